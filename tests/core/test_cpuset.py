"""CpuSet: Linux list syntax both ways, refusal of bad text, and set algebra like frozenset."""

from __future__ import annotations

import copy
import pickle
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dracpu.core.cpuset import MAX_CPU_ID, CpuSet
from dracpu.errors import CpuSetParseError

# --- parse and format tables -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cpus", "canonical"),
    [
        ("", [], ""),
        ("\n", [], ""),
        ("0", [0], "0"),
        ("7\n", [7], "7"),
        ("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11], "0-3,8,10-11"),
        ("0-3,8,10-11\n", [0, 1, 2, 3, 8, 10, 11], "0-3,8,10-11"),
        ("  1-2\t\n", [1, 2], "1-2"),
        ("1,0", [0, 1], "0-1"),  # unsorted
        ("5,3,4", [3, 4, 5], "3-5"),
        ("0-5,2-8", list(range(9)), "0-8"),  # overlapping
        ("2-2", [2], "2"),
        ("3,3,3", [3], "3"),
        ("0,2,4", [0, 2, 4], "0,2,4"),
        ("0-1,2-3", [0, 1, 2, 3], "0-3"),  # adjacent ranges join
        ("63-64", [63, 64], "63-64"),  # across a 64-bit word
        ("0001", [1], "1"),
        (f"{MAX_CPU_ID}", [MAX_CPU_ID], f"{MAX_CPU_ID}"),
        (f"0-{MAX_CPU_ID}", list(range(MAX_CPU_ID + 1)), f"0-{MAX_CPU_ID}"),
    ],
)
def test_parse_and_format(text: str, cpus: list[int], canonical: str) -> None:
    parsed = CpuSet.parse(text)
    assert list(parsed) == cpus
    assert parsed.format() == canonical
    assert str(parsed) == canonical
    assert repr(parsed) == f"CpuSet({canonical!r})"
    assert CpuSet(cpus) == parsed


@pytest.mark.parametrize(
    "text",
    [
        "3-1",
        "a",
        "1,,2",
        "-1",
        "1-",
        "1 2",
        "1, 2",
        ",1",
        "1,",
        "1-2-3",
        "0x3",
        "+1",
        "1.0",
        "\u0663",  # ARABIC-INDIC DIGIT THREE: str.isdigit() says yes, the kernel says no
        "99999999999",
        "0-99999999",
        f"{MAX_CPU_ID + 1}",
        "0-3\n8",
    ],
)
def test_parse_rejects_malformed_text_naming_it(text: str) -> None:
    with pytest.raises(CpuSetParseError) as info:
        CpuSet.parse(text)
    assert repr(text) in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("digits", [6, 4000, 5000, 100_000])
def test_parse_huge_ids_are_refused_with_a_short_message(digits: int) -> None:
    # Python's int() refuses over 4300 digits with a plain ValueError: we must not leak it.
    text = "0-" + "9" * digits
    with pytest.raises(CpuSetParseError, match="above the limit") as info:
        CpuSet.parse(text)
    assert len(str(info.value)) < 400


def test_leading_zeros_are_not_a_huge_id() -> None:
    assert CpuSet.parse("0" * 50 + "7") == CpuSet([7])


@pytest.mark.parametrize("bad", [-1, MAX_CPU_ID + 1, True, "1", 1.0, None])
def test_constructor_rejects_bad_ids(bad: object) -> None:
    with pytest.raises(CpuSetParseError):
        CpuSet([0, bad])  # type: ignore[list-item]


def test_from_mask_and_range() -> None:
    assert CpuSet.from_mask(0b1011) == CpuSet([0, 1, 3])
    assert CpuSet.from_mask(0) == CpuSet()
    assert CpuSet.range(2, 6) == CpuSet.parse("2-5")
    assert CpuSet.range(5, 5) == CpuSet()
    assert CpuSet.range(6, 2) == CpuSet()
    with pytest.raises(CpuSetParseError):
        CpuSet.from_mask(-1)
    with pytest.raises(CpuSetParseError):
        CpuSet.from_mask(1 << (MAX_CPU_ID + 1))
    with pytest.raises(CpuSetParseError):
        CpuSet.range(-1, 3)
    with pytest.raises(CpuSetParseError):
        CpuSet.range(0, MAX_CPU_ID + 2)


def test_queries() -> None:
    cpus = CpuSet.parse("3,5-7,64")
    assert len(cpus) == 5
    assert bool(cpus)
    assert not CpuSet()
    assert cpus.min() == 3
    assert cpus.max() == 64
    assert cpus.mask == (1 << 3) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 64)
    assert cpus.lowest(2) == CpuSet([3, 5])
    assert cpus.lowest(0) == CpuSet()
    assert cpus.lowest(99) == cpus
    assert 64 in cpus
    assert 4 not in cpus
    assert -1 not in cpus
    assert MAX_CPU_ID + 10 not in cpus
    assert "3" not in cpus
    with pytest.raises(ValueError, match="empty"):
        CpuSet().min()
    with pytest.raises(ValueError, match="empty"):
        CpuSet().max()


def test_immutable_and_hashable() -> None:
    cpus = CpuSet.parse("1-3")
    with pytest.raises(AttributeError):
        cpus._mask = 0
    with pytest.raises(AttributeError):
        cpus.extra = 1
    assert {cpus: "a"}[CpuSet([1, 2, 3])] == "a"
    assert len({cpus, CpuSet([3, 2, 1]), CpuSet([1])}) == 2
    assert pickle.loads(pickle.dumps(cpus)) == cpus
    assert copy.deepcopy(cpus) == cpus
    assert cpus != "1-3"
    assert cpus != {1, 2, 3}


def test_operators_refuse_other_types() -> None:
    cpus = CpuSet([1])
    with pytest.raises(TypeError):
        _ = cpus | {2}  # type: ignore[operator]
    with pytest.raises(TypeError):
        _ = cpus < frozenset({1, 2})  # type: ignore[operator]


def test_union_of_many() -> None:
    assert CpuSet.union([]) == CpuSet()
    assert CpuSet.union(CpuSet([n]) for n in range(0, 10, 3)) == CpuSet([0, 3, 6, 9])


# --- properties --------------------------------------------------------------------------------

cpu_ids = st.one_of(st.integers(0, 130), st.integers(0, MAX_CPU_ID))
sets = st.frozensets(cpu_ids, max_size=60)


def _text_of(ranges: list[tuple[int, int]]) -> str:
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


ranges = st.lists(
    st.tuples(st.integers(0, 200), st.integers(0, 20)).map(lambda t: (t[0], t[0] + t[1])),
    max_size=12,
)


@given(sets)
def test_round_trip(cpus: frozenset[int]) -> None:
    cs = CpuSet(cpus)
    text = cs.format()
    assert CpuSet.parse(text) == cs
    assert CpuSet.parse(text).format() == text
    assert CpuSet.parse(text + "\n") == cs
    assert set(cs) == cpus
    assert list(cs) == sorted(cpus)
    assert len(cs) == len(cpus)


@given(ranges)
def test_any_list_text_canonicalises(spans: list[tuple[int, int]]) -> None:
    expected = frozenset(n for a, b in spans for n in range(a, b + 1))
    parsed = CpuSet.parse(_text_of(spans))
    assert set(parsed) == expected
    text = parsed.format()
    # Canonical: ascending runs separated by gaps; "n" for one CPU, "a-b" (a < b) for more.
    bounds: list[tuple[int, int]] = []
    for part in text.split(",") if text else []:
        first, dash, last = part.partition("-")
        low, high = int(first), int(last) if dash else int(first)
        assert (dash == "") == (low == high)
        assert low <= high
        bounds.append((low, high))
    assert all(prev[1] + 1 < nxt[0] for prev, nxt in pairwise(bounds))
    assert CpuSet.parse(text) == parsed


@given(sets, sets)
def test_algebra_matches_frozenset(a: frozenset[int], b: frozenset[int]) -> None:
    x, y = CpuSet(a), CpuSet(b)
    assert set(x | y) == a | b
    assert set(x & y) == a & b
    assert set(x - y) == a - b
    assert set(x ^ y) == a ^ b
    assert (x <= y) == (a <= b)
    assert (x < y) == (a < b)
    assert (x >= y) == (a >= b)
    assert (x > y) == (a > b)
    assert x.issubset(y) == a.issubset(b)
    assert x.issuperset(y) == a.issuperset(b)
    assert x.isdisjoint(y) == a.isdisjoint(b)
    assert (x == y) == (a == b)
    assert (hash(x) == hash(y)) or a != b
    assert CpuSet.union([x, y]) == x | y


@given(sets, st.integers(0, 70))
def test_min_max_lowest(a: frozenset[int], n: int) -> None:
    cs = CpuSet(a)
    if a:
        assert cs.min() == min(a)
        assert cs.max() == max(a)
    assert list(cs.lowest(n)) == sorted(a)[:n]


@settings(max_examples=50)
@given(st.text(alphabet="0123456789-, \n", max_size=20))
def test_parse_never_raises_anything_but_cpuset_parse_error(text: str) -> None:
    try:
        parsed = CpuSet.parse(text)
    except CpuSetParseError:
        return
    assert CpuSet.parse(parsed.format()) == parsed
