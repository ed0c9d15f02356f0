"""Mux, ttrpc framing and the ttrpc envelopes stacked as on the NRI socket: golden frames, both
directions.

A plugin (conn 1 server, conn 2 client) and a fake runtime (conn 1 client, conn 2 server) are
wired back to back, as h11's ``ConnectionPair``; every byte that crosses is compared with frames
written out from containerd/nri and containerd/ttrpc (the Go encoders' output for
``RegisterPlugin``, ``Configure``, ``CreateContainer`` and error replies) and parsed back by the
other side. The envelopes are :mod:`dracpu.adapters.ttrpc_envelopes` (Google protobuf) inside
the sans-IO framing of :mod:`dracpu.wire`.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dracpu.adapters.ttrpc_envelopes import (
    Answer,
    Call,
    read_request,
    read_response,
    request_data,
    response_data,
)
from dracpu.errors import RemoteProtocolError
from dracpu.wire.events import (
    NEED_DATA,
    ConnectionClosed,
    MuxFrame,
    TtrpcRequest,
    TtrpcResponse,
    TtrpcStreamError,
)
from dracpu.wire.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, MuxConnection
from dracpu.wire.status import Code
from dracpu.wire.ttrpc import Role, TtrpcConnection

Event = Call | Answer | TtrpcStreamError | ConnectionClosed

RUNTIME = "nri.pkg.api.v1alpha1.Runtime"
PLUGIN = "nri.pkg.api.v1alpha1.Plugin"


class Side:
    """One end of the NRI socket: a mux and a ttrpc connection per conn id."""

    def __init__(self, roles: dict[int, Role]) -> None:
        self.mux = MuxConnection(roles)
        self.conns = {conn_id: TtrpcConnection(role) for conn_id, role in roles.items()}

    def send_request(
        self, conn_id: int, service: str, method: str, payload: bytes, timeout_nano: int = 0
    ) -> bytes:
        data = request_data(service, method, payload, timeout_nano)
        _, message = self.conns[conn_id].send_request(data)
        return self.mux.send(conn_id, message)

    def send_response(self, conn_id: int, stream_id: int, payload: bytes) -> bytes:
        data = response_data(payload)
        return self.mux.send(conn_id, self.conns[conn_id].send_response(stream_id, data))

    def send_error(self, conn_id: int, stream_id: int, code: int, message: str) -> bytes:
        data = self.conns[conn_id].send_response(stream_id, response_data(b"", code, message))
        return self.mux.send(conn_id, data)

    def receive(self, data: bytes) -> list[tuple[int, Event]]:
        """Feed socket bytes; return the calls and answers they complete, with their conn id.

        A request whose envelope does not decode comes back as the INVALID_ARGUMENT the server
        owes it; a response whose envelope does not decode raises (the connection is lost)."""
        self.mux.receive_data(data)
        events: list[tuple[int, Event]] = []
        while True:
            frame = self.mux.next_event()
            if isinstance(frame, ConnectionClosed):
                for conn in self.conns.values():
                    conn.receive_data(b"")
            elif isinstance(frame, MuxFrame):
                self.conns[frame.conn_id].receive_data(frame.payload)
            for conn_id, conn in self.conns.items():
                while (event := conn.next_event()) is not NEED_DATA:
                    events.append((conn_id, _decoded(event)))
                    if isinstance(event, ConnectionClosed):
                        break
            if frame is NEED_DATA or isinstance(frame, ConnectionClosed):
                return events


def _decoded(event: TtrpcRequest | TtrpcResponse | TtrpcStreamError | ConnectionClosed) -> Event:
    if isinstance(event, TtrpcRequest):
        try:
            return read_request(event)
        except RemoteProtocolError as exc:
            return TtrpcStreamError(event.stream_id, Code.INVALID_ARGUMENT, str(exc))
    if isinstance(event, TtrpcResponse):
        return read_response(event)
    return event


def plugin() -> Side:
    return Side({PLUGIN_SERVICE_CONN: Role.SERVER, RUNTIME_SERVICE_CONN: Role.CLIENT})


def runtime() -> Side:
    return Side({PLUGIN_SERVICE_CONN: Role.CLIENT, RUNTIME_SERVICE_CONN: Role.SERVER})


def hexb(text: str) -> bytes:
    return bytes.fromhex(text)


# Golden vectors: the bytes containerd/nri's Go plugin stub and runtime put on the socket.
REGISTER_PLUGIN = hexb("0a 07 64 72 61 2d 63 70 75 12 02 39 30")
REGISTER_REQUEST = hexb(
    "0a 1c 6e 72 69 2e 70 6b 67 2e 61 70 69 2e 76 31 61 6c 70 68 61 31 2e 52 75 6e 74 69 6d 65"
    "12 0e 52 65 67 69 73 74 65 72 50 6c 75 67 69 6e 1a 0d 0a 07 64 72 61 2d 63 70 75 12 02 39"
    "30 20 80 e4 97 d0 12"
)
REGISTER_SOCKET = hexb("00 00 00 02 00 00 00 4d  00 00 00 43 00 00 00 01 01 00") + REGISTER_REQUEST
REGISTER_OK_SOCKET = hexb("00 00 00 02 00 00 00 0a  00 00 00 00 00 00 00 01 02 00")
CONFIGURE_RESPONSE = hexb("10 88 0d")
CONFIGURE_REPLY_SOCKET = hexb(
    "00 00 00 01 00 00 00 0f  00 00 00 05 00 00 00 01 02 00  12 03 10 88 0d"
)
CREATE_RESPONSE = hexb("0a 0b 32 09 12 07 12 05 32 03 32 2d 33")
CREATE_REPLY_SOCKET = hexb(
    "00 00 00 01 00 00 00 19  00 00 00 0f 00 00 00 05 02 00  12 0d"
    "0a 0b 32 09 12 07 12 05 32 03 32 2d 33"
)
CONTAINER_UPDATE = hexb("0a 03 61 62 63 12 0d 0a 0b 12 09 32 07 30 2d 31 2c 34 2d 37")
STATE_CHANGE_EVENT = hexb("08 0b 1a 05 0a 03 61 62 63")
BOOM = hexb("0a 08 08 02 12 04 62 6f 6f 6d")
UNIMPLEMENTED_FOO = hexb("0a 0e 08 0c 12 0a 6d 65 74 68 6f 64 20 46 6f 6f")


def test_register_plugin_golden_both_ways() -> None:
    p, r = plugin(), runtime()
    data = p.send_request(
        RUNTIME_SERVICE_CONN, RUNTIME, "RegisterPlugin", REGISTER_PLUGIN, 5 * 10**9
    )
    assert data == REGISTER_SOCKET
    assert r.receive(data) == [
        (RUNTIME_SERVICE_CONN, Call(1, RUNTIME, "RegisterPlugin", REGISTER_PLUGIN, 5_000_000_000))
    ]
    # The runtime's OK for Empty: no status, a 0-byte Response.
    reply = r.send_response(RUNTIME_SERVICE_CONN, 1, b"")
    assert reply == REGISTER_OK_SOCKET
    assert p.receive(reply) == [(RUNTIME_SERVICE_CONN, Answer(1, 0, "", b""))]


def test_configure_and_create_container_replies_golden_both_ways() -> None:
    p, r = plugin(), runtime()
    # The runtime calls Configure (1), Synchronize (3), CreateContainer (5) on conn 1.
    calls = b"".join(
        r.send_request(PLUGIN_SERVICE_CONN, PLUGIN, method, b"", 2 * 10**9)
        for method in ("Configure", "Synchronize", "CreateContainer")
    )
    assert [(c, e.stream_id) for c, e in p.receive(calls) if isinstance(e, Call)] == [
        (1, 1),
        (1, 3),
        (1, 5),
    ]
    configure = p.send_response(PLUGIN_SERVICE_CONN, 1, CONFIGURE_RESPONSE)
    assert configure == CONFIGURE_REPLY_SOCKET
    create = p.send_response(PLUGIN_SERVICE_CONN, 5, CREATE_RESPONSE)
    assert create == CREATE_REPLY_SOCKET
    # Out of order, in one read: the runtime matches them by stream id.
    assert r.receive(create + configure) == [
        (PLUGIN_SERVICE_CONN, Answer(5, 0, "", CREATE_RESPONSE)),
        (PLUGIN_SERVICE_CONN, Answer(1, 0, "", CONFIGURE_RESPONSE)),
    ]
    assert r.conns[PLUGIN_SERVICE_CONN].outstanding == {3}


@pytest.mark.parametrize(
    ("code", "message", "envelope"),
    [(Code.UNKNOWN, "boom", BOOM), (Code.UNIMPLEMENTED, "method Foo", UNIMPLEMENTED_FOO)],
)
def test_error_replies_golden_both_ways(code: Code, message: str, envelope: bytes) -> None:
    p, r = plugin(), runtime()
    p.receive(r.send_request(PLUGIN_SERVICE_CONN, PLUGIN, "Foo", b""))
    data = p.send_error(PLUGIN_SERVICE_CONN, 1, code, message)
    n = len(envelope)
    assert data == hexb(f"00000001 {n + 10:08x} {n:08x} 00000001 0200") + envelope
    assert r.receive(data) == [(PLUGIN_SERVICE_CONN, Answer(1, code, message, b""))]


@pytest.mark.parametrize(
    ("conn_id", "service", "method", "payload"),
    [
        (PLUGIN_SERVICE_CONN, PLUGIN, "StateChange", STATE_CHANGE_EVENT),
        # UpdateContainersRequest{update: [ContainerUpdate{"abc", cpus "0-1,4-7"}]}
        (RUNTIME_SERVICE_CONN, RUNTIME, "UpdateContainers", hexb("0a 14") + CONTAINER_UPDATE),
    ],
)
def test_nri_payload_vectors_are_carried_byte_exactly(
    conn_id: int, service: str, method: str, payload: bytes
) -> None:
    p, r = plugin(), runtime()
    caller, callee = (r, p) if conn_id == PLUGIN_SERVICE_CONN else (p, r)
    data = caller.send_request(conn_id, service, method, payload)
    assert payload in data
    assert callee.receive(data) == [(conn_id, Call(1, service, method, payload))]


def test_a_5000_byte_message_crosses_as_frames_of_4096_and_904() -> None:
    p, r = plugin(), runtime()
    p.receive(r.send_request(PLUGIN_SERVICE_CONN, PLUGIN, "Synchronize", b""))
    # Response{payload} = 1-byte tag + 2-byte length + 4987 bytes = 4990; + 10-byte header.
    payload = bytes(i % 251 for i in range(4987))
    data = p.send_response(PLUGIN_SERVICE_CONN, 1, payload)
    assert len(data) == 5000 + 2 * 8
    assert data[:8] == hexb("00000001 00001000")
    assert data[8 + 4096 : 16 + 4096] == hexb("00000001 00000388")  # 904
    # Fed in the two frames' own pieces, then byte by byte: the same single response.
    for pieces in ([data[:4104], data[4104:]], [data[i : i + 1] for i in range(len(data))]):
        runtime_side = runtime()
        runtime_side.send_request(PLUGIN_SERVICE_CONN, PLUGIN, "Synchronize", b"")
        events: list[tuple[int, Event]] = []
        for piece in pieces:
            events += runtime_side.receive(piece)
        assert events == [(PLUGIN_SERVICE_CONN, Answer(1, 0, "", payload))]


def test_eof_reaches_every_conn() -> None:
    p = plugin()
    assert p.receive(b"") == [
        (PLUGIN_SERVICE_CONN, ConnectionClosed()),
        (RUNTIME_SERVICE_CONN, ConnectionClosed()),
    ]


# --- properties over the whole stack ---------------------------------------------------------


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN]),
            st.text(max_size=12),
            st.one_of(st.binary(max_size=100), st.integers(4000, 12000).map(bytes)),
        ),
        min_size=1,
        max_size=6,
    ),
    st.lists(st.integers(0, 1 << 16), max_size=16),
)
def test_interleaved_calls_on_both_conns_survive_any_chunking(
    calls: list[tuple[int, str, bytes]], cuts: list[int]
) -> None:
    p, r = plugin(), runtime()
    wire_to_plugin, wire_to_runtime = b"", b""
    expected_at_plugin, expected_at_runtime = [], []
    next_id = {PLUGIN_SERVICE_CONN: 1, RUNTIME_SERVICE_CONN: 1}
    for conn_id, method, payload in calls:
        request = Call(next_id[conn_id], "svc", method, payload)
        next_id[conn_id] += 2
        if conn_id == PLUGIN_SERVICE_CONN:
            wire_to_plugin += r.send_request(conn_id, "svc", method, payload)
            expected_at_plugin.append((conn_id, request))
        else:
            wire_to_runtime += p.send_request(conn_id, "svc", method, payload)
            expected_at_runtime.append((conn_id, request))
    got_at_plugin = [e for chunk in split(wire_to_plugin, cuts) for e in p.receive(chunk)]
    got_at_runtime = [e for chunk in split(wire_to_runtime, cuts) for e in r.receive(chunk)]
    assert got_at_plugin == expected_at_plugin
    assert got_at_runtime == expected_at_runtime

    # Every call answered with its own payload echoed; replies interleave on one socket each.
    replies_to_runtime = b"".join(
        p.send_response(c, e.stream_id, e.payload) for c, e in reversed(expected_at_plugin)
    )
    replies_to_plugin = b"".join(
        r.send_response(c, e.stream_id, e.payload) for c, e in expected_at_runtime
    )
    got = [e for chunk in split(replies_to_runtime, cuts) for e in r.receive(chunk)]
    assert got == [
        (c, Answer(e.stream_id, 0, "", e.payload)) for c, e in reversed(expected_at_plugin)
    ]
    got = [e for chunk in split(replies_to_plugin, cuts) for e in p.receive(chunk)]
    assert got == [(c, Answer(e.stream_id, 0, "", e.payload)) for c, e in expected_at_runtime]
    assert not any(conn.outstanding for side in (p, r) for conn in side.conns.values())


@settings(max_examples=300)
@given(st.binary(max_size=300), st.lists(st.integers(0, 400), max_size=6))
def test_garbage_on_the_socket_only_raises_peer_errors(data: bytes, cuts: list[int]) -> None:
    side = plugin()
    side.send_request(RUNTIME_SERVICE_CONN, RUNTIME, "RegisterPlugin", b"")
    with contextlib.suppress(RemoteProtocolError):
        for chunk in [*split(data, cuts), b""]:
            side.receive(chunk)
            assert side.mux.buffered_bytes <= 8 + 10 + (4 << 20)


# Structured garbage: well-framed mux frames (conns 1, 2 and an unopened 3) whose payloads are
# ttrpc messages with small, plausible header values (odd, even and reused stream ids, every
# message type, lengths right, short or long) around a mangled envelope. Random bytes alone
# almost never get past the mux header to the ttrpc connections; these do.
_envelopes = st.one_of(
    st.binary(max_size=12),
    st.sampled_from(
        [b"", bytes.fromhex("0a0373766312014d"), bytes.fromhex("0a02 0803"), b"\x0a\x05ab"]
    ),
)


@st.composite
def _mux_frame(draw: st.DrawFn) -> bytes:
    conn_id = draw(st.sampled_from([1, 2, 3]))
    usual = 1 if conn_id == PLUGIN_SERVICE_CONN else 2  # what this conn should carry
    data = draw(_envelopes)
    length = len(data) + draw(st.sampled_from([0, 0, 0, -1, 1, 5]))
    header = (
        max(length, 0).to_bytes(4, "big")
        + draw(st.sampled_from([1, 3, 5] * 2 + [0, 2, 7])).to_bytes(4, "big")
        + bytes((draw(st.sampled_from([usual] * 4 + [0, 1, 2, 3, 4])), draw(st.integers(0, 7))))
    )
    message = header + data
    return conn_id.to_bytes(4, "big") + len(message).to_bytes(4, "big") + message


_mux_frames = st.lists(_mux_frame(), max_size=8).map(b"".join)


@settings(max_examples=300)
@given(_mux_frames, st.lists(st.integers(0, 400), max_size=6))
def test_framed_garbage_reaches_ttrpc_and_only_raises_peer_errors(
    data: bytes, cuts: list[int]
) -> None:
    side = plugin()
    for _ in range(3):  # responses on streams 1, 3 and 5 are expected on conn 2
        side.send_request(RUNTIME_SERVICE_CONN, RUNTIME, "RegisterPlugin", b"")
    allowed = {
        PLUGIN_SERVICE_CONN: Call | TtrpcStreamError | ConnectionClosed,
        RUNTIME_SERVICE_CONN: Answer | TtrpcStreamError | ConnectionClosed,
    }
    with contextlib.suppress(RemoteProtocolError):
        for chunk in [*split(data, cuts), b""]:
            for conn_id, event in side.receive(chunk):
                assert isinstance(event, allowed[conn_id]), (conn_id, event)
            assert side.mux.buffered_bytes <= 8 + 10 + (4 << 20)
