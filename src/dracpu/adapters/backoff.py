"""Retry delays and a retry helper for transient failures (model: kopf, reference
model-codebases.md §4 K4).

Backoff is data: :func:`backoff_delays` yields the delays to sleep between attempts, exponential
and capped, with the jitter's random source injected (tests pass a constant). :func:`retrying`
calls an async function until it succeeds, retrying only the exception types it is told are
transient; when the delays run out the last error escalates to the caller. Cancellation is never
caught: it is not an ``Exception`` the caller could list as transient (anyio cancels with
``asyncio.CancelledError`` / ``trio.Cancelled``, both ``BaseException``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TypeVar

import anyio

__all__ = [
    "DEFAULT_CAP",
    "DEFAULT_FACTOR",
    "DEFAULT_INITIAL",
    "DEFAULT_JITTER",
    "backoff_delays",
    "retrying",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

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


async def retrying(
    fn: Callable[[], Awaitable[T]],
    *,
    retry_on: tuple[type[Exception], ...],
    delays: Iterable[float],
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    what: str = "operation",
) -> T:
    """Await ``fn()``; on an exception of a ``retry_on`` type sleep the next delay and try again.

    When ``delays`` is exhausted the last error is raised (escalated). Any other exception, and
    cancellation, propagates at once. ``what`` names the operation in the log lines.
    """
    attempt = 0
    remaining = iter(delays)
    while True:
        attempt += 1
        try:
            return await fn()
        except retry_on as exc:
            delay = next(remaining, None)
            if delay is None:
                logger.error("%s failed (attempt %d), giving up: %s", what, attempt, exc)
                raise
            logger.warning(
                "%s failed (attempt %d), retrying in %.2f s: %s", what, attempt, delay, exc
            )
        await sleep(delay)
