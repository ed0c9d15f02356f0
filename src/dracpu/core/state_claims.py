"""The node state's claims: what Prepare, Unprepare, adoption, pod listings and Resync do to it
(a part of :func:`dracpu.core.state.apply`).

A claim's CPUs are reserved in the new state before its CDI spec and the checkpoint are
written, and freed in it after its spec is deleted: the effect lists say so, in crash-safe order
(see :mod:`dracpu.core.state`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from types import MappingProxyType

from dracpu.core.allocator import AllocationPolicy, allocate
from dracpu.core.cdi_spec import is_valid_claim_uid
from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.core.commands import (
    AdoptClaims,
    DeviceResult,
    PodsListed,
    PrepareClaim,
    Resync,
    UnprepareClaim,
)
from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.effects import (
    ClaimPrepared,
    ClaimsAdopted,
    ClaimUnprepared,
    DeleteCdiSpec,
    Effect,
    PodsReconciled,
    PruneCdiSpecs,
    PublishSlices,
    ReleasedClaim,
    Reply,
    Resynced,
    WriteCdiSpec,
    WriteCheckpoint,
)
from dracpu.core.node_config import NodeConfig
from dracpu.core.slices import Device
from dracpu.core.state_containers import unsolicited_widening
from dracpu.core.state_values import NodeState, mutable
from dracpu.core.topology import Topology
from dracpu.errors import AllocationError, ClaimConflictError, ClaimError, InsufficientCpusError

__all__ = ["adopt", "pods_listed", "prepare", "resync", "unprepare"]


def _normalized(results: Iterable[DeviceResult]) -> tuple[DeviceResult, ...]:
    return tuple(sorted(results, key=DeviceResult.sort_key))


def _mems_of(topology: Topology, cpus: CpuSet) -> CpuSet:
    """The NUMA nodes of ``cpus``; empty when one has no NUMA node (nothing to pin to)."""
    nodes: set[int] = set()
    for cpu in cpus:
        node = topology.cpus[cpu].numa_node
        if node < 0:
            return EMPTY
        nodes.add(node)
    return CpuSet(nodes)


def _claim_mems(config: NodeConfig, cpus: CpuSet, pin_memory: bool | None) -> CpuSet | None:
    pin = config.pin_memory if pin_memory is None else pin_memory
    if not pin or not cpus:
        return None
    return _mems_of(config.topology, cpus) or None


def _holder(state: NodeState, cpus: CpuSet) -> str:
    """Which claims hold some of ``cpus`` (for error messages only: a scan)."""
    holders = [uid for uid, claim in state.claims.items() if not claim.cpus.isdisjoint(cpus)]
    return ", ".join(sorted(holders)) or "no claim"


def _check_result(config: NodeConfig, uid: str, result: DeviceResult) -> Device:
    """The device of one result, after checking the result's shape."""
    where = f"claim {uid} request {result.request!r}"
    if result.pool != config.node_name:
        raise ClaimError(
            f"{where}: device {result.device!r} is in pool {result.pool!r}, "
            f"not this node's pool {config.node_name!r}"
        )
    device = config.devices.get(result.device)
    if device is None:
        raise ClaimError(f"{where}: device {result.device!r} is not published by this node")
    consumed = result.consumed_cpus
    if consumed is not None and (type(consumed) is not int or consumed <= 0):
        raise ClaimError(
            f"{where}: CPU capacity {consumed!r} for device {device.name!r} must be a positive "
            "whole number"
        )
    if not device.grouped:
        if consumed not in (None, 1):
            raise ClaimError(
                f"{where}: individual device {device.name!r} holds one CPU, not {consumed}"
            )
        if result.cpuset is not None:
            raise ClaimError(f"{where}: an explicit cpuset needs a grouped device")
    elif consumed is None:
        raise ClaimError(
            f"{where}: grouped device {device.name!r} has no consumed capacity 'dra.cpu/cpu'"
        )
    return device


def _pick(
    state: NodeState,
    uid: str,
    results: Sequence[DeviceResult],
    policy: AllocationPolicy,
) -> CpuSet:
    """The CPUs for a new claim: the union over its results."""
    config = state.config
    free = config.allocatable - state.claimed
    assignment = EMPTY
    for result in results:
        device = _check_result(config, uid, result)
        where = f"claim {uid} request {result.request!r} device {device.name!r}"
        group = device.cpus & config.allocatable
        if not device.grouped:
            cpus = group
            if not cpus.isdisjoint(assignment):
                raise ClaimError(f"{where}: the claim lists cpu{cpus.min()} twice")
            if not cpus <= free:
                raise ClaimConflictError(
                    f"{where}: overlapping device assignment: cpus {cpus - free} are already "
                    f"prepared for claim {_holder(state, cpus - free)}"
                )
        else:
            count = result.consumed_cpus
            assert count is not None  # _check_result
            available = (group & free) - assignment
            if result.cpuset is not None:
                cpus = result.cpuset
                if len(cpus) != count:
                    raise ClaimError(
                        f"{where}: cpuset {cpus} has {len(cpus)} CPUs, the claim consumes {count}"
                    )
                if not cpus <= group:
                    raise ClaimError(
                        f"{where}: cpuset {cpus} is not within the device's CPUs {group}"
                        f" (cpus {cpus - group} are outside, reserved or offline)"
                    )
                if not cpus.isdisjoint(assignment):
                    raise ClaimError(f"{where}: cpuset {cpus} overlaps another result's CPUs")
                if not cpus <= free:
                    raise ClaimConflictError(
                        f"{where}: cpus {cpus - free} of cpuset {cpus} are already prepared for "
                        f"claim {_holder(state, cpus - free)}"
                    )
            else:
                if count > len(available):
                    raise InsufficientCpusError(
                        f"{where}: asks {count} CPUs but only {len(available)} of the "
                        f"device's {len(group)} are free"
                    )
                cpus = allocate(config.topology, available, count, policy)
                if len(cpus) != count or not cpus <= available:
                    raise AllocationError(
                        f"{where}: the allocator returned {cpus} for {count} of {available}"
                    )
        assignment |= cpus
    return assignment


def _check_shared_pool(state: NodeState, claimed: CpuSet, what: str) -> None:
    if state.shared and not (state.config.shareable - claimed):
        raise InsufficientCpusError(
            f"{what} would leave no CPU for the {len(state.shared)} shared containers: "
            f"the shared pool {state.shared_pool} would become empty"
        )


def _consistent_with_adopted(
    config: NodeConfig, uid: str, cpus: CpuSet, results: Sequence[DeviceResult]
) -> None:
    """An adopted claim (CPUs known, results not) may be re-prepared with results that fit."""
    per_device: dict[str, int] = {}
    explicit = EMPTY
    for result in results:
        device = _check_result(config, uid, result)
        if device.grouped:
            assert result.consumed_cpus is not None
            per_device[device.name] = per_device.get(device.name, 0) + result.consumed_cpus
            explicit |= result.cpuset or EMPTY
        else:
            per_device[device.name] = per_device.get(device.name, 0) + 1
    covered = EMPTY
    for name, count in per_device.items():
        inside = cpus & config.devices[name].cpus
        if len(inside) != count:
            raise ClaimConflictError(
                f"claim {uid} is prepared with cpus {cpus} ({len(inside)} on device {name}); "
                f"its results ask {count} CPUs of device {name}"
            )
        covered |= inside
    if covered != cpus or not explicit <= cpus:
        raise ClaimConflictError(
            f"claim {uid} is prepared with cpus {cpus}, which its results do not describe"
        )


def prepare(state: NodeState, command: PrepareClaim) -> tuple[NodeState, list[Effect]]:
    uid = command.claim_uid
    if not is_valid_claim_uid(uid):
        raise ClaimError(f"cannot prepare claim {uid!r}: its UID is not an RFC 4122 UUID")
    results = _normalized(command.results)
    existing = state.claims.get(uid)
    if existing is not None:
        prepared = ClaimPrepared(uid, existing.cpus, existing.mems, results)
        # The kubelet asks for it: a pod wants it, whatever a listing missed.
        state = _listed_again(state, uid)
        if existing.results == results:
            # Idempotent; rewrite the CDI spec (a reboot empties /var/run/cdi, k/k#141433).
            return state, [WriteCdiSpec(uid, existing.cpus), Reply(prepared)]
        if existing.results:
            raise ClaimConflictError(
                f"claim {uid} is already prepared for devices {_devices(existing.results)}; "
                f"asked again for devices {_devices(results)}"
            )
        _consistent_with_adopted(state.config, uid, existing.cpus, results)
        claim = replace(existing, namespace=command.namespace, name=command.name, results=results)
        claims = mutable(state.claims)
        claims[uid] = claim
        new = replace(state, claims=MappingProxyType(claims))
        return new, [
            WriteCdiSpec(uid, claim.cpus),
            WriteCheckpoint(new.checkpoint()),
            Reply(prepared),
        ]
    if not results:
        # No result of ours: nothing to hold, no CDI spec (upstream: success, no devices).
        return state, [Reply(ClaimPrepared(uid, EMPTY, None, ()))]
    policy = state.config.policy if command.policy is None else command.policy
    cpus = _pick(state, uid, results, policy)
    claimed = state.claimed | cpus
    _check_shared_pool(state, claimed, f"preparing claim {uid} with cpus {cpus}")
    mems = _claim_mems(state.config, cpus, command.pin_memory)
    claim = PreparedClaim(uid, cpus, command.namespace, command.name, mems, results)
    claims = mutable(state.claims)
    claims[uid] = claim
    new = replace(state, claims=MappingProxyType(claims), claimed=claimed)
    return new, [
        WriteCdiSpec(uid, cpus),
        WriteCheckpoint(new.checkpoint()),
        Reply(ClaimPrepared(uid, cpus, mems, results)),
    ]


def _devices(results: Iterable[DeviceResult]) -> str:
    return (
        ", ".join(
            f"{r.device}" + (f"({r.consumed_cpus})" if r.consumed_cpus is not None else "")
            for r in results
        )
        or "none"
    )


def _listed_again(state: NodeState, uid: str) -> NodeState:
    """The state without a pod-resources miss of claim ``uid``."""
    if uid not in state.unlisted:
        return state
    unlisted = mutable(state.unlisted)
    del unlisted[uid]
    return replace(state, unlisted=MappingProxyType(unlisted))


def _release(state: NodeState, uids: Iterable[str]) -> NodeState:
    """The state without these (prepared) claims.

    Records of containers that still name one of them are dropped: the kubelet unprepares a
    claim only after its pod's containers are gone, so such a record is stale (its remove event
    was missed), and it must not come back to life if the same claim UID is prepared again.
    """
    claims = mutable(state.claims)
    owners = mutable(state.owners)
    freed = 0
    gone: set[str] = set()
    for uid in uids:
        freed |= claims.pop(uid).cpus.mask
        owners.pop(uid, None)
        gone.add(uid)
    containers = state.containers
    stale = [cid for cid, r in containers.items() if not gone.isdisjoint(r.claims)]
    if stale:
        kept = mutable(containers)
        for cid in stale:
            del kept[cid]
        containers = MappingProxyType(kept)
    unlisted = state.unlisted
    if not gone.isdisjoint(unlisted):
        unlisted = MappingProxyType({u: t for u, t in unlisted.items() if u not in gone})
    return replace(
        state,
        claims=MappingProxyType(claims),
        claimed=state.claimed - CpuSet.from_mask(freed),
        owners=MappingProxyType(owners),
        containers=containers,
        unlisted=unlisted,
    )


def unprepare(state: NodeState, command: UnprepareClaim) -> tuple[NodeState, list[Effect]]:
    uid = command.claim_uid
    existing = state.claims.get(uid)
    if existing is None:
        # Unknown: success; still remove a spec a failed earlier attempt may have left.
        return state, [DeleteCdiSpec(uid), Reply(ClaimUnprepared(uid, EMPTY))]
    new = _release(state, [uid])
    new, after = unsolicited_widening(new)
    return new, [
        DeleteCdiSpec(uid),
        WriteCheckpoint(new.checkpoint()),
        Reply(ClaimUnprepared(uid, existing.cpus)),
        *after,
    ]


def _carried(state: NodeState) -> set[str]:
    """The claims a known container names in its ``DRA_CPUSET_*`` env (verified or not)."""
    return {env.claim_uid for r in state.containers.values() for env in r.container.claims}


def _referenced(claim: PreparedClaim, command: PodsListed) -> bool:
    """Whether the listing references ``claim``: by UID, or by name where the kubelet gave no
    UID (a claim we know no name of may be any of those)."""
    if claim.claim_uid in command.claims_in_use:
        return True
    names = command.names_in_use
    return bool(names) and (not claim.name or (claim.namespace, claim.name) in names)


def pods_listed(state: NodeState, command: PodsListed) -> tuple[NodeState, list[Effect]]:
    """A pod-resources listing: mark the claims it misses, release the orphans (see
    :class:`~dracpu.core.commands.PodsListed` for the rules)."""
    if not command.reports_claims:
        new = replace(state, unlisted=MappingProxyType({})) if state.unlisted else state
        return new, [Reply(PodsReconciled((), (), False))]
    carried = _carried(state)
    unlisted: dict[str, float] = {}
    released: list[ReleasedClaim] = []
    for uid in sorted(state.claims):
        claim = state.claims[uid]
        if uid in carried or _referenced(claim, command):
            continue
        since = state.unlisted.get(uid)
        adopted = not claim.results
        ripe = adopted or (since is not None and command.at - since >= command.grace)
        if since is None:
            since = command.at
        if ripe and state.containers_known:
            released.append(
                ReleasedClaim(uid, claim.cpus, claim.namespace, claim.name, adopted, since)
            )
        else:
            unlisted[uid] = since
    waiting = tuple(unlisted)
    if not released:
        new = replace(state, unlisted=MappingProxyType(unlisted))
        return new, [Reply(PodsReconciled((), waiting, True))]
    new = _release(state, [r.claim_uid for r in released])
    new = replace(new, unlisted=MappingProxyType(unlisted))
    new, after = unsolicited_widening(new)
    return new, [
        *(DeleteCdiSpec(r.claim_uid) for r in released),
        WriteCheckpoint(new.checkpoint()),
        Reply(PodsReconciled(tuple(released), waiting, True)),
        *after,
    ]


def _adopt_one(
    state: NodeState, claims: dict[str, PreparedClaim], claimed: CpuSet, uid: str, cpus: CpuSet
) -> str | None:
    """Why a claim cannot be adopted, or ``None`` (then ``claims`` holds it)."""
    if not is_valid_claim_uid(uid):
        return "the UID is not an RFC 4122 UUID"
    if not cpus:
        return "no CPU"
    known = claims.get(uid)
    if known is not None:
        return None if known.cpus == cpus else f"already prepared with cpus {known.cpus}"
    if not cpus <= state.config.allocatable:
        return f"cpus {cpus - state.config.allocatable} are not allocatable (reserved or offline)"
    if not cpus.isdisjoint(claimed):
        return f"cpus {cpus & claimed} are held by another claim"
    if state.shared and not (state.config.shareable - claimed - cpus):
        return "it would leave no CPU for the shared containers"
    claims[uid] = PreparedClaim(uid, cpus, mems=_claim_mems(state.config, cpus, None))
    return None


def adopt(state: NodeState, command: AdoptClaims) -> tuple[NodeState, list[Effect]]:
    claims = mutable(state.claims)
    claimed = state.claimed
    adopted: list[str] = []
    rejected: list[tuple[str, str]] = []
    for item in command.claims:
        fresh = item.claim_uid not in claims
        reason = _adopt_one(state, claims, claimed, item.claim_uid, item.cpus)
        if reason is not None:
            rejected.append((item.claim_uid, reason))
        elif fresh:
            claimed |= item.cpus
            adopted.append(item.claim_uid)
    reply = Reply(ClaimsAdopted(tuple(adopted), tuple(rejected)))
    if not adopted:
        return state, [reply]
    new = replace(state, claims=MappingProxyType(claims), claimed=claimed)
    return new, [
        *(WriteCdiSpec(uid, claims[uid].cpus) for uid in adopted),
        WriteCheckpoint(new.checkpoint()),
        reply,
    ]


def resync(state: NodeState, command: Resync) -> tuple[NodeState, list[Effect]]:
    new = state
    changed = command.config is not None and command.config != state.config
    if command.config is not None and changed:
        config = command.config
        outside = state.claimed - config.allocatable
        if outside:
            raise ClaimConflictError(
                f"cannot take the new topology: cpus {outside} of claim "
                f"{_holder(state, outside)} are no longer allocatable; unprepare it first"
            )
        if state.shared and not (config.shareable - state.claimed):
            raise InsufficientCpusError(
                "cannot take the new topology: it leaves no CPU for the shared containers"
            )
        new = replace(state, config=config)
    new, after = unsolicited_widening(new)
    uids = sorted(new.claims)
    return new, [
        *(WriteCdiSpec(uid, new.claims[uid].cpus) for uid in uids),
        PruneCdiSpecs(frozenset(uids)),
        PublishSlices(new.config.topology),
        Reply(Resynced(len(uids), changed)),
        *after,
    ]
