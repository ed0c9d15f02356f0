"""The NRI multiplexer: frames as bytes, the Go-compatible sending rule, hostile input."""

from __future__ import annotations

import contextlib
import itertools
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dracpu.errors import LocalProtocolError, RemoteProtocolError
from dracpu.wire.events import NEED_DATA, ConnectionClosed, MuxFrame
from dracpu.wire.mux import (
    FIRST_FRAME_MAX,
    MAX_PAYLOAD_SIZE,
    MUX_HEADER_LEN,
    PLUGIN_SERVICE_CONN,
    RUNTIME_SERVICE_CONN,
    MuxConnection,
    MuxEvent,
)


def drain(mux: MuxConnection) -> list[MuxEvent]:
    """All events up to and including the first NEED_DATA or ConnectionClosed."""
    events: list[MuxEvent] = []
    while True:
        event = mux.next_event()
        events.append(event)
        if event is NEED_DATA or isinstance(event, ConnectionClosed):
            return events


def frame_sizes(data: bytes) -> list[tuple[int, int]]:
    """(conn id, payload length) of each frame, parsed independently of the code under test."""
    out, pos = [], 0
    while pos < len(data):
        conn_id, length = struct.unpack(">II", data[pos : pos + 8])
        out.append((conn_id, length))
        pos += 8 + length
    assert pos == len(data)
    return out


# (frames as events, bytes): each row is read whole, byte by byte and with trailing data.
REGISTER = bytes.fromhex("00000043 00000001 0100") + bytes(67)
TABLE: list[tuple[list[MuxFrame], bytes]] = [
    ([MuxFrame(2, REGISTER)], bytes.fromhex("00000002 0000004d") + REGISTER),
    ([MuxFrame(1, b"\x00" * 10)], bytes.fromhex("00000001 0000000a") + b"\x00" * 10),
    (
        [MuxFrame(1, b"ab"), MuxFrame(2, b"c"), MuxFrame(1, b"d")],
        bytes.fromhex("00000001 00000002 6162 00000002 00000001 63 00000001 00000001 64"),
    ),
    # Frames of conns we did not open are dropped; empty frames carry nothing.
    (
        [MuxFrame(2, b"x")],
        bytes.fromhex("00000007 00000002 6162 00000001 00000000 00000002 00000001 78"),
    ),
    ([], bytes.fromhex("00000000 00000003 616263")),  # conn 0 is reserved: never opened
]


@pytest.mark.parametrize(("frames", "data"), TABLE)
def test_read_whole(frames: list[MuxFrame], data: bytes) -> None:
    mux = MuxConnection()
    mux.receive_data(data)
    assert drain(mux) == [*frames, NEED_DATA]
    assert mux.buffered_bytes == 0


@pytest.mark.parametrize(("frames", "data"), TABLE)
def test_read_byte_by_byte(frames: list[MuxFrame], data: bytes) -> None:
    mux = MuxConnection()
    got: list[MuxEvent] = []
    for i in range(len(data)):
        mux.receive_data(data[i : i + 1])
        got += [e for e in drain(mux) if e is not NEED_DATA]
    assert got == frames
    mux.receive_data(b"")
    assert drain(mux) == [ConnectionClosed()]


@pytest.mark.parametrize(("frames", "data"), TABLE)
@pytest.mark.parametrize("trailing", [b"\x00", bytes.fromhex("00000001 00000005 6869")])
def test_read_with_trailing_data(frames: list[MuxFrame], data: bytes, trailing: bytes) -> None:
    mux = MuxConnection()
    mux.receive_data(data + trailing)
    assert drain(mux) == [*frames, NEED_DATA]
    assert mux.buffered_bytes == len(trailing)
    mux.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="inside a frame"):
        mux.next_event()


@pytest.mark.parametrize(("frames", "data"), TABLE[:3])
def test_write_table(frames: list[MuxFrame], data: bytes) -> None:
    mux = MuxConnection()
    assert b"".join(mux.send(f.conn_id, f.payload) for f in frames) == data


def test_dropped_frames_are_counted() -> None:
    mux = MuxConnection()
    mux.receive_data(bytes.fromhex("00000007 00000002 6162 00000000 00000000"))
    assert drain(mux) == [NEED_DATA]
    assert mux.dropped_frames == 2


# --- the sending rule (Go's bufio.Reader in ttrpc channel.go) -----------------------------------


@pytest.mark.parametrize(
    ("size", "sizes"),
    [
        (10, [10]),
        (4096, [4096]),
        (4097, [4096, 1]),
        (5000, [4096, 904]),  # the reference's example
        (MAX_PAYLOAD_SIZE, [4096, MAX_PAYLOAD_SIZE - 4096]),
    ],
)
def test_send_splits_like_go_bufio(size: int, sizes: list[int]) -> None:
    message = bytes(i % 251 for i in range(size))
    data = MuxConnection().send(RUNTIME_SERVICE_CONN, message)
    assert frame_sizes(data) == [(RUNTIME_SERVICE_CONN, n) for n in sizes]
    payloads = data[8 : 8 + sizes[0]]
    if len(sizes) == 2:
        payloads += data[16 + sizes[0] :]
    assert payloads == message


@pytest.mark.parametrize(
    ("conn_id", "message", "match"),
    [
        (1, b"", "empty"),
        (1, bytes(MAX_PAYLOAD_SIZE + 1), "exceeds"),
        (0, b"x", "conn id 0"),
        (1 << 32, b"x", "conn id"),
        (-1, b"x", "conn id"),
    ],
)
def test_send_refuses_what_go_cannot_read(conn_id: int, message: bytes, match: str) -> None:
    with pytest.raises(LocalProtocolError, match=match):
        MuxConnection().send(conn_id, message)


def test_conn_id_zero_cannot_be_opened() -> None:
    with pytest.raises(LocalProtocolError):
        MuxConnection(conn_ids=[0])


# --- limits and EOF ----------------------------------------------------------------------------


def test_largest_frame_is_accepted() -> None:
    mux = MuxConnection()
    payload = b"a" * MAX_PAYLOAD_SIZE
    mux.receive_data(struct.pack(">II", 1, MAX_PAYLOAD_SIZE) + payload)
    assert drain(mux) == [MuxFrame(1, payload), NEED_DATA]


def test_oversized_frame_fails_on_its_header_and_stays_failed() -> None:
    mux = MuxConnection()
    mux.receive_data(struct.pack(">II", 1, MAX_PAYLOAD_SIZE + 1))
    with pytest.raises(RemoteProtocolError, match="4194315 bytes"):
        mux.next_event()
    assert mux.buffered_bytes == MUX_HEADER_LEN  # nothing of the payload was awaited
    with pytest.raises(RemoteProtocolError):
        mux.next_event()


def test_oversized_frame_of_an_unopened_conn_fails_too() -> None:
    mux = MuxConnection()
    mux.receive_data(struct.pack(">II", 9, 0xFFFF_FFFF))
    with pytest.raises(RemoteProtocolError):
        mux.next_event()


@pytest.mark.parametrize("partial", [b"\x00\x00\x00", bytes.fromhex("00000001 00000004 6162")])
def test_eof_inside_a_frame_is_peers_fault(partial: bytes) -> None:
    mux = MuxConnection()
    mux.receive_data(partial)
    assert drain(mux) == [NEED_DATA]
    mux.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="inside a frame"):
        mux.next_event()


def test_clean_eof_repeats_and_data_after_it_is_our_fault() -> None:
    mux = MuxConnection()
    mux.receive_data(b"")
    assert mux.next_event() == ConnectionClosed()
    assert mux.next_event() == ConnectionClosed()
    with pytest.raises(LocalProtocolError):
        mux.receive_data(b"x")


# --- properties --------------------------------------------------------------------------------


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at the given offsets (mod its length) into non-empty chunks."""
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


messages = st.lists(
    st.tuples(
        st.sampled_from([PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN]),
        st.one_of(st.binary(min_size=1, max_size=300), st.integers(1, 9000).map(bytes)),
    ),
    max_size=8,
)


@settings(max_examples=200, deadline=None)
@given(messages, st.lists(st.integers(0, 1 << 20), max_size=12))
def test_any_chunking_gives_the_same_streams(
    sent: list[tuple[int, bytes]], cuts: list[int]
) -> None:
    sender, receiver = MuxConnection(), MuxConnection()
    data = b"".join(sender.send(conn_id, message) for conn_id, message in sent)
    # Each message is one frame, or two with the first exactly 4096 bytes.
    expected_sizes = []
    for conn_id, message in sent:
        if len(message) <= FIRST_FRAME_MAX:
            expected_sizes.append((conn_id, len(message)))
        else:
            expected_sizes += [
                (conn_id, FIRST_FRAME_MAX),
                (conn_id, len(message) - FIRST_FRAME_MAX),
            ]
    assert frame_sizes(data) == expected_sizes
    frames: list[MuxFrame] = []
    for chunk in split(data, cuts):
        receiver.receive_data(chunk)
        frames += [e for e in drain(receiver) if isinstance(e, MuxFrame)]
        assert receiver.buffered_bytes < MUX_HEADER_LEN + MAX_PAYLOAD_SIZE
    receiver.receive_data(b"")
    assert drain(receiver) == [ConnectionClosed()]
    for conn_id in (PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN):
        expected = b"".join(m for c, m in sent if c == conn_id)
        assert b"".join(f.payload for f in frames if f.conn_id == conn_id) == expected
    assert [(f.conn_id, len(f.payload)) for f in frames] == expected_sizes


@settings(max_examples=300)
@given(st.binary(max_size=200), st.lists(st.integers(0, 300), max_size=6))
def test_garbage_gives_frames_or_need_data_or_a_protocol_error(
    data: bytes, cuts: list[int]
) -> None:
    mux = MuxConnection(conn_ids=range(1, 300))
    # Only the peer's fault may surface: any other exception fails the test.
    with contextlib.suppress(RemoteProtocolError):
        for chunk in [*split(data, cuts), b""]:
            mux.receive_data(chunk)
            for event in drain(mux):
                assert isinstance(event, MuxFrame | ConnectionClosed) or event is NEED_DATA
            assert mux.buffered_bytes <= MUX_HEADER_LEN + MAX_PAYLOAD_SIZE
