"""The DRA socket: Prepare / Unprepare over v1 and v1beta1, driven by a grpcio kubelet.

The server runs against a REAL state owner (``dracpu.core.state.apply`` on the 64-CPU
``dual-socket-smt2`` machine) whose effects write real CDI specs and a real checkpoint into
``tmp_path``; ResourceClaims come from a small hand-written claim source. The client is grpcio
with Google-protobuf messages (``tests.peers``) and the method paths written out literally, as the
kubelet (grpc-go) sends them. Assertions read the answer, the files and the cpusets.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import stat
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import grpc
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu._gen.dra import v1 as gen_v1
from dracpu._gen.dra import v1beta1 as gen_v1beta1
from dracpu.adapters import cdi_files, checkpoint_file
from dracpu.adapters.grpc_unix import StreamClosed
from dracpu.config import Config
from dracpu.core.allocator import Strategy
from dracpu.core.commands import Command, DeviceResult, PrepareClaim
from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.device_metadata import METADATA_DIR_NAME, POD_CLAIM_NAME_ANNOTATION
from dracpu.core.effects import (
    ClaimPrepared,
)
from dracpu.core.node_config import NodeConfig
from dracpu.errors import (
    CdiError,
    DracpuError,
    KubeConflictError,
    KubeNotFoundError,
    KubeServerError,
)
from dracpu.sim.topologies import FIXTURES, build_topology
from dracpu.tasks import kubelet_plugin
from dracpu.tasks.device_health import DeviceHealthBoard
from dracpu.tasks.kubelet_plugin import DraPluginV1, DraPluginV1beta1, DraService
from dracpu.tasks.state_owner import Request, StateOwner, create_request_stream
from tests.peers import load_pb2, unix_target
from tests.tasks.owner_files import host_root

__all__ = [
    "NODE",
    "FakeClaims",
    "RunningNode",
    "claim_object",
    "grouped_result",
    "node_config",
    "running_node",
]

pytestmark = pytest.mark.anyio

G_V1 = load_pb2("dra/v1/api.proto")
G_V1BETA1 = load_pb2("dra/v1beta1/api.proto")
PEERS = {"v1": G_V1, "v1beta1": G_V1BETA1}
PATHS = {
    version: {
        "prepare": f"/k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin/NodePrepareResources",
        "unprepare": f"/k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin/NodeUnprepareResources",
    }
    for version in ("v1", "v1beta1")
}
VERSIONS = ("v1", "v1beta1")

NODE = "node-a"
DRIVER = "dra.cpu"
CALL_TIMEOUT = 20.0  # generous: 2 shared cores


def _command_stream() -> tuple[
    MemoryObjectSendStream[Request[Command]], MemoryObjectReceiveStream[Request[Command]]
]:
    return create_request_stream()


# --- the node under test ------------------------------------------------------------------------


def node_config() -> NodeConfig:
    """Grouped by NUMA node on 2 sockets x 2 NUMA x 16 CPUs: cpudevnuma000..003."""
    return NodeConfig.build(NODE, build_topology(FIXTURES["dual-socket-smt2"]))


class FakeClaims:
    """ResourceClaims by (namespace, name), with the API server's merge-patch and 409 rules."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.gets = 0
        self.patches: list[tuple[str, str, dict[str, Any]]] = []
        self.patch_errors: list[DracpuError] = []  # raised by the next patch calls, in order
        self.after_get: Callable[[dict[str, Any]], None] | None = None  # a concurrent writer
        self.patch_gate: anyio.Event | None = None  # patch calls wait for it (a slow server)
        self.get_gates: dict[str, anyio.Event] = {}  # GETs of a name wait for its event
        self.patching = 0  # patch calls in progress now
        self.most_patching = 0  # the most patch calls ever in progress at once
        self.cancelled_patches = 0  # patch calls cancelled while they waited
        self._changed = anyio.Event()  # set (and replaced) whenever a patch call starts or ends

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_until(self, check: Callable[[], bool]) -> None:
        """Wait (at most 10 s) until ``check()`` holds; re-checked when a patch starts or ends."""
        with anyio.fail_after(10):
            while not check():
                await self._changed.wait()

    def add(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self.objects[(meta["namespace"], meta["name"])] = obj

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        await anyio.lowlevel.checkpoint()
        gate = self.get_gates.get(name)
        if gate is not None:
            await gate.wait()
        self.gets += 1
        obj = self.objects.get((namespace, name))
        if obj is None:
            raise KubeNotFoundError(
                f'resourceclaims.resource.k8s.io "{name}" not found', status=404
            )
        answer = copy.deepcopy(obj)
        if self.after_get is not None:
            self.after_get(obj)
        return answer

    async def patch_resource_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        await anyio.lowlevel.checkpoint()
        self.patches.append((namespace, name, copy.deepcopy(dict(patch))))
        self.patching += 1
        self.most_patching = max(self.most_patching, self.patching)
        self._notify()
        try:
            if self.patch_gate is not None:
                await self.patch_gate.wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled_patches += 1
            raise
        finally:
            self.patching -= 1
            self._notify()
        if self.patch_errors:
            raise self.patch_errors.pop(0)
        obj = self.objects.get((namespace, name))
        if obj is None:
            raise KubeNotFoundError(f"{namespace}/{name} not found", status=404)
        wanted = patch.get("metadata", {}).get("resourceVersion")
        if wanted is not None and wanted != obj["metadata"]["resourceVersion"]:
            raise KubeConflictError("the object has been modified", status=409)
        obj.setdefault("status", {})["devices"] = copy.deepcopy(patch["status"]["devices"])
        _bump(obj)
        return copy.deepcopy(obj)


def _bump(obj: dict[str, Any]) -> None:
    meta = obj["metadata"]
    meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)


def grouped_result(
    device: str = "cpudevnuma000",
    cpus: str | None = "4",
    *,
    request: str = "cpu",
    pool: str = NODE,
    driver: str = DRIVER,
    share_id: str | None = None,
) -> dict[str, Any]:
    """One ``status.allocation.devices.results`` entry (``cpus``: consumed ``dra.cpu/cpu``)."""
    result: dict[str, Any] = {"request": request, "driver": driver, "pool": pool, "device": device}
    if cpus is not None:
        result["consumedCapacity"] = {"dra.cpu/cpu": cpus}
    if share_id is not None:
        result["shareID"] = share_id
    return result


def claim_object(
    name: str,
    results: list[dict[str, Any]] | None = None,
    *,
    namespace: str = "default",
    uid: str | None = None,
) -> dict[str, Any]:
    """A ``resource.k8s.io/v1`` ResourceClaim as the API server returns it (``results=None``:
    not allocated)."""
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "namespace": namespace,
            "name": name,
            "uid": uid or str(uuid.uuid4()),
            "resourceVersion": "100",
        },
        "spec": {"devices": {"requests": [{"name": "cpu"}]}},
        "status": {},
    }
    if results is not None:
        obj["status"]["allocation"] = {"devices": {"results": results}}
    return obj


def _ref(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return (meta["namespace"], meta["uid"], meta["name"])


@dataclass
class RunningNode:
    """A state owner + the DRA socket, served in the test's task group."""

    socket: Path
    cdi_dir: Path
    checkpoint: Path
    claims: FakeClaims
    owner: StateOwner
    service: DraService
    config: NodeConfig = field(default_factory=node_config)

    def numa_cpus(self, device: str) -> CpuSet:
        return self.config.devices[device].cpus

    def spec_env(self, uid: str) -> list[str] | None:
        """The env of a claim's CDI spec, read as plain JSON (``None``: no file)."""
        path = self.cdi_dir / f"dra.k8s.io-cpu_claim-{uid}.json"
        if not path.exists():
            return None
        spec = json.loads(path.read_bytes())
        assert spec["kind"] == "dra.k8s.io/cpu"
        [device] = spec["devices"]
        assert device["name"] == f"claim-{uid}"
        env: list[str] = device["containerEdits"]["env"]
        return env

    def checkpointed(self) -> dict[str, CpuSet]:
        """The claims of the newest checkpoint (of its two slot files)."""
        stored = checkpoint_file.read_newest(self.checkpoint)
        assert stored is not None, f"no checkpoint next to {self.checkpoint}"
        return {uid: c.cpus for uid, c in stored.data.claims.items()}


@asynccontextmanager
async def running_node(
    tmp_path: Path,
    claims: FakeClaims | None = None,
    *,
    owner_running: bool = True,
    max_pending_status_patches: int = kubelet_plugin.MAX_PENDING_STATUS_PATCHES,
    status_patch_delay: float = kubelet_plugin.STATUS_PATCH_DELAY,
) -> AsyncIterator[RunningNode]:
    config = node_config()
    cdi_dir = tmp_path / "cdi"
    checkpoint = tmp_path / "state" / "checkpoint.json"
    sock = tmp_path / "kubelet" / "plugins" / DRIVER / "dra.sock"
    # The daemon's own state owner, restored from the machine's sysfs tree: real CDI specs and
    # a real checkpoint.
    owner_config = Config(
        node_name=NODE,
        host_root=host_root("dual-socket-smt2"),
        cdi_dir=cdi_dir,
        state_dir=checkpoint.parent,
        kubelet_root_dir=tmp_path / "kubelet",
    )
    claims = FakeClaims() if claims is None else claims
    send, receive = _command_stream()
    owner = StateOwner(owner_config, receive)
    with send, receive:
        async with anyio.create_task_group() as tg:
            if owner_running:
                await tg.start(owner.run)
            else:
                receive.close()
            service = await tg.start(
                partial(
                    kubelet_plugin.run,
                    sock,
                    send.clone(),
                    claims,
                    NODE,
                    health=owner.health,
                    max_pending_status_patches=max_pending_status_patches,
                    status_patch_delay=status_patch_delay,
                )
            )
            yield RunningNode(sock, cdi_dir, checkpoint, claims, owner, service, config)
            tg.cancel_scope.cancel()


# --- the grpcio kubelet -------------------------------------------------------------------------


def _call(node: RunningNode, version: str, method: str, refs: list[tuple[str, str, str]]) -> Any:
    pb = PEERS[version]
    if method == "prepare":
        req_cls, resp_cls = pb.NodePrepareResourcesRequest, pb.NodePrepareResourcesResponse
    else:
        req_cls, resp_cls = pb.NodeUnprepareResourcesRequest, pb.NodeUnprepareResourcesResponse
    request = req_cls(claims=[pb.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in refs])
    with grpc.insecure_channel(unix_target(node.socket)) as channel:
        call = channel.unary_unary(
            PATHS[version][method],
            request_serializer=req_cls.SerializeToString,
            response_deserializer=resp_cls.FromString,
        )
        return call(request, timeout=CALL_TIMEOUT)


def _call_with_status(node: RunningNode, ref: tuple[str, str, str]) -> tuple[Any, grpc.StatusCode]:
    """A v1 Prepare of one claim: the answer, and the status of the call's trailers."""
    request = G_V1.NodePrepareResourcesRequest(
        claims=[G_V1.Claim(namespace=ref[0], uid=ref[1], name=ref[2])]
    )
    with grpc.insecure_channel(unix_target(node.socket)) as channel:
        call = channel.unary_unary(
            PATHS["v1"]["prepare"],
            request_serializer=G_V1.NodePrepareResourcesRequest.SerializeToString,
            response_deserializer=G_V1.NodePrepareResourcesResponse.FromString,
        )
        reply, state = call.with_call(request, timeout=CALL_TIMEOUT)
        return reply, state.code()


async def prepare(node: RunningNode, version: str, *refs: tuple[str, str, str]) -> Any:
    return await anyio.to_thread.run_sync(_call, node, version, "prepare", list(refs))


async def unprepare(node: RunningNode, version: str, *refs: tuple[str, str, str]) -> Any:
    return await anyio.to_thread.run_sync(_call, node, version, "unprepare", list(refs))


def _devices(entry: Any) -> list[tuple[list[str], str, str, list[str]]]:
    return [
        (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids))
        for d in entry.devices
    ]


def _env_cpus(env: list[str] | None, uid: str) -> CpuSet:
    assert env is not None, f"no CDI spec for {uid}"
    [entry] = env
    key, _, value = entry.partition("=")
    assert key == f"DRA_CPUSET_{uid}"
    return CpuSet.parse(value)


# --- prepare / unprepare ------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
async def test_prepare_answers_devices_writes_cdi_checkpoint_and_status(
    tmp_path: Path, version: str
) -> None:
    claims = FakeClaims()
    obj = claim_object(
        "pod-cpus",
        [grouped_result("cpudevnuma001", "4", request="cpu/fast", share_id="share-1")],
    )
    claims.add(obj)
    ns, uid, name = _ref(obj)
    async with running_node(tmp_path, claims) as node:
        reply = await prepare(node, version, (ns, uid, name))

        assert list(reply.claims) == [uid]
        entry = reply.claims[uid]
        assert entry.error == ""
        assert _devices(entry) == [
            (
                ["cpu"],
                NODE,
                "cpudevnuma001",
                [f"dra.k8s.io/cpu=claim-{uid}", f"dra.cpu/metadata={uid}_cpu"],
            )
        ]
        if version == "v1":
            assert entry.devices[0].HasField("share_id")
            assert entry.devices[0].share_id == "share-1"
        cpus = _env_cpus(node.spec_env(uid), uid)
        assert len(cpus) == 4
        assert cpus <= node.numa_cpus("cpudevnuma001")
        assert node.checkpointed() == {uid: cpus}
        assert os.stat(node.checkpoint).st_mode & 0o777 == 0o600
        # status.devices records the cpuset on our device (best effort, after the answer)
        await node.service.patches.wait()
        stored = claims.objects[(ns, name)]["status"]["devices"]
        assert stored == [
            {
                "driver": DRIVER,
                "pool": NODE,
                "device": "cpudevnuma001",
                "shareID": "share-1",
                "data": {"cpuset": str(cpus)},
            }
        ]


@pytest.mark.parametrize("version", VERSIONS)
async def test_unprepare_removes_spec_and_frees_cpus_unknown_claim_succeeds(
    tmp_path: Path, version: str
) -> None:
    claims = FakeClaims()
    first = claim_object("a", [grouped_result("cpudevnuma000", "16")])
    claims.add(first)
    async with running_node(tmp_path, claims) as node:
        reply = await prepare(node, version, _ref(first))
        assert reply.claims[_ref(first)[1]].error == ""
        if version == "v1":  # no shareID in the allocation: none in the answer
            assert not reply.claims[_ref(first)[1]].devices[0].HasField("share_id")
        full = _env_cpus(node.spec_env(_ref(first)[1]), _ref(first)[1])
        assert full == node.numa_cpus("cpudevnuma000")

        unknown = ("default", str(uuid.uuid4()), "gone")
        reply = await unprepare(node, version, _ref(first), unknown)

        assert {uid: e.error for uid, e in reply.claims.items()} == {
            _ref(first)[1]: "",
            unknown[1]: "",
        }
        assert node.spec_env(_ref(first)[1]) is None
        assert node.checkpointed() == {}
        # the NUMA node's 16 CPUs are free again: a claim for all of them fits
        second = claim_object("b", [grouped_result("cpudevnuma000", "16")])
        claims.add(second)
        reply = await prepare(node, version, _ref(second))
        assert reply.claims[_ref(second)[1]].error == ""
        assert _env_cpus(node.spec_env(_ref(second)[1]), _ref(second)[1]) == full


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _metadata_mount(cdi_dir: Path, uid: str, request: str) -> tuple[Any, Any]:
    """The mount of a request's metadata CDI spec and the document it mounts (plain JSON)."""
    spec = json.loads((cdi_dir / f"dra.cpu_metadata_{uid}_{request}.json").read_text())
    [mount] = spec["devices"][0]["containerEdits"]["mounts"]
    return mount, json.loads(Path(mount["hostPath"]).read_text())


@pytest.mark.parametrize("version", VERSIONS)
async def test_each_request_gets_its_metadata_mount_on_its_first_device(
    tmp_path: Path, version: str
) -> None:
    """The Go helper's rule (kubeletplugin NodePrepareResources): the metadata CDI id of a
    request goes on the first device of that request only. The claim was made from a template
    (its pod-claim-name annotation): the mount goes under resourceclaimtemplates/<pod name>."""
    claims = FakeClaims()
    obj = claim_object(
        "pod-1-cpus-x7k2p",
        [
            grouped_result("cpudevnuma000", "1", request="main"),
            grouped_result("cpudevnuma001", "2", request="side"),
            grouped_result("cpudevnuma000", "1", request="main"),
        ],
    )
    obj["metadata"]["annotations"] = {POD_CLAIM_NAME_ANNOTATION: "cpus"}
    claims.add(obj)
    ns, uid, name = _ref(obj)
    claim_id = f"dra.k8s.io/cpu=claim-{uid}"
    async with running_node(tmp_path, claims) as node:
        reply = await prepare(node, version, (ns, uid, name))
        assert reply.claims[uid].error == ""
        assert _devices(reply.claims[uid]) == [
            (["main"], NODE, "cpudevnuma000", [claim_id, f"dra.cpu/metadata={uid}_main"]),
            (["side"], NODE, "cpudevnuma001", [claim_id, f"dra.cpu/metadata={uid}_side"]),
            (["main"], NODE, "cpudevnuma000", [claim_id]),
        ]
        metadata_dir = tmp_path / "kubelet" / "plugins" / DRIVER / METADATA_DIR_NAME
        for request, count in (("main", 2), ("side", 1)):
            mount, document = _metadata_mount(node.cdi_dir, uid, request)
            assert mount == {
                "hostPath": str(metadata_dir / f"{uid}_{request}.json"),
                "containerPath": "/var/run/kubernetes.io/dra-device-attributes/"
                f"resourceclaimtemplates/cpus/{request}/dra.cpu-metadata.json",
                "options": ["ro", "bind"],
            }
            assert document["podClaimName"] == "cpus"
            assert document["metadata"]["name"] == name
            [entry] = document["requests"]
            assert (entry["name"], len(entry["devices"])) == (request, count)

        reply = await unprepare(node, version, (ns, uid, name))
        assert reply.claims[uid].error == ""
        assert _listing(node.cdi_dir) == []
        assert _listing(metadata_dir) == []


async def test_repeated_prepare_is_idempotent_and_rewrites_a_lost_cdi_spec(tmp_path: Path) -> None:
    claims = FakeClaims()
    obj = claim_object("c", [grouped_result("cpudevnuma002", "3")])
    claims.add(obj)
    ns, uid, name = _ref(obj)
    async with running_node(tmp_path, claims) as node:
        first = await prepare(node, "v1", (ns, uid, name))
        cpus = _env_cpus(node.spec_env(uid), uid)
        await node.service.patches.wait()
        assert len(claims.patches) == 1
        (node.cdi_dir / f"dra.k8s.io-cpu_claim-{uid}.json").unlink()  # a reboot empties the dir

        again = await prepare(node, "v1beta1", (ns, uid, name))

        assert _devices(again.claims[uid]) == _devices(first.claims[uid])
        assert again.claims[uid].error == ""
        assert _env_cpus(node.spec_env(uid), uid) == cpus
        assert node.checkpointed() == {uid: cpus}
        await node.service.patches.wait()
        assert len(claims.patches) == 1  # the status already says so: no second patch


async def test_prepare_records_the_claims_pods_and_a_later_prepare_their_change(
    tmp_path: Path,
) -> None:
    pod_a, pod_b = str(uuid.uuid4()), str(uuid.uuid4())
    claims = FakeClaims()
    obj = claim_object("shared", [grouped_result("cpudevnuma002", "2")])
    obj["status"]["reservedFor"] = [{"resource": "pods", "name": "a", "uid": pod_a}]
    claims.add(obj)
    ns, uid, name = _ref(obj)

    def recorded() -> frozenset[str]:
        stored = checkpoint_file.read_newest(node.checkpoint)
        assert stored is not None
        return stored.data.claims[uid].pod_uids

    async with running_node(tmp_path, claims) as node:
        assert (await prepare(node, "v1", (ns, uid, name))).claims[uid].error == ""
        assert recorded() == {pod_a}
        # A second pod shares the claim: the scheduler adds it, the kubelet prepares again.
        grown = copy.deepcopy(claims.objects[(ns, name)])
        grown["status"]["reservedFor"].append({"resource": "pods", "name": "b", "uid": pod_b})
        claims.add(grown)
        assert (await prepare(node, "v1", (ns, uid, name))).claims[uid].error == ""
        assert recorded() == {pod_a, pod_b}
        assert node.owner.state.claims[uid].pod_uids == {pod_a, pod_b}


async def test_claim_without_our_devices_is_prepared_with_no_devices(tmp_path: Path) -> None:
    claims = FakeClaims()
    obj = claim_object("gpu", [grouped_result("gpu-0", None, driver="gpu.example.com")])
    claims.add(obj)
    async with running_node(tmp_path, claims) as node:
        reply = await prepare(node, "v1", _ref(obj))
        entry = reply.claims[_ref(obj)[1]]
        assert (entry.error, _devices(entry)) == ("", [])
        assert node.spec_env(_ref(obj)[1]) is None
        await node.service.patches.wait()
        assert claims.patches == []


async def test_concurrent_calls_over_both_versions(tmp_path: Path) -> None:
    claims = FakeClaims()
    objs = [
        claim_object(f"pod-{i}", [grouped_result(f"cpudevnuma00{i % 4}", "2")]) for i in range(16)
    ]
    for obj in objs:
        claims.add(obj)
    pairs = [(objs[2 * i], objs[2 * i + 1]) for i in range(8)]
    replies: dict[int, Any] = {}
    async with running_node(tmp_path, claims) as node:

        async def call(i: int) -> None:
            a, b = pairs[i]
            replies[i] = await prepare(node, VERSIONS[i % 2], _ref(a), _ref(b))

        async with anyio.create_task_group() as tg:
            for i in range(len(pairs)):
                tg.start_soon(call, i)

        seen = EMPTY
        for i, (a, b) in enumerate(pairs):
            for obj in (a, b):
                uid = _ref(obj)[1]
                assert replies[i].claims[uid].error == ""
                cpus = _env_cpus(node.spec_env(uid), uid)
                device = obj["status"]["allocation"]["devices"]["results"][0]["device"]
                assert len(cpus) == 2
                assert cpus <= node.numa_cpus(device)
                assert cpus.isdisjoint(seen)
                seen |= cpus
        assert len(node.checkpointed()) == 16

        async def release(i: int) -> None:
            a, b = pairs[i]
            reply = await unprepare(node, VERSIONS[(i + 1) % 2], _ref(a), _ref(b))
            assert [e.error for e in reply.claims.values()] == ["", ""]

        async with anyio.create_task_group() as tg:
            for i in range(len(pairs)):
                tg.start_soon(release, i)
        assert node.checkpointed() == {}
        assert list(node.cdi_dir.glob("*.json")) == []


# --- bad input: one claim fails, the others of the call are prepared ----------------------------


def _not_found(claims: FakeClaims) -> tuple[str, str, str]:
    return ("default", str(uuid.uuid4()), "missing")


def _uid_mismatch(claims: FakeClaims) -> tuple[str, str, str]:
    obj = claim_object("replaced", [grouped_result()])
    claims.add(obj)
    ns, _, name = _ref(obj)
    return (ns, str(uuid.uuid4()), name)


def _bad_claim(results: list[dict[str, Any]] | None) -> Callable[[FakeClaims], tuple[str, ...]]:
    def make(claims: FakeClaims) -> tuple[str, ...]:
        obj = claim_object("bad", results)
        claims.add(obj)
        return _ref(obj)

    return make


BAD_CLAIMS: dict[str, tuple[Callable[[FakeClaims], tuple[str, ...]], str]] = {
    "not found": (_not_found, "not found"),
    "uid mismatch": (_uid_mismatch, "it was replaced"),
    "unallocated": (_bad_claim(None), "is not allocated"),
    "capacity 0": (_bad_claim([grouped_result(cpus="0")]), "not positive"),
    "fractional capacity": (_bad_claim([grouped_result(cpus="1500m")]), "not a whole number"),
    "no capacity": (_bad_claim([grouped_result(cpus=None)]), "no consumedCapacity"),
    "more than the group": (_bad_claim([grouped_result(cpus="17")]), "asks 17 CPUs but only"),
    "unknown device": (
        _bad_claim([grouped_result("cpudevnuma009")]),
        "'cpudevnuma009' is not published by this node",
    ),
    "another node's pool": (_bad_claim([grouped_result(pool="node-b")]), "another node"),
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", sorted(BAD_CLAIMS))
async def test_bad_claim_gets_its_own_error_others_are_prepared(
    tmp_path: Path, case: str, version: str
) -> None:
    make, expected = BAD_CLAIMS[case]
    claims = FakeClaims()
    good = claim_object("good", [grouped_result("cpudevnuma000", "4")])
    claims.add(good)
    bad = make(claims)
    assert len(bad) == 3
    async with running_node(tmp_path, claims) as node:
        reply = await prepare(node, version, _ref(good), (bad[0], bad[1], bad[2]))

        assert set(reply.claims) == {_ref(good)[1], bad[1]}
        assert expected in reply.claims[bad[1]].error
        assert _devices(reply.claims[bad[1]]) == []
        good_uid = _ref(good)[1]
        assert reply.claims[good_uid].error == ""
        cpus = _env_cpus(node.spec_env(good_uid), good_uid)
        assert node.checkpointed() == {good_uid: cpus}
        assert node.spec_env(bad[1]) is None

        # still serving: the same bad claim again, and a fresh good one
        again = await prepare(node, version, (bad[0], bad[1], bad[2]))
        assert expected in again.claims[bad[1]].error
        other = claim_object("other", [grouped_result("cpudevnuma003", "1")])
        claims.add(other)
        reply = await prepare(node, version, _ref(other))
        assert reply.claims[_ref(other)[1]].error == ""


async def test_group_exhausted_by_earlier_claims(tmp_path: Path) -> None:
    claims = FakeClaims()
    big = claim_object("big", [grouped_result("cpudevnuma000", "14")])
    small = claim_object("small", [grouped_result("cpudevnuma000", "3")])
    claims.add(big)
    claims.add(small)
    async with running_node(tmp_path, claims) as node:
        assert (await prepare(node, "v1", _ref(big))).claims[_ref(big)[1]].error == ""
        reply = await prepare(node, "v1", _ref(small))
        assert "asks 3 CPUs but only 2 of the device's 16 are free" in (
            reply.claims[_ref(small)[1]].error
        )
        assert set(node.checkpointed()) == {_ref(big)[1]}


async def test_unprepare_failure_is_that_claims_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims = FakeClaims()
    a = claim_object("a", [grouped_result("cpudevnuma000", "2")])
    b = claim_object("b", [grouped_result("cpudevnuma001", "2")])
    claims.add(a)
    claims.add(b)
    real_delete = cdi_files.delete_spec

    def delete_spec(cdi_dir: Path, uid: str) -> bool:
        if uid == _ref(a)[1]:
            raise CdiError(f"injected: cannot remove the CDI spec of {uid}")
        return real_delete(cdi_dir, uid)

    async with running_node(tmp_path, claims) as node:
        await prepare(node, "v1", _ref(a), _ref(b))
        monkeypatch.setattr(cdi_files, "delete_spec", delete_spec)

        reply = await unprepare(node, "v1", _ref(a), _ref(b))

        assert "injected: cannot remove the CDI spec" in reply.claims[_ref(a)[1]].error
        assert reply.claims[_ref(b)[1]].error == ""
        # the failed claim keeps its CPUs and its spec (kubelet retries); the other is gone
        assert set(node.checkpointed()) == {_ref(a)[1]}
        assert node.spec_env(_ref(a)[1]) is not None
        assert node.spec_env(_ref(b)[1]) is None


async def test_state_owner_gone_is_a_per_claim_error(tmp_path: Path) -> None:
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result()])
    claims.add(obj)
    async with running_node(tmp_path, claims, owner_running=False) as node:
        reply = await prepare(node, "v1", _ref(obj))
        assert "state owner is not running" in reply.claims[_ref(obj)[1]].error
        reply = await unprepare(node, "v1beta1", _ref(obj))
        assert "state owner is not running" in reply.claims[_ref(obj)[1]].error


async def test_duplicate_claim_in_one_call_gets_one_entry(tmp_path: Path) -> None:
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result("cpudevnuma000", "2")])
    claims.add(obj)
    async with running_node(tmp_path, claims) as node:
        reply = await prepare(node, "v1", _ref(obj), _ref(obj))
        assert list(reply.claims) == [_ref(obj)[1]]
        assert len(_env_cpus(node.spec_env(_ref(obj)[1]), _ref(obj)[1])) == 2


# --- the status patch is best effort ------------------------------------------------------------


async def test_status_patch_failure_does_not_fail_prepare(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result("cpudevnuma000", "2")])
    claims.add(obj)
    claims.patch_errors.append(KubeServerError("connection refused"))
    async with running_node(tmp_path, claims) as node:
        reply = await prepare(node, "v1", _ref(obj))
        assert reply.claims[_ref(obj)[1]].error == ""
        assert node.spec_env(_ref(obj)[1]) is not None
        await node.service.patches.wait()
    assert len(claims.patches) == 1
    assert "status.devices could not be updated: connection refused" in caplog.text
    assert "devices" not in claims.objects[("default", "a")]["status"]
    [record] = [r for r in caplog.records if "could not be updated" in r.getMessage()]
    assert record.__dict__["claim_uid"] == _ref(obj)[1]
    assert record.__dict__["claim"] == "default/a"


async def test_status_patch_conflict_reads_the_claim_again(tmp_path: Path) -> None:
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result("cpudevnuma000", "2")])
    obj["status"]["devices"] = [
        {"driver": "gpu.example.com", "pool": NODE, "device": "gpu-0", "data": {"x": 1}}
    ]
    claims.add(obj)
    writes = 0

    def concurrent_writer(stored: dict[str, Any]) -> None:
        nonlocal writes
        if writes == 0:  # someone else writes the claim right after our first GET
            writes += 1
            _bump(stored)

    claims.after_get = concurrent_writer
    async with running_node(tmp_path, claims) as node:
        reply = await prepare(node, "v1", _ref(obj))
        assert reply.claims[_ref(obj)[1]].error == ""
        cpus = _env_cpus(node.spec_env(_ref(obj)[1]), _ref(obj)[1])
        await node.service.patches.wait()
    assert len(claims.patches) == 2  # the 409, then the retry on the fresh object
    assert claims.objects[("default", "a")]["status"]["devices"] == [
        {"driver": "gpu.example.com", "pool": NODE, "device": "gpu-0", "data": {"x": 1}},
        {"driver": DRIVER, "pool": NODE, "device": "cpudevnuma000", "data": {"cpuset": str(cpus)}},
    ]


def _status_cpusets(claims: FakeClaims, obj: Mapping[str, Any]) -> list[str]:
    meta = obj["metadata"]
    stored = claims.objects[(meta["namespace"], meta["name"])]
    return [d["data"]["cpuset"] for d in stored["status"].get("devices", [])]


async def test_the_answer_does_not_wait_for_the_status_patch(tmp_path: Path) -> None:
    claims = FakeClaims()
    claims.patch_gate = anyio.Event()  # the API server does not answer the PATCH yet
    obj = claim_object("a", [grouped_result("cpudevnuma000", "2")])
    claims.add(obj)
    async with running_node(tmp_path, claims) as node:
        with anyio.fail_after(10):
            reply, code = await anyio.to_thread.run_sync(_call_with_status, node, _ref(obj))
        assert code == grpc.StatusCode.OK  # the trailers arrived: the call is complete
        assert reply.claims[_ref(obj)[1]].error == ""
        cpus = _env_cpus(node.spec_env(_ref(obj)[1]), _ref(obj)[1])
        assert node.checkpointed() == {_ref(obj)[1]: cpus}
        await claims.wait_until(lambda: claims.patching == 1)  # sent, not answered
        assert len(claims.patches) == 1
        assert _status_cpusets(claims, obj) == []

        claims.patch_gate.set()
        await node.service.patches.wait()
        assert _status_cpusets(claims, obj) == [str(cpus)]


async def test_unprepare_cancels_the_claims_pending_status_patch(tmp_path: Path) -> None:
    claims = FakeClaims()
    claims.patch_gate = anyio.Event()
    obj = claim_object("a", [grouped_result("cpudevnuma000", "2")])
    other = claim_object("b", [grouped_result("cpudevnuma001", "2")])
    claims.add(obj)
    claims.add(other)
    async with running_node(tmp_path, claims) as node:
        assert (await prepare(node, "v1", _ref(obj))).claims[_ref(obj)[1]].error == ""
        assert (await prepare(node, "v1", _ref(other))).claims[_ref(other)[1]].error == ""
        await claims.wait_until(lambda: claims.patching == 2)

        reply = await unprepare(node, "v1", _ref(obj))

        assert reply.claims[_ref(obj)[1]].error == ""
        await claims.wait_until(lambda: claims.cancelled_patches == 1)
        assert claims.patching == 1  # the other claim's patch still waits for the server
        claims.patch_gate.set()
        await node.service.patches.wait()
        assert claims.cancelled_patches == 1
        assert _status_cpusets(claims, obj) == []  # never recorded for the freed CPUs
        other_cpus = node.checkpointed()[_ref(other)[1]]
        assert _status_cpusets(claims, other) == [str(other_cpus)]


async def test_a_new_prepare_of_the_claim_replaces_its_pending_patch_in_order(
    tmp_path: Path,
) -> None:
    claims = FakeClaims()
    claims.patch_gate = anyio.Event()
    obj = claim_object("a", [grouped_result("cpudevnuma002", "3")])
    claims.add(obj)
    async with running_node(tmp_path, claims) as node:
        await prepare(node, "v1", _ref(obj))
        await claims.wait_until(lambda: claims.patching == 1)
        claims.patch_gate = None  # the server answers again

        again = await prepare(node, "v1", _ref(obj))  # the kubelet retries

        assert again.claims[_ref(obj)[1]].error == ""
        await node.service.patches.wait()
        assert claims.cancelled_patches == 1  # the first patch was cancelled ...
        assert claims.most_patching == 1  # ... and had ended before the second one began
        assert len(claims.patches) == 2
        cpus = node.checkpointed()[_ref(obj)[1]]
        assert _status_cpusets(claims, obj) == [str(cpus)]


async def test_pending_status_patches_end_with_the_task(tmp_path: Path) -> None:
    claims = FakeClaims()
    claims.patch_gate = anyio.Event()  # never set: the server never answers
    obj = claim_object("a", [grouped_result("cpudevnuma000", "2")])
    claims.add(obj)
    with anyio.fail_after(10):
        async with running_node(tmp_path, claims) as node:
            await prepare(node, "v1", _ref(obj))
            await claims.wait_until(lambda: claims.patching == 1)
    assert (claims.patching, claims.cancelled_patches) == (0, 1)
    assert _status_cpusets(claims, obj) == []


async def test_beyond_the_pending_patch_limit_a_prepare_answers_after_its_patch(
    tmp_path: Path,
) -> None:
    claims = FakeClaims()
    gate = anyio.Event()
    claims.patch_gate = gate
    first = claim_object("a", [grouped_result("cpudevnuma000", "2")])
    second = claim_object("b", [grouped_result("cpudevnuma001", "2")])
    claims.add(first)
    claims.add(second)
    answers: list[str] = []
    async with running_node(tmp_path, claims, max_pending_status_patches=1) as node:
        await prepare(node, "v1", _ref(first))  # its patch is pending: the limit is reached
        await claims.wait_until(lambda: claims.patching == 1)

        async def second_prepare() -> None:
            reply = await prepare(node, "v1", _ref(second))
            answers.append(reply.claims[_ref(second)[1]].error)

        async with anyio.create_task_group() as tg:
            tg.start_soon(second_prepare)
            await claims.wait_until(lambda: claims.patching == 2)  # its patch is sent ...
            assert answers == []  # ... and its Prepare waits for it
            gate.set()
        assert answers == [""]
        assert _status_cpusets(claims, second) == [str(node.checkpointed()[_ref(second)[1]])]
        await node.service.patches.wait()
        assert _status_cpusets(claims, first) == [str(node.checkpointed()[_ref(first)[1]])]


async def test_a_service_patches_inline_before_its_patch_group_and_not_after_it(
    tmp_path: Path,
) -> None:
    claims = FakeClaims()
    before = claim_object("before", [grouped_result("cpudevnuma000", "2")])
    after = claim_object("after", [grouped_result("cpudevnuma001", "2")])
    claims.add(before)
    claims.add(after)
    send, receive = _command_stream()
    service = DraService(send, claims, NODE)

    async def owner() -> None:  # answers every PrepareClaim with cpus 2-3
        async for req in receive:
            command = req.command
            assert isinstance(command, PrepareClaim)
            with req.reply:
                prepared = ClaimPrepared(command.claim_uid, CpuSet.parse("2-3"), None, ())
                await req.reply.send(prepared)

    with send, receive:
        async with anyio.create_task_group() as tg:
            tg.start_soon(owner)
            outcome = await service.prepare([kubelet_plugin.ClaimRef(*_ref(before))])
            assert outcome[_ref(before)[1]].error == ""
            assert _status_cpusets(claims, before) == ["2-3"]  # patched before the answer

            async with service.patches.running():
                pass  # the server has stopped: answers still in flight record nothing
            outcome = await service.prepare([kubelet_plugin.ClaimRef(*_ref(after))])
            assert outcome[_ref(after)[1]].error == ""
            await service.patches.wait()
            assert len(claims.patches) == 1
            assert _status_cpusets(claims, after) == []
            tg.cancel_scope.cancel()


# --- answer first, then patch -------------------------------------------------------------------


class FakeStream:
    """The grpclib stream of one Prepare call, as the rpc method uses it: ``recv_message`` gives
    the request (parsed by the generated message type, as the server's codec does);
    ``send_message`` and ``send_trailing_metadata`` record the answer, and the number of PATCH
    calls begun when the trailers were handed over. ``delivered=False``: the kubelet has gone,
    sending raises what grpclib's stream raises then (h2's exception, our ``StreamClosed``)."""

    def __init__(
        self, version: str, request: bytes, claims: FakeClaims, *, delivered: bool = True
    ) -> None:
        self.request = (gen_v1 if version == "v1" else gen_v1beta1).NodePrepareResourcesRequest
        self.data = request
        self.claims = claims
        self.delivered = delivered
        self.sent = b""
        self.send_attempted = False
        self.trailers_sent = False
        self.patches_at_trailers = -1

    async def recv_message(self) -> Any:
        return self.request.parse(self.data)

    async def send_message(self, message: Any) -> None:
        assert not self.sent, "answered twice"
        self.send_attempted = True
        if not self.delivered:
            raise StreamClosed(1)
        self.sent = bytes(message)

    async def send_trailing_metadata(self) -> None:
        assert self.sent
        assert not self.trailers_sent
        self.trailers_sent = True
        self.patches_at_trailers = len(self.claims.patches)


async def _patches_settled(node: RunningNode) -> None:
    with anyio.fail_after(10):  # a patch that never ends fails the test, not the timeout
        await node.service.patches.wait()


def _prepare_request(version: str, *refs: tuple[str, str, str]) -> bytes:
    pb = PEERS[version]
    claims = [pb.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in refs]
    data: bytes = pb.NodePrepareResourcesRequest(claims=claims).SerializeToString()
    return data


async def _serve_prepare(node: RunningNode, version: str, stream: FakeStream) -> None:
    """Run the version's NodePrepareResources rpc method on ``stream``, as grpclib would."""
    plugin = DraPluginV1(node.service) if version == "v1" else DraPluginV1beta1(node.service)
    handler = plugin.__mapping__()[PATHS[version]["prepare"]]
    try:
        await handler.func(stream)
    except StreamClosed:
        assert not stream.delivered  # grpclib's request handler takes it: the kubelet is gone


def _fast_and_slow(claims: FakeClaims) -> tuple[dict[str, Any], dict[str, Any], anyio.Event]:
    """Claim ``fast`` and claim ``slow``, whose GET waits for the returned gate: one call of
    both holds ``fast``'s patch while ``slow`` is still being read."""
    fast = claim_object("fast", [grouped_result("cpudevnuma000", "2", share_id="s-1")])
    slow = claim_object("slow", [grouped_result("cpudevnuma001", "2")])
    claims.add(fast)
    claims.add(slow)
    gate = anyio.Event()
    claims.get_gates[_ref(slow)[2]] = gate
    return fast, slow, gate


async def _held(node: RunningNode, claim: Mapping[str, Any]) -> None:
    """Wait until ``claim`` (the node's first command) is prepared and its requester has the
    owner's answer, so that its status patch is held, and everything else is blocked."""
    with anyio.fail_after(10):
        # The owner commits after its file thread wrote the checkpoint: no event
        # to wait for. Once committed, the answer is in the requester's stream.
        while node.owner.statistics().commands_applied < 1:  # noqa: ASYNC110
            await anyio.sleep(0.005)
    await anyio.wait_all_tasks_blocked()  # the requester takes the answer and holds the patch
    stored = checkpoint_file.read_newest(node.checkpoint)
    assert stored is not None
    assert _ref(claim)[1] in stored.data.claims


@pytest.mark.parametrize("version", VERSIONS)
async def test_the_patches_start_only_after_the_answer(tmp_path: Path, version: str) -> None:
    claims = FakeClaims()
    fast, slow, gate = _fast_and_slow(claims)
    async with running_node(tmp_path, claims) as node:
        call = FakeStream(version, _prepare_request(version, _ref(fast), _ref(slow)), claims)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_serve_prepare, node, version, call)
            await _held(node, fast)
            assert claims.patches == []  # fast is prepared, its patch is held
            gate.set()

        assert call.patches_at_trailers == 0  # no PATCH had begun when the answer went out
        uid = _ref(fast)[1]
        reply = PEERS[version].NodePrepareResourcesResponse.FromString(call.sent)
        assert _devices(reply.claims[uid]) == [
            (
                ["cpu"],
                NODE,
                "cpudevnuma000",
                [f"dra.k8s.io/cpu=claim-{uid}", f"dra.cpu/metadata={uid}_cpu"],
            )
        ]
        assert reply.claims[_ref(slow)[1]].error == ""
        # share_id (5) in v1 only: read as v1, the v1beta1 answer has none
        [device] = G_V1.NodePrepareResourcesResponse.FromString(call.sent).claims[uid].devices
        assert (device.HasField("share_id"), device.share_id) == (
            (True, "s-1") if version == "v1" else (False, "")
        )
        # ... and once the answer is out, both patches land
        await _patches_settled(node)
        for obj in (fast, slow):
            assert _status_cpusets(claims, obj) == [str(node.checkpointed()[_ref(obj)[1]])]


async def test_a_status_patch_waits_its_delay_after_the_answer(tmp_path: Path) -> None:
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result("cpudevnuma002", "2")])
    claims.add(obj)
    delay = 0.3
    async with running_node(tmp_path, claims, status_patch_delay=delay) as node:
        call = FakeStream("v1", _prepare_request("v1", _ref(obj)), claims)
        await _serve_prepare(node, "v1", call)
        answered = anyio.current_time()
        assert call.patches_at_trailers == 0
        await anyio.sleep(delay / 3)
        assert claims.patches == []  # still waiting: the kubelet has the CPU to itself
        await _patches_settled(node)
        assert anyio.current_time() - answered >= delay
        assert _status_cpusets(claims, obj) == [str(node.checkpointed()[_ref(obj)[1]])]


async def test_the_patches_start_even_when_the_answer_cannot_be_sent(tmp_path: Path) -> None:
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result("cpudevnuma001", "3")])
    claims.add(obj)
    async with running_node(tmp_path, claims) as node:
        call = FakeStream("v1", _prepare_request("v1", _ref(obj)), claims, delivered=False)
        await _serve_prepare(node, "v1", call)
        assert call.send_attempted
        assert not call.trailers_sent
        # the claim IS prepared here: its cpuset is recorded all the same
        await _patches_settled(node)
        cpus = node.checkpointed()[_ref(obj)[1]]
        assert _status_cpusets(claims, obj) == [str(cpus)]


async def test_the_kubelets_deadline_cancels_a_prepare_still_reading_its_claims(
    tmp_path: Path,
) -> None:
    """The kubelet's deadline (grpc-timeout) passes while the claim GET hangs: the call ends
    DEADLINE_EXCEEDED, the handler is cancelled (the claim never reaches the state owner, even
    once the GET would answer) and the socket serves the next call."""
    claims = FakeClaims()
    fast, slow, gate = _fast_and_slow(claims)
    async with running_node(tmp_path, claims) as node:

        def prepare_slow() -> grpc.StatusCode:
            ns, uid, name = _ref(slow)
            request = G_V1.NodePrepareResourcesRequest(
                claims=[G_V1.Claim(namespace=ns, uid=uid, name=name)]
            )
            with grpc.insecure_channel(unix_target(node.socket)) as channel:
                call = channel.unary_unary(
                    PATHS["v1"]["prepare"],
                    request_serializer=G_V1.NodePrepareResourcesRequest.SerializeToString,
                )
                with pytest.raises(grpc.RpcError) as info:
                    call(request, timeout=0.3)
                code: grpc.StatusCode = info.value.code()
                return code

        assert await anyio.to_thread.run_sync(prepare_slow) == grpc.StatusCode.DEADLINE_EXCEEDED
        gate.set()  # the GET would answer now: nobody is waiting for it any more
        reply = await prepare(node, "v1", _ref(fast))
        await _patches_settled(node)
        prepared = node.checkpointed()
        gets = claims.gets

    assert reply.claims[_ref(fast)[1]].error == ""
    assert set(prepared) == {_ref(fast)[1]}
    assert gets == 1  # fast's; slow's GET was cancelled while it waited


async def test_a_call_cancelled_midway_still_patches_the_claims_it_prepared(
    tmp_path: Path,
) -> None:
    claims = FakeClaims()
    fast, slow, _ = _fast_and_slow(claims)
    async with running_node(tmp_path, claims) as node:
        call = FakeStream("v1", _prepare_request("v1", _ref(fast), _ref(slow)), claims)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_serve_prepare, node, "v1", call)
            await _held(node, fast)
            assert claims.patches == []
            tg.cancel_scope.cancel()  # the deadline passed, the kubelet reset the stream
        assert not call.send_attempted
        await _patches_settled(node)
        assert _status_cpusets(claims, fast) == [str(node.checkpointed()[_ref(fast)[1]])]
        assert _ref(slow)[1] not in node.checkpointed()
        assert _status_cpusets(claims, slow) == []


async def test_unprepare_drops_a_patch_held_for_an_unanswered_call(tmp_path: Path) -> None:
    claims = FakeClaims()
    fast, slow, gate = _fast_and_slow(claims)
    async with running_node(tmp_path, claims) as node:
        call = FakeStream("v1", _prepare_request("v1", _ref(fast), _ref(slow)), claims)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_serve_prepare, node, "v1", call)
            await _held(node, fast)

            reply = await unprepare(node, "v1", _ref(fast))

            assert reply.claims[_ref(fast)[1]].error == ""
            gate.set()
        assert call.patches_at_trailers == 0
        await _patches_settled(node)
        assert [name for _, name, _ in claims.patches] == ["slow"]  # never for the freed CPUs
        assert set(node.checkpointed()) == {_ref(slow)[1]}


async def test_a_retried_prepare_waits_for_the_held_patch_and_wins(tmp_path: Path) -> None:
    claims = FakeClaims()
    fast, slow, gate = _fast_and_slow(claims)
    async with running_node(tmp_path, claims) as node:
        call = FakeStream("v1", _prepare_request("v1", _ref(fast), _ref(slow)), claims)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_serve_prepare, node, "v1", call)
            await _held(node, fast)

            again = await prepare(node, "v1beta1", _ref(fast))  # the kubelet retries

            assert again.claims[_ref(fast)[1]].error == ""
            await anyio.wait_all_tasks_blocked()
            assert claims.patches == []  # the retry's patch waits for the held one
            gate.set()
        await _patches_settled(node)
        # the first call's patch of fast was dropped unsent; the retry's landed, and slow's
        assert sorted(name for _, name, _ in claims.patches) == ["fast", "slow"]
        assert _status_cpusets(claims, fast) == [str(node.checkpointed()[_ref(fast)[1]])]


async def test_a_patch_held_when_the_task_stops_is_never_sent(tmp_path: Path) -> None:
    claims = FakeClaims()
    fast, slow, gate = _fast_and_slow(claims)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            async with running_node(tmp_path, claims) as node:
                call = FakeStream("v1", _prepare_request("v1", _ref(fast), _ref(slow)), claims)
                tg.start_soon(_serve_prepare, node, "v1", call)
                await _held(node, fast)
                assert claims.patches == []  # held while slow is read
            # the kubelet-plugin task has stopped; the call still finishes and answers
            gate.set()
    assert call.trailers_sent
    reply = G_V1.NodePrepareResourcesResponse.FromString(call.sent)
    assert reply.claims[_ref(fast)[1]].error == ""
    assert reply.claims[_ref(slow)[1]].error != ""  # the state owner is gone
    await _patches_settled(node)
    assert claims.patches == []
    assert _status_cpusets(claims, fast) == []


# --- the socket ---------------------------------------------------------------------------------


async def test_dra_socket_mode_dir_stale_file_and_removal(tmp_path: Path) -> None:
    plugin_dir = tmp_path / "kubelet" / "plugins" / DRIVER
    plugin_dir.mkdir(parents=True, mode=0o755)
    plugin_dir.chmod(0o755)
    stale = plugin_dir / "dra.sock"
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(stale))
    leftover.close()  # a crashed instance's socket file: nobody listens
    stale_inode = stale.stat().st_ino
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result("cpudevnuma000", "1")])
    claims.add(obj)

    async with running_node(tmp_path, claims) as node:
        info = node.socket.lstat()
        assert node.socket == stale
        assert stat.S_ISSOCK(info.st_mode)
        assert info.st_ino != stale_inode
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert stat.S_IMODE(plugin_dir.stat().st_mode) == 0o700
        assert sorted(p.name for p in plugin_dir.iterdir()) == ["dra.sock"]  # no temp left
        reply = await prepare(node, "v1", _ref(obj))
        assert reply.claims[_ref(obj)[1]].error == ""

    assert not node.socket.exists()
    # the prepared claim's device metadata stays (the claim does), nothing else
    assert [p.name for p in plugin_dir.iterdir()] == [METADATA_DIR_NAME]


@pytest.mark.parametrize(
    "leave",
    [
        pytest.param(lambda p: p.write_text("not a socket"), id="regular file"),
        pytest.param(lambda p: p.symlink_to(p.parent / "gone.sock"), id="dangling symlink"),
        pytest.param(lambda p: p.symlink_to(p.parent.parent / "other"), id="symlink to a file"),
    ],
)
async def test_dra_socket_replaces_whatever_an_earlier_run_left_at_its_path(
    tmp_path: Path, leave: Callable[[Path], object]
) -> None:
    """A regular file or a link where the socket goes (a botched earlier run) used to stop the
    daemon; the kubelet's plugin guide says to delete what is there and listen anew. A link is
    removed, never followed."""
    path = tmp_path / "kubelet" / "plugins" / DRIVER / "dra.sock"
    path.parent.mkdir(parents=True)
    other = path.parent.parent / "other"
    other.write_text("someone else's")
    leave(path)
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result("cpudevnuma000", "1")])
    claims.add(obj)
    async with running_node(tmp_path, claims) as node:
        assert node.socket == path
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600
        reply = await prepare(node, "v1", _ref(obj))
        assert reply.claims[_ref(obj)[1]].error == ""
    assert [p.name for p in path.parent.iterdir()] == [METADATA_DIR_NAME]
    assert other.read_text() == "someone else's"


async def test_dra_socket_refuses_a_directory_at_its_path_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "kubelet" / "plugins" / DRIVER / "dra.sock"
    path.mkdir(parents=True)
    (path / "inside").write_text("kept")
    send, receive = _command_stream()
    with send, receive:
        async with anyio.create_task_group() as tg:
            run = partial(
                kubelet_plugin.run,
                path,
                send.clone(),
                FakeClaims(),
                NODE,
                health=DeviceHealthBoard(),
            )
            with pytest.raises(DracpuError, match=f"'{path}' is a directory"):
                await tg.start(run)
    assert (path / "inside").read_text() == "kept"
    assert [p.name for p in path.parent.iterdir()] == ["dra.sock"]  # no temporary left behind


async def test_unknown_method_is_unimplemented_and_server_keeps_serving(tmp_path: Path) -> None:
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result("cpudevnuma000", "1")])
    claims.add(obj)
    async with running_node(tmp_path, claims) as node:

        def call_v1alpha4() -> grpc.StatusCode:
            with grpc.insecure_channel(unix_target(node.socket)) as channel:
                call = channel.unary_unary(
                    "/k8s.io.kubelet.pkg.apis.dra.v1alpha4.Node/NodePrepareResources",
                    request_serializer=G_V1.NodePrepareResourcesRequest.SerializeToString,
                    response_deserializer=G_V1.NodePrepareResourcesResponse.FromString,
                )
                with pytest.raises(grpc.RpcError) as info:
                    call(G_V1.NodePrepareResourcesRequest(), timeout=CALL_TIMEOUT)
                code: grpc.StatusCode = info.value.code()
                return code

        assert await anyio.to_thread.run_sync(call_v1alpha4) == grpc.StatusCode.UNIMPLEMENTED
        reply = await prepare(node, "v1", _ref(obj))
        assert reply.claims[_ref(obj)[1]].error == ""


def test_method_paths_and_types_are_the_generated_services() -> None:
    send, receive = _command_stream()
    with send, receive:
        service = DraService(send, FakeClaims(), NODE)
        for plugin, generated in (
            (DraPluginV1(service), gen_v1.DraPluginBase()),
            (DraPluginV1beta1(service), gen_v1beta1.DraPluginBase()),
        ):
            ours = plugin.__mapping__()
            # the same paths, cardinalities and message types; the functions are ours
            assert {p: h[1:] for p, h in ours.items()} == {
                p: h[1:] for p, h in generated.__mapping__().items()
            }
    assert set(PATHS["v1"].values()) == set(gen_v1.DraPluginBase().__mapping__())


# Requests betterproto2 refuses (its exceptions end up INVALID_ARGUMENT), and requests it parses
# into values of the wrong Python type (the claim check refuses those). Google's runtime refuses
# all but "claim as varint" (a field of another wire type is an unknown field there).
GARBAGE = {
    "bad varint": (bytes.fromhex("0a ffffffffffffffffffff01"), "cannot decode "),
    "invalid UTF-8": (bytes.fromhex("0a 03 12 01 ff"), "cannot decode "),
    "varint cut short": (bytes.fromhex("0a 02 08 ff"), "cannot decode "),
    "claim as varint": (bytes.fromhex("08 01"), "claims[0] is not a well-formed Claim"),
    "uid as varint": (bytes.fromhex("0a 02 10 05"), "claims[0] is not a well-formed Claim"),
    "uid of wire type 7": (bytes.fromhex("0a 01 17"), "claims[0] is not a well-formed Claim"),
}


async def test_undecodable_requests_are_invalid_argument_and_serving_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result("cpudevnuma000", "1")])
    claims.add(obj)
    async with running_node(tmp_path, claims) as node:

        def call_raw(path: str, data: bytes) -> tuple[grpc.StatusCode, str]:
            with grpc.insecure_channel(unix_target(node.socket)) as channel:
                call = channel.unary_unary(path)  # no serializers: bytes go out as they are
                with pytest.raises(grpc.RpcError) as info:
                    call(data, timeout=CALL_TIMEOUT)
                code: grpc.StatusCode = info.value.code()
                details: str = info.value.details()
                return code, details

        for version in VERSIONS:
            for method, message in (
                ("prepare", "NodePrepareResourcesRequest"),
                ("unprepare", "NodeUnprepareResourcesRequest"),
            ):
                for case, (data, expected) in GARBAGE.items():
                    path = PATHS[version][method]
                    code, details = await anyio.to_thread.run_sync(call_raw, path, data)
                    assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, case)
                    if expected == "cannot decode ":
                        expected += message + ": "
                    assert details.startswith(expected), (case, details)
        assert claims.gets == 0  # nothing was prepared from a garbled request
        reply = await prepare(node, "v1", _ref(obj))
        assert reply.claims[_ref(obj)[1]].error == ""
    refused = [
        r for r in caplog.records if "refusing a" in r.getMessage() and r.name.startswith("dracpu.")
    ]
    assert len(refused) == 2 * 2 * len(GARBAGE)
    assert all(r.levelname == "WARNING" for r in refused)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # no "Application error"


async def test_betterproto2_leniency_a_cut_short_claim_fails_at_the_uid_check(
    tmp_path: Path,
) -> None:
    """betterproto2 reads a string that runs past the end of its message as the bytes that are
    there (Google's runtime refuses it). Such a claim's namespace/name/UID cannot match a
    ResourceClaim of the API server: the claim gets its own error, nothing is prepared."""
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result("cpudevnuma000", "1")])
    claims.add(obj)
    ns, uid, name = _ref(obj)
    whole = G_V1.NodePrepareResourcesRequest(
        claims=[G_V1.Claim(namespace=ns, uid=uid, name=name)]
    ).SerializeToString()
    cut = whole[:-1]  # the name's last byte is missing; the lengths still say it is there
    async with running_node(tmp_path, claims) as node:

        def call_raw() -> Any:
            with grpc.insecure_channel(unix_target(node.socket)) as channel:
                call = channel.unary_unary(
                    PATHS["v1"]["prepare"],
                    response_deserializer=G_V1.NodePrepareResourcesResponse.FromString,
                )
                return call(cut, timeout=CALL_TIMEOUT)

        reply = await anyio.to_thread.run_sync(call_raw)
        checkpointed = node.checkpointed() if node.checkpoint.exists() else {}

    assert list(reply.claims) == [uid]
    assert "not found" in reply.claims[uid].error
    assert checkpointed == {}


async def test_empty_request_gets_an_empty_answer(tmp_path: Path) -> None:
    async with running_node(tmp_path) as node:
        for version in VERSIONS:
            assert dict((await prepare(node, version)).claims) == {}
            assert dict((await unprepare(node, version)).claims) == {}


async def test_requests_use_the_owner_stream_request_type(tmp_path: Path) -> None:
    # The service only needs the send side; prove a PrepareClaim arrives with the claim's data.
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result("cpudevnuma000", "2", request="cpu/sub")])
    claims.add(obj)
    send, receive = _command_stream()
    service = DraService(send, claims, NODE)
    seen: list[Command] = []

    async def owner() -> None:
        req: Request[Command] = await receive.receive()
        seen.append(req.command)
        with req.reply:
            await req.reply.send(DracpuError("refused by the test owner"))

    with send, receive:
        async with anyio.create_task_group() as tg:
            tg.start_soon(owner)
            outcomes = await service.prepare([kubelet_plugin.ClaimRef(*_ref(obj))])
    uid = _ref(obj)[1]
    assert outcomes == {uid: kubelet_plugin.PrepareOutcome(error="refused by the test owner")}
    [command] = seen
    assert command == PrepareClaim(
        claim_uid=uid,
        namespace="default",
        name="a",
        results=(DeviceResult("cpu", NODE, "cpudevnuma000", consumed_cpus=2),),
    )


def _cpu_config(requests: list[str], **cpu: object) -> dict[str, Any]:
    return {
        "source": "FromClaim",
        "requests": requests,
        "opaque": {
            "driver": DRIVER,
            "parameters": {"apiVersion": "v1alpha1", "cpuConfig": cpu},
        },
    }


async def test_opaque_configs_reach_the_owner_and_a_bad_one_fails_its_claim_alone() -> None:
    claims = FakeClaims()
    configured = claim_object("configured", [grouped_result("cpudevnuma000", "2")])
    configured["status"]["allocation"]["devices"]["config"] = [
        _cpu_config(["cpu"], cpuset="3,35", memory="pin"),
        _cpu_config([], policy="spread"),  # taken, but an explicit cpuset decides the CPUs
    ]
    bad = claim_object("bad", [grouped_result("cpudevnuma001", "2")])
    bad["status"]["allocation"]["devices"]["config"] = [_cpu_config([], fullCores="yes")]
    claims.add(configured)
    claims.add(bad)
    send, receive = _command_stream()
    service = DraService(send, claims, NODE)
    seen: list[Command] = []

    async def owner() -> None:
        async for req in receive:  # every command that comes, until cancelled
            seen.append(req.command)
            with req.reply:
                await req.reply.send(DracpuError("refused by the test owner"))

    with send, receive:
        async with anyio.create_task_group() as tg:
            tg.start_soon(owner)
            refs = [kubelet_plugin.ClaimRef(*_ref(obj)) for obj in (configured, bad)]
            outcomes = await service.prepare(refs)
            tg.cancel_scope.cancel()
    assert outcomes[_ref(bad)[1]] == kubelet_plugin.PrepareOutcome(
        error="claim default/bad: opaque config [0] cpuConfig.fullCores: 'yes' is not a "
        "boolean (true or false)"
    )
    [command] = seen  # the bad claim never reached the owner
    assert isinstance(command, PrepareClaim)
    assert command.claim_uid == _ref(configured)[1]
    assert command.pin_memory is True
    [result] = command.results
    assert result == DeviceResult("cpu", NODE, "cpudevnuma000", 2, CpuSet([3, 35]))
    assert result.strategy is Strategy.SPREAD
