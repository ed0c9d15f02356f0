"""The signals task with real signals sent to this process (its handlers are installed while the
task runs, so nothing reaches pytest's own handlers), and a hand-driven owner."""

from __future__ import annotations

import logging
import os
import signal
from functools import partial

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu.core.commands import Command, Resync
from dracpu.core.effects import Resynced
from dracpu.tasks import signals
from dracpu.tasks.state_owner import Request, create_request_stream
from tests.tasks.both_backends import anyio_backend  # noqa: F401 (a fixture)

pytestmark = pytest.mark.anyio


Streams = tuple[
    MemoryObjectSendStream[Request[Command]], MemoryObjectReceiveStream[Request[Command]]
]


async def test_sighup_resyncs_and_sighups_during_a_resync_are_coalesced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dracpu")
    coalesced = "SIGHUP: a resync is running; one more follows it"
    streams: Streams = create_request_stream()
    send, receive = streams
    stops: list[str] = []
    async with send, receive, anyio.create_task_group() as tg:
        await tg.start(signals.run, send.clone(), stops.append)
        os.kill(os.getpid(), signal.SIGHUP)
        with anyio.fail_after(5):
            first = await receive.receive()
        assert first.command == Resync()
        for sent in range(1, 4):  # while the first resync runs, one at a time (trio coalesces
            os.kill(os.getpid(), signal.SIGHUP)  # a signal that is still pending)
            with anyio.fail_after(5):
                while caplog.messages.count(coalesced) < sent:  # noqa: ASYNC110 - the log
                    await anyio.sleep(0.01)
        assert receive.statistics().current_buffer_used == 0  # nothing new while in flight
        with first.reply:
            first.reply.send_nowait(Resynced(claims=0))
        with anyio.fail_after(5):
            second = await receive.receive()  # the three SIGHUPs became one more resync
        with second.reply:
            second.reply.send_nowait(Resynced(claims=0))
        await anyio.wait_all_tasks_blocked()
        assert receive.statistics().current_buffer_used == 0
        assert stops == []
        tg.cancel_scope.cancel()


async def test_sighup_calls_the_callbacks_beside_the_resync() -> None:
    streams: Streams = create_request_stream()
    send, receive = streams
    asked: list[str] = []
    stops: list[str] = []
    async with send, receive, anyio.create_task_group() as tg:
        callbacks = (lambda: asked.append("a"), lambda: asked.append("b"))
        await tg.start(partial(signals.run, send.clone(), stops.append, on_sighup=callbacks))
        os.kill(os.getpid(), signal.SIGHUP)
        with anyio.fail_after(5):
            resync = await receive.receive()
        with resync.reply:
            resync.reply.send_nowait(Resynced(claims=0))
        with anyio.fail_after(5):
            while asked != ["a", "b"]:  # noqa: ASYNC110 - plain list appends
                await anyio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # a stop calls none of them
        with anyio.fail_after(5):
            while not stops:  # noqa: ASYNC110 - plain list appends
                await anyio.sleep(0.01)
        assert asked == ["a", "b"]
        tg.cancel_scope.cancel()


async def test_sigterm_and_sigint_ask_the_supervisor_to_stop() -> None:
    streams: Streams = create_request_stream()
    send, receive = streams
    stops: list[str] = []
    async with send, receive, anyio.create_task_group() as tg:
        await tg.start(signals.run, send.clone(), stops.append)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        with anyio.fail_after(5):
            while len(stops) < 2:  # noqa: ASYNC110 - the callback is a plain list.append
                await anyio.sleep(0.01)
        assert stops == ["SIGTERM", "SIGINT"]
        assert receive.statistics().current_buffer_used == 0  # no resync for these
        tg.cancel_scope.cancel()
