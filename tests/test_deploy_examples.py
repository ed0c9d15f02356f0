"""The per-claim configuration examples in deploy/examples/ are valid Kubernetes objects, their
opaque parameters are what dracpu reads, and they give the CPUs they promise.

Each pod's claim is allocated here as the scheduler would (``structured`` allocator: the
DeviceClass's configs as ``FromClass`` entries naming the request, then the claim's as
``FromClaim``), read by dracpu's own claim reader and config parser, and prepared by the node
state machine on the ``dual-socket-smt2`` machine (siblings cpuN and cpuN+32).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dracpu import DRIVER_NAME
from dracpu.core.allocator import Strategy
from dracpu.core.claim_config import ClaimOverrides, claim_overrides, parse_parameters
from dracpu.core.claims import CAPACITY_CPU, read_claim
from dracpu.core.commands import ClaimEnv, Container, CreateContainer, PrepareClaim
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import GroupBy
from dracpu.core.effects import ClaimPrepared, ContainerPinned, Effect, Reply, WriteCdiSpec
from dracpu.core.node_config import NodeConfig
from dracpu.core.quantity import parse_positive_whole
from dracpu.core.state import NodeState, apply
from dracpu.sim.fake_apiserver import build_resource_claim
from dracpu.sim.topologies import FIXTURES, build_topology

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "deploy" / "examples"
BASE_CLASS = ROOT / "deploy" / "kustomize" / "base" / "deviceclass.yaml"
K8S_VERSION = kubernetes_validate.latest_version()
NODE = "node-a"
TOPOLOGY = build_topology(FIXTURES["dual-socket-smt2"])


def _docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


FILES = sorted(EXAMPLES.glob("*.yaml"))
CLASSES = {
    doc["metadata"]["name"]: doc
    for path in [BASE_CLASS, *FILES]
    for doc in _docs(path)
    if doc["kind"] == "DeviceClass"
}


def test_there_are_examples_and_the_docs_name_each() -> None:
    names = {path.name for path in FILES}
    assert {
        "packed.yaml",
        "spread.yaml",
        "full-cores.yaml",
        "memory-pin.yaml",
        "machine-cpuset.yaml",
    } <= names
    page = (ROOT / "docs" / "claim-config.md").read_text()
    for name in names:
        assert f"deploy/examples/{name}" in page


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_examples_validate_strictly(path: Path) -> None:
    for doc in _docs(path):
        # strict=True rejects unknown fields; a missing schema is an error.
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _opaque_parameters(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "Pod":
        return []
    spec = doc["spec"]
    if doc["kind"] == "ResourceClaimTemplate":
        spec = spec["spec"]
    configs = (
        spec.get("config", [])
        if doc["kind"] == "DeviceClass"
        else spec["devices"].get("config", [])
    )
    return [c["opaque"]["parameters"] for c in configs if c["opaque"]["driver"] == DRIVER_NAME]


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_opaque_config_parses(path: Path) -> None:
    found = [p for doc in _docs(path) for p in _opaque_parameters(doc)]
    assert found, f"{path.name} has no opaque config of {DRIVER_NAME}"
    for parameters in found:
        parse_parameters(parameters, path.name)


def _allocated(path: Path) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The example's pod, its claim as the scheduler allocates it, and the claim's UID."""
    docs = _docs(path)
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    (ref,) = pod["spec"]["resourceClaims"]
    (claim_doc,) = [
        d
        for d in docs
        if d["kind"] in ("ResourceClaimTemplate", "ResourceClaim")
        and d["metadata"]["name"]
        in (ref.get("resourceClaimTemplateName"), ref.get("resourceClaimName"))
    ]
    spec = claim_doc["spec"]
    if claim_doc["kind"] == "ResourceClaimTemplate":
        spec = spec["spec"]
    (request,) = spec["devices"]["requests"]
    exactly = request["exactly"]
    cpus = exactly["capacity"]["requests"][CAPACITY_CPU]
    # The container asks the node for as many CPUs as the claim holds.
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["claims"] == [{"name": ref["name"]}]
    assert container["resources"]["requests"]["cpu"] == cpus
    wants_cpuset = any(
        "cpuset" in (p.get("cpuConfig") or {}) for p in _opaque_parameters(claim_doc)
    )
    device = "cpudevmachine" if wants_cpuset else "cpudevnuma001"
    result = {
        "request": request["name"],
        "driver": DRIVER_NAME,
        "pool": NODE,
        "device": device,
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": {CAPACITY_CPU: cpus},
    }
    device_class = CLASSES[exactly["deviceClassName"]]
    configs = [
        {"source": "FromClass", "requests": [request["name"]], "opaque": c["opaque"]}
        for c in device_class["spec"].get("config", [])
    ] + [{"source": "FromClaim", **c} for c in spec["devices"].get("config", [])]
    uid = str(uuid.uuid4())
    claim = build_resource_claim("default", "example", [result], uid=uid, configs=configs)
    return pod, claim, uid


def _prepare(path: Path) -> tuple[ClaimOverrides, CpuSet, CpuSet | None]:
    overrides, _, effects = _prepared(path)
    reply = effects[-1]
    assert isinstance(reply, Reply)
    assert isinstance(reply.value, ClaimPrepared), reply.value
    return overrides, reply.value.cpus, reply.value.mems


def _prepared(path: Path) -> tuple[ClaimOverrides, NodeState, list[Effect]]:
    """The example's claim prepared by the state machine: its overrides, the new state, the
    effects."""
    _, claim, uid = _allocated(path)
    overrides = claim_overrides(read_claim(claim, uid=uid, pool=NODE))
    group_by = GroupBy.MACHINE if overrides.results[0].cpuset is not None else GroupBy.NUMANODE
    node = NodeConfig.build(NODE, TOPOLOGY, group_by=group_by)
    command = PrepareClaim(
        uid,
        "default",
        "example",
        overrides.results,
        overrides.pin_memory,
        shared_pool=overrides.shared_pool,
    )
    state, effects = apply(NodeState.initial(node), command)
    return overrides, state, effects


def _cores(cpus: CpuSet) -> int:
    return len(TOPOLOGY.cores_of(cpus))


def test_packed_takes_whole_cores() -> None:
    overrides, cpus, mems = _prepare(EXAMPLES / "packed.yaml")
    assert overrides.results[0].strategy is Strategy.PACKED
    assert (len(cpus), _cores(cpus), mems) == (4, 2, None)


def test_spread_takes_one_thread_of_four_cores() -> None:
    overrides, cpus, _ = _prepare(EXAMPLES / "spread.yaml")
    assert overrides.results[0].strategy is Strategy.SPREAD
    assert (len(cpus), _cores(cpus)) == (4, 4)


def test_full_cores_takes_whole_cores_only() -> None:
    overrides, cpus, _ = _prepare(EXAMPLES / "full-cores.yaml")
    assert overrides.results[0].full_cores is True
    assert len(cpus) == 4
    assert all(core <= cpus for core in TOPOLOGY.cores_of(cpus))


def test_memory_pin_pins_to_the_numa_node_of_the_cpus() -> None:
    overrides, cpus, mems = _prepare(EXAMPLES / "memory-pin.yaml")
    assert overrides.pin_memory is True
    assert mems == CpuSet({TOPOLOGY.cpus[cpu].numa_node for cpu in cpus}) == CpuSet([1])


def test_the_classs_defaults_reach_its_claims() -> None:
    overrides, _, mems = _prepare(EXAMPLES / "deviceclass-whole-cores.yaml")
    assert (overrides.results[0].full_cores, overrides.pin_memory) == (True, True)
    assert mems == CpuSet([1])


def test_the_machine_mode_cpuset_is_what_the_claim_gets() -> None:
    pod, claim, _ = _allocated(EXAMPLES / "machine-cpuset.yaml")
    overrides, cpus, _ = _prepare(EXAMPLES / "machine-cpuset.yaml")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    size = parse_positive_whole(result["consumedCapacity"][CAPACITY_CPU], maximum=64, unit="CPUs")
    assert cpus == overrides.results[0].cpuset == CpuSet.parse("4-7")
    assert len(cpus) == size
    assert pod["spec"]["resourceClaims"][0]["resourceClaimName"] == "cpus-4-7"


def test_shared_pool_gives_the_claims_cpus_and_the_pool() -> None:
    overrides, state, effects = _prepared(EXAMPLES / "shared-pool.yaml")
    assert overrides.shared_pool is True
    ((uid, claim),) = state.claims.items()
    assert claim.shared_pool
    assert len(claim.cpus) == 2
    spec = effects[0]
    assert spec == WriteCdiSpec(uid, claim.cpus, shared_pool=True)
    # its container: the claim's CPUs plus the shared pool (every other CPU of the node)
    env = (ClaimEnv(uid, claim.cpus),)
    _, effects = apply(state, CreateContainer(Container("c", "pod", name="app", claims=env)))
    reply = effects[-1]
    assert isinstance(reply, Reply)
    assert isinstance(reply.value, ContainerPinned)
    assert reply.value.pin.cpus == TOPOLOGY.online
    # the pod asks the node for the claim's CPUs, and its CPU limit leaves room for the pool
    pod, _, _ = _allocated(EXAMPLES / "shared-pool.yaml")
    (container,) = pod["spec"]["containers"]
    assert int(container["resources"]["limits"]["cpu"]) > len(claim.cpus)
