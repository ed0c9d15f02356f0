"""A writer of fake sysfs trees: the files the kernel would show for a
:class:`~dracpu.sim.machine_model.MachineSpec` under ``<root>/sys``.

Tests read the written tree with :func:`dracpu.adapters.sysfs.read_topology` and compare it with
:func:`dracpu.sim.machine_model.build_topology`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from fnmatch import translate
from pathlib import Path

from dracpu.core.cpuset import CpuSet
from dracpu.core.topology import CoreType
from dracpu.errors import ConfigError
from dracpu.sim.machine_model import (
    NO_CLUSTER_RAW,
    MachineSpec,
    machine_layout,
    numa_cpus,
    pci_affinity,
    smt_control_text,
)

__all__ = ["sysfs_tree", "write_sysfs"]


_CPU = "sys/devices/system/cpu"
_NODE = "sys/devices/system/node"


def write_sysfs(
    spec: MachineSpec,
    root: Path,
    *,
    omit: Iterable[str] = (),
    override: Mapping[str, str] | None = None,
) -> None:
    """Write the machine's sysfs files under ``root/sys`` (``root`` is the host root).

    ``omit``: glob patterns (``fnmatch``, ``*`` crosses ``/``) of paths relative to ``root``
    (``"sys/devices/system/cpu/cpu3/topology/core_id"``) not to write; a pattern matching a
    directory omits everything under it. ``override``: path -> text written instead of (or in
    addition to) the generated file. Together they make broken machines for error tests.
    ``root/sys`` must not exist yet.
    """
    if os.path.lexists(os.path.join(root, "sys")):
        raise ConfigError(f"{os.path.join(root, 'sys')} already exists: write into an empty root")
    files, links = _sysfs_files(spec)
    patterns = [re.compile(translate(p)) for p in omit]
    if patterns:
        files = {p: t for p, t in files.items() if not _omitted(p, patterns)}
        links = {p: t for p, t in links.items() if not _omitted(p, patterns)}
    if override:
        files.update(override)
    prefix = os.fspath(root).rstrip("/") + "/"
    made: set[str] = set()
    for rel, text in files.items():
        _write(prefix, rel, text, made)
    for rel, target in links.items():
        parent = rel.rpartition("/")[0]
        if parent not in made:
            os.makedirs(prefix + parent, exist_ok=True)
            made.add(parent)
        os.symlink(target, prefix + rel)


def sysfs_tree(spec: MachineSpec) -> tuple[dict[str, str], dict[str, str]]:
    """What :func:`write_sysfs` writes: (path -> text, symlink path -> target), the paths
    relative to the host root (:mod:`dracpu.sim.hotplug` rewrites a tree with it)."""
    return _sysfs_files(spec)


def _omitted(rel: str, patterns: list[re.Pattern[str]]) -> bool:
    path = rel
    while path:
        if any(p.match(path) for p in patterns):
            return True
        path = os.path.dirname(path)
    return False


def _write(root: str, rel: str, text: str, made: set[str]) -> None:
    parent = rel.rpartition("/")[0]
    if parent not in made:
        os.makedirs(root + parent, exist_ok=True)
        made.add(parent)
    fd = os.open(root + rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)


def _sysfs_files(spec: MachineSpec) -> tuple[dict[str, str], dict[str, str]]:
    """(path -> text, symlink path -> target), paths relative to the host root."""
    layout = machine_layout(spec)
    online = layout.online
    total = spec.cpu_count
    present = CpuSet.range(0, total)
    files: dict[str, str] = {}
    links: dict[str, str] = {}

    def put(rel: str, value: object) -> None:
        files[rel] = f"{value}\n"

    put(f"{_CPU}/online", online)
    put(f"{_CPU}/present", present)
    put(f"{_CPU}/possible", present)
    put(f"{_CPU}/offline", spec.offline)
    put(f"{_CPU}/isolated", spec.isolated)
    put(f"{_CPU}/kernel_max", 8191)
    smt = smt_control_text(spec)
    if smt is not None:
        put(f"{_CPU}/smt/control", smt)
        put(
            f"{_CPU}/smt/active",
            int(any(len(layout.online_of(c.threads)) > 1 for c in layout.cores)),
        )

    if spec.hybrid is not None:
        by_type: dict[CoreType, int] = {}
        for core in layout.cores:
            for cpu in core.threads:
                by_type[core.core_type] = by_type.get(core.core_type, 0) | 1 << cpu
        put("sys/devices/cpu_core/cpus", CpuSet.from_mask(by_type.get(CoreType.P_CORE, 0)))
        put("sys/devices/cpu_atom/cpus", CpuSet.from_mask(by_type.get(CoreType.E_CORE, 0)))

    sockets = layout.group("socket")
    nodes = layout.group("numa")
    l3s = layout.group("l3")
    l3_written_id = {core.l3: core.l3 for core in layout.cores}
    clusters: dict[tuple[int, int], int] = {}
    dies: dict[tuple[int, int], int] = {}
    for core in layout.cores:
        for cpu in core.threads:
            key = (core.socket, core.cluster)
            clusters[key] = clusters.get(key, 0) | 1 << cpu
            die_key = (core.socket, core.die)
            dies[die_key] = dies.get(die_key, 0) | 1 << cpu

    if spec.numa_sysfs:
        # A node whose every CPU is in no_numa_node is not online: possible, but no directory.
        listed = {n: cpus for n, cpus in numa_cpus(spec, layout).items() if cpus or not nodes[n]}
        node_ids = CpuSet(listed)
        put(f"{_NODE}/possible", CpuSet(nodes))
        put(f"{_NODE}/online", node_ids)
        put(f"{_NODE}/has_cpu", CpuSet(n for n, cpus in listed.items() if cpus))
        put(f"{_NODE}/has_memory", node_ids)
        for node, cpus in listed.items():
            put(f"{_NODE}/node{node}/cpulist", cpus)
            put(f"{_NODE}/node{node}/cpumap", _hex_mask(cpus, total))

    for name, local in pci_affinity(spec, layout).items():
        bus = name.removeprefix("pci")
        put(f"sys/devices/{name}/pci_bus/{bus}/cpulistaffinity", local)
        put(f"sys/devices/{name}/pci_bus/{bus}/cpuaffinity", _hex_mask(local, total))

    for cpu in range(total):
        core = layout.core_of[cpu]
        base = f"{_CPU}/cpu{cpu}"
        if cpu:
            put(f"{base}/online", int(cpu in online))
        if spec.numa_sysfs and cpu not in spec.no_numa_node:
            links[f"{base}/node{core.numa}"] = f"../../node/node{core.numa}"
        if cpu not in online:
            continue  # the kernel removes topology/ and cache/ of an offline CPU
        siblings = layout.online_of(core.threads)
        cluster_cpus = (
            CpuSet.from_mask(clusters[(core.socket, core.cluster)]) & online
            if core.cluster != NO_CLUSTER_RAW
            else siblings
        )
        package = sockets[core.socket]
        topo = f"{base}/topology"
        put(f"{topo}/physical_package_id", core.socket)
        if spec.die_id_file:
            put(f"{topo}/die_id", core.die)
            put(f"{topo}/die_cpus_list", CpuSet.from_mask(dies[(core.socket, core.die)]) & online)
        put(f"{topo}/cluster_id", core.cluster)
        put(f"{topo}/cluster_cpus_list", cluster_cpus)
        put(f"{topo}/core_id", core.core_id)
        put(f"{topo}/thread_siblings_list", siblings)
        put(f"{topo}/core_cpus_list", siblings)
        put(f"{topo}/core_siblings_list", package)
        put(f"{topo}/package_cpus_list", package)

        cache = f"{base}/cache"
        l2_cpus = cluster_cpus if core.core_type is CoreType.E_CORE else siblings
        # L1d, L1i, L2 (only what tells them from the L3), then the L3 unless there is none.
        put(f"{cache}/index0/level", 1)
        put(f"{cache}/index0/type", "Data")
        put(f"{cache}/index1/level", 1)
        put(f"{cache}/index1/type", "Instruction")
        put(f"{cache}/index2/level", 2)
        put(f"{cache}/index2/type", "Unified")
        put(f"{cache}/index2/shared_cpu_list", l2_cpus)
        if spec.l3 != "none":
            put(f"{cache}/index3/level", 3)
            put(f"{cache}/index3/type", "Unified")
            put(f"{cache}/index3/shared_cpu_list", l3s[core.l3])
            if spec.l3 == "id":
                put(f"{cache}/index3/id", l3_written_id[core.l3])
    return files, links


def _hex_mask(cpus: CpuSet, total: int) -> str:
    """The kernel's cpumask format: 32-bit hex words, most significant first, comma separated."""
    words = max(1, (total + 31) // 32)
    mask = cpus.mask
    return ",".join(f"{(mask >> (32 * w)) & 0xFFFFFFFF:08x}" for w in reversed(range(words)))
