"""The CDI watcher observes, the state owner writes: the real watcher (watchfiles on a scratch
dir) and the real owner over real files, the claims prepared through the owner.

What a user sees: a spec or a metadata file deleted or edited while the daemon runs comes
back, a file of ours no claim owns goes, another vendor's file is never touched; and a watcher
pass during a Prepare or an Unprepare of the same claim leaves one consistent result (the
owner decides in order with the command, from its state then).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu.adapters.cdi_files import temp_file_name, write_spec
from dracpu.config import Config
from dracpu.core.cdi_spec import spec_bytes, spec_file_name
from dracpu.core.commands import Command, DeviceResult, PrepareClaim, UnprepareClaim
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import ClaimPrepared, WriteCheckpoint
from dracpu.tasks import cdi_watcher
from dracpu.tasks.state_owner import Request, StateOwner, create_request_stream, request
from tests.fixtures import SysfsTrees
from tests.tasks.both_backends import anyio_backend  # noqa: F401 (a fixture)
from tests.tasks.owner_files import Files

pytestmark = pytest.mark.anyio

A = "8ec6fd12-bb08-4936-a857-866f50153c21"
B = "0b7e3a52-4c1f-4d7e-9a31-2f9a4c1d5e60"
STEP = 10.0  # seconds any single wait of a test may take (2 shared cores)

VENDOR = {
    "nvidia.com-gpu.yaml": b"---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\n",
    "dra.cpu.json": b'{"cdiVersion":"0.8.0","kind":"dra.k8s.io/cpu","devices":[]}',
    "dra.k8s.io-cpu_claim-not-a-uid.json": b"{}",
    f"dra.k8s.io-cpu_claim-{A}.yaml": b"a .yaml is not ours",
    f".dra.k8s.io-cpu_claim-{A}.json.tmp-": b"not our temp pattern",
}


@dataclass
class Node:
    config: Config
    owner: StateOwner
    send: MemoryObjectSendStream[Request[Command]]
    files: Files
    tg: anyio.abc.TaskGroup

    async def prepare(self, uid: str, device: str = "cpudevnuma000") -> CpuSet:
        result = DeviceResult("cpus", "node-a", device, consumed_cpus=2)
        prepared = await request(self.send, PrepareClaim(uid, "ns", "claim", (result,)))
        assert isinstance(prepared, ClaimPrepared)
        return prepared.cpus

    def repairs(self) -> int:
        return self.owner.statistics().by_command.get(("RepairNodeFiles", "ok"), 0)

    def spec(self, uid: str) -> Path:
        return self.config.cdi_dir / spec_file_name(uid)

    def metadata(self, uid: str) -> tuple[Path, Path]:
        """The claim's metadata CDI spec and file (request ``cpus``)."""
        cdi, root = self.config.cdi_dir, self.config.device_metadata_dir
        return cdi / f"dra.cpu_metadata_{uid}_cpus.json", root / f"{uid}_cpus.json"


@asynccontextmanager
async def running(
    trees: SysfsTrees, scratch: Path, *, resync_interval: float = 30.0, polling: bool = False
) -> AsyncIterator[Node]:
    """The owner, then the watcher (a long resync: these tests prove the event path)."""
    config = Config(
        node_name="node-a",
        host_root=trees.root("dual-socket-smt2"),
        cdi_dir=scratch / "cdi",
        state_dir=scratch / "state",
        kubelet_root_dir=scratch / "kubelet",
    )
    files = Files(config)
    send: MemoryObjectSendStream[Request[Command]]
    receive: MemoryObjectReceiveStream[Request[Command]]
    send, receive = create_request_stream()
    owner = StateOwner(config, receive, files=files, retry_delays=lambda: itertools.repeat(0.02))
    async with send, send.clone() as watcher_send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        await tg.start(
            functools.partial(
                cdi_watcher.run,
                config.cdi_dir,
                config.device_metadata_dir,
                lambda: owner.state,
                functools.partial(request, watcher_send),
                resync_interval=resync_interval,
                force_polling=polling,
            )
        )
        yield Node(config, owner, send, files, tg)
        tg.cancel_scope.cancel()


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll until ``condition()`` holds (files and a worker thread have no event of ours)."""
    with anyio.move_on_after(STEP):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.01)
        return
    raise AssertionError(f"timed out waiting for {what}")


def _holds(path: Path, data: bytes) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return path.read_bytes() == data
        except FileNotFoundError:
            return False

    return check


def _vendor_state(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {
        name: ((directory / name).read_bytes(), (directory / name).stat().st_mtime_ns)
        for name in VENDOR
    }


# --- drift is put right by the owner -------------------------------------------------------------


async def test_a_spec_deleted_while_running_is_written_again_by_the_owner(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch) as node:
        cpus = await node.prepare(A)
        node.files.ran.clear()
        node.spec(A).unlink()
        await until(_holds(node.spec(A), spec_bytes(A, cpus)), "the spec back")
        await until(lambda: len(node.files.ran) == 2, "the claim's metadata looked at")
        assert node.repairs() == 1
        assert [type(e).__name__ for e in node.files.ran] == [
            "WriteCdiSpec",
            "WriteDeviceMetadata",  # in place already: left alone
        ]


async def test_an_edited_spec_and_another_drivers_spec_under_our_name_are_rewritten(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch) as node:
        cpus = await node.prepare(A)
        node.spec(A).write_bytes(spec_bytes(A, CpuSet.parse("40-47")))
        await until(_holds(node.spec(A), spec_bytes(A, cpus)), "the edit undone")
        # Upstream's driver names its specs as we do (cdiVersion 0.8.0): ours by kind.
        node.spec(A).write_bytes(spec_bytes(A, cpus).replace(b'"0.5.0"', b'"0.8.0"'))
        await until(_holds(node.spec(A), spec_bytes(A, cpus)), "our bytes back")


async def test_an_orphan_spec_is_removed_and_other_vendors_files_are_never_touched(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch) as node:
        cdi = node.config.cdi_dir
        for name, data in VENDOR.items():
            (cdi / name).write_bytes(data)
        vendor = _vendor_state(cdi)
        write_spec(cdi, B, CpuSet.parse("3"))  # no prepared claim owns it
        await until(lambda: not node.spec(B).exists(), "the orphan gone")
        await node.prepare(A)
        node.spec(A).unlink()
        await until(lambda: node.spec(A).exists(), "the spec back")
        assert _vendor_state(cdi) == vendor


async def test_device_metadata_deleted_or_edited_is_written_again(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch) as node:
        await node.prepare(A)
        spec, document = node.metadata(A)
        want_spec, want_document = spec.read_bytes(), document.read_bytes()
        document.unlink()
        await until(_holds(document, want_document), "the metadata file back")
        spec.unlink()
        await until(_holds(spec, want_spec), "the metadata spec back")
        document.write_bytes(b"{}")
        await until(_holds(document, want_document), "the edit undone")
        assert node.repairs() == 3


async def test_metadata_and_leftovers_no_claim_owns_are_removed(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch, resync_interval=0.5) as node:
        await node.prepare(A)
        spec, document = node.metadata(A)
        orphan_spec = spec.with_name(spec.name.replace(A, B))
        orphan_spec.write_bytes(spec.read_bytes())
        await until(lambda: not orphan_spec.exists(), "the orphan metadata spec gone")
        leftover = node.config.cdi_dir / temp_file_name(B)  # a write cut short by a crash
        leftover.write_bytes(b"partial")
        # A temp file is no event (runtimes ignore it too): the next full pass finds it.
        await until(lambda: not leftover.exists(), "the leftover gone")
        assert spec.exists()
        assert document.exists()


async def test_a_missing_file_is_found_by_the_periodic_pass_and_when_polling(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch, resync_interval=0.2, polling=True) as node:
        cpus = await node.prepare(A)
        node.spec(A).unlink()
        await until(_holds(node.spec(A), spec_bytes(A, cpus)), "the spec back")


async def test_a_replaced_dir_is_watched_again(trees: SysfsTrees, scratch: Path) -> None:
    async with running(trees, scratch) as node:
        cpus = await node.prepare(A)
        cdi = node.config.cdi_dir
        cdi.rename(scratch / "old-cdi")
        cdi.mkdir()
        await until(_holds(node.spec(A), spec_bytes(A, cpus)), "the spec in the new dir")


# --- one writer: a pass during a command of the same claim ---------------------------------------


async def test_a_pass_during_a_prepare_of_the_claim_leaves_its_spec_alone(
    trees: SysfsTrees, scratch: Path
) -> None:
    # The owner writes the spec before it commits the claim (the checkpoint comes between): a
    # pass then finds a spec no committed claim owns. It only asks the owner, whose answer
    # comes after the Prepare: the spec is never removed (a watcher that removed orphans
    # itself would take it away under the Prepare's answer).
    async with running(trees, scratch) as node:
        with node.files.holding(WriteCheckpoint) as gate:
            prepared: list[CpuSet] = []

            async def prepare() -> None:
                prepared.append(await node.prepare(A))

            node.tg.start_soon(prepare)
            await until(lambda: WriteCheckpoint in node.files.held, "the held checkpoint")
            inode = node.spec(A).stat().st_ino
            await until(lambda: node.owner.statistics().queue_depth == 1, "the watcher's ask")
            assert A not in node.owner.state.claims
            assert node.spec(A).stat().st_ino == inode
            gate.set()
        await until(lambda: node.repairs() == 1, "the repair after the prepare")
        assert node.owner.state.claims[A].cpus == prepared[0]
        assert node.spec(A).stat().st_ino == inode  # never removed, nor written again
        assert node.spec(A).read_bytes() == spec_bytes(A, prepared[0])


async def test_a_pass_during_an_unprepare_of_the_claim_does_not_bring_the_spec_back(
    trees: SysfsTrees, scratch: Path
) -> None:
    async with running(trees, scratch) as node:
        await node.prepare(A)
        with node.files.holding(WriteCheckpoint) as gate:
            node.tg.start_soon(request, node.send, UnprepareClaim(A))
            await until(lambda: WriteCheckpoint in node.files.held, "the held checkpoint")
            await until(lambda: node.owner.statistics().queue_depth == 1, "the watcher's ask")
            assert A in node.owner.state.claims  # not committed yet, its spec gone
            assert not node.spec(A).exists()
            gate.set()
        await until(lambda: node.repairs() == 1, "the repair after the unprepare")
        assert node.owner.state.claims == {}
        assert not node.spec(A).exists()
        assert not any(p.exists() for p in node.metadata(A))


async def test_cancellation_is_prompt(trees: SysfsTrees, scratch: Path) -> None:
    resync = 30.0
    with anyio.fail_after(2 * resync):
        async with running(trees, scratch, resync_interval=resync) as node:
            started = time.monotonic()
            node.tg.cancel_scope.cancel()
    # The watch thread waits up to resync_interval for events; the stop event must end it, not
    # the next resync (half the interval: a bound no loaded machine reaches by itself).
    assert time.monotonic() - started < resync / 2
