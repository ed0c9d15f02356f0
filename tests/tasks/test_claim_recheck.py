"""A claim belongs to its pods: the NRI task against the fake runtime and a real state owner,
with the claims the API server holds in a fake reader.

A container whose env is the exact ``DRA_CPUSET_<uid>=<cpus>`` of a prepared claim, in a pod the
claim is not reserved for, is refused at creation and confined at Synchronize, after one fresh
look at the claim; the claim's own containers are pinned and never wait for a look.
"""

from __future__ import annotations

import copy
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from dracpu.adapters import checkpoint_file
from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.errors import KubeNotFoundError
from dracpu.sim.fake_apiserver import build_resource_claim
from dracpu.sim.fake_runtime import FakePod, FakeRuntime, PluginFailedError, claim_env
from dracpu.tasks.claim_recheck import LOOK_TIMEOUT
from tests.tasks.both_backends import anyio_backend  # noqa: F401 (a fixture)
from tests.tasks.test_nri_plugin import NODE, UID_A, Node, add_shared, open_node

pytestmark = pytest.mark.anyio

CLAIM = f"claim-{UID_A[:4]}"  # the name Node.prepare gives it, in namespace "default"


class Claims:
    """The API server's ResourceClaims, as the NRI task reads them (a ``ClaimReader``)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.gets: list[str] = []
        self.gate: anyio.Event | None = None  # GETs wait for it (a server that does not answer)

    def reserve(self, uid: str, name: str, *pods: FakePod) -> None:
        """The claim, allocated on this node and reserved for ``pods``."""
        result = {"request": "cpus", "driver": "dra.cpu", "pool": NODE, "device": "cpudevnuma000"}
        consumers = [{"resource": "pods", "name": p.name, "uid": p.uid} for p in pods]
        obj = build_resource_claim("default", name, [result], uid=uid, reserved_for=consumers)
        self.objects[("default", name)] = obj

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        await anyio.lowlevel.checkpoint()
        self.gets.append(name)
        if self.gate is not None:
            await self.gate.wait()
        obj = self.objects.get((namespace, name))
        if obj is None:
            raise KubeNotFoundError(f'resourceclaims "{name}" not found', status=404)
        return copy.deepcopy(obj)


def checkpointed(node: Node, uid: str) -> PreparedClaim:
    stored = checkpoint_file.read_newest(node.socket.parent / "state" / "checkpoint.json")
    assert stored is not None
    return stored.data.claims[uid]


async def test_a_copied_env_fails_the_creation_naming_the_claim_and_the_pod() -> None:
    claims = Claims()
    async with open_node(setup=lambda rt: add_shared(rt, 2), start=False, api=claims) as node:
        rightful, copier = node.runtime.add_pod("rightful"), node.runtime.add_pod("copier")
        claims.reserve(UID_A, CLAIM, rightful)
        held = await node.prepare(UID_A, pods=frozenset({rightful.uid}))
        await node.start_plugin()
        await node.runtime.wait_plugin(10)
        pool = node.pool

        # The copier shows the claim's exact env before the claim's own container starts.
        stolen = node.exclusive(copier, "thief", UID_A)
        with pytest.raises(PluginFailedError) as caught:
            await node.runtime.create_container(copier, stolen)
        message = str(caught.value)
        assert f"claim default/{CLAIM} ({UID_A}) is not reserved for pod {copier.uid}" in message
        assert "of pod default/copier" in message
        assert caught.value.code == 9  # FAILED_PRECONDITION: the kubelet retries, never unpinned
        assert stolen.id not in node.runtime.containers
        assert claims.gets == [CLAIM]  # one fresh look, which found no reason to let it in
        node.assert_shared_at(pool)  # nothing moved for it

        # The claim's own container is pinned to the claim's CPUs, without a look.
        own = node.exclusive(rightful, "app", UID_A)
        await node.runtime.create_container(rightful, own)
        assert node.runtime.containers[own.id].cpus == str(held)
        assert claims.gets == [CLAIM]
        # The look noted the copier on the claim (checkpointed: a pod's claims never change).
        assert node.state.claims[UID_A].copiers == {copier.uid}
        assert checkpointed(node, UID_A).copiers == {copier.uid}
        # The copier tries again: still refused, without another look.
        with pytest.raises(PluginFailedError, match="not reserved for pod"):
            await node.runtime.create_container(copier, node.exclusive(copier, "again", UID_A))
        assert claims.gets == [CLAIM]


async def test_a_pod_the_claim_was_reserved_for_since_prepare_gets_it_after_one_look() -> None:
    claims = Claims()
    async with open_node(setup=lambda rt: add_shared(rt, 1), start=False, api=claims) as node:
        first, second = node.runtime.add_pod("first"), node.runtime.add_pod("second")
        held = await node.prepare(UID_A, pods=frozenset({first.uid}))
        claims.reserve(UID_A, CLAIM, first, second)  # the scheduler added a consumer
        await node.start_plugin()
        await node.runtime.wait_plugin(10)
        container = node.exclusive(second, "app", UID_A)
        await node.runtime.create_container(second, container)
        assert node.runtime.containers[container.id].cpus == str(held)
        assert claims.gets == [CLAIM]
        assert node.state.claims[UID_A].pod_uids == {first.uid, second.uid}
        assert checkpointed(node, UID_A).pod_uids == {first.uid, second.uid}
        assert checkpointed(node, UID_A).pod_names == {"first", "second"}
        assert checkpointed(node, UID_A).copiers == frozenset()


@pytest.mark.parametrize(
    ("api", "why"),
    [
        ("silent", f"no answer within {LOOK_TIMEOUT:.2f} s"),
        ("gone", "it is gone from the API server"),
        ("replaced", "it was replaced"),
        ("released", "its status.reservedFor names no pod now"),
        ("none", ""),
    ],
)
async def test_a_look_that_finds_nothing_leaves_the_refusal_in_time(api: str, why: str) -> None:
    claims = Claims()
    async with open_node(start=False, api=None if api == "none" else claims) as node:
        rightful, copier = node.runtime.add_pod("rightful"), node.runtime.add_pod("copier")
        await node.prepare(UID_A, pods=frozenset({rightful.uid}))
        if api == "silent":
            claims.reserve(UID_A, CLAIM, copier)
            claims.gate = anyio.Event()  # never set: the server does not answer
        elif api == "replaced":
            claims.reserve("aaaaaaaa-ffff-4000-8000-000000000009", CLAIM, copier)
        elif api == "released":
            claims.reserve(UID_A, CLAIM)  # the rightful pod is gone; Unprepare comes next
        await node.start_plugin()
        info = await node.runtime.wait_plugin(10)
        started = anyio.current_time()
        with pytest.raises(PluginFailedError, match="not reserved for pod") as caught:
            await node.runtime.create_container(copier, node.exclusive(copier, "app", UID_A))
        # Answered before the runtime's 2 s: the plugin is not dropped.
        assert anyio.current_time() - started < 1.9
        assert node.runtime.plugin == info
        assert why in str(caught.value)
        assert claims.gets == ([] if api == "none" else [CLAIM])
        assert node.state.claims[UID_A].pod_uids == {rightful.uid}


async def test_synchronize_confines_the_copier_and_pins_the_claims_own_container() -> None:
    claims = Claims()
    pods: dict[str, FakePod] = {}

    def setup(runtime: FakeRuntime) -> None:
        add_shared(runtime, 2)
        pods["rightful"] = runtime.add_pod("rightful")
        pods["copier"] = runtime.add_pod("copier")

    async with open_node(setup=setup, start=False, api=claims) as node:
        rightful, copier = pods["rightful"], pods["copier"]
        # Prepared for a pod that was replaced meanwhile: the API server names the right one.
        held = await node.prepare(UID_A, pods=frozenset({"0000-old-pod"}))
        claims.reserve(UID_A, CLAIM, rightful)
        env = [claim_env(UID_A, str(held))]
        # The copier's id sorts first: it must not take the claim by coming first.
        node.runtime.add_container(copier, "thief", container_id="a-thief", env=env)
        node.runtime.add_container(rightful, "app", container_id="b-app", env=env)
        await node.start_plugin()
        await node.runtime.wait_plugin(10)
        assert node.runtime.containers["b-app"].cpus == str(held)
        assert node.runtime.containers["a-thief"].cpus == node.pool  # confined to the pool
        assert node.state.shared >= {"a-thief"}
        assert claims.gets == [CLAIM]  # one look for the claim, however many containers
        assert node.state.claims[UID_A].pod_uids == {rightful.uid}
        assert node.state.claims[UID_A].copiers == {copier.uid}
        node.assert_shared_at(node.pool)
