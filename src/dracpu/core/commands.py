"""Commands: what the tasks ask the state owner to do.

Every command is a frozen, slotted value. :func:`dracpu.core.state.apply` turns ``(state,
command)`` into ``(new state, effects)``; exactly one of the effects is a
:class:`~dracpu.core.effects.Reply` carrying the result (or a ``DracpuError``) for the requester.

Who sends what:

- the kubelet plugin: :class:`PrepareClaim`, :class:`UnprepareClaim`;
- the NRI plugin: :class:`CreateContainer`, :class:`UpdateContainer`, :class:`StopContainer`,
  :class:`RemoveContainer`, :class:`Synchronize`, :class:`RuntimeDisconnected`,
  :class:`InvalidateContainers` (the runtime failed an unsolicited ``UpdateContainers``),
  :class:`UpdateClaimPods` (a fresh look at a claim's ``status.reservedFor``);
- the pod-resources sync: :class:`PodsListed`;
- the CDI watcher: :class:`RepairNodeFiles` (our files on disk differ from the claims);
- the state owner itself at start and on SIGHUP: :class:`AdoptClaims`, :class:`Resync`.

A container's ``DRA_CPUSET_<claimUID>=<cpuset>`` environment becomes :class:`ClaimEnv` values
through :meth:`Container.from_env` (parsing by :func:`dracpu.core.cdi_spec.parse_env`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from dracpu.core.allocator import AllocationPolicy, Strategy
from dracpu.core.cdi_spec import parse_env
from dracpu.core.cpuset import CpuSet
from dracpu.core.topology import Topology
from dracpu.errors import CdiError

__all__ = [
    "AdoptClaims",
    "AdoptedClaim",
    "ClaimEnv",
    "Command",
    "Container",
    "ContainerStarted",
    "CreateContainer",
    "DeviceResult",
    "InvalidateContainers",
    "PodsListed",
    "PrepareClaim",
    "RemoveContainer",
    "RepairNodeFiles",
    "Resync",
    "RuntimeDisconnected",
    "StopContainer",
    "Synchronize",
    "UnprepareClaim",
    "UpdateClaimPods",
    "UpdateContainer",
    "claims_from_env",
]

# --- claims ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceResult:
    """One allocation result of a claim for our driver (``status.allocation.devices.results``).

    ``consumed_cpus``: grouped devices: ``consumedCapacity["dra.cpu/cpu"]`` as a whole number (the
    adapter rejects fractions; the state machine rejects missing, zero and negative values);
    individual devices: ``None`` (or 1). ``cpuset``: an explicit cpuset, from the claim's
    opaque config ``cpuConfig.cpuset`` (upstream's, written by an external allocator or the
    user); it must lie in the device's group, be free and have exactly ``consumed_cpus`` CPUs.
    ``None``: dracpu picks the CPUs.

    ``request_cpuset`` (``allocator: external``): the opaque ``cpuConfig.cpuset`` of the whole
    request, whose results share it (upstream ``cpuallocator.External``): this result takes the
    lowest ``consumed_cpus`` of its CPUs still free on its device.

    ``strategy``, ``full_cores`` and ``request_cpuset``: the opaque config's
    ``cpuConfig.policy``, ``cpuConfig.fullCores`` and (external) ``cpuConfig.cpuset`` for this
    result; ``None`` keeps the node's default policy. They only steer the choice of CPUs: they
    take no part in equality, the sort key or the checkpoint, so a re-Prepare of a prepared
    claim is idempotent whatever they say (they come from the allocation, which cannot change
    anyway).
    """

    request: str
    pool: str
    device: str
    consumed_cpus: int | None = None
    cpuset: CpuSet | None = None
    strategy: Strategy | None = field(default=None, compare=False)
    full_cores: bool | None = field(default=None, compare=False)
    request_cpuset: CpuSet | None = field(default=None, compare=False)

    def policy(self, default: AllocationPolicy) -> AllocationPolicy:
        """``default`` with this result's overrides."""
        if self.strategy is None and self.full_cores is None:
            return default
        return replace(
            default,
            strategy=default.strategy if self.strategy is None else self.strategy,
            full_cores=default.full_cores if self.full_cores is None else self.full_cores,
        )

    def sort_key(self) -> tuple[str, str, str, int, str]:
        """A total order, so that the same results in another order compare equal."""
        return (
            self.request,
            self.pool,
            self.device,
            -1 if self.consumed_cpus is None else self.consumed_cpus,
            "" if self.cpuset is None else "+" + str(self.cpuset),
        )


@dataclass(frozen=True, slots=True)
class PrepareClaim:
    """``NodePrepareResources`` for one claim: pick its CPUs, write its CDI spec, checkpoint.

    All results of the claim are unioned into ONE cpuset (upstream: one CDI env var per claim).
    ``pin_memory`` overrides the node default for this claim (its opaque config's
    ``cpuConfig.memory``); ``None`` keeps the default. How each result's CPUs are chosen is in
    the result (:class:`DeviceResult`). ``pod_uids``: the pods its ``status.reservedFor`` names
    (only their containers may use its CPUs), ``pod_names`` their names; a Prepare of a prepared
    claim with other pods (a shared claim gains consumers) updates the record (known pods are
    never emptied).
    ``pod_claim_name``: the claim's ``resource.kubernetes.io/pod-claim-name`` annotation (where
    its device metadata appears in the container), ``None`` without one. ``shared_pool``: its
    containers run on its CPUs and on the shared pool (its opaque config's
    ``cpuConfig.sharedPool``).
    """

    claim_uid: str
    namespace: str
    name: str
    results: tuple[DeviceResult, ...]
    pin_memory: bool | None = None
    pod_uids: frozenset[str] = frozenset()
    pod_claim_name: str | None = None
    pod_names: frozenset[str] = frozenset()
    shared_pool: bool = False


@dataclass(frozen=True, slots=True)
class UnprepareClaim:
    """``NodeUnprepareResources`` for one claim: delete its CDI spec, free its CPUs, checkpoint.

    Unpreparing a claim this node does not hold succeeds (the kubelet retries blindly)."""

    claim_uid: str


@dataclass(frozen=True, slots=True)
class AdoptedClaim:
    """A claim found on disk (a CDI spec of ours) that the checkpoint does not know, and
    whether its spec names the shared pool."""

    claim_uid: str
    cpus: CpuSet
    shared_pool: bool = False


@dataclass(frozen=True, slots=True)
class AdoptClaims:
    """At start, before NRI ``Synchronize``: take over claims whose CDI spec exists but which the
    checkpoint lacks (an upgrade from the upstream driver, which keeps no checkpoint; a lost
    checkpoint). Claims that conflict with state are refused and reported; they are not deleted.
    """

    claims: tuple[AdoptedClaim, ...]


@dataclass(frozen=True, slots=True)
class UpdateClaimPods:
    """A fresh read of a prepared claim's ``status.reservedFor``: the pods it is reserved for
    now, and their names (the NRI task reads it when a container of another pod shows the
    claim's env, then decides again). ``copiers``: pods whose containers show the claim's env
    and that the read found not reserved for it, to note on the claim
    (``PreparedClaim.copiers``). Unknown claims are ignored; a change is checkpointed; known
    pods are replaced, never emptied."""

    claim_uid: str
    pod_uids: frozenset[str]
    pod_names: frozenset[str] = frozenset()
    copiers: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class PodsListed:
    """The kubelet's PodResources ``List``: which of our claims the node's active pods reference.

    ``claims_in_use``: the claim UIDs, read from our CDI device ids
    (``dra.k8s.io/cpu=claim-<uid>``) in the pods' ``dynamic_resources``. ``names_in_use``:
    ``(namespace, name)`` of claims of our driver listed without a CDI device id we can read: a
    prepared claim of that name is in use, and so is every claim we know no name of (adopted
    from its CDI spec). ``pods``: ``(namespace, name)`` of every active pod listed (the kubelet
    lists them whatever its gates). ``reports_claims``: the answer holds claim references (of
    any driver). ``authoritative``: the kubelet's version has its
    ``KubeletPodResourcesDynamicResources`` gate on by default, so an answer without any claim
    reference means that no pod holds one (without it, the gate off and no claim at all look
    the same).

    ``at``: when the listing was asked for, in monotonic seconds of the task's clock (the core
    reads no clock); ``grace``: ``--orphan-grace`` in seconds.

    A prepared claim is in use while a known container carries it in its env, the answer
    references it, or a pod it is reserved for (``PreparedClaim.pod_names``) is listed. Any
    other claim is missed by the listing when the listing can tell (``reports_claims`` or
    ``authoritative``), or when its pods are known by name (all of them absent); otherwise its
    earlier misses are forgotten. A claim is released once it has been missed by every
    listing since one taken at least ``grace`` earlier; a claim known only from its CDI spec
    (adopted, never prepared by the kubelet since) at the first listing that misses it and
    shows claims. Nothing is released while the runtime's containers are not known (no NRI
    ``Synchronize`` since the start or since the runtime went away). See
    ``docs/architecture.md``.
    """

    claims_in_use: frozenset[str]
    names_in_use: frozenset[tuple[str, str]] = frozenset()
    reports_claims: bool = True
    at: float = 0.0
    grace: float = 0.0
    pods: frozenset[tuple[str, str]] = frozenset()
    authoritative: bool = False


@dataclass(frozen=True, slots=True)
class Resync:
    """SIGHUP or start: rewrite every CDI spec, prune the CDI specs no claim owns, republish the
    slices.

    A SIGHUP also brings what it read again (``None``: unchanged): ``topology`` (sysfs),
    ``reserved``, ``pin_memory`` and ``host_cgroups`` (the config file). The node config is then
    built again (:mod:`dracpu.core.reconfigure`): CPUs that went offline or online, or changed
    isolation, change the devices and the shared pool. A claim keeps a CPU that went offline (its
    devices turn unhealthy). A ``reserved`` that would take a CPU a claim holds, or leave no CPU for
    the shared containers, is not applied (the reply says why); a topology that leaves no CPU for
    the shared containers refuses the whole command.
    """

    topology: Topology | None = None
    reserved: CpuSet | None = None
    pin_memory: bool | None = None
    host_cgroups: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class RepairNodeFiles:
    """The files of these claims (their CDI spec, their device metadata) differ from what the
    claims need: put them right, as the state holds the claims when the command is applied (a
    prepared claim's files written, a claim not prepared here has its files removed).
    ``claim_uids=None``: every claim's files, and everything of ours no claim owns removed."""

    claim_uids: frozenset[str] | None = None


# --- containers -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClaimEnv:
    """One ``DRA_CPUSET_<claimUID>=<cpuset>`` of a container's environment."""

    claim_uid: str
    cpus: CpuSet


def claims_from_env(env: Sequence[str]) -> tuple[ClaimEnv, ...]:
    """The claims a container's environment (``KEY=VALUE`` strings) names, in env order.

    Parsing is :func:`dracpu.core.cdi_spec.parse_env` (the owner of the env format); a malformed
    ``DRA_CPUSET_*`` entry raises :class:`~dracpu.errors.CdiError`: the caller fails closed.
    """
    return tuple(ClaimEnv(uid, cpus) for uid, cpus in parse_env(env).items())


@dataclass(frozen=True, slots=True)
class Container:
    """A container as the runtime describes it (NRI ``Container`` + its ``PodSandbox``).

    ``claims``: what its ``DRA_CPUSET_*`` env says (not trusted: checked against state).
    ``env_error``: the env could not be parsed; the container is refused (fail closed) at
    creation and confined to the shared pool at ``Synchronize``.
    """

    id: str
    pod_uid: str
    pod_namespace: str = ""
    pod_name: str = ""
    name: str = ""
    claims: tuple[ClaimEnv, ...] = ()
    env_error: str | None = None

    @classmethod
    def from_env(
        cls,
        id: str,
        pod_uid: str,
        env: Sequence[str],
        *,
        pod_namespace: str = "",
        pod_name: str = "",
        name: str = "",
    ) -> Container:
        """Build from the runtime's env list; a malformed env becomes ``env_error``."""
        try:
            claims = claims_from_env(env)
        except CdiError as exc:
            return cls(id, pod_uid, pod_namespace, pod_name, name, (), str(exc))
        return cls(id, pod_uid, pod_namespace, pod_name, name, claims)

    @property
    def exclusive(self) -> bool:
        """It names claims: it gets their CPUs, not the shared pool."""
        return bool(self.claims)

    def describe(self) -> str:
        """``container <name> (<id>) of pod <ns>/<name>``, for error messages."""
        pod = f"{self.pod_namespace}/{self.pod_name}" if self.pod_name else self.pod_uid
        return f"container {self.name or '?'} ({self.id}) of pod {pod}"


@dataclass(frozen=True, slots=True)
class CreateContainer:
    """NRI ``CreateContainer``: answer with the container's cpuset (+ mems) and the updates of
    the shared containers (``ContainerPinned``), or an error that fails the creation."""

    container: Container


@dataclass(frozen=True, slots=True)
class UpdateContainer:
    """NRI ``UpdateContainer`` (e.g. an in-place resize): same answer as :class:`CreateContainer`;
    the NRI side sends the container's own cpuset as an update instead of an adjustment."""

    container: Container


@dataclass(frozen=True, slots=True)
class StopContainer:
    """NRI ``StopContainer``: forget the container (its claims stay prepared until Unprepare);
    the reply may carry updates that widen shared containers (the response can carry them)."""

    container_id: str


@dataclass(frozen=True, slots=True)
class ContainerStarted:
    """NRI ``PostStartContainer`` (a state change without a reply payload): the container runs.
    A pin decided for it after its ``CreateContainer`` reply is sent again: the runtime may
    have lost it while the container was starting (containerd applies an update of a container
    that is not running yet to its spec only, which runc has already read)."""

    container_id: str


@dataclass(frozen=True, slots=True)
class RemoveContainer:
    """NRI ``RemoveContainer`` (a state change without a reply payload): forget the container."""

    container_id: str


@dataclass(frozen=True, slots=True)
class Synchronize:
    """NRI ``Synchronize`` after (re)connecting: the runtime's full container list replaces what
    we knew; every container is re-pinned in the reply.

    ``unsolicited_updates``: the runtime's NRI handles plugin-initiated ``UpdateContainers``
    without deadlocking (NRI >= v0.12.1, containerd/nri#301): then Unprepare widens the shared
    containers at once instead of at the next container event.
    """

    containers: tuple[Container, ...]
    unsolicited_updates: bool = False


@dataclass(frozen=True, slots=True)
class RuntimeDisconnected:
    """The NRI connection is gone: no unsolicited updates until the next :class:`Synchronize`."""


@dataclass(frozen=True, slots=True)
class InvalidateContainers:
    """The runtime failed an ``UpdateContainers`` of these ``(container id, seq)`` pins: each
    such container's cpuset is unknown, unless the owner decided a newer pin for it meanwhile
    (a higher seq, sent on its own way), so the next reply that can carry updates sends it
    again."""

    failed: tuple[tuple[str, int], ...]


Command = (
    PrepareClaim
    | UnprepareClaim
    | UpdateClaimPods
    | AdoptClaims
    | PodsListed
    | Resync
    | RepairNodeFiles
    | CreateContainer
    | UpdateContainer
    | StopContainer
    | RemoveContainer
    | ContainerStarted
    | Synchronize
    | RuntimeDisconnected
    | InvalidateContainers
)
"""Every command :func:`dracpu.core.state.apply` understands."""
