"""Stopping the NRI task loses nothing: the updates queued or on their way when it is cancelled
reach the runtime before the connection closes (bounded), against the fake runtime, whose
requests die with the plugin's connection as containerd's do."""

from __future__ import annotations

import logging

import anyio
import pytest
from anyio.abc import TaskStatus

from dracpu.core.cpuset import CpuSet
from dracpu.sim._pb2.nri.v1alpha1 import api_pb2 as pb
from tests.tasks.both_backends import anyio_backend  # noqa: F401 (a fixture)
from tests.tasks.test_nri_plugin import ALLOCATABLE, UID_A, Node, add_shared, open_node, until

pytestmark = pytest.mark.anyio


async def _start_plugin(node: Node, **options: float) -> tuple[anyio.CancelScope, anyio.Event]:
    """The node's NRI task in a cancel scope of its own (cancelling it is the daemon's stop);
    the event is set once the task has ended."""
    scope, ended = anyio.CancelScope(), anyio.Event()

    async def run(*, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            with scope:
                await node.plugin()(task_status=task_status, **options)
        finally:
            ended.set()

    await node.tg.start(run)
    await node.runtime.wait_plugin(10)
    return scope, ended


async def _narrowed(node: Node) -> str:
    """An exclusive container came and went: the shared containers run on the narrow pool."""
    cpus = await node.prepare(UID_A)
    pod = node.runtime.add_pod("guaranteed")
    ctr = node.exclusive(pod, "app", UID_A)
    await node.runtime.create_container(pod, ctr)
    await node.runtime.remove_container(ctr.id)
    narrow = str(CpuSet.parse(ALLOCATABLE) - cpus)
    node.assert_shared_at(narrow)
    return narrow


def _on_its_way(node: Node) -> bool:
    return not node.link.queued and node.link.busy


async def test_a_stop_right_after_an_unprepare_still_widens_the_shared_containers() -> None:
    setup = lambda rt: add_shared(rt, 6)  # noqa: E731
    async with open_node(setup=setup, nri_version="v0.12.1", start=False) as node:
        scope, ended = await _start_plugin(node)
        await _narrowed(node)
        async with node.runtime.busy():  # the runtime is in a long event: the update waits
            await node.unprepare(UID_A)
            await until(lambda: _on_its_way(node), "the UpdateContainers on its way")
            scope.cancel()  # SIGTERM while it waits
            await anyio.sleep(0.3)
            assert not ended.is_set()  # the plugin waits for its answer, still connected
            assert node.runtime.plugin is not None
        # The event ends: the runtime applies the update and answers, then the plugin hangs up.
        with anyio.fail_after(2):
            await ended.wait()
        [call] = node.runtime.calls("UpdateContainers", caller="plugin")
        assert call.outcome == "ok"
        assert isinstance(call.request, pb.UpdateContainersRequest)
        assert len(call.request.update) == 6
        node.assert_shared_at(ALLOCATABLE)
        assert not node.link.status().connected


async def test_queued_updates_are_sent_before_the_plugin_hangs_up() -> None:
    setup = lambda rt: add_shared(rt, 3)  # noqa: E731
    async with open_node(setup=setup, nri_version="v0.12.1", start=False) as node:
        scope, ended = await _start_plugin(node)
        await _narrowed(node)
        async with node.runtime.busy():
            # Cancelled in the same breath as the Unprepare's answer: the update is queued at
            # most, and the runtime cannot take it before its event ends.
            await node.unprepare(UID_A)
            scope.cancel()
            await anyio.sleep(0.3)
        with anyio.fail_after(2):
            await ended.wait()
        assert [c.outcome for c in node.runtime.calls("UpdateContainers", caller="plugin")] == [
            "ok"
        ]
        node.assert_shared_at(ALLOCATABLE)


async def test_the_wait_at_a_stop_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    setup = lambda rt: add_shared(rt, 2)  # noqa: E731
    async with open_node(setup=setup, nri_version="v0.12.1", start=False) as node:
        scope, ended = await _start_plugin(node, drain_timeout=0.3)
        narrow = await _narrowed(node)
        with caplog.at_level(logging.WARNING, logger="dracpu"):
            async with node.runtime.busy():  # an event that outlasts the plugin's wait
                await node.unprepare(UID_A)
                await until(lambda: _on_its_way(node), "the UpdateContainers on its way")
                started = anyio.current_time()
                scope.cancel()
                with anyio.fail_after(2):
                    await ended.wait()
                waited = anyio.current_time() - started
                await until(lambda: node.runtime.plugin is None, "the runtime to see it gone")
        assert 0.3 <= waited < 1.0
        assert "the runtime has not confirmed after 0.3 s" in caplog.text
        # The runtime dropped the request with the connection: nothing applied.
        await until(
            lambda: bool(node.runtime.calls("UpdateContainers", caller="plugin")),
            "the runtime to finish the request",
        )
        [call] = node.runtime.calls("UpdateContainers", caller="plugin")
        assert call.outcome == "closed"
        node.assert_shared_at(narrow)
