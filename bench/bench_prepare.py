"""NodePrepareResources as the kubelet sees it: one grouped claim over the real DRA socket.

Run: ``.venv/bin/python bench/bench_prepare.py [--n 1000] [--cdi-dir DIR] [--state-dir DIR]
[--only api|memory|floors]`` (``--only``: run one part alone, e.g. to profile it).

The daemon's prepare path runs in this process: the state owner of ``dracpu run``
(:class:`dracpu.tasks.state_owner.StateOwner`, restored from the sysfs tree of the 64-CPU
``dual-socket-smt2`` machine: the real ``apply``, the real CDI spec write and the real checkpoint
slot write with ``fdatasync``, off the event loop) and the DRA socket of
:mod:`dracpu.tasks.kubelet_plugin` (grpclib, betterproto2). ResourceClaims come through the kube
adapter (:func:`dracpu.adapters.kube.open_kube_client`, used only through its public interface)
from the fake API server of :mod:`dracpu.sim` (aiohttp) served in this same process and event
loop, so its request handling is counted in the daemon's time and CPU (a real API server runs
elsewhere). Its job here is serving, not validating (the tests do that): the OpenAPI schema
validation of written objects is off, the claim status PATCHes still really happen
(``status_patches``). The client is grpcio (the kubelet's role) in its own process, as the
kubelet is; each figure is the client-side latency of one call.

As in production, CDI specs go to tmpfs (``/dev/shm``; ``/var/run/cdi`` is on ``/run``) and the
checkpoint to a disk directory (``/var/tmp``; ``/var/lib/dracpu``); the figures name the file
system of each.

Every iteration prepares a NEW claim (4 CPUs of one of the four ``cpudevnuma00N`` devices, as a
pod's claim would be) and unprepares the claim prepared :data:`LAG` iterations before, so a
handful of claims are prepared at any time, every Prepare allocates afresh and records its
cpuset in the claim's ``status.devices`` (one PATCH per claim), and that status write has long
finished when the claim is unprepared.

Figures (ms, p50/p99):

* ``prepare.grouped_claim.v1``: NodePrepareResources with the claim read from the API server.
  ``server_cpu_ms_per_pair``: this process's CPU time (all threads, the fake API server
  included) per Prepare + Unprepare; ``status_patches``: claims whose ``status.devices`` the API
  server holds at the end;
* ``prepare.unprepare.v1``: NodeUnprepareResources of the same claims;
* ``prepare.grouped_claim.v1.memory_claims`` / ``prepare.unprepare.v1.memory_claims``: the same
  with an in-memory claim source instead of the API server (what the daemon itself costs);
* the floors of this stack, measured in the same run, each "cold" (``….cold``: with
  :data:`COLD_GAP` of other work in the caller before each call, as a Prepare meets them; see
  there) and back to back: ``floor.grpc_unary_unix`` (a bare unary call, GetInfo, from the same
  grpcio client to the same grpclib server setup on the same kind of socket),
  ``floor.kube_get_claim`` (one GET of a claim through the kube adapter from the in-process fake
  API server) and ``floor.checkpoint_write.state_dir`` (one write of a checkpoint of
  :data:`LAG` + 1 claims by :class:`dracpu.adapters.checkpoint_file.CheckpointStore`: encode,
  ``pwrite``, ``fdatasync``); and ``floor.atomic_write_fsync_2k.cdi_dir`` (one atomic replace
  of a 2 KB file, what a CDI spec write is: temp file, write, fsync, rename, fsync the
  directory);
* ``prepare.grouped_claim.v1.target``: the target, p50 <= the sum of the three cold floors'
  p50 + :data:`TARGET_MARGIN_MS` and p99 <= :data:`TARGET_P99_MS`, with what was measured and
  whether it was met (printed when the API-server variant and the floors both ran).

A Prepare is one gRPC call, one claim GET, one CDI spec write (tmpfs), the claim's device
metadata (KEP-5304: its file under the kubelet root, on the checkpoint's disk as
``/var/lib/kubelet`` is, and its CDI spec on tmpfs; no fsync) and one checkpoint slot write
(disk), plus the hand-offs to the state owner and the file effects' thread and back.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio
import anyio.to_thread
import grpc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from bench._harness import emit, percentiles
from dracpu.adapters.checkpoint_file import CheckpointStore
from dracpu.adapters.grpc_unix import open_grpc_server
from dracpu.adapters.kube import open_kube_client
from dracpu.config import Config
from dracpu.core.checkpoint_schema import CheckpointData, PreparedClaim
from dracpu.core.commands import Command
from dracpu.core.cpuset import CpuSet
from dracpu.errors import KubeNotFoundError
from dracpu.sim._pb2.dra.v1 import api_pb2 as dra_pb
from dracpu.sim._pb2.pluginregistration.v1 import api_pb2 as reg_pb
from dracpu.sim.fake_apiserver import build_resource_claim, open_fake_apiserver
from dracpu.sim.topologies import FIXTURES, write_sysfs
from dracpu.tasks import kubelet_plugin, registration
from dracpu.tasks.kubelet_plugin import ClaimSource
from dracpu.tasks.state_owner import Request, StateOwner, create_request_stream

__all__ = ["main"]

NODE = "bench-node"
NAMESPACE = "bench"
TOPOLOGY = "dual-socket-smt2"
# The four grouped devices of dual-socket-smt2 (one per NUMA node, 16 CPUs each).
DEVICES = ("cpudevnuma000", "cpudevnuma001", "cpudevnuma002", "cpudevnuma003")
CPUS = 4
# Claim i is unprepared after claim i + LAG is prepared: at most LAG + 1 claims are prepared, at
# most 2 per device (8 of its 16 CPUs), and each status PATCH has finished long before.
LAG = 4
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
# "Cold" floors: the caller keeps its CPU busy with other work this long (seconds) before each
# call. Code that runs a few ms after other work runs several times slower than back to back
# (caches, TLB; docs/performance.md has the measurements). A Prepare meets this condition (the
# kubelet's calls are far apart; here, the Unprepare and the client's own work come in
# between), a back-to-back floor does not.
COLD_GAP = 0.003
# The parts --only can pick: the API-server variant, the in-memory variant, the floors.
PARTS = ("api", "memory", "floors")
# The Prepare target, relative to this stack's floors: p50 at most the sum of the cold floors
# (gRPC call, claim GET, checkpoint write) plus this margin for our own work (ms), p99 at most
# TARGET_P99_MS.
TARGET_MARGIN_MS = 1.5
TARGET_P99_MS = 20.0


def _results(index: int) -> list[dict[str, Any]]:
    """The allocation of claim ``index``: 4 CPUs of one grouped device, as the scheduler writes."""
    return [
        {
            "request": "cpu",
            "driver": "dra.cpu",
            "pool": NODE,
            "device": DEVICES[index % len(DEVICES)],
            "shareID": str(uuid.uuid4()),
            "consumedCapacity": {"dra.cpu/cpu": str(CPUS)},
        }
    ]


def _claims(count: int) -> list[dict[str, Any]]:
    return [
        build_resource_claim(
            NAMESPACE, f"cpus-{index}", _results(index), uid=str(uuid.uuid4()), node_name=NODE
        )
        for index in range(count)
    ]


class _MemoryClaims:
    """An in-memory claim source (no API server round trip) with merge-patch status writes."""

    def __init__(self, claims: Sequence[dict[str, Any]]) -> None:
        self.objects = {(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in claims}
        for obj in claims:
            obj["metadata"].setdefault("resourceVersion", "1")

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        obj = self.objects.get((namespace, name))
        if obj is None:
            raise KubeNotFoundError(f"{namespace}/{name} not found", status=404)
        return copy.deepcopy(obj)

    async def patch_resource_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        obj = self.objects[(namespace, name)]
        obj["status"]["devices"] = copy.deepcopy(patch["status"]["devices"])
        meta = obj["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        return copy.deepcopy(obj)

    def patched(self) -> int:
        return sum(1 for obj in self.objects.values() if obj["status"].get("devices"))


# --- the kubelet (grpcio, in its own process) -----------------------------------------------------


def _kubelet_pairs(socket_path: Path, refs: list[dra_pb.Claim]) -> tuple[list[float], ...]:
    """Prepare claim i, then unprepare claim i - LAG; latencies in ms after the warm-up."""
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

        def release(ref: dra_pb.Claim) -> float:
            start = time.perf_counter()
            released = unprepare(
                dra_pb.NodeUnprepareResourcesRequest(claims=[ref]), timeout=CALL_TIMEOUT
            )
            took = (time.perf_counter() - start) * 1000
            if released.claims[ref.uid].error:
                raise SystemExit(f"unprepare failed: {released.claims[ref.uid].error}")
            return took

        for index, ref in enumerate(refs):
            start = time.perf_counter()
            answer = prepare(dra_pb.NodePrepareResourcesRequest(claims=[ref]), timeout=CALL_TIMEOUT)
            took = (time.perf_counter() - start) * 1000
            entry = answer.claims[ref.uid]
            if entry.error or len(entry.devices) != 1:
                raise SystemExit(f"prepare failed: {entry.error or answer}")
            if index >= WARMUP:
                prepare_ms.append(took)
            if index >= LAG:
                took = release(refs[index - LAG])
                if index - LAG >= WARMUP:
                    unprepare_ms.append(took)
        for ref in refs[-LAG:]:
            release(ref)
    return prepare_ms, unprepare_ms


def _busy(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` (0: return at once): what makes a call "cold"."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _bare_calls(socket_path: Path, n: int, gap: float) -> list[float]:
    samples: list[float] = []
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        get_info = channel.unary_unary(
            GET_INFO,
            request_serializer=reg_pb.InfoRequest.SerializeToString,
            response_deserializer=reg_pb.PluginInfo.FromString,
        )
        for i in range(WARMUP + n):
            _busy(gap)
            start = time.perf_counter()
            get_info(reg_pb.InfoRequest(), timeout=CALL_TIMEOUT)
            if i >= WARMUP:
                samples.append((time.perf_counter() - start) * 1000)
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
    """``--client pairs SOCKET REFS_JSON`` or ``--client bare SOCKET N GAP``: JSON samples."""
    kind, socket_path = args[0], Path(args[1])
    if kind == "pairs":
        refs = [
            dra_pb.Claim(namespace=ns, uid=uid, name=name)
            for ns, uid, name in json.loads(Path(args[2]).read_text())
        ]
        out: list[list[float]] = list(_kubelet_pairs(socket_path, refs))
    else:
        out = [_bare_calls(socket_path, int(args[2]), float(args[3]))]
    print(json.dumps(out))


# --- floors -------------------------------------------------------------------------------------


def _write_floor(directory: Path, n: int) -> list[float]:
    """One atomic replace of a 2 KB file: temp file, write, fsync, rename, fsync the directory."""
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


def _checkpoint_floor(directory: Path, n: int, gap: float) -> list[float]:
    """One checkpoint write of LAG + 1 claims by the daemon's own store (encode, pwrite into the
    older slot, fdatasync), as the state owner's file thread makes it for each Prepare."""
    store = CheckpointStore(directory / "checkpoint.json")
    store.restore()
    claims = {
        uid: PreparedClaim(uid, CpuSet.parse(f"{4 * i}-{4 * i + 3}"), NAMESPACE, f"cpus-{i}")
        for i, uid in enumerate(str(uuid.uuid4()) for _ in range(LAG + 1))
    }
    data = CheckpointData(claims=claims)
    samples: list[float] = []
    for i in range(WARMUP + n):
        _busy(gap)
        start = time.perf_counter()
        store.write(data)
        if i >= WARMUP:
            samples.append((time.perf_counter() - start) * 1000)
    for slot in store.slots:
        slot.unlink(missing_ok=True)
    return samples


async def _bare_floor(base: Path, n: int, gap: float) -> list[float]:
    bare = registration.Registrar(registration.PluginInfo(name="bench", endpoint=""))
    bare_socket = base / "kubelet" / "bare" / "bare.sock"
    async with open_grpc_server([bare], bare_socket):
        [samples] = await _client("bare", str(bare_socket), str(n), str(gap))
    return samples


async def _get_floor(
    claims: ClaimSource, refs: Sequence[tuple[str, str, str]], gap: float
) -> list[float]:
    samples: list[float] = []
    for index, (namespace, _, name) in enumerate(refs):
        _busy(gap)
        start = time.perf_counter()
        await claims.get_resource_claim(namespace, name)
        if index >= WARMUP:
            samples.append((time.perf_counter() - start) * 1000)
    return samples


# --- the daemon's prepare path ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _node(
    base: Path, cdi_dir: Path, state_dir: Path, claims: ClaimSource
) -> AsyncIterator[Path]:
    """The state owner and the DRA socket; yields the socket's path."""
    host_root = base / f"host-{uuid.uuid4()}"
    write_sysfs(FIXTURES[TOPOLOGY], host_root)
    config = Config(
        node_name=NODE,
        host_root=host_root,
        cdi_dir=cdi_dir,
        state_dir=state_dir,
        kubelet_root_dir=base / "kubelet",
    )
    send: MemoryObjectSendStream[Request[Command]]
    receive: MemoryObjectReceiveStream[Request[Command]]
    send, receive = create_request_stream()
    owner = StateOwner(config, receive)
    socket_path = base / "kubelet" / "plugins" / "dra.cpu" / "dra.sock"
    with send, receive:
        async with anyio.create_task_group() as tg:
            await tg.start(owner.run)
            await tg.start(
                partial(
                    kubelet_plugin.run,
                    socket_path,
                    send.clone(),
                    claims,
                    NODE,
                    health=owner.health,
                )
            )
            yield socket_path
            tg.cancel_scope.cancel()


async def _pairs(
    base: Path, cdi_dir: Path, state_dir: Path, claims: ClaimSource, refs: list[tuple[str, ...]]
) -> tuple[list[float], list[float], float]:
    """Prepare/unprepare every claim from the grpcio kubelet: (prepare ms, unprepare ms, server
    CPU ms per pair)."""
    refs_file = base / f"refs-{uuid.uuid4()}.json"
    refs_file.write_text(json.dumps(refs))
    async with _node(base, cdi_dir, state_dir, claims) as socket_path:
        gc.freeze()  # as dracpu run does once every task runs (dracpu.daemon._settle_heap)
        cpu_start = time.process_time()
        prepare_ms, unprepare_ms = await _client("pairs", str(socket_path), str(refs_file))
        cpu_ms = (time.process_time() - cpu_start) * 1000 / len(refs)
    return prepare_ms, unprepare_ms, cpu_ms


def _ref(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return (meta["namespace"], meta["uid"], meta["name"])


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


def _target(
    prepare: list[float], floors: Mapping[str, list[float]], where: Mapping[str, str]
) -> None:
    """The ``….target`` figure: the target from the cold floors, what was measured, met or not."""
    p50, p99 = percentiles(prepare)
    floor_p50 = {name: round(percentiles(samples)[0], 3) for name, samples in floors.items()}
    target_p50 = sum(floor_p50.values()) + TARGET_MARGIN_MS
    emit(
        "prepare.grouped_claim.v1.target",
        "ms",
        p50=round(target_p50, 3),
        p99=TARGET_P99_MS,
        n=len(prepare),
        measured_p50=round(p50, 3),
        measured_p99=round(p99, 3),
        met_p50=p50 <= target_p50,
        met_p99=p99 <= TARGET_P99_MS,
        met=p50 <= target_p50 and p99 <= TARGET_P99_MS,
        floors_p50=floor_p50,
        margin_ms=TARGET_MARGIN_MS,
        **where,
    )


async def _run(cdi_base: Path, state_base: Path, n: int, parts: frozenset[str]) -> None:
    count = WARMUP + n
    where: dict[str, str] = {}
    for label, base in (("cdi_dir", cdi_base), ("state_dir", state_base)):
        where[label] = f"{base} ({_fs_type(base)})"

    def dirs(variant: str) -> tuple[Path, Path]:
        cdi_dir, state_dir = cdi_base / variant / "cdi", state_base / variant / "state"
        cdi_dir.mkdir(parents=True)
        state_dir.mkdir(parents=True)
        return cdi_dir, state_dir

    claim = f"{CPUS} cpus of a cpudevnuma device ({TOPOLOGY}), a new claim per call"
    cold_floors: dict[str, list[float]] = {}
    api_prepare: list[float] = []
    if "api" in parts:
        # Serving, not validating: the schema validation of written claims is the tests' job.
        async with open_fake_apiserver(kubeconfig_dir=state_base, schema_validation=False) as api:
            objects = [api.add_resource_claim(obj) for obj in _claims(count)]
            refs = [_ref(obj) for obj in objects]
            async with open_kube_client(api.kubeconfig_path) as kube:
                get_ms = await _get_floor(kube, refs, 0)
                get_cold_ms = await _get_floor(kube, refs, COLD_GAP)
                cdi_dir, state_dir = dirs("api")
                api_prepare, api_unprepare, api_cpu = await _pairs(
                    state_base, cdi_dir, state_dir, kube, list(refs)
                )
            api_patched = sum(
                1
                for ns, _, name in refs
                if (api.resource_claim(ns, name).get("status") or {}).get("devices")
            )
        _emit(
            "prepare.grouped_claim.v1",
            api_prepare,
            claim=claim,
            claims_from="kube adapter + in-process fake API server (schema validation off)",
            status_patches=api_patched,
            server_cpu_ms_per_pair=round(api_cpu, 3),
            **where,
        )
        _emit("prepare.unprepare.v1", api_unprepare, **where)
        _emit("floor.kube_get_claim", get_ms, call="kube adapter GET <- in-process fake API server")
        _emit("floor.kube_get_claim.cold", get_cold_ms, gap_ms=COLD_GAP * 1000)
        cold_floors["floor.kube_get_claim.cold"] = get_cold_ms

    if "memory" in parts:
        memory = _MemoryClaims(_claims(count))
        memory_refs = [_ref(obj) for obj in memory.objects.values()]
        cdi_dir, state_dir = dirs("memory")
        mem_prepare, mem_unprepare, mem_cpu = await _pairs(
            state_base, cdi_dir, state_dir, memory, list(memory_refs)
        )
        _emit(
            "prepare.grouped_claim.v1.memory_claims",
            mem_prepare,
            claim=claim,
            claims_from="in-memory",
            status_patches=memory.patched(),
            server_cpu_ms_per_pair=round(mem_cpu, 3),
            **where,
        )
        _emit("prepare.unprepare.v1.memory_claims", mem_unprepare, **where)

    if "floors" in parts:
        floor_cdi, floor_state = dirs("floor")
        cdi_write_ms = await anyio.to_thread.run_sync(_write_floor, floor_cdi, n)
        checkpoint_ms = await anyio.to_thread.run_sync(_checkpoint_floor, floor_state, n, 0)
        checkpoint_cold_ms = await anyio.to_thread.run_sync(
            _checkpoint_floor, floor_state, n, COLD_GAP
        )
        bare_ms = await _bare_floor(state_base, n, 0)
        bare_cold_ms = await _bare_floor(state_base, n, COLD_GAP)
        _emit(
            "floor.grpc_unary_unix",
            bare_ms,
            call="grpcio client -> grpclib server (adapters.grpc_unix), GetInfo",
        )
        _emit("floor.grpc_unary_unix.cold", bare_cold_ms, gap_ms=COLD_GAP * 1000)
        _emit(
            "floor.checkpoint_write.state_dir",
            checkpoint_ms,
            claims=LAG + 1,
            dir=f"{floor_state} ({_fs_type(floor_state)})",
        )
        _emit("floor.checkpoint_write.state_dir.cold", checkpoint_cold_ms, gap_ms=COLD_GAP * 1000)
        _emit(
            "floor.atomic_write_fsync_2k.cdi_dir",
            cdi_write_ms,
            dir=f"{floor_cdi} ({_fs_type(floor_cdi)})",
        )
        cold_floors["floor.grpc_unary_unix.cold"] = bare_cold_ms
        cold_floors["floor.checkpoint_write.state_dir.cold"] = checkpoint_cold_ms

    if len(cold_floors) == 3:
        _target(api_prepare, cold_floors, where)


def _default_cdi_base() -> Path | None:
    """tmpfs when there is one: in production /var/run/cdi lives on tmpfs (/run)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else None


def _default_state_base() -> Path | None:
    """A disk directory: /var/tmp is disk-backed (FHS), as /var/lib/dracpu is; /tmp may be tmpfs."""
    var_tmp = Path("/var/tmp")
    return var_tmp if var_tmp.is_dir() and os.access(var_tmp, os.W_OK) else None


def main() -> None:
    if sys.argv[1:2] == ["--client"]:
        _client_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
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
        default=_default_state_base(),
        help="where the checkpoint goes (default: /var/tmp, a disk like /var/lib/dracpu)",
    )
    parser.add_argument(
        "--only",
        choices=PARTS,
        help="run only this part: the API-server variant, the in-memory one or the floors",
    )
    args = parser.parse_args()
    parts = frozenset([args.only] if args.only else PARTS)
    with contextlib.ExitStack() as stack:
        bases = []
        for base in (args.cdi_dir, args.state_dir):
            if base is not None:
                base.mkdir(parents=True, exist_ok=True)
            tmp = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="dracpu-bench-prepare-", dir=base)
            )
            bases.append(Path(tmp))
        anyio.run(_run, bases[0], bases[1], args.n, parts, backend="asyncio")


if __name__ == "__main__":
    main()
