"""Shared test helpers: scratch directories for fake sysfs trees, and written named machines.

Writing a fake sysfs tree creates many small files (22k for ``big-1024``); on a disk-backed
``/tmp`` that takes seconds, on tmpfs (``/dev/shm``) a fraction of one. :func:`scratch_dir`
therefore prefers ``/dev/shm`` and falls back to the default temporary directory.

``tests/conftest.py`` offers them as the fixtures ``trees`` (module scope) and ``scratch``::

    def test_x(trees: SysfsTrees) -> None:
        topo = read_topology(trees.root("dual-socket-smt2"))
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dracpu.sim.topologies import FIXTURES, MachineSpec, write_sysfs

__all__ = ["SysfsTrees", "scratch_dir", "sysfs_trees"]

# tmpfs on Linux; when it is missing or not writable we use the default temporary directory.
FAST_TMP = "/dev/shm"


@contextmanager
def scratch_dir(prefix: str = "dracpu-test-") -> Iterator[Path]:
    """A new empty directory, on tmpfs when there is one; removed afterwards."""
    base = FAST_TMP if os.path.isdir(FAST_TMP) and os.access(FAST_TMP, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class SysfsTrees:
    """Named machines written once each under one scratch directory; treat them as read-only."""

    def __init__(self, base: Path) -> None:
        self._base = base
        self._written: dict[str, Path] = {}

    def root(self, name: str) -> Path:
        """The host root holding the sysfs tree of ``FIXTURES[name]``."""
        return self.spec_root(name, FIXTURES[name])

    def spec_root(self, name: str, spec: MachineSpec) -> Path:
        """The host root of ``spec``, written on first use under the key ``name``."""
        root = self._written.get(name)
        if root is None:
            root = self._base / name
            root.mkdir()
            write_sysfs(spec, root)
            self._written[name] = root
        return root


@contextmanager
def sysfs_trees() -> Iterator[SysfsTrees]:
    with scratch_dir("dracpu-sysfs-") as base:
        yield SysfsTrees(base)
