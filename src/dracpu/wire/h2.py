"""Sans-IO HTTP/2, server side: as much of RFC 9113 as a gRPC server on a unix socket needs.

Modelled on h11 (``reference/model-codebases.md`` §3): no I/O, bytes in, events and bytes out::

    conn = ServerConnection()
    transport.write(conn.initiate())            # our SETTINGS
    for event in conn.receive_data(chunk):      # RequestReceived | DataReceived | StreamReset
        ...                                     # | GoAwayReceived | ConnectionFailed
    conn.send_headers(stream_id, [(":status", "200"), ...])
    conn.send_data(stream_id, message)
    conn.send_headers(stream_id, trailers, end_stream=True)
    transport.write(conn.data_to_send())

Why our own and not ``h2`` (python-hyper) under grpclib: a bare unary call from grpcio to
grpclib costs 0.8 ms back to back and 1.8-2.3 ms "cold" on the target VM, to our server 0.5 /
1.0-1.2 ms (``bench_prepare``'s ``floor.grpc_unary_unix``); the protocol work of one call is
21 us here against h2's 122 us (``bench_wire``'s ``h2.unary_call``). Header blocks are decoded
and encoded by :mod:`dracpu.wire.hpack`.

What the peer may do, and what we do:

- the client preface, then frames of at most :data:`MAX_FRAME_SIZE` bytes (the default: we never
  raise it); the first frame must be SETTINGS;
- SETTINGS are applied and acknowledged (initial window size, max frame size, header table
  size; ENABLE_PUSH must be 0 or 1; unknown settings are ignored); PING is answered; PRIORITY and
  unknown frame types are ignored; PUSH_PROMISE is a protocol error;
- HEADERS (with CONTINUATION) open a stream: odd, increasing ids; at most
  :data:`MAX_CONCURRENT_STREAMS` open at once (beyond: ``REFUSED_STREAM``); a header block of at
  most :data:`MAX_HEADER_LIST_SIZE` bytes decoded; pseudo-headers first, lower-case names, no
  connection-specific fields, names and values as RFC 9113 §8.2.1 allows; a request missing
  ``:method``, ``:scheme`` or ``:path`` is reset; a stream id at or below one already used is a
  connection error, except frames the client sent before it saw our end of a stream (those are
  ignored: the last :data:`MAX_CLOSED_EARLY` such streams are remembered);
- DATA is delivered as it comes and the flow-control windows we grant are topped up whenever
  half has been used (connection and stream), so a request never waits for them (its size is
  bounded above this layer: :data:`dracpu.wire.grpc.MAX_MESSAGE`);
- our DATA waits for the peer's windows: what does not fit stays queued per stream (trailers
  after it) and goes out when WINDOW_UPDATE or SETTINGS open the window;
- RST_STREAM and GOAWAY are reported as events; our GOAWAY's last stream id never grows.

A stream error resets that stream (RST_STREAM, and a :class:`StreamReset` event with
``by_peer=False``); a connection error queues a GOAWAY naming the error, reports
:class:`ConnectionFailed`, and the connection ignores everything after (close the transport
once its bytes are written). No exception escapes :meth:`ServerConnection.receive_data` for
anything the peer sends; our own misuse (sending on a stream that is closed) raises
:class:`~dracpu.errors.LocalProtocolError`.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from dracpu.errors import LocalProtocolError, RemoteProtocolError
from dracpu.wire.hpack import Decoder, encode_header_block

__all__ = [
    "CONNECTION_WINDOW",
    "MAX_CLOSED_EARLY",
    "MAX_CONCURRENT_STREAMS",
    "MAX_FRAME_SIZE",
    "MAX_HEADER_LIST_SIZE",
    "PREFACE",
    "STREAM_WINDOW",
    "ConnectionFailed",
    "DataReceived",
    "ErrorCode",
    "Event",
    "GoAwayReceived",
    "RequestReceived",
    "ServerConnection",
    "StreamReset",
    "encode_header_block",
]

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 §6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
# Flags.
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Settings (RFC 9113 §6.5.2).
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS_ID = 1, 2, 3
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE_ID, MAX_HEADER_LIST_SIZE_ID = 4, 5, 6


class ErrorCode:
    """HTTP/2 error codes (RFC 9113 §7)."""

    NO_ERROR: Final = 0x0
    PROTOCOL_ERROR: Final = 0x1
    INTERNAL_ERROR: Final = 0x2
    FLOW_CONTROL_ERROR: Final = 0x3
    STREAM_CLOSED: Final = 0x5
    FRAME_SIZE_ERROR: Final = 0x6
    REFUSED_STREAM: Final = 0x7
    CANCEL: Final = 0x8
    COMPRESSION_ERROR: Final = 0x9
    ENHANCE_YOUR_CALM: Final = 0xB


DEFAULT_WINDOW: Final = 65_535
MAX_WINDOW: Final = 2**31 - 1
DEFAULT_FRAME_SIZE: Final = 16_384
MAX_FRAME_SIZE: Final = DEFAULT_FRAME_SIZE
"""The largest frame we accept (the protocol's default; we never announce more)."""
MAX_CONCURRENT_STREAMS: Final = 128
"""Streams a client may have open at once (the kubelet opens one per call)."""
MAX_HEADER_LIST_SIZE: Final = 16_384
"""Largest decoded header list we accept (RFC 9113 §6.5.2 size: names + values + 32 each)."""
MAX_CLOSED_EARLY: Final = 256
"""Streams we closed before the client ended them that we remember (to ignore its frames in
flight for them); twice the streams a client may have open."""
STREAM_WINDOW: Final = 1 << 20
"""The flow-control window we grant each stream (a request of up to 1 MiB flows without a
WINDOW_UPDATE)."""
CONNECTION_WINDOW: Final = 1 << 22
"""The flow-control window we grant the connection as a whole."""

_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")

_CONNECTION_SPECIFIC = frozenset(
    {"connection", "proxy-connection", "keep-alive", "transfer-encoding", "upgrade"}
)
_REQUIRED_PSEUDO = frozenset({":method", ":scheme", ":path"})
# RFC 9113 §8.2.1: a name is visible ASCII without upper case (a colon only to start a
# pseudo-header); a value has no NUL, CR or LF and neither starts nor ends with space or tab.
_FIELD_NAME = re.compile(r":?[!-9;-@\[-~]+")
_BAD_VALUE = re.compile(r"[\0\r\n]|^[ \t]|[ \t]\Z")
_REQUEST_PSEUDO = _REQUIRED_PSEUDO | {":authority"}


# --- events -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestReceived:
    """A stream was opened with a valid request header block."""

    stream_id: int
    headers: tuple[tuple[str, str], ...]
    end_stream: bool


@dataclass(frozen=True, slots=True)
class DataReceived:
    """Body bytes of a request (``end_stream``: nothing more comes; trailers end it with
    ``data=b""``)."""

    stream_id: int
    data: bytes
    end_stream: bool


@dataclass(frozen=True, slots=True)
class StreamReset:
    """The stream is gone: the peer reset it (``by_peer``) or we did for a stream error."""

    stream_id: int
    error_code: int
    by_peer: bool


@dataclass(frozen=True, slots=True)
class GoAwayReceived:
    """The peer opens no more streams; those up to ``last_stream_id`` may still complete."""

    error_code: int
    last_stream_id: int
    debug: bytes


@dataclass(frozen=True, slots=True)
class ConnectionFailed:
    """A connection error: our GOAWAY is queued; close the transport once it is written."""

    error_code: int
    reason: str


Event = RequestReceived | DataReceived | StreamReset | GoAwayReceived | ConnectionFailed


class _ConnectionError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class _StreamError(Exception):
    def __init__(self, stream_id: int, code: int, reason: str) -> None:
        super().__init__(reason)
        self.stream_id = stream_id
        self.code = code


# --- frames and header blocks -------------------------------------------------------------------


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (
        (len(payload) << 8 | kind).to_bytes(4, "big")
        + bytes((flags,))
        + stream_id.to_bytes(4, "big")
        + payload
    )


def _check_request_headers(stream_id: int, headers: Sequence[tuple[str, str]]) -> None:
    """RFC 9113 §8.2-8.3 for a request: a stream error ``PROTOCOL_ERROR`` when malformed."""
    seen: set[str] = set()
    regular = False
    for name, value in headers:
        if _FIELD_NAME.fullmatch(name) is None:
            raise _StreamError(stream_id, ErrorCode.PROTOCOL_ERROR, f"bad header name {name!r}")
        if _BAD_VALUE.search(value) is not None:
            raise _StreamError(stream_id, ErrorCode.PROTOCOL_ERROR, f"bad value of {name!r}")
        if name.startswith(":"):
            if regular or name not in _REQUEST_PSEUDO or name in seen:
                raise _StreamError(
                    stream_id, ErrorCode.PROTOCOL_ERROR, f"misplaced pseudo-header {name!r}"
                )
            seen.add(name)
            continue
        regular = True
        if name in _CONNECTION_SPECIFIC or (name == "te" and value != "trailers"):
            raise _StreamError(
                stream_id, ErrorCode.PROTOCOL_ERROR, f"connection-specific header {name!r}"
            )
    missing = _REQUIRED_PSEUDO - seen
    if missing:
        raise _StreamError(
            stream_id, ErrorCode.PROTOCOL_ERROR, f"request lacks {', '.join(sorted(missing))}"
        )


# --- the connection -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Stream:
    send_window: int
    receive_window: int = STREAM_WINDOW
    unacknowledged: int = 0  # received bytes not yet given back by a WINDOW_UPDATE
    remote_closed: bool = False  # the peer sent END_STREAM
    pending: bytearray = field(default_factory=bytearray)  # our DATA waiting for window
    end_after_pending: bool = False
    trailers_after_pending: bytes | None = None  # an encoded block, sent once pending is out


class ServerConnection:
    """One HTTP/2 connection, server side (see the module docstring)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self._preface_seen = False
        self._settings_seen = False
        self._failed = False
        self._goaway_sent = False
        self._decoder = Decoder(max_list_size=MAX_HEADER_LIST_SIZE)
        self._streams: dict[int, _Stream] = {}
        # Streams we closed (answered, reset, refused, ignored) before the client ended them:
        # frames it had in flight for them are ignored (RFC 9113 §5.1). Oldest first, bounded.
        self._closed_early: dict[int, None] = {}
        self._last_stream_id = 0
        self._goaway_last: int | None = None  # the last stream id of our first GOAWAY
        self._send_window = DEFAULT_WINDOW
        self._receive_window = CONNECTION_WINDOW
        self._unacknowledged = 0
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_FRAME_SIZE
        self._first_block = True
        # A header block in progress: (stream id, END_STREAM of its HEADERS, fragments).
        self._continuing: tuple[int, bool, list[bytes]] | None = None

    # --- state for the adapter ---

    @property
    def failed(self) -> bool:
        """A connection error happened; nothing more is read."""
        return self._failed

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def is_open(self, stream_id: int) -> bool:
        """Whether ``stream_id`` may still be answered (never after a connection error)."""
        return stream_id in self._streams and not self._failed

    def data_to_send(self) -> bytes:
        """The bytes queued for the peer (and forget them)."""
        if not self._out:
            return b""
        out = b"".join(self._out)
        self._out.clear()
        return out

    # --- sending ---

    def initiate(self) -> bytes:
        """Our SETTINGS and the connection window beyond the default: the first bytes to send."""
        settings = b"".join(
            _SETTING.pack(key, value)
            for key, value in (
                (ENABLE_PUSH, 0),
                (MAX_CONCURRENT_STREAMS_ID, MAX_CONCURRENT_STREAMS),
                (INITIAL_WINDOW_SIZE, STREAM_WINDOW),
                (MAX_HEADER_LIST_SIZE_ID, MAX_HEADER_LIST_SIZE),
            )
        )
        self._out.append(_frame(SETTINGS, 0, 0, settings))
        self._out.append(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONNECTION_WINDOW - DEFAULT_WINDOW)))
        return self.data_to_send()

    def send_headers(
        self, stream_id: int, headers: Iterable[tuple[str, str]], *, end_stream: bool = False
    ) -> None:
        """Queue a header block (the response head, or trailers with ``end_stream``).

        Trailers wait behind DATA still queued for flow control. Raises
        :class:`LocalProtocolError` if the stream is not open.
        """
        stream = self._open_stream(stream_id)
        block = encode_header_block(headers, first=self._first_block)
        self._first_block = False
        if stream.end_after_pending or stream.trailers_after_pending is not None:
            raise LocalProtocolError(f"stream {stream_id} already ended")
        if end_stream and stream.pending:
            stream.trailers_after_pending = block
            return
        self._queue_block(stream_id, block, end_stream)
        if end_stream:
            self._close(stream_id)

    def send_data(self, stream_id: int, data: bytes, *, end_stream: bool = False) -> None:
        """Queue body bytes; what the peer's windows do not allow yet waits for them."""
        stream = self._open_stream(stream_id)
        if stream.trailers_after_pending is not None or stream.end_after_pending:
            raise LocalProtocolError(f"stream {stream_id} already ended")
        stream.pending += data
        stream.end_after_pending = end_stream
        self._flush(stream_id, stream)

    def reset_stream(self, stream_id: int, error_code: int = ErrorCode.CANCEL) -> None:
        """Reset an open stream (nothing happens if it is already closed)."""
        if stream_id in self._streams:
            self._close(stream_id)
            self._out.append(_frame(RST_STREAM, 0, stream_id, _U32.pack(error_code)))

    def close(self, error_code: int = ErrorCode.NO_ERROR, reason: str = "") -> None:
        """Queue a GOAWAY: streams opened after it are ignored, open ones may finish."""
        if not self._goaway_sent and not self._failed:
            self._goaway(error_code, reason)

    def _close(self, stream_id: int) -> None:
        """Forget an open stream we end (remembering it if the client has not ended it)."""
        stream = self._streams.pop(stream_id, None)
        if stream is None or not stream.remote_closed:
            self._closed_early[stream_id] = None
            if len(self._closed_early) > MAX_CLOSED_EARLY:
                del self._closed_early[next(iter(self._closed_early))]

    def _open_stream(self, stream_id: int) -> _Stream:
        stream = self._streams.get(stream_id)
        if stream is None or self._failed:
            raise LocalProtocolError(f"stream {stream_id} is not open")
        return stream

    def _queue_block(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        size = self._peer_max_frame
        flags = END_STREAM if end_stream else 0
        if len(block) <= size:
            self._out.append(_frame(HEADERS, flags | END_HEADERS, stream_id, block))
            return
        chunks = [block[i : i + size] for i in range(0, len(block), size)]
        self._out.append(_frame(HEADERS, flags, stream_id, chunks[0]))
        for chunk in chunks[1:-1]:
            self._out.append(_frame(CONTINUATION, 0, stream_id, chunk))
        self._out.append(_frame(CONTINUATION, END_HEADERS, stream_id, chunks[-1]))

    def _flush(self, stream_id: int, stream: _Stream) -> None:
        """Send what the windows allow of ``stream``'s queued DATA, then its end if all is out."""
        while stream.pending:
            allowed = min(stream.send_window, self._send_window, self._peer_max_frame)
            if allowed <= 0:
                return
            chunk = bytes(stream.pending[:allowed])
            del stream.pending[:allowed]
            stream.send_window -= len(chunk)
            self._send_window -= len(chunk)
            last = not stream.pending and stream.end_after_pending
            self._out.append(_frame(DATA, END_STREAM if last else 0, stream_id, chunk))
            if last:
                self._close(stream_id)
                return
        if stream.end_after_pending:  # an empty DATA with END_STREAM
            self._out.append(_frame(DATA, END_STREAM, stream_id))
            self._close(stream_id)
        elif stream.trailers_after_pending is not None:
            self._queue_block(stream_id, stream.trailers_after_pending, True)
            self._close(stream_id)

    def _flush_all(self) -> None:
        for stream_id, stream in list(self._streams.items()):
            if stream.pending or stream.trailers_after_pending is not None:
                self._flush(stream_id, stream)

    def _goaway(self, code: int, reason: str) -> None:
        self._goaway_sent = True
        if self._goaway_last is None:  # a later GOAWAY never raises it (RFC 9113 §6.8)
            self._goaway_last = self._last_stream_id
        payload = _U32.pack(self._goaway_last) + _U32.pack(code) + reason.encode()[:256]
        self._out.append(_frame(GOAWAY, 0, 0, payload))

    # --- receiving ---

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed bytes from the peer; the events they complete (see the module docstring)."""
        if self._failed:
            return []
        self._buffer += data
        events: list[Event] = []
        try:
            if not self._preface_seen:
                if len(self._buffer) < len(PREFACE):
                    if not PREFACE.startswith(bytes(self._buffer)):
                        raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "no HTTP/2 preface")
                    return events
                if bytes(self._buffer[: len(PREFACE)]) != PREFACE:
                    raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "no HTTP/2 preface")
                del self._buffer[: len(PREFACE)]
                self._preface_seen = True
            while len(self._buffer) >= 9:
                head = int.from_bytes(self._buffer[:4], "big")
                length, kind = head >> 8, head & 0xFF
                if length > MAX_FRAME_SIZE:
                    raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                if len(self._buffer) < 9 + length:
                    break
                flags = self._buffer[4]
                stream_id = int.from_bytes(self._buffer[5:9], "big") & 0x7FFF_FFFF
                payload = bytes(self._buffer[9 : 9 + length])
                del self._buffer[: 9 + length]
                try:
                    self._frame_received(kind, flags, stream_id, payload, events)
                except _StreamError as exc:
                    self._close(exc.stream_id)
                    self._out.append(_frame(RST_STREAM, 0, exc.stream_id, _U32.pack(exc.code)))
                    events.append(StreamReset(exc.stream_id, exc.code, by_peer=False))
        except _ConnectionError as exc:
            self._failed = True
            self._buffer.clear()
            self._goaway(exc.code, exc.reason)
            events.append(ConnectionFailed(exc.code, exc.reason))
        return events

    def _frame_received(
        self, kind: int, flags: int, stream_id: int, payload: bytes, events: list[Event]
    ) -> None:
        if self._continuing is not None and kind != CONTINUATION:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "a header block was interrupted")
        if not self._settings_seen:
            if kind != SETTINGS or flags & ACK:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "the preface lacks SETTINGS")
            self._settings_seen = True
        if kind == DATA:
            self._data(flags, stream_id, payload, events)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload, events)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload, events)
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == PING:
            if stream_id:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "PING is not 8 bytes")
            if not flags & ACK:
                self._out.append(_frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            self._rst_stream(stream_id, payload, events)
        elif kind == GOAWAY:
            if stream_id:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
            if len(payload) < 8:
                raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "GOAWAY is too short")
            last = _U32.unpack_from(payload)[0] & 0x7FFF_FFFF
            events.append(GoAwayReceived(_U32.unpack_from(payload, 4)[0], last, payload[8:]))
        elif kind == PRIORITY:
            if not stream_id:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                if stream_id > self._last_stream_id:  # no RST_STREAM on an idle stream
                    raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "PRIORITY size")
                raise _StreamError(stream_id, ErrorCode.FRAME_SIZE_ERROR, "PRIORITY size")
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "a client sent PUSH_PROMISE")
        # Unknown frame types are ignored (RFC 9113 §5.5).

    @staticmethod
    def _unpad(flags: int, payload: bytes, what: str) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, f"{what} padding is too long")
        return payload[1 : len(payload) - payload[0]]

    def _data(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if not stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        # The whole frame, padding included, counts against the windows (RFC 9113 §6.9.1).
        if len(payload) > self._receive_window:
            raise _ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "the peer overran our window")
        self._receive_window -= len(payload)
        self._unacknowledged += len(payload)
        if self._unacknowledged >= CONNECTION_WINDOW // 2:
            self._out.append(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._unacknowledged)))
            self._receive_window += self._unacknowledged
            self._unacknowledged = 0
        data = self._unpad(flags, payload, "DATA")
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_stream_id:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "DATA on an idle stream")
            if stream_id not in self._closed_early:  # the client itself had ended it
                raise _ConnectionError(ErrorCode.STREAM_CLOSED, "DATA after END_STREAM")
            if flags & END_STREAM:
                del self._closed_early[stream_id]
            return  # sent before it saw our end of the stream: ignore (RFC 9113 §5.1)
        if stream.remote_closed:
            raise _StreamError(stream_id, ErrorCode.STREAM_CLOSED, "DATA after END_STREAM")
        if len(payload) > stream.receive_window:
            raise _StreamError(stream_id, ErrorCode.FLOW_CONTROL_ERROR, "stream window overrun")
        stream.receive_window -= len(payload)
        end = bool(flags & END_STREAM)
        if end:
            stream.remote_closed = True
        else:
            stream.unacknowledged += len(payload)
            if stream.unacknowledged >= STREAM_WINDOW // 2:
                self._out.append(
                    _frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(stream.unacknowledged))
                )
                stream.receive_window += stream.unacknowledged
                stream.unacknowledged = 0
        if data or end:
            events.append(DataReceived(stream_id, data, end))

    def _headers(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if not stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        block = self._unpad(flags, payload, "HEADERS")
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "HEADERS priority is short")
            block = block[5:]
        end_stream = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._header_block(stream_id, end_stream, block, events)
        else:
            self._continuing = (stream_id, end_stream, [block])

    def _continuation(
        self, flags: int, stream_id: int, payload: bytes, events: list[Event]
    ) -> None:
        if self._continuing is None or self._continuing[0] != stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "an unexpected CONTINUATION")
        fragments = self._continuing[2]
        fragments.append(payload)
        if sum(map(len, fragments)) > MAX_HEADER_LIST_SIZE:
            raise _ConnectionError(ErrorCode.ENHANCE_YOUR_CALM, "a header block is too large")
        if flags & END_HEADERS:
            end_stream = self._continuing[1]
            self._continuing = None
            self._header_block(stream_id, end_stream, b"".join(fragments), events)

    def _header_block(
        self, stream_id: int, end_stream: bool, block: bytes, events: list[Event]
    ) -> None:
        # Decode first, whatever becomes of the stream: the HPACK state is the connection's.
        try:
            headers = tuple(self._decoder.decode(block))
        except RemoteProtocolError as exc:
            raise _ConnectionError(ErrorCode.COMPRESSION_ERROR, str(exc)) from exc
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers of a request
            if stream.remote_closed:
                raise _StreamError(stream_id, ErrorCode.STREAM_CLOSED, "HEADERS after END_STREAM")
            if not end_stream:
                raise _StreamError(stream_id, ErrorCode.PROTOCOL_ERROR, "trailers without end")
            stream.remote_closed = True
            events.append(DataReceived(stream_id, b"", True))
            return
        if stream_id <= self._last_stream_id:
            if stream_id not in self._closed_early:  # RFC 9113 §5.1.1: stream ids only grow
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "HEADERS on a closed stream")
            if end_stream:  # the client's trailers, sent before it saw our end: ignore
                del self._closed_early[stream_id]
            return
        if stream_id % 2 == 0:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "a client opened an even stream")
        self._last_stream_id = stream_id
        if self._goaway_sent:
            self._close(stream_id)  # after our GOAWAY new streams are ignored (RFC 9113 §6.8)
            return
        if len(self._streams) >= MAX_CONCURRENT_STREAMS:
            raise _StreamError(stream_id, ErrorCode.REFUSED_STREAM, "too many streams")
        _check_request_headers(stream_id, headers)
        self._streams[stream_id] = _Stream(
            send_window=self._peer_initial_window, remote_closed=end_stream
        )
        events.append(RequestReceived(stream_id, headers, end_stream))

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS size")
        for offset in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, offset)
            if key == ENABLE_PUSH and value > 1:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "ENABLE_PUSH must be 0 or 1")
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "window too large")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self._streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise _ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "window overflow")
            elif key == MAX_FRAME_SIZE_ID:
                if not DEFAULT_FRAME_SIZE <= value <= 2**24 - 1:
                    raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "MAX_FRAME_SIZE range")
                self._peer_max_frame = value
            # HEADER_TABLE_SIZE: our blocks never use the dynamic table (size 0 from our first
            # block on), so any value is fine; the others do not concern a server.
        self._out.append(_frame(SETTINGS, ACK, 0))
        self._flush_all()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE is not 4 bytes")
        increment = _U32.unpack(payload)[0] & 0x7FFF_FFFF
        if not stream_id:
            if not increment:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "a zero WINDOW_UPDATE")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise _ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "window overflow")
            self._flush_all()
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_stream_id:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE on idle stream")
            return
        if not increment:
            raise _StreamError(stream_id, ErrorCode.PROTOCOL_ERROR, "a zero WINDOW_UPDATE")
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            raise _StreamError(stream_id, ErrorCode.FLOW_CONTROL_ERROR, "window overflow")
        if stream.pending or stream.trailers_after_pending is not None:
            self._flush(stream_id, stream)

    def _rst_stream(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if not stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM is not 4 bytes")
        if stream_id > self._last_stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        if stream_id in self._streams:
            self._streams[stream_id].remote_closed = False  # remembered: its late frames ignored
            self._close(stream_id)
            events.append(StreamReset(stream_id, _U32.unpack(payload)[0], by_peer=True))
