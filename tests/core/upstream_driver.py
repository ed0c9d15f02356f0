"""An independent model of what ``kubernetes-sigs/dra-driver-cpu`` (main, 2026-08) publishes.

Shares no code with ``dracpu``: it reads a sysfs tree the way upstream's ``pkg/cpuinfo`` does and
builds the devices the way ``pkg/device/builder.go`` does, in JSON form, so that tests can check
our slices against upstream's rules on every simulator machine. Written from upstream's
behaviour, step by step:

- ``GetCPUInfos``: only CPUs of ``devices/system/cpu/online``; per CPU ``physical_package_id``
  and ``core_id`` (required), ``cluster_id`` (65535 or absent: -1), the first ``nodeN`` entry of
  ``cpuN/`` in name order (none: the CPU is skipped), the first ``indexK`` cache directory whose
  ``level`` is 3 (its ``id``, else the lowest CPU of ``shared_cpu_list``; none: -1); hybrid:
  ``devices/cpu_atom/cpus`` lists the e-cores, every other CPU is a p-core.
- ``populateCpuSiblings``: CPUs sharing (socket, cluster, core) are siblings if exactly two.
- ``IsSMTEnabled``: ``smt/control`` ``on`` true; ``off``/``forceoff``/``notsupported``/
  ``notimplemented`` false; else more CPUs than cores.
- ``cpuDeviceInfos`` / ``createCPUDeviceSlices`` / ``groupedCPUDeviceInfos`` /
  ``createGroupedCPUDeviceSlices`` / ``addPCIeRootsAttribute`` / the node-allocatable helpers.
- ``PCIeDomainsFromFS``: ``devices/pciXXXX:YY`` (exactly that shape), ``cpulistaffinity`` of its
  ``pci_bus/XXXX:YY``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYS = "sys"


def parse_list(text: str) -> list[int]:
    """A Linux cpulist ("0-3,8"), the way k8s.io/utils/cpuset.Parse reads it."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return sorted(cpus)


@dataclass
class Cpu:
    cpu: int
    socket: int
    cluster: int
    core: int
    numa: int
    l3: int
    core_type: str
    sibling: int = -1


@dataclass
class Machine:
    cpus: dict[int, Cpu]
    online: list[int]
    smt: bool
    pcie: dict[str, list[int]]


def _read(root: Path, rel: str) -> str | None:
    try:
        return (root / SYS / rel).read_text()
    except FileNotFoundError:
        return None


def read_machine(root: Path) -> Machine:
    online = parse_list(_read(root, "devices/system/cpu/online") or "")
    atom = _read(root, "devices/cpu_atom/cpus")
    e_cores = set(parse_list(atom.splitlines()[0])) if atom is not None else None
    cpus: dict[int, Cpu] = {}
    for cpu in online:
        base = f"devices/system/cpu/cpu{cpu}"
        socket = int((_read(root, f"{base}/topology/physical_package_id") or "").strip())
        cluster_text = _read(root, f"{base}/topology/cluster_id")
        cluster = int(cluster_text) if cluster_text is not None else -1
        if cluster == 65535:
            cluster = -1
        core = int((_read(root, f"{base}/topology/core_id") or "").strip())
        nodes = [e for e in sorted(os.listdir(root / SYS / base)) if e.startswith("node")]
        if not nodes:
            continue  # "skipping CPU due to incomplete topology"
        numa = int(nodes[0][4:])
        l3 = -1
        for entry in sorted(os.listdir(root / SYS / base / "cache")):
            if not entry.startswith("index"):
                continue
            if (_read(root, f"{base}/cache/{entry}/level") or "").strip() != "3":
                continue
            shared = parse_list(_read(root, f"{base}/cache/{entry}/shared_cpu_list") or "")
            ident = _read(root, f"{base}/cache/{entry}/id")
            l3 = int(ident) if ident is not None else (shared[0] if shared else cpu)
            break
        core_type = "standard"
        if e_cores is not None:
            core_type = "e-core" if cpu in e_cores else "p-core"
        cpus[cpu] = Cpu(cpu, socket, cluster, core, numa, l3, core_type)
    by_core: dict[tuple[int, int, int], list[int]] = {}
    for info in cpus.values():
        by_core.setdefault((info.socket, info.cluster, info.core), []).append(info.cpu)
    for members in by_core.values():
        if len(members) == 2:
            cpus[members[0]].sibling = members[1]
            cpus[members[1]].sibling = members[0]
    control = (_read(root, "devices/system/cpu/smt/control") or "").strip().lower()
    if control == "on":
        smt = True
    elif control in ("off", "forceoff", "notsupported", "notimplemented"):
        smt = False
    else:
        smt = len(cpus) > len(by_core)
    pcie: dict[str, list[int]] = {}
    for entry in sorted(os.listdir(root / SYS / "devices")):
        if re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", entry):
            bus = entry[3:]
            text = _read(root, f"devices/{entry}/pci_bus/{bus}/cpulistaffinity") or ""
            pcie[entry] = parse_list(text)
    return Machine(cpus, online, smt, pcie)


def _roots(machine: Machine, cpus: list[int], expose: bool) -> list[str]:
    if not expose:
        return []
    return sorted({name for name, local in machine.pcie.items() for c in cpus if c in local})


def individual_devices(
    machine: Machine, reserved: set[int], *, expose: bool = False, allocatable: bool = False
) -> list[dict[str, Any]]:
    available = sorted(c for c in machine.cpus if c not in reserved)
    groups: list[list[int]] = []
    done: set[int] = set()
    for cpu in available:
        if cpu in done:
            continue
        sibling = machine.cpus[cpu].sibling
        if sibling == -1 or sibling in reserved:
            groups.append([cpu])
            done.add(cpu)
        else:
            groups.append([cpu, sibling])
            done.update((cpu, sibling))
    groups.sort(key=lambda g: g[0])
    devices = []
    for index, cpu in enumerate(c for g in groups for c in g):
        info = machine.cpus[cpu]
        attributes: dict[str, Any] = {
            "resource.kubernetes.io/numaNode": {"int": info.numa},
            "dra.cpu/socketID": {"int": info.socket},
            "dra.cpu/smtEnabled": {"bool": machine.smt},
            "dra.cpu/cacheL3ID": {"int": info.l3},
            "dra.cpu/coreType": {"string": info.core_type},
            "dra.cpu/coreID": {"int": info.core},
            "dra.cpu/cpuID": {"int": cpu},
            "dra.net/numaNode": {"int": info.numa},
            "dra.cpu/numaNodeID": {"int": info.numa},
        }
        roots = _roots(machine, [cpu], expose)
        if roots:
            attributes["resource.kubernetes.io/pcieRoot"] = {"strings": roots}
        device: dict[str, Any] = {"name": f"cpudev{index:03d}", "attributes": attributes}
        if allocatable:
            device["nodeAllocatableResources"] = {"cpu": {"mapping": {"deviceMultiplier": "1"}}}
        devices.append(device)
    return devices


def grouped_devices(
    machine: Machine,
    reserved: set[int],
    group_by: str,
    *,
    expose: bool = False,
    allocatable: bool = False,
) -> list[dict[str, Any]]:
    groups: list[tuple[str, list[int], dict[str, Any]]] = []
    if group_by == "socket":
        for socket in sorted({c.socket for c in machine.cpus.values()}):
            cpus = [c.cpu for c in machine.cpus.values() if c.socket == socket]
            cpus = sorted(c for c in cpus if c not in reserved)
            if cpus:
                groups.append(
                    (
                        f"cpudevsocket{socket:03d}",
                        cpus,
                        {"dra.cpu/socketID": {"int": socket}},
                    )
                )
    elif group_by == "numanode":
        for numa in sorted({c.numa for c in machine.cpus.values()}):
            cpus = [c.cpu for c in machine.cpus.values() if c.numa == numa]
            cpus = sorted(c for c in cpus if c not in reserved)
            if cpus:
                extra = {
                    "resource.kubernetes.io/numaNode": {"int": numa},
                    "dra.cpu/socketID": {"int": machine.cpus[cpus[0]].socket},
                    "dra.net/numaNode": {"int": numa},
                    "dra.cpu/numaNodeID": {"int": numa},
                }
                groups.append((f"cpudevnuma{numa:03d}", cpus, extra))
    else:
        cpus = [c for c in machine.online if c not in reserved]
        groups.append(("cpudevmachine", cpus, {}))
    devices = []
    for name, cpus, extra in groups:
        attributes = {
            **extra,
            "dra.cpu/numCPUs": {"int": len(cpus)},
            "dra.cpu/smtEnabled": {"bool": machine.smt},
        }
        roots = _roots(machine, cpus, expose)
        if roots:
            attributes["resource.kubernetes.io/pcieRoot"] = {"strings": roots}
        device: dict[str, Any] = {
            "name": name,
            "attributes": attributes,
            "capacity": {"dra.cpu/cpu": {"value": str(len(cpus))}},
            "allowMultipleAllocations": True,
        }
        if allocatable:
            device["nodeAllocatableResources"] = {
                "cpu": {"mapping": {"capacityKey": "dra.cpu/cpu", "capacityMultiplier": "1"}}
            }
        devices.append(device)
    return devices


def devices_per_slice(expose: bool) -> int:
    """Config.DevicesPerResourceSlice: the advanced-features limit whenever roots are exposed."""
    return 64 if expose else 128
