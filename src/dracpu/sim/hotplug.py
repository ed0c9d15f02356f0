"""CPU hotplug on a fake sysfs tree: what ``echo 0 > /sys/devices/system/cpu/cpuN/online`` does.

:func:`set_offline` turns a tree that :func:`dracpu.sim.topologies.write_sysfs` wrote into the
tree of the same machine with other CPUs offline, in place, as the kernel changes it: the
``online`` / ``offline`` lists, each CPU's ``online`` flag, the sibling, cluster, die, package,
NUMA and cache lists of the CPUs that stay, and the ``topology/`` and ``cache/`` directories of
a CPU that went offline (removed) or came back (written). Every file is replaced by a rename,
so a reader (the daemon's one-second poll of ``online``) sees the old or the new content, never
a half-written file. Tests and ``dracpu sim`` then send SIGHUP.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from dracpu.core.cpuset import CpuSet
from dracpu.sim.topologies import MachineSpec, sysfs_tree

__all__ = ["set_offline"]


def set_offline(spec: MachineSpec, root: Path, offline: CpuSet) -> MachineSpec:
    """Make the tree under ``root/sys``, written for ``spec``, that of the same machine with
    exactly ``offline`` offline; the new spec. Only the files that differ are written (a
    1024-CPU tree has 22k files). Raises :class:`~dracpu.errors.ConfigError` when ``offline``
    is every CPU or beyond the machine."""
    new = replace(spec, offline=offline)
    old_files, old_links = sysfs_tree(spec)
    files, links = sysfs_tree(new)
    base = os.fspath(root).rstrip("/") + "/"
    for rel, text in files.items():
        if old_files.get(rel) == text:
            continue
        path = base + rel
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        temporary = f"{directory}/.{os.path.basename(path)}.new"
        with open(temporary, "w", encoding="ascii") as out:
            out.write(text)
        os.replace(temporary, path)
    for rel, target in links.items():
        if old_links.get(rel) != target:
            if os.path.lexists(base + rel):
                os.unlink(base + rel)
            os.symlink(target, base + rel)
    stale = (old_files.keys() - files.keys()) | (old_links.keys() - links.keys())
    for rel in stale:
        os.unlink(base + rel)
    for directory in sorted({os.path.dirname(rel) for rel in stale}, key=len, reverse=True):
        _remove_empty(base, directory)
    return new


def _remove_empty(base: str, directory: str) -> None:
    """Remove ``directory`` and its parents below ``sys`` as long as they are empty."""
    while directory.count("/") > 0 and os.path.isdir(base + directory):
        if os.listdir(base + directory):
            return
        os.rmdir(base + directory)
        directory = os.path.dirname(directory)
