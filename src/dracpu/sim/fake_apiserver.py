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

The objects and their bookkeeping (``resourceVersion``, ``uid``, ``generation``, 404, 409, 422 and
immutable fields, as the real server) are :mod:`dracpu.sim.apiserver_store`'s; this module routes
the requests to it, answers errors with a ``Status`` body, streams watches and injects faults.

Test controls: :meth:`FakeApiServer.fail_next` (the next N matching requests get an HTTP error or
a dropped connection), :attr:`FakeApiServer.consumable_capacity` (``False``: behave like a server
without ``DRAConsumableCapacity``, dropping ``allowMultipleAllocations`` and ``requestPolicy``),
:meth:`~FakeApiServer.kubelet_restart` (delete every slice of a node), writes "by someone else"
(:meth:`~FakeApiServer.edit_resource_slice`, ...), :meth:`~FakeApiServer.compact`,
:meth:`~FakeApiServer.break_watches`, and the log of :attr:`~FakeApiServer.requests`.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
import shutil
import ssl
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from aiohttp import web

from dracpu.sim.apiserver_patch import PatchError, apply_json_patch, apply_merge_patch
from dracpu.sim.apiserver_store import (
    DEFAULT_HISTORY,
    RESOURCE_API,
    ApiError,
    ApiStore,
    WatchEvent,
    build_resource_claim,
    dig,
)

__all__ = [
    "FakeApiServer",
    "RecordedRequest",
    "build_resource_claim",
    "open_fake_apiserver",
]

logger = logging.getLogger(__name__)

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
# The real server keeps a watch open for minRequestTimeout (1800 s) when no timeout is asked.
_DEFAULT_WATCH_SECONDS = 1800.0
# How often an idle watch checks whether its client went away or the server is closing.
_WATCH_POLL_SECONDS = 0.5
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


def _parse_field_selector(text: str) -> list[tuple[tuple[str, ...], str, str]]:
    requirements: list[tuple[tuple[str, ...], str, str]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"([^=!]+)(==|=|!=)(.*)", part)
        if match is None:
            raise ApiError(400, f"invalid field selector: {part!r}")
        key, op, value = match.groups()
        if key not in _SLICE_FIELDS:
            raise ApiError(
                400, f'"{key}" is not a known field selector: only "{", ".join(_SLICE_FIELDS)}"'
            )
        requirements.append((_SLICE_FIELDS[key], "!=" if op == "!=" else "=", value))
    return requirements


def _selected(
    obj: Mapping[str, Any], requirements: Sequence[tuple[tuple[str, ...], str, str]]
) -> bool:
    for path, op, value in requirements:
        actual = dig(obj, path)
        actual_text = "" if actual is None else str(actual)
        if (actual_text == value) != (op == "="):
            return False
    return True


class FakeApiServer(ApiStore):
    """The fake API server: its storage (:class:`~dracpu.sim.apiserver_store.ApiStore`) served
    over HTTP, with injected faults and the log of requests. Start it with
    :func:`open_fake_apiserver`; the methods are the test API (synchronous, called from the same
    event loop)."""

    def __init__(
        self,
        *,
        schema_validation: bool = True,
        consumable_capacity: bool = True,
        history: int = DEFAULT_HISTORY,
    ) -> None:
        super().__init__(
            schema_validation=schema_validation,
            consumable_capacity=consumable_capacity,
            history=history,
        )
        self.requests: list[RecordedRequest] = []
        """Every request answered, oldest first."""
        self.url = ""
        self.kubeconfig_path = Path()
        self._faults: list[_Fault] = []
        self._watch_epoch = 0
        self._closing = False
        self.open_watches = 0
        """How many watch streams are open right now."""

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

    def break_watches(self) -> None:
        """Drop the connection of every open watch (clients must reconnect)."""
        self._watch_epoch += 1
        self._notify()

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
                raise ApiError(fault.status, fault.message)
            response = await self._dispatch(request, query, watch)
            status = response.status
            return response
        except ApiError as exc:
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
            raise ApiError(400, f"the body is not JSON: {exc}") from None

    async def _object_body(self, request: web.Request) -> dict[str, Any]:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        if content_type != "application/json":
            raise ApiError(415, f"the body of a {request.method} must be application/json")
        body = await self._body(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
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
            raise ApiError(404, "the server could not find the requested resource")
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
            self._check_type(body, RESOURCE_API, "ResourceClaim")
            return _json(self._write_claim_status(params["namespace"], params["name"], body))
        if route == "slices" and method == "GET":
            requirements = _parse_field_selector(query.get("fieldSelector", ""))
            if watch:
                return await self._watch(request, query, requirements)
            items = [o for _, o in sorted(self._slices.items()) if _selected(o, requirements)]
            return _json(
                {
                    "apiVersion": RESOURCE_API,
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
                    "apiVersion": RESOURCE_API,
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
                raise ApiError(400, "DeleteOptions must be a JSON object")
            return _json(self._delete_slice(params["name"], options))
        raise ApiError(405, f"the server does not allow {method} on this resource")

    def _list_meta(self) -> dict[str, str]:
        return {"resourceVersion": str(self._version)}

    async def _patch_claim_status(self, request: web.Request, params: Mapping[str, str]) -> Any:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        kind = _PATCH_TYPES.get(content_type)
        if kind is None:
            raise ApiError(415, f"the patch type {content_type!r} is not supported")
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
            raise ApiError(422, f"the patch does not apply: {exc}") from None
        if not isinstance(patched, dict):
            raise ApiError(422, "the patch does not leave an object")
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
            raise ApiError(400, f"invalid resourceVersion {version_text!r}") from None
        try:
            seconds = float(query.get("timeoutSeconds", _DEFAULT_WATCH_SECONDS))
        except ValueError:
            raise ApiError(400, "invalid timeoutSeconds") from None
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
                        "apiVersion": RESOURCE_API,
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


def _event_version(event: WatchEvent) -> int:
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
