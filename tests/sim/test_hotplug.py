"""CPU hotplug on a fake sysfs tree: after :func:`dracpu.sim.hotplug.set_offline` the tree is
file for file the one :func:`dracpu.sim.topologies.write_sysfs` writes for the machine with
those CPUs offline, and the daemon's sysfs reader reads it as that machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dracpu.adapters.sysfs import read_online, read_topology
from dracpu.core.cpuset import CpuSet
from dracpu.errors import ConfigError
from dracpu.sim.hotplug import set_offline
from dracpu.sim.topologies import FIXTURES, build_topology, write_sysfs
from tests.fixtures import scratch_dir


def _tree(root: Path) -> dict[str, str]:
    """Every file (its text), symlink (its target) and empty directory under ``root``."""
    found: dict[str, str] = {}
    for directory, dirs, files in os.walk(root):
        links = [d for d in dirs if os.path.islink(os.path.join(directory, d))]
        for name in files + links:
            path = os.path.join(directory, name)
            text = os.readlink(path) if os.path.islink(path) else Path(path).read_text()
            found[os.path.relpath(path, root)] = text
        if not files and not dirs:
            found[os.path.relpath(directory, root) + "/"] = "(empty)"
    return found


@pytest.mark.parametrize("name", ["dual-socket-smt2", "offline-isolated", "hybrid-desktop"])
def test_the_tree_after_hotplug_is_the_tree_of_the_machine_with_those_cpus_offline(
    name: str,
) -> None:
    spec = FIXTURES[name]
    with scratch_dir() as changed, scratch_dir() as fresh:
        write_sysfs(spec, changed)
        for offline in ("5", "5,13", "", "0-3", "1"):
            spec = set_offline(spec, changed, CpuSet.parse(offline))
            assert read_topology(changed, pcie_roots=True) == build_topology(spec, pcie_roots=True)
            assert read_online(changed) == CpuSet.range(0, spec.cpu_count) - spec.offline
            expected = fresh / f"offline-{offline.replace(',', '_')}"
            expected.mkdir()
            write_sysfs(spec, expected)
            assert _tree(changed) == _tree(expected), offline


def test_every_cpu_offline_is_refused() -> None:
    spec = FIXTURES["vm-2cpu"]
    with scratch_dir() as root:
        write_sysfs(spec, root)
        before = _tree(root)
        with pytest.raises(ConfigError, match="every CPU is offline"):
            set_offline(spec, root, CpuSet.parse("0-1"))
        assert _tree(root) == before
