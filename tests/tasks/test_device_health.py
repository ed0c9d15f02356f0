"""Device health (KEP-4680) on the DRA socket, watched by a grpcio kubelet in both versions.

The server is the real one (:class:`~dracpu.tasks.device_health.HealthStreams` behind
:func:`~dracpu.adapters.grpc_unix.open_grpc_server`, composed as the DRA task composes it, and
once through :func:`dracpu.tasks.kubelet_plugin.run` itself); the client is the simulator's
grpcio kubelet (:class:`~dracpu.sim.fake_kubelet.HealthWatch`: Google-protobuf messages, the
method paths written out). The seam (:class:`~dracpu.tasks.device_health.DeviceHealthBoard`) is
driven directly: the devices of the 64-CPU ``dual-socket-smt2`` machine grouped by NUMA node,
then CPUs going offline and back. :func:`~dracpu.tasks.device_health.watch_online` reads a
sysfs tree the simulator writes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.lowlevel
import grpc
import pytest
from anyio.abc import TaskStatus

from dracpu._gen.dra_health import v1 as health_v1
from dracpu.adapters.grpc_unix import Servable, StreamClosed, open_grpc_server
from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy, published_devices
from dracpu.core.health import HealthStatus
from dracpu.sim.fake_kubelet import HealthList, HealthVersion, HealthWatch
from dracpu.sim.topologies import FIXTURES, build_topology, write_sysfs
from dracpu.tasks.device_health import (
    DeviceHealthBoard,
    HealthStreams,
    ResourceHealthV1,
    ResourceHealthV1alpha1,
    watch_online,
)
from tests.peers import load_pb2, unix_target
from tests.tasks.test_kubelet_plugin import NODE, running_node

pytestmark = pytest.mark.anyio

VERSIONS: tuple[HealthVersion, ...] = ("v1", "v1alpha1")
PATHS = {version: f"/{version}.DRAResourceHealth/NodeWatchResources" for version in VERSIONS}
PEERS = {version: load_pb2(f"dra_health/{version}/api.proto") for version in VERSIONS}

MACHINE = build_topology(FIXTURES["dual-socket-smt2"])
# NUMA node n holds cpus 8n..8n+7 and their siblings +32 (the fixture's description).
DEVICES = published_devices(
    MACHINE, reserved=EMPTY, mode=CpuDeviceMode.GROUPED, group_by=GroupBy.NUMANODE
)
NAMES = ["cpudevnuma000", "cpudevnuma001", "cpudevnuma002", "cpudevnuma003"]
START = 1_760_000_000  # the board's clock at the first assessment (a Unix second)
# The kubelet's default health timeout (pkg/kubelet/cm/dra/healthinfo.go), written out.
KUBELET_DEFAULT_TIMEOUT = 30
WITHIN = 10.0  # the longest any wait may take here (2 shared cores)


class Clock:
    """A settable Unix clock for the board."""

    def __init__(self) -> None:
        self.now = float(START)

    def __call__(self) -> float:
        return self.now


def _board(clock: Clock) -> DeviceHealthBoard:
    board = DeviceHealthBoard(clock)
    board.set_devices(DEVICES)
    return board


@asynccontextmanager
async def serving(
    path: Path, board: DeviceHealthBoard, *, resend_interval: float = 60.0
) -> AsyncIterator[HealthStreams]:
    """Both versions on ``path``, the streams ended before the server stops (as the DRA task)."""
    streams = HealthStreams(board, NODE, resend_interval=resend_interval)
    services: list[Servable] = [ResourceHealthV1(streams), ResourceHealthV1alpha1(streams)]
    async with open_grpc_server(services, path), streams.ending():
        yield streams


@contextmanager
def watching(path: Path, version: HealthVersion) -> Iterator[HealthWatch]:
    """A grpcio kubelet's NodeWatchResources call in ``version``, on its own channel."""
    with grpc.insecure_channel(unix_target(path)) as channel, HealthWatch(channel, version) as w:
        yield w


async def _next(watch: HealthWatch) -> HealthList:
    health = await watch.anext(WITHIN)
    assert health is not None, "the stream ended"
    return health


async def _until(check: Any) -> None:
    """Poll ``check`` (state another task or thread changes without telling us) until true."""
    with anyio.fail_after(WITHIN):
        while not check():  # noqa: ASYNC110 (polls state that has no event of its own)
            await anyio.sleep(0.01)


# --- the stream ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
async def test_first_list_is_every_device_with_pool_timeout_and_time(
    tmp_path: Path, version: HealthVersion
) -> None:
    path = tmp_path / "dra.sock"
    async with serving(path, _board(Clock())):
        with watching(path, version) as watch:
            first = await _next(watch)
    assert [(d.pool_name, d.device_name) for d in first.devices] == [(NODE, n) for n in NAMES]
    assert {
        (d.health, d.last_updated_time, d.health_check_timeout_seconds, d.message)
        for d in first.devices
    } == {("HEALTHY", START, KUBELET_DEFAULT_TIMEOUT, "")}


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_cpu_going_offline_is_sent_within_a_second_and_back_online_too(
    tmp_path: Path, version: HealthVersion
) -> None:
    clock = Clock()
    board = _board(clock)
    path = tmp_path / "dra.sock"
    async with serving(path, board):  # no resend within the test: every list is a change
        with watching(path, version) as watch:
            await _next(watch)
            clock.now = START + 5
            changed = time.monotonic()
            board.set_online(MACHINE.online - CpuSet([5, 37]))
            broken = await _next(watch)
            assert broken.received - changed < 1.0
            assert broken.unhealthy() == {"cpudevnuma000": "cpus 5,37 are offline"}
            times = {d.device_name: d.last_updated_time for d in broken.devices}
            assert times == {NAMES[0]: START + 5, NAMES[1]: START, NAMES[2]: START, NAMES[3]: START}

            clock.now = START + 9
            board.set_online(MACHINE.online)
            healed = await _next(watch)
            assert healed.health() == dict.fromkeys(NAMES, "HEALTHY")
            assert healed.devices[0].last_updated_time == START + 9
            assert healed.devices[0].message == ""


async def test_both_versions_at_once_see_the_same_lists(tmp_path: Path) -> None:
    board = _board(Clock())
    path = tmp_path / "dra.sock"
    async with serving(path, board) as streams:
        with watching(path, "v1") as v1, watching(path, "v1alpha1") as v1alpha1:
            first = [await _next(v1), await _next(v1alpha1)]
            assert streams.open_streams == 2
            board.set_online(MACHINE.online - CpuSet([63]))
            second = [await _next(v1), await _next(v1alpha1)]
    assert first[0].devices == first[1].devices
    assert second[0].devices == second[1].devices
    assert second[0].unhealthy() == {"cpudevnuma003": "cpu 63 is offline"}


async def test_an_unchanged_list_is_sent_again_every_interval(tmp_path: Path) -> None:
    interval = 0.25
    path = tmp_path / "dra.sock"
    async with serving(path, _board(Clock()), resend_interval=interval):
        started = time.monotonic()
        with watching(path, "v1") as watch:
            lists = [await _next(watch) for _ in range(6)]
    assert all(later.devices == lists[0].devices for later in lists[1:])
    # Resent, not sooner: the server sends after the call started and waits the interval after
    # each send, so by any time t at most (t - started) / interval + 1 lists can have arrived.
    # Counted against the call's start, not between arrivals: a late delivery shortens the gap
    # to the next arrival, which says nothing about the server (the upper bound is WITHIN).
    window = 3 * interval
    arrived = sum(1 for health in lists if health.received - started <= window)
    assert arrived <= 4, [round(health.received - started, 3) for health in lists]


async def test_a_thousand_individual_devices_cross_whole_and_are_resent_as_they_were(
    tmp_path: Path,
) -> None:
    big = build_topology(FIXTURES["big-1024"])
    devices = published_devices(
        big, reserved=EMPTY, mode=CpuDeviceMode.INDIVIDUAL, group_by=GroupBy.NUMANODE
    )
    board = DeviceHealthBoard(Clock())
    board.set_devices(devices)
    board.set_online(big.online - CpuSet([700]))
    path = tmp_path / "dra.sock"
    async with serving(path, board, resend_interval=0.2):
        with watching(path, "v1") as v1, watching(path, "v1alpha1") as v1alpha1:
            lists = [await _next(v1), await _next(v1), await _next(v1alpha1)]
    assert len(lists[0].devices) == 1024
    assert [d.device_name for d in lists[0].devices] == [device.name for device in devices]
    [lost] = [device.name for device in devices if 700 in device.cpus]
    assert lists[0].unhealthy() == {lost: "cpu 700 is offline"}
    assert lists[1].devices == lists[0].devices == lists[2].devices


async def test_setting_the_same_devices_again_sends_nothing(tmp_path: Path) -> None:
    board = _board(Clock())
    path = tmp_path / "dra.sock"
    async with serving(path, board):
        with watching(path, "v1") as watch:
            await _next(watch)
            before = board.snapshot()
            board.set_devices(DEVICES)  # a Resync publishes the same devices again
            board.set_online(MACHINE.online)
            assert board.snapshot() == before
            board.set_online(MACHINE.online - CpuSet([0]))  # a real change comes next, alone
            assert (await _next(watch)).unhealthy() == {"cpudevnuma000": "cpu 0 is offline"}


async def test_stopping_ends_every_stream_with_ok(tmp_path: Path) -> None:
    path = tmp_path / "dra.sock"

    async def serve(*, task_status: TaskStatus[HealthStreams]) -> None:
        async with serving(path, _board(Clock())) as running:
            task_status.started(running)
            await anyio.sleep_forever()

    with contextlib.ExitStack() as calls, anyio.fail_after(WITHIN):
        async with anyio.create_task_group() as tg:
            streams = await tg.start(serve)
            v1 = calls.enter_context(watching(path, "v1"))
            v1alpha1 = calls.enter_context(watching(path, "v1alpha1"))
            await _next(v1)
            await _next(v1alpha1)
            assert streams.open_streams == 2
            tg.cancel_scope.cancel()  # the daemon stops the DRA socket
        # the server has stopped; the kubelet's calls are still open on its side
        assert await v1.anext(WITHIN) is None
        assert await v1alpha1.anext(WITHIN) is None
    assert streams.open_streams == 0
    assert not path.exists()


async def test_the_kubelet_cancelling_its_call_ends_the_handler(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "dra.sock"
    async with serving(path, _board(Clock())) as streams:
        with watching(path, "v1") as watch:
            await _next(watch)
            assert streams.open_streams == 1
        await _until(lambda: streams.open_streams == 0)
        with watching(path, "v1") as again:  # and the next call is served as the first
            assert len((await _next(again)).devices) == 4
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


class _GoneStream:
    """A health call whose kubelet is gone by the first answer, as grpclib's stream is when h2
    has closed the stream before grpclib cancelled the call: sending raises h2's exception
    (:data:`~dracpu.adapters.grpc_unix.StreamClosed`)."""

    def __init__(self) -> None:
        self.sends = 0

    async def recv_message(self) -> health_v1.NodeWatchResourcesRequest:
        return health_v1.NodeWatchResourcesRequest()

    async def send_message(self, message: Any) -> None:
        self.sends += 1
        raise StreamClosed(1)


async def test_a_stream_closed_before_grpclib_noticed_ends_the_handler_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    streams = HealthStreams(_board(Clock()), NODE)
    stream = _GoneStream()
    with anyio.fail_after(WITHIN):
        await streams.watch(cast(Any, stream), health_v1)
    assert stream.sends == 1
    assert streams.open_streams == 0
    assert "a device health stream was closed by the kubelet" in caplog.text
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_call_that_arrives_after_the_stop_began_ends_at_once(tmp_path: Path) -> None:
    board = _board(Clock())
    path = tmp_path / "dra.sock"
    streams = HealthStreams(board, NODE)
    async with open_grpc_server([ResourceHealthV1(streams)], path):
        async with streams.ending():
            pass  # the stop has begun: the streams are ending
        with watching(path, "v1") as watch:
            assert await watch.anext(WITHIN) is None
        assert streams.open_streams == 0


async def test_a_request_that_does_not_decode_is_invalid_argument(tmp_path: Path) -> None:
    path = tmp_path / "dra.sock"
    async with serving(path, _board(Clock())):

        def call(raw: bytes) -> list[bytes]:
            with grpc.insecure_channel(unix_target(path)) as channel:
                watch = channel.unary_stream(
                    PATHS["v1"],
                    request_serializer=lambda data: data,
                    response_deserializer=lambda data: data,
                )
                return list(watch(raw, timeout=WITHIN))

        with pytest.raises(grpc.RpcError) as refused:
            # field 1 as a varint whose bytes never end
            await anyio.to_thread.run_sync(call, b"\x08\xff")
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "NodeWatchResourcesRequest" in (refused.value.details() or "")
        with watching(path, "v1") as watch:  # the server goes on
            assert len((await _next(watch)).devices) == 4


async def test_an_unknown_version_is_unimplemented(tmp_path: Path) -> None:
    path = tmp_path / "dra.sock"
    async with serving(path, _board(Clock())):

        def call() -> None:
            with grpc.insecure_channel(unix_target(path)) as channel:
                watch = channel.unary_stream(
                    "/v1beta1.DRAResourceHealth/NodeWatchResources",
                    request_serializer=PEERS["v1"].NodeWatchResourcesRequest.SerializeToString,
                    response_deserializer=PEERS["v1"].NodeWatchResourcesResponse.FromString,
                )
                list(watch(PEERS["v1"].NodeWatchResourcesRequest(), timeout=WITHIN))

        with pytest.raises(grpc.RpcError) as refused:
            await anyio.to_thread.run_sync(call)
        assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED


# --- through the DRA task -----------------------------------------------------------------------


async def test_the_dra_socket_serves_health_beside_prepare_and_ends_it_on_stop(
    tmp_path: Path,
) -> None:
    with contextlib.ExitStack() as stack:
        async with running_node(tmp_path) as node:
            node.owner.health.set_devices(node.config.devices.values())
            watch = stack.enter_context(watching(node.socket, "v1alpha1"))
            first = await _next(watch)
            assert first.health() == dict.fromkeys(NAMES, "HEALTHY")
            assert {d.pool_name for d in first.devices} == {NODE}
            node.owner.health.set_online(MACHINE.online - CpuSet([40]))  # NUMA 1 (8 + 32)
            assert (await _next(watch)).unhealthy() == {"cpudevnuma001": "cpu 40 is offline"}
        # running_node's exit cancelled the DRA task: the stream ended cleanly
        assert await watch.anext(WITHIN) is None


# --- the board ----------------------------------------------------------------------------------


async def test_board_wakes_waiters_on_change_only(tmp_path: Path) -> None:
    board = _board(Clock())
    generation, health = board.snapshot()
    assert [h.device for h in health] == NAMES
    await board.wait_newer(generation - 1)  # already newer: at once
    with anyio.move_on_after(0.05) as idle:
        await board.wait_newer(generation)
    assert idle.cancelled_caught
    with anyio.fail_after(WITHIN):  # the waiter must wake up, or the group never ends
        async with anyio.create_task_group() as tg:
            tg.start_soon(board.wait_newer, generation)
            await anyio.lowlevel.checkpoint()
            board.set_online(MACHINE.online - CpuSet([1]))
    assert board.snapshot()[0] == generation + 1


def test_board_made_outside_an_event_loop_counts_every_published_cpu_online() -> None:
    board = DeviceHealthBoard(Clock())
    assert board.snapshot() == (0, ())
    board.set_devices(DEVICES)  # no set_online yet
    assert {h.status for h in board.snapshot()[1]} == {HealthStatus.HEALTHY}


def test_board_logs_a_device_turning_unhealthy_and_recovering(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dracpu.tasks.device_health")
    board = _board(Clock())
    board.set_online(MACHINE.online)
    board.set_online(MACHINE.online - CpuSet([2]))
    board.set_online(MACHINE.online - CpuSet([2]))  # unchanged: nothing more
    board.set_online(MACHINE.online - CpuSet([2, 3]))
    board.set_online(MACHINE.online)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "device cpudevnuma000 is unhealthy: cpu 2 is offline"),
        ("WARNING", "device cpudevnuma000 is unhealthy: cpus 2-3 are offline"),
        ("INFO", "device cpudevnuma000 is healthy again"),
    ]
    assert caplog.records[0].device == "cpudevnuma000"  # type: ignore[attr-defined]


# --- the online CPUs ----------------------------------------------------------------------------


ONLINE = "sys/devices/system/cpu/online"


async def test_watch_online_follows_the_sysfs_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dracpu.tasks.device_health")
    write_sysfs(FIXTURES["dual-socket-smt2"], tmp_path)
    board = _board(Clock())
    online = tmp_path / ONLINE

    # The file changes at once, as the kernel's does: written beside it, renamed over it (a
    # truncate then write would let the watcher read it empty in between).
    def write(text: str) -> None:
        online.with_name("online.new").write_text(text)
        online.with_name("online.new").rename(online)

    write("0-4,6-63\n")
    async with anyio.create_task_group() as tg:
        await tg.start(partial(watch_online, tmp_path, board, interval=0.02))
        # read once before it reports started: the first list is already current
        assert board.snapshot()[1][0].message == "cpu 5 is offline"

        write("garbage\n")  # unreadable: logged once, the last value stays
        await _until(
            lambda: any("cannot read the online" in r.getMessage() for r in caplog.records)
        )
        await anyio.sleep(0.1)
        assert board.snapshot()[1][0].message == "cpu 5 is offline"

        write("0-63\n")
        await _until(lambda: board.snapshot()[1][0].message == "")
        tg.cancel_scope.cancel()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "device cpudevnuma000 is unhealthy: cpu 5 is offline",
        f"cannot read the online CPUs, device health unchanged: {online}: malformed: "
        "invalid cpuset 'garbage': 'garbage' is not a CPU id",
    ]
    assert "the online CPUs can be read again: 0-63" in [r.getMessage() for r in caplog.records]
