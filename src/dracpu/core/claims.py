"""Reading a ResourceClaim for Prepare, and the status patch that records what we prepared.

Pure: a ``resource.k8s.io/v1`` ResourceClaim as a plain JSON ``dict`` (what
:meth:`dracpu.adapters.kube.KubeClient.get_resource_claim` returns) goes in; a
:class:`ClaimAllocation` or a patch ``dict`` comes out. Every problem is a
:class:`~dracpu.errors.ClaimError` naming the claim and the bad value.

:func:`read_claim` checks what the Go kubelet-plugin helper checks before it calls a driver
(``k8s.io/dynamic-resource-allocation/kubeletplugin``: the UID asked for, an allocated claim)
and what upstream's ``prepareGroupedResourceClaim`` checks per result, and reads how many CPUs
each grouped result consumes (``consumedCapacity``, as the scheduler's ``structured`` allocator
writes it); :func:`reserved_pods` the pods of ``status.reservedFor``;
:func:`device_status_patch` the JSON merge patch of ``status.devices`` that records the
prepared cpuset. The rules are ``docs/devices.md``, "What Prepare reads".
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dracpu import DRIVER_NAME
from dracpu.core.commands import DeviceResult
from dracpu.core.cpuset import MAX_CPU_ID, CpuSet
from dracpu.core.device_metadata import POD_CLAIM_NAME_ANNOTATION
from dracpu.core.quantity import parse_positive_whole
from dracpu.errors import ClaimError, QuantityError

__all__ = [
    "CAPACITY_CPU",
    "MAX_STATUS_DATA_BYTES",
    "AllocatedDevice",
    "ClaimAllocation",
    "OpaqueConfig",
    "device_status_patch",
    "parse_whole_quantity",
    "read_claim",
    "reserved_pods",
]

# The capacity grouped devices publish and allocations consume (upstream
# device.CPUResourceQualifiedName; dracpu.core.devices.CAPACITY_CPU), and its short form: an
# unqualified capacity name is in the driver's own domain (resource/v1 QualifiedName).
CAPACITY_CPU = "dra.cpu/cpu"
_CAPACITY_CPU_SHORT = CAPACITY_CPU.rpartition("/")[2]
# No claim can need more CPUs than a CpuSet can hold.
_MAX_CPUS = MAX_CPU_ID + 1
# resource/v1 AllocatedDeviceStatusDataMaxLength: the JSON of status.devices[].data.
MAX_STATUS_DATA_BYTES = 10 * 1024
# Grouped device names (upstream CPUDeviceNUMAGroupedPrefix, CPUDeviceSocketGroupedPrefix + %03d,
# CPUDeviceMachineGrouped); individual devices are "cpudev" + digits and never match.
_GROUPED_DEVICE = re.compile(r"^cpudev(numa\d+|socket\d+|machine)$")


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One allocation result of our driver in our pool.

    ``request``: the main request name (``req`` of ``req/sub``: the kubelet matches containers
    by main request names); ``subrequest``: ``sub`` of ``req/sub``, ``""`` for a top-level
    request (opaque configs may name either). ``share_id``: the result's ``shareID`` (grouped
    devices with consumable capacity). ``consumed_cpus``: ``consumedCapacity["dra.cpu/cpu"]``
    as a whole number, ``None`` when the result consumes no capacity (individual devices).
    """

    request: str
    pool: str
    device: str
    share_id: str | None = None
    consumed_cpus: int | None = None
    subrequest: str = ""

    @property
    def request_ref(self) -> str:
        """The result's ``request`` as the allocation spells it: ``req`` or ``req/sub``."""
        return f"{self.request}/{self.subrequest}" if self.subrequest else self.request


@dataclass(frozen=True, slots=True)
class OpaqueConfig:
    """An opaque config of our driver from ``status.allocation.devices.config`` (kept raw).

    ``source``: ``FromClaim`` or ``FromClass``; ``requests``: the requests it applies to (empty:
    all); ``parameters``: the JSON value as the server returned it; ``index``: its place in
    ``status.allocation.devices.config`` (error messages name it).
    :mod:`dracpu.core.claim_config` reads them.
    """

    source: str
    requests: tuple[str, ...]
    parameters: Any
    index: int = 0


@dataclass(frozen=True, slots=True)
class ClaimAllocation:
    """What Prepare needs from one ResourceClaim.

    ``pod_claim_name``: its ``resource.kubernetes.io/pod-claim-name`` annotation (a claim the
    resourceclaim controller made from a template), ``None`` without one."""

    uid: str
    namespace: str
    name: str
    resource_version: str
    devices: tuple[AllocatedDevice, ...]
    configs: tuple[OpaqueConfig, ...]
    pod_uids: frozenset[str] = frozenset()
    """The pods the claim is reserved for (:func:`reserved_pods`)."""
    pod_claim_name: str | None = None
    pod_names: frozenset[str] = frozenset()
    """The names of those pods (:func:`reserved_pods`)."""

    def device_results(self) -> tuple[DeviceResult, ...]:
        """The results as :class:`~dracpu.core.commands.PrepareClaim` takes them."""
        return tuple(
            DeviceResult(
                request=d.request, pool=d.pool, device=d.device, consumed_cpus=d.consumed_cpus
            )
            for d in self.devices
        )


def parse_whole_quantity(value: object) -> int:
    """A Kubernetes quantity that must be a whole number of CPUs from 1 to 16384.

    ``"2"``, ``"2000m"``, ``"+3"``, ``"1e1"`` are accepted; ``"0"``, ``"-1"``, ``"1.5"``,
    ``"500m"``, non-strings and amounts above 16384 raise :class:`ClaimError`
    (:func:`dracpu.core.quantity.parse_positive_whole`).
    """
    try:
        return parse_positive_whole(value, maximum=_MAX_CPUS, unit="CPUs")
    except QuantityError as exc:
        raise ClaimError(str(exc)) from exc


def _or_empty(value: object, empty: object) -> Any:
    """``value``, or ``empty`` when the field is absent or ``null`` (JSON omits empty lists)."""
    return empty if value is None else value


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def read_claim(
    claim: Mapping[str, Any], *, uid: str, pool: str, driver: str = DRIVER_NAME
) -> ClaimAllocation:
    """Our allocated devices and opaque configs of ``claim``, checked.

    ``uid`` is the UID the kubelet asked to prepare; ``pool`` is this node's pool (the node
    name). Raises :class:`ClaimError` when the claim was replaced (other UID), is not allocated,
    or a result of ours is malformed, in another pool, or consumes a capacity that is not a
    positive whole number of CPUs.
    """
    metadata = claim.get("metadata")
    if not isinstance(metadata, Mapping):
        raise ClaimError(f"claim {uid}: the object has no metadata")
    namespace, name = _text(metadata.get("namespace")), _text(metadata.get("name"))
    label = f"claim {namespace}/{name}"
    actual_uid = metadata.get("uid")
    if actual_uid != uid:
        raise ClaimError(f"{label} has UID {actual_uid!r}, expected {uid!r}: it was replaced")
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    if not isinstance(allocation, Mapping):
        raise ClaimError(f"{label} (UID {uid}) is not allocated")
    device_allocation = _or_empty(allocation.get("devices"), {})
    if not isinstance(device_allocation, Mapping):
        raise ClaimError(f"{label}: status.allocation.devices is not an object")
    results = _or_empty(device_allocation.get("results"), [])
    if not isinstance(results, list):
        raise ClaimError(f"{label}: status.allocation.devices.results is not a list")
    devices = tuple(
        device
        for index, result in enumerate(results)
        if (device := _our_result(label, index, result, driver=driver, pool=pool)) is not None
    )
    configs = _our_configs(label, _or_empty(device_allocation.get("config"), []), driver=driver)
    pods = reserved_pods(claim)
    return ClaimAllocation(
        uid=uid,
        namespace=namespace,
        name=name,
        resource_version=_text(metadata.get("resourceVersion")),
        devices=devices,
        configs=configs,
        pod_uids=frozenset(pods),
        pod_claim_name=_pod_claim_name(label, metadata.get("annotations")),
        pod_names=frozenset(name for name in pods.values() if name),
    )


def reserved_pods(claim: Mapping[str, Any]) -> dict[str, str]:
    """The pods ``claim`` is reserved for, UID to name (``""`` when an entry has none): its
    ``status.reservedFor`` entries (``ResourceClaimConsumerReference``) with ``resource: pods``
    and the core API group (``""`` or absent). Other consumers are not pods and run no
    container. Raises :class:`ClaimError` for a malformed list or a pod entry without a UID."""
    metadata = claim.get("metadata")
    label = "claim"
    if isinstance(metadata, Mapping):
        label = f"claim {_text(metadata.get('namespace'))}/{_text(metadata.get('name'))}"
    status = claim.get("status")
    entries = _or_empty(status.get("reservedFor") if isinstance(status, Mapping) else None, [])
    if not isinstance(entries, list):
        raise ClaimError(f"{label}: status.reservedFor is not a list")
    pods: dict[str, str] = {}
    for index, entry in enumerate(entries):
        where = f"{label}: status.reservedFor[{index}]"
        if not isinstance(entry, Mapping):
            raise ClaimError(f"{where} is not an object")
        if entry.get("resource") != "pods" or _or_empty(entry.get("apiGroup"), "") != "":
            continue
        pods[_required_text(where, entry, "uid")] = _text(entry.get("name"))
    return pods


def _pod_claim_name(label: str, annotations: object) -> str | None:
    """The claim's ``resource.kubernetes.io/pod-claim-name`` annotation, if it has one."""
    if not isinstance(annotations, Mapping):
        return None
    value = annotations.get(POD_CLAIM_NAME_ANNOTATION)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ClaimError(f"{label}: annotation {POD_CLAIM_NAME_ANNOTATION} is not a string")
    return value


_RESULT_KEYS = ("request", "pool", "device")


def _required_text(where: str, obj: Mapping[str, Any], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise ClaimError(f"{where}.{key}: {value!r} is not a non-empty string")
    return value


def _our_result(
    label: str, index: int, result: object, *, driver: str, pool: str
) -> AllocatedDevice | None:
    where = f"{label}: status.allocation.devices.results[{index}]"
    if not isinstance(result, Mapping):
        raise ClaimError(f"{where} is not an object")
    if result.get("driver") != driver:
        return None
    request, result_pool, device = (_required_text(where, result, k) for k in _RESULT_KEYS)
    if result_pool != pool:
        raise ClaimError(
            f"{where}: device {device!r} is in pool {result_pool!r}, not in this node's pool "
            f"{pool!r}: the claim was allocated for another node"
        )
    share_id = result.get("shareID")
    if share_id is not None and (not isinstance(share_id, str) or not share_id):
        raise ClaimError(f"{where}.shareID: {share_id!r} is not a non-empty string")
    consumed_cpus = _consumed_cpus(where, device, result.get("consumedCapacity"))
    main, _, subrequest = request.partition("/")
    return AllocatedDevice(
        request=main,
        pool=result_pool,
        device=device,
        share_id=share_id,
        consumed_cpus=consumed_cpus,
        subrequest=subrequest,
    )


def _consumed_cpus(where: str, device: str, consumed: object) -> int | None:
    """The CPUs a result consumes (see the module docstring); ``None`` for an individual device
    without them."""
    grouped = _GROUPED_DEVICE.match(device) is not None
    if consumed is None:
        if grouped:
            raise ClaimError(
                f"{where}: grouped device {device!r} has no consumedCapacity "
                "(does the cluster enable DRAConsumableCapacity?)"
            )
        return None
    if not isinstance(consumed, Mapping):
        raise ClaimError(f"{where}.consumedCapacity: {consumed!r} is not an object")
    found = [(key, consumed[key]) for key in (CAPACITY_CPU, _CAPACITY_CPU_SHORT) if key in consumed]
    if not found:
        if not grouped:
            return None
        raise ClaimError(f"{where}.consumedCapacity: no {CAPACITY_CPU!r} for {device!r}")
    amounts: list[int] = []
    for key, value in found:
        try:
            amounts.append(parse_whole_quantity(value))
        except ClaimError as exc:
            raise ClaimError(f"{where}.consumedCapacity[{key!r}] of {device!r}: {exc}") from None
    if len(set(amounts)) > 1:
        raise ClaimError(
            f"{where}.consumedCapacity of {device!r}: {CAPACITY_CPU!r} and "
            f"{_CAPACITY_CPU_SHORT!r} are the same capacity but differ: {found}"
        )
    return amounts[0]


def _our_configs(label: str, configs: object, *, driver: str) -> tuple[OpaqueConfig, ...]:
    if not isinstance(configs, list):
        raise ClaimError(f"{label}: status.allocation.devices.config is not a list")
    ours: list[OpaqueConfig] = []
    for index, config in enumerate(configs):
        where = f"{label}: status.allocation.devices.config[{index}]"
        if not isinstance(config, Mapping):
            raise ClaimError(f"{where} is not an object")
        opaque = config.get("opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        requests = _or_empty(config.get("requests"), [])
        if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
            raise ClaimError(f"{where}.requests: {requests!r} is not a list of strings")
        ours.append(
            OpaqueConfig(
                source=_text(config.get("source")),
                requests=tuple(requests),
                parameters=opaque.get("parameters"),
                index=index,
            )
        )
    return tuple(ours)


def _status_key(entry: Mapping[str, Any]) -> tuple[object, object, object, object]:
    """The list-map key of ``status.devices`` (driver, device, pool, shareID)."""
    return (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID"))


def device_status_patch(
    claim: Mapping[str, Any],
    allocation: ClaimAllocation,
    cpus: CpuSet | str,
    *,
    driver: str = DRIVER_NAME,
) -> dict[str, Any] | None:
    """The merge patch recording ``data: {"cpuset": ...}`` on our devices in
    ``status.devices``; ``None`` when we have no device in the claim.

    Other drivers' entries are kept as they are; our entries keep their other fields
    (``conditions``, ...). Raises :class:`ClaimError` if the data would exceed the server's
    10 KiB limit.
    """
    if not allocation.devices:
        return None
    data = {"cpuset": str(cpus)}
    if len(json.dumps(data, separators=(",", ":"))) > MAX_STATUS_DATA_BYTES:
        raise ClaimError(
            f"claim {allocation.namespace}/{allocation.name}: the cpuset is too long for "
            f"status.devices[].data (at most {MAX_STATUS_DATA_BYTES} bytes)"
        )
    wanted: dict[tuple[object, object, object, object], dict[str, Any]] = {}
    for device in allocation.devices:
        entry: dict[str, Any] = {"driver": driver, "pool": device.pool, "device": device.device}
        if device.share_id is not None:
            entry["shareID"] = device.share_id
        wanted[_status_key(entry)] = entry
    status = claim.get("status")
    existing = status.get("devices") if isinstance(status, Mapping) else None
    merged: list[dict[str, Any]] = []
    for old in existing if isinstance(existing, list) else []:
        if not isinstance(old, Mapping):
            continue
        key = _status_key(old)
        if key in wanted:
            merged.append({**old, **wanted.pop(key), "data": data})
        else:
            merged.append(dict(old))
    merged.extend({**entry, "data": data} for entry in wanted.values())
    patch: dict[str, Any] = {"status": {"devices": merged}}
    if allocation.resource_version:
        patch["metadata"] = {"resourceVersion": allocation.resource_version}
    return patch
