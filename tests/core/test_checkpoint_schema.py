from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dracpu.core.checkpoint_schema import (
    CHECKPOINT_VERSION,
    CheckpointData,
    PreparedClaim,
    StoredCheckpoint,
    decode,
    encode,
)
from dracpu.core.commands import DeviceResult
from dracpu.core.cpuset import CpuSet
from dracpu.errors import CheckpointError

__all__: list[str] = []

UID_A = "0b5a1a2e-9f4c-4c1e-8d3a-000000000001"
UID_B = "0b5a1a2e-9f4c-4c1e-8d3a-000000000002"
POD_1 = "7d1e4c2a-0000-4000-8000-00000000000a"
POD_2 = "7d1e4c2a-0000-4000-8000-00000000000b"
POD_3 = "7d1e4c2a-0000-4000-8000-00000000000c"


def sample() -> CheckpointData:
    return CheckpointData(
        MappingProxyType(
            {
                UID_A: PreparedClaim(
                    UID_A,
                    CpuSet.parse("4-5"),
                    "default",
                    "claim-a",
                    CpuSet.parse("0"),
                    (DeviceResult("req", "node-1", "cpudevnuma000", 2),),
                    frozenset({POD_2, POD_1}),
                    pod_names=frozenset({"web-1", "web-0"}),
                    copiers=frozenset({POD_3}),
                    shared_pool=True,
                ),
                UID_B: PreparedClaim(
                    UID_B,
                    CpuSet.parse("8,12"),
                    "team",
                    "pod-1-cpus-x7k2p",
                    None,
                    (
                        DeviceResult("a", "node-1", "cpudev003"),
                        DeviceResult("b", "node-1", "cpudevmachine", 1, CpuSet.parse("12")),
                    ),
                    pod_claim_name="cpus",
                ),
            }
        )
    )


def rewrite(doc: dict[str, Any]) -> bytes:
    """Re-encode a (tampered) document with a correct checksum, as encode() would."""
    payload = {k: v for k, v in doc.items() if k != "checksum"}
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    doc = {**payload, "checksum": "sha256:" + hashlib.sha256(canonical).hexdigest()}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def claims_of(raw: bytes) -> dict[str, PreparedClaim]:
    return dict(decode(raw).data.claims)


def test_round_trip_keeps_every_field_and_the_sequence() -> None:
    data = sample()
    stored = decode(encode(data, 41))
    assert dict(stored.data.claims) == dict(data.claims)
    assert stored.sequence == 41


def test_empty_round_trip() -> None:
    raw = encode(CheckpointData(), 1)
    assert decode(raw) == StoredCheckpoint(CheckpointData(), 1)
    doc = json.loads(raw)
    assert doc["version"] == CHECKPOINT_VERSION == 5
    assert doc["claims"] == {}
    assert doc["sequence"] == 1


def test_layout_is_the_documented_one() -> None:
    doc = json.loads(encode(sample(), 7))
    assert set(doc) == {"version", "checksum", "claims", "sequence"}
    assert doc["sequence"] == 7
    assert doc["checksum"].startswith("sha256:")
    assert doc["claims"][UID_A] == {
        "cpus": "4-5",
        "mems": "0",
        "namespace": "default",
        "name": "claim-a",
        "podClaimName": None,
        "podUids": [POD_1, POD_2],  # sorted
        "podNames": ["web-0", "web-1"],  # sorted
        "copierPods": [POD_3],
        "sharedPool": True,
        "results": [
            {
                "request": "req",
                "pool": "node-1",
                "device": "cpudevnuma000",
                "consumedCpus": 2,
                "cpuset": None,
            }
        ],
    }
    assert doc["claims"][UID_B]["mems"] is None
    assert doc["claims"][UID_B]["podUids"] == []  # no pods known
    assert doc["claims"][UID_B]["podNames"] == []
    assert doc["claims"][UID_B]["copierPods"] == []
    assert doc["claims"][UID_B]["sharedPool"] is False
    assert doc["claims"][UID_B]["podClaimName"] == "cpus"
    assert doc["claims"][UID_B]["results"][1]["cpuset"] == "12"


def test_checksum_is_sha256_of_canonical_payload() -> None:
    raw = encode(sample(), 3)
    doc = json.loads(raw)
    checksum = doc.pop("checksum")
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert checksum == "sha256:" + hashlib.sha256(canonical).hexdigest()


def test_encoding_is_deterministic() -> None:
    assert encode(sample(), 5) == encode(sample(), 5)
    assert encode(sample(), 5) != encode(sample(), 6)


@pytest.mark.parametrize("sequence", [1, 9, 10, 2**63])
def test_encoding_is_canonical_json(sequence: int) -> None:
    raw = encode(sample(), sequence)
    canonical = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    assert raw == canonical + b"\n"


@pytest.mark.parametrize("sequence", [0, -1, True, 1.0, "1"])
def test_encoding_refuses_a_sequence_below_one(sequence: object) -> None:
    with pytest.raises(CheckpointError, match="sequence must be an integer >= 1"):
        encode(sample(), sequence)  # type: ignore[arg-type]


def test_sequence_is_covered_by_the_checksum() -> None:
    doc = json.loads(encode(sample(), 4))
    doc["sequence"] = 5  # a newer number on older content: must not pass
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        decode(json.dumps(doc).encode())


def _older(doc: dict[str, Any], version: int) -> dict[str, Any]:
    """A version-5 document as an earlier build wrote it: without "sharedPool" (version 4),
    without "podNames" and "copierPods" (version 3), without "podClaimName" and "podUids"
    (version 2), and without "sequence" (version 1)."""
    doc = {**doc, "version": version}
    dropped = {"sharedPool"}
    if version < 4:
        dropped |= {"podNames", "copierPods"}
    if version < 3:
        dropped |= {"podClaimName", "podUids"}
    doc["claims"] = {
        uid: {k: v for k, v in claim.items() if k not in dropped}
        for uid, claim in doc["claims"].items()
    }
    if version == 1:
        del doc["sequence"]
    return doc


NO_V5: dict[str, Any] = {"shared_pool": False}
NO_V4: dict[str, Any] = {"pod_names": frozenset(), "copiers": frozenset(), **NO_V5}


def test_version_1_documents_decode_as_sequence_0() -> None:
    # What earlier dracpu builds wrote: the same layout without "sequence", "podClaimName" and
    # "podUids".
    stored = decode(rewrite(_older(json.loads(encode(sample(), 1)), 1)))
    assert stored.sequence == 0
    assert dict(stored.data.claims) == {
        uid: replace(claim, pod_claim_name=None, pod_uids=frozenset(), **NO_V4)
        for uid, claim in sample().claims.items()
    }


def test_version_2_documents_decode_without_pod_claim_names_and_pods() -> None:
    stored = decode(rewrite(_older(json.loads(encode(sample(), 6)), 2)))
    assert stored.sequence == 6
    assert dict(stored.data.claims) == {
        uid: replace(claim, pod_claim_name=None, pod_uids=frozenset(), **NO_V4)
        for uid, claim in sample().claims.items()
    }


def test_version_3_documents_decode_without_pod_names_and_copiers() -> None:
    stored = decode(rewrite(_older(json.loads(encode(sample(), 6)), 3)))
    assert stored.sequence == 6
    assert dict(stored.data.claims) == {
        uid: replace(claim, **NO_V4) for uid, claim in sample().claims.items()
    }


def test_version_4_documents_decode_without_shared_pool() -> None:
    stored = decode(rewrite(_older(json.loads(encode(sample(), 6)), 4)))
    assert dict(stored.data.claims) == {
        uid: replace(claim, **NO_V5) for uid, claim in sample().claims.items()
    }


@pytest.mark.parametrize(
    ("version", "change", "message"),
    [
        (4, {"sharedPool": True}, "must have keys"),  # version 4 had no such key
        (5, {"sharedPool": 1}, "sharedPool must be true or false, not 1"),
        (5, {"sharedPool": None}, "sharedPool must be true or false, not None"),
        (2, {"podClaimName": "cpus"}, "must have keys"),  # version 2 had no such key
        (5, {"podClaimName": 5}, "podClaimName must be a string"),
        (2, {"podUids": [POD_1]}, "must have keys"),
        (5, {"podUids": "pod"}, "podUids must be a list"),
        (3, {"podNames": ["web-0"]}, "must have keys"),  # version 3 had no such key
        (5, {"podNames": "web-0"}, "podNames must be a list"),
        (5, {"copierPods": [POD_1, POD_1]}, "copierPods lists a pod twice"),
    ],
)
def test_pod_claim_names_are_checked(version: int, change: dict[str, Any], message: str) -> None:
    doc = json.loads(encode(sample(), 2))
    doc["version"] = version
    doc["claims"][UID_A].update(change)
    with pytest.raises(CheckpointError, match=message):
        decode(rewrite(doc))


def test_trailing_spaces_pad_a_valid_document() -> None:
    # A slot overwritten by a shorter document keeps its size with spaces after the newline.
    raw = encode(sample(), 2)
    padded = raw + b" " * 3000
    assert json.loads(padded) == json.loads(raw)
    assert decode(padded) == decode(raw)


def test_encoding_follows_changes_of_shared_claims() -> None:
    first = sample()
    claims = dict(first.claims)
    claims[UID_B] = replace(claims[UID_B], cpus=CpuSet.parse("9"))
    second = CheckpointData(MappingProxyType(claims))
    assert claims_of(encode(first, 1))[UID_B].cpus == CpuSet.parse("8,12")
    assert claims_of(encode(second, 2))[UID_B].cpus == CpuSet.parse("9")
    assert claims_of(encode(first, 3))[UID_A] == claims_of(encode(second, 4))[UID_A]


def test_whitespace_changes_do_not_break_the_checksum() -> None:
    doc = json.loads(encode(sample(), 8))
    pretty = json.dumps(doc, indent=4).encode()
    assert decode(pretty) == StoredCheckpoint(sample(), 8)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "not valid JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b"{", "not valid JSON"),
        (b"[]", "must be a JSON object"),
        (b'{"claims": {}}', "no integer 'version'"),
        (b'{"version": "1", "claims": {}}', "no integer 'version'"),
        (b'{"version": 6, "claims": {}, "checksum": "sha256:00"}', "version 6 is unknown"),
        (b'{"version": 0, "claims": {}, "checksum": "sha256:00"}', "version 0 is unknown"),
        (b'{"version": 1, "claims": {}}', "keys must be"),
        (b'{"version": 2, "claims": {}, "checksum": "sha256:00"}', "version 2 keys must be"),
        (b'{"version": 1, "claims": {}, "checksum": "x", "sequence": 1}', "1 keys must be"),
        (b'{"version": 2, "claims": {}, "checksum": "x", "sequence": 0}', "sequence must be"),
        (b'{"version": 2, "claims": {}, "checksum": "x", "sequence": "1"}', "sequence must be"),
        (b'{"version": 2, "claims": {}, "checksum": "x", "sequence": true}', "sequence must be"),
        (b'{"version": 2, "claims": {}, "checksum": "x", "sequence": 1.0}', "sequence must be"),
        (b'{"version": 1, "claims": {}, "checksum": 5}', "is not 'sha256:<64 hex digits>'"),
        (b'{"version": 1, "claims": {}, "checksum": "md5:abc"}', "is not 'sha256"),
    ],
)
def test_refused_documents(raw: bytes, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        decode(raw)


def test_wrong_checksum_is_refused() -> None:
    doc = json.loads(encode(sample(), 1))
    doc["claims"][UID_A]["cpus"] = "4-6"  # content changed, checksum kept
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        decode(json.dumps(doc).encode())


def test_every_flipped_byte_is_detected() -> None:
    raw = encode(sample(), 12)
    for index in range(len(raw) - 1):  # the final newline is whitespace
        for bit in (0x01, 0x20):
            tampered = bytearray(raw)
            tampered[index] ^= bit
            try:
                stored = decode(bytes(tampered))
            except CheckpointError:
                continue
            # Only a flip that keeps the same JSON content may pass (e.g. whitespace).
            assert stored == StoredCheckpoint(sample(), 12), (index, bit)


def test_every_truncation_is_detected() -> None:
    raw = encode(sample(), 1).rstrip(b"\n")
    for length in range(len(raw)):
        with pytest.raises(CheckpointError):
            decode(raw[:length])


def bad_claim(**changes: Any) -> bytes:
    doc = json.loads(encode(sample(), 1))
    claim = doc["claims"][UID_A]
    for key, value in changes.items():
        if value is KeyError:
            del claim[key]
        else:
            claim[key] = value
    return rewrite(doc)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"cpus": 5}, "cpus must be a cpuset string"),
        ({"cpus": "4-x"}, "claim .* cpus: invalid cpuset"),
        ({"cpus": "5-4"}, "ends before it starts"),
        ({"cpus": ""}, "holds no CPU"),
        ({"mems": [0]}, "mems must be a cpuset string"),
        ({"namespace": None}, "namespace must be a string"),
        ({"results": {}}, "results must be a list"),
        ({"results": [1]}, "result 0 must have keys"),
        ({"extra": 1}, "must have keys"),
        ({"name": KeyError}, "must have keys"),
        ({"podUids": "pod"}, "podUids must be a list of non-empty strings"),
        ({"podUids": [POD_1, 7]}, "podUids must be a list of non-empty strings"),
        ({"podUids": [""]}, "podUids must be a list of non-empty strings"),
        ({"podUids": [POD_1, POD_1]}, "lists a pod twice"),
    ],
)
def test_refused_claims(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        decode(bad_claim(**changes))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("consumedCpus", 0, "positive integer or null"),
        ("consumedCpus", -2, "positive integer or null"),
        ("consumedCpus", 1.5, "positive integer or null"),
        ("consumedCpus", True, "positive integer or null"),
        ("cpuset", "x", "cpuset: invalid cpuset"),
        ("device", 3, "device must be a string"),
    ],
)
def test_refused_results(field: str, value: object, message: str) -> None:
    doc = json.loads(encode(sample(), 1))
    doc["claims"][UID_A]["results"][0][field] = value
    with pytest.raises(CheckpointError, match=message):
        decode(rewrite(doc))


def test_overlapping_claims_are_refused() -> None:
    doc = json.loads(encode(sample(), 1))
    doc["claims"][UID_B]["cpus"] = "5,8"
    with pytest.raises(CheckpointError, match="cpus 5 that another claim holds"):
        decode(rewrite(doc))


def test_empty_uid_is_refused() -> None:
    doc = json.loads(encode(sample(), 1))
    doc["claims"][""] = doc["claims"].pop(UID_A)
    with pytest.raises(CheckpointError, match="empty UID"):
        decode(rewrite(doc))


def test_claims_object_must_be_an_object() -> None:
    doc = json.loads(encode(sample(), 1))
    doc["claims"] = []
    with pytest.raises(CheckpointError, match="'claims' must be an object"):
        decode(rewrite(doc))


_uids = st.uuids().map(str)
_cpus = st.frozensets(st.integers(0, 255), min_size=1, max_size=8).map(CpuSet)
_text = st.text(max_size=12)


# Generation slows down on a loaded machine (seven strategies per claim): not the code's time.
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        _uids,
        st.tuples(
            _cpus,
            _text,
            _text,
            st.none() | _cpus,
            st.lists(
                st.builds(
                    DeviceResult,
                    _text,
                    _text,
                    _text,
                    st.none() | st.integers(1, 64),
                    st.none() | _cpus,
                ),
                max_size=3,
            ),
            st.frozensets(st.text(min_size=1, max_size=12), max_size=3),
            st.frozensets(st.text(min_size=1, max_size=12), max_size=3),
        ),
        max_size=6,
    ),
    st.integers(1, 2**64),
)
def test_round_trip_property(
    raw: dict[
        str,
        tuple[CpuSet, str, str, CpuSet | None, list[DeviceResult], frozenset[str], frozenset[str]],
    ],
    sequence: int,
) -> None:
    claims: dict[str, PreparedClaim] = {}
    held = CpuSet()
    for uid, (cpus, ns, name, mems, results, pods, others) in raw.items():
        cpus = cpus - held  # claims are disjoint
        if not cpus:
            continue
        held |= cpus
        ordered = tuple(sorted(results, key=DeviceResult.sort_key))
        claims[uid] = PreparedClaim(
            uid, cpus, ns, name, mems, ordered, pods, pod_names=pods, copiers=others
        )
    data = CheckpointData(MappingProxyType(claims))
    stored = decode(encode(data, sequence))
    assert (dict(stored.data.claims), stored.sequence) == (claims, sequence)


@pytest.mark.parametrize("depth", [600, 990, 100_000])
def test_deeply_nested_checkpoint_is_a_checkpoint_error(depth: int) -> None:
    # json.loads raises RecursionError (not a ValueError) on deep nesting; the file adapter
    # moves aside a checkpoint only on CheckpointError, so anything else crash-looped the daemon.
    nested = b"[" * depth + b"]" * depth
    raw = b'{"version": 1, "checksum": "sha256:' + b"0" * 64 + b'", "claims": ' + nested + b"}"
    with pytest.raises(CheckpointError, match=r"nested too deeply|checksum mismatch"):
        decode(raw)
