"""Host cgroups confined to the shared pool: which paths may be listed, what they are confined
to, and the order of cgroup v1 writes (pure; ``docs/host-cgroups.md`` is the user's view).

The listed cgroups (``--confine-host-cgroups`` / ``confineHostCgroups``: ``system.slice``,
``kubelet.slice``, ...) get ``cpuset.cpus`` = the shared pool plus the reserved CPUs
(:attr:`dracpu.core.state_values.NodeState.host_pool`), as claims come and go: the state machine
emits :class:`~dracpu.core.effects.ConfineHostCgroups`, which
:mod:`dracpu.adapters.host_cgroups` carries out. This module has no import of the state, so that
the settings (:mod:`dracpu.config`) can check the paths without loading it.

**The pods' cgroup is never listed.** The kubelet holds every pod under one cgroup, the "node
allocatable" cgroup ``<cgroupRoot>/kubepods`` (``pkg/kubelet/cm/node_container_manager_linux.go``
``defaultNodeAllocatableCgroupName``). Its name on the node depends on the kubelet's cgroup driver
(``pkg/kubelet/cm/cgroup_manager_linux.go``): ``kubepods`` with ``cgroupfs`` (``/kubepods``, or
``<cgroupRoot>/kubepods``), and with ``systemd`` a slice named after every component of its path
(``ConvertCgroupNameToSystemd``): ``kubepods.slice``, or ``<root>.slice/<root>-kubepods.slice``
under a ``cgroupRoot`` of ``/<root>.slice``; the QoS and pod cgroups below it are
``kubepods-burstable.slice``, ``kubepods-burstable-pod<uid>.slice``, ... Confining it, or anything
below it, would put every pod, exclusive ones included, on the shared pool. So a path is refused
when one of its components is such a name (:func:`pods_cgroup_name`), and the adapter refuses a
listed cgroup that holds such a cgroup anywhere below it (an ancestor of the pods: kind's
``kubelet.slice``, whose ``kubelet-kubepods.slice`` holds the pods). The name rule is the kubelet's
own naming, so it holds whatever ``cgroupRoot`` the kubelet was given; the walk catches the
ancestors the name of a listed path cannot show.

cgroup v1 requires every cpuset to be a subset of its parent's (the kernel refuses a write that
breaks it, kernel/cgroup/cpuset-v1.c ``validate_change_legacy``: ``EACCES`` for a child wider than
its parent, ``EBUSY`` for a parent narrower than a child; ``ENOSPC`` for an empty cpuset with
tasks), so a subtree is written in two passes (:func:`v1_write_order`): first every cgroup widened
to its old CPUs plus its new ones, parents first; then narrowed to the new ones, children first.
Each cgroup below a listed one keeps the CPUs it held before the confinement that the confinement
leaves (:func:`v1_wanted`), so a service pinned to fewer CPUs stays so. cgroup v2 has no such rule
(a cgroup's ``cpuset.cpus.effective`` is its request within its parent's), so only the listed
cgroups are written there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from dracpu.core.cpuset import CpuSet

__all__ = [
    "check_cgroup_path",
    "check_cgroup_paths",
    "pods_cgroup_name",
    "v1_wanted",
    "v1_write_order",
]

# The kubelet's names of the pods' cgroup and everything below it (the module docstring):
# cgroupfs "kubepods"; systemd "kubepods.slice", "<root>-kubepods.slice" and the QoS / pod slices
# "kubepods-…" and "<root>-kubepods-…".
_PODS = re.compile(r"kubepods|(?:.+-)?kubepods(?:\.slice|-.+)")
# What a path component may hold: printable, no slash (a cgroup is a directory name).
_BAD_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


def pods_cgroup_name(name: str) -> bool:
    """Is ``name`` (one path component) the kubelet's cgroup of the pods, or one below it?"""
    return _PODS.fullmatch(name) is not None


def check_cgroup_path(text: str) -> str:
    """``text`` as a cgroup path relative to the cgroup root (``system.slice``,
    ``a.slice/b.service``; a leading ``/``, as systemd and the kubelet write cgroup names, is
    taken off), or :class:`ValueError` with the reason: empty, the root itself, ``.`` or
    ``..``, an empty component, a control character, or the pods' cgroup."""
    path = text[1:] if text.startswith("/") else text
    if not path:
        raise ValueError("is the cgroup root, which holds every process (the pods' too)")
    if _BAD_CHARACTER.search(path):
        raise ValueError("holds a control character")
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise ValueError("must be a path below the cgroup root without empty, . or .. parts")
        if pods_cgroup_name(part):
            raise ValueError(
                f"is, or is inside, the kubelet's cgroup of the pods ({part!r}): confining it "
                "would keep the pods off their exclusive CPUs"
            )
    return "/".join(parts)


def check_cgroup_paths(texts: Iterable[str]) -> tuple[str, ...]:
    """The paths checked (:func:`check_cgroup_path`), or :class:`ValueError` naming the bad
    one; a path listed twice, or inside another listed one, is refused too (the outer one's
    confinement already covers it, and on cgroup v1 the two would be written against each
    other)."""
    paths: list[str] = []
    for text in texts:
        try:
            path = check_cgroup_path(text)
        except ValueError as exc:
            raise ValueError(f"{text!r} {exc}") from None
        for other in paths:
            if other == path:
                raise ValueError(f"{text!r} is listed twice")
            inner, outer = (path, other) if path.startswith(f"{other}/") else (other, path)
            if inner.startswith(f"{outer}/"):
                raise ValueError(f"{inner!r} is inside {outer!r}, which is listed too")
        paths.append(path)
    return tuple(paths)


def _depth(path: str) -> int:
    return path.count("/")


def v1_wanted(listed: str, target: CpuSet, found: Mapping[str, CpuSet]) -> dict[str, CpuSet]:
    """The cpuset each cgroup of a listed v1 subtree is to hold: ``target`` for ``listed``;
    for a cgroup below it, the CPUs it held before dracpu confined it that its parent's new
    cpuset keeps, or all of the parent's when that keeps none of them (a v1 cpuset with tasks
    cannot be empty). ``found``: every cgroup of the subtree (``listed`` and the paths below
    it) and what it held before the first confinement, so that a widening gives back what a
    narrowing took."""
    wanted: dict[str, CpuSet] = {}
    for path in sorted(found, key=_depth):
        if path == listed:
            wanted[path] = target
            continue
        parent = wanted[path.rpartition("/")[0]]
        wanted[path] = (found[path] & parent) or parent
    return wanted


def v1_write_order(
    current: Mapping[str, CpuSet], wanted: Mapping[str, CpuSet]
) -> list[tuple[str, CpuSet]]:
    """The writes that take a v1 subtree from ``current`` to ``wanted`` keeping every cpuset
    within its parent's at each step: widen (old plus new CPUs) parents first, then narrow to
    the new CPUs children first. A cgroup already at its value is not written."""
    paths: Sequence[str] = sorted(wanted, key=_depth)
    writes: list[tuple[str, CpuSet]] = []
    between: dict[str, CpuSet] = {}
    for path in paths:
        now = current[path]
        between[path] = now | wanted[path]
        if between[path] != now:
            writes.append((path, between[path]))
    for path in reversed(paths):
        if wanted[path] != between[path]:
            writes.append((path, wanted[path]))
    return writes
