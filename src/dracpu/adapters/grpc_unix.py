"""grpclib servers on the kubelet's unix sockets.

:func:`open_grpc_server` serves grpclib services (betterproto2-generated ``*Base`` classes, or
anything with ``__mapping__``) on a unix socket path for the life of an ``async with`` block:
the socket file published as :mod:`dracpu.adapters.socket_files` says, messages through
:class:`MessageCodec` (a request betterproto2 cannot parse is ``INVALID_ARGUMENT``; an answer
sent many times may be :class:`Encoded` once), an unknown method ``UNIMPLEMENTED`` in a proper
gRPC answer, each connection remembering its last :data:`CLOSED_STREAMS_KEPT` closed streams,
a peer that does not read its answers not read either (:class:`_Protocol`), and on exit every
call cancelled (within :data:`STOP_TIMEOUT`), every connection closed and the socket removed.
The rest is grpclib's (HTTP/2 by ``h2``, ``grpc-timeout``, a call cancelled with its stream).
grpclib runs on asyncio only and cancels a call with ``Task.cancel``, which anyio's shielded
scopes do not hold off: handlers must be safe to cancel at any ``await``. Why each of these, and
betterproto2's leniency, are ``docs/architecture.md``, "DRA socket".
"""

from __future__ import annotations

import asyncio
import logging
import socket
import weakref
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
import anyio.lowlevel
import grpclib.const
import grpclib.server
import h2.connection
import h2.exceptions
from grpclib._typing import IServable
from grpclib.const import Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError
from grpclib.protocol import H2Protocol
from h2.utilities import SizeLimitDict

from dracpu.adapters.socket_files import BACKLOG, listening_socket
from dracpu.errors import DracpuError

__all__ = [
    "CLOSED_STREAMS_KEPT",
    "STOP_TIMEOUT",
    "Encoded",
    "GrpcUnixServer",
    "H2ProtocolError",
    "MessageCodec",
    "Servable",
    "StreamClosed",
    "StreamHandler",
    "open_grpc_server",
    "receive_request",
    "with_stream_handlers",
]

logger = logging.getLogger(__name__)

# How long stopping waits for the handlers of cancelled calls to finish (seconds): they only
# need to notice the cancellation. Bounded so a stuck handler cannot hold up the daemon's 5 s
# stop.
STOP_TIMEOUT = 1.0

# h2 remembers how each closed stream of a connection ended, to answer a frame that arrives for
# it late (a RST_STREAM back for a stream it reset; python-hyper/h2#48), in an ordered dict of
# up to H2Connection.MAX_CLOSED_STREAMS entries, 2**16 by default: one more per call until then.
# The kubelet keeps its connection to the DRA socket for the life of the plugin and makes two
# calls per pod (Prepare, Unprepare), so the daemon's memory would grow for some 30,000 pods. A
# late frame trails its stream by a round trip on a unix socket, while a peer may have at most
# 100 streams open (h2's SETTINGS_MAX_CONCURRENT_STREAMS): ten times that covers it. Set on each
# connection this server accepts (:class:`_Protocol`); h2's class and every other connection
# (our clients') keep h2's default.
CLOSED_STREAMS_KEPT = 1024
# Event-loop turns the stop lets pass for connections already accepted to be set up: asyncio
# needs two (its accept task makes the protocol and the transport, which then calls
# connection_made), a few more while a protocol still waits for its connection; a peer that
# vanished in between never completes, hence the bound.
_SETUP_TURNS = 2
_ACCEPT_TURNS = 8

Servable = IServable
"""A grpclib service object (anything with ``__mapping__``, e.g. a betterproto2 ``*Base``)."""

StreamClosed = h2.exceptions.StreamClosedError
"""What grpclib's ``Stream.send_message`` raises when the peer closed or reset the stream before
grpclib cancelled the call: python-hyper ``h2``'s exception, which grpclib lets through and has
no name of its own for (its server catches h2's around a call's trailers, ``server.py``). This
module is the one place of ours that names h2; handlers catch :data:`StreamClosed`."""

H2ProtocolError = h2.exceptions.ProtocolError
"""What grpclib lets through from ``h2`` when a peer breaks HTTP/2 itself (a client's call on a
connection the kubelet broke off, :mod:`dracpu.adapters.pod_resources`)."""

StreamHandler = Callable[["grpclib.server.Stream[Any, Any]"], Coroutine[Any, Any, None]]
"""An rpc method as grpclib calls it: it receives and answers on the call's stream."""

_Request = TypeVar("_Request")


@dataclass(frozen=True, slots=True)
class Encoded:
    """An answer encoded beforehand (``bytes(message)``), for a message sent many times:
    :class:`MessageCodec` sends ``data`` as it is when ``message_type`` is the method's."""

    message_type: type[Any]
    data: bytes


class MessageCodec(ProtoCodec):
    """grpclib's protobuf codec for betterproto2 messages, with errors the caller can act on:
    a request that does not parse is ``INVALID_ARGUMENT`` (the client's fault), an answer that
    does not encode is ``INTERNAL`` (ours); both are logged. An :class:`Encoded` answer is sent
    as its bytes."""

    def decode(self, data: bytes, message_type: Any) -> Any:
        try:
            return message_type.FromString(data)
        except Exception as exc:  # betterproto2 raises what its parsing hits (EOFError, ...)
            name = getattr(message_type, "__name__", repr(message_type))
            logger.warning("refusing a request: cannot decode %s: %s", name, exc)
            raise GRPCError(Status.INVALID_ARGUMENT, f"cannot decode {name}: {exc}") from exc

    def encode(self, message: Any, message_type: Any) -> bytes:
        if isinstance(message, Encoded):
            if message.message_type is not message_type:
                logger.error(
                    "a %s answer where %s is due", message.message_type.__name__, message_type
                )
                raise GRPCError(Status.INTERNAL, "cannot encode the answer: wrong message type")
            return message.data
        try:
            return super().encode(message, message_type)
        except Exception as exc:
            logger.error("cannot encode a %s answer: %s", type(message).__name__, exc)
            raise GRPCError(Status.INTERNAL, f"cannot encode the answer: {exc}") from exc


async def receive_request(stream: grpclib.server.Stream[_Request, Any]) -> _Request:
    """The request message of a unary call; ``INVALID_ARGUMENT`` if the client sent none."""
    request = await stream.recv_message()
    if request is None:
        raise GRPCError(Status.INVALID_ARGUMENT, "the call carries no request message")
    return request


def with_stream_handlers(
    mapping: Mapping[str, grpclib.const.Handler], handlers: Mapping[str, StreamHandler]
) -> dict[str, grpclib.const.Handler]:
    """A generated service's ``__mapping__`` with its rpc methods served by ``handlers`` (by
    method name, e.g. ``"GetInfo"``) instead of the generated glue. The paths, cardinalities and
    message types stay the generated ones; a name the service lacks is a :class:`DracpuError`."""
    served = dict(mapping)
    by_name = {path.rsplit("/", 1)[-1]: path for path in served}
    for name, handler in handlers.items():
        path = by_name.get(name)
        if path is None:
            raise DracpuError(f"no rpc method {name!r} in {sorted(by_name)}")
        served[path] = served[path]._replace(func=handler)
    return served


def _unimplemented(path: str) -> grpclib.const.Handler:
    async def refuse(stream: grpclib.server.Stream[Any, Any]) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, f"unknown method {path}")

    return grpclib.const.Handler(refuse, grpclib.const.Cardinality.UNARY_UNARY, None, None)


class _MethodTable(dict[str, grpclib.const.Handler]):
    """The server's methods by path; an unknown path gets a handler that answers
    ``UNIMPLEMENTED`` through a proper gRPC stream. grpclib's own answer to an unknown path
    carries no ``content-type``, which grpc-go (the kubelet) refuses: it reports ``UNKNOWN``
    "missing content-type field" instead of ``UNIMPLEMENTED``."""

    def get(self, path: str, default: Any = None) -> grpclib.const.Handler:
        handler = super().get(path)
        return _unimplemented(path) if handler is None else handler


class _Protocol(H2Protocol):
    """grpclib's connection, reading no more from a peer that does not read its answers.

    grpclib only stops writing when the transport's buffer is full; reading on, it would buffer
    without end what h2 answers by itself (a PING's acknowledgement, SETTINGS acks) for a peer
    that sends and never reads. Pausing reading too lets the kernel's socket buffers hold the
    peer back (asyncio's write buffer limits: ``Transport.set_write_buffer_limits``).
    """

    _peer: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._peer = cast(asyncio.Transport, transport)
        super().connection_made(transport)
        # grpclib made this connection's h2 state machine; h2 reads its bound of closed
        # streams once, when it makes the (still empty) record of them: a record of our bound
        # takes its place. Neither library has a public way to set it per connection.
        h2_connection: h2.connection.H2Connection = self.connection._connection
        h2_connection._closed_streams = SizeLimitDict(size_limit=CLOSED_STREAMS_KEPT)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._peer is not None:
            self._peer.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._peer is not None and not self._peer.is_closing():
            self._peer.resume_reading()


class _Server(grpclib.server.Server):
    """grpclib's server with :class:`_Protocol` connections, remembered so that stopping can
    close them, and answering unknown methods as grpc-go expects (:class:`_MethodTable`)."""

    def __init__(self, services: Collection[Servable]) -> None:
        super().__init__(list(services), codec=MessageCodec())
        self._mapping = _MethodTable(self._mapping)
        self._protocols: weakref.WeakSet[H2Protocol] = weakref.WeakSet()

    def _protocol_factory(self) -> H2Protocol:
        made = super()._protocol_factory()  # registers the connection's call handler
        protocol = _Protocol(made.handler, made.config, made.h2_config)
        self._protocols.add(protocol)
        return protocol

    def accepting(self) -> bool:
        """A connection is being set up (its protocol has no connection yet)."""
        return any(not hasattr(p, "connection") for p in list(self._protocols))

    def open_connections(self) -> int:
        # H2Protocol.connection exists once connection_made has run.
        return sum(
            1
            for p in list(self._protocols)
            if hasattr(p, "connection") and not p.connection.is_closing()
        )

    def close_connections(self) -> None:
        for protocol in list(self._protocols):
            if hasattr(protocol, "processor"):
                protocol.processor.close("the server is stopping")


@dataclass(frozen=True, slots=True)
class GrpcUnixServer:
    """A running server: its socket path, and its open connections (for tests)."""

    path: Path
    _server: _Server

    @property
    def open_connections(self) -> int:
        return self._server.open_connections()


def _check_unique(services: Collection[Servable]) -> None:
    seen: set[str] = set()
    for service in services:
        for path in service.__mapping__():
            if path in seen:
                raise DracpuError(f"two handlers for {path}")
            seen.add(path)


@asynccontextmanager
async def open_grpc_server(
    services: Collection[Servable], path: Path, *, private_dir: bool = False
) -> AsyncIterator[GrpcUnixServer]:
    """Serve ``services`` on the unix socket ``path`` until the block exits.

    ``private_dir``: the directory belongs to us alone, so an existing one is narrowed to 0700.

    Raises :class:`DracpuError` (naming the path) when the path is too long, the directory cannot
    be made, a directory is in the way, binding or serving fails, or two services share a
    method path. Resource handling: the listening socket, the connections, the calls in flight
    (cancelled) and the socket file are released on exit, also on cancellation.
    """
    _check_unique(services)
    server = _Server(services)
    with listening_socket(path, private_dir=private_dir) as listener:
        try:
            await server.start(sock=listener.socket, backlog=BACKLOG)
        except OSError as exc:
            raise DracpuError(f"cannot serve on {str(path)!r}: {exc.strerror or exc}") from exc
        try:
            listener.publish()
            logger.debug("serving gRPC on %s", path)
            yield GrpcUnixServer(path, server)
        finally:
            with anyio.CancelScope(shield=True):
                await _stop(server, listener.socket, path)


async def _stop(server: _Server, listening: socket.socket, path: Path) -> None:
    """Stop accepting, cancel the calls, close every connection, wait (bounded) for the calls."""
    # First stop taking connections off the listening socket, and let those already taken
    # become connections: asyncio accepts in a task of its own, and one that runs after its
    # Server closed never gets a transport, nor is its socket closed (Python 3.11), which would
    # leave the peer connected to nothing.
    asyncio.get_running_loop().remove_reader(listening.fileno())
    for turn in range(_ACCEPT_TURNS):
        if turn >= _SETUP_TURNS and not server.accepting():
            break
        await anyio.lowlevel.checkpoint()
    server.close()  # closes the listening socket and cancels the calls' tasks
    server.close_connections()
    with anyio.move_on_after(STOP_TIMEOUT) as waited:
        await server.wait_closed()
    if waited.cancelled_caught:
        logger.warning("gRPC calls on %s did not end within %.1f s of the stop", path, STOP_TIMEOUT)
