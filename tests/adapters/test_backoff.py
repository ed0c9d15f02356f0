"""Backoff delays and the retry helper (dracpu.adapters.backoff)."""

from __future__ import annotations

import itertools

import anyio
import pytest

from dracpu.adapters.backoff import backoff_delays, retrying
from dracpu.errors import KubeClientError, KubeConflictError, KubeServerError


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


class Flaky:
    """Fails with the given errors in turn, then returns the number of calls."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> int:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.calls


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


@pytest.mark.anyio
async def test_transient_errors_are_retried_until_success() -> None:
    fn = Flaky(KubeServerError("500"), KubeConflictError("409"))
    sleeps = Sleeps()
    result = await retrying(
        fn,
        retry_on=(KubeServerError, KubeConflictError),
        delays=[0.1, 0.2, 0.3],
        sleep=sleeps,
    )
    assert result == 3
    assert sleeps.delays == [0.1, 0.2]


@pytest.mark.anyio
async def test_last_error_escalates_when_delays_run_out() -> None:
    fn = Flaky(KubeServerError("a"), KubeServerError("b"), KubeServerError("c"))
    sleeps = Sleeps()
    with pytest.raises(KubeServerError, match="c"):
        await retrying(fn, retry_on=(KubeServerError,), delays=[0.1, 0.2], sleep=sleeps)
    assert fn.calls == 3
    assert sleeps.delays == [0.1, 0.2]


@pytest.mark.anyio
async def test_errors_not_listed_propagate_at_once() -> None:
    fn = Flaky(KubeClientError("403 forbidden"))
    sleeps = Sleeps()
    with pytest.raises(KubeClientError, match="403"):
        await retrying(fn, retry_on=(KubeServerError,), delays=[0.1], sleep=sleeps)
    assert fn.calls == 1
    assert sleeps.delays == []


@pytest.mark.anyio
async def test_cancellation_is_not_retried() -> None:
    calls = 0

    async def hangs() -> None:
        nonlocal calls
        calls += 1
        await anyio.sleep_forever()

    with anyio.move_on_after(0.05) as scope:
        await retrying(hangs, retry_on=(Exception,), delays=itertools.repeat(0.0))
    assert scope.cancelled_caught
    assert calls == 1
