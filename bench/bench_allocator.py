"""Allocator latency on the 1024-CPU ``big-1024`` machine with about half its CPUs taken.

Figures (one JSON line each, milliseconds): a 16-CPU claim (the issue's target: p99 <= 2 ms),
a 1-CPU and a 64-CPU claim, the same 16 with ``spread`` and with ``full_cores``, on two kinds of
fragmentation:

- ``random``: every CPU busy with probability 1/2, independently (the worst case for packing:
  almost no whole core, L3 or NUMA node is free);
- ``churn``: claims of 1-32 CPUs allocated until half the machine is busy, then a third of them
  released and the machine refilled, repeatedly (what a busy node looks like).

Plus ``index build``: the first allocation on a new Topology object (the per-topology index is
built once and reused). Run: ``.venv/bin/python bench/bench_allocator.py``.
"""

from __future__ import annotations

import random
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import measure
from dracpu.core.allocator import AllocationPolicy, Strategy, allocate
from dracpu.core.cpuset import CpuSet
from dracpu.core.topology import Topology
from dracpu.sim.topologies import FIXTURES, build_topology

__all__ = ["main"]

# Fixed seeds: the same fragmentation on every run, so runs compare.
RANDOM_SEED = 20240601
CHURN_SEED = 7
# Iterations per figure: enough for a stable p99 (the 99th of 2000 is the 20th worst).
N = 2000


def random_fragmentation(topology: Topology) -> CpuSet:
    rnd = random.Random(RANDOM_SEED)
    return CpuSet(cpu for cpu in topology.online if rnd.random() >= 0.5)


def churn_fragmentation(topology: Topology) -> CpuSet:
    """Free CPUs after rounds of packed claims of 1-32 CPUs and random releases."""
    rnd = random.Random(CHURN_SEED)
    free = topology.online
    claims: list[CpuSet] = []
    half = len(topology.online) // 2
    for _ in range(6):
        while len(topology.online) - len(free) < half:
            cpus = allocate(topology, free, rnd.randint(1, 32))
            claims.append(cpus)
            free = free - cpus
        for claim in rnd.sample(claims, len(claims) // 3):
            claims.remove(claim)
            free = free | claim
    while len(topology.online) - len(free) < half:
        cpus = allocate(topology, free, rnd.randint(1, 32))
        claims.append(cpus)
        free = free - cpus
    return free


def main() -> None:
    topology = build_topology(FIXTURES["big-1024"])
    policies = {
        "packed": AllocationPolicy(),
        "spread": AllocationPolicy(strategy=Strategy.SPREAD),
        "full-cores": AllocationPolicy(full_cores=True),
    }
    for pattern, free in (
        ("random", random_fragmentation(topology)),
        ("churn", churn_fragmentation(topology)),
    ):
        whole_cores = sum(1 for core in topology.cores.values() if core <= free)
        for count, policy_name in (
            (16, "packed"),
            (1, "packed"),
            (64, "packed"),
            (16, "spread"),
            (16, "full-cores"),
        ):
            policy = policies[policy_name]
            measure(
                f"allocate {count} of 1024 CPUs, half taken ({pattern}), {policy_name}",
                partial(allocate, topology, free, count, policy),
                n=N,
                cpus=1024,
                free=len(free),
                whole_free_cores=whole_cores,
                count=count,
                policy=policy_name,
                fragmentation=pattern,
            )

    free = random_fragmentation(topology)
    copies = iter(
        [Topology(cpus=dict(topology.cpus), smt_enabled=topology.smt_enabled) for _ in range(120)]
    )
    measure(
        "allocate 16 of 1024 CPUs on a new topology object (index build included)",
        lambda: allocate(next(copies), free, 16),
        n=100,
        warmup=10,
        cpus=1024,
    )


if __name__ == "__main__":
    main()
