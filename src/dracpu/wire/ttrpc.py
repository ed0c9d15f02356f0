"""Sans-IO ttrpc framing: one connection's byte stream in, messages out (containerd/ttrpc).

Framing (``channel.go``)::

    +------------------+------------------+---------+----------+----------------------+
    | length u32 (BE)  | stream id u32    | type u8 | flags u8 | data (length bytes)  |
    +------------------+------------------+---------+----------+----------------------+

``length`` counts only the data and may be at most 4 MiB. Types: 1 request (data is a
``ttrpc.Request``), 2 response (a ``ttrpc.Response``), 3 data (streaming only, never used by NRI).
A client opens a stream per call with an odd id, 1, 3, 5, ... strictly increasing; the server
answers once, on the same id, possibly out of order.

This module is the framing and the stream rules only: a message's data (the protobuf envelope)
goes in and comes out as bytes; :mod:`dracpu.adapters.ttrpc_envelopes` encodes and decodes it
with Google's protobuf runtime. A server that cannot decode a request's envelope still owes the
peer an answer on that stream (Go: INVALID_ARGUMENT "unmarshal request error"); a client that
cannot decode a response's envelope must drop the connection.

What happens on a violation, modelled on the Go implementation where it keeps the connection:

* a message longer than 4 MiB: its bytes are discarded without buffering; a server then owes
  the peer RESOURCE_EXHAUSTED "message length N exceed maximum message size of 4194304", a
  client reads that status as the stream's result (event :class:`TtrpcStreamError`);
* a message type other than 1-3 sent to a server: ignored "for future compat", as Go does.

Everything else (an even or reused stream id, a response to no outstanding request, data
frames, EOF inside a message) raises :class:`RemoteProtocolError`, and the connection stays
broken: drop it. Go answers some of these with INVALID_ARGUMENT instead; a runtime that does
them is broken, and NRI recovers by reconnecting. Sending what the protocol forbids raises
:class:`LocalProtocolError` and changes nothing, so after an oversized response the stream can
still be answered with an error.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import NoReturn

from dracpu.errors import LocalProtocolError, RemoteProtocolError
from dracpu.wire._buffer import ReceiveBuffer
from dracpu.wire.events import (
    NEED_DATA,
    ConnectionClosed,
    NeedData,
    TtrpcRequest,
    TtrpcResponse,
    TtrpcStreamError,
)
from dracpu.wire.status import Code

__all__ = [
    "FLAG_NO_DATA",
    "FLAG_REMOTE_CLOSED",
    "FLAG_REMOTE_OPEN",
    "TTRPC_HEADER_LEN",
    "TTRPC_MAX_DATA_LEN",
    "Code",
    "MessageHeader",
    "MessageType",
    "Role",
    "TtrpcConnection",
    "TtrpcEvent",
]

TTRPC_HEADER = struct.Struct(">IIBB")  # channel.go readMessageHeader: length, stream, type, flags
TTRPC_HEADER_LEN = 10  # channel.go messageHeaderLength
TTRPC_MAX_DATA_LEN = 4 << 20  # channel.go messageLengthMax (header not counted)
FIRST_STREAM_ID = 1  # client.go NewClient: nextStreamID: 1
STREAM_ID_STEP = 2  # client.go createStream: client ids stay odd (even ids: server-initiated)
MAX_STREAM_ID = 0xFFFF_FFFF  # the stream id is a uint32 on the wire
FLAG_REMOTE_CLOSED = 0x1  # channel.go flagRemoteClosed (streaming only)
FLAG_REMOTE_OPEN = 0x2  # channel.go flagRemoteOpen (streaming only)
FLAG_NO_DATA = 0x4  # channel.go flagNoData (streaming only)


class MessageType(enum.IntEnum):
    """ttrpc message types (channel.go ``messageType``)."""

    REQUEST = 1
    RESPONSE = 2
    DATA = 3


class Role(enum.Enum):
    """Which side of the calls on this connection we are."""

    CLIENT = "client"
    SERVER = "server"


TtrpcEvent = TtrpcRequest | TtrpcResponse | TtrpcStreamError | ConnectionClosed | NeedData


@dataclass(frozen=True, slots=True)
class MessageHeader:
    """The 10-byte header of a ttrpc message, for tools and tests (the parser inlines it)."""

    length: int
    stream_id: int
    type: int
    flags: int = 0

    def encode(self) -> bytes:
        try:
            return TTRPC_HEADER.pack(self.length, self.stream_id, self.type, self.flags)
        except struct.error as exc:
            raise LocalProtocolError(f"ttrpc: header {self} does not fit the wire") from exc

    @classmethod
    def decode(cls, data: bytes) -> MessageHeader:
        if len(data) < TTRPC_HEADER_LEN:
            raise RemoteProtocolError(f"ttrpc: a header needs 10 bytes, got {len(data)}")
        return cls(*TTRPC_HEADER.unpack_from(data))


def _oversize_message(length: int) -> str:
    # channel.go recv(): the exact text Go puts in the RESOURCE_EXHAUSTED status.
    return f"message length {length} exceed maximum message size of {TTRPC_MAX_DATA_LEN}"


def _frame(stream_id: int, message_type: MessageType, data: bytes) -> bytes:
    if len(data) > TTRPC_MAX_DATA_LEN:
        raise LocalProtocolError(
            f"ttrpc {message_type.name.lower()} of {len(data)} bytes on stream {stream_id} "
            f"exceeds the {TTRPC_MAX_DATA_LEN}-byte limit"
        )
    return TTRPC_HEADER.pack(len(data), stream_id, message_type, 0) + data


class TtrpcConnection:
    """One ttrpc connection (one NRI mux conn id), as a client or as a server.

    ``receive_data(b"")`` signals EOF. Call ``next_event()`` until it returns ``NEED_DATA``.
    """

    def __init__(self, role: Role) -> None:
        self._role = role
        self._buffer = ReceiveBuffer()
        self._eof = False
        self._error: str | None = None
        self._skip = 0  # bytes of an oversized or ignored message still to discard
        self._after_skip: TtrpcStreamError | None = None
        self._next_stream_id = FIRST_STREAM_ID  # client: id of the next request
        self._last_stream_id = 0  # server: highest request id seen
        self._outstanding: set[int] = set()  # streams still waiting for their response

    @property
    def role(self) -> Role:
        return self._role

    @property
    def outstanding(self) -> frozenset[int]:
        """Streams awaiting a response: sent by us (client) or owed by us (server)."""
        return frozenset(self._outstanding)

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not yet parsed (at most one message: 10 + 4 MiB)."""
        return len(self._buffer)

    # --- receiving ------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Feed bytes of this connection's stream; ``b""`` means the peer closed it."""
        if self._eof:
            raise LocalProtocolError("ttrpc: receive_data after EOF")
        if not data:
            self._eof = True
        elif self._skip:
            dropped = min(self._skip, len(data))
            self._skip -= dropped
            self._buffer.extend(memoryview(data)[dropped:])
        else:
            self._buffer.extend(data)

    def next_event(self) -> TtrpcEvent:
        """Parse the next event out of the received bytes."""
        if self._error is not None:
            raise RemoteProtocolError(self._error)
        while True:
            if self._skip:
                self._skip -= self._buffer.discard(self._skip)
                if self._skip:
                    break
            if self._after_skip is not None:
                event, self._after_skip = self._after_skip, None
                return event
            header = self._buffer.unpack_header(TTRPC_HEADER)
            if header is None:
                break
            length, stream_id, message_type, _flags = header
            wanted = self._check_header(stream_id, message_type)
            if not wanted or length > TTRPC_MAX_DATA_LEN:
                self._buffer.discard(TTRPC_HEADER_LEN)
                self._skip = length
                if wanted:
                    self._after_skip = self._oversized(length, stream_id)
                continue
            if len(self._buffer) < TTRPC_HEADER_LEN + length:
                break
            self._buffer.discard(TTRPC_HEADER_LEN)
            return self._handle(stream_id, self._buffer.take(length))
        if self._eof:
            if self._skip or len(self._buffer):
                self._fail("ttrpc: connection closed in the middle of a message")
            return ConnectionClosed()
        return NEED_DATA

    def _fail(self, message: str) -> NoReturn:
        self._error = message
        raise RemoteProtocolError(message)

    def _check_header(self, stream_id: int, message_type: int) -> bool:
        """Fail on a header no data can make valid (early, before buffering any data).

        ``False`` means: skip this message silently.
        """
        if self._role is Role.SERVER:
            if message_type == MessageType.REQUEST:
                if stream_id % 2 == 0:
                    self._fail(f"ttrpc: request on even stream id {stream_id}: ids must be odd")
                if stream_id <= self._last_stream_id:
                    self._fail(
                        f"ttrpc: request on stream id {stream_id}, not above the last one "
                        f"({self._last_stream_id}): ids must increase"
                    )
                return True
            if message_type in (MessageType.RESPONSE, MessageType.DATA):
                kind = MessageType(message_type).name.lower()
                self._fail(f"ttrpc: server received a {kind} message on stream {stream_id}")
            return False  # unknown type: Go's server ignores it (server.go, "future compat")
        if message_type != MessageType.RESPONSE:
            self._fail(f"ttrpc: client received message type {message_type} on stream {stream_id}")
        if stream_id not in self._outstanding:
            self._fail(f"ttrpc: response on stream {stream_id}, which has no request outstanding")
        return True

    def _oversized(self, length: int, stream_id: int) -> TtrpcStreamError:
        """What the stream gets for a message over the limit, once its bytes are discarded."""
        if self._role is Role.SERVER:
            self._last_stream_id = stream_id
            self._outstanding.add(stream_id)
        else:
            self._outstanding.discard(stream_id)
        return TtrpcStreamError(stream_id, Code.RESOURCE_EXHAUSTED, _oversize_message(length))

    def _handle(self, stream_id: int, data: bytes) -> TtrpcRequest | TtrpcResponse:
        """A complete message whose header ``_check_header`` accepted."""
        if self._role is Role.SERVER:
            self._last_stream_id = stream_id
            self._outstanding.add(stream_id)
            return TtrpcRequest(stream_id, data)
        self._outstanding.discard(stream_id)
        return TtrpcResponse(stream_id, data)

    # --- sending --------------------------------------------------------------------------

    def send_request(self, data: bytes) -> tuple[int, bytes]:
        """Start a unary call with the request envelope ``data``; its stream id and bytes."""
        if self._role is not Role.CLIENT:
            raise LocalProtocolError("ttrpc: a server connection cannot send requests")
        stream_id = self._next_stream_id
        if stream_id > MAX_STREAM_ID:
            raise LocalProtocolError("ttrpc: stream ids exhausted on this connection")
        message = _frame(stream_id, MessageType.REQUEST, data)
        self._next_stream_id += STREAM_ID_STEP
        self._outstanding.add(stream_id)
        return stream_id, message

    def send_response(self, stream_id: int, data: bytes) -> bytes:
        """Answer the request on ``stream_id`` with the response envelope ``data``."""
        self._check_answerable(stream_id)
        message = _frame(stream_id, MessageType.RESPONSE, data)
        self._outstanding.discard(stream_id)
        return message

    def _check_answerable(self, stream_id: int) -> None:
        if self._role is not Role.SERVER:
            raise LocalProtocolError("ttrpc: a client connection cannot send responses")
        if stream_id not in self._outstanding:
            raise LocalProtocolError(
                f"ttrpc: no request to answer on stream {stream_id} (never received or answered)"
            )
