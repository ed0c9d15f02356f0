"""Which claims' files differ from what the state owner would write (``core/file_drift``)."""

from __future__ import annotations

from types import MappingProxyType

from dracpu.core.cdi_spec import spec_bytes, spec_file_name
from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.core.commands import DeviceResult
from dracpu.core.cpuset import CpuSet
from dracpu.core.device_metadata import claim_files
from dracpu.core.file_drift import drifted_claims
from dracpu.core.node_config import NodeConfig
from dracpu.core.state import NodeState
from tests.core.state_helpers import NODE, config_for, cpus, uid

METADATA_DIR = "/var/lib/kubelet/plugins/dra.cpu/dra-device-metadata"
A, B, C, D = uid(1), uid(2), uid(3), uid(4)


def _state(config: NodeConfig, *claims: PreparedClaim) -> NodeState:
    return NodeState(
        config=config,
        claims=MappingProxyType({c.claim_uid: c for c in claims}),
        claimed=CpuSet.union(c.cpus for c in claims),
    )


def _files(state: NodeState) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The metadata specs and files the owner writes for every prepared claim."""
    specs: dict[str, bytes] = {}
    files: dict[str, bytes] = {}
    for claim in state.claims.values():
        for item in claim_files(state.config, claim, METADATA_DIR):
            specs[item.spec_name] = item.spec
            files[item.host_path.rsplit("/", 1)[-1]] = item.document
    return specs, files


def test_missing_edited_unreadable_and_orphan_specs() -> None:
    config = config_for()
    state = _state(
        config,
        PreparedClaim(A, cpus("1")),
        PreparedClaim(B, cpus("2")),
        PreparedClaim(C, cpus("3")),
    )
    specs: dict[str, bytes | None] = {
        A: spec_bytes(A, cpus("1")),  # in place
        B: spec_bytes(B, cpus("7")),  # edited
        D: b"garbage",  # no prepared claim owns it
    }
    assert drifted_claims(state, METADATA_DIR, specs, {}, {}) == {B, C, D}
    assert drifted_claims(state, METADATA_DIR, {**specs, A: None}, {}, {}) == {A, B, C, D}
    # only=: just the named claims (their files were read for those).
    assert drifted_claims(state, METADATA_DIR, specs, {}, {}, only={A}) == frozenset()
    assert drifted_claims(state, METADATA_DIR, specs, {}, {}, only={B, D}) == {B, D}


def test_a_shared_pool_claims_spec_must_say_so() -> None:
    # cpuConfig.sharedPool: the spec carries DRA_SHARED_POOL_<uid>=true after DRA_CPUSET_<uid>.
    state = _state(config_for(), PreparedClaim(A, cpus("1"), shared_pool=True))
    plain = spec_bytes(A, cpus("1"))
    assert drifted_claims(state, METADATA_DIR, {A: plain}, {}, {}) == {A}
    ours = spec_bytes(A, cpus("1"), shared_pool=True)
    assert drifted_claims(state, METADATA_DIR, {A: ours}, {}, {}) == frozenset()


def test_a_spec_of_another_driver_under_our_name_differs() -> None:
    # Upstream's driver names its specs as we do and writes cdiVersion 0.8.0: ours by kind, not
    # our bytes, so it is rewritten.
    state = _state(config_for(), PreparedClaim(A, cpus("1")))
    theirs = spec_bytes(A, cpus("1")).replace(b'"0.5.0"', b'"0.8.0"')
    assert drifted_claims(state, METADATA_DIR, {A: theirs}, {}, {}) == {A}


def test_device_metadata_missing_changed_or_orphan() -> None:
    config = config_for()
    results = (DeviceResult("cpus", NODE, "cpudevnuma000", 2),)
    claim = PreparedClaim(A, cpus("1,9"), "ns", "pod-claim", None, results)
    adopted = PreparedClaim(B, cpus("4"))  # no results: its metadata is not known
    state = _state(config, claim, adopted)
    specs = {A: spec_bytes(A, claim.cpus), B: spec_bytes(B, adopted.cpus)}
    meta_specs, meta_files = _files(state)
    assert meta_specs
    assert meta_files
    assert drifted_claims(state, METADATA_DIR, specs, meta_specs, meta_files) == frozenset()
    (file_name,) = meta_files
    (spec_name,) = meta_specs
    assert drifted_claims(state, METADATA_DIR, specs, meta_specs, {}) == {A}
    assert drifted_claims(state, METADATA_DIR, specs, {}, meta_files) == {A}
    changed = {file_name: meta_files[file_name].replace(b"pod-claim", b"other")}
    assert drifted_claims(state, METADATA_DIR, specs, meta_specs, changed) == {A}
    assert drifted_claims(state, METADATA_DIR, specs, meta_specs, {file_name: None}) == {A}
    # Metadata of a claim not prepared here is an orphan; an adopted claim's is kept.
    orphan = {spec_name.replace(A, C): b"{}"}
    assert drifted_claims(state, METADATA_DIR, specs, {**meta_specs, **orphan}, meta_files) == {C}
    kept = {spec_name.replace(A, B): b"{}"}
    assert drifted_claims(state, METADATA_DIR, specs, {**meta_specs, **kept}, meta_files) == set()
    assert spec_file_name(C) not in orphan
