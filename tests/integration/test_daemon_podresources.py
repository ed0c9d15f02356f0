"""PodResources reconciliation in the real daemon process, with the simulator's grpcio kubelet
serving ``List`` from the pods the simulation runs and the claims it prepared.

An adopted CDI spec of a claim no pod uses is released by the List at start (which comes after
NRI ``Synchronize``): its CPUs go back to the shared containers at once and can be allocated
from the published devices again. A claim whose pod went away without Unprepare is released
after the grace while a claim its pod references stays. On a quiet node (no pod holds a claim),
what an answer without claims means follows the kubelet's version, and nothing goes while the
runtime is away (its containers unknown). SIGHUP asks for a List; a kubelet without the socket
keeps the daemon ready and is used once it comes.
"""

from __future__ import annotations

import signal
import uuid

import anyio
import pytest

from dracpu.sim.fake_runtime import FakePod
from dracpu.sim.node import NodeSim, SimClaim, open_node_sim, wait_until
from tests.integration.conftest import checkpoint_claims, cpus, node_cpus

pytestmark = pytest.mark.anyio


async def _prepare(sim: NodeSim, claim: SimClaim) -> set[int]:
    answer = (await sim.prepare(claim))[claim.uid]
    assert answer.error == ""
    return cpus(sim.cdi_cpus(claim.uid) or "")


def _write_spec(sim: NodeSim, uid: str, cpu_list: str) -> None:
    """A CDI spec of ours (as the Go driver, or an earlier run, left it)."""
    sim.paths.cdi_spec(uid).write_text(
        '{"cdiVersion":"0.5.0","kind":"dra.k8s.io/cpu","devices":[{"name":"claim-'
        f'{uid}","containerEdits":{{"env":["DRA_CPUSET_{uid}={cpu_list}"]}}}}]}}'
    )


async def _lost_and_unknown(sim: NodeSim) -> tuple[FakePod, SimClaim, SimClaim]:
    """Two claims of 2 CPUs, prepared: ``lost``, reserved for a pod whose container runs, and
    ``unknown``, reserved for no pod."""
    pod = sim.runtime.add_pod("batch")
    lost = sim.allocate("lost", 2, device="cpudevnuma000", reserved_for=[pod])
    unknown = sim.allocate("unknown", 2, device="cpudevnuma001")
    await _prepare(sim, lost)
    await _prepare(sim, unknown)
    await sim.run_container("batch", claims=[lost], pod=pod)
    return pod, lost, unknown


async def _metric(sim: NodeSim, name: str) -> float | None:
    _, body = await sim.daemon.get("/metrics")
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    return None


async def _until_metric(sim: NodeSim, name: str, value: float, timeout: float = 10.0) -> None:  # noqa: ASYNC109
    with anyio.fail_after(timeout):
        while await _metric(sim, name) != value:  # noqa: ASYNC110 - polls the HTTP port
            await anyio.sleep(0.05)


async def test_an_adopted_spec_no_pod_uses_is_released_at_start() -> None:
    async with open_node_sim(shared_containers=2) as sim:
        everything = node_cpus(sim)
        numa1 = node_cpus(sim, numa=1)
        await sim.wait_published()
        keeper = sim.allocate("keeper", 4, device="cpudevnuma000")
        held = await _prepare(sim, keeper)
        _, app = await sim.run_container("keeper-pod", claims=[keeper])
        assert await sim.stop_daemon() == 0

        orphan = str(uuid.uuid4())  # a spec left behind: no pod on the node uses this claim
        _write_spec(sim, orphan, "8-9,40-41")
        await sim.start_daemon()

        # The List at start released it: at once, long before the next periodic List (60 s).
        def released_warnings() -> list[str]:
            return [m for m in sim.daemon.messages("warning") if "released orphan claim" in m]

        await wait_until("the release to be logged", lambda: bool(released_warnings()), timeout=10)
        assert sim.cdi_cpus(orphan) is None
        assert f"adopted 1 claims from CDI specs the checkpoint lacked: ['{orphan}']" in (
            sim.daemon.messages("warning")
        )
        assert released_warnings() == [
            f"released orphan claim {orphan} (name unknown, cpus 8-9,40-41): no pod on the "
            "node references it in the kubelet's PodResources and no running container uses "
            "it (known only from its CDI spec: one listing after the runtime's Synchronize is "
            "enough); its CDI spec is deleted and its CPUs are back in the shared pool"
        ]
        assert set(checkpoint_claims(sim.paths.checkpoint)) == {keeper.uid}
        assert sim.cdi_cpus(keeper.uid) is not None

        # Its CPUs are shared again (the runtime takes unsolicited updates: at once) ...
        def widened() -> bool:
            return all(cpus(sim.cpus_of(c)) == everything - held for c in sim.shared_ids())

        await wait_until("the shared containers to widen", widened, timeout=10)
        assert cpus(sim.cpus_of(app.id)) == held  # the keeper's container is left alone
        assert await _metric(sim, "dracpu_orphan_claims_released_total") == 1.0
        assert await _metric(sim, "dracpu_podresources_sync_working") == 1.0
        assert await _metric(sim, "dra_cpu_available_cpus") == float(len(everything - held))
        # ... and in the published devices' view: the whole of NUMA node 1 can be allocated
        # from its device and prepared, the released CPUs with it.
        [numa1_device] = [d for d in sim.published() if d["name"] == "cpudevnuma001"]
        assert numa1_device["capacity"]["dra.cpu/cpu"]["value"] == "16"
        whole = sim.allocate("whole-node-1", 16, device="cpudevnuma001")
        assert await _prepare(sim, whole) == numa1
        assert sim.daemon.messages("error") == []


async def test_a_claim_whose_pod_went_away_goes_after_the_grace_and_a_referenced_one_stays() -> (
    None
):
    flags = ["--podresources-interval=200ms", "--orphan-grace=1s"]
    async with open_node_sim(shared_containers=1, extra_args=flags) as sim:
        everything = node_cpus(sim)
        await sim.wait_published()
        keeper = sim.allocate("keeper", 2, device="cpudevnuma000")
        lost = sim.allocate("lost", 2, device="cpudevnuma001")
        kept = await _prepare(sim, keeper)
        freed = await _prepare(sim, lost)
        await sim.run_container("keeper-pod", claims=[keeper])
        lost_pod, _ = await sim.run_container("lost-pod", claims=[lost])
        await anyio.sleep(1.5)  # listings while both pods run: nothing goes
        assert sim.cdi_claims() == sorted([keeper.uid, lost.uid])

        # The pod ends; the kubelet never unprepares the claim. Its listings miss the claim from
        # the moment the kubelet drops the pod (the start of remove_pod) and its container is
        # gone: the grace is counted from before the call.
        gone = anyio.current_time()
        await sim.remove_pod(lost_pod)
        await wait_until("the orphan to go", lambda: sim.cdi_cpus(lost.uid) is None, timeout=10)
        assert anyio.current_time() - gone >= 1.0  # not before the grace
        # The spec goes first; the checkpoint follows, then the owner's answer and the log line.
        await wait_until(
            "the release to be logged",
            lambda: any(
                m.startswith(f"released orphan claim {lost.uid} (default/lost, cpus ")
                for m in sim.daemon.messages("warning")
            ),
            timeout=10,
        )
        assert set(checkpoint_claims(sim.paths.checkpoint)) == {keeper.uid}
        [shared] = sim.shared_ids()
        await wait_until(
            "the shared container to widen",
            lambda: cpus(sim.cpus_of(shared)) == everything - kept,
            timeout=10,
        )
        assert freed <= everything - kept
        await anyio.sleep(1.5)  # the keeper's pod still references it: it stays
        assert sim.cdi_claims() == [keeper.uid]
        # The kubelet's Unprepare, should it come after all, finds nothing to do.
        assert await sim.unprepare(lost) == {lost.uid: ""}
        server = sim.kubelet.pod_resources
        assert server is not None
        assert server.answered("RESOURCE_EXHAUSTED") == 0  # within the kubelet's rate limit
        assert server.answered("OK") >= 10


async def test_on_a_quiet_node_orphans_go_after_the_grace_when_the_kubelet_shows_claims() -> None:
    """No pod on the node holds a claim: the kubelet's answers show none. A kubelet of 1.34 or
    later lists claims by default (its Node says which version it is), so such an answer is
    taken at its word: a claim whose pod ended without Unprepare, one prepared for no known pod
    and a left-over CDI spec all go after the grace."""
    flags = ["--podresources-interval=200ms", "--orphan-grace=1s"]
    async with open_node_sim(shared_containers=1, extra_args=flags) as sim:
        everything = node_cpus(sim)
        await sim.wait_published()
        pod, lost, unknown = await _lost_and_unknown(sim)
        await sim.stop_daemon()
        leftover = str(uuid.uuid4())
        _write_spec(sim, leftover, "26-27")
        await sim.start_daemon()
        gone = anyio.current_time()  # before: the misses may begin inside remove_pod
        await sim.remove_pod(pod)  # the pod ends; the kubelet never unprepares its claim
        claims = {lost.uid, unknown.uid, leftover}

        await wait_until(
            "the orphans to go", lambda: not claims & set(sim.cdi_claims()), timeout=15
        )
        assert anyio.current_time() - gone >= 1.0  # not before the grace, the adopted spec too
        await wait_until(
            "the releases to be logged",
            lambda: len([m for m in sim.daemon.messages("warning") if "released orphan" in m]) == 3,
            timeout=10,
        )
        assert checkpoint_claims(sim.paths.checkpoint) == {}
        assert any(
            "shows no DRA claim (1 pods); kubelet v1.35.0 has its "
            "KubeletPodResourcesDynamicResources gate on by default" in m
            for m in sim.daemon.messages("info")
        )
        [shared] = sim.shared_ids()
        await wait_until(
            "the shared container to widen",
            lambda: cpus(sim.cpus_of(shared)) == everything,
            timeout=10,
        )
        assert await _metric(sim, "dracpu_podresources_sync_working") == 1.0
        node_gets = [r for r in sim.api.requests if r.method == "GET" and "/nodes/" in r.path]
        # Per daemon start (two): the publisher's owner reference and the kubelet's version,
        # once each, however many answers came without claims.
        assert len(node_gets) == 4
        assert sim.daemon.messages("error") == []


async def test_on_a_quiet_node_nothing_is_released_while_the_runtimes_containers_are_unknown() -> (
    None
):
    """The kubelet's answers show no claim and it is 1.35 (taken at its word), but the runtime
    went away: until its next ``Synchronize`` the daemon cannot see which containers carry a
    claim's env. Here one started unseen while the kubelet stopped listing its pod: listing
    after listing misses the claim and it stays; the runtime's ``Synchronize`` shows the
    container using it, so it still stays; once the pod has ended, it goes after the grace."""
    flags = ["--podresources-interval=200ms", "--orphan-grace=1s", "--v=4"]
    async with open_node_sim(shared_containers=1, extra_args=flags) as sim:
        everything = node_cpus(sim)
        await sim.wait_published()
        pod = sim.runtime.add_pod("batch", namespace="default")
        lost = sim.allocate("lost", 2, device="cpudevnuma000", reserved_for=[pod])
        held = await _prepare(sim, lost)
        sim.kubelet.pods.add_pod("default", "batch", {"main": [lost.uid]})
        await sim.runtime.go_away()
        await wait_until(
            "the state owner to learn that the runtime is gone",
            lambda: "RuntimeDisconnected applied (ok)" in sim.daemon.messages("debug"),
            failed=sim.daemon.exited,
        )
        # Unseen by the daemon: the pod's container starts on the claim's CPUs, and the
        # kubelet's listings no longer show the pod.
        await sim.runtime.run_pod_sandbox(pod)
        app = sim.runtime.add_container(
            pod, "main", env=sim.cdi_env(lost.uid), cpus=",".join(map(str, sorted(held)))
        )
        sim.kubelet.pods.remove_pod("default", "batch")
        server = sim.kubelet.pod_resources
        assert server is not None
        listed = len(server.calls)

        def past_twice_the_grace() -> bool:  # listings that missed it, 2 s apart at least
            since = server.calls[listed:]
            return len(since) >= 5 and since[-1].at - since[0].at >= 2.0

        await wait_until("listings past the grace", past_twice_the_grace, timeout=30)
        assert sim.cdi_claims() == [lost.uid]
        assert set(checkpoint_claims(sim.paths.checkpoint)) == {lost.uid}
        assert not any("released orphan" in m for m in sim.daemon.messages("warning"))

        # Back: Synchronize shows the container carrying the claim; it is kept and pinned.
        await sim.runtime.come_back()
        await sim.runtime.wait_plugin(20)
        listed = len(server.calls)
        await wait_until("five more listings", lambda: len(server.calls) >= listed + 5)
        assert sim.cdi_claims() == [lost.uid]
        assert cpus(sim.cpus_of(app.id)) == held
        [shared] = sim.shared_ids()
        assert cpus(sim.cpus_of(shared)) == everything - held

        # The pod ends: the claim goes after the grace and its CPUs are shared again.
        gone = anyio.current_time()
        await sim.remove_pod(pod)
        # Its spec and its checkpoint entry are two writes of one release, in either order.
        await wait_until(
            "the orphan to go",
            lambda: (
                lost.uid not in sim.cdi_claims() and not checkpoint_claims(sim.paths.checkpoint)
            ),
            timeout=15,
        )
        assert anyio.current_time() - gone >= 1.0
        await wait_until(
            "the shared container to widen",
            lambda: cpus(sim.cpus_of(shared)) == everything,
            timeout=10,
        )
        assert sim.daemon.messages("error") == []


async def test_before_1_34_only_claims_whose_pods_are_gone_are_released_from_empty_answers() -> (
    None
):
    """A kubelet older than 1.34 lists no claims unless its gate was turned on: an answer
    without any does not say that no pod holds one. Pods are listed all the same, so a claim
    whose recorded pods are all gone is an orphan; one whose pods are not known stays."""
    flags = ["--podresources-interval=200ms", "--orphan-grace=1s"]
    async with open_node_sim(kubelet_version="v1.33.4", extra_args=flags) as sim:
        await sim.wait_published()
        server = sim.kubelet.pod_resources
        assert server is not None
        server.dynamic_resources = False  # the gate is off: no claim is ever listed
        pod, lost, unknown = await _lost_and_unknown(sim)
        await anyio.sleep(1.5)  # its pod is listed (and its container runs): nothing goes
        assert set(sim.cdi_claims()) == {lost.uid, unknown.uid}

        gone = anyio.current_time()  # before: the misses may begin inside remove_pod
        await sim.remove_pod(pod)
        await wait_until("the orphan to go", lambda: lost.uid not in sim.cdi_claims(), timeout=15)
        assert anyio.current_time() - gone >= 1.0
        await wait_until(
            "the release to be logged",
            lambda: any(
                f"released orphan claim {lost.uid}" in m and "the pods it is reserved for" in m
                for m in sim.daemon.messages("warning")
            ),
            timeout=10,
        )
        await anyio.sleep(1.5)
        assert sim.cdi_claims() == [unknown.uid]  # cannot be judged: kept
        assert any(
            "either no pod holds one or its KubeletPodResourcesDynamicResources gate is off "
            "(kubelet version v1.33.4)" in m
            for m in sim.daemon.messages("info")
        )
        assert await _metric(sim, "dracpu_podresources_sync_working") == 0.0


async def test_sighup_asks_for_a_list() -> None:
    async with open_node_sim(extra_args=["--podresources-interval=0"]) as sim:
        server = sim.kubelet.pod_resources
        assert server is not None
        await wait_until("the List at start", lambda: len(server.calls) == 1, timeout=10)
        await anyio.sleep(0.5)
        assert len(server.calls) == 1  # no periodic List
        sim.daemon.process.send_signal(signal.SIGHUP)
        await wait_until("the List on SIGHUP", lambda: len(server.calls) == 2, timeout=10)


async def test_without_a_pod_resources_socket_the_daemon_stays_ready_and_uses_it_later() -> None:
    async with open_node_sim(pod_resources=False) as sim:
        assert (await sim.daemon.get("/readyz"))[0] == 200
        await _until_metric(sim, "dracpu_podresources_sync_working", 0.0)
        socket = sim.paths.kubelet_root / "pod-resources" / "kubelet.sock"
        await wait_until(
            "the retry warning",
            lambda: any(
                m.startswith("PodResources List failed, retrying in ")
                and m.endswith(f"cannot connect to {socket}: No such file or directory")
                for m in sim.daemon.messages("warning")
            ),
            timeout=10,
        )
        claim = sim.allocate("c", 2)
        await _prepare(sim, claim)
        await sim.run_container("pod", claims=[claim])
        sim.kubelet.serve_pod_resources()  # the kubelet (re)starts with its socket
        await _until_metric(sim, "dracpu_podresources_sync_working", 1.0, timeout=20)
        assert (await sim.daemon.get("/readyz"))[0] == 200
        assert sim.daemon.messages("error") == []
