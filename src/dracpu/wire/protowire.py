"""The protobuf wire format, just enough for ttrpc's own envelopes (no generated code).

ttrpc wraps every call in ``ttrpc.Request`` and every answer in ``ttrpc.Response``
(containerd/ttrpc ``request.proto``; ``reference/nri-ttrpc-cdi.md`` §1.4)::

    message Request  { string service = 1; string method = 2; bytes payload = 3;
                       int64 timeout_nano = 4; repeated KeyValue metadata = 5; }
    message KeyValue { string key = 1; string value = 2; }
    message Response { google.rpc.Status status = 1; bytes payload = 2; }
    // googleapis google/rpc/status.proto
    message Status   { int32 code = 1; string message = 2;
                       repeated google.protobuf.Any details = 3; }

The encoder writes what Go's ``proto.Marshal`` writes: fields in ascending number, proto3
defaults omitted, so a successful empty reply is a 0-byte ``Response``. The decoder accepts what
Go's ``proto.Unmarshal`` accepts: unknown fields (and known fields of another wire type) are
skipped, the last value of a scalar wins, repeated ``status`` occurrences merge; truncated data,
bad varints and invalid UTF-8 in a string are errors. Decoding errors are the peer's fault
(:class:`RemoteProtocolError`); values that cannot be encoded are ours
(:class:`LocalProtocolError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dracpu.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "MAX_FIELD_NUMBER",
    "MAX_GROUP_DEPTH",
    "WIRE_EGROUP",
    "WIRE_I32",
    "WIRE_I64",
    "WIRE_LEN",
    "WIRE_SGROUP",
    "WIRE_VARINT",
    "Field",
    "RequestEnvelope",
    "ResponseEnvelope",
    "decode_request",
    "decode_response",
    "decode_varint",
    "encode_request",
    "encode_response",
    "encode_text",
    "encode_varint",
    "len_field",
    "scan_fields",
    "skip_group",
    "to_int32",
    "to_int64",
]

# Wire types (protobuf encoding spec, "Message Structure").
WIRE_VARINT = 0
WIRE_I64 = 1
WIRE_LEN = 2
WIRE_SGROUP = 3  # deprecated groups: only skipped, never produced
WIRE_EGROUP = 4
WIRE_I32 = 5

MAX_VARINT_LEN = 10  # a uint64 needs at most 10 groups of 7 bits (protobuf encoding spec)
MAX_FIELD_NUMBER = (1 << 29) - 1  # protobuf language spec: field numbers are 1 .. 2^29-1
MAX_GROUP_DEPTH = 100  # ours: nested unknown groups skipped before we call the data hostile
_MASK64 = (1 << 64) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1

# Field numbers: containerd/ttrpc request.proto and googleapis google/rpc/status.proto.
REQUEST_SERVICE = 1
REQUEST_METHOD = 2
REQUEST_PAYLOAD = 3
REQUEST_TIMEOUT_NANO = 4
REQUEST_METADATA = 5
KEY_VALUE_KEY, KEY_VALUE_VALUE = 1, 2
RESPONSE_STATUS, RESPONSE_PAYLOAD = 1, 2
STATUS_CODE, STATUS_MESSAGE, STATUS_DETAILS = 1, 2, 3
ANY_TYPE_URL, ANY_VALUE = 1, 2  # google/protobuf/any.proto


@dataclass(frozen=True, slots=True)
class RequestEnvelope:
    """A decoded ``ttrpc.Request``."""

    service: str = ""
    method: str = ""
    payload: bytes = b""
    timeout_nano: int = 0
    metadata: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ResponseEnvelope:
    """A decoded ``ttrpc.Response``; an absent status reads as code 0 with no message."""

    status_code: int = 0
    status_message: str = ""
    payload: bytes = b""


# --- encoding -------------------------------------------------------------------------------


_SMALL_VARINTS = tuple(bytes((i,)) for i in range(0x80))  # one-byte varints: most lengths


def encode_varint(value: int) -> bytes:
    """Base-128 varint of an unsigned 64-bit value."""
    if 0 <= value < 0x80:
        return _SMALL_VARINTS[value]
    if not 0 <= value <= _MASK64:
        raise LocalProtocolError(f"varint value {value} is outside 0 .. 2^64-1")
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return encode_varint((field << 3) | wire_type)


def encode_text(text: str, what: str) -> bytes:
    """``text`` as UTF-8 (a protobuf ``string``); :class:`LocalProtocolError` naming ``what``
    when it cannot be (a lone surrogate)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LocalProtocolError(f"{what} {text!r} cannot be encoded as UTF-8") from exc


def len_field(tag: int, data: bytes) -> bytes:
    """A length-delimited field whose tag, ``(number << 3) | WIRE_LEN``, is one byte (fields
    1-15), always written (a proto3 default is the caller's to omit)."""
    return bytes((tag,)) + encode_varint(len(data)) + data


def _put_len(out: bytearray, field: int, data: bytes) -> None:
    """Append a length-delimited field, omitted when empty (proto3 default)."""
    if data:
        out += _tag(field, WIRE_LEN)
        out += encode_varint(len(data))
        out += data


def _put_int(out: bytearray, field: int, value: int) -> None:
    """Append an int32/int64 varint field, omitted when 0; negatives take 10 bytes."""
    if value:
        out += _tag(field, WIRE_VARINT)
        out += encode_varint(value & _MASK64)


def encode_request(
    service: str,
    method: str,
    payload: bytes,
    timeout_nano: int = 0,
    metadata: Sequence[tuple[str, str]] = (),
) -> bytes:
    """Serialize a ``ttrpc.Request`` exactly as Go does."""
    if not _INT64_MIN <= timeout_nano <= _INT64_MAX:
        raise LocalProtocolError(f"timeout_nano {timeout_nano} does not fit in an int64")
    out = bytearray()
    _put_len(out, REQUEST_SERVICE, encode_text(service, "service"))
    _put_len(out, REQUEST_METHOD, encode_text(method, "method"))
    _put_len(out, REQUEST_PAYLOAD, bytes(payload))
    _put_int(out, REQUEST_TIMEOUT_NANO, timeout_nano)
    for key, value in metadata:
        entry = bytearray()
        _put_len(entry, KEY_VALUE_KEY, encode_text(key, "metadata key"))
        _put_len(entry, KEY_VALUE_VALUE, encode_text(value, "metadata value"))
        # A repeated message element is always written, even when empty.
        out += _tag(REQUEST_METADATA, WIRE_LEN)
        out += encode_varint(len(entry))
        out += entry
    return bytes(out)


def encode_response(payload: bytes = b"", status_code: int = 0, status_message: str = "") -> bytes:
    """Serialize a ``ttrpc.Response``; code 0 without a message omits the status (Go's OK)."""
    if not _INT32_MIN <= status_code <= _INT32_MAX:
        raise LocalProtocolError(f"status code {status_code} does not fit in an int32")
    out = bytearray()
    status = bytearray()
    _put_int(status, STATUS_CODE, status_code)
    _put_len(status, STATUS_MESSAGE, encode_text(status_message, "status message"))
    if status:
        out += _tag(RESPONSE_STATUS, WIRE_LEN)
        out += encode_varint(len(status))
        out += status
    _put_len(out, RESPONSE_PAYLOAD, bytes(payload))
    return bytes(out)


# --- decoding -------------------------------------------------------------------------------


def decode_varint(data: bytes, pos: int) -> tuple[int, int]:
    """Read a varint at ``pos``; return ``(value, next_pos)``. Rejects > 64 bits like Go."""
    end = len(data)
    if pos < end and data[pos] < 0x80:
        return data[pos], pos + 1
    result = 0
    for i in range(MAX_VARINT_LEN):
        if pos >= end:
            raise RemoteProtocolError("protobuf: truncated varint")
        byte = data[pos]
        pos += 1
        if i == MAX_VARINT_LEN - 1 and byte > 1:
            raise RemoteProtocolError("protobuf: varint overflows 64 bits")
        result |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            return result, pos
    raise AssertionError("unreachable: the 10th varint byte either ends it or overflows")


Field = tuple[int, int, int, int]
"""One field of a message: (number, wire type, a, b). Varint: ``a`` is the value.
Length-delimited: ``data[a:b]`` is the value (no copy is made until it is used). Fixed-size
fields are skipped: none of the messages we read has one."""


def scan_fields(data: bytes, pos: int, end: int) -> list[Field]:
    """The fields of the message in ``data[pos:end]``, in wire order; groups are skipped."""
    fields: list[Field] = []
    while pos < end:
        key = data[pos]
        if key < 0x80:  # one-byte tag: every field we know (inlined: the hot path)
            pos += 1
        else:
            key, pos = decode_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if not 1 <= number <= MAX_FIELD_NUMBER:
            raise RemoteProtocolError(f"protobuf: invalid field number {number}")
        if wire_type == WIRE_LEN:
            if pos < end and data[pos] < 0x80:
                size = data[pos]
                pos += 1
            else:
                size, pos = decode_varint(data, pos)
            if size > end - pos:
                raise RemoteProtocolError(
                    f"protobuf: field {number} declares {size} bytes, {end - pos} remain"
                )
            fields.append((number, WIRE_LEN, pos, pos + size))
            pos += size
        elif wire_type == WIRE_VARINT:
            value, pos = decode_varint(data, pos)
            fields.append((number, WIRE_VARINT, value, 0))
        elif wire_type in (WIRE_I64, WIRE_I32):
            pos += 8 if wire_type == WIRE_I64 else 4
            if pos > end:
                raise RemoteProtocolError(f"protobuf: truncated fixed-size field {number}")
        elif wire_type == WIRE_SGROUP:
            pos = skip_group(data, pos, end, number)
        else:
            raise RemoteProtocolError(f"protobuf: bad wire type {wire_type} (field {number})")
    if pos > end:  # a varint read past the end of an embedded message
        raise RemoteProtocolError("protobuf: a field overruns its message")
    return fields


def skip_group(data: bytes, pos: int, end: int, number: int) -> int:
    """Skip an unknown group opened by field ``number``, inside ``data[:end]``; return the
    position after its end-group tag (groups are deprecated: skipped, never produced)."""
    open_groups = [number]
    while open_groups:
        if pos >= end:
            raise RemoteProtocolError(f"protobuf: group {number} is not closed")
        key, pos = decode_varint(data, pos)
        inner, wire_type = key >> 3, key & 7
        if wire_type == WIRE_VARINT:
            _, pos = decode_varint(data, pos)
        elif wire_type == WIRE_LEN:
            size, pos = decode_varint(data, pos)
            pos += size
        elif wire_type in (WIRE_I64, WIRE_I32):
            pos += 8 if wire_type == WIRE_I64 else 4
        elif wire_type == WIRE_SGROUP:
            if len(open_groups) >= MAX_GROUP_DEPTH:
                raise RemoteProtocolError("protobuf: groups nested too deeply")
            open_groups.append(inner)
        elif wire_type == WIRE_EGROUP:
            if inner != open_groups.pop():
                raise RemoteProtocolError(f"protobuf: group end {inner} does not match its start")
        else:
            raise RemoteProtocolError(f"protobuf: bad wire type {wire_type} (field {inner})")
        if pos > end:
            raise RemoteProtocolError(f"protobuf: field {inner} in group {number} overruns it")
    return pos


def _text(data: bytes, start: int, end: int, what: str) -> str:
    try:
        return data[start:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError(f"protobuf: {what} is not valid UTF-8") from exc


def to_int64(value: int) -> int:
    """An ``int64`` field's value from its varint (two's complement, as Go reads it)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def to_int32(value: int) -> int:
    """An ``int32`` field's value from its varint."""
    value &= 0xFFFFFFFF  # Go's int32(uint64) conversion keeps the low 32 bits
    return value - (1 << 32) if value >= 1 << 31 else value


def decode_request(data: bytes) -> RequestEnvelope:
    """Parse a ``ttrpc.Request``."""
    service = method = ""
    payload = b""
    timeout_nano = 0
    metadata: list[tuple[str, str]] = []
    for number, wire_type, a, b in scan_fields(data, 0, len(data)):
        if wire_type == WIRE_LEN:
            if number == REQUEST_SERVICE:
                service = _text(data, a, b, "Request.service")
            elif number == REQUEST_METHOD:
                method = _text(data, a, b, "Request.method")
            elif number == REQUEST_PAYLOAD:
                payload = data[a:b]
            elif number == REQUEST_METADATA:
                metadata.append(_decode_key_value(data, a, b))
        elif number == REQUEST_TIMEOUT_NANO:
            timeout_nano = to_int64(a)
    return RequestEnvelope(service, method, payload, timeout_nano, tuple(metadata))


def _decode_key_value(data: bytes, start: int, end: int) -> tuple[str, str]:
    key = value = ""
    for number, wire_type, a, b in scan_fields(data, start, end):
        if wire_type == WIRE_LEN:
            if number == KEY_VALUE_KEY:
                key = _text(data, a, b, "KeyValue.key")
            elif number == KEY_VALUE_VALUE:
                value = _text(data, a, b, "KeyValue.value")
    return key, value


def decode_response(data: bytes) -> ResponseEnvelope:
    """Parse a ``ttrpc.Response``; several ``status`` fields merge as in any protobuf runtime."""
    code, message = 0, ""
    payload = b""
    for number, wire_type, a, b in scan_fields(data, 0, len(data)):
        if wire_type != WIRE_LEN:
            continue
        if number == RESPONSE_PAYLOAD:
            payload = data[a:b]
        elif number == RESPONSE_STATUS:
            for inner, inner_type, x, y in scan_fields(data, a, b):
                if inner_type == WIRE_VARINT:
                    if inner == STATUS_CODE:
                        code = to_int32(x)
                elif inner == STATUS_MESSAGE:
                    message = _text(data, x, y, "Status.message")
                elif inner == STATUS_DETAILS:
                    _check_any(data, x, y)
    return ResponseEnvelope(code, message, payload)


def _check_any(data: bytes, start: int, end: int) -> None:
    """Validate (and drop) a ``google.protobuf.Any`` detail as Go's unmarshal would."""
    for number, wire_type, a, b in scan_fields(data, start, end):
        if number == ANY_TYPE_URL and wire_type == WIRE_LEN:
            _text(data, a, b, "Any.type_url")
