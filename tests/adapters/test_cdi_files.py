from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from dracpu.adapters.cdi_files import (
    check_writable,
    delete_spec,
    ensure_dir,
    is_our_probe_file,
    probe_file_name,
    prune,
    spec_path,
    temp_file_name,
    write_spec,
)
from dracpu.adapters.file_scan import (
    MAX_FILE_BYTES,
    check_not_full,
    dir_identity,
    is_leftover,
    list_our_specs,
    read_ours,
    read_spec,
    scan,
)
from dracpu.core.cdi_spec import ClaimSpec, parse_spec, spec_bytes, spec_file_name
from dracpu.core.cpuset import CpuSet
from dracpu.errors import CdiError
from tests.mounts import read_only_bind

UID = "8ec6fd12-bb08-4936-a857-866f50153c21"
OTHER = "0b7e3a52-4c1f-4d7e-9a31-2f9a4c1d5e60"
CPUS = CpuSet.parse("2-3")

VENDOR_FILES = {
    "nvidia.com-gpu.yaml": b"---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\n",
    "dra.cpu.json": b'{"cdiVersion":"0.8.0","kind":"dra.k8s.io/cpu","devices":[]}',
    "dra.k8s.io-cpu_claim-not-a-uid.json": b"{}",
    f"dra.k8s.io-cpu_claim-{UID}.yaml": b"not ours: .yaml",
}


@pytest.fixture
def umask_077() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def _write_vendor_files(directory: Path) -> dict[str, tuple[bytes, int]]:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in VENDOR_FILES.items():
        (directory / name).write_bytes(data)
    return _vendor_state(directory)


def _vendor_state(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Content and mtime of each vendor file: both must survive untouched."""
    return {
        name: ((directory / name).read_bytes(), (directory / name).stat().st_mtime_ns)
        for name in VENDOR_FILES
    }


# --- names -------------------------------------------------------------------------------------


def test_temp_and_probe_names() -> None:
    temp = temp_file_name(UID)
    assert temp.startswith(f".dra.k8s.io-cpu_claim-{UID}.json.tmp-")
    assert not temp.endswith((".json", ".yaml"))
    assert is_leftover(temp)
    assert temp != temp_file_name(UID)
    assert not is_leftover(spec_file_name(UID))
    assert not is_leftover(".nvidia.json.tmp-0123abcd")
    assert not is_leftover(f".dra.k8s.io-cpu_claim-{UID}.json.tmp-")
    probe = probe_file_name()
    assert is_our_probe_file(probe)
    assert is_leftover(probe)
    assert not probe.endswith((".json", ".yaml"))
    assert not is_our_probe_file("dracpu-cdi-probe-1-0123abcd")
    assert spec_path("/var/run/cdi", UID) == Path(f"/var/run/cdi/dra.k8s.io-cpu_claim-{UID}.json")


# --- write -------------------------------------------------------------------------------------


def test_write_spec_creates_dir_and_file(tmp_path: Path, umask_077: None) -> None:
    cdi = tmp_path / "var" / "run" / "cdi"
    assert write_spec(cdi, UID, CPUS) is True
    path = cdi / f"dra.k8s.io-cpu_claim-{UID}.json"
    assert path.read_bytes() == spec_bytes(UID, CPUS)
    # Readable by the runtime and node tools whatever the daemon's umask.
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE(cdi.stat().st_mode) == 0o755 & ~0o077  # mkdir honours the umask
    assert os.listdir(cdi) == [path.name]


def test_write_spec_replaces_an_existing_spec(tmp_path: Path) -> None:
    write_spec(tmp_path, UID, CpuSet.parse("0-7"))
    assert write_spec(tmp_path, UID, CPUS) is True
    assert read_spec(tmp_path, UID) == CPUS
    assert os.listdir(tmp_path) == [spec_file_name(UID)]


def test_a_spec_that_holds_the_bytes_already_is_left_alone(tmp_path: Path) -> None:
    # No rename: the runtimes' CDI watches see nothing and rescan nothing.
    write_spec(tmp_path, UID, CPUS)
    inode = (tmp_path / spec_file_name(UID)).stat().st_ino
    assert write_spec(tmp_path, UID, CPUS) is False
    assert (tmp_path / spec_file_name(UID)).stat().st_ino == inode


def test_no_json_file_appears_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []
    real_rename = os.rename

    def watching_rename(src: str, dst: str) -> None:
        seen.append(sorted(os.listdir(tmp_path)))  # just before the spec appears
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", watching_rename)
    write_spec(tmp_path, UID, CPUS)
    monkeypatch.undo()
    [before_rename] = seen
    (temp,) = before_rename
    assert is_leftover(temp)
    assert temp.startswith(".")
    assert not temp.endswith((".json", ".yaml"))  # runtimes read only those
    assert os.listdir(tmp_path) == [spec_file_name(UID)]


def test_failed_write_keeps_the_old_spec_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_spec(tmp_path, UID, CPUS)
    before = (tmp_path / spec_file_name(UID)).read_bytes()

    def failing_rename(src: str, dst: str) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(CdiError) as info:
        write_spec(tmp_path, UID, CpuSet.parse("8-9"))
    monkeypatch.undo()
    assert spec_file_name(UID) in str(info.value)
    assert "Input/output error" in str(info.value)
    assert os.listdir(tmp_path) == [spec_file_name(UID)]
    assert (tmp_path / spec_file_name(UID)).read_bytes() == before


def test_a_written_spec_is_not_fsynced_but_a_delete_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The checkpoint is the durable record and every start rewrites every spec; a spec that
    # outlived its claim, though, would be adopted at the next start (module docstring).
    synced: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    monkeypatch.setattr(os, "fdatasync", counting_fsync)
    write_spec(tmp_path, UID, CPUS)
    assert synced == []
    assert delete_spec(tmp_path, UID, fsync=counting_fsync)
    assert len(synced) == 1  # the directory
    assert os.listdir(tmp_path) == []


def test_write_spec_validates_before_touching_the_disk(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    with pytest.raises(CdiError, match="invalid claim UID"):
        write_spec(cdi, "../../etc/x", CPUS)
    with pytest.raises(CdiError, match="empty cpuset"):
        write_spec(cdi, UID, CpuSet())
    assert not cdi.exists()


def test_write_spec_into_a_file_instead_of_a_dir(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "cdi"
    not_a_dir.write_bytes(b"")
    with pytest.raises(CdiError, match="not a directory"):
        write_spec(not_a_dir, UID, CPUS)
    with pytest.raises(CdiError, match="not a directory"):
        ensure_dir(not_a_dir)


def test_write_spec_over_a_directory_named_like_ours(tmp_path: Path) -> None:
    (tmp_path / spec_file_name(UID)).mkdir()
    with pytest.raises(CdiError, match=spec_file_name(UID)):
        write_spec(tmp_path, UID, CPUS)
    assert sorted(os.listdir(tmp_path)) == [spec_file_name(UID)]


def test_write_spec_replaces_a_symlink_not_its_target(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    (cdi / spec_file_name(UID)).symlink_to(target)
    write_spec(cdi, UID, CPUS)
    assert target.read_bytes() == b"keep me"
    assert not (cdi / spec_file_name(UID)).is_symlink()
    assert read_spec(cdi, UID) == CPUS


# --- delete ------------------------------------------------------------------------------------


def test_delete_is_idempotent_and_touches_nothing_else(tmp_path: Path) -> None:
    vendor = _write_vendor_files(tmp_path)
    write_spec(tmp_path, UID, CPUS)
    write_spec(tmp_path, OTHER, CPUS)
    assert delete_spec(tmp_path, UID) is True
    assert delete_spec(tmp_path, UID) is False
    assert delete_spec(tmp_path / "missing-dir", UID) is False
    assert read_spec(tmp_path, OTHER) == CPUS
    assert _vendor_state(tmp_path) == vendor


def test_delete_of_a_directory_named_like_ours_is_an_error(tmp_path: Path) -> None:
    (tmp_path / spec_file_name(UID)).mkdir()
    with pytest.raises(CdiError, match=spec_file_name(UID)):
        delete_spec(tmp_path, UID)


def test_prune_removes_orphans_and_leftovers_only(tmp_path: Path) -> None:
    vendor = _write_vendor_files(tmp_path)
    write_spec(tmp_path, UID, CPUS)
    write_spec(tmp_path, OTHER, CPUS)
    temp = temp_file_name(UID)
    (tmp_path / temp).write_bytes(b"partial")
    probe = probe_file_name()
    (tmp_path / probe).write_bytes(b"x")
    assert prune(tmp_path, frozenset({UID})) == sorted([spec_file_name(OTHER), temp, probe])
    assert sorted(os.listdir(tmp_path)) == sorted([*VENDOR_FILES, spec_file_name(UID)])
    assert _vendor_state(tmp_path) == vendor
    assert prune(tmp_path / "missing", frozenset()) == []


def test_check_writable_creates_the_dir_and_leaves_nothing(tmp_path: Path) -> None:
    cdi = tmp_path / "var" / "run" / "cdi"
    check_writable(cdi)
    assert os.listdir(cdi) == []
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(CdiError, match="exists and is not a directory"):
        check_writable(tmp_path / "file")


def _statvfs(
    *, blocks: int, bfree: int, files: int, ffree: int, flag: int = 0
) -> os.statvfs_result:
    # f_bsize, f_frsize, f_blocks, f_bfree, f_bavail, f_files, f_ffree, f_favail, f_flag, f_namemax
    return os.statvfs_result((4096, 4096, blocks, bfree, bfree, files, ffree, ffree, flag, 255))


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        (_statvfs(blocks=100, bfree=1, files=100, ffree=1), None),
        (_statvfs(blocks=100, bfree=0, files=100, ffree=50), "full file system (no free block)"),
        (_statvfs(blocks=100, bfree=50, files=100, ffree=0), "full file system (no free inode)"),
        (_statvfs(blocks=100, bfree=50, files=0, ffree=0), None),  # no inode counts (btrfs)
        (_statvfs(blocks=0, bfree=0, files=0, ffree=0), None),  # no counts at all
        (
            _statvfs(blocks=100, bfree=50, files=100, ffree=50, flag=os.ST_RDONLY),
            "read-only file system",
        ),
    ],
)
def test_check_not_full_reads_the_file_system_state(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    state: os.statvfs_result,
    problem: str | None,
) -> None:
    monkeypatch.setattr(os, "statvfs", lambda path: state)
    if problem is None:
        check_not_full(tmp_path)
    else:
        with pytest.raises(CdiError) as info:
            check_not_full(tmp_path)
        assert str(info.value) == f"CDI dir {str(tmp_path)!r} is on a {problem}"


def test_a_real_read_only_dir(tmp_path: Path) -> None:
    check_not_full(tmp_path)
    write_spec(tmp_path, OTHER, CPUS)
    with read_only_bind(tmp_path):
        # Nothing to delete is no failure, though the kernel answers EROFS before the lookup.
        assert delete_spec(tmp_path, UID) is False
        with pytest.raises(CdiError, match=r"cannot remove CDI spec .*: Read-only file system"):
            delete_spec(tmp_path, OTHER)
        # Writing what the spec holds already is none either (the rollback of that delete);
        # other content is.
        assert write_spec(tmp_path, OTHER, CPUS) is False
        with pytest.raises(CdiError, match=r"cannot write CDI spec .*: Read-only file system"):
            write_spec(tmp_path, OTHER, CpuSet.parse("7"))
        with pytest.raises(CdiError, match=r"cannot write CDI spec .*: Read-only file system"):
            write_spec(tmp_path, UID, CPUS)
        with pytest.raises(CdiError, match="is on a read-only file system"):
            check_not_full(tmp_path)
        with pytest.raises(CdiError, match="Read-only file system"):
            check_writable(tmp_path)
    assert read_spec(tmp_path, OTHER) == CPUS
    with pytest.raises(CdiError, match="cannot check CDI dir"):
        check_not_full(tmp_path / "missing")


def test_check_writable_and_write_spec_on_a_full_or_read_only_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What ENOSPC or EROFS look like (root ignores file modes, so the test injects the errno;
    # tests/integration/test_daemon_faults.py mounts a read-only dir for the real thing).
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    real_open = os.open

    def full(path: str | os.PathLike[str], flags: int, mode: int = 0o777) -> int:
        if flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, flags, mode)

    def no_blocks(fd: int, data: bytes | memoryview) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    expected = f"cannot create files in CDI dir {str(cdi)!r}: No space left on device"
    monkeypatch.setattr(os, "write", no_blocks)  # a free inode, no free block
    with pytest.raises(CdiError) as info:
        check_writable(cdi)
    assert str(info.value) == expected
    assert os.listdir(cdi) == []  # the probe file it could create is gone again
    monkeypatch.undo()
    monkeypatch.setattr(os, "open", full)
    with pytest.raises(CdiError) as info:
        check_writable(cdi)
    assert str(info.value) == expected
    with pytest.raises(CdiError) as info:
        write_spec(cdi, UID, CPUS)
    # The spec's final name, not the temp file's random one: the kubelet's error reads the same
    # on every try.
    assert str(info.value) == (
        f"cannot write CDI spec {str(cdi / spec_file_name(UID))!r}: No space left on device"
    )
    monkeypatch.undo()
    assert os.listdir(cdi) == []


# --- read --------------------------------------------------------------------------------------


def test_read_spec(tmp_path: Path) -> None:
    assert read_spec(tmp_path, UID) is None
    assert read_spec(tmp_path / "missing-dir", UID) is None
    write_spec(tmp_path, UID, CPUS)
    assert read_spec(tmp_path, UID) == CPUS
    assert read_ours(tmp_path / spec_file_name(UID)) == spec_bytes(UID, CPUS)


def test_read_spec_of_a_malformed_file_names_it(tmp_path: Path) -> None:
    path = tmp_path / spec_file_name(UID)
    path.write_bytes(b'{"cdiVersion":"0.5.0"')
    with pytest.raises(CdiError) as info:
        read_spec(tmp_path, UID)
    assert str(path) in str(info.value)
    assert "not valid JSON" in str(info.value)


def test_read_spec_of_another_claims_content(tmp_path: Path) -> None:
    (tmp_path / spec_file_name(UID)).write_bytes(spec_bytes(OTHER, CPUS))
    with pytest.raises(CdiError, match=f"is for claim {OTHER}, not {UID}"):
        read_spec(tmp_path, UID)


def test_read_spec_does_not_follow_symlinks(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_bytes(spec_bytes(UID, CPUS))
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    (cdi / spec_file_name(UID)).symlink_to(target)
    with pytest.raises(CdiError, match="symlink"):
        read_spec(cdi, UID)


def test_read_spec_does_not_block_on_a_fifo(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / spec_file_name(UID))
    with pytest.raises(CdiError, match="not a regular file"):
        read_spec(tmp_path, UID)


def test_read_spec_refuses_huge_files(tmp_path: Path) -> None:
    (tmp_path / spec_file_name(UID)).write_bytes(b" " * (MAX_FILE_BYTES + 1))
    with pytest.raises(CdiError, match="too large"):
        read_spec(tmp_path, UID)


# --- list and scan -----------------------------------------------------------------------------


def test_list_our_specs_sees_only_our_files(tmp_path: Path) -> None:
    vendor = _write_vendor_files(tmp_path)
    write_spec(tmp_path, UID, CPUS)
    (tmp_path / spec_file_name(OTHER)).write_bytes(b"garbage")
    (tmp_path / temp_file_name(UID)).write_bytes(b"partial")
    found = list_our_specs(tmp_path)
    assert set(found) == {UID, OTHER}
    assert found[UID] == ClaimSpec(CPUS)
    assert isinstance(found[OTHER], CdiError)
    assert spec_file_name(OTHER) in str(found[OTHER])
    assert list_our_specs(tmp_path / "missing") == {}
    assert _vendor_state(tmp_path) == vendor


def test_a_shared_pool_claims_spec_is_written_and_read_back(tmp_path: Path) -> None:
    write_spec(tmp_path, UID, CPUS, shared_pool=True)
    assert list_our_specs(tmp_path) == {UID: ClaimSpec(CPUS, shared_pool=True)}
    assert read_spec(tmp_path, UID) == CPUS
    env = json.loads((tmp_path / spec_file_name(UID)).read_text())["devices"][0]
    assert env["containerEdits"]["env"] == [
        f"DRA_CPUSET_{UID}={CPUS}",
        f"DRA_SHARED_POOL_{UID}=true",
    ]


def test_list_of_a_file_instead_of_a_dir(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "cdi"
    not_a_dir.write_bytes(b"")
    with pytest.raises(CdiError, match="cannot list CDI dir"):
        list_our_specs(not_a_dir)


def test_scan_reports_contents_errors_and_leftovers(tmp_path: Path) -> None:
    _write_vendor_files(tmp_path)
    write_spec(tmp_path, UID, CPUS)
    os.mkfifo(tmp_path / spec_file_name(OTHER))
    found = scan(tmp_path)
    assert found.specs[UID] == spec_bytes(UID, CPUS)
    assert parse_spec(spec_bytes(UID, CPUS)) == (UID, CPUS)
    assert isinstance(found.specs[OTHER], CdiError)
    assert found.leftovers is False
    (tmp_path / temp_file_name(UID)).write_bytes(b"partial")
    assert scan(tmp_path).leftovers is True
    # only=: reads just those claims, skips names no file of ours can have, no leftovers.
    only = scan(tmp_path, only={UID, "not-a-uid"})
    assert only.specs == {UID: spec_bytes(UID, CPUS)}
    assert only.leftovers is False
    assert scan(tmp_path, only={"0b7e3a52-4c1f-4d7e-9a31-000000000000"}).specs == {}


def test_dir_identity(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    assert dir_identity(cdi) is None
    ensure_dir(cdi)
    first = dir_identity(cdi)
    assert first is not None
    ensure_dir(cdi)  # idempotent
    assert dir_identity(cdi) == first
    cdi.rmdir()
    (tmp_path / "placeholder").mkdir()  # keep the old inode number from being reused at once
    ensure_dir(cdi)
    assert dir_identity(cdi) not in (None, first)
    (tmp_path / "file").write_bytes(b"")
    assert dir_identity(tmp_path / "file") is None
