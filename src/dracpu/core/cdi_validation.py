"""The rules the CDI library applies when it loads a spec, written independently (pure).

:func:`validate_spec` is an independent implementation of the checks of
``tags.cncf.io/container-device-interface`` (``specs-go/config.go``, ``version.go``,
``pkg/parser/parser.go``, ``pkg/cdi/spec.go``, ``device.go``, ``container-edits.go``);
:func:`minimum_required_version` is its ``specs-go/version.go``.
:func:`dracpu.core.cdi_spec.parse_spec` runs it on every spec file it reads, and tests use it to
check what :func:`dracpu.core.cdi_spec.build_spec` produces.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

__all__ = [
    "KNOWN_CDI_VERSIONS",
    "NEWEST_CDI_VERSION",
    "minimum_required_version",
    "quote",
    "validate_spec",
]

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


def quote(text: str) -> str:
    """``repr`` of untrusted text for an error message, clipped to a readable length."""
    if len(text) > _QUOTE_LIMIT:
        return repr(text[:_QUOTE_LIMIT] + "...")
    return repr(text)


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
            out.append(f"{where}: unknown field {quote(key)}")


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
            out.append(f"{where}: invalid environment variable {quote(entry)}")


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
            out.append(f"{node_where}: invalid permissions {quote(permissions)}")
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
                out.append(f"{rdt_where}: invalid closID {quote(clos)}")
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
            out.append(f"{net_where}: duplicate hostInterfaceName {quote(host)}")
        if isinstance(name, str) and name in names:
            out.append(f"{net_where}: duplicate name {quote(name)}")
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
    containerd 1.7.0-1.7.11 and podman 4.x, which vendor CDI v0.5.4); newer versions are unknown
    to it.
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
            out.append(f"invalid kind {quote(kind)}: expected vendor/class")
        else:
            if not _vendor_or_class_ok(vendor):
                out.append(f"invalid vendor {quote(vendor)} in kind")
            if not _vendor_or_class_ok(klass):
                out.append(f"invalid class {quote(klass)} in kind")

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
                out.append(f"invalid spec, multiple device {quote(name)}")
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
