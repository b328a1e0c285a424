"""The learner's schedule (learner/schedule.py) as pure functions of a fake clock; the
Synchronizer, a fragment's sync task and waits on versions reading only the clock they
are given."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import heapq
import itertools
import random
import threading

import numpy as np
import pytest

from atoll.learner import schedule
from atoll.learner.fragment_sync import FragmentSync, Link, Pace
from atoll.learner.routing import Router
from atoll.learner.schedule import Reason
from atoll.learner.stopping import Stopped
from atoll.learner.sync import SyncConfig, Synchronizer
from atoll.learner.watch import Versions
from atoll.server.config import ShardConfig
from atoll.server.shard import PushHeader, Shard
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import Pulled
from atoll.wire.plan import FragmentPlan, TensorSpec

H = 32


class Clock:
    """A fake monotonic clock: what the schedule is given as `now`."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def test_first_syncs_are_spread_over_the_period():
    assert schedule.offsets(4, H) == [8, 16, 24, 32]
    assert schedule.offsets(3, 4) == [1, 3, 4]
    assert schedule.offsets(8, 4) == [1, 1, 2, 2, 2, 3, 4, 4]  # never step 0


def test_steps_per_period_follow_the_cadence_once_known():
    assert schedule.steps_per_period(H, None, 0.2) == H
    assert schedule.steps_per_period(H, 6.4, 0.2) == 32
    assert schedule.steps_per_period(H, 6.4, 0.4) == 16  # a 2x slower island: H/2
    assert schedule.steps_per_period(H, 0.1, 0.4) == 1  # at least one
    assert schedule.steps_per_period(H, 6.4, 0.0) == H  # no step time yet


def test_without_a_due_time_pushes_go_at_t_p_then_every_h_steps():
    def due(step, last):
        return schedule.sync_due(
            step=step,
            first_step=8,
            last_sync_step=last,
            due_at=None,
            now=0.0,
            period=H,
            step_seconds=0.1,
        )

    assert [s for s in range(1, 80) if due(s, None)][0] == 8
    assert not due(39, 8) and due(40, 8)
    assert not due(8, 8)  # never twice at one step


def test_with_a_due_time_the_push_goes_at_the_nearest_step_boundary():
    clock = Clock(100.0)
    step_seconds, due_at = 0.2, 100.85
    fired = []
    for step in range(20, 40):
        if schedule.sync_due(
            step=step,
            first_step=8,
            last_sync_step=8,
            due_at=due_at,
            now=clock(),
            period=H,
            step_seconds=step_seconds,
        ):
            fired.append(clock())
            break
        clock.advance(step_seconds)
    # the boundary nearest the due time (100.8, not 101.0): within half a step of it
    assert fired == [pytest.approx(100.8)]


def test_a_push_due_too_soon_after_the_last_takes_the_next_round():
    clock = Clock(50.0)
    kwargs = dict(
        first_step=8, period=H, cadence_seconds=6.4, step_seconds=0.2, due_at=50.0, now=clock()
    )
    push, due_at, reason = schedule.decide_push(step=12, last_sync_step=10, **kwargs)
    assert (push, due_at, reason) == (False, pytest.approx(56.4), Reason.NEXT_ROUND)
    push, due_at, reason = schedule.decide_push(step=30, last_sync_step=10, **kwargs)
    assert (push, due_at, reason) == (True, 50.0, Reason.DUE)
    kwargs["now"] = clock.advance(-1.0)
    assert schedule.decide_push(step=30, last_sync_step=10, **kwargs) == (
        False,
        50.0,
        Reason.NOT_DUE,
    )


def test_synchronous_pushes_keep_to_the_step_grid_whatever_the_due_time():
    # wait_for_rounds: t_p + kH by step count, the shard's due time ignored, no round skipped
    kwargs = dict(first_step=8, period=H, cadence_seconds=6.4, step_seconds=0.2, now=50.0)

    def push(step, last, due_at):
        return schedule.decide_push(
            step=step, last_sync_step=last, due_at=due_at, wait_for_rounds=True, **kwargs
        )

    assert push(8, None, 80.0) == (True, 80.0, Reason.DUE)  # due later by the clock: pushes
    assert push(39, 8, 10.0) == (False, 10.0, Reason.NOT_DUE)  # overdue by the clock: waits
    assert push(40, 8, 50.0) == (True, 50.0, Reason.DUE)  # never NEXT_ROUND
    assert push(72, 50, None)[0] and not push(71, 50, None)[0]  # after a resync at step 50
    assert schedule.steps_per_period(H, 3.2, 0.2, wait_for_rounds=True) == H


def test_no_next_round_without_a_cadence():
    assert (
        schedule.take_next_round(
            step=11,
            last_sync_step=10,
            due_at=50.0,
            now=50.0,
            cadence_seconds=None,
            step_seconds=0.2,
            per_period=H,
        )
        == 50.0
    )


@pytest.mark.parametrize(
    ("step", "done", "wait_for_rounds", "expected"),
    [
        (40, True, False, (False, Reason.OVERLAPPING)),  # τ = 1: not in the push's own step
        (41, True, False, (True, Reason.READY)),
        (41, False, False, (False, Reason.IN_FLIGHT)),
        (40 + 2 * H - 1, False, False, (False, Reason.IN_FLIGHT)),
        (40 + 2 * H, False, False, (True, Reason.OVERDUE)),  # two periods: wait for it
        (40, False, True, (False, Reason.IN_FLIGHT)),  # synchronous: trains its τ steps
        (41, False, True, (True, Reason.OVERDUE)),  # ... then waits for the round
        (41, True, True, (True, Reason.READY)),
    ],
)
def test_adopting_waits_for_tau_and_runs_ahead_at_most_two_periods(
    step, done, wait_for_rounds, expected
):
    assert (
        schedule.decide_adopt(
            step=step,
            task_step=40,
            done=done,
            overlap=1,
            per_period=H,
            wait_for_rounds=wait_for_rounds,
        )
        == expected
    )


def test_due_times_are_relative_to_the_learners_clock():
    assert schedule.due_after(10.0, 2.5) == 12.5
    assert schedule.due_after(10.0, 0.0) is None  # the shard named none
    assert schedule.next_due(12.5, 10.0, 6.4) == 12.5
    assert schedule.next_due(None, 10.0, 6.4) == pytest.approx(16.4)  # a period from now
    assert schedule.next_due(None, 10.0, None) is None


def test_patience_stretches_to_four_periods_of_slow_steps():
    assert schedule.round_patience(30.0, H, 0.1) == 30.0
    assert schedule.round_patience(30.0, H, 1.0) == 4 * H * 1.0


class _NoShard:
    address = "nowhere"

    def close(self) -> None:
        pass


def test_the_synchronizer_reads_only_its_clock():
    # no shard is called: no fragment is due before its first step t_p, and the due
    # times set by hand are read against the fake clock alone
    plan = FragmentPlan.build([TensorSpec(f"w{i}", (2, 2)) for i in range(2)], 2)
    clock = Clock(1000.0)
    sync = Synchronizer(SyncConfig(period=8), plan, [_NoShard()], clock=clock)
    started = []
    try:
        for frag in sync.frags:
            frag.start = lambda *a, frag=frag, **k: started.append((frag.p, clock()))
        sync.frags[0].due_at = 1000.5
        sync.frags[0].last_sync_step = 0
        sync.frags[1].due_at = 2000.0  # not due in this test
        sync.pace.cadence_seconds = 8.0
        params = {f"w{i}": np.zeros((2, 2), np.float32) for i in range(2)}
        for step in range(1, 4):  # 1 s steps on the fake clock
            sync.after_step(step, params, 1.0, tokens_per_step=4)
            clock.advance(1.0)
        # the due time is met at step 1 (1000.0 + half a step >= 1000.5) but fewer than
        # half a period's steps are done: the next round, a cadence later
        assert started == []
        assert sync.frags[0].due_at == pytest.approx(1008.5)
        clock.now = 1008.2
        sync.after_step(8, params, 1.0, tokens_per_step=4)
        assert started == [(0, 1008.2)] and sync.pushes_started == 1 and sync.seq == 1
    finally:
        sync.close()


class _Shard:
    """Answers one fragment's push with `ack` and its pulls with the version at `base`."""

    address = "fake"

    def __init__(self, ack: pb.PushResponse, base: np.ndarray, version: int):
        self.ack, self.base, self.version, self.pushes = ack, base, version, []

    def push(self, header: pb.PushHeader, frame: bytes) -> pb.PushResponse:
        self.pushes.append(header)
        return self.ack

    def pull(self, fragment: int, have: int | None = None) -> Pulled:
        frame = codec.encode(self.base, codec.Codec.FP32)
        return Pulled(fragment, self.version, True, self.base.size, [(self.version, 0, frame)])

    def close(self) -> None:
        pass


def _fragment(
    shard: _Shard, clock: Clock, **settings: float
) -> tuple[FragmentSync, threading.Event]:
    plan = FragmentPlan.build([TensorSpec("w", (2, 2))], 1)
    cfg = SyncConfig(period=8, patience=1.0, max_backoff=0.01, **settings)
    stopping = threading.Event()
    router = Router(plan, [shard], stopping, cfg.max_backoff)
    versions = Versions(router, stopping, cfg.max_backoff, clock)
    link = Link(cfg, plan, router, versions, Pace(), lambda key, amount: None, clock)
    return FragmentSync(0, 4, link), stopping


def test_a_refused_push_resyncs_and_takes_the_shards_due_time_on_the_learners_clock():
    clock = Clock(500.0)
    shard = _Shard(
        pb.PushResponse(accepted=False, next_due_seconds=3.0), np.full(4, 2.0, np.float32), 7
    )
    frag, _ = _fragment(shard, clock)
    outcome = frag.sync(np.ones(4, np.float32), seq=1, steps=8, tokens=64)
    assert outcome.correction is None and outcome.version == 7 == frag.version
    np.testing.assert_array_equal(outcome.values, shard.base)  # θ_p ← Θ_current
    assert outcome.due_at == 503.0  # relative to the fake clock, as the shard said
    assert shard.pushes[0].seq == 1 and shard.pushes[0].inner_steps == 8


def test_the_due_time_counts_from_when_the_push_left_not_from_its_answer():
    # on a loaded host a push and its answer each take hundreds of ms: the shard names the
    # next push 3 s after it judged this one, so counted from the answer the learner's next
    # push would arrive late by both ways, past the round's grace window
    clock = Clock(500.0)

    class Slow(_Shard):
        def push(self, header: pb.PushHeader, frame: bytes) -> pb.PushResponse:
            clock.advance(0.2)  # the request's way there
            answer = super().push(header, frame)
            clock.advance(0.2)  # the answer's way back
            return answer

    shard = Slow(pb.PushResponse(accepted=False, next_due_seconds=3.0), np.zeros(4, np.float32), 7)
    frag, _ = _fragment(shard, clock)
    outcome = frag.sync(np.ones(4, np.float32), seq=1, steps=8, tokens=64)
    # the shard's instant is 503.2 on this clock; the next push, sent at 503.0, gets there then
    assert outcome.due_at == pytest.approx(503.0)


def test_a_round_that_does_not_close_in_time_is_left_without_waiting_on_a_real_clock():
    # each reading of the clock moves it 10 s on: the patience (1 s) is spent at the first
    # look, so the task goes on without the round and nothing sleeps
    class Jumping(Clock):
        def __call__(self) -> float:
            return self.advance(10.0)

    shard = _Shard(pb.PushResponse(accepted=True, staleness=0), np.zeros(4, np.float32), 1)
    frag, _ = _fragment(shard, Jumping(0.0))
    theta = np.ones(4, np.float32)
    outcome = frag.sync(theta, seq=1, steps=8, tokens=64)
    np.testing.assert_array_equal(outcome.correction, np.zeros(4, np.float32))  # keep local
    assert frag.origin is not None and frag.version == 0  # the next Δ starts from θ at the push
    assert outcome.due_at is None  # no schedule from the shard, and no cadence yet


@pytest.mark.parametrize(
    ("settings", "adopted_after", "alpha"),
    [
        ({}, 30, 0.0),  # the default: the global fragment plus the overlapped steps, however late
        ({"late_mix": 0.5}, 1, 0.0),  # adopted at τ: on time, nothing kept
        ({"late_mix": 0.5}, 3, 0.25),  # 2 steps past τ of H = 8
        ({"late_mix": 0.5}, 5, 0.5),
        ({"late_mix": 0.5}, 30, 0.5),  # capped
        ({"late_mix": 0.5, "mix": 0.3}, 2, 0.3),  # α is mix where mix is more
        ({"late_mix": 0.5, "mix": 0.3}, 7, 0.5),
    ],
)
def test_a_late_adoption_keeps_up_to_late_mix_of_the_local_fragment(settings, adopted_after, alpha):
    base = np.array([1.0, 2.0, 3.0, 4.0], np.float32)  # Θ_new
    shard = _Shard(pb.PushResponse(accepted=True, staleness=0), base, 1)
    frag, _ = _fragment(shard, Clock(0.0), **settings)
    frag.link.versions.note(0, 1)  # the round holding the push has closed
    theta_at_push = np.zeros(4, np.float32)
    theta = theta_at_push.copy()  # the task's own: the correction is written over it
    outcome = frag.sync(theta, seq=1, steps=8, tokens=64)
    np.testing.assert_array_equal(outcome.correction, base - theta_at_push)
    assert outcome.correction is theta  # no third vector of the fragment
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(outcome)
    frag.task, frag.task_step = done, 40
    theta_now = np.full(4, 0.5, np.float32)  # the steps trained since the push moved it
    vector = frag.adopt(40 + adopted_after, lambda out: np.add(out, theta_now, out=out))
    np.testing.assert_allclose(vector, theta_now + (1 - alpha) * (base - theta_at_push), rtol=1e-6)
    assert frag.version == 1 and frag.task is None


def test_a_stop_ends_a_wait_on_a_version():
    frag, stopping = _fragment(_Shard(pb.PushResponse(), np.zeros(4, np.float32), 0), Clock(0.0))
    frag.link.versions.note(0, 3)
    assert frag.link.versions.wait_for(0, 3)  # known already: no wait
    stopping.set()
    with pytest.raises(Stopped):
        frag.link.versions.wait_for(0, 4)


def test_the_step_timer_spans_many_periods_of_steps():
    # a period's wall time holds H steps of a learner's long-run pace, not of its last
    # two periods (on a loaded host the pace swings for seconds at a time)
    assert schedule.StepTimer.for_period(64).recent.maxlen == schedule.STEP_WINDOW_PERIODS * 64
    assert schedule.StepTimer.for_period(2).recent.maxlen == schedule.STEP_WINDOW
    timer = schedule.StepTimer.for_period(64)
    for step in range(1, 3 + 64 * schedule.STEP_WINDOW_PERIODS):
        estimate = timer.add(step, 0.02 if (step // 256) % 2 else 0.08)  # fast, then loaded
    assert estimate == pytest.approx(0.05, rel=0.01)  # the mean of both, not the last burst


def test_a_push_reports_no_step_time_until_a_counted_step():
    timer = schedule.StepTimer(window=8, warmup=2)
    assert timer.add(1, 3.0) == 3.0 and timer.measured == 0.0  # a compile: not a pace
    timer.add(2, 0.5)
    assert timer.measured == 0.0
    timer.add(3, 0.03)
    assert timer.measured == pytest.approx(0.03)


# --- the first push's step time, against the real shard (docs: issue 40's schedule bug) ---

_PLAN = FragmentPlan.build([TensorSpec("w1", (32, 32)), TensorSpec("w2", (32, 32))], 2)
_H, _TAU, _STEP = 16, 1, 0.03


@dataclasses.dataclass
class _Task:
    step: int
    pushed_at: float
    due: float | None
    merged_in: int | None  # None: refused (a resync)
    patience: float


@dataclasses.dataclass
class _Frag:
    version: int = 0
    last_sync_step: int | None = None
    due_at: float | None = None
    task: _Task | None = None


class _SimLearner:
    """A learner as `Synchronizer.after_step` drives one: the real StepTimer, the real
    schedule; its first step takes `compile_seconds` (jit), the others _STEP."""

    def __init__(self, name: str, compile_seconds: float, seed: int):
        self.name, self.compile_seconds = name, compile_seconds
        self.rng = random.Random(seed)
        self.timer = schedule.StepTimer.for_period(_H)
        self.estimate, self.cadence = 0.0, None
        self.step = self.seq = 0
        self.frags = [_Frag() for _ in range(_PLAN.num_fragments)]
        self.pushes: list[tuple[int, int, float, float]] = []  # (p, step, when, reported)
        self.stalls: list[tuple[int, int]] = []  # (p, version given up on)

    def gaps(self, p: int) -> list[float]:
        times = [t for q, _, t, _ in self.pushes if q == p]
        return [b - a for a, b in itertools.pairwise(times)]


def _sim_shard(tmp_path, clock: Clock, quorum: int) -> Shard:
    shard = Shard(
        ShardConfig(
            shard_index=0, num_shards=1, data_dir=tmp_path, quorum=quorum, snapshot_every=1000
        ),
        clock=clock,
    )
    shard.recover()
    for p in range(_PLAN.num_fragments):
        zeros = np.zeros(_PLAN.fragment_sizes[p], np.float32)
        shard.init(
            "setup",
            p,
            _PLAN.fingerprint,
            _PLAN.to_json(),
            codec.encode(zeros, codec.Codec.FP32),
            int(codec.Codec.FP32),
            _PLAN.fragment_sizes[p],
        )
    return shard


def _sim_push(shard: Shard, clock: Clock, l: _SimLearner, p: int, last: bool = False) -> None:
    f = l.frags[p]
    steps = max(1, l.step - (f.last_sync_step or 0))
    l.seq += 1
    reported = l.timer.measured  # what FragmentSync._push puts in the header (Pace)
    header = PushHeader(
        l.name,
        p,
        f.version,
        l.seq,
        steps,
        steps * 64,
        int(codec.Codec.INT4),
        _PLAN.fragment_sizes[p],
        _PLAN.fingerprint,
        reported,
        _TAU,
        _H,
        last,
    )
    frame = codec.encode(np.full(_PLAN.fragment_sizes[p], 1e-3, np.float32), codec.Codec.INT4)
    answer = shard.push(header, frame)
    if shard.cadence_seconds:
        l.cadence = shard.cadence_seconds
    due = schedule.due_after(clock.now, shard.due_in(p, l.name))
    l.pushes.append((p, l.step, clock.now, reported))
    f.last_sync_step = l.step
    merged_in = f.version + answer.staleness + 1 if answer.accepted else None
    patience = schedule.round_patience(SyncConfig().patience, _H, l.estimate)
    f.task = _Task(l.step, clock.now, due, merged_in, patience)


def _sim_boundary(shard: Shard, clock: Clock, l: _SimLearner) -> bool:
    """`after_step` at l's step boundary; True: blocked on a round (come back later)."""
    shard.touch(l.name)  # its Watch keeps the lease
    now = clock.now
    per_period = schedule.steps_per_period(_H, l.cadence, l.estimate)
    for p, f in enumerate(l.frags):
        task = f.task
        if task is not None:
            version = shard.fragments[p].version
            out = task.merged_in is None or version >= task.merged_in
            done = out or now >= task.pushed_at + task.patience
            adopt, _ = schedule.decide_adopt(
                step=l.step, task_step=task.step, done=done, overlap=_TAU, per_period=per_period
            )
            if adopt and not done:
                return True
            if adopt:
                if not out:
                    l.stalls.append((p, task.merged_in or 0))
                elif task.merged_in is None:
                    f.last_sync_step = l.step
                f.version = version if out else f.version
                f.due_at = schedule.next_due(task.due, now, l.cadence)
                f.task = None
        if f.task is None:
            push, f.due_at, _ = schedule.decide_push(
                step=l.step,
                first_step=schedule.offsets(_PLAN.num_fragments, _H)[p],
                last_sync_step=f.last_sync_step,
                due_at=f.due_at,
                now=now,
                period=_H,
                cadence_seconds=l.cadence,
                step_seconds=l.estimate,
            )
            if push:
                _sim_push(shard, clock, l, p)
    return False


def _sim_run(shard: Shard, clock: Clock, learners: list[_SimLearner], until: float) -> None:
    """Runs the learners from now (each joining then) to `until`; then their last pushes."""
    for l in learners:
        shard.touch(l.name)
        for p, f in enumerate(l.frags):  # join: the current version and when to push it
            f.version = shard.fragments[p].version
            f.due_at = schedule.due_after(clock.now, shard.due_in(p, l.name))
    events = [(clock.now + l.compile_seconds, i, False) for i, l in enumerate(learners)]
    while events:
        t, i, blocked = heapq.heappop(events)
        if t > until:
            break
        wake = shard.tick()
        while wake is not None and wake < t:  # the shard's round timers fire first
            clock.now = max(clock.now, wake)
            wake = shard.tick()
        clock.now = max(clock.now, t)
        shard.tick()
        l = learners[i]
        if not blocked:
            l.step += 1
            seconds = l.compile_seconds if l.step == 1 else _STEP * l.rng.uniform(0.9, 1.1)
            l.estimate = l.timer.add(l.step, seconds)
        if _sim_boundary(shard, clock, l):
            heapq.heappush(events, (clock.now + 0.005, i, True))
        else:
            heapq.heappush(events, (clock.now + _STEP * l.rng.uniform(0.9, 1.1), i, False))
    for l in learners:
        for p, f in enumerate(l.frags):
            if f.task is None and l.step > (f.last_sync_step or 0):
                _sim_push(shard, clock, l, p, last=True)


@pytest.mark.parametrize("learners,compile_seconds", [(1, (0.5,)), (2, (2.0, 3.0))])
def test_a_restarted_learner_keeps_every_fragments_cadence(tmp_path, learners, compile_seconds):
    """Learners restarted against shards that served a run: fragment 0 is due at once,
    so they push it at step 1, whose time is the jit compile. Reported as the step time,
    the shard's cadence became H compiles and fragment 0's next round was due that far
    ahead: one learner at quorum 1 did not push it again for 7 s (230 steps) while
    fragment 1 kept its period; two at quorum 2 with slower compiles, 30-36 s, past the
    30 s a sync task waits for its round ("fragment 0: no version 2 after 30 s")."""
    clock = Clock(0.0)
    shard = _sim_shard(tmp_path / "shard", clock, quorum=learners)
    before = [_SimLearner(f"old{i}", 0.5, i) for i in range(learners)]
    _sim_run(shard, clock, before, until=5.0)
    clock.advance(1.0)
    now = [_SimLearner(f"new{i}", c, 10 + i) for i, c in enumerate(compile_seconds)]
    _sim_run(shard, clock, now, until=clock.now + 45.0)
    period = _H * _STEP
    for l in now:
        assert l.pushes[0][:2] == (0, 1)  # the fault's trigger fired: fragment 0 at step 1
        assert all(reported == 0.0 for _, step, _, reported in l.pushes if step <= 2)
        for p in range(_PLAN.num_fragments):
            assert max(l.gaps(p)) < 4 * period, (l.name, p, max(l.gaps(p)))
        assert not l.stalls
    versions = [[f.version for f in l.frags] for l in now]
    assert all(abs(a - b) <= 1 for a, b in zip(*versions)) if learners > 1 else versions
