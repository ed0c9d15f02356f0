"""The generated code in ``dracpu._gen`` is fresh and speaks exactly the upstream wire.

Every message is checked against an independent implementation: Google's protobuf runtime
(``tests.peers``), plus golden bytes of the Go implementations. The gRPC services
are checked against grpcio (an independent gRPC stack, as grpc-go's kubelet is) over real unix
sockets, with the method paths written out literally as the kubelet sends them.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import AsyncIterator, Collection
from concurrent import futures
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import anyio.to_thread
import betterproto2
import grpc
import grpclib.client
import pytest
from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from dracpu._gen.dra import v1 as dra_v1
from dracpu._gen.dra import v1beta1 as dra_v1beta1
from dracpu._gen.dra_health import v1 as health_v1
from dracpu._gen.dra_health import v1alpha1 as health_v1alpha1
from dracpu._gen.pb2.nri.v1alpha1 import api_pb2 as nri_pb2
from dracpu._gen.pluginregistration import v1 as reg_v1
from dracpu._gen.podresources import v1 as podres_v1
from dracpu.adapters.grpc_unix import open_grpc_server
from tests.peers import load_pb2, load_pb2_grpc, module_name, serialize, unix_target

__all__: list[str] = []

REPO_ROOT = Path(__file__).resolve().parent.parent
GEN_SCRIPT = REPO_ROOT / "scripts" / "gen_proto.py"

G_DRA_V1 = load_pb2("dra/v1/api.proto")
G_DRA_V1BETA1 = load_pb2("dra/v1beta1/api.proto")
G_HEALTH = {
    "v1": (health_v1, load_pb2("dra_health/v1/api.proto")),
    "v1alpha1": (health_v1alpha1, load_pb2("dra_health/v1alpha1/api.proto")),
}
G_REG = load_pb2("pluginregistration/v1/api.proto")
G_PODRES = load_pb2("podresources/v1/api.proto")
G_NRI = load_pb2("nri/v1alpha1/api.proto")
G_TTRPC = load_pb2("ttrpc/request.proto")
G_STATUS = load_pb2("google/rpc/status.proto")

# Socket timeout for the gRPC smoke tests, seconds (generous: 2 shared cores).
CALL_TIMEOUT = 10.0


def _gparse(cls: Any, data: bytes) -> Any:
    message = cls()
    message.ParseFromString(data)
    return message


def _has_unordered_map(message: Message) -> bool:
    """True if a map field somewhere in ``message`` has two or more entries."""
    for field, value in message.ListFields():
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            if len(value) > 1:
                return True
            values = [v for v in value.values() if isinstance(v, Message)]
        elif entry is not None:
            values = list(value) if field.is_repeated else [value]
        else:
            continue
        if any(_has_unordered_map(v) for v in values):
            return True
    return False


def assert_same_wire(ours: betterproto2.Message, theirs: Message) -> bytes:
    """Our message and Google's encode the same fields the same way; each reads the other's.

    Map entries are the one place where two correct encoders may differ: betterproto2 writes a
    dict in insertion order, Google's upb runtime in its own hash-based "deterministic" order
    (not sorted by key). So bytes must be equal outright when no map has two entries, and
    otherwise equal after the other side re-encodes them (same fields, same bytes per entry).
    """
    ours_bytes = bytes(ours)
    theirs_bytes = serialize(theirs)
    if not _has_unordered_map(theirs):
        assert ours_bytes.hex(" ") == theirs_bytes.hex(" ")
    assert len(ours_bytes) == len(theirs_bytes)
    from_ours = _gparse(type(theirs), ours_bytes)
    assert from_ours == theirs
    assert serialize(from_ours).hex(" ") == theirs_bytes.hex(" ")
    from_theirs = type(ours).parse(theirs_bytes)
    assert from_theirs == ours
    assert bytes(from_theirs).hex(" ") == theirs_bytes.hex(" ")
    return ours_bytes


# --------------------------------------------------------------------------------------------
# Freshness of the committed code


def test_committed_generated_code_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(GEN_SCRIPT), "--check"],
        capture_output=True,
        text=True,
        check=False,
        timeout=100,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_reports_stale_missing_and_extra_files(tmp_path: Path) -> None:
    committed = REPO_ROOT / "src" / "dracpu" / "_gen"
    stale = tmp_path / "_gen"
    for path in committed.rglob("*.py"):
        if "__pycache__" not in path.parts:
            target = stale / path.relative_to(committed)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    dra_init = stale / "dra" / "v1" / "__init__.py"
    dra_init.write_text(dra_init.read_text().replace("cdi_device_ids: ", "cdi_devize_ids: ", 1))
    stub = stale / "pb2" / "nri" / "v1alpha1" / "api_pb2.pyi"
    stub.parent.mkdir(parents=True, exist_ok=True)
    source = committed / "pb2" / "nri" / "v1alpha1" / "api_pb2.pyi"
    stub.write_text(source.read_text().replace("    cpus: str", "    cpuz: str", 1))
    (stale / "podresources" / "v1" / "__init__.py").unlink()
    (stale / "leftover.py").write_text("x = 1\n")

    result = subprocess.run(
        [sys.executable, str(GEN_SCRIPT), "--check", "--out", str(stale)],
        capture_output=True,
        text=True,
        check=False,
        timeout=100,
    )

    assert result.returncode == 1, result.stdout + result.stderr
    assert "differs: dra/v1/__init__.py" in result.stderr
    assert "+    cdi_device_ids: " in result.stderr
    assert "differs: pb2/nri/v1alpha1/api_pb2.pyi" in result.stderr
    assert "+    cpus: str" in result.stderr
    assert "missing: podresources/v1/__init__.py" in result.stderr
    assert "extra:   leftover.py" in result.stderr


def test_check_reports_a_stale_pb2_tree(tmp_path: Path) -> None:
    # The simulator's Google-protobuf tree (dracpu.sim._pb2) is checked the same way.
    committed = REPO_ROOT / "src" / "dracpu" / "sim" / "_pb2"
    stale = tmp_path / "_pb2"
    for path in committed.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            target = stale / path.relative_to(committed)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    stub = stale / "nri" / "v1alpha1" / "api_pb2.pyi"
    stub.write_text(stub.read_text().replace("    cpus: str", "    cpuz: str", 1))
    (stale / "ttrpc" / "request_pb2.py").unlink()
    (stale / "leftover_pb2.py").write_text("x = 1\n")

    result = subprocess.run(
        [sys.executable, str(GEN_SCRIPT), "--check", "--only", "sim", "--sim-out", str(stale)],
        capture_output=True,
        text=True,
        check=False,
        timeout=100,
    )

    assert result.returncode == 1, result.stdout + result.stderr
    assert "differs: nri/v1alpha1/api_pb2.pyi" in result.stderr
    assert "+    cpus: str" in result.stderr
    assert "missing: ttrpc/request_pb2.py" in result.stderr
    assert "extra:   leftover_pb2.py" in result.stderr
    assert "(gen)" not in result.stdout  # --only sim leaves dracpu._gen alone


@pytest.mark.parametrize(
    ("package", "extra"),
    [("dracpu.sim._pb2", "dra.v1.api_pb2"), ("dracpu._gen.pb2", None)],
)
def test_pb2_trees_import_only_inside_their_package(package: str, extra: str | None) -> None:
    # In a fresh interpreter (tests.peers puts top-level nri/ttrpc/google.rpc peers on sys.path
    # in this one): every cross-module import resolves inside the tree's own package, and both
    # trees load side by side (they register the same proto files, with the same contents).
    probe = (
        "import sys\n"
        f"from {package}.ttrpc import request_pb2\n"
        f"from {package}.nri.v1alpha1 import api_pb2\n"
        "from dracpu.sim._pb2.nri.v1alpha1 import api_pb2 as sim_api\n"
        "from dracpu._gen.pb2.nri.v1alpha1 import api_pb2 as daemon_api\n"
        "tops = {'nri', 'ttrpc', 'dra', 'podresources', 'pluginregistration', 'dra_health'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in tops or m == 'google.rpc'))\n"
        "status = request_pb2.Response.DESCRIPTOR.fields_by_name['status'].message_type\n"
        "print(status.full_name, api_pb2.DESCRIPTOR.package)\n"
        "print(sim_api.DESCRIPTOR.serialized_pb == daemon_api.DESCRIPTOR.serialized_pb)\n"
    )
    if extra is not None:
        probe += f"from {package}.{extra} as more\nprint(more.DESCRIPTOR.package)\n".replace(
            f"from {package}.{extra} as", f"import {package}.{extra} as"
        )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stderr
    expected = ["[]", "google.rpc.Status nri.pkg.api.v1alpha1", "True"]
    if extra is not None:
        expected.append("k8s.io.kubelet.pkg.apis.dra.v1")
    assert result.stdout.splitlines() == expected


def _load_gen_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dracpu_gen_proto_script", GEN_SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_write_replaces_the_tree_and_keeps_nothing_stale(tmp_path: Path) -> None:
    script = _load_gen_script()
    root = tmp_path / "_gen"
    (root / "old" / "v0").mkdir(parents=True)
    (root / "old" / "v0" / "__init__.py").write_text("stale\n")
    (root / "old" / "__pycache__").mkdir()
    (root / "keep").mkdir()
    (root / "keep" / "__init__.py").write_text("before\n")

    script._write(root, {"__init__.py": b"root\n", "keep/__init__.py": b"after\n"})

    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
    assert files == ["__init__.py", "keep", "keep/__init__.py"]
    assert (root / "keep" / "__init__.py").read_bytes() == b"after\n"


def test_generated_packages_keep_upstream_proto_packages() -> None:
    # The Python path follows proto/, the registered proto package is upstream's.
    assert dra_v1.DraPluginBase().__mapping__().keys() == {
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
    }
    assert dra_v1beta1.DraPluginBase().__mapping__().keys() == {
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
    }
    assert reg_v1.RegistrationBase().__mapping__().keys() == {
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
    }
    assert podres_v1.PodResourcesListerBase().__mapping__().keys() == {
        "/v1.PodResourcesLister/List",
        "/v1.PodResourcesLister/GetAllocatableResources",
        "/v1.PodResourcesLister/Get",
    }
    # Same bare package "v1" as PodResources, apart in Python and in the descriptor pool.
    assert health_v1.DraResourceHealthBase().__mapping__().keys() == {
        "/v1.DRAResourceHealth/NodeWatchResources"
    }
    assert health_v1alpha1.DraResourceHealthBase().__mapping__().keys() == {
        "/v1alpha1.DRAResourceHealth/NodeWatchResources"
    }


def test_nri_plugin_service_declares_every_upstream_method() -> None:
    # containerd/nri api.proto: all methods, so a server can answer UNIMPLEMENTED by name.
    services = nri_pb2.DESCRIPTOR.services_by_name
    assert {m.name for m in services["Plugin"].methods} == {
        "Configure",
        "Synchronize",
        "Shutdown",
        "RunPodSandbox",
        "UpdatePodSandbox",
        "PostUpdatePodSandbox",
        "StopPodSandbox",
        "RemovePodSandbox",
        "CreateContainer",
        "PostCreateContainer",
        "StartContainer",
        "PostStartContainer",
        "UpdateContainer",
        "PostUpdateContainer",
        "StopContainer",
        "RemoveContainer",
        "StateChange",
        "ValidateContainerAdjustment",
    }
    assert {m.name for m in services["Runtime"].methods} == {"RegisterPlugin", "UpdateContainers"}
    assert services["Plugin"].full_name == "nri.pkg.api.v1alpha1.Plugin"
    assert services["Runtime"].full_name == "nri.pkg.api.v1alpha1.Runtime"


def test_peer_module_names_follow_proto_paths() -> None:
    assert module_name("dra/v1/api.proto") == "dra.v1.api_pb2"
    assert module_name("podresources/v1/api.proto", grpc=True) == "podresources.v1.api_pb2_grpc"
    assert G_DRA_V1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    assert G_PODRES.DESCRIPTOR.package == "v1"
    assert G_REG.DESCRIPTOR.package == "pluginregistration"
    assert G_NRI.DESCRIPTOR.package == "nri.pkg.api.v1alpha1"
    with pytest.raises(ValueError, match=r"not a \.proto path"):
        module_name("dra/v1/api")
    with pytest.raises(FileNotFoundError, match=r"nope/api\.proto"):
        load_pb2("nope/api.proto")


# --------------------------------------------------------------------------------------------
# DRA v1 / v1beta1 messages


def test_dra_v1_prepare_request_round_trip() -> None:
    ours = dra_v1.NodePrepareResourcesRequest(
        claims=[
            dra_v1.Claim(namespace="default", uid="0a1b-2c3d", name="cpus"),
            dra_v1.Claim(namespace="team-b", uid="ffff", name="pinned"),
        ]
    )
    theirs = G_DRA_V1.NodePrepareResourcesRequest(
        claims=[
            G_DRA_V1.Claim(namespace="default", uid="0a1b-2c3d", name="cpus"),
            G_DRA_V1.Claim(namespace="team-b", uid="ffff", name="pinned"),
        ]
    )
    assert_same_wire(ours, theirs)


def test_dra_v1_prepare_response_map_round_trip() -> None:
    ours = dra_v1.NodePrepareResourcesResponse(
        claims={
            "uid-a": dra_v1.NodePrepareResourceResponse(
                devices=[
                    dra_v1.Device(
                        request_names=["cpu"],
                        pool_name="node-1",
                        device_name="cpudevnuma000",
                        cdi_device_ids=["dra.k8s.io/cpu=claim-uid-a"],
                        share_id="0b9e",
                    ),
                    dra_v1.Device(pool_name="node-1", device_name="cpudevnuma001"),
                ]
            ),
            "uid-b": dra_v1.NodePrepareResourceResponse(error="not enough CPUs on NUMA node 1"),
            "uid-c": dra_v1.NodePrepareResourceResponse(),
        }
    )
    theirs = G_DRA_V1.NodePrepareResourcesResponse()
    first = theirs.claims["uid-a"]
    first.devices.add(
        request_names=["cpu"],
        pool_name="node-1",
        device_name="cpudevnuma000",
        cdi_device_ids=["dra.k8s.io/cpu=claim-uid-a"],
        share_id="0b9e",
    )
    first.devices.add(pool_name="node-1", device_name="cpudevnuma001")
    theirs.claims["uid-b"].error = "not enough CPUs on NUMA node 1"
    theirs.claims["uid-c"].SetInParent()
    data = assert_same_wire(ours, theirs)
    assert set(_gparse(G_DRA_V1.NodePrepareResourcesResponse, data).claims) == {
        "uid-a",
        "uid-b",
        "uid-c",
    }


def test_dra_v1_map_in_insertion_order_still_decodes_equal() -> None:
    ours = dra_v1.NodePrepareResourcesResponse(
        claims={
            "zz": dra_v1.NodePrepareResourceResponse(error="e"),
            "aa": dra_v1.NodePrepareResourceResponse(),
        }
    )
    theirs = _gparse(G_DRA_V1.NodePrepareResourcesResponse, bytes(ours))
    assert dict(theirs.claims) == {
        "zz": G_DRA_V1.NodePrepareResourceResponse(error="e"),
        "aa": G_DRA_V1.NodePrepareResourceResponse(),
    }
    assert dra_v1.NodePrepareResourcesResponse.parse(serialize(theirs)) == ours


def test_dra_v1_share_id_presence() -> None:
    # optional string share_id = 5: set-but-empty is on the wire (2a 00), unset is not.
    empty_share = dra_v1.Device(device_name="d", share_id="")
    theirs = G_DRA_V1.Device(device_name="d", share_id="")
    assert assert_same_wire(empty_share, theirs) == bytes.fromhex("1a 01 64 2a 00")
    unset = dra_v1.Device(device_name="d")
    assert assert_same_wire(unset, G_DRA_V1.Device(device_name="d")) == bytes.fromhex("1a 01 64")
    assert dra_v1.Device.parse(bytes.fromhex("1a 01 64")).share_id is None
    assert dra_v1.Device.parse(bytes.fromhex("1a 01 64 2a 00")).share_id == ""


def test_dra_v1_unprepare_response_keeps_empty_map_values() -> None:
    # betterproto 2.0.0b7 (before betterproto2) dropped these entries; the kubelet then reports
    # the claims as skipped. Every claim must keep its (empty) entry.
    ours = dra_v1.NodeUnprepareResourcesResponse(
        claims={
            "uid-1": dra_v1.NodeUnprepareResourceResponse(),
            "uid-2": dra_v1.NodeUnprepareResourceResponse(),
            "uid-3": dra_v1.NodeUnprepareResourceResponse(error="CDI spec busy"),
        }
    )
    theirs = G_DRA_V1.NodeUnprepareResourcesResponse()
    theirs.claims["uid-1"].SetInParent()
    theirs.claims["uid-2"].SetInParent()
    theirs.claims["uid-3"].error = "CDI spec busy"
    data = assert_same_wire(ours, theirs)
    # entry {key "uid-1", value {}}: 0a 09 | 0a 05 "uid-1" | 12 00
    assert data.startswith(bytes.fromhex("0a 09 0a 05 75 69 64 2d 31 12 00"))
    decoded = _gparse(G_DRA_V1.NodeUnprepareResourcesResponse, data)
    assert sorted(decoded.claims) == ["uid-1", "uid-2", "uid-3"]
    assert dra_v1.NodeUnprepareResourcesResponse.parse(data).claims.keys() == {
        "uid-1",
        "uid-2",
        "uid-3",
    }


def test_dra_unprepare_request_round_trip() -> None:
    ours = dra_v1.NodeUnprepareResourcesRequest(
        claims=[dra_v1.Claim(namespace="ns", uid="u1", name="n1")]
    )
    theirs = G_DRA_V1.NodeUnprepareResourcesRequest(
        claims=[G_DRA_V1.Claim(namespace="ns", uid="u1", name="n1")]
    )
    assert_same_wire(ours, theirs)


def test_dra_v1beta1_matches_v1_except_share_id() -> None:
    ours = dra_v1beta1.NodePrepareResourcesResponse(
        claims={
            "u": dra_v1beta1.NodePrepareResourceResponse(
                devices=[
                    dra_v1beta1.Device(
                        request_names=["r"],
                        pool_name="p",
                        device_name="cpudev000",
                        cdi_device_ids=["dra.k8s.io/cpu=claim-u"],
                    )
                ]
            )
        }
    )
    theirs = G_DRA_V1BETA1.NodePrepareResourcesResponse()
    theirs.claims["u"].devices.add(
        request_names=["r"],
        pool_name="p",
        device_name="cpudev000",
        cdi_device_ids=["dra.k8s.io/cpu=claim-u"],
    )
    data = assert_same_wire(ours, theirs)
    # Same bytes as v1 without share_id; a v1 share_id is an unknown field to v1beta1.
    v1_same = dra_v1.NodePrepareResourcesResponse.parse(data)
    assert bytes(v1_same) == data
    v1_device = v1_same.claims["u"].devices[0]
    v1_device.share_id = "s"
    parsed = dra_v1beta1.NodePrepareResourcesResponse.parse(bytes(v1_same))
    assert parsed == ours
    assert not hasattr(parsed.claims["u"].devices[0], "share_id")


# --------------------------------------------------------------------------------------------
# DRA device health messages (k8s.io/kubelet pkg/apis/dra-health/{v1,v1alpha1}/api.proto)


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_dra_health_response_round_trip(version: str) -> None:
    ours, theirs = G_HEALTH[version]
    assert_same_wire(
        ours.NodeWatchResourcesResponse(
            devices=[
                ours.DeviceHealth(
                    device=ours.DeviceIdentifier(pool_name="node-a", device_name="cpudevnuma000"),
                    health=ours.HealthStatus.HEALTHY,
                    last_updated_time=1_760_000_000,
                    health_check_timeout_seconds=30,
                ),
                ours.DeviceHealth(
                    device=ours.DeviceIdentifier(pool_name="node-a", device_name="cpudev017"),
                    health=ours.HealthStatus.UNHEALTHY,
                    last_updated_time=1_760_000_005,
                    health_check_timeout_seconds=30,
                    message="cpu 17 is offline",
                ),
            ]
        ),
        theirs.NodeWatchResourcesResponse(
            devices=[
                theirs.DeviceHealth(
                    device=theirs.DeviceIdentifier(pool_name="node-a", device_name="cpudevnuma000"),
                    health=theirs.HEALTHY,
                    last_updated_time=1_760_000_000,
                    health_check_timeout_seconds=30,
                ),
                theirs.DeviceHealth(
                    device=theirs.DeviceIdentifier(pool_name="node-a", device_name="cpudev017"),
                    health=theirs.UNHEALTHY,
                    last_updated_time=1_760_000_005,
                    health_check_timeout_seconds=30,
                    message="cpu 17 is offline",
                ),
            ]
        ),
    )
    assert bytes(ours.NodeWatchResourcesRequest()) == b""


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_dra_health_field_numbers_are_upstream_s(version: str) -> None:
    # Written by hand from upstream's api.proto: device = 1 {pool_name = 1, device_name = 2},
    # health = 2 (UNKNOWN 0, HEALTHY 1, UNHEALTHY 2), last_updated_time = 3,
    # health_check_timeout_seconds = 4, message = 5; NodeWatchResourcesResponse.devices = 1.
    ours, theirs = G_HEALTH[version]
    golden = bytes.fromhex("0a 11 0a 06 0a 01 70 12 01 64 10 02 18 07 20 1e 2a 01 6d")
    message = ours.NodeWatchResourcesResponse(
        devices=[
            ours.DeviceHealth(
                device=ours.DeviceIdentifier(pool_name="p", device_name="d"),
                health=ours.HealthStatus.UNHEALTHY,
                last_updated_time=7,
                health_check_timeout_seconds=30,
                message="m",
            )
        ]
    )
    assert bytes(message).hex(" ") == golden.hex(" ")
    assert _gparse(theirs.NodeWatchResourcesResponse, golden).devices[0].message == "m"
    assert {v.name: v.number for v in theirs.HealthStatus.DESCRIPTOR.values} == {
        "UNKNOWN": 0,
        "HEALTHY": 1,
        "UNHEALTHY": 2,
    }
    assert {h.name: h.value for h in ours.HealthStatus} == {
        "UNKNOWN": 0,
        "HEALTHY": 1,
        "UNHEALTHY": 2,
    }


# --------------------------------------------------------------------------------------------
# Plugin registration and PodResources messages


def test_registration_messages_round_trip() -> None:
    assert_same_wire(
        reg_v1.PluginInfo(
            type="DRAPlugin",
            name="dra.cpu",
            endpoint="/var/lib/kubelet/plugins/dra.cpu/dra.sock",
            supported_versions=["v1.DRAPlugin", "v1beta1.DRAPlugin"],
        ),
        G_REG.PluginInfo(
            type="DRAPlugin",
            name="dra.cpu",
            endpoint="/var/lib/kubelet/plugins/dra.cpu/dra.sock",
            supported_versions=["v1.DRAPlugin", "v1beta1.DRAPlugin"],
        ),
    )
    assert_same_wire(
        reg_v1.RegistrationStatus(plugin_registered=False, error="bad endpoint"),
        G_REG.RegistrationStatus(plugin_registered=False, error="bad endpoint"),
    )
    assert bytes(reg_v1.InfoRequest()) == b""
    assert bytes(reg_v1.RegistrationStatusResponse()) == b""


def test_podresources_list_response_round_trip() -> None:
    ours = podres_v1.ListPodResourcesResponse(
        pod_resources=[
            podres_v1.PodResources(
                name="web-0",
                namespace="default",
                containers=[
                    podres_v1.ContainerResources(
                        name="app",
                        cpu_ids=[2, 3, 130],
                        memory=[
                            podres_v1.ContainerMemory(
                                memory_type="memory",
                                size=1 << 30,
                                topology=podres_v1.TopologyInfo(
                                    nodes=[podres_v1.NumaNode(id=0), podres_v1.NumaNode(id=1)]
                                ),
                            )
                        ],
                        dynamic_resources=[
                            podres_v1.DynamicResource(
                                claim_name="cpus",
                                claim_namespace="default",
                                claim_resources=[
                                    podres_v1.ClaimResource(
                                        cdi_devices=[
                                            podres_v1.CdiDevice(name="dra.k8s.io/cpu=claim-u1")
                                        ],
                                        driver_name="dra.cpu",
                                        pool_name="node-1",
                                        device_name="cpudevnuma000",
                                    )
                                ],
                            )
                        ],
                    ),
                    podres_v1.ContainerResources(name="sidecar"),
                ],
                cpu_ids=[4],
            )
        ]
    )
    theirs = G_PODRES.ListPodResourcesResponse()
    pod = theirs.pod_resources.add(name="web-0", namespace="default", cpu_ids=[4])
    app = pod.containers.add(name="app", cpu_ids=[2, 3, 130])
    memory = app.memory.add(memory_type="memory", size=1 << 30)
    memory.topology.nodes.add(ID=0)
    memory.topology.nodes.add(ID=1)
    dynamic = app.dynamic_resources.add(claim_name="cpus", claim_namespace="default")
    claim = dynamic.claim_resources.add(
        driver_name="dra.cpu", pool_name="node-1", device_name="cpudevnuma000"
    )
    claim.cdi_devices.add(name="dra.k8s.io/cpu=claim-u1")
    pod.containers.add(name="sidecar")
    assert_same_wire(ours, theirs)


def test_podresources_cpu_ids_accept_unpacked_encoding() -> None:
    # proto3 writes repeated int64 packed; decoders must accept the unpacked form too.
    packed = bytes(podres_v1.ContainerResources(cpu_ids=[1, 2, 300]))
    assert packed == bytes.fromhex("1a 04 01 02 ac 02")
    unpacked = bytes.fromhex("18 01 18 02 18 ac 02")
    assert podres_v1.ContainerResources.parse(unpacked).cpu_ids == [1, 2, 300]
    assert list(_gparse(G_PODRES.ContainerResources, unpacked).cpu_ids) == [1, 2, 300]


def test_podresources_dynamic_resource_field_1_is_a_tombstone() -> None:
    # Field 1 (class_name, removed in 1.31) from an old kubelet is skipped, not misread.
    old = bytes.fromhex("0a 03 63 6c 73") + bytes(podres_v1.DynamicResource(claim_name="c"))
    assert podres_v1.DynamicResource.parse(old) == podres_v1.DynamicResource(claim_name="c")


# --------------------------------------------------------------------------------------------
# The ttrpc envelope's Google peer


def test_ttrpc_peer_envelope_matches_golden_vectors() -> None:
    # The Google peer of the ttrpc envelope reproduces ttrpc-rust's and containerd/nri's
    # vectors, so tests can trust it when they build frames for a fake runtime.
    request = G_TTRPC.Request(
        service="grpc.TestServices",
        method="Test",
        payload=bytes(range(1, 10)),
        timeout_nano=20_000_000,
    )
    request.metadata.add(key="test_key1", value="test_value1")
    # ttrpc-rust src/proto.rs PROTOBUF_REQUEST (67 bytes)
    golden = [
        10, 17, 103, 114, 112, 99, 46, 84, 101, 115, 116, 83, 101, 114, 118, 105, 99, 101, 115,
        18, 4, 84, 101, 115, 116, 26, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 32, 128, 218, 196, 9, 42, 24,
        10, 9, 116, 101, 115, 116, 95, 107, 101, 121, 49, 18, 11, 116, 101, 115, 116, 95, 118, 97,
        108, 117, 101, 49,
    ]  # fmt: skip
    assert serialize(request) == bytes(golden)
    register = G_TTRPC.Request(
        service="nri.pkg.api.v1alpha1.Runtime",
        method="RegisterPlugin",
        payload=serialize(G_NRI.RegisterPluginRequest(plugin_name="dra-cpu", plugin_idx="90")),
        timeout_nano=5_000_000_000,
    )
    assert serialize(register).hex(" ") == (
        "0a 1c 6e 72 69 2e 70 6b 67 2e 61 70 69 2e 76 31 61 6c 70 68 61 31 2e 52 75 6e 74 69 "
        "6d 65 12 0e 52 65 67 69 73 74 65 72 50 6c 75 67 69 6e 1a 0d 0a 07 64 72 61 2d 63 70 "
        "75 12 02 39 30 20 80 e4 97 d0 12"
    )
    boom = G_TTRPC.Response(status=G_STATUS.Status(code=2, message="boom"))
    assert serialize(boom) == bytes.fromhex("0a 08 08 02 12 04 62 6f 6f 6d")
    ok = G_TTRPC.Response(payload=serialize(G_NRI.ConfigureResponse(events=0x688)))
    assert serialize(ok) == bytes.fromhex("12 03 10 88 0d")
    assert serialize(G_TTRPC.Response()) == b""


_cpu_lists = st.lists(st.integers(0, 1023), max_size=12).map(
    lambda cpus: ",".join(str(cpu) for cpu in sorted(set(cpus)))
)
_words = st.text(max_size=20)
_string_maps = st.dictionaries(_words, _words, max_size=4)


@settings(max_examples=40, deadline=None)
@given(
    claims=st.dictionaries(
        st.uuids().map(str),
        st.tuples(st.lists(_cpu_lists, max_size=3), st.text(max_size=10)),
        max_size=5,
    )
)
def test_dra_prepare_response_same_wire_property(
    claims: dict[str, tuple[list[str], str]],
) -> None:
    ours = dra_v1.NodePrepareResourcesResponse(
        claims={
            uid: dra_v1.NodePrepareResourceResponse(
                devices=[
                    dra_v1.Device(pool_name="node", device_name=name, cdi_device_ids=[uid])
                    for name in names
                ],
                error=error,
            )
            for uid, (names, error) in claims.items()
        }
    )
    theirs = G_DRA_V1.NodePrepareResourcesResponse()
    for uid, (names, error) in claims.items():
        entry = theirs.claims[uid]
        entry.SetInParent()
        entry.error = error
        for name in names:
            entry.devices.add(pool_name="node", device_name=name, cdi_device_ids=[uid])
    assert_same_wire(ours, theirs)


# --------------------------------------------------------------------------------------------
# gRPC: grpcio (the kubelet's role) against grpclib servers built from the generated code


class _Registrar(reg_v1.RegistrationBase):
    def __init__(self) -> None:
        self.statuses: list[reg_v1.RegistrationStatus] = []

    async def get_info(self, message: reg_v1.InfoRequest) -> reg_v1.PluginInfo:
        return reg_v1.PluginInfo(
            type="DRAPlugin",
            name="dra.cpu",
            endpoint="/var/lib/kubelet/plugins/dra.cpu/dra.sock",
            supported_versions=["v1.DRAPlugin", "v1beta1.DRAPlugin"],
        )

    async def notify_registration_status(
        self, message: reg_v1.RegistrationStatus
    ) -> reg_v1.RegistrationStatusResponse:
        self.statuses.append(message)
        return reg_v1.RegistrationStatusResponse()


class _DriverV1(dra_v1.DraPluginBase):
    def __init__(self) -> None:
        self.prepared: list[dra_v1.Claim] = []

    async def node_prepare_resources(
        self, message: dra_v1.NodePrepareResourcesRequest
    ) -> dra_v1.NodePrepareResourcesResponse:
        self.prepared.extend(message.claims)
        return dra_v1.NodePrepareResourcesResponse(
            claims={
                claim.uid: dra_v1.NodePrepareResourceResponse(
                    devices=[
                        dra_v1.Device(
                            pool_name="node-1",
                            device_name="cpudevnuma000",
                            cdi_device_ids=[f"dra.k8s.io/cpu=claim-{claim.uid}"],
                        )
                    ]
                )
                for claim in message.claims
            }
        )

    async def node_unprepare_resources(
        self, message: dra_v1.NodeUnprepareResourcesRequest
    ) -> dra_v1.NodeUnprepareResourcesResponse:
        return dra_v1.NodeUnprepareResourcesResponse(
            claims={claim.uid: dra_v1.NodeUnprepareResourceResponse() for claim in message.claims}
        )


class _DriverV1beta1(dra_v1beta1.DraPluginBase):
    async def node_prepare_resources(
        self, message: dra_v1beta1.NodePrepareResourcesRequest
    ) -> dra_v1beta1.NodePrepareResourcesResponse:
        return dra_v1beta1.NodePrepareResourcesResponse(
            claims={
                claim.uid: dra_v1beta1.NodePrepareResourceResponse(error="beta says no")
                for claim in message.claims
            }
        )


@asynccontextmanager
async def _grpclib_server(handlers: Collection[Any], path: Path) -> AsyncIterator[None]:
    """The generated services served by grpclib the way the daemon serves them
    (:func:`dracpu.adapters.grpc_unix.open_grpc_server`, which also closes the connections that
    ``grpclib.server.Server.close`` leaves open: one left open fails a later test with a
    ``ResourceWarning``)."""
    async with open_grpc_server(list(handlers), path):
        yield


def _unary(channel: Any, path: str, request: Message, reply_type: Any) -> Any:
    """A grpcio call by literal method path, as grpc-go's kubelet sends it."""
    call = channel.unary_unary(
        path,
        request_serializer=serialize,
        response_deserializer=reply_type.FromString,
    )
    return call(request, timeout=CALL_TIMEOUT)


@pytest.mark.anyio
async def test_grpcio_kubelet_registers_through_grpclib_server(tmp_path: Path) -> None:
    registrar = _Registrar()
    socket_path = tmp_path / "dra.cpu-reg.sock"

    def kubelet() -> tuple[Any, Any]:
        with grpc.insecure_channel(unix_target(socket_path)) as channel:
            info = _unary(
                channel,
                "/pluginregistration.Registration/GetInfo",
                G_REG.InfoRequest(),
                G_REG.PluginInfo,
            )
            # The generated grpcio stub reaches the same handler.
            stub = load_pb2_grpc("pluginregistration/v1/api.proto").RegistrationStub(channel)
            again = stub.GetInfo(G_REG.InfoRequest(), timeout=CALL_TIMEOUT)
            _unary(
                channel,
                "/pluginregistration.Registration/NotifyRegistrationStatus",
                G_REG.RegistrationStatus(plugin_registered=True),
                G_REG.RegistrationStatusResponse,
            )
            return info, again

    async with _grpclib_server([registrar], socket_path):
        info, again = await anyio.to_thread.run_sync(kubelet)

    assert info == again
    assert info.type == "DRAPlugin"
    assert info.name == "dra.cpu"
    assert info.endpoint == "/var/lib/kubelet/plugins/dra.cpu/dra.sock"
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    assert registrar.statuses == [reg_v1.RegistrationStatus(plugin_registered=True)]


@pytest.mark.anyio
async def test_grpcio_kubelet_prepares_through_grpclib_dra_server(tmp_path: Path) -> None:
    driver = _DriverV1()
    socket_path = tmp_path / "dra.sock"
    claims = [
        G_DRA_V1.Claim(namespace="default", uid="uid-1", name="cpus"),
        G_DRA_V1.Claim(namespace="default", uid="uid-2", name="more-cpus"),
    ]

    def kubelet() -> tuple[Any, Any, Any, dict[str, grpc.StatusCode]]:
        with grpc.insecure_channel(unix_target(socket_path)) as channel:
            prepared = _unary(
                channel,
                "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
                G_DRA_V1.NodePrepareResourcesRequest(claims=claims),
                G_DRA_V1.NodePrepareResourcesResponse,
            )
            unprepared = _unary(
                channel,
                "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
                G_DRA_V1.NodeUnprepareResourcesRequest(claims=claims),
                G_DRA_V1.NodeUnprepareResourcesResponse,
            )
            beta = _unary(
                channel,
                "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
                G_DRA_V1BETA1.NodePrepareResourcesRequest(claims=[G_DRA_V1BETA1.Claim(uid="b")]),
                G_DRA_V1BETA1.NodePrepareResourcesResponse,
            )
            failures: dict[str, grpc.StatusCode] = {}
            # A server generated from a bare "package v1" would sit at the first path, and the
            # v1beta1 unprepare is not implemented by the test driver.
            for path in (
                "/v1.DRAPlugin/NodePrepareResources",
                "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
            ):
                try:
                    _unary(
                        channel,
                        path,
                        G_DRA_V1.NodePrepareResourcesRequest(claims=claims),
                        G_DRA_V1.NodePrepareResourcesResponse,
                    )
                except grpc.RpcError as exc:
                    failures[path] = exc.code()
            return prepared, unprepared, beta, failures

    async with _grpclib_server([driver, _DriverV1beta1()], socket_path):
        prepared, unprepared, beta, failures = await anyio.to_thread.run_sync(kubelet)

    assert [(c.uid, c.name) for c in driver.prepared] == [("uid-1", "cpus"), ("uid-2", "more-cpus")]
    assert sorted(prepared.claims) == ["uid-1", "uid-2"]
    device = prepared.claims["uid-1"].devices[0]
    assert (device.pool_name, device.device_name) == ("node-1", "cpudevnuma000")
    assert list(device.cdi_device_ids) == ["dra.k8s.io/cpu=claim-uid-1"]
    assert not device.HasField("share_id")
    # Every claim has an entry, even though each entry is an empty message.
    assert sorted(unprepared.claims) == ["uid-1", "uid-2"]
    assert all(entry.error == "" for entry in unprepared.claims.values())
    assert beta.claims["b"].error == "beta says no"
    assert failures == {
        "/v1.DRAPlugin/NodePrepareResources": grpc.StatusCode.UNIMPLEMENTED,
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources": (
            grpc.StatusCode.UNIMPLEMENTED
        ),
    }


@pytest.mark.anyio
async def test_grpclib_stub_lists_pod_resources_from_grpcio_kubelet(tmp_path: Path) -> None:
    socket_path = tmp_path / "kubelet.sock"
    reply = G_PODRES.ListPodResourcesResponse()
    container = reply.pod_resources.add(name="web-0", namespace="default").containers.add(
        name="app", cpu_ids=[5]
    )
    dynamic = container.dynamic_resources.add(claim_name="cpus", claim_namespace="default")
    dynamic.claim_resources.add(
        driver_name="dra.cpu", pool_name="node-1", device_name="cpudevnuma000"
    ).cdi_devices.add(name="dra.k8s.io/cpu=claim-u1")
    seen: list[Any] = []

    def list_pods(request: Any, context: Any) -> Any:
        seen.append(request)
        return reply

    handler = grpc.method_handlers_generic_handler(
        "v1.PodResourcesLister",
        {
            "List": grpc.unary_unary_rpc_method_handler(
                list_pods,
                request_deserializer=G_PODRES.ListPodResourcesRequest.FromString,
                response_serializer=serialize,
            )
        },
    )
    kubelet = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    kubelet.add_generic_rpc_handlers((handler,))
    kubelet.add_insecure_port(unix_target(socket_path))
    kubelet.start()
    try:
        channel = grpclib.client.Channel(path=str(socket_path))
        try:
            stub = podres_v1.PodResourcesListerStub(channel)
            with anyio.fail_after(CALL_TIMEOUT):
                listed = await stub.list(podres_v1.ListPodResourcesRequest())
        finally:
            channel.close()
    finally:
        kubelet.stop(None).wait(CALL_TIMEOUT)

    assert len(seen) == 1
    assert listed == podres_v1.ListPodResourcesResponse.parse(serialize(reply))
    claim = listed.pod_resources[0].containers[0].dynamic_resources[0].claim_resources[0]
    assert claim.driver_name == "dra.cpu"
    assert [d.name for d in claim.cdi_devices] == ["dra.k8s.io/cpu=claim-u1"]
    assert listed.pod_resources[0].containers[0].cpu_ids == [5]
