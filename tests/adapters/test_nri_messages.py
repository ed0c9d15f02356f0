"""NRI messages through Google's protobuf runtime, their translation to owner commands, and the
unsolicited-update gate.

Golden vectors are the bytes containerd/nri's Go code writes for the same values
(``RegisterPlugin``, ``Configure``, ``CreateContainer``); the peer for everything else is Google
protobuf driven field by field through the simulator's own generated tree
(:mod:`dracpu.sim._pb2`), so the adapter's message building (templates copied per cpuset) is
checked against the plain way of setting the same fields.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dracpu._gen.pb2.nri.v1alpha1 import api_pb2 as api
from dracpu.adapters import nri_messages as messages
from dracpu.adapters.nri_messages import Version, parse_version, unsolicited_updates_supported
from dracpu.core.commands import ClaimEnv
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import ContainerUpdate
from dracpu.errors import (
    CdiError,
    ClaimConflictError,
    ClaimError,
    DracpuError,
    InsufficientCpusError,
    LocalProtocolError,
    RemoteProtocolError,
)
from dracpu.sim._pb2.nri.v1alpha1 import api_pb2 as pb
from dracpu.wire.status import Code
from tests.wire.mutation import mutated

UID = "11111111-2222-4333-8444-555555555555"
OTHER = "66666666-7777-4888-9999-000000000000"


# --- golden vectors -------------------------------------------------------------------------------


def test_subscribed_mask_is_create_post_start_update_stop_remove_0x6c8() -> None:
    assert messages.SUBSCRIBED_EVENT_MASK == 0x6C8
    assert messages.event_mask([api.CREATE_CONTAINER]) == 0x8
    assert messages.event_mask([api.POST_START_CONTAINER]) == 0x40
    assert messages.event_mask([api.REMOVE_CONTAINER]) == 0x400
    assert messages.SUBSCRIBED_EVENT_MASK & ~0x7FF == 0  # valid on runtimes before NRI v0.10


def test_event_mask_refuses_non_events() -> None:
    with pytest.raises(LocalProtocolError, match="subscribe"):
        messages.event_mask([api.UNKNOWN])
    with pytest.raises(LocalProtocolError):
        messages.event_mask([15])


def test_configure_response_golden() -> None:
    # field 2 (events), varint 0x6c8: what Go's proto.Marshal writes for ConfigureResponse
    assert messages.configure_response() == bytes.fromhex("10c80d")
    assert messages.configure_response(0) == b""
    with pytest.raises(LocalProtocolError):
        messages.configure_response(1 << 31)


def test_create_container_response_golden() -> None:
    golden = bytes.fromhex("0a0b3209120712053203322d33")  # adjust.linux.resources.cpu.cpus "2-3"
    assert messages.create_container_response("c", CpuSet.parse("2-3"), None, []) == golden


def test_register_plugin_request_golden() -> None:
    # 1: "dra-cpu", 2: "90", 3 (NRI_version): "v0.12.2", the NRI release of proto/nri.
    golden = bytes.fromhex("0a076472612d637075 12023930 1a0776302e31322e32".replace(" ", ""))
    assert messages.register_plugin_request("dra-cpu", "90") == golden
    with pytest.raises(LocalProtocolError):
        messages.register_plugin_request("\ud800", "00")


# --- writing: the same bytes as the fields set one by one -----------------------------------------


def _pb_update(update: ContainerUpdate) -> pb.ContainerUpdate:
    message = pb.ContainerUpdate(container_id=update.container_id)
    cpu = message.linux.resources.cpu
    cpu.cpus = str(update.cpus)
    if update.mems:
        cpu.mems = str(update.mems)
    return message


UPDATES = [
    ContainerUpdate("ctr-a", CpuSet.parse("1-31,33-63")),
    ContainerUpdate("ctr-b", CpuSet.parse("1-31,33-63")),
    ContainerUpdate("ctr-c", CpuSet.parse("2-5"), CpuSet.parse("0")),
    ContainerUpdate("ctr-é", CpuSet.parse("7"), CpuSet.parse("0-1")),
    ContainerUpdate("ctr-d", CpuSet.parse("1-31,33-63")),
]


def test_create_container_response_matches_protobuf() -> None:
    cpus, mems = CpuSet.parse("2-5,34-37"), CpuSet.parse("0,1")
    ours = messages.create_container_response("new", cpus, mems, UPDATES)
    peer = pb.CreateContainerResponse(update=[_pb_update(u) for u in UPDATES])
    peer.adjust.linux.resources.cpu.cpus = "2-5,34-37"
    peer.adjust.linux.resources.cpu.mems = "0-1"
    assert ours == peer.SerializeToString(deterministic=True)
    parsed = pb.CreateContainerResponse.FromString(ours)
    assert [u.container_id for u in parsed.update] == ["ctr-a", "ctr-b", "ctr-c", "ctr-é", "ctr-d"]
    assert [u.linux.resources.cpu.mems for u in parsed.update] == ["", "", "0", "0-1", ""]
    assert not any(u.ignore_failure for u in parsed.update)


@pytest.mark.parametrize(
    ("encode", "message_type"),
    [
        (messages.update_container_response, pb.UpdateContainerResponse),
        (messages.stop_container_response, pb.StopContainerResponse),
        (messages.update_containers_request, pb.UpdateContainersRequest),
        (messages.synchronize_response, pb.SynchronizeResponse),
    ],
)
def test_update_lists_match_protobuf(encode: object, message_type: type) -> None:
    assert callable(encode)
    ours = encode(UPDATES)
    peer = message_type(update=[_pb_update(u) for u in UPDATES])
    assert ours == peer.SerializeToString(deterministic=True)


def test_synchronize_response_more() -> None:
    ours = messages.synchronize_response(more=True)
    assert ours == b"\x10\x01"
    assert messages.synchronize_response() == b""


def test_empty_cpusets_never_reach_the_wire(caplog: pytest.LogCaptureFixture) -> None:
    updates = [*UPDATES[:1], ContainerUpdate("bad", CpuSet.parse(""))]
    with caplog.at_level(logging.ERROR, logger="dracpu.adapters.nri_messages"):
        ours = messages.stop_container_response(updates)
    assert ours == messages.stop_container_response(UPDATES[:1])
    assert "empty cpuset for container bad" in caplog.text
    with pytest.raises(LocalProtocolError, match="empty cpuset"):
        messages.create_container_response("ctr-x", CpuSet.parse(""), None, [])
    with pytest.raises(LocalProtocolError, match="container id"):
        messages.update_containers_request([ContainerUpdate("", CpuSet.parse("1"))])


_cpusets = st.frozensets(st.integers(0, 511), min_size=1, max_size=40).map(CpuSet)


@settings(max_examples=60)
@given(
    st.lists(
        st.builds(
            ContainerUpdate,
            st.text(min_size=1, max_size=70),
            _cpusets,
            st.none() | st.frozensets(st.integers(0, 7), max_size=4).map(CpuSet),
        ),
        max_size=20,
    )
)
def test_update_list_bytes_equal_protobuf(updates: list[ContainerUpdate]) -> None:
    ours = messages.update_containers_request(updates)
    peer = pb.UpdateContainersRequest(update=[_pb_update(u) for u in updates])
    assert ours == peer.SerializeToString(deterministic=True)


# --- reading: what the runtime's messages say -----------------------------------------------------


def _pb_pod(pod_id: str = "pod-1", uid: str = "uid-1") -> pb.PodSandbox:
    pod = pb.PodSandbox(
        id=pod_id,
        name="web",
        uid=uid,
        namespace="prod",
        labels={"app": "web"},
        annotations={"a": "b" * 300},
        runtime_handler="runc",
        pid=42,
        ips=["10.0.0.1"],
    )
    pod.linux.cgroup_parent = "/kubepods"
    return pod


def _pb_container(container_id: str = "ctr-1", pod_id: str = "pod-1") -> pb.Container:
    container = pb.Container(
        id=container_id,
        pod_sandbox_id=pod_id,
        name="app",
        state=pb.CONTAINER_RUNNING,
        labels={"l": "v"},
        annotations={"io.kubernetes.container.hash": "abc"},
        args=["sleep", "inf"],
        env=["PATH=/bin", f"DRA_CPUSET_{UID}=1-3", "EMPTY="],
        pid=7,
        created_at=1_700_000_000,
        exit_code=-1,
    )
    container.mounts.add(destination="/data", type="bind", source="/srv", options=["rbind"])
    container.linux.resources.cpu.cpus = "0-63"
    container.linux.resources.memory.limit.value = 1 << 30
    container.hooks.prestart.add(path="/hook", args=["a"])
    container.user.uid = 1000
    return container


def test_read_configure() -> None:
    data = pb.ConfigureRequest(
        config="x",
        runtime_name="containerd",
        runtime_version="v2.3.4",
        registration_timeout=5000,
        request_timeout=2000,
        NRI_version="v0.12.1",
    ).SerializeToString()
    configure = messages.read_configure(data)
    assert (configure.runtime_name, configure.runtime_version, configure.NRI_version) == (
        "containerd",
        "v2.3.4",
        "v0.12.1",
    )
    assert (configure.registration_timeout, configure.request_timeout) == (5000, 2000)
    assert messages.read_configure(b"").request_timeout == 0


def test_read_synchronize_and_translate_its_containers() -> None:
    request = pb.SynchronizeRequest(
        pods=[_pb_pod(), _pb_pod("pod-2", "uid-2")],
        containers=[_pb_container(), _pb_container("ctr-2", "pod-2")],
        more=True,
    )
    part = messages.read_synchronize(request.SerializeToString())
    assert part.more
    containers = messages.synchronized_containers(part.pods, part.containers)
    assert [(c.id, c.pod_uid, c.pod_name, c.pod_namespace, c.name) for c in containers] == [
        ("ctr-1", "uid-1", "web", "prod", "app"),
        ("ctr-2", "uid-2", "web", "prod", "app"),
    ]
    assert containers[0].claims == (ClaimEnv(UID, CpuSet.parse("1-3")),)


@pytest.mark.parametrize("method", sorted(messages.CONTAINER_EVENTS))
def test_read_container_events(method: str) -> None:
    message_type = getattr(pb, f"{method}Request")
    request = message_type(pod=_pb_pod(), container=_pb_container())
    pod, container = messages.read_container_event(method, request.SerializeToString())
    assert pod is not None
    assert (pod.id, pod.uid, pod.name, pod.namespace) == ("pod-1", "uid-1", "web", "prod")
    assert container is not None
    assert container.id == "ctr-1"
    assert messages.read_container_event(method, b"") == (None, None)


def test_read_state_change() -> None:
    event = pb.StateChangeEvent(
        event=pb.REMOVE_CONTAINER, pod=_pb_pod(), container=_pb_container("gone")
    )
    decoded = messages.read_state_change(event.SerializeToString())
    assert decoded.event == api.REMOVE_CONTAINER
    assert decoded.container.id == "gone"


def test_read_update_containers_failed() -> None:
    response = pb.UpdateContainersResponse(failed=[_pb_update(u) for u in UPDATES[:2]])
    assert messages.read_update_containers_failed(response.SerializeToString()) == (
        "ctr-a",
        "ctr-b",
    )
    assert messages.read_update_containers_failed(b"") == ()


def test_a_message_field_sent_twice_merges_like_go() -> None:
    # Concatenated encodings merge (protobuf encoding spec): scalars last-wins, repeated append.
    first = pb.CreateContainerRequest(container=pb.Container(id="a", name="x", env=["A=1"]))
    second = pb.CreateContainerRequest(container=pb.Container(name="y", env=["B=2"]))
    data = first.SerializeToString() + second.SerializeToString()
    _, container = messages.read_container_event("CreateContainer", data)
    assert container is not None
    assert (container.id, container.name, list(container.env)) == ("a", "y", ["A=1", "B=2"])


@pytest.mark.parametrize(
    "data",
    [
        bytes.fromhex("12 05 0a 03 6162"),  # container overruns the request
        bytes.fromhex("12 05 0a 05 616263"),  # id overruns the container
        bytes.fromhex("12 01 08"),  # varint past the container
        bytes.fromhex("12 03 0a 01 ff"),  # id not UTF-8
        bytes.fromhex("0f"),  # field 1, wire type 7
        bytes.fromhex("12 02 0d 01"),  # truncated fixed32
        bytes.fromhex("1b 0801"),  # group never closed
        bytes.fromhex("08 ffffffffffffffffffff01"),  # a varint of 11 bytes
    ],
)
def test_malformed_bytes_are_the_runtimes_fault(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="malformed CreateContainer request"):
        messages.read_container_event("CreateContainer", data)


def test_malformed_synchronize_and_configure() -> None:
    with pytest.raises(RemoteProtocolError, match="malformed Configure"):
        messages.read_configure(bytes.fromhex("12 01 c3"))
    with pytest.raises(RemoteProtocolError, match="malformed Synchronize"):
        messages.read_synchronize(bytes.fromhex("0a 10 0a"))


@settings(max_examples=100)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_fail_cleanly(data: bytes) -> None:
    for read in (
        messages.read_configure,
        messages.read_synchronize,
        messages.read_state_change,
        messages.read_update_containers_failed,
        lambda payload: messages.read_container_event("StopContainer", payload),
    ):
        with contextlib.suppress(RemoteProtocolError):
            read(data)


# Structured garbage: a valid CreateContainerRequest with a few bytes overwritten, inserted or
# cut. Whatever still decodes must translate to a command (or an env error), never crash.
_SEED = pb.CreateContainerRequest(pod=_pb_pod(), container=_pb_container()).SerializeToString()


@settings(max_examples=200)
@given(mutated(_SEED))
def test_mutated_container_events_translate_or_fail_cleanly(data: bytes) -> None:
    try:
        pod, container = messages.read_container_event("CreateContainer", data)
    except RemoteProtocolError:
        return
    if container is not None:
        command = messages.container_command(pod, container)
        assert command.id == container.id


# --- translation to commands ----------------------------------------------------------------------


def test_container_command_reads_claims_from_env() -> None:
    pod = api.PodSandbox(id="sandbox-1", name="web", uid="pod-uid", namespace="prod")
    container = api.Container(
        id="ctr-1",
        pod_sandbox_id="sandbox-1",
        name="app",
        env=["PATH=/bin", f"DRA_CPUSET_{UID}=2-3,34-35"],
    )
    command = messages.container_command(pod, container)
    assert command.id == "ctr-1"
    assert command.pod_uid == "pod-uid"
    assert command.pod_namespace == "prod"
    assert command.pod_name == "web"
    assert command.name == "app"
    assert command.claims == (ClaimEnv(UID, CpuSet.parse("2-3,34-35")),)
    assert command.env_error is None
    assert command.exclusive


def test_container_command_keeps_a_malformed_env_as_an_error() -> None:
    container = api.Container(id="ctr-1", name="app", env=[f"DRA_CPUSET_{UID}=garbage"])
    command = messages.container_command(api.PodSandbox(uid="u"), container)
    assert command.claims == ()
    assert command.env_error is not None
    assert UID in command.env_error


def test_container_command_without_pod() -> None:
    command = messages.container_command(None, api.Container(id="ctr-1", name="app"))
    assert (command.pod_uid, command.pod_name, command.exclusive) == ("", "", False)


def test_synchronized_containers_take_their_pods_identity(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pods = [
        api.PodSandbox(id="s1", name="web", uid="uid-1", namespace="prod"),
        api.PodSandbox(id="s2", name="db", uid="uid-2", namespace="data"),
    ]
    containers = [
        api.Container(id="c1", pod_sandbox_id="s2", name="pg", env=[f"DRA_CPUSET_{OTHER}=4"]),
        api.Container(id="c2", pod_sandbox_id="s1", name="nginx"),
        api.Container(id="c3", pod_sandbox_id="gone", name="orphan"),
    ]
    with caplog.at_level(logging.WARNING, logger="dracpu.adapters.nri_messages"):
        result = messages.synchronized_containers(pods, containers)
    assert [(c.id, c.pod_uid, c.pod_namespace, c.pod_name) for c in result] == [
        ("c1", "uid-2", "data", "db"),
        ("c2", "uid-1", "prod", "web"),
        ("c3", "", "", ""),
    ]
    assert result[0].claims == (ClaimEnv(OTHER, CpuSet.parse("4")),)
    assert "pod sandbox gone" in caplog.text


# --- the runtime's version ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("v0.12.1", Version(0, 12, 1)),
        ("0.12.1", Version(0, 12, 1)),
        ("v2.3.4", Version(2, 3, 4)),
        ("v2.4.0-beta.0", Version(2, 4, 0, release=False)),
        ("v0.12.1-0.20260720101010-abcdef123456", Version(0, 12, 1, release=False)),
        ("v2.3.1-5-gabc123", Version(2, 3, 1)),  # git describe: 5 commits after v2.3.1
        ("v2.3.1-5-gabc123.m", Version(2, 3, 1)),
        ("v0.12.2+incompatible", Version(0, 12, 2)),
        ("0.0.0-unknown", Version(0, 0, 0, release=False)),
        (" v1.2.3 ", Version(1, 2, 3)),
        ("(devel)", None),
        ("", None),
        ("v1.2", None),
        ("v01.2.3", None),
        ("latest", None),
    ],
)
def test_parse_version(text: str, version: Version | None) -> None:
    assert parse_version(text) == version


def test_prereleases_sort_before_their_release() -> None:
    pseudo = parse_version("v0.12.1-0.20260720101010-abcdef123456")
    assert pseudo is not None
    assert not pseudo.at_least((0, 12, 1))
    assert pseudo.at_least((0, 12, 0))
    after = parse_version("v0.12.3-0.20260901000000-abcdef123456")
    assert after is not None
    assert after.at_least((0, 12, 1))


@pytest.mark.parametrize(
    ("name", "version", "nri_version", "supported"),
    [
        # containerd 2.3.0-2.3.4 embed NRI v0.12.0: before containerd/nri#301.
        ("containerd", "v2.3.0", "v0.12.0", False),
        ("containerd", "v2.3.4", "v0.12.0", False),
        ("containerd", "v2.3.5", "v0.12.1", True),
        ("containerd", "2.4.0", "v0.12.2", True),
        ("containerd", "v2.4.0-beta.0", "v0.12.2", True),
        ("containerd", "v2.5.0-12-gdeadbee", "v0.13.0", True),
        ("containerd", "v2.3.5", "v0.12.1-0.20260710000000-0123456789ab", False),
        # Older runtimes do not report their NRI version (field added in NRI v0.12.0).
        ("containerd", "v1.7.30", "", False),
        ("containerd", "v2.1.4", "", False),
        # A containerd older than 2.3 claiming a fixed NRI is a custom build: not trusted.
        ("containerd", "v2.2.9", "v0.12.1", False),
        ("containerd", "devel", "v0.12.1", False),
        ("cri-o", "1.37.0", "v0.12.1", True),
        ("cri-o", "1.36.3", "v0.12.0", False),
        ("cri-o", "1.35.0", "", False),
        ("podman", "5.0.0", "v0.13.0", False),
        ("", "", "v0.13.0", False),
        ("containerd", "v2.4.0", "0.0.0-unknown", False),
        ("containerd", "v2.4.0", "(devel)", False),
    ],
)
def test_unsolicited_updates_gate(
    name: str, version: str, nri_version: str, supported: bool
) -> None:
    configure = api.ConfigureRequest(
        runtime_name=name, runtime_version=version, NRI_version=nri_version
    )
    assert unsolicited_updates_supported(configure) is supported


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ClaimError("spoofed"), Code.FAILED_PRECONDITION),
        (ClaimConflictError("shared claim"), Code.FAILED_PRECONDITION),
        (InsufficientCpusError("empty pool"), Code.FAILED_PRECONDITION),
        (CdiError("malformed env"), Code.FAILED_PRECONDITION),
        (DracpuError("the state owner did not answer"), Code.UNAVAILABLE),
    ],
)
def test_error_status_fails_the_operation(error: DracpuError, code: int) -> None:
    status, text = messages.error_status(error)
    assert status == code
    assert text == f"dra.cpu: {error}"


def test_describe_updates() -> None:
    assert messages.describe_updates(UPDATES[:2]) == "2 containers -> 1-31,33-63"
    assert messages.describe_updates([]) == "0 containers -> nothing"
