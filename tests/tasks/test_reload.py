"""SIGHUP reads the settings and the topology again (:mod:`dracpu.tasks.reload`), in-process.

The settings come from a real config file loaded by :func:`dracpu.config.load_config` with the
``dracpu run`` flags; the topology from a sysfs tree the simulator writes and changes
(:func:`dracpu.sim.hotplug.set_offline`). The last tests run the whole path: a real SIGHUP to
this process, the signals task, the reloader, the real state owner, its health board behind the
real ``DRAResourceHealth`` server and a grpcio kubelet watching in both versions.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu.adapters.sysfs import read_topology
from dracpu.config import Config, load_config
from dracpu.config.go_flags import add_run_arguments
from dracpu.core.commands import Command, DeviceResult, PrepareClaim, Resync
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import Device
from dracpu.core.effects import NodeChanged, Resynced, StrandedClaim
from dracpu.sim.fake_kubelet import HealthVersion
from dracpu.sim.hotplug import set_offline
from dracpu.sim.topologies import FIXTURES, MachineSpec, write_sysfs
from dracpu.tasks import signals
from dracpu.tasks.device_health import RESEND_INTERVAL
from dracpu.tasks.reload import ConfigSource, Reloader, report
from dracpu.tasks.slice_publisher import republish_channel
from dracpu.tasks.state_owner import Request, StateOwner, create_request_stream, request
from tests.tasks.both_backends import anyio_backend  # noqa: F401 (a fixture)
from tests.tasks.test_device_health import serving, watching

pytestmark = pytest.mark.anyio

NODE = "node-a"
MACHINE = "dual-socket-smt2"  # siblings +32; NUMA node n: cpus 8n..8n+7 and +32
WITHIN = 10.0  # the longest any wait may take (2 shared cores)


@dataclass
class Host:
    """A host root whose sysfs the test changes, and a config file next to it."""

    root: Path
    spec: MachineSpec
    config_file: Path

    def offline(self, cpus: str) -> None:
        self.spec = set_offline(self.spec, self.root, CpuSet.parse(cpus))

    def write_config(self, text: str) -> None:
        self.config_file.write_text(text)


@pytest.fixture
def host(scratch: Path) -> Host:
    root = scratch / "host"
    root.mkdir()
    write_sysfs(FIXTURES[MACHINE], root)
    config_file = scratch / "config.yaml"
    config_file.write_text("cpuDeviceMode: individual\nreservedCPUs: '0,32'\n")
    return Host(root, FIXTURES[MACHINE], config_file)


def _source(host: Host, scratch: Path, *flags: str) -> ConfigSource:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(
        [
            f"--config={host.config_file}",
            f"--node-name={NODE}",
            f"--host-root={host.root}",
            f"--cdi-dir={scratch / 'cdi'}",
            f"--state-dir={scratch / 'state'}",
            # The device metadata lives under the kubelet's root: a scratch one, never the
            # machine's /var/lib/kubelet (a restore rewrites every claim's metadata file).
            f"--kubelet-root-dir={scratch / 'kubelet'}",
            *flags,
        ]
    )
    environ: dict[str, str] = {}
    return ConfigSource(load_config(args, environ), partial(load_config, args, environ))


class Logging:
    """The logging setups a reloader asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, tuple[tuple[str, int], ...]]] = []

    def __call__(self, log_format: str, verbosity: int, vmodule: Sequence[tuple[str, int]]) -> None:
        self.calls.append((log_format, verbosity, tuple(vmodule)))


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# --- what a SIGHUP reads ----------------------------------------------------------------------


async def test_the_settings_are_read_again_reserved_applies_structural_keys_are_refused(
    host: Host, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = _source(host, scratch)
    setups = Logging()
    reloader = Reloader(source.loaded, source, setup=setups)
    first = await reloader.command()
    assert first == Resync(read_topology(host.root), CpuSet.parse("0,32"), False, ())
    assert setups.calls == []
    assert _errors(caplog) == []

    host.write_config(
        "cpuDeviceMode: grouped\n"  # structural: refused
        "groupBy: socket\n"  # structural: refused
        "reservedCPUs: '0-1,32-33'\n"
        "memoryPinning: true\n"
        "verbosity: 4\n"
        "nriSocket: /elsewhere/nri.sock\n"  # structural: refused
    )
    caplog.set_level(logging.INFO, logger="dracpu")
    command = await reloader.command()
    assert command.reserved == CpuSet.parse("0-1,32-33")
    assert command.pin_memory is True
    assert setups.calls == [("text", 4, ())]
    assert _errors(caplog) == [
        'SIGHUP: cpuDeviceMode changed from "individual" to "grouped", which needs a restart; '
        '"individual" stays in force',
        'SIGHUP: groupBy changed from "numanode" to "socket", which needs a restart; '
        '"numanode" stays in force',
        'SIGHUP: nriSocket changed from "/var/run/nri/nri.sock" to "/elsewhere/nri.sock", which '
        'needs a restart; "/var/run/nri/nri.sock" stays in force',
    ]
    caplog.clear()
    await reloader.command()
    assert setups.calls == [("text", 4, ())]  # the same verbosity again: not set up again


async def test_an_explicit_flag_still_wins_over_the_file(
    host: Host, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = _source(host, scratch, "--reserved-cpus=0")
    reloader = Reloader(source.loaded, source, setup=Logging())
    host.write_config("cpuDeviceMode: individual\nreservedCPUs: '0-3'\n")
    assert (await reloader.command()).reserved == CpuSet.parse("0")
    assert _errors(caplog) == []


async def test_a_config_file_that_no_longer_loads_keeps_the_running_settings(
    host: Host, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = _source(host, scratch)
    reloader = Reloader(source.loaded, source, setup=Logging())
    host.write_config("cpuDeviceMode: individual\nreservedCPUs: [0]\n")
    command = await reloader.command()
    assert command == Resync(read_topology(host.root))  # the topology is read all the same
    [error] = _errors(caplog)
    assert error.startswith("SIGHUP: the settings cannot be read again, the running ones stay: ")
    assert "reservedCPUs: invalid value [0]: must be a string, not a list" in error


async def test_a_topology_that_cannot_be_read_keeps_the_old_one(
    host: Host, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = _source(host, scratch)
    reloader = Reloader(source.loaded, source, setup=Logging())
    (host.root / "sys/devices/system/cpu/online").write_text("0-3,x\n")
    command = await reloader.command()
    assert command.topology is None
    assert command.reserved == CpuSet.parse("0,32")
    [error] = _errors(caplog)
    assert error.startswith("SIGHUP: cannot read the topology again, the old one stays: ")
    assert "sys/devices/system/cpu/online: malformed" in error


async def test_a_changed_sysfs_overlay_needs_a_restart(
    host: Host, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    overlay = scratch / "overlay.yaml"
    overlay.write_text("/sys/devices/system/cpu/isolated: '3'\n")
    host.write_config(f"cpuDeviceMode: individual\nsysfsOverlay: {overlay}\n")
    source = _source(host, scratch)
    built = {"sys/devices/system/cpu/isolated": b"3"}
    reloader = Reloader(source.loaded, ConfigSource(source.loaded, source.load, built))
    await reloader.command()
    assert _errors(caplog) == []
    overlay.write_text("/sys/devices/system/cpu/isolated: '3-4'\n")
    await reloader.command()
    assert _errors(caplog) == [
        f"SIGHUP: sysfsOverlay {overlay} changed, which needs a restart; the overlay built at "
        "start stays in force"
    ]


async def test_without_a_source_only_the_topology_is_read(host: Host) -> None:
    running = Config(node_name=NODE, host_root=host.root)
    host.offline("5")
    command = await Reloader(running).command()
    assert command == Resync(read_topology(host.root))
    assert command.topology is not None
    assert 5 not in command.topology.online


def test_report_is_one_line_and_a_warning_per_claim_on_offline_cpus(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dracpu")
    stranded = StrandedClaim("uid-1", "ns/a", CpuSet.parse("5"))
    changed = NodeChanged(
        went_offline=CpuSet.parse("5,37"),
        removed=("cpudev010", "cpudev011"),
        republished=True,
        stranded=(stranded,),
    )
    report(Resynced(1, changed, repinned=2))
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            "resync done: files of 1 prepared claims checked; cpus 5,37 went offline; "
            "devices removed: cpudev010, cpudev011; slices republished (new pool generation); "
            "claims holding offline cpus: ns/a (cpus 5); 2 shared containers re-pinned",
        ),
        (
            "WARNING",
            "claim ns/a (uid-1) holds cpus 5, which are offline: it keeps them (its CDI spec and "
            "its containers' cpuset are unchanged) and its devices are reported unhealthy until "
            "the cpus are back online or the claim is unprepared",
        ),
    ]


# --- the whole path: SIGHUP, owner, health stream ----------------------------------------------


@dataclass
class Running:
    owner: StateOwner
    send: MemoryObjectSendStream[Request[Command]]
    republished: list[str]
    published: list[tuple[Device, ...]]


@asynccontextmanager
async def running(host: Host, scratch: Path) -> AsyncIterator[Running]:
    """The state owner restored from ``host`` (individual devices, reserved 0,32), the signals
    task with a reloader, and what the slice publisher is asked."""
    source = _source(host, scratch)
    send: MemoryObjectSendStream[Request[Command]]
    receive: MemoryObjectReceiveStream[Request[Command]]
    send, receive = create_request_stream()
    republish_send, republish_receive = republish_channel()
    asked: list[str] = []
    published: list[tuple[Device, ...]] = []

    async def collect() -> None:
        async for asking in republish_receive:
            asked.append(asking.reason)
            published.append(asking.devices)

    with send, receive, republish_send, republish_receive:
        owner = StateOwner(source.loaded, receive, republish=republish_send)
        async with anyio.create_task_group() as tg:
            await tg.start(owner.run)
            tg.start_soon(collect)
            reloader = Reloader(source.loaded, source, setup=Logging())
            await tg.start(partial(signals.run, send.clone(), print, reloader=reloader))
            yield Running(owner, send, asked, published)
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the gRPC server needs asyncio
@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
async def test_a_cpu_offline_plus_sighup_reaches_the_health_stream_within_a_second(
    host: Host, scratch: Path, version: HealthVersion, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dracpu")
    async with running(host, scratch) as node:
        owner = node.owner
        by_cpu = {device.cpus.min(): device.name for device in owner.state.config.devices.values()}
        held, free = by_cpu[5], by_cpu[37]  # the two threads of one core
        claim_uid = "aaaaaaaa-0000-4000-8000-000000000001"
        result = DeviceResult("cpus", NODE, held)
        await request(node.send, PrepareClaim(claim_uid, "ns", "pinned", (result,)))
        async with serving(scratch / "dra.sock", owner.health):
            with watching(scratch / "dra.sock", version) as watch:
                first = await watch.anext(WITHIN)
                assert first is not None
                assert len(first.devices) == 62
                assert first.unhealthy() == {}

                # Both threads go offline; nothing else tells the board (no online poll here).
                host.offline("5,37")
                sent = time.monotonic()
                os.kill(os.getpid(), signal.SIGHUP)
                after = await watch.until(lambda h: free not in h.health(), WITHIN)
                # at once, not at the next resend of an unchanged list
                assert after.received - sent < RESEND_INTERVAL / 2
                # The free CPU's device is gone; the claim's stays, unhealthy, for its pod.
                assert len(after.devices) == 61
                assert after.unhealthy() == {held: "cpu 5 is offline"}
                assert owner.state.claims[claim_uid].cpus == CpuSet([5])
                assert {d.cpus.min() for d in owner.state.config.devices.values()}.isdisjoint(
                    {5, 37}
                )

                # Back online: every device again, under its old name, healthy.
                host.offline("")
                os.kill(os.getpid(), signal.SIGHUP)
                back = await watch.until(lambda h: len(h.devices) == 62, WITHIN)
                assert back.health() == first.health()
        assert node.republished == ["resync"] * 3  # the start-up Resync, then the two SIGHUPs
        # Each request carries the devices of its moment: all, then without cpus 5 and 37, all.
        assert [len(devices) for devices in node.published] == [62, 60, 62]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        f"claim ns/pinned ({claim_uid}) holds cpus 5, which are offline: it keeps them (its CDI "
        "spec and its containers' cpuset are unchanged) and its devices are reported unhealthy "
        "until the cpus are back online or the claim is unprepared"
    ) in warnings


async def test_a_restart_keeps_a_claim_whose_cpu_is_offline_and_reports_it(
    host: Host, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = _source(host, scratch)
    claim_uid = "aaaaaaaa-0000-4000-8000-000000000002"
    async with running(host, scratch) as node:
        held = {d.cpus.min(): d.name for d in node.owner.state.config.devices.values()}[6]
        result = DeviceResult("cpus", NODE, held)
        await request(node.send, PrepareClaim(claim_uid, "ns", "kept", (result,)))
    host.offline("6")
    send: MemoryObjectSendStream[Request[Command]]
    receive: MemoryObjectReceiveStream[Request[Command]]
    send, receive = create_request_stream()
    with send, receive:
        owner = StateOwner(source.loaded, receive)
        await owner.restore()
    assert owner.state.claims[claim_uid].cpus == CpuSet([6])
    assert all(6 not in d.cpus for d in owner.state.config.devices.values())
    # (a restart numbers the devices afresh: the claim's device name, from its results, is
    # reported for its offline CPU)
    _, health = owner.health.snapshot()
    assert [(h.device, h.status, h.message) for h in health if h.message] == [
        (held, "Unhealthy", "cpu 6 is offline")
    ]
    assert (
        f"claim ns/kept ({claim_uid}) holds cpus 6, which are offline: it keeps them (its CDI "
        "spec and its containers' cpuset are unchanged) and its devices are reported unhealthy "
        "until the cpus are back online or the claim is unprepared"
    ) in [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
