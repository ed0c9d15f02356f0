"""The pod-resources sync: asks the kubelet which of our claims its pods still hold, and releases
the orphans (``docs/architecture.md``, "PodResources reconciliation").

The task lists (:mod:`dracpu.adapters.pod_resources`, the kubelet's PodResources ``List``) at
start (after NRI, so the first listing comes after the runtime's ``Synchronize``), every
``interval`` seconds (``--podresources-interval``; 0: no periodic listing), and whenever
:meth:`ListTrigger.request` asks (SIGHUP). Each answer becomes a
:class:`~dracpu.core.commands.PodsListed` for the state owner, carrying the time the List was
asked (monotonic seconds) and ``--orphan-grace``; the owner marks the claims the listing misses
and releases the orphans as Unprepare would (CDI spec deleted, CPUs back to the shared pool,
shared containers widened). Each released claim is logged as a warning naming it and counted.

Failures wait, never end the task: a socket that is missing or refuses, an error the kubelet
answers (an older kubelet, ``RESOURCE_EXHAUSTED`` from its rate limit: 100 requests per second
and bursts of 10 for all its clients together), a malformed answer. The next try comes after a
capped exponential backoff (a SIGHUP ends the wait early, except after ``RESOURCE_EXHAUSTED``),
each change of failure is logged once (:class:`~dracpu.adapters.backoff.RetryLog`), and
:class:`PodResourcesStatus` tells ``/metrics`` whether the sync works; the daemon stays ready.
What an answer that shows no DRA claim at all means follows the kubelet's version, read from
its Node at the first such answer and again after a failed List: from 1.34 its
``KubeletPodResourcesDynamicResources`` gate is on by default and the answer is taken at its
word; before, only a claim whose recorded pods are all missing from it can be judged.
Two Lists are at least :data:`~dracpu.config.values.MIN_PODRESOURCES_INTERVAL` apart, whatever
asks for them.

:func:`run` needs only anyio (its tests run on asyncio and trio); the lister it is given is the
grpclib client, which needs asyncio.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import anyio
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from dracpu.adapters.backoff import Pause, RetryLog, backoff_delays
from dracpu.adapters.pod_resources import PodResourcesListing, claims_shown_by_default
from dracpu.config.values import MIN_PODRESOURCES_INTERVAL
from dracpu.core.commands import Command, PodsListed
from dracpu.core.effects import PodsReconciled
from dracpu.errors import DracpuError, PodResourcesError
from dracpu.tasks.state_owner import Request, request

__all__ = [
    "RATE_LIMITED",
    "RETRY_CAP",
    "RETRY_INITIAL",
    "ListTrigger",
    "Lister",
    "PodResourcesStatus",
    "retry_delays",
    "run",
]

logger = logging.getLogger(__name__)

# The gRPC status of the kubelet's rate limiter (pkg/kubelet/apis/podresources/grpc/ratelimit.go:
# "rejected by rate limit").
RATE_LIMITED = "RESOURCE_EXHAUSTED"
# Retry backoff: a kubelet restart takes seconds, so the first retries are quick; the cap keeps
# a node whose kubelet has no PodResources socket (or rate-limits us) from being asked often.
RETRY_INITIAL = 1.0
RETRY_CAP = 30.0

Lister = Callable[[], Awaitable[PodResourcesListing]]
"""Asks the kubelet for one ``List`` (:meth:`PodResourcesClient.list
<dracpu.adapters.pod_resources.PodResourcesClient.list>`; tests pass their own)."""

VersionReader = Callable[[], Awaitable[str]]
"""Reads the kubelet's version (the Node's ``status.nodeInfo.kubeletVersion``); raises a
:class:`~dracpu.errors.DracpuError` when it cannot be had."""

# How long one read of the kubelet's version may take (seconds): it never holds up a listing
# for long (without it, an answer without claims is not taken at its word).
VERSION_READ_TIMEOUT = 5.0


def retry_delays() -> Iterator[float]:
    """The delays between failed Lists (restarted after one that works)."""
    return backoff_delays(initial=RETRY_INITIAL, cap=RETRY_CAP)


@dataclass(slots=True)
class PodResourcesStatus:
    """What ``/metrics`` shows of the sync (the task updates it; read at scrape time)."""

    answered: bool = False
    """The last List was answered and reconciled."""
    reports_claims: bool = False
    """The last answer could show DRA claims (it held at least one claim reference)."""
    kubelet_version: str = ""
    """The kubelet's version as last read (``""``: not read, or it could not be)."""
    authoritative: bool = False
    """That version has the kubelet's ``KubeletPodResourcesDynamicResources`` gate on by
    default: an answer without any claim means no pod holds one."""
    shows: str = ""
    """What the answers could show, as last said in the log (one line per change)."""
    lists: Counter[str] = field(default_factory=Counter)
    """Lists by outcome: ``ok``, ``no_claims`` (answered, no claim reference at all),
    ``rate_limited``, ``error``."""
    released: int = 0
    """Claims released as orphans since the start."""
    waiting: int = 0
    """Claims the last listing missed that are kept for now (their grace runs)."""
    last_error: str = ""
    """Why the last List failed (``""`` once one works)."""
    listing: PodResourcesListing | None = None
    """The last answer read: our claims and the containers (pod namespace and name, container
    name; PodResources gives no pod UID) that reference each."""

    @property
    def working(self) -> bool:
        """The sync works: the kubelet answers, and its answers show claims or its version says
        an answer without any means no pod holds one."""
        return self.answered and (self.reports_claims or self.authoritative)


class ListTrigger:
    """Asks the task for a List now (SIGHUP): a request that comes while a List runs is kept for
    after it, and several become one."""

    def __init__(self) -> None:
        self._pending = False
        self._pause = Pause()

    def request(self) -> None:
        """Ask for a List (from any task of the event loop; never blocks)."""
        self._pending = True
        self._pause.wake()

    def begin(self) -> None:
        """A List begins: it answers every request made so far."""
        self._pending = False

    async def wait(self, seconds: float) -> bool:
        """Until a request (at once if one is pending) or ``seconds`` have passed; whether a
        request ended it. The request is taken."""
        requested = self._pending or await self._pause.sleep(seconds)
        self._pending = False
        return requested


async def run(
    owner: MemoryObjectSendStream[Request[Command]],
    lister: Lister,
    *,
    interval: float,
    grace: float,
    trigger: ListTrigger | None = None,
    status: PodResourcesStatus | None = None,
    kubelet_version: VersionReader | None = None,
    clock: Callable[[], float] = time.monotonic,
    delays: Callable[[], Iterator[float]] = retry_delays,
    task_status: TaskStatus[None] = TASK_STATUS_IGNORED,
) -> None:
    """List and reconcile until cancelled (see the module docstring).

    ``owner``: this task's own clone of the state owner's command stream (closed on exit);
    ``interval``, ``grace``: seconds (``interval`` 0: list only at start and on request);
    ``kubelet_version``: reads the kubelet's version (``None``: never known, an answer without
    claims is never taken at its word); ``clock``: the monotonic clock whose time each listing
    carries; ``delays`` makes the retry backoff. Reports started at once: the first List runs
    after.
    """
    trigger = ListTrigger() if trigger is None else trigger
    status = PodResourcesStatus() if status is None else status
    retry = RetryLog(logger, "PodResources List")
    version = _KubeletVersion(kubelet_version, status)
    backoff: Iterator[float] | None = None
    period = interval if interval > 0 else math.inf
    async with owner:
        task_status.started()
        while True:
            began = anyio.current_time()
            trigger.begin()
            at = clock()
            try:
                listing = await lister()
            except PodResourcesError as error:
                version.stale = True  # the kubelet may restart as another version
                backoff = delays() if backoff is None else backoff
                wait = next(backoff)
                limited = error.code == RATE_LIMITED
                status.answered = False
                status.last_error = str(error)
                status.lists["rate_limited" if limited else "error"] += 1
                retry.failed(error, retry_in=wait)
                if limited:  # a SIGHUP must not add to what the kubelet refuses
                    await anyio.sleep(wait)
                else:
                    await trigger.wait(wait)
            else:
                backoff = None
                retry.recovered()
                if not listing.reports_claims:
                    await version.refresh()
                await _reconcile(owner, listing, at, grace, status)
                await trigger.wait(period)
            rest = began + MIN_PODRESOURCES_INTERVAL - anyio.current_time()
            if rest > 0:
                await anyio.sleep(rest)


class _KubeletVersion:
    """The kubelet's version, read when an answer without claims needs it and not read again
    until a List fails (a kubelet restart, maybe as another version) or a read failed."""

    def __init__(self, reader: VersionReader | None, status: PodResourcesStatus) -> None:
        self._reader = reader
        self._status = status
        self._failure = ""  # the last read's failure, said once
        self.stale = True

    async def refresh(self) -> None:
        if not self.stale or self._reader is None:
            return
        status = self._status
        try:
            with anyio.fail_after(VERSION_READ_TIMEOUT):
                found = await self._reader()
        except (DracpuError, TimeoutError) as error:
            status.kubelet_version, status.authoritative = "", False
            reason = str(error) or f"no answer within {VERSION_READ_TIMEOUT:g} s"
            if reason != self._failure:
                logger.warning(
                    "PodResources: cannot read the kubelet's version from the Node (tried again "
                    "at the next listing without claims): %s",
                    reason,
                )
            self._failure = reason
            return
        if self._failure:
            logger.info("PodResources: the kubelet's version is read again: %s", found)
        self._failure = ""
        self.stale = False
        status.kubelet_version, status.authoritative = found, claims_shown_by_default(found)


async def _reconcile(
    owner: MemoryObjectSendStream[Request[Command]],
    listing: PodResourcesListing,
    at: float,
    grace: float,
    status: PodResourcesStatus,
) -> None:
    """Hand one listing to the owner; log and count what it released."""
    command = PodsListed(
        frozenset(listing.by_uid),
        frozenset(listing.by_name),
        reports_claims=listing.reports_claims,
        at=at,
        grace=grace,
        pods=listing.active,
        authoritative=status.authoritative,
    )
    shows = "claims" if listing.reports_claims else f"none, {status.kubelet_version or '?'}"
    if shows != status.shows:
        status.shows = shows
        _say_what_the_answer_shows(listing, grace, status)
    status.answered = True
    status.listing = listing
    status.reports_claims = listing.reports_claims
    status.last_error = ""
    status.lists["ok" if listing.reports_claims else "no_claims"] += 1
    try:
        result = await request(owner, command)
    except DracpuError as error:  # the owner logged it (a failed CDI delete or checkpoint)
        logger.debug("PodResources: the listing was not applied: %s", error)
        return
    if not isinstance(result, PodsReconciled):
        raise DracpuError(f"PodsListed answered {result!r}")  # a bug of the owner
    status.waiting = len(result.waiting)
    for claim in result.released:
        status.released += 1
        name = f"{claim.namespace}/{claim.name}" if claim.name else "name unknown"
        if claim.adopted and claim.missing_since == at:
            why = (
                "known only from its CDI spec: one listing after the runtime's Synchronize is "
                "enough"
            )
        elif claim.by_pods:
            why = (
                "the pods it is reserved for are missing from the listings since "
                f"{at - claim.missing_since:.0f} s"
            )
        else:
            why = f"missing from the listings for {at - claim.missing_since:.0f} s"
        logger.warning(
            "released orphan claim %s (%s, cpus %s): no pod on the node references it in the "
            "kubelet's PodResources and no running container uses it (%s); its CDI spec is "
            "deleted and its CPUs are back in the shared pool",
            claim.claim_uid,
            name,
            claim.cpus,
            why,
            extra={"claim_uid": claim.claim_uid},
        )
    if result.waiting:
        logger.debug(
            "PodResources: %d prepared claims missing from the listing, kept for now: %s",
            len(result.waiting),
            list(result.waiting),
        )


def _say_what_the_answer_shows(
    listing: PodResourcesListing, grace: float, status: PodResourcesStatus
) -> None:
    """One INFO line when what the answers can show changes (and at the first answer)."""
    if listing.reports_claims:
        logger.info(
            "PodResources: the kubelet lists %d pods with %d claim references; orphan claims "
            "are released after %g s",
            listing.pods,
            listing.dynamic_resources,
            grace,
        )
    elif status.authoritative:
        logger.info(
            "PodResources: the kubelet's answer shows no DRA claim (%d pods); kubelet %s has "
            "its KubeletPodResourcesDynamicResources gate on by default, so no pod holds one: "
            "orphan claims are released after %g s",
            listing.pods,
            status.kubelet_version,
            grace,
        )
    else:
        logger.info(
            "PodResources: the kubelet's answer shows no DRA claim at all (%d pods): either no "
            "pod holds one or its KubeletPodResourcesDynamicResources gate is off (kubelet "
            "version %s); until an answer shows claims, only claims whose pods are all gone "
            "from the listing are released, after %g s",
            listing.pods,
            status.kubelet_version or "unknown",
            grace,
        )
