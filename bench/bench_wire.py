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

The kubelet's DRA hot path, one NodePrepareResources of one claim as the kubelet sends it:

* ``dra.prepare_pair.codec``: decode the request and encode the one-claim answer (one device
  with request name, pool, device, CDI id and share id) with :mod:`dracpu.wire.dra`, what the
  DRA socket does per call;
* ``dra.prepare_pair.betterproto2``: the same with the generated betterproto2 messages of
  ``dracpu._gen.dra.v1`` (``FromString``, then build the reply messages and
  ``SerializeToString``), what it did before. ``decode_us`` / ``encode_us``: the two halves
  (p50). Both outputs are checked to be the same bytes before timing.

The gRPC server's protocol work per unary call (the kubelet's call as grpc clients send it:
a request head of nine fields, indexed in HPACK's dynamic table after the first call, and a
one-message body; an answer of head, message and trailers):

* ``h2.unary_call.ours``: :mod:`dracpu.wire.h2` with :mod:`dracpu.wire.hpack` and
  :mod:`dracpu.wire.grpc` (read the head and the message, send the answer), what the DRA socket
  does per call;
* ``h2.unary_call.h2``: the same with python-hyper's ``h2`` server connection, which grpclib
  (the server before ours) drives, grpclib's own work on top not counted.

Both replay the same client bytes, recorded once from an ``h2`` client.

Run: ``.venv/bin/python bench/bench_wire.py``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import h2.config
import h2.connection
import h2.events

from bench._harness import emit, percentiles
from dracpu._gen.dra import v1 as dra_v1
from dracpu.adapters.ttrpc_envelopes import read_request, request_data, response_data
from dracpu.wire import dra
from dracpu.wire import grpc as grpc_wire
from dracpu.wire import h2 as ours
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


def _prepare_request() -> bytes:
    namespace, uid, name = CLAIM
    message = dra_v1.NodePrepareResourcesRequest(
        claims=[dra_v1.Claim(namespace=namespace, uid=uid, name=name)]
    )
    return bytes(message)


def _codec_pair(data: bytes) -> tuple[Callable[[], bytes], Callable[[], bytes]]:
    """(decode, decode + encode) with the hand codec."""
    request, pool, device, cdi_id = DEVICE

    def decode() -> bytes:
        dra.decode_prepare_request(data)
        return b""

    def pair() -> bytes:
        [claim] = dra.decode_prepare_request(data)
        outcome = dra.PrepareOutcome(
            devices=(dra.PreparedDevice((request,), pool, device, (cdi_id,), SHARE_ID),)
        )
        return dra.encode_prepare_response({claim.uid: outcome})

    return decode, pair


def _betterproto2_pair(data: bytes) -> tuple[Callable[[], bytes], Callable[[], bytes]]:
    """(decode, decode + encode) with the betterproto2 messages."""
    request, pool, device, cdi_id = DEVICE

    def decode() -> bytes:
        dra_v1.NodePrepareResourcesRequest.FromString(data)
        return b""

    def pair() -> bytes:
        [claim] = dra_v1.NodePrepareResourcesRequest.FromString(data).claims
        reply = dra_v1.NodePrepareResourcesResponse(
            claims={
                claim.uid: dra_v1.NodePrepareResourceResponse(
                    devices=[
                        dra_v1.Device(
                            request_names=[request],
                            pool_name=pool,
                            device_name=device,
                            cdi_device_ids=[cdi_id],
                            share_id=SHARE_ID,
                        )
                    ]
                )
            }
        )
        return reply.SerializeToString()

    return decode, pair


def _per_call_us(fn: Callable[[], bytes], *, batches: int) -> list[float]:
    """Microseconds per call of ``fn``, one sample per batch of DRA_BATCH calls."""

    def batch() -> float:
        start = time.perf_counter()
        for _ in range(DRA_BATCH):
            fn()
        return (time.perf_counter() - start) / DRA_BATCH * 1e6

    batch()  # warm-up
    return [batch() for _ in range(batches)]


def dra_figures(batches: int = 30) -> None:
    """The ``dra.prepare_pair.*`` figures."""
    data = _prepare_request()
    implementations = {"betterproto2": _betterproto2_pair(data), "codec": _codec_pair(data)}
    answers = {label: pair() for label, (_, pair) in implementations.items()}
    if answers["codec"] != answers["betterproto2"]:
        raise SystemExit("bench_wire: the codec and betterproto2 encode different answers")
    results: dict[str, tuple[list[float], float]] = {}
    for label, (decode, pair) in implementations.items():
        decode_p50, _ = percentiles(_per_call_us(decode, batches=batches))
        results[label] = (_per_call_us(pair, batches=batches), decode_p50)
    baseline, _ = percentiles(results["betterproto2"][0])
    for label, (samples, decode_p50) in results.items():
        p50, p99 = percentiles(samples)
        emit(
            f"dra.prepare_pair.{label}",
            "us/pair",
            p50=round(p50, 3),
            p99=round(p99, 3),
            n=DRA_BATCH * len(samples),
            decode_us=round(decode_p50, 3),
            encode_us=round(p50 - decode_p50, 3),
            request_bytes=len(data),
            response_bytes=len(answers[label]),
            times_faster_than_betterproto2=round(baseline / p50, 1),
        )


_GRPC_HEAD = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"),
    (":authority", "localhost"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
    ("user-agent", "grpc-go/1.72.0"),
    ("grpc-timeout", "44999m"),
]
H2_CALLS = 2000  # calls per timed batch (one connection each batch)


def _client_bytes(calls: int, message: bytes, answer: bytes) -> list[bytes]:
    """What an ``h2`` client sends for ``calls`` unary calls, one chunk per call (the first also
    carries the preface), recorded against our server so that the windows stay open."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    server = ours.ServerConnection()
    client.receive_data(server.initiate())
    chunks: list[bytes] = []
    body = grpc_wire.frame_message(message)
    for _ in range(calls):
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, _GRPC_HEAD)
        client.send_data(stream_id, body, end_stream=True)
        chunk = client.data_to_send()  # with the acknowledgements of the previous answer
        chunks.append(chunk)
        for event in server.receive_data(chunk):
            if isinstance(event, ours.DataReceived) and event.end_stream:
                server.send_headers(event.stream_id, grpc_wire.RESPONSE_HEAD)
                server.send_data(event.stream_id, grpc_wire.frame_message(answer))
                server.send_headers(event.stream_id, grpc_wire.trailers(0), end_stream=True)
        for received in client.receive_data(server.data_to_send()):
            if isinstance(received, h2.events.DataReceived):
                client.acknowledge_received_data(
                    received.flow_controlled_length, received.stream_id
                )
    return chunks


def _ours_batch(chunks: list[bytes], answer: bytes) -> Callable[[], float]:
    ok = tuple(grpc_wire.trailers(0))

    def batch() -> float:
        server = ours.ServerConnection()
        server.initiate()
        start = time.perf_counter()
        for chunk in chunks:
            for event in server.receive_data(chunk):
                if isinstance(event, ours.RequestReceived):
                    grpc_wire.read_call_head(event.headers)
                    body = bytearray()
                elif isinstance(event, ours.DataReceived):
                    body += event.data
                    if event.end_stream:
                        grpc_wire.read_unary_message(bytes(body))
                        server.send_headers(event.stream_id, grpc_wire.RESPONSE_HEAD)
                        server.send_data(event.stream_id, grpc_wire.frame_message(answer))
                        server.send_headers(event.stream_id, ok, end_stream=True)
            server.data_to_send()
        return (time.perf_counter() - start) / len(chunks) * 1e6

    return batch


def _h2_batch(chunks: list[bytes], answer: bytes) -> Callable[[], float]:
    config = h2.config.H2Configuration(client_side=False, header_encoding="utf-8")

    def batch() -> float:
        server = h2.connection.H2Connection(config)
        server.initiate_connection()
        start = time.perf_counter()
        for chunk in chunks:
            for event in server.receive_data(chunk):
                if isinstance(event, h2.events.DataReceived):
                    server.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    stream_id = event.stream_id
                    if event.stream_ended is None:
                        continue
                    server.send_headers(stream_id, grpc_wire.RESPONSE_HEAD)
                    server.send_data(stream_id, grpc_wire.frame_message(answer))
                    server.send_headers(stream_id, grpc_wire.trailers(0), end_stream=True)
            server.data_to_send()
        return (time.perf_counter() - start) / len(chunks) * 1e6

    return batch


def h2_figures(batches: int = 10) -> None:
    """The ``h2.unary_call.*`` figures."""
    request = _prepare_request()
    answer = bytes(100)
    chunks = _client_bytes(H2_CALLS, request, answer)
    results = {}
    for label, batch in (("h2", _h2_batch(chunks, answer)), ("ours", _ours_batch(chunks, answer))):
        batch()  # warm-up
        results[label] = [batch() for _ in range(batches)]
    baseline, _ = percentiles(results["h2"])
    for label, samples in results.items():
        p50, p99 = percentiles(samples)
        emit(
            f"h2.unary_call.{label}",
            "us/call",
            p50=round(p50, 2),
            p99=round(p99, 2),
            n=H2_CALLS * len(samples),
            times_faster_than_h2=round(baseline / p50, 1),
        )


def main() -> None:
    batches = 30
    for label, size in SIZES.items():
        payload = bytes(i % 251 for i in range(size))
        n = _batch_size(size)
        data = _requests_on_the_socket(payload, n)
        _emit(f"wire.decode.{label}", _time(_decode_batch(data, n), batches=batches), n, size)
        _emit(f"wire.encode.{label}", _time(_encode_batch(payload, n), batches=batches), n, size)
    dra_figures(batches)
    h2_figures()


if __name__ == "__main__":
    main()
