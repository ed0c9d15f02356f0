"""The settings of ``dracpu run``: :class:`Config`, loaded from flags, environment and the YAML
config file by :func:`load_config`.

Each setting is declared once, as a field of :class:`Config` (:mod:`dracpu.config.settings`);
:mod:`~dracpu.config.go_flags` builds the flags from the table, :mod:`~dracpu.config.file` reads
the file, :mod:`~dracpu.config.values` converts the values. Precedence, lowest first::

    built-in defaults  <  environment (NODE_NAME, KUBECONFIG, HOST_ROOT)  <  config file  <  flags

The environment acts as a default the DaemonSet injects on every node, so an operator's file or
an explicit flag wins over it. An empty value of ``NODE_NAME``, ``KUBECONFIG``, a path or a node
name means "not given" (as an empty Go string does upstream), and so does a YAML ``null``. The
node name falls back to the lower-cased host name, as the kubelet's own does. Every bad value
raises :class:`~dracpu.errors.ConfigError` with one line naming where it came from (the flag,
the file and key, or the environment variable) and the value; the CLI exits 2.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable, Mapping
from typing import NoReturn

from dracpu.config.file import read_config_file
from dracpu.config.go_flags import DEPRECATED_FLAGS, GIVEN_FLAGS
from dracpu.config.settings import SETTINGS, Config, Setting
from dracpu.config.values import BadValue, show
from dracpu.core.claim_config import ALLOCATOR_EXTERNAL
from dracpu.core.devices import CpuDeviceMode, GroupBy
from dracpu.errors import ConfigError

__all__ = ["UNIX_PATH_MAX", "Config", "changed_settings", "load_config"]

# sun_path of struct sockaddr_un is 108 bytes on Linux, one of them the terminating NUL; upstream
# checks the same limit (pkg/driver/driver.go `unixPathMax = 107`).
UNIX_PATH_MAX = 107

_NODE_NAME = next(s for s in SETTINGS if s.name == "node_name")


def _fail(source: str, raw: object, reason: str) -> NoReturn:
    raise ConfigError(f"{source}: invalid value {show(raw)}: {reason}")


def load_config(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    *,
    hostname: Callable[[], str] = socket.gethostname,
) -> Config:
    """Merge defaults < environment < config file < explicit flags, validate, build a Config.

    ``args`` is the namespace of a parser given
    :func:`~dracpu.config.go_flags.add_run_arguments`. ``hostname`` gives the host name the node
    name falls back to (lower-cased). Raises :class:`~dracpu.errors.ConfigError` with one line
    naming the bad value and its source.
    """
    values: dict[str, object] = {}
    sources: dict[str, str] = {}

    def take(setting: Setting, raw: object, source: str) -> None:
        try:
            value = setting.convert(raw)
        except BadValue as exc:
            _fail(source, raw, str(exc))
        if value is not None:
            values[setting.name] = value
            sources[setting.name] = source

    for setting in SETTINGS:
        if setting.env is not None and environ.get(setting.env):
            take(setting, environ[setting.env], f"environment variable {setting.env}")
    config_file = getattr(args, "config", "")
    if config_file:  # upstream: an empty --config means no file
        data = read_config_file(config_file)
        for setting in SETTINGS:
            key = setting.key
            if key is not None and data.get(key) is not None:
                take(setting, data[key], f"config file {config_file}: {key}")
    for setting in SETTINGS:
        if setting.flags and hasattr(args, setting.name):
            take(setting, getattr(args, setting.name), setting.flags[0])
    given = dict.fromkeys(getattr(args, GIVEN_FLAGS, ()))
    notices = tuple(
        f"flag {flag} is deprecated (as upstream); set {DEPRECATED_FLAGS[flag]} in the "
        "config file instead"
        for flag in given
        if flag in DEPRECATED_FLAGS
    )

    if "node_name" not in values:
        # The kubelet's default node name (k8s.io/component-helpers nodeutil.GetHostname):
        # the host name, lower-cased.
        take(_NODE_NAME, hostname().strip().lower(), "hostname")
    if "node_name" not in values:
        raise ConfigError(
            "no node name: give --node-name (or --hostname-override), set NODE_NAME, "
            "or set hostnameOverride in the config file (the host name is empty)"
        )
    values["node_name_source"] = sources["node_name"]
    grouped = values.get("cpu_device_mode", CpuDeviceMode.GROUPED) is CpuDeviceMode.GROUPED
    machine = grouped and values.get("group_by") is GroupBy.MACHINE
    if machine and values.get("allocator") != ALLOCATOR_EXTERNAL:
        # upstream 0.3 internal/driverconfig/validate.go refuses this; we allocate in the device
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
                f"{source}: {what} path {show(str(path))} is {size} bytes, over the "
                f"{UNIX_PATH_MAX}-byte limit of a Unix socket path"
            )


def changed_settings(old: Config, new: Config) -> list[tuple[Setting, str, str]]:
    """The settings whose value differs between two loads (a SIGHUP reads them again), in the
    table's order, each with its old and new value as an error line shows them."""
    return [
        (setting, _shown(setting, before), _shown(setting, after))
        for setting in SETTINGS
        if (before := getattr(old, setting.name)) != (after := getattr(new, setting.name))
    ]


def _shown(setting: Setting, value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool | int | float) and setting.text is None:
        return show(value)
    return show(setting.shown(value))
