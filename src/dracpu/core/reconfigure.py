"""A SIGHUP's new node config: the topology and the config file read again (a part of
:func:`dracpu.core.state.apply`'s ``Resync``).

Pure: the state, the topology read again and the settings read again go in; the new
:class:`~dracpu.core.node_config.NodeConfig` and what changed (:class:`NodeChanged`) come out.

- **Devices** are built again in the same mode and grouping (a change of those needs a
  restart: the daemon refuses it before it gets here). An individual device keeps its name for
  the life of the process (:func:`dracpu.core.devices.individual_numbering`): the scheduler's
  allocations name devices, and a name that moved to another CPU would hand a new claim a CPU
  another claim holds. A grouped device keeps its name and shrinks or grows.
- **A claim is never shrunk.** A CPU that went offline while a claim held it stays in the
  claim (the CDI spec and the containers' cpuset say what the pod was given); it counts as
  claimed, is in no device and not in the shared pool, and the devices that held it are
  remembered in ``NodeConfig.held`` so that their health is reported (unhealthy) as long as a
  claim holds the CPU (:func:`dracpu.core.health.reported_devices`). Back online, the CPU is
  allocatable again and still the claim's.
- **Reserved CPUs** change only when no claim holds one of the new ones and the shared
  containers keep a CPU; otherwise the old ones stay and :attr:`NodeChanged.reserved_refused`
  says why (the CPUs and the claims). The rest of the Resync goes on.
- **The shared pool** is recomputed from the new config; a topology that leaves no CPU for the
  shared containers (or none shared or reserved for the confined host cgroups) is refused as a
  whole (:class:`~dracpu.errors.InsufficientCpusError`):
  NRI takes an empty cpuset for "no change" (kubernetes-sigs/dra-driver-cpu#295), so the old
  config, whose devices turn unhealthy, is the safer one to keep.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from itertools import chain

from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.core.commands import Resync
from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.devices import Device
from dracpu.core.effects import NodeChanged, StrandedClaim
from dracpu.core.node_config import NodeConfig
from dracpu.core.state_values import NodeState
from dracpu.core.topology import Topology
from dracpu.errors import InsufficientCpusError

__all__ = ["held_at_restore", "reconfigure", "stranded_claims"]


def reconfigure(state: NodeState, command: Resync) -> tuple[NodeConfig, NodeChanged]:
    """The node config after ``command`` and what changed (see the module docstring).

    Raises :class:`~dracpu.errors.InsufficientCpusError` when the new topology leaves no CPU
    for the shared containers, :class:`~dracpu.errors.TopologyError` when its devices cannot be
    built (too many PCIe roots on a device)."""
    old = state.config
    topology = old.topology if command.topology is None else command.topology
    pin_memory = old.pin_memory if command.pin_memory is None else command.pin_memory
    cgroups = old.host_cgroups if command.host_cgroups is None else command.host_cgroups
    reserved = old.reserved
    refused = ""
    if command.reserved is not None and command.reserved != old.reserved:
        refused = _reserved_problem(state, topology, command.reserved)
        if not refused:
            reserved = command.reserved
    config = old.rebuild(topology, reserved=reserved, pin_memory=pin_memory, host_cgroups=cgroups)
    pool = config.shareable - state.claimed
    if state.shared and not pool:
        offline = old.topology.online - topology.online
        raise InsufficientCpusError(
            f"cannot take the node's new topology (cpus {offline or 'none'} went offline): it "
            f"leaves no CPU for the {len(state.shared)} shared containers; the old one stays"
        )
    if config.host_cgroups and not (pool or config.reserved & topology.online):
        raise InsufficientCpusError(
            "cannot take the node's new settings and topology: they leave no CPU shared or "
            f"reserved for the confined host cgroups ({', '.join(config.host_cgroups)}); the "
            "old ones stay"
        )
    stranded = state.claimed - config.allocatable  # offline: reserved ones were refused above
    held = _held(old, stranded)
    if held:
        config = replace(config, held=held)
    return config, _changes(state, old, config, reserved, refused, stranded)


def _reserved_problem(state: NodeState, topology: Topology, reserved: CpuSet) -> str:
    """Why ``reserved`` cannot replace the reserved CPUs now ("" when it can)."""
    taken = reserved & state.claimed
    if taken:
        holders = sorted(uid for uid, claim in state.claims.items() if claim.cpus & taken)
        return (
            f"the config asks {reserved or 'none'}, but cpus {taken} are held by claim "
            f"{', '.join(holders)}; unprepare it and send SIGHUP again"
        )
    shareable = topology.online - reserved - topology.isolated
    if state.shared and not (shareable - state.claimed):
        return (
            f"the config asks {reserved or 'none'}, which leaves no CPU for the "
            f"{len(state.shared)} shared containers"
        )
    if state.config.host_cgroups and not (shareable - state.claimed or reserved & topology.online):
        return (
            f"the config asks {reserved or 'none'}, which leaves no CPU for the confined host "
            "cgroups"
        )
    return ""


def _held(old: NodeConfig, stranded: CpuSet) -> dict[str, CpuSet]:
    """The devices (as published before, or held before) that held the ``stranded`` CPUs."""
    held: dict[str, CpuSet] = {}
    if not stranded:
        return held
    before: Iterable[tuple[str, CpuSet]] = chain(
        ((name, device.cpus) for name, device in old.devices.items()), old.held.items()
    )
    for name, cpus in before:
        lost = cpus & stranded
        if lost:
            held[name] = held.get(name, EMPTY) | lost
    return held


def stranded_claims(claims: Mapping[str, PreparedClaim], offline: CpuSet) -> list[StrandedClaim]:
    """The claims holding some of the ``offline`` CPUs, by UID."""
    if not offline:
        return []
    found: list[StrandedClaim] = []
    for uid in sorted(claims):
        claim = claims[uid]
        lost = claim.cpus & offline
        if lost:
            name = f"{claim.namespace}/{claim.name}" if claim.name else ""
            found.append(StrandedClaim(uid, name, lost))
    return found


def held_at_restore(config: NodeConfig, claims: Iterable[PreparedClaim]) -> dict[str, CpuSet]:
    """``NodeConfig.held`` after a restart, when the devices published before are unknown: the
    offline CPUs of each claim, on every device its results name (exact for a claim of one
    device; a claim of several individual devices reports each of them)."""
    held: dict[str, CpuSet] = {}
    for claim in claims:
        lost = claim.cpus - config.allocatable
        if not lost:
            continue
        for result in claim.results:
            held[result.device] = held.get(result.device, EMPTY) | lost
    return held


def _changes(
    state: NodeState,
    old: NodeConfig,
    new: NodeConfig,
    reserved: CpuSet,
    refused: str,
    stranded: CpuSet,
) -> NodeChanged:
    before, after = old.topology, new.topology
    both = before.online & after.online
    added, removed, resized, updated = _device_changes(old.devices, new.devices)
    return NodeChanged(
        went_online=after.online - before.online,
        went_offline=before.online - after.online,
        isolated=(after.isolated - before.isolated) & both,
        unisolated=(before.isolated - after.isolated) & both,
        reserved=None if reserved == old.reserved else (old.reserved, reserved),
        reserved_refused=refused,
        pin_memory=None if new.pin_memory == old.pin_memory else new.pin_memory,
        host_cgroups=None if new.host_cgroups == old.host_cgroups else new.host_cgroups,
        added=added,
        removed=removed,
        resized=resized,
        updated=updated,
        republished=tuple(old.devices.values()) != tuple(new.devices.values()),
        stranded=tuple(stranded_claims(state.claims, stranded)),
    )


def _device_changes(
    old: Mapping[str, Device], new: Mapping[str, Device]
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(added, removed, resized, updated) device names, each in publication order."""
    added = tuple(name for name in new if name not in old)
    removed = tuple(name for name in old if name not in new)
    resized: list[str] = []
    updated: list[str] = []
    for name, device in new.items():
        was = old.get(name)
        if was is None or was == device:
            continue
        if was.capacity != device.capacity:
            resized.append(name)
        else:
            updated.append(name)
    return added, removed, tuple(resized), tuple(updated)
