"""Issue 4 on the real daemon: slices published, claims prepared and unprepared over the DRA
socket by a grpcio kubelet, CDI files, bad input, a kubelet restart."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from dracpu.sim.fake_kubelet import ClaimRef
from dracpu.sim.node import NodeSim, SimClaim, open_node_sim, wait_until
from tests.integration.conftest import checkpoint_claims, cpus, node_cpus

pytestmark = pytest.mark.anyio


def _result(sim: NodeSim, device: str, capacity: str | None) -> dict[str, Any]:
    result: dict[str, Any] = {
        "request": "cpus",
        "driver": "dra.cpu",
        "pool": sim.node_name,
        "device": device,
        "shareID": str(uuid.uuid4()),
    }
    if capacity is not None:
        result["consumedCapacity"] = {"dra.cpu/cpu": capacity}
    return result


def _whole_cores(sim: NodeSim, held: set[int]) -> bool:
    """Every SMT sibling of a held CPU is held too."""
    return all(set(sim.topology.siblings(cpu)) <= held for cpu in held)


async def _prepared_cpus(sim: NodeSim, claim: SimClaim) -> set[int]:
    """Prepare one claim; check the kubelet's answer and the CDI file; its CPUs."""
    answer = (await sim.prepare(claim))[claim.uid]
    assert answer.error == ""
    # the claim's env on every device; its request's metadata mount on the first (one request)
    claim_id, metadata_id = (
        f"dra.k8s.io/cpu=claim-{claim.uid}",
        f"dra.cpu/metadata={claim.uid}_cpus",
    )
    assert [d.cdi_device_ids for d in answer.devices] == [(claim_id, metadata_id)] + [
        (claim_id,)
    ] * (len(claim.results) - 1)
    text = sim.cdi_cpus(claim.uid)
    assert text is not None
    return cpus(text)


async def test_grouped_claims_prepare_and_unprepare() -> None:
    async with open_node_sim() as sim:
        devices = await sim.wait_published()
        # The fake API server validated every slice on write (schema + server rules).
        assert [(d["name"], d["capacity"]["dra.cpu/cpu"]["value"]) for d in devices] == [
            (f"cpudevnuma00{n}", "16") for n in range(4)
        ]
        assert {s["spec"]["pool"]["name"] for s in sim.slices()} == {sim.node_name}
        numa0 = node_cpus(sim, numa=0)

        first = sim.allocate("first", 4, device="cpudevnuma000")
        held = await _prepared_cpus(sim, first)
        assert len(held) == 4
        assert held <= numa0
        assert _whole_cores(sim, held)
        spec = json.loads(sim.paths.cdi_spec(first.uid).read_text())
        assert spec["kind"] == "dra.k8s.io/cpu"
        assert spec["devices"][0]["name"] == f"claim-{first.uid}"
        assert sim.cdi_env(first.uid) == [f"DRA_CPUSET_{first.uid}={sim.cdi_cpus(first.uid)}"]
        # The status patch runs after the answer: it lands shortly after.
        await wait_until(
            "the claim's status.devices to record its cpuset",
            lambda: sim.claim_status_cpusets(first) == [sim.cdi_cpus(first.uid)],
            failed=sim.daemon.exited,
        )
        assert cpus(checkpoint_claims(sim.paths.checkpoint)[first.uid]["cpus"]) == held

        # Preparing again (the kubelet retries) gives the same CPUs.
        assert await _prepared_cpus(sim, first) == held

        # The rest of the NUMA node goes to a second claim: no CPU twice.
        rest = sim.allocate("rest", 12, device="cpudevnuma000")
        others = await _prepared_cpus(sim, rest)
        assert others == numa0 - held

        # Unprepare: the file goes, the checkpoint forgets it, the CPUs are free again.
        assert await sim.unprepare(first) == {first.uid: ""}
        assert sim.cdi_cpus(first.uid) is None
        assert first.uid not in checkpoint_claims(sim.paths.checkpoint)
        assert await sim.unprepare(first) == {first.uid: ""}  # again: still fine
        sim.deallocate(first)
        again = sim.allocate("again", 4, device="cpudevnuma000")
        assert await _prepared_cpus(sim, again) == held
        assert sorted(sim.cdi_claims()) == sorted([rest.uid, again.uid])

        # Someone deletes a prepared claim's spec: the CDI watcher puts it back.
        sim.paths.cdi_spec(again.uid).unlink()
        await wait_until(
            "the deleted CDI spec to come back",
            lambda: sim.paths.cdi_spec(again.uid).exists(),
            failed=sim.daemon.exited,
        )
        assert cpus(sim.cdi_cpus(again.uid) or "") == held


async def test_individual_devices_prepare_and_unprepare() -> None:
    async with open_node_sim(mode="individual") as sim:
        devices = await sim.wait_published()
        assert len(devices) == 64
        assert [d["name"] for d in devices[:3]] == ["cpudev000", "cpudev001", "cpudev002"]
        cpu_of = {d["name"]: d["attributes"]["dra.cpu/cpuID"]["int"] for d in devices}

        claim = sim.allocate("pair", 2)
        held = await _prepared_cpus(sim, claim)
        assert held == {cpu_of[name] for name in claim.devices}
        assert _whole_cores(sim, held)  # cpudev000 and 001 are SMT siblings

        other = sim.allocate("other", 3)
        assert (await _prepared_cpus(sim, other)).isdisjoint(held)

        assert await sim.unprepare(claim) == {claim.uid: ""}
        assert sim.cdi_cpus(claim.uid) is None
        sim.deallocate(claim)
        back = sim.allocate("back", 2)
        assert back.devices == claim.devices
        assert await _prepared_cpus(sim, back) == held


async def test_each_bad_claim_gets_its_own_error_and_the_others_are_prepared() -> None:
    async with open_node_sim() as sim:
        await sim.wait_published()
        good = sim.allocate("good", 2)
        full = sim.allocate("full", 16, device="cpudevnuma001")
        other = sim.write_claim("replaced", [_result(sim, "cpudevnuma002", "2")])
        bad = {
            "missing": ClaimRef("default", str(uuid.uuid4()), "missing"),
            "uid mismatch": ClaimRef("default", str(uuid.uuid4()), "replaced"),
            "unallocated": sim.write_claim(
                "unallocated", [_result(sim, "cpudevnuma002", "2")], allocated=False
            ).ref,
            "zero": sim.write_claim("zero", [_result(sim, "cpudevnuma002", "0")]).ref,
            "fraction": sim.write_claim("fraction", [_result(sim, "cpudevnuma002", "1500m")]).ref,
            "too many": sim.write_claim("too-many", [_result(sim, "cpudevnuma001", "1")]).ref,
            "unknown device": sim.write_claim("unknown", [_result(sim, "cpudevnuma009", "2")]).ref,
        }
        assert (await sim.prepare(full))[full.uid].error == ""
        answers = await sim.prepare(good, *bad.values())
        errors = {what: answers[ref.uid].error for what, ref in bad.items()}
        assert errors == {
            "missing": f"ResourceClaim default/missing (UID {bad['missing'].uid}) not found",
            "uid mismatch": (
                f"claim default/replaced has UID '{other.uid}', expected "
                f"'{bad['uid mismatch'].uid}': it was replaced"
            ),
            "unallocated": (
                f"claim default/unallocated (UID {bad['unallocated'].uid}) is not allocated"
            ),
            "zero": (
                "claim default/zero: status.allocation.devices.results[0]"
                ".consumedCapacity['dra.cpu/cpu'] of 'cpudevnuma002': '0' is not positive"
            ),
            "fraction": (
                "claim default/fraction: status.allocation.devices.results[0]"
                ".consumedCapacity['dra.cpu/cpu'] of 'cpudevnuma002': '1500m' is not a whole "
                "number of CPUs"
            ),
            "too many": (
                f"claim {bad['too many'].uid} request 'cpus' device 'cpudevnuma001': asks 1 "
                "CPUs but only 0 of the device's 16 are free"
            ),
            "unknown device": (
                f"claim {bad['unknown device'].uid} request 'cpus': device 'cpudevnuma009' is "
                "not published by this node"
            ),
        }
        assert answers[good.uid].error == ""
        assert len(cpus(sim.cdi_cpus(good.uid) or "")) == 2
        # Nothing of the bad claims reached the disk.
        assert sorted(sim.cdi_claims()) == sorted([good.uid, full.uid])
        assert sorted(checkpoint_claims(sim.paths.checkpoint)) == sorted([good.uid, full.uid])

        # The daemon keeps serving, in both DRA versions.
        assert sim.daemon.exited() is None
        assert await sim.daemon.get("/healthz") == (200, "ok\n")
        late = sim.allocate("late", 1)
        beta = await sim.kubelet.aprepare([late.ref], version="v1beta1")
        assert beta[late.uid].error == ""
        assert sim.cdi_cpus(late.uid) is not None


async def test_a_kubelet_restart_wipes_the_slices_and_they_come_back() -> None:
    async with open_node_sim() as sim:
        before = await sim.wait_published()
        names = [s["metadata"]["name"] for s in sim.slices()]
        claim = sim.allocate("kept", 4)
        held = await _prepared_cpus(sim, claim)

        deleted = await sim.kubelet_restart()
        assert deleted == names

        await wait_until(
            "the slices to be republished",
            lambda: [s["metadata"]["name"] for s in sim.slices()] == names,
            timeout=20,
            failed=sim.daemon.exited,
        )
        after = await sim.wait_published()
        assert [(d["name"], d["capacity"]) for d in after] == [
            (d["name"], d["capacity"]) for d in before
        ]
        # The prepared claim is untouched; Prepare works over the new registration.
        assert cpus(sim.cdi_cpus(claim.uid) or "") == held
        assert await _prepared_cpus(sim, claim) == held
