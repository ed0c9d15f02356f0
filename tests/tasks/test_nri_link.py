"""The NRI link's ordering rule against the real state machine: which pins a reply carries, which
containers are queued again after a write, what an UpdateContainers sends.

The owner is played by calling :func:`dracpu.core.state.apply` directly; the link reads the
state the test commits. (The same rule over a real socket and a fake containerd is in
``test_nri_plugin.py``.)
"""

from __future__ import annotations

import anyio
import pytest

from dracpu.core.commands import (
    Command,
    Container,
    CreateContainer,
    DeviceResult,
    InvalidateContainers,
    PrepareClaim,
    RemoveContainer,
    Synchronize,
    UnprepareClaim,
)
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import (
    ClaimPrepared,
    ContainerPinned,
    ContainerUpdate,
    Reply,
    UpdateContainers,
)
from dracpu.core.node_config import NodeConfig
from dracpu.core.state import NodeState, apply, commit_phase
from dracpu.sim.topologies import FIXTURES, build_topology
from dracpu.tasks.nri_link import NriLink
from tests.tasks.both_backends import anyio_backend  # noqa: F401 (a fixture)

pytestmark = pytest.mark.anyio


NODE = "node-a"
TOPOLOGY = build_topology(FIXTURES["dual-socket-smt2"])
CONFIG = NodeConfig.build(NODE, TOPOLOGY, reserved=CpuSet.parse("0,32"))
UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"


class Owner:
    """Commits commands one by one, as the state owner does; the link reads :attr:`state`."""

    def __init__(self) -> None:
        self.state = NodeState.initial(CONFIG)
        self.link = NriLink()
        self.link.watch(lambda: self.state)

    def do(self, command: Command) -> object:
        new, effects = apply(self.state, command)
        _, reply, after = commit_phase(effects)
        assert not isinstance(reply.value, Exception), reply.value
        self.state = new
        for effect in after:
            assert isinstance(effect, UpdateContainers)
            self.link.submit(effect)
        return reply.value

    def prepare(self, uid: str, device: str = "cpudevnuma000") -> CpuSet:
        result = DeviceResult("cpus", NODE, device, consumed_cpus=2)
        prepared = self.do(PrepareClaim(uid, "ns", "c", (result,)))
        assert isinstance(prepared, ClaimPrepared)
        return prepared.cpus

    def create(self, cid: str, uid: str = "") -> ContainerPinned:
        env = [f"DRA_CPUSET_{uid}={self.state.claims[uid].cpus}"] if uid else []
        pinned = self.do(CreateContainer(Container.from_env(cid, f"pod-{cid}", env)))
        assert isinstance(pinned, ContainerPinned)
        return pinned


def _synchronized(*shared: str, unsolicited: bool = True) -> Owner:
    owner = Owner()
    owner.link.start(unsolicited=unsolicited)
    owner.do(Synchronize(tuple(Container(cid, f"pod-{cid}") for cid in shared), unsolicited))
    return owner


async def test_a_reply_carries_the_newest_decision_for_each_container() -> None:
    owner = _synchronized("s1", "s2")
    owner.prepare(UID_A)
    answer = owner.create("x", UID_A)  # decision 2: s1 and s2 narrowed
    narrow = owner.state.shared_pool
    assert [u.cpus for u in answer.updates] == [narrow, narrow]
    # Before the reply goes out, the owner decides Unprepare A: s1 and s2 widened (decision 3).
    owner.do(RemoveContainer("x"))
    owner.do(UnprepareClaim(UID_A))
    wide = owner.state.shared_pool
    assert wide > narrow
    assert owner.link.fresh(answer.updates) == [
        ContainerUpdate("s1", wide, None, 3),
        ContainerUpdate("s2", wide, None, 3),
    ]
    # The event's own container is gone from the state: its pin goes out as answered.
    assert owner.link.fresh_pin(answer.pin) == answer.pin
    assert list(owner.link.queued) == ["s1", "s2"]  # the widening's own UpdateContainers


async def test_a_reply_of_the_newest_decision_goes_out_as_answered() -> None:
    owner = _synchronized("s1")
    owner.prepare(UID_A)
    answer = owner.create("x", UID_A)
    assert owner.link.fresh(answer.updates) == list(answer.updates)
    assert owner.link.fresh_pin(answer.pin) == answer.pin
    owner.link.written([answer.pin, *answer.updates])
    assert list(owner.link.queued) == []  # nothing newer: nothing to send again


async def test_a_newer_pin_that_failed_is_left_to_the_next_reply() -> None:
    owner = _synchronized("s1")
    owner.prepare(UID_A)
    answer = owner.create("x", UID_A)  # decision 2
    owner.do(RemoveContainer("x"))
    owner.do(UnprepareClaim(UID_A))  # decision 3, queued
    [pin] = await owner.link.next_batch()
    owner.do(InvalidateContainers(((pin.container_id, pin.seq),)))  # the runtime failed it
    assert owner.link.fresh(answer.updates) == []  # neither the stale nor an unknown pin
    gone = owner.create("y")  # the next event's reply carries s1 again
    assert [u.container_id for u in gone.updates] == ["s1"]


async def test_a_write_overtaken_by_a_newer_decision_is_sent_again() -> None:
    owner = _synchronized("s1", "s2")
    owner.prepare(UID_A)
    owner.create("x", UID_A)
    owner.do(RemoveContainer("x"))
    owner.do(UnprepareClaim(UID_A))  # decision 3: s1, s2 widened, queued
    batch = await owner.link.next_batch()
    assert [(u.container_id, u.seq) for u in batch] == [("s1", 3), ("s2", 3)]
    # While the UpdateContainers waits for the runtime's lock, an event's reply narrows them
    # again (decision 5): once the update is answered, both are queued with the newest pin.
    owner.prepare(UID_B, "cpudevnuma001")
    answer = owner.create("z", UID_B)
    owner.link.written(owner.link.fresh([answer.pin, *answer.updates]))
    assert list(owner.link.queued) == []
    owner.link.written(batch)
    assert list(owner.link.queued) == ["s1", "s2"]
    narrowed = await owner.link.next_batch()
    assert narrowed == [owner.state.containers[c].pin() for c in ("s1", "s2")]
    assert {u.seq for u in narrowed} == {owner.state.pin_seq}


async def test_nothing_is_queued_without_a_runtime_that_takes_unsolicited_updates() -> None:
    owner = _synchronized("s1", unsolicited=False)
    owner.link.submit(UpdateContainers((ContainerUpdate("s1", CpuSet.parse("1-3"), None, 1),)))
    assert list(owner.link.queued) == []
    assert owner.link.status().unsolicited_dropped == 1
    owner.link.written([ContainerUpdate("s1", CpuSet.parse("1-3"), None, 0)])
    assert list(owner.link.queued) == []  # the next event's reply carries the newest pin

    owner.link.start(unsolicited=True)
    owner.link.submit(UpdateContainers((ContainerUpdate("s1", CpuSet.parse("1-3"), None, 1),)))
    assert list(owner.link.queued) == ["s1"]
    owner.link.stop("the runtime closed the connection")
    assert list(owner.link.queued) == []
    status = owner.link.status()
    assert (status.connected, status.synchronized, status.last_error) == (
        False,
        False,
        "the runtime closed the connection",
    )


async def test_a_batch_sends_the_committed_pins_and_skips_containers_gone_or_unknown() -> None:
    owner = _synchronized("s1", "s2", "s3")
    pins = {cid: owner.state.containers[cid].pin() for cid in ("s1", "s2", "s3")}
    owner.link.submit(UpdateContainers(tuple(pins.values())))
    owner.link.submit(UpdateContainers((pins["s2"],)))  # queued once
    owner.do(RemoveContainer("s1"))
    owner.do(InvalidateContainers((("s3", pins["s3"].seq),)))
    assert list(owner.link.queued) == ["s1", "s2", "s3"]
    assert await owner.link.next_batch() == [pins["s2"]]
    assert list(owner.link.queued) == []


async def test_next_batch_waits_for_a_submission() -> None:
    owner = _synchronized("s1")
    got: list[list[ContainerUpdate]] = []
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            got.append(await owner.link.next_batch())

        tg.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        assert got == []
        owner.link.submit(UpdateContainers((owner.state.containers["s1"].pin(),)))
    assert got == [[owner.state.containers["s1"].pin()]]


def _busy(link: NriLink) -> bool:
    """``link.busy``, read anew (a property mypy would take for constant between reads)."""
    return link.busy


async def test_settled_waits_for_the_queue_the_batch_on_its_way_and_the_answers() -> None:
    owner = _synchronized("s1")
    link = owner.link
    settled = anyio.Event()

    async def wait() -> None:
        await link.settled()
        settled.set()

    assert not _busy(link)
    await link.settled()  # returns at once
    link.submit(UpdateContainers((owner.state.containers["s1"].pin(),)))
    link.answering(1)  # an event is being answered
    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        assert await link.next_batch() == [owner.state.containers["s1"].pin()]
        await anyio.wait_all_tasks_blocked()
        assert _busy(link)  # the batch is on its way, the answer not written
        link.batch_done()
        await anyio.wait_all_tasks_blocked()
        assert not settled.is_set()
        link.answering(-1)
    assert settled.is_set()
    assert not _busy(link)


async def test_a_lost_connection_settles_the_link() -> None:
    owner = _synchronized("s1")
    owner.link.submit(UpdateContainers((owner.state.containers["s1"].pin(),)))
    owner.link.answering(1)
    assert _busy(owner.link)
    owner.link.stop("the runtime went away")  # nothing it owes can reach the runtime now
    assert not _busy(owner.link)
    with anyio.fail_after(1):
        await owner.link.settled()


def test_reply_effects_are_replies() -> None:
    # The owner answers a container event with one Reply and no other effect: the pins travel
    # in the answer, never as effects of their own.
    owner = _synchronized("s1")
    _, effects = apply(owner.state, CreateContainer(Container("y", "pod-y")))
    assert len(effects) == 1
    assert isinstance(effects[0], Reply)
