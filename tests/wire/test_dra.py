"""DRA kubelet-plugin codec: golden bytes, and Google protobuf as the independent peer.

The peer is Google's ``protobuf`` runtime (upb) with the DRA descriptors compiled from our
``proto/dra/v1`` and ``proto/dra/v1beta1/api.proto`` (:mod:`dracpu.sim._pb2`), which shares no
code with :mod:`dracpu.wire.dra`: what it encodes we must decode to the same claims, and what we
encode must equal its ``deterministic=True`` bytes, map entry order included.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from dracpu.errors import LocalProtocolError, RemoteProtocolError
from dracpu.sim._pb2.dra.v1 import api_pb2 as pb_v1
from dracpu.sim._pb2.dra.v1beta1 import api_pb2 as pb_v1beta1
from dracpu.wire import dra
from dracpu.wire.dra import ClaimRef, PreparedDevice, PrepareOutcome
from tests.wire.mutation import mutated

DECODERS = {
    "NodePrepareResourcesRequest": dra.decode_prepare_request,
    "NodeUnprepareResourcesRequest": dra.decode_unprepare_request,
}


def _peer_claims(message: Any) -> tuple[ClaimRef, ...]:
    return tuple(ClaimRef(c.namespace, c.uid, c.name) for c in message.claims)


# --- golden vectors -------------------------------------------------------------------------------


def test_one_claim_prepare_response_golden() -> None:
    outcome = PrepareOutcome(
        devices=(
            PreparedDevice(("cpu",), "node-a", "cpudevnuma000", ("dra.k8s.io/cpu=claim-u",), "s"),
        )
    )
    device = (
        b"\x0a\x03cpu"  # request_names (1)
        + b"\x12\x06node-a"  # pool_name (2)
        + b"\x1a\x0dcpudevnuma000"  # device_name (3)
        + b"\x22\x16dra.k8s.io/cpu=claim-u"  # cdi_device_ids (4)
    )
    share = b"\x2a\x01s"  # share_id (5), v1 only
    v1_value = b"\x0a" + bytes((len(device + share),)) + device + share  # devices (1)
    beta_value = b"\x0a" + bytes((len(device),)) + device
    # claims (1): one map entry {key (1): "u", value (2): NodePrepareResourceResponse}
    v1_entry = b"\x0a\x01u\x12" + bytes((len(v1_value),)) + v1_value
    beta_entry = b"\x0a\x01u\x12" + bytes((len(beta_value),)) + beta_value
    assert dra.encode_prepare_response({"u": outcome}) == (
        b"\x0a" + bytes((len(v1_entry),)) + v1_entry
    )
    assert dra.encode_prepare_response({"u": outcome}, share_ids=False) == (
        b"\x0a" + bytes((len(beta_entry),)) + beta_entry
    )


def test_unprepare_response_golden_writes_an_empty_value_message() -> None:
    # Entry "u": key then an EMPTY value message, still written (12 00); entry "v": error "no".
    golden = bytes.fromhex("0a05 0a0175 12000a09 0a0176 1204 0a026e6f")
    assert dra.encode_unprepare_response({"v": "no", "u": ""}) == golden


def test_empty_maps_and_empty_requests() -> None:
    assert dra.encode_prepare_response({}) == b""
    assert dra.encode_unprepare_response({}) == b""
    assert dra.decode_prepare_request(b"") == ()
    assert dra.decode_unprepare_request(b"") == ()


def test_one_claim_request_golden() -> None:
    data = bytes.fromhex("0a0d 0a026e73 120175 12017a 1a0163")  # uid "u", then uid "z" wins
    assert dra.decode_prepare_request(data) == (ClaimRef("ns", "z", "c"),)
    assert _peer_claims(pb_v1.NodePrepareResourcesRequest.FromString(data)) == (
        ClaimRef("ns", "z", "c"),
    )


# --- encoding: byte equality with Google protobuf -------------------------------------------------


def _peer_prepare(pb: Any, claims: dict[str, PrepareOutcome], share_ids: bool) -> bytes:
    message = pb.NodePrepareResourcesResponse()
    for uid, outcome in claims.items():
        entry = message.claims[uid]  # creates the entry, even for an empty outcome
        entry.error = outcome.error
        for device in outcome.devices:
            added = entry.devices.add(
                request_names=device.request_names,
                pool_name=device.pool_name,
                device_name=device.device_name,
                cdi_device_ids=device.cdi_device_ids,
            )
            if share_ids and device.share_id is not None:
                added.share_id = device.share_id
    data: bytes = message.SerializeToString(deterministic=True)
    return data


def _peer_unprepare(pb: Any, claims: dict[str, str]) -> bytes:
    message = pb.NodeUnprepareResourcesResponse()
    for uid, error in claims.items():
        message.claims[uid].error = error
    data: bytes = message.SerializeToString(deterministic=True)
    return data


def test_share_id_is_present_iff_set_even_when_empty() -> None:
    def one(share_id: str | None) -> dict[str, PrepareOutcome]:
        device = PreparedDevice(("cpu",), "p", "d", ("x/y=z",), share_id)
        return {"uid": PrepareOutcome(devices=(device,))}

    for share_id in (None, "", "share-1"):
        ours = dra.encode_prepare_response(one(share_id))
        assert ours == _peer_prepare(pb_v1, one(share_id), share_ids=True)
        parsed = pb_v1.NodePrepareResourcesResponse.FromString(ours)
        [device] = parsed.claims["uid"].devices
        assert device.HasField("share_id") == (share_id is not None)
        assert device.share_id == (share_id or "")
        # v1beta1 has no field 5: never written
        beta = dra.encode_prepare_response(one(share_id), share_ids=False)
        assert beta == _peer_prepare(pb_v1beta1, one(share_id), share_ids=False)
        assert b"\x2a" not in beta


def test_repeated_elements_are_written_even_when_empty() -> None:
    claims = {
        "a": PrepareOutcome(devices=(PreparedDevice(("", "b"), "", "", ("",)),), error="e"),
        "b": PrepareOutcome(devices=(PreparedDevice((), "", "", ()),) * 2),
        "c": PrepareOutcome(),
    }
    for pb, share_ids in ((pb_v1, True), (pb_v1beta1, False)):
        assert dra.encode_prepare_response(claims, share_ids=share_ids) == _peer_prepare(
            pb, claims, share_ids
        )
    parsed = pb_v1.NodePrepareResourcesResponse.FromString(dra.encode_prepare_response(claims))
    assert list(parsed.claims["a"].devices[0].request_names) == ["", "b"]
    assert len(parsed.claims["b"].devices) == 2
    assert "c" in parsed.claims


def test_map_entries_come_in_upbs_deterministic_order() -> None:
    # By UTF-8 bytes, except that a key comes after the longer keys it is a prefix of.
    keys = ["b", "", "a", "ab", "aa", "é", "a\U0001f600", "B", "ba"]
    ours = dra.encode_unprepare_response(dict.fromkeys(keys, ""))
    assert ours == _peer_unprepare(pb_v1, dict.fromkeys(keys, ""))
    order: list[str] = []
    pos = 0
    while pos < len(ours):  # entries: 0a <len> 0a <keylen> key 12 00 (all short here)
        entry = ours[pos + 2 : pos + 2 + ours[pos + 1]]
        order.append(entry[2 : 2 + entry[1]].decode())
        pos += 2 + ours[pos + 1]
    assert order == ["B", "aa", "ab", "a\U0001f600", "a", "ba", "b", "é", ""]
    # claim UIDs all have one length: plain byte order (Go's Deterministic order too)
    uids = [str(uuid.uuid4()) for _ in range(6)]
    expected = dra.encode_unprepare_response({uid: "" for uid in sorted(uids)})
    assert dra.encode_unprepare_response(dict.fromkeys(uids, "")) == expected


def test_unencodable_strings_are_our_error() -> None:
    with pytest.raises(LocalProtocolError, match="claims key"):
        dra.encode_unprepare_response({"\ud800": ""})
    with pytest.raises(LocalProtocolError, match=r"NodeUnprepareResourceResponse\.error"):
        dra.encode_unprepare_response({"u": "bad \udcff"})
    device = PreparedDevice(("cpu",), "pool", "dev", (), share_id="\ud800")
    with pytest.raises(LocalProtocolError, match=r"Device\.share_id"):
        dra.encode_prepare_response({"u": PrepareOutcome(devices=(device,))})
    # v1beta1 leaves share_id out: nothing to encode, no error
    assert dra.encode_prepare_response({"u": PrepareOutcome(devices=(device,))}, share_ids=False)


_text = st.text(max_size=10)
_device = st.builds(
    PreparedDevice,
    request_names=st.lists(_text, max_size=3).map(tuple),
    pool_name=_text,
    device_name=_text,
    cdi_device_ids=st.lists(_text, max_size=2).map(tuple),
    share_id=st.none() | _text,
)
_outcome = st.builds(
    PrepareOutcome, devices=st.lists(_device, max_size=3).map(tuple), error=st.just("") | _text
)
_keys = st.text(max_size=6) | st.uuids().map(str)


@settings(max_examples=80)
@given(st.dictionaries(_keys, _outcome, max_size=5))
def test_prepare_response_bytes_equal_protobuf(claims: dict[str, PrepareOutcome]) -> None:
    assert dra.encode_prepare_response(claims) == _peer_prepare(pb_v1, claims, True)
    beta = dra.encode_prepare_response(claims, share_ids=False)
    assert beta == _peer_prepare(pb_v1beta1, claims, False)


@settings(max_examples=80)
@given(st.dictionaries(_keys, st.just("") | _text, max_size=8))
def test_unprepare_response_bytes_equal_protobuf(claims: dict[str, str]) -> None:
    ours = dra.encode_unprepare_response(claims)
    assert ours == _peer_unprepare(pb_v1, claims)
    assert ours == _peer_unprepare(pb_v1beta1, claims)


# --- decoding ---------------------------------------------------------------------------------


_claim = st.builds(ClaimRef, _text, st.just("") | st.uuids().map(str) | _text, _text)


@settings(max_examples=80)
@given(st.lists(_claim, max_size=6))
def test_requests_from_protobuf_decode_to_the_same_claims(claims: list[ClaimRef]) -> None:
    for pb in (pb_v1, pb_v1beta1):
        wire = [pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        prepare = pb.NodePrepareResourcesRequest(claims=wire).SerializeToString()
        unprepare = pb.NodeUnprepareResourcesRequest(claims=wire).SerializeToString()
        assert dra.decode_prepare_request(prepare) == tuple(claims)
        assert dra.decode_unprepare_request(unprepare) == tuple(claims)


def test_concatenated_requests_append_claims_and_a_repeated_scalar_keeps_the_last() -> None:
    first = pb_v1.NodePrepareResourcesRequest(
        claims=[pb_v1.Claim(namespace="ns", uid="u1", name="a")]
    )
    second = pb_v1.NodePrepareResourcesRequest(claims=[pb_v1.Claim(uid="u2", name="b")])
    # one Claim whose uid and name occur twice: the last occurrence wins
    twice = bytes.fromhex("0a0c 120178 120179 1a0161 1a0162")
    data = first.SerializeToString() + second.SerializeToString() + twice
    expected = (ClaimRef("ns", "u1", "a"), ClaimRef("", "u2", "b"), ClaimRef("", "y", "b"))
    assert dra.decode_prepare_request(data) == expected
    assert _peer_claims(pb_v1.NodePrepareResourcesRequest.FromString(data)) == expected


def test_unknown_fields_and_known_fields_of_another_wire_type_are_skipped() -> None:
    claim = (
        bytes.fromhex("0a026e73")  # namespace "ns"
        + bytes.fromhex("10 2a")  # uid (2) as a varint: another wire type, skipped
        + bytes.fromhex("2201ff")  # unknown field 4, invalid UTF-8: not ours to check
        + bytes.fromhex("f8ff03 05")  # field 65535 varint (multi-byte tag)
        + bytes.fromhex("3d 01020304")  # field 7 fixed32
        + bytes.fromhex("41 0102030405060708")  # field 8 fixed64
        + bytes.fromhex("4b 0801 5b 0802 5c 4c")  # group 9 { 1: 1, group 11 { 1: 2 } }
        + bytes.fromhex("120175")  # uid "u"
        + bytes.fromhex("1d 00000000")  # name (3) as fixed32: skipped
    )
    request = (
        bytes.fromhex("08 07")  # claims (1) as a varint: skipped
        + bytes.fromhex("12 03 0a0178")  # unknown field 2, shaped like a Claim: skipped
        + b"\x0a"
        + bytes((len(claim),))
        + claim
        + bytes.fromhex("0b 0a00 0c")  # claims (1) as a group: skipped
    )
    expected = (ClaimRef("ns", "u", ""),)
    for name, decode in DECODERS.items():
        assert decode(request) == expected, name
        peer = getattr(pb_v1, name).FromString(request)
        assert _peer_claims(peer) == expected


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (bytes.fromhex("0a 05 12 03 6162"), "declares 5 bytes, 4 remain"),  # truncated claim
        (bytes.fromhex("0a 05 12 05 616263"), "declares 5 bytes, 3 remain"),  # uid overruns
        (bytes.fromhex("0a 01 12"), "truncated varint"),  # uid's length cut off
        (bytes.fromhex("0a"), "truncated varint"),  # tag alone
        (bytes.fromhex("0a ffffffffffffffffff7f"), "overflows 64 bits"),  # bad varint
        (bytes.fromhex("0a ffffffffffffffffffff01"), "overflows 64 bits"),  # 11 bytes
        (bytes.fromhex("0a ffffffff0f 00"), "declares 4294967295 bytes, 1 remain"),  # huge
        (bytes.fromhex("0a 03 0a 01 ff"), "Claim.namespace is not valid UTF-8"),
        (bytes.fromhex("0a 05 12 03 eda080"), "Claim.uid is not valid UTF-8"),  # a surrogate
        (bytes.fromhex("0a 03 1a 01 c3"), "Claim.name is not valid UTF-8"),  # cut sequence
        (bytes.fromhex("0e"), "bad wire type 6"),
        (bytes.fromhex("0a 01 0f"), "bad wire type 7"),  # inside a claim
        (bytes.fromhex("00"), "invalid field number 0"),
        (bytes.fromhex("0a 02 1d 01"), "truncated fixed"),
        (bytes.fromhex("0b 0801"), "not closed"),
        (bytes.fromhex("0b 14"), "does not match"),
        (bytes.fromhex("0c"), "bad wire type 4"),  # an end-group that opens nothing
        (bytes.fromhex("0a 01 10"), "truncated varint|overruns"),  # varint past the claim
    ],
)
def test_malformed_requests_are_the_kubelets_fault(data: bytes, match: str) -> None:
    for name, decode in DECODERS.items():
        with pytest.raises(RemoteProtocolError, match=match) as info:
            decode(data)
        assert str(info.value).startswith(f"malformed {name}: ")
        with pytest.raises(DecodeError):  # Google refuses every one of them as well ...
            getattr(pb_v1, name).FromString(data)


def test_a_tenth_varint_byte_above_one_is_refused_like_go() -> None:
    # Go's protowire refuses it (64-bit overflow); upb lets it through, truncated.
    data = bytes.fromhex("08 ffffffffffffffffff02")  # claims (1) as an overflowing varint
    with pytest.raises(RemoteProtocolError, match="overflows 64 bits"):
        dra.decode_prepare_request(data)
    assert _peer_claims(pb_v1.NodePrepareResourcesRequest.FromString(data)) == ()


@settings(max_examples=100)
@given(st.binary(max_size=48))
def test_arbitrary_bytes_decode_or_fail_cleanly(data: bytes) -> None:
    for decode in DECODERS.values():
        with contextlib.suppress(RemoteProtocolError):
            decode(data)


# Structured garbage: a valid two-claim request with unknown fields, then a few bytes
# overwritten, inserted or cut; random bytes alone rarely reach the nested Claim decoding.
_SEED = pb_v1.NodePrepareResourcesRequest(
    claims=[
        pb_v1.Claim(namespace="default", uid=str(uuid.UUID(int=7)), name="pod-cpus"),
        pb_v1.Claim(namespace="ns", uid="u2", name="b"),
    ]
).SerializeToString() + bytes.fromhex("10 01 1a 02 0a00")


@settings(max_examples=300)
@given(mutated(_SEED))
def test_mutated_requests_decode_exactly_like_protobuf(data: bytes) -> None:
    # Every field of a Claim is one we read: the verdicts must agree both ways (but for the
    # overflowing 10-byte varint upb tolerates, see above).
    for name, decode in DECODERS.items():
        try:
            peer = _peer_claims(getattr(pb_v1, name).FromString(data))
        except DecodeError:
            with pytest.raises(RemoteProtocolError):
                decode(data)
            continue
        ours: tuple[ClaimRef, ...] | str
        try:
            ours = decode(data)
        except RemoteProtocolError as exc:
            ours = str(exc)
        if isinstance(ours, str):
            assert "overflows 64 bits" in ours
        else:
            assert ours == peer
