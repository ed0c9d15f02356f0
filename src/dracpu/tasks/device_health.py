"""Device health for the kubelet (KEP-4680): the ``DRAResourceHealth`` service on the DRA socket.

Served in both versions the kubelet speaks, with the same messages (``k8s.io/kubelet``
``pkg/apis/dra-health/v1`` and ``v1alpha1``), through one :class:`HealthStreams`: every
``NodeWatchResources`` call gets the complete list of the node's devices at once, again on
every change of :class:`DeviceHealthBoard` (the seam: the devices and the claims' file problems
from the state owner, the online CPUs from :func:`watch_online`) and again after
:data:`RESEND_INTERVAL` without one, with ``health_check_timeout_seconds`` =
:data:`HEALTH_CHECK_TIMEOUT`; :meth:`HealthStreams.ending` ends every call with status OK
before the socket closes. What is unhealthy, and why the stream speaks when nothing changed,
are ``docs/architecture.md``, "Device health".
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import anyio
import anyio.to_thread
import betterproto2
import grpclib.const
import grpclib.server
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus

from dracpu._gen.dra_health import v1 as health_v1
from dracpu._gen.dra_health import v1alpha1 as health_v1alpha1
from dracpu.adapters.grpc_unix import (
    Encoded,
    StreamClosed,
    receive_request,
    with_stream_handlers,
)
from dracpu.adapters.sysfs import read_online
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import Device
from dracpu.core.health import DeviceHealth, HealthStatus, assess
from dracpu.errors import TopologyError

__all__ = [
    "END_TIMEOUT",
    "HEALTH_CHECK_TIMEOUT",
    "ONLINE_POLL_INTERVAL",
    "RESEND_INTERVAL",
    "DeviceHealthBoard",
    "HealthStreams",
    "ResourceHealthV1",
    "ResourceHealthV1alpha1",
    "health_response",
    "watch_online",
]

logger = logging.getLogger(__name__)

# Seconds after which the kubelet takes a device it has not heard about for Unknown, sent in
# every DeviceHealth.health_check_timeout_seconds. It is the kubelet's own default
# (pkg/kubelet/cm/dra/healthinfo.go DefaultHealthTimeout = 30 s), which 1.34 kubelets apply to
# every device since they do not know the field: every kubelet version treats us alike. With the
# list sent every RESEND_INTERVAL, the devices turn Unknown only when three resends in a row
# have not gone out: the daemon has stalled (or the kubelet has not read for that long).
HEALTH_CHECK_TIMEOUT = 30
# Seconds between two sends of an unchanged list: a third of HEALTH_CHECK_TIMEOUT, so that two
# resends delayed or lost on a busy node do not turn healthy devices Unknown.
RESEND_INTERVAL = HEALTH_CHECK_TIMEOUT / 3
# Seconds between two reads of <host-root>/sys/devices/system/cpu/online. CPU hotplug changes
# that file without a notification a watcher could wait for (poll() and inotify on sysfs only
# wake for attributes the kernel signals with sysfs_notify, which this one is not), so it is
# read again and again: one small file, in the event loop's worker thread.
ONLINE_POLL_INTERVAL = 1.0
# Seconds the stop of the DRA socket waits for the health calls to end with status OK before
# the server cancels them: each only has to hand its trailers to the transport.
END_TIMEOUT = 0.5


class DeviceHealthBoard:
    """The health of the published devices, and a signal when it changes: the seam between what
    knows the devices (:meth:`set_devices`: :class:`~dracpu.tasks.state_owner.StateOwner`
    whenever they change), what knows the online CPUs (:meth:`set_online`:
    :func:`watch_online`) and the health streams (:meth:`snapshot`, :meth:`wait_newer`).

    Each setter keeps the latest value of its side and assesses the devices again
    (:func:`dracpu.core.health.assess`); before the first :meth:`set_online` every published
    CPU counts as online. ``clock``: Unix time in seconds (``last_updated_time``). It may be
    made outside an event loop; the methods are called on the daemon's event loop.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._devices: tuple[Device, ...] = ()
        self._online: CpuSet | None = None
        self._problems: Mapping[str, str] = {}
        self._health: tuple[DeviceHealth, ...] = ()
        self._generation = 0
        self._changed: anyio.Event | None = None  # made by the first waiter (needs a loop)

    def set_devices(self, devices: Iterable[Device], *, online: CpuSet | None = None) -> None:
        """The devices to report now, each with the CPUs it stands for; ``online``: the online
        CPUs as a topology read just now found them (one assessment for both)."""
        self._devices = tuple(devices)
        if online is not None:
            self._online = online
        self._assess()

    def set_online(self, online: CpuSet) -> None:
        """The CPUs online now (read every second: the same value again costs nothing)."""
        if online == self._online:
            return
        self._online = online
        self._assess()

    def set_problems(self, problems: Mapping[str, str]) -> None:
        """Why claims' files could not be written, by device
        (:func:`dracpu.core.health.claim_device_problems`): those devices are unhealthy."""
        self._problems = problems
        self._assess()

    def _assess(self) -> None:
        online = self._online
        if online is None:
            online = CpuSet.union(device.cpus for device in self._devices)
        health = assess(
            self._devices,
            online,
            now=int(self._clock()),
            previous=self._health,
            problems=self._problems,
        )
        if health == self._health:
            return
        _log_changes(self._health, health)
        self._health = health
        self._generation += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def snapshot(self) -> tuple[int, tuple[DeviceHealth, ...]]:
        """The current generation (it grows with every change) and the devices' health."""
        return self._generation, self._health

    async def wait_newer(self, generation: int) -> None:
        """Return once the health is newer than ``generation`` (at once if it already is)."""
        while self._generation <= generation:
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()


def _log_changes(before: tuple[DeviceHealth, ...], after: tuple[DeviceHealth, ...]) -> None:
    """A device that turns unhealthy is a warning, one that recovers an info line."""
    old = {health.device: health for health in before}
    for health in after:
        previous = old.get(health.device)
        name = health.device
        if health.status is HealthStatus.UNHEALTHY:
            if previous is None or previous.message != health.message:
                logger.warning(
                    "device %s is unhealthy: %s", name, health.message, extra={"device": name}
                )
        elif previous is not None and previous.status is HealthStatus.UNHEALTHY:
            logger.info("device %s is healthy again", name, extra={"device": name})


async def watch_online(
    host_root: Path,
    board: DeviceHealthBoard,
    *,
    interval: float = ONLINE_POLL_INTERVAL,
    task_status: TaskStatus[None] = TASK_STATUS_IGNORED,
) -> None:
    """Tell ``board`` which CPUs are online (``<host_root>/sys``): once before it reports
    started, then every ``interval`` seconds until cancelled.

    Error handling: a file that cannot be read or parsed is logged (once until it reads again)
    and the last known online CPUs stay in force; it never ends the task.
    """
    failure = ""

    async def read() -> None:
        nonlocal failure
        try:
            online = await anyio.to_thread.run_sync(read_online, host_root)
        except TopologyError as exc:
            if str(exc) != failure:
                failure = str(exc)
                logger.warning("cannot read the online CPUs, device health unchanged: %s", exc)
            return
        if failure:
            failure = ""
            logger.info("the online CPUs can be read again: %s", online)
        board.set_online(online)

    await read()
    task_status.started()
    while True:
        await anyio.sleep(interval)
        await read()


def health_response(
    api: ModuleType, pool: str, health: Iterable[DeviceHealth]
) -> betterproto2.Message:
    """The ``NodeWatchResourcesResponse`` of ``api`` (the generated module of a version) listing
    ``health``, every device in pool ``pool``."""
    response: betterproto2.Message = api.NodeWatchResourcesResponse(
        devices=[
            api.DeviceHealth(
                device=api.DeviceIdentifier(pool_name=pool, device_name=entry.device),
                health=api.HealthStatus[entry.status.name],
                last_updated_time=entry.since,
                health_check_timeout_seconds=HEALTH_CHECK_TIMEOUT,
                message=entry.message,
            )
            for entry in health
        ]
    )
    return response


class HealthStreams:
    """The ``NodeWatchResources`` calls of both versions over one :class:`DeviceHealthBoard`.

    ``pool``: our pool's name (the node name). ``resend_interval``: seconds between two sends of
    an unchanged list; ``None``: :data:`RESEND_INTERVAL` as it is when the object is made (tests
    of the daemon process set the module's value).
    """

    def __init__(
        self,
        board: DeviceHealthBoard,
        pool: str,
        *,
        resend_interval: float | None = None,
    ) -> None:
        self._board = board
        self._pool = pool
        self._resend_interval = RESEND_INTERVAL if resend_interval is None else resend_interval
        self._ending = False
        self._waits: set[anyio.CancelScope] = set()  # the streams' waits for a change
        self._open = 0
        self._all_ended: anyio.Event | None = None
        # The newest list encoded, per version (the generated module): (generation, answer).
        self._encoded: dict[ModuleType, tuple[int, Encoded]] = {}

    @property
    def open_streams(self) -> int:
        """Calls being served now."""
        return self._open

    async def watch(self, stream: grpclib.server.Stream[Any, Any], api: ModuleType) -> None:
        """Serve one call in the version of ``api`` (the generated module) until the kubelet
        ends it, the server cancels it or :meth:`ending` ends it (status OK)."""
        await receive_request(stream)
        self._open += 1
        logger.info("the kubelet watches device health (%s)", api.__name__.rsplit(".", 1)[-1])
        try:
            while not self._ending:
                generation, health = self._board.snapshot()
                answer = await self._encode(api, generation, health)
                try:
                    await stream.send_message(answer)
                except StreamClosed:  # the kubelet went away before grpclib noticed
                    logger.debug("a device health stream was closed by the kubelet")
                    return
                with anyio.move_on_after(self._resend_interval) as wait:
                    self._waits.add(wait)
                    try:
                        if not self._ending:
                            await self._board.wait_newer(generation)
                    finally:
                        self._waits.discard(wait)
        finally:
            self._open -= 1
            if self._open == 0 and self._all_ended is not None:
                self._all_ended.set()

    async def _encode(
        self, api: ModuleType, generation: int, health: Iterable[DeviceHealth]
    ) -> Encoded:
        """The list of ``generation`` as ``api``'s answer, encoded once per change and version
        and sent as such every time: a node's list can hold a thousand devices, which
        betterproto2 encodes in pure Python. It encodes in a worker thread, so that the event
        loop goes on serving Prepare meanwhile."""
        cached = self._encoded.get(api)
        if cached is not None and cached[0] == generation:
            return cached[1]
        message = health_response(api, self._pool, health)
        data = await anyio.to_thread.run_sync(bytes, message, abandon_on_cancel=True)
        encoded = Encoded(api.NodeWatchResourcesResponse, data)
        cached = self._encoded.get(api)
        if cached is None or cached[0] < generation:
            self._encoded[api] = (generation, encoded)
        return encoded

    @asynccontextmanager
    async def ending(self) -> AsyncIterator[None]:
        """On exit (also by cancellation), end every call with status OK and wait for them (at
        most :data:`END_TIMEOUT` seconds); calls that arrive afterwards end at once."""
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                self._ending = True
                for wait in list(self._waits):
                    wait.cancel()
                if self._open:
                    self._all_ended = anyio.Event()
                    with anyio.move_on_after(END_TIMEOUT):
                        await self._all_ended.wait()
                if self._open:
                    logger.warning("%d device health streams did not end in time", self._open)


class _ResourceHealth:
    """One version of ``DRAResourceHealth`` over :class:`HealthStreams`: the generated
    service's method (path, message types) served by a stream handler of ours."""

    api: ClassVar[ModuleType]  # the generated module: dracpu._gen.dra_health.v1 or .v1alpha1

    def __init__(self, streams: HealthStreams) -> None:
        self._streams = streams

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        generated: dict[str, grpclib.const.Handler] = self.api.DraResourceHealthBase.__mapping__(
            self
        )
        return with_stream_handlers(generated, {"NodeWatchResources": self._watch})

    async def _watch(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await self._streams.watch(stream, self.api)


class ResourceHealthV1(_ResourceHealth, health_v1.DraResourceHealthBase):
    """``v1.DRAResourceHealth`` over :class:`HealthStreams`."""

    api: ClassVar[ModuleType] = health_v1


class ResourceHealthV1alpha1(_ResourceHealth, health_v1alpha1.DraResourceHealthBase):
    """``v1alpha1.DRAResourceHealth`` over :class:`HealthStreams`."""

    api: ClassVar[ModuleType] = health_v1alpha1
