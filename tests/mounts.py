"""A directory made read-only for real: a bind mount of it on itself, remounted read-only.

Root ignores file modes (``chmod 0555`` does not stop it), so only a read-only mount makes the
kernel answer ``EROFS`` as a node's read-only CDI dir would. Mounting needs root with
``CAP_SYS_ADMIN`` and the ``mount`` tool; where either is missing the test is skipped, saying why.
The mount is removed in every case, even when the test fails.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["ReadOnlyBind", "read_only_bind"]


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


@contextlib.contextmanager
def read_only_bind(path: Path, *, read_only: bool = True) -> Iterator[ReadOnlyBind]:
    """Bind-mount ``path`` on itself (read-only unless told otherwise); unmount afterwards."""
    missing = [tool for tool in ("mount", "umount") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no {' and '.join(missing)} on PATH: cannot make a read-only directory")
    result = _run("mount", "--bind", str(path), str(path))
    if result.returncode != 0:
        pytest.skip(f"cannot bind-mount {path} (root with CAP_SYS_ADMIN needed): {result.stderr}")
    bind = ReadOnlyBind(path)
    try:
        if read_only:
            bind.set_read_only(True)
        yield bind
    finally:
        if _run("umount", str(path)).returncode != 0:
            _run("umount", "-l", str(path))  # busy (an open file): detach it now, free it later
