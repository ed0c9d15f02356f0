"""Node state machine and checkpoint latency with 500 prepared claims on the ``big-1024`` machine.

Figures (one JSON line each, milliseconds):

- ``state.prepare`` (grouped NUMA mode: the allocator runs) and ``state.prepare.individual``:
  ``apply`` of a PrepareClaim for a 2-CPU claim with 500 claims already held, 500 exclusive
  and 200 shared containers known (the issue's target: p99 <= 1 ms);
- ``state.prepare.idempotent``: the same claim prepared again (a kubelet restart);
- ``state.unprepare``: ``apply`` of an UnprepareClaim with 500 claims held;
- ``state.create_container``: an exclusive container's CreateContainer whose reply moves the 200
  shared containers to the new pool (its pod one the claim is reserved for, as every claim's);
- ``checkpoint.encode``, ``checkpoint.decode`` of 500 claims (encode memoizes each claim's JSON,
  so this is the steady state: a Prepare re-encodes only its own claim);
- ``checkpoint.encode+write`` (500 claims) and ``checkpoint.encode+write.small`` (5 claims,
  ~1.5 KB): :meth:`CheckpointStore.write <dracpu.adapters.checkpoint_file.CheckpointStore.write>`
  of the same content again and again: encode, ``pwrite`` in place into the other slot,
  ``fdatasync`` (the size never changes). Until the two-slot store, this figure measured the
  atomic replace (temp file, fsync, rename, fsync of the directory): same name, new method;
- ``checkpoint.encode+write.growing``: one more claim per write from the 5 of the small figure on
  (a node filling up, Prepare after Prepare; ~1 KB to ~60 KB): the slots grow in steps of
  ``GROWTH_STEP`` (4 KiB), so most writes keep the file size;
  ``checkpoint.encode+write.growing.unrounded``: the same with the files grown to the exact
  document size (every write grows a slot): what the 4 KiB steps save;

  all on a real disk, in a temporary directory under ``--dir`` (default ``/var/tmp``).

Each figure applies the command to the same starting state (``apply`` is pure), so every sample
measures the same work. Run: ``.venv/bin/python bench/bench_state.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import measure
from dracpu.adapters import checkpoint_file
from dracpu.adapters.checkpoint_file import CHECKPOINT_FILE_NAME, CheckpointStore
from dracpu.core.checkpoint_schema import CheckpointData, PreparedClaim, decode, encode
from dracpu.core.commands import (
    ClaimEnv,
    Command,
    Container,
    CreateContainer,
    DeviceResult,
    PrepareClaim,
    UnprepareClaim,
)
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode
from dracpu.core.effects import Reply
from dracpu.core.node_config import NodeConfig
from dracpu.core.state import NodeState, apply, check_invariants
from dracpu.errors import DracpuError
from dracpu.sim.topologies import FIXTURES, build_topology

__all__ = ["main"]

NODE = "bench-node"
HELD = 500  # claims held before the measured command (the figure)
SHARED = 200  # shared containers the node runs (kube-system pods, sidecars, best-effort pods)
N = 2000  # samples per in-memory figure: the 99th percentile is the 20th worst
N_DISK = 300  # samples of each fsync figure (each one writes and syncs up to ~160 KiB)
SMALL = 5  # claims of the small checkpoint figure (a node running a few exclusive pods)


def uid(n: int) -> str:
    return f"b3c0a7e1-0000-4000-8000-{n:012d}"


def pod(n: int) -> str:
    """The UID of the pod claim ``n`` is reserved for (its ``status.reservedFor``)."""
    return f"5e1f2a4c-0000-4000-8000-{n:012d}"


def check(state: NodeState, command: Command) -> NodeState:
    new, effects = apply(state, command)
    reply = next(e for e in effects if isinstance(e, Reply))
    if isinstance(reply.value, DracpuError):
        raise reply.value
    return new


def populated(config: NodeConfig) -> NodeState:
    """HELD one-CPU claims (spread over the devices), each reserved for its pod and used by its
    container, plus SHARED shared containers, all pinned where they belong."""
    state = NodeState.initial(config)
    for i in range(SHARED):
        state = check(state, CreateContainer(Container(f"shared-{i}", f"pod-s{i}")))
    devices = [config.devices[name] for name in sorted(config.devices)]
    for i in range(HELD):
        device = devices[i % len(devices)]  # individual mode: the i-th CPU (HELD < CPUs)
        result = DeviceResult("cpu", NODE, device.name, 1 if device.grouped else None)
        pods = frozenset({pod(i)})
        command = PrepareClaim(uid(i), "bench", f"claim-{i}", (result,), pod_uids=pods)
        state = check(state, command)
        env = (ClaimEnv(uid(i), state.claims[uid(i)].cpus),)
        container = Container(f"excl-{i}", pod(i), name="app", claims=env)
        state = check(state, CreateContainer(container))
    check_invariants(state)
    return state


def bench_grouped(topology_name: str) -> None:
    topology = build_topology(FIXTURES[topology_name])
    config = NodeConfig.build(NODE, topology)
    state = populated(config)
    device = sorted(config.devices)[3]
    result = DeviceResult("cpu", NODE, device, 2)
    prepare = PrepareClaim(uid(HELD), "bench", "new", (result,), pod_uids=frozenset({pod(HELD)}))
    extra: dict[str, Any] = {
        "held": HELD,
        "shared": SHARED,
        "topology": topology_name,
        "mode": "grouped",
    }
    measure("state.prepare", lambda: check(state, prepare), n=N, **extra)
    prepared = check(state, prepare)
    measure("state.prepare.idempotent", lambda: check(prepared, prepare), n=N, **extra)
    measure("state.unprepare", lambda: check(state, UnprepareClaim(uid(7))), n=N, **extra)
    env = (ClaimEnv(uid(HELD), prepared.claims[uid(HELD)].cpus),)
    create = CreateContainer(Container("excl-new", pod(HELD), name="app", claims=env))
    measure("state.create_container", lambda: check(prepared, create), n=N, **extra)

    raw = encode(state.checkpoint(), 1)
    size: dict[str, Any] = {"held": HELD, "bytes": len(raw)}
    measure("checkpoint.encode", lambda: encode(state.checkpoint(), 1), n=N // 4, **size)
    measure("checkpoint.decode", lambda: decode(raw), n=N // 4, **size)


def bench_individual(topology_name: str) -> None:
    topology = build_topology(FIXTURES[topology_name])
    config = NodeConfig.build(NODE, topology, mode=CpuDeviceMode.INDIVIDUAL)
    state = populated(config)
    free = sorted(config.devices)[HELD : HELD + 2]
    results = tuple(DeviceResult(f"cpu{i}", NODE, name) for i, name in enumerate(free))
    prepare = PrepareClaim(uid(HELD), "bench", "new", results, pod_uids=frozenset({pod(HELD)}))
    extra: dict[str, Any] = {
        "held": HELD,
        "shared": SHARED,
        "topology": topology_name,
        "mode": "individual",
    }
    measure("state.prepare.individual", lambda: check(state, prepare), n=N, **extra)


def _growing(data: CheckpointData, count: int) -> list[CheckpointData]:
    """``data`` plus 1, 2, … ``count`` more one-CPU claims (on CPUs no claim of ``data`` holds)."""
    claims = dict(data.claims)
    first = 1 + max((claim.cpus.max() for claim in claims.values()), default=0)
    steps: list[CheckpointData] = []
    for i in range(count):
        extra = PreparedClaim(uid(HELD + 1 + i), CpuSet([first + i]), "bench", f"more-{i}")
        claims[extra.claim_uid] = extra
        steps.append(CheckpointData(MappingProxyType(dict(claims))))
    return steps


def bench_disk(directory: Path, topology_name: str) -> None:
    config = NodeConfig.build(NODE, build_topology(FIXTURES[topology_name]))
    state = populated(config)
    full = state.checkpoint()
    small = CheckpointData(MappingProxyType(dict(list(full.claims.items())[:SMALL])))
    with tempfile.TemporaryDirectory(prefix="dracpu-bench-", dir=directory) as tmp:
        fs: dict[str, Any] = {"dir": str(directory), "fs_block": os.statvfs(tmp).f_bsize}
        for name, data in (
            ("checkpoint.encode+write", full),
            ("checkpoint.encode+write.small", small),
        ):
            store = CheckpointStore(Path(tmp) / name / CHECKPOINT_FILE_NAME)
            store.restore()
            measure(
                name,
                partial(store.write, data),
                n=N_DISK,
                held=len(data.claims),
                bytes=len(encode(data, 1)),
                method="two-slot in-place pwrite+fdatasync",
                **fs,
            )
        default_step = checkpoint_file.GROWTH_STEP
        for name, step in (
            ("checkpoint.encode+write.growing", default_step),
            ("checkpoint.encode+write.growing.unrounded", 1),
        ):
            checkpoint_file.GROWTH_STEP = step  # the module reads it at every write
            try:
                store = CheckpointStore(Path(tmp) / name / CHECKPOINT_FILE_NAME)
                store.restore()
                steps = iter(_growing(small, N_DISK + 3))  # + the harness's warm-up calls
                measure(
                    name,
                    lambda: store.write(next(steps)),  # noqa: B023 (called before the loop moves on)
                    n=N_DISK,
                    held=f"{SMALL}+1..{N_DISK + 3}",
                    growth_step=step,
                    **fs,
                )
            finally:
                checkpoint_file.GROWTH_STEP = default_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="disk for fsync")
    parser.add_argument("--topology", default="big-1024", choices=sorted(FIXTURES))
    args = parser.parse_args()
    bench_grouped(args.topology)
    bench_individual(args.topology)
    bench_disk(args.dir, args.topology)


if __name__ == "__main__":
    main()
