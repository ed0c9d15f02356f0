"""One dedicated thread that runs blocking calls in order: the state owner's file effects.

A Prepare makes the CDI spec and the checkpoint durable (``fsync``) before the kubelet gets its
answer, so those writes leave the event loop for a thread. ``anyio.to_thread.run_sync`` costs
0.30 ms per round trip on the reference machine (2-core VM; capacity limiter, cancel scopes and
a context copy on every call), more than the checkpoint write itself (0.13 ms); handing the call
to one waiting thread through a queue and back through ``loop.call_soon_threadsafe`` costs
0.13 ms. A Prepare makes one round trip, so this is a tenth of its latency budget.

Semantics, as ``anyio.to_thread.run_sync`` with its defaults: :meth:`SerialThread.call` returns
what the function returns or raises what it raises, and waits for it to finish even when the
caller is cancelled (the cancellation is delivered afterwards): a file write that has begun is
never abandoned half-way. Calls run one at a time, in the order they were made (FIFO).

The thread starts on the first call and ends after ``idle_seconds`` without one (a later call
starts a new one), as anyio's own worker threads do, or never (``None``: starting a thread costs
~0.13 ms cold, and the kubelet's calls come minutes apart), and in any case after
:meth:`SerialThread.close`, once the calls made before it are done. It is a daemon thread, so a
process that exits never waits for it. This module is the one place besides
:mod:`dracpu.adapters.grpc_server` that uses asyncio directly (the daemon runs anyio on the
asyncio backend): a future of the running loop is what the thread
completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

__all__ = ["IDLE_SECONDS", "SerialThread"]

T = TypeVar("T")

# How long the thread waits for the next call before it ends (seconds); anyio's worker threads
# wait 10 s too (anyio._backends._asyncio.WorkerThread.MAX_IDLE_TIME).
IDLE_SECONDS = 10.0

_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """In the event loop: complete ``future`` (unless its waiter is gone)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class SerialThread:
    """Runs blocking calls one at a time, in order, in one thread of its own (see the module
    docstring). ``name`` names the thread (seen in ``py-spy dump`` and thread listings)."""

    def __init__(self, name: str, *, idle_seconds: float | None = IDLE_SECONDS) -> None:
        self._name = name
        self._idle_seconds = idle_seconds
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # None: stop
        self._lock = threading.Lock()  # guards _thread against a thread ending as a call comes
        self._thread: threading.Thread | None = None
        self._started = 0  # threads started so far (tests read it)
        self._closed = False

    def close(self) -> None:
        """End the thread once the calls already made are done; no call may follow. Safe to
        call from any thread, more than once (``weakref.finalize`` of the owner calls it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread is not None:
                self._jobs.put(None)

    @property
    def threads_started(self) -> int:
        """How many threads this object has started (a new one after each idle end)."""
        return self._started

    async def call(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` in the thread; its result, or its exception re-raised here."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: the thread is closed")
            self._jobs.put((loop, future, function, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._started += 1
                self._thread.start()
        with anyio.CancelScope(shield=True):  # a write that has begun is seen to its end
            result = await future
        return result

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._idle_seconds)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():  # no call came in meanwhile: end this thread
                        self._thread = None
                        return
                continue
            if job is None:  # closed
                return
            loop, future, function, args = job
            result: Any = None
            error: BaseException | None = None
            try:
                result = function(*args)
            except BaseException as exc:  # handed to the caller, whatever it is
                error = exc
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(_settle, future, result, error)
            del job, loop, future, function, args, result, error  # hold nothing while idle
