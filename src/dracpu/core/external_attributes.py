"""The attributes an external allocator reads: ``dra.cpu/cpuIDs`` and ``dra.cpu/smtLayout``.

Upstream (kubernetes-sigs/dra-driver-cpu 0.3, ``pkg/device/builder.go`` ``ExposeExtAttrs``,
``pkg/device/smt.go``, ``docs/dev/smt-layout.md``) publishes both on every grouped device when
``allocator: external``, so that a scheduler plugin choosing the exact CPUs of a claim (its
opaque ``cpuConfig.cpuset``) knows which CPUs a device holds and which are SMT siblings:

- ``dra.cpu/cpuIDs`` (string): the device's allocatable CPUs in Linux list format (``0-7``).
- ``dra.cpu/smtLayout`` (string): the node-wide sibling pairs, version 1 of upstream's encoding:
  entries ``cpuset>S`` (every CPU of the set pairs with the CPU ``S`` above it, taken lowest
  unpaired first) in ascending stride order, then one entry of the CPUs without a sibling, all
  joined by ``;`` (``0-7>4;8-11``). Node-wide: every online CPU, reserved ones included; a
  consumer intersects it with ``cpuIDs``. Two online CPUs of one core are siblings (their
  stride the difference of their ids); a core with one online CPU has none.

Upstream refuses to start where the encoding cannot say the node, and dracpu does not: a value
longer than the API server's 64 bytes (``DeviceAttributeMaxValueLength``) or a core with three
or more online threads (version 1 has pairs only) leaves that attribute out, and
:func:`left_out` says why, for one warning. dracpu publishes no ``smtLayoutV2`` of its own:
upstream reserves the versioned names for its own next formats, whose meaning must never change
once published.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dracpu.core.cpuset import CpuSet
from dracpu.core.topology import Topology

__all__ = ["ATTR_CPU_IDS", "ATTR_SMT_LAYOUT", "external_attributes", "left_out", "smt_layout"]

# The API server's limit of a string attribute value (k8s.io/api resource/v1 types.go
# DeviceAttributeMaxValueLength), in bytes.
MAX_ATTRIBUTE_VALUE_LENGTH = 64
ATTR_CPU_IDS = "dra.cpu/cpuIDs"  # upstream AttributeCPUIDs
# upstream AttributeSMTLayout: version 1 of the encoding, whose name carries no version suffix
ATTR_SMT_LAYOUT = "dra.cpu/smtLayout"

# upstream pkg/device/smt.go AtomSep, StrideSep
_ENTRY_SEP = ";"
_STRIDE_SEP = ">"


def smt_layout(topology: Topology) -> str | None:
    """Version 1 of the encoding for this node, ``None`` when a core has 3+ online threads."""
    by_stride: dict[int, int] = {}  # stride -> mask of the CPUs of its pairs
    alone = 0
    for core in topology.cores.values():
        cpus = list(core)
        if len(cpus) > 2:
            return None
        if len(cpus) == 1:
            alone |= 1 << cpus[0]
        else:
            low, high = cpus
            stride = high - low
            by_stride[stride] = by_stride.get(stride, 0) | (1 << low) | (1 << high)
    entries = [f"{CpuSet.from_mask(mask)}{_STRIDE_SEP}{s}" for s, mask in sorted(by_stride.items())]
    if alone:
        entries.append(str(CpuSet.from_mask(alone)))
    return _ENTRY_SEP.join(entries)


def _fits(value: str) -> bool:
    return len(value.encode()) <= MAX_ATTRIBUTE_VALUE_LENGTH


def external_attributes(cpus: CpuSet, layout: str | None) -> dict[str, str]:
    """The two attributes of a grouped device of ``cpus`` (``layout``: :func:`smt_layout` of
    the node), each left out where it cannot be published."""
    attributes: dict[str, str] = {}
    cpu_ids = str(cpus)
    if cpus and _fits(cpu_ids):
        attributes[ATTR_CPU_IDS] = cpu_ids
    if layout and _fits(layout):
        attributes[ATTR_SMT_LAYOUT] = layout
    return attributes


def left_out(topology: Topology, groups: Iterable[tuple[str, CpuSet]]) -> list[str]:
    """Why attributes :func:`external_attributes` leaves out of the devices ``groups`` (name,
    CPUs) are missing: one sentence each, for a warning."""
    reasons: list[str] = []
    layout = smt_layout(topology)
    if layout is None:
        wide: Mapping[int, CpuSet] = {
            core.min(): core for core in topology.cores.values() if len(core) > 2
        }
        example = wide[min(wide)]
        reasons.append(
            f"{ATTR_SMT_LAYOUT} is not published: {len(wide)} cores have 3 or more online "
            f"threads (cpus {example} share a core), and version 1 of the encoding describes "
            "sibling pairs only (upstream refuses to start on such a node)"
        )
    elif not _fits(layout):
        reasons.append(
            f"{ATTR_SMT_LAYOUT} is not published: its value {layout!r} is "
            f"{len(layout.encode())} bytes, over the API server's {MAX_ATTRIBUTE_VALUE_LENGTH} "
            "(upstream refuses to start on such a node)"
        )
    for name, cpus in groups:
        cpu_ids = str(cpus)
        if not _fits(cpu_ids):
            reasons.append(
                f"{ATTR_CPU_IDS} is not published on device {name}: its cpus {cpu_ids} take "
                f"{len(cpu_ids.encode())} bytes, over the API server's "
                f"{MAX_ATTRIBUTE_VALUE_LENGTH} (upstream refuses to start on such a node)"
            )
    return reasons
