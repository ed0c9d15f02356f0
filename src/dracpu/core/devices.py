"""The devices this node publishes: their names, numbering, attributes and capacity.

Pure: a :class:`~dracpu.core.topology.Topology` and the reserved CPUs go in, :class:`Device`
values come out (:mod:`dracpu.core.slices` puts them into ResourceSlice objects). Names,
numbering, attributes and capacity are the compatibility contract of the Go driver
``kubernetes-sigs/dra-driver-cpu`` (``pkg/device/builder.go``, ``pkg/device/attributes.go``,
``pkg/cpuinfo/cpuinfo.go``): a user who swaps it for dracpu keeps their DeviceClasses and
ResourceClaimTemplates, and a claim allocated against its slices names the same CPUs in ours.
``docs/devices.md`` explains each rule (which CPUs, individual numbering, grouped capacity and
its ``requestPolicy``, our added attributes) and lists where we deliberately differ.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from dracpu.core.cpuset import CpuSet
from dracpu.core.external_attributes import external_attributes, smt_layout
from dracpu.core.topology import Topology
from dracpu.errors import TopologyError

__all__ = [
    "ATTR_CACHE_L3_ID",
    "ATTR_CORE_ID",
    "ATTR_CORE_TYPE",
    "ATTR_CPU_ID",
    "ATTR_DRANET_NUMA_NODE",
    "ATTR_ISOLATED",
    "ATTR_LEGACY_NUMA_NODE_ID",
    "ATTR_NUMA_NODE",
    "ATTR_NUM_CPUS",
    "ATTR_NUM_ISOLATED_CPUS",
    "ATTR_PCIE_ROOT",
    "ATTR_SMT_ENABLED",
    "ATTR_SOCKET_ID",
    "CAPACITY_CPU",
    "DRIVER_NAME",
    "NO_L3_CACHE",
    "AttributeValue",
    "CpuDeviceMode",
    "Device",
    "GroupBy",
    "cpu_attributes",
    "devices_by_name",
    "individual_numbering",
    "published_devices",
]

# --- names of the compatibility contract (upstream pkg/device/attributes.go, builder.go) --------

DRIVER_NAME = "dra.cpu"  # upstream cmd/dracpu/app.go driverName; also the DeviceClass name
API_VERSION = "resource.k8s.io/v1"  # the GA DRA API, the one upstream publishes
KIND = "ResourceSlice"
# The API server's limit of attribute values per device, a list counting each of its values
# (k8s.io/api resource/v1 types.go ResourceSliceMaxAttributeValuesPerDevice, 1.36+).
MAX_ATTRIBUTE_VALUES_PER_DEVICE = 48

CAPACITY_CPU = "dra.cpu/cpu"  # upstream device.CPUResourceQualifiedName

ATTR_NUMA_NODE = "resource.kubernetes.io/numaNode"  # KEP-6072 StandardDeviceAttributeNUMANode
ATTR_PCIE_ROOT = "resource.kubernetes.io/pcieRoot"  # KEP-4381 StandardDeviceAttributePCIeRoot
ATTR_SOCKET_ID = "dra.cpu/socketID"  # upstream AttributeSocketID
ATTR_SMT_ENABLED = "dra.cpu/smtEnabled"  # upstream AttributeSMTEnabled
ATTR_CACHE_L3_ID = "dra.cpu/cacheL3ID"  # upstream AttributeCacheL3ID
ATTR_CORE_TYPE = "dra.cpu/coreType"  # upstream AttributeCoreType
ATTR_CORE_ID = "dra.cpu/coreID"  # upstream AttributeCoreID (raw sysfs core_id)
ATTR_CPU_ID = "dra.cpu/cpuID"  # upstream AttributeCPUID
ATTR_NUM_CPUS = "dra.cpu/numCPUs"  # upstream AttributeNumCPUs (grouped)
ATTR_LEGACY_NUMA_NODE_ID = "dra.cpu/numaNodeID"  # upstream addCompatibilityAttributes (legacy)
ATTR_DRANET_NUMA_NODE = "dra.net/numaNode"  # upstream addCompatibilityAttributes (DraNet alias)
ATTR_ISOLATED = "dra.cpu/isolated"  # ours: on every individual device
ATTR_NUM_ISOLATED_CPUS = "dra.cpu/numIsolatedCPUs"  # ours: on every grouped device

# dra.cpu/cacheL3ID of a CPU without a level-3 cache: upstream CPUInfo.UncoreCacheID's default.
NO_L3_CACHE = -1

# Device name prefixes: upstream CPUDevicePrefix, CPUDeviceNUMAGroupedPrefix,
# CPUDeviceSocketGroupedPrefix, CPUDeviceMachineGrouped.
_PREFIX_CPU = "cpudev"
_PREFIX_NUMA = "cpudevnuma"
_PREFIX_SOCKET = "cpudevsocket"
_NAME_MACHINE = "cpudevmachine"


class CpuDeviceMode(StrEnum):
    """``--cpu-device-mode`` / config ``cpuDeviceMode`` (upstream values)."""

    GROUPED = "grouped"
    INDIVIDUAL = "individual"


class GroupBy(StrEnum):
    """``--group-by`` / config ``groupBy`` (upstream values)."""

    NUMANODE = "numanode"
    SOCKET = "socket"
    MACHINE = "machine"


AttributeValue = bool | int | str | tuple[str, ...]
"""A scalar attribute, or a list of strings (``strings``, the PCIe roots)."""


@dataclass(frozen=True, slots=True)
class Device:
    """One published device.

    ``cpus``: individual mode the one CPU; grouped mode the group's published (online,
    non-reserved) CPUs, isolated ones included. ``attributes`` are keyed by the qualified name
    as published; ``capacity`` is ``{"dra.cpu/cpu": n}`` for grouped devices, empty otherwise.
    """

    name: str
    cpus: CpuSet
    attributes: Mapping[str, AttributeValue]
    capacity: Mapping[str, int]
    grouped: bool


def published_devices(
    topology: Topology,
    *,
    reserved: CpuSet,
    mode: CpuDeviceMode,
    group_by: GroupBy,
    numbering: Mapping[int, int] | None = None,
    external: bool = False,
) -> list[Device]:
    """The devices this node publishes, in publication (and allocation priority) order.

    ``reserved`` CPUs are never published; reserved CPUs that are not online are ignored.
    ``group_by`` only matters in grouped mode. Devices carry ``pcieRoot`` when the topology has
    PCIe roots. ``numbering`` (individual mode): the device number of each CPU, from
    :func:`individual_numbering`; ``None``: upstream's enumeration of this topology.
    ``external`` (``allocator: external``): grouped devices also carry ``dra.cpu/cpuIDs`` and
    ``dra.cpu/smtLayout`` (:mod:`dracpu.core.external_attributes`). Raises
    :class:`TopologyError` when a device would carry more attribute values than the apiserver
    accepts (a machine with that many PCIe roots).
    """
    allocatable = topology.online - reserved
    roots = _PcieRoots(topology.pcie_roots)
    if CpuDeviceMode(mode) is CpuDeviceMode.INDIVIDUAL:
        return _individual_devices(topology, allocatable, roots, numbering)
    layout = smt_layout(topology) if external else None
    return _grouped_devices(topology, allocatable, GroupBy(group_by), roots, external, layout)


def individual_numbering(
    topology: Topology, *, reserved: CpuSet, previous: Mapping[int, int] | None = None
) -> dict[int, int]:
    """The number of each CPU's individual device (``cpudevNNN``).

    Without ``previous``: upstream's enumeration of the published CPUs (the module docstring).
    With ``previous``, the numbering of the devices published before by this process (a SIGHUP
    that found CPUs offline, online or no longer reserved): a CPU keeps the number it had, so
    that a device name never changes its CPU while the scheduler's allocations name it; a CPU
    numbered for the first time gets the next number after every number given so far, in
    upstream's order. The result keeps every entry of ``previous``, published now or not: a CPU
    that comes back gets its name back, and no number is given twice.
    """
    order = _individual_order(topology, topology.online - reserved)
    if not previous:
        return {cpu: number for number, cpu in enumerate(order)}
    numbering = dict(previous)
    following = max(numbering.values(), default=-1) + 1
    for cpu in order:
        if cpu not in numbering:
            numbering[cpu] = following
            following += 1
    return numbering


def devices_by_name(devices: Iterable[Device]) -> dict[str, Device]:
    """Index devices by name (what Prepare needs to turn an allocation into CPUs)."""
    return {device.name: device for device in devices}


def _individual_order(topology: Topology, allocatable: CpuSet) -> list[int]:
    """The CPUs of ``cpudev000``, ``cpudev001``, ... in that order (see the module docstring).

    Upstream ``cpuDeviceInfos`` over the CPUs ``populateTopologyInfo`` keeps (those with a NUMA
    node), with the siblings of ``populateCpuSiblings``: a (socket, cluster, core_id) key held by
    exactly two such CPUs, reserved ones included, pairs them.
    """
    published = topology.online - topology.without_numa_node
    holders: dict[tuple[int, int, int], list[int]] = {}
    for cpu in published:
        info = topology.cpus[cpu]
        holders.setdefault((info.socket_id, info.cluster_id, info.core_id), []).append(cpu)
    sibling: dict[int, int] = {}
    for pair in holders.values():
        if len(pair) == 2:
            first, second = pair
            sibling[first], sibling[second] = second, first
    order: list[int] = []
    numbered: set[int] = set()
    for cpu in published & allocatable:
        if cpu in numbered:
            continue
        order.append(cpu)
        other = sibling.get(cpu)
        if other is not None and other in allocatable:
            order.append(other)
            numbered.add(other)
    return order


class _PcieRoots:
    """The PCIe roots local to a CPU, or to any CPU of a group (upstream
    ``addPCIeRootsAttribute``: a union for groups), as the sorted names ``pcieRoot`` lists."""

    __slots__ = ("_by_cpu", "_roots")

    def __init__(self, roots: Mapping[str, CpuSet]) -> None:
        self._roots = roots
        self._by_cpu: dict[int, tuple[str, ...]] | None = None  # built for the first CPU asked

    def of_cpu(self, cpu: int) -> tuple[str, ...]:
        if self._by_cpu is None:
            by_cpu: dict[int, list[str]] = {}
            for name, local in self._roots.items():  # sorted by name (Topology)
                for member in local:
                    by_cpu.setdefault(member, []).append(name)
            self._by_cpu = {member: tuple(names) for member, names in by_cpu.items()}
        return self._by_cpu.get(cpu, ())

    def of_group(self, cpus: CpuSet) -> tuple[str, ...]:
        return tuple(name for name, local in self._roots.items() if not local.isdisjoint(cpus))


def _add_pcie_roots(
    name: str, attributes: dict[str, AttributeValue], roots: tuple[str, ...], later: int = 1
) -> None:
    """Add ``pcieRoot`` (when there are roots) after the upstream attributes already there;
    ``later``: how many scalar attributes are added after it."""
    if not roots:
        return
    attributes[ATTR_PCIE_ROOT] = roots
    values = len(attributes) - 1 + len(roots) + later
    if values > MAX_ATTRIBUTE_VALUES_PER_DEVICE:
        raise TopologyError(
            f"device {name}: {len(roots)} PCIe roots are local to its CPUs, which makes "
            f"{values} attribute values; the API server accepts at most "
            f"{MAX_ATTRIBUTE_VALUES_PER_DEVICE} per device: turn --expose-pcie-roots off or "
            "use smaller groups (--group-by numanode)"
        )


def cpu_attributes(topology: Topology, cpu: int) -> dict[str, AttributeValue]:
    """The topology attributes of one CPU, in upstream's order: what its individual-mode
    device publishes before ``pcieRoot`` and ours (also the per-CPU entries of a grouped
    claim's device metadata, :mod:`dracpu.core.device_metadata`)."""
    info = topology.info(cpu)
    return {
        ATTR_NUMA_NODE: info.numa_node,
        ATTR_SOCKET_ID: info.socket_id,
        ATTR_SMT_ENABLED: topology.smt_enabled,
        ATTR_CACHE_L3_ID: NO_L3_CACHE if info.l3_id is None else info.l3_id,
        ATTR_CORE_TYPE: info.core_type.value,
        ATTR_CORE_ID: info.core_id,
        ATTR_CPU_ID: cpu,
        ATTR_LEGACY_NUMA_NODE_ID: info.numa_node,
        ATTR_DRANET_NUMA_NODE: info.numa_node,
    }


def _individual_devices(
    topology: Topology,
    allocatable: CpuSet,
    roots: _PcieRoots,
    numbering: Mapping[int, int] | None,
) -> list[Device]:
    isolated = topology.isolated
    order = _individual_order(topology, allocatable)
    if numbering is None:
        numbered = list(enumerate(order))
    else:
        missing = [cpu for cpu in order if cpu not in numbering]
        if missing:
            raise TopologyError(f"cpus {CpuSet(missing)} have no individual device number")
        numbered = sorted((numbering[cpu], cpu) for cpu in order)
    devices: list[Device] = []
    for index, cpu in numbered:
        name = f"{_PREFIX_CPU}{index:03d}"
        attributes = cpu_attributes(topology, cpu)
        _add_pcie_roots(name, attributes, roots.of_cpu(cpu))
        attributes[ATTR_ISOLATED] = cpu in isolated
        devices.append(
            Device(
                name=name,
                cpus=CpuSet.from_mask(1 << cpu),
                attributes=attributes,
                capacity={},
                grouped=False,
            )
        )
    return devices


def _grouped_device(
    name: str,
    cpus: CpuSet,
    topology: Topology,
    roots: _PcieRoots,
    leading: Mapping[str, AttributeValue],
    trailing: Mapping[str, AttributeValue] | None = None,
    *,
    external: bool = False,
    layout: str | None = None,
) -> Device:
    n = len(cpus)
    attributes: dict[str, AttributeValue] = dict(leading)
    attributes[ATTR_SMT_ENABLED] = topology.smt_enabled
    attributes[ATTR_NUM_CPUS] = n
    attributes.update(trailing or {})
    extra = external_attributes(cpus, layout) if external else {}
    _add_pcie_roots(name, attributes, roots.of_group(cpus), later=1 + len(extra))
    attributes.update(extra)
    attributes[ATTR_NUM_ISOLATED_CPUS] = len(cpus & topology.isolated)
    return Device(
        name=name, cpus=cpus, attributes=attributes, capacity={CAPACITY_CPU: n}, grouped=True
    )


def _grouped_devices(
    topology: Topology,
    allocatable: CpuSet,
    group_by: GroupBy,
    roots: _PcieRoots,
    external: bool,
    layout: str | None,
) -> list[Device]:
    devices: list[Device] = []
    if group_by is GroupBy.MACHINE:
        # Upstream builds the machine group from the online list, NUMA node or not.
        machine = _grouped_device(
            _NAME_MACHINE, allocatable, topology, roots, {}, external=external, layout=layout
        )
        return [machine]
    with_numa = allocatable - topology.without_numa_node
    if group_by is GroupBy.SOCKET:
        for socket_id, members in topology.sockets.items():
            cpus = members & with_numa
            if cpus:
                name = f"{_PREFIX_SOCKET}{socket_id:03d}"
                leading = {ATTR_SOCKET_ID: socket_id}
                device = _grouped_device(
                    name, cpus, topology, roots, leading, external=external, layout=layout
                )
                devices.append(device)
        return devices
    for numa_id, members in topology.numa_nodes.items():
        cpus = members & with_numa
        if not cpus:
            continue
        # Upstream: "All CPUs in a NUMA node belong to the same socket"; take the lowest's.
        socket_id = topology.info(cpus.min()).socket_id
        leading = {ATTR_NUMA_NODE: numa_id, ATTR_SOCKET_ID: socket_id}
        legacy = {ATTR_LEGACY_NUMA_NODE_ID: numa_id, ATTR_DRANET_NUMA_NODE: numa_id}
        name = f"{_PREFIX_NUMA}{numa_id:03d}"
        devices.append(
            _grouped_device(
                name, cpus, topology, roots, leading, legacy, external=external, layout=layout
            )
        )
    return devices
