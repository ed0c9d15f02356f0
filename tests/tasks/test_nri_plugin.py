"""The NRI plugin task against the fake runtime (an independent peer with its own framing) and a
real state owner restored from the sysfs tree of the ``dual-socket-smt2`` machine.

Each test asserts what the runtime ends up with: the cpusets in its container table, the calls
and the bytes it saw, and whether the plugin stayed connected.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.memory import MemoryObjectSendStream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dracpu.config import Config
from dracpu.core.commands import (
    Command,
    DeviceResult,
    PrepareClaim,
    UnprepareClaim,
)
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import (
    ClaimPrepared,
)
from dracpu.core.state import NodeState
from dracpu.sim import _nri_framing as framing
from dracpu.sim._pb2.nri.v1alpha1 import api_pb2 as pb
from dracpu.sim.fake_runtime import (
    FakeContainer,
    FakePod,
    FakeRuntime,
    PluginFailedError,
    claim_env,
    open_fake_runtime,
)
from dracpu.sim.topologies import FIXTURES, build_topology
from dracpu.tasks import nri_plugin
from dracpu.tasks.claim_recheck import ClaimReader
from dracpu.tasks.nri_link import NriLink
from dracpu.tasks.state_owner import Request, StateOwner, create_request_stream, request
from dracpu.wire.ttrpc import Code
from tests.fixtures import scratch_dir
from tests.tasks.both_backends import anyio_backend  # noqa: F401 (a fixture)
from tests.tasks.owner_files import Files, host_root

pytestmark = pytest.mark.anyio


NODE = "node-a"
RESERVED = CpuSet.parse("0,32")
TOPOLOGY = build_topology(FIXTURES["dual-socket-smt2"])  # 64 CPUs, NUMA n = cpus 8n..8n+7 (+32)


ALLOCATABLE = "1-31,33-63"
UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"
UID_C = "cccccccc-0000-4000-8000-000000000003"
UID_D = "dddddddd-0000-4000-8000-000000000004"
UNPREPARED = "eeeeeeee-0000-4000-8000-000000000005"
CLAIM_A = ((UID_A, "1-2,33-34"),)  # on NUMA node 0


def fast_delays() -> Iterator[float]:
    return itertools.repeat(0.01)


async def until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:  # noqa: ASYNC109
    with anyio.move_on_after(timeout):
        while not predicate():  # noqa: ASYNC110 (polls state that has no event of its own)
            await anyio.sleep(0.005)
        return
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Node:
    runtime: FakeRuntime
    owner: StateOwner
    send: MemoryObjectSendStream[Request[Command]]
    link: NriLink
    files: Files
    socket: Path
    tg: anyio.abc.TaskGroup
    claims: dict[str, CpuSet] = field(default_factory=dict)
    api: ClaimReader | None = None  # where the plugin reads claims again (None: never)

    @property
    def state(self) -> NodeState:
        return self.owner.state

    @property
    def pool(self) -> str:
        return str(self.state.shared_pool)

    async def prepare(
        self,
        uid: str,
        device: str = "cpudevnuma000",
        count: int = 4,
        cpuset: str | None = None,
        pods: frozenset[str] = frozenset(),
    ) -> CpuSet:
        """Prepare a grouped claim (``default/claim-<uid[:4]>``); ``cpuset``: the CPUs an
        external allocator chose; ``pods``: the pods it is reserved for."""
        chosen = None if cpuset is None else CpuSet.parse(cpuset)
        if chosen is not None:
            self.claims[uid] = chosen
        result = DeviceResult("cpus", NODE, device, consumed_cpus=count, cpuset=chosen)
        command = PrepareClaim(uid, "default", f"claim-{uid[:4]}", (result,), pod_uids=pods)
        prepared = await request(self.send, command)
        assert isinstance(prepared, ClaimPrepared)
        self.claims[uid] = prepared.cpus
        return prepared.cpus

    async def unprepare(self, uid: str) -> None:
        await request(self.send, UnprepareClaim(uid))

    async def hold(self, uid: str, device: str) -> threading.Event:
        """Start preparing ``uid`` and keep the owner busy in its CDI write (in its worker
        thread) until the returned event is set (at the latest when the node closes)."""
        gate = self.files.claim_gates[uid] = threading.Event()
        self.tg.start_soon(partial(self.prepare, uid, device))
        await until(lambda: uid in self.files.held_claims, f"the owner held on claim {uid}")
        return gate

    def plugin(
        self,
        socket: Path | None = None,
        *,
        start_timeout: float = 5.0,
        leaving_pod: str | None = None,
    ) -> partial[Coroutine[Any, Any, None]]:
        """The NRI plugin task of this node (its link and owner, fast reconnects) for ``socket``
        (default: the fake runtime's), ready to start."""
        config = Config(node_name=NODE, nri_socket=socket or self.socket)
        return partial(
            nri_plugin.run,
            config,
            self.send.clone(),
            lambda: self.owner.state,
            link=self.link,
            claims=self.api,
            delays=fast_delays,
            start_timeout=start_timeout,
            leaving_pod=leaving_pod,
        )

    async def start_plugin(self, *, leaving_pod: str | None = None) -> None:
        await self.tg.start(self.plugin(leaving_pod=leaving_pod))

    def exclusive(self, pod: FakePod, name: str, uid: str) -> FakeContainer:
        return self.runtime.new_container(pod, name, env=[claim_env(uid, str(self.claims[uid]))])

    def table(self) -> dict[str, tuple[str, str]]:
        return {c.id: (c.cpus, c.mems) for c in self.runtime.containers.values()}

    def assert_shared_at(self, cpus: str) -> None:
        table = self.table()
        assert self.state.shared, "no shared container to check"  # never pass vacuously
        for cid in self.state.shared:
            assert table[cid][0] == cpus, f"shared container {cid} runs on {table[cid][0]}"


@asynccontextmanager
async def open_node(
    *,
    setup: Callable[[FakeRuntime], object] | None = None,
    prepared: tuple[tuple[str, str], ...] = (),
    start: bool = True,
    pin_memory: bool = True,
    api: ClaimReader | None = None,
    **runtime_options: object,
) -> AsyncIterator[Node]:
    link = NriLink()
    send: MemoryObjectSendStream[Request[Command]]
    send, receive = create_request_stream()
    with scratch_dir("dracpu-nri-") as tmp:
        config = Config(
            node_name=NODE,
            host_root=host_root("dual-socket-smt2"),
            reserved_cpus=RESERVED,
            memory_pinning=pin_memory,
            cdi_dir=tmp / "cdi",
            state_dir=tmp / "state",
            kubelet_root_dir=tmp / "kubelet",
        )
        files = Files(config)
        owner = StateOwner(config, receive, container_updates=link.submit, files=files)
        socket = tmp / "nri.sock"
        async with (
            send,
            open_fake_runtime(socket, **runtime_options) as runtime,  # type: ignore[arg-type]
            anyio.create_task_group() as tg,
        ):
            await tg.start(owner.run)
            node = Node(runtime, owner, send, link, files, socket, tg, api=api)
            if setup is not None:
                setup(runtime)
            for uid, cpuset in prepared:
                await node.prepare(uid, cpuset=cpuset)
            if start:
                await node.start_plugin()
                await runtime.wait_plugin(10)
            try:
                yield node
            finally:
                for gate in files.claim_gates.values():
                    gate.set()  # no worker thread left waiting
            tg.cancel_scope.cancel()


def add_shared(runtime: FakeRuntime, count: int, cpus: str = "0-63") -> list[str]:
    pod = runtime.add_pod("shared")
    return [runtime.add_container(pod, f"s{i}", cpus=cpus).id for i in range(count)]


# --- registration, configuration, synchronization -------------------------------------------------


async def test_registers_and_subscribes_with_mask_0x6c8() -> None:
    async with open_node() as node:
        info = node.runtime.plugin
        assert info is not None
        assert (info.index, info.name) == ("00", "dra.cpu")
        assert info.requested_events == 0x6C8 == info.events
        # The NRI release our proto follows, as containerd/nri's stub sends its module version:
        # the runtime logs it instead of "NRI version unknown".
        assert info.nri_version == "v0.12.2"
        assert [n.detail for n in node.runtime.notes("registered")] == [
            "00-dra.cpu (with NRI version v0.12.2)"
        ]
        register = node.runtime.calls("RegisterPlugin")[0]
        assert register.request.SerializeToString(deterministic=True) == bytes.fromhex(
            "0a076472612e6370751202" + "3030" + "1a07" + b"v0.12.2".hex()
        )
        configure = node.runtime.calls("Configure")[0]
        assert configure.outcome == "ok"
        assert configure.response is not None
        assert configure.response.SerializeToString(deterministic=True) == bytes.fromhex("10c80d")
        status = node.link.status()
        assert status.connected
        assert status.synchronized
        assert (status.runtime_name, status.runtime_version) == ("containerd", "2.3.0")
        assert status.nri_version == "v0.12.0"
        assert not status.unsolicited_updates  # containerd 2.3.0 embeds NRI v0.12.0
        assert status.connections == 1


async def test_synchronize_repins_preexisting_containers() -> None:
    def setup(runtime: FakeRuntime) -> None:
        add_shared(runtime, 3)
        pod = runtime.add_pod("guaranteed")
        runtime.add_container(
            pod, "db", container_id="exclusive", env=[claim_env(UID_A, "1-2,33-34")]
        )
        runtime.add_container(pod, "spoof", container_id="spoofed", env=[claim_env(UID_B, "3")])
        runtime.add_container(pod, "bad", container_id="malformed", env=[f"DRA_CPUSET_{UID_A}=x"])

    async with open_node(setup=setup, prepared=CLAIM_A) as node:
        table = node.table()
        assert table["exclusive"] == ("1-2,33-34", "0")  # its claim's CPUs, NUMA node 0
        pool = "3-31,35-63"
        assert node.pool == pool
        for cid, (cpus, _) in table.items():
            if cid != "exclusive":
                assert cpus == pool, cid  # shared, spoofed and malformed: all in the pool
        assert node.state.shared == {cid for cid in table if cid != "exclusive"}


async def test_synchronize_leaves_out_the_pod_of_the_dracpu_that_handed_over() -> None:
    """CRI-O lists the previous dracpu's container while it stops, and an update of it that
    runc refuses fails the whole Synchronize (docs/architecture.md, "What the real components
    found", 6): the successor neither pins nor records it."""
    leaving = "0f0f0f0f-0000-4000-8000-000000000001"
    pods: dict[str, str] = {}

    def setup(runtime: FakeRuntime) -> None:
        pods["shared"] = add_shared(runtime, 2, cpus="0-63")[0]
        old = runtime.add_pod("dracpu-old", namespace="dracpu", uid=leaving)
        pods["old"] = runtime.add_container(old, "dracpu", cpus="1-63").id

    async with open_node(setup=setup, prepared=CLAIM_A, start=False) as node:
        await node.start_plugin(leaving_pod=leaving)
        await node.runtime.wait_plugin(10)
        [sync] = node.runtime.calls("Synchronize")
        assert isinstance(sync.response, pb.SynchronizeResponse)
        updated = {u.container_id for u in sync.response.update}
        assert pods["shared"] in updated
        assert pods["old"] not in updated
        assert pods["old"] not in node.state.containers
        assert node.table()[pods["old"]] == ("1-63", "")  # untouched


async def test_synchronize_in_parts_answers_more_without_updates() -> None:
    async with open_node(setup=lambda rt: add_shared(rt, 7), sync_chunk=2) as node:
        replies: list[pb.SynchronizeResponse] = []
        for call in node.runtime.calls("Synchronize"):
            assert isinstance(call.response, pb.SynchronizeResponse)
            replies.append(call.response)
        assert [(r.more, len(r.update)) for r in replies] == [(True, 0)] * 3 + [(False, 7)]
        node.assert_shared_at(ALLOCATABLE)


# --- container events ----------------------------------------------------------------------------


async def test_exclusive_create_pins_claim_and_shrinks_shared_pool_in_same_reply() -> None:
    async with open_node(setup=lambda rt: add_shared(rt, 200)) as node:
        node.assert_shared_at(ALLOCATABLE)
        cpus = await node.prepare(UID_A, "cpudevnuma001", 6)
        assert cpus <= CpuSet.parse("8-15,40-47")
        pod = node.runtime.add_pod("guaranteed")
        ctr = node.exclusive(pod, "app", UID_A)
        reply = await node.runtime.create_container(pod, ctr)
        assert reply.adjust.linux.resources.cpu.cpus == str(cpus)
        assert reply.adjust.linux.resources.cpu.mems == "1"
        pool = str(CpuSet.parse(ALLOCATABLE) - cpus)
        assert {u.container_id for u in reply.update} == node.state.shared
        assert {u.linux.resources.cpu.cpus for u in reply.update} == {pool}
        assert len(reply.update) == 200
        assert node.table()[ctr.id] == (str(cpus), "1")
        node.assert_shared_at(pool)
        # A new shared container gets the shrunk pool.
        shared = node.runtime.new_container(pod, "sidecar")
        reply = await node.runtime.create_container(pod, shared)
        assert reply.adjust.linux.resources.cpu.cpus == pool
        assert reply.adjust.linux.resources.cpu.mems == ""
        assert not reply.update


async def test_memory_pinning_off_leaves_mems_alone() -> None:
    async with open_node(pin_memory=False) as node:
        await node.prepare(UID_A)
        pod = node.runtime.add_pod("guaranteed")
        ctr = node.exclusive(pod, "app", UID_A)
        reply = await node.runtime.create_container(pod, ctr)
        assert reply.adjust.linux.resources.cpu.cpus == str(node.claims[UID_A])
        assert reply.adjust.linux.resources.cpu.mems == ""  # proto3: not on the wire at all
        assert node.table()[ctr.id] == (str(node.claims[UID_A]), "")


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ([claim_env(UID_A, "40-43")], "spoofed DRA_CPUSET env"),
        ([claim_env(UNPREPARED, "1")], "has not prepared"),
        ([f"DRA_CPUSET_{UID_A}=1-2,33-x"], "malformed env entry"),
        (["DRA_CPUSET_not-a-uid=1"], "not a claim UID"),
    ],
)
async def test_unverifiable_claims_fail_creation(env: list[str], reason: str) -> None:
    async with open_node(prepared=CLAIM_A) as node:
        pod = node.runtime.add_pod("attacker")
        ctr = node.runtime.new_container(pod, "app", env=env)
        with pytest.raises(PluginFailedError) as failed:
            await node.runtime.create_container(pod, ctr)
        assert failed.value.code == Code.FAILED_PRECONDITION
        assert reason in failed.value.message
        assert ctr.id not in node.runtime.containers
        assert node.runtime.plugin is not None  # still connected: a refusal is not fatal


async def test_a_claim_of_unknown_pods_is_shared_by_its_first_pods_containers_only() -> None:
    async with open_node(prepared=CLAIM_A) as node:
        pod = node.runtime.add_pod("one")
        app = node.exclusive(pod, "app", UID_A)
        await node.runtime.create_container(pod, app)
        sidecar = node.exclusive(pod, "sidecar", UID_A)
        await node.runtime.create_container(pod, sidecar)
        assert node.table()[sidecar.id] == node.table()[app.id]
        assert node.table()[app.id][0] == str(node.claims[UID_A])
        other = node.runtime.add_pod("two")
        with pytest.raises(PluginFailedError, match="is used by pod"):
            await node.runtime.create_container(other, node.exclusive(other, "app", UID_A))


async def test_update_container_pins_back_and_stop_and_remove_forget() -> None:
    async with open_node(setup=lambda rt: add_shared(rt, 2), prepared=CLAIM_A) as node:
        pod = node.runtime.add_pod("guaranteed")
        ctr = node.exclusive(pod, "app", UID_A)
        await node.runtime.create_container(pod, ctr)
        shared = sorted(node.state.shared)[0]
        reply = await node.runtime.update_container(shared, cpus="0-63")
        assert [u.container_id for u in reply.update] == [shared]
        assert node.table()[shared][0] == node.pool
        await node.runtime.stop_container(ctr.id)
        assert ctr.id not in node.state.containers
        await node.runtime.remove_container(ctr.id)
        remove = node.runtime.calls("RemoveContainer")
        assert [c.outcome for c in remove] == ["ok"]  # the dedicated v0.12 RPC, no fallback
        assert not node.runtime.calls("StateChange")
        await node.runtime.remove_container(shared)
        assert shared not in node.state.containers


async def test_remove_on_an_old_runtime_arrives_as_state_change() -> None:
    async with open_node(setup=lambda rt: add_shared(rt, 1), runtime_version="2.1.4") as node:
        [cid] = node.state.shared
        await node.runtime.remove_container(cid)
        assert not node.runtime.calls("RemoveContainer")
        assert [c.outcome for c in node.runtime.calls("StateChange")] == ["ok"]
        assert cid not in node.state.containers


# --- widening after Unprepare ---------------------------------------------------------------------


async def _create_then_unprepare(node: Node) -> tuple[str, str]:
    """Shrink the pool with an exclusive container, end it, unprepare: the pools before/after."""
    cpus = await node.prepare(UID_A)
    pod = node.runtime.add_pod("guaranteed")
    ctr = node.exclusive(pod, "app", UID_A)
    await node.runtime.create_container(pod, ctr)
    narrow = str(CpuSet.parse(ALLOCATABLE) - cpus)
    node.assert_shared_at(narrow)
    await node.runtime.remove_container(ctr.id)
    node.assert_shared_at(narrow)  # stop/remove: the claim still holds its CPUs
    await node.unprepare(UID_A)
    return narrow, ALLOCATABLE


async def test_unprepare_widens_at_once_on_a_fixed_runtime() -> None:
    async with open_node(setup=lambda rt: add_shared(rt, 5), nri_version="v0.12.1") as node:
        assert node.link.status().unsolicited_updates
        _, wide = await _create_then_unprepare(node)
        await until(
            lambda: bool(node.runtime.calls("UpdateContainers", caller="plugin")),
            "an unsolicited UpdateContainers",
        )
        [call] = node.runtime.calls("UpdateContainers", caller="plugin")
        assert call.outcome == "ok"
        assert isinstance(call.request, pb.UpdateContainersRequest)
        assert {u.container_id for u in call.request.update} == node.state.shared
        node.assert_shared_at(wide)
        # The fake logs the call before it answers; the link counts it once the answer is read.
        await node.link.settled()
        assert node.link.status().unsolicited_sent == 1


async def test_unprepare_defers_widening_to_the_next_event_on_an_older_runtime() -> None:
    async with open_node(setup=lambda rt: add_shared(rt, 5)) as node:  # containerd 2.3.0
        narrow, wide = await _create_then_unprepare(node)
        await anyio.sleep(0.1)
        assert not node.runtime.calls("UpdateContainers", caller="plugin")
        node.assert_shared_at(narrow)  # nothing sent behind the runtime's back
        pod = node.runtime.add_pod("next")
        reply = await node.runtime.create_container(pod, node.runtime.new_container(pod, "x"))
        assert reply.adjust.linux.resources.cpu.cpus == wide
        assert len(reply.update) == 5
        node.assert_shared_at(wide)


async def test_failed_unsolicited_update_is_resent_at_the_next_event() -> None:
    async with open_node(setup=lambda rt: add_shared(rt, 4), nri_version="v0.12.2") as node:
        cpus = await node.prepare(UID_A)
        pod = node.runtime.add_pod("guaranteed")
        ctr = node.exclusive(pod, "app", UID_A)
        await node.runtime.create_container(pod, ctr)
        await node.runtime.remove_container(ctr.id)
        # A container vanishes behind our back: the fake runtime fails the whole call for it.
        vanished = sorted(node.state.shared)[0]
        del node.runtime.containers[vanished]
        await node.unprepare(UID_A)
        await until(lambda: node.link.status().unsolicited_failed == 1, "the failed update")
        # The owner was told (InvalidateContainers): the next reply carries every shared one.
        other = node.runtime.add_pod("next")
        new = node.runtime.new_container(other, "x")
        reply = await node.runtime.create_container(other, new)
        resent = {u.container_id for u in reply.update}
        assert vanished in resent
        assert resent == node.state.shared - {new.id}
        assert {u.linux.resources.cpu.cpus for u in reply.update} == {ALLOCATABLE}
        assert cpus <= CpuSet.parse(node.pool)  # the claim's CPUs are shared again


async def test_unsolicited_update_racing_a_newer_event_reply_ends_at_the_newest_cpuset() -> None:
    """The owner decides Unprepare C (widen), then Prepare B and Create B (shrink), but the
    widening UpdateContainers waits for the runtime's lock while the Create holds it, so the
    runtime applies it *after* the Create's reply: the plugin must send the newest cpusets
    again, or the shared containers keep running on B's CPUs."""
    async with open_node(setup=lambda rt: add_shared(rt, 3), nri_version="v0.12.1") as node:
        gate = await _claim_c_released_by_its_pod_and_the_owner_held(node)
        node.tg.start_soon(node.unprepare, UID_C)
        await until(lambda: node.owner.statistics().queue_depth == 1, "Unprepare C queued")
        node.tg.start_soon(partial(node.prepare, UID_B, "cpudevnuma001", cpuset="8-9,40-41"))
        await until(lambda: node.owner.statistics().queue_depth == 2, "Prepare B queued")
        pod_b = node.runtime.add_pod("b")
        created = anyio.Event()

        async def create_b() -> None:  # holds the runtime's lock until our reply
            await node.runtime.create_container(pod_b, node.exclusive(pod_b, "app", UID_B))
            created.set()

        node.tg.start_soon(create_b)
        await until(lambda: node.owner.statistics().queue_depth == 3, "Create B queued")
        gate.set()
        await created.wait()
        await _settled(node)
        held = CpuSet.union(node.claims[uid] for uid in (UID_B, UID_D))
        assert CpuSet.parse(node.pool) == CpuSet.parse(ALLOCATABLE) - held


async def test_event_reply_racing_a_queued_unsolicited_update() -> None:
    """The owner answers Create A, then decides Unprepare C (widen) before the handler of
    Create A resumes: whichever reaches the runtime last, it ends at the owner's cpusets."""
    async with open_node(setup=lambda rt: add_shared(rt, 3), nri_version="v0.12.1") as node:
        await node.prepare(UID_A)
        gate = await _claim_c_released_by_its_pod_and_the_owner_held(node)
        pod_a = node.runtime.add_pod("a")
        created = anyio.Event()

        async def create_a() -> None:
            await node.runtime.create_container(pod_a, node.exclusive(pod_a, "app", UID_A))
            created.set()

        node.tg.start_soon(create_a)
        await until(lambda: node.owner.statistics().queue_depth == 1, "Create A queued")
        node.tg.start_soon(node.unprepare, UID_C)
        await until(lambda: node.owner.statistics().queue_depth == 2, "Unprepare C queued")
        gate.set()
        await created.wait()
        await _settled(node)
        held = CpuSet.union(node.claims[uid] for uid in (UID_A, UID_D))
        assert CpuSet.parse(node.pool) == CpuSet.parse(ALLOCATABLE) - held


async def _claim_c_released_by_its_pod_and_the_owner_held(node: Node) -> threading.Event:
    """Claim C prepared, its container created and removed (an Unprepare C widens the shared
    containers), then the owner held in Prepare D's CDI write: the gate releases it."""
    await node.prepare(UID_C, "cpudevnuma002")
    pod_c = node.runtime.add_pod("c")
    ctr_c = node.exclusive(pod_c, "app", UID_C)
    await node.runtime.create_container(pod_c, ctr_c)
    await node.runtime.remove_container(ctr_c.id)
    return await node.hold(UID_D, "cpudevnuma003")


async def _settled(node: Node) -> None:
    """Wait until every shared container runs on the owner's pool, then check it stays so."""
    await until(
        lambda: all(node.table()[cid][0] == node.pool for cid in node.state.shared),
        "the shared containers at the owner's pool",
    )
    await anyio.sleep(0.2)  # a late UpdateContainers must not undo it
    node.assert_shared_at(node.pool)


# --- a pin lost while a container starts ----------------------------------------------------------


async def _narrowed_while_starting(node: Node) -> tuple[str, str]:
    """A shared container created on the whole pool, its task created (containerd's
    StartContainer, before RUNNING), then a claim prepared and its container created: the
    reply's narrowing of the starting container is lost. Its id and the narrow pool."""
    pod = node.runtime.add_pod("shared")
    starting = node.runtime.new_container(pod, "starting")
    await node.runtime.create_container(pod, starting)
    assert node.table()[starting.id][0] == ALLOCATABLE
    node.runtime.create_task(starting.id)
    await node.prepare(UID_A)
    claimed = node.runtime.add_pod("guaranteed")
    await node.runtime.create_container(claimed, node.exclusive(claimed, "app", UID_A))
    assert [n.detail for n in node.runtime.notes("update-lost")] == [
        f"{starting.id}: starting, not running yet"
    ]
    assert node.table()[starting.id][0] == ALLOCATABLE  # on the claim's CPUs
    return starting.id, node.pool


async def test_a_pin_lost_while_starting_is_sent_again_after_the_start() -> None:
    async with open_node(nri_version="v0.12.1") as node:
        cid, narrow = await _narrowed_while_starting(node)
        await node.runtime.start_container(cid)
        [started] = node.runtime.calls("PostStartContainer")
        assert started.outcome == "ok"  # the dedicated v0.12 RPC, no StateChange fallback
        await until(
            lambda: bool(node.runtime.calls("UpdateContainers", caller="plugin")),
            "the unsolicited UpdateContainers",
        )
        [call] = node.runtime.calls("UpdateContainers", caller="plugin")
        assert isinstance(call.request, pb.UpdateContainersRequest)
        assert [(u.container_id, u.linux.resources.cpu.cpus) for u in call.request.update] == [
            (cid, narrow)
        ]
        assert node.table()[cid][0] == narrow


async def test_a_pin_lost_while_starting_goes_in_the_next_reply_on_an_older_runtime() -> None:
    async with open_node(runtime_version="2.1.4") as node:  # NRI v0.9: StateChange, no unsolicited
        cid, narrow = await _narrowed_while_starting(node)
        await node.runtime.start_container(cid)
        assert not node.runtime.calls("PostStartContainer")
        [change] = node.runtime.calls("StateChange")
        assert isinstance(change.request, pb.StateChangeEvent)
        assert change.request.event == pb.POST_START_CONTAINER
        assert node.table()[cid][0] == ALLOCATABLE  # nothing sent behind the runtime's back
        pod = node.runtime.add_pod("next")
        reply = await node.runtime.create_container(pod, node.runtime.new_container(pod, "x"))
        assert [(u.container_id, u.linux.resources.cpu.cpus) for u in reply.update] == [
            (cid, narrow)
        ]
        assert node.table()[cid][0] == narrow


async def test_a_start_after_no_newer_pin_sends_nothing() -> None:
    async with open_node(setup=lambda rt: add_shared(rt, 2), nri_version="v0.12.1") as node:
        pod = node.runtime.add_pod("shared")
        ctr = node.runtime.new_container(pod, "app")
        await node.runtime.create_container(pod, ctr)
        before = node.state
        await node.runtime.start_container(ctr.id)
        assert [c.outcome for c in node.runtime.calls("PostStartContainer")] == ["ok"]
        await node.link.settled()
        assert node.state is before  # no new decision, no record changed
        assert not node.runtime.calls("UpdateContainers", caller="plugin")
        assert node.table()[ctr.id][0] == ALLOCATABLE


# --- the ordering property, over random interleavings -------------------------------------------

# A step: (what, which claim, run it beside the next steps instead of awaiting it). A prepare run
# beside holds the owner in its CDI write for a while, so the steps after it queue up behind it
# and their answers, replies and unsolicited updates interleave.
_STEPS = st.lists(
    st.tuples(
        st.sampled_from(["prepare", "create", "remove", "unprepare", "shared"]),
        st.integers(0, 2),
        st.booleans(),
    ),
    min_size=4,
    max_size=12,
)
_DEVICES = ("cpudevnuma000", "cpudevnuma001", "cpudevnuma002")
_CLAIMS = (UID_A, UID_B, UID_C)


async def _release_after(gate: threading.Event, seconds: float) -> None:
    await anyio.sleep(seconds)
    gate.set()


async def _play(steps: list[tuple[str, int, bool]], policy: str) -> None:
    """Run ``steps`` against a fixed runtime (unsolicited updates on) whose UpdateContainers
    waits for the event lock (``wait``, containerd) or does not (``serve``); at the end every
    container must run on the owner's last decision for it."""
    async with open_node(
        setup=lambda rt: add_shared(rt, 3), nri_version="v0.12.1", updates_while_busy=policy
    ) as node:
        prepared: set[int] = set()
        running: dict[int, FakeContainer] = {}
        pods: dict[int, FakePod] = {}
        busy: set[int] = set()

        async def one(what: str, k: int, beside: bool) -> None:
            try:
                if what == "prepare":
                    if beside:
                        gate = node.files.claim_gates[_CLAIMS[k]] = threading.Event()
                        tg.start_soon(_release_after, gate, 0.05)
                    await node.prepare(_CLAIMS[k], _DEVICES[k], count=2)
                elif what == "create":  # a claim is its pod's until Unprepare: one pod each
                    if k not in pods:
                        pods[k] = node.runtime.add_pod(f"claim-{k}")
                    pod = pods[k]
                    running[k] = node.exclusive(pod, "app", _CLAIMS[k])
                    await node.runtime.create_container(pod, running[k])
                elif what == "remove":
                    await node.runtime.remove_container(running.pop(k).id)
                else:
                    await node.unprepare(_CLAIMS[k])
                    pods.pop(k, None)
            finally:
                busy.discard(k)

        async with anyio.create_task_group() as tg:
            for what, k, beside in steps:
                if what == "shared":
                    pod = node.runtime.add_pod("more")
                    ctr = node.runtime.new_container(pod, "s")
                    tg.start_soon(partial(node.runtime.create_container, pod, ctr))
                    continue
                if k in busy:
                    continue
                ready = {
                    "prepare": k not in prepared,
                    "create": k in prepared and k not in running,
                    "remove": k in running,
                    "unprepare": k in prepared and k not in running,
                }[what]
                if not ready:
                    continue
                if what == "prepare":
                    prepared.add(k)
                elif what == "unprepare":
                    prepared.discard(k)
                busy.add(k)
                if beside:
                    tg.start_soon(one, what, k, beside)
                else:
                    await one(what, k, beside)

        # Every container ends on the owner's last decision for it (prepares alone move no one:
        # the shared containers follow the pool at the next event).
        def decided() -> dict[str, str]:
            return {c: str(r.cpus) for c, r in node.state.containers.items() if r.cpus}

        def applied() -> dict[str, str]:
            return {c: node.table()[c][0] for c in decided()}

        await until(lambda: applied() == decided(), "every container on its last decision")
        await anyio.sleep(0.2)  # a late UpdateContainers must not undo it
        assert applied() == decided()
        for k, container in running.items():
            assert decided()[container.id] == str(node.claims[_CLAIMS[k]])


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("policy", ["wait", "serve"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=_STEPS)
def test_the_last_write_to_each_container_is_the_owners_last_decision(
    backend: str, policy: str, steps: list[tuple[str, int, bool]]
) -> None:
    anyio.run(_play, steps, policy, backend=backend)


# --- failures: the owner, the runtime, the socket -------------------------------------------------


async def test_a_slow_owner_fails_creation_before_the_runtime_gives_up() -> None:
    async with open_node(plugin_timeout=0.8) as node:
        gate = await node.hold(UID_A, "cpudevnuma000")
        pod = node.runtime.add_pod("p")
        ctr = node.runtime.new_container(pod, "app")
        with pytest.raises(PluginFailedError) as failed:
            await node.runtime.create_container(pod, ctr)
        assert failed.value.code == Code.UNAVAILABLE
        assert "did not answer CreateContainer" in failed.value.message
        assert ctr.id not in node.runtime.containers  # not created unpinned
        gate.set()
        await until(lambda: UID_A in node.claims, "the prepare")
        plugin = node.runtime.plugin
        assert plugin is not None
        assert plugin.connection == 1  # answered in time: the runtime kept us


async def _reconnected(node: Node, connection: int) -> None:
    await until(
        lambda: node.runtime.plugin is not None and node.runtime.plugin.connection == connection,
        f"plugin connection {connection}",
    )


async def test_runtime_restart_reconnects_and_resynchronizes() -> None:
    async with open_node(setup=lambda rt: add_shared(rt, 2), nri_version="v0.12.1") as node:
        await node.prepare(UID_A)
        pod = node.runtime.add_pod("guaranteed")
        ctr = node.exclusive(pod, "app", UID_A)
        await node.runtime.create_container(pod, ctr)
        await node.runtime.restart(downtime=0.05)
        late = add_shared(node.runtime, 2)  # started while we were away: unpinned
        await _reconnected(node, 2)
        assert len(node.runtime.calls("Synchronize")) == 2
        assert node.link.status().connections == 2
        assert node.owner.statistics().by_command[("RuntimeDisconnected", "ok")] == 1
        table = node.table()
        for cid in late:
            assert table[cid][0] == node.pool
        assert table[ctr.id] == (str(node.claims[UID_A]), "0")
        node.assert_shared_at(node.pool)


@pytest.mark.parametrize(
    "garbage",
    [
        bytes.fromhex("ffffffffffffffff"),  # a mux frame longer than the limit
        bytes.fromhex("00000001 0000000a 00000000 00000001 0200"),  # a response on conn 1
        bytes.fromhex("00000001 0000000a 00000000 00000002 0100"),  # an even request id
    ],
)
async def test_garbage_drops_the_connection_and_the_plugin_comes_back(garbage: bytes) -> None:
    async with open_node(setup=lambda rt: add_shared(rt, 1)) as node:
        await node.runtime.send_garbage(garbage)
        await _reconnected(node, 2)
        assert "protocol error" in node.link.status().last_error
        await _still_pins(node)


async def test_an_oversized_frame_drops_the_connection_and_the_plugin_comes_back() -> None:
    async with open_node() as node:
        written = await node.runtime.send_oversized_frame()
        assert written < framing.MUX_MAX_PAYLOAD  # refused at the header, not read to the end
        await _reconnected(node, 2)
        await _still_pins(node)


async def _still_pins(node: Node) -> None:
    pod = node.runtime.add_pod("after")
    reply = await node.runtime.create_container(pod, node.runtime.new_container(pod, "x"))
    assert reply.adjust.linux.resources.cpu.cpus == node.pool


async def test_starts_without_a_runtime_and_connects_when_it_comes() -> None:
    async with open_node(start=False) as node:
        missing = node.socket.with_name("later.sock")
        with anyio.fail_after(2):  # ready after start_timeout although nobody listens
            await node.tg.start(node.plugin(missing, start_timeout=0.2))
        status = node.link.status()
        assert not status.connected
        assert f"cannot connect to {missing}" in status.last_error
        async with open_fake_runtime(missing) as runtime:
            info = await runtime.wait_plugin(10)
            assert info.connection == 1
            assert node.link.status().synchronized


# --- a bare runtime end: exact answers to what the fake runtime never sends -----------------------


PLUGIN = "nri.pkg.api.v1alpha1.Plugin"


class BareRuntime:
    """The runtime end of one plugin connection with no NRI logic: send calls, read answers."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.parser = framing.MuxFrameParser()
        self.readers = {
            framing.PLUGIN_SERVICE_CONN: framing.GoChannelReader(),
            framing.RUNTIME_SERVICE_CONN: framing.GoChannelReader(),
        }
        self.queue: deque[tuple[int, framing.TtrpcMessage]] = deque()
        self.next_id = 1

    async def next_message(self, conn_id: int) -> framing.TtrpcMessage:
        """The next message on ``conn_id`` (messages of the other conn stay queued)."""
        while True:
            for item in self.queue:
                if item[0] == conn_id:
                    self.queue.remove(item)
                    return item[1]
            data = await self.stream.receive(65536)
            for frame_conn, payload in self.parser.feed(data):
                self.queue.extend((frame_conn, m) for m in self.readers[frame_conn].feed(payload))

    async def send(self, conn_id: int, message: bytes) -> None:
        await self.stream.send(b"".join(framing.mux_frames(conn_id, message)))

    async def register(self, *, code: int = 0) -> pb.RegisterPluginRequest:
        message = await self.next_message(framing.RUNTIME_SERVICE_CONN)
        envelope = framing.decode_request(message.data)
        assert (message.stream_id, envelope.service, envelope.method) == (
            1,
            "nri.pkg.api.v1alpha1.Runtime",
            "RegisterPlugin",
        )
        assert envelope.timeout_nano > 0
        reply = framing.response_message(1, code=code, message="refused" if code else "")
        await self.send(framing.RUNTIME_SERVICE_CONN, reply)
        return pb.RegisterPluginRequest.FromString(envelope.payload)

    async def start_call(self, method: str, payload: bytes = b"", service: str = PLUGIN) -> int:
        stream_id = self.next_id
        self.next_id += 2
        message = framing.request_message(stream_id, service, method, payload, 2 * 10**9)
        await self.send(framing.PLUGIN_SERVICE_CONN, message)
        return stream_id

    async def answer(self, stream_id: int) -> tuple[int, str, bytes]:
        """The next answer on conn 1, which must be for ``stream_id``: (code, message, payload)."""
        message = await self.next_message(framing.PLUGIN_SERVICE_CONN)
        assert (message.stream_id, message.type) == (stream_id, framing.TYPE_RESPONSE)
        self.raw = message.data
        envelope = framing.decode_response(message.data)
        return envelope.status.code, envelope.status.message, envelope.payload

    async def call(
        self, method: str, payload: bytes = b"", service: str = PLUGIN
    ) -> tuple[int, str, bytes]:
        return await self.answer(await self.start_call(method, payload, service))


@asynccontextmanager
async def bare_runtime() -> AsyncIterator[tuple[anyio.abc.SocketListener, Node]]:
    """A plugin pointed at a listener the test serves by hand."""
    async with open_node(start=False) as node:
        path = node.socket.with_name("bare.sock")
        async with await anyio.create_unix_listener(path) as listener:
            node.tg.start_soon(node.plugin(path, start_timeout=0.1))
            yield listener, node


async def test_exact_answers_to_a_bare_runtime() -> None:
    async with bare_runtime() as (listener, node), await listener.accept() as stream:
        runtime = BareRuntime(stream)
        # Configure before RegisterPlugin is answered: conn 1 is served from the start.
        configure = pb.ConfigureRequest(runtime_name="containerd", runtime_version="v2.0.2")
        pending = await runtime.start_call("Configure", configure.SerializeToString())
        registration = await runtime.register()
        assert (registration.plugin_name, registration.plugin_idx) == ("dra.cpu", "00")
        assert registration.NRI_version == "v0.12.2"  # the NRI release of our proto
        assert await runtime.answer(pending) == (0, "", bytes.fromhex("10c80d"))
        assert runtime.raw == bytes.fromhex("1203 10c80d")  # Response{payload}, no status
        sync = pb.SynchronizeRequest().SerializeToString()
        assert await runtime.call("Synchronize", sync) == (0, "", b"")
        assert runtime.raw == b""  # success with an empty message: a 0-byte Response
        started = pb.PostStartContainerRequest(container=pb.Container(id="unknown"))
        assert await runtime.call("PostStartContainer", started.SerializeToString()) == (0, "", b"")
        assert runtime.raw == b""  # PostStartContainerResponse is empty; an unknown id is no error
        for method in ("RunPodSandbox", "PostCreateContainer", "ValidateContainerAdjustment"):
            assert await runtime.call(method) == (Code.UNIMPLEMENTED, f"method {method}", b"")
        unknown = await runtime.call("X", service="foo.Bar")
        assert unknown == (Code.UNIMPLEMENTED, "service foo.Bar", b"")
        code, text, _ = await runtime.call("CreateContainer", bytes.fromhex("1203 0a01ff"))
        assert code == Code.INVALID_ARGUMENT
        assert "malformed CreateContainer" in text
        empty = await runtime.call("CreateContainer", b"")
        assert empty == (
            Code.INVALID_ARGUMENT,
            "dra.cpu: CreateContainer names no container",
            b"",
        )
        stop = pb.StopContainerRequest(container=pb.Container(id="unknown"))
        assert await runtime.call("StopContainer", stop.SerializeToString()) == (0, "", b"")
        assert await runtime.call("Shutdown") == (0, "", b"")
        # Still serving after all that.
        create = pb.CreateContainerRequest(
            pod=pb.PodSandbox(id="p", uid="u"), container=pb.Container(id="c1", name="x")
        )
        code, _, payload = await runtime.call("CreateContainer", create.SerializeToString())
        assert code == 0
        adjust = pb.CreateContainerResponse.FromString(payload).adjust
        assert adjust.linux.resources.cpu.cpus == ALLOCATABLE
        assert node.link.status().synchronized
        assert not node.link.status().unsolicited_updates


async def test_a_refused_registration_reconnects() -> None:
    async with bare_runtime() as (listener, node):
        async with await listener.accept() as first:
            await BareRuntime(first).register(code=Code.INVALID_ARGUMENT)
            with anyio.fail_after(5):
                second = await listener.accept()
        assert "refused to register 00-dra.cpu: code 3: refused" in node.link.status().last_error
        async with second:
            assert (await BareRuntime(second).register()).plugin_name == "dra.cpu"
