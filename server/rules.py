"""The syncer shard's decisions: staleness, weights, leases, grace, round closing.

Every decision is a pure function of (state, now) that returns the decision and a
``Reason`` (docs/design.md §1, §3). Nothing here reads a clock, sleeps or locks: the
servicer passes ``now`` (one monotonic clock per process), keeps the state, and arms a
timer at ``CloseDecision.wake_at``. Reasons are short snake_case strings so they can
be used directly as Prometheus label values.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import math
import numbers
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple

from atoll.server.members import Members

LearnerId = str
Seconds = float  # a duration or an instant on the caller's monotonic clock


class Reason(enum.StrEnum):
    """Why a decision came out as it did; the value is the metrics label."""

    # Staleness of a push (judge_staleness).
    FRESH = "fresh"  # base == current: accepted, full weight
    STALE_DISCOUNTED = "stale_discounted"  # 0 < s <= max: accepted, weight * discount
    TOO_STALE = "too_stale"  # s > max: refused, the learner must resync (pull)
    FUTURE_BASE = "future_base"  # base > current: refused as an invalid argument
    # Membership of a push in the open round (judge_membership).
    NEW_IN_ROUND = "new_in_round"  # first contribution of this learner to the round
    ALREADY_IN_ROUND = "already_in_round"  # refused: it already contributed this round
    # Sequence numbers (admit).
    DUPLICATE = "duplicate"  # a retry (same seq: answered with the first answer) or an older seq
    SEQ_TOO_FAR = "seq_too_far"  # refused as invalid: more than MAX_SEQ_JUMP past the newest
    # A push in parts (server/parts.py).
    PART_HELD = "part_held"  # a part is durable and held; the push is judged at its last part
    PARTS_DROPPED = "parts_dropped"  # refused: its parts did not all come in; nothing merged
    # Closing a round (decide_close).
    EMPTY = "empty"  # no contribution yet: nothing to close
    WAITING_FOR_QUORUM = "waiting_for_quorum"  # fewer than K contributors
    WAITING_FOR_JOINERS = "waiting_for_joiners"  # start-up: fewer than K learners have ever joined
    IN_GRACE = "in_grace"  # quorum reached, live learners still missing
    ALL_LIVE_CONTRIBUTED = "all_live_contributed"  # close: nobody live left to wait for
    GRACE_ELAPSED = "grace_elapsed"  # close: the grace window has passed
    QUORUM_UNREACHABLE = "quorum_unreachable"  # close below K: every live learner is in already


def _real(
    name: str,
    x: object,
    *,
    low: float,
    strict: bool = False,
    high: float = math.inf,
    hint: str = "",
) -> float:
    """Checks x is a finite real in [low, high] ((low, high] if strict); returns a float."""
    if isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x):
        value = float(x)
        if (value > low if strict else value >= low) and value <= high:
            return value
    need = f"a finite number {'>' if strict else '>='} {low:g}"
    if high < math.inf:
        need += f" and <= {high:g}"
    raise ValueError(f"{name}={x!r}: need {need}{hint}")


def _int(name: str, x: object, *, low: int, hint: str = "") -> int:
    """Checks x is an int (not a bool) >= low and returns it."""
    if isinstance(x, numbers.Integral) and not isinstance(x, bool) and int(x) >= low:
        return int(x)
    raise ValueError(f"{name}={x!r}: need an int >= {low}{hint}")


@dataclasses.dataclass(frozen=True)
class RoundPolicy:
    """How a shard runs its rounds; validated at construction. The settings have no
    defaults here: ShardConfig holds them (`atoll syncer`'s flags), and the shard passes
    each one on."""

    quorum: int  # K: contributors needed before a round may close; int >= 1
    grace_factor: float  # γ: multiplies the overlap slack; >= 0, 0 = no grace
    max_staleness: int  # s_max: oldest base accepted is current - s_max; int >= 0
    discount_exponent: float  # a in (1+s)^-a for stale pushes; >= 0, 0 = none
    lease_seconds: float  # a learner is live this long after its last call; > 0
    ewma_alpha: float = 0.2  # weight of the newest timing sample; in (0, 1]

    def __post_init__(self) -> None:
        _int("quorum", self.quorum, low=1, hint="; use 1 to close on the first push")
        _real("grace_factor", self.grace_factor, low=0.0, hint="; use 0 to disable grace")
        _int(
            "max_staleness",
            self.max_staleness,
            low=0,
            hint="; use 0 to accept only pushes based on the current version",
        )
        _real(
            "discount_exponent",
            self.discount_exponent,
            low=0.0,
            hint="; use 0 for no staleness discount",
        )
        _real(
            "lease_seconds",
            self.lease_seconds,
            low=0.0,
            strict=True,
            hint="; set it above the learners' longest gap between calls",
        )
        _real("ewma_alpha", self.ewma_alpha, low=0.0, strict=True, high=1.0)


# ---------------------------------------------------------------- staleness, weight


class StalenessVerdict(NamedTuple):
    """Whether a push's base version is acceptable, and at what discount."""

    accept: bool
    reason: Reason
    staleness: int  # current - base; negative for FUTURE_BASE
    discount: float  # multiplies the push's weight; 0.0 when refused


def judge_staleness(
    current_version: int, base_version: int, max_staleness: int, discount_exponent: float
) -> StalenessVerdict:
    """Judges a push by how far its base version lags the fragment's current one.

    Args:
      current_version: the fragment's global version at the shard, >= 0.
      base_version: the version the learner computed its outer gradient from, >= 0.
      max_staleness: s_max; a push with s > s_max is refused (TOO_STALE).
      discount_exponent: a >= 0; an accepted push with staleness s is weighted by
        (1 + s)^-a (a = 0: no discount).

    Returns:
      A StalenessVerdict; e.g. judge_staleness(7, 5, 2, 1.0) accepts with reason
      STALE_DISCOUNTED, staleness 2 and discount 1/3.

    Raises:
      ValueError: on a negative version, max_staleness or exponent.
    """
    current = _int("current_version", current_version, low=0)
    base = _int("base_version", base_version, low=0)
    s_max = _int("max_staleness", max_staleness, low=0)
    a = _real("discount_exponent", discount_exponent, low=0.0)
    s = current - base
    # Future first: such a base was never served, so it is a bug, not lag.
    if s < 0:
        return StalenessVerdict(False, Reason.FUTURE_BASE, s, 0.0)
    if s > s_max:
        return StalenessVerdict(False, Reason.TOO_STALE, s, 0.0)
    if s == 0:
        return StalenessVerdict(True, Reason.FRESH, 0, 1.0)
    return StalenessVerdict(True, Reason.STALE_DISCOUNTED, s, (1.0 + s) ** -a)


def token_weight(tokens: int, inner_steps: int) -> float:
    """A push's merge weight w = tokens² / steps (quantity × tokens per step).

    Args:
      tokens: tokens the learner trained on since the fragment's last sync, >= 1.
      inner_steps: inner steps it took to do so, >= 1.

    Returns:
      The weight as a float; e.g. token_weight(1000, 10) == 100000.0.
    """
    t = _real("tokens", tokens, low=1.0, hint="; a push must carry some training")
    n = _real("inner_steps", inner_steps, low=1.0, hint="; a push must carry some training")
    return t * t / n


MAX_SEQ_JUMP = 1 << 20  # how far past its newest seq (or past 0) a learner's next push may be


class Admission(NamedTuple):
    """The shard's decision on one push (see admit)."""

    accept: bool
    reason: Reason
    staleness: int  # current - base; negative for FUTURE_BASE
    discount: float  # (1 + s)^-a; shrinks the contribution in absolute terms; 0.0 when refused
    weight: float  # token weight tokens² / steps, before the discount; 0.0 when refused
    detail: str  # what the learner should do, for refusals


def _judge_seq(seq: int, newest_seq: int | None) -> Admission | None:
    """The refusal a push's seq alone earns (DUPLICATE, SEQ_TOO_FAR), or None."""
    if newest_seq is not None and seq <= newest_seq:
        detail = (
            "a retry of this learner's newest push"
            if seq == newest_seq
            else f"seq {seq} is older than this learner's newest push ({newest_seq}): "
            "already handled or superseded"
        )
        return Admission(False, Reason.DUPLICATE, 0, 0.0, 0.0, detail)
    # A seq far ahead would lock the learner out for ever (every later push "older"):
    # seqs count pushes, so a real learner never jumps by millions.
    if seq > (newest_seq or 0) + MAX_SEQ_JUMP:
        return Admission(
            False,
            Reason.SEQ_TOO_FAR,
            0,
            0.0,
            0.0,
            f"seq {seq} is more than {MAX_SEQ_JUMP} past this learner's newest "
            f"({newest_seq or 0}): a learner counts its pushes; rejoin to read its seq back",
        )
    return None


def admit(
    *,
    seq: int,
    newest_seq: int | None,
    base_version: int,
    current_version: int,
    in_round: bool,
    tokens: int,
    inner_steps: int,
    policy: RoundPolicy,
) -> Admission:
    """Decides whether one push joins its fragment's open round, and with what weight.

    The one place a push is judged (docs/design.md §1, §2), in this order: a retry of the
    learner's newest push (same seq) or an older seq is a DUPLICATE (the caller answers a
    retry with the first answer); a seq more than MAX_SEQ_JUMP past the newest is
    SEQ_TOO_FAR (an invalid argument); a base from the future is FUTURE_BASE (an invalid
    argument, never lag); a base more than s_max behind is TOO_STALE (resync); a learner
    already in the open round is ALREADY_IN_ROUND; anything else is accepted, FRESH or
    STALE_DISCOUNTED.

    Args:
      seq: the push's per-learner sequence number.
      newest_seq: the seq of this learner's newest answered push for the fragment, or None.
      base_version: the version the outer gradient was computed against.
      current_version: the fragment's version now.
      in_round: whether this learner already contributed to the open round.
      tokens, inner_steps: the training the push carries (both >= 1).
      policy: the shard's RoundPolicy (max_staleness, discount_exponent).

    Returns:
      An Admission; e.g. admit(seq=9, newest_seq=8, base_version=6, current_version=7,
      in_round=False, tokens=100, inner_steps=10, policy=RoundPolicy(quorum=1,
      grace_factor=2.0, max_staleness=4, discount_exponent=1, lease_seconds=30.0))
      accepts with STALE_DISCOUNTED, staleness 1, discount 0.5 and weight 1000.0.
    """
    by_seq = _judge_seq(seq, newest_seq)
    if by_seq is not None:
        return by_seq
    verdict = judge_staleness(
        current_version, base_version, policy.max_staleness, policy.discount_exponent
    )
    if verdict.reason is Reason.FUTURE_BASE:
        return Admission(
            False,
            verdict.reason,
            verdict.staleness,
            0.0,
            0.0,
            f"base_version {base_version} is ahead of the fragment's version {current_version}",
        )
    if not verdict.accept:
        return Admission(
            False,
            verdict.reason,
            verdict.staleness,
            0.0,
            0.0,
            f"base {base_version} is {verdict.staleness} versions behind "
            f"(max {policy.max_staleness}): pull, then go on",
        )
    if in_round:
        return Admission(
            False,
            Reason.ALREADY_IN_ROUND,
            verdict.staleness,
            0.0,
            0.0,
            "this learner is already in the open round",
        )
    return Admission(
        True,
        verdict.reason,
        verdict.staleness,
        verdict.discount,
        token_weight(tokens, inner_steps),
        "",
    )


# ---------------------------------------------------------------- timing, grace, cadence


class Ewma(NamedTuple):
    """An exponentially weighted moving average; value is None until a first sample."""

    value: float | None = None
    samples: int = 0

    def update(self, sample: float, alpha: float) -> Ewma:
        """Returns the average with `sample` folded in (the first sample sets it)."""
        x = _real("sample", sample, low=-math.inf)
        a = _real("alpha", alpha, low=0.0, strict=True, high=1.0)
        if self.value is None:
            return Ewma(x, 1)
        return Ewma(self.value + a * (x - self.value), self.samples + 1)

    def value_or(self, default: float) -> float:
        """The average, or `default` before any sample."""
        return default if self.value is None else self.value


def grace_window(
    grace_factor: float,
    overlap_steps: float,
    step_seconds: float,
    quorum_seconds: float,
    sync_seconds: float,
) -> float:
    """ξ_grace = γ·max(0, τ·ξ_step − ξ_quorum − ξ_sync) (docs/design.md §1).

    The shard only waits inside the slack that the learners' overlap already hides.

    Args:
      grace_factor: γ >= 0.
      overlap_steps: τ >= 0, inner steps a learner computes while a push is in flight.
      step_seconds: ξ_step >= 0, a learner's inner step time.
      quorum_seconds: ξ_quorum >= 0, a round's first push -> quorum reached.
      sync_seconds: ξ_sync >= 0, transfer + merge + outer step.

    Returns:
      The grace window in seconds, never negative; e.g.
      grace_window(1.0, 4, 0.5, 0.5, 0.25) == 1.25.
    """
    g = _real("grace_factor", grace_factor, low=0.0)
    tau = _real("overlap_steps", overlap_steps, low=0.0)
    step = _real("step_seconds", step_seconds, low=0.0)
    quorum = _real("quorum_seconds", quorum_seconds, low=0.0)
    sync = _real("sync_seconds", sync_seconds, low=0.0)
    return g * max(0.0, tau * step - quorum - sync)


# times γ: the shortest grace window, as a share of the period; with the default γ = 2,
# the whole period (the cap below). On a loaded host a learner's push can leave a tenth
# of a period or more after its due time, and one that misses its round joins the next,
# so the learners pull two versions: with γ/8 (a quarter period), 4 learners beside a
# CPU burner pulled 5.0-5.5 bits per parameter per sync, with γ/2 4.3-4.5, at the same
# eval loss over seeds 0-2 (docs/rounds.md "Under load")
GRACE_PERIOD_SHARE = 1 / 2


def estimate_grace(
    policy: RoundPolicy,
    overlap_steps: float,
    step_seconds: float | None,
    sync: Ewma,
    cadence_seconds: float | None = None,
) -> float:
    """The grace window, counted from a round's first push: γ·max(ξ_step, τ·ξ_step − ξ_sync).

    Counted from the first push, the round's own ξ_quorum (first push -> quorum) is
    inside the window, so this is docs/design.md's γ·max(0, τ·ξ_step − ξ_quorum − ξ_sync)
    after quorum with each round's own ξ_quorum, rather than an average that one
    straggler's early push would inflate for every later round.

    `step_seconds` is the slowest live learner's step time: the pushes of one period
    arrive spread by up to one of its steps, since a learner pushes between steps, so
    the window is never shorter than that step (with τ = 1 and a slow merge the formula
    alone gives nothing, and each period's pushes split into two rounds). Nor is it
    shorter than γ/2 of a period (`GRACE_PERIOD_SHARE`): pushes due at one instant also
    arrive spread by their hosts' scheduling and the transfer, which with short steps on
    a busy host is many steps. No step time yet means no grace. Past one period
    (`cadence_seconds`) the next period's pushes are due, so waiting longer would only
    merge two periods at once.
    """
    if step_seconds is None:
        return 0.0
    grace = max(
        policy.grace_factor * step_seconds,
        grace_window(
            policy.grace_factor, overlap_steps, step_seconds, 0.0, max(0.0, sync.value_or(0.0))
        ),
    )
    if cadence_seconds is None:
        return grace
    return min(
        max(grace, policy.grace_factor * GRACE_PERIOD_SHARE * cadence_seconds), cadence_seconds
    )


FAST_CLASS = 1.5  # learners within this factor of the fastest step time pace the cadence together


def cadence(
    period_steps: int,
    step_seconds: Mapping[LearnerId, float],
    live: frozenset[LearnerId] | set[LearnerId],
) -> float | None:
    """The sync period in seconds every learner keeps: H steps of the fastest live islands.

    Dynamic local updates (arXiv 2401.09135): the fastest island takes H inner steps per
    sync, a slower one as many as fit in the same wall-clock time, so every learner
    pushes a fragment once per period whatever its speed (its token weight says how
    much it did). The fastest islands are the live learners within FAST_CLASS of the
    fastest step time, and the pace is their median: learners of one hardware kind
    measure slightly different times, and the smallest of several noisy figures is the
    luckiest one, which would give every learner fewer than H steps per period.

    Args:
      period_steps: H >= 1.
      step_seconds: learner -> its recent seconds per inner step.
      live: the learners with a live lease; only they set the pace.

    Returns:
      H × the median step time of the fastest live learners, or None before any live
      learner reported one; e.g. cadence(32, {"a": 0.125, "b": 0.25}, {"a", "b"}) == 4.0.
    """
    times = sorted(t for m, t in step_seconds.items() if m in live and t > 0)
    return cadence_of_sorted(period_steps, times)


def cadence_of_sorted(period_steps: int, times: Sequence[float]) -> float | None:
    """`cadence` over the live step times (each > 0) already in ascending order: O(log n),
    for a caller that keeps them sorted as they change (server/roster.py)."""
    h = _int("period_steps", period_steps, low=1)
    if not times:
        return None
    k = bisect.bisect_right(times, FAST_CLASS * times[0])  # the fast class: times[:k]
    mid = k // 2
    return h * (times[mid] if k % 2 else (times[mid - 1] + times[mid]) / 2)


# ---------------------------------------------------------------- leases


def live_learners(
    last_seen: Mapping[LearnerId, Seconds], now: Seconds, lease_seconds: float
) -> frozenset[LearnerId]:
    """The learners whose lease holds at `now`.

    Args:
      last_seen: learner id -> instant of its last call (same clock as `now`).
      now: the current instant.
      lease_seconds: > 0; a lease taken at t holds for t <= now < t + lease_seconds.

    Returns:
      The ids of the live learners.
    """
    lease = _real("lease_seconds", lease_seconds, low=0.0, strict=True)
    return frozenset(m for m, seen in last_seen.items() if now < seen + lease)


def next_lease_expiry(
    last_seen: Mapping[LearnerId, Seconds], now: Seconds, lease_seconds: float
) -> Seconds | None:
    """The first instant after `now` at which a live lease lapses, or None."""
    lease = _real("lease_seconds", lease_seconds, low=0.0, strict=True)
    ends = [seen + lease for seen in last_seen.values() if now < seen + lease]
    return min(ends, default=None)


# ---------------------------------------------------------------- rounds


class RoundState(NamedTuple):
    """One fragment's open round: who is in it, when its first push came, when K was hit,
    and when its pushes are due.

    `contributors` is the only record of who is in a round: admission reads it, the
    close rule reads it, snapshots store it. `due_at` is the fragment's schedule (see
    next_due): the instant the shard asked learners to push for this round; None until
    a first round has set the phase or while the cadence is unknown."""

    first_push_at: Seconds | None = None
    contributors: AbstractSet[LearnerId] = frozenset()  # a Members as add_contributor grows it
    quorum_reached_at: Seconds | None = None
    due_at: Seconds | None = None

    @property
    def started_at(self) -> Seconds | None:
        """When the round's grace clock starts: its first push, or its due time if that
        push came early (an early push does not cut short the wait for on-time ones)."""
        if self.first_push_at is None or self.due_at is None:
            return self.first_push_at
        return max(self.first_push_at, self.due_at)

    @property
    def quorum_seconds(self) -> Seconds | None:
        """ξ_quorum sample for this round (first push -> quorum), or None before quorum."""
        if self.quorum_reached_at is None or self.first_push_at is None:
            return None
        return self.quorum_reached_at - self.first_push_at


def open_round(due_at: Seconds | None = None) -> RoundState:
    """A new, empty round, due at `due_at` (None: its first push sets the phase)."""
    return RoundState(due_at=due_at)


MAX_PERIODS_BEHIND = float(1 << 40)  # past this, next_due restarts the schedule at now


def next_due(state: RoundState, now: Seconds, cadence_seconds: float | None) -> Seconds | None:
    """When the round after `state` is due, as the round closes at `now`.

    Each fragment keeps one schedule on the shard's clock, T_{r+1} = T_r + cadence,
    and tells every learner when the next round is due (PushResponse.next_due_seconds),
    so all learners push a fragment at the same instants whatever their speed, and a
    round's close (grace, stragglers) never shifts the next period. The first round's
    phase is its first push. A round that closed more than a period late skips the
    instants already past rather than asking for pushes that are overdue.

    Args:
      state: the round closing (due_at or first_push_at set).
      now: the instant it closes.
      cadence_seconds: the sync period; None or 0 while unknown (no schedule yet).

    Returns:
      The next round's due instant (> now), or None without a cadence or a phase.

    Example:
      >>> next_due(RoundState(10.0, frozenset({"a"}), 10.0, 10.0), 10.5, 3.0)
      13.0
    """
    phase = state.due_at if state.due_at is not None else state.first_push_at
    if not cadence_seconds or phase is None:
        return None
    behind = (now - phase) / cadence_seconds  # ±inf with a cadence of ~1e-300 s (a bogus step time)
    if behind < 1:
        periods = 1
    elif behind < MAX_PERIODS_BEHIND:
        periods = math.floor(behind) + 1
    else:  # too far behind to count periods in: the schedule starts again from now
        return math.nextafter(now + cadence_seconds, math.inf)
    return phase + periods * cadence_seconds


def due_in(
    state: RoundState, now: Seconds, cadence_seconds: float | None, *, in_round: bool
) -> float:
    """Seconds until a learner's next push of this fragment is due; 0 when unknown.

    A learner in the open round pushes next for the round after it (one period after
    this round's due time); one not in it, for the open round itself when that is
    still ahead, otherwise for the round after. Relative seconds, so learners need no
    clock in common with the shard."""
    if not cadence_seconds:
        return 0.0
    due = state.due_at if state.due_at is not None else state.first_push_at
    if due is None:
        return 0.0
    if in_round or due < now - cadence_seconds / 2:
        due = next_due(state._replace(due_at=due), now, cadence_seconds)
        assert due is not None  # the cadence and the phase are both set
        if in_round and state.due_at is not None:
            due = max(due, state.due_at + cadence_seconds)
    return max(0.0, due - now)


class MembershipVerdict(NamedTuple):
    """Whether a learner may contribute to the open round."""

    accept: bool
    reason: Reason


def judge_membership(state: RoundState, learner: LearnerId) -> MembershipVerdict:
    """A learner contributes at most once per round; a second push waits for the next."""
    if learner in state.contributors:
        return MembershipVerdict(False, Reason.ALREADY_IN_ROUND)
    return MembershipVerdict(True, Reason.NEW_IN_ROUND)


def add_contributor(state: RoundState, learner: LearnerId, now: Seconds, quorum: int) -> RoundState:
    """The round with `learner` added, stamping its first push and when K is first met.

    Args:
      state: the open round.
      learner: a learner not yet in state.contributors (see judge_membership).
      now: the instant its push was accepted.
      quorum: K >= 1, the same K later given to decide_close.

    Returns:
      The new RoundState; first_push_at is set by the first contributor,
      quorum_reached_at once, when K is first reached.
    """
    k = _int("quorum", quorum, low=1)
    if learner in state.contributors:
        raise ValueError(
            f"learner {learner!r} already contributed to this round; "
            "check judge_membership before adding"
        )
    # O(1): a frozenset copy here cost a round of n learners O(n²) (server/members.py)
    held = state.contributors
    contributors = (held if isinstance(held, Members) else Members(held)).with_(learner)
    first = now if state.first_push_at is None else state.first_push_at
    reached = state.quorum_reached_at
    if reached is None and len(contributors) >= k:
        reached = now
    return RoundState(first, contributors, reached, state.due_at)


class CloseDecision(NamedTuple):
    """Whether to close the round now; if not, when to look again (None: on a push)."""

    close: bool
    reason: Reason
    wake_at: Seconds | None


def decide_close(
    state: RoundState,
    live: frozenset[LearnerId] | set[LearnerId],
    now: Seconds,
    quorum: int,
    grace_seconds: float,
    joined: int | None = None,
) -> CloseDecision:
    """Decides whether the open round closes at `now`.

    A round gathers the pushes of one sync period. It closes once it has K
    contributors and either every live learner has contributed or the grace window,
    counted from the round's first push, has passed; a push arriving after the close
    joins the next round. Learners whose lease lapsed are not waited for; contributors
    who have since gone still count. When failures leave fewer than K learners live and
    all of them are in, the round closes below quorum (a failed learner never stops the
    run), but only once K learners have ever joined: at start-up the first learner
    does not close rounds alone before the others arrive.

    Args:
      state: the open round (built with add_contributor and the same quorum).
      live: the learners with a live lease at `now` (see live_learners).
      now: the current instant.
      quorum: K >= 1.
      grace_seconds: >= 0, how long after the round's first push to wait for stragglers.
      joined: how many learners the shard has ever known (None: at least K).

    Returns:
      A CloseDecision. While in grace, wake_at is the instant the grace ends, so the
      caller can arm a timer; while waiting for quorum it is None (a push or a lease
      lapse is what can change the answer).
    """
    missing = sum(1 for m in live if m not in state.contributors)
    return decide_close_counted(state, missing, now, quorum, grace_seconds, joined)


def decide_close_counted(
    state: RoundState,
    missing: int,
    now: Seconds,
    quorum: int,
    grace_seconds: float,
    joined: int | None = None,
) -> CloseDecision:
    """`decide_close` given only how many live learners are not in the round (`missing`,
    |live − contributors|), for a caller that keeps that count as leases and the round
    change (server/roster.py) rather than compare sets at every push."""
    k = _int("quorum", quorum, low=1)
    grace = _real("grace_seconds", grace_seconds, low=0.0)
    if not state.contributors:
        return CloseDecision(False, Reason.EMPTY, None)
    if len(state.contributors) < k:
        if missing:
            return CloseDecision(False, Reason.WAITING_FOR_QUORUM, None)
        if joined is not None and joined < k:
            return CloseDecision(False, Reason.WAITING_FOR_JOINERS, None)
        return CloseDecision(True, Reason.QUORUM_UNREACHABLE, None)
    if state.quorum_reached_at is None or state.first_push_at is None:
        raise ValueError(
            f"round has {len(state.contributors)} >= quorum={k} contributors "
            "but no quorum_reached_at; pass decide_close the quorum given "
            "to add_contributor"
        )
    if not missing:
        return CloseDecision(True, Reason.ALL_LIVE_CONTRIBUTED, None)
    started = state.started_at
    assert started is not None  # first_push_at is set
    ends = started + grace
    if now >= ends:
        return CloseDecision(True, Reason.GRACE_ELAPSED, None)
    return CloseDecision(False, Reason.IN_GRACE, ends)
