"""Per-claim opaque configuration (``cpuConfig``) on the real daemon: the CPUs each field gives
on the ``dual-socket-smt2`` machine (siblings cpuN and cpuN+32; NUMA node n = cores 8n..8n+7,
in two L3 caches of four cores), an explicit cpuset in machine mode, memory pinning through NRI,
and a bad config failing its claim alone."""

from __future__ import annotations

from typing import Any

import pytest

from dracpu.sim.node import NodeSim, SimClaim, open_node_sim
from tests.integration.conftest import checkpoint_claims, cpus

pytestmark = pytest.mark.anyio


def cpu_config(
    source: str = "FromClaim", requests: tuple[str, ...] = ("cpus",), **fields: object
) -> dict[str, Any]:
    """A ``status.allocation.devices.config`` entry of ours with these ``cpuConfig`` fields."""
    return {
        "source": source,
        "requests": list(requests),
        "opaque": {
            "driver": "dra.cpu",
            "parameters": {"apiVersion": "v1alpha1", "cpuConfig": fields},
        },
    }


async def prepared(sim: NodeSim, claim: SimClaim) -> set[int]:
    answer = (await sim.prepare(claim))[claim.uid]
    assert answer.error == ""
    return cpus(sim.cdi_cpus(claim.uid) or "")


def sibling(cpu: int) -> int:
    return cpu + 32 if cpu < 32 else cpu - 32


def cores(held: set[int]) -> set[int]:
    """The physical cores of ``held``, by their lower CPU id."""
    return {min(cpu, sibling(cpu)) for cpu in held}


def l3_of(cpu: int) -> int:
    return (cpu % 32) // 4


async def test_policy_and_full_cores_choose_the_cpus_they_say() -> None:
    async with open_node_sim() as sim:
        await sim.wait_published()
        # An explicit cpuset in NUMA mode (an external allocator's): one thread of each core of
        # the first L3 of NUMA nodes 0 and 1.
        first = sim.allocate("first", 4, device="cpudevnuma000", configs=[cpu_config(cpuset="0-3")])
        assert await prepared(sim, first) == {0, 1, 2, 3}
        second = sim.allocate(
            "second", 4, device="cpudevnuma001", configs=[cpu_config(cpuset="8-11")]
        )
        assert await prepared(sim, second) == {8, 9, 10, 11}

        # packed fills the half-used cores first: the other threads of cores 0-3.
        packed = sim.allocate(
            "packed", 4, device="cpudevnuma000", configs=[cpu_config(policy="packed")]
        )
        assert await prepared(sim, packed) == {32, 33, 34, 35}

        # fullCores, on the same free layout of NUMA node 1: whole cores only, so none of the
        # half-used cores 8-11; two whole cores of the other L3.
        full = sim.allocate("full", 4, device="cpudevnuma001", configs=[cpu_config(fullCores=True)])
        held = await prepared(sim, full)
        assert len(held) == 4
        assert {sibling(cpu) for cpu in held} == held  # whole cores
        assert cores(held).isdisjoint({8, 9, 10, 11})
        assert {l3_of(cpu) for cpu in held} == {3}  # cpus 12-15 and 44-47

        # spread on a free NUMA node: four cores, one thread each, in one L3 ...
        spread = sim.allocate(
            "spread", 4, device="cpudevnuma002", configs=[cpu_config(policy="spread")]
        )
        held = await prepared(sim, spread)
        assert len(cores(held)) == 4
        assert len({l3_of(cpu) for cpu in held}) == 1
        # ... where the node's default (packed) takes two whole cores. A DeviceClass asks for
        # spread; the claim's own config wins whatever the order of the entries.
        overridden = sim.allocate(
            "overridden",
            4,
            device="cpudevnuma003",
            configs=[
                cpu_config(policy="packed"),
                cpu_config("FromClass", policy="spread"),
            ],
        )
        held = await prepared(sim, overridden)
        assert len(cores(held)) == 2
        assert {sibling(cpu) for cpu in held} == held

        # The kubelet retries: the same answer.
        assert await prepared(sim, spread) == cpus(sim.cdi_cpus(spread.uid) or "")
        assert await prepared(sim, first) == {0, 1, 2, 3}


async def test_machine_mode_takes_the_cpuset_and_refuses_one_that_is_taken() -> None:
    async with open_node_sim(group_by="machine", reserved="0-1") as sim:
        (device,) = await sim.wait_published()
        assert device["name"] == "cpudevmachine"
        first = sim.allocate("first", 4, configs=[cpu_config(cpuset="4-7")])
        assert await prepared(sim, first) == {4, 5, 6, 7}

        taken = sim.allocate("taken", 4, configs=[cpu_config(cpuset="6-9")])
        reserved = sim.allocate("reserved", 4, configs=[cpu_config(cpuset="0-3")])
        size = sim.allocate("size", 2, configs=[cpu_config(cpuset="10-12")])
        answers = await sim.prepare(taken, reserved, size)
        assert f"cpus 6-7 of cpuset 6-9 are already prepared for claim {first.uid}" in (
            answers[taken.uid].error
        )
        assert "cpuset 0-3: cpus 0-1 are reserved (--reserved-cpus)" in (
            answers[reserved.uid].error
        )
        assert "cpuset 10-12 has 3 CPUs, the claim consumes 2" in answers[size.uid].error
        assert sim.cdi_claims() == [first.uid]

        # Without a cpuset dracpu picks (upstream would refuse the claim in machine mode).
        picked = sim.allocate("picked", 2)
        held = await prepared(sim, picked)
        assert len(held) == 2
        assert held.isdisjoint({0, 1, 4, 5, 6, 7})

        # A restart, then the kubelet's retry: the cpuset is the same, from the checkpoint.
        await sim.restart_daemon()
        assert await prepared(sim, first) == {4, 5, 6, 7}
        assert cpus(checkpoint_claims(sim.paths.checkpoint)[first.uid]["cpus"]) == {4, 5, 6, 7}


@pytest.mark.parametrize(
    ("node_default", "asked", "mems"), [(False, "pin", "2"), (True, "none", "")]
)
async def test_memory_pinning_of_one_claim(node_default: bool, asked: str, mems: str) -> None:
    async with open_node_sim(memory_pinning=node_default) as sim:
        await sim.wait_published()
        configured = sim.allocate(
            "configured", 2, device="cpudevnuma002", configs=[cpu_config(memory=asked)]
        )
        plain = sim.allocate("plain", 2, device="cpudevnuma001")
        answers = await sim.prepare(configured, plain)
        assert [answers[c.uid].error for c in (configured, plain)] == ["", ""]
        _, container = await sim.run_container("configured", claims=[configured])
        assert cpus(container.cpus) == cpus(sim.cdi_cpus(configured.uid) or "")
        assert container.mems == mems  # what the runtime applied (NRI adjustment)
        _, other = await sim.run_container("plain", claims=[plain])
        assert other.mems == ("1" if node_default else "")  # the node's default


async def test_a_bad_config_fails_its_claim_and_the_other_claim_is_prepared() -> None:
    async with open_node_sim() as sim:
        await sim.wait_published()
        bad = sim.allocate("bad", 2, configs=[cpu_config(policy="dense")])
        typo = sim.allocate("typo", 2, configs=[cpu_config(polcy="spread")])
        good = sim.allocate("good", 2, configs=[cpu_config(policy="spread")])
        answers = await sim.prepare(bad, typo, good)
        assert answers[bad.uid].error == (
            "claim default/bad: opaque config [0] cpuConfig.policy: 'dense' is not one of "
            "packed, spread"
        )
        assert answers[typo.uid].error.startswith(
            "claim default/typo: opaque config [0] cpuConfig.polcy: unknown field"
        )
        assert answers[bad.uid].devices == answers[typo.uid].devices == ()
        assert answers[good.uid].error == ""
        assert sim.cdi_claims() == [good.uid]
        assert set(checkpoint_claims(sim.paths.checkpoint)) == {good.uid}
        assert len(cores(cpus(sim.cdi_cpus(good.uid) or ""))) == 2
