"""An in-memory model of a kind cluster running dracpu, answering the kubectl commands the e2e
suite sends. It lets ``tests/test_e2e_assets.py`` run the suite's tests without a cluster, to
check the suite's own logic: that it passes against a cluster behaving as dracpu promises, and
fails against one where dracpu misbehaves (the ``faults``).

It models what the suite observes and nothing more: three nodes sharing one topology, a
scheduler that allocates ``dra.cpu/cpu`` capacity from the NUMA devices (rounding up to whole
CPUs, as the whole-CPU requestPolicy makes it), a kubelet that prepares claims and reports
refusals, and a driver that pins exclusive containers to their claim, keeps the shared containers
on allocatable - claimed - isolated, widens them at Unprepare only with unsolicited updates (else
at the next container creation) and keeps its claims across a restart. Object shapes follow the
Kubernetes API (``resource.k8s.io/v1``, ``v1`` Pod/Event/Node), in the subset the suite reads.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.e2e.kube import Kubectl, KubectlError, format_cpulist, parse_cpulist, parse_quantity
from tests.e2e.workloads import CPU_CAPACITY, DRIVER

__all__ = ["FAULTS", "ModelKubectl"]

NODES = ("dracpu-e2e-control-plane", "dracpu-e2e-worker", "dracpu-e2e-worker2")
CONTROL_PLANE_LABEL = "node-role.kubernetes.io/control-plane"
# Ways the modelled driver can misbehave; each must make some test of the suite fail.
FAULTS = frozenset(
    {
        "hands-out-reserved",  # claims may get the reserved CPU
        "no-shrink",  # shared containers keep claimed CPUs
        "never-widens",  # shared containers never get freed CPUs back
        "forgets-claims-on-restart",  # a restarted daemon lost its claims
        "accepts-spoofed-env",  # a container naming an unknown claim runs
    }
)
_DRA_ENV = re.compile(r"^DRA_CPUSET_(.+)$")


@dataclass
class _Container:
    node: str
    cpus: frozenset[int]
    dra: dict[str, str]
    exclusive: bool


@dataclass
class _Pod:
    obj: dict[str, Any]
    container: _Container | None = None
    claim: str = ""  # name of its generated claim
    logs: str = ""


@dataclass
class _Node:
    name: str
    prepared: dict[str, frozenset[int]] = field(default_factory=dict)  # claim uid -> cpus
    daemon_uid: str = field(default_factory=lambda: str(uuid.uuid4()))


class ModelKubectl(Kubectl):
    """Answers kubectl commands from the model instead of running kubectl."""

    def __init__(
        self,
        *,
        online: str = "0-7",
        numa: Mapping[int, str] | None = None,
        isolated: str = "",
        reserved: str = "0",
        unsolicited: bool = False,
        faults: Sequence[str] = (),
    ) -> None:
        unknown = set(faults) - FAULTS
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}")
        self.faults = frozenset(faults)
        self.online = parse_cpulist(online)
        self.numa = {n: parse_cpulist(c) for n, c in (numa or {0: "0-3", 1: "4-7"}).items()}
        self.isolated = parse_cpulist(isolated)
        self.reserved = parse_cpulist(reserved)
        self.unsolicited = unsolicited
        self.nodes = {name: _Node(name) for name in NODES}
        self.namespaces: set[str] = set()
        self.templates: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], _Pod] = {}
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self._clock = itertools.count(1)
        self.calls: list[tuple[str, ...]] = []

    # --- kubectl ---------------------------------------------------------------------------

    def run(
        self,
        *args: str,
        stdin: str | None = None,
        timeout: float = 60.0,
        check: bool = True,
    ) -> str:
        self.calls.append(args)
        flags, (verb, *rest) = _split(args)
        try:
            if verb == "get":
                return json.dumps(self._get(rest, flags))
            if verb == "create":
                assert stdin is not None
                self._create(json.loads(stdin))
                return ""
            if verb == "delete":
                self._delete(rest[0], rest[1], flags.get("-n"))
                return ""
            if verb == "exec":
                return self._exec(rest[0], flags["-n"])
            if verb == "logs":
                return self._logs(rest[0], flags["-n"])
            if verb == "describe":
                return ""
        except KubectlError:
            if check:
                raise
            return ""
        raise KubectlError(f"model kubectl: unsupported command {args}")

    # --- derived state ---------------------------------------------------------------------

    @property
    def allocatable(self) -> frozenset[int]:
        return self.online - self.reserved

    def pool(self, node: str) -> frozenset[int]:
        held: set[int] = set()
        for cpus in self.nodes[node].prepared.values():
            held |= cpus
        if "no-shrink" in self.faults:
            held = set()
        return self.allocatable - self.isolated - held

    def _devices(self) -> dict[str, tuple[int, frozenset[int]]]:
        devices = {}
        for numa, cpus in sorted(self.numa.items()):
            mine = cpus & self.allocatable
            if mine:
                devices[f"cpudevnuma{numa:03d}"] = (numa, mine)
        return devices

    def _repin_shared(self, node: str) -> None:
        pool = self.pool(node)
        for pod in self.pods.values():
            c = pod.container
            if c is not None and c.node == node and not c.exclusive:
                if "never-widens" in self.faults and not pool <= c.cpus:
                    c.cpus = c.cpus & pool
                else:
                    c.cpus = pool

    def _event(self, namespace: str, name: str, kind: str, reason: str, message: str) -> None:
        self.events.append(
            {
                "metadata": {"namespace": namespace},
                "involvedObject": {"kind": "Pod", "name": name},
                "type": kind,
                "reason": reason,
                "message": message,
                "lastTimestamp": f"2026-01-01T00:{next(self._clock):05d}Z",
            }
        )

    # --- get -------------------------------------------------------------------------------

    def _get(self, rest: list[str], flags: dict[str, str]) -> Any:
        kind = rest[0]
        ns = flags.get("-n")
        if kind == "nodes":
            return {"items": [self._node_obj(n) for n in NODES]}
        if kind == "node":
            return self._node_obj(rest[1])
        if kind == "pods" and ns == "dracpu":
            node = flags["--field-selector"].removeprefix("spec.nodeName=")
            return {"items": [self._daemon_obj(node)]}
        if kind == "pod":
            pod = self.pods.get((flags["-n"], rest[1]))
            if pod is None:
                raise KubectlError(f'pods "{rest[1]}" not found')
            return pod.obj
        if kind == "resourceslices":
            return {"items": [self._slice_obj(n) for n in NODES]}
        if kind == "resourceclaims":
            return {"items": list(self.claims.values())}
        if kind == "resourceclaim":
            return self.claims[(flags["-n"], rest[1])]
        if kind == "events":
            return {"items": [e for e in self.events if e["metadata"]["namespace"] == ns]}
        raise KubectlError(f"model kubectl: cannot get {rest}")

    def _node_obj(self, name: str) -> dict[str, Any]:
        labels = {"kubernetes.io/hostname": name}
        if name.endswith("control-plane"):
            labels[CONTROL_PLANE_LABEL] = ""
        return {
            "metadata": {"name": name, "labels": labels},
            "status": {"nodeInfo": {"containerRuntimeVersion": "containerd://2.3.1"}},
        }

    def _daemon_obj(self, node: str) -> dict[str, Any]:
        state = self.nodes[node]
        return {
            "metadata": {"name": f"dracpu-{state.daemon_uid[:5]}", "uid": state.daemon_uid},
            "spec": {"nodeName": node},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
        }

    def _slice_obj(self, node: str) -> dict[str, Any]:
        devices = []
        for name, (numa, cpus) in self._devices().items():
            count = len(cpus)
            policy: dict[str, Any] = {"default": str(count), "validRange": {"min": "1"}}
            if count >= 2:
                policy["validRange"]["step"] = "1"
            devices.append(
                {
                    "name": name,
                    "allowMultipleAllocations": True,
                    "attributes": {
                        "resource.kubernetes.io/numaNode": {"int": numa},
                        "dra.cpu/socketID": {"int": 0},
                        "dra.cpu/smtEnabled": {"bool": True},
                        "dra.cpu/numCPUs": {"int": count},
                        "dra.cpu/numaNodeID": {"int": numa},
                        "dra.net/numaNode": {"int": numa},
                        "dra.cpu/numIsolatedCPUs": {"int": len(cpus & self.isolated)},
                    },
                    "capacity": {CPU_CAPACITY: {"value": str(count), "requestPolicy": policy}},
                }
            )
        return {
            "metadata": {"name": f"{node}-dra.cpu-000"},
            "spec": {
                "driver": DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": devices,
            },
        }

    # --- create ----------------------------------------------------------------------------

    def _create(self, obj: dict[str, Any]) -> None:
        kind, meta = obj["kind"], obj["metadata"]
        if kind == "Namespace":
            self.namespaces.add(meta["name"])
            return
        ns = meta["namespace"]
        assert ns in self.namespaces, f"namespace {ns} does not exist"
        if kind == "ResourceClaimTemplate":
            self.templates[(ns, meta["name"])] = obj
            return
        assert kind == "Pod", kind
        if (ns, meta["name"]) in self.pods:
            raise KubectlError(f'pods "{meta["name"]}" already exists')
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["uid"] = str(uuid.uuid4())
        obj["status"] = {"phase": "Pending"}
        pod = _Pod(obj)
        self.pods[(ns, meta["name"])] = pod
        node = obj["spec"]["nodeSelector"]["kubernetes.io/hostname"]
        (spec,) = obj["spec"]["containers"]
        env = {e["name"]: e["value"] for e in spec.get("env", [])}
        claims = obj["spec"].get("resourceClaims", [])
        if claims:
            (entry,) = claims
            if not self._allocate(pod, entry, node):
                return
            env.update(self._prepare(pod, node))
        self._start(pod, node, spec, env)

    def _allocate(self, pod: _Pod, entry: Mapping[str, Any], node: str) -> bool:
        ns, name = pod.obj["metadata"]["namespace"], pod.obj["metadata"]["name"]
        template = self.templates[(ns, entry["resourceClaimTemplateName"])]
        (request,) = template["spec"]["spec"]["devices"]["requests"]
        requests = (request["exactly"].get("capacity") or {}).get("requests") or {}
        asked = requests.get(CPU_CAPACITY)
        # requestPolicy: whole CPUs, min 1, step 1; without a request the whole group (default)
        amount = None if asked is None else max(1, math.ceil(parse_quantity(asked)))
        claim_name = f"{name}-{entry['name']}-{uuid.uuid4().hex[:5]}"
        claim: dict[str, Any] = {
            "metadata": {"name": claim_name, "namespace": ns, "uid": str(uuid.uuid4())},
            "status": {},
        }
        self.claims[(ns, claim_name)] = claim
        pod.claim = claim_name
        pod.obj["status"]["resourceClaimStatuses"] = [
            {"name": entry["name"], "resourceClaimName": claim_name}
        ]
        free = self._free(node)
        sizes = {name: len(cpus) for name, (_, cpus) in self._devices().items()}
        device = next(
            (d for d, f in free.items() if f >= (sizes[d] if amount is None else amount)), None
        )
        if device is None:
            self._event(
                ns,
                name,
                "Warning",
                "FailedScheduling",
                "0/3 nodes are available: 1 cannot allocate all claims, 2 node(s) didn't match "
                "Pod's node affinity/selector.",
            )
            return False
        pod.obj["spec"]["nodeName"] = node
        claim["status"]["allocation"] = {
            "devices": {
                "results": [
                    {
                        "request": request["name"],
                        "driver": DRIVER,
                        "pool": node,
                        "device": device,
                        "shareID": str(uuid.uuid4()),
                        "consumedCapacity": {
                            CPU_CAPACITY: str(sizes[device] if amount is None else amount)
                        },
                    }
                ]
            }
        }
        return True

    def _free(self, node: str) -> dict[str, int]:
        free = {name: len(cpus) for name, (_, cpus) in self._devices().items()}
        for claim in self.claims.values():
            for result in (
                claim["status"].get("allocation", {}).get("devices", {}).get("results", [])
            ):
                if result["pool"] == node:
                    free[result["device"]] -= int(result["consumedCapacity"][CPU_CAPACITY])
        return free

    def _prepare(self, pod: _Pod, node: str) -> dict[str, str]:
        ns = pod.obj["metadata"]["namespace"]
        claim = self.claims[(ns, pod.claim)]
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        amount = int(result["consumedCapacity"][CPU_CAPACITY])
        _, group = self._devices()[result["device"]]
        held: set[int] = set()
        for cpus in self.nodes[node].prepared.values():
            held |= cpus
        candidates = sorted(group - held)
        if "hands-out-reserved" in self.faults:
            candidates = sorted((group | self.reserved) - held)
        cpus = frozenset(candidates[:amount])
        uid = claim["metadata"]["uid"]
        self.nodes[node].prepared[uid] = cpus
        claim["status"]["devices"] = [
            {
                "driver": DRIVER,
                "pool": node,
                "device": result["device"],
                "shareID": result["shareID"],
                "data": {"cpuset": format_cpulist(cpus)},
            }
        ]
        return {f"DRA_CPUSET_{uid}": format_cpulist(cpus)}

    def _start(self, pod: _Pod, node: str, spec: Mapping[str, Any], env: dict[str, str]) -> None:
        ns, name = pod.obj["metadata"]["namespace"], pod.obj["metadata"]["name"]
        pod.obj["spec"]["nodeName"] = node
        dra = {k: v for k, v in env.items() if _DRA_ENV.match(k)}
        prepared = self.nodes[node].prepared
        exclusive = bool(dra)
        cpus: frozenset[int] = frozenset()
        for key, value in dra.items():
            uid = key.removeprefix("DRA_CPUSET_")
            try:
                parsed = parse_cpulist(value)
            except ValueError:
                error = f"malformed env entry '{key}={value}'"
            else:
                if uid in prepared and prepared[uid] == parsed:
                    cpus |= parsed
                    continue
                if "accepts-spoofed-env" in self.faults:
                    exclusive = False
                    continue
                error = f"its env names claim {uid}, which this node has not prepared"
            message = f"failed to create containerd container: NRI: {error}"
            pod.obj["status"]["containerStatuses"] = [
                {
                    "name": spec["name"],
                    "state": {"waiting": {"reason": "CreateContainerError", "message": message}},
                }
            ]
            self._event(ns, name, "Warning", "Failed", f"Error: {message}")
            return
        if not exclusive:
            cpus = self.pool(node)
        pod.container = _Container(node, cpus, dra, exclusive)
        self._repin_shared(node)  # the creation's reply re-pins every shared container
        if pod.obj["spec"].get("restartPolicy") == "Never":  # the probe: prints and exits
            numa = {str(n): format_cpulist(c) for n, c in self.numa.items()}
            pod.logs = json.dumps(
                {
                    "online": format_cpulist(self.online),
                    "isolated": format_cpulist(self.isolated),
                    "numa": numa,
                    "allowed": format_cpulist(cpus),
                }
            )
            pod.container = None
            pod.obj["status"]["phase"] = "Succeeded"
            return
        pod.obj["status"]["phase"] = "Running"
        pod.obj["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
        pod.obj["status"]["containerStatuses"] = [
            {"name": spec["name"], "ready": True, "state": {"running": {}}}
        ]

    # --- delete, exec, logs ----------------------------------------------------------------

    def _delete(self, kind: str, name: str, namespace: str | None) -> None:
        if kind == "namespace":
            for key in [k for k in self.pods if k[0] == name]:
                self._delete_pod(*key)
            self.templates = {k: v for k, v in self.templates.items() if k[0] != name}
            self.claims = {k: v for k, v in self.claims.items() if k[0] != name}
            self.events = [e for e in self.events if e["metadata"]["namespace"] != name]
            self.namespaces.discard(name)
            return
        assert kind == "pod", kind
        assert namespace is not None, name
        if namespace == "dracpu":  # the DaemonSet replaces the pod; the checkpoint survives
            for state in self.nodes.values():
                if name == self._daemon_obj(state.name)["metadata"]["name"]:
                    state.daemon_uid = str(uuid.uuid4())
                    if "forgets-claims-on-restart" in self.faults:
                        state.prepared.clear()
                        self._repin_shared(state.name)  # Synchronize
            return
        self._delete_pod(namespace, name)

    def _delete_pod(self, namespace: str, name: str) -> None:
        pod = self.pods.pop((namespace, name), None)
        if pod is None or not pod.claim:
            return
        claim = self.claims.pop((namespace, pod.claim))
        node = pod.obj["spec"].get("nodeName")
        if node and claim["status"].get("allocation"):
            self.nodes[node].prepared.pop(claim["metadata"]["uid"], None)  # Unprepare
            if self.unsolicited:
                self._repin_shared(node)

    def _exec(self, name: str, namespace: str) -> str:
        pod = self.pods.get((namespace, name))
        if pod is None or pod.container is None:
            raise KubectlError(f"cannot exec in {namespace}/{name}: not running")
        c = pod.container
        cpus = format_cpulist(c.cpus)
        return json.dumps({"self": cpus, "pid1": cpus, "dra": c.dra})

    def _logs(self, name: str, namespace: str) -> str:
        if namespace == "dracpu":
            mode = "on" if self.unsolicited else "off (shared containers widen at the next event)"
            return (
                "NRI: configured by containerd v2.3.1 (NRI v0.12.0) as 00-dra.cpu; events 0x6c8; "
                f"unsolicited updates {mode}\n"
            )
        return self.pods[(namespace, name)].logs


# kubectl flags the suite passes with a separate value.
_PAIR_FLAGS = frozenset({"-n", "-c", "-l", "-o", "-f", "--field-selector"})


def _split(args: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """A kubectl command line's flags with values, and its positional words (up to ``--``)."""
    flags: dict[str, str] = {}
    words: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--":
            break
        if arg in _PAIR_FLAGS and index + 1 < len(args):
            flags[arg] = args[index + 1]
            index += 2
            continue
        if not arg.startswith("-"):
            words.append(arg)
        index += 1
    return flags, words
