"""Tables for the node state machine: one command at a time, state and effects checked exactly.

The 16-CPU topology, the configs and the reference effect executor over a fake disk are in
``state_helpers.py`` (shared with ``test_state_properties.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from dracpu.core.allocator import Strategy
from dracpu.core.checkpoint_schema import CheckpointData, decode, encode
from dracpu.core.commands import (
    AdoptClaims,
    AdoptedClaim,
    ClaimEnv,
    Command,
    Container,
    ContainerStarted,
    CreateContainer,
    DeviceResult,
    InvalidateContainers,
    PodsListed,
    PrepareClaim,
    RemoveContainer,
    RepairNodeFiles,
    Resync,
    RuntimeDisconnected,
    StopContainer,
    Synchronize,
    UnprepareClaim,
    UpdateClaimPods,
    UpdateContainer,
    claims_from_env,
)
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy
from dracpu.core.effects import (
    ClaimPrepared,
    ClaimsAdopted,
    ClaimUnprepared,
    ConfineHostCgroups,
    ContainerForgotten,
    ContainerPinned,
    ContainerUpdate,
    DeleteCdiSpec,
    DeleteDeviceMetadata,
    Effect,
    PruneCdiSpecs,
    PruneDeviceMetadata,
    PublishSlices,
    Reply,
    Resynced,
    Synchronized,
    UpdateContainers,
    WriteCdiSpec,
    WriteCheckpoint,
    WriteDeviceMetadata,
)
from dracpu.core.node_config import NodeConfig
from dracpu.core.state import (
    ContainerRecord,
    InvariantError,
    NodeState,
    PreparedClaim,
    apply,
    check_invariants,
    commit_phase,
    restore_state,
    rollback,
)
from dracpu.core.state_containers import unreserved_claims
from dracpu.errors import (
    AllocationError,
    CdiError,
    ClaimConflictError,
    ClaimError,
    ClaimNotReservedError,
    DracpuError,
    InsufficientCpusError,
)
from tests.core.state_helpers import (
    NODE,
    FakeDisk,
    config_for,
    cpus,
    device_of,
    disk_matches,
    run,
    topology16,
    uid,
)

__all__: list[str] = []

GROUPED = config_for()
INDIVIDUAL = config_for(CpuDeviceMode.INDIVIDUAL)


def individual(config: NodeConfig, n: int, cpu_list: Sequence[int]) -> PrepareClaim:
    results = tuple(
        DeviceResult(f"r{i}", NODE, device_of(config, c)) for i, c in enumerate(cpu_list)
    )
    return PrepareClaim(uid(n), "ns", f"claim-{n}", results)


def grouped(n: int, *parts: tuple[str, int]) -> PrepareClaim:
    results = tuple(DeviceResult(f"r{i}", NODE, dev, count) for i, (dev, count) in enumerate(parts))
    return PrepareClaim(uid(n), "ns", f"claim-{n}", results)


def ok(state: NodeState, command: Command) -> tuple[NodeState, object, list[Effect]]:
    """Apply, require success, check the invariants; the new state, reply value and effects."""
    new, effects = apply(state, command)
    replies = [e for e in effects if isinstance(e, Reply)]
    assert len(replies) == 1, effects
    assert not isinstance(replies[0].value, DracpuError), replies[0].value
    check_invariants(new)
    return new, replies[0].value, effects


def refused(state: NodeState, command: Command, error: type[DracpuError], match: str) -> str:
    """Apply, require the error reply and an untouched state; the message."""
    new, effects = apply(state, command)
    assert new is state
    assert len(effects) == 1, effects
    assert isinstance(effects[0], Reply), effects
    value = effects[0].value
    assert isinstance(value, error), value
    with pytest.raises(error, match=match):
        raise value
    return str(value)


def shared_container(n: int, pod: str = "") -> Container:
    return Container(f"shared-{n}", pod or f"pod-s{n}", "ns", f"pod-s{n}", "app")


def claim_container(
    state: NodeState, n: int, *claims: int, pod: str = "", name: str = "app"
) -> Container:
    env = tuple(ClaimEnv(uid(c), state.claims[uid(c)].cpus) for c in claims)
    return Container(f"excl-{n}", pod or f"pod-{n}", "ns", f"pod-{n}", name, env)


# --- prepare: individual mode --------------------------------------------------------------------


def test_prepare_individual_effects_in_crash_safe_order() -> None:
    state = NodeState.initial(INDIVIDUAL)
    command = individual(INDIVIDUAL, 1, [1, 9])
    new, value, effects = ok(state, command)
    claim = new.claims[uid(1)]
    assert claim.cpus == cpus("1,9")
    assert claim.namespace == "ns"
    assert claim.name == "claim-1"
    assert effects == [
        WriteCdiSpec(uid(1), cpus("1,9")),
        WriteDeviceMetadata(claim, INDIVIDUAL),
        WriteCheckpoint(CheckpointData(new.claims)),
        Reply(ClaimPrepared(uid(1), cpus("1,9"), None, claim.results)),
    ]
    assert value == ClaimPrepared(uid(1), cpus("1,9"), None, claim.results)
    assert new.claimed == cpus("1,9")
    assert new.shared_pool == cpus("2-7,10-15")
    assert state.claims == {}  # the old state is untouched


def test_prepare_individual_overlap_names_the_other_claim() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [1, 9]))
    message = refused(
        state, individual(INDIVIDUAL, 2, [9, 10]), ClaimConflictError, "overlapping device"
    )
    assert uid(1) in message
    assert "cpus 9" in message


def test_prepare_individual_same_device_twice() -> None:
    state = NodeState.initial(INDIVIDUAL)
    refused(state, individual(INDIVIDUAL, 1, [3, 3]), ClaimError, "lists cpu3 twice")


@pytest.mark.parametrize(
    ("result", "error", "match"),
    [
        (DeviceResult("r", NODE, "cpudev999"), ClaimError, "'cpudev999' is not published"),
        (DeviceResult("r", "other-node", "cpudev000"), ClaimError, "pool 'other-node'"),
        (DeviceResult("r", NODE, "cpudev000", 2), ClaimError, "holds one CPU, not 2"),
        (DeviceResult("r", NODE, "cpudev000", 0), ClaimError, "positive whole number"),
        (
            DeviceResult("r", NODE, "cpudev000", None, cpus("1")),
            ClaimError,
            "explicit cpuset needs a grouped device",
        ),
    ],
)
def test_prepare_individual_bad_results(
    result: DeviceResult, error: type[DracpuError], match: str
) -> None:
    state = NodeState.initial(INDIVIDUAL)
    refused(state, PrepareClaim(uid(1), "ns", "c", (result,)), error, match)


def test_prepare_individual_consumed_one_is_accepted() -> None:
    result = DeviceResult("r", NODE, device_of(INDIVIDUAL, 4), 1)
    _, value, _ = ok(NodeState.initial(INDIVIDUAL), PrepareClaim(uid(1), "ns", "c", (result,)))
    assert isinstance(value, ClaimPrepared)
    assert value.cpus == cpus("4")


def test_reserved_cpus_have_no_device() -> None:
    names = {d.name for d in INDIVIDUAL.devices.values() if d.cpus & cpus("0,8")}
    assert names == set()


@pytest.mark.parametrize("bad", ["", "claim-1", "not-a-uuid"])
def test_prepare_needs_a_uuid(bad: str) -> None:
    command = PrepareClaim(bad, "ns", "c", (DeviceResult("r", NODE, "cpudevnuma000", 1),))
    refused(NodeState.initial(GROUPED), command, ClaimError, "not an RFC 4122 UUID")


def test_prepare_without_results_holds_nothing() -> None:
    state = NodeState.initial(GROUPED)
    new, effects = apply(state, PrepareClaim(uid(1), "ns", "c", ()))
    assert new is state
    assert effects == [Reply(ClaimPrepared(uid(1), CpuSet(), None, ()))]


# --- prepare: grouped mode -----------------------------------------------------------------------


def test_prepare_grouped_single_result() -> None:
    state = NodeState.initial(GROUPED)
    _new, value, effects = ok(state, grouped(1, ("cpudevnuma001", 2)))
    assert isinstance(value, ClaimPrepared)
    assert len(value.cpus) == 2
    assert value.cpus <= cpus("4-7,12-15")
    # packed: one whole core (siblings c and c+8)
    assert len(GROUPED.topology.cores_of(value.cpus)) == 1
    assert [type(e) for e in effects] == [
        WriteCdiSpec,
        WriteDeviceMetadata,
        WriteCheckpoint,
        Reply,
    ]


def test_prepare_grouped_multi_result_claim_is_one_cpuset() -> None:
    state = NodeState.initial(GROUPED)
    command = grouped(1, ("cpudevnuma000", 1), ("cpudevnuma000", 1), ("cpudevnuma001", 3))
    _new, value, effects = ok(state, command)
    assert isinstance(value, ClaimPrepared)
    assert len(value.cpus) == 5
    assert len(value.cpus & cpus("1-3,9-11")) == 2
    assert len(value.cpus & cpus("4-7,12-15")) == 3
    assert effects[0] == WriteCdiSpec(uid(1), value.cpus)
    assert sum(isinstance(e, WriteCdiSpec) for e in effects) == 1


def test_prepare_grouped_capacity_above_free_cpus_of_the_group() -> None:
    state, _, _ = ok(NodeState.initial(GROUPED), grouped(1, ("cpudevnuma000", 4)))
    message = refused(state, grouped(2, ("cpudevnuma000", 3)), InsufficientCpusError, "asks 3 CPUs")
    assert "only 2 of the device's 6 are free" in message


def test_prepare_grouped_results_of_one_claim_do_not_overlap() -> None:
    state = NodeState.initial(GROUPED)
    refused(
        state,
        grouped(1, ("cpudevnuma000", 4), ("cpudevnuma000", 3)),
        InsufficientCpusError,
        "asks 3 CPUs but only 2",
    )


@pytest.mark.parametrize(
    ("consumed", "match"),
    [
        (None, "no consumed capacity 'dra.cpu/cpu'"),
        (0, "positive whole number"),
        (-2, "positive whole number"),
        (True, "positive whole number"),
    ],
)
def test_prepare_grouped_bad_capacity(consumed: int | None, match: str) -> None:
    command = PrepareClaim(uid(1), "ns", "c", (DeviceResult("r", NODE, "cpudevnuma000", consumed),))
    refused(NodeState.initial(GROUPED), command, ClaimError, match)


def explicit(n: int, device: str, count: int, cpuset: str) -> PrepareClaim:
    result = DeviceResult("r", NODE, device, count, cpus(cpuset))
    return PrepareClaim(uid(n), "ns", "c", (result,))


def test_prepare_grouped_explicit_cpuset() -> None:
    config = config_for(group_by=GroupBy.MACHINE)
    state, value, _ = ok(NodeState.initial(config), explicit(1, "cpudevmachine", 3, "2-3,12"))
    assert isinstance(value, ClaimPrepared)
    assert value.cpus == cpus("2-3,12")
    refused(
        state, explicit(2, "cpudevmachine", 2, "5"), ClaimError, "has 1 CPUs, the claim consumes 2"
    )
    message = refused(state, explicit(2, "cpudevmachine", 2, "0-1"), ClaimError, "reserved")
    assert message.endswith("cpuset 0-1: cpus 0 are reserved (--reserved-cpus)")
    message = refused(state, explicit(2, "cpudevmachine", 3, "8,15-16"), ClaimError, "offline")
    assert message.endswith(
        "cpuset 8,15-16: cpus 16 are offline or not on this machine; "
        "cpus 8 are reserved (--reserved-cpus)"
    )
    message = refused(state, explicit(2, "cpudevmachine", 2, "12-13"), ClaimConflictError, uid(1))
    assert "cpus 12 of cpuset 12-13 are already prepared" in message
    # Two results of one claim cannot share CPUs.
    both = (
        DeviceResult("a", NODE, "cpudevmachine", 1, cpus("5")),
        DeviceResult("b", NODE, "cpudevmachine", 2, cpus("5-6")),
    )
    refused(state, PrepareClaim(uid(2), "ns", "c", both), ClaimError, "overlaps another result")


def test_prepare_explicit_cpuset_must_lie_in_its_numa_device() -> None:
    state = NodeState.initial(GROUPED)
    message = refused(state, explicit(1, "cpudevnuma000", 2, "3-4"), ClaimError, "not in device")
    assert message.endswith("cpuset 3-4: cpus 4 are not in device 'cpudevnuma000'")
    _, value, _ = ok(state, explicit(1, "cpudevnuma001", 2, "4,12"))
    assert isinstance(value, ClaimPrepared)
    assert value.cpus == cpus("4,12")


def test_prepare_policy_override_reaches_the_allocator() -> None:
    state = NodeState.initial(GROUPED)
    packed, _, _ = ok(state, grouped(1, ("cpudevnuma001", 2)))
    spread_command = grouped(1, ("cpudevnuma001", 2))
    spread_command = replace(
        spread_command,
        results=tuple(replace(r, strategy=Strategy.SPREAD) for r in spread_command.results),
    )
    spread, _, _ = ok(state, spread_command)
    assert len(GROUPED.topology.cores_of(packed.claims[uid(1)].cpus)) == 1
    assert len(GROUPED.topology.cores_of(spread.claims[uid(1)].cpus)) == 2


def test_each_result_has_its_own_policy() -> None:
    # One claim, two results: the first spread over cores, the second whole cores only, on
    # NUMA 1 where cpu 5 is taken (core 5 = cpus 5 and 13 is then not whole).
    state, _, _ = ok(NodeState.initial(GROUPED), explicit(1, "cpudevnuma001", 1, "5"))
    results = (
        DeviceResult("a", NODE, "cpudevnuma000", 2, strategy=Strategy.SPREAD),
        DeviceResult("b", NODE, "cpudevnuma001", 2, full_cores=True),
    )
    state, value, _ = ok(state, PrepareClaim(uid(2), "ns", "c", results))
    assert isinstance(value, ClaimPrepared)
    topology = GROUPED.topology
    numa0 = value.cpus & config_device_cpus(GROUPED, "cpudevnuma000")
    numa1 = value.cpus & config_device_cpus(GROUPED, "cpudevnuma001")
    assert len(numa0) == 2
    assert len(topology.cores_of(numa0)) == 2  # one thread on each of two cores
    assert len(numa1) == 2
    assert len(topology.cores_of(numa1)) == 1  # one whole core
    assert numa1.isdisjoint(cpus("5,13"))
    # The overrides steer the choice only: the same results without them are the same claim.
    plain = tuple(replace(r, strategy=None, full_cores=None) for r in results)
    new, effects = apply(state, PrepareClaim(uid(2), "ns", "c", plain))
    assert new is state
    assert effects[-1] == Reply(ClaimPrepared(uid(2), value.cpus, None, value.results))


def test_full_cores_and_a_count_no_whole_cores_make_are_refused() -> None:
    command = PrepareClaim(
        uid(1), "ns", "c", (DeviceResult("r", NODE, "cpudevnuma000", 3, full_cores=True),)
    )
    refused(NodeState.initial(GROUPED), command, AllocationError, "multiple of the SMT width 2")


def config_device_cpus(config: NodeConfig, name: str) -> CpuSet:
    return config.devices[name].cpus


# --- idempotency -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["individual", "grouped"])
def test_prepare_is_idempotent_and_rewrites_the_cdi_spec(mode: str) -> None:
    if mode == "individual":
        config = INDIVIDUAL
        first, other = individual(config, 1, [2, 10]), individual(config, 2, [3])
    else:
        config = GROUPED
        first = grouped(1, ("cpudevnuma000", 1), ("cpudevnuma001", 2))
        other = grouped(2, ("cpudevnuma000", 2))
    again = replace(first, results=first.results[::-1])  # the same results in another order
    state, value, _ = ok(NodeState.initial(config), first)
    state, _, _ = ok(state, other)
    assert isinstance(value, ClaimPrepared)
    new, effects = apply(state, again)
    assert new is state
    assert effects == [
        WriteCdiSpec(uid(1), value.cpus),
        WriteDeviceMetadata(state.claims[uid(1)], config),
        Reply(value),
    ]


def test_same_uid_with_other_devices_is_a_conflict() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [2]))
    message = refused(state, individual(INDIVIDUAL, 1, [3]), ClaimConflictError, "already prepared")
    assert device_of(INDIVIDUAL, 2) in message
    assert device_of(INDIVIDUAL, 3) in message
    state, _, _ = ok(NodeState.initial(GROUPED), grouped(1, ("cpudevnuma000", 1)))
    refused(state, grouped(1, ("cpudevnuma000", 2)), ClaimConflictError, "already prepared")


# --- unprepare -----------------------------------------------------------------------------------


def test_unprepare_frees_cpus_after_deleting_the_cdi_spec() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [1, 9]))
    new, _value, effects = ok(state, UnprepareClaim(uid(1)))
    assert effects == [
        DeleteCdiSpec(uid(1)),
        DeleteDeviceMetadata(uid(1), ("r0", "r1")),  # the claim's requests: no listing
        WriteCheckpoint(CheckpointData(new.claims)),
        Reply(ClaimUnprepared(uid(1), cpus("1,9"))),
    ]
    assert new.claims == {}
    assert new.claimed == CpuSet()
    assert new.shared_pool == cpus("1-7,9-15")
    ok(new, individual(INDIVIDUAL, 2, [1, 9]))  # the CPUs can be prepared again


@pytest.mark.parametrize("bad", ["", "claim-1", "not-a-uuid", "../../etc/x"])
def test_unprepare_needs_a_uuid_and_has_no_effect(bad: str) -> None:
    # As Prepare: refused before any effect, so no spec delete fails and nothing rolls back.
    refused(NodeState.initial(GROUPED), UnprepareClaim(bad), ClaimError, "not an RFC 4122 UUID")


def test_unprepare_unknown_claim_succeeds() -> None:
    state = NodeState.initial(GROUPED)
    new, effects = apply(state, UnprepareClaim(uid(7)))
    assert new is state
    assert effects == [
        DeleteCdiSpec(uid(7)),
        DeleteDeviceMetadata(uid(7), None),  # requests unknown: its files are looked for
        Reply(ClaimUnprepared(uid(7), CpuSet())),
    ]


# --- shared pool, reserved and isolated CPUs -----------------------------------------------------


def test_isolated_cpus_are_preparable_but_never_shared() -> None:
    config = config_for(CpuDeviceMode.INDIVIDUAL, isolated="3,11")
    state = NodeState.initial(config)
    assert state.shared_pool == cpus("1-2,4-7,9-10,12-15")
    state, _, _ = ok(state, individual(config, 1, [3]))
    _, value, _ = ok(state, CreateContainer(shared_container(1)))
    assert isinstance(value, ContainerPinned)
    assert value.pin.cpus == cpus("1-2,4-7,9-10,12-15")


def test_prepare_that_would_empty_the_shared_pool_is_refused() -> None:
    state = NodeState.initial(GROUPED)
    state, _, _ = ok(state, CreateContainer(shared_container(1)))
    state, _, _ = ok(state, grouped(1, ("cpudevnuma000", 6)))
    state, _, _ = ok(state, grouped(2, ("cpudevnuma001", 7)))
    message = refused(
        state, grouped(3, ("cpudevnuma001", 1)), InsufficientCpusError, "no CPU for the 1 shared"
    )
    assert uid(3) in message


def test_prepare_may_take_every_cpu_when_no_shared_container_exists() -> None:
    state = NodeState.initial(GROUPED)
    state, _, _ = ok(state, grouped(1, ("cpudevnuma000", 6), ("cpudevnuma001", 8)))
    assert state.shared_pool == CpuSet()
    refused(
        state, CreateContainer(shared_container(1)), InsufficientCpusError, "shared pool is empty"
    )


def test_isolated_cpus_do_not_keep_the_shared_pool_alive() -> None:
    config = config_for(CpuDeviceMode.INDIVIDUAL, isolated="15")
    state, _, _ = ok(NodeState.initial(config), CreateContainer(shared_container(1)))
    everything_but_15 = [c for c in range(1, 15) if c != 8]
    refused(
        state, individual(config, 1, everything_but_15), InsufficientCpusError, "no CPU for the"
    )


# --- containers ----------------------------------------------------------------------------------


def test_shared_container_gets_the_shared_pool() -> None:
    state = NodeState.initial(GROUPED)
    new, value, _ = ok(state, CreateContainer(shared_container(1)))
    assert value == ContainerPinned(ContainerUpdate("shared-1", cpus("1-7,9-15"), None, 1), ())
    assert new.shared == {"shared-1"}
    assert (new.pin_seq, new.containers["shared-1"].seq) == (1, 1)


def test_exclusive_container_gets_its_claim_and_shrinks_the_shared_ones() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, CreateContainer(shared_container(1)))
    state, _, _ = ok(state, CreateContainer(shared_container(2)))
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4, 12]))
    state, value, effects = ok(state, CreateContainer(claim_container(state, 1, 1)))
    pool = cpus("1-3,5-7,9-11,13-15")
    assert state.pin_seq == 3  # two shared containers created, then this one
    assert value == ContainerPinned(
        ContainerUpdate("excl-1", cpus("4,12"), None, 3),
        (ContainerUpdate("shared-1", pool, None, 3), ContainerUpdate("shared-2", pool, None, 3)),
    )
    assert effects == [Reply(value)]
    assert {cid: r.seq for cid, r in state.containers.items()} == {
        "shared-1": 3,
        "shared-2": 3,
        "excl-1": 3,
    }
    # the next container of either kind sends no update: everyone is where they belong
    new, value, _ = ok(state, CreateContainer(shared_container(3)))
    assert value == ContainerPinned(ContainerUpdate("shared-3", pool, None, 4), ())
    assert new.containers["shared-1"].seq == 3  # not moved: its decision stands


def test_moved_shared_containers_get_immutable_records_and_updates() -> None:
    """The records and updates of a pool move (named tuples, for speed) hold every field and
    cannot be changed."""
    assert ContainerRecord._fields == ("container", "claims", "cpus", "mems", "seq", "adjusted")
    assert ContainerUpdate._fields == ("container_id", "cpus", "mems", "seq")
    state = NodeState.initial(INDIVIDUAL)
    for n in (1, 2, 3):
        state, _, _ = ok(state, CreateContainer(shared_container(n)))
    state, _, _ = ok(state, InvalidateContainers((("shared-2", 2),)))  # cpus unknown: EMPTY
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4, 12]))
    new, value, _ = ok(state, CreateContainer(claim_container(state, 1, 1)))
    pool = cpus("1-3,5-7,9-11,13-15")
    assert isinstance(value, ContainerPinned)
    assert [u.container_id for u in value.updates] == ["shared-1", "shared-2", "shared-3"]
    for update in value.updates:
        built = ContainerUpdate(update.container_id, pool, None, new.pin_seq)
        assert type(update) is ContainerUpdate
        assert (update, hash(update), repr(update)) == (built, hash(built), repr(built))
        record = new.containers[update.container_id]
        old = state.containers[update.container_id]
        expected = ContainerRecord(old.container, (), pool, None, new.pin_seq, old.adjusted)
        assert old.adjusted == int(update.container_id[-1])  # created by decision n
        assert type(record) is ContainerRecord
        assert (record, hash(record), repr(record)) == (expected, hash(expected), repr(expected))
        with pytest.raises(AttributeError):
            setattr(record, "cpus", pool)  # noqa: B010 (mypy: the field is read-only)
        with pytest.raises(AttributeError):
            setattr(update, "mems", pool)  # noqa: B010
    assert state.containers["shared-1"].cpus == cpus("1-7,9-15")  # the old state is untouched
    assert state.containers["shared-2"].cpus == cpus("")


def test_container_with_two_claims_gets_their_union() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    state, _, _ = ok(state, individual(INDIVIDUAL, 2, [6, 14]))
    _, value, _ = ok(state, CreateContainer(claim_container(state, 1, 1, 2)))
    assert isinstance(value, ContainerPinned)
    assert value.pin.cpus == cpus("4,6,14")


def test_spoofed_env_naming_an_unprepared_claim_is_refused() -> None:
    state = NodeState.initial(INDIVIDUAL)
    spoof = Container("x", "pod", "ns", "pod", "app", (ClaimEnv(uid(9), cpus("1-3")),))
    refused(state, CreateContainer(spoof), ClaimError, "has not prepared")


def test_spoofed_env_with_other_cpus_is_refused() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [4]))
    spoof = Container("x", "pod", "ns", "pod", "app", (ClaimEnv(uid(1), cpus("4-5")),))
    message = refused(state, CreateContainer(spoof), ClaimError, "spoofed")
    assert "cpus 4-5" in message
    assert "cpus 4" in message


def test_malformed_env_fails_closed() -> None:
    state = NodeState.initial(INDIVIDUAL)
    container = Container.from_env("x", "pod", ["PATH=/bin", f"DRA_CPUSET_{uid(1)}=4-"])
    assert container.env_error is not None
    assert container.claims == ()
    refused(state, CreateContainer(container), ClaimError, "malformed env entry")


def test_container_from_env_reads_the_claims() -> None:
    env = ["A=1", f"DRA_CPUSET_{uid(1)}=4,12", f"DRA_CPUSET_{uid(2)}=5"]
    container = Container.from_env("x", "pod", env, name="app")
    assert container.claims == (ClaimEnv(uid(1), cpus("4,12")), ClaimEnv(uid(2), cpus("5")))
    assert claims_from_env(env) == container.claims


def test_a_claim_of_unknown_pods_goes_to_the_first_pod_and_all_its_containers() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [4]))
    assert state.claims[uid(1)].pod_uids == frozenset()
    first = claim_container(state, 1, 1, pod="pod-a")
    state, _, _ = ok(state, CreateContainer(first))
    assert state.owners == {uid(1): "pod-a"}
    thief = claim_container(state, 2, 1, pod="pod-b")
    message = refused(state, CreateContainer(thief), ClaimConflictError, "is used by pod pod-a")
    assert "its pods are not known" in message
    # Another container of the same pod shares the claim's CPUs.
    sidecar = claim_container(state, 3, 1, pod="pod-a", name="sidecar")
    state, value, _ = ok(state, CreateContainer(sidecar))
    assert isinstance(value, ContainerPinned)
    assert value.pin.cpus == cpus("4")
    state, _, _ = ok(state, StopContainer(first.id))
    state, _, _ = ok(state, RemoveContainer(first.id))
    state, _, _ = ok(state, RemoveContainer(sidecar.id))
    refused(state, CreateContainer(thief), ClaimConflictError, "pod-a")  # taken until Unprepare
    restarted = replace(first, id="excl-1-restarted")
    state, value, _ = ok(state, CreateContainer(restarted))
    assert isinstance(value, ContainerPinned)
    assert value.pin.cpus == cpus("4")
    state, _, _ = ok(state, RemoveContainer(restarted.id))
    state, _, _ = ok(state, UnprepareClaim(uid(1)))
    assert state.owners == {}


# --- a claim belongs to its pods ----------------------------------------------------------------


def reserved(command: PrepareClaim, *pods: str) -> PrepareClaim:
    """The Prepare of a claim whose status.reservedFor names these pods."""
    return replace(command, pod_uids=frozenset(pods))


def test_prepare_records_the_pods_and_a_changed_reservation_is_checkpointed() -> None:
    state, _, effects = ok(
        NodeState.initial(INDIVIDUAL), reserved(individual(INDIVIDUAL, 1, [4]), "pod-a")
    )
    assert state.claims[uid(1)].pod_uids == {"pod-a"}
    assert isinstance(effects[2], WriteCheckpoint)
    assert effects[2].checkpoint.claims[uid(1)].pod_uids == {"pod-a"}
    # The same reservation again: the claim's files are rewritten, nothing else.
    again, value, effects = ok(state, reserved(individual(INDIVIDUAL, 1, [4]), "pod-a"))
    assert again is state
    assert effects == [
        WriteCdiSpec(uid(1), cpus("4")),
        WriteDeviceMetadata(state.claims[uid(1)], INDIVIDUAL),
        Reply(value),
    ]
    # A shared claim gains a consumer: the record and the checkpoint say so, the CPUs stay.
    grown, value, effects = ok(state, reserved(individual(INDIVIDUAL, 1, [4]), "pod-a", "pod-b"))
    assert isinstance(value, ClaimPrepared)
    assert value.cpus == cpus("4")
    assert grown.claims[uid(1)] == replace(
        state.claims[uid(1)], pod_uids=frozenset({"pod-a", "pod-b"})
    )
    assert grown.claimed == state.claimed
    assert [type(e) for e in effects] == [
        WriteCdiSpec,
        WriteDeviceMetadata,
        WriteCheckpoint,
        Reply,
    ]
    assert decode(encode(grown.checkpoint(), 2)).data == grown.checkpoint()


def test_an_adopted_claim_gets_its_pods_from_the_prepare_that_completes_it() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), AdoptClaims((AdoptedClaim(uid(1), cpus("4")),)))
    assert state.claims[uid(1)].pod_uids == frozenset()
    state, _, _ = ok(state, reserved(individual(INDIVIDUAL, 1, [4]), "pod-a"))
    assert state.claims[uid(1)].pod_uids == {"pod-a"}
    assert state.claims[uid(1)].name == "claim-1"


def test_a_copied_env_of_another_pod_is_refused_and_the_claims_own_container_is_pinned() -> None:
    state, _, _ = ok(
        NodeState.initial(INDIVIDUAL), reserved(individual(INDIVIDUAL, 1, [4]), "pod-a")
    )
    state, _, _ = ok(state, CreateContainer(shared_container(1)))
    copier = claim_container(state, 2, 1, pod="pod-b")  # the exact env of the claim
    message = refused(state, CreateContainer(copier), ClaimError, "not reserved for pod pod-b")
    assert f"claim ns/claim-1 ({uid(1)})" in message
    assert "pod ns/pod-2" in message  # the container's pod, by name too
    rightful = claim_container(state, 1, 1, pod="pod-a")
    state, value, _ = ok(state, CreateContainer(rightful))
    assert isinstance(value, ContainerPinned)
    assert value.pin.cpus == cpus("4")
    assert state.owners == {}  # a claim of known pods has no first comer
    # Still refused for the reservation once the claim is in use.
    refused(state, CreateContainer(copier), ClaimError, "not reserved for pod pod-b")


def test_every_container_of_the_claims_pods_shares_its_cpus() -> None:
    state, _, _ = ok(
        NodeState.initial(INDIVIDUAL),
        reserved(individual(INDIVIDUAL, 1, [4, 12]), "pod-a", "pod-b"),
    )
    state, _, _ = ok(state, CreateContainer(shared_container(1)))
    # An init container runs first and exits; the app and a sidecar then run side by side, and
    # a container of the second pod the claim is reserved for joins them.
    init = claim_container(state, 1, 1, pod="pod-a", name="init")
    state, value, _ = ok(state, CreateContainer(init))
    assert isinstance(value, ContainerPinned)
    assert value.pin.cpus == cpus("4,12")
    state, _, _ = ok(state, StopContainer(init.id))
    assert init.id not in state.containers  # its use ended with it
    users = [
        claim_container(state, 2, 1, pod="pod-a", name="app"),
        claim_container(state, 3, 1, pod="pod-a", name="sidecar"),
        claim_container(state, 4, 1, pod="pod-b", name="app"),
    ]
    for container in users:
        state, value, _ = ok(state, CreateContainer(container))
        assert isinstance(value, ContainerPinned)
        assert value.pin.cpus == cpus("4,12")
    assert {cid: r.cpus for cid, r in state.containers.items() if r.claims} == {
        c.id: cpus("4,12") for c in users
    }
    assert state.owners == {}
    assert state.containers["shared-1"].cpus == cpus("1-3,5-7,9-11,13-15")
    message = refused(
        state,
        CreateContainer(claim_container(state, 5, 1, pod="pod-c")),
        ClaimError,
        "not reserved for pod pod-c",
    )
    assert "2 other pod(s)" in message
    # At Synchronize too (a restart finds them all running).
    _, value, _ = ok(state, Synchronize(tuple(c for c in users)))
    assert isinstance(value, Synchronized)
    assert value.rejected == ()
    assert [u.cpus for u in value.updates] == [cpus("4,12")] * 3


def test_synchronize_moves_shared_containers_before_it_narrows_exclusive_ones() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [4]))
    # Ids that sort the other way round: the order is the rule's, not the ids'.
    excl = replace(claim_container(state, 1, 1), id="a-exclusive")
    late = replace(shared_container(1), id="z-shared")
    state, value, _ = ok(state, Synchronize((excl, late)))
    assert isinstance(value, Synchronized)
    assert [u.container_id for u in value.updates] == ["z-shared", "a-exclusive"]
    assert value.updates[0].cpus == cpus("1-3,5-7,9-15")


def test_a_claim_without_known_pods_goes_to_the_first_comer() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [4]))
    assert state.claims[uid(1)].pod_uids == frozenset()
    first = claim_container(state, 2, 1, pod="pod-b")
    state, value, _ = ok(state, CreateContainer(first))
    assert isinstance(value, ContainerPinned)
    assert unreserved_claims(state, claim_container(state, 1, 1, pod="pod-a")) == ()
    refused(
        state,
        CreateContainer(claim_container(state, 1, 1, pod="pod-a")),
        ClaimConflictError,
        "is used by pod pod-b",
    )


def test_unreserved_claims_names_only_claims_whose_env_matches_and_pods_do_not() -> None:
    state, _, _ = ok(
        NodeState.initial(INDIVIDUAL), reserved(individual(INDIVIDUAL, 1, [4]), "pod-a")
    )
    state, _, _ = ok(state, reserved(individual(INDIVIDUAL, 2, [5]), "pod-b"))
    state, _, _ = ok(state, individual(INDIVIDUAL, 3, [6]))  # pods unknown
    both = claim_container(state, 9, 1, 2, 3, pod="pod-b")
    assert unreserved_claims(state, both) == (state.claims[uid(1)],)
    wrong_cpus = Container("x", "pod-b", "ns", "b", "app", (ClaimEnv(uid(1), cpus("5")),))
    assert unreserved_claims(state, wrong_cpus) == ()  # a spoof, not a reservation question
    assert unreserved_claims(state, claim_container(state, 9, 1, pod="pod-a")) == ()


def test_a_fresh_look_at_the_claims_pods_lets_a_new_consumer_in() -> None:
    state, _, _ = ok(
        NodeState.initial(INDIVIDUAL), reserved(individual(INDIVIDUAL, 1, [4]), "pod-a")
    )
    newcomer = claim_container(state, 2, 1, pod="pod-b")
    refused(state, CreateContainer(newcomer), ClaimError, "not reserved")
    # Unknown claims and unchanged pods change nothing.
    for command in (
        UpdateClaimPods(uid(7), frozenset({"pod-b"})),
        UpdateClaimPods(uid(1), frozenset({"pod-a"})),
    ):
        same, value, effects = ok(state, command)
        assert same is state
        assert effects == [Reply(None)]
    state, _, effects = ok(state, UpdateClaimPods(uid(1), frozenset({"pod-b"})))
    assert [type(e) for e in effects] == [WriteCheckpoint, Reply]
    assert isinstance(effects[0], WriteCheckpoint)
    assert effects[0].checkpoint.claims[uid(1)].pod_uids == {"pod-b"}
    state, value, _ = ok(state, CreateContainer(newcomer))
    assert isinstance(value, ContainerPinned)
    assert value.pin.cpus == cpus("4")


def test_known_pods_are_replaced_but_never_emptied() -> None:
    state, _, _ = ok(
        NodeState.initial(INDIVIDUAL), reserved(individual(INDIVIDUAL, 1, [4]), "pod-a")
    )
    # An empty reservation (the claim's pods are gone; Unprepare comes soon) would open the
    # claim to the first comer: the known pods stay.
    for command in (UpdateClaimPods(uid(1), frozenset()), individual(INDIVIDUAL, 1, [4])):
        same, _, effects = ok(state, command)
        assert same.claims[uid(1)].pod_uids == {"pod-a"}
        assert not any(isinstance(e, WriteCheckpoint) for e in effects)
    refused(state, CreateContainer(claim_container(state, 2, 1, pod="pod-b")), ClaimError, "not")


def test_synchronize_confines_a_copied_env_and_pins_the_claims_own_container() -> None:
    state, _, _ = ok(
        NodeState.initial(INDIVIDUAL), reserved(individual(INDIVIDUAL, 1, [4]), "pod-a")
    )
    # The copier sorts first: it must not become the claim's owner.
    copier = replace(claim_container(state, 2, 1, pod="pod-b"), id="a-copier")
    rightful = claim_container(state, 1, 1, pod="pod-a")
    state, value, _ = ok(state, Synchronize((rightful, copier)))
    assert isinstance(value, Synchronized)
    pool = cpus("1-3,5-7,9-15")  # reserved: 0 and 8; claimed: 4
    assert value.updates == (
        ContainerUpdate("a-copier", pool, None, 1),
        ContainerUpdate("excl-1", cpus("4"), None, 1),
    )
    assert [r.container_id for r in value.rejected] == ["a-copier"]
    assert "not reserved for pod pod-b" in value.rejected[0].reason
    assert state.shared == {"a-copier"}
    assert state.owners == {}


def test_a_copier_noted_by_a_fresh_look_is_refused_without_another_look() -> None:
    state, _, _ = ok(
        NodeState.initial(INDIVIDUAL), reserved(individual(INDIVIDUAL, 1, [4]), "pod-a")
    )
    copier = replace(claim_container(state, 2, 1, pod="pod-b"), id="a-copier")
    _, value, _ = ok(state, Synchronize((copier,)))
    assert isinstance(value, Synchronized)
    assert [(r.container_id, r.noted) for r in value.rejected] == [("a-copier", False)]
    assert unreserved_claims(state, copier) == (state.claims[uid(1)],)  # to look at
    # The look found pod-b not reserved: noted on the claim, and checkpointed.
    state, _, effects = ok(
        state,
        UpdateClaimPods(uid(1), frozenset({"pod-a"}), frozenset({"web"}), frozenset({"pod-b"})),
    )
    assert state.claims[uid(1)].copiers == {"pod-b"}
    assert state.claims[uid(1)].pod_names == {"web"}
    assert isinstance(effects[0], WriteCheckpoint)
    assert effects[0].checkpoint.claims[uid(1)].copiers == {"pod-b"}
    # Noted: nothing to look at, the refusal says so, Synchronize marks it noted.
    assert unreserved_claims(state, copier) == ()
    refused(state, CreateContainer(copier), ClaimNotReservedError, "not reserved for pod pod-b")
    _, [reply] = apply(state, CreateContainer(copier))
    assert isinstance(reply, Reply)
    assert isinstance(reply.value, ClaimNotReservedError)
    assert reply.value.noted
    _, value, _ = ok(state, Synchronize((copier,)))
    assert isinstance(value, Synchronized)
    assert [(r.container_id, r.noted) for r in value.rejected] == [("a-copier", True)]
    # The same look again changes nothing; a pod of the claim is never a copier.
    same, _, effects = ok(
        state,
        UpdateClaimPods(uid(1), frozenset({"pod-a"}), frozenset({"web"}), frozenset({"pod-b"})),
    )
    assert same is state
    assert effects == [Reply(None)]
    grown, _, _ = ok(state, reserved(individual(INDIVIDUAL, 1, [4]), "pod-a", "pod-b"))
    assert grown.claims[uid(1)].copiers == frozenset()


def test_update_container_answers_like_create() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [4]))
    container = claim_container(state, 1, 1)
    state, created, _ = ok(state, CreateContainer(container))
    state2, updated, _ = ok(state, UpdateContainer(container))
    assert isinstance(created, ContainerPinned)
    assert isinstance(updated, ContainerPinned)
    assert updated == replace(created, pin=created.pin._replace(seq=2))  # a new decision
    assert state2.containers == {
        cid: record._replace(seq=2) for cid, record in state.containers.items()
    }


def test_stop_widens_shared_containers_after_an_unprepare() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, CreateContainer(shared_container(1)))
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    excl = claim_container(state, 1, 1)
    state, _, _ = ok(state, CreateContainer(excl))
    assert state.containers["shared-1"].cpus == cpus("1-3,5-7,9-15")
    state, _, effects = ok(state, UnprepareClaim(uid(1)))
    assert not any(isinstance(e, UpdateContainers) for e in effects)  # runtime may deadlock
    state, value, _ = ok(state, StopContainer(excl.id))
    update = ContainerUpdate("shared-1", cpus("1-7,9-15"), None, state.pin_seq)
    assert value == ContainerForgotten(excl.id, (update,))
    assert excl.id not in state.containers


def test_remove_sends_no_update() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, CreateContainer(shared_container(1)))
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    excl = claim_container(state, 1, 1)
    state, _, _ = ok(state, CreateContainer(excl))
    state, _, _ = ok(state, UnprepareClaim(uid(1)))
    before = state.pin_seq
    state, value, _ = ok(state, RemoveContainer(excl.id))
    assert value == ContainerForgotten(excl.id, ())
    assert state.containers["shared-1"].cpus == cpus("1-3,5-7,9-15")  # still to be widened
    assert state.pin_seq == before  # no decision


def test_unprepare_widens_at_once_when_the_runtime_allows_unsolicited_updates() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, Synchronize((shared_container(1),), unsolicited_updates=True))
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    state, _, _ = ok(state, CreateContainer(claim_container(state, 1, 1)))
    before = state.pin_seq
    state, _, effects = ok(state, UnprepareClaim(uid(1)))
    assert state.pin_seq == before + 1
    assert effects[3:] == [
        Reply(ClaimUnprepared(uid(1), cpus("4"))),
        UpdateContainers((ContainerUpdate("shared-1", cpus("1-7,9-15"), None, state.pin_seq),)),
    ]
    assert state.containers["shared-1"].cpus == cpus("1-7,9-15")
    assert state.containers["shared-1"].seq == state.pin_seq
    state, _, _ = ok(state, RuntimeDisconnected())
    assert not state.unsolicited_updates


def test_failed_unsolicited_update_is_sent_again() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, Synchronize((shared_container(1),), unsolicited_updates=True))
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    state, _, _ = ok(state, CreateContainer(claim_container(state, 1, 1)))
    # DeleteCdiSpec, DeleteDeviceMetadata, WriteCheckpoint ok; UpdateContainers fails
    disk = FakeDisk(fail_at=3)
    state, value = run(state, UnprepareClaim(uid(1)), disk)
    assert value == ClaimUnprepared(uid(1), cpus("4"))
    assert state.claims == {}  # committed despite the post-commit failure
    assert state.containers["shared-1"].cpus == CpuSet()  # unknown now
    new, value, _ = ok(state, CreateContainer(shared_container(2)))
    seq = new.pin_seq
    assert value == ContainerPinned(
        ContainerUpdate("shared-2", cpus("1-7,9-15"), None, seq),
        (ContainerUpdate("shared-1", cpus("1-7,9-15"), None, seq),),
    )


def test_synchronize_repins_everything_and_confines_unverifiable_containers() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4, 12]))
    good = claim_container(state, 1, 1)
    spoof = Container("spoof", "pod-x", "ns", "x", "app", (ClaimEnv(uid(1), cpus("5")),))
    broken = Container.from_env("broken", "pod-y", [f"DRA_CPUSET_{uid(2)}"])
    plain = shared_container(1)
    state, value, _ = ok(state, Synchronize((plain, spoof, good, broken)))
    pool = cpus("1-3,5-7,9-11,13-15")
    assert isinstance(value, Synchronized)
    assert state.pin_seq == 1
    assert value.updates == (  # every shared container moved before an exclusive one narrows
        ContainerUpdate("broken", pool, None, 1),
        ContainerUpdate("shared-1", pool, None, 1),
        ContainerUpdate("spoof", pool, None, 1),
        ContainerUpdate("excl-1", cpus("4,12"), None, 1),
    )
    assert [r.container_id for r in value.rejected] == ["broken", "spoof"]
    assert "spoofed" in value.rejected[1].reason
    assert value.unpinned == ()
    assert state.shared == {"broken", "shared-1", "spoof"}
    assert state.owners == {uid(1): good.pod_uid}


def test_synchronize_with_an_empty_pool_leaves_shared_containers_unpinned() -> None:
    state = NodeState.initial(GROUPED)
    state, _, _ = ok(state, grouped(1, ("cpudevnuma000", 6), ("cpudevnuma001", 8)))
    state, value, _ = ok(state, Synchronize((shared_container(1),)))
    assert value == Synchronized((), (), ("shared-1",))
    assert state.containers["shared-1"].cpus == CpuSet()


def test_synchronize_mems_and_pinned_memory() -> None:
    config = config_for(CpuDeviceMode.INDIVIDUAL, pin_memory=True)
    state = NodeState.initial(config)
    state, value, _ = ok(state, individual(config, 1, [4, 5]))
    assert isinstance(value, ClaimPrepared)
    assert value.mems == cpus("1")
    state, value, _ = ok(state, replace(individual(config, 2, [1, 6]), pin_memory=False))
    assert isinstance(value, ClaimPrepared)
    assert value.mems is None
    state, value, _ = ok(state, individual(config, 3, [2, 7]))
    assert isinstance(value, ClaimPrepared)
    assert value.mems == cpus("0-1")
    container = claim_container(state, 1, 1, 3)
    state, value, _ = ok(state, CreateContainer(container))
    assert value == ContainerPinned(ContainerUpdate("excl-1", cpus("2,4-5,7"), cpus("0-1"), 1), ())
    _, value, _ = ok(state, Synchronize((container,)))
    pin = ContainerUpdate("excl-1", cpus("2,4-5,7"), cpus("0-1"), 2)
    assert value == Synchronized((pin,), (), ())


def test_invalidate_containers_resends_on_the_next_event() -> None:
    state = NodeState.initial(GROUPED)
    state, _, _ = ok(state, CreateContainer(shared_container(1)))
    state, _, _ = ok(state, InvalidateContainers((("shared-1", 1), ("unknown", 1))))
    assert state.containers["shared-1"].cpus == CpuSet()
    new, value, _ = ok(state, StopContainer("nothing"))
    update = ContainerUpdate("shared-1", cpus("1-7,9-15"), None, 2)
    assert value == ContainerForgotten("nothing", (update,))
    assert new.containers["shared-1"] == state.containers["shared-1"]._replace(
        cpus=update.cpus, seq=2
    )


def test_a_failed_pin_decided_anew_meanwhile_is_not_invalidated() -> None:
    """The runtime failed the update of decision 2 after the owner decided 3 for the same
    container (sent its own way): the newer pin stands; an exclusive container is never
    invalidated (it gets no unsolicited update)."""
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, Synchronize((shared_container(1),), unsolicited_updates=True))
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    state, _, _ = ok(state, CreateContainer(claim_container(state, 1, 1)))  # decision 2
    state, _, _ = ok(state, CreateContainer(shared_container(2)))  # decision 3
    assert state.containers["shared-1"].seq == 2
    same, value, _ = ok(state, InvalidateContainers((("shared-1", 1), ("excl-1", 2))))
    assert value is None
    assert same is state
    gone, _, _ = ok(state, InvalidateContainers((("shared-1", 2),)))
    assert gone.containers["shared-1"].cpus == CpuSet()
    assert gone.containers["shared-1"].seq == 2


# --- a pin lost while a container starts ---------------------------------------------------------


def test_a_pin_decided_after_a_containers_creation_is_sent_again_at_its_start() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, Synchronize((), unsolicited_updates=True))  # decision 1
    state, _, _ = ok(state, CreateContainer(shared_container(1)))  # decision 2, on the pool
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    state, _, _ = ok(state, CreateContainer(claim_container(state, 1, 1)))  # 3 narrows shared-1
    record = state.containers["shared-1"]
    assert (record.adjusted, record.seq) == (2, 3)
    assert 4 not in record.cpus
    new, value, effects = ok(state, ContainerStarted("shared-1"))
    assert value is None
    assert new is state  # one writer, nothing to write: the pin is the record's
    assert effects[1:] == [UpdateContainers((record.pin(),))]
    # The claim's container runs on what it was created with; an unknown id is no error.
    for cid in ("excl-1", "gone"):
        same, _, effects = ok(state, ContainerStarted(cid))
        assert same is state
        assert effects == [Reply(None)]


def test_without_unsolicited_updates_a_pin_lost_at_the_start_goes_in_the_next_reply() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, CreateContainer(shared_container(1)))  # decision 1
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    state, _, _ = ok(state, CreateContainer(claim_container(state, 1, 1)))  # decision 2
    pool = state.containers["shared-1"].cpus
    new, _, effects = ok(state, ContainerStarted("shared-1"))
    assert effects == [Reply(None)]
    assert new.containers["shared-1"].cpus == CpuSet()  # unknown: the next reply sends it
    _, value, _ = ok(new, StopContainer("nothing"))
    assert value == ContainerForgotten("nothing", (ContainerUpdate("shared-1", pool, None, 3),))


def test_a_container_listed_by_synchronize_is_sent_its_pin_again_at_its_start() -> None:
    """Synchronize lists created containers too, and does not know what they were created
    with: its reply can reach one while it starts."""
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, Synchronize((shared_container(1),), unsolicited_updates=True))
    record = state.containers["shared-1"]
    assert (record.adjusted, record.seq) == (0, 1)
    _, _, effects = ok(state, ContainerStarted("shared-1"))
    assert effects[1:] == [UpdateContainers((record.pin(),))]


def test_update_container_keeps_the_decision_the_container_was_created_with() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, Synchronize((), unsolicited_updates=True))
    state, _, _ = ok(state, CreateContainer(shared_container(1)))  # decision 2
    state, _, _ = ok(state, UpdateContainer(shared_container(1)))  # decision 3
    record = state.containers["shared-1"]
    assert (record.adjusted, record.seq) == (2, 3)
    _, _, effects = ok(state, ContainerStarted("shared-1"))
    assert effects[1:] == [UpdateContainers((record.pin(),))]
    state, _, _ = ok(state, CreateContainer(shared_container(2)))  # decision 4, created
    assert state.containers["shared-2"].adjusted == 4


# --- adoption, resync, restore -------------------------------------------------------------------


def test_adopt_claims_from_cdi_specs() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [4]))
    command = AdoptClaims(
        (
            AdoptedClaim(uid(2), cpus("5,13")),
            AdoptedClaim(uid(1), cpus("4")),  # already known, same cpus: fine
            AdoptedClaim(uid(3), cpus("13")),  # taken by uid(2) just now
            AdoptedClaim(uid(4), cpus("0")),  # reserved
            AdoptedClaim(uid(5), cpus("6")),
            AdoptedClaim("bad", cpus("7")),
            AdoptedClaim(uid(1), cpus("7")),  # known with other cpus
        )
    )
    new, value, effects = ok(state, command)
    assert isinstance(value, ClaimsAdopted)
    assert value.adopted == (uid(2), uid(5))
    assert [u for u, _ in value.rejected] == [uid(3), uid(4), "bad", uid(1)]
    assert effects == [
        WriteCdiSpec(uid(2), cpus("5,13")),
        WriteCdiSpec(uid(5), cpus("6")),
        WriteCheckpoint(CheckpointData(new.claims)),
        Reply(value),
    ]
    assert new.claims[uid(2)].results == ()


def test_adopted_claim_is_completed_by_a_consistent_prepare() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, AdoptClaims((AdoptedClaim(uid(1), cpus("5,13")),)))
    refused(state, individual(INDIVIDUAL, 1, [5]), ClaimConflictError, "do not describe")
    refused(state, individual(INDIVIDUAL, 1, [5, 6]), ClaimConflictError, "ask 1 CPUs")
    new, value, effects = ok(state, individual(INDIVIDUAL, 1, [5, 13]))
    assert isinstance(value, ClaimPrepared)
    assert value.cpus == cpus("5,13")
    assert new.claims[uid(1)].results != ()
    assert effects == [
        WriteCdiSpec(uid(1), cpus("5,13")),
        WriteDeviceMetadata(new.claims[uid(1)], INDIVIDUAL),
        WriteCheckpoint(CheckpointData(new.claims)),
        Reply(value),
    ]


def test_an_adopted_claim_takes_its_own_memory_pinning_when_prepared() -> None:
    # Adoption knows only the CPUs (the node's default: no pinning); the kubelet's Prepare brings
    # the claim's opaque config (memory: pin).
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, AdoptClaims((AdoptedClaim(uid(1), cpus("5,13")),)))
    assert state.claims[uid(1)].mems is None
    command = replace(individual(INDIVIDUAL, 1, [5, 13]), pin_memory=True)
    new, value, effects = ok(state, command)
    assert isinstance(value, ClaimPrepared)
    assert value.mems == new.claims[uid(1)].mems == cpus("1")
    (checkpoint,) = [e for e in effects if isinstance(e, WriteCheckpoint)]
    assert checkpoint.checkpoint == new.checkpoint()


def test_adopted_grouped_claim_is_checked_per_device() -> None:
    state = NodeState.initial(GROUPED)
    state, _, _ = ok(state, AdoptClaims((AdoptedClaim(uid(1), cpus("2,5,13")),)))
    refused(
        state,
        grouped(1, ("cpudevnuma000", 2), ("cpudevnuma001", 1)),
        ClaimConflictError,
        "ask 2 CPUs of device cpudevnuma000",
    )
    _, value, _ = ok(state, grouped(1, ("cpudevnuma000", 1), ("cpudevnuma001", 2)))
    assert isinstance(value, ClaimPrepared)
    assert value.cpus == cpus("2,5,13")


def test_resync_rewrites_specs_prunes_and_publishes() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, individual(INDIVIDUAL, 2, [5]))
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    new, _value, effects = ok(state, Resync())
    assert new == state
    # The files after the answer, each on its own (a CDI dir that cannot be written keeps no
    # SIGHUP from applying): every spec, the prune, then every claim's metadata.
    assert effects == [
        ConfineHostCgroups((), state.host_pool),  # none listed: gives back what was found
        PublishSlices(tuple(INDIVIDUAL.devices.values())),
        Reply(Resynced(2)),
        WriteCdiSpec(uid(1), cpus("4")),
        WriteCdiSpec(uid(2), cpus("5")),
        PruneCdiSpecs(frozenset({uid(1), uid(2)})),
        WriteDeviceMetadata(state.claims[uid(1)], INDIVIDUAL),
        WriteDeviceMetadata(state.claims[uid(2)], INDIVIDUAL),
        PruneDeviceMetadata(frozenset({uid(1), uid(2)})),
    ]


def test_repair_puts_the_named_claims_files_right_after_the_answer() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    new, value, effects = ok(state, RepairNodeFiles(frozenset({uid(1), uid(3)})))
    assert new is state
    assert value is None
    assert effects == [
        Reply(None),
        WriteCdiSpec(uid(1), cpus("4")),  # prepared: its files written
        WriteDeviceMetadata(state.claims[uid(1)], INDIVIDUAL),
        DeleteCdiSpec(uid(3)),  # not prepared here: its files removed, looked for by UID
        DeleteDeviceMetadata(uid(3), None),
    ]
    _, _, everything = ok(state, RepairNodeFiles())
    assert everything == [
        Reply(None),
        WriteCdiSpec(uid(1), cpus("4")),
        PruneCdiSpecs(frozenset({uid(1)})),
        WriteDeviceMetadata(state.claims[uid(1)], INDIVIDUAL),
        PruneDeviceMetadata(frozenset({uid(1)})),
    ]


def test_restore_round_trip_through_the_checkpoint() -> None:
    state = NodeState.initial(GROUPED)
    state, _, _ = ok(state, grouped(1, ("cpudevnuma000", 3)))
    second = grouped(2, ("cpudevnuma001", 2), ("cpudevnuma000", 1))
    state, _, _ = ok(state, second)
    restored, rejected = restore_state(GROUPED, decode(encode(state.checkpoint(), 1)).data)
    assert rejected == ()
    assert restored == NodeState(GROUPED, state.claims, state.claimed)
    check_invariants(restored)
    # and the restored state answers a re-prepare idempotently
    new, effects = apply(restored, second)
    assert new is restored
    assert effects[0] == WriteCdiSpec(uid(2), state.claims[uid(2)].cpus)


def test_restore_drops_claims_that_no_longer_fit() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    state, _, _ = ok(state, individual(INDIVIDUAL, 2, [5]))
    now_reserved = config_for(CpuDeviceMode.INDIVIDUAL, reserved="0,5,8")
    restored, rejected = restore_state(now_reserved, state.checkpoint())
    assert set(restored.claims) == {uid(1)}
    assert rejected == ((uid(2), "cpus 5 are reserved"),)
    check_invariants(restored)


def test_restore_drops_a_claim_whose_uid_is_not_a_uuid() -> None:
    # A checkpoint that decodes (checksum fine) but names a claim that can have no CDI spec:
    # keeping it made every Resync fail at the CDI write (the start-up one too).
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    bad = PreparedClaim("../../etc", cpus("5"))
    data = CheckpointData({**state.claims, bad.claim_uid: bad})
    restored, rejected = restore_state(INDIVIDUAL, decode(encode(data, 1)).data)
    assert set(restored.claims) == {uid(1)}
    assert restored.claimed == cpus("4")
    assert rejected == (("../../etc", "malformed record"),)
    check_invariants(restored)


# --- rollback ------------------------------------------------------------------------------------


def test_commit_phase_splits_at_the_reply() -> None:
    effects: list[Effect] = [DeleteCdiSpec("a"), Reply(1), UpdateContainers(())]
    assert commit_phase(effects) == ([DeleteCdiSpec("a")], Reply(1), [UpdateContainers(())])
    with pytest.raises(ValueError, match="no Reply"):
        commit_phase([DeleteCdiSpec("a")])


def rollback_cases() -> list[tuple[str, NodeState, Command]]:
    base = NodeState.initial(INDIVIDUAL)
    held, _, _ = ok(base, individual(INDIVIDUAL, 1, [4]))
    adopted, _, _ = ok(held, AdoptClaims((AdoptedClaim(uid(2), cpus("6")),)))
    synced, _, _ = ok(held, Synchronize(()))
    listed, _, _ = ok(synced, PodsListed(frozenset()))
    return [
        ("prepare", held, individual(INDIVIDUAL, 2, [5, 13])),
        ("re-prepare", held, individual(INDIVIDUAL, 1, [4])),
        ("complete-adopted", adopted, individual(INDIVIDUAL, 2, [6])),
        ("unprepare", held, UnprepareClaim(uid(1))),
        ("unprepare-unknown", held, UnprepareClaim(uid(3))),
        ("release", listed, PodsListed(frozenset())),
        ("adopt", held, AdoptClaims((AdoptedClaim(uid(2), cpus("6")),))),
        ("resync", adopted, Resync()),
        ("resync-topology", adopted, Resync(topology16(offline="4-5"), reserved=cpus("0-1,8"))),
    ]


@pytest.mark.parametrize(("case", "state", "command"), rollback_cases())
def test_failure_at_any_commit_effect_keeps_the_old_state_on_disk(
    case: str, state: NodeState, command: Command
) -> None:
    _, effects = apply(state, command)
    commit, _, _ = commit_phase(effects)
    assert commit, case
    for fail_at in range(len(commit)):
        disk = FakeDisk(
            cdi={u: c.cpus for u, c in state.claims.items()},
            metadata={u: c for u, c in state.claims.items() if c.results},
            checkpoint=encode(state.checkpoint(), 1),
            fail_at=fail_at,
        )
        kept, value = run(state, command, disk)
        assert kept is state, (case, fail_at)
        assert isinstance(value, CdiError), (case, fail_at)
        disk_matches(state, disk)
        if isinstance(command, Resync):
            assert disk.slices in (None, tuple(state.config.devices.values()))


@pytest.mark.parametrize(("case", "state", "command"), rollback_cases())
def test_success_leaves_the_new_state_on_disk(
    case: str, state: NodeState, command: Command
) -> None:
    disk = FakeDisk(
        cdi={u: c.cpus for u, c in state.claims.items()},
        metadata={u: c for u, c in state.claims.items() if c.results},
        checkpoint=encode(state.checkpoint(), 1),
    )
    new, value = run(state, command, disk)
    assert not isinstance(value, DracpuError), (case, value)
    disk_matches(new, disk)


def test_rollback_restores_files_in_reverse_order() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [4]))
    claim = state.claims[uid(1)]
    error = CdiError("boom")
    other = PreparedClaim(uid(2), cpus("5"), "ns", "b", results=(DeviceResult("r", NODE, "x"),))
    undo = rollback(
        state,
        [
            WriteCdiSpec(uid(2), cpus("5")),
            WriteDeviceMetadata(other, INDIVIDUAL),
            DeleteCdiSpec(uid(1)),
            DeleteDeviceMetadata(uid(1), ("r0",)),
            WriteCheckpoint(CheckpointData()),
        ],
        error,
    )
    assert undo == [
        WriteCheckpoint(state.checkpoint()),
        WriteDeviceMetadata(claim, INDIVIDUAL),
        WriteCdiSpec(uid(1), cpus("4")),
        DeleteDeviceMetadata(uid(2), ("r",)),  # the requests the failed command wrote
        DeleteCdiSpec(uid(2)),
        Reply(error),
    ]


def test_rollback_leaves_the_metadata_of_a_claim_held_without_results() -> None:
    # An adopted claim (known from its CDI spec only) has no metadata of its own to put back:
    # what a failed Prepare of it wrote stays (it describes the claim, and the next Prepare
    # writes it again), and a Resync never writes one for it.
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, AdoptClaims((AdoptedClaim(uid(1), cpus("5,13")),)))
    _, effects = apply(state, individual(INDIVIDUAL, 1, [5, 13]))
    commit, _, _ = commit_phase(effects)
    assert [type(e) for e in commit] == [WriteCdiSpec, WriteDeviceMetadata, WriteCheckpoint]
    undo = rollback(state, commit, CdiError("boom"))
    assert undo[:-1] == [WriteCheckpoint(state.checkpoint()), WriteCdiSpec(uid(1), cpus("5,13"))]
    _, effects = apply(state, Resync())
    assert not any(isinstance(e, WriteDeviceMetadata) for e in effects)
    assert PruneDeviceMetadata(frozenset({uid(1)})) in effects  # its files are kept


# --- invariants ----------------------------------------------------------------------------------


def test_check_invariants_catches_broken_states() -> None:
    state, _, _ = ok(NodeState.initial(INDIVIDUAL), individual(INDIVIDUAL, 1, [4]))
    with pytest.raises(InvariantError, match="claimed mask"):
        check_invariants(replace(state, claimed=cpus("4-5")))
    overlapping = dict(state.claims)
    overlapping[uid(2)] = PreparedClaim(uid(2), cpus("4"))
    with pytest.raises(InvariantError, match="shares cpus 4"):
        check_invariants(replace(state, claims=overlapping))
    with pytest.raises(InvariantError, match="claims hold reserved cpus 0"):
        check_invariants(
            replace(state, claims={uid(3): PreparedClaim(uid(3), cpus("0"))}, claimed=cpus("0"))
        )
    record = ContainerRecord(shared_container(1), (), cpus("1-15"))
    with pytest.raises(InvariantError, match="shared container ids"):
        check_invariants(replace(state, containers={"shared-1": record}))
    excl = claim_container(state, 1, 1)
    bad = {
        "shared-1": record,
        excl.id: ContainerRecord(excl, (uid(1),), cpus("4")),
    }
    broken = replace(state, containers=bad, shared=frozenset({"shared-1"}))
    with pytest.raises(InvariantError, match="of unknown pods, taken by pod None"):
        check_invariants(broken)
    owners = {uid(1): excl.pod_uid}
    with pytest.raises(InvariantError, match="shared container shared-1 runs on cpus 4 of"):
        check_invariants(replace(broken, owners=owners))
