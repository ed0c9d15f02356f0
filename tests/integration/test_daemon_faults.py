"""Conditions the real ``dracpu run`` process waits out instead of exiting: a read-only CDI dir
at start, a full state dir at start, a missing NRI socket, an API server outage; and a bad
claim UID answered without an error line. Each test holds the condition, checks that
the daemon is alive, says why it is not ready (``/readyz``, ``/metrics``) and keeps serving what
it can, then lifts the condition and checks that the daemon recovers by itself within seconds.

A DaemonSet whose process exits for such a condition crash-loops, and while it is down the runtime
creates containers without pinning them."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from dracpu.sim.fake_kubelet import ClaimRef
from dracpu.sim.fake_runtime import open_fake_runtime
from dracpu.sim.faults import api_outage
from dracpu.sim.node import NodeSim, SimClaim, open_node_sim, wait_until
from dracpu.tasks import cdi_watcher
from tests.integration.conftest import checkpoint_claims, cpus, node_cpus
from tests.mounts import full_tmpfs, read_only_bind

pytestmark = pytest.mark.anyio

# How long each condition is held, and how soon after it clears the daemon must be back.
HELD = 10.0
RECOVERY = 5.0
# The API outage of the issue: 8 s, slices back within 5 s of the server's return.
OUTAGE = 8.0


async def _readyz(sim: NodeSim) -> tuple[int, str]:
    try:
        return await sim.daemon.get("/readyz")
    except OSError:
        return 0, ""


async def _metric(sim: NodeSim, line_start: str) -> str:
    """The ``/metrics`` line that starts with ``line_start``."""
    _, body = await sim.daemon.get("/metrics")
    found = [line for line in body.splitlines() if line.startswith(line_start)]
    assert len(found) == 1, f"{line_start!r} in /metrics: {found}"
    return found[0]


def _only_not_ready(flag: str, reason: str) -> Callable[[int, str], None]:
    """A check of one /readyz answer while only ``flag`` is amiss: not ready (or no answer yet)
    and, once every task has started, ``flag`` the one line not ready, for ``reason``."""

    def check(status: int, body: str) -> None:
        assert status in (0, 503)
        if "[+]slice-publisher ok" in body:  # every task started: only the flag is amiss
            assert [line for line in body.splitlines() if line.startswith("[-]")] == [
                f"[-]{flag} not ready: {reason}"
            ]

    return check


async def _hold(sim: NodeSim, seconds: float, check: Callable[[int, str], None]) -> None:
    """For ``seconds``: the daemon runs, and ``check(status, body)`` holds for ``/readyz``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert sim.daemon.exited() is None
        check(*await _readyz(sim))
        await anyio.sleep(0.25)


async def _ready_within(sim: NodeSim, seconds: float) -> float:
    """Wait for ``/readyz`` 200; the seconds it took (fails after ``seconds``)."""
    start = time.monotonic()

    async def ready() -> bool:
        return (await _readyz(sim))[0] == 200

    while not await ready():
        assert sim.daemon.exited() is None
        assert time.monotonic() - start < seconds, (await _readyz(sim))[1]
        await anyio.sleep(0.05)
    return time.monotonic() - start


async def test_a_read_only_cdi_dir_at_start_is_waited_out() -> None:
    async with open_node_sim() as sim:
        await sim.wait_published()
        kept = sim.allocate("kept", 2)
        assert (await sim.prepare(kept))[kept.uid].error == ""
        held = cpus(sim.cdi_cpus(kept.uid) or "")
        assert await sim.stop_daemon() == 0
        sim.paths.cdi_spec(kept.uid).unlink()  # a reboot empties /var/run/cdi
        cdi = sim.paths.cdi_dir

        with read_only_bind(cdi) as mount:
            await sim.start_daemon(wait_ready=False)
            reason = f"cannot create files in CDI dir {str(cdi)!r}: Read-only file system"

            await _hold(sim, HELD, _only_not_ready("cdi-dir", reason))
            assert (await _readyz(sim))[0] == 503
            assert await _metric(sim, 'dracpu_task_ready{task="cdi-dir"}') == (
                'dracpu_task_ready{task="cdi-dir"} 0.0'
            )
            # Prepare fails per claim, saying why; nothing is held for the claim.
            refused = sim.allocate("refused", 2)
            error = (await sim.prepare(refused))[refused.uid].error
            spec = cdi / f"dra.k8s.io-cpu_claim-{refused.uid}.json"
            assert error == f"cannot write CDI spec {str(spec)!r}: Read-only file system"
            # Said once, however many tries: the daemon's log is not flooded.
            errors = sim.daemon.messages("error")
            waiting = [m for m in errors if m.startswith("writing CDI specs in")]
            assert len(waiting) == 1
            assert waiting[0].startswith(f"writing CDI specs in {cdi} failed, retrying in ")
            assert waiting[0].endswith(f": {reason}; Prepare fails until then")
            assert not any(m.startswith("task ") for m in errors)
            # Undoing a spec write that never happened is no error.
            assert not any("rollback" in m for m in errors), errors

            mount.set_read_only(False)
            assert await _ready_within(sim, RECOVERY) < RECOVERY
            # The restored claim's spec is back (the start-up could not write it), and both
            # claims work now.
            assert cpus(sim.cdi_cpus(kept.uid) or "") == held
            assert (await sim.prepare(refused))[refused.uid].error == ""
            got = cpus(sim.cdi_cpus(refused.uid) or "")
            assert got
            assert got.isdisjoint(held)
            _, container = await sim.run_container("app", claims=[refused])
            assert cpus(container.cpus) == got
            assert any(
                m.startswith(f"writing CDI specs in {cdi} works again after ")
                for m in sim.daemon.messages("info")
            )
            assert await sim.stop_daemon() == 0


async def test_a_claim_whose_spec_cannot_be_written_again_is_unhealthy_until_it_is() -> None:
    # The claim is prepared, then its CDI dir turns read-only and its spec is deleted: the owner
    # cannot put the spec back.
    async with open_node_sim() as sim:
        await _unwritable_file(
            sim,
            lambda claim: sim.paths.cdi_spec(claim.uid),
            "CDI spec",
            "containers using the claim cannot start until it is written",
            recovery=HELD,  # the owner's cdi-dir test finds the dir writable within 2 s
        )


async def test_a_claim_whose_device_metadata_cannot_be_written_again_is_unhealthy_until_it_is() -> (
    None
):
    # The same with the claim's device metadata file (KEP-5304), in the kubelet's plugin dir.
    async with open_node_sim() as sim:
        metadata_dir = sim.paths.kubelet_root / "plugins" / "dra.cpu" / "dra-device-metadata"
        await _unwritable_file(
            sim,
            lambda claim: metadata_dir / f"{claim.uid}_cpus.json",
            "device metadata",
            "containers using the claim do not find their device metadata until it is written",
            # A mount turning writable makes no inotify event: the CDI watcher's next full pass
            # (every DEFAULT_RESYNC_INTERVAL) finds the file still missing and asks again.
            recovery=HELD + cdi_watcher.DEFAULT_RESYNC_INTERVAL,
        )


async def _unwritable_file(
    sim: NodeSim,
    file_of: Callable[[SimClaim], Path],
    what: str,
    consequence: str,
    *,
    recovery: float,
) -> None:
    """A prepared claim's file deleted while its dir is read-only (through a descriptor of the
    dir opened before the read-only mount: the mount shows the same files): the claim's device
    says why on the health stream, until the dir takes writes again and the file is back
    (within ``recovery`` seconds)."""
    await sim.wait_published()
    claim = sim.allocate("claim", 2)
    assert (await sim.prepare(claim))[claim.uid].error == ""
    (device,) = set(claim.devices)
    path = file_of(claim)
    assert path.exists()
    underneath = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with sim.kubelet.watch_health() as watch, read_only_bind(path.parent) as mount:
            assert (await watch.until(lambda h: device in h.health(), HELD)).unhealthy() == {}
            os.unlink(path.name, dir_fd=underneath)
            reason = (
                f"claim {claim.uid}: cannot write {what} {str(path)!r}: Read-only file "
                f"system; {consequence}"
            )
            health = await watch.until(lambda h: bool(h.unhealthy()), HELD)
            assert health.unhealthy() == {device: reason}
            assert not path.exists()
            mount.set_read_only(False)
            await watch.until(lambda h: h.health()[device] == "HEALTHY", recovery)
            assert path.exists()
    finally:
        os.close(underneath)
    assert await sim.stop_daemon() == 0


async def test_a_full_state_dir_at_start_is_waited_out() -> None:
    async with open_node_sim() as sim:
        await sim.wait_published()
        kept = sim.allocate("kept", 2)
        assert (await sim.prepare(kept))[kept.uid].error == ""
        held = cpus(sim.cdi_cpus(kept.uid) or "")
        assert await sim.stop_daemon() == 0
        state = sim.paths.state_dir
        newest = sim.paths.checkpoint.read_bytes()
        for path in state.iterdir():
            path.unlink()

        with full_tmpfs(state) as disk:
            # One slot, as an earlier build leaves it: the second must be created, on a full
            # file system. (Slots that exist take their writes, full or not.)
            (state / "checkpoint.json").write_bytes(newest)
            disk.fill()
            await sim.start_daemon(wait_ready=False)
            reason = (
                f"cannot write checkpoint {state / 'checkpoint.1.json'}: No space left on device"
            )

            await _hold(sim, HELD, _only_not_ready("state-dir", reason))
            assert (await _readyz(sim))[0] == 503
            assert await _metric(sim, 'dracpu_task_ready{task="state-dir"}') == (
                'dracpu_task_ready{task="state-dir"} 0.0'
            )
            # Prepare and Unprepare fail per claim, saying why, and lose nothing: the claim of
            # before is held, its spec is in place and its container is pinned; the new one
            # holds nothing.
            refused = sim.allocate("refused", 2)
            assert (await sim.prepare(refused))[refused.uid].error == reason
            assert sim.cdi_cpus(refused.uid) is None
            assert await sim.unprepare(kept) == {kept.uid: reason}
            assert cpus(sim.cdi_cpus(kept.uid) or "") == held
            _, container = await sim.run_container("app", claims=[kept])
            assert cpus(container.cpus) == held
            # One error line for the whole condition; undoing writes that left nothing is none.
            errors = sim.daemon.messages("error")
            assert len(errors) == 1, errors
            assert errors[0].startswith(f"writing the checkpoint in {state} failed, retrying in ")
            assert errors[0].endswith(f": {reason}; Prepare and Unprepare fail until then")

            disk.free()
            assert await _ready_within(sim, RECOVERY) < RECOVERY
            assert (await sim.prepare(refused))[refused.uid].error == ""
            got = cpus(sim.cdi_cpus(refused.uid) or "")
            assert got
            assert got.isdisjoint(held)
            saved = checkpoint_claims(sim.paths.checkpoint)
            assert {uid: cpus(claim["cpus"]) for uid, claim in saved.items()} == {
                kept.uid: held,
                refused.uid: got,
            }
            assert any(
                m.startswith(f"writing the checkpoint in {state} works again after ")
                for m in sim.daemon.messages("info")
            )
            assert await sim.stop_daemon() == 0


async def test_an_unprepare_with_a_bad_claim_uid_is_refused_without_an_error() -> None:
    async with open_node_sim() as sim:
        await sim.wait_published()
        bad = ClaimRef(namespace="default", uid="../not-a-uuid", name="broken")
        assert await sim.unprepare(bad) == {
            bad.uid: "cannot unprepare claim '../not-a-uuid': its UID is not an RFC 4122 UUID"
        }
        assert sim.daemon.messages("error") == []
        assert await _metric(sim, "dracpu_state_owner_effects_failed_total ") == (
            "dracpu_state_owner_effects_failed_total 0.0"
        )
        _, body = await sim.daemon.get("/metrics")
        commands = [m for m in body.splitlines() if m.startswith("dracpu_state_owner_commands_")]
        assert [m for m in commands if "Unprepare" in m or 'outcome="failed"' in m] == [
            'dracpu_state_owner_commands_total{command="UnprepareClaim",outcome="error"} 1.0'
        ]


async def test_a_claim_that_cannot_be_read_fails_its_prepare_naming_the_cause() -> None:
    async with open_node_sim() as sim:
        await sim.wait_published()
        claim = sim.allocate("unread", 2)
        what = f"get resourceclaim default/{claim.name}: "
        # No answer at all (aiohttp sends a GET a second time on a dropped connection).
        sim.api.fail_next(2, status=None, method="GET", path="resourceclaims")
        assert (await sim.prepare(claim))[claim.uid].error == (
            f"{what}cannot reach the API server {sim.api.url}: connection closed by the server "
            "before the answer was complete"
        )
        sim.api.fail_next(status=503, method="GET", path="resourceclaims", message="etcd is away")
        assert (await sim.prepare(claim))[claim.uid].error == (
            f"{what}the API server {sim.api.url} answered 503 Service Unavailable: etcd is away"
        )
        assert sim.cdi_cpus(claim.uid) is None
        assert (await sim.prepare(claim))[claim.uid].error == ""  # the kubelet's retry works
        assert sim.daemon.messages("error") == []


async def test_a_missing_nri_socket_is_waited_out() -> None:
    async with open_node_sim(start=False) as sim:
        socket_path = sim.paths.root / "late-nri" / "nri.sock"  # no runtime listens here yet
        socket_path.parent.mkdir()
        sim.daemon_args.append(f"--nri-socket={socket_path}")
        started = time.monotonic()
        await sim.start_daemon(register=False, wait_ready=False)

        def not_ready(status: int, body: str) -> None:
            # Without a runtime the daemon is never ready: the kubelet is not told about it.
            if time.monotonic() - started < HELD:
                assert status in (0, 503)

        await _hold(sim, HELD - 1.0, not_ready)
        assert sim.daemon.exited() is None
        assert await _metric(sim, "dracpu_nri_connected ") == "dracpu_nri_connected 0.0"
        # The slices are published meanwhile, but no claim can be prepared: there is no
        # registration socket for the kubelet to find (no Prepare while nothing can pin).
        await sim.wait_published()
        assert sim.kubelet.sockets() == []
        status, body = await sim.daemon.get("/readyz")
        assert status == 503
        assert (
            "[-]kubelet-registration not ready: waiting for the container runtime's first NRI "
            "Synchronize before registering with the kubelet "
            f"(cannot connect to {socket_path}: "
        ) in body
        assert any(
            m.startswith(f"NRI: cannot connect to {socket_path} (attempt 1)")
            for m in sim.daemon.messages("warning")
        )

        async with open_fake_runtime(socket_path, runtime_version="2.4.0") as runtime:
            pod = runtime.add_pod("before", namespace="default")
            shared = runtime.add_container(pod, "main", cpus="")
            appeared = time.monotonic()
            await runtime.wait_plugin(RECOVERY + 2.0)  # the reconnect backoff is capped at 5 s
            assert time.monotonic() - appeared < RECOVERY + 2.0
            # Synchronize pinned the container that ran before to the shared pool.
            assert cpus(runtime.containers[shared.id].cpus) == node_cpus(sim)
            await sim.register()
            assert await _ready_within(sim, RECOVERY) < RECOVERY
            assert await _metric(sim, "dracpu_nri_connected ") == "dracpu_nri_connected 1.0"
            claim = sim.allocate("late", 2)
            assert (await sim.prepare(claim))[claim.uid].error == ""
            held = cpus(sim.cdi_cpus(claim.uid) or "")
            app = runtime.add_pod("app", namespace="default")
            await runtime.run_pod_sandbox(app)
            container = runtime.new_container(app, "main", env=sim.cdi_env(claim.uid))
            await runtime.create_container(app, container)
            assert cpus(runtime.containers[container.id].cpus) == held
            assert cpus(runtime.containers[shared.id].cpus) == node_cpus(sim) - held
            assert await sim.stop_daemon() == 0


async def test_slices_are_back_within_5s_of_an_8s_api_outage() -> None:
    async with open_node_sim() as sim:
        await sim.wait_published()
        took = await api_outage(sim, OUTAGE)  # the same as bench/bench_soak.py's five
        assert took < RECOVERY

        # One line when publishing began to fail, one when it worked again (logged after the
        # write the server stored: it may follow the slices by a few milliseconds).
        def back_lines() -> list[str]:
            return [m for m in sim.daemon.messages("info") if "publishing ResourceSlices" in m]

        await wait_until("the recovery to be logged", lambda: bool(back_lines()), timeout=5)
        warned = sim.daemon.messages("warning")
        failed = [m for m in warned if m.startswith("publishing ResourceSlices")]
        back = back_lines()
        assert [m.split(",")[0] for m in failed] == ["publishing ResourceSlices failed"]
        assert [m.split(" after")[0] for m in back] == ["publishing ResourceSlices works again"]
        # /readyz said so meanwhile (the flag `slices`), once, and is ready again.
        [not_ready] = [m for m in warned if m.startswith("task slices is not ready: ")]
        assert "publishing ResourceSlices fails: " in not_ready
        with anyio.fail_after(5):
            while (await _readyz(sim))[0] != 200:  # noqa: ASYNC110 - polls the HTTP port
                await anyio.sleep(0.05)
        assert "[+]slices ok" in (await _readyz(sim))[1]
        assert sim.daemon.messages("error") == []
