"""NRI messages through Google's protobuf runtime, and their translation to owner commands.

The NRI task (:mod:`dracpu.tasks.nri_plugin`) reads the runtime's requests with the
``read_*`` functions here (generated classes of ``dracpu._gen.pb2``: containerd/nri
``pkg/api/api.proto``, package ``nri.pkg.api.v1alpha1``), turns them into commands
(:func:`container_command`, :func:`synchronized_containers`), sends those to the state owner,
and writes the owner's answers with the ``*_response`` / ``*_request`` functions. Nothing here
decides a cpuset: the state machine (:mod:`dracpu.core.state`) does; this module translates,
and refuses to put an empty cpuset on the wire (NRI reads ``""`` as "no change", so a shared
container would keep its old CPUs: kubernetes-sigs/dra-driver-cpu #295).

The only payload we write is ``LinuxCPU.cpus`` / ``.mems``, at
``ContainerAdjustment.linux.resources.cpu`` (the container being created) and
``ContainerUpdate.linux.resources.cpu`` (the others). Every update of one reply that moves a
shared container carries the same cpuset, so each distinct (cpus, mems) is built once and
copied (:class:`_Updates`). Decoding is upb's: unknown fields are kept, a malformed message is
the runtime's fault (:class:`RemoteProtocolError`), answered with INVALID_ARGUMENT.

It also answers one question about the runtime: may the plugin send unsolicited
``UpdateContainers`` (widen the shared containers right after an Unprepare)? Only when the
runtime's NRI has containerd/nri#301 (v0.12.1, "avoid holding lock across runtime update
callback"): before it, a plugin-initiated update racing a container event can deadlock the
runtime (containerd/containerd#13733, kubernetes-sigs/dra-driver-cpu #279). The runtime reports
its NRI version in ``ConfigureRequest.NRI_version`` since NRI v0.12.0; older runtimes do not,
and are older than the fix anyway. See :func:`unsolicited_updates_supported`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from google.protobuf.message import DecodeError, Message

from dracpu._gen.pb2.nri.v1alpha1 import api_pb2 as api
from dracpu.core.commands import Container
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import ContainerUpdate
from dracpu.errors import (
    AllocationError,
    CdiError,
    ClaimError,
    DracpuError,
    LocalProtocolError,
    RemoteProtocolError,
)
from dracpu.wire.status import Code

__all__ = [
    "CONTAINER_EVENTS",
    "MIN_CONTAINERD_FOR_UNSOLICITED",
    "MIN_NRI_FOR_UNSOLICITED",
    "NRI_VERSION",
    "PLUGIN_SERVICE",
    "RUNTIME_SERVICE",
    "SUBSCRIBED_EVENTS",
    "SUBSCRIBED_EVENT_MASK",
    "Version",
    "configure_response",
    "container_command",
    "create_container_response",
    "describe_updates",
    "error_status",
    "event_mask",
    "parse_version",
    "read_configure",
    "read_container_event",
    "read_state_change",
    "read_synchronize",
    "read_update_containers_failed",
    "register_plugin_request",
    "stop_container_response",
    "synchronize_response",
    "synchronized_containers",
    "unsolicited_updates_supported",
    "update_container_response",
    "update_containers_request",
]

logger = logging.getLogger(__name__)

# The NRI release whose API our proto/nri/v1alpha1/api.proto follows (messages and field
# numbers as of containerd/nri v0.12.2). Sent as RegisterPluginRequest.NRI_version, as nri's
# stub sends the version of the NRI Go module a plugin was built with (pkg/stub/stub.go
# register, pkg/version GetFromBuildInfo, e.g. "v0.12.1"). The runtime only logs it
# (pkg/adaptation/plugin.go RegisterPlugin: "registered ... (with NRI version v0.12.2)", else
# "unknown"). Bump it with the proto.
NRI_VERSION = "v0.12.2"

# Service names on the wire (nri pkg/api/api_ttrpc.pb.go): mux conn 1 serves PLUGIN_SERVICE
# (the runtime calls us), conn 2 is the runtime's RUNTIME_SERVICE (we call it).
PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"

# nri pkg/api/event.go: the subscription bit of event e is 1 << (e - 1); valid events are
# RUN_POD_SANDBOX .. VALIDATE_CONTAINER_ADJUSTMENT (the last one since NRI v0.10).
_FIRST_EVENT = api.RUN_POD_SANDBOX
_LAST_EVENT = api.VALIDATE_CONTAINER_ADJUSTMENT

# The events a CPU pinner needs. All exist since NRI v0.2, so the mask is inside the 0x7FF that
# runtimes before NRI v0.10 accept (containerd 1.7 - 2.1); 0 would subscribe to everything and
# make us a validator on v0.10+ runtimes (nri pkg/adaptation/plugin.go, Configure).
# PostStartContainer: a pin sent while the container was starting may have been lost
# (dracpu.core.state_containers.container_started); it is sent again once the container runs.
SUBSCRIBED_EVENTS = (
    api.CREATE_CONTAINER,
    api.POST_START_CONTAINER,
    api.UPDATE_CONTAINER,
    api.STOP_CONTAINER,
    api.REMOVE_CONTAINER,
)

# The request type of each container event we serve; all carry pod = 1, container = 2.
CONTAINER_EVENTS: Mapping[str, type[Message]] = {
    "CreateContainer": api.CreateContainerRequest,
    "PostStartContainer": api.PostStartContainerRequest,
    "UpdateContainer": api.UpdateContainerRequest,
    "StopContainer": api.StopContainerRequest,
    "RemoveContainer": api.RemoveContainerRequest,
}

# containerd/nri#301 (first released in v0.12.1): the adaptation no longer holds its lock
# across the runtime's update callback, so a plugin-initiated UpdateContainers cannot deadlock
# against a concurrent container event (containerd/containerd#13733).
MIN_NRI_FOR_UNSOLICITED = (0, 12, 1)
# containerd embeds NRI v0.12.x from 2.3.0 on (containerd go.mod); an older containerd that
# claims a newer NRI is a custom build we do not trust with unsolicited updates.
MIN_CONTAINERD_FOR_UNSOLICITED = (2, 3, 0)
# Runtime names as sent in ConfigureRequest.runtime_name (containerd internal/nri, CRI-O).
CONTAINERD = "containerd"
CRI_O = "cri-o"

# A Go module / release version: v1.2.3, optional -prerelease, optional +build.
_VERSION = re.compile(
    r"v?(?P<major>0|[1-9]\d*)\.(?P<minor>0|[1-9]\d*)\.(?P<patch>0|[1-9]\d*)"
    r"(?:-(?P<pre>[0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?"
)
# `git describe` suffix of a build after a tag: -<commits>-g<sha> (nri version.go stripGitSuffix).
_GIT_DESCRIBE = re.compile(r"\d+-g[0-9a-f]+(?:\.[0-9A-Za-z.-]+)?")

M = TypeVar("M", bound=Message)


def event_mask(events: Iterable[int]) -> int:
    """``ConfigureResponse.events`` for these events (nri event.go ``EventMask.Set``)."""
    mask = 0
    for event in events:
        if not _FIRST_EVENT <= event <= _LAST_EVENT:
            raise LocalProtocolError(f"nri: {event} is not an event one can subscribe to")
        mask |= 1 << (event - 1)
    return mask


SUBSCRIBED_EVENT_MASK = event_mask(SUBSCRIBED_EVENTS)  # 0x6c8


# --- the runtime's version ------------------------------------------------------------------------


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


def unsolicited_updates_supported(configure: api.ConfigureRequest) -> bool:
    """May we send ``UpdateContainers`` on our own, outside any event handler?

    Yes only when the runtime reports an NRI version >= v0.12.1, and it is containerd >= 2.3.0
    or CRI-O. Otherwise the shared containers are widened at the next container event instead.
    """
    nri_version = parse_version(configure.NRI_version)
    if nri_version is None or not nri_version.at_least(MIN_NRI_FOR_UNSOLICITED):
        return False
    if configure.runtime_name == CONTAINERD:
        runtime = parse_version(configure.runtime_version)
        return runtime is not None and runtime.at_least(MIN_CONTAINERD_FOR_UNSOLICITED)
    return configure.runtime_name == CRI_O


# --- reading the runtime's messages ---------------------------------------------------------------


def _read(message_type: type[M], payload: bytes, method: str) -> M:
    try:
        return message_type.FromString(payload)
    except DecodeError as exc:
        raise RemoteProtocolError(f"nri: malformed {method} request: {exc}") from exc


def read_configure(payload: bytes) -> api.ConfigureRequest:
    """``ConfigureRequest``: runtime name and versions, timeouts in ms (0 before NRI v0.7)."""
    return _read(api.ConfigureRequest, payload, "Configure")


def read_synchronize(payload: bytes) -> api.SynchronizeRequest:
    """One part of ``SynchronizeRequest``: pods, containers, ``more`` parts to come."""
    return _read(api.SynchronizeRequest, payload, "Synchronize")


def read_container_event(
    method: str, payload: bytes
) -> tuple[api.PodSandbox | None, api.Container | None]:
    """The pod (``None`` when absent) and container of a container event in ``CONTAINER_EVENTS``."""
    message = _read(CONTAINER_EVENTS[method], payload, method)
    pod = message.pod if message.HasField("pod") else None  # type: ignore[attr-defined]
    has_container = message.HasField("container")
    return pod, message.container if has_container else None  # type: ignore[attr-defined]


def read_state_change(payload: bytes) -> api.StateChangeEvent:
    """``StateChangeEvent``: how runtimes before NRI v0.12 relay every event."""
    return _read(api.StateChangeEvent, payload, "StateChange")


def read_update_containers_failed(payload: bytes) -> tuple[str, ...]:
    """The ids in ``UpdateContainersResponse.failed``."""
    response = _read(api.UpdateContainersResponse, payload, "UpdateContainers response")
    return tuple(update.container_id for update in response.failed)


def container_command(pod: api.PodSandbox | None, container: api.Container) -> Container:
    """The owner's view of a runtime container; a malformed ``DRA_CPUSET_*`` env becomes
    ``env_error`` (the state machine refuses such a container at creation: fail closed)."""
    if pod is None:
        return Container.from_env(container.id, "", container.env, name=container.name)
    return Container.from_env(
        container.id,
        pod.uid,
        container.env,
        pod_namespace=pod.namespace,
        pod_name=pod.name,
        name=container.name,
    )


def synchronized_containers(
    pods: Iterable[api.PodSandbox], containers: Iterable[api.Container]
) -> tuple[Container, ...]:
    """Every container of a (reassembled) ``Synchronize``, with its pod's uid and names."""
    by_id: Mapping[str, api.PodSandbox] = {pod.id: pod for pod in pods}
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


# --- writing ours ---------------------------------------------------------------------------------


def _refuse_empty(container_id: str) -> None:
    logger.error(
        "refusing to send an empty cpuset for container %s (a bug in the state machine)",
        container_id,
        extra={"container": container_id},
    )


class _Updates:
    """Fills a ``repeated ContainerUpdate`` field: one template per distinct (cpus, mems),
    copied and given the container's id (every moved shared container gets the same pool)."""

    __slots__ = ("_templates",)

    def __init__(self) -> None:
        self._templates: dict[tuple[CpuSet, CpuSet | None], api.ContainerUpdate] = {}

    def _template(self, cpus: CpuSet, mems: CpuSet | None) -> api.ContainerUpdate:
        key = (cpus, mems)
        template = self._templates.get(key)
        if template is None:
            template = api.ContainerUpdate()
            _set_cpu(template.linux.resources.cpu, cpus, mems)
            self._templates[key] = template
        return template

    def fill(
        self,
        field: RepeatedCompositeFieldContainer[api.ContainerUpdate],
        updates: Iterable[ContainerUpdate],
    ) -> None:
        add = field.add
        for update in updates:
            container_id = update.container_id
            if not update.cpus:
                _refuse_empty(container_id)
                continue
            if not container_id:
                raise LocalProtocolError("nri: a container update needs a container id")
            item = add()
            item.CopyFrom(self._template(update.cpus, update.mems))
            item.container_id = container_id


def _set_cpu(cpu: api.LinuxCPU, cpus: CpuSet, mems: CpuSet | None) -> None:
    cpu.cpus = str(cpus)
    if mems:
        cpu.mems = str(mems)


def register_plugin_request(name: str, index: str) -> bytes:
    """``RegisterPluginRequest{plugin_name, plugin_idx, NRI_version}`` (:data:`NRI_VERSION`)."""
    try:
        request = api.RegisterPluginRequest(
            plugin_name=name, plugin_idx=index, NRI_version=NRI_VERSION
        )
        return request.SerializeToString()
    except ValueError as exc:
        raise LocalProtocolError(f"nri: cannot encode the plugin name {name!r}: {exc}") from exc


def configure_response(events: int = SUBSCRIBED_EVENT_MASK) -> bytes:
    """``ConfigureResponse{events}``: the events we subscribe to."""
    try:
        return api.ConfigureResponse(events=events).SerializeToString()
    except ValueError as exc:
        raise LocalProtocolError(f"nri: event mask {events:#x} does not fit an int32") from exc


def synchronize_response(updates: Iterable[ContainerUpdate] = (), *, more: bool = False) -> bytes:
    """``SynchronizeResponse{update, more}``: each part but the last is answered with ``more``
    and no updates (nri pkg/adaptation/plugin.go synchronize)."""
    response = api.SynchronizeResponse(more=more)
    _Updates().fill(response.update, updates)
    return response.SerializeToString()


def create_container_response(
    container_id: str, cpus: CpuSet, mems: CpuSet | None, updates: Iterable[ContainerUpdate]
) -> bytes:
    """``CreateContainerResponse``: the new container's cpuset as its adjustment, the other
    containers' updates (updating the one being created is an error in the runtime, nri
    pkg/adaptation/result.go)."""
    if not cpus:
        raise LocalProtocolError(
            f"nri: refusing to create container {container_id} with an empty cpuset: the "
            "runtime would read it as 'no change'"
        )
    response = api.CreateContainerResponse()
    _set_cpu(response.adjust.linux.resources.cpu, cpus, mems)
    _Updates().fill(response.update, updates)
    return response.SerializeToString()


def update_container_response(updates: Iterable[ContainerUpdate]) -> bytes:
    """``UpdateContainerResponse{update}``: an entry for the target overrides its update."""
    response = api.UpdateContainerResponse()
    _Updates().fill(response.update, updates)
    return response.SerializeToString()


def stop_container_response(updates: Iterable[ContainerUpdate]) -> bytes:
    """``StopContainerResponse{update}``."""
    response = api.StopContainerResponse()
    _Updates().fill(response.update, updates)
    return response.SerializeToString()


def update_containers_request(updates: Iterable[ContainerUpdate]) -> bytes:
    """``UpdateContainersRequest{update}`` (the plugin-initiated call on conn 2)."""
    request = api.UpdateContainersRequest()
    _Updates().fill(request.update, updates)
    return request.SerializeToString()


def error_status(error: DracpuError) -> tuple[int, str]:
    """The ttrpc status that fails the runtime's operation (a non-fatal plugin error).

    The owner's refusals (an unverifiable claim, a spoofed or malformed ``DRA_CPUSET`` env, no
    CPU left for a shared container) are FAILED_PRECONDITION; anything else (the owner did not
    answer in time or is gone) is UNAVAILABLE. Both make the runtime fail the container
    operation, which the kubelet retries: never a container that runs on the wrong CPUs.
    """
    if isinstance(error, ClaimError | AllocationError | CdiError):
        return Code.FAILED_PRECONDITION, f"dra.cpu: {error}"
    return Code.UNAVAILABLE, f"dra.cpu: {error}"


def describe_updates(updates: Sequence[ContainerUpdate]) -> str:
    """``3 containers -> 4-63`` style summary for logs."""
    targets = sorted({str(update.cpus) for update in updates})
    return f"{len(updates)} containers -> {', '.join(targets) or 'nothing'}"
