"""The roster (server/roster.py) against the shard's former per-push computation.

Until the roster, every push recomputed the live set, the finished learners, the cadence,
the grace inputs and the joined count from the shard's whole state, and every round
decision compared the live set with the round's contributors. `reference_*` below are
that code, kept verbatim; a real shard on a fake clock is driven by simulated traffic
(joins, pushes, lease lapses, last pushes, learners leaving and being forgotten, a
restart) and at every push, round decision and tick the incremental answer must equal
the reference one computed from scratch from the shard's state.
"""

from __future__ import annotations

import gc
import math
import random
import tracemalloc

import numpy as np
import pytest

from atoll.server import rules
from atoll.server import shard as shard_module
from atoll.server.config import ShardConfig
from atoll.server.members import Members
from atoll.server.roster import Roster, Timing
from atoll.server.shard import PushHeader, Shard
from atoll.wire import codec
from atoll.wire.plan import FragmentPlan, TensorSpec

PLAN = FragmentPlan.build(
    [TensorSpec("a", (16, 4)), TensorSpec("b", (4, 12)), TensorSpec("c", (8,))], 3
)
LEASE = 2.0


# ---------------------------------------------------------------- the former computation


def reference_cadence(shard: Shard, now: float, before: float | None) -> float | None:
    """The cadence after a push at `now`, as `Shard._heard_from` computed it."""
    done = set().union(*shard.finished.values())
    live_set = rules.live_learners(shard.last_seen, now, shard.policy.lease_seconds)
    live = {m: t for m, t in shard.timings.items() if m in live_set and m not in done}
    periods = [t.period_steps for t in live.values() if t.period_steps]
    steps = {m: t.step_seconds for m, t in live.items()}
    period = rules.cadence(min(periods), steps, frozenset(live)) if periods else None
    return before if period is None else period


def reference_decision(shard: Shard, p: int, now: float) -> rules.CloseDecision:
    """Fragment p's round decision at `now`, as `Shard._maybe_close` made it."""
    frag, policy = shard.fragments[p], shard.policy
    live = rules.live_learners(shard.last_seen, now, policy.lease_seconds)
    timings = [t for m, t in shard.timings.items() if m in live]
    slowest = max((t.step_seconds for t in timings if t.step_seconds > 0), default=None)
    overlap = max((t.overlap_steps for t in timings), default=0)
    cap = min(shard.cadence_seconds or math.inf, policy.lease_seconds)
    grace = rules.estimate_grace(policy, overlap, slowest, shard.sync_time, cap)
    joined = len(shard.known.union(shard.last_seen))
    if frag.version == 0 and shard.cadence_seconds:
        grace = max(grace, shard_module.FIRST_ROUND_GRACE_PERIODS * shard.cadence_seconds)
    waited_for = live - shard.finished.get(p, set())
    return rules.decide_close(
        frag.round_state, waited_for, now, policy.quorum, grace, joined=joined
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CheckedShard(Shard):
    """A shard that checks each incremental answer against the reference one as it goes."""

    checks: dict[str, int]
    reasons: dict[str, int]

    def _heard_from(self, h: PushHeader, now: float) -> None:
        before = self.cadence_seconds
        super()._heard_from(h, now)
        assert self.cadence_seconds == reference_cadence(self, now, before)
        self.checks["cadence"] += 1

    def _maybe_close(self, p: int, now: float, trigger: str | None = None) -> float | None:
        if p in self.frozen:
            return super()._maybe_close(p, now, trigger)
        with self.lock:
            want = reference_decision(self, p, now)
        made: list[rules.CloseDecision] = []
        counted = rules.decide_close_counted

        def record(*args: object, **kwargs: object) -> rules.CloseDecision:
            made.append(counted(*args, **kwargs))  # type: ignore[arg-type]
            return made[-1]

        shard_module.rules.decide_close_counted = record  # type: ignore[assignment]
        try:
            wake = super()._maybe_close(p, now, trigger)
        finally:
            shard_module.rules.decide_close_counted = counted
        assert made == [want], f"fragment {p} at {now}: {made} != {want}"
        self.checks["decisions"] += 1
        self.reasons[str(want.reason)] = self.reasons.get(str(want.reason), 0) + 1
        return wake

    def _forget_departed(self, now: float) -> frozenset[str]:  # called under the lock
        horizon = now - shard_module.PRUNE_AFTER_LEASES * self.policy.lease_seconds
        want = {m for m, seen in self.last_seen.items() if seen < horizon}
        gone = super()._forget_departed(now)
        assert gone == want
        self.checks["forgotten"] += len(gone)
        return gone


def _checked_shard(cfg: ShardConfig, clock: Clock, checks: dict[str, int]) -> CheckedShard:
    shard = CheckedShard(cfg, clock=clock)
    shard.checks, shard.reasons = checks, {}
    shard.recover()
    return shard


def _seed(shard: Shard) -> None:
    for p in range(PLAN.num_fragments):
        shard.init(
            "setup",
            p,
            PLAN.fingerprint,
            PLAN.to_json(),
            codec.encode(np.zeros(PLAN.fragment_sizes[p], np.float32), codec.Codec.FP32),
            int(codec.Codec.FP32),
            PLAN.fragment_sizes[p],
        )


class Crowd:
    """Learners that join, push each fragment at their own pace, send a last push now and
    then, fall silent (their leases lapse, the shard forgets them) and come back."""

    def __init__(self, rng: random.Random, size: int):
        self.rng = rng
        self.ids = [f"learner-{i}" for i in range(size)]
        self.seq = dict.fromkeys(self.ids, 0)
        self.active: set[str] = set()
        self.pace = {m: rng.choice([0.05, 0.06, 0.1, 0.2, 0.0]) for m in self.ids}
        self.period = {m: rng.choice([8, 8, 16, 0]) for m in self.ids}

    def header(self, shard: Shard, m: str, p: int) -> PushHeader:
        self.seq[m] += 1
        rng = self.rng
        step = self.pace[m] * rng.uniform(0.9, 1.1) if rng.random() < 0.3 else self.pace[m]
        period = self.period[m]
        return PushHeader(
            m, p, shard.fragments[p].version, self.seq[m], 8, 8 * 64, int(codec.Codec.INT4),
            PLAN.fragment_sizes[p], PLAN.fingerprint, step, rng.randint(0, max(period - 1, 0)),
            period, last=rng.random() < 0.08,
        )  # fmt: skip


def _event(shard: Shard, crowd: Crowd, frames: dict[int, bytes], clock: Clock) -> None:
    """One step of traffic: a push, a join, a departure or a watcher's touch; then a tick."""
    rng = crowd.rng
    roll = rng.random()
    if roll < 0.08 or not crowd.active:
        crowd.active.add(rng.choice(crowd.ids))  # joins (or comes back)
    elif roll < 0.13:
        crowd.active.discard(rng.choice(sorted(crowd.active)))  # leaves without a word
    elif roll < 0.18:
        shard.touch(rng.choice(crowd.ids))  # a watcher's call renews its lease
    else:
        m, p = rng.choice(sorted(crowd.active)), rng.randrange(PLAN.num_fragments)
        shard.push(crowd.header(shard, m, p), frames[p])
    clock.now += rng.choice([0.001, 0.01, 0.05, 0.2, 0.5, 1.0, 3.0])
    if rng.random() < 0.5:
        shard.tick()
        with shard.lock:
            assert shard.roster.next_expiry(clock.now) == rules.next_lease_expiry(
                shard.last_seen, clock.now, shard.policy.lease_seconds
            )


@pytest.mark.parametrize(("seed", "quorum"), [(0, 1), (1, 2), (2, 3), (3, 2)])
def test_the_roster_decides_as_the_former_computation_on_simulated_traffic(tmp_path, seed, quorum):
    """Joins, pushes, lapses, last pushes, churn and a restart: the same cadence after every
    push, the same decision on every round, the same learners forgotten, at every step."""
    rng = random.Random(seed)
    clock = Clock()
    cfg = ShardConfig(0, 1, tmp_path, quorum=quorum, lease_seconds=LEASE)
    checks = {"cadence": 0, "decisions": 0, "forgotten": 0}
    shard = _checked_shard(cfg, clock, checks)
    _seed(shard)
    frames = {
        p: codec.encode(
            np.random.default_rng(seed).normal(0, 1e-3, n).astype(np.float32), codec.Codec.INT4
        )
        for p, n in enumerate(PLAN.fragment_sizes)
    }
    crowd = Crowd(rng, 40)
    reasons: dict[str, int] = {}
    for i in range(1500):
        if i == 900:  # a restart: leases written by recovery, the roster derived again
            reasons.update(shard.reasons)
            shard.close()
            shard = _checked_shard(cfg, clock, checks)
        _event(shard, crowd, frames, clock)
    reasons.update(shard.reasons)
    shard.close()
    # the traffic reached every kind of decision the rules make, and the comparisons ran
    assert checks["cadence"] > 500 and checks["decisions"] > 500 and checks["forgotten"] > 20
    assert {"all_live_contributed", "grace_elapsed", "in_grace"} <= set(reasons)
    assert "waiting_for_quorum" in reasons or quorum == 1


# ---------------------------------------------------------------- the roster alone


def test_the_roster_follows_leases_finishes_and_rounds_step_by_step():
    """Random events on a bare roster: every derived count equals its from-scratch value."""
    rng = random.Random(7)
    roster, now = Roster(1.0), 0.0
    rounds: dict[int, Members] = {p: Members() for p in range(3)}
    ids = [f"m{i}" for i in range(30)]
    for _ in range(3000):
        m, p, roll = rng.choice(ids), rng.randrange(3), rng.random()
        now += rng.choice([0.0, 0.01, 0.1, 0.4])
        roster.advance(now)
        if roll < 0.4:
            roster.renew(m, now)
            roster.heard(m, Timing(rng.choice([0.0, 0.1, 0.2, 0.3]), rng.randint(0, 3), 8))
        elif roll < 0.55:
            roster.mark_finished(p, m, rng.random() < 0.5)
        elif roll < 0.7:
            rounds[p] = rounds[p].with_(m)
            roster.know(m)
        elif roll < 0.75:
            rounds[p] = Members()  # the round closed
        elif roll < 0.8:
            roster.forget(now - 3.0, 2)
        roster.sync_round(p, rounds[p])
        live = rules.live_learners(roster.last_seen, now, 1.0)
        assert roster.live == live
        assert roster.joined == len(roster.known | set(roster.last_seen))
        fin = roster.finished.get(p, set())
        assert roster.missing(p) == len((live - fin) - set(rounds[p]))
        timed = [t for x, t in roster.timings.items() if x in live]
        steps = [t.step_seconds for t in timed if t.step_seconds > 0]
        assert roster.slowest_step() == max(steps, default=None)
        assert roster.largest_overlap() == max((t.overlap_steps for t in timed), default=0)


def test_members_grow_in_place_and_older_views_stay_as_they_were():
    a = Members(["x"])
    b = a.with_("y")
    c = a.with_("z")  # a branch from an older view: a copy, b is untouched
    assert a == {"x"} and b == {"x", "y"} and c == {"x", "z"} and frozenset({"x", "y"}) == b
    assert "y" not in a and "y" in b and "z" not in b and b.added_since(a) == "y"
    assert c.added_since(a) is None and b.with_("y") is b and len(b) == 2
    assert set() <= b and {"x"} <= b and not {"q"} <= b and hash(b) == hash(frozenset(b))
    state = rules.add_contributor(rules.open_round(), "x", 1.0, 2)
    grown = rules.add_contributor(state, "y", 2.0, 2)
    assert state.contributors == {"x"} and grown.contributors == {"x", "y"}
    assert grown.quorum_reached_at == 2.0 and state.quorum_reached_at is None


# ---------------------------------------------------------------- what a departed learner leaves

# Bytes a learner leaves once forgotten: its id once, and per fragment it pushed one answer
# (exactly-once needs it: a retry is answered once, a resume reads its seq back).
# Measured: ~70 + ~180 per fragment (CPython 3.11, 64-bit), with no answers table growing
# meanwhile (700 -> 1300 answers: one table size); a table that doubles adds ~50 per fragment.
DEPARTED_ID_BYTES, DEPARTED_ANSWER_BYTES = 100, 250


def test_a_departed_learner_leaves_its_id_and_one_answer_per_fragment(tmp_path):
    """Learners that push every fragment once and leave: once forgotten, the shard holds
    nothing of theirs but one answer per fragment, within a fixed number of bytes each."""
    clock = Clock()
    cfg = ShardConfig(0, 1, tmp_path, quorum=2, lease_seconds=1.0, snapshot_every=10**6)
    shard = Shard(cfg, clock=clock)
    shard.recover()
    _seed(shard)
    frames = {
        p: codec.encode(np.full(n, 1e-3, np.float32), codec.Codec.INT4)
        for p, n in enumerate(PLAN.fragment_sizes)
    }

    def cohort(prefix: str, size: int) -> None:
        for i in range(size):
            for p in range(PLAN.num_fragments):
                shard.push(
                    PushHeader(
                        f"{prefix}-{i:06d}", p, shard.fragments[p].version, 1, 8, 512,
                        int(codec.Codec.INT4), PLAN.fragment_sizes[p], PLAN.fingerprint,
                        0.1, 1, 8, last=True,
                    ),
                    frames[p],
                )  # fmt: skip
            clock.now += 0.001
        clock.now += (shard_module.PRUNE_AFTER_LEASES + 1) * cfg.lease_seconds
        shard.tick()  # forgets them

    cohort("warm", 700)  # the first rounds' one-off allocations (the outer step's, the log's)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cohort("gone", 600)
        gc.collect()
        per_learner = (tracemalloc.get_traced_memory()[0] - before) / 600
    finally:
        tracemalloc.stop()
    assert not shard.last_seen and not shard.timings and not shard.roster.live
    assert len(shard.known) <= cfg.quorum and not any(shard.finished.values())
    assert all(len(f.answers) == 1300 for f in shard.fragments.values())
    bound = DEPARTED_ID_BYTES + DEPARTED_ANSWER_BYTES * PLAN.num_fragments
    assert 0 < per_learner <= bound, f"{per_learner:.0f} bytes per departed learner"
    shard.close()
