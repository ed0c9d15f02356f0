"""The storage of the in-process fake API server (:mod:`dracpu.sim.fake_apiserver` serves it).

Bookkeeping like the real server: one global ``resourceVersion`` counter, ``uid``,
``creationTimestamp``, ``metadata.generation`` bumped on spec changes, no-op updates that change
nothing, 409 for a stale ``resourceVersion`` or an existing name, 404, immutable slice fields.
Every written ResourceSlice is checked against the strict OpenAPI schema and the server's own
rules (:mod:`dracpu.sim.apiserver_validation`); an invalid object is refused with the causes, as
the real server's ``422``. Every change to a slice is kept as a watch event (the history a watch
resumes from, until :meth:`ApiStore.compact`).
"""

from __future__ import annotations

import copy
import secrets
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import anyio

from dracpu import DRIVER_NAME
from dracpu.sim.apiserver_validation import SchemaValidator, claim_status_errors
from dracpu.sim.slice_rules import validate_slice

__all__ = [
    "DEFAULT_HISTORY",
    "RESOURCE_API",
    "ApiError",
    "ApiStore",
    "WatchEvent",
    "build_resource_claim",
    "dig",
    "now",
]

_GROUP = "resource.k8s.io"
RESOURCE_API = "resource.k8s.io/v1"
# Fields a server without DRAConsumableCapacity drops from devices (its dropDisabledFields).
_CONSUMABLE_DEVICE_FIELDS = ("allowMultipleAllocations",)
_CONSUMABLE_CAPACITY_FIELDS = ("requestPolicy",)
# ResourceSlice fields that are immutable (resource/v1 validation: driver, pool name, node name).
_IMMUTABLE_SLICE_FIELDS = (("spec", "driver"), ("spec", "pool", "name"), ("spec", "nodeName"))
# Watch events kept for resuming watches; older versions get 410 Gone (etcd compaction).
DEFAULT_HISTORY = 10_000
# Characters of generateName suffixes (k8s.io/apiserver names.SimpleNameGenerator: 5 of these).
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change of a slice, as a watch sends it (``type``: ADDED, MODIFIED, DELETED)."""

    version: int
    type: str
    obj: dict[str, Any]


class ApiError(Exception):
    """What the server answers with a ``Status`` body: HTTP ``code``, message, causes."""

    def __init__(
        self, code: int, message: str, *, causes: Sequence[str] = (), details: Any = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.causes = tuple(causes)
        self.details = details or {}


def now() -> str:
    """The current time as the API server writes timestamps (RFC 3339, seconds, UTC)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def dig(obj: Mapping[str, Any], path: Sequence[str]) -> Any:
    """The value at ``path`` in nested objects, ``None`` where it is absent."""
    node: Any = obj
    for key in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


def build_resource_claim(
    namespace: str,
    name: str,
    results: Sequence[Mapping[str, Any]],
    *,
    uid: str | None = None,
    configs: Sequence[Mapping[str, Any]] = (),
    node_name: str | None = None,
    device_class: str = DRIVER_NAME,
    allocated: bool = True,
    reserved_for: Sequence[Mapping[str, Any]] = (),
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A schema-valid ``resource.k8s.io/v1`` ResourceClaim whose allocation has ``results``
    (``{"request", "driver", "pool", "device", ...}``); one ``ExactCount`` request per distinct
    main request name. ``allocated=False`` leaves ``status`` empty. ``reserved_for``: its
    ``status.reservedFor`` consumers (``{"resource": "pods", "name", "uid"}``: what the
    scheduler writes for the pods it binds). ``annotations``: its ``metadata.annotations``."""
    requests: dict[str, int] = {}
    for result in results:
        main = str(result.get("request", "")).split("/", 1)[0]
        requests[main] = requests.get(main, 0) + 1
    claim: dict[str, Any] = {
        "apiVersion": RESOURCE_API,
        "kind": "ResourceClaim",
        "metadata": {
            "namespace": namespace,
            "name": name,
            "uid": uid or str(uuid.uuid4()),
            **({"annotations": dict(annotations)} if annotations else {}),
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": request,
                        "exactly": {
                            "deviceClassName": device_class,
                            "allocationMode": "ExactCount",
                            "count": count,
                        },
                    }
                    for request, count in (requests or {"cpus": 1}).items()
                ]
            }
        },
        "status": {},
    }
    if allocated:
        allocation: dict[str, Any] = {
            "devices": {"results": [dict(r) for r in results]},
            "allocationTimestamp": now(),
        }
        if configs:
            allocation["devices"]["config"] = [dict(c) for c in configs]
        if node_name is not None:
            allocation["nodeSelector"] = {
                "nodeSelectorTerms": [
                    {
                        "matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": [node_name]}
                        ]
                    }
                ]
            }
        claim["status"] = {"allocation": allocation}
        if reserved_for:
            claim["status"]["reservedFor"] = [dict(r) for r in reserved_for]
    return claim


class ApiStore:
    """The objects of the fake API server and the test API over them (synchronous, called from
    the event loop that serves them)."""

    def __init__(
        self,
        *,
        schema_validation: bool = True,
        consumable_capacity: bool = True,
        history: int = DEFAULT_HISTORY,
    ) -> None:
        self.schema: SchemaValidator | None = SchemaValidator() if schema_validation else None
        self.consumable_capacity = consumable_capacity
        """``False``: drop ``allowMultipleAllocations`` and ``capacity[*].requestPolicy`` from
        written slices, like a server without the ``DRAConsumableCapacity`` feature."""
        self._history_limit = history
        self._version = 0
        self._nodes: dict[str, dict[str, Any]] = {}
        self._claims: dict[tuple[str, str], dict[str, Any]] = {}
        self._slices: dict[str, dict[str, Any]] = {}
        self._events: list[WatchEvent] = []
        self._history_start = 0  # a watch from a version below this gets 410 Gone
        self._changed = anyio.Event()

    # --- test API: seeding and reading back ------------------------------------------------

    @property
    def resource_version(self) -> int:
        """The current (highest) resourceVersion."""
        return self._version

    def add_node(
        self, name: str, *, uid: str | None = None, kubelet_version: str | None = None
    ) -> dict[str, Any]:
        """Create a Node: its metadata and, with ``kubelet_version``, the ``status.nodeInfo``
        its kubelet reports (``kubeletVersion`` that version, the other required fields made
        up); a copy of the stored object."""
        node: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
        if kubelet_version is not None:
            node["status"] = {
                "nodeInfo": {
                    "architecture": "amd64",
                    "bootID": "sim-boot",
                    "containerRuntimeVersion": "containerd://2.4.0",
                    "kernelVersion": "6.1.0",
                    "kubeProxyVersion": "",
                    "kubeletVersion": kubelet_version,
                    "machineID": "sim-machine",
                    "operatingSystem": "linux",
                    "osImage": "Debian GNU/Linux 12 (bookworm)",
                    "systemUUID": "sim-system",
                }
            }
        self._stamp_new(node, uid=uid)
        self._check_schema(node, "Node", name)
        self._nodes[name] = node
        return copy.deepcopy(node)

    def add_resource_claim(self, claim: Mapping[str, Any]) -> dict[str, Any]:
        """Store a ResourceClaim (see :func:`build_resource_claim`), replacing one of the same
        namespace and name; it must be valid. A copy of the stored object."""
        obj = copy.deepcopy(dict(claim))
        metadata = obj.setdefault("metadata", {})
        key = (str(metadata.get("namespace", "")), str(metadata.get("name", "")))
        self._stamp_new(obj, uid=metadata.get("uid"))
        self._check_schema(obj, "ResourceClaim", key[1])
        errors = claim_status_errors(obj)
        if errors:
            raise ValueError(f"invalid claim {key}: {errors}")
        self._claims[key] = obj
        return copy.deepcopy(obj)

    def delete_resource_claim(self, namespace: str, name: str) -> None:
        """Remove a claim (a later GET is 404)."""
        del self._claims[(namespace, name)]

    def resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """A copy of a stored claim."""
        return copy.deepcopy(self._claims[(namespace, name)])

    def node(self, name: str) -> dict[str, Any]:
        """A copy of a stored Node."""
        return copy.deepcopy(self._nodes[name])

    def resource_slices(
        self, *, driver: str | None = None, node_name: str | None = None
    ) -> list[dict[str, Any]]:
        """Copies of the stored slices (optionally of one driver / node), sorted by name."""
        return [
            copy.deepcopy(obj)
            for name, obj in sorted(self._slices.items())
            if (driver is None or dig(obj, ("spec", "driver")) == driver)
            and (node_name is None or dig(obj, ("spec", "nodeName")) == node_name)
        ]

    def pool_generations(
        self, *, driver: str | None = None, node_name: str | None = None
    ) -> list[int]:
        """The pool generation of each stored slice (cheap: no copies), in name order."""
        return [
            int(dig(obj, ("spec", "pool", "generation")) or 0)
            for name, obj in sorted(self._slices.items())
            if (driver is None or dig(obj, ("spec", "driver")) == driver)
            and (node_name is None or dig(obj, ("spec", "nodeName")) == node_name)
        ]

    def slice_names(self, *, driver: str | None = None, node_name: str | None = None) -> list[str]:
        """The names of the stored slices (cheap: no copies), sorted."""
        return [
            name
            for name, obj in sorted(self._slices.items())
            if (driver is None or dig(obj, ("spec", "driver")) == driver)
            and (node_name is None or dig(obj, ("spec", "nodeName")) == node_name)
        ]

    def create_resource_slice(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create a slice as another client would (validated; emits ADDED)."""
        try:
            return copy.deepcopy(self._create_slice(copy.deepcopy(dict(obj))))
        except ApiError as exc:
            raise ValueError(f"{exc.code}: {exc.message}: {list(exc.causes)}") from None

    def edit_resource_slice(
        self, name: str, edit: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any]:
        """Modify a stored slice as someone else would: ``edit`` changes a copy in place, which
        is validated and stored (emits MODIFIED)."""
        obj = copy.deepcopy(self._slices[name])
        edit(obj)
        try:
            return copy.deepcopy(self._update_slice(name, obj))
        except ApiError as exc:
            raise ValueError(f"{exc.code}: {exc.message}: {list(exc.causes)}") from None

    def delete_resource_slice(self, name: str) -> None:
        """Delete a slice as someone else would (emits DELETED)."""
        self._delete_slice(name, {})

    def kubelet_restart(self, node_name: str) -> list[str]:
        """What a restarting kubelet does (kubernetes/kubernetes ``pkg/kubelet/cm/dra/plugin``
        ``DRAPluginManager.wipeResourceSlices``, at start-up): delete every
        ResourceSlice with ``spec.nodeName`` = ``node_name``. The deleted names."""
        names = [
            n for n, o in sorted(self._slices.items()) if dig(o, ("spec", "nodeName")) == node_name
        ]
        for name in names:
            self._delete_slice(name, {})
        return names

    def compact(self) -> None:
        """Forget the watch history (etcd compaction): resuming from any earlier version gets
        ``410 Gone``, so clients must list again."""
        self._events.clear()
        self._history_start = self._version

    # --- bookkeeping ------------------------------------------------------------------------

    def _next_version(self) -> int:
        self._version += 1
        return self._version

    def _stamp_new(self, obj: dict[str, Any], *, uid: object) -> None:
        metadata = obj.setdefault("metadata", {})
        metadata["uid"] = uid if isinstance(uid, str) and uid else str(uuid.uuid4())
        metadata["creationTimestamp"] = now()
        metadata["resourceVersion"] = str(self._next_version())

    def _check_schema(self, obj: Mapping[str, Any], kind: str, name: str) -> None:
        if self.schema is not None:
            errors = self.schema.errors(obj)
            if errors:
                raise ValueError(f"invalid {kind} {name!r}: {errors}")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _record_event(self, kind: str, obj: dict[str, Any]) -> None:
        # Stored objects are never modified in place (every write stores a new object), so
        # events and the store can share them.
        self._events.append(WatchEvent(self._version, kind, obj))
        if len(self._events) > self._history_limit:
            dropped = self._events[: len(self._events) - self._history_limit]
            del self._events[: len(dropped)]
            self._history_start = dropped[-1].version
        self._notify()

    # --- resource slices -------------------------------------------------------------------

    def _invalid(self, kind: str, name: str, causes: list[str]) -> ApiError:
        message = f'{kind}.{_GROUP} "{name}" is invalid: ' + (
            causes[0] if len(causes) == 1 else "[" + ", ".join(causes) + "]"
        )
        details = {
            "name": name,
            "group": _GROUP,
            "kind": kind,
            "causes": [{"reason": "FieldValueInvalid", "message": c} for c in causes],
        }
        return ApiError(422, message, causes=causes, details=details)

    def _drop_disabled_fields(self, obj: dict[str, Any]) -> None:
        if self.consumable_capacity:
            return
        for device in dig(obj, ("spec", "devices")) or []:
            if not isinstance(device, dict):
                continue
            for key in _CONSUMABLE_DEVICE_FIELDS:
                device.pop(key, None)
            for entry in (device.get("capacity") or {}).values():
                if isinstance(entry, dict):
                    for key in _CONSUMABLE_CAPACITY_FIELDS:
                        entry.pop(key, None)

    def _validate_slice(self, obj: dict[str, Any], name: str) -> None:
        causes = list(self.schema.errors(obj)) if self.schema is not None else []
        causes.extend(validate_slice(obj))
        if causes:
            raise self._invalid("ResourceSlice", name, causes)

    def _check_type(self, obj: dict[str, Any], api_version: str, kind: str) -> None:
        for key, expected in (("apiVersion", api_version), ("kind", kind)):
            value = obj.setdefault(key, expected)
            if value != expected:
                raise ApiError(
                    400, f"the {key} in the data ({value}) does not match the expected {expected}"
                )

    def _create_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._check_type(obj, RESOURCE_API, "ResourceSlice")
        metadata = obj.setdefault("metadata", {})
        if not isinstance(metadata, dict):
            raise ApiError(400, "metadata must be an object")
        for key in ("resourceVersion", "uid", "creationTimestamp", "generation"):
            metadata.pop(key, None)
        if not metadata.get("name") and metadata.get("generateName"):
            while True:
                suffix = "".join(secrets.choice(_NAME_ALPHABET) for _ in range(5))
                candidate = f"{metadata['generateName']}{suffix}"
                if candidate not in self._slices:
                    metadata["name"] = candidate
                    break
        name = str(metadata.get("name") or "")
        if not name:
            raise self._invalid("ResourceSlice", name, ["metadata.name: Required value"])
        self._drop_disabled_fields(obj)
        metadata["generation"] = 1
        metadata["uid"] = str(uuid.uuid4())
        metadata["creationTimestamp"] = now()
        metadata["resourceVersion"] = str(self._version + 1)
        self._validate_slice(obj, name)
        if name in self._slices:
            raise ApiError(
                409,
                f'resourceslices.{_GROUP} "{name}" already exists',
                details={"name": name, "group": _GROUP, "kind": "resourceslices"},
            )
        self._next_version()
        self._slices[name] = obj
        self._record_event("ADDED", obj)
        return obj

    def _not_found(self, resource: str, name: str) -> ApiError:
        group = f".{_GROUP}" if resource != "nodes" else ""
        return ApiError(
            404,
            f'{resource}{group} "{name}" not found',
            details={"name": name, "group": _GROUP if group else "", "kind": resource},
        )

    def _conflict(self, resource: str, name: str, why: str) -> ApiError:
        return ApiError(
            409,
            f'Operation cannot be fulfilled on {resource}.{_GROUP} "{name}": {why}',
            details={"name": name, "group": _GROUP, "kind": resource},
        )

    def _update_slice(self, name: str, obj: dict[str, Any]) -> dict[str, Any]:
        self._check_type(obj, RESOURCE_API, "ResourceSlice")
        metadata = obj.get("metadata")
        if not isinstance(metadata, dict):
            raise ApiError(400, "metadata must be an object")
        if metadata.get("name") != name:
            raise ApiError(
                400, f"the name of the object ({metadata.get('name')}) does not match the URL"
            )
        old = self._slices.get(name)
        if old is None:
            raise self._not_found("resourceslices", name)
        old_meta = old["metadata"]
        stale = "the object has been modified; please apply your changes to the latest version"
        if metadata.get("resourceVersion") not in (None, "", old_meta["resourceVersion"]):
            raise self._conflict("resourceslices", name, stale + " and try again")
        if metadata.get("uid") not in (None, "", old_meta["uid"]):
            raise self._conflict(
                "resourceslices",
                name,
                f"Precondition failed: UID in precondition: {metadata['uid']}, "
                f"UID in object meta: {old_meta['uid']}",
            )
        self._drop_disabled_fields(obj)
        causes = [
            f"{'.'.join(path)}: Invalid value: field is immutable"
            for path in _IMMUTABLE_SLICE_FIELDS
            if dig(obj, path) != dig(old, path)
        ]
        if causes:
            raise self._invalid("ResourceSlice", name, causes)
        for key in ("uid", "creationTimestamp"):
            metadata[key] = old_meta[key]
        metadata["generation"] = old_meta.get("generation", 1) + (
            obj.get("spec") != old.get("spec")
        )
        metadata["resourceVersion"] = old_meta["resourceVersion"]
        if obj == old:
            return old  # nothing changed: no new version, no event
        metadata["resourceVersion"] = str(self._version + 1)
        self._validate_slice(obj, name)
        self._next_version()
        self._slices[name] = obj
        self._record_event("MODIFIED", obj)
        return obj

    def _delete_slice(self, name: str, options: Mapping[str, Any]) -> dict[str, Any]:
        old = self._slices.get(name)
        if old is None:
            raise self._not_found("resourceslices", name)
        preconditions = options.get("preconditions") or {}
        for key in ("uid", "resourceVersion"):
            wanted = preconditions.get(key)
            actual = old["metadata"].get(key)
            if wanted not in (None, "") and wanted != actual:
                label = "UID" if key == "uid" else "ResourceVersion"
                raise self._conflict(
                    "resourceslices",
                    name,
                    f"Precondition failed: {label} in precondition: {wanted}, "
                    f"{label} in object meta: {actual}",
                )
        del self._slices[name]
        self._next_version()
        gone = {**old, "metadata": {**old["metadata"], "resourceVersion": str(self._version)}}
        self._record_event("DELETED", gone)
        return gone

    # --- claims ------------------------------------------------------------------------------

    def _claim(self, namespace: str, name: str) -> dict[str, Any]:
        claim = self._claims.get((namespace, name))
        if claim is None:
            raise self._not_found("resourceclaims", name)
        return claim

    def _write_claim_status(self, namespace: str, name: str, patched: Mapping[str, Any]) -> Any:
        old = self._claim(namespace, name)
        meta = patched.get("metadata") if isinstance(patched.get("metadata"), Mapping) else {}
        assert isinstance(meta, Mapping)
        stale = "the object has been modified; please apply your changes to the latest version"
        if meta.get("resourceVersion") not in (None, "", old["metadata"]["resourceVersion"]):
            raise self._conflict("resourceclaims", name, stale + " and try again")
        if meta.get("uid") not in (None, "", old["metadata"]["uid"]):
            raise self._conflict(
                "resourceclaims",
                name,
                f"Precondition failed: UID in precondition: {meta['uid']}, "
                f"UID in object meta: {old['metadata']['uid']}",
            )
        # The versions share what a status write leaves alone (spec, most of metadata): a
        # stored claim is never changed in place, every read hands out a copy or JSON.
        new = dict(old)
        new["metadata"] = dict(old["metadata"])
        new["status"] = copy.deepcopy(patched.get("status") or {})  # status subresource only
        if new == old:
            return old
        causes = claim_status_errors(new)
        if self.schema is not None:
            causes.extend(self.schema.errors(new))
        if causes:
            raise self._invalid("ResourceClaim", name, causes)
        new["metadata"]["resourceVersion"] = str(self._next_version())
        self._claims[(namespace, name)] = new
        return new
