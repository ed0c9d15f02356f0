"""Per-claim opaque configuration (dracpu.core.claim_config): the parameters' schema, which
configs apply to which result, their precedence, and the rules across fields and results."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dracpu.core.allocator import Strategy
from dracpu.core.claim_config import (
    ClaimOverrides,
    CpuConfig,
    Memory,
    claim_overrides,
    parse_parameters,
)
from dracpu.core.claims import ClaimAllocation, read_claim
from dracpu.core.commands import DeviceResult, PrepareClaim
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import GroupBy
from dracpu.core.effects import ClaimPrepared, Reply
from dracpu.core.node_config import NodeConfig
from dracpu.core.state import NodeState, apply
from dracpu.errors import ClaimError
from dracpu.sim.fake_apiserver import build_resource_claim
from dracpu.sim.topologies import FIXTURES, build_topology

UID = "0b6f2c1e-8a51-4b8e-9d43-5b0e7f3c2a10"
NODE = "node-a"
WHERE = "claim ns/c: opaque config [0]"


def params(**cpu: object) -> dict[str, Any]:
    return {"apiVersion": "v1alpha1", "cpuConfig": cpu}


def result(request: str = "cpus", device: str = "cpudevnuma000", cpus: int = 4) -> dict[str, Any]:
    return {
        "request": request,
        "driver": "dra.cpu",
        "pool": NODE,
        "device": device,
        "shareID": "7d2a0b64-2f57-4c1e-a3d2-0c1b9f1e6e55",
        "consumedCapacity": {"dra.cpu/cpu": str(cpus)},
    }


def config(
    parameters: object,
    source: str = "FromClaim",
    requests: tuple[str, ...] = (),
    driver: str = "dra.cpu",
) -> dict[str, Any]:
    return {
        "source": source,
        "requests": list(requests),
        "opaque": {"driver": driver, "parameters": parameters},
    }


def allocation(results: list[dict[str, Any]], configs: list[dict[str, Any]]) -> ClaimAllocation:
    obj = build_resource_claim("ns", "c", results, uid=UID, configs=configs)
    return read_claim(obj, uid=UID, pool=NODE)


def overrides(results: list[dict[str, Any]], configs: list[dict[str, Any]]) -> ClaimOverrides:
    return claim_overrides(allocation(results, configs))


def error(results: list[dict[str, Any]], configs: list[dict[str, Any]]) -> str:
    with pytest.raises(ClaimError) as info:
        overrides(results, configs)
    return str(info.value)


# --- the parameters --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpu", "expected"),
    [
        ({}, CpuConfig()),
        ({"cpuset": "2-5"}, CpuConfig(cpuset=CpuSet.parse("2-5"))),
        ({"cpuset": "0,4-6"}, CpuConfig(cpuset=CpuSet.parse("0,4-6"))),
        ({"policy": "packed"}, CpuConfig(policy=Strategy.PACKED)),
        ({"policy": "spread"}, CpuConfig(policy=Strategy.SPREAD)),
        ({"fullCores": True}, CpuConfig(full_cores=True)),
        ({"fullCores": False}, CpuConfig(full_cores=False)),
        ({"memory": "pin"}, CpuConfig(memory=Memory.PIN)),
        ({"memory": "none"}, CpuConfig(memory=Memory.NONE)),
        ({"sharedPool": True}, CpuConfig(shared_pool=True)),
        ({"sharedPool": False}, CpuConfig(shared_pool=False)),
        (
            {
                "cpuset": "8",
                "policy": "spread",
                "fullCores": False,
                "memory": "pin",
                "sharedPool": True,
            },
            CpuConfig(CpuSet([8]), Strategy.SPREAD, False, Memory.PIN, True),
        ),
        # null is the same as leaving the field out
        (
            {"cpuset": None, "policy": None, "fullCores": None, "memory": None, "sharedPool": None},
            CpuConfig(),
        ),
    ],
)
def test_every_field_is_read(cpu: dict[str, object], expected: CpuConfig) -> None:
    assert parse_parameters(params(**cpu), WHERE) == expected


def test_upstreams_document_is_ours_too() -> None:
    # kubernetes-sigs/dra-driver-cpu docs/user/opaque-cpuset-overrides.md and its test table.
    document = json.loads('{"apiVersion": "v1alpha1", "cpuConfig": {"cpuset": "2-5"}}')
    assert parse_parameters(document, WHERE) == CpuConfig(cpuset=CpuSet([2, 3, 4, 5]))


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        # the whole document
        (None, "the parameters null are not a JSON object"),
        ([1], "the parameters [1] are not a JSON object"),
        ("v1alpha1", "the parameters 'v1alpha1' are not a JSON object"),
        # apiVersion (upstream: "unsupported opaque config apiVersion")
        ({"cpuConfig": {}}, "apiVersion: missing (must be 'v1alpha1')"),
        (
            {"apiVersion": "v1beta1", "cpuConfig": {}},
            "apiVersion: 'v1beta1' is not supported (must be 'v1alpha1')",
        ),
        (
            {"apiVersion": 1, "cpuConfig": {}},
            "apiVersion: 1 is not supported (must be 'v1alpha1')",
        ),
        # cpuConfig
        ({"apiVersion": "v1alpha1"}, "cpuConfig: missing"),
        ({"apiVersion": "v1alpha1", "cpuConfig": None}, "cpuConfig: missing"),
        ({"apiVersion": "v1alpha1", "cpuConfig": "0-3"}, "cpuConfig: '0-3' is not an object"),
        # fields that are not in the schema
        (
            {"apiVersion": "v1alpha1", "kind": "CpuConfig", "cpuConfig": {}},
            "kind: unknown field (known: apiVersion, cpuConfig)",
        ),
        (
            {"apiVersion": "v1alpha1", "policy": "spread", "cpuConfig": {}},
            "policy: unknown field; it belongs inside cpuConfig",
        ),
        (
            {"apiVersion": "v1alpha1", "CPUConfig": {}},
            "CPUConfig: unknown field; did you mean 'cpuConfig'? (field names are case-sensitive)",
        ),
        (params(polcy="spread"), "cpuConfig.polcy: unknown field (known: cpuset, policy, "),
        (params(kind="x"), "cpuConfig.kind: unknown field (known: cpuset, policy, fullCores, "),
        (params(fullcores=True), "cpuConfig.fullcores: unknown field; did you mean 'fullCores'?"),
        (params(CPUSet="0-3"), "cpuConfig.CPUSet: unknown field; did you mean 'cpuset'?"),
        # cpuset (upstream: "cpuConfig.cpuset is empty or missing", "failed to parse cpuset")
        (params(cpuset=""), "cpuConfig.cpuset: empty; leave the field out"),
        (params(cpuset=" "), "cpuConfig.cpuset: empty; leave the field out"),
        (params(cpuset="abc"), "cpuConfig.cpuset: invalid cpuset 'abc'"),
        (params(cpuset="5-3"), "cpuConfig.cpuset: invalid cpuset '5-3'"),
        (params(cpuset="0- 3"), "cpuConfig.cpuset: invalid cpuset"),
        (params(cpuset="99999"), "cpuConfig.cpuset: invalid cpuset"),
        (params(cpuset=3), "cpuConfig.cpuset: 3 is not a string (e.g. '0-3,8')"),
        (params(cpuset=[0, 1]), "cpuConfig.cpuset: [0, 1] is not a string"),
        # policy
        (params(policy="dense"), "cpuConfig.policy: 'dense' is not one of packed, spread"),
        (params(policy="Packed"), "cpuConfig.policy: 'Packed' is not one of packed, spread"),
        (params(policy=""), "cpuConfig.policy: '' is not one of packed, spread"),
        (params(policy=1), "cpuConfig.policy: 1 is not one of packed, spread"),
        # fullCores
        (params(fullCores="true"), "cpuConfig.fullCores: 'true' is not a boolean (true or false)"),
        (params(fullCores=1), "cpuConfig.fullCores: 1 is not a boolean"),
        # memory
        (params(memory="bind"), "cpuConfig.memory: 'bind' is not one of pin, none"),
        (params(memory=True), "cpuConfig.memory: true is not one of pin, none"),
        # sharedPool
        (params(sharedPool="yes"), "cpuConfig.sharedPool: 'yes' is not a boolean (true or false)"),
        (params(sharedPool=0), "cpuConfig.sharedPool: 0 is not a boolean"),
        (
            params(sharedpool=True),
            "cpuConfig.sharedpool: unknown field; did you mean 'sharedPool'?",
        ),
    ],
)
def test_bad_parameters_are_named(parameters: object, message: str) -> None:
    with pytest.raises(ClaimError) as info:
        parse_parameters(parameters, WHERE)
    text = str(info.value)
    assert text.startswith(WHERE)
    assert message in text


def test_a_long_bad_value_is_shortened() -> None:
    with pytest.raises(ClaimError) as info:
        parse_parameters(params(policy="x" * 5000), WHERE)
    assert len(str(info.value)) < 200


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


@given(
    st.dictionaries(
        st.sampled_from(["apiVersion", "cpuConfig", "kind", "policy"]),
        st.just("v1alpha1") | st.dictionaries(st.sampled_from(["cpuset", "policy", "x"]), _JSON),
    )
    | _JSON
)
def test_any_json_is_read_or_refused_by_name(parameters: object) -> None:
    outcome: object
    try:
        outcome = parse_parameters(parameters, WHERE)
    except ClaimError as exc:  # any other exception fails the test
        outcome = exc
    assert isinstance(outcome, CpuConfig) or str(outcome).startswith(WHERE)


_CPU_CONFIG = st.fixed_dictionaries(
    {},
    optional={
        "cpuset": st.sets(st.integers(0, 127), min_size=1).map(lambda s: str(CpuSet(s))),
        "policy": st.sampled_from(["packed", "spread"]),
        "fullCores": st.booleans(),
        "memory": st.sampled_from(["pin", "none"]),
        "sharedPool": st.booleans(),
    },
)


@given(_CPU_CONFIG)
def test_valid_documents_survive_a_json_round_trip(cpu: dict[str, object]) -> None:
    parsed = parse_parameters(json.loads(json.dumps(params(**cpu))), WHERE)
    assert (None if parsed.cpuset is None else str(parsed.cpuset)) == cpu.get("cpuset")
    assert (None if parsed.policy is None else str(parsed.policy)) == cpu.get("policy")
    assert parsed.full_cores == cpu.get("fullCores")
    assert (None if parsed.memory is None else str(parsed.memory)) == cpu.get("memory")
    assert parsed.shared_pool == cpu.get("sharedPool")


# --- which configs apply, and in which order -----------------------------------------------------


def test_no_config_leaves_the_results_as_they_are() -> None:
    claim = allocation([result()], [])
    assert claim_overrides(claim) == ClaimOverrides(claim.device_results(), None)


def test_configs_apply_to_all_their_requests_or_to_the_named_ones() -> None:
    results = [
        result("a", "cpudevnuma000"),
        result("b/small", "cpudevnuma001"),
        result("b/large", "cpudevnuma002"),
        result("c", "cpudevnuma003"),
    ]
    configs = [
        config(params(fullCores=False)),  # no requests: every result
        config(params(policy="spread"), requests=("a",)),
        config(params(policy="packed"), requests=("b",)),  # main request: both subrequests
        config(params(fullCores=True), requests=("b/large",)),  # one subrequest
        config(params(policy="spread"), requests=("b/other", "z")),  # none of ours
    ]
    got = overrides(results, configs)
    assert [(r.request, r.strategy, r.full_cores) for r in got.results] == [
        ("a", Strategy.SPREAD, False),
        ("b", Strategy.PACKED, False),
        ("b", Strategy.PACKED, True),
        ("c", None, False),
    ]
    assert got.pin_memory is None


def test_class_configs_come_first_and_later_ones_override_field_by_field() -> None:
    configs = [
        config(params(policy="packed", memory="none"), source="FromClaim"),
        config(params(policy="spread", fullCores=False, memory="pin"), source="FromClass"),
        config(params(memory="pin"), source="FromClaim"),
        config(params(fullCores=None), source="FromClaim"),  # null overrides nothing
    ]
    (got,) = overrides([result()], configs).results
    # class: spread, fullCores false, pin; claim 1: packed, none; claim 2: pin.
    assert (got.strategy, got.full_cores) == (Strategy.PACKED, False)
    assert overrides([result()], configs).pin_memory is True


def test_other_drivers_configs_are_not_read() -> None:
    configs = [config({"any": "thing"}, driver="gpu.example.com"), config(params(memory="pin"))]
    assert overrides([result()], configs).pin_memory is True


def test_a_config_that_applies_to_none_of_our_results_is_not_read() -> None:
    configs = [config("not even an object", requests=("gpu",)), config(params(policy="spread"))]
    results = [result(), {**result("gpu"), "driver": "gpu.example.com", "pool": "p"}]
    (got,) = overrides(results, configs).results
    assert got.strategy is Strategy.SPREAD


def test_a_claim_without_results_of_ours_reads_no_config() -> None:
    results = [{**result("gpu"), "driver": "gpu.example.com", "pool": "p"}]
    assert overrides(results, [config("bad")]) == ClaimOverrides((), None)


def test_an_explicit_cpuset_reaches_its_result() -> None:
    results = [result("a", cpus=2), result("b", "cpudevnuma001", cpus=2)]
    configs = [config(params(cpuset="8,40"), requests=("b",))]
    got = overrides(results, configs).results
    assert [r.cpuset for r in got] == [None, CpuSet([8, 40])]
    assert got[1] == DeviceResult("b", NODE, "cpudevnuma001", 2, CpuSet([8, 40]))


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["FromClass", "FromClaim"]),
            st.sampled_from([(), ("cpus",), ("other",)]),
            _CPU_CONFIG.map(lambda c: {k: v for k, v in c.items() if k != "cpuset"}),
        ),
        max_size=6,
    )
)
def test_precedence_matches_a_plain_model(entries: list[tuple[str, tuple[str, ...], Any]]) -> None:
    configs = [config(params(**cpu), source, requests) for source, requests, cpu in entries]
    # The model: walk the class entries, then the claim's; the last that applies and sets a
    # field decides it.
    expected: dict[str, object] = {}
    for wanted in ("FromClass", "FromClaim"):
        for source, requests, cpu in entries:
            if source == wanted and (not requests or "cpus" in requests):
                expected.update(cpu)
    if expected.get("fullCores") and expected.get("policy") == "spread":
        assert "cannot be combined" in error([result()], configs)
        return
    got = overrides([result()], configs)
    (one,) = got.results
    assert one.strategy == expected.get("policy")
    assert one.full_cores == expected.get("fullCores")
    assert got.pin_memory == (None if "memory" not in expected else expected["memory"] == "pin")


# --- rules across fields and results -----------------------------------------------------------


def test_a_class_cannot_give_a_cpuset() -> None:
    message = error([result()], [config(params(cpuset="0-3"), source="FromClass")])
    assert message.startswith(
        "claim ns/c: opaque config [0] (from the DeviceClass) cpuConfig.cpuset: a cpuset must "
        "come from the claim (FromClaim)"
    )


def test_a_bad_class_config_is_named_as_the_classs() -> None:
    message = error([result()], [config(params(policy="x"), source="FromClass")])
    assert message == (
        "claim ns/c: opaque config [0] (from the DeviceClass) cpuConfig.policy: 'x' is not one "
        "of packed, spread"
    )


def test_the_index_is_the_entrys_place_in_the_allocation() -> None:
    configs = [
        config({}, driver="gpu.example.com"),
        config(params(policy="spread")),
        config(params(memory="always")),
    ]
    assert error([result()], configs) == (
        "claim ns/c: opaque config [2] cpuConfig.memory: 'always' is not one of pin, none"
    )


def test_full_cores_with_spread_is_refused_but_not_with_packed() -> None:
    assert error([result()], [config(params(policy="spread", fullCores=True))]) == (
        "claim ns/c request 'cpus': cpuConfig.fullCores true takes whole cores packed; it "
        "cannot be combined with cpuConfig.policy 'spread'"
    )
    (got,) = overrides([result()], [config(params(policy="packed", fullCores=True))]).results
    assert (got.strategy, got.full_cores) == (Strategy.PACKED, True)
    (got,) = overrides([result()], [config(params(policy="spread", fullCores=False))]).results
    assert (got.strategy, got.full_cores) == (Strategy.SPREAD, False)


def test_memory_is_one_setting_per_claim() -> None:
    results = [result("a"), result("b", "cpudevnuma001"), result("c", "cpudevnuma002")]
    pin_a = config(params(memory="pin"), requests=("a",))
    assert overrides(results, [pin_a]).pin_memory is True  # b and c follow a
    none_b = config(params(memory="none"), requests=("b",))
    assert error(results, [pin_a, none_b]) == (
        "claim ns/c: cpuConfig.memory is 'pin' for request 'a' but 'none' for request 'b'; "
        "memory pinning is one setting for the whole claim"
    )


def test_shared_pool_is_one_setting_per_claim() -> None:
    results = [result("a"), result("b", "cpudevnuma001")]
    assert overrides(results, []).shared_pool is False
    shared_a = config(params(sharedPool=True), requests=("a",))
    assert overrides(results, [shared_a]).shared_pool is True  # b follows a
    from_class = config(params(sharedPool=True), source="FromClass")
    assert overrides(results, [from_class]).shared_pool is True  # a class may give it
    alone_b = config(params(sharedPool=False), requests=("b",))
    assert error(results, [shared_a, alone_b]) == (
        "claim ns/c: cpuConfig.sharedPool is true for request 'a' but false for request 'b'; "
        "it is one setting for the whole claim (its containers get one cpuset)"
    )
    # the claim's own config wins over its class's, field by field
    assert overrides(results, [from_class, config(params(sharedPool=False))]).shared_pool is False


# --- through the state machine -------------------------------------------------------------------


def test_a_machine_mode_cpuset_is_what_the_claim_gets() -> None:
    topology = build_topology(FIXTURES["dual-socket-smt2"])
    node = NodeConfig.build(NODE, topology, group_by=GroupBy.MACHINE)
    claim = allocation([result(device="cpudevmachine", cpus=3)], [config(params(cpuset="5,37,60"))])
    got = claim_overrides(claim)
    command = PrepareClaim(UID, "ns", "c", got.results, got.pin_memory)
    _, effects = apply(NodeState.initial(node), command)
    reply = effects[-1]
    assert isinstance(reply, Reply)
    assert isinstance(reply.value, ClaimPrepared)
    assert reply.value.cpus == CpuSet([5, 37, 60])


# --- the node's allocator (upstream 0.3's allocator key) ---------------------------------------


def _prepare(
    node: NodeConfig, claim: ClaimAllocation, allocator: str | None, state: NodeState | None = None
) -> Any:
    """The value the owner replies with: ClaimPrepared, or the error raised."""
    got = claim_overrides(claim, allocator)
    command = PrepareClaim(UID, "ns", "c", got.results, got.pin_memory)
    try:
        _, effects = apply(state or NodeState.initial(node), command)
    except ClaimError as exc:
        return exc
    reply = effects[-1]
    assert isinstance(reply, Reply)
    return reply.value


def _numa_node() -> NodeConfig:
    # dual-socket-smt2: NUMA node 0 holds cpus 0-7,32-39; node 1 8-15,40-47.
    return NodeConfig.build(NODE, build_topology(FIXTURES["dual-socket-smt2"]))


def test_external_splits_the_request_cpuset_over_its_results_lowest_first() -> None:
    # A count-2 request: two results of 3 CPUs, one per NUMA node; the cpuset names all six.
    two = [
        result(device="cpudevnuma000", cpus=3),
        result(device="cpudevnuma001", cpus=3),
    ]
    claim = allocation(two, [config(params(cpuset="2,4,33,9,12,42"), requests=("cpus",))])
    got = claim_overrides(claim, "external")
    assert [r.request_cpuset for r in got.results] == [CpuSet.parse("2,4,9,12,33,42")] * 2
    value = _prepare(_numa_node(), claim, "external")
    assert isinstance(value, ClaimPrepared)
    assert value.cpus == CpuSet.parse("2,4,9,12,33,42")
    # Two results on one device: the first takes the lowest of the cpuset, the second the rest.
    same = [result(device="cpudevnuma000", cpus=2), result(device="cpudevnuma000", cpus=2)]
    claim = allocation(same, [config(params(cpuset="3,1,33,5"))])
    value = _prepare(_numa_node(), claim, "external")
    assert isinstance(value, ClaimPrepared)
    assert value.cpus == CpuSet.parse("1,3,5,33")


@pytest.mark.parametrize(
    ("configs", "message"),
    [
        ([], "is targeted by 0 opaque configs of driver dra.cpu; with allocator external it must"),
        (
            [config(params(cpuset="0-3")), config(params(policy="spread"))],
            "is targeted by 2 opaque configs",
        ),
        ([config(params(policy="spread"))], "has no cpuConfig.cpuset; with allocator external"),
        ([config(params(cpuset="0-2"))], "opaque cpuset 0-2 has 3 CPUs, which does not match the "),
        (
            [config(params(cpuset="0-3"), source="FromClass")],
            "comes from the DeviceClass; with allocator external the cpuset must be defined per",
        ),
    ],
)
def test_external_refuses_a_request_without_exactly_one_claim_cpuset(
    configs: list[dict[str, Any]], message: str
) -> None:
    claim = allocation([result(cpus=4)], configs)
    with pytest.raises(ClaimError) as info:
        claim_overrides(claim, "external")
    assert "claim ns/c request 'cpus'" in str(info.value)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("cpuset", "message"),
    [
        # cpus of the other NUMA node cannot serve a result on node 0
        ("8-11", "cannot satisfy request: need 4 CPUs from cpuset 8-11 restricted to the"),
        ("0-1,64-65", "cpus 64-65 are offline or not on this machine"),
    ],
)
def test_external_refuses_a_cpuset_the_device_cannot_give(cpuset: str, message: str) -> None:
    claim = allocation([result(cpus=4)], [config(params(cpuset=cpuset))])
    value = _prepare(_numa_node(), claim, "external")
    assert isinstance(value, ClaimError)
    assert message in str(value)


def test_cpumanager_refuses_a_cpuset_but_takes_our_other_fields() -> None:
    claim = allocation([result(cpus=4)], [config(params(cpuset="0-3"))])
    with pytest.raises(ClaimError) as info:
        claim_overrides(claim, "cpumanager")
    assert "cpuConfig.cpuset 0-3 is not taken with allocator cpumanager" in str(info.value)
    claim = allocation([result(cpus=4)], [config(params(fullCores=True))])
    value = _prepare(_numa_node(), claim, "cpumanager")
    assert isinstance(value, ClaimPrepared)
    assert len(value.cpus) == 4
    # without the key, the cpuset is honoured (dracpu's own mode)
    claim = allocation([result(cpus=4)], [config(params(cpuset="0-3"))])
    value = _prepare(_numa_node(), claim, None)
    assert isinstance(value, ClaimPrepared)
    assert value.cpus == CpuSet.parse("0-3")


def test_machine_mode_takes_one_device_per_request() -> None:
    topology = build_topology(FIXTURES["dual-socket-smt2"])
    node = NodeConfig.build(NODE, topology, group_by=GroupBy.MACHINE)
    two = [result(device="cpudevmachine", cpus=2), result(device="cpudevmachine", cpus=2)]
    claim = allocation(two, [config(params(cpuset="4-7"))])
    value = _prepare(node, claim, "external")
    assert isinstance(value, ClaimError)
    assert "request 'cpus' has 2 devices; with groupBy machine every request must have count 1" in (
        str(value)
    )
    one = allocation([result(device="cpudevmachine", cpus=4)], [config(params(cpuset="4-7"))])
    value = _prepare(node, one, "external")
    assert isinstance(value, ClaimPrepared)
    assert value.cpus == CpuSet.parse("4-7")
