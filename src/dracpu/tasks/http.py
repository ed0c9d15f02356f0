"""``/healthz``, ``/readyz`` and ``/metrics`` on ``--bind-address`` (design §3, §5).

A deliberately tiny HTTP/1.1 server on anyio's TCP listener: it is only ever asked by the
kubelet's probes and by Prometheus, so it answers ``GET`` and ``HEAD`` of three paths, one
request per connection (``Connection: close``), and refuses everything else with a clear status:
404 for another path, 405 for another method, 400 for a malformed request, 431 for a head over
:data:`MAX_REQUEST_BYTES`, 408 when the head does not arrive within :data:`READ_TIMEOUT`. No
request body is read. Garbage from a peer never ends the server.

- ``/healthz``: 200 while the process runs (the liveness probe).
- ``/readyz``: 200 once every task the supervisor started has reported ready, 503 before that,
  while a task reports not ready (e.g. the kubelet refused our registration) and while stopping.
  The body lists the tasks as the Kubernetes API server does (``[+]name ok`` / ``[-]name ...``).
- ``/metrics``: Prometheus text format from a registry of our own
  (:func:`dracpu.tasks.metrics.build_registry`), never the process-global one.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass

import anyio
from anyio import TASK_STATUS_IGNORED, BrokenResourceError, ClosedResourceError, EndOfStream
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskGroup, TaskStatus
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from dracpu.config import BindAddress
from dracpu.errors import DracpuError

__all__ = [
    "MAX_CONNECTIONS",
    "MAX_REQUEST_BYTES",
    "READ_TIMEOUT",
    "WRITE_TIMEOUT",
    "Readiness",
    "ReadinessFlag",
    "run",
]

logger = logging.getLogger(__name__)

# Upstream's HTTP server (cmd/dracpu/app.go): ReadHeaderTimeout 5 s, WriteTimeout 10 s.
READ_TIMEOUT = 5.0
WRITE_TIMEOUT = 10.0
# A probe's request head is ~100 bytes, Prometheus' ~300; 8 KiB is the usual server limit.
MAX_REQUEST_BYTES = 8192
# After answering we shut our side down and read what the peer still sends (a body we ignore)
# for at most this long / this much: closing with unread data would send a TCP reset, which can
# destroy our response before the peer reads it ("lingering close", as Apache and nginx do).
LINGER_TIMEOUT = 1.0
LINGER_BYTES = 65536
# Probes and scrapes come one at a time; more concurrent connections than this are refused at
# once (closed) so that a flood cannot use up the daemon's file descriptors.
MAX_CONNECTIONS = 64
# accept() errors that mean "out of resources right now": wait and retry, as trio's
# serve_listeners does (_highlevel_serve_listeners.py ACCEPT_CAPACITY_ERRNOS, SLEEP_TIME).
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_RETRY_DELAY = 0.1
# accept() errors that concern the one connection being accepted, not the listener: the peer
# reset it while it waited in the queue, a firewall refused it (EPERM), a network error was
# pending on it. accept(2) (Linux notes) says to retry these like EAGAIN; trio's SocketListener
# skips the same errnos (_ignorable_accept_errno_names). Only that connection is lost.
ACCEPT_CONNECTION_ERRNOS = frozenset(
    {
        errno.EPERM,
        errno.ECONNABORTED,
        errno.ECONNRESET,
        errno.EPROTO,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.ENOPROTOOPT,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
        errno.ENONET,
        errno.EOPNOTSUPP,
        errno.ENOSR,
        errno.ESOCKTNOSUPPORT,
        errno.EPROTONOSUPPORT,
        errno.ETIMEDOUT,
    }
)

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
_TEXT = "text/plain; charset=utf-8"
_METHODS = (b"GET", b"HEAD")


# --- readiness ----------------------------------------------------------------------------------


class ReadinessFlag:
    """One task's readiness. Only that task (and the supervisor that starts and stops it)
    writes it."""

    __slots__ = ("_ready", "_reason", "name")

    def __init__(self, name: str, reason: str = "not started") -> None:
        self.name = name
        self._ready = False
        self._reason = reason

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def reason(self) -> str:
        """Why the task is not ready (``""`` when it is)."""
        return self._reason

    def set_ready(self) -> None:
        if not self._ready:
            logger.info("task %s is ready", self.name, extra={"task": self.name})
        self._ready, self._reason = True, ""

    def set_not_ready(self, reason: str) -> None:
        if self._ready or reason != self._reason:
            logger.warning("task %s is not ready: %s", self.name, reason, extra={"task": self.name})
        self._ready, self._reason = False, reason


class Readiness:
    """The readiness of every supervised task, by name; ready when all flags are."""

    def __init__(self) -> None:
        self._flags: dict[str, ReadinessFlag] = {}
        self._stopping = False

    def flag(self, name: str, *, reason: str = "not started") -> ReadinessFlag:
        """The flag of task ``name``, created not-ready on first use (the same object after);
        ``reason`` is why it is not ready yet when this call creates it."""
        flag = self._flags.get(name)
        if flag is None:
            flag = self._flags[name] = ReadinessFlag(name, reason)
        return flag

    def set_stopping(self) -> None:
        """The daemon is stopping: not ready from now on, whatever the flags say."""
        self._stopping = True

    def is_ready(self) -> bool:
        """Every flag is ready (and there is at least one) and the daemon is not stopping."""
        return (
            not self._stopping and bool(self._flags) and all(f.ready for f in self._flags.values())
        )

    def flags(self) -> tuple[ReadinessFlag, ...]:
        """Every flag, in the order they were created."""
        return tuple(self._flags.values())

    def report(self) -> str:
        """The ``/readyz`` body: one line per task, then the verdict."""
        lines = [
            f"[+]{f.name} ok" if f.ready else f"[-]{f.name} not ready: {f.reason}"
            for f in self._flags.values()
        ]
        if self._stopping:
            lines.append("[-]shutdown: stopping")
        lines.append("readyz check passed" if self.is_ready() else "readyz check failed")
        return "\n".join(lines) + "\n"


# --- the server ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Response:
    status: int
    body: bytes = b""
    content_type: str = _TEXT
    headers: tuple[tuple[str, str], ...] = ()

    def encode(self, *, head_only: bool = False) -> bytes:
        lines = [
            f"HTTP/1.1 {self.status} {_REASONS[self.status]}",
            f"Content-Type: {self.content_type}",
            f"Content-Length: {len(self.body)}",
            "Connection: close",
            *(f"{name}: {value}" for name, value in self.headers),
        ]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
        return head if head_only else head + self.body


def _text(status: int, text: str, *headers: tuple[str, str]) -> _Response:
    return _Response(status, text.encode(), headers=headers)


@dataclass(frozen=True, slots=True)
class _Request:
    method: bytes
    path: bytes


def _parse_head(head: bytes) -> _Request | _Response:
    """Parse the request line of a complete head (``METHOD SP target SP HTTP/1.x``)."""
    line = head.split(b"\n", 1)[0].rstrip(b"\r")
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1.") or not parts[1].startswith(b"/"):
        return _text(400, "malformed request line\n")
    method, target, _ = parts
    if method not in _METHODS:
        return _text(405, "only GET and HEAD are allowed\n", ("Allow", "GET, HEAD"))
    return _Request(method, target.split(b"?", 1)[0])


async def _read_head(stream: SocketStream) -> _Request | _Response | None:
    """Read up to the blank line ending the head; ``None`` when the peer sent nothing."""
    buffer = bytearray()
    while True:
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            end = buffer.find(b"\n\n")  # tolerate bare LF line ends, as most servers do
        if 0 <= end <= MAX_REQUEST_BYTES:
            return _parse_head(bytes(buffer[:end]))
        if len(buffer) > MAX_REQUEST_BYTES:
            return _text(431, f"request head over {MAX_REQUEST_BYTES} bytes\n")
        try:
            buffer += await stream.receive(MAX_REQUEST_BYTES)
        except EndOfStream:
            return _text(400, "incomplete request\n") if buffer else None


class _Server:
    def __init__(self, readiness: Readiness, registry: CollectorRegistry) -> None:
        self._readiness = readiness
        self._registry = registry
        self._connections = 0

    def _route(self, path: bytes) -> _Response:
        if path == b"/healthz":
            return _text(200, "ok\n")
        if path == b"/readyz":
            return _text(200 if self._readiness.is_ready() else 503, self._readiness.report())
        if path == b"/metrics":
            try:
                body = generate_latest(self._registry)
            except Exception:
                logger.exception("collecting metrics failed")
                return _text(500, "collecting metrics failed\n")
            return _Response(200, body, content_type=CONTENT_TYPE_PLAIN_0_0_4)
        return _text(404, "not found: try /healthz, /readyz or /metrics\n")

    async def serve_listener(self, listener: SocketListener, tg: TaskGroup) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno in ACCEPT_CONNECTION_ERRNOS:
                    logger.debug("a connection was lost before it was accepted: %s", exc)
                    continue
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                logger.error("accept failed (%s); retrying in %s s", exc, ACCEPT_RETRY_DELAY)
                await anyio.sleep(ACCEPT_RETRY_DELAY)
                continue
            if self._connections >= MAX_CONNECTIONS:
                logger.debug("over %d HTTP connections: one refused", MAX_CONNECTIONS)
                await anyio.aclose_forcefully(stream)
                continue
            self._connections += 1
            tg.start_soon(self._serve_connection, stream)

    async def _serve_connection(self, stream: SocketStream) -> None:
        try:
            async with stream:
                await self._exchange(stream)
        except (BrokenResourceError, ClosedResourceError, EndOfStream, OSError):
            pass  # the peer went away: nothing to answer
        except Exception:
            # A bug of ours in one exchange must not end the daemon; it is logged loudly.
            logger.exception("HTTP connection handler failed")
        finally:
            self._connections -= 1

    async def _exchange(self, stream: SocketStream) -> None:
        request: _Request | _Response | None = _text(408, "request head not received in time\n")
        with anyio.move_on_after(READ_TIMEOUT):
            request = await _read_head(stream)
        if request is None:
            return
        response = request if isinstance(request, _Response) else self._route(request.path)
        head_only = isinstance(request, _Request) and request.method == b"HEAD"
        with anyio.move_on_after(WRITE_TIMEOUT):
            await stream.send(response.encode(head_only=head_only))
            await stream.send_eof()
        with anyio.move_on_after(LINGER_TIMEOUT):
            drained = 0
            while drained < LINGER_BYTES:
                drained += len(await stream.receive())


async def run(
    bind: BindAddress,
    readiness: Readiness,
    registry: CollectorRegistry,
    *,
    task_status: TaskStatus[int] = TASK_STATUS_IGNORED,
) -> None:
    """Serve the three endpoints on ``bind`` until cancelled; ``started()`` gives the port.

    Resource handling: the listening socket and every connection are closed on exit.

    Error handling: a failure to listen raises :class:`~dracpu.errors.DracpuError` naming the
    address; per-connection errors are answered or dropped, never raised.
    """
    try:
        listener = await anyio.create_tcp_listener(
            local_host=bind.host or None, local_port=bind.port
        )
    except OSError as exc:
        raise DracpuError(f"cannot listen on --bind-address {bind}: {exc.strerror or exc}") from exc
    server = _Server(readiness, registry)
    async with listener, anyio.create_task_group() as tg:
        port: int = listener.listeners[0].extra(SocketAttribute.local_port)
        logger.info("serving /healthz, /readyz and /metrics on %s", _describe(bind, port))
        for socket_listener in listener.listeners:
            # create_tcp_listener makes only SocketListeners (which have accept()).
            assert isinstance(socket_listener, SocketListener)
            tg.start_soon(server.serve_listener, socket_listener, tg)
        task_status.started(port)


def _describe(bind: BindAddress, port: int) -> str:
    return str(BindAddress(bind.host, port)) if bind.host else f"port {port}"
