"""Upstream's ``dra_cpu_*`` metrics, so that its dashboards and alerts work on dracpu.

kubernetes-sigs/dra-driver-cpu 0.3 exports nine metrics (``pkg/metrics/metrics.go``, documented
in ``docs/user/metrics.md``, stability ALPHA); :data:`SPECS` has the same names, types, help texts,
labels and buckets. They sit on ``/metrics`` next to our own ``dracpu_*`` metrics.

- The four gauges are read from the node state at scrape time (:class:`DraCpuMetrics` is a
  collector): CPUs held by prepared claims, CPUs still allocatable (online minus reserved minus
  held), reserved CPUs, prepared claims. Upstream refreshes its gauges after each Prepare and
  Unprepare only; reading the state itself is never stale. Before the state is restored the
  gauges are absent.
- The two counters count per-claim ``NodePrepareResources`` / ``NodeUnprepareResources``
  results by ``result`` (``success``, ``error``; ``unknown`` is exported at 0, as upstream
  initialises all three); the kubelet plugin reports each claim (:meth:`DraCpuMetrics.prepared`,
  :meth:`DraCpuMetrics.unprepared`).
- ``dra_cpu_prepare_claim_duration_seconds`` observes every per-claim Prepare,
  ``dra_cpu_unprepare_claim_duration_seconds`` every per-claim Unprepare;
  ``dra_cpu_claim_allocated_cpus`` the CPU count of a claim's first successful Prepare (not
  the kubelet's repeated Prepares of a claim already prepared; again after its Unprepare).

:func:`descriptors` is what ``dracpu introspect metrics`` prints: upstream's JSON
(``metrics.Descriptors``: name, type, stability, help, labels).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from dracpu.core.state import NodeState

__all__ = [
    "RESULT_ERROR",
    "RESULT_SUCCESS",
    "RESULT_UNKNOWN",
    "SPECS",
    "DraCpuMetrics",
    "MetricSpec",
    "descriptors",
]

# Upstream's stability level of every one of these metrics (pkg/metrics/metrics.go `stability`).
STABILITY = "ALPHA"
# The bounded label domain of `result` (pkg/metrics/metrics.go Result*).
RESULT_SUCCESS = "success"
RESULT_ERROR = "error"
RESULT_UNKNOWN = "unknown"
_RESULTS = (RESULT_SUCCESS, RESULT_ERROR, RESULT_UNKNOWN)

# Go client_golang's prometheus.DefBuckets, which upstream's duration histogram uses.
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Upstream's buckets of dra_cpu_claim_allocated_cpus.
CPU_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One upstream metric: as ``metricSpec`` in pkg/metrics/metrics.go."""

    name: str
    type: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


ALLOCATED_CPUS = MetricSpec(
    "dra_cpu_allocated_cpus",
    "gauge",
    "Number of CPUs currently allocated to prepared resource claims.",
)
AVAILABLE_CPUS = MetricSpec(
    "dra_cpu_available_cpus",
    "gauge",
    "Number of CPUs available for allocation after reserved and active claim CPUs are excluded.",
)
RESERVED_CPUS = MetricSpec(
    "dra_cpu_reserved_cpus",
    "gauge",
    "Number of CPUs reserved and excluded from DRA management.",
)
ACTIVE_CLAIMS = MetricSpec(
    "dra_cpu_resource_claims_active",
    "gauge",
    "Number of resource claims currently recorded as active by the allocation store.",
)
PREPARE_CLAIMS = MetricSpec(
    "dra_cpu_prepare_claims_total",
    "counter",
    "Total number of per-claim PrepareResourceClaims results.",
    labels=("result",),
)
UNPREPARE_CLAIMS = MetricSpec(
    "dra_cpu_unprepare_claims_total",
    "counter",
    "Total number of per-claim UnprepareResourceClaims results.",
    labels=("result",),
)
PREPARE_DURATION = MetricSpec(
    "dra_cpu_prepare_claim_duration_seconds",
    "histogram",
    "Duration of per-claim prepare operations in seconds.",
    buckets=DEFAULT_BUCKETS,
)
UNPREPARE_DURATION = MetricSpec(
    "dra_cpu_unprepare_claim_duration_seconds",
    "histogram",
    "Duration of per-claim unprepare operations in seconds.",
    buckets=DEFAULT_BUCKETS,
)
CLAIM_CPUS = MetricSpec(
    "dra_cpu_claim_allocated_cpus",
    "histogram",
    "Number of CPUs allocated for each newly successful claim allocation.",
    buckets=CPU_BUCKETS,
)

SPECS: tuple[MetricSpec, ...] = (
    ALLOCATED_CPUS,
    AVAILABLE_CPUS,
    RESERVED_CPUS,
    ACTIVE_CLAIMS,
    PREPARE_CLAIMS,
    UNPREPARE_CLAIMS,
    PREPARE_DURATION,
    UNPREPARE_DURATION,
    CLAIM_CPUS,
)


def descriptors() -> list[dict[str, object]]:
    """Upstream's ``metrics.Descriptors()``: one JSON object per metric, in its order."""
    return [
        {
            "name": spec.name,
            "type": spec.type,
            "stability": STABILITY,
            "help": spec.help,
            "labels": list(spec.labels),
        }
        for spec in SPECS
    ]


def _histogram(spec: MetricSpec) -> Histogram:
    """prometheus_client's histogram of ``spec``, in no registry: :class:`DraCpuMetrics`
    collects it."""
    return Histogram(spec.name, spec.help, buckets=spec.buckets, registry=None)


def _collected(histogram: Histogram) -> Iterable[Metric]:
    """The histogram's samples without its ``_created`` one, which upstream's Go metrics do
    not have."""
    for metric in histogram.collect():
        metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
        yield metric


class DraCpuMetrics:
    """The recorder the kubelet plugin reports claims to, and the collector of ``/metrics``.

    ``state`` returns the node state, or ``None`` while it is not restored yet.
    """

    def __init__(self, state: Callable[[], NodeState | None]) -> None:
        self._state = state
        self._prepared = dict.fromkeys(_RESULTS, 0)
        self._unprepared = dict.fromkeys(_RESULTS, 0)
        self._duration = _histogram(PREPARE_DURATION)
        self._unprepare_duration = _histogram(UNPREPARE_DURATION)
        self._claim_cpus = _histogram(CLAIM_CPUS)
        self._counted: set[str] = set()  # claims whose allocation was observed

    def prepared(self, claim_uid: str, ok: bool, seconds: float) -> None:
        """One claim of a ``NodePrepareResources`` call ended (``ok``: without an error)."""
        self._prepared[RESULT_SUCCESS if ok else RESULT_ERROR] += 1
        self._duration.observe(seconds)
        if not ok or claim_uid in self._counted:
            return
        state = self._state()
        claim = state.claims.get(claim_uid) if state is not None else None
        if claim is not None and claim.cpus:
            self._counted.add(claim_uid)
            self._claim_cpus.observe(float(len(claim.cpus)))

    def unprepared(self, claim_uid: str, ok: bool, seconds: float) -> None:
        """One claim of a ``NodeUnprepareResources`` call ended (``ok``: without an error)."""
        self._unprepared[RESULT_SUCCESS if ok else RESULT_ERROR] += 1
        self._unprepare_duration.observe(seconds)
        if ok:
            self._counted.discard(claim_uid)

    def collect(self) -> Iterable[Metric]:
        state = self._state()
        if state is not None:
            config = state.config
            gauges = (
                (ALLOCATED_CPUS, len(state.claimed)),
                (AVAILABLE_CPUS, len(config.allocatable - state.claimed)),
                (RESERVED_CPUS, len(config.reserved)),
                (ACTIVE_CLAIMS, len(state.claims)),
            )
            for spec, value in gauges:
                yield GaugeMetricFamily(spec.name, spec.help, value=float(value))
        for spec, counts in (
            (PREPARE_CLAIMS, self._prepared),
            (UNPREPARE_CLAIMS, self._unprepared),
        ):
            family = CounterMetricFamily(spec.name, spec.help, labels=list(spec.labels))
            for result in _RESULTS:
                family.add_metric([result], float(counts[result]))
            yield family
        for histogram in (self._duration, self._unprepare_duration, self._claim_cpus):
            yield from _collected(histogram)
