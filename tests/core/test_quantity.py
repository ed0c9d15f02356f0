"""Kubernetes quantities as exact fractions (dracpu.core.quantity).

The tables follow the serialization format of k8s.io/apimachinery resource.Quantity (quantity.go,
suffix.go): what Go's ParseQuantity accepts and the value it means, and what it refuses.
"""

from __future__ import annotations

import re
import time
from fractions import Fraction

import pytest

from dracpu.core.quantity import (
    MAX_DECIMAL_EXPONENT,
    MAX_QUANTITY_TEXT,
    parse_positive_whole,
    parse_quantity,
)
from dracpu.errors import DracpuError, QuantityError

# --- parse_quantity: the syntax -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        # <number>: digits, digits.digits, digits., .digits; leading zeros
        ("0", Fraction(0)),
        ("1", Fraction(1)),
        ("007", Fraction(7)),
        ("1.5", Fraction(3, 2)),
        ("1.", Fraction(1)),
        (".5", Fraction(1, 2)),
        ("0.000000001", Fraction(1, 10**9)),
        ("12345678901234567890", Fraction(12345678901234567890)),
        # <sign>
        ("+3", Fraction(3)),
        ("-3", Fraction(-3)),
        ("-0", Fraction(0)),
        ("-.5", Fraction(-1, 2)),
        # <decimalSI>, n and u included (suffix.go)
        ("1n", Fraction(1, 10**9)),
        ("1u", Fraction(1, 10**6)),
        ("500m", Fraction(1, 2)),
        ("2000m", Fraction(2)),
        ("1k", Fraction(1000)),
        ("1M", Fraction(10**6)),
        ("1G", Fraction(10**9)),
        ("1T", Fraction(10**12)),
        ("1P", Fraction(10**15)),
        ("1E", Fraction(10**18)),
        ("1.5k", Fraction(1500)),
        ("1.G", Fraction(10**9)),
        # <binarySI>
        ("1Ki", Fraction(1024)),
        ("1Mi", Fraction(2**20)),
        ("1Gi", Fraction(2**30)),
        ("1Ti", Fraction(2**40)),
        ("1Pi", Fraction(2**50)),
        ("1Ei", Fraction(2**60)),
        ("0.5Ki", Fraction(512)),
        ("-2Mi", Fraction(-(2**21))),
        # <decimalExponent>: e or E, a signed integer; "1E2" is an exponent, "1E" is exa
        ("1e3", Fraction(1000)),
        ("1E2", Fraction(100)),
        ("1e+3", Fraction(1000)),
        ("1e-3", Fraction(1, 1000)),
        ("1.5e1", Fraction(15)),
        ("1.e1", Fraction(10)),
        (".5e1", Fraction(5)),
        ("1e007", Fraction(10**7)),
        ("1e0", Fraction(1)),
        # the bounds themselves
        (f"1e{MAX_DECIMAL_EXPONENT}", Fraction(10**MAX_DECIMAL_EXPONENT)),
        (f"1e-{MAX_DECIMAL_EXPONENT}", Fraction(1, 10**MAX_DECIMAL_EXPONENT)),
        ("9" * MAX_QUANTITY_TEXT, Fraction(10**MAX_QUANTITY_TEXT - 1)),
        ("." + "0" * (MAX_QUANTITY_TEXT - 2) + "1", Fraction(1, 10 ** (MAX_QUANTITY_TEXT - 1))),
    ],
)
def test_valid_quantities_have_their_exact_value(text: str, value: Fraction) -> None:
    assert parse_quantity(text) == value
    assert type(parse_quantity(text)) is Fraction


@pytest.mark.parametrize(
    "text",
    [
        "",
        " 1",
        "1 ",
        "1\n",  # a "$" anchor would let this one through
        "\t1",
        "+",  # Go's scanner reads a bare sign or dot as zero; the grammar does not allow them
        "-",
        ".",
        "-.",
        ".e3",
        "++1",
        "+-1",
        "1..5",
        "1.5.",
        "abc",
        "1x",
        "0x10",
        "1_000",  # Python's int() and Fraction() would take the underscore
        "1/2",
        "inf",
        "nan",
        "1e",
        "1e+",
        "1e3.5",  # the exponent is an integer (suffix.go: strconv.ParseInt)
        "1e3k",
        "1ki",
        "1K",
        "1KI",
        "1mi",
        "1Ki2",
        "1kk",
        "1 Ki",
        "k",
        "Ki",
        "e3",
        "\u0663",  # ARABIC-INDIC DIGIT THREE: \d would match it
        "\uff11",  # FULLWIDTH DIGIT ONE
        "1\u00a0",
    ],
)
def test_invalid_quantities_are_refused(text: str) -> None:
    with pytest.raises(QuantityError, match="is not a Kubernetes quantity"):
        parse_quantity(text)


@pytest.mark.parametrize("value", [4, 1.5, None, b"1", ["1"], {"value": "1"}, True])
def test_non_strings_are_refused(value: object) -> None:
    with pytest.raises(QuantityError, match="is not a quantity string"):
        parse_quantity(value)


def test_quantity_error_is_a_dracpu_value_error() -> None:
    assert issubclass(QuantityError, DracpuError)
    assert issubclass(QuantityError, ValueError)


# --- hostile inputs are bounded -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        f"1e{MAX_DECIMAL_EXPONENT + 1}",
        f"1e-{MAX_DECIMAL_EXPONENT + 1}",
        "1e999999999",
        "1e-999999999",
        "1E999999999",
        "-1e999999999",
        "0e999999999",
        "1e" + "9" * (MAX_QUANTITY_TEXT - 2),
    ],
)
def test_huge_decimal_exponents_are_out_of_range(text: str) -> None:
    started = time.perf_counter()
    with pytest.raises(QuantityError, match="out of range"):
        parse_quantity(text)
    assert time.perf_counter() - started < 0.5  # refused, not computed


@pytest.mark.parametrize(
    "text",
    [
        "1" * (MAX_QUANTITY_TEXT + 1),
        "1" * 10**6,
        "0." + "0" * 10**6 + "1",
        "1" + "e" * 10**6,
        "9" * 10**6 + "Ei",
    ],
)
def test_long_text_is_refused_unread_and_not_quoted_whole(text: str) -> None:
    started = time.perf_counter()
    with pytest.raises(QuantityError, match="longer than 64 characters") as refused:
        parse_quantity(text)
    assert time.perf_counter() - started < 0.5
    assert len(str(refused.value)) < 3 * MAX_QUANTITY_TEXT


def test_a_long_non_string_is_not_quoted_whole() -> None:
    with pytest.raises(QuantityError, match="is not a quantity string") as refused:
        parse_quantity(list(range(10**5)))
    assert len(str(refused.value)) < 3 * MAX_QUANTITY_TEXT


def test_short_values_are_quoted_whole() -> None:
    with pytest.raises(QuantityError) as refused:
        parse_quantity("12x")
    assert str(refused.value) == "'12x' is not a Kubernetes quantity"


# --- parse_positive_whole -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", 1),
        ("+3", 3),
        ("2000m", 2),
        ("1e1", 10),
        ("1E2", 100),
        ("1.0", 1),
        ("4000000000n", 4),
        ("1k", 1000),
        ("1Ki", 1024),
        ("0.5Ki", 512),
        ("16", 16),
    ],
)
def test_positive_whole_numbers_are_accepted(text: str, expected: int) -> None:
    value = parse_positive_whole(text, maximum=2048, unit="CPUs")
    assert value == expected
    assert type(value) is int


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "'0' is not positive"),
        ("-1", "'-1' is not positive"),
        ("0.0", "'0.0' is not positive"),
        ("-0.5", "'-0.5' is not positive"),
        ("1.5", "'1.5' is not a whole number of CPUs"),
        ("500m", "'500m' is not a whole number of CPUs"),
        ("1n", "'1n' is not a whole number of CPUs"),
        ("2049", "'2049' is out of range: at most 2048 CPUs"),
        ("3Ki", "'3Ki' is out of range: at most 2048 CPUs"),
        ("1e30", "'1e30' is out of range: at most 2048 CPUs"),
        ("1e999999999", "out of range: the decimal exponent"),
        ("x", "'x' is not a Kubernetes quantity"),
        (2, "2 is not a quantity string"),
    ],
)
def test_positive_whole_refusals_name_the_value(value: object, message: str) -> None:
    with pytest.raises(QuantityError, match=re.escape(message)):
        parse_positive_whole(value, maximum=2048, unit="CPUs")


def test_the_maximum_itself_is_allowed() -> None:
    assert parse_positive_whole("2048", maximum=2048, unit="CPUs") == 2048
    assert parse_positive_whole("2Ki", maximum=2048, unit="CPUs") == 2048
