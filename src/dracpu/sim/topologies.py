"""Fake machines: compact descriptions, a writer of fake sysfs trees, and the model they describe.

A :class:`MachineSpec` describes a machine as a hierarchy — sockets → dies → NUMA nodes → L3
caches → clusters → cores → threads — plus the quirks real kernels show (``core_id`` repeating per
socket, SMT siblings numbered ``+ncores`` apart, arm64 caches without ``id``, hybrid P/E cores,
offline and isolated CPUs, CPUs whose NUMA node is not online) and its PCIe root complexes.
:func:`write_sysfs` writes the files the kernel would show under ``<root>/sys``;
:func:`build_topology` builds the :class:`~dracpu.core.topology.Topology` the same machine must
read as, without touching any file. Tests read the written tree with
:func:`dracpu.adapters.sysfs.read_topology` and compare it with :func:`build_topology`.

:data:`FIXTURES` names the machines used by tests, benchmarks and ``dracpu sim --topology NAME``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import translate
from pathlib import Path
from typing import Literal

from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.topology import NO_NUMA_NODE, CoreType, CpuInfo, Topology
from dracpu.errors import ConfigError

__all__ = [
    "E_CORES_PER_CLUSTER",
    "FIXTURES",
    "CoreIdScheme",
    "CpuNumbering",
    "L3Mode",
    "SMT_AUTO",
    "MachineSpec",
    "PciRoot",
    "build_topology",
    "fixture",
    "sysfs_tree",
    "write_sysfs",
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


def _layout(spec: MachineSpec) -> _Layout:
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
    layout = _layout(spec)
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
        pcie_roots=_pci_affinity(spec, layout) if pcie_roots else {},
        numa_in_sysfs=spec.numa_sysfs,
    )


def _numa_cpus(spec: MachineSpec, layout: _Layout) -> dict[int, CpuSet]:
    """NUMA node -> the online CPUs the kernel lists under it (nodes left empty included)."""
    return {node: cpus - spec.no_numa_node for node, cpus in layout.group("numa").items()}


def _pci_affinity(spec: MachineSpec, layout: _Layout) -> dict[str, CpuSet]:
    """Root complex name -> its cpulistaffinity: the online CPUs of its node, or all of them."""
    nodes = _numa_cpus(spec, layout)
    return {
        root.name: layout.online if root.numa is None else nodes.get(root.numa, EMPTY)
        for root in spec.pci_roots
    }


def _smt_control_text(spec: MachineSpec) -> str | None:
    if spec.smt_control != SMT_AUTO:
        return spec.smt_control
    return "on" if spec.threads_per_core > 1 else "notsupported"


def _smt_enabled(spec: MachineSpec, layout: _Layout) -> bool:
    text = _smt_control_text(spec)
    if text == "on":
        return True
    if text in ("off", "forceoff", "notsupported", "notimplemented"):
        return False
    return any(len(layout.online_of(core.threads)) > 1 for core in layout.cores)


# --- the sysfs tree ------------------------------------------------------------------------------

_CPU = "sys/devices/system/cpu"
_NODE = "sys/devices/system/node"


def write_sysfs(
    spec: MachineSpec,
    root: Path,
    *,
    omit: Iterable[str] = (),
    override: Mapping[str, str] | None = None,
) -> None:
    """Write the machine's sysfs files under ``root/sys`` (``root`` is the host root).

    ``omit``: glob patterns (``fnmatch``, ``*`` crosses ``/``) of paths relative to ``root``
    (``"sys/devices/system/cpu/cpu3/topology/core_id"``) not to write; a pattern matching a
    directory omits everything under it. ``override``: path -> text written instead of (or in
    addition to) the generated file. Together they make broken machines for error tests.
    ``root/sys`` must not exist yet.
    """
    if os.path.lexists(os.path.join(root, "sys")):
        raise ConfigError(f"{os.path.join(root, 'sys')} already exists: write into an empty root")
    files, links = _sysfs_files(spec)
    patterns = [re.compile(translate(p)) for p in omit]
    if patterns:
        files = {p: t for p, t in files.items() if not _omitted(p, patterns)}
        links = {p: t for p, t in links.items() if not _omitted(p, patterns)}
    if override:
        files.update(override)
    prefix = os.fspath(root).rstrip("/") + "/"
    made: set[str] = set()
    for rel, text in files.items():
        _write(prefix, rel, text, made)
    for rel, target in links.items():
        parent = rel.rpartition("/")[0]
        if parent not in made:
            os.makedirs(prefix + parent, exist_ok=True)
            made.add(parent)
        os.symlink(target, prefix + rel)


def sysfs_tree(spec: MachineSpec) -> tuple[dict[str, str], dict[str, str]]:
    """What :func:`write_sysfs` writes: (path -> text, symlink path -> target), the paths
    relative to the host root (:mod:`dracpu.sim.hotplug` rewrites a tree with it)."""
    return _sysfs_files(spec)


def _omitted(rel: str, patterns: list[re.Pattern[str]]) -> bool:
    path = rel
    while path:
        if any(p.match(path) for p in patterns):
            return True
        path = os.path.dirname(path)
    return False


def _write(root: str, rel: str, text: str, made: set[str]) -> None:
    parent = rel.rpartition("/")[0]
    if parent not in made:
        os.makedirs(root + parent, exist_ok=True)
        made.add(parent)
    fd = os.open(root + rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)


def _sysfs_files(spec: MachineSpec) -> tuple[dict[str, str], dict[str, str]]:
    """(path -> text, symlink path -> target), paths relative to the host root."""
    layout = _layout(spec)
    online = layout.online
    total = spec.cpu_count
    present = CpuSet.range(0, total)
    files: dict[str, str] = {}
    links: dict[str, str] = {}

    def put(rel: str, value: object) -> None:
        files[rel] = f"{value}\n"

    put(f"{_CPU}/online", online)
    put(f"{_CPU}/present", present)
    put(f"{_CPU}/possible", present)
    put(f"{_CPU}/offline", spec.offline)
    put(f"{_CPU}/isolated", spec.isolated)
    put(f"{_CPU}/kernel_max", 8191)
    smt = _smt_control_text(spec)
    if smt is not None:
        put(f"{_CPU}/smt/control", smt)
        put(
            f"{_CPU}/smt/active",
            int(any(len(layout.online_of(c.threads)) > 1 for c in layout.cores)),
        )

    if spec.hybrid is not None:
        by_type: dict[CoreType, int] = {}
        for core in layout.cores:
            for cpu in core.threads:
                by_type[core.core_type] = by_type.get(core.core_type, 0) | 1 << cpu
        put("sys/devices/cpu_core/cpus", CpuSet.from_mask(by_type.get(CoreType.P_CORE, 0)))
        put("sys/devices/cpu_atom/cpus", CpuSet.from_mask(by_type.get(CoreType.E_CORE, 0)))

    sockets = layout.group("socket")
    nodes = layout.group("numa")
    l3s = layout.group("l3")
    l3_written_id = {core.l3: core.l3 for core in layout.cores}
    clusters: dict[tuple[int, int], int] = {}
    dies: dict[tuple[int, int], int] = {}
    for core in layout.cores:
        for cpu in core.threads:
            key = (core.socket, core.cluster)
            clusters[key] = clusters.get(key, 0) | 1 << cpu
            die_key = (core.socket, core.die)
            dies[die_key] = dies.get(die_key, 0) | 1 << cpu

    if spec.numa_sysfs:
        # A node whose every CPU is in no_numa_node is not online: possible, but no directory.
        listed = {n: cpus for n, cpus in _numa_cpus(spec, layout).items() if cpus or not nodes[n]}
        node_ids = CpuSet(listed)
        put(f"{_NODE}/possible", CpuSet(nodes))
        put(f"{_NODE}/online", node_ids)
        put(f"{_NODE}/has_cpu", CpuSet(n for n, cpus in listed.items() if cpus))
        put(f"{_NODE}/has_memory", node_ids)
        for node, cpus in listed.items():
            put(f"{_NODE}/node{node}/cpulist", cpus)
            put(f"{_NODE}/node{node}/cpumap", _hex_mask(cpus, total))

    for name, local in _pci_affinity(spec, layout).items():
        bus = name.removeprefix("pci")
        put(f"sys/devices/{name}/pci_bus/{bus}/cpulistaffinity", local)
        put(f"sys/devices/{name}/pci_bus/{bus}/cpuaffinity", _hex_mask(local, total))

    for cpu in range(total):
        core = layout.core_of[cpu]
        base = f"{_CPU}/cpu{cpu}"
        if cpu:
            put(f"{base}/online", int(cpu in online))
        if spec.numa_sysfs and cpu not in spec.no_numa_node:
            links[f"{base}/node{core.numa}"] = f"../../node/node{core.numa}"
        if cpu not in online:
            continue  # the kernel removes topology/ and cache/ of an offline CPU
        siblings = layout.online_of(core.threads)
        cluster_cpus = (
            CpuSet.from_mask(clusters[(core.socket, core.cluster)]) & online
            if core.cluster != NO_CLUSTER_RAW
            else siblings
        )
        package = sockets[core.socket]
        topo = f"{base}/topology"
        put(f"{topo}/physical_package_id", core.socket)
        if spec.die_id_file:
            put(f"{topo}/die_id", core.die)
            put(f"{topo}/die_cpus_list", CpuSet.from_mask(dies[(core.socket, core.die)]) & online)
        put(f"{topo}/cluster_id", core.cluster)
        put(f"{topo}/cluster_cpus_list", cluster_cpus)
        put(f"{topo}/core_id", core.core_id)
        put(f"{topo}/thread_siblings_list", siblings)
        put(f"{topo}/core_cpus_list", siblings)
        put(f"{topo}/core_siblings_list", package)
        put(f"{topo}/package_cpus_list", package)

        cache = f"{base}/cache"
        l2_cpus = cluster_cpus if core.core_type is CoreType.E_CORE else siblings
        # L1d, L1i, L2 (only what tells them from the L3), then the L3 unless there is none.
        put(f"{cache}/index0/level", 1)
        put(f"{cache}/index0/type", "Data")
        put(f"{cache}/index1/level", 1)
        put(f"{cache}/index1/type", "Instruction")
        put(f"{cache}/index2/level", 2)
        put(f"{cache}/index2/type", "Unified")
        put(f"{cache}/index2/shared_cpu_list", l2_cpus)
        if spec.l3 != "none":
            put(f"{cache}/index3/level", 3)
            put(f"{cache}/index3/type", "Unified")
            put(f"{cache}/index3/shared_cpu_list", l3s[core.l3])
            if spec.l3 == "id":
                put(f"{cache}/index3/id", l3_written_id[core.l3])
    return files, links


def _hex_mask(cpus: CpuSet, total: int) -> str:
    """The kernel's cpumask format: 32-bit hex words, most significant first, comma separated."""
    words = max(1, (total + 31) // 32)
    mask = cpus.mask
    return ",".join(f"{(mask >> (32 * w)) & 0xFFFFFFFF:08x}" for w in reversed(range(words)))


# --- named machines ------------------------------------------------------------------------------

FIXTURES: dict[str, MachineSpec] = {
    "dual-socket-smt2": MachineSpec(
        sockets=2,
        numa_per_die=2,
        l3_per_numa=2,
        cores_per_cluster=4,
        threads_per_core=2,
        pci_roots=(
            PciRoot("pci0000:00", 0),
            PciRoot("pci0000:3a", 0),
            PciRoot("pci0000:5d", 1),
            PciRoot("pci0000:80", 2),
            PciRoot("pci0000:ae", 3),
            PciRoot("pci0000:d7", 3),
            PciRoot("pci0001:00", None),
        ),
        description=(
            "x86 server: 2 sockets x 2 NUMA x 2 L3 x 4 cores x SMT2 = 64 CPUs; core_id repeats "
            "per socket; siblings are cpuN and cpuN+32; PCIe roots on every NUMA node (two on "
            "nodes 0 and 3) and one without NUMA affinity"
        ),
    ),
    "hybrid-desktop": MachineSpec(
        hybrid=(8, 8),
        threads_per_core=2,
        cpu_numbering="adjacent",
        core_id_step=4,
        description=(
            "Intel hybrid desktop: 8 P-cores x SMT2 (cpu0-15) + 8 E-cores in 2 clusters "
            "(cpu16-23), one L3, cpu_core/cpu_atom PMU files"
        ),
    ),
    "arm64-server": MachineSpec(
        numa_per_die=2,
        clusters_per_l3=4,
        cores_per_cluster=4,
        l3="shared-cpu-list",
        die_id_file=False,
        smt_control="notsupported",
        pci_roots=(PciRoot("pci0000:00", 0), PciRoot("pci0001:00", 1)),
        description=(
            "arm64 server: 1 socket x 2 NUMA x 1 L3 x 4 clusters x 4 cores = 32 CPUs, no SMT, "
            "no cache id files (L3 named by its lowest CPU), no die_id; a PCIe root per node"
        ),
    ),
    "smt4": MachineSpec(
        sockets=2,
        l3_per_numa=2,
        cores_per_cluster=4,
        threads_per_core=4,
        cpu_numbering="adjacent",
        description=(
            "POWER-like: 2 sockets x 1 NUMA x 2 L3 x 4 cores x SMT4 = 64 CPUs, threads of a "
            "core numbered adjacently"
        ),
    ),
    "vm-2cpu": MachineSpec(
        cores_per_cluster=2,
        smt_control="notsupported",
        pci_roots=(PciRoot("pci0000:00", None),),
        description=(
            "a 2-vCPU virtual machine: 1 socket, 1 NUMA node, 1 L3, no SMT; one PCIe root "
            "without NUMA affinity"
        ),
    ),
    "knl-smt4": MachineSpec(
        cores_per_cluster=16,
        threads_per_core=4,
        l3="none",
        description=(
            "Xeon Phi-like: 1 socket x 1 NUMA x 16 cores x SMT4 = 64 CPUs, siblings +16 apart "
            "(cpu0,16,32,48 are core 0), no L3 cache"
        ),
    ),
    "no-numa-node": MachineSpec(
        numa_per_die=2,
        cores_per_cluster=4,
        threads_per_core=2,
        no_numa_node=CpuSet.parse("4-7,12-15"),
        description=(
            "16-CPU SMT2 box (2 NUMA x 4 cores x SMT2, siblings +8) whose node 1 is not online: "
            "cpu4-7,12-15 link to no NUMA node"
        ),
    ),
    "offline-isolated": MachineSpec(
        numa_per_die=2,
        cores_per_cluster=4,
        threads_per_core=2,
        offline=CpuSet.parse("5,14-15"),
        isolated=CpuSet.parse("2,7,10,14"),
        description=(
            "16-CPU SMT2 box (2 NUMA x 4 cores x SMT2, siblings +8) with cpu5,14,15 offline "
            "and isolcpus=2,7,10,14 (14 is offline, so it does not count)"
        ),
    ),
    "big-1024": MachineSpec(
        sockets=2,
        numa_per_die=4,
        l3_per_numa=4,
        cores_per_cluster=16,
        threads_per_core=2,
        pci_roots=tuple(
            PciRoot(f"pci{n // 2:04x}:{0x80 * (n % 2):02x}", n // 2) for n in range(16)
        ),
        description=(
            "benchmark machine: 2 sockets x 4 NUMA x 4 L3 x 16 cores x SMT2 = 1024 CPUs, "
            "siblings +512; two PCIe roots per NUMA node"
        ),
    ),
}
"""The named machines (``dracpu sim --topology NAME``)."""


def fixture(name: str) -> MachineSpec:
    """The named machine; :class:`ConfigError` listing the names when unknown."""
    try:
        return FIXTURES[name]
    except KeyError:
        raise ConfigError(
            f"unknown topology {name!r}: choose one of {', '.join(sorted(FIXTURES))}"
        ) from None
