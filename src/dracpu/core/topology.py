"""The pure model of a node's CPUs: sockets, dies, clusters, cores, threads, NUMA nodes, L3 caches,
and the PCIe root complexes local to them.

Reading sysfs is the job of :mod:`dracpu.adapters.sysfs`; this module only holds the facts and
the indexes derived from them, so that the allocator and the slice builder never look at files.

Core identity: sysfs ``core_id`` repeats on every socket of a multi-socket server (and on every
die or cluster of some chips), so a core is identified by ``(socket, die, cluster, core_id)``
(:attr:`CpuInfo.core_key`). The SMT siblings of a CPU are the online CPUs with the same core key;
the sysfs reader cross-checks them against ``thread_siblings_list``. Any SMT width works.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.errors import TopologyError

__all__ = ["NO_NUMA_NODE", "CoreKey", "CoreType", "CpuInfo", "Topology"]

CoreKey = tuple[int, int, int, int]
"""(socket, die, cluster, core_id): unique across the machine."""

K = TypeVar("K")

# CpuInfo.numa_node of a CPU the kernel links to no NUMA node (no cpuN/nodeX entry, listed in no
# node's cpulist: its node is not online). The kernel's own "no node" is NUMA_NO_NODE, -1 too.
NO_NUMA_NODE = -1


class CoreType(StrEnum):
    """Published as ``dra.cpu/coreType`` (upstream values)."""

    STANDARD = "standard"
    P_CORE = "p-core"
    E_CORE = "e-core"


@dataclass(frozen=True, slots=True)
class CpuInfo:
    """What we know about one online logical CPU."""

    cpu_id: int
    socket_id: int  # topology/physical_package_id
    die_id: int  # topology/die_id, 0 when absent
    cluster_id: int  # topology/cluster_id, -1 when absent or 65535 (no cluster)
    core_id: int  # topology/core_id, raw: repeats across sockets
    numa_node: int  # the nodeX entry under cpuN/; NO_NUMA_NODE when there is none
    # cache indexK (level 3) id; the lowest CPU of its shared_cpu_list when there is no id
    # file (arm64); None: no L3 cache
    l3_id: int | None
    core_type: CoreType = CoreType.STANDARD

    @property
    def core_key(self) -> CoreKey:
        return (self.socket_id, self.die_id, self.cluster_id, self.core_id)


@dataclass(frozen=True, slots=True)
class Topology:
    """All online CPUs of a node plus the node-wide facts; indexes are derived once, on creation.

    ``offline`` are CPUs the kernel knows (``present``) but that are not online; ``isolated`` are
    the kernel's ``isolcpus`` (a subset of the online CPUs we keep; isolated CPUs that are offline
    are dropped). ``smt_enabled`` is the node-wide SMT state published as ``dra.cpu/smtEnabled``.
    ``pcie_roots``: PCIe root complexes by name (``pci0000:00``) and the online CPUs local to
    each (empty when not read, see ``--expose-pcie-roots``). ``numa_in_sysfs`` is ``False`` when
    the kernel has no NUMA support (no ``devices/system/node``) and every CPU was put on node 0.
    """

    cpus: Mapping[int, CpuInfo]
    smt_enabled: bool
    offline: CpuSet = EMPTY
    isolated: CpuSet = EMPTY
    pcie_roots: Mapping[str, CpuSet] = field(default_factory=dict)
    numa_in_sysfs: bool = True

    online: CpuSet = field(init=False)
    sockets: Mapping[int, CpuSet] = field(init=False)
    numa_nodes: Mapping[int, CpuSet] = field(init=False)
    l3_caches: Mapping[int, CpuSet] = field(init=False)
    cores: Mapping[CoreKey, CpuSet] = field(init=False)
    _core_of: Mapping[int, CpuSet] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        cpus = dict(sorted(self.cpus.items()))
        for cpu_id, info in cpus.items():
            if cpu_id != info.cpu_id:
                raise TopologyError(f"CPU table key {cpu_id} holds cpu{info.cpu_id}")
        online = CpuSet(cpus)
        sockets = _group(cpus.values(), lambda c: c.socket_id)
        numa = _group(cpus.values(), lambda c: c.numa_node)
        l3 = _group((c for c in cpus.values() if c.l3_id is not None), lambda c: c.l3_id or 0)
        cores = _group(cpus.values(), lambda c: c.core_key)
        core_of = {cpu: members for members in cores.values() for cpu in members}
        setattr_ = object.__setattr__
        setattr_(self, "cpus", cpus)
        setattr_(self, "online", online)
        setattr_(self, "isolated", self.isolated & online)
        setattr_(self, "offline", self.offline - online)
        setattr_(self, "pcie_roots", {k: v & online for k, v in sorted(self.pcie_roots.items())})
        setattr_(self, "sockets", sockets)
        setattr_(self, "numa_nodes", numa)
        setattr_(self, "l3_caches", l3)
        setattr_(self, "cores", cores)
        setattr_(self, "_core_of", core_of)

    # --- lookups ------------------------------------------------------------------------------

    def info(self, cpu: int) -> CpuInfo:
        try:
            return self.cpus[cpu]
        except KeyError:
            raise TopologyError(f"cpu{cpu} is not an online CPU of this node") from None

    def siblings(self, cpu: int) -> CpuSet:
        """The SMT siblings of ``cpu`` including itself (its core)."""
        try:
            return self._core_of[cpu]
        except KeyError:
            raise TopologyError(f"cpu{cpu} is not an online CPU of this node") from None

    @property
    def without_numa_node(self) -> CpuSet:
        """The online CPUs the kernel links to no NUMA node."""
        return self.numa_nodes.get(NO_NUMA_NODE, EMPTY)

    @property
    def smt_width(self) -> int:
        """Threads of the widest core (1 without SMT, 2, 4, ...)."""
        return max((len(c) for c in self.cores.values()), default=1)

    def cores_of(self, cpus: CpuSet) -> list[CpuSet]:
        """The cores that have at least one CPU in ``cpus``, by lowest CPU id."""
        seen: dict[int, CpuSet] = {}
        for cpu in cpus:
            core = self._core_of.get(cpu)
            if core is not None:
                seen.setdefault(core.min(), core)
        return [seen[k] for k in sorted(seen)]

    def numa_nodes_of(self, cpus: CpuSet) -> list[int]:
        return sorted({self.cpus[c].numa_node for c in cpus if c in self.cpus})

    def sockets_of(self, cpus: CpuSet) -> list[int]:
        return sorted({self.cpus[c].socket_id for c in cpus if c in self.cpus})

    def l3_caches_of(self, cpus: CpuSet) -> list[int]:
        return sorted(
            {l3 for c in cpus if c in self.cpus and (l3 := self.cpus[c].l3_id) is not None}
        )

    def by_core_type(self, core_type: CoreType) -> CpuSet:
        return CpuSet(c.cpu_id for c in self.cpus.values() if c.core_type is core_type)


def _group(infos: Iterable[CpuInfo], key: Callable[[CpuInfo], K]) -> dict[K, CpuSet]:
    masks: dict[K, int] = {}
    for info in infos:
        k = key(info)
        masks[k] = masks.get(k, 0) | (1 << info.cpu_id)
    return {k: CpuSet.from_mask(masks[k]) for k in sorted(masks)}  # type: ignore[type-var]
