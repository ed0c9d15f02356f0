"""Upstream's ``sysfsOverlay``: sysfs files whose contents a YAML file replaces.

kubernetes-sigs/dra-driver-cpu reads a YAML mapping of absolute sysfs paths to file contents
(``pkg/sysfs/overlay.go``, e.g. a kind node on Docker Desktop, whose sysfs shows no NUMA
topology) and lays it over the host's sysfs: a path in the mapping reads as the given text, every
other path reads from the host. Our sysfs reader (:mod:`dracpu.adapters.sysfs`) reads files under
a root directory, so the overlay becomes a real directory tree that it reads like any host root
(:func:`build_overlay_root`): each directory on the way to an overlaid file is a real directory,
the overlaid files are real files, and every other entry of those directories is a symlink to the
host's entry. Nothing is copied from the host; the tree is rebuilt at every start.

The file's rules are upstream's (``parseOverlay``, ``newOverlay``, ``overlayName``,
``validateNUMANodeEntries``): a mapping with no duplicate keys; each key an absolute, clean path
under ``/sys``; each value a string; no path both a file and a directory; at most one ``nodeN``
entry per ``/sys/devices/system/cpu/cpuN`` directory. An overlaid ``nodeN`` under a CPU's
directory hides the host's ``nodeM`` entries there (a CPU is in one NUMA node). Any other shape
is a :class:`~dracpu.errors.ConfigError` naming the file and the key.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from dracpu.config.file import read_yaml_mapping
from dracpu.errors import ConfigError

__all__ = ["OVERLAY_DIR", "SysfsOverlay", "build_overlay_root", "load_overlay"]

# Where upstream's overlay paths must lie (pkg/sysfs: Root = "/sys").
SYSFS_ROOT = "/sys"
# The overlay tree's directory under the daemon's --state-dir (rebuilt at every start).
OVERLAY_DIR = "sysfs-overlay"

# /sys/devices/system/cpu/cpuN and its nodeN links (pkg/sysfs/overlay.go isCPUDirectory,
# isNUMANodeEntry), relative to the host root.
_CPU_DIR = re.compile(r"sys/devices/system/cpu/cpu[0-9]+")
_NODE_ENTRY = re.compile(r"node[0-9]+")


class SysfsOverlay:
    """The validated overlay: file contents by path relative to the host root (``sys/...``)."""

    __slots__ = ("files", "source")

    def __init__(self, source: Path, files: Mapping[str, bytes]) -> None:
        self.source = source
        self.files: Mapping[str, bytes] = MappingProxyType(dict(files))

    def directories(self) -> set[str]:
        """Every directory an overlaid file lies in, up to ``sys`` (relative paths)."""
        dirs: set[str] = set()
        for name in self.files:
            parent = posixpath.dirname(name)
            while parent and parent not in dirs:
                dirs.add(parent)
                parent = posixpath.dirname(parent)
        return dirs


def load_overlay(path: Path) -> SysfsOverlay:
    """Read and check the overlay file; :class:`ConfigError` with the reason otherwise."""
    where = f"sysfs overlay {path}"
    data = read_yaml_mapping(str(path), where)
    files: dict[str, bytes] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where}: key {key!r} is not a path")
        if not isinstance(value, str):
            raise ConfigError(f"{where}: the value of {key!r} must be a string")
        files[_relative(where, key)] = value.encode()
    overlay = SysfsOverlay(path, files)
    dirs = overlay.directories()
    for name in sorted(files):
        if name in dirs:
            raise ConfigError(f"{where}: /{name} is both a file and a directory")
    for directory in sorted(d for d in dirs if _CPU_DIR.fullmatch(d)):
        nodes = sorted(
            posixpath.basename(n)
            for n in (*files, *dirs)
            if posixpath.dirname(n) == directory and _NODE_ENTRY.fullmatch(posixpath.basename(n))
        )
        if len(nodes) > 1:
            raise ConfigError(
                f"{where}: more than one NUMA node under /{directory}: {', '.join(nodes)}"
            )
    return overlay


def _relative(where: str, key: str) -> str:
    if not key.startswith(SYSFS_ROOT + "/"):
        raise ConfigError(f"{where}: {key!r} is not a path under {SYSFS_ROOT}")
    if posixpath.normpath(key) != key:
        raise ConfigError(f"{where}: {key!r} is not a clean path (write it without //, . or ..)")
    return key.removeprefix("/")


def build_overlay_root(host_root: Path, overlay: SysfsOverlay, dest: Path) -> Path:
    """Make ``dest`` a root whose ``sys`` is the host's ``<host_root>/sys`` with ``overlay``
    laid over it (see the module doc) and return ``dest``. Whatever was at ``dest`` is
    replaced. An I/O failure is a :class:`ConfigError` naming the path."""
    try:
        if dest.is_symlink() or dest.is_file():
            dest.unlink()
        elif dest.exists():
            shutil.rmtree(dest)  # symlinks inside are removed, never followed
        dest.mkdir(parents=True, mode=0o755)
        dirs = overlay.directories()
        for directory in sorted(dirs):
            (dest / directory).mkdir(exist_ok=True)
        for directory in sorted(dirs):
            _link_host_entries(host_root, overlay, directory, dirs, dest)
        for name, content in overlay.files.items():
            (dest / name).write_bytes(content)
    except OSError as exc:
        raise ConfigError(
            f"cannot build the sysfs overlay of {overlay.source} in {dest}: {exc}"
        ) from exc
    return dest


def _link_host_entries(
    host_root: Path, overlay: SysfsOverlay, directory: str, dirs: set[str], dest: Path
) -> None:
    """Symlink every entry of the host's ``directory`` that the overlay does not replace."""
    try:
        entries = os.listdir(host_root / directory)
    except (FileNotFoundError, NotADirectoryError):
        return  # the host lacks the directory: the overlay alone makes it
    hide_nodes = _CPU_DIR.fullmatch(directory) is not None and any(
        posixpath.dirname(n) == directory and _NODE_ENTRY.fullmatch(posixpath.basename(n))
        for n in (*overlay.files, *dirs)
    )
    for entry in entries:
        name = posixpath.join(directory, entry)
        if name in dirs or name in overlay.files:
            continue
        if hide_nodes and _NODE_ENTRY.fullmatch(entry):
            continue  # the overlay moved this CPU to another NUMA node
        os.symlink(host_root / name, dest / name)
