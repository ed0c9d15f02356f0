"""An in-process fake Kubernetes API server for tests, benchmarks and ``dracpu sim``.

The REAL ``kubernetes`` client talks plain HTTP/1.1 to it (``aiohttp.web`` on
``127.0.0.1:<random port>``); :func:`open_fake_apiserver` writes a kubeconfig pointing at it
(token auth, accepted and ignored)::

    async with open_fake_apiserver() as api:
        api.add_node("node-a")
        async with open_kube_client(api.kubeconfig_path) as kube:
            ...

Served (``resource.k8s.io/v1`` and core ``v1``):

- ``nodes``: GET one, LIST;
- ``resourceclaims`` (namespaced): GET; ``/status`` GET, PUT, and PATCH as JSON merge patch,
  strategic merge patch (applied as a merge patch) or JSON patch;
- ``resourceslices``: LIST (``fieldSelector`` on ``spec.driver``, ``spec.nodeName``,
  ``metadata.name``, as the real server; others are 400), WATCH (``?watch=true``: JSON lines,
  ``resourceVersion`` semantics, ``410 Gone`` as an ``ERROR`` event for a compacted version,
  ``timeoutSeconds``, bookmarks), GET, POST (``generateName`` too), PUT, DELETE (with ``uid`` /
  ``resourceVersion`` preconditions) and DELETE of a collection (the kubelet's wipe).

Bookkeeping like the real server: one global ``resourceVersion`` counter, ``uid``,
``creationTimestamp``, ``metadata.generation`` bumped on spec changes, no-op updates that change
nothing, 409 for a stale ``resourceVersion`` or an existing name, 404, immutable slice fields.
Every written ResourceSlice is checked against the strict OpenAPI schema and the server's own
rules (:mod:`dracpu.sim.apiserver_validation`); an invalid object gets ``422`` with a ``Status``
body listing the causes, as the real server answers.

Test controls: :meth:`FakeApiServer.fail_next` (the next N matching requests get an HTTP error or
a dropped connection), :attr:`FakeApiServer.consumable_capacity` (``False``: behave like a server
without ``DRAConsumableCapacity``, dropping ``allowMultipleAllocations`` and ``requestPolicy``),
:meth:`~FakeApiServer.kubelet_restart` (delete every slice of a node), writes "by someone else"
(:meth:`~FakeApiServer.edit_resource_slice`, ...), :meth:`~FakeApiServer.compact`,
:meth:`~FakeApiServer.break_watches`, and the log of :attr:`~FakeApiServer.requests`.
"""

from __future__ import annotations

import bisect
import copy
import json
import logging
import re
import secrets
import shutil
import ssl
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
from aiohttp import web

from dracpu import DRIVER_NAME
from dracpu.core.slices import validate_slice
from dracpu.sim.apiserver_patch import PatchError, apply_json_patch, apply_merge_patch
from dracpu.sim.apiserver_validation import SchemaValidator, claim_status_errors

__all__ = [
    "FakeApiServer",
    "RecordedRequest",
    "build_resource_claim",
    "open_fake_apiserver",
]

logger = logging.getLogger(__name__)

_GROUP = "resource.k8s.io"
_RESOURCE_API = "resource.k8s.io/v1"
_SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
_ROUTES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("nodes", re.compile(r"^/api/v1/nodes$")),
    ("node", re.compile(r"^/api/v1/nodes/(?P<name>[^/]+)$")),
    ("slices", re.compile(r"^/apis/resource\.k8s\.io/v1/resourceslices$")),
    ("slice", re.compile(r"^/apis/resource\.k8s\.io/v1/resourceslices/(?P<name>[^/]+)$")),
    (
        "claim",
        re.compile(
            r"^/apis/resource\.k8s\.io/v1/namespaces/(?P<namespace>[^/]+)/resourceclaims/"
            r"(?P<name>[^/]+)$"
        ),
    ),
    (
        "claim_status",
        re.compile(
            r"^/apis/resource\.k8s\.io/v1/namespaces/(?P<namespace>[^/]+)/resourceclaims/"
            r"(?P<name>[^/]+)/status$"
        ),
    ),
)
# Field selectors the real server supports for ResourceSlices (resource/v1
# ResourceSliceSelectorNodeName, ResourceSliceSelectorDriver, plus the generic metadata.name).
_SLICE_FIELDS = {
    "metadata.name": ("metadata", "name"),
    "spec.driver": ("spec", "driver"),
    "spec.nodeName": ("spec", "nodeName"),
}
# Fields a server without DRAConsumableCapacity drops from devices (its dropDisabledFields).
_CONSUMABLE_DEVICE_FIELDS = ("allowMultipleAllocations",)
_CONSUMABLE_CAPACITY_FIELDS = ("requestPolicy",)
# ResourceSlice fields that are immutable (resource/v1 validation: driver, pool name, node name).
_IMMUTABLE_SLICE_FIELDS = (("spec", "driver"), ("spec", "pool", "name"), ("spec", "nodeName"))
# The real server keeps a watch open for minRequestTimeout (1800 s) when no timeout is asked.
_DEFAULT_WATCH_SECONDS = 1800.0
# How often an idle watch checks whether its client went away or the server is closing.
_WATCH_POLL_SECONDS = 0.5
# Watch events kept for resuming watches; older versions get 410 Gone (etcd compaction).
DEFAULT_HISTORY = 10_000
# Characters of generateName suffixes (k8s.io/apiserver names.SimpleNameGenerator: 5 of these).
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_PATCH_TYPES = {
    "application/merge-patch+json": "merge",
    "application/strategic-merge-patch+json": "merge",
    "application/json-patch+json": "json",
}
_REASONS = {
    400: "BadRequest",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One request the fake server answered (or dropped: ``status`` 0)."""

    method: str
    path: str
    query: Mapping[str, str]
    content_type: str
    status: int
    headers: Mapping[str, str]
    """The request's header fields as sent (names as the client spelled them; a repeated
    field keeps its last value)."""

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")


@dataclass(slots=True)
class _Fault:
    status: int | None  # None: drop the connection
    remaining: int
    method: str | None
    path: str | None
    watch: bool | None
    message: str

    def matches(self, method: str, path: str, watch: bool) -> bool:
        return (
            (self.method is None or self.method == method)
            and (self.path is None or self.path in path)
            and (self.watch is None or self.watch == watch)
        )


@dataclass(frozen=True, slots=True)
class _Event:
    version: int
    type: str
    obj: dict[str, Any]


class _HttpError(Exception):
    def __init__(
        self, code: int, message: str, *, causes: Sequence[str] = (), details: Any = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.causes = tuple(causes)
        self.details = details or {}


def _status_body(
    code: int, message: str, *, details: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": _REASONS.get(code, "Unknown"),
        "code": code,
    }
    if details:
        body["details"] = dict(details)
    return body


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _dig(obj: Mapping[str, Any], path: Sequence[str]) -> Any:
    node: Any = obj
    for key in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


def _parse_field_selector(text: str) -> list[tuple[tuple[str, ...], str, str]]:
    requirements: list[tuple[tuple[str, ...], str, str]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"([^=!]+)(==|=|!=)(.*)", part)
        if match is None:
            raise _HttpError(400, f"invalid field selector: {part!r}")
        key, op, value = match.groups()
        if key not in _SLICE_FIELDS:
            raise _HttpError(
                400, f'"{key}" is not a known field selector: only "{", ".join(_SLICE_FIELDS)}"'
            )
        requirements.append((_SLICE_FIELDS[key], "!=" if op == "!=" else "=", value))
    return requirements


def _selected(
    obj: Mapping[str, Any], requirements: Sequence[tuple[tuple[str, ...], str, str]]
) -> bool:
    for path, op, value in requirements:
        actual = _dig(obj, path)
        actual_text = "" if actual is None else str(actual)
        if (actual_text == value) != (op == "="):
            return False
    return True


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
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A schema-valid ``resource.k8s.io/v1`` ResourceClaim whose allocation has ``results``
    (``{"request", "driver", "pool", "device", ...}``); one ``ExactCount`` request per distinct
    main request name. ``allocated=False`` leaves ``status`` empty."""
    requests: dict[str, int] = {}
    for result in results:
        main = str(result.get("request", "")).split("/", 1)[0]
        requests[main] = requests.get(main, 0) + 1
    claim: dict[str, Any] = {
        "apiVersion": _RESOURCE_API,
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
            "allocationTimestamp": _now(),
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
    return claim


class FakeApiServer:
    """State and HTTP handlers of the fake API server. Start it with
    :func:`open_fake_apiserver`; the methods below are the test API (synchronous, called from
    the same event loop)."""

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
        self.requests: list[RecordedRequest] = []
        """Every request answered, oldest first."""
        self.url = ""
        self.kubeconfig_path = Path()
        self._history_limit = history
        self._version = 0
        self._nodes: dict[str, dict[str, Any]] = {}
        self._claims: dict[tuple[str, str], dict[str, Any]] = {}
        self._slices: dict[str, dict[str, Any]] = {}
        self._events: list[_Event] = []
        self._history_start = 0  # a watch from a version below this gets 410 Gone
        self._faults: list[_Fault] = []
        self._changed = anyio.Event()
        self._watch_epoch = 0
        self._closing = False
        self.open_watches = 0
        """How many watch streams are open right now."""

    # --- test API: seeding and reading back ------------------------------------------------

    @property
    def resource_version(self) -> int:
        """The current (highest) resourceVersion."""
        return self._version

    def add_node(self, name: str, *, uid: str | None = None) -> dict[str, Any]:
        """Create a Node (only its metadata); a copy of the stored object."""
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
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
            if (driver is None or _dig(obj, ("spec", "driver")) == driver)
            and (node_name is None or _dig(obj, ("spec", "nodeName")) == node_name)
        ]

    def slice_names(self, *, driver: str | None = None, node_name: str | None = None) -> list[str]:
        """The names of the stored slices (cheap: no copies), sorted."""
        return [
            name
            for name, obj in sorted(self._slices.items())
            if (driver is None or _dig(obj, ("spec", "driver")) == driver)
            and (node_name is None or _dig(obj, ("spec", "nodeName")) == node_name)
        ]

    def create_resource_slice(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create a slice as another client would (validated; emits ADDED)."""
        try:
            return copy.deepcopy(self._create_slice(copy.deepcopy(dict(obj))))
        except _HttpError as exc:
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
        except _HttpError as exc:
            raise ValueError(f"{exc.code}: {exc.message}: {list(exc.causes)}") from None

    def delete_resource_slice(self, name: str) -> None:
        """Delete a slice as someone else would (emits DELETED)."""
        self._delete_slice(name, {})

    def kubelet_restart(self, node_name: str) -> list[str]:
        """What a restarting kubelet does (reference kubelet-and-k8s-api.md §2.5): delete every
        ResourceSlice with ``spec.nodeName`` = ``node_name``. The deleted names."""
        names = [
            n for n, o in sorted(self._slices.items()) if _dig(o, ("spec", "nodeName")) == node_name
        ]
        for name in names:
            self._delete_slice(name, {})
        return names

    # --- test API: faults ------------------------------------------------------------------

    def fail_next(
        self,
        count: int = 1,
        *,
        status: int | None = 500,
        method: str | None = None,
        path: str | None = None,
        watch: bool | None = None,
        message: str = "injected failure",
    ) -> None:
        """The next ``count`` requests matching ``method`` (``GET``, ``PUT``, ...), a ``path``
        substring and ``watch`` get HTTP ``status`` with a Status body, or with
        ``status=None`` a dropped connection (no answer). Faults are consumed in order."""
        self._faults.append(_Fault(status, count, method, path, watch, message))

    def clear_faults(self) -> None:
        """Forget the injected failures that have not happened yet."""
        self._faults.clear()

    def pending_faults(self) -> int:
        """How many injected failures have not happened yet."""
        return sum(f.remaining for f in self._faults)

    def compact(self) -> None:
        """Forget the watch history (etcd compaction): resuming from any earlier version gets
        ``410 Gone``, so clients must list again."""
        self._events.clear()
        self._history_start = self._version

    def break_watches(self) -> None:
        """Drop the connection of every open watch (clients must reconnect)."""
        self._watch_epoch += 1
        self._notify()

    # --- bookkeeping ------------------------------------------------------------------------

    def _next_version(self) -> int:
        self._version += 1
        return self._version

    def _stamp_new(self, obj: dict[str, Any], *, uid: object) -> None:
        metadata = obj.setdefault("metadata", {})
        metadata["uid"] = uid if isinstance(uid, str) and uid else str(uuid.uuid4())
        metadata["creationTimestamp"] = _now()
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
        self._events.append(_Event(self._version, kind, obj))
        if len(self._events) > self._history_limit:
            dropped = self._events[: len(self._events) - self._history_limit]
            del self._events[: len(dropped)]
            self._history_start = dropped[-1].version
        self._notify()

    # --- resource slices -------------------------------------------------------------------

    def _invalid(self, kind: str, name: str, causes: list[str]) -> _HttpError:
        message = f'{kind}.{_GROUP} "{name}" is invalid: ' + (
            causes[0] if len(causes) == 1 else "[" + ", ".join(causes) + "]"
        )
        details = {
            "name": name,
            "group": _GROUP,
            "kind": kind,
            "causes": [{"reason": "FieldValueInvalid", "message": c} for c in causes],
        }
        return _HttpError(422, message, causes=causes, details=details)

    def _drop_disabled_fields(self, obj: dict[str, Any]) -> None:
        if self.consumable_capacity:
            return
        for device in _dig(obj, ("spec", "devices")) or []:
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
                raise _HttpError(
                    400, f"the {key} in the data ({value}) does not match the expected {expected}"
                )

    def _create_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._check_type(obj, _RESOURCE_API, "ResourceSlice")
        metadata = obj.setdefault("metadata", {})
        if not isinstance(metadata, dict):
            raise _HttpError(400, "metadata must be an object")
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
        metadata["creationTimestamp"] = _now()
        metadata["resourceVersion"] = str(self._version + 1)
        self._validate_slice(obj, name)
        if name in self._slices:
            raise _HttpError(
                409,
                f'resourceslices.{_GROUP} "{name}" already exists',
                details={"name": name, "group": _GROUP, "kind": "resourceslices"},
            )
        self._next_version()
        self._slices[name] = obj
        self._record_event("ADDED", obj)
        return obj

    def _not_found(self, resource: str, name: str) -> _HttpError:
        group = f".{_GROUP}" if resource != "nodes" else ""
        return _HttpError(
            404,
            f'{resource}{group} "{name}" not found',
            details={"name": name, "group": _GROUP if group else "", "kind": resource},
        )

    def _conflict(self, resource: str, name: str, why: str) -> _HttpError:
        return _HttpError(
            409,
            f'Operation cannot be fulfilled on {resource}.{_GROUP} "{name}": {why}',
            details={"name": name, "group": _GROUP, "kind": resource},
        )

    def _update_slice(self, name: str, obj: dict[str, Any]) -> dict[str, Any]:
        self._check_type(obj, _RESOURCE_API, "ResourceSlice")
        metadata = obj.get("metadata")
        if not isinstance(metadata, dict):
            raise _HttpError(400, "metadata must be an object")
        if metadata.get("name") != name:
            raise _HttpError(
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
            if _dig(obj, path) != _dig(old, path)
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

    # --- HTTP ------------------------------------------------------------------------------

    def _take_fault(self, method: str, path: str, watch: bool) -> _Fault | None:
        for fault in self._faults:
            if fault.remaining > 0 and fault.matches(method, path, watch):
                fault.remaining -= 1
                if fault.remaining == 0:
                    self._faults.remove(fault)
                return fault
        return None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """The aiohttp handler of every path."""
        query = dict(request.query)
        watch = query.get("watch") in ("true", "1")
        content_type = request.headers.get("Content-Type", "")
        status = 0
        try:
            fault = self._take_fault(request.method, request.path, watch)
            if fault is not None:
                if fault.status is None:
                    if request.transport is not None:
                        request.transport.abort()
                    raise web.HTTPInternalServerError()  # never reaches the client
                raise _HttpError(fault.status, fault.message)
            response = await self._dispatch(request, query, watch)
            status = response.status
            return response
        except _HttpError as exc:
            status = exc.code
            return web.json_response(
                _status_body(exc.code, exc.message, details=exc.details), status=exc.code
            )
        finally:
            self.requests.append(
                RecordedRequest(
                    request.method,
                    request.path,
                    query,
                    content_type,
                    status,
                    {
                        name.decode("latin-1"): value.decode("latin-1")
                        for name, value in request.raw_headers
                    },
                )
            )

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw) if raw else None
        except ValueError as exc:
            raise _HttpError(400, f"the body is not JSON: {exc}") from None

    async def _object_body(self, request: web.Request) -> dict[str, Any]:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        if content_type != "application/json":
            raise _HttpError(415, f"the body of a {request.method} must be application/json")
        body = await self._body(request)
        if not isinstance(body, dict):
            raise _HttpError(400, "the body must be a JSON object")
        return body

    async def _dispatch(
        self, request: web.Request, query: Mapping[str, str], watch: bool
    ) -> web.StreamResponse:
        method = request.method
        route, params = "", {}
        for name, pattern in _ROUTES:
            match = pattern.match(request.path)
            if match is not None:
                route, params = name, match.groupdict()
                break
        else:
            raise _HttpError(404, "the server could not find the requested resource")
        if route == "nodes" and method == "GET":
            return _json(
                {
                    "apiVersion": "v1",
                    "kind": "NodeList",
                    "metadata": self._list_meta(),
                    "items": [self._nodes[n] for n in sorted(self._nodes)],
                }
            )
        if route == "node" and method == "GET":
            node = self._nodes.get(params["name"])
            if node is None:
                raise self._not_found("nodes", params["name"])
            return _json(node)
        if route in ("claim", "claim_status") and method == "GET":
            return _json(self._claim(params["namespace"], params["name"]))
        if route == "claim_status" and method == "PATCH":
            return _json(await self._patch_claim_status(request, params))
        if route == "claim_status" and method == "PUT":
            body = await self._object_body(request)
            self._check_type(body, _RESOURCE_API, "ResourceClaim")
            return _json(self._write_claim_status(params["namespace"], params["name"], body))
        if route == "slices" and method == "GET":
            requirements = _parse_field_selector(query.get("fieldSelector", ""))
            if watch:
                return await self._watch(request, query, requirements)
            items = [o for _, o in sorted(self._slices.items()) if _selected(o, requirements)]
            return _json(
                {
                    "apiVersion": _RESOURCE_API,
                    "kind": "ResourceSliceList",
                    "metadata": self._list_meta(),
                    "items": items,
                }
            )
        if route == "slices" and method == "POST":
            return _json(self._create_slice(await self._object_body(request)), status=201)
        if route == "slices" and method == "DELETE":
            requirements = _parse_field_selector(query.get("fieldSelector", ""))
            names = [n for n, o in sorted(self._slices.items()) if _selected(o, requirements)]
            items = [self._delete_slice(n, {}) for n in names]
            return _json(
                {
                    "apiVersion": _RESOURCE_API,
                    "kind": "ResourceSliceList",
                    "metadata": self._list_meta(),
                    "items": items,
                }
            )
        if route == "slice" and method == "GET":
            obj = self._slices.get(params["name"])
            if obj is None:
                raise self._not_found("resourceslices", params["name"])
            return _json(obj)
        if route == "slice" and method == "PUT":
            return _json(self._update_slice(params["name"], await self._object_body(request)))
        if route == "slice" and method == "DELETE":
            options = await self._body(request) or {}
            if not isinstance(options, dict):
                raise _HttpError(400, "DeleteOptions must be a JSON object")
            return _json(self._delete_slice(params["name"], options))
        raise _HttpError(405, f"the server does not allow {method} on this resource")

    def _list_meta(self) -> dict[str, str]:
        return {"resourceVersion": str(self._version)}

    async def _patch_claim_status(self, request: web.Request, params: Mapping[str, str]) -> Any:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        kind = _PATCH_TYPES.get(content_type)
        if kind is None:
            raise _HttpError(415, f"the patch type {content_type!r} is not supported")
        patch = await self._body(request)
        old = self._claim(params["namespace"], params["name"])
        try:
            if kind == "json":
                patched = apply_json_patch(old, patch)
            elif isinstance(patch, dict):
                patched = apply_merge_patch(old, patch)
            else:
                raise PatchError("a merge patch must be a JSON object")
        except PatchError as exc:
            raise _HttpError(422, f"the patch does not apply: {exc}") from None
        if not isinstance(patched, dict):
            raise _HttpError(422, "the patch does not leave an object")
        return self._write_claim_status(params["namespace"], params["name"], patched)

    async def _watch(
        self,
        request: web.Request,
        query: Mapping[str, str],
        requirements: Sequence[tuple[tuple[str, ...], str, str]],
    ) -> web.StreamResponse:
        version_text = query.get("resourceVersion", "")
        try:
            start = int(version_text) if version_text not in ("", "0") else None
        except ValueError:
            raise _HttpError(400, f"invalid resourceVersion {version_text!r}") from None
        try:
            seconds = float(query.get("timeoutSeconds", _DEFAULT_WATCH_SECONDS))
        except ValueError:
            raise _HttpError(400, "invalid timeoutSeconds") from None
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        epoch = self._watch_epoch
        self.open_watches += 1

        async def send(kind: str, obj: Mapping[str, Any]) -> None:
            line = json.dumps({"type": kind, "object": obj}, separators=(",", ":")) + "\n"
            await response.write(line.encode())

        try:
            if start is None:
                cursor = self._version
                for _, obj in sorted(self._slices.items()):
                    if _selected(obj, requirements):
                        await send("ADDED", obj)
            else:
                cursor = start
            with anyio.move_on_after(seconds):
                while not self._closing:
                    if cursor < self._history_start:
                        await send(
                            "ERROR",
                            _status_body(
                                410,
                                f"too old resource version: {cursor} ({self._history_start + 1})",
                            ),
                        )
                        return response
                    index = bisect.bisect_right(self._events, cursor, key=_event_version)
                    for event in self._events[index:]:
                        cursor = event.version
                        if _selected(event.obj, requirements):
                            await send(event.type, event.obj)
                    if self._watch_epoch != epoch:
                        if request.transport is not None:
                            request.transport.abort()
                        return response
                    if request.transport is None or request.transport.is_closing():
                        return response
                    changed = self._changed
                    with anyio.move_on_after(_WATCH_POLL_SECONDS):
                        await changed.wait()
            if bookmarks and not self._closing:
                await send(
                    "BOOKMARK",
                    {
                        "apiVersion": _RESOURCE_API,
                        "kind": "ResourceSlice",
                        "metadata": {"resourceVersion": str(self._version)},
                    },
                )
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away
        finally:
            self.open_watches -= 1
        return response

    async def aclose(self) -> None:
        """Wake and end every open watch (used by :func:`open_fake_apiserver`)."""
        self._closing = True
        self._notify()


def _event_version(event: _Event) -> int:
    return event.version


def _json(obj: Any, *, status: int = 200) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(obj, separators=(",", ":")).encode(),
        content_type="application/json",
    )


def _kubeconfig(url: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "fake", "user": {"token": "fake-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        "current-context": "fake",
    }


@asynccontextmanager
async def open_fake_apiserver(
    *,
    schema_validation: bool = True,
    consumable_capacity: bool = True,
    history: int = DEFAULT_HISTORY,
    kubeconfig_dir: Path | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> AsyncIterator[FakeApiServer]:
    """Start a :class:`FakeApiServer` on ``127.0.0.1:<random port>`` and write its kubeconfig
    (``api.kubeconfig_path``; in a temporary directory unless ``kubeconfig_dir`` is given).
    Must run on the asyncio backend (aiohttp). With ``ssl_context`` (a server context) it serves
    HTTPS; the kubeconfig then names no CA, so a client must be given one (a test writes its
    own kubeconfig with ``certificate-authority``)."""
    api = FakeApiServer(
        schema_validation=schema_validation,
        consumable_capacity=consumable_capacity,
        history=history,
    )
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", api.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handle_signals=False)
    await runner.setup()
    directory = kubeconfig_dir or Path(tempfile.mkdtemp(prefix="dracpu-fake-apiserver-"))
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        host, port = runner.addresses[0][:2]
        api.url = f"{'https' if ssl_context else 'http'}://{host}:{port}"
        api.kubeconfig_path = directory / "kubeconfig"
        api.kubeconfig_path.write_text(json.dumps(_kubeconfig(api.url), indent=2))
        logger.debug("fake API server listening on %s", api.url)
        yield api
    finally:
        with anyio.CancelScope(shield=True):
            await api.aclose()
            await runner.cleanup()
            if kubeconfig_dir is None:
                with suppress(OSError):
                    shutil.rmtree(directory)
