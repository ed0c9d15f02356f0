"""The debug dump: on SIGUSR1 the daemon writes what only its memory holds, for ``gatherinfo``.

``dracpu gatherinfo`` runs as a second process (``kubectl exec ... /dracpu gatherinfo``). The
checkpoint and the CDI specs are files it reads itself; the pins last sent to the runtime, the
containers the runtime reported, what each listed host cgroup is confined to (or why not) and
the recent log lines are not. It signals the daemon with
SIGUSR1 (only when the daemon catches it: the default action of SIGUSR1 ends a process) and
reads ``<state-dir>/debug-dump.json``, which this task writes at each signal (atomically: a
temporary file renamed over it, mode 0600; not fsynced, it is no record). Nothing is written
without a signal. A dump that cannot be written is logged and the task goes on.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus

from dracpu.adapters.host_cgroups import CgroupState
from dracpu.core.state import NodeState
from dracpu.logs import recent_lines

__all__ = ["DUMP_FILE", "DUMP_SIGNAL", "run", "snapshot"]

logger = logging.getLogger(__name__)

# The dump's name in --state-dir, and the signal that asks for it (SIGUSR1 is the signal
# daemons conventionally give to "dump your state").
DUMP_FILE = "debug-dump.json"
DUMP_SIGNAL = signal.SIGUSR1


def snapshot(
    state: NodeState | None,
    log: list[str],
    now: float,
    host_cgroups: Sequence[CgroupState] = (),
) -> dict[str, object]:
    """The dump's content: the prepared claims, every container with the cpuset and memory
    nodes last sent for it (``cpus`` empty: none sent yet), the shared pool, the listed host
    cgroups (what each is confined to, or why not) and ``log``."""
    dump: dict[str, object] = {
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "pid": os.getpid(),
    }
    if state is None:
        dump["state"] = "not restored yet"
    else:
        dump["sharedPool"] = str(state.shared_pool)
        dump["claims"] = [
            {
                "uid": uid,
                "namespace": claim.namespace,
                "name": claim.name,
                "cpus": str(claim.cpus),
                "mems": None if claim.mems is None else str(claim.mems),
                "podUids": sorted(claim.pod_uids),
                "podNames": sorted(claim.pod_names),
                "copierPods": sorted(claim.copiers),
                "sharedPool": claim.shared_pool,
            }
            for uid, claim in sorted(state.claims.items())
        ]
        dump["containers"] = [
            {
                "id": cid,
                "pod": f"{record.container.pod_namespace}/{record.container.pod_name}",
                "podUID": record.container.pod_uid,
                "name": record.container.name,
                "claims": list(record.claims),
                "cpus": str(record.cpus),
                "mems": None if record.mems is None else str(record.mems),
            }
            for cid, record in sorted(state.containers.items())
        ]
    dump["hostCgroups"] = [
        {
            "cgroup": cgroup.path,
            "confinedTo": None if cgroup.cpus is None else str(cgroup.cpus),
            "problem": cgroup.problem,
        }
        for cgroup in host_cgroups
    ]
    dump["recentLog"] = log
    return dump


def _write(path: Path, dump: dict[str, object]) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump(dump, out, indent=1)
    os.replace(temporary, path)


async def run(
    state: Callable[[], NodeState | None],
    path: Path,
    *,
    host_cgroups: Callable[[], Sequence[CgroupState]] = tuple,
    task_status: TaskStatus[None] = TASK_STATUS_IGNORED,
) -> None:
    """Write the dump to ``path`` at every SIGUSR1 until cancelled; ``state`` gives the node
    state (``None`` before it is restored), ``host_cgroups`` the listed host cgroups. Ready
    once SIGUSR1 is caught.

    Resource handling: the signal handler is removed on exit (SIGUSR1 kills the process
    again). Error handling: a failed write is logged, never raised.
    """
    with anyio.open_signal_receiver(DUMP_SIGNAL) as signals:
        task_status.started()
        async for _ in signals:
            dump = snapshot(state(), recent_lines(), time.time(), host_cgroups())
            try:
                await anyio.to_thread.run_sync(_write, path, dump)
            except OSError as exc:
                logger.warning("cannot write the debug dump %s: %s", path, exc)
            else:
                logger.info("debug dump written to %s", path)
