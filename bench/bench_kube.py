"""The kube adapter's own HTTP/1.1 client: one ResourceClaim GET / status PATCH against the
in-process fake API server (:mod:`dracpu.sim.fake_apiserver`, aiohttp.web, same event loop).
Run: ``.venv/bin/python bench/bench_kube.py [--n 300]``.

Figures (ms, p50/p99), each with ``server_p50`` (the fake server's handler alone, measured
around :meth:`FakeApiServer.handle`) and ``client_p50`` (the median of total minus handler, per
call: our client plus the kernel's loopback):

* ``kube.get_claim.hot``: GETs back to back;
* ``kube.get_claim.cold``: a 3 ms busy spin before each GET, so the caches are as cold as for the
  GET inside a kubelet Prepare call (on this VM everything runs ~3x slower a few ms after the
  previous burst of work);
* ``kube.patch_claim_status.hot`` / ``.cold``: the same for a merge patch of ``status.devices``.

Baseline (before this client, measured the same way with /work/tmp/get6.py, ``kubernetes.aio``
``ApiClient`` -> aiohttp): GET 0.34-0.40 ms hot, 0.94-1.14 ms cold; a raw asyncio stream
(write the request, read head + Content-Length body, ``json.loads``) 0.19 ms hot, 0.59 ms cold.
The old path cannot run any more, so only the new figures are printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio

from bench._harness import emit, percentiles
from dracpu.adapters.kube import KubeClient, open_kube_client
from dracpu.sim.fake_apiserver import FakeApiServer, build_resource_claim, open_fake_apiserver

__all__ = ["main"]

NAMESPACE = "bench"
NODE = "bench-node"
SAMPLES = 300
WARMUP = 20
# The pause before a "cold" request: the gap between two kubelet calls is milliseconds; 3 ms of
# other work is enough to evict what the request path had in the caches (measured, brief C).
COLD_SPIN_SECONDS = 0.003

_handler_ns = [0]


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


async def _figure(
    name: str, call: Callable[[int], Awaitable[object]], *, n: int, cold: bool, **extra: Any
) -> None:
    for i in range(WARMUP):
        await call(i)
    totals: list[float] = []
    clients: list[float] = []
    servers: list[float] = []
    for i in range(n):
        if cold:
            _spin(COLD_SPIN_SECONDS)
        _handler_ns[0] = 0
        start = time.perf_counter_ns()
        await call(i)
        total = (time.perf_counter_ns() - start) / 1e6
        server = _handler_ns[0] / 1e6
        totals.append(total)
        servers.append(server)
        clients.append(total - server)
    p50, p99 = percentiles(totals)
    emit(
        name,
        "ms",
        p50=round(p50, 4),
        p99=round(p99, 4),
        n=n,
        server_p50=round(statistics.median(servers), 4),
        client_p50=round(statistics.median(clients), 4),
        **extra,
    )


async def _run(n: int) -> None:
    _instrument_server()
    with tempfile.TemporaryDirectory(prefix="dracpu-bench-kube-") as tmp:
        async with open_fake_apiserver(kubeconfig_dir=Path(tmp), schema_validation=False) as api:
            count = n + WARMUP
            claims = [api.add_resource_claim(_claim(i)) for i in range(count)]
            async with open_kube_client(api.kubeconfig_path) as kube:
                await _bench(kube, claims, n)


async def _bench(kube: KubeClient, claims: list[dict[str, Any]], n: int) -> None:
    def name_of(i: int) -> str:
        return str(claims[i % len(claims)]["metadata"]["name"])

    async def get(i: int) -> object:
        return await kube.get_resource_claim(NAMESPACE, name_of(i))

    async def patch(i: int) -> object:
        entry = {"driver": "dra.cpu", "pool": NODE, "device": "cpudevnuma000"}
        claim = claims[i % len(claims)]
        entry["shareID"] = claim["status"]["allocation"]["devices"]["results"][0]["shareID"]
        entry_data = {**entry, "data": {"cpuset": str(i % 64)}}
        return await kube.patch_resource_claim_status(
            NAMESPACE, name_of(i), {"status": {"devices": [entry_data]}}
        )

    where = "kube adapter (own HTTP/1.1 client) <- in-process fake API server, keep-alive"
    await _figure("kube.get_claim.hot", get, n=n, cold=False, setup=where)
    await _figure("kube.get_claim.cold", get, n=n, cold=True, setup=where, spin_ms=3)
    await _figure("kube.patch_claim_status.hot", patch, n=n, cold=False, setup=where)
    await _figure("kube.patch_claim_status.cold", patch, n=n, cold=True, setup=where, spin_ms=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--n", type=int, default=SAMPLES, help="calls per figure")
    args = parser.parse_args()
    anyio.run(_run, args.n, backend="asyncio")


if __name__ == "__main__":
    main()
