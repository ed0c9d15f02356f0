"""Start-up of the daemon: ``dracpu run`` launched as a process until ``/readyz`` answers 200.

The peers are those of the node simulator (:func:`dracpu.sim.node.open_node_sim` with
``start=False``): the fake API server (with a Node, serving the slices and claims), the fake NRI
runtime and the fake kubelet (grpcio) in this process, a fake sysfs tree of the 64-CPU
``dual-socket-smt2`` machine, fresh kubelet/CDI/state directories. Each launch runs the simulator's
``dracpu run`` command line (its flags, ``--bind-address`` pinned to a free port so that readiness
can be polled from the first millisecond). Like the kubelet's plugin watcher (inotify), the fake
kubelet registers the plugin as soon as its registration socket appears (polled every
:data:`POLL_INTERVAL`): ``/readyz`` is 200 only once the kubelet has registered the plugin.

* ``daemon.start_to_ready``: milliseconds from launching the process to the first 200 from
  ``/readyz`` (polled every :data:`POLL_INTERVAL`), over :data:`RUNS` launches after one warm-up
  launch (bytecode cache); ``rss_mib`` is the p50 of the process's VmRSS (``/proc/<pid>/status``)
  read right when it is ready; ``registered_ms``: p50 from launch to the kubelet's registration;
* ``daemon.sigterm_to_exit``: milliseconds from SIGTERM to the process's exit (it stops every
  task: NRI connection, sockets, the API client).

Run: ``.venv/bin/python bench/bench_daemon.py [--runs 10]``. Not a test: nothing here asserts a
number.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import emit, percentiles
from dracpu.sim.node import NodeSim, http_get, open_node_sim

__all__ = ["main"]

RUNS = 10
# How often readiness and the registration socket are polled (seconds).
POLL_INTERVAL = 0.002
READY_TIMEOUT = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # the kernel reports kB
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def _ready(port: int) -> bool:
    try:
        status, _ = await http_get(port, "/readyz", timeout=1.0)
    except OSError:
        return False
    return status == 200


async def _launch_once(sim: NodeSim, port: int) -> tuple[float, float, float, float]:
    """One launch: (ms to ready, ms to registration, RSS MiB when ready, ms SIGTERM to exit)."""
    start = time.perf_counter()
    await sim.start_daemon(register=False, wait_ready=False)
    daemon = sim.daemon
    registered_ms = 0.0
    with anyio.fail_after(READY_TIMEOUT):
        while not sim.kubelet.sockets():  # the plugin watcher: register it once it appears
            if (reason := daemon.exited()) is not None:
                raise RuntimeError(reason)
            await anyio.sleep(POLL_INTERVAL)
        await sim.register()
        registered_ms = (time.perf_counter() - start) * 1000
        while not await _ready(port):
            if (reason := daemon.exited()) is not None:
                raise RuntimeError(reason)
            await anyio.sleep(POLL_INTERVAL)
    ready_ms = (time.perf_counter() - start) * 1000
    rss = _rss_mib(daemon.pid)
    stop = time.perf_counter()
    code = await sim.stop_daemon()
    stop_ms = (time.perf_counter() - stop) * 1000
    if code != 0:
        raise RuntimeError(f"dracpu run exited with {code} after SIGTERM")
    return ready_ms, registered_ms, rss, stop_ms


async def _run(runs: int) -> None:
    port = _free_port()
    async with open_node_sim(start=False, extra_args=[f"--bind-address=127.0.0.1:{port}"]) as sim:
        await _launch_once(sim, port)  # warm the bytecode cache
        ready, registered, rss, stop = [], [], [], []
        for _ in range(runs):
            ready_ms, registered_ms, rss_mib, stop_ms = await _launch_once(sim, port)
            ready.append(ready_ms)
            registered.append(registered_ms)
            rss.append(rss_mib)
            stop.append(stop_ms)
    p50, p99 = percentiles(ready)
    emit(
        "daemon.start_to_ready",
        "ms",
        p50=round(p50, 1),
        p99=round(p99, 1),
        n=runs,
        rss_mib=round(statistics.median(rss), 1),
        registered_ms=round(statistics.median(registered), 1),
        node=f"{sim.topology_name}, fake API server/runtime/kubelet",
    )
    p50, p99 = percentiles(stop)
    emit("daemon.sigterm_to_exit", "ms", p50=round(p50, 1), p99=round(p99, 1), n=runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=RUNS, help="timed launches")
    args = parser.parse_args()
    anyio.run(_run, args.runs, backend="asyncio")


if __name__ == "__main__":
    main()
