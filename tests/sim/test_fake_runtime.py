"""The fake NRI runtime is right on its own, before any plugin of ours relies on it.

Three independent checks:

* its framing reproduces golden frames (ttrpc-rust's vectors and the bytes containerd/nri's Go
  code writes) in both directions, and reads frames exactly as strictly as the Go runtime
  (containerd/ttrpc ``channel.go`` through a 4096-byte ``bufio.Reader``);
* a minimal plugin written here with ``dracpu.wire`` (our sans-IO mux/ttrpc framing) and the
  daemon's envelope and message code registers, configures, synchronizes and pins containers
  through the fake, which frames its messages with code of its own: the two framings check
  each other;
* the failure helpers (garbage, oversized frame, restart, timeouts) put on the socket exactly
  what they claim, observed with a raw socket peer that speaks golden bytes.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import anyio
import anyio.abc
import pytest
from google.protobuf.message import Message

from dracpu._gen.pb2.nri.v1alpha1 import api_pb2 as bp
from dracpu.adapters import ttrpc_envelopes as envelopes
from dracpu.adapters.ttrpc_envelopes import Answer, Call
from dracpu.core.cpuset import CpuSet
from dracpu.errors import ConfigError
from dracpu.sim import _nri_framing as framing
from dracpu.sim._pb2.nri.v1alpha1 import api_pb2 as g
from dracpu.sim._pb2.ttrpc import request_pb2
from dracpu.sim.fake_runtime import (
    PluginFailedError,
    PluginInfo,
    UpdatesWhileBusy,
    claim_env,
    event_bit,
    nri_version_for,
    open_fake_runtime,
)
from dracpu.wire.events import NEED_DATA, ConnectionClosed, MuxFrame, TtrpcRequest, TtrpcResponse
from dracpu.wire.mux import MuxConnection
from dracpu.wire.status import Code
from dracpu.wire.ttrpc import Role, TtrpcConnection

__all__: list[str] = []

RUNTIME = "nri.pkg.api.v1alpha1.Runtime"
# CREATE_CONTAINER | UPDATE_CONTAINER | STOP_CONTAINER | REMOVE_CONTAINER (nri event.go bits)
PINNING_EVENTS = 0x688
STEP = 10.0  # seconds any single step of a test may take (2 shared cores)


def _hex(text: str) -> bytes:
    return bytes.fromhex(text)


# Golden frames: the bytes containerd/nri's Go code writes, and ttrpc-rust's vectors.
GOLDEN_REGISTER_SOCKET = _hex(
    "00 00 00 02 00 00 00 4d  00 00 00 43 00 00 00 01 01 00"
    "0a 1c 6e 72 69 2e 70 6b 67 2e 61 70 69 2e 76 31 61 6c 70 68 61 31 2e 52 75 6e 74 69 6d 65"
    "12 0e 52 65 67 69 73 74 65 72 50 6c 75 67 69 6e 1a 0d 0a 07 64 72 61 2d 63 70 75 12 02 39"
    "30 20 80 e4 97 d0 12"
)
GOLDEN_REGISTER_OK = _hex("00 00 00 02 00 00 00 0a  00 00 00 00 00 00 00 01 02 00")
GOLDEN_CONFIGURE_REPLY = _hex(
    "00 00 00 01 00 00 00 0f  00 00 00 05 00 00 00 01 02 00  12 03 10 88 0d"
)
GOLDEN_CREATE_REPLY_STREAM5 = _hex(
    "00 00 00 01 00 00 00 19  00 00 00 0f 00 00 00 05 02 00"
    "12 0d 0a 0b 32 09 12 07 12 05 32 03 32 2d 33"
)
GOLDEN_ERROR_BOOM = _hex("0a 08 08 02 12 04 62 6f 6f 6d")
GOLDEN_ERROR_UNIMPLEMENTED = _hex("0a 0e 08 0c 12 0a 6d 65 74 68 6f 64 20 46 6f 6f")
RUST_REQUEST_HEADER = bytes([0x00, 0x0, 0x0, 67, 0x0, 0x12, 0x34, 0x56, 0x1, 0xEF])
RUST_REQUEST = bytes(
    [
        10, 17, 103, 114, 112, 99, 46, 84, 101, 115, 116, 83, 101, 114, 118, 105, 99, 101, 115,
        18, 4, 84, 101, 115, 116, 26, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 32, 128, 218, 196, 9, 42, 24,
        10, 9, 116, 101, 115, 116, 95, 107, 101, 121, 49, 18, 11, 116, 101, 115, 116, 95, 118, 97,
        108, 117, 101, 49,
    ]
)  # fmt: skip


def _empty_reply(conn_id: int, stream_id: int) -> bytes:
    """A Go server's success reply with an empty message: a 0-length ttrpc Response."""
    return struct.pack(">IIIIBB", conn_id, 10, 0, stream_id, 2, 0)


@pytest.fixture
def socket_path() -> Iterator[Path]:
    # A short directory: unix socket paths are limited to 107 bytes, pytest's tmp_path is long.
    with tempfile.TemporaryDirectory(prefix="fake-nri-") as tmp:
        yield Path(tmp) / "nri.sock"


# ----------------------------------------------------------------------------------------------
# (a) framing: golden vectors both ways, Go's reader constraints


def test_runtime_replies_match_golden_frames() -> None:
    register_ok = framing.mux_frames(2, framing.response_message(1))
    assert register_ok == [GOLDEN_REGISTER_OK]
    configure = g.ConfigureResponse(events=PINNING_EVENTS).SerializeToString()
    assert framing.mux_frames(1, framing.response_message(1, configure)) == [GOLDEN_CONFIGURE_REPLY]
    adjust = g.CreateContainerResponse()
    adjust.adjust.linux.resources.cpu.cpus = "2-3"
    create = framing.response_message(5, adjust.SerializeToString())
    assert framing.mux_frames(1, create) == [GOLDEN_CREATE_REPLY_STREAM5]
    boom = framing.response_message(7, b"ignored on error", code=2, message="boom")
    assert boom == struct.pack(">IIBB", len(GOLDEN_ERROR_BOOM), 7, 2, 0) + GOLDEN_ERROR_BOOM
    unimplemented = framing.response_message(9, code=12, message="method Foo")
    assert unimplemented[10:] == GOLDEN_ERROR_UNIMPLEMENTED


def test_runtime_requests_match_golden_envelopes() -> None:
    register = g.RegisterPluginRequest(plugin_name="dra-cpu", plugin_idx="90")
    message = framing.request_message(
        1, RUNTIME, "RegisterPlugin", register.SerializeToString(), 5_000_000_000
    )
    assert framing.mux_frames(2, message) == [GOLDEN_REGISTER_SOCKET]
    assert framing.ttrpc_message(0x123456, 1, RUST_REQUEST, flags=0xEF)[:10] == RUST_REQUEST_HEADER
    decoded = framing.decode_request(RUST_REQUEST)
    assert (decoded.service, decoded.method, decoded.payload) == (
        "grpc.TestServices",
        "Test",
        bytes(range(1, 10)),
    )
    assert decoded.timeout_nano == 20_000_000
    assert [(kv.key, kv.value) for kv in decoded.metadata] == [("test_key1", "test_value1")]


def test_reader_parses_golden_plugin_frames() -> None:
    parser = framing.MuxFrameParser()
    readers = {1: framing.GoChannelReader(), 2: framing.GoChannelReader()}
    stream = GOLDEN_REGISTER_SOCKET + GOLDEN_CONFIGURE_REPLY + GOLDEN_CREATE_REPLY_STREAM5
    messages: list[tuple[int, framing.TtrpcMessage]] = []
    for index in range(len(stream)):  # one byte at a time: the parser must reassemble
        for conn_id, payload in parser.feed(stream[index : index + 1]):
            messages.extend((conn_id, m) for m in readers[conn_id].feed(payload))
    assert [(c, m.stream_id, m.type) for c, m in messages] == [(2, 1, 1), (1, 1, 2), (1, 5, 2)]
    request = framing.decode_request(messages[0][1].data)
    assert (request.service, request.method, request.timeout_nano) == (
        RUNTIME,
        "RegisterPlugin",
        5_000_000_000,
    )
    registered = g.RegisterPluginRequest.FromString(request.payload)
    assert (registered.plugin_name, registered.plugin_idx) == ("dra-cpu", "90")
    configure = framing.decode_response(messages[1][1].data)
    assert not configure.HasField("status")
    assert g.ConfigureResponse.FromString(configure.payload).events == PINNING_EVENTS
    create = g.CreateContainerResponse.FromString(
        framing.decode_response(messages[2][1].data).payload
    )
    assert create.adjust.linux.resources.cpu.cpus == "2-3"
    error = framing.decode_response(GOLDEN_ERROR_BOOM)
    assert (error.status.code, error.status.message, error.payload) == (2, "boom", b"")


def test_a_5000_byte_message_goes_out_as_4096_then_904() -> None:
    message = framing.ttrpc_message(3, 1, bytes(4990))
    frames = framing.mux_frames(1, message)
    assert [struct.unpack(">II", f[:8]) for f in frames] == [(1, 4096), (1, 904)]
    assert b"".join(f[8:] for f in frames) == message
    exactly_4096 = framing.ttrpc_message(3, 1, bytes(4086))
    assert [len(f) - 8 for f in framing.mux_frames(1, exactly_4096)] == [4096]
    with pytest.raises(ValueError, match=r"10 \.\. 4194314"):
        framing.mux_frames(1, bytes(framing.MUX_MAX_PAYLOAD + 1))


def _feed_all(reader: framing.GoChannelReader, frames: list[bytes]) -> list[framing.TtrpcMessage]:
    out: list[framing.TtrpcMessage] = []
    for frame in frames:
        out.extend(reader.feed(frame))
    return out


def test_go_reader_accepts_what_go_writers_send_and_rejects_what_go_cannot_read() -> None:
    big = framing.ttrpc_message(1, 2, bytes(range(256)) * 40)  # 10250 bytes
    small = framing.ttrpc_message(3, 2, b"abc")
    # Go's own split, and a header-alone split: fine.
    messages = _feed_all(framing.GoChannelReader(), [big[:4096], big[4096:]])
    assert [m.data for m in messages] == [big[10:]]
    messages = _feed_all(framing.GoChannelReader(), [big[:10], big[10:]])
    assert [m.data for m in messages] == [big[10:]]
    # Many tiny frames, and two small messages sharing one frame (bufio buffers them): fine.
    tiny = [bytes([b]) for b in small + small.replace(b"\x03\x02", b"\x05\x02", 1)]
    assert [m.stream_id for m in _feed_all(framing.GoChannelReader(), tiny)] == [3, 5]
    assert len(_feed_all(framing.GoChannelReader(), [small + small])) == 2
    # A message start in a frame longer than bufio's 4096 bytes: ENOMEM in Go.
    with pytest.raises(framing.FramingError, match="ENOMEM"):
        framing.GoChannelReader().feed(big)
    # The rest of a message followed by the next message in one large frame: corrupt in Go.
    with pytest.raises(framing.FramingError, match="corrupt"):
        _feed_all(framing.GoChannelReader(), [big[:10], big[10:] + small])
    # Without strictness the same bytes are just concatenated.
    loose = _feed_all(framing.GoChannelReader(strict=False), [big + small])
    assert [m.stream_id for m in loose] == [1, 3]


def test_go_reader_discards_an_oversized_message_and_reports_it() -> None:
    declared = framing.TTRPC_MAX_DATA + 1
    reader = framing.GoChannelReader(strict=False)
    header = framing.TTRPC_HEADER.pack(declared, 7, 2, 0)
    assert reader.feed(header) == []
    assert reader.feed(bytes(declared - 1)) == []
    after = framing.ttrpc_message(9, 2, b"ok")
    messages = reader.feed(b"\0" + after)
    assert messages == [
        framing.TtrpcMessage(7, 2, 0, b"", oversized=declared),
        framing.TtrpcMessage(9, 2, 0, b"ok"),
    ]
    assert reader.idle
    with pytest.raises(framing.FramingError, match="4194314-byte frame limit"):
        framing.MuxFrameParser().feed(framing.MUX_HEADER.pack(1, framing.MUX_MAX_PAYLOAD + 1))


def test_nri_version_follows_the_runtime_release() -> None:
    assert nri_version_for("containerd", "2.3.0") == "v0.12.0"
    assert nri_version_for("containerd", "v1.7.13") == "v0.4.0"
    assert nri_version_for("containerd", "1.7.30") == "v0.8.0"
    assert nri_version_for("containerd", "2.1.4") == "v0.8.0"
    assert nri_version_for("containerd", "2.2.0") == "v0.10.0"
    assert nri_version_for("containerd", "2.2.5") == "v0.11.0"
    assert nri_version_for("cri-o", "1.34.2") == "v0.10.0"
    assert event_bit(g.CREATE_CONTAINER) | event_bit(g.REMOVE_CONTAINER) == 0x408
    with pytest.raises(ConfigError, match="no NRI version known"):
        nri_version_for("podman", "5.0")
    with pytest.raises(ConfigError, match="predates NRI"):
        nri_version_for("containerd", "1.6.20")


# ----------------------------------------------------------------------------------------------
# (b) a plugin built from dracpu.wire and the daemon's envelopes and messages against the fake

Reply = bytes | tuple[int, str]
Handler = Callable[[Call], Awaitable[Reply]]
_CLOSED = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


class WirePlugin:
    """A minimal NRI plugin: ``dracpu.wire`` framing, the daemon's envelopes and messages."""

    def __init__(
        self, stream: anyio.abc.SocketStream, handlers: dict[str, Handler], tg: anyio.abc.TaskGroup
    ) -> None:
        self.stream = stream
        self.handlers = handlers
        self.tg = tg
        self.mux = MuxConnection()
        self.server = TtrpcConnection(Role.SERVER)  # conn 1: the runtime calls us
        self.client = TtrpcConnection(Role.CLIENT)  # conn 2: we call the runtime
        self.requests: list[Call] = []
        self.responses: dict[int, Answer] = {}
        self.waiters: dict[int, anyio.Event] = {}
        self.send_lock = anyio.Lock()
        self.closed = anyio.Event()

    def methods(self) -> list[str]:
        return [request.method for request in self.requests]

    async def _send(self, conn_id: int, message: bytes) -> None:
        async with self.send_lock:
            await self.stream.send(self.mux.send(conn_id, message))

    async def call(self, method: str, payload: bytes) -> Answer | None:
        """One call on conn 2; None if the connection closed first."""
        data = envelopes.request_data(RUNTIME, method, payload, 5_000_000_000)
        stream_id, message = self.client.send_request(data)
        waiter = self.waiters[stream_id] = anyio.Event()
        with suppress(*_CLOSED):
            await self._send(2, message)
        await waiter.wait()
        return self.responses.pop(stream_id, None)

    async def read_loop(self) -> None:
        try:
            while True:
                try:
                    data = await self.stream.receive()
                except (anyio.EndOfStream, *_CLOSED):
                    data = b""
                self.mux.receive_data(data)
                while (event := self.mux.next_event()) is not NEED_DATA:
                    if isinstance(event, ConnectionClosed):
                        return
                    assert isinstance(event, MuxFrame)
                    self._receive(event)
        finally:
            self.closed.set()
            for waiter in self.waiters.values():
                waiter.set()

    def _receive(self, frame: MuxFrame) -> None:
        conn = self.server if frame.conn_id == 1 else self.client
        conn.receive_data(frame.payload)
        while (event := conn.next_event()) is not NEED_DATA:
            if isinstance(event, TtrpcRequest):
                call = envelopes.read_request(event)
                self.requests.append(call)
                self.tg.start_soon(self._handle, call)
            elif isinstance(event, TtrpcResponse):
                self.responses[event.stream_id] = envelopes.read_response(event)
                self.waiters[event.stream_id].set()
            else:
                raise AssertionError(f"unexpected ttrpc event {event!r}")

    async def _handle(self, request: Call) -> None:
        handler = self.handlers.get(request.method)
        if handler is None:
            reply: Reply = (Code.UNIMPLEMENTED, f"method {request.method}")
        else:
            reply = await handler(request)
        if isinstance(reply, bytes):
            data = envelopes.response_data(reply)
        else:
            data = envelopes.response_data(b"", *reply)
        message = self.server.send_response(request.stream_id, data)
        with suppress(*_CLOSED):
            await self._send(1, message)


@asynccontextmanager
async def open_wire_plugin(
    path: Path, handlers: dict[str, Handler], *, name: str = "dra.cpu", index: str = "00"
) -> AsyncIterator[tuple[WirePlugin, Answer | None]]:
    """Connect, serve conn 1, register on conn 2; yield the plugin and the RegisterPlugin reply."""
    stream = await anyio.connect_unix(path)
    try:
        async with anyio.create_task_group() as tg:
            plugin = WirePlugin(stream, handlers, tg)
            tg.start_soon(plugin.read_loop)
            request = bp.RegisterPluginRequest(plugin_name=name, plugin_idx=index)
            reply = await plugin.call("RegisterPlugin", request.SerializeToString())
            try:
                yield plugin, reply
            finally:
                # Hang up and let the reader see EOF rather than cancel it inside receive()
                # (anyio's asyncio raw sockets report InvalidStateError on that race).
                with suppress(OSError):
                    stream.extra(anyio.abc.SocketAttribute.raw_socket).shutdown(socket.SHUT_RDWR)
                with anyio.CancelScope(shield=True), anyio.move_on_after(STEP):
                    await plugin.closed.wait()
                tg.cancel_scope.cancel()
    finally:
        await stream.aclose()


def _b(message: Message) -> bytes:
    return message.SerializeToString()


def _update(container_id: str, cpus: CpuSet) -> bp.ContainerUpdate:
    return bp.ContainerUpdate(
        container_id=container_id,
        linux=bp.LinuxContainerUpdate(resources=bp.LinuxResources(cpu=bp.LinuxCPU(cpus=str(cpus)))),
    )


class Pinner:
    """The test plugin's logic: DRA_CPUSET_ env -> exclusive CPUs, everyone else shares the rest."""

    ALL = CpuSet.parse("0-7")

    def __init__(self, events: int = PINNING_EVENTS) -> None:
        self.events = events
        self.exclusive: dict[str, CpuSet] = {}
        self.shared: set[str] = set()
        self.sync_chunks: list[bp.SynchronizeRequest] = []

    @staticmethod
    def claimed(env: Iterable[str]) -> CpuSet | None:
        sets = [
            CpuSet.parse(entry.partition("=")[2])
            for entry in env
            if entry.startswith("DRA_CPUSET_")
        ]
        return CpuSet.union(sets) if sets else None

    def pool(self) -> CpuSet:
        return self.ALL - CpuSet.union(self.exclusive.values())

    def shared_updates(self, skip: str = "") -> list[bp.ContainerUpdate]:
        return [_update(cid, self.pool()) for cid in sorted(self.shared) if cid != skip]

    def handlers(self) -> dict[str, Handler]:
        return {
            "Configure": self.configure,
            "Synchronize": self.synchronize,
            "CreateContainer": self.create_container,
            "UpdateContainer": self.update_container,
            "StopContainer": self.stop_container,
            "StateChange": self.state_change,
        }

    async def configure(self, request: Call) -> Reply:
        return _b(bp.ConfigureResponse(events=self.events))

    async def synchronize(self, request: Call) -> Reply:
        chunk = bp.SynchronizeRequest.FromString(request.payload)
        self.sync_chunks.append(chunk)
        if chunk.more:
            return _b(bp.SynchronizeResponse(more=True))
        for part in self.sync_chunks:
            for container in part.containers:
                cpus = self.claimed(container.env)
                if cpus is None:
                    self.shared.add(container.id)
                else:
                    self.exclusive[container.id] = cpus
        updates = [_update(cid, cpus) for cid, cpus in sorted(self.exclusive.items())]
        return _b(bp.SynchronizeResponse(update=updates + self.shared_updates()))

    async def create_container(self, request: Call) -> Reply:
        container = bp.CreateContainerRequest.FromString(request.payload).container
        assert container is not None
        cpus = self.claimed(container.env)
        if cpus is None:
            self.shared.add(container.id)
            cpus = self.pool()
        else:
            self.exclusive[container.id] = cpus
        adjust = bp.ContainerAdjustment(
            linux=bp.LinuxContainerAdjustment(
                resources=bp.LinuxResources(cpu=bp.LinuxCPU(cpus=str(cpus)))
            )
        )
        reply = bp.CreateContainerResponse(adjust=adjust, update=self.shared_updates(container.id))
        return _b(reply)

    async def update_container(self, request: Call) -> Reply:
        container = bp.UpdateContainerRequest.FromString(request.payload).container
        assert container is not None
        cpus = self.exclusive.get(container.id, self.pool())
        return _b(bp.UpdateContainerResponse(update=[_update(container.id, cpus)]))

    async def stop_container(self, request: Call) -> Reply:
        container = bp.StopContainerRequest.FromString(request.payload).container
        assert container is not None
        self.exclusive.pop(container.id, None)
        self.shared.discard(container.id)
        return _b(bp.StopContainerResponse(update=self.shared_updates()))

    async def state_change(self, request: Call) -> Reply:
        return b""


async def _until(predicate: Callable[[], bool]) -> None:
    """Poll ``predicate`` every 10 ms (call inside a fail_after)."""
    for _ in range(100_000):
        if predicate():
            return
        await anyio.sleep(0.01)


def _parsed(plugin: WirePlugin, method: str) -> list[bytes]:
    return [r.payload for r in plugin.requests if r.method == method]


@pytest.mark.anyio
async def test_wire_plugin_pins_containers_through_the_fake(socket_path: Path) -> None:
    pinner = Pinner()
    async with open_fake_runtime(socket_path) as runtime:
        pod = runtime.add_pod("web", namespace="shop")
        sidecar = runtime.add_container(pod, "sidecar", cpus="0-7")
        db = runtime.add_container(pod, "db", env=[claim_env("u1", "6-7")], cpus="0-7")
        async with open_wire_plugin(socket_path, pinner.handlers()) as (plugin, registered):
            assert registered is not None
            assert (registered.status_code, registered.payload) == (0, b"")
            with anyio.fail_after(STEP):
                info = await runtime.wait_plugin(STEP)
            assert info == PluginInfo(
                name="dra.cpu",
                index="00",
                events=PINNING_EVENTS,
                requested_events=PINNING_EVENTS,
                nri_version="",
                connection=1,
            )
            assert plugin.methods() == ["Configure", "Synchronize"]
            configure = bp.ConfigureRequest.FromString(plugin.requests[0].payload)
            assert configure == bp.ConfigureRequest(
                runtime_name="containerd",
                runtime_version="2.3.0",
                registration_timeout=5000,
                request_timeout=2000,
                NRI_version="v0.12.0",
            )
            assert 0 < plugin.requests[0].timeout_nano <= 2_000_000_000
            (sync,) = pinner.sync_chunks
            assert [p.uid for p in sync.pods] == [pod.uid]
            assert sync.pods[0].namespace == "shop"
            by_id = {c.id: c for c in sync.containers}
            assert by_id[db.id].env == ["DRA_CPUSET_u1=6-7"]
            assert by_id[db.id].state == bp.CONTAINER_RUNNING
            assert by_id[sidecar.id].linux == bp.LinuxContainer(
                resources=bp.LinuxResources(cpu=bp.LinuxCPU(cpus="0-7"))
            )
            # The Synchronize reply's updates reached the table.
            assert runtime.containers[db.id].cpus == "6-7"
            assert runtime.containers[sidecar.id].cpus == "0-5"

            app = runtime.new_container(pod, "app", env=[claim_env("u2", "2-3"), "PATH=/bin"])
            with anyio.fail_after(STEP):
                reply = await runtime.create_container(pod, app)
            assert reply.adjust.linux.resources.cpu.cpus == "2-3"
            created = bp.CreateContainerRequest.FromString(_parsed(plugin, "CreateContainer")[0])
            assert created.container is not None
            assert created.container.state == bp.CONTAINER_UNKNOWN
            assert created.container.env == ["DRA_CPUSET_u2=2-3", "PATH=/bin"]
            assert runtime.containers[app.id].cpus == "2-3"
            assert runtime.containers[app.id].state == g.CONTAINER_CREATED
            assert runtime.containers[app.id].env == app.env
            assert runtime.containers[sidecar.id].cpus == "0-1,4-5"

            # START_CONTAINER and POST_* are not subscribed: nothing goes to the plugin.
            seen = len(plugin.requests)
            with anyio.fail_after(STEP):
                await runtime.start_container(app.id)
            assert len(plugin.requests) == seen
            assert runtime.containers[app.id].state == g.CONTAINER_RUNNING

            with anyio.fail_after(STEP):
                await runtime.update_container(app.id, cpus="0-7")
            asked = bp.UpdateContainerRequest.FromString(_parsed(plugin, "UpdateContainer")[0])
            assert asked.linux_resources is not None
            assert asked.linux_resources.cpu is not None
            assert asked.linux_resources.cpu.cpus == "0-7"
            assert runtime.containers[app.id].cpus == "2-3"  # the plugin's entry overrides

            with anyio.fail_after(STEP):
                await runtime.stop_container(app.id)
            assert runtime.containers[app.id].state == g.CONTAINER_STOPPED
            assert runtime.containers[sidecar.id].cpus == "0-5"

            with anyio.fail_after(STEP):
                await runtime.remove_container(app.id)
            assert app.id not in runtime.containers
            # NRI v0.12: the dedicated RPC first, StateChange after UNIMPLEMENTED.
            assert plugin.methods()[-2:] == ["RemoveContainer", "StateChange"]
            event = bp.StateChangeEvent.FromString(plugin.requests[-1].payload)
            assert event.event == bp.REMOVE_CONTAINER
            assert event.container is not None
            assert event.container.id == app.id

            with anyio.fail_after(STEP):
                await runtime.run_pod_sandbox(runtime.add_pod("other"))
            assert plugin.methods()[-1] == "StateChange"  # RUN_POD_SANDBOX not subscribed
        outcomes = [(c.method, c.outcome, c.code) for c in runtime.calls(caller="runtime")]
        assert outcomes == [
            ("Configure", "ok", 0),
            ("Synchronize", "ok", 0),
            ("CreateContainer", "ok", 0),
            ("UpdateContainer", "ok", 0),
            ("StopContainer", "ok", 0),
            ("RemoveContainer", "error", Code.UNIMPLEMENTED),
            ("StateChange", "ok", 0),
        ]
        assert runtime.notes("violation") == []
        with anyio.fail_after(STEP):
            await runtime.wait_plugin_gone(STEP)
        assert runtime.plugin is None


@pytest.mark.anyio
async def test_old_containerd_uses_state_change_and_the_old_event_mask(socket_path: Path) -> None:
    everything = Pinner(events=0)
    async with open_fake_runtime(socket_path, runtime_version="1.7.0") as runtime:
        assert runtime.nri_version == "v0.3.0"
        pod = runtime.add_pod()
        async with open_wire_plugin(socket_path, everything.handlers()) as (plugin, _):
            with anyio.fail_after(STEP):
                info = await runtime.wait_plugin(STEP)
            assert (info.events, info.requested_events) == (0x7FF, 0)
            configure = bp.ConfigureRequest.FromString(plugin.requests[0].payload)
            assert configure == bp.ConfigureRequest(
                runtime_name="containerd", runtime_version="1.7.0"
            )
            app = runtime.new_container(pod, "app")
            with anyio.fail_after(STEP):
                await runtime.create_container(pod, app)
                await runtime.start_container(app.id)
                await runtime.remove_container(app.id)
            events = [
                bp.StateChangeEvent.FromString(r.payload).event
                for r in plugin.requests
                if r.method == "StateChange"
            ]
            assert events == [
                bp.POST_CREATE_CONTAINER,
                bp.START_CONTAINER,
                bp.POST_START_CONTAINER,
                bp.REMOVE_CONTAINER,
            ]
            assert "RemoveContainer" not in plugin.methods()
            assert plugin.methods().count("StopContainer") == 1  # removal stops it first

    async with open_fake_runtime(socket_path, runtime_version="1.7.0") as runtime:
        async with open_wire_plugin(socket_path, Pinner(events=0x3FFF).handlers()) as (plugin, _):
            with anyio.fail_after(STEP):
                await plugin.closed.wait()
        assert [n.detail for n in runtime.notes("closed")] == ["invalid plugin events: 0x3800"]
        assert runtime.plugin is None


@pytest.mark.anyio
async def test_error_status_fails_the_creation_and_keeps_the_plugin(socket_path: Path) -> None:
    async def refuse(request: Call) -> Reply:
        return (Code.FAILED_PRECONDITION, "claim u9 is not prepared")

    async def fail_stop(request: Call) -> Reply:
        return (Code.INTERNAL, "stop went wrong")

    pinner = Pinner()
    handlers = {**pinner.handlers(), "CreateContainer": refuse, "StopContainer": fail_stop}
    async with open_fake_runtime(socket_path) as runtime:
        pod = runtime.add_pod()
        running = runtime.add_container(pod, "running")
        other = runtime.add_container(pod, "other")
        async with open_wire_plugin(socket_path, handlers):
            with anyio.fail_after(STEP):
                await runtime.wait_plugin(STEP)
                app = runtime.new_container(pod, "app", env=[claim_env("u9", "1")])
                with pytest.raises(PluginFailedError, match="claim u9 is not prepared") as info:
                    await runtime.create_container(pod, app)
            assert (info.value.method, info.value.code) == ("CreateContainer", 9)
            assert app.id not in runtime.containers
            assert runtime.plugin is not None  # a plain error is not fatal
            # A failed StopContainer is reported, yet the container is stopped all the same;
            # removal stops first and ignores that error, as containerd does.
            with anyio.fail_after(STEP):
                with pytest.raises(PluginFailedError, match="stop went wrong"):
                    await runtime.stop_container(running.id)
                await runtime.remove_container(other.id)
            assert runtime.containers[running.id].state == g.CONTAINER_STOPPED
            assert other.id not in runtime.containers
            stops = [(c.outcome, c.code) for c in runtime.calls("StopContainer")]
            assert stops == [("error", Code.INTERNAL), ("error", Code.INTERNAL)]


@pytest.mark.anyio
async def test_slow_plugin_is_closed_and_the_container_created_unpinned(socket_path: Path) -> None:
    async def slow(request: Call) -> Reply:
        await anyio.sleep(5)
        return b""

    handlers = {**Pinner().handlers(), "CreateContainer": slow}
    async with open_fake_runtime(socket_path, plugin_timeout=0.3) as runtime:
        pod = runtime.add_pod()
        async with open_wire_plugin(socket_path, handlers) as (plugin, _):
            with anyio.fail_after(STEP):
                await runtime.wait_plugin(STEP)
                app = runtime.new_container(pod, "app", env=[claim_env("u1", "1")])
                reply = await runtime.create_container(pod, app)
                await plugin.closed.wait()
            assert reply == g.CreateContainerResponse()
            assert runtime.containers[app.id].cpus == ""
            (call,) = runtime.calls("CreateContainer")
            assert (call.outcome, call.code) == ("timeout", 4)
            assert 0.25 < call.seconds < 2.0
            assert runtime.notes("closed")[0].detail == (
                "failed to handle CreateContainer request: context deadline exceeded"
            )
            with anyio.fail_after(STEP):
                await runtime.wait_plugin_gone(STEP)


@pytest.mark.anyio
async def test_synchronize_in_chunks_with_more(socket_path: Path) -> None:
    pinner = Pinner()
    async with open_fake_runtime(socket_path, sync_chunk=2) as runtime:
        pod = runtime.add_pod()
        ids = [runtime.add_container(pod, f"c{i}", cpus="0-7").id for i in range(5)]
        async with open_wire_plugin(socket_path, pinner.handlers()):
            with anyio.fail_after(STEP):
                await runtime.wait_plugin(STEP)
        shape = [(len(c.pods), len(c.containers), c.more) for c in pinner.sync_chunks]
        assert shape == [(1, 2, True), (0, 2, True), (0, 1, False)]
        assert [c.id for chunk in pinner.sync_chunks for c in chunk.containers] == ids
        assert {runtime.containers[i].cpus for i in ids} == {"0-7"}  # pool is everything
        assert [c.outcome for c in runtime.calls("Synchronize")] == ["ok", "ok", "ok"]

    async def eager(request: Call) -> Reply:
        return _b(bp.SynchronizeResponse(update=[_update("x", CpuSet.parse("1"))], more=True))

    async with open_fake_runtime(socket_path, sync_chunk=1) as runtime:
        pod = runtime.add_pod()
        runtime.add_container(pod, "a")
        runtime.add_container(pod, "b")
        handlers = {**Pinner().handlers(), "Synchronize": eager}
        async with open_wire_plugin(socket_path, handlers) as (plugin, _):
            with anyio.fail_after(STEP):
                await plugin.closed.wait()
        assert [n.detail for n in runtime.notes("closed")] == [
            "plugin does not handle split sync requests"
        ]


@pytest.mark.anyio
async def test_synchronize_over_4_mib_is_split_like_containerd(socket_path: Path) -> None:
    pinner = Pinner()
    async with open_fake_runtime(socket_path, plugin_timeout=STEP) as runtime:
        big_env = ["BLOB=" + "x" * 120_000]
        for p in range(10):
            pod = runtime.add_pod(f"p{p}")
            for c in range(4):
                runtime.add_container(pod, f"c{c}", env=big_env)
        async with open_wire_plugin(socket_path, pinner.handlers()):
            with anyio.fail_after(3 * STEP):
                await runtime.wait_plugin(3 * STEP)
        (split,) = runtime.notes("sync-split")
        assert split.detail.endswith("8 pods, 34 containers per message")
        shape = [(len(c.pods), len(c.containers), c.more) for c in pinner.sync_chunks]
        assert shape == [(8, 34, True), (2, 6, False)]


@pytest.mark.anyio
async def test_unsolicited_update_containers(socket_path: Path) -> None:
    async with open_fake_runtime(socket_path) as runtime:
        pod = runtime.add_pod()
        shared = runtime.add_container(pod, "shared", cpus="0-7")
        async with open_wire_plugin(socket_path, Pinner().handlers()) as (plugin, _):
            with anyio.fail_after(STEP):
                await runtime.wait_plugin(STEP)
                ok = await plugin.call(
                    "UpdateContainers",
                    _b(
                        bp.UpdateContainersRequest(update=[_update(shared.id, CpuSet.parse("1-7"))])
                    ),
                )
                missing = await plugin.call(
                    "UpdateContainers",
                    _b(bp.UpdateContainersRequest(update=[_update("nope", CpuSet.parse("1"))])),
                )
                tolerated = bp.UpdateContainersRequest(update=[_update("nope", CpuSet.parse("1"))])
                tolerated.update[0].ignore_failure = True
                ignored = await plugin.call("UpdateContainers", _b(tolerated))
        assert ok is not None
        assert (ok.status_code, ok.payload) == (0, b"")
        assert runtime.containers[shared.id].cpus == "1-7"
        assert missing is not None
        assert (missing.status_code, missing.status_message) == (
            2,
            "NRI update of some containers failed",
        )
        assert ignored is not None
        assert ignored.status_code == 0


@pytest.mark.parametrize("policy", ["wait", "serve", "refuse"])
@pytest.mark.anyio
async def test_update_containers_from_inside_a_handler(
    socket_path: Path, policy: UpdatesWhileBusy
) -> None:
    statuses: list[int] = []
    plugin_box: list[WirePlugin] = []
    pinner = Pinner()

    async def create_and_update(request: Call) -> Reply:
        shared_id = next(iter(pinner.shared))
        update = bp.UpdateContainersRequest(update=[_update(shared_id, CpuSet.parse("4-7"))])
        reply = await plugin_box[0].call("UpdateContainers", _b(update))
        statuses.append(-1 if reply is None else reply.status_code)
        return await pinner.create_container(request)

    handlers = {**pinner.handlers(), "CreateContainer": create_and_update}
    async with open_fake_runtime(
        socket_path,
        plugin_timeout=0.5,
        updates_while_busy=policy,
    ) as runtime:
        pod = runtime.add_pod()
        shared = runtime.add_container(pod, "shared", cpus="0-7")
        async with open_wire_plugin(socket_path, handlers) as (plugin, _):
            plugin_box.append(plugin)
            with anyio.fail_after(STEP):
                await runtime.wait_plugin(STEP)
                app = runtime.new_container(pod, "app", env=[claim_env("u1", "0-1")])
                await runtime.create_container(pod, app)
            (create,) = runtime.calls("CreateContainer")
            if policy == "wait":
                # containerd's lock: the handler waits for itself until the request times out.
                assert create.outcome == "timeout"
                assert runtime.containers[app.id].cpus == ""
                with anyio.fail_after(STEP):
                    await plugin.closed.wait()
                    await _until(lambda: bool(runtime.calls("UpdateContainers")))
                # It gets the lock only after the drop, and ttrpc cancelled its context with the
                # connection (server.go run: deferred cancel): containerd's update fails with it.
                [update] = runtime.calls("UpdateContainers")
                assert (update.outcome, update.code) == ("closed", 1)
                assert runtime.containers[shared.id].cpus == "0-7"
            elif policy == "serve":
                assert create.outcome == "ok"
                assert statuses == [0]
                assert runtime.containers[app.id].cpus == "0-1"
                assert runtime.containers[shared.id].cpus == "2-7"  # the reply's update wins
            else:
                assert create.outcome == "ok"
                assert statuses == [14]
                assert runtime.containers[app.id].cpus == "0-1"


@pytest.mark.anyio
async def test_registration_is_checked(socket_path: Path) -> None:
    async with open_fake_runtime(socket_path) as runtime:
        async with open_wire_plugin(socket_path, Pinner().handlers(), index="9") as (plugin, reply):
            assert reply is not None
            assert reply.status_code == 2
            assert "invalid plugin index" in reply.status_message
            with anyio.fail_after(STEP):
                await plugin.closed.wait()
        async with open_wire_plugin(socket_path, Pinner().handlers(), name="dra cpu") as (_, reply):
            assert reply is not None
            assert reply.status_code == 2
            assert "invalid plugin name" in reply.status_message
        assert runtime.plugin is None
    # NRI < v0.12 only checks that the name is not empty.
    async with (
        open_fake_runtime(socket_path, runtime_version="2.1.4") as runtime,
        open_wire_plugin(socket_path, Pinner().handlers(), name="dra cpu") as (_, reply),
    ):
        assert reply is not None
        assert reply.status_code == 0
        with anyio.fail_after(STEP):
            assert (await runtime.wait_plugin(STEP)).name == "dra cpu"


@pytest.mark.anyio
async def test_a_new_connection_replaces_the_old_one(socket_path: Path) -> None:
    async with open_fake_runtime(socket_path) as runtime:
        async with open_wire_plugin(socket_path, Pinner().handlers()) as (first, _):
            with anyio.fail_after(STEP):
                await runtime.wait_plugin(STEP)
            async with open_wire_plugin(socket_path, Pinner().handlers()) as (second, _):
                with anyio.fail_after(STEP):
                    await first.closed.wait()
                    await _until(lambda: getattr(runtime.plugin, "connection", 0) == 2)
                assert not second.closed.is_set()
        assert runtime.connections == 2
        assert "replaced by a new plugin connection" in [n.detail for n in runtime.notes("closed")]


@pytest.mark.anyio
async def test_drop_plugin_hangs_up_and_the_plugin_can_come_back(socket_path: Path) -> None:
    async with open_fake_runtime(socket_path) as runtime:
        async with open_wire_plugin(socket_path, Pinner().handlers()) as (plugin, _):
            with anyio.fail_after(STEP):
                await runtime.wait_plugin(STEP)
                await runtime.drop_plugin("simulated ttrpc: closed")
                await plugin.closed.wait()
            assert runtime.plugin is None
            assert runtime.notes("closed")[-1].detail == "simulated ttrpc: closed"
            # Events go nowhere while no plugin is connected; the container is still created.
            pod = runtime.add_pod()
            app = runtime.new_container(pod, "app", env=[claim_env("u", "1")])
            with anyio.fail_after(STEP):
                assert await runtime.create_container(pod, app) == g.CreateContainerResponse()
            assert runtime.containers[app.id].cpus == ""
        async with open_wire_plugin(socket_path, Pinner().handlers()):
            with anyio.fail_after(STEP):
                info = await runtime.wait_plugin(STEP)
        assert info.connection == 2
        assert runtime.calls("CreateContainer") == []


# ----------------------------------------------------------------------------------------------
# (c) failure helpers, seen from a raw socket that speaks golden bytes


class RawPeer:
    """A plugin made of golden bytes and ``struct``: sees exactly what the runtime writes."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def read_exactly(self, count: int) -> bytes:
        while len(self.buffer) < count:
            self.buffer += await self.stream.receive()
        data = bytes(self.buffer[:count])
        del self.buffer[:count]
        return data

    async def read_frame(self) -> tuple[int, bytes]:
        conn_id, length = struct.unpack(">II", await self.read_exactly(8))
        return conn_id, await self.read_exactly(length)

    async def read_call(self) -> tuple[int, str, bytes]:
        """Read one whole ttrpc request on conn 1 (possibly split into several frames)."""
        conn_id, data = await self.read_frame()
        assert conn_id == 1
        length, stream_id, kind, flags = struct.unpack(">IIBB", data[:10])
        assert (kind, flags) == (1, 0)
        while len(data) < 10 + length:
            more_conn, more = await self.read_frame()
            assert more_conn == 1
            data += more
        envelope = request_pb2.Request.FromString(data[10:])
        assert envelope.service == "nri.pkg.api.v1alpha1.Plugin"
        return stream_id, envelope.method, envelope.payload

    async def at_eof(self) -> bool:
        try:
            self.buffer += await self.stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
            return True
        return False


async def _register_golden(path: Path) -> tuple[RawPeer, list[bytes]]:
    """Register as ``90-dra-cpu`` with golden bytes; return the peer and Synchronize payloads."""
    peer = RawPeer(await anyio.connect_unix(path))
    await peer.stream.send(GOLDEN_REGISTER_SOCKET)
    frames = [await peer.read_frame(), await peer.read_frame()]
    conn2 = [payload for conn_id, payload in frames if conn_id == 2]
    conn1 = [payload for conn_id, payload in frames if conn_id == 1]
    assert [struct.pack(">II", 2, len(p)) + p for p in conn2] == [GOLDEN_REGISTER_OK]
    (configure,) = conn1
    assert configure[4:10] == b"\0\0\0\x01\x01\x00"  # stream 1, request, no flags
    await peer.stream.send(GOLDEN_CONFIGURE_REPLY)
    syncs: list[bytes] = []
    while True:
        stream_id, method, payload = await peer.read_call()
        assert method == "Synchronize"
        syncs.append(payload)
        if not g.SynchronizeRequest.FromString(payload).more:
            await peer.stream.send(_empty_reply(1, stream_id))
            return peer, syncs
        more = framing.response_message(
            stream_id, g.SynchronizeResponse(more=True).SerializeToString()
        )
        await peer.stream.send(b"".join(framing.mux_frames(1, more)))


@pytest.mark.anyio
async def test_golden_plugin_gets_pinned_then_garbage(socket_path: Path) -> None:
    async with open_fake_runtime(socket_path) as runtime:
        pod = runtime.add_pod()
        with anyio.fail_after(STEP):
            peer, _ = await _register_golden(socket_path)
            info = await runtime.wait_plugin(STEP)
        assert (info.name, info.index, info.events) == ("dra-cpu", "90", PINNING_EVENTS)
        app = runtime.new_container(pod, "app", env=[claim_env("u", "2-3")])
        replies: list[g.CreateContainerResponse] = []

        async def create() -> None:
            replies.append(await runtime.create_container(pod, app))

        with anyio.fail_after(STEP):
            async with anyio.create_task_group() as tg:
                tg.start_soon(create)
                stream_id, method, payload = await peer.read_call()
                assert (stream_id, method) == (5, "CreateContainer")
                assert g.CreateContainerRequest.FromString(payload).container.id == app.id
                await peer.stream.send(GOLDEN_CREATE_REPLY_STREAM5)
        assert runtime.containers[app.id].cpus == "2-3"
        assert replies[0].adjust.linux.resources.cpu.cpus == "2-3"

        with anyio.fail_after(STEP):
            await runtime.send_garbage(b"\xde\xad\xbe\xef\x00")
            assert await peer.read_exactly(5) == b"\xde\xad\xbe\xef\x00"
        assert runtime.notes("garbage")[0].detail == "de ad be ef 00"
        await peer.stream.aclose()


@pytest.mark.anyio
async def test_oversized_frame_declares_one_byte_too_many(socket_path: Path) -> None:
    async with open_fake_runtime(socket_path) as runtime:
        with anyio.fail_after(STEP):
            peer, _ = await _register_golden(socket_path)
            await runtime.wait_plugin(STEP)
        written: list[int] = []

        async def oversized() -> None:
            written.append(await runtime.send_oversized_frame())

        with anyio.fail_after(STEP):
            async with anyio.create_task_group() as tg:
                tg.start_soon(oversized)
                header = await peer.read_exactly(8)
                assert header == _hex("00 00 00 01 00 40 00 0b")  # conn 1, 4194315 bytes
                assert await peer.read_exactly(1000) == bytes(1000)
                await peer.stream.aclose()  # a plugin refuses the frame and hangs up
            await runtime.wait_plugin_gone(STEP)
        assert 8 + 1000 <= written[0] < 8 + framing.MUX_MAX_PAYLOAD + 1
        assert runtime.notes("oversized-frame")[0].detail == "conn 1, 4194315 bytes"


@pytest.mark.anyio
async def test_restart_closes_relistens_and_resyncs(socket_path: Path) -> None:
    async with open_fake_runtime(socket_path) as runtime:
        pod = runtime.add_pod()
        kept = runtime.add_container(pod, "kept", cpus="2-3")
        with anyio.fail_after(STEP):
            peer, first_sync = await _register_golden(socket_path)
            await runtime.wait_plugin(STEP)

        async def restart() -> None:
            await runtime.restart(downtime=0.3)

        with anyio.fail_after(STEP):
            async with anyio.create_task_group() as tg:
                tg.start_soon(restart)
                assert await peer.at_eof()
                await peer.stream.aclose()
                await anyio.sleep(0.1)
                assert not await anyio.Path(socket_path).exists()  # down: nothing listens
                with pytest.raises(FileNotFoundError):
                    await anyio.connect_unix(socket_path)
        assert await anyio.Path(socket_path).is_socket()
        with anyio.fail_after(STEP):
            again, second_sync = await _register_golden(socket_path)
            info = await runtime.wait_plugin(STEP)
        assert (info.connection, runtime.connections) == (2, 2)
        (sync,) = [g.SynchronizeRequest.FromString(p) for p in second_sync]
        assert [(c.id, c.linux.resources.cpu.cpus) for c in sync.containers] == [(kept.id, "2-3")]
        assert second_sync == first_sync  # the same table, re-sent after the restart
        assert [n.kind for n in runtime.notes() if n.kind in ("restart", "listening")] == [
            "listening",
            "restart",
            "listening",
        ]
        await again.stream.aclose()


@pytest.mark.anyio
async def test_big_synchronize_goes_out_as_4096_then_the_rest(socket_path: Path) -> None:
    async with open_fake_runtime(socket_path) as runtime:
        pod = runtime.add_pod()
        runtime.add_container(pod, "big", env=["BLOB=" + "y" * 5000])
        with anyio.fail_after(STEP):
            peer = RawPeer(await anyio.connect_unix(socket_path))
            await peer.stream.send(GOLDEN_REGISTER_SOCKET)
            while (frame := await peer.read_frame())[0] != 1:
                pass
            await peer.stream.send(GOLDEN_CONFIGURE_REPLY)
            head_conn, head = await peer.read_frame()
            rest_conn, rest = await peer.read_frame()
        length, stream_id, kind, _flags = struct.unpack(">IIBB", head[:10])
        assert (head_conn, rest_conn, stream_id, kind) == (1, 1, 3, 1)
        assert len(head) == 4096
        assert len(rest) == 10 + length - 4096 > 0
        envelope = request_pb2.Request.FromString((head + rest)[10:])
        assert envelope.method == "Synchronize"
        assert frame[0] == 1
        await peer.stream.aclose()


@pytest.mark.anyio
async def test_strict_framing_drops_a_plugin_that_sends_a_frame_go_cannot_read(
    socket_path: Path,
) -> None:
    padded = g.ConfigureResponse(events=PINNING_EVENTS).SerializeToString()
    padded += b"\x7a\xa0\x27" + bytes(5024)  # unknown field 15 (bytes), 5024 long: skipped
    reply = framing.response_message(1, padded)
    assert len(reply) > 4096
    one_frame = struct.pack(">II", 1, len(reply)) + reply
    async with open_fake_runtime(socket_path) as runtime:
        with anyio.fail_after(STEP):
            peer = RawPeer(await anyio.connect_unix(socket_path))
            await peer.stream.send(GOLDEN_REGISTER_SOCKET)
            await peer.read_frame()
            await peer.read_frame()
            await peer.stream.send(one_frame)
            await runtime.wait_plugin_gone(STEP)
            await peer.stream.aclose()
        (violation,) = runtime.notes("violation")
        assert "ENOMEM" in violation.detail
        # The same reply framed as Go frames it is accepted.
        with anyio.fail_after(STEP):
            peer = RawPeer(await anyio.connect_unix(socket_path))
            await peer.stream.send(GOLDEN_REGISTER_SOCKET)
            await peer.read_frame()
            await peer.read_frame()
            await peer.stream.send(b"".join(framing.mux_frames(1, reply)))
            stream_id, method, _ = await peer.read_call()
            assert (stream_id, method) == (3, "Synchronize")
            await peer.stream.send(_empty_reply(1, stream_id))
            info = await runtime.wait_plugin(STEP)
        assert info.events == PINNING_EVENTS
        await peer.stream.aclose()


@pytest.mark.anyio
async def test_registration_timeout_closes_a_silent_plugin(socket_path: Path) -> None:
    async with open_fake_runtime(socket_path, registration_timeout=0.3) as runtime:
        with anyio.fail_after(STEP):
            peer = RawPeer(await anyio.connect_unix(socket_path))
            assert await peer.at_eof()
            await runtime.wait_plugin_gone(STEP)
        assert [n.detail for n in runtime.notes("closed")] == ["plugin registration timed out"]
        assert peer.buffer == b""  # nothing was sent before the close
        await peer.stream.aclose()


def test_fake_runtime_shares_no_code_with_the_daemon() -> None:
    # Importing the fake pulls in neither our wire code, nor our generated code, nor betterproto2.
    probe = (
        "import sys, dracpu.sim.fake_runtime; "
        "print(sorted(m for m in sys.modules if m.startswith(('dracpu.wire', 'dracpu._gen', "
        "'betterproto2'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
