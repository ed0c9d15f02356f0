"""The kubelet sockets' gRPC server (``dracpu.adapters.grpc_unix``: grpclib on a unix socket).

The kubelet's role is played by grpcio (C-core: its own HTTP/2, HPACK, flow control and status
handling, no code shared with grpclib's python-hyper ``h2``); where a test needs what grpcio will
not do (send a ``grpc-timeout`` and then keep quiet, break the protocol) the peer is python-hyper
``h2`` as a client, or a bare unix socket. The services are test services over one ``bytes``
message (``tests.adapters.grpc_handlers``), so what is checked is the adapter: bytes in and out,
statuses, deadlines, cancellation, the server's life on its socket and its stop.
"""

from __future__ import annotations

import functools
import gc
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
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, ResponseReceived, StreamEnded, TrailersReceived
from h2.events import StreamReset as H2StreamReset
from h2.settings import SettingCodes

from dracpu.adapters.grpc_unix import (
    CLOSED_STREAMS_KEPT,
    STOP_TIMEOUT,
    Encoded,
    MessageCodec,
    open_grpc_server,
    with_stream_handlers,
)
from dracpu.adapters.socket_files import SOCKET_MODE
from dracpu.errors import DracpuError
from tests.adapters.grpc_handlers import (
    ECHO,
    SLEEP,
    Barrier,
    Blob,
    Sleeper,
    Stubborn,
    TestService,
    blob,
    reverse,
    serving,
    unblob,
)
from tests.peers import unix_target

__all__: list[str] = []

pytestmark = pytest.mark.anyio

# Upper bound of any one wait in these tests, seconds (generous: 2 cores shared by many).
CALL_TIMEOUT = 10.0
MIB = 1 << 20
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # RFC 9113 §3.4
FRAME_SETTINGS, FRAME_PING = 0x4, 0x6  # RFC 9113 §6.5, §6.7
MAX_WINDOW = 2**31 - 1  # RFC 9113 §6.9.1


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    head = len(payload).to_bytes(3, "big") + bytes((kind, flags)) + struct.pack(">I", stream_id)
    return head + payload


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "grpc.sock"


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
        reply: bytes = channel.unary_unary(method)(blob(request), timeout=timeout)
        return unblob(reply)


def _failure(
    socket_path: Path, method: str, request: bytes, *, timeout: float = CALL_TIMEOUT
) -> tuple[Any, str]:
    """(grpc.StatusCode, details) of a call that must fail; ``request`` goes out as it is."""
    with grpc.insecure_channel(unix_target(socket_path)) as channel:
        try:
            reply = channel.unary_unary(method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    raise AssertionError(f"{method} succeeded with {reply!r}")


async def _call(socket_path: Path, method: str, request: bytes, **kwargs: Any) -> bytes:
    return await anyio.to_thread.run_sync(
        functools.partial(_unary, socket_path, method, request, **kwargs)
    )


async def _fail(socket_path: Path, method: str, request: bytes) -> tuple[Any, str]:
    return await anyio.to_thread.run_sync(_failure, socket_path, method, blob(request))


async def _eventually(condition: Callable[[], bool]) -> None:
    """Let the event loop run until ``condition`` holds (bounded by CALL_TIMEOUT)."""
    with anyio.fail_after(CALL_TIMEOUT):
        # The server's connection count has no event to wait on; poll it.
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.001)


async def _wait(event: anyio.Event) -> None:
    with anyio.fail_after(CALL_TIMEOUT):
        await event.wait()


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


def _grpc_frame(message: bytes, *, compressed: bool = False) -> bytes:
    """A gRPC length-prefixed message (grpc doc/PROTOCOL-HTTP2.md)."""
    return bytes((int(compressed),)) + len(message).to_bytes(4, "big") + message


class _RawClient:
    """An HTTP/2 client that does exactly what a test tells it to."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.h2 = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        self.answers: dict[int, _Answer] = {}

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
        end: bool = True,
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
        self.h2.send_headers(stream_id, head, end_stream=body is None and end)
        if body is not None:
            self.h2.send_data(stream_id, body, end_stream=end)
        self.answers[stream_id] = _Answer()
        await self.flush()
        return stream_id

    async def receive(self) -> None:
        for event in self.h2.receive_data(await self.stream.receive()):
            if isinstance(event, ResponseReceived):
                self.answers[event.stream_id].headers.update(
                    (_text(k), _text(v)) for k, v in event.headers
                )
            elif isinstance(event, DataReceived):
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
        await self.flush()

    async def answer(self, stream_id: int) -> _Answer:
        answer = self.answers[stream_id]
        with anyio.fail_after(CALL_TIMEOUT):
            while not answer.ended and answer.reset is None:
                await self.receive()
        return answer


@asynccontextmanager
async def _raw_client(
    socket_path: Path, *, huge_windows: bool = False
) -> AsyncIterator[_RawClient]:
    async with await anyio.connect_unix(socket_path) as stream:
        client = _RawClient(stream)
        client.h2.initiate_connection()
        if huge_windows:  # the server may send all it has at once (RFC 9113 §6.9)
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
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return bytes(received)


# --------------------------------------------------------------------------------------------
# 1. Unary calls


async def test_request_and_reply_bytes_cross_exactly(socket_path: Path) -> None:
    seen: list[bytes] = []

    async def record(request: bytes) -> bytes:
        seen.append(request)
        return request[::-1]

    request = bytes(range(256)) * 40 + b"\x00\xff"  # every byte value, NULs and 0xFF included
    async with serving({ECHO: record}, socket_path):
        reply = await _call(socket_path, ECHO, request)
        empty = await _call(socket_path, ECHO, b"")

    assert seen == [request, b""]
    assert reply == request[::-1]
    assert empty == b""


async def test_fifty_concurrent_calls_on_one_channel_overlap(socket_path: Path) -> None:
    count = 50
    barrier = Barrier(count)
    requests = [f"call {i:02d}".encode() * (i + 1) for i in range(count)]

    def client() -> list[bytes]:
        with grpc.insecure_channel(unix_target(socket_path)) as channel:
            method = channel.unary_unary(ECHO)
            futures = [method.future(blob(r), timeout=CALL_TIMEOUT) for r in requests]
            return [unblob(future.result()) for future in futures]

    async with serving({ECHO: barrier}, socket_path) as server:
        barrier.server = server
        replies = await anyio.to_thread.run_sync(client)

    assert replies == [request[::-1] for request in requests]
    assert barrier.peak == count
    assert barrier.connections_when_full == [1]  # one channel, one connection, 50 streams


async def test_more_calls_than_the_stream_limit_wait_and_all_complete(socket_path: Path) -> None:
    """grpcio honours the SETTINGS_MAX_CONCURRENT_STREAMS the server announces (h2's default,
    100) and queues the rest: the first 100 calls are held until all 100 are in, no 101st runs
    beside them, and every call is answered."""
    count = 250
    limit = H2Connection(H2Configuration(client_side=False)).local_settings.max_concurrent_streams
    counted = Barrier(limit)
    requests = [i.to_bytes(2, "big") for i in range(count)]

    def client() -> list[bytes]:
        with grpc.insecure_channel(unix_target(socket_path)) as channel:
            method = channel.unary_unary(ECHO)
            futures = [method.future(blob(r), timeout=CALL_TIMEOUT) for r in requests]
            return [unblob(future.result()) for future in futures]

    async with serving({ECHO: counted}, socket_path):
        replies = await anyio.to_thread.run_sync(client)

    assert replies == [request[::-1] for request in requests]
    assert counted.peak == limit


async def test_a_long_lived_connection_remembers_only_its_last_closed_streams(
    socket_path: Path,
) -> None:
    """h2 keeps how each closed stream ended (to answer late frames); on the kubelet's one
    connection that record must not grow with every call for the life of the plugin."""
    calls = CLOSED_STREAMS_KEPT + 300

    def many_calls(channel: grpc.Channel) -> None:
        method = channel.unary_unary(ECHO)
        for start in range(0, calls, 100):
            futures = [
                method.future(blob(b"x"), timeout=CALL_TIMEOUT)
                for _ in range(start, min(calls, start + 100))
            ]
            assert [unblob(f.result()) for f in futures] == [b"x"] * len(futures)

    async with serving({ECHO: reverse}, socket_path) as server:
        with grpc.insecure_channel(unix_target(socket_path)) as channel:
            await anyio.to_thread.run_sync(many_calls, channel)
            assert server.open_connections == 1
            kept = [
                len(connection._closed_streams)
                for connection in gc.get_objects()
                if isinstance(connection, H2Connection) and not connection.config.client_side
            ]
    assert max(kept) == CLOSED_STREAMS_KEPT


async def test_a_3_mib_request_and_a_5_mib_reply_cross_whole(socket_path: Path) -> None:
    big_request = os.urandom(3 * MIB)
    big_reply = os.urandom(5 * MIB)  # more than grpcio's windows take at once
    seen: list[bytes] = []

    async def take(request: bytes) -> bytes:
        seen.append(request)
        return len(request).to_bytes(4, "big")

    async def give(request: bytes) -> bytes:
        return big_reply

    # grpcio refuses to receive more than 4 MiB (its default) unless told.
    options = [("grpc.max_receive_message_length", 8 * MIB)]
    async with serving({"/test.Big/Take": take, "/test.Big/Give": give}, socket_path):
        took = await _call(socket_path, "/test.Big/Take", big_request)
        gave = await _call(socket_path, "/test.Big/Give", b"", options=options)

    assert seen == [big_request]
    assert took == (3 * MIB).to_bytes(4, "big")
    assert gave == big_reply


# --------------------------------------------------------------------------------------------
# 2. Statuses and bad requests


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
    async def refuse(request: bytes) -> bytes:
        raise GRPCError(status, f"claim {request.decode()} refused")

    async with serving({ECHO: refuse}, socket_path):
        got = await _fail(socket_path, ECHO, b"uid-1")

    assert got == (code, "claim uid-1 refused")


async def test_status_message_with_non_ascii_and_percent_survives(socket_path: Path) -> None:
    message = "CPU 3 gehört schon 100% dem Pod «web-0» ☃\nzweite Zeile %41 %"

    async def refuse(request: bytes) -> bytes:
        raise GRPCError(Status.FAILED_PRECONDITION, message)

    async with serving({ECHO: refuse}, socket_path):
        got = await _fail(socket_path, ECHO, b"")

    assert got == (grpc.StatusCode.FAILED_PRECONDITION, message)


async def test_unexpected_exception_is_unknown_logged_and_the_server_keeps_serving(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(request: bytes) -> bytes:
        raise ValueError("a bug in the handler")

    with caplog.at_level(logging.ERROR):
        async with serving({"/test.Echo/Broken": broken, ECHO: reverse}, socket_path):
            code, details = await _fail(socket_path, "/test.Echo/Broken", b"x")
            after = await _call(socket_path, ECHO, b"still here")

    assert code == grpc.StatusCode.UNKNOWN
    assert "a bug in the handler" not in details  # internals stay in our log
    assert after == b"ereh llits"
    failures = [r for r in caplog.records if r.exc_info and r.exc_info[0] is ValueError]
    assert len(failures) == 1


async def test_unknown_method_is_unimplemented_as_a_grpc_answer(socket_path: Path) -> None:
    """With a gRPC content-type: grpc-go (the kubelet) reads an answer without one as UNKNOWN
    "missing content-type field", whatever its grpc-status says."""
    async with serving({ECHO: reverse}, socket_path):
        code, details = await _fail(socket_path, "/test.Echo/Nope", b"x")
        other_service = await _fail(socket_path, "/test.Other/Echo", b"x")
        async with _raw_client(socket_path) as client:
            raw = await client.answer(await client.request("/test.Echo/Nope", _grpc_frame(b"")))
        after = await _call(socket_path, ECHO, b"ok")

    assert (code, details) == (grpc.StatusCode.UNIMPLEMENTED, "unknown method /test.Echo/Nope")
    assert other_service[0] == grpc.StatusCode.UNIMPLEMENTED
    assert raw.headers[":status"] == "200"
    assert raw.headers["content-type"].startswith("application/grpc")
    assert raw.grpc_status == Status.UNIMPLEMENTED.value
    assert after == b"ko"


async def test_an_undecodable_request_is_invalid_argument_naming_the_type(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[bytes] = []

    async def record(request: bytes) -> bytes:
        ran.append(request)
        return request

    async with serving({ECHO: record}, socket_path):
        cut = await anyio.to_thread.run_sync(_failure, socket_path, ECHO, b"\x0a\xff")
        after = await _call(socket_path, ECHO, b"fine")

    assert cut[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert cut[1].startswith("cannot decode Blob: "), cut[1]
    assert ran == [b"fine"]
    assert after == b"fine"
    assert [r.levelname for r in caplog.records if "cannot decode Blob" in r.getMessage()] == [
        "WARNING"
    ]


async def test_a_call_without_a_request_message_is_invalid_argument(socket_path: Path) -> None:
    def no_message() -> tuple[Any, str]:
        with grpc.insecure_channel(unix_target(socket_path)) as channel:
            try:
                channel.stream_unary(ECHO)(iter(()), timeout=CALL_TIMEOUT)
            except grpc.RpcError as exc:
                return exc.code(), exc.details()
        raise AssertionError("answered without a request")

    async with serving({ECHO: reverse}, socket_path):
        got = await anyio.to_thread.run_sync(no_message)

    assert got == (grpc.StatusCode.INVALID_ARGUMENT, "the call carries no request message")


async def test_malformed_grpc_requests_get_error_statuses_on_a_live_connection(
    socket_path: Path,
) -> None:
    """What grpclib answers to requests that are HTTP/2 but not valid gRPC; the connection
    serves on."""
    calls: list[bytes] = []

    async def record(request: bytes) -> bytes:
        calls.append(request)
        return b"ok"

    async with (
        serving({ECHO: record}, socket_path),
        _raw_client(socket_path) as client,
    ):
        cases = {
            "GET": await client.request(ECHO, _grpc_frame(blob(b"")), method="GET"),
            "text/plain": await client.request(ECHO, b"hello", content_type="text/plain"),
            "bad timeout": await client.request(
                ECHO, _grpc_frame(blob(b"")), headers=[("grpc-timeout", "1x")]
            ),
            "good": await client.request(ECHO, _grpc_frame(blob(b"fine"))),
        }
        answers = {name: await client.answer(sid) for name, sid in cases.items()}

    got = {name: a.headers[":status"] for name, a in answers.items()}
    assert got == {"GET": "405", "text/plain": "415", "bad timeout": "200", "good": "200"}
    assert answers["bad timeout"].grpc_status == Status.UNKNOWN.value
    assert answers["good"].grpc_status == Status.OK.value
    assert calls == [b"fine"]
    assert bytes(answers["good"].body) == _grpc_frame(blob(b"ok"))


BAD_OPENINGS = {
    "http/1.1": b"GET /test.Echo/Echo HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "garbage": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(64)),
    "huge frame": PREFACE + _frame(FRAME_SETTINGS, 0, 0) + (1 << 20).to_bytes(3, "big") + bytes(6),
}


@pytest.mark.parametrize("name", list(BAD_OPENINGS))
async def test_a_peer_breaking_http2_loses_its_connection_only(
    socket_path: Path, name: str
) -> None:
    async with serving({ECHO: reverse}, socket_path) as server:
        async with await anyio.connect_unix(socket_path) as stream:
            await stream.send(BAD_OPENINGS[name])
            await _read_to_eof(stream)  # the server closes the connection
        await _eventually(lambda: server.open_connections == 0)
        after = await _call(socket_path, ECHO, b"still serving")

    assert after == b"gnivres llits"


async def test_a_client_stalling_on_a_big_answer_gets_it_whole_once_it_reads(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A raw client with huge windows that reads nothing while a 4 MiB answer is sent to it: the
    server keeps it (back pressure, no drop, no deadlock) and serves another client meanwhile;
    the stalled one gets the whole answer once it reads."""
    reply = os.urandom(4 * MIB)
    answering = anyio.Event()

    async def big(request: bytes) -> bytes:
        answering.set()
        return reply

    with caplog.at_level(logging.WARNING):
        async with (
            serving({"/test.Echo/Big": big, ECHO: reverse}, socket_path),
            _raw_client(socket_path, huge_windows=True) as client,
        ):
            big_id = await client.request("/test.Echo/Big", _grpc_frame(blob(b"")))
            await _wait(answering)
            after = await _call(socket_path, ECHO, b"next")  # while the big one waits
            answer = await client.answer(big_id)

    assert after == b"txen"
    assert answer.grpc_status == Status.OK.value
    assert bytes(answer.body) == _grpc_frame(blob(reply))
    assert [r.getMessage() for r in caplog.records] == []


async def test_a_peer_flooding_pings_without_reading_cannot_grow_the_server(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each PING is answered; a peer that never reads the answers cannot make the server buffer
    them without end: once the answers waiting pass the transport's high-water mark the server
    stops reading from it (back pressure), so its sends block (here: time out) far below
    ``limit`` bytes accepted, and the server serves others meanwhile and after."""
    limit = 8 * MIB  # accepted whole, the server would buffer all their answers
    pings = _frame(FRAME_PING, 0, 0, b"pingping") * 4096
    stalled = 1.0  # seconds a blocked send waits before we call it back pressure

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

    with caplog.at_level(logging.WARNING):
        async with serving({ECHO: reverse}, socket_path) as server:
            sent, error = await anyio.to_thread.run_sync(flood)
            await _eventually(lambda: server.open_connections == 0)
            after = await _call(socket_path, ECHO, b"next")

    assert sent < limit, sent
    assert isinstance(error, TimeoutError), error  # the server stopped reading this peer
    assert after == b"txen"
    assert [r.getMessage() for r in caplog.records] == []


# --------------------------------------------------------------------------------------------
# 3. Deadlines and cancellation


async def test_client_timeout_is_deadline_exceeded_and_cancels_the_handler(
    socket_path: Path,
) -> None:
    sleeper = Sleeper()
    async with serving({SLEEP: sleeper}, socket_path):
        code, _ = await anyio.to_thread.run_sync(
            functools.partial(_failure, socket_path, SLEEP, blob(b""), timeout=0.2)
        )
        await _wait(sleeper.cancelled)

    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert sleeper.calls == 1


async def test_the_server_enforces_grpc_timeout_itself(socket_path: Path) -> None:
    """A client that sends ``grpc-timeout: 100m`` and then waits (no RST_STREAM of its own) gets
    DEADLINE_EXCEEDED from the server, on time; the handler is cancelled. A request whose body
    never ends meets the same deadline (grpclib starts the clock once the head is read)."""
    sleeper = Sleeper()
    ran: list[bytes] = []

    async def record(request: bytes) -> bytes:
        ran.append(request)
        return request

    async with (
        serving({SLEEP: sleeper, ECHO: record}, socket_path),
        _raw_client(socket_path) as client,
    ):
        start = anyio.current_time()
        sleeping = await client.request(
            SLEEP, _grpc_frame(blob(b"")), headers=[("grpc-timeout", "100m")]
        )
        stuck = await client.request(
            ECHO, _grpc_frame(blob(b"half"))[:6], headers=[("grpc-timeout", "100m")], end=False
        )
        answers = [await client.answer(sleeping), await client.answer(stuck)]
        elapsed = anyio.current_time() - start
        await _wait(sleeper.cancelled)
        after = await client.answer(await client.request(ECHO, _grpc_frame(blob(b"next"))))

    assert 0.1 <= elapsed < 5
    for answer in answers:
        assert answer.headers[":status"] == "200"
        assert answer.grpc_status == Status.DEADLINE_EXCEEDED.value
        assert not answer.body
    assert after.grpc_status == Status.OK.value
    assert ran == [b"next"]


async def test_client_cancel_cancels_the_handler_and_the_connection_serves_on(
    socket_path: Path,
) -> None:
    sleeper = Sleeper()
    connections: list[int] = []

    def client() -> tuple[bool, bytes]:
        with grpc.insecure_channel(unix_target(socket_path)) as channel:
            future = channel.unary_unary(SLEEP).future(blob(b""), timeout=CALL_TIMEOUT)
            anyio.from_thread.run(_wait, sleeper.started)
            cancelled = future.cancel()
            # Still on the same open channel: only the stream's RST_STREAM can cancel it.
            anyio.from_thread.run(_wait, sleeper.cancelled)
            connections.append(anyio.from_thread.run_sync(lambda: server.open_connections))
            after = unblob(channel.unary_unary(ECHO)(blob(b"next"), timeout=CALL_TIMEOUT))
            return cancelled, after

    async with serving({SLEEP: sleeper, ECHO: reverse}, socket_path) as server:
        cancelled, after = await anyio.to_thread.run_sync(client)

    assert cancelled
    assert connections == [1]
    assert after == b"txen"


async def test_closing_the_channel_mid_call_cancels_the_handler(socket_path: Path) -> None:
    sleeper = Sleeper()

    def client() -> Any:
        channel = grpc.insecure_channel(unix_target(socket_path))
        future = channel.unary_unary(SLEEP).future(blob(b""), timeout=CALL_TIMEOUT)
        anyio.from_thread.run(_wait, sleeper.started)
        channel.close()
        return future.exception(timeout=CALL_TIMEOUT)

    async with serving({SLEEP: sleeper, ECHO: reverse}, socket_path) as server:
        error = await anyio.to_thread.run_sync(client)
        await _wait(sleeper.cancelled)
        await _eventually(lambda: server.open_connections == 0)
        after = await _call(socket_path, ECHO, b"new connection")

    assert error.code() == grpc.StatusCode.CANCELLED
    assert after == b"noitcennoc wen"


async def test_a_peer_that_just_goes_away_has_its_calls_cancelled(socket_path: Path) -> None:
    sleeper = Sleeper()
    async with serving({SLEEP: sleeper, ECHO: reverse}, socket_path) as server:
        async with _raw_client(socket_path) as client:
            await client.request(SLEEP, _grpc_frame(blob(b"")))
            await _wait(sleeper.started)
            assert server.open_connections == 1
        await _wait(sleeper.cancelled)
        await _eventually(lambda: server.open_connections == 0)
        after = await _call(socket_path, ECHO, b"abc")

    assert after == b"cba"


# --------------------------------------------------------------------------------------------
# 4. Stopping


async def test_stop_with_a_call_in_flight(socket_path: Path) -> None:
    sleeper = Sleeper()
    outcome: list[tuple[Any, str]] = []

    async def client() -> None:
        outcome.append(await _fail(socket_path, SLEEP, b""))

    async with anyio.create_task_group() as task_group:
        async with serving({SLEEP: sleeper}, socket_path):
            task_group.start_soon(client)
            await _wait(sleeper.started)
        assert sleeper.cancelled.is_set()  # cancelled and waited for before the block ends
        assert not await anyio.Path(socket_path).exists()

    # The connection is closed with the call still open: grpcio ends it UNAVAILABLE, as any
    # call whose transport is lost.
    assert [code for code, _ in outcome] == [grpc.StatusCode.UNAVAILABLE]


async def test_stop_waits_for_a_stuck_handler_only_stop_timeout(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that does not end when cancelled holds the stop up for STOP_TIMEOUT at most;
    when it ends later, nothing escapes (anyio's test runner fails the test on an unretrieved
    task exception)."""
    stuck = Stubborn()
    outcome: list[tuple[Any, str]] = []

    async def client() -> None:
        outcome.append(await _fail(socket_path, "/test.Echo/Stuck", b""))

    with caplog.at_level(logging.WARNING):
        async with anyio.create_task_group() as task_group:
            async with serving({"/test.Echo/Stuck": stuck}, socket_path):
                task_group.start_soon(client)
                await _wait(stuck.started)
                stop_began = anyio.current_time()
            stop_took = anyio.current_time() - stop_began
            assert not stuck.finished.is_set()
            assert not await anyio.Path(socket_path).exists()
            stuck.go.set()
            await _wait(stuck.finished)

    assert STOP_TIMEOUT <= stop_took < STOP_TIMEOUT + 2
    assert [code for code, _ in outcome] == [grpc.StatusCode.UNAVAILABLE]
    assert any("did not end within" in r.getMessage() for r in caplog.records)


async def test_stop_closes_idle_connections_and_a_kept_channel_fails_fast(
    socket_path: Path,
) -> None:
    channel = grpc.insecure_channel(unix_target(socket_path))
    try:
        method = channel.unary_unary(ECHO)
        async with serving({ECHO: reverse}, socket_path) as server:
            first = await anyio.to_thread.run_sync(
                functools.partial(method, blob(b"one"), timeout=CALL_TIMEOUT)
            )
            bare = await anyio.connect_unix(socket_path)  # an idle raw HTTP/2 peer beside it
            await bare.send(PREFACE + _frame(FRAME_SETTINGS, 0, 0))
            await _eventually(lambda: server.open_connections == 2)
        async with bare:
            await _read_to_eof(bare)  # closed by the stop
        assert server.open_connections == 0
        code, _ = await anyio.to_thread.run_sync(functools.partial(_next_call_failure, method))
    finally:
        channel.close()

    assert unblob(first) == b"eno"
    # grpcio's connection was closed too (a kept one would take the call and time out), and
    # the socket file is gone: nothing to connect to.
    assert code == grpc.StatusCode.UNAVAILABLE
    assert not await anyio.Path(socket_path).exists()


def _next_call_failure(method: Any) -> tuple[Any, str]:
    try:
        method(blob(b"two"), timeout=CALL_TIMEOUT)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    raise AssertionError("a call succeeded after the server stopped")


@pytest.mark.parametrize("turns", range(8))
async def test_a_connection_arriving_during_the_stop_is_closed_too(
    socket_path: Path, turns: int
) -> None:
    """A client connecting just as the server stops: whether the stop comes before the accept,
    between the accept and the protocol's ``connection_made`` or after it (``turns`` event-loop
    turns after the connect sweep those windows), the peer is never left connected to a server
    that is gone."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
        async with serving({ECHO: reverse}, socket_path) as server:
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
        assert server.open_connections == 0


# --------------------------------------------------------------------------------------------
# 5. The socket and the services


async def test_the_socket_is_0600_and_appears_only_once_served(tmp_path: Path) -> None:
    socket_path = tmp_path / "new" / "dir" / "grpc.sock"
    async with serving({ECHO: reverse}, socket_path):
        mode = socket_path.lstat().st_mode
        names = [p.name for p in socket_path.parent.iterdir()]  # no temporary name left
        reply = await _call(socket_path, ECHO, b"here")

    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == SOCKET_MODE == 0o600
    assert names == ["grpc.sock"]
    assert reply == b"ereh"
    assert list(socket_path.parent.iterdir()) == []


async def test_two_services_with_the_same_path_are_refused(socket_path: Path) -> None:
    async def other(request: bytes) -> bytes:
        return b"other"

    with pytest.raises(DracpuError, match=re.escape(ECHO)):
        async with open_grpc_server(
            [TestService({ECHO: reverse}), TestService({ECHO: other})], socket_path
        ):
            raise AssertionError("served with two handlers for one path")

    assert list(socket_path.parent.iterdir()) == []  # no socket, no temporary left behind


async def test_a_directory_in_the_way_is_refused_before_serving(socket_path: Path) -> None:
    await anyio.Path(socket_path).mkdir()
    with pytest.raises(DracpuError, match=f"{re.escape(str(socket_path))}.* is a directory"):
        async with serving({ECHO: reverse}, socket_path):
            raise AssertionError("served over a directory")

    assert [p.name for p in socket_path.parent.iterdir()] == [socket_path.name]


def test_with_stream_handlers_replaces_by_method_name_and_refuses_unknown_names() -> None:
    async def handler(stream: Any) -> None:
        raise AssertionError("not called")

    generated = TestService({ECHO: reverse, SLEEP: reverse}).__mapping__()
    served = with_stream_handlers(generated, {"Sleep": handler})

    assert served[SLEEP] == generated[SLEEP]._replace(func=handler)
    assert served[ECHO] == generated[ECHO]
    with pytest.raises(DracpuError, match="no rpc method 'Nope'"):
        with_stream_handlers(generated, {"Nope": handler})


def test_an_encoded_answer_is_sent_as_its_bytes_for_its_own_type_only() -> None:
    codec = MessageCodec()
    answer = Blob(data=b"\x00answer\xff")
    encoded = Encoded(Blob, bytes(answer))
    assert codec.encode(encoded, Blob) == codec.encode(answer, Blob) == blob(b"\x00answer\xff")
    with pytest.raises(GRPCError) as refused:
        codec.encode(Encoded(Blob, b"\x0a\x00"), TestService)
    assert refused.value.status is Status.INTERNAL
