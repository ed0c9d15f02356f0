"""Publishing a 1024-CPU node's ResourceSlices, in individual mode (1024 devices) and grouped mode
(8 NUMA devices), each plain and with ``--expose-pcie-roots`` and the KEP-5517 mapping on
(``_pcie``: 16 PCIe roots, 64-device slices).

Run: ``.venv/bin/python bench/bench_publish.py``. Figures (ms, p50/p99 over a few runs):

* ``publish.big_1024_<case>.build``: topology model, devices and slice objects (pure);
* ``publish.big_1024_<case>.first_publish``: from starting the slice publisher to its
  ``started()`` (Node GET, LIST, the creates over HTTP to the in-process fake API server, with the
  real ``kubernetes`` client), the server checking every slice against the apiserver's own rules
  but NOT the OpenAPI schema: our side's cost plus a thin server;
* ``publish.big_1024_individual[_pcie].first_publish_schema``: the same with the fake server also
  validating each slice against the strict OpenAPI schema (``jsonschema``, in the same process and
  event loop: an upper bound, not what a real API server costs us);
* ``publish.big_1024_individual.republish_after_wipe``: a kubelet restart deletes the 8 slices;
  from the wipe to all 8 back (watch event, debounce, LIST, 8 creates), no schema check.

Each publish run starts on an empty pool (the previous run's slices are wiped).
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio

from bench._harness import emit, measure, percentiles
from dracpu.adapters.kube import KubeClient, open_kube_client
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, Device, GroupBy, published_devices
from dracpu.core.slices import SliceOptions, build_resource_slices
from dracpu.sim.fake_apiserver import FakeApiServer, open_fake_apiserver
from dracpu.sim.topologies import FIXTURES, build_topology
from dracpu.tasks import slice_publisher
from dracpu.tasks.slice_publisher import (
    PublisherSettings,
    Republish,
    republish_channel,
    request_republish,
)

__all__ = ["main"]

NODE = "bench-node"
TOPOLOGY = "big-1024"  # 2 sockets x 4 NUMA x 4 L3 x 16 cores x SMT2
RUNS = 7  # publish runs per figure (each a few hundred ms)
WARMUP = 1
# The publisher's debounce is part of the republish figure; the default (0.2 s) would dominate it.
SETTINGS = PublisherSettings(debounce=0.01)


@dataclass(frozen=True)
class Case:
    """One way to publish the node."""

    name: str
    mode: CpuDeviceMode
    pcie: bool  # --expose-pcie-roots and publishNodeAllocatableResourceMapping
    schema: bool  # also measure with the fake server's OpenAPI schema check

    @property
    def options(self) -> SliceOptions:
        return SliceOptions(node_allocatable=self.pcie, expose_pcie_roots=self.pcie)

    def devices(self) -> list[Device]:
        topology = build_topology(FIXTURES[TOPOLOGY], pcie_roots=self.pcie)
        return published_devices(
            topology, reserved=CpuSet(), mode=self.mode, group_by=GroupBy.NUMANODE
        )

    def slices(self) -> int:
        return len(build_resource_slices(NODE, self.devices(), options=self.options))


CASES = (
    Case("individual", CpuDeviceMode.INDIVIDUAL, pcie=False, schema=True),
    Case("individual_pcie", CpuDeviceMode.INDIVIDUAL, pcie=True, schema=True),
    Case("grouped", CpuDeviceMode.GROUPED, pcie=False, schema=False),
    Case("grouped_pcie", CpuDeviceMode.GROUPED, pcie=True, schema=False),
)


async def first_publish(
    api: FakeApiServer, kube: KubeClient, case: Case, devices: list[Device], slices: int
) -> float:
    api.kubelet_restart(NODE)
    send, receive = republish_channel()
    request_republish(send, Republish("start", tuple(devices)))
    run = functools.partial(
        slice_publisher.run, kube, NODE, receive, options=case.options, settings=SETTINGS
    )
    start = time.perf_counter()
    async with send, receive, anyio.create_task_group() as tg:
        await tg.start(run)
        elapsed = time.perf_counter() - start
        tg.cancel_scope.cancel()
    if len(api.slice_names(node_name=NODE)) != slices:
        raise RuntimeError("the publish did not complete")
    return elapsed * 1000


async def republish_after_wipe(
    api: FakeApiServer, kube: KubeClient, devices: list[Device], runs: int
) -> list[float]:
    samples: list[float] = []
    send, receive = republish_channel()
    request_republish(send, Republish("start", tuple(devices)))
    async with send, receive, anyio.create_task_group() as tg:
        await tg.start(
            functools.partial(slice_publisher.run, kube, NODE, receive, settings=SETTINGS)
        )
        for _ in range(runs + WARMUP):
            with anyio.fail_after(30):
                while api.open_watches < 1:  # noqa: ASYNC110 (the publisher's watch is up)
                    await anyio.sleep(0.005)
            start = time.perf_counter()
            api.kubelet_restart(NODE)
            with anyio.fail_after(30):
                while len(api.slice_names(node_name=NODE)) < 8:  # noqa: ASYNC110
                    await anyio.sleep(0.001)
            samples.append((time.perf_counter() - start) * 1000)
            await anyio.sleep(0.1)  # let the publisher settle
        tg.cancel_scope.cancel()
    return samples[WARMUP:]


async def publish_figures(case: Case) -> None:
    devices = case.devices()
    slices = case.slices()
    for schema, name in ((False, "first_publish"), (True, "first_publish_schema")):
        if schema and not case.schema:
            continue
        async with open_fake_apiserver(schema_validation=schema) as api:
            api.add_node(NODE)
            async with open_kube_client(api.kubeconfig_path) as kube:
                samples = [
                    await first_publish(api, kube, case, devices, slices)
                    for _ in range(RUNS + WARMUP)
                ]
                p50, p99 = percentiles(samples[WARMUP:])
                emit(
                    f"publish.big_1024_{case.name}.{name}",
                    "ms",
                    p50=round(p50, 1),
                    p99=round(p99, 1),
                    n=RUNS,
                    devices=len(devices),
                    slices=slices,
                )
                if not schema and case.name == "individual":
                    wiped = await republish_after_wipe(api, kube, devices, RUNS)
                    p50, p99 = percentiles(wiped)
                    emit(
                        "publish.big_1024_individual.republish_after_wipe",
                        "ms",
                        p50=round(p50, 1),
                        p99=round(p99, 1),
                        n=RUNS,
                        debounce_ms=SETTINGS.debounce * 1000,
                    )


def build(case: Case) -> list[dict[str, Any]]:
    """What the build figure measures: model, devices and slices."""
    return build_resource_slices(NODE, case.devices(), options=case.options, owner_uid="uid")


def main() -> None:
    for case in CASES:
        measure(
            f"publish.big_1024_{case.name}.build",
            functools.partial(build, case),
            n=20,
            devices=len(case.devices()),
        )
        anyio.run(publish_figures, case, backend="asyncio")


if __name__ == "__main__":
    main()
