"""The supervisor with fake tasks, with the real state owner and signals tasks, and ``main``
in-process. (The real ``dracpu run`` process is driven in tests/integration.)"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu.config import Config
from dracpu.config.values import BindAddress
from dracpu.core.commands import Command
from dracpu.daemon import (
    EXIT_FAILURE,
    EXIT_OK,
    Shutdown,
    TaskRun,
    TaskSpec,
    main,
    serve,
)
from dracpu.errors import DracpuError
from dracpu.tasks import signals, state_owner
from dracpu.tasks.http import Readiness
from dracpu.tasks.state_owner import Request, StateOwner, create_request_stream
from tests.fixtures import SysfsTrees

# --- fake tasks ---------------------------------------------------------------------------------


class Journal:
    def __init__(self) -> None:
        self.events: list[str] = []

    def task(
        self,
        name: str,
        *,
        fail: BaseException | None = None,
        fail_before_start: bool = False,
        block_start: bool = False,
        returns: bool = False,
        slow_stop: float = 0.0,
        after_start: Callable[[], None] | None = None,
    ) -> TaskSpec:
        """A fake task that journals its start and stop and misbehaves as asked."""

        async def run(*, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
            self.events.append(f"start {name}")
            try:
                if fail is not None and fail_before_start:
                    raise fail
                if block_start:
                    await anyio.sleep_forever()
                task_status.started()
                if after_start is not None:
                    after_start()
                if fail is not None:
                    await anyio.sleep(0.05)
                    raise fail
                if returns:
                    return
                await anyio.sleep_forever()
            finally:
                if slow_stop:
                    with anyio.CancelScope(shield=True):
                        await anyio.sleep(slow_stop)
                self.events.append(f"stop {name}")

        return TaskSpec(name, run)


async def _serve(
    tasks: list[TaskSpec],
    *,
    stop_when_ready: bool = True,
    stop_timeout: float = 4.5,
    readiness: Readiness | None = None,
    shutdown: Shutdown | None = None,
    on_running: Callable[[], None] | None = None,
) -> int:
    readiness = Readiness() if readiness is None else readiness
    shutdown = Shutdown() if shutdown is None else shutdown

    async def stop_when_all_ready() -> None:
        while not readiness.is_ready():  # noqa: ASYNC110 - readiness is polled, like /readyz
            await anyio.sleep(0.01)
        shutdown.request("SIGTERM")

    async with anyio.create_task_group() as tg:
        if stop_when_ready:
            tg.start_soon(stop_when_all_ready)
        code = await serve(
            tasks,
            readiness=readiness,
            shutdown=shutdown,
            stop_timeout=stop_timeout,
            on_running=on_running,
        )
        tg.cancel_scope.cancel()
    return code


# --- the supervisor -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_tasks_start_in_order_and_stop_in_reverse() -> None:
    journal = Journal()
    readiness = Readiness()
    code = await _serve([journal.task(n) for n in "abc"], readiness=readiness)
    assert code == EXIT_OK
    assert journal.events == ["start a", "start b", "start c", "stop c", "stop b", "stop a"]
    assert [f.name for f in readiness.flags()] == ["a", "b", "c"]
    assert not readiness.is_ready()  # stopping


@pytest.mark.anyio
async def test_a_task_stops_after_the_tasks_it_outlives() -> None:
    journal = Journal()
    tasks = [journal.task(n) for n in "abcde"]
    tasks[3] = replace(tasks[3], outlives=("b", "c", "x"))  # x: not a task, ignored
    tasks[4] = replace(tasks[4], outlives=("a",))
    assert await _serve(tasks) == EXIT_OK
    stops = [e.split()[1] for e in journal.events if e.startswith("stop")]
    assert stops == ["c", "b", "d", "a", "e"]


@pytest.mark.anyio
async def test_readiness_waits_for_the_last_task() -> None:
    journal = Journal()
    readiness = Readiness()
    seen: list[bool] = []
    tasks = [
        journal.task("a", after_start=lambda: seen.append(readiness.is_ready())),
        journal.task("b", after_start=lambda: seen.append(readiness.is_ready())),
    ]
    assert await _serve(tasks, readiness=readiness) == EXIT_OK
    assert seen == [False, False]  # b was still starting, then its own flag was not yet set


@pytest.mark.anyio
async def test_on_running_is_called_once_when_every_task_has_started() -> None:
    journal = Journal()
    tasks = [journal.task("a"), journal.task("b")]
    assert await _serve(tasks, on_running=lambda: journal.events.append("running")) == EXIT_OK
    assert journal.events == ["start a", "start b", "running", "stop b", "stop a"]

    journal = Journal()
    tasks = [journal.task("a"), journal.task("b", fail=ValueError("x"), fail_before_start=True)]
    code = await _serve(
        tasks, stop_when_ready=False, on_running=lambda: journal.events.append("running")
    )
    assert code == EXIT_FAILURE
    assert "running" not in journal.events


@pytest.mark.anyio
async def test_a_task_that_fails_stops_the_others_and_exits_1(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="dracpu")
    journal = Journal()
    tasks = [journal.task("a"), journal.task("b", fail=ValueError("kaput")), journal.task("c")]
    assert await _serve(tasks, stop_when_ready=False) == EXIT_FAILURE
    assert journal.events == ["start a", "start b", "start c", "stop b", "stop c", "stop a"]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == ["task b failed: ValueError: kaput"]
    tracebacks = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert [r.getMessage() for r in tracebacks] == ["task b failed"]


@pytest.mark.anyio
async def test_a_dracpu_error_is_logged_as_its_message(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="dracpu")
    journal = Journal()
    tasks = [journal.task("nri", fail=DracpuError("the runtime refused us"))]
    assert await _serve(tasks, stop_when_ready=False) == EXIT_FAILURE
    assert "task nri failed: the runtime refused us" in caplog.messages
    # Its one line says it all: no traceback, even at debug level (upstream's chart: --v=4).
    assert [r for r in caplog.records if r.exc_info] == []


@pytest.mark.anyio
async def test_a_failure_in_a_tasks_own_task_group_is_logged_with_its_messages(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Most tasks run their loops in a task group of their own (anyio wraps what a child raises
    # in an ExceptionGroup): the log line must still say what went wrong.
    async def publisher(*, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        async def loop() -> None:
            await anyio.sleep(0.05)
            raise DracpuError("node name 'Bad_Name' is not a valid pool name")

        async with anyio.create_task_group() as tg:
            tg.start_soon(loop)
            tg.start_soon(anyio.sleep_forever)
            task_status.started()

    async def nri(*, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_events)
            task_status.started()

    async def watch_events() -> None:
        await anyio.sleep(0.05)
        raise ExceptionGroup("events", [ValueError("bad event"), KeyError("uid")])

    for name, run, expected in [
        ("slice-publisher", publisher, "node name 'Bad_Name' is not a valid pool name"),
        ("nri", nri, "ValueError: bad event; KeyError: 'uid'"),
    ]:
        caplog.clear()
        assert await _serve([TaskSpec(name, run)], stop_when_ready=False) == EXIT_FAILURE
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert errors == [f"task {name} failed: {expected}"]


@pytest.mark.anyio
async def test_a_start_up_failure_exits_1(caplog: pytest.LogCaptureFixture) -> None:
    journal = Journal()
    tasks = [
        journal.task("a"),
        journal.task("b", fail=OSError("cannot bind"), fail_before_start=True),
        journal.task("c"),
    ]
    assert await _serve(tasks, stop_when_ready=False) == EXIT_FAILURE
    assert journal.events == ["start a", "start b", "stop b", "stop a"]
    assert "task b failed: OSError: cannot bind" in caplog.messages


@pytest.mark.anyio
async def test_a_task_that_returns_is_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    journal = Journal()
    tasks = [journal.task("a"), journal.task("b", returns=True)]
    assert await _serve(tasks, stop_when_ready=False) == EXIT_FAILURE
    assert journal.events == ["start a", "start b", "stop b", "stop a"]
    assert "task b stopped unexpectedly" in caplog.messages


@pytest.mark.anyio
async def test_a_stop_during_start_up_stops_what_started() -> None:
    journal = Journal()
    shutdown = Shutdown()
    tasks = [
        journal.task("a", after_start=lambda: shutdown.request("SIGTERM")),
        journal.task("b", block_start=True),
        journal.task("c"),
    ]
    with anyio.fail_after(5):
        code = await _serve(tasks, stop_when_ready=False, shutdown=shutdown)
    assert code == EXIT_OK
    assert journal.events == ["start a", "start b", "stop b", "stop a"]


@pytest.mark.anyio
async def test_the_stop_timeout_bounds_the_ordered_stop(caplog: pytest.LogCaptureFixture) -> None:
    journal = Journal()
    tasks = [journal.task("a"), journal.task("b"), journal.task("c", slow_stop=0.5)]
    start = time.monotonic()
    assert await _serve(tasks, stop_timeout=0.1) == EXIT_OK
    # c was still stopping when the timeout cancelled a and b without waiting for it.
    assert sorted(journal.events[3:5]) == ["stop a", "stop b"]
    assert journal.events[5:] == ["stop c"]
    assert time.monotonic() - start < 2
    assert "cancelling tasks that had not stopped yet: a, b, c" in caplog.messages


@pytest.mark.anyio
async def test_a_task_may_lengthen_the_stop_it_is_in(caplog: pytest.LogCaptureFixture) -> None:
    # The NRI task's hand-over waits for the next dracpu beyond the stop's usual bound.
    shutdown = Shutdown()
    shutdown.extend(60)  # outside a stop: nothing
    events: list[str] = []

    async def handing_over(*, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                shutdown.extend(0.5)
                await anyio.sleep(0.3)  # longer than the stop's 0.1 s
                events.append("handed over")

    journal = Journal()
    tasks = [journal.task("a"), TaskSpec("nri", handing_over)]
    assert await _serve(tasks, shutdown=shutdown, stop_timeout=0.1) == EXIT_OK
    assert events == ["handed over"]
    assert journal.events[-1] == "stop a"  # stopped after it, within the lengthened bound
    assert not any("had not stopped yet" in m for m in caplog.messages)


@pytest.mark.anyio
async def test_a_second_stop_request_stops_at_once(caplog: pytest.LogCaptureFixture) -> None:
    journal = Journal()
    shutdown = Shutdown()
    tasks = [journal.task("a"), journal.task("b", slow_stop=0.5)]

    async def second_signal() -> None:
        await shutdown.wait()
        await anyio.sleep(0.1)
        shutdown.request("SIGINT")

    async with anyio.create_task_group() as tg:
        tg.start_soon(second_signal)
        code = await _serve(tasks, shutdown=shutdown, stop_timeout=30)
    assert code == EXIT_OK
    assert journal.events[2:] == ["stop a", "stop b"]
    assert "SIGINT during the stop: stopping now" in caplog.messages


@pytest.mark.anyio
async def test_cancelling_serve_cancels_the_tasks_and_propagates() -> None:
    journal = Journal()
    returned: list[int] = []
    with anyio.move_on_after(0.2) as scope:
        returned.append(
            await serve(
                [journal.task("a"), journal.task("b")],
                readiness=Readiness(),
                shutdown=Shutdown(),
            )
        )
    assert scope.cancelled_caught
    assert returned == []  # the cancellation was not turned into a return value
    assert sorted(journal.events) == ["start a", "start b", "stop a", "stop b"]


# --- main in this process -----------------------------------------------------------------------


@pytest.fixture
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    ours = logging.getLogger("dracpu")
    our_level = ours.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    ours.setLevel(our_level)
    # main() leaves the heap frozen (for a fast exit): give this process's later tests a
    # collector that sees every object again (gc.get_referrers, as hypothesis uses, included).
    gc.unfreeze()


_KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


@pytest.mark.usefixtures("_restore_logging")
def test_main_returns_1_when_the_node_cannot_be_restored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(_KUBECONFIG)
    config = Config(
        node_name="n",
        bind_address=BindAddress("127.0.0.1", 0),
        log_format="json",
        kubeconfig=kubeconfig,
        host_root=tmp_path / "no-sysfs-here",
        state_dir=tmp_path / "state",
        cdi_dir=tmp_path / "cdi",
        kubelet_root_dir=tmp_path / "kubelet",
    )
    assert gc.isenabled()
    assert main(config) == EXIT_FAILURE
    assert gc.isenabled()  # main turns the collector off for the start-up only
    assert gc.get_freeze_count() > 0  # and leaves the heap frozen for a fast exit
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    failure = [line for line in lines if line["level"] == "error"]
    assert [line["message"].split(":")[0] for line in failure] == ["task state-owner failed"]
    assert "no-sysfs-here" in failure[0]["message"]
    # The tasks before the owner (signals) were stopped; nothing after it started.
    assert "task http" not in "".join(line["message"] for line in lines)


def test_task_specs_take_partial_and_plain_functions() -> None:
    async def plain(*, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        task_status.started()

    run: TaskRun = plain
    assert TaskSpec("x", run).run is plain


# --- a crashing state owner -------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_crashing_state_owner_stops_the_daemon_with_exit_1(
    trees: SysfsTrees,
    scratch: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = Config(
        node_name="n",
        host_root=trees.root("dual-socket-smt2"),
        cdi_dir=scratch / "cdi",
        state_dir=scratch / "state",
        kubelet_root_dir=scratch / "kubelet",
    )
    send: MemoryObjectSendStream[Request[Command]]
    receive: MemoryObjectReceiveStream[Request[Command]]
    send, receive = create_request_stream()
    owner = StateOwner(config, receive)
    shutdown = Shutdown()

    async def run_signals(*, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        await signals.run(send.clone(), shutdown.request, task_status=task_status)

    def buggy(state: object, command: object) -> Any:
        raise RuntimeError("bug in apply")

    def hang_up() -> None:  # every task runs: the owner meets its bug at the next command
        monkeypatch.setattr(state_owner, "apply", buggy)
        os.kill(os.getpid(), signal.SIGHUP)

    tasks = [TaskSpec("signals", run_signals), TaskSpec("state-owner", owner.run)]
    with send, receive, caplog.at_level(logging.INFO, logger="dracpu"):
        with anyio.fail_after(5):
            code = await serve(tasks, readiness=Readiness(), shutdown=shutdown, on_running=hang_up)
    assert code == EXIT_FAILURE
    messages = [record.getMessage() for record in caplog.records]
    assert "task state-owner failed: RuntimeError: bug in apply" in messages
    assert "resync failed: Resync: internal error: RuntimeError('bug in apply')" in messages
