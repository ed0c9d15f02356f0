"""The HTTP endpoints (dracpu.tasks.http on aiohttp.web) over real TCP connections: asked with
the standard library's ``http.client`` (an HTTP peer that shares no code with aiohttp) and with
raw bytes for what no well-behaved client sends."""

from __future__ import annotations

import http.client
import logging
import platform
import random
import socket
from dataclasses import dataclass
from types import MappingProxyType

import anyio
import anyio.to_thread
import prometheus_client
import pytest
from anyio import BrokenResourceError, EndOfStream
from anyio.abc import TaskGroup
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from dracpu import __version__
from dracpu.config.values import BindAddress
from dracpu.errors import DracpuError
from dracpu.tasks import http as http_task
from dracpu.tasks.http import Readiness
from dracpu.tasks.metrics import build_registry
from dracpu.tasks.state_owner import OwnerStatistics

pytestmark = pytest.mark.anyio


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


async def _get(port: int, path: str, method: str = "GET", host: str = "127.0.0.1") -> Response:
    """One request through ``http.client`` (in a thread: it blocks)."""

    def ask() -> Response:
        connection = http.client.HTTPConnection(host, port, timeout=10)
        try:
            connection.request(method, path)
            answer = connection.getresponse()
            return Response(answer.status, dict(answer.getheaders()), answer.read())
        finally:
            connection.close()

    return await anyio.to_thread.run_sync(ask)


async def _raw(port: int, data: bytes, *, eof: bool = False) -> bytes:
    """Send ``data``, read until the server closes the connection (at most 10 s)."""
    chunks: list[bytes] = []
    with anyio.fail_after(10):
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            if data:
                await stream.send(data)
            if eof:
                await stream.send_eof()
            while True:
                try:
                    chunks.append(await stream.receive())
                except (EndOfStream, BrokenResourceError):
                    return b"".join(chunks)


def _status(raw: bytes) -> int:
    version, status, _ = raw.split(b"\r\n", 1)[0].split(b" ", 2)
    assert version.startswith(b"HTTP/1."), raw
    return int(status)


LOOPBACK = BindAddress("127.0.0.1", 0)


async def _start(
    tg: TaskGroup,
    readiness: Readiness,
    registry: CollectorRegistry | None = None,
    bind: BindAddress = LOOPBACK,
    *,
    started: bool = True,
) -> int:
    """Serve on a free port; ``started``: the supervisor has started every task."""
    if started:
        readiness.set_started()
    registry = build_registry(readiness) if registry is None else registry
    port: int = await tg.start(http_task.run, bind, readiness, registry)
    return port


async def test_healthz_fails_until_every_task_has_started_then_passes_for_good() -> None:
    readiness = Readiness()
    async with anyio.create_task_group() as tg:
        port = await _start(tg, readiness, started=False)
        response = await _get(port, "/healthz")
        assert (response.status, response.body) == (503, b"starting\n")
        readiness.set_started()
        response = await _get(port, "/healthz")
        assert (response.status, response.body) == (200, b"ok\n")
        assert response.headers["Content-Type"] == "text/plain; charset=utf-8"
        assert (await _get(port, "/healthz?verbose=1")).status == 200  # the query is ignored
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
    ("method", "path", "status"),
    [
        ("GET", "/nope", 404),
        ("GET", "/", 404),
        ("GET", "/healthz/", 404),
        ("POST", "/healthz", 405),
        ("DELETE", "/readyz", 405),
        ("PUT", "/metrics", 405),
    ],
)
async def test_other_paths_and_methods(method: str, path: str, status: int) -> None:
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        response = await _get(port, path, method=method)
        assert response.status == status
        if status == 405:
            assert set(response.headers["Allow"].split(",")) == {"GET", "HEAD"}
        tg.cancel_scope.cancel()


async def test_keep_alive_serves_several_requests_on_one_connection() -> None:
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())

        def ask_three_times() -> tuple[list[int], set[int]]:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            statuses, local_ports = [], set()
            for path in ("/healthz", "/readyz", "/metrics"):
                connection.request("GET", path)
                answer = connection.getresponse()
                answer.read()
                statuses.append(answer.status)
                assert connection.sock is not None  # not closed after the answer
                local_ports.add(connection.sock.getsockname()[1])
            connection.close()
            return statuses, local_ports

        statuses, local_ports = await anyio.to_thread.run_sync(ask_three_times)
        assert statuses == [200, 503, 200]
        assert len(local_ports) == 1
        tg.cancel_scope.cancel()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"\x00\xff\xfe garbage\r\n\r\n",
        b"GET\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost x\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"GET healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /healthz HTTP/2\r\nHost: x\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host (RFC 9112 section 3.2)
    ],
)
async def test_a_malformed_request_is_a_bad_request(request_bytes: bytes) -> None:
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        assert _status(await _raw(port, request_bytes)) == 400
        assert (await _get(port, "/healthz")).status == 200
        tg.cancel_scope.cancel()


@pytest.mark.parametrize(
    "head",
    [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * (8192 + 1) + b"\r\n\r\n",
        b"GET /" + b"a" * 8192 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-%d: y\r\n" % i for i in range(http_task.MAX_HEADERS + 1))
        + b"\r\n",
    ],
    ids=["long-field", "long-target", "many-fields"],
)
async def test_an_oversized_request_head_is_refused(head: bytes) -> None:
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        assert _status(await _raw(port, head)) == 400
        assert (await _get(port, "/healthz")).status == 200
        tg.cancel_scope.cancel()


async def test_a_slow_request_head_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_task, "READ_TIMEOUT", 0.2)
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        start = anyio.current_time()
        assert await _raw(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n") == b""
        assert anyio.current_time() - start < 5  # closed by the server, not by _raw's limit
        tg.cancel_scope.cancel()


async def test_a_peer_that_sends_nothing_or_resets_breaks_nothing() -> None:
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        assert await _raw(port, b"", eof=True) == b""
        assert await _raw(port, b"GET /healthz HTTP/1.1\r\n", eof=True) == b""  # incomplete
        raw = socket.create_connection(("127.0.0.1", port))
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        raw.close()  # a reset, not a clean close
        assert (await _get(port, "/healthz")).status == 200
        tg.cancel_scope.cancel()


async def test_a_request_body_we_ignore_does_not_destroy_the_response() -> None:
    # Closing with unread data would send a reset that can discard the answer.
    body = b"x" * (3 * 65536)
    request_bytes = b"POST /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    request_bytes += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        assert _status(await _raw(port, request_bytes)) == 405
        tg.cancel_scope.cancel()


async def test_garbage_never_ends_the_server_nor_fills_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rng = random.Random(20260501)
    samples = [rng.randbytes(rng.randrange(0, 300)) + b"\r\n\r\n" for _ in range(100)]
    samples += [
        b"GET " + rng.randbytes(40) + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        for _ in range(30)
    ]
    caplog.set_level(logging.INFO)
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        for data in samples:
            raw = await _raw(port, data)
            assert not raw or _status(raw) in {200, 400, 404, 405}, data
        assert (await _get(port, "/healthz")).status == 200
        tg.cancel_scope.cancel()
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_peer_fault_is_one_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=f"{http_task.__name__}.peer")
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness())
        await _raw(port, b"GET /healthz HTTP/2\r\n\r\n")
        tg.cancel_scope.cancel()
    [record] = [r for r in caplog.records if r.name == f"{http_task.__name__}.peer"]
    assert record.levelno == logging.DEBUG
    assert record.exc_info is None
    assert record.getMessage().startswith("Error handling request from 127.0.0.1: 400, message")


async def test_an_address_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(DracpuError) as info:
            await http_task.run(BindAddress("127.0.0.1", port), Readiness(), CollectorRegistry())
    assert str(info.value) == (
        f"cannot listen on --bind-address 127.0.0.1:{port}: Address already in use"
    )


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


async def test_every_interface_on_one_port(caplog: pytest.LogCaptureFixture) -> None:
    """``:0``, as Go's ``:8080``: one port, reachable over IPv4 and (where the host has it)
    IPv6; the log line names the port (the node simulator reads it)."""
    caplog.set_level(logging.INFO, logger=http_task.__name__)
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness(), bind=BindAddress("", 0))
        assert (await _get(port, "/healthz")).status == 200
        if _ipv6_loopback():
            assert (await _get(port, "/healthz", host="::1")).status == 200
        tg.cancel_scope.cancel()
    messages = [r.getMessage() for r in caplog.records if r.name == http_task.__name__]
    assert f"serving /healthz, /readyz and /metrics on port {port}" in messages


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
async def test_a_host_and_port(host: str, caplog: pytest.LogCaptureFixture) -> None:
    if host == "::1" and not _ipv6_loopback():
        pytest.skip("this host has no IPv6 loopback address")
    caplog.set_level(logging.INFO, logger=http_task.__name__)
    async with anyio.create_task_group() as tg:
        port = await _start(tg, Readiness(), bind=BindAddress(host, 0))
        address = "::1" if host == "::1" else "127.0.0.1"
        if host == "localhost":  # the first address of the name, whichever family
            address = str(socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM)[0][4][0])
        assert (await _get(port, "/healthz", host=address)).status == 200
        tg.cancel_scope.cancel()
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    messages = [r.getMessage() for r in caplog.records if r.name == http_task.__name__]
    assert f"serving /healthz, /readyz and /metrics on {shown}" in messages


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
    # a ready flag may say what it did beside "ok"
    a.set_ready("system.slice confined to cpus 0-3")
    assert a.detail == "system.slice confined to cpus 0-3"
    assert readiness.report() == "[+]a ok: system.slice confined to cpus 0-3\nreadyz check passed\n"
    a.set_not_ready("cannot confine runtime.slice")
    a.set_ready()
    assert readiness.report() == "[+]a ok\nreadyz check passed\n"
