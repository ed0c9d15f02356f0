"""``dra.cpu/cpuIDs`` and ``dra.cpu/smtLayout`` (allocator external) against a model of
upstream's rules written from its documents, on every simulator topology.

The model shares no code with :mod:`dracpu.core.external_attributes`: it reads the siblings
from the sysfs files the simulator writes (``thread_siblings_list`` of every online CPU) and
the rules from kubernetes-sigs/dra-driver-cpu 0.3 ``docs/user/device-attributes.md`` ("External
allocator attributes", "Versioned attributes") and ``docs/dev/smt-layout.md``: entries
``cpuset[>S]`` joined by ``;``, strided entries in ascending stride order then the sibling-less
one, node-wide (reserved CPUs included), string values at most 64 bytes (the API server's
``DeviceAttributeMaxValueLength``); a node upstream refuses (3+ threads a core, a value over the
limit) publishes no such attribute here. The published slices pass ``kubernetes-validate``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy, published_devices
from dracpu.core.external_attributes import left_out
from dracpu.core.slices import SliceOptions, build_resource_slices
from dracpu.sim.sysfs_writer import sysfs_tree
from dracpu.sim.topologies import FIXTURES, build_topology
from tests.core.test_slices import assert_valid

CPU_IDS = "dra.cpu/cpuIDs"
SMT_LAYOUT = "dra.cpu/smtLayout"
LIMIT = 64


def _ids(text: str) -> list[int]:
    """A Linux cpu list (``0-3,8``), parsed by the model itself."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


def _list(cpus: list[int]) -> str:
    """The Linux list format of sorted CPUs, written by the model itself."""
    runs: list[str] = []
    cpus = sorted(cpus)
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        runs.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(runs)


def _siblings_from_sysfs(name: str) -> dict[int, list[int]]:
    """Each online CPU's thread siblings (itself included), from the simulated sysfs files."""
    files, _ = sysfs_tree(FIXTURES[name])
    online = _ids(files["sys/devices/system/cpu/online"])
    out: dict[int, list[int]] = {}
    for cpu in online:
        path = f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        # the kernel lists online siblings only
        out[cpu] = [c for c in _ids(files[path]) if c in online]
    return out


def _device_cpus(name: str, device: str, reserved: list[int]) -> list[int]:
    """A grouped device's CPUs from the sysfs files (devices.md): the online, non-reserved CPUs
    of its NUMA node or socket that the kernel links to a NUMA node; the machine: all online."""
    files, _ = sysfs_tree(FIXTURES[name])
    online = _ids(files["sys/devices/system/cpu/online"])
    with_node: dict[int, int] = {}
    for path, text in files.items():
        parts = path.split("/")
        if path.startswith("sys/devices/system/node/node") and parts[-1] == "cpulist":
            for cpu in _ids(text):
                with_node[cpu] = int(parts[-2][4:])
    if device == "cpudevmachine":
        members = online
    elif device.startswith("cpudevnuma"):
        members = [c for c, node in with_node.items() if node == int(device[10:])]
    else:
        package = "sys/devices/system/cpu/cpu{}/topology/physical_package_id"
        socket_id = int(device[12:])
        members = [c for c in with_node if int(files[package.format(c)]) == socket_id]
    return sorted(c for c in members if c in online and c not in reserved)


def expected_layout(name: str) -> str | None:
    """``smtLayout`` V1 as the documents describe it; ``None`` where upstream refuses."""
    siblings = _siblings_from_sysfs(name)
    if any(len(group) > 2 for group in siblings.values()):
        return None
    strides: dict[int, list[int]] = {}
    alone: list[int] = []
    for cpu, group in siblings.items():
        if len(group) == 1:
            alone.append(cpu)
        else:
            strides.setdefault(max(group) - min(group), []).append(cpu)
    entries = [f"{_list(strides[s])}>{s}" for s in sorted(strides)]
    if alone:
        entries.append(_list(alone))
    layout = ";".join(entries)
    return layout if len(layout) <= LIMIT else None


def decode(layout: str) -> dict[int, int]:
    """The documents' decoding: the lowest unpaired CPU of a strided entry pairs with the CPU
    the stride above it; sibling-less CPUs map to -1."""
    pairs: dict[int, int] = {}
    for entry in layout.split(";"):
        cpus, _, stride = entry.partition(">")
        members = _ids(cpus)
        if not stride:
            pairs.update(dict.fromkeys(members, -1))
            continue
        for cpu in members:
            if cpu not in pairs:
                assert cpu + int(stride) in members, entry
                pairs[cpu], pairs[cpu + int(stride)] = cpu + int(stride), cpu
    return pairs


def _slices(name: str, group_by: GroupBy, reserved: str = "") -> list[dict[str, Any]]:
    topology = build_topology(FIXTURES[name])
    devices = published_devices(
        topology,
        reserved=CpuSet.parse(reserved),
        mode=CpuDeviceMode.GROUPED,
        group_by=group_by,
        external=True,
    )
    return build_resource_slices("node-a", devices, generation=1, options=SliceOptions())


@pytest.mark.parametrize("group_by", list(GroupBy))
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_topology_publishes_what_upstreams_rules_say(name: str, group_by: GroupBy) -> None:
    reserved = "0" if name != "vm-2cpu" else ""
    slices = _slices(name, group_by, reserved)
    assert_valid(slices)
    layout = expected_layout(name)
    siblings = _siblings_from_sysfs(name)
    for obj in slices:
        for device in obj["spec"]["devices"]:
            attributes = device["attributes"]
            capacity = int(device["capacity"]["dra.cpu/cpu"]["value"])
            cpus = _device_cpus(name, device["name"], _ids(reserved))
            assert len(cpus) == capacity
            wanted = _list(cpus)
            if len(wanted) <= LIMIT:
                assert attributes[CPU_IDS] == {"string": wanted}
            else:
                assert CPU_IDS not in attributes
            if layout is None:
                assert SMT_LAYOUT not in attributes
                continue
            assert attributes[SMT_LAYOUT] == {"string": layout}
            pairs = decode(layout)
            assert set(pairs) == set(siblings)  # node-wide, the reserved CPU included
            for cpu, group in siblings.items():
                assert pairs[cpu] == (-1 if len(group) == 1 else next(c for c in group if c != cpu))


def test_the_documents_examples() -> None:
    # docs/dev/smt-layout.md: "0-7>4;8-11>2;12-15" and the i7-12850HX's "8-23>8;0-7"
    assert decode("0-7>4;8-11>2;12-15")[1] == 5
    assert decode("0-7>4;8-11>2;12-15")[9] == 11
    assert decode("8-23>8;0-7") == {
        **dict.fromkeys(range(8), -1),
        **{c: c + 8 if c < 16 else c - 8 for c in range(8, 24)},
    }


@pytest.mark.parametrize(
    ("name", "found"),
    [
        ("smt4", "smtLayout is not published: 16 cores have 3 or more online threads"),
        ("knl-smt4", "cores have 3 or more online threads"),
    ],
)
def test_what_is_left_out_is_said(name: str, found: str, tmp_path: Path) -> None:
    topology = build_topology(FIXTURES[name])
    devices = published_devices(
        topology, reserved=CpuSet.parse(""), mode=CpuDeviceMode.GROUPED, group_by=GroupBy.MACHINE
    )
    reasons = left_out(topology, [(d.name, d.cpus) for d in devices])
    assert any(found in reason for reason in reasons), reasons


def test_a_cpu_list_over_the_limit_is_left_out_and_said() -> None:
    # big-1024, one machine device without every 3rd CPU: a list far over 64 bytes.
    topology = build_topology(FIXTURES["big-1024"])
    reserved = CpuSet(range(0, 1024, 3))
    devices = published_devices(
        topology,
        reserved=reserved,
        mode=CpuDeviceMode.GROUPED,
        group_by=GroupBy.MACHINE,
        external=True,
    )
    (machine,) = devices
    assert CPU_IDS not in machine.attributes
    reasons = left_out(topology, [(machine.name, machine.cpus)])
    assert any(
        reason.startswith("dra.cpu/cpuIDs is not published on device cpudevmachine: its cpus ")
        for reason in reasons
    )


def test_without_the_external_allocator_there_are_none() -> None:
    topology = build_topology(FIXTURES["dual-socket-smt2"])
    for group_by in GroupBy:
        for device in published_devices(
            topology, reserved=CpuSet.parse(""), mode=CpuDeviceMode.GROUPED, group_by=group_by
        ):
            assert CPU_IDS not in device.attributes
            assert SMT_LAYOUT not in device.attributes
    individual = published_devices(
        topology,
        reserved=CpuSet.parse(""),
        mode=CpuDeviceMode.INDIVIDUAL,
        group_by=GroupBy.NUMANODE,
        external=True,
    )
    assert all(CPU_IDS not in d.attributes for d in individual)
