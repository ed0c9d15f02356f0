"""The text map of ``dracpu inspect``: content on small machines, size on a 1024-CPU one."""

from __future__ import annotations

import pytest

from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy, published_devices
from dracpu.core.slices import SliceOptions, build_resource_slices
from dracpu.core.topology import CpuInfo, Topology
from dracpu.core.topology_map import LINE_WIDTH, claim_keys, render_map
from dracpu.sim.topologies import FIXTURES, MachineSpec, build_topology

NODE = "node-a"


def render(
    topology: Topology,
    reserved: str = "",
    mode: CpuDeviceMode = CpuDeviceMode.GROUPED,
    group_by: GroupBy = GroupBy.NUMANODE,
    claimed: dict[str, CpuSet] | None = None,
    options: SliceOptions | None = None,
) -> list[str]:
    cpus = CpuSet.parse(reserved)
    devices = published_devices(topology, reserved=cpus, mode=mode, group_by=group_by)
    slices = build_resource_slices(NODE, devices, options=options or SliceOptions())
    text = render_map(
        topology, reserved=cpus, devices=devices, slices=slices, claimed=claimed, options=options
    )
    assert text.endswith("\n")
    return text.splitlines()


def test_small_machine_map_with_claims() -> None:
    topology = build_topology(FIXTURES["offline-isolated"])
    claimed = {
        "3f2c1a9b-0000-4000-8000-000000000001": CpuSet.parse("1,9"),
        "77777777-0000-4000-8000-000000000002": CpuSet.parse("3"),
    }
    lines = render(topology, reserved="0,8", claimed=claimed)
    assert lines[:4] == [
        "cpus: 13 online (0-4,6-13), 3 offline; smt on, 2 threads/core",
        "reserved: 0,8   isolated: 2,7,10",
        "a cell is one core, its threads comma separated",
        "marks: R reserved, I isolated, a..z held by a claim (listed below)",
    ]
    start = lines.index("socket 0: cpus 0-4,6-13, 8 cores")
    assert lines[start : start + 7] == [
        "socket 0: cpus 0-4,6-13, 8 cores",
        "  numa 0: cpus 0-3,8-11  -> cpudevnuma000 (dra.cpu/cpu=6)",
        "    l3 0: cpus 0-3,8-11, 4 cores",
        "      0R,8R   1a,9a   2I,10I  3b,11",
        "  numa 1: cpus 4,6-7,12-13  -> cpudevnuma001 (dra.cpu/cpu=5)",
        "    l3 1: cpus 4,6-7,12-13, 4 cores",
        "      4,12    6       7I      13",
    ]
    assert "offline: cpus 5,14-15 (no topology while offline)" in lines
    assert "exclusive: 2 claims, cpus 1,3,9" in lines
    assert "  a  3f2c1a9b  cpus 1,9" in lines
    assert "  b  77777777  cpus 3" in lines
    # shared = online - reserved - isolated - claimed
    assert "shared pool: cpus 4,6,11-13 (5 cpus)" in lines
    assert "  cpudevnuma001  dra.cpu/cpu=5  cpus 4,6-7,12-13" in lines
    assert lines[-2:] == [
        "resourceslices: 1, driver dra.cpu, pool node-a generation 1",
        "  node-a-dra.cpu-000: cpudevnuma000..cpudevnuma001 (2 devices)",
    ]


def test_without_claims_there_is_no_shared_pool_line() -> None:
    lines = render(build_topology(FIXTURES["vm-2cpu"]), mode=CpuDeviceMode.INDIVIDUAL)
    assert lines[3] == "marks: R reserved, I isolated"
    assert not any(line.startswith(("shared pool", "exclusive")) for line in lines)
    assert "devices: individual mode, 2 devices (cpudev000..cpudev001), numbered core by core:" in (
        lines
    )
    assert "  cpudev000=cpu0 cpudev001=cpu1" in lines


def test_socket_and_machine_grouping_annotate_their_level() -> None:
    topology = build_topology(FIXTURES["dual-socket-smt2"])
    lines = render(topology, reserved="0", group_by=GroupBy.SOCKET)
    assert "socket 0: cpus 0-15,32-47, 16 cores  -> cpudevsocket000 (dra.cpu/cpu=31)" in lines
    assert "socket 1: cpus 16-31,48-63, 16 cores  -> cpudevsocket001 (dra.cpu/cpu=32)" in lines
    assert "  numa 0: cpus 0-7,32-39" in lines
    lines = render(topology, group_by=GroupBy.MACHINE)
    assert "machine: 2 sockets, 4 numa nodes, 8 l3 caches, 32 cores" in lines[5]
    assert lines[5].endswith("-> cpudevmachine (dra.cpu/cpu=64)")


def test_hybrid_cores_are_listed_by_type() -> None:
    lines = render(build_topology(FIXTURES["hybrid-desktop"]))
    start = lines.index("    l3 0: cpus 0-23, 16 cores")
    assert lines[start + 1 : start + 5] == [
        "      8 p-cores:",
        "      0,1    2,3    4,5    6,7    8,9    10,11  12,13  14,15",
        "      8 e-cores:",
        "      16     17     18     19     20     21     22     23",
    ]


def test_cpus_without_l3_are_grouped_as_no_l3() -> None:
    cpus = {
        c: CpuInfo(
            cpu_id=c,
            socket_id=0,
            die_id=0,
            cluster_id=-1,
            core_id=c,
            numa_node=0,
            l3_id=0 if c < 2 else None,
        )
        for c in range(4)
    }
    lines = render(Topology(cpus=cpus, smt_enabled=False))
    assert "    l3 0: cpus 0-1, 2 cores" in lines
    assert "    no l3: cpus 2-3, 2 cores" in lines


def test_every_cpu_reserved() -> None:
    lines = render(
        build_topology(FIXTURES["vm-2cpu"]), reserved="0-1", mode=CpuDeviceMode.INDIVIDUAL
    )
    assert "      0R  1R" in lines
    assert "devices: none (no allocatable CPU)" in lines
    assert "  node-a-dra.cpu-000: no devices" in lines


@pytest.mark.parametrize("mode", list(CpuDeviceMode))
def test_1024_cpus_fit_a_screenful_of_columns(mode: CpuDeviceMode) -> None:
    topology = build_topology(FIXTURES["big-1024"])
    claimed = {f"{i:08x}-claim": CpuSet([2 * i + 1]) for i in range(30)}
    lines = render(topology, reserved="0,512", mode=mode, claimed=claimed)
    assert len(lines) < 170
    assert max(map(len, lines)) <= LINE_WIDTH
    # every online CPU appears in exactly one core cell of the grid
    grid = [line for line in lines if line.startswith("      ") and line[6].isdigit()]
    cells = [cell for line in grid for cell in line.split()]
    ids = sorted(int(t.rstrip("RIabcdefghijklmnopqrstuvwxyz")) for c in cells for t in c.split(","))
    assert ids == list(range(1024))
    assert "0R,512R" in cells
    assert "1a,513" in cells
    assert "59ad,571" in cells  # the 30th claim gets the two-letter key "ad"


def test_claim_keys_are_bijective_base_26_by_lowest_cpu() -> None:
    claimed = {f"uid{i}": CpuSet([100 - i]) for i in range(30)}
    claimed["empty"] = CpuSet()
    keys = claim_keys(claimed)
    assert "empty" not in keys
    assert keys["uid29"] == "a"  # lowest CPU (71) first
    assert keys["uid4"] == "z"
    assert keys["uid3"] == "aa"
    assert keys["uid0"] == "ad"
    assert len(set(keys.values())) == 30


def test_pcie_roots_are_listed_under_their_numa_node() -> None:
    topology = build_topology(FIXTURES["dual-socket-smt2"], pcie_roots=True)
    lines = render(topology, options=SliceOptions(expose_pcie_roots=True))
    start = lines.index("  numa 0: cpus 0-7,32-39  -> cpudevnuma000 (dra.cpu/cpu=16)")
    assert lines[start + 1] == "    pcie roots: pci0000:00, pci0000:3a"
    assert "    pcie roots: pci0000:ae, pci0000:d7" in lines
    assert "  pcie roots local to every cpu: pci0001:00" in lines
    assert "  - pcieRoot is read on every architecture (the Go driver: on amd64 only)" in lines
    none_found = render(build_topology(FIXTURES["smt4"]), options=SliceOptions(True, True))
    assert "  pcie roots: none found" in none_found
    assert not any("pcie" in line for line in render(build_topology(FIXTURES["smt4"])))


def test_cpus_of_no_numa_node_are_their_own_unpublished_group() -> None:
    lines = render(build_topology(FIXTURES["no-numa-node"]))
    assert "machine: 1 socket, 1 numa node, 2 l3 caches, 8 cores" in lines
    start = lines.index("  numa 0: cpus 0-3,8-11  -> cpudevnuma000 (dra.cpu/cpu=8)")
    assert lines[start + 3] == "  no numa node: cpus 4-7,12-15 (in no device but cpudevmachine)"
    assert lines[start + 5] == "      4,12  5,13  6,14  7,15"


def test_differences_from_the_go_driver() -> None:
    grouped = render(build_topology(FIXTURES["vm-2cpu"]))
    start = grouped.index("compared with the Go driver:")
    assert grouped[start + 1 : start + 3] == [
        "  - dra.cpu/cpu requestPolicy: whole cpus, default all of them "
        "(Go driver: none, fractions fail)",
        "  - dra.cpu/numIsolatedCPUs on every device (ours)",
    ]
    individual = render(build_topology(FIXTURES["vm-2cpu"]), mode=CpuDeviceMode.INDIVIDUAL)
    start = individual.index("compared with the Go driver:")
    assert individual[start + 1] == "  - dra.cpu/isolated on every device (ours)"
    empty = render(build_topology(FIXTURES["vm-2cpu"]), reserved="0-1", group_by=GroupBy.SOCKET)
    assert "  - no device: one empty ResourceSlice (the Go driver publishes none)" in empty
    no_numa = render(build_topology(MachineSpec(cores_per_cluster=2, numa_sysfs=False)))
    start = no_numa.index("compared with the Go driver:")
    assert no_numa[start + 1 : start + 3] == [
        "  - the kernel has no NUMA nodes: every cpu is on node 0 (the Go driver skips every cpu, "
        "publishing",
        "      no device but cpudevmachine)",
    ]
