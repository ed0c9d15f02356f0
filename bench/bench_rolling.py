"""The unpinned window of a DaemonSet rolling update, measured on the real local cluster.

While ``kubectl rollout restart daemonset/dracpu`` rolls the driver ``--rolls`` times, pods are
created and deleted without pause: pods of two shared containers (no claim) every
``--interval`` seconds, beside one pod that holds a one-CPU claim from before the first roll to
the end (the node has two CPUs: one claim and the shared pool). A sampler
outside the cluster reads every container's ``cpuset.cpus`` from the host's cgroup v1 cpuset
hierarchy every ``--tick`` seconds (10 ms) and compares it with the CPUs the container must not
use:

* a container of a pod that holds a claim may use only the claim's CPUs (``DRA_CPUSET_<uid>`` of
  the claim's CDI spec, read from the cluster's CDI directory);
* any other container (the shared pods', and dracpu's own) must not use a CPU of a claim whose
  container runs at that moment (a claim prepared but not yet used keeps its CPUs in the shared
  pool until its container is created: dracpu's design, not a window).

A container's unpinned time is the time from the first sample that found it on forbidden CPUs
to the first sample that found it back, summed over such stretches, while its cgroup existed.
Pod sandboxes (a cgroup whose process is ``pause``) are not containers NRI pins and are left
out.

* ``rolling.unpinned``: over the containers created during the rolls (first seen from the first
  ``rollout restart`` until ``--settle`` seconds after the last roll completed): ``max`` and
  ``p99`` of the unpinned time in ms, ``n`` containers, ``unpinned`` how many had any, the
  rolls' durations, ``rolls_with_claim`` (rolls during which a claim's container ran: without
  one no CPU is forbidden to anyone), ``exposed`` (shared containers of the rolls that lived
  while a claim's container ran), the sampler's tick gaps (``tick_p99_ms``, ``tick_max_ms``) and
  the DaemonSet's update strategy;
* ``rolling.unpinned.outside``: the same over the containers created outside the rolls (the
  steady state's noise: a claim's container is pinned in the same reply that narrows the shared
  containers, which the runtime applies a few ms apart), with ``claim_containers`` (the claims'
  containers among them) and ``exposed`` (shared ones that lived beside a claim's container).

``--rolls 0 --duration S --cycle-claim T`` measures the start race instead
(``docs/architecture.md``, "NRI"): no roll, ``S`` seconds of churn, and the claim's pod
replaced every ``T`` seconds (each gone, its claim unprepared, before the next), so that the
claim's container's reply narrows the shared pool again and again while shared containers
start.

Needs: root on the node, the local cluster up with dracpu deployed (``just cluster up``, ``just
cluster deploy``), ``KUBECONFIG`` (``eval "$(just cluster env)"``). Run:
``.venv/bin/python bench/bench_rolling.py [--rolls 3]``; ``--details FILE`` writes every
container's record as JSON. Not a test: nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import emit
from tests.e2e.workloads import claim_template

__all__ = ["main"]

NAMESPACE = "dracpu-rolling"
CPUSET_ROOT = Path("/sys/fs/cgroup/cpuset")
CLUSTER_STATE = Path(os.environ.get("DRACPU_CLUSTER_STATE", "/var/tmp/dracpu-cluster"))
# The kubelet's cgroup root (tests/cluster/cluster: cgroupfs, named after the state dir).
KUBEPODS = CPUSET_ROOT / CLUSTER_STATE.name / "kubepods"
CDI_DIR = CLUSTER_STATE / "host" / "var" / "run" / "cdi"
_CDI_SPEC = re.compile(r"^dra\.k8s\.io-cpu_claim-(?P<uid>[0-9a-f-]+)\.json$")
_POD_DIR = re.compile(r"^pod(?P<uid>[0-9a-f_-]+)$")
# containerd names a container's cgroup by its ID, CRI-O by crio-<ID>.
_CONTAINER_DIR = re.compile(r"^(?:crio-)?(?P<id>[0-9a-f]{64})$")


def _cpus(text: str) -> frozenset[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def _kubectl(*args: str, stdin: str | None = None, timeout: float = 120) -> str:
    done = subprocess.run(
        ["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


# --- what the sampler sees ------------------------------------------------------------------


@dataclass
class Container:
    """One container cgroup as the sampler saw it, judged once the run is over."""

    cid: str
    pod_uid: str
    first_seen: float
    last_seen: float = 0.0
    changes: list[tuple[float, str]] = field(default_factory=list)  # (time, cpuset) on change
    unpinned: float = 0.0  # seconds on CPUs it must not use
    comm: str = ""  # its first process's name (``pause``: a pod sandbox)
    pod: str = ""
    name: str = ""
    claims: list[str] = field(default_factory=list)


class Sampler:
    """Reads every container's cpuset every ``tick`` seconds (in a process of its own, see
    :func:`_sample`); judges afterwards, when every container's pod and claims are known."""

    def __init__(self, tick: float) -> None:
        self.tick = tick
        self.containers: dict[str, Container] = {}
        self.ticks: list[float] = []
        self.claim_cpus: dict[str, frozenset[int]] = {}  # claim UID -> CPUs (its CDI spec)
        self._cdi_names: frozenset[str] = frozenset()

    def run(self, stop: Any) -> None:
        while not stop.is_set():
            now = time.monotonic()
            self.ticks.append(now)
            self._read_cdi()
            for cid, pod_uid, path in self._cgroups():
                try:
                    text = (path / "cpuset.cpus").read_text().strip()
                except OSError:
                    continue
                container = self.containers.get(cid)
                if container is None:
                    container = self.containers[cid] = Container(cid, pod_uid, now)
                container.last_seen = now
                if _starting(container.comm):
                    container.comm = _comm(path)
                if not container.changes or container.changes[-1][1] != text:
                    container.changes.append((now, text))
            time.sleep(max(0.0, self.tick - (time.monotonic() - now)))

    def _read_cdi(self) -> None:
        try:
            names = frozenset(os.listdir(CDI_DIR))
        except OSError:
            return
        if names == self._cdi_names:
            return
        self._cdi_names = names
        for name in names:
            match = _CDI_SPEC.match(name)
            if match is None or match["uid"] in self.claim_cpus:
                continue
            try:
                spec = json.loads((CDI_DIR / name).read_text())
            except (OSError, ValueError):
                self._cdi_names = frozenset()  # read again next tick
                continue
            for device in spec.get("devices", []):
                for env in device.get("containerEdits", {}).get("env", []):
                    key, _, value = env.partition("=")
                    if key.startswith("DRA_CPUSET_"):
                        self.claim_cpus[match["uid"]] = _cpus(value)

    def _cgroups(self) -> list[tuple[str, str, Path]]:
        found: list[tuple[str, str, Path]] = []
        for parent in (KUBEPODS, KUBEPODS / "besteffort", KUBEPODS / "burstable"):
            try:
                entries = list(os.scandir(parent))
            except OSError:
                continue
            for entry in entries:
                pod = _POD_DIR.match(entry.name)
                if pod is None:
                    continue
                try:
                    children = list(os.scandir(entry.path))
                except OSError:
                    continue
                for child in children:
                    container = _CONTAINER_DIR.match(child.name)
                    if container is not None:
                        uid = pod["uid"].replace("_", "-")
                        found.append((container["id"], uid, Path(child.path)))
        return found

    def judge(self, pod_claims: dict[str, list[str]]) -> None:
        """Each container's unpinned time, tick by tick: a claim's container off its claim's
        CPUs, any other container on the CPUs of a claim whose container runs then."""
        # A pod sandbox (its pause process) is no container NRI pins: left out, as is a
        # cgroup that never had a process.
        present = sorted(
            (c for c in self.containers.values() if _judged(c)), key=lambda c: c.first_seen
        )
        for container in present:
            container.claims = pod_claims.get(container.pod_uid, [])
        for i, now in enumerate(self.ticks):
            until = self.ticks[i + 1] if i + 1 < len(self.ticks) else now
            live = [
                (c, _cpus(_at(c.changes, now)))
                for c in present
                if c.first_seen <= now <= c.last_seen
            ]
            in_use: set[int] = set()
            for container, _ in live:
                for claim in container.claims:
                    in_use |= self.claim_cpus.get(claim, frozenset())
            for container, cpus in live:
                if container.claims:
                    allowed = frozenset().union(
                        *(self.claim_cpus.get(c, frozenset()) for c in container.claims)
                    )
                    wrong = bool(allowed) and not cpus <= allowed
                else:
                    wrong = bool(cpus & in_use)
                if wrong:
                    container.unpinned += until - now


def _comm(cgroup: Path) -> str:
    """The name of the cgroup's first process (``""`` while it has none)."""
    try:
        pids = (cgroup / "cgroup.procs").read_text().split()
        return Path(f"/proc/{pids[0]}/comm").read_text().strip() if pids else ""
    except (OSError, IndexError):
        return ""


def _sample(tick: float, stop: Any, results: Any) -> None:
    """The sampler's process: real-time priority where root may have it (SCHED_FIFO), so that
    the busy machine's other work (the churn's kubectl processes, the cluster) does not stretch
    its ticks; its records go back through ``results`` when ``stop`` is set."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except OSError:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, -15)
    sampler = Sampler(tick)
    sampler.run(stop)
    results.send((sampler.containers, sampler.ticks, sampler.claim_cpus))
    results.close()


def _starting(comm: str) -> bool:
    """No process yet, or still runc's (``runc:[2:INIT]``, its re-executed ``exe``) before the
    container's own program replaces it."""
    return not comm or comm.startswith("runc") or comm == "exe"


def _judged(container: Container) -> bool:
    return not _starting(container.comm) and container.comm != "pause"


def _at(changes: list[tuple[float, str]], now: float) -> str:
    """The cpuset a container had at ``now``."""
    value = changes[0][1]
    for when, text in changes:
        if when > now:
            break
        value = text
    return value


# --- the API side ---------------------------------------------------------------------------


def _watch_api(
    names: dict[str, tuple[str, str]], stop: threading.Event, pod_claims: dict[str, list[str]]
) -> None:
    """Every 0.2 s: which pods hold which claims, which containers are whose (kept for good:
    a pod deleted since keeps its last record)."""
    while not stop.is_set():
        try:
            pods = json.loads(_kubectl("get", "pods", "-A", "-o", "json"))["items"]
            claims = json.loads(_kubectl("get", "resourceclaims", "-A", "-o", "json"))["items"]
        except (RuntimeError, subprocess.TimeoutExpired, ValueError):
            time.sleep(0.2)
            continue
        claim_uids = {
            (c["metadata"]["namespace"], c["metadata"]["name"]): c["metadata"]["uid"]
            for c in claims
        }
        for pod in pods:
            meta, status = pod["metadata"], pod.get("status", {})
            uids = [
                claim_uids[key]
                for s in status.get("resourceClaimStatuses", [])
                if (key := (meta["namespace"], s.get("resourceClaimName", ""))) in claim_uids
            ]
            if uids or meta["uid"] not in pod_claims:
                pod_claims[meta["uid"]] = uids
            for kind in ("containerStatuses", "initContainerStatuses"):
                for cs in status.get(kind, []):
                    cid = cs.get("containerID", "").partition("://")[2]
                    if cid:
                        names[cid] = (f"{meta['namespace']}/{meta['name']}", cs["name"])
        time.sleep(0.2)


# --- the workload -----------------------------------------------------------------------------


def _pod(name: str, *, claim: bool) -> dict[str, Any]:
    container = {
        "image": "dracpu:dev",
        "imagePullPolicy": "Never",
        "command": ["sleep", "infinity"],
    }
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 0,
        "hostNetwork": True,
        "tolerations": [{"operator": "Exists"}],
        "restartPolicy": "Never",
    }
    if claim:
        spec["resourceClaims"] = [{"name": "cpus", "resourceClaimTemplateName": "one-cpu"}]
        spec["containers"] = [
            {**container, "name": "work", "resources": {"claims": [{"name": "cpus"}]}}
        ]
    else:
        spec["containers"] = [{**container, "name": "a"}, {**container, "name": "b"}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }


def _apply(obj: dict[str, Any]) -> None:
    _kubectl("apply", "-f", "-", stdin=json.dumps(obj))


def _delete(name: str) -> None:
    _kubectl("delete", "pod", "-n", NAMESPACE, name, "--wait=false", "--ignore-not-found")


def _shared_churn(stop: threading.Event, interval: float, lifetime: float, writer: int) -> None:
    alive: list[tuple[float, str]] = []
    n = 0
    while not stop.is_set():
        n += 1
        name = f"shared-{writer}-{n}"
        try:
            _apply(_pod(name, claim=False))
            alive.append((time.monotonic(), name))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"bench_rolling: {exc}", file=sys.stderr)
        while alive and time.monotonic() - alive[0][0] > lifetime:
            _delete(alive.pop(0)[1])
        stop.wait(interval)
    for _, name in alive:
        _delete(name)


def _hold_claim(stop: threading.Event, ready: threading.Event, cycle: float) -> None:
    """One pod holding a one-CPU claim (the node has two CPUs: one claim and the shared pool):
    for the whole run, so that every roll has a claim in use; or, with ``cycle`` > 0, a new pod
    and claim every ``cycle`` seconds, each deleted and gone (its claim unprepared) before the
    next, so that the shared pool narrows and widens again and again beside the churn."""
    n = 0
    while True:
        n += 1
        name = f"holder-{n}"
        _apply(_pod(name, claim=True))
        while True:
            phase = _kubectl("get", "pod", "-n", NAMESPACE, name, "-o", "jsonpath={.status.phase}")
            if phase == "Running":
                break
            time.sleep(0.5)
        ready.set()
        stop.wait(cycle if cycle > 0 else None)
        _kubectl("delete", "pod", "-n", NAMESPACE, name, "--wait=true", timeout=120)
        if stop.is_set():
            return


def _roll(timeout: int) -> tuple[float, float]:
    start = time.monotonic()
    _kubectl("rollout", "restart", "-n", "dracpu", "daemonset/dracpu")
    _kubectl(
        "rollout",
        "status",
        "-n",
        "dracpu",
        "daemonset/dracpu",
        f"--timeout={timeout}s",
        timeout=timeout + 30,
    )
    return start, time.monotonic()


def _strategy() -> str:
    ds = json.loads(_kubectl("get", "daemonset", "-n", "dracpu", "dracpu", "-o", "json"))
    rolling = ds["spec"]["updateStrategy"].get("rollingUpdate", {})
    return (
        f"maxSurge={rolling.get('maxSurge', 0)},maxUnavailable={rolling.get('maxUnavailable', 1)}"
    )


def _figure(name: str, records: list[Container], **extra: object) -> None:
    times = sorted(c.unpinned * 1000 for c in records)
    if not times:
        emit(name, "ms", n=0, **extra)
        return
    p99 = times[min(len(times) - 1, max(0, round(0.99 * len(times)) - 1))]
    emit(
        name,
        "ms",
        max=round(times[-1], 1),
        p99=round(p99, 1),
        n=len(times),
        unpinned=sum(1 for t in times if t > 0),
        **extra,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rolls", type=int, default=3)
    parser.add_argument("--tick", type=float, default=0.01, help="seconds between samples")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between shared pods")
    parser.add_argument("--writers", type=int, default=2, help="threads creating shared pods")
    parser.add_argument("--lifetime", type=float, default=6.0, help="seconds a shared pod lives")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after the last roll")
    parser.add_argument("--pause", type=float, default=5.0, help="seconds between rolls")
    parser.add_argument("--details", type=Path, help="write every container's record here")
    parser.add_argument(
        "--cycle-claim",
        type=float,
        default=0.0,
        help="seconds each claim's pod lives before the next replaces it (0: one for the run)",
    )
    parser.add_argument(
        "--duration", type=float, default=0.0, help="seconds of churn without rolls (--rolls 0)"
    )
    args = parser.parse_args()
    if not KUBEPODS.is_dir():
        raise SystemExit(f"no {KUBEPODS}: is the local cluster up (just cluster up)?")

    subprocess.run(["kubectl", "create", "namespace", NAMESPACE], capture_output=True, check=False)
    _apply(claim_template("one-cpu", NAMESPACE, "1"))
    fork = multiprocessing.get_context("fork")
    stop_sampler = fork.Event()
    receive, send = fork.Pipe(duplex=False)
    sampling = fork.Process(target=_sample, args=(args.tick, stop_sampler, send), daemon=True)
    sampling.start()
    pod_claims: dict[str, list[str]] = {}
    names: dict[str, tuple[str, str]] = {}
    stop_api, stop_work = threading.Event(), threading.Event()
    api = threading.Thread(target=_watch_api, args=(names, stop_api, pod_claims), daemon=True)
    holding = threading.Event()
    work = [
        threading.Thread(
            target=_hold_claim, args=(stop_work, holding, args.cycle_claim), daemon=True
        ),
        *(
            threading.Thread(
                target=_shared_churn,
                args=(stop_work, args.interval, args.lifetime, writer),
                daemon=True,
            )
            for writer in range(args.writers)
        ),
    ]
    threads = [api, *work]
    for thread in threads:
        thread.start()
    if not holding.wait(300):
        raise SystemExit("bench_rolling: the pod with the claim did not start within 300 s")
    strategy = _strategy()
    started = time.monotonic()
    time.sleep(args.settle)  # the steady state before the first roll
    rolls: list[tuple[float, float]] = []
    for _ in range(args.rolls):
        rolls.append(_roll(300))
        time.sleep(args.pause)
    time.sleep(args.settle if rolls else args.duration)
    stop_work.set()
    for thread in work:
        thread.join()
    time.sleep(2)  # the last containers' records from the API
    stop_api.set()
    api.join()
    stop_sampler.set()
    sampler = Sampler(args.tick)
    sampler.containers, sampler.ticks, sampler.claim_cpus = receive.recv()
    sampling.join()
    for cid, (pod, name) in names.items():
        if cid in sampler.containers:
            sampler.containers[cid].pod, sampler.containers[cid].name = pod, name
    sampler.judge(pod_claims)
    _kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=300)

    # Without rolls every container is outside them; the details count from the churn's start.
    origin = rolls[0][0] if rolls else started
    window_start, window_end = (
        (rolls[0][0], rolls[-1][1] + args.settle) if rolls else (float("inf"), float("inf"))
    )
    judged = [c for c in sampler.containers.values() if _judged(c)]
    during = [c for c in judged if window_start <= c.first_seen <= window_end]
    outside = [c for c in judged if c not in during]
    # Whether the rolls met a claim in use (without one, no CPU is forbidden to anyone).
    claimed = [(c.first_seen, c.last_seen) for c in judged if c.claims]
    rolls_with_claim = sum(
        any(first <= end and last >= start for first, last in claimed) for start, end in rolls
    )
    exposed = sum(
        any(first <= c.last_seen and last >= c.first_seen for first, last in claimed)
        for c in during
        if not c.claims
    )
    gaps = sorted((b - a) * 1000 for a, b in zip(sampler.ticks, sampler.ticks[1:], strict=False))
    tick = {
        "tick_p99_ms": round(gaps[round(0.99 * (len(gaps) - 1))], 1),
        "tick_max_ms": round(gaps[-1], 1),
    }
    if rolls:
        _figure(
            "rolling.unpinned",
            during,
            rolls=len(rolls),
            rolls_with_claim=rolls_with_claim,
            exposed=exposed,
            roll_s=[round(end - start, 1) for start, end in rolls],
            strategy=strategy,
            **tick,
        )
    _figure(
        "rolling.unpinned.outside",
        outside,
        claim_containers=sum(1 for c in outside if c.claims),
        exposed=sum(
            any(first <= c.last_seen and last >= c.first_seen for first, last in claimed)
            for c in outside
            if not c.claims
        ),
        **tick,
    )
    if args.details:
        records = [
            {
                **asdict(c),
                "during": c in during,
                "first_seen": round(c.first_seen - origin, 3),
                "last_seen": round(c.last_seen - origin, 3),
            }
            for c in sampler.containers.values()
        ]
        args.details.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
