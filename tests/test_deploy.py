"""The manifests in deploy/ are valid Kubernetes objects, hardened, and agree with the code.

``kubectl kustomize`` of the base and of the kind overlay is rendered by :mod:`tests.kustomize`
(and, where kubectl is installed, by kubectl too: both must agree) and every object is validated
strictly against the Kubernetes schemas of ``kubernetes-validate``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dracpu import DRIVER_NAME
from dracpu.cli import _build_parser
from dracpu.config import go_style_flags, load_config
from tests.kustomize import build

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kustomize"
TREES = {"base": DEPLOY / "base", "kind": DEPLOY / "overlays" / "kind"}
# The Kubernetes version whose schemas we validate against: the newest kubernetes-validate ships.
K8S_VERSION = kubernetes_validate.latest_version()


def _render(tree: str) -> list[dict[str, Any]]:
    return build(TREES[tree])


def _one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj


def test_every_listed_file_exists_and_nothing_is_left_out() -> None:
    kustomization = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in (DEPLOY / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


@pytest.mark.parametrize("tree", list(TREES))
def test_rendered_objects_validate_strictly(tree: str) -> None:
    objects = _render(tree)
    assert {o["kind"] for o in objects} >= {"DaemonSet", "ClusterRole", "ConfigMap"}
    for obj in objects:
        # strict=True rejects unknown fields; a missing schema raises SchemaNotFoundError.
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("tree", list(TREES))
def test_kubectl_kustomize_agrees_with_our_renderer(tree: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the rendering is checked by tests/kustomize.py only")
    out = subprocess.run(
        [kubectl, "kustomize", str(TREES[tree])], capture_output=True, text=True, check=True
    ).stdout
    theirs = sorted(
        (d for d in yaml.safe_load_all(out) if d), key=lambda o: (o["kind"], o["metadata"]["name"])
    )
    ours = sorted(_render(tree), key=lambda o: (o["kind"], o["metadata"]["name"]))
    assert theirs == ours


def test_deviceclass_selects_our_driver() -> None:
    cls = _one(_render("base"), "DeviceClass")
    assert cls["metadata"]["name"] == DRIVER_NAME
    assert cls["spec"]["selectors"] == [
        {"cel": {"expression": f'device.driver == "{DRIVER_NAME}"'}}
    ]


@pytest.mark.parametrize(("tree", "reserved"), [("base", ""), ("kind", "0")])
def test_the_daemonsets_command_and_config_are_accepted_by_the_cli(
    tree: str, reserved: str, tmp_path: Path
) -> None:
    objects = _render(tree)
    container = _one(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    command: list[str] = container["command"] + container.get("args", [])
    assert command[0] == "/dracpu"  # the image's entry point (Containerfile)
    # The ConfigMap's file, where the pod mounts it.
    config_file = tmp_path / "config.yaml"
    config_file.write_text(_one(objects, "ConfigMap")["data"]["config.yaml"])
    argv = [a.replace("/etc/dracpu/config.yaml", str(config_file)) for a in command[1:]]
    parser = _build_parser()
    assert argv[0] == "run"
    args = parser.parse_args(["run", *go_style_flags(argv[1:], parser.get_default("run_flags"))])
    # The pod's environment as the DaemonSet sets it (NODE_NAME from spec.nodeName).
    config = load_config(args, {"NODE_NAME": "node-a", "HOST_ROOT": "/host"})
    assert (config.node_name, config.node_name_source) == (
        "node-a",
        "environment variable NODE_NAME",
    )
    assert config.host_root == Path("/host")
    assert str(config.reserved_cpus) == reserved
    assert config.notices == ()  # no deprecated flag in our own manifests


@pytest.mark.parametrize("tree", list(TREES))
def test_the_daemonset_is_hardened(tree: str) -> None:
    pod = _one(_render(tree), "DaemonSet")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    for key in ("hostPID", "hostIPC", "hostNetwork"):
        assert not pod.get(key), key
    assert all(v.get("hostPath", {}).get("path") != "/" for v in pod["volumes"])


def test_the_daemonset_mounts_the_paths_the_daemon_uses() -> None:
    pod = _one(_render("base"), "DaemonSet")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    # The daemon's defaults: kubelet root, CDI dir, NRI socket dir, state dir, sysfs under
    # HOST_ROOT, and its config file.
    assert {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins",
        "/var/lib/kubelet/pod-resources",
        "/var/run/cdi",
        "/var/run/nri",
        "/var/lib/dracpu",
        "/host/sys",
        "/etc/dracpu",
    } <= set(mounts)
    # The checkpoint must outlive the pod: the state directory is the node's.
    assert volumes[mounts["/var/lib/dracpu"]]["hostPath"]["path"] == "/var/lib/dracpu"
    assert volumes[mounts["/etc/dracpu"]]["configMap"]["name"] == "dracpu-config"
    env = {e["name"]: e for e in container["env"]}
    assert env["HOST_ROOT"]["value"] == "/host"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_rbac_grants_what_the_code_uses_and_nothing_more() -> None:
    role = _one(_render("base"), "ClusterRole")
    granted = {
        (group, resource, verb, tuple(rule.get("resourceNames", ())))
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    slices = {
        ("resource.k8s.io", "resourceslices", verb, ())
        for verb in ("get", "list", "watch", "create", "update", "patch", "delete")
    }
    assert granted == slices | {
        ("resource.k8s.io", "resourceclaims", "get", ()),
        ("resource.k8s.io", "resourceclaims/status", "patch", ()),
        ("resource.k8s.io", "resourceclaims/status", "update", ()),
        ("resource.k8s.io", "resourceclaims/driver", "associated-node:patch", (DRIVER_NAME,)),
        ("resource.k8s.io", "resourceclaims/driver", "associated-node:update", (DRIVER_NAME,)),
        ("", "nodes", "get", ()),
    }
    # Upstream's chart also grants pods get/list/watch and deviceclasses get; nothing of ours
    # reads them (the only API client is adapters/kube.py).
    kube = (Path(__file__).resolve().parent.parent / "src/dracpu/adapters/kube.py").read_text()
    assert "deviceclasses" not in kube
    assert "/pods" not in kube
