"""HTTP/2 frames and HPACK blocks built by hand for the h2 tests, from RFC 9113 §4.1 / §6 and
RFC 7541 §5-6 (not from :mod:`dracpu.wire.h2`, so the tests do not check the code against
itself), and a parser for the frames the server sends."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ACK",
    "GRPC_HEAD",
    "GRPC_PATH",
    "CONTINUATION",
    "DATA",
    "END_HEADERS",
    "END_STREAM",
    "GOAWAY",
    "HEADERS",
    "PADDED",
    "PING",
    "PREFACE",
    "PRIORITY",
    "PRIORITY_FLAG",
    "PUSH_PROMISE",
    "RST_STREAM",
    "SETTINGS",
    "WINDOW_UPDATE",
    "Frame",
    "continuation",
    "data",
    "frame",
    "goaway",
    "grpc_request_block",
    "headers",
    "hpack_integer",
    "indexed",
    "literal",
    "parse_frames",
    "ping",
    "rst_stream",
    "settings",
    "window_update",
]

# RFC 9113 §3.4.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 §6 / §11.2).
DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9

# Flags (RFC 9113 §6.1, §6.2, §6.5, §6.7).
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame as it is on the wire (RFC 9113 §4.1), the reserved bit dropped."""

    kind: int
    flags: int
    stream_id: int
    payload: bytes = b""

    @property
    def code(self) -> int:
        """The error code of a RST_STREAM or GOAWAY frame."""
        if self.kind == RST_STREAM:
            return int.from_bytes(self.payload[:4], "big")
        assert self.kind == GOAWAY
        return int.from_bytes(self.payload[4:8], "big")

    @property
    def last_stream_id(self) -> int:
        """The last stream id of a GOAWAY frame."""
        assert self.kind == GOAWAY
        return int.from_bytes(self.payload[:4], "big") & 0x7FFF_FFFF

    @property
    def increment(self) -> int:
        """The window increment of a WINDOW_UPDATE frame."""
        assert self.kind == WINDOW_UPDATE
        return int.from_bytes(self.payload, "big") & 0x7FFF_FFFF


def frame(
    kind: int, flags: int, stream_id: int, payload: bytes = b"", *, length: int | None = None
) -> bytes:
    """A frame: 24-bit length, type, flags, 31-bit stream id, payload (``length`` overrides the
    length field, to announce more than is sent)."""
    size = len(payload) if length is None else length
    return size.to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


def parse_frames(wire: bytes) -> list[Frame]:
    """The frames in ``wire``, which must hold whole frames only."""
    frames = []
    at = 0
    while at < len(wire):
        assert len(wire) - at >= 9, f"a cut frame header at {at}: {wire[at:]!r}"
        length = int.from_bytes(wire[at : at + 3], "big")
        kind, flags = wire[at + 3], wire[at + 4]
        stream_id = int.from_bytes(wire[at + 5 : at + 9], "big") & 0x7FFF_FFFF
        assert len(wire) - at - 9 >= length, f"a cut frame payload at {at}"
        frames.append(Frame(kind, flags, stream_id, wire[at + 9 : at + 9 + length]))
        at += 9 + length
    return frames


def _padded(payload: bytes, pad: int | None) -> tuple[int, bytes]:
    if pad is None:
        return 0, payload
    return PADDED, bytes((pad,)) + payload + b"\0" * pad


def settings(*pairs: tuple[int, int], ack: bool = False) -> bytes:
    """A SETTINGS frame (RFC 9113 §6.5): 16-bit identifier, 32-bit value, each."""
    payload = b"".join(key.to_bytes(2, "big") + value.to_bytes(4, "big") for key, value in pairs)
    return frame(SETTINGS, ACK if ack else 0, 0, payload)


def ping(opaque: bytes = b"12345678", *, ack: bool = False) -> bytes:
    return frame(PING, ACK if ack else 0, 0, opaque)


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, code.to_bytes(4, "big"))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, last_stream_id.to_bytes(4, "big") + code.to_bytes(4, "big") + debug)


def data(
    stream_id: int, payload: bytes, *, end_stream: bool = False, pad: int | None = None
) -> bytes:
    """A DATA frame, with ``pad`` bytes of padding (and the pad length byte) if given."""
    flags, body = _padded(payload, pad)
    return frame(DATA, flags | (END_STREAM if end_stream else 0), stream_id, body)


def headers(
    stream_id: int,
    block: bytes,
    *,
    end_stream: bool = False,
    end_headers: bool = True,
    pad: int | None = None,
    priority: bytes | None = None,
) -> bytes:
    """A HEADERS frame; ``priority``: the 5 bytes of the PRIORITY flag's fields."""
    flags = (END_STREAM if end_stream else 0) | (END_HEADERS if end_headers else 0)
    if priority is not None:
        flags |= PRIORITY_FLAG
        block = priority + block
    pad_flag, body = _padded(block, pad)
    return frame(HEADERS, flags | pad_flag, stream_id, body)


def continuation(stream_id: int, block: bytes, *, end_headers: bool = True) -> bytes:
    return frame(CONTINUATION, END_HEADERS if end_headers else 0, stream_id, block)


# --- HPACK (RFC 7541) ---------------------------------------------------------------------------


def hpack_integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """RFC 7541 §5.1: ``value`` in a ``prefix_bits`` prefix, ``first`` the bits above it."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _hpack_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return hpack_integer(len(raw), 7) + raw  # H bit 0: no Huffman


def indexed(index: int) -> bytes:
    """An indexed header field (RFC 7541 §6.1)."""
    return hpack_integer(index, 7, 0x80)


def literal(name: str | int, value: str, *, incremental: bool = False) -> bytes:
    """A literal header field (RFC 7541 §6.2): ``name`` a string or a table index; with
    ``incremental`` it is added to the dynamic table (§6.2.1), else "without indexing"
    (§6.2.2)."""
    prefix, first = (6, 0x40) if incremental else (4, 0x00)
    if isinstance(name, int):
        return hpack_integer(name, prefix, first) + _hpack_string(value)
    return bytes((first,)) + _hpack_string(name) + _hpack_string(value)


GRPC_PATH = "/v1beta1.DRAPlugin/NodePrepareResources"
GRPC_HEAD = (
    (":method", "POST"),
    (":scheme", "http"),
    (":path", GRPC_PATH),
    (":authority", "localhost"),
    ("content-type", "application/grpc"),
    ("user-agent", "grpc-go/1.72.0"),
    ("te", "trailers"),
)
"""A gRPC request head as grpc-go sends it, as decoded fields."""


def grpc_request_block(
    path: str = GRPC_PATH,
    *,
    extra: tuple[tuple[str, str], ...] = (),
) -> bytes:
    """A gRPC request head as the kubelet's grpc-go sends it (static table indexes from
    RFC 7541 Appendix A: 3 ``:method POST``, 6 ``:scheme http``, 4 ``:path``, 1 ``:authority``,
    31 ``content-type``)."""
    return (
        indexed(3)
        + indexed(6)
        + literal(4, path)
        + literal(1, "localhost")
        + literal(31, "application/grpc")
        + literal("te", "trailers")
        + b"".join(literal(name, value) for name, value in extra)
    )
