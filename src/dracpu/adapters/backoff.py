"""Retrying what can be waited out: the delays, a wait that a sign of recovery cuts short, and
log lines that say each change of a failure once.

- :func:`backoff_delays`: the delays to sleep between attempts, exponential and capped, with
  the jitter's random source injected (tests pass a constant). Backoff is data (the model is
  kopf's ``error_backoffs``).
- :class:`Pause`: the sleep between two attempts, which :meth:`Pause.wake` ends at once (the
  slice publisher ends it when another request shows the API server is back, or on SIGHUP).
- :class:`RetryLog`: what a retry loop logs. An outage of an hour retried every few seconds
  must not write a thousand identical lines, yet the operator must see when it began, when its
  cause changed and when it ended.
- :class:`Health`: where a retry loop reports the condition it waits out (a readiness flag:
  ``/readyz`` shows the reason, ``dracpu_task_ready`` the state).

Cancellation is never caught here: anyio cancels with ``asyncio.CancelledError`` /
``trio.Cancelled``, both ``BaseException``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import anyio

__all__ = [
    "DEFAULT_CAP",
    "DEFAULT_FACTOR",
    "DEFAULT_INITIAL",
    "DEFAULT_JITTER",
    "Health",
    "Pause",
    "RetryLog",
    "backoff_delays",
]

# Defaults close to client-go's wait.Backoff used by the DRA helpers (Duration 1 s, Factor 2,
# Jitter, Cap ~ 30 s for API errors) but starting at half a second: the first retry after a
# conflict should be quick, a flapping API server should not be hammered.
DEFAULT_INITIAL = 0.5  # seconds before the second attempt
DEFAULT_FACTOR = 2.0  # each delay doubles
DEFAULT_CAP = 30.0  # no delay is longer (kopf's error_backoffs end at 21 s; client-go caps ~30 s)
DEFAULT_JITTER = 0.2  # +-20 %: many nodes restarted together must not retry in lockstep


def backoff_delays(
    *,
    initial: float = DEFAULT_INITIAL,
    factor: float = DEFAULT_FACTOR,
    cap: float = DEFAULT_CAP,
    jitter: float = DEFAULT_JITTER,
    attempts: int | None = None,
    rand: Callable[[], float] = random.random,
) -> Iterator[float]:
    """Delays ``initial, initial*factor, ...`` capped at ``cap``, each scaled by a random factor
    in ``[1 - jitter, 1 + jitter)`` (``rand()`` in ``[0, 1)``) and never above ``cap``.

    ``attempts``: how many delays to yield (``None``: forever). Pure apart from ``rand``.
    """
    if initial < 0 or cap < 0 or factor < 1 or not 0 <= jitter <= 1:
        raise ValueError(
            f"bad backoff: initial={initial} factor={factor} cap={cap} jitter={jitter}"
        )
    base = min(initial, cap)
    count = 0
    while attempts is None or count < attempts:
        scaled = base * (1.0 - jitter + 2.0 * jitter * rand())
        yield min(cap, max(0.0, scaled))
        count += 1
        base = min(cap, base * factor)  # stays finite: never grows past cap


class Health(Protocol):
    """Where a condition that is waited out goes (:class:`dracpu.tasks.http.ReadinessFlag` is
    one)."""

    def set_ready(self, detail: str = "") -> None: ...

    def set_not_ready(self, reason: str) -> None: ...


class Pause:
    """The sleep between two attempts of a retry loop, which :meth:`wake` can end early.

    One task sleeps in it at a time; :meth:`wake` (from any task of the same event loop) ends
    the sleep in progress and is forgotten when none is, so a wake that came while the loop was
    busy does not cut its next backoff short.
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    @property
    def sleeping(self) -> bool:
        """Whether a :meth:`sleep` is in progress."""
        return self._event is not None

    async def sleep(self, seconds: float) -> bool:
        """Sleep ``seconds`` or until :meth:`wake`; whether it was woken."""
        event = self._event = anyio.Event()
        try:
            with anyio.move_on_after(seconds):
                await event.wait()
        finally:
            self._event = None
        return event.is_set()

    def wake(self) -> None:
        """End the sleep in progress, if any."""
        if self._event is not None:
            self._event.set()


class RetryLog:
    """The log lines of ``what``, an operation retried until it works: one line per change.

    The first failure is logged at its ``level`` with the error and the delay; another failure
    with the same message at DEBUG only (the operator knows already); a failure with another
    message, or a higher level, at its level again; the first success after failures at INFO,
    with how many attempts failed over how long. ``extra`` goes to every record.
    """

    def __init__(
        self, log: logging.Logger, what: str, *, extra: dict[str, object] | None = None
    ) -> None:
        self._log = log
        self._what = what
        self._extra = extra
        self._message: str | None = None  # the last failure's, None while it works
        self._level = logging.NOTSET
        self._failures = 0
        self._since = 0.0

    @property
    def failing(self) -> bool:
        """Whether the last attempt failed."""
        return self._message is not None

    @property
    def failures(self) -> int:
        """Failed attempts since the last success."""
        return self._failures

    def failed(self, error: object, *, retry_in: float, level: int = logging.WARNING) -> None:
        """An attempt failed with ``error``; the next one comes in ``retry_in`` seconds."""
        message = str(error)
        if self._message is None:
            self._since = time.monotonic()
        self._failures += 1
        loud = message != self._message or level > self._level
        self._message, self._level = message, level
        if loud:
            self._log.log(
                level,
                "%s failed, retrying in %.1f s: %s",
                self._what,
                retry_in,
                message,
                extra=self._extra,
            )
        else:
            self._log.debug(
                "%s failed again (%d attempts), retrying in %.1f s: %s",
                self._what,
                self._failures,
                retry_in,
                message,
                extra=self._extra,
            )

    def recovered(self) -> bool:
        """An attempt worked; whether it ended a failure (then logged once, at INFO)."""
        if self._message is None:
            return False
        self._log.info(
            "%s works again after %d failed attempts over %.1f s",
            self._what,
            self._failures,
            time.monotonic() - self._since,
            extra=self._extra,
        )
        self._message, self._level, self._failures = None, logging.NOTSET, 0
        return True
