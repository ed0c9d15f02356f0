"""One NRI connection to the runtime: the multiplexed socket, the handlers, the update sender.

One module, a little longer than most: the handlers and the sender share one connection's
lifetime and its ordering rule, and splitting them would pass the connection's state between
modules (the queue and the rule itself live in :mod:`dracpu.tasks.nri_link`).

On the socket, :class:`~dracpu.wire.mux.MuxConnection` carries two ttrpc connections: conn 1,
where we serve ``nri.pkg.api.v1alpha1.Plugin`` to the runtime, and conn 2, where we call the
runtime's ``nri.pkg.api.v1alpha1.Runtime`` (containerd/nri ``pkg/net/multiplex``,
``pkg/adaptation``). The sequence of a connection:

1. the reader serves conn 1 from the start, because ``Configure`` may arrive before the answer
   to our registration;
2. ``RegisterPlugin{name, index, NRI_version}`` on conn 2 (``dra.cpu``/``00`` by default, and
   the NRI release our API follows, :data:`~dracpu.adapters.nri_messages.NRI_VERSION`);
3. the runtime calls ``Configure``: we subscribe to CreateContainer, PostStartContainer,
   UpdateContainer, StopContainer and RemoveContainer (mask 0x6c8, valid on every runtime since
   NRI v0.2) and note the runtime's name and versions: unsolicited updates are allowed only
   with NRI >= v0.12.1 (:func:`~dracpu.adapters.nri_messages.unsolicited_updates_supported`);
4. the runtime calls ``Synchronize`` (possibly in parts, ``more``): the state owner gets every
   container (:class:`~dracpu.core.commands.Synchronize`) and the reply re-pins all of them;
5. events: ``CreateContainer`` pins the new container (its claims' CPUs, plus the shared pool
   for a ``sharedPool`` claim, or the shared pool) and the same reply moves every container that
   follows the pool off newly claimed CPUs; ``UpdateContainer`` and
   ``StopContainer`` answer likewise; ``PostStartContainer`` (dedicated RPC or
   ``StateChange``) sends a container that started its pin again if a newer decision may have
   been lost while it was starting (:class:`~dracpu.core.commands.ContainerStarted`);
   ``RemoveContainer`` (likewise) forgets the container; the other Plugin methods answer
   UNIMPLEMENTED (code 12), so a v0.12 runtime falls back to ``StateChange`` for events we did
   not subscribe to anyway;
6. once synchronized, the sender sends the link's queued unsolicited updates
   (:class:`~dracpu.tasks.nri_link.NriLink`), one ``UpdateContainers`` at a time.

Every reply's pins and every ``UpdateContainers`` go through the link's ordering rule (pins from
the committed state, re-sent when a newer decision was made while they were on their way); a
container the runtime failed to update is reported to the owner
(:class:`~dracpu.core.commands.InvalidateContainers`, with the failed decisions' numbers).

A refusal of the state owner (a spoofed or malformed ``DRA_CPUSET_*`` env, a claim not prepared
here, a claim not reserved for the container's pod) fails the container's creation with a status
code (fail closed); so does an owner that does not answer well before the runtime's deadline
(2 s by default): a plugin that times out is dropped and the container is created *unpinned*, so
we answer an error instead. Handlers do no I/O besides the owner round trip and their reply,
with one exception: before a container is refused (or confined, at Synchronize) because a claim
is not reserved for its pod, the claim is read once more, within the deadline
(:mod:`dracpu.tasks.claim_recheck`), and the owner decides again. A malformed message is
answered with INVALID_ARGUMENT; EOF, a socket error or a protocol violation ends the connection
(the task reconnects), and bugs (non-DracpuError exceptions) end the task.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio
import anyio.abc
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream
from anyio.streams.memory import MemoryObjectSendStream

from dracpu._gen.pb2.nri.v1alpha1 import api_pb2 as api
from dracpu.adapters import nri_messages as messages
from dracpu.adapters import ttrpc_envelopes as envelopes
from dracpu.adapters.ttrpc_envelopes import Answer, Call
from dracpu.config import Config
from dracpu.core.commands import (
    Command,
    Container,
    ContainerStarted,
    CreateContainer,
    InvalidateContainers,
    RemoveContainer,
    StopContainer,
    Synchronize,
    UpdateContainer,
)
from dracpu.core.effects import ContainerForgotten, ContainerPinned, ContainerUpdate, Synchronized
from dracpu.errors import (
    ClaimNotReservedError,
    DracpuError,
    LocalProtocolError,
    RemoteProtocolError,
)
from dracpu.tasks.claim_recheck import ClaimRecheck, Recheck
from dracpu.tasks.nri_link import NriLink
from dracpu.tasks.state_owner import Request, request
from dracpu.wire.events import (
    NEED_DATA,
    ConnectionClosed,
    TtrpcRequest,
    TtrpcResponse,
    TtrpcStreamError,
)
from dracpu.wire.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, MuxConnection
from dracpu.wire.status import Code
from dracpu.wire.ttrpc import Role, TtrpcConnection

__all__ = [
    "DEFAULT_REQUEST_TIMEOUT",
    "HANDLER_MARGIN",
    "HANDSHAKE_TIMEOUT",
    "REGISTRATION_REPLY_TIMEOUT",
    "UPDATE_CONTAINERS_TIMEOUT",
    "NriConnection",
    "OwnerSend",
]

logger = logging.getLogger(__name__)

READ_SIZE = 65536  # bytes per socket read; the mux reassembles frames of any size
# nri pkg/api/timeouts.go DefaultPluginRequestTimeout: the runtime's deadline for each call, used
# until Configure tells us the configured one (ConfigureRequest.request_timeout, NRI v0.7+).
DEFAULT_REQUEST_TIMEOUT = 2.0
# Answer this long before the runtime's deadline: past it the runtime drops us and creates the
# container without our cpuset (nri pkg/adaptation/plugin.go), so an error answer in time is
# the safe one.
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

OwnerSend = MemoryObjectSendStream[Request[Command]]


class _Refused(Exception):
    """A handler answers the runtime with this error status. ``noted``: a copy of claims that
    noted the container's pod as a copier before (reported then; no look, a DEBUG line)."""

    def __init__(self, code: int, message: str, *, noted: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.noted = noted


@dataclass(frozen=True, slots=True)
class _Reply:
    """A handler's answer: the response payload and the pins it carries (checked by the link's
    ordering rule once the reply is written)."""

    payload: bytes
    pins: Sequence[ContainerUpdate] = ()
    synchronizes: bool = False  # the last part of Synchronize: the connection is synchronized


class _Call:
    """A call of ours on conn 2 waiting for its response."""

    __slots__ = ("done", "response")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.response: Answer | None = None


Handler = Callable[[Call], Awaitable[_Reply]]


# The events whose answer carries nothing, as StateChange delivers them (runtimes before NRI
# v0.12 have no dedicated RPC for them): the owner's command for each.
_NOTICES: dict[int, type[ContainerStarted] | type[RemoveContainer]] = {
    api.POST_START_CONTAINER: ContainerStarted,
    api.REMOVE_CONTAINER: RemoveContainer,
}


class NriConnection:
    """One socket to the runtime: the mux, both ttrpc connections, the handlers, the sender.

    ``on_synchronized`` is called once, after the first Synchronize was answered;
    ``on_configured`` once the runtime's ``Configure`` is handled, just before its answer goes
    out (the runtime asks for the ``Synchronize`` next). ``recheck`` reads claims again before a
    container of a pod they are not reserved for is refused (``None``: never). ``leaving_pod``:
    the UID of the pod of the dracpu that handed this one the state dir, whose containers are
    left out of ``Synchronize`` (CRI-O lists them while they stop, and an update of one that has
    stopped fails the whole synchronization: ``docs/architecture.md``, "Rolling update").
    """

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        config: Config,
        owner: OwnerSend,
        link: NriLink,
        on_synchronized: Callable[[], None],
        recheck: ClaimRecheck | None = None,
        on_configured: Callable[[], None] | None = None,
        leaving_pod: str | None = None,
    ) -> None:
        self._stream = stream
        self._leaving_pod = leaving_pod
        self._config = config
        self._owner = owner
        self._link = link
        self._on_synchronized = on_synchronized
        self._on_configured = on_configured
        self._recheck = recheck
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
            "PostStartContainer": self._post_start_container,
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

    async def _write(self, conn_id: int, message: bytes) -> bool:
        """Write one message; ``False`` (and the connection ends) when the socket fails."""
        data = self._mux.send(conn_id, message)
        try:
            async with self._write_lock:
                await self._stream.send(data)
        except (BrokenResourceError, ClosedResourceError, OSError) as exc:
            self._end(f"socket error while writing: {exc!r}")
            return False
        return True

    async def _answer(self, stream_id: int, reply: _Reply) -> None:
        try:
            data = envelopes.response_data(reply.payload)
            message = self._server.send_response(stream_id, data)
        except LocalProtocolError as exc:  # a reply over the 4 MiB ttrpc limit
            logger.error("NRI: cannot send the reply on stream %d: %s", stream_id, exc)
            await self._answer_error(stream_id, Code.RESOURCE_EXHAUSTED, f"dra.cpu: {exc}")
            return
        if await self._write(PLUGIN_SERVICE_CONN, message):
            self._link.written(reply.pins)
            if reply.synchronizes:
                self._synchronized.set()  # answered: the runtime has every container's pin

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
        """Forever: send the link's queued updates, one UpdateContainers at a time."""
        link = self._link
        while True:
            batch = await link.next_batch()
            try:
                if batch:
                    await self._send_batch(batch)
            finally:
                link.batch_done()

    async def _send_batch(self, batch: list[ContainerUpdate]) -> None:
        link = self._link
        failed, reason = await self._update_containers(batch)
        link.update_sent(failed=bool(failed))
        if failed:
            logger.warning(
                "NRI: UpdateContainers of %d containers failed (%s); they are re-pinned at "
                "the next container event",
                len(failed),
                reason,
            )
            pins = tuple((u.container_id, u.seq) for u in batch if u.container_id in failed)
            await self._invalidate(pins)
        else:
            logger.info("NRI: unsolicited update: %s", messages.describe_updates(batch))
        link.written(u for u in batch if u.container_id not in failed)

    async def _update_containers(
        self, updates: list[ContainerUpdate]
    ) -> tuple[frozenset[str], str]:
        """Send one UpdateContainers: the containers that failed (or may have), and why."""
        everything = frozenset(u.container_id for u in updates)
        try:
            payload = messages.update_containers_request(updates)
            response = await self._call("UpdateContainers", payload, UPDATE_CONTAINERS_TIMEOUT)
        except LocalProtocolError as exc:  # e.g. over the 4 MiB ttrpc limit: never sent
            return everything, f"cannot send it: {exc}"
        if response is None:
            # A runtime that stops answering is closed and reconnected (its Synchronize re-pins
            # every container); upstream exits instead (pkg/driver/nri_lifecycle.go).
            reason = (
                f"the runtime did not answer UpdateContainers within {UPDATE_CONTAINERS_TIMEOUT} s"
            )
            self._end(reason)
            return everything, reason
        if response.status_code != Code.OK:
            # containerd sends the failed list AND an error, and ttrpc then drops the list:
            # any container of the call may have failed (nri pkg/adaptation, updateContainers).
            return everything, f"code {response.status_code}: {response.status_message}"
        try:
            failed = messages.read_update_containers_failed(response.payload)
        except RemoteProtocolError as exc:
            return everything, f"unreadable answer: {exc}"
        return frozenset(failed), "the runtime reported them failed"

    async def _invalidate(self, pins: tuple[tuple[str, int], ...]) -> None:
        try:
            await request(self._owner, InvalidateContainers(pins))
        except DracpuError as exc:
            logger.error("NRI: could not tell the state owner about failed updates: %s", exc)

    # --- serving the Plugin service ---------------------------------------------------------------

    def _deadline(self, call: Call) -> float:
        """Until when (``anyio.current_time()``) a handler may work on its answer: the
        runtime's deadline minus a margin."""
        deadline = call.timeout_nano / 1e9 if call.timeout_nano > 0 else 0.0
        if deadline <= 0 or deadline > self._request_timeout:
            deadline = self._request_timeout
        return anyio.current_time() + max(MIN_HANDLER_BUDGET, deadline - HANDLER_MARGIN)

    async def _handle(self, call: Call) -> None:
        self._link.answering(1)
        try:
            await self._handle_call(call)
        finally:
            self._link.answering(-1)

    async def _handle_call(self, call: Call) -> None:
        method = call.method
        if call.service != messages.PLUGIN_SERVICE:
            await self._answer_error(call.stream_id, Code.UNIMPLEMENTED, f"service {call.service}")
            return
        handler = self._handlers.get(method)
        if handler is None:
            # ttrpc services.go wording; v0.12 runtimes then fall back to StateChange.
            await self._answer_error(call.stream_id, Code.UNIMPLEMENTED, f"method {method}")
            return
        try:
            reply = await handler(call)
        except _Refused as refused:
            await self._answer_error(call.stream_id, refused.code, refused.message)
            return
        except RemoteProtocolError as exc:
            logger.warning("NRI: malformed %s request from the runtime: %s", method, exc)
            await self._answer_error(
                call.stream_id, Code.INVALID_ARGUMENT, f"dra.cpu: malformed {method}: {exc}"
            )
            return
        except LocalProtocolError as exc:
            logger.error("NRI: cannot encode the %s reply: %s", method, exc)
            await self._answer_error(call.stream_id, Code.INTERNAL, f"dra.cpu: {exc}")
            return
        await self._answer(call.stream_id, reply)

    async def _ask(self, command: Command, deadline: float) -> object:
        """The owner's answer to ``command`` by ``deadline`` (:meth:`_deadline`); raises
        :class:`_Refused` with the status that fails the runtime's operation."""
        name = type(command).__name__
        try:
            with anyio.fail_at(deadline):
                return await request(self._owner, command)
        except TimeoutError:
            error = DracpuError(f"the state owner did not answer {name} before the deadline")
        except DracpuError as exc:
            error = exc
        code, message = messages.error_status(error)
        noted = isinstance(error, ClaimNotReservedError) and error.noted
        raise _Refused(code, message, noted=noted)

    async def _look_again(self, containers: Sequence[Container], deadline: float) -> Recheck:
        """Read the claims not reserved for these containers' pods once more (see
        :mod:`dracpu.tasks.claim_recheck`)."""
        if self._recheck is None:
            return Recheck()
        return await self._recheck.recheck(containers, deadline)

    async def _configure(self, call: Call) -> _Reply:
        runtime = messages.read_configure(call.payload)
        if runtime.request_timeout > 0:
            self._request_timeout = runtime.request_timeout / 1000
        self._unsolicited = messages.unsolicited_updates_supported(runtime)
        link = self._link
        link.configured(
            (runtime.runtime_name, runtime.runtime_version, runtime.NRI_version),
            unsolicited=self._unsolicited,
        )
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
        if self._on_configured is not None:
            self._on_configured()
        return _Reply(messages.configure_response())

    async def _synchronize(self, call: Call) -> _Reply:
        part = messages.read_synchronize(call.payload)
        self._sync_pods.extend(part.pods)
        self._sync_containers.extend(part.containers)
        if part.more:
            return _Reply(messages.synchronize_response(more=True))
        pods, self._sync_pods = self._sync_pods, []
        containers, self._sync_containers = self._sync_containers, []
        listed = messages.synchronized_containers(pods, containers)
        kept = tuple(c for c in listed if c.pod_uid != self._leaving_pod)
        if len(kept) < len(listed):
            logger.info(
                "NRI: %d containers of the previous dracpu's pod %s are left out of Synchronize",
                len(listed) - len(kept),
                self._leaving_pod,
            )
        command = Synchronize(kept, unsolicited_updates=self._unsolicited)
        self._link.start(unsolicited=self._unsolicited)
        deadline = self._deadline(call)
        value = await self._ask(command, deadline)
        news: set[str] = set()  # confined for a reason not reported before
        if isinstance(value, Synchronized) and value.rejected:
            news = {r.container_id for r in value.rejected if not r.noted}
            suspects = [c for c in command.containers if c.id in news]
            if (await self._look_again(suspects, deadline)).changed:
                value = await self._ask(command, deadline)
        if not isinstance(value, Synchronized):
            raise _Refused(Code.INTERNAL, f"dra.cpu: unexpected answer to Synchronize: {value!r}")
        for rejected in value.rejected:
            # A copier noted by an earlier look was reported then (at most once per pod and
            # claim, across restarts: the note is checkpointed).
            logger.log(
                logging.WARNING if rejected.container_id in news else logging.DEBUG,
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
        pins = self._link.fresh(value.updates)
        logger.info(
            "NRI: synchronized %d containers of %d pods (%d confined for unverifiable claims)",
            len(containers),
            len(pods),
            len(value.rejected),
        )
        return _Reply(messages.synchronize_response(pins), pins, synchronizes=True)

    def _event_container(self, call: Call) -> tuple[api.PodSandbox | None, api.Container]:
        pod, container = messages.read_container_event(call.method, call.payload)
        if container is None or not container.id:
            raise _Refused(Code.INVALID_ARGUMENT, f"dra.cpu: {call.method} names no container")
        return pod, container

    async def _pin(
        self, call: Call, command: CreateContainer | UpdateContainer
    ) -> tuple[ContainerUpdate, list[ContainerUpdate]]:
        """Ask the owner to pin a container: its pin and the other containers' updates, each
        the newest decision. A refusal for a claim not reserved for the container's pod is
        decided again after a fresh look at the claim, if that changed its pods."""
        deadline = self._deadline(call)
        try:
            value = await self._ask(command, deadline)
        except _Refused as refused:
            if refused.noted:
                raise
            look = await self._look_again((command.container,), deadline)
            if not look.changed:
                raise _Refused(refused.code, look.explain(refused.message)) from None
            value = await self._ask(command, deadline)
        if not isinstance(value, ContainerPinned):
            raise _Refused(Code.INTERNAL, f"dra.cpu: unexpected answer: {value!r}")
        own = self._link.fresh_pin(value.pin)
        if not own.cpus:
            logger.error(
                "NRI: refusing to pin container %s to an empty cpuset (a bug in the state machine)",
                own.container_id,
            )
            raise _Refused(Code.INTERNAL, "dra.cpu: internal error: empty cpuset")
        return own, self._link.fresh(value.updates)

    async def _create_container(self, call: Call) -> _Reply:
        pod, container = self._event_container(call)
        command = CreateContainer(messages.container_command(pod, container))
        try:
            own, updates = await self._pin(call, command)
        except _Refused as refused:
            logger.log(
                logging.DEBUG if refused.noted else logging.WARNING,
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
        payload = messages.create_container_response(container.id, own.cpus, own.mems, updates)
        return _Reply(payload, [own, *updates])

    async def _update_container(self, call: Call) -> _Reply:
        pod, container = self._event_container(call)
        command = UpdateContainer(messages.container_command(pod, container))
        own, updates = await self._pin(call, command)
        pins = [own, *updates]
        return _Reply(messages.update_container_response(pins), pins)

    async def _stop_container(self, call: Call) -> _Reply:
        _, container = self._event_container(call)
        try:
            value = await self._ask(StopContainer(container.id), self._deadline(call))
        except _Refused as refused:
            # Never fail a stop: the container stops anyway; the shared containers are widened
            # at a later event.
            logger.warning("NRI: StopContainer %s: %s", container.id, refused.message)
            return _Reply(b"")
        if not isinstance(value, ContainerForgotten):
            return _Reply(b"")
        pins = self._link.fresh(value.updates)
        return _Reply(messages.stop_container_response(pins), pins)

    async def _tell(self, call: Call, command: ContainerStarted | RemoveContainer) -> None:
        """Tell the owner of an event whose answer carries nothing: a refusal is logged, never
        answered (the runtime goes on anyway: the container starts, or is gone)."""
        try:
            await self._ask(command, self._deadline(call))
        except _Refused as refused:
            name = type(command).__name__
            logger.warning("NRI: %s %s: %s", name, command.container_id, refused.message)

    async def _remove_container(self, call: Call) -> _Reply:
        _, container = self._event_container(call)
        await self._tell(call, RemoveContainer(container.id))
        return _Reply(b"")  # RemoveContainerResponse is empty

    async def _post_start_container(self, call: Call) -> _Reply:
        _, container = self._event_container(call)
        await self._tell(call, ContainerStarted(container.id))
        return _Reply(b"")  # PostStartContainerResponse is empty

    async def _state_change(self, call: Call) -> _Reply:
        event = messages.read_state_change(call.payload)
        notice = _NOTICES.get(event.event)
        if notice is not None and event.container.id:
            await self._tell(call, notice(event.container.id))
        return _Reply(b"")  # Empty

    async def _shutdown(self, call: Call) -> _Reply:
        logger.info("NRI: the runtime asked us to shut down; waiting for it to go away")
        return _Reply(b"")
