"""One fresh look at the pods a claim is reserved for, before the NRI task refuses a container.

A prepared claim records the pods its ``status.reservedFor`` named at Prepare
(:attr:`~dracpu.core.checkpoint_schema.PreparedClaim.pod_uids`); only their containers may use
its CPUs (:mod:`dracpu.core.state_containers`). The record can be behind the API server: a claim
shared by several pods gains consumers after it was prepared, and the kubelet does not prepare
a prepared claim again for the next pod. So when the state owner refuses a container (at
``CreateContainer`` or ``UpdateContainer``) or confines it (at ``Synchronize``) and the reason
is a claim not reserved for the container's pod (:func:`~dracpu.core.state_containers.
unreserved_claims` over the committed state), the NRI task reads those claims once more
through the Kubernetes API (the same GET Prepare does), sends the owner what their
``status.reservedFor`` says now (:class:`~dracpu.core.commands.UpdateClaimPods`, which the owner
checkpoints), and asks for the decision once more. A container whose claim does name its pod is
never delayed: the look happens only after a refusal. A pod the look finds not reserved for the
claim is noted on the claim as a copier (in the same command): a pod's claims cannot change, so
its containers are refused from then on without another look (and, at ``Synchronize``, without
another warning), across restarts.

The runtime drops a plugin that does not answer an event within its request timeout (2 s by
default, nri ``pkg/api/timeouts.go``), and creates the container unpinned. The look is bounded
at :data:`LOOK_TIMEOUT` and never runs past the handler's deadline less :data:`RETRY_RESERVE`
(the owner's second decision); a look that fails or does not finish leaves the refusal standing,
with the reason added to its message. The claims of one event are read concurrently.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.core.claims import reserved_pods
from dracpu.core.commands import Command, Container, UpdateClaimPods
from dracpu.core.state_containers import unreserved_claims
from dracpu.errors import ClaimError, DracpuError, KubeAPIError, KubeNotFoundError
from dracpu.tasks.nri_link import CommittedState
from dracpu.tasks.state_owner import Request, request

__all__ = ["LOOK_TIMEOUT", "RETRY_RESERVE", "ClaimReader", "ClaimRecheck", "Recheck"]

logger = logging.getLogger(__name__)

# The longest one look at the claims may take: half the runtime's default request timeout, so
# the two decisions and the answer fit in what is left.
LOOK_TIMEOUT = 1.0
# Kept free after the look, before the handler's deadline: the owner's update (a checkpoint
# write) and its second decision.
RETRY_RESERVE = 0.2


class ClaimReader(Protocol):
    """Where ResourceClaims are read (:class:`dracpu.adapters.kube.KubeClient` is one)."""

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class Recheck:
    """What a look found. ``changed``: the owner now holds other pods for a claim (decide
    again); ``problems``: why a claim could not be read, for the refusal's message."""

    changed: bool = False
    problems: tuple[str, ...] = field(default=())

    def explain(self, message: str) -> str:
        """``message`` with the look's problems appended."""
        if not self.problems:
            return message
        return f"{message}; a fresh look at the claim failed: {'; '.join(self.problems)}"


def _label(claim: PreparedClaim) -> str:
    return f"claim {claim.namespace}/{claim.name} ({claim.claim_uid})"


class ClaimRecheck:
    """The NRI task's fresh look (see the module docstring).

    ``owner``: the NRI task's command stream; ``committed`` reads the owner's committed state;
    ``claims``: the Kubernetes API (``None``: no look, the refusal stands).
    """

    def __init__(
        self,
        owner: MemoryObjectSendStream[Request[Command]],
        committed: CommittedState,
        claims: ClaimReader | None,
        *,
        timeout: float = LOOK_TIMEOUT,
    ) -> None:
        self._owner = owner
        self._committed = committed
        self._claims = claims
        self._timeout = timeout

    def _suspects(
        self, containers: Iterable[Container]
    ) -> dict[str, tuple[PreparedClaim, set[str]]]:
        """The claims to read, each with the pods of the containers that showed it."""
        state = self._committed()
        found: dict[str, tuple[PreparedClaim, set[str]]] = {}
        for container in containers:
            for claim in unreserved_claims(state, container):
                if claim.name:
                    found.setdefault(claim.claim_uid, (claim, set()))[1].add(container.pod_uid)
        return found

    async def recheck(self, containers: Iterable[Container], deadline: float) -> Recheck:
        """Read the claims that keep these containers out, tell the owner their pods; by
        ``deadline`` (``anyio.current_time()`` based) less :data:`RETRY_RESERVE` at the latest."""
        suspects = self._suspects(containers)
        if not suspects or self._claims is None:
            return Recheck()
        budget = min(self._timeout, deadline - RETRY_RESERVE - anyio.current_time())
        if budget <= 0:
            return Recheck(problems=("no time left before the runtime's deadline",))
        found: dict[str, dict[str, str] | str] = {}
        with anyio.move_on_after(budget):
            async with anyio.create_task_group() as tg:
                for claim, _ in suspects.values():
                    tg.start_soon(self._look, claim, found)
        problems: list[str] = []
        changed = False
        for claim, showing in suspects.values():
            reserved = found.get(claim.claim_uid, f"no answer within {budget:.2f} s")
            if isinstance(reserved, str):
                problems.append(f"{_label(claim)}: {reserved}")
                continue
            if not reserved:  # its pods are gone: known pods are never emptied (Unprepare comes)
                problems.append(f"{_label(claim)}: its status.reservedFor names no pod now")
                continue
            pods = frozenset(reserved)
            names = frozenset(name for name in reserved.values() if name)
            copiers = frozenset(showing) - pods
            if (pods, names) == (claim.pod_uids, claim.pod_names) and copiers <= claim.copiers:
                continue
            update = UpdateClaimPods(claim.claim_uid, pods, names, copiers)
            try:
                with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                    await request(self._owner, update)
            except (DracpuError, TimeoutError) as exc:
                why = str(exc) or "the state owner did not answer in time"
                problems.append(f"{_label(claim)}: cannot record its pods: {why}")
                continue
            if pods != claim.pod_uids:
                logger.info(
                    "%s is reserved for %d pod(s) now (it was %d)",
                    _label(claim),
                    len(pods),
                    len(claim.pod_uids),
                    extra={"claim": claim.claim_uid},
                )
                changed = True
        return Recheck(changed, tuple(problems))

    async def _look(self, claim: PreparedClaim, found: dict[str, dict[str, str] | str]) -> None:
        assert self._claims is not None
        try:
            obj = await self._claims.get_resource_claim(claim.namespace, claim.name)
        except KubeNotFoundError:
            found[claim.claim_uid] = "it is gone from the API server"
            return
        except KubeAPIError as exc:
            found[claim.claim_uid] = str(exc)
            return
        metadata = obj.get("metadata")
        uid = metadata.get("uid") if isinstance(metadata, dict) else None
        if uid != claim.claim_uid:
            found[claim.claim_uid] = f"it was replaced (the API server has UID {uid!r})"
            return
        try:
            found[claim.claim_uid] = reserved_pods(obj)
        except ClaimError as exc:
            found[claim.claim_uid] = str(exc)
