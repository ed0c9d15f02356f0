"""The aiohttp side of the kube adapter (:mod:`dracpu.adapters.kube`): what it sets on the
library's aiohttp session and how its failures read.

- :func:`send_once`, the client middleware that keeps aiohttp from sending a POST, PUT, PATCH or
  DELETE a second time (see :mod:`dracpu.adapters.kube`);
- :func:`describe_failure`: why no answer came, in words, from aiohttp's ``client_exceptions``;
  :func:`status_error`: an answer with an error status as the :mod:`dracpu.errors` tree;
- :func:`proxy_url`: the proxy for the API server, decided once.

No ``kubernetes`` import here (the import-linter contract keeps that to ``adapters.kube``).
"""

from __future__ import annotations

import errno
import json
import logging
import ssl
import urllib.request
from contextlib import suppress
from typing import Any, Final
from urllib.parse import quote, urlsplit

import aiohttp
from aiohttp.helpers import basicauth_from_netrc, netrc_from_env
from aiohttp.http_exceptions import HttpProcessingError

from dracpu.errors import (
    ConfigError,
    KubeAPIError,
    KubeClientError,
    KubeConflictError,
    KubeNotFoundError,
    KubeServerError,
)

__all__ = [
    "BODY_EXCERPT",
    "REQUEST_ERRORS",
    "describe_failure",
    "json_object",
    "one_line",
    "proxy_url",
    "send_once",
    "status_error",
]

logger = logging.getLogger(__name__)

# Methods aiohttp may send a second time on a connection that dropped before any answer: GET
# alone (safe, RFC 9110 §9.2.1). Every other method we use changes state.
_RESENDABLE: Final = frozenset({"GET"})

# OpenSSL verification results (x509_vfy.h X509_V_ERR_*) and what they mean to an operator.
_UNKNOWN_CA_CODES: Final = frozenset({2, 18, 19, 20, 21})  # no path to a trusted CA
_NAME_MISMATCH_CODES: Final = frozenset({62, 63, 64})  # hostname, e-mail, IP address mismatch
_EXPIRED_CODE: Final = 10
_NOT_YET_VALID_CODE: Final = 9
# OpenSSL handshake failures (ssl.SSLError.reason) in words.
_TLS_REASONS: Final = {
    "WRONG_VERSION_NUMBER": "the server does not speak TLS",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the server wants a client certificate",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the server refused the client certificate",
    "TLSV1_ALERT_UNKNOWN_CA": "the server does not trust the client certificate's CA",
}
# Socket errors in words (the kernel's strerror text is terse: "Connection reset by peer").
_OS_CAUSES: Final = {
    errno.ECONNREFUSED: "connection refused",
    errno.ECONNRESET: "connection reset by the server",
    errno.EPIPE: "connection closed by the server while sending",
    errno.ETIMEDOUT: "connection timed out",
    errno.EHOSTUNREACH: "no route to host",
    errno.ENETUNREACH: "network unreachable",
}
# How much of a non-JSON error body goes into an error message.
BODY_EXCERPT = 200


class _SentOnceError(aiohttp.ClientConnectionError):
    """A request that is not resent lost its connection (the cause is ``__cause__``). Not one of
    the two exception types aiohttp's resend loop catches, so it passes through."""


async def send_once(
    request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
) -> aiohttp.ClientResponse:
    """aiohttp client middleware: a dropped connection ends a request other than GET at once
    (aiohttp would send PUT and DELETE again)."""
    try:
        return await handler(request)
    except aiohttp.ClientConnectorError:
        raise  # nothing was sent: aiohttp never resends these either
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
        if request.method in _RESENDABLE:
            raise
        raise _SentOnceError(str(exc)) from exc


def _os_cause(error: BaseException | None) -> str:
    if isinstance(error, OSError) and error.errno in _OS_CAUSES:
        return _OS_CAUSES[error.errno]
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__


def _certificate_cause(error: BaseException) -> str:
    """Which check refused the server's certificate (``ssl.SSLCertVerificationError``)."""
    code = getattr(error, "verify_code", None)
    detail = getattr(error, "verify_message", None) or str(error)
    if code in _UNKNOWN_CA_CODES:
        kind = "unknown CA (the certificate is not signed by a CA the client trusts)"
    elif code in _NAME_MISMATCH_CODES:
        kind = "name mismatch (the certificate is for another name; see tls-server-name)"
    elif code == _EXPIRED_CODE:
        kind = "the certificate has expired"
    elif code == _NOT_YET_VALID_CODE:
        kind = "the certificate is not valid yet"
    else:
        kind = "the certificate was refused"
    return f"TLS failure: {kind}: {detail}"


def describe_failure(exc: BaseException, seconds: float) -> str:
    """Why no answer came, in words (aiohttp's ``client_exceptions`` tree, most specific
    first); ``seconds`` is the time the request was given."""
    if isinstance(exc, _SentOnceError) and exc.__cause__ is not None:
        return (
            f"{describe_failure(exc.__cause__, seconds)} (not sent again: it may have been applied)"
        )
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return _certificate_cause(exc.certificate_error)
    if isinstance(exc, aiohttp.ClientConnectorSSLError):
        error = exc.os_error
        reason = getattr(error, "reason", None) or _os_cause(error)
        words = _TLS_REASONS.get(reason)
        return f"TLS failure: handshake failed: {f'{words} ({reason})' if words else reason}"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"DNS failure: cannot resolve {exc.host}: {_os_cause(exc.os_error)}"
    if isinstance(exc, aiohttp.ClientProxyConnectionError):
        cause = _os_cause(exc.os_error)
        return f"cannot connect to the proxy {exc.host}:{exc.port}: {cause}"
    if isinstance(exc, aiohttp.ClientHttpProxyError):
        answer = f"{exc.status} {exc.message}"
        return f"proxy refusal: the proxy answered the tunnel request with {answer}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return _os_cause(exc.os_error)
    if isinstance(exc, TimeoutError):  # aiohttp's ServerTimeoutError and its kin are too
        return f"timeout: no answer within {seconds:g} s"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "connection closed by the server before the answer was complete"
    if isinstance(exc, aiohttp.ClientPayloadError):
        # aiohttp names the connection's error only in the text (client_proto.connection_lost);
        # the cause is the parser's complaint (content length / chunked framing not complete).
        how = "reset" if "ConnectionResetError" in str(exc) else "closed"
        detail = getattr(exc.__cause__, "message", None) or str(exc)
        return f"connection {how} by the server in the middle of the answer: {one_line(detail)}"
    if isinstance(exc, aiohttp.ClientResponseError | HttpProcessingError):
        return f"the answer is not valid HTTP: {one_line(str(exc.message))}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS failure: {exc.reason or exc}"
    if isinstance(exc, OSError):
        return _os_cause(exc)
    return f"{type(exc).__name__}: {exc}"


def one_line(text: str) -> str:
    """``text`` with its line breaks and runs of spaces made single spaces."""
    return " ".join(text.split())


def server_message(body: bytes) -> str:
    """The ``message`` of a Status body, else the start of the body."""
    text = body.decode("utf-8", "replace")
    try:
        status = json.loads(text)
    except ValueError:
        status = None
    if isinstance(status, dict) and isinstance(status.get("message"), str):
        return str(status["message"])
    return text[:BODY_EXCERPT].strip() or "(empty body)"


def status_error(what: str, server: str, status: int, reason: str, body: bytes) -> KubeAPIError:
    message = f"{what}: the API server {server} answered {status} {reason}: {server_message(body)}"
    if status == 404:
        return KubeNotFoundError(message, status=status)
    if status == 409:
        return KubeConflictError(message, status=status)
    if status == 429 or status >= 500:
        return KubeServerError(message, status=status)
    return KubeClientError(message, status=status)


def json_object(what: str, server: str, body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise KubeServerError(f"{what}: the API server {server} sent invalid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise KubeServerError(
            f"{what}: the API server {server} sent {type(obj).__name__}, not an object"
        )
    return obj


# What a request can raise below us: aiohttp's errors, socket errors (ssl.SSLError and
# TimeoutError are OSErrors) and aiohttp's HTTP parser errors.
REQUEST_ERRORS: Final = (aiohttp.ClientError, OSError, HttpProcessingError)


def proxy_url(server_url: str, configured: str | None) -> str | None:
    """The proxy URL for the API server at ``server_url`` (credentials in it), decided now: the
    ``configured`` one (a kubeconfig ``proxy-url``), else ``<scheme>_proxy`` unless
    ``no_proxy`` names the server. A bad configured one is a :class:`ConfigError`."""
    server = urlsplit(server_url)
    if configured:
        text, source = configured, "the kubeconfig proxy-url"
    else:
        text = urllib.request.getproxies_environment().get(server.scheme, "")
        source = f"{server.scheme}_proxy"
        if not text or urllib.request.proxy_bypass(server.hostname or ""):
            return None
    proxy = urlsplit(text if "://" in text else "http://" + text)  # "proxy:3128", as curl has it
    try:
        proxy.port  # noqa: B018 (urllib checks the port when it is read)
    except ValueError as exc:
        raise ConfigError(f"{source} {text!r} has a bad port: {exc}") from exc
    if proxy.scheme.lower() != "http" or not proxy.hostname:
        # aiohttp tunnels through plain HTTP proxies only (it ignores https:// ones too).
        if configured:
            raise ConfigError(f"{source} {text!r}: only http:// proxies are supported")
        logger.warning("%s %s: only http:// proxies are supported, ignoring it", source, text)
        return None
    address = proxy.netloc.rpartition("@")[2]
    if proxy.username is None and not configured:
        # aiohttp's rule for a proxy from the environment: credentials from ~/.netrc.
        with suppress(LookupError):
            auth = basicauth_from_netrc(netrc_from_env(), proxy.hostname)
            user, password = quote(auth.login, safe=""), quote(auth.password, safe="")
            proxy = proxy._replace(netloc=f"{user}:{password}@{address}")
    logger.info(
        "the API server %s is reached through proxy http://%s (%s)",
        server_url,
        address,
        source,
    )
    return proxy.geturl()
