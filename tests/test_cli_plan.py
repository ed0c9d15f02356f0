"""``dracpu plan``: what a grouped claim of N CPUs would get, read from a fake sysfs tree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dracpu.cli import main
from dracpu.core.cpuset import CpuSet
from dracpu.sim.topologies import FIXTURES, build_topology, write_sysfs


@pytest.fixture
def dual_socket(tmp_path: Path) -> Path:
    """A host root whose sysfs is the dual-socket-smt2 machine (64 CPUs, siblings +32)."""
    write_sysfs(FIXTURES["dual-socket-smt2"], tmp_path)
    return tmp_path


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_eight_cpus_are_four_whole_cores_in_one_l3_in_one_numa_node(
    dual_socket: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = plan(capsys, "--cpus", "8", "--host-root", str(dual_socket), "-o", "json")
    assert (code, err) == (0, "")
    result = json.loads(out)
    topology = build_topology(FIXTURES["dual-socket-smt2"])
    cpus = CpuSet.parse(result["cpus"])
    assert result["count"] == len(cpus) == 8
    assert len(result["cores"]) == 4
    for core in result["cores"]:
        chosen = CpuSet.parse(core)
        assert chosen == topology.siblings(chosen.min())  # the whole core, both threads
    assert len(result["l3Caches"]) == 1
    assert len(result["numaNodes"]) == 1
    assert cpus <= topology.l3_caches[result["l3Caches"][0]]
    assert result == {
        "cpus": "0-3,32-35",
        "count": 8,
        "numaNodes": [0],
        "sockets": [0],
        "l3Caches": [0],
        "cores": ["0,32", "1,33", "2,34", "3,35"],
    }


def test_text_output(dual_socket: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan(capsys, "--cpus", "3", "--host-root", str(dual_socket))
    assert code == 0
    assert out == ("cpus: 0-1,32\nnuma nodes: [0]  l3 caches: [0]  cores: 2 (0,32 1)\n")


def test_unsatisfiable_exits_1_with_a_clear_message(
    dual_socket: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = plan(capsys, "--cpus", "65", "--host-root", str(dual_socket), "-o", "json")
    assert code == 1
    assert out == ""
    assert err == "dracpu plan: cannot allocate 65 CPUs: only 64 free (0-63)\n"


def test_reserved_and_available_narrow_the_choice(
    dual_socket: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(dual_socket)
    code, out, _ = plan(
        capsys, "--cpus", "2", "--host-root", root, "--reserved-cpus", "0-15,32-47", "-o", "json"
    )
    assert code == 0
    assert json.loads(out)["cpus"] == "16,48"  # socket 1's first core; core_id repeats there
    code, out, err = plan(
        capsys, "--cpus", "4", "--host-root", root, "--available", "0-7", "--reserved-cpus", "0-4"
    )
    assert code == 1
    assert "cannot allocate 4 CPUs: only 3 free (5-7)" in err


def test_spread_and_full_cores(dual_socket: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(dual_socket)
    code, out, _ = plan(
        capsys, "--cpus", "4", "--host-root", root, "--policy", "spread", "-o", "json"
    )
    assert code == 0
    assert json.loads(out)["cores"] == ["0", "1", "2", "3"]
    # cpu2 is free but its sibling 34 is not: whole cores only means 0/32 and 1/33
    available = ["--available", "0-2,32-33"]
    code, out, _ = plan(capsys, "--cpus", "4", "--host-root", root, "--full-cores", *available)
    assert code == 0
    assert out.startswith("cpus: 0-1,32-33\n")
    available = ["--available", "0-2,32"]  # 4 CPUs free, but only one whole core
    code, out, err = plan(capsys, "--cpus", "4", "--host-root", root, "--full-cores", *available)
    assert code == 1
    assert "4 CPUs as whole cores: only 2 CPUs in fully free cores (0,32)" in err


@pytest.mark.parametrize("count", ["0", "-2"])
def test_an_invalid_count_is_bad_input(
    dual_socket: Path, capsys: pytest.CaptureFixture[str], count: str
) -> None:
    code, out, err = plan(capsys, "--cpus", count, "--host-root", str(dual_socket))
    assert code == 2
    assert out == ""
    assert err == f"dracpu plan: error: invalid CPU count {count}: --cpus must be at least 1\n"


def test_a_count_no_whole_cores_make_cannot_be_met(
    dual_socket: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # As documented: exit 1 when the request cannot be met (issue 20: it was 2, bad input).
    code, out, err = plan(capsys, "--cpus", "3", "--full-cores", "--host-root", str(dual_socket))
    assert (code, out) == (1, "")
    assert err == (
        "dracpu plan: cannot allocate 3 CPUs as whole cores: the count must be a multiple of "
        "the SMT width 2\n"
    )


def test_reserved_cpus_the_node_does_not_have_are_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_sysfs(FIXTURES["vm-2cpu"], tmp_path)
    for command in ("plan", "inspect"):
        extra = ["--cpus", "1"] if command == "plan" else []
        assert main([command, "--host-root", str(tmp_path), "--reserved-cpus", "1,5", *extra]) == 0
        _, err = capsys.readouterr()
        assert err == (
            f"dracpu {command}: warning: --reserved-cpus 1,5: cpus 5 are not online on this "
            "node (online: 0-1); they reserve nothing\n"
        )
