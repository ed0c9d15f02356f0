"""Device health (KEP-4680) from the online CPUs: every device mode, ``since``, the message.

The devices are the real published devices of the simulator's fixture machines
(:func:`dracpu.core.devices.published_devices`); which device holds which CPU is read from the
devices themselves, and the expected CPUs of each group from the fixture's description.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.devices import CpuDeviceMode, Device, GroupBy, published_devices
from dracpu.core.health import (
    MAX_MESSAGE_CHARS,
    DeviceHealth,
    HealthStatus,
    assess,
    offline_message,
    reported_devices,
)
from dracpu.core.topology import Topology
from dracpu.sim.topologies import FIXTURES, build_topology

HEALTHY = HealthStatus.HEALTHY
UNHEALTHY = HealthStatus.UNHEALTHY
START = 1_760_000_000  # a Unix second
LATER = START + 60

# dual-socket-smt2: 2 sockets x 2 NUMA x 16 CPUs; NUMA node n holds cpus 8n..8n+7 and their SMT
# siblings +32 (the fixture's description).
MACHINE = build_topology(FIXTURES["dual-socket-smt2"])


def _devices(
    topology: Topology,
    mode: CpuDeviceMode,
    group_by: GroupBy = GroupBy.NUMANODE,
    reserved: CpuSet = EMPTY,
) -> list[Device]:
    return published_devices(topology, reserved=reserved, mode=mode, group_by=group_by)


def _by_name(health: tuple[DeviceHealth, ...]) -> dict[str, DeviceHealth]:
    return {entry.device: entry for entry in health}


def _unhealthy(health: tuple[DeviceHealth, ...]) -> dict[str, str]:
    return {entry.device: entry.message for entry in health if entry.status is UNHEALTHY}


def _holding(devices: list[Device], cpu: int) -> str:
    [name] = [device.name for device in devices if cpu in device.cpus]
    return name


# --- every mode ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "group_by"),
    [
        (CpuDeviceMode.INDIVIDUAL, GroupBy.NUMANODE),
        (CpuDeviceMode.GROUPED, GroupBy.NUMANODE),
        (CpuDeviceMode.GROUPED, GroupBy.SOCKET),
        (CpuDeviceMode.GROUPED, GroupBy.MACHINE),
    ],
)
def test_all_online_every_device_is_healthy_in_order(
    mode: CpuDeviceMode, group_by: GroupBy
) -> None:
    devices = _devices(MACHINE, mode, group_by)
    health = assess(devices, MACHINE.online, now=START)
    assert [entry.device for entry in health] == [device.name for device in devices]
    assert {(entry.status, entry.message, entry.since) for entry in health} == {
        (HEALTHY, "", START)
    }


def test_individual_only_the_device_of_the_offline_cpu_is_unhealthy() -> None:
    devices = _devices(MACHINE, CpuDeviceMode.INDIVIDUAL)
    assert len(devices) == 64
    health = assess(devices, MACHINE.online - CpuSet([5]), now=START)
    assert _unhealthy(health) == {_holding(devices, 5): "cpu 5 is offline"}
    # its SMT sibling (cpu 37) is a device of its own and stays healthy
    assert _by_name(health)[_holding(devices, 37)].status is HEALTHY


@pytest.mark.parametrize(
    ("group_by", "unhealthy"),
    [
        # cpu 5 is on NUMA node 0, socket 0
        (GroupBy.NUMANODE, "cpudevnuma000"),
        (GroupBy.SOCKET, "cpudevsocket000"),
        (GroupBy.MACHINE, "cpudevmachine"),
    ],
)
def test_grouped_the_group_of_the_offline_cpu_is_unhealthy(
    group_by: GroupBy, unhealthy: str
) -> None:
    devices = _devices(MACHINE, CpuDeviceMode.GROUPED, group_by)
    health = assess(devices, MACHINE.online - CpuSet([5, 37]), now=START)
    assert _unhealthy(health) == {unhealthy: "cpus 5,37 are offline"}


def test_grouped_cpus_offline_in_two_groups_name_each_group_s_own() -> None:
    devices = _devices(MACHINE, CpuDeviceMode.GROUPED)
    # cpu 3: NUMA 0; cpus 16-18: NUMA 2 (8n..8n+7 with n = 2)
    health = assess(devices, MACHINE.online - CpuSet([3, 16, 17, 18]), now=START)
    assert _unhealthy(health) == {
        "cpudevnuma000": "cpu 3 is offline",
        "cpudevnuma002": "cpus 16-18 are offline",
    }


def test_a_reserved_cpu_going_offline_touches_no_device() -> None:
    reserved = CpuSet([0, 32])
    for mode in CpuDeviceMode:
        devices = _devices(MACHINE, mode, reserved=reserved)
        health = assess(devices, MACHINE.online - CpuSet([0]), now=START)
        assert _unhealthy(health) == {}


def test_cpus_offline_before_the_devices_were_built_make_nothing_unhealthy() -> None:
    # offline-isolated: cpus 5, 14, 15 are offline at boot (as with nosmt): never published
    topology = build_topology(FIXTURES["offline-isolated"])
    assert topology.offline == CpuSet([5, 14, 15])
    for mode in CpuDeviceMode:
        devices = _devices(topology, mode)
        assert all(device.cpus.isdisjoint(topology.offline) for device in devices)
        health = assess(devices, topology.online, now=START)
        assert _unhealthy(health) == {}


def test_a_hot_removed_cpu_counts_as_offline() -> None:
    # not in `online` is what matters, whether the CPU is still present or not
    devices = _devices(MACHINE, CpuDeviceMode.GROUPED, GroupBy.MACHINE)
    online = CpuSet(cpu for cpu in MACHINE.online if cpu != 63)
    assert _unhealthy(assess(devices, online, now=START)) == {"cpudevmachine": "cpu 63 is offline"}


# --- since ------------------------------------------------------------------------------------


def test_since_is_the_time_of_the_last_change_of_each_device() -> None:
    devices = _devices(MACHINE, CpuDeviceMode.GROUPED)
    first = assess(devices, MACHINE.online, now=START)

    # nothing changed: every device keeps its time
    again = assess(devices, MACHINE.online, now=LATER, previous=first)
    assert again == first

    # cpu 3 goes offline: only its group changes, at that time
    broken = assess(devices, MACHINE.online - CpuSet([3]), now=LATER, previous=again)
    assert {e.device: (e.status, e.since) for e in broken} == {
        "cpudevnuma000": (UNHEALTHY, LATER),
        "cpudevnuma001": (HEALTHY, START),
        "cpudevnuma002": (HEALTHY, START),
        "cpudevnuma003": (HEALTHY, START),
    }

    # a second CPU of the same group: same status, new message, new time
    worse = assess(devices, MACHINE.online - CpuSet([3, 4]), now=LATER + 1, previous=broken)
    assert _by_name(worse)["cpudevnuma000"] == DeviceHealth(
        "cpudevnuma000", UNHEALTHY, "cpus 3-4 are offline", LATER + 1
    )

    # back online: healthy again, at that time
    healed = assess(devices, MACHINE.online, now=LATER + 2, previous=worse)
    assert _by_name(healed)["cpudevnuma000"] == DeviceHealth(
        "cpudevnuma000", HEALTHY, "", LATER + 2
    )
    assert _by_name(healed)["cpudevnuma001"].since == START


def test_devices_that_are_no_longer_published_are_dropped_new_ones_start_now() -> None:
    before = assess(_devices(MACHINE, CpuDeviceMode.GROUPED), MACHINE.online, now=START)
    # republished by socket: new names, none of the old ones
    after = assess(
        _devices(MACHINE, CpuDeviceMode.GROUPED, GroupBy.SOCKET),
        MACHINE.online,
        now=LATER,
        previous=before,
    )
    assert [(e.device, e.since) for e in after] == [
        ("cpudevsocket000", LATER),
        ("cpudevsocket001", LATER),
    ]


# --- the message ----------------------------------------------------------------------------


def test_message_uses_the_linux_list_syntax() -> None:
    assert offline_message(CpuSet([7])) == "cpu 7 is offline"
    assert offline_message(CpuSet([1, 2, 3, 9])) == "cpus 1-3,9 are offline"


def test_a_long_message_is_cut_as_the_kubelet_would() -> None:
    every_other = CpuSet(range(0, 4096, 2))
    message = offline_message(every_other)
    assert len(message) == MAX_MESSAGE_CHARS == 1024
    assert message.startswith("cpus 0,2,4,6,")
    assert message.endswith("...")
    assert message[:-3] == f"cpus {every_other} are offline"[:1021]


def test_a_message_of_exactly_1024_characters_is_kept_whole() -> None:
    # "cpus " + "10," + 201 four-digit ids 1000,1002,... (5 * 201 - 1) + " are offline"
    cpus = CpuSet([10, *range(1000, 1000 + 2 * 201, 2)])
    assert len(offline_message(cpus)) == 5 + 3 + 1004 + 12 == MAX_MESSAGE_CHARS
    assert offline_message(cpus) == f"cpus {cpus} are offline"
    one_more = cpus | CpuSet([12])
    assert offline_message(one_more).endswith("...")
    assert len(offline_message(one_more)) == MAX_MESSAGE_CHARS


@settings(max_examples=200, deadline=None)
@given(
    mode=st.sampled_from(list(CpuDeviceMode)),
    group_by=st.sampled_from(list(GroupBy)),
    offline=st.sets(st.integers(min_value=0, max_value=63), max_size=64),
)
def test_unhealthy_exactly_when_a_published_cpu_is_offline(
    mode: CpuDeviceMode, group_by: GroupBy, offline: set[int]
) -> None:
    devices = _devices(MACHINE, mode, group_by)
    online = MACHINE.online - CpuSet(offline)
    for device, entry in zip(devices, assess(devices, online, now=START), strict=True):
        lost = {cpu for cpu in device.cpus if cpu in offline}
        assert entry.device == device.name
        assert (entry.status is UNHEALTHY) == bool(lost)
        if lost:
            # the message names exactly the lost CPUs (short enough here never to be cut)
            listed = entry.message.split(" ")[1]
            assert set(CpuSet.parse(listed)) == lost
        else:
            assert entry.message == ""


# --- the devices reported after a SIGHUP ----------------------------------------------------------


def test_reported_devices_keep_the_offline_cpus_claims_hold() -> None:
    numa = _devices(MACHINE, CpuDeviceMode.GROUPED)
    assert reported_devices(numa, {}, CpuSet([1, 2])) == tuple(numa)
    # cpu 5 (NUMA 0, claimed) and cpu 9 (NUMA 1, free) went offline; the devices were published
    # again without them; individual device cpudev999 stood for cpu 40 (claimed, offline)
    online = MACHINE.online - CpuSet([5, 9, 40])
    again = _devices(without(MACHINE, CpuSet([5, 9, 40])), CpuDeviceMode.GROUPED)
    held = {"cpudevnuma000": CpuSet([5]), "cpudevnuma001": CpuSet([9]), "cpudev999": CpuSet([40])}
    reported = reported_devices(again, held, claimed=CpuSet([5, 6, 40]))
    assert [d.name for d in reported] == [d.name for d in again] + ["cpudev999"]
    assert reported[0].cpus == again[0].cpus | CpuSet([5])
    assert reported[1] == again[1]  # cpu 9 is held by no claim: the group is as published
    health = assess(reported, online, now=START)
    assert _unhealthy(health) == {
        "cpudevnuma000": "cpu 5 is offline",
        "cpudev999": "cpu 40 is offline",
    }


def without(topology: Topology, offline: CpuSet) -> Topology:
    return Topology(
        {cpu: info for cpu, info in topology.cpus.items() if cpu not in offline},
        smt_enabled=topology.smt_enabled,
        offline=topology.offline | offline,
        isolated=topology.isolated,
    )
