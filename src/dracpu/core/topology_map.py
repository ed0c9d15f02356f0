"""A text map of the node's CPUs for ``dracpu inspect``. Pure text rendering.

The map nests sockets → NUMA nodes → L3 caches → cores; each core is one cell listing its
threads (``0,32`` is the core of cpu0 and its SMT sibling cpu32), cells laid out in columns so a
1024-CPU node stays about a hundred lines. A mark after a CPU id says what it is:

- ``R`` reserved (never published, never shared);
- ``I`` isolated (the kernel's ``isolcpus``: never in the shared pool);
- a lowercase key (``a``, ``b``, ... ``aa``) held exclusively by a claim, listed under the map
  with its claim UID prefix; only when the caller passes ``claimed``, which then also makes the
  map list the shared pool.

CPUs the kernel links to no NUMA node are shown as their own group (no device publishes them).
With ``--expose-pcie-roots`` each NUMA node lists the PCIe roots local to it. Offline CPUs have
no topology; they are listed once after the map. The last part summarises the devices (grouped:
one line per device, with ``dra.cpu/cpuIDs`` and the node's ``dra.cpu/smtLayout`` where the
devices carry them: ``allocator: external``; individual: the numbering), what on this node
differs from the Go driver's slices (``docs/devices.md``), and the ResourceSlices.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import ATTR_ISOLATED, CAPACITY_CPU, Device
from dracpu.core.external_attributes import ATTR_CPU_IDS, ATTR_SMT_LAYOUT
from dracpu.core.slices import SliceOptions
from dracpu.core.topology import NO_NUMA_NODE, CoreType, Topology

__all__ = ["claim_keys", "render_map"]

# The map is meant for a terminal: cells wrap so no line of the grid exceeds this width.
LINE_WIDTH = 100
# Spaces between core cells.
CELL_GAP = 2
# How many leading characters of a claim UID identify it in the legend (kubectl shows 8 too,
# for pod-template hashes; UIDs are random so 8 hex digits collide once in ~4 billion pairs).
CLAIM_UID_PREFIX = 8
# Individual mode: how many "cpudevNNN=cpuN" pairs the summary shows before eliding.
NUMBERING_SHOWN = 8

MARK_RESERVED = "R"
MARK_ISOLATED = "I"
_KEY_ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def claim_keys(claimed: Mapping[str, CpuSet]) -> dict[str, str]:
    """Claim UID → its short key in the map (``a``..``z``, ``aa``..), claims ordered by lowest
    CPU, then UID; claims without CPUs get no key."""
    order = sorted(
        (uid for uid, cpus in claimed.items() if cpus), key=lambda u: (claimed[u].min(), u)
    )
    return {uid: _key(i) for i, uid in enumerate(order)}


def _key(index: int) -> str:
    """0 → a, 25 → z, 26 → aa, ... (bijective base 26, like spreadsheet columns)."""
    letters = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, len(_KEY_ALPHABET))
        letters = _KEY_ALPHABET[rest] + letters
    return letters


def render_map(
    topology: Topology,
    *,
    reserved: CpuSet,
    devices: Sequence[Device],
    slices: Sequence[Mapping[str, Any]],
    claimed: Mapping[str, CpuSet] | None = None,
    options: SliceOptions | None = None,
) -> str:
    """Sockets → NUMA nodes → L3 caches → cores → threads, then the devices, the differences
    from the Go driver and the slices. ``options``: the publication switches the slices were
    built with (``None``: upstream's defaults)."""
    options = options or SliceOptions()
    reserved_online = reserved & topology.online
    keys = claim_keys(claimed) if claimed is not None else {}
    key_of: dict[int, str] = {}
    for uid, key in keys.items():
        for cpu in claimed[uid] if claimed is not None else ():
            key_of[cpu] = key
    group_device = _group_devices(topology, devices)

    def mark(cpu: int) -> str:
        return (
            str(cpu)
            + (MARK_RESERVED if cpu in reserved_online else "")
            + (MARK_ISOLATED if cpu in topology.isolated else "")
            + key_of.get(cpu, "")
        )

    lines = list(_header(topology, reserved_online, claimed is not None))
    lines.append("")
    machine_device = group_device.get(("machine", 0))
    numa_ids = [n for n in topology.numa_nodes if n != NO_NUMA_NODE]
    lines.append(
        f"machine: {_count(len(topology.sockets), 'socket')}, "
        f"{_count(len(numa_ids), 'numa node')}, "
        f"{_count(len(topology.l3_caches), 'l3 cache')}, {_count(len(topology.cores), 'core')}"
        + _device_note(machine_device)
    )
    everywhere = [n for n, cpus in topology.pcie_roots.items() if cpus == topology.online]
    if options.expose_pcie_roots:
        if not topology.pcie_roots:
            lines.append("  pcie roots: none found")
        elif everywhere:
            lines.append(f"  pcie roots local to every cpu: {', '.join(everywhere)}")
    cells_width = max(
        (len(",".join(mark(c) for c in core)) for core in topology.cores.values()), default=1
    )
    for socket_id, socket_cpus in topology.sockets.items():
        note = _device_note(group_device.get(("socket", socket_id)))
        lines.append(
            f"socket {socket_id}: cpus {socket_cpus}, "
            f"{_count(len(topology.cores_of(socket_cpus)), 'core')}{note}"
        )
        # CPUs of no NUMA node after the nodes (their key, -1, sorts first)
        for numa_id, numa_cpus in sorted(
            topology.numa_nodes.items(), key=lambda item: item[0] == NO_NUMA_NODE
        ):
            in_numa = numa_cpus & socket_cpus
            if not in_numa:
                continue
            if numa_id == NO_NUMA_NODE:
                lines.append(f"  no numa node: cpus {in_numa} (in no device but cpudevmachine)")
            else:
                note = _device_note(group_device.get(("numa", numa_id)))
                lines.append(f"  numa {numa_id}: cpus {in_numa}{note}")
            local = [
                name
                for name, cpus in topology.pcie_roots.items()
                if name not in everywhere and not cpus.isdisjoint(in_numa)
            ]
            if local:
                lines.append(f"    pcie roots: {', '.join(local)}")
            for label, cpus in _caches(topology, in_numa):
                cores = [core & cpus for core in topology.cores_of(cpus)]
                lines.append(f"    {label}: cpus {cpus}, {_count(len(cores), 'core')}")
                by_type: dict[CoreType, list[str]] = {}
                for core in cores:
                    core_type = topology.info(core.min()).core_type
                    by_type.setdefault(core_type, []).append(",".join(mark(c) for c in core))
                for core_type, cells in by_type.items():
                    if core_type is not CoreType.STANDARD:
                        lines.append(f"      {_count(len(cells), core_type.value)}:")
                    lines.extend(_grid(cells, cells_width, indent=6))
    if topology.offline:
        lines.append(f"offline: cpus {topology.offline} (no topology while offline)")
    if claimed is not None:
        lines.extend(_claims(topology, reserved_online, claimed, keys))
    lines.append("")
    lines.extend(_devices_summary(devices))
    lines.extend(_differences(topology, devices, slices, options))
    lines.extend(_slices_summary(slices))
    return "".join(folded + "\n" for line in lines for folded in _fold(line))


def _fold(line: str) -> Iterator[str]:
    """Wrap a line longer than LINE_WIDTH after a comma or space (long cpusets), continuation
    lines indented four more than the line."""
    indent = " " * (len(line) - len(line.lstrip(" ")) + 4)
    while len(line) > LINE_WIDTH:
        cut = max(
            line.rfind(",", len(indent), LINE_WIDTH), line.rfind(" ", len(indent), LINE_WIDTH)
        )
        if cut <= len(indent):
            break  # nothing to break at: leave it long rather than split a number
        yield line[: cut + 1].rstrip()
        line = indent + line[cut + 1 :].lstrip()
    yield line


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _header(topology: Topology, reserved: CpuSet, claims_known: bool) -> Iterator[str]:
    smt = (
        f"on, {topology.smt_width} threads/core"
        if topology.smt_enabled
        else f"off ({topology.smt_width} thread{'s' if topology.smt_width > 1 else ''}/core)"
    )
    yield (
        f"cpus: {len(topology.online)} online ({topology.online or '-'}), "
        f"{len(topology.offline)} offline; smt {smt}"
    )
    yield f"reserved: {reserved or '-'}   isolated: {topology.isolated or '-'}"
    yield "a cell is one core, its threads comma separated"
    legend = "marks: R reserved, I isolated"
    if claims_known:
        legend += ", a..z held by a claim (listed below)"
    yield legend


def _caches(topology: Topology, cpus: CpuSet) -> Iterator[tuple[str, CpuSet]]:
    """The L3 caches within ``cpus`` (label, CPUs), then the CPUs with no L3 at all."""
    covered = CpuSet()
    for l3_id, l3_cpus in topology.l3_caches.items():
        inside = l3_cpus & cpus
        if inside:
            covered |= inside
            yield f"l3 {l3_id}", inside
    rest = cpus - covered
    if rest:
        yield "no l3", rest


def _grid(cells: Sequence[str], width: int, *, indent: int) -> Iterator[str]:
    per_row = max(1, (LINE_WIDTH - indent + CELL_GAP) // (width + CELL_GAP))
    for start in range(0, len(cells), per_row):
        row = cells[start : start + per_row]
        yield " " * indent + (" " * CELL_GAP).join(c.ljust(width) for c in row).rstrip()


def _group_devices(topology: Topology, devices: Sequence[Device]) -> dict[tuple[str, int], Device]:
    """Grouped devices keyed by the topology group they cover: ("numa", id), ("socket", id) or
    ("machine", 0)."""
    found: dict[tuple[str, int], Device] = {}
    for device in devices:
        if not device.grouped or not device.cpus:
            if device.grouped:
                found[("machine", 0)] = device
            continue
        numa = topology.numa_nodes_of(device.cpus)
        sockets = topology.sockets_of(device.cpus)
        if device.name.startswith("cpudevnuma") and len(numa) == 1:
            found[("numa", numa[0])] = device
        elif device.name.startswith("cpudevsocket") and len(sockets) == 1:
            found[("socket", sockets[0])] = device
        else:
            found[("machine", 0)] = device
    return found


def _device_note(device: Device | None) -> str:
    if device is None:
        return ""
    return f"  -> {device.name} ({CAPACITY_CPU}={device.capacity.get(CAPACITY_CPU, 0)})"


def _claims(
    topology: Topology, reserved: CpuSet, claimed: Mapping[str, CpuSet], keys: Mapping[str, str]
) -> Iterator[str]:
    held = CpuSet.union(claimed.values())
    shared = topology.online - reserved - topology.isolated - held
    yield ""
    yield f"exclusive: {_count(len(keys), 'claim')}, cpus {held or '-'}"
    for uid, key in keys.items():
        yield f"  {key}  {uid[:CLAIM_UID_PREFIX]}  cpus {claimed[uid]}"
    yield f"shared pool: cpus {shared or '-'} ({_count(len(shared), 'cpu')})"


def _devices_summary(devices: Sequence[Device]) -> Iterator[str]:
    if not devices:
        yield "devices: none (no allocatable CPU)"
        return
    if devices[0].grouped:
        yield f"devices: grouped mode, {_count(len(devices), 'device')}"
        width = max(len(d.name) for d in devices)
        layouts: set[object] = set()
        for device in devices:
            amount = device.capacity.get(CAPACITY_CPU, 0)
            cpus = device.cpus or "-"
            line = f"  {device.name.ljust(width)}  {CAPACITY_CPU}={amount}  cpus {cpus}"
            if ATTR_CPU_IDS in device.attributes:
                line += f"  {ATTR_CPU_IDS}={device.attributes[ATTR_CPU_IDS]}"
            layouts.add(device.attributes.get(ATTR_SMT_LAYOUT))
            yield line
        for layout in sorted(str(v) for v in layouts if v is not None):
            yield f"  {ATTR_SMT_LAYOUT}={layout} (node-wide, on every device)"
        return
    yield (
        f"devices: individual mode, {_count(len(devices), 'device')} "
        f"({devices[0].name}..{devices[-1].name}), numbered core by core:"
    )
    pairs = [f"{d.name}=cpu{d.cpus.min()}" for d in devices[:NUMBERING_SHOWN]]
    if len(devices) > NUMBERING_SHOWN:
        pairs.append(f"... +{len(devices) - NUMBERING_SHOWN}")
    yield from _wrap(pairs, indent=2)


def _wrap(words: Sequence[str], *, indent: int) -> Iterator[str]:
    line = ""
    for word in words:
        if line and indent + len(line) + 1 + len(word) > LINE_WIDTH:
            yield " " * indent + line
            line = ""
        line = f"{line} {word}" if line else word
    if line:
        yield " " * indent + line


def _differences(
    topology: Topology,
    devices: Sequence[Device],
    slices: Sequence[Mapping[str, Any]],
    options: SliceOptions,
) -> Iterator[str]:
    """What in these slices the Go driver would publish differently on this node."""
    found: list[str] = []
    if not topology.numa_in_sysfs:
        found.append(
            "the kernel has no NUMA nodes: every cpu is on node 0 (the Go driver skips every "
            "cpu, publishing no device but cpudevmachine)"
        )
    if not devices:
        found.append("no device: one empty ResourceSlice (the Go driver publishes none)")
    elif devices[0].grouped:
        policies = [
            d.get("capacity", {}).get(CAPACITY_CPU, {}).get("requestPolicy")
            for s in slices
            for d in (s.get("spec") or {}).get("devices") or []
        ]
        if any(policies):
            found.append(
                f"{CAPACITY_CPU} requestPolicy: whole cpus, default all of them (Go driver: none, "
                "fractions fail)"
            )
        found.append("dra.cpu/numIsolatedCPUs on every device (ours)")
    elif any(d.attributes.get(ATTR_ISOLATED) is not None for d in devices):
        found.append(f"{ATTR_ISOLATED} on every device (ours)")
    if options.expose_pcie_roots:
        found.append("pcieRoot is read on every architecture (the Go driver: on amd64 only)")
    yield "compared with the Go driver:"
    for line in found:
        yield f"  - {line}"


def _slices_summary(slices: Sequence[Mapping[str, Any]]) -> Iterator[str]:
    if not slices:
        yield "resourceslices: none"
        return
    spec = slices[0].get("spec") or {}
    pool = spec.get("pool") or {}
    yield (
        f"resourceslices: {len(slices)}, driver {spec.get('driver')}, "
        f"pool {pool.get('name')} generation {pool.get('generation')}"
    )
    for obj in slices:
        name = (obj.get("metadata") or {}).get("name", "?")
        devices = (obj.get("spec") or {}).get("devices") or []
        if not devices:
            yield f"  {name}: no devices"
            continue
        first, last = devices[0].get("name"), devices[-1].get("name")
        span = first if len(devices) == 1 else f"{first}..{last}"
        yield f"  {name}: {span} ({_count(len(devices), 'device')})"
