"""The fake API server itself (dracpu.sim.fake_apiserver), spoken to with plain HTTP (aiohttp),
not through our adapter: the behaviours the real server has and our tests rely on."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import kubernetes_validate
import pytest

from dracpu.sim.apiserver_patch import PatchError, apply_json_patch, apply_merge_patch
from dracpu.sim.apiserver_validation import SchemaValidator
from dracpu.sim.fake_apiserver import FakeApiServer, build_resource_claim, open_fake_apiserver

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIM = "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c1"


def slice_obj(name: str, *, node: str = "node-a", driver: str = "dra.cpu") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "cpudev000", "attributes": {"dra.cpu/cpuID": {"int": 0}}}],
        },
    }


@asynccontextmanager
async def server(**options: Any) -> AsyncIterator[tuple[FakeApiServer, aiohttp.ClientSession]]:
    async with (
        open_fake_apiserver(**options) as api,
        aiohttp.ClientSession(base_url=api.url) as http,
    ):
        yield api, http


async def call(
    http: aiohttp.ClientSession,
    method: str,
    path: str,
    body: Any = None,
    *,
    content_type: str = "application/json",
    params: dict[str, str] | None = None,
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body)
    headers = {"Content-Type": content_type}
    async with http.request(method, path, data=data, headers=headers, params=params) as response:
        return response.status, await response.json()


async def watch_lines(
    http: aiohttp.ClientSession, params: dict[str, str], count: int
) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    async with http.get(SLICES, params={"watch": "true", **params}) as response:
        assert response.status == 200
        while len(events) < count:
            line = await response.content.readline()
            if not line:
                break
            events.append(json.loads(line))
    return events


# --- patches ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "patch", "result"),
    [  # RFC 7386 appendix A
        ({"a": "b"}, {"a": "c"}, {"a": "c"}),
        ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
        ({"a": "b"}, {"a": None}, {}),
        ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
        ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
        ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
        ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
        (["a", "b"], ["c", "d"], ["c", "d"]),
        ({"a": "b"}, ["c"], ["c"]),
        ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
        ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
        ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
    ],
)
def test_merge_patch_follows_rfc_7386(target: Any, patch: Any, result: Any) -> None:
    assert apply_merge_patch(target, patch) == result


def test_json_patch_operations() -> None:
    doc = {"a": {"b": [1, 2, 3]}, "c": "x"}
    ops = [
        {"op": "test", "path": "/c", "value": "x"},
        {"op": "add", "path": "/a/b/1", "value": 9},
        {"op": "add", "path": "/a/b/-", "value": 4},
        {"op": "remove", "path": "/a/b/0"},
        {"op": "replace", "path": "/c", "value": "y"},
        {"op": "copy", "from": "/c", "path": "/d"},
        {"op": "move", "from": "/d", "path": "/a/e~1f"},
    ]
    assert apply_json_patch(doc, ops) == {"a": {"b": [9, 2, 3, 4], "e/f": "y"}, "c": "y"}
    assert doc == {"a": {"b": [1, 2, 3]}, "c": "x"}  # the target is not modified


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ([{"op": "test", "path": "/c", "value": "z"}], "test of '/c' failed"),
        ([{"op": "remove", "path": "/nope"}], "no member"),
        ([{"op": "replace", "path": "/a/b/7", "value": 1}], "out of range"),
        ([{"op": "add", "path": "/a/b/01", "value": 1}], "not an array index"),
        ([{"op": "add", "path": "a", "value": 1}], "not a JSON pointer"),
        ([{"op": "add", "path": "/c"}], "no value"),
        ([{"op": "frobnicate", "path": "/c"}], "unknown op"),
        ({"op": "add"}, "must be a list"),
    ],
)
def test_json_patch_errors(ops: Any, message: str) -> None:
    with pytest.raises(PatchError, match=message):
        apply_json_patch({"a": {"b": [1]}, "c": "x"}, ops)


# --- schema -------------------------------------------------------------------------------------


def test_a_kind_without_schema_is_an_error_at_start() -> None:
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        SchemaValidator(kinds=(("resource.k8s.io/v1", "NoSuchKind"),))


def test_schema_uses_the_newest_kubernetes_version_and_is_strict() -> None:
    validator = SchemaValidator(kinds=(("resource.k8s.io/v1", "ResourceSlice"),))
    assert validator.version == kubernetes_validate.latest_version()
    good = slice_obj("s")
    assert validator.errors(good) == []
    bad = slice_obj("s")
    bad["spec"]["devices"][0]["attributes"]["dra.cpu/cpuID"] = {"int": "0"}
    bad["spec"]["unknown"] = 1
    errors = validator.errors(bad)
    assert any("spec.devices.0.attributes.dra.cpu/cpuID.int" in e for e in errors)
    assert any("'unknown' was unexpected" in e for e in errors)
    assert validator.errors({"apiVersion": "v1", "kind": "Pod"}) == [
        "no schema for apiVersion 'v1' kind 'Pod'"
    ]


def test_seeding_invalid_objects_fails() -> None:
    api = FakeApiServer()
    claim = build_resource_claim("ns", "c1", [])
    claim["spec"]["devices"]["requests"][0]["exactly"]["count"] = "one"
    with pytest.raises(ValueError, match="count"):
        api.add_resource_claim(claim)
    with pytest.raises(ValueError, match="422"):
        api.create_resource_slice({**slice_obj("s"), "spec": {"driver": "dra.cpu"}})


# --- slices -------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_kubeconfig_points_at_the_server_and_is_removed() -> None:
    async with open_fake_apiserver() as api:
        config = json.loads(api.kubeconfig_path.read_text())
        assert config["clusters"][0]["cluster"]["server"] == api.url
        assert api.url.startswith("http://127.0.0.1:")
        path = api.kubeconfig_path
    assert not path.exists()


@pytest.mark.anyio
async def test_versions_generations_and_no_op_updates() -> None:
    async with server() as (api, http):
        status, created = await call(http, "POST", SLICES, slice_obj("s1"))
        assert status == 201
        meta = created["metadata"]
        assert (meta["generation"], meta["resourceVersion"]) == (1, str(api.resource_version))
        assert meta["creationTimestamp"].endswith("Z")

        status, same = await call(http, "PUT", f"{SLICES}/s1", created)
        assert status == 200
        assert same == created  # nothing changed: no new version

        labelled = {**created, "metadata": {**meta, "labels": {"a": "b"}}}
        _, after_label = await call(http, "PUT", f"{SLICES}/s1", labelled)
        assert after_label["metadata"]["generation"] == 1
        assert int(after_label["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])

        respec = json.loads(json.dumps(after_label))
        respec["spec"]["pool"]["generation"] = 5
        _, after_spec = await call(http, "PUT", f"{SLICES}/s1", respec)
        assert after_spec["metadata"]["generation"] == 2

        status, body = await call(http, "PUT", f"{SLICES}/s1", respec)  # stale version
        assert status == 409
        assert body["reason"] == "Conflict"
        assert body["kind"] == "Status"
        status, body = await call(http, "PUT", f"{SLICES}/other", respec)
        assert (status, body["reason"]) == (400, "BadRequest")


@pytest.mark.anyio
async def test_generate_name_and_422_details() -> None:
    async with server() as (_, http):
        obj = slice_obj("")
        obj["metadata"] = {"generateName": "node-a-dra.cpu-"}
        status, created = await call(http, "POST", SLICES, obj)
        assert status == 201
        name = created["metadata"]["name"]
        assert name.startswith("node-a-dra.cpu-")
        assert len(name) == len("node-a-dra.cpu-") + 5

        bad = slice_obj("bad")
        bad["spec"]["pool"]["resourceSliceCount"] = 0
        bad["spec"]["devices"][0]["name"] = "Not_A_Label"
        status, body = await call(http, "POST", SLICES, bad)
        assert status == 422
        assert body["reason"] == "Invalid"
        assert body["message"].startswith('ResourceSlice.resource.k8s.io "bad" is invalid: [')
        causes = [c["message"] for c in body["details"]["causes"]]
        assert any("resourceSliceCount" in c for c in causes)
        assert any("DNS label" in c for c in causes)

        status, body = await call(http, "POST", SLICES, slice_obj("x"), content_type="text/plain")
        assert status == 415


@pytest.mark.anyio
async def test_field_selectors_are_the_real_servers() -> None:
    async with server() as (api, http):
        for name, node, driver in [
            ("a", "node-a", "dra.cpu"),
            ("b", "node-b", "dra.cpu"),
            ("c", "node-a", "gpu.example.com"),
        ]:
            api.create_resource_slice(slice_obj(name, node=node, driver=driver))
        selector = {"fieldSelector": "spec.nodeName=node-a,spec.driver!=gpu.example.com"}
        status, listing = await call(http, "GET", SLICES, params=selector)
        assert status == 200
        assert [i["metadata"]["name"] for i in listing["items"]] == ["a"]
        assert listing["metadata"]["resourceVersion"] == str(api.resource_version)
        status, body = await call(
            http, "GET", SLICES, params={"fieldSelector": "spec.pool.name=node-a"}
        )
        assert status == 400
        assert "spec.pool.name" in body["message"]

        # The kubelet's wipe: DELETE of the collection with a node selector.
        status, deleted = await call(
            http, "DELETE", SLICES, params={"fieldSelector": "spec.nodeName=node-a"}
        )
        assert status == 200
        assert sorted(i["metadata"]["name"] for i in deleted["items"]) == ["a", "c"]
        assert [s["metadata"]["name"] for s in api.resource_slices()] == ["b"]


@pytest.mark.anyio
async def test_watch_versions_replay_and_410() -> None:
    async with server() as (api, http):
        first = api.create_resource_slice(slice_obj("a"))
        start = api.resource_version
        second = api.create_resource_slice(slice_obj("b"))
        api.delete_resource_slice("a")

        # No version: the current state as ADDED events, then live ones.
        events = await watch_lines(http, {"timeoutSeconds": "1"}, 1)
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b")]

        # From a version: exactly the later events, the DELETED one with its own version.
        events = await watch_lines(http, {"resourceVersion": str(start), "timeoutSeconds": "1"}, 2)
        assert [e["type"] for e in events] == ["ADDED", "DELETED"]
        assert events[0]["object"] == second
        assert events[1]["object"]["metadata"]["uid"] == first["metadata"]["uid"]
        assert events[1]["object"]["metadata"]["resourceVersion"] == str(api.resource_version)

        # At the end of timeoutSeconds: a bookmark with the current version, then EOF.
        events = await watch_lines(
            http,
            {
                "resourceVersion": str(api.resource_version),
                "timeoutSeconds": "1",
                "allowWatchBookmarks": "true",
            },
            5,
        )
        assert events == [
            {
                "type": "BOOKMARK",
                "object": {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceSlice",
                    "metadata": {"resourceVersion": str(api.resource_version)},
                },
            }
        ]

        api.compact()
        events = await watch_lines(http, {"resourceVersion": str(start)}, 5)
        assert len(events) == 1
        assert events[0]["type"] == "ERROR"
        assert events[0]["object"]["code"] == 410
        assert events[0]["object"]["reason"] == "Expired"


@pytest.mark.anyio
async def test_history_limit_expires_old_versions() -> None:
    async with server(history=3) as (api, http):
        api.add_node("node-a")  # version "0" would mean "any version"
        start = api.resource_version
        for index in range(5):
            api.create_resource_slice(slice_obj(f"s{index}"))
        events = await watch_lines(http, {"resourceVersion": str(start)}, 5)
        assert [e["type"] for e in events] == ["ERROR"]
        events = await watch_lines(
            http, {"resourceVersion": str(api.resource_version - 3), "timeoutSeconds": "1"}, 3
        )
        assert [e["object"]["metadata"]["name"] for e in events] == ["s2", "s3", "s4"]


# --- claims -------------------------------------------------------------------------------------


def allocated() -> dict[str, Any]:
    result = {"request": "cpus", "driver": "dra.cpu", "pool": "node-a", "device": "cpudev000"}
    return build_resource_claim("ns", "c1", [result])


@pytest.mark.anyio
async def test_claim_status_writes_change_only_the_status_and_version() -> None:
    async with server(schema_validation=False) as (api, http):
        stored = api.add_resource_claim(allocated())
        entry = {"driver": "dra.cpu", "pool": "node-a", "device": "cpudev000"}
        versions = []
        for cpuset in ("0-3", "4-7"):
            patch = {"status": {"devices": [{**entry, "data": {"cpuset": cpuset}}]}}
            status, body = await call(
                http, "PATCH", f"{CLAIM}/status", patch, content_type="application/merge-patch+json"
            )
            assert status == 200
            versions.append(body)
        first, second = versions
        assert first["status"]["devices"][0]["data"] == {"cpuset": "0-3"}
        assert second["status"]["devices"][0]["data"] == {"cpuset": "4-7"}
        for body in versions:
            assert body["spec"] == stored["spec"]
            assert body["status"]["allocation"] == stored["status"]["allocation"]
            assert {k: v for k, v in body["metadata"].items() if k != "resourceVersion"} == {
                k: v for k, v in stored["metadata"].items() if k != "resourceVersion"
            }
        rvs = [int(b["metadata"]["resourceVersion"]) for b in (stored, first, second)]
        assert rvs == sorted(set(rvs))
        current = api.resource_claim("ns", "c1")
        assert current == second
        current["spec"]["devices"]["requests"][0]["name"] = "changed by the reader"
        current["metadata"]["labels"] = {"changed": "by the reader"}
        status, body = await call(http, "GET", CLAIM)
        assert (status, body) == (200, second)


@pytest.mark.anyio
async def test_claim_status_writes_are_validated() -> None:
    async with server() as (api, http):
        stored = api.add_resource_claim(allocated())
        status, body = await call(http, "GET", CLAIM)
        assert (status, body) == (200, stored)
        entry = {"driver": "dra.cpu", "pool": "node-a", "device": "cpudev000"}

        for devices, message in [
            ([{**entry, "data": "0-3"}], "must be a JSON object"),
            ([entry, entry], "Duplicate value"),
            ([{**entry, "data": {"cpuset": "x" * 11000}}], "Too long"),
            ([{**entry, "device": "cpudev001"}], "must be an allocated device"),
        ]:
            patch = {"status": {"devices": devices}}
            status, body = await call(
                http, "PATCH", f"{CLAIM}/status", patch, content_type="application/merge-patch+json"
            )
            assert status == 422, devices
            assert message in body["message"]

        status, _ = await call(
            http, "PATCH", f"{CLAIM}/status", {}, content_type="application/apply-patch+yaml"
        )
        assert status == 415

        # PUT of the status: only the status changes, spec edits are ignored.
        whole = json.loads(json.dumps(stored))
        whole["status"]["devices"] = [{**entry, "data": {"cpuset": "0"}}]
        whole["spec"]["devices"]["requests"][0]["name"] = "renamed"
        status, body = await call(http, "PUT", f"{CLAIM}/status", whole)
        assert status == 200
        assert body["status"]["devices"] == whole["status"]["devices"]
        assert body["spec"] == stored["spec"]

        # A strategic merge patch replaces the list like a merge patch.
        smp = {"status": {"devices": [{**entry, "data": {"cpuset": "1"}}]}}
        status, body = await call(
            http,
            "PATCH",
            f"{CLAIM}/status",
            smp,
            content_type="application/strategic-merge-patch+json",
        )
        assert status == 200
        assert body["status"]["devices"] == smp["status"]["devices"]


def _slice_variants() -> list[tuple[dict[str, Any], bool]]:
    good = slice_obj("s")
    wrong_type = slice_obj("s")
    wrong_type["spec"]["pool"]["generation"] = "1"
    unknown = slice_obj("s")
    unknown["spec"]["devices"][0]["extra"] = True
    missing = slice_obj("s")
    del missing["spec"]["pool"]["name"]
    capacity = slice_obj("s")
    capacity["spec"]["devices"][0]["capacity"] = {"dra.cpu/cpu": {"value": "4"}}
    return [(good, True), (wrong_type, False), (unknown, False), (missing, False), (capacity, True)]


@pytest.mark.parametrize(("obj", "valid"), _slice_variants())
def test_schema_verdict_equals_kubernetes_validate(obj: dict[str, Any], valid: bool) -> None:
    """The cached, inlined validator agrees with kubernetes_validate.validate itself."""
    version = kubernetes_validate.latest_version()
    try:
        kubernetes_validate.validate(obj, version, strict=True)
        reference_ok = True
    except kubernetes_validate.ValidationError:
        reference_ok = False
    validator = SchemaValidator(kinds=(("resource.k8s.io/v1", "ResourceSlice"),))
    assert reference_ok == valid
    assert (validator.errors(obj) == []) == valid
