"""The Kubernetes API, as dracpu uses it: Nodes (read), ResourceClaims (read, status patch),
ResourceSlices (list, watch, create, update, delete). The ONLY module that imports
``kubernetes`` (design §8: the import costs ~0.5 s and ~30 MiB, so nothing else pays for it).

``kubernetes`` is used for ONE job: loading the configuration (kubeconfig or the in-cluster
service account, client certificates, exec plugins, token files), i.e. a
``kubernetes.aio.client.Configuration``. Every request goes through our own small HTTP/1.1
client: the sans-IO :mod:`dracpu.wire.http1` over the connection pool of
:mod:`dracpu.adapters.http_pool`.

Why (measured on the 2-core VM against the in-process fake API server, whose handler is ~0.22
ms of each figure): the claim GET sits in the Prepare path (issue 4), and on this VM code that
runs a few ms after the previous burst of work runs ~3x slower (cold caches), so what counts is
how much code one request runs. The ``kubernetes.aio`` ``ApiClient`` -> aiohttp path took
0.42-0.47 ms back to back and 1.19-1.33 ms cold; this client takes 0.38-0.41 / 1.09-1.23 ms (a
bare anyio stream with no client code on top: 0.24 / 0.82-0.90). Modest per request, but the
Prepare benchmark (``bench/bench_prepare.py --only api``, six alternating runs) was faster with
it in five of six, by ~0.5 ms at the median: the claim status PATCH after each answer competes
with the next call too. It also sends nothing twice behind our back (aiohttp retried PUT and
DELETE once on a dropped connection).

What this module keeps from ``kubernetes.aio`` (``rest.py``, ``api_client.py``):

- **TLS**: one ``ssl.SSLContext`` built at open as ``RESTClientObject`` builds it (CA file /
  data, client certificate, ``verify_ssl``, ``disable_strict_ssl_verification``) plus
  ``assert_hostname=False`` and ``tls_server_name`` (the SNI and the name checked).
- **Auth**: per request, ``await configuration.auth_settings()`` (it runs the token refresh
  hook of the in-cluster service account), header settings become headers, as
  ``update_params_for_auth`` does; HTTP basic auth when a user name / password is configured
  and no other credential is. Plus ``User-Agent: dracpu/<version>`` and
  ``Accept: application/json``.
- **Proxy**: resolved ONCE at open (kubeconfig ``proxy-url`` first, else ``https_proxy`` /
  ``http_proxy`` for the server's scheme, ``no_proxy`` honoured, credentials from the proxy URL
  or ``~/.netrc``) as the old aiohttp set-up did and as client-go does
  (``http.ProxyFromEnvironment``). Only ``http://`` proxies are supported (aiohttp had the same
  limit).
- **Connections** (:mod:`dracpu.adapters.http_pool`): keep-alive, at most
  :data:`~dracpu.adapters.http_pool.MAX_CONNECTIONS` ordinary requests at a time, dead idle
  connections dropped before reuse, a GET resent once after the keep-alive race, nothing else
  ever sent twice.
- **Timeouts**: ``request_timeout`` bounds a whole ordinary request; a watch is bounded by its
  ``timeoutSeconds`` plus :data:`_WATCH_CLIENT_MARGIN`.

Objects are plain dicts, camelCase as on the wire, with every field the server sent: the
generated pydantic models would drop fields this client version does not know and re-validate
every one of a 128-device slice's fields on each call.

Errors become the :mod:`dracpu.errors` tree, with the HTTP status and the server's message:
404 :class:`KubeNotFoundError`, 409 :class:`KubeConflictError`, other 4xx
:class:`KubeClientError`, 5xx, 429 (too many requests: transient) and every connection failure,
TLS failure, protocol violation or timeout :class:`KubeServerError` (``status`` is ``None`` for
those).

Watches (:meth:`KubeClient.watch_resource_slices`) list first, then stream events from the
list's resourceVersion, reconnecting from the last seen version when the server ends the stream;
a ``410 Gone`` (the version was compacted away) makes them list again. A list is reported as one
``("LISTED", <ResourceSliceList>)`` event so the consumer can resynchronise from it.
"""

from __future__ import annotations

import base64
import json
import logging
import netrc
import os
import random
import ssl
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote, unquote, urlencode, urlsplit

import anyio
import anyio.abc
from kubernetes.aio import client as kube_client
from kubernetes.aio import config as kube_config

from dracpu import __version__
from dracpu.adapters.http_pool import (
    CONNECTION_ERRORS,
    Endpoint,
    HttpPool,
    Proxy,
    ProxyRefusedError,
    StreamedResponse,
    bracketed,
    quote_segment,
)
from dracpu.errors import (
    ConfigError,
    KubeAPIError,
    KubeClientError,
    KubeConflictError,
    KubeNotFoundError,
    KubeServerError,
    ProtocolError,
)
from dracpu.wire.http1 import (
    Response,
    encode_request,
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
# Default ports of the API server URL's schemes (RFC 9110 §4.2).
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}

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


_USER_AGENT: Final = f"dracpu/{__version__}"


class KubeClient:
    """The calls dracpu makes; every object in and out is a plain JSON ``dict``.

    Use :func:`open_kube_client` to get one. ``request_timeout`` bounds each ordinary request;
    ``watch_seconds`` (``None``: 5-10 min, randomised) is the server-side duration of one watch
    request before it is renewed.
    """

    def __init__(
        self,
        configuration: Any,
        pool: HttpPool,
        *,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        watch_seconds: int | None = None,
    ) -> None:
        self._configuration = configuration
        self._pool = pool
        self._endpoint = pool.endpoint
        self._request_timeout = request_timeout
        self._watch_seconds = watch_seconds

    # --- plumbing --------------------------------------------------------------------------

    async def _encode(
        self,
        method: str,
        path: str,
        what: str,
        *,
        path_params: Mapping[str, str] | None = None,
        query: Sequence[tuple[str, object]] = (),
        body: object = None,
        content_type: str = _JSON,
    ) -> bytes:
        """The bytes of one request, authenticated now (the token may have been refreshed)."""
        if path_params:
            path = path.format_map({k: quote_segment(v) for k, v in path_params.items()})
        params = [(key, str(value)) for key, value in query]
        headers = [("User-Agent", _USER_AGENT), ("Accept", _JSON)]
        await self._authenticate(what, headers, params)
        payload = b""
        if body is not None:
            payload = json.dumps(body, separators=(",", ":")).encode()
            headers.append(("Content-Type", content_type))
        endpoint = self._endpoint
        proxy = endpoint.proxy
        if proxy is not None and proxy.authorization is not None and endpoint.ssl_context is None:
            headers.append(("Proxy-Authorization", proxy.authorization))
        if params:
            path = f"{path}?{urlencode(params, quote_via=quote)}"
        try:
            return encode_request(
                method,
                endpoint.target(path),
                host=endpoint.authority,
                headers=headers,
                body=payload,
            )
        except ProtocolError as exc:  # a credential with a line break, say
            raise KubeClientError(f"{what}: cannot send the request: {exc}") from exc

    async def _authenticate(
        self, what: str, headers: list[tuple[str, str]], query: list[tuple[str, str]]
    ) -> None:
        """Add the credentials, as ``ApiClient.update_params_for_auth`` does."""
        configuration = self._configuration
        try:
            # Runs the refresh hook (the in-cluster loader re-reads the token file every minute).
            settings = await configuration.auth_settings()
        except Exception as exc:  # the hook is third-party code: any failure is a bad credential
            raise KubeServerError(f"{what}: cannot get the credentials: {exc!r}") from exc
        authorized = False
        for setting in settings.values():
            value = setting.get("value")
            if value is None:
                continue
            key, text = str(setting.get("key")), str(value).strip()  # client-go: TrimSpace
            if setting.get("in") == "header" and setting.get("type") != "http-signature":
                headers.append((key, text))
                authorized = authorized or key.lower() == "authorization"
            elif setting.get("in") == "query":
                query.append((key, text))
        if not authorized and (configuration.username or configuration.password):
            headers.append(("Authorization", configuration.get_basic_auth_token()))

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
        wire = await self._encode(
            method,
            path,
            what,
            path_params=path_params,
            query=query,
            body=body,
            content_type=content_type,
        )
        answer: tuple[Response, bytes] | None = None
        with anyio.move_on_after(self._request_timeout):
            try:
                answer = await self._pool.request(method, path, wire)
            except (ProxyRefusedError, *CONNECTION_ERRORS) as exc:
                raise KubeServerError(f"{what}: cannot reach the API server: {exc!r}") from exc
        if answer is None:
            raise KubeServerError(
                f"{what}: cannot reach the API server: no answer within {self._request_timeout:g} s"
            )
        response, data = answer
        if response.status >= 400:
            raise _status_error(what, response.status, response.reason, data)
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
            # No cancel scope may stay open across a yield: every wait below gets its own
            # scope, up to this one deadline.
            deadline = anyio.current_time() + seconds + _WATCH_CLIENT_MARGIN
            wire = await self._encode("GET", _SLICES, what, query=query)
            response: StreamedResponse | None = None
            with anyio.move_on_after(deadline - anyio.current_time()):
                try:
                    response = await self._pool.open_stream("GET", wire)
                except (ProxyRefusedError, *CONNECTION_ERRORS) as exc:
                    raise KubeServerError(f"{what}: cannot reach the API server: {exc!r}") from exc
            if response is None:
                raise KubeServerError(f"{what}: cannot reach the API server: no answer in time")
            try:
                if response.status == 410:
                    logger.info("%s: resourceVersion %s is too old, relisting", what, version)
                    version = None
                    continue
                if response.status >= 400:
                    try:
                        with anyio.fail_after(self._request_timeout):
                            data = await response.read_all()
                    except (TimeoutError, KubeServerError, *CONNECTION_ERRORS) as exc:
                        # The status is known; only the server's message was lost.
                        data = f"(reading the answer failed: {exc!r})".encode()
                    raise _status_error(what, response.status, response.reason, data)
                while True:
                    try:
                        with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                            line = await response.read_line()
                    except TimeoutError:
                        break  # the client-side deadline: renew the watch
                    except CONNECTION_ERRORS as exc:
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
                with anyio.CancelScope(shield=True):
                    await response.aclose()


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
    return configuration


def _ssl_context(configuration: Any) -> ssl.SSLContext:
    """The TLS settings of ``kubernetes.aio``'s ``RESTClientObject``, plus ``assert_hostname``
    (honoured by the synchronous client only, there)."""
    try:
        context = ssl.create_default_context(
            cafile=configuration.ssl_ca_cert, cadata=configuration.ca_cert_data
        )
        if configuration.cert_file:
            context.load_cert_chain(configuration.cert_file, keyfile=configuration.key_file)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise ConfigError(
            f"cannot set up TLS for the API server {configuration.host}: {exc}"
        ) from exc
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif configuration.assert_hostname is False:
        context.check_hostname = False
    if configuration.disable_strict_ssl_verification:
        context.verify_flags &= ~ssl.VERIFY_X509_STRICT
    return context


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


def _netrc_authorization(host: str) -> str | None:
    """Basic credentials for ``host`` from ``$NETRC`` or ``~/.netrc`` (aiohttp's rule for a
    proxy URL without credentials)."""
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    if not path.is_file():
        return None
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError) as exc:
        logger.warning("cannot read %s for the proxy credentials: %s", path, exc)
        return None
    if entry is None:
        return None
    login, _, password = entry
    return _basic(login or "", password or "")


def _proxy(configuration: Any, scheme: str, host: str) -> Proxy | None:
    """The proxy for the API server, decided now: kubeconfig ``proxy-url``, else the
    environment (``<scheme>_proxy``, ``no_proxy``)."""
    if configuration.proxy:
        url, source = str(configuration.proxy), "the kubeconfig proxy-url"
    else:
        proxies = urllib.request.getproxies_environment()
        url, source = proxies.get(scheme, ""), f"{scheme}_proxy"
        if not url or urllib.request.proxy_bypass(host):
            return None
    if "://" not in url:
        url = "http://" + url  # "proxy:3128", as curl reads it
    parsed = urlsplit(url)
    try:
        port = parsed.port or _DEFAULT_PORTS["http"]
    except ValueError as exc:
        raise ConfigError(f"{source} {url!r}: bad port: {exc}") from exc
    if parsed.scheme.lower() != "http" or not parsed.hostname:
        if configuration.proxy:
            raise ConfigError(f"{source} {url!r}: only http:// proxies are supported")
        logger.warning("%s %s: only http:// proxies are supported, ignoring it", source, url)
        return None
    authorization: str | None = None
    if parsed.username is not None:
        authorization = _basic(unquote(parsed.username), unquote(parsed.password or ""))
    else:
        authorization = _netrc_authorization(parsed.hostname)
    for key, value in dict(configuration.proxy_headers or {}).items():
        if str(key).lower() == "proxy-authorization":
            authorization = str(value)
    plain = f"http://{bracketed(parsed.hostname)}:{port}"
    logger.info("the API server %s is reached through proxy %s", configuration.host, plain)
    return Proxy(host=parsed.hostname, port=port, url=plain, authorization=authorization)


def _endpoint(configuration: Any) -> Endpoint:
    host = str(configuration.host)
    url = urlsplit(host)
    scheme = url.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not url.hostname:
        raise ConfigError(f"the API server URL {host!r} is not http(s)://host[:port][/path]")
    try:
        port = url.port or _DEFAULT_PORTS[scheme]
    except ValueError as exc:
        raise ConfigError(f"the API server URL {host!r} has a bad port: {exc}") from exc
    tls = scheme == "https"
    return Endpoint(
        scheme=scheme,
        host=url.hostname,
        port=port,
        authority=url.netloc.rpartition("@")[2],
        prefix=url.path.rstrip("/"),
        ssl_context=_ssl_context(configuration) if tls else None,
        tls_name=configuration.tls_server_name or url.hostname,
        proxy=_proxy(configuration, scheme, url.hostname),
    )


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
    pool = HttpPool(_endpoint(configuration), _USER_AGENT)
    try:
        yield KubeClient(
            configuration, pool, request_timeout=request_timeout, watch_seconds=watch_seconds
        )
    finally:
        with anyio.CancelScope(shield=True):
            await pool.aclose()
