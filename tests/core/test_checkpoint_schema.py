from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dracpu.core.checkpoint_schema import (
    CHECKPOINT_VERSION,
    CheckpointData,
    PreparedClaim,
    decode,
    encode,
)
from dracpu.core.commands import DeviceResult
from dracpu.core.cpuset import CpuSet
from dracpu.errors import CheckpointError

__all__: list[str] = []

UID_A = "0b5a1a2e-9f4c-4c1e-8d3a-000000000001"
UID_B = "0b5a1a2e-9f4c-4c1e-8d3a-000000000002"


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
                ),
                UID_B: PreparedClaim(
                    UID_B,
                    CpuSet.parse("8,12"),
                    "team",
                    "claim-b",
                    None,
                    (
                        DeviceResult("a", "node-1", "cpudev003"),
                        DeviceResult("b", "node-1", "cpudevmachine", 1, CpuSet.parse("12")),
                    ),
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


def test_round_trip_keeps_every_field() -> None:
    data = sample()
    assert dict(decode(encode(data)).claims) == dict(data.claims)


def test_empty_round_trip() -> None:
    raw = encode(CheckpointData())
    assert dict(decode(raw).claims) == {}
    doc = json.loads(raw)
    assert doc["version"] == CHECKPOINT_VERSION == 1
    assert doc["claims"] == {}


def test_layout_is_the_documented_one() -> None:
    doc = json.loads(encode(sample()))
    assert set(doc) == {"version", "checksum", "claims"}
    assert doc["checksum"].startswith("sha256:")
    assert doc["claims"][UID_A] == {
        "cpus": "4-5",
        "mems": "0",
        "namespace": "default",
        "name": "claim-a",
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
    assert doc["claims"][UID_B]["results"][1]["cpuset"] == "12"


def test_checksum_is_sha256_of_canonical_payload() -> None:
    raw = encode(sample())
    doc = json.loads(raw)
    checksum = doc.pop("checksum")
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert checksum == "sha256:" + hashlib.sha256(canonical).hexdigest()


def test_encoding_is_deterministic() -> None:
    assert encode(sample()) == encode(sample())


def test_encoding_is_canonical_json() -> None:
    raw = encode(sample())
    canonical = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    assert raw == canonical + b"\n"


def test_encoding_follows_changes_of_shared_claims() -> None:
    first = sample()
    claims = dict(first.claims)
    claims[UID_B] = replace(claims[UID_B], cpus=CpuSet.parse("9"))
    second = CheckpointData(MappingProxyType(claims))
    assert decode(encode(first)).claims[UID_B].cpus == CpuSet.parse("8,12")
    assert decode(encode(second)).claims[UID_B].cpus == CpuSet.parse("9")
    assert decode(encode(first)).claims[UID_A] == decode(encode(second)).claims[UID_A]


def test_whitespace_changes_do_not_break_the_checksum() -> None:
    doc = json.loads(encode(sample()))
    pretty = json.dumps(doc, indent=4).encode()
    assert dict(decode(pretty).claims) == dict(sample().claims)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "not valid JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b"{", "not valid JSON"),
        (b"[]", "must be a JSON object"),
        (b'{"claims": {}}', "no integer 'version'"),
        (b'{"version": "1", "claims": {}}', "no integer 'version'"),
        (b'{"version": 2, "claims": {}, "checksum": "sha256:00"}', "version 2 is unknown"),
        (b'{"version": 1, "claims": {}}', "keys must be"),
        (b'{"version": 1, "claims": {}, "checksum": 5}', "is not 'sha256:<64 hex digits>'"),
        (b'{"version": 1, "claims": {}, "checksum": "md5:abc"}', "is not 'sha256"),
    ],
)
def test_refused_documents(raw: bytes, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        decode(raw)


def test_wrong_checksum_is_refused() -> None:
    doc = json.loads(encode(sample()))
    doc["claims"][UID_A]["cpus"] = "4-6"  # content changed, checksum kept
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        decode(json.dumps(doc).encode())


def test_every_flipped_byte_is_detected() -> None:
    raw = encode(sample())
    for index in range(len(raw) - 1):  # the final newline is whitespace
        for bit in (0x01, 0x20):
            tampered = bytearray(raw)
            tampered[index] ^= bit
            try:
                data = decode(bytes(tampered))
            except CheckpointError:
                continue
            # Only a flip that keeps the same JSON content may pass (e.g. whitespace).
            assert dict(data.claims) == dict(sample().claims), (index, bit)


def test_every_truncation_is_detected() -> None:
    raw = encode(sample()).rstrip(b"\n")
    for length in range(len(raw)):
        with pytest.raises(CheckpointError):
            decode(raw[:length])


def bad_claim(**changes: Any) -> bytes:
    doc = json.loads(encode(sample()))
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
    doc = json.loads(encode(sample()))
    doc["claims"][UID_A]["results"][0][field] = value
    with pytest.raises(CheckpointError, match=message):
        decode(rewrite(doc))


def test_overlapping_claims_are_refused() -> None:
    doc = json.loads(encode(sample()))
    doc["claims"][UID_B]["cpus"] = "5,8"
    with pytest.raises(CheckpointError, match="cpus 5 that another claim holds"):
        decode(rewrite(doc))


def test_empty_uid_is_refused() -> None:
    doc = json.loads(encode(sample()))
    doc["claims"][""] = doc["claims"].pop(UID_A)
    with pytest.raises(CheckpointError, match="empty UID"):
        decode(rewrite(doc))


def test_claims_object_must_be_an_object() -> None:
    doc = json.loads(encode(sample()))
    doc["claims"] = []
    with pytest.raises(CheckpointError, match="'claims' must be an object"):
        decode(rewrite(doc))


_uids = st.uuids().map(str)
_cpus = st.frozensets(st.integers(0, 255), min_size=1, max_size=8).map(CpuSet)
_text = st.text(max_size=12)


@settings(max_examples=60)
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
        ),
        max_size=6,
    )
)
def test_round_trip_property(
    raw: dict[str, tuple[CpuSet, str, str, CpuSet | None, list[DeviceResult]]],
) -> None:
    claims: dict[str, PreparedClaim] = {}
    held = CpuSet()
    for uid, (cpus, ns, name, mems, results) in raw.items():
        cpus = cpus - held  # claims are disjoint
        if not cpus:
            continue
        held |= cpus
        ordered = tuple(sorted(results, key=DeviceResult.sort_key))
        claims[uid] = PreparedClaim(uid, cpus, ns, name, mems, ordered)
    data = CheckpointData(MappingProxyType(claims))
    assert dict(decode(encode(data)).claims) == claims


@pytest.mark.parametrize("depth", [600, 990, 100_000])
def test_deeply_nested_checkpoint_is_a_checkpoint_error(depth: int) -> None:
    # json.loads raises RecursionError (not a ValueError) on deep nesting; the file adapter
    # moves aside a checkpoint only on CheckpointError, so anything else crash-looped the daemon.
    nested = b"[" * depth + b"]" * depth
    raw = b'{"version": 1, "checksum": "sha256:' + b"0" * 64 + b'", "claims": ' + nested + b"}"
    with pytest.raises(CheckpointError, match=r"nested too deeply|checksum mismatch"):
        decode(raw)
