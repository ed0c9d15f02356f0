"""The settings of ``dracpu run``, one declaration each: :class:`Config`'s fields.

Each field is declared with :func:`setting`: its flag spellings, config-file key, environment
variable, converter, default, help and whether a SIGHUP applies it. The argparse flags
(:mod:`dracpu.config.go_flags`), the config-file reader (:mod:`dracpu.config.file`), the merge
(:func:`dracpu.config.load_config`), ``dracpu run --help``, SIGHUP's split of what applies now
(:mod:`dracpu.tasks.reload`) and the table of every setting in
``docs/upstream-compatibility.md`` (:func:`markdown_table`, checked by a test) are read off
:data:`SETTINGS`. A new setting is one new field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any, Literal, TypeVar, dataclass_transform, overload

from dracpu import DRIVER_NAME
from dracpu.config import values as v
from dracpu.config.values import BindAddress, LogFormat
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy

__all__ = [
    "CHECKPOINT_FILE",
    "DEVICE_METADATA_DIR",
    "DRA_SOCKET",
    "POD_RESOURCES_SOCKET",
    "REGISTRATION_SOCKET",
    "SETTINGS",
    "Config",
    "Setting",
    "markdown_table",
    "setting",
]

_T = TypeVar("_T")

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

_SPEC = "dracpu.setting"  # the key of a field's metadata that holds its Setting


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting of ``dracpu run`` (see the module docstring); ``name`` is its Config field
    and argparse ``dest``, ``default`` its field's default (``MISSING``: required)."""

    help: str
    """What it is, for ``--help`` and the docs (the default and environment are added)."""
    convert: Callable[[Any], object]
    """A raw flag, environment or file value to the value, or :class:`~.values.BadValue`."""
    flags: tuple[str, ...] = ()
    """Its flag spellings (argparse's option strings), the first the one messages name."""
    deprecated: tuple[str, ...] = ()
    """Flags upstream deprecated in favour of :attr:`key` (internal/driverconfig/load.go
    ``deprecatedFlags``, kubernetes-sigs/dra-driver-cpu#245): accepted, noticed once."""
    key: str | None = None
    """Its config-file key."""
    not_in_file: str | None = None
    """For a key upstream refuses in the file (``schemaExcludedFields``: its chart renders it as
    a flag next to the mounts that must match), what to use instead."""
    env: str | None = None
    """The environment variable that gives it (below the file and the flags)."""
    metavar: str | None = None
    takes: Literal["value", "bool", "count"] = "value"
    """How its flag takes a value: ``--f v`` / ``--f=v``; a Go boolean (alone means true);
    klog's ``-v`` (``-v=N``, or ``-v``, ``-vv`` counting up)."""
    sighup: bool = False
    """A SIGHUP applies a new value; otherwise a change needs a restart (refused, logged)."""
    default_text: str | None = None
    """The default in words, where the value does not say it (``None``, an empty set)."""
    text: Callable[[Any], str] | None = None
    """A value in words for help, docs and log lines (default: :func:`str`, booleans lower)."""
    name: str = ""
    default: object = None

    def shown(self, value: object) -> str:
        """``value`` as help, the docs and SIGHUP's log lines show it."""
        if self.text is not None:
            return self.text(value)
        if isinstance(value, bool):
            return str(value).lower()
        return str(value)

    @property
    def shown_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        return self.shown(self.default)

    @property
    def label(self) -> str:
        """How a user names it: its config-file key, else its first flag."""
        return self.key if self.key is not None else self.flags[0]

    def help_text(self) -> str:
        """Its ``--help`` line: what it is, its environment variable, its default, and which
        spellings upstream deprecated."""
        env = f"env {self.env}; " if self.env else ""
        deprecated = "".join(
            f"; {flag} is deprecated upstream: set {self.key} in the config file"
            for flag in self.deprecated
        )
        return f"{self.help} ({env}default {self.shown_default}){deprecated}"


@overload
def setting(*, default: _T, **spec: Any) -> _T: ...
@overload
def setting(**spec: Any) -> Any: ...
def setting(*, default: object = MISSING, **spec: Any) -> Any:
    """Declare a :class:`Config` field as a setting (``spec``: :class:`Setting`'s fields)."""
    return field(default=default, metadata={_SPEC: Setting(**spec)})


@dataclass_transform(frozen_default=True, field_specifiers=(setting, field))
def _settings_class(cls: type[_T]) -> type[_T]:
    return dataclass(frozen=True, slots=True)(cls)


def _choices(enum: type[Enum]) -> str:
    return "|".join(str(member.value) for member in enum)


def _vmodule_text(value: tuple[tuple[str, int], ...]) -> str:
    return ",".join(f"{pattern}={level}" for pattern, level in value)


@_settings_class
class Config:
    """Everything ``dracpu run`` needs to know, validated; build it with
    :func:`dracpu.config.load_config`. Defaults are upstream's (internal/driverconfig/defaults.go)
    where upstream has the setting."""

    node_name: str = setting(
        flags=("--node-name", "--hostname-override"),
        deprecated=("--hostname-override",),
        key="hostnameOverride",
        env="NODE_NAME",
        convert=v.node_name,
        metavar="NAME",
        help="the node this daemon serves, also the name of its ResourceSlice pool",
        default_text="the lower-cased hostname",
    )
    kubeconfig: Path | None = setting(
        default=None,
        flags=("--kubeconfig",),
        key="kubeconfig",
        env="KUBECONFIG",
        convert=v.optional_path,
        metavar="FILE",
        help="a kubeconfig file for API access",
        default_text="the in-cluster service account",
    )
    cpu_device_mode: CpuDeviceMode = setting(
        default=CpuDeviceMode.GROUPED,
        flags=("--cpu-device-mode",),
        deprecated=("--cpu-device-mode",),
        key="cpuDeviceMode",
        convert=v.choice(CpuDeviceMode),
        metavar=_choices(CpuDeviceMode),
        help="one device with capacity per CPU group, or one device per CPU",
    )
    group_by: GroupBy = setting(
        default=GroupBy.NUMANODE,
        flags=("--group-by",),
        deprecated=("--group-by",),
        key="groupBy",
        convert=v.choice(GroupBy),
        metavar=_choices(GroupBy),
        help="the CPU groups of grouped mode",
    )
    reserved_cpus: CpuSet = setting(
        default=CpuSet(),
        flags=("--reserved-cpus",),
        deprecated=("--reserved-cpus",),
        key="reservedCPUs",
        convert=v.cpuset,
        metavar="SET",
        help="CPUs never published and never in the shared pool (system and kubelet CPUs), "
        "Linux list syntax e.g. 0-1",
        sighup=True,
        default_text="none",
    )
    kubelet_root_dir: Path = setting(
        default=Path("/var/lib/kubelet"),
        flags=("--kubelet-root-dir",),
        key="kubeletRootDir",
        not_in_file="use --kubelet-root-dir (with the Helm chart: its kubeletRootDir value)",
        convert=v.absolute_path,
        metavar="DIR",
        help="the kubelet's --root-dir; the plugin and pod-resources sockets live under it",
    )
    cdi_dir: Path = setting(
        default=Path("/var/run/cdi"),  # the CDI spec directory runtimes read by default
        flags=("--cdi-dir",),
        key="cdiDir",
        convert=v.absolute_path,
        metavar="DIR",
        help="where CDI specs are written, a directory the runtime reads",
    )
    nri_socket: Path = setting(
        default=Path("/var/run/nri/nri.sock"),  # containerd/nri pkg/api DefaultSocketPath
        flags=("--nri-socket",),
        key="nriSocket",
        convert=v.absolute_path,
        metavar="PATH",
        help="the runtime's NRI socket",
    )
    state_dir: Path = setting(
        default=Path("/var/lib/dracpu"),  # ours: the checkpoint (upstream keeps none)
        flags=("--state-dir",),
        key="stateDir",
        convert=v.absolute_path,
        metavar="DIR",
        help="the checkpoint's directory, created 0700 if missing",
    )
    host_root: Path = setting(
        default=Path("/"),
        flags=("--host-root",),
        key="hostRoot",
        env="HOST_ROOT",
        convert=v.absolute_path,
        metavar="DIR",
        help="the host's root as mounted in the container: sysfs is read under <host-root>/sys",
    )
    bind_address: BindAddress = setting(
        default=BindAddress("", 8080),
        flags=("--bind-address",),
        key="bindAddress",
        not_in_file="use --bind-address (with the Helm chart: its healthzPort value)",
        convert=v.bind_address,
        metavar="[HOST]:PORT",
        help="where /healthz, /readyz and /metrics listen",
    )
    log_format: LogFormat = setting(
        default="text",
        flags=("--log-format",),
        key="logFormat",
        convert=v.log_format,
        metavar="|".join(v.LOG_FORMATS),
        help="text for people, json (one object per line) for log collectors",
        sighup=True,
    )
    verbosity: int = setting(
        default=0,
        flags=("-v", "--v"),
        key="verbosity",
        convert=v.verbosity,
        takes="count",
        metavar="N",
        help="log verbosity as klog's: -v=4 (or -v, -vv, ...); 0 logs info and above, 1+ also "
        "debug, 6+ also the libraries' debug",
        sighup=True,
    )
    vmodule: tuple[tuple[str, int], ...] = setting(
        default=(),
        flags=("--vmodule",),
        convert=v.vmodule,
        metavar="PATTERN=N,...",
        help="klog's per-file verbosity; patterns are matched against dracpu's module names",
        sighup=True,
        default_text="none",
        text=_vmodule_text,
    )
    memory_pinning: bool = setting(
        default=False,
        flags=("--memory-pinning",),
        key="memoryPinning",
        convert=v.boolean,
        takes="bool",
        metavar="BOOL",
        help="also pin cpuset.mems to the NUMA nodes of a claim's CPUs; a claim's "
        "cpuConfig.memory pin|none overrides it",
        sighup=True,
    )
    nri_plugin_name: str = setting(
        default=DRIVER_NAME,  # upstream stub.WithPluginName("dra.cpu")
        flags=("--nri-plugin-name",),
        key="nriPluginName",
        convert=v.nri_plugin_name,
        metavar="NAME",
        help="the name we register with the runtime's NRI",
    )
    nri_plugin_index: str = setting(
        default="00",  # upstream stub.WithPluginIdx("00")
        flags=("--nri-plugin-index",),
        key="nriPluginIndex",
        convert=v.nri_plugin_index,
        metavar="NN",
        help="the two-digit NRI plugin index: the runtime calls plugins in index order",
    )
    # The pod-resources sync (docs/architecture.md "PodResources reconciliation"): a List every
    # minute costs the kubelet next to nothing; an orphan is released after 5 minutes of
    # misses, far longer than the kubelet takes to unprepare the claims of a pod that ended.
    podresources_interval: float = setting(
        default=60.0,
        flags=("--podresources-interval",),
        key="podresourcesInterval",
        convert=v.podresources_interval,
        metavar="DURATION",
        help="how often to ask the kubelet's PodResources API which claims its pods hold, "
        "e.g. 90s or 5m (a plain number is seconds); 0: only at start and on SIGHUP",
        text=v.go_duration,
    )
    orphan_grace: float = setting(
        default=300.0,
        flags=("--orphan-grace",),
        key="orphanGrace",
        convert=v.duration,
        metavar="DURATION",
        help="release a prepared claim that no pod references and no container uses once the "
        "listings have missed it this long",
        text=v.go_duration,
    )
    sysfs_overlay: Path | None = setting(
        default=None,
        flags=("--sysfs-overlay",),
        deprecated=("--sysfs-overlay",),
        key="sysfsOverlay",
        convert=v.optional_path,
        metavar="FILE",
        help="a YAML file of sysfs paths and contents laid over <host-root>/sys, for machines "
        "whose sysfs lacks the topology",
        default_text="none",
    )
    expose_pcie_roots: bool = setting(
        default=False,
        flags=("--expose-pcie-roots",),
        key="exposePCIeRoots",
        not_in_file="use --expose-pcie-roots (with the Helm chart: its args.exposePCIeRoots value)",
        convert=v.boolean,
        takes="bool",
        metavar="BOOL",
        help="publish resource.kubernetes.io/pcieRoot, the PCIe roots local to each device's "
        "CPUs, and cap slices at 64 devices; the cluster needs DRAListTypeAttributes",
    )
    confine_host_cgroups: tuple[str, ...] = setting(
        default=(),
        flags=("--confine-host-cgroups",),
        key="confineHostCgroups",
        convert=v.host_cgroups,
        metavar="CGROUP,...",
        help="host cgroups (paths under <host-root>/sys/fs/cgroup, e.g. system.slice; a YAML "
        "list in the file, comma-separated on the command line) kept on the shared pool plus "
        "the reserved CPUs as claims come and go; never the pods' cgroup "
        "(docs/host-cgroups.md)",
        sighup=True,
        default_text="none",
        text=", ".join,
    )
    publish_node_allocatable_resource_mapping: bool = setting(
        default=False,
        key="publishNodeAllocatableResourceMapping",
        convert=v.boolean,
        help="publish KEP-5517 nodeAllocatableResources (cpu) on every device; the cluster "
        "needs DRANodeAllocatableResources",
    )
    allocator: str | None = setting(
        default=None,
        key="allocator",
        convert=v.allocator,
        help=f"upstream 0.3's allocator: {v.ALLOCATOR_CPUMANAGER} (ours picks the CPUs, a "
        f"claim's opaque cpuset is refused) or {v.ALLOCATOR_EXTERNAL} (every grouped request "
        "carries one opaque cpuset, split over its results; grouped devices publish "
        "dra.cpu/cpuIDs and dra.cpu/smtLayout); unset: ours picks, an opaque cpuset is honoured",
        default_text="unset",
    )
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


SETTINGS: tuple[Setting, ...] = tuple(
    replace(spec, name=f.name, default=f.default)
    for f in fields(Config)
    if (spec := f.metadata.get(_SPEC)) is not None
)
"""Every setting, in :class:`Config`'s order (the order of ``--help``, the docs and SIGHUP's
lines)."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


def markdown_table() -> str:
    """The table of every setting in ``docs/upstream-compatibility.md`` ("Every setting")."""
    lines = [
        "| Flag | Config key | Environment | Default | SIGHUP | What |",
        "|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        flags = ", ".join(
            f"`{flag}`" + (" (deprecated)" if flag in s.deprecated else "") for flag in s.flags
        )
        key = f"`{s.key}`" + (" (refused)" if s.not_in_file else "") if s.key else ""
        env = f"`{s.env}`" if s.env else ""
        cells = (flags, key, env, _cell(s.shown_default), "applies" if s.sighup else "restart")
        lines.append("| " + " | ".join((*cells, _cell(s.help))) + " |")
    return "\n".join(lines) + "\n"
