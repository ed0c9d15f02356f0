"""gRPC over HTTP/2, server side, unary calls (gRPC's PROTOCOL-HTTP2.md): the request head,
the length-prefixed message, the status trailers. Pure; :mod:`dracpu.wire.h2` carries it and
:mod:`dracpu.adapters.grpc_server` does the I/O.

A request must be ``POST`` (else HTTP 405) with a ``content-type`` of ``application/grpc`` or
``application/grpc+<codec>`` (else HTTP 415); ``grpc-timeout`` is read into seconds. The body of
a unary call is exactly one message: a 5-byte prefix (compressed flag, 32-bit length) and the
bytes. We announce no compression, so a compressed message is ``UNIMPLEMENTED``; a message over
:data:`MAX_MESSAGE` bytes is ``RESOURCE_EXHAUSTED`` (grpc's default limit); anything else
malformed is ``INTERNAL`` (what grpc-go answers for broken framing). Each refusal is a
:class:`~dracpu.errors.GrpcError` the server turns into a trailers-only answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from dracpu.errors import GrpcError
from dracpu.wire.status import Code as Status  # gRPC calls them status codes

__all__ = [
    "MAX_MESSAGE",
    "RESPONSE_HEAD",
    "CallHead",
    "Status",
    "frame_message",
    "percent_encode",
    "read_call_head",
    "read_timeout",
    "read_unary_message",
    "trailers",
    "trailers_only",
]

MAX_MESSAGE: Final = 4 * 1024 * 1024
"""The largest request message accepted (grpc's default max receive size)."""

RESPONSE_HEAD: Final = ((":status", "200"), ("content-type", "application/grpc"))

_UNITS: Final = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


@dataclass(frozen=True, slots=True)
class CallHead:
    """What a request's header block says: the method path and the deadline (seconds)."""

    path: str
    timeout: float | None


def read_timeout(value: str) -> float:
    """``grpc-timeout``: 1 to 8 digits and a unit (H M S m u n), in seconds."""
    digits, unit = value[:-1], value[-1:]
    if not (1 <= len(digits) <= 8 and digits.isascii() and digits.isdigit()) or unit not in _UNITS:
        raise GrpcError(Status.INTERNAL, f"malformed grpc-timeout {value!r}")
    return int(digits) * _UNITS[unit]


def read_call_head(headers: tuple[tuple[str, str], ...]) -> CallHead:
    """The call a request head asks for; :class:`GrpcError` if it is not a gRPC request."""
    method = path = content_type = ""
    timeout: float | None = None
    for name, value in headers:
        if name == ":method":
            method = value
        elif name == ":path":
            path = value
        elif name == "content-type":
            content_type = value
        elif name == "grpc-timeout":
            timeout = read_timeout(value)
    if method != "POST":
        raise GrpcError(Status.INTERNAL, f"method {method!r} is not POST", http_status=405)
    if content_type != "application/grpc" and not content_type.startswith("application/grpc+"):
        raise GrpcError(
            Status.INTERNAL, f"content-type {content_type!r} is not gRPC", http_status=415
        )
    return CallHead(path, timeout)


def frame_message(message: bytes) -> bytes:
    """One uncompressed length-prefixed message."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def read_unary_message(body: bytes) -> bytes:
    """The one message of a unary request body."""
    if len(body) < 5:
        raise GrpcError(Status.INTERNAL, "the request carries no message")
    if body[0] not in (0, 1):
        raise GrpcError(Status.INTERNAL, f"bad message flag {body[0]}")
    if body[0] == 1:
        raise GrpcError(Status.UNIMPLEMENTED, "compressed messages are not supported")
    length = int.from_bytes(body[1:5], "big")
    if length > MAX_MESSAGE:
        raise GrpcError(
            Status.RESOURCE_EXHAUSTED, f"a message of {length} bytes exceeds {MAX_MESSAGE}"
        )
    if len(body) != 5 + length:
        what = "is cut short" if len(body) < 5 + length else "carries more than one message"
        raise GrpcError(Status.INTERNAL, f"the request body {what}")
    return body[5:]


def percent_encode(message: str) -> str:
    """``grpc-message`` encoding: UTF-8, bytes outside 0x20-0x7E and ``%`` as ``%XX``."""
    raw = message.encode("utf-8")
    if all(0x20 <= byte <= 0x7E and byte != 0x25 for byte in raw):
        return message
    return "".join(
        chr(byte) if 0x20 <= byte <= 0x7E and byte != 0x25 else f"%{byte:02X}" for byte in raw
    )


def trailers(status: int, message: str = "") -> list[tuple[str, str]]:
    """The trailers ending a call (after the response head and its message, if any)."""
    fields = [("grpc-status", str(int(status)))]
    if message:
        fields.append(("grpc-message", percent_encode(message)))
    return fields


def trailers_only(error: GrpcError) -> list[tuple[str, str]]:
    """A whole answer of one header block: an error before any message (a "Trailers-Only"
    response)."""
    return [
        (":status", str(error.http_status)),
        ("content-type", "application/grpc"),
        *trailers(error.status, error.message),
    ]
