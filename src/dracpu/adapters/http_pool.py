"""Keep-alive HTTP/1.1 connections to one server, for the kube adapter.

The I/O half of dracpu's own HTTP client (the sans-IO half is :mod:`dracpu.wire.http1`;
:mod:`dracpu.adapters.kube` says why there is one and speaks the Kubernetes API over it): a
pool of ``anyio`` TCP streams, TLS when the endpoint has an ``ssl.SSLContext``, through an HTTP
proxy when one is configured (a ``CONNECT`` tunnel for https, absolute-form targets for http).

- :meth:`HttpPool.request` sends one encoded request and reads the whole answer;
  :meth:`HttpPool.open_stream` reads the head and leaves the body to a
  :class:`StreamedResponse` (a watch). At most :data:`MAX_CONNECTIONS` ordinary requests run at
  once; streams hold their connection on top.
- Idle connections are reused last-in first-out; one the server closed (its socket is
  readable) or idle for :data:`_IDLE_SECONDS` is closed instead. A GET whose connection drops
  before any byte of the answer arrived (the keep-alive race) is sent once more on a new
  connection (RFC 9112 §9.3.1: idempotent); other methods are never sent twice.
- Errors: what the connection raises (:data:`CONNECTION_ERRORS`) and
  :class:`ProxyRefusedError`; the caller translates them.
"""

from __future__ import annotations

import logging
import re
import select
import socket
import ssl
from dataclasses import dataclass
from typing import Final
from urllib.parse import quote

import anyio
import anyio.abc
from anyio.streams.tls import TLSStream

from dracpu.errors import KubeServerError, ProtocolError
from dracpu.wire.http1 import (
    MAX_BODY,
    NEED_DATA,
    Data,
    EndOfMessage,
    Response,
    ResponseParser,
    encode_request,
)

__all__ = [
    "CONNECTION_ERRORS",
    "MAX_CONNECTIONS",
    "Endpoint",
    "HttpPool",
    "Proxy",
    "ProxyRefusedError",
    "StreamedResponse",
    "bracketed",
    "quote_segment",
]

logger = logging.getLogger(__name__)

# Ordinary requests in flight at once (each on its own connection). dracpu makes a few at a
# time (a Prepare's GET + PATCH per claim, the publisher's writes); the kubelet sends Prepare
# calls one after the other. 8 is aiohttp's per-host default order of magnitude (its total
# limit is 100) kept small: the API server counts our connections against the node's budget.
MAX_CONNECTIONS: Final = 8
# Idle keep-alive connections kept for reuse (the rest are closed when released).
_MAX_IDLE: Final = MAX_CONNECTIONS
# An idle connection older than this is closed instead of reused: Go's http.Transport
# IdleConnTimeout default (90 s). Load balancers drop idle flows silently after minutes
# (AWS NLB 350 s, Azure 4 min); a connection is never reused past that.
_IDLE_SECONDS: Final = 90.0
# TCP keep-alive probes on every connection (a watch may be silent for minutes; a peer that
# vanished without a FIN is noticed): idle 30 s, then every 30 s, as Go's net.Dialer
# (KeepAlive: 30 s) does for client-go.
_KEEPALIVE_SECONDS: Final = 30
# Bytes asked of the socket per read: a claim answer (~3 KB) or a watch event fits in one.
_READ_SIZE: Final = 65536
# The longest watch event line accepted: one object, the same bound as a whole LIST answer.
_MAX_EVENT_LINE: Final = MAX_BODY
# What a connection failure can raise below us: socket errors (ssl.SSLError, TimeoutError are
# OSErrors), anyio's stream errors, and the peer's HTTP violations (dracpu.wire.http1).
CONNECTION_ERRORS: Final = (
    OSError,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
    ProtocolError,
)

# Path segments that need no percent-encoding (RFC 3986 unreserved characters).
_PLAIN_SEGMENT: Final = re.compile(r"[A-Za-z0-9._~-]+")

# How much of a proxy's refusal goes into an error message, and the most of its answer read.
_EXCERPT: Final = 200
_CONNECT_ANSWER_MAX: Final = 64 * _EXCERPT


@dataclass(frozen=True, slots=True)
class Proxy:
    """An HTTP proxy, resolved once at open."""

    host: str
    port: int
    url: str  # for messages: scheme://host:port, no credentials
    authorization: str | None  # the Proxy-Authorization value, when credentials are known


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how the API server is reached."""

    scheme: str  # "http" or "https"
    host: str  # to connect to (an IPv6 address without brackets)
    port: int
    authority: str  # the Host header: host[:port] as in the URL
    prefix: str  # a path prefix of the server URL (a proxying front end), "" usually
    ssl_context: ssl.SSLContext | None  # https only
    tls_name: str  # the name sent as SNI and checked in the certificate
    proxy: Proxy | None

    def target(self, path_and_query: str) -> str:
        """The request target: origin-form, or absolute-form through an http proxy."""
        if self.proxy is not None and self.ssl_context is None:
            return f"{self.scheme}://{self.authority}{self.prefix}{path_and_query}"
        return self.prefix + path_and_query


class ProxyRefusedError(Exception):
    """The proxy answered CONNECT with something other than 2xx."""


class HttpPool:
    """Keep-alive HTTP/1.1 connections to one API server."""

    def __init__(
        self, endpoint: Endpoint, user_agent: str, *, max_connections: int = MAX_CONNECTIONS
    ) -> None:
        self.endpoint = endpoint
        self.user_agent = user_agent
        self._idle: list[tuple[anyio.abc.ByteStream, float]] = []  # (stream, idle since)
        self._slots = anyio.Semaphore(max_connections)
        self._closed = False

    async def aclose(self) -> None:
        """Close the idle connections; connections in use are closed when released."""
        self._closed = True
        idle, self._idle = self._idle, []
        for stream, _ in idle:
            await anyio.aclose_forcefully(stream)

    async def _connect(self) -> anyio.abc.ByteStream:
        stream = await self._open()
        _keep_alive(stream)
        return stream

    async def _open(self) -> anyio.abc.ByteStream:
        endpoint = self.endpoint
        proxy = endpoint.proxy
        if proxy is None:
            if endpoint.ssl_context is None:
                return await anyio.connect_tcp(endpoint.host, endpoint.port)
            return await anyio.connect_tcp(
                endpoint.host,
                endpoint.port,
                ssl_context=endpoint.ssl_context,
                tls_hostname=endpoint.tls_name,
                tls_standard_compatible=False,  # our framing detects truncation itself
            )
        stream: anyio.abc.ByteStream = await anyio.connect_tcp(proxy.host, proxy.port)
        if endpoint.ssl_context is None:
            return stream
        try:
            await self._open_tunnel(stream, proxy)
            return await TLSStream.wrap(
                stream,
                hostname=endpoint.tls_name,
                ssl_context=endpoint.ssl_context,
                standard_compatible=False,
            )
        except BaseException:
            await anyio.aclose_forcefully(stream)
            raise

    async def _open_tunnel(self, stream: anyio.abc.ByteStream, proxy: Proxy) -> None:
        authority = f"{bracketed(self.endpoint.host)}:{self.endpoint.port}"
        headers = [("User-Agent", self.user_agent)]
        if proxy.authorization is not None:
            headers.append(("Proxy-Authorization", proxy.authorization))
        await stream.send(encode_request("CONNECT", authority, host=authority, headers=headers))
        parser = ResponseParser("CONNECT", max_body=_CONNECT_ANSWER_MAX)
        response, body = await _read_response(stream, parser)
        if not 200 <= response.status < 300:
            excerpt = body[:_EXCERPT].decode("utf-8", "replace").strip()
            raise ProxyRefusedError(
                f"the proxy {proxy.url} refused CONNECT {authority}: "
                f"{response.status} {response.reason} {excerpt}".rstrip()
            )
        if not parser.reusable:
            raise ProxyRefusedError(f"the proxy {proxy.url} closed the CONNECT tunnel at once")

    async def _checkout(self) -> tuple[anyio.abc.ByteStream, bool]:
        """The most recently used live idle connection (``True``: reused) or a new one."""
        while self._idle:
            stream, since = self._idle.pop()
            if anyio.current_time() - since < _IDLE_SECONDS and not _closed_by_peer(stream):
                return stream, True
            await anyio.aclose_forcefully(stream)
        return await self._connect(), False

    async def release(self, stream: anyio.abc.ByteStream, reusable: bool) -> None:
        """Keep ``stream`` for the next request, or close it."""
        if reusable and not self._closed and len(self._idle) < _MAX_IDLE:
            self._idle.append((stream, anyio.current_time()))
        else:
            await anyio.aclose_forcefully(stream)

    async def request(
        self, method: str, target: str, wire: bytes, *, max_body: int = MAX_BODY
    ) -> tuple[Response, bytes]:
        """Send one encoded request, read the whole answer: its head and body.

        Raises what the connection raises (:data:`CONNECTION_ERRORS`, :class:`ProxyRefusedError`).
        """
        try:  # the common case without a checkpoint (an event loop iteration, cold: ~50 us)
            self._slots.acquire_nowait()
        except anyio.WouldBlock:
            await self._slots.acquire()
        try:
            retry = method == "GET"
            while True:
                stream, reused = await self._checkout()
                parser = ResponseParser(method, max_body=max_body)
                try:
                    await stream.send(wire)
                    response, body = await _read_response(stream, parser)
                except CONNECTION_ERRORS as exc:
                    await anyio.aclose_forcefully(stream)
                    if retry and not parser.started:
                        retry = False
                        logger.debug(
                            "%s %s: the %s connection dropped before an answer (%r), sending "
                            "it again on a new one",
                            method,
                            target,
                            "reused" if reused else "new",
                            exc,
                        )
                        continue
                    raise
                except BaseException:  # cancelled or timed out mid-request: state unknown
                    await anyio.aclose_forcefully(stream)
                    raise
                await self.release(stream, parser.reusable)
                return response, body
        finally:
            self._slots.release()

    async def open_stream(self, method: str, wire: bytes) -> StreamedResponse:
        """Send one encoded request, read the answer's head; the body is read by the caller
        (:class:`StreamedResponse`, which must be closed). Not counted against the slots:
        watches hold their connection for minutes."""
        retry = method == "GET"
        while True:
            stream, _ = await self._checkout()
            parser = ResponseParser(method, max_body=None)
            try:
                await stream.send(wire)
                while True:
                    event = parser.next_event()
                    if event is NEED_DATA:
                        parser.receive_data(await _receive(stream))
                    elif isinstance(event, Response):
                        return StreamedResponse(self, stream, parser, event)
            except CONNECTION_ERRORS:
                await anyio.aclose_forcefully(stream)
                if retry and not parser.started:
                    retry = False  # the keep-alive race, as in request()
                    continue
                raise
            except BaseException:
                await anyio.aclose_forcefully(stream)
                raise


class StreamedResponse:
    """An answer whose body is read piece by piece (a watch)."""

    def __init__(
        self, pool: HttpPool, stream: anyio.abc.ByteStream, parser: ResponseParser, head: Response
    ) -> None:
        self.status = head.status
        self.reason = head.reason
        self._pool = pool
        self._stream: anyio.abc.ByteStream | None = stream
        self._parser = parser
        self._done = False
        self._pending = bytearray()

    async def receive_some(self) -> bytes:
        """The next body bytes; ``b""`` once the body ended."""
        if self._done or self._stream is None:
            return b""
        while True:
            event = self._parser.next_event()
            if event is NEED_DATA:
                self._parser.receive_data(await _receive(self._stream))
            elif isinstance(event, Data):
                return event.data
            else:
                self._done = True
                return b""

    async def read_line(self) -> bytes:
        """The next ``\\n``-terminated line of the body (the newline kept), or what is left
        without one at the end of the body (``b""``: nothing left)."""
        while True:
            end = self._pending.find(b"\n")
            if end >= 0:
                line = bytes(self._pending[: end + 1])
                del self._pending[: end + 1]
                return line
            if len(self._pending) > _MAX_EVENT_LINE:
                raise KubeServerError(f"a watch event longer than {_MAX_EVENT_LINE} bytes: refused")
            data = await self.receive_some()
            if not data:
                line = bytes(self._pending)
                self._pending.clear()
                return line
            self._pending += data

    async def read_all(self, limit: int = MAX_BODY) -> bytes:
        """The rest of the body (an error answer's Status), at most ``limit`` bytes."""
        chunks = bytearray()
        while data := await self.receive_some():
            chunks += data
            if len(chunks) > limit:
                raise KubeServerError(f"an answer of more than {limit} bytes: refused")
        return bytes(chunks)

    async def aclose(self) -> None:
        """Give the connection back (reusable if the body was read to its end) or close it."""
        stream, self._stream = self._stream, None
        if stream is not None:
            await self._pool.release(stream, self._done and self._parser.reusable)


async def _receive(stream: anyio.abc.ByteStream) -> bytes:
    """Bytes from the connection, ``b""`` at its end."""
    try:
        return await stream.receive(_READ_SIZE)
    except anyio.EndOfStream:
        return b""


async def _read_response(
    stream: anyio.abc.ByteStream, parser: ResponseParser
) -> tuple[Response, bytes]:
    response: Response | None = None
    chunks: list[bytes] = []
    while True:
        event = parser.next_event()
        if event is NEED_DATA:
            parser.receive_data(await _receive(stream))
        elif isinstance(event, Data):
            chunks.append(event.data)
        elif isinstance(event, Response):
            response = event
        elif isinstance(event, EndOfMessage):
            assert response is not None  # the parser gives the head first
            return response, b"".join(chunks)


def quote_segment(value: str) -> str:
    """``value`` as one path segment: object names (DNS labels / subdomains) as they are, any
    other text percent-encoded (``quote`` is the slow part of building a request)."""
    if _PLAIN_SEGMENT.fullmatch(value):
        return value
    return quote(str(value), safe="")


def _keep_alive(stream: anyio.abc.ByteStream) -> None:
    """Turn TCP keep-alive probes on (see :data:`_KEEPALIVE_SECONDS`)."""
    sock = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, _KEEPALIVE_SECONDS)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, _KEEPALIVE_SECONDS)
    except OSError as exc:
        logger.debug("cannot turn TCP keep-alive on: %s", exc)


def _closed_by_peer(stream: anyio.abc.ByteStream) -> bool:
    """Whether an idle connection is unusable: the server closed it (FIN or RST waiting) or sent
    bytes nobody asked for, i.e. its socket is readable. One zero-timeout poll (~2 us): an idle
    connection is not being read (anyio pauses reading between receives), so its end would
    otherwise only show when a request is written to it, and a PATCH must not be lost to that."""
    sock = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
    if sock is None:
        return False
    poller = select.poll()
    try:
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True  # closed under us


def bracketed(host: str) -> str:
    """``host`` as it appears in an authority (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host
