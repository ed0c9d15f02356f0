"""Settings of ``dracpu run``: flags, environment and the YAML config file.

One module, longer than most: the flags, the environment and the file are three sources of the
same settings, resolved together in one precedence and refused in one style of error; each
setting's flag, key, default and check are read side by side here.

Precedence, lowest first::

    built-in defaults  <  environment (NODE_NAME, KUBECONFIG, HOST_ROOT)  <  config file  <  flags

Only flags given *explicitly* on the command line override the file: every ``run`` flag has the
argparse default ``SUPPRESS``, so an absent flag is absent from the namespace (upstream's
``driverconfig.FromFlags`` does the same with ``flag.Visit``). The environment behaves like a
flag *default*: it is what the DaemonSet's pod spec injects for every node (``NODE_NAME`` from
the downward API, ``HOST_ROOT``), so an operator's config file or an explicit flag is the more
deliberate choice and wins over it. Upstream reads ``HOST_ROOT`` only from the environment; we
also accept ``--host-root`` and the key ``hostRoot``. An empty ``NODE_NAME``, ``KUBECONFIG``,
``hostnameOverride``, ``kubeconfig`` or ``sysfsOverlay`` means "not given" (as an empty Go
string does upstream), and so does a YAML ``null`` for any key.

Flags are spelled as Go's ``flag`` package takes them (upstream's binary): ``-name`` or
``--name``, ``=value`` or a separate value, a boolean alone means true (:func:`go_style_flags`
turns the single-dash long form into argparse's). Upstream deprecated five flags in favour of
config-file keys (``internal/driverconfig/load.go`` ``deprecatedFlags``): ``--cpu-device-mode``,
``--group-by``, ``--reserved-cpus``, ``--hostname-override``, ``--sysfs-overlay``. They keep
working; each one given adds a line to :attr:`Config.notices`, which the daemon logs once.

The config file is upstream's (``internal/driverconfig``): a flat YAML mapping with the optional
``apiVersion: v1alpha1`` and the keys ``cpuDeviceMode``, ``groupBy``, ``reservedCPUs``,
``hostnameOverride``, ``kubeconfig``, ``sysfsOverlay`` (a YAML file of sysfs paths and contents
laid over the host's sysfs, :mod:`dracpu.adapters.sysfs_overlay`),
``publishNodeAllocatableResourceMapping`` and ``allocator`` (kubernetes-sigs/dra-driver-cpu
0.3: ``cpumanager``, the topology-aware allocator, which is ours, refusing a claim that carries
an opaque cpuset; ``external``, every grouped request carries exactly one opaque cpuset from
the claim, split over the request's results, and grouped devices publish ``dra.cpu/cpuIDs`` and
``dra.cpu/smtLayout``; without the key, our allocator and a claim's ``cpuConfig.cpuset``
honoured in every grouped mode: :mod:`dracpu.core.claim_config`). ``groupBy: machine`` without
``allocator: external``, which upstream 0.3 refuses to start with, works here (our allocator
picks inside the machine's device) and adds a notice. Upstream refuses ``bindAddress``,
``exposePCIeRoots`` and ``kubeletRootDir`` in the file (``schemaExcludedFields``: the Helm chart
renders them as flags, next to the mounts that must match), and so do we, naming the flag to
use. Our own settings have camelCase keys of their own (``cdiDir``, ``nriSocket``,
``stateDir``, ``hostRoot``, ``logFormat``, ``verbosity``, ``memoryPinning``, ``nriPluginName``,
``nriPluginIndex``, ``podresourcesInterval``, ``orphanGrace``). Durations are written as
Kubernetes' Go flags take them (``time.ParseDuration``: ``500ms``, ``90s``, ``5m``, ``1h30m``);
a plain number is seconds (a YAML number too). Unknown keys, keys spelled with another case,
duplicate keys and values of the wrong YAML type are errors; every bad key of a file is named in
the one error line.

The node name falls back to the lower-cased host name when neither ``--node-name`` (alias
``--hostname-override``), ``NODE_NAME`` nor ``hostnameOverride`` gives one: the kubelet
registers its Node under that name when it has no ``--hostname-override`` (upstream does the
same). :attr:`Config.node_name_source` says where the name came from, for the start-up log.

Every bad value raises :class:`~dracpu.errors.ConfigError` with one line naming where the value
came from (the flag, the file and key, or the environment variable) and the value itself; the CLI
prints it and exits 2.
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import json
import os
import re
import socket
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal, NoReturn

import yaml

from dracpu import DRIVER_NAME
from dracpu.core.claim_config import ALLOCATOR_CPUMANAGER, ALLOCATOR_EXTERNAL
from dracpu.core.cpuset import CpuSet
from dracpu.core.slices import CpuDeviceMode, GroupBy
from dracpu.errors import ConfigError, DracpuError

__all__ = [
    "ALLOCATOR_CPUMANAGER",
    "ALLOCATOR_EXTERNAL",
    "CONFIG_API_VERSION",
    "DEPRECATED_FLAGS",
    "MIN_PODRESOURCES_INTERVAL",
    "UNIX_PATH_MAX",
    "BindAddress",
    "Config",
    "LogFormat",
    "add_run_arguments",
    "changed_settings",
    "go_style_flags",
    "load_config",
    "parse_duration",
    "read_yaml_mapping",
]

LogFormat = Literal["text", "json"]

# The only config-file apiVersion upstream accepts (internal/driverconfig/config.go).
CONFIG_API_VERSION = "v1alpha1"

# sun_path of struct sockaddr_un is 108 bytes on Linux, one of them the terminating NUL; upstream
# checks the same limit (pkg/driver/driver.go `unixPathMax = 107`).
UNIX_PATH_MAX = 107

# Defaults: upstream internal/driverconfig/defaults.go where upstream has the setting
# (docs/upstream-compatibility.md lists every flag).
DEFAULT_KUBELET_ROOT_DIR = Path("/var/lib/kubelet")
DEFAULT_CDI_DIR = Path("/var/run/cdi")  # the CDI spec directory runtimes read by default
DEFAULT_NRI_SOCKET = Path("/var/run/nri/nri.sock")  # containerd/nri pkg/api DefaultSocketPath
DEFAULT_STATE_DIR = Path("/var/lib/dracpu")  # ours: the checkpoint (upstream keeps none)
DEFAULT_HOST_ROOT = Path("/")
DEFAULT_BIND_ADDRESS = ":8080"  # upstream --bind-address default
DEFAULT_NRI_PLUGIN_NAME = DRIVER_NAME  # upstream stub.WithPluginName("dra.cpu")
DEFAULT_NRI_PLUGIN_INDEX = "00"  # upstream stub.WithPluginIdx("00")
# The pod-resources sync (docs/architecture.md "PodResources reconciliation"): a List every
# minute costs the kubelet next to nothing; an orphan is released after 5 minutes of misses,
# far longer than the kubelet takes to unprepare the claims of a pod that ended.
DEFAULT_PODRESOURCES_INTERVAL = 60.0  # seconds; 0 turns the periodic List off
DEFAULT_ORPHAN_GRACE = 300.0  # seconds
# The kubelet's PodResources server allows 100 requests per second to all its clients together
# (pkg/kubelet/apis/podresources/grpc/ratelimit.go DefaultQPS): we take at most a tenth.
MIN_PODRESOURCES_INTERVAL = 0.1

# Socket and file names under the kubelet root, as the kubeletplugin helper upstream derives
# them (RegistrarDirectoryPath, PluginDataDirectoryPath; "<driver>-reg.sock" while rolling
# updates are off) and the kubelet's pod-resources socket (pkg/kubelet/apis/podresources).
REGISTRATION_SOCKET = Path("plugins_registry") / f"{DRIVER_NAME}-reg.sock"
DRA_SOCKET = Path("plugins") / DRIVER_NAME / "dra.sock"
# The KEP-5304 device metadata files, under the plugin data dir as the Go helper puts them
# (kubeletplugin/metadata.go metadataSubDir; dracpu.core.device_metadata.METADATA_DIR_NAME, not
# imported here: it would load most of the core into every command's start).
DEVICE_METADATA_DIR = DRA_SOCKET.parent / "dra-device-metadata"
POD_RESOURCES_SOCKET = Path("pod-resources") / "kubelet.sock"
CHECKPOINT_FILE = "checkpoint.json"  # <state-dir>/checkpoint.json (docs/architecture.md)

_LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
_NO_CPUS = CpuSet()

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

# The flags upstream deprecated in favour of a config-file key (internal/driverconfig/load.go
# deprecatedFlags, kubernetes-sigs/dra-driver-cpu#245): flag -> the key that replaces it.
DEPRECATED_FLAGS: Mapping[str, str] = MappingProxyType(
    {
        "--cpu-device-mode": "cpuDeviceMode",
        "--group-by": "groupBy",
        "--reserved-cpus": "reservedCPUs",
        "--hostname-override": "hostnameOverride",
        "--sysfs-overlay": "sysfsOverlay",
    }
)


# klog's -vmodule value (k8s.io/klog/v2 moduleSpec.Set): comma-separated ``pattern=N``, the
# pattern a glob over source file names without ".go".
_VMODULE_ITEM = re.compile(r"([^=,]+)=([0-9]+)")


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


@dataclass(frozen=True, slots=True)
class Config:
    """Everything ``dracpu run`` needs to know, validated; build it with :func:`load_config`."""

    node_name: str
    """The node this daemon serves; also the name of the ResourceSlice pool (required)."""
    kubeconfig: Path | None = None
    """A kubeconfig file for API access; ``None`` uses the in-cluster service account."""
    cpu_device_mode: CpuDeviceMode = CpuDeviceMode.GROUPED
    """``grouped`` (one device with capacity per group) or ``individual`` (one per CPU)."""
    group_by: GroupBy = GroupBy.NUMANODE
    """How grouped mode groups CPUs: by NUMA node, socket or the whole machine."""
    reserved_cpus: CpuSet = _NO_CPUS
    """CPUs never published and never in the shared pool (system and kubelet CPUs)."""
    kubelet_root_dir: Path = DEFAULT_KUBELET_ROOT_DIR
    """The kubelet's ``--root-dir``; the plugin and pod-resources sockets live under it."""
    cdi_dir: Path = DEFAULT_CDI_DIR
    """Directory where CDI spec files are written (the runtime must read it)."""
    nri_socket: Path = DEFAULT_NRI_SOCKET
    """The runtime's NRI socket we connect to."""
    state_dir: Path = DEFAULT_STATE_DIR
    """Directory of the checkpoint (created 0700 if missing)."""
    host_root: Path = DEFAULT_HOST_ROOT
    """The host's root as mounted in the container; sysfs is read under ``<host_root>/sys``."""
    bind_address: BindAddress = BindAddress("", 8080)
    """Listening address of ``/healthz``, ``/readyz`` and ``/metrics``."""
    log_format: LogFormat = "text"
    """``text`` for people, ``json`` (one object per line) for log collectors."""
    verbosity: int = 0
    """klog-style level: 0 logs info and above, 1+ also debug, 6+ also libraries' debug."""
    vmodule: tuple[tuple[str, int], ...] = ()
    """klog's ``-vmodule``: (glob over module names, verbosity) pairs, in the order given."""
    memory_pinning: bool = False
    """Also pin ``cpuset.mems`` to the NUMA nodes of a claim's CPUs (per-claim override later)."""
    nri_plugin_name: str = DEFAULT_NRI_PLUGIN_NAME
    """Name we register with the runtime's NRI."""
    nri_plugin_index: str = DEFAULT_NRI_PLUGIN_INDEX
    """Two-digit NRI plugin index: the runtime calls plugins in index order."""
    podresources_interval: float = DEFAULT_PODRESOURCES_INTERVAL
    """Seconds between two kubelet PodResources ``List`` calls; 0: only at start and on SIGHUP."""
    orphan_grace: float = DEFAULT_ORPHAN_GRACE
    """Seconds a prepared claim must be missing from the listings before it is released."""
    sysfs_overlay: Path | None = None
    """A YAML file of sysfs paths and their contents laid over ``<host_root>/sys`` (upstream's
    ``sysfsOverlay``, for machines whose sysfs lacks the topology); ``None``: none."""
    expose_pcie_roots: bool = False
    """Publish ``resource.kubernetes.io/pcieRoot`` (list-typed: the cluster needs
    ``DRAListTypeAttributes``) and cap slices at 64 devices, as upstream's flag does."""
    allocator: str | None = None
    """Upstream's ``allocator`` key: ``external``, ``cpumanager`` or ``None`` (not given: our
    allocator, an opaque cpuset honoured; :mod:`dracpu.core.claim_config`)."""
    publish_node_allocatable_resource_mapping: bool = False
    """Publish KEP-5517 ``nodeAllocatableResources`` (``cpu``) on every device (the cluster needs
    ``DRANodeAllocatableResources``), as upstream's config key does."""
    notices: tuple[str, ...] = field(default=(), compare=False)
    """Warnings about how the settings were given (deprecated flags), for the daemon to log
    once; not compared."""
    node_name_source: str = field(default="", compare=False)
    """Where :attr:`node_name` came from (``--node-name``, ``environment variable NODE_NAME``,
    ``config file <path>: hostnameOverride`` or ``hostname``); for logs, not compared."""

    @property
    def registration_socket(self) -> Path:
        """Kubelet plugin-registration socket: ``<root>/plugins_registry/dra.cpu-reg.sock``."""
        return self.kubelet_root_dir / REGISTRATION_SOCKET

    @property
    def dra_socket(self) -> Path:
        """DRA gRPC socket the kubelet calls: ``<root>/plugins/dra.cpu/dra.sock``."""
        return self.kubelet_root_dir / DRA_SOCKET

    @property
    def device_metadata_dir(self) -> Path:
        """Where the KEP-5304 device metadata files go:
        ``<root>/plugins/dra.cpu/dra-device-metadata`` (the Go helper's place under the plugin
        data dir; the runtime bind-mounts the files from there, so the path must be the same on
        the host)."""
        return self.kubelet_root_dir / DEVICE_METADATA_DIR

    @property
    def pod_resources_socket(self) -> Path:
        """The kubelet's PodResources socket: ``<root>/pod-resources/kubelet.sock``."""
        return self.kubelet_root_dir / POD_RESOURCES_SOCKET

    @property
    def checkpoint_path(self) -> Path:
        """The checkpoint's slot 0: ``<state_dir>/checkpoint.json``; slot 1 (``checkpoint.1.json``)
        is derived from it (:func:`dracpu.adapters.checkpoint_file.slot_paths`)."""
        return self.state_dir / CHECKPOINT_FILE


# --- command-line flags -------------------------------------------------------------------------

# Where the parser notes the flags given, in order and as spelled (for the deprecation notices).
_GIVEN_FLAGS = "given_flags"


def _note_flag(namespace: argparse.Namespace, option_string: str | None) -> None:
    if option_string is not None:
        given: list[str] = namespace.__dict__.setdefault(_GIVEN_FLAGS, [])
        given.append(option_string)


def _go_bool(text: str) -> bool:
    if text in _GO_TRUE:
        return True
    if text in _GO_FALSE:
        return False
    raise ValueError(f"invalid boolean {text!r} (use true or false)")


class _StoreAction(argparse.Action):
    """``--flag value`` / ``--flag=value``; notes the spelling used. Subclasses convert the
    value (:meth:`value`)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        _note_flag(namespace, option_string)
        setattr(namespace, self.dest, self.value(namespace, values))

    def value(self, namespace: argparse.Namespace, values: str | Sequence[object] | None) -> object:
        return values


class _GoBoolAction(_StoreAction):
    """A Go-style boolean flag: ``--flag`` is true, ``--flag=false`` / ``--flag=true`` as given."""

    def value(self, namespace: argparse.Namespace, values: str | Sequence[object] | None) -> object:
        if values is None:
            return True
        try:
            return _go_bool(str(values))
        except ValueError as exc:
            raise argparse.ArgumentError(self, str(exc)) from exc


class _VerbosityAction(_StoreAction):
    """klog's ``-v=N`` / ``--v=N`` / ``-v N``, and also ``-v``, ``-vv``, ... counting up."""

    def value(self, namespace: argparse.Namespace, values: str | Sequence[object] | None) -> object:
        current: int = getattr(namespace, self.dest, 0)
        if values is None:
            return current + 1
        if isinstance(values, str) and values and set(values) == {"v"}:  # -vv arrives as "v"
            return current + 1 + len(values)
        if isinstance(values, str) and values.isascii() and values.isdigit():
            return int(values)
        raise argparse.ArgumentError(self, f"invalid verbosity {values!r}: use a number >= 0")


def _deprecated(help_text: str, flag: str) -> str:
    return f"{help_text}; deprecated upstream: set {DEPRECATED_FLAGS[flag]} in the config file"


def add_run_arguments(parser: argparse.ArgumentParser) -> frozenset[str]:
    """Add every ``dracpu run`` flag to ``parser``; none has a default (see the module doc).

    Returns the long option strings (``--name``), for :func:`go_style_flags`.
    """
    s = argparse.SUPPRESS

    def flag(*names: str, **options: object) -> None:
        options.setdefault("action", _StoreAction)
        parser.add_argument(*names, default=s, **options)  # type: ignore[arg-type]

    flag(
        "--config",
        metavar="FILE",
        help="YAML config file (upstream's keys, see the docs); empty: none",
    )
    flag(
        "--node-name",
        "--hostname-override",
        dest="node_name",
        metavar="NAME",
        help="node this daemon serves (env NODE_NAME; default: the lower-cased hostname); "
        "--hostname-override is deprecated upstream: set hostnameOverride in the config file",
    )
    flag("--kubeconfig", metavar="FILE", help="kubeconfig (env KUBECONFIG; in-cluster)")
    flag(
        "--cpu-device-mode",
        metavar="|".join(CpuDeviceMode),
        help=_deprecated(
            "one device per CPU group with capacity, or one per CPU (default grouped)",
            "--cpu-device-mode",
        ),
    )
    flag(
        "--group-by",
        metavar="|".join(GroupBy),
        help=_deprecated("CPU groups of grouped mode (default numanode)", "--group-by"),
    )
    flag(
        "--reserved-cpus",
        metavar="SET",
        help=_deprecated(
            "CPUs never published nor shared, Linux list syntax e.g. 0-1 (default none)",
            "--reserved-cpus",
        ),
    )
    flag(
        "--kubelet-root-dir",
        metavar="DIR",
        help=f"the kubelet's root directory (default {DEFAULT_KUBELET_ROOT_DIR})",
    )
    flag("--cdi-dir", metavar="DIR", help=f"CDI spec directory (default {DEFAULT_CDI_DIR})")
    flag(
        "--nri-socket",
        metavar="PATH",
        help=f"the runtime's NRI socket (default {DEFAULT_NRI_SOCKET})",
    )
    flag("--state-dir", metavar="DIR", help=f"checkpoint directory (default {DEFAULT_STATE_DIR})")
    flag(
        "--host-root",
        metavar="DIR",
        help="read sysfs under <host-root>/sys (env HOST_ROOT; default /)",
    )
    flag(
        "--bind-address",
        metavar="[HOST]:PORT",
        help=f"/healthz, /readyz and /metrics (default {DEFAULT_BIND_ADDRESS})",
    )
    flag("--log-format", metavar="|".join(_LOG_FORMATS), help="default text")
    flag(
        "-v",
        "--v",
        dest="verbosity",
        action=_VerbosityAction,
        nargs="?",
        metavar="N",
        help="log verbosity as klog: -v=4 (or -v, -vv, ...); 1+ logs debug (default 0)",
    )
    flag(
        "--vmodule",
        metavar="PATTERN=N,...",
        help="klog's per-file verbosity; patterns are matched against dracpu's module names",
    )
    flag(
        "--memory-pinning",
        action=_GoBoolAction,
        nargs="?",
        metavar="BOOL",
        help=(
            "also pin cpuset.mems to the claim's NUMA nodes (default false; a claim's "
            "cpuConfig.memory pin|none overrides it)"
        ),
    )
    flag(
        "--nri-plugin-name",
        metavar="NAME",
        help=f"NRI plugin name (default {DEFAULT_NRI_PLUGIN_NAME})",
    )
    flag(
        "--nri-plugin-index",
        metavar="NN",
        help=f"two-digit NRI plugin index (default {DEFAULT_NRI_PLUGIN_INDEX})",
    )
    flag(
        "--podresources-interval",
        metavar="DURATION",
        help="how often to ask the kubelet's PodResources API which claims its pods hold, "
        "e.g. 90s or 5m; a plain number is seconds; 0: only at start and on SIGHUP "
        f"(default {_go_duration(DEFAULT_PODRESOURCES_INTERVAL)})",
    )
    flag(
        "--orphan-grace",
        metavar="DURATION",
        help="release a prepared claim that no pod references and no container uses once "
        f"the listings have missed it this long (default {_go_duration(DEFAULT_ORPHAN_GRACE)})",
    )
    flag(
        "--expose-pcie-roots",
        action=_GoBoolAction,
        nargs="?",
        metavar="BOOL",
        help="publish the PCIe roots local to each device's CPUs (default false)",
    )
    flag(
        "--sysfs-overlay",
        metavar="FILE",
        help=_deprecated(
            "a YAML file of sysfs paths and contents laid over the host's sysfs", "--sysfs-overlay"
        ),
    )
    return frozenset(
        option
        for action in parser._actions  # the public API has no list of the options added
        for option in action.option_strings
        if option.startswith("--")
    )


def go_style_flags(argv: Sequence[str], long_flags: Collection[str]) -> list[str]:
    """``argv`` with Go's single-dash long flags (``-kubeconfig x``, ``-v=4``,
    ``-vmodule=a=2``) written with two dashes, as argparse takes them.

    Only a word whose name (before any ``=``) is one of ``long_flags`` without its dashes is
    rewritten; everything after ``--`` is left alone, like any other word.
    """
    out: list[str] = []
    rest = iter(argv)
    for word in rest:
        if word == "--":
            out.append(word)
            out.extend(rest)
            break
        if word.startswith("-") and not word.startswith("--"):
            name = word[1:].partition("=")[0]
            if f"--{name}" in long_flags:
                word = "-" + word
        out.append(word)
    return out


# --- loading ------------------------------------------------------------------------------------


class _BadValue(ValueError):
    """A value that cannot be used; the message is the reason, without the source."""


def _show(value: object) -> str:
    """A value as it appears in an error line: JSON style, so strings get double quotes."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _string(raw: object) -> str:
    if not isinstance(raw, str):
        raise _BadValue(f"must be a string, not {_yaml_type(raw)}")
    return raw


def _yaml_type(raw: object) -> str:
    names = {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }
    return names.get(type(raw), type(raw).__name__)


def _choice(enum: type[CpuDeviceMode] | type[GroupBy]) -> Callable[[object], object]:
    def convert(raw: object) -> object:
        text = _string(raw)
        try:
            return enum(text)
        except ValueError:
            allowed = ", ".join(_show(member.value) for member in enum)
            raise _BadValue(f"must be one of {allowed}") from None

    return convert


def _log_format(raw: object) -> LogFormat:
    text = _string(raw)
    for fmt in _LOG_FORMATS:
        if text == fmt:
            return fmt
    raise _BadValue('must be "text" or "json"')


def _cpuset(raw: object) -> CpuSet:
    text = _string(raw)
    try:
        return CpuSet.parse(text)
    except DracpuError as exc:
        raise _BadValue(str(exc)) from exc


def _absolute_path(raw: object) -> Path:
    text = _string(raw)
    if not text:
        raise _BadValue("must not be empty")
    if not os.path.isabs(text):
        raise _BadValue("must be an absolute path")
    return Path(os.path.normpath(text))


def _optional_path(raw: object) -> Path | None:
    """A client-side file (kubeconfig): relative is resolved against the working directory."""
    text = _string(raw)
    if not text:
        return None
    if os.pathsep in text:
        raise _BadValue(f"lists several files ({os.pathsep!r}-separated); give exactly one")
    return Path(os.path.abspath(text))


def _node_name(raw: object) -> str | None:
    text = _string(raw)
    if not text:
        return None
    if len(text) > _DNS_SUBDOMAIN_MAX or not _DNS_SUBDOMAIN.fullmatch(text):
        raise _BadValue(
            "is not a valid node name (lowercase RFC 1123 subdomain: a-z, 0-9, '-' and '.')"
        )
    return text


def _bind_address(raw: object) -> BindAddress:
    text = _string(raw)
    try:
        return BindAddress.parse(text)
    except ValueError as exc:
        raise _BadValue(str(exc)) from exc


def _verbosity(raw: object) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise _BadValue("must be a number >= 0")
    return raw


def _boolean(raw: object) -> bool:
    if not isinstance(raw, bool):
        raise _BadValue(f"must be true or false, not {_yaml_type(raw)}")
    return raw


def _nri_plugin_name(raw: object) -> str:
    text = _string(raw)
    if not _NRI_PLUGIN_NAME.fullmatch(text):
        raise _BadValue("must be letters, digits, '.', '_' or '-', starting with a letter or digit")
    return text


def _nri_plugin_index(raw: object) -> str:
    # YAML reads an unquoted 00 / 07 as the number 0 / 7, so a number 0..99 is accepted too.
    reason = 'must be two digits, "00" to "99"'
    if isinstance(raw, int) and not isinstance(raw, bool):
        if 0 <= raw <= 99:
            return f"{raw:02d}"
        raise _BadValue(reason)
    text = _string(raw)
    if not _NRI_PLUGIN_INDEX.fullmatch(text):
        raise _BadValue(reason)
    return text


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


def _go_duration(seconds: float) -> str:
    """A default in flag help: 60.0 -> ``1m0s`` as Go prints it, kept short: ``60s``, ``5m``."""
    if seconds % 60 == 0 and seconds >= 60:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"


def _duration(raw: object) -> float:
    if isinstance(raw, bool):
        raise _BadValue("must be a duration (e.g. 90s, 5m) or a number of seconds, not a boolean")
    if isinstance(raw, int | float):
        if raw < 0:
            raise _BadValue("must not be negative")
        return float(raw)
    try:
        return parse_duration(_string(raw))
    except ValueError as exc:
        raise _BadValue(str(exc)) from exc


def _podresources_interval(raw: object) -> float:
    seconds = _duration(raw)
    if 0 < seconds < MIN_PODRESOURCES_INTERVAL:
        raise _BadValue(
            "must be 0 (off) or at least 100ms: the kubelet allows 100 PodResources requests "
            "per second to all its clients together"
        )
    return seconds


def _vmodule(raw: object) -> tuple[tuple[str, int], ...]:
    text = _string(raw)
    if not text:
        return ()
    items = []
    for item in text.split(","):
        match = _VMODULE_ITEM.fullmatch(item.strip())
        if match is None:
            raise _BadValue("expect a comma-separated list of pattern=N (klog's -vmodule)")
        items.append((match[1], int(match[2])))
    return tuple(items)


def _allocator(raw: object) -> str:
    text = _string(raw)
    if text not in (ALLOCATOR_CPUMANAGER, ALLOCATOR_EXTERNAL):
        raise _BadValue(f"must be {_show(ALLOCATOR_CPUMANAGER)} or {_show(ALLOCATOR_EXTERNAL)}")
    return text


@dataclass(frozen=True, slots=True)
class _Setting:
    """One setting: its name (the Config field and the argparse ``dest``), its flag, its
    config-file key, the converter of a raw flag / file / environment value, the environment
    variable if any, and, for a key upstream refuses in the file, what to use instead."""

    name: str
    flag: str | None
    key: str | None
    convert: Callable[[object], object]
    env: str | None = None
    not_in_file: str | None = None


_SETTINGS: tuple[_Setting, ...] = (
    _Setting("node_name", "--node-name", "hostnameOverride", _node_name, env="NODE_NAME"),
    _Setting("kubeconfig", "--kubeconfig", "kubeconfig", _optional_path, env="KUBECONFIG"),
    _Setting("cpu_device_mode", "--cpu-device-mode", "cpuDeviceMode", _choice(CpuDeviceMode)),
    _Setting("group_by", "--group-by", "groupBy", _choice(GroupBy)),
    _Setting("reserved_cpus", "--reserved-cpus", "reservedCPUs", _cpuset),
    _Setting(
        "kubelet_root_dir",
        "--kubelet-root-dir",
        "kubeletRootDir",
        _absolute_path,
        not_in_file="use --kubelet-root-dir (with the Helm chart: its kubeletRootDir value)",
    ),
    _Setting("cdi_dir", "--cdi-dir", "cdiDir", _absolute_path),
    _Setting("nri_socket", "--nri-socket", "nriSocket", _absolute_path),
    _Setting("state_dir", "--state-dir", "stateDir", _absolute_path),
    _Setting("host_root", "--host-root", "hostRoot", _absolute_path, env="HOST_ROOT"),
    _Setting(
        "bind_address",
        "--bind-address",
        "bindAddress",
        _bind_address,
        not_in_file="use --bind-address (with the Helm chart: its healthzPort value)",
    ),
    _Setting("log_format", "--log-format", "logFormat", _log_format),
    _Setting("verbosity", "--v", "verbosity", _verbosity),
    _Setting("vmodule", "--vmodule", None, _vmodule),
    _Setting("memory_pinning", "--memory-pinning", "memoryPinning", _boolean),
    _Setting("nri_plugin_name", "--nri-plugin-name", "nriPluginName", _nri_plugin_name),
    _Setting("nri_plugin_index", "--nri-plugin-index", "nriPluginIndex", _nri_plugin_index),
    _Setting(
        "podresources_interval",
        "--podresources-interval",
        "podresourcesInterval",
        _podresources_interval,
    ),
    _Setting("orphan_grace", "--orphan-grace", "orphanGrace", _duration),
    _Setting("sysfs_overlay", "--sysfs-overlay", "sysfsOverlay", _optional_path),
    _Setting(
        "expose_pcie_roots",
        "--expose-pcie-roots",
        "exposePCIeRoots",
        _boolean,
        not_in_file="use --expose-pcie-roots (with the Helm chart: its args.exposePCIeRoots value)",
    ),
    _Setting(
        "publish_node_allocatable_resource_mapping",
        None,
        "publishNodeAllocatableResourceMapping",
        _boolean,
    ),
    _Setting("allocator", None, "allocator", _allocator),
)

_FILE_KEYS: frozenset[str] = frozenset(
    {"apiVersion"} | {s.key for s in _SETTINGS if s.key is not None}
)
_NOT_IN_FILE: Mapping[str, str] = MappingProxyType(
    {s.key: s.not_in_file for s in _SETTINGS if s.key is not None and s.not_in_file}
)


def _fail(source: str, raw: object, reason: str) -> NoReturn:
    raise ConfigError(f"{source}: invalid value {_show(raw)}: {reason}")


def _converted(setting: _Setting, raw: object, source: str) -> object:
    try:
        return setting.convert(raw)
    except _BadValue as exc:
        _fail(source, raw, str(exc))


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses a mapping key given twice (upstream: yaml.UnmarshalStrict)."""


def _construct_unique_mapping(
    loader: yaml.SafeLoader, node: yaml.MappingNode
) -> dict[object, object]:
    loader.flatten_mapping(node)
    seen: set[object] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            continue  # construct_mapping below reports the unhashable key
        if key in seen:
            mark = key_node.start_mark
            raise yaml.MarkedYAMLError(problem=f"duplicate key {_show(key)}", problem_mark=mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def read_yaml_mapping(path: str, where: str) -> dict[object, object]:
    """The YAML mapping in ``path`` (duplicate keys refused, ``{}`` for an empty file);
    :class:`ConfigError` starting with ``where`` otherwise."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{where}: cannot read: {reason}") from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: builds no objects
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {_yaml_problem(exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a mapping of keys to values, not {_yaml_type(data)}")
    return data


def _read_file(path: str) -> dict[str, object]:
    where = f"config file {path}"
    data = read_yaml_mapping(path, where)
    version = data.get("apiVersion", CONFIG_API_VERSION)
    if version != CONFIG_API_VERSION:
        raise ConfigError(
            f"{where}: apiVersion: invalid value {_show(version)}: "
            f"must be {_show(CONFIG_API_VERSION)}"
        )
    problems = [
        problem
        for key in sorted((str(k) for k in data), key=str)
        if (problem := _key_problem(key)) is not None
    ]
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    return {str(k): v for k, v in data.items() if k != "apiVersion"}


def _key_problem(key: str) -> str | None:
    """Why ``key`` may not be in a config file (upstream's ``rejectNonCanonicalKeys``,
    ``rejectExcludedFields`` and unknown fields), or ``None``."""
    folded = next((k for k in sorted(_FILE_KEYS) if k.lower() == key.lower()), None)
    if folded is not None and folded in _NOT_IN_FILE:
        return f"key {_show(key)} is not settable in the config file; {_NOT_IN_FILE[folded]}"
    if key in _FILE_KEYS:
        return None
    if folded is not None:
        return f"key {_show(key)} is spelled differently from the schema; use {_show(folded)}"
    close = difflib.get_close_matches(key, sorted(_FILE_KEYS), n=1)
    hint = f" (did you mean {_show(close[0])}?)" if close else ""
    return f"unknown key {_show(key)}{hint}"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        return f"{exc.problem}{where}"
    return " ".join(str(exc).split())


def load_config(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    *,
    hostname: Callable[[], str] = socket.gethostname,
) -> Config:
    """Merge defaults < environment < config file < explicit flags, validate, build a Config.

    ``args`` is the namespace of a parser given :func:`add_run_arguments`. ``hostname`` gives
    the host name the node name falls back to (lower-cased). Raises
    :class:`~dracpu.errors.ConfigError` with one line naming the bad value and its source.
    """
    values: dict[str, object] = {}
    sources: dict[str, str] = {}

    def take(setting: _Setting, raw: object, source: str) -> None:
        value = _converted(setting, raw, source)
        if value is not None:
            values[setting.name] = value
            sources[setting.name] = source

    for setting in _SETTINGS:
        if setting.env is not None and environ.get(setting.env):
            take(setting, environ[setting.env], f"environment variable {setting.env}")
    config_file = getattr(args, "config", "")
    if config_file:  # upstream: an empty --config means no file
        data = _read_file(config_file)
        for setting in _SETTINGS:
            key = setting.key
            if key is not None and data.get(key) is not None:
                take(setting, data[key], f"config file {config_file}: {key}")
    for setting in _SETTINGS:
        if setting.flag is not None and hasattr(args, setting.name):
            take(setting, getattr(args, setting.name), setting.flag)
    given = dict.fromkeys(getattr(args, _GIVEN_FLAGS, ()))
    notices = tuple(
        f"flag {flag} is deprecated (as upstream); set {DEPRECATED_FLAGS[flag]} in the "
        "config file instead"
        for flag in given
        if flag in DEPRECATED_FLAGS
    )

    if "node_name" not in values:
        # The kubelet's default node name (k8s.io/component-helpers nodeutil.GetHostname):
        # the host name, lower-cased.
        node_name = next(s for s in _SETTINGS if s.name == "node_name")
        take(node_name, hostname().strip().lower(), "hostname")
    if "node_name" not in values:
        raise ConfigError(
            "no node name: give --node-name (or --hostname-override), set NODE_NAME, "
            "or set hostnameOverride in the config file (the host name is empty)"
        )
    values["node_name_source"] = sources["node_name"]
    grouped = values.get("cpu_device_mode", CpuDeviceMode.GROUPED) is CpuDeviceMode.GROUPED
    machine = grouped and values.get("group_by") is GroupBy.MACHINE
    if machine and values.get("allocator") != ALLOCATOR_EXTERNAL:
        notices += (
            "groupBy machine without allocator external: upstream 0.3 refuses to start "
            "with this; dracpu picks the CPUs inside the machine's device itself (a "
            "claim's cpuConfig.cpuset is honoured)",
        )
    values["notices"] = notices
    config = Config(**values)  # type: ignore[arg-type]
    _check_socket_paths(config, sources)
    return config


def _check_socket_paths(config: Config, sources: Mapping[str, str]) -> None:
    checks = (
        ("kubelet_root_dir", "registration socket", config.registration_socket),
        ("kubelet_root_dir", "DRA socket", config.dra_socket),
        ("kubelet_root_dir", "pod-resources socket", config.pod_resources_socket),
        ("nri_socket", "NRI socket", config.nri_socket),
    )
    for key, what, path in checks:
        size = len(os.fsencode(path))
        if size > UNIX_PATH_MAX:
            source = sources.get(key, "default")
            raise ConfigError(
                f"{source}: {what} path {_show(str(path))} is {size} bytes, over the "
                f"{UNIX_PATH_MAX}-byte limit of a Unix socket path"
            )


def changed_settings(old: Config, new: Config) -> list[tuple[str, str, str, str]]:
    """The settings whose value differs between two loads (a SIGHUP reads them again), in the
    order of the settings: (the Config field, how a user names it: its config-file key, else
    its flag; the old value, the new value, as an error line shows them)."""
    changed: list[tuple[str, str, str, str]] = []
    for setting in _SETTINGS:
        before, after = getattr(old, setting.name), getattr(new, setting.name)
        if before != after:
            label = setting.key if setting.key is not None else str(setting.flag)
            changed.append((setting.name, label, _shown_setting(before), _shown_setting(after)))
    return changed


def _shown_setting(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, (Path, CpuSet, BindAddress)) or type(value) in (CpuDeviceMode, GroupBy):
        return _show(str(value))
    return _show(value)
