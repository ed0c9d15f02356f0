"""The fake runtime's own NRI framing: mux frames, ttrpc messages and Go's reader constraints.

This module shares no code with ``dracpu.wire`` on purpose: the fake runtime is the independent
peer our NRI plugin is tested against, so its framing is written again from the facts of
containerd/nri ``pkg/net/multiplex`` and containerd/ttrpc ``channel.go``, and the ttrpc envelope
(``ttrpc.Request`` / ``ttrpc.Response``) is encoded with Google's protobuf runtime, from the
simulator's own generated tree.

Wire layout::

    mux frame     : conn_id u32 BE | length u32 BE | payload          (nri pkg/net/multiplex)
    ttrpc message : length u32 BE | stream_id u32 BE | type u8 | flags u8 | data  (ttrpc)

Sending (:func:`mux_frames`) copies what a Go runtime writes through its 4096-byte
``bufio.Writer``: a ttrpc message of at most 4096 bytes is one frame, a longer one is two frames,
the first 4096 bytes and then the rest (a message never exceeds 10 + 4 MiB bytes).

Receiving (:class:`GoChannelReader`) models how the Go runtime reads one mux conn: ttrpc reads
the 10-byte header, then the data, through a 4096-byte ``bufio.Reader`` over the mux conn, whose
``Read`` hands over one whole frame and fails with ENOMEM if the frame is larger than the buffer
it reads into. In strict mode a frame the Go runtime could not read kills the
connection with :class:`FramingError`, so a plugin that frames badly fails here as it would
against containerd.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass

from dracpu.errors import RemoteProtocolError
from dracpu.sim._pb2.google.rpc import status_pb2
from dracpu.sim._pb2.ttrpc import request_pb2

__all__ = [
    "BUFIO_SIZE",
    "MUX_HEADER",
    "MUX_HEADER_LEN",
    "MUX_MAX_PAYLOAD",
    "PLUGIN_SERVICE_CONN",
    "RUNTIME_SERVICE_CONN",
    "TTRPC_HEADER",
    "TTRPC_HEADER_LEN",
    "TTRPC_MAX_DATA",
    "TYPE_DATA",
    "TYPE_REQUEST",
    "TYPE_RESPONSE",
    "FramingError",
    "GoChannelReader",
    "MuxFrameParser",
    "TtrpcMessage",
    "decode_request",
    "decode_response",
    "mux_frames",
    "request_message",
    "response_message",
    "ttrpc_message",
]

MUX_HEADER = struct.Struct(">II")  # nri mux.go write(): BigEndian conn id, payload length
MUX_HEADER_LEN = 8  # nri mux.go headerLen
TTRPC_HEADER = struct.Struct(">IIBB")  # ttrpc channel.go: length, stream id, type, flags
TTRPC_HEADER_LEN = 10  # ttrpc channel.go messageHeaderLength
TTRPC_MAX_DATA = 4 << 20  # ttrpc channel.go messageLengthMax (header not counted)
MUX_MAX_PAYLOAD = TTRPC_HEADER_LEN + TTRPC_MAX_DATA  # nri mux.go maxPayloadSize (4194314)
BUFIO_SIZE = 4096  # Go bufio defaultBufSize: ttrpc channel.go reads and writes through it
PLUGIN_SERVICE_CONN = 1  # nri multiplex/ttrpc.go PluginServiceConn: runtime calls plugin
RUNTIME_SERVICE_CONN = 2  # nri multiplex/ttrpc.go RuntimeServiceConn: plugin calls runtime
TYPE_REQUEST = 1  # ttrpc channel.go messageTypeRequest
TYPE_RESPONSE = 2  # ttrpc channel.go messageTypeResponse
TYPE_DATA = 3  # ttrpc channel.go messageTypeData (streaming only; NRI never uses it)


class FramingError(RemoteProtocolError):
    """The plugin framed its bytes in a way the Go runtime could not read."""


@dataclass(frozen=True, slots=True)
class TtrpcMessage:
    """One ttrpc message as it came off a mux conn."""

    stream_id: int
    type: int
    flags: int
    data: bytes
    oversized: int = 0  # declared length when it exceeded 4 MiB (data is then empty)


# --- sending ----------------------------------------------------------------------------------


def ttrpc_message(stream_id: int, message_type: int, data: bytes, flags: int = 0) -> bytes:
    """A whole ttrpc message: the 10-byte header, then ``data``."""
    return TTRPC_HEADER.pack(len(data), stream_id, message_type, flags) + data


def mux_frames(conn_id: int, message: bytes) -> list[bytes]:
    """The mux frames (header included) a Go runtime writes for one ttrpc message."""
    if not message or len(message) > MUX_MAX_PAYLOAD:
        raise ValueError(f"a ttrpc message has 10 .. {MUX_MAX_PAYLOAD} bytes, not {len(message)}")
    if len(message) <= BUFIO_SIZE:
        return [MUX_HEADER.pack(conn_id, len(message)) + message]
    head, rest = message[:BUFIO_SIZE], message[BUFIO_SIZE:]
    return [MUX_HEADER.pack(conn_id, len(head)) + head, MUX_HEADER.pack(conn_id, len(rest)) + rest]


def request_message(
    stream_id: int, service: str, method: str, payload: bytes, timeout_nano: int = 0
) -> bytes:
    """A ttrpc Request message (flags 0: unary), envelope encoded by Google protobuf."""
    envelope = request_pb2.Request(
        service=service, method=method, payload=payload, timeout_nano=timeout_nano
    )
    return ttrpc_message(stream_id, TYPE_REQUEST, envelope.SerializeToString(deterministic=True))


def response_message(
    stream_id: int, payload: bytes = b"", *, code: int = 0, message: str = ""
) -> bytes:
    """A ttrpc Response as a Go server sends it: payload only on success, status only on error."""
    envelope = request_pb2.Response()
    if code:
        envelope.status.CopyFrom(status_pb2.Status(code=code, message=message))
    else:
        envelope.payload = payload
    return ttrpc_message(stream_id, TYPE_RESPONSE, envelope.SerializeToString(deterministic=True))


# --- receiving --------------------------------------------------------------------------------


def decode_request(data: bytes) -> request_pb2.Request:
    """Parse a ttrpc Request envelope (raises ``google.protobuf.message.DecodeError``)."""
    return request_pb2.Request.FromString(data)


def decode_response(data: bytes) -> request_pb2.Response:
    """Parse a ttrpc Response envelope (raises ``google.protobuf.message.DecodeError``)."""
    return request_pb2.Response.FromString(data)


class MuxFrameParser:
    """Cuts the socket's byte stream into ``(conn_id, payload)`` frames."""

    def __init__(self, max_payload: int = MUX_MAX_PAYLOAD) -> None:
        self._buffer = bytearray()
        self._max_payload = max_payload

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buffer += data
        frames: list[tuple[int, bytes]] = []
        while len(self._buffer) >= MUX_HEADER_LEN:
            conn_id, length = MUX_HEADER.unpack_from(self._buffer)
            if length > self._max_payload:
                raise FramingError(
                    f"mux frame for conn {conn_id} declares {length} bytes "
                    f"(more than the {self._max_payload}-byte frame limit)"
                )
            end = MUX_HEADER_LEN + length
            if len(self._buffer) < end:
                break
            frames.append((conn_id, bytes(self._buffer[MUX_HEADER_LEN:end])))
            del self._buffer[:end]
        return frames


class GoChannelReader:
    """Reassembles one mux conn's ttrpc messages the way the Go runtime reads them.

    ttrpc ``channel.recv`` does ``io.ReadFull(bufio, header[:10])`` then
    ``io.ReadFull(bufio, data[:length])``; a bufio read with an empty buffer either fills the
    4096-byte buffer from one frame (request < 4096 bytes) or reads one frame straight into the
    destination (request >= 4096). A frame larger than what it is read into fails (ENOMEM, or a
    silently truncated copy): with ``strict`` that raises :class:`FramingError`. Without
    ``strict`` frames are just concatenated. A declared length above 4 MiB is discarded (through
    the buffer, as ``bufio.Discard`` does) and reported as a message with ``oversized`` set.
    """

    def __init__(self, *, strict: bool = True) -> None:
        self._strict = strict
        self._frames: deque[bytes] = deque()
        self._buffer = b""  # bytes held by the bufio.Reader
        self._got = bytearray()  # bytes of the current read
        self._header: tuple[int, int, int, int] | None = None
        self._discarding = False
        self._skipped = 0  # bytes of an oversized message discarded so far

    def feed(self, payload: bytes) -> list[TtrpcMessage]:
        """Add one frame's payload; return the messages it completes."""
        if payload:  # a zero-length frame is a 0-byte Read: nothing happens
            self._frames.append(payload)
        messages: list[TtrpcMessage] = []
        while (message := self._step()) is not None:
            messages.append(message)
        return messages

    @property
    def idle(self) -> bool:
        """True between messages with nothing buffered (EOF here is clean)."""
        return not (self._frames or self._buffer or self._got or self._header)

    def _need(self) -> int:
        if self._header is None:
            return TTRPC_HEADER_LEN - len(self._got)
        if self._discarding:
            return self._header[0] - self._skipped
        return self._header[0] - len(self._got)

    def _take(self, data: bytes) -> None:
        if self._discarding:
            self._skipped += len(data)
        else:
            self._got += data

    def _step(self) -> TtrpcMessage | None:
        while True:
            need = self._need()
            if need == 0:
                message = self._complete()
                if message is not None:
                    return message
                continue
            if self._buffer:
                take = self._buffer[:need]
                self._buffer = self._buffer[len(take) :]
                self._take(take)
                continue
            if not self._frames:
                return None
            frame = self._frames.popleft()
            if need >= BUFIO_SIZE and not self._discarding:
                # bufio.Read with len(p) >= 4096: the frame is copied straight into p.
                if self._strict and len(frame) > need:
                    raise FramingError(
                        f"a {len(frame)}-byte mux frame arrived where the Go reader reads at "
                        f"most {need} bytes (the rest of a ttrpc message): the runtime would "
                        "corrupt the stream"
                    )
                self._take(frame)
            else:
                # bufio.fill(): the frame goes into the 4096-byte buffer.
                if self._strict and len(frame) > BUFIO_SIZE:
                    raise FramingError(
                        f"a {len(frame)}-byte mux frame arrived where the Go reader fills its "
                        f"{BUFIO_SIZE}-byte buffer (e.g. at the start of a ttrpc message): the "
                        "runtime would fail the read with ENOMEM and drop the plugin"
                    )
                self._buffer = frame

    def _complete(self) -> TtrpcMessage | None:
        data = bytes(self._got)
        self._got.clear()
        if self._header is None:
            length, stream_id, message_type, flags = TTRPC_HEADER.unpack(data)
            self._header = (length, stream_id, message_type, flags)
            self._discarding = length > TTRPC_MAX_DATA
            if length == 0:
                return self._complete()
            return None
        length, stream_id, message_type, flags = self._header
        self._header = None
        if self._discarding:
            self._discarding = False
            self._skipped = 0
            return TtrpcMessage(stream_id, message_type, flags, b"", oversized=length)
        return TtrpcMessage(stream_id, message_type, flags, data)
