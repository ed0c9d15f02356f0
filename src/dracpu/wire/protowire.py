"""The protobuf wire format's field scanner, for the kubelet's DRA codec (no generated code).

What is left of the hand-written protobuf code once the NRI messages and the ttrpc envelopes
moved to Google's protobuf runtime (:mod:`dracpu.adapters.nri_messages`,
:mod:`dracpu.adapters.ttrpc_envelopes`): the pieces :mod:`dracpu.wire.dra` and
:mod:`dracpu.adapters.grpc_server` read and write their few fields with. It goes when they do.

The scanner accepts what Go's ``proto.Unmarshal`` accepts: unknown fields (and known fields of
another wire type) are returned or skipped, groups are skipped; truncated data and bad varints
are errors. Decoding errors are the peer's fault (:class:`RemoteProtocolError`); values that
cannot be encoded are ours (:class:`LocalProtocolError`).
"""

from __future__ import annotations

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
    "decode_varint",
    "encode_text",
    "encode_varint",
    "len_field",
    "scan_fields",
    "skip_group",
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
