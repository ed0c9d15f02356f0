"""Fault scenarios on a simulated node (:mod:`dracpu.sim.node`), shared by the tests and the
benchmarks that time how the daemon recovers.

- :func:`api_outage`: the API server away for a while, and how long after its return the
  daemon's ResourceSlices are what they should be.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import anyio

from dracpu.sim.node import NodeSim, SimError, wait_until

__all__ = ["api_outage", "pool_specs"]

# How long the slices may take after the server's return before the scenario gives up (far more
# than the daemon should need: the figure it measures is what matters).
_CONVERGE_TIMEOUT = 30.0
# A fault count no outage exhausts: every request while it lasts is dropped.
_EVERY_REQUEST = 1_000_000


def pool_specs(sim: NodeSim) -> dict[str, Any]:
    """Our ResourceSlices as the API server stores them: name -> spec."""
    return {s["metadata"]["name"]: s["spec"] for s in sim.slices()}


async def api_outage(sim: NodeSim, seconds: float) -> float:
    """Take the API server away for ``seconds``; the seconds from its return until the stored
    slices equal those from before the outage.

    While it is away, every request is dropped without an answer, the open watch is cut, the
    node's slices are gone (the kubelet wiped them as the server went away) and the daemon gets
    a SIGHUP (a republish, which fails): the publish pass and the watch both wait in their
    backoff when the server returns. Raises :class:`SimError` when the daemon exits or the
    slices are not back within 30 s.
    """
    desired = pool_specs(sim)
    if not desired:
        raise SimError("no ResourceSlices are published: nothing to wait for after an outage")
    sim.api.fail_next(_EVERY_REQUEST, status=None)
    sim.api.break_watches()
    sim.api.kubelet_restart(sim.node_name)
    sim.daemon.process.send_signal(signal.SIGHUP)
    await anyio.sleep(seconds)
    reason = sim.daemon.exited()
    if reason is not None:
        raise SimError(f"{reason} during an API outage")
    if sim.slices():
        raise SimError("ResourceSlices were written while every request was dropped")
    sim.api.clear_faults()
    back = time.monotonic()
    await wait_until(
        "the ResourceSlices after an API outage",
        lambda: pool_specs(sim) == desired,
        timeout=_CONVERGE_TIMEOUT,
        failed=sim.daemon.exited,
    )
    return time.monotonic() - back
