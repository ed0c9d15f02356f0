"""A node reboot storm: the kubelet re-prepares every claim of the node right after the daemon
starts, many at a time, while the runtime synchronizes hundreds of containers.

The peers are the node simulator's (:func:`dracpu.sim.node.open_node_sim`): the fake API server,
the fake NRI runtime, the grpcio kubelet, the 1024-CPU ``big-1024`` machine, the real
``dracpu run`` process. Set-up: the daemon prepares :data:`CLAIMS` claims of :data:`CLAIM_CPUS`
CPUs (the simulated scheduler allocates them from the published devices), each claim's CPUs are
recorded from its CDI spec, and the daemon stops: its checkpoint and the CDI specs stay, as
after a reboot that kept them. The runtime holds :data:`CONTAINERS` containers: one per claim
with the claim's ``DRA_CPUSET_*`` env, the rest shared. Then the storm: the daemon starts again,
the kubelet registers it as soon as its registration socket appears and at once calls
``NodePrepareResources`` for every claim, one pod (claim) per call, :data:`CONCURRENCY` calls at
a time (a call the daemon refuses is retried after :data:`RETRY_DELAY`, as the kubelet retries a
pod's sync), while the runtime's ``Synchronize`` of every container is answered. Every claim
must get its recorded CPUs (its CDI spec, and its container's cpuset after ``Synchronize``);
anything else stops the run.

* ``storm.prepare``: milliseconds of one claim's ``NodePrepareResources`` in the storm, retries
  included (p50/p99 over the claims); ``first_call_ms`` / ``all_prepared_ms``: from the
  launch to the first call and to the last answer; ``refused``: calls answered with an error
  (retried); ``synchronize_ms``: the runtime's ``Synchronize`` call as the runtime timed it;
* ``storm.prepare.single``: the same claims' ``NodePrepareResources`` again, one at a time, in
  the same run once the storm is over: the single-claim figure beside the storm's.

Run: ``.venv/bin/python bench/bench_storm.py [--claims 200] [--concurrency 16] [--containers
500]``. The kubelet's grpcio client runs in this process, with the fake API server and runtime:
the figures are the client's latencies on one shared machine, not the daemon's time alone. Not
a test: nothing here asserts a number; a claim that does not get its recorded CPUs raises.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import cpu_list, emit, percentiles
from dracpu.sim.fake_kubelet import ClaimRef
from dracpu.sim.node import NodeSim, SimClaim, open_node_sim
from dracpu.sim.runtime_model import claim_env

__all__ = ["main"]

TOPOLOGY = "big-1024"
CLAIMS = 200
CLAIM_CPUS = 4
CONCURRENCY = 16  # the kubelet's parallel pod workers preparing claims after a reboot
CONTAINERS = 500
RETRY_DELAY = 0.1  # seconds before a refused call is made again
START_TIMEOUT = 120.0


async def _set_up(sim: NodeSim, claims: int, containers: int) -> dict[str, tuple[SimClaim, str]]:
    """Prepare the claims, fill the runtime, stop the daemon: each claim and its recorded CPUs."""
    await sim.wait_published(timeout=START_TIMEOUT)
    recorded: dict[str, tuple[SimClaim, str]] = {}
    for number in range(claims):
        claim = sim.allocate(f"storm-{number:03d}", CLAIM_CPUS, namespace="storm")
        answer = (await sim.prepare(claim))[claim.uid]
        if answer.error:
            raise RuntimeError(f"set-up: claim {claim.name}: {answer.error}")
        cpus = sim.cdi_cpus(claim.uid)
        if cpus is None:
            raise RuntimeError(f"set-up: claim {claim.name} has no CDI spec")
        recorded[claim.uid] = (claim, cpus)
    assert await sim.stop_daemon() == 0
    for claim, cpus in recorded.values():
        pod = sim.runtime.add_pod(f"{claim.name}-pod", namespace="storm")
        sim.runtime.add_container(pod, "app", env=[claim_env(claim.uid, cpus)], cpus=cpus)
    for number in range(containers - claims):
        sim.shared_container(f"shared-{number:03d}")
    return recorded


async def _prepare(sim: NodeSim, ref: ClaimRef, refused: list[str]) -> float:
    """One pod's Prepare, retried until answered without error: its milliseconds."""
    start = time.perf_counter()
    while True:
        answer = (await sim.kubelet.aprepare([ref]))[ref.uid]
        if not answer.error:
            return (time.perf_counter() - start) * 1000
        refused.append(answer.error)
        await anyio.sleep(RETRY_DELAY)


async def _storm(sim: NodeSim, recorded: dict[str, tuple[SimClaim, str]], concurrency: int) -> None:
    launched = time.perf_counter()
    await sim.start_daemon(register=False, wait_ready=False)
    with anyio.fail_after(START_TIMEOUT):
        while not sim.kubelet.sockets():  # the kubelet's plugin watcher
            if (reason := sim.daemon.exited()) is not None:
                raise RuntimeError(reason)
            await anyio.sleep(0.002)
        await sim.register()
    first_call = (time.perf_counter() - launched) * 1000
    limiter = anyio.CapacityLimiter(concurrency)
    samples: list[float] = []
    refused: list[str] = []

    async def one(ref: ClaimRef) -> None:
        async with limiter:
            samples.append(await _prepare(sim, ref, refused))

    async with anyio.create_task_group() as tg:
        for claim, _ in recorded.values():
            tg.start_soon(one, claim.ref)
    all_prepared = (time.perf_counter() - launched) * 1000
    await sim.runtime.wait_plugin(START_TIMEOUT)
    _check(sim, recorded)
    synchronize = [c for c in sim.runtime.calls("Synchronize") if c.response is not None]
    p50, p99 = percentiles(samples)
    emit(
        "storm.prepare",
        "ms",
        p50=round(p50, 2),
        p99=round(p99, 2),
        n=len(samples),
        claims=len(recorded),
        concurrency=concurrency,
        containers=len(sim.runtime.containers),
        topology=TOPOLOGY,
        first_call_ms=round(first_call, 1),
        all_prepared_ms=round(all_prepared, 1),
        refused=len(refused),
        synchronize_ms=round(synchronize[-1].seconds * 1000, 1) if synchronize else None,
    )
    singles = [await _prepare(sim, claim.ref, refused) for claim, _ in recorded.values()]
    _check(sim, recorded)
    p50, p99 = percentiles(singles)
    emit("storm.prepare.single", "ms", p50=round(p50, 2), p99=round(p99, 2), n=len(singles))


def _check(sim: NodeSim, recorded: dict[str, tuple[SimClaim, str]]) -> None:
    """Every claim has its recorded CPUs: its CDI spec, and its container's cpuset."""
    pinned = {
        env.split("=", 1)[0][len("DRA_CPUSET_") :]: container.cpus
        for container in sim.runtime.containers.values()
        for env in container.env
        if env.startswith("DRA_CPUSET_")
    }
    for uid, (claim, cpus) in recorded.items():
        spec = sim.cdi_cpus(uid)
        if spec is None or cpu_list(spec) != cpu_list(cpus):
            raise RuntimeError(f"claim {claim.name}: CDI spec cpus {spec}, recorded {cpus}")
        if cpu_list(pinned[uid]) != cpu_list(cpus):
            raise RuntimeError(f"claim {claim.name}: its container runs on {pinned[uid]}")


async def _run(args: argparse.Namespace) -> None:
    async with open_node_sim(topology=TOPOLOGY) as sim:
        recorded = await _set_up(sim, args.claims, args.containers)
        await _storm(sim, recorded, args.concurrency)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=CLAIMS)
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--containers", type=int, default=CONTAINERS)
    anyio.run(_run, parser.parse_args(), backend="asyncio")


if __name__ == "__main__":
    main()
