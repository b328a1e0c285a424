"""The learner's sync schedule: when each fragment pushes, how far it runs ahead of a
round in flight, and when it takes the next round instead (docs/design.md §1).

Every rule is a pure function of the fragment's state and `now` (an instant on the
learner's one monotonic clock, which the caller reads and passes), the way
`server/rules.py` keeps the shard's: nothing here reads a clock, sleeps or locks, so a
test drives the schedule on a fake clock (tests/test_schedule.py, tests/test_cadence.py).
Decisions come with a `Reason`.

Fragment p first syncs at step t_p = round((p+1)·H/P) (`offsets`), spread over the
period so the link carries one fragment at a time. After that the shard names the
period T (H steps of the fastest live learners) and, with each answer, when this
learner's next push of p is due; the learner pushes at the step boundary nearest that
instant (`sync_due`), so a fast island takes about H steps per sync, a 2× slower one
about H/2, and a round gathers one push per learner per period.

Synchronous semantics (`wait_for_rounds`, K = M) keep to step counts instead: fragment
p pushes at t_p + kH (`sync_step`), never skips a round, and adopts each round exactly τ
steps after its push, waiting for it there if it is late (Streaming DiLoCo's overlap):
a run's trajectory does not depend on when its rounds close, and no two learners can
each wait on a round that needs the other's next push (τ < H).
"""

from __future__ import annotations

import collections
import enum
import math

Seconds = float  # a duration, or an instant on the learner's monotonic clock

STEP_WINDOW = 128  # recent steps whose mean is this learner's step time (what the cadence follows)
# ... and at least this many periods of them: on a loaded host each learner's pace swings
# 3-6x for seconds at a time as other processes take the cores, and the shards pace the
# cadence by the fastest learners. Over 2 periods (128 steps at H = 64) the fastest at any
# moment is the luckiest one just then, so the period held ~0.6 H steps of the run's
# actual pace and fragments took 1.6-1.8 outer steps per H steps; over 16 periods each
# learner's figure is its own long-run pace, and the fastest is the one that really is.
STEP_WINDOW_PERIODS = 16
STEP_WARMUP = 2  # the first steps after joining are not counted (they compile)
# Periods a fragment trains on while its push waits in an open round before the learner
# waits for that round: 2 lets a push that just missed a close (back one period plus a
# grace window later) go by without a stall.
RUN_AHEAD_PERIODS = 2
# Periods of steps a sync task waits for the round holding its push (if longer than the
# configured patience) before the fragment goes on without it
PATIENCE_PERIODS = 4


class Reason(enum.StrEnum):
    """Why a fragment's decision at a step boundary came out as it did."""

    # Adopting a sync task's result (decide_adopt).
    IN_FLIGHT = "in_flight"  # not done, and the run-ahead is not spent: train on
    OVERLAPPING = "overlapping"  # done, but fewer than τ steps since its push: train on
    READY = "ready"  # done and τ steps past its push: adopt
    OVERDUE = "overdue"  # the run-ahead is spent: adopt, waiting for the task if need be
    # Starting a push (decide_push).
    NOT_DUE = "not_due"  # before the fragment's due step boundary
    DUE = "due"  # the step boundary nearest the due time (or t_p, then every H steps)
    NEXT_ROUND = "next_round"  # due, but too little done since the last push: a period later


def offsets(num_fragments: int, period: int) -> list[int]:
    """t_p in [1, H]: the step of each fragment's first sync, spread over the period.

    Example:
      >>> offsets(4, 32)
      [8, 16, 24, 32]
    """
    return [max(1, round((p + 1) * period / num_fragments)) for p in range(num_fragments)]


def steps_per_period(
    period: int,
    cadence_seconds: Seconds | None,
    step_seconds: Seconds,
    wait_for_rounds: bool = False,
) -> int:
    """Inner steps this learner takes in one sync period: H until the shard names a
    cadence, then as many of its own steps as fit in it (at least 1); always H with
    synchronous semantics (`wait_for_rounds`: sync points go by step count).

    Example:
      >>> steps_per_period(32, 3.2, 0.2)  # a learner half as fast as the fastest
      16
    """
    if wait_for_rounds or not cadence_seconds or step_seconds <= 0:
        return period
    return max(1, round(cadence_seconds / step_seconds))


def sync_due(
    *,
    step: int,
    first_step: int,
    last_sync_step: int | None,
    due_at: Seconds | None,
    now: Seconds,
    period: int,
    step_seconds: Seconds,
) -> bool:
    """Whether fragment p's next push starts at this step boundary (no push in flight).

    Args:
      step: inner steps done since joining.
      first_step: t_p, the fragment's first sync step (staggered over the period).
      last_sync_step: the step of the fragment's last push, or None before the first.
      due_at: when the shard asked for this learner's next push of the fragment
        (PushResponse.next_due_seconds after its last push), on this learner's
        monotonic clock; None when not known.
      now: the same clock, at this step boundary.
      period: H, inner steps per sync of the fastest learner.
      step_seconds: this learner's recent seconds per inner step.

    Returns:
      True at the step boundary nearest to `due_at`, so every learner, fast or slow,
      pushes once per period and within a step of the others; with no due time, at t_p
      first and then every H steps.

    Example:
      >>> sync_due(step=40, first_step=8, last_sync_step=8, due_at=103.15, now=103.1,
      ...          period=32, step_seconds=0.2)
      True
    """
    if step <= (last_sync_step or 0):
        return False
    if due_at is None:
        return step >= first_step if last_sync_step is None else step - last_sync_step >= period
    return now + step_seconds / 2 >= due_at


def sync_step(first_step: int, last_sync_step: int | None, period: int) -> int:
    """The step of fragment p's next sync point on the step-count grid t_p + kH: the
    first one after `last_sync_step` (t_p itself before any push).

    Synchronous semantics (`wait_for_rounds`) keep to this grid: every learner pushes its
    k-th round of p at the same step count, and waits for it H steps later at most, so a
    learner only ever waits on learners that are behind it in steps and no two can each
    wait on the other (with the shard's wall-clock due times, pushes of one round came at
    different step counts on different learners, and K = M rounds deadlocked).

    Example:
      >>> sync_step(8, None, 32), sync_step(8, 8, 32), sync_step(8, 50, 32)
      (8, 40, 72)
    """
    if last_sync_step is None or last_sync_step < first_step:
        return first_step
    return first_step + ((last_sync_step - first_step) // period + 1) * period


def take_next_round(
    *,
    step: int,
    last_sync_step: int | None,
    due_at: Seconds | None,
    now: Seconds,
    cadence_seconds: Seconds | None,
    step_seconds: Seconds,
    per_period: int,
) -> Seconds | None:
    """The due time to keep: `due_at` one cadence later when the push is due with less
    than half a period of steps done since the last one (the learner just joined, or its
    last round came back late), so this learner takes the next round instead.

    Example:
      >>> take_next_round(step=12, last_sync_step=10, due_at=50.0, now=50.0,
      ...                 cadence_seconds=6.4, step_seconds=0.2, per_period=32)
      56.4
    """
    if (
        due_at is not None
        and cadence_seconds
        and now + step_seconds / 2 >= due_at
        and step - (last_sync_step or 0) < max(1, per_period // 2)
    ):
        return due_at + cadence_seconds
    return due_at


def decide_push(
    *,
    step: int,
    first_step: int,
    last_sync_step: int | None,
    due_at: Seconds | None,
    now: Seconds,
    period: int,
    cadence_seconds: Seconds | None,
    step_seconds: Seconds,
    wait_for_rounds: bool = False,
) -> tuple[bool, Seconds | None, Reason]:
    """Whether an idle fragment starts its push at this step boundary.

    Args: as `sync_due`, with `cadence_seconds` the shards' sync period (None: not known)
      and `wait_for_rounds` synchronous semantics.

    Returns:
      (push, the fragment's due time from now on, reason): `take_next_round` first, then
      `sync_due`; with `wait_for_rounds`, at the step-count grid's points (`sync_step`),
      the due time ignored and never a round skipped.

    Example:
      >>> decide_push(step=40, first_step=8, last_sync_step=8, due_at=103.15, now=103.1,
      ...             period=32, cadence_seconds=6.4, step_seconds=0.2)
      (True, 103.15, <Reason.DUE: 'due'>)
    """
    if wait_for_rounds:
        due = step >= sync_step(first_step, last_sync_step, period)
        return due, due_at, Reason.DUE if due else Reason.NOT_DUE
    per_period = steps_per_period(period, cadence_seconds, step_seconds)
    moved = take_next_round(
        step=step,
        last_sync_step=last_sync_step,
        due_at=due_at,
        now=now,
        cadence_seconds=cadence_seconds,
        step_seconds=step_seconds,
        per_period=per_period,
    )
    due = sync_due(
        step=step,
        first_step=first_step,
        last_sync_step=last_sync_step,
        due_at=moved,
        now=now,
        period=period,
        step_seconds=step_seconds,
    )
    if due:
        return True, moved, Reason.DUE
    return False, moved, Reason.NEXT_ROUND if moved != due_at else Reason.NOT_DUE


def decide_adopt(
    *,
    step: int,
    task_step: int,
    done: bool,
    overlap: int,
    per_period: int,
    wait_for_rounds: bool = False,
) -> tuple[bool, Reason]:
    """Whether a fragment with a sync task adopts its result at this step boundary.

    A round still open after τ steps (one that waits on slower learners, or a push that
    just missed a close and joined the next round, back about a period later) does not
    stop training: the fragment trains on and adopts when the round is back (with the
    steps made meanwhile). Only a round RUN_AHEAD_PERIODS late is waited for, so a
    fragment's local drift stays bounded. With synchronous semantics the round is
    adopted exactly τ steps after its push, waited for there if need be: where the
    learner adopts never depends on when the round closed, so a synchronous run is the
    same run on a loaded host as on an idle one.

    Args:
      step: inner steps done since joining.
      task_step: the step the task was started at.
      done: whether the task has finished.
      overlap: τ, steps trained before a finished task is adopted.
      per_period: this learner's steps per sync period (`steps_per_period`, given
        the same `wait_for_rounds`).
      wait_for_rounds: synchronous semantics, adopt at τ steps, never later.

    Returns:
      (adopt, reason); adopt with `done` False means the caller waits for the task.

    Example:
      >>> decide_adopt(step=70, task_step=40, done=False, overlap=1, per_period=32)
      (False, <Reason.IN_FLIGHT: 'in_flight'>)
    """
    if done and step >= task_step + overlap:
        return True, Reason.READY
    late = overlap if wait_for_rounds else RUN_AHEAD_PERIODS * per_period
    if step - task_step >= late:
        return True, Reason.OVERDUE
    return False, Reason.OVERLAPPING if done else Reason.IN_FLIGHT


def due_after(sent: Seconds, next_due_seconds: Seconds) -> Seconds | None:
    """The instant a shard's relative due time (`next_due_seconds`, 0: none) names on
    this learner's clock: relative, so the two need no clock in common.

    Counted from `sent`, when the call that brought it left this learner, not from its
    answer: the shard counted from a moment in between, so the learner's instant is early
    by at most the call's one-way time, which the next push spends getting there. Counted
    from the answer, every push aimed late by both ways, against a grace window of an
    eighth of a period (on a loaded 2-core host, ~0.15 s), and a push that misses its
    round joins the next and skips a period."""
    return sent + next_due_seconds if next_due_seconds > 0 else None


def next_due(
    due_at: Seconds | None, now: Seconds, cadence_seconds: Seconds | None
) -> Seconds | None:
    """The shard's due time, or one period from `now` when the shard gave none (and a
    cadence is known)."""
    if due_at is not None or not cadence_seconds:
        return due_at
    return now + cadence_seconds


def round_patience(patience: Seconds, period: int, step_seconds: Seconds) -> Seconds:
    """Seconds a sync task waits for the round holding its push: the configured patience,
    or PATIENCE_PERIODS periods of this learner's steps if that is longer."""
    return max(patience, PATIENCE_PERIODS * period * step_seconds)


class StepTimer:
    """A learner's seconds per inner step, the figure the shards' cadence is built from:
    the plain mean of the last STEP_WINDOW steps, the first STEP_WARMUP after joining left
    out (they compile).

    Long steps count: on a busy host most steps are quick and a few wait for a core
    (measured with 4 learners on 2 cores: 3 ms typical, one in ~20 at 20-150 ms, 7 ms
    mean). A period must hold H steps of wall time; a median or a trimmed mean gave a
    cadence half that long, so rounds came due twice as often as learners pushed and
    half the pushes arrived a version stale."""

    @classmethod
    def for_period(cls, period: int) -> StepTimer:
        """A timer whose window spans STEP_WINDOW_PERIODS periods of H steps (at least
        STEP_WINDOW steps): the pace a period's wall time actually holds."""
        return cls(max(STEP_WINDOW, STEP_WINDOW_PERIODS * period))

    def __init__(self, window: int = STEP_WINDOW, warmup: int = STEP_WARMUP):
        self.warmup = warmup
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        # the window's running sum: np.mean of the deque cost ~0.25 ms a step on a loaded
        # host, on the training thread; summed afresh once per window, so no drift builds
        self._total = 0.0
        self._added = 0

    def add(self, step: int, seconds: Seconds) -> Seconds:
        """Records step `step` (counted from 1 since joining); returns the estimate (the
        step's own time until a counted step is in: a compile never enters the window,
        which a loop that compiles in its first step, as a library user's does, needs)."""
        if step > self.warmup:
            recent = self.recent
            evicted = recent[0] if len(recent) == recent.maxlen else 0.0
            recent.append(float(seconds))
            self._added += 1
            if self._added % (recent.maxlen or 1) == 0:
                self._total = math.fsum(recent)
            else:
                self._total += float(seconds) - evicted
        return self._total / len(self.recent) if self.recent else float(seconds)

    @property
    def measured(self) -> Seconds:
        """The mean of the counted steps; 0.0 before any (STEP_WARMUP steps in).

        This, not `add`'s estimate, is what a push reports: the shards build the
        cadence, and each round's next due time, from it. A compile step's time reported
        as the pace (a push at step 1: a restarted learner due at once, or t_p = 1) gave
        a cadence of H compiles, and the fragment whose round closed on it was next due
        that far ahead, 5-11 s while the others kept their period; 0 tells the shards
        "not known yet", and they keep the cadence they have."""
        return self._total / len(self.recent) if self.recent else 0.0
