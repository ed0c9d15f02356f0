"""Upstream's dra_cpu_* metrics: names, types, labels, values from the node state."""

from __future__ import annotations

import json
import subprocess
import sys
from types import MappingProxyType

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.core.cpuset import CpuSet
from dracpu.core.node_config import NodeConfig
from dracpu.core.state import NodeState
from dracpu.sim.topologies import build_topology, fixture
from dracpu.tasks.dra_cpu_metrics import SPECS, DraCpuMetrics, descriptors

# Upstream 0.3's nine metrics (kubernetes-sigs/dra-driver-cpu docs/user/metrics.md):
# name -> (type, labels).
UPSTREAM = {
    "dra_cpu_allocated_cpus": ("gauge", []),
    "dra_cpu_available_cpus": ("gauge", []),
    "dra_cpu_reserved_cpus": ("gauge", []),
    "dra_cpu_resource_claims_active": ("gauge", []),
    "dra_cpu_prepare_claims_total": ("counter", ["result"]),
    "dra_cpu_unprepare_claims_total": ("counter", ["result"]),
    "dra_cpu_prepare_claim_duration_seconds": ("histogram", []),
    "dra_cpu_unprepare_claim_duration_seconds": ("histogram", []),
    "dra_cpu_claim_allocated_cpus": ("histogram", []),
}


def _state() -> NodeState:
    topology = build_topology(fixture("dual-socket-smt2"))
    config = NodeConfig.build("n", topology, reserved=CpuSet.parse("0,1"))
    claims = {
        "a": PreparedClaim("a", CpuSet.parse("2-5")),
        "b": PreparedClaim("b", CpuSet.parse("8-9")),
    }
    return NodeState(
        config=config, claims=MappingProxyType(claims), claimed=CpuSet.parse("2-5,8-9")
    )


def _scrape(
    metrics: DraCpuMetrics,
) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    registry = CollectorRegistry()
    registry.register(metrics)
    text = generate_latest(registry).decode()
    out: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            out.setdefault(family.name, {})[key] = sample.value
    return out


def test_introspect_lists_upstreams_metrics_in_its_json() -> None:
    described = descriptors()
    assert len(described) == 9
    assert {d["name"]: (d["type"], d["labels"]) for d in described} == UPSTREAM
    assert all(d["stability"] == "ALPHA" and d["help"] for d in described)
    assert [d["name"] for d in described] == [s.name for s in SPECS]


def test_dracpu_introspect_metrics_prints_them() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dracpu", "introspect", "metrics"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert {d["name"] for d in json.loads(result.stdout)} == set(UPSTREAM)


def test_gauges_come_from_the_state() -> None:
    scraped = _scrape(DraCpuMetrics(_state))
    gauges = {name: scraped[name][(name, ())] for name in list(UPSTREAM)[:4]}
    # 64 online CPUs, 2 reserved; the claims hold 2-5 and 8-9.
    assert len(_state().config.topology.online) == 64
    assert gauges == {
        "dra_cpu_allocated_cpus": 6.0,
        "dra_cpu_available_cpus": 56.0,
        "dra_cpu_reserved_cpus": 2.0,
        "dra_cpu_resource_claims_active": 2.0,
    }


def test_no_gauges_before_the_state_is_restored_but_counters_at_zero() -> None:
    scraped = _scrape(DraCpuMetrics(lambda: None))
    assert "dra_cpu_allocated_cpus" not in scraped
    assert scraped["dra_cpu_prepare_claims"] == {
        ("dra_cpu_prepare_claims_total", (("result", r),)): 0.0
        for r in ("success", "error", "unknown")
    }


def test_prepare_and_unprepare_are_counted_and_timed_per_claim() -> None:
    metrics = DraCpuMetrics(_state)
    metrics.prepared("a", True, 0.004)
    metrics.prepared("a", True, 0.002)  # the kubelet prepares a prepared claim again
    metrics.prepared("b", True, 0.2)
    metrics.prepared("c", False, 7.0)
    metrics.unprepared("a", True, 0.001)
    metrics.unprepared("x", False, 3.0)
    metrics.prepared("a", True, 0.003)  # prepared anew after its Unprepare
    scraped = _scrape(metrics)
    prepare = scraped["dra_cpu_prepare_claims"]
    assert prepare[("dra_cpu_prepare_claims_total", (("result", "success"),))] == 4.0
    assert prepare[("dra_cpu_prepare_claims_total", (("result", "error"),))] == 1.0
    unprepare = scraped["dra_cpu_unprepare_claims"]
    assert unprepare[("dra_cpu_unprepare_claims_total", (("result", "success"),))] == 1.0
    assert unprepare[("dra_cpu_unprepare_claims_total", (("result", "error"),))] == 1.0
    duration = scraped["dra_cpu_prepare_claim_duration_seconds"]
    name = "dra_cpu_prepare_claim_duration_seconds"
    assert duration[(f"{name}_count", ())] == 5.0
    assert duration[(f"{name}_bucket", (("le", "0.005"),))] == 3.0
    assert duration[(f"{name}_bucket", (("le", "0.25"),))] == 4.0
    assert duration[(f"{name}_bucket", (("le", "5.0"),))] == 4.0
    assert duration[(f"{name}_bucket", (("le", "+Inf"),))] == 5.0
    assert abs(duration[(f"{name}_sum", ())] - 7.209) < 1e-9
    name = "dra_cpu_unprepare_claim_duration_seconds"
    undo = scraped[name]
    assert undo[(f"{name}_count", ())] == 2.0
    assert undo[(f"{name}_bucket", (("le", "0.005"),))] == 1.0
    assert undo[(f"{name}_bucket", (("le", "2.5"),))] == 1.0
    assert undo[(f"{name}_bucket", (("le", "5.0"),))] == 2.0
    assert abs(undo[(f"{name}_sum", ())] - 3.001) < 1e-9
    cpus = scraped["dra_cpu_claim_allocated_cpus"]
    # a (4 CPUs) twice: first Prepare and again after its Unprepare; b (2 CPUs) once.
    assert cpus[("dra_cpu_claim_allocated_cpus_count", ())] == 3.0
    assert cpus[("dra_cpu_claim_allocated_cpus_bucket", (("le", "2.0"),))] == 1.0
    assert cpus[("dra_cpu_claim_allocated_cpus_bucket", (("le", "4.0"),))] == 3.0
    assert cpus[("dra_cpu_claim_allocated_cpus_sum", ())] == 10.0
