"""Real cgroup v1 cpusets for the host-cgroup tests: cgroups made under a test parent of this
machine's ``/sys/fs/cgroup/cpuset``, each with a live ``sleep`` in it, and always removed.

:func:`v1_tree` skips (saying why: :func:`why_not`) when the test cannot run here: not root, no
v1 cpuset hierarchy (a cgroup v2 node), fewer than 2 CPUs in the root cpuset.
``bench/bench_host_cgroups.py`` uses the same trees.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dracpu.core.cpuset import CpuSet

__all__ = ["CGROUP_ROOT", "V1Tree", "allowed_cpus", "v1_tree", "why_not"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
CPUSET = CGROUP_ROOT / "cpuset"


def allowed_cpus(pid: int) -> CpuSet:
    """The CPUs the kernel lets ``pid`` run on (``Cpus_allowed_list`` of its status, proc(5))."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return CpuSet.parse(line.split(":", 1)[1])
    raise AssertionError(f"no Cpus_allowed_list in /proc/{pid}/status")


@dataclass
class V1Tree:
    """The test parent (``parent``: its path under the cpuset hierarchy), its cgroups (path
    under the parent -> directory) and the pid of the ``sleep`` in each."""

    parent: str
    cgroups: dict[str, Path] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)

    def path(self, name: str) -> str:
        """``name`` as a path under the hierarchy's root (what dracpu is told to confine)."""
        return f"{self.parent}/{name}"

    def cpus(self, name: str) -> CpuSet:
        return CpuSet.parse((self.cgroups[name] / "cpuset.cpus").read_text())

    def allowed(self, name: str) -> CpuSet:
        return allowed_cpus(self.pids[name])


def why_not() -> str | None:
    """Why real cgroup v1 cpusets cannot be made here (``None``: they can)."""
    if os.geteuid() != 0:
        return "the real cgroup v1 test writes cpusets: it needs root"
    if not (CPUSET / "cpuset.cpus").is_file():
        return f"no cgroup v1 cpuset hierarchy at {CPUSET} (a cgroup v2 node)"
    if len(CpuSet.parse((CPUSET / "cpuset.cpus").read_text())) < 2:
        return "the root cpuset has fewer than 2 CPUs: nothing could move"
    return None


@contextlib.contextmanager
def v1_tree(children: Sequence[str]) -> Iterator[V1Tree]:
    """A test parent ``dracpu-test-<random>`` under the cpuset hierarchy with the root's CPUs
    and memory nodes, the cgroups ``children`` (paths under it, parents listed first) with the
    same, and a ``sleep`` in each; everything is killed and removed on exit."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    tree = V1Tree(f"dracpu-test-{uuid.uuid4().hex[:8]}")
    top = CPUSET / tree.parent
    cpus, mems = ((CPUSET / f"cpuset.{what}").read_text().strip() for what in ("cpus", "mems"))
    sleeps: list[subprocess.Popen[bytes]] = []
    made: list[Path] = []
    try:
        for name, directory in [("", top), *((c, top / c) for c in children)]:
            directory.mkdir()
            made.append(directory)
            (directory / "cpuset.mems").write_text(mems)
            (directory / "cpuset.cpus").write_text(cpus)
            if name:
                tree.cgroups[name] = directory
        for name, directory in tree.cgroups.items():
            sleep = subprocess.Popen(["sleep", "3600"])
            sleeps.append(sleep)
            (directory / "cgroup.procs").write_text(str(sleep.pid))
            tree.pids[name] = sleep.pid
        yield tree
    finally:
        for sleep in sleeps:
            sleep.kill()
            sleep.wait()
        for directory in reversed(made):
            with contextlib.suppress(OSError):
                directory.rmdir()
