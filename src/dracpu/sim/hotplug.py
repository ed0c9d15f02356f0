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
    """Make the tree under ``root/sys`` (written for ``spec``, any CPUs offline) that of the
    same machine with exactly ``offline`` offline; the new spec. Raises
    :class:`~dracpu.errors.ConfigError` when ``offline`` is every CPU or beyond the machine."""
    new = replace(spec, offline=offline)
    files, links = sysfs_tree(new)
    base = os.fspath(root).rstrip("/") + "/"
    for rel, text in files.items():
        path = base + rel
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{os.path.dirname(path)}/.{os.path.basename(path)}.new"
        with open(temporary, "w", encoding="ascii") as out:
            out.write(text)
        os.replace(temporary, path)
    for rel, target in links.items():
        if not os.path.lexists(base + rel):
            os.symlink(target, base + rel)
    _remove_stale(base + "sys", base, set(files) | set(links))
    return new


def _remove_stale(top: str, base: str, keep: set[str]) -> None:
    """Remove the files under ``top`` that the new tree lacks, then the emptied directories."""
    for dirpath, dirnames, filenames in os.walk(top, topdown=False):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            if path.removeprefix(base) not in keep:
                os.unlink(path)
        if dirpath != top and not os.listdir(dirpath):
            os.rmdir(dirpath)
