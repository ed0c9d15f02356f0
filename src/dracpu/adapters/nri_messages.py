"""NRI messages <-> state-owner commands and results: the NRI plugin's translation table.

The NRI task (:mod:`dracpu.tasks.nri_plugin`) decodes the runtime's requests with
:mod:`dracpu.wire.nri`, turns them into commands with the functions here, sends those to the
state owner, and turns the owner's answers back into NRI replies. Nothing here decides a cpuset:
the state machine (:mod:`dracpu.core.state`) does; this module only translates, and refuses to
put an empty cpuset on the wire (NRI reads ``""`` as "no change", upstream issue #295).

It also answers one question about the runtime: may the plugin send unsolicited
``UpdateContainers`` (widen the shared containers right after an Unprepare)? Only when the
runtime's NRI has containerd/nri#301 (v0.12.1, "avoid holding lock across runtime update
callback"): before it, a plugin-initiated update racing a container event can deadlock the
runtime (containerd/containerd#13733, dra-driver-cpu #279). The runtime reports its NRI version
in ``ConfigureRequest.NRI_version`` since NRI v0.12.0; older runtimes do not, and are older than
the fix anyway. See :func:`unsolicited_updates_supported`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dracpu.core.commands import Container
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import ContainerUpdate
from dracpu.errors import AllocationError, CdiError, ClaimError, DracpuError
from dracpu.wire import nri
from dracpu.wire.ttrpc import Code

__all__ = [
    "MIN_CONTAINERD_FOR_UNSOLICITED",
    "MIN_NRI_FOR_UNSOLICITED",
    "Version",
    "container_command",
    "describe_updates",
    "error_status",
    "parse_version",
    "synchronized_containers",
    "unsolicited_updates_supported",
    "wire_pins",
    "wire_update",
    "wire_updates",
]

logger = logging.getLogger(__name__)

# containerd/nri#301 (merged 2026-07-15, first released in v0.12.1): the adaptation no longer
# holds its lock across the runtime's update callback, so a plugin-initiated UpdateContainers
# cannot deadlock against a concurrent container event (containerd/containerd#13733).
MIN_NRI_FOR_UNSOLICITED = (0, 12, 1)
# containerd embeds NRI v0.12.x from 2.3.0 on (reference §3.5); an older containerd that claims
# a newer NRI is a custom build we do not trust with unsolicited updates.
MIN_CONTAINERD_FOR_UNSOLICITED = (2, 3, 0)
# Runtime names as sent in ConfigureRequest.runtime_name (reference §3.4).
CONTAINERD = "containerd"
CRI_O = "cri-o"

# A Go module / release version: v1.2.3, optional -prerelease, optional +build.
_VERSION = re.compile(
    r"v?(?P<major>0|[1-9]\d*)\.(?P<minor>0|[1-9]\d*)\.(?P<patch>0|[1-9]\d*)"
    r"(?:-(?P<pre>[0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?"
)
# `git describe` suffix of a build after a tag: -<commits>-g<sha> (nri version.go stripGitSuffix).
_GIT_DESCRIBE = re.compile(r"\d+-g[0-9a-f]+(?:\.[0-9A-Za-z.-]+)?")


@dataclass(frozen=True, slots=True, order=True)
class Version:
    """A comparable release version; a prerelease sorts before its release (semver)."""

    major: int
    minor: int
    patch: int
    release: bool = True  # False for a prerelease such as -rc.1 or a Go pseudo-version

    def at_least(self, minimum: tuple[int, int, int]) -> bool:
        return self >= Version(*minimum)


def parse_version(text: str) -> Version | None:
    """``v0.12.1`` -> Version(0, 12, 1); ``None`` for text that is not a version.

    A ``git describe`` suffix (``v2.3.1-5-gabc123``: five commits after v2.3.1) counts as the
    tag; any other suffix is a prerelease and sorts before the release, so a Go pseudo-version
    ``v0.12.1-0.20260720-abcdef`` (a commit *before* v0.12.1) is older than v0.12.1.
    """
    match = _VERSION.fullmatch(text.strip())
    if match is None:
        return None
    pre = match.group("pre")
    release = pre is None or _GIT_DESCRIBE.fullmatch(pre) is not None
    return Version(
        int(match.group("major")), int(match.group("minor")), int(match.group("patch")), release
    )


def unsolicited_updates_supported(configure: nri.ConfigureRequest) -> bool:
    """May we send ``UpdateContainers`` on our own, outside any event handler?

    Yes only when the runtime reports an NRI version >= v0.12.1, and it is containerd >= 2.3.0
    or CRI-O. Otherwise the shared containers are widened at the next container event instead.
    """
    nri_version = parse_version(configure.nri_version)
    if nri_version is None or not nri_version.at_least(MIN_NRI_FOR_UNSOLICITED):
        return False
    if configure.runtime_name == CONTAINERD:
        runtime = parse_version(configure.runtime_version)
        return runtime is not None and runtime.at_least(MIN_CONTAINERD_FOR_UNSOLICITED)
    return configure.runtime_name == CRI_O


# --- requests -> commands -------------------------------------------------------------------------


def container_command(pod: nri.Pod | None, container: nri.Container) -> Container:
    """The owner's view of a runtime container; a malformed ``DRA_CPUSET_*`` env becomes
    ``env_error`` (the state machine refuses such a container at creation: fail closed)."""
    pod = pod or nri.Pod()
    return Container.from_env(
        container.id,
        pod.uid,
        container.env,
        pod_namespace=pod.namespace,
        pod_name=pod.name,
        name=container.name,
    )


def synchronized_containers(
    pods: Iterable[nri.Pod], containers: Iterable[nri.Container]
) -> tuple[Container, ...]:
    """Every container of a (reassembled) ``Synchronize``, with its pod's uid and names."""
    by_id: Mapping[str, nri.Pod] = {pod.id: pod for pod in pods}
    result: list[Container] = []
    for container in containers:
        pod = by_id.get(container.pod_sandbox_id)
        if pod is None:
            logger.warning(
                "Synchronize: container %s (%s) names pod sandbox %s, which the runtime did not "
                "list; its claims are checked without the pod's identity",
                container.name,
                container.id,
                container.pod_sandbox_id,
                extra={"container": container.id},
            )
        result.append(container_command(pod, container))
    return tuple(result)


# --- results -> replies ---------------------------------------------------------------------------


def wire_update(container_id: str, cpus: CpuSet, mems: CpuSet | None) -> nri.CpusetUpdate | None:
    """The update to send, or ``None`` (logged as a bug) when ``cpus`` is empty: an empty cpuset
    means "no change" to the runtime, so it would leave the container where it is."""
    if not cpus:
        logger.error(
            "refusing to send an empty cpuset for container %s (a bug in the state machine)",
            container_id,
            extra={"container": container_id},
        )
        return None
    return nri.CpusetUpdate(container_id, str(cpus), str(mems) if mems else "")


class _Texts(dict[CpuSet, str]):
    """Each distinct cpuset formatted once: every shared container gets the same pool, and
    formatting a 1000-CPU set costs ~30 us (200 of them were most of a CreateContainer)."""

    def __missing__(self, cpus: CpuSet) -> str:
        text = self[cpus] = str(cpus)
        return text


def wire_pins(pins: Iterable[tuple[str, CpuSet, CpuSet | None]]) -> list[nri.CpusetUpdate]:
    """``(container id, cpus, mems)`` as NRI updates; empty cpusets are dropped (and logged)."""
    texts = _Texts()
    result: list[nri.CpusetUpdate] = []
    for container_id, cpus, mems in pins:
        if not cpus:
            wire_update(container_id, cpus, mems)  # logs the refusal
            continue
        result.append(nri.CpusetUpdate(container_id, texts[cpus], texts[mems] if mems else ""))
    return result


def wire_updates(updates: Iterable[ContainerUpdate]) -> list[nri.CpusetUpdate]:
    """The owner's container updates as NRI updates; empty cpusets are dropped (and logged)."""
    return wire_pins((u.container_id, u.cpus, u.mems) for u in updates)


def error_status(error: DracpuError) -> tuple[int, str]:
    """The ttrpc status that fails the runtime's operation (a non-fatal error, reference §3.7).

    The owner's refusals (an unverifiable claim, a spoofed or malformed ``DRA_CPUSET`` env, no
    CPU left for a shared container) are FAILED_PRECONDITION; anything else (the owner did not
    answer in time or is gone) is UNAVAILABLE. Both make the runtime fail the container
    operation, which the kubelet retries: never a container that runs on the wrong CPUs.
    """
    if isinstance(error, ClaimError | AllocationError | CdiError):
        return Code.FAILED_PRECONDITION, f"dra.cpu: {error}"
    return Code.UNAVAILABLE, f"dra.cpu: {error}"


def describe_updates(updates: Sequence[nri.CpusetUpdate]) -> str:
    """``3 containers -> 4-63`` style summary for logs."""
    targets = sorted({update.cpus for update in updates})
    return f"{len(updates)} containers -> {', '.join(targets) or 'nothing'}"
