"""Test services for the grpclib server tests (grpcio, raw HTTP/2 and grpc-go peers alike).

Messages are :class:`Blob`, one ``bytes`` field numbered 1: on the wire exactly Google's
``google.protobuf.BytesValue``, which the peers use (:func:`blob`, :func:`unblob`), so a test
can carry any bytes and the peers share no message code with the server.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import betterproto2
import grpclib.const
import grpclib.server
from google.protobuf.wrappers_pb2 import BytesValue

from dracpu.adapters.grpc_unix import GrpcUnixServer, open_grpc_server, receive_request

__all__ = [
    "CALL_TIMEOUT",
    "ECHO",
    "SLEEP",
    "Barrier",
    "Blob",
    "Sleeper",
    "Stubborn",
    "TestService",
    "blob",
    "reverse",
    "serving",
    "unblob",
]

ECHO = "/test.Echo/Echo"
SLEEP = "/test.Echo/Sleep"
CALL_TIMEOUT = 10.0  # generous: 2 shared cores


@dataclass(eq=False, repr=False)
class Blob(betterproto2.Message):
    """The test services' request and answer: ``bytes data = 1`` (as ``BytesValue.value``)."""

    data: bytes = betterproto2.field(1, betterproto2.TYPE_BYTES)


def blob(data: bytes) -> bytes:
    """``data`` as the peers send it: a Google-protobuf ``BytesValue``."""
    return BytesValue(value=data).SerializeToString()


def unblob(message: bytes) -> bytes:
    """The bytes a peer reads out of an answer."""
    return BytesValue.FromString(message).value


Unary = Callable[[bytes], Awaitable[bytes]]
"""A test rpc method: the request's bytes in, the answer's bytes out (or it raises)."""


class TestService:
    """A grpclib servable of unary methods by path, each a :data:`Unary` over :class:`Blob`."""

    __test__ = False  # not a pytest test class

    def __init__(self, methods: Mapping[str, Unary]) -> None:
        self._methods = dict(methods)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            path: grpclib.const.Handler(
                self._stream_handler(method), grpclib.const.Cardinality.UNARY_UNARY, Blob, Blob
            )
            for path, method in self._methods.items()
        }

    @staticmethod
    def _stream_handler(
        method: Unary,
    ) -> Callable[[grpclib.server.Stream[Any, Any]], Awaitable[None]]:
        async def handle(stream: grpclib.server.Stream[Any, Any]) -> None:
            request: Blob = await receive_request(stream)
            await stream.send_message(Blob(data=await method(request.data)))

        return handle


@asynccontextmanager
async def serving(
    methods: Mapping[str, Unary], path: Path, **kwargs: Any
) -> AsyncIterator[GrpcUnixServer]:
    """:func:`~dracpu.adapters.grpc_unix.open_grpc_server` with a :class:`TestService`."""
    async with open_grpc_server([TestService(methods)], path, **kwargs) as server:
        yield server


async def reverse(request: bytes) -> bytes:
    """Echo: the request reversed (so an answer cannot be the request passed through)."""
    return request[::-1]


@dataclass
class Sleeper:
    """A method that never answers: it waits until cancelled, and records that it was."""

    started: anyio.Event = field(default_factory=anyio.Event)
    cancelled: anyio.Event = field(default_factory=anyio.Event)
    calls: int = 0

    async def __call__(self, request: bytes) -> bytes:
        self.calls += 1
        self.started.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled.set()
            raise
        raise AssertionError("unreachable")


@dataclass
class Stubborn:
    """A method that, cancelled, still waits for ``go`` before it ends (as a handler finishing a
    write it began would; grpclib cancels with ``Task.cancel``, which anyio's shields do not
    hold off, and may do so more than once: this one catches every cancellation, then answers).
    ``finished`` is set once it has ended."""

    started: anyio.Event = field(default_factory=anyio.Event)
    go: anyio.Event = field(default_factory=anyio.Event)
    finished: anyio.Event = field(default_factory=anyio.Event)

    async def __call__(self, request: bytes) -> bytes:
        try:
            self.started.set()
            while not self.go.is_set():
                with contextlib.suppress(anyio.get_cancelled_exc_class()):
                    await self.go.wait()
            return b"nobody listens"
        finally:
            self.finished.set()


@dataclass
class Barrier:
    """Echo (reversed) that answers no call before ``count`` are inside at once (calls the server
    ran one after another would time out here); once they were, calls pass. ``peak``: the most
    inside at once; ``connections_when_full``: the open connections of ``server`` (if set once
    serving) when the ``count``-th came in."""

    count: int
    server: GrpcUnixServer | None = None
    inside: int = 0
    peak: int = 0
    connections_when_full: list[int] = field(default_factory=list)
    full: anyio.Event = field(default_factory=anyio.Event)

    async def __call__(self, request: bytes) -> bytes:
        self.inside += 1
        self.peak = max(self.peak, self.inside)
        if self.inside == self.count and not self.full.is_set():
            if self.server is not None:
                self.connections_when_full.append(self.server.open_connections)
            self.full.set()
        try:
            with anyio.fail_after(CALL_TIMEOUT):
                await self.full.wait()
        finally:
            self.inside -= 1
        return request[::-1]
