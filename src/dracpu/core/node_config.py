"""What the state machine knows about the node: topology, published devices, reserved CPUs.

Its own module so that :mod:`dracpu.core.commands` (``Resync`` carries a new config),
:mod:`dracpu.core.state` and the tasks can all name it without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from dracpu.core.allocator import AllocationPolicy
from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.slices import CpuDeviceMode, Device, GroupBy, published_devices
from dracpu.core.topology import Topology

__all__ = ["NodeConfig"]


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """What the state machine needs to know about the node; fixed until a topology Resync.

    ``devices``: the published devices by name (:func:`dracpu.core.slices.published_devices`).
    ``policy``: the default allocation policy of grouped claims; ``pin_memory``: pin the
    containers of a claim to the NUMA nodes of its CPUs unless the claim says otherwise.
    """

    node_name: str
    topology: Topology
    devices: Mapping[str, Device]
    reserved: CpuSet = EMPTY
    policy: AllocationPolicy = field(default_factory=AllocationPolicy)
    pin_memory: bool = False
    allocatable: CpuSet = field(init=False)
    shareable: CpuSet = field(init=False)

    def __post_init__(self) -> None:
        allocatable = self.topology.online - self.reserved
        object.__setattr__(self, "devices", MappingProxyType(dict(self.devices)))
        object.__setattr__(self, "allocatable", allocatable)
        object.__setattr__(self, "shareable", allocatable - self.topology.isolated)

    @classmethod
    def build(
        cls,
        node_name: str,
        topology: Topology,
        *,
        reserved: CpuSet = EMPTY,
        mode: CpuDeviceMode = CpuDeviceMode.GROUPED,
        group_by: GroupBy = GroupBy.NUMANODE,
        policy: AllocationPolicy | None = None,
        pin_memory: bool = False,
    ) -> NodeConfig:
        """The config with the devices this node publishes in ``mode``/``group_by``."""
        devices = published_devices(topology, reserved=reserved, mode=mode, group_by=group_by)
        return cls(
            node_name=node_name,
            topology=topology,
            devices={d.name: d for d in devices},
            reserved=reserved,
            policy=AllocationPolicy() if policy is None else policy,
            pin_memory=pin_memory,
        )
