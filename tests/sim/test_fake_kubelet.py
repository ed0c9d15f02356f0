"""The fake kubelet: against our real sockets, and against a scripted grpcio plugin.

Against dracpu's registration and DRA sockets (with the real state owner of
``tests.tasks.test_kubelet_plugin``) it registers the way the kubelet does and prepares claims
over the version it negotiated or the one asked for. Against a plugin scripted here with
grpcio's own server (so every answer can be wrong on purpose) it applies the kubelet's checks:
plugin type, versions, endpoint, and the per-call answer map.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import grpc
import pytest

from dracpu.core.cpuset import CpuSet
from dracpu.sim.fake_kubelet import (
    ClaimRef,
    Device,
    DeviceHealthReport,
    FakeKubelet,
    FakeKubeletError,
    KubeletCallError,
    PrepareResult,
    RegistrationRefused,
)
from dracpu.sim.fake_podresources import KubeletPods, PodResourcesServer
from dracpu.tasks import registration
from dracpu.tasks.http import Readiness
from dracpu.tasks.registration import RegistrationState
from tests.peers import load_pb2
from tests.tasks.test_kubelet_plugin import (
    NODE,
    FakeClaims,
    RunningNode,
    claim_object,
    grouped_result,
    running_node,
)

__all__: list[str] = []

G_REG = load_pb2("pluginregistration/v1/api.proto")
G_V1 = load_pb2("dra/v1/api.proto")
G_HEALTH = load_pb2("dra_health/v1/api.proto")


# --- against dracpu -----------------------------------------------------------------------------


@dataclass
class Daemon:
    node: RunningNode
    registry: Path
    state: RegistrationState
    readiness: Readiness


@asynccontextmanager
async def daemon(
    tmp_path: Path, claims: FakeClaims, *, endpoint: Path | None = None
) -> AsyncIterator[Daemon]:
    """DRA socket first, then the registration socket, as the daemon starts them."""
    registry = tmp_path / "kubelet" / "plugins_registry"
    readiness = Readiness()
    flag = readiness.flag("registration")
    async with running_node(tmp_path, claims) as node, anyio.create_task_group() as tg:
        state = await tg.start(
            partial(
                registration.run,
                registry / "dra.cpu-reg.sock",
                node.socket if endpoint is None else endpoint,
                flag,
            )
        )
        flag.set_ready()
        yield Daemon(node, registry, state, readiness)
        tg.cancel_scope.cancel()


def _ref(obj: dict[str, Any]) -> ClaimRef:
    meta = obj["metadata"]
    return ClaimRef(meta["namespace"], meta["uid"], meta["name"])


@pytest.mark.anyio
async def test_registers_with_dracpu_and_prepares_over_both_versions(tmp_path: Path) -> None:
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result("cpudevnuma001", "2", share_id="s1")])
    claims.add(obj)
    ref = _ref(obj)
    async with daemon(tmp_path, claims) as d:
        with FakeKubelet(d.registry) as kubelet:
            found = await kubelet.await_socket(within=10)
            assert found == d.registry / "dra.cpu-reg.sock"
            reg = await kubelet.aregister()
            await d.state.wait_notified()

            assert (reg.driver, reg.endpoint, reg.version) == ("dra.cpu", d.node.socket, "v1")
            assert reg.supported_versions == (
                "v1.DRAPlugin",
                "v1beta1.DRAPlugin",
                "v1.DRAResourceHealth",
                "v1alpha1.DRAResourceHealth",
            )
            assert d.state.registered
            assert d.readiness.is_ready()
            assert kubelet.registrations() == {"dra.cpu": reg}

            first = await kubelet.aprepare([ref])
            cdi = (f"dra.k8s.io/cpu=claim-{ref.uid}", f"dra.cpu/metadata={ref.uid}_cpu")
            assert first == {
                ref.uid: PrepareResult(
                    devices=(Device(("cpu",), NODE, "cpudevnuma001", cdi, "s1"),)
                )
            }
            beta = await kubelet.aprepare([ref], version="v1beta1")
            assert beta == {
                ref.uid: PrepareResult(devices=(Device(("cpu",), NODE, "cpudevnuma001", cdi),))
            }
            assert d.node.spec_env(ref.uid) is not None

            assert await kubelet.aunprepare([ref], version="v1beta1") == {ref.uid: ""}
            assert await kubelet.aunprepare([ref]) == {ref.uid: ""}
            assert d.node.spec_env(ref.uid) is None
            assert d.node.checkpointed() == {}


@pytest.mark.anyio
async def test_old_kubelet_negotiates_v1beta1(tmp_path: Path) -> None:
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result("cpudevnuma000", "1")])
    claims.add(obj)
    async with daemon(tmp_path, claims) as d:
        with FakeKubelet(d.registry, services=("v1beta1.DRAPlugin",)) as kubelet:
            reg = await kubelet.aregister()
            assert reg.version == "v1beta1"
            [result] = (await kubelet.aprepare([_ref(obj)])).values()
            assert result.error == ""
            assert result.devices[0].share_id is None


@pytest.mark.anyio
async def test_watches_dracpu_s_device_health_in_both_versions(tmp_path: Path) -> None:
    async with daemon(tmp_path, FakeClaims()) as d:
        board = d.node.owner.health
        board.set_devices(d.node.config.devices.values())
        with FakeKubelet(d.registry) as kubelet:
            reg = await kubelet.aregister()
            assert reg.health_version == "v1"  # advertised both: the kubelet picks v1
            with kubelet.watch_health() as v1, kubelet.watch_health(version="v1alpha1") as alpha:
                assert (v1.version, alpha.version) == ("v1", "v1alpha1")
                for watch in (v1, alpha):
                    first = await watch.anext()
                    assert first is not None
                    assert [(d.pool_name, d.health) for d in first.devices] == [
                        (NODE, "HEALTHY")
                    ] * 4
                board.set_online(CpuSet(range(64)) - CpuSet([0]))
                for watch in (v1, alpha):
                    changed = await watch.anext()
                    assert changed is not None
                    assert changed.unhealthy() == {"cpudevnuma000": "cpu 0 is offline"}


@pytest.mark.anyio
async def test_kubelet_without_a_common_version_refuses_and_tells_the_plugin(
    tmp_path: Path,
) -> None:
    async with daemon(tmp_path, FakeClaims()) as d:
        with FakeKubelet(d.registry, services=("v1alpha4.DRAPlugin",)) as kubelet:
            with pytest.raises(RegistrationRefused, match="none of services supported"):
                await kubelet.aregister()
            await d.state.wait_notified()
            assert kubelet.registrations() == {}
        assert not d.state.registered
        assert "none of services supported by the plugin" in d.state.error
        assert not d.readiness.is_ready()
        assert "kubelet registration failed: none of services" in d.readiness.report()

        # the kubelet retries later with a newer version: registered, ready again
        with FakeKubelet(d.registry) as kubelet:
            await kubelet.aregister()
        await d.state.wait_notified(2)
        assert d.readiness.is_ready()


@pytest.mark.anyio
async def test_endpoint_that_is_not_a_socket_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "dra.sock"
    async with daemon(tmp_path, FakeClaims(), endpoint=missing) as d:
        refused = pytest.raises(RegistrationRefused, match=f"endpoint {missing} of dra.cpu")
        with FakeKubelet(d.registry) as kubelet, refused:
            await kubelet.aregister()
        await d.state.wait_notified()
        assert not d.readiness.is_ready()


# --- against a scripted grpcio plugin -----------------------------------------------------------


@dataclass
class ScriptedPlugin:
    """A DRA plugin written with grpcio's server: answers what the test says."""

    info: Any
    prepare: Callable[[Any], Any] = field(
        default=lambda request: G_V1.NodePrepareResourcesResponse()
    )
    notified: list[tuple[bool, str]] = field(default_factory=list)
    health_lists: list[Any] = field(default_factory=list)  # v1 NodeWatchResourcesResponses
    health_end: grpc.StatusCode | None = None  # how the health stream ends (None: OK)

    def handlers(self) -> list[Any]:
        registration_service = grpc.method_handlers_generic_handler(
            "pluginregistration.Registration",
            {
                "GetInfo": grpc.unary_unary_rpc_method_handler(
                    lambda request, context: self.info,
                    request_deserializer=G_REG.InfoRequest.FromString,
                    response_serializer=G_REG.PluginInfo.SerializeToString,
                ),
                "NotifyRegistrationStatus": grpc.unary_unary_rpc_method_handler(
                    self._notify,
                    request_deserializer=G_REG.RegistrationStatus.FromString,
                    response_serializer=G_REG.RegistrationStatusResponse.SerializeToString,
                ),
            },
        )
        dra_service = grpc.method_handlers_generic_handler(
            "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
            {
                "NodePrepareResources": grpc.unary_unary_rpc_method_handler(
                    lambda request, context: self.prepare(request),
                    request_deserializer=G_V1.NodePrepareResourcesRequest.FromString,
                    response_serializer=G_V1.NodePrepareResourcesResponse.SerializeToString,
                ),
            },
        )
        health_service = grpc.method_handlers_generic_handler(
            "v1.DRAResourceHealth",
            {
                "NodeWatchResources": grpc.unary_stream_rpc_method_handler(
                    self._watch,
                    request_deserializer=G_HEALTH.NodeWatchResourcesRequest.FromString,
                    response_serializer=G_HEALTH.NodeWatchResourcesResponse.SerializeToString,
                ),
            },
        )
        return [registration_service, dra_service, health_service]

    def _watch(self, request: Any, context: Any) -> Iterator[Any]:
        yield from self.health_lists
        if self.health_end is not None:
            context.abort(self.health_end, "the scripted plugin gives up")

    def _notify(self, request: Any, context: Any) -> Any:
        self.notified.append((request.plugin_registered, request.error))
        return G_REG.RegistrationStatusResponse()


@contextmanager
def scripted(registry: Path, plugin: ScriptedPlugin) -> Iterator[Path]:
    """Serve ``plugin`` on ``<registry>/plugin-reg.sock`` (registration and DRA on one socket)."""
    registry.mkdir(parents=True, exist_ok=True)
    path = registry / "plugin-reg.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(plugin.handlers())
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        yield path
    finally:
        server.stop(None).wait()


def _info(**fields: Any) -> Any:
    values: dict[str, Any] = {
        "type": "DRAPlugin",
        "name": "example.com",
        "endpoint": "",
        "supported_versions": ["v1.DRAPlugin"],
    }
    values.update(fields)
    return G_REG.PluginInfo(**values)


@pytest.mark.parametrize(
    ("info", "message"),
    [
        (_info(type="CSIPlugin"), "no handler registered for plugin type: CSIPlugin"),
        (_info(name=""), "plugin name is empty"),
        (_info(supported_versions=[]), "empty list of supported gRPC services"),
        (_info(supported_versions=["v1alpha4.DRAPlugin"]), "none of services supported"),
        (_info(endpoint="/nonexistent/dra.sock"), "endpoint /nonexistent/dra.sock"),
    ],
)
def test_registration_checks(tmp_path: Path, info: Any, message: str) -> None:
    plugin = ScriptedPlugin(info)
    with scripted(tmp_path / "registry", plugin), FakeKubelet(tmp_path / "registry") as kubelet:
        with pytest.raises(RegistrationRefused, match=message):
            kubelet.register()
        assert kubelet.registrations() == {}
    assert len(plugin.notified) == 1
    assert plugin.notified[0][0] is False
    assert message.split(":")[0] in plugin.notified[0][1]


def test_empty_endpoint_means_the_registration_socket_and_plugin_order_wins(
    tmp_path: Path,
) -> None:
    plugin = ScriptedPlugin(
        _info(
            supported_versions=["v1alpha1.DRAResourceHealth", "v1beta1.DRAPlugin", "v1.DRAPlugin"]
        )
    )
    with scripted(tmp_path / "registry", plugin) as path, FakeKubelet(path.parent) as kubelet:
        reg = kubelet.register()
    assert (reg.endpoint, reg.version) == (path, "v1beta1")
    assert plugin.notified == [(True, "")]


@pytest.mark.parametrize(
    ("advertised", "chosen"),
    [
        (["v1.DRAPlugin", "v1alpha1.DRAResourceHealth", "v1.DRAResourceHealth"], "v1"),
        (["v1.DRAPlugin", "v1alpha1.DRAResourceHealth"], "v1alpha1"),
        (["v1.DRAPlugin", "v1.DRAResourceHealth"], "v1"),
        (["v1.DRAPlugin"], None),
    ],
)
def test_health_service_is_v1_over_v1alpha1_whatever_the_order(
    tmp_path: Path, advertised: list[str], chosen: str | None
) -> None:
    plugin = ScriptedPlugin(_info(supported_versions=advertised))
    with scripted(tmp_path / "registry", plugin), FakeKubelet(tmp_path / "registry") as kubelet:
        assert kubelet.register().health_version == chosen
        if chosen is None:
            with pytest.raises(FakeKubeletError, match="advertised no health service"):
                kubelet.watch_health()


def _health_list(*devices: tuple[str, Any, str]) -> Any:
    return G_HEALTH.NodeWatchResourcesResponse(
        devices=[
            G_HEALTH.DeviceHealth(
                device=G_HEALTH.DeviceIdentifier(pool_name="pool", device_name=name),
                health=health,
                last_updated_time=7,
                health_check_timeout_seconds=30,
                message=message,
            )
            for name, health, message in devices
        ]
    )


@pytest.mark.parametrize("end", [None, grpc.StatusCode.UNAVAILABLE])
def test_health_watch_hands_over_every_list_then_how_the_stream_ended(
    tmp_path: Path, end: grpc.StatusCode | None
) -> None:
    plugin = ScriptedPlugin(
        _info(supported_versions=["v1.DRAPlugin", "v1.DRAResourceHealth"]),
        health_lists=[
            _health_list(("a", G_HEALTH.HEALTHY, "")),
            _health_list(("a", G_HEALTH.UNHEALTHY, "broken"), ("b", G_HEALTH.UNKNOWN, "")),
        ],
        health_end=end,
    )
    with scripted(tmp_path / "registry", plugin), FakeKubelet(tmp_path / "registry") as kubelet:
        kubelet.register()
        with kubelet.watch_health() as watch:
            first, second = watch.next(), watch.next()
            assert first is not None
            assert second is not None
            assert first.devices == (DeviceHealthReport("pool", "a", "HEALTHY", 7, 30, ""),)
            assert second.health() == {"a": "UNHEALTHY", "b": "UNKNOWN"}
            assert second.unhealthy() == {"a": "broken"}
            if end is None:
                assert watch.next() is None
                assert watch.next() is None  # and stays ended
            else:
                with pytest.raises(KubeletCallError, match="UNAVAILABLE: the scripted") as info:
                    watch.next()
                assert info.value.code == "UNAVAILABLE"


def test_a_health_stream_ended_before_any_list_is_none(tmp_path: Path) -> None:
    plugin = ScriptedPlugin(_info(supported_versions=["v1.DRAPlugin", "v1.DRAResourceHealth"]))
    with scripted(tmp_path / "registry", plugin), FakeKubelet(tmp_path / "registry") as kubelet:
        kubelet.register()
        with kubelet.watch_health() as watch:
            assert watch.next() is None  # the scripted stream sends nothing and ends OK


def _answer(claims: dict[str, Any]) -> Callable[[Any], Any]:
    def prepare(request: Any) -> Any:
        return G_V1.NodePrepareResourcesResponse(claims=claims)

    return prepare


def test_answer_missing_a_claim_is_a_call_error(tmp_path: Path) -> None:
    a, b = (ClaimRef("ns", str(uuid.uuid4()), name) for name in ("a", "b"))
    plugin = ScriptedPlugin(_info(), _answer({a.uid: G_V1.NodePrepareResourceResponse()}))
    with scripted(tmp_path / "registry", plugin), FakeKubelet(tmp_path / "registry") as kubelet:
        kubelet.register()
        assert kubelet.prepare([a]) == {a.uid: PrepareResult()}
        with pytest.raises(KubeletCallError, match="skipped 1 ResourceClaims"):
            kubelet.prepare([a, b])


def test_answer_for_an_unknown_claim_is_a_call_error(tmp_path: Path) -> None:
    a = ClaimRef("ns", str(uuid.uuid4()), "a")
    stranger = str(uuid.uuid4())
    plugin = ScriptedPlugin(
        _info(),
        _answer(
            {
                a.uid: G_V1.NodePrepareResourceResponse(),
                stranger: G_V1.NodePrepareResourceResponse(),
            }
        ),
    )
    with scripted(tmp_path / "registry", plugin), FakeKubelet(tmp_path / "registry") as kubelet:
        kubelet.register()
        with pytest.raises(KubeletCallError, match=f"unknown claim UID {stranger}"):
            kubelet.prepare([a])


def test_grpc_error_carries_its_code(tmp_path: Path) -> None:
    a = ClaimRef("ns", str(uuid.uuid4()), "a")
    plugin = ScriptedPlugin(_info(supported_versions=["v1beta1.DRAPlugin"]))
    with scripted(tmp_path / "registry", plugin), FakeKubelet(tmp_path / "registry") as kubelet:
        kubelet.register()  # the scripted plugin serves only v1
        with pytest.raises(KubeletCallError) as info:
            kubelet.prepare([a])
    assert info.value.code == "UNIMPLEMENTED"


# --- discovery ----------------------------------------------------------------------------------


def test_discovery_ignores_dot_files_and_non_sockets_and_walks_subdirs(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    (registry / "sub").mkdir(parents=True)
    (registry / "plain-file.sock").write_text("")
    held = []
    for rel in (".hidden.sock", "b-reg.sock", "sub/a-reg.sock"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(registry / rel))
        held.append(sock)
    try:
        kubelet = FakeKubelet(registry)
        assert kubelet.sockets() == [registry / "b-reg.sock", registry / "sub" / "a-reg.sock"]
        with pytest.raises(FakeKubeletError, match="expected one plugin socket"):
            kubelet.register()
    finally:
        for sock in held:
            sock.close()


def test_wait_for_socket_times_out_with_a_clear_error(tmp_path: Path) -> None:
    kubelet = FakeKubelet(tmp_path / "missing")
    assert kubelet.sockets() == []
    with pytest.raises(FakeKubeletError, match="no plugin socket appeared"):
        kubelet.wait_for_socket(0.05)


def test_calls_need_a_registered_driver(tmp_path: Path) -> None:
    with (
        FakeKubelet(tmp_path) as kubelet,
        pytest.raises(FakeKubeletError, match="0 are registered"),
    ):
        kubelet.prepare([ClaimRef("ns", str(uuid.uuid4()), "a")])


# --- PodResources ---------------------------------------------------------------------------------

G_PODRES = load_pb2("podresources/v1/api.proto")


def _list(socket_path: Path) -> Any:
    """One ``List`` with a plain grpcio client (the fake's own peer, not dracpu's client)."""
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        call = channel.unary_unary(
            "/v1.PodResourcesLister/List",
            request_serializer=G_PODRES.ListPodResourcesRequest.SerializeToString,
            response_deserializer=G_PODRES.ListPodResourcesResponse.FromString,
        )
        return call(G_PODRES.ListPodResourcesRequest(), timeout=5)


def _claims_of(answer: Any) -> dict[tuple[str, str], list[tuple[str, str, list[str]]]]:
    return {
        (pod.name, container.name): [
            (d.claim_name, r.driver_name, [c.name for c in r.cdi_devices])
            for d in container.dynamic_resources
            for r in d.claim_resources
        ]
        for pod in answer.pod_resources
        for container in pod.containers
    }


@pytest.mark.anyio
async def test_pod_resources_lists_the_pods_claims_that_dracpu_prepared(tmp_path: Path) -> None:
    claims = FakeClaims()
    obj = claim_object("a", [grouped_result("cpudevnuma001", "2", share_id="s1")])
    claims.add(obj)
    ref = _ref(obj)
    cdi = f"dra.k8s.io/cpu=claim-{ref.uid}"
    metadata = f"dra.cpu/metadata={ref.uid}_cpu"  # the request's device metadata (KEP-5304)
    async with daemon(tmp_path, claims) as d:
        with FakeKubelet(d.registry) as kubelet:
            server = kubelet.serve_pod_resources()
            assert server.socket == d.registry.parent / "pod-resources" / "kubelet.sock"
            await kubelet.aregister()
            kubelet.pods.add_pod(ref.namespace, "web", {"app": [ref.uid], "log": []})
            # Not prepared yet: not in the kubelet's claim cache, not listed.
            answer = await anyio.to_thread.run_sync(_list, server.socket)
            assert _claims_of(answer) == {("web", "app"): [], ("web", "log"): []}

            await kubelet.aprepare([ref])
            answer = await anyio.to_thread.run_sync(_list, server.socket)
            assert _claims_of(answer) == {
                ("web", "app"): [(ref.name, "dra.cpu", [cdi, metadata])],
                ("web", "log"): [],
            }
            resource = answer.pod_resources[0].containers[0].dynamic_resources[0]
            assert resource.claim_namespace == ref.namespace
            assert resource.claim_resources[0].device_name == "cpudevnuma001"
            assert resource.claim_resources[0].share_id == "s1"

            server.dynamic_resources = False  # the gate off
            blind = await anyio.to_thread.run_sync(_list, server.socket)
            assert _claims_of(blind) == {("web", "app"): [], ("web", "log"): []}
            server.dynamic_resources = True

            await kubelet.aunprepare([ref])
            answer = await anyio.to_thread.run_sync(_list, server.socket)
            assert _claims_of(answer) == {("web", "app"): [], ("web", "log"): []}
            kubelet.pods.remove_pod(ref.namespace, "web")
            assert len((await anyio.to_thread.run_sync(_list, server.socket)).pod_resources) == 0
        assert not server.socket.exists()  # closing the kubelet removes its socket


def test_pod_resources_faults_and_the_rate_limit(tmp_path: Path) -> None:
    with FakeKubelet(tmp_path / "plugins_registry") as kubelet:
        server = kubelet.serve_pod_resources()
        server.fail("UNAVAILABLE")
        with pytest.raises(grpc.RpcError) as info:
            _list(server.socket)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(_list(server.socket).pod_resources) == 0
        assert [c.code for c in server.calls] == ["UNAVAILABLE", "OK"]
        server.stop()
        assert not server.socket.exists()
    # The kubelet's bucket (burst 10; the refill slowed down here): the 11th call is refused.
    with PodResourcesServer(tmp_path / "kubelet.sock", KubeletPods(), qps=1e-3) as limited:
        answers: list[tuple[str, str]] = []
        for _ in range(11):
            try:
                _list(limited.socket)
                answers.append(("OK", ""))
            except grpc.RpcError as exc:
                answers.append((exc.code().name, exc.details()))
    assert answers == [("OK", "")] * 10 + [("RESOURCE_EXHAUSTED", "rejected by rate limit")]
