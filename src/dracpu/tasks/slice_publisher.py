"""Publish this node's devices as ResourceSlices and keep them published.

The devices travel with each request on the ``requests`` stream (:class:`Republish`): the state
owner sends one at start and one per Resync. A pass lists our slices on this node and sends
what :func:`dracpu.core.slices.slice_writes` says (deletes, updates, creates; the pool
generation by :func:`~dracpu.core.slices.next_generation`); a watch on our slices wakes a pass
on drift (a kubelet restart wipes them), and API errors are retried with backoff, sooner while
the server is away. The rules (generation, the consumable-capacity fallback, drift, failures,
readiness) are ``docs/architecture.md``, "Publishing the slices".
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu import DRIVER_NAME
from dracpu.adapters.backoff import Health, Pause, RetryLog, backoff_delays
from dracpu.adapters.kube import LISTED, KubeClient
from dracpu.core.devices import Device
from dracpu.core.slices import (
    SliceOptions,
    build_resource_slices,
    consumable_capacity_dropped,
    next_generation,
    pool_content,
    pool_generation,
    slice_content,
    slice_writes,
)
from dracpu.errors import KubeAPIError, KubeNotFoundError

__all__ = [
    "DEFAULT_DEBOUNCE",
    "DEFAULT_RESYNC_INTERVAL",
    "DEFAULT_START_TIMEOUT",
    "UNAVAILABLE_RETRY_CAP",
    "PublisherSettings",
    "Republish",
    "republish_channel",
    "request_republish",
    "run",
]

logger = logging.getLogger(__name__)

# A burst of triggers (a kubelet wipe deletes every slice one by one) is handled by ONE pass:
# the publisher waits this long after the first trigger. The Go helper waits 30 s
# (DefaultSyncDelay); a node whose slices are gone gets no new pods, so we are quicker.
DEFAULT_DEBOUNCE = 0.2
# A full pass even without any event: a safety net against a watch that silently missed one.
DEFAULT_RESYNC_INTERVAL = 600.0
# started() at the latest after this long, even if the first pass still hangs on the network.
DEFAULT_START_TIMEOUT = 10.0
# Upstream's defaults: no node-allocatable mapping, no PCIe roots.
_UPSTREAM_DEFAULTS = SliceOptions()
# Pending republish requests kept; more are merged into the pending ones.
_REPUBLISH_BUFFER = 16
# A watch that failed again within this long of its start continues its backoff; one that ran
# longer starts the backoff over. Each attempt lists first, so its LISTED event proves nothing
# about the watch. client-go's reflector does the same: "If we don't backoff for 2min, assume
# API server is healthy and we reset the backoff" (NewExponentialBackoffManager(800ms, 30s, 2m)).
_WATCH_BACKOFF_RESET = 120.0
# The longest wait between two attempts while the API server is unavailable (no answer, 5xx,
# 429). Nothing else may show that it is back (no Prepare comes while no pod can be scheduled
# here), and the slices should be back within 5 s of its return (issue 15): this cap plus one
# pass. One LIST per node every 2.4-3 s during an outage is a load the server's watch cache
# serves; the kubelet's node lease retries up to every 7 s for comparison
# (k8s.io/component-helpers/apimachinery/lease/controller.go, maxBackoff).
UNAVAILABLE_RETRY_CAP = 3.0


@dataclass(frozen=True, slots=True)
class PublisherSettings:
    """Timing of the publisher (seconds); tests shorten them."""

    debounce: float = DEFAULT_DEBOUNCE
    resync_interval: float = DEFAULT_RESYNC_INTERVAL
    start_timeout: float = DEFAULT_START_TIMEOUT
    backoff: Callable[[], Iterator[float]] = field(default=backoff_delays)
    """A fresh iterator of retry delays (endless) after each success: errors the server
    answered (403, 409, 422, ...)."""
    unavailable_backoff: Callable[[], Iterator[float]] = field(
        default=partial(backoff_delays, cap=UNAVAILABLE_RETRY_CAP)
    )
    """The same while the server is unavailable (no answer, 5xx, 429)."""


def _unavailable(error: KubeAPIError) -> bool:
    """No answer, a server error or 429: the server is down or overloaded, not refusing us."""
    return error.status is None or error.status == 429 or error.status >= 500


class _Retries:
    """The delays of one retry loop: a backoff per kind of failure, both reset on success."""

    def __init__(self, settings: PublisherSettings) -> None:
        self._settings = settings
        self._answered: Iterator[float] | None = None
        self._unavailable: Iterator[float] | None = None

    def next_delay(self, error: KubeAPIError) -> float:
        if _unavailable(error):
            if self._unavailable is None:
                self._unavailable = self._settings.unavailable_backoff()
            return next(self._unavailable)
        if self._answered is None:
            self._answered = self._settings.backoff()
        return next(self._answered)

    def reset(self) -> None:
        self._answered = self._unavailable = None


@dataclass(frozen=True, slots=True)
class Republish:
    """Publish ``devices`` (in publication order) now; ``reason`` says why, in the log."""

    reason: str
    devices: tuple[Device, ...]


def republish_channel() -> tuple[
    MemoryObjectSendStream[Republish], MemoryObjectReceiveStream[Republish]
]:
    """A stream pair for republish requests: pass the receiving end to :func:`run`."""
    return anyio.create_memory_object_stream[Republish](_REPUBLISH_BUFFER)


def request_republish(channel: MemoryObjectSendStream[Republish], request: Republish) -> None:
    """Ask for a republish without waiting. The publisher takes each request at once, so only
    one sent before it runs can wait; a request that finds the buffer full is dropped (the
    sender has sent newer ones since)."""
    with contextlib.suppress(
        anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError
    ):
        channel.send_nowait(request)


@dataclass(slots=True)
class _Written:
    """What we sent for one slice and what the server stored in answer."""

    sent: dict[str, Any]  # spec + ownerReferences we sent
    stored: dict[str, Any]  # spec + ownerReferences the server answered with
    resource_version: str


class _Restart(Exception):
    """Publish again at once (the server dropped the consumable-capacity fields)."""


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def _version(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


class _Publisher:
    def __init__(
        self,
        kube: KubeClient,
        node_name: str,
        options: SliceOptions,
        settings: PublisherSettings,
        health: Health | None = None,
    ) -> None:
        self.kube = kube
        self.health = health
        self.node_name = node_name
        self.options = options
        self.settings = settings
        self.devices: tuple[Device, ...] | None = None
        self.consumable = True
        self.generation = 0  # 0: not published yet by this process
        self.owner_uid: str | None = None
        self.pool_key: list[dict[str, Any]] = []
        self.wanted: tuple[str, ...] = ()
        self.written: dict[str, _Written] = {}
        wake_send, wake_receive = anyio.create_memory_object_stream[tuple[str, bool]](math.inf)
        self.wake_send = wake_send
        self.wake_receive = wake_receive
        self.first_attempt = anyio.Event()
        # The retry waits of the two loops, and whether each waits for the server's return.
        self.publish_pause = Pause()
        self.watch_pause = Pause()
        self.publish_waits_for_server = False
        self.watch_waits_for_server = False
        self.publish_log = RetryLog(logger, "publishing ResourceSlices")
        self.watch_log = RetryLog(logger, "watching ResourceSlices")

    # --- triggers ----------------------------------------------------------------------------

    def wake(self, reason: str, *, urgent: bool = False) -> None:
        self.wake_send.send_nowait((reason, urgent))
        self.publish_pause.wake()  # a retry wait ends too: do what was asked now

    def server_answered(self) -> None:
        """A request of this process worked (:meth:`KubeClient.on_success`): the loops that
        wait for the server's return retry now."""
        if self.publish_waits_for_server:
            self.publish_pause.wake()
        if self.watch_waits_for_server:
            self.watch_pause.wake()

    async def forward_requests(self, requests: AsyncIterable[Republish]) -> None:
        async for request in requests:
            self.devices = request.devices
            self.wake(f"republish requested ({request.reason})", urgent=True)

    # --- the publish loop --------------------------------------------------------------------

    async def main_loop(self) -> None:
        reasons: list[str] = []
        retries = _Retries(self.settings)
        while True:
            if not reasons:
                urgent = False
                # Nothing to publish before the first request: only a request ends the wait.
                wait = math.inf if self.devices is None else self.settings.resync_interval
                with anyio.move_on_after(wait):
                    reason, urgent = await self.wake_receive.receive()
                    reasons.append(reason)
                if not reasons:
                    reasons.append("periodic resync")
                if not urgent:  # a republish request (SIGHUP) is one event: no burst to wait for
                    await anyio.sleep(self.settings.debounce)
            while True:  # drain the triggers that came meanwhile
                try:
                    reason, _ = self.wake_receive.receive_nowait()
                except anyio.WouldBlock:
                    break
                reasons.append(reason)
            if self.devices is None:
                logger.debug("no devices to publish yet (%s)", ", ".join(reasons))
                reasons = []
                continue
            logger.debug("publishing ResourceSlices: %s", ", ".join(dict.fromkeys(reasons)))
            try:
                await self.reconcile()
            except _Restart:
                reasons = ["consumable capacity unsupported"]
                continue
            except KubeAPIError as exc:
                delay = retries.next_delay(exc)
                # 404: a slice vanished between our list and our write; relisting fixes it.
                transient = _unavailable(exc) or exc.status in (404, 409)
                level = logging.WARNING if transient else logging.ERROR
                self.publish_log.failed(exc, retry_in=delay, level=level)
                if self.health is not None and exc.status not in (404, 409):
                    self.health.set_not_ready(f"publishing ResourceSlices fails: {exc}")
                self.first_attempt.set()
                self.publish_waits_for_server = _unavailable(exc)
                try:
                    woken = await self.publish_pause.sleep(delay)
                finally:
                    self.publish_waits_for_server = False
                reasons = ["retry, woken early" if woken else "retry"]
                continue
            retries.reset()
            self.publish_log.recovered()
            if self.health is not None:
                self.health.set_ready()
            reasons = []
            self.first_attempt.set()

    async def reconcile(self) -> None:
        """One publish pass (see the module docstring); raises on API errors."""
        assert self.devices is not None
        if self.owner_uid is None:
            try:
                node = await self.kube.get_node(self.node_name)
            except KubeNotFoundError as exc:
                logger.warning("publishing without an owner reference (no Node object): %s", exc)
            else:
                uid = (node.get("metadata") or {}).get("uid")
                self.owner_uid = uid if isinstance(uid, str) and uid else None
        existing, _ = await self.kube.list_resource_slices(DRIVER_NAME, self.node_name)
        desired = self.build()
        key = pool_content(desired)
        highest = max((pool_generation(obj) for obj in existing), default=0)
        self.generation = next_generation(self.generation, highest, changed=key != self.pool_key)
        self.pool_key = key
        for obj in desired:
            obj["spec"]["pool"]["generation"] = self.generation
        self.wanted = tuple(_name(obj) for obj in desired)
        stored = {name: (w.sent, w.stored) for name, w in self.written.items()}
        writes = slice_writes(existing, desired, stored)
        for gone in writes.delete:
            await self.delete(_name(gone), gone)
        for want, version in writes.write:
            name = _name(want)
            if version is None:
                answer = await self.kube.create_resource_slice(want)
            else:
                metadata = {**want["metadata"], "resourceVersion": version}
                answer = await self.kube.update_resource_slice({**want, "metadata": metadata})
            self.written[name] = _Written(
                slice_content(want), slice_content(answer), _version(answer)
            )
            if self.consumable and consumable_capacity_dropped(want, answer):
                logger.warning(
                    "the API server dropped allowMultipleAllocations/requestPolicy from "
                    "ResourceSlice %s: the cluster lacks the DRAConsumableCapacity feature; "
                    "publishing without requestPolicy from now on",
                    name,
                )
                self.consumable = False
                raise _Restart
        changes = len(writes.delete) + len(writes.write)
        for name in list(self.written):
            if name not in self.wanted:
                del self.written[name]
        if changes:
            logger.info(
                "published %d devices in %d ResourceSlices (pool %s, generation %d, %d writes)",
                len(self.devices),
                len(desired),
                self.node_name,
                self.generation,
                changes,
            )

    def build(self) -> list[dict[str, Any]]:
        """The wanted slices, generation 0 (the caller sets it)."""
        assert self.devices is not None
        return build_resource_slices(
            self.node_name,
            self.devices,
            options=self.options,
            consumable_capacity=self.consumable,
            generation=0,
            owner_uid=self.owner_uid,
        )

    async def delete(self, name: str, obj: Mapping[str, Any]) -> None:
        uid = (obj.get("metadata") or {}).get("uid")
        with contextlib.suppress(KubeNotFoundError):  # gone already: what we wanted
            await self.kube.delete_resource_slice(
                name,
                uid=uid if isinstance(uid, str) else None,
                resource_version=_version(obj) or None,
            )
        logger.info("deleted stale ResourceSlice %s", name)

    # --- drift -------------------------------------------------------------------------------

    def drifted(self, kind: str, obj: Mapping[str, Any]) -> bool:
        """Whether a watch event shows our published state differs from the wanted one."""
        if self.generation == 0:
            return False  # nothing published yet: the publish loop is on it
        if kind == LISTED:
            items = [i for i in obj.get("items") or [] if isinstance(i, Mapping)]
            names = {_name(i) for i in items}
            return names != set(self.wanted) or any(self.changed(i) for i in items)
        if kind == "DELETED":
            return _name(obj) in self.wanted
        return self.changed(obj)

    def changed(self, obj: Mapping[str, Any]) -> bool:
        name = _name(obj)
        if name not in self.wanted:
            return True  # a slice of ours we do not want
        record = self.written.get(name)
        if record is None:
            return True
        if record.resource_version == _version(obj):
            return False  # our own write
        return slice_content(obj) != record.stored

    async def watch_loop(self) -> None:
        await self.first_attempt.wait()
        retries = _Retries(self.settings)
        while True:
            began = anyio.current_time()
            try:
                events = self.kube.watch_resource_slices(DRIVER_NAME, self.node_name)
                async with contextlib.aclosing(events):
                    async for kind, obj in events:
                        if kind != LISTED:  # the watch itself delivers: it works
                            self.watch_log.recovered()
                        if self.drifted(kind, obj):
                            self.wake(f"{kind.lower()} {_name(obj)}".strip())
            except KubeAPIError as exc:
                if anyio.current_time() - began >= _WATCH_BACKOFF_RESET:
                    retries.reset()  # a new failure: said again even if it reads the same
                    self.watch_log = RetryLog(logger, "watching ResourceSlices")
                delay = retries.next_delay(exc)
                self.watch_log.failed(exc, retry_in=delay)
                self.watch_waits_for_server = _unavailable(exc)
                try:
                    await self.watch_pause.sleep(delay)
                finally:
                    self.watch_waits_for_server = False


async def run(
    kube: KubeClient,
    node_name: str,
    requests: AsyncIterable[Republish],
    *,
    options: SliceOptions = _UPSTREAM_DEFAULTS,
    settings: PublisherSettings = PublisherSettings(),
    health: Health | None = None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Publish the devices of each of ``requests`` for ``node_name`` until cancelled (see the
    module docstring). ``options``: upstream's publication switches. ``health``: ready while the
    slices are published. ``started()`` comes after the first publish attempt, successful or
    not, or after ``settings.start_timeout``.
    """
    publisher = _Publisher(kube, node_name, options, settings, health)
    stop_listening = kube.on_success(publisher.server_answered)
    try:
        await _run(publisher, requests, settings, task_status)
    finally:
        stop_listening()


async def _run(
    publisher: _Publisher,
    requests: AsyncIterable[Republish],
    settings: PublisherSettings,
    task_status: anyio.abc.TaskStatus[None],
) -> None:
    async with publisher.wake_send, publisher.wake_receive, anyio.create_task_group() as tg:
        tg.start_soon(publisher.forward_requests, requests, name="slice publisher: requests")
        tg.start_soon(publisher.main_loop, name="slice publisher")
        tg.start_soon(publisher.watch_loop, name="slice publisher: watch")
        with anyio.move_on_after(settings.start_timeout):
            await publisher.first_attempt.wait()
        task_status.started()
