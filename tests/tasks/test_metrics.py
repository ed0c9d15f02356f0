"""The daemon's metrics registry: what each collector reports at scrape time, in the
Prometheus text format (parsed back by prometheus_client's own parser)."""

from __future__ import annotations

from types import MappingProxyType

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dracpu.adapters.host_cgroups import CgroupState
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import UpdateContainers
from dracpu.tasks.http import Readiness
from dracpu.tasks.metrics import build_registry
from dracpu.tasks.nri_link import NriLink, NriStatus
from dracpu.tasks.podresources_sync import PodResourcesStatus
from dracpu.tasks.state_owner import OwnerStatistics


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_nri_side_is_read_at_scrape_time() -> None:
    link = NriLink()
    registry = build_registry(Readiness(), nri_status=link.status)
    before = _samples(generate_latest(registry).decode())
    assert before[("dracpu_nri_connected", ())] == 0.0
    assert before[("dracpu_nri_synchronized", ())] == 0.0
    assert before[("dracpu_nri_connections_total", ())] == 0.0

    for _ in range(3):  # before a runtime synchronizes, the owner's updates are dropped
        link.submit(UpdateContainers(()))
    link.configured(("containerd", "v2.4.0", "v0.12.2"), unsolicited=True)
    link.mark_synchronized()
    link.mark_synchronized()  # a second connection
    for failed in (False, False, True, False, False):
        link.update_sent(failed=failed)
    after = _samples(generate_latest(registry).decode())
    assert after[("dracpu_nri_connected", ())] == 1.0
    assert after[("dracpu_nri_synchronized", ())] == 1.0
    assert after[("dracpu_nri_connections_total", ())] == 2.0
    for outcome, count in (("sent", 5.0), ("failed", 1.0), ("dropped", 3.0)):
        key = ("dracpu_nri_unsolicited_updates_total", (("outcome", outcome),))
        assert after[key] == count
    info = (
        ("name", "containerd"),
        ("nri_version", "v0.12.2"),
        ("unsolicited_updates", "true"),
        ("version", "v2.4.0"),
    )
    assert after[("dracpu_nri_runtime_info", info)] == 1.0


def test_sources_left_out_report_nothing() -> None:
    readiness = Readiness()
    readiness.flag("state-owner").set_ready()
    text = generate_latest(build_registry(readiness)).decode()
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {"dracpu_ready", "dracpu_task_ready", "dracpu_build_info"} <= names
    assert not any(
        name.startswith(("dracpu_nri", "dracpu_state_owner", "dracpu_podresources"))
        for name in names
    )


def test_the_pod_resources_sync_is_read_at_scrape_time() -> None:
    status = PodResourcesStatus()
    registry = build_registry(Readiness(), podresources_status=status)
    before = _samples(generate_latest(registry).decode())
    assert before[("dracpu_podresources_sync_working", ())] == 0.0
    assert before[("dracpu_podresources_answered", ())] == 0.0
    assert before[("dracpu_orphan_claims_released_total", ())] == 0.0

    status.answered = True  # answered, but no claim shown: not working
    status.lists.update({"no_claims": 2, "error": 1})
    middle = _samples(generate_latest(registry).decode())
    assert middle[("dracpu_podresources_answered", ())] == 1.0
    assert middle[("dracpu_podresources_sync_working", ())] == 0.0

    status.reports_claims = True
    status.lists.update({"ok": 4, "rate_limited": 3})
    status.released, status.waiting = 2, 5
    after = _samples(generate_latest(registry).decode())
    assert after[("dracpu_podresources_sync_working", ())] == 1.0
    assert after[("dracpu_orphan_claims_released_total", ())] == 2.0
    assert after[("dracpu_podresources_orphan_candidates", ())] == 5.0
    lists = {
        labels[0][1]: value
        for (name, labels), value in after.items()
        if name == "dracpu_podresources_lists_total"
    }
    assert lists == {"ok": 4.0, "no_claims": 2.0, "rate_limited": 3.0, "error": 1.0}


def test_the_owner_and_the_nri_side_together() -> None:
    stats = OwnerStatistics(1, 0, 0, 0, MappingProxyType({("Resync", "ok"): 1}))
    status = NriStatus(False, False, "", "", "", False, 0, 0, 0, 0, "")
    registry = build_registry(Readiness(), lambda: stats, lambda: status)
    samples = _samples(generate_latest(registry).decode())
    key = ("dracpu_state_owner_commands_total", (("command", "Resync"), ("outcome", "ok")))
    assert samples[key] == 1.0
    assert samples[("dracpu_nri_connected", ())] == 0.0


def test_the_host_cgroups_are_read_at_scrape_time() -> None:
    states: list[CgroupState] = []
    registry = build_registry(Readiness(), host_cgroups=lambda: tuple(states))
    assert not any(
        name == "dracpu_host_cgroup_confined"
        for name, _ in _samples(generate_latest(registry).decode())
    )
    states[:] = [
        CgroupState("system.slice", CpuSet.parse("0-3")),
        CgroupState("runtime.slice", None, "no such cgroup"),
    ]
    after = _samples(generate_latest(registry).decode())
    assert after[("dracpu_host_cgroup_confined", (("cgroup", "system.slice"),))] == 1.0
    assert after[("dracpu_host_cgroup_confined", (("cgroup", "runtime.slice"),))] == 0.0
