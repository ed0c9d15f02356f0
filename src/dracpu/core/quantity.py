"""Kubernetes quantities (``resource.Quantity``) read as exact fractions.

Pure: a quantity string goes in, a :class:`~fractions.Fraction` comes out, or a
:class:`~dracpu.errors.QuantityError` naming the value. :func:`parse_quantity` reads any
quantity; :func:`parse_positive_whole` also requires a whole number from 1 to a maximum (a count
of CPUs in ``consumedCapacity``).

The syntax is the serialization format of ``k8s.io/apimachinery/pkg/api/resource.Quantity``
(quantity.go, suffix.go)::

    <quantity>        ::= <signedNumber><suffix>
    <signedNumber>    ::= <number> | <sign><number>          <sign> ::= "+" | "-"
    <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
    <suffix>          ::= <binarySI> | <decimalSI> | <decimalExponent>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei                      (powers of 2^10)
    <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E           (powers of 10^3)
    <decimalExponent> ::= "e" <signedInteger> | "E" <signedInteger>

``n`` and ``u`` are missing from quantity.go's comment but suffix.go accepts them; ``1E`` is
10^18 and ``1E2`` is 100, as in Go. Where we differ from Go's ``ParseQuantity``, on purpose:

- the value is exact: Go rounds a non-zero value up to a multiple of 10^-9 and caps binary-SI
  values at 2^63-1; callers here decide themselves what is whole or too large;
- the arithmetic is bounded: at most :data:`MAX_QUANTITY_TEXT` characters and a decimal exponent
  within +-:data:`MAX_DECIMAL_EXPONENT`, so a hostile ``"1e999999999"`` is refused as out of
  range instead of computed;
- only ASCII digits, and nothing after the suffix (not even a newline); Go's scanner also reads
  a bare ``"+"``, ``"-"`` or ``"."`` as zero, which the grammar above does not allow, nor do we.
"""

from __future__ import annotations

import re
from fractions import Fraction

from dracpu.errors import QuantityError

__all__ = [
    "MAX_DECIMAL_EXPONENT",
    "MAX_QUANTITY_TEXT",
    "parse_positive_whole",
    "parse_quantity",
]

# Longest quantity text we read: our own quantities are a few digits, the apiserver's canonical
# form of any int64-sized value stays under 30 characters; a longer one is refused unread.
MAX_QUANTITY_TEXT = 64
# Largest magnitude of a decimal exponent ("1e40"): with at most 64 digits this bounds every
# value to about 10^104 (and 10^-104), cheap exact arithmetic; a resource.Quantity cannot hold
# more than 2^63-1 units of 10^-9 anyway (quantity.go, "capped or rounded up").
MAX_DECIMAL_EXPONENT = 40

# The grammar of the module docstring. [0-9], not \d: \d also takes other Unicode digits.
# Used with fullmatch: "$" would accept a trailing newline.
_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)"
    r"(?:(?P<whole>[0-9]+)(?:\.(?P<fraction>[0-9]*))?|\.(?P<only_fraction>[0-9]+))"
    r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)|[eE](?P<exponent>[+-]?[0-9]+))?"
)
# suffix.go: binary suffixes are 2^(10k), decimal ones 10^(3k).
_SUFFIX: dict[str, Fraction] = {
    "": Fraction(1),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}
# How much of a refused value an error message quotes (a hostile value can be megabytes).
_SHOWN = MAX_QUANTITY_TEXT + 8


def parse_quantity(value: object) -> Fraction:
    """The exact value of the quantity string ``value``.

    ``"1.5"`` is 3/2, ``"1500m"`` is 3/2, ``"2Ki"`` is 2048, ``"1e-3"`` is 1/1000. Raises
    :class:`QuantityError` for a non-string, a string that is not a quantity (or is longer than
    :data:`MAX_QUANTITY_TEXT`), and a decimal exponent beyond +-:data:`MAX_DECIMAL_EXPONENT`
    ("out of range").
    """
    if not isinstance(value, str):
        raise QuantityError(f"{_shown(value)} is not a quantity string")
    if len(value) > MAX_QUANTITY_TEXT:
        raise QuantityError(
            f"{_shown(value)} is not a Kubernetes quantity (longer than {MAX_QUANTITY_TEXT} "
            "characters)"
        )
    match = _QUANTITY.fullmatch(value)
    if match is None:
        raise QuantityError(f"{value!r} is not a Kubernetes quantity")
    whole = match["whole"] or ""
    fraction = match["fraction"] or match["only_fraction"] or ""
    amount = Fraction(int(whole + fraction or "0"), 10 ** len(fraction))
    exponent = match["exponent"]
    if exponent is None:
        amount *= _SUFFIX[match["suffix"] or ""]
    else:
        power = int(exponent)
        if abs(power) > MAX_DECIMAL_EXPONENT:
            raise QuantityError(
                f"{value!r} is out of range: the decimal exponent must be within "
                f"+-{MAX_DECIMAL_EXPONENT}"
            )
        amount *= Fraction(10) ** power
    return -amount if match["sign"] == "-" else amount


def parse_positive_whole(value: object, *, maximum: int, unit: str) -> int:
    """A quantity that must be a whole number from 1 to ``maximum`` ``unit`` (e.g. ``"CPUs"``).

    ``"2"``, ``"2000m"``, ``"+3"``, ``"1e1"`` are accepted; ``"0"``, ``"-1"``, ``"1.5"``,
    ``"500m"`` and amounts above ``maximum`` raise :class:`QuantityError` (besides everything
    :func:`parse_quantity` refuses).
    """
    amount = parse_quantity(value)
    if amount <= 0:
        raise QuantityError(f"{value!r} is not positive")
    if amount.denominator != 1:
        raise QuantityError(f"{value!r} is not a whole number of {unit}")
    if amount > maximum:
        raise QuantityError(f"{value!r} is out of range: at most {maximum} {unit}")
    return int(amount)


def _shown(value: object) -> str:
    """``repr(value)``, cut short when it is long."""
    if isinstance(value, str) and len(value) > _SHOWN:
        return f"{value[:_SHOWN]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}..."
