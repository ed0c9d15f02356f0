"""SerialThread: blocking calls in one thread of their own, in order, never abandoned."""

from __future__ import annotations

import threading
import time

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from dracpu.tasks.serial_thread import SerialThread

__all__: list[str] = []

pytestmark = pytest.mark.anyio


def _threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


async def test_returns_the_result_from_another_thread() -> None:
    worker = SerialThread("dracpu-test-result")
    ident = await worker.call(threading.get_ident)
    assert ident != threading.get_ident()
    assert await worker.call(divmod, 17, 5) == (3, 2)


async def test_reraises_the_functions_exception_and_keeps_working() -> None:
    worker = SerialThread("dracpu-test-error")
    error = OSError(28, "No space left on device")

    def fail() -> None:
        raise error

    with pytest.raises(OSError, match="No space left") as caught:
        await worker.call(fail)
    assert caught.value is error
    assert await worker.call(len, "abc") == 3
    assert worker.threads_started == 1


async def test_calls_run_one_at_a_time_in_the_order_they_were_made() -> None:
    worker = SerialThread("dracpu-test-order")
    log: list[tuple[str, int]] = []
    busy = threading.Lock()

    def job(index: int) -> int:
        assert busy.acquire(blocking=False), "two calls ran at once"
        try:
            log.append(("start", index))
            time.sleep(0.002)
            log.append(("end", index))
        finally:
            busy.release()
        return index

    results: list[int] = []

    async def caller(index: int) -> None:
        results.append(await worker.call(job, index))

    async with anyio.create_task_group() as tg:
        for index in range(8):
            tg.start_soon(caller, index)
            await anyio.lowlevel.checkpoint()  # the calls are made in index order
    assert log == [(kind, i) for i in range(8) for kind in ("start", "end")]
    assert sorted(results) == list(range(8))


async def test_a_cancelled_caller_still_waits_for_its_call_to_finish() -> None:
    worker = SerialThread("dracpu-test-cancel")
    release = threading.Event()
    finished = threading.Event()

    def slow_write() -> str:
        release.wait(5)
        finished.set()
        return "written"

    timer = threading.Timer(0.1, release.set)
    timer.start()
    try:
        with anyio.CancelScope() as scope:
            scope.cancel()  # already cancelled when the call is made
            result = await worker.call(slow_write)
            assert finished.is_set()  # returned only once the write had finished
            assert result == "written"
            await anyio.lowlevel.checkpoint()  # the cancellation lands here, after the call
            pytest.fail("the cancellation was lost")
    finally:
        timer.cancel()
    assert scope.cancelled_caught


async def test_the_thread_ends_when_idle_and_a_later_call_starts_a_new_one() -> None:
    name = "dracpu-test-idle"
    worker = SerialThread(name, idle_seconds=0.05)
    assert _threads_named(name) == []  # nothing runs before the first call
    await worker.call(lambda: None)
    [thread] = _threads_named(name)
    await anyio.to_thread.run_sync(thread.join, 5)  # it ends on its own, once idle
    assert _threads_named(name) == []
    assert await worker.call(lambda: "again") == "again"
    assert worker.threads_started == 2


async def test_a_call_made_as_the_thread_goes_idle_is_not_lost() -> None:
    worker = SerialThread("dracpu-test-race", idle_seconds=0.001)
    for index in range(200):
        assert await worker.call(int, index) == index
        await anyio.sleep(0.001 * (index % 3))  # around the idle deadline


async def test_without_an_idle_end_the_thread_stays_until_closed() -> None:
    name = "dracpu-test-close"
    worker = SerialThread(name, idle_seconds=None)
    assert await worker.call(int, 7) == 7
    await anyio.sleep(0.1)
    [thread] = _threads_named(name)  # still there, idle
    assert await worker.call(int, 8) == 8
    assert worker.threads_started == 1
    worker.close()
    worker.close()  # a second close does nothing
    await anyio.to_thread.run_sync(thread.join, 5)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        await worker.call(int, 9)


async def test_close_lets_the_calls_made_before_it_finish() -> None:
    worker = SerialThread("dracpu-test-close-order", idle_seconds=None)
    done: list[int] = []

    def slow(index: int) -> int:
        time.sleep(0.01)
        done.append(index)
        return index

    async def caller(index: int) -> None:
        assert await worker.call(slow, index) == index

    async with anyio.create_task_group() as tg:
        for index in range(3):
            tg.start_soon(caller, index)
        await anyio.lowlevel.checkpoint()  # the three calls are queued
        worker.close()
    assert done == [0, 1, 2]
