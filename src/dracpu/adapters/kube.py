"""The Kubernetes API, as dracpu uses it: Nodes (read), ResourceClaims (read, status patch),
ResourceSlices (list, watch, create, update, delete). The ONLY module that imports
``kubernetes`` (design §8: the import costs ~0.5 s and ~30 MiB, so nothing else pays for it).

``kubernetes`` is used for ONE job: loading the configuration (kubeconfig or the in-cluster
service account, client certificates, exec plugins, token files), i.e. a
``kubernetes.aio.client.Configuration``. Every request goes through our own small HTTP/1.1
client: the sans-IO :mod:`dracpu.wire.http1` over a pool of ``anyio`` TCP (TLS) streams.

Why (measured on the 2-core VM, a claim GET against the in-process fake API server, of which
the server's handler is ~0.22 ms): the ``kubernetes.aio`` ``ApiClient`` -> aiohttp path took
0.34-0.40 ms back to back and 0.94-1.14 ms a few ms after the previous burst of work (cold
caches, the case of a kubelet Prepare call); a raw stream took 0.19 / 0.59 ms. What counts
cold is how much code one request runs, and the GET of the claim sits in the Prepare path
(issue 4). The same client also serves the claim status PATCH and the slice publisher.

What the client does, and what it keeps from ``kubernetes.aio`` (``rest.py``, ``api_client.py``):

- **TLS**: one ``ssl.SSLContext`` built at open as ``RESTClientObject`` builds it (CA file /
  data, client certificate, ``verify_ssl``, ``disable_strict_ssl_verification``) plus
  ``assert_hostname=False`` and ``tls_server_name`` (the SNI and the name checked).
- **Auth**: per request, ``await configuration.auth_settings()`` (it runs the token refresh
  hook of the in-cluster service account), header settings become headers, as
  ``update_params_for_auth`` does; HTTP basic auth when a user name / password is configured
  and no other credential is. Plus ``User-Agent: dracpu/<version>`` and
  ``Accept: application/json``.
- **Proxy**: resolved ONCE at open (kubeconfig ``proxy-url`` first, else ``https_proxy`` /
  ``http_proxy`` for the server's scheme, ``no_proxy`` honoured, credentials from the proxy URL
  or ``~/.netrc``) as the old aiohttp set-up did and as client-go does
  (``http.ProxyFromEnvironment``). An https server is reached through a ``CONNECT`` tunnel,
  then TLS; an http server gets absolute-form request targets; ``Proxy-Authorization`` when
  credentials are known. Only ``http://`` proxies are supported (aiohttp had the same limit).
- **Connections**: keep-alive, idle ones reused last-in first-out, at most
  :data:`_MAX_CONNECTIONS` ordinary requests at a time (watches hold their own connection on
  top). A connection that failed or that the server closed is dropped: before reuse, an idle
  connection whose socket is readable (FIN, RST, stray bytes) or that has been idle for
  :data:`_IDLE_SECONDS` is closed; TCP keep-alive probes run on every connection. A GET whose
  connection drops before any byte of the answer arrives (the keep-alive race: the server
  closed an idle connection just as we reused it) is sent once more on a fresh connection
  (RFC 9112 §9.3.1: idempotent; aiohttp did the same); a PATCH/POST/PUT/DELETE is never sent
  twice.
- **Timeouts**: ``request_timeout`` bounds a whole ordinary request; a watch is bounded by its
  ``timeoutSeconds`` plus :data:`_WATCH_CLIENT_MARGIN`.

Objects are plain dicts, camelCase as on the wire, with every field the server sent: the
generated pydantic models would drop fields this client version does not know and re-validate
every one of a 128-device slice's fields on each call.

Errors become the :mod:`dracpu.errors` tree, with the HTTP status and the server's message:
404 :class:`KubeNotFoundError`, 409 :class:`KubeConflictError`, other 4xx
:class:`KubeClientError`, 5xx, 429 (too many requests: transient) and every connection failure,
TLS failure, protocol violation or timeout :class:`KubeServerError` (``status`` is ``None`` for
those).

Watches (:meth:`KubeClient.watch_resource_slices`) list first, then stream events from the
list's resourceVersion, reconnecting from the last seen version when the server ends the stream;
a ``410 Gone`` (the version was compacted away) makes them list again. A list is reported as one
``("LISTED", <ResourceSliceList>)`` event so the consumer can resynchronise from it.
"""

from __future__ import annotations

import base64
import json
import logging
import netrc
import os
import random
import re
import select
import socket
import ssl
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote, unquote, urlencode, urlsplit

import anyio
import anyio.abc
from anyio.streams.tls import TLSStream
from kubernetes.aio import client as kube_client
from kubernetes.aio import config as kube_config

from dracpu import __version__
from dracpu.errors import (
    ConfigError,
    KubeAPIError,
    KubeClientError,
    KubeConflictError,
    KubeNotFoundError,
    KubeServerError,
    ProtocolError,
)
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
    "DEFAULT_REQUEST_TIMEOUT",
    "LISTED",
    "MERGE_PATCH",
    "KubeClient",
    "WatchEvent",
    "consumable_capacity_dropped",
    "open_kube_client",
    "slice_selector",
]

logger = logging.getLogger(__name__)

WatchEvent = tuple[str, dict[str, Any]]
"""``(type, object)``: ``ADDED``/``MODIFIED``/``DELETED`` with the object, or ``LISTED`` with
the whole ``ResourceSliceList`` after a (re)list."""

LISTED = "LISTED"  # our synthetic event type for a (re)list; not an API server event type

# Content types (https://kubernetes.io/docs/reference/using-api/api-concepts/#patch-and-apply).
MERGE_PATCH = "application/merge-patch+json"  # RFC 7386: what we send for claim status patches
_JSON_PATCH = "application/json-patch+json"  # RFC 6902: a list of operations
_JSON = "application/json"

# Client-side timeout of one ordinary request (seconds). client-go has none by default; a
# bounded wait lets the publisher's first attempt finish (and the daemon become ready) while the
# API server is unreachable.
DEFAULT_REQUEST_TIMEOUT = 30.0
# Server-side watch duration: client-go's reflector picks timeoutSeconds uniformly in
# [minWatchTimeout, 2*minWatchTimeout) with minWatchTimeout = 5 min, spreading reconnects.
_WATCH_MIN_SECONDS = 300
# Extra client-side time beyond timeoutSeconds before a silent watch counts as dead.
_WATCH_CLIENT_MARGIN = 30.0
# How much of a non-JSON error body goes into an error message.
_BODY_EXCERPT = 200
# Ordinary requests in flight at once (each on its own connection). dracpu makes a few at a
# time (a Prepare's GET + PATCH per claim, the publisher's writes); the kubelet sends Prepare
# calls one after the other. 8 is aiohttp's per-host default order of magnitude (its total
# limit is 100) kept small: the API server counts our connections against the node's budget.
_MAX_CONNECTIONS: Final = 8
# Idle keep-alive connections kept for reuse (the rest are closed when released).
_MAX_IDLE: Final = _MAX_CONNECTIONS
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
# Default ports of the API server URL's schemes (RFC 9110 §4.2).
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
# What a connection failure can raise below us: socket errors (ssl.SSLError, TimeoutError are
# OSErrors), anyio's stream errors, and the peer's HTTP violations (dracpu.wire.http1).
_CONNECTION_ERRORS: Final = (
    OSError,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
    ProtocolError,
)

# Path segments that need no percent-encoding (RFC 3986 unreserved characters).
_PLAIN_SEGMENT: Final = re.compile(r"[A-Za-z0-9._~-]+")

_RESOURCE_V1 = "/apis/resource.k8s.io/v1"
_SLICES = _RESOURCE_V1 + "/resourceslices"
_SLICE = _SLICES + "/{name}"
_CLAIM = _RESOURCE_V1 + "/namespaces/{namespace}/resourceclaims/{name}"
_CLAIM_STATUS = _CLAIM + "/status"
_NODE = "/api/v1/nodes/{name}"
# resource.k8s.io/v1 ResourceSliceSelectorDriver / ResourceSliceSelectorNodeName: the field
# selectors the API server supports for ResourceSlices (reference kubelet-and-k8s-api.md §6.4).
_FIELD_DRIVER = "spec.driver"
_FIELD_NODE_NAME = "spec.nodeName"


def slice_selector(driver: str | None, node_name: str | None) -> str:
    """The field selector ``spec.driver=<driver>,spec.nodeName=<node>`` (parts left out when
    ``None``)."""
    parts = []
    if driver is not None:
        parts.append(f"{_FIELD_DRIVER}={driver}")
    if node_name is not None:
        parts.append(f"{_FIELD_NODE_NAME}={node_name}")
    return ",".join(parts)


def consumable_capacity_dropped(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """Whether the API server dropped the consumable-capacity fields of a ResourceSlice.

    A server without the ``DRAConsumableCapacity`` feature (off by default before 1.36) silently
    strips ``allowMultipleAllocations`` and ``capacity[*].requestPolicy`` from the devices it
    stores; ``stored`` is the object it answered a create or update with.
    """
    stored_devices = {
        d.get("name"): d
        for d in (stored.get("spec") or {}).get("devices") or []
        if isinstance(d, Mapping)
    }
    for device in (sent.get("spec") or {}).get("devices") or []:
        if not isinstance(device, Mapping):
            continue
        kept = stored_devices.get(device.get("name"))
        if kept is None:
            continue
        if "allowMultipleAllocations" in device and "allowMultipleAllocations" not in kept:
            return True
        kept_capacity = kept.get("capacity") or {}
        for key, entry in (device.get("capacity") or {}).items():
            if (
                isinstance(entry, Mapping)
                and "requestPolicy" in entry
                and "requestPolicy" not in (kept_capacity.get(key) or {})
            ):
                return True
    return False


def _server_message(body: bytes) -> str:
    """The ``message`` of a Status body, else the start of the body."""
    text = body.decode("utf-8", "replace")
    try:
        status = json.loads(text)
    except ValueError:
        status = None
    if isinstance(status, dict) and isinstance(status.get("message"), str):
        return str(status["message"])
    return text[:_BODY_EXCERPT].strip() or "(empty body)"


def _status_error(what: str, status: int, reason: str, body: bytes) -> KubeAPIError:
    message = f"{what}: {status} {reason}: {_server_message(body)}"
    if status == 404:
        return KubeNotFoundError(message, status=status)
    if status == 409:
        return KubeConflictError(message, status=status)
    if status == 429 or status >= 500:
        return KubeServerError(message, status=status)
    return KubeClientError(message, status=status)


def _json_object(what: str, body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise KubeServerError(f"{what}: the API server sent invalid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise KubeServerError(f"{what}: the API server sent {type(obj).__name__}, not an object")
    return obj


def _resource_version(obj: Mapping[str, Any]) -> str | None:
    metadata = obj.get("metadata")
    if isinstance(metadata, Mapping):
        value = metadata.get("resourceVersion")
        if isinstance(value, str) and value:
            return value
    return None


# --- the HTTP transport --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Proxy:
    """An HTTP proxy, resolved once at open."""

    host: str
    port: int
    url: str  # for messages: scheme://host:port, no credentials
    authorization: str | None  # the Proxy-Authorization value, when credentials are known


@dataclass(frozen=True, slots=True)
class _Endpoint:
    """Where and how the API server is reached."""

    scheme: str  # "http" or "https"
    host: str  # to connect to (an IPv6 address without brackets)
    port: int
    authority: str  # the Host header: host[:port] as in the URL
    prefix: str  # a path prefix of the server URL (a proxying front end), "" usually
    ssl_context: ssl.SSLContext | None  # https only
    tls_name: str  # the name sent as SNI and checked in the certificate
    proxy: _Proxy | None

    def target(self, path_and_query: str) -> str:
        """The request target: origin-form, or absolute-form through an http proxy."""
        if self.proxy is not None and self.ssl_context is None:
            return f"{self.scheme}://{self.authority}{self.prefix}{path_and_query}"
        return self.prefix + path_and_query


class _ProxyRefusedError(Exception):
    """The proxy answered CONNECT with something other than 2xx."""


class _HttpPool:
    """Keep-alive HTTP/1.1 connections to one API server."""

    def __init__(self, endpoint: _Endpoint, *, max_connections: int = _MAX_CONNECTIONS) -> None:
        self.endpoint = endpoint
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

    async def _open_tunnel(self, stream: anyio.abc.ByteStream, proxy: _Proxy) -> None:
        authority = f"{_bracketed(self.endpoint.host)}:{self.endpoint.port}"
        headers = [("User-Agent", _USER_AGENT)]
        if proxy.authorization is not None:
            headers.append(("Proxy-Authorization", proxy.authorization))
        await stream.send(encode_request("CONNECT", authority, host=authority, headers=headers))
        parser = ResponseParser("CONNECT", max_body=_BODY_EXCERPT * 64)
        response, body = await _read_response(stream, parser)
        if not 200 <= response.status < 300:
            excerpt = body[:_BODY_EXCERPT].decode("utf-8", "replace").strip()
            raise _ProxyRefusedError(
                f"the proxy {proxy.url} refused CONNECT {authority}: "
                f"{response.status} {response.reason} {excerpt}".rstrip()
            )
        if not parser.reusable:
            raise _ProxyRefusedError(f"the proxy {proxy.url} closed the CONNECT tunnel at once")

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

        Raises what the connection raises (:data:`_CONNECTION_ERRORS`, :class:`_ProxyRefusedError`).
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
                except _CONNECTION_ERRORS as exc:
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

    async def open_stream(self, method: str, wire: bytes) -> _StreamedResponse:
        """Send one encoded request, read the answer's head; the body is read by the caller
        (:class:`_StreamedResponse`, which must be closed). Not counted against the slots:
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
                        return _StreamedResponse(self, stream, parser, event)
            except _CONNECTION_ERRORS:
                await anyio.aclose_forcefully(stream)
                if retry and not parser.started:
                    retry = False  # the keep-alive race, as in request()
                    continue
                raise
            except BaseException:
                await anyio.aclose_forcefully(stream)
                raise


class _StreamedResponse:
    """An answer whose body is read piece by piece (a watch)."""

    def __init__(
        self, pool: _HttpPool, stream: anyio.abc.ByteStream, parser: ResponseParser, head: Response
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


def _quote(value: str) -> str:
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


def _bracketed(host: str) -> str:
    """``host`` as it appears in an authority (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


_USER_AGENT: Final = f"dracpu/{__version__}"


class KubeClient:
    """The calls dracpu makes; every object in and out is a plain JSON ``dict``.

    Use :func:`open_kube_client` to get one. ``request_timeout`` bounds each ordinary request;
    ``watch_seconds`` (``None``: 5-10 min, randomised) is the server-side duration of one watch
    request before it is renewed.
    """

    def __init__(
        self,
        configuration: Any,
        pool: _HttpPool,
        *,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        watch_seconds: int | None = None,
    ) -> None:
        self._configuration = configuration
        self._pool = pool
        self._endpoint = pool.endpoint
        self._request_timeout = request_timeout
        self._watch_seconds = watch_seconds

    # --- plumbing --------------------------------------------------------------------------

    async def _encode(
        self,
        method: str,
        path: str,
        what: str,
        *,
        path_params: Mapping[str, str] | None = None,
        query: Sequence[tuple[str, object]] = (),
        body: object = None,
        content_type: str = _JSON,
    ) -> bytes:
        """The bytes of one request, authenticated now (the token may have been refreshed)."""
        if path_params:
            path = path.format_map({k: _quote(v) for k, v in path_params.items()})
        params = [(key, str(value)) for key, value in query]
        headers = [("User-Agent", _USER_AGENT), ("Accept", _JSON)]
        await self._authenticate(what, headers, params)
        payload = b""
        if body is not None:
            payload = json.dumps(body, separators=(",", ":")).encode()
            headers.append(("Content-Type", content_type))
        endpoint = self._endpoint
        proxy = endpoint.proxy
        if proxy is not None and proxy.authorization is not None and endpoint.ssl_context is None:
            headers.append(("Proxy-Authorization", proxy.authorization))
        if params:
            path = f"{path}?{urlencode(params, quote_via=quote)}"
        try:
            return encode_request(
                method,
                endpoint.target(path),
                host=endpoint.authority,
                headers=headers,
                body=payload,
            )
        except ProtocolError as exc:  # a credential with a line break, say
            raise KubeClientError(f"{what}: cannot send the request: {exc}") from exc

    async def _authenticate(
        self, what: str, headers: list[tuple[str, str]], query: list[tuple[str, str]]
    ) -> None:
        """Add the credentials, as ``ApiClient.update_params_for_auth`` does."""
        configuration = self._configuration
        try:
            # Runs the refresh hook (the in-cluster loader re-reads the token file every minute).
            settings = await configuration.auth_settings()
        except Exception as exc:  # the hook is third-party code: any failure is a bad credential
            raise KubeServerError(f"{what}: cannot get the credentials: {exc!r}") from exc
        authorized = False
        for setting in settings.values():
            value = setting.get("value")
            if value is None:
                continue
            key, text = str(setting.get("key")), str(value).strip()  # client-go: TrimSpace
            if setting.get("in") == "header" and setting.get("type") != "http-signature":
                headers.append((key, text))
                authorized = authorized or key.lower() == "authorization"
            elif setting.get("in") == "query":
                query.append((key, text))
        if not authorized and (configuration.username or configuration.password):
            headers.append(("Authorization", configuration.get_basic_auth_token()))

    async def _request(
        self,
        method: str,
        path: str,
        what: str,
        *,
        path_params: Mapping[str, str] | None = None,
        query: Sequence[tuple[str, object]] = (),
        body: object = None,
        content_type: str = _JSON,
    ) -> dict[str, Any]:
        wire = await self._encode(
            method,
            path,
            what,
            path_params=path_params,
            query=query,
            body=body,
            content_type=content_type,
        )
        answer: tuple[Response, bytes] | None = None
        with anyio.move_on_after(self._request_timeout):
            try:
                answer = await self._pool.request(method, path, wire)
            except (_ProxyRefusedError, *_CONNECTION_ERRORS) as exc:
                raise KubeServerError(f"{what}: cannot reach the API server: {exc!r}") from exc
        if answer is None:
            raise KubeServerError(
                f"{what}: cannot reach the API server: no answer within {self._request_timeout:g} s"
            )
        response, data = answer
        if response.status >= 400:
            raise _status_error(what, response.status, response.reason, data)
        return _json_object(what, data)

    # --- nodes and claims ------------------------------------------------------------------

    async def get_node(self, name: str) -> dict[str, Any]:
        """GET the Node (the slice publisher needs its ``metadata.uid``)."""
        return await self._request("GET", _NODE, f"get node {name}", path_params={"name": name})

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """GET ``resource.k8s.io/v1`` ResourceClaim ``namespace/name``."""
        return await self._request(
            "GET",
            _CLAIM,
            f"get resourceclaim {namespace}/{name}",
            path_params={"namespace": namespace, "name": name},
        )

    async def patch_resource_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any] | Sequence[Any]
    ) -> dict[str, Any]:
        """PATCH the claim's ``status`` subresource; the updated claim.

        A mapping is sent as a JSON merge patch (RFC 7386; put ``metadata.resourceVersion`` in it
        to make the server refuse a stale write with 409), a list as a JSON patch (RFC 6902).
        """
        content_type = _JSON_PATCH if isinstance(patch, Sequence) else MERGE_PATCH
        body = list(patch) if isinstance(patch, Sequence) else dict(patch)
        return await self._request(
            "PATCH",
            _CLAIM_STATUS,
            f"patch resourceclaim {namespace}/{name} status",
            path_params={"namespace": namespace, "name": name},
            body=body,
            content_type=content_type,
        )

    # --- resource slices -------------------------------------------------------------------

    async def list_resource_slices(
        self, driver: str | None, node_name: str | None
    ) -> tuple[list[dict[str, Any]], str]:
        """The ResourceSlices of ``driver`` on ``node_name`` (server-side field selector) and the
        list's resourceVersion (to watch from)."""
        selector = slice_selector(driver, node_name)
        obj = await self._request(
            "GET", _SLICES, f"list resourceslices {selector}", query=[("fieldSelector", selector)]
        )
        items = obj.get("items")
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise KubeServerError(f"list resourceslices {selector}: no list of items in the answer")
        return items, _resource_version(obj) or ""

    async def get_resource_slice(self, name: str) -> dict[str, Any]:
        """GET one ResourceSlice."""
        return await self._request(
            "GET", _SLICE, f"get resourceslice {name}", path_params={"name": name}
        )

    async def create_resource_slice(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """POST a ResourceSlice; the object as stored (compare it with what was sent: the server
        drops fields of disabled features). 409 if the name exists."""
        name = (obj.get("metadata") or {}).get("name") or "(generated)"
        return await self._request("POST", _SLICES, f"create resourceslice {name}", body=dict(obj))

    async def update_resource_slice(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """PUT a ResourceSlice (``metadata.resourceVersion`` makes it conditional: 409 when the
        stored object changed since); the object as stored."""
        name = str((obj.get("metadata") or {}).get("name") or "")
        if not name:
            raise KubeClientError("update resourceslice: the object has no metadata.name")
        return await self._request(
            "PUT",
            _SLICE,
            f"update resourceslice {name}",
            path_params={"name": name},
            body=dict(obj),
        )

    async def delete_resource_slice(
        self, name: str, *, uid: str | None = None, resource_version: str | None = None
    ) -> None:
        """DELETE a ResourceSlice, only if it still has this ``uid`` / ``resource_version``
        (409 otherwise); 404 if it is gone already."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        preconditions = {
            key: value
            for key, value in (("uid", uid), ("resourceVersion", resource_version))
            if value is not None
        }
        if preconditions:
            body["preconditions"] = preconditions
        await self._request(
            "DELETE", _SLICE, f"delete resourceslice {name}", path_params={"name": name}, body=body
        )

    async def watch_resource_slices(
        self, driver: str | None, node_name: str | None
    ) -> AsyncGenerator[WatchEvent, None]:
        """List, then watch, the ResourceSlices of ``driver`` on ``node_name``, forever.

        Yields ``(LISTED, list)`` after every (re)list, then ``(type, object)`` for ``ADDED``,
        ``MODIFIED`` and ``DELETED``. A stream the server closes is renewed from the last
        resourceVersion (bookmarks requested); ``410 Gone`` relists. Any other failure raises a
        :class:`~dracpu.errors.KubeAPIError` (the caller backs off and calls again). Close the
        iterator with ``contextlib.aclosing`` so the connection is released promptly.
        """
        selector = slice_selector(driver, node_name)
        what = f"watch resourceslices {selector}"
        version: str | None = None
        while True:
            if version is None:
                items, version = await self.list_resource_slices(driver, node_name)
                yield (
                    LISTED,
                    {
                        "apiVersion": "resource.k8s.io/v1",
                        "kind": "ResourceSliceList",
                        "metadata": {"resourceVersion": version},
                        "items": items,
                    },
                )
            seconds = self._watch_seconds or random.randrange(
                _WATCH_MIN_SECONDS, 2 * _WATCH_MIN_SECONDS
            )
            query: list[tuple[str, object]] = [
                ("fieldSelector", selector),
                ("watch", "true"),
                ("allowWatchBookmarks", "true"),
                ("timeoutSeconds", str(seconds)),
            ]
            if version:
                query.append(("resourceVersion", version))
            # No cancel scope may stay open across a yield: every wait below gets its own
            # scope, up to this one deadline.
            deadline = anyio.current_time() + seconds + _WATCH_CLIENT_MARGIN
            wire = await self._encode("GET", _SLICES, what, query=query)
            response: _StreamedResponse | None = None
            with anyio.move_on_after(deadline - anyio.current_time()):
                try:
                    response = await self._pool.open_stream("GET", wire)
                except (_ProxyRefusedError, *_CONNECTION_ERRORS) as exc:
                    raise KubeServerError(f"{what}: cannot reach the API server: {exc!r}") from exc
            if response is None:
                raise KubeServerError(f"{what}: cannot reach the API server: no answer in time")
            try:
                if response.status == 410:
                    logger.info("%s: resourceVersion %s is too old, relisting", what, version)
                    version = None
                    continue
                if response.status >= 400:
                    try:
                        with anyio.fail_after(self._request_timeout):
                            data = await response.read_all()
                    except (TimeoutError, KubeServerError, *_CONNECTION_ERRORS) as exc:
                        # The status is known; only the server's message was lost.
                        data = f"(reading the answer failed: {exc!r})".encode()
                    raise _status_error(what, response.status, response.reason, data)
                while True:
                    try:
                        with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                            line = await response.read_line()
                    except TimeoutError:
                        break  # the client-side deadline: renew the watch
                    except _CONNECTION_ERRORS as exc:
                        raise KubeServerError(f"{what}: the stream broke: {exc!r}") from exc
                    if not line:
                        break  # the server ended the stream (timeoutSeconds)
                    if not line.strip():
                        continue
                    event = _json_object(what, line)
                    kind = event.get("type")
                    obj = event.get("object")
                    if not isinstance(obj, dict):
                        raise KubeServerError(f"{what}: event without an object: {line[:200]!r}")
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            logger.info("%s: watch expired (410 Gone), relisting", what)
                            version = None
                            break
                        raise _status_error(
                            what, int(obj.get("code") or 500), str(obj.get("reason") or ""), line
                        )
                    seen = _resource_version(obj)
                    if seen is not None:
                        version = seen
                    if kind == "BOOKMARK":
                        continue
                    if kind not in ("ADDED", "MODIFIED", "DELETED"):
                        logger.warning("%s: ignoring an event of unknown type %r", what, kind)
                        continue
                    yield kind, obj
            finally:
                with anyio.CancelScope(shield=True):
                    await response.aclose()


async def _load_configuration(kubeconfig: Path | None) -> Any:
    configuration = kube_client.Configuration()
    try:
        if kubeconfig is None:
            kube_config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
        else:
            await kube_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=str(kubeconfig),
                client_configuration=configuration,
                persist_config=False,
            )
    except (kube_config.ConfigException, OSError, ValueError, TypeError, KeyError) as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster service account"
        raise ConfigError(f"cannot load the {where}: {exc}") from exc
    return configuration


def _ssl_context(configuration: Any) -> ssl.SSLContext:
    """The TLS settings of ``kubernetes.aio``'s ``RESTClientObject``, plus ``assert_hostname``
    (honoured by the synchronous client only, there)."""
    try:
        context = ssl.create_default_context(
            cafile=configuration.ssl_ca_cert, cadata=configuration.ca_cert_data
        )
        if configuration.cert_file:
            context.load_cert_chain(configuration.cert_file, keyfile=configuration.key_file)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise ConfigError(
            f"cannot set up TLS for the API server {configuration.host}: {exc}"
        ) from exc
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif configuration.assert_hostname is False:
        context.check_hostname = False
    if configuration.disable_strict_ssl_verification:
        context.verify_flags &= ~ssl.VERIFY_X509_STRICT
    return context


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


def _netrc_authorization(host: str) -> str | None:
    """Basic credentials for ``host`` from ``$NETRC`` or ``~/.netrc`` (aiohttp's rule for a
    proxy URL without credentials)."""
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    if not path.is_file():
        return None
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError) as exc:
        logger.warning("cannot read %s for the proxy credentials: %s", path, exc)
        return None
    if entry is None:
        return None
    login, _, password = entry
    return _basic(login or "", password or "")


def _proxy(configuration: Any, scheme: str, host: str) -> _Proxy | None:
    """The proxy for the API server, decided now: kubeconfig ``proxy-url``, else the
    environment (``<scheme>_proxy``, ``no_proxy``)."""
    if configuration.proxy:
        url, source = str(configuration.proxy), "the kubeconfig proxy-url"
    else:
        proxies = urllib.request.getproxies_environment()
        url, source = proxies.get(scheme, ""), f"{scheme}_proxy"
        if not url or urllib.request.proxy_bypass(host):
            return None
    if "://" not in url:
        url = "http://" + url  # "proxy:3128", as curl reads it
    parsed = urlsplit(url)
    try:
        port = parsed.port or _DEFAULT_PORTS["http"]
    except ValueError as exc:
        raise ConfigError(f"{source} {url!r}: bad port: {exc}") from exc
    if parsed.scheme.lower() != "http" or not parsed.hostname:
        if configuration.proxy:
            raise ConfigError(f"{source} {url!r}: only http:// proxies are supported")
        logger.warning("%s %s: only http:// proxies are supported, ignoring it", source, url)
        return None
    authorization: str | None = None
    if parsed.username is not None:
        authorization = _basic(unquote(parsed.username), unquote(parsed.password or ""))
    else:
        authorization = _netrc_authorization(parsed.hostname)
    for key, value in dict(configuration.proxy_headers or {}).items():
        if str(key).lower() == "proxy-authorization":
            authorization = str(value)
    plain = f"http://{_bracketed(parsed.hostname)}:{port}"
    logger.info("the API server %s is reached through proxy %s", configuration.host, plain)
    return _Proxy(host=parsed.hostname, port=port, url=plain, authorization=authorization)


def _endpoint(configuration: Any) -> _Endpoint:
    host = str(configuration.host)
    url = urlsplit(host)
    scheme = url.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not url.hostname:
        raise ConfigError(f"the API server URL {host!r} is not http(s)://host[:port][/path]")
    try:
        port = url.port or _DEFAULT_PORTS[scheme]
    except ValueError as exc:
        raise ConfigError(f"the API server URL {host!r} has a bad port: {exc}") from exc
    tls = scheme == "https"
    return _Endpoint(
        scheme=scheme,
        host=url.hostname,
        port=port,
        authority=url.netloc.rpartition("@")[2],
        prefix=url.path.rstrip("/"),
        ssl_context=_ssl_context(configuration) if tls else None,
        tls_name=configuration.tls_server_name or url.hostname,
        proxy=_proxy(configuration, scheme, url.hostname),
    )


@asynccontextmanager
async def open_kube_client(
    kubeconfig: Path | None,
    *,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    watch_seconds: int | None = None,
) -> AsyncIterator[KubeClient]:
    """A :class:`KubeClient` for the cluster of ``kubeconfig`` (``None``: in-cluster, from the
    pod's service account). Bad or missing configuration raises :class:`ConfigError`."""
    configuration = await _load_configuration(kubeconfig)
    pool = _HttpPool(_endpoint(configuration))
    try:
        yield KubeClient(
            configuration, pool, request_timeout=request_timeout, watch_seconds=watch_seconds
        )
    finally:
        with anyio.CancelScope(shield=True):
            await pool.aclose()
