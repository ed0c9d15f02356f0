"""The two-slot checkpoint on real files: which slot each write goes to, padding and growth, the
restore of damaged slots, failed writes (through the store's I/O seams) and a crash model that
tears a write at any byte."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dracpu.adapters.checkpoint_file import (
    CHECKPOINT_FILE_NAME,
    CheckpointStore,
    read_newest,
    slot_paths,
)
from dracpu.core.checkpoint_schema import (
    CheckpointData,
    PreparedClaim,
    StoredCheckpoint,
    decode,
    encode,
)
from dracpu.core.commands import DeviceResult
from dracpu.core.cpuset import CpuSet
from dracpu.errors import CheckpointError

__all__: list[str] = []

UID = "7c0e5a55-1c0e-4e8a-9b1b-00000000000a"
SLOT_1 = "checkpoint.1.json"
LOGGER = "dracpu.adapters.checkpoint_file"


def data(cpus: str = "2-3") -> CheckpointData:
    claim = PreparedClaim(
        UID, CpuSet.parse(cpus), "ns", "name", None, (DeviceResult("r", "node", "cpudev002"),)
    )
    return CheckpointData(MappingProxyType({UID: claim}))


def many(count: int, first_cpu: int = 0) -> CheckpointData:
    """``count`` one-CPU claims (about 200 bytes each in the document)."""
    claims = {}
    for n in range(count):
        uid = f"00000000-0000-4000-8000-{first_cpu + n:012d}"
        result = DeviceResult("cpus", "node-a", f"cpudev{first_cpu + n:03d}")
        claims[uid] = PreparedClaim(
            uid, CpuSet([first_cpu + n]), "team", f"claim-{n}", None, (result,)
        )
    return CheckpointData(MappingProxyType(claims))


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def slots_of(path: Path) -> list[StoredCheckpoint | None]:
    """What each slot file decodes to (``None``: no file)."""
    return [decode(p.read_bytes()) if p.exists() else None for p in slot_paths(path)]


def restored(path: Path) -> CheckpointData:
    """A restart: a fresh store restores the directory."""
    return CheckpointStore(path).restore()


def version_1(claims: CheckpointData) -> bytes:
    """A checkpoint as the single-file writer of earlier builds wrote it (layout version 1)."""
    doc = json.loads(encode(claims, 1))
    del doc["sequence"], doc["checksum"]
    doc["version"] = 1
    for claim in doc["claims"].values():
        del claim["podClaimName"], claim["podUids"]  # version 3
        del claim["podNames"], claim["copierPods"]  # version 4
        del claim["sharedPool"]  # version 5
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    doc["checksum"] = "sha256:" + hashlib.sha256(canonical).hexdigest()
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / CHECKPOINT_FILE_NAME


# --- writes ---------------------------------------------------------------------------------------


def test_slot_1_sits_next_to_slot_0() -> None:
    assert slot_paths(Path("/var/lib/dracpu/checkpoint.json")) == (
        Path("/var/lib/dracpu/checkpoint.json"),
        Path("/var/lib/dracpu/checkpoint.1.json"),
    )


def test_write_then_restore(path: Path) -> None:
    store = CheckpointStore(path)
    assert store.restore() == CheckpointData()
    store.write(data())
    assert restored(path) == data()
    assert listing(path.parent) == [CHECKPOINT_FILE_NAME]


def test_writes_alternate_slots_and_count_up(path: Path) -> None:
    store = CheckpointStore(path)
    store.restore()
    contents = [data("1"), data("2"), data("3"), data("4")]
    expected: list[StoredCheckpoint | None] = [None, None]
    for sequence, content in enumerate(contents, start=1):
        store.write(content)
        expected[(sequence - 1) % 2] = StoredCheckpoint(content, sequence)
        assert slots_of(path) == expected
        assert read_newest(path) == StoredCheckpoint(content, sequence)
    assert listing(path.parent) == sorted([CHECKPOINT_FILE_NAME, SLOT_1])


@pytest.mark.parametrize("newest", [0, 1])
def test_restore_takes_the_highest_sequence_and_writes_over_the_other_slot(
    path: Path, newest: int
) -> None:
    old, new = data("5"), data("6-7")
    for index, slot in enumerate(slot_paths(path)):
        slot.write_bytes(encode(new, 9) if index == newest else encode(old, 8))
    store = CheckpointStore(path)
    assert store.restore() == new
    store.write(data("8"))
    after = slots_of(path)
    assert after[newest] == StoredCheckpoint(new, 9)  # the newest is never written over
    assert after[1 - newest] == StoredCheckpoint(data("8"), 10)
    assert restored(path) == data("8")


def test_equal_sequences_take_slot_0_with_a_warning(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    zero, one = slot_paths(path)
    zero.write_bytes(encode(data("1"), 4))
    one.write_bytes(encode(data("2"), 4))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert restored(path) == data("1")
    assert any("both hold sequence 4" in r.getMessage() for r in caplog.records)


def test_a_write_before_restore_never_overwrites_the_newest(path: Path) -> None:
    path.write_bytes(encode(data("1"), 5))
    CheckpointStore(path).write(data("2"))  # the Prepare benchmark and tests run no restore
    assert slots_of(path) == [StoredCheckpoint(data("1"), 5), StoredCheckpoint(data("2"), 6)]


def test_file_modes_are_0600_and_a_new_directory_0700(tmp_path: Path) -> None:
    path = tmp_path / "state" / "sub" / CHECKPOINT_FILE_NAME
    old_umask = os.umask(0)  # a permissive umask must not widen the modes
    try:
        store = CheckpointStore(path)
        store.write(data("1"))
        store.write(data("2"))
    finally:
        os.umask(old_umask)
    for slot in slot_paths(path):
        assert stat.S_IMODE(slot.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_existing_directory_mode_is_left_alone(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    CheckpointStore(tmp_path / CHECKPOINT_FILE_NAME).write(data())
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755


@dataclass
class Syncs:
    """The store's sync seams, recording what they synced: ``("fsync" | "fdatasync", name)``."""

    calls: list[tuple[str, str]] = field(default_factory=list)
    fail: OSError | None = None  # raised by every sync
    fail_dir: bool = False  # a directory's fsync fails with EIO

    def _record(self, kind: str, fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        is_dir = os.path.isdir(target)
        self.calls.append((kind, "<dir>" if is_dir else Path(target).name))
        if self.fail is not None:
            raise self.fail
        if is_dir and self.fail_dir:
            raise OSError(errno.EIO, "Input/output error")

    def fsync(self, fd: int) -> None:
        self._record("fsync", fd)
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        self._record("fdatasync", fd)
        os.fdatasync(fd)


def test_a_new_slot_is_fsynced_with_its_directory_an_existing_one_only_fdatasynced(
    path: Path,
) -> None:
    syncs = Syncs()
    store = CheckpointStore(path, fsync=syncs.fsync, fdatasync=syncs.fdatasync)
    store.restore()
    for cpus in ("1", "2", "3", "4"):
        store.write(data(cpus))
    assert syncs.calls == [
        ("fsync", CHECKPOINT_FILE_NAME),
        ("fsync", "<dir>"),
        ("fsync", SLOT_1),
        ("fsync", "<dir>"),
        ("fdatasync", CHECKPOINT_FILE_NAME),
        ("fdatasync", SLOT_1),
    ]


def test_a_shorter_checkpoint_is_padded_to_one_valid_document_of_the_same_size(
    path: Path,
) -> None:
    store = CheckpointStore(path)
    store.restore()
    store.write(many(40))  # slot 0
    store.write(many(40))  # slot 1
    size = path.stat().st_size
    store.write(data())  # slot 0 again, much shorter
    raw = path.read_bytes()
    assert len(raw) == size
    assert json.loads(raw) == json.loads(encode(data(), 3))
    document = encode(data(), 3)
    assert raw == document + b" " * (size - len(document))
    assert restored(path) == data()


def test_slots_stay_valid_documents_through_growing_and_shrinking(path: Path) -> None:
    store = CheckpointStore(path)
    store.restore()
    sizes = [0, 30, 2, 60, 1, 1, 25, 0, 61, 3, 12, 12, 0, 4]
    high = 0
    for sequence, count in enumerate(sizes, start=1):
        content = many(count, first_cpu=sequence)
        store.write(content)
        high = max(high, len(encode(content, sequence)))
        for slot in slot_paths(path)[: min(sequence, 2)]:
            raw = slot.read_bytes()
            assert json.loads(raw) == json.loads(raw.rstrip(b" "))  # one document + padding
            decode(raw)  # valid: the older one too
        assert read_newest(path) == StoredCheckpoint(content, sequence)
    assert max(p.stat().st_size for p in slot_paths(path)) >= high  # grown, never truncated
    assert restored(path) == many(4, first_cpu=len(sizes))


def test_a_version_1_checkpoint_of_an_earlier_build_restores_and_is_kept_until_superseded(
    path: Path,
) -> None:
    old = version_1(many(3))
    path.write_bytes(old)
    store = CheckpointStore(path)
    assert store.restore() == many(3)
    store.write(many(2))  # slot 1 (sequence 1): the old file is the newest until this returns
    assert path.read_bytes() == old
    store.write(many(1))  # now slot 0 is overwritten in place, padded over the longer old file
    assert slots_of(path) == [StoredCheckpoint(many(1), 2), StoredCheckpoint(many(2), 1)]
    assert path.stat().st_size == len(old)
    assert restored(path) == many(1)


def test_after_an_upgrade_the_first_write_in_slot_1_beats_the_version_1_slot_0(
    path: Path,
) -> None:
    path.write_bytes(version_1(many(3)))
    store = CheckpointStore(path)
    store.restore()
    store.write(many(5))  # slot 1, sequence 1; then the daemon stops before the next write
    assert restored(path) == many(5)


def test_a_version_1_slot_0_written_after_a_downgrade_beats_the_stale_slot_1(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(path)
    for count in (1, 2, 3):
        store.write(many(count))  # slot 0: sequence 3, slot 1: sequence 2
    # An earlier build (one file, version 1, rename) runs for a while, then this one again.
    path.write_bytes(version_1(many(4)))
    store = CheckpointStore(path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.restore() == many(4)  # not slot 1's stale claims
    assert any("a downgrade and upgrade" in r.getMessage() for r in caplog.records)
    store.write(many(6))  # over the stale slot 1, counting from the version-1 document
    assert slots_of(path) == [StoredCheckpoint(many(4), 0), StoredCheckpoint(many(6), 1)]
    assert restored(path) == many(6)


# --- restore --------------------------------------------------------------------------------------


def test_missing_slots_restore_empty(path: Path) -> None:
    assert read_newest(path) is None
    assert restored(path) == CheckpointData()
    assert listing(path.parent) == []


@pytest.mark.parametrize("index", [0, 1])
def test_an_unreadable_slot_fails_the_restore_and_changes_nothing(path: Path, index: int) -> None:
    slots = slot_paths(path)
    slots[1 - index].write_bytes(b"junk")  # would be moved aside, but the restore fails first
    slots[index].mkdir()  # reading a directory fails (EISDIR) even as root
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint {slots[index]}"):
        restored(path)
    assert slots[index].is_dir()
    assert slots[1 - index].read_bytes() == b"junk"


@pytest.mark.parametrize("damaged", [0, 1])
def test_a_damaged_slot_is_moved_aside_with_a_warning_and_the_other_used(
    path: Path, caplog: pytest.LogCaptureFixture, damaged: int
) -> None:
    slots = slot_paths(path)
    torn = encode(data("9"), 8)[:-30]  # a write cut short: never acknowledged
    slots[damaged].write_bytes(torn)
    slots[1 - damaged].write_bytes(encode(data("4"), 7))
    store = CheckpointStore(path)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert store.restore() == data("4")
    moved = slots[damaged].with_name(slots[damaged].name + ".corrupt-1")
    assert moved.read_bytes() == torn
    assert not slots[damaged].exists()
    [warning] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.levelno == logging.WARNING
    message = warning.getMessage()
    assert str(slots[damaged]) in message
    assert str(moved) in message
    assert f"using {slots[1 - damaged]} (sequence 7)" in message
    store.write(data("5"))  # into the damaged slot's place, numbered after the one used
    assert slots_of(path)[damaged] == StoredCheckpoint(data("5"), 8)
    assert restored(path) == data("5")


def test_both_slots_damaged_are_both_moved_aside_with_errors_and_the_state_is_empty(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    zero, one = slot_paths(path)
    zero.write_bytes(b"{not json")
    one.write_bytes(encode(data(), 2)[:-9])
    store = CheckpointStore(path)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert store.restore() == CheckpointData()
    assert listing(path.parent) == sorted(
        [f"{CHECKPOINT_FILE_NAME}.corrupt-1", f"{SLOT_1}.corrupt-1"]
    )
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert all("no checkpoint slot is valid" in m for m in errors)
    store.write(data())
    assert slots_of(path) == [StoredCheckpoint(data(), 1), None]


def corrupt_cases() -> list[tuple[str, bytes]]:
    good = encode(data(), 1)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x04
    doc = json.loads(good)
    doc["version"] = 7
    wrong_version = json.dumps(doc).encode()
    doc = json.loads(good)
    doc["checksum"] = "sha256:" + "0" * 64
    wrong_checksum = json.dumps(doc).encode()
    return [
        ("flipped-byte", bytes(flipped)),
        ("wrong-version", wrong_version),
        ("wrong-checksum", wrong_checksum),
        ("not-json", b"\x00\x01garbage"),
        ("wrong-shape", b'["version", 1]'),
        ("empty", b""),
        ("spaces", b" " * 4096),
    ]


@pytest.mark.parametrize(("case", "raw"), corrupt_cases())
def test_a_corrupt_only_slot_is_moved_aside_and_state_starts_empty(
    path: Path, caplog: pytest.LogCaptureFixture, case: str, raw: bytes
) -> None:
    path.write_bytes(raw)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert restored(path) == CheckpointData()
    assert not path.exists()
    moved = path.with_name(f"{CHECKPOINT_FILE_NAME}.corrupt-1")
    assert moved.read_bytes() == raw
    assert listing(path.parent) == [moved.name]
    assert any(
        r.levelno == logging.ERROR and "unusable" in r.getMessage() and str(moved) in r.getMessage()
        for r in caplog.records
    )


def test_truncation_at_every_length_is_moved_aside(path: Path) -> None:
    good = encode(data(), 1)
    for length in range(len(good) - 1):  # the last byte is the newline
        path.write_bytes(good[:length])
        assert restored(path) == CheckpointData(), length
        moved = path.with_name(f"{CHECKPOINT_FILE_NAME}.corrupt-{length + 1}")
        assert moved.read_bytes() == good[:length]
    # every earlier file is still there, none overwritten
    assert len(listing(path.parent)) == len(good) - 1


def test_moved_aside_files_are_never_overwritten(path: Path) -> None:
    directory = path.parent
    (directory / f"{CHECKPOINT_FILE_NAME}.corrupt-1").write_bytes(b"first")
    (directory / f"{CHECKPOINT_FILE_NAME}.corrupt-3").write_bytes(b"third")
    path.write_bytes(b"second")
    restored(path)
    path.write_bytes(b"fourth")
    restored(path)
    contents = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert contents == {
        f"{CHECKPOINT_FILE_NAME}.corrupt-1": b"first",
        f"{CHECKPOINT_FILE_NAME}.corrupt-2": b"second",
        f"{CHECKPOINT_FILE_NAME}.corrupt-3": b"third",
        f"{CHECKPOINT_FILE_NAME}.corrupt-4": b"fourth",
    }


def test_read_newest_changes_no_file(path: Path) -> None:
    zero, one = slot_paths(path)
    zero.write_bytes(b"junk")
    one.write_bytes(encode(data(), 3))
    assert read_newest(path) == StoredCheckpoint(data(), 3)
    assert zero.read_bytes() == b"junk"
    assert listing(path.parent) == sorted([CHECKPOINT_FILE_NAME, SLOT_1])


def test_restore_removes_temp_files_of_the_rename_based_writer(path: Path) -> None:
    store = CheckpointStore(path)
    store.write(data())
    good = path.read_bytes()
    # What a SIGKILL during a write of an earlier build left behind.
    leftover = path.with_name(f".{CHECKPOINT_FILE_NAME}.k1ll3d.tmp")
    leftover.write_bytes(b'{"version": 1')
    unrelated = path.with_name("notes.tmp")
    unrelated.write_bytes(b"keep me")
    assert restored(path) == data()
    assert listing(path.parent) == [CHECKPOINT_FILE_NAME, "notes.tmp"]
    assert path.read_bytes() == good
    assert unrelated.read_bytes() == b"keep me"


# --- failed writes --------------------------------------------------------------------------------


def test_a_file_in_the_way_of_the_directory_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "state" / CHECKPOINT_FILE_NAME
    store = CheckpointStore(path)
    assert store.restore() == CheckpointData()
    (tmp_path / "state").write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"cannot write checkpoint {path}: "):
        store.write(data())
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint {path}: "):
        CheckpointStore(path).write(data())  # a store that did not restore reads first


@dataclass
class FailingPwrite:
    """``os.pwrite`` that, when armed, writes only the first half of what it is given and then
    fails as a full disk would."""

    armed: bool = False

    def __call__(self, fd: int, buffer: memoryview, offset: int) -> int:
        if not self.armed:
            return os.pwrite(fd, buffer, offset)
        os.pwrite(fd, buffer[: len(buffer) // 2], offset)
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("failing", ["fdatasync", "pwrite"])
def test_a_failed_write_keeps_the_previous_checkpoint_and_the_next_write_works(
    path: Path, failing: str
) -> None:
    syncs, pwrite = Syncs(), FailingPwrite()
    store = CheckpointStore(path, fdatasync=syncs.fdatasync, pwrite=pwrite)
    store.restore()
    store.write(many(3))  # slot 0, sequence 1
    store.write(many(4))  # slot 1, sequence 2: the newest
    newest = slot_paths(path)[1].read_bytes()
    if failing == "fdatasync":
        syncs.fail = OSError(errno.EIO, "Input/output error")
    else:
        pwrite.armed = True
    with pytest.raises(CheckpointError, match=f"cannot write checkpoint {path}: "):
        store.write(many(5))
    assert slot_paths(path)[1].read_bytes() == newest  # never touched
    assert read_newest(path) == StoredCheckpoint(many(4), 2)  # what a restart would restore
    syncs.fail, pwrite.armed = None, False
    store.write(many(4))  # the state owner's rollback: the old state, into the same slot again
    assert slots_of(path) == [StoredCheckpoint(many(4), 3), StoredCheckpoint(many(4), 2)]
    store.write(many(6))
    assert restored(path) == many(6)


def full_disk(fd: int, buffer: memoryview, offset: int) -> int:
    """``os.pwrite`` on a full file system: what fits in the file's blocks is written (a
    regular file's blocks below its size are its own), nothing beyond."""
    room = os.fstat(fd).st_size - offset
    if room <= 0:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return os.pwrite(fd, buffer[:room], offset)


def test_on_a_full_disk_only_a_slot_that_must_be_created_or_grow_fails(path: Path) -> None:
    store = CheckpointStore(path, pwrite=full_disk)
    store.restore()
    with pytest.raises(CheckpointError) as failed:
        store.write(data())
    # The cause in words, and no empty slot left to be moved aside as damaged at the next start.
    assert str(failed.value) == f"cannot write checkpoint {path}: No space left on device"
    assert listing(path.parent) == []
    # The rollback of that write: the content the (missing) newest checkpoint holds, no write.
    store.write(CheckpointData(), skip_unchanged=True)
    assert listing(path.parent) == []
    assert CheckpointStore(path).restore() == CheckpointData()
    # Slots that exist take any document that fits in them, full disk or not.
    roomy = CheckpointStore(path)
    roomy.write(many(3))
    roomy.write(many(3))
    store = CheckpointStore(path, pwrite=full_disk)
    store.write(many(5))
    assert restored(path) == many(5)
    with pytest.raises(CheckpointError, match="No space left on device"):
        store.write(many(40))  # past the slot's 4 KiB
    assert restored(path) == many(5)


def test_the_undo_of_a_failed_write_is_written_only_when_the_write_may_have_left_a_document(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    syncs = Syncs()
    spoiling = FailingPwrite()  # armed: fails the one-byte mark of a failed write

    def pwrite(fd: int, buffer: memoryview, offset: int) -> int:
        if len(buffer) == 1 and spoiling.armed:
            raise OSError(errno.EIO, "Input/output error")
        return os.pwrite(fd, buffer, offset)

    store = CheckpointStore(path, fdatasync=syncs.fdatasync, pwrite=pwrite)
    store.write(many(3))  # slot 0, sequence 1
    store.write(many(4))  # slot 1, sequence 2: the newest
    # The sync fails after the whole document went in, and it cannot be marked invalid: the
    # slot may hold a newer valid document, so the undo is a real write.
    syncs.fail = OSError(errno.EIO, "Input/output error")
    spoiling.armed = True
    with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(CheckpointError):
        store.write(many(5))
    assert read_newest(path) == StoredCheckpoint(many(5), 3)  # what the undo must replace
    assert "cannot mark the failed checkpoint write of " in caplog.text
    syncs.fail, spoiling.armed = None, False
    store.write(many(4), skip_unchanged=True)
    assert read_newest(path) == StoredCheckpoint(many(4), 3)
    # Marked invalid: nothing to undo, nothing written.
    syncs.fail = OSError(errno.EIO, "Input/output error")
    with pytest.raises(CheckpointError):
        store.write(many(6))
    syncs.fail = None
    before = [p.read_bytes() for p in slot_paths(path)]
    store.write(many(4), skip_unchanged=True)
    assert [p.read_bytes() for p in slot_paths(path)] == before
    assert read_newest(path) == StoredCheckpoint(many(4), 3)


def test_a_state_dir_that_cannot_be_created_names_it(tmp_path: Path) -> None:
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere" / "at-all")  # a dangling link
    path = tmp_path / "gone" / "state" / CHECKPOINT_FILE_NAME
    store = CheckpointStore(path)
    assert store.restore() == CheckpointData()
    with pytest.raises(CheckpointError) as failed:
        store.write(data())
    assert str(failed.value) == (
        f"cannot write checkpoint {path}: cannot create its dir {path.parent}: File exists"
    )


def test_a_restart_after_a_failed_write_restores_the_previous_checkpoint(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    syncs = Syncs()
    store = CheckpointStore(path, fdatasync=syncs.fdatasync)
    store.write(many(1))
    store.write(many(2))
    syncs.fail = OSError(errno.EIO, "Input/output error")
    with pytest.raises(CheckpointError):
        store.write(many(3))
    fresh = CheckpointStore(path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert fresh.restore() == many(2)
    assert any(
        f"using {slot_paths(path)[1]} (sequence 2)" in r.getMessage() for r in caplog.records
    )
    fresh.write(many(4))
    assert restored(path) == many(4)


def test_a_failed_directory_sync_of_a_new_slot_is_retried_by_the_next_write(path: Path) -> None:
    syncs = Syncs(fail_dir=True)
    store = CheckpointStore(path, fsync=syncs.fsync, fdatasync=syncs.fdatasync)
    store.restore()
    with pytest.raises(CheckpointError, match=f"cannot write checkpoint {path}"):
        store.write(data("1"))
    syncs.fail_dir = False
    syncs.calls.clear()
    store.write(data("2"))  # slot 0 exists now, but its entry was never made durable
    assert syncs.calls == [("fdatasync", CHECKPOINT_FILE_NAME), ("fsync", "<dir>")]
    assert slots_of(path) == [StoredCheckpoint(data("2"), 1), None]
    assert restored(path) == data("2")


# --- the crash model ------------------------------------------------------------------------------


class Crash(Exception):
    """The power went out in the middle of a write (not an OSError: the store gets no chance to
    react, as with a real power loss)."""


SECTOR = 512  # what a disk writes atomically at best; a crash may keep any subset of sectors
POOL = [many(n, first_cpu=n) for n in (0, 1, 2, 5, 20, 45)]  # ~80 B to ~9 KB


@dataclass
class Tear:
    """How the slot being written looks after the crash, byte by byte: new, old or zero."""

    mode: str  # "prefix": new bytes up to `cut`, old after; "sectors": each sector chosen
    cut: float  # fraction of the new bytes written, for "prefix"
    sectors: list[int]  # per sector 0 = new, 1 = old, 2 = zeros, for "sectors"
    grown: bool  # the file's size already grew (when the write grows it)
    vanished: bool  # a slot created by this write: its directory entry was not durable


tears = st.builds(
    Tear,
    st.sampled_from(["prefix", "sectors"]),
    st.floats(0, 1),
    st.lists(st.integers(0, 2), max_size=32),
    st.booleans(),
    st.booleans(),
)


@dataclass
class Tearing:
    """``os.pwrite`` that, when given a :class:`Tear`, leaves the file as that crash would and
    raises :class:`Crash`. Records the slot bytes it left."""

    tear: Tear | None = None
    left: bytes | None = None  # what the torn slot holds (None: it vanished)

    def __call__(self, fd: int, buffer: memoryview, offset: int) -> int:
        if self.tear is None:
            return os.pwrite(fd, buffer, offset)
        tear, self.tear = self.tear, None
        slot = Path(os.readlink(f"/proc/self/fd/{fd}"))  # the store opened it write-only
        old = slot.read_bytes()
        new = bytes(buffer)
        assert offset == 0
        length = max(len(old), len(new)) if tear.grown else len(old)
        torn = bytearray(length)
        for i in range(length):
            if tear.mode == "prefix":
                source = 0 if i < tear.cut * len(new) else 1
            else:
                index = i // SECTOR
                source = tear.sectors[index] if index < len(tear.sectors) else 1
            if source == 0 and i < len(new):
                torn[i] = new[i]
            elif source != 2 and i < len(old):
                torn[i] = old[i]
        slot.write_bytes(bytes(torn))
        if tear.vanished and not old:  # created by this write
            slot.unlink()
            self.left = None
        else:
            self.left = bytes(torn)
        raise Crash


def _nosync(fd: int) -> None:
    """No fsync in the crash model: the kernel never loses a page here, the Tear does."""


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_a_crash_in_any_write_never_loses_the_last_acknowledged_checkpoint(
    draw: st.DataObject,
) -> None:
    with tempfile.TemporaryDirectory(prefix="dracpu-crash-") as tmp:
        path = Path(tmp) / "state" / CHECKPOINT_FILE_NAME
        tearing = Tearing()

        def boot() -> tuple[CheckpointStore, CheckpointData]:
            store = CheckpointStore(path, pwrite=tearing, fdatasync=_nosync, fsync=_nosync)
            return store, store.restore()

        store, _ = boot()
        acknowledged = CheckpointData()
        sequence = 0  # of the acknowledged checkpoint, as far as the test can tell
        for _ in range(draw.draw(st.integers(1, 14), label="writes")):
            content = draw.draw(st.sampled_from(POOL), label="content")
            tear = draw.draw(st.none() | tears, label="tear")
            if tear is None:
                store.write(content)
                acknowledged = content
                sequence += 1
                continue
            tearing.tear = tear
            with pytest.raises(Crash):
                store.write(content)
            # The torn slot either holds the new document whole, or does not hold the newest.
            complete = False
            if tearing.left is not None:
                try:
                    stored = decode(tearing.left)
                except CheckpointError:
                    pass
                else:
                    complete = stored.sequence > sequence
                    if complete:
                        assert stored == StoredCheckpoint(content, sequence + 1)
            store, data_after = boot()  # the reboot
            if complete:
                acknowledged = content
                sequence += 1
            assert data_after == acknowledged
            newest = None if sequence == 0 else StoredCheckpoint(acknowledged, sequence)
            assert read_newest(path) == newest
        assert boot()[1] == acknowledged
