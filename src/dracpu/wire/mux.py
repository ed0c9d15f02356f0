"""Sans-IO NRI multiplexer: the socket's bytes in, frames per logical connection out.

containerd/nri ``pkg/net/multiplex`` runs several byte streams over one unix socket::

    +---------------------+--------------------------+-------------------------+
    | conn id u32 (BE)    | payload length u32 (BE)  | payload (length bytes)  |
    +---------------------+--------------------------+-------------------------+

Conn 1 carries the runtime's calls to the plugin, conn 2 the plugin's calls to the runtime; conn 0
is reserved. Opening a conn sends nothing. A frame is a chunk of one conn's stream, not a message:
hand each :class:`MuxFrame` payload to that conn's :class:`~dracpu.wire.ttrpc.TtrpcConnection`,
which reassembles the ttrpc messages.

Receiving: frames for conn ids we did not open are dropped, as the Go reader drops them;
zero-length frames (Go's ``Write(nil)``) carry nothing and are skipped; a frame longer than
``MAX_PAYLOAD_SIZE`` or EOF inside a frame raises :class:`RemoteProtocolError`, so at most one
frame is ever buffered.

Sending (:meth:`MuxConnection.send`) follows the rule the Go reader needs: containerd/ttrpc
``channel.go`` reads the start of every message through a 4096-byte ``bufio.Reader``, and the
mux's ``Read`` fails with ENOMEM when a frame is longer than the buffer it is given. So a message
of at most 4096 bytes goes in one frame, a longer one in exactly two, the first 4096 bytes then
the rest, which is what Go's own ``bufio.Writer`` produces. Two messages never share a frame.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import NoReturn

from dracpu.errors import LocalProtocolError, RemoteProtocolError
from dracpu.wire._buffer import ReceiveBuffer
from dracpu.wire.events import NEED_DATA, ConnectionClosed, MuxFrame, NeedData
from dracpu.wire.ttrpc import TTRPC_HEADER_LEN, TTRPC_MAX_DATA_LEN

__all__ = [
    "FIRST_FRAME_MAX",
    "MAX_PAYLOAD_SIZE",
    "MUX_HEADER_LEN",
    "PLUGIN_SERVICE_CONN",
    "RUNTIME_SERVICE_CONN",
    "MuxConnection",
    "MuxEvent",
]

MUX_HEADER = struct.Struct(">II")  # mux.go write(): BigEndian conn id, then payload length
MUX_HEADER_LEN = 8  # mux.go headerLen: "4-byte ConnID, 4-byte payload length"
RESERVED_CONN_ID = 0  # mux.go reservedConnID: Open(0) is an error
MAX_CONN_ID = 0xFFFF_FFFF  # mux.go ConnID is a uint32
PLUGIN_SERVICE_CONN = 1  # ttrpc.go PluginServiceConn: runtime -> plugin calls, plugin serves
RUNTIME_SERVICE_CONN = 2  # ttrpc.go RuntimeServiceConn: plugin -> runtime calls, runtime serves
MAX_PAYLOAD_SIZE = TTRPC_HEADER_LEN + TTRPC_MAX_DATA_LEN  # mux.go maxPayloadSize (4194314)
FIRST_FRAME_MAX = 4096  # Go bufio defaultBufSize, the buffer ttrpc channel.go reads through

MuxEvent = MuxFrame | ConnectionClosed | NeedData


class MuxConnection:
    """The NRI socket's multiplexer, one per socket connection.

    ``conn_ids`` are the logical connections we opened; frames for others are dropped
    (counted in ``dropped_frames``).
    """

    def __init__(
        self, conn_ids: Iterable[int] = (PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN)
    ) -> None:
        self._conn_ids = frozenset(conn_ids)
        for conn_id in self._conn_ids:
            _check_conn_id(conn_id)
        self._buffer = ReceiveBuffer()
        self._eof = False
        self._error: str | None = None
        self.dropped_frames = 0

    @property
    def conn_ids(self) -> frozenset[int]:
        return self._conn_ids

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not yet parsed (one partial frame after ``next_event``)."""
        return len(self._buffer)

    def receive_data(self, data: bytes) -> None:
        """Feed bytes read from the socket; ``b""`` means the peer closed it."""
        if self._eof:
            raise LocalProtocolError("mux: receive_data after EOF")
        if data:
            self._buffer.extend(data)
        else:
            self._eof = True

    def next_event(self) -> MuxEvent:
        """Return the next frame of an opened conn, ``ConnectionClosed`` or ``NEED_DATA``."""
        if self._error is not None:
            raise RemoteProtocolError(self._error)
        while (header := self._buffer.unpack_header(MUX_HEADER)) is not None:
            conn_id, length = header
            if length > MAX_PAYLOAD_SIZE:
                self._fail(
                    f"mux: frame for conn {conn_id} declares {length} bytes, "
                    f"more than the {MAX_PAYLOAD_SIZE}-byte limit"
                )
            if len(self._buffer) < MUX_HEADER_LEN + length:
                break
            self._buffer.discard(MUX_HEADER_LEN)
            if conn_id not in self._conn_ids:
                self._buffer.discard(length)
                self.dropped_frames += 1
            elif length:
                return MuxFrame(conn_id, self._buffer.take(length))
        if self._eof:
            if len(self._buffer):
                self._fail(f"mux: socket closed inside a frame ({len(self._buffer)} bytes of it)")
            return ConnectionClosed()
        return NEED_DATA

    def _fail(self, message: str) -> NoReturn:
        self._error = message
        raise RemoteProtocolError(message)

    def send(self, conn_id: int, message: bytes) -> bytes:
        """Frame one whole ttrpc message for ``conn_id``; write the result in one go."""
        _check_conn_id(conn_id)
        size = len(message)
        if size == 0:
            raise LocalProtocolError("mux: refusing to send an empty message (a no-op frame)")
        if size > MAX_PAYLOAD_SIZE:
            raise LocalProtocolError(
                f"mux: message of {size} bytes exceeds the {MAX_PAYLOAD_SIZE}-byte limit"
            )
        if size <= FIRST_FRAME_MAX:
            return MUX_HEADER.pack(conn_id, size) + message
        view = memoryview(message)
        return b"".join(
            (
                MUX_HEADER.pack(conn_id, FIRST_FRAME_MAX),
                view[:FIRST_FRAME_MAX],
                MUX_HEADER.pack(conn_id, size - FIRST_FRAME_MAX),
                view[FIRST_FRAME_MAX:],
            )
        )


def _check_conn_id(conn_id: int) -> None:
    if not RESERVED_CONN_ID < conn_id <= MAX_CONN_ID:
        raise LocalProtocolError(f"mux: conn id {conn_id} is not in 1 .. {MAX_CONN_ID}")
