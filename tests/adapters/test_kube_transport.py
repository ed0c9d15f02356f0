"""How the kube adapter's requests travel (the ``kubernetes.aio`` client over aiohttp, set up by
dracpu.adapters.kube): connections, the resend rule, credentials, TLS, proxies, watch framing,
and failures named in words. Over real sockets, against small raw servers and proxies
(tests.kube_helpers: they share no code with aiohttp or the kubernetes client) or the aiohttp
fake API server."""

from __future__ import annotations

import base64
import contextlib
import datetime
import itertools
import json
import socket
import struct
import sys
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.tls import TLSStream
from kubernetes.aio.config import incluster_config

from dracpu.adapters.kube import LISTED, MAX_CONNECTIONS, KubeClient, open_kube_client
from dracpu.errors import ConfigError, KubeServerError
from dracpu.sim.fake_apiserver import open_fake_apiserver
from tests.kube_helpers import (
    NODE,
    NODE_JSON,
    NODE_UID,
    OPENSSL,
    Handler,
    Pki,
    RawRequest,
    answering,
    make_pki,
    ok,
    raw_server,
    read_request,
    write_kubeconfig,
)

pytestmark = pytest.mark.anyio

_PROXY_VARIABLES = tuple(
    name
    for scheme in ("http", "https", "all", "no")
    for name in (f"{scheme}_proxy", f"{scheme.upper()}_PROXY")
)
Stream = anyio.abc.SocketStream | TLSStream


@pytest.fixture(autouse=True)
def _no_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's proxy settings must not reach these tests; a test sets its own."""
    for name in _PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if not OPENSSL:
        pytest.skip("the openssl CLI is not installed: cannot make test certificates")
    return make_pki(tmp_path_factory.mktemp("pki"))


def free_port() -> int:
    """A port nobody listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def reset(stream: Stream) -> None:
    """Make the coming close of ``stream`` a TCP reset (SO_LINGER with a zero timeout)."""
    sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def failure(config: Path, *, request_timeout: float = 10) -> KubeServerError:
    """The error of one ``get node`` through a client of ``config``."""
    async with open_kube_client(config, request_timeout=request_timeout) as kube:
        with pytest.raises(KubeServerError) as info:
            await kube.get_node(NODE)
    assert info.value.status is None
    assert isinstance(info.value.__cause__, Exception)  # the library's error, kept
    return info.value


async def served_failure(
    handler: Handler, tmp_path: Path, *, scheme: str = "http", request_timeout: float = 10
) -> tuple[str, KubeServerError, list[int]]:
    """The server's URL, the error of one ``get node`` from ``handler``'s raw server, and the
    connections it accepted."""
    async with raw_server(handler) as (port, accepted):
        url = f"{scheme}://127.0.0.1:{port}"
        config = write_kubeconfig(tmp_path / "kubeconfig", url)
        return url, await failure(config, request_timeout=request_timeout), accepted


CLAIM_JSON = json.dumps({"kind": "ResourceClaim", "metadata": {"name": "claim-1"}}).encode()
SLICE = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s-1"}}


# --- connections ----------------------------------------------------------------------------------


async def test_keep_alive_many_gets_use_one_connection(tmp_path: Path) -> None:
    seen: list[RawRequest] = []
    async with raw_server(answering(seen=seen)) as (port, accepted):
        config = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
        async with open_kube_client(config, request_timeout=10) as kube:
            for _ in range(20):
                assert (await kube.get_node(NODE))["metadata"]["name"] == NODE
    assert accepted == [0]
    assert len(seen) == 20
    first = seen[0]
    assert first.line == f"GET /api/v1/nodes/{NODE} HTTP/1.1"
    assert first.header("Host") == f"127.0.0.1:{port}"
    assert first.header("Authorization") == "Bearer t"
    assert first.header("Accept") == "application/json"
    assert (first.header("User-Agent") or "").startswith("dracpu/")


async def test_concurrent_requests_share_a_bounded_number_of_connections(tmp_path: Path) -> None:
    in_flight = [0, 0]  # now, most

    async def handler(stream: Stream, buffered: BufferedByteReceiveStream, number: int) -> None:
        while (request := await read_request(buffered, number)) is not None:
            assert request.method == "GET"
            in_flight[0] += 1
            in_flight[1] = max(in_flight)
            await anyio.sleep(0.02)
            in_flight[0] -= 1
            await stream.send(ok(NODE_JSON))

    async with raw_server(handler) as (port, accepted):
        config = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
        async with open_kube_client(config, request_timeout=10) as kube:
            async with anyio.create_task_group() as tg:
                for _ in range(30):
                    tg.start_soon(kube.get_node, NODE)
            assert len(accepted) == MAX_CONNECTIONS
            assert in_flight[1] == MAX_CONNECTIONS
            for _ in range(5):
                await kube.get_node(NODE)
            assert len(accepted) == MAX_CONNECTIONS  # idle connections were reused


Operation = Callable[[KubeClient], Awaitable[object]]
OPERATIONS: dict[str, Operation] = {
    "GET": lambda kube: kube.get_resource_claim("team", "claim-1"),
    "PATCH": lambda kube: kube.patch_resource_claim_status("team", "claim-1", {"status": {}}),
    "POST": lambda kube: kube.create_resource_slice(SLICE),
    "PUT": lambda kube: kube.update_resource_slice(SLICE),
    "DELETE": lambda kube: kube.delete_resource_slice("s-1"),
}


@pytest.mark.parametrize("reused", [False, True], ids=["new-connection", "reused-connection"])
@pytest.mark.parametrize("method", list(OPERATIONS))
async def test_a_request_whose_connection_drops_is_sent_again_only_if_it_is_a_get(
    tmp_path: Path, method: str, reused: bool
) -> None:
    """The server reads the request, then drops the connection without an answer (a crash, a
    load balancer, the keep-alive race). A GET is sent again on a new connection; a POST, PUT,
    PATCH or DELETE is not: it may have been applied (aiohttp on its own resends PUT and
    DELETE)."""
    seen: list[RawRequest] = []
    drop = 1 if reused else 0  # the index of the request that is dropped

    async def handler(stream: Stream, buffered: BufferedByteReceiveStream, number: int) -> None:
        while (request := await read_request(buffered, number)) is not None:
            seen.append(request)
            if len(seen) - 1 == drop:
                return  # raw_server closes the connection, the request unanswered
            await stream.send(ok(CLAIM_JSON))

    async with raw_server(handler) as (port, accepted):
        config = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
        async with open_kube_client(config, request_timeout=10) as kube:
            if reused:
                await OPERATIONS["GET"](kube)  # opens the connection the next request reuses
            if method == "GET":
                assert await OPERATIONS[method](kube)
                assert [r.method for r in seen[drop:]] == ["GET", "GET"]  # sent again
                assert seen[-1].connection == len(accepted) - 1 != seen[drop].connection
                return
            with pytest.raises(KubeServerError) as info:
                await OPERATIONS[method](kube)
            assert info.value.status is None
            assert str(info.value).endswith(
                f"cannot reach the API server http://127.0.0.1:{port}: connection closed by the "
                "server before the answer was complete (not sent again: it may have been applied)"
            )
            assert [r.method for r in seen[drop:]] == [method]  # sent once, never again
            # The next request opens a new connection and works.
            assert await OPERATIONS["GET"](kube)
            assert seen[-1].connection == accepted[-1] == seen[drop].connection + 1


async def test_an_idle_connection_the_server_closed_is_not_reused(tmp_path: Path) -> None:
    """The server answers keep-alive, then closes the idle connection (an idle timeout): the
    next request, even a PATCH, goes on a new connection and is not lost."""
    seen: list[RawRequest] = []

    async def handler(stream: Stream, buffered: BufferedByteReceiveStream, number: int) -> None:
        request = await read_request(buffered, number)
        assert request is not None
        seen.append(request)
        await stream.send(ok(CLAIM_JSON))  # no "Connection: close": reusable as far as HTTP says
        # ... and the handler returns: raw_server closes the connection.

    async with raw_server(handler) as (port, accepted):
        config = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
        async with open_kube_client(config, request_timeout=10) as kube:
            await OPERATIONS["GET"](kube)
            await anyio.sleep(0.1)  # the FIN arrives while the connection is idle
            await OPERATIONS["PATCH"](kube)
    assert accepted == [0, 1]
    assert [(r.connection, r.method) for r in seen] == [(0, "GET"), (1, "PATCH")]
    assert seen[1].body == b'{"status": {}}'  # encoded by the library (json.dumps defaults)
    assert seen[1].header("Content-Type") == "application/merge-patch+json"


async def test_a_server_url_path_prefix_is_kept(tmp_path: Path) -> None:
    seen: list[RawRequest] = []
    listing = b'{"metadata": {"resourceVersion": "3"}, "items": []}'
    async with raw_server(answering(listing, seen)) as (port, _):
        config = write_kubeconfig(
            tmp_path / "kubeconfig", f"http://127.0.0.1:{port}/k8s/clusters/c-1/"
        )
        async with open_kube_client(config, request_timeout=10) as kube:
            await kube.list_resource_slices("dra.cpu", "node a/b")
    [request] = seen
    assert request.line == (
        "GET /k8s/clusters/c-1/apis/resource.k8s.io/v1/resourceslices"
        "?fieldSelector=spec.driver%3Ddra.cpu,spec.nodeName%3Dnode%20a/b HTTP/1.1"
    )


# --- credentials ----------------------------------------------------------------------------------


async def test_basic_auth_from_the_kubeconfig(tmp_path: Path) -> None:
    seen: list[RawRequest] = []
    async with raw_server(answering(seen=seen)) as (port, _):
        config = write_kubeconfig(
            tmp_path / "kubeconfig",
            f"http://127.0.0.1:{port}",
            user="{username: 'ad min', password: 'p:w'}",
        )
        async with open_kube_client(config, request_timeout=10) as kube:
            await kube.get_node(NODE)
    [request] = seen
    assert request.header("Authorization") == "Basic " + base64.b64encode(b"ad min:p:w").decode()


@pytest.mark.parametrize("expires", [False, True], ids=["no-expiry", "expired"])
async def test_an_exec_plugin_token_is_renewed_when_it_expires(
    tmp_path: Path, expires: bool
) -> None:
    """A kubeconfig exec plugin (client.authentication.k8s.io/v1 ExecCredential): the library
    runs it at load; its token is renewed before a request once its expirationTimestamp has
    passed, and kept when it has none."""
    runs = tmp_path / "runs"
    plugin = tmp_path / "plugin.py"
    expiry = '"2000-01-01T00:00:00Z"' if expires else "None"
    plugin.write_text(
        "import json, pathlib\n"
        f"runs = pathlib.Path({str(runs)!r})\n"
        "n = int(runs.read_text()) + 1 if runs.exists() else 1\n"
        "runs.write_text(str(n))\n"
        f"status = {{'token': f'exec-{{n}}', 'expirationTimestamp': {expiry}}}\n"
        "status = {k: v for k, v in status.items() if v is not None}\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1',\n"
        "                  'kind': 'ExecCredential', 'status': status}))\n"
    )
    seen: list[RawRequest] = []
    async with raw_server(answering(seen=seen)) as (port, _):
        config = write_kubeconfig(
            tmp_path / "kubeconfig",
            f"http://127.0.0.1:{port}",
            user=(
                "{exec: {apiVersion: client.authentication.k8s.io/v1, interactiveMode: Never, "
                f"command: '{sys.executable}', args: ['{plugin}']}}}}"
            ),
        )
        async with open_kube_client(config, request_timeout=10) as kube:
            await kube.get_node(NODE)
            await kube.get_node(NODE)
    tokens = [r.header("Authorization") for r in seen]
    if expires:
        assert tokens == ["Bearer exec-2", "Bearer exec-3"]
        assert runs.read_text() == "3"
    else:
        assert tokens == ["Bearer exec-1", "Bearer exec-1"]
        assert runs.read_text() == "1"


async def test_in_cluster_token_is_refreshed_between_requests(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-cluster loader's refresh_api_key_hook re-reads the rotated token file once its
    minute is over; the next request carries the new token (over TLS with the pod's CA)."""
    seen: list[RawRequest] = []
    token = tmp_path / "token"
    token.write_text("token-1")
    shift = [datetime.timedelta(0)]

    class ShiftedClock(datetime.datetime):
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> ShiftedClock:
            moment = datetime.datetime.now(tz) + shift[0]
            return cls.fromtimestamp(moment.timestamp(), tz)

    monkeypatch.setattr(
        incluster_config,
        "datetime",
        types.SimpleNamespace(datetime=ShiftedClock, timedelta=datetime.timedelta),
    )
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(pki.ca))
    async with raw_server(answering(seen=seen), ssl_context=pki.server_context()) as (port, _):
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(port))
        async with open_kube_client(None, request_timeout=10) as kube:
            await kube.get_node(NODE)
            token.write_text("token-2")  # the kubelet rotates the projected token
            await kube.get_node(NODE)  # within the minute: the cached token
            shift[0] = datetime.timedelta(minutes=2)
            await kube.get_node(NODE)
    assert [r.header("Authorization") for r in seen] == [
        "bearer token-1",
        "bearer token-1",
        "bearer token-2",
    ]


# --- TLS ------------------------------------------------------------------------------------------


async def test_tls_with_the_cluster_ca(pki: Pki, tmp_path: Path) -> None:
    async with open_fake_apiserver(ssl_context=pki.server_context()) as api:
        api.add_node(NODE, uid=NODE_UID)
        assert api.url.startswith("https://127.0.0.1:")
        config = write_kubeconfig(tmp_path / "kubeconfig", api.url, ca=pki.ca)
        async with open_kube_client(config, request_timeout=10) as kube:
            assert await kube.get_node(NODE) == api.node(NODE)
            stored = await kube.create_resource_slice(
                {**SLICE, "spec": {"driver": "dra.cpu", "nodeName": NODE, "devices": [],
                                   "pool": {"name": NODE, "generation": 1,
                                            "resourceSliceCount": 1}}}
            )  # fmt: skip
            assert api.resource_slices() == [stored]


async def test_tls_keep_alive_many_gets_use_one_connection(pki: Pki, tmp_path: Path) -> None:
    # A TLS 1.3 server sends session tickets after the handshake: bytes the client reads with
    # the first answer, never a reason to think the idle connection was closed.
    async with raw_server(answering(), ssl_context=pki.server_context()) as (port, accepted):
        config = write_kubeconfig(tmp_path / "kubeconfig", f"https://127.0.0.1:{port}", ca=pki.ca)
        async with open_kube_client(config, request_timeout=10) as kube:
            for _ in range(5):
                assert (await kube.get_node(NODE))["metadata"]["name"] == NODE
                await anyio.sleep(0.02)  # idle between requests, as between Prepares
    assert accepted == [0]


async def test_tls_with_a_wrong_ca_is_an_unknown_ca(pki: Pki, tmp_path: Path) -> None:
    async with open_fake_apiserver(ssl_context=pki.server_context()) as api:
        config = write_kubeconfig(tmp_path / "kubeconfig", api.url, ca=pki.other_ca)
        error = await failure(config)
        assert str(error) == (
            f"get node {NODE}: cannot reach the API server {api.url}: TLS failure: unknown CA "
            "(the certificate is not signed by a CA the client trusts): unable to get local "
            "issuer certificate"
        )
        assert api.requests == []


async def test_tls_server_name_is_the_name_sent_and_checked(pki: Pki, tmp_path: Path) -> None:
    async with open_fake_apiserver(ssl_context=pki.server_context(named=True)) as api:
        api.add_node(NODE, uid=NODE_UID)
        # The certificate names api.cluster.test, not 127.0.0.1: refused without the name ...
        plain = write_kubeconfig(tmp_path / "plain", api.url, ca=pki.ca)
        error = await failure(plain)
        assert str(error) == (
            f"get node {NODE}: cannot reach the API server {api.url}: TLS failure: name mismatch "
            "(the certificate is for another name; see tls-server-name): IP address mismatch, "
            "certificate is not valid for '127.0.0.1'."
        )
        # ... accepted with it.
        named = write_kubeconfig(
            tmp_path / "named",
            api.url,
            ca=pki.ca,
            cluster_extra="tls-server-name: api.cluster.test",
        )
        async with open_kube_client(named, request_timeout=10) as kube:
            assert await kube.get_node(NODE) == api.node(NODE)


# --- failures, in words ---------------------------------------------------------------------------


async def test_connection_refused(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    error = await failure(write_kubeconfig(tmp_path / "kubeconfig", url))
    assert str(error) == f"get node {NODE}: cannot reach the API server {url}: connection refused"


async def test_connection_reset(tmp_path: Path) -> None:
    async def handler(stream: Stream, buffered: BufferedByteReceiveStream, number: int) -> None:
        await read_request(buffered, number)
        reset(stream)

    url, error, accepted = await served_failure(handler, tmp_path)
    assert str(error) == (
        f"get node {NODE}: cannot reach the API server {url}: connection reset by the server"
    )
    assert accepted == [0, 1]  # a GET is sent once more


@pytest.mark.parametrize("how", ["closed", "reset"])
async def test_an_answer_cut_short(tmp_path: Path, how: str) -> None:
    async def handler(stream: Stream, buffered: BufferedByteReceiveStream, number: int) -> None:
        await read_request(buffered, number)
        await stream.send(ok(NODE_JSON)[:-10])
        await anyio.sleep(0.05)  # the head and part of the body arrive first
        if how == "reset":
            reset(stream)

    url, error, _ = await served_failure(handler, tmp_path)
    assert str(error) == (
        f"get node {NODE}: reading the answer of the API server {url} failed: connection {how} "
        f"by the server in the middle of the answer: Not enough data to satisfy content length "
        f"header (received {len(NODE_JSON) - 10} of {len(NODE_JSON)} bytes)."
    )


async def test_a_timeout(tmp_path: Path) -> None:
    async def handler(stream: Stream, buffered: BufferedByteReceiveStream, number: int) -> None:
        await read_request(buffered, number)
        await anyio.sleep_forever()

    with anyio.fail_after(10):
        url, error, _ = await served_failure(handler, tmp_path, request_timeout=0.3)
    assert str(error) == (
        f"get node {NODE}: cannot reach the API server {url}: timeout: no answer within 0.3 s"
    )


async def test_an_answer_that_is_not_http(tmp_path: Path) -> None:
    async def handler(stream: Stream, buffered: BufferedByteReceiveStream, number: int) -> None:
        await read_request(buffered, number)
        await stream.send(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")

    url, error, _ = await served_failure(handler, tmp_path)
    assert str(error).startswith(
        f"get node {NODE}: cannot reach the API server {url}: the answer is not valid HTTP: "
    )
    assert "SSH-2.0" in str(error)


async def test_a_dns_failure(tmp_path: Path) -> None:
    url = "https://api.dracpu-test.invalid:6443"  # RFC 6761: .invalid never resolves
    error = await failure(write_kubeconfig(tmp_path / "kubeconfig", url))
    assert str(error).startswith(
        f"get node {NODE}: cannot reach the API server {url}: DNS failure: cannot resolve "
        "api.dracpu-test.invalid: "
    )


async def test_tls_to_a_server_that_does_not_speak_it(tmp_path: Path) -> None:
    async def handler(stream: Stream, buffered: BufferedByteReceiveStream, number: int) -> None:
        await stream.receive()  # the ClientHello, answered as a plain HTTP server would
        await stream.send(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    url, error, _ = await served_failure(handler, tmp_path, scheme="https")
    assert str(error) == (
        f"get node {NODE}: cannot reach the API server {url}: TLS failure: handshake failed: the "
        "server does not speak TLS (WRONG_VERSION_NUMBER)"
    )


# --- proxies --------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def recording_proxy() -> AsyncIterator[tuple[int, list[RawRequest]]]:
    """A stand-in HTTP proxy: records each request, answers a Node named ``via-proxy``."""
    seen: list[RawRequest] = []
    body = json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "via-proxy"}})
    async with raw_server(answering(body.encode(), seen)) as (port, _):
        yield port, seen


@contextlib.asynccontextmanager
async def connect_proxy(*, refuse: bool = False) -> AsyncIterator[tuple[int, list[RawRequest]]]:
    """A CONNECT-only HTTP proxy on 127.0.0.1 that tunnels to the requested 127.0.0.1 port."""
    heads: list[RawRequest] = []

    async def handler(stream: Stream, buffered: BufferedByteReceiveStream, number: int) -> None:
        request = await read_request(buffered, number)
        assert request is not None
        heads.append(request)
        if refuse:
            await stream.send(
                b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 4\r\n\r\nnope"
            )
            return
        host, _, port = request.line.split()[1].rpartition(":")
        upstream = await anyio.connect_tcp(host, int(port))
        await stream.send(b"HTTP/1.1 200 Connection established\r\n\r\n")

        async def pump(source: anyio.abc.ByteReceiveStream, sink: anyio.abc.ByteStream) -> None:
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                while True:
                    await sink.send(await source.receive())

        async with upstream, anyio.create_task_group() as tg:
            tg.start_soon(pump, buffered, upstream)
            await pump(upstream, stream)
            tg.cancel_scope.cancel()

    async with raw_server(handler) as (port, _):
        yield port, heads


async def test_the_proxy_environment_is_read_once_when_the_client_opens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with recording_proxy() as (port, seen), open_fake_apiserver() as api:
        api.add_node(NODE, uid=NODE_UID)
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")
        async with open_kube_client(api.kubeconfig_path, request_timeout=10) as kube:
            monkeypatch.delenv("http_proxy")  # later changes do not matter: read at open
            assert (await kube.get_node(NODE))["metadata"]["name"] == "via-proxy"
        [request] = seen
        assert request.line == f"GET {api.url}/api/v1/nodes/{NODE} HTTP/1.1"
        assert api.requests == []  # nothing reached the server directly

        # A client opened without a proxy connects directly, whatever the environment says later.
        async with open_kube_client(api.kubeconfig_path, request_timeout=10) as kube:
            monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")
            assert await kube.get_node(NODE) == api.node(NODE)
        assert len(seen) == 1


async def test_proxy_credentials_reach_the_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    async with recording_proxy() as (port, seen), open_fake_apiserver() as api:
        monkeypatch.setenv("http_proxy", f"http://user:secret@127.0.0.1:{port}")
        async with open_kube_client(api.kubeconfig_path, request_timeout=10) as kube:
            assert (await kube.get_node(NODE))["metadata"]["name"] == "via-proxy"
    [request] = seen
    credentials = base64.b64encode(b"user:secret").decode()
    assert request.header("Proxy-Authorization") == f"Basic {credentials}"


async def test_proxy_credentials_from_netrc(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login net password rc\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    async with recording_proxy() as (port, seen), open_fake_apiserver() as api:
        monkeypatch.setenv("http_proxy", f"127.0.0.1:{port}")  # no scheme: http, as curl reads it
        async with open_kube_client(api.kubeconfig_path, request_timeout=10) as kube:
            assert (await kube.get_node(NODE))["metadata"]["name"] == "via-proxy"
    [request] = seen
    assert request.header("Proxy-Authorization") == "Basic " + base64.b64encode(b"net:rc").decode()


async def test_no_proxy_sends_requests_to_the_server_directly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with recording_proxy() as (port, seen), open_fake_apiserver() as api:
        api.add_node(NODE, uid=NODE_UID)
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("no_proxy", "127.0.0.1")
        async with open_kube_client(api.kubeconfig_path, request_timeout=10) as kube:
            assert await kube.get_node(NODE) == api.node(NODE)
    assert seen == []


async def test_https_through_a_proxy_tunnels_with_connect(pki: Pki, tmp_path: Path) -> None:
    async with (
        open_fake_apiserver(ssl_context=pki.server_context()) as api,
        connect_proxy() as (proxy_port, heads),
    ):
        api.add_node(NODE, uid=NODE_UID)
        config = write_kubeconfig(
            tmp_path / "kubeconfig",
            api.url,
            ca=pki.ca,
            cluster_extra=f"proxy-url: 'http://who:pw@127.0.0.1:{proxy_port}'",
        )
        async with open_kube_client(config, request_timeout=10) as kube:
            assert await kube.get_node(NODE) == api.node(NODE)
            assert await kube.get_node(NODE) == api.node(NODE)  # the tunnel is kept alive
        api_port = api.url.rpartition(":")[2]
        [connect] = heads
        assert connect.line == f"CONNECT 127.0.0.1:{api_port} HTTP/1.1"
        assert (
            connect.header("Proxy-Authorization") == "Basic " + base64.b64encode(b"who:pw").decode()
        )
        assert [r.path for r in api.requests] == [f"/api/v1/nodes/{NODE}"] * 2


async def test_a_proxy_refusal(pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with connect_proxy(refuse=True) as (proxy_port, _):
        monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{proxy_port}")
        url = "https://127.0.0.1:1"
        error = await failure(write_kubeconfig(tmp_path / "kubeconfig", url, ca=pki.ca))
    assert str(error) == (
        f"get node {NODE}: cannot reach the API server {url}: proxy refusal: the proxy answered "
        "the tunnel request with 407 Proxy Authentication Required"
    )


async def test_a_proxy_that_cannot_be_reached(tmp_path: Path) -> None:
    proxy_port = free_port()
    url = "https://127.0.0.1:1"
    config = write_kubeconfig(
        tmp_path / "kubeconfig", url, cluster_extra=f"proxy-url: 'http://127.0.0.1:{proxy_port}'"
    )
    error = await failure(config)
    assert str(error) == (
        f"get node {NODE}: cannot reach the API server {url}: cannot connect to the proxy "
        f"127.0.0.1:{proxy_port}: connection refused"
    )


async def test_only_http_proxies_are_accepted_from_the_kubeconfig(tmp_path: Path) -> None:
    config = write_kubeconfig(
        tmp_path / "kubeconfig",
        "https://127.0.0.1:6443",
        cluster_extra="proxy-url: 'socks5://127.0.0.1:1080'",
    )
    with pytest.raises(ConfigError, match="only http:// proxies"):
        async with open_kube_client(config):
            pass


# --- watch framing --------------------------------------------------------------------------------


async def next_event(events: Any) -> Any:
    with anyio.fail_after(10):
        return await events.__anext__()


async def test_watch_events_split_at_odd_places_in_chunks_and_packets(tmp_path: Path) -> None:
    def slice_obj(name: str, version: int) -> dict[str, Any]:
        return {
            "kind": "ResourceSlice",
            "metadata": {"name": name, "resourceVersion": str(version)},
        }

    events = [
        {"type": "ADDED", "object": slice_obj("a", 8)},
        {"type": "MODIFIED", "object": slice_obj("a", 9)},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "10"}}},
        {"type": "DELETED", "object": slice_obj("a", 11)},
    ]  # fmt: skip
    body = b"".join(json.dumps(e).encode() + b"\n" for e in events)
    # Chunk boundaries inside a JSON object, across a newline, several events in one chunk.
    cuts = [0, 5, 6, 40, len(body) // 2, len(body) // 2 + 1, len(body) - 1, len(body)]
    chunks = [body[a:b] for a, b in itertools.pairwise(cuts)]
    wire = b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in chunks) + b"0\r\n\r\n"
    listed = json.dumps(
        {"kind": "ResourceSliceList", "metadata": {"resourceVersion": "7"}, "items": []}
    ).encode()
    watches: list[RawRequest] = []
    second_watch = anyio.Event()

    async def handler(stream: Stream, buffered: BufferedByteReceiveStream, number: int) -> None:
        while (request := await read_request(buffered, number)) is not None:
            if "watch=true" not in request.line:
                await stream.send(ok(listed))
                continue
            watches.append(request)
            if len(watches) > 1:
                second_watch.set()
                await anyio.sleep_forever()
            await stream.send(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            for i in range(0, len(wire), 7):  # TCP packets cutting chunk headers too
                await stream.send(wire[i : i + 7])
                await anyio.sleep(0.001)  # let the client read each piece alone

    async with raw_server(handler) as (port, _):
        config = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
        async with open_kube_client(config, request_timeout=10, watch_seconds=60) as kube:
            stream = kube.watch_resource_slices("dra.cpu", NODE)
            async with contextlib.aclosing(stream):
                assert (await next_event(stream))[0] == LISTED
                got = [await next_event(stream) for _ in range(3)]
                async with anyio.create_task_group() as tg:
                    tg.start_soon(stream.__anext__)  # the stream ends: the watch is renewed
                    with anyio.fail_after(10):
                        await second_watch.wait()
                    tg.cancel_scope.cancel()
    assert got == [(e["type"], e["object"]) for e in events if e["type"] != "BOOKMARK"]
    assert "resourceVersion=7" in watches[0].line
    assert "resourceVersion=11" in watches[1].line  # renewed from the last event seen


async def test_a_watch_error_answer_cut_short_is_a_server_error(tmp_path: Path) -> None:
    # The server answers the watch with an error status and the connection drops in the middle
    # of the body (a restarting API server, a load balancer): a KubeServerError like any other
    # broken watch, never a raw aiohttp error the publisher would not retry.
    listed = json.dumps(
        {"kind": "ResourceSliceList", "metadata": {"resourceVersion": "7"}, "items": []}
    ).encode()

    async def handler(stream: Stream, buffered: BufferedByteReceiveStream, number: int) -> None:
        while (request := await read_request(buffered, number)) is not None:
            if "watch=true" in request.line:
                await stream.send(
                    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 400\r\n\r\n" + b'{"kind": "Status", "mess'
                )
                return  # closes the connection with most of the body missing
            await stream.send(ok(listed))

    async with raw_server(handler) as (port, _):
        url = f"http://127.0.0.1:{port}"
        config = write_kubeconfig(tmp_path / "kubeconfig", url)
        async with open_kube_client(config, request_timeout=5) as kube:
            events = kube.watch_resource_slices("dra.cpu", NODE)
            async with contextlib.aclosing(events):
                assert (await next_event(events))[0] == LISTED
                with pytest.raises(KubeServerError) as info:
                    await next_event(events)
    assert str(info.value).startswith(
        f"watch resourceslices spec.driver=dra.cpu,spec.nodeName={NODE}: the API server {url} "
        "answered 500 Internal Server Error: (reading the answer failed: connection closed by "
        "the server in the middle of the answer: "
    )
    assert info.value.status == 500
