"""Who a shard hears from, kept as it changes: leases, timings, finished marks, the learners
it has known, and what its decisions read of them (the live set, the pace, the grace
inputs, how many live learners each open round still waits for).

Each is what the shard once recomputed from scratch at every push, in time proportional
to every learner it remembered (a round of n learners cost O(n²)); here each is updated
when it changes, so a push costs the same whatever the crowd:

- live: the learners whose lease holds (`rules.live_learners` over `last_seen`). A lease
  starts at a learner's first call or after a lapse, and lapses when a lazy heap of lease
  starts says so (`advance`); renewing a live lease is one heap push.
- done: learners whose last push of some fragment came in (`finished`, per fragment).
- pacers: live learners with a timing that are not done; they set the cadence
  (`rules.cadence` of the smallest H among them): their step times kept sorted, their
  H's counted.
- the grace inputs (`ShardState._grace`): the slowest step and the largest τ of the live.
- joined: |known ∪ leased|, the learners the shard has ever known.
- per fragment p, missing(p) = |(live − finished[p]) − contributors_p|, which is all
  `rules.decide_close` asks of the live set: the round's contributors as last seen by
  `sync_round`, how many live learners are finished on p, and how many contributors are
  live and not finished on p.

Costs: renewing a live lease or a timing, O(log n) (a heap push; a sorted-list search and
a move of at most n pointers); a lease that starts or lapses, or a learner forgotten,
O(F) (F: fragments here); a new round or a restart, one count over it. Not thread-safe:
the shard calls it under its `lock`. The instant it has reached never goes back: a
decision passed an earlier `now` (a call whose clock read lost a race to the lock) sees
the leases of the latest one.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import NamedTuple

from atoll.server import rules
from atoll.server.members import Members


class Timing(NamedTuple):
    """What a learner's last push said of its pace (validated by PushHeader.problem)."""

    step_seconds: float  # its recent seconds per inner step; 0: not measured yet
    overlap_steps: int  # τ
    period_steps: int  # H; 0: not given


def _count(counter: dict[int, int], key: int, sign: int) -> None:
    n = counter.get(key, 0) + sign
    if n:
        counter[key] = n
    else:
        del counter[key]


def _sorted(values: list[float], x: float, sign: int) -> None:
    if sign > 0:
        bisect.insort(values, x)
    else:
        i = bisect.bisect_left(values, x)
        assert values[i] == x, "a step time left that was never indexed"
        del values[i]


class Roster:
    """Leases, timings, finished marks and known learners, with what decisions read of them.

    `last_seen`, `timings`, `known` and `finished` are the state (the shard shows them as
    its own); everything else is derived, and `rebuild` derives it again from them."""

    def __init__(self, lease_seconds: float):
        self.lease = lease_seconds
        self.last_seen: dict[str, float] = {}  # learner -> instant of its last call
        self.timings: dict[str, Timing] = {}  # learner -> the timing its last push reported
        self.known: set[str] = set()  # learners whose pushes some fragment holds
        # fragment -> learners whose last push of it came in (PushHeader.last)
        self.finished: collections.defaultdict[int, set[str]] = collections.defaultdict(set)
        self._dropped: list[int] = []  # fragments gone, to forget at the next advance
        self._peak = 0  # the most learners leased at once since the tables last shrank
        self._reset_derived(-math.inf)

    def _reset_derived(self, now: float) -> None:
        self._now = now  # the latest instant advanced to
        self.live: set[str] = set()
        self._lapse: list[tuple[float, str]] = []  # (seen, learner) of leases, lazily deleted
        self._forget: list[tuple[float, str]] = []  # (seen, learner) of lapsed ones, lazily
        self._done: dict[str, int] = {}  # learner -> fragments it finished (only if > 0)
        self._unknown_leased = 0  # |last_seen − known|
        self._live_steps: list[float] = []  # step times > 0 of the live, sorted
        self._live_overlaps: dict[int, int] = {}  # τ of the live -> how many
        self._pacer_steps: list[float] = []  # step times > 0 of the pacers, sorted
        self._pacer_periods: dict[int, int] = {}  # H > 0 of the pacers -> how many
        self._fin_live: dict[int, int] = {}  # p -> |live ∩ finished[p]|
        self._rounds: dict[int, AbstractSet[str]] = {}  # p -> its contributors, as last synced
        self._in_waited: dict[int, int] = {}  # p -> |contributors_p ∩ live − finished[p]|

    # ------------------------------------------------------------ what decisions read

    @property
    def joined(self) -> int:
        """Learners the shard knows: any with a lease, any whose push it holds."""
        return len(self.known) + self._unknown_leased

    def missing(self, p: int) -> int:
        """Live learners not finished on p that fragment p's round (as synced) lacks."""
        return len(self.live) - self._fin_live.get(p, 0) - self._in_waited.get(p, 0)

    def cadence(self) -> float | None:
        """The pacers' `rules.cadence`, or None while none reported H and a step time."""
        if not self._pacer_periods:
            return None
        return rules.cadence_of_sorted(min(self._pacer_periods), self._pacer_steps)

    def slowest_step(self) -> float | None:
        """The slowest step time (> 0) of the live learners, or None."""
        return self._live_steps[-1] if self._live_steps else None

    def largest_overlap(self) -> int:
        """The largest τ of the live learners with a timing (0: none)."""
        return max(self._live_overlaps, default=0)

    def next_expiry(self, now: float) -> float | None:
        """The first instant after `now` at which a live lease lapses, or None."""
        self.advance(now)
        heap = self._lapse
        while heap and self.last_seen.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # a lease renewed since, or forgotten
        return heap[0][0] + self.lease if heap else None

    # ------------------------------------------------------------ events

    def advance(self, now: float) -> None:
        """Lapses the leases that end by `now`."""
        self._take_up_drops()
        now = max(now, self._now)
        self._now = now
        heap = self._lapse
        while heap and not now < heap[0][0] + self.lease:
            seen, m = heapq.heappop(heap)
            if self.last_seen.get(m) == seen and m in self.live:
                self._set_live(m, False)
                heapq.heappush(self._forget, (seen, m))

    def renew(self, m: str, seen: float) -> None:
        """A call from `m` at `seen`: its lease starts or runs on."""
        if m not in self.last_seen:
            self._unknown_leased += m not in self.known
            self._peak = max(self._peak, len(self.last_seen) + 1)
        self.last_seen[m] = seen
        if self._now < seen + self.lease:
            heapq.heappush(self._lapse, (seen, m))
            if m not in self.live:
                self._set_live(m, True)
        else:  # renewed to an instant already past its lease (its call lost a race)
            if m in self.live:
                self._set_live(m, False)
            heapq.heappush(self._forget, (seen, m))
        if len(self._lapse) > 2 * len(self.live) + 64:  # stale entries: compact
            self._lapse = [(self.last_seen[x], x) for x in self.live]
            heapq.heapify(self._lapse)

    def heard(self, m: str, timing: Timing) -> None:
        """`m`'s push brought its timing."""
        self._index(m, -1)
        self.timings[m] = timing
        self._index(m, +1)

    def know(self, m: str) -> None:
        """Some fragment holds a push of `m`'s."""
        if m not in self.known:
            self.known.add(m)
            if m in self.last_seen:
                self._unknown_leased -= 1

    def mark_finished(self, p: int, m: str, last: bool) -> None:
        """`m`'s push of p was its last of p (or, not, it pushes p again)."""
        fin = self.finished[p]
        if last == (m in fin):
            return
        sign = 1 if last else -1
        if last:
            fin.add(m)
        else:
            fin.discard(m)
        if m in self.live:
            self._fin_live[p] = self._fin_live.get(p, 0) + sign
            if m in self._rounds.get(p, ()):
                self._in_waited[p] -= sign
        done = self._done.get(m, 0)
        if (done + sign > 0) != (done > 0):
            self._index(m, -1)
        if done + sign:
            self._done[m] = done + sign
        else:
            del self._done[m]
        if (done + sign > 0) != (done > 0):
            self._index(m, +1)

    def sync_round(self, p: int, contributors: AbstractSet[str]) -> None:
        """Fragment p's open round holds `contributors` now (O(1) when it grew by one)."""
        held = self._rounds.get(p)
        if contributors is held:
            return
        added = None
        if held is not None and isinstance(contributors, Members):
            added = contributors.added_since(held)
        self._rounds[p] = contributors
        fin = self.finished.get(p, ())
        if added is not None:
            if added in self.live and added not in fin:
                self._in_waited[p] += 1
            return
        self._in_waited[p] = sum(1 for m in contributors if m in self.live and m not in fin)

    def forget(self, horizon: float, quorum: int) -> list[str]:
        """Forgets the learners last seen before `horizon`: their lease, timing and finished
        marks (`known` keeps at least `quorum` of them); returns them, oldest first."""
        gone = []
        heap = self._forget
        while heap and heap[0][0] < horizon:
            seen, m = heapq.heappop(heap)
            if self.last_seen.get(m) != seen or m in self.live:
                continue  # called again since
            gone.append(m)
            del self.last_seen[m]
            if m not in self.known:
                self._unknown_leased -= 1
            self.timings.pop(m, None)
            if len(self.known) > quorum:
                self.known.discard(m)
            for fin in self.finished.values():
                fin.discard(m)
            self._done.pop(m, None)
        if gone and self._peak > 4 * len(self.last_seen) + 1024:
            self._shrink()
        return gone

    def _shrink(self) -> None:
        """Gives back the hash tables a crowd that has left grew (a dict never shrinks as
        entries go), in place: the shard holds the same objects."""
        tables: list[dict[str, float] | dict[str, Timing] | dict[str, int] | set[str]]
        tables = [self.last_seen, self.timings, self._done, self.known, self.live]
        for table in [*tables, *self.finished.values()]:
            held = table.copy()
            table.clear()
            table.update(held)  # type: ignore[arg-type]
        self._peak = len(self.last_seen)

    def drop_fragment(self, p: int) -> None:
        """Fragment p is no longer here: forgotten at the next `advance` (this alone may be
        called without the shard's lock; a list append is atomic)."""
        self._dropped.append(p)

    def _take_up_drops(self) -> None:
        while self._dropped:
            self._drop_now(self._dropped.pop(0))

    def _drop_now(self, p: int) -> None:
        for m in list(self.finished.get(p, ())):
            self.mark_finished(p, m, False)
        self.finished.pop(p, None)
        self._fin_live.pop(p, None)
        self._rounds.pop(p, None)
        self._in_waited.pop(p, None)

    def rebuild(self, now: float, rounds: Mapping[int, AbstractSet[str]]) -> None:
        """Derives everything again from the state (after recovery wrote it directly)."""
        while self._dropped:
            self.finished.pop(self._dropped.pop(0), None)
        self._reset_derived(now)
        for m in self.last_seen:
            self._unknown_leased += m not in self.known
        for fin in self.finished.values():
            for m in fin:
                self._done[m] = self._done.get(m, 0) + 1
        for m, seen in self.last_seen.items():
            if now < seen + self.lease:
                heapq.heappush(self._lapse, (seen, m))
                self._set_live(m, True)
            else:
                heapq.heappush(self._forget, (seen, m))
        for p, contributors in rounds.items():
            self.sync_round(p, contributors)

    # ------------------------------------------------------------ indexes

    def _set_live(self, m: str, live: bool) -> None:
        """`m`'s lease starts (live) or lapses: every index that counts the live."""
        sign = 1 if live else -1
        if not live:
            self._index(m, -1)
            self.live.discard(m)
        else:
            self.live.add(m)
            self._index(m, +1)
        for p, fin in self.finished.items():
            if m in fin:
                self._fin_live[p] = self._fin_live.get(p, 0) + sign
        for p, contributors in self._rounds.items():
            if m in contributors and m not in self.finished.get(p, ()):
                self._in_waited[p] += sign

    def _index(self, m: str, sign: int) -> None:
        """Adds (+1) or takes out (-1) `m`'s timing in the indexes its status puts it in."""
        t = self.timings.get(m)
        if t is None or m not in self.live:
            return
        if t.step_seconds > 0:
            _sorted(self._live_steps, t.step_seconds, sign)
        _count(self._live_overlaps, t.overlap_steps, sign)
        if m in self._done:
            return
        if t.step_seconds > 0:
            _sorted(self._pacer_steps, t.step_seconds, sign)
        if t.period_steps > 0:
            _count(self._pacer_periods, t.period_steps, sign)
