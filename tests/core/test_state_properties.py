"""Random command sequences against the node state machine.

After every command: exactly one Reply; a refused command leaves the very same state; the
invariants hold (:func:`check_invariants`); and, running the effects through the reference
executor over a fake disk with failures injected at random commit-phase effects, the CDI specs
and the checkpoint on the fake disk always equal the claims of the state that was kept.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dracpu.core.allocator import Strategy
from dracpu.core.checkpoint_schema import decode, encode
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
    Resync,
    RuntimeDisconnected,
    StopContainer,
    Synchronize,
    UnprepareClaim,
    UpdateClaimPods,
    UpdateContainer,
)
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy
from dracpu.core.effects import ClaimPrepared, ContainerPinned, Reply, Synchronized, WriteCdiSpec
from dracpu.core.node_config import NodeConfig
from dracpu.core.state import (
    NodeState,
    apply,
    check_invariants,
    commit_phase,
    restore_state,
)
from dracpu.core.state_containers import claims_cpus, unreserved_claims
from dracpu.errors import DracpuError
from dracpu.sim.topologies import FIXTURES, build_topology
from tests.core.state_helpers import (
    NODE,
    FakeDisk,
    config_for,
    disk_matches,
    run,
    uid,
    without,
)

__all__: list[str] = []

UIDS = 6  # few claim UIDs, so that reuse, idempotency and conflicts happen often
CONTAINERS = 6
PODS = [f"pod{i}" for i in range(4)]  # the pod UIDs of containers and of claims' reservations


def configs() -> dict[str, NodeConfig]:
    box = build_topology(FIXTURES["offline-isolated"])
    built = {
        "individual": config_for(CpuDeviceMode.INDIVIDUAL, isolated="3,11"),
        "numa": replace(config_for(isolated="6"), host_cgroups=("system.slice",)),
        "machine": replace(
            config_for(group_by=GroupBy.MACHINE, reserved="", pin_memory=True),
            host_cgroups=("system.slice", "kubelet.slice"),
        ),
        "box-numa": NodeConfig.build(NODE, box, reserved=CpuSet.parse("0")),
        "box-individual": NodeConfig.build(
            NODE, box, reserved=CpuSet.parse("1,9"), mode=CpuDeviceMode.INDIVIDUAL
        ),
    }
    # Each config under a node name of its own, so that a drawn Resync finds its machine.
    return {name: replace(config, node_name=f"node-{name}") for name, config in built.items()}


CONFIGS = configs()
# The machine of each config (by node name): a drawn Resync takes some of its CPUs offline.
MACHINES = {config.node_name: config.topology for config in CONFIGS.values()}


def draw_pods(data: st.DataObject) -> frozenset[str]:
    """What a claim's status.reservedFor names (often nothing: pods not known)."""
    return data.draw(st.frozensets(st.sampled_from(PODS), max_size=2), label="pods")


def draw_prepare(data: st.DataObject, state: NodeState) -> Command:
    config = state.config
    n = data.draw(st.integers(0, UIDS - 1), label="claim")
    existing = state.claims.get(uid(n))
    if existing is not None and existing.results and data.draw(st.booleans(), label="again"):
        shuffled = data.draw(st.permutations(existing.results), label="order")
        return PrepareClaim(uid(n), "ns", f"c{n}", tuple(shuffled), pod_uids=draw_pods(data))
    devices = sorted(config.devices)
    results: list[DeviceResult] = []
    for i in range(data.draw(st.integers(0, 4), label="results")):
        name = data.draw(st.sampled_from(devices), label="device")
        device = config.devices[name]
        if device.grouped:
            count = data.draw(st.integers(-1, 6), label="count")
            cpuset = None
            if data.draw(st.integers(0, 5), label="explicit") == 0:
                cpuset = CpuSet(data.draw(st.sets(st.integers(0, 16), max_size=4)))
            strategy = data.draw(st.sampled_from([None, *Strategy]), label="strategy")
            full_cores = data.draw(st.sampled_from([None, False, True]), label="full cores")
            results.append(
                DeviceResult(f"r{i}", config.node_name, name, count, cpuset, strategy, full_cores)
            )
        else:
            results.append(DeviceResult(f"r{i}", config.node_name, name))
    pin = data.draw(st.sampled_from([None, True, False]), label="pin")
    shared_pool = data.draw(st.booleans(), label="shared pool")
    return PrepareClaim(
        uid(n), "ns", f"c{n}", tuple(results), pin, draw_pods(data), shared_pool=shared_pool
    )


def draw_container(data: st.DataObject, state: NodeState) -> Container:
    cid = f"c{data.draw(st.integers(0, CONTAINERS - 1), label='container')}"
    pod = data.draw(st.sampled_from(PODS), label="pod")
    kind = data.draw(st.sampled_from(["shared", "claims", "spoof", "broken"]), label="kind")
    if kind == "shared" or (kind == "claims" and not state.claims):
        return Container(cid, pod, "ns", pod, "app")
    if kind == "claims":
        uids = data.draw(st.sets(st.sampled_from(sorted(state.claims)), min_size=1, max_size=2))
        env = tuple(ClaimEnv(u, state.claims[u].cpus) for u in sorted(uids))
        return Container(cid, pod, "ns", pod, "app", env)
    if kind == "spoof":
        n = data.draw(st.integers(0, UIDS - 1), label="spoofed claim")
        spoofed = CpuSet(data.draw(st.sets(st.integers(0, 15), min_size=1, max_size=3)))
        return Container(cid, pod, "ns", pod, "app", (ClaimEnv(uid(n), spoofed),))
    return Container.from_env(cid, pod, [f"DRA_CPUSET_{uid(0)}=1-"])


def draw_command(data: st.DataObject, state: NodeState) -> Command:
    kind = data.draw(
        st.sampled_from(
            [
                "prepare",
                "prepare",
                "prepare",
                "unprepare",
                "create",
                "create",
                "update",
                "stop",
                "remove",
                "started",
                "sync",
                "listed",
                "pods",
                "adopt",
                "invalidate",
                "disconnect",
                "resync",
            ]
        ),
        label="command",
    )
    container_ids = st.sampled_from([f"c{i}" for i in range(CONTAINERS)])
    match kind:
        case "prepare":
            return draw_prepare(data, state)
        case "unprepare":
            return UnprepareClaim(uid(data.draw(st.integers(0, UIDS - 1), label="claim")))
        case "create":
            return CreateContainer(draw_container(data, state))
        case "update":
            return UpdateContainer(draw_container(data, state))
        case "stop":
            return StopContainer(data.draw(container_ids, label="id"))
        case "remove":
            return RemoveContainer(data.draw(container_ids, label="id"))
        case "started":
            return ContainerStarted(data.draw(container_ids, label="id"))
        case "sync":
            count = data.draw(st.integers(0, 4), label="synced")
            containers = tuple(draw_container(data, state) for _ in range(count))
            return Synchronize(containers, data.draw(st.booleans(), label="unsolicited"))
        case "listed":
            listed = data.draw(st.sets(st.integers(0, UIDS - 1)), label="listed")
            reports = data.draw(st.booleans(), label="reports")
            at = data.draw(st.sampled_from([0.0, 10.0, 1000.0]), label="at")
            return PodsListed(frozenset(uid(n) for n in listed), reports_claims=reports, at=at)
        case "pods":
            n = data.draw(st.integers(0, UIDS - 1), label="claim")
            return UpdateClaimPods(uid(n), draw_pods(data))
        case "adopt":
            n = data.draw(st.integers(0, UIDS - 1), label="claim")
            adopted = CpuSet(data.draw(st.sets(st.integers(0, 16), max_size=3), label="cpus"))
            return AdoptClaims((AdoptedClaim(uid(n), adopted),))
        case "invalidate":
            failed = data.draw(container_ids, label="id")
            record = state.containers.get(failed)
            seq = data.draw(st.sampled_from([0, state.pin_seq, record.seq if record else 0]))
            return InvalidateContainers(((failed, seq),))
        case "disconnect":
            return RuntimeDisconnected()
        case _:
            return draw_resync(data, state)


def draw_resync(data: st.DataObject, state: NodeState) -> Resync:
    """A plain Resync, or a SIGHUP's: CPUs of the machine offline or back, other isolated CPUs,
    other reserved CPUs, memory pinning on or off (each drawn or left out)."""
    if data.draw(st.booleans(), label="plain"):
        return Resync()
    machine = MACHINES[state.config.node_name]
    cpu_ids = sorted(machine.online)
    topology = None
    if data.draw(st.booleans(), label="topology"):
        offline = CpuSet(data.draw(st.sets(st.sampled_from(cpu_ids), max_size=5), label="off"))
        if offline == machine.online:
            offline = CpuSet(cpu_ids[1:])
        isolated = CpuSet(data.draw(st.sets(st.sampled_from(cpu_ids), max_size=3), label="iso"))
        topology = without(replace(machine, isolated=isolated), offline)
    reserved = None
    if data.draw(st.booleans(), label="reserved"):
        reserved = CpuSet(data.draw(st.sets(st.sampled_from(cpu_ids), max_size=4), label="rsv"))
    pin = data.draw(st.sampled_from([None, True, False]), label="pin memory")
    return Resync(topology, reserved, pin)


def check_step(state: NodeState, command: Command, new: NodeState, value: object) -> None:
    """Per-command properties beyond the invariants."""
    if isinstance(value, DracpuError):
        assert new is state
        return
    match command:
        case PrepareClaim(claim_uid=claim_uid) if isinstance(value, ClaimPrepared):
            if value.cpus:
                assert new.claims[claim_uid].cpus == value.cpus
                known = state.claims[claim_uid].pod_uids if claim_uid in state.claims else None
                # the reservation's pods; known pods are never emptied
                assert new.claims[claim_uid].pod_uids == (command.pod_uids or known or frozenset())
                before = state.claims.get(claim_uid)
                if before is not None:
                    # idempotent: the same CPUs (with any that went offline since: rule 2)
                    assert before.cpus == value.cpus
                else:
                    assert value.cpus <= state.config.allocatable
                    assert value.cpus.isdisjoint(state.claimed)
        case Synchronize(containers=containers) if isinstance(value, Synchronized):
            ids = Counter(container.id for container in containers)
            for container in containers:
                # (a duplicated id: the first is judged, the others are refused as duplicates)
                if ids[container.id] == 1 and unreserved_claims(state, container):
                    assert container.id in {r.container_id for r in value.rejected}
                    assert container.id in new.shared
        case UpdateClaimPods(claim_uid=claim_uid, pod_uids=pods) if claim_uid in state.claims:
            before = state.claims[claim_uid]
            assert new.claims[claim_uid] == replace(before, pod_uids=pods or before.pod_uids)
        case UnprepareClaim(claim_uid=claim_uid):
            assert claim_uid not in new.claims
            assert new.claimed == state.claimed - (
                state.claims[claim_uid].cpus if claim_uid in state.claims else CpuSet()
            )
        case CreateContainer(container=container) if isinstance(value, ContainerPinned):
            for env in container.claims:  # a claim with known pods serves only those pods
                pods = state.claims[env.claim_uid].pod_uids
                assert not pods or container.pod_uid in pods
            if container.claims:
                claims = [state.claims[c.claim_uid] for c in container.claims]
                expected = CpuSet.union(claim.cpus for claim in claims)
                if any(claim.shared_pool for claim in claims):  # its claims' and the pool
                    assert value.pin.cpus == expected | new.shared_pool
                    assert container.id in new.mixed
                else:
                    assert value.pin.cpus == expected
                    assert value.pin.cpus.isdisjoint(new.shared_pool)
            else:
                assert value.pin.cpus == state.shared_pool
                assert value.pin.cpus
            # Every container that follows the pool is on it after the reply (rule 7).
            for cid in new.mixed:
                record = new.containers[cid]
                assert record.cpus == claims_cpus(new, record) | new.shared_pool
            # One new decision: every pin it answers with, and every record it moved, has it.
            assert new.pin_seq == state.pin_seq + 1
            assert {u.seq for u in (value.pin, *value.updates)} == {new.pin_seq}
            for update in value.updates:
                assert new.containers[update.container_id].pin() == update
            # It notes the decision it was created with (a start compares with it).
            assert new.containers[container.id].adjusted == new.pin_seq
        case ContainerStarted(container_id=started):
            # No new decision: at most the started container's pin is unknown (sent again).
            assert new.pin_seq == state.pin_seq
            others = {cid: r for cid, r in new.containers.items() if cid != started}
            assert others == {cid: r for cid, r in state.containers.items() if cid != started}
        case _:
            pass
    assert new.pin_seq >= state.pin_seq  # decisions are numbered in order
    for cid, record in new.containers.items():
        old = state.containers.get(cid)
        if old is not None and (old.cpus, old.mems) != (record.cpus, record.mems):
            # a pin changed by a decision (or unknown after a failed update of its own decision)
            assert record.seq > old.seq or (not record.cpus and record.seq == old.seq)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_random_commands_keep_the_invariants_and_the_disk(name: str, data: st.DataObject) -> None:
    state = NodeState.initial(CONFIGS[name])
    disk = FakeDisk()
    check_invariants(state)
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        command = draw_command(data, state)
        new, effects = apply(state, command)
        assert sum(isinstance(e, Reply) for e in effects) == 1
        commit, reply, _ = commit_phase(effects)
        check_invariants(new, state)
        check_step(state, command, new, reply.value)
        rewritten = isinstance(command, PrepareClaim) and command.claim_uid in state.claims
        if rewritten and not isinstance(reply.value, DracpuError):
            assert isinstance(effects[0], WriteCdiSpec)  # the CDI spec is always rewritten
        # now for real, through the executor, maybe failing one commit-phase effect
        fail = None
        if commit and data.draw(st.integers(0, 4), label="inject") == 0:
            fail = data.draw(st.integers(0, len(commit) - 1), label="fail at")
        disk.fail_at = None if fail is None else disk.executed + fail
        kept, value = run(state, command, disk)
        check_invariants(kept)
        if fail is None:
            assert kept == new
        else:
            assert kept is state
            assert isinstance(value, DracpuError)
        disk_matches(kept, disk)
        state = kept
    # a restart restores exactly the claims from the checkpoint on disk
    restored, rejected = restore_state(state.config, decode(disk.checkpoint).data)
    assert rejected == ()
    assert restored.claims == state.claims
    assert restored.claimed == state.claimed
    check_invariants(restored)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_checkpoint_round_trip_of_random_states(data: st.DataObject) -> None:
    state = NodeState.initial(CONFIGS["numa"])
    for _ in range(data.draw(st.integers(1, 15))):
        state, _ = apply(state, draw_prepare(data, state))
    restored, rejected = restore_state(state.config, decode(encode(state.checkpoint(), 1)).data)
    assert rejected == ()
    assert restored == replace(
        NodeState.initial(state.config), claims=state.claims, claimed=state.claimed
    )
