"""Does a directory outlive the pod? Read from the mount table (``/proc/self/mountinfo``).

The checkpoint in ``--state-dir`` is what keeps prepared claims across a restart of the daemon's
pod. Our manifests mount a hostPath there; upstream's Helm chart mounts nothing, so under it the
directory lies on the container's own root filesystem (an overlay the runtime throws away with
the container) and the claims are lost when the pod is replaced. :func:`volatile_reason` tells
these apart: a directory on a memory filesystem, or on an overlay mounted at ``/`` (the
container's root), does not survive; a bind mount (a hostPath, even of an overlay, as on a kind
node) or any other filesystem does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Mount", "mount_reason", "parse_mountinfo", "volatile_reason"]

MOUNTINFO = Path("/proc/self/mountinfo")

# Filesystems kept in memory only (Documentation/filesystems/tmpfs.rst, ramfs-rootfs-initramfs).
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
# Filesystems container runtimes build a container's root from (containerd's and CRI-O's
# overlayfs snapshotters; fuse-overlayfs rootless; aufs on old Docker).
CONTAINER_ROOT_FILESYSTEMS = frozenset({"overlay", "fuse.fuse-overlayfs", "aufs"})


@dataclass(frozen=True, slots=True)
class Mount:
    """One line of ``/proc/<pid>/mountinfo`` (proc(5)): where and what."""

    mount_point: str
    fs_type: str


def _unescape(field: str) -> str:
    # proc(5): space, tab, newline and backslash in paths are written as octal escapes.
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and all(c in "01234567" for c in code):
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> Iterator[Mount]:
    """The mounts of a mountinfo text, in its order; malformed lines are skipped."""
    for line in text.splitlines():
        fields = line.split()
        try:
            separator = fields.index("-", 6)
            yield Mount(_unescape(fields[4]), fields[separator + 1])
        except (ValueError, IndexError):
            continue


def _existing(path: Path) -> str:
    """The real path of ``path`` or of its nearest existing ancestor (it may not exist yet)."""
    current = os.path.abspath(path)
    while not os.path.exists(current) and current != "/":
        current = os.path.dirname(current)
    return os.path.realpath(current)


def volatile_reason(path: Path) -> str | None:
    """Why files in ``path`` would not survive the pod (see the module doc), or ``None`` (also
    when the mount table cannot be read: the check is a warning, never a reason to stop)."""
    try:
        mountinfo = MOUNTINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return mount_reason(_existing(path), mountinfo)


def mount_reason(target: str, mountinfo: str) -> str | None:
    """:func:`volatile_reason` for the absolute, resolved path ``target`` and the mount table
    ``mountinfo`` (the text of a ``/proc/<pid>/mountinfo``)."""
    best: Mount | None = None
    for mount in parse_mountinfo(mountinfo):
        point = mount.mount_point
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        # The later of two mounts on one point is the visible one: >= keeps it.
        if inside and (best is None or len(point) >= len(best.mount_point)):
            best = mount
    if best is None:
        return None
    if best.fs_type in MEMORY_FILESYSTEMS:
        return f"it is on a {best.fs_type} (memory) mounted at {best.mount_point}"
    if best.mount_point == "/" and best.fs_type in CONTAINER_ROOT_FILESYSTEMS:
        return f"it is on the container's own root filesystem ({best.fs_type})"
    return None
