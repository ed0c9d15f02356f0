"""The host cgroups' cpusets (:mod:`dracpu.adapters.host_cgroups`): on a fake cgroup v2 tree (a
directory with the kernel's files: what is written where), and on this machine's real cgroup v1
cpuset hierarchy (cgroups made under a test parent, a live process in each, the CPUs the kernel
lets it run on read back)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from dracpu.adapters.host_cgroups import CgroupState, HostCgroups
from dracpu.core.cpuset import CpuSet
from tests.cgroups_v1 import CGROUP_ROOT, v1_tree

ALL = CpuSet.range(0, 8)


def cpus(text: str) -> CpuSet:
    return CpuSet.parse(text)


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


def v2_node(root: Path) -> Path:
    """A cgroup v2 fs as a systemd node has it before anyone enabled cpuset below the root:
    ``cpuset.cpus`` present where the parent enables the controller (the tests write the file
    the kernel would show once the adapter enabled it)."""
    cgroups = root / "cgroup"
    write_tree(
        cgroups,
        {
            "cgroup.controllers": "cpuset cpu io memory pids\n",
            "cgroup.subtree_control": "cpu memory pids\n",
            "system.slice/cgroup.controllers": "cpuset cpu memory pids\n",
            "system.slice/cgroup.subtree_control": "cpu memory\n",
            "system.slice/cpuset.cpus": "\n",
            "system.slice/app.service/cgroup.controllers": "cpuset cpu memory\n",
            "system.slice/app.service/cgroup.subtree_control": "\n",
            "system.slice/app.service/cpuset.cpus": "\n",
            "kubelet.slice/cgroup.controllers": "cpuset cpu memory pids\n",
            "kubelet.slice/cgroup.subtree_control": "cpuset cpu memory\n",
            "kubelet.slice/cpuset.cpus": "0-5\n",
            "kubepods.slice/cgroup.controllers": "cpuset cpu memory pids\n",
            "kubepods.slice/cpuset.cpus": "\n",
        },
    )
    return cgroups


def read(root: Path, name: str) -> str:
    return (root / name).read_text()


def record(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict)
    return doc


# --- cgroup v2, on a fake tree ----------------------------------------------------------------


def test_v2_enables_cpuset_in_the_parents_records_confines_and_gives_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    root = v2_node(tmp_path)
    found = tmp_path / "state" / "host-cgroups.json"
    cgroups = HostCgroups(root, found)
    cgroups.confine(("system.slice/app.service", "kubelet.slice"), cpus("1-3"))
    assert cgroups.status() == (
        CgroupState("system.slice/app.service", cpus("1-3")),
        CgroupState("kubelet.slice", cpus("1-3")),
    )
    # the controller enabled where it was not: the root's and system.slice's subtree_control
    assert read(root, "cgroup.subtree_control") == "+cpuset\n"
    assert read(root, "system.slice/cgroup.subtree_control") == "+cpuset\n"
    assert read(root, "kubelet.slice/cgroup.subtree_control") == "cpuset cpu memory\n"  # had it
    assert read(root, "system.slice/app.service/cpuset.cpus") == "1-3\n"
    assert read(root, "kubelet.slice/cpuset.cpus") == "1-3\n"
    assert read(root, "system.slice/cpuset.cpus") == "\n"  # not listed: untouched
    assert read(root, "kubepods.slice/cpuset.cpus") == "\n"
    # what each held is on disk before it was written, 0600
    assert record(found) == {
        "version": 1,
        "hierarchy": "v2",
        "found": {"kubelet.slice": "0-5", "system.slice/app.service": ""},
    }
    assert found.stat().st_mode & 0o777 == 0o600
    logged = [r.getMessage() for r in caplog.records]
    assert any("enabled the cpuset controller in" in m for m in logged)
    assert any("host cgroup kubelet.slice (cgroup v2) confined to cpus 1-3" in m for m in logged)

    # the pool shrinks, then a SIGHUP drops kubelet.slice: it gets back what it held
    write_tree(root, {"cgroup.subtree_control": "cpuset cpu memory pids\n"})  # as the kernel
    write_tree(root, {"system.slice/cgroup.subtree_control": "cpuset cpu memory\n"})
    cgroups.confine(("system.slice/app.service", "kubelet.slice"), cpus("2-3"))
    assert read(root, "kubelet.slice/cpuset.cpus") == "2-3\n"
    cgroups.confine(("system.slice/app.service",), cpus("2-3"))
    assert read(root, "kubelet.slice/cpuset.cpus") == "0-5\n"
    assert cgroups.status() == (CgroupState("system.slice/app.service", cpus("2-3")),)
    assert record(found) == {
        "version": 1,
        "hierarchy": "v2",
        "found": {"system.slice/app.service": ""},
    }
    # the daemon stops: everything back (an empty cpuset.cpus: its parent's CPUs), no record
    cgroups.release()
    assert read(root, "system.slice/app.service/cpuset.cpus") == "\n"
    assert not found.exists()
    assert cgroups.status() == ()


def test_after_a_crash_the_record_is_what_is_given_back(tmp_path: Path) -> None:
    root = v2_node(tmp_path)
    found = tmp_path / "host-cgroups.json"
    HostCgroups(root, found).confine(("kubelet.slice",), cpus("4"))
    assert read(root, "kubelet.slice/cpuset.cpus") == "4\n"
    # a new process (the old one was killed): it finds 4 there, but the record says 0-5
    again = HostCgroups(root, found)
    again.confine(("kubelet.slice",), cpus("3-4"))
    assert record(found)["found"] == {"kubelet.slice": "0-5"}
    # restarted without the option: the start-up Resync lists nothing, which gives it back
    HostCgroups(root, found).confine((), cpus("0-7"))
    assert read(root, "kubelet.slice/cpuset.cpus") == "0-5\n"
    assert not found.exists()


def test_a_missing_cgroup_or_one_holding_the_pods_is_reported_and_left_alone(
    tmp_path: Path,
) -> None:
    root = v2_node(tmp_path)
    write_tree(root, {"kubelet.slice/kubelet-kubepods.slice/cpuset.cpus": "\n"})  # kind's layout
    found = tmp_path / "host-cgroups.json"
    cgroups = HostCgroups(root, found)
    cgroups.confine(("runtime.slice", "kubelet.slice", "system.slice/app.service"), cpus("1"))
    missing, pods, app = cgroups.status()
    assert missing == CgroupState(
        "runtime.slice", None, f"no such cgroup: {root / 'runtime.slice'}"
    )
    assert pods.cpus is None
    assert pods.problem == (
        "it holds kubelet.slice/kubelet-kubepods.slice, the kubelet's cgroup of the pods: "
        "confining it would confine every pod, exclusive ones included"
    )
    assert app == CgroupState("system.slice/app.service", cpus("1"))
    assert read(root, "kubelet.slice/cpuset.cpus") == "0-5\n"
    assert record(found)["found"] == {"system.slice/app.service": ""}


def test_without_the_cpuset_controller_nothing_is_written(tmp_path: Path) -> None:
    root = v2_node(tmp_path)
    write_tree(root, {"cgroup.controllers": "cpu io memory pids\n"})  # cpuset bound elsewhere
    cgroups = HostCgroups(root, tmp_path / "host-cgroups.json")
    cgroups.confine(("system.slice/app.service",), cpus("1"))
    (state,) = cgroups.status()
    assert state.problem == (
        f"the cpuset controller is not available in {root} "
        f"({root / 'cgroup.controllers'} does not list it)"
    )
    assert read(root, "cgroup.subtree_control") == "cpu memory pids\n"
    assert not (tmp_path / "host-cgroups.json").exists()


def test_nothing_is_written_before_what_it_holds_is_recorded(tmp_path: Path) -> None:
    root = v2_node(tmp_path)
    found = tmp_path / "host-cgroups.json"
    in_the_way = tmp_path / ".host-cgroups.json.tmp"
    in_the_way.mkdir()  # the record's temporary file cannot be made (as on a full disk)
    cgroups = HostCgroups(root, found)
    cgroups.confine(("kubelet.slice",), cpus("1"))
    (state,) = cgroups.status()
    assert state.cpus is None
    assert state.problem == (
        f"cannot record what it holds in {found}: Is a directory; nothing is written to a "
        "cgroup before that is recorded"
    )
    assert read(root, "kubelet.slice/cpuset.cpus") == "0-5\n"
    # repaired: the next try works
    in_the_way.rmdir()
    cgroups.confine(("kubelet.slice",), cpus("1"))
    assert cgroups.status() == (CgroupState("kubelet.slice", cpus("1")),)


@pytest.mark.parametrize(
    ("found", "said", "aside"),
    [
        (
            '{"version": 1, "hierarchy": "v2", "found": {"kubelet.slice": "x"}}',
            "cannot be read",
            True,
        ),
        ('{"version": 1, "hierarchy": "v1", "found": {"kubelet.slice": "0"}}', "is dropped", False),
    ],
    ids=["unreadable", "another hierarchy"],
)
def test_a_record_of_no_use_is_put_aside_and_what_the_cgroup_holds_is_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, found: str, said: str, aside: bool
) -> None:
    root = v2_node(tmp_path)
    path = tmp_path / "host-cgroups.json"
    path.write_text(found)
    HostCgroups(root, path).confine(("kubelet.slice",), cpus("1"))
    assert (tmp_path / "host-cgroups.json.corrupt").exists() is aside
    assert any(said in r.getMessage() for r in caplog.records)
    assert record(path)["found"] == {"kubelet.slice": "0-5"}


def test_no_cgroup_fs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cgroups = HostCgroups(tmp_path / "nothing", tmp_path / "host-cgroups.json")
    cgroups.confine((), ALL)  # nothing listed, nothing recorded: not even a look
    cgroups.release()
    assert cgroups.status() == ()
    assert caplog.records == []
    cgroups.confine(("system.slice",), ALL)
    (state,) = cgroups.status()
    assert state.problem.startswith(f"no cgroup fs at {tmp_path / 'nothing'}")


def test_an_empty_pool_confines_nothing(tmp_path: Path) -> None:
    root = v2_node(tmp_path)
    cgroups = HostCgroups(root, tmp_path / "host-cgroups.json")
    cgroups.confine(("kubelet.slice",), CpuSet())
    assert cgroups.status() == (
        CgroupState("kubelet.slice", None, "no CPU is shared or reserved to confine it to"),
    )
    assert read(root, "kubelet.slice/cpuset.cpus") == "0-5\n"


# --- cgroup v1, on this machine's cpuset hierarchy ---------------------------------------------


def test_v1_moves_live_processes_children_first_and_gives_back(tmp_path: Path) -> None:
    with v1_tree(["host.slice", "host.slice/svc", "other"]) as tree:
        machine = tree.cpus("host.slice")
        assert len(machine) >= 2
        first, rest = CpuSet([machine.min()]), machine - CpuSet([machine.min()])
        # a service below it is pinned to the first CPU only: it must stay so
        (tree.cgroups["host.slice/svc"] / "cpuset.cpus").write_text(str(first))
        found = tmp_path / "host-cgroups.json"
        cgroups = HostCgroups(CGROUP_ROOT, found)
        listed = (tree.path("host.slice"),)

        # a claim takes the first CPU: both processes move off it at once (the child is
        # narrowed first: the kernel refuses a parent narrower than a child, EBUSY); the child
        # keeps none of its own CPUs, so it gets all of its parent's
        cgroups.confine(listed, rest)
        assert cgroups.status() == (CgroupState(listed[0], rest),)
        assert tree.allowed("host.slice") == rest
        assert tree.allowed("host.slice/svc") == rest
        assert tree.allowed("other") == machine  # not listed
        assert record(found) == {
            "version": 1,
            "hierarchy": "v1",
            "found": {listed[0]: str(machine), f"{listed[0]}/svc": str(first)},
        }
        # released: back on every CPU, the service on its own one again (parents first)
        cgroups.confine(listed, machine)
        assert tree.allowed("host.slice") == machine
        assert tree.allowed("host.slice/svc") == first
        # another claim: taken again; then the daemon stops: everything as it was found
        cgroups.confine(listed, rest)
        assert tree.allowed("host.slice/svc") == rest
        cgroups.release()
        assert tree.cpus("host.slice") == machine
        assert tree.cpus("host.slice/svc") == first
        assert tree.allowed("host.slice/svc") == first
        assert not found.exists()


def test_v1_refuses_a_cgroup_holding_the_pods(tmp_path: Path) -> None:
    with v1_tree(["host", "host/kubepods"]) as tree:
        machine = tree.cpus("host")
        cgroups = HostCgroups(CGROUP_ROOT, tmp_path / "host-cgroups.json")
        cgroups.confine((tree.path("host"),), CpuSet([machine.max()]))
        (state,) = cgroups.status()
        assert state.problem.startswith(f"it holds {tree.path('host/kubepods')}, the kubelet's")
        assert tree.allowed("host/kubepods") == machine
        assert not (tmp_path / "host-cgroups.json").exists()


def test_v1_a_cgroup_gone_before_it_is_given_back_is_dropped(tmp_path: Path) -> None:
    with v1_tree(["host"]) as tree:
        machine = tree.cpus("host")
        found = tmp_path / "host-cgroups.json"
        cgroups = HostCgroups(CGROUP_ROOT, found)
        # an empty cgroup below it, made after the first confinement, then removed
        cgroups.confine((tree.path("host"),), CpuSet([machine.max()]))
        late = tree.cgroups["host"] / "late"
        late.mkdir()
        (late / "cpuset.mems").write_text((tree.cgroups["host"] / "cpuset.mems").read_text())
        (late / "cpuset.cpus").write_text(str(machine.max()))
        cgroups.confine((tree.path("host"),), CpuSet([machine.max()]))
        assert f"{tree.path('host')}/late" in record(found)["found"]
        os.rmdir(late)
        cgroups.release()
        assert cgroups.status() == ()
        assert tree.cpus("host") == machine
        assert not found.exists()
