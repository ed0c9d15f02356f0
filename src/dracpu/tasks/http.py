"""``/healthz``, ``/readyz`` and ``/metrics`` on ``--bind-address``, served by ``aiohttp.web``.

Only the kubelet's probes and Prometheus ask, so the server answers ``GET`` and ``HEAD`` of three
paths; aiohttp answers everything else: 404 for another path, 405 (with ``Allow``) for another
method, 400 for a request that is not HTTP, and drops a peer that breaks the protocol, without
ending the server. Requests are bounded by aiohttp's own settings (:data:`READ_TIMEOUT` to send a
request head and between requests on a kept-alive connection, :data:`MAX_LINE_BYTES` per request
line or header field, :data:`MAX_HEADERS` fields); no request body is read. Our answers are a few
KiB, within the socket's send buffer, so a peer that does not read cannot hold a handler.

- ``/healthz``: 503 until every task has started once, then 200 for as long as the process runs
  (the liveness probe). Upstream's ``/healthz`` does the same (``cmd/dracpu/app.go``: 503 until
  the driver's ``Start`` returned), and its Helm chart uses it as the readiness probe too, so a
  pod under that chart is not marked ready before the driver serves.
- ``/readyz``: 200 once every task the supervisor started has reported ready, 503 before that,
  while a task reports not ready (e.g. the kubelet refused our registration) and while stopping.
  The body lists the tasks as the Kubernetes API server does (``[+]name ok`` / ``[-]name ...``).
- ``/metrics``: Prometheus text format from a registry of our own
  (:func:`dracpu.tasks.metrics.build_registry`), never the process-global one.

aiohttp runs on asyncio only, so this task does too (the daemon's backend).
"""

from __future__ import annotations

import logging
import os
import socket

import anyio
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from dracpu.config.values import BindAddress
from dracpu.errors import DracpuError

__all__ = [
    "MAX_HEADERS",
    "MAX_LINE_BYTES",
    "READ_TIMEOUT",
    "Readiness",
    "ReadinessFlag",
    "run",
]

logger = logging.getLogger(__name__)

# Upstream's HTTP server (cmd/dracpu/app.go) has ReadHeaderTimeout 5 s. aiohttp's keep-alive
# timeout starts when a connection opens and again after each answer, and closes a connection
# that has not sent a whole request head by then.
READ_TIMEOUT = 5.0
# A probe's request head is ~100 bytes, Prometheus' ~300: 8 KiB per line is the usual server
# limit (aiohttp's default is 8190), and a dozen fields is plenty (aiohttp allows 128).
MAX_LINE_BYTES = 8192
MAX_HEADERS = 32
# How long a stop waits for answers being written (probes are answered at once).
_SHUTDOWN_SECONDS = 1.0
# The paths served: /healthz and /metrics as upstream's server (cmd/dracpu/app.go), /readyz as
# the Kubernetes API server's.
_PATHS = ("/healthz", "/readyz", "/metrics")


# --- readiness ----------------------------------------------------------------------------------


class ReadinessFlag:
    """One task's readiness. Only that task (and the supervisor that starts and stops it)
    writes it."""

    __slots__ = ("_detail", "_ready", "_reason", "name")

    def __init__(self, name: str, reason: str = "not started") -> None:
        self.name = name
        self._ready = False
        self._reason = reason
        self._detail = ""

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def reason(self) -> str:
        """Why the task is not ready (``""`` when it is)."""
        return self._reason

    @property
    def detail(self) -> str:
        """What the ready task says beside ``ok`` (``""``: nothing)."""
        return self._detail

    def set_ready(self, detail: str = "") -> None:
        """Ready; ``detail``: what ``/readyz`` shows beside ``ok`` (e.g. what was done)."""
        if not self._ready:
            logger.info("task %s is ready", self.name, extra={"task": self.name})
        self._ready, self._reason, self._detail = True, "", detail

    def set_not_ready(self, reason: str) -> None:
        if self._ready or reason != self._reason:
            logger.warning("task %s is not ready: %s", self.name, reason, extra={"task": self.name})
        self._ready, self._reason = False, reason


class Readiness:
    """The readiness of every supervised task, by name; ready when all flags are."""

    def __init__(self) -> None:
        self._flags: dict[str, ReadinessFlag] = {}
        self._stopping = False
        self._started = False

    @property
    def started(self) -> bool:
        """Every task has started once (``/healthz`` answers 200 from then on)."""
        return self._started

    def set_started(self) -> None:
        """The supervisor started every task; stays true for the life of the process."""
        self._started = True

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
            (f"[+]{f.name} ok: {f.detail}" if f.detail else f"[+]{f.name} ok")
            if f.ready
            else f"[-]{f.name} not ready: {f.reason}"
            for f in self._flags.values()
        ]
        if self._stopping:
            lines.append("[-]shutdown: stopping")
        lines.append("readyz check passed" if self.is_ready() else "readyz check failed")
        return "\n".join(lines) + "\n"


# --- the server ---------------------------------------------------------------------------------


class _PeerFaults(logging.Filter):
    """aiohttp logs a request it cannot parse at ERROR with a traceback (``web_protocol``
    ``RequestHandler.handle_error``), whatever sent it: a port scanner would fill the daemon's
    log. Such a record (its exception an ``HttpProcessingError``: the peer's fault) becomes one
    DEBUG line; a failure of ours (any other exception, a 500) stays an ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, HttpProcessingError):
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        record.msg = f"{record.msg}: %s"
        record.args = (*(record.args if isinstance(record.args, tuple) else ()), error)
        record.exc_info = record.exc_text = None
        return _peer_logger.isEnabledFor(logging.DEBUG)


# aiohttp's server logs through this logger (the RequestHandler ``logger`` argument).
_peer_logger = logging.getLogger(f"{__name__}.peer")
_peer_logger.addFilter(_PeerFaults())


def _application(readiness: Readiness, registry: CollectorRegistry) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        if not readiness.started:
            return web.Response(status=503, text="starting\n")
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        return web.Response(status=200 if readiness.is_ready() else 503, text=readiness.report())

    async def metrics(_: web.Request) -> web.Response:
        try:
            body = generate_latest(registry)
        except Exception:
            logger.exception("collecting metrics failed")
            return web.Response(status=500, text="collecting metrics failed\n")
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    app = web.Application()
    for path, handler in zip(_PATHS, (healthz, readyz, metrics), strict=True):
        app.router.add_get(path, handler)  # HEAD too (allow_head)
    return app


async def _listen(bind: BindAddress) -> socket.socket:
    """One listening socket for ``bind``, as Go's ``net.Listen`` makes it: ``:port`` on every
    interface (dual-stack IPv6 where the host has it, else IPv4), a host name on the first of
    its addresses. With ``SO_REUSEPORT``: during a rolling update on the host's network the next
    dracpu serves its probes on the same port beside this one (the kernel shares a port only
    among sockets of the same user that all set it; :mod:`dracpu.tasks.handover`)."""
    try:
        if not bind.host:
            if socket.has_dualstack_ipv6():
                return socket.create_server(
                    ("", bind.port), family=socket.AF_INET6, dualstack_ipv6=True, reuse_port=True
                )
            return socket.create_server(("", bind.port), reuse_port=True)
        family, _, _, _, address = (
            await anyio.getaddrinfo(
                bind.host, bind.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        )[0]
        return socket.create_server(address[:2], family=family, reuse_port=True)
    except OSError as exc:
        # socket.create_server adds the address to strerror; the message names it already.
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise DracpuError(f"cannot listen on --bind-address {bind}: {reason}") from exc


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
    address; aiohttp answers or drops a connection that breaks HTTP, never raising here.
    """
    runner = web.AppRunner(
        _application(readiness, registry),
        access_log=None,
        handle_signals=False,
        shutdown_timeout=_SHUTDOWN_SECONDS,
        # aiohttp's per-connection settings (web_protocol.RequestHandler keyword arguments):
        logger=_peer_logger,
        keepalive_timeout=READ_TIMEOUT,
        max_line_size=MAX_LINE_BYTES,
        max_field_size=MAX_LINE_BYTES,
        max_headers=MAX_HEADERS,
    )
    await runner.setup()
    try:
        listening = await _listen(bind)
        try:
            await web.SockSite(runner, listening).start()
        except BaseException:
            listening.close()
            raise
        port: int = listening.getsockname()[1]
        logger.info("serving /healthz, /readyz and /metrics on %s", _describe(bind, port))
        task_status.started(port)
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()


def _describe(bind: BindAddress, port: int) -> str:
    return str(BindAddress(bind.host, port)) if bind.host else f"port {port}"
