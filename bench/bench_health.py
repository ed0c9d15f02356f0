"""Device health (KEP-4680): what a change of the devices' health costs the daemon.

Run: ``.venv/bin/python bench/bench_health.py``. Figures (ms, p50/p99), for the largest node
the fixtures have (``big-1024``: 1024 CPUs, so 1024 devices in individual mode) and the usual
grouped node (``dual-socket-smt2`` by NUMA node: 4 devices):

* ``health.assess.<node>``: :func:`dracpu.core.health.assess` of every device, what the board
  does on each change of the devices or of the online CPUs (on the event loop);
* ``health.list.<node>.build_encode``: the ``NodeWatchResourcesResponse`` of every device built
  and encoded by betterproto2: what each change costs once per version (the streams encode it
  in a worker thread and send the same bytes again on every resend).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import measure
from dracpu._gen.dra_health import v1 as health_v1
from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy, published_devices
from dracpu.core.health import assess
from dracpu.sim.topologies import FIXTURES, build_topology
from dracpu.tasks.device_health import health_response

__all__ = ["main"]

# (figure name, fixture, device mode): the largest list and the usual one.
NODES = (
    ("individual_1024", "big-1024", CpuDeviceMode.INDIVIDUAL),
    ("grouped_4", "dual-socket-smt2", CpuDeviceMode.GROUPED),
)
SAMPLES = 50
NOW = 1_760_000_000  # a Unix second


def bench_node(name: str, fixture: str, mode: CpuDeviceMode) -> None:
    topology = build_topology(FIXTURES[fixture])
    devices = published_devices(topology, reserved=EMPTY, mode=mode, group_by=GroupBy.NUMANODE)
    # one CPU offline: one device unhealthy, with a message
    online = topology.online - CpuSet([topology.online.max()])
    measure(
        f"health.assess.{name}",
        lambda: assess(devices, online, now=NOW),
        n=SAMPLES,
        devices=len(devices),
    )
    health = assess(devices, online, now=NOW)
    size = len(bytes(health_response(health_v1, "node-1", health)))
    measure(
        f"health.list.{name}.build_encode",
        lambda: bytes(health_response(health_v1, "node-1", health)),
        n=SAMPLES,
        devices=len(devices),
        bytes=size,
    )


def main() -> None:
    for name, fixture, mode in NODES:
        bench_node(name, fixture, mode)


if __name__ == "__main__":
    main()
