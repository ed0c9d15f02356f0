"""The fake API server's reading of the rules the API server applies to ResourceSlice objects
(``k8s.io/api`` resource/v1 ``types.go`` limits, ``pkg/apis/resource/validation/validation.go``,
apimachinery's quantity grammar), beyond the OpenAPI schema
(:mod:`dracpu.sim.apiserver_validation`).

Written for the simulator from those sources, sharing no code with :mod:`dracpu.core`, which
builds the slices these rules check: a mistake in the daemon's reading of a limit cannot hide
behind the same mistake here. :func:`validate_slice` checks one slice, :func:`validate_pool` the
slices of one pool together.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

__all__ = ["quantity_value", "validate_pool", "validate_slice"]

_API_VERSION = "resource.k8s.io/v1"
_KIND = "ResourceSlice"

# --- apiserver limits (k8s.io/api resource/v1 types.go) ----------------------------------------

_MAX_DEVICES_PER_SLICE = 128  # ResourceSliceMaxDevices
_MAX_DEVICES_PER_SLICE_ADVANCED = 64  # ResourceSliceMaxDevicesWithAdvancedFeatures (1.36+)
_MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
_MAX_ATTRIBUTE_VALUES_PER_DEVICE = 48  # ResourceSliceMaxAttributeValuesPerDevice (1.36+)
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


def _uses_advanced_features(device: Mapping[str, Any]) -> bool:
    """The apiserver's "advanced features" of a device: taints, counter consumption, or an
    attribute whose value is a list."""
    if device.get("taints") or device.get("consumesCounters"):
        return True
    attributes = device.get("attributes") or {}
    return any(
        isinstance(value, Mapping) and not _LIST_KEYS.isdisjoint(value)
        for value in attributes.values()
    )


def _max_devices_per_slice(wire_devices: Iterable[Mapping[str, Any]]) -> int:
    """The apiserver's per-slice limit: 64 devices when any uses an advanced feature, else
    128."""
    if any(_uses_advanced_features(device) for device in wire_devices):
        return _MAX_DEVICES_PER_SLICE_ADVANCED
    return _MAX_DEVICES_PER_SLICE


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


# apimachinery's quantity grammar (k8s.io/apimachinery/pkg/api/resource quantity.go): a signed
# decimal number, then a binary-SI or decimal-SI suffix or a decimal exponent.
_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)|[eE](?P<exponent>[+-]?[0-9]+))?"
)
_SUFFIXES: Mapping[str, Fraction] = {
    **{s: Fraction(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    "m": Fraction(1, 1000),
    **{s: Fraction(1000) ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
}
# A decimal exponent beyond this is out of the range the API server stores (an int64 of
# nano-units and the exponents of its inf.Dec scale); beyond it a Fraction would be huge.
_MAX_EXPONENT = 40
_MAX_QUANTITY_TEXT = 128


def quantity_value(value: object) -> Fraction | str:
    """The exact value of the quantity string ``value``, or why it is none."""
    if not isinstance(value, str):
        return f"{value!r} is not a quantity string"
    match = _QUANTITY.fullmatch(value) if len(value) <= _MAX_QUANTITY_TEXT else None
    if match is None:
        return f"{value!r} is not a Kubernetes quantity"
    exponent = int(match["exponent"] or 0)
    if abs(exponent) > _MAX_EXPONENT:
        return f"{value!r} is out of range: the decimal exponent must be within +-{_MAX_EXPONENT}"
    return (
        Fraction(match["number"])
        * _SUFFIXES.get(match["suffix"] or "", Fraction(1))
        * Fraction(10) ** exponent
    )


def _parse_quantity(value: object) -> Fraction | None:
    """The exact value of a quantity; None when it is not one (the callers word the error)."""
    parsed = quantity_value(value)
    return parsed if isinstance(parsed, Fraction) else None


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
        parsed = quantity_value(policy["default"])
        if isinstance(parsed, str):
            errors.append(f"{path}.default: {parsed}")
        else:
            default = parsed
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
    if total > _MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE:
        errors.append(
            f"{path}: {total} attributes and capacities, at most "
            f"{_MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE} allowed"
        )
    values = 0
    for key, attribute in attributes.items():
        errors.extend(f"{path}.attributes[{key}]: {e}" for e in _qualified_name_errors(str(key)))
        attribute_errors, count = _attribute_errors(f"{path}.attributes[{key}]", attribute)
        errors.extend(attribute_errors)
        values += count
    if values > _MAX_ATTRIBUTE_VALUES_PER_DEVICE:
        errors.append(
            f"{path}: {values} attribute values, at most {_MAX_ATTRIBUTE_VALUES_PER_DEVICE} allowed"
        )
    multi = device.get("allowMultipleAllocations") is True
    for key, entry in capacity.items():
        where = f"{path}.capacity[{key}]"
        errors.extend(f"{where}: {e}" for e in _qualified_name_errors(str(key)))
        if not isinstance(entry, Mapping):
            errors.append(f"{where}: must be an object")
            continue
        value = quantity_value(entry.get("value"))
        if isinstance(value, str):
            errors.append(f"{where}.value: {value}")
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
    amount = quantity_value(value)
    if isinstance(amount, str):
        return [f"{path}: {amount}"]
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
    if obj.get("apiVersion") != _API_VERSION:
        errors.append(f"apiVersion: must be {_API_VERSION!r}, got {obj.get('apiVersion')!r}")
    if obj.get("kind") != _KIND:
        errors.append(f"kind: must be {_KIND!r}, got {obj.get('kind')!r}")
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
    limit = _max_devices_per_slice(d for d in devices if isinstance(d, Mapping))
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
