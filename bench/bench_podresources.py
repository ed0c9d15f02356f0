"""One kubelet PodResources ``List`` of 500 pods holding 1000 of our claims, reconciled.

The daemon's work for one List answer, on the 1024-CPU ``big-1024`` machine in individual mode
with 1000 one-CPU claims prepared and 1000 exclusive containers (2 per pod, one claim each) and
100 shared containers known from NRI: the answer's bytes (built by Google protobuf, as the
kubelet's grpc-go would send them: each container's claim with its device, pool, CDI id and
share id) decoded by betterproto2, read into our listing
(:func:`dracpu.adapters.pod_resources.claims_listed`) and applied to the node state
(:func:`dracpu.core.state.apply` of ``PodsListed``: every claim referenced, nothing released,
the steady state of every periodic List). Figures (one JSON line each, milliseconds of this
process's CPU time, ``time.process_time``):

- ``podresources.reconcile``: decode + read + apply, the issue's figure (target p99 <= 20 ms);
- ``podresources.decode``: the floor, the bare betterproto2 decode of the same bytes
  (``ListPodResourcesResponse.parse``), measured in the same run;
- ``podresources.read`` and ``podresources.apply``: the two parts of ours on their own.

The gRPC transport (grpclib's HTTP/2 receive of the ~170 KB message) is not included. Run:
``.venv/bin/python bench/bench_podresources.py``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import emit, percentiles
from dracpu._gen.podresources import v1 as podres
from dracpu.adapters.pod_resources import claims_listed
from dracpu.core.cdi_spec import device_id
from dracpu.core.checkpoint_schema import CheckpointData, PreparedClaim
from dracpu.core.commands import ClaimEnv, Container, DeviceResult, PodsListed, Synchronize
from dracpu.core.devices import CpuDeviceMode
from dracpu.core.effects import Effect, PodsReconciled, Reply
from dracpu.core.node_config import NodeConfig
from dracpu.core.state import NodeState, apply, restore_state
from dracpu.sim._pb2.podresources.v1 import api_pb2 as pr
from dracpu.sim.topologies import FIXTURES, build_topology

__all__ = ["main"]

NODE = "bench-node"
PODS = 500
CLAIMS = 1000  # two containers per pod, one claim each
SHARED = 100  # shared containers the runtime reports (system pods, best-effort pods)
N = 200  # samples per figure


def uid(n: int) -> str:
    return str(uuid.UUID(int=n + 1, version=4))


def node_state() -> NodeState:
    """CLAIMS one-CPU claims prepared, each used by its container; SHARED shared containers."""
    config = NodeConfig.build(
        NODE, build_topology(FIXTURES["big-1024"]), mode=CpuDeviceMode.INDIVIDUAL
    )
    devices = sorted(config.devices.values(), key=lambda d: d.name)[:CLAIMS]
    claims = {
        uid(i): PreparedClaim(
            uid(i),
            device.cpus,
            "bench",
            f"claim-{i}",
            None,
            (DeviceResult("cpu", NODE, device.name),),
        )
        for i, device in enumerate(devices)
    }
    state, refused = restore_state(config, CheckpointData(MappingProxyType(claims)))
    assert not refused, refused
    containers = [
        Container(
            f"excl-{i}",
            f"pod-uid-{i // 2}",
            "bench",
            f"pod-{i // 2}",
            f"c{i % 2}",
            (ClaimEnv(uid(i), claims[uid(i)].cpus),),
        )
        for i in range(CLAIMS)
    ]
    containers += [Container(f"shared-{i}", f"shared-pod-{i}") for i in range(SHARED)]
    state, _ = apply(state, Synchronize(tuple(containers), unsolicited_updates=True))
    assert state.containers_known
    assert len(state.containers) == CLAIMS + SHARED
    return state


def answer_bytes(state: NodeState) -> bytes:
    """The kubelet's List answer for the node (Google protobuf, as another stack sends it)."""
    answer = pr.ListPodResourcesResponse()
    for p in range(PODS):
        pod = answer.pod_resources.add(name=f"pod-{p}", namespace="bench")
        for c in range(2):
            i = 2 * p + c
            claim = state.claims[uid(i)]
            container = pod.containers.add(name=f"c{c}")
            listed = container.dynamic_resources.add(claim_name=claim.name, claim_namespace="bench")
            resource = listed.claim_resources.add(
                driver_name="dra.cpu",
                pool_name=NODE,
                device_name=claim.results[0].device,
                share_id=str(uuid.UUID(int=10_000 + i, version=4)),
            )
            resource.cdi_devices.add(name=device_id(uid(i)))
    return answer.SerializeToString()


def cpu_ms(name: str, fn: Callable[[], object], *, n: int, **extra: Any) -> list[float]:
    """Call ``fn`` ``n`` times; p50/p99 of this process's CPU time per call, in ms."""
    for _ in range(3):
        fn()
    samples: list[float] = []
    for _ in range(n):
        start = time.process_time()
        fn()
        samples.append((time.process_time() - start) * 1000)
    p50, p99 = percentiles(samples)
    emit(name, "ms", p50=round(p50, 3), p99=round(p99, 3), n=n, clock="process_time", **extra)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=N, help=f"samples per figure (default {N})")
    args = parser.parse_args(argv)

    state = node_state()
    data = answer_bytes(state)
    at = 1000.0

    def reconcile() -> list[Effect]:
        listing = claims_listed(podres.ListPodResourcesResponse.parse(data))
        command = PodsListed(
            frozenset(listing.by_uid),
            frozenset(listing.by_name),
            reports_claims=listing.reports_claims,
            at=at,
            grace=300.0,
        )
        return apply(state, command)[1]

    # Every claim is referenced: nothing released, nothing written (the steady state).
    effects = reconcile()
    assert effects == [Reply(PodsReconciled((), (), True))], effects

    parsed = podres.ListPodResourcesResponse.parse(data)
    listing = claims_listed(parsed)
    assert len(listing.by_uid) == CLAIMS
    command = PodsListed(frozenset(listing.by_uid), at=at, grace=300.0)
    extra = {"pods": PODS, "claims": CLAIMS, "containers": CLAIMS + SHARED, "bytes": len(data)}
    gc.collect()
    cpu_ms("podresources.reconcile", reconcile, n=args.n, target_p99=20.0, **extra)
    cpu_ms(
        "podresources.decode",
        lambda: podres.ListPodResourcesResponse.parse(data),
        n=args.n,
        floor="bare betterproto2 decode of the same bytes",
        **extra,
    )
    cpu_ms("podresources.read", lambda: claims_listed(parsed), n=args.n, **extra)
    cpu_ms("podresources.apply", lambda: apply(state, command), n=args.n, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
