"""What the kind e2e tests do to and read from the cluster, on top of :class:`Kubectl`.

:class:`Cluster` starts pods and waits for them (failing at once when a pod can never start),
reads what a container was given (:meth:`Cluster.observe`), finds a node's dracpu pod, slices and
the capacity its claims consume, and waits for a container's cpus to become what the test
expects, optionally "poking" the node (starting a pod there) to cause the container event after
which a runtime without unsolicited updates gets its shared containers widened.

:class:`NodeFacts` is what a probe pod read from a node's sysfs, with the CPU sets the driver's
behaviour is defined by: allocatable (online minus reserved) and shareable (allocatable minus
isolated: the shared pool while no claim holds CPUs).
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from tests.e2e import kube as kube_module
from tests.e2e.kube import (
    Kubectl,
    KubectlError,
    format_cpulist,
    parse_cpulist,
    parse_quantity,
    poll,
)
from tests.e2e.workloads import (
    CLAIM_REQUEST,
    CPU_CAPACITY,
    DRIVER,
    OBSERVE,
    WORK_CONTAINER,
    probe_pod,
    shared_pod,
)

__all__ = [
    "DAEMON_CONTAINER",
    "DAEMON_NAMESPACE",
    "NAMESPACE_LABEL",
    "Cluster",
    "NodeFacts",
    "Observed",
    "Target",
    "claim_result",
    "claim_size",
    "fits",
    "grouped_device_numa",
]

# deploy/kustomize/base: the DaemonSet's namespace, pod label and container name.
DAEMON_NAMESPACE = "dracpu"
DAEMON_SELECTOR = "app.kubernetes.io/name=dracpu"
DAEMON_CONTAINER = "dracpu"
# Grouped-mode device names by NUMA node (docs/devices.md): cpudevnuma000, cpudevnuma001, ...
_NUMA_DEVICE = re.compile(r"^cpudevnuma(\d{3,})$")
# The daemon's log line when the runtime configures its NRI plugin (src/dracpu/tasks/nri_plugin.py,
# NriPlugin._configure): "...; unsolicited updates on" or "... off (shared containers widen at
# the next event)". The suite needs it to know which widening to expect.
_UNSOLICITED_MODE = re.compile(r"unsolicited updates\W+(on|off)\b")
# Label of every namespace the suite creates, so leftovers can be found and deleted.
NAMESPACE_LABEL = "dracpu-e2e"
# Waiting reasons after which a container will not start without someone changing something.
_FATAL_WAITING = frozenset(
    {
        "CreateContainerError",
        "CreateContainerConfigError",
        "RunContainerError",
        "CrashLoopBackOff",
        "ErrImageNeverPull",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
    }
)
# How long a pod of this suite may take to start: scheduling, claim allocation, Prepare, CDI,
# NRI; seconds on an idle kind node, but CI machines are slow and shared.
START_TIMEOUT = 180.0


@dataclass(frozen=True)
class NodeFacts:
    """A node's CPUs as its sysfs shows them, and the driver's reserved CPUs."""

    name: str
    online: frozenset[int]
    isolated: frozenset[int]
    numa: Mapping[int, frozenset[int]]  # NUMA node -> its online CPUs
    reserved: frozenset[int]
    probe_allowed: frozenset[int]  # the probe pod's own Cpus_allowed_list (no claims held)

    @property
    def allocatable(self) -> frozenset[int]:
        """What the driver publishes: online CPUs minus the reserved ones."""
        return self.online - self.reserved

    @property
    def shareable(self) -> frozenset[int]:
        """The shared pool while nothing is claimed: allocatable minus isolated CPUs."""
        return self.allocatable - self.isolated

    def grouped_devices(self) -> dict[str, tuple[int, int]]:
        """The grouped-by-NUMA devices the driver must publish: name -> (NUMA node, CPUs)."""
        devices: dict[str, tuple[int, int]] = {}
        for node, cpus in sorted(self.numa.items()):
            count = len(cpus & self.allocatable)
            if count:  # a group without allocatable CPUs is not published (docs/devices.md)
                devices[f"cpudevnuma{node:03d}"] = (node, count)
        return devices

    @classmethod
    def from_probe(cls, name: str, probe: Mapping[str, Any], reserved: frozenset[int]) -> NodeFacts:
        online = parse_cpulist(probe["online"])
        numa = {int(k): parse_cpulist(v) & online for k, v in probe["numa"].items()}
        if not numa:  # a kernel without NUMA: every CPU is on node 0
            numa = {0: online}
        return cls(
            name=name,
            online=online,
            isolated=parse_cpulist(probe["isolated"]),
            numa=numa,
            reserved=reserved,
            probe_allowed=parse_cpulist(probe["allowed"]),
        )


@dataclass(frozen=True)
class Observed:
    """What one container was given, seen from inside it."""

    self_cpus: frozenset[int]  # Cpus_allowed_list of the process kubectl exec started
    pid1_cpus: frozenset[int]  # Cpus_allowed_list of the container's own process
    dra: Mapping[str, str]  # DRA_CPUSET_* entries of the container's environment

    def __str__(self) -> str:
        return (
            f"self={format_cpulist(self.self_cpus)!r} pid1={format_cpulist(self.pid1_cpus)!r} "
            f"dra={dict(self.dra)}"
        )


@dataclass(frozen=True)
class Target:
    """The node the workload tests run on, every node's facts, and the CPUs per claim."""

    node: NodeFacts
    nodes: Mapping[str, NodeFacts]
    size: int

    @property
    def room_for_two_claims(self) -> bool:
        """Do two claims of ``size`` CPUs and a shared CPU fit on the node at once?"""
        return fits(self.node, self.size, claims=2)

    @property
    def room_for_two_cpu_claim(self) -> bool:
        """Does one claim of 2 CPUs from one device, and a shared CPU, fit on the node?"""
        return fits(self.node, 2, claims=1)


def fits(node: NodeFacts, size: int, *, claims: int) -> bool:
    """Do ``claims`` claims of ``size`` CPUs each fit in the node's NUMA groups and leave a CPU
    for the shared pool (dracpu refuses a claim that would empty it while shared containers
    run, and its own pod is one)?"""
    capacities = [count for _, count in node.grouped_devices().values()]
    return sum(c // size for c in capacities) >= claims and len(node.shareable) >= size * claims + 1


def claim_size(node: NodeFacts) -> int:
    """CPUs per exclusive claim: 2 when two such claims fit in the node's NUMA groups with a
    CPU left for the shared pool, else 1. Raises when not even one 1-CPU claim and a shared CPU
    fit (2 shareable CPUs): the tests that need more (two claims at once, a 2-CPU claim) skip,
    saying so, on a node that has only that (the local cluster's 2-CPU machine)."""
    if not fits(node, 1, claims=1):
        raise AssertionError(
            f"node {node.name} has too few CPUs for the e2e suite: online "
            f"{format_cpulist(node.online)!r}, reserved {format_cpulist(node.reserved)!r}, "
            f"isolated {format_cpulist(node.isolated)!r}; it needs 2 shareable CPUs"
        )
    return 2 if fits(node, 2, claims=2) else 1


def claim_result(claim: Mapping[str, Any], node: str) -> dict[str, Any]:
    """The one allocation result of our driver in the claim, checked to be on ``node``."""
    allocation = (claim.get("status") or {}).get("allocation")
    assert allocation, f"claim {claim['metadata']['name']} is not allocated"
    results = [r for r in allocation["devices"]["results"] if r.get("driver") == DRIVER]
    assert len(results) == 1, f"expected one result of {DRIVER}: {results}"
    (result,) = results
    assert result["pool"] == node, f"allocated from pool {result['pool']}, not node {node}"
    assert result["request"] == CLAIM_REQUEST
    return dict(result)


def grouped_device_numa(device: str) -> int:
    """``cpudevnuma003`` -> 3."""
    match = _NUMA_DEVICE.match(device)
    if match is None:
        raise AssertionError(f"device {device!r} is not a grouped-by-NUMA device of {DRIVER}")
    return int(match.group(1))


class Cluster:
    """The kind cluster under test."""

    def __init__(self, kube: Kubectl, artifacts: Path) -> None:
        self.kube = kube
        self.artifacts = artifacts
        self._pokes = itertools.count(1)

    # --- setting up -----------------------------------------------------------------------

    def wait_deployed(self, *, timeout: float) -> None:
        """Wait until every node has a Ready dracpu pod and ResourceSlices of our driver."""
        nodes = self.node_names()
        assert nodes, "the cluster has no nodes"
        for node in nodes:
            self.ready_daemon(node, timeout=timeout)
        for node in nodes:
            poll(
                partial(self.slices, node),
                bool,
                timeout=timeout,
                what=f"ResourceSlices of driver {DRIVER} for node {node}",
            )

    def discover(self, reserved: frozenset[int], *, node: str | None = None) -> Target:
        """Probe every node's CPUs (one pod each, in a namespace deleted afterwards) and pick
        the node the workload tests use: ``node``, or the first worker by name."""
        namespace = self.create_namespace("probe")
        nodes: dict[str, NodeFacts] = {}
        try:
            for index, name in enumerate(self.node_names()):
                log = self.run_to_completion(probe_pod(f"probe-{index}", namespace, name))
                nodes[name] = NodeFacts.from_probe(name, json.loads(log), reserved)
        except BaseException:
            self.dump(self.artifacts / namespace, namespace, self.node_names())
            raise
        finally:
            self.kube.delete("namespace", namespace, timeout=300)
        chosen = node or next(iter(self.worker_names() or self.node_names()))
        assert chosen in nodes, f"node {chosen!r} is not in the cluster ({sorted(nodes)})"
        return Target(node=nodes[chosen], nodes=nodes, size=claim_size(nodes[chosen]))

    def create_namespace(self, hint: str) -> str:
        """A new namespace named after ``hint`` with a random suffix; its name."""
        slug = re.sub(r"[^a-z0-9]+", "-", hint.lower()).strip("-")[:40].rstrip("-")
        name = f"e2e-{slug}-{secrets.token_hex(3)}"
        self.kube.create(
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": name, "labels": {NAMESPACE_LABEL: "true"}},
            }
        )
        return name

    # --- nodes and the daemon -------------------------------------------------------------

    def node_names(self) -> list[str]:
        return sorted(n["metadata"]["name"] for n in self.kube.items("nodes"))

    def worker_names(self) -> list[str]:
        return sorted(
            n["metadata"]["name"]
            for n in self.kube.items("nodes")
            if "node-role.kubernetes.io/control-plane" not in n["metadata"].get("labels", {})
        )

    def runtime_version(self, node: str) -> str:
        """``containerd://2.3.1`` and the like."""
        version: str = self.kube.get("node", node)["status"]["nodeInfo"]["containerRuntimeVersion"]
        return version

    def daemon_pods(self, node: str) -> list[dict[str, Any]]:
        """The node's dracpu pods that are not being deleted."""
        return [
            pod
            for pod in self.kube.items(
                "pods",
                "-n",
                DAEMON_NAMESPACE,
                "-l",
                DAEMON_SELECTOR,
                "--field-selector",
                f"spec.nodeName={node}",
            )
            if not pod["metadata"].get("deletionTimestamp")
        ]

    def ready_daemon(self, node: str, *, timeout: float = START_TIMEOUT, not_uid: str = "") -> str:
        """Wait for the node's dracpu pod (other than ``not_uid``) to be Ready; its name."""

        def ready() -> list[str]:
            return [
                pod["metadata"]["name"]
                for pod in self.daemon_pods(node)
                if pod["metadata"]["uid"] != not_uid and _is_ready(pod)
            ]

        names = poll(ready, bool, timeout=timeout, what=f"a Ready dracpu pod on node {node}")
        return names[0]

    def daemon_exec(self, node: str, *command: str, timeout: float = 60.0) -> str:
        """Run ``command`` in the node's Ready dracpu container; its stdout."""
        pod = self.ready_daemon(node)
        return self.kube.run(
            "exec",
            "-n",
            DAEMON_NAMESPACE,
            pod,
            "-c",
            DAEMON_CONTAINER,
            "--",
            *command,
            timeout=timeout,
        )

    def checkpoint(self, node: str) -> dict[str, dict[str, Any]]:
        """The claims in the node's dracpu checkpoint, by claim UID, as its gatherinfo report
        shows them (read by the running daemon's own command from the state directory)."""
        report = yaml.safe_load(self.daemon_exec(node, "/dracpu", "gatherinfo", "--stdout"))
        claims = report["dracpu"]["checkpoint"]["claims"]
        return {claim["uid"]: claim for claim in claims}

    def restart_daemons(self, *, timeout: float = START_TIMEOUT) -> None:
        """A rolling update of the DaemonSet (``kubectl rollout restart``), waited out."""
        self.kube.run("rollout", "restart", "-n", DAEMON_NAMESPACE, "daemonset/dracpu")
        self.kube.run(
            "rollout",
            "status",
            "-n",
            DAEMON_NAMESPACE,
            "daemonset/dracpu",
            f"--timeout={int(timeout)}s",
            timeout=timeout + 30,
        )

    def daemon_logs(self, node: str) -> str:
        pods = self.daemon_pods(node)
        if not pods:
            return ""
        return self.kube.logs(DAEMON_NAMESPACE, pods[0]["metadata"]["name"], DAEMON_CONTAINER)

    def widens_at_once(self, node: str) -> bool:
        """Does the node's daemon widen shared containers at Unprepare (unsolicited NRI
        updates), or at the next container event? Read from its log, as the daemon decided it
        from the runtime's name and NRI version; checked against the node's containerd."""

        def modes() -> list[str]:
            return _UNSOLICITED_MODE.findall(self.daemon_logs(node))

        found = poll(
            modes,
            bool,
            timeout=60,
            what=(
                f"the dracpu pod on {node} to log its NRI configuration ('unsolicited updates "
                "on|off'): is NRI enabled in the node's containerd (kind-config.yaml)?"
            ),
        )
        at_once = found[-1] == "on"
        runtime = self.runtime_version(node)
        match = re.match(r"^containerd://v?(\d+)\.(\d+)", runtime)
        if at_once and match is not None and (int(match[1]), int(match[2])) < (2, 3):
            raise AssertionError(
                f"the daemon on {node} sends unsolicited NRI updates to {runtime}, whose NRI "
                "(< v0.12.1) can deadlock on them"
            )
        return at_once

    # --- slices and claims -----------------------------------------------------------------

    def slices(self, node: str) -> list[dict[str, Any]]:
        """The node's ResourceSlices of our driver."""
        return [
            s
            for s in self.kube.items("resourceslices")
            if s["spec"].get("driver") == DRIVER and s["spec"].get("nodeName") == node
        ]

    def devices(self, node: str) -> dict[str, dict[str, Any]]:
        """The devices of the node's pool at its newest generation, by name."""
        slices = self.slices(node)
        if not slices:
            return {}
        generation = max(s["spec"]["pool"]["generation"] for s in slices)
        return {
            d["name"]: d
            for s in slices
            if s["spec"]["pool"]["generation"] == generation
            for d in s["spec"].get("devices", [])
        }

    def free_capacity(self, node: str) -> dict[str, Fraction]:
        """Per device of the node: its ``dra.cpu/cpu`` capacity minus what allocated claims
        (in every namespace) consume from it, as the scheduler counts it."""
        free = {
            name: parse_quantity(device["capacity"][CPU_CAPACITY]["value"])
            for name, device in self.devices(node).items()
        }
        for claim in self.kube.items("resourceclaims", "-A"):
            allocation = (claim.get("status") or {}).get("allocation") or {}
            for result in (allocation.get("devices") or {}).get("results") or []:
                if result.get("driver") == DRIVER and result.get("pool") == node:
                    consumed = (result.get("consumedCapacity") or {}).get(CPU_CAPACITY)
                    if consumed is not None and result["device"] in free:
                        free[result["device"]] -= parse_quantity(consumed)
        return free

    def claim_of(self, namespace: str, pod: str) -> dict[str, Any]:
        """The ResourceClaim the pod's (only) claim entry was given."""
        statuses = self.kube.get("pod", pod, "-n", namespace)["status"].get(
            "resourceClaimStatuses", []
        )
        names = [s["resourceClaimName"] for s in statuses if s.get("resourceClaimName")]
        if len(names) != 1:
            raise AssertionError(f"pod {namespace}/{pod} has claims {names}, expected one")
        claim: dict[str, Any] = self.kube.get("resourceclaim", names[0], "-n", namespace)
        return claim

    def events(
        self,
        namespace: str,
        name: str,
        *,
        reason: str | None = None,
        kind: str | None = None,
        text: str | None = None,
    ) -> list[dict[str, Any]]:
        """Events about the object ``name`` in ``namespace`` (oldest first), optionally only
        those with this ``reason``, of this type (``kind``: Normal, Warning), or whose message
        contains ``text``."""
        events = [
            e
            for e in self.kube.items("events", "-n", namespace)
            if e.get("involvedObject", {}).get("name") == name
            and (reason is None or e.get("reason") == reason)
            and (kind is None or e.get("type") == kind)
            and (text is None or text in e.get("message", ""))
        ]
        return sorted(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")

    # --- pods ------------------------------------------------------------------------------

    def create(self, obj: Mapping[str, Any]) -> None:
        self.kube.create(obj)

    def start(self, pod: Mapping[str, Any], *, timeout: float = START_TIMEOUT) -> dict[str, Any]:
        """Create the pod and wait until all its containers are ready."""
        self.kube.create(pod)
        return self.wait_running(pod["metadata"]["namespace"], pod["metadata"]["name"], timeout)

    def wait_running(self, namespace: str, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            pod: dict[str, Any] = self.kube.get("pod", name, "-n", namespace)
            status = pod.get("status", {})
            if status.get("phase") == "Running" and _is_ready(pod):
                return pod
            problem = _fatal(pod)
            if problem is None and status.get("phase") in ("Failed", "Succeeded"):
                problem = f"phase {status['phase']}"
            if problem is None and time.monotonic() >= deadline:
                problem = f"not running after {timeout:.0f}s (phase {status.get('phase')})"
            if problem is not None:
                raise AssertionError(
                    f"pod {namespace}/{name} will not run: {problem}\n"
                    f"{self._describe_events(namespace, name)}"
                )
            time.sleep(kube_module.POLL_INTERVAL)

    def run_to_completion(self, pod: Mapping[str, Any], *, timeout: float = START_TIMEOUT) -> str:
        """Create a ``restartPolicy: Never`` pod, wait until it succeeded; its log."""
        namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self.kube.create(pod)

        def phase() -> str:
            found: dict[str, Any] = self.kube.get("pod", name, "-n", namespace)
            problem = _fatal(found)
            current = str(found.get("status", {}).get("phase", ""))
            if problem is not None or current == "Failed":
                raise AssertionError(
                    f"pod {namespace}/{name} failed: {problem or current}\n"
                    f"{self._describe_events(namespace, name)}"
                )
            return current

        poll(phase, lambda p: p == "Succeeded", timeout=timeout, what=f"pod {namespace}/{name}")
        (container,) = pod["spec"]["containers"]
        return self.kube.logs(namespace, name, container["name"])

    def wait_container_refused(self, namespace: str, name: str, timeout: float) -> str:
        """Wait until the pod's container cannot be created (``CreateContainerError``, as when an
        NRI plugin refuses it); the kubelet's message, which carries the runtime's error."""

        def waiting() -> dict[str, Any]:
            pod = self.kube.get("pod", name, "-n", namespace)
            if pod.get("status", {}).get("phase") == "Running":
                raise AssertionError(
                    f"pod {namespace}/{name} is running: its container should have been refused"
                )
            for status in pod.get("status", {}).get("containerStatuses", []):
                state: dict[str, Any] = status.get("state", {}).get("waiting") or {}
                return state
            return {}

        state = poll(
            waiting,
            lambda s: s.get("reason") == "CreateContainerError",
            timeout=timeout,
            what=f"pod {namespace}/{name}'s container to be refused (CreateContainerError)",
        )
        return str(state.get("message", ""))

    def observe(self, namespace: str, pod: str) -> Observed:
        raw = self.kube.exec_python(namespace, pod, WORK_CONTAINER, OBSERVE)
        return Observed(
            self_cpus=parse_cpulist(raw["self"]),
            pid1_cpus=parse_cpulist(raw["pid1"]),
            dra=dict(raw["dra"]),
        )

    def expect_cpus(
        self,
        namespace: str,
        pod: str,
        expected: frozenset[int],
        *,
        timeout: float,
        poke_node: str | None = None,
        poke_every: float = 15.0,
    ) -> Observed:
        """Wait until the container's processes (exec'd and PID 1) may run on exactly
        ``expected``. With ``poke_node``, start a best-effort pod on that node every
        ``poke_every`` seconds while they are not: its creation is a container event, whose
        reply re-pins every shared container to the current shared pool."""
        last_poke = float("-inf")  # the first stale look pokes at once

        def look() -> Observed:
            nonlocal last_poke
            seen = self.observe(namespace, pod)
            stale = seen.self_cpus != expected or seen.pid1_cpus != expected
            if stale and poke_node is not None and time.monotonic() - last_poke >= poke_every:
                self.poke(namespace, poke_node)
                last_poke = time.monotonic()
                seen = self.observe(namespace, pod)
            return seen

        return poll(
            look,
            lambda s: s.self_cpus == expected and s.pid1_cpus == expected,
            timeout=timeout,
            what=f"pod {namespace}/{pod} to run on cpus {format_cpulist(expected)!r}",
        )

    def poke(self, namespace: str, node: str) -> str:
        """Start a best-effort pod on ``node`` (a container event there); its name."""
        name = f"poke-{next(self._pokes)}"
        self.start(shared_pod(name, namespace, node))
        return name

    def exclusive_cpus(self, namespace: str, pod: str) -> frozenset[int]:
        """The cpus of a pod holding one claim, after checking that its env names exactly that
        claim and that its processes run on exactly the env's cpus."""
        uid = self.claim_of(namespace, pod)["metadata"]["uid"]
        seen = self.observe(namespace, pod)
        key = f"DRA_CPUSET_{uid}"
        assert list(seen.dra) == [key], f"{namespace}/{pod}: env {dict(seen.dra)}, expected {key}"
        cpus = parse_cpulist(seen.dra[key])
        assert seen.self_cpus == cpus, f"{namespace}/{pod}: {seen}: exec'd process not on {key}"
        assert seen.pid1_cpus == cpus, f"{namespace}/{pod}: {seen}: PID 1 not on {key}"
        return cpus

    def delete_pod(self, namespace: str, name: str) -> None:
        self.kube.delete("pod", name, namespace=namespace)

    # --- diagnostics -----------------------------------------------------------------------

    def _describe_events(self, namespace: str, name: str) -> str:
        try:
            lines = [
                f"  {e.get('type')} {e.get('reason')}: {e.get('message', '').strip()}"
                for e in self.events(namespace, name)
            ]
        except KubectlError as exc:
            return f"(events unavailable: {exc})"
        return "events:\n" + "\n".join(lines) if lines else "no events"

    def dump(self, directory: Path, namespace: str, nodes: list[str]) -> None:
        """Save what explains a failure in ``namespace``: pods, events, claims, daemon logs."""
        directory.mkdir(parents=True, exist_ok=True)
        kube = self.kube
        kube.save(directory / "pods.txt", "describe", "pods", "-n", namespace)
        kube.save(directory / "events.txt", "get", "events", "-n", namespace, "-o", "wide")
        kube.save(
            directory / "resourceclaims.yaml",
            "get",
            "resourceclaims",
            "-n",
            namespace,
            "-o",
            "yaml",
        )
        kube.save(directory / "resourceslices.yaml", "get", "resourceslices", "-o", "yaml")
        try:
            daemons = [
                pod
                for node in nodes
                for pod in kube.items(
                    "pods", "-n", DAEMON_NAMESPACE, "--field-selector", f"spec.nodeName={node}"
                )
            ]
        except KubectlError as exc:
            (directory / "daemon-pods.txt").write_text(f"# {exc}\n")
            daemons = []
        for pod in daemons:
            name = pod["metadata"]["name"]
            log = directory / f"{name}.log"
            kube.save(log, "logs", "-n", DAEMON_NAMESPACE, name, "-c", DAEMON_CONTAINER)
        summary = directory / "summary.json"
        summary.write_text(json.dumps({"namespace": namespace, "nodes": nodes}, indent=2))


def _is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _fatal(pod: Mapping[str, Any]) -> str | None:
    for status in pod.get("status", {}).get("containerStatuses", []):
        waiting = status.get("state", {}).get("waiting") or {}
        if waiting.get("reason") in _FATAL_WAITING:
            return (
                f"container {status.get('name')}: {waiting['reason']}: {waiting.get('message', '')}"
            )
    return None
