"""The fake runtime's NRI side: it accepts the plugin's connection, runs the handshake, calls
the plugin on mux conn 1 and serves its calls (RegisterPlugin, UpdateContainers) on conn 2."""

from __future__ import annotations

import time
from contextlib import suppress

import anyio
import anyio.abc
from google.protobuf.message import DecodeError, Message

from dracpu.sim import _nri_framing as framing
from dracpu.sim._pb2.nri.v1alpha1 import api_pb2 as nri
from dracpu.sim.runtime_model import (
    _PLUGIN_INDEX,
    _PLUGIN_NAME,
    _SEND_ERRORS,
    CODE_CANCELLED,
    CODE_INVALID_ARGUMENT,
    CODE_RESOURCE_EXHAUSTED,
    CODE_UNAVAILABLE,
    CODE_UNIMPLEMENTED,
    CODE_UNKNOWN,
    MIN_SYNC_OBJECTS,
    NRI_V0_7,
    NRI_V0_12,
    PLUGIN_SERVICE,
    READ_CHUNK,
    RUNTIME_SERVICE,
    SYNC_SHRINK_MAX,
    UPDATE_FAILED,
    Call,
    M,
    PluginInfo,
    RuntimeBase,
    _Connection,
    _Pending,
    _Result,
)


def _envelope_size(method: str, request: Message) -> int:
    """Bytes of the ttrpc Request envelope (the data the 4 MiB limit applies to)."""
    message = framing.request_message(
        1, PLUGIN_SERVICE, method, request.SerializeToString(deterministic=True), 1
    )
    return len(message) - framing.TTRPC_HEADER_LEN


def _shrink(pods: int, containers: int, size: int) -> tuple[int, int] | None:
    """nri adaptation/plugin.go recalcObjsPerSyncMsg; None when it gives up."""
    if pods + containers <= MIN_SYNC_OBJECTS:
        return None
    factor = min(framing.TTRPC_MAX_DATA / size, SYNC_SHRINK_MAX)
    pods, containers = int(pods * factor), int(containers * factor)
    if pods + containers < MIN_SYNC_OBJECTS:
        pods = containers = MIN_SYNC_OBJECTS // 2
    return pods, containers


class NriServer(RuntimeBase):
    """The socket, the handshake and both ttrpc directions (a part of FakeRuntime)."""

    # --- ttrpc client on conn 1 -------------------------------------------------------------

    async def _call(
        self,
        conn: _Connection,
        method: str,
        request: Message,
        response_type: type[M],
        *,
        deadline: float,
    ) -> _Result[M]:
        """One call to the plugin; timeouts and closed connections close the plugin (fatal)."""
        stream_id = conn.next_stream_id
        conn.next_stream_id += 2
        pending = _Pending()
        conn.pending[stream_id] = pending
        started = anyio.current_time()
        timeout_nano = max(0, int((deadline - started) * 1e9))
        message = framing.request_message(
            stream_id,
            PLUGIN_SERVICE,
            method,
            request.SerializeToString(deterministic=True),
            timeout_nano,
        )
        sent = True
        try:
            with anyio.CancelScope(deadline=deadline) as scope:
                try:
                    await conn.send(framing.PLUGIN_SERVICE_CONN, message)
                except _SEND_ERRORS:
                    sent = False
                else:
                    await pending.done.wait()
        finally:
            conn.pending.pop(stream_id, None)
        result: _Result[M]
        if scope.cancelled_caught:
            result = _Result("timeout", None, 4, "context deadline exceeded")
            self._close(conn, f"failed to handle {method} request: context deadline exceeded")
        elif not sent or pending.reply is None:
            result = _Result("closed", None, 0, "ttrpc: closed")
            self._close(conn, f"failed to handle {method} request: ttrpc: closed")
        else:
            result = self._decode_reply(conn, method, pending, response_type)
        self.log.append(
            Call(
                caller="runtime",
                method=method,
                stream_id=stream_id,
                request=request,
                response=result.response,
                code=result.code,
                message=result.message,
                outcome=result.outcome,
                seconds=anyio.current_time() - started,
                connection=conn.number,
                ended=time.monotonic(),
            )
        )
        return result

    def _decode_reply(
        self, conn: _Connection, method: str, pending: _Pending, response_type: type[M]
    ) -> _Result[M]:
        if pending.oversized:
            # ttrpc channel.go recv: the stream gets RESOURCE_EXHAUSTED, the connection stays.
            return _Result(
                "error",
                None,
                CODE_RESOURCE_EXHAUSTED,
                f"message length {pending.oversized} exceed maximum message size of "
                f"{framing.TTRPC_MAX_DATA}",
            )
        assert pending.reply is not None
        try:
            envelope = framing.decode_response(pending.reply)
            if envelope.HasField("status") and envelope.status.code != 0:
                return _Result("error", None, envelope.status.code, envelope.status.message)
            response = response_type()
            response.ParseFromString(envelope.payload)
        except DecodeError as exc:
            self._note("violation", f"{method} reply does not parse: {exc}", conn)
            self._close(conn, f"failed to handle {method} request: bad reply")
            return _Result("closed", None, 0, f"bad reply: {exc}")
        return _Result("ok", response)

    def _close(self, conn: _Connection, reason: str) -> None:
        if not conn.close_reason:
            self._note("closed", reason, conn)
        conn.close(reason)
        self._signal()

    # --- accepting and serving connections --------------------------------------------------

    async def _listen(self) -> None:
        path = anyio.Path(self.socket_path)
        await path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if await path.is_socket():
            await path.unlink()  # adaptation.go startListener: remove a stale socket first
        listener = await anyio.create_unix_listener(self.socket_path)
        self._accept_stopped = anyio.Event()
        await self._tg.start(self._accept_loop, listener)
        self._note("listening", str(path))

    async def _accept_loop(
        self,
        listener: anyio.abc.SocketListener,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        # Stopped by closing the listener (_stop_all), never by cancelling accept(): like a
        # blocked receive(), a cancelled accept() can race with the selector (see close()).
        self._listener = listener
        task_status.started()
        try:
            while True:
                try:
                    stream = await listener.accept()
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    return
                self.connections += 1
                conn = _Connection(self.connections, stream, strict=self.strict_framing)
                self._live.add(conn)
                old = self._conn
                if old is not None:
                    self._close(old, "replaced by a new plugin connection")
                self._conn = conn
                self._note("connected", "", conn)
                self._tg.start_soon(self._run_connection, conn)
                # adaptation.go acceptPluginConnections: one handshake at a time
                await conn.handshake_done.wait()
        finally:
            self._accept_stopped.set()

    async def _run_connection(self, conn: _Connection) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read_loop, conn)
                with conn.scope:
                    await self._handshake(conn)
                conn.handshake_done.set()
        finally:
            self._live.discard(conn)
            conn.handshake_done.set()
            for pending in conn.pending.values():
                pending.done.set()
            with anyio.CancelScope(shield=True):
                await conn.stream.aclose()
            if not conn.close_reason:
                conn.close_reason = "connection ended"
            self._note("disconnected", conn.close_reason, conn)
            if self._conn is conn:
                self._conn = None
            conn.closed.set()
            self._signal()

    async def _handshake(self, conn: _Connection) -> None:
        # adaptation/plugin.go start(): wait for RegisterPlugin up to the registration timeout.
        with anyio.move_on_after(self.registration_timeout):
            await conn.registered.wait()
        if not conn.registered.is_set():
            self._close(conn, "plugin registration timed out")
            return
        if conn.registration_error:
            self._close(conn, f"failed to register plugin: {conn.registration_error}")
            return
        configure = nri.ConfigureRequest(
            config=self.config,
            runtime_name=self.runtime_name,
            runtime_version=self.runtime_version,
        )
        if self._nri >= NRI_V0_7:
            configure.registration_timeout = round(self.registration_timeout * 1000)
            configure.request_timeout = round(self.plugin_timeout * 1000)
        if self._nri >= NRI_V0_12:
            configure.NRI_version = self.nri_version
        deadline = anyio.current_time() + self.plugin_timeout
        result = await self._call(
            conn, "Configure", configure, nri.ConfigureResponse, deadline=deadline
        )
        if result.response is None:
            self._close(conn, f"failed to configure plugin: {result.outcome} {result.message}")
            return
        requested = result.response.events
        events = requested or self.valid_events
        if events & ~self.valid_events:
            self._close(conn, f"invalid plugin events: 0x{events & ~self.valid_events:x}")
            return
        info = PluginInfo(
            name=conn.name,
            index=conn.index,
            events=events,
            requested_events=requested,
            nri_version=conn.plugin_nri_version,
            connection=conn.number,
        )
        if not await self._synchronize(conn):
            return
        conn.info = info
        self._note("ready", f"{info.index}-{info.name} events=0x{info.events:x}", conn)
        self._signal()

    async def _synchronize(self, conn: _Connection) -> bool:
        """nri adaptation/plugin.go synchronize, under containerd's lock (nri.go syncPlugin)."""
        async with self._lock:
            pods = [pod.to_pb() for pod in self.pods.values()]
            containers = [container.to_pb() for container in self.containers.values()]
            deadline = anyio.current_time() + self.plugin_timeout
            can_split = self._nri >= NRI_V0_7
            pods_per, ctrs_per = len(pods), len(containers)
            if self.sync_chunk is not None and can_split:
                pods_per = min(pods_per, self.sync_chunk)
                ctrs_per = min(ctrs_per, self.sync_chunk)
            while True:
                more = len(pods) > pods_per or len(containers) > ctrs_per
                request = nri.SynchronizeRequest(
                    pods=pods[:pods_per], containers=containers[:ctrs_per]
                )
                if more:
                    request.more = True
                size = _envelope_size("Synchronize", request)
                if size > framing.TTRPC_MAX_DATA:
                    # The Go client refuses to send it (OversizedMessageErr); shrink and retry.
                    shrunk = _shrink(pods_per, ctrs_per, size) if can_split else None
                    if shrunk is None:
                        self._close(conn, "failed to synchronize plugin with split messages")
                        return False
                    pods_per, ctrs_per = shrunk
                    self._note(
                        "sync-split",
                        f"{size} bytes: {pods_per} pods, {ctrs_per} containers per message",
                        conn,
                    )
                    continue
                result = await self._call(
                    conn, "Synchronize", request, nri.SynchronizeResponse, deadline=deadline
                )
                if result.response is None:
                    self._close(
                        conn, f"failed to synchronize plugin: {result.outcome} {result.message}"
                    )
                    return False
                if not more:
                    break
                if result.response.update or result.response.more != more:
                    self._close(conn, "plugin does not handle split sync requests")
                    return False
                pods, containers = pods[pods_per:], containers[ctrs_per:]
                pods_per, ctrs_per = min(pods_per, len(pods)), min(ctrs_per, len(containers))
            # containerd syncPlugin: failures of the returned updates are only logged.
            self._apply_updates(result.response.update)
            return True

    async def _read_loop(self, conn: _Connection) -> None:
        parser = framing.MuxFrameParser()
        try:
            while True:
                try:
                    data = await conn.stream.receive(READ_CHUNK)
                except (anyio.EndOfStream, *_SEND_ERRORS):
                    break
                for conn_id, payload in parser.feed(data):
                    reader = conn.readers.get(conn_id)
                    if reader is None:
                        # nri mux.go reader: frames for conns nobody opened are dropped.
                        self._note("dropped-frame", f"conn {conn_id}, {len(payload)} bytes", conn)
                        continue
                    for message in reader.feed(payload):
                        await self._dispatch(conn, conn_id, message)
        except framing.FramingError as exc:
            self._note("violation", str(exc), conn)
            self._close(conn, f"protocol error: {exc}")
            return
        partial = parser.buffered or not all(r.idle for r in conn.readers.values())
        if partial and not conn.close_reason:  # our own hang-up may cut a message short
            self._note("violation", "the plugin closed the socket inside a frame", conn)
        self._close(conn, "plugin closed the connection")

    async def _dispatch(
        self, conn: _Connection, conn_id: int, message: framing.TtrpcMessage
    ) -> None:
        if conn_id == framing.PLUGIN_SERVICE_CONN:
            if message.type != framing.TYPE_RESPONSE:
                self._note(
                    "violation", f"message type {message.type} from the plugin on conn 1", conn
                )
                return
            pending = conn.pending.get(message.stream_id)
            if pending is None or pending.done.is_set():
                # ttrpc client.go: "received message on inactive stream", dropped.
                self._note("stray-response", f"stream {message.stream_id}", conn)
                return
            pending.reply = message.data
            pending.oversized = message.oversized
            pending.done.set()
            return
        await self._serve_request(conn, message)

    # --- ttrpc server on conn 2 -------------------------------------------------------------

    async def _reply(
        self, conn: _Connection, stream_id: int, payload: bytes = b"", code: int = 0, text: str = ""
    ) -> None:
        message = framing.response_message(stream_id, payload, code=code, message=text)
        with suppress(*_SEND_ERRORS):
            await conn.send(framing.RUNTIME_SERVICE_CONN, message)

    async def _serve_request(self, conn: _Connection, message: framing.TtrpcMessage) -> None:
        stream_id = message.stream_id
        if message.type != framing.TYPE_REQUEST:
            # ttrpc server.go ignores unknown types; a response or data frame is a plugin bug.
            self._note("violation", f"message type {message.type} from the plugin on conn 2", conn)
            return
        if stream_id % 2 == 0:
            self._note("violation", f"request on even stream id {stream_id}", conn)
            await self._reply(
                conn,
                stream_id,
                code=CODE_INVALID_ARGUMENT,
                text="StreamID must be odd for client initiated streams",
            )
            return
        if stream_id <= conn.last_request_id:
            self._note("violation", f"request stream id {stream_id} reused or decreasing", conn)
            await self._reply(
                conn,
                stream_id,
                code=CODE_INVALID_ARGUMENT,
                text="StreamID cannot be re-used and must increment",
            )
            return
        conn.last_request_id = stream_id
        if message.oversized:
            await self._reply(
                conn,
                stream_id,
                code=CODE_RESOURCE_EXHAUSTED,
                text=f"message length {message.oversized} exceed maximum message size of "
                f"{framing.TTRPC_MAX_DATA}",
            )
            return
        try:
            envelope = framing.decode_request(message.data)
        except DecodeError as exc:
            self._note("violation", f"request envelope does not parse: {exc}", conn)
            await self._reply(
                conn,
                stream_id,
                code=CODE_INVALID_ARGUMENT,
                text=f"unmarshal request error: {exc}",
            )
            return
        if envelope.service != RUNTIME_SERVICE:
            await self._reply(
                conn, stream_id, code=CODE_UNIMPLEMENTED, text=f"service {envelope.service}"
            )
            return
        if envelope.method == "RegisterPlugin":
            await self._register(conn, stream_id, envelope.payload)
        elif envelope.method == "UpdateContainers":
            # Served in the runtime's task group, not the connection's: like a Go handler
            # goroutine it outlives a closed connection (and then applies late, unanswered).
            self._tg.start_soon(self._update_containers, conn, stream_id, envelope.payload)
        else:
            await self._reply(
                conn, stream_id, code=CODE_UNIMPLEMENTED, text=f"method {envelope.method}"
            )

    async def _register(self, conn: _Connection, stream_id: int, payload: bytes) -> None:
        started = anyio.current_time()
        try:
            request = nri.RegisterPluginRequest.FromString(payload)
        except DecodeError as exc:
            self._note("violation", f"RegisterPluginRequest does not parse: {exc}", conn)
            await self._reply(conn, stream_id, code=CODE_UNKNOWN, text=str(exc))
            return
        error = self._check_registration(request)
        # The reply goes out before the handshake moves on, so a rejected plugin reads why.
        # (Go leaves a rejected connection open; the fake closes it right after the reply.)
        await self._reply(conn, stream_id, code=CODE_UNKNOWN if error else 0, text=error)
        if conn.registered.is_set():
            self._note("violation", "RegisterPlugin sent twice on one connection", conn)
        elif error:
            conn.registration_error = error
        else:
            conn.name = request.plugin_name
            conn.index = request.plugin_idx
            conn.plugin_nri_version = request.NRI_version
            # nri pkg/adaptation/plugin.go RegisterPlugin logs the plugin's NRI version, or
            # "unknown" when the request has none.
            version = request.NRI_version or "unknown"
            what = f"{request.plugin_idx}-{request.plugin_name} (with NRI version {version})"
            self._note("registered", what, conn)
        conn.registered.set()
        self.log.append(
            Call(
                caller="plugin",
                method="RegisterPlugin",
                stream_id=stream_id,
                request=request,
                response=None if error else nri.Empty(),
                code=CODE_UNKNOWN if error else 0,
                message=error,
                outcome="error" if error else "ok",
                seconds=anyio.current_time() - started,
                connection=conn.number,
                ended=time.monotonic(),
            )
        )

    def _check_registration(self, request: nri.RegisterPluginRequest) -> str:
        """nri adaptation/plugin.go RegisterPlugin + pkg/api/plugin.go checks; "" if fine."""
        name, index = request.plugin_name, request.plugin_idx
        if not name:
            return "invalid plugin name: name is empty"
        if self._nri >= NRI_V0_12 and _PLUGIN_NAME.fullmatch(name) is None:
            return f"invalid plugin name: {name!r} contains invalid characters"
        if _PLUGIN_INDEX.fullmatch(index) is None:
            return f"invalid plugin index: {index!r} is not [0-9][0-9]"
        return ""

    async def _update_containers(self, conn: _Connection, stream_id: int, payload: bytes) -> None:
        started = anyio.current_time()
        try:
            request = nri.UpdateContainersRequest.FromString(payload)
        except DecodeError as exc:
            self._note("violation", f"UpdateContainersRequest does not parse: {exc}", conn)
            await self._reply(conn, stream_id, code=CODE_UNKNOWN, text=str(exc))
            return
        code, text = 0, ""
        if self.updates_while_busy == "refuse" and self._lock.locked():
            code, text = CODE_UNAVAILABLE, "runtime busy: a plugin request is in flight"
        elif self.updates_while_busy == "serve":
            code, text = self._apply_unsolicited(request)
        else:
            async with self._lock:  # containerd nri.go updateFromPlugin takes l.Lock()
                if conn.close_reason:
                    # The plugin hung up while this waited: ttrpc cancelled the request's context
                    # with the connection (server.go run: deferred cancel), and the container
                    # updates fail with it. Nothing is applied.
                    code, text = CODE_CANCELLED, "context canceled"
                else:
                    code, text = self._apply_unsolicited(request)
        # Logged before the reply is written (an await): whoever sees the table changed also
        # sees the call that changed it.
        self.log.append(
            Call(
                caller="plugin",
                method="UpdateContainers",
                stream_id=stream_id,
                request=request,
                response=None if code else nri.UpdateContainersResponse(),
                code=code,
                message=text,
                outcome=("closed" if code == CODE_CANCELLED else "error") if code else "ok",
                seconds=anyio.current_time() - started,
                connection=conn.number,
                ended=time.monotonic(),
            )
        )
        await self._reply(conn, stream_id, code=code, text=text)

    def _apply_unsolicited(self, request: nri.UpdateContainersRequest) -> tuple[int, str]:
        self._evict(request.evict)
        if self._apply_updates(request.update):
            # containerd returns the failed list AND an error; ttrpc then drops the payload.
            return CODE_UNKNOWN, UPDATE_FAILED
        return 0, ""
