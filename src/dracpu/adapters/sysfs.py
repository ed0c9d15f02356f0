"""Read the node's CPU topology from ``<host-root>/sys`` into a :class:`Topology`.

Synchronous plain file reads (callers on the event loop use ``anyio.to_thread.run_sync``). What is
read, relative to ``<host-root>/sys/devices``:

- ``system/cpu/online`` (required), ``present`` (fallback ``possible``) for the offline CPUs,
  ``isolated`` (optional) for the kernel's ``isolcpus``;
- per online CPU ``system/cpu/cpuN/topology/core_id``; with the lowest CPU of each core its
  ``thread_siblings_list`` (or ``core_cpus_list``); ``physical_package_id``, ``die_id`` and
  ``cluster_id`` with the lowest CPU of each package (die, cluster) as listed by
  ``package_cpus_list`` (``die_cpus_list``, ``cluster_cpus_list``) or by the SMT siblings; the
  level-3 ``cache/indexK/{level, type, id, shared_cpu_list}`` with the lowest CPU of each L3;
- ``system/node/nodeX/cpulist`` plus the ``nodeX`` link under ``cpuN/`` for the NUMA node. A CPU
  that no node lists and that links to no node (its node is not online) has no NUMA node
  (:data:`~dracpu.core.topology.NO_NUMA_NODE`); a kernel without NUMA support (no ``system/node``
  at all) puts every CPU on node 0, as its own ``numa_node_id()`` does;
- ``cpu_core/cpus`` and ``cpu_atom/cpus`` (hybrid P-/E-cores), ``system/cpu/smt/control``;
- with ``pcie_roots=True`` (``--expose-pcie-roots``): the PCIe root complexes, the
  ``pciDDDD:BB`` entries of ``devices/`` (the kernel names a host bridge ``"pci%04x:%02x"``,
  ``drivers/pci/probe.c``; upstream ``pcie.IsPCIeRootName`` reads exactly these), each with the
  CPUs local to it from ``pciDDDD:BB/pci_bus/DDDD:BB/cpulistaffinity`` (the CPUs of the root
  bus's NUMA node, or every CPU when it has none).

Every missing or malformed file that we need becomes one :class:`~dracpu.errors.TopologyError`
whose message starts with the file's path; no ``OSError`` or ``ValueError`` escapes.

Opening a sysfs file costs far more than reading it, so a file that a whole group of CPUs shares
is read once for the group, never once per CPU: only ``core_id`` and one ``lstat`` of the NUMA
link are per CPU (``docs/performance.md`` has the figures). The kernel fills the group lists only
with CPUs of the same package, die, cluster, core or cache, so spreading a value over a list is
what the kernel itself says; the thread-siblings check below still proves the core identity.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.topology import NO_NUMA_NODE, CoreKey, CoreType, CpuInfo, Topology
from dracpu.errors import CpuSetParseError, TopologyError

__all__ = ["read_online", "read_topology"]

# Paths relative to the host root (Linux ABI: Documentation/ABI/stable/sysfs-devices-system-cpu,
# Documentation/ABI/testing/sysfs-devices-system-cpu, Documentation/ABI/stable/sysfs-devices-node).
CPU_DIR = "sys/devices/system/cpu"
NODE_DIR = "sys/devices/system/node"
# Hybrid Intel CPUs register one PMU per core type (arch/x86/events/intel/core.c): "cpu_core"
# for P-cores and "cpu_atom" for E-cores, each with a "cpus" cpulist.
CPU_CORE_CPUS = "sys/devices/cpu_core/cpus"
CPU_ATOM_CPUS = "sys/devices/cpu_atom/cpus"
SMT_CONTROL = f"{CPU_DIR}/smt/control"
# Where the kernel registers PCI host bridges (drivers/pci/probe.c, pci_register_host_bridge).
DEVICES_DIR = "sys/devices"

# smt/control values (Documentation/ABI/testing/sysfs-devices-system-cpu); upstream maps "on" to
# true and these four to false, anything else falls back to "some core has 2+ threads".
SMT_ON = "on"
SMT_OFF_VALUES = frozenset({"off", "forceoff", "notsupported", "notimplemented"})

# cluster_id is 65535 (BAD_APICID / "no cluster") on x86 CPUs without clusters; upstream maps it
# to -1, as we do for a missing file.
NO_CLUSTER_RAW = 65535
NO_CLUSTER = -1

# The cache level we align on (the "uncore cache" of kubelet's cpu manager) and the cache types
# that hold data; an "Instruction" level-3 cache is not the LLC.
L3_LEVEL = 3
L3_TYPES = frozenset({"Unified", "Data"})

# Larger than any sysfs attribute (one page, PAGE_SIZE is 4..64 KiB).
_READ_SIZE = 1 << 17

_INT = re.compile(r"-?[0-9]+")
# A root complex entry, "pci" + "%04x:%02x" of its domain and bus; as upstream IsPCIeRootName,
# a domain wider than four hex digits (Intel VMD's 10000 and up) is not read.
_PCI_ROOT = re.compile(r"pci([0-9a-f]{4}:[0-9a-f]{2})")
_NODE_ENTRY = re.compile(r"node([0-9]+)")
_INDEX_ENTRY = re.compile(r"index([0-9]+)")


def read_topology(host_root: Path, *, pcie_roots: bool = False) -> Topology:
    """Read every online CPU under ``<host_root>/sys``, and with ``pcie_roots`` the PCIe root
    complexes; :class:`TopologyError` on a bad file."""
    return _Reader(host_root).read(pcie_roots=pcie_roots)


def read_online(host_root: Path) -> CpuSet:
    """The online CPUs now (``system/cpu/online``); :class:`TopologyError` when the file is
    missing or malformed."""
    return _Reader(host_root).read_online()


class _Reader:
    """One pass over sysfs; remembers files shared by several CPUs."""

    def __init__(self, host_root: Path) -> None:
        root = os.fspath(host_root)
        self._prefix = root if root.endswith("/") else root + "/"
        self._l3_index: int | None = None  # index of the L3 in cache/, learnt on the first CPU
        self._l3_of: dict[int, int] = {}  # cpu -> L3 id, filled one cache domain at a time

    # --- files -----------------------------------------------------------------------------

    def _path(self, rel: str) -> str:
        return self._prefix + rel

    def _read(self, rel: str) -> str | None:
        """The file's text without surrounding whitespace; ``None`` when it does not exist."""
        try:
            fd = os.open(self._path(rel), os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TopologyError(f"{self._path(rel)}: cannot open: {exc.strerror}") from exc
        try:
            # A sysfs attribute is at most one page, returned by the first read(); loop only
            # for the (fake) files that fill the buffer.
            data = os.read(fd, _READ_SIZE)
            if len(data) == _READ_SIZE:
                while chunk := os.read(fd, _READ_SIZE):
                    data += chunk
        except OSError as exc:
            raise TopologyError(f"{self._path(rel)}: cannot read: {exc.strerror}") from exc
        finally:
            os.close(fd)
        try:
            return data.decode("ascii").strip()
        except UnicodeDecodeError as exc:
            raise TopologyError(f"{self._path(rel)}: malformed: not ASCII text") from exc

    def _required(self, rel: str) -> str:
        text = self._read(rel)
        if text is None:
            raise TopologyError(f"{self._path(rel)}: missing")
        return text

    def _int(self, rel: str, text: str) -> int:
        if not _INT.fullmatch(text):
            raise TopologyError(f"{self._path(rel)}: malformed: {text!r} is not an integer")
        return int(text)

    def _required_int(self, rel: str) -> int:
        return self._int(rel, self._required(rel))

    def _cpulist(self, rel: str, text: str) -> CpuSet:
        try:
            return CpuSet.parse(text)
        except CpuSetParseError as exc:
            raise TopologyError(f"{self._path(rel)}: malformed: {exc}") from exc

    def _required_cpulist(self, rel: str) -> CpuSet:
        return self._cpulist(rel, self._required(rel))

    def _optional_cpulist(self, rel: str) -> CpuSet | None:
        text = self._read(rel)
        return None if text is None else self._cpulist(rel, text)

    def _listdir(self, rel: str) -> list[str] | None:
        try:
            return os.listdir(self._path(rel))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise TopologyError(f"{self._path(rel)}: cannot list: {exc.strerror}") from exc

    # --- the machine -----------------------------------------------------------------------

    def read_online(self) -> CpuSet:
        online_rel = f"{CPU_DIR}/online"
        online = self._required_cpulist(online_rel)
        if not online:
            raise TopologyError(f"{self._path(online_rel)}: malformed: no online CPU")
        return online

    def read(self, *, pcie_roots: bool) -> Topology:
        online = self.read_online()
        present = self._optional_cpulist(f"{CPU_DIR}/present")
        if present is None:
            present = self._optional_cpulist(f"{CPU_DIR}/possible")
        offline = (present or EMPTY) - online
        isolated = self._optional_cpulist(f"{CPU_DIR}/isolated") or EMPTY

        numa_of, numa_in_sysfs = self._numa_nodes(online)
        core_types = self._core_types()

        sockets = _SharedId("physical_package_id", ("package_cpus_list", "core_siblings_list"))
        dies = _SharedId("die_id", ("die_cpus_list",), default=0)
        clusters = _SharedId("cluster_id", ("cluster_cpus_list",), default=NO_CLUSTER)
        keys: dict[int, CoreKey] = {}
        by_key: dict[CoreKey, int] = {}  # core key -> bit mask of its online CPUs
        listed: dict[int, tuple[str, CpuSet]] = {}  # cpu -> (siblings file read, its siblings)
        for cpu in online:
            topo = f"{CPU_DIR}/cpu{cpu}/topology"
            seed = cpu not in listed
            if seed:
                rel, siblings = self._siblings(topo)
                if cpu not in siblings:
                    raise TopologyError(f"{self._path(rel)}: does not list cpu{cpu} itself")
                siblings &= online
                for sibling in siblings:
                    listed.setdefault(sibling, (rel, siblings))
            socket = self._shared_id(sockets, cpu, topo, online)
            die = self._shared_id(dies, cpu, topo, online)
            cluster = self._shared_id(clusters, cpu, topo, online)
            if seed:
                # SMT threads share their core's package, die and cluster.
                for shared, value in ((sockets, socket), (dies, die), (clusters, cluster)):
                    for sibling in siblings:
                        shared.known.setdefault(sibling, value)
            key = (
                socket,
                die,
                NO_CLUSTER if cluster == NO_CLUSTER_RAW else cluster,
                self._required_int(f"{topo}/core_id"),
            )
            keys[cpu] = key
            by_key[key] = by_key.get(key, 0) | (1 << cpu)

        # The kernel's SMT siblings of each core must be the online CPUs with its core key: this
        # proves (socket, die, cluster, core_id) identifies a core on this machine.
        for key, core in by_key.items():
            cpu = (core & -core).bit_length() - 1
            rel, siblings = listed[cpu]
            if siblings.mask != core:
                raise TopologyError(
                    f"{self._path(rel)}: lists online siblings {str(siblings)!r} but the online "
                    f"CPUs with cpu{cpu}'s (physical_package_id, die_id, cluster_id, core_id) = "
                    f"{key} are {str(CpuSet.from_mask(core))!r}"
                )

        cpus: dict[int, CpuInfo] = {}
        for cpu, (socket, die, cluster, core_id) in keys.items():
            cpus[cpu] = CpuInfo(
                cpu_id=cpu,
                socket_id=socket,
                die_id=die,
                cluster_id=cluster,
                core_id=core_id,
                numa_node=numa_of[cpu],
                l3_id=self._l3_id(cpu),
                core_type=core_types(cpu),
            )

        return Topology(
            cpus=cpus,
            smt_enabled=self._smt_enabled(max(m.bit_count() for m in by_key.values())),
            offline=offline,
            isolated=isolated,
            pcie_roots=self._pcie_roots() if pcie_roots else {},
            numa_in_sysfs=numa_in_sysfs,
        )

    def _shared_id(self, shared: _SharedId, cpu: int, topo: str, online: CpuSet) -> int:
        """Read the id with the group's lowest CPU and give it to every online CPU of its list:
        the kernel only lists CPUs of the same package (die, cluster) there. Without a list file
        (older kernels) each CPU's own id is read."""
        known = shared.known.get(cpu)
        if known is not None:
            return known
        rel = f"{topo}/{shared.id_name}"
        text = self._read(rel)
        if text is None:
            if shared.default is None:
                raise TopologyError(f"{self._path(rel)}: missing")
            return shared.default
        value = self._int(rel, text)
        for name in shared.list_names:
            list_rel = f"{topo}/{name}"
            group = self._optional_cpulist(list_rel)
            if group is None:
                continue
            if cpu not in group:
                raise TopologyError(f"{self._path(list_rel)}: does not list cpu{cpu} itself")
            for member in group & online:
                shared.known[member] = value
            break
        return value

    def _siblings(self, topo: str) -> tuple[str, CpuSet]:
        """(the file read, the SMT siblings it lists): ``thread_siblings_list``, or the newer
        name ``core_cpus_list`` when only that exists."""
        for name in ("thread_siblings_list", "core_cpus_list"):
            rel = f"{topo}/{name}"
            text = self._read(rel)
            if text is not None:
                return rel, self._cpulist(rel, text)
        raise TopologyError(
            f"{self._path(f'{topo}/thread_siblings_list')}: missing (and no core_cpus_list)"
        )

    # --- NUMA ------------------------------------------------------------------------------

    def _numa_nodes(self, online: CpuSet) -> tuple[dict[int, int], bool]:
        """(cpu -> NUMA node, whether the kernel has NUMA nodes), from node/nodeX/cpulist, each
        checked against cpuN/nodeX."""
        entries = self._listdir(NODE_DIR)
        if entries is None:
            # A kernel without CONFIG_NUMA has no node directory: one node, 0.
            return dict.fromkeys(online, 0), False
        node_of: dict[int, int] = {}
        for entry in entries:
            match = _NODE_ENTRY.fullmatch(entry)
            if match is None:
                continue
            node = int(match.group(1))
            rel = f"{NODE_DIR}/{entry}/cpulist"
            for cpu in self._required_cpulist(rel) & online:
                other = node_of.setdefault(cpu, node)
                if other != node:
                    raise TopologyError(
                        f"{self._path(rel)}: lists cpu{cpu}, which "
                        f"{self._path(f'{NODE_DIR}/node{other}/cpulist')} lists too"
                    )
        for cpu in online:
            listed = node_of.get(cpu)
            link = f"{CPU_DIR}/cpu{cpu}/node{listed}"
            if listed is None or not os.path.lexists(self._path(link)):
                node_of[cpu] = self._unlinked(cpu, listed)
        return node_of, True

    def _unlinked(self, cpu: int, listed: int | None) -> int:
        """The node of a CPU whose ``nodeX`` link is not the node listing it: NO_NUMA_NODE when
        neither exists, else the kernel contradicts itself (an error)."""
        cpu_rel = f"{CPU_DIR}/cpu{cpu}"
        linked = sorted(
            int(m.group(1))
            for entry in self._listdir(cpu_rel) or []
            if (m := _NODE_ENTRY.fullmatch(entry)) is not None
        )
        if listed is None and not linked:
            return NO_NUMA_NODE
        if listed is None:
            raise TopologyError(
                f"{self._path(f'{NODE_DIR}/node{linked[0]}/cpulist')}: does not list cpu{cpu} "
                f"although {self._path(f'{cpu_rel}/node{linked[0]}')} exists"
            )
        if not linked:
            raise TopologyError(
                f"{self._path(cpu_rel)}: no node{listed} entry although "
                f"{self._path(f'{NODE_DIR}/node{listed}/cpulist')} lists cpu{cpu}"
            )
        raise TopologyError(
            f"{self._path(f'{NODE_DIR}/node{listed}/cpulist')}: lists cpu{cpu} but "
            f"{self._path(cpu_rel)} links to node{linked[0]}"
        )

    # --- PCIe roots ------------------------------------------------------------------------

    def _pcie_roots(self) -> dict[str, CpuSet]:
        """Root complex name -> the CPUs local to it (upstream ``pcie.PCIeDomainsFromFS``)."""
        roots: dict[str, CpuSet] = {}
        for entry in sorted(self._listdir(DEVICES_DIR) or []):
            match = _PCI_ROOT.fullmatch(entry)
            if match is not None:
                bus = match.group(1)
                rel = f"{DEVICES_DIR}/{entry}/pci_bus/{bus}/cpulistaffinity"
                roots[entry] = self._required_cpulist(rel)
        return roots

    # --- caches ----------------------------------------------------------------------------

    def _l3_id(self, cpu: int) -> int | None:
        known = self._l3_of.get(cpu)
        if known is not None:
            return known  # read with a lower CPU of the same cache domain
        index = self._find_l3_index(cpu)
        if index is None:
            return None
        cache = f"{CPU_DIR}/cpu{cpu}/cache/index{index}"
        shared_rel = f"{cache}/shared_cpu_list"
        shared = self._required_cpulist(shared_rel)
        if cpu not in shared:
            raise TopologyError(f"{self._path(shared_rel)}: does not list cpu{cpu} itself")
        text = self._read(f"{cache}/id")
        # arm64 has no cache id: the lowest CPU sharing the cache names it (as upstream does).
        l3 = shared.min() if text is None else self._int(f"{cache}/id", text)
        for member in shared:
            other = self._l3_of.setdefault(member, l3)
            if other != l3:
                raise TopologyError(
                    f"{self._path(shared_rel)}: lists cpu{member}, whose level-3 cache is "
                    f"{other}, not {l3}"
                )
        return l3

    def _is_l3(self, cache: str) -> bool:
        level = self._read(f"{cache}/level")
        if level is None:
            return False
        if self._int(f"{cache}/level", level) != L3_LEVEL:
            return False
        return self._required(f"{cache}/type") in L3_TYPES

    def _find_l3_index(self, cpu: int) -> int | None:
        caches = f"{CPU_DIR}/cpu{cpu}/cache"
        if self._l3_index is not None and self._is_l3(f"{caches}/index{self._l3_index}"):
            return self._l3_index
        indexes = sorted(
            int(m.group(1))
            for entry in self._listdir(caches) or []
            if (m := _INDEX_ENTRY.fullmatch(entry)) is not None
        )
        for index in indexes:
            if self._is_l3(f"{caches}/index{index}"):
                self._l3_index = index
                return index
        return None

    # --- node-wide facts -------------------------------------------------------------------

    def _core_types(self) -> _CoreTypes:
        p_cores = self._optional_cpulist(CPU_CORE_CPUS)
        e_cores = self._optional_cpulist(CPU_ATOM_CPUS)
        return _CoreTypes(p_cores, e_cores)

    def _smt_enabled(self, smt_width: int) -> bool:
        control = self._read(SMT_CONTROL)
        if control == SMT_ON:
            return True
        if control in SMT_OFF_VALUES:
            return False
        return smt_width > 1


@dataclass(frozen=True, slots=True)
class _SharedId:
    """A per-CPU id that a group of CPUs share and that the kernel also lists as a group
    (``physical_package_id`` with ``package_cpus_list``, ...). ``default``: the value when the
    id file is missing (``None``: the file is required). ``known``: cpu -> id found so far."""

    id_name: str
    list_names: tuple[str, ...]
    default: int | None = None
    known: dict[int, int] = field(default_factory=dict)


class _CoreTypes:
    """cpu -> core type: ``cpu_atom`` CPUs are E-cores, ``cpu_core`` CPUs (or, when only
    ``cpu_atom`` exists, all the others) are P-cores; no hybrid PMU at all: standard."""

    __slots__ = ("_e_cores", "_p_cores", "_rest")

    def __init__(self, p_cores: CpuSet | None, e_cores: CpuSet | None) -> None:
        self._p_cores = p_cores or EMPTY
        self._e_cores = e_cores or EMPTY
        self._rest = CoreType.P_CORE if e_cores is not None else CoreType.STANDARD

    def __call__(self, cpu: int) -> CoreType:
        if cpu in self._e_cores:
            return CoreType.E_CORE
        if cpu in self._p_cores:
            return CoreType.P_CORE
        return self._rest
