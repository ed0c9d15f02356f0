"""Reading ResourceClaims for Prepare and building their status patch (dracpu.core.claims)."""

from __future__ import annotations

import copy
from fractions import Fraction
from typing import Any

import pytest

from dracpu.core.claims import (
    MAX_STATUS_DATA_BYTES,
    AllocatedDevice,
    OpaqueConfig,
    device_status_patch,
    parse_whole_quantity,
    read_claim,
    reserved_pods,
)
from dracpu.core.commands import DeviceResult, PrepareClaim
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CAPACITY_CPU, CpuDeviceMode, GroupBy, published_devices
from dracpu.core.effects import ClaimPrepared, Reply
from dracpu.core.node_config import NodeConfig
from dracpu.core.slices import build_resource_slices
from dracpu.core.state import NodeState, apply
from dracpu.errors import ClaimError
from dracpu.sim.apiserver_patch import apply_merge_patch
from dracpu.sim.apiserver_validation import SchemaValidator, claim_status_errors
from dracpu.sim.fake_apiserver import build_resource_claim
from dracpu.sim.topologies import FIXTURES, build_topology
from tests.core import scheduler_model

UID = "0b6f2c1e-8a51-4b8e-9d43-5b0e7f3c2a10"
NODE = "node-a"
SHARE = "7d2a0b64-2f57-4c1e-a3d2-0c1b9f1e6e55"


def grouped(device: str = "cpudevnuma000", cpus: str = "4", **extra: Any) -> dict[str, Any]:
    result = {
        "request": "cpus",
        "driver": "dra.cpu",
        "pool": NODE,
        "device": device,
        "shareID": SHARE,
        "consumedCapacity": {"dra.cpu/cpu": cpus},
    }
    result.update(extra)
    return result


def individual(device: str, request: str = "cpus") -> dict[str, Any]:
    return {"request": request, "driver": "dra.cpu", "pool": NODE, "device": device}


def claim(results: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    obj = build_resource_claim("default", "pod-cpus", results, uid=UID, **kwargs)
    obj["metadata"]["resourceVersion"] = "42"
    return obj


# --- quantities ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", 1),
        ("4", 4),
        ("+3", 3),
        ("2000m", 2),
        ("1e1", 10),
        ("1E2", 100),
        ("1.0", 1),
        ("16384", 16384),
        ("1k", 1000),
        ("1Ki", 1024),
        ("4000000000n", 4),
    ],
)
def test_whole_quantities_are_accepted(text: str, expected: int) -> None:
    assert parse_whole_quantity(text) == expected


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("0", "not positive"),
        ("-1", "not positive"),
        ("0.0", "not positive"),
        ("1.5", "not a whole number"),
        ("500m", "not a whole number"),
        ("17Ki", "out of range"),
        ("16385", "out of range"),
        ("1e999999999", "out of range"),
        ("1e-999999999", "out of range"),
        ("99999999999999999999999999", "out of range"),
        ("abc", "not a Kubernetes quantity"),
        ("", "not a Kubernetes quantity"),
        ("1 ", "not a Kubernetes quantity"),
        ("1" * 65, "not a Kubernetes quantity"),
        (4, "not a quantity string"),
        (None, "not a quantity string"),
    ],
)
def test_bad_quantities_are_refused(value: object, why: str) -> None:
    with pytest.raises(ClaimError, match=why):
        parse_whole_quantity(value)


# --- read_claim: good claims -------------------------------------------------------------------


def test_grouped_claim_gives_consumed_cpus_and_share_id() -> None:
    allocation = read_claim(claim([grouped(cpus="4")]), uid=UID, pool=NODE)
    assert allocation.uid == UID
    assert (allocation.namespace, allocation.name) == ("default", "pod-cpus")
    assert allocation.resource_version == "42"
    assert allocation.devices == (
        AllocatedDevice(
            request="cpus", pool=NODE, device="cpudevnuma000", share_id=SHARE, consumed_cpus=4
        ),
    )
    assert allocation.device_results() == (
        DeviceResult(request="cpus", pool=NODE, device="cpudevnuma000", consumed_cpus=4),
    )
    assert allocation.configs == ()


def test_individual_claim_keeps_order_and_strips_subrequests() -> None:
    results = [
        individual("cpudev003", request="main/small"),
        individual("cpudev004", request="main/small"),
        individual("cpudev010", request="other"),
    ]
    allocation = read_claim(claim(results), uid=UID, pool=NODE)
    assert [(d.request, d.device, d.consumed_cpus) for d in allocation.devices] == [
        ("main", "cpudev003", None),
        ("main", "cpudev004", None),
        ("other", "cpudev010", None),
    ]
    # The subrequest is kept apart: opaque configs may name "main" or "main/small".
    assert [(d.subrequest, d.request_ref) for d in allocation.devices] == [
        ("small", "main/small"),
        ("small", "main/small"),
        ("", "other"),
    ]


def test_other_drivers_results_and_configs_are_ignored() -> None:
    results = [
        {"request": "gpu", "driver": "gpu.example.com", "pool": "elsewhere", "device": "gpu-0"},
        grouped(cpus="2"),
    ]
    configs = [
        {
            "source": "FromClass",
            "requests": [],
            "opaque": {"driver": "gpu.example.com", "parameters": {"x": 1}},
        },
        {
            "source": "FromClaim",
            "requests": ["cpus"],
            "opaque": {"driver": "dra.cpu", "parameters": {"policy": "spread"}},
        },
    ]
    allocation = read_claim(claim(results, configs=configs), uid=UID, pool=NODE)
    assert [d.device for d in allocation.devices] == ["cpudevnuma000"]
    assert allocation.configs == (
        OpaqueConfig(
            source="FromClaim", requests=("cpus",), parameters={"policy": "spread"}, index=1
        ),
    )


def test_claim_with_no_result_of_ours_gives_no_devices() -> None:
    results = [{"request": "gpu", "driver": "gpu.example.com", "pool": "p", "device": "gpu-0"}]
    assert read_claim(claim(results), uid=UID, pool=NODE).devices == ()


# --- read_claim: bad claims --------------------------------------------------------------------


def _without_status(obj: dict[str, Any]) -> dict[str, Any]:
    obj["status"] = {}
    return obj


def _set(path: tuple[str | int, ...], value: object) -> Any:
    def change(obj: dict[str, Any]) -> dict[str, Any]:
        node: Any = obj
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        return obj

    return change


_DELETE = object()
_RESULT0 = ("status", "allocation", "devices", "results", 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set(("metadata", "uid"), "other-uid"), "expected .* it was replaced"),
        (_without_status, "is not allocated"),
        (_set(("status", "allocation"), None), "is not allocated"),
        (_set(("metadata",), "x"), "has no metadata"),
        (_set((*_RESULT0, "consumedCapacity"), _DELETE), "has no consumedCapacity"),
        (_set((*_RESULT0, "consumedCapacity"), {"dra.cpu/memory": "1"}), "no 'dra.cpu/cpu'"),
        (_set((*_RESULT0, "consumedCapacity"), {"dra.cpu/cpu": "0"}), "not positive"),
        (_set((*_RESULT0, "consumedCapacity"), {"dra.cpu/cpu": "-1"}), "not positive"),
        (_set((*_RESULT0, "consumedCapacity"), {"dra.cpu/cpu": "1.5"}), "whole number"),
        (_set((*_RESULT0, "consumedCapacity"), {"dra.cpu/cpu": "500m"}), "whole number"),
        (_set((*_RESULT0, "consumedCapacity"), {"dra.cpu/cpu": "1e30"}), "out of range"),
        (_set((*_RESULT0, "consumedCapacity"), "4"), "is not an object"),
        (_set((*_RESULT0, "pool"), "node-b"), "allocated for another node"),
        (_set((*_RESULT0, "device"), ""), r"\.device: '' is not a non-empty string"),
        (_set((*_RESULT0, "request"), None), r"\.request: None"),
        (_set((*_RESULT0, "shareID"), 7), r"\.shareID: 7"),
        (_set(("status", "allocation", "devices", "results"), {}), "is not a list"),
        (_set(("status", "allocation", "devices", "results", 0), "x"), "is not an object"),
    ],
)
def test_bad_claims_are_refused_with_a_clear_error(change: Any, message: str) -> None:
    obj = change(claim([grouped()]))
    with pytest.raises(ClaimError, match=message) as info:
        read_claim(obj, uid=UID, pool=NODE)
    if "metadata" in obj and isinstance(obj["metadata"], dict):
        assert "default/pod-cpus" in str(info.value)


def test_error_names_the_bad_capacity_and_device() -> None:
    obj = claim([individual("cpudev000"), grouped("cpudevsocket001", cpus="2.5")])
    with pytest.raises(ClaimError) as info:
        read_claim(obj, uid=UID, pool=NODE)
    text = str(info.value)
    assert "results[1]" in text
    assert "'2.5'" in text
    assert "cpudevsocket001" in text


def test_machine_device_without_capacity_is_refused() -> None:
    result = grouped("cpudevmachine")
    del result["consumedCapacity"]
    with pytest.raises(ClaimError, match="DRAConsumableCapacity"):
        read_claim(claim([result]), uid=UID, pool=NODE)


def test_bad_opaque_config_requests_are_refused() -> None:
    configs = [{"source": "FromClaim", "requests": "cpus", "opaque": {"driver": "dra.cpu"}}]
    with pytest.raises(ClaimError, match=r"config\[0\]\.requests"):
        read_claim(claim([grouped()], configs=configs), uid=UID, pool=NODE)


POD_A = "5f0c9a3e-0000-4000-8000-00000000000a"
POD_B = "5f0c9a3e-0000-4000-8000-00000000000b"


def test_the_pods_the_claim_is_reserved_for_are_read_and_other_consumers_ignored() -> None:
    consumers = [
        {"resource": "pods", "name": "web-0", "uid": POD_A},
        {"apiGroup": "", "resource": "pods", "name": "web-1", "uid": POD_B},
        {"apiGroup": "example.com", "resource": "pods", "name": "x", "uid": "not-a-pod"},
        {"apiGroup": "apps", "resource": "deployments", "name": "web", "uid": "not-a-pod-2"},
    ]
    obj = claim([grouped()], reserved_for=consumers)
    assert SchemaValidator().errors(obj) == []  # what the API server stores
    allocation = read_claim(obj, uid=UID, pool=NODE)
    assert allocation.pod_uids == {POD_A, POD_B}
    assert allocation.pod_names == {"web-0", "web-1"}
    assert reserved_pods(obj) == {POD_A: "web-0", POD_B: "web-1"}
    assert read_claim(claim([grouped()]), uid=UID, pool=NODE).pod_uids == frozenset()


@pytest.mark.parametrize(
    ("reserved_for", "message"),
    [
        ({"resource": "pods"}, r"status\.reservedFor is not a list"),
        ([7], r"status\.reservedFor\[0\] is not an object"),
        ([{"resource": "pods", "name": "p"}], r"status\.reservedFor\[0\]\.uid: None is not"),
        (
            [{"resource": "pods", "name": "p", "uid": ""}],
            r"status\.reservedFor\[0\]\.uid: '' is not",
        ),
    ],
)
def test_a_malformed_reservation_is_an_error_naming_it(reserved_for: object, message: str) -> None:
    obj = claim([grouped()])
    obj["status"]["reservedFor"] = reserved_for
    with pytest.raises(ClaimError, match=f"claim default/pod-cpus: {message}"):
        read_claim(obj, uid=UID, pool=NODE)


def test_reading_does_not_modify_the_claim() -> None:
    obj = claim([grouped(), individual("cpudev001")])
    before = copy.deepcopy(obj)
    read_claim(obj, uid=UID, pool=NODE)
    assert obj == before


# --- status patch -------------------------------------------------------------------------------


def test_status_patch_records_the_cpuset_and_keeps_other_drivers_entries() -> None:
    gpu = {"request": "gpu", "driver": "gpu.example.com", "pool": "gpus", "device": "gpu-0"}
    obj = claim([gpu, grouped("cpudevnuma001", cpus="3")])
    gpu_status = {"driver": "gpu.example.com", "pool": "gpus", "device": "gpu-0", "data": {"a": 1}}
    obj["status"]["devices"] = [gpu_status]
    allocation = read_claim(obj, uid=UID, pool=NODE)

    patch = device_status_patch(obj, allocation, CpuSet.parse("8-9,40"))

    assert patch == {
        "metadata": {"resourceVersion": "42"},
        "status": {
            "devices": [
                gpu_status,
                {
                    "driver": "dra.cpu",
                    "pool": NODE,
                    "device": "cpudevnuma001",
                    "shareID": SHARE,
                    "data": {"cpuset": "8-9,40"},
                },
            ]
        },
    }
    patched = apply_merge_patch(obj, patch)
    assert claim_status_errors(patched) == []
    assert SchemaValidator(kinds=(("resource.k8s.io/v1", "ResourceClaim"),)).errors(patched) == []


def test_status_patch_updates_our_entries_in_place_keeping_conditions() -> None:
    obj = claim([individual("cpudev000"), individual("cpudev001")])
    condition = {
        "type": "Ready",
        "status": "True",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
        "reason": "Prepared",
        "message": "",
    }
    obj["status"]["devices"] = [
        {"driver": "dra.cpu", "pool": NODE, "device": "cpudev001", "conditions": [condition]},
        {"driver": "dra.cpu", "pool": NODE, "device": "cpudev000", "data": {"cpuset": "7"}},
    ]
    allocation = read_claim(obj, uid=UID, pool=NODE)
    patch = device_status_patch(obj, allocation, "0-1")
    assert patch is not None
    assert patch["status"]["devices"] == [
        {
            "driver": "dra.cpu",
            "pool": NODE,
            "device": "cpudev001",
            "conditions": [condition],
            "data": {"cpuset": "0-1"},
        },
        {"driver": "dra.cpu", "pool": NODE, "device": "cpudev000", "data": {"cpuset": "0-1"}},
    ]


def test_no_patch_without_devices_of_ours() -> None:
    results = [{"request": "gpu", "driver": "gpu.example.com", "pool": "p", "device": "gpu-0"}]
    obj = claim(results)
    assert device_status_patch(obj, read_claim(obj, uid=UID, pool=NODE), "0") is None


def test_too_long_cpuset_data_is_refused() -> None:
    obj = claim([grouped("cpudevmachine", cpus="8000")])
    allocation = read_claim(obj, uid=UID, pool=NODE)
    every_other = CpuSet.union(CpuSet.parse(str(cpu)) for cpu in range(0, 16000, 2))
    assert len(str(every_other)) > MAX_STATUS_DATA_BYTES
    with pytest.raises(ClaimError, match="too long"):
        device_status_patch(obj, allocation, every_other)


# --- grouped capacity end to end: published slice -> scheduler -> claim -> Prepare ---------------

TOPOLOGY = build_topology(FIXTURES["dual-socket-smt2"])
GROUP = "cpudevnuma002"  # 16 CPUs: 16-23,48-55


def published_device(*, policy: bool) -> dict[str, Any]:
    """Our wire device ``GROUP``; ``policy=False``: as the Go driver publishes it (no policy)."""
    devices = published_devices(
        TOPOLOGY, reserved=CpuSet(), mode=CpuDeviceMode.GROUPED, group_by=GroupBy.NUMANODE
    )
    (obj,) = build_resource_slices(NODE, devices, consumable_capacity=policy)
    (device,) = (d for d in obj["spec"]["devices"] if d["name"] == GROUP)
    assert isinstance(device, dict)
    return device


def prepare(
    result: dict[str, Any], *, state: NodeState | None = None, uid: str = UID
) -> tuple[NodeState, ClaimPrepared]:
    """read_claim, then the state machine's Prepare of a claim with this one result."""
    obj = claim([{**result, "pool": NODE}])
    obj["metadata"]["uid"] = uid
    allocation = read_claim(obj, uid=uid, pool=NODE)
    state = state or NodeState.initial(NodeConfig.build(NODE, TOPOLOGY))
    command = PrepareClaim(uid, "default", "pod-cpus", allocation.device_results())
    state, effects = apply(state, command)
    (reply,) = (e for e in effects if isinstance(e, Reply))
    assert isinstance(reply.value, ClaimPrepared), reply.value
    return state, reply.value


@pytest.mark.parametrize(
    ("requests", "ours", "upstream"),
    [
        # no capacity.requests: the whole group, with our default as without upstream's policy
        (None, 16, 16),
        ({CAPACITY_CPU: "4"}, 4, 4),
        # fractions: our whole-CPU policy rounds up at scheduling; upstream's slice lets the
        # fraction through and its Prepare (and ours) refuses it
        ({CAPACITY_CPU: "1500m"}, 2, "not a whole number"),
        ({CAPACITY_CPU: "500m"}, 1, "not a whole number"),
        ({CAPACITY_CPU: "15.2"}, 16, "not a whole number"),
        # the request names the capacity without its domain: the same capacity
        ({"cpu": "3"}, 3, 3),
    ],
)
def test_grouped_capacity_through_the_scheduler_and_prepare(
    requests: dict[str, str] | None, ours: int, upstream: int | str
) -> None:
    for policy, expected in ((True, ours), (False, upstream)):
        device = scheduler_model.stored_device(published_device(policy=policy), feature=True)
        result = scheduler_model.allocate(device, requests, feature=True)
        if isinstance(expected, str):
            with pytest.raises(ClaimError, match=expected):
                prepare(result)
            continue
        assert result["consumedCapacity"] == {CAPACITY_CPU: str(expected)}
        _, prepared = prepare(result)
        assert len(prepared.cpus) == expected
        assert prepared.cpus <= CpuSet.parse("16-23,48-55")


def test_more_than_the_group_is_not_allocated_at_all() -> None:
    device = scheduler_model.stored_device(published_device(policy=True), feature=True)
    with pytest.raises(scheduler_model.NotEligible):
        scheduler_model.allocate(device, {CAPACITY_CPU: "17"}, feature=True)
    whole = scheduler_model.allocate(device, None, feature=True)
    with pytest.raises(scheduler_model.NotEligible):  # the default took the whole group
        scheduler_model.allocate(
            device,
            {CAPACITY_CPU: "1"},
            feature=True,
            already={
                CAPACITY_CPU: scheduler_model.quantity(whole["consumedCapacity"][CAPACITY_CPU])
            },
        )


def test_two_claims_share_a_group_with_disjoint_cpus() -> None:
    device = scheduler_model.stored_device(published_device(policy=True), feature=True)
    first = scheduler_model.allocate(device, {CAPACITY_CPU: "6"}, feature=True)
    second = scheduler_model.allocate(
        device, {CAPACITY_CPU: "10"}, feature=True, already={CAPACITY_CPU: Fraction(6)}
    )
    state, a = prepare(first)
    _, b = prepare(second, state=state, uid="5f0e1d2c-3b4a-4968-8776-a5b4c3d2e1f0")
    assert (len(a.cpus), len(b.cpus)) == (6, 10)
    assert a.cpus | b.cpus == CpuSet.parse("16-23,48-55")


def test_without_consumable_capacity_on_the_server_prepare_fails_as_upstream() -> None:
    # The API server drops allowMultipleAllocations and requestPolicy; the scheduler hands the
    # device out whole and records no consumedCapacity. Upstream: "CPU capacity ... is missing".
    device = scheduler_model.stored_device(published_device(policy=True), feature=False)
    assert "allowMultipleAllocations" not in device
    result = scheduler_model.allocate(device, None, feature=False)
    assert "consumedCapacity" not in result
    with pytest.raises(ClaimError, match=r"has no consumedCapacity.*DRAConsumableCapacity"):
        prepare(result)


def test_consumed_capacity_under_its_short_name_is_read_too() -> None:
    # An unqualified capacity name is in the driver's own domain: "cpu" is "dra.cpu/cpu".
    short = grouped(device=GROUP, consumedCapacity={"cpu": "3"})
    assert read_claim(claim([short]), uid=UID, pool=NODE).devices[0].consumed_cpus == 3
    both = grouped(device=GROUP, consumedCapacity={CAPACITY_CPU: "3", "cpu": "3"})
    assert read_claim(claim([both]), uid=UID, pool=NODE).devices[0].consumed_cpus == 3
    differ = grouped(device=GROUP, consumedCapacity={CAPACITY_CPU: "3", "cpu": "4"})
    with pytest.raises(ClaimError, match="the same capacity but differ"):
        read_claim(claim([differ]), uid=UID, pool=NODE)


def test_individual_devices_ignore_an_unrelated_consumed_capacity() -> None:
    # Individual devices publish no capacity; a consumedCapacity without ours says nothing.
    result = {**individual("cpudev003"), "consumedCapacity": {"example.com/other": "1"}}
    (device,) = read_claim(claim([result]), uid=UID, pool=NODE).devices
    assert device.consumed_cpus is None
