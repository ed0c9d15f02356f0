"""The manifests in deploy/ are valid Kubernetes objects and agree with the code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dracpu import DRIVER_NAME
from dracpu.cli import _build_parser
from dracpu.config import load_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kustomize"
# The Kubernetes version whose schemas we validate against: the newest kubernetes-validate ships.
K8S_VERSION = kubernetes_validate.latest_version()


def _base_objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    objects: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        objects.extend(
            doc for doc in yaml.safe_load_all((DEPLOY / "base" / name).read_text()) if doc
        )
    return objects


def test_every_listed_file_exists_and_nothing_is_left_out() -> None:
    kustomization = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in (DEPLOY / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


@pytest.mark.parametrize(
    "obj", _base_objects(), ids=lambda o: f"{o['kind']}/{o['metadata']['name']}"
)
def test_base_objects_validate_strictly(obj: dict[str, Any]) -> None:
    # strict=True rejects unknown fields; a missing schema raises SchemaNotFoundError (a failure).
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_deviceclass_selects_our_driver() -> None:
    (cls,) = [o for o in _base_objects() if o["kind"] == "DeviceClass"]
    assert cls["metadata"]["name"] == DRIVER_NAME
    assert cls["spec"]["selectors"] == [
        {"cel": {"expression": f'device.driver == "{DRIVER_NAME}"'}}
    ]


def _daemonset_args(overlay_patch: bool) -> list[str]:
    (ds,) = [o for o in _base_objects() if o["kind"] == "DaemonSet"]
    args: list[str] = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    if overlay_patch:
        kind = yaml.safe_load((DEPLOY / "overlays" / "kind" / "kustomization.yaml").read_text())
        ops = yaml.safe_load(kind["patches"][0]["patch"])
        (op,) = [o for o in ops if o["path"].endswith("/args")]
        args = op["value"]
    return args


@pytest.mark.parametrize("overlay", [False, True], ids=["base", "kind"])
def test_daemonset_args_are_accepted_by_the_cli(overlay: bool) -> None:
    args = _build_parser().parse_args(_daemonset_args(overlay))
    assert args.command == "run"
    # The pod's environment as the DaemonSet sets it (NODE_NAME from spec.nodeName).
    config = load_config(args, {"NODE_NAME": "node-a", "HOST_ROOT": "/host"})
    assert (config.node_name, config.node_name_source) == (
        "node-a",
        "environment variable NODE_NAME",
    )
    assert config.host_root == Path("/host")
    assert str(config.reserved_cpus) == ("0" if overlay else "")


def test_daemonset_mounts_the_paths_the_daemon_uses() -> None:
    (ds,) = [o for o in _base_objects() if o["kind"] == "DaemonSet"]
    container = ds["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    # design §5 defaults: kubelet root, CDI dir, NRI socket dir, state dir, sysfs under HOST_ROOT.
    assert {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins",
        "/var/lib/kubelet/pod-resources",
        "/var/run/cdi",
        "/var/run/nri",
        "/var/lib/dracpu",
        "/host/sys",
    } <= mounts
    env = {e["name"]: e for e in container["env"]}
    assert env["HOST_ROOT"]["value"] == "/host"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
