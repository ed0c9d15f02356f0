"""Upstream's Helm chart, unchanged, with dracpu's image: the driver starts, serves and pins.

kubernetes-sigs/dra-driver-cpu's chart (``deployment/helm/dra-driver-cpu/templates/
daemonset.yaml``) runs the image's ``/dracpu`` with ``--v=<logLevel> --bind-address=:<port>
--expose-pcie-roots=<bool>``, adds ``--kubelet-root-dir=<root>`` when the root is not the
default and ``--config=/etc/dracpu/config.yaml`` when it renders a driver config, sets no node
name (the hostname is used) and no kubeconfig (in-cluster service account), and mounts neither a
state directory nor sysfs. :mod:`tests.integration.chart_scenario` builds exactly that in a
private mount namespace and walks one claim through; here we check what it saw.

The same runs on a built image (``just image``) when ``DRACPU_TEST_IMAGE`` names it (e.g.
``DRACPU_TEST_IMAGE=dracpu:dev``): podman runs the image's own ``/dracpu`` as the chart's pod.
Building needs the network and a pullable base, so CI runs the layout instead (the image's
links to the installed command, below); docs/image.md has the measured runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DRACPU = Path(sys.executable).parent / "dracpu"  # the installed command (the image's /dracpu)
IMAGE = os.environ.get("DRACPU_TEST_IMAGE", "")  # an image built by `just image`
# The driver config of upstream's chart (`driverConfig` values, rendered into the ConfigMap).
CONFIG = 'apiVersion: v1alpha1\ncpuDeviceMode: grouped\ngroupBy: socket\nreservedCPUs: "0"\n'


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a private mount namespace for the chart's fixed paths)"
    for tool in ("unshare", "mount", "setpriv", "openssl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not DRACPU.exists():
        return f"the dracpu command is not installed at {DRACPU}"
    return None


def _missing_image() -> str | None:
    if not IMAGE:
        return "DRACPU_TEST_IMAGE is not set (build one with `just image`, then name it there)"
    if os.geteuid() != 0:
        return "needs root (podman with the host's network and bind mounts)"
    for tool in ("podman", "openssl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    exists = subprocess.run(["podman", "image", "exists", IMAGE], capture_output=True, check=False)
    if exists.returncode != 0:
        return f"podman has no image {IMAGE}"
    return None


def _layout(tmp_path: Path) -> Path:
    """The image's entry points: /dracpu and /dracpu-gatherinfo link to the installed command
    (Containerfile: ln -s /opt/dracpu/bin/dracpu /dracpu)."""
    layout = tmp_path / "layout"
    layout.mkdir()
    for name in ("dracpu", "dracpu-gatherinfo"):
        (layout / name).symlink_to(DRACPU)
    return layout


def _run(tmp_path: Path, **params: Any) -> dict[str, Any]:
    reason = _missing_image() if params.get("image") else _missing()
    if reason is not None:
        pytest.skip(reason)
    params = {
        "base": str(tmp_path),
        "log_level": 4,
        "expose_pcie_roots": False,
        "no_capabilities": True,
        **params,
    }
    scenario = [sys.executable, "-m", "tests.integration.chart_scenario", json.dumps(params)]
    if not params.get("image"):
        params["layout"] = str(_layout(tmp_path))
        scenario[-1] = json.dumps(params)
        namespaces = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork",
                      "--mount-proc"]  # fmt: skip
        scenario = [*namespaces, *scenario]
    result = subprocess.run(scenario, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    seen: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return seen


def _check_the_node(seen: dict[str, Any], port_arg: str, devices: list[str]) -> dict[str, Any]:
    log = "\n".join(seen["log"])
    assert seen["readyz"][0] == 200, log[-3000:]
    assert seen["healthz"] == [200, "ok\n"]
    assert seen["devices"] == devices
    assert seen["prepare_error"] == ""
    assert seen["cdi_cpus"] == seen["container_cpus"]
    assert len(_cpus(seen["cdi_cpus"])) == 4
    assert seen["unprepare_error"] == ""
    assert seen["exit"] == 0, log[-3000:]
    # The chart mounts no state directory: the daemon says what that costs, once.
    assert log.count("does not outlive this pod") == 1
    assert "deprecated" not in log  # the chart passes no deprecated flag
    # Root without a single capability (the hardened DaemonSet drops them all) was enough.
    assert seen["capabilities"] == {
        "CapPrm": "0000000000000000",
        "CapEff": "0000000000000000",
        "CapBnd": "0000000000000000",
    }
    metrics = set(seen["metrics"])
    assert {
        "dra_cpu_allocated_cpus 4.0",
        "dra_cpu_resource_claims_active 1.0",
        'dra_cpu_prepare_claims_total{result="success"} 1.0',
        'dra_cpu_prepare_claims_total{result="error"} 0.0',
        "dra_cpu_claim_allocated_cpus_count 1.0",
    } <= metrics, sorted(metrics)
    gather = seen["gatherinfo"]
    assert gather["rc"] == 0, gather["err"]
    assert gather["out"].startswith("---\n")
    report: dict[str, Any] = yaml.safe_load(gather["out"])
    assert report["layoutVersion"] == "v1"
    assert report["driverConfig"]["bindAddress"] == port_arg
    assert report["cpuDetails"]["topology"]["numCPUs"] == 64
    claims = report["dracpu"]["checkpoint"]["claims"]
    assert [(c["uid"], c["cpus"]) for c in claims] == [(seen["claim"], seen["cdi_cpus"])]
    assert report["dracpu"]["cdiSpecs"] == {seen["claim"]: seen["cdi_cpus"]}
    dump = report["dracpu"]["debugDump"]
    pinned = {c["id"]: c["cpus"] for c in dump["containers"]}
    assert pinned[seen["container"]] == seen["cdi_cpus"]
    assert any("prepared claim default/chart" in line for line in dump["recentLog"])
    return report


def _cpus(text: str) -> set[int]:
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def _check_the_chart_run(seen: dict[str, Any], root: str, config: str | None) -> None:
    """The chart's arguments were passed verbatim and the node worked under them."""
    port = seen["args"][2].removeprefix("--bind-address=")
    assert seen["args"] == [
        "/dracpu",
        "--v=4",
        f"--bind-address={port}",
        "--expose-pcie-roots=false",
        *([f"--kubelet-root-dir={root}"] if root != "/var/lib/kubelet" else []),
        *(["--config=/etc/dracpu/config.yaml"] if config else []),
    ]
    devices = ["cpudevsocket000", "cpudevsocket001"] if config else None
    report = _check_the_node(seen, port, devices or [f"cpudevnuma00{n}" for n in range(4)])
    assert report["driverConfig"]["kubeletRootDir"] == root
    assert report["driverConfig"]["groupBy"] == ("socket" if config else "numanode")
    assert report["driverConfig"].get("reservedCPUs", "") == ("0" if config else "")


@pytest.mark.parametrize(
    "root", ["/var/lib/kubelet", "/var/lib/k8s/kubelet"], ids=["root", "other-root"]
)
@pytest.mark.parametrize("config", [None, CONFIG], ids=["no-config", "config"])
def test_the_charts_arguments(tmp_path: Path, root: str, config: str | None) -> None:
    # The chart passes --kubelet-root-dir only for a root other than the default, --config only
    # when it renders a driver config; gatherinfo is run under both of upstream's names.
    gatherinfo = "subcommand" if (config is None) == (root == "/var/lib/kubelet") else "alias"
    seen = _run(tmp_path, kubelet_root_dir=root, config=config, gatherinfo=gatherinfo)
    _check_the_chart_run(seen, root, config)


# Upstream 0.3's values for an external allocator (docs/user/upgrade.md "Configuration: grouped
# mode", docs/user/configuration.md `allocator`): `driverConfig` rendered into the ConfigMap.
EXTERNAL_NUMANODE = (
    "apiVersion: v1alpha1\ncpuDeviceMode: grouped\ngroupBy: numanode\nallocator: external\n"
)
EXTERNAL_MACHINE = "cpuDeviceMode: grouped\ngroupBy: machine\nallocator: external\n"


@pytest.mark.parametrize(
    ("config", "devices"),
    [
        (EXTERNAL_NUMANODE, [f"cpudevnuma00{n}" for n in range(4)]),
        (EXTERNAL_MACHINE, ["cpudevmachine"]),
    ],
    ids=["numanode", "machine"],
)
def test_upstream_0_3_external_allocator_values(
    tmp_path: Path, config: str, devices: list[str]
) -> None:
    # The scheduler plugin chose CPUs 4-7 (on cpudevnuma000, and on the machine's device).
    seen = _run(
        tmp_path,
        kubelet_root_dir="/var/lib/kubelet",
        config=config,
        gatherinfo="subcommand",
        cpuset="4-7",
    )
    port = seen["args"][2].removeprefix("--bind-address=")
    report = _check_the_node(seen, port, devices)
    assert seen["cdi_cpus"] == "4-7"
    assert report["driverConfig"]["allocator"] == "external"
    for attributes in seen["attributes"].values():
        # dual-socket-smt2: cpuN and cpuN+32 are siblings
        assert attributes["dra.cpu/smtLayout"] == {"string": "0-63>32"}
        assert "string" in attributes["dra.cpu/cpuIDs"]
    assert seen["attributes"][devices[0]]["dra.cpu/cpuIDs"]["string"] == (
        "0-7,32-39" if len(devices) > 1 else "0-63"
    )
    assert "upstream 0.3 refuses" not in "\n".join(seen["log"])


@pytest.mark.parametrize("config", [None, CONFIG], ids=["no-config", "config"])
def test_the_charts_arguments_on_the_built_image(config: str | None) -> None:
    reason = _missing_image()
    if reason is not None:
        pytest.skip(reason)
    # The kubelet root is a directory of the test, at the same path in the container and here
    # (the chart passes --kubelet-root-dir for any root but the default); a short one, for the
    # 107-byte limit of the socket paths under it.
    base = Path(tempfile.mkdtemp(prefix="dracpu-chart-", dir="/tmp"))
    root = str(base / "node" / "kubelet")
    try:
        seen = _run(
            base,
            image=IMAGE,
            container=base.name,
            kubelet_root_dir=root,
            config=config,
            gatherinfo="subcommand" if config is None else "alias",
        )
    finally:
        shutil.rmtree(base)
    _check_the_chart_run(seen, root, config)
