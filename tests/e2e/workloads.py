"""The objects the e2e suite creates, built from ``tests/e2e/manifests/*.yaml``.

The manifests are complete, valid objects (``tests/test_e2e_assets.py`` validates them and every
object built here against the Kubernetes schemas); the builders copy one and set what each test
varies: name, namespace, node, the CPUs a claim asks for, extra env.

Also here: what the suite reads from the repository instead of repeating it (the reserved CPUs
and the image of the deployed overlay: ``kind``, or the one ``DRACPU_E2E_OVERLAY`` names), and
:data:`OBSERVE`, the script run inside a container to see what it was given.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.kube import parse_cpulist

__all__ = [
    "CLAIM_REQUEST",
    "CPU_CAPACITY",
    "DRIVER",
    "MANIFESTS",
    "OBSERVE",
    "KIND_OVERLAY",
    "OVERLAYS",
    "OVERLAY_ENV",
    "REPO",
    "SEEN_BY_INIT",
    "SIDE_CONTAINER",
    "WORK_CONTAINER",
    "claim_sharing_pod",
    "claim_template",
    "deployed_overlay",
    "exclusive_pod",
    "load_manifest",
    "overlay_image",
    "overlay_reserved_cpus",
    "probe_pod",
    "shared_pod",
]

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = Path(__file__).resolve().parent / "manifests"
OVERLAYS = REPO / "deploy" / "kustomize" / "overlays"
# The overlay `just e2e` deploys (tests/e2e/run.sh applies it with kubectl apply -k).
KIND_OVERLAY = OVERLAYS / "kind"
# The name of the overlay deployed when it is not kind's (`just e2e-local` sets it to "local").
OVERLAY_ENV = "DRACPU_E2E_OVERLAY"
BASE = REPO / "deploy" / "kustomize" / "base"

# The compatibility contract (docs/devices.md), written out here rather than imported from dracpu:
# the suite checks dracpu against these facts.
DRIVER = "dra.cpu"  # driver name and DeviceClass name
CPU_CAPACITY = "dra.cpu/cpu"  # the capacity of grouped devices
# Names used by the manifests.
CLAIM_REQUEST = "cpus"  # the request of claim-template.yaml, the claim entry of exclusive-pod.yaml
WORK_CONTAINER = "work"  # the container of shared-pod.yaml and exclusive-pod.yaml
# claim_sharing_pod's second app container, and the file in which its init container left what
# OBSERVE saw (an emptyDir the work container mounts too).
SIDE_CONTAINER = "side"
SEEN_BY_INIT = "/seen/init.json"
_NODE_LABEL = "kubernetes.io/hostname"  # kind names each node after its hostname

# Run inside a container (python3 -c): the Cpus_allowed_list of the process kubectl exec starts
# (/proc/self/status) and of the container's own process (PID 1), and the DRA_CPUSET_* entries of
# PID 1's environment (of the exec'd process's, which the runtime builds from the same container
# spec, if PID 1's cannot be read), as one JSON object.
OBSERVE = """
import json, os
def allowed(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return None
try:
    with open("/proc/1/environ", "rb") as f:
        env = [e.decode() for e in f.read().split(b"\\0") if b"=" in e]
except OSError:
    env = [f"{k}={v}" for k, v in os.environ.items()]
dra = dict(e.split("=", 1) for e in env if e.startswith("DRA_CPUSET_"))
print(json.dumps({"self": allowed("self"), "pid1": allowed(1), "dra": dra}))
"""


@cache
def _manifest(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((MANIFESTS / name).read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{MANIFESTS / name}: not one YAML object")
    return doc


def load_manifest(name: str) -> dict[str, Any]:
    """A fresh copy of ``manifests/<name>``."""
    return copy.deepcopy(_manifest(name))


def _place(obj: dict[str, Any], name: str, namespace: str, node: str) -> dict[str, Any]:
    obj["metadata"]["name"] = name
    obj["metadata"]["namespace"] = namespace
    obj["spec"]["nodeSelector"] = {_NODE_LABEL: node}
    return obj


def probe_pod(name: str, namespace: str, node: str) -> dict[str, Any]:
    """A pod that prints the node's CPU topology and its own (shared-pool) cpus, then exits."""
    return _place(load_manifest("probe-pod.yaml"), name, namespace, node)


def shared_pod(
    name: str, namespace: str, node: str, *, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A best-effort pod without claims; ``env`` adds entries to its container."""
    pod = _place(load_manifest("shared-pod.yaml"), name, namespace, node)
    if env:
        (container,) = pod["spec"]["containers"]
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return pod


def claim_template(
    name: str,
    namespace: str,
    cpus: str | None,
    *,
    cpu_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A ResourceClaimTemplate asking for ``cpus`` (a quantity: "2", "1500m") of one grouped
    device, or (``None``) for one device with no capacity request: an individual-mode device.
    ``cpu_config``: the claim's opaque config of our driver (docs/claim-config.md)."""
    template = load_manifest("claim-template.yaml")
    template["metadata"]["name"] = name
    template["metadata"]["namespace"] = namespace
    devices = template["spec"]["spec"]["devices"]
    (request,) = devices["requests"]
    if cpus is None:
        del request["exactly"]["capacity"]
    else:
        request["exactly"]["capacity"]["requests"] = {CPU_CAPACITY: cpus}
    if cpu_config is not None:
        devices["config"] = [
            {
                "requests": [CLAIM_REQUEST],
                "opaque": {
                    "driver": DRIVER,
                    "parameters": {"apiVersion": "v1alpha1", "cpuConfig": dict(cpu_config)},
                },
            }
        ]
    return template


def exclusive_pod(
    name: str, namespace: str, node: str, *, template: str, cpu_resources: str | None
) -> dict[str, Any]:
    """A pod with one claim from ``template``. ``cpu_resources`` sets the container's cpu
    requests and limits (mirroring the claim: a Guaranteed pod); ``None`` leaves cpu out, for
    pods that must stay Pending because of their claim and nothing else."""
    pod = _place(load_manifest("exclusive-pod.yaml"), name, namespace, node)
    (claim,) = pod["spec"]["resourceClaims"]
    claim["resourceClaimTemplateName"] = template
    (container,) = pod["spec"]["containers"]
    resources = container["resources"]
    for kind in ("requests", "limits"):
        if cpu_resources is None:
            resources[kind].pop("cpu", None)
        else:
            resources[kind]["cpu"] = cpu_resources
    return pod


def claim_sharing_pod(
    name: str, namespace: str, node: str, *, template: str, cpu_resources: str
) -> dict[str, Any]:
    """An exclusive pod (:func:`exclusive_pod`) whose one claim is used by three containers: an
    init container, which runs :data:`OBSERVE` into :data:`SEEN_BY_INIT` and exits, the work
    container and a second app container, :data:`SIDE_CONTAINER` (docs/pods.md: the containers
    of the pods a claim is reserved for share its CPUs)."""
    pod = exclusive_pod(name, namespace, node, template=template, cpu_resources=cpu_resources)
    (work,) = pod["spec"]["containers"]
    seen = Path(SEEN_BY_INIT).parent
    mount = {"name": "seen", "mountPath": str(seen)}
    pod["spec"]["volumes"] = [{"name": "seen", "emptyDir": {}}]
    work["volumeMounts"] = [mount]
    claim_only = {"claims": copy.deepcopy(work["resources"]["claims"])}
    init = {
        "name": "init",
        "image": work["image"],
        "imagePullPolicy": work["imagePullPolicy"],
        # sh passes the script as $0 to python3, unquoted by nothing: OBSERVE has newlines.
        "command": ["sh", "-c", f'python3 -c "$0" > {SEEN_BY_INIT}', OBSERVE],
        "resources": claim_only,
        "volumeMounts": [mount],
    }
    side = {
        "name": SIDE_CONTAINER,
        "image": work["image"],
        "imagePullPolicy": work["imagePullPolicy"],
        "command": work["command"],
        "resources": copy.deepcopy(claim_only),
    }
    pod["spec"]["initContainers"] = [init]
    pod["spec"]["containers"].append(side)
    return pod


def deployed_overlay() -> Path:
    """The overlay the cluster under test runs: ``overlays/$DRACPU_E2E_OVERLAY``, else kind's."""
    return OVERLAYS / os.environ.get(OVERLAY_ENV, KIND_OVERLAY.name)


def overlay_reserved_cpus(overlay: Path | None = None) -> frozenset[int]:
    """The ``reservedCPUs`` of the driver config the overlay (default: the deployed one)
    deploys (empty if none)."""
    from tests.kustomize import build

    (configmap,) = [o for o in build(overlay or deployed_overlay()) if o["kind"] == "ConfigMap"]
    config = yaml.safe_load(configmap["data"]["config.yaml"]) or {}
    return parse_cpulist(str(config.get("reservedCPUs", "")))


def overlay_image(overlay: Path = KIND_OVERLAY) -> str:
    """The image reference the overlay deploys: the base DaemonSet's image with the overlay's
    ``images`` rewrite (kustomize ``newName``/``newTag``) applied."""
    daemonset = yaml.safe_load((BASE / "daemonset.yaml").read_text())
    image: str = daemonset["spec"]["template"]["spec"]["containers"][0]["image"]
    match = re.match(r"^(?P<name>[^:@]+(:\d+/[^:@]+)?)(:(?P<tag>[^@]+))?(@.*)?$", image)
    if match is None:
        raise ValueError(f"{BASE / 'daemonset.yaml'}: cannot read image {image!r}")
    name, tag = match.group("name"), match.group("tag") or "latest"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    for rewrite in kustomization.get("images", []):
        if rewrite.get("name") == name:
            name = rewrite.get("newName", name)
            tag = rewrite.get("newTag", tag)
    return f"{name}:{tag}"
