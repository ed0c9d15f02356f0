"""The Kubernetes adapter (dracpu.adapters.kube: the kubernetes configuration loader, our own
HTTP/1.1 client) over real sockets, against the aiohttp fake API server
(dracpu.sim.fake_apiserver) and small raw servers and proxies written here."""

from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import datetime
import itertools
import json
import shutil
import socket
import ssl
import subprocess
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.tls import TLSStream
from kubernetes.aio.config import incluster_config

from dracpu.adapters import http_pool
from dracpu.adapters.kube import (
    LISTED,
    WatchEvent,
    consumable_capacity_dropped,
    open_kube_client,
)
from dracpu.core.claims import device_status_patch, read_claim
from dracpu.core.cpuset import CpuSet
from dracpu.core.slices import CpuDeviceMode, GroupBy, build_resource_slices, published_devices
from dracpu.errors import (
    ConfigError,
    KubeClientError,
    KubeConflictError,
    KubeNotFoundError,
    KubeServerError,
)
from dracpu.sim.fake_apiserver import FakeApiServer, build_resource_claim, open_fake_apiserver
from dracpu.sim.topologies import FIXTURES, build_topology
from tests.kube_helpers import NODE, NODE_UID, connected, foreign_slice


def slices(
    node: str = NODE, *, mode: CpuDeviceMode = CpuDeviceMode.GROUPED, generation: int = 1
) -> list[dict[str, Any]]:
    topology = build_topology(FIXTURES["dual-socket-smt2"])
    devices = published_devices(
        topology, reserved=CpuSet.parse(""), mode=mode, group_by=GroupBy.NUMANODE
    )
    return build_resource_slices(node, devices, generation=generation, owner_uid=NODE_UID)


# --- nodes, errors ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_get_node_returns_the_object_as_a_plain_dict() -> None:
    async with connected() as (api, kube):
        node = await kube.get_node(NODE)
        assert node == api.node(NODE)
        assert node["metadata"]["uid"] == NODE_UID
        assert type(node) is dict


@pytest.mark.anyio
async def test_not_found_is_translated_with_status_and_server_message() -> None:
    async with connected() as (_, kube):
        with pytest.raises(KubeNotFoundError) as info:
            await kube.get_node("nope")
    assert info.value.status == 404
    assert 'nodes "nope" not found' in str(info.value)
    assert "get node nope" in str(info.value)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "error"),
    [
        (500, KubeServerError),
        (503, KubeServerError),
        (429, KubeServerError),
        (409, KubeConflictError),
        (403, KubeClientError),
        (404, KubeNotFoundError),
    ],
)
async def test_http_errors_map_to_the_error_tree(status: int, error: type[Exception]) -> None:
    async with connected() as (api, kube):
        api.fail_next(status=status, message="injected by the test")
        with pytest.raises(error) as info:
            await kube.get_node(NODE)
        assert getattr(info.value, "status", None) == status
        assert "injected by the test" in str(info.value)
        assert await kube.get_node(NODE)  # only the next request failed


@pytest.mark.anyio
async def test_dropped_connection_is_a_server_error_without_status() -> None:
    async with connected() as (api, kube):
        # aiohttp itself retries an idempotent request once on a dropped connection.
        api.fail_next(2, status=None)
        with pytest.raises(KubeServerError) as info:
            await kube.get_node(NODE)
        assert [r.status for r in api.requests] == [0, 0]
        assert info.value.status is None
        assert isinstance(info.value.__cause__, Exception)
        assert "cannot reach the API server" in str(info.value)
        assert (await kube.get_node(NODE))["metadata"]["name"] == NODE


@pytest.mark.anyio
async def test_unreachable_server_is_a_server_error(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    async with open_kube_client(config, request_timeout=5) as kube:
        with pytest.raises(KubeServerError) as info:
            await kube.get_node(NODE)
    assert info.value.status is None


_PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY")


@contextlib.asynccontextmanager
async def recording_proxy() -> AsyncIterator[tuple[int, list[bytes]]]:
    """A stand-in HTTP proxy on 127.0.0.1: records each request's head, answers a Node named
    ``via-proxy``."""
    heads: list[bytes] = []
    body = json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "via-proxy"}})

    async def serve(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive()
            heads.append(data.partition(b"\r\n\r\n")[0])
            await stream.send(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
            )

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        yield port, heads
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_the_proxy_environment_is_read_once_when_the_client_opens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in _PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    async with recording_proxy() as (port, heads), open_fake_apiserver() as api:
        api.add_node(NODE, uid=NODE_UID)
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")
        async with open_kube_client(api.kubeconfig_path, request_timeout=10) as kube:
            monkeypatch.delenv("http_proxy")  # later changes do not matter: read at open
            assert (await kube.get_node(NODE))["metadata"]["name"] == "via-proxy"
        [head] = heads
        assert head.decode().split("\r\n")[0] == f"GET {api.url}/api/v1/nodes/{NODE} HTTP/1.1"
        assert api.requests == []  # nothing reached the server directly

        # A client opened without a proxy connects directly, whatever the environment says later.
        async with open_kube_client(api.kubeconfig_path, request_timeout=10) as kube:
            monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")
            assert await kube.get_node(NODE) == api.node(NODE)
        assert len(heads) == 1


@pytest.mark.anyio
async def test_proxy_credentials_reach_the_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    async with recording_proxy() as (port, heads), open_fake_apiserver() as api:
        monkeypatch.setenv("http_proxy", f"http://user:secret@127.0.0.1:{port}")
        async with open_kube_client(api.kubeconfig_path, request_timeout=10) as kube:
            assert (await kube.get_node(NODE))["metadata"]["name"] == "via-proxy"
    [head] = heads
    credentials = base64.b64encode(b"user:secret").decode()
    assert f"Proxy-Authorization: Basic {credentials}" in head.decode().split("\r\n")


@pytest.mark.anyio
async def test_no_proxy_sends_requests_to_the_server_directly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in _PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    async with recording_proxy() as (port, heads), open_fake_apiserver() as api:
        api.add_node(NODE, uid=NODE_UID)
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("no_proxy", "127.0.0.1")
        async with open_kube_client(api.kubeconfig_path, request_timeout=10) as kube:
            assert await kube.get_node(NODE) == api.node(NODE)
    assert heads == []


@pytest.mark.anyio
async def test_missing_kubeconfig_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kubeconfig"):
        async with open_kube_client(tmp_path / "absent"):
            pass


@pytest.mark.anyio
async def test_in_cluster_without_service_account_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(ConfigError, match="in-cluster"):
        async with open_kube_client(None):
            pass


# --- resource slices ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_slice_create_get_update_delete() -> None:
    async with connected() as (api, kube):
        wanted = slices()[0]
        stored = await kube.create_resource_slice(wanted)
        assert stored["spec"] == wanted["spec"]
        assert stored["metadata"]["ownerReferences"] == wanted["metadata"]["ownerReferences"]
        assert stored["metadata"]["generation"] == 1
        assert stored["metadata"]["uid"]
        assert await kube.get_resource_slice(wanted["metadata"]["name"]) == stored
        assert api.resource_slices() == [stored]

        changed = copy.deepcopy(stored)
        changed["spec"]["pool"]["generation"] = 2
        updated = await kube.update_resource_slice(changed)
        assert updated["spec"]["pool"]["generation"] == 2
        assert updated["metadata"]["generation"] == 2
        assert int(updated["metadata"]["resourceVersion"]) > int(
            stored["metadata"]["resourceVersion"]
        )

        with pytest.raises(KubeConflictError, match="has been modified"):
            await kube.update_resource_slice(changed)  # stale resourceVersion
        with pytest.raises(KubeConflictError, match="already exists"):
            await kube.create_resource_slice(wanted)
        with pytest.raises(KubeConflictError, match="Precondition failed"):
            await kube.delete_resource_slice(
                wanted["metadata"]["name"], uid=stored["metadata"]["uid"], resource_version="1"
            )
        await kube.delete_resource_slice(
            wanted["metadata"]["name"],
            uid=updated["metadata"]["uid"],
            resource_version=updated["metadata"]["resourceVersion"],
        )
        assert api.resource_slices() == []
        with pytest.raises(KubeNotFoundError):
            await kube.get_resource_slice(wanted["metadata"]["name"])
        with pytest.raises(KubeNotFoundError):
            await kube.delete_resource_slice(wanted["metadata"]["name"])
        with pytest.raises(KubeNotFoundError):
            await kube.update_resource_slice(changed)


@pytest.mark.anyio
async def test_invalid_slices_are_refused_with_422() -> None:
    async with connected() as (api, kube):
        too_many = slices(mode=CpuDeviceMode.INDIVIDUAL)[0]
        too_many["spec"]["devices"] = [{"name": f"dev{i}", "attributes": {}} for i in range(129)]
        with pytest.raises(KubeClientError) as info:
            await kube.create_resource_slice(too_many)
        assert info.value.status == 422
        assert "129 devices, at most 128" in str(info.value)

        unknown_field = slices()[0]
        unknown_field["spec"]["devices"][0]["colour"] = "blue"
        with pytest.raises(KubeClientError, match="colour") as info:
            await kube.create_resource_slice(unknown_field)
        assert info.value.status == 422

        bad_attribute = slices()[0]
        bad_attribute["spec"]["devices"][0]["attributes"]["dra.cpu/not-an-identifier"] = {"int": 1}
        with pytest.raises(KubeClientError, match="C identifier"):
            await kube.create_resource_slice(bad_attribute)
        assert api.resource_slices() == []


@pytest.mark.anyio
async def test_immutable_fields_cannot_change() -> None:
    async with connected() as (_, kube):
        stored = await kube.create_resource_slice(slices()[0])
        moved = copy.deepcopy(stored)
        moved["spec"]["nodeName"] = "node-b"
        moved["spec"]["pool"]["name"] = "node-b"
        with pytest.raises(KubeClientError, match="immutable") as info:
            await kube.update_resource_slice(moved)
        assert info.value.status == 422


@pytest.mark.anyio
async def test_list_uses_the_field_selector() -> None:
    async with connected() as (api, kube):
        ours = [await kube.create_resource_slice(obj) for obj in slices()]
        api.create_resource_slice(foreign_slice("gpu-a", driver="gpu.example.com", node=NODE))
        api.create_resource_slice(foreign_slice("cpu-b", driver="dra.cpu", node="node-b"))
        items, version = await kube.list_resource_slices("dra.cpu", NODE)
        assert items == ours
        assert version == str(api.resource_version)
        every, _ = await kube.list_resource_slices(None, None)
        assert len(every) == len(ours) + 2
        listing = [r for r in api.requests if r.method == "GET" and "resourceslices" in r.path]
        assert listing[0].query["fieldSelector"] == "spec.driver=dra.cpu,spec.nodeName=node-a"


@pytest.mark.anyio
async def test_consumable_capacity_drop_is_detected() -> None:
    grouped = slices()[0]
    assert any(
        "requestPolicy" in c for d in grouped["spec"]["devices"] for c in d["capacity"].values()
    )
    async with connected(consumable_capacity=False) as (_, kube):
        stored = await kube.create_resource_slice(grouped)
    assert consumable_capacity_dropped(grouped, stored)
    assert len(stored["spec"]["devices"]) == len(grouped["spec"]["devices"])  # none lost
    for device in stored["spec"]["devices"]:
        assert "allowMultipleAllocations" not in device
        assert all("requestPolicy" not in c for c in device["capacity"].values())
    async with connected() as (_, kube):
        kept = await kube.create_resource_slice(grouped)
    assert not consumable_capacity_dropped(grouped, kept)
    individual = slices(mode=CpuDeviceMode.INDIVIDUAL)[0]
    assert not consumable_capacity_dropped(individual, individual)


# --- claims -------------------------------------------------------------------------------------


def allocated_claim() -> dict[str, Any]:
    result = {
        "request": "cpus",
        "driver": "dra.cpu",
        "pool": NODE,
        "device": "cpudevnuma000",
        "shareID": "7d2a0b64-2f57-4c1e-a3d2-0c1b9f1e6e55",
        "consumedCapacity": {"dra.cpu/cpu": "2"},
    }
    return build_resource_claim("team", "claim-1", [result], node_name=NODE)


@pytest.mark.anyio
async def test_get_claim_and_patch_its_status() -> None:
    async with connected() as (api, kube):
        stored = api.add_resource_claim(allocated_claim())
        got = await kube.get_resource_claim("team", "claim-1")
        assert got == stored
        entry = {
            "driver": "dra.cpu",
            "pool": NODE,
            "device": "cpudevnuma000",
            "shareID": "7d2a0b64-2f57-4c1e-a3d2-0c1b9f1e6e55",
            "data": {"cpuset": "0-1"},
        }
        patch = {
            "metadata": {"resourceVersion": got["metadata"]["resourceVersion"]},
            "status": {"devices": [entry]},
        }
        patched = await kube.patch_resource_claim_status("team", "claim-1", patch)
        assert patched["status"]["devices"] == [entry]
        assert patched["status"]["allocation"] == got["status"]["allocation"]
        assert api.resource_claim("team", "claim-1") == patched
        assert api.requests[-1].content_type == "application/merge-patch+json"

        with pytest.raises(KubeConflictError):  # the same resourceVersion again: stale
            await kube.patch_resource_claim_status("team", "claim-1", patch)
        wrong = {"status": {"devices": [{**entry, "device": "cpudevnuma001"}]}}
        with pytest.raises(KubeClientError, match="allocated device") as info:
            await kube.patch_resource_claim_status("team", "claim-1", wrong)
        assert info.value.status == 422
        json_patch = [{"op": "replace", "path": "/status/devices/0/data/cpuset", "value": "4"}]
        again = await kube.patch_resource_claim_status("team", "claim-1", json_patch)
        assert again["status"]["devices"][0]["data"] == {"cpuset": "4"}
        assert api.requests[-1].content_type == "application/json-patch+json"
        with pytest.raises(KubeNotFoundError):
            await kube.get_resource_claim("team", "other")


# --- watch --------------------------------------------------------------------------------------


async def next_event(events: Any) -> WatchEvent:
    with anyio.fail_after(10):
        event: WatchEvent = await events.__anext__()
        return event


@pytest.mark.anyio
async def test_watch_lists_then_streams_events_of_our_selector() -> None:
    async with connected() as (api, kube):
        first = await kube.create_resource_slice(slices()[0])
        events = kube.watch_resource_slices("dra.cpu", NODE)
        async with contextlib.aclosing(events):
            kind, listed = await next_event(events)
            assert kind == LISTED
            assert listed["items"] == [first]
            api.create_resource_slice(foreign_slice("gpu-a", driver="gpu.example.com", node=NODE))
            other = slices()[0]
            other["metadata"]["name"] = "node-a-dra.cpu-001"
            second = await kube.create_resource_slice(other)
            assert await next_event(events) == ("ADDED", second)
            edited = api.edit_resource_slice(
                first["metadata"]["name"], lambda o: o["metadata"].setdefault("labels", {"a": "b"})
            )
            assert await next_event(events) == ("MODIFIED", edited)
            api.kubelet_restart(NODE)
            kinds = [await next_event(events) for _ in range(2)]
            assert [(k, o["metadata"]["name"]) for k, o in kinds] == [
                ("DELETED", first["metadata"]["name"]),
                ("DELETED", second["metadata"]["name"]),
            ]
            assert api.resource_slices() == []  # the kubelet wipes every driver's slices


async def wait_for_watches(api: FakeApiServer, count: int) -> None:
    with anyio.fail_after(10):
        while api.open_watches != count:  # noqa: ASYNC110 (polling a plain counter)
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_watch_relists_when_its_version_was_compacted() -> None:
    async with connected() as (api, kube):
        events = kube.watch_resource_slices("dra.cpu", NODE)
        async with contextlib.aclosing(events):
            assert (await next_event(events))[0] == LISTED
            # An event, then a compaction before the watch (from the listed version) starts:
            # the server sends an ERROR 410 event and the adapter lists again.
            created = api.create_resource_slice(slices()[0])
            api.compact()
            kind, listed = await next_event(events)
            assert kind == LISTED
            assert listed["items"] == [created]
            lists = [r for r in api.requests if r.method == "GET" and not r.watch]
            assert len(lists) == 2


@pytest.mark.anyio
async def test_broken_watch_stream_is_a_server_error() -> None:
    async with connected() as (api, kube):
        events = kube.watch_resource_slices("dra.cpu", NODE)
        async with contextlib.aclosing(events):
            assert (await next_event(events))[0] == LISTED
            failures: list[Exception] = []

            async def wait_next() -> None:
                try:
                    await next_event(events)
                except KubeServerError as exc:
                    failures.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_next)
                await wait_for_watches(api, 1)
                api.break_watches()
        assert len(failures) == 1
        assert "stream broke" in str(failures[0])
        assert getattr(failures[0], "status", "?") is None


@pytest.mark.anyio
async def test_a_watch_error_answer_cut_short_is_a_server_error(tmp_path: Path) -> None:
    # The server answers the watch with an error status and the connection drops in the middle
    # of the body (a restarting API server, a load balancer): a KubeServerError like any other
    # broken watch, never a raw aiohttp error the publisher would not retry.
    listed = json.dumps(
        {"kind": "ResourceSliceList", "metadata": {"resourceVersion": "7"}, "items": []}
    )

    async def serve(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive()
            if b"watch=true" in data.partition(b"\r\n")[0]:
                await stream.send(
                    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 400\r\n\r\n" + b'{"kind": "Status", "mess'
                )
                return  # closes the connection with most of the body missing
            await stream.send(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                + f"Content-Length: {len(listed)}\r\n\r\n{listed}".encode()
            )

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    config = tmp_path / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        async with open_kube_client(config, request_timeout=5) as kube:
            events = kube.watch_resource_slices("dra.cpu", NODE)
            async with contextlib.aclosing(events):
                assert (await next_event(events))[0] == LISTED
                with pytest.raises(KubeServerError) as info:
                    await next_event(events)
        tg.cancel_scope.cancel()
    assert "watch resourceslices" in str(info.value)
    assert "500 Internal Server Error: (reading the answer failed: " in str(info.value)
    assert info.value.status == 500


@pytest.mark.anyio
async def test_watch_relists_when_the_server_answers_410() -> None:
    async with connected() as (api, kube):
        api.fail_next(status=410, watch=True, message="too old resource version")
        created = await kube.create_resource_slice(slices()[0])
        events = kube.watch_resource_slices("dra.cpu", NODE)
        async with contextlib.aclosing(events):
            assert await next_event(events) == (
                LISTED,
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceSliceList",
                    "metadata": {"resourceVersion": str(api.resource_version)},
                    "items": [created],
                },
            )
            kind, again = await next_event(events)  # the 410 made it list a second time
            assert kind == LISTED
            assert again["items"] == [created]
            assert [r.status for r in api.requests if r.watch] == [410]  # the 2nd is open


@pytest.mark.anyio
async def test_watch_resumes_after_the_server_ends_the_stream() -> None:
    async with (
        open_fake_apiserver() as api,
        open_kube_client(api.kubeconfig_path, watch_seconds=1) as kube,
    ):
        seen: list[WatchEvent] = []

        async def consume() -> None:
            events = kube.watch_resource_slices("dra.cpu", NODE)
            async with contextlib.aclosing(events):
                async for event in events:
                    seen.append(event)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await wait_for_watches(api, 1)
            with anyio.fail_after(10):
                while not [r for r in api.requests if r.watch]:  # noqa: ASYNC110
                    await anyio.sleep(0.05)  # until the first watch request has ended
            await wait_for_watches(api, 1)  # and the next one is open
            created = await kube.create_resource_slice(slices()[0])
            with anyio.fail_after(10):
                while len(seen) < 2:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert [kind for kind, _ in seen] == [LISTED, "ADDED"]
        assert seen[1][1] == created
        first = next(r for r in api.requests if r.watch)
        assert first.status == 200
        assert first.query["timeoutSeconds"] == "1"
        assert first.query["allowWatchBookmarks"] == "true"
        lists = [r for r in api.requests if r.method == "GET" and not r.watch]
        assert len(lists) == 1  # resumed from the bookmark, no relist


@pytest.mark.anyio
async def test_prepare_flow_reads_the_claim_and_records_the_cpuset() -> None:
    """What the kubelet plugin does: GET the claim, read it, patch status.devices."""
    async with connected() as (api, kube):
        gpu = {"request": "gpu", "driver": "gpu.example.com", "pool": "gpus", "device": "gpu-0"}
        claim = allocated_claim()
        claim["status"]["allocation"]["devices"]["results"].insert(0, gpu)
        claim["status"]["devices"] = [{k: gpu[k] for k in ("driver", "pool", "device")}]
        uid = api.add_resource_claim(claim)["metadata"]["uid"]

        got = await kube.get_resource_claim("team", "claim-1")
        allocation = read_claim(got, uid=uid, pool=NODE)
        assert [(d.device, d.consumed_cpus) for d in allocation.devices] == [("cpudevnuma000", 2)]
        patch = device_status_patch(got, allocation, CpuSet.parse("0,32"))
        assert patch is not None
        patched = await kube.patch_resource_claim_status("team", "claim-1", patch)
        assert patched["status"]["devices"] == [
            {"driver": "gpu.example.com", "pool": "gpus", "device": "gpu-0"},
            {
                "driver": "dra.cpu",
                "pool": NODE,
                "device": "cpudevnuma000",
                "shareID": "7d2a0b64-2f57-4c1e-a3d2-0c1b9f1e6e55",
                "data": {"cpuset": "0,32"},
            },
        ]
        # A second writer that read the claim before our patch is refused, not merged blindly.
        with pytest.raises(KubeConflictError):
            await kube.patch_resource_claim_status("team", "claim-1", patch)


# --- our HTTP client: connections, TLS, credentials, streaming, proxies --------------------------
# These talk to small raw servers written here (independent peers: they parse requests with
# anyio's buffered stream, not with dracpu.wire.http1), or to the aiohttp fake API server.

NODE_JSON = json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}).encode()


def write_kubeconfig(
    path: Path, server: str, *, ca: Path | None = None, cluster_extra: str = ""
) -> Path:
    cluster = f"server: '{server}'"
    if ca is not None:
        cluster += f", certificate-authority: '{ca}'"
    if cluster_extra:
        cluster += ", " + cluster_extra
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{{cluster}}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    return path


@dataclasses.dataclass
class RawRequest:
    connection: int
    head: str
    body: bytes

    @property
    def line(self) -> str:
        return self.head.split("\r\n")[0]

    def header(self, name: str) -> str | None:
        for line in self.head.split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None


async def read_request(buffered: BufferedByteReceiveStream, connection: int) -> RawRequest | None:
    """One request from the connection, ``None`` when the client closed it."""
    try:
        head = await buffered.receive_until(b"\r\n\r\n", 65536)
    except (anyio.IncompleteRead, anyio.EndOfStream):
        return None
    request = RawRequest(connection, head.decode("latin-1"), b"")
    length = int(request.header("Content-Length") or 0)
    if length:
        request.body = await buffered.receive_exactly(length)
    return request


def ok(body: bytes, *, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + extra
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


Handler = Callable[[anyio.abc.ByteStream, BufferedByteReceiveStream, int], Awaitable[None]]


def answering_node(seen: list[RawRequest] | None = None) -> Handler:
    """A handler that answers every request with the Node (recording the requests in ``seen``)."""

    async def handler(
        stream: anyio.abc.ByteStream, buffered: BufferedByteReceiveStream, number: int
    ) -> None:
        while (request := await read_request(buffered, number)) is not None:
            if seen is not None:
                seen.append(request)
            await stream.send(ok(NODE_JSON))

    return handler


@contextlib.asynccontextmanager
async def raw_server(
    handler: Handler, *, ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[int, list[int]]]:
    """A TCP (TLS) server on 127.0.0.1 calling ``handler(stream, buffered, number)`` for each
    connection; yields its port and the list of connection numbers accepted so far."""
    accepted: list[int] = []
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def serve(client: anyio.abc.SocketStream) -> None:
        stream: anyio.abc.ByteStream = client
        try:
            if ssl_context is not None:
                stream = await TLSStream.wrap(
                    client, server_side=True, ssl_context=ssl_context, standard_compatible=False
                )
            number = len(accepted)
            accepted.append(number)
            await handler(stream, BufferedByteReceiveStream(stream), number)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, ssl.SSLError, OSError):
            pass  # the client went away (or refused our certificate)
        finally:
            await anyio.aclose_forcefully(stream)

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        yield port, accepted
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_keep_alive_many_gets_use_one_connection(tmp_path: Path) -> None:
    seen: list[RawRequest] = []

    handler = answering_node(seen)

    async with raw_server(handler) as (port, accepted):
        config = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
        async with open_kube_client(config, request_timeout=10) as kube:
            for _ in range(20):
                assert (await kube.get_node(NODE))["metadata"]["name"] == NODE
    assert accepted == [0]
    assert len(seen) == 20
    first = seen[0]
    assert first.line == f"GET /api/v1/nodes/{NODE} HTTP/1.1"
    assert first.header("Host") == f"127.0.0.1:{port}"
    assert first.header("Authorization") == "Bearer t"
    assert first.header("Accept") == "application/json"
    assert (first.header("User-Agent") or "").startswith("dracpu/")


@pytest.mark.anyio
async def test_an_idle_connection_older_than_the_idle_limit_is_not_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Load balancers drop idle flows silently; past the limit a new connection is opened even
    # though the old one still looks open.
    monkeypatch.setattr(http_pool, "_IDLE_SECONDS", 0.05)

    handler = answering_node()

    async with raw_server(handler) as (port, accepted):
        config = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
        async with open_kube_client(config, request_timeout=10) as kube:
            await kube.get_node(NODE)
            await kube.get_node(NODE)  # at once: reused
            await anyio.sleep(0.2)
            await kube.get_node(NODE)  # idle too long: a new connection
    assert accepted == [0, 1]


@pytest.mark.anyio
async def test_basic_auth_from_the_kubeconfig(tmp_path: Path) -> None:
    seen: list[RawRequest] = []

    handler = answering_node(seen)

    async with raw_server(handler) as (port, _):
        config = tmp_path / "kubeconfig"
        config.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
            f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
            "users: [{name: u, user: {username: 'ad min', password: 'p:w'}}]\n"
            "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
        )
        async with open_kube_client(config, request_timeout=10) as kube:
            await kube.get_node(NODE)
    [request] = seen
    assert request.header("Authorization") == "Basic " + base64.b64encode(b"ad min:p:w").decode()


@pytest.mark.anyio
async def test_concurrent_requests_open_at_most_8_connections_then_reuse_them(
    tmp_path: Path,
) -> None:
    in_flight = [0, 0]  # now, most

    async def handler(
        stream: anyio.abc.ByteStream, buffered: BufferedByteReceiveStream, number: int
    ) -> None:
        while (request := await read_request(buffered, number)) is not None:
            assert request.line.startswith("GET ")
            in_flight[0] += 1
            in_flight[1] = max(in_flight)
            await anyio.sleep(0.02)
            in_flight[0] -= 1
            await stream.send(ok(NODE_JSON))

    async with raw_server(handler) as (port, accepted):
        config = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
        async with open_kube_client(config, request_timeout=10) as kube:
            async with anyio.create_task_group() as tg:
                for _ in range(30):
                    tg.start_soon(kube.get_node, NODE)
            assert len(accepted) == 8
            assert in_flight[1] == 8
            for _ in range(5):
                await kube.get_node(NODE)
            assert len(accepted) == 8  # idle connections were reused


@pytest.mark.anyio
@pytest.mark.parametrize("method", ["GET", "PATCH"])
async def test_a_reused_connection_closed_by_the_server_is_retried_for_get_only(
    tmp_path: Path, method: str
) -> None:
    """The keep-alive race: the server drops an idle connection just as the client reuses it.
    A GET is sent again on a new connection; a PATCH is not (it may have been applied)."""
    seen: list[RawRequest] = []
    claim = json.dumps(allocated_claim()).encode()

    async def handler(
        stream: anyio.abc.ByteStream, buffered: BufferedByteReceiveStream, number: int
    ) -> None:
        while (request := await read_request(buffered, number)) is not None:
            seen.append(request)
            if number == 0 and len(seen) == 2:
                return  # the second request on the first connection: closed, unanswered
            await stream.send(ok(claim))

    async with raw_server(handler) as (port, accepted):
        config = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
        async with open_kube_client(config, request_timeout=10) as kube:
            await kube.get_resource_claim("team", "claim-1")  # opens the connection
            if method == "GET":
                assert await kube.get_resource_claim("team", "claim-1")
                assert accepted == [0, 1]
                assert [(r.connection, r.line.split()[0]) for r in seen] == [
                    (0, "GET"),
                    (0, "GET"),
                    (1, "GET"),
                ]
            else:
                with pytest.raises(KubeServerError) as info:
                    await kube.patch_resource_claim_status("team", "claim-1", {"status": {}})
                assert info.value.status is None
                assert "cannot reach the API server" in str(info.value)
                assert [(r.connection, r.line.split()[0]) for r in seen] == [
                    (0, "GET"),
                    (0, "PATCH"),  # sent once, never again
                ]
                assert seen[1].body == b'{"status":{}}'
                assert seen[1].header("Content-Type") == "application/merge-patch+json"
                # The next request opens a new connection and works.
                assert await kube.get_resource_claim("team", "claim-1")
                assert accepted == [0, 1]


@pytest.mark.anyio
async def test_an_idle_connection_the_server_closed_is_not_reused(tmp_path: Path) -> None:
    """The server answers keep-alive, then closes the idle connection (an idle timeout): the
    next request, even a PATCH, goes on a new connection and is not lost."""
    seen: list[RawRequest] = []
    claim = json.dumps(allocated_claim()).encode()

    async def handler(
        stream: anyio.abc.ByteStream, buffered: BufferedByteReceiveStream, number: int
    ) -> None:
        request = await read_request(buffered, number)
        assert request is not None
        seen.append(request)
        await stream.send(ok(claim))  # no "Connection: close": reusable as far as HTTP says
        # ... and the handler returns: raw_server closes the connection.

    async with raw_server(handler) as (port, accepted):
        config = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
        async with open_kube_client(config, request_timeout=10) as kube:
            await kube.get_resource_claim("team", "claim-1")
            await anyio.sleep(0.1)  # the FIN arrives while the connection is idle
            await kube.patch_resource_claim_status("team", "claim-1", {"status": {}})
    assert accepted == [0, 1]
    assert [(r.connection, r.line.split()[0]) for r in seen] == [(0, "GET"), (1, "PATCH")]


# --- TLS ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: Path
    other_ca: Path
    server_cert: Path  # SAN IP:127.0.0.1
    server_key: Path
    named_cert: Path  # SAN DNS:api.cluster.test only
    named_key: Path

    def server_context(self, *, named: bool = False) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        if named:
            context.load_cert_chain(self.named_cert, self.named_key)
        else:
            context.load_cert_chain(self.server_cert, self.server_key)
        return context


def openssl(*args: str | Path) -> None:
    subprocess.run([OPENSSL, *map(str, args)], check=True, capture_output=True, timeout=60)


OPENSSL = shutil.which("openssl") or ""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if not OPENSSL:
        pytest.skip("the openssl CLI is not installed: cannot make test certificates")
    d = tmp_path_factory.mktemp("pki")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for name in ("ca", "other-ca"):
        openssl(
            "req", "-x509", *ec, "-keyout", d / f"{name}.key", "-out", d / f"{name}.pem",
            "-days", "2", "-subj", f"/CN=dracpu test {name}",
        )  # fmt: skip
    for name, san in (("server", "IP:127.0.0.1"), ("named", "DNS:api.cluster.test")):
        openssl(
            "req", *ec, "-keyout", d / f"{name}.key", "-out", d / f"{name}.csr",
            "-subj", f"/CN={name}",
        )  # fmt: skip
        (d / f"{name}.ext").write_text(
            f"subjectAltName={san}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
        )
        openssl(
            "x509", "-req", "-in", d / f"{name}.csr", "-CA", d / "ca.pem", "-CAkey", d / "ca.key",
            "-CAcreateserial", "-out", d / f"{name}.pem", "-days", "2",
            "-extfile", d / f"{name}.ext",
        )  # fmt: skip
    return Pki(
        ca=d / "ca.pem",
        other_ca=d / "other-ca.pem",
        server_cert=d / "server.pem",
        server_key=d / "server.key",
        named_cert=d / "named.pem",
        named_key=d / "named.key",
    )


@pytest.mark.anyio
async def test_tls_with_the_cluster_ca(pki: Pki, tmp_path: Path) -> None:
    async with open_fake_apiserver(ssl_context=pki.server_context()) as api:
        api.add_node(NODE, uid=NODE_UID)
        assert api.url.startswith("https://127.0.0.1:")
        config = write_kubeconfig(tmp_path / "kubeconfig", api.url, ca=pki.ca)
        async with open_kube_client(config, request_timeout=10) as kube:
            assert await kube.get_node(NODE) == api.node(NODE)
            stored = await kube.create_resource_slice(slices()[0])
            assert api.resource_slices() == [stored]


@pytest.mark.anyio
async def test_tls_keep_alive_many_gets_use_one_connection(pki: Pki, tmp_path: Path) -> None:
    # A TLS 1.3 server sends session tickets after the handshake: bytes the client reads with
    # the first answer, never a reason to think the idle connection was closed.
    handler = answering_node()

    async with raw_server(handler, ssl_context=pki.server_context()) as (port, accepted):
        config = write_kubeconfig(tmp_path / "kubeconfig", f"https://127.0.0.1:{port}", ca=pki.ca)
        async with open_kube_client(config, request_timeout=10) as kube:
            for _ in range(5):
                assert (await kube.get_node(NODE))["metadata"]["name"] == NODE
                await anyio.sleep(0.02)  # idle between requests, as between Prepares
    assert accepted == [0]


@pytest.mark.anyio
async def test_tls_with_a_wrong_ca_is_a_clear_server_error(pki: Pki, tmp_path: Path) -> None:
    async with open_fake_apiserver(ssl_context=pki.server_context()) as api:
        api.add_node(NODE, uid=NODE_UID)
        config = write_kubeconfig(tmp_path / "kubeconfig", api.url, ca=pki.other_ca)
        async with open_kube_client(config, request_timeout=10) as kube:
            with pytest.raises(KubeServerError) as info:
                await kube.get_node(NODE)
        assert info.value.status is None
        assert "get node node-a: cannot reach the API server" in str(info.value)
        assert "CERTIFICATE_VERIFY_FAILED" in str(info.value)
        assert api.requests == []


@pytest.mark.anyio
async def test_tls_server_name_is_the_name_sent_and_checked(pki: Pki, tmp_path: Path) -> None:
    async with open_fake_apiserver(ssl_context=pki.server_context(named=True)) as api:
        api.add_node(NODE, uid=NODE_UID)
        # The certificate names api.cluster.test, not 127.0.0.1: refused without the name ...
        plain = write_kubeconfig(tmp_path / "plain", api.url, ca=pki.ca)
        async with open_kube_client(plain, request_timeout=10) as kube:
            with pytest.raises(KubeServerError, match="CERTIFICATE_VERIFY_FAILED"):
                await kube.get_node(NODE)
        # ... accepted with it.
        named = write_kubeconfig(
            tmp_path / "named",
            api.url,
            ca=pki.ca,
            cluster_extra="tls-server-name: api.cluster.test",
        )
        async with open_kube_client(named, request_timeout=10) as kube:
            assert await kube.get_node(NODE) == api.node(NODE)


@pytest.mark.anyio
async def test_in_cluster_token_is_refreshed_between_requests(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-cluster loader's refresh_api_key_hook re-reads the rotated token file once its
    minute is over; the next request carries the new token (over TLS with the pod's CA)."""
    seen: list[RawRequest] = []

    handler = answering_node(seen)

    token = tmp_path / "token"
    token.write_text("token-1")
    shift = [datetime.timedelta(0)]

    class ShiftedClock(datetime.datetime):
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> ShiftedClock:
            moment = datetime.datetime.now(tz) + shift[0]
            return cls.fromtimestamp(moment.timestamp(), tz)

    monkeypatch.setattr(
        incluster_config,
        "datetime",
        types.SimpleNamespace(datetime=ShiftedClock, timedelta=datetime.timedelta),
    )
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(pki.ca))
    async with raw_server(handler, ssl_context=pki.server_context()) as (port, _):
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(port))
        async with open_kube_client(None, request_timeout=10) as kube:
            await kube.get_node(NODE)
            token.write_text("token-2")  # the kubelet rotates the projected token
            await kube.get_node(NODE)  # within the minute: the cached token
            shift[0] = datetime.timedelta(minutes=2)
            await kube.get_node(NODE)
    assert [r.header("Authorization") for r in seen] == [
        "bearer token-1",
        "bearer token-1",
        "bearer token-2",
    ]


# --- watch framing ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_watch_events_split_at_odd_places_in_chunks_and_packets(tmp_path: Path) -> None:
    def slice_obj(name: str, version: int) -> dict[str, Any]:
        return {
            "kind": "ResourceSlice",
            "metadata": {"name": name, "resourceVersion": str(version)},
        }

    events = [
        {"type": "ADDED", "object": slice_obj("a", 8)},
        {"type": "MODIFIED", "object": slice_obj("a", 9)},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "10"}}},
        {"type": "DELETED", "object": slice_obj("a", 11)},
    ]  # fmt: skip
    body = b"".join(json.dumps(e).encode() + b"\n" for e in events)
    # Chunk boundaries inside a JSON object, across a newline, several events in one chunk.
    cuts = [0, 5, 6, 40, len(body) // 2, len(body) // 2 + 1, len(body) - 1, len(body)]
    chunks = [body[a:b] for a, b in itertools.pairwise(cuts)]
    wire = b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in chunks) + b"0\r\n\r\n"
    listed = json.dumps(
        {"kind": "ResourceSliceList", "metadata": {"resourceVersion": "7"}, "items": []}
    ).encode()
    watches: list[RawRequest] = []
    second_watch = anyio.Event()

    async def handler(
        stream: anyio.abc.ByteStream, buffered: BufferedByteReceiveStream, number: int
    ) -> None:
        while (request := await read_request(buffered, number)) is not None:
            if "watch=true" not in request.line:
                await stream.send(ok(listed))
                continue
            watches.append(request)
            if len(watches) > 1:
                second_watch.set()
                await anyio.sleep_forever()
            await stream.send(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            for i in range(0, len(wire), 7):  # TCP packets cutting chunk headers too
                await stream.send(wire[i : i + 7])
                await anyio.sleep(0.001)  # let the client read each piece alone

    async with raw_server(handler) as (port, _):
        config = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
        async with open_kube_client(config, request_timeout=10, watch_seconds=60) as kube:
            stream = kube.watch_resource_slices("dra.cpu", NODE)
            async with contextlib.aclosing(stream):
                assert (await next_event(stream))[0] == LISTED
                got = [await next_event(stream) for _ in range(3)]
                async with anyio.create_task_group() as tg:
                    tg.start_soon(stream.__anext__)  # the stream ends: the watch is renewed
                    with anyio.fail_after(10):
                        await second_watch.wait()
                    tg.cancel_scope.cancel()
    assert got == [(e["type"], e["object"]) for e in events if e["type"] != "BOOKMARK"]
    assert "resourceVersion=7" in watches[0].line
    assert "resourceVersion=11" in watches[1].line  # renewed from the last event seen


# --- proxies ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def connect_proxy(*, refuse: bool = False) -> AsyncIterator[tuple[int, list[RawRequest]]]:
    """A CONNECT-only HTTP proxy on 127.0.0.1 that tunnels to the requested 127.0.0.1 port."""
    heads: list[RawRequest] = []

    async def handler(
        stream: anyio.abc.ByteStream, buffered: BufferedByteReceiveStream, number: int
    ) -> None:
        request = await read_request(buffered, number)
        assert request is not None
        heads.append(request)
        if refuse:
            await stream.send(
                b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 4\r\n\r\nnope"
            )
            return
        host, _, port = request.line.split()[1].rpartition(":")
        upstream = await anyio.connect_tcp(host, int(port))
        await stream.send(b"HTTP/1.1 200 Connection established\r\n\r\n")

        async def pump(source: anyio.abc.ByteReceiveStream, sink: anyio.abc.ByteStream) -> None:
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                while True:
                    await sink.send(await source.receive())

        async with upstream, anyio.create_task_group() as tg:
            tg.start_soon(pump, buffered, upstream)
            await pump(upstream, stream)
            tg.cancel_scope.cancel()

    async with raw_server(handler) as (port, _):
        yield port, heads


@pytest.mark.anyio
async def test_https_through_a_proxy_tunnels_with_connect(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (*_PROXY_VARIABLES, "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    async with (
        open_fake_apiserver(ssl_context=pki.server_context()) as api,
        connect_proxy() as (proxy_port, heads),
    ):
        api.add_node(NODE, uid=NODE_UID)
        config = write_kubeconfig(
            tmp_path / "kubeconfig",
            api.url,
            ca=pki.ca,
            cluster_extra=f"proxy-url: 'http://who:pw@127.0.0.1:{proxy_port}'",
        )
        async with open_kube_client(config, request_timeout=10) as kube:
            assert await kube.get_node(NODE) == api.node(NODE)
            assert await kube.get_node(NODE) == api.node(NODE)  # the tunnel is kept alive
        api_port = api.url.rpartition(":")[2]
        [connect] = heads
        assert connect.line == f"CONNECT 127.0.0.1:{api_port} HTTP/1.1"
        assert (
            connect.header("Proxy-Authorization") == "Basic " + base64.b64encode(b"who:pw").decode()
        )
        assert [r.path for r in api.requests] == [f"/api/v1/nodes/{NODE}"] * 2


@pytest.mark.anyio
async def test_a_proxy_refusing_connect_is_a_server_error(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (*_PROXY_VARIABLES, "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    async with connect_proxy(refuse=True) as (proxy_port, _):
        monkeypatch.setenv("https_proxy", f"127.0.0.1:{proxy_port}")  # no scheme: http
        config = write_kubeconfig(tmp_path / "kubeconfig", "https://127.0.0.1:1", ca=pki.ca)
        async with open_kube_client(config, request_timeout=10) as kube:
            with pytest.raises(KubeServerError) as info:
                await kube.get_node(NODE)
    assert "refused CONNECT 127.0.0.1:1: 407 Proxy Authentication Required" in str(info.value)
    assert info.value.status is None


@pytest.mark.anyio
async def test_only_http_proxies_are_accepted_from_the_kubeconfig(tmp_path: Path) -> None:
    config = write_kubeconfig(
        tmp_path / "kubeconfig",
        "https://127.0.0.1:6443",
        cluster_extra="proxy-url: 'socks5://127.0.0.1:1080'",
    )
    with pytest.raises(ConfigError, match="only http:// proxies"):
        async with open_kube_client(config):
            pass


@pytest.mark.anyio
async def test_a_server_url_path_prefix_is_kept(tmp_path: Path) -> None:
    seen: list[RawRequest] = []

    async def handler(
        stream: anyio.abc.ByteStream, buffered: BufferedByteReceiveStream, number: int
    ) -> None:
        while (request := await read_request(buffered, number)) is not None:
            seen.append(request)
            await stream.send(ok(b'{"metadata": {"resourceVersion": "3"}, "items": []}'))

    async with raw_server(handler) as (port, _):
        config = write_kubeconfig(
            tmp_path / "kubeconfig", f"http://127.0.0.1:{port}/k8s/clusters/c-1/"
        )
        async with open_kube_client(config, request_timeout=10) as kube:
            await kube.list_resource_slices("dra.cpu", "node a/b")
    [request] = seen
    assert request.line == (
        "GET /k8s/clusters/c-1/apis/resource.k8s.io/v1/resourceslices"
        "?fieldSelector=spec.driver%3Ddra.cpu%2Cspec.nodeName%3Dnode%20a%2Fb HTTP/1.1"
    )
