"""The state owner against a small hand-written state machine (no NodeState needed).

The fake state is the tuple of the items of the commands committed so far; a command carries
the exact effects its ``apply`` returns, so each test spells out the effect list it exercises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import pytest
from anyio import wait_all_tasks_blocked
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu.core.effects import Reply
from dracpu.errors import AllocationError, DracpuError
from dracpu.tasks import state_owner
from dracpu.tasks.state_owner import (
    PendingReply,
    Request,
    StateOwner,
    create_request_stream,
    request,
)

pytestmark = pytest.mark.anyio

State = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Write:
    """Succeeds; the executor records its name."""

    name: str


@dataclass(frozen=True, slots=True)
class Fail:
    """Raises DracpuError (after the executor recorded the attempt)."""

    name: str


@dataclass(frozen=True, slots=True)
class Block:
    """Waits for ``gate``, then succeeds."""

    name: str
    gate: anyio.Event = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Bug:
    """Raises a non-DracpuError: a bug in an executor."""

    name: str


Action = Write | Fail | Block | Bug
Effect = Action | Reply  # what apply returns; the owner never passes a Reply to the executor


@dataclass(frozen=True, slots=True)
class Do:
    """Commit ``item`` with these effects."""

    item: str
    effects: tuple[Effect, ...] = ()

    @classmethod
    def replying(cls, item: str, *before: Action) -> Do:
        return cls(item, (*before, Reply(item)))


@dataclass(frozen=True, slots=True)
class Explode:
    """``apply`` raises ValueError (a bug)."""


@dataclass(frozen=True, slots=True)
class Refuse:
    """``apply`` raises DracpuError."""


Command = Do | Explode | Refuse


def apply(state: State, command: Command) -> tuple[State, Sequence[Effect]]:
    match command:
        case Do(item, effects):
            return (*state, item), effects
        case Explode():
            raise ValueError("boom")
        case Refuse():
            raise DracpuError("refused")


class Executor:
    def __init__(self) -> None:
        self.executed: list[str] = []
        self.batches: list[list[str]] = []  # the effects of each execute_batch call

    async def batch(self, effects: Sequence[Effect], started: list[Effect]) -> None:
        """``execute_batch``: each effect in order, marked as begun first."""
        self.batches.append([e.name for e in effects if not isinstance(e, Reply)])
        for effect in effects:
            started.append(effect)
            await self(effect)

    async def __call__(self, effect: Effect) -> None:
        assert not isinstance(effect, Reply)
        self.executed.append(effect.name)
        match effect:
            case Write():
                pass
            case Fail(name):
                raise DracpuError(f"{name} failed")
            case Block(gate=gate):
                await gate.wait()
            case Bug(name):
                raise RuntimeError(name)


def rollback(old: State, started: Sequence[Effect], error: DracpuError) -> list[Effect]:
    undo = [Write(f"undo-{e.name}") for e in reversed(started) if not isinstance(e, Reply)]
    return [*undo, Reply(error)]


def follow_up(effect: Effect, error: DracpuError) -> Command | None:
    return Do(f"after-{effect.name}") if isinstance(effect, Fail) else None


Streams = tuple[
    MemoryObjectSendStream[Request[Command]], MemoryObjectReceiveStream[Request[Command]]
]


def _owner(
    *,
    with_hooks: bool = True,
    deadline: float = state_owner.COMMAND_DEADLINE,
    batching: bool = False,
) -> tuple[StateOwner[State, Command, Effect], MemoryObjectSendStream[Request[Command]], Executor]:
    streams: Streams = create_request_stream()
    send, receive = streams
    executor = Executor()
    owner: StateOwner[State, Command, Effect] = StateOwner(
        receive,
        (),
        apply,
        executor,
        rollback=rollback if with_hooks else None,
        follow_up=follow_up if with_hooks else None,
        command_deadline=deadline,
        execute_batch=executor.batch if batching else None,
    )
    return owner, send, executor


def _committed(owner: StateOwner[State, Command, Effect]) -> State:
    return owner.state  # a call: mypy would narrow `owner.state` after the first assert


async def test_effects_run_in_order_and_the_reply_commits() -> None:
    owner, send, executor = _owner()
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        command = Do("a", (Write("cdi"), Write("checkpoint"), Reply("done"), Write("widen")))
        assert await request(send, command) == "done"
        await wait_all_tasks_blocked()
        assert executor.executed == ["cdi", "checkpoint", "widen"]
        assert owner.state == ("a",)
        stats = owner.statistics()
        assert (stats.commands_applied, stats.commands_failed, stats.effects_failed) == (1, 0, 0)
        assert dict(stats.by_command) == {("Do", "ok"): 1}
        tg.cancel_scope.cancel()


async def test_an_error_reply_commits_and_is_raised_to_the_requester() -> None:
    owner, send, _ = _owner()
    error = AllocationError("only 2 cpus free")
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        with pytest.raises(AllocationError) as info:
            await request(send, Do("b", (Reply(error),)))
        assert info.value is error
        assert owner.state == ("b",)
        assert dict(owner.statistics().by_command) == {("Do", "error"): 1}
        tg.cancel_scope.cancel()


async def test_a_commit_phase_failure_keeps_the_old_state_and_rolls_back() -> None:
    owner, send, executor = _owner()
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        assert await request(send, Do.replying("a")) == "a"
        failing = Do("b", (Write("cdi-b"), Fail("ckpt-b"), Write("never"), Reply("never")))
        with pytest.raises(DracpuError, match=r"^ckpt-b failed$"):
            await request(send, failing)
        assert owner.state == ("a",)
        assert executor.executed == ["cdi-b", "ckpt-b", "undo-ckpt-b", "undo-cdi-b"]
        stats = owner.statistics()
        assert (stats.commands_applied, stats.commands_failed, stats.effects_failed) == (1, 1, 1)
        assert stats.by_command[("Do", "failed")] == 1
        assert await request(send, Do.replying("c")) == "c"  # the owner goes on
        assert _committed(owner) == ("a", "c")
        tg.cancel_scope.cancel()


async def test_without_a_rollback_hook_the_error_is_answered() -> None:
    owner, send, executor = _owner(with_hooks=False)
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        with pytest.raises(DracpuError, match=r"^cdi failed$"):
            await request(send, Do("a", (Fail("cdi"), Reply("never"))))
        assert owner.state == ()
        assert executor.executed == ["cdi"]
        tg.cancel_scope.cancel()


async def test_a_dracpu_error_from_apply_is_answered_and_the_state_kept() -> None:
    owner, send, _ = _owner()
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        with pytest.raises(DracpuError, match=r"^refused$"):
            await request(send, Refuse())
        assert owner.state == ()
        assert dict(owner.statistics().by_command) == {("Refuse", "failed"): 1}
        tg.cancel_scope.cancel()


async def test_a_post_commit_failure_keeps_the_new_state_and_applies_the_follow_up() -> None:
    owner, send, executor = _owner()
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        assert await request(send, Do("b", (Write("ckpt"), Reply("ok"), Fail("widen")))) == "ok"
        assert await request(send, Do.replying("c")) == "c"
        # The follow-up was applied right after "b", before the next request.
        assert owner.state == ("b", "after-widen", "c")
        assert executor.executed == ["ckpt", "widen"]
        stats = owner.statistics()
        assert (stats.commands_applied, stats.commands_failed, stats.effects_failed) == (3, 0, 1)
        tg.cancel_scope.cancel()


async def test_a_command_without_a_reply_is_answered_none_after_its_effects() -> None:
    owner, send, executor = _owner()
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        assert await request(send, Do("a", (Write("x"),))) is None
        assert executor.executed == ["x"]
        assert owner.state == ("a",)
        tg.cancel_scope.cancel()


async def test_a_cancelled_requester_never_crashes_the_owner() -> None:
    owner, send, executor = _owner()
    gate = anyio.Event()
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        requester = anyio.CancelScope()

        async def ask() -> None:
            with requester:
                await request(send, Do.replying("slow", Block("cdi", gate)))

        tg.start_soon(ask)
        await wait_all_tasks_blocked()
        assert executor.executed == ["cdi"]  # the owner is inside the slow effect
        requester.cancel()
        await wait_all_tasks_blocked()
        assert requester.cancelled_caught
        gate.set()
        assert await request(send, Do.replying("next")) == "next"
        assert owner.state == ("slow", "next")  # the cancelled command was still applied
        tg.cancel_scope.cancel()


async def test_a_hung_effect_is_cut_off_by_the_command_deadline() -> None:
    owner, send, executor = _owner(deadline=0.2)
    never = anyio.Event()
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        with pytest.raises(DracpuError, match=r"^Block did not finish within 0.2 s$"):
            await request(send, Do.replying("a", Write("cdi"), Block("nri", never)))
        assert owner.state == ()
        assert executor.executed == ["cdi", "nri", "undo-nri", "undo-cdi"]
        assert await request(send, Do.replying("b")) == "b"
        tg.cancel_scope.cancel()


async def test_a_stopping_owner_finishes_the_command_in_flight() -> None:
    owner, send, executor = _owner()
    gate = anyio.Event()
    answers: list[object] = []
    owner_scope = anyio.CancelScope()

    async def run_owner() -> None:
        with owner_scope:
            await owner.run()

    async def ask() -> None:
        answers.append(await request(send, Do.replying("a", Block("ckpt", gate))))

    async with send, anyio.create_task_group() as tg:
        tg.start_soon(run_owner)
        tg.start_soon(ask)
        await wait_all_tasks_blocked()
        owner_scope.cancel()  # the stop arrives while the effect runs
        await wait_all_tasks_blocked()
        assert answers == []
        gate.set()
    assert answers == ["a"]
    assert owner.state == ("a",)
    assert executor.executed == ["ckpt"]


async def test_a_bug_in_apply_is_answered_then_ends_the_owner() -> None:
    owner, send, _ = _owner()
    reply_send, reply_receive = anyio.create_memory_object_stream[object](1)
    with reply_receive:
        async with send:
            await send.send(Request(Explode(), reply_send))
            with pytest.raises(ExceptionGroup) as info:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(owner.run)
        assert info.group_contains(ValueError, match="^boom$")
        answer = reply_receive.receive_nowait()
    assert isinstance(answer, DracpuError)
    assert str(answer) == "Explode: internal error: ValueError('boom')"


async def test_a_bug_in_an_effect_is_answered_then_ends_the_owner() -> None:
    owner, send, _ = _owner()
    reply_send, reply_receive = anyio.create_memory_object_stream[object](1)
    with reply_receive:
        async with send:
            await send.send(Request(Do.replying("a", Bug("cdi")), reply_send))
            with pytest.raises(ExceptionGroup) as info:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(owner.run)
        assert info.group_contains(RuntimeError, match="^cdi$")
        answer = reply_receive.receive_nowait()
    assert isinstance(answer, DracpuError)
    assert str(answer) == "Do: internal error in Bug: RuntimeError('cdi')"
    assert owner.state == ()


async def test_requests_still_queued_when_the_owner_stops_are_refused() -> None:
    owner, send, _ = _owner()
    replies = [anyio.create_memory_object_stream[object](1) for _ in range(2)]
    async with send:
        for reply_send, _ in replies:
            await send.send(Request(Do.replying("never"), reply_send))
        with anyio.CancelScope() as scope:
            scope.cancel()
            await owner.run()
    for _, reply_receive in replies:
        with reply_receive:
            answer = reply_receive.receive_nowait()
        assert isinstance(answer, DracpuError)
        assert str(answer) == "the state owner stopped before handling Do"
    assert owner.state == ()


async def test_request_when_the_owner_is_not_running() -> None:
    streams: Streams = create_request_stream()
    send, receive = streams
    receive.close()
    async with send:
        with pytest.raises(DracpuError, match="cannot send Do: the state owner is not running"):
            await request(send, Do.replying("a"))


async def test_request_when_the_owner_ends_without_answering() -> None:
    streams: Streams = create_request_stream()
    send, receive = streams

    async def drop_one() -> None:
        async with receive:
            req = await receive.receive()
            req.reply.close()  # a misbehaving owner: no answer

    async with send, anyio.create_task_group() as tg:
        tg.start_soon(drop_one)
        with pytest.raises(DracpuError, match="the state owner stopped before answering Do"):
            await request(send, Do.replying("a"))


async def test_a_request_is_handled_after_its_last_effect_and_before_the_next_request() -> None:
    """PendingReply.handled, the NRI plugin's ordering guard: false while the owner runs the
    request's effects (commit phase and post-commit), true before the owner takes the next one."""
    streams: Streams = create_request_stream()
    send, receive = streams
    first, second = PendingReply(), PendingReply()
    seen: list[tuple[str, bool, bool]] = []

    async def execute(effect: Effect) -> None:
        assert not isinstance(effect, Reply)
        seen.append((effect.name, first.handled, second.handled))

    owner: StateOwner[State, Command, Effect] = StateOwner(receive, (), apply, execute)
    answers: list[object] = []

    async def ask(command: Command, pending: PendingReply) -> None:
        answers.append(await request(send, command, reply=pending))

    assert not first.handled
    async with send, anyio.create_task_group() as tg:
        tg.start_soon(ask, Do("a", (Write("a-before"), Reply("a"), Write("a-after"))), first)
        await wait_all_tasks_blocked()
        tg.start_soon(ask, Do("b", (Write("b-before"), Reply("b"), Write("b-after"))), second)
        await wait_all_tasks_blocked()
        assert not first.handled  # queued, not yet taken
        await tg.start(owner.run)
        await wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert answers == ["a", "b"]
    assert seen == [
        ("a-before", False, False),
        ("a-after", False, False),  # answered, but the owner is not done with it yet
        ("b-before", True, False),
        ("b-after", True, False),
    ]
    assert all(p.handled for p in (first, second))


async def test_a_request_that_cannot_be_sent_is_handled() -> None:
    streams: Streams = create_request_stream()
    send, receive = streams
    receive.close()
    pending = PendingReply()
    async with send:
        with pytest.raises(DracpuError, match="the state owner is not running"):
            await request(send, Do.replying("a"), reply=pending)
    assert pending.handled


async def test_the_command_stream_is_bounded_and_its_depth_reported() -> None:
    streams: Streams = create_request_stream(max_buffer_size=2)
    send, receive = streams
    gate = anyio.Event()
    owner: StateOwner[State, Command, Effect] = StateOwner(receive, (), apply, Executor())
    answers: list[object] = []
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)

        async def ask(item: str, *effects: Action) -> None:
            answers.append(await request(send, Do.replying(item, *effects)))

        tg.start_soon(ask, "slow", Block("x", gate))
        await wait_all_tasks_blocked()
        for item in ("q1", "q2", "q3"):
            tg.start_soon(ask, item)
        await wait_all_tasks_blocked()
        assert owner.statistics().queue_depth == 2  # the third sender waits for room
        gate.set()
        await wait_all_tasks_blocked()
        assert sorted(map(str, answers)) == ["q1", "q2", "q3", "slow"]
        assert owner.statistics().queue_depth == 0
        tg.cancel_scope.cancel()


async def test_run_serves_until_every_sender_is_closed() -> None:
    streams: Streams = create_request_stream()
    send, receive = streams
    executor = Executor()
    owner: StateOwner[State, Command, Effect] = StateOwner(receive, (), apply, executor)
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        async with send:
            assert await request(send, Do.replying("a", Write("w"))) == "a"
        # every send side closed: the owner's loop ends and run() returns by itself
    assert executor.executed == ["w"]


# --- the commit phase in one execute_batch call --------------------------------------------------


async def test_a_batch_runs_the_commit_phase_in_one_call_then_the_rest_one_by_one() -> None:
    owner, send, executor = _owner(batching=True)
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        command = Do("a", (Write("cdi"), Write("checkpoint"), Reply("done"), Write("widen")))
        assert await request(send, command) == "done"
        await wait_all_tasks_blocked()
        assert executor.batches == [["cdi", "checkpoint"]]  # the post-commit effect is not in it
        assert executor.executed == ["cdi", "checkpoint", "widen"]
        assert owner.state == ("a",)
        # A command with nothing before its Reply makes no batch call; one without a Reply
        # batches all its effects and is answered None after them.
        assert await request(send, Do.replying("b")) == "b"
        assert await request(send, Do("c", (Write("x"), Write("y")))) is None
        assert executor.batches == [["cdi", "checkpoint"], ["x", "y"]]
        assert _committed(owner) == ("a", "b", "c")
        stats = owner.statistics()
        assert (stats.commands_applied, stats.commands_failed, stats.effects_failed) == (3, 0, 0)
        tg.cancel_scope.cancel()


async def test_a_failed_batch_rolls_back_exactly_the_effects_it_began() -> None:
    owner, send, executor = _owner(batching=True)
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        assert await request(send, Do.replying("a")) == "a"
        failing = Do("b", (Write("cdi-b"), Fail("ckpt-b"), Write("never"), Reply("never")))
        with pytest.raises(DracpuError, match=r"^ckpt-b failed$"):
            await request(send, failing)
        assert owner.state == ("a",)
        # "never" did not begin, so it is neither run nor undone; the rollback runs one by one.
        assert executor.executed == ["cdi-b", "ckpt-b", "undo-ckpt-b", "undo-cdi-b"]
        assert executor.batches == [["cdi-b", "ckpt-b", "never"]]
        stats = owner.statistics()
        assert (stats.commands_applied, stats.commands_failed, stats.effects_failed) == (1, 1, 1)
        assert await request(send, Do.replying("c", Write("w"))) == "c"  # the owner goes on
        assert _committed(owner) == ("a", "c")
        tg.cancel_scope.cancel()


async def test_a_batch_cut_off_by_the_deadline_rolls_back_what_began() -> None:
    owner, send, executor = _owner(deadline=0.2, batching=True)
    never = anyio.Event()
    async with send, anyio.create_task_group() as tg:
        await tg.start(owner.run)
        command = Do.replying("a", Write("cdi"), Block("ckpt", never), Write("later"))
        with pytest.raises(DracpuError, match=r"^Block did not finish within 0.2 s$"):
            await request(send, command)
        assert owner.state == ()
        assert executor.executed == ["cdi", "ckpt", "undo-ckpt", "undo-cdi"]
        assert owner.statistics().effects_failed == 1
        assert await request(send, Do.replying("b")) == "b"
        tg.cancel_scope.cancel()


async def test_a_bug_in_a_batch_is_answered_then_ends_the_owner() -> None:
    owner, send, _ = _owner(batching=True)
    reply_send, reply_receive = anyio.create_memory_object_stream[object](1)
    with reply_receive:
        async with send:
            await send.send(Request(Do.replying("a", Write("cdi"), Bug("ckpt")), reply_send))
            with pytest.raises(ExceptionGroup) as info:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(owner.run)
        assert info.group_contains(RuntimeError, match="^ckpt$")
        answer = reply_receive.receive_nowait()
    assert isinstance(answer, DracpuError)
    assert str(answer) == "Do: internal error in Bug: RuntimeError('ckpt')"
    assert owner.state == ()
