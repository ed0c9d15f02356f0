"""Advisory locks on files of the state dir: which dracpu owns the dir, which one waits for it.

A lock is ``flock(LOCK_EX)`` on a file that is never removed (removing it would let two
processes lock two different inodes under one name). The kernel drops the lock with the last
open descriptor of its holder, so a process that dies releases it; instances in two pods share
it because the state dir is the same host directory in both (a hostPath volume). The holder
writes its description (pid, host name) into the file for the other's log lines.

The hand-over that uses these locks is :mod:`dracpu.tasks.handover`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from dracpu.errors import DracpuError

__all__ = ["FileLock", "StateLockError"]


class StateLockError(DracpuError):
    """A lock file that cannot be opened or locked (not: held by another process)."""


class FileLock:
    """An exclusive ``flock`` on ``path`` (created 0600 when missing), tried without blocking."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lock if it is free (``True``), or leave it to its holder (``False``)."""
        if self._fd is not None:
            return True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StateLockError(f"cannot open lock file {self.path}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise StateLockError(f"cannot lock {self.path}: {exc.strerror}") from exc
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass  # the description is for messages only
        return True

    def holder(self) -> str:
        """What the holder wrote about itself (``"another process"`` when unreadable)."""
        try:
            text = self.path.read_text(errors="replace").strip()
        except OSError:
            text = ""
        return text or "another process"

    def release(self) -> None:
        """Give the lock up (closing the descriptor drops it)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
