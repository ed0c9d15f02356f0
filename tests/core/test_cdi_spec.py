from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dracpu.core.cdi_spec import (
    CDI_KIND,
    CDI_VERSION,
    ENV_PREFIX,
    ClaimSpec,
    build_spec,
    check_claim_uid,
    claim_uid_from_file_name,
    device_id,
    device_name,
    encode_spec,
    env_entry,
    is_our_spec_file,
    is_valid_claim_uid,
    minimum_required_version,
    parse_claim_spec,
    parse_env,
    parse_spec,
    spec_bytes,
    spec_file_name,
    validate_spec,
)
from dracpu.core.cpuset import CpuSet
from dracpu.errors import CdiError

UID = "8ec6fd12-bb08-4936-a857-866f50153c21"
OTHER = "0b7e3a52-4c1f-4d7e-9a31-2f9a4c1d5e60"
CPUS = CpuSet.parse("4-5,68-69")

# The exact file content (dra-driver-cpu issue #140 shows this env for this claim).
EXPECTED = (
    b'{"cdiVersion":"0.5.0","kind":"dra.k8s.io/cpu","devices":[{"name":'
    b'"claim-8ec6fd12-bb08-4936-a857-866f50153c21","containerEdits":{"env":'
    b'["DRA_CPUSET_8ec6fd12-bb08-4936-a857-866f50153c21=4-5,68-69"]}}]}\n'
)


# --- names ---------------------------------------------------------------------------------------


def test_constants_match_the_compatibility_contract() -> None:
    assert CDI_VERSION == "0.5.0"
    assert CDI_KIND == "dra.k8s.io/cpu"
    assert ENV_PREFIX == "DRA_CPUSET_"


def test_names_of_a_claim() -> None:
    assert device_name(UID) == f"claim-{UID}"
    assert device_id(UID) == f"dra.k8s.io/cpu=claim-{UID}"
    assert spec_file_name(UID) == f"dra.k8s.io-cpu_claim-{UID}.json"
    assert env_entry(UID, CPUS) == f"DRA_CPUSET_{UID}=4-5,68-69"


@pytest.mark.parametrize(
    "uid",
    [
        "",
        "abc",
        "../../etc/passwd",
        "8ec6fd12-bb08-4936-a857-866f50153c2/",
        "8ec6fd12-bb08-4936-a857-866f50153c21/..",
        "8ec6fd12/bb08-4936-a857-866f50153c21",
        "8ec6fd12-bb08-4936-a857-866f50153c2g",
        "8ec6fd12-bb08-4936-a857-866f50153c21\n",
        " 8ec6fd12-bb08-4936-a857-866f50153c21",
        "8ec6fd12-bb08-4936-a857-866f50153c21=0",
        "8ec6fd12bb084936a857866f50153c21",
        "{8ec6fd12-bb08-4936-a857-866f50153c21}",
        "\uff18ec6fd12-bb08-4936-a857-866f50153c21",  # a full-width digit eight
    ],
)
def test_bad_claim_uids_are_rejected_everywhere(uid: str) -> None:
    assert not is_valid_claim_uid(uid)
    for fn in (check_claim_uid, device_name, device_id, spec_file_name):
        with pytest.raises(CdiError, match="invalid claim UID"):
            fn(uid)
    with pytest.raises(CdiError, match="invalid claim UID"):
        build_spec(uid, CPUS)


def test_claim_uid_must_be_a_string() -> None:
    assert not is_valid_claim_uid(None)
    with pytest.raises(CdiError, match="invalid claim UID"):
        check_claim_uid(12)


def test_uppercase_uuid_is_accepted_verbatim() -> None:
    upper = UID.upper()
    assert spec_file_name(upper) == f"dra.k8s.io-cpu_claim-{upper}.json"


@pytest.mark.parametrize(
    ("name", "uid"),
    [
        (f"dra.k8s.io-cpu_claim-{UID}.json", UID),
        (f"dra.k8s.io-cpu_claim-{UID}.yaml", None),
        (f"dra.k8s.io-cpu_claim-{UID}.json.tmp-0123abcd", None),
        (f".dra.k8s.io-cpu_claim-{UID}.json.tmp-0123abcd", None),
        (f"dra.k8s.io-cpu_claim-{UID}", None),
        ("dra.k8s.io-cpu_claim-foo.json", None),
        ("dra.cpu.json", None),
        ("nvidia.com-gpu.json", None),
        (f"x/dra.k8s.io-cpu_claim-{UID}.json", None),
        (f"DRA.K8S.IO-cpu_claim-{UID}.json", None),
        (f"dra.k8s.io-cpu_claim-{UID}.JSON", None),
    ],
)
def test_our_spec_file_names(name: str, uid: str | None) -> None:
    assert claim_uid_from_file_name(name) == uid
    assert is_our_spec_file(name) is (uid is not None)


# --- build and encode ----------------------------------------------------------------------------


def test_exact_bytes_of_a_spec() -> None:
    assert spec_bytes(UID, CPUS) == EXPECTED
    assert encode_spec(build_spec(UID, CPUS)) == EXPECTED


def test_build_spec_structure_and_key_order() -> None:
    spec = build_spec(UID, CpuSet.parse("0-3,8"))
    assert spec == {
        "cdiVersion": "0.5.0",
        "kind": "dra.k8s.io/cpu",
        "devices": [
            {
                "name": f"claim-{UID}",
                "containerEdits": {"env": [f"DRA_CPUSET_{UID}=0-3,8"]},
            }
        ],
    }
    # Go struct order of specs-go/config.go.
    assert list(spec) == ["cdiVersion", "kind", "devices"]
    assert list(spec["devices"][0]) == ["name", "containerEdits"]


def test_a_shared_pool_claims_spec_names_the_pool_after_its_cpus() -> None:
    spec = build_spec(UID, CpuSet.parse("4-5"), shared_pool=True)
    assert spec["devices"][0]["containerEdits"] == {
        "env": [f"DRA_CPUSET_{UID}=4-5", f"DRA_SHARED_POOL_{UID}=true"]
    }
    data = spec_bytes(UID, CpuSet.parse("4-5"), shared_pool=True)
    assert parse_claim_spec(data) == (UID, ClaimSpec(CpuSet.parse("4-5"), shared_pool=True))
    assert parse_spec(data) == (UID, CpuSet.parse("4-5"))
    assert parse_claim_spec(EXPECTED) == (UID, ClaimSpec(CPUS))
    assert validate_spec(json.loads(data), newest_known="0.5.0") == []
    # the marker is no claim to an env reader of DRA_CPUSET_ (ours, upstream's)
    env = spec["devices"][0]["containerEdits"]["env"]
    assert parse_env(env) == {UID: CpuSet.parse("4-5")}


def test_empty_cpuset_is_refused() -> None:
    with pytest.raises(CdiError, match="empty cpuset"):
        build_spec(UID, CpuSet())


def test_encode_spec_is_deterministic_and_rejects_non_json() -> None:
    spec = build_spec(UID, CPUS)
    assert encode_spec(spec) == encode_spec(copy.deepcopy(spec))
    with pytest.raises(CdiError, match="cannot be encoded"):
        encode_spec({"x": {1, 2}})
    with pytest.raises(CdiError, match="cannot be encoded"):
        encode_spec({"x": float("nan")})


# --- validate_spec: the CDI library's rules --------------------------------------------------


def ours() -> dict[str, Any]:
    return build_spec(UID, CPUS)


def test_our_spec_is_valid_for_every_runtime_generation() -> None:
    for newest in ("0.5.0", "0.6.0", "0.8.0", "1.1.0"):
        assert validate_spec(ours(), newest_known=newest) == []
    assert minimum_required_version(ours()) == "0.3.0"


def test_a_rich_vendor_spec_is_valid() -> None:
    spec = {
        "cdiVersion": "v0.6.0",
        "kind": "vendor.example.com/gpu",
        "annotations": {"a": "b"},
        "devices": [
            {
                "name": "0",
                "annotations": {"x": "y"},
                "containerEdits": {
                    "deviceNodes": [
                        {"path": "/dev/gpu0", "hostPath": "/dev/gpu0", "type": "c", "major": 1,
                         "minor": 2, "fileMode": 438, "permissions": "rw", "uid": 0, "gid": 0}
                    ],
                },
            },
            {"name": "all:0", "containerEdits": {"env": ["A=1", "B="]}},
        ],
        "containerEdits": {
            "mounts": [{"hostPath": "/a", "containerPath": "/b", "options": ["ro"], "type": "x"}],
            "hooks": [{"hookName": "createContainer", "path": "/bin/true", "args": ["true"],
                       "env": ["X=1"], "timeout": 5}],
        },
    }  # fmt: skip
    assert validate_spec(spec) == []
    assert minimum_required_version(spec) == "0.6.0"
    # podman 4.x / containerd 1.7.0-1.7.11 know only up to 0.5.0.
    assert validate_spec(spec, newest_known="0.5.0") == ["invalid version 'v0.6.0'"]


def test_json_null_counts_as_absent() -> None:
    spec = ours()
    spec["containerEdits"] = None
    spec["devices"][0]["annotations"] = None
    assert validate_spec(spec) == []


Mutation = Callable[[dict[str, Any]], None]


def _set(path: tuple[Any, ...], value: Any) -> Mutation:
    def mutate(spec: dict[str, Any]) -> None:
        target: Any = spec
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _delete(path: tuple[Any, ...]) -> Mutation:
    def mutate(spec: dict[str, Any]) -> None:
        target: Any = spec
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


def _chain(*mutations: Mutation) -> Mutation:
    def mutate(spec: dict[str, Any]) -> None:
        for mutation in mutations:
            mutation(spec)

    return mutate


EDITS = ("devices", 0, "containerEdits")

BROKEN: list[tuple[str, Mutation, str | None]] = [
    ("no version", _delete(("cdiVersion",)), "invalid version"),
    ("unknown version", _set(("cdiVersion",), "0.9.0"), "invalid version '0.9.0'"),
    ("version not semver", _set(("cdiVersion",), "0.5"), "invalid version"),
    ("version a number", _set(("cdiVersion",), 0.5), "invalid version"),
    ("too old for the spec", _set(("cdiVersion",), "0.2.0"), "at least v0.3.0"),
    ("no kind", _delete(("kind",)), "kind is required"),
    ("kind without class", _set(("kind",), "dra.k8s.io"), "expected vendor/class"),
    ("kind with empty vendor", _set(("kind",), "/cpu"), "expected vendor/class"),
    ("vendor starts with digit", _set(("kind",), "9dra.io/cpu"), "invalid vendor"),
    ("vendor ends with dot", _set(("kind",), "dra.io./cpu"), "invalid vendor"),
    ("class with second slash", _set(("kind",), "dra.k8s.io/cpu/x"), "invalid class"),
    ("class with space", _set(("kind",), "dra.k8s.io/c pu"), "invalid class"),
    ("class with dot needs 0.6.0", _set(("kind",), "dra.k8s.io/cpu.x"), "at least v0.6.0"),
    ("unknown top-level field", _set(("kindShort",), ["cpu"]), "unknown field 'kindShort'"),
    ("annotations need 0.6.0", _set(("annotations",), {"a": "b"}), "at least v0.6.0"),
    ("annotations not strings", _set(("annotations",), {"a": 1}), "annotations must map"),
    ("no devices field", _delete(("devices",)), "devices is required"),
    ("empty devices", _set(("devices",), []), "no devices"),
    ("device not an object", _set(("devices", 0), "claim"), "must be an object"),
    ("device without name", _delete(("devices", 0, "name")), "invalid device name"),
    ("empty device name", _set(("devices", 0, "name"), ""), "invalid device name"),
    ("device name with slash", _set(("devices", 0, "name"), "claim/x"), "invalid device name"),
    ("device name ends with dash", _set(("devices", 0, "name"), "claim-"), "invalid device name"),
    ("digit-first name needs 0.5.0", _set(("devices", 0, "name"), "1claim"), None),
    ("unknown device field", _set(("devices", 0, "nameShort"), ["x"]), "unknown field"),
    ("no device edits", _delete(EDITS), "empty device edits"),
    ("empty device edits", _set(EDITS, {}), "empty device edits"),
    ("empty env list", _set((*EDITS, "env"), []), "empty device edits"),
    ("edits not an object", _set(EDITS, ["A=1"]), "must be an object"),
    ("env not a list", _set((*EDITS, "env"), "A=1"), "env must be a list"),
    ("env entry without =", _set((*EDITS, "env"), ["DRA_CPUSET"]), "invalid environment"),
    ("env entry starting with =", _set((*EDITS, "env"), ["=0-3"]), "invalid environment"),
    ("env entry not a string", _set((*EDITS, "env"), [1]), "env must be a list of strings"),
    ("unknown edits field", _set((*EDITS, "user"), {"uid": 0}), "unknown field 'user'"),
    ("device node without path", _set((*EDITS, "deviceNodes"), [{"type": "c"}]), "path is"),
    ("device node bad type", _set((*EDITS, "deviceNodes"), [{"path": "/d", "type": "x"}]),
     "invalid type"),
    ("negative major", _set((*EDITS, "deviceNodes"), [{"path": "/d", "major": -1}]),
     "non-negative"),
    ("bad permissions", _set((*EDITS, "deviceNodes"), [{"path": "/d", "permissions": "rx"}]),
     "invalid permissions"),
    ("mount without host path", _set((*EDITS, "mounts"), [{"containerPath": "/b"}]), "hostPath"),
    ("mount type needs 0.4.0",
     _chain(_set(("cdiVersion",), "0.3.0"),
            _set((*EDITS, "mounts"), [{"hostPath": "/a", "containerPath": "/b", "type": "x"}])),
     "at least v0.4.0"),
    ("device node hostPath needs 0.5.0",
     _chain(_set(("cdiVersion",), "0.4.0"),
            _set((*EDITS, "deviceNodes"), [{"path": "/dev/a", "hostPath": "/dev/b"}])),
     "at least v0.5.0"),
    ("bad hook name", _set((*EDITS, "hooks"), [{"hookName": "later", "path": "/x"}]),
     "invalid hook name"),
    ("intelRdt needs 0.7.0", _set((*EDITS, "intelRdt"), {"closID": "x"}), "at least v0.7.0"),
    ("bad closID", _set((*EDITS, "intelRdt"), {"closID": ".."}), "invalid closID"),
    ("additionalGids need 0.7.0", _set((*EDITS, "additionalGids"), [5]), "at least v0.7.0"),
    ("negative gid", _set((*EDITS, "additionalGids"), [-5]), "additionalGids"),
    ("netDevices need 1.1.0",
     _set((*EDITS, "netDevices"), [{"hostInterfaceName": "eth0", "name": "eth1"}]),
     "at least v1.1.0"),
    ("duplicate device names", lambda s: s["devices"].append(copy.deepcopy(s["devices"][0])),
     "multiple device"),
    ("spec-level edits invalid", _set(("containerEdits",), {"env": ["NOEQUALS"]}),
     "invalid environment"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mutate", "expected"), [(m, e) for _, m, e in BROKEN], ids=[name for name, _, _ in BROKEN]
)
def test_validate_spec_rejects_broken_specs(mutate: Mutation, expected: str | None) -> None:
    spec = ours()
    mutate(spec)
    problems = validate_spec(spec)
    if expected is None:  # the digit-first name: valid as 0.5.0, invalid as 0.3.0 / 0.4.0
        assert problems == []
        spec["cdiVersion"] = "0.4.0"
        assert validate_spec(spec) == ["the spec version must be at least v0.5.0"]
        return
    assert problems, "the mutation must make the spec invalid"
    assert any(expected in p for p in problems), problems


def test_validate_spec_rejects_non_objects() -> None:
    assert validate_spec([ours()]) == ["a CDI spec must be a JSON object"]
    assert validate_spec("spec") == ["a CDI spec must be a JSON object"]


def test_newest_known_version_must_be_a_version() -> None:
    with pytest.raises(ValueError, match="not a version"):
        validate_spec(ours(), newest_known="latest")


# --- parse_spec --------------------------------------------------------------------------------


def test_parse_spec_round_trip() -> None:
    assert parse_spec(EXPECTED) == (UID, CPUS)


def test_parse_spec_reads_upstream_files() -> None:
    # What the Go driver writes (json.MarshalIndent of specs.Spec, cdiVersion 0.8.0): the spec-level
    # ContainerEdits struct is never omitted, so it appears as {}.
    upstream = {
        "cdiVersion": "0.8.0",
        "kind": "dra.k8s.io/cpu",
        "devices": [
            {"name": f"claim-{UID}", "containerEdits": {"env": [f"DRA_CPUSET_{UID}=4-5,68-69"]}}
        ],
        "containerEdits": {},
    }
    assert parse_spec(json.dumps(upstream, indent="  ").encode()) == (UID, CPUS)


def _raw(spec: dict[str, Any]) -> bytes:
    return json.dumps(spec).encode()


def _spec_with(mutate: Mutation) -> bytes:
    spec = ours()
    mutate(spec)
    return _raw(spec)


PARSE_ERRORS: list[tuple[str, bytes, str]] = [
    ("not utf-8", b'{"kind":"\xff"}', "not UTF-8"),
    ("not json", b"cdiVersion: 0.5.0\n", "not valid JSON"),
    ("truncated", EXPECTED[:-20], "not valid JSON"),
    ("empty", b"", "not valid JSON"),
    ("duplicate key", EXPECTED.replace(b'"kind":', b'"kind":"x/y","kind":', 1), "duplicate key"),
    ("top-level list", b"[]", "JSON object"),
    ("NaN", EXPECTED.replace(b'"0.5.0"', b"NaN"), "NaN is not a JSON value"),
    ("bad version", _spec_with(_set(("cdiVersion",), "2.0.0")), "invalid version"),
    ("other kind", _spec_with(_set(("kind",), "nvidia.com/gpu")), "is not ours"),
    ("unknown field", _spec_with(_set(("extra",), 1)), "unknown field 'extra'"),
    ("annotations", _spec_with(_chain(_set(("cdiVersion",), "0.6.0"),
                                      _set(("annotations",), {"a": "b"}))), "never writes"),
    ("spec-level env", _spec_with(_set(("containerEdits",), {"env": ["A=1"]})), "spec-level"),
    ("two devices", _spec_with(lambda s: s["devices"].append(
        {"name": "claim-x", "containerEdits": {"env": ["A=1"]}})), "2 devices"),
    ("device annotations", _spec_with(_chain(_set(("cdiVersion",), "0.6.0"),
                                             _set(("devices", 0, "annotations"), {"a": "b"}))),
     "never writes"),
    ("device name not claim-", _spec_with(_set(("devices", 0, "name"), f"cpu-{UID}")),
     "is not claim-<claim UID>"),
    ("device name bad uid", _spec_with(_set(("devices", 0, "name"), "claim-1234")),
     "is not claim-<claim UID>"),
    ("env missing", _spec_with(_set(EDITS, {"mounts": [{"hostPath": "/a",
                                                         "containerPath": "/b"}]})),
     f"containerEdits must be the env entry DRA_CPUSET_{UID}, maybe followed by "
     f"DRA_SHARED_POOL_{UID}"),
    ("another second env entry", _spec_with(_set((*EDITS, "env"), [f"DRA_CPUSET_{UID}=1", "A=1"])),
     f"is not DRA_SHARED_POOL_{UID}=true"),
    ("shared pool not true", _spec_with(_set((*EDITS, "env"), [f"DRA_CPUSET_{UID}=1",
                                                              f"DRA_SHARED_POOL_{UID}=1"])),
     f"is not DRA_SHARED_POOL_{UID}=true"),
    ("shared pool of another claim", _spec_with(_set((*EDITS, "env"), [
        f"DRA_CPUSET_{UID}=1", f"DRA_SHARED_POOL_{OTHER}=true"])),
     f"is not DRA_SHARED_POOL_{UID}=true"),
    ("shared pool first", _spec_with(_set((*EDITS, "env"), [f"DRA_SHARED_POOL_{UID}=true",
                                                           f"DRA_CPUSET_{UID}=1"])),
     f"is not DRA_CPUSET_{UID}"),
    ("three env entries", _spec_with(_set((*EDITS, "env"), [
        f"DRA_CPUSET_{UID}=1", f"DRA_SHARED_POOL_{UID}=true", "A=1"])),
     "maybe followed by"),
    ("env of another claim", _spec_with(_set((*EDITS, "env"), [f"DRA_CPUSET_{OTHER}=1"])),
     f"is not DRA_CPUSET_{UID}"),
    ("env of another name", _spec_with(_set((*EDITS, "env"), ["CPUSET=1"])), "is not DRA_CPUSET_"),
    ("malformed cpuset", _spec_with(_set((*EDITS, "env"), [f"DRA_CPUSET_{UID}=3-1"])),
     "ends before it starts"),
    ("empty cpuset", _spec_with(_set((*EDITS, "env"), [f"DRA_CPUSET_{UID}="])), "empty"),
    ("cpuset with spaces", _spec_with(_set((*EDITS, "env"), [f"DRA_CPUSET_{UID}=1, 2"])),
     "not a CPU id"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("data", "expected"), [(d, e) for _, d, e in PARSE_ERRORS], ids=[n for n, _, _ in PARSE_ERRORS]
)
def test_parse_spec_errors(data: bytes, expected: str) -> None:
    with pytest.raises(CdiError) as info:
        parse_spec(data)
    assert expected in str(info.value)


# --- parse_env -----------------------------------------------------------------------------------


def test_parse_env_reads_our_entries_and_ignores_the_rest() -> None:
    env = [
        "PATH=/usr/bin",
        f"DRA_CPUSET_{UID}=4-5,68-69",
        "HOSTNAME=pod",
        f"DRA_CPUSET_{OTHER}=0",
        "dra_cpuset_whatever=not-checked",  # env names are case-sensitive: not ours
        "DRA_CPUSETS=1",  # another name that merely starts alike
        f"DRA_CPUSET_{UID}=4-5,68-69",  # the same entry twice is harmless
        "",
    ]
    assert parse_env(env) == {UID: CPUS, OTHER: CpuSet.parse("0")}
    assert parse_env([]) == {}
    assert parse_env(["HOME=/"]) == {}


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        (f"DRA_CPUSET_{UID}", "no '='"),
        (f"DRA_CPUSET_{UID}=", "empty"),
        (f"DRA_CPUSET_{UID}=abc", "not a CPU id"),
        (f"DRA_CPUSET_{UID}=5-2", "ends before it starts"),
        (f"DRA_CPUSET_{UID}= 1", "whitespace"),
        (f"DRA_CPUSET_{UID}=1\n", "whitespace"),
        (f"DRA_CPUSET_{UID}=99999", "above the limit"),
        ("DRA_CPUSET_=1", "is not a claim UID"),
        ("DRA_CPUSET_../../etc/passwd=1", "is not a claim UID"),
        (f"DRA_CPUSET_{UID}x=1", "is not a claim UID"),
        (f"DRA_CPUSET_{UID}/..=1", "is not a claim UID"),
        (f"DRA_CPUSET_ {UID}=1", "is not a claim UID"),
        (f"DRA_CPUSET_claim_{UID}=1", "is not a claim UID"),
    ],
)
def test_parse_env_fails_closed_on_malformed_entries(entry: str, expected: str) -> None:
    with pytest.raises(CdiError) as info:
        parse_env(["PATH=/bin", entry])
    message = str(info.value)
    assert expected in message
    assert "malformed env entry" in message


def test_parse_env_conflicting_values_for_one_claim() -> None:
    with pytest.raises(CdiError, match="twice with different cpusets"):
        parse_env([f"DRA_CPUSET_{UID}=1", f"DRA_CPUSET_{UID}=2"])


def test_parse_env_clips_huge_values_in_messages() -> None:
    with pytest.raises(CdiError) as info:
        parse_env([f"DRA_CPUSET_{UID}=" + "x" * 100_000])
    assert len(str(info.value)) < 600


def test_parse_env_rejects_non_strings() -> None:
    with pytest.raises(CdiError, match="not a string"):
        parse_env([b"DRA_CPUSET_x=1"])  # type: ignore[list-item]


# --- properties --------------------------------------------------------------------------------

uids = st.uuids().map(str) | st.uuids().map(lambda u: str(u).upper())
cpusets = st.sets(st.integers(0, 2047), min_size=1, max_size=64).map(CpuSet)


@settings(max_examples=150, deadline=None)
@given(uid=uids, cpus=cpusets, shared_pool=st.booleans())
def test_every_spec_round_trips_and_is_valid_for_old_runtimes(
    uid: str, cpus: CpuSet, shared_pool: bool
) -> None:
    data = spec_bytes(uid, cpus, shared_pool)
    assert parse_claim_spec(data) == (uid, ClaimSpec(cpus, shared_pool))
    assert validate_spec(json.loads(data), newest_known="0.5.0") == []
    assert parse_env(["A=1", env_entry(uid, cpus)]) == {uid: cpus}
    assert claim_uid_from_file_name(spec_file_name(uid)) == uid


@pytest.mark.parametrize("depth", [600, 990, 100_000])
def test_deeply_nested_spec_is_a_cdi_error_not_a_recursion_error(depth: int) -> None:
    # A corrupt file in the CDI dir must not crash the watcher: json.loads (deep) or the
    # validation walk (less deep, but still parseable) raised RecursionError.
    nested = b"[" * depth + b"]" * depth
    raw = EXPECTED.replace(b'"kind":', b'"annotations":{"a":' + nested + b'},"kind":', 1)
    with pytest.raises(CdiError, match="nested too deeply"):
        parse_spec(raw)
