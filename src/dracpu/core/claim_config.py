"""Per-claim opaque configuration of driver ``dra.cpu``: what a claim's configs ask of Prepare.

Pure: a :class:`~dracpu.core.claims.ClaimAllocation` (its results and its opaque configs of our
driver, read raw by :func:`dracpu.core.claims.read_claim`) goes in; the claim's
:class:`~dracpu.core.commands.DeviceResult` values, with their overrides, and the claim's memory
pinning come out (:func:`claim_overrides`). Every problem is a
:class:`~dracpu.errors.ClaimError` naming the claim, the config's place in
``status.allocation.devices.config`` and the field. The schema (upstream's
``api/v1alpha1/types.go`` with our fields next to ``cpuset``), which configs apply and which
wins (``ConfigForResult``), the rules beyond one field and what the node's ``allocator``
changes are ``docs/claim-config.md``; the cpuset itself is checked where the node state is
known (:func:`dracpu.core.state_claims.prepare`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any

from dracpu.core.allocator import Strategy
from dracpu.core.claims import AllocatedDevice, ClaimAllocation, OpaqueConfig
from dracpu.core.commands import DeviceResult
from dracpu.core.cpuset import CpuSet
from dracpu.errors import ClaimError, CpuSetParseError

__all__ = [
    "ALLOCATOR_CPUMANAGER",
    "ALLOCATOR_EXTERNAL",
    "API_VERSION",
    "ClaimOverrides",
    "CpuConfig",
    "Memory",
    "claim_overrides",
    "parse_parameters",
]

# The values of upstream's allocator key (internal/driverconfig AllocatorCPUManager,
# AllocatorExternal; kubernetes-sigs/dra-driver-cpu#229).
ALLOCATOR_CPUMANAGER = "cpumanager"
ALLOCATOR_EXTERNAL = "external"
# upstream api/v1alpha1 APIVersion: the only version of the parameters.
API_VERSION = "v1alpha1"
# resource/v1 AllocationConfigSource: configs from the claim; anything else (FromClass) is a
# DeviceClass's (upstream refuses a cpuset unless the source is exactly this).
SOURCE_CLAIM = "FromClaim"
SOURCE_CLASS = "FromClass"

_TOP_FIELDS = ("apiVersion", "cpuConfig")
_CPU_FIELDS = ("cpuset", "policy", "fullCores", "memory", "sharedPool")
# Error messages quote at most this much of a bad value.
_SHOWN_CHARS = 80


class Memory(StrEnum):
    """``cpuConfig.memory``: pin the claim's containers' memory to the NUMA nodes of its CPUs,
    or not."""

    PIN = "pin"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class CpuConfig:
    """The ``cpuConfig`` of one or more configs; ``None``: not set."""

    cpuset: CpuSet | None = None
    policy: Strategy | None = None
    full_cores: bool | None = None
    memory: Memory | None = None
    shared_pool: bool | None = None

    def under(self, later: CpuConfig) -> CpuConfig:
        """This config with every field ``later`` sets replaced by ``later``'s."""
        changes = {
            name: value for name in _FIELD_NAMES if (value := getattr(later, name)) is not None
        }
        return replace(self, **changes) if changes else self


_FIELD_NAMES = tuple(f.name for f in fields(CpuConfig))
_NOTHING = CpuConfig()


@dataclass(frozen=True, slots=True)
class ClaimOverrides:
    """What a claim's opaque configs ask: its results (with ``cpuset``, ``strategy`` and
    ``full_cores`` set from them) for :class:`~dracpu.core.commands.PrepareClaim`, its memory
    pinning (``None``: the node's default) and whether its containers also run on the shared
    pool."""

    results: tuple[DeviceResult, ...]
    pin_memory: bool | None = None
    shared_pool: bool = False


def _show(value: object) -> str:
    """A JSON value for an error message: strings as ``'text'``, the rest as JSON."""
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _unknown(where: str, prefix: str, key: object, known: tuple[str, ...], hint: str) -> str:
    name = f"{prefix}{key}" if isinstance(key, str) else f"{prefix}{_show(key)}"
    if isinstance(key, str):
        same = [k for k in known if k.lower() == key.lower()]
        if same:
            return (
                f"{where} {name}: unknown field; did you mean {same[0]!r}? "
                "(field names are case-sensitive)"
            )
        if hint and key in _CPU_FIELDS:
            return f"{where} {name}: unknown field; {hint}"
    return f"{where} {name}: unknown field (known: {', '.join(known)})"


def _choice(where: str, field: str, value: object, kind: type[StrEnum]) -> Any:
    choices = [str(member) for member in kind]
    if not isinstance(value, str) or value not in choices:
        raise ClaimError(f"{where} {field}: {_show(value)} is not one of {', '.join(choices)}")
    return kind(value)


def _cpuset(where: str, value: object) -> CpuSet:
    field = "cpuConfig.cpuset"
    if not isinstance(value, str):
        raise ClaimError(f"{where} {field}: {_show(value)} is not a string (e.g. '0-3,8')")
    if not value.strip():
        raise ClaimError(f"{where} {field}: empty; leave the field out to let dracpu choose")
    try:
        return CpuSet.parse(value)
    except CpuSetParseError as exc:
        raise ClaimError(f"{where} {field}: {exc}") from None


def parse_parameters(parameters: object, where: str) -> CpuConfig:
    """The ``cpuConfig`` of one config's ``opaque.parameters``, checked.

    ``where`` starts every error message (``claim ns/name: opaque config [1]``). Raises
    :class:`ClaimError` naming the field for anything but the schema in the module docstring.
    """
    if not isinstance(parameters, Mapping):
        raise ClaimError(f"{where}: the parameters {_show(parameters)} are not a JSON object")
    for key in parameters:
        if key not in _TOP_FIELDS:
            raise ClaimError(_unknown(where, "", key, _TOP_FIELDS, "it belongs inside cpuConfig"))
    version = parameters.get("apiVersion")
    if version is None:
        raise ClaimError(f"{where} apiVersion: missing (must be {API_VERSION!r})")
    if version != API_VERSION:
        raise ClaimError(
            f"{where} apiVersion: {_show(version)} is not supported (must be {API_VERSION!r})"
        )
    cpu = parameters.get("cpuConfig")
    if cpu is None:
        raise ClaimError(f"{where} cpuConfig: missing")
    if not isinstance(cpu, Mapping):
        raise ClaimError(f"{where} cpuConfig: {_show(cpu)} is not an object")
    for key in cpu:
        if key not in _CPU_FIELDS:
            raise ClaimError(_unknown(where, "cpuConfig.", key, _CPU_FIELDS, ""))
    cpuset, policy, full_cores, memory, shared_pool = (cpu.get(name) for name in _CPU_FIELDS)
    for name, value in (("fullCores", full_cores), ("sharedPool", shared_pool)):
        if value is not None and not isinstance(value, bool):
            raise ClaimError(
                f"{where} cpuConfig.{name}: {_show(value)} is not a boolean (true or false)"
            )
    return CpuConfig(
        cpuset=None if cpuset is None else _cpuset(where, cpuset),
        policy=None if policy is None else _choice(where, "cpuConfig.policy", policy, Strategy),
        full_cores=full_cores,
        memory=None if memory is None else _choice(where, "cpuConfig.memory", memory, Memory),
        shared_pool=shared_pool,
    )


def _applies(config: OpaqueConfig, device: AllocatedDevice) -> bool:
    """``ConfigForResult``'s match: no requests, the result's request, or its main request."""
    requests = config.requests
    return not requests or device.request_ref in requests or device.request in requests


def _precedence(configs: Iterable[OpaqueConfig]) -> list[OpaqueConfig]:
    """Class entries first, then the claim's, each in listed order (a stable sort)."""
    return sorted(configs, key=lambda c: c.source != SOURCE_CLASS)


def _parsed(label: str, config: OpaqueConfig) -> CpuConfig:
    if config.source == SOURCE_CLAIM:
        source = ""
    elif config.source == SOURCE_CLASS:
        source = " (from the DeviceClass)"
    else:
        source = f" (source {config.source!r})"
    where = f"{label}: opaque config [{config.index}]{source}"
    parsed = parse_parameters(config.parameters, where)
    if parsed.cpuset is not None and config.source != SOURCE_CLAIM:
        raise ClaimError(
            f"{where} cpuConfig.cpuset: a cpuset must come from the claim (FromClaim), not "
            "from a DeviceClass: it would give every claim of the class the same CPUs"
        )
    return parsed


def _claim_memory(label: str, chosen: Mapping[str, Memory]) -> bool | None:
    """The claim's one memory pinning out of its results' (request -> value)."""
    values = set(chosen.values())
    if len(values) > 1:
        pinned = sorted(r for r, m in chosen.items() if m is Memory.PIN)
        unpinned = sorted(r for r, m in chosen.items() if m is Memory.NONE)
        raise ClaimError(
            f"{label}: cpuConfig.memory is 'pin' for request {pinned[0]!r} but 'none' for "
            f"request {unpinned[0]!r}; memory pinning is one setting for the whole claim"
        )
    return None if not values else values.pop() is Memory.PIN


def _claim_shared_pool(label: str, chosen: Mapping[str, bool]) -> bool:
    """The claim's one ``sharedPool`` out of its results' (request -> value)."""
    if len(set(chosen.values())) > 1:
        shared = sorted(r for r, v in chosen.items() if v)
        alone = sorted(r for r, v in chosen.items() if not v)
        raise ClaimError(
            f"{label}: cpuConfig.sharedPool is true for request {shared[0]!r} but false for "
            f"request {alone[0]!r}; it is one setting for the whole claim (its containers get "
            "one cpuset)"
        )
    return any(chosen.values())


def claim_overrides(allocation: ClaimAllocation, allocator: str | None = None) -> ClaimOverrides:
    """The claim's results with what its opaque configs ask, and its memory pinning.

    ``allocator``: the node's ``allocator`` in grouped mode (``None``: not set, or individual
    mode). Raises :class:`ClaimError` naming the config and field for a bad config that applies
    to a result of ours, and for the combinations refused in the module docstring.
    """
    label = f"claim {allocation.namespace}/{allocation.name}"
    plain = allocation.device_results()
    external = allocator == ALLOCATOR_EXTERNAL
    if not allocation.configs and not external:
        return ClaimOverrides(plain)
    ordered = _precedence(allocation.configs)
    parsed: dict[int, CpuConfig] = {}
    totals: dict[str, int] = {}  # external: the CPUs each request's results consume together
    for device in allocation.devices if external else ():
        totals[device.request_ref] = totals.get(device.request_ref, 0) + (device.consumed_cpus or 1)
    # The results of one request (an individual claim has up to 32) share their configs.
    by_request: dict[str, CpuConfig] = {}
    results: list[DeviceResult] = []
    for device, result in zip(allocation.devices, plain, strict=True):
        ref = device.request_ref
        effective = by_request.get(ref)
        if effective is None:
            if external:
                effective = _request_config(label, ref, ordered, device, totals[ref])
            else:
                effective = _merged(label, ref, ordered, device, parsed, allocator)
            by_request[ref] = effective
        if effective.cpuset is None and effective.policy is None and effective.full_cores is None:
            results.append(result)
        else:
            results.append(
                replace(
                    result,
                    cpuset=None if external else effective.cpuset,
                    request_cpuset=effective.cpuset if external else None,
                    strategy=effective.policy,
                    full_cores=effective.full_cores,
                )
            )
    memory = {ref: c.memory for ref, c in by_request.items() if c.memory is not None}
    shared = {ref: c.shared_pool for ref, c in by_request.items() if c.shared_pool is not None}
    return ClaimOverrides(
        tuple(results), _claim_memory(label, memory), _claim_shared_pool(label, shared)
    )


def _merged(
    label: str,
    ref: str,
    ordered: list[OpaqueConfig],
    device: AllocatedDevice,
    parsed: dict[int, CpuConfig],
    allocator: str | None,
) -> CpuConfig:
    """Every config that applies to the request, field by field (``parsed``: the configs read
    so far, by index)."""
    effective = _NOTHING
    for config in ordered:
        if _applies(config, device):
            if config.index not in parsed:
                parsed[config.index] = _parsed(label, config)
            effective = effective.under(parsed[config.index])
    if effective.full_cores and effective.policy is Strategy.SPREAD:
        raise ClaimError(
            f"{label} request {ref!r}: cpuConfig.fullCores true takes whole cores "
            "packed; it cannot be combined with cpuConfig.policy 'spread'"
        )
    if effective.cpuset is not None and allocator == ALLOCATOR_CPUMANAGER:
        raise ClaimError(
            f"{label} request {ref!r}: cpuConfig.cpuset {effective.cpuset} is not taken "
            "with allocator cpumanager, which picks the CPUs itself (upstream: preferred "
            "CPUs not supported); remove the cpuset, or run the node with allocator "
            "external"
        )
    return effective


def _request_config(
    label: str, ref: str, ordered: list[OpaqueConfig], device: AllocatedDevice, total: int
) -> CpuConfig:
    """``allocator: external``: the one claim config with a cpuset of the whole request
    (upstream ``External.GetPreferredCPUs``)."""
    where = f"{label} request {ref!r}"
    matching = [config for config in ordered if _applies(config, device)]
    for config in matching:
        if config.source != SOURCE_CLAIM:
            raise ClaimError(
                f"{where}: opaque config [{config.index}] comes from the DeviceClass; with "
                "allocator external the cpuset must be defined per ResourceClaim request "
                "(upstream: configuration from DeviceClass is not supported by this driver)"
            )
    if len(matching) != 1:
        raise ClaimError(
            f"{where} is targeted by {len(matching)} opaque configs of driver dra.cpu; with "
            "allocator external it must be targeted by exactly 1, carrying cpuConfig.cpuset"
        )
    config = matching[0]
    parsed = _parsed(label, config)
    if parsed.cpuset is None:
        raise ClaimError(
            f"{where}: opaque config [{config.index}] has no cpuConfig.cpuset; with allocator "
            "external every request needs one (upstream: no opaque cpuset configuration found)"
        )
    if len(parsed.cpuset) != total:
        raise ClaimError(
            f"{where}: opaque cpuset {parsed.cpuset} has {len(parsed.cpuset)} CPUs, which does "
            f"not match the request total of {total} CPUs"
        )
    return parsed
