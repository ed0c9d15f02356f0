"""The state owner: the one task that changes node state (design §3).

Every other task sends it a :class:`Request` (a command plus a one-shot reply stream) over one
bounded memory object stream; :func:`request` is the client side. The owner closes each request's
reply stream right after that request's last effect, before it takes the next one
(:attr:`PendingReply.handled`). For each request the owner
calls the pure ``apply(state, command) -> (new_state, effects)`` and runs the effects in order:

- a :class:`~dracpu.core.effects.Reply` **commits** the new state (it becomes the owner's state)
  and sends its value to the requester;
- any other effect is awaited through ``execute(effect)``; with an ``execute_batch`` the effects
  before the Reply go to it together, in one call (``execute_batch(effects, started)``), so an
  executor can run a Prepare's file writes in one worker-thread hop.

The effects before the Reply are the commit phase, already in crash-safe order (write the CDI
spec, then the checkpoint, then reply). If one of them fails, the owner keeps the OLD state, runs
the undo effects of ``rollback(old_state, started_effects, error)`` (restore the files of the old
state; their own failures are logged) and answers the requester with the error, then goes on with
the next request: nothing was promised, and the checkpoint on disk still equals the state kept.
Without a ``rollback`` the error is answered and the files are left to the next reconciliation.
Effects after the Reply are post-commit (widening shared containers): their failure is logged and
counted, the new state stays (the requester was already told, the checkpoint already holds it),
and ``follow_up(effect, error)`` may name a command the owner applies itself right after (a
failed ``UpdateContainers`` becomes ``InvalidateContainers``). A command whose effects hold no
Reply commits after its last effect and is answered ``None``: every request gets one answer.
This is the protocol :mod:`dracpu.core.state` describes (``commit_phase``, ``rollback``).

Error handling: a :class:`~dracpu.errors.DracpuError` from ``apply`` or an effect is an expected
failure (a bad claim, a full disk): answered, logged, counted. Any other exception is a bug: the
requester is answered with a DracpuError wrapping it, then the exception ends the owner and with
it the task group (the DaemonSet restarts the daemon, which restores the checkpoint).

Cancellation: a requester that is cancelled while waiting never disturbs the owner; its answer
is dropped (``suppress(BrokenResourceError, ClosedResourceError)``). The owner runs one command's
effects in a cancel scope shielded from outside cancellation but bounded by ``command_deadline``,
so a stop lets the command in flight finish (or fail cleanly) and a hung effect cannot block the
owner forever; a command cut off by the deadline fails like any other. Requests still queued when
the owner stops are answered with an error, never left hanging.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, TypeVar

import anyio
from anyio import (
    TASK_STATUS_IGNORED,
    BrokenResourceError,
    ClosedResourceError,
    EndOfStream,
    WouldBlock,
)
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu.core.effects import Reply
from dracpu.errors import DracpuError

__all__ = [
    "COMMAND_DEADLINE",
    "COMMAND_QUEUE_SIZE",
    "ExecuteBatch",
    "FollowUp",
    "OwnerStatistics",
    "PendingReply",
    "Request",
    "Rollback",
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
# fsync) and NRI calls that the runtime itself times out at 2 s; 4 s leaves room for a slow
# fsync and keeps a graceful stop within the daemon's 5 s.
COMMAND_DEADLINE = 4.0

S = TypeVar("S")
C = TypeVar("C")
E = TypeVar("E")  # the effect type, Reply included (the owner never passes a Reply to execute)


@dataclass(frozen=True, slots=True)
class Request(Generic[C]):
    """A command for the owner and the one-shot stream (buffer 1) its answer goes to."""

    command: C
    reply: MemoryObjectSendStream[object]


@dataclass(frozen=True, slots=True)
class OwnerStatistics:
    """Counters of the owner since it started (for ``/metrics`` and debugging)."""

    commands_applied: int
    """Commands whose new state was committed."""
    commands_failed: int
    """Commands answered with an error while the old state was kept."""
    effects_failed: int
    """Effects that raised (commit phase and post-commit)."""
    queue_depth: int
    """Requests waiting in the command stream now."""
    by_command: Mapping[tuple[str, str], int]
    """Commands handled, by (command type name, outcome). Outcomes: ``ok`` (committed, answered
    with a result), ``error`` (committed, answered with an error value ``apply`` chose) and
    ``failed`` (not committed: ``apply`` raised or a commit-phase effect failed)."""


def create_request_stream(
    max_buffer_size: int = COMMAND_QUEUE_SIZE,
) -> tuple[MemoryObjectSendStream[Request[C]], MemoryObjectReceiveStream[Request[C]]]:
    """The bounded command stream: give each sending task its own ``clone()`` of the send side."""
    return anyio.create_memory_object_stream[Request[C]](max_buffer_size)


class PendingReply:
    """A requester's end of one request's one-shot reply stream; use it for one :func:`request`.

    :func:`request` makes its own; a requester that must order the owner's effects against its
    request passes one it made and watches :attr:`handled` (the NRI plugin does).
    """

    __slots__ = ("_receive", "_send")

    def __init__(self) -> None:
        self._send, self._receive = anyio.create_memory_object_stream[object](1)

    @property
    def handled(self) -> bool:
        """The owner is done with the request: it answered and closed the reply stream.

        The owner closes a request's reply stream right after the request's last effect, before
        it takes the next request, so an effect the owner executes while this is true was decided
        after the request's answer; one it executes while this is false was decided before the
        answer or with it. True also once the request could not be sent.
        """
        return self._receive.statistics().open_send_streams == 0


async def request(
    send: MemoryObjectSendStream[Request[C]], command: C, *, reply: PendingReply | None = None
) -> object:
    """Send ``command`` to the owner and wait for its answer.

    Returns the answer's value; raises it when it is a :class:`~dracpu.errors.DracpuError`.
    Raises DracpuError when the owner is not running or stops before answering. Cancelling the
    caller is safe at any point: the owner still applies a command it received. ``reply``: the
    reply end to use (default: a new one); it is closed on return.
    """
    pending = PendingReply() if reply is None else reply
    with pending._receive:
        delivered = False
        try:
            try:  # queued at once when there is room: no event-loop round before it
                send.send_nowait(Request(command, pending._send))
            except WouldBlock:
                await send.send(Request(command, pending._send))
            delivered = True
        except (BrokenResourceError, ClosedResourceError) as exc:
            raise DracpuError(
                f"cannot send {type(command).__name__}: the state owner is not running"
            ) from exc
        finally:
            if not delivered:
                pending._send.close()
        try:
            value = await pending._receive.receive()
        except EndOfStream:
            raise DracpuError(
                f"the state owner stopped before answering {type(command).__name__}"
            ) from None
    if isinstance(value, DracpuError):
        raise value
    return value


Rollback = Callable[[S, Sequence[E], DracpuError], Sequence[E]]
"""``rollback(old_state, started_effects, error)``: effects that undo the commit-phase effects
already started (the failed one included), ending with ``Reply(error)``
(:func:`dracpu.core.state.rollback`)."""

FollowUp = Callable[[E, DracpuError], C | None]
"""``follow_up(effect, error)``: a command the owner applies itself after a post-commit effect
failed (a failed ``UpdateContainers`` becomes ``InvalidateContainers``), or ``None``."""

ExecuteBatch = Callable[[Sequence[E], list[E]], Awaitable[object]]
"""``execute_batch(effects, started)``: run the commit phase's effects in order, as ``execute``
would one by one, appending each to ``started`` just before it begins; on the first failure
raise (the failed effect is the last one in ``started``; the ones after it never began)
(:meth:`dracpu.tasks.node_machine.NodeMachine.execute_batch`)."""


class StateOwner(Generic[S, C, E]):
    """Owns the node state; :meth:`run` is the task. Read-only views: :attr:`state`,
    :meth:`statistics`."""

    def __init__(
        self,
        receive: MemoryObjectReceiveStream[Request[C]],
        state: S,
        apply: Callable[[S, C], tuple[S, Sequence[E]]],
        execute: Callable[[E], Awaitable[object]],
        *,
        rollback: Rollback[S, E] | None = None,
        follow_up: FollowUp[E, C] | None = None,
        command_deadline: float = COMMAND_DEADLINE,
        execute_batch: ExecuteBatch[E] | None = None,
    ) -> None:
        self._receive = receive
        self._state = state
        self._apply = apply
        self._execute = execute
        self._execute_batch = execute_batch
        self._rollback = rollback
        self._follow_up = follow_up
        self._command_deadline = command_deadline
        self._follow_ups: list[C] = []
        self._applied = 0
        self._failed = 0
        self._effects_failed = 0
        self._by_command: Counter[tuple[str, str]] = Counter()

    @property
    def state(self) -> S:
        """The current (committed) state."""
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

    async def run(self, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        """Serve requests until every send side of the stream is closed (or until cancelled).

        Resource handling: closes the receive stream on exit, after answering each request
        still queued with an error.

        Error handling: see the module docstring; only bugs (non-DracpuError exceptions from
        ``apply`` or an effect) escape, after the requester was answered.
        """
        try:
            task_status.started()
            async for req in self._receive:
                await self._handle(req)
                while self._follow_ups:
                    await self._handle_follow_up(self._follow_ups.pop(0))
        finally:
            self._refuse_queued()
            self._receive.close()

    def _refuse_queued(self) -> None:
        while True:
            try:
                req = self._receive.receive_nowait()
            except (WouldBlock, EndOfStream, ClosedResourceError):
                return
            with req.reply:
                name = type(req.command).__name__
                _answer(req, DracpuError(f"the state owner stopped before handling {name}"))

    async def _handle_follow_up(self, command: C) -> None:
        """Apply a command of our own: nobody waits for its answer (its stream is closed)."""
        reply_send, reply_receive = anyio.create_memory_object_stream[object](1)
        reply_receive.close()
        logger.info("applying %s after a failed effect", type(command).__name__)
        await self._handle(Request(command, reply_send), follow_ups=False)

    async def _handle(self, req: Request[C], *, follow_ups: bool = True) -> None:
        name = type(req.command).__name__
        # Closed after the last effect, before the next request: PendingReply.handled.
        with req.reply:
            try:
                new_state, effects = self._apply(self._state, req.command)
            except DracpuError as exc:
                self._fail(req, name, exc)
                return
            except Exception as exc:
                self._fail(req, name, DracpuError(f"{name}: internal error: {exc!r}"))
                raise
            await self._run_effects(req, name, new_state, effects, follow_ups=follow_ups)

    async def _run_effects(
        self,
        req: Request[C],
        name: str,
        new_state: S,
        effects: Sequence[E],
        *,
        follow_ups: bool,
    ) -> None:
        committed = False
        started: list[E] = []  # commit-phase effects begun, for the rollback
        current: E | None = None  # the effect being executed
        failure: DracpuError | None = None
        rest: Sequence[E] = effects  # the effects left for the loop below
        with self._effects_scope() as scope:
            if self._execute_batch is not None:
                batch = _before_reply(effects)
                rest = effects[len(batch) :]
                try:
                    failure = await self._run_batch(req, name, batch, started)
                finally:
                    current = started[-1] if started else None
            for effect in rest if failure is None else ():
                if isinstance(effect, Reply):
                    if committed:
                        logger.error("%s: a second Reply was dropped: %r", name, effect.value)
                    else:
                        committed = True
                        self._commit(req, name, new_state, effect.value)
                    continue
                if not committed:
                    started.append(effect)
                current = effect
                try:
                    await self._execute(effect)
                except DracpuError as exc:
                    self._effects_failed += 1
                    if not committed:
                        failure = exc
                        break
                    self._post_commit_failed(name, effect, exc, follow_ups=follow_ups)
                except Exception as exc:
                    self._effects_failed += 1
                    if not committed:
                        error = DracpuError(f"{name}: internal error in {_kind(effect)}: {exc!r}")
                        self._fail(req, name, error)
                    raise
        if scope.cancelled_caught:
            # The deadline cut off the last effect begun; whether it took place is unknown. (No
            # effect begun: the batch was cut off before its first one, there is nothing to undo.)
            self._effects_failed += 1
            deadline = self._command_deadline
            what = _kind(current) if current is not None else "the commit phase"
            error = DracpuError(f"{what} did not finish within {deadline:g} s")
            if committed:
                assert current is not None  # committed: the loop below the batch ran an effect
                self._post_commit_failed(name, current, error, follow_ups=follow_ups)
                return
            failure = error
        if failure is not None:
            await self._roll_back(req, name, started, failure)
        elif not committed:
            self._commit(req, name, new_state, None)

    async def _run_batch(
        self, req: Request[C], name: str, batch: Sequence[E], started: list[E]
    ) -> DracpuError | None:
        """The commit phase in one ``execute_batch`` call; its expected failure, if any."""
        if not batch or self._execute_batch is None:
            return None
        try:
            await self._execute_batch(batch, started)
        except DracpuError as exc:
            self._effects_failed += 1
            return exc
        except Exception as exc:
            self._effects_failed += 1
            what = _kind(started[-1]) if started else "the commit phase"
            self._fail(req, name, DracpuError(f"{name}: internal error in {what}: {exc!r}"))
            raise
        return None

    def _effects_scope(self) -> anyio.CancelScope:
        """Shielded from outside cancellation, bounded by the command deadline."""
        scope = anyio.CancelScope(shield=True)
        if math.isfinite(self._command_deadline):
            scope.deadline = anyio.current_time() + self._command_deadline
        return scope

    def _post_commit_failed(
        self, name: str, effect: E, error: DracpuError, *, follow_ups: bool
    ) -> None:
        logger.error("%s: post-commit effect %s failed: %s", name, _kind(effect), error)
        if self._follow_up is None:
            return
        command = self._follow_up(effect, error)
        if command is None:
            return
        if follow_ups:
            self._follow_ups.append(command)
        else:
            logger.error("%s: not applying %s (a follow-up of a follow-up)", name, command)

    async def _roll_back(
        self, req: Request[C], name: str, started: Sequence[E], failure: DracpuError
    ) -> None:
        """Keep the old state, run the rollback's undo effects, answer with the failure."""
        self._count_failed(name, failure)
        undo = self._rollback(self._state, started, failure) if self._rollback else ()
        answered = False
        try:
            with self._effects_scope() as scope:
                for effect in undo:
                    if isinstance(effect, Reply):
                        if not answered:
                            answered = True
                            _answer(req, effect.value)
                        continue
                    try:
                        await self._execute(effect)
                    except DracpuError as exc:
                        self._effects_failed += 1
                        logger.error("%s: rollback effect %s failed: %s", name, _kind(effect), exc)
            if scope.cancelled_caught:
                self._effects_failed += 1
                logger.error(
                    "%s: rollback did not finish within %g s", name, self._command_deadline
                )
        finally:
            if not answered:
                _answer(req, failure)

    def _commit(self, req: Request[C], name: str, new_state: S, value: object) -> None:
        self._state = new_state
        self._applied += 1
        outcome = "error" if isinstance(value, BaseException) else "ok"
        self._by_command[name, outcome] += 1
        logger.debug("%s applied (%s)", name, outcome, extra={"command": name})
        _answer(req, value)

    def _fail(self, req: Request[C], name: str, error: DracpuError) -> None:
        """Answer ``error`` and count the command as failed (the old state stays)."""
        self._count_failed(name, error)
        _answer(req, error)

    def _count_failed(self, name: str, error: DracpuError) -> None:
        self._failed += 1
        self._by_command[name, "failed"] += 1
        logger.warning("%s failed, state unchanged: %s", name, error, extra={"command": name})


def _before_reply(effects: Sequence[E]) -> Sequence[E]:
    """The commit phase: the effects before the first Reply (all of them without one)."""
    for index, effect in enumerate(effects):
        if isinstance(effect, Reply):
            return effects[:index]
    return effects


def _kind(effect: object) -> str:
    """An effect in a message: its type (its fields can be a whole checkpoint)."""
    return type(effect).__name__


def _answer(req: Request[C], value: object) -> None:
    # The requester may be gone (cancelled, closed its end): its answer is dropped, the owner
    # goes on. WouldBlock cannot happen for the first answer on a stream of buffer 1.
    try:
        req.reply.send_nowait(value)
    except (BrokenResourceError, ClosedResourceError, WouldBlock):
        logger.debug("the requester of %s is gone; answer dropped", type(req.command).__name__)
