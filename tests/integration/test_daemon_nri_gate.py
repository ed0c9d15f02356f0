"""No Prepare while the runtime cannot pin (issue 19 item 5), on the real daemon: the kubelet is
told about the driver only after the runtime's first NRI ``Synchronize`` was answered; while the
runtime is away a Prepare is refused with a retryable error and Unprepare still works; once it is
back, the same Prepare succeeds and its container is pinned. No container is ever created
unpinned in between. Also issue 20 item 6: an unwritable kubelet plugins or registration dir is
waited out, not an exit."""

from __future__ import annotations

import shutil
from typing import Any

import anyio
import pytest

from dracpu.sim.node import NodeSim, open_node_sim, wait_until
from tests.integration.conftest import cpus, node_cpus

pytestmark = [pytest.mark.anyio, pytest.mark.daemon]

NOT_SYNCHRONIZED = (
    "the container runtime's NRI connection is not synchronized; the kubelet will retry"
)
WAITING = "registration with the kubelet waits for the container runtime's first NRI Synchronize"


async def _readyz(sim: NodeSim) -> tuple[int, str]:
    return await sim.daemon.get("/readyz")


def _every_container_pinned(sim: NodeSim) -> None:
    """Every container the runtime ever created got a cpuset from us (none runs unpinned)."""
    created = [c for c in sim.runtime.calls("CreateContainer") if c.outcome == "ok"]
    assert created
    for call in created:
        response: Any = call.response
        request: Any = call.request
        assert response.adjust.linux.resources.cpu.cpus, (
            f"container {request.container.id} was created without a cpuset"
        )


async def test_registration_waits_for_the_first_synchronize() -> None:
    async with open_node_sim(start=False, shared_containers=1) as sim:
        await sim.runtime.go_away()
        await sim.start_daemon(register=False, wait_ready=False)
        await wait_until(
            "the daemon to wait for the runtime",
            lambda: WAITING in " ".join(sim.daemon.messages("info")),
            failed=sim.daemon.exited,
        )
        await sim.daemon.wait_listening()
        code, text = await _readyz(sim)
        assert code == 503
        assert (
            "[-]kubelet-registration not ready: waiting for the container runtime's first NRI"
            in text
        )
        assert sim.kubelet.sockets() == []  # the kubelet has nothing to find yet
        assert sim.kubelet.record == []

        await sim.runtime.come_back()
        await sim.register()
        await sim.daemon.wait_ready()
        synchronized = [c.ended for c in sim.runtime.calls("Synchronize") if c.outcome == "ok"]
        ((registered, what),) = sim.kubelet.record
        assert what == "registered dra.cpu"
        assert synchronized
        assert min(synchronized) < registered  # answered before the kubelet heard of us
        assert sim.daemon.messages("error") == []


async def test_prepare_is_refused_while_the_runtime_is_away_and_accepted_once_back() -> None:
    async with open_node_sim(shared_containers=2) as sim:
        everything = node_cpus(sim)
        await sim.wait_published()
        before = sim.allocate("before", 2)
        assert (await sim.prepare(before))[before.uid].error == ""

        await sim.runtime.go_away()
        await wait_until(
            "the daemon to see the runtime gone",
            lambda: any("NRI: connection to" in m for m in sim.daemon.messages("warning")),
            failed=sim.daemon.exited,
        )
        claim = sim.allocate("while-away", 4)
        error = (await sim.prepare(claim))[claim.uid].error
        assert NOT_SYNCHRONIZED in error
        assert sim.cdi_cpus(claim.uid) is None  # nothing prepared, nothing written
        # Unprepare still works: it only frees CPUs.
        assert await sim.unprepare(before) == {before.uid: ""}

        await sim.runtime.come_back()
        await sim.runtime.wait_plugin(20)
        await wait_until(
            "the second Synchronize",
            lambda: sum(m.startswith("NRI: synchronized ") for m in sim.daemon.messages()) == 2,
            failed=sim.daemon.exited,
        )
        # The kubelet retries a failed Prepare with backoff: until the daemon has marked the new
        # connection synchronized (just after its answer to Synchronize), it is still refused.
        for _ in range(100):
            error = (await sim.prepare(claim))[claim.uid].error
            if not error:
                break
            assert NOT_SYNCHRONIZED in error
            await anyio.sleep(0.05)
        assert error == ""
        held = cpus(sim.cdi_cpus(claim.uid) or "")
        _, container = await sim.run_container("app", claims=[claim])
        assert cpus(container.cpus) == held
        assert {cid: cpus(sim.cpus_of(cid)) for cid in sim.shared_ids()} == dict.fromkeys(
            sim.shared_ids(), everything - held
        )
        _every_container_pinned(sim)


@pytest.mark.parametrize("which", ["plugins/dra.cpu", "plugins_registry"])
async def test_an_unwritable_kubelet_dir_is_waited_out(which: str) -> None:
    async with open_node_sim(start=False) as sim:
        # A file where the plugin's own dir or the kubelet's registry must be: a condition of
        # the node, not of dracpu (root writes into read-only dirs, so a mode cannot show it).
        blocker = sim.paths.kubelet_root / which
        blocker.parent.mkdir(parents=True, exist_ok=True)
        if blocker.is_dir():
            shutil.rmtree(blocker)
        blocker.write_text("in the way\n")
        try:
            await sim.start_daemon(register=False, wait_ready=False)
            flag = "dra-socket" if which.startswith("plugins/") else "kubelet-registration"
            await sim.daemon.wait_listening()

            async def not_ready() -> bool:
                code, text = await _readyz(sim)
                return code == 503 and f"[-]{flag} not ready: " in text

            await wait_until(
                f"/readyz to say why ({flag})",
                lambda: any(
                    "failed, retrying in" in m and "socket" in m
                    for m in sim.daemon.messages("warning")
                ),
                failed=sim.daemon.exited,
            )
            assert await not_ready()
            assert sim.daemon.returncode is None
        finally:
            blocker.unlink()
            blocker.mkdir()
        await sim.register()
        await sim.daemon.wait_ready()
        recovered = [m for m in sim.daemon.messages("info") if "works again after" in m]
        assert len(recovered) == 1
        failures = [m for m in sim.daemon.messages("warning") if "failed, retrying in" in m]
        assert len(failures) == 1  # one line per change, not one per attempt
        await sim.wait_published()
        claim = sim.allocate("after", 2)
        assert (await sim.prepare(claim))[claim.uid].error == ""
