"""Published devices and ResourceSlice objects, checked against the Go driver's rules.

Every named fixture machine is checked three ways: against an independent model of
``kubernetes-sigs/dra-driver-cpu`` (``upstream_driver``: its sysfs reading and device builder,
sharing no code with ours) on the fixture's sysfs tree, in every mode, with and without PCIe roots
and the KEP-5517 mapping; generic invariants (every published CPU once, schema- and
apiserver-valid slices); and concrete devices derived by hand from the fixture's description.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from dracpu.adapters.sysfs import read_topology
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import (
    API_VERSION,
    ATTR_CACHE_L3_ID,
    ATTR_CORE_ID,
    ATTR_CORE_TYPE,
    ATTR_CPU_ID,
    ATTR_DRANET_NUMA_NODE,
    ATTR_ISOLATED,
    ATTR_LEGACY_NUMA_NODE_ID,
    ATTR_NUM_CPUS,
    ATTR_NUM_ISOLATED_CPUS,
    ATTR_NUMA_NODE,
    ATTR_PCIE_ROOT,
    ATTR_SMT_ENABLED,
    ATTR_SOCKET_ID,
    CAPACITY_CPU,
    DRIVER_NAME,
    NO_L3_CACHE,
    CpuDeviceMode,
    Device,
    GroupBy,
    devices_by_name,
    individual_numbering,
    published_devices,
)
from dracpu.core.slices import (
    MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_ADVANCED,
    SliceOptions,
    SliceWrites,
    build_resource_slices,
    consumable_capacity_dropped,
    max_devices_per_slice,
    next_generation,
    pool_generation,
    slice_content,
    slice_name,
    slice_writes,
)
from dracpu.core.topology import CpuInfo, Topology
from dracpu.errors import ConfigError, TopologyError
from dracpu.sim.slice_rules import validate_pool, validate_slice
from dracpu.sim.topologies import FIXTURES, MachineSpec, PciRoot, build_topology, write_sysfs
from tests.core import upstream_driver

# The Kubernetes version whose OpenAPI schemas we validate against: the newest kubernetes-validate
# ships, and the one our client library (kubernetes 37) targets. resource.k8s.io/v1 is GA since
# 1.34, so any version from 1.34 on has the schema.
K8S_VERSION = "1.37"

INDIVIDUAL = CpuDeviceMode.INDIVIDUAL
GROUPED = CpuDeviceMode.GROUPED
NODE = "node-a"


def schema_check(obj: dict[str, Any]) -> None:
    """Validate against the Kubernetes OpenAPI schema; a missing schema is a failure too."""
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"no schema: {exc.message}")
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{obj['metadata'].get('name')}: {exc.message}")


def assert_valid(slices: list[dict[str, Any]], *, schema: bool = True) -> None:
    for obj in slices:
        assert validate_slice(obj) == []
        if schema:
            schema_check(obj)
    assert validate_pool(slices) == []
    json.dumps(slices)  # plain JSON types only


def devices_of(
    name: str, mode: CpuDeviceMode, group_by: GroupBy = GroupBy.NUMANODE, reserved: str = ""
) -> dict[str, Device]:
    topology = build_topology(FIXTURES[name])
    found = published_devices(
        topology, reserved=CpuSet.parse(reserved), mode=mode, group_by=group_by
    )
    return devices_by_name(found)


def cpu_of(device: Device) -> int:
    assert len(device.cpus) == 1
    return device.cpus.min()


def numbering(devices: dict[str, Device]) -> list[int]:
    """CPU of cpudev000, cpudev001, ... in name order."""
    return [cpu_of(devices[name]) for name in sorted(devices, key=lambda n: int(n[6:]))]


# --- generic invariants, every fixture -------------------------------------------------------


def _reserved_choices(topology: Topology) -> list[CpuSet]:
    """No CPU, the first CPU alone (splitting its core), the first core, a whole NUMA node."""
    first = topology.online.min()
    first_numa = next(iter(topology.numa_nodes.values()))
    return [CpuSet(), CpuSet([first]), topology.siblings(first), first_numa]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_individual_devices_cover_every_published_cpu_once(name: str) -> None:
    topology = build_topology(FIXTURES[name])
    for reserved in _reserved_choices(topology):
        devices = published_devices(
            topology, reserved=reserved, mode=INDIVIDUAL, group_by=GroupBy.NUMANODE
        )
        cpus = [cpu_of(d) for d in devices]
        # CPUs of no NUMA node are skipped, as upstream's topology reader skips them
        assert sorted(cpus) == list(topology.online - reserved - topology.without_numa_node)
        assert [d.name for d in devices] == [f"cpudev{i:03d}" for i in range(len(devices))]
        for device in devices:
            info = topology.info(cpu_of(device))
            assert device.attributes[ATTR_CPU_ID] == info.cpu_id
            assert device.attributes[ATTR_CORE_ID] == info.core_id
            assert device.attributes[ATTR_SOCKET_ID] == info.socket_id
            assert device.attributes[ATTR_NUMA_NODE] == info.numa_node
            assert device.attributes[ATTR_LEGACY_NUMA_NODE_ID] == info.numa_node
            assert device.attributes[ATTR_DRANET_NUMA_NODE] == info.numa_node
            assert device.attributes[ATTR_CORE_TYPE] == info.core_type.value
            assert device.attributes[ATTR_SMT_ENABLED] is topology.smt_enabled
            assert device.attributes[ATTR_ISOLATED] is (info.cpu_id in topology.isolated)
            l3 = NO_L3_CACHE if info.l3_id is None else info.l3_id
            assert device.attributes[ATTR_CACHE_L3_ID] == l3
            assert ATTR_PCIE_ROOT not in device.attributes  # roots not read
            assert device.capacity == {}
            assert not device.grouped


@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize("group_by", list(GroupBy))
def test_grouped_devices_partition_allocatable_cpus(name: str, group_by: GroupBy) -> None:
    topology = build_topology(FIXTURES[name])
    known = topology.online - topology.without_numa_node
    groups = {
        GroupBy.NUMANODE: {n: c for n, c in topology.numa_nodes.items() if n >= 0},
        GroupBy.SOCKET: {s: cpus & known for s, cpus in topology.sockets.items()},
        GroupBy.MACHINE: {0: topology.online},  # upstream: the online list, NUMA node or not
    }[group_by]
    for reserved in _reserved_choices(topology):
        devices = published_devices(topology, reserved=reserved, mode=GROUPED, group_by=group_by)
        expected = {
            gid: cpus - reserved
            for gid, cpus in groups.items()
            if cpus - reserved or group_by is GroupBy.MACHINE
        }
        assert [d.cpus for d in devices] == list(expected.values())
        for gid, device in zip(expected, devices, strict=True):
            n = len(device.cpus)
            assert device.grouped
            assert device.capacity == {CAPACITY_CPU: n}
            assert device.attributes[ATTR_NUM_CPUS] == n
            assert device.attributes[ATTR_NUM_ISOLATED_CPUS] == len(device.cpus & topology.isolated)
            assert device.attributes[ATTR_SMT_ENABLED] is topology.smt_enabled
            if group_by is GroupBy.NUMANODE:
                assert device.name == f"cpudevnuma{gid:03d}"
                assert device.attributes[ATTR_NUMA_NODE] == gid
                assert device.attributes[ATTR_SOCKET_ID] == topology.sockets_of(device.cpus)[0]
            elif group_by is GroupBy.SOCKET:
                assert device.name == f"cpudevsocket{gid:03d}"
                assert device.attributes[ATTR_SOCKET_ID] == gid
                assert ATTR_NUMA_NODE not in device.attributes
            else:
                assert device.name == "cpudevmachine"
                assert set(device.attributes) == {
                    ATTR_SMT_ENABLED,
                    ATTR_NUM_CPUS,
                    ATTR_NUM_ISOLATED_CPUS,
                }


@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize(
    ("mode", "group_by"),
    [(INDIVIDUAL, GroupBy.NUMANODE), (GROUPED, GroupBy.NUMANODE), (GROUPED, GroupBy.SOCKET)],
)
def test_slices_of_every_fixture_are_valid(
    name: str, mode: CpuDeviceMode, group_by: GroupBy
) -> None:
    topology = build_topology(FIXTURES[name])
    first = topology.online.min()
    devices = published_devices(topology, reserved=CpuSet([first]), mode=mode, group_by=group_by)
    slices = build_resource_slices(NODE, devices, owner_uid="0d4b7a1e-5f0c-4c55-9a43-1c2c3d4e5f60")
    assert_valid(slices)
    published = [d["name"] for s in slices for d in s["spec"]["devices"]]
    assert published == [d.name for d in devices]
    for obj in slices:
        assert len(obj["spec"]["devices"]) <= MAX_DEVICES_PER_SLICE
        for device in obj["spec"]["devices"]:
            assert len(device["attributes"]) + len(device.get("capacity", {})) <= 32


# --- concrete devices of each fixture ----------------------------------------------------------


def test_dual_socket_individual_numbering_and_attributes() -> None:
    # 2 sockets x 2 NUMA x 2 L3 x 4 cores x SMT2; first threads cpu0-31, siblings +32.
    devices = devices_of("dual-socket-smt2", INDIVIDUAL)
    assert len(devices) == 64
    assert numbering(devices)[:6] == [0, 32, 1, 33, 2, 34]
    cpu16 = devices["cpudev032"]  # the 17th core: socket 1's first core
    assert cpu_of(cpu16) == 16
    assert cpu16.attributes == {
        ATTR_NUMA_NODE: 2,
        ATTR_SOCKET_ID: 1,
        ATTR_SMT_ENABLED: True,
        ATTR_CACHE_L3_ID: 4,
        ATTR_CORE_TYPE: "standard",
        ATTR_CORE_ID: 0,  # raw core_id repeats per socket, as upstream publishes it
        ATTR_CPU_ID: 16,
        ATTR_LEGACY_NUMA_NODE_ID: 2,
        ATTR_DRANET_NUMA_NODE: 2,
        ATTR_ISOLATED: False,
    }
    cpu63 = devices["cpudev063"]
    assert cpu_of(cpu63) == 63
    assert cpu63.attributes[ATTR_CORE_ID] == 15
    assert cpu63.attributes[ATTR_CACHE_L3_ID] == 7
    assert cpu63.attributes[ATTR_NUMA_NODE] == 3


def test_reserved_cpu_whose_sibling_is_free_sorts_by_the_free_sibling() -> None:
    # Upstream orders core groups by their first non-reserved CPU: with cpu0 reserved, cpu32
    # (alone on core 0) comes after cpu1..31 and their siblings. Keeping this order keeps device
    # names meaning the same CPUs as under the Go driver.
    devices = devices_of("dual-socket-smt2", INDIVIDUAL, reserved="0")
    order = numbering(devices)
    assert len(order) == 63
    assert order[:4] == [1, 33, 2, 34]
    assert order[61] == 63
    assert order[62] == 32
    assert 0 not in order


def test_reserved_full_core_is_left_out_and_numbering_restarts() -> None:
    devices = devices_of("dual-socket-smt2", INDIVIDUAL, reserved="0,32")
    assert numbering(devices)[:2] == [1, 33]
    assert len(devices) == 62
    assert "cpudev062" not in devices


def test_individual_numbering_keeps_each_cpus_number_across_topology_changes() -> None:
    machine = build_topology(FIXTURES["dual-socket-smt2"])
    fresh = individual_numbering(machine, reserved=CpuSet([0]))
    upstream = devices_of("dual-socket-smt2", INDIVIDUAL, reserved="0")
    assert {cpu_of(d): int(name[len("cpudev") :]) for name, d in upstream.items()} == fresh
    # cpu 33 goes offline, cpu 0 is no longer reserved: 33 keeps its number unpublished, every
    # other CPU keeps its own, cpu 0 gets the next number after all of them
    spec = dataclasses.replace(FIXTURES["dual-socket-smt2"], offline=CpuSet([33]))
    later = individual_numbering(build_topology(spec), reserved=CpuSet(), previous=fresh)
    assert later == {**fresh, 0: 63}
    devices = published_devices(
        build_topology(spec),
        reserved=CpuSet(),
        mode=INDIVIDUAL,
        group_by=GroupBy.NUMANODE,
        numbering=later,
    )
    names = {d.name: cpu_of(d) for d in devices}
    assert names["cpudev063"] == 0
    assert f"cpudev{fresh[33]:03d}" not in names
    assert all(names[f"cpudev{number:03d}"] == cpu for cpu, number in later.items() if cpu != 33)
    assert [d.name for d in devices] == sorted(names)  # publication order is number order
    # a numbering that lacks a published CPU is a bug of the caller, not a silent renumbering
    with pytest.raises(TopologyError, match="cpus 0 have no individual device number"):
        published_devices(
            machine, reserved=CpuSet(), mode=INDIVIDUAL, group_by=GroupBy.NUMANODE, numbering=fresh
        )


def test_dual_socket_grouped_by_numa_and_socket() -> None:
    numa = devices_of("dual-socket-smt2", GROUPED)
    assert list(numa) == ["cpudevnuma000", "cpudevnuma001", "cpudevnuma002", "cpudevnuma003"]
    assert numa["cpudevnuma002"].cpus == CpuSet.parse("16-23,48-55")
    assert numa["cpudevnuma002"].capacity == {CAPACITY_CPU: 16}
    assert numa["cpudevnuma002"].attributes == {
        ATTR_NUMA_NODE: 2,
        ATTR_SOCKET_ID: 1,
        ATTR_SMT_ENABLED: True,
        ATTR_NUM_CPUS: 16,
        ATTR_LEGACY_NUMA_NODE_ID: 2,
        ATTR_DRANET_NUMA_NODE: 2,
        ATTR_NUM_ISOLATED_CPUS: 0,
    }
    sockets = devices_of("dual-socket-smt2", GROUPED, GroupBy.SOCKET, reserved="0,32")
    assert list(sockets) == ["cpudevsocket000", "cpudevsocket001"]
    assert sockets["cpudevsocket000"].cpus == CpuSet.parse("1-15,33-47")
    assert sockets["cpudevsocket000"].capacity == {CAPACITY_CPU: 30}
    assert sockets["cpudevsocket001"].attributes[ATTR_SOCKET_ID] == 1
    assert sockets["cpudevsocket001"].capacity == {CAPACITY_CPU: 32}


def test_group_with_every_cpu_reserved_is_not_published_but_machine_always_is() -> None:
    numa = devices_of("dual-socket-smt2", GROUPED, reserved="8-15,40-47")
    assert list(numa) == ["cpudevnuma000", "cpudevnuma002", "cpudevnuma003"]
    socket = devices_of("dual-socket-smt2", GROUPED, GroupBy.SOCKET, reserved="0-15,32-47")
    assert list(socket) == ["cpudevsocket001"]
    machine = devices_of("vm-2cpu", GROUPED, GroupBy.MACHINE, reserved="0-1")
    assert list(machine) == ["cpudevmachine"]
    assert machine["cpudevmachine"].capacity == {CAPACITY_CPU: 0}
    assert machine["cpudevmachine"].cpus == CpuSet()
    slices = build_resource_slices(NODE, list(machine.values()))
    capacity = slices[0]["spec"]["devices"][0]["capacity"]
    assert capacity == {CAPACITY_CPU: {"value": "0"}}  # no request policy: min 1 > value 0
    assert_valid(slices)


def test_hybrid_desktop_core_types_and_adjacent_threads() -> None:
    # 8 P-cores x SMT2 numbered adjacently (cpu0-15), 8 E-cores (cpu16-23); core_id step 4.
    devices = devices_of("hybrid-desktop", INDIVIDUAL)
    assert numbering(devices) == list(range(24))
    assert devices["cpudev000"].attributes[ATTR_CORE_TYPE] == "p-core"
    assert devices["cpudev015"].attributes[ATTR_CORE_TYPE] == "p-core"
    assert devices["cpudev016"].attributes[ATTR_CORE_TYPE] == "e-core"
    assert devices["cpudev023"].attributes[ATTR_CORE_TYPE] == "e-core"
    assert devices["cpudev002"].attributes[ATTR_CORE_ID] == 4
    assert devices["cpudev003"].attributes[ATTR_CORE_ID] == 4
    assert devices["cpudev016"].attributes[ATTR_CORE_ID] == 32
    assert devices["cpudev023"].attributes[ATTR_SMT_ENABLED] is True
    grouped = devices_of("hybrid-desktop", GROUPED)
    assert list(grouped) == ["cpudevnuma000"]
    assert grouped["cpudevnuma000"].capacity == {CAPACITY_CPU: 24}


def test_arm64_l3_named_by_lowest_cpu_and_smt_disabled() -> None:
    devices = devices_of("arm64-server", INDIVIDUAL)
    assert numbering(devices) == list(range(32))
    assert devices["cpudev000"].attributes[ATTR_CACHE_L3_ID] == 0
    assert devices["cpudev016"].attributes[ATTR_CACHE_L3_ID] == 16
    assert devices["cpudev016"].attributes[ATTR_NUMA_NODE] == 1
    assert devices["cpudev031"].attributes[ATTR_SMT_ENABLED] is False
    grouped = devices_of("arm64-server", GROUPED)
    assert [d.capacity for d in grouped.values()] == [{CAPACITY_CPU: 16}, {CAPACITY_CPU: 16}]


def test_smt4_adjacent_threads_are_numbered_in_cpu_order() -> None:
    # 2 sockets x 2 L3 x 4 cores x SMT4, threads numbered adjacently. Upstream pairs no thread
    # of a 4-thread core, so the numbering is plain CPU order, which keeps a core's threads
    # together here since the kernel numbers them adjacently.
    devices = devices_of("smt4", INDIVIDUAL, reserved="1")
    assert numbering(devices)[:7] == [0, 2, 3, 4, 5, 6, 7]
    assert [devices[f"cpudev00{i}"].attributes[ATTR_CORE_ID] for i in range(7)] == [
        0, 0, 0, 1, 1, 1, 1,
    ]  # fmt: skip
    cpu32 = devices["cpudev031"]
    assert cpu_of(cpu32) == 32
    assert cpu32.attributes[ATTR_SOCKET_ID] == 1
    assert cpu32.attributes[ATTR_CORE_ID] == 0
    assert cpu32.attributes[ATTR_NUMA_NODE] == 1
    assert cpu32.attributes[ATTR_CACHE_L3_ID] == 2


def test_offline_and_isolated_cpus() -> None:
    # 16 CPUs, 2 NUMA x 4 cores x SMT2, siblings +8; cpu5,14,15 offline; isolcpus 2,7,10,14.
    devices = devices_of("offline-isolated", INDIVIDUAL)
    assert numbering(devices) == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 6, 7, 13]
    isolated = [cpu_of(d) for d in devices.values() if d.attributes[ATTR_ISOLATED]]
    assert sorted(isolated) == [2, 7, 10]
    assert all(isinstance(d.attributes[ATTR_ISOLATED], bool) for d in devices.values())
    grouped = devices_of("offline-isolated", GROUPED)
    assert grouped["cpudevnuma000"].cpus == CpuSet.parse("0-3,8-11")
    assert grouped["cpudevnuma000"].attributes[ATTR_NUM_ISOLATED_CPUS] == 2
    assert grouped["cpudevnuma001"].cpus == CpuSet.parse("4,6-7,12-13")
    assert grouped["cpudevnuma001"].capacity == {CAPACITY_CPU: 5}
    assert grouped["cpudevnuma001"].attributes[ATTR_NUM_ISOLATED_CPUS] == 1


def test_vm_two_cpus() -> None:
    devices = devices_of("vm-2cpu", INDIVIDUAL)
    assert numbering(devices) == [0, 1]
    assert devices["cpudev001"].attributes[ATTR_SMT_ENABLED] is False
    assert devices_of("vm-2cpu", GROUPED, GroupBy.MACHINE)["cpudevmachine"].capacity == {
        CAPACITY_CPU: 2
    }
    assert devices_of("vm-2cpu", INDIVIDUAL, reserved="0-1") == {}


def test_big_1024_individual_splits_into_128_device_slices() -> None:
    topology = build_topology(FIXTURES["big-1024"])
    devices = published_devices(
        topology, reserved=CpuSet.parse("0,512"), mode=INDIVIDUAL, group_by=GroupBy.NUMANODE
    )
    assert len(devices) == 1022
    assert devices[0].name == "cpudev000"
    assert cpu_of(devices[0]) == 1
    assert cpu_of(devices[1]) == 513
    assert devices[1000].name == "cpudev1000"  # %03d only pads; wider numbers just grow
    slices = build_resource_slices(NODE, devices, generation=7)
    assert [len(s["spec"]["devices"]) for s in slices] == [128] * 7 + [126]
    assert [s["metadata"]["name"] for s in slices] == [f"{NODE}-dra.cpu-{i:03d}" for i in range(8)]
    for obj in slices:
        assert obj["spec"]["pool"] == {"name": NODE, "generation": 7, "resourceSliceCount": 8}
        assert obj["spec"]["nodeName"] == NODE
        assert obj["spec"]["driver"] == DRIVER_NAME
    assert slices[1]["spec"]["devices"][0]["name"] == "cpudev128"
    for obj in slices[:2]:  # the schema check is slow on 128-device slices: two suffice
        schema_check(obj)
    assert_valid(slices, schema=False)


# --- against the model of the Go driver, on each fixture's sysfs tree ---------------------------

# What we add to upstream's devices (docs/devices.md): our attributes, and the request policy.
OUR_ATTRIBUTES = (ATTR_ISOLATED, ATTR_NUM_ISOLATED_CPUS)


@pytest.fixture(scope="module")
def sysfs_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every fixture machine written once as a host root."""
    base = tmp_path_factory.mktemp("machines")
    roots = {}
    for name, spec in FIXTURES.items():
        write_sysfs(spec, base / name)
        roots[name] = base / name
    return roots


def without_our_additions(device: dict[str, Any]) -> dict[str, Any]:
    device = copy.deepcopy(device)
    for key in OUR_ATTRIBUTES:
        device["attributes"].pop(key, None)
    for entry in device.get("capacity", {}).values():
        policy = entry.pop("requestPolicy", None)
        if policy is not None:  # whole CPUs; by default the whole group, as without a policy
            assert policy["default"] == entry["value"]
            assert policy["validRange"]["min"] == "1"
    return device


UPSTREAM_CASES = [
    (INDIVIDUAL, GroupBy.NUMANODE),
    (GROUPED, GroupBy.NUMANODE),
    (GROUPED, GroupBy.SOCKET),
    (GROUPED, GroupBy.MACHINE),
]


@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize(("mode", "group_by"), UPSTREAM_CASES)
@pytest.mark.parametrize("expose", [False, True], ids=["plain", "pcie+allocatable"])
def test_devices_are_the_go_drivers(
    sysfs_roots: dict[str, Path], name: str, mode: CpuDeviceMode, group_by: GroupBy, expose: bool
) -> None:
    root = sysfs_roots[name]
    machine = upstream_driver.read_machine(root)
    topology = read_topology(root, pcie_roots=expose)
    options = SliceOptions(node_allocatable=expose, expose_pcie_roots=expose)
    first = min(machine.online)
    for reserved in (set(), {first}, set(machine.online[: len(machine.online) // 2])):
        devices = published_devices(
            topology, reserved=CpuSet(reserved), mode=mode, group_by=group_by
        )
        slices = build_resource_slices(NODE, devices, options=options)
        ours = [without_our_additions(d) for s in slices for d in s["spec"]["devices"]]
        if mode is INDIVIDUAL:
            theirs = upstream_driver.individual_devices(
                machine, reserved, expose=expose, allocatable=expose
            )
        else:
            theirs = upstream_driver.grouped_devices(
                machine, reserved, group_by.value, expose=expose, allocatable=expose
            )
        assert ours == theirs, reserved
        per_slice = upstream_driver.devices_per_slice(expose)
        assert [len(s["spec"]["devices"]) for s in slices][:-1] == [per_slice] * (len(slices) - 1)
        assert validate_pool(slices) == []
        for obj in slices:
            assert validate_slice(obj) == []


def test_the_model_sees_pcie_roots_and_missing_numa_nodes(sysfs_roots: dict[str, Path]) -> None:
    # The comparison above is only as good as the model: make sure it reads what matters.
    dual = upstream_driver.read_machine(sysfs_roots["dual-socket-smt2"])
    assert dual.pcie["pci0000:3a"] == [*range(8), *range(32, 40)]
    assert dual.pcie["pci0001:00"] == list(range(64))
    assert dual.cpus[32].sibling == 0
    unlinked = upstream_driver.read_machine(sysfs_roots["no-numa-node"])
    assert sorted(unlinked.cpus) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert unlinked.online == list(range(16))
    knl = upstream_driver.read_machine(sysfs_roots["knl-smt4"])
    assert {c.sibling for c in knl.cpus.values()} == {-1}
    assert {c.l3 for c in knl.cpus.values()} == {-1}


def test_kernel_without_numa_puts_every_cpu_on_node_0_unlike_upstream(tmp_path: Path) -> None:
    # A deliberate difference (docs/devices.md): upstream finds no cpuN/nodeX entry, skips every
    # CPU and publishes nothing but cpudevmachine; the kernel itself runs every CPU on node 0.
    spec = MachineSpec(cores_per_cluster=4, numa_sysfs=False, smt_control="notsupported")
    write_sysfs(spec, tmp_path)
    assert upstream_driver.read_machine(tmp_path).cpus == {}
    topology = read_topology(tmp_path)
    assert topology.numa_in_sysfs is False
    devices = published_devices(
        topology, reserved=CpuSet(), mode=INDIVIDUAL, group_by=GroupBy.NUMANODE
    )
    assert [d.attributes[ATTR_NUMA_NODE] for d in devices] == [0, 0, 0, 0]


# --- PCIe roots and the node-allocatable mapping --------------------------------------------------


def test_pcie_roots_individual_and_grouped() -> None:
    topology = build_topology(FIXTURES["dual-socket-smt2"], pcie_roots=True)
    individual = devices_by_name(
        published_devices(topology, reserved=CpuSet(), mode=INDIVIDUAL, group_by=GroupBy.NUMANODE)
    )
    # cpu0 (numa 0): the two roots of node 0 and the one local to every CPU, sorted by name
    assert individual["cpudev000"].attributes[ATTR_PCIE_ROOT] == (
        "pci0000:00",
        "pci0000:3a",
        "pci0001:00",
    )
    # cpu63 (numa 3)
    assert individual["cpudev063"].attributes[ATTR_PCIE_ROOT] == (
        "pci0000:ae",
        "pci0000:d7",
        "pci0001:00",
    )
    # ours stays last: upstream's attributes first
    assert list(individual["cpudev000"].attributes)[-2:] == [ATTR_PCIE_ROOT, ATTR_ISOLATED]
    sockets = devices_by_name(
        published_devices(topology, reserved=CpuSet(), mode=GROUPED, group_by=GroupBy.SOCKET)
    )
    assert sockets["cpudevsocket001"].attributes[ATTR_PCIE_ROOT] == (
        "pci0000:80",
        "pci0000:ae",
        "pci0000:d7",
        "pci0001:00",
    )
    slices = build_resource_slices(
        NODE, list(individual.values()), options=SliceOptions(expose_pcie_roots=True)
    )
    assert slices[0]["spec"]["devices"][0]["attributes"][ATTR_PCIE_ROOT] == {
        "strings": ["pci0000:00", "pci0000:3a", "pci0001:00"]
    }
    assert [len(s["spec"]["devices"]) for s in slices] == [64]
    assert_valid(slices)


def test_a_cpu_without_local_roots_gets_no_attribute() -> None:
    spec = dataclasses.replace(FIXTURES["dual-socket-smt2"], pci_roots=(PciRoot("pci0000:00", 0),))
    topology = build_topology(spec, pcie_roots=True)
    devices = published_devices(
        topology, reserved=CpuSet(), mode=GROUPED, group_by=GroupBy.NUMANODE
    )
    assert [ATTR_PCIE_ROOT in d.attributes for d in devices] == [True, False, False, False]


def test_expose_pcie_roots_caps_slices_at_64_even_without_roots() -> None:
    # upstream Config.DevicesPerResourceSlice: the flag decides, not the attributes
    devices = list(devices_of("big-1024", INDIVIDUAL).values())
    plain = build_resource_slices(NODE, devices)
    capped = build_resource_slices(NODE, devices, options=SliceOptions(expose_pcie_roots=True))
    assert [len(s["spec"]["devices"]) for s in plain] == [128] * 8
    assert [len(s["spec"]["devices"]) for s in capped] == [64] * 16
    assert ATTR_PCIE_ROOT not in capped[0]["spec"]["devices"][0]["attributes"]
    assert_valid(capped, schema=False)


def test_too_many_roots_for_one_device_is_a_clear_error() -> None:
    roots = tuple(PciRoot(f"pci{n:04x}:00", None) for n in range(46))
    spec = dataclasses.replace(FIXTURES["vm-2cpu"], pci_roots=roots)
    topology = build_topology(spec, pcie_roots=True)
    # machine: smtEnabled, numCPUs, numIsolatedCPUs + 45 roots = 48 values: the limit
    fits = dataclasses.replace(spec, pci_roots=roots[:45])
    published_devices(
        build_topology(fits, pcie_roots=True),
        reserved=CpuSet(),
        mode=GROUPED,
        group_by=GroupBy.MACHINE,
    )
    with pytest.raises(TopologyError, match=r"cpudevmachine: 46 PCIe roots .* 49 attribute values"):
        published_devices(topology, reserved=CpuSet(), mode=GROUPED, group_by=GroupBy.MACHINE)


@pytest.mark.parametrize("mode", list(CpuDeviceMode))
def test_node_allocatable_mapping_is_upstreams_and_valid(mode: CpuDeviceMode) -> None:
    devices = list(devices_of("offline-isolated", mode).values())
    slices = build_resource_slices(NODE, devices, options=SliceOptions(node_allocatable=True))
    mapping = {
        INDIVIDUAL: {"deviceMultiplier": "1"},
        GROUPED: {"capacityKey": CAPACITY_CPU, "capacityMultiplier": "1"},
    }[mode]
    for device in slices[0]["spec"]["devices"]:
        assert device["nodeAllocatableResources"] == {"cpu": {"mapping": mapping}}
    assert_valid(slices)
    plain = build_resource_slices(NODE, devices)
    assert all("nodeAllocatableResources" not in d for d in plain[0]["spec"]["devices"])


def test_validator_enforces_node_allocatable_rules() -> None:
    def device(resources: Any) -> dict[str, Any]:
        return {
            "name": "d",
            "allowMultipleAllocations": True,
            "capacity": {CAPACITY_CPU: {"value": "8"}},
            "nodeAllocatableResources": resources,
        }

    good: list[Any] = [
        {"cpu": {"mapping": {"capacityKey": CAPACITY_CPU, "capacityMultiplier": "1"}}},
        {"memory": {"mapping": {"deviceMultiplier": "1Gi"}}},
        {"hugepages-2Mi": {"overhead": {"perPod": "0"}}},
        {"cpu": {"mapping": {"deviceMultiplier": "1"}, "overhead": {"perContainer": "100m"}}},
    ]
    for resources in good:
        assert validate_slice(_slice_with([device(resources)])) == [], resources
    bad: list[tuple[Any, str]] = [
        ({"ephemeral-storage": {"mapping": {"deviceMultiplier": "1"}}}, "resource name"),
        ({"cpu": {}}, "at least one of mapping or overhead"),
        (
            {"cpu": {"mapping": {"capacityKey": "dra.cpu/other", "capacityMultiplier": "1"}}},
            "not a capacity",
        ),
        ({"cpu": {"mapping": {"capacityKey": CAPACITY_CPU}}}, "capacityMultiplier: required"),
        ({"cpu": {"mapping": {"capacityMultiplier": "1"}}}, "exactly one of"),
        (
            {"cpu": {"mapping": {"capacityKey": CAPACITY_CPU, "capacityMultiplier": "0"}}},
            "positive",
        ),
        ({"cpu": {"mapping": {"deviceMultiplier": "-1"}}}, "positive"),
        (
            {"cpu": {"mapping": {"deviceMultiplier": "1", "capacityKey": CAPACITY_CPU}}},
            "exactly one",
        ),
        ({"cpu": {"overhead": {}}}, "perPod or perContainer"),
        ({"cpu": {"overhead": {"perPod": "-1"}}}, ">= 0"),
        ([], "must be an object"),
    ]
    for resources, message in bad:
        errors = validate_slice(_slice_with([device(resources)]))
        assert any(message in e for e in errors), (resources, errors)


# --- the wire form -----------------------------------------------------------------------------


def test_wire_form_of_individual_and_grouped_devices() -> None:
    individual = list(devices_of("offline-isolated", INDIVIDUAL).values())
    (obj,) = build_resource_slices(NODE, individual[4:5])
    assert obj == {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-dra.cpu-000"},
        "spec": {
            "driver": "dra.cpu",
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "cpudev004",
                    "attributes": {
                        "resource.kubernetes.io/numaNode": {"int": 0},
                        "dra.cpu/socketID": {"int": 0},
                        "dra.cpu/smtEnabled": {"bool": True},
                        "dra.cpu/cacheL3ID": {"int": 0},
                        "dra.cpu/coreType": {"string": "standard"},
                        "dra.cpu/coreID": {"int": 2},
                        "dra.cpu/cpuID": {"int": 2},
                        "dra.cpu/numaNodeID": {"int": 0},
                        "dra.net/numaNode": {"int": 0},
                        "dra.cpu/isolated": {"bool": True},
                    },
                }
            ],
        },
    }
    grouped = list(devices_of("offline-isolated", GROUPED).values())
    (obj,) = build_resource_slices(NODE, grouped, owner_uid="uid-1", generation=3)
    assert obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "uid-1", "controller": True}
    ]
    numa1 = obj["spec"]["devices"][1]
    assert numa1["name"] == "cpudevnuma001"
    assert numa1["allowMultipleAllocations"] is True
    assert numa1["capacity"] == {
        "dra.cpu/cpu": {
            "value": "5",
            # default: the whole group, what a request without capacity.requests consumes
            "requestPolicy": {"default": "5", "validRange": {"min": "1", "step": "1"}},
        }
    }
    assert numa1["attributes"]["dra.cpu/numCPUs"] == {"int": 5}
    assert numa1["attributes"]["dra.cpu/numIsolatedCPUs"] == {"int": 1}
    (fallback,) = build_resource_slices(NODE, grouped, consumable_capacity=False)
    assert fallback["spec"]["devices"][1]["capacity"] == {"dra.cpu/cpu": {"value": "5"}}
    assert fallback["spec"]["devices"][1]["allowMultipleAllocations"] is True


def test_one_cpu_group_gets_a_policy_without_step() -> None:
    # min + step must not exceed the capacity value, so a 1-CPU group has no step.
    devices = devices_of("vm-2cpu", GROUPED, GroupBy.SOCKET, reserved="0")
    slices = build_resource_slices(NODE, list(devices.values()))
    capacity = slices[0]["spec"]["devices"][0]["capacity"]["dra.cpu/cpu"]
    assert capacity == {"value": "1", "requestPolicy": {"default": "1", "validRange": {"min": "1"}}}
    assert_valid(slices)
    broken = copy.deepcopy(slices[0])
    broken["spec"]["devices"][0]["capacity"]["dra.cpu/cpu"]["requestPolicy"]["validRange"][
        "step"
    ] = "1"
    assert any("step" in e for e in validate_slice(broken))


def test_no_devices_still_publishes_one_empty_slice() -> None:
    slices = build_resource_slices(NODE, [])
    assert len(slices) == 1
    assert slices[0]["spec"]["devices"] == []
    assert slices[0]["spec"]["pool"]["resourceSliceCount"] == 1
    assert_valid(slices)


def test_bad_node_name_and_generation_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="Node_A"):
        build_resource_slices("Node_A", [])
    with pytest.raises(ConfigError, match="generation"):
        build_resource_slices(NODE, [], generation=-1)


def test_long_node_name_gives_a_valid_unique_slice_name() -> None:
    long_a = "a" * 240 + ".example"
    long_b = "a" * 240 + ".exampld"
    name_a, name_b = slice_name(long_a, 0), slice_name(long_b, 0)
    assert len(name_a) <= 253
    assert name_a != name_b
    assert name_a.endswith("-dra.cpu-000")
    (obj,) = build_resource_slices(long_a, [])
    assert obj["metadata"]["name"] == name_a
    assert validate_slice(obj) == []
    assert slice_name(NODE, 12) == "node-a-dra.cpu-012"


def test_cpus_of_no_numa_node_are_published_only_by_the_machine_device() -> None:
    # 2 NUMA x 4 cores x SMT2, siblings +8; node 1 (cpu4-7,12-15) is not online.
    individual = devices_of("no-numa-node", INDIVIDUAL)
    assert numbering(individual) == [0, 8, 1, 9, 2, 10, 3, 11]
    numa = devices_of("no-numa-node", GROUPED)
    assert list(numa) == ["cpudevnuma000"]
    assert numa["cpudevnuma000"].cpus == CpuSet.parse("0-3,8-11")
    sockets = devices_of("no-numa-node", GROUPED, GroupBy.SOCKET)
    assert sockets["cpudevsocket000"].capacity == {CAPACITY_CPU: 8}
    machine = devices_of("no-numa-node", GROUPED, GroupBy.MACHINE)
    assert machine["cpudevmachine"].cpus == CpuSet.parse("0-15")
    assert machine["cpudevmachine"].capacity == {CAPACITY_CPU: 16}


def test_machine_of_cpus_without_any_numa_node_publishes_only_cpudevmachine() -> None:
    cpus = {
        c: CpuInfo(
            cpu_id=c, socket_id=0, die_id=0, cluster_id=-1, core_id=c, numa_node=-1, l3_id=None
        )
        for c in range(2)
    }
    topology = Topology(cpus=cpus, smt_enabled=False)
    for mode, group_by in ((GROUPED, GroupBy.NUMANODE), (GROUPED, GroupBy.SOCKET)):
        assert published_devices(topology, reserved=CpuSet(), mode=mode, group_by=group_by) == []
    assert (
        published_devices(topology, reserved=CpuSet(), mode=INDIVIDUAL, group_by=GroupBy.NUMANODE)
        == []
    )
    (machine,) = published_devices(
        topology, reserved=CpuSet(), mode=GROUPED, group_by=GroupBy.MACHINE
    )
    assert machine.capacity == {CAPACITY_CPU: 2}
    assert_valid(build_resource_slices(NODE, [machine]))


def test_knl_smt4_numbers_four_thread_cores_in_cpu_order_without_l3() -> None:
    # 16 cores x SMT4, siblings +16: cpu0,16,32,48 are core 0. Upstream pairs only cores of
    # exactly two threads, so these CPUs are numbered in CPU order; no L3: cacheL3ID -1.
    devices = devices_of("knl-smt4", INDIVIDUAL)
    assert numbering(devices) == list(range(64))
    assert {d.attributes[ATTR_CACHE_L3_ID] for d in devices.values()} == {NO_L3_CACHE}
    assert devices["cpudev016"].attributes[ATTR_CORE_ID] == 0
    # Siblings are counted among the online CPUs, reserved ones included: reserving two threads
    # of core 0 pairs nothing, taking them offline pairs the other two.
    reserved = devices_of("knl-smt4", INDIVIDUAL, reserved="32,48")
    assert numbering(reserved)[:4] == [0, 1, 2, 3]
    offline = dataclasses.replace(FIXTURES["knl-smt4"], offline=CpuSet.parse("32,48"))
    devices = devices_by_name(
        published_devices(
            build_topology(offline), reserved=CpuSet(), mode=INDIVIDUAL, group_by=GroupBy.NUMANODE
        )
    )
    assert numbering(devices)[:4] == [0, 16, 1, 2]


# --- limits and the validator --------------------------------------------------------------------


def _wire_device(name: str, **attributes: Any) -> dict[str, Any]:
    return {"name": name, "attributes": attributes}


def test_list_typed_attribute_halves_the_device_limit() -> None:
    plain = [_wire_device("d", **{"dra.cpu/cpuID": {"int": 1}})]
    listed = [_wire_device("d", **{"resource.kubernetes.io/pcieRoot": {"strings": ["pci0000:00"]}})]
    assert max_devices_per_slice(plain) == MAX_DEVICES_PER_SLICE
    assert max_devices_per_slice(listed) == MAX_DEVICES_PER_SLICE_ADVANCED
    assert max_devices_per_slice([{"name": "d", "taints": [{"key": "k"}]}]) == 64


def _slice_with(devices: list[dict[str, Any]]) -> dict[str, Any]:
    (obj,) = build_resource_slices(NODE, [])
    obj["spec"]["devices"] = devices
    return obj


def test_validator_enforces_device_counts() -> None:
    many = [_wire_device(f"d{i}", **{"dra.cpu/cpuID": {"int": i}}) for i in range(129)]
    assert validate_slice(_slice_with(many[:128])) == []
    assert any("129 devices, at most 128" in e for e in validate_slice(_slice_with(many)))
    listed = [_wire_device(f"d{i}", **{"a.b/roots": {"strings": ["x"]}}) for i in range(65)]
    assert validate_slice(_slice_with(listed[:64])) == []
    assert any("at most 64" in e for e in validate_slice(_slice_with(listed)))
    duplicate = [_wire_device("d0"), _wire_device("d0")]
    assert any("duplicate" in e for e in validate_slice(_slice_with(duplicate)))


def test_validator_enforces_attribute_limits_and_names() -> None:
    too_many = {f"dra.cpu/a{i}": {"int": i} for i in range(33)}
    assert any(
        "33 attributes" in e for e in validate_slice(_slice_with([_wire_device("d", **too_many)]))
    )
    bad_names = {
        "dra.cpu/" + "x" * 33: {"int": 1},  # identifier longer than 32
        "dra.cpu/1abc": {"int": 1},  # not a C identifier
        "Bad_Domain/abc": {"int": 1},  # domain not a DNS subdomain
        ("d" * 64) + "/abc": {"int": 1},  # domain longer than 63
        "a/b/c": {"int": 1},
        "/abc": {"int": 1},
        "dra.cpu/": {"int": 1},
    }
    for key, attribute in bad_names.items():
        errors = validate_slice(_slice_with([_wire_device("d", **{key: attribute})]))
        assert errors, key
    good = {"plain_id": {"int": 1}, "dra.cpu/" + "x" * 32: {"bool": True}}
    assert validate_slice(_slice_with([_wire_device("d", **good)])) == []
    bad_values: list[dict[str, Any]] = [
        {"int": 1, "bool": True},
        {},
        {"string": "x" * 65},
        {"version": "1.2"},
        {"int": True},
        {"ints": []},
        {"float": 1.5},
    ]
    for attribute in bad_values:
        errors = validate_slice(_slice_with([_wire_device("d", **{"dra.cpu/x": attribute})]))
        assert errors, attribute
    assert (
        validate_slice(_slice_with([_wire_device("d", **{"dra.cpu/v": {"version": "1.2.3-rc.1"}})]))
        == []
    )
    for bad_device_name in ("CPU0", "-a", "a" * 64, ""):
        assert validate_slice(_slice_with([_wire_device(bad_device_name)])), bad_device_name


def test_validator_enforces_request_policy_rules() -> None:
    def device(value: str, policy: dict[str, Any], multi: bool = True) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "name": "d",
            "capacity": {"dra.cpu/cpu": {"value": value, "requestPolicy": policy}},
        }
        if multi:
            wire["allowMultipleAllocations"] = True
        return wire

    ok = {"default": "1", "validRange": {"min": "1", "step": "1"}}
    assert validate_slice(_slice_with([device("8", ok)])) == []
    assert validate_slice(_slice_with([device("8", ok, multi=False)]))
    invalid: list[dict[str, Any]] = [
        {"validRange": {"min": "1"}},  # default required
        {"default": "1", "validRange": {"min": "9"}},  # min above the value
        {"default": "2", "validRange": {"min": "1", "step": "2"}},  # default off the step grid
        {"default": "1", "validRange": {"min": "1", "max": "9"}},  # max above the value
        {"default": "1", "validValues": ["2", "1"]},  # not ascending
        {"default": "3", "validValues": ["1", "2"]},  # default not an option
        {"default": "1", "validValues": ["1"], "validRange": {"min": "1"}},
        {"default": "1", "validRange": {"step": "1"}},  # min required
    ]
    for policy in invalid:
        assert validate_slice(_slice_with([device("8", policy)])), policy
    assert (
        validate_slice(
            _slice_with([device("8", {"default": "500m", "validRange": {"min": "500m"}})])
        )
        == []
    )
    assert validate_slice(_slice_with([device("eight", ok)]))


def test_validator_reads_quantities_with_bounded_arithmetic() -> None:
    """Capacity values and request policies use dracpu.core.quantity: exact values, and a
    hostile exponent is refused instead of computed."""

    def device(value: object, policy: dict[str, Any] | None = None) -> dict[str, Any]:
        entry: dict[str, Any] = {"value": value}
        if policy is not None:
            entry["requestPolicy"] = policy
        return {"name": "d", "allowMultipleAllocations": True, "capacity": {"dra.cpu/cpu": entry}}

    assert validate_slice(_slice_with([device("8Ki")])) == []
    assert validate_slice(_slice_with([device("1.5e3")])) == []
    # 0.1 + 0.2 == 0.3 exactly: the step grid is checked on fractions, not floats
    policy = {"default": "300m", "validRange": {"min": "100m", "step": "100m"}}
    assert validate_slice(_slice_with([device("1", policy)])) == []
    started = time.perf_counter()
    errors = validate_slice(_slice_with([device("1e999999999")]))
    assert time.perf_counter() - started < 0.5
    assert errors == [
        "spec.devices[0].capacity[dra.cpu/cpu].value: '1e999999999' is out of range: the "
        "decimal exponent must be within +-40"
    ]
    errors = validate_slice(_slice_with([device("8", {"default": "1e-999999999"})]))
    assert any("requestPolicy.default: '1e-999999999' is out of range" in e for e in errors)
    assert validate_slice(_slice_with([device("8\n")])) == [
        "spec.devices[0].capacity[dra.cpu/cpu].value: '8\\n' is not a Kubernetes quantity"
    ]
    assert validate_slice(_slice_with([device(8)])) == [
        "spec.devices[0].capacity[dra.cpu/cpu].value: 8 is not a quantity string"
    ]


def test_validator_enforces_spec_and_pool() -> None:
    (obj,) = build_resource_slices(NODE, [])
    cases: list[tuple[str, Any]] = [
        ("driver", "Not A Driver"),
        ("driver", "d" * 64),
        ("nodeName", "Node_A"),
        ("allNodes", True),  # a second node selection field
    ]
    for key, value in cases:
        broken = copy.deepcopy(obj)
        broken["spec"][key] = value
        assert validate_slice(broken), (key, value)
    for key, value in (("generation", -1), ("resourceSliceCount", 0), ("name", "")):
        broken = copy.deepcopy(obj)
        broken["spec"]["pool"][key] = value
        assert validate_slice(broken), (key, value)
    for top, value in (("apiVersion", "resource.k8s.io/v1beta1"), ("kind", "Pod")):
        broken = copy.deepcopy(obj)
        broken[top] = value
        assert validate_slice(broken), top
    broken = copy.deepcopy(obj)
    broken["metadata"]["name"] = "UPPER"
    assert validate_slice(broken)


def test_pool_validator_catches_inconsistent_slices() -> None:
    devices = list(devices_of("big-1024", INDIVIDUAL).values())
    slices = build_resource_slices(NODE, devices)
    assert validate_pool(slices) == []
    assert validate_pool(slices[:-1])  # resourceSliceCount 8, only 7 slices
    mixed = copy.deepcopy(slices)
    mixed[0]["spec"]["pool"]["generation"] = 2
    assert any("generation" in e for e in validate_pool(mixed))
    twice = copy.deepcopy(slices)
    twice[1]["spec"]["devices"][0]["name"] = "cpudev000"
    assert any("cpudev000" in e for e in validate_pool(twice))


# --- the diff a publisher sends -----------------------------------------------------------------

DUAL = build_topology(FIXTURES["dual-socket-smt2"])


def _stored(obj: dict[str, Any], version: str) -> dict[str, Any]:
    """``obj`` as the server stores it: with a uid and a resourceVersion."""
    metadata = {
        **obj["metadata"],
        "uid": f"uid-{obj['metadata']['name']}",
        "resourceVersion": version,
    }
    return {**obj, "metadata": metadata}


def test_slice_writes_creates_updates_and_deletes() -> None:
    devices = published_devices(DUAL, reserved=CpuSet(), mode=INDIVIDUAL, group_by=GroupBy.NUMANODE)
    wanted = build_resource_slices("node-a", devices)  # 64 devices: one slice
    assert len(wanted) == 1
    assert slice_writes([], wanted) == SliceWrites(delete=(), write=((wanted[0], None),))
    same = _stored(wanted[0], "7")
    assert slice_writes([same], wanted) == SliceWrites(delete=(), write=())
    edited = copy.deepcopy(same)
    edited["spec"]["devices"].pop()
    assert slice_writes([edited], wanted) == SliceWrites(delete=(), write=((wanted[0], "7"),))
    other = _stored({**wanted[0], "metadata": {"name": "node-a-gpu-0"}}, "3")  # another layout
    writes = slice_writes([same, other], wanted)
    assert writes.delete == (other,)
    assert writes.write == ()


def test_what_the_server_dropped_is_no_difference() -> None:
    devices = published_devices(DUAL, reserved=CpuSet(), mode=GROUPED, group_by=GroupBy.NUMANODE)
    [wanted] = build_resource_slices("node-a", devices)
    answered = copy.deepcopy(wanted)
    for device in answered["spec"]["devices"]:  # a server without DRAConsumableCapacity
        device.pop("allowMultipleAllocations")
        device["capacity"]["dra.cpu/cpu"].pop("requestPolicy")
    assert consumable_capacity_dropped(wanted, answered)
    assert not consumable_capacity_dropped(wanted, wanted)
    stored = _stored(answered, "9")
    assert slice_writes([stored], [wanted]).write == ((wanted, "9"),)  # looks changed ...
    record = {"node-a-dra.cpu-000": (slice_content(wanted), slice_content(answered))}
    assert slice_writes([stored], [wanted], record).write == ()  # ... but is what we sent


def test_the_pool_generation_never_goes_back() -> None:
    assert next_generation(0, 0, changed=False) == 1  # first publication
    assert next_generation(0, 41, changed=False) == 42  # a restart: above what is there
    assert next_generation(5, 5, changed=False) == 5  # a repair keeps it
    assert next_generation(5, 5, changed=True) == 6  # new content
    assert next_generation(5, 9, changed=False) == 10  # someone published higher
    assert pool_generation({"spec": {"pool": {"generation": 3}}}) == 3
    assert pool_generation({"spec": {"pool": {"generation": True}}}) == 0
