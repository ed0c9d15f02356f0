"""The PodResources adapter: what a ``List`` answer says about our claims (answers built with
Google protobuf, read by our betterproto2 messages), and the grpclib client against the grpcio
fake of the kubelet's socket, including every way a call can fail."""

from __future__ import annotations

import threading
import uuid
from concurrent import futures
from typing import Any

import anyio
import grpc
import pytest

from dracpu._gen.podresources import v1 as podres
from dracpu.adapters.pod_resources import (
    ClaimUser,
    PodResourcesClient,
    PodResourcesListing,
    claims_listed,
    claims_shown_by_default,
)
from dracpu.errors import PodResourcesError
from dracpu.sim._pb2.podresources.v1 import api_pb2 as pr
from dracpu.sim.fake_podresources import (
    CachedClaim,
    ClaimDevice,
    KubeletPods,
    PodResourcesServer,
)
from tests.fixtures import scratch_dir

U1 = str(uuid.UUID(int=1, version=4))
U2 = str(uuid.UUID(int=2, version=4))


def ours(uid: str) -> str:
    return f"dra.k8s.io/cpu=claim-{uid}"


def read(answer: pr.ListPodResourcesResponse) -> PodResourcesListing:
    """The answer's bytes (Google protobuf) as our client decodes and reads them."""
    return claims_listed(podres.ListPodResourcesResponse.parse(answer.SerializeToString()))


def reference(
    container: Any, name: str, *devices: tuple[str, list[str]], namespace: str = "ns"
) -> None:
    listed = container.dynamic_resources.add(claim_name=name, claim_namespace=namespace)
    for driver, cdi_ids in devices:
        resource = listed.claim_resources.add(driver_name=driver, pool_name="node-a")
        for cdi_id in cdi_ids:
            resource.cdi_devices.add(name=cdi_id)


# --- reading an answer ---------------------------------------------------------------------------


def test_claims_are_read_by_the_uid_in_our_cdi_device_ids() -> None:
    answer = pr.ListPodResourcesResponse()
    web = answer.pod_resources.add(name="web", namespace="shop")
    app = web.containers.add(name="app", cpu_ids=[3])
    reference(app, "cpus", ("dra.cpu", [ours(U1)]), namespace="shop")
    sidecar = web.containers.add(name="sidecar")
    reference(sidecar, "cpus", ("dra.cpu", [ours(U1)]), namespace="shop")
    reference(sidecar, "gpu", ("gpu.example.com", ["example.com/gpu=g0"]), namespace="shop")
    # Two devices of one claim (individual mode): one ClaimResource each, the same CDI id.
    batch = answer.pod_resources.add(name="batch", namespace="jobs").containers.add(name="main")
    reference(batch, "two", ("dra.cpu", [ours(U2)]), ("dra.cpu", [ours(U2)]), namespace="jobs")
    answer.pod_resources.add(name="plain", namespace="x").containers.add(name="c")

    listing = read(answer)
    assert dict(listing.by_uid) == {
        U1: (ClaimUser("shop", "web", "app"), ClaimUser("shop", "web", "sidecar")),
        U2: (ClaimUser("jobs", "batch", "main"),),
    }
    assert dict(listing.by_name) == {}
    assert (listing.pods, listing.dynamic_resources, listing.reports_claims) == (3, 4, True)


def test_a_claim_of_ours_without_a_readable_cdi_id_is_known_by_its_name() -> None:
    answer = pr.ListPodResourcesResponse()
    main = answer.pod_resources.add(name="p", namespace="ns").containers.add(name="main")
    reference(main, "no-cdi", ("dra.cpu", []))
    reference(main, "not-a-uuid", ("dra.cpu", ["dra.k8s.io/cpu=claim-1234"]))
    reference(main, "other-kind", ("dra.cpu", [f"vendor.example/cpu=claim-{U1}"]))
    listing = read(answer)
    assert dict(listing.by_uid) == {}
    assert set(listing.by_name) == {("ns", "no-cdi"), ("ns", "not-a-uuid"), ("ns", "other-kind")}


def test_other_drivers_claims_count_but_are_not_ours() -> None:
    answer = pr.ListPodResourcesResponse()
    main = answer.pod_resources.add(name="p", namespace="ns").containers.add(name="main")
    # Another driver whose CDI id happens to look like ours is still not ours.
    reference(main, "gpu", ("gpu.example.com", [ours(U1)]))
    listing = read(answer)
    assert (dict(listing.by_uid), dict(listing.by_name)) == ({}, {})
    assert listing.reports_claims


def test_an_answer_without_any_claim_reference_cannot_show_claims() -> None:
    answer = pr.ListPodResourcesResponse()
    answer.pod_resources.add(name="p", namespace="ns").containers.add(name="c", cpu_ids=[1])
    listing = read(answer)
    assert (listing.pods, listing.dynamic_resources, listing.reports_claims) == (1, 0, False)
    assert listing.active == {("ns", "p")}  # the pods are listed whatever the gate
    assert not read(pr.ListPodResourcesResponse()).reports_claims


@pytest.mark.parametrize(
    ("version", "shown"),
    [
        ("v1.34.0", True),  # beta, on by default (kube_features.go)
        ("v1.35.2", True),
        ("v1.36.0", True),
        ("v1.34.1-gke.1200", True),
        ("v1.34.0+k3s1", True),
        (" v1.40.3 ", True),
        ("v2.0.0", True),
        ("v1.33.9", False),  # alpha, off by default
        ("v1.27.0", False),
        ("v1.9.0", False),  # minor versions compare as numbers
        ("", False),
        ("devel", False),
        ("v1", False),
    ],
)
def test_claims_are_listed_by_default_from_kubelet_1_34(version: str, shown: bool) -> None:
    assert claims_shown_by_default(version) is shown


@pytest.mark.parametrize(
    ("wire", "problem"),
    [
        # pod_resources (field 1) sent as a varint: betterproto2 keeps an int in the list.
        (bytes.fromhex("08 01"), "an item of pod_resources is int, not PodResources"),
        # a pod whose containers (field 3) is a varint
        (bytes.fromhex("0a 02 18 01"), "an item of containers is int, not ContainerResources"),
    ],
)
def test_an_answer_of_the_wrong_wire_types_is_refused_as_a_whole(wire: bytes, problem: str) -> None:
    with pytest.raises(PodResourcesError) as info:
        claims_listed(podres.ListPodResourcesResponse.parse(wire))
    assert str(info.value) == f"the kubelet's List answer is malformed: {problem}"


def test_a_driver_name_of_the_wrong_wire_type_is_refused() -> None:
    # ContainerResources.dynamic_resources[0].claim_resources[0].driver_name (field 2) as varint
    claim_resource = bytes.fromhex("10 05")
    dynamic = bytes([0x22, len(claim_resource)]) + claim_resource
    container = bytes([0x2A, len(dynamic)]) + dynamic
    pod = bytes([0x1A, len(container)]) + container
    wire = bytes([0x0A, len(pod)]) + pod
    with pytest.raises(PodResourcesError, match="driver_name is int, not a string"):
        claims_listed(podres.ListPodResourcesResponse.parse(wire))


# --- the client against the grpcio kubelet --------------------------------------------------------


def pods_with_claims() -> KubeletPods:
    pods = KubeletPods()
    pods.claim_prepared(
        CachedClaim("ns", "cpus", U1, "dra.cpu", (ClaimDevice("node-a", "cpudev000", (ours(U1),)),))
    )
    pods.add_pod("ns", "web", {"app": [U1], "log": []})
    pods.add_pod("ns", "idle", {"main": []})
    return pods


@pytest.mark.anyio
async def test_the_client_lists_what_the_kubelet_serves() -> None:
    with scratch_dir("dracpu-podres-") as tmp:
        socket = tmp / "pod-resources" / "kubelet.sock"
        with (
            PodResourcesServer(socket, pods_with_claims()) as server,
            PodResourcesClient(socket) as client,
        ):
            listing = await client.list()
            again = await client.list()  # the same connection, asked again
            server.dynamic_resources = False  # the kubelet's gate off
            blind = await client.list()
        assert dict(listing.by_uid) == {U1: (ClaimUser("ns", "web", "app"),)}
        assert (listing.pods, listing.reports_claims) == (2, True)
        assert again == listing
        assert (blind.pods, blind.reports_claims, dict(blind.by_uid)) == (2, False, {})
        assert [c.code for c in server.calls] == ["OK", "OK", "OK"]


@pytest.mark.anyio
async def test_a_missing_socket_is_an_error_naming_it_and_the_next_call_connects() -> None:
    with scratch_dir("dracpu-podres-") as tmp:
        socket = tmp / "kubelet.sock"
        with PodResourcesClient(socket) as client:
            with pytest.raises(PodResourcesError) as info:
                await client.list()
            assert str(info.value) == f"cannot connect to {socket}: No such file or directory"
            assert info.value.code is None
            with PodResourcesServer(socket, pods_with_claims()):
                assert (await client.list()).reports_claims


@pytest.mark.anyio
async def test_a_socket_nobody_listens_on_refuses() -> None:
    import socket as sockets

    with scratch_dir("dracpu-podres-") as tmp:
        path = tmp / "kubelet.sock"
        with sockets.socket(sockets.AF_UNIX) as stale:
            stale.bind(str(path))  # bound, never listening: what a dead kubelet leaves
            with PodResourcesClient(path) as client, pytest.raises(PodResourcesError) as info:
                await client.list()
        assert str(info.value) == f"cannot connect to {path}: Connection refused"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("RESOURCE_EXHAUSTED", "the kubelet answered RESOURCE_EXHAUSTED: rejected by rate limit"),
        ("UNAVAILABLE", "the kubelet answered UNAVAILABLE: UNAVAILABLE"),
    ],
)
async def test_an_error_status_is_an_error_with_its_code(code: str, expected: str) -> None:
    with scratch_dir("dracpu-podres-") as tmp:
        socket = tmp / "kubelet.sock"
        with (
            PodResourcesServer(socket, pods_with_claims()) as server,
            PodResourcesClient(socket) as client,
        ):
            server.fail(code)
            with pytest.raises(PodResourcesError) as info:
                await client.list()
            assert str(info.value) == f"PodResources List on {socket}: {expected}"
            assert info.value.code == code
            assert (await client.list()).reports_claims  # and the next call works


@pytest.mark.anyio
async def test_the_kubelets_rate_limit_answers_resource_exhausted() -> None:
    with scratch_dir("dracpu-podres-") as tmp:
        socket = tmp / "kubelet.sock"
        with (
            PodResourcesServer(socket, pods_with_claims(), qps=1.0, burst=2) as server,
            PodResourcesClient(socket) as client,
        ):
            await client.list()
            await client.list()
            with pytest.raises(PodResourcesError) as info:
                await client.list()
        assert info.value.code == "RESOURCE_EXHAUSTED"
        assert [c.code for c in server.calls] == ["OK", "OK", "RESOURCE_EXHAUSTED"]


@pytest.mark.anyio
async def test_a_kubelet_without_the_service_answers_unimplemented() -> None:
    with scratch_dir("dracpu-podres-") as tmp:
        socket = tmp / "kubelet.sock"
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # serves nothing
        server.add_insecure_port(f"unix:{socket}")
        server.start()
        try:
            with PodResourcesClient(socket) as client, pytest.raises(PodResourcesError) as info:
                await client.list()
        finally:
            server.stop(None).wait(5)
        assert info.value.code == "UNIMPLEMENTED"


@pytest.mark.anyio
async def test_a_kubelet_that_does_not_answer_times_out() -> None:
    release = threading.Event()
    with scratch_dir("dracpu-podres-") as tmp:
        socket = tmp / "kubelet.sock"
        with PodResourcesServer(socket, pods_with_claims()) as server:

            def stuck() -> pr.ListPodResourcesResponse:
                release.wait(5)
                return pr.ListPodResourcesResponse()

            server.answer = stuck
            try:
                with PodResourcesClient(socket, timeout=0.2) as client:
                    with pytest.raises(PodResourcesError) as info:
                        await client.list()
                    # Whichever side's clock ran out first (grpcio honours our grpc-timeout).
                    assert str(info.value) == (
                        f"PodResources List on {socket}: no answer within 0.2 s"
                    )
                    assert info.value.code == "DEADLINE_EXCEEDED"
            finally:
                release.set()


class _Garbage:
    """An answer whose bytes betterproto2 cannot read (a varint cut short)."""

    def SerializeToString(self) -> bytes:
        return bytes.fromhex("0a 03 1a 01 08")


@pytest.mark.anyio
async def test_an_answer_that_cannot_be_parsed_is_an_error() -> None:
    with scratch_dir("dracpu-podres-") as tmp:
        socket = tmp / "kubelet.sock"
        with PodResourcesServer(socket, pods_with_claims()) as server:
            server.answer = lambda: bytes.fromhex("0a 03 1a 01 08")  # a varint cut short
            with PodResourcesClient(socket) as client, pytest.raises(PodResourcesError) as info:
                await client.list()
    assert str(info.value).startswith("the kubelet's List answer is malformed: EOFError: ")


@pytest.mark.anyio
async def test_a_kubelet_that_goes_away_mid_call_breaks_the_connection() -> None:
    with scratch_dir("dracpu-podres-") as tmp:
        socket = tmp / "kubelet.sock"
        gate = threading.Event()
        server = PodResourcesServer(socket, pods_with_claims())
        server.start()

        def hang() -> pr.ListPodResourcesResponse:
            gate.wait(5)
            return pr.ListPodResourcesResponse()

        server.answer = hang
        try:
            with PodResourcesClient(socket, timeout=5) as client:
                async with anyio.create_task_group() as tg:

                    async def kill() -> None:
                        await anyio.sleep(0.2)
                        await anyio.to_thread.run_sync(server.stop)

                    tg.start_soon(kill)
                    with pytest.raises(PodResourcesError) as info:
                        await client.list()
        finally:
            gate.set()
            server.stop()
        assert info.value.code is None
        assert str(info.value) == (
            f"PodResources List on {socket}: the connection broke: Connection lost"
        )
