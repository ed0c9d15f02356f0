"""Throughput of the NRI stack (mux + ttrpc framing + envelopes), the plugin's hot path.

* ``wire.decode.<size>``: socket bytes of runtime -> plugin requests, read in 64 KiB pieces, through
  ``MuxConnection`` and a server ``TtrpcConnection`` into ``TtrpcRequest`` events, each
  envelope decoded (:func:`dracpu.adapters.ttrpc_envelopes.read_request`);
* ``wire.encode.<size>``: the plugin's answers: the response envelope
  (:func:`~dracpu.adapters.ttrpc_envelopes.response_data`), ``send_response`` then
  ``MuxConnection.send``.

``<size>`` is the inner payload (200 B, 4 KiB, 64 KiB). Each figure times batches of messages:
p50/p99 are microseconds per message over the batches; ``mb_per_s`` and ``msgs_per_s`` come
from the p50.

Run: ``.venv/bin/python bench/bench_wire.py``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from bench._harness import emit, percentiles
from dracpu.adapters.ttrpc_envelopes import read_request, request_data, response_data
from dracpu.wire.events import NEED_DATA, MuxFrame, TtrpcRequest
from dracpu.wire.mux import PLUGIN_SERVICE_CONN, MuxConnection
from dracpu.wire.ttrpc import Role, TtrpcConnection

__all__ = ["main"]

SIZES = {"200B": 200, "4KiB": 4096, "64KiB": 65536}
READ_SIZE = 65536  # a typical socket recv() size
SERVICE = "nri.pkg.api.v1alpha1.Plugin"
# One claim as the kubelet names it, and the answer of a grouped-mode Prepare for it.
CLAIM_UID = "0b6f4c1e-3f5d-4c8a-9a57-2d1e6f7a8b90"
CLAIM = ("default", CLAIM_UID, "pod-cpus-7d9f")
DEVICE = ("cpu", "node-1", "cpudevnuma000", f"dra.k8s.io/cpu=claim-{CLAIM_UID}")
SHARE_ID = "5e0a9a44-7c2b-4d59-8c4f-0f1e2d3c4b5a"
DRA_BATCH = 2000  # pairs per timed batch: ~10-100 ms a batch


def _batch_size(size: int) -> int:
    return max(20, min(2000, (4 << 20) // size))


def _requests_on_the_socket(payload: bytes, n: int) -> bytes:
    runtime_client, runtime_mux = TtrpcConnection(Role.CLIENT), MuxConnection()
    out = bytearray()
    for _ in range(n):
        data = request_data(SERVICE, "CreateContainer", payload, 2 * 10**9)
        _, message = runtime_client.send_request(data)
        out += runtime_mux.send(PLUGIN_SERVICE_CONN, message)
    return bytes(out)


def _decode_batch(data: bytes, n: int) -> Callable[[], float]:
    """Seconds to turn ``data`` into its ``n`` request events."""

    def run() -> float:
        start = time.perf_counter()
        mux, server = MuxConnection(), TtrpcConnection(Role.SERVER)
        seen = 0
        for offset in range(0, len(data), READ_SIZE):
            mux.receive_data(data[offset : offset + READ_SIZE])
            while isinstance(frame := mux.next_event(), MuxFrame):
                server.receive_data(frame.payload)
                while (event := server.next_event()) is not NEED_DATA:
                    assert isinstance(event, TtrpcRequest)
                    read_request(event)
                    seen += 1
        elapsed = time.perf_counter() - start
        assert seen == n
        return elapsed

    return run


def _encode_batch(payload: bytes, n: int) -> Callable[[], float]:
    """Seconds to answer ``n`` received requests with ``payload`` as socket bytes."""
    client = TtrpcConnection(Role.CLIENT)
    request = request_data(SERVICE, "M", b"")
    requests = b"".join(client.send_request(request)[1] for _ in range(n))

    def run() -> float:
        server, mux = TtrpcConnection(Role.SERVER), MuxConnection()
        server.receive_data(requests)
        while server.next_event() is not NEED_DATA:
            pass
        start = time.perf_counter()
        for stream_id in range(1, 2 * n, 2):
            mux.send(PLUGIN_SERVICE_CONN, server.send_response(stream_id, response_data(payload)))
        return time.perf_counter() - start

    return run


def _time(fn: Callable[[], float], *, batches: int) -> list[float]:
    fn()  # warm-up
    return [fn() for _ in range(batches)]


def _emit(name: str, samples: list[float], n: int, size: int) -> None:
    per_msg_us = [s / n * 1e6 for s in samples]
    p50, p99 = percentiles(per_msg_us)
    emit(
        name,
        "us/msg",
        p50=round(p50, 3),
        p99=round(p99, 3),
        n=n * len(samples),
        payload_bytes=size,
        msgs_per_s=round(1e6 / p50),
        mb_per_s=round(size / p50, 1),  # bytes per microsecond == MB/s
    )


def main() -> None:
    batches = 30
    for label, size in SIZES.items():
        payload = bytes(i % 251 for i in range(size))
        n = _batch_size(size)
        data = _requests_on_the_socket(payload, n)
        _emit(f"wire.decode.{label}", _time(_decode_batch(data, n), batches=batches), n, size)
        _emit(f"wire.encode.{label}", _time(_encode_batch(payload, n), batches=batches), n, size)


if __name__ == "__main__":
    main()
