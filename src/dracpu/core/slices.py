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

What a publisher sends to keep the pool so (:func:`slice_writes`, :func:`next_generation`) is
here too, pure; the task that sends it is :mod:`dracpu.tasks.slice_publisher`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from dracpu.core.devices import (
    API_VERSION,
    CAPACITY_CPU,
    DRIVER_NAME,
    KIND,
    AttributeValue,
    Device,
)
from dracpu.errors import ConfigError

__all__ = [
    "MAX_DEVICES_PER_SLICE",
    "MAX_DEVICES_PER_SLICE_ADVANCED",
    "MAX_DNS_SUBDOMAIN",
    "SliceOptions",
    "SliceWrites",
    "build_resource_slices",
    "consumable_capacity_dropped",
    "max_devices_per_slice",
    "next_generation",
    "node_name_errors",
    "pool_content",
    "pool_generation",
    "slice_content",
    "slice_name",
    "slice_writes",
    "wire_attribute",
]

# The API server's limits the slices are built within (k8s.io/api resource/v1 types.go).
MAX_DEVICES_PER_SLICE = 128  # ResourceSliceMaxDevices
MAX_DEVICES_PER_SLICE_ADVANCED = 64  # ResourceSliceMaxDevicesWithAdvancedFeatures (1.36+)
MAX_DNS_SUBDOMAIN = 253  # validation.DNS1123SubdomainMaxLength: slice, node and pool names
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
# List-typed attribute values (DRAListTypeAttributes, 1.36): an "advanced feature".
_LIST_KEYS = frozenset(("ints", "bools", "strings", "versions"))

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


def max_devices_per_slice(wire_devices: Iterable[Mapping[str, Any]]) -> int:
    """128, or 64 when any device uses an "advanced feature" (list-typed attribute, taints,
    counter consumption): the API server's per-slice limit for these devices."""
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


def node_name_errors(value: object) -> list[str]:
    """Why ``value`` cannot name a node (and so a pool): a lowercase RFC 1123 subdomain of at
    most 253 characters."""
    if not isinstance(value, str):
        return ["must be a string"]
    if not value:
        return ["must not be empty"]
    if len(value) > MAX_DNS_SUBDOMAIN:
        return [f"must be no more than {MAX_DNS_SUBDOMAIN} characters"]
    if not _DNS_SUBDOMAIN.fullmatch(value):
        return ["must be a lowercase RFC 1123 subdomain"]
    return []


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


# --- the diff a publisher sends ------------------------------------------------------------------


def slice_content(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a slice the publisher owns and compares: its spec and owner references."""
    return {
        "spec": obj.get("spec"),
        "ownerReferences": (obj.get("metadata") or {}).get("ownerReferences"),
    }


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def pool_generation(obj: Mapping[str, Any]) -> int:
    """A slice's ``spec.pool.generation`` (0 when it has none that is a number)."""
    value = ((obj.get("spec") or {}).get("pool") or {}).get("generation")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def pool_content(slices: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What the pool says without its generation (compare, never send: shallow copies)."""
    contents = []
    for obj in slices:
        content = slice_content(obj)
        spec = dict(content["spec"])
        spec["pool"] = {k: v for k, v in spec["pool"].items() if k != "generation"}
        contents.append({**content, "spec": spec})
    return contents


def next_generation(current: int, highest: int, *, changed: bool) -> int:
    """The pool generation to publish: ``highest`` (of the slices found) + 1 at the first
    publication of this process (``current`` 0), so a restart never goes backwards; one more
    when the pool's content ``changed`` or a slice of ours carries a higher generation; else
    ``current``."""
    if current == 0:
        return highest + 1
    if changed or highest > current:
        return max(current, highest) + 1
    return current


@dataclass(frozen=True, slots=True)
class SliceWrites:
    """What to send so that the pool holds the wanted slices.

    ``delete``: the slices found that are not wanted (extra ones, another layout's names), in
    name order: delete each with its ``uid`` and ``resourceVersion`` as preconditions.
    ``write``: the wanted slices that are missing or differ, in pool order, each with the
    ``resourceVersion`` of the slice to update (``None``: create it).
    """

    delete: tuple[Mapping[str, Any], ...]
    write: tuple[tuple[dict[str, Any], str | None], ...]


def slice_writes(
    existing: Sequence[Mapping[str, Any]],
    wanted: Sequence[dict[str, Any]],
    stored: Mapping[str, tuple[Mapping[str, Any], Mapping[str, Any]]] = MappingProxyType({}),
) -> SliceWrites:
    """The diff between the slices ``existing`` on the server and the ``wanted`` ones.

    ``stored``: by slice name, what this publisher last sent and what the server stored in
    answer (its :func:`slice_content`): a wanted slice whose content is what was sent is
    expected to look as stored, so fields the server drops (or defaults) are no difference.
    """
    have = {_name(obj): obj for obj in existing}
    names = {_name(obj) for obj in wanted}
    delete = tuple(obj for name, obj in sorted(have.items()) if name not in names)
    write: list[tuple[dict[str, Any], str | None]] = []
    for want in wanted:
        current = have.get(_name(want))
        if current is None:
            write.append((want, None))
            continue
        content = slice_content(want)
        sent, answered = stored.get(_name(want), (None, None))
        expected = answered if sent == content else content
        if slice_content(current) != expected:
            version = (current.get("metadata") or {}).get("resourceVersion")
            write.append((want, str(version or "")))
    return SliceWrites(delete, tuple(write))


def consumable_capacity_dropped(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """Whether the API server dropped the consumable-capacity fields of a ResourceSlice.

    A server without the ``DRAConsumableCapacity`` feature (off by default before 1.36) silently
    strips ``allowMultipleAllocations`` and ``capacity[*].requestPolicy`` from the devices it
    stores; ``stored`` is the object it answered a create or update with.
    """
    stored_devices = {
        d.get("name"): d
        for d in (stored.get("spec") or {}).get("devices") or []
        if isinstance(d, Mapping)
    }
    for device in (sent.get("spec") or {}).get("devices") or []:
        if not isinstance(device, Mapping):
            continue
        kept = stored_devices.get(device.get("name"))
        if kept is None:
            continue
        if "allowMultipleAllocations" in device and "allowMultipleAllocations" not in kept:
            return True
        kept_capacity = kept.get("capacity") or {}
        for key, entry in (device.get("capacity") or {}).items():
            if (
                isinstance(entry, Mapping)
                and "requestPolicy" in entry
                and "requestPolicy" not in (kept_capacity.get(key) or {})
            ):
                return True
    return False
