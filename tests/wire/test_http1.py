"""Sans-IO HTTP/1.1 client side: request bytes, response framing fed whole and in any split,
connection reuse, and a clear RemoteProtocolError for every malformed answer."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dracpu.errors import LocalProtocolError, RemoteProtocolError
from dracpu.wire.http1 import (
    MAX_CHUNK_LINE,
    MAX_HEADER_BYTES,
    MAX_HEADERS,
    NEED_DATA,
    Data,
    EndOfMessage,
    Response,
    ResponseParser,
    encode_request,
)

# --- encoding -----------------------------------------------------------------------------------


def test_a_get_is_request_line_host_headers_blank_line() -> None:
    wire = encode_request(
        "GET",
        "/api/v1/nodes/node-a",
        host="10.0.0.1:6443",
        headers=[("Accept", "application/json"), ("Authorization", "Bearer t0k")],
    )
    assert wire == (
        b"GET /api/v1/nodes/node-a HTTP/1.1\r\n"
        b"Host: 10.0.0.1:6443\r\n"
        b"Accept: application/json\r\n"
        b"Authorization: Bearer t0k\r\n"
        b"\r\n"
    )


def test_a_body_gets_its_content_length() -> None:
    body = b'{"status":{}}'
    wire = encode_request(
        "PATCH",
        "/x/status",
        host="h",
        headers=[("Content-Type", "application/merge-patch+json")],
        body=body,
    )
    assert wire == (
        b"PATCH /x/status HTTP/1.1\r\nHost: h\r\n"
        b"Content-Type: application/merge-patch+json\r\nContent-Length: 13\r\n\r\n" + body
    )
    # A method that defines a body says "0" for an empty one; a DELETE with a body gets a length.
    assert encode_request("POST", "/x", host="h").endswith(b"Content-Length: 0\r\n\r\n")
    assert encode_request("DELETE", "/x", host="h", body=b"{}") == (
        b"DELETE /x HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n{}"
    )


@pytest.mark.parametrize(
    ("method", "target", "headers", "match"),
    [
        ("GET", "/x", [("X-A", "one\r\nInjected: yes")], "CR, LF or NUL"),
        ("GET", "/x", [("X-A", "nul\x00")], "CR, LF or NUL"),
        ("GET", "/x", [("Bad Name", "v")], "not a token"),
        ("GET", "/x", [("Host", "other")], "written by the encoder"),
        ("GET", "/x", [("content-length", "5")], "written by the encoder"),
        ("GET", "/a b", [], "white space"),
        ("GET", "", [], "empty"),
        ("G ET", "/x", [], "not a token"),
        ("GET", "/x", [("X-A", "snow\u2603")], "latin-1"),
    ],
)
def test_what_cannot_be_sent_is_a_local_error(
    method: str, target: str, headers: list[tuple[str, str]], match: str
) -> None:
    with pytest.raises(LocalProtocolError, match=match):
        encode_request(method, target, host="h", headers=headers)


# --- parsing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parsed:
    heads: list[Response]
    body: bytes
    ended: bool
    reusable: bool


def parse(
    method: str, chunks: list[bytes], *, eof: bool = False, max_body: int | None = 1 << 20
) -> Parsed:
    """Feed ``chunks`` (then the EOF), draining events after each; Data joined."""
    parser = ResponseParser(method, max_body=max_body)
    heads: list[Response] = []
    body = bytearray()
    ended = False

    def drain() -> None:
        nonlocal ended
        while not ended:
            event = parser.next_event()
            if event is NEED_DATA:
                return
            if isinstance(event, Response):
                heads.append(event)
            elif isinstance(event, Data):
                assert event.data  # never an empty Data
                body.extend(event.data)
            else:
                assert isinstance(event, EndOfMessage)
                ended = True

    for chunk in chunks:
        parser.receive_data(chunk)
        drain()
    if eof:
        parser.receive_data(b"")
        drain()
    return Parsed(heads, bytes(body), ended, parser.reusable)


JSON_200 = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{"kind":"Ok"}'
)
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;name=value\r\nhello\r\n"
    b"1A\r\n" + b"abcdefghijklmnopqrstuvwxyz" + b"\r\n"
    b"0\r\nX-Trailer: ignored\r\nOther: too\r\n\r\n"
)
WATCH = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    b'2b\r\n{"type":"ADDED","object":{"kind":"Slice"}}\n\r\n'
    b'2e\r\n{"type":"MODIFIED","object":{"kind":"Slice"}}\n\r\n'
    b"0\r\n\r\n"
)
UNTIL_CLOSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end"


def test_content_length_body_and_keep_alive() -> None:
    parsed = parse("GET", [JSON_200])
    [head] = parsed.heads
    assert (head.status, head.reason, head.http_version) == (200, "OK", "1.1")
    assert head.header("content-type") == "application/json"
    assert head.header("CONTENT-LENGTH") == "13"
    assert head.header("absent") is None
    assert parsed.body == b'{"kind":"Ok"}'
    assert parsed.ended
    assert parsed.reusable


def test_chunked_body_with_extensions_and_trailers() -> None:
    parsed = parse("GET", [CHUNKED])
    assert parsed.body == b"hello" + b"abcdefghijklmnopqrstuvwxyz"
    assert parsed.ended
    assert parsed.reusable


def test_body_until_close_is_not_reusable() -> None:
    parsed = parse("GET", [UNTIL_CLOSE])
    assert parsed.body == b"until the end"
    assert not parsed.ended  # it cannot know the end before the EOF
    parsed = parse("GET", [UNTIL_CLOSE], eof=True)
    assert parsed.ended
    assert parsed.body == b"until the end"
    assert not parsed.reusable


@pytest.mark.parametrize(
    ("response", "reusable"),
    [
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", False),
        (b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive, Close\r\nContent-Length: 2\r\n\r\nok", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
        (b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok", True),
        # Both framings (a smuggling sign): chunked wins, the connection is dropped afterwards.
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2\r\nok\r\n0\r\n\r\n",
            False,
        ),
        # Bytes beyond the response: the server is out of step, do not reuse.
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA", False),
    ],
)
def test_reuse_needs_http_1_1_no_close_and_an_exact_end(response: bytes, reusable: bool) -> None:
    parsed = parse("GET", [response])
    assert parsed.body == b"ok"
    assert parsed.ended
    assert parsed.reusable is reusable


def test_eof_after_a_complete_response_forbids_reuse() -> None:
    assert not parse("GET", [JSON_200], eof=True).reusable


@pytest.mark.parametrize(
    ("method", "response"),
    [
        ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n"),
        ("GET", b"HTTP/1.1 204 No Content\r\n\r\n"),
        ("GET", b"HTTP/1.1 304 Not Modified\r\nContent-Length: 50\r\n\r\n"),
        ("CONNECT", b"HTTP/1.1 200 Connection established\r\n\r\n"),
        ("GET", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
    ],
)
def test_answers_without_a_body_end_at_the_head(method: str, response: bytes) -> None:
    parsed = parse(method, [response])
    assert len(parsed.heads) == 1
    assert parsed.body == b""
    assert parsed.ended
    assert parsed.reusable


def test_interim_1xx_answers_are_skipped() -> None:
    parsed = parse(
        "GET",
        [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + JSON_200],
    )
    assert [h.status for h in parsed.heads] == [200]
    assert parsed.body == b'{"kind":"Ok"}'


def test_reason_may_be_empty_and_status_line_may_lack_the_space() -> None:
    for line in (b"HTTP/1.1 404 \r\n", b"HTTP/1.1 404\r\n"):
        parsed = parse("GET", [line + b"Content-Length: 0\r\n\r\n"])
        assert (parsed.heads[0].status, parsed.heads[0].reason) == (404, "")


def test_header_values_are_trimmed_and_names_lower_cased() -> None:
    parsed = parse("GET", [b"HTTP/1.1 200 OK\r\nX-Thing:  \tv a l \t\r\nContent-Length: 0\r\n\r\n"])
    assert parsed.heads[0].headers == (("x-thing", "v a l"), ("content-length", "0"))


def test_a_streamed_body_comes_out_as_it_arrives() -> None:
    parser = ResponseParser("GET", max_body=None)
    head, first_chunk = WATCH.split(b"\r\n\r\n", 1)
    parser.receive_data(head + b"\r\n\r\n" + first_chunk[:20])
    assert isinstance(parser.next_event(), Response)
    event = parser.next_event()
    assert event == Data(first_chunk[4:20])  # part of the first chunk, before the rest came
    assert parser.next_event() is NEED_DATA
    assert not parser.reusable


def test_started_tells_whether_any_byte_arrived() -> None:
    parser = ResponseParser("GET")
    assert not parser.started
    parser.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="closed before any answer"):
        parser.next_event()
    assert not parser.started  # a GET may be sent again
    parser = ResponseParser("GET")
    parser.receive_data(b"H")
    parser.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="inside the response head"):
        parser.next_event()
    assert parser.started


# --- any split gives the same events ------------------------------------------------------------

CANONICAL = [JSON_200, CHUNKED, WATCH, b"HTTP/1.1 100 Continue\r\n\r\n" + JSON_200]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(CANONICAL), st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_any_split_of_the_input_gives_the_same_events(data: bytes, cuts: list[int]) -> None:
    whole = parse("GET", [data])
    points = sorted({min(c, len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    split = parse("GET", [p for p in pieces if p])
    assert split == whole
    assert whole.ended
    assert whole.reusable


@pytest.mark.parametrize("data", [*CANONICAL, UNTIL_CLOSE])
def test_byte_by_byte_equals_whole(data: bytes) -> None:
    eof = data is UNTIL_CLOSE
    assert parse("GET", [data[i : i + 1] for i in range(len(data))], eof=eof) == parse(
        "GET", [data], eof=eof
    )


# --- malformed answers --------------------------------------------------------------------------

HEAD_OK = b"HTTP/1.1 200 OK\r\n"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"HTTP/2 200 OK\r\n\r\n", "bad status line"),
        (b"HTTP/1.1 20 OK\r\n\r\n", "bad status line"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "bad status line"),
        (b"http/1.1 200 OK\r\n\r\n", "bad status line"),
        (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "bad status line"),
        (b"HTTP/1.1 099 Odd\r\n\r\n", "bad status code 99"),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "101 Switching Protocols"),
        (HEAD_OK + b"X-A: 1\r\n continued\r\n\r\n", "obsolete line folding"),
        (HEAD_OK + b"No colon here\r\n\r\n", "malformed header line"),
        (HEAD_OK + b"Bad Name: v\r\n\r\n", "malformed header line"),
        (HEAD_OK + b"X: a\rb\r\n\r\n", "CR/LF/NUL"),
        (HEAD_OK + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n", "disagree"),
        (HEAD_OK + b"Content-Length: 5, 6\r\n\r\n", "disagree"),
        (HEAD_OK + b"Content-Length: -1\r\n\r\n", "not a number"),
        (HEAD_OK + b"Content-Length: +5\r\n\r\n", "not a number"),
        (HEAD_OK + b"Content-Length: abc\r\n\r\n", "not a number"),
        (HEAD_OK + b"Content-Length: \r\n\r\n", "not a number"),
        (HEAD_OK + b"Content-Length: \xd9\xa3\r\n\r\n", "not a number"),  # Arabic-Indic 3
        (HEAD_OK + b"Transfer-Encoding: gzip, chunked\r\n\r\n", "unsupported Transfer-Encoding"),
        (HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n-1\r\n", "bad chunk size"),
        (HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n\r\n", "bad chunk size"),
        (HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n0x5\r\n", "bad chunk size"),
        (HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n" + b"1" * 17 + b"\r\n", "bad chunk size"),
        (HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n2\r\nokXY", "not followed by CRLF"),
    ],
)
def test_malformed_answers_are_remote_errors(data: bytes, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        parse("GET", [data])


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "closed before any answer"),
        (b"HTTP/1.1 200 OK\r\nContent-", "inside the response head"),
        (HEAD_OK + b"Content-Length: 10\r\n\r\nshort", "5 of 10 body bytes missing"),
        (HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n5\r\nab", "inside a chunk"),
        (HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n5\r\nabcde\r\n", "before a chunk size"),
        (HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n0\r\nX: y\r\n", "in the trailers"),
    ],
)
def test_a_close_before_the_end_is_an_error(data: bytes, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        parse("GET", [data], eof=True)


def test_limits() -> None:
    endless_head = HEAD_OK + b"X-Filler: " + b"a" * MAX_HEADER_BYTES
    with pytest.raises(RemoteProtocolError, match=f"head over {MAX_HEADER_BYTES} bytes"):
        parse("GET", [endless_head])
    big_head = HEAD_OK + b"X-Filler: " + b"a" * MAX_HEADER_BYTES + b"\r\n\r\n"
    with pytest.raises(RemoteProtocolError, match=f"head over {MAX_HEADER_BYTES} bytes"):
        parse("GET", [big_head])
    many = HEAD_OK + b"X: 1\r\n" * (MAX_HEADERS + 1) + b"\r\n"
    with pytest.raises(RemoteProtocolError, match=f"at most {MAX_HEADERS}"):
        parse("GET", [many])
    long_chunk_line = HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n5;" + b"x" * MAX_CHUNK_LINE
    with pytest.raises(RemoteProtocolError, match="chunk-size line longer"):
        parse("GET", [long_chunk_line])
    with pytest.raises(RemoteProtocolError, match="at most 10"):
        parse("GET", [HEAD_OK + b"Content-Length: 11\r\n\r\n"], max_body=10)
    chunked = HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n6\r\nabcdef\r\n6\r\nabcdef\r\n"
    with pytest.raises(RemoteProtocolError, match="at most 10"):
        parse("GET", [chunked], max_body=10)
    with pytest.raises(RemoteProtocolError, match="at most 10"):
        parse("GET", [HEAD_OK + b"\r\n" + b"x" * 11], max_body=10)
    # The same inputs within the limits are fine; a streamed body has none.
    assert parse("GET", [chunked + b"0\r\n\r\n"], max_body=None).body == b"abcdef" * 2
    assert parse("GET", [HEAD_OK + b"X: 1\r\n" * (MAX_HEADERS - 1) + b"Content-Length: 0\r\n\r\n"])


def test_a_broken_parser_stays_broken() -> None:
    parser = ResponseParser("GET")
    parser.receive_data(b"garbage\r\n\r\n")
    with pytest.raises(RemoteProtocolError):
        parser.next_event()
    with pytest.raises(LocalProtocolError, match="after a protocol error"):
        parser.next_event()
    done = ResponseParser("GET")
    done.receive_data(JSON_200)
    while not isinstance(done.next_event(), EndOfMessage):
        pass
    with pytest.raises(LocalProtocolError, match="after EndOfMessage"):
        done.next_event()
    done.receive_data(b"")
    with pytest.raises(LocalProtocolError, match="after the end of the stream"):
        done.receive_data(b"more")
