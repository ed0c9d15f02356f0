"""The node machine in-process: restore (checkpoint, adoption, resync) and the effect executor,
on a written sysfs tree and real files in scratch directories."""

from __future__ import annotations

import gc
import logging
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import pytest

from dracpu.adapters import cdi_files, checkpoint_file
from dracpu.config import Config
from dracpu.core.checkpoint_schema import (
    CheckpointData,
    PreparedClaim,
    StoredCheckpoint,
    decode,
)
from dracpu.core.commands import (
    DeviceResult,
    InvalidateContainers,
    PrepareClaim,
    UnprepareClaim,
)
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import (
    ClaimPrepared,
    ContainerUpdate,
    DeleteCdiSpec,
    Effect,
    PruneCdiSpecs,
    PublishSlices,
    Reply,
    UpdateContainers,
    WriteCdiSpec,
    WriteCheckpoint,
)
from dracpu.core.slices import CpuDeviceMode
from dracpu.core.state import NodeState, commit_phase
from dracpu.errors import CheckpointError, DracpuError
from dracpu.tasks.node_machine import FILE_THREAD_NAME, NodeMachine
from dracpu.tasks.serial_thread import SerialThread
from dracpu.tasks.slice_publisher import republish_channel
from tests.fixtures import SysfsTrees

pytestmark = pytest.mark.anyio

UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"
FOREIGN = "vendor.example-gpu.json"

T = TypeVar("T")


def _config(trees: SysfsTrees, scratch: Path, **changes: object) -> Config:
    values: dict[str, object] = {
        "node_name": "node-a",
        "host_root": trees.root("dual-socket-smt2"),
        "cdi_dir": scratch / "cdi",
        "state_dir": scratch / "state",
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


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _grouped(uid: str, count: int) -> PrepareClaim:
    result = DeviceResult("cpus", "node-a", "cpudevnuma000", consumed_cpus=count)
    return PrepareClaim(uid, "ns", "claim", (result,))


async def test_a_fresh_node_restores_empty_and_hands_its_devices_to_the_publisher(
    trees: SysfsTrees, scratch: Path
) -> None:
    send, receive = republish_channel()
    with send, receive:
        machine = NodeMachine(_config(trees, scratch), republish=send)
        state = await machine.restore()
        assert dict(state.claims) == {}
        assert [d.name for d in machine.devices()] == [f"cpudevnuma00{n}" for n in range(4)]
        assert receive.receive_nowait() == "resync"
    # nothing to persist yet: no slot written
    assert not any(
        p.exists() for p in checkpoint_file.slot_paths(scratch / "state" / "checkpoint.json")
    )


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
        state = await NodeMachine(config).restore()
    assert {uid: c.cpus for uid, c in state.claims.items()} == {UID_A: CpuSet.parse("4-5")}
    assert _saved(config) == {UID_A: CpuSet.parse("4-5")}  # the checkpoint equals the state
    assert cdi_files.list_our_specs(config.cdi_dir) == {UID_A: CpuSet.parse("4-5")}
    assert (config.cdi_dir / FOREIGN).read_text() == "{}"
    assert any(
        r.levelno == logging.ERROR and UID_B in r.getMessage() and "cpus 0" in r.getMessage()
        for r in caplog.records
    )


async def test_restore_adopts_cdi_specs_the_checkpoint_lacks(
    trees: SysfsTrees, scratch: Path
) -> None:
    config = _config(trees, scratch)
    _checkpoint(config, PreparedClaim(UID_A, CpuSet.parse("4-5"), "ns", "known"))
    cdi_files.write_spec(config.cdi_dir, UID_B, CpuSet.parse("8-9"))
    clash = str(uuid.uuid4())
    cdi_files.write_spec(config.cdi_dir, clash, CpuSet.parse("5-6"))  # overlaps claim A
    state = await NodeMachine(config).restore()
    assert {uid: c.cpus for uid, c in state.claims.items()} == {
        UID_A: CpuSet.parse("4-5"),
        UID_B: CpuSet.parse("8-9"),
    }
    assert _saved(config) == {UID_A: CpuSet.parse("4-5"), UID_B: CpuSet.parse("8-9")}
    assert sorted(cdi_files.list_our_specs(config.cdi_dir)) == sorted([UID_A, UID_B])


async def test_a_failed_start_resync_keeps_the_claims_and_the_devices(
    trees: SysfsTrees, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(trees, scratch, cdi_dir=scratch / "not-a-dir")
    config.cdi_dir.write_text("")  # every CDI write fails
    _checkpoint(config, PreparedClaim(UID_A, CpuSet.parse("4-5"), "ns", "kept"))
    machine = NodeMachine(config)
    state = await machine.restore()
    assert list(state.claims) == [UID_A]
    assert _saved(config) == {UID_A: CpuSet.parse("4-5")}
    assert len(machine.devices()) == 4  # the publisher never sees an empty node
    assert any(
        r.levelno == logging.ERROR and r.getMessage().startswith("start-up Resync failed: ")
        for r in caplog.records
    )


async def test_an_unreadable_checkpoint_fails_the_restore(trees: SysfsTrees, scratch: Path) -> None:
    config = _config(trees, scratch)
    config.checkpoint_path.mkdir(parents=True)  # a directory where the file should be
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        await NodeMachine(config).restore()


async def _prepare(machine: NodeMachine, state: NodeState, command: PrepareClaim) -> NodeState:
    """A Prepare's commit phase through the machine (CDI spec, checkpoint); the new state."""
    new, effects = machine.apply(state, command)
    commit, reply, _ = commit_phase(effects)
    assert isinstance(reply.value, ClaimPrepared)
    await machine.execute_batch(commit, [])
    return new


async def test_prepares_checkpoint_into_alternate_slots_and_a_restart_takes_the_newest(
    trees: SysfsTrees, scratch: Path
) -> None:
    config = _config(trees, scratch)
    machine = NodeMachine(config)
    state = await machine.restore()
    state = await _prepare(machine, state, _grouped(UID_A, 2))
    state = await _prepare(machine, state, _grouped(UID_B, 3))
    zero, one = checkpoint_file.slot_paths(config.checkpoint_path)
    assert dict(decode(zero.read_bytes()).data.claims) == {UID_A: state.claims[UID_A]}
    assert decode(one.read_bytes()) == StoredCheckpoint(state.checkpoint(), 2)
    restarted = await NodeMachine(config).restore()
    assert dict(restarted.claims) == dict(state.claims)


async def test_a_prepare_whose_checkpoint_write_was_torn_is_adopted_from_its_cdi_spec(
    trees: SysfsTrees, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(trees, scratch)
    machine = NodeMachine(config)
    state = await machine.restore()
    state = await _prepare(machine, state, _grouped(UID_A, 2))
    state = await _prepare(machine, state, _grouped(UID_B, 3))
    # The power failed in the middle of B's checkpoint write (after its CDI spec was written):
    # that write was never acknowledged, so the kubelet still thinks B is unprepared.
    zero, one = checkpoint_file.slot_paths(config.checkpoint_path)
    one.write_bytes(one.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="dracpu"):
        restarted = await NodeMachine(config).restore()
    assert {uid: c.cpus for uid, c in restarted.claims.items()} == {
        uid: c.cpus for uid, c in state.claims.items()
    }
    assert restarted.claims[UID_A] == state.claims[UID_A]  # from the checkpoint, with results
    assert restarted.claims[UID_B].results == ()  # adopted from its spec: the kubelet's retry
    assert _saved(config) == {uid: c.cpus for uid, c in state.claims.items()}
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"using {zero} (sequence 1)" in m for m in messages)
    assert any(
        f"adopted 1 claims from CDI specs the checkpoint lacked: ['{UID_B}']" in m for m in messages
    )


async def test_desired_specs_follow_the_command_in_flight(trees: SysfsTrees, scratch: Path) -> None:
    config = _config(trees, scratch)
    machine = NodeMachine(config)
    state = await machine.restore()
    committed = state
    machine.watch_state(lambda: committed)

    # Prepare: the spec is written before the state commits; the watcher must keep it.
    new, effects = machine.apply(committed, _grouped(UID_A, 2))
    await machine.execute(effects[0])
    assert isinstance(effects[0], WriteCdiSpec)
    assert machine.desired_specs() == {UID_A: effects[0].cpus}
    for effect in effects[1:]:
        if not isinstance(effect, Reply):
            await machine.execute(effect)
    committed = new
    assert machine.desired_specs() == {UID_A: new.claims[UID_A].cpus}

    # Unprepare: the spec is deleted before the state commits; the watcher must not restore it.
    _, effects = machine.apply(committed, UnprepareClaim(UID_A))
    await machine.execute(effects[0])
    assert machine.desired_specs() == {}
    assert cdi_files.list_our_specs(config.cdi_dir) == {}
    # The next command starts afresh from the committed state.
    machine.apply(committed, UnprepareClaim(UID_B))
    assert machine.desired_specs() == {UID_A: new.claims[UID_A].cpus}


async def test_effects_reach_the_nri_task_and_the_publisher(
    trees: SysfsTrees, scratch: Path
) -> None:
    config = _config(trees, scratch, cpu_device_mode=CpuDeviceMode.INDIVIDUAL)
    submitted: list[UpdateContainers] = []
    send, receive = republish_channel()
    with send, receive:
        machine = NodeMachine(config, republish=send, update_containers=submitted.append)
        state = await machine.restore()
        assert receive.receive_nowait() == "resync"
        update = UpdateContainers((ContainerUpdate("c1", CpuSet.parse("2-63")),))
        await machine.execute(update)
        assert submitted == [update]
        await machine.execute(PublishSlices(state.config.topology))
        assert receive.receive_nowait() == "resync"
        assert len(machine.devices()) == 64
    # Without an NRI task the updates are dropped (Synchronize re-pins everything later).
    await NodeMachine(config).execute(update)
    assert machine.follow_up(update, DracpuError("x")) == InvalidateContainers(("c1",))
    assert machine.follow_up(PublishSlices(state.config.topology), DracpuError("x")) is None
    with pytest.raises(DracpuError, match="not an effect"):
        await machine.execute(Reply(None))


async def test_prune_removes_only_our_specs_that_are_not_kept(scratch: Path) -> None:
    config = Config(node_name="n", cdi_dir=scratch)
    for uid in (UID_A, UID_B):
        cdi_files.write_spec(scratch, uid, CpuSet.parse("1"))
    (scratch / FOREIGN).write_text("{}")
    await NodeMachine(config).execute(PruneCdiSpecs(frozenset({UID_A})))
    assert _names(scratch) == sorted([cdi_files.spec_path(scratch, UID_A).name, FOREIGN])


# --- the commit phase in one hop to the file thread ---------------------------------------------


def _count_thread_hops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every call handed to the file thread (the name of the function it runs), and
    check that it runs in that thread."""
    hops: list[str] = []
    real = SerialThread.call

    async def counting(self: SerialThread, func: Callable[..., T], *args: Any) -> T:
        name = getattr(func, "__name__", repr(func))

        def in_thread(*inner: Any) -> T:
            assert threading.current_thread().name == FILE_THREAD_NAME
            return func(*inner)

        hops.append(name)
        return await real(self, in_thread, *args)

    monkeypatch.setattr(SerialThread, "call", counting)
    return hops


async def test_a_prepare_commit_phase_takes_one_file_thread_hop(
    trees: SysfsTrees, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(trees, scratch)
    machine = NodeMachine(config)
    state = await machine.restore()
    machine.watch_state(lambda: state)
    new, effects = machine.apply(state, _grouped(UID_A, 2))
    commit, reply, _ = commit_phase(effects)
    assert [type(e) for e in commit] == [WriteCdiSpec, WriteCheckpoint]
    hops = _count_thread_hops(monkeypatch)
    started: list[Effect] = []

    await machine.execute_batch(commit, started)

    assert hops == ["_run_file_effects"]
    assert started == commit
    cpus = new.claims[UID_A].cpus
    assert cdi_files.list_our_specs(config.cdi_dir) == {UID_A: cpus}
    assert _saved(config) == {UID_A: cpus}
    assert machine.desired_specs() == {UID_A: cpus}
    assert isinstance(reply.value, ClaimPrepared)


async def test_a_batch_runs_other_effects_in_order_between_file_hops(
    trees: SysfsTrees, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(trees, scratch)
    send, receive = republish_channel()
    with send, receive:
        machine = NodeMachine(config, republish=send)
        state = await machine.restore()
        assert receive.receive_nowait() == "resync"
        hops = _count_thread_hops(monkeypatch)
        batch: list[Effect] = [
            WriteCdiSpec(UID_A, CpuSet.parse("4-5")),
            WriteCdiSpec(UID_B, CpuSet.parse("6-7")),
            PublishSlices(state.config.topology),
            PruneCdiSpecs(frozenset({UID_B})),
        ]
        started: list[Effect] = []
        await machine.execute_batch(batch, started)
        assert started == batch
        assert hops == ["_run_file_effects", "_run_file_effects"]  # split by PublishSlices
        assert receive.receive_nowait() == "resync"
        assert cdi_files.list_our_specs(config.cdi_dir) == {UID_B: CpuSet.parse("6-7")}


async def test_a_failed_batch_names_what_began_and_leaves_no_trace_of_the_rest(
    trees: SysfsTrees, scratch: Path
) -> None:
    config = _config(trees, scratch)
    machine = NodeMachine(config)
    state = await machine.restore()
    machine.watch_state(lambda: state)
    config.state_dir.mkdir(parents=True, exist_ok=True)
    config.checkpoint_path.mkdir()  # a directory where the checkpoint goes: its write fails
    machine.apply(state, UnprepareClaim(UID_A))  # a new command: no CDI change marked yet
    batch: list[Effect] = [
        WriteCdiSpec(UID_A, CpuSet.parse("4-5")),
        WriteCheckpoint(state.checkpoint()),
        WriteCdiSpec(UID_B, CpuSet.parse("6-7")),
        DeleteCdiSpec(UID_A),
    ]
    started: list[Effect] = []

    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        await machine.execute_batch(batch, started)

    assert started == batch[:2]  # the failed one is last; the others never began
    assert cdi_files.list_our_specs(config.cdi_dir) == {UID_A: CpuSet.parse("4-5")}
    # The watcher's view has the write that happened, not the two that never began.
    assert machine.desired_specs() == {UID_A: CpuSet.parse("4-5")}


async def test_a_failed_adoption_fails_the_start_and_keeps_the_specs(
    trees: SysfsTrees, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(trees, scratch)
    _checkpoint(config, PreparedClaim(UID_A, CpuSet.parse("4-5"), "ns", "known"))
    cdi_files.write_spec(config.cdi_dir, UID_B, CpuSet.parse("8-9"))  # only its spec knows it
    before = _saved(config)

    def disk_full(store: checkpoint_file.CheckpointStore, data: CheckpointData) -> None:
        raise CheckpointError(f"cannot write checkpoint {store.path}: No space left on device")

    monkeypatch.setattr(checkpoint_file.CheckpointStore, "write", disk_full)
    with pytest.raises(DracpuError, match=r"start-up AdoptClaims failed, not starting: .*No space"):
        await NodeMachine(config).restore()
    # Neither rolled back nor pruned: the next start can still adopt the claim.
    assert cdi_files.list_our_specs(config.cdi_dir) == {UID_B: CpuSet.parse("8-9")}
    assert _saved(config) == before


async def test_the_file_thread_lives_as_long_as_the_machine(
    trees: SysfsTrees, scratch: Path
) -> None:
    config = _config(trees, scratch)
    before = set(threading.enumerate())  # other tests' machines may not be collected yet
    machine = NodeMachine(config)
    state = await machine.restore()  # its resync already runs file effects
    new, effects = machine.apply(state, _grouped(UID_A, 2))
    commit, _, _ = commit_phase(effects)
    await machine.execute_batch(commit, [])
    await anyio.sleep(0.05)
    [thread] = [t for t in set(threading.enumerate()) - before if t.name == FILE_THREAD_NAME]
    assert thread.is_alive()  # no idle end: the kubelet's calls come minutes apart
    del machine, new, effects, commit
    gc.collect()
    await anyio.to_thread.run_sync(thread.join, 5)
    assert not thread.is_alive()  # a dropped machine ends its thread
