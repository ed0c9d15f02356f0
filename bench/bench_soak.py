"""A soak of the real ``dracpu run`` process, and how fast its slices come back after API outages.

The peers are the node simulator's (:func:`dracpu.sim.node.open_node_sim`): the fake API server,
the fake NRI runtime with :data:`SHARED` shared containers, the grpcio kubelet, the 64-CPU
``dual-socket-smt2`` machine. One cycle is a pod's life: the simulated scheduler allocates a
claim of 1-4 CPUs, the kubelet prepares it, the runtime creates and starts its container (checked
to be pinned to exactly the claim's CPUs), stops and removes the pod, the kubelet unprepares the
claim and the scheduler frees it. Every cycle is checked; a wrong answer stops the run.

* ``soak.cycle``: milliseconds per cycle (p50/p99 over ``--cycles``);
* ``soak.rss_growth``: MiB the daemon's resident set grew from the end of the warm-up
  (``--warmup`` cycles) to the end of the run: the median of the first three samples after the
  warm-up against the median of the last three (``VmRSS`` of ``/proc/<pid>/status``, sampled
  every ``--sample-every`` cycles); target at most 2 MiB;
* ``soak.fd_growth``: open file descriptors of the daemon (``/proc/<pid>/fd``) at the end minus
  after the warm-up; target 0;
* ``outage.slices_back``: seconds from the API server's return after an outage of
  ``--outage-seconds`` until the stored ResourceSlices equal those from before
  (:func:`dracpu.sim.faults.api_outage`: every request dropped, the watch cut, the slices wiped,
  a SIGHUP that fails), ``--outages`` times in a row on the same daemon; target below 5 s each
  (``runs`` lists every one).

Run: ``.venv/bin/python bench/bench_soak.py [--cycles 5000] [--outages 5]`` (the defaults take
a few minutes; ``--outages 0`` skips the outages). Not a test: nothing here asserts a number;
a cycle that goes wrong raises.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import cpu_list, emit, percentiles, rss_mib
from dracpu.sim.faults import api_outage
from dracpu.sim.node import NodeSim, open_node_sim

__all__ = ["main"]

CYCLES = 5000
WARMUP = 500  # the allocator's and the clients' caches fill up in the first cycles
SAMPLE_EVERY = 50
SHARED = 20  # shared containers on the node: each cycle's create and unprepare updates them
OUTAGES = 5
OUTAGE_SECONDS = 8.0  # the outage of issue 15
CLAIM_SIZES = (1, 2, 3, 4)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _cycle(sim: NodeSim, index: int) -> None:
    claim = sim.allocate(f"soak-{index}", CLAIM_SIZES[index % len(CLAIM_SIZES)])
    answer = (await sim.prepare(claim))[claim.uid]
    if answer.error:
        raise RuntimeError(f"cycle {index}: prepare failed: {answer.error}")
    held = cpu_list(sim.cdi_cpus(claim.uid) or "")
    if len(held) != CLAIM_SIZES[index % len(CLAIM_SIZES)]:
        raise RuntimeError(f"cycle {index}: the claim holds cpus {sorted(held)}")
    pod, container = await sim.run_container(f"soak-{index}", claims=[claim])
    if cpu_list(container.cpus) != held:
        raise RuntimeError(f"cycle {index}: container on {container.cpus}, claim on {held}")
    await sim.remove_pod(pod)
    sim.runtime.pods.pop(pod.id, None)
    errors = await sim.unprepare(claim)
    if errors != {claim.uid: ""}:
        raise RuntimeError(f"cycle {index}: unprepare failed: {errors}")
    sim.deallocate(claim)


async def _soak(sim: NodeSim, cycles: int, warmup: int, every: int) -> None:
    pid = sim.daemon.pid
    times: list[float] = []
    samples: list[tuple[int, float, int]] = []  # (cycle, RSS MiB, fds)
    for index in range(cycles):
        start = time.perf_counter()
        await _cycle(sim, index)
        times.append((time.perf_counter() - start) * 1000)
        if (index + 1) % every == 0:
            samples.append((index + 1, rss_mib(pid), _fds(pid)))
    errors = sim.daemon.messages("error")
    if errors:
        raise RuntimeError(f"the daemon logged errors during the soak: {errors[:3]}")
    after = [s for s in samples if s[0] > warmup]
    if len(after) < 6:
        raise RuntimeError(f"too few samples after the warm-up: {len(after)} (more --cycles)")
    p50, p99 = percentiles(times)
    emit("soak.cycle", "ms", p50=round(p50, 2), p99=round(p99, 2), n=cycles, shared=SHARED)
    start_rss = statistics.median(s[1] for s in after[:3])
    end_rss = statistics.median(s[1] for s in after[-3:])
    growth = round(end_rss - start_rss, 2)
    emit(
        "soak.rss_growth",
        "MiB",
        p50=growth,
        p99=growth,
        n=len(after),
        after_warmup_mib=round(start_rss, 1),
        end_mib=round(end_rss, 1),
        peak_mib=round(max(s[1] for s in after), 1),
        cycles=cycles,
        warmup=warmup,
        target_max=2.0,
    )
    fd_growth = after[-1][2] - after[0][2]
    emit(
        "soak.fd_growth",
        "fds",
        p50=fd_growth,
        p99=fd_growth,
        n=len(after),
        after_warmup=after[0][2],
        end=after[-1][2],
        most=max(s[2] for s in after),
        target_max=0,
    )


async def _outages(sim: NodeSim, count: int, seconds: float) -> None:
    runs = [await api_outage(sim, seconds) for _ in range(count)]
    p50, p99 = percentiles(runs)
    emit(
        "outage.slices_back",
        "s",
        p50=round(p50, 2),
        p99=round(p99, 2),
        n=count,
        runs=[round(r, 2) for r in runs],
        outage_s=seconds,
        target_max=5.0,
    )


async def _run(args: argparse.Namespace) -> None:
    async with open_node_sim(shared_containers=SHARED) as sim:
        await sim.wait_published()
        await sim.runtime.wait_plugin(30)
        if args.cycles:
            await _soak(sim, args.cycles, args.warmup, args.sample_every)
        if args.outages:
            await _outages(sim, args.outages, args.outage_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=CYCLES, help="pod lives (0: none)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="cycles before RSS counts")
    parser.add_argument("--sample-every", type=int, default=SAMPLE_EVERY, help="cycles")
    parser.add_argument("--outages", type=int, default=OUTAGES, help="API outages (0: none)")
    parser.add_argument("--outage-seconds", type=float, default=OUTAGE_SECONDS)
    anyio.run(_run, parser.parse_args(), backend="asyncio")


if __name__ == "__main__":
    main()
