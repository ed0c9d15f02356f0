"""The supervisor of ``dracpu run``: one task group, start order, readiness, graceful stop.

:func:`main` sets up logging and runs :func:`serve` on anyio's asyncio backend (grpclib only
runs there, design §3) with the daemon's tasks, in this order:

1. ``signals``: first, so that SIGTERM during a slow start already stops gracefully (a SIGHUP
   that arrives before the owner runs waits in the owner's queue);
2. ``state-owner``: the one task that changes node state;
3. ``http``: ``/healthz``, ``/readyz``, ``/metrics``;

and, as later issues add them (design §3), after the HTTP server and in this order:
``cdi-watcher`` (CDI drift repair), ``kubelet-plugin`` (DRA socket), ``registration``
(registration socket), ``nri-plugin``, ``podresources-sync`` and ``slice-publisher``. Those
tasks do not exist yet and nothing stands in for them: see :func:`_daemon_tasks`.

Each task is started with ``await tg.start(...)``; once it calls ``task_status.started()`` its
readiness flag turns ready, and ``/readyz`` answers 200 when all have. A task may later report
not ready through its :class:`~dracpu.tasks.http.ReadinessFlag`.

Stopping (SIGTERM/SIGINT, or a task failure): ``/readyz`` turns 503, then the tasks are
cancelled one by one in REVERSE start order, each awaited, so the request sources stop before
the state owner, which finishes the command in flight (bounded by its own deadline). The whole
stop is bounded by :data:`STOP_TIMEOUT`; a second signal cancels everything at once. Tasks
remove the sockets they created in their own ``finally``.

Failure policy (design §3): a task that raises after it started, or returns while no stop was
asked, is logged (one line; the traceback at debug level) and stops the daemon the same graceful
way; a task that raises before it started ends the start-up. Either way the exit code is 1, so
the DaemonSet restarts us; a requested stop exits 0. Cancellation is never swallowed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

import anyio
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu import __version__
from dracpu.config import Config
from dracpu.core.commands import Command, Resync
from dracpu.core.effects import Reply, Resynced
from dracpu.errors import DracpuError
from dracpu.logs import setup_logging
from dracpu.tasks import http, signals, state_owner
from dracpu.tasks.http import Readiness
from dracpu.tasks.state_owner import FollowUp, Request, Rollback, StateOwner

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "STOP_TIMEOUT",
    "Shutdown",
    "StateMachine",
    "TaskRun",
    "TaskSpec",
    "main",
    "serve",
    "skeleton_machine",
]

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1  # a task failed: the DaemonSet restarts the pod
EXIT_INTERRUPTED = 130  # Ctrl-C before the signal handlers were installed (128 + SIGINT)

# A stop must end within the 5 s the daemon promises (design §3, issue 2); 4.5 s for the tasks
# leaves half a second to close the event loop and exit. The kubelet waits 30 s by default
# (terminationGracePeriodSeconds) before it kills the container.
STOP_TIMEOUT = 4.5

S = TypeVar("S")
E = TypeVar("E")


class TaskRun(Protocol):
    """A supervised task: runs until cancelled, calls ``task_status.started()`` when ready."""

    def __call__(self, *, task_status: TaskStatus[Any]) -> Awaitable[object]: ...


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """A task for :func:`serve`: its name (logs, readiness, metrics) and how to run it."""

    name: str
    run: TaskRun


class Shutdown:
    """The stop request: the first :meth:`request` stops gracefully, the second at once.

    Create it inside the event loop (it holds an :class:`anyio.Event`).
    """

    def __init__(self) -> None:
        self._requested = anyio.Event()
        self._force: Callable[[], None] | None = None
        self.reason = ""
        self.failed = False

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def request(self, reason: str) -> None:
        """Ask the supervisor to stop (a signal name, or why a task failed)."""
        if not self._requested.is_set():
            self.reason = reason
            self._requested.set()
        elif self._force is not None:
            logger.warning("%s during the stop: stopping now", reason)
            self._force()

    def on_force(self, force: Callable[[], None] | None) -> None:
        """What a second request does (the supervisor cancels its stop sequence)."""
        self._force = force

    def fail(self, task: str, error: BaseException | None) -> None:
        """Task ``task`` failed (``None``: it returned while it should run): log it, stop
        gracefully (a failure during a stop does not hurry the stop)."""
        self.failed = True
        if error is None:
            logger.error("task %s stopped unexpectedly", task, extra={"task": task})
        else:
            logger.error("task %s failed: %s", task, _describe(error), extra={"task": task})
            logger.debug("task %s failed", task, exc_info=error, extra={"task": task})
        if not self._requested.is_set():
            self.request(f"task {task} failed")

    async def wait(self) -> None:
        await self._requested.wait()


def _describe(error: BaseException) -> str:
    if isinstance(error, DracpuError):
        return str(error)
    return f"{type(error).__name__}: {error}"


class _WatchedStatus:
    """Passes ``started()`` on and remembers that it was called."""

    def __init__(self, inner: TaskStatus[Any]) -> None:
        self._inner = inner
        self.started_called = False

    def started(self, value: object = None) -> None:
        self.started_called = True
        self._inner.started(value)


@dataclass(eq=False, slots=True)
class _Running:
    """A started task: its cancel scope and an event set when it has ended."""

    spec: TaskSpec
    scope: anyio.CancelScope
    done: anyio.Event


async def _supervise(
    spec: TaskSpec,
    scope: anyio.CancelScope,
    done: anyio.Event,
    shutdown: Shutdown,
    *,
    task_status: TaskStatus[Any] = TASK_STATUS_IGNORED,
) -> None:
    status = _WatchedStatus(task_status)
    try:
        with scope:
            await spec.run(task_status=status)
    except Exception as exc:
        if not status.started_called:
            raise  # a start-up failure: tg.start() raises it in serve()
        shutdown.fail(spec.name, exc)
        return
    finally:
        done.set()
    if not scope.cancelled_caught and not shutdown.requested:
        shutdown.fail(spec.name, None)


async def _cancel_on_request(shutdown: Shutdown, scope: anyio.CancelScope) -> None:
    await shutdown.wait()
    scope.cancel()


async def serve(
    tasks: Sequence[TaskSpec],
    *,
    readiness: Readiness,
    shutdown: Shutdown,
    stop_timeout: float = STOP_TIMEOUT,
) -> int:
    """Start ``tasks`` in order, run until ``shutdown`` is requested, stop them in reverse.

    Returns :data:`EXIT_OK` after a requested stop, :data:`EXIT_FAILURE` when a task failed
    (logged). Cancelling the caller cancels every task, and the cancellation propagates.
    """
    running: list[_Running] = []
    for spec in tasks:
        readiness.flag(spec.name)  # all flags exist (not ready) before the first start
    try:
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as startup:
                tg.start_soon(_cancel_on_request, shutdown, startup)
                for spec in tasks:
                    task = _Running(spec, anyio.CancelScope(), anyio.Event())
                    await tg.start(
                        _supervise, spec, task.scope, task.done, shutdown, name=spec.name
                    )
                    running.append(task)
                    readiness.flag(spec.name).set_ready()
                logger.info("dracpu %s is running (%d tasks)", __version__, len(running))
            await shutdown.wait()
            logger.info("stopping (%s)", shutdown.reason)
            readiness.set_stopping()
            await _stop(running, shutdown, stop_timeout)
            tg.cancel_scope.cancel()
    except ExceptionGroup as group:
        # Only a start-up failure (or a bug of the supervisor) gets here: _supervise catches
        # what a task raises after it started.
        culprit = tasks[len(running)].name if len(running) < len(tasks) else "supervisor"
        for error in _leaves(group):
            shutdown.fail(culprit, error)
        return EXIT_FAILURE
    if shutdown.failed:
        return EXIT_FAILURE
    logger.info("stopped")
    return EXIT_OK


async def _stop(running: Sequence[_Running], shutdown: Shutdown, stop_timeout: float) -> None:
    with anyio.move_on_after(stop_timeout) as scope:
        shutdown.on_force(scope.cancel)
        for task in reversed(running):
            task.scope.cancel()
            await task.done.wait()
            logger.debug("task %s stopped", task.spec.name)
    shutdown.on_force(None)
    left = [task.spec.name for task in running if not task.done.is_set()]
    if left:
        logger.warning("cancelling tasks that had not stopped yet: %s", ", ".join(left))


def _leaves(group: BaseExceptionGroup[Exception]) -> list[Exception]:
    leaves: list[Exception] = []
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            leaves.extend(_leaves(error))
        else:
            leaves.append(error)
    return leaves


# --- the daemon's tasks -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StateMachine(Generic[S, E]):
    """What the state owner runs: an initial state, the pure ``apply``, the effect executor and
    the rollback / follow-up hooks (see :mod:`dracpu.tasks.state_owner`)."""

    state: S
    apply: Callable[[S, Command], tuple[S, Sequence[E]]]
    execute: Callable[[E], Awaitable[object]]
    rollback: Rollback[S, E] | None = None
    follow_up: FollowUp[E, Command] | None = None


MachineFactory = Callable[[Config], StateMachine[Any, Any]]


def skeleton_machine(config: Config) -> StateMachine[None, Reply]:
    """The state machine of the daemon skeleton, until the node state is wired in.

    It holds no claims and refuses every command with an error, except Resync, which it
    answers truthfully: no CDI spec to rewrite, no config change. The issue that restores the
    checkpoint replaces it with ``dracpu.core.state`` (``NodeState``, ``apply``, ``rollback``)
    and the effect executor.
    """

    def apply(state: None, command: Command) -> tuple[None, Sequence[Reply]]:
        if isinstance(command, Resync):
            return state, [Reply(Resynced(claims=0, config_changed=False))]
        name = type(command).__name__
        return state, [Reply(DracpuError(f"{name}: the node state is not wired in yet"))]

    async def execute(effect: Reply) -> None:
        raise DracpuError(f"no executor for {effect}")  # apply above returns only Replies

    return StateMachine(state=None, apply=apply, execute=execute)


def _daemon_tasks(
    config: Config,
    owner: StateOwner[Any, Command, Any],
    send: MemoryObjectSendStream[Request[Command]],
    readiness: Readiness,
    shutdown: Shutdown,
) -> list[TaskSpec]:
    """The daemon's tasks in start order. A task that sends commands takes its own clone of
    ``send`` when it starts (so a task that never starts leaves no stream open)."""

    async def run_signals(*, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        await signals.run(send.clone(), shutdown.request, task_status=task_status)

    registry = http.build_registry(readiness, owner.statistics)
    return [
        TaskSpec("signals", run_signals),
        TaskSpec("state-owner", owner.run),
        TaskSpec("http", partial(http.run, config.bind_address, readiness, registry)),
        # Later issues add their tasks here, in this order (design §3), each taking its own
        # clone of `send`: cdi-watcher, kubelet-plugin (DRA socket), registration, nri-plugin,
        # podresources-sync, slice-publisher.
    ]


async def _serve(config: Config, factory: MachineFactory) -> int:
    readiness = Readiness()
    shutdown = Shutdown()
    machine = factory(config)
    send: MemoryObjectSendStream[Request[Command]]
    receive: MemoryObjectReceiveStream[Request[Command]]
    send, receive = state_owner.create_request_stream()
    with send, receive:  # the owner closes `receive` itself; this covers a failed start
        owner: StateOwner[Any, Command, Any] = StateOwner(
            receive,
            machine.state,
            machine.apply,
            machine.execute,
            rollback=machine.rollback,
            follow_up=machine.follow_up,
        )
        tasks = _daemon_tasks(config, owner, send, readiness, shutdown)
        return await serve(tasks, readiness=readiness, shutdown=shutdown)


def main(config: Config, *, machine: MachineFactory = skeleton_machine) -> int:
    """Run the daemon until SIGTERM/SIGINT (exit 0) or a task failure (exit 1)."""
    setup_logging(config.log_format, config.verbosity)
    logger.info(
        "dracpu %s starting on node %s (%s devices, group by %s, reserved cpus %s)",
        __version__,
        config.node_name,
        config.cpu_device_mode,
        config.group_by,
        config.reserved_cpus or "none",
    )
    try:
        return anyio.run(_serve, config, machine, backend="asyncio")
    except KeyboardInterrupt:
        logger.warning("interrupted before the signal handlers were installed")
        return EXIT_INTERRUPTED
    except Exception as exc:  # a failure while wiring the tasks, before serve() runs
        logger.error("dracpu failed to start: %s", _describe(exc))
        logger.debug("start-up failure", exc_info=exc)
        return EXIT_FAILURE
