"""The DRA gRPC service the kubelet calls: ``NodePrepareResources`` / ``NodeUnprepareResources``.

Served on ``<kubelet-root>/plugins/dra.cpu/dra.sock`` in both versions the kubelet speaks
(reference kubelet-and-k8s-api.md §1): ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` and
``k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin``. Both go through one :class:`DraService`; the
versions differ only in v1's ``Device.share_id``. Messages are read and written by the hand codec
:mod:`dracpu.wire.dra` (a few microseconds instead of betterproto2's ~80 us per call); a request
that does not decode fails the call with ``INVALID_ARGUMENT`` saying what is wrong, and the
server keeps serving.

Prepare, for each claim of a call, concurrently (at most :data:`MAX_CONCURRENT_CLAIMS` claims at
a time over all calls):

1. GET the ResourceClaim ``namespace/name`` (the kubelet sends references only) and read it with
   :func:`dracpu.core.claims.read_claim`: the UID must be the one asked for, the claim must be
   allocated, our results (driver ``dra.cpu``, pool = node name) must be well formed;
2. send :class:`~dracpu.core.commands.PrepareClaim` to the state owner, which picks the CPUs,
   writes the CDI spec and the checkpoint (and rewrites the spec when the claim was already
   prepared: a reboot empties ``/var/run/cdi``);
3. answer one entry per claim: a device per result of ours, with the main request name (the
   Go helper strips ``/<subrequest>``; the kubelet matches containers by main request names),
   pool, device and the claim's CDI id ``dra.k8s.io/cpu=claim-<uid>``;
4. best effort, record the cpuset in the claim's ``status.devices[].data`` (a failure is logged;
   the claim stays prepared). This PATCH starts only once the WHOLE answer (message and
   trailers) has been handed to the transport: each rpc method receives, prepares, answers with
   :meth:`~dracpu.adapters.grpc_server.Call.reply` (which returns once head, message and
   trailers are written), and only then starts the call's patches (held until then in a
   :class:`DeferredPatches`), and then waits :data:`STATUS_PATCH_DELAY` more, so building and
   sending the PATCH never competes with the answer nor with the kubelet taking it. If the
   call ends without an answer (the kubelet went away, the deadline passed) the patches start
   all the same: the claims ARE prepared here, so recording their cpusets is still right.
   The patches run in tasks of the kubelet-plugin task's own task group (cancelled when the
   task stops): the kubelet never waits for the API server's write. At most one patch per claim
   runs at a time, in order: a new Prepare of the claim cancels its pending patch (started or
   still held) and starts its own once that one has ended, and an Unprepare cancels it (the
   claim no longer holds those CPUs here); the patch carries the claim's ``resourceVersion``,
   so a write the API server still applies late can never overwrite a newer one. Beyond
   :data:`MAX_PENDING_STATUS_PATCHES` pending patches (a slow API server) a Prepare waits for its
   own patch before answering, as it did when patches were inline.

A claim that cannot be prepared gets its own ``error`` string; the other claims of the call are
still prepared, and the call itself never fails at the gRPC level for a claim's problem (the
kubelet then retries only what failed). Unprepare sends
:class:`~dracpu.core.commands.UnprepareClaim` per claim; the claim object is not read (it may
be gone) and an unknown claim succeeds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Protocol, TypeVar

import anyio
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from dracpu import DRIVER_NAME
from dracpu.adapters.grpc_server import Call, Handler, Service, open_unix_server
from dracpu.core.cdi_spec import device_id
from dracpu.core.claims import ClaimAllocation, device_status_patch, read_claim
from dracpu.core.commands import Command, PrepareClaim, UnprepareClaim
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import ClaimPrepared, ClaimUnprepared
from dracpu.errors import (
    DracpuError,
    GrpcError,
    KubeAPIError,
    KubeConflictError,
    KubeNotFoundError,
    LocalProtocolError,
    RemoteProtocolError,
)
from dracpu.tasks import state_owner
from dracpu.tasks.dra_cpu_metrics import DraCpuMetrics
from dracpu.tasks.state_owner import Request
from dracpu.wire.dra import (
    ClaimRef,
    PreparedDevice,
    PrepareOutcome,
    decode_prepare_request,
    decode_unprepare_request,
    encode_prepare_response,
    encode_unprepare_response,
)
from dracpu.wire.grpc import Status

__all__ = [
    "MAX_CONCURRENT_CLAIMS",
    "MAX_PENDING_STATUS_PATCHES",
    "SERVICE_V1",
    "SERVICE_V1BETA1",
    "STATUS_PATCH_DELAY",
    "STATUS_PATCH_TIMEOUT",
    "ClaimRef",
    "ClaimSource",
    "DeferredPatches",
    "DraPluginV1",
    "DraPluginV1beta1",
    "DraService",
    "PrepareOutcome",
    "PreparedDevice",
    "run",
]

logger = logging.getLogger(__name__)

# Claims handled at once over all calls: bounds the API GETs in flight. The kubelet sends one
# call per pod admission with that pod's claims (reference §1.5), rarely more than a few; the
# state owner serialises the rest anyway.
MAX_CONCURRENT_CLAIMS = 16
# Longest one best-effort status patch may take (seconds), a retry after a 409 included. It
# also bounds how long a Prepare answered inline (too many pending patches) waits for it: the
# kubelet gives the whole call 45 s (dra_plugin.go defaultClientCallTimeout).
STATUS_PATCH_TIMEOUT = 5.0
# Status patches pending after their Prepare was answered, at most; beyond, a Prepare waits for
# its patch before answering (back pressure instead of an unbounded backlog). Far above what a
# healthy API server leaves pending: the kubelet prepares one pod's claims per call and at most
# MAX_CONCURRENT_CLAIMS claims are handled at once.
MAX_PENDING_STATUS_PATCHES = 64
# How long a background status patch waits after its call was answered (seconds). The kubelet
# is woken by our answer on a unix socket, a "sync" wakeup that tends to put it on the CPU we
# run on: work we start at once (the PATCH, ~1 ms of CPU with its JSON and HTTP) makes it wait
# for that CPU. Measured with bench/bench_prepare.py: Prepare p50 5.3 ms with the PATCH at once,
# 4.4 ms with this delay, 4.0 ms with no PATCH at all. Short enough that the status is recorded
# long before the pod's containers are created.
STATUS_PATCH_DELAY = 0.001
# The gRPC services the kubelet calls: proto package + service name of proto/dra/v1 and
# proto/dra/v1beta1/api.proto (reference §1.1), as the generated DraPluginBase registers them.
SERVICE_V1 = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
SERVICE_V1BETA1 = "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"

T = TypeVar("T")


class ClaimSource(Protocol):
    """Where ResourceClaims come from (:class:`dracpu.adapters.kube.KubeClient` is one).

    Errors are :class:`~dracpu.errors.KubeAPIError` subclasses (404: KubeNotFoundError)."""

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...

    async def patch_resource_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]: ...


def _log_context(ref: ClaimRef) -> dict[str, str]:
    return {"claim": f"{ref.namespace}/{ref.name}", "claim_uid": ref.uid}


@dataclass(eq=False, slots=True)
class _StatusPatch:
    """A claim's status patch running after the answer. ``previous``: the claim's patch before
    this one (this one starts once it has ended); ``scope`` cancels it; ``done`` is set once it
    has ended, whatever the outcome (dropped unstarted included); ``started``: handed to the
    task group (or dropped), never to be started again."""

    ref: ClaimRef
    obj: Mapping[str, Any]
    allocation: ClaimAllocation
    cpus: CpuSet
    previous: _StatusPatch | None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    done: anyio.Event = field(default_factory=anyio.Event)
    started: bool = False


class DeferredPatches:
    """The status patches of one call, held until its answer is out.

    Made by :meth:`DraService.deferred_patches` and given to :meth:`DraService.prepare`;
    leaving its ``with`` block starts the held patches, however it is left (an answer that could
    not be sent included). A patch scheduled after that starts at once.
    """

    __slots__ = ("_held", "_start_patch", "_started")

    def __init__(self, start_patch: Callable[[_StatusPatch], None]) -> None:
        self._start_patch = start_patch
        self._held: list[_StatusPatch] = []
        self._started = False

    def _hold(self, patch: _StatusPatch) -> None:
        if self._started:
            self._start_patch(patch)
        else:
            self._held.append(patch)

    def __enter__(self) -> DeferredPatches:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._started = True
        held, self._held = self._held, []
        for patch in held:
            self._start_patch(patch)


def _unique(refs: Iterable[ClaimRef]) -> list[ClaimRef]:
    """The claims by UID, first occurrence wins (the answer is a map keyed by UID)."""
    seen: dict[str, ClaimRef] = {}
    for ref in refs:
        seen.setdefault(ref.uid, ref)
    return list(seen.values())


async def _each_claim(
    refs: Iterable[ClaimRef], handle: Callable[[ClaimRef], Awaitable[T]]
) -> dict[str, T]:
    """``handle`` every distinct claim concurrently; the results by claim UID (``handle`` never
    raises for a claim's problem: it returns that claim's error)."""
    claims = _unique(refs)
    results: dict[str, T] = {}
    if len(claims) == 1:  # the common case: no task group needed
        results[claims[0].uid] = await handle(claims[0])
        return results

    async def one(ref: ClaimRef) -> None:
        results[ref.uid] = await handle(ref)

    async with anyio.create_task_group() as tg:
        for ref in claims:
            tg.start_soon(one, ref)
    return results


class DraService:
    """Prepare and Unprepare, independent of the gRPC version.

    Inside :meth:`status_patches`, status patches run in the background (at most
    ``max_pending_status_patches`` pending): started once the call's answer is out when
    :meth:`prepare` is given a :class:`DeferredPatches`, else as soon as they are scheduled.
    Outside it they run inline, before :meth:`prepare` returns.
    """

    def __init__(
        self,
        owner: MemoryObjectSendStream[Request[Command]],
        claims: ClaimSource,
        node_name: str,
        *,
        driver: str = DRIVER_NAME,
        max_concurrent: int = MAX_CONCURRENT_CLAIMS,
        status_patch_timeout: float = STATUS_PATCH_TIMEOUT,
        status_patch_delay: float = STATUS_PATCH_DELAY,
        max_pending_status_patches: int = MAX_PENDING_STATUS_PATCHES,
        metrics: DraCpuMetrics | None = None,
    ) -> None:
        self._owner = owner
        self._metrics = metrics  # told each claim's outcome (upstream's dra_cpu_* metrics)
        self._claims = claims
        self._node_name = node_name
        self._driver = driver
        self._max_concurrent = max_concurrent
        self._status_patch_timeout = status_patch_timeout
        self._status_patch_delay = status_patch_delay
        self._limiter: anyio.CapacityLimiter | None = None
        self._background: TaskGroup | None = None  # runs the patches (inside status_patches)
        self._stopped = False  # status_patches has ended: no more patches
        self._max_pending = max_pending_status_patches
        self._pending: dict[str, _StatusPatch] = {}  # the latest patch by claim UID

    @asynccontextmanager
    async def status_patches(self) -> AsyncIterator[None]:
        """While the block runs, status patches run in the background, in a task group of the
        caller's task. When it ends they are cancelled, those still held are dropped, and a
        Prepare still answered afterwards (the server is stopping) records nothing."""
        async with anyio.create_task_group() as background:
            self._background = background
            try:
                yield
            finally:
                self._background = None
                self._stopped = True
                background.cancel_scope.cancel()
                for patch in list(self._pending.values()):
                    if not patch.started:  # held by a call still answering: never started
                        patch.started = True
                        self._finish(patch)

    async def wait_status_patches(self) -> None:
        """Wait until no status patch is pending (held, waiting or running)."""
        while self._pending:
            await next(iter(self._pending.values())).done.wait()

    def deferred_patches(self) -> DeferredPatches:
        """A holder for one call's status patches, to start once its answer is out."""
        return DeferredPatches(self._start_patch)

    def _slots(self) -> anyio.CapacityLimiter:
        # Created on first use: an anyio primitive needs the running event loop.
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self._max_concurrent)
        return self._limiter

    # --- prepare ---------------------------------------------------------------------------

    async def prepare(
        self, refs: Sequence[ClaimRef], *, deferred: DeferredPatches | None = None
    ) -> dict[str, PrepareOutcome]:
        """Prepare every claim; one outcome per distinct claim UID. The claims' status patches
        are held in ``deferred`` (if given) until it starts them."""
        return await _each_claim(refs, lambda ref: self._prepare_measured(ref, deferred))

    async def _prepare_measured(
        self, ref: ClaimRef, deferred: DeferredPatches | None
    ) -> PrepareOutcome:
        started = time.monotonic()
        outcome = await self._prepare_one(ref, deferred)
        if self._metrics is not None:
            self._metrics.prepared(ref.uid, not outcome.error, time.monotonic() - started)
        return outcome

    async def _prepare_one(self, ref: ClaimRef, deferred: DeferredPatches | None) -> PrepareOutcome:
        context = _log_context(ref)
        async with self._slots():
            try:
                obj, allocation = await self._read(ref)
                command = PrepareClaim(
                    claim_uid=ref.uid,
                    namespace=ref.namespace,
                    name=ref.name,
                    results=allocation.device_results(),
                )
                if allocation.configs:
                    logger.warning(
                        "claim %s/%s has %d opaque config(s) of %s; per-claim configuration is "
                        "not supported yet, the node defaults apply",
                        ref.namespace,
                        ref.name,
                        len(allocation.configs),
                        self._driver,
                        extra=context,
                    )
                result = await state_owner.request(self._owner, command)
                if not isinstance(result, ClaimPrepared):
                    raise DracpuError(f"the state owner answered {result!r} to PrepareClaim")
            except DracpuError as exc:
                logger.warning(
                    "cannot prepare claim %s/%s: %s", ref.namespace, ref.name, exc, extra=context
                )
                return PrepareOutcome(error=str(exc))
            except Exception as exc:  # a bug: fail this claim, keep serving the others
                logger.exception(
                    "internal error preparing claim %s/%s", ref.namespace, ref.name, extra=context
                )
                return PrepareOutcome(error=f"internal error preparing the claim: {exc!r}")
            if not result.cpus:
                logger.info(
                    "claim %s/%s has no device of %s on this node: nothing to prepare",
                    ref.namespace,
                    ref.name,
                    self._driver,
                    extra=context,
                )
                return PrepareOutcome()
            logger.info(
                "prepared claim %s/%s: cpus %s",
                ref.namespace,
                ref.name,
                result.cpus,
                extra={**context, "cpus": str(result.cpus)},
            )
            await self._status_patch(ref, obj, allocation, result.cpus, deferred)
        cdi_ids = (device_id(ref.uid),)
        return PrepareOutcome(
            devices=tuple(
                PreparedDevice(
                    request_names=(device.request,),
                    pool_name=device.pool,
                    device_name=device.device,
                    cdi_device_ids=cdi_ids,
                    share_id=device.share_id,
                )
                for device in allocation.devices
            )
        )

    async def _read(self, ref: ClaimRef) -> tuple[dict[str, Any], ClaimAllocation]:
        """GET the claim and read our allocation out of it (ClaimError/KubeAPIError if not)."""
        try:
            obj = await self._claims.get_resource_claim(ref.namespace, ref.name)
        except KubeNotFoundError as exc:
            raise DracpuError(
                f"ResourceClaim {ref.namespace}/{ref.name} (UID {ref.uid}) not found"
            ) from exc
        except KubeAPIError as exc:
            raise DracpuError(
                f"cannot get ResourceClaim {ref.namespace}/{ref.name}: {exc}"
            ) from exc
        allocation = read_claim(obj, uid=ref.uid, pool=self._node_name, driver=self._driver)
        return obj, allocation

    async def _status_patch(
        self,
        ref: ClaimRef,
        obj: Mapping[str, Any],
        allocation: ClaimAllocation,
        cpus: CpuSet,
        deferred: DeferredPatches | None,
    ) -> None:
        """Record the cpuset in the claim's status: in the background when a task group runs
        the patches and fewer than the limit are pending (held in ``deferred`` until the answer
        is out), else now (see the module docstring)."""
        if self._stopped:
            logger.debug(
                "not recording the cpuset of claim %s/%s: stopping",
                ref.namespace,
                ref.name,
                extra=_log_context(ref),
            )
            return
        previous = self._pending.get(ref.uid)
        if previous is not None:
            previous.scope.cancel()  # this Prepare read the claim later: its patch wins
        if self._background is None or (
            previous is None and len(self._pending) >= self._max_pending
        ):
            await self._record_status(ref, obj, allocation, cpus)
            return
        patch = _StatusPatch(ref, obj, allocation, cpus, previous)
        self._pending[ref.uid] = patch
        if deferred is None:
            self._start_patch(patch)
        else:
            deferred._hold(patch)

    def _start_patch(self, patch: _StatusPatch) -> None:
        """Hand a patch to the task group (drop it if the patches have ended meanwhile)."""
        if patch.started:
            return
        patch.started = True
        background = self._background
        if background is None:  # stopping: record nothing
            self._finish(patch)
            return
        background.start_soon(self._run_patch, patch)

    def _finish(self, patch: _StatusPatch) -> None:
        patch.done.set()
        if self._pending.get(patch.ref.uid) is patch:
            del self._pending[patch.ref.uid]

    async def _run_patch(self, patch: _StatusPatch) -> None:
        ref = patch.ref
        try:
            previous, patch.previous = patch.previous, None  # no chain of ended patches
            if previous is not None:
                await previous.done.wait()  # one patch of a claim at a time, in order
            if patch.scope.cancel_called:  # cancelled before it could start
                dropped = True
            else:
                with patch.scope:
                    await anyio.sleep(self._status_patch_delay)  # the kubelet takes its answer
                    await self._record_status(ref, patch.obj, patch.allocation, patch.cpus)
                dropped = patch.scope.cancelled_caught
            if dropped:
                logger.debug(
                    "status patch of claim %s/%s dropped: the claim was unprepared or prepared "
                    "again",
                    ref.namespace,
                    ref.name,
                    extra=_log_context(ref),
                )
        finally:
            self._finish(patch)

    async def _record_status(
        self, ref: ClaimRef, obj: Mapping[str, Any], allocation: ClaimAllocation, cpus: CpuSet
    ) -> None:
        """Best effort: write ``data: {"cpuset": ...}`` into the claim's ``status.devices``."""
        context = _log_context(ref)
        with anyio.move_on_after(self._status_patch_timeout) as scope:
            try:
                if await self._patch_status(ref, obj, allocation, cpus):
                    return
                # 409: the claim changed since we read it (the kubelet or the scheduler wrote
                # it); read it again and retry once.
                obj = await self._claims.get_resource_claim(ref.namespace, ref.name)
                allocation = read_claim(obj, uid=ref.uid, pool=self._node_name, driver=self._driver)
                if not await self._patch_status(ref, obj, allocation, cpus):
                    raise DracpuError("the claim keeps changing (409 conflict twice)")
            except DracpuError as exc:
                logger.warning(
                    "claim %s/%s is prepared, but its status.devices could not be updated: %s",
                    ref.namespace,
                    ref.name,
                    exc,
                    extra=context,
                )
        if scope.cancelled_caught:
            logger.warning(
                "claim %s/%s is prepared, but updating its status.devices took over %g s",
                ref.namespace,
                ref.name,
                self._status_patch_timeout,
                extra=context,
            )

    async def _patch_status(
        self, ref: ClaimRef, obj: Mapping[str, Any], allocation: ClaimAllocation, cpus: CpuSet
    ) -> bool:
        """Send the patch unless the status already says so; ``False`` on a 409 conflict."""
        patch = device_status_patch(obj, allocation, cpus, driver=self._driver)
        if patch is None:
            return True
        status = obj.get("status")
        if isinstance(status, Mapping) and status.get("devices") == patch["status"]["devices"]:
            return True  # a repeated Prepare: already recorded
        try:
            await self._claims.patch_resource_claim_status(ref.namespace, ref.name, patch)
        except KubeConflictError:
            return False
        return True

    # --- unprepare -------------------------------------------------------------------------

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """Unprepare every claim; an error string per distinct claim UID (``""``: done)."""
        return await _each_claim(refs, self._unprepare_measured)

    async def _unprepare_measured(self, ref: ClaimRef) -> str:
        error = await self._unprepare_one(ref)
        if self._metrics is not None:
            self._metrics.unprepared(ref.uid, not error)
        return error

    async def _unprepare_one(self, ref: ClaimRef) -> str:
        context = _log_context(ref)
        pending = self._pending.get(ref.uid)
        if pending is not None:
            pending.scope.cancel()  # its cpuset is about to be freed: do not record it now
        try:
            result = await state_owner.request(self._owner, UnprepareClaim(ref.uid))
            if not isinstance(result, ClaimUnprepared):
                raise DracpuError(f"the state owner answered {result!r} to UnprepareClaim")
        except DracpuError as exc:
            logger.warning(
                "cannot unprepare claim %s/%s: %s", ref.namespace, ref.name, exc, extra=context
            )
            return str(exc)
        except Exception as exc:  # a bug: fail this claim, keep serving the others
            logger.exception(
                "internal error unpreparing claim %s/%s", ref.namespace, ref.name, extra=context
            )
            return f"internal error unpreparing the claim: {exc!r}"
        if result.cpus:
            logger.info(
                "unprepared claim %s/%s: cpus %s are free",
                ref.namespace,
                ref.name,
                result.cpus,
                extra={**context, "cpus": str(result.cpus)},
            )
        else:
            logger.debug(
                "unprepare of claim %s/%s: it was not prepared here",
                ref.namespace,
                ref.name,
                extra=context,
            )
        return ""


# --- the two gRPC versions ----------------------------------------------------------------------


def _decode(call: Call, decode: Callable[[bytes], tuple[ClaimRef, ...]]) -> tuple[ClaimRef, ...]:
    """The claims of the call's request; ``INVALID_ARGUMENT`` if it does not decode."""
    try:
        return decode(call.request)
    except RemoteProtocolError as exc:
        logger.warning("refusing a %s call: %s", call.path.rsplit("/", 1)[-1], exc)
        raise GrpcError(Status.INVALID_ARGUMENT, str(exc)) from exc


def _encode(call: Call, encode: Callable[[], bytes]) -> bytes:
    try:
        return encode()
    except LocalProtocolError as exc:  # our bug: say so, keep serving
        logger.error("cannot encode the %s answer: %s", call.path.rsplit("/", 1)[-1], exc)
        raise GrpcError(Status.INTERNAL, f"cannot encode the answer: {exc}") from exc


class _DraPlugin:
    """One version of ``DRAPlugin`` over :class:`DraService`: its rpc methods by path
    (:meth:`methods`, for :func:`~dracpu.adapters.grpc_server.open_unix_server`).

    Not the generated ``DraPluginBase``: that one is grpclib's and decodes and encodes
    betterproto2 messages. The tests check that the method paths are the generated ones.
    """

    service_name: ClassVar[str]
    share_ids: ClassVar[bool]  # the version's Device has share_id (field 5)

    def __init__(self, service: DraService) -> None:
        self._service = service

    def methods(self) -> dict[str, Handler]:
        prefix = f"/{self.service_name}/"
        return {
            prefix + "NodePrepareResources": self.node_prepare_resources,
            prefix + "NodeUnprepareResources": self.node_unprepare_resources,
        }

    async def node_prepare_resources(self, call: Call) -> None:
        """Prepare, answer (the whole answer is with the transport when ``reply`` returns),
        THEN start the status patches."""
        refs = _decode(call, decode_prepare_request)
        with self._service.deferred_patches() as deferred:
            outcomes = await self._service.prepare(refs, deferred=deferred)
            call.reply(
                _encode(call, lambda: encode_prepare_response(outcomes, share_ids=self.share_ids))
            )

    async def node_unprepare_resources(self, call: Call) -> None:
        refs = _decode(call, decode_unprepare_request)
        errors = await self._service.unprepare(refs)
        call.reply(_encode(call, lambda: encode_unprepare_response(errors)))


class DraPluginV1(_DraPlugin):
    """``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` over :class:`DraService`."""

    service_name = SERVICE_V1
    share_ids = True


class DraPluginV1beta1(_DraPlugin):
    """``k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`` over :class:`DraService` (no
    ``share_id``: the v1beta1 Device has no field 5)."""

    service_name = SERVICE_V1BETA1
    share_ids = False


# --- the task -----------------------------------------------------------------------------------


async def run(
    socket_path: Path,
    owner: MemoryObjectSendStream[Request[Command]],
    claims: ClaimSource,
    node_name: str,
    *,
    driver: str = DRIVER_NAME,
    max_pending_status_patches: int = MAX_PENDING_STATUS_PATCHES,
    status_patch_delay: float = STATUS_PATCH_DELAY,
    metrics: DraCpuMetrics | None = None,
    task_status: TaskStatus[DraService] = TASK_STATUS_IGNORED,
) -> None:
    """Serve the DRA socket at ``socket_path`` (v1 and v1beta1) until cancelled.

    ``owner``: this task's own clone of the state owner's command stream (closed on exit).
    ``claims``: where ResourceClaims are read and their status patched. ``node_name``: our pool.
    Ready (``task_status.started(service)``) once the socket is listening.

    Resource handling: the socket file is removed on exit; calls in flight are cancelled (the
    kubelet retries them; a command the owner already received still completes), and so are the
    status patches still pending (best effort).
    Error handling: a socket that cannot be made raises :class:`~dracpu.errors.DracpuError`
    before ``started``; a claim's problem is that claim's error string, and a request that does
    not decode fails that call alone (``INVALID_ARGUMENT``), never the task.
    """
    async with owner:
        service = DraService(
            owner,
            claims,
            node_name,
            driver=driver,
            max_pending_status_patches=max_pending_status_patches,
            status_patch_delay=status_patch_delay,
            metrics=metrics,
        )
        handlers: list[Service] = [
            DraPluginV1(service).methods(),
            DraPluginV1beta1(service).methods(),
        ]
        # The patches' task group inside the server: when it ends, later answers patch nothing.
        async with (
            open_unix_server(handlers, socket_path, private_dir=True),
            service.status_patches(),
        ):
            logger.info("DRA socket %s is listening (v1, v1beta1)", socket_path)
            task_status.started(service)
            await anyio.sleep_forever()
