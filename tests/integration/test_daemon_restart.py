"""Crash safety on the real daemon: claims survive SIGKILL through the checkpoint (also in the
middle of a stream of Prepares, round after round), the CDI specs come back at start, a torn
checkpoint slot falls back to the other slot, a corrupt checkpoint (both slots) is moved aside
and the claims adopted from their CDI specs, and NRI ``Synchronize`` re-pins the running
containers."""

from __future__ import annotations

import dataclasses
import uuid

import anyio
import pytest

from dracpu.sim.node import NodeSim, SimClaim, open_node_sim, wait_until
from tests.integration.conftest import checkpoint_claims, cpus, node_cpus

pytestmark = pytest.mark.anyio

FOREIGN_SPEC = "vendor.example-gpu.json"  # another vendor's CDI spec: never ours to touch
KILL_ROUNDS = 3  # SIGKILL rounds under load (each a restart: about a second)
CLAIMS_PER_ROUND = 8


async def _prepare(sim: NodeSim, claim: SimClaim) -> set[int]:
    answer = (await sim.prepare(claim))[claim.uid]
    assert answer.error == ""
    return cpus(sim.cdi_cpus(claim.uid) or "")


def _drift(sim: NodeSim) -> None:
    """Someone resets every container's cpuset while the daemon is away."""
    for cid, record in list(sim.runtime.containers.items()):
        sim.runtime.containers[cid] = dataclasses.replace(record, cpus="0-63")


async def test_a_killed_daemon_keeps_its_claims_and_repins_containers_at_synchronize() -> None:
    async with open_node_sim(shared_containers=2) as sim:
        numa0 = node_cpus(sim, numa=0)
        await sim.wait_published()
        claim = sim.allocate("survivor", 4, device="cpudevnuma000")
        held = await _prepare(sim, claim)
        _, container = await sim.run_container("app", claims=[claim])
        assert cpus(container.cpus) == held

        assert await sim.daemon.kill() == -9
        _drift(sim)
        await sim.start_daemon()

        # Still held, from the checkpoint; its CDI spec is there; the container is re-pinned.
        assert cpus(checkpoint_claims(sim.paths.checkpoint)[claim.uid]["cpus"]) == held
        assert cpus(sim.cdi_cpus(claim.uid) or "") == held
        await sim.runtime.wait_plugin(20)
        assert cpus(sim.cpus_of(container.id)) == held
        shared = {cid: cpus(sim.cpus_of(cid)) for cid in sim.shared_ids()}
        assert shared == dict.fromkeys(sim.shared_ids(), node_cpus(sim) - held)
        assert "restored 1 prepared claims from " + str(sim.paths.checkpoint_slots[0]) in (
            sim.daemon.messages()
        )

        # The kubelet's retry gets the same CPUs; nobody else gets them.
        assert await _prepare(sim, claim) == held
        rest = sim.allocate("rest", 12, device="cpudevnuma000")
        assert await _prepare(sim, rest) == numa0 - held


async def test_sigkill_amid_prepares_loses_no_answered_claim_and_holds_no_cpu_twice() -> None:
    async with open_node_sim(shared_containers=2) as sim:
        await sim.wait_published()
        answered: dict[str, set[int]] = {}  # claims the kubelet was told are prepared
        for round_ in range(KILL_ROUNDS):
            claims = [sim.allocate(f"r{round_}-{n}", 1 + n % 2) for n in range(CLAIMS_PER_ROUND)]
            unknown: list[SimClaim] = []  # calls that died with the daemon
            first = anyio.Event()

            async def prepare(claim: SimClaim, unknown: list[SimClaim], first: anyio.Event) -> None:
                try:
                    result = (await sim.prepare(claim))[claim.uid]
                except Exception:  # grpcio's error of a call cut short by the kill
                    unknown.append(claim)
                    return
                assert result.error == ""
                answered[claim.uid] = cpus(sim.cdi_cpus(claim.uid) or "")
                first.set()

            async with anyio.create_task_group() as tg:
                for claim in claims:
                    tg.start_soon(prepare, claim, unknown, first)
                await first.wait()  # the others are queued or in flight
                assert await sim.daemon.kill() == -9
            await sim.start_daemon()

            saved = {
                uid: cpus(c["cpus"]) for uid, c in checkpoint_claims(sim.paths.checkpoint).items()
            }
            # Every claim the kubelet was told about is held, on the CPUs it was told.
            assert {uid: saved.get(uid) for uid in answered} == answered
            # The kubelet's retry of a call that died gets the CPUs the daemon may have chosen
            # before the kill, or new ones.
            for claim in unknown:
                assert (await sim.prepare(claim))[claim.uid].error == ""
                got = cpus(sim.cdi_cpus(claim.uid) or "")
                assert got == saved.get(claim.uid, got)
                answered[claim.uid] = got
            # No CPU is held twice.
            held = [cpu for claim_cpus in answered.values() for cpu in claim_cpus]
            assert len(held) == len(set(held))
            assert len(answered) == (round_ + 1) * CLAIMS_PER_ROUND
            # Synchronize re-pinned the shared containers off every claim held at the restart
            # (a claim prepared later takes its CPUs when its container starts).
            restored = set().union(*saved.values())
            await wait_until(
                "the shared containers re-pinned off the restored claims",
                lambda: all(cpus(sim.cpus_of(c)).isdisjoint(restored) for c in sim.shared_ids()),  # noqa: B023
                timeout=20,
                failed=sim.daemon.exited,
            )
        assert sim.daemon.messages("error") == []


async def test_cdi_specs_deleted_while_the_daemon_was_down_are_rewritten_at_start() -> None:
    async with open_node_sim() as sim:
        await sim.wait_published()
        claims = [sim.allocate(f"c{n}", 2 + n) for n in range(2)]
        held = {c.uid: await _prepare(sim, c) for c in claims}
        assert await sim.stop_daemon() == 0

        for path in sim.paths.cdi_dir.iterdir():
            path.unlink()
        orphan = str(uuid.uuid4())  # a spec of our kind that the checkpoint does not know
        (sim.paths.cdi_dir / FOREIGN_SPEC).write_text('{"cdiVersion": "0.5.0"}')
        orphan_text = (
            '{"cdiVersion":"0.5.0","kind":"dra.k8s.io/cpu","devices":[{"name":"claim-'
            + orphan
            + '","containerEdits":{"env":["DRA_CPUSET_'
            + orphan
            + '=60-61"]}}]}'
        )
        sim.paths.cdi_spec(orphan).write_text(orphan_text)

        await sim.start_daemon()
        assert {c.uid: cpus(sim.cdi_cpus(c.uid) or "") for c in claims} == held
        assert (sim.paths.cdi_dir / FOREIGN_SPEC).read_text() == '{"cdiVersion": "0.5.0"}'
        # The orphan named a CPU nobody holds, so it was adopted (an upgrade from upstream).
        assert orphan in checkpoint_claims(sim.paths.checkpoint)
        assert sim.cdi_cpus(orphan) == "60-61"
        assert "the files of 3 prepared claims are being put in place" in sim.daemon.messages()


async def test_an_orphan_spec_that_conflicts_with_a_claim_is_removed_at_start() -> None:
    async with open_node_sim() as sim:
        await sim.wait_published()
        claim = sim.allocate("owner", 2)
        held = await _prepare(sim, claim)
        assert await sim.stop_daemon() == 0
        orphan = str(uuid.uuid4())
        taken = ",".join(str(c) for c in sorted(held))
        sim.paths.cdi_spec(orphan).write_text(
            '{"cdiVersion":"0.5.0","kind":"dra.k8s.io/cpu","devices":[{"name":"claim-'
            f'{orphan}","containerEdits":{{"env":["DRA_CPUSET_{orphan}={taken}"]}}}}]}}'
        )
        await sim.start_daemon()
        assert sim.cdi_claims() == [claim.uid]
        assert sorted(checkpoint_claims(sim.paths.checkpoint)) == [claim.uid]
        assert any(
            m.startswith(f"cannot adopt the CDI spec of claim {orphan}: cpus ")
            for m in sim.daemon.messages("error")
        )


async def test_a_torn_newest_slot_falls_back_to_the_other_and_adopts_the_lost_claim() -> None:
    async with open_node_sim() as sim:
        await sim.wait_published()
        first = sim.allocate("first", 2, device="cpudevnuma000")
        second = sim.allocate("second", 3, device="cpudevnuma001")
        held = {first.uid: await _prepare(sim, first), second.uid: await _prepare(sim, second)}
        # Three writes: the start's in slot 0, the first claim's in slot 1, the second's in 0.
        newest, older = sim.paths.checkpoint_slots
        assert sim.paths.checkpoint == newest
        assert await sim.daemon.kill() == -9

        # The power failed in the middle of the second claim's checkpoint write.
        torn = newest.read_bytes()[:150]
        newest.write_bytes(torn)
        await sim.start_daemon()

        assert (sim.paths.state_dir / "checkpoint.json.corrupt-1").read_bytes() == torn
        assert any(
            m.startswith(f"checkpoint {newest} is unusable") and f"using {older} (sequence 2)" in m
            for m in sim.daemon.messages("warning")
        )
        assert sim.daemon.messages("error") == []
        saved = checkpoint_claims(sim.paths.checkpoint)
        assert {uid: cpus(c["cpus"]) for uid, c in saved.items()} == held
        assert saved[first.uid]["results"] != []  # from the older slot
        assert saved[second.uid]["results"] == []  # adopted from its CDI spec
        assert await _prepare(sim, second) == held[second.uid]  # the kubelet's retry


async def test_a_corrupt_checkpoint_is_moved_aside_and_claims_are_adopted_from_cdi() -> None:
    async with open_node_sim() as sim:
        numa0 = node_cpus(sim, numa=0)
        await sim.wait_published()
        claim = sim.allocate("adoptee", 4, device="cpudevnuma000")
        held = await _prepare(sim, claim)
        # Two more checkpoint writes, so that both slots hold the claim.
        other = sim.allocate("other", 2, device="cpudevnuma001")
        await _prepare(sim, other)
        assert (await sim.unprepare(other))[other.uid] == ""
        for slot in sim.paths.checkpoint_slots:
            assert claim.uid in checkpoint_claims(slot)
        assert await sim.daemon.kill() == -9

        # Torn writes (the spaces that pad a slot are not content: cut into the document).
        corrupt = [slot.read_bytes().rstrip(b" ")[:-20] for slot in sim.paths.checkpoint_slots]
        for slot, raw in zip(sim.paths.checkpoint_slots, corrupt, strict=True):
            slot.write_bytes(raw)
        await sim.start_daemon()

        for slot, raw in zip(sim.paths.checkpoint_slots, corrupt, strict=True):
            assert slot.with_name(slot.name + ".corrupt-1").read_bytes() == raw
        errors = [m for m in sim.daemon.messages("error") if m.startswith("checkpoint ")]
        assert len(errors) == 2
        assert f"adopted 1 claims from CDI specs the checkpoint lacked: ['{claim.uid}']" in (
            sim.daemon.messages("warning")
        )
        adopted = checkpoint_claims(sim.paths.checkpoint)[claim.uid]
        assert (cpus(adopted["cpus"]), adopted["results"]) == (held, [])

        # Held: the rest of the NUMA node is all another claim can get ...
        greedy = sim.write_claim(
            "greedy",
            [
                {
                    "request": "cpus",
                    "driver": "dra.cpu",
                    "pool": sim.node_name,
                    "device": "cpudevnuma000",
                    "shareID": str(uuid.uuid4()),
                    "consumedCapacity": {"dra.cpu/cpu": "16"},
                }
            ],
        )
        error = (await sim.prepare(greedy))[greedy.uid].error
        assert error.endswith("asks 16 CPUs but only 12 of the device's 16 are free")
        assert await _prepare(sim, sim.allocate("rest", 12, device="cpudevnuma000")) == (
            numa0 - held
        )
        # ... and the kubelet's Prepare of the adopted claim gets its CPUs, results recorded.
        assert await _prepare(sim, claim) == held
        assert checkpoint_claims(sim.paths.checkpoint)[claim.uid]["results"] != []
