"""The device metadata builder (KEP-5304): documents of every fixture machine in every device
mode, checked against the published slices, against an independent reading of the machine's
sysfs (``upstream_driver``), and against the v1beta1 rules, re-implemented here from
k8s.io/dynamic-resource-allocation ``api/metadata/v1beta1`` (``zz_generated.validations.go``:
driver, pool, name required, at most 32 attributes, one value each) and resource/v1
``DeviceAttribute``; plus names, paths, the CDI spec and the Prepare answer's ids."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest

from dracpu.adapters.sysfs import read_topology
from dracpu.config import Config
from dracpu.core.cdi_spec import minimum_required_version, validate_spec
from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.core.commands import DeviceResult, PrepareClaim
from dracpu.core.cpuset import CpuSet
from dracpu.core.device_metadata import (
    METADATA_API_VERSION,
    METADATA_DIR_NAME,
    check_names,
    claim_files,
    container_path,
    document,
    metadata_device_id,
    metadata_file_name,
    metadata_file_owner,
    metadata_ids_by_device,
    metadata_spec_file_name,
    metadata_spec_owner,
    result_cpus,
)
from dracpu.core.devices import CpuDeviceMode, GroupBy
from dracpu.core.effects import Reply
from dracpu.core.node_config import NodeConfig
from dracpu.core.slices import SliceOptions, build_resource_slices
from dracpu.core.state import NodeState, apply
from dracpu.core.topology import Topology
from dracpu.errors import ClaimError
from dracpu.sim.topologies import FIXTURES, build_topology
from tests.core import upstream_driver
from tests.fixtures import SysfsTrees

__all__: list[str] = []

NODE = "node-a"
UID = "0b5a1a2e-9f4c-4c1e-8d3a-00000000000a"
METADATA_DIR = "/var/lib/kubelet/plugins/dra.cpu/dra-device-metadata"
MODES = [
    (CpuDeviceMode.INDIVIDUAL, GroupBy.NUMANODE),
    (CpuDeviceMode.GROUPED, GroupBy.NUMANODE),
    (CpuDeviceMode.GROUPED, GroupBy.SOCKET),
    (CpuDeviceMode.GROUPED, GroupBy.MACHINE),
]
# The per-CPU lists and the model's field each one must equal, position by position.
PER_CPU = {
    "dra.cpu/allocatedCPUIDs": ("ints", "cpu"),
    "dra.cpu/allocatedCoreIDs": ("ints", "core"),
    "dra.cpu/allocatedSocketIDs": ("ints", "socket"),
    "dra.cpu/allocatedNUMANodeIDs": ("ints", "numa"),
    "dra.cpu/allocatedCacheL3IDs": ("ints", "l3"),
    "dra.cpu/allocatedCoreTypes": ("strings", "core_type"),
}


# --- an independent check of the v1beta1 document ------------------------------------------------

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL.pattern}(\.{_DNS_LABEL.pattern})*")
_QUALIFIED = re.compile(rf"({_DNS_SUBDOMAIN.pattern}/)?[A-Za-z_][A-Za-z0-9_]{{0,31}}")
_SCALARS = {"int": int, "bool": bool, "string": str, "version": str}
_LISTS = {"ints": int, "bools": bool, "strings": str, "versions": str}


def _type_ok(value: object, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def v1beta1_errors(doc: Any) -> list[str]:
    """What a strict reader of ``metadata.resource.k8s.io/v1beta1`` would refuse."""
    errors: list[str] = []

    def keys(obj: Any, allowed: set[str], where: str) -> None:
        if not isinstance(obj, dict):
            errors.append(f"{where} is not an object")
            return
        errors.extend(f"{where}: unknown field {k}" for k in set(obj) - allowed)

    keys(doc, {"kind", "apiVersion", "metadata", "podClaimName", "requests"}, "document")
    if doc.get("kind") != "DeviceMetadata" or doc.get("apiVersion") != METADATA_API_VERSION:
        errors.append("kind/apiVersion")
    meta = doc.get("metadata", {})
    keys(meta, {"name", "namespace", "uid", "generation"}, "metadata")
    if not _DNS_SUBDOMAIN.fullmatch(str(meta.get("name"))):
        errors.append("metadata.name")
    if "podClaimName" in doc and not _DNS_LABEL.fullmatch(str(doc["podClaimName"])):
        errors.append("podClaimName")
    for r, request in enumerate(doc.get("requests", [])):
        keys(request, {"name", "devices"}, f"requests[{r}]")
        if not request.get("name"):
            errors.append(f"requests[{r}].name is required")
        for d, device in enumerate(request.get("devices", [])):
            where = f"requests[{r}].devices[{d}]"
            keys(device, {"driver", "pool", "name", "attributes", "networkData"}, where)
            driver, pool, name = device.get("driver"), device.get("pool"), device.get("name")
            if not (
                isinstance(driver, str) and len(driver) <= 63 and _DNS_SUBDOMAIN.fullmatch(driver)
            ):
                errors.append(f"{where}.driver")
            if not (isinstance(pool, str) and pool):
                errors.append(f"{where}.pool")
            if not (isinstance(name, str) and len(name) <= 63 and _DNS_LABEL.fullmatch(name)):
                errors.append(f"{where}.name")
            attributes = device.get("attributes", {})
            if len(attributes) > 32:
                errors.append(f"{where}.attributes: {len(attributes)} > 32")
            for key, value in attributes.items():
                if not _QUALIFIED.fullmatch(key):
                    errors.append(f"{where}: attribute name {key}")
                if not isinstance(value, dict) or len(value) != 1:
                    errors.append(f"{where}.{key}: exactly one value")
                    continue
                [(kind, item)] = value.items()
                if kind in _SCALARS:
                    ok = _type_ok(item, _SCALARS[kind])
                elif kind in _LISTS:
                    ok = (
                        isinstance(item, list)
                        and bool(item)
                        and all(_type_ok(v, _LISTS[kind]) for v in item)
                    )
                else:
                    ok = False
                if not ok or (
                    kind in ("string", "strings")
                    and any(
                        len(v.encode()) > 64 for v in (item if isinstance(item, list) else [item])
                    )
                ):
                    errors.append(f"{where}.{key}: bad {kind} {item!r}")
    return errors


# --- fixtures ------------------------------------------------------------------------------------


@functools.cache
def _topology(root: Path, roots: bool) -> Topology:
    return read_topology(root, pcie_roots=roots)


@functools.cache
def _model(root: Path) -> upstream_driver.Machine:
    return upstream_driver.read_machine(root)


def _config(root: Path, mode: CpuDeviceMode, group_by: GroupBy, *, roots: bool) -> NodeConfig:
    return NodeConfig.build(NODE, _topology(root, roots), mode=mode, group_by=group_by)


def _published(config: NodeConfig, *, roots: bool) -> dict[str, dict[str, Any]]:
    """The devices as the ResourceSlices carry them, by name."""
    slices = build_resource_slices(
        NODE, list(config.devices.values()), options=SliceOptions(expose_pcie_roots=roots)
    )
    return {d["name"]: d for s in slices for d in s["spec"]["devices"]}


def _claim(config: NodeConfig, model: upstream_driver.Machine) -> PreparedClaim:
    """A claim on every published device: grouped, up to 3 CPUs of each group (the lowest the
    model knows); individual, every device."""
    results: list[DeviceResult] = []
    cpus = CpuSet()
    for device in config.devices.values():
        if device.grouped:
            mine = CpuSet(c for c in device.cpus if c in model.cpus).lowest(3)
            if not mine:
                continue
            results.append(DeviceResult("cpus", NODE, device.name, len(mine)))
        else:
            mine = device.cpus
            results.append(DeviceResult("cpus", NODE, device.name))
        cpus |= mine
    results.sort(key=DeviceResult.sort_key)
    return PreparedClaim(UID, cpus, "team", "claim-a", None, tuple(results))


# --- the documents --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize(("mode", "group_by"), MODES)
@pytest.mark.parametrize("roots", [False, True], ids=["plain", "pcie"])
def test_every_fixture_mirrors_the_slices_and_the_machine(
    trees: SysfsTrees, name: str, mode: CpuDeviceMode, group_by: GroupBy, roots: bool
) -> None:
    root = trees.root(name)
    model = _model(root)
    config = _config(root, mode, group_by, roots=roots)
    published = _published(config, roots=roots)
    claim = _claim(config, model)
    assert claim.results, "the claim has a result on some device"
    [metadata_file] = claim_files(config, claim, METADATA_DIR)
    raw = metadata_file.document
    doc = json.loads(raw)  # ONE JSON object: a reader that parses the whole file works too
    assert doc == document(config, claim, "cpus")
    assert v1beta1_errors(doc) == []
    assert doc["metadata"] == {"name": "claim-a", "namespace": "team", "uid": UID, "generation": 1}
    [request] = doc["requests"]
    assert request["name"] == "cpus"
    assert [(e["driver"], e["pool"], e["name"]) for e in request["devices"]] == [
        ("dra.cpu", NODE, r.device) for r in claim.results
    ]
    for entry, result in zip(request["devices"], claim.results, strict=True):
        attributes = dict(entry["attributes"])
        device = config.devices[result.device]
        if not device.grouped:
            assert attributes == published[result.device]["attributes"]  # exactly the slice's
            continue
        lists = {
            key: attributes.pop(key)
            for key in list(attributes)
            if key.startswith("dra.cpu/allocated") and key != "dra.cpu/allocatedNumCPUs"
        }
        assert attributes.pop("dra.cpu/allocatedNumCPUs") == {"int": result.consumed_cpus}
        assert attributes == published[result.device]["attributes"]
        cpus = sorted(c for c in claim.cpus if c in device.cpus)
        assert len(cpus) == result.consumed_cpus
        for key, (kind, field_name) in PER_CPU.items():
            assert lists.pop(key) == {kind: [getattr(model.cpus[c], field_name) for c in cpus]}
        assert lists.pop("dra.cpu/allocatedSMTEnabled") == {"bools": [model.smt] * len(cpus)}
        assert lists == {}


def test_a_document_is_one_json_object_with_the_attributes_sorted() -> None:
    config = NodeConfig.build(NODE, _dual())
    claim = PreparedClaim(
        UID,
        CpuSet.parse("2,34"),
        "team",
        "pod-7-cpus-k2x9z",
        None,
        (DeviceResult("cpus", NODE, "cpudevnuma000", 2),),
        pod_claim_name="cpus",
    )
    [item] = claim_files(config, claim, METADATA_DIR)
    text = item.document.decode()
    assert text.startswith('{"kind":"DeviceMetadata","apiVersion":"metadata.resource.k8s.io/')
    assert text.endswith("}\n")
    assert text.count("\n") == 1
    doc = json.loads(text)
    assert doc["podClaimName"] == "cpus"
    [entry] = doc["requests"][0]["devices"]
    assert list(entry["attributes"]) == sorted(entry["attributes"])
    assert entry["attributes"]["dra.cpu/allocatedCPUIDs"] == {"ints": [2, 34]}
    assert entry["attributes"]["dra.cpu/allocatedCoreIDs"] == {"ints": [2, 2]}  # siblings


def _dual() -> Topology:
    return build_topology(FIXTURES["dual-socket-smt2"])


def test_results_sharing_a_device_split_its_cpus_lowest_first() -> None:
    config = NodeConfig.build(NODE, _dual())
    group = config.devices["cpudevnuma000"].cpus
    held = group.lowest(5)
    explicit = CpuSet([held.max()])
    results = (
        DeviceResult("a", NODE, "cpudevnuma000", 2),
        DeviceResult("b", NODE, "cpudevnuma000", 2),
        DeviceResult("c", NODE, "cpudevnuma000", 1, explicit),
    )
    claim = PreparedClaim(UID, held, "ns", "x", None, results)
    rest = held - explicit
    assert result_cpus(config, claim) == (rest.lowest(2), rest - rest.lowest(2), explicit)
    docs = {r: document(config, claim, r) for r in ("a", "b", "c")}
    for request, cpus in zip("abc", result_cpus(config, claim), strict=True):
        [entry] = docs[request]["requests"][0]["devices"]
        assert entry["attributes"]["dra.cpu/allocatedCPUIDs"] == {"ints": list(cpus)}


def test_a_device_no_longer_published_keeps_what_its_result_says() -> None:
    config = NodeConfig.build(NODE, _dual())
    claim = PreparedClaim(
        UID, CpuSet.parse("1"), "ns", "x", None, (DeviceResult("cpus", NODE, "cpudevnuma007", 1),)
    )
    [entry] = document(config, claim, "cpus")["requests"][0]["devices"]
    assert entry == {
        "driver": "dra.cpu",
        "pool": NODE,
        "name": "cpudevnuma007",
        "attributes": {"dra.cpu/allocatedNumCPUs": {"int": 1}},
    }


# --- names, paths, the CDI spec ------------------------------------------------------------------


def test_paths_and_the_cdi_spec_are_the_helpers() -> None:
    config = NodeConfig.build(NODE, _dual())
    direct = PreparedClaim(
        UID, CpuSet.parse("3"), "ns", "shared-cpus", None,
        (DeviceResult("cpus", NODE, "cpudevnuma000", 1),),
    )  # fmt: skip
    templated = PreparedClaim(**{**_fields(direct), "pod_claim_name": "my-cpus"})
    base = "/var/run/kubernetes.io/dra-device-attributes"
    assert container_path(direct, "cpus") == (
        f"{base}/resourceclaims/shared-cpus/cpus/dra.cpu-metadata.json"
    )
    assert container_path(templated, "cpus") == (
        f"{base}/resourceclaimtemplates/my-cpus/cpus/dra.cpu-metadata.json"
    )
    [item] = claim_files(config, templated, METADATA_DIR + "/")
    assert item.host_path == f"{METADATA_DIR}/{UID}_cpus.json"
    assert item.spec_name == f"dra.cpu_metadata_{UID}_cpus.json"
    spec = json.loads(item.spec)
    assert spec == {
        "cdiVersion": "0.5.0",
        "kind": "dra.cpu/metadata",
        "devices": [
            {
                "name": f"{UID}_cpus",
                "containerEdits": {
                    "mounts": [
                        {
                            "hostPath": item.host_path,
                            "containerPath": container_path(templated, "cpus"),
                            "options": ["ro", "bind"],
                        }
                    ]
                },
            }
        ],
    }
    # what podman 4.x and containerd 1.7.0-1.7.11 load (their newest CDI version is 0.5.0)
    assert validate_spec(spec, newest_known="0.5.0") == []
    assert minimum_required_version(spec) == "0.5.0"  # a device name starting with a digit
    assert metadata_device_id(UID, "cpus") == f"dra.cpu/metadata={UID}_cpus"


def _fields(claim: PreparedClaim) -> dict[str, Any]:
    return {name: getattr(claim, name) for name in PreparedClaim.__slots__}


def test_file_names_are_recognised_and_nothing_else() -> None:
    assert metadata_spec_owner(metadata_spec_file_name(UID, "cpus")) == UID
    assert metadata_spec_owner(metadata_spec_file_name(UID, "a.b_c-1")) == UID
    assert metadata_file_owner(metadata_file_name(UID, "cpus")) == UID
    assert metadata_file_owner(metadata_spec_file_name(UID, "cpus")) is None
    assert metadata_spec_owner(metadata_file_name(UID, "cpus")) is None
    assert metadata_file_owner(f"{UID}_.json") is None
    assert metadata_file_owner(f".{UID}_cpus.json.tmp-0123456789abcdef") is None
    for other in (
        f"dra.k8s.io-cpu_claim-{UID}.json",  # the claim's own spec
        f".dra.cpu_metadata_{UID}_cpus.json.tmp-0123456789abcdef",  # a temp file
        f"dra.cpu_metadata_{UID}_.json",
        f"dra.cpu_metadata_{UID}_../x.json",
        "dra.cpu_metadata_not-a-uid_cpus.json",
        f"gpu.example.com_metadata_{UID}_cpus.json",  # another driver's
    ):
        assert metadata_spec_owner(other) is None, other


@pytest.mark.parametrize(
    ("name", "pod_claim_name", "request_name", "bad"),
    [
        ("../etc", None, "cpus", "its name"),
        ("a/b", None, "cpus", "its name"),
        ("", None, "cpus", "its name"),
        ("ok", "..", "cpus", "pod-claim-name"),
        ("ok", "x/y", "cpus", "pod-claim-name"),
        ("ok", None, ".", "request"),
        ("ok", None, "a/b", "request"),
    ],
)
def test_names_that_cannot_make_paths_fail_the_prepare(
    name: str, pod_claim_name: str | None, request_name: str, bad: str
) -> None:
    results = (DeviceResult(request_name, NODE, "cpudevnuma000", 1),)
    with pytest.raises(ClaimError, match=bad):
        check_names(UID, name, pod_claim_name, results)
    state = NodeState.initial(NodeConfig.build(NODE, _dual()))
    new, effects = apply(
        state, PrepareClaim(UID, "ns", name, results, pod_claim_name=pod_claim_name)
    )
    assert new is state
    [reply] = effects
    assert isinstance(reply, Reply)
    assert isinstance(reply.value, ClaimError)


def test_each_request_has_its_id_on_its_first_device_only() -> None:
    assert metadata_ids_by_device(UID, ["a", "b", "a", "b", "c"]) == (
        f"dra.cpu/metadata={UID}_a",
        f"dra.cpu/metadata={UID}_b",
        None,
        None,
        f"dra.cpu/metadata={UID}_c",
    )
    assert metadata_ids_by_device(UID, []) == ()


def test_a_claim_without_results_has_no_metadata() -> None:
    config = NodeConfig.build(NODE, _dual())
    assert claim_files(config, PreparedClaim(UID, CpuSet.parse("4")), METADATA_DIR) == ()


def test_the_v1beta1_check_catches_what_it_is_for() -> None:
    config = NodeConfig.build(NODE, _dual())
    claim = PreparedClaim(
        UID, CpuSet.parse("2"), "ns", "x", None, (DeviceResult("cpus", NODE, "cpudevnuma000", 1),)
    )
    good = document(config, claim, "cpus")
    assert v1beta1_errors(good) == []
    entry = good["requests"][0]["devices"][0]
    broken: list[tuple[str, Any]] = [
        ("attributes", {f"dra.cpu/a{i}": {"int": i} for i in range(33)}),
        ("attributes", {"dra.cpu/x": {"ints": []}}),
        ("attributes", {"dra.cpu/x": {"int": 1, "bool": True}}),
        ("attributes", {"dra.cpu/x": {"string": "s" * 65}}),
        ("attributes", {"not/a/name": {"int": 1}}),
        ("name", "CpuDev"),
        ("extra", 1),
    ]
    for key, value in broken:
        bad = json.loads(json.dumps(good))
        bad["requests"][0]["devices"][0] = {**entry, key: value}
        assert v1beta1_errors(bad) != [], (key, value)


def test_the_daemon_writes_where_the_helper_does() -> None:
    config = Config(node_name="n", kubelet_root_dir=Path("/var/lib/k8s/kubelet"))
    assert (
        config.device_metadata_dir
        == Path("/var/lib/k8s/kubelet/plugins/dra.cpu") / METADATA_DIR_NAME
        == Path("/var/lib/k8s/kubelet/plugins/dra.cpu/dra-device-metadata")
    )
