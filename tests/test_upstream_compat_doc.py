"""docs/upstream-compatibility.md's table of upstream's flags and config keys is true.

Each row is run: a flag through the command line as ``dracpu [flags]`` parses it, a key through a
config file; the verdict (accepted, deprecated, refused) and, for an accepted row, the setting it
changes are checked. The table must also name every flag and key upstream has.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from dracpu.cli import _build_parser
from dracpu.config import Config, load_config
from dracpu.config.go_flags import go_style_flags
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy
from dracpu.errors import ConfigError
from dracpu.tasks.dra_cpu_metrics import SPECS

DOC = Path(__file__).resolve().parent.parent / "docs" / "upstream-compatibility.md"

# kubernetes-sigs/dra-driver-cpu 0.3: internal/driverconfig/flags.go AddFlags, cmd/dracpu/app.go
# (--config), internal/ctxlog (klog's -v, -vmodule); the Config struct's json keys
# (internal/driverconfig/config.go, with #229's allocator; validate.go) and apiVersion.
UPSTREAM_FLAGS = {
    "--config",
    "--kubeconfig",
    "--bind-address",
    "--expose-pcie-roots",
    "--kubelet-root-dir",
    "--cpu-device-mode",
    "--group-by",
    "--reserved-cpus",
    "--hostname-override",
    "--sysfs-overlay",
    "-v",
    "-vmodule",
}
UPSTREAM_KEYS = {
    "apiVersion",
    "kubeconfig",
    "hostnameOverride",
    "bindAddress",
    "reservedCPUs",
    "cpuDeviceMode",
    "groupBy",
    "exposePCIeRoots",
    "sysfsOverlay",
    "kubeletRootDir",
    "publishNodeAllocatableResourceMapping",
    "allocator",
}


@dataclass(frozen=True)
class Row:
    name: str
    where: str
    example: str
    verdict: str


def _rows() -> list[Row]:
    text = DOC.read_text()
    section = text.split("## Flags and config keys", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].startswith("`"):
            continue
        name, where, example, verdict = (c.strip("`") for c in cells[:4])
        rows.append(Row(name, where, example, verdict))
    return rows


ROWS = _rows()


def test_the_table_names_every_upstream_flag_and_key() -> None:
    assert {r.name for r in ROWS if r.where == "flag"} == UPSTREAM_FLAGS
    assert {r.name for r in ROWS if r.where == "file"} == UPSTREAM_KEYS
    assert {r.verdict for r in ROWS} == {"accepted", "deprecated", "refused"}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text('/sys/devices/system/cpu/smt/control: "off\\n"\n')
    config = tmp_path / "config.yaml"
    config.write_text("groupBy: socket\n")
    return {"OVERLAY": str(overlay), "CONFIG": str(config)}


def _substitute(text: str, files: dict[str, str]) -> str:
    return re.sub(r"\b(OVERLAY|CONFIG)\b", lambda m: files[m[1]], text)


def _load_flags(argv: list[str]) -> Config:
    parser = _build_parser()
    words = ["run", *go_style_flags(argv, parser.get_default("run_flags"))]
    args: argparse.Namespace = parser.parse_args(words)
    return load_config(args, {}, hostname=lambda: "host-a")


# What an accepted row changes: upstream name -> (Config field, value after the example).
MEANING: dict[str, tuple[str, object]] = {
    "--config": ("group_by", GroupBy.SOCKET),
    "--kubeconfig": ("kubeconfig", Path("/etc/kube.conf")),
    "--bind-address": ("bind_address", "8081"),
    "--expose-pcie-roots": ("expose_pcie_roots", False),
    "--kubelet-root-dir": ("kubelet_root_dir", Path("/var/lib/k8s/kubelet")),
    "--cpu-device-mode": ("cpu_device_mode", CpuDeviceMode.INDIVIDUAL),
    "--group-by": ("group_by", GroupBy.SOCKET),
    "--reserved-cpus": ("reserved_cpus", CpuSet.parse("0-1")),
    "--hostname-override": ("node_name", "node-a"),
    "--sysfs-overlay": ("sysfs_overlay", "OVERLAY"),
    "-v": ("verbosity", 4),
    "-vmodule": ("vmodule", (("nri_plugin", 4),)),
    "apiVersion": ("node_name", "host-a"),
    "kubeconfig": ("kubeconfig", Path("/etc/kube.conf")),
    "hostnameOverride": ("node_name", "node-a"),
    "reservedCPUs": ("reserved_cpus", CpuSet.parse("0-1")),
    "cpuDeviceMode": ("cpu_device_mode", CpuDeviceMode.INDIVIDUAL),
    "groupBy": ("group_by", GroupBy.MACHINE),
    "sysfsOverlay": ("sysfs_overlay", "OVERLAY"),
    "publishNodeAllocatableResourceMapping": ("publish_node_allocatable_resource_mapping", False),
    "allocator": ("allocator", ""),  # the example's value
}


def _check_meaning(row: Row, config: Config, files: dict[str, str]) -> None:
    field, expected = MEANING[row.name]
    if isinstance(expected, bool):  # a boolean's rows differ by the example's value
        expected = row.example.rstrip("`").endswith("true")
    value = getattr(config, field)
    if field == "bind_address":
        value = str(value.port)
    if field == "sysfs_overlay":
        expected = Path(files["OVERLAY"])
    if field == "allocator":
        expected = row.example.split(": ", 1)[1]
    assert value == expected, row


@pytest.mark.parametrize("row", [r for r in ROWS if r.where == "flag"], ids=lambda r: r.example)
def test_each_flag_does_what_the_table_says(row: Row, files: dict[str, str]) -> None:
    argv = [_substitute(word, files) for word in row.example.split()]
    if row.verdict == "refused":
        with pytest.raises(ConfigError):
            _load_flags(argv)
        return
    config = _load_flags(argv)
    _check_meaning(row, config, files)
    if row.verdict == "deprecated":
        flag = argv[0].split("=", 1)[0]
        assert len(config.notices) == 1
        assert config.notices[0].startswith(f"flag {flag} is deprecated")
    else:
        assert config.notices == ()


@pytest.mark.parametrize("row", [r for r in ROWS if r.where == "file"], ids=lambda r: r.example)
def test_each_key_does_what_the_table_says(row: Row, files: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "driver-config.yaml"
    path.write_text(_substitute(row.example, files) + "\n")
    if row.verdict == "refused":
        with pytest.raises(ConfigError) as info:
            _load_flags([f"--config={path}"])
        assert row.name in str(info.value)
        return
    assert row.verdict == "accepted"
    _check_meaning(row, _load_flags([f"--config={path}"]), files)


# kubernetes-sigs/dra-driver-cpu 0.3: pkg/metrics/metrics.go descriptors, docs/user/metrics.md.
UPSTREAM_METRICS = {
    "dra_cpu_allocated_cpus",
    "dra_cpu_available_cpus",
    "dra_cpu_reserved_cpus",
    "dra_cpu_resource_claims_active",
    "dra_cpu_prepare_claims_total",
    "dra_cpu_unprepare_claims_total",
    "dra_cpu_prepare_claim_duration_seconds",
    "dra_cpu_unprepare_claim_duration_seconds",
    "dra_cpu_claim_allocated_cpus",
}


def test_the_metrics_table_names_every_upstream_metric_and_we_export_them() -> None:
    section = DOC.read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    named = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`dra_cpu_"):
            named.add(cells[0].strip("`").split("{", 1)[0])
    assert named == UPSTREAM_METRICS
    assert {spec.name for spec in SPECS} == UPSTREAM_METRICS
