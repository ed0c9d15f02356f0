"""CDI specs of dracpu: build, encode and parse them (pure).

One spec file per prepared claim (upstream ``pkg/driver/cdi.go`` since PR #154; the contract is in
``docs/devices.md``, "What Prepare writes")::

    <cdi-dir>/dra.k8s.io-cpu_claim-<claimUID>.json
    {"cdiVersion":"0.5.0","kind":"dra.k8s.io/cpu",
     "devices":[{"name":"claim-<claimUID>","containerEdits":{"env":["DRA_CPUSET_<claimUID>=0-3"]}}]}

The runtime injects the env var into every container that asks for the device
``dra.k8s.io/cpu=claim-<claimUID>``; the NRI side reads it back (:func:`parse_env`) and checks it
against its own prepared claims (fail closed).

A claim whose containers also run on the shared pool (its opaque config's
``cpuConfig.sharedPool``, ours) has a second env entry after the first,
``DRA_SHARED_POOL_<claimUID>=true`` (:data:`SHARED_POOL_PREFIX`): the claim's own CPUs stay in
``DRA_CPUSET_<claimUID>``, and the shared ones are the rest of the container's CPUs, which move as
claims come and go while an env is fixed when the container is created, so the entry names no
CPU (``docs/claim-config.md``). Its name does not start with ``DRA_CPUSET_``: every reader of
that prefix (ours, :func:`parse_env`; upstream's NRI plugin) takes the rest of the name for a
claim UID.

:func:`validate_spec` (from :mod:`dracpu.core.cdi_validation`, re-exported here with the other
names of that module) is an independent implementation of the rules the CDI library applies when
it loads a spec. Tests use it to check what :func:`build_spec` produces.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dracpu.core.cdi_validation import (
    KNOWN_CDI_VERSIONS,
    NEWEST_CDI_VERSION,
    minimum_required_version,
    validate_spec,
)
from dracpu.core.cdi_validation import quote as _quote
from dracpu.core.cpuset import CpuSet
from dracpu.errors import CdiError, CpuSetParseError

__all__ = [
    "CDI_CLASS",
    "CDI_KIND",
    "CDI_VENDOR",
    "CDI_VERSION",
    "DEVICE_PREFIX",
    "ENV_PREFIX",
    "KNOWN_CDI_VERSIONS",
    "NEWEST_CDI_VERSION",
    "SPEC_FILE_PREFIX",
    "SPEC_FILE_SUFFIX",
    "SHARED_POOL_PREFIX",
    "SHARED_POOL_VALUE",
    "ClaimSpec",
    "build_spec",
    "check_claim_uid",
    "claim_uid_from_file_name",
    "device_id",
    "device_name",
    "encode_spec",
    "env_entry",
    "is_our_spec_file",
    "is_valid_claim_uid",
    "minimum_required_version",
    "parse_claim_spec",
    "parse_env",
    "parse_spec",
    "shared_pool_entry",
    "spec_bytes",
    "spec_file_name",
    "validate_spec",
]

# --- constants -----------------------------------------------------------------------------------

# The newest cdiVersion every supported runtime accepts: containerd 1.7.0-1.7.11 vendor CDI v0.5.4
# and podman 4.x vendors the same line; both reject anything newer (their vendored CDI library's
# specs-go/version.go). An env-only spec needs only 0.3.0, so nothing is lost. Upstream writes
# "0.8.0", which containerd < 1.7.27 cannot load.
CDI_VERSION = "0.5.0"
# Vendor and class of upstream's kind (dra-driver-cpu pkg/driver/cdi.go: cdiVendor, cdiClass).
CDI_VENDOR = "dra.k8s.io"
CDI_CLASS = "cpu"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
# Env var prefix: upstream cdiEnvVarPrefix "DRA_CPUSET" joined with "_" and the claim UID.
ENV_PREFIX = "DRA_CPUSET_"
# Ours: the env entry of a claim whose containers also run on the shared pool, and its value.
SHARED_POOL_PREFIX = "DRA_SHARED_POOL_"
SHARED_POOL_VALUE = "true"
# Device names are "claim-<uid>" (upstream getCDIDeviceName).
DEVICE_PREFIX = "claim-"
# File names follow cdi.GenerateTransientSpecName("dra.k8s.io", "cpu", "claim-<uid>") + ".json"
# (upstream pkg/driver/cdi.go; container-device-interface pkg/cdi/spec.go):
# "<vendor>-<class>_<transient id>".
SPEC_FILE_PREFIX = f"{CDI_VENDOR}-{CDI_CLASS}_{DEVICE_PREFIX}"
SPEC_FILE_SUFFIX = ".json"

# Kubernetes object UIDs are RFC 4122 UUIDs in their canonical text form (the API server generates
# them with google/uuid). Anything else could break the file name ("/", "..") or the env var name.
_UUID_RE = re.compile(
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
)
_FILE_RE = re.compile(
    re.escape(SPEC_FILE_PREFIX) + "(" + _UUID_RE.pattern + ")" + re.escape(SPEC_FILE_SUFFIX)
)

# --- what a spec says --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClaimSpec:
    """What one claim's CDI spec says: the claim's CPUs (``DRA_CPUSET_<uid>``) and whether its
    containers also run on the shared pool (``DRA_SHARED_POOL_<uid>=true``)."""

    cpus: CpuSet
    shared_pool: bool = False


# --- names -------------------------------------------------------------------------------------


def is_valid_claim_uid(uid: object) -> bool:
    """True for a canonical RFC 4122 UUID string (what the API server puts in ``metadata.uid``)."""
    return isinstance(uid, str) and _UUID_RE.fullmatch(uid) is not None


def check_claim_uid(uid: object) -> str:
    """Return ``uid`` or raise :class:`CdiError`: it goes into a file name and an env var name."""
    if not is_valid_claim_uid(uid):
        shown = _quote(uid) if isinstance(uid, str) else repr(type(uid).__name__)
        raise CdiError(f"invalid claim UID {shown}: expected an RFC 4122 UUID")
    assert isinstance(uid, str)
    return uid


def device_name(claim_uid: str) -> str:
    """The CDI device name of a claim: ``claim-<uid>``."""
    return DEVICE_PREFIX + check_claim_uid(claim_uid)


def device_id(claim_uid: str) -> str:
    """The qualified CDI device id given to the runtime: ``dra.k8s.io/cpu=claim-<uid>``."""
    return f"{CDI_KIND}={device_name(claim_uid)}"


def spec_file_name(claim_uid: str) -> str:
    """The spec file name (no directory): ``dra.k8s.io-cpu_claim-<uid>.json``."""
    return SPEC_FILE_PREFIX + check_claim_uid(claim_uid) + SPEC_FILE_SUFFIX


def claim_uid_from_file_name(name: str) -> str | None:
    """The claim UID of one of our spec file names, else ``None`` (other vendors, temp files)."""
    match = _FILE_RE.fullmatch(name)
    return match.group(1) if match else None


def is_our_spec_file(name: str) -> bool:
    """True when ``name`` (a base name) is exactly one of our spec file names."""
    return claim_uid_from_file_name(name) is not None


def env_entry(claim_uid: str, cpus: CpuSet) -> str:
    """``DRA_CPUSET_<uid>=<cpuset>`` (Linux list format); the cpuset must not be empty."""
    uid = check_claim_uid(claim_uid)
    if not cpus:
        raise CdiError(f"claim {uid}: refusing to write an empty cpuset into a CDI spec")
    return f"{ENV_PREFIX}{uid}={cpus.format()}"


# --- build and encode --------------------------------------------------------------------------


def shared_pool_entry(claim_uid: str) -> str:
    """``DRA_SHARED_POOL_<uid>=true``: the claim's containers also run on the shared pool."""
    return f"{SHARED_POOL_PREFIX}{check_claim_uid(claim_uid)}={SHARED_POOL_VALUE}"


def build_spec(claim_uid: str, cpus: CpuSet, shared_pool: bool = False) -> dict[str, Any]:
    """The CDI spec of one claim, as a JSON-ready dict (``shared_pool``: with the second env
    entry, after the claim's CPUs).

    Keys are in the order of the Go structs (``specs-go/config.go``). No spec-level
    ``containerEdits``: it is optional and would be empty (the Go driver emits ``{}`` only because
    ``omitempty`` does not apply to a struct).
    """
    env = [env_entry(claim_uid, cpus)]
    if shared_pool:
        env.append(shared_pool_entry(claim_uid))
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [{"name": device_name(claim_uid), "containerEdits": {"env": env}}],
    }


def encode_spec(spec: Mapping[str, Any]) -> bytes:
    """Deterministic JSON: keys in insertion order, no spaces, ASCII only, one final newline."""
    try:
        text = json.dumps(spec, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CdiError(f"CDI spec cannot be encoded as JSON: {exc}") from exc
    return text.encode("ascii") + b"\n"


def spec_bytes(claim_uid: str, cpus: CpuSet, shared_pool: bool = False) -> bytes:
    """``encode_spec(build_spec(...))``: the exact file content for a claim."""
    return encode_spec(build_spec(claim_uid, cpus, shared_pool))


# --- parse ---------------------------------------------------------------------------------------


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            # sigs.k8s.io/yaml UnmarshalStrict rejects duplicate keys too.
            raise CdiError(f"duplicate key {_quote(key)}")
        result[key] = value
    return result


def _reject_constant(name: str) -> object:
    # Python's json accepts NaN / Infinity; JSON (and Go) do not.
    raise CdiError(f"{name} is not a JSON value")


def _strict_cpuset(text: str, what: str) -> CpuSet:
    if not text or text != text.strip():
        raise CdiError(f"{what}: cpuset {_quote(text)} is empty or has surrounding whitespace")
    try:
        cpus = CpuSet.parse(text)
    except CpuSetParseError as exc:
        raise CdiError(f"{what}: {exc}") from exc
    return cpus


def parse_spec(data: bytes) -> tuple[str, CpuSet]:
    """``(claim_uid, cpus)`` of one of OUR spec files (:func:`parse_claim_spec`)."""
    uid, spec = parse_claim_spec(data)
    return uid, spec.cpus


def parse_claim_spec(data: bytes) -> tuple[str, ClaimSpec]:
    """Parse one of OUR spec files; return ``(claim_uid, what it says)``.

    Strict, like the CDI loader (unknown fields and duplicate keys are errors), and strict about
    our shape: kind ``dra.k8s.io/cpu``, one device ``claim-<uid>``, the env entry
    ``DRA_CPUSET_<uid>=<cpuset>`` for the same uid, non-empty cpuset, then
    ``DRA_SHARED_POOL_<uid>=true`` or nothing. Any cdiVersion the CDI library accepts is allowed
    (so upstream's ``0.8.0`` files parse), and so is an empty spec-level ``containerEdits``
    (upstream writes ``{}``). Anything else raises :class:`CdiError`.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CdiError(f"CDI spec is not UTF-8: {exc}") from exc
    try:
        obj = json.loads(
            text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant
        )
    except CdiError as exc:
        raise CdiError(f"CDI spec is not valid JSON: {exc}") from exc
    except ValueError as exc:  # json.JSONDecodeError, or a number too large
        raise CdiError(f"CDI spec is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # json.loads of deeply nested arrays/objects
        raise CdiError("CDI spec is not valid JSON: nested too deeply") from exc
    try:
        problems = validate_spec(obj)
    except RecursionError as exc:  # the validation walk of a parseable but deep document
        raise CdiError("CDI spec is nested too deeply") from exc
    if problems:
        raise CdiError("invalid CDI spec: " + "; ".join(problems))
    assert isinstance(obj, dict)
    if obj["kind"] != CDI_KIND:
        raise CdiError(f"CDI spec of kind {_quote(obj['kind'])} is not ours ({CDI_KIND})")
    extra = set(obj) - {"cdiVersion", "kind", "devices", "containerEdits"}
    if extra:
        raise CdiError(f"CDI spec has fields dracpu never writes: {sorted(extra)}")
    if obj.get("containerEdits", {}) != {}:
        raise CdiError("CDI spec has spec-level containerEdits, which dracpu never writes")
    devices = obj["devices"]
    if len(devices) != 1:
        raise CdiError(f"CDI spec has {len(devices)} devices, dracpu writes exactly one")
    device = devices[0]
    if set(device) != {"name", "containerEdits"}:
        raise CdiError(f"CDI device has fields dracpu never writes: {sorted(device)}")
    name: str = device["name"]
    uid = name[len(DEVICE_PREFIX) :] if name.startswith(DEVICE_PREFIX) else ""
    if not is_valid_claim_uid(uid):
        raise CdiError(f"CDI device name {_quote(name)} is not claim-<claim UID>")
    edits = device["containerEdits"]
    env = edits.get("env")
    if set(edits) != {"env"} or len(env) not in (1, 2):
        raise CdiError(
            f"CDI device {name}: containerEdits must be the env entry {ENV_PREFIX}{uid}, "
            f"maybe followed by {SHARED_POOL_PREFIX}{uid}"
        )
    parsed = parse_env(env[:1])
    if set(parsed) != {uid}:
        raise CdiError(f"CDI device {name}: env {_quote(env[0])} is not {ENV_PREFIX}{uid}=<cpuset>")
    shared = len(env) == 2
    if shared and env[1] != shared_pool_entry(uid):
        raise CdiError(
            f"CDI device {name}: env {_quote(env[1])} is not "
            f"{SHARED_POOL_PREFIX}{uid}={SHARED_POOL_VALUE}"
        )
    return uid, ClaimSpec(parsed[uid], shared)


def parse_env(env: Sequence[str]) -> dict[str, CpuSet]:
    """The claims in a container's env: ``{claim_uid: cpus}`` from ``DRA_CPUSET_<uid>=<cpus>``.

    Entries not starting with ``DRA_CPUSET_`` are ignored. A ``DRA_CPUSET_`` entry that is
    malformed (no ``=``, a name that is not a claim UID, an empty or bad cpuset, whitespace) or
    that names the same claim twice with different cpusets raises :class:`CdiError` naming it:
    the caller must fail closed.
    """
    claims: dict[str, CpuSet] = {}
    for entry in env:
        if not isinstance(entry, str):
            raise CdiError(f"env entry {entry!r} is not a string")
        if not entry.startswith(ENV_PREFIX):
            continue
        key, sep, value = entry.partition("=")
        if not sep:
            raise CdiError(f"malformed env entry {_quote(entry)}: no '='")
        uid = key[len(ENV_PREFIX) :]
        if not is_valid_claim_uid(uid):
            raise CdiError(f"malformed env entry {_quote(entry)}: {_quote(uid)} is not a claim UID")
        cpus = _strict_cpuset(value, f"malformed env entry {_quote(entry)}")
        if not cpus:
            raise CdiError(f"malformed env entry {_quote(entry)}: empty cpuset")
        previous = claims.get(uid)
        if previous is not None and previous != cpus:
            raise CdiError(
                f"env names claim {uid} twice with different cpusets: {previous} and {cpus}"
            )
        claims[uid] = cpus
    return claims
