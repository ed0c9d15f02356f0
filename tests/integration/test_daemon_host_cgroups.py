"""Host cgroups confined to the shared pool, on the real ``dracpu run``.

On this machine's real cgroup v1 cpuset hierarchy: cgroups made under a test parent, with a
live ``sleep`` in each, listed in the daemon's config file. The simulated node is ``vm-2cpu``
(CPUs 0 and 1, which this machine has too), and its host root's ``sys/fs/cgroup`` is the real
one. The CPUs the kernel lets each process run on (``Cpus_allowed_list``) are read back: off a
CPU the moment a claim takes it, back when it is released, the cgroup as it was found when the
daemon stops; what a crash leaves is given back by the next start without the option, and a
SIGHUP that drops it gives it back at once. On a fake cgroup v2 tree: a listed cgroup that does
not exist is reported (``/readyz`` 503 naming it, the metric 0), and confined once it appears.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dracpu.core.cpuset import CpuSet
from dracpu.sim.node import NodeSim, open_node_sim, wait_until
from tests.cgroups_v1 import CGROUP_ROOT, V1Tree, v1_tree
from tests.integration.conftest import cpus

pytestmark = pytest.mark.anyio

WITHIN = 20.0  # the longest any wait may take (2 shared cores, a subprocess)
NODE = CpuSet([0, 1])  # the CPUs of the simulated vm-2cpu machine


def _config(path: Path, cgroups: list[str]) -> str:
    path.write_text(f"confineHostCgroups: {json.dumps(cgroups)}\n")
    return f"--config={path}"


def _cgroup_fs(sim: NodeSim, target: Path) -> None:
    """The simulated host's cgroup fs is ``target``."""
    link = sim.paths.host_root / "sys" / "fs" / "cgroup"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


def _record(sim: NodeSim) -> Path:
    return sim.paths.state_dir / "host-cgroups.json"


async def _metric(sim: NodeSim, cgroup: str) -> str:
    _, body = await sim.daemon.get("/metrics")
    start = f'dracpu_host_cgroup_confined{{cgroup="{cgroup}"}} '
    (line,) = [line for line in body.splitlines() if line.startswith(start)]
    return line[len(start) :]


async def _allowed(tree: V1Tree, name: str, expected: CpuSet, what: str) -> None:
    await wait_until(f"{name} on cpus {expected} ({what})", lambda: tree.allowed(name) == expected)


async def test_a_confined_cgroup_follows_the_claims_on_real_cgroup_v1(tmp_path: Path) -> None:
    with v1_tree(["host.slice", "host.slice/svc", "other"]) as tree:
        machine = tree.cpus("host.slice")
        assert machine >= NODE
        listed = tree.path("host.slice")
        config = tmp_path / "config.yaml"
        async with open_node_sim(
            topology="vm-2cpu", start=False, extra_args=[_config(config, [listed])]
        ) as sim:
            _cgroup_fs(sim, CGROUP_ROOT)
            await sim.start_daemon()
            # confined at start to the shared pool (no reserved CPU): the node's two CPUs
            assert tree.allowed("host.slice") == NODE
            assert tree.allowed("host.slice/svc") == NODE
            assert tree.allowed("other") == machine  # not listed
            status, body = await sim.daemon.get("/readyz")
            assert status == 200
            assert f"[+]host-cgroups ok: {listed} confined to cpus 0-1\n" in body
            assert await _metric(sim, listed) == "1.0"

            # a claim takes a CPU: the processes are off it when Prepare answers
            claim = sim.allocate("claim", 1)
            assert (await sim.prepare(claim))[claim.uid].error == ""
            held = CpuSet(cpus(sim.cdi_cpus(claim.uid) or ""))
            assert len(held) == 1
            assert tree.allowed("host.slice") == NODE - held
            assert tree.allowed("host.slice/svc") == NODE - held
            status, body = await sim.daemon.get("/readyz")
            assert f"[+]host-cgroups ok: {listed} confined to cpus {NODE - held}\n" in body

            # released: back on both CPUs when Unprepare answers
            assert (await sim.unprepare(claim))[claim.uid] == ""
            assert tree.allowed("host.slice") == NODE
            assert tree.allowed("host.slice/svc") == NODE

            # taken again, then the daemon stops: the cgroups get back what they held
            assert (await sim.prepare(claim))[claim.uid].error == ""
            assert tree.allowed("host.slice") == NODE - held
            assert _record(sim).exists()
            assert await sim.stop_daemon() == 0
            assert tree.cpus("host.slice") == machine
            assert tree.allowed("host.slice/svc") == machine
            assert not _record(sim).exists()

            # started again (the claim is in the checkpoint): confined again, then killed
            await sim.start_daemon()
            assert tree.allowed("host.slice") == NODE - held
            await sim.daemon.kill()
            assert tree.allowed("host.slice") == NODE - held  # a crash gives nothing back
            # started without the option: the start gives back what the record says
            config.write_text("{}\n")
            await sim.start_daemon()
            assert tree.allowed("host.slice") == machine
            assert tree.allowed("host.slice/svc") == machine
            assert not _record(sim).exists()

            # a SIGHUP lists it: confined at once; one that drops it: given back at once
            _config(config, [listed])
            sim.sighup()
            await _allowed(tree, "host.slice", NODE - held, "listed by a SIGHUP")
            _config(config, [])
            sim.sighup()
            await _allowed(tree, "host.slice", machine, "dropped by a SIGHUP")
            await _allowed(tree, "host.slice/svc", machine, "dropped by a SIGHUP")
            assert (await sim.unprepare(claim))[claim.uid] == ""


def _v2_cgroup(directory: Path, files: dict[str, str]) -> None:
    """A cgroup v2 directory with these files, made elsewhere and renamed into place (as the
    kernel makes a cgroup: whole at once)."""
    making = directory.with_name(f".{directory.name}")
    making.mkdir(parents=True)
    for name, content in files.items():
        (making / name).write_text(content)
    making.rename(directory)


# A slice of a systemd node whose parent enables cpuset: cpuset.cpus empty (its parent's CPUs).
_SLICE = {
    "cgroup.controllers": "cpuset cpu memory pids\n",
    "cgroup.subtree_control": "cpu memory\n",
    "cpuset.cpus": "\n",
}


async def test_a_cgroup_that_cannot_be_confined_is_reported_and_tried_again(
    tmp_path: Path,
) -> None:
    fake = tmp_path / "cgroup"
    _v2_cgroup(fake, {**_SLICE, "cgroup.subtree_control": "cpuset cpu memory pids\n"})
    _v2_cgroup(fake / "system.slice", _SLICE)
    config = tmp_path / "config.yaml"
    arguments = [_config(config, ["system.slice", "runtime.slice"]), "--v=1"]
    async with open_node_sim(topology="vm-2cpu", start=False, extra_args=arguments) as sim:
        _cgroup_fs(sim, fake)
        await sim.start_daemon(wait_ready=False)
        await sim.daemon.wait_listening()

        async def reported() -> tuple[int, str]:
            return await sim.daemon.get("/readyz")

        await wait_until(
            "a second try to confine runtime.slice",
            lambda: any("failed again" in m for m in sim.daemon.messages("debug")),
            timeout=WITHIN,
            failed=sim.daemon.exited,
        )
        assert (fake / "system.slice" / "cpuset.cpus").read_text() == "0-1\n"
        status, body = await reported()
        assert status == 503
        assert (
            "[-]host-cgroups not ready: cannot confine runtime.slice: no such cgroup: "
            f"{sim.paths.host_root}/sys/fs/cgroup/runtime.slice\n"
        ) in body
        assert await _metric(sim, "runtime.slice") == "0.0"
        assert await _metric(sim, "system.slice") == "1.0"
        warnings = [m for m in sim.daemon.messages("warning") if "host cgroups" in m]
        assert len(warnings) == 1, warnings  # said once, however often it is tried
        assert warnings[0].startswith("confining the host cgroups failed, retrying in ")

        # systemd creates the slice: the next try (within a few seconds) confines it
        _v2_cgroup(fake / "runtime.slice", _SLICE)
        await wait_until(
            "runtime.slice confined",
            lambda: (fake / "runtime.slice" / "cpuset.cpus").read_text() == "0-1\n",
            timeout=WITHIN,
            failed=sim.daemon.exited,
        )
        await sim.daemon.wait_ready(WITHIN)
        status, body = await reported()
        assert "[+]host-cgroups ok: system.slice, runtime.slice confined to cpus 0-1\n" in body
        assert await _metric(sim, "runtime.slice") == "1.0"
        assert any(
            "confining the host cgroups works again" in m for m in sim.daemon.messages("info")
        )
        assert json.loads(_record(sim).read_text())["found"] == {
            "runtime.slice": "",
            "system.slice": "",
        }
        assert await sim.stop_daemon() == 0
        assert (fake / "system.slice" / "cpuset.cpus").read_text() == "\n"
        assert not _record(sim).exists()
