"""An immutable set of CPU ids, with the Linux list syntax (``"0-3,8,10-11"``).

The set is kept as a bit mask in one Python ``int``: union, intersection and difference of two
1024-CPU sets are a few machine words of work, and the size is ``int.bit_count()``. Parsing and
formatting follow ``k8s.io/utils/cpuset`` and the kernel's ``cpulist`` format: comma-separated
single ids and inclusive ``a-b`` ranges, no spaces inside, empty text for the empty set; the only
whitespace accepted is around the whole text (sysfs files end with a newline).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from dracpu.errors import CpuSetParseError

__all__ = ["MAX_CPU_ID", "CpuSet"]

# The largest CONFIG_NR_CPUS any Linux architecture allows today is 8192 (x86_64 MAXSMP); we accept
# twice that so a future machine is not refused, and refuse anything larger so that a typo like
# "100000000" cannot make us allocate a gigantic bit mask.
MAX_CPU_ID = 16383
_MAX_DIGITS = len(str(MAX_CPU_ID))
# Error messages quote at most this much of a bad text (a sysfs file is at most one page).
_SHOWN_CHARS = 120


class CpuSet:
    """An immutable, hashable set of CPU ids; iteration is in ascending order."""

    __slots__ = ("_mask",)

    _mask: int

    def __init__(self, cpus: Iterable[int] = ()) -> None:
        mask = 0
        for cpu in cpus:
            if not isinstance(cpu, int) or isinstance(cpu, bool) or not 0 <= cpu <= MAX_CPU_ID:
                raise CpuSetParseError(
                    f"invalid CPU id {cpu!r}: must be an integer 0..{MAX_CPU_ID}"
                )
            mask |= 1 << cpu
        object.__setattr__(self, "_mask", mask)

    @classmethod
    def from_mask(cls, mask: int) -> CpuSet:
        """Build from a bit mask (bit *n* set = CPU *n*)."""
        if mask < 0 or mask.bit_length() > MAX_CPU_ID + 1:
            raise CpuSetParseError(f"invalid CPU mask: bits must be within 0..{MAX_CPU_ID}")
        new = cls.__new__(cls)
        object.__setattr__(new, "_mask", mask)
        return new

    @classmethod
    def range(cls, start: int, stop: int) -> CpuSet:
        """CPUs ``start`` .. ``stop - 1`` (like :func:`range`)."""
        if start < 0:
            raise CpuSetParseError(f"invalid CPU range {start}..{stop - 1}: negative CPU id")
        if start >= stop:
            return EMPTY
        return cls.from_mask(((1 << (stop - start)) - 1) << start)

    @classmethod
    def parse(cls, text: str) -> CpuSet:
        """Parse Linux list syntax; raise :class:`CpuSetParseError` naming the text."""
        stripped = text.strip()
        if not stripped:
            return EMPTY
        mask = 0
        for part in stripped.split(","):
            first, dash, last = part.partition("-")
            start = _parse_id(first, text)
            end = _parse_id(last, text) if dash else start
            if end < start:
                raise CpuSetParseError(
                    f"invalid cpuset {_shown(text)}: range {_shown(part)} ends before it starts"
                )
            mask |= ((1 << (end - start + 1)) - 1) << start
        return cls.from_mask(mask)

    # --- queries -------------------------------------------------------------------------------

    @property
    def mask(self) -> int:
        return self._mask

    def __len__(self) -> int:
        return self._mask.bit_count()

    def __bool__(self) -> bool:
        return self._mask != 0

    def __contains__(self, cpu: object) -> bool:
        return isinstance(cpu, int) and 0 <= cpu <= MAX_CPU_ID and bool(self._mask >> cpu & 1)

    def __iter__(self) -> Iterator[int]:
        mask = self._mask
        while mask:
            low = mask & -mask
            yield low.bit_length() - 1
            mask ^= low

    def min(self) -> int:
        """The lowest CPU id; ``ValueError`` when empty."""
        if not self._mask:
            raise ValueError("min() of an empty CpuSet")
        return (self._mask & -self._mask).bit_length() - 1

    def max(self) -> int:
        """The highest CPU id; ``ValueError`` when empty."""
        if not self._mask:
            raise ValueError("max() of an empty CpuSet")
        return self._mask.bit_length() - 1

    def lowest(self, count: int) -> CpuSet:
        """The ``count`` lowest CPUs (all of them when there are fewer)."""
        result = 0
        mask = self._mask
        for _ in range(count):
            if not mask:
                break
            low = mask & -mask
            result |= low
            mask ^= low
        return CpuSet.from_mask(result)

    def issubset(self, other: CpuSet) -> bool:
        return self._mask & ~other._mask == 0

    def issuperset(self, other: CpuSet) -> bool:
        return other._mask & ~self._mask == 0

    def isdisjoint(self, other: CpuSet) -> bool:
        return self._mask & other._mask == 0

    # --- algebra -------------------------------------------------------------------------------

    def __or__(self, other: CpuSet) -> CpuSet:
        if not isinstance(other, CpuSet):
            return NotImplemented
        return CpuSet.from_mask(self._mask | other._mask)

    def __and__(self, other: CpuSet) -> CpuSet:
        if not isinstance(other, CpuSet):
            return NotImplemented
        return CpuSet.from_mask(self._mask & other._mask)

    def __sub__(self, other: CpuSet) -> CpuSet:
        if not isinstance(other, CpuSet):
            return NotImplemented
        return CpuSet.from_mask(self._mask & ~other._mask)

    def __xor__(self, other: CpuSet) -> CpuSet:
        if not isinstance(other, CpuSet):
            return NotImplemented
        return CpuSet.from_mask(self._mask ^ other._mask)

    def __le__(self, other: CpuSet) -> bool:
        if not isinstance(other, CpuSet):
            return NotImplemented
        return self.issubset(other)

    def __ge__(self, other: CpuSet) -> bool:
        if not isinstance(other, CpuSet):
            return NotImplemented
        return self.issuperset(other)

    def __lt__(self, other: CpuSet) -> bool:
        if not isinstance(other, CpuSet):
            return NotImplemented
        return self._mask != other._mask and self.issubset(other)

    def __gt__(self, other: CpuSet) -> bool:
        if not isinstance(other, CpuSet):
            return NotImplemented
        return self._mask != other._mask and self.issuperset(other)

    @staticmethod
    def union(sets: Iterable[CpuSet]) -> CpuSet:
        mask = 0
        for cpus in sets:
            mask |= cpus._mask
        return CpuSet.from_mask(mask)

    # --- identity and text ---------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuSet) and self._mask == other._mask

    def __hash__(self) -> int:
        return hash(self._mask)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("CpuSet is immutable")

    def __reduce__(self) -> tuple[object, tuple[int]]:
        return (CpuSet.from_mask, (self._mask,))

    def format(self) -> str:
        """Canonical Linux list syntax: ascending, ranges of 2+ CPUs joined with ``-``."""
        parts: list[str] = []
        mask = self._mask
        while mask:
            start = (mask & -mask).bit_length() - 1
            shifted = mask >> start
            # shifted ^ (shifted + 1) has ones up to and including the first zero above the run.
            end = start + (shifted ^ (shifted + 1)).bit_length() - 2
            parts.append(str(start) if end == start else f"{start}-{end}")
            mask &= ~(((1 << (end - start + 1)) - 1) << start)
        return ",".join(parts)

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return f"CpuSet({self.format()!r})"


def _parse_id(token: str, text: str) -> int:
    if not token or not token.isascii() or not token.isdigit():
        raise CpuSetParseError(f"invalid cpuset {_shown(text)}: {_shown(token)} is not a CPU id")
    # Compare digit counts first: int() of thousands of digits is slow or refused by Python.
    if len(token.lstrip("0")) > _MAX_DIGITS or int(token) > MAX_CPU_ID:
        raise CpuSetParseError(
            f"invalid cpuset {_shown(text)}: CPU id {_shown(token)} is above the limit {MAX_CPU_ID}"
        )
    return int(token)


def _shown(text: str) -> str:
    """``repr`` of text for an error message, cut short when it is long."""
    if len(text) <= _SHOWN_CHARS:
        return repr(text)
    return f"{text[:_SHOWN_CHARS]!r}... ({len(text)} characters)"


EMPTY = CpuSet()
