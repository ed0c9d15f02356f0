"""The DRA gRPC service the kubelet calls: ``NodePrepareResources`` / ``NodeUnprepareResources``.

Served on ``<kubelet-root>/plugins/dra.cpu/dra.sock`` in both versions the kubelet speaks
(``k8s.io/kubelet`` ``pkg/apis/dra/v1`` and ``v1beta1``, differing only in v1's
``Device.share_id``) through one :class:`DraService`, by grpclib
(:func:`dracpu.adapters.grpc_unix.open_grpc_server`) with the betterproto2 messages and service
bases of ``dracpu._gen.dra``; the same socket serves the devices' health
(:mod:`dracpu.tasks.device_health`). Prepare, for each claim of a call concurrently (at most
:data:`MAX_CONCURRENT_CLAIMS` over all calls): GET and read the ResourceClaim
(:func:`dracpu.core.claims.read_claim`, its opaque configs by
:func:`dracpu.core.claim_config.claim_overrides`), send
:class:`~dracpu.core.commands.PrepareClaim` to the state owner, answer a device per result of
ours with the claim's CDI id (and, on each request's first device, its metadata's, as the Go
helper does with ``EnableDeviceMetadata``), and only once the whole answer has been handed to
the transport patch the claim's status (:mod:`dracpu.tasks.status_patches`). A claim that
cannot be prepared gets its own ``error``; the call never fails for a claim's problem.
Unprepare sends :class:`~dracpu.core.commands.UnprepareClaim` per claim without reading it. The
walk is ``docs/architecture.md``, "The walk of one claim" and "DRA socket".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, TypeVar

import anyio
import betterproto2
import grpclib.const
import grpclib.server
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from dracpu import DRIVER_NAME
from dracpu._gen.dra import v1 as dra_v1
from dracpu._gen.dra import v1beta1 as dra_v1beta1
from dracpu.adapters.grpc_unix import (
    Servable,
    open_grpc_server,
    receive_request,
    with_stream_handlers,
)
from dracpu.core.cdi_spec import device_id
from dracpu.core.claim_config import claim_overrides
from dracpu.core.claims import ClaimAllocation, read_claim
from dracpu.core.commands import Command, PrepareClaim, UnprepareClaim
from dracpu.core.device_metadata import metadata_ids_by_device
from dracpu.core.effects import ClaimPrepared, ClaimUnprepared
from dracpu.errors import DracpuError, KubeAPIError, KubeNotFoundError
from dracpu.tasks import state_owner
from dracpu.tasks.device_health import (
    DeviceHealthBoard,
    HealthStreams,
    ResourceHealthV1,
    ResourceHealthV1alpha1,
)
from dracpu.tasks.dra_cpu_metrics import DraCpuMetrics
from dracpu.tasks.state_owner import Request
from dracpu.tasks.status_patches import (
    MAX_PENDING_STATUS_PATCHES,
    STATUS_PATCH_DELAY,
    STATUS_PATCH_TIMEOUT,
    ClaimRef,
    ClaimSource,
    DeferredPatches,
    StatusPatches,
    log_context,
)

__all__ = [
    "MAX_CONCURRENT_CLAIMS",
    "MAX_PENDING_STATUS_PATCHES",
    "STATUS_PATCH_DELAY",
    "STATUS_PATCH_TIMEOUT",
    "ClaimRef",
    "ClaimSource",
    "DraPluginV1",
    "DraPluginV1beta1",
    "DraService",
    "PrepareOutcome",
    "PreparedDevice",
    "run",
]

logger = logging.getLogger(__name__)

# Claims handled at once over all calls: bounds the API GETs in flight. The kubelet sends one
# call per pod admission with that pod's claims of our driver (kubernetes
# pkg/kubelet/cm/dra/manager.go PrepareResources), rarely more than a few; the state owner
# serialises the rest anyway.
MAX_CONCURRENT_CLAIMS = 16

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """A ``Device`` of a ``NodePrepareResourceResponse``: one device of a prepared claim, as the
    kubelet stores it. ``share_id`` ``None``: absent (v1beta1 never carries it)."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class PrepareOutcome:
    """A ``NodePrepareResourceResponse``: the answer for one claim, its devices or a non-empty
    ``error``."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


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

    :attr:`patches` records the prepared claims' cpusets in their status
    (:class:`~dracpu.tasks.status_patches.StatusPatches`); a Prepare given a
    :class:`~dracpu.tasks.status_patches.DeferredPatches` holds its claims' patches in it.
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
        allocator: str | None = None,
        runtime_not_ready: Callable[[], str] | None = None,
    ) -> None:
        self._owner = owner
        self._allocator = allocator  # upstream's allocator key, grouped mode (claim_config)
        # Why the runtime cannot pin a new claim's containers now ("": it can).
        self._runtime_not_ready = runtime_not_ready
        self._metrics = metrics  # told each claim's outcome (upstream's dra_cpu_* metrics)
        self._claims = claims
        self._node_name = node_name
        self._driver = driver
        self._max_concurrent = max_concurrent
        self._limiter: anyio.CapacityLimiter | None = None
        self.patches = StatusPatches(
            claims,
            node_name,
            driver=driver,
            timeout=status_patch_timeout,
            delay=status_patch_delay,
            max_pending=max_pending_status_patches,
        )

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
        context = log_context(ref)
        async with self._slots():
            try:
                self._check_runtime()
                obj, allocation = await self._read(ref)
                # its opaque configs, checked
                overrides = claim_overrides(allocation, self._allocator)
                command = PrepareClaim(
                    claim_uid=ref.uid,
                    namespace=ref.namespace,
                    name=ref.name,
                    results=overrides.results,
                    pin_memory=overrides.pin_memory,
                    shared_pool=overrides.shared_pool,
                    pod_uids=allocation.pod_uids,
                    pod_names=allocation.pod_names,
                    pod_claim_name=allocation.pod_claim_name,
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
            await self.patches.record(ref, obj, allocation, result.cpus, deferred)
        cdi_id = device_id(ref.uid)
        metadata_ids = metadata_ids_by_device(ref.uid, [d.request for d in allocation.devices])
        return PrepareOutcome(
            devices=tuple(
                PreparedDevice(
                    request_names=(device.request,),
                    pool_name=device.pool,
                    device_name=device.device,
                    cdi_device_ids=(cdi_id,) if metadata_id is None else (cdi_id, metadata_id),
                    share_id=device.share_id,
                )
                for device, metadata_id in zip(allocation.devices, metadata_ids, strict=True)
            )
        )

    def _check_runtime(self) -> None:
        """Refuse a Prepare while the runtime cannot pin its containers (upstream 0.3
        ``prepareReady``): a container created then would run on every CPU. The kubelet retries
        a failed Prepare with backoff."""
        if self._runtime_not_ready is not None and (reason := self._runtime_not_ready()):
            raise DracpuError(
                "the container runtime's NRI connection is not synchronized; the kubelet will "
                f"retry ({reason})"
            )

    async def _read(self, ref: ClaimRef) -> tuple[dict[str, Any], ClaimAllocation]:
        """GET the claim and read our allocation out of it (ClaimError/KubeAPIError if not)."""
        try:
            obj = await self._claims.get_resource_claim(ref.namespace, ref.name)
        except KubeNotFoundError as exc:
            raise DracpuError(
                f"ResourceClaim {ref.namespace}/{ref.name} (UID {ref.uid}) not found"
            ) from exc
        except KubeAPIError as exc:  # it names the operation, the server and the cause
            raise DracpuError(str(exc)) from exc
        allocation = read_claim(obj, uid=ref.uid, pool=self._node_name, driver=self._driver)
        return obj, allocation

    # --- unprepare -------------------------------------------------------------------------

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """Unprepare every claim; an error string per distinct claim UID (``""``: done)."""
        return await _each_claim(refs, self._unprepare_measured)

    async def _unprepare_measured(self, ref: ClaimRef) -> str:
        started = time.monotonic()
        error = await self._unprepare_one(ref)
        if self._metrics is not None:
            self._metrics.unprepared(ref.uid, not error, time.monotonic() - started)
        return error

    async def _unprepare_one(self, ref: ClaimRef) -> str:
        context = log_context(ref)
        self.patches.drop(ref.uid)  # its cpuset is about to be freed: do not record it now
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

_CLAIM_FIELDS = ("namespace", "uid", "name")


def _claim_refs(method: str, claims: Sequence[object]) -> list[ClaimRef]:
    """The claims of a request. betterproto2 keeps a field sent with another wire type as a
    value of another Python type (``claims=[1]``, ``uid=None``): such a claim is the kubelet's
    error, ``INVALID_ARGUMENT``."""
    refs = []
    for index, claim in enumerate(claims):
        values = [getattr(claim, name, None) for name in _CLAIM_FIELDS]
        texts = [value for value in values if isinstance(value, str)]
        if len(texts) != len(_CLAIM_FIELDS):
            message = f"claims[{index}] is not a well-formed Claim: {repr(claim)[:200]}"
            logger.warning("refusing a %s call: %s", method, message)
            raise GRPCError(Status.INVALID_ARGUMENT, message)
        refs.append(ClaimRef(*texts))
    return refs


class _DraPlugin:
    """One version of ``DRAPlugin`` over :class:`DraService`: the generated service's rpc methods
    (paths, message types) served by stream handlers of ours. Prepare needs the stream: it sends
    the answer's message and trailers itself, then starts the status patches."""

    api: ClassVar[ModuleType]  # the generated module: dracpu._gen.dra.v1 or .v1beta1
    share_ids: ClassVar[bool]  # the version's Device has share_id (field 5)

    def __init__(self, service: DraService) -> None:
        self._service = service

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        generated: dict[str, grpclib.const.Handler] = self.api.DraPluginBase.__mapping__(self)
        return with_stream_handlers(
            generated,
            {
                "NodePrepareResources": self._node_prepare_resources,
                "NodeUnprepareResources": self._node_unprepare_resources,
            },
        )

    async def _node_prepare_resources(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        """Prepare, answer (message and trailers are with the transport once
        ``send_trailing_metadata`` returns), THEN start the status patches."""
        request = await receive_request(stream)
        refs = _claim_refs("NodePrepareResources", request.claims)
        with self._service.patches.deferred() as deferred:
            outcomes = await self._service.prepare(refs, deferred=deferred)
            await stream.send_message(self._prepare_response(outcomes))
            await stream.send_trailing_metadata()

    async def _node_unprepare_resources(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        request = await receive_request(stream)
        errors = await self._service.unprepare(
            _claim_refs("NodeUnprepareResources", request.claims)
        )
        api = self.api
        response: betterproto2.Message = api.NodeUnprepareResourcesResponse(
            claims={
                uid: api.NodeUnprepareResourceResponse(error=error) for uid, error in errors.items()
            }
        )
        await stream.send_message(response)

    def _prepare_response(self, outcomes: Mapping[str, PrepareOutcome]) -> betterproto2.Message:
        api = self.api

        def device(prepared: PreparedDevice) -> Any:
            share = {"share_id": prepared.share_id} if self.share_ids else {}
            return api.Device(
                request_names=list(prepared.request_names),
                pool_name=prepared.pool_name,
                device_name=prepared.device_name,
                cdi_device_ids=list(prepared.cdi_device_ids),
                **share,
            )

        response: betterproto2.Message = api.NodePrepareResourcesResponse(
            claims={
                uid: api.NodePrepareResourceResponse(
                    devices=[device(d) for d in outcome.devices], error=outcome.error
                )
                for uid, outcome in outcomes.items()
            }
        )
        return response


class DraPluginV1(_DraPlugin, dra_v1.DraPluginBase):
    """``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` over :class:`DraService`."""

    api: ClassVar[ModuleType] = dra_v1
    share_ids = True


class DraPluginV1beta1(_DraPlugin, dra_v1beta1.DraPluginBase):
    """``k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`` over :class:`DraService` (no
    ``share_id``: the v1beta1 Device has no field 5)."""

    api: ClassVar[ModuleType] = dra_v1beta1
    share_ids = False


# --- the task -----------------------------------------------------------------------------------


async def run(
    socket_path: Path,
    owner: MemoryObjectSendStream[Request[Command]],
    claims: ClaimSource,
    node_name: str,
    *,
    health: DeviceHealthBoard,
    driver: str = DRIVER_NAME,
    max_pending_status_patches: int = MAX_PENDING_STATUS_PATCHES,
    status_patch_delay: float = STATUS_PATCH_DELAY,
    metrics: DraCpuMetrics | None = None,
    allocator: str | None = None,
    runtime_not_ready: Callable[[], str] | None = None,
    task_status: TaskStatus[DraService] = TASK_STATUS_IGNORED,
) -> None:
    """Serve the DRA socket at ``socket_path`` (DRAPlugin v1 and v1beta1, DRAResourceHealth v1
    and v1alpha1) until cancelled.

    ``owner``: this task's own clone of the state owner's command stream (closed on exit).
    ``claims``: where ResourceClaims are read and their status patched. ``node_name``: our pool.
    ``health``: the devices' health the health streams send.
    Ready (``task_status.started(service)``) once the socket is listening.

    Resource handling: the socket file is removed on exit; the health streams end with status
    OK first, the other calls in flight are cancelled (the kubelet retries them; a command the
    owner already received still completes), and so are the status patches still pending (best
    effort).
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
            allocator=allocator,
            runtime_not_ready=runtime_not_ready,
        )
        streams = HealthStreams(health, node_name)
        plugins: list[Servable] = [
            DraPluginV1(service),
            DraPluginV1beta1(service),
            ResourceHealthV1(streams),
            ResourceHealthV1alpha1(streams),
        ]
        # The patches' task group inside the server: when it ends, later answers patch nothing.
        # The health streams end (status OK) before the server cancels what is left.
        async with (
            open_grpc_server(plugins, socket_path, private_dir=True),
            streams.ending(),
            service.patches.running(),
        ):
            logger.info(
                "DRA socket %s is listening (v1, v1beta1; health v1, v1alpha1)", socket_path
            )
            task_status.started(service)
            await anyio.sleep_forever()
