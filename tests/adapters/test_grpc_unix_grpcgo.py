"""The kubelet sockets' gRPC server (grpclib, ``dracpu.adapters.grpc_unix``) against grpc-go, the
kubelet's own gRPC stack.

The peer is ``tests/peers_go/grpc_client/main.go``: a tiny grpc-go client (raw-bytes codec,
content-type ``application/grpc``; the test services' messages are Google ``BytesValue``
bytes, ``tests.adapters.grpc_handlers``) that dials one insecure ``ClientConn`` either way the
kubelet dials its plugins (a ``unix://`` target, or a bare path with its own unix dialer), reads
batches of calls as JSON lines on stdin and prints one JSON result per call (a call may be
server-streaming, as the kubelet's device-health watch: its replies in order). It is built once
per session from its Go module (``tests/peers_go/grpc_client/go.mod``: grpc-go at the kubelet's
version, from the Go module proxy into the user's module cache) and runs as a subprocess
while our server runs on the test's event loop; successive batches are successive calls on the
one kept connection, as the kubelet's.

Without ``go`` the tests are skipped; with it, a build failure (a module that cannot be
fetched included) fails them. To see the frames
grpc-go sends and receives, run with ``GODEBUG=http2debug=2`` in the environment: the client's
stderr is printed into the test's captured output (``-s`` to see it on success).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import Process, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from h2.config import H2Configuration
from h2.connection import H2Connection

from dracpu.adapters.grpc_unix import Servable, open_grpc_server
from dracpu.core.cpuset import CpuSet
from dracpu.tasks import registration
from dracpu.tasks.device_health import (
    DeviceHealthBoard,
    HealthStreams,
    ResourceHealthV1,
    ResourceHealthV1alpha1,
)
from dracpu.tasks.registration import RegistrationState
from tests.adapters.grpc_handlers import (
    ECHO,
    SLEEP,
    Barrier,
    Sleeper,
    blob,
    reverse,
    serving,
    unblob,
)
from tests.peers import load_pb2, serialize
from tests.tasks.test_kubelet_plugin import (
    NODE,
    FakeClaims,
    claim_object,
    grouped_result,
    node_config,
    running_node,
)
from tests.tasks.test_registration import ADVERTISED

__all__: list[str] = []

pytestmark = pytest.mark.anyio

G_V1 = load_pb2("dra/v1/api.proto")
G_V1BETA1 = load_pb2("dra/v1beta1/api.proto")
G_REG = load_pb2("pluginregistration/v1/api.proto")

# The client's Go module (main.go, go.mod, go.sum).
CLIENT_MODULE = Path(__file__).resolve().parent.parent / "peers_go" / "grpc_client"
# A cold build (modules fetched, grpc-go compiled) took about a minute on 2 shared cores.
BUILD_TIMEOUT = 600.0

# grpc-go's status codes (google.golang.org/grpc/codes), written out so that the numbers are
# checked against ours rather than taken from them.
GO_OK = 0
GO_INVALID_ARGUMENT = 3
GO_DEADLINE_EXCEEDED = 4
GO_NOT_FOUND = 5
GO_RESOURCE_EXHAUSTED = 8
GO_FAILED_PRECONDITION = 9
GO_UNIMPLEMENTED = 12
GO_UNAVAILABLE = 14

# Upper bound of any one wait in these tests, seconds (generous: 2 cores shared by many).
CALL_TIMEOUT = 10.0
MIB = 1 << 20
# How the client dials (main.go): the kubelet's newer DRA client dials a "unix://" target; its
# plugin watcher (the registration socket) and its older DRA client a bare path, own dialer.
DIAL_URL = "unix-url"
DIAL_PATH = "bare-path"
# The longest result line the client prints: a 5 MiB reply in hex and some.
MAX_LINE = 16 * MIB

DRA_V1 = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
DRA_V1BETA1 = "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
# What the kubelet's OpenTelemetry interceptor adds to its calls when tracing is on (the example
# value of the W3C Trace Context recommendation): a header the server must ignore.
TRACE = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
GET_INFO = "/pluginregistration.Registration/GetInfo"
NOTIFY = "/pluginregistration.Registration/NotifyRegistrationStatus"


# --------------------------------------------------------------------------------------------
# The grpc-go client


@pytest.fixture(scope="session")
def grpc_go(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The grpc-go client binary, built once per session (skip without Go)."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("no go command on PATH (Go 1.25 or newer builds the grpc-go peer)")
    binary = tmp_path_factory.mktemp("grpcgo") / "grpc_client"
    env = {
        **os.environ,  # the user's module cache, build cache and proxy
        "GOFLAGS": "-mod=readonly",  # go.sum pins every module: nothing is resolved anew
        "GOTOOLCHAIN": "local",  # the go on PATH, never a toolchain download
        "CGO_ENABLED": "0",  # no C compiler needed
    }
    start = time.monotonic()
    built = subprocess.run(
        [go, "build", "-o", str(binary), "."],
        env=env,
        cwd=CLIENT_MODULE,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    if built.returncode != 0:
        pytest.fail(f"go build of {CLIENT_MODULE} failed ({built.returncode}):\n{built.stderr}")
    print(f"built {binary} in {time.monotonic() - start:.1f} s")
    return binary


@dataclass(frozen=True, slots=True)
class GoResult:
    """One invocation as grpc-go saw it."""

    call: int
    copy: int
    reply: bytes
    code: int
    message: str
    elapsed_ms: float
    replies: tuple[bytes, ...] = ()  # a streaming call's replies, in order
    ended: bool = True  # a streaming call: the server ended it (else the client stopped)


def go_call(
    method: str,
    request: bytes = b"",
    *,
    timeout: float = CALL_TIMEOUT,
    copies: int = 1,
    max_recv: int = 0,
    wait_for_ready: bool = False,
    metadata: Mapping[str, str] | None = None,
    messages: int = 0,
) -> dict[str, Any]:
    """One call for the client (see main.go): ``copies`` concurrent invocations of it;
    ``messages`` > 0: server-streaming, read at most that many replies."""
    return {
        "method": method,
        "request": request.hex(),
        "timeout_ms": round(timeout * 1000),
        "copies": copies,
        "max_recv": max_recv,
        "wait_for_ready": wait_for_ready,
        "metadata": dict(metadata or {}),
        "messages": messages,
    }


class GoClient:
    """A running grpc-go client: one ClientConn, fed one batch of calls at a time."""

    def __init__(self, process: Process) -> None:
        assert process.stdin is not None
        assert process.stdout is not None
        self._stdin = process.stdin
        self._stdout = BufferedByteReceiveStream(process.stdout)

    async def run(self, *calls: dict[str, Any]) -> list[GoResult]:
        """Make the calls, all at once; the results in input order once all have ended."""
        expected = [(i, k) for i, c in enumerate(calls) for k in range(c["copies"])]
        await self._stdin.send(json.dumps(list(calls)).encode() + b"\n")
        results = []
        with anyio.fail_after(CALL_TIMEOUT * 2):
            for _ in expected:
                line = await self._stdout.receive_until(b"\n", MAX_LINE)
                r = json.loads(line)
                results.append(
                    GoResult(
                        call=r["call"],
                        copy=r["copy"],
                        reply=bytes.fromhex(r["reply"]),
                        code=r["code"],
                        message=r["message"],
                        elapsed_ms=r["elapsed_ms"],
                        replies=tuple(bytes.fromhex(h) for h in r.get("replies", ())),
                        ended=r["ended"],
                    )
                )
        assert [(r.call, r.copy) for r in results] == expected
        return results


@asynccontextmanager
async def grpc_go_client(
    binary: Path, socket_path: Path, *, dial: str = DIAL_URL
) -> AsyncIterator[GoClient]:
    """The client dialled to ``socket_path`` (``dial``: :data:`DIAL_URL` or :data:`DIAL_PATH`);
    on exit its stdin ends and it must exit 0. Its stderr (GODEBUG=http2debug=2 frames, or its
    complaint) is printed into the test's output."""
    assert socket_path.is_absolute(), socket_path
    target = f"unix://{socket_path}" if dial == DIAL_URL else str(socket_path)
    with tempfile.TemporaryFile() as stderr:
        try:
            async with await anyio.open_process([str(binary), target], stderr=stderr) as process:
                yield GoClient(process)
                assert process.stdin is not None
                await process.stdin.aclose()
                with anyio.fail_after(CALL_TIMEOUT):
                    code = await process.wait()
        finally:
            stderr.seek(0)
            complaint = stderr.read().decode(errors="replace")
            if complaint:
                print(complaint)
        assert code == 0, f"grpc-go client exited with {code}: {complaint}"


async def run_go(
    binary: Path, socket_path: Path, *batches: Sequence[dict[str, Any]], dial: str = DIAL_URL
) -> list[GoResult]:
    """Each batch through one grpc-go ClientConn, one after another; all results in order."""
    results = []
    async with grpc_go_client(binary, socket_path, dial=dial) as client:
        for batch in batches:
            results += await client.run(*batch)
    return results


def ok(result: GoResult) -> bytes:
    """The reply of a call that must have succeeded."""
    assert (result.code, result.message) == (GO_OK, ""), result
    return result.reply


def service_call(method: str, data: bytes = b"", **kwargs: Any) -> dict[str, Any]:
    """A call of a test service: ``data`` in a ``BytesValue``."""
    return go_call(method, blob(data), **kwargs)


def answer(result: GoResult) -> bytes:
    """The bytes a test service answered, for a call that must have succeeded."""
    return unblob(ok(result))


# --------------------------------------------------------------------------------------------
# Handlers


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "grpc.sock"


# --------------------------------------------------------------------------------------------
# 1. Bytes and paths


async def test_bytes_cross_exactly_and_each_path_reaches_its_method(
    grpc_go: Path, socket_path: Path
) -> None:
    seen: dict[str, bytes] = {}

    def recording(path: str, reply: Callable[[bytes], bytes]) -> Any:
        async def method(request: bytes) -> bytes:
            seen[path] = request
            return reply(request)

        return method

    request = bytes(range(256)) * 40 + b"\x00\xff"  # every byte value, NULs and 0xFF included
    prepare = f"{DRA_V1}/NodePrepareResources"  # a real path: dots, a long package
    methods = {
        ECHO: recording(ECHO, lambda r: r[::-1]),
        prepare: recording(prepare, lambda r: r[::-1]),
        "/test.Echo/Empty": recording("/test.Echo/Empty", lambda r: b""),
    }
    async with serving(methods, socket_path):
        results = await run_go(
            grpc_go,
            socket_path,
            [
                service_call(ECHO, request),
                service_call(prepare, bytes(range(255, -1, -1))),
                service_call("/test.Echo/Empty", b""),
            ],
        )

    assert [answer(r) for r in results] == [request[::-1], bytes(range(256)), b""]
    assert seen == {ECHO: request, prepare: bytes(range(255, -1, -1)), "/test.Echo/Empty": b""}


# --------------------------------------------------------------------------------------------
# 2. Concurrency on one ClientConn


async def test_fifty_concurrent_calls_on_one_client_conn_overlap(
    grpc_go: Path, socket_path: Path
) -> None:
    count = 50
    barrier = Barrier(count)

    requests = [f"call {i:02d}".encode() * (i + 1) for i in range(count)]
    async with serving({ECHO: barrier}, socket_path) as server:
        barrier.server = server
        results = await run_go(grpc_go, socket_path, [service_call(ECHO, r) for r in requests])

    assert [answer(r) for r in results] == [r[::-1] for r in requests]
    assert barrier.peak == count
    assert barrier.connections_when_full == [1]  # one ClientConn, one connection, 50 streams


async def test_calls_beyond_max_concurrent_streams_wait_for_a_free_stream(
    grpc_go: Path, socket_path: Path
) -> None:
    """grpc-go honours the SETTINGS_MAX_CONCURRENT_STREAMS the server announces (h2's default,
    100): of 200 calls the first 100 are held until all 100 are in, no 101st runs beside them,
    and every call is answered."""
    count = 200
    limit = H2Connection(H2Configuration(client_side=False)).local_settings.max_concurrent_streams
    counted = Barrier(limit)

    requests = [i.to_bytes(2, "big") for i in range(count)]
    async with serving({ECHO: counted}, socket_path):
        results = await run_go(grpc_go, socket_path, [service_call(ECHO, r) for r in requests])

    assert [answer(r) for r in results] == [r[::-1] for r in requests]
    assert counted.peak == limit


# --------------------------------------------------------------------------------------------
# 3. Flow control both ways


async def test_a_3_mib_request_and_a_5_mib_reply_cross_whole(
    grpc_go: Path, socket_path: Path
) -> None:
    big_request = os.urandom(3 * MIB)
    big_reply = os.urandom(5 * MIB)  # beyond grpc-go's windows: needs its WINDOW_UPDATEs
    seen: list[bytes] = []

    async def take(request: bytes) -> bytes:
        seen.append(request)
        return len(request).to_bytes(4, "big")

    async def give(request: bytes) -> bytes:
        return big_reply

    methods = {"/test.Big/Take": take, "/test.Big/Give": give, ECHO: reverse}
    async with serving(methods, socket_path):
        took, gave, after = await run_go(
            grpc_go,
            socket_path,
            [
                service_call("/test.Big/Take", big_request),
                # grpc-go refuses to receive more than 4 MiB (its default) unless told.
                service_call("/test.Big/Give", max_recv=8 * MIB),
            ],
            [service_call(ECHO, b"after")],
        )

    assert answer(took) == (3 * MIB).to_bytes(4, "big")
    assert seen == [big_request]
    assert answer(gave) == big_reply
    assert answer(after) == b"retfa"


async def test_a_reply_over_grpc_gos_limit_fails_that_call_only(
    grpc_go: Path, socket_path: Path
) -> None:
    """grpc-go resets the stream of a 5 MiB reply (over its default 4 MiB limit) once it has read
    the message's length: the server drops the rest of that answer and the same connection
    serves the next calls, a 5 MiB reply included."""
    big_reply = os.urandom(5 * MIB)

    async def give(request: bytes) -> bytes:
        return big_reply

    async with (
        serving({"/test.Big/Give": give, ECHO: reverse}, socket_path) as server,
        grpc_go_client(grpc_go, socket_path) as client,
    ):
        [refused] = await client.run(service_call("/test.Big/Give"))
        [after] = await client.run(service_call(ECHO, b"after"))
        [taken] = await client.run(service_call("/test.Big/Give", max_recv=8 * MIB))
        connections = server.open_connections

    assert refused.code == GO_RESOURCE_EXHAUSTED, refused
    assert answer(after) == b"retfa"
    assert answer(taken) == big_reply
    assert connections == 1  # all on the one connection


# --------------------------------------------------------------------------------------------
# 4. Statuses, deadlines, the server going away


async def test_statuses_reach_grpc_go_exactly(grpc_go: Path, socket_path: Path) -> None:
    message = "CPU 3 gehört schon 100% dem Pod «web-0» ☃\nzweite Zeile %41 %"

    async def refuse(request: bytes) -> bytes:
        raise GRPCError(Status.FAILED_PRECONDITION, message)

    async def missing(request: bytes) -> bytes:
        raise GRPCError(Status.NOT_FOUND, f"claim {request.decode()} not found")

    # 33 600 characters, 65 600 bytes once percent-encoded: four times grpc-go's frame size
    # (16 KiB), so the trailers take a HEADERS frame and CONTINUATION frames.
    long_message = "".join(f"claim-{i:04d} «€» 100%; " for i in range(1600))

    async def refuse_long(request: bytes) -> bytes:
        raise GRPCError(Status.FAILED_PRECONDITION, long_message)

    methods = {
        "/test.Echo/Refuse": refuse,
        "/test.Echo/Missing": missing,
        "/test.Echo/Long": refuse_long,
        ECHO: reverse,
    }
    async with serving(methods, socket_path):
        refused, not_found, long, nope, other, garbled, after = await run_go(
            grpc_go,
            socket_path,
            [
                service_call("/test.Echo/Refuse"),
                service_call("/test.Echo/Missing", b"uid-1"),
                service_call("/test.Echo/Long"),
                service_call("/test.Echo/Nope"),
                service_call("/test.Other/Echo"),
                go_call(ECHO, b"\x0a\xff"),  # not a BytesValue: a length cut short
            ],
            [service_call(ECHO, b"still here")],
        )

    assert (refused.code, refused.message) == (GO_FAILED_PRECONDITION, message)
    assert (long.code, long.message) == (GO_FAILED_PRECONDITION, long_message)
    assert (not_found.code, not_found.message) == (GO_NOT_FOUND, "claim uid-1 not found")
    assert (nope.code, nope.message) == (GO_UNIMPLEMENTED, "unknown method /test.Echo/Nope")
    assert other.code == GO_UNIMPLEMENTED
    assert garbled.code == GO_INVALID_ARGUMENT
    assert garbled.message.startswith("cannot decode Blob: "), garbled
    assert answer(after) == b"ereh llits"


async def test_grpc_go_deadline_is_deadline_exceeded_and_cancels_the_handler(
    grpc_go: Path, socket_path: Path
) -> None:
    sleeper = Sleeper()
    async with serving({SLEEP: sleeper, ECHO: reverse}, socket_path):
        timed_out, after = await run_go(
            grpc_go, socket_path, [service_call(SLEEP, timeout=0.2)], [service_call(ECHO, b"next")]
        )
        cancelled = sleeper.cancelled.is_set()

    assert timed_out.code == GO_DEADLINE_EXCEEDED, timed_out
    assert 200 <= timed_out.elapsed_ms < 5000
    assert sleeper.calls == 1
    assert cancelled  # before the next call was answered
    assert answer(after) == b"txen"  # the same connection serves on


async def test_a_stop_fails_the_call_in_flight_and_grpc_go_redials_the_new_server(
    grpc_go: Path, socket_path: Path
) -> None:
    """The plugin restarting under a kubelet that keeps its ClientConn: the call in flight when
    the server stops fails UNAVAILABLE (its handler cancelled), and once a new server listens
    at the same path the same ClientConn dials it again by itself (a call waiting for it is
    answered by the new server)."""
    sleeper = Sleeper()

    async def second(request: bytes) -> bytes:
        return b"second " + request

    async with grpc_go_client(grpc_go, socket_path) as client:
        async with anyio.create_task_group() as tg:
            in_flight: list[GoResult] = []

            async def sleep_call() -> None:
                # wait_for_ready: the ClientConn may have dialled (and be backing off) before
                # this first server listened; the call must reach it, not fail fast.
                in_flight.extend(await client.run(service_call(SLEEP, wait_for_ready=True)))

            async with serving({SLEEP: sleeper}, socket_path):
                tg.start_soon(sleep_call)
                with anyio.fail_after(CALL_TIMEOUT):
                    await sleeper.started.wait()
            cancelled = sleeper.cancelled.is_set()
        async with serving({ECHO: second}, socket_path):
            [again] = await client.run(service_call(ECHO, b"server", wait_for_ready=True))

    [stopped] = in_flight
    assert stopped.code == GO_UNAVAILABLE, stopped
    assert cancelled
    assert answer(again) == b"second server"


# --------------------------------------------------------------------------------------------
# 5. The real sockets: DRA and registration


@pytest.mark.parametrize("dial", [DIAL_URL, DIAL_PATH])
@pytest.mark.parametrize(
    ("service", "pb"), [(DRA_V1, G_V1), (DRA_V1BETA1, G_V1BETA1)], ids=["v1", "v1beta1"]
)
async def test_dra_prepare_and_unprepare_through_grpc_go(
    grpc_go: Path, tmp_path: Path, service: str, pb: Any, dial: str
) -> None:
    """The kubelet plugin's socket (real state owner, CDI specs, checkpoint) driven through one
    grpc-go connection, dialled either way the kubelet does: Prepare, then Unprepare of the same
    claim."""
    claims = FakeClaims()
    obj = claim_object("pod-cpus", [grouped_result("cpudevnuma001", "4")])
    claims.add(obj)
    meta = obj["metadata"]
    uid = meta["uid"]
    claim = pb.Claim(namespace=meta["namespace"], uid=uid, name=meta["name"])
    prepare = serialize(pb.NodePrepareResourcesRequest(claims=[claim]))
    unprepare = serialize(pb.NodeUnprepareResourcesRequest(claims=[claim]))

    async with (
        running_node(tmp_path, claims) as node,
        grpc_go_client(grpc_go, node.socket, dial=dial) as client,
    ):
        [prepared] = await client.run(
            go_call(f"{service}/NodePrepareResources", prepare, metadata=TRACE)
        )
        env = node.spec_env(uid)
        checkpointed = node.checkpointed()
        [unprepared] = await client.run(
            go_call(f"{service}/NodeUnprepareResources", unprepare, metadata=TRACE)
        )
        env_after = node.spec_env(uid)
        checkpointed_after = node.checkpointed()
        numa_cpus = node.numa_cpus("cpudevnuma001")

    reply = pb.NodePrepareResourcesResponse.FromString(ok(prepared))
    assert list(reply.claims) == [uid]
    entry = reply.claims[uid]
    assert entry.error == ""
    assert [
        (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids))
        for d in entry.devices
    ] == [
        (
            ["cpu"],
            NODE,
            "cpudevnuma001",
            [f"dra.k8s.io/cpu=claim-{uid}", f"dra.cpu/metadata={uid}_cpu"],
        )
    ]
    assert env is not None
    [variable] = env
    name, _, cpus = variable.partition("=")
    assert name == f"DRA_CPUSET_{uid}"
    assert list(checkpointed) == [uid]
    assert str(checkpointed[uid]) == cpus
    assert len(checkpointed[uid]) == 4
    assert checkpointed[uid] <= numa_cpus

    unreply = pb.NodeUnprepareResourcesResponse.FromString(ok(unprepared))
    assert list(unreply.claims) == [uid]
    assert unreply.claims[uid].error == ""
    assert env_after is None
    assert checkpointed_after == {}


@asynccontextmanager
async def _registration(tmp_path: Path) -> AsyncIterator[tuple[Path, Path, RegistrationState]]:
    reg_socket = tmp_path / "kubelet" / "plugins_registry" / "dra.cpu-reg.sock"
    endpoint = tmp_path / "kubelet" / "plugins" / "dra.cpu" / "dra.sock"
    async with anyio.create_task_group() as tg:
        state = await tg.start(partial(registration.run, reg_socket, endpoint))
        yield reg_socket, endpoint, state
        tg.cancel_scope.cancel()


async def test_registration_get_info_and_notify_through_grpc_go(
    grpc_go: Path, tmp_path: Path
) -> None:
    error = f"plugin {uuid.uuid4()} refused: 100% wrong «endpoint»"
    notify = serialize(G_REG.RegistrationStatus(plugin_registered=False, error=error))
    async with _registration(tmp_path) as (reg_socket, endpoint, state):
        *got_info, notified = await run_go(
            grpc_go,
            reg_socket,
            # 10 at once, each with the kubelet's 1 s deadline
            [go_call(GET_INFO, serialize(G_REG.InfoRequest()), timeout=1.0, copies=10)],
            [go_call(NOTIFY, notify)],
            dial=DIAL_PATH,  # as the kubelet's plugin watcher dials
        )
        registered, reported = state.registered, state.error

    assert len(got_info) == 10
    for answer in got_info:
        info = G_REG.PluginInfo.FromString(ok(answer))
        assert info == G_REG.PluginInfo(
            type="DRAPlugin",
            name="dra.cpu",
            endpoint=str(endpoint),
            supported_versions=list(ADVERTISED),
        )
    assert G_REG.RegistrationStatusResponse.FromString(ok(notified)) == (
        G_REG.RegistrationStatusResponse()
    )
    assert (registered, reported) == (False, error)


# --------------------------------------------------------------------------------------------
# 9. Device health: a server-streaming call, as the kubelet watches it

HEALTH_VERSIONS = ("v1", "v1alpha1")
HEALTH = {v: f"/{v}.DRAResourceHealth/NodeWatchResources" for v in HEALTH_VERSIONS}
G_HEALTH = {v: load_pb2(f"dra_health/{v}/api.proto") for v in HEALTH_VERSIONS}


def _health_board() -> DeviceHealthBoard:
    """The DRA tests' node (4 NUMA groups of 16 CPUs, cpus 0-63) with cpu 5 offline."""
    board = DeviceHealthBoard(lambda: 1_760_000_000.0)
    devices = list(node_config().devices.values())
    board.set_devices(devices)
    board.set_online(CpuSet.union(d.cpus for d in devices) - CpuSet([5]))
    return board


@asynccontextmanager
async def serving_health(path: Path, streams: HealthStreams) -> AsyncIterator[None]:
    services: list[Servable] = [ResourceHealthV1(streams), ResourceHealthV1alpha1(streams)]
    async with open_grpc_server(services, path), streams.ending():
        yield


@pytest.mark.parametrize("version", HEALTH_VERSIONS)
async def test_device_health_streams_to_grpc_go(
    grpc_go: Path, socket_path: Path, version: str
) -> None:
    pb = G_HEALTH[version]
    streams = HealthStreams(_health_board(), NODE, resend_interval=0.2)
    async with serving_health(socket_path, streams):
        [result] = await run_go(
            grpc_go,
            socket_path,
            [go_call(HEALTH[version], serialize(pb.NodeWatchResourcesRequest()), messages=3)],
        )
    assert (result.code, result.message, result.ended) == (GO_OK, "", False)
    lists = [pb.NodeWatchResourcesResponse.FromString(reply) for reply in result.replies]
    assert len(lists) == 3
    assert lists[1] == lists[0] == lists[2]  # the first list, then resent unchanged
    assert [
        (d.device.pool_name, d.device.device_name, pb.HealthStatus.Name(d.health), d.message)
        for d in lists[0].devices
    ] == [
        (NODE, "cpudevnuma000", "UNHEALTHY", "cpu 5 is offline"),
        (NODE, "cpudevnuma001", "HEALTHY", ""),
        (NODE, "cpudevnuma002", "HEALTHY", ""),
        (NODE, "cpudevnuma003", "HEALTHY", ""),
    ]
    assert {(d.last_updated_time, d.health_check_timeout_seconds) for d in lists[0].devices} == {
        (1_760_000_000, 30)
    }


async def test_a_stop_ends_grpc_go_s_health_stream_with_ok(
    grpc_go: Path, socket_path: Path
) -> None:
    streams = HealthStreams(_health_board(), NODE)
    server = anyio.CancelScope()
    results: list[GoResult] = []

    async def serve(*, task_status: TaskStatus[None]) -> None:
        with server:
            async with serving_health(socket_path, streams):
                task_status.started()
                await anyio.sleep_forever()

    async def watch() -> None:
        request = serialize(G_HEALTH["v1"].NodeWatchResourcesRequest())
        results.extend(
            await run_go(grpc_go, socket_path, [go_call(HEALTH["v1"], request, messages=100)])
        )

    async with anyio.create_task_group() as tg:
        await tg.start(serve)
        tg.start_soon(watch)
        with anyio.fail_after(CALL_TIMEOUT):
            while streams.open_streams == 0:  # noqa: ASYNC110 (the server's count, no event)
                await anyio.sleep(0.01)
        server.cancel()  # the daemon stops the DRA socket
    [result] = results
    assert (result.code, result.message, result.ended) == (GO_OK, "", True)
    assert len(result.replies) == 1  # the first list; no resend within the test
