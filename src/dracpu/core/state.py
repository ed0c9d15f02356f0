"""The node's CPU state and the pure state machine that changes it (design §3).

``apply(state, command) -> (new_state, effects)`` reads no clock, does no I/O and never raises
for bad input: a refused command returns the *same* state object and ``[Reply(error)]``.

Rules (each checked by :func:`check_invariants` after every command in the property tests):

1. No CPU is held by two claims; ``claimed`` is the union of the claims' CPUs, kept
   incrementally (an apply never recomputes it over all claims).
2. Claims hold only allocatable CPUs: online and not reserved. Reserved CPUs are in no claim
   and never in the shared pool.
3. The shared pool is ``allocatable - claimed - isolated``: isolated CPUs are never shared.
4. The shared pool is never emptied while shared containers exist: a Prepare (or adoption, or
   topology change) that would empty it is refused. A shared container is never created with
   an empty pool (NRI would read an empty cpuset as "no change", issue #295).
5. Prepare is idempotent: the same claim UID with the same results gets the same CPUs and its
   CDI spec rewritten (a reboot empties ``/var/run/cdi``). The same UID with other results is an
   error. Unpreparing an unknown claim succeeds.
6. A container gets a claim's CPUs only if the claim is prepared here with exactly the cpuset its
   ``DRA_CPUSET_<uid>`` env says, and only one (pod, container name) may use a claim until it is
   unprepared (fail closed: a spoofed env is an error for CreateContainer).
7. When a container with a claim starts, the same reply moves every shared container off the
   claim's CPUs.

Effects and rollback. The effects before the one :class:`Reply` are the commit phase, in
crash-safe order: Prepare reserves in the new state, then ``WriteCdiSpec`` → ``WriteCheckpoint``
→ ``Reply``; Unprepare ``DeleteCdiSpec`` → (CPUs freed in the new state) → ``WriteCheckpoint`` →
``Reply``. The state owner runs them like this::

    new, effects = apply(state, command)
    commit, reply, after = commit_phase(effects)
    for i, effect in enumerate(commit):
        try:
            await execute(effect)
        except DracpuError as error:           # translated by the adapter
            for undo in rollback(state, commit[: i + 1], error):   # ends with Reply(error)
                await execute_logging_failures(undo)
            break                              # ``state`` (the old one) is kept
    else:
        state = new                            # committed
        send(reply.value)
        for effect in after:                   # post-commit: failures are logged only;
            await execute(effect)              # UpdateContainers failing -> InvalidateContainers

The checkpoint on disk therefore always equals the claims of the state the owner keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, TypeVar, assert_never

from dracpu.core.allocator import AllocationPolicy, allocate
from dracpu.core.cdi_spec import is_valid_claim_uid
from dracpu.core.checkpoint_schema import CheckpointData, PreparedClaim
from dracpu.core.commands import (
    AdoptClaims,
    Command,
    Container,
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
    UpdateContainer,
)
from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.effects import (
    ClaimPrepared,
    ClaimsAdopted,
    ClaimUnprepared,
    ContainerForgotten,
    ContainerPinned,
    ContainerRejected,
    ContainerUpdate,
    DeleteCdiSpec,
    Effect,
    PodsReconciled,
    PruneCdiSpecs,
    PublishSlices,
    Reply,
    Resynced,
    Synchronized,
    UpdateContainers,
    WriteCdiSpec,
    WriteCheckpoint,
)
from dracpu.core.node_config import NodeConfig
from dracpu.core.slices import Device
from dracpu.core.topology import Topology
from dracpu.errors import (
    AllocationError,
    ClaimConflictError,
    ClaimError,
    DracpuError,
    InsufficientCpusError,
)

__all__ = [
    "ClaimOwner",
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


def _no_claims() -> Mapping[str, PreparedClaim]:
    return MappingProxyType({})


def _no_containers() -> Mapping[str, ContainerRecord]:
    return MappingProxyType({})


def _no_owners() -> Mapping[str, ClaimOwner]:
    return MappingProxyType({})


K = TypeVar("K")
V = TypeVar("V")


def _mutable(mapping: Mapping[K, V]) -> dict[K, V]:
    """A new dict with the items of ``mapping`` (one of the state's read-only mappings).

    ``dict(proxy)`` reads a ``MappingProxyType`` item by item through the mapping protocol;
    ``proxy.copy()`` copies the dict behind it at once, ~10x faster for hundreds of items.
    """
    if isinstance(mapping, (MappingProxyType, dict)):
        copied = mapping.copy()
        if type(copied) is dict:
            return copied
    return dict(mapping)


class InvariantError(DracpuError, AssertionError):
    """:func:`check_invariants` found a broken rule: a bug in the state machine."""


# --- values ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClaimOwner:
    """The one (pod, container name) allowed to use a claim until it is unprepared."""

    pod_uid: str
    container_name: str


@dataclass(frozen=True, slots=True)
class ContainerRecord:
    """A container the runtime told us about.

    ``claims``: the claims it verifiably uses (empty: a shared container). ``cpus``/``mems``:
    what we last told the runtime to set (``cpus`` empty: unknown, never set or an update
    failed; the next reply that can carry updates sets it).
    """

    container: Container
    claims: tuple[str, ...]
    cpus: CpuSet
    mems: CpuSet | None = None


@dataclass(frozen=True, slots=True)
class NodeState:
    """Everything the state owner knows. Treat as immutable: ``apply`` builds a new one.

    ``claimed`` is the union of the claims' CPUs; ``shared`` the ids of the shared containers;
    ``owners`` who uses each claim; ``unlisted`` the claims missing from the last pod-resources
    listing; ``unsolicited_updates`` whether the runtime takes plugin-initiated updates.
    """

    config: NodeConfig
    claims: Mapping[str, PreparedClaim] = field(default_factory=_no_claims)
    claimed: CpuSet = EMPTY
    containers: Mapping[str, ContainerRecord] = field(default_factory=_no_containers)
    shared: frozenset[str] = frozenset()
    owners: Mapping[str, ClaimOwner] = field(default_factory=_no_owners)
    unlisted: frozenset[str] = frozenset()
    unsolicited_updates: bool = False

    @classmethod
    def initial(cls, config: NodeConfig) -> NodeState:
        """No claims, no containers."""
        return cls(config=config)

    @property
    def shared_pool(self) -> CpuSet:
        """The CPUs of every container without a claim: allocatable - claimed - isolated."""
        return self.config.shareable - self.claimed

    def checkpoint(self) -> CheckpointData:
        """What to persist (the claims; shares the read-only mapping, copies nothing)."""
        return CheckpointData(self.claims)


# --- apply ----------------------------------------------------------------------------------------


def apply(state: NodeState, command: Command) -> tuple[NodeState, list[Effect]]:
    """Apply one command: the new state and the effects to execute, in order.

    Bad input never raises: the result is ``(state, [Reply(error)])`` with the same state.
    """
    try:
        match command:
            case PrepareClaim():
                return _prepare(state, command)
            case UnprepareClaim():
                return _unprepare(state, command)
            case CreateContainer() | UpdateContainer():
                return _create_container(state, command.container)
            case StopContainer():
                return _forget_container(state, command.container_id, send_updates=True)
            case RemoveContainer():
                return _forget_container(state, command.container_id, send_updates=False)
            case Synchronize():
                return _synchronize(state, command)
            case RuntimeDisconnected():
                return replace(state, unsolicited_updates=False), [Reply(None)]
            case InvalidateContainers():
                return _invalidate(state, command.container_ids)
            case PodsListed():
                return _pods_listed(state, command)
            case AdoptClaims():
                return _adopt(state, command)
            case Resync():
                return _resync(state, command)
            case _:
                assert_never(command)
    except DracpuError as error:
        return state, [Reply(error)]


# --- prepare / unprepare --------------------------------------------------------------------------


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


def _prepare(state: NodeState, command: PrepareClaim) -> tuple[NodeState, list[Effect]]:
    uid = command.claim_uid
    if not is_valid_claim_uid(uid):
        raise ClaimError(f"cannot prepare claim {uid!r}: its UID is not an RFC 4122 UUID")
    results = _normalized(command.results)
    existing = state.claims.get(uid)
    if existing is not None:
        prepared = ClaimPrepared(uid, existing.cpus, existing.mems, results)
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
        claims = _mutable(state.claims)
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
    claims = _mutable(state.claims)
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


def _release(state: NodeState, uids: Iterable[str]) -> NodeState:
    """The state without these (prepared) claims.

    Records of containers that still name one of them are dropped: the kubelet unprepares a
    claim only after its pod's containers are gone, so such a record is stale (its remove event
    was missed), and it must not come back to life if the same claim UID is prepared again.
    """
    claims = _mutable(state.claims)
    owners = _mutable(state.owners)
    freed = 0
    gone: set[str] = set()
    for uid in uids:
        freed |= claims.pop(uid).cpus.mask
        owners.pop(uid, None)
        gone.add(uid)
    containers = state.containers
    stale = [cid for cid, r in containers.items() if not gone.isdisjoint(r.claims)]
    if stale:
        kept = _mutable(containers)
        for cid in stale:
            del kept[cid]
        containers = MappingProxyType(kept)
    return replace(
        state,
        claims=MappingProxyType(claims),
        claimed=state.claimed - CpuSet.from_mask(freed),
        owners=MappingProxyType(owners),
        containers=containers,
        unlisted=state.unlisted - gone,
    )


def _unprepare(state: NodeState, command: UnprepareClaim) -> tuple[NodeState, list[Effect]]:
    uid = command.claim_uid
    existing = state.claims.get(uid)
    if existing is None:
        # Unknown: success; still remove a spec a failed earlier attempt may have left.
        return state, [DeleteCdiSpec(uid), Reply(ClaimUnprepared(uid, EMPTY))]
    new = _release(state, [uid])
    new, after = _unsolicited_widening(new)
    return new, [
        DeleteCdiSpec(uid),
        WriteCheckpoint(new.checkpoint()),
        Reply(ClaimUnprepared(uid, existing.cpus)),
        *after,
    ]


# --- containers -----------------------------------------------------------------------------------


def _verify(
    state: NodeState, container: Container, owners: Mapping[str, ClaimOwner]
) -> tuple[CpuSet, CpuSet | None]:
    """The CPUs and mems of a container with claims; raises when its env cannot be trusted."""
    what = container.describe()
    if container.env_error is not None:
        raise ClaimError(f"{what}: {container.env_error}")
    cpus = EMPTY
    mems: CpuSet | None = None
    me = ClaimOwner(container.pod_uid, container.name)
    for env in container.claims:
        claim = state.claims.get(env.claim_uid)
        if claim is None:
            raise ClaimError(
                f"{what}: its env names claim {env.claim_uid}, which this node has not prepared "
                "(stale or spoofed DRA_CPUSET env)"
            )
        if claim.cpus != env.cpus:
            raise ClaimError(
                f"{what}: its env says claim {env.claim_uid} has cpus {env.cpus}, but the claim "
                f"is prepared with cpus {claim.cpus} (spoofed DRA_CPUSET env)"
            )
        owner = owners.get(env.claim_uid)
        if owner is not None and owner != me:
            raise ClaimConflictError(
                f"{what}: claim {env.claim_uid} is already used by container "
                f"{owner.container_name} of pod {owner.pod_uid}; claims cannot be shared"
            )
        cpus |= claim.cpus
        if claim.mems is not None:
            mems = claim.mems if mems is None else mems | claim.mems
    return cpus, mems


def _shared_updates(
    containers: dict[str, ContainerRecord], shared: Iterable[str], pool: CpuSet, skip: str = ""
) -> list[ContainerUpdate]:
    """Move every shared container (but ``skip``) whose cpuset is not ``pool`` to it, updating
    the records in ``containers`` in place. Nothing when the pool is empty.

    The loop of a CreateContainer that moves hundreds of containers: unchanged records are kept
    (compared by mask, no ``CpuSet.__eq__`` call) and the new values are built by
    :func:`_moved_record` and :func:`_pool_update`, not by the dataclass constructors.
    """
    updates: list[ContainerUpdate] = []
    if not pool:
        return updates
    mask = pool.mask
    for cid in sorted(shared):
        record = containers[cid]
        if record.cpus.mask != mask and cid != skip:
            containers[cid] = _moved_record(record, pool)
            updates.append(_pool_update(cid, pool))
    return updates


# The frozen dataclass constructors set each field through object.__setattr__; setting the slots
# through their descriptors builds the same value in about half the time (bench_state:
# state.create_container, 200 shared containers moved). Only for these two classes, which have no
# __post_init__; tests/core/test_state.py checks their fields and that the values equal the
# constructors'.
_new = object.__new__
_SetSlot = Callable[[object, Any], None]


def _slot_setter(cls: type[ContainerRecord] | type[ContainerUpdate], name: str) -> _SetSlot:
    setter: _SetSlot = vars(cls)[name].__set__
    return setter


_set_record_container = _slot_setter(ContainerRecord, "container")
_set_record_claims = _slot_setter(ContainerRecord, "claims")
_set_record_cpus = _slot_setter(ContainerRecord, "cpus")
_set_record_mems = _slot_setter(ContainerRecord, "mems")
_set_update_id = _slot_setter(ContainerUpdate, "container_id")
_set_update_cpus = _slot_setter(ContainerUpdate, "cpus")
_set_update_mems = _slot_setter(ContainerUpdate, "mems")


def _moved_record(record: ContainerRecord, cpus: CpuSet) -> ContainerRecord:
    """``ContainerRecord(record.container, record.claims, cpus, record.mems)``, built faster."""
    moved: ContainerRecord = _new(ContainerRecord)
    _set_record_container(moved, record.container)
    _set_record_claims(moved, record.claims)
    _set_record_cpus(moved, cpus)
    _set_record_mems(moved, record.mems)
    return moved


def _pool_update(container_id: str, pool: CpuSet) -> ContainerUpdate:
    """``ContainerUpdate(container_id, pool)``, built faster."""
    update: ContainerUpdate = _new(ContainerUpdate)
    _set_update_id(update, container_id)
    _set_update_cpus(update, pool)
    _set_update_mems(update, None)
    return update


def _create_container(state: NodeState, container: Container) -> tuple[NodeState, list[Effect]]:
    if not container.id:
        raise ClaimError(f"{container.describe()}: no container id")
    containers = _mutable(state.containers)
    shared = set(state.shared)
    shared.discard(container.id)
    containers.pop(container.id, None)
    owners = state.owners
    pool = state.shared_pool
    if container.exclusive or container.env_error is not None:
        cpus, mems = _verify(state, container, state.owners)
        uids = tuple(env.claim_uid for env in container.claims)
        me = ClaimOwner(container.pod_uid, container.name)
        if any(owners.get(uid) != me for uid in uids):
            new_owners = _mutable(owners)
            new_owners.update((uid, me) for uid in uids)
            owners = MappingProxyType(new_owners)
        containers[container.id] = ContainerRecord(container, uids, cpus, mems)
    else:
        if not pool:
            raise InsufficientCpusError(
                f"{container.describe()}: the shared pool is empty (every allocatable CPU is "
                "held by a claim); refusing a container that would run unconfined"
            )
        cpus, mems = pool, None
        containers[container.id] = ContainerRecord(container, (), pool)
        shared.add(container.id)
    updates = _shared_updates(containers, shared, pool, skip=container.id)
    new = replace(
        state,
        containers=MappingProxyType(containers),
        shared=frozenset(shared),
        owners=owners,
    )
    return new, [Reply(ContainerPinned(container.id, cpus, mems, tuple(updates)))]


def _forget_container(
    state: NodeState, container_id: str, *, send_updates: bool
) -> tuple[NodeState, list[Effect]]:
    containers = _mutable(state.containers)
    containers.pop(container_id, None)
    shared = state.shared - {container_id}
    updates = _shared_updates(containers, shared, state.shared_pool) if send_updates else []
    new = replace(state, containers=MappingProxyType(containers), shared=shared)
    return new, [Reply(ContainerForgotten(container_id, tuple(updates)))]


def _synchronize(state: NodeState, command: Synchronize) -> tuple[NodeState, list[Effect]]:
    pool = state.shared_pool
    containers: dict[str, ContainerRecord] = {}
    shared: set[str] = set()
    owners = _mutable(state.owners)  # owners stay until Unprepare (upstream ClaimTracker.Cleanup)
    updates: list[ContainerUpdate] = []
    rejected: list[ContainerRejected] = []
    unpinned: list[str] = []
    for container in sorted(command.containers, key=lambda c: c.id):
        if not container.id or container.id in containers:
            rejected.append(ContainerRejected(container.id, "missing or duplicate container id"))
            continue
        if container.exclusive or container.env_error is not None:
            try:
                cpus, mems = _verify(state, container, owners)
            except DracpuError as error:
                rejected.append(ContainerRejected(container.id, str(error)))
            else:
                uids = tuple(env.claim_uid for env in container.claims)
                me = ClaimOwner(container.pod_uid, container.name)
                owners.update((uid, me) for uid in uids)
                containers[container.id] = ContainerRecord(container, uids, cpus, mems)
                updates.append(ContainerUpdate(container.id, cpus, mems))
                continue
        # Shared, or claims that cannot be verified: confined to the shared pool (fail closed).
        shared.add(container.id)
        containers[container.id] = ContainerRecord(container, (), pool)
        if pool:
            updates.append(ContainerUpdate(container.id, pool))
        else:
            unpinned.append(container.id)
    new = replace(
        state,
        containers=MappingProxyType(containers),
        shared=frozenset(shared),
        owners=MappingProxyType(owners),
        unsolicited_updates=command.unsolicited_updates,
    )
    return new, [Reply(Synchronized(tuple(updates), tuple(rejected), tuple(unpinned)))]


def _invalidate(state: NodeState, ids: Iterable[str]) -> tuple[NodeState, list[Effect]]:
    containers = _mutable(state.containers)
    for cid in ids:
        # Only shared containers get unsolicited updates; an exclusive one keeps its claims' CPUs.
        if cid in state.shared:
            containers[cid] = replace(containers[cid], cpus=EMPTY)
    return replace(state, containers=MappingProxyType(containers)), [Reply(None)]


def _unsolicited_widening(state: NodeState) -> tuple[NodeState, list[Effect]]:
    """Post-commit updates moving shared containers to the (wider) pool, when the runtime
    takes unsolicited updates; otherwise they catch up at the next container event."""
    if not state.unsolicited_updates or not state.shared:
        return state, []
    containers = _mutable(state.containers)
    updates = _shared_updates(containers, state.shared, state.shared_pool)
    if not updates:
        return state, []
    return replace(state, containers=MappingProxyType(containers)), [
        UpdateContainers(tuple(updates))
    ]


# --- reconciliation -------------------------------------------------------------------------------


def _pods_listed(state: NodeState, command: PodsListed) -> tuple[NodeState, list[Effect]]:
    in_use = command.claims_in_use
    unlisted = frozenset(uid for uid in state.claims if uid not in in_use)
    held = {uid for record in state.containers.values() for uid in record.claims}
    trusted = command.reports_claims and not (unlisted & held)
    if not trusted:
        # The listing contradicts a running container (or cannot show claims): release nothing
        # and forget earlier misses, so two trusted listings in a row are needed again.
        new = replace(state, unlisted=frozenset())
        return new, [Reply(PodsReconciled((), tuple(sorted(unlisted)), False))]
    release = sorted(unlisted & state.unlisted)
    if not release:
        new = replace(state, unlisted=unlisted)
        return new, [Reply(PodsReconciled((), tuple(sorted(unlisted)), True))]
    new = replace(_release(state, release), unlisted=unlisted - set(release))
    new, after = _unsolicited_widening(new)
    return new, [
        *(DeleteCdiSpec(uid) for uid in release),
        WriteCheckpoint(new.checkpoint()),
        Reply(PodsReconciled(tuple(release), tuple(sorted(unlisted)), True)),
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


def _adopt(state: NodeState, command: AdoptClaims) -> tuple[NodeState, list[Effect]]:
    claims = _mutable(state.claims)
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


def _resync(state: NodeState, command: Resync) -> tuple[NodeState, list[Effect]]:
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
    new, after = _unsolicited_widening(new)
    uids = sorted(new.claims)
    return new, [
        *(WriteCdiSpec(uid, new.claims[uid].cpus) for uid in uids),
        PruneCdiSpecs(frozenset(uids)),
        PublishSlices(new.config.topology),
        Reply(Resynced(len(uids), changed)),
        *after,
    ]


# --- restore --------------------------------------------------------------------------------------


def restore_state(
    config: NodeConfig, data: CheckpointData
) -> tuple[NodeState, tuple[tuple[str, str], ...]]:
    """The state after a restart: the checkpoint's claims that still fit the node, and the
    refused ones with the reason (a CPU now reserved or offline; the owner logs them)."""
    claims: dict[str, PreparedClaim] = {}
    claimed = EMPTY
    rejected: list[tuple[str, str]] = []
    for uid in sorted(data.claims):
        claim = data.claims[uid]
        if uid != claim.claim_uid or not claim.cpus or not is_valid_claim_uid(uid):
            rejected.append((uid, "malformed record"))
        elif not claim.cpus <= config.allocatable:
            outside = claim.cpus - config.allocatable
            rejected.append((uid, f"cpus {outside} are not allocatable (reserved or offline)"))
        elif not claim.cpus.isdisjoint(claimed):
            rejected.append((uid, f"cpus {claim.cpus & claimed} are held by another claim"))
        else:
            claims[uid] = claim
            claimed |= claim.cpus
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

    The owner keeps ``old`` and runs these, logging (not raising) their own failures.
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
                undo.append(DeleteCdiSpec(uid) if claim is None else WriteCdiSpec(uid, claim.cpus))
            case WriteCheckpoint():
                if "checkpoint" not in seen:
                    seen.add("checkpoint")
                    undo.append(WriteCheckpoint(old.checkpoint()))
            case PublishSlices():
                if "slices" not in seen:
                    seen.add("slices")
                    undo.append(PublishSlices(old.config.topology))
            case PruneCdiSpecs() | UpdateContainers() | Reply():
                pass  # prune removes orphans only; the others are never in the commit phase
            case _:
                assert_never(effect)
    undo.append(Reply(error))
    return undo


# --- invariants -----------------------------------------------------------------------------------


def check_invariants(state: NodeState) -> None:
    """Raise :class:`InvariantError` naming the first broken rule (recomputes everything)."""

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
    if not claimed <= config.allocatable:
        fail(f"claims hold non-allocatable cpus {claimed - config.allocatable}")
    if not claimed.isdisjoint(config.reserved):
        fail(f"claims hold reserved cpus {claimed & config.reserved}")
    pool = config.topology.online - config.reserved - config.topology.isolated - claimed
    if state.shared_pool != pool:
        fail(f"shared pool {state.shared_pool} != online - reserved - isolated - claimed {pool}")
    shared = frozenset(cid for cid, r in state.containers.items() if not r.claims)
    if shared != state.shared:
        fail(f"shared container ids {sorted(state.shared)} != containers without claims")
    for cid, record in state.containers.items():
        if cid != record.container.id:
            fail(f"container key {cid} holds container {record.container.id}")
    if not pool and any(state.containers[cid].cpus for cid in shared):
        fail("the shared pool is empty but shared containers were given CPUs")
    for uid in state.owners:
        if uid not in state.claims:
            fail(f"claim {uid} has an owner but is not prepared")
    if not state.unlisted <= state.claims.keys():
        fail(f"unlisted claims {sorted(state.unlisted - state.claims.keys())} are not prepared")
    for cid, record in state.containers.items():
        if not record.claims:
            continue
        missing = [uid for uid in record.claims if uid not in state.claims]
        if missing:
            fail(f"container {cid} uses claims {missing} that are not prepared")
        me = ClaimOwner(record.container.pod_uid, record.container.name)
        held = CpuSet.union(state.claims[uid].cpus for uid in record.claims)
        if record.cpus != held:
            fail(f"container {cid} is pinned to {record.cpus}, its claims hold {held}")
        for uid in record.claims:
            if state.owners.get(uid) != me:
                fail(f"container {cid} uses claim {uid} owned by {state.owners.get(uid)}")
        for sid in shared:
            overlap = state.containers[sid].cpus & held
            if overlap:
                fail(f"shared container {sid} runs on cpus {overlap} of running container {cid}")
