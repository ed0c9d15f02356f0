"""Protobuf costs on the daemon's hot paths: betterproto2 (DRA) and Google protobuf (NRI).

Run: ``.venv/bin/python bench/bench_proto.py``. Figures (ms, p50/p99):

* ``proto.dra_prepare_pair_1.v1``: what the DRA socket's codec does per Prepare call of one
  claim (the kubelet's usual call): parse the request, build and encode the one-device answer;
* ``proto.dra_prepare_response_100.build_encode`` / ``.decode``: a NodePrepareResources reply
  for 100 claims (a pod with many claims, the large end);
* ``proto.nri_create_container_request.decode``: what the CreateContainer hook parses first
  (:func:`dracpu.adapters.nri_messages.read_container_event`; budget: the runtime drops a
  plugin after 2 s for the whole call);
* ``proto.nri_create_container_response_100_updates.build_encode``: pin one container and
  shrink 100 shared containers in the same reply
  (:func:`dracpu.adapters.nri_messages.create_container_response`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import measure
from dracpu._gen.dra import v1 as dra_v1
from dracpu._gen.pb2.nri.v1alpha1 import api_pb2 as nri
from dracpu.adapters import nri_messages
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import ContainerUpdate

__all__ = ["main"]

# Claims of the large NodePrepareResources reply: far more than one pod asks for.
CLAIMS = 100
# The one claim of the per-call figure, as the kubelet names it, and its shared-device answer.
CLAIM_UID = "0b6f4c1e-3f5d-4c8a-9a57-2d1e6f7a8b90"
SHARE_ID = "5e0a9a44-7c2b-4d59-8c4f-0f1e2d3c4b5a"
# A busy node: 100 shared containers to shrink when one exclusive claim is pinned.
SHARED_CONTAINERS = 100
SAMPLES = 200


def prepare_pair(request: bytes) -> bytes:
    """Parse a one-claim request, answer it with one device (v1: with share_id), encode."""
    [claim] = dra_v1.NodePrepareResourcesRequest.parse(request).claims
    return bytes(
        dra_v1.NodePrepareResourcesResponse(
            claims={
                claim.uid: dra_v1.NodePrepareResourceResponse(
                    devices=[
                        dra_v1.Device(
                            request_names=["cpu"],
                            pool_name="node-1",
                            device_name="cpudevnuma000",
                            cdi_device_ids=[f"dra.k8s.io/cpu=claim-{claim.uid}"],
                            share_id=SHARE_ID,
                        )
                    ]
                )
            }
        )
    )


def build_prepare_response() -> dra_v1.NodePrepareResourcesResponse:
    return dra_v1.NodePrepareResourcesResponse(
        claims={
            f"5b3c8f9e-0000-4000-8000-{index:012d}": dra_v1.NodePrepareResourceResponse(
                devices=[
                    dra_v1.Device(
                        request_names=["cpus"],
                        pool_name="node-1",
                        device_name=f"cpudevnuma{index % 4:03d}",
                        cdi_device_ids=[
                            f"dra.k8s.io/cpu=claim-5b3c8f9e-0000-4000-8000-{index:012d}"
                        ],
                    )
                ]
            )
            for index in range(CLAIMS)
        }
    )


def build_create_container_request() -> nri.CreateContainerRequest:
    return nri.CreateContainerRequest(
        pod=nri.PodSandbox(
            id="a" * 64,
            name="web-0",
            uid="5b3c8f9e-0000-4000-8000-000000000001",
            namespace="default",
            labels={f"label-{i}": "value" for i in range(10)},
            annotations={f"annotation-{i}": "x" * 40 for i in range(10)},
            runtime_handler="runc",
            linux=nri.LinuxPodSandbox(cgroup_parent="kubepods-pod5b3c8f9e.slice"),
        ),
        container=nri.Container(
            id="b" * 64,
            pod_sandbox_id="a" * 64,
            name="app",
            labels={f"label-{i}": "value" for i in range(10)},
            annotations={f"annotation-{i}": "x" * 40 for i in range(10)},
            args=["/bin/app", "--serve", "--port=8080"],
            env=[f"VAR_{i}=value-{i}" for i in range(30)]
            + ["DRA_CPUSET_5b3c8f9e-0000-4000-8000-000000000001=4-7,132-135"],
            mounts=[
                nri.Mount(destination=f"/mnt/{i}", type="bind", source=f"/var/lib/{i}")
                for i in range(8)
            ],
            linux=nri.LinuxContainer(
                namespaces=[nri.LinuxNamespace(type="network", path="/proc/1/ns/net")],
                resources=nri.LinuxResources(
                    memory=nri.LinuxMemory(limit=nri.OptionalInt64(value=1 << 30)),
                    cpu=nri.LinuxCPU(
                        shares=nri.OptionalUInt64(value=4096),
                        quota=nri.OptionalInt64(value=400000),
                        period=nri.OptionalUInt64(value=100000),
                        cpus="0-255",
                    ),
                ),
                cgroups_path="kubepods-pod5b3c8f9e.slice:cri-containerd:" + "b" * 64,
            ),
        ),
    )


SHARED_POOL = CpuSet.parse("0-3,8-131,136-255")
SHARED_UPDATES = [
    ContainerUpdate(f"{index:064x}", SHARED_POOL) for index in range(SHARED_CONTAINERS)
]


def build_create_container_response() -> bytes:
    return nri_messages.create_container_response(
        "b" * 64, CpuSet.parse("4-7,132-135"), CpuSet.parse("0"), SHARED_UPDATES
    )


def main() -> None:
    request = bytes(
        dra_v1.NodePrepareResourcesRequest(
            claims=[dra_v1.Claim(namespace="default", uid=CLAIM_UID, name="pod-cpus-7d9f")]
        )
    )
    measure(
        "proto.dra_prepare_pair_1.v1",
        lambda: prepare_pair(request),
        n=SAMPLES * 10,
        request_bytes=len(request),
        response_bytes=len(prepare_pair(request)),
    )
    prepare_bytes = bytes(build_prepare_response())
    measure(
        "proto.dra_prepare_response_100.build_encode",
        lambda: bytes(build_prepare_response()),
        n=SAMPLES,
        bytes=len(prepare_bytes),
    )
    measure(
        "proto.dra_prepare_response_100.decode",
        lambda: dra_v1.NodePrepareResourcesResponse.parse(prepare_bytes),
        n=SAMPLES,
        bytes=len(prepare_bytes),
    )
    request_bytes = build_create_container_request().SerializeToString()
    measure(
        "proto.nri_create_container_request.decode",
        lambda: nri_messages.read_container_event("CreateContainer", request_bytes),
        n=SAMPLES,
        bytes=len(request_bytes),
    )
    response_bytes = build_create_container_response()
    measure(
        "proto.nri_create_container_response_100_updates.build_encode",
        build_create_container_response,
        n=SAMPLES,
        bytes=len(response_bytes),
    )


if __name__ == "__main__":
    main()
