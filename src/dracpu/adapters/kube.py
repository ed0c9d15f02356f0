"""The Kubernetes API, as dracpu uses it: Nodes (read), ResourceClaims (read, status patch),
ResourceSlices (list, watch, create, update, delete). The ONLY module that imports
``kubernetes`` (its import is a large part of the daemon's start and memory,
``docs/performance.md``; the import-linter contract in ``pyproject.toml`` keeps it so).

Every request goes through the official asyncio client ``kubernetes.aio`` (its configuration
loaders, ``ApiClient.param_serialize`` and ``call_api``) with plain ``dict`` bodies, read back
as plain dicts. What we set on the library's ``Configuration`` (:func:`_load_configuration`: no
hidden retries, the proxy decided once, at most :data:`MAX_CONNECTIONS` connections, exec
tokens renewed), the errors (the :mod:`dracpu.errors` tree, each with status, reason and the
server's message, or the cause in words) and the watches (list, then stream; relist on ``410
Gone``; a list is one ``("LISTED", <ResourceSliceList>)`` event) are ``docs/architecture.md``,
"Kubernetes API".
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import aiohttp
import anyio
from kubernetes.aio import client as kube_client
from kubernetes.aio import config as kube_config

from dracpu import __version__
from dracpu.adapters.kube_transport import (
    BODY_EXCERPT,
    REQUEST_ERRORS,
    describe_failure,
    json_object,
    proxy_url,
    send_once,
    status_error,
)
from dracpu.errors import ConfigError, DracpuError, KubeClientError, KubeServerError

__all__ = [
    "DEFAULT_REQUEST_TIMEOUT",
    "LISTED",
    "MAX_CONNECTIONS",
    "MERGE_PATCH",
    "KubeClient",
    "WatchEvent",
    "kubelet_version",
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
# Connections to the API server at once. dracpu makes a few requests at a time (a Prepare's GET
# and status PATCH per claim, the publisher's writes, one watch); the kubelet sends Prepare calls
# one after the other. Small, because the API server counts connections per client.
MAX_CONNECTIONS: Final = 8
# Server-side watch duration: client-go's reflector picks timeoutSeconds uniformly in
# [minWatchTimeout, 2*minWatchTimeout) with minWatchTimeout = 5 min, spreading reconnects.
_WATCH_MIN_SECONDS = 300
# Extra client-side time beyond timeoutSeconds before a silent watch counts as dead.
_WATCH_CLIENT_MARGIN = 30.0
# The longest watch event line accepted. The API server refuses objects over 3 MiB
# (apiserver's maxRequestBodyBytes) and etcd stores at most 1.5 MiB per value by default; a
# line holds one object plus the event's envelope.
_MAX_EVENT_LINE = 4 * 1024 * 1024
# The security scheme every generated kubernetes API method names (``auth_settings``): the
# bearer token, or the basic-auth header the kubeconfig loader puts in the same place.
_AUTH_SETTINGS: Final = ["BearerToken"]

_RESOURCE_V1 = "/apis/resource.k8s.io/v1"
_SLICES = _RESOURCE_V1 + "/resourceslices"
_SLICE = _SLICES + "/{name}"
_CLAIM = _RESOURCE_V1 + "/namespaces/{namespace}/resourceclaims/{name}"
_CLAIM_STATUS = _CLAIM + "/status"
_NODE = "/api/v1/nodes/{name}"
# resource.k8s.io/v1 ResourceSliceSelectorDriver / ResourceSliceSelectorNodeName
# (k8s.io/api/resource/v1 types.go): the field selectors the API server supports for slices.
_FIELD_DRIVER = "spec.driver"
_FIELD_NODE_NAME = "spec.nodeName"

_USER_AGENT: Final = f"dracpu/{__version__}"


def slice_selector(driver: str | None, node_name: str | None) -> str:
    """The field selector ``spec.driver=<driver>,spec.nodeName=<node>`` (parts left out when
    ``None``)."""
    parts = []
    if driver is not None:
        parts.append(f"{_FIELD_DRIVER}={driver}")
    if node_name is not None:
        parts.append(f"{_FIELD_NODE_NAME}={node_name}")
    return ",".join(parts)


def kubelet_version(node: Mapping[str, Any]) -> str:
    """The Node's ``status.nodeInfo.kubeletVersion`` (the kubelet reports it in its node
    status); raises :class:`~dracpu.errors.DracpuError` when the Node has none."""
    status = node.get("status")
    info = status.get("nodeInfo") if isinstance(status, Mapping) else None
    version = info.get("kubeletVersion") if isinstance(info, Mapping) else None
    if not isinstance(version, str) or not version:
        name = (node.get("metadata") or {}).get("name")
        raise DracpuError(f"Node {name!r} has no status.nodeInfo.kubeletVersion")
    return version


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
        self._server = str(api_client.configuration.host)
        self._request_timeout = request_timeout
        self._watch_seconds = watch_seconds
        self._success_listeners: tuple[Callable[[], None], ...] = ()

    def on_success(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` after every request the API server answers with success (a
        status below 400; for a watch, the head of its stream); returns what removes it again.

        Any task's request that works shows the server is back (a Prepare's claim GET during
        the slice publisher's backoff): the publisher ends its wait through this. A listener
        runs inside the requesting task, on the event loop: it must be quick and never raise.
        """
        self._success_listeners = (*self._success_listeners, listener)

        def remove() -> None:
            self._success_listeners = tuple(f for f in self._success_listeners if f != listener)

        return remove

    # --- plumbing --------------------------------------------------------------------------

    async def _send(
        self,
        method: str,
        path: str,
        what: str,
        *,
        path_params: Mapping[str, str] | None = None,
        query: Sequence[tuple[str, str]] = (),
        body: object = None,
        content_type: str = _JSON,
        seconds: float | None = None,
    ) -> aiohttp.ClientResponse:
        """Send one request through the library; the response with its head read (the caller
        reads the body and releases it); ``seconds`` bounds the whole exchange (default: the
        request timeout)."""
        seconds = seconds or self._request_timeout
        try:
            # Credentials are taken now (the in-cluster token or an exec plugin's may have been
            # renewed); a plugin that hangs is given up on like a silent server.
            with anyio.fail_after(seconds):
                _, url, headers, _, _ = await self._api.param_serialize(
                    method=method,
                    resource_path=path,
                    path_params=dict(path_params or {}),
                    query_params=list(query),
                    header_params={"Accept": _JSON, "Content-Type": content_type},
                    auth_settings=_AUTH_SETTINGS,
                )
        except Exception as exc:  # a refresh hook or exec plugin is third-party code
            cause = f"none within {seconds:g} s" if isinstance(exc, TimeoutError) else exc
            raise KubeServerError(
                f"{what}: cannot get the credentials for the API server {self._server}: {cause}"
            ) from exc
        try:
            answer = await self._api.call_api(
                method,
                url,
                header_params=headers,
                body=body,  # json.dumps'ed by the library's REST layer
                _request_timeout=seconds,
            )
        except REQUEST_ERRORS as exc:
            raise self._unreachable(what, exc, seconds) from exc
        except kube_client.ApiException as exc:  # the REST layer refused the arguments
            raise KubeClientError(f"{what}: cannot send the request: {exc.reason}") from exc
        response: aiohttp.ClientResponse = answer.response
        if response.status < 400:
            for listener in self._success_listeners:
                listener()
        return response

    def _unreachable(self, what: str, exc: BaseException, seconds: float) -> KubeServerError:
        return KubeServerError(
            f"{what}: cannot reach the API server {self._server}: {describe_failure(exc, seconds)}"
        )

    def _broken(self, what: str, exc: BaseException, seconds: float) -> KubeServerError:
        return KubeServerError(
            f"{what}: reading the answer of the API server {self._server} failed: "
            f"{describe_failure(exc, seconds)}"
        )

    async def _request(
        self,
        method: str,
        path: str,
        what: str,
        *,
        path_params: Mapping[str, str] | None = None,
        query: Sequence[tuple[str, str]] = (),
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
        except REQUEST_ERRORS as exc:
            raise self._broken(what, exc, self._request_timeout) from exc
        finally:
            response.release()
        if response.status >= 400:
            raise status_error(what, self._server, response.status, response.reason or "", data)
        return json_object(what, self._server, data)

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
        what = f"list resourceslices {selector}"
        obj = await self._request("GET", _SLICES, what, query=[("fieldSelector", selector)])
        items = obj.get("items")
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise KubeServerError(
                f"{what}: the API server {self._server} sent no list of items in the answer"
            )
        return items, _resource_version(obj) or ""

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
            query = [
                ("fieldSelector", selector),
                ("watch", "true"),
                ("allowWatchBookmarks", "true"),
                ("timeoutSeconds", str(seconds)),
            ]
            if version:
                query.append(("resourceVersion", version))
            # aiohttp's timeout bounds the whole exchange, the body included.
            deadline = seconds + _WATCH_CLIENT_MARGIN
            response = await self._send("GET", _SLICES, what, query=query, seconds=deadline)
            try:
                if response.status == 410:
                    logger.info("%s: resourceVersion %s is too old, relisting", what, version)
                    version = None
                    continue
                if response.status >= 400:
                    try:
                        data = await response.read()
                    except REQUEST_ERRORS as exc:
                        # The status is known; only the server's message was lost.
                        cause = describe_failure(exc, deadline)
                        data = f"(reading the answer failed: {cause})".encode()
                    raise status_error(
                        what, self._server, response.status, response.reason or "", data
                    )
                while True:
                    try:
                        line = await response.content.readline(max_line_length=_MAX_EVENT_LINE)
                    except TimeoutError:
                        break  # the client-side deadline: renew the watch
                    except REQUEST_ERRORS as exc:
                        raise self._broken(what, exc, deadline) from exc
                    if not line:
                        break  # the server ended the stream (timeoutSeconds)
                    if not line.strip():
                        continue
                    event = json_object(what, self._server, line)
                    kind = event.get("type")
                    obj = event.get("object")
                    if not isinstance(obj, dict):
                        raise KubeServerError(
                            f"{what}: the API server {self._server} sent an event without an "
                            f"object: {line[:BODY_EXCERPT]!r}"
                        )
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            logger.info("%s: watch expired (410 Gone), relisting", what)
                            version = None
                            break
                        raise status_error(
                            what,
                            self._server,
                            int(obj.get("code") or 500),
                            str(obj.get("reason") or ""),
                            line,
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


# --- configuration --------------------------------------------------------------------------------


async def _load_configuration(kubeconfig: Path | None) -> Any:
    """The library's ``Configuration`` for ``kubeconfig`` (``None``: in-cluster), set up as the
    module docstring says."""
    configuration = kube_client.Configuration()
    try:
        if kubeconfig is None:
            kube_config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
        else:
            loader = await kube_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=str(kubeconfig),
                client_configuration=configuration,
                persist_config=False,
            )
            _refresh_exec_token(loader, configuration)
    except (kube_config.ConfigException, OSError, ValueError, TypeError, KeyError) as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster service account"
        raise ConfigError(f"cannot load the {where}: {exc}") from exc
    configuration.retries = None
    configuration.connection_pool_maxsize = MAX_CONNECTIONS
    kwargs = dict(configuration.client_session_kwargs or {})
    kwargs["trust_env"] = False
    kwargs["middlewares"] = (send_once,)
    configuration.client_session_kwargs = kwargs
    configuration.proxy = proxy_url(str(configuration.host), configuration.proxy or None)
    return configuration


def _refresh_exec_token(loader: Any, configuration: Any) -> None:
    """Renew an exec plugin's token when it expires, before the request that needs it.

    ``kubernetes.aio`` runs a kubeconfig's exec plugin once at load; renewing is left to a
    ``kube_config.refresh_token`` loop the caller runs. We hook the library's own renewal
    (``KubeConfigLoader.load_from_exec_plugin``, which runs the plugin again only once the token's
    ``expirationTimestamp`` has passed) into the configuration's ``refresh_api_key_hook``, which
    ``ApiClient`` awaits before each request, as the in-cluster loader's token refresh is. A
    token without an expiry is kept for good (client-go does the same).
    """
    if getattr(loader, "exec_plugin_expiry", None) is None:
        return

    async def refresh(config: Any) -> None:
        await loader.load_from_exec_plugin()
        config.api_key["BearerToken"] = loader.token

    configuration.refresh_api_key_hook = refresh


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
    try:
        api_client = kube_client.ApiClient(configuration=configuration)
    except (OSError, ValueError) as exc:  # the TLS context: CA or client certificate files
        raise ConfigError(
            f"cannot set up TLS for the API server {configuration.host}: {exc}"
        ) from exc
    api_client.user_agent = _USER_AGENT
    try:
        yield KubeClient(api_client, request_timeout=request_timeout, watch_seconds=watch_seconds)
    finally:
        with anyio.CancelScope(shield=True):
            await api_client.close()  # type: ignore[no-untyped-call]
