"""SIGHUP on the real ``dracpu run``: the topology and the config file read again.

CPUs go offline in the simulated node's sysfs (:meth:`NodeSim.set_offline`, as the kernel's
hotplug changes the tree), then SIGHUP: the published ResourceSlices at the fake API server lose
the devices (individual mode) or the capacity (grouped mode) with a new pool generation, the
grpcio kubelet's health stream reports it, a claim holding an offline CPU keeps its record, CDI
spec and cpuset and is reported unhealthy, shared containers move to the new pool. A change of
a structural key in the config file is refused with one line; ``reservedCPUs`` applies, unless
a claim holds one of the new CPUs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dracpu.core.cpuset import CpuSet
from dracpu.sim.node import NodeSim, open_node_sim, wait_until
from tests.integration.conftest import checkpoint_claims, cpus

pytestmark = pytest.mark.anyio

WITHIN = 20.0  # the longest any wait may take (2 shared cores, a subprocess)


def _generation(sim: NodeSim) -> int:
    return max(int(s["spec"]["pool"]["generation"]) for s in sim.slices())


async def _republished(sim: NodeSim, after: int) -> list[dict[str, Any]]:
    """Wait for a complete pool of a newer generation than ``after``; its devices."""
    await wait_until(
        "the republished ResourceSlices",
        lambda: bool(sim.slices()) and _generation(sim) > after,
        timeout=WITHIN,
        failed=sim.daemon.exited,
    )
    return await sim.wait_published()


async def _logged(sim: NodeSim, start: str, *, since: int = 0) -> str:
    """The first daemon log line from line ``since`` on that starts with ``start`` (waiting
    for it)."""
    found: list[str] = []

    def seen() -> bool:
        found[:] = [m for m in sim.daemon.messages()[since:] if m.startswith(start)]
        return bool(found)

    await wait_until(f"a log line {start!r}", seen, timeout=WITHIN, failed=sim.daemon.exited)
    return found[0]


def _by_cpu(devices: list[dict[str, Any]]) -> dict[int, str]:
    return {d["attributes"]["dra.cpu/cpuID"]["int"]: d["name"] for d in devices}


async def test_individual_devices_shrink_the_claim_stays_and_reserved_cpus_apply(
    tmp_path: Path,
) -> None:
    config = tmp_path / "dracpu.yaml"
    config.write_text("reservedCPUs: '0,32'\n")
    async with open_node_sim(
        mode="individual", shared_containers=1, extra_args=[f"--config={config}"]
    ) as sim:
        devices = await sim.wait_published()
        assert len(devices) == 62
        names = _by_cpu(devices)
        claim = sim.allocate("pinned", 1)  # the first device: cpu 1 (its sibling is cpu 33)
        assert claim.devices == [names[1]]
        assert (await sim.prepare(claim))[claim.uid].error == ""
        _, container = await sim.run_container("app", claims=[claim])
        assert container.cpus == "1"
        [shared] = sim.shared_ids()
        assert cpus(sim.cpus_of(shared)) == set(range(64)) - {0, 32, 1}

        with sim.kubelet.watch_health() as watch:
            first = await watch.until(lambda h: len(h.devices) == 62, WITHIN)
            assert first.unhealthy() == {}

            # cpu 1 (the claim's), its sibling 33 and a free cpu 40 go offline; SIGHUP
            generation = _generation(sim)
            sim.set_offline(CpuSet([1, 33, 40]))
            sim.sighup()
            after = await _republished(sim, generation)
            # the three devices left the slices; every other device kept its name and CPU
            assert _by_cpu(after) == {c: n for c, n in names.items() if c not in (1, 33, 40)}
            health = await watch.until(lambda h: names[33] not in h.health(), WITHIN)
            # the claim's device is still reported, unhealthy; the free ones are gone
            assert health.unhealthy() == {names[1]: "cpu 1 is offline"}
            assert len(health.devices) == 60

        # the claim keeps its record, its CDI spec and its container's cpuset
        assert checkpoint_claims(sim.paths.checkpoint)[claim.uid]["cpus"] == "1"
        assert sim.cdi_cpus(claim.uid) == "1"
        assert sim.cpus_of(container.id) == "1"
        # the shared container moved to the new pool at once (containerd 2.4: unsolicited)
        await wait_until(
            "the shared container on the new pool",
            lambda: cpus(sim.cpus_of(shared)) == set(range(64)) - {0, 32, 1, 33, 40},
            timeout=WITHIN,
        )
        line = await _logged(sim, "resync done: ")
        assert "cpus 1,33,40 went offline" in line
        assert f"devices removed: {names[1]}, {names[33]}, {names[40]}" in line
        assert "claims holding offline cpus: default/pinned (cpus 1)" in line
        assert "1 shared containers re-pinned" in line
        assert any(
            m.startswith(f"claim default/pinned ({claim.uid}) holds cpus 1, which are offline")
            for m in sim.daemon.messages("warning")
        )

        # The config file: a structural key is refused, reservedCPUs applies.
        config.write_text("reservedCPUs: '0,2,32'\nnriPluginIndex: '42'\n")
        generation = _generation(sim)
        sim.sighup()
        after = await _republished(sim, generation)
        assert _by_cpu(after) == {c: n for c, n in names.items() if c not in (1, 2, 33, 40)}
        refusal = await _logged(sim, "SIGHUP: nriPluginIndex changed")
        assert refusal == (
            'SIGHUP: nriPluginIndex changed from "00" to "42", which needs a restart; "00" '
            "stays in force"
        )
        await wait_until(
            "the shared container off the newly reserved cpu",
            lambda: 2 not in cpus(sim.cpus_of(shared)),
            timeout=WITHIN,
        )

        # reservedCPUs that take the claim's CPU: not applied, said why
        config.write_text("reservedCPUs: '0-2,32'\n")
        since = len(sim.daemon.messages())
        sim.sighup()
        line = await _logged(sim, "resync done: ", since=since)
        assert (
            "reserved cpus not changed: the config asks 0-2,32, but cpus 1 are held by claim "
            f"{claim.uid}; unprepare it and send SIGHUP again" in line
        )
        assert line in sim.daemon.messages("warning")
        assert sim.daemon.messages("error") == [refusal]


async def test_grouped_capacity_shrinks_and_the_health_stream_reports_the_claims_cpu() -> None:
    async with open_node_sim() as sim:  # grouped by NUMA node: node 1 = cpus 8-15,40-47
        devices = await sim.wait_published()
        capacity = {d["name"]: int(d["capacity"]["dra.cpu/cpu"]["value"]) for d in devices}
        assert capacity["cpudevnuma001"] == 16
        claim = sim.allocate("pair", 2, device="cpudevnuma001")
        assert (await sim.prepare(claim))[claim.uid].error == ""
        held = cpus(sim.cdi_cpus(claim.uid) or "")
        lost = min(held)
        free = min({8, 9, 10, 11, 12, 13, 14, 15} - held)

        with (
            sim.kubelet.watch_health(version="v1") as v1,
            sim.kubelet.watch_health(version="v1alpha1") as v1alpha1,
        ):
            for watch in (v1, v1alpha1):
                assert (await watch.until(lambda h: len(h.devices) == 4, WITHIN)).unhealthy() == {}
            generation = _generation(sim)
            sim.set_offline(CpuSet([lost, free]))
            sim.sighup()
            after = await _republished(sim, generation)
            capacity = {d["name"]: int(d["capacity"]["dra.cpu/cpu"]["value"]) for d in after}
            assert capacity == {
                "cpudevnuma000": 16,
                "cpudevnuma001": 14,
                "cpudevnuma002": 16,
                "cpudevnuma003": 16,
            }
            # After the republish only the claim's offline CPU keeps its group unhealthy (the
            # one-second poll said "cpus ... are offline" of both before it).
            for watch in (v1, v1alpha1):
                health = await watch.until(
                    lambda h: h.unhealthy() == {"cpudevnuma001": f"cpu {lost} is offline"}, WITHIN
                )
                assert len(health.devices) == 4
            assert checkpoint_claims(sim.paths.checkpoint)[claim.uid]["cpus"] == sim.cdi_cpus(
                claim.uid
            )
            assert cpus(sim.cdi_cpus(claim.uid) or "") == held

            # back online: the group is whole and healthy again
            generation = _generation(sim)
            sim.set_offline(CpuSet())
            sim.sighup()
            after = await _republished(sim, generation)
            assert {d["name"]: d["capacity"]["dra.cpu/cpu"]["value"] for d in after}[
                "cpudevnuma001"
            ] == "16"
            await v1.until(lambda h: h.unhealthy() == {}, WITHIN)
        line = await _logged(sim, "resync done: ")
        assert f"cpus {CpuSet([lost, free])} went offline" in line
        assert "devices resized: cpudevnuma001" in line
