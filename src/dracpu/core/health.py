"""Device health (KEP-4680): which published devices are healthy, judged by the online CPUs.

Pure: the devices as published (:class:`~dracpu.core.slices.Device`, each with its CPUs), the
CPUs online now, the previous assessment and the time go in; the health of every device comes
out, in the devices' order. :mod:`dracpu.tasks.device_health` keeps it current and streams it to
the kubelet.

A device is UNHEALTHY when a CPU it was published with is not online any more (taken offline,
or hot-removed), with a message naming those CPUs; otherwise HEALTHY. In each mode:

* individual (``cpudevNNN``): the device's one CPU is offline;
* grouped (``cpudevnumaNNN``, ``cpudevsocketNNN``, ``cpudevmachine``): a CPU the group counted
  in its ``dra.cpu/cpu`` capacity is offline.

Offline CPUs are never published (:func:`dracpu.core.slices.published_devices` builds devices
from the online CPUs only), so devices built from a fresh topology are all HEALTHY: a machine
booted with ``nosmt``, or with CPUs taken offline on purpose, has no unhealthy device. A device
turns UNHEALTHY when one of its CPUs goes offline while it stays published, and HEALTHY again
when the CPU comes back. Publishing the devices again from a topology read after the change
ends it the other way: the individual device of an offline CPU no longer exists (the kubelet,
told the complete list, takes a device left out for Unknown after its timeout), and a group
comes back HEALTHY with a smaller capacity.

``since``: the Unix time (seconds) at which the device's health (status or message) last
changed, or at which the device was first assessed: ``DeviceHealth.last_updated_time`` of the
kubelet's API.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from dracpu.core.cpuset import CpuSet
from dracpu.core.slices import Device

__all__ = [
    "MAX_MESSAGE_CHARS",
    "DeviceHealth",
    "HealthStatus",
    "assess",
    "offline_message",
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
    text = f"cpu {cpus} is offline" if len(cpus) == 1 else f"cpus {cpus} are offline"
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - len(_ELLIPSIS)] + _ELLIPSIS
    return text


def assess(
    devices: Iterable[Device],
    online: CpuSet,
    *,
    now: int,
    previous: Iterable[DeviceHealth] = (),
) -> tuple[DeviceHealth, ...]:
    """The health of ``devices`` (in their order) with the ``online`` CPUs online, at Unix
    second ``now``. A device whose status and message are those of its entry in ``previous``
    keeps that entry's ``since``; any other gets ``now``."""
    before = {health.device: health for health in previous}
    assessed: list[DeviceHealth] = []
    for device in devices:
        lost = device.cpus - online
        if lost:
            status, message = HealthStatus.UNHEALTHY, offline_message(lost)
        else:
            status, message = HealthStatus.HEALTHY, ""
        old = before.get(device.name)
        unchanged = old is not None and old.status is status and old.message == message
        since = old.since if old is not None and unchanged else now
        assessed.append(DeviceHealth(device.name, status, message, since))
    return tuple(assessed)
