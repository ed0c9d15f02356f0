"""NRI plugin latency, as the runtime sees it: the fake runtime calls the real plugin task, which
asks the real state owner (restored from the sysfs tree of the ``big-1024`` machine; its CDI specs
and checkpoint on tmpfs; container events have no file effects).

* ``nri.create.shared.200``: the CreateContainer call (request sent -> reply decoded by the
  runtime: what the runtime's 2 s deadline applies to) for a container without claims, with
  200 shared containers on the node (reply: the shared pool, no updates);
* ``nri.create.exclusive.200``: the same for a container with a fresh 1-CPU claim: the reply
  pins it and moves all 200 shared containers off that CPU (200 updates). Target: p99 <= 5 ms;
* ``*.full``: the whole ``FakeRuntime.create_container`` around it, which adds the fake
  runtime's own bookkeeping (applying 200 updates to its table);
* ``nri.synchronize.500``: the Synchronize call after a reconnect, 500 containers in 100 pods
  (realistic env, labels, annotations, mounts), 40 of them with a claim;
* ``nri.codec.*``: the messages alone, through Google protobuf (upb): build and encode the
  200-update reply; decode the 500-container Synchronize and read the fields we use
  (``sync_decode``), and the same plus its translation to owner commands, each container's
  ``DRA_CPUSET_*`` env parsed (``sync_read``).

Plugin, state owner and fake runtime share one process and one event loop, so every figure
includes the other side's CPU time (Google protobuf, the state machine). Run:
``.venv/bin/python bench/bench_nri.py``.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import emit, measure, percentiles
from dracpu.adapters import nri_messages as messages
from dracpu.config import Config
from dracpu.core.commands import Command, DeviceResult, PrepareClaim
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import ClaimPrepared, ContainerUpdate
from dracpu.core.node_config import NodeConfig
from dracpu.sim._pb2.nri.v1alpha1 import api_pb2 as pb
from dracpu.sim.fake_runtime import FakePod, FakeRuntime, claim_env, open_fake_runtime
from dracpu.sim.topologies import FIXTURES, write_sysfs
from dracpu.tasks import nri_plugin
from dracpu.tasks.nri_link import NriLink
from dracpu.tasks.state_owner import Request, StateOwner, create_request_stream, request

__all__ = ["main"]

NODE = "bench-node"
SHARED = 200
SYNC_CONTAINERS = 500
SYNC_PODS = 100
SYNC_CLAIMS = 40
N_CREATE = 300
N_EXCLUSIVE = 200
N_SYNC = 20
WARMUP = 5

OwnerSend = MemoryObjectSendStream[Request[Command]]


def _uid(n: int) -> str:
    return f"00000000-0000-4000-8000-{n:012d}"


def _env(n: int) -> list[str]:
    base = [f"KUBERNETES_SERVICE_{i}=10.96.0.{i}" for i in range(18)]
    return [*base, "PATH=/usr/local/bin:/usr/bin:/bin", f"HOSTNAME=pod-{n}", "HOME=/root"]


def _add_realistic(runtime: FakeRuntime, pods: int, containers: int) -> list[FakePod]:
    pod_list = [
        runtime.add_pod(
            f"app-{p}",
            namespace="prod",
            labels={f"label-{i}": f"value-{i}" for i in range(6)},
            annotations={"kubectl.kubernetes.io/last-applied-configuration": "x" * 1500},
        )
        for p in range(pods)
    ]
    for c in range(containers):
        runtime.add_container(
            pod_list[c % pods],
            f"c{c}",
            env=_env(c),
            cpus="0-1023",
            labels={f"io.kubernetes.{i}": f"v{i}" for i in range(6)},
            annotations={f"io.kubernetes.container.{i}": "y" * 40 for i in range(6)},
        )
    return pod_list


async def _prepare(send: OwnerSend, uid: str, device: str) -> CpuSet:
    results = (DeviceResult("cpus", NODE, device, consumed_cpus=1),)
    prepared = await request(send, PrepareClaim(uid, "bench", "claim", results))
    assert isinstance(prepared, ClaimPrepared)
    return prepared.cpus


@asynccontextmanager
async def _node(
    base: Path,
) -> AsyncIterator[tuple[FakeRuntime, OwnerSend, NodeConfig, TaskGroup]]:
    """A fake runtime, a state owner over big-1024 and the plugin task (started by the caller)."""
    host_root = base / "host"
    if not host_root.exists():
        write_sysfs(FIXTURES["big-1024"], host_root)
    socket = base / "nri.sock"
    config = Config(
        node_name=NODE,
        host_root=host_root,
        reserved_cpus=CpuSet.parse("0,512"),
        memory_pinning=True,
        nri_socket=socket,
        cdi_dir=base / "cdi",
        state_dir=base / "state",
        kubelet_root_dir=base / "kubelet",
    )
    link = NriLink()
    send: OwnerSend
    send, receive = create_request_stream()
    owner = StateOwner(config, receive, container_updates=link.submit)
    async with send, open_fake_runtime(socket) as runtime, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        run = partial(nri_plugin.run, config, send.clone(), lambda: owner.state, link=link)
        tg.start_soon(run)  # connects once the caller has filled the runtime's table
        yield runtime, send, owner.state.config, tg
        tg.cancel_scope.cancel()
    shutil.rmtree(base / "cdi", ignore_errors=True)
    shutil.rmtree(base / "state", ignore_errors=True)


async def _round_trips(base: Path) -> None:
    async with _node(base) as (runtime, send, config, _):
        shared_pod = runtime.add_pod("shared")
        for i in range(SHARED):
            runtime.add_container(shared_pod, f"s{i}", env=_env(i), cpus="0-1023")
        await runtime.wait_plugin(30)
        pod = runtime.add_pod("bench")

        # Shared containers: created (timed), removed (untimed) so that 200 stay shared.
        samples: list[float] = []
        for i in range(N_CREATE + WARMUP):
            container = runtime.new_container(pod, f"shared-{i}", env=_env(i))
            start = time.perf_counter()
            reply = await runtime.create_container(pod, container)
            elapsed = (time.perf_counter() - start) * 1000
            assert not reply.update
            await runtime.remove_container(container.id)
            if i >= WARMUP:
                samples.append(elapsed)
        _emit_calls(runtime, f"nri.create.shared.{SHARED}", N_CREATE)
        p50, p99 = percentiles(samples)
        emit(
            f"nri.create.shared.{SHARED}.full",
            "ms",
            p50=round(p50, 3),
            p99=round(p99, 3),
            n=N_CREATE,
        )

        # Exclusive containers: a fresh 1-CPU claim each (prepared untimed), 200 updates each.
        samples = []
        groups = sorted(config.devices)
        for i in range(N_EXCLUSIVE + WARMUP):
            uid = _uid(i + 1)
            cpus = await _prepare(send, uid, groups[i % len(groups)])
            env = [*_env(i), claim_env(uid, str(cpus))]
            container = runtime.new_container(pod, f"excl-{i}", env=env)
            start = time.perf_counter()
            reply = await runtime.create_container(pod, container)
            elapsed = (time.perf_counter() - start) * 1000
            assert reply.adjust.linux.resources.cpu.cpus == str(cpus)
            assert len(reply.update) == SHARED
            if i >= WARMUP:
                samples.append(elapsed)
        _emit_calls(runtime, f"nri.create.exclusive.{SHARED}", N_EXCLUSIVE, target_p99_ms=5)
        p50, p99 = percentiles(samples)
        emit(
            f"nri.create.exclusive.{SHARED}.full",
            "ms",
            p50=round(p50, 3),
            p99=round(p99, 3),
            n=N_EXCLUSIVE,
        )


def _emit_calls(runtime: FakeRuntime, name: str, n: int, **extra: object) -> None:
    """The last ``n`` CreateContainer calls as the runtime timed them (its ``Call.seconds``)."""
    calls = runtime.calls("CreateContainer")[-n:]
    assert len(calls) == n
    assert all(call.outcome == "ok" for call in calls)
    p50, p99 = percentiles([call.seconds * 1000 for call in calls])
    emit(name, "ms", p50=round(p50, 3), p99=round(p99, 3), n=n, **extra)


async def _synchronize(base: Path) -> None:
    async with _node(base) as (runtime, send, config, _):
        pods = _add_realistic(runtime, SYNC_PODS, SYNC_CONTAINERS - SYNC_CLAIMS)
        groups = sorted(config.devices)
        for i in range(SYNC_CLAIMS):
            uid = _uid(10_000 + i)
            cpus = await _prepare(send, uid, groups[i % len(groups)])
            runtime.add_container(pods[i], f"x{i}", env=[*_env(i), claim_env(uid, str(cpus))])
        await runtime.wait_plugin(30)
        for connection in range(2, N_SYNC + 2):
            await runtime.drop_plugin()
            info = await runtime.wait_plugin(30)
            assert info.connection == connection
        syncs = runtime.calls("Synchronize")
        assert all(call.outcome == "ok" for call in syncs)
        last = syncs[-1].response
        assert isinstance(last, pb.SynchronizeResponse)
        assert len(last.update) == SYNC_CONTAINERS
        samples = [call.seconds * 1000 for call in syncs[1:]]
        p50, p99 = percentiles(samples)
        emit(
            f"nri.synchronize.{SYNC_CONTAINERS}",
            "ms",
            p50=round(p50, 3),
            p99=round(p99, 3),
            n=len(samples),
            pods=SYNC_PODS,
            claims=SYNC_CLAIMS,
        )


def _codec_figures() -> None:
    pool = CpuSet.parse("1-511,513-1023")
    updates = [ContainerUpdate(f"{i:064x}", pool) for i in range(SHARED)]
    cpus, mems = CpuSet.parse("2-3"), CpuSet.parse("0")
    measure(
        f"nri.codec.create_reply.{SHARED}",
        lambda: messages.create_container_response("new", cpus, mems, updates),
        n=300,
    )

    request_pb = pb.SynchronizeRequest()
    for p in range(SYNC_PODS):
        request_pb.pods.add(
            id=f"{p:064x}",
            uid=_uid(p),
            name=f"app-{p}",
            namespace="prod",
            labels={f"label-{i}": f"value-{i}" for i in range(6)},
            annotations={"kubectl.kubernetes.io/last-applied-configuration": "x" * 1500},
        )
    for c in range(SYNC_CONTAINERS):
        container = request_pb.containers.add(
            id=f"{c:064x}",
            pod_sandbox_id=f"{c % SYNC_PODS:064x}",
            name=f"c{c}",
            env=_env(c),
            labels={f"io.kubernetes.{i}": f"v{i}" for i in range(6)},
            annotations={f"io.kubernetes.container.{i}": "y" * 40 for i in range(6)},
        )
        for m in range(8):
            container.mounts.add(destination=f"/m{m}", type="bind", source=f"/src/{m}")
    data = request_pb.SerializeToString()

    def decode() -> int:
        part = messages.read_synchronize(data)
        fields = [(c.id, c.pod_sandbox_id, c.name, c.state, list(c.env)) for c in part.containers]
        pods = [(p.id, p.name, p.uid, p.namespace) for p in part.pods]
        return len(fields) + len(pods)

    def read() -> int:
        part = messages.read_synchronize(data)
        return len(messages.synchronized_containers(part.pods, part.containers))

    measure(f"nri.codec.sync_decode.{SYNC_CONTAINERS}", decode, n=30, bytes=len(data))
    measure(f"nri.codec.sync_read.{SYNC_CONTAINERS}", read, n=30, bytes=len(data))


async def _all(tmp: Path) -> None:
    await _round_trips(tmp)
    await _synchronize(tmp)


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    _codec_figures()
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None  # short socket paths, tmpfs
    with tempfile.TemporaryDirectory(prefix="dracpu-bench-nri-", dir=base) as tmp:
        anyio.run(_all, Path(tmp), backend="asyncio")


if __name__ == "__main__":
    main()
