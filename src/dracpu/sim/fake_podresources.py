"""The kubelet's PodResources socket, played with grpcio for the fake kubelet.

It shares no code with the daemon's client (grpclib + betterproto2): grpcio with Google-protobuf
messages (:mod:`dracpu.sim._pb2`) and the method path written out. What it answers follows the
kubelet (``pkg/kubelet/apis/podresources/server_v1.go``, reference kubelet-and-k8s-api.md §4):

- ``List`` names every active pod (:class:`KubeletPods`: the pods the simulation runs) with its
  containers; a container's ``dynamic_resources`` are the claims it references that are in the
  kubelet's DRA claim cache (prepared through the fake kubelet, or put there by a test as a
  claim of another driver), one ``ClaimResource`` per prepared device with its CDI device ids.
  With :attr:`PodResourcesServer.dynamic_resources` off (the kubelet's
  ``KubeletPodResourcesDynamicResources`` gate off) no container has any.
- The kubelet's rate limiter: a token bucket of 100 requests per second and bursts of 10 for all
  clients together; a call over it is ``RESOURCE_EXHAUSTED`` "rejected by rate limit"
  (``pkg/kubelet/apis/podresources/grpc/ratelimit.go``).
- Faults on demand: :meth:`PodResourcesServer.fail` answers the next calls with a status code
  (``RESOURCE_EXHAUSTED``, ``UNAVAILABLE``, ...); not starting the server (or :meth:`stop`)
  leaves no socket at all; :attr:`PodResourcesServer.answer` replaces the answer outright (a
  message, or raw bytes: a malformed answer).

Every call is recorded (:attr:`PodResourcesServer.calls`). ``Get`` and
``GetAllocatableResources`` are not served (grpcio answers ``UNIMPLEMENTED``): the daemon only
lists.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from dracpu.sim._pb2.podresources.v1 import api_pb2 as pr

__all__ = [
    "BURST",
    "QPS",
    "CachedClaim",
    "ClaimDevice",
    "KubeletPods",
    "PodResourcesCall",
    "PodResourcesServer",
]

# The kubelet's limiter on the PodResources socket (grpc/ratelimit.go DefaultQPS,
# DefaultBurstTokens) and its refusal (codes.ResourceExhausted, "rejected by rate limit").
QPS = 100.0
BURST = 10
_RATE_LIMITED = "rejected by rate limit"
_SERVICE = "v1.PodResourcesLister"  # proto package "v1": the wire name is v1.PodResourcesLister


def _serialize(answer: pr.ListPodResourcesResponse | bytes) -> bytes:
    return answer if isinstance(answer, bytes) else answer.SerializeToString()


@dataclass(frozen=True, slots=True)
class ClaimDevice:
    """One prepared device of a claim, as the kubelet's claim cache keeps it."""

    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class CachedClaim:
    """A claim in the kubelet's DRA claim cache: prepared by ``driver`` with these devices."""

    namespace: str
    name: str
    uid: str
    driver: str
    devices: tuple[ClaimDevice, ...]


class KubeletPods:
    """The kubelet's active pods (containers and the claims each references, by UID) and its
    claim cache. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], dict[str, tuple[str, ...]]] = {}
        self._claims: dict[str, CachedClaim] = {}

    def add_pod(self, namespace: str, name: str, containers: Mapping[str, Sequence[str]]) -> None:
        """A pod the kubelet runs: ``{container name: claim UIDs it references}``."""
        with self._lock:
            self._pods[namespace, name] = {c: tuple(uids) for c, uids in containers.items()}

    def remove_pod(self, namespace: str, name: str) -> None:
        """The pod is no longer active (a missing pod is no error)."""
        with self._lock:
            self._pods.pop((namespace, name), None)

    def pods(self) -> dict[tuple[str, str], dict[str, tuple[str, ...]]]:
        with self._lock:
            return {key: dict(containers) for key, containers in self._pods.items()}

    def claim_prepared(self, claim: CachedClaim) -> None:
        """The claim is in the cache (a driver prepared it)."""
        with self._lock:
            self._claims[claim.uid] = claim

    def claim_unprepared(self, uid: str) -> None:
        with self._lock:
            self._claims.pop(uid, None)

    def claims(self) -> dict[str, CachedClaim]:
        with self._lock:
            return dict(self._claims)

    def response(self, *, dynamic_resources: bool = True) -> pr.ListPodResourcesResponse:
        """The ``List`` answer the kubelet would give now."""
        with self._lock:
            pods = {key: dict(containers) for key, containers in self._pods.items()}
            claims = dict(self._claims)
        response = pr.ListPodResourcesResponse()
        for (namespace, name), containers in sorted(pods.items()):
            pod = response.pod_resources.add(name=name, namespace=namespace)
            for container_name, uids in containers.items():
                container = pod.containers.add(name=container_name)
                if not dynamic_resources:
                    continue
                for uid in uids:
                    claim = claims.get(uid)
                    if claim is None:  # not prepared (yet): not in the cache, not listed
                        continue
                    listed = container.dynamic_resources.add(
                        claim_name=claim.name, claim_namespace=claim.namespace
                    )
                    for device in claim.devices:
                        resource = listed.claim_resources.add(
                            driver_name=claim.driver,
                            pool_name=device.pool_name,
                            device_name=device.device_name,
                        )
                        if device.share_id is not None:
                            resource.share_id = device.share_id
                        for cdi_id in device.cdi_device_ids:
                            resource.cdi_devices.add(name=cdi_id)
        return response


@dataclass(frozen=True, slots=True)
class PodResourcesCall:
    """One ``List`` the server received: when (``time.monotonic()``) and the status code it
    answered (``"OK"``, ``"RESOURCE_EXHAUSTED"``, ...)."""

    at: float
    code: str


class PodResourcesServer:
    """The kubelet's PodResources socket at ``socket`` (grpcio), answering ``List`` from
    ``pods``. Not serving until :meth:`start`; :meth:`stop` removes the socket.

    ``dynamic_resources``: the kubelet's gate (off: no container lists a claim). ``answer``:
    when set, called for each ``List`` instead of ``pods`` (a test's own answer: a message or
    the bytes to send).
    """

    def __init__(self, socket: Path, pods: KubeletPods, *, qps: float = QPS, burst: int = BURST):
        self.socket = socket
        self.pods = pods
        self.dynamic_resources = True
        self.answer: Callable[[], pr.ListPodResourcesResponse | bytes] | None = None
        self._qps = qps
        self._burst = burst
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._refilled = time.monotonic()
        self._faults: deque[tuple[grpc.StatusCode, str]] = deque()
        self._calls: list[PodResourcesCall] = []
        self._server: Any = None

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Listen on the socket (its directory is created; a leftover file is replaced)."""
        if self._server is not None:
            return
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        handler = grpc.method_handlers_generic_handler(
            _SERVICE,
            {
                "List": grpc.unary_unary_rpc_method_handler(
                    self._list,
                    request_deserializer=pr.ListPodResourcesRequest.FromString,
                    response_serializer=_serialize,
                )
            },
        )
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"unix:{self.socket.absolute()}")
        server.start()
        self._server = server

    def stop(self) -> None:
        """Stop serving and remove the socket: as if the kubelet had none."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(None).wait(5.0)
        self.socket.unlink(missing_ok=True)

    @property
    def serving(self) -> bool:
        return self._server is not None

    def __enter__(self) -> PodResourcesServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- what a test controls and sees ---------------------------------------------------------

    def fail(self, code: str, times: int = 1, details: str = "") -> None:
        """Answer the next ``times`` calls with status ``code`` (a ``grpc.StatusCode`` name)."""
        status = grpc.StatusCode[code]
        text = details or (_RATE_LIMITED if status is grpc.StatusCode.RESOURCE_EXHAUSTED else code)
        with self._lock:
            self._faults.extend([(status, text)] * times)

    @property
    def calls(self) -> list[PodResourcesCall]:
        with self._lock:
            return list(self._calls)

    def answered(self, code: str = "OK") -> int:
        """How many calls were answered with ``code``."""
        return sum(1 for call in self.calls if call.code == code)

    # --- the service ---------------------------------------------------------------------------

    def _take_token(self, now: float) -> bool:
        self._tokens = min(float(self._burst), self._tokens + (now - self._refilled) * self._qps)
        self._refilled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _list(self, request: pr.ListPodResourcesRequest, context: Any) -> Any:
        now = time.monotonic()
        with self._lock:
            fault: tuple[grpc.StatusCode, str] | None = None
            if not self._take_token(now):
                fault = (grpc.StatusCode.RESOURCE_EXHAUSTED, _RATE_LIMITED)
            elif self._faults:
                fault = self._faults.popleft()
            self._calls.append(PodResourcesCall(now, "OK" if fault is None else fault[0].name))
        if fault is not None:
            context.abort(*fault)
        if self.answer is not None:
            return self.answer()
        return self.pods.response(dynamic_resources=self.dynamic_resources)
