"""The supervisor with fake tasks, ``main`` in-process, and the real ``dracpu run`` process."""

from __future__ import annotations

import gc
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus

from dracpu.config import BindAddress, Config
from dracpu.daemon import (
    EXIT_FAILURE,
    EXIT_OK,
    Shutdown,
    StateMachine,
    TaskRun,
    TaskSpec,
    main,
    serve,
)
from dracpu.errors import DracpuError
from dracpu.tasks.http import Readiness

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
    journal = Journal()
    tasks = [journal.task("nri", fail=DracpuError("the runtime refused us"))]
    assert await _serve(tasks, stop_when_ready=False) == EXIT_FAILURE
    assert "task nri failed: the runtime refused us" in caplog.messages


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


@pytest.mark.usefixtures("_restore_logging")
def test_main_returns_1_when_the_daemon_cannot_be_wired(capsys: pytest.CaptureFixture[str]) -> None:
    def broken(config: Config) -> StateMachine[None, object]:
        raise DracpuError("cannot read /sys/devices/system/cpu/online")

    config = Config(node_name="n", bind_address=BindAddress("127.0.0.1", 0), log_format="json")
    assert gc.isenabled()
    assert main(config, machine=broken) == EXIT_FAILURE
    assert gc.isenabled()  # main turns the collector off for the start-up only
    assert gc.get_freeze_count() > 0  # and leaves the heap frozen for a fast exit
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert lines[-1]["message"] == (
        "dracpu failed to start: cannot read /sys/devices/system/cpu/online"
    )
    assert lines[-1]["level"] == "error"


def test_task_specs_take_partial_and_plain_functions() -> None:
    async def plain(*, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        task_status.started()

    run: TaskRun = plain
    assert TaskSpec("x", run).run is plain


# --- the real process ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def _wait_until(what: str, check: Callable[[], bool], proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"dracpu exited ({proc.returncode}) before {what}"
        try:
            if check():
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Daemon:
    """``python -m dracpu run`` on temporary directories and a free port."""

    def __init__(self, tmp_path: Path, *extra: str, argv: list[str] | None = None) -> None:
        self.port = _free_port()
        self.dirs = [tmp_path / d for d in ("state", "kubelet", "cdi", "nri")]
        for directory in self.dirs:
            directory.mkdir()
        state, kubelet, cdi, nri = self.dirs
        command = argv or [
            sys.executable,
            "-m",
            "dracpu",
            "run",
            "--node-name=node-1",
            f"--state-dir={state}",
            f"--kubelet-root-dir={kubelet}",
            f"--cdi-dir={cdi}",
            f"--nri-socket={nri / 'nri.sock'}",
            f"--bind-address=127.0.0.1:{self.port}",
            "--log-format=json",
            *extra,
        ]
        env = {k: v for k, v in os.environ.items() if k not in {"NODE_NAME", "HOST_ROOT"}}
        self.proc = subprocess.Popen(
            command, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env
        )

    def wait_ready(self) -> None:
        _wait_until("/readyz 200", lambda: _get(self.port, "/readyz")[0] == 200, self.proc)

    def stop(self, signum: signal.Signals) -> tuple[int, float, list[dict[str, object]]]:
        """Send ``signum``; the exit code, the seconds it took and the JSON log lines."""
        start = time.monotonic()
        self.proc.send_signal(signum)
        return self.finish(start)

    def finish(self, start: float) -> tuple[int, float, list[dict[str, object]]]:
        _, err = self.proc.communicate(timeout=30)
        elapsed = time.monotonic() - start
        return self.proc.returncode, elapsed, [json.loads(line) for line in err.splitlines()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for daemon in started:
        daemon.kill()


_BUGGY_OWNER = """
import sys
from collections.abc import Sequence
from dracpu.config import BindAddress, Config
from dracpu.core.effects import Reply
from dracpu.daemon import StateMachine, main, skeleton_machine

def buggy(config: Config) -> StateMachine[None, Reply]:
    def apply(state: None, command: object) -> tuple[None, Sequence[Reply]]:
        raise RuntimeError("bug in apply")
    return StateMachine(state=None, apply=apply, execute=skeleton_machine(config).execute)

config = Config(node_name="n", bind_address=BindAddress("127.0.0.1", int(sys.argv[1])),
                log_format="json")
sys.exit(main(config, machine=buggy))
"""


def test_a_crashing_state_owner_exits_1(tmp_path: Path, daemons: list[Daemon]) -> None:
    port = _free_port()
    daemon = Daemon(tmp_path, argv=[sys.executable, "-c", _BUGGY_OWNER, str(port)])
    daemon.port = port
    daemons.append(daemon)
    daemon.wait_ready()
    code, elapsed, logs = daemon.stop(signal.SIGHUP)  # the resync hits the bug
    assert code == 1
    assert elapsed < 5
    messages = [entry["message"] for entry in logs]
    assert "task state-owner failed: RuntimeError: bug in apply" in messages
    assert "resync failed: Resync: internal error: RuntimeError('bug in apply')" in messages
