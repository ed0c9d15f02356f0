"""The checkpoint: what survives a restart of dracpu (and a reboot of the node), as versioned JSON.

Only the prepared claims are persisted: containers are learnt again from NRI ``Synchronize``.
The document (version 5, a SHA-256 ``checksum`` over its canonical JSON, the write's
``sequence``) and what each claim field means are ``docs/architecture.md``, "The checkpoint
document"; versions 1 to 4 still decode. :func:`decode` refuses anything else with a
:class:`CheckpointError` naming the problem; whether the claims fit the node is checked when
the state is restored (:func:`dracpu.core.state.restore_state`), since it needs the topology.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from dracpu.core.commands import DeviceResult
from dracpu.core.cpuset import CpuSet
from dracpu.errors import CheckpointError, CpuSetParseError

__all__ = [
    "CHECKPOINT_VERSION",
    "CheckpointData",
    "PreparedClaim",
    "StoredCheckpoint",
    "decode",
    "encode",
]

# Bump on any incompatible change of the layout above (2: + "sequence"; 3: + "podClaimName",
# "podUids"; 4: + "podNames", "copierPods"; 5: + "sharedPool").
CHECKPOINT_VERSION = 5
_LEGACY_VERSION = 1  # the layout of earlier builds: no "sequence"; decodes as sequence 0
_KNOWN_VERSIONS = (_LEGACY_VERSION, 2, 3, 4, CHECKPOINT_VERSION)
_CHECKSUM_PREFIX = "sha256:"
_SHA256_HEX_LEN = 64  # hashlib.sha256().hexdigest() length
_TOP_KEYS = frozenset({"version", "checksum", "claims", "sequence"})
_LEGACY_TOP_KEYS = frozenset({"version", "checksum", "claims"})
_CLAIM_KEYS = frozenset(
    {
        "cpus",
        "mems",
        "namespace",
        "name",
        "podClaimName",
        "podUids",
        "podNames",
        "copierPods",
        "sharedPool",
        "results",
    }
)
_CLAIM_KEYS_V4 = _CLAIM_KEYS - {"sharedPool"}
_CLAIM_KEYS_V3 = _CLAIM_KEYS_V4 - {"podNames", "copierPods"}
_CLAIM_KEYS_V1 = _CLAIM_KEYS_V3 - {"podClaimName", "podUids"}  # versions 1 and 2
_CLAIM_KEYS_OF = {
    1: _CLAIM_KEYS_V1,
    2: _CLAIM_KEYS_V1,
    3: _CLAIM_KEYS_V3,
    4: _CLAIM_KEYS_V4,
    5: _CLAIM_KEYS,
}
_RESULT_KEYS = frozenset({"request", "pool", "device", "consumedCpus", "cpuset"})
_FRAGMENT_SLACK = 64  # memoized claim fragments beyond 2x the live claims before a sweep


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    """A claim this node has prepared: its CPUs are held exclusively until Unprepare.

    ``mems``: the NUMA nodes of ``cpus`` its containers' memory is pinned to, or ``None``.
    ``results``: the allocation results it was prepared for, sorted
    (:meth:`DeviceResult.sort_key`); empty for a claim adopted from its CDI spec.
    ``pod_uids``: the pods the claim is reserved for (``status.reservedFor``, resource
    ``pods``), whose containers alone may use it; empty when not known (adopted, prepared by an
    earlier build, or reserved for no pod): then the first container to show the claim's env
    keeps it (:mod:`dracpu.core.state_containers`).
    ``pod_claim_name``: the claim's ``resource.kubernetes.io/pod-claim-name`` annotation (a
    claim made from a template), ``None`` without one.
    ``pod_names``: the names of the pods of ``pod_uids`` (in the claim's namespace: a pod can
    only use claims of its own), as the kubelet's PodResources listing names pods; empty when
    not known (then the listing cannot tell whether they are gone).
    ``copiers``: pods whose containers showed a copy of the claim's env and that a fresh look
    at the claim found not reserved for it (a pod's claims cannot change, so they never will
    be): their containers are refused without another look and another warning.
    ``shared_pool``: its containers run on its CPUs and on the shared pool, which they follow
    (``cpuConfig.sharedPool``; :mod:`dracpu.core.state_containers`).
    """

    claim_uid: str
    cpus: CpuSet
    namespace: str = ""
    name: str = ""
    mems: CpuSet | None = None
    results: tuple[DeviceResult, ...] = ()
    pod_uids: frozenset[str] = frozenset()
    pod_claim_name: str | None = None
    pod_names: frozenset[str] = frozenset()
    copiers: frozenset[str] = frozenset()
    shared_pool: bool = False


@dataclass(frozen=True, slots=True)
class CheckpointData:
    """The persisted content: prepared claims by UID (read-only view, never copied)."""

    claims: Mapping[str, PreparedClaim] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class StoredCheckpoint:
    """A decoded checkpoint document: its content and the sequence number of its write
    (0 for a version-1 document, which has none)."""

    data: CheckpointData
    sequence: int


# --- encode ---------------------------------------------------------------------------------------


def _canonical(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _checksum(payload: Mapping[str, Any]) -> str:
    return _CHECKSUM_PREFIX + hashlib.sha256(_canonical(payload)).hexdigest()


def _result_doc(result: DeviceResult) -> dict[str, Any]:
    return {
        "request": result.request,
        "pool": result.pool,
        "device": result.device,
        "consumedCpus": result.consumed_cpus,
        "cpuset": None if result.cpuset is None else str(result.cpuset),
    }


def _claim_doc(claim: PreparedClaim) -> dict[str, Any]:
    return {
        "cpus": str(claim.cpus),
        "mems": None if claim.mems is None else str(claim.mems),
        "namespace": claim.namespace,
        "name": claim.name,
        "podClaimName": claim.pod_claim_name,
        "podUids": sorted(claim.pod_uids),
        "podNames": sorted(claim.pod_names),
        "copierPods": sorted(claim.copiers),
        "sharedPool": claim.shared_pool,
        "results": [_result_doc(r) for r in claim.results],
    }


def _fragment(claim: PreparedClaim) -> bytes:
    """The canonical JSON of one claim's record, memoized by identity: a claim is immutable and
    lives as long as it is prepared, so a checkpoint write encodes only the claims that changed."""
    key = id(claim)
    hit = _fragments.get(key)
    if hit is not None and hit[0] is claim:
        return hit[1]
    fragment = _canonical(_claim_doc(claim))
    _fragments[key] = (claim, fragment)
    return fragment


# id(claim) -> (claim, its canonical JSON). The claim is kept in the entry so its id cannot be
# reused while the entry exists; encode() drops entries of claims no longer checkpointed.
_fragments: dict[int, tuple[PreparedClaim, bytes]] = {}


def encode(data: CheckpointData, sequence: int) -> bytes:
    """The checkpoint document of write number ``sequence`` (>= 1): canonical JSON (what
    ``json.dumps(doc, sort_keys=True, separators=(",", ":"))`` gives) plus a final newline.

    Built from memoized per-claim fragments: with sorted keys the document is
    ``{"checksum":…,"claims":{…},"sequence":…,"version":4}`` and the checksummed payload is the
    same text without the ``"checksum"`` member, so it is hashed and spliced rather than dumped
    twice.
    """
    if type(sequence) is not int or sequence < 1:
        raise CheckpointError(f"checkpoint sequence must be an integer >= 1, not {sequence!r}")
    claims = data.claims
    parts = [
        b"".join((_canonical_str(uid), b":", _fragment(claims[uid]))) for uid in sorted(claims)
    ]
    if len(_fragments) > 2 * len(claims) + _FRAGMENT_SLACK:
        live = {id(claim) for claim in claims.values()}
        for key in list(_fragments):  # a copy: safe if another thread encodes meanwhile
            if key not in live:
                _fragments.pop(key, None)
    body = b"".join(
        (
            b'"claims":{',
            b",".join(parts),
            b'},"sequence":',
            str(sequence).encode(),
            b',"version":',
            str(CHECKPOINT_VERSION).encode(),
        )
    )
    checksum = _CHECKSUM_PREFIX + hashlib.sha256(b"{" + body + b"}").hexdigest()
    return b'{"checksum":' + _canonical_str(checksum) + b"," + body + b"}\n"


def _canonical_str(text: str) -> bytes:
    return json.dumps(text, ensure_ascii=True).encode()


# --- decode ---------------------------------------------------------------------------------------


def decode(raw: bytes) -> StoredCheckpoint:
    """Parse and verify a checkpoint document (version 1 to 4); :class:`CheckpointError` says
    what is wrong."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"checkpoint is not UTF-8 text: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # json.loads of deeply nested arrays/objects
        raise CheckpointError("checkpoint is not valid JSON: nested too deeply") from exc
    if not isinstance(doc, dict):
        raise CheckpointError(f"checkpoint must be a JSON object, not {type(doc).__name__}")
    version = doc.get("version")
    if type(version) is not int:
        raise CheckpointError(f"checkpoint has no integer 'version' (got {version!r})")
    if version not in _KNOWN_VERSIONS:
        raise CheckpointError(
            f"checkpoint version {version} is unknown: this dracpu reads versions "
            + ", ".join(map(str, _KNOWN_VERSIONS))
        )
    top_keys = _LEGACY_TOP_KEYS if version == _LEGACY_VERSION else _TOP_KEYS
    keys = set(doc)
    if keys != top_keys:
        raise CheckpointError(
            f"checkpoint version {version} keys must be {sorted(top_keys)}, got {sorted(keys)}"
        )
    sequence = doc.get("sequence", 0)
    if version != _LEGACY_VERSION and (type(sequence) is not int or sequence < 1):
        raise CheckpointError(f"checkpoint sequence must be an integer >= 1, not {sequence!r}")
    checksum = doc.pop("checksum")
    if (
        not isinstance(checksum, str)
        or not checksum.startswith(_CHECKSUM_PREFIX)
        or len(checksum) != len(_CHECKSUM_PREFIX) + _SHA256_HEX_LEN
    ):
        raise CheckpointError(f"checkpoint checksum {checksum!r} is not 'sha256:<64 hex digits>'")
    try:
        expected = _checksum(doc)
    except RecursionError as exc:  # json.dumps of a parseable but deeply nested document
        raise CheckpointError("checkpoint is nested too deeply") from exc
    if checksum != expected:
        raise CheckpointError(
            f"checkpoint checksum mismatch: file says {checksum}, content hashes to {expected}"
        )
    claims_doc = doc["claims"]
    if not isinstance(claims_doc, dict):
        raise CheckpointError("checkpoint 'claims' must be an object")
    claims: dict[str, PreparedClaim] = {}
    held = 0
    claim_keys = _CLAIM_KEYS_OF[version]
    for uid, claim_doc in claims_doc.items():
        claim = _decode_claim(uid, claim_doc, claim_keys)
        if held & claim.cpus.mask:
            raise CheckpointError(
                f"checkpoint claim {uid} holds cpus {claim.cpus & CpuSet.from_mask(held)} "
                "that another claim holds too"
            )
        held |= claim.cpus.mask
        claims[uid] = claim
    return StoredCheckpoint(CheckpointData(MappingProxyType(claims)), sequence)


def _cpuset(text: object, what: str, *, optional: bool = False) -> CpuSet | None:
    if text is None and optional:
        return None
    if not isinstance(text, str):
        raise CheckpointError(f"checkpoint {what} must be a cpuset string, not {text!r}")
    try:
        return CpuSet.parse(text)
    except CpuSetParseError as exc:
        raise CheckpointError(f"checkpoint {what}: {exc}") from exc


def _string(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise CheckpointError(f"checkpoint {what} must be a string, not {value!r}")
    return value


def _decode_claim(uid: str, doc: object, keys: frozenset[str]) -> PreparedClaim:
    if not uid:
        raise CheckpointError("checkpoint has a claim with an empty UID")
    if not isinstance(doc, dict) or set(doc) != keys:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise CheckpointError(f"checkpoint claim {uid} must have keys {sorted(keys)}: {got}")
    cpus = _cpuset(doc["cpus"], f"claim {uid} cpus")
    assert cpus is not None  # not optional
    if not cpus:
        raise CheckpointError(f"checkpoint claim {uid} holds no CPU")
    mems = _cpuset(doc["mems"], f"claim {uid} mems", optional=True)
    results_doc = doc["results"]
    if not isinstance(results_doc, list):
        raise CheckpointError(f"checkpoint claim {uid} results must be a list")
    results = tuple(_decode_result(uid, i, r) for i, r in enumerate(results_doc))
    pod_claim_name = doc.get("podClaimName")
    if pod_claim_name is not None:
        pod_claim_name = _string(pod_claim_name, f"claim {uid} podClaimName")
    return PreparedClaim(
        claim_uid=uid,
        cpus=cpus,
        namespace=_string(doc["namespace"], f"claim {uid} namespace"),
        name=_string(doc["name"], f"claim {uid} name"),
        mems=mems,
        results=tuple(sorted(results, key=DeviceResult.sort_key)),
        pod_uids=_pods(uid, "podUids", doc.get("podUids", [])),
        pod_claim_name=pod_claim_name,
        pod_names=_pods(uid, "podNames", doc.get("podNames", [])),
        copiers=_pods(uid, "copierPods", doc.get("copierPods", [])),
        shared_pool=_flag(uid, "sharedPool", doc.get("sharedPool", False)),
    )


def _pods(uid: str, key: str, doc: object) -> frozenset[str]:
    if not isinstance(doc, list) or not all(isinstance(p, str) and p for p in doc):
        raise CheckpointError(
            f"checkpoint claim {uid} {key} must be a list of non-empty strings, not {doc!r}"
        )
    pods = frozenset(doc)
    if len(pods) != len(doc):
        raise CheckpointError(f"checkpoint claim {uid} {key} lists a pod twice: {doc!r}")
    return pods


def _flag(uid: str, key: str, value: object) -> bool:
    if type(value) is not bool:
        raise CheckpointError(f"checkpoint claim {uid} {key} must be true or false, not {value!r}")
    return value


def _decode_result(uid: str, index: int, doc: object) -> DeviceResult:
    what = f"claim {uid} result {index}"
    if not isinstance(doc, dict) or set(doc) != _RESULT_KEYS:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise CheckpointError(f"checkpoint {what} must have keys {sorted(_RESULT_KEYS)}: {got}")
    consumed = doc["consumedCpus"]
    if consumed is not None and (type(consumed) is not int or consumed <= 0):
        raise CheckpointError(
            f"checkpoint {what} consumedCpus must be a positive integer or null, not {consumed!r}"
        )
    return DeviceResult(
        request=_string(doc["request"], f"{what} request"),
        pool=_string(doc["pool"], f"{what} pool"),
        device=_string(doc["device"], f"{what} device"),
        consumed_cpus=consumed,
        cpuset=_cpuset(doc["cpuset"], f"{what} cpuset", optional=True),
    )
