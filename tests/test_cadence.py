"""Rounds follow the sync period: the real Shard and the learners' real schedule
(learner/schedule.py: `decide_push`, `decide_adopt`) on a fake clock, with islands of
two speeds.

Each simulated learner steps at its own pace (with jitter), pushes a fragment when
`decide_push` says so, adopts the round's result once its version is out and τ steps
have passed, and blocks only when the run-ahead is spent with its push still in an open
round, as `Synchronizer.after_step` does. The shard is the real one, with its write-ahead
log in a temporary directory, its rules and its timers (`tick`).
"""

from __future__ import annotations

import dataclasses
import heapq
import random

import numpy as np
import pytest

from atoll.learner.schedule import (
    STEP_WINDOW,
    StepTimer,
    decide_adopt,
    decide_push,
    offsets,
    steps_per_period,
)
from atoll.server.config import ShardConfig
from atoll.server.shard import PushHeader, Shard
from atoll.wire import codec
from atoll.wire.plan import FragmentPlan, TensorSpec

SPECS = [
    TensorSpec("embed", (40, 8)),
    TensorSpec("w1", (8, 36)),
    TensorSpec("w2", (36, 8)),
    TensorSpec("w3", (16, 16)),
]
PLAN = FragmentPlan.build(SPECS, 4)
H, TAU, TOKENS_PER_STEP = 32, 1, 512
FIRST_STEPS = offsets(PLAN.num_fragments, H)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Frag:
    version: int = 0
    last_sync_step: int | None = None
    due_at: float | None = None  # when the shard asked for the next push
    pushed_at_step: int | None = None  # the step of the push in flight, None when none
    merged_in: int = 0


@dataclasses.dataclass
class Learner:
    name: str
    step_seconds: float
    rng: random.Random
    measured: bool = False  # report the StepTimer's estimate of the steps taken, as a learner does
    step: int = 0
    seq: int = 0
    blocked_seconds: float = 0.0
    pushes: list = dataclasses.field(default_factory=list)  # (fragment, staleness, accepted)

    def __post_init__(self):
        self.frags = {p: Frag() for p in range(PLAN.num_fragments)}
        self.timer = StepTimer.for_period(H)  # as the learner keeps it (learner/sync.py)
        self.estimate = self.step_seconds  # the step time it reports (StepTimer when measured)
        self.load = 1.0  # what other processes on its host slow its steps by, now
        self.load_until = 0.0

    def step_time(
        self, now: float, jitter: float, stalls: float, load, pauses: tuple[float, float]
    ) -> float:
        """How long its next step takes, started at `now`; records it when measured."""
        rng = self.rng
        if load is not None and now >= self.load_until:  # the host's load moves
            self.load, hold = load(rng)
            self.load_until = now + hold
        step = self.step_seconds * self.load * (1 + rng.uniform(-jitter, jitter))
        if rng.random() < stalls:  # an evaluation, a GC pause, a busy host: a few steps lost
            step += self.step_seconds * rng.uniform(2, 8)
        if pauses[0] and rng.random() < pauses[0]:  # descheduled: a pause of many steps
            step += pauses[1]
        if self.measured:
            self.estimate = self.timer.add(self.step + 1, step)
        return step


def _seeded_shard(cfg: ShardConfig, clock: Clock) -> Shard:
    """A shard on `clock` with every fragment of PLAN seeded at zeros."""
    shard = Shard(cfg, clock=clock)
    shard.recover()
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
    return shard


def _frames(rng: np.random.Generator) -> dict[int, bytes]:
    """One small int4 push frame per fragment of PLAN, the same for every push."""
    return {
        p: codec.encode(
            rng.normal(0, 1e-3, PLAN.fragment_sizes[p]).astype(np.float32), codec.Codec.INT4
        )
        for p in range(PLAN.num_fragments)
    }


def simulate(
    speeds: list[float],
    quorum: int,
    periods: int,
    tmp_path,
    seed: int = 0,
    jitter: float = 0.05,
    stalls: float = 0.0,
    start_spread: float = 1.0,
    load=None,
    measured: bool = False,
    pauses: tuple[float, float] = (0.0, 0.0),
):
    """Runs the learners for `periods` sync periods of the fastest; returns (shard, learners,
    close times, end). `load(rng)` -> (factor, seconds): each learner's steps are slowed by
    `factor` for `seconds` at a time (other processes on its host); `pauses` (p, seconds):
    a step is held `seconds` longer with probability p (descheduled); `measured`: learners
    report the StepTimer's estimate of the steps they took, not their nominal speed."""
    clock = Clock()
    cfg = ShardConfig(
        shard_index=0,
        num_shards=1,
        data_dir=tmp_path / "shard",
        quorum=quorum,
        lease_seconds=30.0,
        snapshot_every=1000,
    )
    shard = _seeded_shard(cfg, clock)
    rng = np.random.default_rng(seed)
    frames = _frames(rng)
    learners = [
        Learner(f"l{i}", s, random.Random(seed * 100 + i), measured) for i, s in enumerate(speeds)
    ]
    closes: dict[int, list[float]] = {p: [] for p in range(PLAN.num_fragments)}
    known = {p: 0 for p in range(PLAN.num_fragments)}
    sim = Sim(shard, clock, frames, closes, known)
    end = periods * H * min(speeds)
    # (time, order, learner index) for step boundaries; learners start up to a period apart
    events = [
        (l.rng.uniform(0, start_spread * H * min(speeds)), i, i) for i, l in enumerate(learners)
    ]
    heapq.heapify(events)
    order = len(learners)
    while events and clock.now < end:
        t, _, i = heapq.heappop(events)
        wake = shard.tick() if t > clock.now else None
        while wake is not None and wake < t:  # the shard's round timer fires before this step ends
            clock.now = wake
            wake = shard.tick()
            sim.note_closes()
        clock.now = max(clock.now, t)
        shard.tick()
        sim.note_closes()
        l = learners[i]
        blocked_until = step_learner(sim, l)
        l.blocked_seconds += blocked_until - clock.now
        step = l.step_time(blocked_until, jitter, stalls, load, pauses)
        order += 1
        heapq.heappush(events, (blocked_until + step, order, i))
    return shard, learners, closes, end


@dataclasses.dataclass
class Sim:
    """The shard, the clock and the round closes seen so far, shared by the learners."""

    shard: Shard
    clock: Clock
    frames: dict[int, bytes]  # the outer-gradient frame each push of a fragment sends
    closes: dict[int, list[float]]  # per fragment, when each version came out
    known: dict[int, int]  # per fragment, the versions in `closes`

    def note_closes(self) -> None:
        note_closes(self.shard, self.known, self.closes, self.clock.now)


def step_learner(sim: Sim, l: Learner) -> float:
    """Learner l's step boundary: adopts, blocks or pushes per fragment, as
    `Synchronizer.after_step` does; returns when its next step may start."""
    sim.shard.touch(l.name)  # the learner's Watch keeps its lease
    if l.step == 0:  # joining: it pulls every fragment's current version and when to push it
        for p, f in l.frags.items():
            f.version = sim.shard.fragments[p].version
            due_in = sim.shard.due_in(p, l.name)  # PullHeader.next_due_seconds
            f.due_at = sim.clock.now + due_in if due_in > 0 else None
    l.step += 1
    cadence = sim.shard.cadence_seconds
    per_period = steps_per_period(H, cadence, l.estimate)
    blocked_until = sim.clock.now
    for p, f in l.frags.items():
        if f.pushed_at_step is not None:
            out = sim.shard.fragments[p].version >= f.merged_in
            adopt, _ = decide_adopt(
                step=l.step,
                task_step=f.pushed_at_step,
                done=out,
                overlap=TAU,
                per_period=per_period,
            )
            if adopt and not out:  # the run-ahead is spent: wait for the round
                return_at = close_time(sim.closes[p], f.merged_in)
                if return_at is None:
                    continue  # still not out: a real learner would block; try again next step
                blocked_until = max(blocked_until, return_at)
            if adopt:
                f.version = sim.shard.fragments[p].version
                f.pushed_at_step = None
        if f.pushed_at_step is not None:
            continue
        push, f.due_at, _ = decide_push(
            step=l.step,
            first_step=FIRST_STEPS[p],
            last_sync_step=f.last_sync_step,
            due_at=f.due_at,
            now=sim.clock.now,
            period=H,
            cadence_seconds=cadence,
            step_seconds=l.estimate,
        )
        if push:
            push_fragment(sim, l, p, f, cadence)
    return blocked_until


def push_fragment(sim: Sim, l: Learner, p: int, f: Frag, cadence: float | None) -> None:
    """Learner l pushes fragment p to the shard and takes its answer."""
    steps = l.step - (f.last_sync_step or 0)
    l.seq += 1
    h = PushHeader(
        l.name,
        p,
        f.version,
        l.seq,
        steps,
        steps * TOKENS_PER_STEP,
        int(codec.Codec.INT4),
        PLAN.fragment_sizes[p],
        PLAN.fingerprint,
        l.estimate,
        TAU,
        H,
    )
    answer = sim.shard.push(h, sim.frames[p])
    sim.note_closes()
    due_in = sim.shard.due_in(p, l.name)  # PushResponse.next_due_seconds
    f.due_at = (
        sim.clock.now + due_in if due_in > 0 else (sim.clock.now + cadence if cadence else None)
    )
    l.pushes.append((p, answer.staleness, answer.accepted))
    f.last_sync_step = l.step
    if answer.accepted:
        f.pushed_at_step, f.merged_in = l.step, f.version + answer.staleness + 1
    else:  # resync: adopt the current version
        f.version = sim.shard.fragments[p].version


def note_closes(
    shard: Shard, known: dict[int, int], closes: dict[int, list[float]], now: float
) -> None:
    for p, frag in shard.fragments.items():
        while known[p] < frag.version:
            known[p] += 1
            closes[p].append(now)


def close_time(times: list[float], version: int) -> float | None:
    return times[version - 1] if len(times) >= version else None


def outer_steps_per_period(
    closes: list[float], period_seconds: float, start: float, end: float
) -> float:
    return sum(start <= t < end for t in closes) / ((end - start) / period_seconds)


@pytest.mark.parametrize("seed", [0, 1])
def test_one_outer_step_per_period_with_half_speed_islands_and_k_below_m(tmp_path, seed):
    speeds = [0.1, 0.1, 0.2, 0.2]  # two islands at half speed
    shard, learners, closes, end = simulate(
        speeds, quorum=2, periods=30, tmp_path=tmp_path, seed=seed
    )
    period = H * min(speeds)
    assert shard.cadence_seconds == pytest.approx(period, rel=0.06)
    start = 5 * period  # after the first periods, once the learners are in step
    rates = [outer_steps_per_period(c, period, start, end) for c in closes.values()]
    assert all(0.8 <= r <= 1.25 for r in rates), rates
    for l in learners:
        late = [s for p, s, ok in l.pushes[len(l.pushes) // 3 :] if ok and s > 0]
        # a 2x-slower island is neither refused nor chronically a version behind
        assert all(ok for _, _, ok in l.pushes), l.name
        assert len(late) <= len(l.pushes) // 5, (l.name, late)
        assert l.blocked_seconds < 0.05 * end, (l.name, l.blocked_seconds)
    # the slow islands take about H/2 steps per sync, the fast ones about H
    fast, slow = learners[0], learners[2]
    assert fast.step / len(fast.pushes) == pytest.approx(2 * slow.step / len(slow.pushes), rel=0.25)


@pytest.mark.parametrize("seed", [0, 1])
def test_slower_islands_that_start_together_make_each_fragments_first_round(tmp_path, seed):
    # `atoll up` starts every island at once: a half-speed island reaches step t_p up to a
    # period after the fast ones, and the first round waits for it (one delta per pull after)
    speeds = [0.1, 0.1, 0.2, 0.2]
    shard, learners, _, _ = simulate(
        speeds, quorum=2, periods=6, tmp_path=tmp_path, seed=seed, start_spread=0.05
    )
    for l in learners:
        first = {}
        for p, staleness, ok in l.pushes:
            first.setdefault(p, (staleness, ok))
        assert first == {p: (0, True) for p in range(PLAN.num_fragments)}, (l.name, first)
    assert all(f.version >= 2 for f in shard.fragments.values())


def test_rounds_close_once_per_period_whatever_k(tmp_path):
    speeds = [0.1] * 4
    for quorum in (1, 2, 4):
        shard, _, closes, end = simulate(
            speeds, quorum=quorum, periods=20, tmp_path=tmp_path / str(quorum)
        )
        period = H * 0.1
        rates = [outer_steps_per_period(c, period, 5 * period, end) for c in closes.values()]
        assert all(0.8 <= r <= 1.25 for r in rates), (quorum, rates)


@pytest.mark.parametrize("seed", [0, 1])
def test_stalls_do_not_split_rounds(tmp_path, seed):
    """Learners that lose a few steps now and then (an evaluation, a busy host) still
    push on the fragment's one schedule: a round waits up to a period (γ/2 of one, γ = 2)
    for a late push (and a later one joins the next round, still due a period after the last), so
    rounds do not split into a punctual group and a late one, and a learner seldom
    pulls two versions in one sync. Waiting merges a few periods' pushes into one
    round: 0.84-0.96 outer steps per period here, 1.01-1.14 versions pulled per push
    (γ/8 of a period: 0.96-1.0 and 1.03-1.25)."""
    speeds = [0.1, 0.1, 0.2, 0.2]
    shard, learners, closes, end = simulate(
        speeds, quorum=2, periods=30, tmp_path=tmp_path, seed=seed, jitter=0.3, stalls=0.05
    )
    period = H * min(speeds)
    start = 5 * period
    rates = [outer_steps_per_period(c, period, start, end) for c in closes.values()]
    assert all(0.8 <= r <= 1.1 for r in rates), rates
    for l in learners:
        assert all(ok for _, _, ok in l.pushes), l.name
        # versions a learner has to pull per push it makes (what pull bandwidth pays for)
        pushes = sum(1 for _ in l.pushes) / PLAN.num_fragments
        assert sum(rates) / len(rates) * (end / period) / pushes <= 1.2, l.name


def test_the_step_time_a_learner_reports_holds_its_wall_time_with_skewed_steps():
    # 4 learners on 2 cores: most steps quick, one in 20 waits for a core; H steps of the
    # estimate must be H steps of wall time, or rounds come due faster than pushes
    timer = StepTimer()
    timer.add(1, 30.0)  # the compile
    timer.add(2, 30.0)
    steps = [0.003] * 19 + [0.1]
    for i in range(STEP_WINDOW * 3):
        estimate = timer.add(3 + i, steps[i % len(steps)])
    assert estimate == pytest.approx(np.mean(steps), rel=0.1)  # the window holds 6 or 7 long steps
    assert estimate > 2 * np.median(steps)
    fresh = StepTimer()
    assert fresh.add(1, 2.0) == 2.0  # before any other step, the first one is all there is


def bursty_load(rng: random.Random) -> tuple[float, float]:
    """Other processes on a loaded host: a learner's steps run at full speed or 4x slower,
    switching every few periods (each learner on its own)."""
    return rng.choice([1.0, 4.0]), rng.expovariate(1 / (4 * H * 0.1))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_period_holds_h_steps_of_the_fastest_learner_under_bursty_load(tmp_path, seed):
    """Learners of one speed on a loaded host, reporting the step time they measure: the
    fastest at any moment is whichever the load spared just then. The cadence must follow
    each learner's long-run pace (StepTimer.for_period), not the luckiest recent window,
    or a period holds fewer than H steps and fragments take more outer steps than the
    fastest learner makes periods (1.6-1.8x in `atoll up` under load, with a 128-step window)."""
    speeds = [0.1] * 4
    shard, learners, _, _ = simulate(
        speeds, quorum=2, periods=80, tmp_path=tmp_path, seed=seed, load=bursty_load, measured=True
    )
    periods = max(l.step for l in learners) / H
    rates = [f.version / periods for f in shard.fragments.values()]
    assert all(0.8 <= r <= 1.25 for r in rates), rates


def simulate_lockstep(speeds: list[float], steps: int, tmp_path, seed: int = 0, load=None):
    """Synchronous DiLoCo (`atoll chaos`'s lockstep: K = M, no grace, leases that never
    lapse, `wait_for_rounds`) with P = 4 fragments on a fake clock. Unlike `simulate`, a
    learner that waits for a round really stops until that round closes, as
    `Synchronizer.after_step` does; the run ends when every learner has taken `steps`
    steps or when nobody can move (a deadlock). Returns (shard, learners)."""
    clock = Clock()
    cfg = ShardConfig(
        shard_index=0,
        num_shards=1,
        data_dir=tmp_path / "shard",
        quorum=len(speeds),
        grace_factor=0.0,
        lease_seconds=1e9,
        snapshot_every=1000,
    )
    shard = _seeded_shard(cfg, clock)
    rng = np.random.default_rng(seed)
    frames = _frames(rng)
    learners = [
        Learner(f"l{i}", s, random.Random(seed * 100 + i), measured=True)
        for i, s in enumerate(speeds)
    ]
    sim = Sim(
        shard,
        clock,
        frames,
        {p: [] for p in range(PLAN.num_fragments)},
        dict.fromkeys(range(PLAN.num_fragments), 0),
    )
    blocked: dict[
        int, tuple[int, int, int, float]
    ] = {}  # learner -> (p, version, resume at p, now)
    events = [(l.rng.uniform(0, 0.05 * H * min(speeds)), i, i) for i, l in enumerate(learners)]
    heapq.heapify(events)
    order = len(learners)

    def boundary(i: int, first: int, now: float) -> None:
        """Learner i's step boundary from fragment `first` on; blocks or schedules its next step."""
        nonlocal order
        l = learners[i]
        cadence = shard.cadence_seconds
        per_period = steps_per_period(H, cadence, l.estimate, wait_for_rounds=True)
        for p in range(first, PLAN.num_fragments):
            f = l.frags[p]
            if f.pushed_at_step is not None:
                out = shard.fragments[p].version >= f.merged_in
                adopt, _ = decide_adopt(
                    step=l.step,
                    task_step=f.pushed_at_step,
                    done=out,
                    overlap=TAU,
                    per_period=per_period,
                    wait_for_rounds=True,
                )
                if adopt and not out:  # wait for the round: this learner stops here
                    blocked[i] = (p, f.merged_in, p, now)
                    return
                if adopt:
                    f.version = shard.fragments[p].version
                    f.pushed_at_step = None
            if f.pushed_at_step is None:
                push, f.due_at, _ = decide_push(
                    step=l.step,
                    first_step=FIRST_STEPS[p],
                    last_sync_step=f.last_sync_step,
                    due_at=f.due_at,
                    now=now,
                    period=H,
                    cadence_seconds=cadence,
                    step_seconds=l.estimate,
                    wait_for_rounds=True,
                )
                if push:
                    push_fragment(sim, l, p, f, cadence)
        if l.step < steps:
            order += 1
            heapq.heappush(
                events, (clock.now + l.step_time(clock.now, 0.3, 0.05, load, (0.0, 0.0)), order, i)
            )

    while events:
        t, _, i = heapq.heappop(events)
        clock.now = max(clock.now, t)
        shard.tick()
        sim.note_closes()
        l = learners[i]
        shard.touch(l.name)  # the learner's Watch keeps its lease
        if l.step == 0:  # joining: every fragment's version, and when to push it
            for p, f in l.frags.items():
                f.version = shard.fragments[p].version
                due_in = shard.due_in(p, l.name)
                f.due_at = clock.now + due_in if due_in > 0 else None
        l.step += 1
        boundary(i, 0, clock.now)
        # learners whose round has closed since go on from where they stopped
        for j, (p, version, resume, now) in list(blocked.items()):
            if shard.fragments[p].version >= version:
                del blocked[j]
                learners[j].blocked_seconds += clock.now - now
                boundary(j, resume, now)
    return shard, learners, blocked


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_synchronous_rounds_with_several_fragments_never_deadlock(tmp_path, seed):
    """Lockstep with P = 4 (K = M, learners that wait for their rounds): each learner
    pushes fragment p at t_p + kH by its own step count and waits for that round τ steps
    after the push (τ < H), so no two learners can each wait on a round that needs the
    other's next push (a run at H = 64 stopped for good after 10 rounds when sync points
    followed the shard's wall-clock due times)."""
    speeds = [0.1, 0.1, 0.11, 0.13]
    steps = 40 * H
    shard, learners, blocked = simulate_lockstep(
        speeds, steps, tmp_path, seed=seed, load=bursty_load
    )
    assert not blocked, {learners[i].name: b for i, b in blocked.items()}
    assert all(l.step == steps for l in learners), [l.step for l in learners]
    for l in learners:
        assert all(ok for _, _, ok in l.pushes), l.name  # nothing refused: one push per round
    # every round had every learner: a fragment's version counts the periods
    versions = [f.version for f in shard.fragments.values()]
    assert all(steps // H - 1 <= v <= steps // H for v in versions), versions


def test_a_learner_done_training_no_longer_sets_the_pace(tmp_path):
    """The fastest learner's last push ends its say in the cadence at once, not when its
    lease lapses: the learners still training keep H of their own steps per period."""
    clock = Clock()
    cfg = ShardConfig(0, 1, tmp_path, quorum=2, lease_seconds=600.0)
    shard = _seeded_shard(cfg, clock)
    frames = _frames(np.random.default_rng(0))
    seqs = {"fast": 0, "slow": 0}

    def push(name: str, step_seconds: float, p: int, last: bool = False) -> None:
        seqs[name] += 1
        version = shard.fragments[p].version
        shard.push(
            PushHeader(
                name, p, version, seqs[name], H, H * TOKENS_PER_STEP, int(codec.Codec.INT4),
                PLAN.fragment_sizes[p], PLAN.fingerprint, step_seconds, TAU, H, last=last,
            ),
            frames[p],
        )  # fmt: skip
        clock.now += 0.01

    push("fast", 0.1, 0)
    push("slow", 0.4, 1)
    assert shard.cadence_seconds == pytest.approx(H * 0.1)  # the fastest sets the pace
    push("fast", 0.1, 2, last=True)
    push("slow", 0.4, 3)
    assert shard.cadence_seconds == pytest.approx(H * 0.4)  # well inside fast's lease
    push("fast", 0.1, 2)  # a restarted learner trains again: it sets the pace again
    assert shard.cadence_seconds == pytest.approx(H * 0.1)
