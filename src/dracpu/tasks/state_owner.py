"""The state owner: the one task that holds and changes the node's state.

:class:`StateOwner` restores the node at start (topology, checkpoint, CDI specs the checkpoint
lacks adopted, a ``Resync``), then serves the commands the other tasks send (:func:`request`),
one at a time: it runs the pure :func:`dracpu.core.state.apply`, executes the effects in order
(the file effects through :class:`~dracpu.adapters.node_files.NodeFiles` in a worker thread),
adopts the new state, replies, then runs the post-commit effects; a failed commit phase keeps
the old state and is rolled back. It is also the only writer of the CDI dir, the device
metadata and the checkpoint: it waits out a CDI dir or state dir that cannot be written
(readiness flags ``cdi-dir`` and ``state-dir``) and reports a claim whose files could not be
written on its devices' health, and it keeps the listed host cgroups confined to the shared
pool (their ``ConfineHostCgroups`` effect never fails a command; the ``host-cgroups`` flag,
retries after a backoff of 1 s growing to 30 s, a look every :data:`HOST_CGROUPS_CHECK` seconds
while all are confined, what they held given back when :meth:`StateOwner.run` ends). One
module on purpose: restoring, serving and running effects
are one concept. The story is ``docs/architecture.md`` ("The tasks and the state owner",
"Crash safety", "Faults the daemon waits out").
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
from anyio import (
    TASK_STATUS_IGNORED,
    BrokenResourceError,
    ClosedResourceError,
    EndOfStream,
    WouldBlock,
)
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu.adapters.backoff import Health, RetryLog, backoff_delays
from dracpu.adapters.host_cgroups import RECORD_FILE, CgroupState, HostCgroups, cgroup_root
from dracpu.adapters.node_files import FILE_EFFECTS, NodeFiles
from dracpu.adapters.sysfs import read_topology
from dracpu.config import Config
from dracpu.core import external_attributes
from dracpu.core.claim_config import ALLOCATOR_EXTERNAL
from dracpu.core.commands import AdoptClaims, AdoptedClaim, Command, RepairNodeFiles, Resync
from dracpu.core.devices import Device
from dracpu.core.effects import (
    ClaimsAdopted,
    ConfineHostCgroups,
    DeleteCdiSpec,
    Effect,
    PruneCdiSpecs,
    PublishSlices,
    Reply,
    Resynced,
    UpdateContainers,
    WriteCdiSpec,
    WriteCheckpoint,
    WriteDeviceMetadata,
)
from dracpu.core.health import claim_device_problems, reported_devices
from dracpu.core.node_config import NodeConfig
from dracpu.core.reconfigure import stranded_claims
from dracpu.core.state import NodeState, apply, commit_phase, restore_state, rollback
from dracpu.errors import CdiError, CheckpointError, DracpuError
from dracpu.tasks.device_health import DeviceHealthBoard
from dracpu.tasks.slice_publisher import Republish, request_republish

__all__ = [
    "CDI_DIR_CHECK_INTERVAL",
    "COMMAND_DEADLINE",
    "COMMAND_QUEUE_SIZE",
    "HOST_CGROUPS_CHECK",
    "ContainerUpdates",
    "OwnerStatistics",
    "Request",
    "StateOwner",
    "create_request_stream",
    "request",
]

logger = logging.getLogger(__name__)

# Requests waiting for the owner beyond this block their senders (back pressure, never an
# unbounded queue; anyio docs/streams.rst). The kubelet prepares a pod's claims in one call and
# the runtime sends one NRI event at a time, so 64 waiting commands mean the owner is stuck.
COMMAND_QUEUE_SIZE = 64

# Longest a command's effects may run. They are local file writes (CDI spec, checkpoint with
# fsync) and hand-offs to other tasks; 4 s leaves room for a slow fsync and keeps a graceful
# stop within the daemon's 5 s.
COMMAND_DEADLINE = 4.0

# Tests of a state dir or CDI dir that cannot be written: quick at first (a mount being set up,
# space being freed), then every 2 s at most. Every Prepare fails until one works: the dir must
# be used again within seconds of its repair. A test is one failed file creation (in the CDI
# dir no runtime sees it).
_DIR_RETRY = partial(backoff_delays, initial=0.25, cap=2.0)
# While the CDI dir works, a look at its file system (statvfs: read-only, full?) this often,
# which writes nothing: a dir remounted read-only shows on /readyz before a Prepare fails.
CDI_DIR_CHECK_INTERVAL = 10.0
# How often the confined host cgroups are looked at while all is well (seconds): a value another
# writer put there (systemd, at a reload of a slice with AllowedCPUs=) is written over.
HOST_CGROUPS_CHECK = 10.0
# Retries of host cgroups that could not be confined (tasks' "waited out" rule): a slice that
# systemd creates later, a cgroup fs mounted later; every 30 s at most.
_HOST_CGROUPS_RETRY = partial(backoff_delays, initial=1.0, cap=30.0)

C = TypeVar("C")
T = TypeVar("T")

ContainerUpdates = Callable[[UpdateContainers], None]
"""Takes the owner's unsolicited container updates without blocking and without failing (the
NRI task's :meth:`~dracpu.tasks.nri_link.NriLink.submit`)."""


# --- the requesters' side -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request(Generic[C]):
    """A command for the owner (``C`` is :data:`~dracpu.core.commands.Command`) and the one-shot
    stream (buffer 1) its answer goes to."""

    command: C
    reply: MemoryObjectSendStream[object]


def create_request_stream(
    max_buffer_size: int = COMMAND_QUEUE_SIZE,
) -> tuple[MemoryObjectSendStream[Request[C]], MemoryObjectReceiveStream[Request[C]]]:
    """The bounded command stream: give each sending task its own ``clone()`` of the send side."""
    return anyio.create_memory_object_stream[Request[C]](max_buffer_size)


async def request(send: MemoryObjectSendStream[Request[C]], command: C) -> object:
    """Send ``command`` to the owner and wait for its answer.

    Returns the answer's value; raises it when it is a :class:`~dracpu.errors.DracpuError`.
    Raises DracpuError when the owner is not running or stops before answering. Cancelling the
    caller is safe at any point: the owner still applies a command it received.
    """
    reply_send, reply_receive = anyio.create_memory_object_stream[object](1)
    with reply_receive:
        delivered = False
        try:
            try:  # queued at once when there is room: no event-loop round before it
                send.send_nowait(Request(command, reply_send))
            except WouldBlock:
                await send.send(Request(command, reply_send))
            delivered = True
        except (BrokenResourceError, ClosedResourceError) as exc:
            raise DracpuError(
                f"cannot send {type(command).__name__}: the state owner is not running"
            ) from exc
        finally:
            if not delivered:
                reply_send.close()
        try:
            value = await reply_receive.receive()
        except EndOfStream:
            raise DracpuError(
                f"the state owner stopped before answering {type(command).__name__}"
            ) from None
    if isinstance(value, DracpuError):
        raise value
    return value


# --- the owner ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OwnerStatistics:
    """Counters of the owner since it started (for ``/metrics`` and debugging)."""

    commands_applied: int
    """Commands whose new state was committed."""
    commands_failed: int
    """Commands answered with an error while the old state was kept."""
    effects_failed: int
    """Effects that raised (commit phase, rollback and post-commit)."""
    queue_depth: int
    """Requests waiting in the command stream now."""
    by_command: Mapping[tuple[str, str], int]
    """Commands handled, by (command type name, outcome). Outcomes: ``ok`` (committed, answered
    with a result), ``error`` (committed, answered with an error value ``apply`` chose) and
    ``failed`` (not committed: a commit-phase effect failed)."""


class _CommitFailed(Exception):
    """The commit phase failed (``error``) after the effects in ``started`` began."""

    def __init__(self, error: DracpuError, started: list[Effect]) -> None:
        super().__init__(str(error))
        self.error = error
        self.started = started


class _DirCondition:
    """A directory the owner writes and waits out while it cannot be written: its readiness
    flag, the log of its changes (:class:`~dracpu.adapters.backoff.RetryLog`) and when to test
    it next (:attr:`due`, on anyio's clock). ``check_every``: while it works, how often to look
    at it without writing (``inf``: never)."""

    def __init__(
        self,
        what: str,
        flag: Health | None,
        delays: Callable[[], Iterator[float]],
        check_every: float = math.inf,
    ) -> None:
        self._flag = flag
        self._log = RetryLog(logger, what)
        self._delays_made = delays
        self._delays: Iterator[float] | None = None
        self._check_every = check_every
        self.failing = False
        self.suspect = False
        self.due = math.inf

    def failed(self, problem: str, consequence: str) -> None:
        """It cannot be written (``problem``); test it again after the next backoff delay."""
        if self._delays is None:
            self._delays = self._delays_made()
        delay = next(self._delays)
        self.failing = True
        self.suspect = False
        self.due = anyio.current_time() + delay
        self._log.failed(f"{problem}; {consequence}", retry_in=delay, level=logging.ERROR)
        if self._flag is not None:
            self._flag.set_not_ready(problem)

    def works(self) -> None:
        self._delays = None
        self.failing = self.suspect = False
        self.due = anyio.current_time() + self._check_every
        self._log.recovered()
        if self._flag is not None:
            self._flag.set_ready()

    def write_failed(self) -> None:
        """A write into it failed: test it at the next idle moment."""
        if not self.failing:
            self.suspect = True
            self.due = anyio.current_time()


# What a claim's file problem means for its containers, by the kind of file (health messages).
_CDI_SPEC = "CDI spec"
_METADATA = "device metadata"
_CONSEQUENCE = {
    _CDI_SPEC: "containers using the claim cannot start until it is written",
    _METADATA: "containers using the claim do not find their device metadata until it is written",
}


def _problem_key(effect: Effect) -> tuple[str, str] | None:
    """The (claim UID, kind of file) a file effect writes for a prepared claim."""
    match effect:
        case WriteCdiSpec(claim_uid=uid):
            return uid, _CDI_SPEC
        case WriteDeviceMetadata(claim=claim):
            return claim.claim_uid, _METADATA
        case _:
            return None


class StateOwner:
    """Holds the node state; :meth:`run` is the task (see the module docstring).

    ``receive``: the receiving end of :func:`create_request_stream` (closed when :meth:`run`
    ends). ``republish``: the sending end of the slice publisher's republish channel;
    ``container_updates``: where ``UpdateContainers`` effects go (``None``: dropped with a debug
    log, the next NRI ``Synchronize`` re-pins every container anyway). ``files``: the CDI specs,
    the device metadata, the checkpoint and the host cgroups (default: the config's directories
    and the host's cgroup fs). ``state_dir`` and ``cdi_dir``: told whether the checkpoint, and
    the CDI specs, can be written, with the reason when not; ``retry_delays`` makes the delays
    between the tests of a dir meanwhile. ``host_cgroups`` makes the readiness flag of the host
    cgroups (when one is first listed); ``cgroup_retry_delays`` the delays between attempts
    while one cannot be confined; ``cgroup_check`` the seconds between two looks at them while
    all are.
    """

    def __init__(
        self,
        config: Config,
        receive: MemoryObjectReceiveStream[Request[Command]],
        *,
        republish: MemoryObjectSendStream[Republish] | None = None,
        container_updates: ContainerUpdates | None = None,
        files: NodeFiles | None = None,
        command_deadline: float = COMMAND_DEADLINE,
        state_dir: Health | None = None,
        cdi_dir: Health | None = None,
        retry_delays: Callable[[], Iterator[float]] = _DIR_RETRY,
        host_cgroups: Callable[[], Health] | None = None,
        cgroup_retry_delays: Callable[[], Iterator[float]] = _HOST_CGROUPS_RETRY,
        cgroup_check: float = HOST_CGROUPS_CHECK,
    ) -> None:
        self.config = config
        self._receive = receive
        self._republish = republish
        self._container_updates = container_updates
        self._files = (
            NodeFiles(
                config.cdi_dir,
                config.checkpoint_path,
                config.device_metadata_dir,
                HostCgroups(cgroup_root(config.host_root), config.state_dir / RECORD_FILE),
            )
            if files is None
            else files
        )
        self._command_deadline = command_deadline
        # The file effects run in anyio's worker threads, one hop at a time and in order: the
        # owner awaits each hop, and this limiter keeps any other caller out of the way.
        self._files_limiter = anyio.CapacityLimiter(1)
        self._handed_over = False  # the state dir is the next dracpu's: no file is written
        self._state: NodeState | None = None
        # The published devices' health (the DRA socket's health streams read it).
        self.health = DeviceHealthBoard()
        # Why a prepared claim's files could not be written, by (claim UID, kind of file);
        # the health board shows it on the claim's devices until a write of them works.
        self._file_problems: dict[tuple[str, str], str] = {}
        self._reported_problems: Mapping[str, str] = {}
        self._applied = 0
        self._failed = 0
        self._effects_failed = 0
        self._by_command: Counter[tuple[str, str]] = Counter()
        self._state_dir = _DirCondition(
            f"writing the checkpoint in {self._files.checkpoint_path.parent}",
            state_dir,
            retry_delays,
        )
        self._cdi_dir = _DirCondition(
            f"writing CDI specs in {self._files.cdi_dir}",
            cdi_dir,
            retry_delays,
            check_every=CDI_DIR_CHECK_INTERVAL,
        )
        # The host cgroups: their readiness flag (made when a cgroup is first listed), and the
        # next try while one cannot be confined.
        self._cgroups_flag_factory = host_cgroups
        self._cgroups_flag: Health | None = None
        self._cgroup_retry_delays = cgroup_retry_delays
        self._cgroup_check = cgroup_check
        self._cgroups_log = RetryLog(logger, "confining the host cgroups")
        self._cgroups_delays: Iterator[float] | None = None
        self._cgroups_retry_at: float | None = None  # None: nothing listed

    # --- what other tasks read -------------------------------------------------------------------

    @property
    def state(self) -> NodeState:
        """The committed state; :class:`~dracpu.errors.DracpuError` before the restore read the
        topology."""
        if self._state is None:
            raise DracpuError("the state owner has not restored the node yet")
        return self._state

    def statistics(self) -> OwnerStatistics:
        """A snapshot of the counters and the queue depth."""
        return OwnerStatistics(
            commands_applied=self._applied,
            commands_failed=self._failed,
            effects_failed=self._effects_failed,
            queue_depth=self._receive.statistics().current_buffer_used,
            by_command=MappingProxyType(dict(self._by_command)),
        )

    def host_cgroups(self) -> tuple[CgroupState, ...]:
        """The listed host cgroups: what each is confined to, or why it is not."""
        return self._files.host_cgroups()

    # --- the task ------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        """Restore the node, report ready, then serve requests until every send side of the
        stream is closed (or until cancelled). On exit the requests still queued are answered
        with an error and the receive stream is closed. Raises DracpuError when the node cannot
        be restored (topology, an unreadable checkpoint, a failed adoption)."""
        try:
            await self.restore()
            task_status.started()
            while (req := await self._next_request()) is not None:
                await self._handle(req)
        finally:
            self._refuse_queued()
            self._receive.close()
            with anyio.CancelScope(shield=True):
                await self._release_host_cgroups()

    async def _next_request(self) -> Request[Command] | None:
        """The next request (``None``: every send side is closed); meanwhile a dir whose test is
        due is tested (a checkpoint or CDI dir that cannot be written, the CDI dir's look), and
        the host cgroups are confined again when due."""
        while True:
            cgroups = math.inf if self._cgroups_retry_at is None else self._cgroups_retry_at
            due = min(self._state_dir.due, self._cdi_dir.due, cgroups)
            if self._handed_over:
                due = math.inf  # the dirs are the next dracpu's to test
            with anyio.CancelScope(deadline=due):
                try:
                    return await self._receive.receive()
                except EndOfStream:
                    return None
            now = anyio.current_time()
            if self._state_dir.due <= now:
                await self._write_checkpoint()
            if self._cdi_dir.due <= now:
                await self._check_cdi_dir()
            if self._cgroups_retry_at is not None and self._cgroups_retry_at <= now:
                await self._confine_again()

    async def _confine_again(self) -> None:
        """Confine the listed host cgroups to the committed state's pool once more."""
        if self._handed_over:
            self._cgroups_retry_at = None
            return
        state = self.state
        effect = ConfineHostCgroups(state.config.host_cgroups, state.host_pool)
        with anyio.CancelScope(shield=True):
            await self._files_call(self._files.run_batch, (effect,), [])
        self._follow_host_cgroups(retried=True)

    async def _release_host_cgroups(self) -> None:
        """The daemon stops: every confined host cgroup gets back what it held (unless the
        state dir went to the next dracpu, which keeps them confined)."""
        if self._handed_over:
            return
        try:
            await self._files_call(self._files.release_host_cgroups)
        except Exception:  # a bug: never hide the reason the owner stopped
            logger.exception("giving the host cgroups back what they held failed")

    async def stop_writing(self) -> None:
        """The state dir goes to the next dracpu (:mod:`dracpu.tasks.handover`): wait for the
        file effect in flight, then write no file any more. Commands that need one fail from
        now on (and are rolled back); container events, which write none, are still served."""
        async with self._files_limiter:
            self._handed_over = True
        self._cgroups_retry_at = None
        logger.info("the state owner writes no file any more: the state dir is handed over")

    async def _files_call(self, function: Callable[..., T], *args: object) -> T:
        """``function(*args)`` in a worker thread, one at a time, unless the state dir was
        handed over (checked under the limiter, so no write begins after
        :meth:`stop_writing` returned)."""

        def call() -> T:
            if self._handed_over:
                raise DracpuError("the state dir was handed over to the next dracpu")
            return function(*args)

        return await anyio.to_thread.run_sync(call, limiter=self._files_limiter)

    def _follow_host_cgroups(self, *, retried: bool = False) -> None:
        """Report the host cgroups after an attempt to confine them: the readiness flag (not
        ready, naming each cgroup that could not be confined and why), the log (once per
        change), and the next attempt: after a backoff while one could not be confined
        (``retried``: this was such an attempt), else a check every
        :data:`HOST_CGROUPS_CHECK` seconds while any is listed (what another writer changed,
        systemd at a reload, is put right)."""
        states = self._files.host_cgroups()
        problems = [f"{state.path}: {state.problem}" for state in states if state.problem]
        if states and self._cgroups_flag is None and self._cgroups_flag_factory is not None:
            self._cgroups_flag = self._cgroups_flag_factory()
        flag = self._cgroups_flag
        if problems:
            if self._cgroups_delays is None or retried:
                if self._cgroups_delays is None:
                    self._cgroups_delays = self._cgroup_retry_delays()
                delay = next(self._cgroups_delays)
                self._cgroups_retry_at = anyio.current_time() + delay
                self._cgroups_log.failed("; ".join(problems), retry_in=delay)
            if flag is not None:  # the problems only: the CPUs move at every claim
                flag.set_not_ready("; ".join(f"cannot confine {p}" for p in problems))
            return
        self._cgroups_delays = None
        self._cgroups_log.recovered()
        self._cgroups_retry_at = anyio.current_time() + self._cgroup_check if states else None
        if flag is not None:
            flag.set_ready(_cgroups_report(states))

    async def _write_checkpoint(self) -> None:
        """Write the committed state's checkpoint (even unchanged): the state dir's test."""
        if self._handed_over:
            return
        data = self.state.checkpoint()
        try:
            await self._files_call(self._files.write_checkpoint, data)
        except CheckpointError as error:
            self._state_dir.failed(str(error), "Prepare and Unprepare fail until then")
        else:
            self._state_dir.works()

    async def _check_cdi_dir(self) -> None:
        """The CDI dir's test: while it works, a look at its file system (read-only, full?)
        that writes nothing; once a write failed, a probe file created and removed. When it
        works again after it failed, every claim's files are written again."""
        if self._handed_over:
            return
        condition = self._cdi_dir
        probe = condition.failing or condition.suspect
        try:
            await anyio.to_thread.run_sync(
                self._files.check_cdi_dir, probe, limiter=self._files_limiter
            )
        except CdiError as error:
            condition.failed(str(error), "Prepare fails until then")
            return
        recovered = condition.failing
        condition.works()
        if recovered:
            await self._start_command(RepairNodeFiles())

    def _refuse_queued(self) -> None:
        while True:
            try:
                req = self._receive.receive_nowait()
            except (WouldBlock, EndOfStream, ClosedResourceError):
                return
            with req.reply:
                name = type(req.command).__name__
                _answer(req, DracpuError(f"the state owner stopped before handling {name}"))

    async def _handle(self, req: Request[Command]) -> None:
        name = type(req.command).__name__

        def answer(value: object, committed: bool) -> None:
            if committed:
                self._count_applied(name, value)
            else:
                assert isinstance(value, DracpuError)
                self._count_failed(name, value)
            _answer(req, value)

        with req.reply:  # closed once the owner is done with the request
            await self._run(req.command, answer)

    async def _start_command(self, command: Command, *, roll_back: bool = True) -> None:
        """Apply ``command`` as a request is, on the owner's own account (at start, and when
        the CDI dir works again): its answer is logged."""
        name = type(command).__name__

        def answer(value: object, committed: bool) -> None:
            if committed:
                _report(value)
            else:
                logger.error("start-up %s failed: %s", name, value)

        await self._run(command, answer, roll_back=roll_back)

    async def _run(
        self,
        command: Command,
        answer: Callable[[object, bool], None],
        *,
        roll_back: bool = True,
    ) -> None:
        """The one way a command is run: :func:`~dracpu.core.state.apply`, the commit phase,
        the new state adopted, ``answer(value, committed)``, the post-commit effects. A failed
        commit phase keeps the old state and is rolled back, or (``roll_back=False``: the
        start-up adoption, whose specs are the claims' only record) keeps the new state all
        the same."""
        name = type(command).__name__
        old = self.state
        try:
            new, effects = apply(old, command)
            commit, reply, after = commit_phase(effects)
            with self._effects_scope() as scope:
                await self._commit(commit)
            if scope.cancelled_caught:
                raise _CommitFailed(self._cut_off("the commit phase"), [])
        except _CommitFailed as failed:
            if roll_back:
                await self._roll_back(name, old, failed.started, failed.error)
                self._follow_file_problems()
                self._follow_host_cgroups()
                answer(failed.error, False)
                return
            # The file's condition is reported on its own (a CDI dir or state dir that cannot
            # be written); what this means for the command is said here.
            logger.warning(
                "start-up %s could not write all its files, its claims are kept all the same: %s",
                name,
                failed.error,
            )
        except Exception as exc:
            answer(DracpuError(f"{name}: internal error: {exc!r}"), False)
            raise
        self._state = new
        self._follow_health(old, new)
        self._follow_host_cgroups()
        answer(reply.value, True)
        await self._post_commit(name, after)
        self._follow_file_problems()

    # --- effects -------------------------------------------------------------------------------

    def _effects_scope(self) -> anyio.CancelScope:
        """Shielded from outside cancellation, bounded by the command deadline."""
        scope = anyio.CancelScope(shield=True)
        if math.isfinite(self._command_deadline):
            scope.deadline = anyio.current_time() + self._command_deadline
        return scope

    def _cut_off(self, what: str) -> DracpuError:
        self._effects_failed += 1
        return DracpuError(f"{what} did not finish within {self._command_deadline:g} s")

    async def _commit(self, effects: Sequence[Effect]) -> None:
        """The commit phase, in order, each run of consecutive file effects in one hop to a
        worker thread; raises :class:`_CommitFailed` naming the effects that began (the failed
        one last; the ones after it never began and left no trace). A hop that has begun is
        waited for; past the deadline, the next effect does not begin."""
        started: list[Effect] = []
        index = 0
        try:
            while index < len(effects):
                if started:
                    await anyio.lowlevel.checkpoint_if_cancelled()
                effect = effects[index]
                if not isinstance(effect, FILE_EFFECTS):
                    started.append(effect)
                    self._run_now(effect)
                    index += 1
                    continue
                end = index + 1
                while end < len(effects) and isinstance(effects[end], FILE_EFFECTS):
                    end += 1
                await self._run_files(effects[index:end], started)
                index = end
            if self._state_dir.failing and any(
                isinstance(effect, WriteCheckpoint) for effect in effects
            ):
                self._state_dir.works()
        except DracpuError as error:
            self._effects_failed += 1
            if isinstance(error, CheckpointError):
                self._state_dir.failed(str(error), "Prepare and Unprepare fail until then")
            raise _CommitFailed(error, started) from error
        except anyio.get_cancelled_exc_class():
            if started:  # the deadline passed; the effects begun have all run to their end
                cut = self._cut_off(f"the commit phase (cut off after {_kind(started[-1])})")
                raise _CommitFailed(cut, started) from None
            raise

    async def _run_files(self, batch: Sequence[Effect], started: list[Effect]) -> None:
        """File effects in one hop to a worker thread, each outcome noted
        (:meth:`_note_file`). A caller cancelled while the hop runs still waits for it
        (anyio's default: the thread is not abandoned)."""
        before = len(started)
        try:
            await self._files_call(self._files.run_batch, batch, started)
        except DracpuError as error:
            begun = started[before:]
            for effect in begun[:-1]:
                self._note_file(effect, None)
            if begun:
                self._note_file(begun[-1], error)
            raise
        for effect in batch:
            self._note_file(effect, None)

    def _note_file(self, effect: Effect, error: DracpuError | None) -> None:
        """Keep what a file effect's outcome says of its claim's files (their health) and of
        the CDI dir (a failed write there has the dir tested)."""
        if error is not None and isinstance(effect, WriteCdiSpec | DeleteCdiSpec | PruneCdiSpecs):
            self._cdi_dir.write_failed()
        key = _problem_key(effect)
        if key is None:
            return
        if error is not None:
            self._file_problems[key] = str(error)
        elif self._file_problems.pop(key, None) is not None:
            logger.info("the %s of claim %s is written again", key[1], key[0])

    def _run_now(self, effect: Effect) -> None:
        """An effect that hands something to another task: it never blocks."""
        match effect:
            case UpdateContainers():
                if self._container_updates is None:
                    logger.debug(
                        "no NRI task: dropping updates of %d containers", len(effect.updates)
                    )
                else:
                    self._container_updates(effect)
            case PublishSlices(devices=devices):
                self._publish(devices)
            case _:
                raise DracpuError(f"{_kind(effect)} is not an effect to run here")

    async def _execute(self, effect: Effect) -> None:
        """One effect, whatever its kind (rollback and post-commit effects)."""
        if isinstance(effect, FILE_EFFECTS):
            await self._run_files((effect,), [])
        else:
            self._run_now(effect)

    async def _roll_back(
        self, name: str, old: NodeState, started: Sequence[Effect], error: DracpuError
    ) -> None:
        """Put back the files of ``old``; the undo effects' own failures are logged."""
        failed = started[-1] if started else None
        with self._effects_scope() as scope:
            for effect in rollback(old, started, error):
                if isinstance(effect, Reply):
                    continue  # the caller answers
                try:
                    await self._execute(effect)
                except DracpuError as exc:
                    if effect == failed:
                        # The undo is the very effect that failed, failing again: that effect
                        # left its file as it was (a file is written by rename, a checkpoint
                        # slot the store could not mark says so itself), so there is nothing
                        # to put back, and nothing new to report.
                        logger.debug("%s: rollback effect %s: %s", name, _kind(effect), exc)
                        continue
                    self._effects_failed += 1
                    logger.error("%s: rollback effect %s failed: %s", name, _kind(effect), exc)
        if scope.cancelled_caught:
            self._effects_failed += 1
            logger.error("%s: rollback did not finish within %g s", name, self._command_deadline)

    async def _post_commit(self, name: str, effects: Sequence[Effect]) -> None:
        """Effects after the reply, each on its own: failures are logged (a claim's file that
        failed the same way before at DEBUG) and counted, the new state stays."""
        if not effects:
            return
        with self._effects_scope() as scope:
            for effect in effects:
                key = _problem_key(effect)
                before = None if key is None else self._file_problems.get(key)
                try:
                    await self._execute(effect)
                except DracpuError as exc:
                    self._effects_failed += 1
                    level = logging.DEBUG if before == str(exc) else logging.ERROR
                    logger.log(
                        level, "%s: post-commit effect %s failed: %s", name, _kind(effect), exc
                    )
        if scope.cancelled_caught:
            self._effects_failed += 1
            logger.error("%s: post-commit effects cut off after %g s", name, self._command_deadline)

    def _publish(self, devices: tuple[Device, ...]) -> None:
        """Ask the slice publisher to publish ``devices`` now (the request carries them);
        their health follows the committed state (:meth:`_follow_health`)."""
        if self._republish is not None:
            request_republish(self._republish, Republish("resync", devices))

    def _follow_health(self, old: NodeState, new: NodeState) -> None:
        """Tell the health board the devices to report when the committed state changed them:
        a new node config (a SIGHUP read the topology and the config file again; its topology's
        online CPUs too), or other claims on CPUs that went offline
        (:func:`dracpu.core.health.reported_devices`). Every other command costs two compares."""
        config = new.config
        if config is old.config and not (config.held and new.claimed != old.claimed):
            return
        online = None if config.topology is old.config.topology else config.topology.online
        devices = reported_devices(config.devices.values(), config.held, new.claimed)
        self.health.set_devices(devices, online=online)

    def _follow_file_problems(self) -> None:
        """Tell the health board about the prepared claims whose files could not be written
        (a claim no longer prepared takes its problems with it)."""
        claims = self.state.claims
        for key in [key for key in self._file_problems if key[0] not in claims]:
            del self._file_problems[key]
        messages: dict[str, list[str]] = {}
        for (uid, kind), error in sorted(self._file_problems.items()):
            messages.setdefault(uid, []).append(f"{error}; {_CONSEQUENCE[kind]}")
        problems = claim_device_problems(
            self.state.config, claims, {uid: "; ".join(m) for uid, m in messages.items()}
        )
        if problems != self._reported_problems:
            self._reported_problems = problems
            self.health.set_problems(problems)

    # --- counting --------------------------------------------------------------------------------

    def _count_applied(self, name: str, value: object) -> None:
        self._applied += 1
        outcome = "error" if isinstance(value, BaseException) else "ok"
        self._by_command[name, outcome] += 1
        logger.debug("%s applied (%s)", name, outcome, extra={"command": name})

    def _count_failed(self, name: str, error: DracpuError) -> None:
        self._failed += 1
        self._by_command[name, "failed"] += 1
        logger.warning("%s failed, state unchanged: %s", name, error, extra={"command": name})

    # --- restore ---------------------------------------------------------------------------------

    async def restore(self) -> NodeState:
        """The start state (``docs/architecture.md``, "Crash safety"); raises DracpuError when
        the node cannot be read (topology, an unreadable checkpoint) or the adoption of CDI
        specs fails."""
        config = self.config
        read = partial(read_topology, config.host_root, pcie_roots=config.expose_pcie_roots)
        topology = await anyio.to_thread.run_sync(read)
        outside = config.reserved_cpus - topology.online
        if outside:
            logger.warning("reserved cpus %s are not online on this node; ignored", outside)
        node = NodeConfig.build(
            config.node_name,
            topology,
            reserved=config.reserved_cpus,
            mode=config.cpu_device_mode,
            group_by=config.group_by,
            pin_memory=config.memory_pinning,
            external_allocator=config.allocator == ALLOCATOR_EXTERNAL,
            host_cgroups=config.confine_host_cgroups,
        )
        if node.external_allocator:
            grouped = [(d.name, d.cpus) for d in node.devices.values() if d.grouped]
            for reason in external_attributes.left_out(topology, grouped):
                logger.warning("allocator external: %s", reason)
        logger.info(
            "topology: %d online cpus (%s), %d allocatable, %d devices",
            len(topology.online),
            topology.online,
            len(node.allocatable),
            len(node.devices),
        )
        data = await anyio.to_thread.run_sync(self._files.restore_checkpoint)
        state, refused = restore_state(node, data)
        reported = reported_devices(node.devices.values(), state.config.held, state.claimed)
        self.health.set_devices(reported, online=topology.online)
        for stranded in stranded_claims(state.claims, state.claimed - state.config.allocatable):
            logger.warning("%s", stranded.warning(), extra={"claim_uid": stranded.claim_uid})
        for uid, reason in refused:
            claim = data.claims[uid]
            logger.error(
                "checkpointed claim %s (cpus %s, %s/%s) no longer fits this node and is dropped: "
                "%s",
                uid,
                claim.cpus,
                claim.namespace or "?",
                claim.name or "?",
                reason,
                extra={"claim_uid": uid},
            )
        logger.info(
            "restored %d prepared claims from %s", len(state.claims), config.checkpoint_path
        )
        self._state = state
        await self._adopt()
        # The checkpoint must hold exactly the claims we keep (refused ones dropped, adopted ones
        # added); and whether the state dir takes writes is known before the first Prepare.
        await self._write_checkpoint()
        await self._start_command(Resync())
        # Whether the CDI dir takes writes, before the first Prepare (the Resync writes
        # nothing when every file is in place already).
        self._cdi_dir.suspect = True
        await self._check_cdi_dir()
        return self.state

    async def _adopt(self) -> None:
        """Adopt our CDI specs that the checkpoint lacks."""
        try:
            specs = await anyio.to_thread.run_sync(self._files.our_specs)
        except CdiError as exc:
            logger.error("cannot look for CDI specs to adopt: %s", exc)
            return
        claims = self.state.claims
        candidates: list[AdoptedClaim] = []
        for uid, spec in sorted(specs.items()):
            if uid in claims:
                continue
            if isinstance(spec, CdiError):
                logger.warning("CDI spec of claim %s cannot be adopted: %s", uid, spec)
                continue
            candidates.append(AdoptedClaim(uid, spec.cpus, spec.shared_pool))
        if not candidates:
            return
        # The specs are the only record of these claims: a rollback would delete them and
        # dropping them would have the Resync below prune them. So they are kept even when
        # their files cannot be written (a read-only CDI dir, a full state dir): the specs are
        # still there, the checkpoint write after this and the state dir's retries write them
        # down, and a restart meanwhile adopts them again.
        await self._start_command(AdoptClaims(tuple(candidates)), roll_back=False)


def _report(value: object) -> None:
    """Log the answer to a command the owner runs on its own account."""
    match value:
        case ClaimsAdopted(adopted=adopted, rejected=rejected):
            if adopted:
                logger.warning(
                    "adopted %d claims from CDI specs the checkpoint lacked: %s",
                    len(adopted),
                    list(adopted),
                )
            for uid, reason in rejected:
                logger.error(
                    "cannot adopt the CDI spec of claim %s: %s (the spec is removed)",
                    uid,
                    reason,
                    extra={"claim_uid": uid},
                )
        case Resynced(claims=claims):
            logger.info("the files of %d prepared claims are being put in place", claims)
        case DracpuError():
            logger.error("start-up command refused: %s", value)
        case _:
            pass


def _cgroups_report(states: Sequence[CgroupState]) -> str:
    """The confined host cgroups in one line (``/readyz``): the CPUs each is confined to."""
    by_cpus: dict[str, list[str]] = {}
    for state in states:
        if state.cpus is not None:
            by_cpus.setdefault(str(state.cpus), []).append(state.path)
    confined = [f"{', '.join(paths)} confined to cpus {cpus}" for cpus, paths in by_cpus.items()]
    return "; ".join(confined) or "no host cgroup listed"


def _kind(effect: object) -> str:
    """An effect in a message: its type (its fields can be a whole checkpoint)."""
    return type(effect).__name__


def _answer(req: Request[Command], value: object) -> None:
    # The requester may be gone (cancelled, closed its end): its answer is dropped, the owner
    # goes on. WouldBlock cannot happen for the first answer on a stream of buffer 1.
    try:
        req.reply.send_nowait(value)
    except (BrokenResourceError, ClosedResourceError, WouldBlock):
        logger.debug("the requester of %s is gone; answer dropped", type(req.command).__name__)
