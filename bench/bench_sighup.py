"""SIGHUP to slices republished on a 1024-CPU node, beside the floor of the work it must do.

The real ``dracpu run`` runs on the node simulator (:func:`dracpu.sim.node.open_node_sim`) with
the ``big-1024`` machine (2 sockets x 4 NUMA x 4 L3 x 16 cores x SMT2), in individual mode
(1024 devices, 8 slices) and grouped by NUMA node (8 devices, 1 slice). Each run takes one CPU
offline in the fake sysfs (or brings it back: the runs alternate, so every SIGHUP changes the
devices; the tree is changed before the clock starts), sends SIGHUP and waits until the fake API
server stores every slice of the pool with the new generation (polled every
:data:`POLL_INTERVAL` in this process, which also runs the fake API server).

* ``sighup.big_1024_<mode>.republished``: milliseconds from ``kill(SIGHUP)`` to the last slice
  of the new pool generation stored: the daemon reads its config file and sysfs again, builds
  the node config and the devices, commits the Resync (CDI specs of the prepared claims, none
  here), and the slice publisher builds the slices and PUTs each changed one to the fake API
  server (the real ``kubernetes`` client over HTTP; the server checks each slice against the
  apiserver's rules but not the OpenAPI schema). ``daemon_cpu_ms_p50``: the CPU time the
  daemon process used meanwhile (``/proc/<pid>/stat``, 10 ms ticks), ``fake_apiserver_cpu_ms_p50``
  this process's (the fake API server, the poll): on a busy machine the wall time is mostly
  waiting for a CPU, which these two show apart from the load (``load_average``);
* ``sighup.big_1024_<mode>.floor``: in this process, a bare topology read of the same tree
  (:func:`dracpu.adapters.sysfs.read_topology`) plus the devices and the slice objects
  (:meth:`NodeConfig.build`, :func:`build_resource_slices`): what any SIGHUP must compute, without
  the process, the event loop, the API requests.

Run: ``.venv/bin/python bench/bench_sighup.py [--runs 15]``. Not a test: nothing here asserts a
number. The target of issue 12 is 300 ms for the first figure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import emit, measure, percentiles
from dracpu import DRIVER_NAME
from dracpu.adapters.sysfs import read_topology
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode
from dracpu.core.node_config import NodeConfig
from dracpu.core.slices import build_resource_slices
from dracpu.sim.node import NodeSim, open_node_sim

__all__ = ["main"]

TOPOLOGY = "big-1024"
RUNS = 15
WARMUP = 2
POLL_INTERVAL = 0.001  # seconds between two looks at the fake API server's slices
TIMEOUT = 30.0
CPU = 1000  # the CPU that goes offline and comes back (socket 1, NUMA node 7)


@contextmanager
def _scratch() -> Iterator[Path]:
    """A directory for the node's files, on tmpfs when there is one (22k sysfs files)."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="dracpu-bench-sighup-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _generations(sim: NodeSim) -> list[int]:
    return sim.api.pool_generations(driver=DRIVER_NAME, node_name=sim.node_name)


def _cpu_ms(pid: int) -> float:
    """CPU time (user + system) process ``pid`` has used, in milliseconds (clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (proc(5), fields 14 and 15)
    return ticks * 1000 / os.sysconf("SC_CLK_TCK")


async def _one_sighup(sim: NodeSim, offline: CpuSet) -> tuple[float, float, float]:
    """Change the tree, SIGHUP, wait for the new generation everywhere: the milliseconds of
    wall time, of the daemon's CPU time and of this process's (the fake API server)."""
    before = max(_generations(sim))
    sim.set_offline(offline)
    cpu, here = _cpu_ms(sim.daemon.pid), time.process_time()
    start = time.perf_counter()
    sim.sighup()
    with anyio.fail_after(TIMEOUT):
        while True:
            generations = _generations(sim)
            if generations and min(generations) > before:
                break
            await anyio.sleep(POLL_INTERVAL)
    wall = (time.perf_counter() - start) * 1000
    return wall, _cpu_ms(sim.daemon.pid) - cpu, (time.process_time() - here) * 1000


async def _republished(mode: CpuDeviceMode, runs: int) -> None:
    with _scratch() as root:
        async with open_node_sim(topology=TOPOLOGY, mode=mode, root=root) as sim:
            await sim.wait_published(timeout=TIMEOUT)
            samples: list[float] = []
            daemon_cpu: list[float] = []
            server_cpu: list[float] = []
            for index in range(WARMUP + runs):
                offline = CpuSet([CPU]) if index % 2 == 0 else CpuSet()
                took, cpu, here = await _one_sighup(sim, offline)
                if index >= WARMUP:
                    samples.append(took)
                    daemon_cpu.append(cpu)
                    server_cpu.append(here)
            devices = len(await sim.wait_published(timeout=TIMEOUT))
            slices = len(sim.slices())
            errors = sim.daemon.messages("error")
            if errors:
                raise RuntimeError(f"the daemon logged errors: {errors}")
            p50, p99 = percentiles(samples)
            emit(
                f"sighup.big_1024_{mode}.republished",
                "ms",
                p50=round(p50, 1),
                p99=round(p99, 1),
                n=runs,
                devices=devices,
                slices=slices,
                target_ms=300,
                daemon_cpu_ms_p50=round(statistics.median(daemon_cpu), 1),
                fake_apiserver_cpu_ms_p50=round(statistics.median(server_cpu), 1),
                load_average=round(os.getloadavg()[0], 1),
            )
            host_root = sim.paths.host_root

            def floor() -> None:
                topology = read_topology(host_root)
                config = NodeConfig.build(sim.node_name, topology, mode=mode)
                build_resource_slices(sim.node_name, tuple(config.devices.values()))

            measure(f"sighup.big_1024_{mode}.floor", floor, n=runs, warmup=WARMUP)


async def _run(runs: int) -> None:
    for mode in (CpuDeviceMode.INDIVIDUAL, CpuDeviceMode.GROUPED):
        await _republished(mode, runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=RUNS, help="timed SIGHUPs per mode")
    args = parser.parse_args()
    anyio.run(_run, args.runs, backend="asyncio")


if __name__ == "__main__":
    main()
