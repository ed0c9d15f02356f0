"""The pure topology model: indexes, siblings, core identity, NUMA nodes, PCIe roots."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dracpu.core.cpuset import CpuSet
from dracpu.core.topology import NO_NUMA_NODE, CoreType, CpuInfo, Topology
from dracpu.errors import TopologyError


def cs(text: str) -> CpuSet:
    return CpuSet.parse(text)


def two_socket_smt2() -> Topology:
    """2 sockets x 2 cores x SMT2, core_id 0 and 1 on *each* socket, siblings +4.

    socket 0: core_id 0 = {0, 4}, core_id 1 = {1, 5}; socket 1: core_id 0 = {2, 6}, 1 = {3, 7}.
    """
    cpus = {}
    for cpu in range(8):
        socket = (cpu % 4) // 2
        cpus[cpu] = CpuInfo(
            cpu_id=cpu,
            socket_id=socket,
            die_id=0,
            cluster_id=-1,
            core_id=cpu % 2,
            numa_node=socket,
            l3_id=10 + socket,
        )
    return Topology(cpus=cpus, smt_enabled=True)


def test_indexes() -> None:
    topo = two_socket_smt2()
    assert topo.online == cs("0-7")
    assert topo.sockets == {0: cs("0-1,4-5"), 1: cs("2-3,6-7")}
    assert topo.numa_nodes == {0: cs("0-1,4-5"), 1: cs("2-3,6-7")}
    assert topo.l3_caches == {10: cs("0-1,4-5"), 11: cs("2-3,6-7")}
    assert topo.cores == {
        (0, 0, -1, 0): cs("0,4"),
        (0, 0, -1, 1): cs("1,5"),
        (1, 0, -1, 0): cs("2,6"),
        (1, 0, -1, 1): cs("3,7"),
    }
    assert topo.smt_width == 2


def test_core_id_repeating_across_sockets_gives_distinct_cores() -> None:
    topo = two_socket_smt2()
    assert topo.info(0).core_id == topo.info(2).core_id == 0
    assert topo.siblings(0) == cs("0,4")
    assert topo.siblings(2) == cs("2,6")
    assert topo.siblings(6) == cs("2,6")
    assert topo.info(0).core_key != topo.info(2).core_key


def test_siblings_of_unknown_cpu() -> None:
    topo = two_socket_smt2()
    with pytest.raises(TopologyError, match="cpu9"):
        topo.siblings(9)
    with pytest.raises(TopologyError, match="cpu9"):
        topo.info(9)


def test_cores_of_includes_partial_cores_ordered_by_lowest_cpu() -> None:
    topo = two_socket_smt2()
    assert topo.cores_of(cs("6,1")) == [cs("1,5"), cs("2,6")]
    assert topo.cores_of(cs("0,4")) == [cs("0,4")]
    assert topo.cores_of(CpuSet()) == []
    assert topo.cores_of(cs("8-9")) == []  # not online


def test_pcie_roots_are_sorted_and_kept_to_online_cpus() -> None:
    base = two_socket_smt2()
    roots = {"pci0000:80": cs("2-3,6-7,12"), "pci0000:00": cs("0-1,4-5")}
    topo = Topology(cpus=dict(base.cpus), smt_enabled=True, pcie_roots=roots)
    assert list(topo.pcie_roots) == ["pci0000:00", "pci0000:80"]
    assert topo.pcie_roots["pci0000:80"] == cs("2-3,6-7")  # cpu12 is not online
    assert topo != base  # the roots are part of the model
    assert base.pcie_roots == {}


def test_cpus_without_a_numa_node() -> None:
    base = two_socket_smt2()
    assert base.without_numa_node == CpuSet()
    cpus = {
        c: replace(i, numa_node=NO_NUMA_NODE) if c in (3, 7) else i for c, i in base.cpus.items()
    }
    topo = Topology(cpus=cpus, smt_enabled=True)
    assert topo.without_numa_node == cs("3,7")
    assert topo.numa_nodes == {NO_NUMA_NODE: cs("3,7"), 0: cs("0-1,4-5"), 1: cs("2,6")}
    assert topo.numa_in_sysfs is True


def test_queries_of_cpu_sets() -> None:
    topo = two_socket_smt2()
    assert topo.numa_nodes_of(cs("1,6,20")) == [0, 1]
    assert topo.sockets_of(cs("4-5")) == [0]
    assert topo.l3_caches_of(cs("3")) == [11]
    assert topo.by_core_type(CoreType.STANDARD) == topo.online
    assert topo.by_core_type(CoreType.P_CORE) == CpuSet()


def test_offline_and_isolated_are_normalised() -> None:
    base = two_socket_smt2()
    cpus = {c: i for c, i in base.cpus.items() if c != 7}
    topo = Topology(cpus=cpus, smt_enabled=True, offline=cs("3,7"), isolated=cs("1,7,9"))
    assert topo.offline == cs("7")  # cpu3 is online after all
    assert topo.isolated == cs("1")  # isolated must be online
    assert topo.siblings(3) == cs("3")
    assert topo.smt_width == 2


def test_smt_width_any_width_and_without_smt() -> None:
    def cpu(n: int, core: int) -> CpuInfo:
        return CpuInfo(n, 0, 0, -1, core, 0, None)

    smt4 = Topology(cpus={n: cpu(n, n // 4) for n in range(8)}, smt_enabled=True)
    assert smt4.smt_width == 4
    assert smt4.siblings(5) == cs("4-7")
    assert smt4.l3_caches == {}
    assert smt4.l3_caches_of(cs("0-7")) == []
    no_smt = Topology(cpus={n: cpu(n, n) for n in range(3)}, smt_enabled=False)
    assert no_smt.smt_width == 1
    assert Topology(cpus={}, smt_enabled=False).smt_width == 1


def test_die_and_cluster_are_part_of_the_core_identity() -> None:
    cpus = {
        0: CpuInfo(0, 0, 0, 5, 0, 0, 0),
        1: CpuInfo(1, 0, 1, 5, 0, 0, 0),  # other die, same core_id
        2: CpuInfo(2, 0, 0, 6, 0, 0, 0),  # other cluster, same core_id
    }
    topo = Topology(cpus=cpus, smt_enabled=False)
    assert len(topo.cores) == 3


def test_cpu_table_key_must_match() -> None:
    with pytest.raises(TopologyError, match="3"):
        Topology(cpus={3: CpuInfo(4, 0, 0, -1, 0, 0, 0)}, smt_enabled=False)


def test_cpus_are_kept_sorted_and_equal_models_compare_equal() -> None:
    topo = two_socket_smt2()
    shuffled = Topology(cpus=dict(reversed(list(topo.cpus.items()))), smt_enabled=True)
    assert list(shuffled.cpus) == list(range(8))
    assert shuffled == topo
    assert Topology(cpus=dict(topo.cpus), smt_enabled=False) != topo


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_indexes_partition_the_online_cpus(core_of: list[int]) -> None:
    cpus = {
        n: CpuInfo(
            n, socket_id=c % 2, die_id=0, cluster_id=-1, core_id=c, numa_node=c % 2, l3_id=c // 2
        )
        for n, c in enumerate(core_of)
    }
    topo = Topology(cpus=cpus, smt_enabled=True)
    for index in (topo.sockets, topo.numa_nodes, topo.l3_caches, topo.cores):
        groups = list(index.values())
        assert CpuSet.union(groups) == topo.online
        assert sum(len(g) for g in groups) == len(topo.online)
    assert topo.smt_width == max(core_of.count(c) for c in set(core_of))
    for cpu in topo.online:
        assert topo.siblings(cpu) == CpuSet(n for n, c in enumerate(core_of) if c == core_of[cpu])
