"""``dracpu inspect`` on fake sysfs trees and on this machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dracpu.cli import main
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy, published_devices
from dracpu.core.slices import SliceOptions, build_resource_slices
from dracpu.sim.topologies import FIXTURES, build_topology, write_sysfs

K8S_VERSION = "1.37"  # as tests/core/test_slices.py: newest schema kubernetes-validate ships
NODE = "worker-1"


def expected_slices(
    fixture: str, mode: str, group_by: str, reserved: str = ""
) -> list[dict[str, Any]]:
    devices = published_devices(
        build_topology(FIXTURES[fixture]),
        reserved=CpuSet.parse(reserved),
        mode=CpuDeviceMode(mode),
        group_by=GroupBy(group_by),
    )
    return build_resource_slices(NODE, devices)


# A 1024-CPU tree is ~20k small files: on tmpfs it is written in half a second, on a busy disk it
# can take half a minute.
TMPFS = Path("/dev/shm")


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Every fixture machine written once as a host root (on tmpfs when there is one)."""
    on_tmpfs = TMPFS.is_dir() and os.access(TMPFS, os.W_OK)
    base = Path(tempfile.mkdtemp(prefix="dracpu-inspect-", dir=TMPFS)) if on_tmpfs else None
    made: dict[str, Path] = {}
    try:
        for name, spec in FIXTURES.items():
            root = base / name if base is not None else tmp_path_factory.mktemp(name)
            write_sysfs(spec, root)
            made[name] = root
        yield made
    finally:
        if base is not None:
            shutil.rmtree(base)


def inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["inspect", "--node-name", NODE, *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
@pytest.mark.parametrize(
    ("mode", "group_by", "reserved"),
    [("individual", "numanode", "0"), ("grouped", "numanode", ""), ("grouped", "socket", "0")],
)
def test_json_is_exactly_the_slices_of_the_fixture(
    capsys: pytest.CaptureFixture[str],
    roots: dict[str, Path],
    fixture: str,
    mode: str,
    group_by: str,
    reserved: str,
) -> None:
    args = ["--host-root", str(roots[fixture]), "--cpu-device-mode", mode, "--group-by", group_by]
    if reserved:
        args += ["--reserved-cpus", reserved]
    code, out, err = inspect(capsys, *args, "-o", "json")
    assert (code, err) == (0, "")
    slices = json.loads(out)
    assert slices == expected_slices(fixture, mode, group_by, reserved)
    kubernetes_validate.validate(slices[-1], K8S_VERSION, strict=True)


@pytest.mark.parametrize("fixture", ["dual-socket-smt2", "arm64-server", "big-1024"])
@pytest.mark.parametrize("mode", ["individual", "grouped"])
def test_pcie_roots_and_node_allocatable_mapping(
    capsys: pytest.CaptureFixture[str], roots: dict[str, Path], fixture: str, mode: str
) -> None:
    args = ["--host-root", str(roots[fixture]), "--cpu-device-mode", mode]
    flags = ["--expose-pcie-roots", "--publish-node-allocatable-resource-mapping"]
    code, out, err = inspect(capsys, *args, *flags, "-o", "json")
    assert (code, err) == (0, "")
    slices = json.loads(out)
    devices = published_devices(
        build_topology(FIXTURES[fixture], pcie_roots=True),
        reserved=CpuSet(),
        mode=CpuDeviceMode(mode),
        group_by=GroupBy.NUMANODE,
    )
    options = SliceOptions(node_allocatable=True, expose_pcie_roots=True)
    assert slices == build_resource_slices(NODE, devices, options=options)
    first = slices[0]["spec"]["devices"][0]
    assert "strings" in first["attributes"]["resource.kubernetes.io/pcieRoot"]
    assert "mapping" in first["nodeAllocatableResources"]["cpu"]
    assert all(len(s["spec"]["devices"]) <= 64 for s in slices)
    kubernetes_validate.validate(slices[0], K8S_VERSION, strict=True)
    code, out, err = inspect(capsys, *args, *flags)
    assert (code, err) == (0, "")
    assert "    pcie roots: " in out


def test_yaml_is_one_document_per_slice(
    capsys: pytest.CaptureFixture[str], roots: dict[str, Path]
) -> None:
    code, out, err = inspect(
        capsys,
        "--host-root",
        str(roots["big-1024"]),
        "--cpu-device-mode",
        "individual",
        "--reserved-cpus",
        "0,512",
        "-o",
        "yaml",
    )
    assert (code, err) == (0, "")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    documents = list(yaml.load_all(out, Loader=loader))
    assert documents == expected_slices("big-1024", "individual", "numanode", "0,512")
    assert len(documents) == 8
    assert out.count("\n---\n") == 7


def test_text_map_of_a_small_machine(
    capsys: pytest.CaptureFixture[str], roots: dict[str, Path]
) -> None:
    code, out, err = inspect(
        capsys, "--host-root", str(roots["offline-isolated"]), "--reserved-cpus", "0,8"
    )
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert "cpus: 13 online (0-4,6-13), 3 offline; smt on, 2 threads/core" in lines
    assert "reserved: 0,8   isolated: 2,7,10" in lines
    assert "  numa 0: cpus 0-3,8-11  -> cpudevnuma000 (dra.cpu/cpu=6)" in lines
    assert "      0R,8R   1,9     2I,10I  3,11" in lines
    assert "offline: cpus 5,14-15 (no topology while offline)" in lines
    assert "  worker-1-dra.cpu-000: cpudevnuma000..cpudevnuma001 (2 devices)" in lines


def test_the_external_allocators_attributes_are_shown(
    capsys: pytest.CaptureFixture[str], roots: dict[str, Path]
) -> None:
    root = str(roots["offline-isolated"])
    code, out, err = inspect(capsys, "--host-root", root, "--allocator", "external")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert any(
        line.startswith("  cpudevnuma000") and line.endswith("dra.cpu/cpuIDs=0-3,8-11")
        for line in lines
    ), lines
    layout = [line for line in lines if line.startswith("  dra.cpu/smtLayout=")]
    assert len(layout) == 1
    assert layout[0].endswith(" (node-wide, on every device)")
    code, out, err = inspect(capsys, "--host-root", root, "--allocator", "external", "-o", "json")
    devices = [d for s in json.loads(out) for d in s["spec"]["devices"]]
    assert {d["attributes"]["dra.cpu/cpuIDs"]["string"] for d in devices} >= {"0-3,8-11"}
    # a node upstream refuses: SMT-4 cores; the attribute is left out, and said on stderr
    smt4 = str(roots["smt4"])
    code, out, err = inspect(capsys, "--host-root", smt4, "--allocator", "external", "-o", "json")
    assert code == 0
    assert err.startswith("dracpu inspect: warning: dra.cpu/smtLayout is not published: ")
    devices = [d for s in json.loads(out) for d in s["spec"]["devices"]]
    assert all("dra.cpu/smtLayout" not in d["attributes"] for d in devices)
    assert all("dra.cpu/cpuIDs" in d["attributes"] for d in devices)


def test_text_map_of_1024_cpus_stays_short(
    capsys: pytest.CaptureFixture[str], roots: dict[str, Path]
) -> None:
    code, out, err = inspect(
        capsys, "--host-root", str(roots["big-1024"]), "--cpu-device-mode", "individual"
    )
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert len(lines) < 150
    assert max(map(len, lines)) <= 100
    assert "  worker-1-dra.cpu-007: cpudev896..cpudev1023 (128 devices)" in lines


def test_bad_mode_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["inspect", "--cpu-device-mode", "bogus"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert "bogus" in err


def test_backwards_cpu_range_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["inspect", "--reserved-cpus", "9-2"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert "9-2" in err


def test_missing_core_id_exits_2_naming_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = "sys/devices/system/cpu/cpu3/topology/core_id"
    write_sysfs(FIXTURES["dual-socket-smt2"], tmp_path, omit=[missing])
    code, out, err = inspect(capsys, "--host-root", str(tmp_path))
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1
    assert "cpu3/topology/core_id" in err


def test_subprocess_errors_are_one_line_and_exit_2(tmp_path: Path) -> None:
    write_sysfs(
        FIXTURES["vm-2cpu"], tmp_path, omit=["sys/devices/system/cpu/cpu1/topology/core_id"]
    )
    for args in (
        ["--cpu-device-mode", "bogus"],
        ["--reserved-cpus", "9-2"],
        ["--host-root", str(tmp_path)],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "dracpu", "inspect", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2, args
        assert done.stdout == ""
        assert len(done.stderr.splitlines()) == 1, done.stderr
        assert done.stderr.startswith("dracpu inspect: error: ")


def test_inspect_this_machine() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dracpu", "inspect", "--host-root", "/", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    slices = json.loads(done.stdout)
    assert slices
    for obj in slices:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    text = subprocess.run(
        [sys.executable, "-m", "dracpu", "inspect", "--host-root", "/"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("cpus: ")


def test_invalid_node_name_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], roots: dict[str, Path]
) -> None:
    code = main(["inspect", "--host-root", str(roots["vm-2cpu"]), "--node-name", "Bad_Node"])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1
    assert "Bad_Node" in err
