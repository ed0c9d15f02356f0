"""The manifests in deploy/ are valid Kubernetes objects, hardened, and agree with the code.

The base and the kind overlay are rendered by the real ``kubectl kustomize`` (the dev lock's
kubectl, :mod:`tests.kustomize`) and the output passes ``kubernetes-validate --strict`` (unknown
fields refused) against the newest Kubernetes schemas it ships.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import dracpu
from dracpu import DRIVER_NAME
from dracpu.adapters.host_cgroups import cgroup_root
from dracpu.adapters.kube import KubeClient
from dracpu.cli import _build_parser
from dracpu.config import load_config
from dracpu.config.go_flags import go_style_flags
from tests.kustomize import build, render

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kustomize"
TREES = {
    "base": DEPLOY / "base",
    "kind": DEPLOY / "overlays" / "kind",
    "local": DEPLOY / "overlays" / "local",
    "host-cgroups": DEPLOY / "overlays" / "host-cgroups",
}
# The Kubernetes version whose schemas we validate against: the newest kubernetes-validate ships.
K8S_VERSION = kubernetes_validate.latest_version()


def _render(tree: str) -> list[dict[str, Any]]:
    return build(TREES[tree])


def _one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj


def test_every_listed_file_exists_and_nothing_is_left_out() -> None:
    kustomization = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in (DEPLOY / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


@pytest.mark.parametrize("tree", list(TREES))
def test_kubectl_kustomize_passes_kubernetes_validate_strict(tree: str, tmp_path: Path) -> None:
    rendered = tmp_path / f"{tree}.yaml"
    rendered.write_text(render(TREES[tree]))
    objects = [o for o in yaml.safe_load_all(rendered.read_text()) if o]
    assert {o["kind"] for o in objects} >= {"DaemonSet", "ClusterRole", "ConfigMap"}
    validator = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run(
        [str(validator), "--strict", "-k", K8S_VERSION, str(rendered)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # One "passed" line per object: a document it could not check would not say so.
    passed = [line for line in result.stdout.splitlines() if " passed for resource " in line]
    assert len(passed) == len(objects), result.stdout


def test_strict_validation_refuses_an_unknown_field(tmp_path: Path) -> None:
    # The check above can fail: a field the schema does not have is an error under --strict.
    objects = build(TREES["kind"])
    daemonset = _one(objects, "DaemonSet")
    daemonset["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(daemonset))
    validator = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run(
        [str(validator), "--strict", "--quiet", "-k", K8S_VERSION, str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "securityContxt" in result.stdout + result.stderr


def test_deviceclass_selects_our_driver() -> None:
    cls = _one(_render("base"), "DeviceClass")
    assert cls["metadata"]["name"] == DRIVER_NAME
    assert cls["spec"]["selectors"] == [
        {"cel": {"expression": f'device.driver == "{DRIVER_NAME}"'}}
    ]


@pytest.mark.parametrize(
    ("tree", "reserved", "cgroups"),
    [
        ("base", "", ()),
        ("kind", "0", ()),
        ("local", "", ()),
        ("host-cgroups", "", ("system.slice",)),
    ],
)
def test_the_daemonsets_command_and_config_are_accepted_by_the_cli(
    tree: str, reserved: str, cgroups: tuple[str, ...], tmp_path: Path
) -> None:
    objects = _render(tree)
    container = _one(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    command: list[str] = container["command"] + container.get("args", [])
    assert command[0] == "/dracpu"  # the image's entry point (Containerfile)
    # The ConfigMap's file, where the pod mounts it.
    config_file = tmp_path / "config.yaml"
    config_file.write_text(_one(objects, "ConfigMap")["data"]["config.yaml"])
    argv = [a.replace("/etc/dracpu/config.yaml", str(config_file)) for a in command[1:]]
    parser = _build_parser()
    assert argv[0] == "run"
    args = parser.parse_args(["run", *go_style_flags(argv[1:], parser.get_default("run_flags"))])
    # The pod's environment as the DaemonSet sets it (NODE_NAME from spec.nodeName).
    config = load_config(args, {"NODE_NAME": "node-a", "HOST_ROOT": "/host"})
    assert (config.node_name, config.node_name_source) == (
        "node-a",
        "environment variable NODE_NAME",
    )
    assert config.host_root == Path("/host")
    assert str(config.reserved_cpus) == reserved
    assert config.confine_host_cgroups == cgroups
    assert config.notices == ()  # no deprecated flag in our own manifests


@pytest.mark.parametrize("tree", list(TREES))
def test_the_daemonset_is_hardened(tree: str) -> None:
    pod = _one(_render(tree), "DaemonSet")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    for key in ("hostPID", "hostIPC"):
        assert not pod.get(key), key
    # Only the local cluster's overlay, which has no pod network, runs on the host's; there
    # the daemon serves on loopback alone.
    if pod.get("hostNetwork"):
        assert tree == "local"
        assert "--bind-address=127.0.0.1:8080" in container["args"]
    assert all(v.get("hostPath", {}).get("path") != "/" for v in pod["volumes"])


def test_the_daemonset_mounts_the_paths_the_daemon_uses() -> None:
    pod = _one(_render("base"), "DaemonSet")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    # The daemon's defaults: kubelet root, CDI dir, NRI socket dir, state dir, sysfs under
    # HOST_ROOT, and its config file.
    assert {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins",
        "/var/lib/kubelet/pod-resources",
        "/var/run/cdi",
        "/var/run/nri",
        "/var/lib/dracpu",
        "/host/sys",
        "/etc/dracpu",
    } <= set(mounts)
    # The checkpoint must outlive the pod: the state directory is the node's.
    assert volumes[mounts["/var/lib/dracpu"]]["hostPath"]["path"] == "/var/lib/dracpu"
    assert volumes[mounts["/etc/dracpu"]]["configMap"]["name"] == "dracpu-config"
    env = {e["name"]: e for e in container["env"]}
    assert env["HOST_ROOT"]["value"] == "/host"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_only_the_host_cgroups_overlay_mounts_the_cgroup_fs_and_writable() -> None:
    def cgroup_mounts(tree: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        pod = _one(_render(tree), "DaemonSet")["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        return [
            (mount, volumes[mount["name"]])
            for mount in pod["containers"][0]["volumeMounts"]
            if "cgroup" in mount["mountPath"]
        ]

    assert cgroup_mounts("base") == cgroup_mounts("kind") == cgroup_mounts("local") == []
    ((mount, volume),) = cgroup_mounts("host-cgroups")
    # where the daemon looks (adapters.host_cgroups.cgroup_root of HOST_ROOT), not read-only
    assert mount["mountPath"] == str(cgroup_root(Path("/host")))
    assert not mount.get("readOnly", False)
    assert volume["hostPath"] == {"path": "/sys/fs/cgroup", "type": "Directory"}


# What each request of the API adapter needs (the only API client is adapters/kube.py): the
# ClusterRole grants exactly the union over the methods the daemon calls. A status PATCH that
# changes status.devices is also authorized as `associated-node:patch` on resourceclaims/driver
# named after the driver (Kubernetes 1.36+, DRAResourceClaimGranularStatusAuthorization: the
# request's own verb, for a claim allocated on the service account's node).
Grant = tuple[str, str, str, tuple[str, ...]]
GRANTS: dict[str, set[Grant]] = {
    "get_node": {("", "nodes", "get", ())},
    "get_resource_claim": {("resource.k8s.io", "resourceclaims", "get", ())},
    "patch_resource_claim_status": {
        ("resource.k8s.io", "resourceclaims/status", "patch", ()),
        ("resource.k8s.io", "resourceclaims/driver", "associated-node:patch", (DRIVER_NAME,)),
    },
    "list_resource_slices": {("resource.k8s.io", "resourceslices", "list", ())},
    "create_resource_slice": {("resource.k8s.io", "resourceslices", "create", ())},
    "update_resource_slice": {("resource.k8s.io", "resourceslices", "update", ())},
    "delete_resource_slice": {("resource.k8s.io", "resourceslices", "delete", ())},
    "watch_resource_slices": {
        ("resource.k8s.io", "resourceslices", "list", ()),
        ("resource.k8s.io", "resourceslices", "watch", ()),
    },
}


def _requests_the_daemon_makes() -> set[str]:
    """The adapter's request methods called anywhere in the daemon's code (not the simulator)."""
    src = Path(dracpu.__file__).parent
    called: set[str] = set()
    for path in src.rglob("*.py"):
        relative = path.relative_to(src).as_posix()
        if relative.startswith("sim/") or relative == "adapters/kube.py":
            continue
        text = path.read_text()
        called |= {name for name in GRANTS if re.search(rf"\.{name}\(", text)}
    return called


def test_rbac_grants_what_the_code_uses_and_nothing_more() -> None:
    requests = {
        name
        for name, member in vars(KubeClient).items()
        if not name.startswith("_")
        and (inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member))
    }
    assert requests == set(GRANTS), "a request method of KubeClient without its RBAC in GRANTS"
    used = _requests_the_daemon_makes()
    assert {"get_node", "patch_resource_claim_status", "watch_resource_slices"} <= used
    role = _one(_render("base"), "ClusterRole")
    granted = {
        (group, resource, verb, tuple(rule.get("resourceNames", ())))
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == set().union(*(GRANTS[name] for name in used))
    # Upstream's chart also grants pods get/list/watch and deviceclasses get: nothing of ours
    # reads either (no request method of the adapter names them).
    assert not {g for g in granted if g[1] in {"pods", "deviceclasses"}}
