"""The kube adapter's requests: one ResourceClaim GET / status PATCH against the in-process fake
API server (:mod:`dracpu.sim.fake_apiserver`, aiohttp.web, same event loop).
Run: ``.venv/bin/python bench/bench_kube.py [--n 300]``.

Two request paths, both the official ``kubernetes`` client:

* ``kube.*``: :mod:`dracpu.adapters.kube` as the daemon runs it (``kubernetes.aio``'s
  ``ApiClient`` on the event loop, aiohttp underneath);
* ``kube_sync_thread.*``: the alternative the adapter did not take, measured so the choice rests
  on figures: the synchronous ``kubernetes.client.ApiClient`` (urllib3, its own keep-alive pool)
  called the same way (``param_serialize`` + ``call_api``, the raw JSON read by us), each call
  handed to a worker thread with ``anyio.to_thread.run_sync``;
* ``floor.*``: the stack's floor, the same requests sent with a bare ``aiohttp.ClientSession``
  (the library ``kubernetes.aio`` sends through), no ``kubernetes`` code on top.

The two paths take turns call by call, so both meet the same load. Figures (ms, p50/p99), each
with ``server_p50`` (the fake server's handler alone, measured around
:meth:`FakeApiServer.handle`) and ``client_p50`` (the median of total minus handler, per call:
the client plus the kernel's loopback):

* ``….get_claim.hot``: GETs back to back;
* ``….get_claim.cold``: a 3 ms busy spin before each GET, so the caches are as cold as for the GET
  inside a kubelet Prepare call (code that runs a few ms after the previous burst of work runs
  several times slower);
* ``….patch_claim_status.hot`` / ``.cold``: the same for a merge patch of ``status.devices``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp
import anyio
import anyio.to_thread
from kubernetes import client as sync_client
from kubernetes import config as sync_config

from bench._harness import emit, percentiles
from dracpu import __version__
from dracpu.adapters.kube import MERGE_PATCH, open_kube_client
from dracpu.sim.fake_apiserver import FakeApiServer, build_resource_claim, open_fake_apiserver

__all__ = ["main"]

NAMESPACE = "bench"
NODE = "bench-node"
SAMPLES = 300
WARMUP = 20
# The pause before a "cold" request: the gap between two kubelet calls is milliseconds; 3 ms of
# other work is enough to evict what the request path had in the caches.
COLD_SPIN_SECONDS = 0.003
_CLAIM = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"

_SETUPS = {
    "kube": "dracpu.adapters.kube (kubernetes.aio ApiClient) <- in-process fake API server",
    "kube_sync_thread": (
        "kubernetes.client ApiClient in anyio.to_thread <- in-process fake API server"
    ),
    "floor": "a bare aiohttp.ClientSession (what kubernetes.aio sends through) <- the same server",
}

_handler_ns = [0]

Get = Callable[[str], Awaitable[object]]
Patch = Callable[[str, dict[str, Any]], Awaitable[object]]


def _instrument_server() -> None:
    """Time the fake server's handler (the route binds ``api.handle`` when the app starts, so
    the class attribute is wrapped before that)."""
    original = FakeApiServer.handle

    async def timed(self: FakeApiServer, request: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return await original(self, request)
        finally:
            _handler_ns[0] += time.perf_counter_ns() - start

    FakeApiServer.handle = timed  # type: ignore[method-assign]


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _claim(index: int) -> dict[str, Any]:
    result = {
        "request": "cpus",
        "driver": "dra.cpu",
        "pool": NODE,
        "device": "cpudevnuma000",
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": {"dra.cpu/cpu": "4"},
    }
    return build_resource_claim(NAMESPACE, f"claim-{index}", [result], node_name=NODE)


async def _figures(
    calls: dict[str, Callable[[int], Awaitable[object]]], *, n: int, cold: bool, **extra: Any
) -> None:
    """One figure per entry of ``calls``, the calls of the entries taking turns (so that every
    path meets the same machine load)."""
    for i in range(WARMUP):
        for call in calls.values():
            await call(i)
    totals: dict[str, list[float]] = {name: [] for name in calls}
    clients: dict[str, list[float]] = {name: [] for name in calls}
    servers: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(n):
        for name, call in calls.items():
            if cold:
                _spin(COLD_SPIN_SECONDS)
            _handler_ns[0] = 0
            start = time.perf_counter_ns()
            await call(i)
            total = (time.perf_counter_ns() - start) / 1e6
            server = _handler_ns[0] / 1e6
            totals[name].append(total)
            servers[name].append(server)
            clients[name].append(total - server)
    for name in calls:
        p50, p99 = percentiles(totals[name])
        emit(
            name,
            "ms",
            p50=round(p50, 4),
            p99=round(p99, 4),
            n=n,
            server_p50=round(statistics.median(servers[name]), 4),
            client_p50=round(statistics.median(clients[name]), 4),
            setup=_SETUPS[name.split(".", 1)[0]],
            **extra,
        )


def _sync_client(kubeconfig: Path) -> tuple[Get, Patch, Callable[[], None]]:
    """GET and PATCH of a claim through the synchronous ``kubernetes`` client in a worker
    thread, and its closing function."""
    configuration = sync_client.Configuration()
    sync_config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig), client_configuration=configuration, persist_config=False
    )
    api = sync_client.ApiClient(configuration)
    api.user_agent = f"dracpu/{__version__}"

    def call(method: str, path: str, name: str, body: Any, content_type: str) -> Any:
        _, url, headers, _, _ = api.param_serialize(
            method=method,
            resource_path=path,
            path_params={"namespace": NAMESPACE, "name": name},
            header_params={"Accept": "application/json", "Content-Type": content_type},
            auth_settings=["BearerToken"],
        )
        response = api.call_api(method, url, header_params=headers, body=body)
        data = response.read()  # type: ignore[no-untyped-call]
        if response.status >= 400:
            raise RuntimeError(f"{method} {path}: {response.status}")
        return json.loads(data)

    async def get(name: str) -> object:
        return await anyio.to_thread.run_sync(call, "GET", _CLAIM, name, None, "application/json")

    async def patch(name: str, body: dict[str, Any]) -> object:
        return await anyio.to_thread.run_sync(
            call, "PATCH", _CLAIM + "/status", name, body, MERGE_PATCH
        )

    return get, patch, api.close


def _bare_aiohttp(session: aiohttp.ClientSession) -> tuple[Get, Patch]:
    """The same requests with a bare aiohttp session: the floor under ``kubernetes.aio``."""
    headers = {"Accept": "application/json", "Authorization": "Bearer fake-token"}

    async def get(name: str) -> object:
        path = _CLAIM.format(namespace=NAMESPACE, name=name)
        async with session.get(path, headers=headers) as response:
            return json.loads(await response.read())

    async def patch(name: str, body: dict[str, Any]) -> object:
        path = _CLAIM.format(namespace=NAMESPACE, name=name) + "/status"
        data = json.dumps(body)
        patch_headers = {**headers, "Content-Type": MERGE_PATCH}
        async with session.patch(path, data=data, headers=patch_headers) as response:
            return json.loads(await response.read())

    return get, patch


Paths = dict[str, tuple[Get, Patch]]


async def _bench(paths: Paths, claims: list[dict[str, Any]], n: int) -> None:
    def name_of(i: int) -> str:
        return str(claims[i % len(claims)]["metadata"]["name"])

    def getter(get: Get) -> Callable[[int], Awaitable[object]]:
        async def get_one(i: int) -> object:
            return await get(name_of(i))

        return get_one

    def patcher(patch: Patch) -> Callable[[int], Awaitable[object]]:
        async def patch_one(i: int) -> object:
            claim = claims[i % len(claims)]
            entry = {
                "driver": "dra.cpu",
                "pool": NODE,
                "device": "cpudevnuma000",
                "shareID": claim["status"]["allocation"]["devices"]["results"][0]["shareID"],
                "data": {"cpuset": str(i % 64)},
            }
            return await patch(name_of(i), {"status": {"devices": [entry]}})

        return patch_one

    gets = {f"{path}.get_claim": getter(get) for path, (get, _) in paths.items()}
    patches = {f"{path}.patch_claim_status": patcher(patch) for path, (_, patch) in paths.items()}
    for figures in (gets, patches):
        await _figures({f"{name}.hot": call for name, call in figures.items()}, n=n, cold=False)
        await _figures(
            {f"{name}.cold": call for name, call in figures.items()}, n=n, cold=True, spin_ms=3
        )


async def _run(n: int) -> None:
    _instrument_server()
    with tempfile.TemporaryDirectory(prefix="dracpu-bench-kube-") as tmp:
        async with open_fake_apiserver(kubeconfig_dir=Path(tmp), schema_validation=False) as api:
            claims = [api.add_resource_claim(_claim(i)) for i in range(n + WARMUP)]
            async with open_kube_client(api.kubeconfig_path) as kube:

                async def get(name: str) -> object:
                    return await kube.get_resource_claim(NAMESPACE, name)

                async def patch(name: str, body: dict[str, Any]) -> object:
                    return await kube.patch_resource_claim_status(NAMESPACE, name, body)

                sync_get, sync_patch, close = _sync_client(api.kubeconfig_path)
                try:
                    async with aiohttp.ClientSession(api.url) as session:
                        paths = {
                            "kube": (get, patch),
                            "kube_sync_thread": (sync_get, sync_patch),
                            "floor": _bare_aiohttp(session),
                        }
                        await _bench(paths, claims, n)
                finally:
                    close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--n", type=int, default=SAMPLES, help="calls per figure")
    args = parser.parse_args()
    anyio.run(_run, args.n, backend="asyncio")


if __name__ == "__main__":
    main()
