"""The ``resource.k8s.io/v1`` ResourceSlices that carry this node's devices.

Pure: the :class:`~dracpu.core.devices.Device` values of :mod:`dracpu.core.devices` go in, plain
``dict`` objects ready for ``json.dumps`` (or the API) come out.

Slices: one pool named after the node, devices chunked in order into slices of at most 128
devices (64 when a device has a list-typed attribute, taints or counter consumption: the
apiserver's ``ResourceSliceMaxDevicesWithAdvancedFeatures``; 64 always with
``--expose-pcie-roots``), every slice carrying the same ``generation`` and
``resourceSliceCount``. Slice names are fixed (``<node>-dra.cpu-000``, ``-001``, ...), so a
publisher can GET/PUT each slice by name and repair it in place; the index is zero-padded so that
name order (the scheduler's first-fit order) is device order. No device still gives one empty
slice (upstream publishes none): an empty pool says "nothing here", no pool says "unknown".

This module also re-exports the names of :mod:`dracpu.core.devices` and
:mod:`dracpu.core.slice_validation`, so ``from dracpu.core.slices import ...`` keeps working for
every public name of the three.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dracpu.core.devices import (
    ATTR_CACHE_L3_ID,
    ATTR_CORE_ID,
    ATTR_CORE_TYPE,
    ATTR_CPU_ID,
    ATTR_DRANET_NUMA_NODE,
    ATTR_ISOLATED,
    ATTR_LEGACY_NUMA_NODE_ID,
    ATTR_NUM_CPUS,
    ATTR_NUM_ISOLATED_CPUS,
    ATTR_NUMA_NODE,
    ATTR_PCIE_ROOT,
    ATTR_SMT_ENABLED,
    ATTR_SOCKET_ID,
    CAPACITY_CPU,
    DRIVER_NAME,
    NO_L3_CACHE,
    AttributeValue,
    CpuDeviceMode,
    Device,
    GroupBy,
    cpu_attributes,
    devices_by_name,
    individual_numbering,
    published_devices,
)
from dracpu.core.slice_validation import (
    API_VERSION,
    KIND,
    MAX_ATTRIBUTE_VALUES_PER_DEVICE,
    MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE,
    MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_ADVANCED,
    MAX_DNS_SUBDOMAIN,
    max_devices_per_slice,
    node_name_errors,
    validate_pool,
    validate_slice,
)
from dracpu.errors import ConfigError

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
    "AttributeValue",
    "CAPACITY_CPU",
    "CpuDeviceMode",
    "DRIVER_NAME",
    "Device",
    "GroupBy",
    "KIND",
    "MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE",
    "MAX_ATTRIBUTE_VALUES_PER_DEVICE",
    "MAX_DEVICES_PER_SLICE",
    "MAX_DEVICES_PER_SLICE_ADVANCED",
    "NO_L3_CACHE",
    "SliceOptions",
    "build_resource_slices",
    "cpu_attributes",
    "devices_by_name",
    "individual_numbering",
    "max_devices_per_slice",
    "published_devices",
    "slice_name",
    "validate_pool",
    "validate_slice",
    "wire_attribute",
]

# KEP-5517 (k8s.io/api resource/v1 NodeAllocatableMapping, 1.37 shape): the node resource our
# devices are, and the multiplier: one consumed dra.cpu/cpu, or one individual device, is one
# cpu (upstream groupedCPUNodeAllocatable / individualCPUNodeAllocatable).
_NODE_RESOURCE_CPU = "cpu"
_ONE = "1"

# Slice names: "<node>-dra.cpu-NNN". The index is padded to 3 digits: 16384 CPUs (CpuSet's
# MAX_CPU_ID + 1) in slices of 64 need 256 slices, so name order is numeric order.
_SLICE_SUFFIX = f"-{DRIVER_NAME}-"
_SLICE_INDEX_WIDTH = 3
_NODE_HASH_LENGTH = 10  # hex digits of sha256(node) kept when a long node name is shortened


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


# --- slices --------------------------------------------------------------------------------------


def slice_name(node_name: str, index: int) -> str:
    """The fixed name of slice ``index`` of this node's pool: ``<node>-dra.cpu-000``.

    A node name too long to fit in 253 characters with the suffix is shortened and made unique
    again with a hash of the full name.
    """
    suffix = f"{_SLICE_SUFFIX}{index:0{_SLICE_INDEX_WIDTH}d}"
    if len(node_name) + len(suffix) <= MAX_DNS_SUBDOMAIN:
        return node_name + suffix
    digest = hashlib.sha256(node_name.encode()).hexdigest()[:_NODE_HASH_LENGTH]
    keep = MAX_DNS_SUBDOMAIN - len(suffix) - 1 - _NODE_HASH_LENGTH
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
    errors = node_name_errors(node_name)
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
