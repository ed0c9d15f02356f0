"""An independent model of what the API server stores and kube-scheduler writes for a claim on a
device with consumable capacity, for end-to-end tests of Prepare. Shares no code with ``dracpu``.

Written from ``k8s.io/dynamic-resource-allocation/structured`` (``allocateDevice``,
``cmpRequestOverCapacity``, ``calculateConsumedCapacity``, ``roundUpRange``,
``roundUpValidValues``, ``violatesPolicy``) and the API server's ``dropDisabledFields``:

- with ``DRAConsumableCapacity`` a device with ``allowMultipleAllocations`` gets a ``shareID``
  and a ``consumedCapacity`` entry for every capacity it publishes: the request's amount rounded
  up by the capacity's ``requestPolicy``, or without a request the policy's ``default``, or
  without a policy the whole capacity (a request without a policy is taken as it is); a result
  that would break the policy (above ``max``, off the step grid, not a valid value) or the
  capacity left makes the device ineligible;
- without it the API server drops ``allowMultipleAllocations`` and ``requestPolicy`` from
  slices and ``capacity`` from requests, and the scheduler allocates the device whole to one
  claim: no ``consumedCapacity``, no ``shareID``.
"""

from __future__ import annotations

import copy
import math
import re
import uuid
from fractions import Fraction
from typing import Any

_QUANTITY = re.compile(r"(\d+)(?:\.(\d+))?(m?)")


class NotEligible(Exception):
    """The scheduler would not pick this device for the request."""


def quantity(text: str) -> Fraction:
    """The few quantity forms these tests use: "2", "1.5", "1500m"."""
    match = _QUANTITY.fullmatch(text)
    assert match is not None, text
    whole, fraction, milli = match.groups()
    value = Fraction(int(whole + (fraction or "")), 10 ** len(fraction or ""))
    return value / 1000 if milli else value


def canonical(value: Fraction) -> str:
    """resource.Quantity's canonical text: whole numbers plain, else milli units."""
    if value.denominator == 1:
        return str(value.numerator)
    milli = value * 1000
    assert milli.denominator == 1, value
    return f"{milli.numerator}m"


def stored_device(device: dict[str, Any], *, feature: bool) -> dict[str, Any]:
    """The device as the API server stores it."""
    device = copy.deepcopy(device)
    if not feature:
        device.pop("allowMultipleAllocations", None)
        for entry in device.get("capacity", {}).values():
            entry.pop("requestPolicy", None)
    return device


def _consumed(request: Fraction | None, value: Fraction, policy: dict[str, Any] | None) -> Fraction:
    if request is None:
        if policy is not None and "default" in policy:
            return quantity(policy["default"])
        return value
    if policy is None:
        return request
    valid_range = policy.get("validRange")
    if valid_range is not None:
        low = quantity(valid_range["min"])
        if request < low:
            return low
        if "step" not in valid_range:
            return request
        step = quantity(valid_range["step"])
        return low + math.ceil((request - low) / step) * step
    for option in map(quantity, policy.get("validValues") or []):
        if request <= option:
            return option
    return request


def _violates(amount: Fraction, policy: dict[str, Any] | None) -> bool:
    if policy is None or ("default" in policy and amount == quantity(policy["default"])):
        return False
    valid_range = policy.get("validRange")
    if valid_range is not None:
        if "max" in valid_range and amount > quantity(valid_range["max"]):
            return True
        if "step" in valid_range:
            low, step = quantity(valid_range["min"]), quantity(valid_range["step"])
            return (amount - low) % step != 0
        return False
    values = policy.get("validValues")
    return bool(values) and amount not in [quantity(v) for v in values or ()]


def allocate(
    device: dict[str, Any],
    requests: dict[str, str] | None,
    *,
    feature: bool,
    already: dict[str, Fraction] | None = None,
) -> dict[str, Any]:
    """The ``status.allocation.devices.results[]`` entry for a request on the stored ``device``
    (``requests``: its ``capacity.requests``; ``already``: capacity consumed by earlier claims).
    Raises :class:`NotEligible` when the scheduler would not pick the device."""
    result: dict[str, Any] = {"request": "cpus", "driver": "dra.cpu", "device": device["name"]}
    if not (feature and device.get("allowMultipleAllocations")):
        return result  # the whole device, exclusively: nothing consumed is recorded
    # resolveCapacityName: a request name without a domain is in the driver's domain
    asked_for = {
        name if "/" in name else f"{result['driver']}/{name}": amount
        for name, amount in (requests or {}).items()
    }
    consumed: dict[str, str] = {}
    for name, entry in device.get("capacity", {}).items():
        value = quantity(entry["value"])
        policy = entry.get("requestPolicy")
        asked = asked_for.get(name)
        amount = _consumed(None if asked is None else quantity(asked), value, policy)
        if _violates(amount, policy) or amount + (already or {}).get(name, 0) > value:
            raise NotEligible(f"{device['name']}: {name} {amount} does not fit")
        consumed[name] = canonical(amount)
    result["shareID"] = str(uuid.uuid4())
    result["consumedCapacity"] = consumed
    return result
