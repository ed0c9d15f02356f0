"""Device health (KEP-4680): which published devices are healthy, judged by the online CPUs and
the claims' file problems.

Pure: the devices as published (:class:`~dracpu.core.devices.Device`, each with its CPUs), the
CPUs online now, the previous assessment and the time go in; the health of every device comes
out, in the devices' order (:func:`assess`). A device is UNHEALTHY when a CPU it was published
with is not online any more, or while a prepared claim it was allocated to has a file that
could not be written (:func:`claim_device_problems`), with the reason in the message.
:func:`reported_devices` says which devices the kubelet is told about after a SIGHUP (those of
CPUs that went offline while a claim held them stay). ``since`` is the Unix time of the
device's last change, the kubelet's ``DeviceHealth.last_updated_time``.
:mod:`dracpu.tasks.device_health` keeps it current and streams it; the rules are
``docs/architecture.md``, "Device health".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from types import MappingProxyType

from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import Device
from dracpu.core.node_config import NodeConfig

__all__ = [
    "MAX_MESSAGE_CHARS",
    "DeviceHealth",
    "HealthStatus",
    "assess",
    "claim_device_problems",
    "offline_message",
    "reported_devices",
]

# k8s.io/kubelet pkg/apis/dra-health/v1/api.proto DeviceHealth.message: "Maximum length is 1024
# characters. Messages longer than 1024 characters will be truncated to 1021 characters with
# '...' appended." We cut the same way, so the kubelet shows what we send.
MAX_MESSAGE_CHARS = 1024
_ELLIPSIS = "..."


class HealthStatus(StrEnum):
    """What we say of a device (the kubelet's ``HealthStatus`` without ``UNKNOWN``, which is the
    kubelet's verdict on a device it has not heard about in time). The values are the kubelet's
    own words for them (``pkg/kubelet/cm/dra/state`` ``DeviceHealthStatus``)."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    """The health of one published device: its name, status, message (empty when healthy) and
    the Unix second of its last change (see the module docstring)."""

    device: str
    status: HealthStatus
    message: str
    since: int


def offline_message(cpus: CpuSet) -> str:
    """Why a device is unhealthy: ``"cpu 5 is offline"``, ``"cpus 5,7-9 are offline"`` (the
    Linux list syntax), cut to :data:`MAX_MESSAGE_CHARS` as the kubelet would."""
    return _cut(f"cpu {cpus} is offline" if len(cpus) == 1 else f"cpus {cpus} are offline")


def _cut(text: str) -> str:
    if len(text) > MAX_MESSAGE_CHARS:
        return text[: MAX_MESSAGE_CHARS - len(_ELLIPSIS)] + _ELLIPSIS
    return text


def claim_device_problems(
    config: NodeConfig, claims: Mapping[str, PreparedClaim], problems: Mapping[str, str]
) -> dict[str, str]:
    """``problems`` (claim UID → why its files could not be written) by device: the devices of
    each prepared claim's results, or for a claim without results (adopted from its CDI spec)
    the published devices holding its CPUs; a device of several such claims gets their
    messages joined, each naming its claim."""
    by_device: dict[str, list[str]] = {}
    for uid in sorted(problems):
        claim = claims.get(uid)
        if claim is None:
            continue
        if claim.results:
            names = {result.device for result in claim.results}
        else:
            names = {n for n, d in config.devices.items() if not d.cpus.isdisjoint(claim.cpus)}
        for name in sorted(names):
            by_device.setdefault(name, []).append(f"claim {uid}: {problems[uid]}")
    return {name: "; ".join(messages) for name, messages in by_device.items()}


def assess(
    devices: Iterable[Device],
    online: CpuSet,
    *,
    now: int,
    previous: Iterable[DeviceHealth] = (),
    problems: Mapping[str, str] = MappingProxyType({}),
) -> tuple[DeviceHealth, ...]:
    """The health of ``devices`` (in their order) with the ``online`` CPUs online and the
    claims' file ``problems`` by device (:func:`claim_device_problems`), at Unix second
    ``now``. A device whose status and message are those of its entry in ``previous`` keeps
    that entry's ``since``; any other gets ``now``."""
    before = {health.device: health for health in previous}
    assessed: list[DeviceHealth] = []
    for device in devices:
        lost = device.cpus - online
        reasons = [offline_message(lost)] if lost else []
        if device.name in problems:
            reasons.append(problems[device.name])
        if reasons:
            status, message = HealthStatus.UNHEALTHY, _cut("; ".join(reasons))
        else:
            status, message = HealthStatus.HEALTHY, ""
        old = before.get(device.name)
        unchanged = old is not None and old.status is status and old.message == message
        since = old.since if old is not None and unchanged else now
        assessed.append(DeviceHealth(device.name, status, message, since))
    return tuple(assessed)


def reported_devices(
    devices: Iterable[Device], held: Mapping[str, CpuSet], claimed: CpuSet
) -> tuple[Device, ...]:
    """The devices whose health the kubelet is told: ``devices`` (the published ones, in their
    order), each with the ``held`` CPUs a claim still holds (``claimed``) added to its CPUs,
    then the held devices that are not published while a claim holds one of their CPUs (by
    name; such a device carries only its name and those CPUs)."""
    if not held:
        return tuple(devices)
    reported: list[Device] = []
    seen: set[str] = set()
    for device in devices:
        seen.add(device.name)
        lost = held.get(device.name, _NONE) & claimed
        reported.append(replace(device, cpus=device.cpus | lost) if lost else device)
    for name in sorted(held.keys() - seen):
        lost = held[name] & claimed
        if lost:
            reported.append(Device(name, lost, {}, {}, grouped=False))
    return tuple(reported)


_NONE = CpuSet()
