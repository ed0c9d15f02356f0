"""What the daemon holds of the NRI task: its queue of updates, the rule that orders every write to
the runtime, and its status.

The pins live in the node state (:class:`~dracpu.core.state_values.ContainerRecord`: cpus, mems
and ``seq``, the number of the owner's decision that chose them). They reach the runtime two
ways: in the reply to a container event (CreateContainer, UpdateContainer, StopContainer,
Synchronize), and, after an Unprepare or a container's start (a pin it may have lost while
starting), on a runtime that takes them, in an unsolicited ``UpdateContainers`` that this queue
holds until the connection sends it (never from inside an event handler: containerd holds one
lock across an event, and ``UpdateContainers`` needs it too, containerd/containerd#13733).

The two ways can reach the runtime in the opposite order of the owner's decisions: an
``UpdateContainers`` waiting for containerd's lock is applied after the event that holds it,
whose reply may carry a newer pin; on a runtime that does not hold the lock, an update the owner
decided after an event's answer may be applied before that answer's reply is written. One rule
keeps the last write to each container the owner's last decision:

* every write is built from the committed state when it goes out: an event reply's pins are
  replaced by the record's pin when the record holds a newer decision (:meth:`NriLink.fresh`),
  and a queued container is sent the record's pin (:meth:`NriLink.next_batch`);
* once a write has gone out (a reply written, an ``UpdateContainers`` answered), every container
  whose record now holds a newer decision than the one written is queued again
  (:meth:`NriLink.written`): whichever write the runtime applied last, the newest follows.

A container whose update the runtime failed gets an unknown cpuset in the node state
(:class:`~dracpu.core.commands.InvalidateContainers`, sent by the connection with the failed
decisions' numbers); the owner sends it its pin again in the next reply that can carry updates
(any CreateContainer, UpdateContainer or StopContainer), and a reconnect's Synchronize re-pins
every container anyway. Without a synchronized runtime that takes unsolicited updates nothing is
queued (the updates are counted as dropped): the next Synchronize re-pins everything.

At a stop the task waits (bounded) until :meth:`NriLink.settled`: nothing queued, no
``UpdateContainers`` on its way and no event being answered, so the widening an Unprepare
decided just before a SIGTERM still reaches the runtime.

:meth:`NriLink.status` tells ``/readyz`` and ``/metrics`` whether a runtime is connected and
synchronized, which one, and how the unsolicited updates fared.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import anyio

from dracpu.core.effects import ContainerUpdate, UpdateContainers
from dracpu.core.state_values import ContainerRecord, NodeState

__all__ = ["CommittedState", "NriLink", "NriStatus"]

logger = logging.getLogger(__name__)

CommittedState = Callable[[], NodeState]
"""Reads the state owner's committed state (``lambda: owner.state``)."""


@dataclass(frozen=True, slots=True)
class NriStatus:
    """A snapshot of the NRI side, for ``/readyz`` and ``/metrics``."""

    connected: bool
    """A runtime registered and configured us, and the connection is up."""
    synchronized: bool
    """...and its ``Synchronize`` was answered: every container it runs is pinned."""
    runtime_name: str
    runtime_version: str
    nri_version: str
    """The runtime's NRI version (``ConfigureRequest.NRI_version``; empty before NRI v0.12)."""
    unsolicited_updates: bool
    """Unprepare widens the shared containers at once (else at the next container event)."""
    connections: int
    """Synchronized connections since the start (1 + reconnects)."""
    unsolicited_sent: int
    unsolicited_failed: int
    unsolicited_dropped: int
    """UpdateContainers effects that came while no runtime took them (the next Synchronize
    re-pins every container instead)."""
    last_error: str
    """Why the last connection ended or could not be made ("" if none did)."""


class NriLink:
    """The containers owed an unsolicited update, the freshness checks of every write, and the
    NRI task's status.

    The state owner's executor calls :meth:`submit` (it never blocks, never fails); ``/readyz``
    and ``/metrics`` read :meth:`status`; the NRI task (:func:`dracpu.tasks.nri_plugin.run`)
    calls the rest, and :meth:`watch` when it starts. Create it before the state owner and pass
    the same object to the NRI task.
    """

    def __init__(self) -> None:
        self._committed: CommittedState | None = None
        self._queued: dict[str, None] = {}  # container ids, in the order they were queued
        self._wakeup: anyio.Event | None = None
        self._live = False
        self._sending = False  # an UpdateContainers taken from the queue has not been answered
        self._answering = 0  # event handlers working on their answer
        self._settled: anyio.Event | None = None  # set when settled() may hold
        # What status() reports; the NRI task tells them through the methods below.
        self._connected = False
        self._synchronized = False
        self._first_sync: anyio.Event | None = None  # created by the first waiter
        self._synchronized_once = False
        self._runtime: tuple[str, str, str] = ("", "", "")  # name, version, NRI version
        self._unsolicited = False
        self._connections = 0
        self._sent = 0
        self._failed = 0
        self._dropped = 0
        self._last_error = ""

    def status(self) -> NriStatus:
        """The current state of the NRI connection."""
        name, version, nri_version = self._runtime
        return NriStatus(
            connected=self._connected,
            synchronized=self._synchronized,
            runtime_name=name,
            runtime_version=version,
            nri_version=nri_version,
            unsolicited_updates=self._unsolicited,
            connections=self._connections,
            unsolicited_sent=self._sent,
            unsolicited_failed=self._failed,
            unsolicited_dropped=self._dropped,
            last_error=self._last_error,
        )

    def configured(self, runtime: tuple[str, str, str], *, unsolicited: bool) -> None:
        """A runtime (name, version, NRI version) configured the plugin; ``unsolicited``:
        it takes unsolicited updates."""
        self._runtime = runtime
        self._unsolicited = unsolicited
        self._connected = True

    def connect_failed(self, reason: str) -> None:
        """No runtime could be reached, for ``reason``."""
        self._last_error = reason

    def update_sent(self, *, failed: bool) -> None:
        """An unsolicited ``UpdateContainers`` was answered; ``failed``: it failed containers."""
        self._sent += 1
        self._failed += failed

    def mark_synchronized(self) -> None:
        """A connection's first ``Synchronize`` was answered: the runtime pins what it creates."""
        self._synchronized = True
        self._connections += 1
        self._synchronized_once = True
        if self._first_sync is not None:
            self._first_sync.set()

    @property
    def synchronized_once(self) -> bool:
        """Whether a runtime has synchronized since the start."""
        return self._synchronized_once

    async def wait_synchronized_once(self) -> None:
        """Until a runtime has synchronized since the start (the kubelet is told about us only
        then: every claim it prepares can be pinned)."""
        if self._synchronized_once:
            return
        if self._first_sync is None:
            self._first_sync = anyio.Event()
        await self._first_sync.wait()

    def watch(self, committed: CommittedState) -> None:
        """Read the owner's committed state through ``committed``."""
        self._committed = committed

    @property
    def live(self) -> bool:
        """A synchronized runtime takes unsolicited updates."""
        return self._live

    @property
    def queued(self) -> tuple[str, ...]:
        """The container ids waiting to be sent, in order."""
        return tuple(self._queued)

    def _containers(self) -> Mapping[str, ContainerRecord]:
        if self._committed is None:
            return {}
        return self._committed().containers

    # --- the owner's side ----------------------------------------------------------------------

    def submit(self, effect: UpdateContainers) -> None:
        """Queue the containers of an unsolicited update (the owner's post-commit hand-off)."""
        if not self._live:
            self._dropped += 1
            logger.debug(
                "no synchronized NRI runtime takes unsolicited updates: dropping the updates of "
                "%d containers (the next Synchronize re-pins them)",
                len(effect.updates),
            )
            return
        self._queue(u.container_id for u in effect.updates)

    # --- the connection's side -----------------------------------------------------------------

    def start(self, *, unsolicited: bool) -> None:
        """A Synchronize is about to reach the owner: from now on (if the runtime takes
        unsolicited updates) the owner's updates are queued, not dropped."""
        self._live = unsolicited
        self._queued.clear()

    def stop(self, reason: str) -> None:
        """The connection ended (``reason``): nothing more is queued (the next Synchronize
        re-pins all)."""
        self._live = False
        self._queued.clear()
        self._sending = False
        self._answering = 0
        self._check_settled()
        self._connected = False
        self._synchronized = False
        self._unsolicited = False
        self._last_error = reason

    def fresh(self, updates: Iterable[ContainerUpdate]) -> list[ContainerUpdate]:
        """The pins an event reply should carry for ``updates`` (decided with the answer):
        each replaced by its record's pin when the record holds a newer decision; dropped when
        that newer pin is unknown (a failed update: the next reply sends it) or the container
        is gone."""
        containers = self._containers()
        result: list[ContainerUpdate] = []
        for update in updates:
            record = containers.get(update.container_id)
            if record is None:
                continue
            if record.seq > update.seq:
                if not record.cpus:
                    continue
                update = record.pin()
            result.append(update)
        return result

    def fresh_pin(self, pin: ContainerUpdate) -> ContainerUpdate:
        """The event's own container's pin: its record's when that holds a newer, known one."""
        record = self._containers().get(pin.container_id)
        if record is not None and record.seq > pin.seq and record.cpus:
            return record.pin()
        return pin

    def written(self, updates: Iterable[ContainerUpdate]) -> None:
        """These pins went out (a reply written, an UpdateContainers answered): queue again the
        containers whose record holds a newer decision, if the runtime takes unsolicited
        updates (else the next event's reply carries it)."""
        if not self._live:
            return
        containers = self._containers()
        newer = []
        for update in updates:
            record = containers.get(update.container_id)
            if record is not None and record.seq > update.seq and record.cpus:
                newer.append(update.container_id)
        self._queue(newer)

    async def next_batch(self) -> list[ContainerUpdate]:
        """Wait for queued containers; their pins from the committed state (containers gone or
        with an unknown pin are skipped; the list may come back empty). The batch is on its way
        until :meth:`batch_done`."""
        while not self._queued:
            event = anyio.Event()
            self._wakeup = event
            await event.wait()
        ids = list(self._queued)
        self._queued.clear()
        self._sending = True
        containers = self._containers()
        pins = []
        for cid in ids:
            record = containers.get(cid)
            if record is not None and record.cpus:
                pins.append(record.pin())
        return pins

    def batch_done(self) -> None:
        """The batch of :meth:`next_batch` was answered (or could not be sent)."""
        self._sending = False
        self._check_settled()

    def answering(self, delta: int) -> None:
        """An event handler began (``+1``) or finished (``-1``) its answer."""
        self._answering = max(0, self._answering + delta)
        self._check_settled()

    @property
    def busy(self) -> bool:
        """Updates are queued or on their way, or an event is being answered."""
        return bool(self._queued or self._sending or self._answering)

    async def settled(self) -> None:
        """Wait until nothing is queued, on its way or being answered."""
        while self.busy:
            if self._settled is None:
                self._settled = anyio.Event()
            await self._settled.wait()

    def _check_settled(self) -> None:
        if self._settled is not None and not self.busy:
            self._settled.set()
            self._settled = None

    def _queue(self, container_ids: Iterable[str]) -> None:
        before = len(self._queued)
        self._queued.update(dict.fromkeys(container_ids))
        if len(self._queued) > before:
            self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None
