"""The state owner and the host cgroups, in-process on a fake cgroup v2 tree: confined at the
restore and at every claim change, reported on the readiness flag, tried again while one cannot
be confined, looked at while all are (a value another writer put there is written over), and
given back what they held when the owner stops."""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu.adapters.host_cgroups import HostCgroups
from dracpu.adapters.node_files import NodeFiles
from dracpu.config import Config
from dracpu.core.commands import Command, DeviceResult, PrepareClaim, Resync, UnprepareClaim
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import ClaimPrepared
from dracpu.tasks.state_owner import Request, StateOwner, create_request_stream, request
from tests.fixtures import SysfsTrees
from tests.tasks.both_backends import anyio_backend  # noqa: F401 (a fixture)
from tests.tasks.owner_files import Flag

pytestmark = pytest.mark.anyio

UID = "aaaaaaaa-0000-4000-8000-000000000001"
STEP = 10.0  # seconds any single wait may take (2 shared cores)
MACHINE = "0-63"  # dual-socket-smt2's CPUs: all shared, none reserved


def _slice(directory: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "cgroup.controllers").write_text("cpuset cpu memory\n")
    (directory / "cgroup.subtree_control").write_text("\n")
    (directory / "cpuset.cpus").write_text("\n")


def cpus_of(root: Path, name: str) -> str:
    return (root / name / "cpuset.cpus").read_text().strip()


async def until(check: Callable[[], bool], what: str) -> None:
    with anyio.move_on_after(STEP):
        while not check():  # noqa: ASYNC110 (a file another thread writes)
            await anyio.sleep(0.005)
        return
    raise AssertionError(f"timed out waiting for {what}")


@asynccontextmanager
async def owning(
    trees: SysfsTrees, scratch: Path, cgroups: tuple[str, ...]
) -> AsyncIterator[tuple[StateOwner, MemoryObjectSendStream[Request[Command]], Flag, Path]]:
    root = scratch / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("cpuset cpu memory\n")
    _slice(root / "system.slice")
    config = Config(
        node_name="node-a",
        host_root=trees.root("dual-socket-smt2"),
        cdi_dir=scratch / "cdi",
        state_dir=scratch / "state",
        kubelet_root_dir=scratch / "kubelet",
        confine_host_cgroups=cgroups,
    )
    files = NodeFiles(
        config.cdi_dir,
        config.checkpoint_path,
        config.device_metadata_dir,
        HostCgroups(root, config.state_dir / "host-cgroups.json"),
    )
    flag = Flag()
    send: MemoryObjectSendStream[Request[Command]]
    receive: MemoryObjectReceiveStream[Request[Command]]
    send, receive = create_request_stream()
    owner = StateOwner(
        config,
        receive,
        files=files,
        host_cgroups=lambda: flag,
        cgroup_retry_delays=lambda: itertools.repeat(0.02),
        cgroup_check=0.05,
    )
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        yield owner, send, flag, root
        tg.cancel_scope.cancel()


async def test_claims_move_the_host_cgroups_and_the_stop_gives_them_back(
    trees: SysfsTrees, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with owning(trees, scratch, ("system.slice",)) as (owner, send, flag, root):
        # restored: confined to the whole shared pool, ready, saying so
        assert cpus_of(root, "system.slice") == MACHINE
        assert flag.is_ready()
        assert flag.detail == f"system.slice confined to cpus {MACHINE}"
        claim = PrepareClaim(UID, "ns", "c", (DeviceResult("r", "node-a", "cpudevnuma000", 2),))
        prepared = await request(send, claim)
        assert isinstance(prepared, ClaimPrepared)
        pool = CpuSet.parse(MACHINE) - prepared.cpus
        assert cpus_of(root, "system.slice") == str(pool)  # before Prepare answered
        assert flag.detail == f"system.slice confined to cpus {pool}"

        # another writer changes it: the next look writes it over, and says so once
        (root / "system.slice" / "cpuset.cpus").write_text("0\n")
        await until(lambda: cpus_of(root, "system.slice") == str(pool), "the value put back")
        changed = [r for r in caplog.records if "another writer changed it" in r.getMessage()]
        assert len(changed) == 1

        # a SIGHUP lists a slice that is not there: not ready, naming it, tried again
        await request(send, Resync(host_cgroups=("system.slice", "runtime.slice")))
        assert not flag.is_ready()
        assert flag.reasons[-1] == (
            f"cannot confine runtime.slice: no such cgroup: {root / 'runtime.slice'}"
        )
        _slice(root / "runtime.slice")
        await until(flag.is_ready, "runtime.slice confined by a retry")
        assert cpus_of(root, "runtime.slice") == str(pool)
        assert flag.detail == f"system.slice, runtime.slice confined to cpus {pool}"
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert sum("confining the host cgroups failed" in m for m in warned) == 1

        await request(send, UnprepareClaim(UID))
        assert cpus_of(root, "runtime.slice") == MACHINE
        assert (scratch / "state" / "host-cgroups.json").exists()
        assert [s.path for s in owner.host_cgroups()] == ["system.slice", "runtime.slice"]
    # the owner stopped: what they held is back, the record gone
    assert cpus_of(root, "system.slice") == ""
    assert cpus_of(root, "runtime.slice") == ""
    assert not (scratch / "state" / "host-cgroups.json").exists()


async def test_nothing_listed_touches_nothing(trees: SysfsTrees, scratch: Path) -> None:
    async with owning(trees, scratch, ()) as (owner, _, flag, root):
        assert owner.host_cgroups() == ()
        assert flag.reasons == []
        assert not flag.is_ready()  # never made: the factory was not called
        assert cpus_of(root, "system.slice") == ""
    assert not (scratch / "state" / "host-cgroups.json").exists()
