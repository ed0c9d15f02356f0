"""Host cgroups confined to the shared pool (:mod:`dracpu.core.host_cgroups`): the paths that
may be listed, the order of cgroup v1 writes, and the effect the state machine emits as claims
come and go."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dracpu.core.commands import DeviceResult, PrepareClaim, Resync, UnprepareClaim
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import GroupBy
from dracpu.core.effects import (
    ClaimPrepared,
    ClaimUnprepared,
    ConfineHostCgroups,
    Effect,
    Reply,
    Resynced,
    WriteCheckpoint,
)
from dracpu.core.host_cgroups import (
    check_cgroup_path,
    check_cgroup_paths,
    pods_cgroup_name,
    v1_wanted,
    v1_write_order,
)
from dracpu.core.state import NodeState, apply, check_invariants
from dracpu.errors import InsufficientCpusError
from tests.core.state_helpers import NODE, FakeDisk, config_for, cpus, run, uid

# --- the paths -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("system.slice", "system.slice"),
        ("/system.slice", "system.slice"),  # as systemd and the kubelet write cgroup names
        ("kubelet.slice", "kubelet.slice"),
        ("system.slice/containerd.service", "system.slice/containerd.service"),
        ("podman", "podman"),
        ("kubepodsish", "kubepodsish"),  # not the kubelet's name
    ],
)
def test_good_paths(text: str, path: str) -> None:
    assert check_cgroup_path(text) == path


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "is the cgroup root"),
        ("/", "is the cgroup root"),
        ("a//b", "without empty, . or .. parts"),
        ("a/", "without empty, . or .. parts"),
        ("../etc", "without empty, . or .. parts"),
        ("a/./b", "without empty, . or .. parts"),
        ("system\nslice", "control character"),
        # the kubelet's pods' cgroup, by cgroup driver and cgroupRoot, and what is below it
        ("kubepods", "the kubelet's cgroup of the pods ('kubepods')"),
        ("kubepods/burstable", "the kubelet's cgroup of the pods ('kubepods')"),
        ("kubepods.slice", "the kubelet's cgroup of the pods ('kubepods.slice')"),
        ("/kubepods.slice/kubepods-besteffort.slice", "'kubepods.slice'"),
        ("kubelet.slice/kubelet-kubepods.slice", "'kubelet-kubepods.slice'"),
        ("foo/kubepods", "'kubepods'"),  # cgroupfs driver, cgroupRoot /foo
        ("kubepods-burstable.slice", "'kubepods-burstable.slice'"),
    ],
)
def test_bad_paths_are_refused_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)) as error:
        check_cgroup_path(text)
    assert "\n" not in str(error.value)


def test_a_list_refuses_duplicates_and_nesting() -> None:
    assert check_cgroup_paths(["system.slice", "/kubelet.slice"]) == (
        "system.slice",
        "kubelet.slice",
    )
    with pytest.raises(ValueError, match=re.escape("'/system.slice' is listed twice")):
        check_cgroup_paths(["system.slice", "/system.slice"])
    with pytest.raises(ValueError, match=re.escape("'system.slice/a' is inside 'system.slice'")):
        check_cgroup_paths(["system.slice/a", "system.slice"])
    with pytest.raises(ValueError, match=re.escape("'system.slice/a' is inside 'system.slice'")):
        check_cgroup_paths(["system.slice", "system.slice/a"])
    with pytest.raises(ValueError, match=r"^'kubepods\.slice' is, or is inside, the kubelet's"):
        check_cgroup_paths(["system.slice", "kubepods.slice"])
    assert check_cgroup_paths(["system.slice", "system.slicer"]) == (
        "system.slice",
        "system.slicer",
    )


def test_pods_names_are_the_kubelets() -> None:
    pods = ["kubepods", "kubepods.slice", "kubelet-kubepods.slice", "kubepods-pod1_2.slice"]
    others = ["system.slice", "kubelet.slice", "kubepodsx", "my-kubepods", "runtime.slice"]
    assert [name for name in pods + others if pods_cgroup_name(name)] == pods


# --- the order of cgroup v1 writes ------------------------------------------------------------


def test_v1_shrinks_children_first_and_widens_parents_first() -> None:
    current = {"s": cpus("0-7"), "s/a": cpus("0-7"), "s/a/b": cpus("2-3")}
    shrunk = v1_wanted("s", cpus("0-1,6-7"), current)
    # b held 2-3, none of which stays: it gets all of its parent's
    assert shrunk == {"s": cpus("0-1,6-7"), "s/a": cpus("0-1,6-7"), "s/a/b": cpus("0-1,6-7")}
    assert v1_write_order(current, shrunk) == [
        ("s/a/b", cpus("0-3,6-7")),  # widened first (6-7 are new to it), parents before
        ("s/a/b", cpus("0-1,6-7")),
        ("s/a", cpus("0-1,6-7")),
        ("s", cpus("0-1,6-7")),
    ]
    # widened, each gets back what it held before that the pool has again: b its cpu 2-3
    widened = v1_wanted("s", cpus("0-3,6-7"), current)
    assert v1_write_order(shrunk, widened) == [
        ("s", cpus("0-3,6-7")),
        ("s/a", cpus("0-3,6-7")),
        ("s/a/b", cpus("0-3,6-7")),
        ("s/a/b", cpus("2-3")),
    ]
    # a cgroup that keeps some of its CPUs keeps only those
    assert v1_wanted("s", cpus("3-7"), current)["s/a/b"] == cpus("3")
    assert v1_write_order(current, current) == []


def _trees() -> st.SearchStrategy[dict[str, CpuSet]]:
    """A v1 subtree "s" with up to 6 cgroups below it, each cpuset within its parent's."""

    def subset(parent: CpuSet) -> st.SearchStrategy[CpuSet]:
        return st.sets(st.sampled_from(sorted(parent)), min_size=1).map(CpuSet)

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, CpuSet]:
        tree = {"s": draw(subset(CpuSet.range(0, 8)))}
        for index in range(draw(st.integers(0, 6))):
            parent = draw(st.sampled_from(sorted(tree)))
            tree[f"{parent}/c{index}"] = draw(subset(tree[parent]))
        return tree

    return build()


def _walk(now: dict[str, CpuSet], wanted: dict[str, CpuSet]) -> None:
    """Apply the writes to ``now``, checking the kernel's rule (cgroup v1 ``validate_change``:
    each cpuset within its parent's, never empty) after each."""
    for path, value in v1_write_order(now, wanted):
        assert value, path
        now[path] = value
        for child, held in now.items():
            parent = child.rpartition("/")[0]
            if parent:
                assert held <= now[parent], (child, held, parent, now[parent])
    assert now == wanted


@given(
    tree=_trees(),
    targets=st.lists(st.sets(st.integers(0, 7), min_size=1).map(CpuSet), min_size=1, max_size=4),
)
def test_v1_every_step_keeps_each_cpuset_within_its_parents(
    tree: dict[str, CpuSet], targets: list[CpuSet]
) -> None:
    now = dict(tree)
    for target in targets:  # claims come and go
        wanted = v1_wanted("s", target, tree)
        assert wanted["s"] == target
        _walk(now, wanted)
    # and back: giving the cgroups back what they held is as safe
    _walk(now, tree)
    # a target that holds every CPU the subtree held gives each back what it held
    assert v1_wanted("s", tree["s"], tree) == tree


# --- the state machine ------------------------------------------------------------------------

LISTED = ("system.slice", "kubelet.slice")


def _state(reserved: str = "0,8", **options: object) -> NodeState:
    return NodeState.initial(replace(config_for(reserved=reserved, **options), host_cgroups=LISTED))  # type: ignore[arg-type]


def _grouped(n: int, count: int, device: str = "cpudevnuma000") -> PrepareClaim:
    result = DeviceResult(request="r", pool=NODE, device=device, consumed_cpus=count)
    return PrepareClaim(uid(n), "ns", f"claim-{n}", (result,))


def test_prepare_confines_after_the_checkpoint_and_unprepare_widens_before_the_reply() -> None:
    state = _state()
    assert state.host_pool == CpuSet.range(0, 16)  # shared 1-7,9-15 plus reserved 0,8
    new, effects = apply(state, _grouped(1, 2))
    reply = effects[-1]
    assert isinstance(reply, Reply)
    assert isinstance(reply.value, ClaimPrepared)
    held = reply.value.cpus
    assert [type(e) for e in effects[-3:]] == [WriteCheckpoint, ConfineHostCgroups, Reply]
    assert effects[-2] == ConfineHostCgroups(LISTED, CpuSet.range(0, 16) - held)
    check_invariants(new, state)

    back, effects = apply(new, UnprepareClaim(uid(1)))
    assert [type(e) for e in effects[-3:]] == [WriteCheckpoint, ConfineHostCgroups, Reply]
    assert effects[-2] == ConfineHostCgroups(LISTED, CpuSet.range(0, 16))
    assert effects[-1] == Reply(ClaimUnprepared(uid(1), held))
    assert back.host_pool == state.host_pool


def test_nothing_is_confined_when_nothing_is_listed() -> None:
    state = NodeState.initial(config_for())
    _, effects = apply(state, _grouped(1, 2))
    assert not any(isinstance(e, ConfineHostCgroups) for e in effects)


def test_isolated_cpus_are_not_host_cpus_but_reserved_ones_are() -> None:
    state = _state(reserved="0", isolated="7,15")
    assert state.host_pool == CpuSet.range(0, 16) - cpus("7,15")


def test_a_prepare_that_leaves_the_host_cgroups_no_cpu_is_refused() -> None:
    # machine mode, no reserved CPU: every CPU in claims would leave the host cgroups nothing
    state = _state(reserved="", group_by=GroupBy.MACHINE)
    whole = PrepareClaim(
        uid(1),
        "ns",
        "all",
        (DeviceResult(request="r", pool=NODE, device="cpudevmachine", consumed_cpus=16),),
    )
    new, effects = apply(state, whole)
    assert new is state
    (reply,) = effects
    assert isinstance(reply, Reply)
    assert isinstance(reply.value, InsufficientCpusError)
    assert "would leave no CPU for the confined host cgroups" in str(reply.value)
    # with a reserved CPU, the host cgroups keep that one
    reserved = _state(reserved="0", group_by=GroupBy.MACHINE)
    whole = replace(whole, results=(replace(whole.results[0], consumed_cpus=15),))
    new, effects = apply(reserved, whole)
    assert effects[-2] == ConfineHostCgroups(LISTED, cpus("0"))


def test_a_sighup_lists_others_and_a_resync_always_confines() -> None:
    state = _state()
    new, effects = apply(state, Resync(host_cgroups=("system.slice",)))
    assert new.config.host_cgroups == ("system.slice",)
    (confine,) = [e for e in effects if isinstance(e, ConfineHostCgroups)]
    assert confine == ConfineHostCgroups(("system.slice",), state.host_pool)
    assert "host cgroups confined to the shared pool: system.slice" in _resynced(effects)
    # removed: the Resync still confines (nothing), which gives back what was found
    gone, effects = apply(new, Resync(host_cgroups=()))
    assert ConfineHostCgroups((), state.host_pool) in effects
    assert "host cgroups confined to the shared pool: none" in _resynced(effects)
    check_invariants(gone, new)


def _resynced(effects: list[Effect]) -> str:
    (reply,) = [e for e in effects if isinstance(e, Reply)]
    assert isinstance(reply.value, Resynced)
    return reply.value.describe()


def test_a_failed_checkpoint_confines_nothing_and_a_rollback_restores_the_old_pool() -> None:
    state = _state()
    disk = FakeDisk()
    new, value = run(state, _grouped(1, 2), disk)
    assert isinstance(value, ClaimPrepared)
    assert disk.cgroups == (LISTED, new.host_pool)
    # the Unprepare's checkpoint fails: the cgroups are never widened
    disk.fail_at = disk.executed + 2  # DeleteCdiSpec, DeleteDeviceMetadata, WriteCheckpoint
    kept, value = run(new, UnprepareClaim(uid(1)), disk)
    assert kept is new
    assert disk.cgroups == (LISTED, new.host_pool)
    # the confinement itself failing (it never does: the adapter reports) is undone as well
    disk.fail_at = disk.executed + 3
    kept, value = run(new, UnprepareClaim(uid(1)), disk)
    assert kept is new
    assert disk.cgroups == (LISTED, new.host_pool)
