"""Handlers for the gRPC server tests (grpcio, raw h2 and grpc-go peers alike)."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from dracpu.adapters.grpc_server import Call, UnixServer

__all__ = ["CALL_TIMEOUT", "ECHO", "SLEEP", "Barrier", "Shielded", "Sleeper", "reverse"]

ECHO = "/test.Echo/Echo"
SLEEP = "/test.Echo/Sleep"
CALL_TIMEOUT = 10.0  # generous: 2 shared cores


async def reverse(call: Call) -> None:
    """Echo service: the request reversed (so an answer cannot be the request passed through)."""
    call.reply(call.request[::-1])


@dataclass
class Sleeper:
    """A handler that never answers: it waits until cancelled, and records that it was."""

    started: anyio.Event = field(default_factory=anyio.Event)
    cancelled: anyio.Event = field(default_factory=anyio.Event)
    calls: int = 0

    async def __call__(self, call: Call) -> None:
        self.calls += 1
        self.started.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled.set()
            raise


@dataclass
class Shielded:
    """A handler that ignores cancellation until ``go`` is set, then replies; ``replied``
    records what ``reply`` returned."""

    started: anyio.Event = field(default_factory=anyio.Event)
    go: anyio.Event = field(default_factory=anyio.Event)
    replied: list[bool] = field(default_factory=list)

    async def __call__(self, call: Call) -> None:
        with anyio.CancelScope(shield=True):
            self.started.set()
            await self.go.wait()
            self.replied.append(call.reply(b"nobody listens"))


@dataclass
class Barrier:
    """Echo (reversed) that answers no call before ``count`` are inside at once (calls the server
    ran one after another would time out here); once they were, calls pass. ``peak``: the most
    inside at once; ``connections_when_full``: the open connections of ``server`` (if set once
    serving) when the ``count``-th came in."""

    count: int
    server: UnixServer | None = None
    inside: int = 0
    peak: int = 0
    connections_when_full: list[int] = field(default_factory=list)
    full: anyio.Event = field(default_factory=anyio.Event)

    async def __call__(self, call: Call) -> None:
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
        call.reply(call.request[::-1])
