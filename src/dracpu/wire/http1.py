"""Sans-IO HTTP/1.1, client side: encode a request, parse its response fed in byte chunks.

Modelled on h11 (``reference/model-codebases.md`` §3): no I/O, bytes in, events out::

    wire = encode_request("GET", "/api/v1/nodes/a", host="10.0.0.1:6443", headers=[...])
    parser = ResponseParser("GET")
    parser.receive_data(chunk)          # b"" = the peer closed the connection
    event = parser.next_event()         # Response | Data | EndOfMessage | NEED_DATA

One parser reads ONE response (a client sends its next request on the same connection only
after the previous answer ended, so there is no pipelining to track). After
:class:`EndOfMessage`, :attr:`ResponseParser.reusable` says whether the connection may carry
another request: HTTP/1.1, no ``Connection: close``, the body was delimited by its framing (not
by the close) and the server sent nothing beyond it.

Body framing, RFC 9112 §6.3, in this order:

1. the answer to HEAD, every 1xx, 204 and 304, and a 2xx answer to CONNECT: no body;
2. ``Transfer-Encoding: chunked``: chunks; chunk extensions and trailer fields are read and
   ignored. Any other transfer coding is refused (we never ask for one);
   with ``Content-Length`` as well (a smuggling sign) chunked wins and the connection is not
   reused;
3. ``Content-Length``: exactly that many bytes (repeated identical values are tolerated,
   different ones are an error);
4. otherwise: everything until the server closes the connection.

Interim 1xx answers (a proxy may send ``100 Continue``) are skipped; ``101 Switching
Protocols`` is an error since we never ask to upgrade. Lines must end in CRLF; obs-fold
(a header line starting with white space, RFC 9112 §5.2) is refused.

Everything the peer gets wrong raises :class:`~dracpu.errors.RemoteProtocolError` naming the bad
value, and the parser stays broken (drop the connection). Limits (each a
``RemoteProtocolError``): the head and the trailer block at most :data:`MAX_HEADER_BYTES`,
:data:`MAX_HEADERS` fields, a chunk-size line at most :data:`MAX_CHUNK_LINE` bytes, and for a
non-streamed response (``max_body`` given) a body of at most ``max_body`` bytes. Body bytes come
out as :class:`Data` events as soon as they arrive, so a streamed body (a watch) is consumed
incrementally.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, NoReturn

from dracpu.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "MAX_BODY",
    "MAX_CHUNK_LINE",
    "MAX_HEADERS",
    "MAX_HEADER_BYTES",
    "NEED_DATA",
    "Data",
    "EndOfMessage",
    "NeedData",
    "Response",
    "ResponseParser",
    "encode_request",
]

# Bytes of a response head (status line + header fields + blank line), and of a trailer block.
# Go's net/http server allows 1 MiB of REQUEST headers; API server responses carry a dozen short
# fields. 64 KiB is h11's default (DEFAULT_MAX_INCOMPLETE_EVENT_SIZE = 16 KiB) with headroom.
MAX_HEADER_BYTES: Final = 64 * 1024
# Header fields in one head: the API server sends ~10 (Audit-Id, Cache-Control, Content-Type,
# X-Kubernetes-Pf-*, Date, Content-Length); a proxy adds a few.
MAX_HEADERS: Final = 256
# A chunk-size line (hex size + extensions + CRLF). Go writes the bare size ("%x\r\n"); 4 KiB is
# Go's own reader limit for the line (net/http/internal/chunked.go maxLineLength = 4096).
MAX_CHUNK_LINE: Final = 4096
# Default body limit of a non-streamed response: a 1024-CPU node's ResourceSlice LIST is a few
# MB; 64 MiB is also the fake API server's request limit (dracpu.sim.fake_apiserver).
MAX_BODY: Final = 64 * 1024 * 1024

_CRLF: Final = b"\r\n"
_HEAD_END: Final = b"\r\n\r\n"
# RFC 9110 §5.6.2 token (method, header field name).
_TOKEN_STR = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Characters a field value or request target must never contain (RFC 9110 §5.5: CR, LF, NUL).
_FORBIDDEN_IN_VALUE = re.compile(r"[\r\n\x00]")
_FORBIDDEN_IN_TARGET = re.compile(r"[\s\x00-\x1f\x7f]")
# RFC 9112 §4: status-line = HTTP-version SP status-code SP [ reason-phrase ]. A missing SP
# before an empty reason is tolerated, as h11 and Go do.
_STATUS_LINE = re.compile(rb"HTTP/1\.([0-9]) ([0-9]{3})(?: ([\t\x20-\x7e\x80-\xff]*))?")
_HEX = re.compile(rb"[0-9A-Fa-f]+")
# A header field line (RFC 9112 §5: field-name ":" OWS field-value OWS), on the latin-1 text of
# the block with a final CRLF; the value may hold any octet but CR, LF, NUL (RFC 9110 §5.5).
_FIELD_LINE = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\r\n\x00]*\r\n"
_FIELD_BLOCK = re.compile(f"(?:{_FIELD_LINE})*")
_FIELD = re.compile(r"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([^\r\n\x00]*)\r\n")
# Headers the encoder writes itself: callers may not pass them.
_SET_BY_ENCODER: Final = frozenset({"host", "content-length", "transfer-encoding"})
# Methods whose request has a body by definition, so an empty one still gets Content-Length: 0
# (RFC 9110 §8.6: "a user agent SHOULD send Content-Length ... when the method defines a
# meaning for an enclosed content").
_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})


def encode_request(
    method: str,
    target: str,
    *,
    host: str,
    headers: Iterable[tuple[str, str]] = (),
    body: bytes = b"",
) -> bytes:
    """The bytes of one request: request line, ``Host``, ``headers`` in order,
    ``Content-Length`` (when there is a body or the method defines one), blank line, body.

    ``target`` is origin-form (``/path?query``) or absolute-form (``http://host/path``, for a
    proxy) or authority-form (``host:port``, for CONNECT). Raises
    :class:`~dracpu.errors.LocalProtocolError` for a method, target or header that cannot be
    sent (a CR/LF in a value would split the request).
    """
    if not _TOKEN_STR.fullmatch(method):
        raise LocalProtocolError(f"HTTP method {method!r} is not a token")
    if not target or _FORBIDDEN_IN_TARGET.search(target):
        raise LocalProtocolError(f"HTTP request target {target!r} is empty or has white space")
    if _FORBIDDEN_IN_VALUE.search(host) or not host:
        raise LocalProtocolError(f"HTTP Host {host!r} is empty or has CR/LF/NUL")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    for name, value in headers:
        if not _TOKEN_STR.fullmatch(name):
            raise LocalProtocolError(f"HTTP header name {name!r} is not a token")
        if name.lower() in _SET_BY_ENCODER:
            raise LocalProtocolError(f"HTTP header {name} is written by the encoder itself")
        if _FORBIDDEN_IN_VALUE.search(value):
            raise LocalProtocolError(f"HTTP header {name} has CR, LF or NUL in {value!r}")
        lines.append(f"{name}: {value}")
    if body or method in _BODY_METHODS:
        lines.append(f"Content-Length: {len(body)}")
    lines.append("\r\n")
    try:
        head = "\r\n".join(lines).encode("latin-1")
    except UnicodeEncodeError as exc:
        raise LocalProtocolError(f"HTTP request head is not latin-1: {exc}") from exc
    return head + body if body else head


# --- events -------------------------------------------------------------------------------------


class NeedData:
    """The sentinel type of :data:`NEED_DATA`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = NeedData()
"""``next_event()`` needs more bytes (or the EOF) before it can say anything."""


@dataclass(frozen=True, slots=True)
class Response:
    """The final response head. ``headers``: ``(lower-case name, value)`` in order."""

    status: int
    reason: str
    http_version: str
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        """The value of the first field ``name`` (case-insensitive), else ``None``."""
        wanted = name.lower()
        for key, value in self.headers:
            if key == wanted:
                return value
        return None


@dataclass(frozen=True, slots=True)
class Data:
    """Body bytes, in arrival order (chunk boundaries are not preserved)."""

    data: bytes


@dataclass(frozen=True, slots=True)
class EndOfMessage:
    """The body ended (trailer fields, if any, were read and dropped)."""


Event = Response | Data | EndOfMessage | NeedData


class _State(enum.Enum):
    HEAD = enum.auto()
    LENGTH = enum.auto()  # Content-Length body: _remaining bytes left
    CHUNK_SIZE = enum.auto()
    CHUNK_DATA = enum.auto()  # _remaining bytes of this chunk left
    CHUNK_END = enum.auto()  # the CRLF after a chunk's data
    TRAILERS = enum.auto()
    UNTIL_CLOSE = enum.auto()
    END = enum.auto()  # the body is complete; EndOfMessage not returned yet
    DONE = enum.auto()
    ERROR = enum.auto()


def _split_head(block: bytes, what: str) -> list[tuple[str, str]]:
    """Parse header field lines (no status line, no final blank line): one regex check of the
    whole block and one ``findall`` (C speed: this runs for every response); the slow path only
    names the bad line."""
    if not block:
        return []
    text = block.decode("latin-1") + "\r\n"
    if _FIELD_BLOCK.fullmatch(text) is None:
        _raise_bad_field(text, what)
    fields: list[tuple[str, str]] = _FIELD.findall(text)
    if len(fields) > MAX_HEADERS:
        raise RemoteProtocolError(
            f"HTTP {what}: {len(fields)} header fields, at most {MAX_HEADERS}"
        )
    return [(name.lower(), value.rstrip(" \t")) for name, value in fields]


def _raise_bad_field(text: str, what: str) -> NoReturn:
    for line in text.split("\r\n")[:-1]:
        if line[:1] in (" ", "\t"):
            raise RemoteProtocolError(f"HTTP {what}: obsolete line folding in {line[:80]!r}")
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN_STR.fullmatch(name):
            raise RemoteProtocolError(f"HTTP {what}: malformed header line {line[:80]!r}")
        if _FORBIDDEN_IN_VALUE.search(value):
            raise RemoteProtocolError(f"HTTP {what}: CR/LF/NUL in header {name!r}")
    raise RemoteProtocolError(f"HTTP {what}: malformed header block {text[:80]!r}")


def _content_length(values: list[str]) -> int:
    """One length from every Content-Length field (RFC 9110 §8.6: a list of identical values
    may be accepted; anything else is unrecoverable)."""
    if len(values) == 1 and values[0].isdigit() and values[0].isascii():
        return int(values[0])  # the usual case
    lengths = set()
    for value in values:
        for part in value.split(","):
            text = part.strip(" \t")
            if not text.isdigit() or not text.isascii():
                raise RemoteProtocolError(f"HTTP Content-Length {value!r} is not a number")
            lengths.add(int(text))
    if len(lengths) != 1:
        raise RemoteProtocolError(f"HTTP Content-Length fields disagree: {values!r}")
    return lengths.pop()


class ResponseParser:
    """Parses the response to one request of ``method``.

    ``max_body``: the largest body accepted (``None``: no limit, for a streamed body such as a
    watch, which the caller consumes as :class:`Data` events arrive).
    """

    __slots__ = (
        "_buffer",
        "_close_delimited",
        "_eof",
        "_got_bytes",
        "_keep_alive",
        "_max_body",
        "_method",
        "_received_body",
        "_remaining",
        "_state",
        "response",
    )

    def __init__(self, method: str, *, max_body: int | None = MAX_BODY) -> None:
        self._method = method.upper()
        self._max_body = max_body
        self._buffer = bytearray()
        self._eof = False
        self._got_bytes = False
        self._state = _State.HEAD
        self._remaining = 0
        self._received_body = 0
        self._keep_alive = False
        self._close_delimited = False
        self.response: Response | None = None
        """The final response head, once :meth:`next_event` returned it."""

    # --- input ---------------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Feed bytes from the connection; ``b""`` means the peer closed it."""
        if self._eof and data:
            raise LocalProtocolError("HTTP response: data fed after the end of the stream")
        if data:
            self._buffer += data
            self._got_bytes = True
        else:
            self._eof = True

    @property
    def reusable(self) -> bool:
        """Whether the connection may carry another request: the response ended by its own
        framing, HTTP/1.1 without ``Connection: close``, and no byte beyond it arrived."""
        return (
            self._state in (_State.END, _State.DONE)
            and self._keep_alive
            and not self._close_delimited
            and not self._buffer
            and not self._eof
        )

    @property
    def started(self) -> bool:
        """Whether any byte of the response arrived (a request whose connection dropped
        before this may be sent again, if idempotent)."""
        return self._got_bytes

    # --- output --------------------------------------------------------------------------------

    def next_event(self) -> Event:
        """The next event, or :data:`NEED_DATA` (feed more bytes or the EOF)."""
        try:
            return self._next_event()
        except RemoteProtocolError:
            self._state = _State.ERROR
            raise

    def _next_event(self) -> Event:
        state = self._state
        if state is _State.HEAD:
            return self._read_head()
        if state is _State.LENGTH:
            return self._read_length()
        if state is _State.CHUNK_DATA:
            return self._read_chunk_data()
        if state is _State.CHUNK_SIZE:
            return self._read_chunk_size()
        if state is _State.CHUNK_END:
            if len(self._buffer) < 2:
                return self._need(self._eof, "inside a chunk")
            if self._buffer[:2] != _CRLF:
                raise RemoteProtocolError(
                    "HTTP chunked body: chunk data not followed by CRLF: "
                    f"{bytes(self._buffer[:8])!r}"
                )
            del self._buffer[:2]
            self._state = _State.CHUNK_SIZE
            return self._read_chunk_size()
        if state is _State.TRAILERS:
            return self._read_trailers()
        if state is _State.UNTIL_CLOSE:
            if self._buffer:
                return self._take_body(len(self._buffer))
            if self._eof:
                self._state = _State.DONE
                return EndOfMessage()
            return NEED_DATA
        if state is _State.END:
            self._state = _State.DONE
            return EndOfMessage()
        if state is _State.DONE:
            raise LocalProtocolError("HTTP response: next_event() after EndOfMessage")
        raise LocalProtocolError("HTTP response: next_event() after a protocol error")

    def _need(self, eof: bool, where: str) -> NeedData:
        if eof:
            raise RemoteProtocolError(f"HTTP response: the connection closed {where}")
        return NEED_DATA

    def _read_head(self) -> Event:
        while True:
            end = self._buffer.find(_HEAD_END)
            if end < 0:
                if len(self._buffer) > MAX_HEADER_BYTES:
                    raise RemoteProtocolError(f"HTTP response head over {MAX_HEADER_BYTES} bytes")
                if self._eof:
                    if self._buffer:
                        raise RemoteProtocolError(
                            "HTTP response: the connection closed inside the response head"
                        )
                    raise RemoteProtocolError(
                        "HTTP response: the connection closed before any answer"
                    )
                return NEED_DATA
            if end + 4 > MAX_HEADER_BYTES:
                raise RemoteProtocolError(f"HTTP response head over {MAX_HEADER_BYTES} bytes")
            head = bytes(self._buffer[:end])
            del self._buffer[: end + 4]
            status_line, _, block = head.partition(_CRLF)
            match = _STATUS_LINE.fullmatch(status_line)
            if match is None:
                raise RemoteProtocolError(f"HTTP response: bad status line {status_line[:80]!r}")
            minor, status = int(match[1]), int(match[2])
            fields = _split_head(block, "response")
            if status < 100:
                raise RemoteProtocolError(f"HTTP response: bad status code {status}")
            if status == 101:
                raise RemoteProtocolError(
                    "HTTP response: 101 Switching Protocols was not asked for"
                )
            if status < 200:
                continue  # interim answer (100 Continue, 103 Early Hints): the real one follows
            response = Response(
                status=status,
                reason=(match[3] or b"").decode("latin-1"),
                http_version=f"1.{minor}",
                headers=tuple(fields),
            )
            self.response = response
            self._frame_body(response, minor)
            return response

    def _frame_body(self, response: Response, minor: int) -> None:
        connection: list[str] = []
        codings: list[str] = []
        lengths: list[str] = []
        for name, value in response.headers:
            if name == "content-length":
                lengths.append(value)
            elif name == "transfer-encoding":
                codings.extend(t.strip(" \t").lower() for t in value.split(",") if t.strip(" \t"))
            elif name == "connection":
                connection.extend(t.strip(" \t").lower() for t in value.split(","))
        self._keep_alive = minor >= 1 and "close" not in connection
        status = response.status
        if (
            self._method == "HEAD"
            or status in (204, 304)
            or (self._method == "CONNECT" and 200 <= status < 300)
        ):
            self._state = _State.END
            return
        if codings:
            if codings != ["chunked"]:
                raise RemoteProtocolError(
                    f"HTTP response: unsupported Transfer-Encoding {', '.join(codings)!r}"
                )
            if lengths:
                self._keep_alive = False  # both framings: answer it, then drop the connection
            self._state = _State.CHUNK_SIZE
            return
        if lengths:
            length = _content_length(lengths)
            self._check_body_size(length)
            self._remaining = length
            self._state = _State.LENGTH if length else _State.END
            return
        self._close_delimited = True
        self._state = _State.UNTIL_CLOSE

    def _check_body_size(self, size: int) -> None:
        if self._max_body is not None and size > self._max_body:
            raise RemoteProtocolError(
                f"HTTP response body of {size} bytes or more, at most {self._max_body}"
            )

    def _take_body(self, n: int) -> Data:
        self._received_body += n
        self._check_body_size(self._received_body)
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return Data(data)

    def _read_length(self) -> Event:
        if not self._buffer:
            if self._eof:
                raise RemoteProtocolError(
                    f"HTTP response: the connection closed with {self._remaining} of "
                    f"{self._received_body + self._remaining} body bytes missing"
                )
            return NEED_DATA
        return self._take_part(_State.END)

    def _read_chunk_size(self) -> Event:
        end = self._buffer.find(_CRLF, 0, MAX_CHUNK_LINE)
        if end < 0:
            if len(self._buffer) >= MAX_CHUNK_LINE:
                raise RemoteProtocolError(
                    f"HTTP chunked body: chunk-size line longer than {MAX_CHUNK_LINE} bytes"
                )
            return self._need(self._eof, "before a chunk size")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        size_text = line.split(b";", 1)[0].strip(b" \t")
        if not _HEX.fullmatch(size_text) or len(size_text) > 16:
            raise RemoteProtocolError(f"HTTP chunked body: bad chunk size {line[:80]!r}")
        size = int(size_text, 16)
        if size == 0:
            self._state = _State.TRAILERS
            return self._read_trailers()
        self._check_body_size(self._received_body + size)
        self._remaining = size
        self._state = _State.CHUNK_DATA
        return self._read_chunk_data()

    def _read_chunk_data(self) -> Event:
        if not self._buffer:
            return self._need(self._eof, "inside a chunk")
        return self._take_part(_State.CHUNK_END)

    def _take_part(self, then: _State) -> Data:
        """The buffered bytes of the current body part, up to what is left of it (the buffer
        is not empty); ``then`` is the state once the part is complete."""
        n = min(self._remaining, len(self._buffer))
        self._remaining -= n
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        self._received_body += n
        if not self._remaining:
            self._state = then
        return Data(data)

    def _read_trailers(self) -> Event:
        if self._buffer[:2] == _CRLF:
            del self._buffer[:2]
            self._state = _State.DONE
            return EndOfMessage()
        end = self._buffer.find(_HEAD_END)
        if end < 0:
            if len(self._buffer) > MAX_HEADER_BYTES:
                raise RemoteProtocolError(
                    f"HTTP trailer block longer than {MAX_HEADER_BYTES} bytes"
                )
            return self._need(self._eof, "in the trailers")
        if end + 4 > MAX_HEADER_BYTES:
            raise RemoteProtocolError(f"HTTP trailer block over {MAX_HEADER_BYTES} bytes")
        block = bytes(self._buffer[:end])
        del self._buffer[: end + 4]
        _split_head(block, "trailer")  # validated, then dropped
        self._state = _State.DONE
        return EndOfMessage()
