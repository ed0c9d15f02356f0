"""The values of the node state: :class:`NodeState` and what it holds.

Frozen and slotted; :func:`dracpu.core.state.apply` builds new ones, never changes one. The
mappings are read-only views (``MappingProxyType``) of dicts no one else holds; a transition
copies one with :func:`mutable`, changes the copy and wraps it again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple, TypeVar

from dracpu.core.checkpoint_schema import CheckpointData, PreparedClaim
from dracpu.core.commands import Container
from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.effects import ContainerUpdate
from dracpu.core.node_config import NodeConfig

__all__ = ["ContainerRecord", "NodeState", "mutable"]

K = TypeVar("K")
V = TypeVar("V")


def mutable(mapping: Mapping[K, V]) -> dict[K, V]:
    """A new dict with the items of ``mapping`` (one of the state's read-only mappings).

    ``dict(proxy)`` reads a ``MappingProxyType`` item by item through the mapping protocol;
    ``proxy.copy()`` copies the dict behind it in one call.
    """
    if isinstance(mapping, (MappingProxyType, dict)):
        copied = mapping.copy()
        if type(copied) is dict:
            return copied
    return dict(mapping)


def _no_claims() -> Mapping[str, PreparedClaim]:
    return MappingProxyType({})


def _no_containers() -> Mapping[str, ContainerRecord]:
    return MappingProxyType({})


def _no_owners() -> Mapping[str, str]:
    return MappingProxyType({})


def _no_misses() -> Mapping[str, float]:
    return MappingProxyType({})


class ContainerRecord(NamedTuple):
    """A container the runtime told us about, and its pin (a named tuple: a CreateContainer
    builds hundreds of them, and a tuple is built several times faster than a frozen
    dataclass, whose constructor sets each field through ``object.__setattr__``).

    ``claims``: the claims it verifiably uses (empty: a shared container). ``cpus``/``mems``:
    the pin the owner last decided for it, which the NRI task sends to the runtime (in an event
    reply or an unsolicited update); ``cpus`` empty: unknown (never set, or the runtime failed
    the update that carried it), so the next reply that can carry updates sets it. ``seq``: the
    number of that decision (:attr:`NodeState.pin_seq`). ``adjusted``: the decision its
    ``CreateContainer`` reply created it with (0: not known, a container listed by
    ``Synchronize``); when ``seq`` differs at its ``PostStartContainer``, a later pin may have
    reached the runtime while the container was starting, which loses it
    (:func:`dracpu.core.state_containers.container_started`).
    """

    container: Container
    claims: tuple[str, ...]
    cpus: CpuSet
    mems: CpuSet | None = None
    seq: int = 0
    adjusted: int = 0

    def pin(self) -> ContainerUpdate:
        """The container's pin as an update to send."""
        return ContainerUpdate(self.container.id, self.cpus, self.mems, self.seq)


@dataclass(frozen=True, slots=True)
class NodeState:
    """Everything the state owner knows. Treat as immutable: ``apply`` builds a new one.

    ``claimed`` is the union of the claims' CPUs; ``shared`` the ids of the shared containers;
    ``mixed`` the ids of the containers with a claim that also runs them on the shared pool
    (``PreparedClaim.shared_pool``: pinned to their claims' CPUs plus the pool, which they
    follow as the shared containers do);
    ``owners`` the pod (UID) that took each claim whose pods are not known (the first pod whose
    container showed its env; it keeps the claim until Unprepare); ``unlisted`` the claims
    missing from every pod-resources listing since the one taken at the time given (monotonic
    seconds of the sync task's clock);
    ``containers_known`` whether :attr:`containers` is the runtime's word (an NRI
    ``Synchronize`` since the start, and the runtime not gone since); ``unsolicited_updates``
    whether the runtime takes plugin-initiated updates;
    ``pin_seq`` the number of the last decision that pinned containers (it only grows: the NRI
    task orders the writes that reach the runtime by it).
    """

    config: NodeConfig
    claims: Mapping[str, PreparedClaim] = field(default_factory=_no_claims)
    claimed: CpuSet = EMPTY
    containers: Mapping[str, ContainerRecord] = field(default_factory=_no_containers)
    shared: frozenset[str] = frozenset()
    mixed: frozenset[str] = frozenset()
    owners: Mapping[str, str] = field(default_factory=_no_owners)
    unlisted: Mapping[str, float] = field(default_factory=_no_misses)
    containers_known: bool = False
    unsolicited_updates: bool = False
    pin_seq: int = 0

    @classmethod
    def initial(cls, config: NodeConfig) -> NodeState:
        """No claims, no containers."""
        return cls(config=config)

    @property
    def shared_pool(self) -> CpuSet:
        """The CPUs of every container without a claim: allocatable - claimed - isolated."""
        return self.config.shareable - self.claimed

    @property
    def host_pool(self) -> CpuSet:
        """The CPUs the confined host cgroups get (:mod:`dracpu.core.host_cgroups`): the shared
        pool plus the reserved CPUs that are online (a v1 cpuset refuses an offline CPU)."""
        config = self.config
        return self.shared_pool | (config.reserved & config.topology.online)

    def checkpoint(self) -> CheckpointData:
        """What to persist (the claims; shares the read-only mapping, copies nothing)."""
        return CheckpointData(self.claims)
