"""The state owner reads the PCIe roots only with ``--expose-pcie-roots`` and hands the
devices carrying them to the publisher (the settings of ``dracpu.config``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu.config import Config
from dracpu.core.commands import Command
from dracpu.core.devices import ATTR_PCIE_ROOT
from dracpu.tasks.state_owner import Request, StateOwner, create_request_stream
from tests.fixtures import SysfsTrees

pytestmark = pytest.mark.anyio


def config(trees: SysfsTrees, scratch: Path, *, expose: bool) -> Config:
    return Config(
        node_name="node-a",
        host_root=trees.root("dual-socket-smt2"),
        cdi_dir=scratch / "cdi",
        state_dir=scratch / "state",
        kubelet_root_dir=scratch / "kubelet",
        expose_pcie_roots=expose,
    )


async def test_pcie_roots_reach_the_published_devices_only_when_exposed(
    trees: SysfsTrees, scratch: Path
) -> None:
    send: MemoryObjectSendStream[Request[Command]]
    receive: MemoryObjectReceiveStream[Request[Command]]
    send, receive = create_request_stream()
    with send, receive:
        owner = StateOwner(config(trees, scratch, expose=True), receive)
        await owner.restore()
        roots = {d.name: d.attributes[ATTR_PCIE_ROOT] for d in owner.state.config.devices.values()}
        assert roots["cpudevnuma001"] == ("pci0000:5d", "pci0001:00")
        plain = StateOwner(config(trees, scratch, expose=False), receive)
        await plain.restore()
        assert all(ATTR_PCIE_ROOT not in d.attributes for d in plain.state.config.devices.values())
