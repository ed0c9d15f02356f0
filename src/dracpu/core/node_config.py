"""What the state machine knows about the node: topology, published devices, reserved CPUs.

Its own module so that :mod:`dracpu.core.state`, :mod:`dracpu.core.reconfigure` (a SIGHUP's
``Resync`` builds a new one) and the tasks can all name it without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from dracpu.core.allocator import AllocationPolicy
from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.devices import (
    CpuDeviceMode,
    Device,
    GroupBy,
    individual_numbering,
    published_devices,
)
from dracpu.core.topology import Topology

__all__ = ["NodeConfig"]


def _no_numbers() -> Mapping[int, int]:
    return MappingProxyType({})


def _no_held() -> Mapping[str, CpuSet]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """What the state machine needs to know about the node; fixed until a topology Resync.

    ``devices``: the published devices by name (:func:`dracpu.core.devices.published_devices`).
    ``policy``: the default allocation policy of grouped claims; ``pin_memory``: pin the
    containers of a claim to the NUMA nodes of its CPUs unless the claim says otherwise.
    ``mode`` / ``group_by``: how the devices were built (a Resync builds them again alike).
    ``numbering``: individual mode, the device number of every CPU numbered by this process
    (:func:`dracpu.core.devices.individual_numbering`), published now or not.
    ``external_allocator``: ``allocator: external``, so grouped devices carry ``dra.cpu/cpuIDs``
    and ``dra.cpu/smtLayout`` (:mod:`dracpu.core.external_attributes`).
    ``held``: devices (by name, as published before) whose CPUs went offline while a claim held
    them, and those CPUs (:mod:`dracpu.core.reconfigure`): the devices' health is still reported
    while a claim holds such a CPU (:func:`dracpu.core.health.reported_devices`).
    ``host_cgroups``: the host cgroups confined to the shared pool plus the reserved CPUs
    (:mod:`dracpu.core.host_cgroups`), paths under the cgroup root; empty: none.
    """

    node_name: str
    topology: Topology
    devices: Mapping[str, Device]
    reserved: CpuSet = EMPTY
    policy: AllocationPolicy = field(default_factory=AllocationPolicy)
    pin_memory: bool = False
    mode: CpuDeviceMode = CpuDeviceMode.GROUPED
    group_by: GroupBy = GroupBy.NUMANODE
    numbering: Mapping[int, int] = field(default_factory=_no_numbers)
    external_allocator: bool = False
    held: Mapping[str, CpuSet] = field(default_factory=_no_held)
    host_cgroups: tuple[str, ...] = ()
    allocatable: CpuSet = field(init=False)
    shareable: CpuSet = field(init=False)

    def __post_init__(self) -> None:
        allocatable = self.topology.online - self.reserved
        object.__setattr__(self, "devices", MappingProxyType(dict(self.devices)))
        object.__setattr__(self, "numbering", MappingProxyType(dict(self.numbering)))
        object.__setattr__(self, "held", MappingProxyType(dict(self.held)))
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
        numbering: Mapping[int, int] | None = None,
        external_allocator: bool = False,
        host_cgroups: tuple[str, ...] = (),
    ) -> NodeConfig:
        """The config with the devices this node publishes in ``mode``/``group_by``;
        ``numbering``: the individual device numbers given before (see
        :func:`~dracpu.core.devices.individual_numbering`), ``None`` at start."""
        mode = CpuDeviceMode(mode)
        numbers: dict[int, int] = {}
        if mode is CpuDeviceMode.INDIVIDUAL:
            numbers = individual_numbering(topology, reserved=reserved, previous=numbering)
        devices = published_devices(
            topology,
            reserved=reserved,
            mode=mode,
            group_by=group_by,
            numbering=numbers if mode is CpuDeviceMode.INDIVIDUAL else None,
            external=external_allocator,
        )
        return cls(
            node_name=node_name,
            topology=topology,
            devices={d.name: d for d in devices},
            reserved=reserved,
            policy=AllocationPolicy() if policy is None else policy,
            pin_memory=pin_memory,
            mode=mode,
            group_by=GroupBy(group_by),
            numbering=numbers,
            external_allocator=external_allocator,
            host_cgroups=host_cgroups,
        )

    def rebuild(
        self,
        topology: Topology,
        *,
        reserved: CpuSet,
        pin_memory: bool,
        host_cgroups: tuple[str, ...],
    ) -> NodeConfig:
        """The config of the same node in the same device mode after a SIGHUP: the devices of
        ``topology`` without ``reserved``, every individual device keeping its number
        (``held`` is left empty: :mod:`dracpu.core.reconfigure` knows the claims)."""
        return NodeConfig.build(
            self.node_name,
            topology,
            reserved=reserved,
            mode=self.mode,
            group_by=self.group_by,
            policy=self.policy,
            pin_memory=pin_memory,
            numbering=self.numbering,
            external_allocator=self.external_allocator,
            host_cgroups=host_cgroups,
        )
