"""ttrpc envelope encoding: golden bytes, decoder edge cases, and Google protobuf as a peer.

The peer is Google's ``protobuf`` runtime (upb), given ``ttrpc.Request``/``Response`` and
``google.rpc.Status`` descriptors built here from their field numbers (containerd/ttrpc
``request.proto``, googleapis ``google/rpc/status.proto``): it shares no code with ours.
"""

from __future__ import annotations

import base64
import functools
from typing import Any

import pytest
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import DecodeError, Message
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dracpu.errors import LocalProtocolError, RemoteProtocolError
from dracpu.wire.protowire import (
    RequestEnvelope,
    ResponseEnvelope,
    decode_request,
    decode_response,
    decode_varint,
    encode_request,
    encode_response,
    encode_varint,
    skip_group,
    to_int32,
    to_int64,
)

# --- golden vectors (reference/nri-ttrpc-cdi.md §4) --------------------------------------------

# containerd/ttrpc-rust src/proto.rs PROTOBUF_REQUEST (67 bytes), quoted in §4.1.
RUST_REQUEST = bytes(
    [
        10, 17, 103, 114, 112, 99, 46, 84, 101, 115, 116, 83, 101, 114, 118, 105, 99, 101, 115, 18,
        4, 84, 101, 115, 116, 26, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 32, 128, 218, 196, 9, 42, 24, 10,
        9, 116, 101, 115, 116, 95, 107, 101, 121, 49, 18, 11, 116, 101, 115, 116, 95, 118, 97, 108,
        117, 101, 49,
    ]
)  # fmt: skip
RUST_REQUEST_ENVELOPE = RequestEnvelope(
    "grpc.TestServices", "Test", bytes(range(1, 10)), 20_000_000, (("test_key1", "test_value1"),)
)

REGISTER_PLUGIN = bytes.fromhex("0a07 6472612d637075 1202 3930")  # §4.2 RegisterPluginRequest
REGISTER_REQUEST = bytes.fromhex(
    "0a1c 6e72692e706b672e6170692e7631616c706861312e52756e74696d65"
    "120e 5265676973746572506c7567696e"
    "1a0d 0a076472612d637075120239 30"
    "2080e497d012"
)
REQUEST_TABLE = [
    (RUST_REQUEST_ENVELOPE, RUST_REQUEST),
    (
        RequestEnvelope(
            "nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin", REGISTER_PLUGIN, 5_000_000_000
        ),
        REGISTER_REQUEST,
    ),
    (RequestEnvelope(), b""),
    (RequestEnvelope(timeout_nano=-1), bytes.fromhex("20 ffffffffffffffffff01")),
    (RequestEnvelope(metadata=(("", ""),)), bytes.fromhex("2a00")),
]

RESPONSE_TABLE = [
    # Go's OK reply to an Empty-returning call: no status, no payload, 0 bytes.
    (ResponseEnvelope(), b""),
    # ConfigureResponse{events: 0x688} as payload.
    (ResponseEnvelope(payload=bytes.fromhex("10880d")), bytes.fromhex("1203 10880d")),
    # CreateContainerResponse{adjust{linux{resources{cpu{cpus:"2-3"}}}}} as payload.
    (
        ResponseEnvelope(payload=bytes.fromhex("0a0b320912071205320332 2d33")),
        bytes.fromhex("120d 0a0b3209120712053203322d33"),
    ),
    (ResponseEnvelope(2, "boom"), bytes.fromhex("0a08 0802 1204626f6f6d")),
    (ResponseEnvelope(12, "method Foo"), bytes.fromhex("0a0e 080c 120a6d6574686f6420466f6f")),
    (ResponseEnvelope(-1, ""), bytes.fromhex("0a0b 08ffffffffffffffffff01")),
]


@pytest.mark.parametrize(("envelope", "data"), REQUEST_TABLE)
def test_request_golden_both_ways(envelope: RequestEnvelope, data: bytes) -> None:
    assert encode_request(**_fields_of(envelope)) == data
    assert decode_request(data) == envelope


@pytest.mark.parametrize(("envelope", "data"), RESPONSE_TABLE)
def test_response_golden_both_ways(envelope: ResponseEnvelope, data: bytes) -> None:
    assert encode_response(envelope.payload, envelope.status_code, envelope.status_message) == data
    assert decode_response(data) == envelope


def _fields_of(envelope: RequestEnvelope) -> dict[str, Any]:
    return {
        "service": envelope.service,
        "method": envelope.method,
        "payload": envelope.payload,
        "timeout_nano": envelope.timeout_nano,
        "metadata": envelope.metadata,
    }


# --- varints -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "data"),
    [
        (0, b"\x00"),
        (1, b"\x01"),
        (127, b"\x7f"),
        (128, b"\x80\x01"),
        (300, b"\xac\x02"),
        (5_000_000_000, bytes.fromhex("80e497d012")),
        ((1 << 64) - 1, bytes.fromhex("ffffffffffffffffff01")),
    ],
)
def test_varint_table(value: int, data: bytes) -> None:
    assert encode_varint(value) == data
    assert decode_varint(data + b"\x99", 0) == (value, len(data))


@pytest.mark.parametrize("value", [-1, 1 << 64])
def test_varint_out_of_range_is_our_fault(value: int) -> None:
    with pytest.raises(LocalProtocolError):
        encode_varint(value)


@pytest.mark.parametrize(
    "data",
    [
        b"",  # nothing
        b"\x80",  # continuation without an end
        bytes.fromhex("ffffffffffffffffff02"),  # 10th byte > 1: over 64 bits (Go errors)
        bytes.fromhex("ffffffffffffffffffff01"),  # 11 bytes
    ],
)
def test_bad_varint_is_peers_fault(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_varint(data, 0)


@given(st.integers(0, (1 << 64) - 1))
def test_varint_round_trip(value: int) -> None:
    data = encode_varint(value)
    assert decode_varint(data, 0) == (value, len(data))


# --- decoder leniency and strictness, as Go's proto.Unmarshal ---------------------------------


def test_unknown_fields_and_mismatched_wire_types_are_skipped() -> None:
    data = (
        bytes.fromhex("3801")  # field 7 varint
        + bytes.fromhex("410102030405060708")  # field 8 fixed64
        + bytes.fromhex("4d01020304")  # field 9 fixed32
        + bytes.fromhex("5203616263")  # field 10 bytes
        + bytes.fromhex("5b 0801 63 1a00 64 5c")  # field 11 group, nested group 12 inside
        + bytes.fromhex("0805")  # service (field 1) as a varint: wrong wire type, unknown
        + bytes.fromhex("1204 54657374")  # method "Test"
        + bytes.fromhex("2103000000 00000000")  # timeout_nano as fixed64: unknown
    )
    assert decode_request(data) == RequestEnvelope(method="Test")


def test_last_scalar_wins_and_status_fields_merge() -> None:
    data = bytes.fromhex("0a020803 1201aa 0a05 1203 6f6f70 1201bb")
    # status{code:3} + payload aa + status{message:"oop"} + payload bb
    assert decode_response(data) == ResponseEnvelope(3, "oop", b"\xbb")


def test_status_details_are_validated_and_dropped() -> None:
    detail = bytes.fromhex("0a03 782f79 1201 00")  # Any{type_url:"x/y", value:00}
    data = bytes.fromhex("0a") + bytes([4 + len(detail)]) + bytes.fromhex("0809 1a")
    data += bytes([len(detail)]) + detail
    assert decode_response(data) == ResponseEnvelope(9, "", b"")


def test_int32_code_keeps_low_32_bits_like_go() -> None:
    # code = 2^32 + 5 on the wire: Go's int32(v) and upb both read 5.
    data = bytes.fromhex("0a06 0885808080 10")
    assert decode_response(data).status_code == 5


@pytest.mark.parametrize(
    ("value", "int64", "int32"),
    [
        (0, 0, 0),
        (5, 5, 5),
        ((1 << 31) - 1, (1 << 31) - 1, (1 << 31) - 1),
        (1 << 31, 1 << 31, -(1 << 31)),
        ((1 << 63) - 1, (1 << 63) - 1, -1),
        (1 << 63, -(1 << 63), 0),
        ((1 << 64) - 1, -1, -1),
        ((1 << 64) - 5, -5, -5),
    ],
)
def test_signed_varints_read_as_go_does(value: int, int64: int, int32: int) -> None:
    assert to_int64(value) == int64
    assert to_int32(value) == int32


def test_skip_group_stays_inside_its_message() -> None:
    # group 11 { 1: 1, group 12 { 3: "" } } then field 1: 2
    data = bytes.fromhex("5b 0801 63 1a00 64 5c 0802")
    assert skip_group(data, 1, len(data), 11) == 8
    assert skip_group(data, 1, 8, 11) == 8
    for end in range(1, 8):  # the enclosing message ends inside the group
        with pytest.raises(RemoteProtocolError, match=r"not closed|overruns"):
            skip_group(data, 1, end, 11)
    with pytest.raises(RemoteProtocolError, match="does not match"):
        skip_group(bytes.fromhex("5b 64"), 1, 2, 11)


@pytest.mark.parametrize(
    "data",
    [
        bytes.fromhex("0a05 616263"),  # string longer than the data
        bytes.fromhex("0a"),  # tag without value
        bytes.fromhex("0a02 c328"),  # invalid UTF-8 in service
        bytes.fromhex("2a04 0a02c328"),  # invalid UTF-8 in a metadata key
        bytes.fromhex("0001"),  # field number 0
        bytes.fromhex("0e"),  # wire type 6
        bytes.fromhex("5b 0801"),  # group never closed
        bytes.fromhex("5b 64"),  # group closed by another field's end
        bytes.fromhex("5c"),  # group end without a start
        bytes.fromhex("41 0102"),  # truncated fixed64
        bytes.fromhex("4d 01"),  # truncated fixed32
        bytes.fromhex("5b") * 101 + bytes.fromhex("5c") * 101,  # groups nested too deeply
    ],
)
def test_malformed_request_is_peers_fault(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_request(data)


@pytest.mark.parametrize(
    "data",
    [
        bytes.fromhex("0a04 1202c328"),  # invalid UTF-8 in Status.message
        bytes.fromhex("0a06 1a04 0a02c328"),  # invalid UTF-8 in Any.type_url
        bytes.fromhex("0a03 0880"),  # truncated varint inside status
        bytes.fromhex("1205 00"),  # payload longer than the data
    ],
)
def test_malformed_response_is_peers_fault(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_response(data)


def test_unencodable_values_are_our_fault() -> None:
    with pytest.raises(LocalProtocolError):
        encode_request("svc", "m", b"", timeout_nano=1 << 63)
    with pytest.raises(LocalProtocolError):
        encode_request("\ud800", "m", b"")
    with pytest.raises(LocalProtocolError):
        encode_request("s", "m", b"", metadata=[("k", "\udfff")])
    with pytest.raises(LocalProtocolError):
        encode_response(b"", 1 << 31, "x")
    with pytest.raises(LocalProtocolError):
        encode_response(b"", 1, "\ud800")


# --- Google protobuf as an independent peer ---------------------------------------------------

_F = descriptor_pb2.FieldDescriptorProto


@functools.cache
def _google_classes() -> tuple[type[Message], type[Message]]:
    """``ttrpc.Request`` and ``ttrpc.Response`` classes from descriptors built here."""
    pool = descriptor_pool.DescriptorPool()
    any_file = descriptor_pb2.FileDescriptorProto()
    any_pb2.DESCRIPTOR.CopyToProto(any_file)
    pool.Add(any_file)

    status_file = descriptor_pb2.FileDescriptorProto(
        name="google/rpc/status.proto",
        package="google.rpc",
        syntax="proto3",
        dependency=["google/protobuf/any.proto"],
    )
    status = status_file.message_type.add(name="Status")
    status.field.add(name="code", number=1, type=_F.TYPE_INT32, label=_F.LABEL_OPTIONAL)
    status.field.add(name="message", number=2, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    status.field.add(
        name="details",
        number=3,
        type=_F.TYPE_MESSAGE,
        label=_F.LABEL_REPEATED,
        type_name=".google.protobuf.Any",
    )
    pool.Add(status_file)

    ttrpc_file = descriptor_pb2.FileDescriptorProto(
        name="github.com/containerd/ttrpc/request.proto",
        package="ttrpc",
        syntax="proto3",
        dependency=["google/rpc/status.proto"],
    )
    request = ttrpc_file.message_type.add(name="Request")
    request.field.add(name="service", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    request.field.add(name="method", number=2, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    request.field.add(name="payload", number=3, type=_F.TYPE_BYTES, label=_F.LABEL_OPTIONAL)
    request.field.add(name="timeout_nano", number=4, type=_F.TYPE_INT64, label=_F.LABEL_OPTIONAL)
    request.field.add(
        name="metadata",
        number=5,
        type=_F.TYPE_MESSAGE,
        label=_F.LABEL_REPEATED,
        type_name=".ttrpc.KeyValue",
    )
    response = ttrpc_file.message_type.add(name="Response")
    response.field.add(
        name="status",
        number=1,
        type=_F.TYPE_MESSAGE,
        label=_F.LABEL_OPTIONAL,
        type_name=".google.rpc.Status",
    )
    response.field.add(name="payload", number=2, type=_F.TYPE_BYTES, label=_F.LABEL_OPTIONAL)
    key_value = ttrpc_file.message_type.add(name="KeyValue")
    key_value.field.add(name="key", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    key_value.field.add(name="value", number=2, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    pool.Add(ttrpc_file)

    return (
        message_factory.GetMessageClass(pool.FindMessageTypeByName("ttrpc.Request")),
        message_factory.GetMessageClass(pool.FindMessageTypeByName("ttrpc.Response")),
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def google_request(envelope: RequestEnvelope) -> Message:
    request_cls, _ = _google_classes()
    as_dict = {
        "service": envelope.service,
        "method": envelope.method,
        "payload": _b64(envelope.payload),
        "timeout_nano": str(envelope.timeout_nano),
        "metadata": [{"key": k, "value": v} for k, v in envelope.metadata],
    }
    return json_format.ParseDict(as_dict, request_cls())


def google_response(envelope: ResponseEnvelope) -> Message:
    _, response_cls = _google_classes()
    as_dict: dict[str, Any] = {"payload": _b64(envelope.payload)}
    if envelope.status_code or envelope.status_message:
        as_dict["status"] = {"code": envelope.status_code, "message": envelope.status_message}
    return json_format.ParseDict(as_dict, response_cls())


def request_from_google(message: Message) -> RequestEnvelope:
    d = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return RequestEnvelope(
        d.get("service", ""),
        d.get("method", ""),
        base64.b64decode(d.get("payload", "")),
        int(d.get("timeout_nano", "0")),
        tuple((kv.get("key", ""), kv.get("value", "")) for kv in d.get("metadata", [])),
    )


def response_from_google(message: Message) -> ResponseEnvelope:
    d = json_format.MessageToDict(message, preserving_proto_field_name=True)
    status = d.get("status", {})
    return ResponseEnvelope(
        status.get("code", 0), status.get("message", ""), base64.b64decode(d.get("payload", ""))
    )


texts = st.text(max_size=40)
request_envelopes = st.builds(
    RequestEnvelope,
    texts,
    texts,
    st.binary(max_size=300),
    st.integers(-(1 << 63), (1 << 63) - 1),
    st.lists(st.tuples(texts, texts), max_size=3).map(tuple),
)
response_envelopes = st.builds(
    ResponseEnvelope, st.integers(-(1 << 31), (1 << 31) - 1), texts, st.binary(max_size=300)
)


@pytest.mark.parametrize(("envelope", "data"), REQUEST_TABLE)
def test_google_serializes_golden_requests_identically(
    envelope: RequestEnvelope, data: bytes
) -> None:
    assert google_request(envelope).SerializeToString(deterministic=True) == data


@pytest.mark.parametrize(("envelope", "data"), RESPONSE_TABLE)
def test_google_serializes_golden_responses_identically(
    envelope: ResponseEnvelope, data: bytes
) -> None:
    assert google_response(envelope).SerializeToString(deterministic=True) == data


@settings(max_examples=300)
@given(request_envelopes)
def test_request_bytes_equal_google_and_parse_both_ways(envelope: RequestEnvelope) -> None:
    ours = encode_request(**_fields_of(envelope))
    theirs = google_request(envelope).SerializeToString(deterministic=True)
    assert ours == theirs
    request_cls, _ = _google_classes()
    assert request_from_google(request_cls.FromString(ours)) == envelope
    assert decode_request(theirs) == envelope


@settings(max_examples=300)
@given(response_envelopes)
def test_response_bytes_equal_google_and_parse_both_ways(envelope: ResponseEnvelope) -> None:
    ours = encode_response(envelope.payload, envelope.status_code, envelope.status_message)
    theirs = google_response(envelope).SerializeToString(deterministic=True)
    assert ours == theirs
    _, response_cls = _google_classes()
    assert response_from_google(response_cls.FromString(ours)) == envelope
    assert decode_response(theirs) == envelope


# Differential decoding: on arbitrary bytes, we accept exactly what upb accepts, with the same
# values. Tags of the known fields with every wire type, plus junk, make the input interesting.
_TAGS = [bytes([(field << 3) | wire]) for field in range(1, 7) for wire in range(6)]
wire_soup = st.lists(
    st.one_of(
        st.sampled_from(_TAGS),
        st.binary(max_size=4),
        st.integers(0, 12).map(lambda n: bytes([n])),
        st.sampled_from([b"\x0a\x00", b"\x08\x96\x01", b"\x12\x02hi", b"\xc3\x28", b"\x80"]),
    ),
    max_size=12,
).map(b"".join)


def _field(number: int, wire_type: int, body: bytes | int) -> bytes:
    tag = encode_varint((number << 3) | wire_type)
    if isinstance(body, int):
        return tag + encode_varint(body)
    if wire_type == 2:
        return tag + encode_varint(len(body)) + body
    return tag + body


# Well-formed messages with random field numbers, wire types and nesting: mostly accepted.
well_formed = st.recursive(
    st.just(b""),
    lambda inner: st.lists(
        st.one_of(
            st.builds(_field, st.integers(1, 6), st.just(0), st.integers(0, (1 << 64) - 1)),
            st.builds(
                _field,
                st.integers(1, 6),
                st.just(2),
                st.one_of(inner, st.binary(max_size=5), texts.map(str.encode)),
            ),
            st.builds(_field, st.integers(1, 6), st.just(1), st.binary(min_size=8, max_size=8)),
            st.builds(_field, st.integers(1, 6), st.just(5), st.binary(min_size=4, max_size=4)),
            st.builds(lambda n, b: _field(n, 3, b) + _field(n, 4, b""), st.integers(7, 9), inner),
        ),
        max_size=6,
    ).map(b"".join),
    max_leaves=12,
)


@settings(max_examples=500)
@given(st.one_of(wire_soup, well_formed))
@example(bytes.fromhex("0a03 0880"))
@example(bytes.fromhex("0a02 1a00"))
def test_decoders_agree_with_google_on_arbitrary_bytes(data: bytes) -> None:
    request_cls, response_cls = _google_classes()
    for cls, decode, convert in (
        (request_cls, decode_request, request_from_google),
        (response_cls, decode_response, response_from_google),
    ):
        try:
            expected: object = convert(cls.FromString(data))
        except DecodeError:
            expected = RemoteProtocolError
        try:
            got: object = decode(data)
        except RemoteProtocolError:
            got = RemoteProtocolError
        assert got == expected, (cls.__name__, data.hex())
