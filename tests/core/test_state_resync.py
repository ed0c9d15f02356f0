"""A SIGHUP's Resync: the topology and the settings read again (:mod:`dracpu.core.reconfigure`).

The 16-CPU machine of ``state_helpers`` (reserved 0,8): CPUs go offline and come back, change
isolation, the reserved CPUs change; claims on CPUs that went offline stay whole.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest

from dracpu.core.checkpoint_schema import CheckpointData, PreparedClaim
from dracpu.core.commands import CreateContainer, Resync, Synchronize, UnprepareClaim
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CAPACITY_CPU, CpuDeviceMode
from dracpu.core.effects import (
    ConfineHostCgroups,
    ContainerPinned,
    NodeChanged,
    PruneCdiSpecs,
    PruneDeviceMetadata,
    PublishSlices,
    Reply,
    Resynced,
    StrandedClaim,
    UpdateContainers,
    WriteCdiSpec,
    WriteDeviceMetadata,
)
from dracpu.core.health import reported_devices
from dracpu.core.state import InvariantError, NodeState, check_invariants, restore_state
from dracpu.errors import InsufficientCpusError
from tests.core.state_helpers import NODE, config_for, cpus, device_of, topology16, uid
from tests.core.test_state import (
    GROUPED,
    INDIVIDUAL,
    claim_container,
    grouped,
    individual,
    ok,
    refused,
    shared_container,
)

__all__: list[str] = []


def changes(value: object) -> NodeChanged:
    assert isinstance(value, Resynced), value
    assert value.changed is not None
    return value.changed


def test_a_cpu_going_offline_keeps_its_claim_whole_and_the_other_device_names() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [4]))
    dev4, dev5 = device_of(INDIVIDUAL, 4), device_of(INDIVIDUAL, 5)
    new, value, effects = ok(state, Resync(topology16(offline="4,5")))
    check_invariants(new, state)
    config = new.config
    assert new.claims == state.claims
    assert new.claimed == cpus("4")
    # The two devices are gone; every other keeps its name and its CPU.
    assert {n: d.cpus for n, d in config.devices.items()} == {
        n: d.cpus for n, d in INDIVIDUAL.devices.items() if n not in (dev4, dev5)
    }
    assert config.held == {dev4: cpus("4")}
    assert new.shared_pool == cpus("1-3,6-7,9-15")
    stranded = StrandedClaim(uid(1), "ns/claim-1", cpus("4"))
    assert value == Resynced(
        1,
        NodeChanged(
            went_offline=cpus("4-5"), removed=(dev4, dev5), republished=True, stranded=(stranded,)
        ),
    )
    assert effects == [
        ConfineHostCgroups((), cpus("0-3,6-15")),  # the pool without the claim and cpu 4-5
        PublishSlices(tuple(config.devices.values())),
        Reply(value),
        WriteCdiSpec(uid(1), cpus("4")),  # the CDI spec keeps the offline CPU
        PruneCdiSpecs(frozenset({uid(1)})),
        WriteDeviceMetadata(new.claims[uid(1)], config),  # its device is no longer published
        PruneDeviceMetadata(frozenset({uid(1)})),
    ]
    # the claim's device is still reported (unhealthy: cpu 4 is offline), the free one is not
    reported = reported_devices(config.devices.values(), config.held, new.claimed)
    assert [(d.name, d.cpus) for d in reported if d.name in (dev4, dev5)] == [(dev4, cpus("4"))]
    # a re-prepare of the claim is idempotent: the same CPUs, the offline one included
    again, value, _ = ok(new, individual(INDIVIDUAL, 1, [4]))
    assert again is new

    # both come back: the same names again, nothing held
    back, value, _ = ok(new, Resync(topology16()))
    check_invariants(back, new)
    assert back.config.devices == INDIVIDUAL.devices
    assert back.config.held == {}
    assert changes(value) == NodeChanged(
        went_online=cpus("4-5"), added=(dev4, dev5), republished=True
    )


def test_a_cpu_first_seen_online_gets_the_next_free_device_number() -> None:
    start = config_for(CpuDeviceMode.INDIVIDUAL)
    start = replace(start, topology=topology16(offline="6"))  # devices as built without cpu 6
    booted = NodeState.initial(
        type(start).build(NODE, start.topology, reserved=start.reserved, mode=start.mode)
    )
    assert len(booted.config.devices) == 13
    highest = max(booted.config.numbering.values())
    new, value, _ = ok(booted, Resync(topology16()))
    assert device_of(new.config, 6) == f"cpudev{highest + 1:03d}"
    assert {n: d.cpus for n, d in booted.config.devices.items()}.items() <= {
        n: d.cpus for n, d in new.config.devices.items()
    }.items()
    assert changes(value).added == (f"cpudev{highest + 1:03d}",)


def test_grouped_capacity_shrinks_and_a_claims_offline_cpu_keeps_its_group_reported() -> None:
    state, _, _ = ok(NodeState.initial(GROUPED), grouped(1, ("cpudevnuma001", 2)))
    held = state.claims[uid(1)].cpus
    lost = held.min()
    free = (cpus("4-7,12-15") - held).min()
    new, value, _ = ok(state, Resync(topology16(offline=f"{lost},{free}")))
    check_invariants(new, state)
    assert new.config.devices["cpudevnuma001"].capacity == {CAPACITY_CPU: 6}
    assert new.config.devices["cpudevnuma000"] == GROUPED.devices["cpudevnuma000"]
    assert new.config.held == {"cpudevnuma001": CpuSet([lost])}
    changed = changes(value)
    assert changed.resized == ("cpudevnuma001",)
    assert changed.stranded == (StrandedClaim(uid(1), "ns/claim-1", CpuSet([lost])),)
    reported = {
        d.name: d.cpus
        for d in reported_devices(new.config.devices.values(), new.config.held, new.claimed)
    }
    assert reported["cpudevnuma001"] == new.config.devices["cpudevnuma001"].cpus | CpuSet([lost])
    # the group has 6 CPUs: the claim's online one and 5 free ones; 6 asked is refused
    refused(new, grouped(2, ("cpudevnuma001", 6)), InsufficientCpusError, "only 5 of the")
    # Unprepare of the claim: nothing held any more is reported
    freed, _, _ = ok(new, UnprepareClaim(uid(1)))
    check_invariants(freed, new)
    assert freed.claimed == CpuSet()
    assert reported_devices(freed.config.devices.values(), freed.config.held, freed.claimed) == (
        tuple(freed.config.devices.values())
    )


def test_reserved_cpus_change_and_shared_containers_follow_at_once() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, Synchronize((shared_container(1),), unsolicited_updates=True))
    assert state.containers["shared-1"].cpus == cpus("1-7,9-15")
    new, value, effects = ok(state, Resync(reserved=cpus("0-1,8-9")))
    check_invariants(new, state)
    assert new.config.reserved == cpus("0-1,8-9")
    gone = (device_of(INDIVIDUAL, 1), device_of(INDIVIDUAL, 9))
    assert value == Resynced(
        0,
        NodeChanged(reserved=(cpus("0,8"), cpus("0-1,8-9")), removed=gone, republished=True),
        repinned=1,
    )
    assert UpdateContainers((new.containers["shared-1"].pin(),)) in effects
    assert new.containers["shared-1"].cpus == cpus("2-7,10-15")
    # and back: the devices keep their names
    back, value, _ = ok(new, Resync(reserved=cpus("0,8")))
    assert back.config.devices == INDIVIDUAL.devices
    assert changes(value).added == gone


def test_reserved_cpus_a_claim_holds_are_not_taken_and_the_topology_still_is() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [4]))
    new, value, _ = ok(state, Resync(topology16(offline="6"), reserved=cpus("0,4,8")))
    check_invariants(new, state)
    changed = changes(value)
    assert new.config.reserved == cpus("0,8")
    assert changed.reserved is None
    assert changed.reserved_refused == (
        f"the config asks 0,4,8, but cpus 4 are held by claim {uid(1)}; "
        "unprepare it and send SIGHUP again"
    )
    assert changed.went_offline == cpus("6")
    assert "reserved cpus not changed: the config asks 0,4,8" in value.describe()  # type: ignore[attr-defined]


def test_reserved_cpus_that_leave_no_cpu_for_shared_containers_are_not_taken() -> None:
    state, _, _ = ok(NodeState.initial(GROUPED), grouped(1, ("cpudevnuma001", 8)))
    state, _, _ = ok(state, CreateContainer(shared_container(1)))
    _, value, _ = ok(state, Resync(reserved=cpus("0-3,8-11")))
    assert "leaves no CPU for the 1 shared containers" in changes(value).reserved_refused


def test_a_topology_that_leaves_no_cpu_for_shared_containers_is_refused() -> None:
    state, _, _ = ok(NodeState.initial(GROUPED), grouped(1, ("cpudevnuma001", 8)))
    state, _, _ = ok(state, CreateContainer(shared_container(1)))
    refused(
        state,
        Resync(topology16(offline="1-3,9-11")),
        InsufficientCpusError,
        r"cpus 1-3,9-11 went offline\): it leaves no CPU for the 1 shared containers",
    )


def test_shared_containers_wait_for_their_next_event_without_unsolicited_updates() -> None:
    state, _, _ = ok(NodeState.initial(GROUPED), CreateContainer(shared_container(1)))
    new, value, effects = ok(state, Resync(topology16(offline="5")))
    assert isinstance(value, Resynced)
    assert (value.repinned, value.waiting) == (0, 1)
    assert not any(isinstance(e, UpdateContainers) for e in effects)
    assert new.containers["shared-1"].cpus == cpus("1-7,9-15")  # not sent yet
    _, pinned, _ = ok(new, CreateContainer(shared_container(2)))
    assert isinstance(pinned, ContainerPinned)
    assert [(u.container_id, u.cpus) for u in pinned.updates] == [
        ("shared-1", cpus("1-4,6-7,9-15"))
    ]


def test_isolation_and_memory_pinning_changes() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), CreateContainer(shared_container(1)))
    new, value, _ = ok(state, Resync(topology16(isolated="3,11"), pin_memory=True))
    changed = changes(value)
    assert changed.isolated == cpus("3,11")
    assert changed.pin_memory is True
    assert changed.updated == (device_of(INDIVIDUAL, 3), device_of(INDIVIDUAL, 11))
    assert new.config.devices[device_of(INDIVIDUAL, 3)].attributes["dra.cpu/isolated"] is True
    assert new.shared_pool == cpus("1-2,4-7,9-10,12-15")
    assert new.config.pin_memory
    _, value, _ = ok(new, Resync(topology16()))
    assert changes(value).unisolated == cpus("3,11")


def test_nothing_changed_is_said_so() -> None:
    state = NodeState.initial(GROUPED)
    new, value, _ = ok(state, Resync(topology16(), reserved=cpus("0,8"), pin_memory=False))
    assert new.config == state.config
    assert value == Resynced(0, NodeChanged())
    assert value.describe() == "files of 0 prepared claims checked; node unchanged"


def test_restore_keeps_a_claim_whose_cpus_are_offline() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [4, 12]))
    state, _, _ = ok(state, individual(INDIVIDUAL, 2, [5]))
    ghost = PreparedClaim(uid(3), cpus("40"))
    data = CheckpointData(MappingProxyType({**state.claims, uid(3): ghost}))
    booted = replace(INDIVIDUAL, topology=topology16(offline="4"))
    config = type(INDIVIDUAL).build(NODE, booted.topology, reserved=cpus("0,8"), mode=booted.mode)
    restored, rejected = restore_state(config, data)
    check_invariants(restored)
    assert set(restored.claims) == {uid(1), uid(2)}
    assert rejected == ((uid(3), "cpus 40 are not present on this node"),)
    # after a restart the devices of before are unknown: the claim's devices stand for cpu 4
    names = {r.device for r in state.claims[uid(1)].results}
    assert restored.config.held == dict.fromkeys(names, cpus("4"))


def test_invariants_refuse_an_offline_cpu_joining_a_claim() -> None:
    state = NodeState.initial(replace(INDIVIDUAL, topology=topology16(offline="4")))
    claim = PreparedClaim(uid(1), cpus("4"))
    bad = replace(state, claims=MappingProxyType({uid(1): claim}), claimed=cpus("4"))
    check_invariants(bad)  # alone it could be a claim stranded by a topology change
    with pytest.raises(InvariantError, match="cpus 4 joined a claim but are not allocatable"):
        check_invariants(bad, state)


def test_a_stranded_claim_still_pins_its_container() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [4]))
    state, _, _ = ok(state, Resync(topology16(offline="4")))
    _, pinned, _ = ok(state, CreateContainer(claim_container(state, 1, 1)))
    assert isinstance(pinned, ContainerPinned)
    assert pinned.pin.cpus == cpus("4")
