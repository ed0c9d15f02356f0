"""Fake machines as compact descriptions, and the topology model they describe (no files).

A :class:`MachineSpec` describes a machine as a hierarchy — sockets → dies → NUMA nodes → L3
caches → clusters → cores → threads — plus the quirks real kernels show (``core_id`` repeating per
socket, SMT siblings numbered ``+ncores`` apart, arm64 caches without ``id``, hybrid P/E cores,
offline and isolated CPUs, CPUs whose NUMA node is not online) and its PCIe root complexes.
:func:`build_topology` builds the :class:`~dracpu.core.topology.Topology` the machine must read
as; :func:`machine_layout` numbers its cores and CPUs, the single source both this model and the
sysfs writer (:mod:`dracpu.sim.sysfs_writer`) use.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.topology import NO_NUMA_NODE, CoreType, CpuInfo, Topology
from dracpu.errors import ConfigError

__all__ = [
    "E_CORES_PER_CLUSTER",
    "NO_CLUSTER_RAW",
    "SMT_AUTO",
    "CoreIdScheme",
    "CpuNumbering",
    "L3Mode",
    "MachineSpec",
    "PciRoot",
    "build_topology",
    "machine_layout",
    "numa_cpus",
    "pci_affinity",
    "smt_control_text",
]

CoreIdScheme = Literal["global", "per-socket", "per-die", "per-cluster"]
CpuNumbering = Literal["linux", "adjacent"]
L3Mode = Literal["id", "shared-cpu-list", "none"]

# Intel Gracemont E-cores come in modules of four sharing one L2 (one sysfs cluster).
E_CORES_PER_CLUSTER = 4
# What x86 kernels write in cluster_id when the CPU has no cluster (BAD_APICID & 0xffff).
NO_CLUSTER_RAW = 65535
# smt_control value meaning "on when some core has 2+ threads, else notsupported".
SMT_AUTO = "auto"


# A PCIe root complex entry of /sys/devices: "pci" + "%04x:%02x" (domain, bus), as the kernel
# names host bridges (drivers/pci/probe.c).
_PCI_ROOT_NAME = re.compile(r"pci[0-9a-f]{4}:[0-9a-f]{2}")


@dataclass(frozen=True, slots=True)
class PciRoot:
    """A PCIe root complex: its ``/sys/devices`` name and the NUMA node of its root bus
    (``None``: no NUMA affinity, so the kernel calls every online CPU local to it)."""

    name: str
    numa: int | None


@dataclass(frozen=True, slots=True)
class MachineSpec:
    """A machine, described compactly; every count is per parent level.

    Cores per L3 cache are ``clusters_per_l3 * cores_per_cluster``, each with
    ``threads_per_core`` threads; with ``hybrid=(p, e)`` each L3 instead has ``p`` P-cores (with
    ``threads_per_core`` threads, one cluster each) then ``e`` single-thread E-cores in clusters
    of :data:`E_CORES_PER_CLUSTER`, and ``cpu_core``/``cpu_atom`` PMU files are written.

    - ``core_id_scheme``: where ``core_id`` restarts from 0: ``per-socket`` (real x86 servers),
      ``per-die``, ``per-cluster`` (needs real clusters), or never (``global``). Cluster ids
      restart per socket (``per-socket``), per die (``per-die``, ``per-cluster``) or never.
      ``core_id`` = index * ``core_id_step``.
    - ``cpu_numbering``: ``linux`` numbers the first thread of every core, then the second
      threads, ... (x86: siblings ``+ncores`` apart); ``adjacent`` numbers a core's threads
      consecutively (POWER, Intel hybrid desktops).
    - ``l3``: ``id`` writes ``cache/index3/id``; ``shared-cpu-list`` omits it (arm64: the L3 is
      named by the lowest online CPU of its ``shared_cpu_list``); ``none`` writes no L3.
    - clusters: with ``clusters_per_l3 > 1`` (or hybrid) ``cluster_id`` holds real ids, else 65535.
    - ``die_id_file=False`` omits ``die_id`` (arm64); ``numa_sysfs=False`` omits
      ``devices/system/node`` and the ``cpuN/nodeX`` links (a kernel without CONFIG_NUMA).
    - ``offline`` CPUs are present but not online (no topology/cache directories);
      ``isolated`` is written verbatim to ``devices/system/cpu/isolated``.
    - ``no_numa_node`` CPUs belong to a NUMA node that is not online: no ``cpuN/nodeX`` link, in
      no node's ``cpulist`` (a node left with no CPU gets no ``nodeX`` directory).
    - ``pci_roots`` are written as ``devices/pciDDDD:BB`` with the ``cpulistaffinity`` of their
      root bus: the online CPUs of the root's NUMA node, or every online CPU.
    - ``smt_control``: the text of ``smt/control``; ``"auto"`` = ``on`` with SMT else
      ``notsupported``; ``None`` = no file.
    """

    sockets: int = 1
    dies_per_socket: int = 1
    numa_per_die: int = 1
    l3_per_numa: int = 1
    clusters_per_l3: int = 1
    cores_per_cluster: int = 1
    threads_per_core: int = 1
    hybrid: tuple[int, int] | None = None
    core_id_scheme: CoreIdScheme = "per-socket"
    core_id_step: int = 1
    cpu_numbering: CpuNumbering = "linux"
    l3: L3Mode = "id"
    die_id_file: bool = True
    numa_sysfs: bool = True
    offline: CpuSet = EMPTY
    isolated: CpuSet = EMPTY
    no_numa_node: CpuSet = EMPTY
    pci_roots: tuple[PciRoot, ...] = ()
    smt_control: str | None = SMT_AUTO
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        counts = {
            "sockets": self.sockets,
            "dies_per_socket": self.dies_per_socket,
            "numa_per_die": self.numa_per_die,
            "l3_per_numa": self.l3_per_numa,
            "clusters_per_l3": self.clusters_per_l3,
            "cores_per_cluster": self.cores_per_cluster,
            "threads_per_core": self.threads_per_core,
            "core_id_step": self.core_id_step,
        }
        for name, value in counts.items():
            if value < 1:
                raise ConfigError(f"machine spec: {name} must be at least 1, not {value}")
        if self.hybrid is not None:
            p_cores, e_cores = self.hybrid
            if p_cores < 0 or e_cores < 0 or p_cores + e_cores == 0:
                raise ConfigError(f"machine spec: bad hybrid core counts {self.hybrid}")
            if self.clusters_per_l3 != 1 or self.cores_per_cluster != 1:
                raise ConfigError(
                    "machine spec: hybrid replaces clusters_per_l3 and cores_per_cluster"
                )
        if (
            self.core_id_scheme == "per-cluster"
            and self.hybrid is None
            and (self.clusters_per_l3 == 1 and self.l3_per_numa * self.numa_per_die > 1)
        ):
            raise ConfigError("machine spec: per-cluster core ids need clusters_per_l3 > 1")
        if self.dies_per_socket > 1 and not self.die_id_file:
            raise ConfigError("machine spec: several dies per socket need die_id files")
        if self.numa_per_die * self.dies_per_socket * self.sockets > 1 and not self.numa_sysfs:
            raise ConfigError("machine spec: several NUMA nodes need devices/system/node")
        total = self.cpu_count
        if (self.offline | self.isolated | self.no_numa_node).mask >> total:
            raise ConfigError(
                f"machine spec: offline/isolated/no-NUMA-node CPUs beyond cpu{total - 1}"
            )
        if self.no_numa_node and not self.numa_sysfs:
            raise ConfigError("machine spec: CPUs without a NUMA node need devices/system/node")
        names = [root.name for root in self.pci_roots]
        if len(set(names)) != len(names) or not all(map(_PCI_ROOT_NAME.fullmatch, names)):
            raise ConfigError(f"machine spec: PCIe root names must be unique pciDDDD:BB: {names}")
        if len(self.offline) == total:
            raise ConfigError("machine spec: every CPU is offline")

    @property
    def cores_per_l3(self) -> int:
        if self.hybrid is not None:
            return self.hybrid[0] + self.hybrid[1]
        return self.clusters_per_l3 * self.cores_per_cluster

    @property
    def cpu_count(self) -> int:
        """Present CPUs (online + offline)."""
        per_l3 = (
            self.hybrid[0] * self.threads_per_core + self.hybrid[1]
            if self.hybrid is not None
            else self.cores_per_l3 * self.threads_per_core
        )
        return self.sockets * self.dies_per_socket * self.numa_per_die * self.l3_per_numa * per_l3

    @property
    def online(self) -> CpuSet:
        return CpuSet.range(0, self.cpu_count) - self.offline


# --- layout: the single source both the writer and the model builder use -------------------------


@dataclass(frozen=True, slots=True)
class _Core:
    socket: int
    die: int
    numa: int
    l3: int  # machine-wide index of the L3 cache
    cluster: int  # the raw cluster_id written to sysfs (65535: none)
    core_id: int
    core_type: CoreType
    threads: tuple[int, ...] = ()  # CPU ids, filled when numbering


@dataclass(frozen=True, slots=True)
class _Layout:
    spec: MachineSpec
    cores: tuple[_Core, ...]
    core_of: Mapping[int, _Core]  # every present CPU -> its core
    online: CpuSet

    def online_of(self, cpus: Iterable[int]) -> CpuSet:
        return CpuSet(cpus) & self.online

    def group(self, attr: str) -> dict[int, CpuSet]:
        masks: dict[int, int] = {}
        for core in self.cores:
            key: int = getattr(core, attr)
            for cpu in core.threads:
                masks[key] = masks.get(key, 0) | 1 << cpu
        return {k: CpuSet.from_mask(m) & self.online for k, m in masks.items()}


def machine_layout(spec: MachineSpec) -> _Layout:
    """The machine's cores with their ids, caches and NUMA nodes, and its CPUs numbered (the
    model and the sysfs writer both start from it)."""
    cores: list[tuple[_Core, int]] = []  # (core, thread count)
    numa = l3 = 0
    core_index = cluster_index = 0
    clustered = spec.hybrid is not None or spec.clusters_per_l3 > 1
    for socket in range(spec.sockets):
        if spec.core_id_scheme != "global":
            core_index = cluster_index = 0
        for die in range(spec.dies_per_socket):
            if spec.core_id_scheme in ("per-die", "per-cluster"):
                core_index = cluster_index = 0
            for _ in range(spec.numa_per_die):
                for _ in range(spec.l3_per_numa):
                    for kind, cluster_size, threads in _core_groups(spec):
                        for position in range(cluster_size):
                            if spec.core_id_scheme == "per-cluster" and (
                                position == 0 or kind is CoreType.P_CORE
                            ):
                                core_index = 0
                            cluster = cluster_index if clustered else NO_CLUSTER_RAW
                            core = _Core(
                                socket=socket,
                                die=die,
                                numa=numa,
                                l3=l3,
                                cluster=cluster,
                                core_id=core_index * spec.core_id_step,
                                core_type=kind,
                            )
                            cores.append((core, threads))
                            core_index += 1
                            if position == cluster_size - 1 or kind is CoreType.P_CORE:
                                cluster_index += 1
                    l3 += 1
                numa += 1

    threads_of: list[list[int]] = [[] for _ in cores]
    next_cpu = 0
    if spec.cpu_numbering == "linux":
        for thread in range(max(t for _, t in cores)):
            for index, (_, count) in enumerate(cores):
                if thread < count:
                    threads_of[index].append(next_cpu)
                    next_cpu += 1
    else:
        for index, (_, count) in enumerate(cores):
            threads_of[index].extend(range(next_cpu, next_cpu + count))
            next_cpu += count

    numbered = tuple(
        _Core(c.socket, c.die, c.numa, c.l3, c.cluster, c.core_id, c.core_type, tuple(t))
        for (c, _), t in zip(cores, threads_of, strict=True)
    )
    core_of = {cpu: core for core in numbered for cpu in core.threads}
    return _Layout(spec, numbered, core_of, spec.online)


def _core_groups(spec: MachineSpec) -> list[tuple[CoreType, int, int]]:
    """(core type, cores per cluster, threads per core) for each cluster of one L3 cache."""
    if spec.hybrid is None:
        return [(CoreType.STANDARD, spec.cores_per_cluster, spec.threads_per_core)] * (
            spec.clusters_per_l3
        )
    p_cores, e_cores = spec.hybrid
    groups: list[tuple[CoreType, int, int]] = []
    if p_cores:
        groups.append((CoreType.P_CORE, p_cores, spec.threads_per_core))
    for start in range(0, e_cores, E_CORES_PER_CLUSTER):
        groups.append((CoreType.E_CORE, min(E_CORES_PER_CLUSTER, e_cores - start), 1))
    return groups


def _l3_ids(layout: _Layout) -> dict[int, int]:
    """L3 cache index -> the L3 id the model holds (the written id, or arm64's lowest CPU)."""
    if layout.spec.l3 == "id":
        return {core.l3: core.l3 for core in layout.cores}
    return {index: cpus.min() for index, cpus in layout.group("l3").items() if cpus}


# --- the model -----------------------------------------------------------------------------------


def build_topology(spec: MachineSpec, *, pcie_roots: bool = False) -> Topology:
    """The topology a correct sysfs reader must find in ``write_sysfs(spec, ...)`` (with
    ``pcie_roots``: when it also reads the PCIe roots)."""
    layout = machine_layout(spec)
    l3_ids = _l3_ids(layout) if spec.l3 != "none" else {}
    cpus: dict[int, CpuInfo] = {}
    for cpu in layout.online:
        core = layout.core_of[cpu]
        cpus[cpu] = CpuInfo(
            cpu_id=cpu,
            socket_id=core.socket,
            die_id=core.die,
            cluster_id=-1 if core.cluster == NO_CLUSTER_RAW else core.cluster,
            core_id=core.core_id,
            numa_node=NO_NUMA_NODE if cpu in spec.no_numa_node else core.numa,
            l3_id=l3_ids.get(core.l3),
            core_type=core.core_type,
        )
    return Topology(
        cpus=cpus,
        smt_enabled=_smt_enabled(spec, layout),
        offline=spec.offline,
        isolated=spec.isolated,
        pcie_roots=pci_affinity(spec, layout) if pcie_roots else {},
        numa_in_sysfs=spec.numa_sysfs,
    )


def numa_cpus(spec: MachineSpec, layout: _Layout) -> dict[int, CpuSet]:
    """NUMA node -> the online CPUs the kernel lists under it (nodes left empty included)."""
    return {node: cpus - spec.no_numa_node for node, cpus in layout.group("numa").items()}


def pci_affinity(spec: MachineSpec, layout: _Layout) -> dict[str, CpuSet]:
    """Root complex name -> its cpulistaffinity: the online CPUs of its node, or all of them."""
    nodes = numa_cpus(spec, layout)
    return {
        root.name: layout.online if root.numa is None else nodes.get(root.numa, EMPTY)
        for root in spec.pci_roots
    }


def smt_control_text(spec: MachineSpec) -> str | None:
    """What ``devices/system/cpu/smt/control`` holds, ``None`` when the file is absent."""
    if spec.smt_control != SMT_AUTO:
        return spec.smt_control
    return "on" if spec.threads_per_core > 1 else "notsupported"


def _smt_enabled(spec: MachineSpec, layout: _Layout) -> bool:
    text = smt_control_text(spec)
    if text == "on":
        return True
    if text in ("off", "forceoff", "notsupported", "notimplemented"):
        return False
    return any(len(layout.online_of(core.threads)) > 1 for core in layout.cores)
