"""The daemon's ``/metrics``: one registry of our own and the collectors that fill it.

:func:`build_registry` makes the registry ``/metrics`` serves (:mod:`dracpu.tasks.http`), never
prometheus_client's process-global one. Each collector reads its task's state at scrape time:
the readiness flags and the state owner's counters (``dracpu_ready``, ``dracpu_task_ready``,
``dracpu_state_owner_*``), the NRI side (``dracpu_nri_*``: connected, synchronized, the
runtime and its versions, unsolicited updates by outcome) and the pod-resources sync
(``dracpu_podresources_*``: whether it works, Lists by outcome, orphan claims released and
waiting) and the confined host cgroups (``dracpu_host_cgroup_confined``).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Info, PlatformCollector, ProcessCollector
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from dracpu import __version__
from dracpu.adapters.host_cgroups import CgroupState
from dracpu.tasks.http import Readiness
from dracpu.tasks.nri_link import NriStatus
from dracpu.tasks.podresources_sync import PodResourcesStatus
from dracpu.tasks.state_owner import OwnerStatistics

__all__ = ["build_registry"]


class _DaemonCollector:
    """Reads the owner's statistics and the readiness flags at scrape time."""

    def __init__(
        self, owner_statistics: Callable[[], OwnerStatistics] | None, readiness: Readiness
    ) -> None:
        self._owner_statistics = owner_statistics
        self._readiness = readiness

    def collect(self) -> Iterable[Metric]:
        ready = GaugeMetricFamily(
            "dracpu_task_ready", "1 when the task reports ready, else 0.", labels=["task"]
        )
        for flag in self._readiness.flags():
            ready.add_metric([flag.name], 1.0 if flag.ready else 0.0)
        yield ready
        yield GaugeMetricFamily(
            "dracpu_ready",
            "1 when /readyz answers 200.",
            value=1.0 if self._readiness.is_ready() else 0.0,
        )
        if self._owner_statistics is None:
            return
        stats = self._owner_statistics()
        commands = CounterMetricFamily(
            "dracpu_state_owner_commands",
            "Commands handled by the state owner, by type and outcome (ok, error, failed).",
            labels=["command", "outcome"],
        )
        for (command, outcome), count in sorted(stats.by_command.items()):
            commands.add_metric([command, outcome], float(count))
        yield commands
        yield CounterMetricFamily(
            "dracpu_state_owner_effects_failed",
            "Effects (file writes, NRI updates, ...) that failed.",
            value=float(stats.effects_failed),
        )
        yield GaugeMetricFamily(
            "dracpu_state_owner_queue_depth",
            "Commands waiting for the state owner.",
            value=float(stats.queue_depth),
        )


class _NriCollector:
    """The NRI side, read from :meth:`NriLink.status <dracpu.tasks.nri_link.NriLink.status>`."""

    def __init__(self, nri_status: Callable[[], NriStatus]) -> None:
        self._nri_status = nri_status

    def collect(self) -> Iterable[Metric]:
        status = self._nri_status()
        yield GaugeMetricFamily(
            "dracpu_nri_connected",
            "1 while a runtime has accepted our NRI registration.",
            value=float(status.connected),
        )
        yield GaugeMetricFamily(
            "dracpu_nri_synchronized",
            "1 once the connected runtime's Synchronize was answered (every container pinned).",
            value=float(status.synchronized),
        )
        yield CounterMetricFamily(
            "dracpu_nri_connections",
            "Synchronized NRI connections since the start (1 + reconnects).",
            value=float(status.connections),
        )
        updates = CounterMetricFamily(
            "dracpu_nri_unsolicited_updates",
            "Unsolicited UpdateContainers (widening after Unprepare), by outcome.",
            labels=["outcome"],
        )
        updates.add_metric(["sent"], float(status.unsolicited_sent))
        updates.add_metric(["failed"], float(status.unsolicited_failed))
        updates.add_metric(["dropped"], float(status.unsolicited_dropped))
        yield updates
        runtime = InfoMetricFamily("dracpu_nri_runtime", "The runtime on the NRI socket.")
        runtime.add_metric(
            [],
            {
                "name": status.runtime_name,
                "version": status.runtime_version,
                "nri_version": status.nri_version,
                "unsolicited_updates": str(status.unsolicited_updates).lower(),
            },
        )
        yield runtime


class _PodResourcesCollector:
    """The pod-resources sync, read from its :class:`PodResourcesStatus`."""

    def __init__(self, status: PodResourcesStatus) -> None:
        self._status = status

    def collect(self) -> Iterable[Metric]:
        status = self._status
        yield GaugeMetricFamily(
            "dracpu_podresources_sync_working",
            "1 while the kubelet answers PodResources List and its answers show DRA claims, "
            "or its version lists them by default (every orphan claim can be released), else 0.",
            value=float(status.working),
        )
        yield GaugeMetricFamily(
            "dracpu_podresources_answered",
            "1 when the last PodResources List was answered, else 0.",
            value=float(status.answered),
        )
        lists = CounterMetricFamily(
            "dracpu_podresources_lists",
            "PodResources List calls by outcome (ok, no_claims: the answer showed no DRA claim "
            "at all, rate_limited, error).",
            labels=["outcome"],
        )
        for outcome in ("ok", "no_claims", "rate_limited", "error"):
            lists.add_metric([outcome], float(status.lists[outcome]))
        yield lists
        yield CounterMetricFamily(
            "dracpu_orphan_claims_released",
            "Prepared claims released because no pod referenced them and no container used them.",
            value=float(status.released),
        )
        yield GaugeMetricFamily(
            "dracpu_podresources_orphan_candidates",
            "Prepared claims the last PodResources listing missed, kept while their grace runs.",
            value=float(status.waiting),
        )


class _HostCgroupsCollector:
    """The host cgroups, read from the state owner's
    :meth:`~dracpu.tasks.state_owner.StateOwner.host_cgroups`."""

    def __init__(self, states: Callable[[], tuple[CgroupState, ...]]) -> None:
        self._states = states

    def collect(self) -> Iterable[Metric]:
        confined = GaugeMetricFamily(
            "dracpu_host_cgroup_confined",
            "1 while a listed host cgroup (--confine-host-cgroups) is confined to the shared "
            "pool plus the reserved CPUs, 0 while it cannot be (/readyz says why; also 0 for "
            "one no longer listed that could not be given back what it held).",
            labels=["cgroup"],
        )
        for state in self._states():
            confined.add_metric([state.path], 0.0 if state.problem else 1.0)
        yield confined


def build_registry(
    readiness: Readiness,
    owner_statistics: Callable[[], OwnerStatistics] | None = None,
    nri_status: Callable[[], NriStatus] | None = None,
    podresources_status: PodResourcesStatus | None = None,
    host_cgroups: Callable[[], tuple[CgroupState, ...]] | None = None,
) -> CollectorRegistry:
    """Our own metrics registry: build info, process and Python metrics, readiness, the state
    owner's counters, the NRI side, the pod-resources sync and the host cgroups (each left out
    when its source is ``None``)."""
    registry = CollectorRegistry()
    Info("dracpu_build", "dracpu build information.", registry=registry).info(
        {"version": __version__, "python_version": platform.python_version()}
    )
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    registry.register(_DaemonCollector(owner_statistics, readiness))
    if nri_status is not None:
        registry.register(_NriCollector(nri_status))
    if podresources_status is not None:
        registry.register(_PodResourcesCollector(podresources_status))
    if host_cgroups is not None:
        registry.register(_HostCgroupsCollector(host_cgroups))
    return registry
