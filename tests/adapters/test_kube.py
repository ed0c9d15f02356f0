"""The Kubernetes adapter (dracpu.adapters.kube, requests through the ``kubernetes.aio``
client) against the aiohttp fake API server (dracpu.sim.fake_apiserver): what each call sends and
what it makes of the answers. Transport behaviour (connections, TLS, proxies, failures) is in
test_kube_transport.py."""

from __future__ import annotations

import contextlib
import copy
import secrets
from pathlib import Path
from typing import Any

import anyio
import pytest
from kubernetes.aio.client import rest

from dracpu import __version__
from dracpu.adapters.kube import (
    LISTED,
    WatchEvent,
    kubelet_version,
    open_kube_client,
)
from dracpu.core.claims import device_status_patch, read_claim
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy, published_devices
from dracpu.core.slices import build_resource_slices, consumable_capacity_dropped
from dracpu.errors import (
    ConfigError,
    DracpuError,
    KubeAPIError,
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


# --- nodes, answers with an error status -------------------------------------------------------


@pytest.mark.anyio
async def test_get_node_returns_the_object_as_a_plain_dict() -> None:
    async with connected() as (api, kube):
        node = await kube.get_node(NODE)
        assert node == api.node(NODE)
        assert node["metadata"]["uid"] == NODE_UID
        assert type(node) is dict


@pytest.mark.anyio
async def test_the_kubelets_version_is_read_from_the_nodes_status() -> None:
    async with connected() as (api, kube):
        api.add_node("reported", kubelet_version="v1.34.2")  # validated as a Node
        assert kubelet_version(await kube.get_node("reported")) == "v1.34.2"
        with pytest.raises(DracpuError, match=f"Node '{NODE}' has no status.nodeInfo"):
            kubelet_version(await kube.get_node(NODE))  # no status: its kubelet never reported


@pytest.mark.anyio
async def test_not_found_names_the_operation_the_server_and_its_message() -> None:
    async with connected() as (api, kube):
        with pytest.raises(KubeNotFoundError) as info:
            await kube.get_node("nope")
    assert info.value.status == 404
    assert str(info.value) == (
        f'get node nope: the API server {api.url} answered 404 Not Found: nodes "nope" not found'
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "reason", "error"),
    [
        (500, "Internal Server Error", KubeServerError),
        (503, "Service Unavailable", KubeServerError),
        (429, "Too Many Requests", KubeServerError),
        (409, "Conflict", KubeConflictError),
        (403, "Forbidden", KubeClientError),
        (404, "Not Found", KubeNotFoundError),
    ],
)
async def test_http_errors_map_to_the_error_tree(
    status: int, reason: str, error: type[Exception]
) -> None:
    async with connected() as (api, kube):
        api.fail_next(status=status, message="injected by the test")
        with pytest.raises(error) as info:
            await kube.get_node(NODE)
        assert getattr(info.value, "status", None) == status
        assert str(info.value) == (
            f"get node {NODE}: the API server {api.url} answered {status} {reason}: "
            "injected by the test"
        )
        assert await kube.get_node(NODE)  # only the next request failed


@pytest.mark.anyio
async def test_success_listeners_hear_of_every_answered_request_and_only_those() -> None:
    async with connected() as (api, kube):
        heard: list[str] = []
        remove = kube.on_success(lambda: heard.append("a"))
        kube.on_success(lambda: heard.append("b"))
        await kube.get_node(NODE)
        assert heard == ["a", "b"]
        api.fail_next(status=503)
        api.fail_next(2, status=None)  # no answer at all (aiohttp sends a GET twice)
        api.fail_next(status=404)
        for _ in range(3):
            with pytest.raises(KubeAPIError):
                await kube.get_node(NODE)
        assert heard == ["a", "b"]
        remove()
        await kube.list_resource_slices("dra.cpu", NODE)
        assert heard == ["a", "b", "b"]
        events = kube.watch_resource_slices("dra.cpu", NODE)
        async with contextlib.aclosing(events):
            assert (await next_event(events))[0] == LISTED  # the list: one success
            api.create_resource_slice(slices()[0])
            assert (await next_event(events))[0] == "ADDED"  # the watch's head: another
        assert heard == ["a", "b", "b", "b", "b"]


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
        assert str(failures[0]).startswith(
            f"watch resourceslices spec.driver=dra.cpu,spec.nodeName={NODE}: reading the answer "
            f"of the API server {api.url} failed: connection closed by the server in the middle "
            "of the answer: "
        )
        assert getattr(failures[0], "status", "?") is None


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


# --- every request goes through the kubernetes client -------------------------------------------


@pytest.mark.anyio
async def test_every_kind_of_request_is_sent_by_the_kubernetes_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each request the fake API server receives went through the library's REST layer
    (``kubernetes.aio.client.rest.RESTClientObject.request``, wrapped here to add a header with
    a secret only this test knows) and aiohttp (its default ``Accept-Encoding``), and carries
    what the library adds (``Content-Type`` even on a GET, the token from the kubeconfig, our
    User-Agent as the ``ApiClient`` default header). One of each request the daemon makes."""
    secret = secrets.token_hex(16)
    through_rest: list[tuple[str, str]] = []
    original = rest.RESTClientObject.request

    async def tagged(
        self: rest.RESTClientObject, method: str, url: str, headers: Any = None, **kwargs: Any
    ) -> Any:
        through_rest.append((method, url))
        tagged_headers = {**headers, "X-Test": secret}
        return await original(self, method, url, headers=tagged_headers, **kwargs)  # type: ignore[no-untyped-call]

    monkeypatch.setattr(rest.RESTClientObject, "request", tagged)
    async with open_fake_apiserver() as api:
        api.add_node(NODE, uid=NODE_UID)
        api.add_resource_claim(allocated_claim())
        async with open_kube_client(api.kubeconfig_path, watch_seconds=1) as kube:
            await kube.get_node(NODE)
            claim = await kube.get_resource_claim("team", "claim-1")
            entry = {k: claim["status"]["allocation"]["devices"]["results"][0][k] for k in
                     ("driver", "pool", "device", "shareID")}  # fmt: skip
            await kube.patch_resource_claim_status(
                "team", "claim-1", {"status": {"devices": [entry]}}
            )
            stored = await kube.create_resource_slice(slices()[0])
            name = stored["metadata"]["name"]
            stored = await kube.update_resource_slice(stored)
            events = kube.watch_resource_slices("dra.cpu", NODE)
            async with contextlib.aclosing(events):
                assert (await next_event(events))[0] == LISTED
                await kube.delete_resource_slice(name, uid=stored["metadata"]["uid"])
                assert (await next_event(events))[0] == "DELETED"
    kinds = {(r.method, r.path.rpartition("/")[2] if r.method != "GET" else r.path, r.watch)
             for r in api.requests}  # fmt: skip
    slices_path = "/apis/resource.k8s.io/v1/resourceslices"
    assert kinds == {
        ("GET", f"/api/v1/nodes/{NODE}", False),
        ("GET", "/apis/resource.k8s.io/v1/namespaces/team/resourceclaims/claim-1", False),
        ("PATCH", "status", False),
        ("POST", "resourceslices", False),
        ("PUT", name, False),
        ("GET", slices_path, False),
        ("GET", slices_path, True),
        ("DELETE", name, False),
    }
    assert len(through_rest) == len(api.requests)
    for request in api.requests:
        headers = {key.lower(): value for key, value in request.headers.items()}
        assert headers["x-test"] == secret, request
        assert "gzip" in headers["accept-encoding"]  # aiohttp's ClientRequest.DEFAULT_HEADERS
        assert headers["user-agent"] == f"dracpu/{__version__}"
        assert headers["authorization"] == "Bearer fake-token"
        assert headers["content-type"] == request.content_type != ""
