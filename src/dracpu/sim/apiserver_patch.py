"""Patch formats the fake API server accepts: JSON merge patch (RFC 7386) and JSON patch
(RFC 6902: ``add``, ``remove``, ``replace``, ``test``, ``move``, ``copy``).

A strategic merge patch is applied as a merge patch: for the lists in the objects we serve
(``status.devices`` of a ResourceClaim, a list-map with several keys) the API server's strategic
merge has no merge key either and replaces the list, as a merge patch does.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

__all__ = ["PatchError", "apply_json_patch", "apply_merge_patch"]


class PatchError(ValueError):
    """The patch is malformed or does not apply (the server answers 422 / 400)."""


def apply_merge_patch(target: object, patch: object) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result: dict[str, Any] = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


def _pointer(path: object) -> list[str]:
    if not isinstance(path, str) or (path and not path.startswith("/")):
        raise PatchError(f"{path!r} is not a JSON pointer")
    if not path:
        return []
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], path: str) -> tuple[Any, str]:
    if not parts:
        raise PatchError(f"{path!r}: the whole document cannot be the target")
    node = doc
    for part in parts[:-1]:
        node = _child(node, part, path)
    return node, parts[-1]


def _child(node: Any, part: str, path: str) -> Any:
    if isinstance(node, dict):
        if part not in node:
            raise PatchError(f"{path!r}: no member {part!r}")
        return node[part]
    if isinstance(node, list):
        return node[_index(node, part, path, allow_end=False)]
    raise PatchError(f"{path!r}: {part!r} is inside a scalar")


def _index(node: list[Any], part: str, path: str, *, allow_end: bool) -> int:
    if part == "-" and allow_end:
        return len(node)
    if not part.isdigit() or (len(part) > 1 and part.startswith("0")):
        raise PatchError(f"{path!r}: {part!r} is not an array index")
    index = int(part)
    if index > len(node) or (index == len(node) and not allow_end):
        raise PatchError(f"{path!r}: index {index} is out of range")
    return index


def _get(doc: Any, path: str) -> Any:
    node = doc
    for part in _pointer(path):
        node = _child(node, part, path)
    return node


def _add(doc: Any, path: str, value: Any) -> None:
    parent, last = _parent(doc, _pointer(path), path)
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, path, allow_end=True), value)
    else:
        raise PatchError(f"{path!r}: the parent is a scalar")


def _remove(doc: Any, path: str) -> Any:
    parent, last = _parent(doc, _pointer(path), path)
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"{path!r}: no member {last!r}")
        return parent.pop(last)
    if isinstance(parent, list):
        return parent.pop(_index(parent, last, path, allow_end=False))
    raise PatchError(f"{path!r}: the parent is a scalar")


def apply_json_patch(target: object, operations: object) -> Any:
    """RFC 6902 on a deep copy of ``target``; :class:`PatchError` if any operation fails."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for number, operation in enumerate(operations):
        if not isinstance(operation, Mapping):
            raise PatchError(f"operation {number} is not an object")
        op, path = operation.get("op"), operation.get("path")
        if not isinstance(path, str):
            raise PatchError(f"operation {number}: path {path!r} is not a string")
        if op in ("add", "replace", "test") and "value" not in operation:
            raise PatchError(f"operation {number} ({op}): no value")
        value = copy.deepcopy(operation.get("value"))
        if op == "add":
            _add(doc, path, value)
        elif op == "remove":
            _remove(doc, path)
        elif op == "replace":
            _remove(doc, path)
            _add(doc, path, value)
        elif op == "test":
            if _get(doc, path) != value:
                raise PatchError(f"operation {number}: test of {path!r} failed")
        elif op in ("move", "copy"):
            source = operation.get("from")
            if not isinstance(source, str):
                raise PatchError(f"operation {number} ({op}): from {source!r} is not a string")
            moved = _remove(doc, source) if op == "move" else copy.deepcopy(_get(doc, source))
            _add(doc, path, moved)
        else:
            raise PatchError(f"operation {number}: unknown op {op!r}")
    return doc
