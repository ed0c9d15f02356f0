"""Helpers shared by the tests that talk through the real kube adapter: the fake API server with a
client of it, and small raw HTTP/1.1 servers (independent peers: they parse requests with anyio's
buffered stream, sharing no code with aiohttp or the kubernetes client)."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.tls import TLSStream

from dracpu.adapters.kube import KubeClient, open_kube_client
from dracpu.sim.fake_apiserver import FakeApiServer, open_fake_apiserver

__all__ = [
    "NODE",
    "NODE_JSON",
    "NODE_UID",
    "OPENSSL",
    "Handler",
    "Pki",
    "RawRequest",
    "answering",
    "connected",
    "foreign_slice",
    "make_pki",
    "ok",
    "raw_server",
    "read_request",
    "write_kubeconfig",
]

NODE = "node-a"
NODE_UID = "6c4d2b1a-0000-4000-8000-000000000001"
NODE_JSON = b'{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}}'


def foreign_slice(name: str, *, driver: str, node: str, generation: int = 1) -> dict[str, Any]:
    """A minimal valid ResourceSlice of someone else (another driver, or another node)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [{"name": "dev0"}],
        },
    }


@contextlib.asynccontextmanager
async def connected(**options: Any) -> AsyncIterator[tuple[FakeApiServer, KubeClient]]:
    """A fake API server (``options`` go to it) holding node ``NODE``, and a client of it."""
    async with open_fake_apiserver(**options) as api:
        api.add_node(NODE, uid=NODE_UID)
        async with open_kube_client(api.kubeconfig_path, request_timeout=10) as kube:
            yield api, kube


def write_kubeconfig(
    path: Path,
    server: str,
    *,
    ca: Path | None = None,
    cluster_extra: str = "",
    user: str = "{token: t}",
) -> Path:
    """A kubeconfig for ``server`` (``cluster_extra``: more fields of the cluster entry)."""
    cluster = f"server: '{server}'"
    if ca is not None:
        cluster += f", certificate-authority: '{ca}'"
    if cluster_extra:
        cluster += ", " + cluster_extra
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{{cluster}}}}}]\n"
        f"users: [{{name: u, user: {user}}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    return path


# --- raw servers ----------------------------------------------------------------------------------


@dataclasses.dataclass
class RawRequest:
    """One request as a raw server read it."""

    connection: int
    head: str
    body: bytes

    @property
    def line(self) -> str:
        return self.head.split("\r\n")[0]

    @property
    def method(self) -> str:
        return self.line.split()[0]

    def header(self, name: str) -> str | None:
        for line in self.head.split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None


async def read_request(buffered: BufferedByteReceiveStream, connection: int) -> RawRequest | None:
    """One request from the connection (its body by Content-Length), ``None`` when the client
    closed it."""
    try:
        head = await buffered.receive_until(b"\r\n\r\n", 65536)
    except (anyio.IncompleteRead, anyio.EndOfStream):
        return None
    request = RawRequest(connection, head.decode("latin-1"), b"")
    length = int(request.header("Content-Length") or 0)
    if length:
        request.body = await buffered.receive_exactly(length)
    return request


def ok(body: bytes, *, extra: bytes = b"") -> bytes:
    """A 200 answer with a JSON ``body``."""
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + extra
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


Handler = Callable[
    [anyio.abc.SocketStream | TLSStream, BufferedByteReceiveStream, int], Awaitable[None]
]
"""``handler(stream, buffered, number)``: serves connection ``number`` (0, 1, ...)."""


def answering(body: bytes = NODE_JSON, seen: list[RawRequest] | None = None) -> Handler:
    """A handler that answers every request with ``body`` (recording the requests in ``seen``)."""

    async def handler(
        stream: anyio.abc.SocketStream | TLSStream, buffered: BufferedByteReceiveStream, number: int
    ) -> None:
        while (request := await read_request(buffered, number)) is not None:
            if seen is not None:
                seen.append(request)
            await stream.send(ok(body))

    return handler


@contextlib.asynccontextmanager
async def raw_server(
    handler: Handler, *, ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[int, list[int]]]:
    """A TCP (TLS) server on 127.0.0.1 calling ``handler`` for each connection; yields its port
    and the list of connection numbers accepted so far."""
    accepted: list[int] = []
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def serve(client: anyio.abc.SocketStream) -> None:
        stream: anyio.abc.SocketStream | TLSStream = client
        try:
            if ssl_context is not None:
                stream = await TLSStream.wrap(
                    client, server_side=True, ssl_context=ssl_context, standard_compatible=False
                )
            number = len(accepted)
            accepted.append(number)
            await handler(stream, BufferedByteReceiveStream(stream), number)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, ssl.SSLError, OSError):
            pass  # the client went away (or refused our certificate)
        finally:
            await anyio.aclose_forcefully(stream)

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        yield port, accepted
        tg.cancel_scope.cancel()


# --- certificates ---------------------------------------------------------------------------------

OPENSSL = shutil.which("openssl") or ""


@dataclasses.dataclass(frozen=True)
class Pki:
    """Test certificates: a CA, an unrelated CA, and two server certificates of the CA."""

    ca: Path
    other_ca: Path
    server_cert: Path  # SAN IP:127.0.0.1
    server_key: Path
    named_cert: Path  # SAN DNS:api.cluster.test only
    named_key: Path

    def server_context(self, *, named: bool = False) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        if named:
            context.load_cert_chain(self.named_cert, self.named_key)
        else:
            context.load_cert_chain(self.server_cert, self.server_key)
        return context


def _openssl(*args: str | Path) -> None:
    subprocess.run([OPENSSL, *map(str, args)], check=True, capture_output=True, timeout=60)


def make_pki(d: Path) -> Pki:
    """Make the certificates of a :class:`Pki` in ``d`` with the openssl CLI."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for name in ("ca", "other-ca"):
        _openssl(
            "req", "-x509", *ec, "-keyout", d / f"{name}.key", "-out", d / f"{name}.pem",
            "-days", "2", "-subj", f"/CN=dracpu test {name}",
        )  # fmt: skip
    for name, san in (("server", "IP:127.0.0.1"), ("named", "DNS:api.cluster.test")):
        _openssl(
            "req", *ec, "-keyout", d / f"{name}.key", "-out", d / f"{name}.csr",
            "-subj", f"/CN={name}",
        )  # fmt: skip
        (d / f"{name}.ext").write_text(
            f"subjectAltName={san}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
        )
        _openssl(
            "x509", "-req", "-in", d / f"{name}.csr", "-CA", d / "ca.pem", "-CAkey", d / "ca.key",
            "-CAcreateserial", "-out", d / f"{name}.pem", "-days", "2",
            "-extfile", d / f"{name}.ext",
        )  # fmt: skip
    return Pki(
        ca=d / "ca.pem",
        other_ca=d / "other-ca.pem",
        server_cert=d / "server.pem",
        server_key=d / "server.key",
        named_cert=d / "named.pem",
        named_key=d / "named.key",
    )
