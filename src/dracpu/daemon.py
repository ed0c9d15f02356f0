"""The supervisor of ``dracpu run``: one task group, start order, readiness, graceful stop.

:func:`main` sets up logging, takes the state dir's owner lock (while another dracpu holds it,
the process waits as a Ready standby for its hand-over: :mod:`dracpu.tasks.handover`) and runs
:func:`serve` on anyio's asyncio backend with the daemon's
tasks (:meth:`_Node.tasks`, in start order: signals, state owner, HTTP, debug dump, CDI watcher,
device health, DRA socket, registration, NRI plugin, pod-resources sync, slice publisher). Each
task reports ready through ``task_status.started()``; the readiness flags that are no task's
(``kubelet-registration``, ``dra-socket``, ``cdi-dir``, ``state-dir``, ``slices``,
``host-cgroups``) are
made here and handed to their owners. A stop cancels the tasks in reverse start order (a task
after those it :attr:`TaskSpec.outlives`), within :data:`STOP_TIMEOUT` (lengthened by a
hand-over to a waiting successor); a second signal cancels at once. A task that fails ends the
daemon with exit code 1, a requested stop with 0. The story is ``docs/architecture.md``
("Tasks and start order", "Rolling update").
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import anyio
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from prometheus_client import CollectorRegistry

from dracpu import __version__
from dracpu.adapters.backoff import RetryLog, backoff_delays
from dracpu.adapters.kube import KubeClient, kubelet_version, open_kube_client
from dracpu.adapters.pod_resources import PodResourcesClient
from dracpu.config import Config
from dracpu.core.commands import Command
from dracpu.core.devices import CpuDeviceMode
from dracpu.core.slices import SliceOptions
from dracpu.core.state_values import NodeState
from dracpu.errors import DracpuError, leaf_errors
from dracpu.logs import setup_logging
from dracpu.tasks import (
    cdi_watcher,
    debug_dump,
    device_health,
    http,
    kubelet_plugin,
    metrics,
    nri_plugin,
    podresources_sync,
    registration,
    signals,
    slice_publisher,
    state_owner,
)
from dracpu.tasks.dra_cpu_metrics import DraCpuMetrics
from dracpu.tasks.handover import HandOver
from dracpu.tasks.http import Readiness
from dracpu.tasks.nri_link import NriLink
from dracpu.tasks.reload import ConfigSource, Reloader
from dracpu.tasks.state_owner import Request, StateOwner

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "CDI_DIR",
    "DRA_SOCKET",
    "SLICES",
    "HOST_CGROUPS",
    "KUBELET_REGISTRATION",
    "STATE_DIR",
    "STOP_TIMEOUT",
    "Shutdown",
    "TaskRun",
    "TaskSpec",
    "main",
    "serve",
]

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1  # a task failed: the DaemonSet restarts the pod
EXIT_INTERRUPTED = 130  # Ctrl-C before the signal handlers were installed (128 + SIGINT)

# A stop must end within the 5 s the daemon promises; 4.5 s for the tasks
# leaves half a second to close the event loop and exit. The kubelet waits 30 s by default
# (terminationGracePeriodSeconds) before it kills the container.
STOP_TIMEOUT = 4.5
# At a stop with a successor waiting: the longest wait, NRI still connected, for it to restore
# the state and be configured by the runtime (tasks/handover.py). It lengthens the stop by as
# much: within the kubelet's default grace of 30 s.
HANDOVER_TIMEOUT = 20.0
# The pod's UID, which the DaemonSet sets from the downward API (metadata.uid): a hand-over
# tells the successor which pod leaves (tasks/handover.py).
POD_UID_ENV = "POD_UID"
# How often a standby looks whether a dracpu without the state dir lock still serves the DRA
# socket (a connection each time, which grpclib accepts and drops).
LEGACY_POLL = 0.05

# The readiness flag that follows the kubelet's registration verdict (not a task's flag).
KUBELET_REGISTRATION = "kubelet-registration"
# The readiness flag that says whether CDI specs can be written (the state owner's verdict).
CDI_DIR = "cdi-dir"
# The readiness flag that says whether the node's ResourceSlices are published (the slice
# publisher's verdict).
SLICES = "slices"
# The readiness flag that says whether the checkpoint can be written (the state owner's verdict).
STATE_DIR = "state-dir"
# The readiness flag that says whether the DRA socket serves (its directory may not be writable).
DRA_SOCKET = "dra-socket"
# The retries of a kubelet socket whose directory cannot be written: as those of the CDI and
# state dirs (tasks/state_owner).
SOCKET_RETRY_INITIAL = 0.25
SOCKET_RETRY_CAP = 2.0
# How often the reason registration waits for the runtime is refreshed on /readyz.
SYNC_WAIT_POLL = 1.0
# The readiness flag that says whether every listed host cgroup is confined (the state owner's
# verdict; there only once a host cgroup was listed).
HOST_CGROUPS = "host-cgroups"


class TaskRun(Protocol):
    """A supervised task: runs until cancelled, calls ``task_status.started()`` when ready."""

    def __call__(self, *, task_status: TaskStatus[Any]) -> Awaitable[object]: ...


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """A task for :func:`serve`: its name (logs, readiness, metrics) and how to run it.

    ``outlives``: names of tasks started before this one that must stop before it does (it is
    stopped right after the last of them instead of in reverse start order)."""

    name: str
    run: TaskRun
    outlives: tuple[str, ...] = ()


class Shutdown:
    """The stop request: the first :meth:`request` stops gracefully, the second at once.

    Create it inside the event loop (it holds an :class:`anyio.Event`).
    """

    def __init__(self) -> None:
        self._requested = anyio.Event()
        self._force: Callable[[], None] | None = None
        self._extend: Callable[[float], None] | None = None
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

    def on_extend(self, extend: Callable[[float], None] | None) -> None:
        """How a task lengthens the stop in progress (the supervisor moves its deadline)."""
        self._extend = extend

    def extend(self, seconds: float) -> None:
        """Give the stop in progress ``seconds`` more (a hand-over waiting for the next
        dracpu); nothing outside a stop."""
        if self._extend is not None:
            self._extend(seconds)

    def fail(self, task: str, error: BaseException | None) -> None:
        """Task ``task`` failed (``None``: it returned while it should run): log it, stop
        gracefully (a failure during a stop does not hurry the stop)."""
        self.failed = True
        if error is None:
            logger.error("task %s stopped unexpectedly", task, extra={"task": task})
        else:
            logger.error("task %s failed: %s", task, _describe(error), extra={"task": task})
            if _a_bug(error):
                logger.debug("task %s failed", task, exc_info=error, extra={"task": task})
        if not self._requested.is_set():
            self.request(f"task {task} failed")

    async def wait(self) -> None:
        await self._requested.wait()


def _a_bug(error: BaseException) -> bool:
    """Whether ``error`` holds an exception that is not a :class:`DracpuError`: only then is
    its traceback worth logging (at DEBUG). A DracpuError is an expected condition whose one
    line names the file, value or peer at fault; its traceback would only follow that line
    with dozens of lines of our call stack at every ``--v=4`` start (upstream's chart runs
    ``--v=4``)."""
    if isinstance(error, BaseExceptionGroup):
        return any(_a_bug(inner) for inner in error.exceptions)
    return not isinstance(error, DracpuError)


def _describe(error: BaseException) -> str:
    if isinstance(error, BaseExceptionGroup):
        # A task's own task group wraps what its children raised: name those, not the group.
        return "; ".join(_describe(inner) for inner in error.exceptions)
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
    on_running: Callable[[], None] | None = None,
) -> int:
    """Start ``tasks`` in order, run until ``shutdown`` is requested, stop them in reverse.

    Returns :data:`EXIT_OK` after a requested stop, :data:`EXIT_FAILURE` when a task failed
    (logged). Cancelling the caller cancels every task, and the cancellation propagates.
    ``on_running`` is called once, when every task has started.
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
                readiness.set_started()
                if on_running is not None:
                    on_running()
            await shutdown.wait()
            logger.info("stopping (%s)", shutdown.reason)
            readiness.set_stopping()
            await _stop(running, shutdown, stop_timeout)
            tg.cancel_scope.cancel()
    except ExceptionGroup as group:
        # Only a start-up failure (or a bug of the supervisor) gets here: _supervise catches
        # what a task raises after it started.
        culprit = tasks[len(running)].name if len(running) < len(tasks) else "supervisor"
        for error in leaf_errors(group):
            shutdown.fail(culprit, error)
        return EXIT_FAILURE
    if shutdown.failed:
        return EXIT_FAILURE
    logger.info("stopped")
    return EXIT_OK


def _stop_order(running: Sequence[_Running]) -> list[_Running]:
    """Reverse start order, but each task after the tasks it outlives."""
    order = list(reversed(running))
    for task in [t for t in order if t.spec.outlives]:
        last = max(
            (i for i, t in enumerate(order) if t.spec.name in task.spec.outlives), default=-1
        )
        if last > order.index(task):
            order.remove(task)
            order.insert(last, task)  # right after the last task it outlives
    return order


async def _stop(running: Sequence[_Running], shutdown: Shutdown, stop_timeout: float) -> None:
    with anyio.move_on_after(stop_timeout) as scope:
        shutdown.on_force(scope.cancel)
        shutdown.on_extend(lambda seconds: setattr(scope, "deadline", scope.deadline + seconds))
        for task in _stop_order(running):
            task.scope.cancel()
            await task.done.wait()
            logger.debug("task %s stopped", task.spec.name)
    shutdown.on_force(None)
    shutdown.on_extend(None)
    left = [task.spec.name for task in running if not task.done.is_set()]
    if left:
        logger.warning("cancelling tasks that had not stopped yet: %s", ", ".join(left))


# --- the daemon's tasks -------------------------------------------------------------------------


async def _start_waiting_out(
    run: Callable[..., Coroutine[Any, Any, object]],
    what: str,
    not_ready: Callable[[str], None],
    started: Callable[[], None],
) -> None:
    """Run ``run`` (a task serving a socket), starting it again while its start fails with a
    :class:`DracpuError` (a kubelet dir that cannot be written: read-only, full, a file in the
    way): each change of the reason logged once, ``not_ready`` told the reason, retried every
    0.25-2 s; ``started`` once it serves. A failure after it started ends the daemon as
    before."""
    retry = RetryLog(logger, what)
    delays = backoff_delays(initial=SOCKET_RETRY_INITIAL, cap=SOCKET_RETRY_CAP)
    async with anyio.create_task_group() as tg:
        while True:
            try:
                await tg.start(run)
            except DracpuError as exc:
                delay = next(delays)
                retry.failed(exc, retry_in=delay)
                not_ready(str(exc))
                await anyio.sleep(delay)
                continue
            break
        retry.recovered()
        started()


# --- the real node ------------------------------------------------------------------------------


class _Node:
    """Everything the node's tasks share: config, streams, the state owner, the NRI link, the
    republish channel, the Kubernetes client. :meth:`tasks` lists them in start order."""

    def __init__(
        self,
        config: Config,
        kube: KubeClient,
        send: MemoryObjectSendStream[Request[Command]],
        receive: MemoryObjectReceiveStream[Request[Command]],
        readiness: Readiness,
        shutdown: Shutdown,
        handover: HandOver,
        source: ConfigSource | None = None,
    ) -> None:
        self.config = config
        self.handover = handover
        self.source = source
        self.kube = kube
        self.send = send
        self.readiness = readiness
        self.shutdown = shutdown
        self.link = NriLink()
        self.republish_send, self.republish_receive = slice_publisher.republish_channel()
        self.owner = StateOwner(
            config,
            receive,
            republish=self.republish_send,
            container_updates=self.link.submit,
            state_dir=readiness.flag(STATE_DIR, reason="the checkpoint has not been written yet"),
            cdi_dir=readiness.flag(CDI_DIR, reason="the CDI dir has not been tried yet"),
            host_cgroups=partial(readiness.flag, HOST_CGROUPS),
        )
        self.metrics = DraCpuMetrics(self.node_state)
        self.dra_serving = anyio.Event()  # the DRA socket serves: registration may begin
        self.list_trigger = podresources_sync.ListTrigger()
        self.podresources = podresources_sync.PodResourcesStatus()

    def node_state(self) -> NodeState | None:
        """The state owner's committed state, ``None`` until the owner has restored the node."""
        try:
            return self.owner.state
        except DracpuError:
            return None

    def close(self) -> None:
        self.republish_send.close()
        self.republish_receive.close()

    async def run_signals(self, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        reloader = Reloader(self.config, self.source)
        await signals.run(
            self.send.clone(),
            self.shutdown.request,
            reloader=reloader,
            on_sighup=(self.list_trigger.request,),
            task_status=task_status,
        )

    async def run_cdi_watcher(self, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        config = self.config
        async with self.send.clone() as send:
            await cdi_watcher.run(
                config.cdi_dir,
                config.device_metadata_dir,
                lambda: self.owner.state,
                partial(state_owner.request, send),
                task_status=task_status,
            )

    def runtime_not_ready(self) -> str:
        """Why the runtime cannot pin a new claim's containers now (``""``: it can)."""
        if self.link.status().synchronized:
            return ""
        return self.link.status().last_error or "no runtime has connected yet"

    async def run_kubelet_plugin(
        self, *, task_status: TaskStatus[Any] = TASK_STATUS_IGNORED
    ) -> None:
        config = self.config
        grouped = config.cpu_device_mode is CpuDeviceMode.GROUPED

        async def serve(*, task_status: TaskStatus[Any]) -> None:
            # A stream of its own each attempt: a start that failed closed the one it had.
            await kubelet_plugin.run(
                config.dra_socket,
                self.send.clone(),
                self.kube,
                config.node_name,
                metrics=self.metrics,
                health=self.owner.health,
                allocator=config.allocator if grouped else None,
                runtime_not_ready=self.runtime_not_ready,
                task_status=task_status,
            )

        flag = self.readiness.flag(DRA_SOCKET, reason="the DRA socket has not been made yet")

        def serving() -> None:
            flag.set_ready()
            self.dra_serving.set()

        task_status.started()
        await _start_waiting_out(serve, "the DRA socket", flag.set_not_ready, serving)

    async def run_debug_dump(self, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        path = self.config.state_dir / debug_dump.DUMP_FILE
        await debug_dump.run(
            self.node_state, path, host_cgroups=self.owner.host_cgroups, task_status=task_status
        )

    async def run_device_health(
        self, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED
    ) -> None:
        await device_health.watch_online(
            self.config.host_root, self.owner.health, task_status=task_status
        )

    async def run_registration(self, *, task_status: TaskStatus[Any] = TASK_STATUS_IGNORED) -> None:
        verdict = self.readiness.flag(
            KUBELET_REGISTRATION, reason="waiting for the DRA socket to serve"
        )
        task_status.started()
        await self.dra_serving.wait()
        await self._wait_synchronized(verdict.set_not_ready)
        verdict.set_not_ready("the kubelet has not registered the plugin yet")
        config = self.config
        serve = partial(registration.run, config.registration_socket, config.dra_socket, verdict)
        await _start_waiting_out(
            serve, "the registration socket", verdict.set_not_ready, lambda: None
        )

    async def _wait_synchronized(self, not_ready: Callable[[str], None]) -> None:
        """Until a runtime has answered NRI ``Synchronize`` once, ``not_ready`` told why we
        wait (refreshed every second: the NRI task's last error)."""
        logged = False
        while not self.link.synchronized_once:
            reason = self.link.status().last_error or "connecting"
            not_ready(
                "waiting for the container runtime's first NRI Synchronize before registering "
                f"with the kubelet ({reason})"
            )
            if not logged:
                logger.info(
                    "registration with the kubelet waits for the container runtime's first NRI "
                    "Synchronize on %s",
                    self.config.nri_socket,
                )
                logged = True
            with anyio.move_on_after(SYNC_WAIT_POLL):
                await self.link.wait_synchronized_once()

    async def run_nri_plugin(self, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        await nri_plugin.run(
            self.config,
            self.send.clone(),
            lambda: self.owner.state,
            link=self.link,
            claims=self.kube,
            on_configured=self.handover.configured,
            hand_over=self.hand_over,
            leaving_pod=self.handover.predecessor_pod,
            task_status=task_status,
        )

    async def hand_over(self) -> bool:
        """At a stop, NRI still connected: give the state dir to the dracpu waiting for it, if
        one is (:mod:`dracpu.tasks.handover`), and wait until it pins the containers."""
        if not self.handover.successor_waiting():
            return False
        self.shutdown.extend(HANDOVER_TIMEOUT)
        await self.owner.stop_writing()
        self.handover.release(os.environ.get(POD_UID_ENV))
        logger.info(
            "handing the state dir over; NRI stays connected until the next dracpu is configured"
        )
        if await self.handover.wait_successor(HANDOVER_TIMEOUT):
            logger.info("the next dracpu is configured by the runtime: disconnecting from NRI")
            return True
        logger.warning(
            "the next dracpu was not configured by the runtime within %g s: disconnecting",
            HANDOVER_TIMEOUT,
        )
        return False

    async def run_podresources_sync(
        self, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED
    ) -> None:
        config = self.config

        async def read_kubelet_version() -> str:
            return kubelet_version(await self.kube.get_node(config.node_name))

        with PodResourcesClient(config.pod_resources_socket) as client:
            await podresources_sync.run(
                self.send.clone(),
                client.list,
                interval=config.podresources_interval,
                grace=config.orphan_grace,
                trigger=self.list_trigger,
                status=self.podresources,
                kubelet_version=read_kubelet_version,
                task_status=task_status,
            )

    async def run_slice_publisher(
        self, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED
    ) -> None:
        options = SliceOptions(
            node_allocatable=self.config.publish_node_allocatable_resource_mapping,
            expose_pcie_roots=self.config.expose_pcie_roots,
        )
        # The state owner's restore asked for the first publication before this task starts:
        # the request waits in the channel.
        async with self.republish_receive.clone() as requests:
            await slice_publisher.run(
                self.kube,
                self.config.node_name,
                requests,
                options=options,
                health=self.readiness.flag(SLICES, reason="no ResourceSlice is published yet"),
                task_status=task_status,
            )

    def tasks(self) -> list[TaskSpec]:
        registry = metrics.build_registry(
            self.readiness,
            self.owner.statistics,
            self.link.status,
            self.podresources,
            self.owner.host_cgroups,
        )
        registry.register(self.metrics)
        return [
            TaskSpec("signals", self.run_signals),
            TaskSpec("state-owner", self.owner.run),
            TaskSpec("http", partial(http.run, self.config.bind_address, self.readiness, registry)),
            TaskSpec("debug-dump", self.run_debug_dump),
            TaskSpec("cdi-watcher", self.run_cdi_watcher),
            TaskSpec("device-health", self.run_device_health),
            TaskSpec("kubelet-plugin", self.run_kubelet_plugin),
            TaskSpec("registration", self.run_registration),
            # Stopped after the sockets that answer Unprepare (their widenings reach the
            # runtime) and after the CDI watcher: at a hand-over the state dir then has no
            # writer left but the owner, which stops writing before it is handed over.
            TaskSpec(
                "nri-plugin",
                self.run_nri_plugin,
                outlives=("kubelet-plugin", "registration", "cdi-watcher"),
            ),
            TaskSpec("podresources-sync", self.run_podresources_sync),
            TaskSpec("slice-publisher", self.run_slice_publisher),
        ]


async def _serve_node(config: Config, source: ConfigSource | None) -> int:
    readiness = Readiness()
    shutdown = Shutdown()
    send: MemoryObjectSendStream[Request[Command]]
    receive: MemoryObjectReceiveStream[Request[Command]]
    send, receive = state_owner.create_request_stream()
    handover = HandOver(config.state_dir)
    try:
        await _own_state_dir(config, handover)
        with send, receive:  # the owner closes `receive` itself; this covers a failed start
            async with open_kube_client(config.kubeconfig) as kube:
                node = _Node(config, kube, send, receive, readiness, shutdown, handover, source)
                try:
                    return await serve(
                        node.tasks(),
                        readiness=readiness,
                        shutdown=shutdown,
                        on_running=_settle_heap,
                    )
                finally:
                    node.close()
    finally:
        handover.close()


async def _own_state_dir(config: Config, handover: HandOver) -> None:
    """Own the state dir before anything reads it. While another dracpu owns it (a rolling
    update's new pod beside the old one), wait as its successor: Ready, serving ``/healthz``
    and ``/readyz`` (a ``standby`` flag), touching nothing else, until it hands over or exits.
    A SIGTERM meanwhile ends the process at once (no handler is installed yet)."""
    with contextlib.suppress(OSError):  # a dir that cannot be made is the state owner's to report
        config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    wait: Callable[[], Awaitable[None]]
    if handover.try_own():
        if not await _serves(config.dra_socket):
            return
        # A build without the lock serves the node (the first update to this one): wait until
        # it stops, as its successor would (without its hand-over).
        holder = f"a dracpu without the state dir lock, serving {config.dra_socket}"
        wait = partial(_until_quiet, config.dra_socket)
    else:
        await handover.become_successor()
        holder, wait = handover.holder(), handover.wait_own
    logger.info(
        "the state dir %s is owned by %s: waiting for its hand-over as a standby",
        config.state_dir,
        holder,
    )
    standby = Readiness()
    standby.flag("standby").set_ready()
    standby.set_started()
    async with anyio.create_task_group() as tg:
        try:
            await tg.start(http.run, config.bind_address, standby, CollectorRegistry())
        except DracpuError as exc:
            # The probes reach whoever holds the port (on the host's network: the running
            # dracpu, if it predates SO_REUSEPORT); the wait does not depend on them.
            logger.warning("standby without /healthz and /readyz: %s", exc)
        await wait()
        tg.cancel_scope.cancel()


async def _serves(socket: Path) -> bool:
    """Does a process accept connections on ``socket`` (a stale file refuses them)?"""
    try:
        stream = await anyio.connect_unix(socket)
    except OSError:
        return False
    await stream.aclose()
    return True


async def _until_quiet(socket: Path) -> None:
    while True:
        if not await _serves(socket):
            return
        await anyio.sleep(LEGACY_POLL)


def _settle_heap() -> None:
    """Every task runs: the objects that exist now (modules, classes, the restored state, the
    clients) live as long as the process. Move them out of the collector's generations
    (``gc.freeze``), so that no later full collection walks them (a pause in a Prepare
    otherwise), and turn the collector back on (:func:`main` turned it off for the
    start-up, which allocates for good: collections there find next to nothing)."""
    gc.freeze()
    gc.enable()


def main(config: Config, source: ConfigSource | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT (exit 0) or a task failure (exit 1); ``source``:
    where a SIGHUP reads the settings again (``None``: it reads only the topology)."""
    collecting = gc.isenabled()
    gc.disable()  # until every task runs: _settle_heap
    try:
        return _main(config, source)
    finally:
        # The interpreter's collections at exit would walk the whole heap again: a slow part of the
        # stop after SIGTERM. Frozen objects are left to the OS with the process.
        gc.freeze()
        if collecting:
            gc.enable()
        else:
            gc.disable()


def _main(config: Config, source: ConfigSource | None) -> int:
    setup_logging(config.log_format, config.verbosity, vmodule=config.vmodule)
    logger.info(
        "dracpu %s starting on node %s (node name from %s; %s devices, group by %s, "
        "reserved cpus %s)",
        __version__,
        config.node_name,
        config.node_name_source or "the caller",
        config.cpu_device_mode,
        config.group_by,
        config.reserved_cpus or "none",
    )
    try:
        return anyio.run(_serve_node, config, source, backend="asyncio")
    except KeyboardInterrupt:
        logger.warning("interrupted before the signal handlers were installed")
        return EXIT_INTERRUPTED
    except Exception as exc:  # a failure while wiring the tasks, before serve() runs
        logger.error("dracpu failed to start: %s", _describe(exc))
        if _a_bug(exc):
            logger.debug("start-up failure", exc_info=exc)
        return EXIT_FAILURE
