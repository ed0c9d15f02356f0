"""End to end on the real ``dracpu run`` process with the simulator's peers.

* ``e2e.start_to_ready``: milliseconds from launching ``dracpu run`` to ``/readyz`` 200 on the
  simulated node, the fake kubelet's registration included (``rss_mib``: VmRSS when ready);
* ``e2e.sigterm_to_exit``: milliseconds from SIGTERM to the exit of the connected daemon;
* ``e2e.prepare``: ``NodePrepareResources`` of one grouped 2-CPU claim, from the grpcio kubelet
  (a worker-thread hop included) through the daemon (claim GET, allocation, CDI spec and
  checkpoint with fsync) and back; the claim's status PATCH runs after the answer, and the fake
  API server that serves the GET and the PATCH runs in this process, on the same event loop as
  the kubelet's side of the call;
* ``e2e.create_container``: NRI ``CreateContainer`` of that claim's container from the fake
  runtime (Google protobuf) to the decoded reply, which moves all ``SHARED`` shared containers
  off the claim's CPUs;
* ``e2e.create_container.call``: the same calls as the fake runtime timed them on the socket
  (request written to reply decoded), without its own bookkeeping of the 200 updates;
* ``e2e.unprepare``: ``NodeUnprepareResources`` of the claim after its pod is gone (CDI delete,
  checkpoint, and the unsolicited UpdateContainers widening the shared containers).

Run: ``.venv/bin/python bench/bench_e2e.py``. Not a test: nothing here asserts a number.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import emit, percentiles
from dracpu.sim.node import NodeSim, open_node_sim

__all__ = ["main"]

SHARED = 200  # shared containers on the node (the brief's figure)
ROUNDS = 100  # claims walked through prepare / create / unprepare
STARTS = 5  # daemon launches timed
CLAIM_CPUS = 2


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # the kernel reports kB
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _figure(name: str, samples: list[float], **extra: object) -> None:
    p50, p99 = percentiles(samples)
    emit(name, "ms", p50=round(p50, 3), p99=round(p99, 3), n=len(samples), **extra)


async def _starts(sim: NodeSim) -> None:
    ready: list[float] = []
    rss: list[float] = []
    stop: list[float] = []
    for _ in range(STARTS):
        start = time.perf_counter()
        code = await sim.stop_daemon()
        stop.append((time.perf_counter() - start) * 1000)
        if code != 0:
            raise RuntimeError(f"dracpu run exited with {code} after SIGTERM")
        seconds = await sim.start_daemon()
        ready.append(seconds * 1000)
        rss.append(_rss_mib(sim.daemon.pid))
    _figure("e2e.start_to_ready", ready, rss_mib=round(statistics.median(rss), 1), shared=SHARED)
    _figure("e2e.sigterm_to_exit", stop, shared=SHARED)


async def _rounds(sim: NodeSim) -> None:
    prepare: list[float] = []
    create: list[float] = []
    unprepare: list[float] = []
    for index in range(ROUNDS):
        claim = sim.allocate(f"bench-{index}", CLAIM_CPUS)
        start = time.perf_counter()
        answer = (await sim.prepare(claim))[claim.uid]
        prepare.append((time.perf_counter() - start) * 1000)
        if answer.error:
            raise RuntimeError(f"prepare failed: {answer.error}")
        env = sim.cdi_env(claim.uid)
        pod = sim.runtime.add_pod(f"bench-{index}")
        container = sim.runtime.new_container(pod, "main", env=env)
        start = time.perf_counter()
        reply = await sim.runtime.create_container(pod, container)
        create.append((time.perf_counter() - start) * 1000)
        if index == 0 and len(reply.update) != SHARED:
            raise RuntimeError(f"the reply moved {len(reply.update)} containers, not {SHARED}")
        await sim.runtime.remove_container(container.id)
        sim.runtime.pods.pop(pod.id)
        start = time.perf_counter()
        errors = await sim.unprepare(claim)
        unprepare.append((time.perf_counter() - start) * 1000)
        if errors != {claim.uid: ""}:
            raise RuntimeError(f"unprepare failed: {errors}")
        sim.deallocate(claim)
    _figure("e2e.prepare", prepare, cpus=CLAIM_CPUS)
    _figure("e2e.create_container", create, shared=SHARED)
    calls = sim.runtime.calls("CreateContainer")[-ROUNDS:]
    if len(calls) != ROUNDS or any(call.outcome != "ok" for call in calls):
        raise RuntimeError(f"expected {ROUNDS} answered CreateContainer calls, got {calls!r}")
    _figure("e2e.create_container.call", [call.seconds * 1000 for call in calls], shared=SHARED)
    _figure("e2e.unprepare", unprepare, shared=SHARED)


async def _main() -> None:
    async with open_node_sim(shared_containers=SHARED) as sim:
        await sim.wait_published()
        await _rounds(sim)
        await _starts(sim)


def main() -> None:
    anyio.run(_main, backend="asyncio")


if __name__ == "__main__":
    main()
