"""The node's CPU state and the pure state machine that changes it.

``apply(state, command) -> (new_state, effects)`` reads no clock, does no I/O and never raises
for bad input: a refused command returns the *same* state object and ``[Reply(error)]``. The
state's values are in :mod:`dracpu.core.state_values`; what the claim commands do is
:mod:`dracpu.core.state_claims`, what the container events do :mod:`dracpu.core.state_containers`.
The effects before the one :class:`Reply` are the commit phase, in crash-safe order
(:func:`commit_phase`); :func:`rollback` says how the state owner undoes one that failed.
The rules every command keeps (:func:`check_invariants`, after every command in the property
tests) and the order of the effects are ``docs/architecture.md``, "The state's rules".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import assert_never

from dracpu.core.cdi_spec import is_valid_claim_uid
from dracpu.core.checkpoint_schema import CheckpointData, PreparedClaim
from dracpu.core.commands import (
    AdoptClaims,
    Command,
    ContainerStarted,
    CreateContainer,
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
)
from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.effects import (
    ConfineHostCgroups,
    DeleteCdiSpec,
    DeleteDeviceMetadata,
    Effect,
    PruneCdiSpecs,
    PruneDeviceMetadata,
    PublishSlices,
    Reply,
    UpdateContainers,
    WriteCdiSpec,
    WriteCheckpoint,
    WriteDeviceMetadata,
)
from dracpu.core.node_config import NodeConfig
from dracpu.core.reconfigure import held_at_restore
from dracpu.core.state_claims import (
    adopt,
    metadata_files,
    pods_listed,
    prepare,
    repair,
    resync,
    unprepare,
    update_claim_pods,
    write_spec,
)
from dracpu.core.state_containers import (
    container_started,
    create_container,
    forget_container,
    invalidate,
    synchronize,
)
from dracpu.core.state_values import ContainerRecord, NodeState
from dracpu.errors import DracpuError

__all__ = [
    "ContainerRecord",
    "InvariantError",
    "NodeState",
    "PreparedClaim",
    "apply",
    "check_invariants",
    "commit_phase",
    "restore_state",
    "rollback",
]


class InvariantError(DracpuError, AssertionError):
    """:func:`check_invariants` found a broken rule: a bug in the state machine."""


# --- apply ----------------------------------------------------------------------------------------


def apply(state: NodeState, command: Command) -> tuple[NodeState, list[Effect]]:
    """Apply one command: the new state and the effects to execute, in order.

    Bad input never raises: the result is ``(state, [Reply(error)])`` with the same state.
    """
    try:
        match command:
            case PrepareClaim():
                return prepare(state, command)
            case UnprepareClaim():
                return unprepare(state, command)
            case UpdateClaimPods():
                return update_claim_pods(state, command)
            case CreateContainer():
                return create_container(state, command.container, created=True)
            case UpdateContainer():
                return create_container(state, command.container, created=False)
            case ContainerStarted():
                return container_started(state, command.container_id)
            case StopContainer():
                return forget_container(state, command.container_id, send_updates=True)
            case RemoveContainer():
                return forget_container(state, command.container_id, send_updates=False)
            case Synchronize():
                return synchronize(state, command)
            case RuntimeDisconnected():
                gone = replace(state, unsolicited_updates=False, containers_known=False)
                return gone, [Reply(None)]
            case InvalidateContainers():
                return invalidate(state, command.failed)
            case PodsListed():
                return pods_listed(state, command)
            case AdoptClaims():
                return adopt(state, command)
            case Resync():
                return resync(state, command)
            case RepairNodeFiles():
                return repair(state, command)
            case _:
                assert_never(command)
    except DracpuError as error:
        return state, [Reply(error)]


# --- restore --------------------------------------------------------------------------------------


def restore_state(
    config: NodeConfig, data: CheckpointData
) -> tuple[NodeState, tuple[tuple[str, str], ...]]:
    """The state after a restart: the checkpoint's claims that still fit the node, and the
    refused ones with the reason (a CPU now reserved, or one the node does not have; the owner
    logs them). A claim holding CPUs that are offline now is kept whole (rule 2), its devices
    in ``config.held`` (:func:`dracpu.core.reconfigure.held_at_restore`)."""
    claims: dict[str, PreparedClaim] = {}
    claimed = EMPTY
    rejected: list[tuple[str, str]] = []
    known = config.topology.online | config.topology.offline
    for uid in sorted(data.claims):
        claim = data.claims[uid]
        if uid != claim.claim_uid or not claim.cpus or not is_valid_claim_uid(uid):
            rejected.append((uid, "malformed record"))
        elif not claim.cpus.isdisjoint(config.reserved):
            rejected.append((uid, f"cpus {claim.cpus & config.reserved} are reserved"))
        elif not claim.cpus <= known:
            rejected.append((uid, f"cpus {claim.cpus - known} are not present on this node"))
        elif not claim.cpus.isdisjoint(claimed):
            rejected.append((uid, f"cpus {claim.cpus & claimed} are held by another claim"))
        else:
            claims[uid] = claim
            claimed |= claim.cpus
    held = held_at_restore(config, claims.values())
    if held:
        config = replace(config, held=held)
    state = NodeState(config=config, claims=MappingProxyType(claims), claimed=claimed)
    return state, tuple(rejected)


# --- running effects ------------------------------------------------------------------------------


def commit_phase(effects: Sequence[Effect]) -> tuple[list[Effect], Reply, list[Effect]]:
    """Split ``apply``'s effects into (commit phase, the reply, post-commit effects)."""
    for index, effect in enumerate(effects):
        if isinstance(effect, Reply):
            return list(effects[:index]), effect, list(effects[index + 1 :])
    raise ValueError("effects hold no Reply")  # apply always returns one


def rollback(old: NodeState, started: Sequence[Effect], error: DracpuError) -> list[Effect]:
    """Effects that undo the commit-phase effects ``started`` (including the one that failed:
    its outcome is unknown), restoring the files of ``old``, then ``Reply(error)``.

    The owner keeps ``old`` and runs these, logging (not raising) their own failures. A claim's
    device metadata is put back only where ``old`` has it (a claim with results); a claim that
    ``old`` holds without results (adopted) keeps whatever metadata is there.
    """
    undo: list[Effect] = []
    seen: set[object] = set()
    for effect in reversed(started):
        match effect:
            case WriteCdiSpec(claim_uid=uid) | DeleteCdiSpec(claim_uid=uid):
                if ("cdi", uid) in seen:
                    continue
                seen.add(("cdi", uid))
                claim = old.claims.get(uid)
                undo.append(DeleteCdiSpec(uid) if claim is None else write_spec(claim))
            case (
                WriteDeviceMetadata(claim=PreparedClaim(claim_uid=uid))
                | DeleteDeviceMetadata(claim_uid=uid)
            ):
                if ("metadata", uid) in seen:
                    continue
                seen.add(("metadata", uid))
                claim = old.claims.get(uid)
                if claim is None:
                    undo.append(DeleteDeviceMetadata(uid, _metadata_requests(started, uid)))
                else:
                    undo.extend(metadata_files(old.config, claim))
            case WriteCheckpoint():
                if "checkpoint" not in seen:
                    seen.add("checkpoint")
                    undo.append(WriteCheckpoint(old.checkpoint()))
            case PublishSlices():
                if "slices" not in seen:
                    seen.add("slices")
                    undo.append(PublishSlices(tuple(old.config.devices.values())))
            case ConfineHostCgroups():
                if "cgroups" not in seen:
                    seen.add("cgroups")
                    undo.append(ConfineHostCgroups(old.config.host_cgroups, old.host_pool))
            case PruneCdiSpecs() | PruneDeviceMetadata() | UpdateContainers() | Reply():
                pass  # prunes remove orphans only; the others are never in the commit phase
            case _:
                assert_never(effect)
    undo.append(Reply(error))
    return undo


def _metadata_requests(started: Sequence[Effect], uid: str) -> tuple[str, ...] | None:
    """The requests the commit phase wrote device metadata for (``None``: it wrote none)."""
    requests = {
        result.request
        for effect in started
        if isinstance(effect, WriteDeviceMetadata) and effect.claim.claim_uid == uid
        for result in effect.claim.results
    }
    return tuple(sorted(requests)) if requests else None


# --- invariants -----------------------------------------------------------------------------------


def check_invariants(state: NodeState, previous: NodeState | None = None) -> None:
    """Raise :class:`InvariantError` naming the first broken rule (recomputes everything).

    ``previous``: the state the command was applied to; then also no CPU that is not
    allocatable joins a claim (only a topology change may leave one in a claim, rule 2)."""

    def fail(message: str) -> None:
        raise InvariantError(message)

    config = state.config
    union = 0
    total = 0
    for uid, claim in state.claims.items():
        if uid != claim.claim_uid:
            fail(f"claim key {uid} holds claim {claim.claim_uid}")
        if not claim.cpus:
            fail(f"claim {uid} holds no CPU")
        if union & claim.cpus.mask:
            fail(f"claim {uid} shares cpus {claim.cpus & CpuSet.from_mask(union)} with another")
        union |= claim.cpus.mask
        total += len(claim.cpus)
    claimed = CpuSet.from_mask(union)
    if claimed != state.claimed:
        fail(f"claimed mask {state.claimed} != union of the claims {claimed}")
    if not claimed.isdisjoint(config.reserved):
        fail(f"claims hold reserved cpus {claimed & config.reserved}")
    if previous is not None:  # (no reserved CPU is claimed: the others are offline, rule 2)
        joined = claimed - previous.claimed - config.allocatable
        if joined:
            fail(f"cpus {joined} joined a claim but are not allocatable")
    for name, lost in config.held.items():
        if not lost.isdisjoint(config.topology.online):
            fail(
                f"device {name} is held for cpus {lost & config.topology.online}, which are online"
            )
        if name in config.devices and not lost.isdisjoint(config.devices[name].cpus):
            fail(f"device {name} is published with cpus it is held for: {lost}")
    pool = config.topology.online - config.reserved - config.topology.isolated - claimed
    if state.shared_pool != pool:
        fail(f"shared pool {state.shared_pool} != online - reserved - isolated - claimed {pool}")
    shared = frozenset(cid for cid, r in state.containers.items() if not r.claims)
    if shared != state.shared:
        fail(f"shared container ids {sorted(state.shared)} != containers without claims")
    for cid, record in state.containers.items():
        if cid != record.container.id:
            fail(f"container key {cid} holds container {record.container.id}")
        if not 0 <= record.seq <= state.pin_seq:
            fail(f"container {cid} is pinned by decision {record.seq}, after {state.pin_seq}")
    if not pool and any(state.containers[cid].cpus for cid in shared):
        fail("the shared pool is empty but shared containers were given CPUs")
    if config.host_cgroups and not state.host_pool:
        fail(f"host cgroups {config.host_cgroups} are listed but no CPU is shared or reserved")
    mixed = frozenset(
        cid
        for cid, r in state.containers.items()
        if any(uid in state.claims and state.claims[uid].shared_pool for uid in r.claims)
    )
    if mixed != state.mixed:
        fail(f"mixed container ids {sorted(state.mixed)} != containers of shared-pool claims")
    for uid in state.owners:
        if uid not in state.claims:
            fail(f"claim {uid} has an owner but is not prepared")
    if not state.unlisted.keys() <= state.claims.keys():
        fail(f"unlisted claims {sorted(state.unlisted.keys() - state.claims.keys())} are gone")
    for cid, record in state.containers.items():
        if not record.claims:
            continue
        missing = [uid for uid in record.claims if uid not in state.claims]
        if missing:
            fail(f"container {cid} uses claims {missing} that are not prepared")
        held = CpuSet.union(state.claims[uid].cpus for uid in record.claims)
        if cid in mixed:
            if record.cpus and not held <= record.cpus:
                fail(f"container {cid} is pinned to {record.cpus} without its claims' {held}")
        elif record.cpus != held:
            fail(f"container {cid} is pinned to {record.cpus}, its claims hold {held}")
        for uid in record.claims:
            owner = state.owners.get(uid)
            if not state.claims[uid].pod_uids and owner != record.container.pod_uid:
                fail(f"container {cid} uses claim {uid} of unknown pods, taken by pod {owner}")
        for sid in shared:
            overlap = state.containers[sid].cpus & held
            if overlap:
                fail(f"shared container {sid} runs on cpus {overlap} of running container {cid}")
        for mid in mixed - {cid}:
            other = state.containers[mid]
            own = CpuSet.union(state.claims[uid].cpus for uid in other.claims)
            overlap = (other.cpus - own) & held - own
            if overlap:
                fail(f"container {mid} shares cpus {overlap} of running container {cid}")
