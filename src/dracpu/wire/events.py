"""Events of the NRI wire protocols: what ``next_event()`` returns (h11 style).

Two framing layers share one unix socket (containerd/nri ``pkg/net/multiplex``; containerd/ttrpc
``channel.go``):

* the mux cuts the socket into frames ``conn_id u32 | length u32 | payload`` (big-endian) and
  yields :class:`MuxFrame`;
* each mux connection carries a ttrpc byte stream of messages
  ``length u32 | stream_id u32 | type u8 | flags u8 | data`` (big-endian), yielding
  :class:`TtrpcRequest`, :class:`TtrpcResponse` and :class:`TtrpcStreamError`. The data of a
  message is a protobuf envelope; the framing carries it as bytes.

Events are frozen, slotted dataclasses compared by value. ``NEED_DATA`` is an identity sentinel
(compare with ``is``): feed more bytes with ``receive_data``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "NEED_DATA",
    "ConnectionClosed",
    "MuxFrame",
    "NeedData",
    "Sentinel",
    "TtrpcRequest",
    "TtrpcResponse",
    "TtrpcStreamError",
]


class Sentinel(enum.Enum):
    """Identity sentinels returned by ``next_event()`` instead of an event."""

    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return self.value


NEED_DATA: Final = Sentinel.NEED_DATA
"""No complete event is buffered: call ``receive_data`` with more bytes (or ``b""`` at EOF)."""

NeedData = Literal[Sentinel.NEED_DATA]


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """The peer closed the byte stream cleanly, at a frame/message boundary."""


@dataclass(frozen=True, slots=True)
class MuxFrame:
    """One frame of the NRI multiplexer: a chunk of the byte stream of ``conn_id``.

    A frame is not a message: a ttrpc message may span two frames (:mod:`dracpu.wire.mux`), so
    feed ``payload`` to the ttrpc connection of ``conn_id``, which reassembles the stream.
    """

    conn_id: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class TtrpcRequest:
    """A request message (type 1) that a server must answer on ``stream_id``.

    ``data`` is the serialized ``ttrpc.Request`` envelope (service, method, the inner request,
    timeout, metadata); its decoding is the envelope codec's (``dracpu.adapters``), not the
    framing's.
    """

    stream_id: int
    data: bytes


@dataclass(frozen=True, slots=True)
class TtrpcResponse:
    """The response message (type 2) to the request this client sent on ``stream_id``.

    ``data`` is the serialized ``ttrpc.Response`` envelope (a ``google.rpc.Status`` and the
    inner response).
    """

    stream_id: int
    data: bytes


@dataclass(frozen=True, slots=True)
class TtrpcStreamError:
    """A stream that the framing itself ended with a status, as the Go implementation does.

    Emitted for a message longer than the 4 MiB limit, once its bytes are discarded: a server
    owes the peer this status as the request's answer (the connection stays usable), a client
    reads it as the call's result.
    """

    stream_id: int
    status_code: int
    status_message: str
