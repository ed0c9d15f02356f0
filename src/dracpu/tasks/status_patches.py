"""The prepared claims' cpusets in their ``status.devices[].data``: best-effort PATCHes that run
after the kubelet has its answer.

:class:`StatusPatches` records, for a claim the DRA socket has prepared, ``data: {"cpuset":
...}`` in the claim's ``status.devices`` entries of our driver (a failure is logged; the claim
stays prepared). Inside :meth:`StatusPatches.running` the patches run in tasks of the caller's
task group (cancelled when it ends): the kubelet never waits for the API server's write.

- **After the answer.** A Prepare holds its claims' patches in a :class:`DeferredPatches`
  (:meth:`StatusPatches.deferred`) and leaves its block once the whole answer (message and
  trailers) is with the transport: only then do the patches start, and each waits
  :data:`STATUS_PATCH_DELAY` more, so building and sending the PATCH never competes with the
  answer nor with the kubelet taking it. The patches also start when the call ends without an
  answer (the kubelet went away, the deadline passed): the claims ARE prepared, so recording
  their cpusets is still right.
- **One per claim, in order.** A new Prepare of the claim cancels its pending patch (started or
  still held) and starts its own once that one has ended; an Unprepare cancels it
  (:meth:`StatusPatches.drop`: the claim no longer holds those CPUs here). The patch carries
  the claim's ``resourceVersion``, so a write the API server still applies late can never
  overwrite a newer one; on a 409 the claim is read again and the patch retried once.
- **Bounded.** Beyond :data:`MAX_PENDING_STATUS_PATCHES` pending patches (a slow API server) a
  Prepare records its claim's status before answering; outside :meth:`StatusPatches.running`
  every patch is recorded at once; after it has ended none is.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup

from dracpu import DRIVER_NAME
from dracpu.core.claims import ClaimAllocation, device_status_patch, read_claim
from dracpu.core.cpuset import CpuSet
from dracpu.errors import DracpuError, KubeConflictError

__all__ = [
    "MAX_PENDING_STATUS_PATCHES",
    "STATUS_PATCH_DELAY",
    "STATUS_PATCH_TIMEOUT",
    "ClaimRef",
    "ClaimSource",
    "DeferredPatches",
    "StatusPatches",
    "log_context",
]

logger = logging.getLogger(__name__)

# Longest one best-effort status patch may take (seconds), a retry after a 409 included. It
# also bounds how long a Prepare answered inline (too many pending patches) waits for it: the
# kubelet gives the whole call 45 s (dra_plugin.go defaultClientCallTimeout).
STATUS_PATCH_TIMEOUT = 5.0
# Status patches pending after their Prepare was answered, at most; beyond, a Prepare waits for
# its patch before answering (back pressure instead of an unbounded backlog). Far above what a
# healthy API server leaves pending: the kubelet prepares one pod's claims per call, and the
# DRA socket handles a bounded number of claims at once.
MAX_PENDING_STATUS_PATCHES = 64
# How long a background status patch waits after its call was answered (seconds). The kubelet
# is woken by our answer on a unix socket, a "sync" wakeup that tends to put it on the CPU we
# run on: work we start at once (the PATCH, with its JSON and HTTP) makes it wait for that CPU
# (bench/bench_prepare.py shows the difference; docs/performance.md). Short enough that the
# status is recorded long before the pod's containers are created.
STATUS_PATCH_DELAY = 0.001


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A ``Claim`` of a request: a ResourceClaim as the kubelet names it."""

    namespace: str
    uid: str
    name: str


def log_context(ref: ClaimRef) -> dict[str, str]:
    """The ``extra=`` of a log record about the claim."""
    return {"claim": f"{ref.namespace}/{ref.name}", "claim_uid": ref.uid}


class ClaimSource(Protocol):
    """Where ResourceClaims come from (:class:`dracpu.adapters.kube.KubeClient` is one).

    Errors are :class:`~dracpu.errors.KubeAPIError` subclasses (404: KubeNotFoundError)."""

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...

    async def patch_resource_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]: ...


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

    Made by :meth:`StatusPatches.deferred`; leaving its ``with`` block starts the held patches,
    however it is left (an answer that could not be sent included). A patch scheduled after
    that starts at once.
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


class StatusPatches:
    """The status patches of one DRA socket (see the module docstring)."""

    def __init__(
        self,
        claims: ClaimSource,
        node_name: str,
        *,
        driver: str = DRIVER_NAME,
        timeout: float = STATUS_PATCH_TIMEOUT,
        delay: float = STATUS_PATCH_DELAY,
        max_pending: int = MAX_PENDING_STATUS_PATCHES,
    ) -> None:
        self._claims = claims
        self._node_name = node_name
        self._driver = driver
        self._timeout = timeout
        self._delay = delay
        self._max_pending = max_pending
        self._background: TaskGroup | None = None  # runs the patches (inside running)
        self._stopped = False  # running has ended: no more patches
        self._pending: dict[str, _StatusPatch] = {}  # the latest patch by claim UID

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
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

    async def wait(self) -> None:
        """Wait until no status patch is pending (held, waiting or running)."""
        while self._pending:
            await next(iter(self._pending.values())).done.wait()

    def deferred(self) -> DeferredPatches:
        """A holder for one call's status patches, to start once its answer is out."""
        return DeferredPatches(self._start_patch)

    def drop(self, uid: str) -> None:
        """Cancel the claim's pending patch, if any (its CPUs are about to be freed)."""
        pending = self._pending.get(uid)
        if pending is not None:
            pending.scope.cancel()

    async def record(
        self,
        ref: ClaimRef,
        obj: Mapping[str, Any],
        allocation: ClaimAllocation,
        cpus: CpuSet,
        deferred: DeferredPatches | None,
    ) -> None:
        """Record the cpuset in the claim's status: in the background when a task group runs
        the patches and fewer than the limit are pending (held in ``deferred`` until the answer
        is out), else now."""
        if self._stopped:
            logger.debug(
                "not recording the cpuset of claim %s/%s: stopping",
                ref.namespace,
                ref.name,
                extra=log_context(ref),
            )
            return
        previous = self._pending.get(ref.uid)
        if previous is not None:
            previous.scope.cancel()  # this Prepare read the claim later: its patch wins
        if self._background is None or (
            previous is None and len(self._pending) >= self._max_pending
        ):
            await self._record_now(ref, obj, allocation, cpus)
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
                    await anyio.sleep(self._delay)  # the kubelet takes its answer
                    await self._record_now(ref, patch.obj, patch.allocation, patch.cpus)
                dropped = patch.scope.cancelled_caught
            if dropped:
                logger.debug(
                    "status patch of claim %s/%s dropped: the claim was unprepared or prepared "
                    "again",
                    ref.namespace,
                    ref.name,
                    extra=log_context(ref),
                )
        finally:
            self._finish(patch)

    async def _record_now(
        self, ref: ClaimRef, obj: Mapping[str, Any], allocation: ClaimAllocation, cpus: CpuSet
    ) -> None:
        """Best effort: write ``data: {"cpuset": ...}`` into the claim's ``status.devices``."""
        context = log_context(ref)
        with anyio.move_on_after(self._timeout) as scope:
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
                self._timeout,
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
