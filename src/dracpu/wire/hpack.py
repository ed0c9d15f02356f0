"""HPACK (RFC 7541) for our HTTP/2 server: a decoder of request header blocks and an encoder of
the blocks we send.

Decoding keeps the connection's dynamic table; a gRPC client sends every request after the first
as a handful of one-byte references into it, so the decoder is built for that case (one dict
lookup and no string work per field). Huffman-coded string literals are decoded by the
``hpack`` package's table-driven decoder (``decode_huffman``): they occur when a client first
sends a field, not per request. Anything malformed raises
:class:`~dracpu.errors.RemoteProtocolError`, after which the connection's HPACK state is
unusable (a connection error, ``COMPRESSION_ERROR``).

Encoding writes literals "without indexing" only (never Huffman), so our blocks change no table
on either side and there is no encoder state to keep. The connection's first block may start
with a dynamic table size update to 0 (``first=True``): then no later
``SETTINGS_HEADER_TABLE_SIZE`` from the peer ever needs one (RFC 7541 §4.2).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Final

from hpack.huffman_table import decode_huffman

from dracpu.errors import RemoteProtocolError

__all__ = [
    "DEFAULT_TABLE_SIZE",
    "STATIC_TABLE",
    "Decoder",
    "encode_header_block",
]

DEFAULT_TABLE_SIZE: Final = 4096
"""SETTINGS_HEADER_TABLE_SIZE's initial value (RFC 9113 §6.5.2); we never announce another."""

ENTRY_OVERHEAD: Final = 32
"""What a table entry or a header list field costs beyond its name and value (RFC 7541 §4.1)."""

# RFC 7541 Appendix A, indexes 1 to 61.
STATIC_TABLE: Final[tuple[tuple[str, str], ...]] = (
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
)
_STATIC_COUNT: Final = len(STATIC_TABLE)
_STATIC_SIZES: Final = tuple(
    ENTRY_OVERHEAD + len(name.encode()) + len(value.encode()) for name, value in STATIC_TABLE
)


class Decoder:
    """One connection's HPACK decoder (its dynamic table)."""

    __slots__ = ("_entries", "_max_list_size", "_max_size", "_settings_size", "_size")

    def __init__(self, *, max_list_size: int, settings_size: int = DEFAULT_TABLE_SIZE) -> None:
        # Newest first: index 62 is _entries[0]. Each entry: (name, value, cost).
        self._entries: deque[tuple[str, str, int]] = deque()
        self._size = 0
        self._settings_size = settings_size  # the most the encoder may choose
        self._max_size = settings_size  # what it chose (size updates)
        self._max_list_size = max_list_size

    @property
    def table_size(self) -> int:
        """Bytes the dynamic table holds now (RFC 7541 §4.1 sizes)."""
        return self._size

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """The fields of one complete header block, in order."""
        fields: list[tuple[str, str]] = []
        list_size = 0
        pos, end = 0, len(block)
        while pos < end:
            byte = block[pos]
            if byte & 0x80:  # indexed field (§6.1): the common case
                if byte != 0xFF:
                    index, pos = byte & 0x7F, pos + 1
                else:
                    index, pos = _integer(block, pos, 7)
                name, value, cost = self._lookup(index)
            elif byte & 0x40:  # literal with incremental indexing (§6.2.1)
                name, value, pos = self._literal(block, pos, 6)
                cost = ENTRY_OVERHEAD + len(name.encode()) + len(value.encode())
                self._insert(name, value, cost)
            elif byte & 0x20:  # dynamic table size update (§6.3)
                if fields:
                    raise RemoteProtocolError("HPACK: a table size update after a field")
                size, pos = _integer(block, pos, 5)
                if size > self._settings_size:
                    raise RemoteProtocolError(
                        f"HPACK: table size {size} exceeds the {self._settings_size} allowed"
                    )
                self._max_size = size
                self._evict_to(size)
                continue
            else:  # literal without indexing (§6.2.2) or never indexed (§6.2.3)
                name, value, pos = self._literal(block, pos, 4)
                cost = ENTRY_OVERHEAD + len(name.encode()) + len(value.encode())
            list_size += cost
            if list_size > self._max_list_size:
                raise RemoteProtocolError(
                    f"HPACK: the header list exceeds {self._max_list_size} bytes"
                )
            fields.append((name, value))
        return fields

    def _lookup(self, index: int) -> tuple[str, str, int]:
        if 0 < index <= _STATIC_COUNT:
            name, value = STATIC_TABLE[index - 1]
            return name, value, _STATIC_SIZES[index - 1]
        try:
            if index > _STATIC_COUNT:
                return self._entries[index - _STATIC_COUNT - 1]
        except IndexError:
            pass
        raise RemoteProtocolError(f"HPACK: no table entry {index}")

    def _literal(self, block: bytes, pos: int, prefix: int) -> tuple[str, str, int]:
        index, pos = _integer(block, pos, prefix)
        if index:
            name = self._lookup(index)[0]
        else:
            name, pos = _string(block, pos)
        value, pos = _string(block, pos)
        return name, value, pos

    def _insert(self, name: str, value: str, cost: int) -> None:
        if cost > self._max_size:  # larger than the table: it empties it (§4.4)
            self._entries.clear()
            self._size = 0
            return
        self._evict_to(self._max_size - cost)
        self._entries.appendleft((name, value, cost))
        self._size += cost

    def _evict_to(self, limit: int) -> None:
        """Drop the oldest entries until at most ``limit`` bytes are used."""
        while self._size > limit:
            self._size -= self._entries.pop()[2]


def _integer(block: bytes, pos: int, prefix: int) -> tuple[int, int]:
    """An integer with an N-bit prefix at ``block[pos]`` (§5.1); (value, position after)."""
    if pos >= len(block):
        raise RemoteProtocolError("HPACK: the block ends inside an integer")
    limit = (1 << prefix) - 1
    value = block[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        if pos >= len(block):
            raise RemoteProtocolError("HPACK: the block ends inside an integer")
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 28:  # more than 2**28 + prefix: no field is that long
            raise RemoteProtocolError("HPACK: an integer is too large")


def _string(block: bytes, pos: int) -> tuple[str, int]:
    """A string literal (§5.2): (text, position after)."""
    if pos >= len(block):
        raise RemoteProtocolError("HPACK: the block ends before a string")
    huffman = block[pos] & 0x80
    length, pos = _integer(block, pos, 7)
    if pos + length > len(block):
        raise RemoteProtocolError("HPACK: a string runs past the block")
    raw = block[pos : pos + length]
    pos += length
    if huffman:
        try:
            raw = decode_huffman(raw)
        except Exception as exc:  # the hpack package's own HPACKDecodingError
            raise RemoteProtocolError(f"HPACK: bad Huffman code: {exc}") from exc
    try:
        return raw.decode("utf-8"), pos
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError(f"HPACK: a string is not UTF-8: {exc}") from exc


# --- encoding -----------------------------------------------------------------------------------


def _encode_integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (§5.1) whose first byte carries ``first`` above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _encode_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return _encode_integer(len(raw), 7, 0) + raw


# The static-table indexes of the names we send, and of the one full entry we send.
_STATIC_NAMES: Final = {
    name: index for index, (name, _) in reversed(list(enumerate(STATIC_TABLE, 1)))
}
_STATIC_FULL: Final = {(":status", "200"): 8}


def encode_header_block(headers: Iterable[tuple[str, str]], *, first: bool = False) -> bytes:
    """A block of literals "without indexing" (no table state on either side); ``first``: start
    with a dynamic table size update to 0 (see the module docstring)."""
    out = bytearray(b"\x20" if first else b"")
    for name, value in headers:
        index = _STATIC_FULL.get((name, value))
        if index is not None:
            out += bytes((0x80 | index,))
            continue
        name_index = _STATIC_NAMES.get(name)
        if name_index is not None:
            out += _encode_integer(name_index, 4, 0x00)
        else:
            out += b"\x00" + _encode_string(name)
        out += _encode_string(value)
    return bytes(out)
