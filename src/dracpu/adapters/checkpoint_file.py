"""The checkpoint file: atomic writes, and a restore that never loses a bad file (design §3).

Write: a temp file in the SAME directory (``.checkpoint.json.<random>.tmp``, never ending in
``.json``), the bytes, ``fsync``, ``rename`` over the checkpoint, ``fsync`` of the directory.
A crash at any point leaves either the old or the new checkpoint, whole. The file is mode 0600;
a missing directory is created 0700.

Restore: no file → empty state. A file that does not decode (corrupt, truncated, unknown
version) is moved aside to ``<name>.corrupt-<n>`` (the lowest free ``n``: an earlier moved file
is never overwritten, nothing is deleted), an error is logged, and the state starts empty. A file
that cannot be read at all (permissions, I/O error) raises :class:`CheckpointError`: starting
empty over a checkpoint we merely failed to read would lose claims.

These functions are synchronous and small; the state owner calls them via ``anyio.to_thread``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from dracpu.core.checkpoint_schema import CheckpointData, decode
from dracpu.errors import CheckpointError

__all__ = [
    "CHECKPOINT_FILE_NAME",
    "CORRUPT_SUFFIX",
    "DIR_MODE",
    "FILE_MODE",
    "load_checkpoint",
    "restore",
    "write_checkpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINT_FILE_NAME = "checkpoint.json"  # design §5: <state-dir>/checkpoint.json
FILE_MODE = 0o600  # design §5: the checkpoint is private to the daemon
DIR_MODE = 0o700  # design §5: files we create live in 0700 directories
CORRUPT_SUFFIX = ".corrupt-"  # <name>.corrupt-<n>: a moved-aside bad checkpoint
_TMP_SUFFIX = ".tmp"  # never ".json": nothing scanning the directory mistakes it for a checkpoint
_MAX_MOVED_ASIDE = 100_000  # give up looking for a free .corrupt-<n> name after this many


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _ensure_dir(directory: Path) -> None:
    if directory.is_dir():
        return
    directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    directory.chmod(DIR_MODE)  # mkdir's mode is masked by the umask


def write_checkpoint(
    path: Path,
    data: bytes,
    *,
    before_rename: Callable[[Path], None] | None = None,
) -> None:
    """Replace ``path`` with ``data`` atomically and durably.

    ``before_rename`` is a test seam, called with the written and synced temp file just before
    the rename (raise from it to simulate a crash or an I/O error at that point). On any error
    the temp file is removed, the old checkpoint is untouched and :class:`CheckpointError` is
    raised naming the file.
    """
    directory = path.parent
    tmp: Path | None = None
    try:
        _ensure_dir(directory)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_TMP_SUFFIX, dir=directory)
        tmp = Path(tmp_name)
        try:
            os.fchmod(fd, FILE_MODE)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, path)
        tmp = None
        _fsync_dir(directory)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc}") from exc
    finally:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def load_checkpoint(path: Path) -> bytes | None:
    """The checkpoint's bytes, ``None`` if there is no file; :class:`CheckpointError` if it
    exists but cannot be read."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc


def _move_aside(path: Path) -> Path:
    """Rename ``path`` to the first free ``<name>.corrupt-<n>``; never overwrite one."""
    for n in range(1, _MAX_MOVED_ASIDE + 1):
        target = path.with_name(f"{path.name}{CORRUPT_SUFFIX}{n}")
        try:
            os.link(path, target)  # fails if target exists: no overwrite, even in a race
        except FileExistsError:
            continue
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            if target.exists():  # a filesystem without hard links: check, then rename
                continue
            os.rename(path, target)
        else:
            path.unlink()
        _fsync_dir(path.parent)
        return target
    raise CheckpointError(f"cannot move {path} aside: {_MAX_MOVED_ASIDE} moved-aside files exist")


def _remove_leftover_temp_files(path: Path) -> None:
    """Temp files of writes that a crash cut short (``.checkpoint.json.<random>.tmp``).

    Only called at restore, before this process writes: no write of ours is in flight.
    """
    try:
        leftovers = sorted(path.parent.glob(f".{path.name}.*{_TMP_SUFFIX}"))
    except OSError:
        return
    for leftover in leftovers:
        try:
            leftover.unlink()
        except OSError as exc:
            logger.warning("cannot remove leftover checkpoint temp file %s: %s", leftover, exc)
        else:
            logger.info("removed %s, left by a checkpoint write that did not finish", leftover)


def restore(path: Path) -> CheckpointData:
    """The checkpoint's content; empty when missing; empty (file moved aside) when corrupt.

    Temp files left by a write that a crash cut short are removed first.
    """
    _remove_leftover_temp_files(path)
    raw = load_checkpoint(path)
    if raw is None:
        return CheckpointData()
    try:
        return decode(raw)
    except CheckpointError as error:
        try:
            moved = _move_aside(path)
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint {path} is unusable ({error}) and cannot be moved aside: {exc}"
            ) from exc
        logger.error(
            "checkpoint %s is unusable, moved to %s; starting with no prepared claims: %s",
            path,
            moved,
            error,
        )
        return CheckpointData()
