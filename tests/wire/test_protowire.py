"""The protobuf field scanner left for the kubelet's DRA codec: varints, fields, groups, and
Google protobuf as a peer (on arbitrary bytes the scanner accepts exactly what upb accepts)."""

from __future__ import annotations

import pytest
from google.protobuf import timestamp_pb2
from google.protobuf.message import DecodeError
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dracpu.errors import LocalProtocolError, RemoteProtocolError
from dracpu.wire.protowire import (
    WIRE_LEN,
    WIRE_VARINT,
    decode_varint,
    encode_varint,
    scan_fields,
    skip_group,
)

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


# --- fields ----------------------------------------------------------------------------------


def test_fields_come_in_wire_order_with_their_spans() -> None:
    data = bytes.fromhex("0805 1203 616263 410102030405060708 5b 0801 5c 0896 01")
    assert scan_fields(data, 0, len(data)) == [
        (1, WIRE_VARINT, 5, 0),
        (2, WIRE_LEN, 4, 7),  # data[4:7] == b"abc"
        (1, WIRE_VARINT, 150, 0),  # fixed-size fields and groups are skipped
    ]


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
        bytes.fromhex("0a05 616263"),  # a field longer than the data
        bytes.fromhex("0a"),  # tag without value
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
def test_malformed_messages_are_the_peers_fault(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        scan_fields(data, 0, len(data))


# --- Google protobuf as an independent peer ---------------------------------------------------


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
                st.one_of(inner, st.binary(max_size=5), st.text(max_size=8).map(str.encode)),
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
def test_the_scanner_agrees_with_google_on_arbitrary_bytes(data: bytes) -> None:
    try:
        # Timestamp has two varint fields and no string (whose UTF-8 upb would check): what
        # it accepts depends on the wire structure only, as for the scanner.
        timestamp_pb2.Timestamp.FromString(data)
        expected = True
    except DecodeError:
        expected = False
    try:
        scan_fields(data, 0, len(data))
        got = True
    except RemoteProtocolError:
        got = False
    assert got == expected, data.hex()
