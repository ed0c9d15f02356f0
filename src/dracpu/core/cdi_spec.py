"""CDI specs of dracpu: build, encode, parse and validate them (pure).

One spec file per prepared claim (design §2, upstream ``pkg/driver/cdi.go`` since PR #154)::

    <cdi-dir>/dra.k8s.io-cpu_claim-<claimUID>.json
    {"cdiVersion":"0.5.0","kind":"dra.k8s.io/cpu",
     "devices":[{"name":"claim-<claimUID>","containerEdits":{"env":["DRA_CPUSET_<claimUID>=0-3"]}}]}

The runtime injects the env var into every container that asks for the device
``dra.k8s.io/cpu=claim-<claimUID>``; the NRI side reads it back (:func:`parse_env`) and checks it
against its own prepared claims (fail closed).

:func:`validate_spec` is an independent implementation of the rules the CDI library applies when it
loads a spec (``tags.cncf.io/container-device-interface``: ``specs-go/config.go``, ``version.go``,
``pkg/parser/parser.go``, ``pkg/cdi/spec.go``, ``device.go``, ``container-edits.go``; see
``reference/nri-ttrpc-cdi.md`` §5). Tests use it to check what :func:`build_spec` produces.

:func:`plan_reconcile` decides which spec files to write and remove so that the CDI directory holds
exactly the specs of the prepared claims; ``tasks/cdi_watcher.py`` executes the plan.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
    "ReconcilePlan",
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
    "parse_env",
    "parse_spec",
    "plan_reconcile",
    "spec_bytes",
    "spec_file_name",
    "validate_spec",
]

# --- constants -----------------------------------------------------------------------------------

# The newest cdiVersion every supported runtime accepts: containerd 1.7.0-1.7.11 vendor CDI v0.5.4
# and podman 4.x vendors the same line; both reject anything newer (design §2; reference
# nri-ttrpc-cdi.md §5.7). An env-only spec needs only 0.3.0, so nothing is lost. Upstream writes
# "0.8.0", which containerd < 1.7.27 cannot load.
CDI_VERSION = "0.5.0"
# Vendor and class of upstream's kind (dra-driver-cpu pkg/driver/cdi.go: cdiVendor, cdiClass).
CDI_VENDOR = "dra.k8s.io"
CDI_CLASS = "cpu"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
# Env var prefix: upstream cdiEnvVarPrefix "DRA_CPUSET" joined with "_" and the claim UID.
ENV_PREFIX = "DRA_CPUSET_"
# Device names are "claim-<uid>" (upstream getCDIDeviceName).
DEVICE_PREFIX = "claim-"
# File names follow cdi.GenerateTransientSpecName("dra.k8s.io", "cpu", "claim-<uid>") + ".json"
# (reference anchors-upstream.md §D.3): "<vendor>-<class>_<transient id>".
SPEC_FILE_PREFIX = f"{CDI_VENDOR}-{CDI_CLASS}_{DEVICE_PREFIX}"
SPEC_FILE_SUFFIX = ".json"

# Versions known to the newest CDI library (v1.1.0, specs-go/version.go), oldest first.
KNOWN_CDI_VERSIONS: tuple[str, ...] = (
    "0.1.0",
    "0.2.0",
    "0.3.0",
    "0.4.0",
    "0.5.0",
    "0.6.0",
    "0.7.0",
    "0.8.0",
    "1.0.0",
    "1.1.0",
)
NEWEST_CDI_VERSION = KNOWN_CDI_VERSIONS[-1]
# specs-go/version.go vEarliest: the minimum-required version is never below this one.
_EARLIEST_REQUIRED = "0.3.0"

# Kubernetes object UIDs are RFC 4122 UUIDs in their canonical text form (the API server generates
# them with google/uuid). Anything else could break the file name ("/", "..") or the env var name.
_UUID_RE = re.compile(
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
)
_FILE_RE = re.compile(
    re.escape(SPEC_FILE_PREFIX) + "(" + _UUID_RE.pattern + ")" + re.escape(SPEC_FILE_SUFFIX)
)
# Error messages quote untrusted text; clip it so a megabyte of env cannot flood the log.
_QUOTE_LIMIT = 120

# pkg/cdi/container-edits.go validHookNames.
_HOOK_NAMES = frozenset(
    {
        "prestart",
        "createRuntime",
        "createContainer",
        "startContainer",
        "poststart",
        "poststop",
    }
)
# pkg/cdi/container-edits.go DeviceNode.Validate validTypes.
_DEVICE_NODE_TYPES = frozenset({"", "b", "c", "u", "p"})
_UINT32_MAX = 2**32 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# Known keys of each object (specs-go/config.go, v1.1.0). The loader is strict: any other key is
# an error ("unknown field").
_SPEC_KEYS = frozenset({"cdiVersion", "kind", "annotations", "devices", "containerEdits"})
_DEVICE_KEYS = frozenset({"name", "annotations", "containerEdits"})
_EDITS_KEYS = frozenset(
    {"env", "deviceNodes", "hooks", "mounts", "intelRdt", "additionalGids", "netDevices"}
)
_DEVICE_NODE_KEYS = frozenset(
    {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}
)
_MOUNT_KEYS = frozenset({"hostPath", "containerPath", "options", "type"})
_HOOK_KEYS = frozenset({"hookName", "path", "args", "env", "timeout"})
_INTEL_RDT_KEYS = frozenset(
    {"closID", "l3CacheSchema", "memBwSchema", "schemata", "enableMonitoring"}
)
_NET_DEVICE_KEYS = frozenset({"hostInterfaceName", "name"})


# --- names -------------------------------------------------------------------------------------


def _quote(text: str) -> str:
    if len(text) > _QUOTE_LIMIT:
        return repr(text[:_QUOTE_LIMIT] + "...")
    return repr(text)


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


def build_spec(claim_uid: str, cpus: CpuSet) -> dict[str, Any]:
    """The CDI spec of one claim, as a JSON-ready dict.

    Keys are in the order of the Go structs (``specs-go/config.go``). No spec-level
    ``containerEdits``: it is optional and would be empty (the Go driver emits ``{}`` only because
    ``omitempty`` does not apply to a struct).
    """
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [
            {
                "name": device_name(claim_uid),
                "containerEdits": {"env": [env_entry(claim_uid, cpus)]},
            }
        ],
    }


def encode_spec(spec: Mapping[str, Any]) -> bytes:
    """Deterministic JSON: keys in insertion order, no spaces, ASCII only, one final newline."""
    try:
        text = json.dumps(spec, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CdiError(f"CDI spec cannot be encoded as JSON: {exc}") from exc
    return text.encode("ascii") + b"\n"


def spec_bytes(claim_uid: str, cpus: CpuSet) -> bytes:
    """``encode_spec(build_spec(claim_uid, cpus))``: the exact file content for a claim."""
    return encode_spec(build_spec(claim_uid, cpus))


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
    """Parse one of OUR spec files; return ``(claim_uid, cpus)``.

    Strict, like the CDI loader (unknown fields and duplicate keys are errors), and strict about
    our shape: kind ``dra.k8s.io/cpu``, one device ``claim-<uid>``, one env entry
    ``DRA_CPUSET_<uid>=<cpuset>`` for the same uid, non-empty cpuset. Any cdiVersion the CDI
    library accepts is allowed (so upstream's ``0.8.0`` files parse), and so is an empty spec-level
    ``containerEdits`` (upstream writes ``{}``). Anything else raises :class:`CdiError`.
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
    if set(edits) != {"env"} or len(edits["env"]) != 1:
        raise CdiError(f"CDI device {name}: containerEdits must be exactly one env entry")
    parsed = parse_env(edits["env"])
    if set(parsed) != {uid}:
        raise CdiError(
            f"CDI device {name}: env {_quote(edits['env'][0])} is not {ENV_PREFIX}{uid}=<cpuset>"
        )
    return uid, parsed[uid]


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


# --- validation (the CDI library's rules) ----------------------------------------------------


def _version_key(version: str) -> tuple[int, int, int] | None:
    text = version[1:] if version.startswith("v") else version
    parts = text.split(".")
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2])


# Parsed form of KNOWN_CDI_VERSIONS, for semver comparison.
_VERSION_KEYS: dict[str, tuple[int, int, int]] = {
    v: (int(v.split(".")[0]), int(v.split(".")[1]), int(v.split(".")[2]))
    for v in KNOWN_CDI_VERSIONS
}
_KNOWN_KEY_SET = frozenset(_VERSION_KEYS.values())


def _is_letter(char: str) -> bool:
    return char.isascii() and char.isalpha()


def _drop_nulls(value: object) -> object:
    # Go's encoding/json leaves a field at its zero value for a JSON null: same as absent.
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _vendor_or_class_ok(name: str) -> bool:
    # pkg/parser validateVendorOrClassName: letter first, letter/digit last, [A-Za-z0-9_.-] between.
    if not name or not name.isascii():
        return False
    if not _is_letter(name[0]) or not name[-1].isalnum():
        return False
    return all(c.isalnum() or c in "_-." for c in name[1:-1])


def _device_name_ok(name: str) -> bool:
    # pkg/parser ValidateDeviceName: letter/digit first and last, [A-Za-z0-9_.:-] between.
    if not name or not name.isascii():
        return False
    if not name[0].isalnum() or not name[-1].isalnum():
        return False
    return all(c.isalnum() or c in "_-.:" for c in name[1:-1])


def _is_int(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_keys(obj: Mapping[str, Any], known: frozenset[str], where: str, out: list[str]) -> None:
    for key in obj:
        if key not in known:
            out.append(f"{where}: unknown field {_quote(key)}")


def _check_annotations(value: object, where: str, out: list[str]) -> None:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in value.items()
    ):
        out.append(f"{where}: annotations must map non-empty strings to strings")


def _check_env(value: object, where: str, out: list[str]) -> None:
    if not _is_str_list(value):
        out.append(f"{where}: env must be a list of strings")
        return
    assert isinstance(value, list)
    for entry in value:
        # container-edits.go ValidateEnv: the '=' must be present at an index > 0.
        if entry.find("=") <= 0:
            out.append(f"{where}: invalid environment variable {_quote(entry)}")


def _check_object_list(
    value: object, where: str, out: list[str]
) -> list[tuple[str, dict[str, Any]]]:
    if not isinstance(value, list):
        out.append(f"{where} must be a list")
        return []
    items: list[tuple[str, dict[str, Any]]] = []
    for index, item in enumerate(value):
        if isinstance(item, dict):
            items.append((f"{where}[{index}]", item))
        else:
            out.append(f"{where}[{index}] must be an object")
    return items


def _check_str_fields(
    obj: Mapping[str, Any],
    where: str,
    required: Collection[str],
    optional: Collection[str],
    out: list[str],
) -> None:
    for key in required:
        value = obj.get(key)
        if not isinstance(value, str) or not value:
            out.append(f"{where}: {key} is required (non-empty string)")
    for key in optional:
        if key in obj and not isinstance(obj[key], str):
            out.append(f"{where}: {key} must be a string")


def _check_edits(edits: object, where: str, out: list[str]) -> bool:
    """Validate a ContainerEdits object; return True when it is empty."""
    if not isinstance(edits, dict):
        out.append(f"{where} must be an object")
        return False
    _check_keys(edits, _EDITS_KEYS, where, out)
    if "env" in edits:
        _check_env(edits["env"], where, out)
    for node_where, node in _check_object_list(
        edits.get("deviceNodes", []), f"{where}.deviceNodes", out
    ):
        _check_keys(node, _DEVICE_NODE_KEYS, node_where, out)
        _check_str_fields(node, node_where, ("path",), ("hostPath", "type", "permissions"), out)
        if node.get("type", "") not in _DEVICE_NODE_TYPES:
            out.append(f"{node_where}: invalid type {node.get('type')!r}")
        for key in ("major", "minor"):
            # Negative numbers are rejected: -1 would be a wildcard (DeviceNode.Validate).
            if key in node and not _is_int(node[key], 0, _INT64_MAX):
                out.append(f"{node_where}: {key} must be a non-negative integer")
        for key in ("fileMode", "uid", "gid"):
            if key in node and not _is_int(node[key], 0, _UINT32_MAX):
                out.append(f"{node_where}: {key} must be an unsigned 32-bit integer")
        permissions = node.get("permissions", "")
        if (
            isinstance(permissions, str)
            and permissions not in ("", "none")
            and (permissions.strip("rwm"))
        ):
            out.append(f"{node_where}: invalid permissions {_quote(permissions)}")
    for mount_where, mount in _check_object_list(edits.get("mounts", []), f"{where}.mounts", out):
        _check_keys(mount, _MOUNT_KEYS, mount_where, out)
        _check_str_fields(mount, mount_where, ("hostPath", "containerPath"), ("type",), out)
        if "options" in mount and not _is_str_list(mount["options"]):
            out.append(f"{mount_where}: options must be a list of strings")
    for hook_where, hook in _check_object_list(edits.get("hooks", []), f"{where}.hooks", out):
        _check_keys(hook, _HOOK_KEYS, hook_where, out)
        if hook.get("hookName") not in _HOOK_NAMES:
            out.append(f"{hook_where}: invalid hook name {hook.get('hookName')!r}")
        _check_str_fields(hook, hook_where, ("path",), (), out)
        if "args" in hook and not _is_str_list(hook["args"]):
            out.append(f"{hook_where}: args must be a list of strings")
        if "env" in hook:
            _check_env(hook["env"], hook_where, out)
        if "timeout" in hook and not _is_int(hook["timeout"], _INT64_MIN, _INT64_MAX):
            out.append(f"{hook_where}: timeout must be an integer")
    if "intelRdt" in edits:
        rdt = edits["intelRdt"]
        rdt_where = f"{where}.intelRdt"
        if not isinstance(rdt, dict):
            out.append(f"{rdt_where} must be an object")
        else:
            _check_keys(rdt, _INTEL_RDT_KEYS, rdt_where, out)
            _check_str_fields(rdt, rdt_where, (), ("closID", "l3CacheSchema", "memBwSchema"), out)
            clos = rdt.get("closID", "")
            if (
                isinstance(clos, str)
                and clos != "/"
                and (len(clos) >= 4096 or clos in (".", "..") or "/" in clos or "\n" in clos)
            ):
                out.append(f"{rdt_where}: invalid closID {_quote(clos)}")
            if "schemata" in rdt and not _is_str_list(rdt["schemata"]):
                out.append(f"{rdt_where}: schemata must be a list of strings")
            if "enableMonitoring" in rdt and not isinstance(rdt["enableMonitoring"], bool):
                out.append(f"{rdt_where}: enableMonitoring must be a boolean")
    gids = edits.get("additionalGids", [])
    if not isinstance(gids, list) or not all(_is_int(g, 0, _UINT32_MAX) for g in gids):
        out.append(f"{where}: additionalGids must be a list of unsigned 32-bit integers")
    hosts: set[str] = set()
    names: set[str] = set()
    for net_where, net in _check_object_list(
        edits.get("netDevices", []), f"{where}.netDevices", out
    ):
        _check_keys(net, _NET_DEVICE_KEYS, net_where, out)
        _check_str_fields(net, net_where, ("hostInterfaceName", "name"), (), out)
        host, name = net.get("hostInterfaceName"), net.get("name")
        if isinstance(host, str) and host in hosts:
            out.append(f"{net_where}: duplicate hostInterfaceName {_quote(host)}")
        if isinstance(name, str) and name in names:
            out.append(f"{net_where}: duplicate name {_quote(name)}")
        if isinstance(host, str):
            hosts.add(host)
        if isinstance(name, str):
            names.add(name)
    # container-edits.go isEmpty: nothing to apply (an absent intelRdt counts as empty).
    return (
        not any(
            edits.get(key)
            for key in ("env", "deviceNodes", "hooks", "mounts", "additionalGids", "netDevices")
        )
        and "intelRdt" not in edits
    )


def _edits_of(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    edits: list[Mapping[str, Any]] = []
    if isinstance(spec.get("containerEdits"), dict):
        edits.append(spec["containerEdits"])
    for device in spec.get("devices") or ():
        if isinstance(device, dict) and isinstance(device.get("containerEdits"), dict):
            edits.append(device["containerEdits"])
    return edits


def minimum_required_version(spec: Mapping[str, Any]) -> str:
    """The oldest cdiVersion that can express ``spec`` (``specs-go/version.go``).

    Expects a spec whose shape is already valid (see :func:`validate_spec`).
    """
    edits = _edits_of(spec)
    devices = [d for d in spec.get("devices") or () if isinstance(d, dict)]
    rdts = [e["intelRdt"] for e in edits if isinstance(e.get("intelRdt"), dict)]
    if any(e.get("netDevices") for e in edits) or any(
        "schemata" in r or "enableMonitoring" in r for r in rdts
    ):
        return "1.1.0"
    if any(e.get("intelRdt") is not None for e in edits) or any(
        e.get("additionalGids") for e in edits
    ):
        return "0.7.0"
    kind = spec.get("kind")
    _, _, klass = kind.partition("/") if isinstance(kind, str) else ("", "", "")
    if spec.get("annotations") or any(d.get("annotations") for d in devices) or "." in klass:
        return "0.6.0"
    # requiresV050: a device name whose first character is not a letter.
    starts_with_digit = any(
        isinstance(d.get("name"), str) and d["name"][:1] and not _is_letter(d["name"][0])
        for d in devices
    )
    host_paths = any(
        isinstance(n, dict) and n.get("hostPath")
        for e in edits
        for n in (e.get("deviceNodes") or ())
    )
    if starts_with_digit or host_paths:
        return "0.5.0"
    mounts_typed = any(
        isinstance(m, dict) and m.get("type") for e in edits for m in (e.get("mounts") or ())
    )
    if mounts_typed:
        return "0.4.0"
    return _EARLIEST_REQUIRED


def validate_spec(obj: object, *, newest_known: str = NEWEST_CDI_VERSION) -> list[str]:
    """The problems the CDI library would report when loading ``obj``; empty means valid.

    ``newest_known`` is the newest cdiVersion of the consumer's CDI library (``"0.5.0"`` for
    containerd 1.7.0-1.7.11 and podman 4.x, reference §5.7); newer versions are unknown to it.
    A JSON ``null`` counts as an absent field, as in Go. Field names must match exactly (Go's
    decoder would also accept other letter cases: this check is stricter).
    """
    out: list[str] = []
    obj = _drop_nulls(obj)
    if not isinstance(obj, dict):
        return ["a CDI spec must be a JSON object"]
    _check_keys(obj, _SPEC_KEYS, "spec", out)

    version = obj.get("cdiVersion")
    version_key = _version_key(version) if isinstance(version, str) else None
    newest_key = _version_key(newest_known)
    if newest_key is None:
        raise ValueError(f"newest_known {newest_known!r} is not a version")
    if version_key is None or version_key not in _KNOWN_KEY_SET or version_key > newest_key:
        out.append(f"invalid version {version!r}")

    kind = obj.get("kind")
    if not isinstance(kind, str):
        out.append("kind is required (a string vendor/class)")
    else:
        vendor, slash, klass = kind.partition("/")
        if not slash or not vendor or not klass:
            out.append(f"invalid kind {_quote(kind)}: expected vendor/class")
        else:
            if not _vendor_or_class_ok(vendor):
                out.append(f"invalid vendor {_quote(vendor)} in kind")
            if not _vendor_or_class_ok(klass):
                out.append(f"invalid class {_quote(klass)} in kind")

    if "annotations" in obj:
        _check_annotations(obj["annotations"], "spec", out)
    if "containerEdits" in obj:
        _check_edits(obj["containerEdits"], "spec.containerEdits", out)

    devices = obj.get("devices")
    if not isinstance(devices, list):
        out.append("devices is required (a list)")
    elif not devices:
        out.append("invalid spec, no devices")
    else:
        seen: set[str] = set()
        for index, device in enumerate(devices):
            where = f"devices[{index}]"
            if not isinstance(device, dict):
                out.append(f"{where} must be an object")
                continue
            _check_keys(device, _DEVICE_KEYS, where, out)
            name = device.get("name")
            if not isinstance(name, str) or not _device_name_ok(name):
                out.append(f"{where}: invalid device name {name!r}")
            elif name in seen:
                out.append(f"invalid spec, multiple device {_quote(name)}")
            else:
                seen.add(name)
            if "annotations" in device:
                _check_annotations(device["annotations"], where, out)
            edits = device.get("containerEdits", {})
            if _check_edits(edits, f"{where}.containerEdits", out):
                out.append(f"{where}: invalid device, empty device edits")

    if not out and version_key is not None:
        required = minimum_required_version(obj)
        if version_key < _VERSION_KEYS[required]:
            out.append(f"the spec version must be at least v{required}")
    return out


# --- reconcile planning --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReconcilePlan:
    """What to do so that the CDI dir holds exactly the specs of the prepared claims.

    ``create``: claims whose spec file is missing; ``repair``: claims whose spec file differs from
    what we would write (edited, malformed, unreadable); ``remove``: claim UIDs of our spec files
    that no prepared claim owns; ``invalid``: prepared claims no spec can be written for (bad UID,
    empty cpuset), with the reason. Each tuple is sorted by claim UID.
    """

    create: tuple[tuple[str, CpuSet], ...] = ()
    repair: tuple[tuple[str, CpuSet], ...] = ()
    remove: tuple[str, ...] = ()
    invalid: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.create or self.repair or self.remove)


def plan_reconcile(
    existing: Mapping[str, bytes | None],
    desired: Mapping[str, CpuSet],
    *,
    only: Collection[str] | None = None,
) -> ReconcilePlan:
    """Compare our spec files with the prepared claims.

    ``existing`` maps the claim UID of each of our spec files to its content, or ``None`` when it
    could not be read. ``desired`` maps each prepared claim to its cpuset. ``only`` restricts the
    plan to those claim UIDs (a watcher event names a few files). A spec is correct only when its
    bytes are exactly :func:`spec_bytes`.
    """
    create: list[tuple[str, CpuSet]] = []
    repair: list[tuple[str, CpuSet]] = []
    invalid: list[tuple[str, str]] = []
    wanted = set(desired) if only is None else set(desired) & set(only)
    for uid in sorted(wanted):
        cpus = desired[uid]
        try:
            content = spec_bytes(uid, cpus)
        except CdiError as exc:
            invalid.append((uid, str(exc)))
            continue
        if uid not in existing:
            create.append((uid, cpus))
        elif existing[uid] != content:
            repair.append((uid, cpus))
    candidates = set(existing) if only is None else set(existing) & set(only)
    remove = sorted(uid for uid in candidates if uid not in desired)
    return ReconcilePlan(tuple(create), tuple(repair), tuple(remove), tuple(invalid))
