"""Issue 5 on the real daemon: containers pinned through NRI by a fake runtime that frames its
messages with code of its own: the claim's container gets exactly the claim's CPUs, shared
containers shrink and widen again, a runtime restart is survived."""

from __future__ import annotations

import dataclasses
import signal

import anyio
import pytest

from dracpu.sim._pb2.nri.v1alpha1 import api_pb2 as nri
from dracpu.sim.fake_runtime import FakePod, PluginFailedError, claim_env
from dracpu.sim.node import NodeSim, SimClaim, open_node_sim, wait_until
from tests.integration.conftest import checkpoint_claims, cpus, node_cpus

pytestmark = pytest.mark.anyio


def _shared(sim: NodeSim) -> dict[str, set[int]]:
    return {cid: cpus(sim.cpus_of(cid)) for cid in sim.shared_ids()}


async def _reserved_claim(sim: NodeSim) -> tuple[FakePod, SimClaim, str]:
    """A pod, a claim of 4 CPUs reserved for it (status.reservedFor), prepared; its CPUs."""
    await sim.wait_published()
    pod = sim.runtime.add_pod("rightful")
    claim = sim.allocate("exclusive", 4, reserved_for=[pod])
    assert (await sim.prepare(claim))[claim.uid].error == ""
    held = sim.cdi_cpus(claim.uid)
    assert held is not None
    return pod, claim, held


def _claim_gets(sim: NodeSim, name: str) -> list[str]:
    """The GETs of a ResourceClaim the API server answered (Prepare's, and the fresh looks)."""
    return [
        r.path
        for r in sim.api.requests
        if r.method == "GET" and r.path.endswith(f"/resourceclaims/{name}")
    ]


def _unsolicited(sim: NodeSim) -> int:
    return len(sim.runtime.calls("UpdateContainers", caller="plugin"))


async def test_a_claims_container_gets_its_cpus_and_shared_ones_shrink_then_widen() -> None:
    async with open_node_sim(shared_containers=3, runtime_version="2.4.0") as sim:
        everything = node_cpus(sim)
        # Synchronize pinned the containers that ran before the daemon to the whole pool.
        assert _shared(sim) == dict.fromkeys(sim.shared_ids(), everything)

        await sim.wait_published()
        claim = sim.allocate("exclusive", 4)
        assert (await sim.prepare(claim))[claim.uid].error == ""
        held = cpus(sim.cdi_cpus(claim.uid) or "")
        pod, container = await sim.run_container("app", claims=[claim])
        assert dict(container.env_map)[f"DRA_CPUSET_{claim.uid}"] == sim.cdi_cpus(claim.uid)
        assert cpus(container.cpus) == held
        assert _shared(sim) == dict.fromkeys(sim.shared_ids(), everything - held)

        # A shared container created now gets the shared pool as well.
        _, late = await sim.run_container("late")
        assert cpus(late.cpus) == everything - held

        # The pod ends, the kubelet unprepares: with NRI v0.12.2 the shared containers are
        # widened at once by an unsolicited UpdateContainers.
        await sim.remove_pod(pod)
        assert await sim.unprepare(claim) == {claim.uid: ""}
        await wait_until(
            "the shared containers to be widened",
            lambda: _shared(sim) == dict.fromkeys(sim.shared_ids(), everything),
            failed=sim.daemon.exited,
        )
        assert _unsolicited(sim) >= 1
        assert sim.daemon.messages("error") == []


async def test_an_old_runtime_widens_shared_containers_at_the_next_event() -> None:
    # containerd 2.2 embeds NRI v0.10: unsolicited updates could deadlock it, so none are sent.
    async with open_node_sim(shared_containers=2, runtime_version="2.2.0") as sim:
        everything = node_cpus(sim)
        await sim.wait_published()
        claim = sim.allocate("exclusive", 8)
        assert (await sim.prepare(claim))[claim.uid].error == ""
        held = cpus(sim.cdi_cpus(claim.uid) or "")
        pod, container = await sim.run_container("app", claims=[claim])
        assert cpus(container.cpus) == held
        assert _shared(sim) == dict.fromkeys(sim.shared_ids(), everything - held)

        await sim.remove_pod(pod)
        assert await sim.unprepare(claim) == {claim.uid: ""}
        # Nothing is pushed: the shared containers keep the narrow pool for now ...
        assert _unsolicited(sim) == 0
        assert _shared(sim) == dict.fromkeys(sim.shared_ids(), everything - held)
        # ... until the next container event, whose reply widens every one of them.
        _, late = await sim.run_container("late")
        assert cpus(late.cpus) == everything
        assert _shared(sim) == dict.fromkeys(sim.shared_ids(), everything)
        assert _unsolicited(sim) == 0


async def test_a_spoofed_claim_env_fails_the_container_creation() -> None:
    async with open_node_sim(shared_containers=1) as sim:
        await sim.wait_published()
        claim = sim.allocate("real", 2)
        assert (await sim.prepare(claim))[claim.uid].error == ""
        real = sim.cdi_cpus(claim.uid)
        pod = sim.runtime.add_pod("spoof")
        wrong = "0-63" if real != "0-63" else "0-1"
        spoofed = sim.runtime.new_container(pod, "main", env=[claim_env(claim.uid, wrong)])
        with pytest.raises(PluginFailedError, match="spoofed DRA_CPUSET env"):
            await sim.runtime.create_container(pod, spoofed)
        assert spoofed.id not in sim.runtime.containers
        # The honest container of the claim still gets it.
        _, honest = await sim.run_container("honest", claims=[claim])
        assert honest.cpus == real


async def test_a_runtime_restart_reconnects_and_resyncs_every_container() -> None:
    async with open_node_sim(shared_containers=2, memory_pinning=True) as sim:
        everything = node_cpus(sim)
        await sim.wait_published()
        claim = sim.allocate("exclusive", 4, device="cpudevnuma002")
        assert (await sim.prepare(claim))[claim.uid].error == ""
        held = cpus(sim.cdi_cpus(claim.uid) or "")
        _, container = await sim.run_container("app", claims=[claim])
        assert cpus(container.cpus) == held
        assert container.mems == "2"  # memory pinned to the claim's NUMA node
        first = sim.runtime.plugin
        assert first is not None

        # While the runtime is down, its containers drift (someone reset their cpusets).
        for cid, record in list(sim.runtime.containers.items()):
            sim.runtime.containers[cid] = dataclasses.replace(record, cpus="0-63", mems="")
        await sim.runtime.restart(downtime=0.2)
        info = await sim.runtime.wait_plugin(20)
        assert info.connection == first.connection + 1

        # Synchronize re-pinned every container: the claim's and the shared ones.
        assert cpus(sim.cpus_of(container.id)) == held
        assert sim.runtime.containers[container.id].mems == "2"
        assert _shared(sim) == dict.fromkeys(sim.shared_ids(), everything - held)
        assert any(
            m.startswith("NRI: connection to ") and "reconnecting" in m
            for m in sim.daemon.messages("warning")
        )
        # Containers are still pinned at creation after the reconnect.
        _, late = await sim.run_container("late")
        assert cpus(late.cpus) == everything - held


async def test_a_copied_claim_env_is_refused_confined_and_the_claims_own_container_pinned() -> None:
    """Tried against containerd 2.3.4: a second pod that copied the exact DRA_CPUSET env of a
    prepared claim, before the claim's own container started, was pinned to the claim's CPUs and
    the rightful container refused. The claim belongs to the pods its status.reservedFor names."""
    async with open_node_sim(shared_containers=1, extra_args=["--v=4"]) as sim:
        everything = node_cpus(sim)
        rightful, claim, held = await _reserved_claim(sim)
        copied = sim.cdi_env(claim.uid)  # DRA_CPUSET_<uid>=<cpus>, exactly

        # CreateContainer of the copier's container fails, naming the claim and the pod.
        copier = sim.runtime.add_pod("copier")
        await sim.runtime.run_pod_sandbox(copier)
        thief = sim.runtime.new_container(copier, "thief", env=copied)
        with pytest.raises(PluginFailedError) as caught:
            await sim.runtime.create_container(copier, thief)
        assert f"not reserved for pod {copier.uid}" in str(caught.value)
        assert f"claim default/exclusive ({claim.uid})" in str(caught.value)
        assert thief.id not in sim.runtime.containers

        # The copier's container appeared while the daemon was away: Synchronize confines it
        # (the look at the refusal noted the pod as a copier: said at DEBUG this time).
        await sim.stop_daemon()
        sim.runtime.add_container(copier, "thief", container_id="a-thief", env=copied, cpus=held)
        await sim.start_daemon()
        await sim.runtime.wait_plugin(20)
        pool = everything - cpus(held)
        assert cpus(sim.cpus_of("a-thief")) == pool
        assert any(
            "a-thief confined to the shared pool" in m and f"not reserved for pod {copier.uid}" in m
            for m in sim.daemon.messages("debug")
        )

        # The claim's own container is then pinned to the claim's CPUs.
        _, own = await sim.run_container("rightful", claims=[claim], pod=rightful)
        assert own.cpus == held
        assert _shared(sim) == dict.fromkeys(sim.shared_ids(), pool)
        assert cpus(sim.cpus_of("a-thief")) == pool
        assert sim.daemon.messages("error") == []


async def test_a_container_confined_for_a_copied_env_is_warned_about_once() -> None:
    """Seen against containerd: a container confined at Synchronize for a copied env was warned
    about, and its claim read from the API server, at every start of dracpu for as long as it
    ran. The look that confirms the copy notes the pod on the claim, in the checkpoint."""
    async with open_node_sim(shared_containers=1, extra_args=["--v=4"]) as sim:
        everything = node_cpus(sim)
        _, claim, held = await _reserved_claim(sim)
        pool = everything - cpus(held)
        looks = len(_claim_gets(sim, claim.name))  # Prepare's

        # A pod that copied the claim's env starts while dracpu is down.
        await sim.stop_daemon()
        copier = sim.runtime.add_pod("copier")
        sim.runtime.add_container(
            copier, "thief", container_id="a-thief", env=sim.cdi_env(claim.uid), cpus=held
        )
        for start in range(3):
            await sim.start_daemon()
            await sim.runtime.wait_plugin(20)
            assert cpus(sim.cpus_of("a-thief")) == pool
            warned = [m for m in sim.daemon.messages("warning") if "a-thief" in m]
            assert len(warned) == (1 if start == 0 else 0), warned
            if start == 0:
                assert f"not reserved for pod {copier.uid}" in warned[0]
            assert any("a-thief confined" in m for m in sim.daemon.messages("debug")) == (start > 0)
            assert len(_claim_gets(sim, claim.name)) == looks + 1  # one look, at the first start
            await sim.stop_daemon()
        assert checkpoint_claims(sim.paths.checkpoint)[claim.uid]["copierPods"] == [copier.uid]


async def test_the_containers_of_a_claims_pods_share_its_cpus_and_another_pod_is_refused() -> None:
    """Kubernetes lets every container of a pod name the pod's claims: an init container and
    the app, a sidecar and the app, and the pods a shared claim is reserved for. Each gets the
    claim's CPUs (exclusive to the claim, shared among its containers); a pod the claim is not
    reserved for is refused."""
    async with open_node_sim(shared_containers=1) as sim:
        everything = node_cpus(sim)
        await sim.wait_published()
        web = sim.runtime.add_pod("web")
        batch = sim.runtime.add_pod("batch")
        claim = sim.allocate("shared", 4, reserved_for=[web, batch])
        assert (await sim.prepare(claim))[claim.uid].error == ""
        held = cpus(sim.cdi_cpus(claim.uid) or "")

        # The init container runs on the claim's CPUs and exits; its use ends with it.
        _, init = await sim.run_container("web", "init", claims=[claim], pod=web)
        assert cpus(init.cpus) == held
        await sim.runtime.stop_container(init.id)
        # A sidecar (a restartable init container), then the app, then the other pod's worker.
        users = [
            (await sim.run_container("web", "sidecar", claims=[claim], pod=web))[1],
            (await sim.run_container("web", "app", claims=[claim], pod=web))[1],
            (await sim.run_container("batch", "worker", claims=[claim], pod=batch))[1],
        ]
        assert {c.id: cpus(sim.cpus_of(c.id)) for c in users} == dict.fromkeys(
            (c.id for c in users), held
        )
        assert _shared(sim) == dict.fromkeys(sim.shared_ids(), everything - held)

        # A pod the claim is not reserved for, showing the claim's exact env, is refused.
        stranger = sim.runtime.add_pod("stranger")
        await sim.runtime.run_pod_sandbox(stranger)
        thief = sim.runtime.new_container(stranger, "app", env=sim.cdi_env(claim.uid))
        with pytest.raises(PluginFailedError, match=f"not reserved for pod {stranger.uid}"):
            await sim.runtime.create_container(stranger, thief)

        # After a restart, Synchronize keeps every one of them on the claim's CPUs.
        await sim.restart_daemon()
        await sim.runtime.wait_plugin(20)
        assert {c.id: cpus(sim.cpus_of(c.id)) for c in users} == dict.fromkeys(
            (c.id for c in users), held
        )
        assert not any("confined" in m for m in sim.daemon.messages("warning"))
        assert all(d.messages("error") == [] for d in sim.daemons)


async def test_after_a_restart_synchronize_moves_shared_containers_before_narrowing() -> None:
    """Against containerd 2.3.4 an exclusive container was narrowed onto its CPUs about 120 ms
    before a shared container the runtime had put there while dracpu was down was moved off:
    the Synchronize reply's updates went in container-ID order. The runtime applies them in
    the reply's order, so every shared container must come first."""
    async with open_node_sim(shared_containers=1) as sim:
        everything = node_cpus(sim)
        await sim.wait_published()
        claim = sim.allocate("exclusive", 4)
        assert (await sim.prepare(claim))[claim.uid].error == ""
        held = cpus(sim.cdi_cpus(claim.uid) or "")
        _, exclusive = await sim.run_container("app", claims=[claim])

        # While the daemon is down, a pod starts unpinned (every CPU, the claim's too), and the
        # exclusive container's cpuset is reset: both need repairs at Synchronize.
        await sim.stop_daemon()
        late = sim.shared_container("late", cpus="0-63")
        assert late.id > exclusive.id  # container-ID order would narrow the exclusive first
        sim.runtime.containers[exclusive.id] = dataclasses.replace(
            sim.runtime.containers[exclusive.id], cpus="0-63"
        )
        await sim.start_daemon()
        await sim.runtime.wait_plugin(20)

        answered = [c.response for c in sim.runtime.calls("Synchronize")]
        reply = answered[-1]
        assert isinstance(reply, nri.SynchronizeResponse)
        order = [u.container_id for u in reply.update]
        shared = set(sim.shared_ids())
        assert set(order) == shared | {exclusive.id}
        assert order.index(exclusive.id) == len(order) - 1  # after every shared container
        assert cpus(sim.cpus_of(late.id)) == everything - held
        assert cpus(sim.cpus_of(exclusive.id)) == held


async def test_sigterm_right_after_an_unprepare_still_widens_the_shared_containers() -> None:
    """Tried against containerd 2.4 with unsolicited updates on: a SIGTERM 1 ms after an
    Unprepare cancelled the updates in flight and left the shared containers narrow until the
    next start. The NRI plugin now stops after the DRA socket and sends what is queued first."""
    async with open_node_sim(shared_containers=6, extra_args=["-v=1"]) as sim:
        everything = node_cpus(sim)
        await sim.wait_published()
        claim = sim.allocate("exclusive", 8)
        assert (await sim.prepare(claim))[claim.uid].error == ""
        pod, _ = await sim.run_container("app", claims=[claim])
        await sim.remove_pod(pod)
        narrow = everything - cpus(sim.cdi_cpus(claim.uid) or "")
        assert _shared(sim) == dict.fromkeys(sim.shared_ids(), narrow)

        # The runtime is busy with a long event: the widening waits for its lock.
        async with sim.runtime.busy():
            assert await sim.unprepare(claim) == {claim.uid: ""}
            sim.daemon.process.send_signal(signal.SIGTERM)
            await anyio.sleep(0.5)
        with anyio.fail_after(5):
            assert await sim.daemon.process.wait() == 0

        assert [c.outcome for c in sim.runtime.calls("UpdateContainers", caller="plugin")] == ["ok"]
        assert _shared(sim) == dict.fromkeys(sim.shared_ids(), everything)
        stopped = [m for m in sim.daemon.messages() if m.startswith("task ") and "stopped" in m]
        assert stopped.index("task nri-plugin stopped") > stopped.index(
            "task kubelet-plugin stopped"
        )
        assert stopped.index("task nri-plugin stopped") > stopped.index("task registration stopped")
        assert "NRI: every update and answer in flight reached the runtime; disconnecting" in (
            sim.daemon.messages()
        )


@pytest.mark.parametrize("version", ["2.4.0", "2.2.0"])
async def test_a_shared_container_starting_while_a_claim_narrows_the_pool_leaves_its_cpus(
    version: str,
) -> None:
    """docs/architecture.md, "What the real components found", item 5: containerd loses the
    update of a container whose task exists but that is not RUNNING yet (the fake runtime does
    too). The claim's container's reply narrows the starting shared container in vain; after its
    start dracpu sends the pin again: at once where the runtime takes unsolicited updates
    (containerd 2.4), else in the next reply (containerd 2.2, NRI v0.10)."""
    async with open_node_sim(runtime_version=version) as sim:
        everything = node_cpus(sim)
        await sim.wait_published()
        pod = sim.runtime.add_pod("starting")
        await sim.runtime.run_pod_sandbox(pod)
        starting = sim.runtime.new_container(pod, "app")
        await sim.runtime.create_container(pod, starting)
        assert cpus(sim.cpus_of(starting.id)) == everything
        sim.runtime.create_task(starting.id)  # StartContainer has begun: runc made the cgroup

        claim = sim.allocate("exclusive", 4)
        assert (await sim.prepare(claim))[claim.uid].error == ""
        held = cpus(sim.cdi_cpus(claim.uid) or "")
        _, container = await sim.run_container("app", claims=[claim])
        assert cpus(container.cpus) == held
        assert [n.detail for n in sim.runtime.notes("update-lost")] == [
            f"{starting.id}: starting, not running yet"
        ]
        assert cpus(sim.cpus_of(starting.id)) == everything  # on the claim's CPUs

        await sim.runtime.start_container(starting.id)
        if version == "2.4.0":
            await wait_until(
                "the started container to leave the claim's CPUs",
                lambda: cpus(sim.cpus_of(starting.id)) == everything - held,
                failed=sim.daemon.exited,
            )
            assert _unsolicited(sim) == 1
        else:
            assert cpus(sim.cpus_of(starting.id)) == everything  # nothing unsolicited
            await sim.run_container("next")
            assert cpus(sim.cpus_of(starting.id)) == everything - held
            assert _unsolicited(sim) == 0
        assert _shared(sim) == dict.fromkeys(sim.shared_ids(), everything - held)
        assert sim.daemon.messages("error") == []
