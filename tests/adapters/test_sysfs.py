"""read_topology against fake sysfs trees (every named machine, broken trees) and this host."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from dracpu.adapters.sysfs import read_online, read_topology
from dracpu.core.cpuset import CpuSet
from dracpu.core.topology import NO_NUMA_NODE, CoreType, Topology
from dracpu.errors import TopologyError
from dracpu.sim.topologies import FIXTURES, MachineSpec, PciRoot, build_topology, write_sysfs
from tests.fixtures import SysfsTrees

CPU = "sys/devices/system/cpu"
NODE = "sys/devices/system/node"


def cs(text: str) -> CpuSet:
    return CpuSet.parse(text)


def read_named(trees: SysfsTrees, name: str) -> Topology:
    return read_topology(trees.root(name))


# --- every named machine reads back as the model of its description ---------------------------


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_reads_as_its_model(trees: SysfsTrees, name: str) -> None:
    topo = read_named(trees, name)
    assert topo == build_topology(FIXTURES[name])
    assert topo.online == FIXTURES[name].online


def test_dual_socket_smt2(trees: SysfsTrees) -> None:
    topo = read_named(trees, "dual-socket-smt2")
    assert len(topo.online) == 64
    assert topo.sockets == {0: cs("0-15,32-47"), 1: cs("16-31,48-63")}
    assert topo.numa_nodes == {
        0: cs("0-7,32-39"),
        1: cs("8-15,40-47"),
        2: cs("16-23,48-55"),
        3: cs("24-31,56-63"),
    }
    assert len(topo.l3_caches) == 8
    assert topo.l3_caches[0] == cs("0-3,32-35")
    assert topo.l3_caches[7] == cs("28-31,60-63")
    assert len(topo.cores) == 32
    assert topo.smt_width == 2
    assert topo.smt_enabled is True
    assert topo.siblings(5) == cs("5,37")
    assert topo.siblings(37) == cs("5,37")
    # core_id repeats per socket (cpu5 and cpu21 both have core_id 5) but the cores differ.
    assert topo.info(5).core_id == topo.info(21).core_id == 5
    assert topo.info(5).core_key != topo.info(21).core_key
    assert topo.siblings(21) == cs("21,53")
    assert {info.cluster_id for info in topo.cpus.values()} == {-1}
    assert {info.die_id for info in topo.cpus.values()} == {0}
    assert topo.by_core_type(CoreType.STANDARD) == topo.online
    assert topo.offline == CpuSet()
    assert topo.isolated == CpuSet()


def test_hybrid_desktop(trees: SysfsTrees) -> None:
    topo = read_named(trees, "hybrid-desktop")
    assert len(topo.online) == 24
    assert topo.by_core_type(CoreType.P_CORE) == cs("0-15")
    assert topo.by_core_type(CoreType.E_CORE) == cs("16-23")
    assert topo.by_core_type(CoreType.STANDARD) == CpuSet()
    assert topo.info(3).core_type is CoreType.P_CORE
    assert topo.info(17).core_type is CoreType.E_CORE
    assert topo.siblings(3) == cs("2-3")
    assert topo.siblings(17) == cs("17")
    assert len(topo.cores) == 16
    assert topo.smt_width == 2
    assert topo.smt_enabled
    assert topo.info(2).core_id == 4  # P-cores step 4: 0, 4, ..., 28
    assert topo.info(16).core_id == 32  # E-cores continue: 32, 36, ...
    # E-cores share a cluster per module of four; every P-core is its own cluster.
    assert topo.info(16).cluster_id == topo.info(19).cluster_id != topo.info(20).cluster_id
    assert topo.info(0).cluster_id != topo.info(2).cluster_id
    assert list(topo.l3_caches) == [0]
    assert topo.l3_caches[0] == topo.online
    assert list(topo.numa_nodes) == [0]


def test_hybrid_with_only_cpu_atom_makes_the_rest_p_cores(scratch: Path) -> None:
    write_sysfs(FIXTURES["hybrid-desktop"], scratch, omit=["sys/devices/cpu_core"])
    topo = read_topology(scratch)
    assert topo.by_core_type(CoreType.P_CORE) == cs("0-15")
    assert topo.by_core_type(CoreType.E_CORE) == cs("16-23")


def test_hybrid_without_pmu_files_is_standard(scratch: Path) -> None:
    write_sysfs(
        FIXTURES["hybrid-desktop"], scratch, omit=["sys/devices/cpu_core", "sys/devices/cpu_atom"]
    )
    assert read_topology(scratch).by_core_type(CoreType.STANDARD) == cs("0-23")


def test_arm64_server(trees: SysfsTrees) -> None:
    topo = read_named(trees, "arm64-server")
    assert len(topo.online) == 32
    assert topo.smt_width == 1
    assert topo.smt_enabled is False
    assert topo.numa_nodes == {0: cs("0-15"), 1: cs("16-31")}
    # No cache id files: each L3 is named by the lowest CPU of its shared_cpu_list.
    assert topo.l3_caches == {0: cs("0-15"), 16: cs("16-31")}
    assert topo.info(20).l3_id == 16
    assert not (trees.root("arm64-server") / CPU / "cpu20/cache/index3/id").exists()
    # Clusters of four cores.
    assert topo.info(5).cluster_id == 1
    assert {topo.info(c).cluster_id for c in range(16, 20)} == {4}
    assert topo.info(0).die_id == 0  # no die_id file
    assert not (trees.root("arm64-server") / CPU / "cpu0/topology/die_id").exists()
    assert all(len(core) == 1 for core in topo.cores.values())


def test_smt4(trees: SysfsTrees) -> None:
    topo = read_named(trees, "smt4")
    assert len(topo.online) == 64
    assert topo.smt_width == 4
    assert topo.smt_enabled
    assert topo.siblings(6) == cs("4-7")
    assert topo.siblings(63) == cs("60-63")
    assert len(topo.cores) == 16
    assert topo.sockets == {0: cs("0-31"), 1: cs("32-63")}
    assert topo.l3_caches == {0: cs("0-15"), 1: cs("16-31"), 2: cs("32-47"), 3: cs("48-63")}
    assert topo.info(4).core_id == topo.info(36).core_id == 1
    assert topo.siblings(36) == cs("36-39")


def test_vm_2cpu(trees: SysfsTrees) -> None:
    topo = read_named(trees, "vm-2cpu")
    assert topo.online == cs("0-1")
    assert topo.cores == {(0, 0, -1, 0): cs("0"), (0, 0, -1, 1): cs("1")}
    assert topo.numa_nodes == {0: cs("0-1")}
    assert topo.l3_caches == {0: cs("0-1")}
    assert topo.smt_enabled is False
    assert topo.smt_width == 1


def test_offline_isolated(trees: SysfsTrees) -> None:
    topo = read_named(trees, "offline-isolated")
    assert topo.online == cs("0-4,6-13")
    assert topo.offline == cs("5,14-15")
    assert topo.isolated == cs("2,7,10")  # 14 is isolated but offline
    assert topo.siblings(2) == cs("2,10")
    assert topo.siblings(13) == cs("13")  # its sibling cpu5 is offline
    assert topo.siblings(6) == cs("6")
    assert len(topo.cores) == 8
    assert topo.smt_enabled is True
    assert topo.smt_width == 2
    assert topo.numa_nodes == {0: cs("0-3,8-11"), 1: cs("4,6-7,12-13")}
    assert topo.l3_caches == {0: cs("0-3,8-11"), 1: cs("4,6-7,12-13")}
    with pytest.raises(TopologyError, match="cpu5"):
        topo.info(5)


def test_big_1024(trees: SysfsTrees) -> None:
    topo = read_named(trees, "big-1024")
    assert len(topo.online) == 1024
    assert len(topo.sockets) == 2
    assert len(topo.numa_nodes) == 8
    assert len(topo.l3_caches) == 32
    assert len(topo.cores) == 512
    assert topo.siblings(0) == cs("0,512")
    assert topo.siblings(300) == cs("300,812")
    assert topo.sockets[1] == cs("256-511,768-1023")
    assert topo.l3_caches[31] == cs("496-511,1008-1023")


def test_dies_distinguish_cores_when_core_id_restarts_per_die(scratch: Path) -> None:
    spec = MachineSpec(dies_per_socket=2, cores_per_cluster=4, threads_per_core=2,
                       core_id_scheme="per-die")  # fmt: skip
    write_sysfs(spec, scratch)
    topo = read_topology(scratch)
    assert topo == build_topology(spec)
    assert topo.info(0).core_id == topo.info(4).core_id == 0
    assert topo.info(0).die_id == 0
    assert topo.info(4).die_id == 1
    assert topo.siblings(4) == cs("4,12")
    assert len(topo.cores) == 8


def test_clusters_distinguish_cores_when_core_id_restarts_per_cluster(scratch: Path) -> None:
    spec = MachineSpec(clusters_per_l3=4, cores_per_cluster=2, core_id_scheme="per-cluster")
    write_sysfs(spec, scratch)
    topo = read_topology(scratch)
    assert topo == build_topology(spec)
    assert [topo.info(c).core_id for c in range(8)] == [0, 1] * 4
    assert len(topo.cores) == 8


def test_no_numa_directory_means_node_0(scratch: Path) -> None:
    spec = replace(FIXTURES["vm-2cpu"], numa_sysfs=False)
    write_sysfs(spec, scratch)
    assert not (scratch / NODE).exists()
    topo = read_topology(scratch)
    assert topo.numa_nodes == {0: cs("0-1")}


def test_no_l3_cache(scratch: Path) -> None:
    write_sysfs(replace(FIXTURES["vm-2cpu"], l3="none"), scratch)
    topo = read_topology(scratch)
    assert topo.l3_caches == {}
    assert topo.info(0).l3_id is None


def test_no_cache_directory_at_all(scratch: Path) -> None:
    write_sysfs(FIXTURES["vm-2cpu"], scratch, omit=[f"{CPU}/cpu*/cache"])
    assert read_topology(scratch).l3_caches == {}


def test_l3_found_at_another_index(scratch: Path) -> None:
    # Only an L2 at index2 and the L3 moved to index5 (with index3/index4 absent).
    write_sysfs(FIXTURES["vm-2cpu"], scratch, omit=[f"{CPU}/cpu*/cache/index3"])
    for cpu in (0, 1):
        index = scratch / CPU / f"cpu{cpu}/cache/index5"
        index.mkdir()
        (index / "level").write_text("3\n")
        (index / "type").write_text("Unified\n")
        (index / "id").write_text("7\n")
        (index / "shared_cpu_list").write_text("0-1\n")
    assert read_topology(scratch).l3_caches == {7: cs("0-1")}


def test_instruction_level3_cache_is_not_the_l3(scratch: Path) -> None:
    write_sysfs(
        FIXTURES["vm-2cpu"],
        scratch,
        override={f"{CPU}/cpu{c}/cache/index3/type": "Instruction\n" for c in (0, 1)},
    )
    assert read_topology(scratch).l3_caches == {}


def test_optional_topology_files_missing(scratch: Path) -> None:
    write_sysfs(
        FIXTURES["dual-socket-smt2"],
        scratch,
        omit=[
            f"{CPU}/cpu*/topology/die_id",
            f"{CPU}/cpu*/topology/cluster_id",
            f"{CPU}/cpu*/topology/package_cpus_list",
            f"{CPU}/cpu*/topology/thread_siblings_list",
            f"{CPU}/present",
            f"{CPU}/isolated",
        ],
    )
    # core_siblings_list replaces package_cpus_list, core_cpus_list replaces
    # thread_siblings_list, possible replaces present.
    assert read_topology(scratch) == build_topology(FIXTURES["dual-socket-smt2"])


def test_without_any_group_list_every_cpu_is_read(scratch: Path) -> None:
    omit = [f"{CPU}/cpu*/topology/{n}_list" for n in ("package_cpus", "core_siblings")]
    write_sysfs(FIXTURES["offline-isolated"], scratch, omit=omit)
    assert read_topology(scratch) == build_topology(FIXTURES["offline-isolated"])


def test_offline_falls_back_to_possible_then_empty(scratch: Path) -> None:
    spec = FIXTURES["offline-isolated"]
    write_sysfs(spec, scratch, omit=[f"{CPU}/present"])
    assert read_topology(scratch).offline == cs("5,14-15")
    (scratch / CPU / "possible").unlink()
    assert read_topology(scratch).offline == CpuSet()


@pytest.mark.parametrize(
    ("control", "spec_name", "enabled"),
    [
        ("on", "vm-2cpu", True),  # upstream: "on" wins even without SMT siblings
        ("off", "dual-socket-smt2", False),
        ("forceoff", "dual-socket-smt2", False),
        ("notsupported", "dual-socket-smt2", False),
        ("notimplemented", "dual-socket-smt2", False),
        ("something-new", "dual-socket-smt2", True),
        ("something-new", "vm-2cpu", False),
        (None, "smt4", True),
        (None, "arm64-server", False),
    ],
)
def test_smt_control(scratch: Path, control: str | None, spec_name: str, enabled: bool) -> None:
    spec = replace(FIXTURES[spec_name], smt_control=control)
    write_sysfs(spec, scratch)
    assert (control is None) != (scratch / CPU / "smt/control").exists()
    topo = read_topology(scratch)
    assert topo.smt_enabled is enabled
    assert topo == build_topology(spec)


# --- broken trees: one TopologyError naming the file -------------------------------------------


def read_error(root: Path, *, pcie_roots: bool = False) -> str:
    with pytest.raises(TopologyError) as info:
        read_topology(root, pcie_roots=pcie_roots)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("omit", "names"),
    [
        (f"{CPU}/online", f"{CPU}/online: missing"),
        (f"{CPU}/cpu3/topology/core_id", f"{CPU}/cpu3/topology/core_id: missing"),
        (f"{CPU}/cpu0/topology/physical_package_id", "cpu0/topology/physical_package_id: missing"),
        (f"{CPU}/cpu1/topology", "cpu1/topology/thread_siblings_list: missing"),
        (f"{CPU}/cpu2/topology/[tc]*_[sc]*s_list", "cpu2/topology/thread_siblings_list: missing"),
        (f"{CPU}/cpu2/topology/core_cpus_list", None),  # thread_siblings_list suffices
        (f"{CPU}/cpu1/node0", f"{CPU}/cpu1: no node0 entry although "),
        (f"{NODE}/node1/cpulist", f"{NODE}/node1/cpulist: missing"),
        (f"{CPU}/cpu0/cache/index3/type", f"{CPU}/cpu0/cache/index3/type: missing"),
        (f"{CPU}/cpu0/cache/index3/shared_cpu_list", "cpu0/cache/index3/shared_cpu_list: missing"),
    ],
)
def test_missing_file(scratch: Path, omit: str, names: str | None) -> None:
    spec = FIXTURES["offline-isolated"]
    write_sysfs(spec, scratch, omit=[omit])
    if names is None:
        assert read_topology(scratch) == build_topology(spec)
        return
    message = read_error(scratch)
    assert names in message
    assert str(scratch) in message


@pytest.mark.parametrize(
    ("path", "text", "names"),
    [
        (f"{CPU}/online", "0-3,x\n", f"{CPU}/online: malformed"),
        (f"{CPU}/online", "\n", f"{CPU}/online: malformed: no online CPU"),
        (f"{CPU}/online", "0-99999999\n", f"{CPU}/online: malformed"),
        (f"{CPU}/present", "0-15-\n", f"{CPU}/present: malformed"),
        (f"{CPU}/isolated", "2,,3\n", f"{CPU}/isolated: malformed"),
        (f"{NODE}/node0/cpulist", "0-3,8-11,\n", f"{NODE}/node0/cpulist: malformed"),
        (f"{CPU}/cpu3/topology/core_id", "three\n", "cpu3/topology/core_id: malformed"),
        (f"{CPU}/cpu3/topology/core_id", "", "cpu3/topology/core_id: malformed"),
        (f"{CPU}/cpu0/topology/physical_package_id", "0x0", "physical_package_id: malformed"),
        (f"{CPU}/cpu0/topology/die_id", "1.0", "cpu0/topology/die_id: malformed"),
        (f"{CPU}/cpu0/topology/thread_siblings_list", "0;8", "thread_siblings_list: malformed"),
        (f"{CPU}/cpu0/cache/index3/level", "L3", "cpu0/cache/index3/level: malformed"),
        (f"{CPU}/cpu0/cache/index3/id", "zero", "cpu0/cache/index3/id: malformed"),
        ("sys/devices/cpu_atom/cpus", "16-", "sys/devices/cpu_atom/cpus: malformed"),
    ],
)
def test_malformed_file(scratch: Path, path: str, text: str, names: str) -> None:
    write_sysfs(FIXTURES["offline-isolated"], scratch, override={path: text})
    assert names in read_error(scratch)


def test_non_utf8_bytes_are_malformed(scratch: Path) -> None:
    write_sysfs(FIXTURES["vm-2cpu"], scratch)
    (scratch / CPU / "cpu1/topology/core_id").write_bytes(b"\xff\xfe\n")
    assert f"{CPU}/cpu1/topology/core_id: malformed" in read_error(scratch)


def test_unreadable_file_is_a_topology_error(scratch: Path) -> None:
    write_sysfs(FIXTURES["vm-2cpu"], scratch, omit=[f"{CPU}/cpu1/topology/core_id"])
    (scratch / CPU / "cpu1/topology/core_id").mkdir()  # read() fails with EISDIR
    assert f"{CPU}/cpu1/topology/core_id: cannot read" in read_error(scratch)


def test_thread_siblings_disagreeing_with_core_keys(scratch: Path) -> None:
    # cpu2 and cpu10 share (socket, die, cluster, core_id) but cpu2 claims no sibling.
    write_sysfs(
        FIXTURES["offline-isolated"],
        scratch,
        override={f"{CPU}/cpu2/topology/thread_siblings_list": "2\n"},
    )
    message = read_error(scratch)
    assert f"{CPU}/cpu2/topology/thread_siblings_list" in message
    assert "'2'" in message
    assert "'2,10'" in message


def test_repeated_core_id_without_siblings_is_refused(scratch: Path) -> None:
    # Two single-thread cores reporting the same core_id in the same package: the core key
    # would merge them, the kernel's siblings list says they are distinct.
    write_sysfs(FIXTURES["vm-2cpu"], scratch, override={f"{CPU}/cpu1/topology/core_id": "0\n"})
    message = read_error(scratch)
    assert f"{CPU}/cpu0/topology/thread_siblings_list" in message
    assert "'0-1'" in message


def test_cpu_listed_by_two_nodes(scratch: Path) -> None:
    write_sysfs(
        FIXTURES["offline-isolated"], scratch, override={f"{NODE}/node1/cpulist": "3-4,6-7\n"}
    )
    message = read_error(scratch)
    assert "node1/cpulist" in message
    assert "node0/cpulist" in message
    assert "cpu3" in message


def test_cpu_linked_to_another_node_than_listed(scratch: Path) -> None:
    write_sysfs(FIXTURES["offline-isolated"], scratch, omit=[f"{CPU}/cpu4/node1"])
    (scratch / CPU / "cpu4/node0").symlink_to("../../node/node0")
    message = read_error(scratch)
    assert f"{NODE}/node1/cpulist: lists cpu4" in message
    assert "node0" in message


def test_cpu_linked_to_a_node_that_does_not_list_it(scratch: Path) -> None:
    write_sysfs(
        FIXTURES["offline-isolated"], scratch, override={f"{NODE}/node1/cpulist": "6-7,12-13\n"}
    )
    message = read_error(scratch)
    assert f"{NODE}/node1/cpulist: does not list cpu4" in message


def test_l3_shared_list_without_the_cpu_itself(scratch: Path) -> None:
    write_sysfs(
        FIXTURES["arm64-server"],
        scratch,
        override={f"{CPU}/cpu0/cache/index3/shared_cpu_list": "1-15\n"},
    )
    assert f"{CPU}/cpu0/cache/index3/shared_cpu_list: does not list cpu0" in read_error(scratch)


def test_missing_host_root(tmp_path: Path) -> None:
    message = read_error(tmp_path / "nope")
    assert f"{tmp_path}/nope/{CPU}/online: missing" in message


# --- NUMA nodes and PCIe roots ------------------------------------------------------------------


def test_cpus_of_a_node_that_is_not_online_have_no_numa_node(trees: SysfsTrees) -> None:
    topo = read_named(trees, "no-numa-node")
    assert topo.without_numa_node == cs("4-7,12-15")
    assert topo.numa_nodes == {NO_NUMA_NODE: cs("4-7,12-15"), 0: cs("0-3,8-11")}
    assert topo.siblings(4) == cs("4,12")  # the rest of the topology is read as usual
    assert topo.numa_in_sysfs is True


def test_kernel_without_numa_puts_every_cpu_on_node_0(scratch: Path) -> None:
    spec = MachineSpec(cores_per_cluster=4, numa_sysfs=False)
    write_sysfs(spec, scratch)
    topo = read_topology(scratch)
    assert topo.numa_nodes == {0: cs("0-3")}
    assert topo.numa_in_sysfs is False
    assert topo == build_topology(spec)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_pcie_roots_read_as_the_model(trees: SysfsTrees, name: str) -> None:
    topo = read_topology(trees.root(name), pcie_roots=True)
    assert topo == build_topology(FIXTURES[name], pcie_roots=True)
    assert list(topo.pcie_roots) == sorted(r.name for r in FIXTURES[name].pci_roots)
    assert read_named(trees, name).pcie_roots == {}  # only read when asked


def test_pcie_roots_of_the_dual_socket_server(trees: SysfsTrees) -> None:
    topo = read_topology(trees.root("dual-socket-smt2"), pcie_roots=True)
    assert topo.pcie_roots == {
        "pci0000:00": cs("0-7,32-39"),
        "pci0000:3a": cs("0-7,32-39"),
        "pci0000:5d": cs("8-15,40-47"),
        "pci0000:80": cs("16-23,48-55"),
        "pci0000:ae": cs("24-31,56-63"),
        "pci0000:d7": cs("24-31,56-63"),
        "pci0001:00": cs("0-63"),
    }


def test_only_root_complex_names_are_read(scratch: Path) -> None:
    # upstream IsPCIeRootName: "pci" + 4 hex digits + ":" + 2 hex digits, lowercase
    spec = replace(FIXTURES["vm-2cpu"], pci_roots=(PciRoot("pci0000:00", None),))
    others = ("pci10000:00", "pci0000:0", "pciABCD:00", "pci0000-00", "platform")
    override = {f"sys/devices/{name}/pci_bus/x/cpulistaffinity": "0\n" for name in others}
    write_sysfs(spec, scratch, override=override)
    assert list(read_topology(scratch, pcie_roots=True).pcie_roots) == ["pci0000:00"]


def test_no_pci_at_all_is_no_roots(scratch: Path) -> None:
    write_sysfs(FIXTURES["hybrid-desktop"], scratch)
    assert read_topology(scratch, pcie_roots=True).pcie_roots == {}


def test_bad_cpulistaffinity_names_the_file(scratch: Path) -> None:
    affinity = "sys/devices/pci0000:00/pci_bus/0000:00/cpulistaffinity"
    write_sysfs(FIXTURES["vm-2cpu"], scratch, override={affinity: "0-1,\n"})
    assert f"{affinity}: malformed" in read_error(scratch, pcie_roots=True)
    assert read_topology(scratch).pcie_roots == {}  # not read without the flag


def test_missing_cpulistaffinity_names_the_file(scratch: Path) -> None:
    affinity = "sys/devices/pci0000:00/pci_bus/0000:00/cpulistaffinity"
    write_sysfs(FIXTURES["vm-2cpu"], scratch, omit=[affinity])
    assert f"{affinity}: missing" in read_error(scratch, pcie_roots=True)


# --- the online CPUs alone (device health reads them again and again) --------------------------


def test_read_online_is_the_topology_s_online(trees: SysfsTrees) -> None:
    root = trees.root("offline-isolated")
    assert read_online(root) == read_topology(root).online == cs("0-4,6-13")


@pytest.mark.parametrize(
    ("text", "error"), [("", "malformed: no online CPU"), ("0-x", "malformed: invalid cpuset")]
)
def test_read_online_refuses_a_bad_file_naming_it(scratch: Path, text: str, error: str) -> None:
    write_sysfs(FIXTURES["vm-2cpu"], scratch, override={f"{CPU}/online": text})
    with pytest.raises(TopologyError, match=f"^{scratch}/{CPU}/online: {error}"):
        read_online(scratch)


def test_read_online_without_the_file(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=f"{tmp_path}/{CPU}/online: missing"):
        read_online(tmp_path)


# --- this machine -------------------------------------------------------------------------------


def test_this_host() -> None:
    if not os.path.exists("/sys/devices/system/cpu/online"):
        pytest.skip("this host has no Linux sysfs CPU directory")
    topo = read_topology(Path("/"))
    assert CpuSet(os.sched_getaffinity(0)) <= topo.online
    assert len(topo.online) == os.cpu_count()
    assert CpuSet.union(topo.numa_nodes.values()) == topo.online
    assert CpuSet.union(topo.sockets.values()) == topo.online
    assert CpuSet.union(topo.cores.values()) == topo.online
    assert sum(len(core) for core in topo.cores.values()) == len(topo.online)
    for cpu in topo.online:
        assert cpu in topo.siblings(cpu)
        assert (
            topo.siblings(cpu)
            == CpuSet.parse(Path(f"/{CPU}/cpu{cpu}/topology/thread_siblings_list").read_text())
            & topo.online
        )
    # this host's PCIe roots, if any, are read with their cpulistaffinity
    roots = read_topology(Path("/"), pcie_roots=True).pcie_roots
    for name, local in roots.items():
        bus = name.removeprefix("pci")
        text = Path(f"/sys/devices/{name}/pci_bus/{bus}/cpulistaffinity").read_text()
        assert local == CpuSet.parse(text) & topo.online
