"""``dracpu gatherinfo``: finding the driver, reading its settings, and the report's parts.

The whole report from a running simulated node is read back by
tests/integration/test_upstream_chart.py; here the pieces, and the failures a broken node shows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import MappingProxyType

import pytest
import yaml

from dracpu.adapters.cdi_files import write_spec
from dracpu.adapters.host_cgroups import CgroupState
from dracpu.core.checkpoint_schema import CheckpointData, PreparedClaim, encode
from dracpu.core.commands import Container
from dracpu.core.cpuset import CpuSet
from dracpu.core.node_config import NodeConfig
from dracpu.core.state import ContainerRecord, NodeState
from dracpu.diagnostics import gatherinfo
from dracpu.diagnostics.gatherinfo import (
    DriverProcess,
    GatherError,
    driver_arguments,
    driver_config,
    find_driver,
    render,
    report,
)
from dracpu.sim.topologies import build_topology, fixture, write_sysfs
from dracpu.tasks.debug_dump import snapshot


@pytest.mark.parametrize(
    ("cmdline", "expected"),
    [
        (["/dracpu", "--v=4"], ["--v=4"]),
        (["/opt/dracpu/bin/python", "/dracpu", "--v=4"], ["--v=4"]),  # a script's cmdline
        (["/usr/bin/python3", "-m", "dracpu", "run", "-v"], ["run", "-v"]),
        (["/dracpu-gatherinfo", "--stdout"], None),
        (["/usr/bin/python3", "-c", "pass"], None),
        ([], None),
    ],
)
def test_driver_arguments(cmdline: list[str], expected: list[str] | None) -> None:
    assert driver_arguments(cmdline) == expected


def _process(tmp_path: Path, arguments: list[str], environ: dict[str, str]) -> DriverProcess:
    # Our own process stands in for the driver: /proc/<pid>/root is "/" for it.
    return DriverProcess(os.getpid(), ("/dracpu", *arguments), tuple(arguments), environ)


def test_the_settings_come_from_flags_environment_and_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("groupBy: socket\nreservedCPUs: '0-1'\n")
    process = _process(
        tmp_path,
        ["--v=4", "--bind-address=:9090", f"--config={config}", "--reserved-cpus=2"],
        {"NODE_NAME": "node-a", "HOST_ROOT": str(tmp_path)},
    )
    settings = driver_config(process)
    assert (settings.node_name, settings.verbosity, str(settings.bind_address)) == (
        "node-a",
        4,
        ":9090",
    )
    assert (str(settings.group_by), str(settings.reserved_cpus)) == ("socket", "2")
    assert settings.host_root == tmp_path


@pytest.fixture
def node(tmp_path: Path) -> DriverProcess:
    host = tmp_path / "host"
    write_sysfs(fixture("smt4"), host)
    state, cdi = tmp_path / "state", tmp_path / "cdi"
    state.mkdir()
    cdi.mkdir()
    claim = PreparedClaim(
        "11111111-2222-3333-4444-555555555555",
        CpuSet.parse("4-7"),
        "ns",
        "c",
        pod_uids=frozenset({"pod-b", "pod-a"}),
    )
    (state / "checkpoint.json").write_bytes(
        encode(CheckpointData(MappingProxyType({claim.claim_uid: claim})), 1)
    )
    return _process(
        tmp_path,
        ["run", f"--state-dir={state}", f"--cdi-dir={cdi}", "--node-name=n"],
        {"HOST_ROOT": str(host)},
    )


def test_the_report_has_upstreams_shape_and_ours(node: DriverProcess) -> None:
    doc = report(node)
    text = render(doc)
    assert text.startswith("---\n")
    back = yaml.safe_load(text)
    assert list(back)[:4] == ["toolVersion", "layoutVersion", "cpuDetails", "driverConfig"]
    assert back["layoutVersion"] == "v1"
    topology = back["cpuDetails"]["topology"]
    machine = build_topology(fixture("smt4"))
    assert topology["numCPUs"] == len(machine.online)
    assert topology["numNUMANodes"] == len(machine.numa_nodes)
    assert topology["smtEnabled"] is True
    cpu0 = back["cpuDetails"]["cpus"][0]
    assert set(cpu0) == {
        "cpuID",
        "coreID",
        "socketID",
        "clusterID",
        "numaNodeID",
        "numaNodeCPUSet",
        "sibling",
        "coreType",
        "uncoreCacheID",
    }
    assert cpu0["sibling"] in set(machine.siblings(0)) - {0}
    # Upstream's driverConfig leaves zero values out (json omitempty).
    assert back["driverConfig"] == {
        "hostnameOverride": "n",
        "bindAddress": ":8080",
        "cpuDeviceMode": "grouped",
        "groupBy": "numanode",
        "kubeletRootDir": "/var/lib/kubelet",
    }
    ours = back["dracpu"]
    assert ours["checkpoint"]["claims"] == [
        {
            "uid": "11111111-2222-3333-4444-555555555555",
            "namespace": "ns",
            "name": "c",
            "cpus": "4-7",
            "mems": None,
            "devices": [],
            "podUids": ["pod-a", "pod-b"],  # the pods the claim is reserved for
            "podNames": [],
            "copierPods": [],
            "sharedPool": False,
        }
    ]
    assert ours["cdiSpecs"] == {}
    assert ours["hostCgroupsFound"] is None  # nothing confined
    # This test process does not catch SIGUSR1: it is not sent (it would end the process).
    assert ours["debugDump"] == {"error": f"process {os.getpid()} does not handle SIGUSR1 (yet)"}


def test_a_broken_part_is_reported_in_place(node: DriverProcess, tmp_path: Path) -> None:
    (tmp_path / "state" / "checkpoint.json").write_bytes(b"\x00garbage")
    (tmp_path / "state" / "checkpoint.1.json").mkdir()  # unreadable as a file
    doc = report(node)
    assert set(doc["dracpu"]["checkpoint"]) == {"error"}
    assert doc["cpuDetails"]["topology"]["numCPUs"] > 0  # the rest is still there


def test_what_the_confined_host_cgroups_held_is_in_the_report(
    node: DriverProcess, tmp_path: Path
) -> None:
    found = {"version": 1, "hierarchy": "v2", "found": {"system.slice": ""}}
    (tmp_path / "state" / "host-cgroups.json").write_text(json.dumps(found))
    assert report(node)["dracpu"]["hostCgroupsFound"] == found


def test_the_cdi_specs_say_which_claims_share_the_pool(node: DriverProcess, tmp_path: Path) -> None:
    plain, shared = "11111111-2222-3333-4444-555555555555", "11111111-2222-3333-4444-666666666666"
    write_spec(tmp_path / "cdi", plain, CpuSet.parse("4-7"))
    write_spec(tmp_path / "cdi", shared, CpuSet.parse("8-9"), shared_pool=True)
    assert report(node)["dracpu"]["cdiSpecs"] == {
        plain: "4-7",
        shared: "8-9 and the shared pool",
    }


def test_no_driver_process_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gatherinfo, "PROC", tmp_path)
    with pytest.raises(GatherError, match="no running 'dracpu' process found"):
        find_driver()
    with pytest.raises(GatherError, match="process 1 is not a running dracpu"):
        find_driver(1)


def test_the_driver_is_found_by_its_process_name_and_dumps_on_sigusr1(tmp_path: Path) -> None:
    # A stand-in driver: a process named dracpu (its command is a link of that name) that
    # catches SIGUSR1 and writes a dump where the daemon's task writes it, atomically as the
    # task does (a plain write can be seen empty, between its truncate and its write).
    state = tmp_path / "state"
    state.mkdir()
    program = tmp_path / "driver.py"
    program.write_text(
        "import json, os, signal, time\n"
        "from pathlib import Path\n"
        f"path = Path({str(state / 'debug-dump.json')!r})\n"
        "def dump(*_):\n"
        "    doc = {'pid': os.getpid(), 'state': 'not restored yet', 'recentLog': ['a line']}\n"
        "    path.with_suffix('.tmp').write_text(json.dumps(doc))\n"
        "    os.replace(path.with_suffix('.tmp'), path)\n"
        "signal.signal(signal.SIGUSR1, dump)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    link = tmp_path / "dracpu"
    link.symlink_to(sys.executable)
    with subprocess.Popen(
        [str(link), str(program), "run", f"--state-dir={state}", "--node-name=n"],
        stdout=subprocess.PIPE,
        text=True,
    ) as driver:
        try:
            assert driver.stdout is not None
            assert driver.stdout.readline() == "ready\n"
            found = find_driver(driver.pid)
            assert found.arguments[0] == str(program)  # python <script> ...: not dracpu's argv
            process = DriverProcess(
                driver.pid,
                found.cmdline,
                ("run", f"--state-dir={state}", "--node-name=n"),
                found.environ,
            )
            dump = report(process)["dracpu"]["debugDump"]
            assert dump == {
                "pid": driver.pid,
                "state": "not restored yet",
                "recentLog": ["a line"],
            }
        finally:
            driver.send_signal(signal.SIGTERM)
            driver.wait(timeout=30)


def test_gatherinfo_writes_a_file_under_output_dir(
    node: DriverProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gatherinfo, "find_driver", lambda pid: node)
    out = tmp_path / "reports"
    assert gatherinfo.gather(output_dir=out, stdout=False, pid=None) == 0
    (written,) = out.iterdir()
    assert written.name.startswith("dracpu-gatherinfo-")
    assert written.suffix == ".yaml"
    assert (written.stat().st_mode & 0o777) == 0o600
    assert yaml.safe_load(written.read_text())["layoutVersion"] == "v1"


def test_the_debug_dump_lists_claims_containers_and_the_pins_last_sent() -> None:
    topology = build_topology(fixture("smt4"))
    config = NodeConfig.build("n", topology)
    claim = PreparedClaim("u1", CpuSet.parse("4-7"), "ns", "c", pod_uids=frozenset({"p2"}))
    shared = Container(id="c-shared", pod_uid="p1", pod_namespace="ns", pod_name="web", name="m")
    pinned = Container(id="c-pinned", pod_uid="p2", pod_namespace="ns", pod_name="db", name="m")
    state = NodeState(
        config=config,
        claims=MappingProxyType({"u1": claim}),
        claimed=CpuSet.parse("4-7"),
        containers=MappingProxyType(
            {
                "c-shared": ContainerRecord(shared, (), config.allocatable - CpuSet.parse("4-7")),
                "c-pinned": ContainerRecord(pinned, ("u1",), CpuSet.parse("4-7")),
            }
        ),
        shared=frozenset({"c-shared"}),
    )
    cgroups = (
        CgroupState("system.slice", CpuSet.parse("0-3")),
        CgroupState("runtime.slice", None, "no such cgroup"),
    )
    dump = snapshot(state, ["l1"], 0.0, cgroups)
    assert dump["written"] == "1970-01-01T00:00:00Z"
    assert dump["hostCgroups"] == [
        {"cgroup": "system.slice", "confinedTo": "0-3", "problem": ""},
        {"cgroup": "runtime.slice", "confinedTo": None, "problem": "no such cgroup"},
    ]
    assert dump["claims"] == [
        {
            "uid": "u1",
            "namespace": "ns",
            "name": "c",
            "cpus": "4-7",
            "mems": None,
            "podUids": ["p2"],
            "podNames": [],
            "copierPods": [],
            "sharedPool": False,
        }
    ]
    containers = {c["id"]: c for c in dump["containers"]}  # type: ignore[attr-defined]
    assert containers["c-pinned"]["cpus"] == "4-7"
    assert containers["c-pinned"]["claims"] == ["u1"]
    assert containers["c-shared"]["cpus"] == str(state.shared_pool)
    assert containers["c-shared"]["pod"] == "ns/web"
    assert dump["recentLog"] == ["l1"]
    assert time.gmtime(0).tm_year == 1970
