"""dracpu's own gRPC server (``dracpu.adapters.grpc_server``) against independent peers.

The kubelet's role is played by grpcio (a gRPC stack that shares no code with ours: C-core
HTTP/2, its own HPACK, flow control and status handling); where a test needs to do what grpcio
will not (send a ``grpc-timeout`` and then keep quiet, reset a stream and prove the server saw
it, never read, break the protocol) the peer is the ``h2`` package (python-hyper) or a bare unix
socket. Handlers here are raw-bytes handlers registered under test paths, so what is checked is
the adapter alone: bytes in and out, statuses, cancellation, flow control, and the server's life
on its socket.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import stat
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import grpc
import pytest
from anyio.abc import SocketStream
from google.protobuf.message import DecodeError
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived as H2DataReceived
from h2.events import Event as H2Event
from h2.events import PingAckReceived, ResponseReceived, StreamEnded, TrailersReceived
from h2.events import StreamReset as H2StreamReset
from h2.settings import SettingCodes

from dracpu._gen.pluginregistration.v1 import RegistrationStatus
from dracpu.adapters.grpc_server import (
    SOCKET_MODE,
    STOP_TIMEOUT,
    Call,
    Service,
    decode_message,
    open_unix_server,
)
from dracpu.errors import DracpuError, GrpcError, LocalProtocolError
from dracpu.wire.grpc import MAX_MESSAGE, Status
from tests.adapters.grpc_handlers import ECHO, SLEEP, Barrier, Shielded, Sleeper, reverse
from tests.peers import load_pb2, unix_target

__all__: list[str] = []

LOGGER = "dracpu.adapters.grpc_server"

G_REG = load_pb2("pluginregistration/v1/api.proto")

# Upper bound of any one wait in these tests, seconds (generous: 2 cores shared by many).
CALL_TIMEOUT = 10.0
MIB = 1 << 20


# HTTP/2 (RFC 9113 §6, §7): frame types and error codes the raw peers look at, written out here
# rather than taken from dracpu.wire.h2 so the peers share nothing with the code under test.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_SETTINGS, FRAME_PING, FRAME_GOAWAY = 0x4, 0x6, 0x7
H2_NO_ERROR, H2_PROTOCOL_ERROR, H2_FRAME_SIZE_ERROR = 0x0, 0x1, 0x6
MAX_WINDOW = 2**31 - 1


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    head = len(payload).to_bytes(3, "big") + bytes((kind, flags)) + struct.pack(">I", stream_id)
    return head + payload


def _frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of each whole frame in ``data``."""
    frames = []
    while len(data) >= 9:
        length = int.from_bytes(data[:3], "big")
        frames.append((data[3], data[4], struct.unpack(">I", data[5:9])[0], data[9 : 9 + length]))
        data = data[9 + length :]
    assert not data, f"{len(data)} bytes of a partial frame"
    return frames


def _whole_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """The whole frames at the start of ``data`` (a partial one at the end is left out)."""
    end = 0
    while len(data) - end >= 9 and len(data) - end >= 9 + int.from_bytes(data[end : end + 3]):
        end += 9 + int.from_bytes(data[end : end + 3])
    return _frames(data[:end])


def _grpc_frame(message: bytes, *, compressed: bool = False) -> bytes:
    """A gRPC length-prefixed message (PROTOCOL-HTTP2.md), built independently of wire.grpc."""
    return bytes((int(compressed),)) + len(message).to_bytes(4, "big") + message


# --------------------------------------------------------------------------------------------
# grpcio peer (sync API, run in a worker thread while the server runs on the event loop)


def _unary(
    socket_path: Path,
    method: str,
    request: bytes,
    *,
    timeout: float = CALL_TIMEOUT,
    options: Sequence[tuple[str, int]] = (),
) -> bytes:
    with grpc.insecure_channel(unix_target(socket_path), options=list(options)) as channel:
        reply: bytes = channel.unary_unary(method)(request, timeout=timeout)
        return reply


def _failure(
    socket_path: Path,
    method: str,
    request: bytes,
    *,
    timeout: float = CALL_TIMEOUT,
    options: Sequence[tuple[str, int]] = (),
) -> tuple[Any, str]:
    """(grpc.StatusCode, details) of a call that must fail."""
    try:
        reply = _unary(socket_path, method, request, timeout=timeout, options=options)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    raise AssertionError(f"{method} succeeded with {reply!r}")


async def _call(socket_path: Path, method: str, request: bytes, **kwargs: Any) -> bytes:
    return await anyio.to_thread.run_sync(
        functools.partial(_unary, socket_path, method, request, **kwargs)
    )


async def _fail(socket_path: Path, method: str, request: bytes, **kwargs: Any) -> tuple[Any, str]:
    return await anyio.to_thread.run_sync(
        functools.partial(_failure, socket_path, method, request, **kwargs)
    )


# --------------------------------------------------------------------------------------------
# Handlers


async def _eventually(condition: Callable[[], bool]) -> None:
    """Let the event loop run until ``condition`` holds (bounded by CALL_TIMEOUT)."""
    with anyio.fail_after(CALL_TIMEOUT):
        # The server's connection count has no event to wait on; poll it.
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.001)


async def _wait(event: anyio.Event) -> None:
    with anyio.fail_after(CALL_TIMEOUT):
        await event.wait()


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "grpc.sock"


# --------------------------------------------------------------------------------------------
# Raw HTTP/2 peer (python-hyper h2 as a client)


@dataclass
class _Answer:
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    trailers: dict[str, str] = field(default_factory=dict)
    ended: bool = False
    reset: int | None = None

    @property
    def grpc_status(self) -> int:
        return int(self.trailers.get("grpc-status") or self.headers["grpc-status"])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class _RawClient:
    """An HTTP/2 client that does exactly what a test tells it to."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.h2 = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        self.answers: dict[int, _Answer] = {}
        self.pings = 0

    async def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            await self.stream.send(data)

    async def request(
        self,
        path: str,
        body: bytes | None,
        *,
        headers: Sequence[tuple[str, str]] = (),
        method: str = "POST",
        content_type: str = "application/grpc",
    ) -> int:
        """Open a stream: the head, then ``body`` (raw bytes, the gRPC prefix included)."""
        stream_id = self.h2.get_next_available_stream_id()
        head = [
            (":method", method),
            (":scheme", "http"),
            (":path", path),
            (":authority", "localhost"),
            ("content-type", content_type),
            ("te", "trailers"),
            *headers,
        ]
        self.h2.send_headers(stream_id, head, end_stream=body is None)
        if body is not None:
            self.h2.send_data(stream_id, body, end_stream=True)
        self.answers[stream_id] = _Answer()
        await self.flush()
        return stream_id

    async def receive(self) -> list[H2Event]:
        events = self.h2.receive_data(await self.stream.receive())
        for event in events:
            if isinstance(event, ResponseReceived):
                self.answers[event.stream_id].headers.update(
                    (_text(k), _text(v)) for k, v in event.headers
                )
            elif isinstance(event, H2DataReceived):
                self.answers[event.stream_id].body += event.data
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, TrailersReceived):
                self.answers[event.stream_id].trailers.update(
                    (_text(k), _text(v)) for k, v in event.headers
                )
            elif isinstance(event, StreamEnded):
                self.answers[event.stream_id].ended = True
            elif isinstance(event, H2StreamReset):
                self.answers[event.stream_id].reset = event.error_code
            elif isinstance(event, PingAckReceived):
                self.pings += 1
        await self.flush()
        return events

    async def answer(self, stream_id: int) -> _Answer:
        answer = self.answers[stream_id]
        with anyio.fail_after(CALL_TIMEOUT):
            while not answer.ended and answer.reset is None:
                await self.receive()
        return answer

    async def round_trip(self) -> None:
        """PING and wait for its ACK: the server has handled everything sent before."""
        expected = self.pings + 1
        self.h2.ping(b"dracpu!!")
        await self.flush()
        with anyio.fail_after(CALL_TIMEOUT):
            while self.pings < expected:
                await self.receive()


@asynccontextmanager
async def _raw_client(
    socket_path: Path, *, huge_windows: bool = False
) -> AsyncIterator[_RawClient]:
    async with await anyio.connect_unix(socket_path) as stream:
        client = _RawClient(stream)
        client.h2.initiate_connection()
        if huge_windows:
            client.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: MAX_WINDOW})
            client.h2.increment_flow_control_window(MAX_WINDOW - 65_535)
        await client.flush()
        yield client


async def _read_to_eof(stream: SocketStream) -> bytes:
    received = bytearray()
    with anyio.fail_after(CALL_TIMEOUT):
        while True:
            try:
                received += await stream.receive()
            except anyio.EndOfStream:
                return bytes(received)


# --------------------------------------------------------------------------------------------
# 1. Unary calls with raw bytes


@pytest.mark.anyio
async def test_request_and_reply_bytes_cross_exactly(socket_path: Path) -> None:
    seen: list[tuple[str, bytes]] = []

    async def record(call: Call) -> None:
        seen.append((call.path, call.request))
        assert call.reply(call.request[::-1])
        assert call.replied

    request = bytes(range(256)) * 40 + b"\x00\xff"  # every byte value, NULs and 0xFF included
    async with open_unix_server([{ECHO: record}], socket_path):
        reply = await _call(socket_path, ECHO, request)

    assert seen == [(ECHO, request)]
    assert reply == request[::-1]


@pytest.mark.anyio
async def test_empty_request_and_empty_reply(socket_path: Path) -> None:
    seen: list[bytes] = []

    async def empty(call: Call) -> None:
        seen.append(call.request)
        call.reply(b"")

    async with open_unix_server([{ECHO: empty}], socket_path):
        reply = await _call(socket_path, ECHO, b"")

    assert seen == [b""]
    assert reply == b""


@pytest.mark.anyio
async def test_fifty_concurrent_calls_on_one_channel_overlap(socket_path: Path) -> None:
    count = 50
    barrier = Barrier(count)

    requests = [f"call {i:02d}".encode() * (i + 1) for i in range(count)]

    def client() -> list[bytes]:
        with grpc.insecure_channel(unix_target(socket_path)) as channel:
            method = channel.unary_unary(ECHO)
            futures = [method.future(request, timeout=CALL_TIMEOUT) for request in requests]
            return [future.result() for future in futures]

    async with open_unix_server([{ECHO: barrier}], socket_path) as server:
        barrier.server = server
        replies = await anyio.to_thread.run_sync(client)

    assert replies == [request[::-1] for request in requests]
    assert barrier.peak == count
    assert barrier.connections_when_full == [1]  # one channel, one connection, 50 streams


@pytest.mark.anyio
async def test_more_calls_than_max_concurrent_streams_all_complete(socket_path: Path) -> None:
    """grpcio honours our SETTINGS_MAX_CONCURRENT_STREAMS (128) and queues the rest: the first
    128 calls are held until all 128 are in, and no 129th ever runs beside them."""
    count = 300
    limit = 128  # dracpu.wire.h2.MAX_CONCURRENT_STREAMS, written out: what we announce
    counted = Barrier(limit)

    requests = [i.to_bytes(2, "big") for i in range(count)]

    def client() -> list[bytes]:
        with grpc.insecure_channel(unix_target(socket_path)) as channel:
            method = channel.unary_unary(ECHO)
            futures = [method.future(request, timeout=CALL_TIMEOUT) for request in requests]
            return [future.result() for future in futures]

    async with open_unix_server([{ECHO: counted}], socket_path):
        replies = await anyio.to_thread.run_sync(client)

    assert replies == [request[::-1] for request in requests]
    assert counted.peak == limit


# --------------------------------------------------------------------------------------------
# 2. Large messages and flow control


@pytest.mark.anyio
async def test_a_3_mib_request_arrives_whole(socket_path: Path) -> None:
    request = os.urandom(3 << 20)  # 3x our stream window: needs our WINDOW_UPDATEs
    seen: list[bytes] = []

    async def big(call: Call) -> None:
        seen.append(call.request)
        call.reply(len(call.request).to_bytes(4, "big"))

    async with open_unix_server([{ECHO: big}], socket_path):
        got = await _call(socket_path, ECHO, request)

    assert len(seen) == 1
    assert seen[0] == request
    assert got == (3 << 20).to_bytes(4, "big")


@pytest.mark.anyio
async def test_a_5_mib_reply_arrives_whole(socket_path: Path) -> None:
    reply = os.urandom(5 << 20)  # more than grpcio's windows take at once: needs its updates

    async def big(call: Call) -> None:
        call.reply(reply)

    # grpcio refuses to receive more than 4 MiB (its default) unless told.
    options = [("grpc.max_receive_message_length", 8 << 20)]
    async with open_unix_server([{ECHO: big}, {"/test.Echo/Reverse": reverse}], socket_path):
        got = await _call(socket_path, ECHO, b"", options=options)
        after = await _call(socket_path, "/test.Echo/Reverse", b"ok")

    assert len(got) == len(reply)
    assert got == reply
    assert after == b"ko"


@pytest.mark.anyio
async def test_a_request_of_exactly_max_message_is_accepted_one_more_byte_refused(
    socket_path: Path,
) -> None:
    lengths: list[int] = []

    async def size(call: Call) -> None:
        lengths.append(len(call.request))
        call.reply(str(len(call.request)).encode())

    options = [("grpc.max_send_message_length", 8 << 20)]

    def client() -> tuple[bytes, Any, str, bytes]:
        with grpc.insecure_channel(unix_target(socket_path), options=options) as channel:
            method = channel.unary_unary(ECHO)
            exact = method(b"\x01" * MAX_MESSAGE, timeout=CALL_TIMEOUT)
            try:
                method(b"\x02" * (MAX_MESSAGE + 1), timeout=CALL_TIMEOUT)
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details()
            else:
                raise AssertionError("a request over MAX_MESSAGE was accepted")
            # The same connection still serves: the refused stream's DATA was accounted for.
            after = method(b"small", timeout=CALL_TIMEOUT)
            return exact, code, details, after

    async with open_unix_server([{ECHO: size}], socket_path):
        exact, code, details, after = await anyio.to_thread.run_sync(client)

    assert exact == str(MAX_MESSAGE).encode()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(MAX_MESSAGE) in details
    assert after == b"5"
    assert lengths == [MAX_MESSAGE, 5]  # the handler never saw the refused request


# --------------------------------------------------------------------------------------------
# 3. Statuses


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "code"),
    [
        (Status.NOT_FOUND, grpc.StatusCode.NOT_FOUND),
        (Status.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT),
        (Status.FAILED_PRECONDITION, grpc.StatusCode.FAILED_PRECONDITION),
        (Status.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
        (Status.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
)
async def test_grpc_error_reaches_the_client_as_its_status(
    socket_path: Path, status: Status, code: Any
) -> None:
    async def refuse(call: Call) -> None:
        raise GrpcError(status, f"claim {call.request.decode()} refused")

    async with open_unix_server([{ECHO: refuse}], socket_path):
        got = await _fail(socket_path, ECHO, b"uid-1")

    assert got == (code, "claim uid-1 refused")


@pytest.mark.anyio
async def test_status_message_with_non_ascii_and_percent_survives(socket_path: Path) -> None:
    message = "CPU 3 gehört schon 100% dem Pod «web-0» ☃\nzweite Zeile %41 %"

    async def refuse(call: Call) -> None:
        raise GrpcError(Status.FAILED_PRECONDITION, message)

    async with open_unix_server([{ECHO: refuse}], socket_path):
        got = await _fail(socket_path, ECHO, b"")

    assert got == (grpc.StatusCode.FAILED_PRECONDITION, message)


@pytest.mark.anyio
async def test_unexpected_exception_is_unknown_logged_and_the_server_keeps_serving(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(call: Call) -> None:
        raise ValueError("a bug in the handler")

    with caplog.at_level(logging.ERROR, logger=LOGGER):
        async with open_unix_server([{"/test.Echo/Broken": broken, ECHO: reverse}], socket_path):
            code, details = await _fail(socket_path, "/test.Echo/Broken", b"x")
            after = await _call(socket_path, ECHO, b"still here")

    assert code == grpc.StatusCode.UNKNOWN
    assert "a bug in the handler" not in details  # internals stay in our log
    assert after == b"ereh llits"
    failures = [r for r in caplog.records if r.exc_info and r.exc_info[0] is ValueError]
    assert len(failures) == 1
    assert "/test.Echo/Broken" in failures[0].getMessage()


@pytest.mark.anyio
async def test_handler_without_reply_is_internal(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def silent(call: Call) -> None:
        pass

    with caplog.at_level(logging.ERROR, logger=LOGGER):
        async with open_unix_server([{ECHO: silent}], socket_path):
            code, _ = await _fail(socket_path, ECHO, b"x")

    assert code == grpc.StatusCode.INTERNAL
    assert any(ECHO in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


@pytest.mark.anyio
async def test_unknown_method_is_unimplemented(socket_path: Path) -> None:
    async with open_unix_server([{ECHO: reverse}], socket_path):
        code, details = await _fail(socket_path, "/test.Echo/Nope", b"x")
        other_service = await _fail(socket_path, "/test.Other/Echo", b"x")
        after = await _call(socket_path, ECHO, b"ok")

    assert code == grpc.StatusCode.UNIMPLEMENTED
    assert "/test.Echo/Nope" in details
    assert other_service[0] == grpc.StatusCode.UNIMPLEMENTED
    assert after == b"ko"


@pytest.mark.anyio
async def test_second_reply_raises_and_the_first_answer_stands(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    second: list[BaseException] = []

    async def twice(call: Call) -> None:
        assert call.reply(b"first")
        try:
            call.reply(b"second")
        except LocalProtocolError as exc:
            second.append(exc)

    async def twice_unhandled(call: Call) -> None:
        call.reply(b"first")
        call.reply(b"second")  # raises out of the handler: logged, the answer already went

    service = {ECHO: twice, "/test.Echo/Unhandled": twice_unhandled}
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        async with open_unix_server([service], socket_path):
            caught = await _call(socket_path, ECHO, b"")
            unhandled = await _call(socket_path, "/test.Echo/Unhandled", b"")

    assert caught == b"first"
    assert len(second) == 1
    assert isinstance(second[0], LocalProtocolError)
    assert unhandled == b"first"
    assert any(r.exc_info and r.exc_info[0] is LocalProtocolError for r in caplog.records)


# --------------------------------------------------------------------------------------------
# 4. Deadlines


@pytest.mark.anyio
async def test_client_timeout_is_deadline_exceeded_and_cancels_the_handler(
    socket_path: Path,
) -> None:
    sleeper = Sleeper()
    async with open_unix_server([{SLEEP: sleeper}], socket_path):
        code, _ = await _fail(socket_path, SLEEP, b"", timeout=0.2)
        await _wait(sleeper.cancelled)

    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert sleeper.calls == 1


@pytest.mark.anyio
async def test_server_enforces_grpc_timeout_itself(socket_path: Path) -> None:
    async def slow(call: Call) -> None:
        await anyio.sleep(5)
        call.reply(b"too late")

    sleeper = Sleeper()
    async with (
        open_unix_server([{SLEEP: sleeper, "/test.Echo/Slow": slow}], socket_path),
        _raw_client(socket_path) as client,
    ):
        start = anyio.current_time()
        slow_id = await client.request(
            "/test.Echo/Slow", _grpc_frame(b""), headers=[("grpc-timeout", "100m")]
        )
        sleeper_id = await client.request(
            SLEEP, _grpc_frame(b""), headers=[("grpc-timeout", "100m")]
        )
        slow_answer = await client.answer(slow_id)
        elapsed = anyio.current_time() - start
        sleeper_answer = await client.answer(sleeper_id)
        await _wait(sleeper.cancelled)

    assert 0.1 <= elapsed < 5
    for answer in (slow_answer, sleeper_answer):
        assert answer.reset is None
        assert answer.headers[":status"] == "200"
        assert answer.grpc_status == Status.DEADLINE_EXCEEDED
        assert not answer.body


@pytest.mark.anyio
async def test_the_deadline_runs_from_the_head_even_if_the_body_never_ends(
    socket_path: Path,
) -> None:
    """A request whose body never completes is answered DEADLINE_EXCEEDED on time; its handler
    never runs, and the connection keeps serving."""
    ran: list[bytes] = []

    async def record(call: Call) -> None:
        ran.append(call.request)
        call.reply(b"")

    async with (
        open_unix_server([{ECHO: record}], socket_path),
        _raw_client(socket_path) as client,
    ):
        start = anyio.current_time()
        stuck = client.h2.get_next_available_stream_id()
        client.h2.send_headers(
            stuck,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", ECHO),
                (":authority", "localhost"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                ("grpc-timeout", "100m"),
            ],
        )
        client.h2.send_data(stuck, _grpc_frame(b"half")[:6])  # no END_STREAM, ever
        client.answers[stuck] = _Answer()
        await client.flush()
        answer = await client.answer(stuck)
        elapsed = anyio.current_time() - start
        after = await client.answer(await client.request(ECHO, _grpc_frame(b"next")))

    assert 0.1 <= elapsed < 5
    assert answer.grpc_status == Status.DEADLINE_EXCEEDED
    assert ran == [b"next"]
    assert after.grpc_status == Status.OK


# --------------------------------------------------------------------------------------------
# 5. Cancellation by the client


@pytest.mark.anyio
async def test_client_cancel_cancels_the_handler(socket_path: Path) -> None:
    sleeper = Sleeper()
    connections: list[int] = []

    def client() -> tuple[bool, bool]:
        with grpc.insecure_channel(unix_target(socket_path)) as channel:
            future = channel.unary_unary(SLEEP).future(b"", timeout=CALL_TIMEOUT)
            anyio.from_thread.run(_wait, sleeper.started)
            cancelled = future.cancel()
            # Still on the same open channel: only the stream's RST_STREAM can cancel it.
            anyio.from_thread.run(_wait, sleeper.cancelled)
            connections.append(anyio.from_thread.run_sync(lambda: server.open_connections))
            return cancelled, future.cancelled()

    async with open_unix_server([{SLEEP: sleeper, ECHO: reverse}], socket_path) as server:
        assert await anyio.to_thread.run_sync(client) == (True, True)
        after = await _call(socket_path, ECHO, b"next")

    assert sleeper.cancelled.is_set()
    assert connections == [1]
    assert after == b"txen"


@pytest.mark.anyio
async def test_closing_the_channel_mid_call_cancels_the_handler(socket_path: Path) -> None:
    sleeper = Sleeper()

    def client() -> Any:
        channel = grpc.insecure_channel(unix_target(socket_path))
        future = channel.unary_unary(SLEEP).future(b"", timeout=CALL_TIMEOUT)
        anyio.from_thread.run(_wait, sleeper.started)
        channel.close()
        return future.exception(timeout=CALL_TIMEOUT)

    async with open_unix_server([{SLEEP: sleeper, ECHO: reverse}], socket_path) as server:
        error = await anyio.to_thread.run_sync(client)
        await _wait(sleeper.cancelled)
        await _eventually(lambda: server.open_connections == 0)
        after = await _call(socket_path, ECHO, b"new connection")

    assert error.code() == grpc.StatusCode.CANCELLED
    assert after == b"noitcennoc wen"


@pytest.mark.anyio
async def test_connection_loss_cancels_the_handler_and_reply_reports_it(socket_path: Path) -> None:
    """A peer that just goes away (no RST_STREAM, no GOAWAY): the handler is cancelled; one that
    shields itself finds ``reply`` returning False."""
    sleeper = Sleeper()
    shielded = Shielded()
    service: Service = {SLEEP: sleeper, "/test.Echo/Shielded": shielded, ECHO: reverse}
    async with open_unix_server([service], socket_path) as server:
        async with _raw_client(socket_path) as client:
            await client.request(SLEEP, _grpc_frame(b""))
            await client.request("/test.Echo/Shielded", _grpc_frame(b""))
            await _wait(sleeper.started)
            await _wait(shielded.started)
            assert server.open_connections == 1
        await _wait(sleeper.cancelled)
        await _eventually(lambda: server.open_connections == 0)
        shielded.go.set()
        await _eventually(lambda: bool(shielded.replied))
        after = await _call(socket_path, ECHO, b"abc")

    assert shielded.replied == [False]
    assert after == b"cba"


@pytest.mark.anyio
async def test_reset_stream_cancels_the_call_and_reply_reports_it(socket_path: Path) -> None:
    sleeper = Sleeper()
    shielded = Shielded()
    service: Service = {SLEEP: sleeper, "/test.Echo/Shielded": shielded, ECHO: reverse}
    async with (
        open_unix_server([service], socket_path),
        _raw_client(socket_path) as client,
    ):
        sleeping = await client.request(SLEEP, _grpc_frame(b""))
        waiting = await client.request("/test.Echo/Shielded", _grpc_frame(b""))
        await _wait(sleeper.started)
        await _wait(shielded.started)
        client.h2.reset_stream(sleeping)
        client.h2.reset_stream(waiting)
        await client.flush()
        await client.round_trip()  # the server has read both RST_STREAMs
        await _wait(sleeper.cancelled)
        shielded.go.set()
        await _eventually(lambda: bool(shielded.replied))
        # The connection lives on: a new stream on it is answered.
        echo = await client.request(ECHO, _grpc_frame(b"same connection"))
        answer = await client.answer(echo)
        await client.round_trip()  # nothing was sent on the reset streams in the meantime

    assert shielded.replied == [False]
    assert answer.grpc_status == Status.OK
    assert bytes(answer.body) == _grpc_frame(b"noitcennoc emas")
    assert not client.answers[sleeping].headers
    assert not client.answers[waiting].headers


# --------------------------------------------------------------------------------------------
# Requests that reach the server over valid HTTP/2 but are not valid gRPC calls


@pytest.mark.anyio
async def test_malformed_grpc_requests_get_error_statuses_on_a_live_connection(
    socket_path: Path,
) -> None:
    calls: list[bytes] = []

    async def record(call: Call) -> None:
        calls.append(call.request)
        call.reply(b"ok")

    async with (
        open_unix_server([{ECHO: record}], socket_path),
        _raw_client(socket_path) as client,
    ):
        cases = {
            "GET": await client.request(ECHO, _grpc_frame(b""), method="GET"),
            "text/plain": await client.request(ECHO, b"hello", content_type="text/plain"),
            "no body": await client.request(ECHO, None),
            "bad timeout": await client.request(
                ECHO, _grpc_frame(b""), headers=[("grpc-timeout", "1x")]
            ),
            "compressed": await client.request(ECHO, _grpc_frame(b"z", compressed=True)),
            "cut short": await client.request(ECHO, _grpc_frame(b"abc")[:-1]),
            "two messages": await client.request(ECHO, _grpc_frame(b"a") + _grpc_frame(b"b")),
            "good": await client.request(ECHO, _grpc_frame(b"fine")),
        }
        answers = {name: await client.answer(sid) for name, sid in cases.items()}

    got = {name: (a.headers[":status"], a.grpc_status) for name, a in answers.items()}
    assert got == {
        "GET": ("405", Status.INTERNAL),
        "text/plain": ("415", Status.INTERNAL),
        "no body": ("200", Status.INTERNAL),
        "bad timeout": ("200", Status.INTERNAL),
        "compressed": ("200", Status.UNIMPLEMENTED),
        "cut short": ("200", Status.INTERNAL),
        "two messages": ("200", Status.INTERNAL),
        "good": ("200", Status.OK),
    }
    assert calls == [b"fine"]
    assert bytes(answers["good"].body) == _grpc_frame(b"ok")


# --------------------------------------------------------------------------------------------
# 6. Bad peers


BAD_OPENINGS = {
    "http/1.1": (b"GET /test.Echo/Echo HTTP/1.1\r\nHost: localhost\r\n\r\n", H2_PROTOCOL_ERROR),
    "garbage": (
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(64)),
        H2_PROTOCOL_ERROR,
    ),
    "ping first": (PREFACE + _frame(FRAME_PING, 0, 0, b"12345678"), H2_PROTOCOL_ERROR),
    "huge frame": (
        PREFACE + _frame(FRAME_SETTINGS, 0, 0) + (1 << 20).to_bytes(3, "big") + b"\x00" * 6,
        H2_FRAME_SIZE_ERROR,
    ),
}


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(BAD_OPENINGS))
async def test_a_peer_breaking_http2_loses_its_connection_only(
    socket_path: Path, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    opening, error_code = BAD_OPENINGS[name]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        async with open_unix_server([{ECHO: reverse}], socket_path) as server:
            async with await anyio.connect_unix(socket_path) as stream:
                await stream.send(opening)
                received = await _read_to_eof(stream)
            await _eventually(lambda: server.open_connections == 0)
            after = await _call(socket_path, ECHO, b"still serving")

    frames = _frames(received)
    assert frames[0][0] == FRAME_SETTINGS  # the server spoke first, as HTTP/2 wants
    kind, _, stream_id, payload = frames[-1]
    assert (kind, stream_id) == (FRAME_GOAWAY, 0)
    assert struct.unpack(">I", payload[4:8])[0] == error_code
    assert after == b"gnivres llits"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(socket_path) in warnings[0].getMessage()


@pytest.mark.anyio
async def test_a_handler_ending_after_its_peer_broke_http2_ends_quietly(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that raises after its connection broke the protocol (here: shielded, as one
    waiting for a worker thread is) has nobody to answer: its error is dropped, nothing escapes
    the call's task (anyio's test runner fails the test on an unretrieved task exception)."""
    go = anyio.Event()
    started = anyio.Event()
    finished = anyio.Event()

    async def refuse_later(call: Call) -> None:
        try:
            with anyio.CancelScope(shield=True):
                started.set()
                await go.wait()
            raise GrpcError(Status.NOT_FOUND, "too late to tell anyone")
        finally:
            finished.set()

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        async with open_unix_server(
            [{"/test.Echo/Later": refuse_later, ECHO: reverse}], socket_path
        ) as server:
            async with _raw_client(socket_path) as client:
                await client.request("/test.Echo/Later", _grpc_frame(b""))
                await _wait(started)
                await client.stream.send(_frame(FRAME_PING, 0, 1, b"12345678"))  # on a stream
                received = await _read_to_eof(client.stream)
            await _eventually(lambda: server.open_connections == 0)
            go.set()
            await _wait(finished)
            after = await _call(socket_path, ECHO, b"alive")

    assert _frames(received)[-1][0] == FRAME_GOAWAY
    assert after == b"evila"


@pytest.mark.anyio
async def test_a_client_stalling_on_a_big_answer_never_stalls_the_server(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A raw client with huge windows that reads nothing while a 4 MiB answer is sent to it: the
    server keeps it (back pressure, no drop) and it gets the whole answer once it reads; the
    event loop is never blocked: another client is served while this one stalls."""
    size = 4 * MIB
    reply = os.urandom(size)
    replied = anyio.Event()

    async def big(call: Call) -> None:
        call.reply(reply)
        replied.set()

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        async with (
            open_unix_server([{"/test.Echo/Big": big, ECHO: reverse}], socket_path),
            _raw_client(socket_path, huge_windows=True) as client,
        ):
            big_id = await client.request("/test.Echo/Big", _grpc_frame(b""))
            await _wait(replied)
            after = await _call(socket_path, ECHO, b"next")  # while the big one waits
            try:
                answer: _Answer | None = await client.answer(big_id)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                answer = None

    assert after == b"txen"
    assert [r.getMessage() for r in caplog.records] == []
    assert answer is not None  # kept: the whole answer, intact, once the client read it
    assert answer.grpc_status == Status.OK
    assert bytes(answer.body) == _grpc_frame(reply)


@pytest.mark.anyio
async def test_a_client_flooding_pings_without_reading_cannot_grow_the_server(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each PING is answered; a peer that never reads the answers cannot make the server buffer
    them without end: once the answers waiting pass the transport's high-water mark the server
    stops reading from it (back pressure), so its sends block (here: time out) far below
    ``limit`` bytes accepted."""
    # 8 MiB of PINGs accepted would mean the server buffers their answers without end.
    limit = 8 * MIB
    pings = _frame(FRAME_PING, 0, 0, b"pingping") * 4096
    stalled = 1.0  # seconds a blocked send waits before we call it backpressure

    def flood() -> tuple[int, OSError | None]:
        sent = 0
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(stalled)
            sock.connect(str(socket_path))
            sock.sendall(PREFACE + _frame(FRAME_SETTINGS, 0, 0))
            try:
                while sent < limit:
                    sock.sendall(pings)
                    sent += len(pings)
            except OSError as exc:
                return sent, exc
        return sent, None

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        async with open_unix_server([{ECHO: reverse}], socket_path) as server:
            sent, error = await anyio.to_thread.run_sync(flood)
            await _eventually(lambda: server.open_connections == 0)
            after = await _call(socket_path, ECHO, b"next")

    assert sent < limit, sent
    assert after == b"txen"
    assert isinstance(error, TimeoutError), error  # the server stopped reading this peer
    assert [r.getMessage() for r in caplog.records] == []


# --------------------------------------------------------------------------------------------
# 7. Stopping


@pytest.mark.anyio
async def test_stop_with_a_call_in_flight(socket_path: Path) -> None:
    sleeper = Sleeper()
    outcome: list[tuple[Any, str]] = []

    async def client() -> None:
        outcome.append(await _fail(socket_path, SLEEP, b""))

    async with anyio.create_task_group() as task_group:
        async with open_unix_server([{SLEEP: sleeper}], socket_path):
            task_group.start_soon(client)
            await _wait(sleeper.started)
        assert sleeper.cancelled.is_set()  # cancelled and waited for before the block ends
        assert not await anyio.Path(socket_path).exists()

    assert len(outcome) == 1
    # The server sends GOAWAY and closes the connection with the call still open (no status):
    # grpcio ends such a call UNAVAILABLE, as it does for any transport lost mid-call.
    assert outcome[0][0] == grpc.StatusCode.UNAVAILABLE


@pytest.mark.anyio
async def test_stop_waits_for_a_stuck_handler_only_stop_timeout(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that ignores cancellation (shielded, as one waiting on a worker thread is)
    holds the stop up for STOP_TIMEOUT at most; when it ends later, its answer goes nowhere and
    nothing escapes (anyio's test runner fails the test on an unretrieved task exception)."""
    started = anyio.Event()
    go = anyio.Event()
    finished = anyio.Event()
    replied: list[bool] = []

    async def stuck(call: Call) -> None:
        try:
            with anyio.CancelScope(shield=True):
                started.set()
                await go.wait()
                replied.append(call.reply(b"after the stop"))
        finally:
            finished.set()

    outcome: list[tuple[Any, str]] = []

    async def client() -> None:
        outcome.append(await _fail(socket_path, "/test.Echo/Stuck", b""))

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        async with anyio.create_task_group() as task_group:
            async with open_unix_server([{"/test.Echo/Stuck": stuck}], socket_path):
                task_group.start_soon(client)
                await _wait(started)
                stop_began = anyio.current_time()
            stop_took = anyio.current_time() - stop_began
            assert not finished.is_set()
            assert not await anyio.Path(socket_path).exists()
            go.set()
            await _wait(finished)

    assert STOP_TIMEOUT <= stop_took < STOP_TIMEOUT + 2
    assert replied == [False]
    assert [code for code, _ in outcome] == [grpc.StatusCode.UNAVAILABLE]
    assert any("did not end" in r.getMessage() for r in caplog.records)


@pytest.mark.anyio
async def test_stop_closes_idle_connections_with_goaway(socket_path: Path) -> None:
    channel = grpc.insecure_channel(unix_target(socket_path))
    try:
        method = channel.unary_unary(ECHO)
        async with open_unix_server([{ECHO: reverse}], socket_path) as server:
            first = await anyio.to_thread.run_sync(
                functools.partial(method, b"one", timeout=CALL_TIMEOUT)
            )
            bare = await anyio.connect_unix(socket_path)  # an idle raw HTTP/2 peer beside it
            await bare.send(PREFACE + _frame(FRAME_SETTINGS, 0, 0))
            # Until our SETTINGS are acknowledged: the server has read all we sent (a unix
            # socket closed with unread input resets its peer instead of an EOF).
            received = b""
            with anyio.fail_after(CALL_TIMEOUT):
                while (FRAME_SETTINGS, 1) not in {(k, f) for k, f, _, _ in _whole_frames(received)}:
                    received += await bare.receive()
            assert server.open_connections == 2
        async with bare:
            received += await _read_to_eof(bare)
        await _eventually(lambda: server.open_connections == 0)
        code, _ = await anyio.to_thread.run_sync(functools.partial(_next_call_failure, method))
    finally:
        channel.close()

    assert first == b"eno"
    goaways = [f for f in _frames(received) if f[0] == FRAME_GOAWAY]
    assert len(goaways) == 1
    assert struct.unpack(">I", goaways[0][3][4:8])[0] == H2_NO_ERROR
    # grpcio's connection was closed too (a kept one would take the call and time out: the
    # server's tasks are gone), and the socket file is gone: nothing to connect to.
    assert code == grpc.StatusCode.UNAVAILABLE
    assert not await anyio.Path(socket_path).exists()


@pytest.mark.anyio
@pytest.mark.parametrize("turns", range(8))
async def test_a_connection_arriving_during_the_stop_is_closed_too(
    socket_path: Path, turns: int
) -> None:
    """A client connecting just as the server stops: whether the stop comes before the accept,
    between the accept and the protocol's ``connection_made`` or after it (``turns`` event-loop
    turns after the connect sweeps those windows), the peer is never left connected to a server
    that is gone."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
        async with open_unix_server([{ECHO: reverse}], socket_path) as server:
            peer.connect(str(socket_path))  # completes in the kernel's backlog, loop uninvolved
            peer.setblocking(False)
            for _ in range(turns):
                await anyio.lowlevel.checkpoint()
        # The server is gone: the kernel holds whatever it wrote; 2 s is plenty to read that.
        with anyio.fail_after(2):
            while True:
                await anyio.wait_readable(peer)
                try:
                    if not peer.recv(1 << 16):
                        break  # EOF
                except ConnectionResetError:
                    break  # the listening socket closed before the connection was accepted
        await _eventually(lambda: server.open_connections == 0)


def _next_call_failure(method: Any) -> tuple[Any, str]:
    try:
        method(b"two", timeout=CALL_TIMEOUT)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    raise AssertionError("a call succeeded after the server stopped")


@pytest.mark.anyio
async def test_socket_file_is_0600_in_a_created_0700_directory(tmp_path: Path) -> None:
    socket_path = tmp_path / "new" / "dir" / "grpc.sock"
    async with open_unix_server([{ECHO: reverse}], socket_path):
        mode = socket_path.lstat().st_mode
        dir_mode = stat.S_IMODE(socket_path.parent.stat().st_mode)
        parent_mode = stat.S_IMODE(socket_path.parent.parent.stat().st_mode)
        # Only the socket is there: the temporary dot-name it was bound under was renamed.
        names = sorted(p.name for p in socket_path.parent.iterdir())

    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == SOCKET_MODE == 0o600
    assert dir_mode == parent_mode == 0o700
    assert names == ["grpc.sock"]
    assert list(socket_path.parent.iterdir()) == []


@pytest.mark.anyio
async def test_a_stale_socket_is_replaced_and_a_regular_file_refused(socket_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as crashed:
        crashed.bind(str(socket_path))  # a dead instance's socket file: nobody listens
    async with open_unix_server([{ECHO: reverse}], socket_path):
        after = await _call(socket_path, ECHO, b"fresh")
    assert after == b"hserf"

    await anyio.Path(socket_path).write_bytes(b"not a socket")
    with pytest.raises(DracpuError, match="not a socket"):
        async with open_unix_server([{ECHO: reverse}], socket_path):
            raise AssertionError("served over a regular file")

    assert await anyio.Path(socket_path).read_bytes() == b"not a socket"
    assert [p.name for p in socket_path.parent.iterdir()] == [socket_path.name]


@pytest.mark.anyio
async def test_two_services_with_the_same_path_are_refused(socket_path: Path) -> None:
    async def other(call: Call) -> None:
        call.reply(b"other")

    with pytest.raises(DracpuError, match=re.escape(ECHO)):
        async with open_unix_server([{ECHO: reverse}, {ECHO: other}], socket_path):
            raise AssertionError("served with two handlers for one path")

    assert list(socket_path.parent.iterdir()) == []  # no socket, no temporary left behind


# --------------------------------------------------------------------------------------------
# 8. decode_message


def test_decode_message_parses_good_bytes() -> None:
    data = bytes(RegistrationStatus(plugin_registered=True, error="kubelet says no"))
    assert data == b"\x08\x01\x12\x0fkubelet says no"

    message = decode_message(RegistrationStatus, data)

    assert message == RegistrationStatus(plugin_registered=True, error="kubelet says no")


@pytest.mark.parametrize(
    "data",
    [
        b"\x08\xff",  # a varint cut short
        b"\x12\x02\xff\xfe",  # a string that is not UTF-8
        b"\x12\x05ab",  # a string of 5 bytes with 2 present
        b"\x17",  # field 2 with wire type 7, which does not exist
    ],
)
def test_decode_message_refuses_bad_bytes_as_invalid_argument(data: bytes) -> None:
    # Google's protobuf runtime (as grpc-go's in the kubelet) rejects each of these.
    with pytest.raises(DecodeError):
        G_REG.RegistrationStatus.FromString(data)

    with pytest.raises(GrpcError) as caught:
        decode_message(RegistrationStatus, data)

    assert caught.value.status == Status.INVALID_ARGUMENT
    assert "RegistrationStatus" in caught.value.message


@pytest.mark.anyio
async def test_decode_message_error_reaches_the_client(socket_path: Path) -> None:
    async def notify(call: Call) -> None:
        status = decode_message(RegistrationStatus, call.request)
        call.reply(b"registered" if status.plugin_registered else b"not registered")

    path = "/pluginregistration.Registration/NotifyRegistrationStatus"
    async with open_unix_server([{path: notify}], socket_path):
        good = await _call(socket_path, path, bytes(RegistrationStatus(plugin_registered=True)))
        code, details = await _fail(socket_path, path, b"\x08\xff")

    assert good == b"registered"
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "RegistrationStatus" in details
