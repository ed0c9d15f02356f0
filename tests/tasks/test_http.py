"""The HTTP endpoints over real TCP connections, byte for byte."""

from __future__ import annotations

import errno
import os
import platform
import random
import socket
from dataclasses import dataclass
from types import MappingProxyType

import anyio
import prometheus_client
import pytest
from anyio import BrokenResourceError, EndOfStream
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskGroup
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from dracpu import __version__
from dracpu.config import BindAddress
from dracpu.errors import DracpuError
from dracpu.tasks import http
from dracpu.tasks.http import Readiness
from dracpu.tasks.metrics import build_registry
from dracpu.tasks.state_owner import OwnerStatistics

pytestmark = pytest.mark.anyio


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


def _parse(raw: bytes) -> Response:
    head, sep, body = raw.partition(b"\r\n\r\n")
    assert sep, raw
    status_line, *header_lines = head.decode("ascii").split("\r\n")
    version, status, _reason = status_line.split(" ", 2)
    assert version == "HTTP/1.1"
    headers = dict(line.split(": ", 1) for line in header_lines)
    assert headers["Connection"] == "close"
    return Response(int(status), headers, body)


async def _read_all(stream: SocketStream) -> bytes:
    chunks: list[bytes] = []
    while True:
        try:
            chunks.append(await stream.receive())
        except (EndOfStream, BrokenResourceError):
            return b"".join(chunks)


async def _raw(port: int, data: bytes, *, eof: bool = False) -> bytes:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        if data:
            await stream.send(data)
        if eof:
            await stream.send_eof()
        return await _read_all(stream)


async def _get(port: int, path: str, method: str = "GET") -> Response:
    raw = await _raw(port, f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    response = _parse(raw)
    if method != "HEAD":
        assert int(response.headers["Content-Length"]) == len(response.body)
    return response


async def _start(
    tg: TaskGroup, readiness: Readiness, registry: CollectorRegistry | None = None
) -> int:
    registry = build_registry(readiness) if registry is None else registry
    port: int = await tg.start(http.run, BindAddress("127.0.0.1", 0), readiness, registry)
    return port


async def test_healthz() -> None:
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        response = await _get(port, "/healthz")
        assert (response.status, response.body) == (200, b"ok\n")
        assert response.headers["Content-Type"] == "text/plain; charset=utf-8"
        tg.cancel_scope.cancel()


async def test_readyz_follows_the_task_flags() -> None:
    readiness = Readiness()
    owner, kubelet = readiness.flag("state-owner"), readiness.flag("kubelet-plugin")
    assert readiness.flag("state-owner") is owner
    async with anyio.create_task_group() as tg:
        port = await _start(tg, readiness)
        response = await _get(port, "/readyz")
        assert (response.status, response.body) == (
            503,
            b"[-]state-owner not ready: not started\n"
            b"[-]kubelet-plugin not ready: not started\n"
            b"readyz check failed\n",
        )
        owner.set_ready()
        assert (await _get(port, "/readyz")).status == 503
        kubelet.set_ready()
        response = await _get(port, "/readyz")
        assert (response.status, response.body) == (
            200,
            b"[+]state-owner ok\n[+]kubelet-plugin ok\nreadyz check passed\n",
        )
        kubelet.set_not_ready("the kubelet refused the registration: bad version")
        response = await _get(port, "/readyz")
        assert response.status == 503
        assert b"[-]kubelet-plugin not ready: the kubelet refused the registration" in response.body
        kubelet.set_ready()
        assert (await _get(port, "/readyz")).status == 200
        readiness.set_stopping()
        response = await _get(port, "/readyz")
        assert response.status == 503
        assert response.body.endswith(b"[-]shutdown: stopping\nreadyz check failed\n")
        assert (await _get(port, "/healthz")).status == 200  # alive while stopping
        tg.cancel_scope.cancel()


async def test_readyz_without_tasks_is_not_ready() -> None:
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        response = await _get(port, "/readyz")
        assert (response.status, response.body) == (503, b"readyz check failed\n")
        tg.cancel_scope.cancel()


async def test_metrics_come_from_our_own_registry() -> None:
    readiness = Readiness()
    readiness.flag("state-owner").set_ready()
    readiness.flag("http")
    stats = OwnerStatistics(
        commands_applied=3,
        commands_failed=1,
        effects_failed=2,
        queue_depth=4,
        by_command=MappingProxyType({("Resync", "ok"): 3, ("PrepareClaim", "failed"): 1}),
    )
    registry = build_registry(readiness, lambda: stats)
    async with anyio.create_task_group() as tg:
        port = await _start(tg, readiness, registry)
        response = await _get(port, "/metrics")
        tg.cancel_scope.cancel()
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = response.body.decode()
    lines = set(text.splitlines())
    python = platform.python_version()
    assert f'dracpu_build_info{{python_version="{python}",version="{__version__}"}} 1.0' in lines
    assert 'dracpu_state_owner_commands_total{command="Resync",outcome="ok"} 3.0' in lines
    assert 'dracpu_state_owner_commands_total{command="PrepareClaim",outcome="failed"} 1.0' in lines
    assert "dracpu_state_owner_effects_failed_total 2.0" in lines
    assert "dracpu_state_owner_queue_depth 4.0" in lines
    assert 'dracpu_task_ready{task="state-owner"} 1.0' in lines
    assert 'dracpu_task_ready{task="http"} 0.0' in lines
    assert "dracpu_ready 0.0" in lines
    families = {f.name: f for f in text_string_to_metric_families(text)}  # parses: valid format
    (rss,) = families["process_resident_memory_bytes"].samples
    assert rss.value > 1_000_000
    assert "python_info" in families
    # Nothing of ours leaks into prometheus_client's process-global registry.
    assert prometheus_client.REGISTRY.get_sample_value("dracpu_ready") is None


async def test_head_answers_the_head_only() -> None:
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        response = await _get(port, "/healthz", method="HEAD")
        assert (response.status, response.body) == (200, b"")
        assert response.headers["Content-Length"] == "3"
        tg.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("request_bytes", "status", "body"),
    [
        (b"GET /healthz?verbose=1 HTTP/1.1\r\n\r\n", 200, b"ok\n"),
        (b"GET /healthz HTTP/1.0\n\n", 200, b"ok\n"),  # bare LF line ends
        (b"GET /nope HTTP/1.1\r\n\r\n", 404, b"not found: try /healthz, /readyz or /metrics\n"),
        (b"GET / HTTP/1.1\r\n\r\n", 404, b"not found: try /healthz, /readyz or /metrics\n"),
        (b"POST /healthz HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 405, None),
        (b"DELETE /readyz HTTP/1.1\r\n\r\n", 405, None),
        (b"\x00\xff\xfe garbage\r\n\r\n", 400, b"malformed request line\n"),
        (b"GET\r\n\r\n", 400, b"malformed request line\n"),
        (b"GET /healthz\r\n\r\n", 400, b"malformed request line\n"),
        (b"GET healthz HTTP/1.1\r\n\r\n", 400, b"malformed request line\n"),
        (b"GET /healthz HTTP/2\r\n\r\n", 400, b"malformed request line\n"),
        (b"GET  /healthz HTTP/1.1\r\n\r\n", 400, b"malformed request line\n"),
        (b"\r\n\r\n", 400, b"malformed request line\n"),
    ],
)
async def test_requests_and_their_status(
    request_bytes: bytes, status: int, body: bytes | None
) -> None:
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        response = _parse(await _raw(port, request_bytes))
        assert response.status == status
        if body is not None:
            assert response.body == body
        if status == 405:
            assert response.headers["Allow"] == "GET, HEAD"
            assert response.body == b"only GET and HEAD are allowed\n"
        tg.cancel_scope.cancel()


async def test_an_incomplete_request_is_a_bad_request() -> None:
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        response = _parse(await _raw(port, b"GET /healthz HTTP/1.1\r\n", eof=True))
        assert (response.status, response.body) == (400, b"incomplete request\n")
        tg.cancel_scope.cancel()


async def test_an_oversized_request_head_is_refused() -> None:
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        # One byte over the limit and no end of head: the server reads it all, then refuses.
        head = b"GET /healthz HTTP/1.1\r\nX-Filler: "
        data = head + b"a" * (http.MAX_REQUEST_BYTES + 1 - len(head))
        response = _parse(await _raw(port, data))
        assert (response.status, response.body) == (431, b"request head over 8192 bytes\n")
        assert (await _get(port, "/healthz")).status == 200
        tg.cancel_scope.cancel()


async def test_a_request_body_we_ignore_does_not_destroy_the_response() -> None:
    # Closing with unread data would send a reset that can discard our answer: the server
    # half-closes and drains instead.
    # More than one read of the server: part of the body is still unread when it answers.
    body = b"x" * (3 * http.MAX_REQUEST_BYTES)
    request_bytes = b"POST /metrics HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(request_bytes)
            await anyio.sleep(0.2)  # a reset would arrive before we read
            response = _parse(await _read_all(stream))
        assert response.status == 405
        tg.cancel_scope.cancel()


async def test_a_slow_request_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "READ_TIMEOUT", 0.2)
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        with anyio.fail_after(5):
            response = _parse(await _raw(port, b"GET /healthz HTTP/1.1\r\n"))
        assert (response.status, response.body) == (408, b"request head not received in time\n")
        tg.cancel_scope.cancel()


async def test_a_peer_that_sends_nothing_gets_nothing_and_breaks_nothing() -> None:
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        assert await _raw(port, b"", eof=True) == b""
        raw = socket.create_connection(("127.0.0.1", port))
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        raw.close()  # a reset, not a clean close
        assert (await _get(port, "/healthz")).status == 200
        tg.cancel_scope.cancel()


async def test_connections_over_the_limit_are_closed_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http, "MAX_CONNECTIONS", 2)
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        idle = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(2)]
        await anyio.wait_all_tasks_blocked()
        with anyio.fail_after(5):
            assert await _raw(port, b"GET /healthz HTTP/1.1\r\n\r\n") == b""
        for stream in idle:
            await stream.aclose()
        with anyio.fail_after(5):
            while True:  # the idle connections are released once the server sees them close
                raw = await _raw(port, b"GET /healthz HTTP/1.1\r\n\r\n")
                if raw:
                    break
                await anyio.sleep(0.01)
        assert _parse(raw).status == 200
        tg.cancel_scope.cancel()


async def test_garbage_never_ends_the_server() -> None:
    rng = random.Random(20260501)
    samples = [rng.randbytes(rng.randrange(0, 300)) + b"\r\n\r\n" for _ in range(150)]
    samples += [b"GET " + rng.randbytes(40) + b" HTTP/1.1\r\n\r\n" for _ in range(50)]
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        for data in samples:
            response = _parse(await _raw(port, data))
            assert response.status in {200, 400, 404, 405}, data
        assert (await _get(port, "/healthz")).status == 200
        tg.cancel_scope.cancel()


class _AbortingListener(SocketListener):
    """A real listener whose first ``accept()`` fails with ECONNABORTED, as the kernel's does
    for a connection reset while it waited in the accept queue (accept(2): such errors are to be
    retried like EAGAIN)."""

    def __init__(self, inner: SocketListener) -> None:
        self._inner = inner
        self.failures = 0

    @property
    def _raw_socket(self) -> socket.socket:
        return self._inner.extra(SocketAttribute.raw_socket)

    async def accept(self) -> SocketStream:
        if not self.failures:
            self.failures += 1
            raise OSError(errno.ECONNABORTED, os.strerror(errno.ECONNABORTED))
        return await self._inner.accept()

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_a_connection_aborted_before_accept_does_not_end_the_server() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    inner = listener.listeners[0]
    assert isinstance(inner, SocketListener)
    aborting = _AbortingListener(inner)
    port = aborting.extra(SocketAttribute.local_port)
    readiness = Readiness()
    server = http._Server(readiness, build_registry(readiness))
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(server.serve_listener, aborting, tg)
        with anyio.fail_after(5):
            response = await _get(port, "/healthz")
        tg.cancel_scope.cancel()
    assert aborting.failures == 1
    assert (response.status, response.body) == (200, b"ok\n")


async def test_an_address_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(DracpuError) as info:
            await http.run(BindAddress("127.0.0.1", port), Readiness(), CollectorRegistry())
    assert str(info.value) == (
        f"cannot listen on --bind-address 127.0.0.1:{port}: Address already in use"
    )


def test_readiness_flags_and_report() -> None:
    readiness = Readiness()
    assert not readiness.is_ready()
    a = readiness.flag("a")
    assert (a.ready, a.reason) == (False, "not started")
    a.set_ready()
    assert readiness.is_ready()
    assert (a.ready, a.reason) == (True, "")
    assert readiness.report() == "[+]a ok\nreadyz check passed\n"
    a.set_not_ready("lost the runtime")
    assert not readiness.is_ready()
    assert readiness.flags() == (a,)
