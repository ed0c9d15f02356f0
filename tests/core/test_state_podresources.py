"""Pod-resources reconciliation in the node state: which prepared claims are orphans, when they
are released, and that a claim the kubelet references or a container carries never is.

The rules (``dracpu.core.commands.PodsListed``): a claim no listed pod references and no known
container carries is released once it has been missing from every listing since one taken at
least the grace earlier; a claim known only from its CDI spec (adopted) at the first listing that
misses it; never while the runtime's containers are unknown, never by a listing that cannot show
claims.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dracpu.core.checkpoint_schema import CheckpointData
from dracpu.core.commands import (
    AdoptClaims,
    AdoptedClaim,
    ClaimEnv,
    Command,
    Container,
    CreateContainer,
    PodsListed,
    PrepareClaim,
    RuntimeDisconnected,
    StopContainer,
    Synchronize,
    UnprepareClaim,
)
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import (
    DeleteCdiSpec,
    DeleteDeviceMetadata,
    PodsReconciled,
    ReleasedClaim,
    Reply,
    UpdateContainers,
    WriteCheckpoint,
)
from dracpu.core.state import NodeState, apply, check_invariants
from dracpu.errors import DracpuError
from tests.core.state_helpers import cpus, uid
from tests.core.test_state import (
    INDIVIDUAL,
    claim_container,
    individual,
    ok,
    shared_container,
)

GRACE = 300.0  # the default --orphan-grace, 5m


def listed(*claims: int, at: float, grace: float = GRACE, **kw: object) -> PodsListed:
    return PodsListed(
        frozenset(uid(n) for n in claims),
        at=at,
        grace=grace,
        **kw,  # type: ignore[arg-type]
    )


def reconciled(value: object) -> PodsReconciled:
    assert isinstance(value, PodsReconciled), value
    return value


def released(value: object) -> list[str]:
    return [r.claim_uid for r in reconciled(value).released]


def two_claims() -> NodeState:
    """Claims 1 (cpu 4) and 2 (cpu 5) prepared; the runtime synchronized, with no container."""
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    state, _, _ = ok(state, individual(INDIVIDUAL, 2, [5]))
    state, _, _ = ok(state, Synchronize(()))
    return state


# --- unit cases ----------------------------------------------------------------------------------


def test_an_orphan_is_released_by_the_first_listing_a_grace_after_the_first_miss() -> None:
    state = two_claims()
    state, value, effects = ok(state, listed(2, at=1000.0))
    assert value == PodsReconciled((), (uid(1),), True)
    assert effects == [Reply(value)]
    state, value, _ = ok(state, listed(2, at=1000.0 + GRACE - 0.001))
    assert value == PodsReconciled((), (uid(1),), True)
    assert dict(state.unlisted) == {uid(1): 1000.0}  # the run of misses began at the first

    state, value, effects = ok(state, listed(2, at=1000.0 + GRACE))
    gone = ReleasedClaim(uid(1), cpus("4"), "ns", "claim-1", False, 1000.0)
    assert value == PodsReconciled((gone,), (), True)
    assert effects == [
        DeleteCdiSpec(uid(1)),
        DeleteDeviceMetadata(uid(1), ("r0",)),  # what Unprepare removes (release_files)
        WriteCheckpoint(CheckpointData(state.claims)),
        Reply(value),
    ]
    assert set(state.claims) == {uid(2)}
    assert state.claimed == cpus("5")
    assert dict(state.unlisted) == {}


def test_effects_end_with_the_reply_and_widen_the_shared_containers() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, Synchronize((shared_container(1),), unsolicited_updates=True))
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    state, _, _ = ok(state, CreateContainer(shared_container(2)))  # narrowed to the pool
    narrow = state.containers["shared-2"].cpus
    assert 4 not in narrow
    state, _, _ = ok(state, listed(at=0.0))
    state, value, effects = ok(state, listed(at=GRACE))
    assert released(value) == [uid(1)]
    assert isinstance(effects[-2], Reply)
    widen = effects[-1]
    assert isinstance(widen, UpdateContainers)
    assert {u.container_id for u in widen.updates} == {"shared-1", "shared-2"}
    assert all(u.cpus == state.shared_pool and 4 in u.cpus for u in widen.updates)


def test_a_listing_that_references_the_claim_starts_its_grace_again() -> None:
    state = two_claims()
    state, _, _ = ok(state, listed(2, at=0.0))
    state, _, _ = ok(state, listed(1, 2, at=200.0))  # back: the pod still has it
    assert dict(state.unlisted) == {}
    state, value, _ = ok(state, listed(2, at=400.0))  # 400 s after the first miss: a new run
    assert released(value) == []
    state, value, _ = ok(state, listed(2, at=699.0))
    assert released(value) == []
    state, value, _ = ok(state, listed(2, at=700.0))
    assert released(value) == [uid(1)]


def test_a_claim_a_container_carries_is_kept_whatever_the_listings_say() -> None:
    state = two_claims()
    state, _, _ = ok(state, CreateContainer(claim_container(state, 1, 1)))
    for at in (0.0, GRACE, 10 * GRACE):
        state, value, _ = ok(state, listed(2, at=at))
        assert value == PodsReconciled((), (), True)
    # The container stops: the claim's first miss is the next listing.
    state, _, _ = ok(state, StopContainer("excl-1"))
    state, value, _ = ok(state, listed(2, at=11 * GRACE))
    assert value == PodsReconciled((), (uid(1),), True)
    state, value, _ = ok(state, listed(2, at=12 * GRACE))
    assert released(value) == [uid(1)]


def test_a_container_refused_at_synchronize_still_keeps_the_claim_its_env_names() -> None:
    # Its env names claim 1 with other CPUs: it is confined to the shared pool, but the claim
    # it names is not released under it (the rule: no running container carries the env).
    state = two_claims()
    copy = Container("copy", "pod-x", "ns", "pod-x", "app", (ClaimEnv(uid(1), cpus("9")),))
    state, value, _ = ok(state, Synchronize((copy,)))
    assert state.containers["copy"].claims == ()
    state, _, _ = ok(state, listed(2, at=0.0))
    state, value, _ = ok(state, listed(2, at=GRACE))
    assert value == PodsReconciled((), (), True)


def test_an_adopted_claim_goes_at_the_first_listing_after_synchronize() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, individual(INDIVIDUAL, 2, [5]))
    state, _, _ = ok(state, AdoptClaims((AdoptedClaim(uid(1), cpus("6-7")),)))
    # Before the runtime has told us its containers: kept, whatever the listing says.
    state, value, _ = ok(state, listed(2, at=10.0))
    assert value == PodsReconciled((), (uid(1),), True)
    state, _, _ = ok(state, Synchronize((shared_container(1),)))
    state, value, effects = ok(state, listed(2, at=11.0))  # long before any grace
    gone = ReleasedClaim(uid(1), cpus("6-7"), "", "", True, 10.0)
    assert value == PodsReconciled((gone,), (), True)
    assert DeleteCdiSpec(uid(1)) in effects
    assert state.shared_pool >= cpus("6-7")


def test_an_adopted_claim_the_kubelet_prepares_again_needs_the_grace() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, Synchronize(()))
    state, _, _ = ok(state, AdoptClaims((AdoptedClaim(uid(1), cpus("4")),)))
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))  # the kubelet's Prepare: results
    state, value, _ = ok(state, listed(at=0.0))
    assert released(value) == []
    state, value, _ = ok(state, listed(at=GRACE))
    assert released(value) == [uid(1)]


def test_a_prepare_forgets_the_claims_miss() -> None:
    state = two_claims()
    state, _, _ = ok(state, listed(2, at=0.0))
    assert uid(1) in state.unlisted
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))  # idempotent re-prepare
    assert dict(state.unlisted) == {}
    state, value, _ = ok(state, listed(2, at=GRACE))
    assert released(value) == []


def test_unprepare_drops_the_claims_miss() -> None:
    state = two_claims()
    state, _, _ = ok(state, listed(at=0.0))
    state, _, _ = ok(state, UnprepareClaim(uid(1)))
    assert dict(state.unlisted) == {uid(2): 0.0}


def test_nothing_goes_while_the_runtime_is_away() -> None:
    state = two_claims()
    state, _, _ = ok(state, listed(2, at=0.0))
    state, _, _ = ok(state, RuntimeDisconnected())
    assert not state.containers_known
    state, value, effects = ok(state, listed(2, at=2 * GRACE))
    assert value == PodsReconciled((), (uid(1),), True)
    assert effects == [Reply(value)]
    assert dict(state.unlisted) == {uid(1): 0.0}  # the miss is kept
    state, _, _ = ok(state, Synchronize(()))  # back, with no container using it
    state, value, _ = ok(state, listed(2, at=2 * GRACE + 1))
    assert released(value) == [uid(1)]


def test_nothing_goes_before_the_first_synchronize() -> None:
    state = NodeState.initial(INDIVIDUAL)
    state, _, _ = ok(state, individual(INDIVIDUAL, 1, [4]))
    for at in (0.0, GRACE, 2 * GRACE):
        state, value, _ = ok(state, listed(at=at))
        assert released(value) == []
    assert uid(1) in state.claims


def test_a_listing_that_cannot_show_claims_releases_nothing_and_forgets_the_misses() -> None:
    state = two_claims()
    state, _, _ = ok(state, AdoptClaims((AdoptedClaim(uid(3), cpus("6")),)))
    state, _, _ = ok(state, listed(at=0.0, reports_claims=False))
    assert uid(3) in state.claims  # not even the adopted claim
    state, value, _ = ok(state, listed(at=GRACE, reports_claims=False))
    assert value == PodsReconciled((), (), False)
    assert set(state.claims) == {uid(1), uid(2), uid(3)}
    state, _, _ = ok(state, listed(2, at=2 * GRACE))  # a miss, then forgotten again
    assert set(state.unlisted) == {uid(1)}
    state, _, _ = ok(state, listed(2, at=3 * GRACE, reports_claims=False))
    assert dict(state.unlisted) == {}
    state, value, _ = ok(state, listed(2, at=4 * GRACE))
    assert released(value) == []


def test_on_a_quiet_node_an_authoritative_empty_answer_releases_after_the_grace() -> None:
    """An answer without any claim reference, from a kubelet whose gate is on by default: no
    pod holds a claim. Prepared and adopted claims alike go after the grace (two listings)."""
    state = two_claims()
    state, _, _ = ok(state, AdoptClaims((AdoptedClaim(uid(3), cpus("6")),)))

    def quiet(at: float) -> PodsListed:
        return listed(at=at, reports_claims=False, authoritative=True)

    state, value, _ = ok(state, quiet(0.0))
    assert value == PodsReconciled((), (uid(1), uid(2), uid(3)), True)
    state, value, _ = ok(state, quiet(GRACE - 1))
    assert released(value) == []
    state, value, _ = ok(state, quiet(GRACE))
    assert released(value) == [uid(1), uid(2), uid(3)]
    assert [r.adopted for r in reconciled(value).released] == [False, False, True]
    assert not any(r.by_pods for r in reconciled(value).released)
    assert state.claims == {}


def test_a_claim_whose_pods_are_all_gone_is_an_orphan_whatever_the_gate() -> None:
    """Pods are listed whatever the kubelet's gates: a claim whose recorded pods are all absent
    is missed even by an answer that cannot show claims; one whose pod is listed is kept (even
    when the answer shows claims and not this one); one without known pod names cannot be
    judged by such an answer."""
    state = NodeState.initial(INDIVIDUAL)
    for n, pod in ((1, "web-0"), (2, "web-1")):
        command = individual(INDIVIDUAL, n, [3 + n])
        state, _, _ = ok(
            state, replace(command, pod_uids=frozenset({f"u{n}"}), pod_names=frozenset({pod}))
        )
    state, _, _ = ok(state, individual(INDIVIDUAL, 3, [6]))  # an earlier build: no pods known
    state, _, _ = ok(state, Synchronize(()))
    web1 = frozenset({("ns", "web-1")})
    state, value, _ = ok(state, listed(at=0.0, reports_claims=False, pods=web1))
    assert value == PodsReconciled((), (uid(1),), False)
    state, value, _ = ok(state, listed(at=GRACE, reports_claims=False, pods=web1))
    assert released(value) == [uid(1)]
    assert reconciled(value).released[0].by_pods
    # web-1 is listed: claim 2 stays, even when the answer shows claims but not this one.
    state, value, _ = ok(state, listed(at=2 * GRACE, pods=web1))
    assert value == PodsReconciled((), (uid(3),), True)
    state, value, _ = ok(state, listed(at=3 * GRACE, pods=web1))
    assert released(value) == [uid(3)]
    assert set(state.claims) == {uid(2)}


def test_claims_listed_by_name_only() -> None:
    state = two_claims()
    state, _, _ = ok(state, AdoptClaims((AdoptedClaim(uid(3), cpus("6")),)))
    names = frozenset({("ns", "claim-1")})
    state, value, _ = ok(state, listed(at=0.0, names_in_use=names))
    # claim-1 by its name; the adopted claim has no name, so it may be the one listed.
    assert value == PodsReconciled((), (uid(2),), True)
    state, value, _ = ok(state, listed(at=GRACE, names_in_use=frozenset({("ns", "other")})))
    assert released(value) == [uid(2)]
    assert set(state.claims) == {uid(1), uid(3)}
    state, value, _ = ok(state, listed(at=GRACE + 1))  # no name listed: the adopted one goes
    assert released(value) == [uid(3)]


def test_grace_zero_still_needs_two_listings() -> None:
    state = two_claims()
    state, value, _ = ok(state, listed(2, at=5.0, grace=0.0))
    assert released(value) == []
    state, value, _ = ok(state, listed(2, at=5.0, grace=0.0))
    assert released(value) == [uid(1)]


def test_a_release_has_the_effects_of_unprepare() -> None:
    """A release is an ordinary commit phase: the old state is kept when it fails (the
    rollback tests of test_state.py run it); here: its effects are those of Unprepare."""
    state = two_claims()
    state, _, _ = ok(state, listed(at=0.0))
    _, effects = apply(state, listed(at=GRACE))
    assert [type(e).__name__ for e in effects] == [
        "DeleteCdiSpec",
        "DeleteDeviceMetadata",
        "DeleteCdiSpec",
        "DeleteDeviceMetadata",
        "WriteCheckpoint",
        "Reply",
    ]


# --- properties ----------------------------------------------------------------------------------

UIDS = 5


@dataclass
class Model:
    """Each claim's current run of misses: (time, number) of the listing that began it."""

    runs: dict[str, tuple[float, int]] = field(default_factory=dict)
    clock: float = 0.0
    listings: int = 0


def draw_command(data: st.DataObject, state: NodeState, model: Model, grace: float) -> Command:
    kind = data.draw(
        st.sampled_from(
            ["prepare", "adopt", "unprepare", "start", "stop", "sync", "gone", "list", "list"]
        ),
        label="command",
    )
    n = data.draw(st.integers(0, UIDS - 1), label="claim")
    match kind:
        case "prepare":
            command = individual(INDIVIDUAL, n, [2 + n])
            if data.draw(st.booleans(), label="pods known"):  # by name too: its pod is p<n>
                command = replace(
                    command, pod_uids=frozenset({f"uid-{n}"}), pod_names=frozenset({f"p{n}"})
                )
            return command
        case "adopt":
            return AdoptClaims((AdoptedClaim(uid(n), CpuSet([9 + n])),))
        case "unprepare":
            return UnprepareClaim(uid(n))
        case "start":
            claim = state.claims.get(uid(n))
            env = () if claim is None else (ClaimEnv(uid(n), claim.cpus),)
            return CreateContainer(Container(f"c{n}", f"p{n}", "ns", f"p{n}", "app", env))
        case "stop":
            return StopContainer(f"c{n}")
        case "sync":
            return Synchronize(tuple(r.container for r in state.containers.values()))
        case "gone":
            return RuntimeDisconnected()
        case _:
            model.clock += data.draw(st.sampled_from([0.0, 1.0, grace / 2, grace, 2 * grace]))
            in_use = data.draw(st.sets(st.integers(0, UIDS - 1)), label="referenced")
            names = data.draw(st.sets(st.integers(0, UIDS + 1), max_size=2), label="names")
            pods = data.draw(st.sets(st.integers(0, UIDS - 1)), label="pods listed")
            return PodsListed(
                frozenset(uid(i) for i in in_use),
                frozenset(("ns", f"claim-{i}") for i in names),
                reports_claims=data.draw(st.integers(0, 5), label="reports") > 0,
                at=model.clock,
                grace=grace,
                pods=frozenset(("ns", f"p{i}") for i in pods),
                authoritative=data.draw(st.booleans(), label="authoritative"),
            )


def carried_by_containers(state: NodeState) -> set[str]:
    return {e.claim_uid for r in state.containers.values() for e in r.container.claims}


def expected_release(state: NodeState, command: PodsListed, model: Model) -> set[str]:
    """What the rules say this listing releases; the model's runs follow the listing."""
    model.listings += 1
    trusted = command.reports_claims or command.authoritative
    carried = carried_by_containers(state)
    release: set[str] = set()
    for key, claim in state.claims.items():
        by_name = bool(command.names_in_use) and (
            not claim.name or (claim.namespace, claim.name) in command.names_in_use
        )
        pod_listed = any((claim.namespace, p) in command.pods for p in claim.pod_names)
        if key in command.claims_in_use or key in carried or by_name or pod_listed:
            model.runs.pop(key, None)
            continue
        if not trusted and not claim.pod_names:
            model.runs.pop(key, None)
            continue
        began, number = model.runs.setdefault(key, (command.at, model.listings))
        adopted = not claim.results
        ripe = (adopted and command.reports_claims) or (
            number < model.listings and command.at - began >= command.grace
        )
        if ripe and state.containers_known:
            release.add(key)
    return release


@pytest.mark.parametrize("grace", [0.0, 5.0, GRACE])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_histories_release_exactly_the_orphans_the_rules_name(
    grace: float, data: st.DataObject
) -> None:
    state = NodeState.initial(INDIVIDUAL)
    model = Model()
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        command = draw_command(data, state, model, grace)
        runs_before = dict(model.runs)
        want = expected_release(state, command, model) if isinstance(command, PodsListed) else None
        new, effects = apply(state, command)
        check_invariants(new)
        replies = [e for e in effects if isinstance(e, Reply)]
        assert len(replies) == 1
        value = replies[0].value
        if isinstance(value, DracpuError):
            assert new is state
            continue
        if isinstance(command, PodsListed):
            result = reconciled(value)
            got = {r.claim_uid for r in result.released}
            # Never a referenced claim, never one a container carries, never blind.
            assert not got & command.claims_in_use
            assert not got & carried_by_containers(state)
            if got:
                assert state.containers_known
            for gone in result.released:
                claim = state.claims[gone.claim_uid]
                assert (claim.namespace, claim.name) not in command.names_in_use
                assert not {(claim.namespace, p) for p in claim.pod_names} & command.pods
                assert command.reports_claims or command.authoritative or claim.pod_names
                assert gone.adopted == (not claim.results)
                if claim.results or not command.reports_claims:  # two listings a grace apart
                    began, number = runs_before[gone.claim_uid]
                    assert command.at - began >= grace
                    assert number < model.listings
                    assert gone.missing_since == began
            assert got == want
            for key in got:
                del model.runs[key]
        else:
            # A Prepare of the claim (the kubelet wants it) or its end ends a run of misses.
            if isinstance(command, PrepareClaim | UnprepareClaim):
                model.runs.pop(command.claim_uid, None)
        assert {k: t for k, (t, _) in model.runs.items()} == dict(new.unlisted)
        state = new
