"""Directories with a real file-system condition: read-only (a bind mount of the directory on
itself, remounted read-only) or full (a small tmpfs mounted on it, filled up).

Root ignores file modes (``chmod 0555`` does not stop it), so only a read-only mount makes the
kernel answer ``EROFS`` as a node's read-only CDI dir would, and only a full file system
``ENOSPC``. Mounting needs root with ``CAP_SYS_ADMIN`` and the ``mount`` tool; where either is
missing the test is skipped, saying why. The mount is removed in every case, even when the test
fails.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["FullTmpfs", "ReadOnlyBind", "full_tmpfs", "read_only_bind"]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)


class ReadOnlyBind:
    """A bind mount of a directory on itself; :meth:`set_read_only` flips it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def set_read_only(self, read_only: bool) -> None:
        mode = "ro" if read_only else "rw"
        result = _run("mount", "-o", f"remount,bind,{mode}", str(self.path))
        if result.returncode != 0:
            raise RuntimeError(f"cannot remount {self.path} {mode}: {result.stderr.strip()}")


def _mount(*argv: str) -> None:
    missing = [tool for tool in ("mount", "umount") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no {' and '.join(missing)} on PATH: cannot mount a test directory")
    result = _run("mount", *argv)
    if result.returncode != 0:
        pytest.skip(f"cannot mount {argv[-1]} (root with CAP_SYS_ADMIN needed): {result.stderr}")


def _unmount(path: Path) -> None:
    if _run("umount", str(path)).returncode != 0:
        _run("umount", "-l", str(path))  # busy (an open file): detach it now, free it later


@contextlib.contextmanager
def read_only_bind(path: Path, *, read_only: bool = True) -> Iterator[ReadOnlyBind]:
    """Bind-mount ``path`` on itself (read-only unless told otherwise); unmount afterwards."""
    _mount("--bind", str(path), str(path))
    bind = ReadOnlyBind(path)
    try:
        if read_only:
            bind.set_read_only(True)
        yield bind
    finally:
        _unmount(path)


class FullTmpfs:
    """A small tmpfs on a directory, filled up by :attr:`filler`; :meth:`free` makes room."""

    FILLER = ".filler"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.filler = path / self.FILLER

    def fill(self) -> None:
        """Write the filler until the file system is full (``ENOSPC``)."""
        chunk = b"\0" * 4096
        with self.filler.open("ab", buffering=0) as file:
            while True:
                try:
                    file.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    return

    def free(self) -> None:
        """Remove the filler."""
        self.filler.unlink()


@contextlib.contextmanager
def full_tmpfs(path: Path, *, size: str = "64k") -> Iterator[FullTmpfs]:
    """Mount a tmpfs of ``size`` on the empty directory ``path`` (what it holds is hidden
    meanwhile); fill it after writing what the test wants in it; unmount afterwards."""
    _mount("-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path))
    try:
        yield FullTmpfs(path)
    finally:
        _unmount(path)
