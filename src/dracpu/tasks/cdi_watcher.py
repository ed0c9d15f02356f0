"""Keep the CDI dir holding exactly the specs of the prepared claims.

A spec of a prepared claim that someone deletes or edits is rewritten; a spec of ours that no
prepared claim owns is removed; other vendors' files are never touched. :func:`reconcile` does one
pass; :func:`run` watches the dir with ``watchfiles.awatch`` and reconciles the files named by
each batch of events, plus a full pass every ``resync_interval`` seconds.

Start-up: the task creates the dir, proves that files can be created in it, starts the watch and
proves it is live by writing a probe file (``.dracpu-cdi-probe-*``, not ``.json``: runtimes
ignore it) until the watch reports it; only then does it reconcile the whole dir, so no change
can fall between the first pass and the watch. If inotify reports nothing within
``probe_timeout`` (some filesystems, exhausted watches) it falls back to polling. When the dir is
removed or replaced, the watch is restarted on the new dir.

A dir that cannot be used (read-only, full, not a directory, its parent read-only, a watch that
reports nothing even when polling) is waited out, never a reason to exit: the daemon would crash
loop as a DaemonSet, and while it is down the runtime creates containers without pinning. The
task reports the condition on its ``health`` flag (``/readyz`` shows the reason; the daemon
names the flag ``cdi-dir``), logs each change of it once
(:class:`~dracpu.adapters.backoff.RetryLog`) and tries again with a short backoff; Prepare fails
per claim meanwhile, with the file system's reason. Once files can be created again, the watch
goes live and its first full pass writes every prepared claim's spec (those the start-up Resync
could not write among them): the flag turns ready by itself. A live watch notices the dir turning
unusable when a pass cannot write, or when a full pass finds its file system read-only or full
(``statvfs``, which no runtime sees), and then waits it out the same way. ``task_status.started()``
comes after the first attempt, whether the dir could be used or not: the DRA socket and the NRI
plugin start after this task.

Our own writes cause events too; they are harmless: temp files are filtered out, and a spec we just
wrote compares equal on the next pass, so nothing is rewritten twice.

Races with the state owner, which writes a claim's spec on Prepare and removes it on Unprepare
before it commits the new state (after the checkpoint): the desired claims are read AFTER the
files, and an orphan younger than ``orphan_grace`` is left for a later pass, so a spec written
for a claim being prepared is not removed before the claim shows in ``desired()``. A spec
rewritten for a claim being unprepared at that instant is an orphan for the next passes: removed
once older than the grace. Orphans are harmless meanwhile (the NRI side refuses a claim it does not
hold). A ``desired()`` that includes claims whose Prepare is in flight makes both windows vanish.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio
import anyio.abc
from watchfiles import Change, awatch

from dracpu.adapters import cdi_files
from dracpu.adapters.backoff import Health, RetryLog, backoff_delays
from dracpu.core.cdi_spec import ClaimSpec, claim_uid_from_file_name, plan_reconcile
from dracpu.errors import CdiError

__all__ = [
    "DEFAULT_DEBOUNCE_MS",
    "DEFAULT_ORPHAN_GRACE",
    "DEFAULT_PROBE_TIMEOUT",
    "DEFAULT_RESYNC_INTERVAL",
    "DEFAULT_STEP_MS",
    "STALE_LEFTOVER_AGE",
    "Health",
    "ReconcileReport",
    "reconcile",
    "reconcile_scan",
    "run",
]

logger = logging.getLogger(__name__)

# watchfiles groups the events of a burst: it returns once no new event came for STEP ms, and at
# the latest DEBOUNCE ms after the first one. A deleted spec must come back fast (the runtime may
# look it up any moment), so these are far below watchfiles' 1600/50 ms defaults.
DEFAULT_DEBOUNCE_MS = 200
DEFAULT_STEP_MS = 50
# A full pass this often even without events: a safety net for lost events (queue overflow), and
# what removes orphans once they are older than the grace period. Cheap: a pass over 200 specs is
# ``cdi.reconcile_noop_200`` in ``bench/bench_cdi.py`` (docs/performance.md).
DEFAULT_RESYNC_INTERVAL = 10.0
# An orphan spec (no prepared claim owns it) younger than this is left for a later pass. The state
# owner writes a claim's spec before it commits the claim (after the checkpoint), so a pass in
# between sees the new spec as an orphan; removing it could make the runtime miss the device.
# Orphans are harmless meanwhile: the NRI side refuses env naming a claim it does not hold.
DEFAULT_ORPHAN_GRACE = 5.0
# How long to wait for the watch to report our probe before falling back to polling.
DEFAULT_PROBE_TIMEOUT = 3.0
# Interval between probe writes while waiting for the watch to see one.
_PROBE_PERIOD = 0.1
# Retries of a dir that cannot be used: quick at first (a mount being set up), then every 2 s at
# most. A try is one failed file creation (no event for the runtimes' CDI watches), and every
# Prepare fails until one works: the dir must be used again within seconds of its repair.
_RETRY_DELAYS = partial(backoff_delays, initial=0.25, cap=2.0)
# Poll period when inotify does not work, and the full-pass interval then (a poller cannot see a
# spec that was written and deleted between two of its scans).
_POLL_DELAY_MS = 300
_POLLING_RESYNC = 1.0
# Our temp and probe files older than this are leftovers of a crash and are removed. A write takes
# milliseconds, so a younger temp file may belong to a write in progress (the state owner's).
STALE_LEFTOVER_AGE = 60.0


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    """What one reconcile pass did. Claim UIDs and file names are sorted."""

    created: tuple[str, ...] = ()  # prepared claims whose missing spec was written
    repaired: tuple[str, ...] = ()  # prepared claims whose edited/broken spec was rewritten
    removed: tuple[str, ...] = ()  # claim UIDs of our orphan specs that were removed
    deferred: tuple[str, ...] = ()  # claim UIDs of orphans too young to remove yet
    removed_leftovers: tuple[str, ...] = ()  # stale temp / probe file names removed
    errors: tuple[str, ...] = ()  # actions that failed (each message names the file)

    @property
    def changed(self) -> bool:
        return bool(self.created or self.repaired or self.removed or self.removed_leftovers)


def reconcile_scan(
    cdi_dir: str | os.PathLike[str],
    scan: cdi_files.CdiDirScan,
    desired: Mapping[str, ClaimSpec],
    *,
    only: Collection[str] | None = None,
    orphan_grace: float = 0.0,
    stale_age: float | None = STALE_LEFTOVER_AGE,
) -> ReconcileReport:
    """Bring the dir in line with ``desired`` given a :func:`cdi_files.scan_dir` result (sync).

    ``only`` restricts the pass to those claim UIDs (the scan must have been made with the same
    ``only``). Orphan specs modified less than ``orphan_grace`` seconds ago are kept (reported as
    ``deferred``). Leftover temp/probe files older than ``stale_age`` seconds are removed
    (``None``: keep them). Never raises for a bad file: failures are in the report.
    """
    existing: dict[str, bytes | None] = {}
    for uid, content in scan.specs.items():
        if isinstance(content, CdiError):  # rewritten below; the report has it if that fails
            logger.debug("unreadable CDI spec of claim %s: %s", uid, content)
            existing[uid] = None
        else:
            existing[uid] = content
    plan = plan_reconcile(existing, desired, only=only)
    created: list[str] = []
    repaired: list[str] = []
    removed: list[str] = []
    deferred: list[str] = []
    leftovers: list[str] = []
    errors: list[str] = [f"claim {uid}: {reason}" for uid, reason in plan.invalid]
    for uid, spec in plan.create:
        try:
            cdi_files.write_spec(cdi_dir, uid, spec.cpus, spec.shared_pool)
            created.append(uid)
        except CdiError as exc:
            errors.append(str(exc))
    for uid, spec in plan.repair:
        try:
            cdi_files.write_spec(cdi_dir, uid, spec.cpus, spec.shared_pool)
            repaired.append(uid)
        except CdiError as exc:
            errors.append(str(exc))
    for uid in plan.remove:
        if scan.ages.get(uid, math.inf) < orphan_grace:
            deferred.append(uid)
            continue
        try:
            cdi_files.delete_spec(cdi_dir, uid)
            removed.append(uid)
        except CdiError as exc:
            errors.append(str(exc))
    if only is None and stale_age is not None:
        for name, age in sorted(scan.leftovers.items()):
            if age < stale_age:
                continue
            try:
                if cdi_files.remove_our_file(cdi_dir, name):
                    leftovers.append(name)
            except CdiError as exc:
                errors.append(str(exc))
    return ReconcileReport(
        tuple(created),
        tuple(repaired),
        tuple(removed),
        tuple(deferred),
        tuple(leftovers),
        tuple(errors),
    )


def reconcile(
    cdi_dir: str | os.PathLike[str],
    desired: Mapping[str, ClaimSpec],
    *,
    only: Collection[str] | None = None,
    orphan_grace: float = 0.0,
    stale_age: float | None = STALE_LEFTOVER_AGE,
) -> ReconcileReport:
    """One synchronous pass: scan our files, then write/repair/remove so the dir matches.

    Raises :class:`CdiError` only when the dir itself cannot be listed; problems with single files
    are in the report. Run it in a worker thread from async code.
    """
    scan = cdi_files.scan_dir(cdi_dir, only=only)
    return reconcile_scan(
        cdi_dir, scan, desired, only=only, orphan_grace=orphan_grace, stale_age=stale_age
    )


class _Ending(enum.Enum):
    """Why :meth:`_Watch.watch_once` returned."""

    REPLACED = enum.auto()  # the live watch's dir was removed or replaced: watch the new one
    SILENT = enum.auto()  # the watch never reported the probe within probe_timeout
    UNUSABLE = enum.auto()  # no file can be created in the dir (``_Watch.problem`` says why)


class _Watch:
    """State of one :func:`run`: the dir, the desired-claims provider, the tuning knobs, and
    what the daemon sees of the dir (readiness, the log, ``started()``)."""

    def __init__(
        self,
        path: Path,
        desired: Callable[[], Mapping[str, ClaimSpec]],
        on_report: Callable[[ReconcileReport], None] | None,
        debounce_ms: int,
        step_ms: int,
        resync_interval: float,
        probe_timeout: float,
        orphan_grace: float,
        health: Health | None,
        task_status: anyio.abc.TaskStatus[None],
    ) -> None:
        self.path = path
        self.desired = desired
        self.on_report = on_report
        self.debounce_ms = debounce_ms
        self.step_ms = step_ms
        self.resync_interval = resync_interval
        self.probe_timeout = probe_timeout
        self.orphan_grace = orphan_grace
        self.health = health
        self.task_status = task_status
        self.started = False
        self.probe = cdi_files.probe_file_name()
        self.dir_text = str(path)
        self.problem: str | None = None  # why the dir cannot be used, when it cannot
        self.live = False
        self.log = RetryLog(logger, f"using CDI dir {path}")
        self.errors_seen: frozenset[str] = frozenset()  # the last passes' errors, logged once

    # --- what the daemon sees ------------------------------------------------------------------

    def _start(self) -> None:
        if not self.started:
            self.started = True
            self.task_status.started()

    def usable(self) -> None:
        """The watch is live and its first full pass is done."""
        self.log.recovered()
        if self.health is not None:
            self.health.set_ready()
        self._start()

    def unusable(self, problem: str, retry_in: float) -> None:
        """The dir cannot be used; the next try comes in ``retry_in`` seconds."""
        self.log.failed(
            f"{problem}; Prepare fails until then", retry_in=retry_in, level=logging.ERROR
        )
        if self.health is not None:
            self.health.set_not_ready(problem)
        self._start()

    # --- the watch -----------------------------------------------------------------------------

    def wanted(self, change: Change, path: str) -> bool:
        """watchfiles filter: our spec files, our probe, and the dir itself."""
        if path == self.dir_text:
            return True
        name = os.path.basename(path)
        return claim_uid_from_file_name(name) is not None or name == self.probe

    async def reconcile_pass(
        self, only: Collection[str] | None, *, orphan_grace: float | None = None
    ) -> bool:
        """One pass; whether the dir is still usable (else :attr:`problem` says why)."""
        grace = self.orphan_grace if orphan_grace is None else orphan_grace
        try:
            scan = await anyio.to_thread.run_sync(lambda: cdi_files.scan_dir(self.path, only=only))
        except CdiError as exc:
            report = ReconcileReport(errors=(str(exc),))
        else:
            # The snapshot is taken after the files were read (see the module docstring).
            snapshot = dict(self.desired())
            report = await anyio.to_thread.run_sync(
                lambda: reconcile_scan(self.path, scan, snapshot, only=only, orphan_grace=grace)
            )
        self.log_report(report, full=only is None)
        if self.on_report is not None:
            self.on_report(report)
        try:
            if report.errors:  # a write failed: can files be created at all?
                await anyio.to_thread.run_sync(cdi_files.check_writable, self.path, self.probe)
            elif only is None:  # a full pass: the file system's state, without a write
                await anyio.to_thread.run_sync(cdi_files.check_not_full, self.path)
        except CdiError as exc:
            self.problem = str(exc)
            return False
        return True

    def log_report(self, report: ReconcileReport, *, full: bool) -> None:
        """Log what a pass did; an error the previous passes logged already goes to DEBUG."""
        if report.created or report.repaired or report.removed:
            logger.info(
                "CDI specs reconciled: created %s, repaired %s, removed orphans %s",
                list(report.created),
                list(report.repaired),
                list(report.removed),
            )
        if report.deferred:
            logger.debug("young orphan CDI specs left for a later pass: %s", list(report.deferred))
        if report.removed_leftovers:
            logger.info("removed stale CDI temp files %s", list(report.removed_leftovers))
        for message in report.errors:
            level = logging.DEBUG if message in self.errors_seen else logging.ERROR
            logger.log(level, "CDI reconcile: %s", message)
        errors = frozenset(report.errors)
        self.errors_seen = errors if full else self.errors_seen | errors

    async def guard(self, seen: anyio.Event, stop: anyio.Event) -> None:
        """Write the probe until the watch reports it; then stay until the watch ends.

        Sets ``stop`` (the watch's stop event) when the probe is not seen in time or cannot be
        written, and whenever this task ends: watchfiles waits for changes in a worker thread
        that a cancellation cannot interrupt, but the thread checks ``stop`` every ``step_ms``.
        """
        try:
            with anyio.move_on_after(self.probe_timeout):
                while not seen.is_set():
                    try:
                        await anyio.to_thread.run_sync(cdi_files.touch_probe, self.path, self.probe)
                    except CdiError as exc:
                        self.problem = str(exc)
                        return
                    with anyio.move_on_after(_PROBE_PERIOD):
                        await seen.wait()
            if seen.is_set():
                await anyio.sleep_forever()
        finally:
            stop.set()

    async def remove_probe(self) -> None:
        try:
            await anyio.to_thread.run_sync(cdi_files.remove_our_file, self.path, self.probe)
        except CdiError as exc:
            logger.debug("CDI watcher: %s", exc)  # the dir's problem is reported already

    def begin(self) -> None:
        """A new watch: not live, no problem known (the guard and the passes set them)."""
        self.problem = None
        self.live = False

    async def watch_once(self, polling: bool) -> _Ending:
        """Watch the dir until it is removed or replaced, or cannot be used.

        :attr:`live` tells whether the watch went live (probe seen, first full pass done).
        Raises ``OSError`` when the watch cannot be set up.
        """
        identity = await anyio.to_thread.run_sync(cdi_files.dir_identity, self.path)
        self.begin()
        seen = anyio.Event()
        stop = anyio.Event()
        # A poller misses a file created and removed between two scans: pass more often.
        resync = min(self.resync_interval, _POLLING_RESYNC) if polling else self.resync_interval
        watcher = awatch(
            self.path,
            watch_filter=self.wanted,
            debounce=self.debounce_ms,
            step=self.step_ms,
            stop_event=stop,
            rust_timeout=max(1, round(resync * 1000)),
            yield_on_timeout=True,
            recursive=False,
            force_polling=polling,
            poll_delay_ms=_POLL_DELAY_MS,
        )
        ending = _Ending.SILENT
        failure: OSError | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.guard, seen, stop)
            try:
                async with contextlib.aclosing(watcher):
                    async for changes in watcher:
                        if self.live:
                            ending = await self.handle(changes, identity)
                            if ending is not _Ending.SILENT:
                                break
                        elif any(os.path.basename(p) == self.probe for _, p in changes):
                            self.live = True
                            seen.set()
                            await self.remove_probe()
                            # The watch is live: a full pass. Before started() nothing is being
                            # prepared yet (the DRA socket opens after this task): no grace.
                            grace = None if self.started else 0.0
                            if not await self.reconcile_pass(None, orphan_grace=grace):
                                ending = _Ending.UNUSABLE
                                break
                            self.usable()
                    else:
                        if self.live:  # the watch ended by itself: start it again
                            ending = _Ending.REPLACED
            except OSError as exc:  # RustNotify: dir missing, no inotify watches left, ...
                failure = exc
            tg.cancel_scope.cancel()  # ends the guard
        if not self.live:
            await self.remove_probe()
        if failure is not None:
            raise failure
        if not self.live and self.problem is not None:
            return _Ending.UNUSABLE  # the guard could not write the probe
        return ending

    async def handle(self, changes: set[tuple[Change, str]], identity: object) -> _Ending:
        """Reconcile after a batch of events (or a timeout); ``SILENT``: go on watching."""
        current = await anyio.to_thread.run_sync(cdi_files.dir_identity, self.path)
        if current != identity:
            logger.warning("CDI dir %s was removed or replaced", self.path)
            return _Ending.REPLACED
        only = self.named_claims(changes)
        if (only is None or only) and not await self.reconcile_pass(only):
            return _Ending.UNUSABLE
        return _Ending.SILENT

    def named_claims(self, changes: set[tuple[Change, str]]) -> set[str] | None:
        """Claim UIDs named by a batch; ``None`` (full pass) for a timeout or a dir event."""
        if not changes:
            return None
        uids: set[str] = set()
        for _, path in changes:
            uid = claim_uid_from_file_name(os.path.basename(path))
            if uid is None:
                if path == self.dir_text:
                    return None
                continue  # our probe
            uids.add(uid)
        return uids


async def run(
    cdi_dir: str | os.PathLike[str],
    desired: Callable[[], Mapping[str, ClaimSpec]],
    *,
    debounce_ms: int = DEFAULT_DEBOUNCE_MS,
    step_ms: int = DEFAULT_STEP_MS,
    resync_interval: float = DEFAULT_RESYNC_INTERVAL,
    probe_timeout: float = DEFAULT_PROBE_TIMEOUT,
    orphan_grace: float = DEFAULT_ORPHAN_GRACE,
    force_polling: bool = False,
    on_report: Callable[[ReconcileReport], None] | None = None,
    health: Health | None = None,
    retry_delays: Callable[[], Iterator[float]] = _RETRY_DELAYS,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Watch ``cdi_dir`` forever, keeping our specs equal to ``desired()``.

    ``desired`` returns a snapshot ``{claim_uid: ClaimSpec}`` of the prepared claims; it is called
    on the event loop, after the files of a pass were read. ``on_report`` receives every pass's
    report (metrics, tests). ``health`` is told whether the dir can be used, with the reason when
    not; ``retry_delays`` makes the delays between tries of a dir that cannot. ``started()`` comes
    once the watch is live and the first full pass is done, or once the first try found the dir
    unusable. Never raises for the dir's condition (see the module docstring).
    """
    path = Path(cdi_dir)
    watch = _Watch(
        path,
        desired,
        on_report,
        debounce_ms,
        step_ms,
        resync_interval,
        probe_timeout,
        orphan_grace,
        health,
        task_status,
    )
    polling = force_polling
    delays: Iterator[float] | None = None
    while True:
        try:
            await anyio.to_thread.run_sync(cdi_files.check_writable, path, watch.probe)
            ending = await watch.watch_once(polling)
        except CdiError as exc:
            problem = str(exc)
        except OSError as exc:  # the watch could not be set up
            if not polling and not isinstance(exc, FileNotFoundError):
                logger.warning("cannot watch CDI dir %s with inotify (%s); polling", path, exc)
                polling = True
                continue
            problem = f"cannot watch CDI dir {str(path)!r}: {exc}"
        else:
            if watch.live:
                delays = None  # it worked for a while: a new problem starts the backoff over
            if ending is _Ending.REPLACED:
                continue
            if ending is _Ending.SILENT and not polling:
                logger.warning(
                    "inotify reported no event in CDI dir %s within %.1f s; polling instead",
                    path,
                    probe_timeout,
                )
                polling = True
                continue
            problem = watch.problem or (
                f"the watch of CDI dir {str(path)!r} reported no change within "
                f"{probe_timeout:g} s, even polling"
            )
        if delays is None:
            delays = retry_delays()
        delay = next(delays)
        watch.unusable(problem, delay)
        await anyio.sleep(delay)
