"""The state owner in-process: restore (checkpoint, adoption, resync), then serving commands with
the real state machine on a written ``dual-socket-smt2`` sysfs tree and real CDI specs and
checkpoint slots in scratch directories.

Faults are injected at the file layer (:class:`Files`, a :class:`NodeFiles` that can fail an
effect or hold it in the worker thread until the test lets it go), the one place where the
owner meets the disk.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu.adapters import cdi_files, checkpoint_file, file_scan
from dracpu.adapters.node_files import NodeFiles
from dracpu.config import Config
from dracpu.core.cdi_spec import ClaimSpec
from dracpu.core.checkpoint_schema import CheckpointData, PreparedClaim, StoredCheckpoint, decode
from dracpu.core.commands import (
    Command,
    Container,
    CreateContainer,
    DeviceResult,
    PrepareClaim,
    Resync,
    Synchronize,
    UnprepareClaim,
)
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode
from dracpu.core.effects import (
    ClaimPrepared,
    ClaimUnprepared,
    ConfineHostCgroups,
    ContainerPinned,
    ContainerUpdate,
    DeleteCdiSpec,
    DeleteDeviceMetadata,
    Effect,
    PruneCdiSpecs,
    PruneDeviceMetadata,
    PublishSlices,
    Resynced,
    UpdateContainers,
    WriteCdiSpec,
    WriteCheckpoint,
    WriteDeviceMetadata,
)
from dracpu.errors import CdiError, CheckpointError, ClaimError, DracpuError
from dracpu.tasks import state_owner
from dracpu.tasks.slice_publisher import republish_channel
from dracpu.tasks.state_owner import Request, StateOwner, create_request_stream, request
from tests.fixtures import SysfsTrees
from tests.tasks.both_backends import anyio_backend  # noqa: F401 (a fixture)
from tests.tasks.owner_files import Files, Flag

pytestmark = pytest.mark.anyio


UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"
FOREIGN = "vendor.example-gpu.json"
STEP = 10.0  # seconds any single wait of a test may take (2 shared cores)

Send = MemoryObjectSendStream[Request[Command]]
Receive = MemoryObjectReceiveStream[Request[Command]]


def _config(trees: SysfsTrees, scratch: Path, **changes: object) -> Config:
    values: dict[str, object] = {
        "node_name": "node-a",
        "host_root": trees.root("dual-socket-smt2"),
        "cdi_dir": scratch / "cdi",
        "state_dir": scratch / "state",
        "kubelet_root_dir": scratch / "kubelet",
    }
    values.update(changes)
    return Config(**values)  # type: ignore[arg-type]


def _checkpoint(config: Config, *claims: PreparedClaim) -> None:
    data = CheckpointData({c.claim_uid: c for c in claims})
    checkpoint_file.CheckpointStore(config.checkpoint_path).write(data)


def _saved(config: Config) -> dict[str, CpuSet]:
    """The claims of the newest checkpoint on disk (there must be one)."""
    stored = checkpoint_file.read_newest(config.checkpoint_path)
    assert stored is not None, "no checkpoint written"
    return {uid: claim.cpus for uid, claim in stored.data.claims.items()}


def _specs(config: Config) -> dict[str, CpuSet | CdiError]:
    """The CPUs of our CDI specs (none of these tests' claims shares the pool)."""
    found = file_scan.list_our_specs(config.cdi_dir)
    assert not any(isinstance(s, ClaimSpec) and s.shared_pool for s in found.values())
    return {uid: s.cpus if isinstance(s, ClaimSpec) else s for uid, s in found.items()}


def _metadata(config: Config) -> dict[str, list[str]]:
    """The requests of each claim that has both a metadata spec and the file it mounts."""
    found: dict[str, list[str]] = {}
    for spec in sorted(config.cdi_dir.glob("dra.cpu_metadata_*.json")):
        [device] = json.loads(spec.read_text())["devices"]
        uid, _, request = device["name"].partition("_")
        [mount] = device["containerEdits"]["mounts"]
        assert Path(mount["hostPath"]) == config.device_metadata_dir / f"{uid}_{request}.json"
        assert json.loads(Path(mount["hostPath"]).read_text())["metadata"]["uid"] == uid
        found.setdefault(uid, []).append(request)
    return found


def _grouped(uid: str, count: int, device: str = "cpudevnuma000") -> PrepareClaim:
    result = DeviceResult("cpus", "node-a", device, consumed_cpus=count)
    return PrepareClaim(uid, "ns", "claim", (result,))


async def until(predicate: Callable[[], bool], what: str) -> None:
    with anyio.move_on_after(STEP):
        while not predicate():  # noqa: ASYNC110 (the worker thread has no event of ours)
            await anyio.sleep(0.002)
        return
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Node:
    config: Config
    owner: StateOwner
    send: Send
    files: Files
    updates: list[UpdateContainers]
    tg: anyio.abc.TaskGroup

    async def ask(self, command: Command) -> object:
        return await request(self.send, command)

    def ran(self) -> list[type[Effect]]:
        return [type(e) for e in self.files.ran]


@asynccontextmanager
async def running(
    trees: SysfsTrees,
    scratch: Path,
    *,
    deadline: float = state_owner.COMMAND_DEADLINE,
    max_buffer_size: int = state_owner.COMMAND_QUEUE_SIZE,
    state_dir: Flag | None = None,
    full: bool = False,
    **changes: object,
) -> AsyncIterator[Node]:
    """A restored owner serving commands; the effects of the restore are not in ``files.ran``.
    ``state_dir``: the owner's state-dir flag (its retries come every 20 ms); ``full``: the
    checkpoint's writes fail from the start."""
    config = _config(trees, scratch, **changes)
    files = Files(config)
    files.full = full
    updates: list[UpdateContainers] = []
    send: Send
    receive: Receive
    send, receive = create_request_stream(max_buffer_size)
    owner = StateOwner(
        config,
        receive,
        container_updates=updates.append,
        files=files,
        command_deadline=deadline,
        state_dir=state_dir,
        retry_delays=lambda: itertools.repeat(0.02),
    )
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        files.ran.clear()
        files.on_loop.clear()
        yield Node(config, owner, send, files, updates, tg)
        tg.cancel_scope.cancel()


async def _with_node(
    trees: SysfsTrees, scratch: Path, body: Callable[[Node], Awaitable[None]]
) -> None:
    async with running(trees, scratch) as node:
        await body(node)


# --- serving: effects, reply, rollback ------------------------------------------------------------


async def test_a_prepare_writes_its_spec_then_the_checkpoint_then_commits_and_answers(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch) as node:
        prepared = await node.ask(_grouped(UID_A, 2))
        assert isinstance(prepared, ClaimPrepared)
        assert node.ran() == [WriteCdiSpec, WriteDeviceMetadata, WriteCheckpoint]
        assert node.files.on_loop == [False] * 3  # in a worker thread, all in one hop
        assert node.owner.state.claims[UID_A].cpus == prepared.cpus
        assert _specs(node.config) == {UID_A: prepared.cpus}
        assert _metadata(node.config) == {UID_A: ["cpus"]}
        assert _saved(node.config) == {UID_A: prepared.cpus}
        stats = node.owner.statistics()
        assert (stats.commands_applied, stats.commands_failed, stats.effects_failed) == (1, 0, 0)
        assert dict(stats.by_command) == {("PrepareClaim", "ok"): 1}

        node.files.ran.clear()
        unprepared = await node.ask(UnprepareClaim(UID_A))
        assert unprepared == ClaimUnprepared(UID_A, prepared.cpus)
        assert node.ran() == [DeleteCdiSpec, DeleteDeviceMetadata, WriteCheckpoint]
        assert _specs(node.config) == {}
        assert _metadata(node.config) == {}
        assert _saved(node.config) == {}


async def test_a_refusal_of_the_state_machine_is_raised_to_the_requester_and_changes_nothing(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch) as node:
        before = node.owner.state
        with pytest.raises(ClaimError, match="is not published by this node"):
            await node.ask(_grouped(UID_A, 2, device="cpudevnuma009"))
        assert node.owner.state is before
        assert node.files.ran == []
        assert dict(node.owner.statistics().by_command) == {("PrepareClaim", "error"): 1}


async def test_a_failed_checkpoint_write_keeps_the_old_state_and_puts_the_files_back(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch) as node:
        first = await node.ask(_grouped(UID_A, 2))
        assert isinstance(first, ClaimPrepared)
        node.files.ran.clear()
        node.files.failing.append(WriteCheckpoint)
        with pytest.raises(CheckpointError, match="No space left on device"):
            await node.ask(_grouped(UID_B, 3))
        assert list(node.owner.state.claims) == [UID_A]
        # The spec and metadata were written, the checkpoint failed; the rollback puts back
        # the old files: the checkpoint first, then B's metadata and spec go (newest first).
        assert node.ran() == [
            WriteCdiSpec,
            WriteDeviceMetadata,
            WriteCheckpoint,
            WriteCheckpoint,
            DeleteDeviceMetadata,
            DeleteCdiSpec,
        ]
        assert _specs(node.config) == {UID_A: first.cpus}
        assert _metadata(node.config) == {UID_A: ["cpus"]}
        assert _saved(node.config) == {UID_A: first.cpus}
        stats = node.owner.statistics()
        assert (stats.commands_applied, stats.commands_failed, stats.effects_failed) == (1, 1, 1)
        assert stats.by_command[("PrepareClaim", "failed")] == 1
        assert isinstance(await node.ask(_grouped(UID_B, 3)), ClaimPrepared)  # the owner goes on


async def test_a_state_dir_full_at_start_is_waited_out_and_prepare_fails_per_claim(
    trees: SysfsTrees, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    flag = Flag()
    with caplog.at_level(logging.DEBUG, logger="dracpu"):
        async with running(trees, scratch, state_dir=flag, full=True) as node:
            slot = checkpoint_file.slot_paths(node.config.checkpoint_path)[0]
            reason = f"cannot write checkpoint {slot}: No space left on device"
            assert (flag.is_ready(), set(flag.reasons)) == (False, {reason})  # the start's test
            with pytest.raises(CheckpointError) as refused:
                await node.ask(_grouped(UID_A, 2))
            assert str(refused.value) == reason
            assert node.owner.state.claims == {}
            assert _specs(node.config) == {}  # the spec written before the checkpoint is gone
            assert not slot.exists()
            stats = node.owner.statistics()
            assert (stats.commands_failed, stats.effects_failed) == (1, 1)  # no rollback failure
            # Retried between requests while it lasts, each a write of the committed state.
            await until(lambda: len(node.files.checkpoint_tests) >= 3, "three retries")
            assert not flag.is_ready()
            node.files.full = False
            await until(lambda: flag.is_ready(), "the state dir back")
            assert _saved(node.config) == {}
            prepared = await node.ask(_grouped(UID_A, 2))
            assert isinstance(prepared, ClaimPrepared)
            assert _saved(node.config) == {UID_A: prepared.cpus}
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [  # one line for the whole condition, however many tries
        f"writing the checkpoint in {slot.parent} failed, retrying in 0.0 s: {reason}; "
        "Prepare and Unprepare fail until then"
    ]
    assert any(
        r.getMessage().startswith(f"writing the checkpoint in {slot.parent} works again after ")
        for r in caplog.records
    )


async def test_a_state_dir_that_fills_up_keeps_every_claim_until_it_can_write_again(
    trees: SysfsTrees, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    flag = Flag()
    async with running(trees, scratch, state_dir=flag) as node:
        assert flag.is_ready()
        held = await node.ask(_grouped(UID_A, 2))
        assert isinstance(held, ClaimPrepared)
        node.files.full = True
        with caplog.at_level(logging.WARNING, logger="dracpu"):
            with pytest.raises(CheckpointError, match="No space left on device"):
                await node.ask(_grouped(UID_B, 3))
            with pytest.raises(CheckpointError, match="No space left on device"):
                await node.ask(UnprepareClaim(UID_A))
        # Nothing lost: A is held, its spec is back, the checkpoint still says so; B holds nothing.
        assert {uid: c.cpus for uid, c in node.owner.state.claims.items()} == {UID_A: held.cpus}
        assert _specs(node.config) == {UID_A: held.cpus}
        assert _saved(node.config) == {UID_A: held.cpus}
        assert not flag.is_ready()
        # Undoing the checkpoint writes that left nothing is no write, hence no error.
        assert not [r for r in caplog.records if "rollback" in r.getMessage()]
        assert node.owner.statistics().effects_failed == 2
        node.files.full = False
        await until(lambda: flag.is_ready(), "the state dir back")
        assert await node.ask(UnprepareClaim(UID_A)) == ClaimUnprepared(UID_A, held.cpus)
        assert _saved(node.config) == {}


async def test_a_failed_batch_leaves_no_trace_of_the_effects_that_never_began(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch) as node:
        node.files.failing.append(WriteCdiSpec)
        with pytest.raises(CheckpointError):
            await node.ask(_grouped(UID_A, 2))
        # The spec write failed: nothing after it began, nothing to undo but itself.
        assert node.ran() == [WriteCdiSpec, DeleteCdiSpec]
        assert node.owner.state.claims == {}
        assert _specs(node.config) == {}
        assert _metadata(node.config) == {}


async def test_a_post_commit_failure_keeps_the_new_state(
    trees: SysfsTrees, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(effect: UpdateContainers) -> None:
        raise DracpuError("the NRI task is gone")

    async with running(trees, scratch) as node:
        node.owner._container_updates = broken
        shared = Container("shared", "pod-1", name="sidecar")
        await node.ask(Synchronize((shared,), unsolicited_updates=True))
        prepared = await node.ask(_grouped(UID_A, 2))
        assert isinstance(prepared, ClaimPrepared)
        env = f"DRA_CPUSET_{UID_A}={prepared.cpus}"
        await node.ask(CreateContainer(Container.from_env("app", "pod-2", [env], name="app")))
        narrowed = node.owner.state.containers["shared"].cpus
        assert narrowed.isdisjoint(prepared.cpus)
        with caplog.at_level(logging.ERROR, logger="dracpu.tasks.state_owner"):
            assert await node.ask(UnprepareClaim(UID_A)) == ClaimUnprepared(UID_A, prepared.cpus)
        # Committed and answered: the widening was decided even though it could not be handed on.
        assert UID_A not in node.owner.state.claims
        assert node.owner.state.containers["shared"].cpus == narrowed | prepared.cpus
        assert node.owner.statistics().effects_failed == 1
        assert "post-commit effect UpdateContainers failed: the NRI task is gone" in caplog.text


async def test_unsolicited_updates_go_to_the_nri_task_after_the_answer(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch) as node:
        await node.ask(Synchronize((Container("shared", "pod-1"),), unsolicited_updates=True))
        prepared = await node.ask(_grouped(UID_A, 2))
        assert isinstance(prepared, ClaimPrepared)
        env = f"DRA_CPUSET_{UID_A}={prepared.cpus}"
        await node.ask(CreateContainer(Container.from_env("app", "pod-2", [env])))
        assert node.updates == []
        await node.ask(UnprepareClaim(UID_A))
        [update] = node.updates
        state = node.owner.state
        assert update.updates == (ContainerUpdate("shared", state.shared_pool, None, 3),)
        assert state.containers["shared"].seq == state.pin_seq == 3


async def test_a_cancelled_requester_never_disturbs_the_owner(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch) as node:
        requester = anyio.CancelScope()

        async def ask() -> None:
            with requester:
                await node.ask(_grouped(UID_A, 2))

        with node.files.holding(WriteCheckpoint) as gate:
            node.tg.start_soon(ask)
            await until(lambda: WriteCheckpoint in node.files.held, "the held checkpoint")
            requester.cancel()
            await anyio.wait_all_tasks_blocked()
            gate.set()
        assert isinstance(await node.ask(_grouped(UID_B, 2)), ClaimPrepared)
        assert requester.cancelled_caught
        assert sorted(node.owner.state.claims) == [UID_A, UID_B]  # the cancelled one applied


async def test_effects_past_the_deadline_are_cut_off_after_the_hop_that_began(
    trees: SysfsTrees, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    send, receive = republish_channel()
    with send, receive:
        async with running(trees, scratch, deadline=0.2) as node:
            prepared = await node.ask(_grouped(UID_A, 2))
            assert isinstance(prepared, ClaimPrepared)
            node.owner._republish = send
            node.files.ran.clear()

            async def release(gate: threading.Event) -> None:
                await anyio.sleep(0.5)  # past the deadline: the write is waited for
                gate.set()

            # The commit phase: the hop that had begun ran to its end, the publish after it
            # never began, the rollback put the old cgroups back.
            with node.files.holding(ConfineHostCgroups) as gate:
                node.tg.start_soon(release, gate)
                message = (
                    r"^the commit phase \(cut off after ConfineHostCgroups\) did not finish "
                    r"within 0.2 s$"
                )
                with pytest.raises(DracpuError, match=message):
                    await node.ask(Resync())
            assert node.ran() == [ConfineHostCgroups, ConfineHostCgroups]
            with pytest.raises(anyio.WouldBlock):
                receive.receive_nowait()
            assert node.owner.statistics().effects_failed == 1
            # After the answer: the files of the Resync, each on its own; the one that had begun
            # ran to its end, the ones after it never began.
            node.files.ran.clear()
            with (
                caplog.at_level(logging.ERROR, logger="dracpu"),
                node.files.holding(WriteCdiSpec) as gate,
            ):
                node.tg.start_soon(release, gate)
                assert await node.ask(Resync()) == Resynced(1)  # answered before the files
                await until(lambda: node.owner.statistics().effects_failed == 2, "the cut-off")
            assert node.ran() == [ConfineHostCgroups, WriteCdiSpec]
            assert "Resync: post-commit effects cut off after 0.2 s" in caplog.messages
            assert _specs(node.config) == {UID_A: prepared.cpus}
            assert await node.ask(UnprepareClaim(UID_A)) == ClaimUnprepared(UID_A, prepared.cpus)
            # A prepare is one hop: however slow, nothing comes after it to cut off.
            with node.files.holding(WriteCheckpoint) as gate:
                node.tg.start_soon(release, gate)
                assert isinstance(await node.ask(_grouped(UID_B, 2)), ClaimPrepared)


async def test_a_stopping_owner_finishes_the_command_in_flight(
    trees: SysfsTrees, scratch: Path
) -> None:
    config = _config(trees, scratch)
    files = Files(config)
    send: Send
    receive: Receive
    send, receive = create_request_stream()
    owner = StateOwner(config, receive, files=files)
    answers: list[object] = []
    owner_scope = anyio.CancelScope()

    async def run_owner(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        with owner_scope:
            await owner.run(task_status=task_status)

    async def ask() -> None:
        answers.append(await request(send, _grouped(UID_A, 2)))

    with files.holding(WriteCheckpoint) as gate:
        async with send, anyio.create_task_group() as tg:
            await tg.start(run_owner)
            tg.start_soon(ask)
            await until(lambda: WriteCheckpoint in files.held, "the held checkpoint")
            owner_scope.cancel()  # the stop arrives while the effect runs
            await anyio.wait_all_tasks_blocked()
            assert answers == []
            gate.set()
    [prepared] = answers
    assert isinstance(prepared, ClaimPrepared)
    assert list(owner.state.claims) == [UID_A]
    assert _saved(config) == {UID_A: prepared.cpus}


async def _crash(
    trees: SysfsTrees, scratch: Path, command: Command, bug: Callable[[Files], None]
) -> tuple[pytest.ExceptionInfo[ExceptionGroup], object]:
    """Restore an owner, plant ``bug``, send ``command`` with a reply stream of the test's own:
    the group the owner's failure ends, and the answer the owner left in that stream."""
    config = _config(trees, scratch)
    files = Files(config)
    send: Send
    receive: Receive
    send, receive = create_request_stream()
    owner = StateOwner(config, receive, files=files)
    reply_send, reply_receive = anyio.create_memory_object_stream[object](1)

    async def serve_one() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(owner.run)
            bug(files)
            send.send_nowait(Request(command, reply_send))
            await anyio.sleep_forever()  # the owner's failure ends the group

    with reply_receive, reply_send, send:
        with pytest.raises(ExceptionGroup) as info:
            await serve_one()
        answer = reply_receive.receive_nowait()
    return info, answer


async def test_a_bug_in_apply_is_answered_then_ends_the_owner(
    trees: SysfsTrees, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(state: object, command: object) -> Any:
        raise ValueError("boom")

    def plant(files: Files) -> None:
        monkeypatch.setattr(state_owner, "apply", broken)

    info, answer = await _crash(trees, scratch, UnprepareClaim(UID_A), plant)
    assert info.group_contains(ValueError, match="^boom$")
    assert isinstance(answer, DracpuError)
    assert str(answer) == "UnprepareClaim: internal error: ValueError('boom')"


async def test_a_bug_in_an_effect_is_answered_then_ends_the_owner(
    trees: SysfsTrees, scratch: Path
) -> None:
    info, answer = await _crash(
        trees, scratch, _grouped(UID_A, 2), lambda files: files.bugs.append(WriteCheckpoint)
    )
    assert info.group_contains(RuntimeError, match="^bug in WriteCheckpoint$")
    assert isinstance(answer, DracpuError)
    assert str(answer) == "PrepareClaim: internal error: RuntimeError('bug in WriteCheckpoint')"


async def test_requests_still_queued_when_the_owner_stops_are_refused(
    trees: SysfsTrees, scratch: Path
) -> None:
    config = _config(trees, scratch)
    send: Send
    receive: Receive
    send, receive = create_request_stream()
    owner = StateOwner(config, receive)
    replies = [anyio.create_memory_object_stream[object](1) for _ in range(2)]
    async with send:
        for reply_send, _ in replies:
            await send.send(Request(UnprepareClaim(UID_A), reply_send))
        with anyio.CancelScope() as scope:
            scope.cancel()
            await owner.run()
    for _, reply_receive in replies:
        with reply_receive:
            answer = reply_receive.receive_nowait()
        assert isinstance(answer, DracpuError)
        assert str(answer) == "the state owner stopped before handling UnprepareClaim"


async def test_request_when_the_owner_is_not_running() -> None:
    send: Send
    receive: Receive
    send, receive = create_request_stream()
    receive.close()
    async with send:
        with pytest.raises(DracpuError, match="cannot send Resync: the state owner is not running"):
            await request(send, Resync())


async def test_request_when_the_owner_ends_without_answering() -> None:
    send: Send
    receive: Receive
    send, receive = create_request_stream()

    async def drop_one() -> None:
        async with receive:
            req = await receive.receive()
            req.reply.close()  # a misbehaving owner: no answer

    async with send, anyio.create_task_group() as tg:
        tg.start_soon(drop_one)
        with pytest.raises(DracpuError, match="the state owner stopped before answering Resync"):
            await request(send, Resync())


async def test_the_command_stream_is_bounded_and_its_depth_reported(
    trees: SysfsTrees, scratch: Path
) -> None:
    answers: list[object] = []
    async with running(trees, scratch, max_buffer_size=2) as node:

        async def ask(command: Command) -> None:
            answers.append(await node.ask(command))

        with node.files.holding(WriteCheckpoint) as gate:
            node.tg.start_soon(ask, _grouped(UID_A, 2))
            await until(lambda: WriteCheckpoint in node.files.held, "the held checkpoint")
            for _ in range(3):
                node.tg.start_soon(ask, UnprepareClaim(UID_B))
            await anyio.wait_all_tasks_blocked()
            assert node.owner.statistics().queue_depth == 2  # the third sender waits for room
            gate.set()
        await until(lambda: len(answers) == 4, "every answer")
        assert node.owner.statistics().queue_depth == 0


async def test_run_serves_until_every_sender_is_closed(trees: SysfsTrees, scratch: Path) -> None:
    config = _config(trees, scratch)
    send: Send
    receive: Receive
    send, receive = create_request_stream()
    owner = StateOwner(config, receive)
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        async with send:
            assert isinstance(await request(send, _grouped(UID_A, 1)), ClaimPrepared)
        # every send side closed: the owner's loop ends and run() returns by itself
    assert list(owner.state.claims) == [UID_A]


# --- file effects in one hop; the CDI watcher's view -------------------------------------------


async def test_a_commit_phase_takes_one_hop_and_other_effects_split_it(
    trees: SysfsTrees, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hops: list[list[type[Effect]]] = []
    real = NodeFiles.run_batch

    def counting(self: NodeFiles, batch: list[Effect], started: list[Effect]) -> None:
        hops.append([type(e) for e in batch])
        real(self, batch, started)

    monkeypatch.setattr(NodeFiles, "run_batch", counting)
    send, receive = republish_channel()
    with send, receive:
        async with running(trees, scratch) as node:
            node.owner._republish = send
            await node.ask(_grouped(UID_A, 2))
            await node.ask(_grouped(UID_B, 2, device="cpudevnuma001"))
            hops.clear()
            await node.ask(Resync())
            assert receive.receive_nowait().devices == tuple(
                node.owner.state.config.devices.values()
            )
    # Resync: the host cgroups in one hop, the publish after it (on the event loop), then after
    # the answer each file on its own: one that fails keeps no other from being written.
    assert hops == [
        [ConfineHostCgroups],
        [WriteCdiSpec],
        [WriteCdiSpec],
        [PruneCdiSpecs],
        [WriteDeviceMetadata],
        [WriteDeviceMetadata],
        [PruneDeviceMetadata],
    ]


async def test_unsolicited_updates_without_an_nri_task_are_dropped(
    trees: SysfsTrees, scratch: Path
) -> None:
    config = _config(trees, scratch, cpu_device_mode=CpuDeviceMode.INDIVIDUAL)
    send: Send
    receive: Receive
    send, receive = create_request_stream()
    owner = StateOwner(config, receive)
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        assert len(owner.state.config.devices) == 64  # 64 CPUs, individual devices
        await request(send, Synchronize((Container("s", "p"),), unsolicited_updates=True))
        result = DeviceResult("cpus", "node-a", "cpudev002")
        prepared = await request(send, PrepareClaim(UID_A, "ns", "c", (result,)))
        assert isinstance(prepared, ClaimPrepared)
        env = f"DRA_CPUSET_{UID_A}={prepared.cpus}"
        await request(send, CreateContainer(Container.from_env("x", "q", [env])))
        narrowed = owner.state.containers["s"].cpus
        await request(send, UnprepareClaim(UID_A))  # widening with nowhere to go: logged only
        assert owner.statistics().effects_failed == 0
        assert owner.state.containers["s"].cpus == narrowed | prepared.cpus
        tg.cancel_scope.cancel()


# --- restore --------------------------------------------------------------------------------------


async def test_a_fresh_node_restores_empty_and_hands_its_devices_to_the_publisher(
    trees: SysfsTrees, scratch: Path
) -> None:
    config = _config(trees, scratch)
    send, receive = republish_channel()
    requests: Send
    owner_end: Receive
    requests, owner_end = create_request_stream()
    with send, receive, requests, owner_end:
        owner = StateOwner(config, owner_end, republish=send)
        state = await owner.restore()
        assert dict(state.claims) == {}
        request = receive.receive_nowait()  # the devices travel with the request
        assert [d.name for d in request.devices] == [f"cpudevnuma00{n}" for n in range(4)]
    # An empty checkpoint in slot 0: the proof that the state dir takes writes, before the
    # first Prepare needs it.
    zero, one = checkpoint_file.slot_paths(config.checkpoint_path)
    assert decode(zero.read_bytes()) == StoredCheckpoint(CheckpointData(), 1)
    assert not one.exists()


def _owner(config: Config, **options: Any) -> StateOwner:
    """An owner to restore only (its command stream is closed: it serves nothing)."""
    send: Send
    receive: Receive
    send, receive = create_request_stream()
    send.close()
    receive.close()
    return StateOwner(config, receive, **options)


async def test_restore_keeps_fitting_claims_drops_others_and_rewrites_specs(
    trees: SysfsTrees, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(trees, scratch, reserved_cpus=CpuSet.parse("0,32"))
    _checkpoint(
        config,
        PreparedClaim(UID_A, CpuSet.parse("4-5"), "ns", "kept"),
        PreparedClaim(UID_B, CpuSet.parse("0-1"), "ns", "dropped"),  # cpu0 is reserved now
    )
    cdi_files.write_spec(config.cdi_dir, UID_B, CpuSet.parse("0-1"))
    (config.cdi_dir / FOREIGN).write_text("{}")
    with caplog.at_level(logging.INFO, logger="dracpu"):
        state = await _owner(config).restore()
    assert {uid: c.cpus for uid, c in state.claims.items()} == {UID_A: CpuSet.parse("4-5")}
    assert _saved(config) == {UID_A: CpuSet.parse("4-5")}  # the checkpoint equals the state
    assert _specs(config) == {UID_A: CpuSet.parse("4-5")}
    assert (config.cdi_dir / FOREIGN).read_text() == "{}"
    assert any(
        r.levelno == logging.ERROR and UID_B in r.getMessage() and "cpus 0" in r.getMessage()
        for r in caplog.records
    )


async def test_restore_says_which_reserved_cpus_are_not_online(
    trees: SysfsTrees, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 20: ``--reserved-cpus 5`` on a 2-CPU machine was taken silently. Reserved CPUs that
    are not online reserve nothing: one warning names them; the online ones are reserved."""
    config = _config(trees, scratch, reserved_cpus=CpuSet.parse("0,64-65"))
    with caplog.at_level(logging.WARNING, logger="dracpu"):
        state = await _owner(config).restore()
    assert [r.getMessage() for r in caplog.records if "reserved" in r.getMessage()] == [
        "reserved cpus 64-65 are not online on this node; ignored"
    ]
    assert state.shared_pool == CpuSet.parse("1-63")


async def test_restore_adopts_cdi_specs_the_checkpoint_lacks(
    trees: SysfsTrees, scratch: Path
) -> None:
    config = _config(trees, scratch)
    _checkpoint(config, PreparedClaim(UID_A, CpuSet.parse("4-5"), "ns", "known"))
    cdi_files.write_spec(config.cdi_dir, UID_B, CpuSet.parse("8-9"))
    clash = str(uuid.uuid4())
    cdi_files.write_spec(config.cdi_dir, clash, CpuSet.parse("5-6"))  # overlaps claim A
    state = await _owner(config).restore()
    assert {uid: c.cpus for uid, c in state.claims.items()} == {
        UID_A: CpuSet.parse("4-5"),
        UID_B: CpuSet.parse("8-9"),
    }
    assert _saved(config) == {UID_A: CpuSet.parse("4-5"), UID_B: CpuSet.parse("8-9")}
    assert sorted(_specs(config)) == sorted([UID_A, UID_B])


async def test_a_failed_start_resync_keeps_the_claims_and_the_devices(
    trees: SysfsTrees, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(trees, scratch, cdi_dir=scratch / "not-a-dir")
    config.cdi_dir.write_text("")  # every CDI write fails
    _checkpoint(config, PreparedClaim(UID_A, CpuSet.parse("4-5"), "ns", "kept"))
    owner = _owner(config)
    state = await owner.restore()
    assert list(state.claims) == [UID_A]
    assert _saved(config) == {UID_A: CpuSet.parse("4-5")}
    assert len(owner.state.config.devices) == 4
    reason = f"CDI dir {str(config.cdi_dir)!r} exists and is not a directory"
    assert f"Resync: post-commit effect WriteCdiSpec failed: {reason}" in caplog.messages
    # The claim's device says why its containers cannot start.
    _, health = owner.health.snapshot()
    unhealthy = {h.device: h.message for h in health if h.status == "Unhealthy"}
    assert unhealthy == {
        "cpudevnuma000": f"claim {UID_A}: {reason}; containers using the claim cannot start "
        "until it is written"
    }


async def test_an_unreadable_checkpoint_fails_the_restore(trees: SysfsTrees, scratch: Path) -> None:
    config = _config(trees, scratch)
    config.checkpoint_path.mkdir(parents=True)  # a directory where the file should be
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        await _owner(config).restore()


async def test_a_missing_topology_fails_the_start(scratch: Path) -> None:
    config = Config(
        node_name="n",
        host_root=scratch / "empty",
        cdi_dir=scratch / "cdi",
        kubelet_root_dir=scratch / "kubelet",
    )
    with pytest.raises(DracpuError):
        await _owner(config).run()


async def test_prepares_checkpoint_into_alternate_slots_and_a_restart_takes_the_newest(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch) as node:
        await node.ask(_grouped(UID_A, 2))
        await node.ask(_grouped(UID_B, 3))
        state = node.owner.state
    # The start wrote slot 0 (sequence 1), A's Prepare slot 1, B's slot 0 again.
    zero, one = checkpoint_file.slot_paths(node.config.checkpoint_path)
    assert dict(decode(one.read_bytes()).data.claims) == {UID_A: state.claims[UID_A]}
    assert decode(zero.read_bytes()) == StoredCheckpoint(state.checkpoint(), 3)
    restarted = await _owner(node.config).restore()
    assert dict(restarted.claims) == dict(state.claims)


async def test_a_prepare_whose_checkpoint_write_was_torn_is_adopted_from_its_cdi_spec(
    trees: SysfsTrees, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running(trees, scratch) as node:
        await node.ask(_grouped(UID_A, 2))
        await node.ask(_grouped(UID_B, 3))
        state = node.owner.state
    config = node.config
    # The power failed in the middle of B's checkpoint write (after its CDI spec was written):
    # that write was never acknowledged, so the kubelet still thinks B is unprepared. (The start
    # wrote slot 0, A's Prepare slot 1, B's slot 0.)
    zero, one = checkpoint_file.slot_paths(config.checkpoint_path)
    zero.write_bytes(zero.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="dracpu"):
        restarted = await _owner(config).restore()
    assert {uid: c.cpus for uid, c in restarted.claims.items()} == {
        uid: c.cpus for uid, c in state.claims.items()
    }
    assert restarted.claims[UID_A] == state.claims[UID_A]  # from the checkpoint, with results
    assert restarted.claims[UID_B].results == ()  # adopted from its spec: the kubelet's retry
    assert _saved(config) == {uid: c.cpus for uid, c in state.claims.items()}
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"using {one} (sequence 2)" in m for m in messages)
    assert any(
        f"adopted 1 claims from CDI specs the checkpoint lacked: ['{UID_B}']" in m for m in messages
    )


async def test_a_failed_adoption_keeps_the_claims_and_the_specs(
    trees: SysfsTrees, scratch: Path
) -> None:
    config = _config(trees, scratch)
    _checkpoint(config, PreparedClaim(UID_A, CpuSet.parse("4-5"), "ns", "known"))
    cdi_files.write_spec(config.cdi_dir, UID_B, CpuSet.parse("8-9"))  # only its spec knows it
    before = _saved(config)
    files = Files(config)
    files.full = True
    flag = Flag()
    owner = _owner(config, files=files, state_dir=flag)
    state = await owner.restore()
    # Neither rolled back nor pruned: the specs stay their record, and the claim is held.
    assert {uid: c.cpus for uid, c in state.claims.items()} == {
        UID_A: CpuSet.parse("4-5"),
        UID_B: CpuSet.parse("8-9"),
    }
    assert _specs(config) == {UID_A: CpuSet.parse("4-5"), UID_B: CpuSet.parse("8-9")}
    assert _saved(config) == before
    slot = checkpoint_file.slot_paths(config.checkpoint_path)[1]
    assert set(flag.reasons) == {f"cannot write checkpoint {slot}: No space left on device"}
    assert not slot.exists()  # the slot the failed writes created is gone again
    # The state dir's next test writes them down.
    files.full = False
    await owner._write_checkpoint()
    assert _saved(config) == {UID_A: CpuSet.parse("4-5"), UID_B: CpuSet.parse("8-9")}
    assert flag.is_ready()


async def test_prune_removes_only_our_specs_that_are_not_kept(scratch: Path) -> None:
    files = NodeFiles(scratch, scratch / "state" / "checkpoint.json", scratch / "metadata")
    for uid in (UID_A, UID_B):
        cdi_files.write_spec(scratch, uid, CpuSet.parse("1"))
    (scratch / FOREIGN).write_text("{}")
    files.run(PruneCdiSpecs(frozenset({UID_A})))
    assert _specs(Config(node_name="n", cdi_dir=scratch)) == {UID_A: CpuSet.parse("1")}
    assert (scratch / FOREIGN).read_text() == "{}"
    with pytest.raises(DracpuError, match="PublishSlices is not a file effect"):
        files.run(PublishSlices(()))


# --- the hand-over of a rolling update ------------------------------------------------------------


async def test_after_stop_writing_no_file_is_written_and_container_events_are_still_served(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch) as node:
        prepared = await node.ask(_grouped(UID_A, 2))
        assert isinstance(prepared, ClaimPrepared)
        await node.owner.stop_writing()
        slots = {p: p.read_bytes() for p in scratch.joinpath("state").iterdir()}
        node.files.ran.clear()
        with pytest.raises(DracpuError, match="the state dir was handed over to the next dracpu"):
            await node.ask(_grouped(UID_B, 2, device="cpudevnuma001"))
        assert UID_B not in node.owner.state.claims
        assert _specs(node.config) == {UID_A: prepared.cpus}
        # A container event writes no file: it is answered from the state as before.
        pinned = await node.ask(CreateContainer(Container("c1", "pod-1", name="main")))
        assert isinstance(pinned, ContainerPinned)
        assert not pinned.pin.cpus & prepared.cpus
        assert {p: p.read_bytes() for p in scratch.joinpath("state").iterdir()} == slots
