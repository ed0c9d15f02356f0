"""The DRA gRPC service the kubelet calls: ``NodePrepareResources`` / ``NodeUnprepareResources``.

Served on ``<kubelet-root>/plugins/dra.cpu/dra.sock`` in both versions the kubelet speaks
(reference kubelet-and-k8s-api.md §1): ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` and
``k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin``. Both go through one :class:`DraService`; the
versions differ only in v1's ``Device.share_id``.

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
   the claim stays prepared). This PATCH runs AFTER the answer, in a task of the kubelet-plugin
   task's own task group (cancelled when the task stops): the kubelet never waits for the API
   server's write. At most one patch per claim runs at a time, in order: a new Prepare of the
   claim cancels its pending patch and starts its own once that one has ended, and an Unprepare
   cancels it (the claim no longer holds those CPUs here); the patch carries the claim's
   ``resourceVersion``, so a write the API server still applies late can never overwrite a newer
   one. Beyond :data:`MAX_PENDING_STATUS_PATCHES` pending patches (a slow API server) a Prepare
   waits for its own patch before answering, as it did when patches were inline.

A claim that cannot be prepared gets its own ``error`` string; the other claims of the call are
still prepared, and the call itself never fails at the gRPC level for a claim's problem (the
kubelet then retries only what failed). Unprepare sends
:class:`~dracpu.core.commands.UnprepareClaim` per claim; the claim object is not read (it may
be gone) and an unknown claim succeeds.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from dracpu import DRIVER_NAME
from dracpu._gen.dra import v1 as dra_v1
from dracpu._gen.dra import v1beta1 as dra_v1beta1
from dracpu.adapters.grpc_server import Servable, open_unix_server
from dracpu.core.cdi_spec import device_id
from dracpu.core.claims import ClaimAllocation, device_status_patch, read_claim
from dracpu.core.commands import Command, PrepareClaim, UnprepareClaim
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import ClaimPrepared, ClaimUnprepared
from dracpu.errors import DracpuError, KubeAPIError, KubeConflictError, KubeNotFoundError
from dracpu.tasks import state_owner
from dracpu.tasks.state_owner import Request

__all__ = [
    "MAX_CONCURRENT_CLAIMS",
    "MAX_PENDING_STATUS_PATCHES",
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

T = TypeVar("T")


class ClaimSource(Protocol):
    """Where ResourceClaims come from (:class:`dracpu.adapters.kube.KubeClient` is one).

    Errors are :class:`~dracpu.errors.KubeAPIError` subclasses (404: KubeNotFoundError)."""

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...

    async def patch_resource_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    uid: str
    name: str

    def log_context(self) -> dict[str, str]:
        return {"claim": f"{self.namespace}/{self.name}", "claim_uid": self.uid}


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim, as the kubelet stores it."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class PrepareOutcome:
    """The answer for one claim: its devices, or a non-empty ``error``."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


@dataclass(eq=False, slots=True)
class _StatusPatch:
    """A claim's status patch running after the answer: ``scope`` cancels it, ``done`` is set
    once it has ended (whatever the outcome)."""

    scope: anyio.CancelScope
    done: anyio.Event


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


class _ClaimMessage(Protocol):
    """A ``Claim`` of either DRA version's request."""

    namespace: str
    uid: str
    name: str


def _refs(claims: Iterable[_ClaimMessage]) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.uid, c.name) for c in claims]


class DraService:
    """Prepare and Unprepare, independent of the gRPC version.

    Status patches run after the answers inside :meth:`status_patches` (at most
    ``max_pending_status_patches`` pending), before them outside it.
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
        max_pending_status_patches: int = MAX_PENDING_STATUS_PATCHES,
    ) -> None:
        self._owner = owner
        self._claims = claims
        self._node_name = node_name
        self._driver = driver
        self._max_concurrent = max_concurrent
        self._status_patch_timeout = status_patch_timeout
        self._limiter: anyio.CapacityLimiter | None = None
        self._background: TaskGroup | None = None  # runs the patches (inside status_patches)
        self._stopped = False  # status_patches has ended: no more patches
        self._max_pending = max_pending_status_patches
        self._pending: dict[str, _StatusPatch] = {}  # by claim UID

    @asynccontextmanager
    async def status_patches(self) -> AsyncIterator[None]:
        """While the block runs, status patches run after the answers, in a task group of the
        caller's task. When it ends they are cancelled, and a Prepare still answered afterwards
        (the server is stopping) records nothing."""
        async with anyio.create_task_group() as background:
            self._background = background
            try:
                yield
            finally:
                self._background = None
                self._stopped = True
                background.cancel_scope.cancel()

    async def wait_status_patches(self) -> None:
        """Wait until no status patch is pending (the patches run after the answers)."""
        while self._pending:
            await next(iter(self._pending.values())).done.wait()

    def _slots(self) -> anyio.CapacityLimiter:
        # Created on first use: an anyio primitive needs the running event loop.
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self._max_concurrent)
        return self._limiter

    # --- prepare ---------------------------------------------------------------------------

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PrepareOutcome]:
        """Prepare every claim; one outcome per distinct claim UID."""
        return await _each_claim(refs, self._prepare_one)

    async def _prepare_one(self, ref: ClaimRef) -> PrepareOutcome:
        context = ref.log_context()
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
            await self._status_patch(ref, obj, allocation, result.cpus)
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
        self, ref: ClaimRef, obj: Mapping[str, Any], allocation: ClaimAllocation, cpus: CpuSet
    ) -> None:
        """Record the cpuset in the claim's status: after the answer when a task group runs the
        patches and fewer than the limit are pending, else now (see the module docstring)."""
        if self._stopped:
            logger.debug(
                "not recording the cpuset of claim %s/%s: stopping",
                ref.namespace,
                ref.name,
                extra=ref.log_context(),
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
        patch = _StatusPatch(anyio.CancelScope(), anyio.Event())
        self._pending[ref.uid] = patch
        self._background.start_soon(
            self._patch_after_answer, ref, obj, allocation, cpus, previous, patch
        )

    async def _patch_after_answer(
        self,
        ref: ClaimRef,
        obj: Mapping[str, Any],
        allocation: ClaimAllocation,
        cpus: CpuSet,
        previous: _StatusPatch | None,
        patch: _StatusPatch,
    ) -> None:
        try:
            if previous is not None:
                await previous.done.wait()  # one patch of a claim at a time, in order
            with patch.scope:
                await self._record_status(ref, obj, allocation, cpus)
            if patch.scope.cancelled_caught:
                logger.debug(
                    "status patch of claim %s/%s dropped: the claim was unprepared or prepared "
                    "again",
                    ref.namespace,
                    ref.name,
                    extra=ref.log_context(),
                )
        finally:
            patch.done.set()
            if self._pending.get(ref.uid) is patch:
                del self._pending[ref.uid]

    async def _record_status(
        self, ref: ClaimRef, obj: Mapping[str, Any], allocation: ClaimAllocation, cpus: CpuSet
    ) -> None:
        """Best effort: write ``data: {"cpuset": ...}`` into the claim's ``status.devices``."""
        context = ref.log_context()
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
        return await _each_claim(refs, self._unprepare_one)

    async def _unprepare_one(self, ref: ClaimRef) -> str:
        context = ref.log_context()
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


class DraPluginV1(dra_v1.DraPluginBase):
    """``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` over :class:`DraService`."""

    def __init__(self, service: DraService) -> None:
        self._service = service

    async def node_prepare_resources(
        self, message: dra_v1.NodePrepareResourcesRequest
    ) -> dra_v1.NodePrepareResourcesResponse:
        outcomes = await self._service.prepare(_refs(message.claims))
        return dra_v1.NodePrepareResourcesResponse(
            claims={
                uid: dra_v1.NodePrepareResourceResponse(
                    devices=[
                        dra_v1.Device(
                            request_names=list(d.request_names),
                            pool_name=d.pool_name,
                            device_name=d.device_name,
                            cdi_device_ids=list(d.cdi_device_ids),
                            share_id=d.share_id,
                        )
                        for d in outcome.devices
                    ],
                    error=outcome.error,
                )
                for uid, outcome in outcomes.items()
            }
        )

    async def node_unprepare_resources(
        self, message: dra_v1.NodeUnprepareResourcesRequest
    ) -> dra_v1.NodeUnprepareResourcesResponse:
        errors = await self._service.unprepare(_refs(message.claims))
        return dra_v1.NodeUnprepareResourcesResponse(
            claims={
                uid: dra_v1.NodeUnprepareResourceResponse(error=error)
                for uid, error in errors.items()
            }
        )


class DraPluginV1beta1(dra_v1beta1.DraPluginBase):
    """``k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`` over :class:`DraService` (no
    ``share_id``: the v1beta1 Device has no field 5)."""

    def __init__(self, service: DraService) -> None:
        self._service = service

    async def node_prepare_resources(
        self, message: dra_v1beta1.NodePrepareResourcesRequest
    ) -> dra_v1beta1.NodePrepareResourcesResponse:
        outcomes = await self._service.prepare(_refs(message.claims))
        return dra_v1beta1.NodePrepareResourcesResponse(
            claims={
                uid: dra_v1beta1.NodePrepareResourceResponse(
                    devices=[
                        dra_v1beta1.Device(
                            request_names=list(d.request_names),
                            pool_name=d.pool_name,
                            device_name=d.device_name,
                            cdi_device_ids=list(d.cdi_device_ids),
                        )
                        for d in outcome.devices
                    ],
                    error=outcome.error,
                )
                for uid, outcome in outcomes.items()
            }
        )

    async def node_unprepare_resources(
        self, message: dra_v1beta1.NodeUnprepareResourcesRequest
    ) -> dra_v1beta1.NodeUnprepareResourcesResponse:
        errors = await self._service.unprepare(_refs(message.claims))
        return dra_v1beta1.NodeUnprepareResourcesResponse(
            claims={
                uid: dra_v1beta1.NodeUnprepareResourceResponse(error=error)
                for uid, error in errors.items()
            }
        )


# --- the task -----------------------------------------------------------------------------------


async def run(
    socket_path: Path,
    owner: MemoryObjectSendStream[Request[Command]],
    claims: ClaimSource,
    node_name: str,
    *,
    driver: str = DRIVER_NAME,
    max_pending_status_patches: int = MAX_PENDING_STATUS_PATCHES,
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
    before ``started``; a claim's problem is that claim's error string, never a task failure.
    """
    async with owner:
        service = DraService(
            owner,
            claims,
            node_name,
            driver=driver,
            max_pending_status_patches=max_pending_status_patches,
        )
        handlers: list[Servable] = [DraPluginV1(service), DraPluginV1beta1(service)]
        # The patches' task group inside the server: when it ends, later answers patch nothing.
        async with (
            open_unix_server(handlers, socket_path, private_dir=True),
            service.status_patches(),
        ):
            logger.info("DRA socket %s is listening (v1, v1beta1)", socket_path)
            task_status.started(service)
            await anyio.sleep_forever()
