"""``kubectl kustomize`` for the subset of kustomize our ``deploy/`` tree uses, for tests.

Supported: ``resources`` (files and directories), ``namespace`` (set on namespaced objects),
``images`` (``newName`` / ``newTag`` of containers' images) and ``patches`` that are JSON 6902
operation lists (``add``, ``replace``, ``remove``) with a ``target`` of ``kind`` and ``name``. A
kustomization using anything else is refused, so that a feature this renderer does not know is
never silently skipped. Where ``kubectl`` is installed, the tests compare its output with ours.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

__all__ = ["build"]

_KNOWN_KEYS = frozenset({"apiVersion", "kind", "namespace", "resources", "images", "patches"})
# Kinds whose objects have no namespace (kubectl api-resources --namespaced=false).
_CLUSTER_SCOPED = frozenset(
    {
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "DeviceClass",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
)


def build(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize <directory>`` would print, in its resource order."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - _KNOWN_KEYS
    if unknown:
        raise ValueError(f"{directory}: kustomization keys this renderer does not know: {unknown}")
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        if path.is_dir():
            objects.extend(build(path))
        else:
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    namespace = kustomization.get("namespace")
    if namespace:
        for obj in objects:
            if obj["kind"] not in _CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = namespace
    for rewrite in kustomization.get("images", []):
        for obj in objects:
            for container in _containers(obj):
                _rewrite_image(container, rewrite)
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        if set(target) - {"kind", "name"} or "path" in patch:
            raise ValueError(f"{directory}: only inline JSON 6902 patches by kind and name")
        matched = [
            obj
            for obj in objects
            if obj["kind"] == target["kind"] and obj["metadata"]["name"] == target["name"]
        ]
        if not matched:
            raise ValueError(f"{directory}: patch target {target} matches no object")
        for obj in matched:
            for op in yaml.safe_load(patch["patch"]):
                _apply(obj, op)
    return objects


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {})
    pod = spec.get("template", {}).get("spec", {}) if obj["kind"] != "Pod" else spec
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def _rewrite_image(container: dict[str, Any], rewrite: dict[str, str]) -> None:
    image = container["image"]
    name, _, tag = image.partition(":")
    if name != rewrite["name"]:
        return
    container["image"] = f"{rewrite.get('newName', name)}:{rewrite.get('newTag', tag)}"


def _apply(obj: dict[str, Any], op: dict[str, Any]) -> None:
    *parents, last = [
        part.replace("~1", "/").replace("~0", "~") for part in op["path"].split("/")[1:]
    ]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    kind = op["op"]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if kind == "add":
            node.insert(index, copy.deepcopy(op["value"]))
        elif kind == "replace":
            node[index] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del node[index]
        else:
            raise ValueError(f"unsupported JSON 6902 op {kind!r}")
        return
    if kind in ("add", "replace"):
        if kind == "replace" and last not in node:
            raise ValueError(f"replace of a missing path {op['path']}")
        node[last] = copy.deepcopy(op["value"])
    elif kind == "remove":
        del node[last]
    else:
        raise ValueError(f"unsupported JSON 6902 op {kind!r}")
