"""Upstream's sysfsOverlay: a YAML file of sysfs contents laid over the host's sysfs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dracpu.adapters.sysfs import read_topology
from dracpu.adapters.sysfs_overlay import build_overlay_root, load_overlay
from dracpu.errors import ConfigError
from dracpu.sim.topologies import fixture, write_sysfs

# Upstream's example (hack/examples/sysfs-overlay/configmap.yaml, in our words): four CPUs in two
# NUMA nodes of two cores each, on a host whose own sysfs says otherwise.
FOUR_CPUS_TWO_NODES = "\n".join(
    [
        '/sys/devices/system/cpu/online: "0-3\\n"',
        '/sys/devices/system/cpu/smt/control: "off\\n"',
        '/sys/devices/system/node/node0/cpulist: "0-1\\n"',
        '/sys/devices/system/node/node1/cpulist: "2-3\\n"',
    ]
    + [
        line
        for cpu in range(4)
        for line in (
            f'/sys/devices/system/cpu/cpu{cpu}/node{cpu // 2}: ""',
            f'/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id: "{cpu // 2}\\n"',
            f'/sys/devices/system/cpu/cpu{cpu}/topology/core_id: "{cpu % 2}\\n"',
            f'/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list: "{cpu}\\n"',
            f'/sys/devices/system/cpu/cpu{cpu}/cache/index3/level: "3\\n"',
            f'/sys/devices/system/cpu/cpu{cpu}/cache/index3/type: "Unified\\n"',
            f'/sys/devices/system/cpu/cpu{cpu}/cache/index3/id: "{cpu // 2}\\n"',
            f"/sys/devices/system/cpu/cpu{cpu}/cache/index3/shared_cpu_list: "
            f'"{cpu // 2 * 2}-{cpu // 2 * 2 + 1}\\n"',
        )
    ]
)


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host whose sysfs shows one NUMA node with two CPUs (a small VM)."""
    root = tmp_path / "host"
    write_sysfs(fixture("vm-2cpu"), root)
    return root


def _overlay(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "overlay.yaml"
    path.write_text(text)
    return path


def test_the_overlay_replaces_the_topology_the_host_shows(tmp_path: Path, host: Path) -> None:
    before = read_topology(host)
    overlay = load_overlay(_overlay(tmp_path, FOUR_CPUS_TWO_NODES))
    root = build_overlay_root(host, overlay, tmp_path / "merged")
    topology = read_topology(root)
    assert len(before.numa_nodes) == 1
    assert {n: str(c) for n, c in topology.numa_nodes.items()} == {0: "0-1", 1: "2-3"}
    assert {s: str(c) for s, c in topology.sockets.items()} == {0: "0-1", 1: "2-3"}
    assert topology.smt_enabled is False
    # The overlaid NUMA link hides the host's: each CPU is in exactly one node.
    assert sorted(e for e in os.listdir(root / "sys/devices/system/cpu/cpu2") if "node" in e) == [
        "node1"
    ]


def test_untouched_host_entries_are_links_to_the_host(tmp_path: Path, host: Path) -> None:
    overlay = load_overlay(_overlay(tmp_path, '/sys/devices/system/cpu/smt/control: "off\\n"\n'))
    root = build_overlay_root(host, overlay, tmp_path / "merged")
    cpu0 = root / "sys/devices/system/cpu/cpu0"
    assert cpu0.is_symlink()
    assert os.readlink(cpu0) == str(host / "sys/devices/system/cpu/cpu0")
    assert (root / "sys/devices/system/cpu/smt/control").read_text() == "off\n"
    assert not (root / "sys/devices/system/cpu/smt/control").is_symlink()
    assert read_topology(root).smt_enabled is False
    assert read_topology(root).online == read_topology(host).online


def test_a_rebuild_replaces_the_previous_tree_and_leaves_the_host_alone(
    tmp_path: Path, host: Path
) -> None:
    dest = tmp_path / "merged"
    build_overlay_root(host, load_overlay(_overlay(tmp_path, FOUR_CPUS_TWO_NODES)), dest)
    small = load_overlay(_overlay(tmp_path, '/sys/devices/system/cpu/smt/control: "on\\n"\n'))
    build_overlay_root(host, small, dest)
    assert not (dest / "sys/devices/system/node/node1").exists()
    assert read_topology(dest).online == read_topology(host).online
    assert (host / "sys/devices/system/cpu/online").read_text().strip() == "0-1"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("- a\n", "must be a mapping of keys to values, not a list"),
        ("/proc/cpuinfo: x\n", "'/proc/cpuinfo' is not a path under /sys"),
        ("sys/x: a\n", "'sys/x' is not a path under /sys"),
        ("/sys/a/../b: x\n", "'/sys/a/../b' is not a clean path (write it without //, . or ..)"),
        ("/sys//b: x\n", "'/sys//b' is not a clean path (write it without //, . or ..)"),
        ("/sys/a: 1\n", "the value of '/sys/a' must be a string"),
        ("/sys/a: x\n/sys/a/b: y\n", "/sys/a is both a file and a directory"),
        ("/sys/a: x\n/sys/a: y\n", 'not valid YAML: duplicate key "/sys/a" at line 2 column 1'),
        (
            '/sys/devices/system/cpu/cpu0/node0: ""\n/sys/devices/system/cpu/cpu0/node1: ""\n',
            "more than one NUMA node under /sys/devices/system/cpu/cpu0: node0, node1",
        ),
    ],
)
def test_bad_overlays_are_refused_with_one_line(tmp_path: Path, text: str, reason: str) -> None:
    path = _overlay(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_overlay(path)
    assert str(info.value) == f"sysfs overlay {path}: {reason}"


def test_a_missing_overlay_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"sysfs overlay .*nothing.yaml: cannot read: No such"):
        load_overlay(tmp_path / "nothing.yaml")


def test_an_overlay_on_a_host_without_sysfs_is_the_whole_tree(tmp_path: Path) -> None:
    overlay = load_overlay(_overlay(tmp_path, FOUR_CPUS_TWO_NODES))
    root = build_overlay_root(tmp_path / "no-such-host", overlay, tmp_path / "merged")
    assert str(read_topology(root).online) == "0-3"
