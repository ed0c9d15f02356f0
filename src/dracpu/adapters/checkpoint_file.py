"""The checkpoint on disk: two slot files overwritten in place in turn
(``<state-dir>/checkpoint.json`` and ``checkpoint.1.json``, :func:`slot_paths`), and a restore
that never loses a bad file.

:meth:`CheckpointStore.write` puts the next document (:mod:`dracpu.core.checkpoint_schema`,
with its ``sequence``) into the slot that does not hold the newest valid checkpoint, with
``pwrite`` and ``fdatasync``, padded, or grown in steps of :data:`GROWTH_STEP`, so the file
stays one JSON document; a failed write raises :class:`CheckpointError` and leaves nothing
that decodes. :meth:`CheckpointStore.restore` takes the valid slot with the highest sequence
and moves a slot that does not decode aside (``<name>.corrupt-<n>``); :func:`read_newest`
reads without changing a file. A store is used from one thread at a time (the state owner's
file thread). The rules are ``docs/architecture.md``, "Crash safety"; why it is not a rename,
"Where the code differs from the founding design".
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dracpu.core.checkpoint_schema import CheckpointData, StoredCheckpoint, decode, encode
from dracpu.errors import CheckpointError

__all__ = [
    "CHECKPOINT_FILE_NAME",
    "CORRUPT_SUFFIX",
    "DIR_MODE",
    "FILE_MODE",
    "GROWTH_STEP",
    "CheckpointStore",
    "Fsync",
    "Pwrite",
    "read_newest",
    "slot_paths",
]

logger = logging.getLogger(__name__)

CHECKPOINT_FILE_NAME = "checkpoint.json"  # <state-dir>/checkpoint.json (slot 0)
_SLOT_1_TAG = ".1"  # slot 1 of checkpoint.json is checkpoint.1.json: still a .json document
FILE_MODE = 0o600  # the checkpoint is private to the daemon
DIR_MODE = 0o700  # files we create live in 0700 directories
CORRUPT_SUFFIX = ".corrupt-"  # <name>.corrupt-<n>: a moved-aside bad checkpoint
# A slot that must grow grows to a multiple of this (bytes, padded with spaces): the page size
# and ext4 block size. A Prepare adds ~200 bytes, so most writes keep the size, which makes
# fdatasync cheaper than when every write grows the file (``checkpoint.encode+write.growing`` and
# ``.growing.unrounded`` in ``bench/bench_state.py``; figures in docs/performance.md).
GROWTH_STEP = 4096
_TMP_SUFFIX = ".tmp"  # the temp files of the rename-based writer of earlier builds
_MAX_MOVED_ASIDE = 100_000  # give up looking for a free .corrupt-<n> name after this many
# A version-1 checkpoint.json (sequence 0, written only by earlier builds) next to a slot 1 of at
# least this sequence was written AFTER it: from an upgrade, slot 1 gets sequence 1 and the next
# write (2) overwrites slot 0, so only a downgraded build can have written slot 0 since. Taking
# slot 1 would bring back the claims unprepared meanwhile.
_DOWNGRADE_SEQUENCE = 2
_SPOILER = b"\x00"  # written over byte 0 of a slot whose write failed: never valid JSON

Fsync = Callable[[int], None]
"""``os.fsync`` / ``os.fdatasync``: the seams a test replaces to inject an I/O error."""
Pwrite = Callable[[int, memoryview, int], int]
"""``os.pwrite``: the seam a test replaces to inject an error or tear a write."""


def slot_paths(path: Path) -> tuple[Path, Path]:
    """Slot 0 (``path`` itself) and slot 1 (``checkpoint.json`` → ``checkpoint.1.json``)."""
    return path, path.with_name(f"{path.stem}{_SLOT_1_TAG}{path.suffix}")


# --- reading --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Slot:
    """One slot as read: its bytes (``None``: no file) and what they decode to."""

    path: Path
    raw: bytes | None
    stored: StoredCheckpoint | None
    error: CheckpointError | None

    @property
    def extent(self) -> int | None:
        """Where the content ends (the spaces after it are padding); ``None``: unknown (no
        file, or not a valid document): the file size counts when it is written."""
        if self.raw is None or self.stored is None:
            return None
        return len(self.raw.rstrip(b" "))


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc


def _read_slots(paths: tuple[Path, Path]) -> tuple[_Slot, _Slot]:
    """Both slots, read before anything is changed (an unreadable one raises)."""
    raws = [_read(path) for path in paths]
    slots: list[_Slot] = []
    for path, raw in zip(paths, raws, strict=True):
        if raw is None:
            slots.append(_Slot(path, None, None, None))
            continue
        try:
            slots.append(_Slot(path, raw, decode(raw), None))
        except CheckpointError as error:
            slots.append(_Slot(path, raw, None, error))
    return slots[0], slots[1]


def _newest(slots: tuple[_Slot, _Slot]) -> int | None:
    """The index of the valid slot with the highest sequence (``None``: no valid slot), but see
    :data:`_DOWNGRADE_SEQUENCE`."""
    first, second = (slot.stored for slot in slots)
    if first is None:
        return None if second is None else 1
    if first.sequence == 0 and second is not None and second.sequence >= _DOWNGRADE_SEQUENCE:
        logger.warning(
            "checkpoint %s (version 1) was written by an earlier dracpu after %s (sequence %d): "
            "a downgrade and upgrade; using %s",
            slots[0].path,
            slots[1].path,
            second.sequence,
            slots[0].path,
        )
        return 0
    if second is None or first.sequence > second.sequence:
        return 0
    if first.sequence == second.sequence:
        logger.warning(
            "checkpoint slots %s and %s both hold sequence %d (not written by one dracpu?); "
            "using %s",
            slots[0].path,
            slots[1].path,
            first.sequence,
            slots[0].path,
        )
        return 0
    return 1


def read_newest(path: Path) -> StoredCheckpoint | None:
    """The newest valid checkpoint of the slots of ``path`` (``None``: no slot holds one),
    changing no file; :class:`CheckpointError` if a slot exists but cannot be read."""
    slots = _read_slots(slot_paths(path))
    index = _newest(slots)
    return None if index is None else slots[index].stored


# --- the store ------------------------------------------------------------------------------------


class CheckpointStore:
    """The checkpoint of one state directory (see the module docstring).

    ``path`` is slot 0 (``Config.checkpoint_path``). ``pwrite``, ``fdatasync`` and ``fsync`` are
    test seams (``fsync`` syncs a created slot and the directory). Call :meth:`restore` once at
    start; a :meth:`write` before it first reads the slots (changing none) so that it never
    overwrites the newest checkpoint.
    """

    def __init__(
        self,
        path: Path,
        *,
        pwrite: Pwrite = os.pwrite,
        fdatasync: Fsync = os.fdatasync,
        fsync: Fsync = os.fsync,
    ) -> None:
        self.slots = slot_paths(path)
        self._pwrite = pwrite
        self._fdatasync = fdatasync
        self._fsync = fsync
        self._known = False  # the slots have been read (restore, or a first write)
        self._newest: int | None = None  # the slot holding the newest valid checkpoint
        self._sequence = 0  # its sequence (0: none, or a version-1 document)
        # Per slot: where the last content written or read ends (the bytes beyond, up to the
        # file's end, are spaces); None: unknown, the file size counts.
        self._extent: list[int | None] = [None, None]
        # Per slot: created by this store, but its directory entry is not known durable yet.
        self._entry_pending = [False, False]
        self._written = 0  # bytes of the slot write in progress that are in the file
        # The content of the newest slot (None: not read yet), and whether a failed write may
        # have left a newer valid document in the other slot (then the same content is written
        # again all the same: see the module docstring).
        self._current: CheckpointData | None = None
        self._leftover = False

    @property
    def path(self) -> Path:
        """Slot 0: the configured checkpoint path."""
        return self.slots[0]

    def restore(self) -> CheckpointData:
        """The newest valid checkpoint's content (empty when there is none); bad slots are moved
        aside. Raises :class:`CheckpointError` when a slot cannot be read or moved aside."""
        _remove_leftover_temp_files(self.path)
        slots = _read_slots(self.slots)
        newest = _newest(slots)
        for slot in slots:
            if slot.raw is not None and slot.stored is None:
                self._move_aside(slot, None if newest is None else slots[newest])
        if any(slot.raw is not None for slot in slots):
            try:
                _fsync_dir(self.path.parent, self._fsync)
            except OSError as exc:
                raise CheckpointError(
                    f"cannot fsync checkpoint dir {self.path.parent}: {exc}"
                ) from exc
        self._learn(slots, newest)
        if newest is None:
            return CheckpointData()
        stored = slots[newest].stored
        assert stored is not None
        logger.info(
            "checkpoint: sequence %d of %s, %d claims",
            stored.sequence,
            slots[newest].path,
            len(stored.data.claims),
        )
        return stored.data

    def write(self, data: CheckpointData, *, skip_unchanged: bool = False) -> None:
        """Make ``data`` the newest checkpoint, durably, before returning (see the module
        docstring); :class:`CheckpointError` naming the file and the cause if it cannot.
        ``skip_unchanged``: write nothing when the newest slot holds ``data`` already and no
        failed write may have left a newer document."""
        if not self._known:
            slots = _read_slots(self.slots)
            self._learn(slots, _newest(slots))
        if skip_unchanged and not self._leftover and data == self._current:
            return
        target = 0 if self._newest is None else 1 - self._newest
        sequence = self._sequence + 1
        raw = encode(data, sequence)
        path = self.slots[target]
        extent, self._extent[target] = self._extent[target], None  # unknown until it is done
        try:
            self._write_slot(target, raw, extent)
        except _SlotWriteError as failed:
            self._leftover = failed.whole and not self._spoil(path)
            raise CheckpointError(f"cannot write checkpoint {failed.describe(path)}") from (
                failed.__cause__
            )
        self._extent[target] = len(raw)
        self._newest = target
        self._sequence = sequence
        self._current = data
        self._leftover = False

    # --- internals ---------------------------------------------------------------------------

    def _learn(self, slots: tuple[_Slot, _Slot], newest: int | None) -> None:
        self._known = True
        self._newest = newest
        stored = None if newest is None else slots[newest].stored
        self._sequence = 0 if stored is None else stored.sequence
        self._current = CheckpointData() if stored is None else stored.data
        self._extent = [slot.extent for slot in slots]

    def _move_aside(self, slot: _Slot, used: _Slot | None) -> None:
        try:
            moved = _move_aside(slot.path)
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint {slot.path} is unusable ({slot.error}) and cannot be moved aside: "
                f"{exc}"
            ) from exc
        if used is not None:
            assert used.stored is not None
            logger.warning(
                "checkpoint %s is unusable (a write cut short by a crash leaves this), moved to "
                "%s; using %s (sequence %d): %s",
                slot.path,
                moved,
                used.path,
                used.stored.sequence,
                slot.error,
            )
        else:
            logger.error(
                "checkpoint %s is unusable, moved to %s, and no checkpoint slot is valid: "
                "starting with no prepared claims: %s",
                slot.path,
                moved,
                slot.error,
            )

    def _write_slot(self, index: int, raw: bytes, extent: int | None) -> None:
        """``raw`` at offset 0 of slot ``index``, padded with spaces, synced (see the module
        docstring); :class:`_SlotWriteError` when it fails (a slot it created and could not
        write whole is removed again)."""
        path = self.slots[index]
        created = False
        self._written = 0
        try:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                try:
                    _ensure_dir(path.parent)
                except OSError as exc:
                    raise _SlotWriteError(f"dir {path.parent}", whole=False) from exc
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
                created = True
                self._entry_pending[index] = True
            try:
                if created:
                    os.fchmod(fd, FILE_MODE)  # the mode of os.open is masked by the umask
                size = os.fstat(fd).st_size
                end = max(len(raw), size if extent is None else extent)
                if end > size:  # the file grows: by whole steps
                    end = -(-end // GROWTH_STEP) * GROWTH_STEP
                self._pwrite_all(fd, raw + b" " * (end - len(raw)) if end > len(raw) else raw)
                if created:
                    self._fsync(fd)
                else:
                    self._fdatasync(fd)
            finally:
                os.close(fd)
            if self._entry_pending[index]:
                _fsync_dir(path.parent, self._fsync)
                self._entry_pending[index] = False
        except OSError as exc:
            # A document cut short is never valid (its checksum covers all of it): only a whole
            # one needs marking. A slot this write created holds nothing else: it goes again.
            whole = self._written >= len(raw)
            if created and not whole and _remove_quietly(path):
                self._entry_pending[index] = False
            raise _SlotWriteError(None, whole=whole) from exc

    def _spoil(self, path: Path) -> bool:
        """Best effort after a failed write: make ``path`` not decode (see the module
        docstring); whether it does not (if even this fails, the slot holds what the failed
        write left)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        except OSError as exc:
            logger.warning("cannot mark the failed checkpoint write of %s: %s", path, exc)
            return False
        try:
            self._pwrite(fd, memoryview(_SPOILER), 0)
        except OSError as exc:
            logger.warning("cannot mark the failed checkpoint write of %s: %s", path, exc)
            return False
        finally:
            os.close(fd)
        return True

    def _pwrite_all(self, fd: int, buffer: bytes) -> None:
        """``buffer`` at offset 0; :attr:`_written` says how far it got."""
        view = memoryview(buffer)
        while self._written < len(buffer):
            offset = self._written
            written = self._pwrite(fd, view[offset:], offset)
            if written <= 0:
                raise OSError(errno.EIO, f"pwrite wrote {written} bytes at offset {offset}")
            self._written += written


class _SlotWriteError(Exception):
    """A slot write failed (the ``OSError`` is the cause); ``whole``: the new document was
    written whole before it did (its padding or sync failed). ``what`` names what failed when
    it was not the slot itself (its dir)."""

    def __init__(self, what: str | None, *, whole: bool) -> None:
        super().__init__(what)
        self.what = what
        self.whole = whole

    def describe(self, path: Path) -> str:
        """``<path>: <cause in words>`` for the error message."""
        cause = self.__cause__
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
        where = str(path) if self.what is None else f"{path}: cannot create its {self.what}"
        return f"{where}: {reason}"


# --- files ----------------------------------------------------------------------------------------


def _fsync_dir(directory: Path, fsync: Fsync = os.fsync) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def _ensure_dir(directory: Path) -> None:
    if directory.is_dir():
        return
    directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    directory.chmod(DIR_MODE)  # mkdir's mode is masked by the umask


def _remove_quietly(path: Path) -> bool:
    """Remove ``path``; whether it is gone."""
    try:
        path.unlink()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


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
    """Temp files of the rename-based writer of earlier builds that a crash left
    (``.checkpoint.json.<random>.tmp``). Only called at restore, before this process writes."""
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
