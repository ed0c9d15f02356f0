"""Effects: the I/O the state owner performs after a command was applied.

``apply(state, command) -> (state, effects)`` is pure; the state owner executes the effects in
order. :class:`Reply` is special: its value goes back to the requester's one-shot reply stream.

Every effect list holds exactly one :class:`Reply`. The effects before it are the **commit
phase**, already in crash-safe order (Prepare: ``WriteCdiSpec`` → ``WriteDeviceMetadata`` →
``WriteCheckpoint`` → ``Reply``; Unprepare: ``DeleteCdiSpec`` → ``DeleteDeviceMetadata`` →
``WriteCheckpoint`` → ``Reply``; ``ConfineHostCgroups`` before the ``Reply`` when host cgroups
are listed); the effects after it are
**post-commit** (e.g. ``UpdateContainers`` widening the shared pool after an Unprepare), whose
failure is logged and never undoes the command. How the owner runs them, and rolls back, is
described in :mod:`dracpu.core.state` (``commit_phase``, ``rollback``).

The result types (past tense) are the values a :class:`Reply` carries on success.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from dracpu.core.checkpoint_schema import CheckpointData, PreparedClaim
from dracpu.core.commands import DeviceResult
from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.devices import Device
from dracpu.core.node_config import NodeConfig

__all__ = [
    "ClaimPrepared",
    "ClaimUnprepared",
    "ClaimsAdopted",
    "ConfineHostCgroups",
    "ContainerForgotten",
    "ContainerPinned",
    "ContainerRejected",
    "ContainerUpdate",
    "DeleteCdiSpec",
    "DeleteDeviceMetadata",
    "Effect",
    "NodeChanged",
    "PodsReconciled",
    "PruneCdiSpecs",
    "PruneDeviceMetadata",
    "PublishSlices",
    "ReleasedClaim",
    "Reply",
    "Resynced",
    "StrandedClaim",
    "Synchronized",
    "UpdateContainers",
    "WriteCdiSpec",
    "WriteCheckpoint",
    "WriteDeviceMetadata",
]


# --- effects --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    """Answer the command's requester with ``value`` (a result object or a DracpuError)."""

    value: object


@dataclass(frozen=True, slots=True)
class WriteCdiSpec:
    """(Re)write ``<cdi-dir>/dra.k8s.io-cpu_claim-<uid>.json`` with ``DRA_CPUSET_<uid>=<cpus>``
    (and ``DRA_SHARED_POOL_<uid>=true`` when ``shared_pool``)."""

    claim_uid: str
    cpus: CpuSet
    shared_pool: bool = False


@dataclass(frozen=True, slots=True)
class DeleteCdiSpec:
    """Remove the claim's CDI spec; a missing file is success."""

    claim_uid: str


@dataclass(frozen=True, slots=True)
class PruneCdiSpecs:
    """Remove every CDI spec of ours whose claim UID is not in ``keep`` (orphans)."""

    keep: frozenset[str]


@dataclass(frozen=True, slots=True)
class WriteDeviceMetadata:
    """(Re)write the KEP-5304 device metadata of a prepared claim that has results: per
    request, its metadata file, then the CDI spec that mounts it
    (:func:`dracpu.core.device_metadata.claim_files` of ``claim`` under ``config``, built in
    the worker thread that writes them)."""

    claim: PreparedClaim
    config: NodeConfig


@dataclass(frozen=True, slots=True)
class DeleteDeviceMetadata:
    """Remove a claim's metadata CDI specs, then its metadata files; nothing there is success.
    ``requests``: the requests it has metadata for (a prepared claim's), ``None`` when they are
    not known (a claim not prepared here, or adopted): then its files are looked for."""

    claim_uid: str
    requests: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class PruneDeviceMetadata:
    """Remove the device metadata (CDI specs, files, leftovers of interrupted writes) of every
    claim whose UID is not in ``keep``."""

    keep: frozenset[str]


@dataclass(frozen=True, slots=True)
class WriteCheckpoint:
    """Encode (:func:`dracpu.core.checkpoint_schema.encode`) and write atomically."""

    checkpoint: CheckpointData


class ContainerUpdate(NamedTuple):
    """Set a container's ``cpuset.cpus`` (and ``cpuset.mems`` unless ``mems`` is ``None``); a
    named tuple, as :class:`~dracpu.core.state_values.ContainerRecord`, for the replies that
    move hundreds of containers.

    ``seq``: the number of the owner's decision that chose this pin
    (:attr:`dracpu.core.state.NodeState.pin_seq`): of two writes to a container, the one with
    the higher number is the newer decision."""

    container_id: str
    cpus: CpuSet
    mems: CpuSet | None = None
    seq: int = 0


@dataclass(frozen=True, slots=True)
class UpdateContainers:
    """Unsolicited NRI ``Runtime/UpdateContainers`` (only from outside an NRI event handler):
    the NRI task queues these containers and sends each its pin from the committed state. When
    the runtime fails them, it sends :class:`~dracpu.core.commands.InvalidateContainers`."""

    updates: tuple[ContainerUpdate, ...]


@dataclass(frozen=True, slots=True)
class ConfineHostCgroups:
    """Keep the host cgroups ``cgroups`` (paths under the cgroup root) at ``cpuset.cpus`` =
    ``cpus`` (the shared pool plus the reserved CPUs), and put back what it found in every
    cgroup it confined that is no longer listed (:mod:`dracpu.core.host_cgroups`,
    :mod:`dracpu.adapters.host_cgroups`). It never fails its command: a cgroup that cannot be
    confined is reported (``/readyz``, metrics) and tried again."""

    cgroups: tuple[str, ...]
    cpus: CpuSet


@dataclass(frozen=True, slots=True)
class PublishSlices:
    """Publish these devices (the node config's, in publication order); their health follows."""

    devices: tuple[Device, ...]


Effect = (
    Reply
    | WriteCdiSpec
    | DeleteCdiSpec
    | PruneCdiSpecs
    | WriteDeviceMetadata
    | DeleteDeviceMetadata
    | PruneDeviceMetadata
    | WriteCheckpoint
    | UpdateContainers
    | PublishSlices
    | ConfineHostCgroups
)


# --- results (the value of a successful Reply) ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClaimPrepared:
    """The claim holds ``cpus`` (empty: the claim had no result of ours); its containers' memory
    goes to NUMA nodes ``mems`` (``None``: not pinned). ``results`` are the claim's results."""

    claim_uid: str
    cpus: CpuSet
    mems: CpuSet | None
    results: tuple[DeviceResult, ...]


@dataclass(frozen=True, slots=True)
class ClaimUnprepared:
    """The claim's CPUs ``cpus`` are free again (empty when the claim was not prepared)."""

    claim_uid: str
    cpus: CpuSet


@dataclass(frozen=True, slots=True)
class ClaimsAdopted:
    """Claims taken over from CDI specs, and the ones refused with the reason."""

    adopted: tuple[str, ...]
    rejected: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class ContainerPinned:
    """Answer to CreateContainer/UpdateContainer: the container's own pin (``mems`` ``None``:
    leave mems alone) and the updates of *other* containers to send in the same response."""

    pin: ContainerUpdate
    updates: tuple[ContainerUpdate, ...]


@dataclass(frozen=True, slots=True)
class ContainerForgotten:
    """Answer to StopContainer/RemoveContainer: updates to send in the response (StopContainer
    only; RemoveContainer has no response payload and gets none)."""

    container_id: str
    updates: tuple[ContainerUpdate, ...]


@dataclass(frozen=True, slots=True)
class ContainerRejected:
    """A container of a Synchronize whose claims could not be verified: confined to the shared
    pool instead of its claimed CPUs. ``noted``: the reason is a copy of claims that have noted
    its pod as a copier (reported when they did: say it no louder than DEBUG)."""

    container_id: str
    reason: str
    noted: bool = False


@dataclass(frozen=True, slots=True)
class Synchronized:
    """Answer to Synchronize: one update per container to send in the response, every shared
    container's before any exclusive container's (the order the runtime applies them in).

    ``unpinned``: shared containers left alone because the shared pool is empty (NRI treats an
    empty cpuset as "no change", so they keep whatever they had)."""

    updates: tuple[ContainerUpdate, ...]
    rejected: tuple[ContainerRejected, ...]
    unpinned: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReleasedClaim:
    """A prepared claim released as an orphan by a pod-resources listing, as Unprepare would.

    ``adopted``: it was known only from its CDI spec; ``missing_since``: the ``at`` of the first
    listing of the run of listings that missed it (the listing itself: one was enough);
    ``by_pods``: the listings could not show claims, and it went because every pod it is
    reserved for was missing from them."""

    claim_uid: str
    cpus: CpuSet
    namespace: str
    name: str
    adopted: bool
    missing_since: float
    by_pods: bool = False


@dataclass(frozen=True, slots=True)
class PodsReconciled:
    """Answer to PodsListed: the claims released as orphans, the claims missing from this
    listing that are kept for now (their grace runs, or the runtime's containers are not
    known), and whether the listing can tell about every claim (it shows claims, or the
    kubelet's version says an answer without any means no pod holds one; ``False``: only claims
    whose pods are known by name were judged, the others' earlier misses are forgotten)."""

    released: tuple[ReleasedClaim, ...]
    waiting: tuple[str, ...]
    trusted: bool


@dataclass(frozen=True, slots=True)
class StrandedClaim:
    """A prepared claim holding CPUs that are offline now: kept whole (its CDI spec and its
    containers' cpuset unchanged), its devices reported unhealthy. ``name``: ``namespace/name``
    (empty for a claim adopted from a CDI spec and not prepared again since)."""

    claim_uid: str
    name: str
    offline: CpuSet

    def warning(self) -> str:
        """The warning the daemon logs for such a claim."""
        return (
            f"claim {self.name or 'name unknown'} ({self.claim_uid}) holds cpus {self.offline}, "
            "which are offline: it keeps them (its CDI spec and its containers' cpuset are "
            "unchanged) and its devices are reported unhealthy until the cpus are back online "
            "or the claim is unprepared"
        )


@dataclass(frozen=True, slots=True)
class NodeChanged:
    """What a SIGHUP's Resync changed in the node config; empty values: no change.

    ``went_online`` / ``went_offline``: CPUs; ``isolated`` / ``unisolated``: CPUs that joined or
    left the kernel's isolated set; ``reserved``: (before, after) when the reserved CPUs
    changed, ``reserved_refused`` why the reserved CPUs asked for were not applied;
    ``pin_memory``: the new default when it changed; ``host_cgroups``: the host cgroups
    confined from now on, when the list changed. ``added`` / ``removed``: device names;
    ``resized``: grouped devices whose ``dra.cpu/cpu`` capacity changed; ``updated``: devices
    whose attributes changed otherwise. ``republished``: the devices changed, so the slices go
    out again with the pool generation bumped. ``stranded``: every claim holding offline CPUs.
    """

    went_online: CpuSet = EMPTY
    went_offline: CpuSet = EMPTY
    isolated: CpuSet = EMPTY
    unisolated: CpuSet = EMPTY
    reserved: tuple[CpuSet, CpuSet] | None = None
    reserved_refused: str = ""
    pin_memory: bool | None = None
    host_cgroups: tuple[str, ...] | None = None
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    resized: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    republished: bool = False
    stranded: tuple[StrandedClaim, ...] = ()

    def parts(self) -> list[str]:
        """The changes in words, for the daemon's one log line."""
        parts: list[str] = []
        for cpus, what in (
            (self.went_offline, "went offline"),
            (self.went_online, "came online"),
            (self.isolated, "became isolated"),
            (self.unisolated, "are no longer isolated"),
        ):
            if cpus:
                parts.append(f"cpus {cpus} {what}")
        if self.reserved is not None:
            before, after = self.reserved
            parts.append(f"reserved cpus {before or 'none'} -> {after or 'none'}")
        if self.reserved_refused:
            parts.append(f"reserved cpus not changed: {self.reserved_refused}")
        if self.pin_memory is not None:
            parts.append(f"memory pinning of new claims {'on' if self.pin_memory else 'off'}")
        if self.host_cgroups is not None:
            listed = ", ".join(self.host_cgroups) or "none"
            parts.append(f"host cgroups confined to the shared pool: {listed}")
        for names, what in (
            (self.added, "added"),
            (self.removed, "removed"),
            (self.resized, "resized"),
            (self.updated, "with new attributes"),
        ):
            if names:
                parts.append(f"devices {what}: {_names(names)}")
        if self.republished:
            parts.append("slices republished (new pool generation)")
        if self.stranded:
            held = ", ".join(
                f"{claim.name or claim.claim_uid} (cpus {claim.offline})" for claim in self.stranded
            )
            parts.append(f"claims holding offline cpus: {held}")
        return parts


# Device names shown in a log line; a 1024-CPU node can add or remove hundreds at once.
_NAMES_SHOWN = 8


def _names(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


@dataclass(frozen=True, slots=True)
class Resynced:
    """Answer to Resync: how many prepared claims' files (CDI spec, device metadata) are put
    right after the answer (each written unless it holds its bytes already); what a
    SIGHUP changed (``None``: nothing was read again); the shared containers moved to the new
    pool at once (``repinned``, unsolicited updates) or waiting for their next event
    (``waiting``: the runtime does not take unsolicited updates)."""

    claims: int
    changed: NodeChanged | None = None
    repinned: int = 0
    waiting: int = 0

    def describe(self) -> str:
        """One line: everything that changed."""
        parts = [f"files of {self.claims} prepared claims checked"]
        changes = [] if self.changed is None else self.changed.parts()
        parts.extend(changes or ["node unchanged"])
        if self.repinned:
            parts.append(f"{self.repinned} shared containers re-pinned")
        if self.waiting:
            parts.append(f"{self.waiting} shared containers get the new pool at their next event")
        return "; ".join(parts)
