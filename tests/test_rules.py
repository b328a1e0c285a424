"""Tests for server/rules.py: every decision with an injected clock, never sleeping."""

import dataclasses
import math
import pathlib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.server import rules
from atoll.server.config import ShardConfig
from atoll.server.rules import (
    CloseDecision,
    Ewma,
    Reason,
    RoundPolicy,
    RoundState,
    add_contributor,
    admit,
    cadence,
    decide_close,
    due_in,
    estimate_grace,
    grace_window,
    judge_membership,
    judge_staleness,
    live_learners,
    next_due,
    next_lease_expiry,
    open_round,
    token_weight,
)


def _policy(**fields) -> RoundPolicy:
    """A RoundPolicy at ShardConfig's defaults but for `fields` (it has none of its own)."""
    cfg = ShardConfig(0, 1, pathlib.Path("unused"))
    values = dict(
        quorum=cfg.quorum,
        grace_factor=cfg.grace_factor,
        max_staleness=cfg.max_staleness,
        discount_exponent=cfg.staleness_discount,
        lease_seconds=cfg.lease_seconds,
    )
    return RoundPolicy(**(values | fields))


T0 = 1000.0  # an arbitrary instant on the injected monotonic clock
FAST = settings(max_examples=150, deadline=None)


def round_with(learners, at=T0, quorum=1):
    """A round with `learners` contributing at instants `at`."""
    state = open_round()
    times = at if isinstance(at, (list, tuple)) else [at] * len(learners)
    for m, t in zip(learners, times):
        state = add_contributor(state, m, t, quorum)
    return state


# ---------------------------------------------------------------- reasons


def test_reasons_are_snake_case_metric_labels():
    for r in Reason:
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", r.value), r
        assert str(r) == r.value and f"{r}" == r.value
    assert len({r.value for r in Reason}) == len(Reason)


# ---------------------------------------------------------------- staleness


def test_fresh_push_is_accepted_at_full_weight():
    assert judge_staleness(5, 5, 2, 1.0) == (True, Reason.FRESH, 0, 1.0)


def test_stale_push_within_bound_is_discounted():
    v = judge_staleness(7, 6, 2, 1.0)
    assert v.accept and v.reason is Reason.STALE_DISCOUNTED
    assert v.staleness == 1 and v.discount == pytest.approx(0.5)


def test_staleness_exactly_max_is_accepted_and_one_more_is_refused():
    at_max = judge_staleness(10, 7, 3, 0.5)
    assert at_max.accept and at_max.reason is Reason.STALE_DISCOUNTED
    assert at_max.discount == pytest.approx(4**-0.5)
    over = judge_staleness(10, 6, 3, 0.5)
    assert (over.accept, over.reason, over.staleness, over.discount) == (
        False,
        Reason.TOO_STALE,
        4,
        0.0,
    )


def test_zero_exponent_disables_discount():
    v = judge_staleness(9, 5, 4, 0.0)
    assert v.accept and v.reason is Reason.STALE_DISCOUNTED and v.discount == 1.0


def test_max_staleness_zero_accepts_only_fresh():
    assert judge_staleness(3, 3, 0, 1.0).reason is Reason.FRESH
    assert judge_staleness(3, 2, 0, 1.0).reason is Reason.TOO_STALE


def test_base_from_the_future_is_refused_as_invalid():
    v = judge_staleness(4, 5, 100, 1.0)
    assert (v.accept, v.reason, v.staleness, v.discount) == (False, Reason.FUTURE_BASE, -1, 0.0)


@pytest.mark.parametrize(
    "args",
    [
        (-1, 0, 1, 0.0),
        (0, -1, 1, 0.0),
        (5, 5, -1, 0.0),
        (5, 5, 1, -0.5),
        (5, 5, 1, math.nan),
        (5, 5, 1, math.inf),
        (5.0, 5, 1, 0.0),
        (True, 0, 1, 0.0),
    ],
)
def test_judge_staleness_refuses_bad_arguments(args):
    with pytest.raises(ValueError):
        judge_staleness(*args)


@FAST
@given(s_max=st.integers(0, 50), a=st.floats(0, 8), base=st.integers(0, 1000))
def test_discount_in_unit_interval_and_non_increasing_in_staleness(s_max, a, base):
    prev = 1.0
    for s in range(s_max + 1):
        v = judge_staleness(base + s, base, s_max, a)
        assert v.accept and v.staleness == s
        assert 0.0 < v.discount <= 1.0
        assert v.discount <= prev
        prev = v.discount
    assert not judge_staleness(base + s_max + 1, base, s_max, a).accept


# ---------------------------------------------------------------- token weight


def test_token_weight_is_quantity_times_tokens_per_step():
    assert token_weight(1000, 10) == 100_000.0
    assert token_weight(1, 1) == 1.0
    # Same tokens in fewer steps (bigger batches) weighs more; more tokens weighs more.
    assert token_weight(400, 2) > token_weight(400, 4)
    assert token_weight(800, 4) == 2 * token_weight(400, 2)


@pytest.mark.parametrize(
    "tokens,steps", [(0, 1), (1, 0), (-5, 3), (10, -1), (math.nan, 1), (10, math.inf), (True, 1)]
)
def test_token_weight_refuses_empty_or_bad_pushes(tokens, steps):
    with pytest.raises(ValueError):
        token_weight(tokens, steps)


# ---------------------------------------------------------------- grace, ewma


def test_grace_window_formula():
    assert grace_window(1.0, 4, 0.5, 0.5, 0.25) == pytest.approx(1.25)
    assert grace_window(2.0, 4, 0.5, 0.5, 0.25) == pytest.approx(2.5)
    assert grace_window(0.0, 4, 0.5, 0.0, 0.0) == 0.0


def test_grace_window_is_zero_when_quorum_and_sync_eat_the_slack():
    assert grace_window(1.0, 2, 1.0, 1.5, 0.5) == 0.0  # exactly no slack
    assert grace_window(1.0, 2, 1.0, 3.0, 1.0) == 0.0  # negative slack clamps


@pytest.mark.parametrize(
    "args",
    [
        (-1.0, 1, 1, 0, 0),
        (1.0, -1, 1, 0, 0),
        (1.0, 1, -1, 0, 0),
        (1.0, 1, 1, -1, 0),
        (1.0, 1, 1, 0, -1),
        (1.0, 1, math.nan, 0, 0),
    ],
)
def test_grace_window_refuses_negative_inputs(args):
    with pytest.raises(ValueError):
        grace_window(*args)


@FAST
@given(*[st.floats(0, 1e6)] * 5)
def test_grace_never_negative(g, tau, step, quorum, sync):
    assert grace_window(g, tau, step, quorum, sync) >= 0.0


def test_ewma_first_sample_sets_then_blends():
    e = Ewma()
    assert e.value is None and e.value_or(3.0) == 3.0
    e = e.update(2.0, 0.25)
    assert e == Ewma(2.0, 1)
    e = e.update(6.0, 0.25)
    assert e.value == pytest.approx(3.0) and e.samples == 2
    assert e.update(10.0, 1.0).value == 10.0  # alpha 1: newest sample only


@pytest.mark.parametrize(
    "sample,alpha", [(1.0, 0.0), (1.0, 1.5), (1.0, -0.1), (math.nan, 0.5), (math.inf, 0.5)]
)
def test_ewma_refuses_bad_samples_and_alpha(sample, alpha):
    with pytest.raises(ValueError):
        Ewma().update(sample, alpha)


def test_estimate_grace_from_running_timings():
    policy = _policy(grace_factor=1.0)
    step, sync = 0.5, Ewma(0.25, 3)
    # counted from the first push: τ·ξ_step − ξ_sync (the round's own ξ_quorum is inside it)
    assert estimate_grace(policy, 4, step, sync) == pytest.approx(1.75)
    assert estimate_grace(policy, 4, None, sync) == 0.0  # no step time yet
    assert estimate_grace(policy, 4, step, Ewma()) == pytest.approx(2.0)
    assert estimate_grace(_policy(grace_factor=0.5), 4, step, Ewma()) == pytest.approx(1.0)
    # never shorter than one step: a period's pushes arrive spread by up to a step
    assert estimate_grace(policy, 1, step, Ewma(0.4, 3)) == pytest.approx(0.5)
    assert estimate_grace(_policy(grace_factor=0.0), 4, step, Ewma()) == 0.0
    # never past one sync period: the next period's pushes are due then
    assert estimate_grace(policy, 4, step, Ewma(), cadence_seconds=1.5) == 1.5
    assert estimate_grace(policy, 4, step, Ewma(), cadence_seconds=3.0) == pytest.approx(2.0)
    # nor shorter than γ/2 of a period: pushes on a busy host arrive spread by more than a step
    assert estimate_grace(policy, 4, step, Ewma(), cadence_seconds=9.0) == pytest.approx(4.5)
    assert estimate_grace(
        _policy(grace_factor=0.5), 1, 0.005, Ewma(), cadence_seconds=0.32
    ) == pytest.approx(0.08)
    assert estimate_grace(_policy(grace_factor=0.0), 1, 0.005, Ewma(), cadence_seconds=0.32) == 0.0


def test_cadence_is_h_steps_of_the_fastest_live_learner():
    steps = {"fast": 0.125, "slow": 0.25, "gone": 0.0625}
    assert cadence(32, steps, {"fast", "slow"}) == 4.0  # "gone" has no lease: not the pace
    assert cadence(32, steps, {"slow"}) == 8.0
    # islands of one kind pace together (their median), a 2x slower one does not
    assert cadence(
        100, {"a": 0.10, "b": 0.11, "c": 0.12, "d": 0.25}, {"a", "b", "c", "d"}
    ) == pytest.approx(11.0)
    assert cadence(100, {"a": 0.10, "b": 0.12}, {"a", "b"}) == pytest.approx(11.0)
    assert cadence(32, steps, set()) is None
    assert cadence(32, {"a": 0.0}, {"a"}) is None  # no measured step yet
    with pytest.raises(ValueError):
        cadence(0, steps, {"fast"})


# ---------------------------------------------------------------- leases


def test_live_learners_lease_boundary():
    seen = {"a": 0.0, "b": 5.0, "c": 9.0}
    assert live_learners(seen, 9.0, 10.0) == {"a", "b", "c"}
    assert live_learners(seen, 10.0, 10.0) == {"b", "c"}  # a's lease ends at 10.0 exactly
    assert live_learners(seen, 15.0, 10.0) == {"c"}
    assert live_learners(seen, 19.0, 10.0) == frozenset()
    assert live_learners({}, 0.0, 1.0) == frozenset()


def test_next_lease_expiry():
    seen = {"a": 0.0, "b": 5.0}
    assert next_lease_expiry(seen, 1.0, 10.0) == 10.0
    assert next_lease_expiry(seen, 10.0, 10.0) == 15.0
    assert next_lease_expiry(seen, 15.0, 10.0) is None


@pytest.mark.parametrize("lease", [0.0, -1.0, math.nan])
def test_leases_refuse_non_positive_duration(lease):
    with pytest.raises(ValueError):
        live_learners({"a": 0.0}, 0.0, lease)
    with pytest.raises(ValueError):
        next_lease_expiry({"a": 0.0}, 0.0, lease)


# ---------------------------------------------------------------- round transitions


def test_add_contributor_stamps_first_push_and_first_quorum_only():
    s = open_round()
    assert s == RoundState(None, frozenset(), None, None) and s.quorum_seconds is None
    s = add_contributor(s, "a", T0 + 1, quorum=2)
    assert s.contributors == {"a"} and s.quorum_reached_at is None and s.first_push_at == T0 + 1
    s = add_contributor(s, "b", T0 + 3, quorum=2)
    # ξ_quorum runs from the round's first push, not from the previous close
    assert s.quorum_reached_at == T0 + 3 and s.quorum_seconds == 2.0 and s.first_push_at == T0 + 1
    s = add_contributor(s, "c", T0 + 4, quorum=2)
    assert s.contributors == {"a", "b", "c"} and s.quorum_reached_at == T0 + 3


def test_membership_once_per_round():
    s = round_with(["a"])
    assert judge_membership(s, "b") == (True, Reason.NEW_IN_ROUND)
    assert judge_membership(s, "a") == (False, Reason.ALREADY_IN_ROUND)
    with pytest.raises(ValueError, match="judge_membership"):
        add_contributor(s, "a", T0 + 1, 1)


# ---------------------------------------------------------------- closing


def test_waits_for_quorum_without_a_timer():
    s = round_with(["a", "b"], quorum=3)
    d = decide_close(s, {"a", "b", "c"}, T0 + 1e6, quorum=3, grace_seconds=0.0)
    assert d == CloseDecision(False, Reason.WAITING_FOR_QUORUM, None)
    assert decide_close(open_round(), set(), T0, 1, 0.0) == (False, Reason.EMPTY, None)


def test_quorum_exactly_k_then_grace_window_from_the_first_push():
    s = round_with(["a", "b"], at=[T0 + 1, T0 + 2], quorum=2)
    live = {"a", "b", "c"}
    d = decide_close(s, live, T0 + 2, quorum=2, grace_seconds=3.0)
    assert d == CloseDecision(False, Reason.IN_GRACE, T0 + 4)  # first push + grace
    assert decide_close(s, live, T0 + 3.999, 2, 3.0).reason is Reason.IN_GRACE
    # Grace exactly elapsed closes.
    assert decide_close(s, live, T0 + 4, 2, 3.0) == CloseDecision(True, Reason.GRACE_ELAPSED, None)
    # A quorum reached after the grace ran out closes at once.
    late = round_with(["a", "b"], at=[T0, T0 + 10], quorum=2)
    assert decide_close(late, live, T0 + 10, 2, 3.0).reason is Reason.GRACE_ELAPSED


def test_all_live_contributed_closes_before_grace():
    s = round_with(["a", "b", "c"], at=[T0, T0 + 1, T0 + 2], quorum=2)
    d = decide_close(s, {"a", "b", "c"}, T0 + 2, quorum=2, grace_seconds=100.0)
    assert d == CloseDecision(True, Reason.ALL_LIVE_CONTRIBUTED, None)


def test_quorum_of_one_closes_on_first_push_when_alone_or_after_grace():
    s = round_with(["a"], quorum=1)
    assert decide_close(s, {"a"}, T0, 1, 10.0).reason is Reason.ALL_LIVE_CONTRIBUTED
    assert decide_close(s, {"a", "b"}, T0, 1, 10.0) == (False, Reason.IN_GRACE, T0 + 10)
    assert decide_close(s, {"a", "b"}, T0, 1, 0.0).reason is Reason.GRACE_ELAPSED


def test_lease_lapse_makes_round_closable():
    seen = {"a": T0, "b": T0, "slow": T0 - 8.0}
    s = round_with(["a", "b"], quorum=2)
    lease, grace = 10.0, 60.0
    now = T0 + 1.0
    live = live_learners(seen, now, lease)
    assert decide_close(s, live, now, 2, grace).reason is Reason.IN_GRACE
    now = next_lease_expiry(seen, now, lease)  # "slow"'s lease lapses at T0 + 2
    assert now == T0 + 2.0
    live = live_learners(seen, now, lease)
    assert live == {"a", "b"}
    assert decide_close(s, live, now, 2, grace) == (True, Reason.ALL_LIVE_CONTRIBUTED, None)


def test_departed_contributors_still_count_toward_quorum():
    s = round_with(["a", "b"], quorum=2)
    # Both contributors' leases lapsed; nobody live is missing, so the round closes.
    assert decide_close(s, frozenset(), T0 + 1, 2, 30.0).reason is Reason.ALL_LIVE_CONTRIBUTED
    # With a live non-contributor, it waits out the grace all the same.
    assert decide_close(s, {"c"}, T0 + 1, 2, 30.0).reason is Reason.IN_GRACE


def test_round_closes_below_quorum_when_every_live_learner_is_in():
    s = round_with(["a"], quorum=3)
    assert decide_close(s, {"a", "b"}, T0 + 1, 3, 0.0).reason is Reason.WAITING_FOR_QUORUM
    # b's lease lapsed: nobody else can come, so a lone survivor's round closes.
    assert decide_close(s, {"a"}, T0 + 1, 3, 0.0) == (True, Reason.QUORUM_UNREACHABLE, None)
    assert decide_close(s, frozenset(), T0 + 1, 3, 0.0).reason is Reason.QUORUM_UNREACHABLE


def test_no_round_closes_below_quorum_before_k_learners_joined():
    s = round_with(["a"], quorum=2)
    # start-up: "a" is the only learner the shard has ever known, and alone it waits
    assert decide_close(s, {"a"}, T0 + 1e6, 2, 0.0, joined=1) == (
        False,
        Reason.WAITING_FOR_JOINERS,
        None,
    )
    # once K have joined, a lone survivor's round closes below quorum
    assert decide_close(s, {"a"}, T0 + 1, 2, 0.0, joined=2).reason is Reason.QUORUM_UNREACHABLE
    # at quorum, joiners do not matter
    both = round_with(["a", "b"], quorum=2)
    assert decide_close(both, {"a", "b"}, T0, 2, 0.0, joined=2).close


def test_decide_close_refuses_bad_arguments_and_mismatched_quorum():
    s = round_with(["a", "b"], quorum=3)  # built with K=3: quorum not stamped
    with pytest.raises(ValueError, match="quorum given to add_contributor"):
        decide_close(s, {"a", "b", "c"}, T0, quorum=2, grace_seconds=1.0)
    with pytest.raises(ValueError):
        decide_close(s, set(), T0, quorum=0, grace_seconds=1.0)
    with pytest.raises(ValueError):
        decide_close(s, set(), T0, quorum=2, grace_seconds=-1.0)
    with pytest.raises(ValueError):
        add_contributor(s, "z", T0, quorum=0)


learner_ids = st.sampled_from(list("abcdefgh"))


@FAST
@given(
    contributors=st.lists(learner_ids, unique=True, max_size=8),
    others=st.sets(learner_ids),
    quorum=st.integers(1, 5),
    gaps=st.lists(st.floats(0, 100), min_size=8, max_size=8),
    grace=st.floats(0, 100),
    t=st.floats(0, 500),
    dt=st.floats(0, 500),
)
def test_decide_close_is_monotone_in_time(contributors, others, quorum, gaps, grace, t, dt):
    times = [T0 + sum(gaps[: i + 1]) for i in range(len(contributors))]
    s = round_with(contributors, at=times, quorum=quorum)
    live = frozenset(others)
    now = T0 + t
    first = decide_close(s, live, now, quorum, grace)
    later = decide_close(s, live, now + dt, quorum, grace)
    if first.close:
        assert later.close
    if not later.close and later.reason is Reason.IN_GRACE:
        assert later.wake_at > now + dt  # an armed timer is always in the future
    if first.reason is Reason.IN_GRACE:
        # Waking at wake_at closes the round with the same state.
        assert decide_close(s, live, first.wake_at, quorum, grace).close


# ---------------------------------------------------------------- policy


def test_policy_defaults_are_valid_and_frozen():
    p = _policy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.quorum = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    "field,value,hint",
    [
        ("quorum", 0, "use 1"),
        ("quorum", 1.5, "int >= 1"),
        ("grace_factor", -0.1, "disable grace"),
        ("max_staleness", -1, "use 0"),
        ("discount_exponent", -1.0, "no staleness discount"),
        ("lease_seconds", 0.0, "longest gap"),
        ("lease_seconds", math.inf, "finite"),
        ("ewma_alpha", 0.0, "> 0"),
        ("ewma_alpha", 1.5, "<= 1"),
    ],
)
def test_policy_refuses_bad_fields_saying_how_to_fix(field, value, hint):
    with pytest.raises(ValueError, match=re.escape(hint)) as err:
        _policy(**{field: value})
    assert field in str(err.value)


# ---------------------------------------------------------------- admission


def _admit(**kw):
    args = dict(
        seq=10,
        newest_seq=9,
        base_version=5,
        current_version=5,
        in_round=False,
        tokens=1000,
        inner_steps=10,
        policy=_policy(max_staleness=2, discount_exponent=1.0),
    )
    return admit(**(args | kw))


def test_admit_fresh_and_stale_pushes_with_weight_and_discount():
    assert _admit() == (True, Reason.FRESH, 0, 1.0, 100000.0, "")
    stale = _admit(base_version=4)
    assert stale[:5] == (True, Reason.STALE_DISCOUNTED, 1, 0.5, 100000.0)
    assert _admit(newest_seq=None).accept  # a learner's first push


def test_admit_judges_in_order_duplicate_future_stale_in_round():
    assert _admit(seq=9).reason is Reason.DUPLICATE  # a retry: the caller answers it
    older = _admit(seq=3)
    assert older.reason is Reason.DUPLICATE and "older" in older.detail and not older.accept
    # a duplicate wins over every other judgement: retries get the first answer
    assert _admit(seq=9, base_version=99, in_round=True).reason is Reason.DUPLICATE
    assert _admit(base_version=6).reason is Reason.FUTURE_BASE
    assert _admit(base_version=6, in_round=True).reason is Reason.FUTURE_BASE
    too = _admit(base_version=2, in_round=True)
    assert too.reason is Reason.TOO_STALE and "pull" in too.detail and too.weight == 0.0
    assert _admit(in_round=True) == (
        False,
        Reason.ALREADY_IN_ROUND,
        0,
        0.0,
        0.0,
        "this learner is already in the open round",
    )


@FAST
@given(
    current=st.integers(0, 50),
    lag=st.integers(-3, 10),
    in_round=st.booleans(),
    tokens=st.integers(1, 10**6),
    steps=st.integers(1, 1000),
)
def test_admit_accepts_exactly_the_pushes_the_rules_allow(current, lag, in_round, tokens, steps):
    base = current - lag
    if base < 0:
        return
    a = _admit(
        base_version=base,
        current_version=current,
        in_round=in_round,
        tokens=tokens,
        inner_steps=steps,
    )
    assert a.accept == (0 <= lag <= 2 and not in_round)
    if a.accept:
        assert a.weight == token_weight(tokens, steps) and a.discount == (1.0 + lag) ** -1.0
    else:
        assert a.weight == 0.0 and a.discount == 0.0


def test_admit_refuses_a_seq_far_past_the_newest():
    from atoll.server.rules import MAX_SEQ_JUMP

    assert _admit(seq=9 + MAX_SEQ_JUMP).accept
    far = _admit(seq=10 + MAX_SEQ_JUMP)
    assert far.reason is Reason.SEQ_TOO_FAR and not far.accept and "rejoin" in far.detail
    assert _admit(seq=MAX_SEQ_JUMP, newest_seq=None).accept  # a first push counts from 0
    assert _admit(seq=MAX_SEQ_JUMP + 1, newest_seq=None).reason is Reason.SEQ_TOO_FAR


# ---------------------------------------------------------------- the fragment's schedule


def test_next_due_keeps_one_schedule_whenever_rounds_close():
    due = RoundState(T0 + 0.2, frozenset({"a", "b"}), T0 + 0.3, T0)
    assert next_due(due, T0 + 0.9, 3.0) == T0 + 3.0  # a late close does not shift the next period
    assert next_due(due, T0 + 7.5, 3.0) == T0 + 9.0  # a round that closed periods late skips them
    first = RoundState(
        T0 + 1.0, frozenset({"a"}), T0 + 1.0
    )  # no schedule yet: the first push sets it
    assert next_due(first, T0 + 1.5, 3.0) == T0 + 4.0
    assert next_due(due, T0 + 1.0, None) is None  # no cadence, no schedule


def test_due_in_tells_each_learner_its_next_push():
    state = add_contributor(open_round(due_at=T0 + 3.0), "a", T0 + 2.9, 2)
    assert due_in(state, T0 + 2.9, 3.0, in_round=True) == pytest.approx(
        3.1
    )  # the round after this one
    assert due_in(state, T0 + 2.9, 3.0, in_round=False) == pytest.approx(0.1)  # this one
    assert due_in(state, T0 + 5.0, 3.0, in_round=False) == pytest.approx(
        1.0
    )  # overdue: the next instant
    assert due_in(state, T0 + 2.9, None, in_round=False) == 0.0  # no cadence yet
    assert due_in(open_round(), T0, 3.0, in_round=False) == 0.0  # no phase yet


def test_an_early_push_does_not_start_the_grace_clock():
    state = add_contributor(
        add_contributor(open_round(due_at=T0 + 3.0), "a", T0 + 1.0, 2), "b", T0 + 1.1, 2
    )
    assert state.started_at == T0 + 3.0
    assert decide_close(state, {"a", "b", "c"}, T0 + 3.4, 2, 0.5) == (
        False,
        Reason.IN_GRACE,
        T0 + 3.5,
    )
    assert decide_close(state, {"a", "b", "c"}, T0 + 3.5, 2, 0.5).close


def test_a_cadence_too_short_to_count_in_restarts_the_schedule_instead_of_overflowing():
    # a learner may report any step time in [0, 86400]: 5e-324 s makes a cadence of ~4e-323 s,
    # and the periods since the phase overflow (found by tests/integration/test_fuzz.py)
    state = rules.RoundState(10.0, frozenset({"a"}), 10.0, 10.0)
    cadence = rules.cadence(8, {"a": 5e-324}, {"a"})
    assert cadence is not None and 0 < cadence < 1e-300
    due = rules.next_due(state, 11.0, cadence)
    assert due is not None and 11.0 < due < 11.0 + 1e-9
    assert 0 <= rules.due_in(state, 11.0, cadence, in_round=True) < 1e-9
    assert rules.next_due(state, 11.0, 0.5) == 11.5  # the ordinary case is unchanged


def test_a_cadence_too_short_to_count_in_with_the_due_time_ahead():
    ahead = rules.RoundState(10.0, frozenset({"a"}), 10.0, 12.0)  # due at 12, now 11
    due = rules.next_due(ahead, 11.0, 4e-323)
    assert due is not None and due > 11.0
    assert rules.due_in(ahead, 11.0, 4e-323, in_round=True) >= 0.0
