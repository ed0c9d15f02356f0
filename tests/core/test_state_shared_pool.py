"""Claims whose containers also run on the shared pool (``cpuConfig.sharedPool``): the node state
machine pins such a container to its claim's CPUs plus the pool, and moves it with the pool as
the shared containers move (in the replies of container events and in unsolicited updates)."""

from __future__ import annotations

from dracpu.core.commands import (
    AdoptClaims,
    AdoptedClaim,
    ClaimEnv,
    Command,
    Container,
    CreateContainer,
    DeviceResult,
    InvalidateContainers,
    PrepareClaim,
    StopContainer,
    Synchronize,
    UnprepareClaim,
)
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import (
    ContainerPinned,
    ContainerUpdate,
    Effect,
    Reply,
    UpdateContainers,
    WriteCdiSpec,
)
from dracpu.core.state import NodeState, apply, check_invariants
from dracpu.errors import DracpuError
from tests.core.state_helpers import NODE, FakeDisk, config_for, cpus, run, uid

CONFIG = config_for()  # 16 CPUs, reserved 0,8: the pool is 1-7,9-15 without claims


def _prepare(n: int, count: int, device: str, *, shared_pool: bool) -> PrepareClaim:
    result = DeviceResult("r", NODE, device, count)
    return PrepareClaim(uid(n), "ns", f"c{n}", (result,), shared_pool=shared_pool)


def _ok(state: NodeState, command: Command) -> tuple[NodeState, object, list[Effect]]:
    new, effects = apply(state, command)
    (reply,) = [e for e in effects if isinstance(e, Reply)]
    assert not isinstance(reply.value, DracpuError), reply.value
    check_invariants(new, state)
    return new, reply.value, effects


def _container(state: NodeState, cid: str, *claims: int) -> Container:
    env = tuple(ClaimEnv(uid(n), state.claims[uid(n)].cpus) for n in claims)
    return Container(cid, f"pod-{cid}", "ns", f"pod-{cid}", "app", env)


def _pinned(value: object) -> ContainerPinned:
    assert isinstance(value, ContainerPinned)
    return value


def test_a_shared_pool_claims_container_follows_the_pool() -> None:
    state = NodeState.initial(CONFIG)
    state, _, _ = _ok(state, CreateContainer(_container(state, "s")))  # a shared container
    state, _, effects = _ok(state, _prepare(1, 2, "cpudevnuma000", shared_pool=True))
    mixed = state.claims[uid(1)]
    assert mixed.shared_pool
    assert effects[0] == WriteCdiSpec(uid(1), mixed.cpus, shared_pool=True)

    # its container: its claim's CPUs plus the pool; the shared container leaves the claim's
    state, value, _ = _ok(state, CreateContainer(_container(state, "m", 1)))
    pool = state.shared_pool
    assert pool == cpus("1-7,9-15") - mixed.cpus
    reply = _pinned(value)
    assert reply.pin.cpus == mixed.cpus | pool
    assert [(u.container_id, u.cpus) for u in reply.updates] == [("s", pool)]
    assert state.mixed == {"m"}

    # another claim (without the pool) is prepared, and its container created: the pool
    # shrinks, and the same reply moves both containers that follow it
    state, _, _ = _ok(state, _prepare(2, 2, "cpudevnuma001", shared_pool=False))
    other = state.claims[uid(2)].cpus
    state, value, _ = _ok(state, CreateContainer(_container(state, "x", 2)))
    reply = _pinned(value)
    assert reply.pin.cpus == other  # no pool for it
    smaller = pool - other
    assert state.shared_pool == smaller
    assert sorted((u.container_id, u.cpus) for u in reply.updates) == [
        ("m", mixed.cpus | smaller),
        ("s", smaller),
    ]
    assert state.containers["m"].cpus == mixed.cpus | smaller

    # the runtime takes unsolicited updates: Unprepare widens both at once, after the reply
    state, _, _ = _ok(state, StopContainer("x"))
    state, _, _ = _ok(
        state,
        Synchronize(
            tuple(r.container for r in state.containers.values()), unsolicited_updates=True
        ),
    )
    state, _, effects = _ok(state, UnprepareClaim(uid(2)))
    (widening,) = [e for e in effects if isinstance(e, UpdateContainers)]
    assert sorted((u.container_id, u.cpus) for u in widening.updates) == [
        ("m", mixed.cpus | pool),
        ("s", pool),
    ]
    assert state.containers["m"].cpus == mixed.cpus | pool


def test_synchronize_invalidate_and_stop() -> None:
    state = NodeState.initial(CONFIG)
    state, _, _ = _ok(state, _prepare(1, 2, "cpudevnuma000", shared_pool=True))
    held = state.claims[uid(1)].cpus
    container = _container(state, "m", 1)
    state, _, _ = _ok(state, Synchronize((container,), unsolicited_updates=True))
    assert state.mixed == {"m"}
    assert state.containers["m"].cpus == held | state.shared_pool
    # the runtime failed an update of it: unknown, sent again with the next reply
    seq = state.containers["m"].seq
    state, _, _ = _ok(state, InvalidateContainers((("m", seq),)))
    assert state.containers["m"].cpus == CpuSet()
    state, value, _ = _ok(state, CreateContainer(_container(state, "s")))
    assert ContainerUpdate("m", held | state.shared_pool, None, state.pin_seq) in (
        _pinned(value).updates
    )
    state, _, _ = _ok(state, StopContainer("m"))
    assert state.mixed == frozenset()
    assert "m" not in state.containers


def test_a_container_with_a_plain_and_a_shared_pool_claim_gets_both_and_the_pool() -> None:
    state = NodeState.initial(CONFIG)
    state, _, _ = _ok(state, _prepare(1, 2, "cpudevnuma000", shared_pool=True))
    state, _, _ = _ok(state, _prepare(2, 1, "cpudevnuma001", shared_pool=False))
    both = state.claims[uid(1)].cpus | state.claims[uid(2)].cpus
    state, value, _ = _ok(state, CreateContainer(_container(state, "m", 1, 2)))
    assert _pinned(value).pin.cpus == both | state.shared_pool


def test_the_pool_taken_whole_leaves_it_its_claims_cpus() -> None:
    state = NodeState.initial(config_for(reserved="0,8"))
    state, _, _ = _ok(state, _prepare(1, 2, "cpudevnuma000", shared_pool=True))
    state, _, _ = _ok(state, CreateContainer(_container(state, "m", 1)))
    held = state.claims[uid(1)].cpus
    # every other CPU into claims (no shared container: allowed)
    rest0 = len(CONFIG.devices["cpudevnuma000"].cpus - CONFIG.reserved) - 2
    rest1 = len(CONFIG.devices["cpudevnuma001"].cpus - CONFIG.reserved)
    state, _, _ = _ok(state, _prepare(2, rest0, "cpudevnuma000", shared_pool=False))
    state, _, _ = _ok(state, _prepare(3, rest1, "cpudevnuma001", shared_pool=False))
    assert state.shared_pool == CpuSet()
    state, value, _ = _ok(state, CreateContainer(_container(state, "x", 2)))
    assert ContainerUpdate("m", held, None, state.pin_seq) in _pinned(value).updates


def test_adoption_and_restart_keep_the_shared_pool() -> None:
    state = NodeState.initial(CONFIG)
    state, _, _ = _ok(state, AdoptClaims((AdoptedClaim(uid(1), cpus("2-3"), True),)))
    assert state.claims[uid(1)].shared_pool
    disk = FakeDisk()
    state, _ = run(state, _prepare(2, 2, "cpudevnuma001", shared_pool=True), disk)
    assert disk.claims()[uid(2)].shared_pool  # in the checkpoint
    # a re-Prepare of the adopted claim: its config (from the allocation) is known now
    state, _, effects = _ok(state, _prepare(1, 2, "cpudevnuma000", shared_pool=False))
    assert not state.claims[uid(1)].shared_pool
    assert effects[0] == WriteCdiSpec(uid(1), cpus("2-3"), shared_pool=False)
