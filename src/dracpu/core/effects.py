"""Effects: the I/O the state owner performs after a command was applied.

``apply(state, command) -> (state, effects)`` is pure; the state owner executes the effects in
order. :class:`Reply` is special: its value goes back to the requester's one-shot reply stream.

Every effect list holds exactly one :class:`Reply`. The effects before it are the **commit
phase**, already in crash-safe order (Prepare: ``WriteCdiSpec`` → ``WriteCheckpoint`` → ``Reply``;
Unprepare: ``DeleteCdiSpec`` → ``WriteCheckpoint`` → ``Reply``); the effects after it are
**post-commit** (e.g. ``UpdateContainers`` widening the shared pool after an Unprepare), whose
failure is logged and never undoes the command. How the owner runs them, and rolls back, is
described in :mod:`dracpu.core.state` (``commit_phase``, ``rollback``).

The result types (past tense) are the values a :class:`Reply` carries on success.
"""

from __future__ import annotations

from dataclasses import dataclass

from dracpu.core.checkpoint_schema import CheckpointData
from dracpu.core.commands import DeviceResult
from dracpu.core.cpuset import CpuSet
from dracpu.core.topology import Topology

__all__ = [
    "ClaimPrepared",
    "ClaimUnprepared",
    "ClaimsAdopted",
    "ContainerForgotten",
    "ContainerPinned",
    "ContainerRejected",
    "ContainerUpdate",
    "DeleteCdiSpec",
    "Effect",
    "PodsReconciled",
    "PruneCdiSpecs",
    "PublishSlices",
    "ReleasedClaim",
    "Reply",
    "Resynced",
    "Synchronized",
    "UpdateContainers",
    "WriteCdiSpec",
    "WriteCheckpoint",
]


# --- effects --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    """Answer the command's requester with ``value`` (a result object or a DracpuError)."""

    value: object


@dataclass(frozen=True, slots=True)
class WriteCdiSpec:
    """(Re)write ``<cdi-dir>/dra.k8s.io-cpu_claim-<uid>.json`` with ``DRA_CPUSET_<uid>=<cpus>``."""

    claim_uid: str
    cpus: CpuSet


@dataclass(frozen=True, slots=True)
class DeleteCdiSpec:
    """Remove the claim's CDI spec; a missing file is success."""

    claim_uid: str


@dataclass(frozen=True, slots=True)
class PruneCdiSpecs:
    """Remove every CDI spec of ours whose claim UID is not in ``keep`` (orphans)."""

    keep: frozenset[str]


@dataclass(frozen=True, slots=True)
class WriteCheckpoint:
    """Encode (:func:`dracpu.core.checkpoint_schema.encode`) and write atomically."""

    checkpoint: CheckpointData


@dataclass(frozen=True, slots=True)
class ContainerUpdate:
    """Set a container's ``cpuset.cpus`` (and ``cpuset.mems`` unless ``mems`` is ``None``).

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
class PublishSlices:
    """Publish the devices of this topology (the config's reserved CPUs left out)."""

    topology: Topology


Effect = (
    Reply
    | WriteCdiSpec
    | DeleteCdiSpec
    | PruneCdiSpecs
    | WriteCheckpoint
    | UpdateContainers
    | PublishSlices
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
    pool instead of its claimed CPUs."""

    container_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Synchronized:
    """Answer to Synchronize: one update per container to send in the response.

    ``unpinned``: shared containers left alone because the shared pool is empty (NRI treats an
    empty cpuset as "no change", so they keep whatever they had)."""

    updates: tuple[ContainerUpdate, ...]
    rejected: tuple[ContainerRejected, ...]
    unpinned: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReleasedClaim:
    """A prepared claim released as an orphan by a pod-resources listing, as Unprepare would.

    ``adopted``: it was known only from its CDI spec (one listing was enough); ``missing_since``:
    the ``at`` of the first listing of the run of listings that missed it."""

    claim_uid: str
    cpus: CpuSet
    namespace: str
    name: str
    adopted: bool
    missing_since: float


@dataclass(frozen=True, slots=True)
class PodsReconciled:
    """Answer to PodsListed: the claims released as orphans, the claims missing from this
    listing that are kept for now (their grace runs, or the runtime's containers are not
    known), and whether the listing could show claims at all (``False``: nothing released,
    earlier misses forgotten)."""

    released: tuple[ReleasedClaim, ...]
    waiting: tuple[str, ...]
    trusted: bool


@dataclass(frozen=True, slots=True)
class Resynced:
    """Answer to Resync: how many CDI specs were rewritten; whether the config changed."""

    claims: int
    config_changed: bool
