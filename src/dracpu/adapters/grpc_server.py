"""gRPC servers on unix sockets, with the socket-file rules of design §5.

:func:`open_unix_server` serves rpc methods (:data:`Service`: path -> :data:`Handler`) on a unix
socket path for the life of an ``async with`` block:

- the socket's directory is created if missing (mode 0700); with ``private_dir=True`` an
  existing directory is narrowed to 0700 too (our own ``<kubelet-root>/plugins/dra.cpu``). A
  directory shared with others (the kubelet's ``plugins_registry``, which other plugins use as
  well) is never changed, only created;
- a stale socket file at the path (a crashed instance's) is replaced; anything that is not a
  socket is refused with an error, never deleted;
- the socket appears at its path only once it is listening and already mode 0600: it is bound
  under a temporary dot-name in the same directory (the kubelet's plugin watcher ignores
  dot-files), chmod'ed, put into listening state and served, then renamed over the final path
  in one step (the watcher sees it as a creation, as it would a fresh bind);
- on exit the server stops: each connection gets a GOAWAY and is closed (the kubelet sees the
  plugin go away), in-flight calls are cancelled and waited for, and the socket file is
  removed, unless another process has meanwhile replaced it.

The protocol is ours: HTTP/2 from :mod:`dracpu.wire.h2` and gRPC's framing from
:mod:`dracpu.wire.grpc` (unary calls only; all the kubelet makes). Each connection is an asyncio
protocol (the cheapest way to get bytes in and out: no reader task per connection); each call
runs as an asyncio task of its own, in its own anyio cancel scope: the caller resetting the
stream or dropping the connection cancels it, ``grpc-timeout`` bounds it (then
``DEADLINE_EXCEEDED``; the clock starts with the request's head), and stopping the server
cancels it and waits for it at most :data:`STOP_TIMEOUT`. (Not an anyio task group: the group
would have to enclose the ``async with`` body, whose exceptions it would wrap in an
``ExceptionGroup``.) A handler answers with :meth:`Call.reply`, which hands the whole answer
(head, message, trailers) to the transport before it returns, so whatever the handler does
after it never delays the answer.

A peer that breaks HTTP/2 loses its connection (GOAWAY naming the error, a warning logged); a
request that is not a valid gRPC call gets an error status; the server keeps serving both ways.
A client that does not read its answers is not read either (back pressure), so it cannot make
us buffer more than its own flow-control windows allow. Connections are accepted by our own
reader on the listening socket, so none slips in after the stop.

One of the modules that use asyncio directly (design §3: anyio everywhere else), for the
protocol callbacks and the call tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import socket
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, Self, TypeVar

import anyio

from dracpu.errors import DracpuError, GrpcError, LocalProtocolError
from dracpu.wire.grpc import (
    MAX_MESSAGE,
    RESPONSE_HEAD,
    Status,
    frame_message,
    read_call_head,
    read_unary_message,
    trailers,
    trailers_only,
)
from dracpu.wire.h2 import (
    ConnectionFailed,
    DataReceived,
    RequestReceived,
    ServerConnection,
    StreamReset,
)
from dracpu.wire.protowire import scan_fields

__all__ = [
    "ACCEPT_RETRY_DELAY",
    "DIR_MODE",
    "SOCKET_MODE",
    "STOP_TIMEOUT",
    "UNIX_PATH_MAX",
    "Call",
    "Handler",
    "Service",
    "UnixServer",
    "decode_message",
    "open_unix_server",
    "remove_stale_socket",
]

logger = logging.getLogger(__name__)

# Design §5: every socket the daemon creates is mode 0600 in a 0700 directory.
SOCKET_MODE = 0o600
DIR_MODE = 0o700
# sun_path of struct sockaddr_un holds 108 bytes on Linux including the terminating NUL
# (unix(7)); upstream checks the same limit (dra-driver-cpu pkg/driver/driver.go unixPathMax).
UNIX_PATH_MAX = 107
# Pending connections the kernel queues for us; the kubelet keeps one connection per plugin.
BACKLOG = 100
# How long stopping waits for the handlers of cancelled calls to finish (seconds): they only
# need to notice the cancellation. Bounded so a stuck handler cannot hold up the daemon's 5 s
# stop.
STOP_TIMEOUT = 1.0
# How long accepting pauses after accept() itself failed (EMFILE: out of file descriptors);
# asyncio's own server waits the same second.
ACCEPT_RETRY_DELAY = 1.0


class _Message(Protocol):
    @classmethod
    def parse(cls, data: bytes) -> Self: ...


_M = TypeVar("_M", bound=_Message)
_temp_counter = itertools.count()


class Call:
    """One unary call as its handler sees it: the method path and the request message."""

    __slots__ = ("_connection", "_replied", "_stream_id", "path", "request")

    def __init__(self, connection: _Connection, stream_id: int, path: str, request: bytes) -> None:
        self._connection = connection
        self._stream_id = stream_id
        self._replied = False
        self.path = path
        self.request = request

    @property
    def replied(self) -> bool:
        return self._replied

    def reply(self, message: bytes) -> bool:
        """Answer the call with ``message`` and status OK: head, message and trailers are handed
        to the transport at once, before this returns. ``False`` if the caller is gone (the
        stream was reset, the connection closed): the answer is dropped.

        Raises :class:`~dracpu.errors.LocalProtocolError` on a second reply.
        """
        if self._replied:
            raise LocalProtocolError(f"{self.path}: the call was already answered")
        self._replied = True
        return self._connection.respond(self._stream_id, message)


Handler = Callable[[Call], Awaitable[None]]
"""An rpc method: reads ``call.request``, answers with ``call.reply(...)`` or raises
:class:`~dracpu.errors.GrpcError`. Any other exception is logged and answered ``UNKNOWN``."""

Service = Mapping[str, Handler]
"""The rpc methods of one service by path (``/<package>.<Service>/<Method>``)."""


def decode_message(message_type: type[_M], data: bytes) -> _M:
    """A betterproto2 request message; ``INVALID_ARGUMENT`` naming the type if it does not
    parse."""
    try:
        scan_fields(data, 0, len(data))  # betterproto2 lets truncation and bad wire types by
        return message_type.parse(data)
    except Exception as exc:  # ours is a RemoteProtocolError; betterproto2 raises anything
        raise GrpcError(
            Status.INVALID_ARGUMENT, f"cannot decode {message_type.__name__}: {exc}"
        ) from exc


@dataclass(slots=True)
class _CallState:
    handler: Handler
    path: str
    deadline: float  # loop time; inf without grpc-timeout
    body: bytearray = field(default_factory=bytearray)
    scope: anyio.CancelScope | None = None  # set once the handler's task is started
    expiry: asyncio.TimerHandle | None = None  # answers DEADLINE_EXCEEDED before the start
    cancelled: bool = False  # the caller went away; nothing is to be sent


class _Connection(asyncio.Protocol):
    """One client connection: HTTP/2 by :mod:`dracpu.wire.h2`, each call an asyncio task of its
    own (:meth:`_Server.start_call`)."""

    def __init__(self, server: _Server) -> None:
        self._server = server
        self._h2 = ServerConnection()
        self._transport: asyncio.Transport | None = None
        self._calls: dict[int, _CallState] = {}

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._server.connections.add(self)
        transport.write(self._h2.initiate())
        if self._server.stopping:  # accepted just before the listener closed
            self.stop()

    def data_received(self, data: bytes) -> None:
        for event in self._h2.receive_data(data):
            if isinstance(event, RequestReceived):
                self._request(event)
            elif isinstance(event, DataReceived):
                self._data(event)
            elif isinstance(event, StreamReset):
                self._cancel(event.stream_id)
            elif isinstance(event, ConnectionFailed):
                logger.warning(
                    "gRPC connection on %s broke the protocol (%s); closing it",
                    self._server.path,
                    event.reason,
                )
        self._flush()

    # Back pressure: while the transport's buffer is over its high-water mark (a client that
    # does not read), we stop reading from it; its windows bound the DATA we queue, and the
    # acknowledgements of its frames wait in the kernel instead of our memory.

    def pause_writing(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        for stream_id in list(self._calls):
            self._cancel(stream_id)

    # --- calls ---

    def _request(self, event: RequestReceived) -> None:
        try:
            head = read_call_head(event.headers)
            handler = self._server.handlers.get(head.path)
            if handler is None:
                raise GrpcError(Status.UNIMPLEMENTED, f"unknown method {head.path}")
        except GrpcError as exc:
            self._refuse(event.stream_id, exc)
            return
        loop = asyncio.get_running_loop()
        deadline = math.inf if head.timeout is None else loop.time() + head.timeout
        state = _CallState(handler, head.path, deadline)
        self._calls[event.stream_id] = state
        if event.end_stream:
            self._start(event.stream_id, state)
        elif head.timeout is not None:  # the clock runs from the head, not the body's end
            state.expiry = loop.call_at(deadline, self._expire, event.stream_id, state)

    def _expire(self, stream_id: int, state: _CallState) -> None:
        if self._calls.get(stream_id) is state and state.scope is None:
            del self._calls[stream_id]
            self._refuse(stream_id, GrpcError(Status.DEADLINE_EXCEEDED, "deadline exceeded"))
            self._flush()

    def _data(self, event: DataReceived) -> None:
        state = self._calls.get(event.stream_id)
        if state is None or state.scope is not None:
            return  # refused already, or DATA after the end (the stream is reset by h2)
        state.body += event.data
        if len(state.body) > MAX_MESSAGE + 5:
            self._cancel(event.stream_id)
            self._refuse(
                event.stream_id,
                GrpcError(Status.RESOURCE_EXHAUSTED, f"a request over {MAX_MESSAGE} bytes"),
            )
        elif event.end_stream:
            self._start(event.stream_id, state)

    def _start(self, stream_id: int, state: _CallState) -> None:
        if state.expiry is not None:
            state.expiry.cancel()
        if self._server.stopping:
            del self._calls[stream_id]
            self._refuse(stream_id, GrpcError(Status.UNAVAILABLE, "the server is stopping"))
            return
        state.scope = anyio.CancelScope()
        self._server.start_call(self._run(stream_id, state), state.path)

    def _cancel(self, stream_id: int) -> None:
        state = self._calls.pop(stream_id, None)
        if state is not None:
            state.cancelled = True
            if state.expiry is not None:
                state.expiry.cancel()
            if state.scope is not None:
                state.scope.cancel()

    async def _run(self, stream_id: int, state: _CallState) -> None:
        assert state.scope is not None
        error: GrpcError | None = None
        call: Call | None = None
        with state.scope as scope:
            scope.deadline = state.deadline
            try:
                call = Call(self, stream_id, state.path, read_unary_message(bytes(state.body)))
                state.body = bytearray()
                await state.handler(call)
                if not call.replied:
                    logger.error("%s: the handler sent no answer", state.path)
                    error = GrpcError(Status.INTERNAL, "the handler sent no answer")
            except GrpcError as exc:
                error = exc
            except Exception:
                logger.exception("%s failed", state.path)
                error = GrpcError(Status.UNKNOWN, "internal error")
        if scope.cancelled_caught and not state.cancelled:
            error = GrpcError(Status.DEADLINE_EXCEEDED, "deadline exceeded")
        if self._calls.get(stream_id) is state:
            del self._calls[stream_id]
        if error is not None and (call is None or not call.replied):
            self._refuse(stream_id, error)
            self._flush()

    # --- sending ---

    def respond(self, stream_id: int, message: bytes) -> bool:
        """Head, message, OK trailers of ``stream_id``; ``False`` if it is no longer open."""
        h2 = self._h2
        if not h2.is_open(stream_id) or self._transport is None or self._transport.is_closing():
            return False
        h2.send_headers(stream_id, RESPONSE_HEAD)
        h2.send_data(stream_id, frame_message(message))
        h2.send_headers(stream_id, _OK_TRAILERS, end_stream=True)
        self._flush()
        return True

    def _refuse(self, stream_id: int, error: GrpcError) -> None:
        if self._h2.is_open(stream_id):  # never after a connection error
            self._h2.send_headers(stream_id, trailers_only(error), end_stream=True)

    def _flush(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        out = self._h2.data_to_send()
        if out:
            transport.write(out)
        if self._h2.failed:
            transport.close()

    def stop(self) -> None:
        """Send GOAWAY, cancel the calls, close (after the queued bytes are written)."""
        for stream_id in list(self._calls):
            self._cancel(stream_id)
        if self._transport is not None and not self._transport.is_closing():
            self._h2.close()
            self._flush()
            self._transport.close()


_OK_TRAILERS: Final = tuple(trailers(Status.OK))


class _Server:
    """The handlers, the open connections and the tasks of the calls in flight."""

    def __init__(self, services: Collection[Service], path: Path) -> None:
        self.handlers: dict[str, Handler] = {}
        for service in services:
            for method_path, handler in service.items():
                if method_path in self.handlers:
                    raise DracpuError(f"two handlers for {method_path}")
                self.handlers[method_path] = handler
        self.path = path
        self.connections: set[_Connection] = set()
        self.calls: set[asyncio.Task[None]] = set()
        self.stopping = False

    def start_call(self, call: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(call, name=name)
        self.calls.add(task)
        task.add_done_callback(self.calls.discard)

    async def stop(self) -> None:
        """GOAWAY and close every connection, cancel the calls, wait for them (bounded)."""
        self.stopping = True
        for connection in list(self.connections):
            connection.stop()
        if self.calls:
            with anyio.move_on_after(STOP_TIMEOUT):
                await asyncio.wait(set(self.calls))
            if self.calls:
                logger.warning(
                    "%d gRPC call(s) on %s did not end within %.1f s of the stop",
                    len(self.calls),
                    self.path,
                    STOP_TIMEOUT,
                )


@dataclass(frozen=True, slots=True)
class UnixServer:
    """A running server."""

    path: Path
    _server: _Server

    @property
    def open_connections(self) -> int:
        return len(self._server.connections)


def _check_path(path: Path) -> None:
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise DracpuError(
            f"socket path {str(path)!r} is {len(os.fsencode(path))} bytes long; unix sockets "
            f"allow at most {UNIX_PATH_MAX}"
        )


def _prepare_dir(directory: Path, *, private: bool) -> None:
    """Create ``directory`` (and missing parents) with mode 0700; narrow it if ``private``."""
    try:
        missing: list[Path] = []
        current = directory
        while not current.exists():
            missing.append(current)
            current = current.parent
        for created in reversed(missing):
            with contextlib.suppress(FileExistsError):
                created.mkdir(mode=DIR_MODE)
            created.chmod(DIR_MODE)  # mkdir's mode is narrowed by the umask, never widened
        if not directory.is_dir():
            raise DracpuError(f"socket directory {str(directory)!r} is not a directory")
        if private and stat.S_IMODE(directory.stat().st_mode) != DIR_MODE:
            directory.chmod(DIR_MODE)
    except OSError as exc:
        raise DracpuError(
            f"cannot prepare socket directory {str(directory)!r}: {exc.strerror or exc}"
        ) from exc


def remove_stale_socket(path: Path) -> bool:
    """Remove a socket file left at ``path``; ``True`` if one was removed.

    Raises :class:`DracpuError` if ``path`` exists and is not a socket (we never delete a file
    we did not make) or cannot be removed.
    """
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise DracpuError(f"cannot inspect {str(path)!r}: {exc.strerror or exc}") from exc
    if not stat.S_ISSOCK(info.st_mode):
        raise DracpuError(f"{str(path)!r} exists and is not a socket; refusing to replace it")
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise DracpuError(
            f"cannot remove stale socket {str(path)!r}: {exc.strerror or exc}"
        ) from exc
    return True


def _temp_path(path: Path) -> Path:
    """A dot-name beside ``path``, no longer than ``path`` allows (the watcher skips dot-files)."""
    temp = path.with_name(f".{os.getpid()}.{next(_temp_counter)}.sock")
    if len(os.fsencode(temp)) > UNIX_PATH_MAX:
        temp = path.with_name(f".{next(_temp_counter)}")
    return temp


def _bind_private(temp: Path) -> socket.socket:
    """A listening unix socket bound at ``temp`` with mode 0600."""
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()  # a leftover of a crashed start of the same pid (pid reuse)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(temp))
        os.chmod(temp, SOCKET_MODE)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        with contextlib.suppress(OSError):
            temp.unlink()
        raise DracpuError(f"cannot bind unix socket {str(temp)!r}: {exc.strerror or exc}") from exc
    return sock


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = path.lstat()
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _remove_if_ours(path: Path, identity: tuple[int, int] | None) -> None:
    """Remove the socket file we made; leave a file another process put there since."""
    current = _identity(path)
    if current is None:
        return  # already gone
    if current != identity:
        logger.warning("socket %s was replaced by someone else; leaving it", path)
        return
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.error("cannot remove socket %s: %s", path, exc.strerror or exc)


@asynccontextmanager
async def open_unix_server(
    services: Collection[Service],
    path: Path,
    *,
    private_dir: bool = False,
) -> AsyncIterator[UnixServer]:
    """Serve the rpc methods of ``services`` on the unix socket ``path`` until the block exits.

    ``private_dir``: the directory belongs to us alone, so an existing one is narrowed to 0700.

    Raises :class:`DracpuError` (naming the path) when the path is too long, the directory cannot
    be made, a non-socket file is in the way, or binding fails. Resource handling: the listening
    socket, the connections, the calls in flight (cancelled) and the socket file are released on
    exit, also on cancellation.
    """
    _check_path(path)
    _prepare_dir(path.parent, private=private_dir)
    server = _Server(services, path)
    temp = _temp_path(path)
    sock = _bind_private(temp)
    identity = _identity(temp)
    loop = asyncio.get_running_loop()
    accepting: set[asyncio.Task[Any]] = set()

    def accept() -> None:
        # Our own accept (not loop.create_unix_server): asyncio 3.11's Server can accept a
        # connection after close() and then neither serve nor close it.
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # EMFILE, ENOBUFS...: pause rather than spin (as asyncio does)
            logger.error(
                "cannot accept a connection on %s: %s; retrying in %.0f s",
                path,
                exc,
                ACCEPT_RETRY_DELAY,
            )
            loop.remove_reader(sock.fileno())
            loop.call_later(ACCEPT_RETRY_DELAY, resume_accepting)
            return
        task = loop.create_task(serve(conn))
        accepting.add(task)
        task.add_done_callback(accepting.discard)

    async def serve(conn: socket.socket) -> None:
        try:
            await loop.connect_accepted_socket(lambda: _Connection(server), conn)
        except OSError as exc:  # the peer went away at once, or no memory for the transport
            logger.warning("cannot serve a connection on %s: %s", path, exc)
            conn.close()

    def resume_accepting() -> None:
        if not server.stopping:
            loop.add_reader(sock.fileno(), accept)

    listening = False
    placed = False
    try:
        loop.add_reader(sock.fileno(), accept)
        listening = True
        if remove_stale_socket(path):
            logger.info("removed a stale socket at %s", path)
        try:
            os.rename(temp, path)
        except OSError as exc:
            raise DracpuError(
                f"cannot move socket {str(temp)!r} to {str(path)!r}: {exc.strerror or exc}"
            ) from exc
        placed = True
        logger.debug("serving gRPC on %s", path)
        yield UnixServer(path, server)
    finally:
        with anyio.CancelScope(shield=True):
            server.stopping = True
            if listening:
                loop.remove_reader(sock.fileno())
            if accepting:
                await asyncio.wait(set(accepting))
            await server.stop()
        sock.close()
        if placed:
            _remove_if_ours(path, identity)
        else:
            with contextlib.suppress(OSError):
                temp.unlink()
