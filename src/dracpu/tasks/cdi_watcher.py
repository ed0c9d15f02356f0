"""Watch the CDI dir and the device metadata dir for drift, and ask the state owner to put it
right: the watcher reads, the owner writes.

A pass reads our files (all of them, or those a batch of events named) and compares them with
the owner's committed claims (:func:`dracpu.core.file_drift.drifted_claims`): a claim's spec or
metadata missing or changed, or a file of ours no prepared claim owns. For those claims it sends
one :class:`~dracpu.core.commands.RepairNodeFiles`, which the owner applies in order with every
other command, deciding from its state at that moment; a leftover of a write cut short asks for
every claim's files (the owner prunes leftovers). Other vendors' files are never read.

``watchfiles.awatch`` reports changes in batches; a pass over every file runs once the watch is
set up and every ``resync_interval`` seconds after (the net for lost events), and the watch
starts again when a dir is replaced or the metadata dir appears. Where inotify cannot
be used (no watches left) it polls. A dir that cannot be read is logged once per change of its
condition and waited out; whether files can be written is the owner's to say (the ``cdi-dir``
readiness flag). ``docs/architecture.md`` ("The CDI dir and the device metadata") has the story.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path

import anyio
import anyio.abc
from watchfiles import Change, awatch

from dracpu.adapters import file_scan
from dracpu.adapters.backoff import RetryLog, backoff_delays
from dracpu.core.cdi_spec import claim_uid_from_file_name
from dracpu.core.commands import RepairNodeFiles
from dracpu.core.device_metadata import metadata_file_owner, metadata_spec_owner
from dracpu.core.file_drift import drifted_claims
from dracpu.core.state_values import NodeState
from dracpu.errors import CdiError, DracpuError

__all__ = [
    "DEFAULT_DEBOUNCE_MS",
    "DEFAULT_RESYNC_INTERVAL",
    "DEFAULT_STEP_MS",
    "Repair",
    "run",
]

logger = logging.getLogger(__name__)

# watchfiles groups the events of a burst: it returns once no new event came for STEP ms, and at
# the latest DEBOUNCE ms after the first one. A deleted spec must come back fast (the runtime may
# look it up any moment), so these are far below watchfiles' 1600/50 ms defaults.
DEFAULT_DEBOUNCE_MS = 200
DEFAULT_STEP_MS = 50
# A pass over every file this often: a safety net for lost events (a queue overflow, a change
# made just before the watch started). Cheap: ``bench/bench_cdi.py`` (docs/performance.md).
DEFAULT_RESYNC_INTERVAL = 10.0
# The longest wait of the watch thread for events: it then yields (no change), and a full pass
# runs if one is due. Its first yield also comes after the watch is set up, which is when the
# first full pass runs: a change made while the watch was being set up is seen by it.
_TICK = 1.0
# Poll period when inotify cannot be used, and the full-pass interval then (a poller cannot see
# a spec that was written and deleted between two of its scans).
_POLL_DELAY_MS = 300
_POLLING_RESYNC = 1.0
# Waits for a CDI dir that is missing or cannot be watched (the owner creates it when it
# writes): quick at first, then every 2 s at most.
_RETRY_DELAYS = partial(backoff_delays, initial=0.25, cap=2.0)

Repair = Callable[[RepairNodeFiles], Awaitable[object]]
"""Sends the command to the state owner and waits for its answer
(:func:`dracpu.tasks.state_owner.request`)."""


class _Watcher:
    """One :func:`run`: the dirs, where the committed claims come from, where repairs go."""

    def __init__(
        self,
        cdi_dir: Path,
        metadata_dir: Path,
        state: Callable[[], NodeState],
        repair: Repair,
        resync_interval: float,
    ) -> None:
        self.cdi_dir = cdi_dir
        self.metadata_dir = metadata_dir
        self.state = state
        self.repair = repair
        self.resync_interval = resync_interval
        self.dirs = (str(cdi_dir), str(metadata_dir))
        self.log = RetryLog(logger, f"reading CDI dir {cdi_dir}")
        self.last_drift: frozenset[str] | None = frozenset()
        self.last_full = -math.inf

    def identities(self) -> tuple[object, object]:
        return file_scan.dir_identity(self.cdi_dir), file_scan.dir_identity(self.metadata_dir)

    def wanted(self, change: Change, path: str) -> bool:
        """watchfiles filter: our spec and metadata files, and the dirs themselves."""
        if path in self.dirs:
            return True
        return _owner(os.path.basename(path)) is not None

    async def check(self, only: frozenset[str] | None) -> None:
        """One pass: the files (of ``only``, or all) against the committed claims; the claims
        that differ go to the owner."""
        if only is not None and not only:
            return
        if only is None:
            self.last_full = anyio.current_time()
        try:
            scan = await anyio.to_thread.run_sync(
                partial(file_scan.scan, self.cdi_dir, self.metadata_dir, only=only)
            )
        except CdiError as exc:
            self.log.failed(exc, retry_in=self.resync_interval)
            return
        self.log.recovered()
        state = self.state()
        specs = {uid: None if isinstance(c, CdiError) else c for uid, c in scan.specs.items()}
        drift = await anyio.to_thread.run_sync(
            partial(
                drifted_claims,
                state,
                str(self.metadata_dir),
                specs,
                scan.metadata_specs,
                scan.metadata_files,
                only=only,
            )
        )
        uids: frozenset[str] | None = None if scan.leftovers else drift
        if uids is not None and not uids:
            self.last_drift = frozenset()
            return
        # The same drift pass after pass is a file the owner cannot write: said once.
        level = logging.DEBUG if uids == self.last_drift else logging.INFO
        self.last_drift = uids
        what = "leftovers of writes cut short" if uids is None else f"claims {sorted(uids)}"
        logger.log(level, "our files differ from the prepared claims (%s): repairing", what)
        try:
            await self.repair(RepairNodeFiles(uids))
        except DracpuError as exc:  # the owner is stopping, or refused
            logger.debug("CDI watcher: %s", exc)

    def named(self, changes: set[tuple[Change, str]], resync: float) -> frozenset[str] | None:
        """The claims a batch names (none for a tick without events); ``None`` (every file)
        for a dir's own event, or once a full pass is due (every ``resync`` seconds)."""
        if anyio.current_time() - self.last_full >= resync:
            return None
        uids: set[str] = set()
        for _, path in changes:
            if path in self.dirs:
                return None
            uid = _owner(os.path.basename(path))
            if uid is not None:
                uids.add(uid)
        return frozenset(uids)

    async def watch(self, polling: bool) -> None:
        """Watch until a dir is replaced, removed or appears; raises ``OSError`` when the watch
        cannot be set up."""
        identities = self.identities()
        paths = [p for p, ident in zip(self.dirs, identities, strict=True) if ident is not None]
        resync = min(self.resync_interval, _POLLING_RESYNC) if polling else self.resync_interval
        stop = anyio.Event()
        watcher = awatch(
            *paths,
            watch_filter=self.wanted,
            debounce=DEFAULT_DEBOUNCE_MS,
            step=DEFAULT_STEP_MS,
            stop_event=stop,
            rust_timeout=max(1, round(min(_TICK, resync) * 1000)),
            yield_on_timeout=True,
            recursive=False,
            force_polling=polling,
            poll_delay_ms=_POLL_DELAY_MS,
        )
        self.last_full = -math.inf  # the first yield comes once the watch is set up: a full pass
        async with anyio.create_task_group() as tg:
            # watchfiles waits for changes in a worker thread that a cancellation cannot
            # interrupt; the thread checks ``stop`` every step.
            tg.start_soon(_stop_on_cancel, stop)
            async with contextlib.aclosing(watcher):
                async for changes in watcher:
                    if self.identities() != identities:
                        break
                    await self.check(self.named(changes, resync))
            tg.cancel_scope.cancel()


async def _stop_on_cancel(stop: anyio.Event) -> None:
    try:
        await anyio.sleep_forever()
    finally:
        stop.set()


def _owner(name: str) -> str | None:
    """The claim UID a file name of ours belongs to (its CDI spec, metadata spec or file)."""
    return claim_uid_from_file_name(name) or metadata_spec_owner(name) or metadata_file_owner(name)


async def run(
    cdi_dir: str | os.PathLike[str],
    metadata_dir: str | os.PathLike[str],
    state: Callable[[], NodeState],
    repair: Repair,
    *,
    resync_interval: float = DEFAULT_RESYNC_INTERVAL,
    force_polling: bool = False,
    retry_delays: Callable[[], Iterator[float]] = _RETRY_DELAYS,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Watch the dirs forever (see the module docstring). ``state`` gives the owner's committed
    state; ``repair`` sends it a :class:`~dracpu.core.commands.RepairNodeFiles`. Started at
    once; never raises for the dirs' condition."""
    watcher = _Watcher(Path(cdi_dir), Path(metadata_dir), state, repair, resync_interval)
    task_status.started()
    polling = force_polling
    delays: Iterator[float] | None = None
    while True:
        if file_scan.dir_identity(cdi_dir) is not None:
            try:
                await watcher.watch(polling)
                delays = None
                continue
            except FileNotFoundError:
                pass  # a dir went away while the watch was set up
            except OSError as exc:  # RustNotify: no inotify watches left, ...
                if not polling:
                    logger.warning(
                        "cannot watch CDI dir %s with inotify (%s); polling", cdi_dir, exc
                    )
                    polling = True
                    continue
                logger.error("cannot watch CDI dir %s: %s", cdi_dir, exc)
        if delays is None:
            delays = retry_delays()
        await anyio.sleep(next(delays))
