"""ttrpc's envelopes through Google's protobuf runtime: the data of every ttrpc message.

ttrpc wraps every call in a ``ttrpc.Request`` and every answer in a ``ttrpc.Response``
(containerd/ttrpc ``request.proto``; the status is googleapis ``google/rpc/status.proto``)::

    message Request  { string service = 1; string method = 2; bytes payload = 3;
                       int64 timeout_nano = 4; repeated KeyValue metadata = 5; }
    message Response { google.rpc.Status status = 1; bytes payload = 2; }

The framing (:mod:`dracpu.wire.ttrpc`) hands the envelopes over as bytes; this module turns them
into :class:`Call` / :class:`Answer` values and back with the generated classes of
``dracpu._gen.pb2``. Encoding matches Go's ``proto.Marshal``: fields in ascending number,
proto3 defaults omitted, and a success answers with no ``status`` at all (Go's server leaves it
nil), so an empty successful reply is a 0-byte ``Response``.

Errors: data that does not decode is the peer's fault (:class:`RemoteProtocolError`); values
that cannot be encoded (an int64 out of range, text that is not UTF-8) are ours
(:class:`LocalProtocolError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from dracpu._gen.pb2.ttrpc import request_pb2
from dracpu.errors import LocalProtocolError, RemoteProtocolError
from dracpu.wire.events import TtrpcRequest, TtrpcResponse

__all__ = ["Answer", "Call", "read_request", "read_response", "request_data", "response_data"]


@dataclass(frozen=True, slots=True)
class Call:
    """A decoded request: ``payload`` is the inner request (e.g. an NRI ``CreateContainerRequest``);
    ``metadata`` the ``ttrpc.KeyValue`` pairs in wire order; ``timeout_nano`` 0 means none."""

    stream_id: int
    service: str
    method: str
    payload: bytes
    timeout_nano: int = 0
    metadata: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Answer:
    """A decoded response: ``status_code`` 0 is success (then ``payload`` is the inner response);
    anything else is a google.rpc code with ``status_message``. An absent status reads as 0."""

    stream_id: int
    status_code: int
    status_message: str
    payload: bytes


def read_request(message: TtrpcRequest) -> Call:
    """The call in a request message; :class:`RemoteProtocolError` if its envelope is malformed
    (a server still owes that stream an answer: Go sends INVALID_ARGUMENT)."""
    try:
        envelope = request_pb2.Request.FromString(message.data)
    except DecodeError as exc:
        raise RemoteProtocolError(f"unmarshal request error: {exc}") from exc
    return Call(
        message.stream_id,
        envelope.service,
        envelope.method,
        envelope.payload,
        envelope.timeout_nano,
        tuple((pair.key, pair.value) for pair in envelope.metadata),
    )


def read_response(message: TtrpcResponse) -> Answer:
    """The answer in a response message; :class:`RemoteProtocolError` if its envelope is
    malformed (a client cannot tell what the call did: drop the connection)."""
    try:
        envelope = request_pb2.Response.FromString(message.data)
    except DecodeError as exc:
        raise RemoteProtocolError(
            f"ttrpc: response on stream {message.stream_id} does not parse: {exc}"
        ) from exc
    status = envelope.status
    return Answer(message.stream_id, status.code, status.message, envelope.payload)


def request_data(
    service: str,
    method: str,
    payload: bytes,
    timeout_nano: int = 0,
    metadata: Sequence[tuple[str, str]] = (),
) -> bytes:
    """The serialized ``ttrpc.Request`` of a call."""
    try:
        envelope = request_pb2.Request(
            service=service, method=method, payload=payload, timeout_nano=timeout_nano
        )
        for key, value in metadata:
            envelope.metadata.add(key=key, value=value)
        return envelope.SerializeToString()
    except (ValueError, TypeError) as exc:  # upb: out of range, or not valid UTF-8
        raise LocalProtocolError(f"ttrpc: cannot encode the {method} request: {exc}") from exc


# A successful answer without payload: an empty Response (Go omits the nil status).
_EMPTY_OK = b""


def response_data(payload: bytes = b"", status_code: int = 0, status_message: str = "") -> bytes:
    """The serialized ``ttrpc.Response``; code 0 without a message leaves the status out."""
    if not payload and not status_code and not status_message:
        return _EMPTY_OK
    try:
        envelope = request_pb2.Response(payload=payload)
        if status_code or status_message:
            envelope.status.code = status_code
            envelope.status.message = status_message
        return envelope.SerializeToString()
    except (ValueError, TypeError) as exc:
        raise LocalProtocolError(f"ttrpc: cannot encode the response status: {exc}") from exc
