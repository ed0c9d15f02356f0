"""What confining the host cgroups adds to a command that changes the shared pool.

Run: ``.venv/bin/python bench/bench_host_cgroups.py`` (as root for the cgroup v1 figures). Figures
(ms, p50/p99) of :meth:`dracpu.adapters.host_cgroups.HostCgroups.confine`, the effect a Prepare or
an Unprepare runs after its checkpoint when host cgroups are listed, the pool alternating between
two values so that every call writes:

* ``host_cgroups.v2_fake_1``: one listed cgroup on a fake cgroup v2 tree (tmpfs files: the
  adapter's own cost, without the kernel's);
* ``host_cgroups.v1_real_2`` / ``host_cgroups.v1_real_noop``: one listed cgroup with one cgroup
  below it, a ``sleep`` in each, on this machine's cgroup v1 cpuset hierarchy (the kernel moves
  the tasks; the test trees of ``tests/cgroups_v1.py``); the same with an unchanged pool (reads
  only: the 10 s check while all is well). Left out, saying why, when not root or without a v1
  cpuset hierarchy.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import emit, measure
from dracpu.adapters.host_cgroups import HostCgroups
from dracpu.core.cpuset import CpuSet
from tests.cgroups_v1 import CGROUP_ROOT, v1_tree, why_not

__all__ = ["main"]

SAMPLES = 500


def _fake_v2(root: Path) -> None:
    for name, content in {
        "cgroup.controllers": "cpuset cpu memory\n",
        "cgroup.subtree_control": "cpuset cpu memory\n",
        "system.slice/cgroup.controllers": "cpuset cpu memory\n",
        "system.slice/cgroup.subtree_control": "\n",
        "system.slice/cpuset.cpus": "\n",
    }.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


def _alternating(cgroups: HostCgroups, listed: str, a: CpuSet, b: CpuSet) -> Callable[[], None]:
    targets = iter([a, b] * (SAMPLES + 10))
    return lambda: cgroups.confine((listed,), next(targets))


def main() -> None:
    tmpfs = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = Path(tempfile.mkdtemp(prefix="dracpu-bench-", dir=tmpfs))
    try:
        _fake_v2(work / "cgroup")
        cgroups = HostCgroups(work / "cgroup", work / "state" / "host-cgroups.json")
        alternate = _alternating(
            cgroups, "system.slice", CpuSet.parse("0-63"), CpuSet.parse("2-63")
        )
        measure("host_cgroups.v2_fake_1", alternate, n=SAMPLES)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    reason = why_not()
    if reason is not None:
        emit("host_cgroups.v1_real_2", "ms", skipped=reason)
        return
    with v1_tree(["host", "host/svc"]) as tree, tempfile.TemporaryDirectory() as state:
        cgroups = HostCgroups(CGROUP_ROOT, Path(state) / "host-cgroups.json")
        listed, machine = tree.path("host"), tree.cpus("host")
        fewer = machine - CpuSet([machine.min()])
        alternate = _alternating(cgroups, listed, machine, fewer)
        measure("host_cgroups.v1_real_2", alternate, n=SAMPLES)
        measure("host_cgroups.v1_real_noop", lambda: cgroups.confine((listed,), fewer), n=SAMPLES)
        cgroups.release()


if __name__ == "__main__":
    main()
