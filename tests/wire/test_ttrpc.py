"""One ttrpc connection's framing: messages as bytes, stream ids, the 4 MiB limit, whose fault
errors are. The envelopes inside the messages are tested in tests/adapters/test_ttrpc_envelopes.py
(also byte-exactly, through this framing)."""

from __future__ import annotations

import contextlib
import itertools
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dracpu.errors import LocalProtocolError, RemoteProtocolError
from dracpu.wire.events import (
    NEED_DATA,
    ConnectionClosed,
    TtrpcRequest,
    TtrpcResponse,
    TtrpcStreamError,
)
from dracpu.wire.ttrpc import (
    TTRPC_HEADER_LEN,
    TTRPC_MAX_DATA_LEN,
    Code,
    MessageHeader,
    MessageType,
    Role,
    TtrpcConnection,
    TtrpcEvent,
)

RUNTIME = "nri.pkg.api.v1alpha1.Runtime"
# A ttrpc.Request envelope: RegisterPlugin{dra-cpu, 90} on the Runtime service, 5 s timeout
# (containerd/nri plugin.go register; the framing carries it as opaque bytes).
REGISTER_DATA = (
    bytes.fromhex("0a1c") + RUNTIME.encode() + bytes.fromhex("120e") + b"RegisterPlugin"
    + bytes.fromhex("1a0d 0a076472612d637075 12023930") + bytes.fromhex("2080e497d012")
)  # fmt: skip
OVERSIZE_TEXT = "message length {} exceed maximum message size of 4194304"  # channel.go recv()


def header(length: int, stream_id: int, message_type: int, flags: int = 0) -> bytes:
    return struct.pack(">IIBB", length, stream_id, message_type, flags)


def drain(conn: TtrpcConnection) -> list[TtrpcEvent]:
    events: list[TtrpcEvent] = []
    while True:
        event = conn.next_event()
        events.append(event)
        if event is NEED_DATA or isinstance(event, ConnectionClosed):
            return events


def client_with_streams(n: int) -> TtrpcConnection:
    """A client that has sent ``n`` requests (streams 1, 3, ...)."""
    client = TtrpcConnection(Role.CLIENT)
    for _ in range(n):
        client.send_request(b"")
    return client


def server_with_streams(*stream_ids: int) -> TtrpcConnection:
    """A server that has received a request on each of ``stream_ids``."""
    server = TtrpcConnection(Role.SERVER)
    for stream_id in stream_ids:
        server.receive_data(header(0, stream_id, MessageType.REQUEST))
    assert len(drain(server)) == len(stream_ids) + 1
    return server


# --- byte tables: requests a server reads, responses a client reads ----------------------------

REQUEST_TABLE: list[tuple[TtrpcRequest, bytes]] = [
    (TtrpcRequest(1, REGISTER_DATA), header(0x43, 1, 1) + REGISTER_DATA),
    (TtrpcRequest(1, b""), header(0, 1, 1)),  # an empty envelope: every field its default
    (TtrpcRequest(7, b"\xff" * 300), header(300, 7, 1) + b"\xff" * 300),  # opaque to the framing
]

RESPONSE_TABLE: list[tuple[TtrpcResponse, bytes]] = [
    (TtrpcResponse(1, b""), header(0, 1, 2)),  # Go's OK for an Empty reply
    (TtrpcResponse(1, bytes.fromhex("120310880d")), header(5, 1, 2) + bytes.fromhex("120310880d")),
    (
        TtrpcResponse(1, bytes.fromhex("0a0808021204626f6f6d")),
        header(10, 1, 2) + bytes.fromhex("0a0808021204626f6f6d"),
    ),
]


@pytest.mark.parametrize(("event", "data"), REQUEST_TABLE)
def test_server_reads_request_whole_bytewise_and_with_trailing(
    event: TtrpcRequest, data: bytes
) -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(data)
    assert drain(server) == [event, NEED_DATA]

    server = TtrpcConnection(Role.SERVER)
    got: list[TtrpcEvent] = []
    for i in range(len(data)):
        assert server.buffered_bytes == i
        server.receive_data(data[i : i + 1])
        got += [e for e in drain(server) if e is not NEED_DATA]
    assert got == [event]

    server = TtrpcConnection(Role.SERVER)
    trailing = header(100, event.stream_id + 2, 1)[:7]
    server.receive_data(data + trailing)
    assert drain(server) == [event, NEED_DATA]
    assert server.buffered_bytes == len(trailing)
    assert server.outstanding == {event.stream_id}


def test_client_writes_request() -> None:
    client = TtrpcConnection(Role.CLIENT)
    assert client.send_request(REGISTER_DATA) == (1, header(0x43, 1, 1) + REGISTER_DATA)
    assert client.send_request(b"") == (3, header(0, 3, 1))
    assert client.outstanding == {1, 3}


@pytest.mark.parametrize(("event", "data"), RESPONSE_TABLE)
def test_client_reads_response_whole_bytewise_and_with_trailing(
    event: TtrpcResponse, data: bytes
) -> None:
    client = client_with_streams(1)
    client.receive_data(data)
    assert drain(client) == [event, NEED_DATA]
    assert client.outstanding == set()

    client = client_with_streams(1)
    got: list[TtrpcEvent] = []
    for i in range(len(data)):
        client.receive_data(data[i : i + 1])
        got += [e for e in drain(client) if e is not NEED_DATA]
    assert got == [event]

    client = client_with_streams(2)
    client.receive_data(data + header(0, 3, 2)[:9])
    assert drain(client) == [event, NEED_DATA]
    assert client.buffered_bytes == 9


@pytest.mark.parametrize(("event", "data"), RESPONSE_TABLE)
def test_server_writes_response(event: TtrpcResponse, data: bytes) -> None:
    server = server_with_streams(1)
    assert server.send_response(1, event.data) == data
    assert server.outstanding == set()


def test_message_header_golden_vectors_from_ttrpc_rust() -> None:
    # containerd/ttrpc-rust src/proto.rs MESSAGE_HEADER and PROTOBUF_MESSAGE_HEADER.
    vectors = [
        (bytes([0x10, 0, 0, 0, 0, 0, 0, 0x03, 0x2, 0xEF]), MessageHeader(0x1000_0000, 3, 2, 0xEF)),
        (
            bytes([0, 0, 0, 67, 0, 0x12, 0x34, 0x56, 0x1, 0xEF]),
            MessageHeader(67, 0x123456, 1, 0xEF),
        ),
    ]
    for data, parsed in vectors:
        assert MessageHeader.decode(data) == parsed
        assert parsed.encode() == data
    with pytest.raises(RemoteProtocolError):
        MessageHeader.decode(b"\x00" * 9)
    with pytest.raises(LocalProtocolError):
        MessageHeader(1 << 32, 1, 1).encode()


# --- stream ids and outstanding requests -----------------------------------------------------


def test_client_stream_ids_are_odd_and_increase_by_two() -> None:
    client = TtrpcConnection(Role.CLIENT)
    ids = [client.send_request(b"")[0] for _ in range(4)]
    assert ids == [1, 3, 5, 7]
    assert client.outstanding == {1, 3, 5, 7}


def test_responses_may_come_out_of_order() -> None:
    client = client_with_streams(3)
    client.receive_data(header(0, 5, 2) + header(0, 1, 2))
    assert drain(client) == [TtrpcResponse(5, b""), TtrpcResponse(1, b""), NEED_DATA]
    assert client.outstanding == {3}


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (header(0, 3, 2), "no request outstanding"),  # never requested
        (header(0, 1, 2) + header(0, 1, 2), "no request outstanding"),  # answered twice
        (header(0, 1, 1), "client received message type 1"),
        (header(0, 1, 3), "client received message type 3"),
        (header(0, 1, 9), "client received message type 9"),
        (header(3, 1, 2, 0xFF)[:10], None),  # only a header so far: needs data
    ],
)
def test_client_rejects_what_no_server_may_send(data: bytes, match: str | None) -> None:
    client = client_with_streams(1)
    client.receive_data(data)
    if match is None:
        assert drain(client) == [NEED_DATA]
        return
    with pytest.raises(RemoteProtocolError, match=match):
        drain(client)
    with pytest.raises(RemoteProtocolError, match=match):  # the connection stays broken
        client.next_event()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (header(0, 2, 1), "even stream id 2"),
        (header(0, 3, 1) + header(0, 3, 1), "not above the last one"),
        (header(0, 5, 1) + header(0, 3, 1), "not above the last one"),
        (header(0, 1, 2), "server received a response"),
        (header(0, 1, 3), "server received a data"),
        (header(TTRPC_MAX_DATA_LEN + 1, 4, 1), "even stream id 4"),
    ],
)
def test_server_rejects_what_no_client_may_send(data: bytes, match: str) -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(data)
    with pytest.raises(RemoteProtocolError, match=match):
        drain(server)
    with pytest.raises(RemoteProtocolError):
        server.next_event()


def test_bad_header_fails_before_its_data_arrives() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(header(1000, 2, 1))
    with pytest.raises(RemoteProtocolError, match="even"):
        server.next_event()


def test_server_ignores_unknown_message_types_like_go() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(header(3, 8, 0x7F, 0xFF) + b"xyz" + header(0, 1, 1))
    assert drain(server) == [TtrpcRequest(1, b""), NEED_DATA]


def test_sending_what_the_protocol_forbids_is_our_fault_and_changes_nothing() -> None:
    server = server_with_streams(1)
    with pytest.raises(LocalProtocolError, match="no request to answer on stream 3"):
        server.send_response(3, b"")
    with pytest.raises(LocalProtocolError, match="cannot send requests"):
        server.send_request(b"")
    assert server.send_response(1, b"") == header(0, 1, 2)
    with pytest.raises(LocalProtocolError, match="answered"):
        server.send_response(1, b"")

    client = TtrpcConnection(Role.CLIENT)
    with pytest.raises(LocalProtocolError, match="cannot send responses"):
        client.send_response(1, b"")


# --- the 4 MiB limit ---------------------------------------------------------------------------


def test_oversized_response_is_refused_and_the_stream_can_still_fail() -> None:
    server = server_with_streams(1)
    with pytest.raises(LocalProtocolError, match="exceeds the 4194304-byte limit"):
        server.send_response(1, bytes(TTRPC_MAX_DATA_LEN + 1))
    assert server.outstanding == {1}
    reply = server.send_response(1, b"an error envelope")
    assert reply == header(17, 1, 2) + b"an error envelope"


def test_largest_response_fits() -> None:
    server = server_with_streams(1)
    data = bytes(TTRPC_MAX_DATA_LEN)
    message = server.send_response(1, data)
    assert MessageHeader.decode(message).length == TTRPC_MAX_DATA_LEN
    client = client_with_streams(1)
    client.receive_data(message)
    assert drain(client) == [TtrpcResponse(1, data), NEED_DATA]


def test_oversized_request_is_refused_without_using_a_stream_id() -> None:
    client = TtrpcConnection(Role.CLIENT)
    with pytest.raises(LocalProtocolError, match="exceeds"):
        client.send_request(bytes(TTRPC_MAX_DATA_LEN + 1))
    assert client.outstanding == set()
    assert client.send_request(b"")[0] == 1


def feed_zeros(conn: TtrpcConnection, n: int, chunk: int = 1 << 20) -> None:
    """Feed ``n`` zero bytes in chunks, checking that none of them is buffered."""
    block = bytes(chunk)
    while n:
        part = min(n, chunk)
        conn.receive_data(block[:part] if part < chunk else block)
        n -= part
        if n:
            assert drain(conn) == [NEED_DATA]
            assert conn.buffered_bytes == 0


def test_server_discards_oversized_request_and_owes_resource_exhausted() -> None:
    server = TtrpcConnection(Role.SERVER)
    length = TTRPC_MAX_DATA_LEN + 1
    server.receive_data(header(length, 1, 1))
    assert drain(server) == [NEED_DATA]
    feed_zeros(server, length)
    server.receive_data(header(0, 3, 1))
    assert drain(server) == [
        TtrpcStreamError(1, Code.RESOURCE_EXHAUSTED, OVERSIZE_TEXT.format(length)),
        TtrpcRequest(3, b""),
        NEED_DATA,
    ]
    assert server.outstanding == {1, 3}
    reply = server.send_response(1, b"the error")
    assert reply[:10] == header(9, 1, 2)
    assert server.outstanding == {3}


def test_client_turns_oversized_response_into_its_error_ttrpc_rust_header() -> None:
    # ttrpc-rust MESSAGE_HEADER: length 0x1000_0000 (256 MiB) on stream 3, flags 0xef.
    client = client_with_streams(2)
    client.receive_data(bytes([0x10, 0, 0, 0, 0, 0, 0, 0x03, 0x2, 0xEF]))
    assert drain(client) == [NEED_DATA]
    feed_zeros(client, 0x1000_0000, chunk=8 << 20)
    assert drain(client) == [
        TtrpcStreamError(3, Code.RESOURCE_EXHAUSTED, OVERSIZE_TEXT.format(0x1000_0000)),
        NEED_DATA,
    ]
    assert client.outstanding == {1}


def test_server_skips_oversized_unknown_type_silently() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(header(TTRPC_MAX_DATA_LEN + 7, 2, 0x42) + bytes(TTRPC_MAX_DATA_LEN + 7))
    assert drain(server) == [NEED_DATA]
    assert server.buffered_bytes == 0
    assert server.outstanding == set()


def test_eof_while_discarding_is_peers_fault() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(header(TTRPC_MAX_DATA_LEN + 1, 1, 1) + bytes(100))
    assert drain(server) == [NEED_DATA]
    server.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="middle of a message"):
        server.next_event()


# --- EOF ----------------------------------------------------------------------------------------


def test_eof_at_a_message_boundary_closes_cleanly() -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(header(0, 1, 1))
    server.receive_data(b"")
    assert drain(server) == [TtrpcRequest(1, b""), ConnectionClosed()]
    assert server.next_event() == ConnectionClosed()
    with pytest.raises(LocalProtocolError):
        server.receive_data(b"more")


@pytest.mark.parametrize("partial", [header(0, 1, 1)[:5], header(4, 1, 1) + b"\x0a"])
def test_eof_inside_a_message_is_peers_fault(partial: bytes) -> None:
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(partial)
    server.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="middle of a message"):
        server.next_event()


# --- properties -------------------------------------------------------------------------------


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.binary(max_size=200), min_size=1, max_size=6),
    st.lists(st.binary(max_size=200), min_size=6, max_size=6),
    st.randoms(use_true_random=False),
    st.lists(st.integers(0, 5000)),
)
def test_client_server_round_trip_with_any_chunking(
    sent: list[bytes], replies: list[bytes], rng: random.Random, cuts: list[int]
) -> None:
    client, server = TtrpcConnection(Role.CLIENT), TtrpcConnection(Role.SERVER)
    wire = b""
    expected_requests = []
    for data in sent:
        stream_id, message = client.send_request(data)
        wire += message
        expected_requests.append(TtrpcRequest(stream_id, data))
    received: list[TtrpcEvent] = []
    for chunk in split(wire, cuts):
        server.receive_data(chunk)
        received += [e for e in drain(server) if e is not NEED_DATA]
    assert received == expected_requests

    order = list(expected_requests)
    rng.shuffle(order)  # a Go server may answer out of order
    wire = b""
    expected_responses = []
    for request, reply in zip(order, replies, strict=False):
        wire += server.send_response(request.stream_id, reply)
        expected_responses.append(TtrpcResponse(request.stream_id, reply))
    assert server.outstanding == set()
    received = []
    for chunk in split(wire, cuts):
        client.receive_data(chunk)
        received += [e for e in drain(client) if e is not NEED_DATA]
    assert received == expected_responses
    assert client.outstanding == set()


@settings(max_examples=300)
@given(
    st.sampled_from([Role.CLIENT, Role.SERVER]),
    st.binary(max_size=300),
    st.lists(st.integers(0, 400), max_size=6),
)
def test_garbage_gives_events_or_need_data_or_a_peer_error(
    role: Role, data: bytes, cuts: list[int]
) -> None:
    conn = TtrpcConnection(role)
    if role is Role.CLIENT:
        for _ in range(3):
            conn.send_request(b"")
    with contextlib.suppress(RemoteProtocolError):
        for chunk in [*split(data, cuts), b""]:
            conn.receive_data(chunk)
            drain(conn)
            assert conn.buffered_bytes <= TTRPC_HEADER_LEN + TTRPC_MAX_DATA_LEN
