from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from types import MappingProxyType

import pytest

from dracpu.adapters.checkpoint_file import (
    CHECKPOINT_FILE_NAME,
    load_checkpoint,
    restore,
    write_checkpoint,
)
from dracpu.core.checkpoint_schema import CheckpointData, PreparedClaim, encode
from dracpu.core.commands import DeviceResult
from dracpu.core.cpuset import CpuSet
from dracpu.errors import CheckpointError

__all__: list[str] = []

UID = "7c0e5a55-1c0e-4e8a-9b1b-00000000000a"


def data(cpus: str = "2-3") -> CheckpointData:
    claim = PreparedClaim(
        UID, CpuSet.parse(cpus), "ns", "name", None, (DeviceResult("r", "node", "cpudev002"),)
    )
    return CheckpointData(MappingProxyType({UID: claim}))


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_write_then_restore(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE_NAME
    write_checkpoint(path, encode(data()))
    assert dict(restore(path).claims) == dict(data().claims)
    assert listing(tmp_path) == [CHECKPOINT_FILE_NAME]


def test_file_mode_is_0600_and_new_directory_0700(tmp_path: Path) -> None:
    path = tmp_path / "state" / "sub" / CHECKPOINT_FILE_NAME
    old_umask = os.umask(0)  # a permissive umask must not widen the modes
    try:
        write_checkpoint(path, b"x")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_existing_directory_mode_is_left_alone(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    write_checkpoint(tmp_path / CHECKPOINT_FILE_NAME, b"x")
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755


def test_overwrite_replaces_content(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE_NAME
    write_checkpoint(path, encode(data("2-3")))
    write_checkpoint(path, encode(data("6")))
    assert restore(path).claims[UID].cpus == CpuSet.parse("6")
    assert listing(tmp_path) == [CHECKPOINT_FILE_NAME]


def test_temp_file_is_in_the_same_directory_and_never_ends_with_json(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE_NAME
    seen: list[Path] = []

    def peek(tmp: Path) -> None:
        seen.append(tmp)
        assert tmp.read_bytes() == b"new"
        assert stat.S_IMODE(tmp.stat().st_mode) == 0o600

    write_checkpoint(path, b"new", before_rename=peek)
    assert len(seen) == 1
    assert seen[0].parent == tmp_path
    assert not seen[0].name.endswith(".json")
    assert not seen[0].exists()
    assert path.read_bytes() == b"new"


def test_failure_before_rename_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE_NAME
    good = encode(data())
    write_checkpoint(path, good)

    def crash(tmp: Path) -> None:
        raise OSError(5, "Input/output error")

    with pytest.raises(CheckpointError, match=f"cannot write checkpoint {path}"):
        write_checkpoint(path, encode(data("9")), before_rename=crash)
    assert path.read_bytes() == good
    assert listing(tmp_path) == [CHECKPOINT_FILE_NAME]  # temp file removed


def test_directory_in_the_way_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        write_checkpoint(tmp_path / "file" / CHECKPOINT_FILE_NAME, b"x")


def test_missing_file_restores_empty(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE_NAME
    assert load_checkpoint(path) is None
    assert dict(restore(path).claims) == {}
    assert listing(tmp_path) == []


def test_unreadable_file_raises_instead_of_starting_empty(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE_NAME
    path.mkdir()  # reading a directory fails (EISDIR) even as root
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        restore(path)
    assert path.is_dir()


def corrupt_cases() -> list[tuple[str, bytes]]:
    good = encode(data())
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
    ]


@pytest.mark.parametrize(("case", "raw"), corrupt_cases())
def test_corrupt_file_is_moved_aside_and_state_starts_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str, raw: bytes
) -> None:
    path = tmp_path / CHECKPOINT_FILE_NAME
    path.write_bytes(raw)
    with caplog.at_level(logging.ERROR, logger="dracpu.adapters.checkpoint_file"):
        assert dict(restore(path).claims) == {}
    assert not path.exists()
    moved = tmp_path / f"{CHECKPOINT_FILE_NAME}.corrupt-1"
    assert moved.read_bytes() == raw
    assert listing(tmp_path) == [moved.name]
    assert any(
        "unusable" in r.getMessage() and str(moved) in r.getMessage() for r in caplog.records
    )


def test_truncation_at_every_length_is_moved_aside(tmp_path: Path) -> None:
    good = encode(data())
    path = tmp_path / CHECKPOINT_FILE_NAME
    for length in range(len(good) - 1):  # the last byte is the newline
        path.write_bytes(good[:length])
        assert dict(restore(path).claims) == {}, length
        moved = tmp_path / f"{CHECKPOINT_FILE_NAME}.corrupt-{length + 1}"
        assert moved.read_bytes() == good[:length]
    # every earlier file is still there, none overwritten
    assert len(listing(tmp_path)) == len(good) - 1


def test_moved_aside_files_are_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE_NAME
    (tmp_path / f"{CHECKPOINT_FILE_NAME}.corrupt-1").write_bytes(b"first")
    (tmp_path / f"{CHECKPOINT_FILE_NAME}.corrupt-3").write_bytes(b"third")
    path.write_bytes(b"second")
    restore(path)
    path.write_bytes(b"fourth")
    restore(path)
    contents = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert contents == {
        f"{CHECKPOINT_FILE_NAME}.corrupt-1": b"first",
        f"{CHECKPOINT_FILE_NAME}.corrupt-2": b"second",
        f"{CHECKPOINT_FILE_NAME}.corrupt-3": b"third",
        f"{CHECKPOINT_FILE_NAME}.corrupt-4": b"fourth",
    }


def test_good_checkpoint_after_a_corrupt_one(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE_NAME
    path.write_bytes(b"junk")
    restore(path)
    write_checkpoint(path, encode(data()))
    assert dict(restore(path).claims) == dict(data().claims)


def test_restore_removes_temp_files_a_crashed_write_left(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE_NAME
    write_checkpoint(path, encode(CheckpointData()))
    good = path.read_bytes()

    def crash(tmp: Path) -> None:
        raise OSError("killed before the rename")

    with pytest.raises(CheckpointError):
        write_checkpoint(path, b"{}", before_rename=crash)
    # A SIGKILL gives no chance to clean up: leave a temp file as the kill would.
    leftover = tmp_path / f".{CHECKPOINT_FILE_NAME}.k1ll3d.tmp"
    leftover.write_bytes(b'{"version": 1')
    unrelated = tmp_path / "notes.tmp"
    unrelated.write_bytes(b"keep me")

    assert restore(path) == CheckpointData()
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_FILE_NAME, "notes.tmp"]
    assert path.read_bytes() == good
    assert unrelated.read_bytes() == b"keep me"
