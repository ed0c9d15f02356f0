"""Sans-IO DRA kubelet-plugin messages: the four the kubelet exchanges with us, as protobuf bytes.

The kubelet calls ``NodePrepareResources`` and ``NodeUnprepareResources`` of
``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` (or ``...v1beta1.DRAPlugin``); ``proto/dra/v1`` and
``proto/dra/v1beta1/api.proto``, reference kubelet-and-k8s-api.md §1.2-1.3::

    message NodePrepareResourcesRequest   { repeated Claim claims = 1; }
    message NodeUnprepareResourcesRequest { repeated Claim claims = 1; }
    message Claim { string namespace = 1; string uid = 2; string name = 3; }

    message NodePrepareResourcesResponse  { map<string, NodePrepareResourceResponse> claims = 1; }
    message NodePrepareResourceResponse   { repeated Device devices = 1; string error = 2; }
    message Device { repeated string request_names = 1; string pool_name = 2;
                     string device_name = 3; repeated string cdi_device_ids = 4;
                     optional string share_id = 5;   // v1 only: v1beta1 has no field 5
                   }
    message NodeUnprepareResourcesResponse {
        map<string, NodeUnprepareResourceResponse> claims = 1; }
    message NodeUnprepareResourceResponse { string error = 1; }

Hand-written rather than generated because it is on the kubelet's hot path: betterproto2 spends
~24 us decoding a one-claim request and ~58 us encoding its one-claim response (hot; about
double with cold caches); here both take a few microseconds (``bench/bench_wire.py``,
``dra.*`` figures).

Decoding follows Go's ``proto.Unmarshal``: unknown fields, and known fields of another wire type,
are skipped; the last value of a scalar wins; every ``claims`` occurrence is one more claim, in
wire order; strings must be UTF-8. Malformed bytes raise :class:`RemoteProtocolError` (the
kubelet's fault) naming the message.

Encoding writes exactly what Google's protobuf (the upb runtime of the ``protobuf`` package)
writes with ``deterministic=True``: fields in ascending number, proto3 defaults omitted, every
element of a repeated field written (an empty string or an empty ``Device`` too), ``share_id``
written iff it is set (``""`` included: proto3 ``optional`` has explicit presence). A map entry
always carries both its key (field 1, even ``""``) and its value (field 2, even an empty message:
``12 00``), as upb and Go both write it. Map entries come in upb's deterministic order: by the
key's UTF-8 bytes, except that a key sorts AFTER every longer key it is a prefix of (upb compares
the common prefix, then puts the longer key first). For keys of one length, claim UIDs (36-char
UUIDs), that is plain byte order, Go's ``Deterministic`` order too; map order carries no meaning
on the wire, and the kubelet reads the map into a Go map. A string that is not encodable
(a lone surrogate) raises :class:`LocalProtocolError` (ours).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dracpu.errors import RemoteProtocolError
from dracpu.wire.protowire import WIRE_LEN, encode_text, len_field, scan_fields

__all__ = [
    "ClaimRef",
    "PrepareOutcome",
    "PreparedDevice",
    "decode_prepare_request",
    "decode_unprepare_request",
    "encode_prepare_response",
    "encode_unprepare_response",
]


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A ``Claim`` of a request: a ResourceClaim as the kubelet names it."""

    namespace: str
    uid: str
    name: str


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """A ``Device`` of a ``NodePrepareResourceResponse``: one device of a prepared claim, as the
    kubelet stores it. ``share_id`` ``None``: absent (v1beta1 never carries it)."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class PrepareOutcome:
    """A ``NodePrepareResourceResponse``: the answer for one claim, its devices or a non-empty
    ``error``."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


# --- decoding -------------------------------------------------------------------------------------

# Field numbers (proto/dra/v1/api.proto, the same in v1beta1).
_REQUEST_CLAIMS = 1
_CLAIM_NAMESPACE, _CLAIM_UID, _CLAIM_NAME = 1, 2, 3


def _text(data: bytes, start: int, end: int, what: str) -> str:
    try:
        return data[start:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError(f"protobuf: {what} is not valid UTF-8") from exc


def _claims(data: bytes) -> tuple[ClaimRef, ...]:
    claims: list[ClaimRef] = []
    for number, wire_type, a, b in scan_fields(data, 0, len(data)):
        if number != _REQUEST_CLAIMS or wire_type != WIRE_LEN:
            continue  # unknown, or a known field of another wire type: skipped as Go does
        namespace = uid = name = ""
        for inner, inner_type, c, d in scan_fields(data, a, b):
            if inner_type != WIRE_LEN:
                continue
            if inner == _CLAIM_UID:
                uid = _text(data, c, d, "Claim.uid")
            elif inner == _CLAIM_NAMESPACE:
                namespace = _text(data, c, d, "Claim.namespace")
            elif inner == _CLAIM_NAME:
                name = _text(data, c, d, "Claim.name")
        claims.append(ClaimRef(namespace, uid, name))
    return tuple(claims)


def _request_claims(data: bytes, message: str) -> tuple[ClaimRef, ...]:
    try:
        return _claims(bytes(data))
    except RemoteProtocolError as exc:
        raise RemoteProtocolError(f"malformed {message}: {exc}") from exc


def decode_prepare_request(data: bytes) -> tuple[ClaimRef, ...]:
    """The claims of a ``NodePrepareResourcesRequest``, in wire order (duplicates kept)."""
    return _request_claims(data, "NodePrepareResourcesRequest")


def decode_unprepare_request(data: bytes) -> tuple[ClaimRef, ...]:
    """The claims of a ``NodeUnprepareResourcesRequest`` (the same shape: ``claims = 1``), in
    wire order (duplicates kept)."""
    return _request_claims(data, "NodeUnprepareResourcesRequest")


# --- encoding -------------------------------------------------------------------------------------

# One-byte tags, (field number << 3) | WIRE_LEN: every field we write is length-delimited.
_TAG_1 = 0x0A
_TAG_2 = 0x12
_TAG_3 = 0x1A
_TAG_4 = 0x22
_TAG_5 = 0x2A
# A map entry's value field holding an empty message (upb and Go always write the value).
_EMPTY_VALUE = b"\x12\x00"
# Sorts after every byte of valid UTF-8 (which never holds 0xF8-0xFF): appended to a key, it
# makes a key sort after the longer keys it is a prefix of, as upb's map sorter does.
_AFTER_UTF8 = b"\xff"


def _device(device: PreparedDevice, share_ids: bool) -> bytes:
    out = bytearray()
    for request in device.request_names:
        out += len_field(_TAG_1, encode_text(request, "Device.request_names"))
    if device.pool_name:
        out += len_field(_TAG_2, encode_text(device.pool_name, "Device.pool_name"))
    if device.device_name:
        out += len_field(_TAG_3, encode_text(device.device_name, "Device.device_name"))
    for cdi_id in device.cdi_device_ids:
        out += len_field(_TAG_4, encode_text(cdi_id, "Device.cdi_device_ids"))
    if share_ids and device.share_id is not None:
        out += len_field(_TAG_5, encode_text(device.share_id, "Device.share_id"))
    return bytes(out)


def _prepare_outcome(outcome: PrepareOutcome, share_ids: bool) -> bytes:
    out = bytearray()
    for device in outcome.devices:
        out += len_field(_TAG_1, _device(device, share_ids))
    if outcome.error:
        out += len_field(_TAG_2, encode_text(outcome.error, "NodePrepareResourceResponse.error"))
    return bytes(out)


def _map(entries: list[tuple[bytes, bytes]]) -> bytes:
    """``map<string, Message> claims = 1`` from (key bytes, value field) pairs."""
    if len(entries) > 1:
        entries.sort(key=lambda entry: entry[0] + _AFTER_UTF8)
    out = bytearray()
    for key, value in entries:
        out += len_field(_TAG_1, len_field(_TAG_1, key) + value)
    return bytes(out)


def encode_prepare_response(
    claims: Mapping[str, PrepareOutcome], *, share_ids: bool = True
) -> bytes:
    """A ``NodePrepareResourcesResponse``: one entry per claim UID.

    ``share_ids=False`` for v1beta1, whose ``Device`` has no field 5: a ``share_id`` is then
    left out (as the kubelet's v1beta1 conversion loses it).
    """
    entries = [
        (
            encode_text(uid, "NodePrepareResourcesResponse.claims key"),
            len_field(_TAG_2, _prepare_outcome(outcome, share_ids)),
        )
        for uid, outcome in claims.items()
    ]
    return _map(entries)


def encode_unprepare_response(claims: Mapping[str, str]) -> bytes:
    """A ``NodeUnprepareResourcesResponse``: one entry per claim UID with its error (``""``:
    unprepared)."""
    entries = [
        (
            encode_text(uid, "NodeUnprepareResourcesResponse.claims key"),
            len_field(
                _TAG_2, len_field(_TAG_1, encode_text(error, "NodeUnprepareResourceResponse.error"))
            )
            if error
            else _EMPTY_VALUE,
        )
        for uid, error in claims.items()
    ]
    return _map(entries)
