"""The NRI plugin task: pins every container of the node through the runtime's NRI socket.

One connection at a time to ``--nri-socket`` (containerd or CRI-O), served by
:class:`~dracpu.tasks.nri_connection.NriConnection` (registration, ``Configure``,
``Synchronize``, the container events, the unsolicited updates). The task is that connection
plus the :class:`~dracpu.tasks.nri_link.NriLink` the state owner hands its unsolicited updates
to: the pins themselves live in the node state.

Failure policy: a lost connection (EOF, socket error, protocol violation, garbage, an oversized
frame, a refused registration, a handshake that does not finish) sends
:class:`~dracpu.core.commands.RuntimeDisconnected` to the owner and reconnects with capped
exponential backoff; every connection registers and synchronizes again (a reconnect's
``Synchronize`` re-pins every container). A malformed message is answered with
INVALID_ARGUMENT and never ends the task. Bugs (non-DracpuError exceptions) do.

Stop: when the task is cancelled (SIGTERM), the connection stays up until the link has
settled (:meth:`NriLink.settled <dracpu.tasks.nri_link.NriLink.settled>`: the queued unsolicited
updates sent and answered, the ``UpdateContainers`` on its way answered, the events being
handled answered), for at most :data:`STOP_DRAIN_TIMEOUT`; only then is it closed. Closing it
earlier would lose them: the runtime cancels the requests of a connection that closes (ttrpc
cancels their context), so an Unprepare answered just before the SIGTERM would leave the shared
containers narrow until the next start. The daemon stops this task after the DRA socket, so
every Unprepare it answered has its update queued by then.

Readiness: :func:`run` calls ``task_status.started()`` after the first ``Synchronize`` was
answered, or after ``start_timeout`` (10 s) without one: an absent runtime must not keep the
daemon from starting. :meth:`NriLink.status <dracpu.tasks.nri_link.NriLink.status>` tells
``/readyz`` and ``/metrics`` whether a runtime is connected and synchronized.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path

import anyio
import anyio.abc
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus

from dracpu.adapters.backoff import backoff_delays
from dracpu.config import Config
from dracpu.core.commands import RuntimeDisconnected
from dracpu.errors import DracpuError
from dracpu.tasks.claim_recheck import ClaimReader, ClaimRecheck
from dracpu.tasks.nri_connection import NriConnection, OwnerSend
from dracpu.tasks.nri_link import CommittedState, NriLink
from dracpu.tasks.state_owner import request

__all__ = [
    "START_TIMEOUT",
    "STOP_DRAIN_TIMEOUT",
    "Connect",
    "connect_unix",
    "reconnect_delays",
    "run",
]

logger = logging.getLogger(__name__)

# Readiness without a runtime: two registration timeouts (the runtime serves one plugin
# handshake at a time, each bounded by nri pkg/api/timeouts.go DefaultPluginRegistrationTimeout).
START_TIMEOUT = 10.0
# Reconnect backoff: containers created while we are away run unpinned until we are back, so
# the first retries are fast; the cap keeps a runtime that is down from being hammered.
RECONNECT_INITIAL = 0.1
RECONNECT_CAP = 5.0
# At a stop, the longest wait for queued and in-flight updates and answers: one event's worth of
# the runtime's lock (an UpdateContainers waits for it, nri DefaultPluginRequestTimeout 2 s),
# within the daemon's 5 s stop.
STOP_DRAIN_TIMEOUT = 2.0

Connect = Callable[[Path], Awaitable[anyio.abc.ByteStream]]
"""Opens the NRI socket (tests pass their own)."""


async def connect_unix(path: Path) -> anyio.abc.ByteStream:
    """Connect to the runtime's NRI unix socket."""
    return await anyio.connect_unix(path)


def reconnect_delays() -> Iterator[float]:
    """The delays between connection attempts (restarted after every synchronized connection)."""
    return backoff_delays(initial=RECONNECT_INITIAL, cap=RECONNECT_CAP)


# --- the task -------------------------------------------------------------------------------------


async def _tell_disconnected(owner: OwnerSend) -> None:
    try:
        await request(owner, RuntimeDisconnected())
    except DracpuError as exc:
        logger.error("NRI: could not tell the state owner the runtime is gone: %s", exc)


async def _connections(
    config: Config,
    owner: OwnerSend,
    link: NriLink,
    connect: Connect,
    delays_factory: Callable[[], Iterator[float]],
    first_sync: anyio.Event,
    recheck: ClaimRecheck,
    handing_over: anyio.Event,
    on_configured: Callable[[], None] | None,
    leaving_pod: str | None,
) -> None:
    """Connect, serve, reconnect: until a connection ends during the hand-over."""
    delays = delays_factory()
    socket = config.nri_socket
    failures = 0

    def synchronized() -> None:
        link.mark_synchronized()
        first_sync.set()

    while True:
        try:
            stream = await connect(socket)
        except OSError as exc:
            failures += 1
            link.connect_failed(f"cannot connect to {socket}: {exc}")
            log = logger.warning if failures == 1 else logger.debug
            log("NRI: cannot connect to %s (attempt %d): %s; retrying", socket, failures, exc)
            await anyio.sleep(next(delays))
            continue
        connection = NriConnection(
            stream,
            config,
            owner,
            link,
            synchronized,
            recheck,
            on_configured=on_configured,
            leaving_pod=leaving_pod,
        )
        reason = "connection ended"
        try:
            async with stream:
                reason = await connection.serve()
        finally:
            link.stop(reason)
        if connection.synchronized:
            delays = delays_factory()
            failures = 0
        if handing_over.is_set():
            # The state dir is the next dracpu's, which pins the containers now.
            logger.info("NRI: connection to %s ended during the hand-over: %s", socket, reason)
            return
        logger.warning("NRI: connection to %s ended: %s; reconnecting", socket, reason)
        await _tell_disconnected(owner)
        await anyio.sleep(next(delays))


async def run(
    config: Config,
    owner_send: OwnerSend,
    committed: CommittedState,
    *,
    link: NriLink | None = None,
    claims: ClaimReader | None = None,
    connect: Connect = connect_unix,
    delays: Callable[[], Iterator[float]] = reconnect_delays,
    start_timeout: float = START_TIMEOUT,
    drain_timeout: float = STOP_DRAIN_TIMEOUT,
    on_configured: Callable[[], None] | None = None,
    hand_over: Callable[[], Awaitable[bool]] | None = None,
    leaving_pod: str | None = None,
    task_status: TaskStatus[None] = TASK_STATUS_IGNORED,
) -> None:
    """Be the node's NRI plugin until cancelled (see the module docstring).

    ``owner_send``: this task's own clone of the state owner's command stream (closed when the
    task ends); ``committed`` reads the owner's committed state (``lambda: owner.state``).
    ``link``: the object whose :meth:`NriLink.submit` the owner's executor calls for
    ``UpdateContainers`` effects (a private one if ``None``: unsolicited updates are then
    dropped). ``claims``: the Kubernetes API, read once more before a container is refused for a
    claim not reserved for its pod (:mod:`dracpu.tasks.claim_recheck`; ``None``: never).
    ``connect`` opens ``config.nri_socket``; ``delays`` makes the reconnect backoff.
    ``task_status.started()`` comes after the first synchronized connection or after
    ``start_timeout`` seconds, whichever is first. Cancelled, it waits up to ``drain_timeout``
    seconds for the link to settle before the connection closes (see the module docstring).

    The hand-over of a rolling update (:mod:`dracpu.tasks.handover`): ``on_configured`` is
    called when a connection's ``Configure`` is handled; ``hand_over``, at a stop, after the
    drain and before the connection closes: it returns once the next dracpu is configured
    (``True``) or there is none; a connection that ends after it began is not made again.
    ``leaving_pod``: the pod UID of the dracpu that handed this one the state dir, whose
    containers every ``Synchronize`` leaves out.
    """
    link = NriLink() if link is None else link
    link.watch(committed)
    first_sync = anyio.Event()
    recheck = ClaimRecheck(owner_send, committed, claims)
    # The connections run shielded from the task's cancellation: at a stop they end only once
    # the link has settled (or the drain timed out).
    connections = anyio.CancelScope(shield=True)
    handing_over = anyio.Event()
    serve = partial(
        _connections,
        config,
        owner_send,
        link,
        connect,
        delays,
        first_sync,
        recheck,
        handing_over,
        on_configured,
        leaving_pod,
    )
    async with owner_send, anyio.create_task_group() as tg:
        tg.start_soon(_within, connections, serve)
        try:
            with anyio.move_on_after(start_timeout):
                await first_sync.wait()
            if not first_sync.is_set():
                logger.warning(
                    "NRI: no runtime synchronized within %g s (%s); starting anyway: "
                    "containers are pinned once it connects",
                    start_timeout,
                    link.status().last_error or "still trying",
                )
            task_status.started()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await _drain(link, drain_timeout)
                if hand_over is not None:
                    handing_over.set()
                    await hand_over()
            connections.cancel()


async def _within(scope: anyio.CancelScope, serve: Callable[[], Awaitable[None]]) -> None:
    with scope:
        await serve()


async def _drain(link: NriLink, limit: float) -> None:
    """Wait (at most ``limit`` s) until the link has settled; say what is left if not."""
    if not link.busy:
        return
    with anyio.move_on_after(limit):
        await link.settled()
        logger.info("NRI: every update and answer in flight reached the runtime; disconnecting")
        return
    logger.warning(
        "NRI: stopping with updates the runtime has not confirmed after %g s (%d containers "
        "queued); the next start re-pins every container",
        limit,
        len(link.queued),
    )
