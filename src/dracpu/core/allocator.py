"""Topology-aware choice of exclusive CPUs for one grouped-mode claim.

The allocator is pure: a :class:`~dracpu.core.topology.Topology`, the free CPUs and a count go in,
a :class:`~dracpu.core.cpuset.CpuSet` comes out (or an :class:`~dracpu.errors.AllocationError`).
``packed`` (the default), ``spread`` and ``full_cores`` descend a tree of units (NUMA node and
socket, L3 cache, core, thread) on bit masks and a per-topology index built once; how each
chooses, hybrid machines and the deviations from the kubelet's CPU manager are
``docs/architecture.md``, "Choosing the CPUs".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from dracpu.core.cpuset import CpuSet
from dracpu.core.topology import CoreType, Topology
from dracpu.errors import AllocationError, InsufficientCpusError

__all__ = ["AllocationPolicy", "Strategy", "allocate", "describe_plan"]


class Strategy(StrEnum):
    """How the CPUs of one claim are laid over physical cores (opaque claim config ``policy``)."""

    PACKED = "packed"
    SPREAD = "spread"


@dataclass(frozen=True, slots=True)
class AllocationPolicy:
    """Per-claim allocation options.

    - ``strategy``: ``packed`` fills whole cores; ``spread`` one thread per core first.
    - ``full_cores``: never split a physical core; the count must be a multiple of the widest
      core's thread count (:attr:`Topology.smt_width`).
    - ``prefer_core_type``: on hybrid machines, serve from this core type first (P-cores by
      default); ``None`` treats every core alike. No effect where all cores are of one type.
    """

    strategy: Strategy = Strategy.PACKED
    full_cores: bool = False
    prefer_core_type: CoreType | None = CoreType.P_CORE


# Tree levels. Level numbers only order the tree; what each of the two top levels holds (NUMA
# node or socket) is decided per topology, as the kubelet's numaFirst/socketsFirst rule does.
_ROOT = -1
_L1 = 0  # the coarser of NUMA node / socket
_L2 = 1  # the finer one
_L3 = 2  # L3 (uncore) cache group; one pseudo group per parent on machines without L3 data
_CORE = 3  # physical core
_THREAD = 4  # hardware thread (a leaf: not a unit of its own)

# Identity-keyed memo of topology indexes. A Topology is immutable, so its index never goes
# stale; the cap only bounds memory when a long-lived process sees many topologies (tests).
_INDEX_CACHE_SIZE = 16
_index_cache: dict[int, tuple[Topology, _Index]] = {}


@dataclass(frozen=True, slots=True, eq=False)
class _Unit:
    level: int
    ident: int  # NUMA / socket / L3 id, or the lowest CPU id of a core
    mask: int  # the unit's online CPUs
    size: int  # how many online CPUs
    ncores: int  # how many physical cores
    width: int  # threads per core when every core of the unit has as many, else 0
    children: tuple[_Unit, ...]


@dataclass(frozen=True, slots=True, eq=False)
class _Index:
    root: _Unit
    cores: tuple[_Unit, ...]  # by lowest CPU id
    max_core_size: int
    type_masks: dict[CoreType, int]


def _build_index(topology: Topology) -> _Index:
    numa_first = len(topology.sockets) >= len(topology.numa_nodes)
    # path (l1, l2, l3) -> cores in that cell, by lowest CPU id
    cells: dict[tuple[int, int, int], list[_Unit]] = {}
    cores: list[_Unit] = []
    for core in sorted(topology.cores.values(), key=CpuSet.min):
        info = topology.cpus[core.min()]
        l1, l2 = (
            (info.numa_node, info.socket_id) if numa_first else (info.socket_id, info.numa_node)
        )
        l3 = info.l3_id if info.l3_id is not None else -1
        unit = _Unit(_CORE, core.min(), core.mask, len(core), 1, len(core), ())
        cores.append(unit)
        cells.setdefault((l1, l2, l3), []).append(unit)

    def group(level: int, items: dict[int, list[_Unit]]) -> tuple[_Unit, ...]:
        units = []
        for ident in sorted(items):
            kids = tuple(items[ident])
            mask = 0
            for kid in kids:
                mask |= kid.mask
            widths = {kid.width for kid in kids}
            width = widths.pop() if len(widths) == 1 else 0
            ncores = sum(kid.ncores for kid in kids)
            units.append(_Unit(level, ident, mask, mask.bit_count(), ncores, width, kids))
        return tuple(units)

    by_l1: dict[int, dict[int, dict[int, list[_Unit]]]] = {}
    for (l1, l2, l3), members in cells.items():
        by_l1.setdefault(l1, {}).setdefault(l2, {})[l3] = members
    l1_units: dict[int, list[_Unit]] = {}
    for l1, by_l2 in by_l1.items():
        l2_units = {l2: list(group(_L3, by_l3)) for l2, by_l3 in by_l2.items()}
        l1_units[l1] = list(group(_L2, l2_units))
    top = group(_L1, l1_units)
    mask = topology.online.mask
    widths = {unit.width for unit in top}
    width = widths.pop() if len(widths) == 1 else 0
    root = _Unit(_ROOT, -1, mask, mask.bit_count(), len(cores), width, top)
    type_masks: dict[CoreType, int] = {}
    for info in topology.cpus.values():
        type_masks[info.core_type] = type_masks.get(info.core_type, 0) | (1 << info.cpu_id)
    return _Index(root, tuple(cores), max((c.size for c in cores), default=1), type_masks)


def _index(topology: Topology) -> _Index:
    key = id(topology)
    hit = _index_cache.get(key)
    if hit is not None and hit[0] is topology:
        return hit[1]
    index = _build_index(topology)
    if len(_index_cache) >= _INDEX_CACHE_SIZE:
        _index_cache.pop(next(iter(_index_cache)))
    _index_cache[key] = (topology, index)
    return index


class _Pick:
    """One descent over the unit tree with a mutable free mask; collects what it takes."""

    __slots__ = ("core_cap", "free", "full_cores", "splits", "spread", "taken")

    def __init__(
        self, index: _Index, free: int, *, spread: bool = False, full_cores: bool = False
    ) -> None:
        self.free = free
        self.spread = spread  # free holds one representative thread per core
        self.full_cores = full_cores  # free holds whole cores only; never split one
        # the most a single core can hold in this view: a request no larger may fit one core
        self.core_cap = 1 if spread else index.max_core_size
        self.taken = 0
        self.splits = 0  # cores the thread level took part of, leaving a free thread

    # --- measures ---------------------------------------------------------------------------

    def count(self, unit: _Unit) -> int:
        return (unit.mask & self.free).bit_count()

    def capacity(self, unit: _Unit) -> int:
        return unit.ncores if self.spread else unit.size

    def take(self, mask: int) -> int:
        mask &= self.free
        self.taken |= mask
        self.free &= ~mask
        return mask.bit_count()

    # --- orders -----------------------------------------------------------------------------

    def ordered_cores(self, scope: _Unit) -> list[_Unit]:
        """The cores with a free CPU under ``scope`` (itself if a core), in packing order."""
        return [scope] if scope.level >= _CORE else self.ordered(scope, _CORE)

    def ordered(self, scope: _Unit, level: int) -> list[_Unit]:
        """Units at ``level`` under ``scope`` with a free CPU, in packing order."""
        kids = [kid for kid in scope.children if kid.mask & self.free]
        kids.sort(key=lambda kid: (self.count(kid), kid.ident))
        if scope.level + 1 >= level:
            return kids
        out: list[_Unit] = []
        for kid in kids:
            out.extend(self.ordered(kid, level))
        return out

    def fits(self, unit: _Unit, need: int) -> bool:
        """Can ``unit`` alone give ``need`` CPUs (as whole cores, in full-cores mode)?"""
        free = self.count(unit)
        if free < need:
            return False
        if not self.full_cores:
            return True
        if unit.width:
            # free holds whole cores only, all of this width: any multiple up to free works
            return need % unit.width == 0
        return _exact_cores(self.ordered_cores(unit), need) is not None

    def depth(self, unit: _Unit, need: int, bound: int) -> int:
        """The deepest level at which one unit inside ``unit`` holds ``need`` free CPUs."""
        best = unit.level
        if best >= bound:
            return best
        for kid in unit.children:
            if self.fits(kid, need):
                best = max(best, self.depth(kid, need, bound))
                if best >= bound:
                    break
        return best

    def container(self, units: list[_Unit], level: int, need: int) -> _Unit | None:
        """The best unit of ``units`` to hold all of ``need``, or None if none can."""
        if level == _CORE and self.full_cores:
            return None
        bound = _CORE if need <= self.core_cap else _L3
        best: tuple[int, int, int] | None = None
        chosen: _Unit | None = None
        for position, unit in enumerate(units):
            if not self.fits(unit, need):
                continue
            key = (-self.depth(unit, need, bound), self.count(unit), position)
            if best is None or key < best:
                best, chosen = key, unit
        return chosen

    # --- the descent ------------------------------------------------------------------------

    def fill(self, scope: _Unit, level: int, need: int) -> int:
        """Take ``need`` CPUs under ``scope`` starting at ``level``; return how many are missing."""
        while need > 0:
            if level >= _THREAD or scope.level >= _CORE:
                return self._threads(scope, need)
            if level == _CORE and self.full_cores:
                return self._exact(scope, need)
            units = self.ordered(scope, level)
            if not units:
                return need
            unit = self.container(units, level, need)
            if unit is not None:
                return self.descend(unit, need)
            for unit in units:
                if self.capacity(unit) <= need and self.count(unit) == self.capacity(unit):
                    need -= self.take(unit.mask)
                    if need == 0:
                        return 0
            units = [unit for unit in units if unit.mask & self.free]
            unit = self.container(units, level, need)
            if unit is not None:
                return self.descend(unit, need)
            level += 1
        return need

    def descend(self, unit: _Unit, need: int) -> int:
        """Take all of ``need`` inside ``unit``, a container that :meth:`fits` it."""
        free, taken, splits = self.free, self.taken, self.splits
        left = self.fill(unit, unit.level + 1, need)
        if self.full_cores and left:
            # whole sub-units taken greedily left a remainder no core combination makes (cores
            # of mixed width); the unit as a whole can (fits() said so): choose exactly in it
            self.free, self.taken = free, taken
            left = self._exact(unit, need)
        elif not left and self.splits > splits and not self.spread:
            self.unsplit(unit, need, free, taken)
        return left

    def unsplit(self, scope: _Unit, need: int, free: int, taken: int) -> None:
        """What the descent took under ``scope`` (``need`` CPUs, from ``free``; ``taken``
        before) splits a core: take whole free cores adding up to ``need`` instead, if some do
        and they span no more NUMA nodes, sockets and L3 caches (greedy whole units of an odd
        size, a core with an offline thread, leave a remainder that only a split can make)."""
        if scope.width and need % scope.width:
            return  # cores of one width cannot make the count: the split stays
        got = self.taken & ~taken
        self.free = free  # packing order as the descent saw it
        order = [core for core in self.ordered_cores(scope) if core.mask & free == core.mask]
        self.free = free & ~got
        whole = _exact_cores(order, need)
        if whole is None or any(
            a > b for a, b in zip(_spans(scope, whole), _spans(scope, got), strict=True)
        ):
            return
        self.free, self.taken = free & ~whole, taken | whole

    def _exact(self, scope: _Unit, need: int) -> int:
        """Full-cores mode: whole cores under ``scope`` adding up to exactly ``need``."""
        mask = _exact_cores(self.ordered_cores(scope), need)
        if mask is None:
            return need
        return need - self.take(mask)

    def _threads(self, scope: _Unit, need: int) -> int:
        if self.full_cores:
            return need
        for core in self.ordered_cores(scope):
            mask = core.mask & self.free
            while mask and need:
                low = mask & -mask
                need -= self.take(low)
                mask ^= low
            if not need:
                self.splits += mask != 0  # the last core keeps a free thread
                break
        return need


def allocate(
    topology: Topology,
    available: CpuSet,
    count: int,
    policy: AllocationPolicy = AllocationPolicy(),
) -> CpuSet:
    """Choose ``count`` CPUs out of ``available`` (the free CPUs) for one claim.

    Never returns a CPU outside ``available``; CPUs of ``available`` that are not online are
    ignored. Raises :class:`InsufficientCpusError` when the free CPUs cannot satisfy the request
    and :class:`AllocationError` when the request itself is invalid.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise AllocationError(f"invalid CPU count {count!r}: must be a whole number of at least 1")
    index = _index(topology)
    free = available.mask & topology.online.mask
    if free.bit_count() < count:
        raise InsufficientCpusError(
            f"cannot allocate {count} CPUs: only {free.bit_count()} free"
            f" ({CpuSet.from_mask(free) or 'none'})"
        )
    if policy.full_cores:
        width = topology.smt_width
        if count % width:
            raise AllocationError(
                f"cannot allocate {count} CPUs as whole cores: the count must be a multiple"
                f" of the SMT width {width}"
            )
        free = _whole_core_mask(index, free)
        if free.bit_count() < count:
            raise InsufficientCpusError(
                f"cannot allocate {count} CPUs as whole cores: only {free.bit_count()} CPUs"
                f" in fully free cores ({CpuSet.from_mask(free) or 'none'})"
            )

    preferred = policy.prefer_core_type
    pool = index.type_masks.get(preferred, 0) & free if preferred is not None else 0
    if pool and pool != free:
        if pool.bit_count() >= count:
            result = _choose(index, pool, count, policy)
        else:
            # not enough of the preferred type: all of it, the rest from the other cores
            rest = _choose(index, free & ~pool, count - pool.bit_count(), policy)
            result = None if rest is None else pool | rest
        if result is not None:
            return CpuSet.from_mask(result)
        # whole cores could not add up within that split: one descent over every free CPU
    result = _choose(index, free, count, policy)
    if result is None:
        raise InsufficientCpusError(
            f"cannot allocate {count} CPUs as whole cores out of"
            f" {CpuSet.from_mask(free) or 'none'}: no combination of free cores adds up"
        )
    return CpuSet.from_mask(result)


def _spans(scope: _Unit, mask: int) -> tuple[int, int, int]:
    """How many units of the three levels above cores (under ``scope``) ``mask`` touches."""
    counts = [0, 0, 0]

    def visit(unit: _Unit) -> None:
        if unit.level >= _CORE or not unit.mask & mask:
            return
        if unit.level >= _L1:
            counts[unit.level] += 1
        for kid in unit.children:
            visit(kid)

    visit(scope)
    return counts[0], counts[1], counts[2]


def _whole_core_mask(index: _Index, free: int) -> int:
    mask = 0
    for core in index.cores:
        if core.mask & free == core.mask:
            mask |= core.mask
    return mask


def _choose(index: _Index, free: int, count: int, policy: AllocationPolicy) -> int | None:
    """The mask of ``count`` CPUs out of ``free``; None when whole cores cannot add up."""
    if count <= 0:
        return 0
    if policy.full_cores:
        pick = _Pick(index, free, full_cores=True)
        if pick.fill(index.root, _L1, count) == 0:
            return pick.taken
        # greedy whole units made the rest unreachable: any exact combination, packing order
        return _exact_cores(_Pick(index, free).ordered(index.root, _CORE), count)
    if policy.strategy is Strategy.SPREAD:
        return _spread(index, free, count)
    pick = _Pick(index, free)
    if pick.fill(index.root, _L1, count) == 0 and pick.splits:
        pick.unsplit(index.root, count, free, 0)
    return pick.taken


def _spread(index: _Index, free: int, count: int) -> int:
    taken = 0
    need = count
    while need > 0:
        reps = 0
        for core in index.cores:
            mask = core.mask & free
            if mask:
                reps |= mask & -mask
        if not reps:
            break
        if reps.bit_count() <= need:
            taken |= reps
            free &= ~reps
            need -= reps.bit_count()
            continue
        pick = _Pick(index, reps, spread=True)
        pick.fill(index.root, _L1, need)
        taken |= pick.taken
        need = 0
    return taken


def _exact_cores(cores: list[_Unit], need: int) -> int | None:
    """The mask of some of ``cores`` adding up to exactly ``need`` CPUs, or None.

    Subset sum over core sizes, as bit sets (bit s of ``reach[i]``: s CPUs can be made of the
    first i cores); the choice keeps the earliest cores of ``cores`` (packing order).
    """
    reach = [1]
    limit = (1 << (need + 1)) - 1
    for core in cores:
        reach.append((reach[-1] | (reach[-1] << core.size)) & limit)
    if not reach[-1] >> need & 1:
        return None
    taken = 0
    for i in range(len(cores), 0, -1):
        if reach[i - 1] >> need & 1:
            continue
        taken |= cores[i - 1].mask
        need -= cores[i - 1].size
    return taken


def describe_plan(topology: Topology, cpus: CpuSet) -> dict[str, Any]:
    """What a chosen set means in topology terms (``dracpu plan -o json``)."""
    return {
        "cpus": str(cpus),
        "count": len(cpus),
        "numaNodes": topology.numa_nodes_of(cpus),
        "sockets": topology.sockets_of(cpus),
        "l3Caches": topology.l3_caches_of(cpus),
        "cores": [str(core & cpus) for core in topology.cores_of(cpus)],
    }
