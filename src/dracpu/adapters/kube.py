"""The Kubernetes API, as dracpu uses it: Nodes (read), ResourceClaims (read, status patch),
ResourceSlices (list, watch, create, update, delete). The ONLY module that imports
``kubernetes`` (design §8: the import costs ~0.5 s and ~30 MiB, so nothing else pays for it).

Built on the official asyncio client ``kubernetes.aio`` (fits our asyncio backend): its
``ApiClient`` loads the kubeconfig or the in-cluster service account (token refresh included),
builds URLs and authenticates; we call it with plain ``dict`` bodies through
``ApiClient.param_serialize`` / ``call_api`` and parse the JSON answers ourselves. Objects are
therefore plain dicts, camelCase as on the wire, with every field the server sent: the generated
pydantic models would drop fields this client version does not know and re-validate every one
of a 128-device slice's fields on each call.

Errors become the :mod:`dracpu.errors` tree, with the HTTP status and the server's message:
404 :class:`KubeNotFoundError`, 409 :class:`KubeConflictError`, other 4xx
:class:`KubeClientError`, 5xx, 429 (too many requests: transient) and every connection failure or
timeout :class:`KubeServerError` (``status`` is ``None`` for those).

Watches (:meth:`KubeClient.watch_resource_slices`) list first, then stream events from the
list's resourceVersion, reconnecting from the last seen version when the server ends the stream;
a ``410 Gone`` (the version was compacted away) makes them list again. A list is reported as one
``("LISTED", <ResourceSliceList>)`` event so the consumer can resynchronise from it.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
from aiohttp.helpers import get_env_proxy_for_url
from kubernetes.aio import client as kube_client
from kubernetes.aio import config as kube_config
from yarl import URL

from dracpu import __version__
from dracpu.errors import (
    ConfigError,
    KubeAPIError,
    KubeClientError,
    KubeConflictError,
    KubeNotFoundError,
    KubeServerError,
)

__all__ = [
    "DEFAULT_REQUEST_TIMEOUT",
    "LISTED",
    "MERGE_PATCH",
    "KubeClient",
    "WatchEvent",
    "consumable_capacity_dropped",
    "open_kube_client",
    "slice_selector",
]

logger = logging.getLogger(__name__)

WatchEvent = tuple[str, dict[str, Any]]
"""``(type, object)``: ``ADDED``/``MODIFIED``/``DELETED`` with the object, or ``LISTED`` with
the whole ``ResourceSliceList`` after a (re)list."""

LISTED = "LISTED"  # our synthetic event type for a (re)list; not an API server event type

# Content types (https://kubernetes.io/docs/reference/using-api/api-concepts/#patch-and-apply).
MERGE_PATCH = "application/merge-patch+json"  # RFC 7386: what we send for claim status patches
_JSON_PATCH = "application/json-patch+json"  # RFC 6902: a list of operations
_JSON = "application/json"

# Client-side timeout of one ordinary request (seconds). client-go has none by default; a
# bounded wait lets the publisher's first attempt finish (and the daemon become ready) while the
# API server is unreachable.
DEFAULT_REQUEST_TIMEOUT = 30.0
# Server-side watch duration: client-go's reflector picks timeoutSeconds uniformly in
# [minWatchTimeout, 2*minWatchTimeout) with minWatchTimeout = 5 min, spreading reconnects.
_WATCH_MIN_SECONDS = 300
# Extra client-side time beyond timeoutSeconds before a silent watch counts as dead.
_WATCH_CLIENT_MARGIN = 30.0
# How much of a non-JSON error body goes into an error message.
_BODY_EXCERPT = 200

_RESOURCE_V1 = "/apis/resource.k8s.io/v1"
_SLICES = _RESOURCE_V1 + "/resourceslices"
_SLICE = _SLICES + "/{name}"
_CLAIM = _RESOURCE_V1 + "/namespaces/{namespace}/resourceclaims/{name}"
_CLAIM_STATUS = _CLAIM + "/status"
_NODE = "/api/v1/nodes/{name}"
# resource.k8s.io/v1 ResourceSliceSelectorDriver / ResourceSliceSelectorNodeName: the field
# selectors the API server supports for ResourceSlices (reference kubelet-and-k8s-api.md §6.4).
_FIELD_DRIVER = "spec.driver"
_FIELD_NODE_NAME = "spec.nodeName"


def slice_selector(driver: str | None, node_name: str | None) -> str:
    """The field selector ``spec.driver=<driver>,spec.nodeName=<node>`` (parts left out when
    ``None``)."""
    parts = []
    if driver is not None:
        parts.append(f"{_FIELD_DRIVER}={driver}")
    if node_name is not None:
        parts.append(f"{_FIELD_NODE_NAME}={node_name}")
    return ",".join(parts)


def consumable_capacity_dropped(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """Whether the API server dropped the consumable-capacity fields of a ResourceSlice.

    A server without the ``DRAConsumableCapacity`` feature (off by default before 1.36) silently
    strips ``allowMultipleAllocations`` and ``capacity[*].requestPolicy`` from the devices it
    stores; ``stored`` is the object it answered a create or update with.
    """
    stored_devices = {
        d.get("name"): d
        for d in (stored.get("spec") or {}).get("devices") or []
        if isinstance(d, Mapping)
    }
    for device in (sent.get("spec") or {}).get("devices") or []:
        if not isinstance(device, Mapping):
            continue
        kept = stored_devices.get(device.get("name"))
        if kept is None:
            continue
        if "allowMultipleAllocations" in device and "allowMultipleAllocations" not in kept:
            return True
        kept_capacity = kept.get("capacity") or {}
        for key, entry in (device.get("capacity") or {}).items():
            if (
                isinstance(entry, Mapping)
                and "requestPolicy" in entry
                and "requestPolicy" not in (kept_capacity.get(key) or {})
            ):
                return True
    return False


def _server_message(body: bytes) -> str:
    """The ``message`` of a Status body, else the start of the body."""
    text = body.decode("utf-8", "replace")
    try:
        status = json.loads(text)
    except ValueError:
        status = None
    if isinstance(status, dict) and isinstance(status.get("message"), str):
        return str(status["message"])
    return text[:_BODY_EXCERPT].strip() or "(empty body)"


def _status_error(what: str, status: int, reason: str, body: bytes) -> KubeAPIError:
    message = f"{what}: {status} {reason}: {_server_message(body)}"
    if status == 404:
        return KubeNotFoundError(message, status=status)
    if status == 409:
        return KubeConflictError(message, status=status)
    if status == 429 or status >= 500:
        return KubeServerError(message, status=status)
    return KubeClientError(message, status=status)


def _json_object(what: str, body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise KubeServerError(f"{what}: the API server sent invalid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise KubeServerError(f"{what}: the API server sent {type(obj).__name__}, not an object")
    return obj


def _resource_version(obj: Mapping[str, Any]) -> str | None:
    metadata = obj.get("metadata")
    if isinstance(metadata, Mapping):
        value = metadata.get("resourceVersion")
        if isinstance(value, str) and value:
            return value
    return None


class KubeClient:
    """The calls dracpu makes; every object in and out is a plain JSON ``dict``.

    Use :func:`open_kube_client` to get one. ``request_timeout`` bounds each ordinary request;
    ``watch_seconds`` (``None``: 5-10 min, randomised) is the server-side duration of one watch
    request before it is renewed.
    """

    def __init__(
        self,
        api_client: Any,
        *,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        watch_seconds: int | None = None,
    ) -> None:
        self._api = api_client
        self._request_timeout = request_timeout
        self._watch_seconds = watch_seconds

    # --- plumbing --------------------------------------------------------------------------

    async def _send(
        self,
        method: str,
        path: str,
        what: str,
        *,
        path_params: Mapping[str, str] | None = None,
        query: Sequence[tuple[str, object]] = (),
        body: object = None,
        content_type: str = _JSON,
        request_seconds: float | None = None,
    ) -> Any:
        """Send one request; the raw ``aiohttp`` response (the caller releases it)."""
        headers = {"Accept": _JSON, "Content-Type": content_type}
        try:
            serialized = await self._api.param_serialize(
                method=method,
                resource_path=path,
                path_params=dict(path_params or {}),
                query_params=list(query),
                header_params=headers,
                body=None,  # ours are plain JSON values already: skip the model sanitizer
                auth_settings=["BearerToken"],
            )
            _, url, header_params, _, post_params = serialized
            response = await self._api.call_api(
                method,
                url,
                header_params=header_params,
                body=body,  # json.dumps'ed by the client's REST layer
                post_params=post_params,
                _request_timeout=request_seconds or self._request_timeout,
            )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise KubeServerError(f"{what}: cannot reach the API server: {exc!r}") from exc
        except kube_client.ApiException as exc:
            raise _status_error(what, exc.status or 0, exc.reason or "", b"") from exc
        return response.response

    async def _request(
        self,
        method: str,
        path: str,
        what: str,
        *,
        path_params: Mapping[str, str] | None = None,
        query: Sequence[tuple[str, object]] = (),
        body: object = None,
        content_type: str = _JSON,
    ) -> dict[str, Any]:
        response = await self._send(
            method,
            path,
            what,
            path_params=path_params,
            query=query,
            body=body,
            content_type=content_type,
        )
        try:
            data = await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise KubeServerError(f"{what}: reading the answer failed: {exc!r}") from exc
        finally:
            response.release()
        if response.status >= 400:
            raise _status_error(what, response.status, response.reason or "", data)
        return _json_object(what, data)

    # --- nodes and claims ------------------------------------------------------------------

    async def get_node(self, name: str) -> dict[str, Any]:
        """GET the Node (the slice publisher needs its ``metadata.uid``)."""
        return await self._request("GET", _NODE, f"get node {name}", path_params={"name": name})

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """GET ``resource.k8s.io/v1`` ResourceClaim ``namespace/name``."""
        return await self._request(
            "GET",
            _CLAIM,
            f"get resourceclaim {namespace}/{name}",
            path_params={"namespace": namespace, "name": name},
        )

    async def patch_resource_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any] | Sequence[Any]
    ) -> dict[str, Any]:
        """PATCH the claim's ``status`` subresource; the updated claim.

        A mapping is sent as a JSON merge patch (RFC 7386; put ``metadata.resourceVersion`` in it
        to make the server refuse a stale write with 409), a list as a JSON patch (RFC 6902).
        """
        content_type = _JSON_PATCH if isinstance(patch, Sequence) else MERGE_PATCH
        body = list(patch) if isinstance(patch, Sequence) else dict(patch)
        return await self._request(
            "PATCH",
            _CLAIM_STATUS,
            f"patch resourceclaim {namespace}/{name} status",
            path_params={"namespace": namespace, "name": name},
            body=body,
            content_type=content_type,
        )

    # --- resource slices -------------------------------------------------------------------

    async def list_resource_slices(
        self, driver: str | None, node_name: str | None
    ) -> tuple[list[dict[str, Any]], str]:
        """The ResourceSlices of ``driver`` on ``node_name`` (server-side field selector) and the
        list's resourceVersion (to watch from)."""
        selector = slice_selector(driver, node_name)
        obj = await self._request(
            "GET", _SLICES, f"list resourceslices {selector}", query=[("fieldSelector", selector)]
        )
        items = obj.get("items")
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise KubeServerError(f"list resourceslices {selector}: no list of items in the answer")
        return items, _resource_version(obj) or ""

    async def get_resource_slice(self, name: str) -> dict[str, Any]:
        """GET one ResourceSlice."""
        return await self._request(
            "GET", _SLICE, f"get resourceslice {name}", path_params={"name": name}
        )

    async def create_resource_slice(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """POST a ResourceSlice; the object as stored (compare it with what was sent: the server
        drops fields of disabled features). 409 if the name exists."""
        name = (obj.get("metadata") or {}).get("name") or "(generated)"
        return await self._request("POST", _SLICES, f"create resourceslice {name}", body=dict(obj))

    async def update_resource_slice(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """PUT a ResourceSlice (``metadata.resourceVersion`` makes it conditional: 409 when the
        stored object changed since); the object as stored."""
        name = str((obj.get("metadata") or {}).get("name") or "")
        if not name:
            raise KubeClientError("update resourceslice: the object has no metadata.name")
        return await self._request(
            "PUT",
            _SLICE,
            f"update resourceslice {name}",
            path_params={"name": name},
            body=dict(obj),
        )

    async def delete_resource_slice(
        self, name: str, *, uid: str | None = None, resource_version: str | None = None
    ) -> None:
        """DELETE a ResourceSlice, only if it still has this ``uid`` / ``resource_version``
        (409 otherwise); 404 if it is gone already."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        preconditions = {
            key: value
            for key, value in (("uid", uid), ("resourceVersion", resource_version))
            if value is not None
        }
        if preconditions:
            body["preconditions"] = preconditions
        await self._request(
            "DELETE", _SLICE, f"delete resourceslice {name}", path_params={"name": name}, body=body
        )

    async def watch_resource_slices(
        self, driver: str | None, node_name: str | None
    ) -> AsyncGenerator[WatchEvent, None]:
        """List, then watch, the ResourceSlices of ``driver`` on ``node_name``, forever.

        Yields ``(LISTED, list)`` after every (re)list, then ``(type, object)`` for ``ADDED``,
        ``MODIFIED`` and ``DELETED``. A stream the server closes is renewed from the last
        resourceVersion (bookmarks requested); ``410 Gone`` relists. Any other failure raises a
        :class:`~dracpu.errors.KubeAPIError` (the caller backs off and calls again). Close the
        iterator with ``contextlib.aclosing`` so the connection is released promptly.
        """
        selector = slice_selector(driver, node_name)
        what = f"watch resourceslices {selector}"
        version: str | None = None
        while True:
            if version is None:
                items, version = await self.list_resource_slices(driver, node_name)
                yield (
                    LISTED,
                    {
                        "apiVersion": "resource.k8s.io/v1",
                        "kind": "ResourceSliceList",
                        "metadata": {"resourceVersion": version},
                        "items": items,
                    },
                )
            seconds = self._watch_seconds or random.randrange(
                _WATCH_MIN_SECONDS, 2 * _WATCH_MIN_SECONDS
            )
            query: list[tuple[str, object]] = [
                ("fieldSelector", selector),
                ("watch", "true"),
                ("allowWatchBookmarks", "true"),
                ("timeoutSeconds", str(seconds)),
            ]
            if version:
                query.append(("resourceVersion", version))
            response = await self._send(
                "GET", _SLICES, what, query=query, request_seconds=seconds + _WATCH_CLIENT_MARGIN
            )
            try:
                if response.status == 410:
                    logger.info("%s: resourceVersion %s is too old, relisting", what, version)
                    version = None
                    continue
                if response.status >= 400:
                    try:
                        data = await response.read()
                    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                        # The status is known; only the server's message was lost.
                        data = f"(reading the answer failed: {exc!r})".encode()
                    raise _status_error(what, response.status, response.reason or "", data)
                while True:
                    try:
                        line = await response.content.readline()
                    except TimeoutError:
                        break  # the client-side deadline: renew the watch
                    except (aiohttp.ClientError, OSError) as exc:
                        raise KubeServerError(f"{what}: the stream broke: {exc!r}") from exc
                    if not line:
                        break  # the server ended the stream (timeoutSeconds)
                    if not line.strip():
                        continue
                    event = _json_object(what, line)
                    kind = event.get("type")
                    obj = event.get("object")
                    if not isinstance(obj, dict):
                        raise KubeServerError(f"{what}: event without an object: {line[:200]!r}")
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            logger.info("%s: watch expired (410 Gone), relisting", what)
                            version = None
                            break
                        raise _status_error(
                            what, int(obj.get("code") or 500), str(obj.get("reason") or ""), line
                        )
                    seen = _resource_version(obj)
                    if seen is not None:
                        version = seen
                    if kind == "BOOKMARK":
                        continue
                    if kind not in ("ADDED", "MODIFIED", "DELETED"):
                        logger.warning("%s: ignoring an event of unknown type %r", what, kind)
                        continue
                    yield kind, obj
            finally:
                response.release()


async def _load_configuration(kubeconfig: Path | None) -> Any:
    configuration = kube_client.Configuration()
    try:
        if kubeconfig is None:
            kube_config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
        else:
            await kube_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=str(kubeconfig),
                client_configuration=configuration,
                persist_config=False,
            )
    except (kube_config.ConfigException, OSError, ValueError, TypeError, KeyError) as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster service account"
        raise ConfigError(f"cannot load the {where}: {exc}") from exc
    # We retry at the task level with our own backoff (adapters.backoff); no hidden retries.
    configuration.retries = None
    _pin_proxy(configuration)
    return configuration


def _pin_proxy(configuration: Any) -> None:
    """Read the proxy environment once, now, instead of on every request.

    ``kubernetes.aio`` opens its aiohttp session with ``trust_env=True``, which makes aiohttp look
    up ``~/.netrc`` and the ``*_PROXY`` variables in worker threads on EVERY request (two thread
    hops: a claim GET from a local server took 1.1 ms with them, 0.3 ms without). We resolve the
    proxy for the API server's URL once, with aiohttp's own rules (``NO_PROXY`` bypass,
    credentials from the proxy URL or ``.netrc``), and turn the per-request lookup off; a
    kubeconfig ``proxy-url`` still wins. client-go reads the proxy environment once as well
    (``http.ProxyFromEnvironment``).

    One case keeps the per-request lookup: proxy credentials for a plain-HTTP API server, which
    aiohttp only sends when it found them itself (it puts ``proxy_headers`` on a CONNECT only,
    i.e. for HTTPS servers).
    """
    if configuration.proxy:
        proxy, auth = None, None
    else:
        try:
            proxy, auth = get_env_proxy_for_url(URL(configuration.host))
        except (LookupError, ValueError):
            proxy, auth = None, None  # no proxy for this host: connect directly
    if auth is not None and not str(configuration.host).startswith("https:"):
        return
    kwargs = dict(configuration.client_session_kwargs or {})
    kwargs["trust_env"] = False
    configuration.client_session_kwargs = kwargs
    if proxy is None:
        return
    configuration.proxy = str(proxy)
    if auth is not None:
        configuration.proxy_headers = {"Proxy-Authorization": auth.encode()}
    logger.info("the API server %s is reached through proxy %s", configuration.host, proxy)


@asynccontextmanager
async def open_kube_client(
    kubeconfig: Path | None,
    *,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    watch_seconds: int | None = None,
) -> AsyncIterator[KubeClient]:
    """A :class:`KubeClient` for the cluster of ``kubeconfig`` (``None``: in-cluster, from the
    pod's service account). Bad or missing configuration raises :class:`ConfigError`."""
    configuration = await _load_configuration(kubeconfig)
    api_client = kube_client.ApiClient(configuration=configuration)
    api_client.user_agent = f"dracpu/{__version__}"
    try:
        yield KubeClient(api_client, request_timeout=request_timeout, watch_seconds=watch_seconds)
    finally:
        with anyio.CancelScope(shield=True):
            await api_client.close()  # type: ignore[no-untyped-call]
