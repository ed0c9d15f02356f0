"""Backoff delays, the wakeable pause and the retry log (dracpu.adapters.backoff)."""

from __future__ import annotations

import itertools
import logging
import time

import anyio
import anyio.lowlevel
import pytest

from dracpu.adapters.backoff import Pause, RetryLog, backoff_delays


def test_delays_double_up_to_the_cap_without_jitter() -> None:
    delays = backoff_delays(initial=0.5, factor=2.0, cap=5.0, jitter=0.0)
    assert list(itertools.islice(delays, 7)) == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def test_jitter_scales_each_delay_within_bounds() -> None:
    low = list(backoff_delays(initial=1.0, cap=8.0, jitter=0.25, attempts=4, rand=lambda: 0.0))
    high = list(backoff_delays(initial=1.0, cap=100.0, jitter=0.25, attempts=4, rand=lambda: 0.999))
    assert low == [0.75, 1.5, 3.0, 6.0]
    assert high == pytest.approx([1.2495, 2.499, 4.998, 9.996])


def test_jitter_never_exceeds_the_cap() -> None:
    delays = backoff_delays(initial=10.0, cap=10.0, jitter=0.5, attempts=3, rand=lambda: 0.99)
    assert list(delays) == [10.0, 10.0, 10.0]


def test_attempts_bound_the_delays_and_huge_counts_do_not_overflow() -> None:
    assert len(list(backoff_delays(attempts=3))) == 3
    endless = backoff_delays(initial=1.0, factor=10.0, cap=30.0, jitter=0.0)
    assert list(itertools.islice(endless, 2000))[-1] == 30.0


@pytest.mark.parametrize(
    ("initial", "factor", "cap", "jitter"),
    [(-1.0, 2.0, 1.0, 0.0), (1.0, 0.5, 1.0, 0.0), (1.0, 2.0, -1.0, 0.0), (1.0, 2.0, 1.0, 1.5)],
)
def test_bad_parameters_are_refused(
    initial: float, factor: float, cap: float, jitter: float
) -> None:
    with pytest.raises(ValueError, match="bad backoff"):
        next(backoff_delays(initial=initial, factor=factor, cap=cap, jitter=jitter))


@pytest.mark.anyio
async def test_a_pause_sleeps_its_time_unless_woken() -> None:
    pause = Pause()
    start = time.monotonic()
    assert await pause.sleep(0.05) is False
    assert time.monotonic() - start >= 0.05
    assert [pause.sleeping] == [False]

    woken: list[bool] = []
    async with anyio.create_task_group() as tg:

        async def sleeper() -> None:
            woken.append(await pause.sleep(30.0))

        tg.start_soon(sleeper)
        with anyio.fail_after(5):
            while not pause.sleeping:
                await anyio.lowlevel.checkpoint()
        start = time.monotonic()
        pause.wake()
    assert woken == [True]
    assert time.monotonic() - start < 5


@pytest.mark.anyio
async def test_a_wake_without_a_sleep_is_forgotten() -> None:
    pause = Pause()
    pause.wake()  # the loop was busy: its next backoff must still be slept
    start = time.monotonic()
    assert await pause.sleep(0.05) is False
    assert time.monotonic() - start >= 0.05


def _records(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records]


def test_retry_log_says_each_change_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="test.retry")
    log = RetryLog(logging.getLogger("test.retry"), "publishing")
    assert (log.recovered(), log.failing) == (False, False)  # nothing failed: nothing to say
    log.failed("connection refused", retry_in=0.5)
    log.failed("connection refused", retry_in=1.0)
    log.failed("connection refused", retry_in=2.0)
    log.failed("503 Service Unavailable", retry_in=2.0)
    log.failed("503 Service Unavailable", retry_in=2.0, level=logging.ERROR)
    assert (log.failing, log.failures) == (True, 5)
    assert log.recovered() is True
    assert log.recovered() is False
    assert log.failures == 0
    records = _records(caplog)
    assert records[:6] == [
        ("WARNING", "publishing failed, retrying in 0.5 s: connection refused"),
        ("DEBUG", "publishing failed again (2 attempts), retrying in 1.0 s: connection refused"),
        ("DEBUG", "publishing failed again (3 attempts), retrying in 2.0 s: connection refused"),
        ("WARNING", "publishing failed, retrying in 2.0 s: 503 Service Unavailable"),
        ("ERROR", "publishing failed, retrying in 2.0 s: 503 Service Unavailable"),
        ("INFO", records[5][1]),
    ]
    assert records[5][1].startswith("publishing works again after 5 failed attempts over ")
    assert len(records) == 6


def test_retry_log_starts_over_after_a_recovery(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="test.retry")
    log = RetryLog(logging.getLogger("test.retry"), "watching", extra={"task": "x"})
    log.failed("reset", retry_in=1.0)
    log.recovered()
    log.failed("reset", retry_in=1.0)  # the same cause, but a new failure: said again
    assert [level for level, _ in _records(caplog)] == ["WARNING", "INFO", "WARNING"]
    assert all(getattr(r, "task", None) == "x" for r in caplog.records)
