"""Sans-IO NRI messages: the few fields a CPU-pinning plugin reads and writes, as protobuf bytes.

The NRI API (containerd/nri ``pkg/api/api.proto``, package ``nri.pkg.api.v1alpha1``;
``reference/nri-ttrpc-cdi.md`` §3) is large; a CPU plugin needs a sliver of it:

* it **reads** ``ConfigureRequest`` (runtime name, versions, timeouts), ``SynchronizeRequest``
  (pods and containers, ``more``), the container events (``CreateContainerRequest``,
  ``UpdateContainerRequest``, ``StopContainerRequest``, ``RemoveContainerRequest``: ``pod`` = 1,
  ``container`` = 2), ``StateChangeEvent`` and ``UpdateContainersResponse``; of a ``PodSandbox``
  only id, name, uid and namespace, of a ``Container`` only id, pod id, name, state and env;
* it **writes** ``RegisterPluginRequest``, ``ConfigureResponse``, ``SynchronizeResponse``,
  ``CreateContainerResponse`` (adjust ``linux.resources.cpu.cpus/mems`` plus updates),
  ``UpdateContainerResponse``, ``StopContainerResponse`` and ``UpdateContainersRequest``, whose
  only payload is ``LinuxCPU.cpus`` (6) and ``.mems`` (7) at
  ``ContainerAdjustment.linux(6).resources(2).cpu(2)`` and
  ``ContainerUpdate.linux(2).resources(1).cpu(2)``.

Hand-written rather than generated because it is on the hot path: a ``CreateContainer`` reply
that moves 200 shared containers costs ~35 ms with betterproto2 and well under 1 ms here, and a
500-container ``Synchronize`` is decoded without materialising labels, annotations, mounts and
the rest. Field numbers are those of ``api.proto``; the bytes equal Go's ``proto.Marshal``
(fields in ascending order, proto3 defaults omitted).

Decoding follows Go's ``proto.Unmarshal``: unknown fields, and known fields of another wire type,
are skipped; the last value of a scalar wins; a singular message field that occurs twice is
merged; strings must be UTF-8. Malformed bytes raise :class:`RemoteProtocolError` (the
runtime's fault). Encoding refuses an empty ``cpus`` (NRI reads ``""`` as "no change", so a
shared container would silently keep its old CPUs, upstream dra-driver-cpu #295) with
:class:`LocalProtocolError` (ours).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dracpu.errors import LocalProtocolError, RemoteProtocolError
from dracpu.wire.protowire import (
    WIRE_LEN,
    WIRE_VARINT,
    Field,
    encode_text,
    encode_varint,
    len_field,
    scan_fields,
    to_int32,
    to_int64,
)

__all__ = [
    "PLUGIN_SERVICE",
    "RUNTIME_SERVICE",
    "SUBSCRIBED_EVENTS",
    "SUBSCRIBED_EVENT_MASK",
    "ConfigureRequest",
    "Container",
    "ContainerEvent",
    "CpusetUpdate",
    "Event",
    "Pod",
    "StateChangeEvent",
    "SynchronizeRequest",
    "decode_configure_request",
    "decode_container_event",
    "decode_state_change_event",
    "decode_synchronize_request",
    "decode_update_containers_response",
    "encode_configure_response",
    "encode_create_container_response",
    "encode_register_plugin_request",
    "encode_stop_container_response",
    "encode_synchronize_response",
    "encode_update_container_response",
    "encode_update_containers_request",
    "event_mask",
]

# Service names on the wire (nri pkg/api/api_ttrpc.pb.go): conn 1 serves PLUGIN_SERVICE (the
# runtime calls us), conn 2 is the runtime's RUNTIME_SERVICE (we call it).
PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"


class Event(enum.IntEnum):
    """NRI ``enum Event`` (api.proto); the subscription bit of event ``e`` is ``1 << (e - 1)``."""

    UNKNOWN = 0
    RUN_POD_SANDBOX = 1
    STOP_POD_SANDBOX = 2
    REMOVE_POD_SANDBOX = 3
    CREATE_CONTAINER = 4
    POST_CREATE_CONTAINER = 5
    START_CONTAINER = 6
    POST_START_CONTAINER = 7
    UPDATE_CONTAINER = 8
    POST_UPDATE_CONTAINER = 9
    STOP_CONTAINER = 10
    REMOVE_CONTAINER = 11
    UPDATE_POD_SANDBOX = 12  # NRI v0.10+
    POST_UPDATE_POD_SANDBOX = 13  # NRI v0.10+
    VALIDATE_CONTAINER_ADJUSTMENT = 14  # NRI v0.10+


def event_mask(events: Iterable[int]) -> int:
    """``ConfigureResponse.events`` for these events (nri event.go ``EventMask.Set``)."""
    mask = 0
    for event in events:
        if not Event.RUN_POD_SANDBOX <= event <= Event.VALIDATE_CONTAINER_ADJUSTMENT:
            raise LocalProtocolError(f"nri: {event} is not an event one can subscribe to")
        mask |= 1 << (event - 1)
    return mask


# The events a CPU pinner needs. All exist since NRI v0.2, so the mask is inside the 0x7FF that
# runtimes before NRI v0.10 accept (containerd 1.7 - 2.1); 0 would subscribe to everything,
# and make us a validator on v0.10+ runtimes (reference §3.3).
SUBSCRIBED_EVENTS = (
    Event.CREATE_CONTAINER,
    Event.UPDATE_CONTAINER,
    Event.STOP_CONTAINER,
    Event.REMOVE_CONTAINER,
)
SUBSCRIBED_EVENT_MASK = event_mask(SUBSCRIBED_EVENTS)  # 0x688, reference §4.2 golden vector


# --- decoded values -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pod:
    """The fields of an NRI ``PodSandbox`` we use (1 id, 2 name, 3 uid, 4 namespace)."""

    id: str = ""
    name: str = ""
    uid: str = ""
    namespace: str = ""


@dataclass(frozen=True, slots=True)
class Container:
    """The fields of an NRI ``Container`` we use (1 id, 2 pod_sandbox_id, 3 name, 4 state,
    8 env as ``KEY=VALUE`` strings, CDI-injected variables included, reference §3.10)."""

    id: str = ""
    pod_sandbox_id: str = ""
    name: str = ""
    state: int = 0
    env: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ConfigureRequest:
    """NRI ``ConfigureRequest``. Timeouts are in milliseconds (0 from runtimes before NRI v0.7);
    ``nri_version`` is the runtime's NRI module version (NRI v0.12+, else empty)."""

    config: str = ""
    runtime_name: str = ""
    runtime_version: str = ""
    registration_timeout_ms: int = 0
    request_timeout_ms: int = 0
    nri_version: str = ""


@dataclass(frozen=True, slots=True)
class SynchronizeRequest:
    """NRI ``SynchronizeRequest``: one part of the runtime's pods and containers; ``more``: more
    parts follow (answer this one with ``more`` and no updates)."""

    pods: tuple[Pod, ...] = ()
    containers: tuple[Container, ...] = ()
    more: bool = False


@dataclass(frozen=True, slots=True)
class ContainerEvent:
    """A container event request: ``CreateContainerRequest``, ``UpdateContainerRequest``,
    ``StopContainerRequest``, ``RemoveContainerRequest`` and the other v0.12 per-event requests
    all carry ``pod`` = 1 and ``container`` = 2 (``None`` when absent)."""

    pod: Pod | None = None
    container: Container | None = None


@dataclass(frozen=True, slots=True)
class StateChangeEvent:
    """NRI ``StateChangeEvent`` (1 event, 2 pod, 3 container)."""

    event: int = 0
    pod: Pod | None = None
    container: Container | None = None


@dataclass(frozen=True, slots=True)
class CpusetUpdate:
    """A container's cpuset to write: ``cpus`` (never empty) and ``mems`` (``""``: unchanged),
    in the Linux list format (``0-3,8``)."""

    container_id: str
    cpus: str
    mems: str = ""


# --- decoding -------------------------------------------------------------------------------------


def _text(data: bytes, start: int, end: int, what: str) -> str:
    try:
        return data[start:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError(f"nri: {what} is not valid UTF-8") from exc


_Span = tuple[int, int]


def _pod(data: bytes, spans: Sequence[_Span]) -> Pod:
    """A PodSandbox from every occurrence of the field (occurrences merge)."""
    pod_id = name = uid = namespace = ""
    for start, end in spans:
        for number, wire_type, a, b in scan_fields(data, start, end):
            if wire_type != WIRE_LEN:
                continue
            if number == 1:
                pod_id = _text(data, a, b, "PodSandbox.id")
            elif number == 2:
                name = _text(data, a, b, "PodSandbox.name")
            elif number == 3:
                uid = _text(data, a, b, "PodSandbox.uid")
            elif number == 4:
                namespace = _text(data, a, b, "PodSandbox.namespace")
    return Pod(pod_id, name, uid, namespace)


def _container(data: bytes, spans: Sequence[_Span]) -> Container:
    """A Container from every occurrence of the field (occurrences merge)."""
    container_id = pod_id = name = ""
    state = 0
    env: list[str] = []
    for start, end in spans:
        for number, wire_type, a, b in scan_fields(data, start, end):
            if wire_type == WIRE_LEN:
                if number == 8:
                    env.append(_text(data, a, b, "Container.env"))
                elif number == 1:
                    container_id = _text(data, a, b, "Container.id")
                elif number == 2:
                    pod_id = _text(data, a, b, "Container.pod_sandbox_id")
                elif number == 3:
                    name = _text(data, a, b, "Container.name")
            elif wire_type == WIRE_VARINT and number == 4:
                state = to_int32(a)
    return Container(container_id, pod_id, name, state, tuple(env))


def _pod_and_container(
    data: bytes, fields: Iterable[Field], pod_field: int, container_field: int
) -> tuple[Pod | None, Container | None]:
    pods: list[_Span] = []
    containers: list[_Span] = []
    for number, wire_type, a, b in fields:
        if wire_type == WIRE_LEN:
            if number == pod_field:
                pods.append((a, b))
            elif number == container_field:
                containers.append((a, b))
    return (
        _pod(data, pods) if pods else None,
        _container(data, containers) if containers else None,
    )


def decode_configure_request(data: bytes) -> ConfigureRequest:
    """Parse an NRI ``ConfigureRequest``."""
    data = bytes(data)
    texts = {1: "", 2: "", 3: "", 6: ""}
    names = {1: "config", 2: "runtime_name", 3: "runtime_version", 6: "NRI_version"}
    timeouts = {4: 0, 5: 0}
    for number, wire_type, a, b in scan_fields(data, 0, len(data)):
        if wire_type == WIRE_LEN and number in texts:
            texts[number] = _text(data, a, b, f"ConfigureRequest.{names[number]}")
        elif wire_type == WIRE_VARINT and number in timeouts:
            timeouts[number] = to_int64(a)
    return ConfigureRequest(texts[1], texts[2], texts[3], timeouts[4], timeouts[5], texts[6])


def decode_synchronize_request(data: bytes) -> SynchronizeRequest:
    """Parse an NRI ``SynchronizeRequest`` (1 pods, 2 containers, 3 more)."""
    data = bytes(data)
    pods: list[Pod] = []
    containers: list[Container] = []
    more = False
    for number, wire_type, a, b in scan_fields(data, 0, len(data)):
        if wire_type == WIRE_LEN:
            if number == 2:
                containers.append(_container(data, ((a, b),)))
            elif number == 1:
                pods.append(_pod(data, ((a, b),)))
        elif wire_type == WIRE_VARINT and number == 3:
            more = a != 0
    return SynchronizeRequest(tuple(pods), tuple(containers), more)


def decode_container_event(data: bytes) -> ContainerEvent:
    """Parse any request of the form ``{PodSandbox pod = 1; Container container = 2; ...}``."""
    data = bytes(data)
    pod, container = _pod_and_container(data, scan_fields(data, 0, len(data)), 1, 2)
    return ContainerEvent(pod, container)


def decode_state_change_event(data: bytes) -> StateChangeEvent:
    """Parse an NRI ``StateChangeEvent`` (1 event, 2 pod, 3 container)."""
    data = bytes(data)
    fields = scan_fields(data, 0, len(data))
    event = 0
    for number, wire_type, a, _ in fields:
        if number == 1 and wire_type == WIRE_VARINT:
            event = to_int32(a)
    pod, container = _pod_and_container(data, fields, 2, 3)
    return StateChangeEvent(event, pod, container)


def decode_update_containers_response(data: bytes) -> tuple[str, ...]:
    """The ids of ``UpdateContainersResponse.failed`` (1: repeated ContainerUpdate)."""
    data = bytes(data)
    failed: list[str] = []
    for number, wire_type, a, b in scan_fields(data, 0, len(data)):
        if number == 1 and wire_type == WIRE_LEN:
            container_id = ""
            for inner, inner_type, c, d in scan_fields(data, a, b):
                if inner == 1 and inner_type == WIRE_LEN:
                    container_id = _text(data, c, d, "ContainerUpdate.container_id")
            failed.append(container_id)
    return tuple(failed)


# --- encoding -------------------------------------------------------------------------------------


# One-byte tags: (field number << 3) | wire type.
_TAG_1_LEN = 0x0A
_TAG_2_LEN = 0x12
_TAG_3_LEN = 0x1A
_TAG_6_LEN = 0x32
_TAG_7_LEN = 0x3A
_TAG_2_VARINT = 0x10


def _linux_resources(cpus: str, mems: str, what: str) -> bytes:
    """``LinuxResources{cpu(2): LinuxCPU{cpus(6), mems(7)}}``; ``cpus`` must not be empty."""
    if not cpus:
        raise LocalProtocolError(
            f"nri: refusing to send an empty cpuset for {what}: the runtime would read it as "
            "'no change'"
        )
    cpu = len_field(_TAG_6_LEN, encode_text(cpus, "nri: cpus"))
    if mems:
        cpu += len_field(_TAG_7_LEN, encode_text(mems, "nri: mems"))
    return len_field(_TAG_2_LEN, cpu)


def _container_updates(field_tag: int, updates: Iterable[CpusetUpdate]) -> bytes:
    """``repeated ContainerUpdate`` with ``container_id`` and ``linux.resources.cpu``."""
    out = bytearray()
    tag = bytes((field_tag,))
    tails: dict[tuple[str, str], bytes] = {}  # shared containers all get the same cpuset
    for update in updates:
        key = (update.cpus, update.mems)
        tail = tails.get(key)
        if tail is None:
            resources = _linux_resources(update.cpus, update.mems, update.container_id)
            # ContainerUpdate.linux(2) = LinuxContainerUpdate{resources(1)}
            tail = tails[key] = len_field(_TAG_2_LEN, len_field(_TAG_1_LEN, resources))
        if not update.container_id:
            raise LocalProtocolError("nri: a container update needs a container id")
        container_id = encode_text(update.container_id, "nri: container id")
        size = len(container_id)
        out += tag
        out += encode_varint(1 + len(encode_varint(size)) + size + len(tail))
        out += b"\x0a"  # ContainerUpdate.container_id(1)
        out += encode_varint(size)
        out += container_id
        out += tail
    return bytes(out)


def encode_register_plugin_request(name: str, index: str, nri_version: str = "") -> bytes:
    """``RegisterPluginRequest{plugin_name(1), plugin_idx(2), NRI_version(3)}``."""
    out = b""
    if name:
        out += len_field(_TAG_1_LEN, encode_text(name, "nri: plugin name"))
    if index:
        out += len_field(_TAG_2_LEN, encode_text(index, "nri: plugin index"))
    if nri_version:
        out += len_field(_TAG_3_LEN, encode_text(nri_version, "nri: NRI version"))
    return out


def encode_configure_response(events: int) -> bytes:
    """``ConfigureResponse{events(2): int32}`` (field 1 is unused)."""
    if not 0 <= events < 1 << 31:
        raise LocalProtocolError(f"nri: event mask {events:#x} does not fit in an int32")
    return bytes((_TAG_2_VARINT,)) + encode_varint(events) if events else b""


def encode_synchronize_response(
    updates: Sequence[CpusetUpdate] = (), *, more: bool = False
) -> bytes:
    """``SynchronizeResponse{update(1), more(2)}``."""
    out = _container_updates(_TAG_1_LEN, updates)
    return out + b"\x10\x01" if more else out


def encode_create_container_response(
    cpus: str, mems: str = "", updates: Sequence[CpusetUpdate] = (), *, what: str = "container"
) -> bytes:
    """``CreateContainerResponse{adjust(1).linux(6).resources(2) = cpus/mems, update(2)}``.

    ``updates`` are for *other* containers (updating the one being created is an error in the
    runtime, nri adaptation/result.go).
    """
    adjustment = len_field(_TAG_6_LEN, len_field(_TAG_2_LEN, _linux_resources(cpus, mems, what)))
    return len_field(_TAG_1_LEN, adjustment) + _container_updates(_TAG_2_LEN, updates)


def encode_update_container_response(updates: Sequence[CpusetUpdate]) -> bytes:
    """``UpdateContainerResponse{update(1)}``: an entry for the target overrides its update."""
    return _container_updates(_TAG_1_LEN, updates)


def encode_stop_container_response(updates: Sequence[CpusetUpdate]) -> bytes:
    """``StopContainerResponse{update(1)}``."""
    return _container_updates(_TAG_1_LEN, updates)


def encode_update_containers_request(updates: Sequence[CpusetUpdate]) -> bytes:
    """``UpdateContainersRequest{update(1)}`` (the plugin-initiated call on conn 2)."""
    return _container_updates(_TAG_1_LEN, updates)
