"""Topology read + device + slice build on the 1024-CPU fixture (issue 2: target p50 <= 50 ms).

Figures (milliseconds, in-process, warm page cache):

- ``topology.read_sysfs.big-1024``: :func:`dracpu.adapters.sysfs.read_topology` of a written tree;
  ``topology.read_sysfs.pcie.big-1024`` also reads its 16 PCIe roots (``--expose-pcie-roots``);
- ``topology.devices_and_slices.<mode>[.pcie].big-1024``: read + :func:`published_devices` +
  :func:`build_resource_slices` — what start-up and a SIGHUP resync cost; ``.pcie`` with the PCIe
  roots and the KEP-5517 mapping on;
- ``devices.build.<mode>[.pcie].big-1024``: :func:`published_devices` alone;
- ``slices.build.<mode>[.pcie].big-1024``: :func:`build_resource_slices` alone (what a republish
  costs);
- ``slices.validate.individual.big-1024``: :func:`validate_slice` over the 8 slices (the fake API
  server's cost per publish).

Run: ``.venv/bin/python bench/bench_topology.py``
"""

from __future__ import annotations

import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import measure
from dracpu.adapters.sysfs import read_topology
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy, published_devices
from dracpu.core.slices import SliceOptions, build_resource_slices
from dracpu.sim.slice_rules import validate_slice
from dracpu.sim.topologies import FIXTURES, write_sysfs

__all__ = ["main"]

FIXTURE = "big-1024"
NODE = "bench-node"
RESERVED = CpuSet.parse("0,512")  # one full core, as a typical reservedSystemCPUs
N = 60


def main() -> None:
    # tmpfs when there is one: writing the ~20k files is then quick; reads hit the page cache
    # either way.
    tmpfs = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="dracpu-bench-", dir=tmpfs) as tmp:
        root = Path(tmp)
        write_sysfs(FIXTURES[FIXTURE], root)
        measure(f"topology.read_sysfs.{FIXTURE}", lambda: read_topology(root), n=N)
        measure(
            f"topology.read_sysfs.pcie.{FIXTURE}",
            lambda: read_topology(root, pcie_roots=True),
            n=N,
        )
        for pcie, suffix in ((False, ""), (True, ".pcie")):
            options = SliceOptions(node_allocatable=pcie, expose_pcie_roots=pcie)
            for mode in CpuDeviceMode:

                def full(
                    mode: CpuDeviceMode = mode, pcie: bool = pcie, options: SliceOptions = options
                ) -> object:
                    topology = read_topology(root, pcie_roots=pcie)
                    devices = published_devices(
                        topology, reserved=RESERVED, mode=mode, group_by=GroupBy.NUMANODE
                    )
                    return build_resource_slices(NODE, devices, options=options)

                measure(f"topology.devices_and_slices.{mode}{suffix}.{FIXTURE}", full, n=N)

            topology = read_topology(root, pcie_roots=pcie)
            for mode in CpuDeviceMode:
                devices = published_devices(
                    topology, reserved=RESERVED, mode=mode, group_by=GroupBy.NUMANODE
                )
                build_devices = partial(
                    published_devices,
                    topology,
                    reserved=RESERVED,
                    mode=mode,
                    group_by=GroupBy.NUMANODE,
                )
                measure(f"devices.build.{mode}{suffix}.{FIXTURE}", build_devices, n=N)
                build_slices = partial(build_resource_slices, NODE, devices, options=options)
                measure(
                    f"slices.build.{mode}{suffix}.{FIXTURE}",
                    build_slices,
                    n=N,
                    devices=len(devices),
                )
        topology = read_topology(root)
        devices = published_devices(
            topology, reserved=RESERVED, mode=CpuDeviceMode.INDIVIDUAL, group_by=GroupBy.NUMANODE
        )
        slices = build_resource_slices(NODE, devices)
        measure(
            f"slices.validate.individual.{FIXTURE}",
            lambda: [validate_slice(s) for s in slices],
            n=N,
            slices=len(slices),
        )


if __name__ == "__main__":
    main()
