"""gRPC over HTTP/2, unary server side (PROTOCOL-HTTP2.md): the request head, grpc-timeout,
the length-prefixed message, percent-encoded grpc-message (decoded here independently with
urllib), status trailers."""

from __future__ import annotations

from urllib.parse import unquote

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dracpu.errors import GrpcError
from dracpu.wire.grpc import (
    MAX_MESSAGE,
    RESPONSE_HEAD,
    CallHead,
    Status,
    frame_message,
    percent_encode,
    read_call_head,
    read_timeout,
    read_unary_message,
    trailers,
    trailers_only,
)
from tests.wire.h2_frames import GRPC_HEAD, GRPC_PATH

# --- status codes -------------------------------------------------------------------------------


def test_status_codes_are_grpcs() -> None:
    expected = {code.name: code.value[0] for code in grpc.StatusCode}
    assert {status.name: int(status) for status in Status} == expected


# --- grpc-timeout -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("1H", 3600.0),
        ("2M", 120.0),
        ("3S", 3.0),
        ("4m", 0.004),
        ("5u", 5e-6),
        ("6n", 6e-9),
        ("0S", 0.0),
        ("1999982u", 1.999982),  # what grpc-go sends for a 2 s deadline, 18 us later
        ("99999999H", 99999999 * 3600.0),  # 8 digits: the most the spec allows
        ("00000010m", 0.01),
    ],
)
def test_a_timeout_is_read_in_every_unit(value: str, seconds: float) -> None:
    assert read_timeout(value) == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "S",
        "1",
        "100000000S",  # 9 digits
        "1s",
        "1h",
        "1x",
        "-1S",
        "+1S",
        " 1S",
        "1 S",
        "1S ",
        "1.5S",
        "1e3S",
        "\u0663S",  # ARABIC-INDIC DIGIT THREE: a digit to str.isdigit, not to the spec
        "\uff11S",  # FULLWIDTH DIGIT ONE
    ],
)
def test_a_malformed_timeout_is_internal(value: str) -> None:
    with pytest.raises(GrpcError) as caught:
        read_timeout(value)
    assert caught.value.status == Status.INTERNAL
    assert caught.value.http_status == 200
    assert repr(value) in caught.value.message


# --- the request head ---------------------------------------------------------------------------


def test_a_grpc_request_head_gives_the_path_and_the_deadline() -> None:
    assert read_call_head(GRPC_HEAD) == CallHead(GRPC_PATH, None)
    assert read_call_head((*GRPC_HEAD, ("grpc-timeout", "250m"))) == CallHead(GRPC_PATH, 0.25)
    # A codec suffix is gRPC too.
    proto = tuple(
        (name, "application/grpc+proto" if name == "content-type" else value)
        for name, value in GRPC_HEAD
    )
    assert read_call_head(proto) == CallHead(GRPC_PATH, None)


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/grpc-web", "text/plain", "application/grp"]
)
def test_a_body_that_is_not_grpc_is_refused_with_415(content_type: str) -> None:
    head = tuple(
        (name, content_type if name == "content-type" else value) for name, value in GRPC_HEAD
    )
    with pytest.raises(GrpcError) as caught:
        read_call_head(head)
    assert (caught.value.http_status, caught.value.status) == (415, Status.INTERNAL)
    assert content_type in caught.value.message


def test_a_request_without_content_type_is_refused_with_415() -> None:
    head = tuple((name, value) for name, value in GRPC_HEAD if name != "content-type")
    with pytest.raises(GrpcError) as caught:
        read_call_head(head)
    assert caught.value.http_status == 415


@pytest.mark.parametrize("method", ["GET", "PUT", "post", None])
def test_a_method_other_than_post_is_refused_with_405(method: str | None) -> None:
    head = tuple((name, value) for name, value in GRPC_HEAD if name != ":method")
    if method is not None:
        head = ((":method", method), *head)
    with pytest.raises(GrpcError) as caught:
        read_call_head(head)
    assert (caught.value.http_status, caught.value.status) == (405, Status.INTERNAL)
    # The method is judged before the content type.
    head = tuple((name, "text/plain" if name == "content-type" else v) for name, v in head)
    with pytest.raises(GrpcError) as caught:
        read_call_head(head)
    assert caught.value.http_status == 405


def test_a_bad_timeout_in_the_head_is_internal_not_an_http_refusal() -> None:
    with pytest.raises(GrpcError) as caught:
        read_call_head((*GRPC_HEAD, ("grpc-timeout", "soon")))
    assert (caught.value.http_status, caught.value.status) == (200, Status.INTERNAL)


# --- the message --------------------------------------------------------------------------------


def test_frame_message_is_flag_length_bytes() -> None:
    assert frame_message(b"") == b"\x00\x00\x00\x00\x00"
    assert frame_message(b"\x0a\x01x") == b"\x00\x00\x00\x00\x03\x0a\x01x"
    assert frame_message(b"y" * 300) == b"\x00\x00\x00\x01\x2c" + b"y" * 300
    assert frame_message(b"z" * 70_000)[:5] == b"\x00\x00\x01\x11\x70"


@given(st.binary(max_size=2000))
@settings(max_examples=200)
def test_a_framed_message_reads_back(message: bytes) -> None:
    assert read_unary_message(frame_message(message)) == message


def test_the_largest_message_is_accepted() -> None:
    message = b"m" * MAX_MESSAGE
    assert MAX_MESSAGE == 4 * 1024 * 1024
    assert read_unary_message(frame_message(message)) == message


def grpc_error(body: bytes) -> GrpcError:
    with pytest.raises(GrpcError) as caught:
        read_unary_message(body)
    assert caught.value.http_status == 200
    return caught.value


@pytest.mark.parametrize(
    "body",
    [
        b"",  # no message at all
        b"\x00\x00\x00\x00",  # a prefix cut short
        b"\x00\x00\x00\x00\x05abc",  # a message cut short
        frame_message(b"one") + frame_message(b"two"),  # a unary call with two messages
        frame_message(b"one") + b"\x00",  # a byte after the message
        b"\x02\x00\x00\x00\x00",  # a flag that is neither 0 nor 1
        b"\x80\x00\x00\x00\x01x",
    ],
    ids=[
        "empty",
        "short prefix",
        "cut short",
        "two messages",
        "trailing byte",
        "flag 2",
        "flag 128",
    ],
)
def test_a_malformed_body_is_internal(body: bytes) -> None:
    assert grpc_error(body).status == Status.INTERNAL


def test_a_compressed_message_is_unimplemented() -> None:
    error = grpc_error(b"\x01\x00\x00\x00\x03abc")
    assert error.status == Status.UNIMPLEMENTED


def test_a_message_over_the_limit_is_resource_exhausted_before_it_arrives() -> None:
    # Only the prefix is there: the announced size alone is refused.
    prefix = b"\x00" + (MAX_MESSAGE + 1).to_bytes(4, "big")
    error = grpc_error(prefix)
    assert error.status == Status.RESOURCE_EXHAUSTED
    assert str(MAX_MESSAGE + 1) in error.message
    assert grpc_error(b"\x00\xff\xff\xff\xff").status == Status.RESOURCE_EXHAUSTED


# --- grpc-message -------------------------------------------------------------------------------


def test_printable_ascii_passes_through() -> None:
    text = "".join(chr(c) for c in range(0x20, 0x7F) if c != 0x25)
    assert percent_encode(text) == text
    assert percent_encode("") == ""


def test_percent_and_everything_outside_printable_ascii_is_encoded_as_utf8_bytes() -> None:
    assert percent_encode("100%") == "100%25"
    assert percent_encode("%25") == "%2525"
    assert percent_encode("caf\u00e9") == "caf%C3%A9"
    assert percent_encode("a\nb\tc\rd\x00e\x7f") == "a%0Ab%09c%0Dd%00e%7F"
    assert percent_encode("\U0001f600") == "%F0%9F%98%80"
    assert percent_encode("\u20ac 5") == "%E2%82%AC 5"


@given(st.text(max_size=200))
@settings(max_examples=200)
def test_percent_encoding_round_trips_through_an_independent_decoder(text: str) -> None:
    encoded = percent_encode(text)
    # Only what the spec lets through unencoded: 0x20-0x7E.
    assert all(0x20 <= ord(char) <= 0x7E for char in encoded)
    assert unquote(encoded, encoding="utf-8", errors="strict") == text
    # Every '%' starts an escape of two upper-case hex digits.
    assert all(set(part[:2]) <= set("0123456789ABCDEF") for part in encoded.split("%")[1:])
    assert all(len(part) >= 2 for part in encoded.split("%")[1:])


# --- trailers -----------------------------------------------------------------------------------


def test_trailers_carry_the_status_and_an_encoded_message() -> None:
    assert trailers(Status.OK) == [("grpc-status", "0")]
    assert trailers(Status.NOT_FOUND, "claim 5 % gone") == [
        ("grpc-status", "5"),
        ("grpc-message", "claim 5 %25 gone"),
    ]
    assert trailers(16, "caf\u00e9") == [("grpc-status", "16"), ("grpc-message", "caf%C3%A9")]


def test_a_trailers_only_answer_is_head_and_trailers_in_one() -> None:
    error = GrpcError(Status.FAILED_PRECONDITION, "cpus 0-3 taken\n")
    assert trailers_only(error) == [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("grpc-status", "9"),
        ("grpc-message", "cpus 0-3 taken%0A"),
    ]
    refused = GrpcError(Status.INTERNAL, "", http_status=415)
    assert trailers_only(refused) == [
        (":status", "415"),
        ("content-type", "application/grpc"),
        ("grpc-status", "13"),
    ]
    assert list(RESPONSE_HEAD) == trailers_only(error)[:2]
