"""The state dir's locks and the hand-over's steps, with two owners in one process (``flock``
locks belong to open files: two opens of one file conflict as two processes do)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from dracpu.adapters.state_lock import FileLock, StateLockError
from dracpu.tasks.handover import LEAVING_POD, OWNER_LOCK, HandOver
from tests.tasks.both_backends import anyio_backend  # noqa: F401 (a fixture)

pytestmark = pytest.mark.anyio


def test_a_lock_is_exclusive_until_released_and_names_its_holder(tmp_path: Path) -> None:
    first, second = FileLock(tmp_path / "x.lock"), FileLock(tmp_path / "x.lock")
    assert first.try_acquire()
    assert first.try_acquire()  # already held: still ours
    assert not second.try_acquire()
    assert second.holder().startswith("pid ")
    first.release()
    assert second.try_acquire()
    assert (tmp_path / "x.lock").stat().st_mode & 0o777 == 0o600


def test_a_lock_file_that_cannot_be_made_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(StateLockError, match=r"cannot open lock file .*/file/x\.lock: Not a dir"):
        FileLock(tmp_path / "file" / "x.lock").try_acquire()


async def test_the_hand_over_steps_in_order(tmp_path: Path) -> None:
    old, new = HandOver(tmp_path, poll=0.001), HandOver(tmp_path, poll=0.001)
    assert old.try_own()
    assert not old.successor_waiting()
    assert not new.try_own()
    await new.become_successor()
    assert old.successor_waiting()
    async with anyio.create_task_group() as tg:
        owned = anyio.Event()

        async def take_over() -> None:
            await new.wait_own()
            owned.set()

        tg.start_soon(take_over)
        await anyio.sleep(0.02)
        assert not owned.is_set()  # the owner has not released
        old.release()
        with anyio.fail_after(5):
            await owned.wait()
    assert (tmp_path / OWNER_LOCK).read_text().startswith("pid ")
    # The old one waits for the new one to be configured by the runtime, at most its timeout.
    assert not await old.wait_successor(0.02)
    new.configured()
    assert await old.wait_successor(5)
    new.close()
    old.close()


async def test_the_successor_learns_which_pod_leaves_once(tmp_path: Path) -> None:
    old, new = HandOver(tmp_path, poll=0.001), HandOver(tmp_path, poll=0.001)
    assert old.try_own()
    await new.become_successor()
    old.release("6f1c0f4e-1111-4222-8333-444455556666")
    with anyio.fail_after(5):
        await new.wait_own()
    assert new.predecessor_pod == "6f1c0f4e-1111-4222-8333-444455556666"
    assert not (tmp_path / LEAVING_POD).exists()  # read once: no later start takes it for its own
    # A predecessor that could not say (no POD_UID, an older build): nothing is left out.
    new.release()
    later = HandOver(tmp_path, poll=0.001)
    with anyio.fail_after(5):
        await later.wait_own()
    assert later.predecessor_pod is None
    later.close()
    new.close()
    old.close()


async def test_a_state_dir_without_locks_is_owned_without_a_hand_over(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("a file where the dir should be")
    handover = HandOver(tmp_path / "state")
    assert handover.try_own()
    assert not handover.usable
    assert not handover.successor_waiting()
