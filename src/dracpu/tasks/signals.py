"""Signals: SIGHUP resyncs, SIGTERM and SIGINT stop the daemon (docs/architecture.md).

- ``SIGHUP`` reads the settings and the topology again (:class:`~dracpu.tasks.reload.Reloader`)
  and sends the :class:`~dracpu.core.commands.Resync` it builds to the state owner (the node
  config built again, CDI specs rewritten, orphans pruned, slices republished, shared
  containers re-pinned), then logs the answer in one line (:func:`dracpu.tasks.reload.report`).
  Without a reloader it sends a plain ``Resync()``. The resync runs beside the signal loop, so
  a slow owner never delays a stop; SIGHUPs that arrive while a resync is running are
  coalesced into one more resync after it. Each SIGHUP also calls the ``on_sighup``
  callbacks (the pod-resources sync's request for a List).
- ``SIGTERM`` / ``SIGINT`` call ``stop(reason)``: the supervisor stops the tasks in reverse start
  order within its grace period. A second one calls ``stop`` again, which the supervisor takes
  as "stop now".
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Sequence

import anyio
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from dracpu.core.commands import Command, Resync
from dracpu.errors import DracpuError
from dracpu.tasks.reload import Reloader, report
from dracpu.tasks.state_owner import Request, request

__all__ = ["run"]

logger = logging.getLogger(__name__)


class _Resyncer:
    """At most one Resync in flight; a SIGHUP meanwhile asks for exactly one more."""

    def __init__(
        self, owner: MemoryObjectSendStream[Request[Command]], reloader: Reloader | None
    ) -> None:
        self._owner = owner
        self._reloader = reloader
        self._running = False
        self._again = False

    def trigger(self, tg: TaskGroup) -> None:
        if self._running:
            logger.info("SIGHUP: a resync is running; one more follows it")
            self._again = True
            return
        self._running = True
        tg.start_soon(self._resync)

    async def _resync(self) -> None:
        try:
            while True:
                self._again = False
                logger.info("SIGHUP: resync requested")
                try:
                    reloader = self._reloader
                    command = Resync() if reloader is None else await reloader.command()
                    result = await request(self._owner, command)
                except DracpuError as exc:
                    logger.warning("resync failed: %s", exc)
                else:
                    report(result)
                if not self._again:
                    return
        finally:
            self._running = False


async def run(
    owner: MemoryObjectSendStream[Request[Command]],
    stop: Callable[[str], None],
    *,
    reloader: Reloader | None = None,
    on_sighup: Sequence[Callable[[], None]] = (),
    task_status: TaskStatus[None] = TASK_STATUS_IGNORED,
) -> None:
    """Handle SIGHUP, SIGTERM and SIGINT until cancelled; ``reloader`` builds a SIGHUP's
    Resync (``None``: a plain ``Resync()``); ``on_sighup``: called at each SIGHUP (they must not
    block).

    Resource handling: ``owner`` (give this task its own clone) is closed on exit; the signal
    handlers are removed on exit, restoring the default ones.

    Error handling: a failed resync is logged and does not end the task.
    """
    async with owner:
        with anyio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as tg:
                resyncer = _Resyncer(owner, reloader)
                task_status.started()
                async for signum in signals:
                    if signum == signal.SIGHUP:
                        resyncer.trigger(tg)
                        for callback in on_sighup:
                            callback()
                    else:
                        name = signal.Signals(signum).name
                        logger.info("%s received: stopping", name)
                        stop(name)
