"""Device health (KEP-4680) from the real ``dracpu run`` over the real DRA socket.

The simulated kubelet (grpcio, Google protobuf) registers the daemon and watches
``NodeWatchResources`` in the version it prefers; the simulated node's sysfs is a file tree the
test edits, so a CPU goes offline by rewriting ``sys/devices/system/cpu/online``. The daemon is
started with a short resend interval (a test seam: the module constant, set before the daemon
runs) so that the periodic resend shows within the test.
"""

from __future__ import annotations

import itertools
import signal
import sys
import time

import pytest

from dracpu.sim.fake_kubelet import HealthList, HealthWatch
from dracpu.sim.node import NodeSim, open_node_sim
from tests.integration.conftest import node_cpus

pytestmark = pytest.mark.anyio

# `python -c` with the resend interval set before the daemon's modules read it; the rest of the
# command line is `dracpu run`'s.
_SHORT_RESEND = (
    "import sys\n"
    "from dracpu.tasks import device_health\n"
    "device_health.RESEND_INTERVAL = float(sys.argv.pop(1))\n"
    "from dracpu.cli import main\n"
    "raise SystemExit(main())\n"
)
RESEND = 0.5
NAMES = [f"cpudevnuma00{n}" for n in range(4)]
WITHIN = 20.0  # the longest any wait may take (2 shared cores, a subprocess)


def _short_resend(sim: NodeSim) -> list[str]:
    return [sys.executable, "-c", _SHORT_RESEND, str(RESEND), "run", *sim.daemon_args]


async def _next(watch: HealthWatch) -> HealthList:
    health = await watch.anext(WITHIN)
    assert health is not None, "the daemon ended the health stream"
    return health


async def test_health_stream_of_the_real_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_node_sim(start=False) as sim:
        monkeypatch.setattr(sim, "command", lambda: _short_resend(sim))
        started = int(time.time())
        await sim.start_daemon()
        registration = sim.registration
        assert registration is not None
        assert registration.health_version == "v1"
        online = sim.paths.host_root / "sys/devices/system/cpu/online"
        everything = node_cpus(sim)
        numa1 = sorted(node_cpus(sim, numa=1))

        with sim.kubelet.watch_health() as watch:
            # the complete list at once: every published device, healthy
            first = await _next(watch)
            assert [(d.pool_name, d.device_name) for d in first.devices] == [
                (sim.node_name, name) for name in NAMES
            ]
            assert {
                (d.health, d.health_check_timeout_seconds, d.message) for d in first.devices
            } == {("HEALTHY", 30, "")}
            assert all(started - 1 <= d.last_updated_time <= time.time() for d in first.devices)

            # unchanged, it comes again every RESEND seconds
            again = [await _next(watch) for _ in range(2)]
            assert all(later.devices == first.devices for later in again)
            gaps = [b.received - a.received for a, b in itertools.pairwise([first, *again])]
            assert min(gaps) > RESEND * 0.8

            # a CPU of NUMA node 1 goes offline: that group turns unhealthy
            lost = numa1[1]
            online.write_text(",".join(str(c) for c in sorted(everything - {lost})) + "\n")
            broken = await watch.until(
                lambda h: h.unhealthy() == {"cpudevnuma001": f"cpu {lost} is offline"}, WITHIN
            )
            assert broken.health() == {
                "cpudevnuma000": "HEALTHY",
                "cpudevnuma001": "UNHEALTHY",
                "cpudevnuma002": "HEALTHY",
                "cpudevnuma003": "HEALTHY",
            }
            assert broken.devices[1].last_updated_time >= first.devices[1].last_updated_time
            assert any(
                m == f"device cpudevnuma001 is unhealthy: cpu {lost} is offline"
                for m in sim.daemon.messages("warning")
            )

            # back online: healthy again
            online.write_text(f"0-{max(everything)}\n")
            await watch.until(lambda h: h.unhealthy() == {}, WITHIN)

            # the daemon stops: the stream ends cleanly (status OK), after any list in flight
            assert await sim.stop_daemon(signal.SIGTERM) == 0
            while await watch.anext(WITHIN) is not None:
                pass
