"""The node state's claims: what Prepare, Unprepare, a fresh look at a claim's pods, adoption,
pod listings and Resync do to it (a part of :func:`dracpu.core.state.apply`).

A claim's CPUs are reserved in the new state before its files (CDI spec, device metadata) and
the checkpoint are written, and freed in it after its files are deleted: the effect lists say so,
in crash-safe order (see :mod:`dracpu.core.state`). Which effects write a claim's files is
:func:`claim_files` (a Resync emits the same effects, every claim's CDI spec before any device
metadata), which remove them :func:`release_files`: every path that releases a claim, Unprepare
or a pod-resources listing, goes through that one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import replace
from types import MappingProxyType

from dracpu.core.allocator import allocate
from dracpu.core.cdi_spec import is_valid_claim_uid
from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.core.commands import (
    AdoptClaims,
    AdoptedClaim,
    DeviceResult,
    PodsListed,
    PrepareClaim,
    RepairNodeFiles,
    Resync,
    UnprepareClaim,
    UpdateClaimPods,
)
from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.device_metadata import check_names, requests_of
from dracpu.core.devices import CpuDeviceMode, Device, GroupBy
from dracpu.core.effects import (
    ClaimPrepared,
    ClaimsAdopted,
    ClaimUnprepared,
    ConfineHostCgroups,
    DeleteCdiSpec,
    DeleteDeviceMetadata,
    Effect,
    PodsReconciled,
    PruneCdiSpecs,
    PruneDeviceMetadata,
    PublishSlices,
    ReleasedClaim,
    Reply,
    Resynced,
    UpdateContainers,
    WriteCdiSpec,
    WriteCheckpoint,
    WriteDeviceMetadata,
)
from dracpu.core.node_config import NodeConfig
from dracpu.core.reconfigure import reconfigure
from dracpu.core.state_containers import claims_cpus, unsolicited_widening
from dracpu.core.state_values import NodeState, mutable
from dracpu.core.topology import Topology
from dracpu.errors import AllocationError, ClaimConflictError, ClaimError, InsufficientCpusError

__all__ = [
    "adopt",
    "claim_files",
    "confinement",
    "metadata_files",
    "pods_listed",
    "prepare",
    "release_files",
    "repair",
    "repair_files",
    "resync",
    "unprepare",
    "update_claim_pods",
    "write_spec",
]


def claim_files(config: NodeConfig, claim: PreparedClaim) -> list[Effect]:
    """The effects that (re)write a prepared claim's files, in order: its CDI spec, then its
    device metadata (:func:`metadata_files`)."""
    return [write_spec(claim), *metadata_files(config, claim)]


def write_spec(claim: PreparedClaim) -> WriteCdiSpec:
    """The effect that (re)writes a prepared claim's CDI spec."""
    return WriteCdiSpec(claim.claim_uid, claim.cpus, claim.shared_pool)


def metadata_files(config: NodeConfig, claim: PreparedClaim) -> list[Effect]:
    """The effect that (re)writes a prepared claim's device metadata, if it has any: a claim
    without results (adopted from its CDI spec: its requests and names are unknown) has none,
    nor has one whose names cannot make paths (Prepare refuses those; only a checkpoint
    written otherwise could hold one)."""
    if not claim.results:
        return []
    try:
        check_names(claim.claim_uid, claim.name, claim.pod_claim_name, claim.results)
    except ClaimError:
        return []
    return [WriteDeviceMetadata(claim, config)]


def confinement(state: NodeState) -> list[Effect]:
    """The effect that confines the listed host cgroups to the state's
    :attr:`~dracpu.core.state_values.NodeState.host_pool` (none when no cgroup is listed):
    after a command that changes the shared pool has written the checkpoint, before its reply,
    so that the claim's CPUs are off the host cgroups when Prepare answers."""
    cgroups = state.config.host_cgroups
    if not cgroups:
        return []
    return [ConfineHostCgroups(cgroups, state.host_pool)]


def release_files(claim_uid: str, claim: PreparedClaim | None) -> list[Effect]:
    """The effects that remove a released claim's files, in order: its CDI spec (no container
    can get its CPUs any more), then its device metadata (of the requests of ``claim``, its
    record; ``None``: not prepared here, whatever a failed earlier attempt left). Unprepare and
    the release of a leaked claim (a pod-resources listing) both use this."""
    requests = requests_of(claim.results) if claim is not None and claim.results else None
    return [DeleteCdiSpec(claim_uid), DeleteDeviceMetadata(claim_uid, requests)]


def repair_files(state: NodeState, uids: frozenset[str] | None) -> list[Effect]:
    """The effects that put the files of the claims ``uids`` right, as ``state`` holds the
    claims: a prepared claim's written (:func:`claim_files`), a claim not prepared here has its
    files removed (:func:`release_files`). ``None``: every prepared claim's files, all CDI specs
    before any device metadata (a metadata dir that cannot be written keeps no spec from being
    written), and whatever of ours no claim owns pruned."""
    claims = state.claims
    if uids is not None:
        return [
            effect
            for uid in sorted(uids)
            for effect in (
                claim_files(state.config, claims[uid])
                if uid in claims
                else release_files(uid, None)
            )
        ]
    keep = frozenset(claims)
    return [
        *(write_spec(claims[uid]) for uid in sorted(keep)),
        PruneCdiSpecs(keep),
        *(effect for uid in sorted(keep) for effect in metadata_files(state.config, claims[uid])),
        PruneDeviceMetadata(keep),
    ]


def repair(state: NodeState, command: RepairNodeFiles) -> tuple[NodeState, list[Effect]]:
    """The files go right after the reply, each on its own: a claim whose file cannot be
    written does not keep the others' from being written, and nothing is rolled back (the
    state does not change)."""
    return state, [Reply(None), *repair_files(state, command.claim_uids)]


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
            raise ClaimError(
                f"{where}: an explicit cpuset needs a grouped device (cpuConfig.cpuset); "
                f"{device.name!r} is one CPU the scheduler chose"
            )
    elif consumed is None:
        raise ClaimError(
            f"{where}: grouped device {device.name!r} has no consumed capacity 'dra.cpu/cpu'"
        )
    return device


def _outside(config: NodeConfig, cpus: CpuSet, device: Device | None = None) -> str:
    """Why CPUs of an explicit cpuset are not ``device``'s (``None``: the node's) to give
    (``""``: they all are)."""
    group = config.allocatable if device is None else device.cpus & config.allocatable
    outside = cpus - group
    if not outside:
        return ""
    offline = outside - config.topology.online
    reserved = (outside & config.reserved) - offline
    elsewhere = outside - offline - reserved
    reasons = [
        f"cpus {part} are {why}"
        for part, why in (
            (offline, "offline or not on this machine"),
            (reserved, "reserved (--reserved-cpus)"),
            (elsewhere, f"not in device {device.name if device else '?'!r}"),
        )
        if part
    ]
    return "; ".join(reasons)


def _one_result_per_request(config: NodeConfig, uid: str, results: Sequence[DeviceResult]) -> None:
    """``groupBy: machine`` takes one result per request, as upstream 0.3 (its upgrade notes:
    "exact or firstAvailable device request count to 1")."""
    if config.mode is not CpuDeviceMode.GROUPED or config.group_by is not GroupBy.MACHINE:
        return
    counts = Counter(result.request for result in results)
    many = sorted(request for request, count in counts.items() if count > 1)
    if many:
        raise ClaimError(
            f"claim {uid} request {many[0]!r} has {counts[many[0]]} devices; with groupBy "
            "machine every request must have count 1 (ask for the CPUs as capacity instead)"
        )


def _from_request_cpuset(
    state: NodeState, where: str, result: DeviceResult, wanted: CpuSet, available: CpuSet
) -> CpuSet:
    """A result's share of its request's cpuset (``allocator: external``): the lowest
    ``consumed_cpus`` of it still available on the device (upstream ``External.Allocate``)."""
    count = result.consumed_cpus
    assert count is not None  # _check_result
    outside = _outside(state.config, wanted)
    if outside:
        raise ClaimError(f"{where}: cpuset {wanted}: {outside}")
    candidates = wanted & available
    if len(candidates) < count:
        taken = wanted & state.claimed
        held = f"; cpus {taken} are prepared for claim {_holder(state, taken)}" if taken else ""
        error = ClaimConflictError if taken else ClaimError
        raise error(
            f"{where}: cannot satisfy request: need {count} CPUs from cpuset {wanted} "
            f"restricted to the device's available cpus {available or 'none'}, only "
            f"{len(candidates)} candidates{held}"
        )
    return candidates.lowest(count)


def _pick(state: NodeState, uid: str, results: Sequence[DeviceResult]) -> CpuSet:
    """The CPUs for a new claim: the union over its results (each result with its own policy
    over the node's default)."""
    config = state.config
    _one_result_per_request(config, uid, results)
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
            if result.request_cpuset is not None:
                cpus = _from_request_cpuset(state, where, result, result.request_cpuset, available)
            elif result.cpuset is not None:
                cpus = result.cpuset
                if len(cpus) != count:
                    raise ClaimError(
                        f"{where}: cpuset {cpus} has {len(cpus)} CPUs, the claim consumes {count}"
                    )
                outside = _outside(config, cpus, device)
                if outside:
                    raise ClaimError(f"{where}: cpuset {cpus}: {outside}")
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
                cpus = allocate(config.topology, available, count, result.policy(config.policy))
                if len(cpus) != count or not cpus <= available:
                    raise AllocationError(
                        f"{where}: the allocator returned {cpus} for {count} of {available}"
                    )
        assignment |= cpus
    return assignment


def _check_shared_pool(state: NodeState, claimed: CpuSet, what: str) -> None:
    config = state.config
    pool = config.shareable - claimed
    if state.shared and not pool:
        raise InsufficientCpusError(
            f"{what} would leave no CPU for the {len(state.shared)} shared containers: "
            f"the shared pool {state.shared_pool} would become empty"
        )
    if config.host_cgroups and not (pool or config.reserved & config.topology.online):
        raise InsufficientCpusError(
            f"{what} would leave no CPU for the confined host cgroups "
            f"({', '.join(config.host_cgroups)}): no CPU would be shared or reserved"
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
        pods, names = _pods(existing, command.pod_uids, command.pod_names)
        # The kubelet asks for it: a pod wants it, whatever a listing missed.
        state = _listed_again(state, uid)
        if existing.results == results:
            # Idempotent; rewrite the files (a reboot empties /var/run/cdi, k/k#141433).
            if existing.pod_uids == pods and existing.pod_names == names:
                return state, [*claim_files(state.config, existing), Reply(prepared)]
            # The same claim, reserved for other pods now (a shared claim gains consumers).
            claim = replace(
                existing, pod_uids=pods, pod_names=names, copiers=existing.copiers - pods
            )
        elif existing.results:
            raise ClaimConflictError(
                f"claim {uid} is already prepared for devices {_devices(existing.results)}; "
                f"asked again for devices {_devices(results)}"
            )
        else:
            _consistent_with_adopted(state.config, uid, existing.cpus, results)
            check_names(uid, command.name, command.pod_claim_name, results)
            # Adoption knew only the CPUs: the claim's own memory pinning (its opaque config) is
            # known now. Its running containers get it at their next pin.
            claim = replace(
                existing,
                namespace=command.namespace,
                name=command.name,
                results=results,
                pod_uids=pods,
                pod_names=names,
                pod_claim_name=command.pod_claim_name,
                mems=_claim_mems(state.config, existing.cpus, command.pin_memory),
                shared_pool=command.shared_pool,
            )
        claims = mutable(state.claims)
        claims[uid] = claim
        new = replace(state, claims=MappingProxyType(claims))
        return new, [
            *claim_files(new.config, claim),
            WriteCheckpoint(new.checkpoint()),
            Reply(ClaimPrepared(uid, claim.cpus, claim.mems, results)),
        ]
    if not results:
        # No result of ours: nothing to hold, no files (upstream: success, no devices).
        return state, [Reply(ClaimPrepared(uid, EMPTY, None, ()))]
    check_names(uid, command.name, command.pod_claim_name, results)
    cpus = _pick(state, uid, results)
    claimed = state.claimed | cpus
    _check_shared_pool(state, claimed, f"preparing claim {uid} with cpus {cpus}")
    mems = _claim_mems(state.config, cpus, command.pin_memory)
    claim = PreparedClaim(
        uid,
        cpus,
        command.namespace,
        command.name,
        mems,
        results,
        pod_uids=command.pod_uids,
        pod_claim_name=command.pod_claim_name,
        pod_names=command.pod_names,
        shared_pool=command.shared_pool,
    )
    claims = mutable(state.claims)
    claims[uid] = claim
    new = replace(state, claims=MappingProxyType(claims), claimed=claimed)
    return new, [
        *claim_files(new.config, claim),
        WriteCheckpoint(new.checkpoint()),
        *confinement(new),
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
    mixed = state.mixed
    stale = [cid for cid, r in containers.items() if not gone.isdisjoint(r.claims)]
    if stale:
        kept = mutable(containers)
        for cid in stale:
            del kept[cid]
        containers = MappingProxyType(kept)
        mixed = mixed.difference(stale)
    unlisted = state.unlisted
    if not gone.isdisjoint(unlisted):
        unlisted = MappingProxyType({u: t for u, t in unlisted.items() if u not in gone})
    return replace(
        state,
        claims=MappingProxyType(claims),
        claimed=state.claimed - CpuSet.from_mask(freed),
        owners=MappingProxyType(owners),
        containers=containers,
        mixed=mixed,
        unlisted=unlisted,
    )


def unprepare(state: NodeState, command: UnprepareClaim) -> tuple[NodeState, list[Effect]]:
    uid = command.claim_uid
    if not is_valid_claim_uid(uid):
        # As Prepare: a UID that names no spec file must not reach the CDI effects.
        raise ClaimError(f"cannot unprepare claim {uid!r}: its UID is not an RFC 4122 UUID")
    existing = state.claims.get(uid)
    if existing is None:
        # Unknown: success; still remove files a failed earlier attempt may have left.
        return state, [*release_files(uid, None), Reply(ClaimUnprepared(uid, EMPTY))]
    new = _release(state, [uid])
    new, after = unsolicited_widening(new)
    return new, [
        *release_files(uid, existing),
        WriteCheckpoint(new.checkpoint()),
        *confinement(new),
        Reply(ClaimUnprepared(uid, existing.cpus)),
        *after,
    ]


def _pods(
    claim: PreparedClaim, seen: frozenset[str], names: frozenset[str]
) -> tuple[frozenset[str], frozenset[str]]:
    """The pods (UIDs, names) to record for ``claim`` when its reservation names ``seen``
    (named ``names``): known pods are replaced, never emptied (an empty record would hand the
    claim to the first pod that shows its env; a claim whose pods are gone is unprepared
    soon)."""
    return (seen, names) if seen else (claim.pod_uids, claim.pod_names)


def update_claim_pods(state: NodeState, command: UpdateClaimPods) -> tuple[NodeState, list[Effect]]:
    """A fresh look at a claim's pods: record them and the copiers it found (and checkpoint) if
    that changes the record. A pod of the claim is never a copier."""
    existing = state.claims.get(command.claim_uid)
    if existing is None:
        return state, [Reply(None)]
    pods, names = _pods(existing, command.pod_uids, command.pod_names)
    copiers = (existing.copiers | command.copiers) - pods
    if (existing.pod_uids, existing.pod_names, existing.copiers) == (pods, names, copiers):
        return state, [Reply(None)]
    claims = mutable(state.claims)
    claims[command.claim_uid] = replace(existing, pod_uids=pods, pod_names=names, copiers=copiers)
    new = replace(state, claims=MappingProxyType(claims))
    return new, [WriteCheckpoint(new.checkpoint()), Reply(None)]


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


def _pod_listed(claim: PreparedClaim, command: PodsListed) -> bool:
    """Whether a pod the claim is reserved for is among the listing's active pods."""
    pods = command.pods
    return any((claim.namespace, name) in pods for name in claim.pod_names)


def pods_listed(state: NodeState, command: PodsListed) -> tuple[NodeState, list[Effect]]:
    """A pod-resources listing: mark the claims it misses, release the orphans (see
    :class:`~dracpu.core.commands.PodsListed` for the rules)."""
    trusted = command.reports_claims or command.authoritative
    carried = _carried(state)
    unlisted: dict[str, float] = {}
    released: list[ReleasedClaim] = []
    for uid in sorted(state.claims):
        claim = state.claims[uid]
        if uid in carried or _referenced(claim, command) or _pod_listed(claim, command):
            continue
        if not trusted and not claim.pod_names:
            continue  # the listing cannot tell: its earlier misses are forgotten
        since = state.unlisted.get(uid)
        adopted = not claim.results
        ripe = (adopted and command.reports_claims) or (
            since is not None and command.at - since >= command.grace
        )
        if since is None:
            since = command.at
        if ripe and state.containers_known:
            released.append(
                ReleasedClaim(
                    uid, claim.cpus, claim.namespace, claim.name, adopted, since, not trusted
                )
            )
        else:
            unlisted[uid] = since
    waiting = tuple(unlisted)
    if not released:
        new = replace(state, unlisted=MappingProxyType(unlisted))
        if new.unlisted == state.unlisted:
            new = state
        return new, [Reply(PodsReconciled((), waiting, trusted))]
    new = _release(state, [r.claim_uid for r in released])
    new = replace(new, unlisted=MappingProxyType(unlisted))
    new, after = unsolicited_widening(new)
    return new, [
        *(
            effect
            for r in released
            for effect in release_files(r.claim_uid, state.claims[r.claim_uid])
        ),
        WriteCheckpoint(new.checkpoint()),
        *confinement(new),
        Reply(PodsReconciled(tuple(released), waiting, trusted)),
        *after,
    ]


def _adopt_one(
    state: NodeState, claims: dict[str, PreparedClaim], claimed: CpuSet, item: AdoptedClaim
) -> str | None:
    """Why a claim cannot be adopted, or ``None`` (then ``claims`` holds it)."""
    uid, cpus = item.claim_uid, item.cpus
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
    config = state.config
    left = config.shareable - claimed - cpus
    if state.shared and not left:
        return "it would leave no CPU for the shared containers"
    if config.host_cgroups and not (left or config.reserved & config.topology.online):
        return "it would leave no CPU for the confined host cgroups"
    claims[uid] = PreparedClaim(
        uid, cpus, mems=_claim_mems(state.config, cpus, None), shared_pool=item.shared_pool
    )
    return None


def adopt(state: NodeState, command: AdoptClaims) -> tuple[NodeState, list[Effect]]:
    claims = mutable(state.claims)
    claimed = state.claimed
    adopted: list[str] = []
    rejected: list[tuple[str, str]] = []
    for item in command.claims:
        fresh = item.claim_uid not in claims
        reason = _adopt_one(state, claims, claimed, item)
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
        *(effect for uid in adopted for effect in claim_files(new.config, claims[uid])),
        WriteCheckpoint(new.checkpoint()),
        *confinement(new),
        reply,
    ]


def resync(state: NodeState, command: Resync) -> tuple[NodeState, list[Effect]]:
    new = state
    changed = None
    if (
        command.topology is not None
        or command.reserved is not None
        or command.pin_memory is not None
        or command.host_cgroups is not None
    ):
        config, changed = reconfigure(state, command)
        new = replace(state, config=config)
    new, after = unsolicited_widening(new)
    repinned = sum(len(e.updates) for e in after if isinstance(e, UpdateContainers))
    pool = new.shared_pool
    waiting = sum(1 for cid in new.shared if pool and new.containers[cid].cpus != pool)
    waiting += sum(
        1
        for cid in new.mixed
        if new.containers[cid].cpus != claims_cpus(new, new.containers[cid]) | pool
    )
    # The files are put right after the reply, each on its own (:func:`repair`): a CDI dir
    # that cannot be written keeps no SIGHUP from applying the node's new config.
    return new, [
        # Always, even with no cgroup listed: a SIGHUP (or a start) without the option puts
        # back what an earlier confinement found.
        ConfineHostCgroups(new.config.host_cgroups, new.host_pool),
        PublishSlices(tuple(new.config.devices.values())),
        Reply(Resynced(len(new.claims), changed, repinned, waiting)),
        *after,
        *repair_files(new, None),
    ]
