"""The ttrpc envelopes through Google's protobuf runtime: the bytes Go's ttrpc writes, what Go's
``proto.Unmarshal`` accepts, and whose fault an error is.

Golden vectors are containerd/ttrpc-rust's (``src/proto.rs``) and the frames containerd/nri's Go
plugin stub sends; the framing around them is tested in tests/wire (test_ttrpc, test_stack).
"""

from __future__ import annotations

import pytest

from dracpu.adapters.ttrpc_envelopes import (
    Answer,
    Call,
    read_request,
    read_response,
    request_data,
    response_data,
)
from dracpu.errors import LocalProtocolError, RemoteProtocolError
from dracpu.wire.events import TtrpcRequest, TtrpcResponse

# --- golden vectors ------------------------------------------------------------------------------

# containerd/ttrpc-rust src/proto.rs PROTOBUF_REQUEST (67 bytes).
RUST_REQUEST = bytes(
    [
        10, 17, 103, 114, 112, 99, 46, 84, 101, 115, 116, 83, 101, 114, 118, 105, 99, 101, 115, 18,
        4, 84, 101, 115, 116, 26, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 32, 128, 218, 196, 9, 42, 24, 10,
        9, 116, 101, 115, 116, 95, 107, 101, 121, 49, 18, 11, 116, 101, 115, 116, 95, 118, 97, 108,
        117, 101, 49,
    ]
)  # fmt: skip
RUST_REQUEST_CALL = Call(
    1, "grpc.TestServices", "Test", bytes(range(1, 10)), 20_000_000, (("test_key1", "test_value1"),)
)

REGISTER_PLUGIN = bytes.fromhex(
    "0a07 6472612d637075 1202 3930"
)  # RegisterPluginRequest{dra-cpu, 90}
REGISTER_REQUEST = bytes.fromhex(
    "0a1c 6e72692e706b672e6170692e7631616c706861312e52756e74696d65"
    "120e 5265676973746572506c7567696e"
    "1a0d 0a076472612d637075120239 30"
    "2080e497d012"
)
REQUEST_TABLE = [
    (RUST_REQUEST_CALL, RUST_REQUEST),
    (
        Call(1, "nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin", REGISTER_PLUGIN, 5_000_000_000),
        REGISTER_REQUEST,
    ),
    (Call(1, "", "", b""), b""),
    (Call(1, "", "", b"", timeout_nano=-1), bytes.fromhex("20 ffffffffffffffffff01")),
    (Call(1, "", "", b"", metadata=(("", ""),)), bytes.fromhex("2a00")),
]

RESPONSE_TABLE = [
    # Go's OK reply to an Empty-returning call: no status, no payload, 0 bytes.
    (Answer(1, 0, "", b""), b""),
    # ConfigureResponse{events: 0x688} as payload.
    (Answer(1, 0, "", bytes.fromhex("10880d")), bytes.fromhex("1203 10880d")),
    # CreateContainerResponse{adjust{linux{resources{cpu{cpus:"2-3"}}}}} as payload.
    (
        Answer(1, 0, "", bytes.fromhex("0a0b320912071205320332 2d33")),
        bytes.fromhex("120d 0a0b3209120712053203322d33"),
    ),
    (Answer(1, 2, "boom", b""), bytes.fromhex("0a08 0802 1204626f6f6d")),
    (Answer(1, 12, "method Foo", b""), bytes.fromhex("0a0e 080c 120a6d6574686f6420466f6f")),
    (Answer(1, -1, "", b""), bytes.fromhex("0a0b 08ffffffffffffffffff01")),
]


@pytest.mark.parametrize(("call", "data"), REQUEST_TABLE)
def test_request_golden_both_ways(call: Call, data: bytes) -> None:
    encoded = request_data(call.service, call.method, call.payload,
                           call.timeout_nano, call.metadata)  # fmt: skip
    assert encoded == data
    assert read_request(TtrpcRequest(1, data)) == call


@pytest.mark.parametrize(("answer", "data"), RESPONSE_TABLE)
def test_response_golden_both_ways(answer: Answer, data: bytes) -> None:
    assert response_data(answer.payload, answer.status_code, answer.status_message) == data
    assert read_response(TtrpcResponse(1, data)) == answer


# --- decoding as Go's proto.Unmarshal does ----------------------------------------------------


def test_unknown_fields_and_mismatched_wire_types_are_skipped() -> None:
    data = (
        bytes.fromhex("3801")  # field 7 varint
        + bytes.fromhex("410102030405060708")  # field 8 fixed64
        + bytes.fromhex("4d01020304")  # field 9 fixed32
        + bytes.fromhex("5203616263")  # field 10 bytes
        + bytes.fromhex("5b 0801 63 1a00 64 5c")  # field 11 group, nested group 12 inside
        + bytes.fromhex("1204 54657374")  # method "Test"
    )
    assert read_request(TtrpcRequest(3, data)) == Call(3, "", "Test", b"")


def test_last_scalar_wins_and_status_fields_merge() -> None:
    data = bytes.fromhex("0a020803 1201aa 0a05 1203 6f6f70 1201bb")
    # status{code:3} + payload aa + status{message:"oop"} + payload bb
    assert read_response(TtrpcResponse(5, data)) == Answer(5, 3, "oop", b"\xbb")


def test_status_details_are_read_and_dropped() -> None:
    detail = bytes.fromhex("0a03 782f79 1201 00")  # Any{type_url:"x/y", value:00}
    data = bytes.fromhex("0a") + bytes([4 + len(detail)]) + bytes.fromhex("0809 1a")
    data += bytes([len(detail)]) + detail
    assert read_response(TtrpcResponse(1, data)) == Answer(1, 9, "", b"")


def test_int32_code_keeps_low_32_bits_like_go() -> None:
    # code = 2^32 + 5 on the wire: Go's int32(v) and upb both read 5.
    data = bytes.fromhex("0a06 0885808080 10")
    assert read_response(TtrpcResponse(1, data)).status_code == 5


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
    ],
)
def test_malformed_request_is_the_peers_fault(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="unmarshal request error"):
        read_request(TtrpcRequest(1, data))


@pytest.mark.parametrize(
    "data",
    [
        bytes.fromhex("0a04 1202c328"),  # invalid UTF-8 in Status.message
        bytes.fromhex("0a03 0880"),  # truncated varint inside status
        bytes.fromhex("1205 00"),  # payload longer than the data
    ],
)
def test_malformed_response_is_the_peers_fault(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="response on stream 7 does not parse"):
        read_response(TtrpcResponse(7, data))


def test_unencodable_values_are_our_fault() -> None:
    with pytest.raises(LocalProtocolError):
        request_data("svc", "m", b"", timeout_nano=1 << 63)
    with pytest.raises(LocalProtocolError):
        request_data("\ud800", "m", b"")
    with pytest.raises(LocalProtocolError):
        request_data("s", "m", b"", metadata=[("k", "\udfff")])
    with pytest.raises(LocalProtocolError):
        response_data(b"", 1 << 31, "x")
    with pytest.raises(LocalProtocolError):
        response_data(b"", 1, "\ud800")
