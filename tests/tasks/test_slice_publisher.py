"""The slice publisher against the fake API server (dracpu.tasks.slice_publisher): every slice
it writes is validated by the server (schema + apiserver rules); the tests check what the
server ends up storing."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectSendStream

from dracpu.adapters.backoff import backoff_delays
from dracpu.adapters.kube import KubeClient
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, Device, GroupBy, published_devices
from dracpu.core.slices import SliceOptions, slice_name
from dracpu.sim.fake_apiserver import FakeApiServer
from dracpu.sim.slice_rules import validate_pool
from dracpu.sim.topologies import FIXTURES, MachineSpec, build_topology
from dracpu.tasks import slice_publisher
from dracpu.tasks.http import ReadinessFlag
from dracpu.tasks.slice_publisher import (
    PublisherSettings,
    Republish,
    republish_channel,
    request_republish,
)
from tests.kube_helpers import NODE, NODE_UID, connected, foreign_slice

FAST = PublisherSettings(
    debounce=0.01,
    resync_interval=600.0,
    start_timeout=10.0,
    backoff=functools.partial(backoff_delays, initial=0.01, cap=0.05, jitter=0.0),
    unavailable_backoff=functools.partial(backoff_delays, initial=0.01, cap=0.05, jitter=0.0),
)
# Retry waits far longer than any test: only a wake can explain a quick retry.
PATIENT = PublisherSettings(
    debounce=0.01,
    backoff=functools.partial(backoff_delays, initial=60.0, cap=60.0, jitter=0.0),
    unavailable_backoff=functools.partial(backoff_delays, initial=60.0, cap=60.0, jitter=0.0),
)
TOPOLOGY = build_topology(FIXTURES["dual-socket-smt2"])


def devices(
    mode: CpuDeviceMode = CpuDeviceMode.GROUPED,
    *,
    reserved: str = "",
    topology_name: str | None = None,
    spec: MachineSpec | None = None,
) -> list[Device]:
    topology = TOPOLOGY
    if spec is not None:
        topology = build_topology(spec)
    elif topology_name is not None:
        topology = build_topology(FIXTURES[topology_name])
    return published_devices(
        topology, reserved=CpuSet.parse(reserved), mode=mode, group_by=GroupBy.NUMANODE
    )


@contextlib.asynccontextmanager
async def publishing(
    kube: KubeClient,
    want: Sequence[Device],
    *,
    settings: PublisherSettings = FAST,
    **kwargs: Any,
) -> AsyncIterator[MemoryObjectSendStream[Republish]]:
    """The publisher, asked to publish ``want`` before it starts (as the state owner's restore
    asks); yields the stream of further requests."""
    send, receive = republish_channel()
    async with send, receive, anyio.create_task_group() as tg:
        request_republish(send, Republish("start", tuple(want)))
        await tg.start(
            functools.partial(slice_publisher.run, kube, NODE, receive, settings=settings, **kwargs)
        )
        yield send
        tg.cancel_scope.cancel()


def ours(api: FakeApiServer, node: str = NODE) -> list[dict[str, Any]]:
    return api.resource_slices(driver="dra.cpu", node_name=node)


def published_names(api: FakeApiServer) -> list[str]:
    return sorted(d["name"] for s in ours(api) for d in s["spec"]["devices"])


def generations(api: FakeApiServer) -> set[int]:
    return {s["spec"]["pool"]["generation"] for s in ours(api)}


def writes(api: FakeApiServer) -> list[str]:
    """The slice writes so far: ``POST`` (a create) or ``PUT <name>`` / ``DELETE <name>``."""
    return [
        "POST" if r.method == "POST" else f"{r.method} {r.path.rsplit('/', 1)[-1]}"
        for r in api.requests
        if r.method in ("POST", "PUT", "DELETE") and "resourceslices" in r.path
    ]


async def until(condition: Callable[[], bool], what: str, seconds: float = 15.0) -> None:
    with anyio.move_on_after(seconds):
        while not condition():  # noqa: ASYNC110 (polling the fake server's state)
            await anyio.sleep(0.01)
        return
    pytest.fail(f"timed out waiting for: {what}")


async def settled(api: FakeApiServer, quiet: float = 0.3) -> None:
    """Wait until no request reached the server for ``quiet`` seconds."""
    with anyio.fail_after(15):
        while True:
            count = len(api.requests)
            await anyio.sleep(quiet)
            if len(api.requests) == count and api.open_watches == 1:
                return


def expected_pool(api: FakeApiServer, want: Sequence[Device]) -> None:
    slices = ours(api)
    assert validate_pool(slices) == []
    assert published_names(api) == sorted(d.name for d in want)
    for obj in slices:
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE_UID, "controller": True}
        ]


# --- publishing -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_first_publish_happens_before_started() -> None:
    want = devices()
    async with connected() as (api, kube), publishing(kube, want):
        slices = ours(api)  # right after started(): no waiting
        assert [s["metadata"]["name"] for s in slices] == [slice_name(NODE, 0)]
        expected_pool(api, want)
        assert generations(api) == {1}
        capacity = slices[0]["spec"]["devices"][0]["capacity"]["dra.cpu/cpu"]
        assert capacity["requestPolicy"] == {
            "default": capacity["value"],  # the whole group, as without a policy
            "validRange": {"min": "1", "step": "1"},
        }
        assert slices[0]["spec"]["devices"][0]["allowMultipleAllocations"] is True
        assert "nodeAllocatableResources" not in slices[0]["spec"]["devices"][0]


@pytest.mark.anyio
async def test_slice_options_reach_the_published_slices() -> None:
    want = devices(CpuDeviceMode.INDIVIDUAL, topology_name="big-1024")
    options = SliceOptions(node_allocatable=True, expose_pcie_roots=True)
    async with connected() as (api, kube), publishing(kube, want, options=options):
        slices = ours(api)
        assert [len(s["spec"]["devices"]) for s in slices] == [64] * 16
        for device in slices[0]["spec"]["devices"]:
            mapping = device["nodeAllocatableResources"]["cpu"]["mapping"]
            assert mapping == {"deviceMultiplier": "1"}


@pytest.mark.anyio
async def test_300_cpus_individual_mode_give_three_slices() -> None:
    spec = MachineSpec(sockets=2, cores_per_cluster=75, threads_per_core=2)
    want = devices(CpuDeviceMode.INDIVIDUAL, spec=spec)
    assert len(want) == 300
    async with connected() as (api, kube), publishing(kube, want):
        slices = ours(api)
        assert [s["metadata"]["name"] for s in slices] == [slice_name(NODE, i) for i in range(3)]
        assert [len(s["spec"]["devices"]) for s in slices] == [128, 128, 44]
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {3}
        expected_pool(api, want)


@pytest.mark.anyio
async def test_nothing_is_written_while_nothing_changes() -> None:
    async with connected() as (api, kube), publishing(kube, devices()):
        await settled(api)
        before = writes(api)
        assert before == ["POST"]
        await anyio.sleep(0.3)
        assert writes(api) == before


# --- repairs ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_slices_wiped_by_a_kubelet_restart_come_back() -> None:
    spec = MachineSpec(sockets=2, cores_per_cluster=75, threads_per_core=2)
    want = devices(CpuDeviceMode.INDIVIDUAL, spec=spec)
    async with connected() as (api, kube), publishing(kube, want):
        await settled(api)
        assert len(api.kubelet_restart(NODE)) == 3
        assert ours(api) == []
        await until(lambda: len(ours(api)) == 3, "slices republished")
        expected_pool(api, want)
        assert generations(api) == {1}  # same content, same generation


@pytest.mark.anyio
async def test_someone_elses_edit_is_repaired() -> None:
    want = devices()
    async with connected() as (api, kube), publishing(kube, want):
        await settled(api)
        original = ours(api)[0]["spec"]
        name = slice_name(NODE, 0)

        def tamper(obj: dict[str, Any]) -> None:
            obj["spec"]["devices"][0]["attributes"]["dra.cpu/numCPUs"] = {"int": 999}

        api.edit_resource_slice(name, tamper)
        await until(lambda: ours(api)[0]["spec"] == original, "edit reverted")

        api.edit_resource_slice(name, lambda o: o["metadata"].setdefault("labels", {"x": "y"}))
        await settled(api)
        assert ours(api)[0]["metadata"]["labels"] == {"x": "y"}  # not our business
        assert writes(api).count(f"PUT {name}") == 1


@pytest.mark.anyio
async def test_other_drivers_and_nodes_are_untouched_and_our_stale_slices_go() -> None:
    async with connected() as (api, kube):
        gpu = api.create_resource_slice(foreign_slice("gpu-a", driver="gpu.example.com", node=NODE))
        other_node = api.create_resource_slice(
            foreign_slice("node-b-dra.cpu-000", driver="dra.cpu", node="node-b", generation=9)
        )
        # Ours from before: an extra index and an upstream-style generated name.
        api.create_resource_slice(foreign_slice(slice_name(NODE, 4), driver="dra.cpu", node=NODE))
        api.create_resource_slice(
            foreign_slice("node-a-dra.cpu-x7k2p", driver="dra.cpu", node=NODE)
        )
        want = devices()
        async with publishing(kube, want):
            assert [s["metadata"]["name"] for s in ours(api)] == [slice_name(NODE, 0)]
            expected_pool(api, want)
            assert generations(api) == {2}  # above the stale slices' generation 1
            await settled(api)
            # A slice of ours appearing later is removed too.
            api.create_resource_slice(foreign_slice("intruder", driver="dra.cpu", node=NODE))
            await until(lambda: len(ours(api)) == 1, "intruder deleted")
            assert api.resource_slices(driver="gpu.example.com") == [gpu]
            assert ours(api, "node-b") == [other_node]


@pytest.mark.anyio
async def test_server_errors_and_dropped_connections_are_retried() -> None:
    async with connected() as (api, kube):
        api.fail_next(2, status=500, method="GET", path="/nodes/")
        api.fail_next(3, status=None, method="POST")
        api.fail_next(2, status=409, method="POST")
        api.fail_next(1, status=503, method="GET", path="resourceslices")
        want = devices()
        async with publishing(kube, want):
            await until(lambda: len(ours(api)) == 1, "published after retries")
            expected_pool(api, want)
            assert api.pending_faults() == 0


@pytest.mark.anyio
async def test_started_even_while_the_api_server_fails_then_publishes() -> None:
    async with connected() as (api, kube):
        api.fail_next(10_000, status=503)
        want = devices()
        async with publishing(kube, want):
            assert ours(api) == []  # started() came although nothing could be published
            await anyio.sleep(0.2)
            api.clear_faults()
            await until(lambda: len(ours(api)) == 1, "published once the server is back")
            expected_pool(api, want)


@pytest.mark.anyio
async def test_the_health_flag_says_whether_the_slices_are_published(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dracpu")
    async with connected() as (api, kube):
        flag = ReadinessFlag("slices", reason="no ResourceSlice is published yet")
        api.fail_next(10_000, status=503, path="resourceslices")
        want = devices()
        async with publishing(kube, want, health=flag):
            # Started (the kubelet is served), but /readyz says the slices are not published.
            assert flag.reason.startswith("publishing ResourceSlices fails: ")
            assert "503" in flag.reason
            api.clear_faults()
            await until(lambda: flag.ready, "ready once a pass stored the slices")
            expected_pool(api, want)
            # A conflict is relisted at once: not a reason to say the node is not ready.
            await settled(api)
            original = ours(api)[0]["spec"]
            api.fail_next(1, status=409, method="PUT")

            def tamper(obj: dict[str, Any]) -> None:
                obj["spec"]["devices"][0]["attributes"]["dra.cpu/numCPUs"] = {"int": 999}

            api.edit_resource_slice(slice_name(NODE, 0), tamper)  # the next pass repairs it
            await until(lambda: ours(api)[0]["spec"] == original, "edit reverted")
            assert api.pending_faults() == 0  # the first repair met the conflict
            assert flag.ready
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("task slices")]
    assert [m.split(":")[0] for m in said] == ["task slices is not ready", "task slices is ready"]


def failed_slice_lists(api: FakeApiServer, status: int) -> int:
    """The ResourceSlice lists (not watches) the server answered with ``status``."""
    return sum(
        1
        for r in api.requests
        if r.method == "GET"
        and r.path.endswith("/resourceslices")
        and not r.watch
        and r.status == status
    )


@pytest.mark.anyio
async def test_after_an_outage_any_request_that_works_ends_both_waits() -> None:
    # The outage: the watch is cut and the slices vanish while the server is away; the
    # publisher and the watch both wait 60 s before their next attempt. When another task's
    # request (a Prepare's claim GET) works, both retry at once: the slices are back.
    want = devices()
    async with connected() as (api, kube), publishing(kube, want, settings=PATIENT) as send:
        await settled(api)
        api.fail_next(10_000, status=503)
        api.break_watches()
        api.kubelet_restart(NODE)
        request_republish(send, Republish("SIGHUP", tuple(want)))  # fails: it waits too
        await until(
            lambda: failed_slice_lists(api, 503) == 1 and api.open_watches == 0,
            "the pass and the watch failed",
        )
        await anyio.sleep(0.1)  # both now in their 60 s wait
        assert ours(api) == []
        api.clear_faults()
        await kube.get_node(NODE)  # another task's request works
        await until(lambda: len(ours(api)) == 1, "slices back", seconds=5.0)
        expected_pool(api, want)
        await until(lambda: api.open_watches == 1, "the watch is back", seconds=5.0)


@pytest.mark.anyio
async def test_an_error_the_server_answered_is_not_retried_on_another_success() -> None:
    # A 403 (RBAC) is not cured by the server answering someone else: the wait runs its course.
    async with connected() as (api, kube):
        api.fail_next(10_000, status=403, method="GET", path="resourceslices")
        async with publishing(kube, devices(), settings=PATIENT):
            assert failed_slice_lists(api, 403) == 1
            api.clear_faults()
            await kube.get_node(NODE)
            await anyio.sleep(0.5)
            assert failed_slice_lists(api, 403) == 1
            assert ours(api) == []


@pytest.mark.anyio
async def test_a_republish_request_ends_any_retry_wait() -> None:
    want = devices()
    async with connected() as (api, kube):
        api.fail_next(1, status=403, method="GET", path="resourceslices")
        async with publishing(kube, want, settings=PATIENT) as send:
            assert ours(api) == []
            # The administrator fixed RBAC and says so (SIGHUP: the same devices again).
            request_republish(send, Republish("SIGHUP", tuple(want)))
            await until(lambda: len(ours(api)) == 1, "published at once", seconds=5.0)
            expected_pool(api, want)


@pytest.mark.anyio
async def test_unavailable_and_refusing_servers_have_their_own_backoff() -> None:
    taken: list[tuple[str, float]] = []

    def recorded(kind: str, initial: float) -> Callable[[], Iterator[float]]:
        def delays() -> Iterator[float]:
            for delay in backoff_delays(initial=initial, cap=initial * 4, jitter=0.0):
                taken.append((kind, delay))
                yield delay

        return delays

    settings = PublisherSettings(
        debounce=0.01,
        backoff=recorded("answered", 0.02),
        unavailable_backoff=recorded("unavailable", 0.01),
    )
    async with connected() as (api, kube):
        # Creates fail (only the publish pass makes them; a dropped POST is never resent).
        for status in (503, None, 429, 403, 422, 500):
            api.fail_next(status=status, method="POST", path="resourceslices")
        async with publishing(kube, devices(), settings=settings):
            await until(lambda: len(ours(api)) == 1, "published after the failures")
    assert taken == [
        ("unavailable", 0.01),
        ("unavailable", 0.02),
        ("unavailable", 0.04),
        ("answered", 0.02),
        ("answered", 0.04),
        ("unavailable", 0.04),
    ]


@pytest.mark.anyio
async def test_an_outage_is_logged_once_and_its_end_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="dracpu.tasks.slice_publisher")
    async with connected() as (api, kube):
        api.fail_next(20, status=503, method="GET", path="resourceslices", watch=False)
        async with publishing(kube, devices()):
            await until(lambda: len(ours(api)) == 1, "published after the outage")
            await settled(api)
    # The publish pass and the watch's relist share the 20 failures; each says its outage
    # once and its end once, the repeats go to DEBUG.
    mine = [r for r in caplog.records if r.name == "dracpu.tasks.slice_publisher"]
    loud = [(r.levelname, r.getMessage()) for r in mine if r.levelno >= logging.INFO]
    failed = [m for level, m in loud if level == "WARNING"]
    recovered = [m for level, m in loud if "works again" in m]
    assert len(loud) == len(failed) + len(recovered) + 1, loud  # + "published ..."
    assert failed[0].startswith("publishing ResourceSlices failed, retrying in 0.0 s: list ")
    assert failed[0].endswith("answered 503 Service Unavailable: injected failure")
    assert [m.split(" failed")[0] for m in failed] in (
        ["publishing ResourceSlices"],
        ["publishing ResourceSlices", "watching ResourceSlices"],
    )
    # The watch's end of the outage shows with its first event, which may not come: at most one.
    assert [m.split(" works")[0] for m in recovered] in (
        ["publishing ResourceSlices"],
        ["publishing ResourceSlices", "watching ResourceSlices"],
        ["watching ResourceSlices", "publishing ResourceSlices"],
    )
    quiet = [r for r in mine if "failed again" in r.getMessage()]
    assert all(r.levelno == logging.DEBUG for r in quiet)
    assert len(quiet) + len(failed) == 20


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("healthy_after", "expected"),
    [(120.0, [0.01, 0.02, 0.04, 0.04, 0.04]), (0.0, [0.01, 0.01, 0.01, 0.01, 0.01])],
)
async def test_a_watch_that_keeps_failing_backs_off_although_each_relist_works(
    monkeypatch: pytest.MonkeyPatch, healthy_after: float, expected: list[float]
) -> None:
    # Each watch attempt lists first (one LISTED event), then its watch request fails. The
    # listing must not count as a recovery, or the delay never grows and a watch that keeps
    # failing (no 'watch' permission, a proxy cutting long requests) lists every 0.5 s forever.
    # Only a watch that ran for _WATCH_BACKOFF_RESET seconds starts the backoff over.
    monkeypatch.setattr(slice_publisher, "_WATCH_BACKOFF_RESET", healthy_after)
    taken: list[float] = []

    def recorded_backoff() -> Iterator[float]:
        for delay in backoff_delays(initial=0.01, cap=0.04, jitter=0.0):
            taken.append(delay)
            yield delay

    settings = PublisherSettings(debounce=0.01, backoff=recorded_backoff)
    async with connected() as (api, kube):
        api.fail_next(10_000, status=403, watch=True)
        async with publishing(kube, devices(), settings=settings):
            await until(lambda: len(taken) >= 5, "five watch retries")
    assert taken[:5] == expected


# --- generation, changes, fallback --------------------------------------------------------------


@pytest.mark.anyio
async def test_generation_increases_across_restarts_and_changes() -> None:
    async with connected() as (api, kube):
        async with publishing(kube, devices()):
            assert generations(api) == {1}
        async with publishing(kube, devices()):
            assert generations(api) == {2}  # a restart never goes backwards
        async with publishing(kube, devices()) as send:
            await until(lambda: generations(api) == {3}, "published from the request")
            await settled(api)
            request_republish(send, Republish("SIGHUP", tuple(devices(reserved="0-3"))))
            await until(lambda: generations(api) == {4}, "a change bumps the generation")
            capacities = [
                d["capacity"]["dra.cpu/cpu"]["value"] for d in ours(api)[0]["spec"]["devices"]
            ]
            assert capacities == ["12", "16", "16", "16"]


@pytest.mark.anyio
async def test_a_higher_foreign_generation_is_overtaken() -> None:
    async with connected() as (api, kube), publishing(kube, devices()):
        await settled(api)
        api.edit_resource_slice(
            slice_name(NODE, 0), lambda o: o["spec"]["pool"].update(generation=41)
        )
        await until(lambda: generations(api) == {42}, "generation above the foreign one")


@pytest.mark.anyio
async def test_a_republish_request_brings_the_devices() -> None:
    async with connected() as (api, kube), publishing(kube, devices()) as send:
        await settled(api)
        individual = devices(CpuDeviceMode.INDIVIDUAL)
        request_republish(send, Republish("SIGHUP", tuple(individual)))
        await until(lambda: len(published_names(api)) == 64, "individual devices published")
        expected_pool(api, individual)
        assert generations(api) == {2}


@pytest.mark.anyio
async def test_a_republish_request_does_not_wait_for_the_debounce() -> None:
    # A kubelet wipe (one DELETE per slice) waits out the debounce; a republish request (one per
    # SIGHUP) is one event and goes out at once.
    slow = dataclasses.replace(FAST, debounce=60.0)
    async with connected() as (api, kube), publishing(kube, devices(), settings=slow) as send:
        individual = devices(CpuDeviceMode.INDIVIDUAL)
        request_republish(send, Republish("SIGHUP", tuple(individual)))
        await until(lambda: len(published_names(api)) == 64, "republished", seconds=10.0)


@pytest.mark.anyio
async def test_cluster_without_consumable_capacity_gets_the_fallback() -> None:
    async with (
        connected(consumable_capacity=False) as (api, kube),
        publishing(kube, devices()),
    ):
        await settled(api)
        slices = ours(api)
        assert slices[0]["spec"]["devices"]  # the loop below must check something
        for device in slices[0]["spec"]["devices"]:
            assert "allowMultipleAllocations" not in device
            assert "requestPolicy" not in device["capacity"]["dra.cpu/cpu"]
        assert generations(api) == {2}  # republished without requestPolicy
        before = writes(api)
        assert before == ["POST", f"PUT {slice_name(NODE, 0)}"]
        api.kubelet_restart(NODE)
        await until(lambda: len(ours(api)) == 1, "republished after a wipe")
        await settled(api)
        assert writes(api)[len(before) :] == ["POST"]  # once, no loop
