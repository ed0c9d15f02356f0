"""The topology-aware allocator: ported kubelet cases, our own rules, and properties."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dracpu.core.allocator import AllocationPolicy, Strategy, allocate, describe_plan
from dracpu.core.cpuset import CpuSet
from dracpu.core.topology import CoreType, CpuInfo, Topology
from dracpu.errors import AllocationError, InsufficientCpusError
from dracpu.sim.topologies import FIXTURES, MachineSpec, build_topology
from tests.core import kubelet_cases
from tests.core.kubelet_cases import CASES, KubeletCase

PACKED = AllocationPolicy()
SPREAD = AllocationPolicy(strategy=Strategy.SPREAD)
FULL = AllocationPolicy(full_cores=True)
NO_TYPE_PREFERENCE = AllocationPolicy(prefer_core_type=None)


def fx(name: str) -> Topology:
    return build_topology(FIXTURES[name])


def cs(text: str) -> CpuSet:
    return CpuSet.parse(text)


# --- ported kubelet cases ----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.upstream for c in CASES])
def test_kubelet_case(case: KubeletCase) -> None:
    topology = kubelet_cases.topology(case.topology)
    policy = AllocationPolicy(strategy=case.strategy)
    expected = case.our_result
    if expected is None:
        with pytest.raises(AllocationError):
            allocate(topology, case.available_set, case.count, policy)
        return
    assert allocate(topology, case.available_set, case.count, policy) == cs(expected)


@pytest.mark.parametrize("case", CASES, ids=[c.upstream for c in CASES])
def test_kubelet_case_data_is_consistent(case: KubeletCase) -> None:
    """A deviation says why and differs from upstream; a ported case is self-consistent."""
    topology = kubelet_cases.topology(case.topology)
    assert case.available_set <= topology.online
    if case.deviation:
        assert case.ours is not None
        assert case.ours != case.expected
    else:
        assert case.ours is None
    if case.expected:
        assert len(cs(case.expected)) == case.count
        assert cs(case.expected) <= case.available_set


def test_quad_socket_fixture_matches_upstream_socket_lists() -> None:
    """The transcribed KNL fixture: 288 CPUs once each; socket 0 as upstream's comment lists."""
    topology = kubelet_cases.topology("topoQuadSocketFourWayHT")
    assert topology.online == cs("0-287")
    assert len(topology.cores) == 72
    assert topology.smt_width == 4
    assert topology.sockets[0] == cs(
        "0-2,9-10,13-14,21-22,25-26,33-34,38-39,46-47,50,57-58,71-72,79-80,87-88,95-96,"
        "103-104,109-110,117-118,131-132,139-140,147-148,155-156,163-164,169-170,177-178,"
        "191-192,199-200,207-208,215-216,223-224,229-230,237-238,251-252,259-260,267-268,"
        "275-276,283-284"
    )
    assert topology.sockets[3] == cs(
        "7-8,19-20,31-32,37,44-45,55-56,63-64,69-70,77-78,85-86,93-94,101-102,107-108,"
        "115-116,123-124,129-130,137-138,145-146,153-154,161-162,167-168,175-176,183-184,"
        "189-190,197-198,205-206,213-214,221-222,227-228,235-236,243-244,249-250,257-258,"
        "265-266,273-274,281-282,287"
    )


# --- the must-shows and our own rules --------------------------------------------------


def test_eight_cpus_on_dual_socket_are_four_whole_cores_in_one_l3_and_numa_node() -> None:
    topology = fx("dual-socket-smt2")
    result = allocate(topology, topology.online, 8)
    assert describe_plan(topology, result) == {
        "cpus": "0-3,32-35",
        "count": 8,
        "numaNodes": [0],
        "sockets": [0],
        "l3Caches": [0],
        "cores": ["0,32", "1,33", "2,34", "3,35"],
    }


def test_core_identity_includes_the_socket() -> None:
    """core_id repeats per socket: cpu0 and cpu16 both say core_id 0 but are different cores."""
    topology = fx("dual-socket-smt2")
    assert topology.info(0).core_id == topology.info(16).core_id
    # cpu0 (socket 0) plus the whole core 16/48 (socket 1): two CPUs must be that whole core
    assert allocate(topology, cs("0,16,48"), 2) == cs("16,48")
    assert allocate(topology, cs("16-31,48-63"), 4, FULL) == cs("16-17,48-49")
    # full cores: cpu0's sibling 32 is busy, so 0 and 16 are not a core even with equal core_id
    with pytest.raises(InsufficientCpusError):
        allocate(topology, cs("0,16"), 2, FULL)


def test_best_fit_prefers_the_fuller_numa_node() -> None:
    topology = fx("dual-socket-smt2")
    # NUMA 0 (0-7,32-39) has 4 free CPUs as two whole cores; NUMA 1 and up are empty
    free = cs("2-3,34-35,8-31,40-63")
    assert allocate(topology, free, 4) == cs("2-3,34-35")


def test_a_whole_free_l3_beats_a_fuller_numa_node_that_would_split_the_request() -> None:
    topology = fx("dual-socket-smt2")
    # L3 0 = cores 0-3, L3 1 = cores 4-7 (NUMA 0). Leave 3 whole cores in each L3 of NUMA 0:
    # NUMA 0 has 12 free, but no L3 of it can hold 8. NUMA 1's L3s are whole (8 CPUs each).
    free = cs("1-3,33-35,5-7,37-39,8-15,40-47")
    result = allocate(topology, free, 8)
    assert topology.l3_caches_of(result) == [topology.cpus[8].l3_id]
    assert result == cs("8-11,40-43")


def test_one_cpu_prefers_a_half_used_core() -> None:
    topology = fx("dual-socket-smt2")
    free = topology.online - cs("32")  # core 0/32 half used
    assert allocate(topology, free, 1) == cs("0")
    free = topology.online - cs("0")
    assert allocate(topology, free, 1) == cs("32")


def test_two_cpus_prefer_a_whole_core_over_two_half_cores_in_a_fuller_node() -> None:
    topology = fx("dual-socket-smt2")
    # NUMA 0 has only lone threads (every sibling busy); NUMA 1 is empty
    free = cs("0-7") | (topology.numa_nodes[1])
    result = allocate(topology, free, 2)
    assert len(topology.cores_of(result)) == 1
    assert topology.numa_nodes_of(result) == [1]


def test_request_larger_than_a_numa_node_takes_whole_nodes_then_best_fit() -> None:
    topology = fx("dual-socket-smt2")
    # 16 CPUs per NUMA node; node 0 has one busy CPU (7, in its second L3: cores 4-7), so
    # 20 = node 1 whole + 4 from node 0, from the fuller of its L3s
    free = topology.online - cs("7")
    result = allocate(topology, free, 20)
    assert topology.numa_nodes[1] <= result
    assert result - topology.numa_nodes[1] == cs("4-5,36-37")


def test_spread_takes_one_thread_per_core_first() -> None:
    topology = fx("dual-socket-smt2")
    assert allocate(topology, topology.online, 4, SPREAD) == cs("0-3")
    smt4 = fx("smt4")
    result = allocate(smt4, smt4.online, 3, SPREAD)
    assert len(smt4.cores_of(result)) == 3


def test_spread_rounds_give_second_threads_only_when_every_core_has_one() -> None:
    topology = fx("vm-2cpu")
    assert allocate(topology, topology.online, 2, SPREAD) == cs("0-1")
    small = fx("offline-isolated")  # 16 CPUs, 13 online, 8 cores
    result = allocate(small, small.online, 10, SPREAD)
    assert len(small.cores_of(result)) == 8


def test_full_cores_never_split_a_core() -> None:
    topology = fx("smt4")
    assert allocate(topology, topology.online, 4, FULL) == cs("0-3")
    assert allocate(topology, topology.online - cs("1"), 4, FULL) == cs("4-7")
    assert allocate(topology, topology.online - cs("1"), 8, FULL) == cs("4-11")


def test_full_cores_count_must_be_a_multiple_of_the_smt_width() -> None:
    topology = fx("smt4")
    with pytest.raises(AllocationError, match=r"6 CPUs.*multiple of the SMT width 4") as info:
        allocate(topology, topology.online, 6, FULL)
    assert not isinstance(info.value, InsufficientCpusError)


def test_full_cores_without_enough_whole_cores_is_insufficient() -> None:
    topology = fx("dual-socket-smt2")
    # every core has one busy thread
    free = cs("0-31")
    with pytest.raises(InsufficientCpusError, match=r"2 CPUs as whole cores.*only 0"):
        allocate(topology, free, 2, FULL)


def test_full_cores_with_mixed_core_widths_finds_an_exact_combination() -> None:
    # an SMT4 box whose cpu3 is offline: cores of 3, 4 and 4 threads. Packing order offers the
    # 3-thread core first (fewest free), but 8 can only be 4 + 4.
    cpus = {cpu: CpuInfo(cpu, 0, 0, -1, cpu // 4, 0, 0) for cpu in (0, 1, 2, *range(4, 12))}
    topology = Topology(cpus=cpus, smt_enabled=True, offline=cs("3"))
    assert allocate(topology, topology.online, 8, FULL) == cs("4-11")
    assert allocate(topology, topology.online, 4, FULL) == cs("4-7")


def test_whole_cores_that_add_up_are_taken_before_a_core_is_split() -> None:
    """Issue 20: on dual-socket-smt2 with cpu63 offline (core 31 keeps one thread), 4 CPUs were
    28-29,31,60: the one-thread core, a whole core and half of core 29, while two whole
    two-thread cores were free. The kubelet would answer the same (its takeFullCores takes the
    free cores in its order, the one-thread core first; takeRemainingCPUs then splits a core):
    whole cores first, as documented, wins (kubelet_cases.py lists the deviation)."""
    topology = build_topology(replace(FIXTURES["dual-socket-smt2"], offline=cs("63")))
    assert allocate(topology, topology.online, 4) == cs("28-29,60-61")
    assert allocate(topology, topology.online, 6) == cs("28-30,60-62")
    # The one-thread core is whole too: an odd count takes it rather than split a core.
    assert allocate(topology, topology.online, 3) == cs("28,31,60")
    assert allocate(topology, topology.online, 5) == cs("28-29,31,60-61")
    for count in range(1, 16):  # NUMA node 3: 15 CPUs, 8 cores
        result = allocate(topology, topology.online, count)
        split = [core for core in topology.cores_of(result) if not core <= result]
        assert split == [], (count, result)
    # Where no whole cores add up, one core is split, no more.
    busy = cs("24-26,56-58")  # numa 3 keeps cores 27,28,29,30 (two threads) and 31 (one)
    result = allocate(topology, topology.online - busy, 10)
    assert len([core for core in topology.cores_of(result) if not core <= result]) <= 1


def test_hybrid_prefers_p_cores_then_spills_to_e_cores() -> None:
    topology = fx("hybrid-desktop")  # P-cores cpu0-15 (SMT2, adjacent), E-cores cpu16-23
    p_cores = topology.by_core_type(CoreType.P_CORE)
    e_cores = topology.by_core_type(CoreType.E_CORE)
    assert allocate(topology, topology.online, 4) <= p_cores
    e_only = AllocationPolicy(prefer_core_type=CoreType.E_CORE)
    assert allocate(topology, topology.online, 4, e_only) <= e_cores
    # only 4 P threads free: all of them, then E-cores
    result = allocate(topology, cs("0-3,16-23"), 6)
    assert cs("0-3") <= result
    assert len(result & e_cores) == 2


def test_hybrid_full_cores_never_returns_more_than_asked() -> None:
    # P-cores of 4 threads, the two free ones with an offline 4th thread; E-cores cpu12-15.
    # The free P threads (6) outnumber the request (4) but no whole P-cores make 4.
    p, e = CoreType.P_CORE, CoreType.E_CORE
    rows = [(c, c // 4, p) for c in (0, 1, 2, 3, 4, 5, 6, 8, 9, 10)]
    rows += [(c, c, e) for c in range(12, 16)]
    cpus = {c: CpuInfo(c, 0, 0, -1, core, 0, 0, kind) for c, core, kind in rows}
    topology = Topology(cpus=cpus, smt_enabled=True, offline=cs("7,11"))
    result = allocate(topology, cs("4-6,8-10,12-15"), 4, FULL)
    assert len(result) == 4
    assert all(core <= result for core in topology.cores_of(result))


def test_machine_without_l3_information() -> None:
    topology = build_topology(MachineSpec(cores_per_cluster=4, threads_per_core=2, l3="none"))
    result = allocate(topology, topology.online, 4)
    assert len(topology.cores_of(result)) == 2
    assert describe_plan(topology, result)["l3Caches"] == []


def test_never_returns_offline_or_unavailable_cpus() -> None:
    topology = fx("offline-isolated")  # cpu5, 14, 15 offline
    available = cs("0-15")
    result = allocate(topology, available, 13)
    assert result == topology.online
    with pytest.raises(InsufficientCpusError, match=r"14 CPUs: only 13 free"):
        allocate(topology, available, 14)


@pytest.mark.parametrize("count", [0, -1])
def test_count_below_one_is_an_allocation_error(count: int) -> None:
    topology = fx("vm-2cpu")
    with pytest.raises(AllocationError, match=f"invalid CPU count {count}") as info:
        allocate(topology, topology.online, count)
    assert not isinstance(info.value, InsufficientCpusError)


def test_insufficient_message_names_count_and_free_cpus() -> None:
    topology = fx("dual-socket-smt2")
    with pytest.raises(InsufficientCpusError, match=r"cannot allocate 5 CPUs: only 4 free \(0-3\)"):
        allocate(topology, cs("0-3"), 5)
    with pytest.raises(InsufficientCpusError, match=r"only 0 free \(none\)"):
        allocate(topology, CpuSet(), 1)


def test_big_machine_fragmented_request_stays_in_one_l3() -> None:
    topology = fx("big-1024")  # L3 = 16 cores x 2 threads = 32 CPUs
    # three cores of every four are busy everywhere except in L3 5: every other L3 has 8 free
    # CPUs, so only L3 5 can hold 16
    l3_5 = topology.l3_caches[sorted(topology.l3_caches)[5]]
    busy = CpuSet.union(
        core
        for i, core in enumerate(topology.cores_of(topology.online))
        if i % 4 and not core <= l3_5
    )
    free = topology.online - busy
    result = allocate(topology, free, 16)
    assert result <= l3_5
    assert all(core <= result for core in topology.cores_of(result))
    # with L3 5 busy too, 16 spans exactly two of the 8-CPU L3s of one NUMA node
    result = allocate(topology, free - l3_5, 16)
    assert len(topology.l3_caches_of(result)) == 2
    assert len(topology.numa_nodes_of(result)) == 1


def test_describe_plan_of_a_split_core() -> None:
    topology = fx("dual-socket-smt2")
    assert describe_plan(topology, cs("0-1,32")) == {
        "cpus": "0-1,32",
        "count": 3,
        "numaNodes": [0],
        "sockets": [0],
        "l3Caches": [0],
        "cores": ["0,32", "1"],
    }


# --- properties on random machines -------------------------------------------------------------


@st.composite
def machines(draw: st.DrawFn) -> MachineSpec:
    hybrid = draw(st.booleans()) and draw(st.integers(0, 3)) == 0
    spec_args: dict[str, object] = {
        "sockets": draw(st.integers(1, 2)),
        "numa_per_die": draw(st.integers(1, 2)),
        "l3_per_numa": draw(st.integers(1, 3)),
        "threads_per_core": draw(st.sampled_from([1, 2, 2, 4])),
        "core_id_scheme": draw(st.sampled_from(["per-socket", "global"])),
        "cpu_numbering": draw(st.sampled_from(["linux", "adjacent"])),
        "l3": draw(st.sampled_from(["id", "id", "shared-cpu-list", "none"])),
    }
    if hybrid:
        spec_args["hybrid"] = (draw(st.integers(1, 3)), draw(st.integers(1, 4)))
    else:
        spec_args["clusters_per_l3"] = draw(st.integers(1, 2))
        spec_args["cores_per_cluster"] = draw(st.integers(1, 4))
    spec = MachineSpec(**spec_args)  # type: ignore[arg-type]
    total = spec.cpu_count
    offline = draw(st.sets(st.integers(0, total - 1), max_size=total // 4)) if total > 1 else set()
    return MachineSpec(**spec_args, offline=CpuSet(offline))  # type: ignore[arg-type]


@st.composite
def random_machine_situations(draw: st.DrawFn) -> tuple[Topology, CpuSet, int]:
    topology = build_topology(draw(machines()))
    online = sorted(topology.online)
    busy = draw(st.sets(st.sampled_from(online), max_size=len(online) - 1))
    free = topology.online - CpuSet(busy)
    count = draw(st.integers(1, len(free)))
    return topology, free, count


_FIXTURE_TOPOLOGIES = {name: build_topology(spec) for name, spec in FIXTURES.items()}


@st.composite
def fixture_situations(draw: st.DrawFn) -> tuple[Topology, CpuSet, int]:
    """A named machine (big-1024 included) with a seeded random share of its CPUs busy."""
    topology = draw(st.sampled_from(sorted(_FIXTURE_TOPOLOGIES.items())))[1]
    rnd = random.Random(draw(st.integers(0, 2**32)))
    busy_share = draw(st.sampled_from([0.0, 0.25, 0.5, 0.75, 0.95]))
    free = CpuSet(cpu for cpu in topology.online if rnd.random() >= busy_share)
    assume(free)
    count = draw(st.integers(1, min(len(free), 96)))
    return topology, free, count


def situations() -> st.SearchStrategy[tuple[Topology, CpuSet, int]]:
    return st.one_of(random_machine_situations(), fixture_situations())


PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@PROPERTY_SETTINGS
@given(situations(), st.sampled_from([PACKED, SPREAD, NO_TYPE_PREFERENCE]))
def test_result_is_count_cpus_out_of_available_and_deterministic(
    situation: tuple[Topology, CpuSet, int], policy: AllocationPolicy
) -> None:
    topology, free, count = situation
    result = allocate(topology, free, count, policy)
    assert len(result) == count
    assert result <= free
    assert allocate(topology, free, count, policy) == result
    # a fresh, equal topology object (no cached index) gives the same answer
    rebuilt = Topology(
        cpus=dict(topology.cpus),
        smt_enabled=topology.smt_enabled,
        offline=topology.offline,
        isolated=topology.isolated,
    )
    assert allocate(rebuilt, free, count, policy) == result


ALL_POLICIES = [
    AllocationPolicy(strategy, full_cores, prefer)
    for strategy in Strategy
    for full_cores in (False, True)
    for prefer in (None, CoreType.P_CORE, CoreType.E_CORE)
]


@PROPERTY_SETTINGS
@given(situations(), st.sampled_from(ALL_POLICIES), st.booleans())
def test_every_policy_returns_exactly_count_or_refuses_for_a_reason(
    situation: tuple[Topology, CpuSet, int], policy: AllocationPolicy, round_count: bool
) -> None:
    topology, free, count = situation
    if policy.full_cores and round_count:
        count = max(topology.smt_width, count - count % topology.smt_width)
    try:
        result = allocate(topology, free, count, policy)
    except InsufficientCpusError:
        assert policy.full_cores  # enough free CPUs: only whole cores can be short
        return
    except AllocationError:
        assert policy.full_cores
        assert count % topology.smt_width
        return
    assert len(result) == count
    assert result <= free
    if policy.full_cores:
        assert all(core <= result for core in topology.cores_of(result))


@PROPERTY_SETTINGS
@given(situations(), st.data())
def test_full_cores_results_are_unions_of_whole_cores(
    situation: tuple[Topology, CpuSet, int], data: st.DataObject
) -> None:
    topology, free, _ = situation
    width = topology.smt_width
    whole = CpuSet.union(core for core in topology.cores.values() if core <= free)
    assume(len(whole) >= width)
    count = width * data.draw(st.integers(1, len(whole) // width))
    policy = AllocationPolicy(full_cores=True, prefer_core_type=None)
    try:
        result = allocate(topology, free, count, policy)
    except InsufficientCpusError:
        # only when no combination of whole free cores adds up (offline threads, hybrid)
        sums = {0}
        for core in topology.cores.values():
            if core <= free:
                sums |= {s + len(core) for s in sums}
        assert count not in sums
        return
    assert len(result) == count
    assert result <= free
    assert all(core <= result for core in topology.cores_of(result))


@PROPERTY_SETTINGS
@given(situations())
def test_spread_never_doubles_up_while_a_core_has_no_chosen_thread(
    situation: tuple[Topology, CpuSet, int],
) -> None:
    topology, free, count = situation
    result = allocate(topology, free, count, AllocationPolicy(Strategy.SPREAD, False, None))
    chosen = {core: len(core & result) for core in topology.cores.values() if core & free}
    most = max(chosen.values())
    for core, taken in chosen.items():
        if taken <= most - 2:
            # another core gave 2+ more threads: this one only because it has no more free
            assert taken == len(core & free)


@PROPERTY_SETTINGS
@given(situations(), st.sampled_from([PACKED, FULL]))
def test_a_request_that_fits_a_free_whole_l3_or_numa_node_stays_inside_one(
    situation: tuple[Topology, CpuSet, int], policy: AllocationPolicy
) -> None:
    topology, free, count = situation
    policy = AllocationPolicy(full_cores=policy.full_cores, prefer_core_type=None)
    if policy.full_cores:
        count = max(topology.smt_width, count - count % topology.smt_width)
    width = topology.smt_width

    def fits(unit: CpuSet) -> bool:
        # a free unit big enough; for whole cores, one whose cores all have the full width
        # (a count of whole 3-thread cores cannot make 4)
        if not unit <= free or len(unit) < count:
            return False
        return not policy.full_cores or all(len(c) == width for c in topology.cores_of(unit))

    fits_l3 = any(fits(cpus) for cpus in topology.l3_caches.values())
    fits_numa = any(fits(cpus) for cpus in topology.numa_nodes.values())
    assume(fits_l3 or fits_numa)
    result = allocate(topology, free, count, policy)
    if fits_l3:
        assert len(topology.l3_caches_of(result)) == 1
    if fits_numa:
        assert len(topology.numa_nodes_of(result)) == 1
