"""The devices this node publishes and the ``resource.k8s.io/v1`` ResourceSlices that carry them.

Pure: a :class:`~dracpu.core.topology.Topology` and the reserved CPUs go in, plain ``dict``
objects ready for ``json.dumps`` (or the API) come out. Names, numbering, attributes and capacity
are the compatibility contract of the Go driver ``kubernetes-sigs/dra-driver-cpu``
(``pkg/device/builder.go``, ``pkg/device/attributes.go``, ``pkg/cpuinfo/cpuinfo.go``): a user who
swaps it for dracpu keeps their DeviceClasses and ResourceClaimTemplates, and a claim allocated
against its slices names the same CPUs in ours. ``docs/devices.md`` explains each rule and lists
where we deliberately differ.

Which CPUs are published: the online, non-reserved ones. Upstream skips a CPU the kernel links
to no NUMA node (``populateTopologyInfo`` fails for it), so such a CPU is in no individual, NUMA
or socket device; only ``cpudevmachine`` (built from the ``online`` list) counts it. It stays in
our shared pool.

Individual mode (``cpudev000``, ``cpudev001``, ...): one device per published CPU. The number is
an enumeration index, not the CPU id (upstream ``cpuDeviceInfos``): CPUs sharing
(``physical_package_id``, ``cluster_id``, ``core_id``) are siblings when there are exactly two of
them (``populateCpuSiblings``: the key has no die, and 3+ threads pair nobody); in ascending CPU
order each CPU not yet numbered gets the next number and its sibling, unless reserved, the one
after. Three digits, more from 1000 devices on (Go's ``%03d`` only pads).

Grouped mode: one device per NUMA node (``cpudevnuma000``, the NUMA id), per socket
(``cpudevsocket000``, the socket id) or one for the machine (``cpudevmachine``), with capacity
``dra.cpu/cpu`` = the group's published CPUs and ``allowMultipleAllocations: true``. A NUMA node
or socket with no such CPU is not published; ``cpudevmachine`` always is. The capacity carries a
``requestPolicy`` that upstream does not: whole CPUs (``validRange {min: 1, step: 1}``), so the
scheduler rounds ``1500m`` up to 2 instead of allocating a fraction that Prepare must refuse, and
``default`` = the whole capacity, so a request without ``capacity.requests`` consumes the whole
group exactly as it does without a policy (KEP-5075: no policy means full capacity).

``dra.cpu/cacheL3ID`` is ``-1`` for a CPU without a level-3 cache (upstream ``UncoreCacheID``).

``--expose-pcie-roots`` adds ``resource.kubernetes.io/pcieRoot`` (KEP-4381 standard attribute,
list-typed: ``DRAListTypeAttributes``): the sorted names of the PCIe root complexes local to the
device's CPUs (a group: local to any of them), omitted when there are none, and slices hold at
most 64 devices whether or not a device has the attribute (upstream
``Config.DevicesPerResourceSlice``). ``publishNodeAllocatableResourceMapping`` adds KEP-5517's
``nodeAllocatableResources``: ``cpu`` mapped from the consumed ``dra.cpu/cpu`` capacity (grouped)
or one CPU per device (individual).

Our additions to the upstream attributes:

* ``dra.cpu/isolated`` (bool) on **every** individual device, ``true`` on the kernel's isolated
  CPUs (``isolcpus``). Present on every device so a selector is a plain
  ``device.attributes["dra.cpu"].isolated`` / ``!device.attributes["dra.cpu"].isolated``: a CEL
  selector that reads an absent attribute is an evaluation error, not ``false``.
* ``dra.cpu/numIsolatedCPUs`` (int) on every grouped device. Isolated CPUs are part of their
  group: they count in ``dra.cpu/cpu`` and ``dra.cpu/numCPUs`` and can be handed out to exclusive
  claims like any other CPU (they never join the shared pool). The attribute only says how many
  of the group's CPUs are isolated, so a claim can avoid (``== 0``) or look for such groups.

Attribute keys are the full qualified names (``dra.cpu/socketID``), as upstream publishes them;
in CEL they are grouped by domain (``device.attributes["dra.cpu"].socketID``).

Slices: one pool named after the node, devices chunked in order into slices of at most 128
devices (64 when a device has a list-typed attribute, taints or counter consumption: the
apiserver's ``ResourceSliceMaxDevicesWithAdvancedFeatures``; 64 always with
``--expose-pcie-roots``), every slice carrying the same ``generation`` and
``resourceSliceCount``. Slice names are fixed (``<node>-dra.cpu-000``, ``-001``, ...), so a
publisher can GET/PUT each slice by name and repair it in place; the index is zero-padded so that
name order (the scheduler's first-fit order) is device order. No device still gives one empty
slice (upstream publishes none): an empty pool says "nothing here", no pool says "unknown".

:func:`validate_slice` re-checks a ResourceSlice object against the apiserver's own rules
(``pkg/apis/resource/validation``), for our tests and the simulator's fake API server.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from typing import Any

from dracpu.core.cpuset import CpuSet
from dracpu.core.quantity import parse_quantity
from dracpu.core.topology import Topology
from dracpu.errors import ConfigError, QuantityError, TopologyError

__all__ = [
    "API_VERSION",
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
    "KIND",
    "MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE",
    "MAX_ATTRIBUTE_VALUES_PER_DEVICE",
    "MAX_DEVICES_PER_SLICE",
    "MAX_DEVICES_PER_SLICE_ADVANCED",
    "NO_L3_CACHE",
    "CpuDeviceMode",
    "Device",
    "GroupBy",
    "SliceOptions",
    "build_resource_slices",
    "cpu_attributes",
    "devices_by_name",
    "max_devices_per_slice",
    "published_devices",
    "slice_name",
    "validate_pool",
    "validate_slice",
    "wire_attribute",
]

# --- names of the compatibility contract (upstream pkg/device/attributes.go, builder.go) --------

DRIVER_NAME = "dra.cpu"  # upstream cmd/dracpu/app.go driverName; also the DeviceClass name
API_VERSION = "resource.k8s.io/v1"  # the GA DRA API, the one upstream publishes
KIND = "ResourceSlice"

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

# KEP-5517 (k8s.io/api resource/v1 NodeAllocatableMapping, 1.37 shape): the node resource our
# devices are, and the multiplier: one consumed dra.cpu/cpu, or one individual device, is one
# cpu (upstream groupedCPUNodeAllocatable / individualCPUNodeAllocatable).
_NODE_RESOURCE_CPU = "cpu"
_ONE = "1"

# --- apiserver limits (k8s.io/api resource/v1 types.go) ----------------------------------------

MAX_DEVICES_PER_SLICE = 128  # ResourceSliceMaxDevices
MAX_DEVICES_PER_SLICE_ADVANCED = 64  # ResourceSliceMaxDevicesWithAdvancedFeatures (1.36+)
MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
MAX_ATTRIBUTE_VALUES_PER_DEVICE = 48  # ResourceSliceMaxAttributeValuesPerDevice (1.36+)
_MAX_ID_LENGTH = 32  # DeviceMaxIDLength: the C-identifier part of a qualified name
_MAX_DOMAIN_LENGTH = 63  # DeviceMaxDomainLength = DriverNameMaxLength
_MAX_ATTRIBUTE_VALUE_LENGTH = 64  # DeviceAttributeMaxValueLength (string and version values)
_MAX_DNS_SUBDOMAIN = 253  # validation.DNS1123SubdomainMaxLength: object, node and pool names
_MAX_DNS_LABEL = 63  # validation.DNS1123LabelMaxLength: device names
_MAX_TAINTS = 16  # DeviceTaintsMaxLength (1.35+)
_MAX_VALID_VALUES = 10  # CapacityRequestPolicyDiscreteMaxOptions
_LIST_ATTRIBUTE_TYPES = ("ints", "bools", "strings", "versions")  # DRAListTypeAttributes (1.36)
_SCALAR_ATTRIBUTE_TYPES = ("int", "bool", "string", "version")
_LIST_KEYS = frozenset(_LIST_ATTRIBUTE_TYPES)
# A str of at most this many characters is within the 64-byte limit whatever its encoding
# (UTF-8 needs at most 4 bytes per character).
_MAX_ASCII_FAST = _MAX_ATTRIBUTE_VALUE_LENGTH // 4
# The node resources a device may map (core helper IsNodeAllocatableResourceName).
_NODE_ALLOCATABLE_NAMES = frozenset({"cpu", "memory"})
_HUGEPAGES_PREFIX = "hugepages-"

# Slice names: "<node>-dra.cpu-NNN". The index is padded to 3 digits: 16384 CPUs (CpuSet's
# MAX_CPU_ID + 1) in slices of 64 need 256 slices, so name order is numeric order.
_SLICE_SUFFIX = f"-{DRIVER_NAME}-"
_SLICE_INDEX_WIDTH = 3
_NODE_HASH_LENGTH = 10  # hex digits of sha256(node) kept when a long node name is shortened

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL_RE = re.compile(rf"^{_DNS_LABEL}$")
_DNS_SUBDOMAIN_RE = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_C_IDENTIFIER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Semantic Versioning 2.0.0, as the apiserver's semverRe.
_SEMVER_RE = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?$"
)


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


@dataclass(frozen=True, slots=True)
class SliceOptions:
    """What upstream's publication switches add to the slices (not to the devices' CPUs).

    ``node_allocatable``: config ``publishNodeAllocatableResourceMapping`` (KEP-5517
    ``nodeAllocatableResources`` on every device; the cluster needs the alpha
    ``DRANodeAllocatableResources`` gate, an apiserver without it drops the field).
    ``expose_pcie_roots``: ``--expose-pcie-roots``; the list-typed ``pcieRoot`` attribute comes
    with the devices (read from sysfs into the topology), this caps slices at 64 devices.
    """

    node_allocatable: bool = False
    expose_pcie_roots: bool = False


# --- devices -------------------------------------------------------------------------------------


def published_devices(
    topology: Topology, *, reserved: CpuSet, mode: CpuDeviceMode, group_by: GroupBy
) -> list[Device]:
    """The devices this node publishes, in publication (and allocation priority) order.

    ``reserved`` CPUs are never published; reserved CPUs that are not online are ignored.
    ``group_by`` only matters in grouped mode. Devices carry ``pcieRoot`` when the topology has
    PCIe roots. Raises :class:`TopologyError` when a device would carry more attribute values
    than the apiserver accepts (a machine with that many PCIe roots).
    """
    allocatable = topology.online - reserved
    roots = _PcieRoots(topology.pcie_roots)
    if CpuDeviceMode(mode) is CpuDeviceMode.INDIVIDUAL:
        return _individual_devices(topology, allocatable, roots)
    return _grouped_devices(topology, allocatable, GroupBy(group_by), roots)


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
    name: str, attributes: dict[str, AttributeValue], roots: tuple[str, ...]
) -> None:
    """Add ``pcieRoot`` (when there are roots) after the upstream attributes already there."""
    if not roots:
        return
    attributes[ATTR_PCIE_ROOT] = roots
    values = len(attributes) - 1 + len(roots) + 1  # + ours, added after
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


def _individual_devices(topology: Topology, allocatable: CpuSet, roots: _PcieRoots) -> list[Device]:
    isolated = topology.isolated
    devices: list[Device] = []
    for index, cpu in enumerate(_individual_order(topology, allocatable)):
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
) -> Device:
    n = len(cpus)
    attributes: dict[str, AttributeValue] = dict(leading)
    attributes[ATTR_SMT_ENABLED] = topology.smt_enabled
    attributes[ATTR_NUM_CPUS] = n
    attributes.update(trailing or {})
    _add_pcie_roots(name, attributes, roots.of_group(cpus))
    attributes[ATTR_NUM_ISOLATED_CPUS] = len(cpus & topology.isolated)
    return Device(
        name=name, cpus=cpus, attributes=attributes, capacity={CAPACITY_CPU: n}, grouped=True
    )


def _grouped_devices(
    topology: Topology, allocatable: CpuSet, group_by: GroupBy, roots: _PcieRoots
) -> list[Device]:
    devices: list[Device] = []
    if group_by is GroupBy.MACHINE:
        # Upstream builds the machine group from the online list, NUMA node or not.
        return [_grouped_device(_NAME_MACHINE, allocatable, topology, roots, {})]
    with_numa = allocatable - topology.without_numa_node
    if group_by is GroupBy.SOCKET:
        for socket_id, members in topology.sockets.items():
            cpus = members & with_numa
            if cpus:
                name = f"{_PREFIX_SOCKET}{socket_id:03d}"
                leading = {ATTR_SOCKET_ID: socket_id}
                devices.append(_grouped_device(name, cpus, topology, roots, leading))
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
        devices.append(_grouped_device(name, cpus, topology, roots, leading, legacy))
    return devices


# --- slices --------------------------------------------------------------------------------------


def slice_name(node_name: str, index: int) -> str:
    """The fixed name of slice ``index`` of this node's pool: ``<node>-dra.cpu-000``.

    A node name too long to fit in 253 characters with the suffix is shortened and made unique
    again with a hash of the full name.
    """
    suffix = f"{_SLICE_SUFFIX}{index:0{_SLICE_INDEX_WIDTH}d}"
    if len(node_name) + len(suffix) <= _MAX_DNS_SUBDOMAIN:
        return node_name + suffix
    digest = hashlib.sha256(node_name.encode()).hexdigest()[:_NODE_HASH_LENGTH]
    keep = _MAX_DNS_SUBDOMAIN - len(suffix) - 1 - _NODE_HASH_LENGTH
    return f"{node_name[:keep].rstrip('.-')}-{digest}{suffix}"


def wire_attribute(value: AttributeValue) -> dict[str, Any]:
    """An attribute value as a ``DeviceAttribute`` of the API (``{"int": 3}``, ...)."""
    if isinstance(value, bool):  # before int: bool is an int in Python
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, tuple):
        return {"strings": list(value)}
    return {"string": value}


def _wire_device(
    device: Device, consumable_capacity: bool, node_allocatable: bool
) -> dict[str, Any]:
    wire: dict[str, Any] = {
        "name": device.name,
        "attributes": {key: wire_attribute(value) for key, value in device.attributes.items()},
    }
    if device.capacity:
        capacity: dict[str, Any] = {}
        for key, amount in device.capacity.items():
            entry: dict[str, Any] = {"value": str(amount)}
            if consumable_capacity and device.grouped and amount >= 1:
                entry["requestPolicy"] = _request_policy(amount)
            capacity[key] = entry
        wire["capacity"] = capacity
    if device.grouped:
        wire["allowMultipleAllocations"] = True
    if node_allocatable:
        mapping = (
            {"capacityKey": CAPACITY_CPU, "capacityMultiplier": _ONE}
            if device.grouped
            else {"deviceMultiplier": _ONE}
        )
        wire["nodeAllocatableResources"] = {_NODE_RESOURCE_CPU: {"mapping": mapping}}
    return wire


def _request_policy(amount: int) -> dict[str, Any]:
    """Whole CPUs; the whole group by default (KEP-5075 CapacityRequestPolicy).

    ``default`` is the full capacity: what the scheduler consumes for a request without
    ``capacity.requests`` when there is no policy at all (upstream publishes none), and the API
    requires a default next to ``validRange``. ``step`` is left out when the group has a single
    CPU: the apiserver requires ``min + step <= value``. An empty group (``cpudevmachine`` with
    every CPU reserved) gets no policy at all, since ``min`` may not exceed the value.
    """
    valid_range: dict[str, str] = {"min": _ONE}
    if amount >= 2:
        valid_range["step"] = _ONE
    return {"default": str(amount), "validRange": valid_range}


def max_devices_per_slice(wire_devices: Iterable[Mapping[str, Any]]) -> int:
    """128, or 64 when any device uses an "advanced feature" (list-typed attribute, taints,
    counter consumption): the apiserver's per-slice limit for these devices."""
    for device in wire_devices:
        if device.get("taints") or device.get("consumesCounters"):
            return MAX_DEVICES_PER_SLICE_ADVANCED
        for attribute in (device.get("attributes") or {}).values():
            # type() first: the ABC isinstance check is slow on 1000-device pools
            if (type(attribute) is dict or isinstance(attribute, Mapping)) and not (
                _LIST_KEYS.isdisjoint(attribute)
            ):
                return MAX_DEVICES_PER_SLICE_ADVANCED
    return MAX_DEVICES_PER_SLICE


def build_resource_slices(
    node_name: str,
    devices: Sequence[Device],
    *,
    options: SliceOptions = SliceOptions(),
    consumable_capacity: bool = True,
    generation: int = 1,
    owner_uid: str | None = None,
) -> list[dict[str, Any]]:
    """The complete ResourceSlice objects of this node's pool, in order.

    ``options``: upstream's publication switches (:class:`SliceOptions`).
    ``consumable_capacity=False`` leaves ``requestPolicy`` out (clusters whose apiserver drops
    it). ``owner_uid`` is the Node's UID: the slices get the Node as controller owner so they are
    garbage-collected with it. No devices still gives one (empty) slice: an empty pool tells the
    scheduler this node has nothing, where no pool would mean "unknown".
    """
    errors = _node_name_errors(node_name)
    if errors:
        raise ConfigError(f"invalid node name {node_name!r}: {errors[0]}")
    if generation < 0:
        raise ConfigError(f"invalid pool generation {generation}: must be >= 0")
    wire_devices = [
        _wire_device(device, consumable_capacity, options.node_allocatable) for device in devices
    ]
    per_slice = (
        MAX_DEVICES_PER_SLICE_ADVANCED
        if options.expose_pcie_roots
        else max_devices_per_slice(wire_devices)
    )
    chunks = [wire_devices[i : i + per_slice] for i in range(0, len(wire_devices), per_slice)]
    if not chunks:
        chunks = [[]]
    slices: list[dict[str, Any]] = []
    for index, chunk in enumerate(chunks):
        metadata: dict[str, Any] = {"name": slice_name(node_name, index)}
        if owner_uid is not None:
            metadata["ownerReferences"] = [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": node_name,
                    "uid": owner_uid,
                    "controller": True,
                }
            ]
        slices.append(
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "metadata": metadata,
                "spec": {
                    "driver": DRIVER_NAME,
                    "nodeName": node_name,
                    "pool": {
                        "name": node_name,
                        "generation": generation,
                        "resourceSliceCount": len(chunks),
                    },
                    "devices": chunk,
                },
            }
        )
    return slices


# --- validation (the apiserver's rules, pkg/apis/resource/validation/validation.go) -------------


def _dns_subdomain_errors(value: str) -> list[str]:
    if not value:
        return ["must not be empty"]
    if len(value) > _MAX_DNS_SUBDOMAIN:
        return [f"must be no more than {_MAX_DNS_SUBDOMAIN} characters"]
    if not _DNS_SUBDOMAIN_RE.match(value):
        return ["must be a lowercase RFC 1123 subdomain"]
    return []


def _node_name_errors(value: object) -> list[str]:
    if not isinstance(value, str):
        return ["must be a string"]
    return _dns_subdomain_errors(value)


def _driver_name_errors(value: object) -> list[str]:
    """ValidateCSIDriverName: <= 63 characters, a DNS subdomain once lowercased."""
    if not isinstance(value, str) or not value:
        return ["must be a non-empty string"]
    if len(value) > _MAX_DOMAIN_LENGTH:
        return [f"must be no more than {_MAX_DOMAIN_LENGTH} characters"]
    if not _DNS_SUBDOMAIN_RE.match(value.lower()):
        return ["must be an RFC 1123 subdomain"]
    return []


@functools.lru_cache(maxsize=1024)
def _qualified_name_errors(name: str) -> tuple[str, ...]:
    """validateQualifiedName: ``<C identifier>`` or ``<domain>/<C identifier>``.

    Cached: a slice repeats the same few names on every device."""
    domain, slash, ident = name.rpartition("/")
    errors: list[str] = []
    if slash:
        if "/" in domain:
            errors.append("must contain at most one '/'")
        elif not domain:
            errors.append("the domain must not be empty")
        else:
            errors.extend(f"domain {e}" for e in _driver_name_errors(domain))
    if not ident:
        errors.append("the name must not be empty")
    else:
        if len(ident) > _MAX_ID_LENGTH:
            errors.append(f"name must be no more than {_MAX_ID_LENGTH} characters")
        if not _C_IDENTIFIER_RE.match(ident):
            errors.append("name must be a C identifier ([A-Za-z_][A-Za-z0-9_]*)")
    return tuple(errors)


def _parse_quantity(value: object) -> Fraction | None:
    """The exact value of a quantity; None when it is not one (the callers word the error)."""
    try:
        return parse_quantity(value)
    except QuantityError:
        return None


def _attribute_errors(path: str, attribute: object) -> tuple[list[str], int]:
    """Errors of one DeviceAttribute and how many values it holds."""
    if type(attribute) is dict and len(attribute) == 1:  # fast path: a well-formed scalar
        ((kind, value),) = attribute.items()
        if (
            (kind == "int" and type(value) is int)
            or (kind == "bool" and type(value) is bool)
            or (kind == "string" and type(value) is str and len(value) <= _MAX_ASCII_FAST)
        ):
            return [], 1
    if not isinstance(attribute, Mapping):
        return [f"{path}: must be an object"], 0
    present = [k for k in (*_SCALAR_ATTRIBUTE_TYPES, *_LIST_ATTRIBUTE_TYPES) if k in attribute]
    unknown = sorted(set(attribute) - set(_SCALAR_ATTRIBUTE_TYPES) - set(_LIST_ATTRIBUTE_TYPES))
    errors = [f"{path}: unknown field {k!r}" for k in unknown]
    if len(present) != 1:
        errors.append(f"{path}: exactly one value must be specified, got {len(present)}")
        return errors, len(present)
    kind = present[0]
    value = attribute[kind]
    values = list(value) if kind in _LIST_ATTRIBUTE_TYPES and isinstance(value, list) else [value]
    if kind in _LIST_ATTRIBUTE_TYPES and (not isinstance(value, list) or not value):
        errors.append(f"{path}.{kind}: must be a non-empty list")
    element = kind.rstrip("s")
    for item in values:
        if element == "int" and (not isinstance(item, int) or isinstance(item, bool)):
            errors.append(f"{path}.{kind}: {item!r} is not an integer")
        elif element == "bool" and not isinstance(item, bool):
            errors.append(f"{path}.{kind}: {item!r} is not a boolean")
        elif element in ("string", "version"):
            if not isinstance(item, str):
                errors.append(f"{path}.{kind}: {item!r} is not a string")
            elif len(item.encode()) > _MAX_ATTRIBUTE_VALUE_LENGTH:
                errors.append(
                    f"{path}.{kind}: must be no more than {_MAX_ATTRIBUTE_VALUE_LENGTH} bytes"
                )
            elif element == "version" and not _SEMVER_RE.match(item):
                errors.append(f"{path}.{kind}: {item!r} is not a semantic version")
    return errors, len(values)


def _request_policy_errors(path: str, capacity: Fraction, policy: object) -> list[str]:
    if not isinstance(policy, Mapping):
        return [f"{path}: must be an object"]
    errors: list[str] = []
    default: Fraction | None = None
    if "default" in policy:
        try:
            default = parse_quantity(policy["default"])
        except QuantityError as exc:
            errors.append(f"{path}.default: {exc}")
    valid_values = policy.get("validValues")
    valid_range = policy.get("validRange")
    if valid_values and valid_range is not None:
        return [*errors, f"{path}: cannot specify both validValues and validRange"]
    if valid_values:
        if default is None:
            return [*errors, f"{path}.default: required when validValues is defined"]
        options = [_parse_quantity(v) for v in valid_values]
        if any(o is None for o in options):
            return [*errors, f"{path}.validValues: every value must be a quantity"]
        if len(options) > _MAX_VALID_VALUES:
            errors.append(f"{path}.validValues: must have at most {_MAX_VALID_VALUES} entries")
        if options != sorted(options):  # type: ignore[type-var]
            errors.append(f"{path}.validValues: must be sorted in ascending order")
        if any(o > capacity for o in options if o is not None):
            errors.append(f"{path}.validValues: an option is larger than the capacity value")
        if default not in options:
            errors.append(f"{path}.default: must be one of validValues")
    elif valid_range is not None:
        if default is None:
            return [*errors, f"{path}.default: required when validRange is defined"]
        if not isinstance(valid_range, Mapping) or "min" not in valid_range:
            return [*errors, f"{path}.validRange.min: required when validRange is defined"]
        bounds = {
            k: _parse_quantity(valid_range[k]) for k in ("min", "max", "step") if k in valid_range
        }
        if any(v is None for v in bounds.values()):
            return [*errors, f"{path}.validRange: min, max and step must be quantities"]
        low, high, step = bounds["min"], bounds.get("max"), bounds.get("step")
        assert low is not None
        if low > capacity:
            errors.append(f"{path}.validRange.min: larger than the capacity value")
        if default < low:
            errors.append(f"{path}.validRange.min: default is less than min")
        if high is not None:
            if low > high:
                errors.append(f"{path}.validRange.max: min is larger than max")
            if high > capacity:
                errors.append(f"{path}.validRange.max: larger than the capacity value")
            if default > high:
                errors.append(f"{path}.validRange.max: default is more than max")
        if step is not None:
            if step <= 0:
                errors.append(f"{path}.validRange.step: must be positive")
            else:
                if low + step > capacity:
                    errors.append(f"{path}.validRange.step: one step is larger than the capacity")
                for what, value in (("default", default), ("max", high)):
                    if value is not None and (value - low) % step:
                        errors.append(f"{path}.validRange.step: {what} is not min + n * step")
    return errors


def _device_errors(path: str, device: object) -> list[str]:
    if not isinstance(device, Mapping):
        return [f"{path}: must be an object"]
    errors: list[str] = []
    name = device.get("name")
    if not isinstance(name, str) or len(name) > _MAX_DNS_LABEL or not _DNS_LABEL_RE.match(name):
        errors.append(f"{path}.name: {name!r} is not a DNS label (RFC 1123, <= 63 characters)")
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if not isinstance(attributes, Mapping) or not isinstance(capacity, Mapping):
        return [*errors, f"{path}: attributes and capacity must be objects"]
    total = len(attributes) + len(capacity)
    if total > MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE:
        errors.append(
            f"{path}: {total} attributes and capacities, at most "
            f"{MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE} allowed"
        )
    values = 0
    for key, attribute in attributes.items():
        errors.extend(f"{path}.attributes[{key}]: {e}" for e in _qualified_name_errors(str(key)))
        attribute_errors, count = _attribute_errors(f"{path}.attributes[{key}]", attribute)
        errors.extend(attribute_errors)
        values += count
    if values > MAX_ATTRIBUTE_VALUES_PER_DEVICE:
        errors.append(
            f"{path}: {values} attribute values, at most {MAX_ATTRIBUTE_VALUES_PER_DEVICE} allowed"
        )
    multi = device.get("allowMultipleAllocations") is True
    for key, entry in capacity.items():
        where = f"{path}.capacity[{key}]"
        errors.extend(f"{where}: {e}" for e in _qualified_name_errors(str(key)))
        if not isinstance(entry, Mapping):
            errors.append(f"{where}: must be an object")
            continue
        try:
            value = parse_quantity(entry.get("value"))
        except QuantityError as exc:
            errors.append(f"{where}.value: {exc}")
            continue
        if "requestPolicy" in entry:
            if not multi:
                errors.append(f"{where}.requestPolicy: allowMultipleAllocations must be true")
            else:
                errors.extend(
                    _request_policy_errors(f"{where}.requestPolicy", value, entry["requestPolicy"])
                )
    taints = device.get("taints") or []
    if len(taints) > _MAX_TAINTS:
        errors.append(f"{path}.taints: at most {_MAX_TAINTS} allowed")
    if "nodeAllocatableResources" in device:
        errors.extend(
            _node_allocatable_errors(
                f"{path}.nodeAllocatableResources", device["nodeAllocatableResources"], capacity
            )
        )
    return errors


def _positive_quantity_errors(path: str, value: object) -> list[str]:
    try:
        amount = parse_quantity(value)
    except QuantityError as exc:
        return [f"{path}: {exc}"]
    return [] if amount > 0 else [f"{path}: must be positive"]


def _node_allocatable_errors(
    path: str, resources: object, capacity: Mapping[str, Any]
) -> list[str]:
    """validateNodeAllocatableResources (KEP-5517, 1.37 shape): node resource names as keys, a
    ``mapping`` and/or an ``overhead`` each; a mapping names either an existing capacity with a
    positive ``capacityMultiplier`` or a positive ``deviceMultiplier``."""
    if not isinstance(resources, Mapping):
        return [f"{path}: must be an object"]
    errors: list[str] = []
    for name, resource in resources.items():
        where = f"{path}[{name}]"
        if name not in _NODE_ALLOCATABLE_NAMES and not str(name).startswith(_HUGEPAGES_PREFIX):
            errors.append(f"{where}: must be a node allocatable resource name")
        if not isinstance(resource, Mapping):
            errors.append(f"{where}: must be an object")
            continue
        mapping, overhead = resource.get("mapping"), resource.get("overhead")
        if mapping is None and overhead is None:
            errors.append(f"{where}: at least one of mapping or overhead must be set")
        if mapping is not None:
            errors.extend(_mapping_errors(f"{where}.mapping", mapping, capacity))
        if overhead is not None:
            if not isinstance(overhead, Mapping) or not (
                "perPod" in overhead or "perContainer" in overhead
            ):
                errors.append(f"{where}.overhead: at least one of perPod or perContainer")
                continue
            for key in ("perPod", "perContainer"):
                if key in overhead:
                    amount = _parse_quantity(overhead[key])
                    if amount is None or amount < 0:
                        errors.append(f"{where}.overhead.{key}: must be a quantity >= 0")
    return errors


def _mapping_errors(path: str, mapping: object, capacity: Mapping[str, Any]) -> list[str]:
    if not isinstance(mapping, Mapping):
        return [f"{path}: must be an object"]
    key = mapping.get("capacityKey")
    set_fields = [k for k in ("capacityKey", "deviceMultiplier") if mapping.get(k) is not None]
    if len(set_fields) != 1:
        return [f"{path}: exactly one of capacityKey or deviceMultiplier is required"]
    if key is not None:
        errors: list[str] = []
        if key not in capacity:
            errors.append(f"{path}.capacityKey: {key!r} is not a capacity of the device")
        if "capacityMultiplier" not in mapping:
            errors.append(f"{path}.capacityMultiplier: required when capacityKey is set")
        else:
            where = f"{path}.capacityMultiplier"
            errors.extend(_positive_quantity_errors(where, mapping["capacityMultiplier"]))
        return errors
    if "capacityMultiplier" in mapping:
        return [f"{path}.capacityKey: required when capacityMultiplier is set"]
    return _positive_quantity_errors(f"{path}.deviceMultiplier", mapping["deviceMultiplier"])


def validate_slice(obj: Mapping[str, Any]) -> list[str]:
    """The apiserver's create-time checks of one ResourceSlice; an empty list means valid.

    Covers what the OpenAPI schema does not: name syntax, device and attribute limits, qualified
    names, attribute values and capacity request policies. Pair it with a schema check.
    """
    errors: list[str] = []
    if obj.get("apiVersion") != API_VERSION:
        errors.append(f"apiVersion: must be {API_VERSION!r}, got {obj.get('apiVersion')!r}")
    if obj.get("kind") != KIND:
        errors.append(f"kind: must be {KIND!r}, got {obj.get('kind')!r}")
    metadata = obj.get("metadata")
    if not isinstance(metadata, Mapping):
        errors.append("metadata: required")
    elif "name" in metadata:
        errors.extend(f"metadata.name: {e}" for e in _node_name_errors(metadata["name"]))
    elif "generateName" not in metadata:
        errors.append("metadata.name: name or generateName is required")
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        return [*errors, "spec: required"]
    errors.extend(f"spec.driver: {e}" for e in _driver_name_errors(spec.get("driver")))
    pool = spec.get("pool")
    if not isinstance(pool, Mapping):
        errors.append("spec.pool: required")
    else:
        pool_name = pool.get("name")
        if not isinstance(pool_name, str) or not pool_name:
            errors.append("spec.pool.name: required")
        elif len(pool_name) > _MAX_DNS_SUBDOMAIN:
            errors.append(f"spec.pool.name: must be no more than {_MAX_DNS_SUBDOMAIN} characters")
        else:
            for part in pool_name.split("/"):
                errors.extend(f"spec.pool.name: {e}" for e in _dns_subdomain_errors(part))
        generation = pool.get("generation")
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            errors.append(f"spec.pool.generation: {generation!r} must be an integer >= 0")
        count = pool.get("resourceSliceCount")
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            errors.append(f"spec.pool.resourceSliceCount: {count!r} must be an integer > 0")
    selectors = [
        k
        for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
        if spec.get(k) not in (None, "")
    ]
    if len(selectors) != 1:
        errors.append(
            "spec: exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection "
            f"is required, got {selectors or 'none'}"
        )
    if "nodeName" in spec:
        errors.extend(f"spec.nodeName: {e}" for e in _node_name_errors(spec["nodeName"]))
    for flag in ("allNodes", "perDeviceNodeSelection"):
        if flag in spec and spec[flag] is not True:
            errors.append(f"spec.{flag}: must be either unset or true")
    devices = spec.get("devices")
    if devices is not None and spec.get("sharedCounters") is not None:
        errors.append("spec: only one of sharedCounters or devices is allowed")
    devices = devices or []
    if not isinstance(devices, list):
        return [*errors, "spec.devices: must be a list"]
    limit = max_devices_per_slice(d for d in devices if isinstance(d, Mapping))
    if len(devices) > limit:
        return [*errors, f"spec.devices: {len(devices)} devices, at most {limit} allowed"]
    seen: set[object] = set()
    for i, device in enumerate(devices):
        errors.extend(_device_errors(f"spec.devices[{i}]", device))
        name = device.get("name") if isinstance(device, Mapping) else None
        if name in seen:
            errors.append(f"spec.devices[{i}].name: duplicate device name {name!r}")
        seen.add(name)
    return errors


def validate_pool(slices: Sequence[Mapping[str, Any]]) -> list[str]:
    """Checks across the slices of one pool: same driver, pool and generation, a
    ``resourceSliceCount`` equal to the number of slices, unique slice and device names."""
    errors: list[str] = []
    if not slices:
        return ["pool: no slices"]
    specs = [s.get("spec") or {} for s in slices]
    for key in ("driver", "nodeName"):
        values = {spec.get(key) for spec in specs}
        if len(values) != 1:
            errors.append(f"pool: slices disagree on spec.{key}: {sorted(map(str, values))}")
    pools = [spec.get("pool") or {} for spec in specs]
    for key in ("name", "generation", "resourceSliceCount"):
        values = {p.get(key) for p in pools}
        if len(values) != 1:
            errors.append(f"pool: slices disagree on spec.pool.{key}: {sorted(map(str, values))}")
    counts = {p.get("resourceSliceCount") for p in pools}
    if counts != {len(slices)}:
        errors.append(
            f"pool: resourceSliceCount {sorted(map(str, counts))} but {len(slices)} slices"
        )
    names = [(s.get("metadata") or {}).get("name") for s in slices]
    if len(set(names)) != len(names):
        errors.append("pool: duplicate slice names")
    seen: set[object] = set()
    for spec in specs:
        for device in spec.get("devices") or []:
            name = device.get("name")
            if name in seen:
                errors.append(f"pool: device {name!r} is published twice")
            seen.add(name)
    return errors
