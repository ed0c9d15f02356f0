"""Our HPACK decoder and encoder (:mod:`dracpu.wire.hpack`) against the ``hpack`` package as the
independent peer (its encoder feeds our decoder, its decoder reads our encoder), plus RFC 7541's
own examples and every malformed-block rule.

Shared code, said plainly: our decoder borrows ``hpack``'s Huffman table decoder for
Huffman-coded literals; the RFC's non-Huffman examples (Appendix C.3) and the hand-built blocks
here do not go through it.
"""

from __future__ import annotations

import hpack
import pytest
from hpack.table import HeaderTable
from hypothesis import given, settings
from hypothesis import strategies as st

from dracpu.errors import RemoteProtocolError
from dracpu.wire.hpack import STATIC_TABLE, Decoder, encode_header_block

__all__: list[str] = []

LIMIT = 1 << 16

# RFC 7541 Appendix C.3: three requests on one connection, without Huffman coding; the table
# size after each (C.3.1-C.3.3).
C3 = [
    (
        "828684410f7777772e6578616d706c652e636f6d",
        [
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com"),
        ],
        57,
    ),
    (
        "828684be58086e6f2d6361636865",
        [
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com"),
            ("cache-control", "no-cache"),
        ],
        110,
    ),
    (
        "828785bf400a637573746f6d2d6b65790c637573746f6d2d76616c7565",
        [
            (":method", "GET"),
            (":scheme", "https"),
            (":path", "/index.html"),
            (":authority", "www.example.com"),
            ("custom-key", "custom-value"),
        ],
        164,
    ),
]


def test_the_static_table_is_the_rfc_one() -> None:
    theirs = [(n.decode(), v.decode()) for n, v in HeaderTable.STATIC_TABLE]
    assert list(STATIC_TABLE) == theirs
    assert len(STATIC_TABLE) == 61


def test_rfc7541_c3_requests_and_table_sizes() -> None:
    decoder = Decoder(max_list_size=LIMIT)
    for block, fields, size in C3:
        assert decoder.decode(bytes.fromhex(block)) == fields
        assert decoder.table_size == size


_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-0123456789", min_size=1, max_size=12)
_values = st.text(max_size=20)
_field = st.one_of(
    st.tuples(_names, _values),
    st.sampled_from([(n, v) for n, v in STATIC_TABLE]),
    st.tuples(st.sampled_from([n for n, _ in STATIC_TABLE]), _values),
)


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.lists(st.lists(_field, max_size=8), min_size=1, max_size=6),
    huffman=st.booleans(),
    table_size=st.sampled_from([0, 64, 256, 4096]),
)
def test_whatever_hpack_encodes_we_decode(
    blocks: list[list[tuple[str, str]]], huffman: bool, table_size: int
) -> None:
    """Blocks from hpack's encoder (indexing, eviction, a table size update, Huffman or not)
    decode to exactly the fields it was given, block after block."""
    encoder = hpack.Encoder()
    encoder.header_table_size = table_size  # emitted as a size update in the next block
    decoder = Decoder(max_list_size=LIMIT)
    for fields in blocks:
        block = encoder.encode(fields, huffman=huffman)
        assert decoder.decode(block) == fields
    assert decoder.table_size <= table_size


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_names, _values), max_size=10), st.booleans())
def test_hpack_decodes_what_we_encode(fields: list[tuple[str, str]], first: bool) -> None:
    theirs = hpack.Decoder()

    def decoded(block: bytes) -> list[tuple[str, str]]:
        return [(str(name), str(value)) for name, value in theirs.decode(block)]

    assert decoded(encode_header_block(fields, first=first)) == fields
    assert decoded(encode_header_block(fields)) == fields  # no table state was made
    assert theirs.header_table_size == (0 if first else 4096)


def test_never_indexed_and_without_indexing_do_not_enter_the_table() -> None:
    decoder = Decoder(max_list_size=LIMIT)
    # 0x10: never indexed, new name; 0x04 (index 4 ":path") without indexing.
    block = b"\x10\x01a\x01b" + b"\x04\x02/x"
    assert decoder.decode(block) == [("a", "b"), (":path", "/x")]
    assert decoder.table_size == 0


def test_an_entry_larger_than_the_table_empties_it() -> None:
    decoder = Decoder(max_list_size=LIMIT, settings_size=64)
    decoder.decode(b"\x40\x01a\x01b")  # 34 bytes
    assert decoder.table_size == 34
    decoder.decode(b"\x40\x01c" + b"\x1e" + b"x" * 30)  # 32 + 1 + 30 = 63: evicts "a"
    assert decoder.table_size == 63
    assert decoder.decode(b"\xbe") == [("c", "x" * 30)]
    decoder.decode(b"\x40\x01d" + b"\x20" + b"y" * 32)  # 65 > 64: the table empties
    assert decoder.table_size == 0
    with pytest.raises(RemoteProtocolError, match="no table entry 62"):
        decoder.decode(b"\xbe")


BAD_BLOCKS = {
    "index 0": (b"\x80", "no table entry 0"),
    "index past the table": (b"\xbe", "no table entry 62"),
    "integer cut short": (b"\xff", "ends inside an integer"),
    "integer too large": (b"\xff" + b"\xff" * 6 + b"\x01", "integer is too large"),
    "string cut short": (b"\x40\x05ab", "runs past the block"),
    "no string": (b"\x40", "ends before a string"),
    "size update over the setting": (b"\x3f\xe2\x1f", "exceeds the 4096 allowed"),
    "size update after a field": (b"\x82\x20", "size update after a field"),
    "bad Huffman": (b"\x40\x81\x00\x01a", "bad Huffman code"),
    "not UTF-8": (b"\x40\x01a\x01\xff", "not UTF-8"),
}


@pytest.mark.parametrize("case", BAD_BLOCKS.values(), ids=BAD_BLOCKS.keys())
def test_malformed_blocks_are_refused(case: tuple[bytes, str]) -> None:
    block, message = case
    with pytest.raises(RemoteProtocolError, match=message):
        Decoder(max_list_size=LIMIT).decode(block)


def test_the_header_list_size_is_limited() -> None:
    decoder = Decoder(max_list_size=100)
    ok = b"\x00\x01a" + b"\x3e" + b"v" * 62  # 32 + 1 + 62 = 95
    assert decoder.decode(ok) == [("a", "v" * 62)]
    with pytest.raises(RemoteProtocolError, match="exceeds 100 bytes"):
        decoder.decode(ok + b"\x00\x01b\x01w")  # 95 + 34
