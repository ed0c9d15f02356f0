"""The gRPC server's write coalescing: one event-loop turn's writes reach the socket as one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dracpu.adapters.grpc_server import _CoalescingTransport

__all__: list[str] = []


class _RecordingTransport(asyncio.Transport):
    """A transport that records what reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": "kubelet"}.get(name, default)


def _pair() -> tuple[_RecordingTransport, _CoalescingTransport]:
    inner = _RecordingTransport()
    return inner, _CoalescingTransport(inner, asyncio.get_running_loop())


@pytest.mark.anyio
async def test_writes_of_one_turn_are_one_write_in_order() -> None:
    inner, transport = _pair()
    transport.write(b"headers|")
    transport.write(b"")
    transport.writelines([b"data|", bytearray(b"trailers")])
    assert inner.writes == []  # nothing before the turn ends
    await asyncio.sleep(0)
    assert inner.writes == [b"headers|data|trailers"]
    transport.write(memoryview(b"next"))
    await asyncio.sleep(0)
    assert inner.writes == [b"headers|data|trailers", b"next"]


@pytest.mark.anyio
async def test_close_sends_what_is_queued_first() -> None:
    inner, transport = _pair()
    transport.write(b"trailers")
    transport.close()
    assert inner.writes == [b"trailers"]
    assert inner.closed
    assert transport.is_closing()
    await asyncio.sleep(0)
    assert inner.writes == [b"trailers"]  # the scheduled flush finds nothing more


@pytest.mark.anyio
async def test_abort_drops_what_is_queued() -> None:
    inner, transport = _pair()
    transport.write(b"lost")
    transport.abort()
    await asyncio.sleep(0)
    assert inner.writes == []
    assert inner.aborted


@pytest.mark.anyio
async def test_nothing_is_written_to_a_closing_transport() -> None:
    inner, transport = _pair()
    transport.write(b"late")
    inner.closed = True  # the peer went away meanwhile
    await asyncio.sleep(0)
    assert inner.writes == []
    assert transport.get_extra_info("peername") == "kubelet"
