"""Helpers of the tests that run the state owner: :class:`Files`, a :class:`NodeFiles` with faults
(the one place where the owner meets the disk), and :func:`host_root`, the sysfs tree of a named
machine for its restore."""

from __future__ import annotations

import atexit
import errno
import functools
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dracpu.adapters.checkpoint_file import CheckpointStore
from dracpu.adapters.node_files import NodeFiles
from dracpu.config import Config
from dracpu.core.checkpoint_schema import CheckpointData
from dracpu.core.effects import DeleteCdiSpec, Effect, WriteCdiSpec
from dracpu.errors import CheckpointError
from dracpu.sim.topologies import FIXTURES, write_sysfs
from tests.fixtures import FAST_TMP

__all__ = ["Files", "Flag", "host_root"]

STEP = 10.0  # seconds a held effect waits at most for its gate (2 shared cores)


@functools.cache
def host_root(machine: str) -> Path:
    """The host root holding the sysfs tree of ``FIXTURES[machine]``, written once per test
    process (on tmpfs when there is one) and removed when it exits; treat it as read-only."""
    base = Path(tempfile.mkdtemp(prefix="dracpu-hosts-", dir=_fast_tmp()))
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    write_sysfs(FIXTURES[machine], base)
    return base


def _fast_tmp() -> str | None:
    return FAST_TMP if Path(FAST_TMP).is_dir() else None


class Files(NodeFiles):
    """The real files, and faults: ``failing`` effects raise (once each) before they touch
    anything; ``bugs`` raise a non-DracpuError; ``gates`` hold an effect of that type (and
    ``claim_gates`` a CDI write or delete of that claim) in the worker thread until the test sets
    the event; while ``full`` is set, the checkpoint's writes fail as on a full disk (its
    ``pwrite`` does: what the store does about it is the real store's). ``ran`` lists every
    effect begun, in order; ``checkpoint_tests`` the owner's tests of the state dir;
    ``on_loop`` whether each ran in the event loop's thread (it never should)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config.cdi_dir, config.checkpoint_path, config.device_metadata_dir)
        self.ran: list[Effect] = []
        self.on_loop: list[bool] = []
        self.failing: list[type[Effect]] = []
        self.bugs: list[type[Effect]] = []
        self.gates: dict[type[Effect], threading.Event] = {}
        self.claim_gates: dict[str, threading.Event] = {}
        self.held: set[type[Effect]] = set()
        self.held_claims: set[str] = set()
        self.full = False
        self.checkpoint_tests: list[CheckpointData] = []
        self._checkpoint = CheckpointStore(config.checkpoint_path, pwrite=self._pwrite)

    def run(self, effect: Effect) -> None:
        self.ran.append(effect)
        self.on_loop.append(threading.current_thread() is threading.main_thread())
        kind = type(effect)
        gate = self.gates.get(kind) or self.claim_gates.get(_claim_of(effect))
        if gate is not None:
            self.held.add(kind)
            self.held_claims.add(_claim_of(effect))
            gate.wait(STEP)
            self.held.discard(kind)
            self.held_claims.discard(_claim_of(effect))
        if kind in self.bugs:
            raise RuntimeError(f"bug in {kind.__name__}")
        if kind in self.failing:
            self.failing.remove(kind)
            raise CheckpointError(f"{kind.__name__}: No space left on device")
        super().run(effect)

    def write_checkpoint(self, data: CheckpointData) -> None:
        self.checkpoint_tests.append(data)
        super().write_checkpoint(data)

    def _pwrite(self, fd: int, buffer: memoryview, offset: int) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.pwrite(fd, buffer, offset)

    @contextmanager
    def holding(self, kind: type[Effect]) -> Iterator[threading.Event]:
        """Hold effects of ``kind`` until the returned event is set (at the latest on exit)."""
        gate = self.gates[kind] = threading.Event()
        try:
            yield gate
        finally:
            gate.set()
            del self.gates[kind]

    @contextmanager
    def holding_claim(self, claim_uid: str) -> Iterator[threading.Event]:
        """Hold the CDI write or delete of ``claim_uid`` until the event is set (or on exit)."""
        gate = self.claim_gates[claim_uid] = threading.Event()
        try:
            yield gate
        finally:
            gate.set()
            del self.claim_gates[claim_uid]


def _claim_of(effect: Effect) -> str:
    return effect.claim_uid if isinstance(effect, WriteCdiSpec | DeleteCdiSpec) else ""


class Flag:
    """A readiness flag that remembers: ``reasons`` lists every not-ready reason set, in
    order; ``detail`` what the last ``set_ready`` said."""

    def __init__(self) -> None:
        self._ready = False
        self.reasons: list[str] = []
        self.detail = ""

    def is_ready(self) -> bool:
        return self._ready

    def set_ready(self, detail: str = "") -> None:
        self._ready = True
        self.detail = detail

    def set_not_ready(self, reason: str) -> None:
        self._ready = False
        self.reasons.append(reason)
