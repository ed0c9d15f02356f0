"""The NRI plugin task: pins every container of the node through the runtime's NRI socket.

One connection at a time to ``--nri-socket`` (containerd or CRI-O; ``reference/nri-ttrpc-cdi.md``
§2-§3). On the socket, :class:`~dracpu.wire.mux.MuxConnection` carries two ttrpc connections:
conn 1, where we serve ``nri.pkg.api.v1alpha1.Plugin`` to the runtime, and conn 2, where we call
the runtime's ``nri.pkg.api.v1alpha1.Runtime``. The sequence of a connection:

1. connect; the reader serves conn 1 from the start, because ``Configure`` may arrive before
   the answer to our registration;
2. ``RegisterPlugin{name, index}`` on conn 2 (``dra.cpu``/``00`` by default);
3. the runtime calls ``Configure``: we subscribe to CreateContainer, UpdateContainer,
   StopContainer and RemoveContainer (mask 0x688, valid on every runtime since NRI v0.2) and
   note the runtime's name and versions: unsolicited updates are allowed only with NRI >=
   v0.12.1 (:func:`~dracpu.adapters.nri_messages.unsolicited_updates_supported`);
4. the runtime calls ``Synchronize`` (possibly in parts, ``more``): the state owner gets every
   container (:class:`~dracpu.core.commands.Synchronize`) and the reply re-pins all of them;
5. events: ``CreateContainer`` pins the new container (its claims' CPUs, or the shared pool) and
   the same reply moves every shared container off newly claimed CPUs; ``UpdateContainer`` and
   ``StopContainer`` answer likewise; ``RemoveContainer`` (dedicated RPC or ``StateChange``)
   forgets the container; the other Plugin methods answer UNIMPLEMENTED (code 12), so a v0.12
   runtime falls back to ``StateChange`` for events we did not subscribe to anyway.

A refusal of the state owner (a spoofed or malformed ``DRA_CPUSET_*`` env, a claim not prepared
here) fails the container's creation with a status code (fail closed); so does an owner that
does not answer well before the runtime's 2 s deadline: a plugin that times out is dropped and
the container is created *unpinned*, so we answer an error instead. Handlers do no I/O besides
the owner round trip.

Unsolicited updates (widening the shared containers after an Unprepare) never go out from inside
an event handler: containerd holds one lock across the event and ``UpdateContainers`` needs it
too (reference §3.9). The state owner's executor hands its
:class:`~dracpu.core.effects.UpdateContainers` effects to :meth:`NriLink.submit`; this task's
sender sends them on conn 2 and, when the runtime fails them, sends
:class:`~dracpu.core.commands.InvalidateContainers` to the owner.

Ordering. An unsolicited update and an event reply can reach the runtime in the opposite order of
the owner's decisions: an ``UpdateContainers`` waiting for containerd's lock is applied *after*
the event that holds it, whose reply may carry a newer (narrower) shared pool. :class:`NriLink`
therefore keeps, for every container, the newest cpuset the owner decided, in the owner's order
(an answer that the owner sent before an effect it executed later is overridden by that effect,
see :meth:`NriLink.submit`); every update is built from it when it is sent, and a container
whose cpuset changed while an ``UpdateContainers`` was in flight is sent again afterwards. So the
last write to reach each container is the owner's last decision.

Failure policy: a lost connection (EOF, socket error, protocol violation, garbage, an oversized
frame, a refused registration, a handshake that does not finish) sends
:class:`~dracpu.core.commands.RuntimeDisconnected` to the owner and reconnects with capped
exponential backoff; every connection registers and synchronizes again. A malformed message is
answered with INVALID_ARGUMENT and never ends the task. Bugs (non-DracpuError exceptions) do.

Readiness: :func:`run` calls ``task_status.started()`` after the first ``Synchronize`` was
answered, or after ``start_timeout`` (10 s) without one: an absent runtime must not keep the
daemon from starting. :meth:`NriLink.status` tells ``/readyz`` and ``/metrics`` whether a runtime
is connected and synchronized.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio
import anyio.abc
from anyio import TASK_STATUS_IGNORED, BrokenResourceError, ClosedResourceError, EndOfStream
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from dracpu._gen.pb2.nri.v1alpha1 import api_pb2 as api
from dracpu.adapters import nri_messages as messages
from dracpu.adapters import ttrpc_envelopes as envelopes
from dracpu.adapters.backoff import backoff_delays
from dracpu.adapters.ttrpc_envelopes import Answer, Call
from dracpu.config import Config
from dracpu.core.commands import (
    Command,
    CreateContainer,
    InvalidateContainers,
    RemoveContainer,
    RuntimeDisconnected,
    StopContainer,
    Synchronize,
    UpdateContainer,
)
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import (
    ContainerForgotten,
    ContainerPinned,
    ContainerUpdate,
    Synchronized,
    UpdateContainers,
)
from dracpu.errors import DracpuError, LocalProtocolError, RemoteProtocolError
from dracpu.tasks.state_owner import PendingReply, Request, request
from dracpu.wire.events import (
    NEED_DATA,
    ConnectionClosed,
    TtrpcRequest,
    TtrpcResponse,
    TtrpcStreamError,
)
from dracpu.wire.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, MuxConnection
from dracpu.wire.ttrpc import Code, Role, TtrpcConnection

__all__ = [
    "DEFAULT_REQUEST_TIMEOUT",
    "HANDLER_MARGIN",
    "HANDSHAKE_TIMEOUT",
    "REGISTRATION_REPLY_TIMEOUT",
    "START_TIMEOUT",
    "UPDATE_CONTAINERS_TIMEOUT",
    "Connect",
    "NriLink",
    "NriStatus",
    "connect_unix",
    "reconnect_delays",
    "run",
]

logger = logging.getLogger(__name__)

READ_SIZE = 65536  # bytes per socket read; the mux reassembles frames of any size
# nri pkg/api/timeouts.go DefaultPluginRequestTimeout: the runtime's deadline for each call, used
# until Configure tells us the configured one (ConfigureRequest.request_timeout, NRI v0.7+).
DEFAULT_REQUEST_TIMEOUT = 2.0
# Answer this long before the runtime's deadline: past it the runtime drops us and creates the
# container without our cpuset (reference §3.7), so an error answer in time is the safe one.
HANDLER_MARGIN = 0.3
MIN_HANDLER_BUDGET = 0.1  # seconds; never wait less for the owner, whatever the deadline says
# The runtime serves one plugin handshake at a time and times each out after 5 s
# (DefaultPluginRegistrationTimeout); twice that covers another plugin's handshake ahead of ours.
REGISTRATION_REPLY_TIMEOUT = 10.0
# From connecting to an answered Synchronize: registration, Configure and Synchronize are each
# bounded by the runtime (5 s + 2 s + 2 s); a runtime silent for longer is stuck: reconnect.
HANDSHAKE_TIMEOUT = 30.0
# An UpdateContainers waits for containerd's NRI lock (up to one 2 s event) and then writes the
# cgroups of every container in it; beyond this we count it as failed (InvalidateContainers).
UPDATE_CONTAINERS_TIMEOUT = 10.0
# Readiness without a runtime: two registration timeouts (see module docstring).
START_TIMEOUT = 10.0
# Reconnect backoff: containers created while we are away run unpinned until we are back, so
# the first retries are fast; the cap keeps a runtime that is down from being hammered.
RECONNECT_INITIAL = 0.1
RECONNECT_CAP = 5.0

Connect = Callable[[Path], Awaitable[anyio.abc.ByteStream]]
"""Opens the NRI socket (tests pass their own)."""

OwnerSend = MemoryObjectSendStream[Request[Command]]


async def connect_unix(path: Path) -> anyio.abc.ByteStream:
    """Connect to the runtime's NRI unix socket."""
    return await anyio.connect_unix(path)


def reconnect_delays() -> Iterator[float]:
    """The delays between connection attempts (restarted after every synchronized connection)."""
    return backoff_delays(initial=RECONNECT_INITIAL, cap=RECONNECT_CAP)


# --- the link between the state owner and this task -----------------------------------------------


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
    """UpdateContainers effects that came while no runtime was synchronized (the next
    Synchronize re-pins every container instead)."""
    last_error: str
    """Why the last connection ended or could not be made ("" if none did)."""


@dataclass(frozen=True, slots=True)
class _Pin:
    """A container's cpuset as the owner decided it (``mems`` None: leave cpuset.mems alone)."""

    cpus: CpuSet
    mems: CpuSet | None


def _wire(pins: Mapping[str, _Pin]) -> list[ContainerUpdate]:
    return [ContainerUpdate(cid, pin.cpus, pin.mems) for cid, pin in pins.items()]


class _Ask:
    """A command of ours on its way to the owner; ``newer``: pins of effects the owner executed
    after it answered this command (they override the answer's pins)."""

    __slots__ = ("newer", "reply")

    def __init__(self) -> None:
        self.reply = PendingReply()
        self.newer: dict[str, _Pin] = {}


class NriLink:
    """What the rest of the daemon holds of the NRI task.

    - The state owner's effect executor calls :meth:`submit` with each
      :class:`~dracpu.core.effects.UpdateContainers` effect; it never blocks and never fails
      (a runtime failure comes back to the owner as ``InvalidateContainers``).
    - ``/readyz`` and ``/metrics`` read :meth:`status`.

    Create it before the state owner and pass the same object to :func:`run`. Everything else
    on it is the NRI task's own.
    """

    def __init__(self) -> None:
        self._pins: dict[str, _Pin] = {}  # the newest decision per container, in owner order
        self._asks: set[_Ask] = set()
        self._queued: dict[str, None] = {}  # containers owed an unsolicited update (ordered)
        self._wakeup: anyio.Event | None = None
        self._live = False
        self._connected = False
        self._synchronized = False
        self._runtime = ("", "", "")  # name, version, NRI version (ConfigureRequest)
        self._unsolicited = False
        self._connections = 0
        self._sent = 0
        self._failed = 0
        self._dropped = 0
        self._last_error = ""

    # --- for the owner's executor and the HTTP task --------------------------------------------

    def submit(self, effect: UpdateContainers) -> None:
        """Queue the owner's unsolicited updates for the runtime (call it from the executor).

        Runs inside the owner, between two commands, so it also fixes the order against our
        own commands: a command of ours that the owner has already answered (its one-shot reply
        stream is closed: :attr:`~dracpu.tasks.state_owner.PendingReply.handled`) was decided
        *before* this effect, and its answer's pins for these containers are superseded.
        """
        if not self._live:
            self._dropped += 1
            logger.debug(
                "no synchronized NRI runtime: dropping unsolicited updates of %d containers "
                "(the next Synchronize re-pins them)",
                len(effect.updates),
            )
            return
        pins = {u.container_id: _Pin(u.cpus, u.mems) for u in effect.updates}
        for ask in self._asks:
            if ask.reply.handled:  # answered before this effect
                ask.newer.update(pins)
        self._pins.update(pins)
        self._queued.update(dict.fromkeys(pins))
        self._wake()

    def status(self) -> NriStatus:
        """The current state of the NRI connection."""
        return NriStatus(
            connected=self._connected,
            synchronized=self._synchronized,
            runtime_name=self._runtime[0],
            runtime_version=self._runtime[1],
            nri_version=self._runtime[2],
            unsolicited_updates=self._unsolicited,
            connections=self._connections,
            unsolicited_sent=self._sent,
            unsolicited_failed=self._failed,
            unsolicited_dropped=self._dropped,
            last_error=self._last_error,
        )

    # --- the NRI task's side ------------------------------------------------------------------

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    async def _ask(self, owner: OwnerSend, command: Command) -> tuple[object, dict[str, _Pin]]:
        """Send ``command`` to the owner, await its answer (:func:`state_owner.request`), and
        return it with the pins that effects executed after it supersede."""
        ask = _Ask()
        self._asks.add(ask)
        try:
            value = await request(owner, command, reply=ask.reply)
        finally:
            self._asks.discard(ask)
        return value, ask.newer

    def _record(self, pins: Mapping[str, _Pin], newer: Mapping[str, _Pin]) -> dict[str, _Pin]:
        """Record an answer's pins; return the pins to send (superseded ones replaced)."""
        effective: dict[str, _Pin] = {}
        for cid, pin in pins.items():
            newest = newer.get(cid)
            if newest is None:
                self._pins[cid] = pin
                effective[cid] = pin
            else:
                effective[cid] = newest
        return effective

    def _reset(self, pins: Mapping[str, _Pin], newer: Mapping[str, _Pin]) -> dict[str, _Pin]:
        """After Synchronize: the answer's pins replace everything known."""
        self._pins = {**pins, **newer}
        return {cid: newer.get(cid, pin) for cid, pin in pins.items()}

    def _forget(self, container_id: str) -> None:
        self._pins.pop(container_id, None)
        self._queued.pop(container_id, None)

    def _go_live(self) -> None:
        """A Synchronize is about to reach the owner: from now on its effects are for us."""
        self._live = True

    def _connection_ended(self, reason: str) -> None:
        self._live = False
        self._connected = False
        self._synchronized = False
        self._unsolicited = False
        self._pins.clear()
        self._queued.clear()
        self._last_error = reason

    async def _next_batch(self) -> list[tuple[str, _Pin]]:
        """Wait for queued containers; return them with their newest pins."""
        while not self._queued:
            event = anyio.Event()
            self._wakeup = event
            await event.wait()
        ids = list(self._queued)
        self._queued.clear()
        return [(cid, self._pins[cid]) for cid in ids if cid in self._pins]

    def _batch_done(self, batch: list[tuple[str, _Pin]], failed: frozenset[str]) -> None:
        """Queue again the containers whose pin changed while the update was in flight: the
        runtime may have applied our (older) update after the newer one."""
        for cid, pin in batch:
            if cid not in failed and self._pins.get(cid, pin) != pin:
                self._queued[cid] = None
        if self._queued:
            self._wake()


# --- one connection -------------------------------------------------------------------------------


class _Refused(Exception):
    """A handler answers the runtime with this error status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Call:
    """A call of ours on conn 2 waiting for its response."""

    __slots__ = ("done", "response")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.response: Answer | None = None


Handler = Callable[[Call], Awaitable[bytes]]


class _Connection:
    """One socket to the runtime: the mux, both ttrpc connections, the handlers, the sender."""

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        config: Config,
        owner: OwnerSend,
        link: NriLink,
        on_synchronized: Callable[[], None],
    ) -> None:
        self._stream = stream
        self._config = config
        self._owner = owner
        self._link = link
        self._on_synchronized = on_synchronized
        self._mux = MuxConnection()
        self._server = TtrpcConnection(Role.SERVER)  # conn 1: the runtime calls us
        self._client = TtrpcConnection(Role.CLIENT)  # conn 2: we call the runtime
        self._write_lock = anyio.Lock()
        self._calls: dict[int, _Call] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._end_reason = ""
        self._request_timeout = DEFAULT_REQUEST_TIMEOUT
        self._unsolicited = False
        self._sync_pods: list[api.PodSandbox] = []
        self._sync_containers: list[api.Container] = []
        self._synchronized = anyio.Event()
        self._handlers: dict[str, Handler] = {
            "Configure": self._configure,
            "Synchronize": self._synchronize,
            "CreateContainer": self._create_container,
            "UpdateContainer": self._update_container,
            "StopContainer": self._stop_container,
            "RemoveContainer": self._remove_container,
            "StateChange": self._state_change,
            "Shutdown": self._shutdown,
        }

    @property
    def synchronized(self) -> bool:
        return self._synchronized.is_set()

    async def serve(self) -> str:
        """Run the connection until it ends; return why it ended."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._read_loop)
            tg.start_soon(self._handshake)
        return self._end_reason or "connection ended"

    def _end(self, reason: str) -> None:
        if not self._end_reason:
            self._end_reason = reason
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    # --- reading ------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            reason = await self._read()
        except RemoteProtocolError as exc:
            reason = f"protocol error from the runtime: {exc}"
        self._end(reason)

    async def _read(self) -> str:
        while True:
            try:
                data = await self._stream.receive(READ_SIZE)
            except EndOfStream:
                data = b""
            except (BrokenResourceError, ClosedResourceError, OSError) as exc:
                return f"socket error: {exc!r}"
            self._mux.receive_data(data)
            while (frame := self._mux.next_event()) is not NEED_DATA:
                if isinstance(frame, ConnectionClosed):
                    return "the runtime closed the connection"
                if frame.conn_id == PLUGIN_SERVICE_CONN:
                    self._server.receive_data(frame.payload)
                    await self._drain_server()
                else:
                    self._client.receive_data(frame.payload)
                    self._drain_client()

    async def _drain_server(self) -> None:
        assert self._tg is not None
        while (event := self._server.next_event()) is not NEED_DATA:
            if isinstance(event, TtrpcRequest):
                try:
                    call = envelopes.read_request(event)
                except RemoteProtocolError as exc:  # ttrpc server.go: answered, conn kept
                    logger.warning("NRI: bad request from the runtime: %s", exc)
                    await self._answer_error(event.stream_id, Code.INVALID_ARGUMENT, str(exc))
                    continue
                self._tg.start_soon(self._handle, call)
            elif isinstance(event, TtrpcStreamError):
                logger.warning("NRI: bad request from the runtime: %s", event.status_message)
                await self._answer_error(event.stream_id, event.status_code, event.status_message)

    def _drain_client(self) -> None:
        while (event := self._client.next_event()) is not NEED_DATA:
            if isinstance(event, TtrpcResponse):
                answer = envelopes.read_response(event)  # malformed: the connection ends
            elif isinstance(event, TtrpcStreamError):
                answer = Answer(event.stream_id, event.status_code, event.status_message, b"")
            else:
                continue
            call = self._calls.pop(answer.stream_id, None)
            if call is None:
                logger.debug("NRI: late response on stream %d dropped", answer.stream_id)
                continue
            call.response = answer
            call.done.set()

    # --- writing ------------------------------------------------------------------------------

    async def _write(self, conn_id: int, message: bytes) -> None:
        data = self._mux.send(conn_id, message)
        try:
            async with self._write_lock:
                await self._stream.send(data)
        except (BrokenResourceError, ClosedResourceError, OSError) as exc:
            self._end(f"socket error while writing: {exc!r}")

    async def _answer(self, stream_id: int, payload: bytes) -> None:
        try:
            message = self._server.send_response(stream_id, envelopes.response_data(payload))
        except LocalProtocolError as exc:  # a reply over the 4 MiB ttrpc limit
            logger.error("NRI: cannot send the reply on stream %d: %s", stream_id, exc)
            await self._answer_error(stream_id, Code.RESOURCE_EXHAUSTED, f"dra.cpu: {exc}")
            return
        await self._write(PLUGIN_SERVICE_CONN, message)

    async def _answer_error(self, stream_id: int, code: int, text: str) -> None:
        data = envelopes.response_data(b"", code, text)
        await self._write(PLUGIN_SERVICE_CONN, self._server.send_response(stream_id, data))

    async def _call(self, method: str, payload: bytes, within: float) -> Answer | None:
        """Call the runtime on conn 2; ``None`` when it did not answer ``within`` seconds."""
        call = _Call()
        data = envelopes.request_data(
            messages.RUNTIME_SERVICE, method, payload, round(within * 1e9)
        )
        async with self._write_lock:
            # Stream ids must reach the wire in increasing order: take one under the lock.
            stream_id, message = self._client.send_request(data)
            self._calls[stream_id] = call
            try:
                await self._stream.send(self._mux.send(RUNTIME_SERVICE_CONN, message))
            except (BrokenResourceError, ClosedResourceError, OSError) as exc:
                self._end(f"socket error while writing: {exc!r}")
        with anyio.move_on_after(within):
            await call.done.wait()
        self._calls.pop(stream_id, None)
        return call.response

    # --- registration and unsolicited updates ---------------------------------------------------

    async def _handshake(self) -> None:
        name, index = self._config.nri_plugin_name, self._config.nri_plugin_index
        payload = messages.register_plugin_request(name, index)
        response = await self._call("RegisterPlugin", payload, REGISTRATION_REPLY_TIMEOUT)
        if response is None:
            self._end(
                f"the runtime did not answer RegisterPlugin in {REGISTRATION_REPLY_TIMEOUT} s"
            )
            return
        if response.status_code != Code.OK:
            self._end(
                f"the runtime refused to register {index}-{name}: code {response.status_code}: "
                f"{response.status_message}"
            )
            return
        logger.debug("NRI: registered as %s-%s", index, name)
        with anyio.move_on_after(HANDSHAKE_TIMEOUT):
            await self._synchronized.wait()
        if not self._synchronized.is_set():
            self._end(f"the runtime did not configure and synchronize us in {HANDSHAKE_TIMEOUT} s")
            return
        self._on_synchronized()
        await self._send_unsolicited()

    async def _send_unsolicited(self) -> None:
        """Forever: send the queued unsolicited updates, one UpdateContainers at a time."""
        link = self._link
        while True:
            batch = await link._next_batch()
            updates = [ContainerUpdate(cid, pin.cpus, pin.mems) for cid, pin in batch if pin.cpus]
            if not updates:
                continue
            failed, reason = await self._update_containers(updates)
            link._sent += 1
            if failed:
                link._failed += 1
                logger.warning(
                    "NRI: UpdateContainers of %d containers failed (%s); they are re-pinned at "
                    "the next container event",
                    len(failed),
                    reason,
                )
                await self._invalidate(failed)
            else:
                logger.info("NRI: unsolicited update: %s", messages.describe_updates(updates))
            link._batch_done(batch, frozenset(failed))

    async def _update_containers(
        self, updates: list[ContainerUpdate]
    ) -> tuple[tuple[str, ...], str]:
        """Send one UpdateContainers: the containers that failed (or may have), and why."""
        everything = tuple(u.container_id for u in updates)
        try:
            payload = messages.update_containers_request(updates)
            response = await self._call("UpdateContainers", payload, UPDATE_CONTAINERS_TIMEOUT)
        except LocalProtocolError as exc:  # e.g. over the 4 MiB ttrpc limit: never sent
            return everything, f"cannot send it: {exc}"
        if response is None:
            return everything, f"no answer within {UPDATE_CONTAINERS_TIMEOUT} s"
        if response.status_code != Code.OK:
            # containerd sends the failed list AND an error, and ttrpc then drops the list:
            # any container of the call may have failed (reference §3.4).
            return everything, f"code {response.status_code}: {response.status_message}"
        try:
            failed = messages.read_update_containers_failed(response.payload)
        except RemoteProtocolError as exc:
            return everything, f"unreadable answer: {exc}"
        return failed, "the runtime reported them failed"

    async def _invalidate(self, container_ids: tuple[str, ...]) -> None:
        try:
            await request(self._owner, InvalidateContainers(container_ids))
        except DracpuError as exc:
            logger.error("NRI: could not tell the state owner about failed updates: %s", exc)

    # --- serving the Plugin service ---------------------------------------------------------------

    def _budget(self, request_: Call) -> float:
        """How long a handler may wait for the owner: the runtime's deadline minus a margin."""
        deadline = request_.timeout_nano / 1e9 if request_.timeout_nano > 0 else 0.0
        if deadline <= 0 or deadline > self._request_timeout:
            deadline = self._request_timeout
        return max(MIN_HANDLER_BUDGET, deadline - HANDLER_MARGIN)

    async def _handle(self, request_: Call) -> None:
        method = request_.method
        if request_.service != messages.PLUGIN_SERVICE:
            await self._answer_error(
                request_.stream_id, Code.UNIMPLEMENTED, f"service {request_.service}"
            )
            return
        handler = self._handlers.get(method)
        if handler is None:
            # ttrpc services.go wording; v0.12 runtimes then fall back to StateChange.
            await self._answer_error(request_.stream_id, Code.UNIMPLEMENTED, f"method {method}")
            return
        try:
            payload = await handler(request_)
        except _Refused as refused:
            await self._answer_error(request_.stream_id, refused.code, refused.message)
            return
        except RemoteProtocolError as exc:
            logger.warning("NRI: malformed %s request from the runtime: %s", method, exc)
            await self._answer_error(
                request_.stream_id, Code.INVALID_ARGUMENT, f"dra.cpu: malformed {method}: {exc}"
            )
            return
        except LocalProtocolError as exc:
            logger.error("NRI: cannot encode the %s reply: %s", method, exc)
            await self._answer_error(request_.stream_id, Code.INTERNAL, f"dra.cpu: {exc}")
            return
        await self._answer(request_.stream_id, payload)

    async def _ask(self, request_: Call, command: Command) -> tuple[object, dict[str, _Pin]]:
        """The owner's answer to ``command``, within the handler's budget; raises
        :class:`_Refused` with the status that fails the runtime's operation."""
        budget = self._budget(request_)
        name = type(command).__name__
        try:
            with anyio.fail_after(budget):
                return await self._link._ask(self._owner, command)
        except TimeoutError:
            error = DracpuError(f"the state owner did not answer {name} within {budget:.2f} s")
        except DracpuError as exc:
            error = exc
        code, message = messages.error_status(error)
        raise _Refused(code, message)

    async def _configure(self, request_: Call) -> bytes:
        runtime = messages.read_configure(request_.payload)
        if runtime.request_timeout > 0:
            self._request_timeout = runtime.request_timeout / 1000
        self._unsolicited = messages.unsolicited_updates_supported(runtime)
        link = self._link
        link._runtime = (runtime.runtime_name, runtime.runtime_version, runtime.NRI_version)
        link._unsolicited = self._unsolicited
        link._connected = True
        logger.info(
            "NRI: configured by %s %s (NRI %s) as %s-%s; events %#x; unsolicited updates %s",
            runtime.runtime_name or "an unnamed runtime",
            runtime.runtime_version or "?",
            runtime.NRI_version or "< v0.12",
            self._config.nri_plugin_index,
            self._config.nri_plugin_name,
            messages.SUBSCRIBED_EVENT_MASK,
            "on" if self._unsolicited else "off (shared containers widen at the next event)",
        )
        return messages.configure_response()

    async def _synchronize(self, request_: Call) -> bytes:
        part = messages.read_synchronize(request_.payload)
        self._sync_pods.extend(part.pods)
        self._sync_containers.extend(part.containers)
        if part.more:
            return messages.synchronize_response(more=True)
        pods, self._sync_pods = self._sync_pods, []
        containers, self._sync_containers = self._sync_containers, []
        command = Synchronize(
            messages.synchronized_containers(pods, containers),
            unsolicited_updates=self._unsolicited,
        )
        self._link._go_live()
        value, newer = await self._ask(request_, command)
        if not isinstance(value, Synchronized):
            raise _Refused(Code.INTERNAL, f"dra.cpu: unexpected answer to Synchronize: {value!r}")
        pins = self._link._reset(
            {u.container_id: _Pin(u.cpus, u.mems) for u in value.updates}, newer
        )
        for rejected in value.rejected:
            logger.warning(
                "NRI: container %s confined to the shared pool: %s",
                rejected.container_id,
                rejected.reason,
                extra={"container": rejected.container_id},
            )
        if value.unpinned:
            logger.warning(
                "NRI: the shared pool is empty: %d shared containers keep their CPUs",
                len(value.unpinned),
            )
        updates = _wire(pins)
        logger.info(
            "NRI: synchronized %d containers of %d pods (%d confined for unverifiable claims)",
            len(containers),
            len(pods),
            len(value.rejected),
        )
        self._synchronized.set()
        return messages.synchronize_response(updates)

    def _event_container(self, request_: Call) -> tuple[api.PodSandbox | None, api.Container]:
        pod, container = messages.read_container_event(request_.method, request_.payload)
        if container is None or not container.id:
            raise _Refused(Code.INVALID_ARGUMENT, f"dra.cpu: {request_.method} names no container")
        return pod, container

    async def _pin(
        self, request_: Call, command: Command, container_id: str
    ) -> tuple[_Pin, list[ContainerUpdate]]:
        """Ask the owner to pin a container; its pin and the other containers' updates."""
        value, newer = await self._ask(request_, command)
        if not isinstance(value, ContainerPinned):
            raise _Refused(Code.INTERNAL, f"dra.cpu: unexpected answer: {value!r}")
        pins = {u.container_id: _Pin(u.cpus, u.mems) for u in value.updates}
        pins[container_id] = _Pin(value.cpus, value.mems)
        effective = self._link._record(pins, newer)
        own = effective.pop(container_id)
        if not own.cpus:
            logger.error(
                "NRI: refusing to pin container %s to an empty cpuset (a bug in the state machine)",
                container_id,
            )
            raise _Refused(Code.INTERNAL, "dra.cpu: internal error: empty cpuset")
        updates = _wire(effective)
        return own, updates

    async def _create_container(self, request_: Call) -> bytes:
        pod, container = self._event_container(request_)
        command = CreateContainer(messages.container_command(pod, container))
        try:
            own, updates = await self._pin(request_, command, container.id)
        except _Refused as refused:
            logger.warning(
                "NRI: refusing to create %s: %s",
                command.container.describe(),
                refused.message,
                extra={"container": container.id},
            )
            raise
        logger.debug(
            "NRI: %s pinned to cpus %s mems %s; %d other containers updated",
            command.container.describe(),
            own.cpus,
            own.mems,
            len(updates),
            extra={"container": container.id},
        )
        return messages.create_container_response(container.id, own.cpus, own.mems, updates)

    async def _update_container(self, request_: Call) -> bytes:
        pod, container = self._event_container(request_)
        command = UpdateContainer(messages.container_command(pod, container))
        own, updates = await self._pin(request_, command, container.id)
        mine = ContainerUpdate(container.id, own.cpus, own.mems)
        return messages.update_container_response([mine, *updates])

    async def _stop_container(self, request_: Call) -> bytes:
        _, container = self._event_container(request_)
        try:
            value, newer = await self._ask(request_, StopContainer(container.id))
        except _Refused as refused:
            # Never fail a stop: the container stops anyway; the shared containers are widened
            # at a later event.
            logger.warning("NRI: StopContainer %s: %s", container.id, refused.message)
            return b""
        self._link._forget(container.id)
        if not isinstance(value, ContainerForgotten):
            return b""
        pins = {u.container_id: _Pin(u.cpus, u.mems) for u in value.updates}
        effective = self._link._record(pins, newer)
        updates = _wire(effective)
        return messages.stop_container_response(updates)

    async def _forget(self, request_: Call, container_id: str) -> None:
        try:
            await self._ask(request_, RemoveContainer(container_id))
        except _Refused as refused:
            logger.warning("NRI: RemoveContainer %s: %s", container_id, refused.message)
        self._link._forget(container_id)

    async def _remove_container(self, request_: Call) -> bytes:
        _, container = self._event_container(request_)
        await self._forget(request_, container.id)
        return b""  # RemoveContainerResponse is empty

    async def _state_change(self, request_: Call) -> bytes:
        event = messages.read_state_change(request_.payload)
        if event.event == api.REMOVE_CONTAINER and event.container.id:
            await self._forget(request_, event.container.id)
        return b""  # Empty

    async def _shutdown(self, request_: Call) -> bytes:
        logger.info("NRI: the runtime asked us to shut down; waiting for it to go away")
        return b""


# --- the task -------------------------------------------------------------------------------------


async def _tell_disconnected(owner: OwnerSend) -> None:
    try:
        await request(owner, RuntimeDisconnected())
    except DracpuError as exc:
        logger.error("NRI: could not tell the state owner the runtime is gone: %s", exc)


async def _connections(
    config: Config,
    owner: OwnerSend,
    link: NriLink,
    connect: Connect,
    delays_factory: Callable[[], Iterator[float]],
    first_sync: anyio.Event,
) -> None:
    """Connect, serve, reconnect: forever."""
    delays = delays_factory()
    socket = config.nri_socket
    failures = 0

    def synchronized() -> None:
        link._synchronized = True
        link._connections += 1
        first_sync.set()

    while True:
        try:
            stream = await connect(socket)
        except OSError as exc:
            failures += 1
            link._last_error = f"cannot connect to {socket}: {exc}"
            log = logger.warning if failures == 1 else logger.debug
            log("NRI: cannot connect to %s (attempt %d): %s; retrying", socket, failures, exc)
            await anyio.sleep(next(delays))
            continue
        connection = _Connection(stream, config, owner, link, synchronized)
        reason = "connection ended"
        try:
            async with stream:
                reason = await connection.serve()
        finally:
            link._connection_ended(reason)
        if connection.synchronized:
            delays = delays_factory()
            failures = 0
        logger.warning("NRI: connection to %s ended: %s; reconnecting", socket, reason)
        await _tell_disconnected(owner)
        await anyio.sleep(next(delays))


async def run(
    config: Config,
    owner_send: OwnerSend,
    *,
    link: NriLink | None = None,
    connect: Connect = connect_unix,
    delays: Callable[[], Iterator[float]] = reconnect_delays,
    start_timeout: float = START_TIMEOUT,
    task_status: TaskStatus[None] = TASK_STATUS_IGNORED,
) -> None:
    """Be the node's NRI plugin until cancelled (see the module docstring).

    ``owner_send``: this task's own clone of the state owner's command stream (closed when the
    task ends). ``link``: the object whose :meth:`NriLink.submit` the owner's executor calls
    for ``UpdateContainers`` effects (a private one if ``None``: unsolicited updates are then
    dropped). ``connect`` opens ``config.nri_socket``; ``delays`` makes the reconnect backoff.
    ``task_status.started()`` comes after the first synchronized connection or after
    ``start_timeout`` seconds, whichever is first.
    """
    link = NriLink() if link is None else link
    first_sync = anyio.Event()
    async with owner_send, anyio.create_task_group() as tg:
        tg.start_soon(partial(_connections, config, owner_send, link, connect, delays, first_sync))
        with anyio.move_on_after(start_timeout):
            await first_sync.wait()
        if not first_sync.is_set():
            logger.warning(
                "NRI: no runtime synchronized within %g s (%s); starting anyway: containers "
                "are pinned once it connects",
                start_timeout,
                link._last_error or "still trying",
            )
        task_status.started()
