"""The real ``dracpu run`` process on a simulated node: start order, readiness, signals, exits."""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import time
from pathlib import Path

import anyio
import pytest

from dracpu.sim.daemon_process import READY_TIMEOUT
from dracpu.sim.fake_kubelet import FakeKubelet, RegistrationRefused
from dracpu.sim.node import NodeSim, SimError, open_node_sim, wait_until

pytestmark = pytest.mark.anyio

TASKS = (
    "signals",
    "state-owner",
    "http",
    "debug-dump",
    "cdi-watcher",
    "device-health",
    "kubelet-plugin",
    "registration",
    "nri-plugin",
    "podresources-sync",
    "slice-publisher",
)


def _sockets_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if stat.S_ISSOCK(p.lstat().st_mode)]


async def _exit_code(sim: NodeSim, timeout: float = 30.0) -> int:  # noqa: ASYNC109
    with anyio.fail_after(timeout):
        return await sim.daemon.process.wait()


async def test_ready_with_every_task_then_sighup_resyncs_and_sigterm_stops_within_5s() -> None:
    async with open_node_sim() as sim:
        status, body = await sim.daemon.get("/readyz")
        assert status == 200
        assert body == (
            "[+]state-dir ok\n[+]cdi-dir ok\n"
            + "".join(f"[+]{task} ok\n" for task in TASKS)
            + "[+]dra-socket ok\n[+]kubelet-registration ok\n[+]slices ok\n"
            + "readyz check passed\n"
        )
        assert await sim.daemon.get("/healthz") == (200, "ok\n")
        # The supervisor's tasks become ready in start order; the kubelet's registration verdict
        # arrives on its own schedule, so it is not part of that order.
        expected = [f"task {task} is ready" for task in TASKS]
        started = [m for m in sim.daemon.messages() if m in expected]
        assert started == expected

        metrics = (await sim.daemon.get("/metrics"))[1]
        for line in (
            "dracpu_nri_connected 1.0",
            "dracpu_nri_synchronized 1.0",
            "dracpu_nri_connections_total 1.0",
            'dracpu_nri_unsolicited_updates_total{outcome="sent"} 0.0',
            'dracpu_nri_runtime_info{name="containerd",nri_version="v0.12.2",'
            'unsolicited_updates="true",version="2.4.0"} 1.0',
            'dracpu_task_ready{task="kubelet-registration"} 1.0',
        ):
            assert line in metrics.splitlines()

        # SIGHUP reaches the state owner as a Resync (counted in /metrics).
        resyncs = 'dracpu_state_owner_commands_total{command="Resync",outcome="ok"} 1.0'
        sim.daemon.process.send_signal(signal.SIGHUP)
        with anyio.fail_after(10):
            while resyncs not in (await sim.daemon.get("/metrics"))[1]:  # noqa: ASYNC110
                await anyio.sleep(0.05)

        start = time.monotonic()
        assert await sim.stop_daemon(signal.SIGTERM) == 0
        assert time.monotonic() - start < 5
        messages = sim.daemon.messages()
        assert "resync done: files of 0 prepared claims checked; node unchanged" in messages
        assert "SIGTERM received: stopping" in messages
        assert messages[-2:] == ["stopping (SIGTERM)", "stopped"]
        assert sim.daemon.messages("error") == []
        # Every socket the daemon made is gone; the runtime's NRI socket and the kubelet's
        # PodResources socket stay.
        assert _sockets_under(sim.paths.kubelet_root) == [
            sim.paths.kubelet_root / "pod-resources" / "kubelet.sock"
        ]
        assert _sockets_under(sim.paths.nri_socket.parent) == [sim.paths.nri_socket]


async def test_sigint_stops_the_daemon_too() -> None:
    async with open_node_sim() as sim:
        start = time.monotonic()
        assert await sim.stop_daemon(signal.SIGINT) == 0
        assert time.monotonic() - start < 5
        assert sim.daemon.messages()[-1] == "stopped"


async def test_not_ready_until_the_kubelet_registers_the_plugin_and_after_a_refusal() -> None:
    async with open_node_sim(start=False) as sim:
        await sim.start_daemon(register=False, wait_ready=False)
        waiting = "[-]kubelet-registration not ready: the kubelet has not registered the plugin yet"

        async def readyz() -> tuple[int, str]:
            try:
                return await sim.daemon.get("/readyz")
            except OSError:
                return 0, ""

        with anyio.fail_after(60):
            while True:
                status, body = await readyz()
                if all(f"[+]{task} ok" in body for task in TASKS):
                    break
                assert sim.daemon.exited() is None
                await anyio.sleep(0.05)
        assert (status, waiting in body) == (503, True)

        await sim.register()
        assert (await readyz())[0] == 200

        # A kubelet that speaks no version of ours refuses the plugin and tells it why.
        picky = FakeKubelet(sim.paths.registry_dir, services=("v9.DRAPlugin",))
        with picky, pytest.raises(RegistrationRefused):
            await picky.aregister()
        status, body = await readyz()
        assert status == 503
        assert "[-]kubelet-registration not ready: kubelet registration failed: none of " in body
        assert any(
            m.startswith("the kubelet refused to register DRA driver dra.cpu")
            for m in sim.daemon.messages("error")
        )
        await sim.register()  # the kubelet retries and succeeds: ready again
        assert (await readyz())[0] == 200


async def test_a_task_that_cannot_start_exits_1_with_the_error_logged() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        async with open_node_sim(
            start=False, pod_resources=False, extra_args=[f"--bind-address=127.0.0.1:{port}"]
        ) as sim:
            await sim.start_daemon(register=False, wait_ready=False)
            assert await _exit_code(sim) == 1
            assert sim.daemon.messages("error") == [
                f"task http failed: cannot listen on --bind-address 127.0.0.1:{port}: "
                "Address already in use"
            ]
            # The tasks started before it were stopped and cleaned up after themselves.
            assert _sockets_under(sim.paths.kubelet_root) == []


async def test_leftovers_at_the_kubelet_sockets_are_replaced_and_a_directory_waited_out() -> None:
    async with open_node_sim(start=False) as sim:
        dra = sim.paths.kubelet_root / "plugins" / "dra.cpu" / "dra.sock"
        reg = sim.paths.registry_dir / "dra.cpu-reg.sock"
        dra.parent.mkdir(parents=True)
        reg.parent.mkdir(parents=True, exist_ok=True)
        dra.write_text("a regular file")
        reg.symlink_to(reg.parent / "gone.sock")  # dangling
        await sim.start_daemon()  # registered through `reg`, ready
        assert stat.S_ISSOCK(dra.lstat().st_mode)
        assert stat.S_ISSOCK(reg.lstat().st_mode)
        claim = sim.allocate("after-leftovers", 2)
        assert (await sim.prepare(claim))[claim.uid].error == ""
        # A crash leaves both sockets behind; the next start replaces them.
        await sim.restart_daemon(kill=True)
        assert stat.S_ISSOCK(dra.lstat().st_mode)
        assert stat.S_ISSOCK(reg.lstat().st_mode)
        assert await sim.stop_daemon() == 0

        # A directory in the way is a condition of the node: waited out (issue 20), not exit 1.
        dra.mkdir()
        await sim.start_daemon(register=False, wait_ready=False)
        await wait_until(
            "the DRA socket's failure to be logged",
            lambda: any(
                m.startswith("the DRA socket failed, retrying in")
                for m in sim.daemon.messages("warning")
            ),
            timeout=READY_TIMEOUT,  # logged as the daemon starts: a start's bound, not 10 s
            failed=sim.daemon.exited,
        )
        status, body = await sim.daemon.get("/readyz")
        assert status == 503
        assert f"'{dra}' is a directory" in body
        assert dra.is_dir()
        assert sim.kubelet.sockets() == []  # nothing to register with yet
        dra.rmdir()
        await sim.register()
        await sim.daemon.wait_ready()
        assert sim.daemon.messages("error") == []


async def test_a_topology_that_cannot_be_read_fails_the_start() -> None:
    async with open_node_sim(start=False) as sim:
        online = sim.paths.host_root / "sys/devices/system/cpu/online"
        online.unlink()
        await sim.start_daemon(register=False, wait_ready=False)
        assert await _exit_code(sim) == 1
        errors = sim.daemon.messages("error")
        assert len(errors) == 1
        assert errors[0].startswith("task state-owner failed: ")
        assert "online" in errors[0]


async def test_without_a_kubeconfig_outside_a_cluster_the_start_fails(tmp_path: Path) -> None:
    async with open_node_sim(start=False) as sim:
        # At --v=4 (upstream chart's verbosity) too, the error is the last line: one line, no
        # traceback after it (it is no bug).
        argv = [a for a in sim.command() if not a.startswith("--kubeconfig=")] + ["--v=4"]
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in {"KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"}
        }
        result = await anyio.run_process(argv, env=env, check=False)
        assert result.returncode == 1
        last = result.stderr.decode().splitlines()[-1]
        assert '"level": "error"' in last
        assert "dracpu failed to start: cannot load the in-cluster service account" in last
        assert "Traceback" not in result.stderr.decode()


async def test_wait_until_names_what_it_waited_for() -> None:
    with pytest.raises(SimError, match=re.escape("timed out after 0.05 s waiting for nothing")):
        await wait_until("nothing", lambda: False, timeout=0.05)
