"""Machine descriptions: the model they build, the files they write, the specs they refuse."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from dracpu.core.cpuset import CpuSet
from dracpu.core.topology import CoreType
from dracpu.errors import ConfigError
from dracpu.sim.topologies import (
    FIXTURES,
    MachineSpec,
    PciRoot,
    build_topology,
    fixture,
    write_sysfs,
)

CPU = "sys/devices/system/cpu"
NODE = "sys/devices/system/node"


def cs(text: str) -> CpuSet:
    return CpuSet.parse(text)


def read(root: Path, rel: str) -> str:
    return (root / rel).read_text()


# --- the named machines --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cpus", "online"),
    [
        ("dual-socket-smt2", 64, 64),
        ("hybrid-desktop", 24, 24),
        ("arm64-server", 32, 32),
        ("smt4", 64, 64),
        ("vm-2cpu", 2, 2),
        ("offline-isolated", 16, 13),
        ("knl-smt4", 64, 64),
        ("no-numa-node", 16, 16),
        ("big-1024", 1024, 1024),
    ],
)
def test_fixture_sizes(name: str, cpus: int, online: int) -> None:
    spec = FIXTURES[name]
    assert spec.cpu_count == cpus
    assert len(build_topology(spec).online) == online
    assert spec.description


def test_fixture_lookup() -> None:
    assert fixture("smt4") is FIXTURES["smt4"]
    with pytest.raises(ConfigError, match=r"unknown topology 'smt8'.*dual-socket-smt2"):
        fixture("smt8")


# --- the model ----------------------------------------------------------------------------------


def test_linux_numbering_puts_siblings_ncores_apart() -> None:
    topo = build_topology(MachineSpec(sockets=2, cores_per_cluster=3, threads_per_core=2))
    assert topo.siblings(0) == cs("0,6")
    assert topo.siblings(4) == cs("4,10")
    assert topo.sockets == {0: cs("0-2,6-8"), 1: cs("3-5,9-11")}


def test_adjacent_numbering_keeps_threads_together() -> None:
    spec = MachineSpec(sockets=2, cores_per_cluster=3, threads_per_core=2, cpu_numbering="adjacent")
    topo = build_topology(spec)
    assert topo.siblings(0) == cs("0-1")
    assert topo.siblings(7) == cs("6-7")
    assert topo.sockets == {0: cs("0-5"), 1: cs("6-11")}


@pytest.mark.parametrize(
    ("scheme", "core_ids"),
    [
        ("per-socket", [0, 2, 4, 6, 0, 2, 4, 6]),
        ("global", [0, 2, 4, 6, 8, 10, 12, 14]),
        ("per-die", [0, 2, 0, 2, 0, 2, 0, 2]),
    ],
)
def test_core_id_schemes(scheme: str, core_ids: list[int]) -> None:
    spec = MachineSpec(
        sockets=2,
        dies_per_socket=2,
        cores_per_cluster=2,
        core_id_scheme=scheme,  # type: ignore[arg-type]
        core_id_step=2,
    )
    topo = build_topology(spec)
    assert [topo.info(cpu).core_id for cpu in range(8)] == core_ids
    assert len(topo.cores) == 8  # whatever the scheme, every core stays distinct


def test_per_cluster_core_ids_and_cluster_ids() -> None:
    spec = MachineSpec(
        sockets=2, clusters_per_l3=2, cores_per_cluster=2, core_id_scheme="per-cluster"
    )
    topo = build_topology(spec)
    assert [topo.info(c).core_id for c in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [topo.info(c).cluster_id for c in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert len(topo.cores) == 8


def test_hybrid_layout_with_a_partial_e_core_module() -> None:
    topo = build_topology(MachineSpec(hybrid=(2, 6), threads_per_core=2, cpu_numbering="adjacent"))
    assert topo.by_core_type(CoreType.P_CORE) == cs("0-3")
    assert topo.by_core_type(CoreType.E_CORE) == cs("4-9")
    assert topo.siblings(1) == cs("0-1")
    clusters = [topo.info(c).cluster_id for c in range(10)]
    assert clusters == [0, 0, 1, 1, 2, 2, 2, 2, 3, 3]  # P-cores alone, E-cores by four


def test_no_clusters_read_as_minus_one() -> None:
    topo = build_topology(FIXTURES["vm-2cpu"])
    assert {info.cluster_id for info in topo.cpus.values()} == {-1}


def test_arm64_l3_named_by_its_lowest_online_cpu() -> None:
    spec = replace(FIXTURES["arm64-server"], offline=cs("0-1,16"))
    topo = build_topology(spec)
    assert topo.l3_caches == {2: cs("2-15"), 17: cs("17-31")}


def test_l3_modes() -> None:
    base = MachineSpec(sockets=2, cores_per_cluster=2)
    assert build_topology(base).l3_caches == {0: cs("0-1"), 1: cs("2-3")}
    assert build_topology(replace(base, l3="shared-cpu-list")).l3_caches == {
        0: cs("0-1"),
        2: cs("2-3"),
    }
    assert build_topology(replace(base, l3="none")).l3_caches == {}


@pytest.mark.parametrize(
    ("control", "threads", "enabled"),
    [("auto", 2, True), ("auto", 1, False), ("off", 2, False), ("on", 1, True), (None, 2, True)],
)
def test_smt_enabled(control: str | None, threads: int, enabled: bool) -> None:
    spec = MachineSpec(cores_per_cluster=2, threads_per_core=threads, smt_control=control)
    assert build_topology(spec).smt_enabled is enabled


def test_offline_siblings_leave_single_thread_cores() -> None:
    spec = MachineSpec(cores_per_cluster=2, threads_per_core=2, offline=cs("2-3"))
    topo = build_topology(spec)
    assert topo.cores == {(0, 0, -1, 0): cs("0"), (0, 0, -1, 1): cs("1")}
    assert topo.offline == cs("2-3")
    # smt/control still says "on": the machine has SMT, some siblings are just offline.
    assert topo.smt_enabled is True


# --- specs refused --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sockets": 0}, "sockets must be at least 1"),
        ({"threads_per_core": 0}, "threads_per_core"),
        ({"core_id_step": 0}, "core_id_step"),
        ({"hybrid": (0, 0)}, "hybrid"),
        ({"hybrid": (2, -1)}, "hybrid"),
        ({"hybrid": (2, 2), "cores_per_cluster": 2}, "hybrid replaces"),
        ({"dies_per_socket": 2, "die_id_file": False}, "die_id"),
        ({"numa_per_die": 2, "numa_sysfs": False}, "devices/system/node"),
        ({"offline": CpuSet([2])}, "beyond cpu1"),
        ({"isolated": CpuSet([9])}, "beyond cpu1"),
        ({"offline": CpuSet([0, 1])}, "every CPU is offline"),
        ({"core_id_scheme": "per-cluster", "l3_per_numa": 2}, "per-cluster"),
        ({"no_numa_node": CpuSet([2])}, "beyond cpu1"),
        ({"no_numa_node": CpuSet([1]), "numa_sysfs": False}, "need devices/system/node"),
        ({"pci_roots": (PciRoot("pci0000:00", 0), PciRoot("pci0000:00", None))}, "unique"),
        ({"pci_roots": (PciRoot("pci10000:00", 0),)}, "pciDDDD:BB"),
    ],
)
def test_bad_specs_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        replace(FIXTURES["vm-2cpu"], **changes)  # type: ignore[arg-type]


# --- the files ---------------------------------------------------------------------------------


def test_written_files(scratch: Path) -> None:
    write_sysfs(FIXTURES["dual-socket-smt2"], scratch)
    assert read(scratch, f"{CPU}/online") == "0-63\n"
    assert read(scratch, f"{CPU}/isolated") == "\n"
    assert read(scratch, f"{CPU}/smt/control") == "on\n"
    assert read(scratch, f"{CPU}/cpu21/topology/core_id") == "5\n"
    assert read(scratch, f"{CPU}/cpu21/topology/physical_package_id") == "1\n"
    assert read(scratch, f"{CPU}/cpu21/topology/thread_siblings_list") == "21,53\n"
    assert read(scratch, f"{CPU}/cpu21/topology/cluster_id") == "65535\n"
    assert read(scratch, f"{CPU}/cpu21/topology/package_cpus_list") == "16-31,48-63\n"
    assert read(scratch, f"{CPU}/cpu21/cache/index3/level") == "3\n"
    assert read(scratch, f"{CPU}/cpu21/cache/index3/id") == "5\n"
    assert read(scratch, f"{CPU}/cpu21/cache/index3/shared_cpu_list") == "20-23,52-55\n"
    assert read(scratch, f"{CPU}/cpu21/cache/index2/level") == "2\n"
    assert read(scratch, f"{NODE}/node2/cpulist") == "16-23,48-55\n"
    assert read(scratch, f"{NODE}/node0/cpumap") == "000000ff,000000ff\n"
    link = scratch / CPU / "cpu21/node2"
    assert link.is_symlink()
    assert os.readlink(link) == "../../node/node2"
    assert link.resolve() == (scratch / NODE / "node2").resolve()
    assert not (scratch / "sys/devices/cpu_atom").exists()


def test_written_offline_cpu(scratch: Path) -> None:
    write_sysfs(FIXTURES["offline-isolated"], scratch)
    assert read(scratch, f"{CPU}/online") == "0-4,6-13\n"
    assert read(scratch, f"{CPU}/offline") == "5,14-15\n"
    assert read(scratch, f"{CPU}/present") == "0-15\n"
    assert read(scratch, f"{CPU}/isolated") == "2,7,10,14\n"
    assert read(scratch, f"{CPU}/cpu5/online") == "0\n"
    assert read(scratch, f"{CPU}/cpu6/online") == "1\n"
    assert not (scratch / CPU / "cpu0/online").exists()  # the boot CPU cannot go offline
    assert not (scratch / CPU / "cpu5/topology").exists()
    assert not (scratch / CPU / "cpu5/cache").exists()
    assert read(scratch, f"{CPU}/cpu13/topology/thread_siblings_list") == "13\n"
    assert read(scratch, f"{NODE}/node1/cpulist") == "4,6-7,12-13\n"


def test_written_hybrid_and_arm64_files(scratch: Path) -> None:
    (scratch / "x86").mkdir()
    (scratch / "arm").mkdir()
    write_sysfs(FIXTURES["hybrid-desktop"], scratch / "x86")
    write_sysfs(FIXTURES["arm64-server"], scratch / "arm")
    assert read(scratch / "x86", "sys/devices/cpu_core/cpus") == "0-15\n"
    assert read(scratch / "x86", "sys/devices/cpu_atom/cpus") == "16-23\n"
    assert read(scratch / "x86", f"{CPU}/cpu17/cache/index2/shared_cpu_list") == "16-19\n"
    assert not (scratch / "arm" / CPU / "cpu0/cache/index3/id").exists()
    assert not (scratch / "arm" / CPU / "cpu0/topology/die_id").exists()
    assert read(scratch / "arm", f"{CPU}/cpu5/topology/cluster_cpus_list") == "4-7\n"
    assert read(scratch / "arm", f"{CPU}/smt/control") == "notsupported\n"


def test_omit_and_override(scratch: Path) -> None:
    write_sysfs(
        FIXTURES["vm-2cpu"],
        scratch,
        omit=[f"{CPU}/cpu1/topology/core_id", f"{CPU}/cpu*/cache", f"{CPU}/smt/control"],
        override={f"{CPU}/online": "garbage\n", f"{CPU}/cpu0/extra": "new\n"},
    )
    assert not (scratch / CPU / "cpu1/topology/core_id").exists()
    assert (scratch / CPU / "cpu1/topology/physical_package_id").exists()
    assert not (scratch / CPU / "cpu0/cache").exists()
    assert not (scratch / CPU / "smt/control").exists()
    assert (scratch / CPU / "smt/active").exists()
    assert read(scratch, f"{CPU}/online") == "garbage\n"
    assert read(scratch, f"{CPU}/cpu0/extra") == "new\n"


def test_omit_applies_to_node_links(scratch: Path) -> None:
    write_sysfs(FIXTURES["vm-2cpu"], scratch, omit=[f"{CPU}/cpu1/node0"])
    assert not os.path.lexists(scratch / CPU / "cpu1/node0")
    assert os.path.islink(scratch / CPU / "cpu0/node0")


def test_no_numa_sysfs_writes_no_node_directory(scratch: Path) -> None:
    write_sysfs(replace(FIXTURES["vm-2cpu"], numa_sysfs=False), scratch)
    assert not (scratch / NODE).exists()
    assert not os.path.lexists(scratch / CPU / "cpu0/node0")


def test_written_pcie_roots(scratch: Path) -> None:
    write_sysfs(FIXTURES["dual-socket-smt2"], scratch)
    bus = "sys/devices/pci0000:5d/pci_bus/0000:5d"
    assert read(scratch, f"{bus}/cpulistaffinity") == "8-15,40-47\n"
    assert read(scratch, f"{bus}/cpuaffinity") == "0000ff00,0000ff00\n"
    everywhere = "sys/devices/pci0001:00/pci_bus/0001:00/cpulistaffinity"
    assert read(scratch, everywhere) == "0-63\n"  # no NUMA node: every online CPU
    assert build_topology(FIXTURES["dual-socket-smt2"]).pcie_roots == {}
    roots = build_topology(FIXTURES["dual-socket-smt2"], pcie_roots=True).pcie_roots
    assert roots["pci0000:5d"] == cs("8-15,40-47")


def test_written_node_that_is_not_online(scratch: Path) -> None:
    write_sysfs(FIXTURES["no-numa-node"], scratch)
    assert read(scratch, f"{NODE}/possible") == "0-1\n"
    assert read(scratch, f"{NODE}/online") == "0\n"
    assert read(scratch, f"{NODE}/node0/cpulist") == "0-3,8-11\n"
    assert not (scratch / NODE / "node1").exists()
    assert not os.path.lexists(scratch / CPU / "cpu4/node1")
    assert os.path.islink(scratch / CPU / "cpu3/node0")
    topo = build_topology(FIXTURES["no-numa-node"])
    assert topo.without_numa_node == cs("4-7,12-15")
    assert topo.info(12).numa_node == -1


def test_refuses_to_write_over_an_existing_tree(scratch: Path) -> None:
    write_sysfs(FIXTURES["vm-2cpu"], scratch)
    with pytest.raises(ConfigError, match="already exists"):
        write_sysfs(FIXTURES["vm-2cpu"], scratch)
