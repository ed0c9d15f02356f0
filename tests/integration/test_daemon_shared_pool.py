"""A claim whose containers also run on the shared pool (``cpuConfig.sharedPool: true``), on the
real ``dracpu run`` with the fake runtime: the CDI env names the claim's CPUs first and then the
pool, and the container's cpuset is the claim's CPUs plus the shared pool through a shrink
(another claim prepared and its container created) and a widen (that claim unprepared), and
after a restart of the daemon."""

from __future__ import annotations

import dataclasses

import pytest

from dracpu.sim._pb2.nri.v1alpha1 import api_pb2 as nri
from dracpu.sim.node import NodeSim, open_node_sim, wait_until
from tests.integration.conftest import checkpoint_claims, cpus, node_cpus
from tests.integration.test_daemon_claim_config import cpu_config

pytestmark = pytest.mark.anyio


def _cpus_of(sim: NodeSim, container_id: str) -> set[int]:
    return cpus(sim.runtime.containers[container_id].cpus)


async def test_the_claims_container_follows_the_shared_pool() -> None:
    async with open_node_sim(shared_containers=1, runtime_version="2.4.0") as sim:
        everything = node_cpus(sim)  # no reserved CPU: the pool is every CPU no claim holds
        await sim.wait_published()
        mixed = sim.allocate("mixed", 2, configs=[cpu_config(sharedPool=True)])
        assert (await sim.prepare(mixed))[mixed.uid].error == ""
        held = cpus(sim.cdi_cpus(mixed.uid) or "")
        assert len(held) == 2
        # the env: the claim's CPUs first, then the entry that says the pool is shared too
        assert sim.cdi_env(mixed.uid) == [
            f"DRA_CPUSET_{mixed.uid}={sim.cdi_cpus(mixed.uid)}",
            f"DRA_SHARED_POOL_{mixed.uid}=true",
        ]
        assert checkpoint_claims(sim.paths.checkpoint)[mixed.uid]["sharedPool"] is True

        _, container = await sim.run_container("mixed", claims=[mixed])
        assert list(container.env[-2:]) == sim.cdi_env(mixed.uid)
        assert _cpus_of(sim, container.id) == everything  # its 2 CPUs plus the other 62
        (shared,) = sim.shared_ids(exclude=[container.id])
        assert _cpus_of(sim, shared) == everything - held

        # shrink: another claim (on its CPUs alone) is prepared and its container created
        other = sim.allocate("other", 4, device="cpudevnuma001")
        assert (await sim.prepare(other))[other.uid].error == ""
        taken = cpus(sim.cdi_cpus(other.uid) or "")
        pod, exclusive = await sim.run_container("other", claims=[other])
        assert cpus(exclusive.cpus) == taken
        assert _cpus_of(sim, container.id) == everything - taken
        assert _cpus_of(sim, container.id) >= held
        assert _cpus_of(sim, shared) == everything - taken - held

        # widen: that claim's pod ends and the kubelet unprepares it
        await sim.remove_pod(pod)
        assert await sim.unprepare(other) == {other.uid: ""}
        await wait_until(
            "the shared-pool claim's container widened",
            lambda: _cpus_of(sim, container.id) == everything,
            failed=sim.daemon.exited,
        )
        assert _cpus_of(sim, shared) == everything - held

        # a restart: the checkpoint keeps the claim's sharedPool, Synchronize pins it again
        # (the runtime's table is put at the claim's CPUs alone meanwhile)
        await sim.stop_daemon()
        sim.runtime.containers[container.id] = dataclasses.replace(
            sim.runtime.containers[container.id], cpus=sim.cdi_cpus(mixed.uid) or ""
        )
        await sim.start_daemon()
        await sim.runtime.wait_plugin(20)
        reply = sim.runtime.calls("Synchronize")[-1].response
        assert isinstance(reply, nri.SynchronizeResponse)
        pins = {u.container_id: u.linux.resources.cpu.cpus for u in reply.update}
        assert cpus(pins[container.id]) == everything
        assert _cpus_of(sim, container.id) == everything
        assert sim.cdi_env(mixed.uid)[1] == f"DRA_SHARED_POOL_{mixed.uid}=true"
        assert sim.daemon.messages("error") == []
