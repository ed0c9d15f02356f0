"""Helpers of the node state machine tests (``test_state.py``, ``test_state_properties.py``).

A 16-CPU topology and its configs, and a reference effect executor over a fake disk: the state
owner's loop for one command exactly as :mod:`dracpu.core.state` documents it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dracpu.core.checkpoint_schema import CheckpointData, decode, encode
from dracpu.core.commands import Command, InvalidateContainers
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, Device, GroupBy
from dracpu.core.effects import (
    ConfineHostCgroups,
    ContainerUpdate,
    DeleteCdiSpec,
    DeleteDeviceMetadata,
    Effect,
    PruneCdiSpecs,
    PruneDeviceMetadata,
    PublishSlices,
    Reply,
    UpdateContainers,
    WriteCdiSpec,
    WriteCheckpoint,
    WriteDeviceMetadata,
)
from dracpu.core.node_config import NodeConfig
from dracpu.core.state import NodeState, PreparedClaim, apply, commit_phase, rollback
from dracpu.core.topology import CpuInfo, Topology
from dracpu.errors import CdiError, DracpuError

__all__ = [
    "NODE",
    "FakeDisk",
    "config_for",
    "cpus",
    "device_of",
    "disk_matches",
    "run",
    "topology16",
    "uid",
    "without",
]

NODE = "node-1"


def uid(n: int) -> str:
    return f"5d0c0a7e-0000-4000-8000-{n:012d}"


def cpus(text: str) -> CpuSet:
    return CpuSet.parse(text)


def topology16(isolated: str = "", offline: str = "") -> Topology:
    """1 socket, 2 NUMA nodes (one L3 each) x 4 cores x SMT2: core c = cpus c and c+8;
    NUMA 0 = cpus 0-3,8-11, NUMA 1 = cpus 4-7,12-15; the ``offline`` ones present but not
    online."""
    return without(_full16(isolated), cpus(offline))


def without(topology: Topology, offline: CpuSet) -> Topology:
    """``topology`` with the ``offline`` CPUs taken offline (as sysfs read again shows it)."""
    return Topology(
        {cpu: info for cpu, info in topology.cpus.items() if cpu not in offline},
        smt_enabled=topology.smt_enabled,
        offline=topology.offline | (offline & topology.online),
        isolated=topology.isolated - offline,
        pcie_roots=topology.pcie_roots,
        numa_in_sysfs=topology.numa_in_sysfs,
    )


def _full16(isolated: str) -> Topology:
    infos = {
        cpu: CpuInfo(
            cpu_id=cpu,
            socket_id=0,
            die_id=0,
            cluster_id=-1,
            core_id=cpu % 8,
            numa_node=(cpu % 8) // 4,
            l3_id=(cpu % 8) // 4,
        )
        for cpu in range(16)
    }
    return Topology(infos, smt_enabled=True, isolated=CpuSet.parse(isolated))


def config_for(
    mode: CpuDeviceMode = CpuDeviceMode.GROUPED,
    *,
    group_by: GroupBy = GroupBy.NUMANODE,
    reserved: str = "0,8",
    isolated: str = "",
    pin_memory: bool = False,
) -> NodeConfig:
    return NodeConfig.build(
        NODE,
        topology16(isolated),
        reserved=cpus(reserved),
        mode=mode,
        group_by=group_by,
        pin_memory=pin_memory,
    )


def device_of(config: NodeConfig, cpu: int) -> str:
    """The individual device that stands for ``cpu``."""
    (name,) = [d.name for d in config.devices.values() if d.cpus == CpuSet([cpu])]
    return name


# --- a reference effect executor over a fake disk ---------------------------------------------


@dataclass
class FakeDisk:
    """CDI specs, device metadata (the claim record each was written from) and the checkpoint
    as the state owner's adapters would leave them.

    ``fail_at``: the number of the effect execution (0-based, counting every effect run,
    compensations included) that raises instead of happening."""

    cdi: dict[str, CpuSet] = field(default_factory=dict)
    metadata: dict[str, PreparedClaim] = field(default_factory=dict)
    checkpoint: bytes = field(default_factory=lambda: encode(CheckpointData(), 1))
    slices: tuple[Device, ...] | None = None
    fail_at: int | None = None
    executed: int = 0
    sent_updates: list[ContainerUpdate] = field(default_factory=list)
    # The host cgroups and the CPUs the last ConfineHostCgroups confined them to.
    cgroups: tuple[tuple[str, ...], CpuSet] | None = None

    def execute(self, effect: Effect) -> None:
        number = self.executed
        self.executed += 1
        if number == self.fail_at:
            if isinstance(effect, WriteCdiSpec):  # half done: a write may land before the error
                self.cdi[effect.claim_uid] = effect.cpus
            if isinstance(effect, WriteDeviceMetadata):
                self.metadata[effect.claim.claim_uid] = effect.claim
            if isinstance(effect, DeleteDeviceMetadata):  # the specs went, the files did not
                self.metadata.pop(effect.claim_uid, None)
            raise CdiError(f"injected failure of {type(effect).__name__}")
        match effect:
            case WriteCdiSpec(claim_uid=claim_uid, cpus=claim_cpus):
                self.cdi[claim_uid] = claim_cpus
            case DeleteCdiSpec(claim_uid=claim_uid):
                self.cdi.pop(claim_uid, None)
            case PruneCdiSpecs(keep=keep):
                for key in [k for k in self.cdi if k not in keep]:
                    del self.cdi[key]
            case WriteDeviceMetadata(claim=claim):
                self.metadata[claim.claim_uid] = claim
            case DeleteDeviceMetadata(claim_uid=claim_uid):
                self.metadata.pop(claim_uid, None)
            case PruneDeviceMetadata(keep=keep):
                for key in [k for k in self.metadata if k not in keep]:
                    del self.metadata[key]
            case WriteCheckpoint(checkpoint=data):
                self.checkpoint = encode(data, decode(self.checkpoint).sequence + 1)
            case PublishSlices(devices=devices):
                self.slices = devices
            case UpdateContainers(updates=updates):
                self.sent_updates.extend(updates)
            case ConfineHostCgroups(cgroups=cgroups, cpus=host_cpus):
                self.cgroups = (cgroups, host_cpus)
            case Reply():
                pass

    def claims(self) -> dict[str, PreparedClaim]:
        return dict(decode(self.checkpoint).data.claims)


def run(state: NodeState, command: Command, disk: FakeDisk) -> tuple[NodeState, object]:
    """The state owner's loop for one command, exactly as documented in ``dracpu.core.state``."""
    new, effects = apply(state, command)
    commit, reply, after = commit_phase(effects)
    for index, effect in enumerate(commit):
        try:
            disk.execute(effect)
        except DracpuError as error:
            undo = rollback(state, commit[: index + 1], error)
            for compensation in undo[:-1]:
                disk.execute(compensation)
            final = undo[-1]
            assert isinstance(final, Reply)
            return state, final.value
    for effect in after:
        try:
            disk.execute(effect)
        except DracpuError:
            if isinstance(effect, UpdateContainers):  # the runtime failed them: the NRI task
                failed = tuple((u.container_id, u.seq) for u in effect.updates)  # tells us so
                new, _ = apply(new, InvalidateContainers(failed))
    return new, reply.value


def _unpodded(claim: PreparedClaim) -> PreparedClaim:
    return replace(claim, pod_uids=frozenset())


def disk_matches(state: NodeState, disk: FakeDisk) -> None:
    """The files are those of ``state``: the checkpoint, a CDI spec per claim, the device
    metadata of each claim with results; a claim without results (adopted) may keep metadata
    a failed Prepare wrote for it, of no other claim."""
    assert disk.claims() == dict(state.claims)
    assert disk.cdi == {u: c.cpus for u, c in state.claims.items()}
    # The metadata is written from the claim record; the pods it is reserved for are not in it
    # (a fresh look that changes them rewrites no metadata).
    with_results = {u: _unpodded(c) for u, c in state.claims.items() if c.results}
    written = {u: _unpodded(c) for u, c in disk.metadata.items() if u in with_results}
    assert written == with_results
    assert disk.metadata.keys() <= state.claims.keys()
    # The host cgroups follow the pool of every command that changed it (a Resync confines them
    # even when none is listed, to give back what an earlier confinement found).
    if state.config.host_cgroups and disk.cgroups is not None:
        assert disk.cgroups == (state.config.host_cgroups, state.host_pool)
