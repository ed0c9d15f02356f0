"""NRI message codec: golden bytes, and Google protobuf as the independent peer.

The peer is Google's ``protobuf`` runtime with the NRI descriptors compiled from our
``api.proto`` (:mod:`dracpu.sim._pb2`), which shares no code with :mod:`dracpu.wire.nri`:
what it encodes we must decode, what we encode it must parse back, byte for byte equal to its
deterministic output (which is what Go's ``proto.Marshal`` writes).
"""

from __future__ import annotations

import contextlib

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from dracpu.errors import LocalProtocolError, RemoteProtocolError
from dracpu.sim._pb2.nri.v1alpha1 import api_pb2 as pb
from dracpu.wire import nri
from dracpu.wire.nri import (
    ConfigureRequest,
    Container,
    ContainerEvent,
    CpusetUpdate,
    Event,
    Pod,
    StateChangeEvent,
    SynchronizeRequest,
)
from tests.wire.mutation import mutated

# --- golden vectors (reference/nri-ttrpc-cdi.md §4.2) ---------------------------------------------


def test_subscribed_mask_is_create_update_stop_remove_0x688() -> None:
    assert nri.SUBSCRIBED_EVENT_MASK == 0x688
    assert nri.event_mask([Event.CREATE_CONTAINER]) == 0x8
    assert nri.event_mask([Event.REMOVE_CONTAINER]) == 0x400
    assert nri.SUBSCRIBED_EVENT_MASK & ~0x7FF == 0  # valid on runtimes before NRI v0.10


def test_event_mask_refuses_non_events() -> None:
    with pytest.raises(LocalProtocolError, match="subscribe"):
        nri.event_mask([Event.UNKNOWN])
    with pytest.raises(LocalProtocolError):
        nri.event_mask([15])


def test_configure_response_golden() -> None:
    assert nri.encode_configure_response(0x688) == bytes.fromhex("10880d")


def test_create_container_response_golden() -> None:
    golden = bytes.fromhex("0a0b3209120712053203322d33")
    assert nri.encode_create_container_response("2-3") == golden


def test_register_plugin_request_golden() -> None:
    assert nri.encode_register_plugin_request("dra-cpu", "90") == bytes.fromhex(
        "0a076472612d637075120239 30".replace(" ", "")
    )
    ours = nri.encode_register_plugin_request("dra.cpu", "00", "v0.12.2")
    assert ours == pb.RegisterPluginRequest(
        plugin_name="dra.cpu", plugin_idx="00", NRI_version="v0.12.2"
    ).SerializeToString(deterministic=True)


# --- encoding: Google protobuf reads what we write, and writes the same bytes ---------------------


def _pb_update(update: CpusetUpdate) -> pb.ContainerUpdate:
    message = pb.ContainerUpdate(container_id=update.container_id)
    cpu = message.linux.resources.cpu
    cpu.cpus = update.cpus
    cpu.mems = update.mems
    return message


UPDATES = [
    CpusetUpdate("ctr-a", "1-31,33-63"),
    CpusetUpdate("ctr-b", "1-31,33-63"),
    CpusetUpdate("ctr-c", "2-5", "0"),
    CpusetUpdate("ctr-é", "7", "0-1"),
]


def test_create_container_response_matches_protobuf() -> None:
    ours = nri.encode_create_container_response("2-5,34-37", "0,1", UPDATES)
    peer = pb.CreateContainerResponse(update=[_pb_update(u) for u in UPDATES])
    peer.adjust.linux.resources.cpu.cpus = "2-5,34-37"
    peer.adjust.linux.resources.cpu.mems = "0,1"
    assert ours == peer.SerializeToString(deterministic=True)
    parsed = pb.CreateContainerResponse.FromString(ours)
    assert parsed.adjust.linux.resources.cpu.cpus == "2-5,34-37"
    assert [u.container_id for u in parsed.update] == ["ctr-a", "ctr-b", "ctr-c", "ctr-é"]
    assert not any(u.ignore_failure for u in parsed.update)


@pytest.mark.parametrize(
    ("encode", "message_type"),
    [
        (nri.encode_update_container_response, pb.UpdateContainerResponse),
        (nri.encode_stop_container_response, pb.StopContainerResponse),
        (nri.encode_update_containers_request, pb.UpdateContainersRequest),
        (nri.encode_synchronize_response, pb.SynchronizeResponse),
    ],
)
def test_update_lists_match_protobuf(encode: object, message_type: type) -> None:
    assert callable(encode)
    ours = encode(UPDATES)
    peer = message_type(update=[_pb_update(u) for u in UPDATES])
    assert ours == peer.SerializeToString(deterministic=True)


def test_synchronize_response_more() -> None:
    ours = nri.encode_synchronize_response(more=True)
    assert ours == pb.SynchronizeResponse(more=True).SerializeToString(deterministic=True)
    assert ours == b"\x10\x01"
    assert nri.encode_synchronize_response() == b""


def test_empty_cpus_is_never_encoded() -> None:
    with pytest.raises(LocalProtocolError, match="empty cpuset for ctr-x"):
        nri.encode_stop_container_response([CpusetUpdate("ctr-x", "")])
    with pytest.raises(LocalProtocolError, match="empty cpuset"):
        nri.encode_create_container_response("", "0")
    with pytest.raises(LocalProtocolError, match="container id"):
        nri.encode_update_containers_request([CpusetUpdate("", "1")])


def test_configure_response_range() -> None:
    assert nri.encode_configure_response(0) == b""
    with pytest.raises(LocalProtocolError):
        nri.encode_configure_response(1 << 31)


# --- decoding: we read what Google protobuf writes ------------------------------------------------


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
        env=["PATH=/bin", "DRA_CPUSET_x=1-3", "EMPTY="],
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


def test_decode_configure_request() -> None:
    data = pb.ConfigureRequest(
        config="x",
        runtime_name="containerd",
        runtime_version="v2.3.4",
        registration_timeout=5000,
        request_timeout=2000,
        NRI_version="v0.12.1",
    ).SerializeToString()
    assert nri.decode_configure_request(data) == ConfigureRequest(
        "x", "containerd", "v2.3.4", 5000, 2000, "v0.12.1"
    )
    assert nri.decode_configure_request(b"") == ConfigureRequest()


def test_decode_synchronize_request_reads_only_what_it_needs() -> None:
    request = pb.SynchronizeRequest(
        pods=[_pb_pod(), _pb_pod("pod-2", "uid-2")],
        containers=[_pb_container(), _pb_container("ctr-2", "pod-2")],
        more=True,
    )
    decoded = nri.decode_synchronize_request(request.SerializeToString())
    assert decoded == SynchronizeRequest(
        pods=(Pod("pod-1", "web", "uid-1", "prod"), Pod("pod-2", "web", "uid-2", "prod")),
        containers=(
            Container("ctr-1", "pod-1", "app", 3, ("PATH=/bin", "DRA_CPUSET_x=1-3", "EMPTY=")),
            Container("ctr-2", "pod-2", "app", 3, ("PATH=/bin", "DRA_CPUSET_x=1-3", "EMPTY=")),
        ),
        more=True,
    )


@pytest.mark.parametrize(
    "message_type",
    [
        pb.CreateContainerRequest,
        pb.UpdateContainerRequest,
        pb.StopContainerRequest,
        pb.RemoveContainerRequest,
        pb.PostCreateContainerRequest,
    ],
)
def test_decode_container_events(message_type: type) -> None:
    request = message_type(pod=_pb_pod(), container=_pb_container())
    if message_type is pb.UpdateContainerRequest:
        request.linux_resources.cpu.cpus = "4-5"
    decoded = nri.decode_container_event(request.SerializeToString())
    assert decoded.pod == Pod("pod-1", "web", "uid-1", "prod")
    assert decoded.container is not None
    assert decoded.container.id == "ctr-1"
    assert nri.decode_container_event(b"") == ContainerEvent(None, None)


def test_decode_state_change_event() -> None:
    event = pb.StateChangeEvent(
        event=pb.REMOVE_CONTAINER, pod=_pb_pod(), container=_pb_container("gone")
    )
    decoded = nri.decode_state_change_event(event.SerializeToString())
    assert decoded.event == Event.REMOVE_CONTAINER
    assert decoded.container is not None
    assert decoded.container.id == "gone"
    pod_event = pb.StateChangeEvent(event=pb.RUN_POD_SANDBOX, pod=_pb_pod())
    assert nri.decode_state_change_event(pod_event.SerializeToString()) == StateChangeEvent(
        Event.RUN_POD_SANDBOX, Pod("pod-1", "web", "uid-1", "prod"), None
    )


def test_decode_update_containers_response() -> None:
    response = pb.UpdateContainersResponse(
        failed=[_pb_update(CpusetUpdate("a", "1")), _pb_update(CpusetUpdate("b", "2"))]
    )
    assert nri.decode_update_containers_response(response.SerializeToString()) == ("a", "b")
    assert nri.decode_update_containers_response(b"") == ()


def test_a_message_field_sent_twice_merges_like_protobuf() -> None:
    # Concatenated encodings merge (protobuf encoding spec): scalars last-wins, repeated append.
    first = pb.CreateContainerRequest(container=pb.Container(id="a", name="x", env=["A=1"]))
    second = pb.CreateContainerRequest(container=pb.Container(name="y", env=["B=2"]))
    data = first.SerializeToString() + second.SerializeToString()
    peer = pb.CreateContainerRequest.FromString(data)
    decoded = nri.decode_container_event(data)
    assert decoded.container == Container(
        peer.container.id, "", peer.container.name, 0, tuple(peer.container.env)
    )
    assert decoded.container == Container("a", "", "y", 0, ("A=1", "B=2"))


def test_unknown_fields_wire_types_and_groups_are_skipped() -> None:
    container = pb.Container(id="c", env=["K=V"]).SerializeToString()
    extra = (
        bytes.fromhex("f8ff03 05")  # field 65535 varint 5 (multi-byte tag)
        + bytes.fromhex("0d 01020304")  # field 1 as fixed32: a known field of another type
        + bytes.fromhex("11 0102030405060708")  # field 2 fixed64
        + bytes.fromhex("4b 0801 5b 0802 5c 4c")  # group 9 { 1: 1, group 11 { 1: 2 } }
        + bytes.fromhex("08 2a")  # field 1 (id) as varint: another wire type, skipped
    )
    request = bytes.fromhex("12") + bytes((len(container) + len(extra),)) + container + extra
    decoded = nri.decode_container_event(request)
    assert decoded.container == Container("c", "", "", 0, ("K=V",))
    peer = pb.CreateContainerRequest.FromString(request).container
    assert decoded.container == Container(
        peer.id, peer.pod_sandbox_id, peer.name, peer.state, tuple(peer.env)
    )


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (bytes.fromhex("12 05 0a 03 6162"), "declares 5 bytes"),  # container overruns request
        (bytes.fromhex("12 05 0a 05 616263"), "declares 5 bytes, 3 remain"),  # id overruns
        (bytes.fromhex("12 02 0a 01"), "declares 1 bytes"),
        (bytes.fromhex("12 01 08"), "truncated varint|overruns"),  # varint past the container
        (bytes.fromhex("12 03 0a 01 ff"), "UTF-8"),
        (bytes.fromhex("0f"), "bad wire type"),  # field 1, wire type 7
        (bytes.fromhex("00"), "invalid field number"),
        (bytes.fromhex("12 02 0d 01"), "truncated fixed"),
        (bytes.fromhex("1b 0801"), "not closed"),
        (bytes.fromhex("1b 24"), "does not match"),
        (bytes.fromhex("08 ffffffffffffffffff02"), "overflows"),
    ],
)
def test_malformed_bytes_are_the_runtimes_fault(data: bytes, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        nri.decode_container_event(data)


def test_malformed_synchronize_and_configure() -> None:
    with pytest.raises(RemoteProtocolError, match="UTF-8"):
        nri.decode_configure_request(bytes.fromhex("12 01 c3"))
    with pytest.raises(RemoteProtocolError):
        nri.decode_synchronize_request(bytes.fromhex("0a 10 0a"))


# --- properties -----------------------------------------------------------------------------------

_text = st.text(max_size=12)
_env = st.lists(_text, max_size=4)


@settings(max_examples=60)
@given(
    container_id=_text,
    pod_id=_text,
    name=_text,
    state=st.integers(min_value=0, max_value=4),
    env=_env,
    uid=_text,
)
def test_container_event_round_trip_against_protobuf(
    container_id: str, pod_id: str, name: str, state: int, env: list[str], uid: str
) -> None:
    request = pb.CreateContainerRequest(
        pod=pb.PodSandbox(id=pod_id, uid=uid, labels={"k": name}),
        container=pb.Container(
            id=container_id,
            pod_sandbox_id=pod_id,
            name=name,
            state=pb.ContainerState.Name(state),
            env=env,
        ),
    )
    decoded = nri.decode_container_event(request.SerializeToString())
    assert decoded.pod == Pod(pod_id, "", uid, "")
    assert decoded.container == Container(container_id, pod_id, name, state, tuple(env))


_cpus = st.from_regex(r"[0-9]{1,3}(-[0-9]{1,3})?(,[0-9]{1,3})*", fullmatch=True)


@settings(max_examples=60)
@given(
    st.lists(
        st.builds(CpusetUpdate, st.text(min_size=1, max_size=70), _cpus, st.just("") | _cpus),
        max_size=20,
    )
)
def test_update_list_bytes_equal_protobuf(updates: list[CpusetUpdate]) -> None:
    ours = nri.encode_update_containers_request(updates)
    peer = pb.UpdateContainersRequest(update=[_pb_update(u) for u in updates])
    assert ours == peer.SerializeToString(deterministic=True)


@settings(max_examples=100)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_fail_cleanly(data: bytes) -> None:
    for decode in (
        nri.decode_container_event,
        nri.decode_synchronize_request,
        nri.decode_configure_request,
        nri.decode_state_change_event,
        nri.decode_update_containers_response,
    ):
        with contextlib.suppress(RemoteProtocolError):
            decode(data)


# Structured garbage: a valid CreateContainerRequest (pod, container with env and nested
# messages), then a few bytes overwritten, inserted or cut. Random bytes alone almost never reach
# the nested PodSandbox/Container decoding; these do, and often still parse.
_SEED = pb.CreateContainerRequest(
    pod=pb.PodSandbox(id="p1", name="web", uid="u1", namespace="ns", labels={"a": "b"}),
    container=pb.Container(
        id="c1",
        pod_sandbox_id="p1",
        name="app",
        state=pb.ContainerState.CONTAINER_RUNNING,
        env=["PATH=/bin", "DRA_CPUSET_x=1-3"],
        linux=pb.LinuxContainer(resources=pb.LinuxResources(cpu=pb.LinuxCPU(cpus="0-3"))),
    ),
).SerializeToString()


@settings(max_examples=300)
@given(mutated(_SEED))
def test_mutated_container_events_decode_like_protobuf_or_fail_cleanly(data: bytes) -> None:
    try:
        peer = pb.CreateContainerRequest.FromString(data)
    except DecodeError:  # Google rejected it: we may reject it too, or be lazier
        with contextlib.suppress(RemoteProtocolError):
            nri.decode_container_event(data)
        return
    # Google accepted it: so must we, with the same values for the fields we read.
    decoded = nri.decode_container_event(data)
    if peer.HasField("pod"):
        p = peer.pod
        assert decoded.pod == Pod(p.id, p.name, p.uid, p.namespace)
    else:
        assert decoded.pod is None
    if peer.HasField("container"):
        c = peer.container
        expected = Container(c.id, c.pod_sandbox_id, c.name, c.state, tuple(c.env))
        assert decoded.container == expected
    else:
        assert decoded.container is None
