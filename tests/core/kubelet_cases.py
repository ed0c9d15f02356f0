"""Kubelet CPU manager allocation test cases, ported as data (no upstream code).

Sources (read, not copied): kubernetes ``pkg/kubelet/cm/cpumanager/cpu_assignment_test.go``
(``commonTakeByTopologyTestCases``, ``TestTakeByTopologyNUMAPacked``,
``TestTakeByTopologyWithSpreadPhysicalCPUsPreferredOption``), the fixtures of
``pkg/kubelet/cm/cpumanager/policy_test.go`` (``topoSingleSocketHT`` ...
``topoQuadSocketFourWayHT``) and the ``topoUncore*`` fixtures, as vendored in
kubernetes-sigs/dra-driver-cpu ``pkg/cpumanager/`` (kubelet commit fd5b2efa, the version that
driver runs), plus the free-uncore-cache cases of the kubelet uncore-alignment work
(``TestCPUAccumulatorFreeUncoreCache``, fixture ``topoDualUncoreCacheSingleSocketHT``).

Each case names its upstream test and sub-test. Where our allocator intentionally answers
differently, ``ours`` holds our answer and ``deviation`` says why; the test asserts ``ours``.

One deviation has no upstream case, since upstream's fixtures have cores of one width only:
where whole free cores add up to the request, we never split a core, while the kubelet's
``takeFullCores`` takes the free cores in its own order (fewest free CPUs first: a core whose
sibling is offline, having one CPU, comes first) and ``takeRemainingCPUs`` then splits a core
for the rest. A split core shares its other thread (its L1 and L2 caches and execution units)
with another claim; a core left over is only a core another claim gets whole. Our documented
order (whole NUMA nodes, whole L3 caches, whole cores) wins, and
``test_allocator.py::test_whole_cores_that_add_up_are_taken_before_a_core_is_split`` holds the
case (dual-socket-smt2 with cpu63 offline, 4 CPUs: ``28-29,60-61``, where the kubelet's order
gives ``28-29,31,60``).
Not ported: ``TestTakeByTopologyNUMADistributed`` (the distribute-across-NUMA option, which
dracpu does not offer), the ``...ForResize`` cases (in-place resize; a claim's CPUs never change)
and the accumulator-internals tests (``freeSockets``, ``freeCores`` ... orderings of private
helpers, not results).
"""

from __future__ import annotations

from dataclasses import dataclass

from dracpu.core.allocator import Strategy
from dracpu.core.cpuset import CpuSet
from dracpu.core.topology import CpuInfo, Topology

__all__ = ["CASES", "QUAD_SOCKET_FOUR_WAY_HT_CORES", "TOPOLOGIES", "KubeletCase", "topology"]

Row = tuple[int, int, int, int, int]
"""(cpu, core_id, socket, numa node, L3 (uncore) cache id), as the upstream CPUDetails maps."""

# topoQuadSocketFourWayHT (Intel KNL, hwloc KNL.SNC4.H50): (core_id, socket, its four threads).
# Socket s is NUMA node s; the fixture leaves UncoreCacheID at 0.
QUAD_SOCKET_FOUR_WAY_HT_CORES: tuple[tuple[int, int, tuple[int, int, int, int]], ...] = (
    (0, 0, (0, 169, 109, 229)),
    (1, 0, (50, 170, 110, 230)),
    (64, 0, (1, 25, 13, 38)),
    (65, 0, (2, 26, 14, 39)),
    (72, 0, (9, 33, 21, 46)),
    (73, 0, (10, 34, 22, 47)),
    (8, 0, (57, 177, 117, 237)),
    (9, 0, (58, 178, 118, 238)),
    (24, 0, (71, 191, 131, 251)),
    (25, 0, (72, 192, 132, 252)),
    (32, 0, (79, 199, 139, 259)),
    (33, 0, (80, 200, 140, 260)),
    (40, 0, (87, 207, 147, 267)),
    (41, 0, (88, 208, 148, 268)),
    (48, 0, (95, 215, 155, 275)),
    (49, 0, (96, 216, 156, 276)),
    (56, 0, (103, 223, 163, 283)),
    (57, 0, (104, 224, 164, 284)),
    (66, 1, (3, 27, 15, 40)),
    (67, 1, (4, 28, 16, 41)),
    (74, 1, (11, 35, 23, 48)),
    (75, 1, (12, 36, 24, 49)),
    (2, 1, (51, 171, 111, 231)),
    (3, 1, (52, 172, 112, 232)),
    (10, 1, (59, 179, 119, 239)),
    (11, 1, (60, 180, 120, 240)),
    (18, 1, (65, 185, 125, 245)),
    (19, 1, (66, 186, 126, 246)),
    (26, 1, (73, 193, 133, 253)),
    (27, 1, (74, 194, 134, 254)),
    (34, 1, (81, 201, 141, 261)),
    (35, 1, (82, 202, 142, 262)),
    (42, 1, (89, 209, 149, 269)),
    (43, 1, (90, 210, 150, 270)),
    (50, 1, (97, 217, 157, 277)),
    (51, 1, (98, 218, 158, 278)),
    (68, 2, (5, 29, 17, 42)),
    (69, 2, (6, 30, 18, 43)),
    (4, 2, (53, 173, 113, 233)),
    (5, 2, (54, 174, 114, 234)),
    (12, 2, (61, 181, 121, 241)),
    (13, 2, (62, 182, 122, 242)),
    (20, 2, (67, 187, 127, 247)),
    (21, 2, (68, 188, 128, 248)),
    (28, 2, (75, 195, 135, 255)),
    (29, 2, (76, 196, 136, 256)),
    (36, 2, (83, 203, 143, 263)),
    (37, 2, (84, 204, 144, 264)),
    (44, 2, (91, 211, 151, 271)),
    (45, 2, (92, 212, 152, 272)),
    (52, 2, (99, 219, 159, 279)),
    (53, 2, (100, 220, 160, 280)),
    (60, 2, (105, 225, 165, 285)),
    (61, 2, (106, 226, 166, 286)),
    (70, 3, (7, 31, 19, 44)),
    (71, 3, (8, 32, 20, 45)),
    (63, 3, (37, 168, 108, 228)),
    (62, 3, (107, 227, 167, 287)),
    (6, 3, (55, 175, 115, 235)),
    (7, 3, (56, 176, 116, 236)),
    (14, 3, (63, 183, 123, 243)),
    (15, 3, (64, 184, 124, 244)),
    (22, 3, (69, 189, 129, 249)),
    (23, 3, (70, 190, 130, 250)),
    (30, 3, (77, 197, 137, 257)),
    (31, 3, (78, 198, 138, 258)),
    (38, 3, (85, 205, 145, 265)),
    (39, 3, (86, 206, 146, 266)),
    (46, 3, (93, 213, 153, 273)),
    (47, 3, (94, 214, 154, 274)),
    (54, 3, (101, 221, 161, 281)),
    (55, 3, (102, 222, 162, 282)),
)

# The upstream fixtures, one row per CPU. Fixtures that leave NUMANodeID or UncoreCacheID unset
# get 0, as the Go zero value does upstream.
TOPOLOGIES: dict[str, tuple[Row, ...]] = {
    # 1 socket, 4 cores, HT siblings cpuN and cpuN+4
    "topoSingleSocketHT": tuple((cpu, cpu % 4, 0, 0, 0) for cpu in range(8)),
    # 2 sockets = 2 NUMA nodes, 6 cores; even CPUs on socket 0, siblings cpuN and cpuN+6
    "topoDualSocketHT": tuple((cpu, cpu % 6, cpu % 2, cpu % 2, 0) for cpu in range(12)),
    # 2 sockets = 2 NUMA nodes, 4 cores each, no HT
    "topoDualSocketNoHT": tuple((cpu, cpu, cpu // 4, cpu // 4, 0) for cpu in range(8)),
    # dual Xeon Gold 6230: 2 sockets x 2 NUMA x 10 cores x HT, siblings cpuN and cpuN+40
    "topoDualSocketMultiNumaPerSocketHT": tuple(
        (cpu, cpu % 40, cpu % 40 // 20, cpu % 40 // 10, 0) for cpu in range(80)
    ),
    # 16 single-thread cores, 2 sockets (one NUMA node), 4 L3 groups of 4
    "topoUncoreDualSocketNoSMT": tuple((cpu, cpu, cpu // 8, 0, cpu // 4) for cpu in range(16)),
    # 16 single-thread cores, 1 socket, 2 NUMA nodes, 4 L3 groups of 4
    "topoUncoreSingleSocketMultiNuma": tuple(
        (cpu, cpu, 0, cpu // 8, cpu // 4) for cpu in range(16)
    ),
    # 8 cores x SMT2 (siblings cpuN and cpuN+8), 2 L3 groups of 4 cores
    "topoUncoreSingleSocketSMT": tuple((cpu, cpu % 8, 0, 0, cpu % 8 // 4) for cpu in range(16)),
    # 16 single-thread cores, 1 socket, 4 L3 groups of 4
    "topoUncoreSingleSocketNoSMT": tuple((cpu, cpu, 0, 0, cpu // 4) for cpu in range(16)),
    # 8 cores x SMT2 with adjacent siblings (cpu2k, cpu2k+1), 2 L3 groups of 4 cores
    "topoDualUncoreCacheSingleSocketHT": tuple(
        (cpu, cpu // 2, 0, 0, cpu // 8) for cpu in range(16)
    ),
    # 4 sockets = 4 NUMA nodes, 18 cores x 4 threads each
    "topoQuadSocketFourWayHT": tuple(
        sorted(
            (cpu, core_id, socket, socket, 0)
            for core_id, socket, cpus in QUAD_SOCKET_FOUR_WAY_HT_CORES
            for cpu in cpus
        )
    ),
}


def topology(name: str) -> Topology:
    """Our model of an upstream fixture (cores keyed by socket + core_id, as sysfs would be)."""
    rows = TOPOLOGIES[name]
    cpus = {
        cpu: CpuInfo(
            cpu_id=cpu,
            socket_id=socket,
            die_id=0,
            cluster_id=-1,
            core_id=core,
            numa_node=numa,
            l3_id=l3,
        )
        for cpu, core, socket, numa, l3 in rows
    }
    per_core: dict[tuple[int, int], int] = {}
    for _, core, socket, _, _ in rows:
        per_core[socket, core] = per_core.get((socket, core), 0) + 1
    return Topology(cpus=cpus, smt_enabled=max(per_core.values()) > 1)


@dataclass(frozen=True, slots=True)
class KubeletCase:
    """One upstream sub-test: topology, free CPUs, count, and what upstream expects."""

    upstream: str  # "<Go test function>: <t.Run description>"
    topology: str  # key of TOPOLOGIES
    available: str  # cpuset text
    count: int
    expected: str | None  # upstream's result; None: upstream returns an error
    strategy: Strategy = Strategy.PACKED
    ours: str | None = None  # our result when it deviates from upstream ("error": we raise)
    deviation: str = ""  # why we deviate

    @property
    def our_result(self) -> str | None:
        """What our allocator must return (None: an error)."""
        if self.deviation:
            return None if self.ours == "error" else self.ours
        return self.expected

    @property
    def available_set(self) -> CpuSet:
        return CpuSet.parse(self.available)


_PACKED = "TestTakeByTopologyNUMAPacked"
_SPREAD = "TestTakeByTopologyWithSpreadPhysicalCPUsPreferredOption"
_UNCORE = "TestTakeByTopologyNUMAPacked (PreferAlignByUncoreCacheOption)"
_FREE_UNCORE = "TestCPUAccumulatorFreeUncoreCache (as a request of one L3's worth)"

_ONE_THREAD_PER_CORE_FIRST = (
    "spread gives every core one thread before any core gives a second; upstream's spread "
    "order is CPU id order inside the emptiest socket, which takes whole cores when siblings "
    "are numbered next to each other"
)

CASES: tuple[KubeletCase, ...] = (
    # --- commonTakeByTopologyTestCases (run by TestTakeByTopologyNUMAPacked) ----------------
    KubeletCase(
        f"{_PACKED}: take more cpus than are available from single socket with HT",
        "topoSingleSocketHT",
        "0,2,4,6",
        5,
        None,
    ),
    KubeletCase(
        f"{_PACKED}: take zero cpus from single socket with HT",
        "topoSingleSocketHT",
        "0-7",
        0,
        "",
        ours="error",
        deviation="a claim of zero CPUs is a caller bug: we raise AllocationError, upstream "
        "returns the empty set",
    ),
    KubeletCase(
        f"{_PACKED}: take one cpu from single socket with HT",
        "topoSingleSocketHT",
        "0-7",
        1,
        "0",
    ),
    KubeletCase(
        f"{_PACKED}: take one cpu from single socket with HT, some cpus are taken",
        "topoSingleSocketHT",
        "1,3,5-7",
        1,
        "6",
    ),
    KubeletCase(
        f"{_PACKED}: take two cpus from single socket with HT",
        "topoSingleSocketHT",
        "0-7",
        2,
        "0,4",
    ),
    KubeletCase(
        f"{_PACKED}: take all cpus from single socket with HT",
        "topoSingleSocketHT",
        "0-7",
        8,
        "0-7",
    ),
    KubeletCase(
        f"{_PACKED}: take two cpus from single socket with HT, only one core totally free",
        "topoSingleSocketHT",
        "0-3,6",
        2,
        "2,6",
    ),
    KubeletCase(
        f"{_PACKED}: take a socket of cpus from dual socket with HT",
        "topoDualSocketHT",
        "0-11",
        6,
        "0,2,4,6,8,10",
    ),
    KubeletCase(
        f"{_PACKED}: take a socket of cpus from dual socket with multi-numa-per-socket with HT",
        "topoDualSocketMultiNumaPerSocketHT",
        "0-79",
        40,
        "0-19,40-59",
    ),
    KubeletCase(
        f"{_PACKED}: take a NUMA node of cpus from dual socket with multi-numa-per-socket with HT",
        "topoDualSocketMultiNumaPerSocketHT",
        "0-79",
        20,
        "0-9,40-49",
    ),
    KubeletCase(
        f"{_PACKED}: take a NUMA node of cpus from dual socket with multi-numa-per-socket "
        "with HT, with 1 NUMA node already taken",
        "topoDualSocketMultiNumaPerSocketHT",
        "10-39,50-79",
        20,
        "10-19,50-59",
    ),
    KubeletCase(
        f"{_PACKED}: take a socket and a NUMA node of cpus from dual socket with "
        "multi-numa-per-socket with HT",
        "topoDualSocketMultiNumaPerSocketHT",
        "0-79",
        60,
        "0-29,40-69",
    ),
    KubeletCase(
        f"{_PACKED}: take a socket and a NUMA node of cpus from dual socket with "
        "multi-numa-per-socket with HT, a core taken",
        "topoDualSocketMultiNumaPerSocketHT",
        "1-39,41-79",
        60,
        "10-39,50-79",
    ),
    # --- TestTakeByTopologyNUMAPacked's own cases --------------------------------------------
    KubeletCase(
        f"{_PACKED}: take one cpu from dual socket with HT - core from Socket 0",
        "topoDualSocketHT",
        "1-5,7-11",
        1,
        "2",
    ),
    KubeletCase(
        f"{_PACKED}: allocate 4 full cores with 3 coming from the first NUMA node (filling it "
        "up) and 1 coming from the second NUMA node",
        "topoDualSocketHT",
        "0-11",
        8,
        "0-2,4,6-8,10",
    ),
    KubeletCase(
        f"{_PACKED}: allocate 32 full cores with 30 coming from the first 3 NUMA nodes "
        "(filling them up) and 2 coming from the fourth NUMA node",
        "topoDualSocketMultiNumaPerSocketHT",
        "0-79",
        64,
        "0-31,40-71",
    ),
    KubeletCase(
        f"{_UNCORE}: take cpus from two full UncoreCaches and partial from a single UncoreCache",
        "topoUncoreSingleSocketNoSMT",
        "1-15",
        10,
        "1-2,4-11",
    ),
    KubeletCase(
        f"{_UNCORE}: take one cpu from dual socket with HT - core from Socket 0",
        "topoDualSocketHT",
        "1-5,7-11",
        1,
        "1",
        ours="2",
        deviation="best fit at every level: socket 0 has fewer free CPUs, so the CPU comes "
        "from there (as upstream's packed case without the uncore option answers); upstream's "
        "partial-uncore step takes the first core by id in the L3, which this fixture spreads "
        "over both sockets",
    ),
    KubeletCase(
        f"{_UNCORE}: take first available UncoreCache from first socket",
        "topoUncoreDualSocketNoSMT",
        "0-15",
        4,
        "0-3",
    ),
    KubeletCase(
        f"{_UNCORE}: take all available UncoreCache from first socket",
        "topoUncoreDualSocketNoSMT",
        "2-15",
        6,
        "2-7",
    ),
    KubeletCase(
        f"{_UNCORE}: take first available UncoreCache from second socket",
        "topoUncoreDualSocketNoSMT",
        "8-15",
        4,
        "8-11",
    ),
    KubeletCase(
        f"{_UNCORE}: take first available UncoreCache from available NUMA",
        "topoUncoreSingleSocketMultiNuma",
        "3-8,12",
        2,
        "4-5",
    ),
    KubeletCase(
        f"{_UNCORE}: take cpus from best available UncoreCache group of multi uncore cache "
        "single socket - SMT enabled",
        "topoUncoreSingleSocketSMT",
        "2-7,10-15",
        6,
        "4-6,12-14",
    ),
    KubeletCase(
        f"{_UNCORE}: take cpus from multiple UncoreCache of single socket - SMT enabled",
        "topoUncoreSingleSocketSMT",
        "1-7,9-15",
        10,
        "1,4-7,9,12-15",
    ),
    # --- free uncore caches, asked as "one L3's worth" ---------------------------------------
    KubeletCase(
        f"{_FREE_UNCORE}: dual UncoreCache groups, 1 uncore cache free, cache id and cpu "
        "numbers (0:7, 1:8)",
        "topoDualUncoreCacheSingleSocketHT",
        "1-15",
        8,
        "8-15",
    ),
    KubeletCase(
        f"{_FREE_UNCORE}: dual UncoreCache groups, 2 uncore cache free, cache id and cpu "
        "numbers (0:8, 1:8)",
        "topoDualUncoreCacheSingleSocketHT",
        "0-15",
        8,
        "0-7",
    ),
    KubeletCase(
        f"{_FREE_UNCORE}: dual UncoreCache groups, 1 uncore cache free, cache id and cpu "
        "numbers (0:8, 1:7)",
        "topoDualUncoreCacheSingleSocketHT",
        "0-14",
        8,
        "0-7",
    ),
    KubeletCase(
        f"{_FREE_UNCORE}: dual UncoreCache groups, 0 uncore cache free, cache id and cpu "
        "numbers (0:7, 1:7)",
        # upstream only checks that no L3 is free; the result is our packed answer: the three
        # whole cores of the first L3, then the best-fit whole core of the other
        "topoDualUncoreCacheSingleSocketHT",
        "1-14",
        8,
        "2-9",
    ),
    # --- TestTakeByTopologyWithSpreadPhysicalCPUsPreferredOption ---------------------------
    KubeletCase(
        f"{_SPREAD}: take a socket of cpus from single socket with HT, 3 cpus",
        "topoSingleSocketHT",
        "0-7",
        3,
        "0-2",
        Strategy.SPREAD,
    ),
    KubeletCase(
        f"{_SPREAD}: take a socket of cpus from dual socket with HT, 2 cpus",
        "topoDualSocketHT",
        "0-11",
        2,
        "0,2",
        Strategy.SPREAD,
    ),
    KubeletCase(
        f"{_SPREAD}: take a socket of cpus from dual socket with HT, 3 cpus",
        "topoDualSocketHT",
        "0-11",
        3,
        "0,2,4",
        Strategy.SPREAD,
    ),
    KubeletCase(
        f"{_SPREAD}: take a socket of cpus from dual socket with HT, 6 cpus",
        "topoDualSocketHT",
        "0-11",
        6,
        "0,2,4,6,8,10",
        Strategy.SPREAD,
        ours="0-5",
        deviation=_ONE_THREAD_PER_CORE_FIRST,
    ),
    KubeletCase(
        f"{_SPREAD}: take cpus from dual socket with HT, 8 cpus",
        "topoDualSocketHT",
        "0-11",
        8,
        "0-4,6,8,10",
        Strategy.SPREAD,
        ours="0-6,8",
        deviation=_ONE_THREAD_PER_CORE_FIRST,
    ),
    KubeletCase(
        f"{_SPREAD}: take a socket of cpus from dual socket without HT, 2 cpus",
        "topoDualSocketNoHT",
        "0-7",
        2,
        "0-1",
        Strategy.SPREAD,
    ),
    KubeletCase(
        f"{_SPREAD}: take a socket of cpus from dual socket with multi numa per socket and "
        "HT, 12 cpus",
        "topoDualSocketMultiNumaPerSocketHT",
        "0-79",
        8,
        "0-7",
        Strategy.SPREAD,
    ),
    KubeletCase(
        f"{_SPREAD}: take a socket of cpus from quad socket four way with HT, 12 cpus",
        "topoQuadSocketFourWayHT",
        "0-287",
        12,
        "0-2,9-10,13-14,21-22,25-26,33",
        Strategy.SPREAD,
        ours="0-2,9-10,50,57-58,71-72,79-80",
        deviation=_ONE_THREAD_PER_CORE_FIRST
        + " (upstream's answer puts 1,13,25 on one core and 9,21,33 on another)",
    ),
)
"""Every ported case, in upstream order."""
