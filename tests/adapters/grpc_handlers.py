"""Handlers for the gRPC server tests (grpcio, raw h2 and grpc-go peers alike)."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from dracpu.adapters.grpc_server import Call

__all__ = ["ECHO", "SLEEP", "Shielded", "Sleeper", "reverse"]

ECHO = "/test.Echo/Echo"
SLEEP = "/test.Echo/Sleep"


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
