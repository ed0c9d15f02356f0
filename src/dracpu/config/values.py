"""The settings' value converters: a raw flag, environment or config-file value to the typed
value, or :class:`BadValue` with the reason (the caller adds where the value came from).

A flag and the environment give strings; a YAML file gives strings, numbers, booleans or
``None``; each converter takes what its setting may be given in either place.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Literal, TypeVar

from dracpu.core.claim_config import ALLOCATOR_CPUMANAGER, ALLOCATOR_EXTERNAL
from dracpu.core.cpuset import CpuSet
from dracpu.core.host_cgroups import check_cgroup_paths
from dracpu.errors import DracpuError

__all__ = [
    "ALLOCATOR_CPUMANAGER",
    "ALLOCATOR_EXTERNAL",
    "LOG_FORMATS",
    "MIN_PODRESOURCES_INTERVAL",
    "BadValue",
    "BindAddress",
    "LogFormat",
    "absolute_path",
    "allocator",
    "bind_address",
    "boolean",
    "choice",
    "cpuset",
    "duration",
    "go_bool",
    "go_duration",
    "host_cgroups",
    "log_format",
    "node_name",
    "nri_plugin_index",
    "nri_plugin_name",
    "optional_path",
    "parse_duration",
    "podresources_interval",
    "show",
    "string",
    "verbosity",
    "vmodule",
    "yaml_type",
]

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")

# The kubelet's PodResources server allows 100 requests per second to all its clients together
# (pkg/kubelet/apis/podresources/grpc/ratelimit.go DefaultQPS): we take at most a tenth.
MIN_PODRESOURCES_INTERVAL = 0.1


# Kubernetes object names (node names, and with them pool names) are RFC 1123 DNS subdomains.
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS_SUBDOMAIN_MAX = 253
# An NRI plugin name becomes part of "<index>-<name>" and of log lines; keep it a plain token.
_NRI_PLUGIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# NRI orders plugins by a two-digit index (containerd/nri pkg/stub: "00".."99").
_NRI_PLUGIN_INDEX = re.compile(r"[0-9]{2}")
_HOSTNAME = re.compile(
    r"[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*"
)
# Go's strconv.ParseBool, which upstream's boolean flags use.
_GO_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_GO_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})
# klog's -vmodule value (k8s.io/klog/v2 moduleSpec.Set): comma-separated ``pattern=N``, the
# pattern a glob over source file names without ".go".
_VMODULE_ITEM = re.compile(r"([^=,]+)=([0-9]+)")
# Go's time.ParseDuration units, in seconds (src/time/format.go unitMap; "us" has two more
# spellings with the micro sign and the Greek mu).
_DURATION_UNITS: Mapping[str, float] = MappingProxyType(
    {
        "ns": 1e-9,
        "us": 1e-6,
        "\u00b5s": 1e-6,
        "\u03bcs": 1e-6,
        "ms": 1e-3,
        "s": 1.0,
        "m": 60.0,
        "h": 3600.0,
    }
)
_DURATION_PART = re.compile(r"([0-9]*(?:\.[0-9]*)?)([^0-9.]+)")
_PLAIN_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")


_E = TypeVar("_E", bound=StrEnum)
_T = TypeVar("_T")


class BadValue(ValueError):
    """A value that cannot be used; the message is the reason, without the source."""


@dataclass(frozen=True, slots=True)
class BindAddress:
    """Where ``/healthz``, ``/readyz`` and ``/metrics`` listen."""

    host: str
    """An IP address or host name; ``""`` listens on every interface (Go's ``:8080``)."""
    port: int
    """TCP port, 0..65535 (0 picks a free port)."""

    @classmethod
    def parse(cls, text: str) -> BindAddress:
        """Parse ``:8080``, ``127.0.0.1:9000``, ``[::1]:8080`` or ``localhost:8080``.

        Raises :class:`ValueError` with the reason.
        """
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError('missing ":<port>"')
        if not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
            raise ValueError(f"port {port_text!r} is not a number 0..65535")
        if host.startswith("[") and host.endswith("]"):
            try:
                ipaddress.IPv6Address(host[1:-1])
            except ValueError:
                raise ValueError(f"{host} is not an IPv6 address") from None
            host = host[1:-1]
        elif ":" in host:
            raise ValueError("an IPv6 address must be in brackets, e.g. [::1]:8080")
        elif host and not _HOSTNAME.fullmatch(host):
            raise ValueError(f"{host!r} is neither an IP address nor a host name")
        return cls(host, int(port_text))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def show(value: object) -> str:
    """A value as it appears in an error line: JSON style, so strings get double quotes."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def yaml_type(raw: object) -> str:
    """What kind of YAML value ``raw`` is, in words."""
    names = {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }
    return names.get(type(raw), type(raw).__name__)


def string(raw: object) -> str:
    """``raw`` if it is a string."""
    if not isinstance(raw, str):
        raise BadValue(f"must be a string, not {yaml_type(raw)}")
    return raw


def choice(enum: type[_E]) -> Callable[[object], _E]:
    """The converter to a member of ``enum`` by its value."""

    def convert(raw: object) -> _E:
        text = string(raw)
        try:
            return enum(text)
        except ValueError:
            allowed = ", ".join(show(member.value) for member in enum)
            raise BadValue(f"must be one of {allowed}") from None

    return convert


def log_format(raw: object) -> LogFormat:
    text = string(raw)
    for fmt in LOG_FORMATS:
        if text == fmt:
            return fmt
    raise BadValue('must be "text" or "json"')


def _parsed(parse: Callable[[str], _T], raw: object, errors: type[Exception]) -> _T:
    """``parse`` of the string ``raw``; its ``errors`` become :class:`BadValue`."""
    try:
        return parse(string(raw))
    except errors as exc:
        raise BadValue(str(exc)) from exc


def cpuset(raw: object) -> CpuSet:
    """A CPU list in the kernel's syntax (``0-3,8``)."""
    return _parsed(CpuSet.parse, raw, DracpuError)


def absolute_path(raw: object) -> Path:
    text = string(raw)
    if not text:
        raise BadValue("must not be empty")
    if not os.path.isabs(text):
        raise BadValue("must be an absolute path")
    return Path(os.path.normpath(text))


def optional_path(raw: object) -> Path | None:
    """A client-side file (kubeconfig): relative is resolved against the working directory;
    empty is none (as an empty Go string upstream)."""
    text = string(raw)
    if not text:
        return None
    if os.pathsep in text:
        raise BadValue(f"lists several files ({os.pathsep!r}-separated); give exactly one")
    return Path(os.path.abspath(text))


def node_name(raw: object) -> str | None:
    """A Kubernetes node name; empty is none."""
    text = string(raw)
    if not text:
        return None
    if len(text) > _DNS_SUBDOMAIN_MAX or not _DNS_SUBDOMAIN.fullmatch(text):
        raise BadValue(
            "is not a valid node name (lowercase RFC 1123 subdomain: a-z, 0-9, '-' and '.')"
        )
    return text


def bind_address(raw: object) -> BindAddress:
    return _parsed(BindAddress.parse, raw, ValueError)


def verbosity(raw: object) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise BadValue("must be a number >= 0")
    return raw


def boolean(raw: object) -> bool:
    if not isinstance(raw, bool):
        raise BadValue(f"must be true or false, not {yaml_type(raw)}")
    return raw


def go_bool(text: str) -> bool:
    """A boolean as Go's ``strconv.ParseBool`` reads it (upstream's boolean flags)."""
    if text in _GO_TRUE:
        return True
    if text in _GO_FALSE:
        return False
    raise ValueError(f"invalid boolean {text!r} (use true or false)")


def nri_plugin_name(raw: object) -> str:
    text = string(raw)
    if not _NRI_PLUGIN_NAME.fullmatch(text):
        raise BadValue("must be letters, digits, '.', '_' or '-', starting with a letter or digit")
    return text


def nri_plugin_index(raw: object) -> str:
    # YAML reads an unquoted 00 / 07 as the number 0 / 7, so a number 0..99 is accepted too.
    reason = 'must be two digits, "00" to "99"'
    if isinstance(raw, int) and not isinstance(raw, bool):
        if 0 <= raw <= 99:
            return f"{raw:02d}"
        raise BadValue(reason)
    text = string(raw)
    if not _NRI_PLUGIN_INDEX.fullmatch(text):
        raise BadValue(reason)
    return text


def parse_duration(text: str) -> float:
    """Seconds of a duration as Kubernetes' Go flags take it (``time.ParseDuration``:
    ``500ms``, ``1.5h``, ``1h30m``, ``0``), or of a plain number (seconds). Negative durations
    are refused. Raises :class:`ValueError` with the reason."""
    if _PLAIN_SECONDS.fullmatch(text):
        return float(text)
    if text.startswith("-"):
        raise ValueError("must not be negative")
    body = text[1:] if text.startswith("+") else text
    if not body:
        raise ValueError("is not a duration (e.g. 500ms, 90s, 5m, 1h30m)")
    seconds = 0.0
    position = 0
    while position < len(body):
        match = _DURATION_PART.match(body, position)
        if match is None or match[1] in ("", "."):
            raise ValueError("is not a duration (e.g. 500ms, 90s, 5m, 1h30m)")
        unit = _DURATION_UNITS.get(match[2])
        if unit is None:
            raise ValueError(
                f"unknown unit {match[2]!r} (use ns, us, ms, s, m or h, e.g. 500ms, 90s, 5m)"
            )
        seconds += float(match[1]) * unit
        position = match.end()
    return seconds


def go_duration(seconds: float) -> str:
    """A duration as help and docs show it, short: ``60s``, ``5m``, ``0.5s``."""
    if seconds % 60 == 0 and seconds >= 60:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"


def duration(raw: object) -> float:
    """Seconds: a Go duration string, or a number of seconds (a YAML number too)."""
    if isinstance(raw, bool):
        raise BadValue("must be a duration (e.g. 90s, 5m) or a number of seconds, not a boolean")
    if isinstance(raw, int | float):
        if raw < 0:
            raise BadValue("must not be negative")
        return float(raw)
    try:
        return parse_duration(string(raw))
    except ValueError as exc:
        raise BadValue(str(exc)) from exc


def podresources_interval(raw: object) -> float:
    seconds = duration(raw)
    if 0 < seconds < MIN_PODRESOURCES_INTERVAL:
        raise BadValue(
            "must be 0 (off) or at least 100ms: the kubelet allows 100 PodResources requests "
            "per second to all its clients together"
        )
    return seconds


def vmodule(raw: object) -> tuple[tuple[str, int], ...]:
    text = string(raw)
    if not text:
        return ()
    items = []
    for item in text.split(","):
        match = _VMODULE_ITEM.fullmatch(item.strip())
        if match is None:
            raise BadValue("expect a comma-separated list of pattern=N (klog's -vmodule)")
        items.append((match[1], int(match[2])))
    return tuple(items)


def host_cgroups(raw: object) -> tuple[str, ...]:
    """Cgroup paths (:func:`dracpu.core.host_cgroups.check_cgroup_paths`): a YAML list, or (a
    flag) one string of them separated by commas."""
    if isinstance(raw, list):
        items = [string(item) for item in raw]
    else:
        text = string(raw)
        items = [item.strip() for item in text.split(",")] if text.strip() else []
    try:
        return check_cgroup_paths(items)
    except ValueError as exc:
        raise BadValue(f"cgroup {exc}") from None


def allocator(raw: object) -> str:
    """Upstream 0.3's ``allocator`` (``internal/driverconfig/validate.go``); what each value
    means is :mod:`dracpu.core.claim_config`'s."""
    text = string(raw)
    if text not in (ALLOCATOR_CPUMANAGER, ALLOCATOR_EXTERNAL):
        raise BadValue(f"must be {show(ALLOCATOR_CPUMANAGER)} or {show(ALLOCATOR_EXTERNAL)}")
    return text
