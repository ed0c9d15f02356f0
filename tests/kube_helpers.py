"""Helpers shared by the tests that talk to the fake API server through the real kube adapter."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from dracpu.adapters.kube import KubeClient, open_kube_client
from dracpu.sim.fake_apiserver import FakeApiServer, open_fake_apiserver

__all__ = ["NODE", "NODE_UID", "connected", "foreign_slice"]

NODE = "node-a"
NODE_UID = "6c4d2b1a-0000-4000-8000-000000000001"


def foreign_slice(name: str, *, driver: str, node: str, generation: int = 1) -> dict[str, Any]:
    """A minimal valid ResourceSlice of someone else (another driver, or another node)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [{"name": "dev0"}],
        },
    }


@contextlib.asynccontextmanager
async def connected(**options: Any) -> AsyncIterator[tuple[FakeApiServer, KubeClient]]:
    """A fake API server (``options`` go to it) holding node ``NODE``, and a client of it."""
    async with open_fake_apiserver(**options) as api:
        api.add_node(NODE, uid=NODE_UID)
        async with open_kube_client(api.kubeconfig_path, request_timeout=10) as kube:
            yield api, kube
