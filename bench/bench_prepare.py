"""NodePrepareResources as the kubelet sees it: one grouped claim over the real DRA socket.

Run: ``.venv/bin/python bench/bench_prepare.py [--n 1000] [--cdi-dir DIR] [--state-dir DIR]``.
In one process: the state owner with the real ``dracpu.core.state.apply`` on the 64-CPU
``dual-socket-smt2`` machine, real CDI spec and checkpoint writes (temp file, fsync, rename,
fsync dir), an in-memory claim source, and the DRA socket of :mod:`dracpu.tasks.kubelet_plugin`.
As in production, CDI specs go to tmpfs (``/dev/shm``; ``/var/run/cdi`` is on ``/run``) and the
checkpoint to a disk directory (the system temp dir; ``/var/lib/dracpu``); the figures name the
file system of each. The client is grpcio (the kubelet's role) in its own process, as the
kubelet is; each figure is the client-side latency of one call. ``server_cpu_ms_per_pair`` is
the daemon process's CPU time (all threads) per Prepare + Unprepare pair.

The claim asks 4 CPUs of ``cpudevnuma000``; each iteration prepares it and then unprepares it,
so state does not grow and every Prepare allocates afresh (a new claim for the allocator). The
claim's ``status.devices`` is patched once (the first Prepare); later Prepares find the cpuset
already recorded when the allocator picks the same CPUs.

Figures (ms, p50/p99):

* ``prepare.grouped_claim.v1``: NodePrepareResources (target p50 <= 3 ms, p99 <= 20 ms); the
  same figure with ``--state-dir /dev/shm`` shows the cost without a disk fsync;
* ``prepare.unprepare.v1``: the NodeUnprepareResources of the same pairs;
* floors measured in the same run: ``floor.grpc_unary_unix`` (a bare grpclib unary call,
  GetInfo, from the same grpcio client on the same kind of socket) and
  ``floor.atomic_write_fsync_2k.cdi_dir`` / ``.state_dir`` (one atomic write + fsync of a 2 KB
  file in each directory). A Prepare is one gRPC call plus two atomic writes (CDI spec,
  checkpoint), each run in a worker thread by the effect executor.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio
import anyio.to_thread
import grpc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from bench._harness import emit, percentiles
from dracpu.adapters import cdi_files
from dracpu.adapters.checkpoint_file import write_checkpoint
from dracpu.adapters.grpc_server import open_unix_server
from dracpu.core.checkpoint_schema import encode
from dracpu.core.commands import Command
from dracpu.core.effects import DeleteCdiSpec, Effect, WriteCdiSpec, WriteCheckpoint
from dracpu.core.state import NodeConfig, NodeState, apply, rollback
from dracpu.errors import KubeNotFoundError
from dracpu.sim._pb2.dra.v1 import api_pb2 as dra_pb
from dracpu.sim._pb2.pluginregistration.v1 import api_pb2 as reg_pb
from dracpu.sim.topologies import FIXTURES, build_topology
from dracpu.tasks import kubelet_plugin, registration
from dracpu.tasks.state_owner import Request, StateOwner, create_request_stream

__all__ = ["main"]

NODE = "bench-node"
TOPOLOGY = "dual-socket-smt2"
DEVICE = "cpudevnuma000"
CPUS = "4"
SAMPLES = 1000
WARMUP = 20
# The kubelet's per-call deadline (dra_plugin.go defaultClientCallTimeout).
CALL_TIMEOUT = 45.0
# A checkpoint/CDI-sized payload for the write floor.
FLOOR_BYTES = 2048
PREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
UNPREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
GET_INFO = "/pluginregistration.Registration/GetInfo"
_SCRIPT = str(Path(__file__).resolve())


class _Executor:
    """Real CDI spec and checkpoint writes; other effects are ignored."""

    def __init__(self, cdi_dir: Path, checkpoint: Path) -> None:
        self.cdi_dir = cdi_dir
        self.checkpoint = checkpoint

    async def __call__(self, effect: Effect) -> None:
        match effect:
            case WriteCdiSpec(claim_uid=uid, cpus=cpus):
                await anyio.to_thread.run_sync(cdi_files.write_spec, self.cdi_dir, uid, cpus)
            case DeleteCdiSpec(claim_uid=uid):
                await anyio.to_thread.run_sync(cdi_files.delete_spec, self.cdi_dir, uid)
            case WriteCheckpoint(checkpoint=data):
                raw = encode(data)
                await anyio.to_thread.run_sync(write_checkpoint, self.checkpoint, raw)
            case _:
                pass


class _Claims:
    """An in-memory claim source (no API server round trip)."""

    def __init__(self, claim: dict[str, Any]) -> None:
        self.claim = claim
        self.patches = 0

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        meta = self.claim["metadata"]
        if (namespace, name) != (meta["namespace"], meta["name"]):
            raise KubeNotFoundError(f"{namespace}/{name} not found", status=404)
        return copy.deepcopy(self.claim)

    async def patch_resource_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        self.patches += 1
        self.claim["status"]["devices"] = copy.deepcopy(patch["status"]["devices"])
        meta = self.claim["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        return copy.deepcopy(self.claim)


def _claim() -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "namespace": "bench",
            "name": "cpus",
            "uid": str(uuid.uuid4()),
            "resourceVersion": "1",
        },
        "spec": {"devices": {"requests": [{"name": "cpu"}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "cpu",
                            "driver": "dra.cpu",
                            "pool": NODE,
                            "device": DEVICE,
                            "consumedCapacity": {"dra.cpu/cpu": CPUS},
                        }
                    ]
                }
            }
        },
    }


def _kubelet_pairs(socket_path: Path, ref: dra_pb.Claim, n: int) -> tuple[list[float], ...]:
    """Prepare + Unprepare ``n`` times with grpcio; latencies in ms."""
    prepare_request = dra_pb.NodePrepareResourcesRequest(claims=[ref])
    unprepare_request = dra_pb.NodeUnprepareResourcesRequest(claims=[ref])
    prepare_ms: list[float] = []
    unprepare_ms: list[float] = []
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        prepare = channel.unary_unary(
            PREPARE,
            request_serializer=dra_pb.NodePrepareResourcesRequest.SerializeToString,
            response_deserializer=dra_pb.NodePrepareResourcesResponse.FromString,
        )
        unprepare = channel.unary_unary(
            UNPREPARE,
            request_serializer=dra_pb.NodeUnprepareResourcesRequest.SerializeToString,
            response_deserializer=dra_pb.NodeUnprepareResourcesResponse.FromString,
        )
        for i in range(WARMUP + n):
            start = time.perf_counter()
            answer = prepare(prepare_request, timeout=CALL_TIMEOUT)
            middle = time.perf_counter()
            released = unprepare(unprepare_request, timeout=CALL_TIMEOUT)
            end = time.perf_counter()
            entry = answer.claims[ref.uid]
            if entry.error or len(entry.devices) != 1 or released.claims[ref.uid].error:
                raise SystemExit(f"prepare failed: {entry.error or released}")
            if i >= WARMUP:
                prepare_ms.append((middle - start) * 1000)
                unprepare_ms.append((end - middle) * 1000)
    return prepare_ms, unprepare_ms


def _bare_calls(socket_path: Path, n: int) -> list[float]:
    samples: list[float] = []
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        get_info = channel.unary_unary(
            GET_INFO,
            request_serializer=reg_pb.InfoRequest.SerializeToString,
            response_deserializer=reg_pb.PluginInfo.FromString,
        )
        for i in range(WARMUP + n):
            start = time.perf_counter()
            get_info(reg_pb.InfoRequest(), timeout=CALL_TIMEOUT)
            if i >= WARMUP:
                samples.append((time.perf_counter() - start) * 1000)
    return samples


def _write_floor(directory: Path, n: int) -> list[float]:
    """One atomic write of 2 KB: temp file, write, fsync, rename, fsync the directory."""
    data = os.urandom(FLOOR_BYTES // 2).hex().encode()
    final = directory / "floor.json"
    temp = directory / ".floor.tmp"
    samples: list[float] = []
    for i in range(WARMUP + n):
        start = time.perf_counter()
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, final)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        if i >= WARMUP:
            samples.append((time.perf_counter() - start) * 1000)
    final.unlink()
    return samples


async def _client(*args: str) -> list[list[float]]:
    """Run the grpcio kubelet in its own process (the kubelet is one); its samples in ms."""
    command = [sys.executable, _SCRIPT, "--client", *args]
    result = await anyio.run_process(command, check=False)
    if result.returncode != 0:
        raise SystemExit(f"client {args[0]} failed: {result.stderr.decode(errors='replace')}")
    samples: list[list[float]] = json.loads(result.stdout)
    return samples


def _client_main(args: list[str]) -> None:
    """``--client pairs SOCKET N NS UID NAME`` or ``--client bare SOCKET N``: JSON samples."""
    kind, socket_path, n = args[0], Path(args[1]), int(args[2])
    if kind == "pairs":
        ref = dra_pb.Claim(namespace=args[3], uid=args[4], name=args[5])
        out: list[list[float]] = list(_kubelet_pairs(socket_path, ref, n))
    else:
        out = [_bare_calls(socket_path, n)]
    print(json.dumps(out))


def _emit(name: str, samples: list[float], **extra: Any) -> None:
    p50, p99 = percentiles(samples)
    emit(name, "ms", p50=round(p50, 3), p99=round(p99, 3), n=len(samples), **extra)


def _fs_type(path: Path) -> str:
    """The file system type of ``path`` (from /proc/mounts, longest matching mount point)."""
    best, kind = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    target = str(path.resolve())
    for line in mounts:
        fields = line.split()
        if len(fields) < 3 or len(fields[1]) <= len(best):
            continue
        if target == fields[1] or target.startswith(fields[1].rstrip("/") + "/"):
            best, kind = fields[1], fields[2]
    return kind


async def _run(cdi_base: Path, state_base: Path, n: int) -> None:
    config = NodeConfig.build(NODE, build_topology(FIXTURES[TOPOLOGY]))
    cdi_dir = cdi_base / "cdi"
    state_dir = state_base / "state"
    executor = _Executor(cdi_dir, state_dir / "checkpoint.json")
    claim = _claim()
    claims = _Claims(claim)
    dra_socket = state_base / "kubelet" / "plugins" / "dra.cpu" / "dra.sock"
    send: MemoryObjectSendStream[Request[Command]]
    receive: MemoryObjectReceiveStream[Request[Command]]
    send, receive = create_request_stream()
    owner: StateOwner[NodeState, Command, Effect] = StateOwner(
        receive, NodeState.initial(config), apply, executor, rollback=rollback
    )
    cdi_dir.mkdir(parents=True)
    state_dir.mkdir(parents=True)
    cdi_write_ms = await anyio.to_thread.run_sync(_write_floor, cdi_dir, n)
    state_write_ms = await anyio.to_thread.run_sync(_write_floor, state_dir, n)

    bare = registration.Registrar(registration.PluginInfo(name="bench", endpoint=""))
    bare_socket = state_base / "kubelet" / "bare" / "bare.sock"
    async with open_unix_server([bare], bare_socket):
        [bare_ms] = await _client("bare", str(bare_socket), str(n))

    with send, receive:
        async with anyio.create_task_group() as tg:
            await tg.start(owner.run)
            await tg.start(partial(kubelet_plugin.run, dra_socket, send.clone(), claims, NODE))
            meta = claim["metadata"]
            cpu_start = time.process_time()
            prepare_ms, unprepare_ms = await _client(
                "pairs", str(dra_socket), str(n), meta["namespace"], meta["uid"], meta["name"]
            )
            server_cpu_ms = (time.process_time() - cpu_start) * 1000 / (n + WARMUP)
            tg.cancel_scope.cancel()

    where = {
        "cdi_dir": f"{cdi_dir} ({_fs_type(cdi_dir)})",
        "state_dir": f"{state_dir} ({_fs_type(state_dir)})",
    }
    _emit(
        "prepare.grouped_claim.v1",
        prepare_ms,
        target_p50=3.0,
        target_p99=20.0,
        claim=f"{CPUS} cpus of {DEVICE} ({TOPOLOGY}), prepare+unprepare pairs",
        status_patches=claims.patches,
        server_cpu_ms_per_pair=round(server_cpu_ms, 3),
        **where,
    )
    _emit("prepare.unprepare.v1", unprepare_ms, **where)
    _emit("floor.grpc_unary_unix", bare_ms, call="grpcio client -> grpclib GetInfo")
    _emit(
        "floor.atomic_write_fsync_2k.cdi_dir",
        cdi_write_ms,
        dir=f"{cdi_dir} ({_fs_type(cdi_dir)})",
    )
    _emit(
        "floor.atomic_write_fsync_2k.state_dir",
        state_write_ms,
        dir=f"{state_dir} ({_fs_type(state_dir)})",
    )


def _default_cdi_base() -> Path | None:
    """tmpfs when there is one: in production /var/run/cdi lives on tmpfs (/run)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else None


def main() -> None:
    if sys.argv[1:2] == ["--client"]:
        _client_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=SAMPLES, help="calls per figure")
    parser.add_argument(
        "--cdi-dir",
        type=Path,
        default=_default_cdi_base(),
        help="where CDI specs go (default: /dev/shm, tmpfs like /var/run/cdi)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where the checkpoint goes (default: the system temp dir, like /var/lib/dracpu)",
    )
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        bases = []
        for base in (args.cdi_dir, args.state_dir):
            if base is not None:
                base.mkdir(parents=True, exist_ok=True)
            tmp = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="dracpu-bench-prepare-", dir=base)
            )
            bases.append(Path(tmp))
        anyio.run(_run, bases[0], bases[1], args.n, backend="asyncio")


if __name__ == "__main__":
    main()
