"""A rolling update's hand-over between two ``dracpu run`` processes on one simulated node.

The new process starts beside the running one (``maxSurge: 1``), waits as a Ready standby that
touches nothing, and takes the state dir over when the old one stops: the old one keeps its NRI
connection until the new one has synchronized with the runtime (docs/architecture.md, "Rolling
update"). The fake runtime serves one plugin connection at a time and closes the older one when
a newer one connects, so "the old connection was replaced" is the proof that the runtime was
never without a plugin that pins.
"""

from __future__ import annotations

import anyio
import pytest

from dracpu.core.cpuset import CpuSet
from dracpu.sim.fake_runtime import Note
from dracpu.sim.node import NodeSim, open_node_sim
from dracpu.tasks.handover import OWNER_LOCK

pytestmark = [pytest.mark.anyio, pytest.mark.daemon]


def _notes(sim: NodeSim, kind: str) -> list[Note]:
    return sim.runtime.notes(kind)


async def test_the_successor_waits_as_a_standby_then_pins_before_the_old_one_leaves() -> None:
    async with open_node_sim() as sim:
        old = sim.daemon
        claim = sim.allocate("held", 2)
        await sim.prepare(claim)
        _, pinned = await sim.run_container("app", claims=[claim])
        _, shared = await sim.run_container("other")
        slots = [p.read_bytes() for p in sim.paths.checkpoint_slots if p.exists()]
        connections = sim.runtime.connections

        new = await sim.start_successor()
        # Ready as a standby: nothing of the node touched, no runtime connection.
        status, body = await new.get("/readyz")
        assert (status, body) == (200, "[+]standby ok\nreadyz check passed\n")
        assert any("waiting for its hand-over as a standby" in m for m in new.messages("info"))
        assert sim.runtime.connections == connections
        assert [p.read_bytes() for p in sim.paths.checkpoint_slots if p.exists()] == slots
        assert (sim.paths.state_dir / OWNER_LOCK).read_text().startswith(f"pid {old.pid} ")

        assert await old.stop() == 0
        await sim.register()
        new.port = None  # it serves on a port of its own once it owns the node
        await new.wait_ready()

        # The new connection came while the old one was up: the runtime closed the old one
        # for it (a real runtime keeps both), and the old one did not connect again.
        [replaced] = [n for n in _notes(sim, "disconnected") if n.connection == connections]
        assert replaced.detail == "replaced by a new plugin connection"
        assert sim.runtime.connections == connections + 1
        assert (
            "handing the state dir over; NRI stays connected until the next dracpu is configured"
            in old.messages("info")
        )
        assert "the next dracpu is configured by the runtime: disconnecting from NRI" in (
            old.messages("info")
        )
        # The new one restored the old one's claim and pins as it did.
        claimed = CpuSet.parse(sim.cdi_cpus(claim.uid) or "")
        assert CpuSet.parse(sim.cpus_of(pinned.id)) == claimed
        assert not CpuSet.parse(sim.cpus_of(shared.id)) & claimed
        second = sim.allocate("second", 2)
        await sim.prepare(second)
        _, container = await sim.run_container("next", claims=[second])
        assert sim.cpus_of(container.id) == sim.cdi_cpus(second.uid)
        assert (sim.paths.state_dir / OWNER_LOCK).read_text().startswith(f"pid {new.pid} ")


async def test_without_a_successor_the_stop_is_as_before_and_the_next_start_owns_at_once() -> None:
    async with open_node_sim() as sim:
        old = sim.daemon
        assert await old.stop() == 0
        assert not any("handing the state dir over" in m for m in old.messages())
        await sim.start_daemon()
        assert not any("standby" in m for m in sim.daemon.messages())
        assert (sim.paths.state_dir / OWNER_LOCK).read_text().startswith(f"pid {sim.daemon.pid} ")


async def test_a_crashed_owner_leaves_the_state_dir_to_its_successor() -> None:
    async with open_node_sim() as sim:
        old = sim.daemon
        new = await sim.start_successor()
        await old.kill()  # the kernel drops the dead process's lock
        await sim.register()
        new.port = None
        await new.wait_ready()
        assert any("took over the state dir" in m for m in new.messages("info"))


async def test_a_dracpu_without_the_lock_serving_the_node_is_waited_for() -> None:
    # The first update to this build: the old process takes no lock, but serves the DRA socket.
    async with open_node_sim(start=False) as sim:
        path = sim.paths.kubelet_root / "plugins" / "dra.cpu" / "dra.sock"
        path.parent.mkdir(parents=True, exist_ok=True)
        listener = await anyio.create_unix_listener(path)
        try:
            await sim.start_daemon(register=False)  # Ready: the standby
            daemon = sim.daemon
            assert any(
                f"owned by a dracpu without the state dir lock, serving {path}" in m
                for m in daemon.messages("info")
            )
            assert sim.runtime.connections == 0
        finally:
            await listener.aclose()
        path.unlink()
        await sim.register()
        daemon.port = None
        await daemon.wait_ready()
        assert sim.runtime.connections == 1
