"""One claim from ``NodePrepareResources`` to the CDI file, the checkpoint and the container's
cpuset: the walk of ``docs/architecture.md`` ("The walk of one claim"), step by step.

The daemon's own pieces run in this process, composed as ``dracpu run`` composes them: the state
owner, the DRA and registration sockets (grpclib), the NRI plugin with its link, the Kubernetes
client. The peers are the simulator's fakes, which share no code with them: the API server
(:mod:`dracpu.sim.fake_apiserver`, the real ``kubernetes`` client talks to it), the kubelet
(:mod:`dracpu.sim.fake_kubelet`, grpcio) and the container runtime (:mod:`dracpu.sim.fake_runtime`,
Google protobuf and its own NRI framing). Each step is checked where a maintainer would look:
the API server's request log, the owner's state, the files, the runtime's container table. The
owner's file effects run through :class:`WalkFiles`, the real
:class:`~dracpu.adapters.node_files.NodeFiles`, which notes what had happened when each began.
Files and cpusets are read with plain ``json`` and a cpu-list parser of this file, not dracpu's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectSendStream

from dracpu.adapters.kube import open_kube_client
from dracpu.adapters.node_files import NodeFiles
from dracpu.config import Config
from dracpu.core.commands import Command
from dracpu.core.effects import Effect
from dracpu.sim.fake_apiserver import FakeApiServer, build_resource_claim, open_fake_apiserver
from dracpu.sim.fake_kubelet import ClaimRef, FakeKubelet
from dracpu.sim.fake_runtime import FakeRuntime, open_fake_runtime
from dracpu.tasks import kubelet_plugin, nri_plugin, registration
from dracpu.tasks.kubelet_plugin import DraService
from dracpu.tasks.nri_link import NriLink
from dracpu.tasks.state_owner import Request, StateOwner, create_request_stream
from tests.fixtures import scratch_dir
from tests.tasks.owner_files import host_root

pytestmark = pytest.mark.anyio

NODE = "node-a"
NAMESPACE, NAME = "default", "walk"
NUMA0 = "cpudevnuma000"  # dual-socket-smt2: NUMA node 0 holds cpus 0-7 and their siblings 32-39
NUMA0_CPUS = frozenset([*range(0, 8), *range(32, 40)])
ALL_CPUS = frozenset(range(64))
COUNT = 4
WITHIN = 10.0  # the longest any wait may take here (2 shared cores)


def cpus(text: str) -> frozenset[int]:
    """A Linux cpu list (``0-3,8``) as a set."""
    result: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        result.update(range(int(low), int(high or low) + 1))
    return frozenset(result)


@dataclass(frozen=True, slots=True)
class Began:
    """What had happened when one file effect began."""

    effect: str
    requests: tuple[tuple[str, str], ...]  # (method, path) the API server had answered
    committed: bool  # the owner's committed state held the claim
    cdi_files: tuple[str, ...]  # the CDI dir's entries


class WalkFiles(NodeFiles):
    """The owner's real file effects, each noted (in its worker thread) as it begins."""

    def __init__(self, config: Config, api: FakeApiServer, uid: str) -> None:
        super().__init__(config.cdi_dir, config.checkpoint_path, config.device_metadata_dir)
        self.api = api
        self.uid = uid
        self.owner: StateOwner | None = None
        self.began: list[Began] = []

    def run(self, effect: Effect) -> None:
        assert self.owner is not None
        self.began.append(
            Began(
                type(effect).__name__,
                tuple((r.method, r.path) for r in list(self.api.requests)),
                self.uid in self.owner.state.claims,
                tuple(sorted(p.name for p in self.cdi_dir.iterdir()))
                if self.cdi_dir.is_dir()
                else (),
            )
        )
        super().run(effect)


@dataclass(frozen=True, slots=True)
class Node:
    config: Config
    api: FakeApiServer
    runtime: FakeRuntime
    owner: StateOwner
    service: DraService
    files: WalkFiles
    kubelet: FakeKubelet


@asynccontextmanager
async def open_node(tmp: Path, uid: str) -> AsyncIterator[Node]:
    """The daemon's pieces and the simulator's peers, started in ``dracpu run``'s order, with a
    shared container already running before the NRI plugin connects."""
    config = Config(
        node_name=NODE,
        host_root=host_root("dual-socket-smt2"),
        cdi_dir=tmp / "cdi",
        state_dir=tmp / "state",
        nri_socket=tmp / "nri.sock",
        kubelet_root_dir=tmp / "kubelet",
    )
    send: MemoryObjectSendStream[Request[Command]]
    send, receive = create_request_stream()
    link = NriLink()
    async with (
        send,
        open_fake_apiserver() as api,
        open_kube_client(api.kubeconfig_path) as kube,
        open_fake_runtime(config.nri_socket) as runtime,
        anyio.create_task_group() as tg,
    ):
        api.add_node(NODE)
        files = WalkFiles(config, api, uid)
        owner = StateOwner(config, receive, container_updates=link.submit, files=files)
        files.owner = owner
        await tg.start(owner.run)
        service = await tg.start(
            partial(
                kubelet_plugin.run,
                config.dra_socket,
                send.clone(),
                kube,
                NODE,
                health=owner.health,
            )
        )
        await tg.start(partial(registration.run, config.registration_socket, config.dra_socket))
        shared = runtime.add_pod("old")
        runtime.add_container(shared, "sidecar", cpus="0-63", container_id="shared-1")
        await tg.start(
            partial(nri_plugin.run, config, send.clone(), lambda: owner.state, link=link)
        )
        await runtime.wait_plugin(WITHIN)
        with FakeKubelet(config.registration_socket.parent) as kubelet:
            await kubelet.aregister(config.registration_socket)
            yield Node(config, api, runtime, owner, service, files, kubelet)
        tg.cancel_scope.cancel()


def newest_checkpoint(config: Config) -> dict[str, Any]:
    """The checkpoint slot with the highest sequence, read as plain JSON."""
    slots = [config.checkpoint_path, config.checkpoint_path.with_name("checkpoint.1.json")]
    documents = [json.loads(path.read_text()) for path in slots if path.exists()]
    assert documents, f"no checkpoint in {config.state_dir}"
    newest: dict[str, Any] = max(documents, key=lambda document: document["sequence"])
    return newest


async def test_one_claim_from_node_prepare_resources_to_the_containers_cpuset() -> None:
    uid = str(uuid.uuid4())
    with scratch_dir("dracpu-walk-") as tmp:
        async with open_node(tmp, uid) as node:
            api, owner, runtime = node.api, node.owner, node.runtime
            claim_path = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/{NAME}"
            result = {
                "request": "cpus",
                "driver": "dra.cpu",
                "pool": NODE,
                "device": NUMA0,
                "shareID": str(uuid.uuid4()),
                "consumedCapacity": {"dra.cpu/cpu": str(COUNT)},
            }
            # The scheduler's part: the claim, allocated on this node's NUMA node 0.
            api.add_resource_claim(build_resource_claim(NAMESPACE, NAME, [result], uid=uid))
            # Before the walk: the shared container runs on every CPU, no claim, no file.
            assert runtime.containers["shared-1"].cpus == "0-63"
            assert uid not in owner.state.claims
            assert not any(node.config.cdi_dir.glob("*.json"))
            node.files.began.clear()  # the restore's own effects

            # 1. The kubelet calls NodePrepareResources on the DRA socket.
            answer = await node.kubelet.aprepare([ClaimRef(NAMESPACE, uid, NAME)], version="v1")

            # 2. DraService._read: the claim was read with the kubernetes client (a GET of the
            #    claim, before the owner's first effect began; no status PATCH yet).
            first, metadata, second = node.files.began
            assert ("GET", claim_path) in first.requests
            assert ("PATCH", f"{claim_path}/status") not in first.requests
            get = next(r for r in api.requests if (r.method, r.path) == ("GET", claim_path))
            assert get.headers["User-Agent"].startswith("dracpu/")

            # 3. core.state.apply -> core.state_claims.prepare: the owner's new state holds the
            #    claim on COUNT CPUs of the allocated device's NUMA node.
            held = cpus(str(owner.state.claims[uid].cpus))
            assert len(held) == COUNT
            assert held <= NUMA0_CPUS

            # 4. The commit phase, in order: the CDI spec, the device metadata (its file and the
            #    CDI spec that mounts it), then the checkpoint, all before the owner adopted the
            #    new state.
            assert (first.effect, metadata.effect, second.effect) == (
                "WriteCdiSpec",
                "WriteDeviceMetadata",
                "WriteCheckpoint",
            )
            assert not first.committed
            assert not metadata.committed
            assert not second.committed
            spec_name = f"dra.k8s.io-cpu_claim-{uid}.json"
            metadata_spec = f"dra.cpu_metadata_{uid}_cpus.json"
            assert spec_name not in first.cdi_files
            assert spec_name in metadata.cdi_files
            assert metadata_spec not in metadata.cdi_files
            assert {spec_name, metadata_spec} <= set(second.cdi_files)
            spec = json.loads((node.config.cdi_dir / spec_name).read_text())
            assert spec["kind"] == "dra.k8s.io/cpu"
            [device] = spec["devices"]
            assert device["name"] == f"claim-{uid}"
            [env] = device["containerEdits"]["env"]
            name, _, value = env.partition("=")
            assert name == f"DRA_CPUSET_{uid}"
            assert cpus(value) == held
            checkpoint = newest_checkpoint(node.config)
            assert cpus(checkpoint["claims"][uid]["cpus"]) == held

            # 5. The answer: the claim's device with our CDI device id and its metadata's; then,
            #    after the answer, the status PATCH with the cpuset.
            assert answer[uid].error == ""
            [prepared] = answer[uid].devices
            assert prepared.cdi_device_ids == (
                f"dra.k8s.io/cpu=claim-{uid}",
                f"dra.cpu/metadata={uid}_cpus",
            )
            assert (prepared.pool_name, prepared.device_name) == (NODE, NUMA0)
            assert prepared.request_names == ("cpus",)
            with anyio.fail_after(WITHIN):
                await node.service.patches.wait()
            [status] = api.resource_claim(NAMESPACE, NAME)["status"]["devices"]
            assert (status["driver"], status["pool"], status["device"]) == ("dra.cpu", NODE, NUMA0)
            assert cpus(status["data"]["cpuset"]) == held

            # 6. The runtime resolves the CDI device into the container's env and calls NRI
            #    CreateContainer: the container is pinned to the claim's CPUs, and in the same
            #    reply the shared container shrinks to the rest.
            pod = runtime.add_pod("app")
            await runtime.run_pod_sandbox(pod)
            container = runtime.new_container(pod, "main", env=[env])
            await runtime.create_container(pod, container)
            assert cpus(runtime.containers[container.id].cpus) == held
            assert cpus(runtime.containers["shared-1"].cpus) == ALL_CPUS - held
            assert cpus(str(owner.state.containers[container.id].cpus)) == held
