"""Events of the NRI wire protocols: what ``next_event()`` returns (h11 style).

Two framing layers share one unix socket (containerd/nri ``pkg/net/multiplex``; containerd/ttrpc
``channel.go``; see ``reference/nri-ttrpc-cdi.md`` §1-§2):

* the mux cuts the socket into frames ``conn_id u32 | length u32 | payload`` (big-endian) and
  yields :class:`MuxFrame`;
* each mux connection carries a ttrpc byte stream of messages
  ``length u32 | stream_id u32 | type u8 | flags u8 | data`` (big-endian), yielding
  :class:`TtrpcRequest`, :class:`TtrpcResponse` and :class:`TtrpcBadRequest`.

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
    "TtrpcBadRequest",
    "TtrpcRequest",
    "TtrpcResponse",
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

    A frame is not a message: a ttrpc message may span two frames (§2.3), so feed ``payload``
    to the ttrpc connection of ``conn_id``, which reassembles the stream.
    """

    conn_id: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class TtrpcRequest:
    """A unary ttrpc call (message type 1) that a server must answer on ``stream_id``.

    ``payload`` is the serialized inner request (e.g. an NRI ``CreateContainerRequest``);
    ``metadata`` holds the ``ttrpc.KeyValue`` pairs in wire order (unknown keys are ignorable).
    """

    stream_id: int
    service: str
    method: str
    payload: bytes
    timeout_nano: int = 0
    metadata: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class TtrpcResponse:
    """The answer (message type 2) to the request this client sent on ``stream_id``.

    ``status_code`` 0 is success (Go servers omit the status, §1.4); anything else is a
    google.rpc code with ``status_message``, and then ``payload`` is normally empty.
    """

    stream_id: int
    status_code: int
    status_message: str
    payload: bytes


@dataclass(frozen=True, slots=True)
class TtrpcBadRequest:
    """A request the server cannot accept, yet must answer, as the Go server does.

    Emitted for a request longer than the 4 MiB limit (RESOURCE_EXHAUSTED, its bytes discarded)
    and for one whose envelope does not parse (INVALID_ARGUMENT). The connection stays usable:
    answer with ``send_error(stream_id, status_code, status_message)``.
    """

    stream_id: int
    status_code: int
    status_message: str
