"""Fake machines: compact descriptions, a writer of fake sysfs trees, and the model they describe.

:data:`FIXTURES` names the machines used by tests, benchmarks and ``dracpu sim --topology NAME``.
A :class:`MachineSpec` describes a machine (:mod:`dracpu.sim.machine_model`, with
:func:`build_topology`, the :class:`~dracpu.core.topology.Topology` the machine must read as);
:func:`write_sysfs` writes the files the kernel would show under ``<root>/sys``
(:mod:`dracpu.sim.sysfs_writer`). Tests read the written tree with
:func:`dracpu.adapters.sysfs.read_topology` and compare it with :func:`build_topology`. This module
re-exports those names, so ``from dracpu.sim.topologies import ...`` works for all of them.
"""

from __future__ import annotations

from dracpu.core.cpuset import CpuSet
from dracpu.errors import ConfigError
from dracpu.sim.machine_model import (
    E_CORES_PER_CLUSTER,
    SMT_AUTO,
    CoreIdScheme,
    CpuNumbering,
    L3Mode,
    MachineSpec,
    PciRoot,
    build_topology,
)
from dracpu.sim.sysfs_writer import sysfs_tree, write_sysfs

__all__ = [
    "E_CORES_PER_CLUSTER",
    "FIXTURES",
    "CoreIdScheme",
    "CpuNumbering",
    "L3Mode",
    "SMT_AUTO",
    "MachineSpec",
    "PciRoot",
    "build_topology",
    "fixture",
    "sysfs_tree",
    "write_sysfs",
]

# --- named machines ------------------------------------------------------------------------------

FIXTURES: dict[str, MachineSpec] = {
    "dual-socket-smt2": MachineSpec(
        sockets=2,
        numa_per_die=2,
        l3_per_numa=2,
        cores_per_cluster=4,
        threads_per_core=2,
        pci_roots=(
            PciRoot("pci0000:00", 0),
            PciRoot("pci0000:3a", 0),
            PciRoot("pci0000:5d", 1),
            PciRoot("pci0000:80", 2),
            PciRoot("pci0000:ae", 3),
            PciRoot("pci0000:d7", 3),
            PciRoot("pci0001:00", None),
        ),
        description=(
            "x86 server: 2 sockets x 2 NUMA x 2 L3 x 4 cores x SMT2 = 64 CPUs; core_id repeats "
            "per socket; siblings are cpuN and cpuN+32; PCIe roots on every NUMA node (two on "
            "nodes 0 and 3) and one without NUMA affinity"
        ),
    ),
    "hybrid-desktop": MachineSpec(
        hybrid=(8, 8),
        threads_per_core=2,
        cpu_numbering="adjacent",
        core_id_step=4,
        description=(
            "Intel hybrid desktop: 8 P-cores x SMT2 (cpu0-15) + 8 E-cores in 2 clusters "
            "(cpu16-23), one L3, cpu_core/cpu_atom PMU files"
        ),
    ),
    "arm64-server": MachineSpec(
        numa_per_die=2,
        clusters_per_l3=4,
        cores_per_cluster=4,
        l3="shared-cpu-list",
        die_id_file=False,
        smt_control="notsupported",
        pci_roots=(PciRoot("pci0000:00", 0), PciRoot("pci0001:00", 1)),
        description=(
            "arm64 server: 1 socket x 2 NUMA x 1 L3 x 4 clusters x 4 cores = 32 CPUs, no SMT, "
            "no cache id files (L3 named by its lowest CPU), no die_id; a PCIe root per node"
        ),
    ),
    "smt4": MachineSpec(
        sockets=2,
        l3_per_numa=2,
        cores_per_cluster=4,
        threads_per_core=4,
        cpu_numbering="adjacent",
        description=(
            "POWER-like: 2 sockets x 1 NUMA x 2 L3 x 4 cores x SMT4 = 64 CPUs, threads of a "
            "core numbered adjacently"
        ),
    ),
    "vm-2cpu": MachineSpec(
        cores_per_cluster=2,
        smt_control="notsupported",
        pci_roots=(PciRoot("pci0000:00", None),),
        description=(
            "a 2-vCPU virtual machine: 1 socket, 1 NUMA node, 1 L3, no SMT; one PCIe root "
            "without NUMA affinity"
        ),
    ),
    "knl-smt4": MachineSpec(
        cores_per_cluster=16,
        threads_per_core=4,
        l3="none",
        description=(
            "Xeon Phi-like: 1 socket x 1 NUMA x 16 cores x SMT4 = 64 CPUs, siblings +16 apart "
            "(cpu0,16,32,48 are core 0), no L3 cache"
        ),
    ),
    "no-numa-node": MachineSpec(
        numa_per_die=2,
        cores_per_cluster=4,
        threads_per_core=2,
        no_numa_node=CpuSet.parse("4-7,12-15"),
        description=(
            "16-CPU SMT2 box (2 NUMA x 4 cores x SMT2, siblings +8) whose node 1 is not online: "
            "cpu4-7,12-15 link to no NUMA node"
        ),
    ),
    "offline-isolated": MachineSpec(
        numa_per_die=2,
        cores_per_cluster=4,
        threads_per_core=2,
        offline=CpuSet.parse("5,14-15"),
        isolated=CpuSet.parse("2,7,10,14"),
        description=(
            "16-CPU SMT2 box (2 NUMA x 4 cores x SMT2, siblings +8) with cpu5,14,15 offline "
            "and isolcpus=2,7,10,14 (14 is offline, so it does not count)"
        ),
    ),
    "big-1024": MachineSpec(
        sockets=2,
        numa_per_die=4,
        l3_per_numa=4,
        cores_per_cluster=16,
        threads_per_core=2,
        pci_roots=tuple(
            PciRoot(f"pci{n // 2:04x}:{0x80 * (n % 2):02x}", n // 2) for n in range(16)
        ),
        description=(
            "benchmark machine: 2 sockets x 4 NUMA x 4 L3 x 16 cores x SMT2 = 1024 CPUs, "
            "siblings +512; two PCIe roots per NUMA node"
        ),
    ),
}
"""The named machines (``dracpu sim --topology NAME``)."""


def fixture(name: str) -> MachineSpec:
    """The named machine; :class:`ConfigError` listing the names when unknown."""
    try:
        return FIXTURES[name]
    except KeyError:
        raise ConfigError(
            f"unknown topology {name!r}: choose one of {', '.join(sorted(FIXTURES))}"
        ) from None
