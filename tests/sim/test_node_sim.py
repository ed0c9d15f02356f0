"""The node simulator: scheduler and CDI reader without a daemon; ``dracpu sim`` with one."""

from __future__ import annotations

import json
import re
import shutil
import uuid
from pathlib import Path

import pytest

from dracpu.adapters.cdi_files import write_spec
from dracpu.cli import main as cli_main
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy, published_devices
from dracpu.core.slices import build_resource_slices
from dracpu.sim.node import NodeSim, SimError, open_node_sim
from dracpu.sim.topologies import FIXTURES

pytestmark = pytest.mark.anyio


def _publish(sim: NodeSim, mode: CpuDeviceMode) -> None:
    """Publish the node's devices as the daemon would (no daemon runs in these tests)."""
    devices = published_devices(
        sim.topology, reserved=CpuSet(), mode=mode, group_by=GroupBy.NUMANODE
    )
    for obj in build_resource_slices(sim.node_name, devices):
        sim.api.create_resource_slice(obj)


# --- the library, without a daemon -------------------------------------------------------------


async def test_the_node_files_are_laid_out_and_removed() -> None:
    async with open_node_sim(start=False, shared_containers=2) as sim:
        root = sim.paths.root
        assert (sim.paths.host_root / "sys/devices/system/cpu/online").read_text() == "0-63\n"
        assert sim.paths.nri_socket.is_socket()  # the fake runtime listens
        assert len(str(sim.paths.registry_dir / "dra.cpu-reg.sock")) <= 107
        assert sim.api.node(sim.node_name)["metadata"]["name"] == "sim-node"
        assert len(sim.shared_ids()) == 2
        assert "--kubeconfig=" + str(sim.api.kubeconfig_path) in sim.command()
        with pytest.raises(SimError, match="no dracpu run process was started"):
            _ = sim.daemon
    assert not root.exists()


async def test_the_scheduler_allocates_grouped_capacity_and_frees_it() -> None:
    async with open_node_sim(start=False) as sim:
        with pytest.raises(SimError, match="no device is published"):
            sim.allocate("early", 1)
        _publish(sim, CpuDeviceMode.GROUPED)
        big = sim.allocate("big", 14)
        small = sim.allocate("small", 4)
        assert (big.devices, small.devices) == (["cpudevnuma000"], ["cpudevnuma001"])
        assert sim.free_capacity() == {
            "cpudevnuma000": 2,
            "cpudevnuma001": 12,
            "cpudevnuma002": 16,
            "cpudevnuma003": 16,
        }
        stored = sim.api.resource_claim("default", "big")
        assert stored["metadata"]["uid"] == big.uid
        (result,) = stored["status"]["allocation"]["devices"]["results"]
        assert result["consumedCapacity"] == {"dra.cpu/cpu": "14"}
        assert result["pool"] == sim.node_name
        with pytest.raises(SimError, match="no published device has 17 free CPUs"):
            sim.allocate("huge", 17)
        sim.deallocate(big)
        assert sim.free_capacity()["cpudevnuma000"] == 16
        with pytest.raises(KeyError):
            sim.api.resource_claim("default", "big")


async def test_the_scheduler_allocates_individual_devices_in_order() -> None:
    async with open_node_sim(start=False, mode="individual") as sim:
        _publish(sim, CpuDeviceMode.INDIVIDUAL)
        first = sim.allocate("first", 3)
        second = sim.allocate("second", 2)
        assert first.devices == ["cpudev000", "cpudev001", "cpudev002"]
        assert second.devices == ["cpudev003", "cpudev004"]
        sim.deallocate(first)
        assert sim.allocate("third", 1).devices == ["cpudev000"]


async def test_the_runtime_side_reads_the_cdi_env_from_the_spec_file() -> None:
    async with open_node_sim(start=False) as sim:
        uid = str(uuid.uuid4())
        assert sim.cdi_cpus(uid) is None
        write_spec(sim.paths.cdi_dir, uid, CpuSet.parse("4-5,36-37"))
        assert sim.cdi_env(uid) == [f"DRA_CPUSET_{uid}=4-5,36-37"]
        assert sim.cdi_cpus(uid) == "4-5,36-37"
        assert sim.cdi_claims() == [uid]
        other = str(uuid.uuid4())
        sim.paths.cdi_spec(other).write_text('{"kind": "vendor.example/gpu", "devices": []}')
        with pytest.raises(SimError, match=r"has kind 'vendor\.example/gpu'"):
            sim.cdi_env(other)


# --- dracpu sim, with the real daemon --------------------------------------------------------


def test_dracpu_sim_walks_a_claim_through_the_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["sim", "--shared", "2", "--cpus", "6"]) == 0
    out = capsys.readouterr().out.splitlines()
    titles = [line for line in out if line.startswith("[")]
    assert [t.split("]")[0] for t in titles] == [f"[{n}" for n in range(1, 10)]
    assert titles[0].startswith("[1] dracpu run is ready (")
    assert titles[3] == (
        "[4] The scheduler allocates claim demo/demo: 6 CPUs of cpudevnuma000 "
        "(consumedCapacity dra.cpu/cpu=6)"
    )
    assert titles[4].startswith("[5] kubelet NodePrepareResources: cpus 0-2,32-34 (3 cores")
    assert "    demo/demo-app/main         cpus 0-2,32-34 (exclusive)" in out
    assert out.count("    default/shared-0/main      cpus 0-63 -> 3-31,35-63") == 1
    # A second claim (cpu 3) whose pod ends without Unprepare goes after the grace (2 s).
    assert titles[6].startswith(
        "[7] A pod ends but the kubelet never unprepares its claim: the daemon releases the orphan "
    )
    assert titles[6].endswith(" s later (List every 500ms, --orphan-grace 2s)")
    assert float(titles[6].split("orphan ")[1].split(" s later")[0]) >= 2.0
    assert any(line.startswith("    daemon: released orphan claim ") for line in out)
    assert "    CDI spec removed; claim demo/demo still prepared" in out
    assert out.count("    default/shared-0/main      cpus 4-31,35-63 -> 3-31,35-63") == 1
    assert titles[7].endswith("widened at once (unsolicited NRI UpdateContainers)")
    assert out.count("    default/shared-1/main      cpus 3-31,35-63 -> 0-63") == 1
    # cpu 63 goes offline: unhealthy within the second, then SIGHUP shrinks NUMA node 3
    assert titles[8] == "[9] cpu 63 goes offline (CPU hotplug in the fake sysfs), then SIGHUP"
    assert any(
        line.startswith(
            '    kubelet health stream (v1): cpudevnuma003 UNHEALTHY, "cpu 63 is offline" ('
        )
        for line in out
    )
    assert "    SIGHUP: ResourceSlices republished, pool generation 1 -> 2" in out
    assert "      cpudevnuma003: dra.cpu/cpu 16 -> 15" in out
    assert "    kubelet health stream: 4 devices (was 4), 0 unhealthy" in out
    assert out.count("    default/shared-0/main      cpus -> 0-62 (re-pinned at once)") == 1
    assert out[-1].startswith("OK: 9 steps checked in ")


def readme_topologies() -> list[str]:
    """The topologies the README's `dracpu sim` section lists (``--topology``: ...)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## `dracpu sim`", 1)[1].split("\n## ", 1)[0]
    listed = re.search(r"\(`--topology`:(.*?)\)\.", section, re.DOTALL)
    assert listed is not None, "the README's dracpu sim section lists no topologies"
    return re.findall(r"`([a-z0-9-]+)`", listed[1])


def test_the_readme_lists_every_topology() -> None:
    assert sorted(readme_topologies()) == sorted(FIXTURES)


@pytest.mark.parametrize("topology", readme_topologies())
def test_dracpu_sim_exits_0_on_every_topology_the_readme_lists(
    topology: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["sim", "--topology", topology, "-o", "json"]) == 0, capsys.readouterr().out
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is True
    steps = document["steps"]
    assert len(steps) == 9
    claim = CpuSet.parse(steps[4]["cpus"])
    assert 1 <= len(claim) <= 4  # the default size, or what fits (vm-2cpu: 1)
    assert steps[5]["cpus"] == steps[4]["cpus"]  # the container got the claim's CPUs
    assert steps[8]["unhealthy"]  # the CPU that went offline made a device unhealthy
    assert set(steps[8]["healthAfter"].values()) == {"HEALTHY"}


def test_dracpu_sim_json_with_an_old_runtime(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "-o", "json", "--runtime-version", "2.2.0", "--shared", "1", "--cpus", "2"]
    assert cli_main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is True
    assert len(document["steps"]) == 9
    assert document["steps"][4]["cpus"] == "0,32"
    assert document["steps"][6]["cpus"] == "1"  # the orphan
    assert document["steps"][6]["releasedAfter"] >= 2.0
    assert document["steps"][7]["widened"].startswith("at the next container event (NRI v0.10")
    assert document["steps"][7]["shared"] == {"ctr-0002": "0-63"}
    hotplug = document["steps"][8]
    assert hotplug["unhealthy"] == {"cpudevnuma003": "cpu 63 is offline"}
    assert hotplug["resized"] == {"cpudevnuma003": ["16", "15"]}
    assert set(hotplug["healthAfter"].values()) == {"HEALTHY"}


def test_dracpu_sim_fails_with_exit_1_when_the_node_refuses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Two CPUs, one shared container: the claim would leave the shared pool empty.
    assert cli_main(["sim", "--topology", "vm-2cpu", "--cpus", "2", "--shared", "1"]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("FAILED: NodePrepareResources failed: preparing claim ")
    assert last.endswith(
        "would leave no CPU for the 1 shared containers: the shared pool 0-1 would become empty; "
        "choose a smaller --cpus (at most 1 fit here)"
    )
    # More than any device has: the scheduler cannot allocate it, and the message says --cpus.
    # With --keep, the run says where its files are, failed or not.
    argv = ["sim", "--topology", "vm-2cpu", "--cpus", "4", "--shared", "1", "--keep"]
    assert cli_main(argv) == 1
    failed, kept = capsys.readouterr().out.splitlines()[-2:]
    assert failed == (
        "FAILED: no published device has 4 free CPUs: {'cpudevnuma000': 2}; choose a smaller "
        "--cpus (at most 1 fit here)"
    )
    assert kept.startswith("node files and daemon logs kept in /")
    root = Path(kept.rsplit(" ", 1)[1])
    try:
        logs = list((root / "logs").iterdir())
        assert logs, "no daemon log kept"
        assert all(log.stat().st_size > 0 for log in logs)
    finally:
        shutil.rmtree(root)


def test_dracpu_sim_refuses_an_unknown_topology(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["sim", "--topology", "nope"]) == 2
    assert capsys.readouterr().err == (
        "dracpu sim: error: unknown topology 'nope': choose one of arm64-server, big-1024, "
        "dual-socket-smt2, hybrid-desktop, knl-smt4, no-numa-node, offline-isolated, smt4, "
        "vm-2cpu\n"
    )
