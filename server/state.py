"""What every part of a shard shares: its settings, clock and storage, its plan, fragment
map and fragments, the locks over them, and the plumbing each part calls (the log, the
fragment a call names, a fragment's lock).

`ShardState(cfg, clock, log=..., snapshots=...)` builds it alone, as tests may; the
shard's jobs are written over it: the calls (`server/shard.py`), recovery and snapshots
(`server/recovery.py`) and moves (`server/moves.py`). Locks, always taken in this
order: `init_lock`, a fragment's lock, `lock`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import pathlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from atoll.server import log_damage, merge, rules, storage
from atoll.server.config import ShardConfig
from atoll.server.fragment import Fragment
from atoll.server.metrics import FragmentGauges, ScrapeGauges, ShardMetrics
from atoll.server.part_commit import PartCommit
from atoll.server.refusal import ShardError, Why
from atoll.server.roster import Roster
from atoll.server.seed_parts import SeedParts
from atoll.server.snapshots import SnapshotStorage, SnapshotStore
from atoll.wire import codec
from atoll.wire.client import FRAGMENT_KEY, MAP_VERSION_KEY, OWNER_KEY
from atoll.wire.plan import FragmentMap, FragmentPlan

log = logging.getLogger("atoll.syncer")
MAX_ABS_VALUE = (
    1e9  # |outer gradient| or |initial weight| per element; training that far off has diverged
)


class PeriodCount(NamedTuple):
    """Outer steps a fragment took against the sync periods that elapsed meanwhile."""

    closes: int = 0
    periods: float = 0.0  # Σ (time between closes / the cadence then)
    last_close_at: float | None = None

    def closed(self, now: float, cadence_seconds: float | None) -> PeriodCount:
        """The count with one more close at `now` (periods advance once the cadence is known)."""
        if self.last_close_at is None or not cadence_seconds:
            return PeriodCount(self.closes + 1, self.periods, now)
        return PeriodCount(
            self.closes + 1, self.periods + (now - self.last_close_at) / cadence_seconds, now
        )

    @property
    def outer_steps_per_period(self) -> float | None:
        """Closes after the first per elapsed period (1.0: one outer step per period)."""
        return (self.closes - 1) / self.periods if self.periods > 0 else None


def _magnitude_problem(codes: codec.Codes, segments: merge.Segments) -> str | None:
    """Why an outer gradient (as its frame's checked codes) could overflow the merge, or None.

    Read from the codes, never a float32 copy: per-tensor norms in float64 (the merge's
    own, `Codes.range_sq_norms`) bound every element, so only a tensor whose norm passes
    MAX_ABS_VALUE needs the exact per-element check (`Codes.range_max_abs`). Live pushes
    and replayed records run this same check on the same codes."""
    try:
        sq = codes.range_sq_norms(segments.offsets, segments.ends)
    except codec.CodecError:  # float64 sums of finite codes are finite; refuse all the same
        return "values whose squares overflow: a diverged learner's update is not merged"
    norms = np.sqrt(sq)
    if not np.all(np.isfinite(norms)):
        bad = int(np.argmin(np.isfinite(norms)))
        return f"tensor {bad} of the fragment has values whose squares overflow"
    big = norms > MAX_ABS_VALUE
    if np.any(big):
        peaks = codes.range_max_abs(segments.offsets[big], segments.ends[big])
        if float(peaks.max(initial=0.0)) > MAX_ABS_VALUE:
            return f"values beyond ±{MAX_ABS_VALUE:g}: a diverged learner's update is not merged"
    return None


class RecoveryError(RuntimeError):
    """A log record that cannot be applied; the message names it and the way forward."""


class RecoveryStopped(Exception):
    """Recovery ended early because the process is stopping; nothing was written."""


def _same_move(held: FragmentMap | None, p: int, new: FragmentMap) -> bool:
    """Whether `held` already says what `new` says of fragment p (the same move)."""
    return (
        held is not None and held.owner(p) == new.owner(p) and held.moved_at[p] == new.moved_at[p]
    )


class ShardState:
    """A shard's state and plumbing, no calls: create, then give it to the jobs.

    `clock`, `log` and `snapshots` are the shard's only contact with time and disk: by
    default the monotonic clock and a WriteAheadLog and SnapshotStore in cfg.data_dir;
    tests pass a fake clock and in-memory storage (tests/test_shard_memory.py)."""

    def __init__(
        self,
        cfg: ShardConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        log: storage.Log | None = None,
        snapshots: SnapshotStorage | None = None,
    ):
        self.cfg = cfg
        self.clock = clock
        self.policy = cfg.round_policy()
        data = pathlib.Path(cfg.data_dir)
        # a damaged log opens as a DamagedLog: recovery then says why, and serves nothing
        self.wal: storage.Log = log if log is not None else log_damage.open_log(data / "wal")
        self.snapshots: SnapshotStorage = (
            snapshots if snapshots is not None else SnapshotStore(data / "snapshots")
        )
        # Locks, always taken in this order: init_lock, a fragment's lock, lock.
        self.init_lock = threading.Lock()  # Init calls, one at a time (the first adopts the plan)
        # seeds in parts in progress, under init_lock; a stale run's go after the parts' wait
        self.seeds = SeedParts(clock, cfg.part_wait_leases * cfg.lease_seconds)
        self.lock = (
            threading.Lock()
        )  # shard-wide state (leases, timings, cadence); never held over I/O or a merge
        self.changed = threading.Condition(self.lock)
        self.snapshot_lock = threading.Lock()  # one snapshot written at a time
        self.pool = merge.AccumulatorPool()  # its own lock, taken under a fragment's (last)
        self.part_commit = PartCommit()  # parts of one push share an fsync; its own lock
        self._snapshotting = False  # a background snapshot is under way (under lock)
        self._snapshot_thread: threading.Thread | None = None
        self.listeners: list[
            Callable[[], None]
        ] = []  # called under the lock when a version changes; must not block
        self.ready = False
        self.recovery_error: str | None = (
            None  # why recovery stopped; the shard then serves nothing
        )
        self.metrics = ShardMetrics(cfg.shard_index, gauges=self._gauges)
        self._reset()

    def _reset(self) -> None:
        """The state before recovery: no plan, no fragments, nothing replayed."""
        self.plan: FragmentPlan | None = None
        self.fragment_map: FragmentMap | None = None  # who owns which fragment (with the plan)
        # fragments being moved away: p -> the map that gives p its new owner (durable)
        self.frozen: dict[int, FragmentMap] = {}
        self.frozen_since: dict[int, float] = {}  # when each froze, by this process's clock
        # p -> the LSN of its FREEZE record: the move id an Export hands its target (durable)
        self.freeze_lsns: dict[int, int] = {}
        # frozen fragments whose state an Export handed out since they froze (not durable:
        # after a restart, Commit waits for one more Export)
        self.exported: set[int] = set()
        self.fragments: dict[int, Fragment] = {}
        # leases, timings, finished marks and known learners, with what the rounds' decisions
        # read of them kept as they change (server/roster.py; under self.lock). Not durable:
        # after a restart every learner a fragment holds an answer of has a fresh lease.
        self.roster = Roster(self.policy.lease_seconds)
        # fragment -> learners whose last push of it came in (PushHeader.last)
        self.finished = self.roster.finished
        # One lock per fragment, held while a push to it is judged, logged (written, not
        # yet fsynced) and merged, and over a round close: a fragment's log order is
        # its merge order, and fragments never wait on each other.
        self.frag_locks: dict[int, threading.Lock] = {}
        self.last_seen = self.roster.last_seen  # learner -> instant of its last call
        self.timings = self.roster.timings  # learner -> the timing its last push reported
        self.known = self.roster.known  # learners whose pushes some fragment holds
        self.cadence_seconds: float | None = None  # the sync period learners are asked to keep
        self.periods: dict[int, PeriodCount] = {}  # fragment -> outer steps against elapsed periods
        self.sync_time = rules.Ewma()
        self.rounds_since_snapshot = 0
        self.pushes_since_snapshot = 0  # accepted, since the last snapshot began (under lock)
        self.last_lsn = 0
        self.snapshot_lsns: dict[
            int, int
        ] = {}  # fragment -> newest LSN of it the loaded snapshot holds

    def _write(self, records: list[storage.Record]) -> int:
        """Writes records to the log (not yet durable); returns the last one's LSN."""
        try:
            lsns: list[int] = self.wal.write_many(records)
            return lsns[-1]
        except storage.DiskFull as e:  # none of it was kept: memory and log still agree
            raise ShardError(Why.TOO_BIG, str(e)) from None
        except (OSError, storage.StorageError) as e:
            raise self._log_failed(e) from e

    def _sync(self, lsn: int) -> None:
        """Returns once the log is durable through `lsn` (before any ack that depends on it).

        Group commit: concurrent callers share one fsync. Never called under `lock`."""
        try:
            seconds = self.wal.sync(lsn)
        except (OSError, storage.StorageError) as e:
            raise self._log_failed(e) from e
        if seconds is not None:
            self.metrics.fsync_seconds.observe(seconds)

    def _log_failed(self, e: Exception) -> ShardError:
        """After a failed write or fsync, what is on disk is unknown: the shard stops serving
        (its memory may hold records that never reached the disk) until restarted from its log."""
        self.recovery_error = (
            f"the write-ahead log failed ({type(e).__name__}: {e}); restart the shard"
        )
        log.error("%s", self.recovery_error)
        return ShardError(Why.BUSY, self.recovery_error)

    def _adopt_plan(self, plan: FragmentPlan, fragment_map: FragmentMap | None = None) -> None:
        """Takes the plan and the fragment map (version 0, p mod S, unless given) and makes
        the fragments the map gives this shard."""
        if fragment_map is None:
            fragment_map = FragmentMap.modulo(plan.num_fragments, self.cfg.num_shards)
        if fragment_map.num_fragments != plan.num_fragments:
            raise RuntimeError(
                f"fragment map of {fragment_map.num_fragments} fragments for a plan of "
                f"{plan.num_fragments}"
            )
        fragments, locks = {}, {}
        for p in fragment_map.fragments_of(self.cfg.shard_index):
            fragments[p] = self._new_fragment(plan, p)
            locks[p] = threading.Lock()
            self.periods[p] = PeriodCount()
        self.fragments, self.frag_locks = fragments, locks
        self.fragment_map = fragment_map
        self.plan = plan  # last: a call that sees the plan finds its fragments and locks

    def _new_fragment(self, plan: FragmentPlan, p: int) -> Fragment:
        return Fragment(
            p,
            plan,
            lr=self.cfg.outer_lr,
            momentum=self.cfg.outer_momentum,
            rda=self.cfg.rda,
            delta_ring=self.cfg.delta_ring,
            publish_codec=self.cfg.publish_codec,
            quorum=self.policy.quorum,
            momentum_delay=self.cfg.momentum_delay,
            pool=self.pool,
        )

    def _add_fragment(self, p: int) -> None:
        """Makes fragment p here (adopted from another shard): lock first, then the fragment."""
        assert self.plan is not None
        self.frag_locks.setdefault(p, threading.Lock())
        self.periods[p] = PeriodCount()
        self.fragments[p] = self._new_fragment(self.plan, p)

    def _thawed(self, p: int) -> None:
        """Fragment p takes pushes again here, or is gone: how long it took none."""
        since = self.frozen_since.pop(p, None)
        if since is not None:
            self.metrics.frozen_seconds.observe(self.clock() - since)

    def _moved_away(self, p: int, new: FragmentMap) -> None:
        """Fragment p is another shard's under `new` (live commit and replay)."""
        self._drop_fragment(p)
        assert self.fragment_map is not None
        self.fragment_map = self.fragment_map.merged(new)

    def _drop_fragment(self, p: int) -> None:
        """Forgets fragment p (moved to another shard); its lock stays, for callers holding it."""
        self.fragments.pop(p, None)
        self.periods.pop(p, None)
        self.frozen.pop(p, None)
        self.freeze_lsns.pop(p, None)
        self.exported.discard(p)
        self.roster.drop_fragment(p)  # taken up under the lock (callers may hold it or not)

    def _install(
        self, meta: dict[str, Any], payload: bytes | memoryview, checked: Fragment | None = None
    ) -> None:
        """Makes fragment p here from an ADOPT record (live and replayed); live, from the
        fragment `_checked_state` restored from it already."""
        p, new = int(meta["fragment"]), FragmentMap.from_json(meta["map"])
        if self.plan is None:
            self._adopt_plan(FragmentPlan.from_json(meta["plan"]), new)
        if p not in self.fragments:
            self._add_fragment(p)
        if checked is not None:
            self.fragments[p] = checked
        else:
            with np.load(io.BytesIO(bytes(payload))) as z:
                arrays = {k: z[k] for k in z.files}
            self.fragments[p].restore(meta["state"], arrays, self.clock())
        self.fragment_map = new if self.fragment_map is None else self.fragment_map.merged(new)

    def _require_ready(self) -> None:
        if self.recovery_error is not None:
            raise ShardError(Why.BUSY, f"shard did not recover: {self.recovery_error}")
        if not self.ready:
            raise ShardError(Why.BUSY, "shard is recovering; retry shortly")

    def _check_fragment(self, plan: FragmentPlan, p: int, fingerprint: str | None) -> None:
        """Refuses a fragment that `plan` lacks or that another shard owns."""
        if fingerprint is not None and fingerprint != plan.fingerprint:
            raise ShardError(
                Why.OUT_OF_STEP,
                f"plan fingerprint {fingerprint!r} differs from the shard's "
                f"{plan.fingerprint!r}: learner and shard disagree on the model",
            )
        if not 0 <= p < plan.num_fragments:
            raise ShardError(
                Why.NOT_FOUND,
                f"fragment {p} does not exist (the plan has {plan.num_fragments})",
            )
        owners = self.fragment_map or FragmentMap.modulo(plan.num_fragments, self.cfg.num_shards)
        owner, since = owners.owner(p), owners.moved_at[p]
        if owner != self.cfg.shard_index:
            raise ShardError(
                Why.OUT_OF_STEP,
                f"fragment {p} is on shard {owner} (map version {since}), "
                f"not shard {self.cfg.shard_index}",
                metadata=(
                    (OWNER_KEY, str(owner)),
                    (MAP_VERSION_KEY, str(since)),
                    (FRAGMENT_KEY, str(p)),
                ),
            )

    def _fragment(self, p: int, fingerprint: str | None = None, need_init: bool = True) -> Fragment:
        if self.plan is None:
            raise ShardError(
                Why.OUT_OF_STEP,
                "this shard has no fragment plan yet: a learner must Init first",
            )
        self._check_fragment(self.plan, p, fingerprint)
        frag = self.fragments[p]
        if need_init and not frag.initialized:
            raise ShardError(
                Why.OUT_OF_STEP,
                f"fragment {p} is not initialized; Init it first",
            )
        return frag

    @contextlib.contextmanager
    def _lock_of(self, p: int, frag: Fragment) -> Iterator[None]:
        """Holds fragment p's lock, once `frag` (found before) is still p's fragment here:
        a move may have taken p away meanwhile, and the caller is then told its owner."""
        with self.frag_locks[p]:
            if self.fragments.get(p) is not frag:
                self._fragment(p)  # raises: p is another shard's now
                raise ShardError(Why.BUSY, f"fragment {p} changed; retry")
            yield

    def _version_changed(self) -> None:
        self.changed.notify_all()
        for listener in self.listeners:
            listener()

    def _grace(self) -> float:
        """The grace window from the live learners' timing: the slowest step, the largest τ;
        never past one period, nor past a lease (whom the shard waits for is live for that long).
        Under lock, the roster advanced to now."""
        slowest, overlap = self.roster.slowest_step(), self.roster.largest_overlap()
        cap = min(self.cadence_seconds or math.inf, self.policy.lease_seconds)
        grace: float = rules.estimate_grace(self.policy, overlap, slowest, self.sync_time, cap)
        return grace

    def _gauges(self) -> ScrapeGauges:
        """What the metrics read at scrape time: versions, open rounds, cadence, leases, grace."""
        with self.lock:
            now = self.clock()
            fragments = {
                p: FragmentGauges(f.version, f.round.count, self.periods[p].outer_steps_per_period)
                for p, f in self.fragments.items()
                if f.initialized
            }
            self.roster.advance(now)
            return ScrapeGauges(
                fragments,
                len(self.roster.live),
                self._grace(),
                self.cadence_seconds,
                owned=len(self.fragments),
                moving=len(self.frozen),
                map_version=self.fragment_map.version if self.fragment_map else 0,
            )
