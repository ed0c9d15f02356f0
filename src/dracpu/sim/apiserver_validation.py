"""What the fake API server checks before it stores an object.

- The Kubernetes OpenAPI schema, strict (no unknown fields), from ``kubernetes-validate``'s
  bundled JSON schemas for ``kubernetes_validate.latest_version()``. A kind without a schema is
  an error at start, never a silent pass. The schema of each kind is loaded once and its
  ``$ref``\\s inlined, since ``kubernetes_validate.validate`` reloads the 5 MB definitions file
  on every call and a reference-resolving validator is slower than an inlined one (figures in
  ``docs/performance.md``).
- The API server's own rules the schema cannot express: for ResourceSlices
  :func:`dracpu.sim.slice_rules.validate_slice` (128 devices, 32 attributes + capacities, qualified
  names, pool and node names, request policies ...); for a ResourceClaim's ``status.devices``
  :func:`claim_status_errors` (each entry must name an allocated device, ``data`` is a JSON
  object of at most 10 KiB, at most 8 conditions, no duplicate keys).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate
from kubernetes_validate.utils import schema_contents

__all__ = ["SchemaValidator", "claim_status_errors"]

# resource/v1 limits (k8s.io/api resource/v1 types.go).
_MAX_STATUS_DATA = 10 * 1024  # AllocatedDeviceStatusDataMaxLength
_MAX_CONDITIONS = 8  # AllocatedDeviceStatusMaxConditions
_MAX_ERRORS = 20  # errors reported per object, like the API server's aggregated message


class SchemaValidator:
    """Strict OpenAPI schema checks for the kinds the fake server stores.

    ``version``: the Kubernetes version whose schemas to use (default: the newest that
    ``kubernetes-validate`` ships). Raises ``kubernetes_validate.SchemaNotFoundError`` at
    construction if a kind has no schema.
    """

    def __init__(
        self,
        kinds: tuple[tuple[str, str], ...] = (
            ("resource.k8s.io/v1", "ResourceSlice"),
            ("resource.k8s.io/v1", "ResourceClaim"),
            ("v1", "Node"),
        ),
        *,
        version: str | None = None,
    ) -> None:
        self.version = version or kubernetes_validate.latest_version()
        self._validators: dict[tuple[str, str], Any] = {}
        directory = f"kubernetes-json-schema/v{self.version}-local-strict"
        definitions = schema_contents(f"{directory}/_definitions.json", self.version)["$defs"]
        for api_version, kind in kinds:
            # kubernetes_validate.validate: "rbac.authorization.k8s.io/v1" -> "rbac-v1"
            group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
            name = f"{directory}/{kind.lower()}-{group_version}.json"
            try:
                schema = schema_contents(name, self.version)
            except FileNotFoundError:
                raise kubernetes_validate.SchemaNotFoundError(
                    version=self.version, kind=kind, api_version=api_version
                ) from None
            inlined = _inline(schema, definitions, ())
            self._validators[(api_version, kind)] = jsonschema.validators.Draft202012Validator(
                inlined
            )

    def errors(self, obj: Mapping[str, Any]) -> list[str]:
        """Schema violations of ``obj`` as ``path: message`` lines; empty when valid."""
        key = (str(obj.get("apiVersion")), str(obj.get("kind")))
        validator = self._validators.get(key)
        if validator is None:
            return [f"no schema for apiVersion {key[0]!r} kind {key[1]!r}"]
        found: list[str] = []
        for error in validator.iter_errors(obj):
            path = ".".join(str(p) for p in error.absolute_path) or "<root>"
            found.append(f"{path}: {error.message}")
            if len(found) >= _MAX_ERRORS:
                break
        return sorted(found)


def _inline(node: Any, definitions: Mapping[str, Any], stack: tuple[str, ...]) -> Any:
    """``node`` with every ``#/$defs/<name>`` reference replaced by the definition itself."""
    if isinstance(node, list):
        return [_inline(item, definitions, stack) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = str(node["$ref"]).rsplit("/", 1)[-1]
        if name in stack or name not in definitions:
            raise ValueError(f"cannot inline schema reference {node['$ref']!r}")
        target = _inline(definitions[name], definitions, (*stack, name))
        rest = {k: v for k, v in node.items() if k != "$ref"}
        # 2020-12: keywords beside $ref apply too, i.e. both must hold.
        return {"allOf": [target, _inline(rest, definitions, stack)]} if rest else target
    return {key: _inline(value, definitions, stack) for key, value in node.items()}


def _status_key(entry: Mapping[str, Any]) -> tuple[object, object, object, object]:
    return (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID"))


def claim_status_errors(claim: Mapping[str, Any]) -> list[str]:
    """The API server's checks of ``status.devices`` (``validateDeviceStatus``)."""
    status = claim.get("status") or {}
    entries = status.get("devices") or []
    if not isinstance(entries, list):
        return ["status.devices: must be a list"]
    allocation = status.get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    allocated = {_status_key(r) for r in results if isinstance(r, Mapping)}
    errors: list[str] = []
    seen: set[tuple[object, object, object, object]] = set()
    for index, entry in enumerate(entries):
        where = f"status.devices[{index}]"
        if not isinstance(entry, Mapping):
            errors.append(f"{where}: must be an object")
            continue
        key = _status_key(entry)
        if key in seen:
            errors.append(f"{where}: Duplicate value: {key}")
        seen.add(key)
        if key not in allocated:
            errors.append(
                f"{where}: Invalid value: {key}: must be an allocated device in the claim"
            )
        if "data" in entry:
            data = entry["data"]
            if not isinstance(data, Mapping):
                errors.append(f"{where}.data: Invalid value: must be a JSON object")
            elif len(json.dumps(data, separators=(",", ":"))) > _MAX_STATUS_DATA:
                errors.append(f"{where}.data: Too long: must have at most {_MAX_STATUS_DATA} bytes")
        conditions = entry.get("conditions") or []
        if isinstance(conditions, list) and len(conditions) > _MAX_CONDITIONS:
            errors.append(
                f"{where}.conditions: Too many: must have at most {_MAX_CONDITIONS} items"
            )
    return errors
