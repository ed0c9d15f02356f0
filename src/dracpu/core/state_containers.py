"""The node state's containers: what the runtime's NRI events do to it (a part of
:func:`dracpu.core.state.apply`).

Each command that pins containers is one decision with the next number, ``state.pin_seq + 1``,
stamped on every record it changes and every update it answers with: the NRI task uses the
numbers to keep the last write that reaches each container the owner's last decision, whatever
order the runtime applies an event reply and an unsolicited update in
(:mod:`dracpu.tasks.nri_link`).

Who may use a claim (rule 6 of :mod:`dracpu.core.state`, ``docs/pods.md``): a container whose
env names it with the claim's exact cpuset, in a pod the claim is reserved for
(``PreparedClaim.pod_uids``, the pods of its ``status.reservedFor``). Every container of those
pods may use it at once (an init container, a sidecar, the app: Kubernetes lets any container of
a pod name the pod's claims), each pinned to the claim's CPUs. A container of another pod is
refused (CreateContainer fails; Synchronize confines it to the shared pool): an env copied from
a prepared claim's CDI spec must not pin a stranger to the claim's CPUs. Before it refuses, the
NRI task reads the claim again (:func:`unreserved_claims` says which claims, then
:class:`~dracpu.core.commands.UpdateClaimPods`): a claim shared by several pods gains consumers
after its Prepare. A claim whose pods are not known (adopted from its CDI spec, prepared by an
earlier build, reserved for no pod) goes to the first pod one of whose containers shows its env
(``NodeState.owners``), and its containers alone use it until Unprepare.

A claim prepared with ``cpuConfig.sharedPool`` (``PreparedClaim.shared_pool``) pins its
containers to its CPUs plus the shared pool (``NodeState.mixed``): they follow the pool as the
shared containers do, in the same replies and unsolicited updates (:func:`_pool_updates`), and
the pool never holds a CPU of any claim, so no one else's claim is touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from types import MappingProxyType

from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.core.commands import Container, Synchronize
from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.effects import (
    ContainerForgotten,
    ContainerPinned,
    ContainerRejected,
    ContainerUpdate,
    Effect,
    Reply,
    Synchronized,
    UpdateContainers,
)
from dracpu.core.state_values import ContainerRecord, NodeState, mutable
from dracpu.errors import (
    ClaimConflictError,
    ClaimError,
    ClaimNotReservedError,
    DracpuError,
    InsufficientCpusError,
)

__all__ = [
    "claims_cpus",
    "container_started",
    "create_container",
    "forget_container",
    "invalidate",
    "reserved_for",
    "synchronize",
    "unreserved_claims",
    "unsolicited_widening",
]


def reserved_for(claim: PreparedClaim, pod_uid: str) -> bool:
    """Is ``claim`` not known to be reserved for other pods than ``pod_uid``? Yes when the
    claim's pods are not known (then the first pod to use it takes it: ``NodeState.owners``),
    else when the pod is one of them."""
    return not claim.pod_uids or pod_uid in claim.pod_uids


def unreserved_claims(state: NodeState, container: Container) -> tuple[PreparedClaim, ...]:
    """The prepared claims the container's env names, with the cpuset they hold, that are not
    reserved for its pod and have not noted it as a copier: the claims to read again before the
    container is refused."""
    found: list[PreparedClaim] = []
    for env in container.claims:
        claim = state.claims.get(env.claim_uid)
        if (
            claim is not None
            and claim.cpus == env.cpus
            and not reserved_for(claim, container.pod_uid)
            and container.pod_uid not in claim.copiers
        ):
            found.append(claim)
    return tuple(found)


def _claim_label(claim: PreparedClaim) -> str:
    if claim.name:
        return f"claim {claim.namespace}/{claim.name} ({claim.claim_uid})"
    return f"claim {claim.claim_uid}"


def _verify(
    state: NodeState, container: Container, owners: Mapping[str, str]
) -> tuple[CpuSet, CpuSet | None]:
    """The CPUs and mems of a container with claims; raises when its env cannot be trusted (a
    claim not reserved for its pod last, :class:`ClaimNotReservedError`, after every other
    reason)."""
    what = container.describe()
    if container.env_error is not None:
        raise ClaimError(f"{what}: {container.env_error}")
    cpus = EMPTY
    mems: CpuSet | None = None
    unreserved: list[PreparedClaim] = []
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
        if not reserved_for(claim, container.pod_uid):
            unreserved.append(claim)
            continue
        owner = owners.get(env.claim_uid)
        if not claim.pod_uids and owner is not None and owner != container.pod_uid:
            raise ClaimConflictError(
                f"{what}: {_claim_label(claim)} is used by pod {owner}: its pods are not known "
                "(adopted from its CDI spec, or prepared by an earlier build), so the first pod "
                "to use it keeps it until Unprepare"
            )
        cpus |= claim.cpus
        if claim.mems is not None:
            mems = claim.mems if mems is None else mems | claim.mems
    if unreserved:
        claim = unreserved[0]
        raise ClaimNotReservedError(
            f"{what}: {_claim_label(claim)} is not reserved for pod {container.pod_uid} "
            f"(its status.reservedFor names {len(claim.pod_uids)} other pod(s)); "
            "its DRA_CPUSET env was copied from another pod's claim",
            noted=all(container.pod_uid in c.copiers for c in unreserved),
        )
    return cpus, mems


def _taken(state: NodeState, uids: Iterable[str]) -> list[str]:
    """Of these claims (verified for a container), those whose pods are not known: the
    container's pod takes them (``NodeState.owners``)."""
    return [uid for uid in uids if not state.claims[uid].pod_uids]


def claims_cpus(state: NodeState, record: ContainerRecord) -> CpuSet:
    """The CPUs of the claims a container uses."""
    return CpuSet.union(state.claims[uid].cpus for uid in record.claims)


def _follows_pool(state: NodeState, uids: Iterable[str]) -> bool:
    """Do the containers of these (prepared) claims also run on the shared pool?"""
    return any(state.claims[uid].shared_pool for uid in uids)


def _mixed_updates(
    state: NodeState,
    containers: dict[str, ContainerRecord],
    mixed: Iterable[str],
    pool: CpuSet,
    seq: int,
    skip: str = "",
) -> list[ContainerUpdate]:
    """Pin every container of ``mixed`` (but ``skip``) whose cpuset is not its claims' CPUs plus
    ``pool`` to those, in decision ``seq``, updating the records in ``containers``; the updates
    to send (with the claims' ``mems``, the record's pin). An empty pool leaves them their
    claims' CPUs."""
    updates: list[ContainerUpdate] = []
    for cid in sorted(mixed):
        record = containers[cid]
        cpus = claims_cpus(state, record) | pool
        if record.cpus != cpus and cid != skip:
            containers[cid] = _moved_record(record, cpus, seq)
            updates.append(ContainerUpdate(cid, cpus, record.mems, seq))
    return updates


def _pool_updates(
    state: NodeState,
    containers: dict[str, ContainerRecord],
    shared: Iterable[str],
    mixed: Iterable[str],
    seq: int,
    skip: str = "",
) -> list[ContainerUpdate]:
    """Every container that follows the shared pool moved to ``state``'s pool: the shared
    containers (:func:`_shared_updates`), then those of shared-pool claims."""
    pool = state.shared_pool
    updates = _shared_updates(containers, shared, pool, seq, skip)
    updates.extend(_mixed_updates(state, containers, mixed, pool, seq, skip))
    return updates


def _shared_updates(
    containers: dict[str, ContainerRecord],
    shared: Iterable[str],
    pool: CpuSet,
    seq: int,
    skip: str = "",
) -> list[ContainerUpdate]:
    """Move every shared container (but ``skip``) whose cpuset is not ``pool`` to it, in
    decision ``seq``, updating the records in ``containers`` in place; the updates to send.
    Nothing when the pool is empty.

    The loop of a CreateContainer that moves hundreds of containers: records already at the
    pool are kept (compared by mask, no ``CpuSet.__eq__`` call).
    """
    updates: list[ContainerUpdate] = []
    if not pool:
        return updates
    mask = pool.mask
    for cid in sorted(shared):
        record = containers[cid]
        if record.cpus.mask != mask and cid != skip:
            containers[cid] = _moved_record(record, pool, seq)
            updates.append(_pool_update(cid, pool, seq))
    return updates


def _moved_record(record: ContainerRecord, cpus: CpuSet, seq: int) -> ContainerRecord:
    """``record`` pinned to ``cpus`` by decision ``seq``."""
    return ContainerRecord(record.container, record.claims, cpus, record.mems, seq, record.adjusted)


def _pool_update(container_id: str, pool: CpuSet, seq: int) -> ContainerUpdate:
    """A shared container's update to ``pool`` by decision ``seq``."""
    return ContainerUpdate(container_id, pool, None, seq)


def create_container(
    state: NodeState, container: Container, *, created: bool
) -> tuple[NodeState, list[Effect]]:
    """CreateContainer (``created``) / UpdateContainer: pin the container (its claims' CPUs, or
    the shared pool) and, in the same reply, move the other shared containers to the pool.

    A created container's record notes the decision it was created with (``adjusted``, for
    :func:`container_started`); an updated one keeps what its record noted."""
    if not container.id:
        raise ClaimError(f"{container.describe()}: no container id")
    seq = state.pin_seq + 1
    containers = mutable(state.containers)
    shared = set(state.shared)
    shared.discard(container.id)
    mixed = state.mixed - {container.id}
    previous = containers.pop(container.id, None)
    adjusted = seq if created else (previous.adjusted if previous is not None else 0)
    owners = state.owners
    pool = state.shared_pool
    if container.exclusive or container.env_error is not None:
        cpus, mems = _verify(state, container, state.owners)
        uids = tuple(env.claim_uid for env in container.claims)
        taken = _taken(state, uids)
        if any(owners.get(uid) != container.pod_uid for uid in taken):
            new_owners = mutable(owners)
            new_owners.update((uid, container.pod_uid) for uid in taken)
            owners = MappingProxyType(new_owners)
        if _follows_pool(state, uids):
            cpus |= pool
            mixed |= {container.id}
        containers[container.id] = ContainerRecord(container, uids, cpus, mems, seq, adjusted)
    else:
        if not pool:
            raise InsufficientCpusError(
                f"{container.describe()}: the shared pool is empty (every allocatable CPU is "
                "held by a claim); refusing a container that would run unconfined"
            )
        cpus, mems = pool, None
        containers[container.id] = ContainerRecord(container, (), pool, None, seq, adjusted)
        shared.add(container.id)
    updates = _pool_updates(state, containers, shared, mixed, seq, skip=container.id)
    new = replace(
        state,
        containers=MappingProxyType(containers),
        shared=frozenset(shared),
        mixed=mixed,
        owners=owners,
        pin_seq=seq,
    )
    pin = ContainerUpdate(container.id, cpus, mems, seq)
    return new, [Reply(ContainerPinned(pin, tuple(updates)))]


def container_started(state: NodeState, container_id: str) -> tuple[NodeState, list[Effect]]:
    """PostStartContainer: send the container its pin again if a decision after the one it was
    created with (or a ``Synchronize``, which does not know that one) may have been lost.

    containerd applies an update of a container that is not RUNNING to its spec only ("new
    resource limit will be applied when container start", ``internal/cri/server/
    container_update_resources.go``), but ``StartContainer`` has already created the task (runc
    read the spec and made the cgroup) before it marks the container RUNNING: an update in
    between reaches neither. CRI-O ignores an update of a container it has not finished
    creating (``server/nri-api.go``). Once the runtime reports the start, an update reaches the
    cgroup. On a runtime that takes unsolicited updates the pin goes at once; otherwise a
    container that follows the shared pool gets an unknown cpuset, which the next reply that
    can carry updates sends (as a failed update's, :func:`invalidate`); a container on its
    claims' CPUs alone was created with those very CPUs, which no later decision changes.
    Nothing changes, and nothing is sent, when no decision came after its creation.
    """
    record = state.containers.get(container_id)
    if record is None or record.seq == record.adjusted or not record.cpus:
        return state, [Reply(None)]
    if state.unsolicited_updates:
        return state, [Reply(None), UpdateContainers((record.pin(),))]
    return invalidate(state, ((container_id, record.seq),))


def forget_container(
    state: NodeState, container_id: str, *, send_updates: bool
) -> tuple[NodeState, list[Effect]]:
    """StopContainer (``send_updates``: its reply may widen the shared containers) or
    RemoveContainer: forget the container; its claims stay prepared until Unprepare."""
    containers = mutable(state.containers)
    containers.pop(container_id, None)
    shared = state.shared - {container_id}
    mixed = state.mixed - {container_id}
    seq = state.pin_seq + 1
    updates = _pool_updates(state, containers, shared, mixed, seq) if send_updates else []
    new = replace(
        state,
        containers=MappingProxyType(containers),
        shared=shared,
        mixed=mixed,
        pin_seq=seq if updates else state.pin_seq,
    )
    return new, [Reply(ContainerForgotten(container_id, tuple(updates)))]


def synchronize(state: NodeState, command: Synchronize) -> tuple[NodeState, list[Effect]]:
    """Synchronize: the runtime's containers replace what we knew, each pinned anew.

    The reply moves every shared container before it narrows any exclusive one (the runtime
    applies a reply's updates in order, containerd ``internal/nri`` ``syncPlugin``): after a
    restart, a shared container the runtime put on a claim's CPUs while we were down leaves
    them before the claim's own container is confined to them.
    """
    seq = state.pin_seq + 1
    pool = state.shared_pool
    containers: dict[str, ContainerRecord] = {}
    shared: set[str] = set()
    mixed: set[str] = set()
    owners = mutable(state.owners)  # owners stay until Unprepare (upstream ClaimTracker.Cleanup)
    moved: list[ContainerUpdate] = []
    narrowed: list[ContainerUpdate] = []
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
                noted = isinstance(error, ClaimNotReservedError) and error.noted
                rejected.append(ContainerRejected(container.id, str(error), noted))
            else:
                uids = tuple(env.claim_uid for env in container.claims)
                owners.update((uid, container.pod_uid) for uid in _taken(state, uids))
                if _follows_pool(state, uids):
                    cpus |= pool
                    mixed.add(container.id)
                containers[container.id] = ContainerRecord(container, uids, cpus, mems, seq)
                narrowed.append(ContainerUpdate(container.id, cpus, mems, seq))
                continue
        # Shared, or claims that cannot be verified: confined to the shared pool (fail closed).
        shared.add(container.id)
        containers[container.id] = ContainerRecord(container, (), pool, None, seq)
        if pool:
            moved.append(ContainerUpdate(container.id, pool, None, seq))
        else:
            unpinned.append(container.id)
    new = replace(
        state,
        containers=MappingProxyType(containers),
        shared=frozenset(shared),
        mixed=frozenset(mixed),
        owners=MappingProxyType(owners),
        unsolicited_updates=command.unsolicited_updates,
        containers_known=True,
        pin_seq=seq,
    )
    updates = (*moved, *narrowed)
    return new, [Reply(Synchronized(updates, tuple(rejected), tuple(unpinned)))]


def invalidate(
    state: NodeState, failed: Iterable[tuple[str, int]]
) -> tuple[NodeState, list[Effect]]:
    """The runtime failed these pins: a container that follows the shared pool (a shared one,
    or one of a shared-pool claim) whose record still holds the failed decision gets an unknown
    cpuset, which the next reply that can carry updates sends again. (A container decided anew
    meanwhile keeps that newer pin: it goes its own way; a container on its claims' CPUs alone
    never gets unsolicited updates.)"""
    containers = mutable(state.containers)
    changed = False
    for cid, seq in failed:
        record = containers.get(cid)
        follows = cid in state.shared or cid in state.mixed
        if record is not None and follows and record.seq == seq:
            containers[cid] = record._replace(cpus=EMPTY)
            changed = True
    if not changed:
        return state, [Reply(None)]
    return replace(state, containers=MappingProxyType(containers)), [Reply(None)]


def unsolicited_widening(state: NodeState) -> tuple[NodeState, list[Effect]]:
    """Post-commit updates moving the containers that follow the shared pool to the (wider)
    pool, when the runtime takes unsolicited updates; otherwise they catch up at the next
    container event."""
    if not state.unsolicited_updates or not (state.shared or state.mixed):
        return state, []
    containers = mutable(state.containers)
    seq = state.pin_seq + 1
    updates = _pool_updates(state, containers, state.shared, state.mixed, seq)
    if not updates:
        return state, []
    new = replace(state, containers=MappingProxyType(containers), pin_seq=seq)
    return new, [UpdateContainers(tuple(updates))]
