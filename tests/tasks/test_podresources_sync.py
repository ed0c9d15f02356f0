"""The pod-resources sync task.

Its loop (when it lists, how it waits out failures, what it tells the owner, logs and counts)
needs only anyio: those tests run on asyncio and trio with a lister of their own and a
hand-driven owner. With the real client (grpclib) against the grpcio fake of the kubelet's
socket and a real state owner, on asyncio: an orphan released after the grace while a referenced
claim stays, an adopted orphan released by the first List, a missing socket and the kubelet's
rate limit waited out, a kubelet that cannot show claims releasing nothing.
"""

from __future__ import annotations

import itertools
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

import anyio
import anyio.abc
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu.adapters.pod_resources import ClaimUser, PodResourcesClient, PodResourcesListing
from dracpu.config import Config
from dracpu.config.values import MIN_PODRESOURCES_INTERVAL
from dracpu.core.cdi_spec import device_id, spec_bytes, spec_file_name
from dracpu.core.commands import Command, DeviceResult, PodsListed, PrepareClaim, Synchronize
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import ClaimPrepared, PodsReconciled, ReleasedClaim
from dracpu.errors import DracpuError, PodResourcesError
from dracpu.sim.fake_podresources import (
    CachedClaim,
    ClaimDevice,
    KubeletPods,
    PodResourcesServer,
)
from dracpu.tasks import podresources_sync
from dracpu.tasks.podresources_sync import ListTrigger, PodResourcesStatus
from dracpu.tasks.state_owner import Request, StateOwner, create_request_stream, request
from tests.fixtures import scratch_dir
from tests.tasks.both_backends import anyio_backend  # noqa: F401 (a fixture)
from tests.tasks.owner_files import host_root

pytestmark = pytest.mark.anyio

U1 = str(uuid.UUID(int=1, version=4))
U2 = str(uuid.UUID(int=2, version=4))
NODE = "node-a"


async def until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:  # noqa: ASYNC109
    with anyio.move_on_after(timeout):
        while not predicate():  # noqa: ASYNC110 (polls state that has no event of its own)
            await anyio.sleep(0.005)
        return
    raise AssertionError(f"timed out waiting for {what}")


def listing(*uids: str, references: int | None = None) -> PodResourcesListing:
    users = {uid: (ClaimUser("ns", f"pod-{uid[-1]}", "app"),) for uid in uids}
    return PodResourcesListing(
        by_uid=MappingProxyType(users),
        by_name=MappingProxyType({("ns", "named"): (ClaimUser("ns", "p", "c"),)}),
        pods=len(uids),
        dynamic_resources=len(uids) + 1 if references is None else references,
    )


# --- the loop, on both backends ------------------------------------------------------------------


@dataclass
class Kubelet:
    """A lister of our own: answers (or raises) what the test queued, the last answer again."""

    answers: list[PodResourcesListing | PodResourcesError] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    last: PodResourcesListing = field(default_factory=listing)

    async def list(self) -> PodResourcesListing:
        self.times.append(anyio.current_time())
        answer = self.answers.pop(0) if self.answers else self.last
        if isinstance(answer, PodResourcesError):
            raise answer
        self.last = answer
        return answer


@dataclass
class Owner:
    """A hand-driven owner: records the commands, answers ``reply(command)``."""

    reply: Callable[[PodsListed], object] = lambda _: PodsReconciled((), (), True)
    commands: list[PodsListed] = field(default_factory=list)

    async def serve(self, receive: MemoryObjectReceiveStream[Request[Command]]) -> None:
        async for req in receive:
            assert isinstance(req.command, PodsListed)
            self.commands.append(req.command)
            with req.reply:
                req.reply.send_nowait(self.reply(req.command))


@asynccontextmanager
async def running(
    kubelet: Kubelet,
    owner: Owner,
    *,
    interval: float,
    grace: float = 300.0,
    clock: Callable[[], float] | None = None,
    delays: Callable[[], Iterator[float]] = podresources_sync.retry_delays,
    kubelet_version: podresources_sync.VersionReader | None = None,
) -> AsyncIterator[tuple[ListTrigger, PodResourcesStatus]]:
    send: MemoryObjectSendStream[Request[Command]]
    send, receive = create_request_stream()
    trigger, status = ListTrigger(), PodResourcesStatus()
    async with send, receive, anyio.create_task_group() as tg:
        tg.start_soon(owner.serve, receive)
        await tg.start(
            lambda task_status: podresources_sync.run(
                send.clone(),
                kubelet.list,
                interval=interval,
                grace=grace,
                trigger=trigger,
                status=status,
                clock=clock or anyio.current_time,
                delays=delays,
                kubelet_version=kubelet_version,
                task_status=task_status,
            )
        )
        yield trigger, status
        tg.cancel_scope.cancel()


async def test_lists_at_start_then_every_interval_and_tells_the_owner() -> None:
    kubelet, owner = Kubelet([listing(U1)]), Owner()
    ticks = iter(range(1000, 2000, 10))
    async with running(kubelet, owner, interval=0.1, grace=90.0, clock=lambda: next(ticks)) as (
        _,
        status,
    ):
        await until(lambda: len(owner.commands) >= 3, "three listings")
    first = owner.commands[0]
    assert first == PodsListed(
        frozenset({U1}), frozenset({("ns", "named")}), reports_claims=True, at=1000, grace=90.0
    )
    assert [c.at for c in owner.commands[:3]] == [1000, 1010, 1020]
    assert status.listing == listing(U1)  # who holds what, for whoever asks
    gaps = [b - a for a, b in itertools.pairwise(kubelet.times)]
    assert all(0.09 <= gap < 5.0 for gap in gaps[:2]), gaps


async def test_interval_zero_lists_only_at_start_and_on_request_at_most_every_100ms() -> None:
    kubelet, owner = Kubelet(), Owner()
    async with running(kubelet, owner, interval=0) as (trigger, _):
        await until(lambda: len(kubelet.times) == 1, "the List at start")
        await anyio.sleep(0.3)
        assert len(kubelet.times) == 1
        trigger.request()  # SIGHUP
        await until(lambda: len(kubelet.times) == 2, "the List on request")
        for _ in range(5):  # a burst of SIGHUPs: at most one List per 100 ms
            trigger.request()
        await until(lambda: len(kubelet.times) == 3, "one more List")
        await anyio.sleep(0.3)
        assert len(kubelet.times) == 3
    gaps = [b - a for a, b in itertools.pairwise(kubelet.times)]
    assert all(gap >= MIN_PODRESOURCES_INTERVAL * 0.99 for gap in gaps), gaps


async def test_a_request_during_a_list_is_kept_for_after_it() -> None:
    kubelet, owner = Kubelet(), Owner()
    entered, gate = anyio.Event(), anyio.Event()

    async def slow_list() -> PodResourcesListing:
        kubelet.times.append(anyio.current_time())
        if len(kubelet.times) == 1:
            entered.set()
            await gate.wait()
        return listing()

    kubelet.list = slow_list  # type: ignore[method-assign]
    async with running(kubelet, owner, interval=0) as (trigger, _):
        await entered.wait()
        trigger.request()
        gate.set()
        await until(lambda: len(kubelet.times) == 2, "the List asked for during the first")


async def test_failures_back_off_and_a_request_ends_the_wait_but_not_after_rate_limiting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="dracpu")
    missing = PodResourcesError("cannot connect to /k/kubelet.sock: No such file or directory")
    limited = PodResourcesError("rejected by rate limit", code="RESOURCE_EXHAUSTED")
    kubelet = Kubelet([missing, missing, missing, limited, limited])
    owner = Owner()
    waits = iter([0.2, 0.2, 60.0, 0.3, 0.6])  # the third wait is long: a request ends it
    async with running(kubelet, owner, interval=60, delays=lambda: waits) as (trigger, status):
        await until(lambda: len(kubelet.times) == 3, "three failed Lists")
        assert 0.19 <= kubelet.times[1] - kubelet.times[0] < 5.0
        assert status.lists["error"] == 3
        assert not status.working
        assert status.last_error == str(missing)
        trigger.request()  # SIGHUP: try now
        await until(lambda: len(kubelet.times) == 4, "the List on request")
        trigger.request()  # ... but not while the kubelet's rate limit says wait
        await until(lambda: len(kubelet.times) == 6, "the Lists after rate limiting")
        await until(lambda: status.working, "a List that works")
        await anyio.sleep(0.3)
        assert len(kubelet.times) == 6  # that List answered the request: none more
    assert kubelet.times[4] - kubelet.times[3] >= 0.29
    assert kubelet.times[5] - kubelet.times[4] >= 0.59
    assert status.lists == {"error": 3, "rate_limited": 2, "ok": 1}
    retries = [r for r in caplog.records if r.getMessage().startswith("PodResources List")]
    loud = [(r.levelname, r.getMessage()) for r in retries if r.levelno >= logging.INFO]
    assert loud[:2] == [
        ("WARNING", f"PodResources List failed, retrying in 0.2 s: {missing}"),
        ("WARNING", f"PodResources List failed, retrying in 0.3 s: {limited}"),
    ]
    assert len(loud) == 3
    assert loud[2][0] == "INFO"
    assert loud[2][1].startswith("PodResources List works again after 5 failed attempts over ")
    assert len(owner.commands) == 1  # only the answer that came reached the owner


async def test_released_claims_are_logged_by_name_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dracpu")
    gone = (
        ReleasedClaim(U1, CpuSet.parse("4-5"), "shop", "cpus", False, 100.0),
        ReleasedClaim(U2, CpuSet.parse("9"), "", "", True, 400.0),
    )
    answers = iter([PodsReconciled((), (U1,), True), PodsReconciled(gone, (), True)])
    owner = Owner(lambda _: next(answers, PodsReconciled((), (), True)))
    ticks = iter([100.0, 400.0, 700.0, 1000.0])
    async with running(Kubelet(), owner, interval=0.1, clock=lambda: next(ticks, 1e4)) as (
        _,
        status,
    ):
        await until(lambda: status.released == 2, "two released")
    released = [
        (r.levelname, r.getMessage(), getattr(r, "claim_uid", None))
        for r in caplog.records
        if "released orphan claim" in r.getMessage()
    ]
    assert released == [
        (
            "WARNING",
            f"released orphan claim {U1} (shop/cpus, cpus 4-5): no pod on the node references "
            "it in the kubelet's PodResources and no running container uses it (missing from "
            "the listings for 300 s); its CDI spec is deleted and its CPUs are back in the "
            "shared pool",
            U1,
        ),
        (
            "WARNING",
            f"released orphan claim {U2} (name unknown, cpus 9): no pod on the node references "
            "it in the kubelet's PodResources and no running container uses it (known only "
            "from its CDI spec: one listing after the runtime's Synchronize is enough); its CDI "
            "spec is deleted and its CPUs are back in the shared pool",
            U2,
        ),
    ]


async def test_an_answer_without_claims_is_said_once_and_the_owner_still_hears_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dracpu")
    blind = listing(references=0)
    kubelet, owner = Kubelet([blind, blind, blind, listing(U1)]), Owner()
    async with running(kubelet, owner, interval=0.1) as (_, status):
        await until(lambda: len(owner.commands) >= 3, "three listings")
        assert not status.working
        assert status.answered
        await until(lambda: status.working, "an answer with claims")
    assert [c.reports_claims for c in owner.commands[:4]] == [False, False, False, True]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("PodResources:")]
    assert len(said) == 2
    assert "shows no DRA claim at all" in said[0]
    assert "KubeletPodResourcesDynamicResources gate is off" in said[0]
    assert said[1].startswith("PodResources: the kubelet lists 1 pods with 2 claim references")
    assert status.lists["no_claims"] == 3


@dataclass
class Versions:
    """The Node's kubelet version as the API server answers it, one answer per read."""

    answers: list[str | DracpuError]
    reads: int = 0

    async def read(self) -> str:
        self.reads += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, DracpuError):
            raise answer
        return answer


async def test_the_kubelets_version_says_whether_an_answer_without_claims_is_its_word(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dracpu")
    quiet = replace(listing(references=0), active=frozenset({("ns", "web-0")}))
    down = PodResourcesError("cannot connect to kubelet.sock: Connection refused")
    kubelet = Kubelet([quiet, quiet, quiet, down, quiet, listing(U1), quiet, quiet])
    versions = Versions([DracpuError("503 Service Unavailable"), "v1.33.2", "v1.34.0"])
    owner = Owner()
    async with running(
        kubelet, owner, interval=0.1, delays=lambda: iter([0.0] * 9), kubelet_version=versions.read
    ) as (_, status):
        await until(lambda: len(owner.commands) >= 7, "seven listings")
    # Read when an answer without claims needs it: again after a failed read, not after a
    # successful one until a List fails (the kubelet may come back as another version).
    assert [c.authoritative for c in owner.commands[:7]] == [
        False,  # the read failed
        False,  # v1.33.2
        False,
        True,  # after the failed List: v1.34.0
        True,  # an answer with claims: no read
        True,
        True,
    ]
    assert versions.reads == 3
    assert all(c.pods == {("ns", "web-0")} for c in owner.commands if not c.reports_claims)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("PodResources:")]
    assert said[0] == (
        "PodResources: cannot read the kubelet's version from the Node (tried again at the "
        "next listing without claims): 503 Service Unavailable"
    )
    assert "(kubelet version unknown)" in said[1]
    assert said[2] == "PodResources: the kubelet's version is read again: v1.33.2"
    assert "(kubelet version v1.33.2)" in said[3]
    assert "kubelet v1.34.0 has its KubeletPodResourcesDynamicResources gate on" in said[4]
    assert said[5].startswith("PodResources: the kubelet lists 1 pods with 2 claim references")
    assert "kubelet v1.34.0 has its" in said[6]
    assert len(said) == 7
    assert status.kubelet_version == "v1.34.0"
    assert status.working


async def test_an_owner_that_refuses_a_listing_does_not_end_the_task() -> None:
    owner = Owner(lambda _: DracpuError("checkpoint: No space left on device"))
    async with running(Kubelet(), owner, interval=0.1) as (_, status):
        await until(lambda: len(owner.commands) >= 2, "two listings")
        assert status.answered


async def test_a_list_trigger_waits_until_asked() -> None:
    trigger = ListTrigger()
    with anyio.move_on_after(0.05) as scope:
        assert not await trigger.wait(math.inf)
    assert scope.cancelled_caught
    trigger.request()
    with anyio.fail_after(1):
        assert await trigger.wait(math.inf)  # pending: at once
    assert not await trigger.wait(0.01)


# --- the real client and the grpcio kubelet, with a real state owner (asyncio: grpclib) ----------


@dataclass
class Node:
    owner: StateOwner
    send: MemoryObjectSendStream[Request[Command]]
    pods: KubeletPods
    server: PodResourcesServer
    config: Config
    tg: anyio.abc.TaskGroup
    status: PodResourcesStatus = field(default_factory=PodResourcesStatus)
    trigger: ListTrigger = field(default_factory=ListTrigger)

    async def prepare(self, uid: str, name: str, cpus: str) -> CpuSet:
        """Prepare a grouped claim of these CPUs (NUMA node 0) and put it in the kubelet's
        claim cache, as a successful Prepare does."""
        chosen = CpuSet.parse(cpus)
        result = DeviceResult("cpus", NODE, "cpudevnuma000", len(chosen), chosen)
        prepared = await request(self.send, PrepareClaim(uid, "ns", name, (result,)))
        assert isinstance(prepared, ClaimPrepared)
        device = ClaimDevice(NODE, "cpudevnuma000", (device_id(uid),))
        self.pods.claim_prepared(CachedClaim("ns", name, uid, "dra.cpu", (device,)))
        return prepared.cpus

    async def start_sync(self, *, interval: float, grace: float) -> None:
        client = PodResourcesClient(self.server.socket)

        async def sync(task_status: anyio.abc.TaskStatus[None]) -> None:
            with client:
                await podresources_sync.run(
                    self.send.clone(),
                    client.list,
                    interval=interval,
                    grace=grace,
                    trigger=self.trigger,
                    status=self.status,
                    delays=lambda: iter([0.2, 0.4, 0.8, 1.6, 1.6, 1.6, 1.6]),
                    task_status=task_status,
                )

        await self.tg.start(sync)


@asynccontextmanager
async def open_node(
    *, adopt: dict[str, str] | None = None, serve: bool = True
) -> AsyncIterator[Node]:
    send: MemoryObjectSendStream[Request[Command]]
    send, receive = create_request_stream()
    with scratch_dir("dracpu-podres-") as tmp:
        config = Config(
            node_name=NODE,
            host_root=host_root("dual-socket-smt2"),
            reserved_cpus=CpuSet.parse("0,32"),
            cdi_dir=tmp / "cdi",
            state_dir=tmp / "state",
            kubelet_root_dir=tmp / "kubelet",
        )
        config.cdi_dir.mkdir()
        for uid, cpus in (adopt or {}).items():  # specs of ours the checkpoint lacks
            (config.cdi_dir / spec_file_name(uid)).write_bytes(spec_bytes(uid, CpuSet.parse(cpus)))
        owner = StateOwner(config, receive)
        pods = KubeletPods()
        server = PodResourcesServer(config.pod_resources_socket, pods)
        if serve:
            server.start()
        try:
            async with send, anyio.create_task_group() as tg:
                await tg.start(owner.run)
                yield Node(owner, send, pods, server, config, tg)
                tg.cancel_scope.cancel()
        finally:
            server.stop()


def cdi_specs(node: Node) -> set[str]:
    """The claims' CDI specs (not the device metadata's, which sit beside them)."""
    names = (p.name for p in Path(node.config.cdi_dir).iterdir())
    return {name for name in names if name.startswith("dra.k8s.io-cpu_claim-")}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_orphan_goes_after_the_grace_and_a_referenced_claim_stays() -> None:
    async with open_node() as node:
        await request(node.send, Synchronize(()))  # the runtime: no container running
        await node.prepare(U1, "keeper", "1-2")
        await node.prepare(U2, "orphan", "3-4")
        node.pods.add_pod("ns", "keeper-pod", {"app": [U1]})
        node.pods.add_pod("ns", "orphan-pod", {"app": [U2]})
        await node.start_sync(interval=0.1, grace=0.5)
        await until(lambda: node.status.lists["ok"] >= 2, "two listings")
        assert set(node.owner.state.claims) == {U1, U2}

        node.pods.remove_pod("ns", "orphan-pod")  # gone without Unprepare
        gone_at = anyio.current_time()
        await until(lambda: U2 not in node.owner.state.claims, "the orphan released")
        assert anyio.current_time() - gone_at >= 0.5  # not before the grace
        await until(lambda: node.status.released == 1, "the release counted")
        assert set(node.owner.state.claims) == {U1}
        assert node.owner.state.shared_pool >= CpuSet.parse("3-4")
        assert cdi_specs(node) == {spec_file_name(U1)}
        # The keeper stays, however long: its pod references it.
        await anyio.sleep(0.7)
        assert set(node.owner.state.claims) == {U1}
        assert node.server.answered("RESOURCE_EXHAUSTED") == 0  # within the kubelet's limit


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_adopted_orphan_goes_at_the_first_list_after_synchronize() -> None:
    async with open_node(adopt={U1: "1-2", U2: "9-10"}) as node:
        assert set(node.owner.state.claims) == {U1, U2}  # adopted at start
        # U1 is the kubelet's: a pod references it; nobody references U2.
        node.pods.claim_prepared(
            CachedClaim(
                "ns", "live", U1, "dra.cpu", (ClaimDevice(NODE, "cpudevnuma000", (device_id(U1),)),)
            )
        )
        node.pods.add_pod("ns", "live-pod", {"app": [U1]})
        await request(node.send, Synchronize(()))
        await node.start_sync(interval=3600, grace=3600)  # only the List at start
        await until(lambda: U2 not in node.owner.state.claims, "the adopted orphan released")
        assert len(node.server.calls) == 1
        assert set(node.owner.state.claims) == {U1}
        assert cdi_specs(node) == {spec_file_name(U1)}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_missing_socket_is_retried_without_end_and_then_used() -> None:
    async with open_node(adopt={U2: "9-10"}, serve=False) as node:
        await request(node.send, Synchronize(()))
        node.pods.add_pod("ns", "other", {"app": [U1]})
        node.pods.claim_prepared(
            CachedClaim("ns", "gpu", U1, "gpu.example.com", (ClaimDevice(NODE, "g0", ()),))
        )
        await node.start_sync(interval=3600, grace=3600)
        await until(lambda: node.status.lists["error"] >= 2, "two failed Lists")
        assert "No such file or directory" in node.status.last_error
        assert U2 in node.owner.state.claims
        node.server.start()  # the kubelet comes (back)
        await until(lambda: U2 not in node.owner.state.claims, "the orphan released")
        assert node.status.working


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_resource_exhausted_backs_off() -> None:
    async with open_node() as node:
        node.server.fail("RESOURCE_EXHAUSTED", times=3)
        await node.start_sync(interval=3600, grace=3600)
        await until(lambda: node.server.answered("OK") == 1, "a List that works")
        # The server counts its answer when it sends it; the task counts it once read.
        await until(lambda: node.status.lists["no_claims"] == 1, "the answer read")
        calls = node.server.calls
        assert [c.code for c in calls] == ["RESOURCE_EXHAUSTED"] * 3 + ["OK"]
        gaps = [b.at - a.at for a, b in itertools.pairwise(calls)]
        assert gaps[0] >= 0.19
        assert gaps[1] >= 0.39
        assert gaps[2] >= 0.79
        assert node.status.lists == {"rate_limited": 3, "no_claims": 1}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_kubelet_that_cannot_show_claims_releases_nothing() -> None:
    async with open_node(adopt={U2: "9-10"}) as node:
        await request(node.send, Synchronize(()))
        await node.prepare(U1, "orphan", "3-4")  # its pod is gone; no pod holds any claim
        node.pods.add_pod("ns", "plain", {"app": []})
        node.server.dynamic_resources = False  # and the gate is off
        await node.start_sync(interval=0.1, grace=0.1)
        await until(lambda: node.status.lists["no_claims"] >= 5, "five listings")
        assert set(node.owner.state.claims) == {U1, U2}
        assert not node.status.working
        assert node.status.released == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_malformed_answer_releases_nothing() -> None:
    async with open_node(adopt={U2: "9-10"}) as node:
        await request(node.send, Synchronize(()))
        node.server.answer = lambda: bytes.fromhex("08 01")  # pod_resources as a varint
        await node.start_sync(interval=0.1, grace=0.1)
        await until(lambda: node.status.lists["error"] >= 2, "two refused answers")
        assert "malformed" in node.status.last_error
        assert U2 in node.owner.state.claims
