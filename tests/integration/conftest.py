"""Helpers of the end-to-end tests on the real ``dracpu run`` process (:mod:`dracpu.sim.node`).

The daemon runs as a subprocess; its peers (fake API server, fake runtime, grpcio kubelet) run in
the test's event loop. Cpusets are compared as plain ``set[int]`` parsed here, not with
dracpu's own ``CpuSet``, so a parser bug cannot hide itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dracpu.sim.node import NodeSim

__all__ = ["checkpoint_claims", "cpus", "node_cpus"]


def cpus(text: str) -> set[int]:
    """A Linux cpu list (``0-3,8``) as a set; ``""`` is empty."""
    result: set[int] = set()
    for part in text.split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        result.update(range(int(low), int(high or low) + 1))
    return result


def node_cpus(sim: NodeSim, *, numa: int | None = None) -> set[int]:
    """The online CPUs of the simulated machine (of one NUMA node)."""
    return {
        cpu for cpu, info in sim.topology.cpus.items() if numa is None or info.numa_node == numa
    }


def checkpoint_claims(path: Path) -> dict[str, Any]:
    """The ``claims`` of the daemon's checkpoint file (``{}`` when there is none)."""
    if not path.exists():
        return {}
    claims = json.loads(path.read_text())["claims"]
    assert isinstance(claims, dict)
    return claims
