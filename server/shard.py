"""One syncer shard: its fragments, durable log, round timing and watchers.

Domain calls (`init`, `push`, `pull`, `describe`, `wait_for_versions`, `tick`) take
plain values and raise `ShardError` with a gRPC status; the servicer only
translates. Ordering: a push is decompressed and checked with no lock held; then,
under its fragment's lock alone, judged, written to the write-ahead log and merged
straight from its codes; the fsync comes after that lock is let go, shared by every
push waiting for one (group commit), and the ack only after it (the ack is a
promise). Fragments never wait on each other; each one's log order is its merge
order, so replaying the log after a crash rebuilds bit-identical state. A round close
is durable before its fragment's lock is let go, so no version a crash could take
back is ever served. Snapshots are written by a thread of their own while pushes go
on (`_snapshot`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import logging
import math
import pathlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grpc
import numpy as np

from atoll.server import merge, moves, rules, storage
from atoll.server.config import ShardConfig
from atoll.server.fragment import Answer, Fragment
from atoll.server.metrics import FragmentGauges, ScrapeGauges, ShardMetrics
from atoll.wire import codec
from atoll.wire.client import FRAGMENT_KEY, MAP_VERSION_KEY, OWNER_KEY
from atoll.wire.plan import FragmentMap, FragmentPlan
from atoll.wire.records import (
    LOG_ADOPT,
    LOG_CLOSE,
    LOG_FREEZE,
    LOG_INIT,
    LOG_MOVED,
    LOG_PLAN,
    LOG_PUSH,
    LOG_UNFREEZE,
    log_record,
    log_record_parts,
    parse_log_record,
)

FIRST_ROUND_GRACE_PERIODS = 1.5  # how long a fragment's first round waits for every live learner
ACCEPTED_CODECS = (codec.Codec.INT4, codec.Codec.MXFP4, codec.Codec.FP32)
# Header bounds. Weights tokens²/steps stay below 2^80 and outer-gradient values below
# MAX_ABS_VALUE, so a round of up to 2^17 pushes cannot overflow its float32 accumulator.
MAX_TOKENS = 1 << 40  # tokens one push may carry (a trillion: more than any sync period trains)
MAX_INNER_STEPS = 1 << 31
MAX_SEQ = (1 << 63) - 1
MAX_STEP_SECONDS = 86400.0  # a step longer than a day is a broken clock, not a slow island
MAX_PERIOD_STEPS = 1 << 20
MAX_ABS_VALUE = (
    1e9  # |outer gradient| or |initial weight| per element; training that far off has diverged
)
log = logging.getLogger("atoll.syncer")
PRUNE_AFTER_LEASES = 10  # a learner silent this many leases is forgotten (its lease table entry)


class Timing(NamedTuple):
    """What a learner's last push said of its pace (validated by PushHeader.problem)."""

    step_seconds: float  # its recent seconds per inner step; 0: not measured yet
    overlap_steps: int  # τ
    period_steps: int  # H; 0: not given


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


class ShardError(Exception):
    """A refused call: the gRPC status and a message saying what to fix."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        metadata: tuple[tuple[str, str], ...] = (),
    ):
        super().__init__(message)
        self.code = code
        self.metadata = metadata  # trailing metadata: what a client acts on (the owner)


@dataclasses.dataclass(frozen=True)
class PushHeader:
    learner_id: str
    fragment: int
    base_version: int
    seq: int
    inner_steps: int
    tokens: int
    codec: int
    num_params: int
    plan_fingerprint: str
    step_seconds: float = 0.0
    overlap_steps: int = 0
    period_steps: int = 0  # H of the learner; 0: not given
    last: bool = False  # the learner's last push of this fragment: its rounds stop waiting for it

    def problem(self) -> str | None:
        """What is out of range in this header, or None. Every field is checked here,
        before anything is logged: the timing fields size the grace window and the
        cadence, tokens and steps the merge weight."""
        if not self.learner_id:
            return "learner_id is empty"
        for name, value, low, high in (
            ("inner_steps", self.inner_steps, 1, MAX_INNER_STEPS),
            ("tokens", self.tokens, 1, MAX_TOKENS),
            ("seq", self.seq, 0, MAX_SEQ),
        ):
            if not low <= value <= high:
                return f"{name}={value}: must be in [{low}, {high}]"
        if self.tokens < self.inner_steps:
            return f"tokens={self.tokens} < inner_steps={self.inner_steps}: a step trains on at least one token"
        if not (math.isfinite(self.step_seconds) and 0 <= self.step_seconds <= MAX_STEP_SECONDS):
            return f"step_seconds={self.step_seconds}: must be a finite number in [0, {MAX_STEP_SECONDS}]"
        if not 0 <= self.period_steps <= MAX_PERIOD_STEPS:
            return f"period_steps={self.period_steps}: must be in [0, {MAX_PERIOD_STEPS}]"
        most = self.period_steps - 1 if self.period_steps else MAX_PERIOD_STEPS
        if not 0 <= self.overlap_steps <= most:
            return f"overlap_steps={self.overlap_steps}: must be in [0, {most}] (below period_steps when given)"
        return None


class Shard:
    """Create, then `recover()` before serving.

    `clock`, `log` and `snapshots` are the shard's only contact with time and disk: by
    default the monotonic clock and a WriteAheadLog and SnapshotStore in cfg.data_dir;
    tests pass a fake clock and in-memory storage (tests/test_shard_memory.py)."""

    def __init__(
        self,
        cfg: ShardConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        log: storage.Log | None = None,
        snapshots: storage.SnapshotStorage | None = None,
    ):
        self.cfg = cfg
        self.clock = clock
        self.policy = rules.RoundPolicy(
            quorum=cfg.quorum,
            grace_factor=cfg.grace_factor,
            max_staleness=cfg.max_staleness,
            discount_exponent=cfg.staleness_discount,
            lease_seconds=cfg.lease_seconds,
        )
        data = pathlib.Path(cfg.data_dir)
        self.wal: storage.Log = log if log is not None else storage.WriteAheadLog(data / "wal")
        self.snapshots: storage.SnapshotStorage = (
            snapshots if snapshots is not None else storage.SnapshotStore(data / "snapshots")
        )
        # Locks, always taken in this order: init_lock, a fragment's lock, lock.
        self.init_lock = threading.Lock()  # Init calls, one at a time (the first adopts the plan)
        self.lock = (
            threading.Lock()
        )  # shard-wide state (leases, timings, cadence); never held over I/O or a merge
        self.changed = threading.Condition(self.lock)
        self.snapshot_lock = threading.Lock()  # one snapshot written at a time
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
        self.fragments: dict[int, Fragment] = {}
        # fragment -> learners whose last push of it came in (PushHeader.last); not durable:
        # after a restart they hold fresh leases like everyone else (under self.lock)
        self.finished: collections.defaultdict[int, set[str]] = collections.defaultdict(set)
        # One lock per fragment, held while a push to it is judged, logged (written, not
        # yet fsynced) and merged, and over a round close: a fragment's log order is
        # its merge order, and fragments never wait on each other.
        self.frag_locks: dict[int, threading.Lock] = {}
        self.last_seen: dict[str, float] = {}
        self.timings: dict[str, Timing] = {}  # learner -> the timing its last push reported
        self.known: set[str] = set()  # learners whose pushes some fragment holds
        self.cadence_seconds: float | None = None  # the sync period learners are asked to keep
        self.periods: dict[int, PeriodCount] = {}  # fragment -> outer steps against elapsed periods
        self.sync_time = rules.Ewma()
        self.rounds_since_snapshot = 0
        self.last_lsn = 0
        self.snapshot_lsns: dict[
            int, int
        ] = {}  # fragment -> newest LSN of it the loaded snapshot holds

    # --- recovery ---

    def recover(self, stop: threading.Event | None = None) -> int:
        """Loads the newest snapshot and replays the log after it; returns records replayed.

        A replay can take as long as the log is: once `stop` is set (a SIGTERM) it ends
        between two records with RecoveryStopped, the shard as before recovery (not ready,
        so no final snapshot of half a replay) and its files untouched.

        Every record was checked before it was logged, so every record applies. If one
        does not (a log from an older build, a disk error), recovery stops and raises
        RecoveryError naming it, leaving the files untouched; with
        `cfg.quarantine_records` holding its LSN, the record is copied to
        `quarantine/<lsn>.record` in the data directory and replay starts over without
        it: an operator's decision, since that record may be an acknowledged push."""
        with self.lock:
            try:
                replayed = self._replay(set(self.cfg.quarantine_records), stop)
            except RecoveryError as e:
                self._reset()  # half a replay is no state to serve from
                self.recovery_error = str(e)
                raise
            except RecoveryStopped:
                self._reset()
                raise
            now = self.clock()
            for frag in self.fragments.values():
                # round timing is not durable: the open round's clock restarts now
                frag.round_state = frag.restamp(frag.contributors, now)
                # learners known before the restart get a fresh lease, so the first
                # one back does not find itself alone and close a round below quorum
                for learner in frag.answers:
                    self.last_seen[learner] = now
            self.ready = True
            return replayed

    def _replay(self, skip: set[int], stop: threading.Event | None = None) -> int:
        snap = self.snapshots.latest()
        if snap is not None:
            try:
                self._restore(snap)
            except ValueError as e:  # written under settings this shard does not have
                raise RecoveryError(
                    f"the snapshot in {self.cfg.data_dir} cannot be loaded: {e}"
                ) from e
        replayed = 0
        for lsn, record in self.wal.replay(self.last_lsn):
            if stop is not None and stop.is_set():
                raise RecoveryStopped(f"stopped after replaying {replayed} log records")
            if lsn in skip:
                self._quarantine(lsn, record)
            else:
                try:
                    self._apply(record, live=False, lsn=lsn)
                except Exception as e:  # noqa: BLE001 - any failure here must stop and say which record
                    raise RecoveryError(
                        f"log record {lsn} in {self.cfg.data_dir} cannot be applied ({type(e).__name__}: {e}); "
                        f"the shard serves nothing until it can. Keep the data directory as it is, then "
                        f"restart with --quarantine-record {lsn} to set that record aside (copied to "
                        f"quarantine/{lsn}.record; if it was an acknowledged push, that push is lost) "
                        f"and replay the rest"
                    ) from e
            self.last_lsn = lsn
            replayed += 1
        for frag in self.fragments.values():
            self.known.update(frag.answers)
        return replayed

    def _quarantine(self, lsn: int, record: bytes) -> None:
        folder = pathlib.Path(self.cfg.data_dir) / "quarantine"
        folder.mkdir(exist_ok=True)
        (folder / f"{lsn}.record").write_bytes(record)
        log.warning(
            "log record %d set aside in %s as --quarantine-record asked; replay goes on without it",
            lsn,
            folder,
        )

    def _apply(self, record: bytes, live: bool, lsn: int = 0) -> None:
        """Applies one log record; the same code runs live and during replay. A record of
        a fragment that the snapshot already holds (its LSN at or before that fragment's
        in the snapshot) is skipped."""
        kind, meta, payload = parse_log_record(record)
        if "fragment" in meta and lsn <= self.snapshot_lsns.get(meta["fragment"], 0):
            return
        if kind == LOG_PLAN:  # with the map of the first Init (older records: p mod S)
            saved = meta.get("map")
            self._adopt_plan(
                FragmentPlan.from_json(meta["plan"]),
                FragmentMap.from_json(saved) if saved is not None else None,
            )
        elif kind == LOG_INIT:
            frag = self.fragments[meta["fragment"]]
            codes = self._checked(codec.read_codes(payload, num_values=frag.size), frag, live)
            values = np.empty(frag.size, np.float32)
            codes.decode_into(values, accumulate=False)
            frag.initialize(values)
        elif kind == LOG_PUSH:
            frag = self.fragments[meta["fragment"]]
            codes = self._checked(codec.read_codes(payload, num_values=frag.size), frag, live)
            frag.contribute(meta["learner"], codes, Answer(**meta["answer"]), self.clock())
        elif kind == LOG_CLOSE:
            self.fragments[meta["fragment"]].close_round(meta.get("trigger"))
        elif kind == LOG_FREEZE:
            self.frozen[meta["fragment"]] = FragmentMap.from_json(meta["map"])
            self.freeze_lsns[meta["fragment"]] = lsn
        elif kind == LOG_UNFREEZE:
            self.frozen.pop(meta["fragment"], None)
            self.freeze_lsns.pop(meta["fragment"], None)
        elif kind == LOG_ADOPT:
            self._install(meta, payload)
        elif kind == LOG_MOVED:
            self._moved_away(meta["fragment"], FragmentMap.from_json(meta["map"]))
        else:
            raise RuntimeError(f"unknown log record kind {kind}")

    @staticmethod
    def _checked(codes: codec.Codes, frag: Fragment, live: bool) -> codec.Codes:
        """Codes a replayed record carries pass the checks a live call made before logging
        them: a record this build would have refused (from an older build, say) stops
        recovery instead of merging into the parameters."""
        if not live and (problem := _magnitude_problem(codes, frag.segments)):
            raise ValueError(problem)
        return codes

    def _write(self, records: list[storage.Record]) -> int:
        """Writes records to the log (not yet durable); returns the last one's LSN."""
        try:
            lsns: list[int] = self.wal.write_many(records)
            return lsns[-1]
        except storage.StorageError as e:
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
        return ShardError(grpc.StatusCode.UNAVAILABLE, self.recovery_error)

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
        self.finished.pop(p, None)

    # --- snapshots ---

    def _snapshot(self) -> None:
        """Writes a snapshot while pushes go on.

        Each fragment is captured under its own lock alone, at the log's newest LSN at
        that moment (its state then holds exactly its records up to that LSN); only the
        round accumulator is copied: params, opt state and the published copy are lent
        (`Fragment.lend`) until the snapshot is written, so closes meanwhile make fresh
        ones instead of stepping over them, and ring frames are bytes.
        The records captured are made durable before the snapshot names them; the
        snapshot's LSN is the oldest fragment LSN, and replay skips each fragment's
        records up to its own."""
        with self.snapshot_lock:
            meta: dict[str, Any] = {
                "plan": self.plan.to_json() if self.plan else None,
                "fragment_map": self.fragment_map.to_json() if self.fragment_map else None,
                "frozen": {str(p): m.to_json() for p, m in self.frozen.items()},
                "freeze_lsns": {str(p): lsn for p, lsn in self.freeze_lsns.items()},
                "shard_index": self.cfg.shard_index,
                "num_shards": self.cfg.num_shards,
                "fragments": {},
                "fragment_lsns": {},
            }
            arrays: dict[str, np.ndarray] = {}
            lent: list[int] = []  # fragments whose arrays this snapshot reads unlocked
            try:
                for p in sorted(self.fragments):
                    with self.frag_locks[p]:
                        fmeta, farrays = self.fragments[p].state()
                        meta["fragment_lsns"][str(p)] = self.wal.written_lsn
                        self.fragments[p].lend()
                        lent.append(p)
                    meta["fragments"][str(p)] = fmeta
                    arrays.update({f"f{p}.{k}": v for k, v in farrays.items()})
                # fragments that moved away: their records up to now are history, not state
                if self.fragment_map is not None:
                    for p in range(self.fragment_map.num_fragments):
                        if p not in self.fragments:
                            meta["fragment_lsns"][str(p)] = self.wal.written_lsn
                lsns = list(meta["fragment_lsns"].values()) or [self.wal.written_lsn]
                if max(lsns) > 0:
                    self._sync(max(lsns))
                with self.metrics.snapshot_seconds.time():
                    self.snapshots.save(min(lsns), meta, arrays)
            finally:
                del arrays
                for p in lent:
                    with self.frag_locks[p]:
                        self.fragments[p].give_back()
            self.wal.truncate_through(self.snapshots.truncatable_lsn())

    def _snapshot_in_background(self) -> None:
        try:
            self._snapshot()
        except Exception:  # noqa: BLE001 - the log still holds everything; the next one tries again
            log.exception(
                "background snapshot failed; the log keeps every record until one succeeds"
            )
        finally:
            with self.lock:
                self._snapshotting = False

    def _restore(self, snap: storage.Snapshot) -> None:
        meta = snap.meta
        # with a fragment map in the snapshot, the map says what this shard owns and
        # --num-shards only set the layout a run starts from: it may have grown since
        laid_out = meta.get("fragment_map") is None and meta["num_shards"] != self.cfg.num_shards
        if meta["shard_index"] != self.cfg.shard_index or laid_out:
            raise RuntimeError(
                f"data dir holds shard {meta['shard_index']} of {meta['num_shards']}, but this is "
                f"shard {self.cfg.shard_index} of {self.cfg.num_shards}; point --data-dir elsewhere"
            )
        if meta["plan"] is not None:
            saved_map = meta.get("fragment_map")  # older snapshots: version 0, p mod S
            self._adopt_plan(
                FragmentPlan.from_json(meta["plan"]),
                FragmentMap.from_json(saved_map) if saved_map else None,
            )
        for key, fmeta in meta["fragments"].items():
            prefix = f"f{key}."
            if int(key) not in self.fragments:  # adopted from another shard
                self._add_fragment(int(key))
            self.fragments[int(key)].restore(
                fmeta,
                {k[len(prefix) :]: v for k, v in snap.arrays.items() if k.startswith(prefix)},
                self.clock(),
            )
        for p in [p for p in self.fragments if str(p) not in meta["fragments"]]:
            self._drop_fragment(p)  # moved away before the snapshot
        self.frozen = {int(p): FragmentMap.from_json(m) for p, m in meta.get("frozen", {}).items()}
        # older snapshots kept no freeze LSN: the snapshot's own stands in as the move id
        lsns_of = meta.get("freeze_lsns", {})
        self.freeze_lsns = {p: int(lsns_of.get(str(p), max(snap.lsn, 1))) for p in self.frozen}
        # older snapshots were taken at one LSN for every fragment
        lsns = meta.get("fragment_lsns") or {key: snap.lsn for key in meta["fragments"]}
        self.snapshot_lsns = {int(key): int(lsn) for key, lsn in lsns.items()}
        self.last_lsn = snap.lsn

    # --- the calls ---

    def _require_ready(self) -> None:
        if self.recovery_error is not None:
            raise ShardError(
                grpc.StatusCode.UNAVAILABLE, f"shard did not recover: {self.recovery_error}"
            )
        if not self.ready:
            raise ShardError(grpc.StatusCode.UNAVAILABLE, "shard is recovering; retry shortly")

    def _check_fragment(self, plan: FragmentPlan, p: int, fingerprint: str | None) -> None:
        """Refuses a fragment that `plan` lacks or that another shard owns."""
        if fingerprint is not None and fingerprint != plan.fingerprint:
            raise ShardError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"plan fingerprint {fingerprint!r} differs from the shard's "
                f"{plan.fingerprint!r}: learner and shard disagree on the model",
            )
        if not 0 <= p < plan.num_fragments:
            raise ShardError(
                grpc.StatusCode.NOT_FOUND,
                f"fragment {p} does not exist (the plan has {plan.num_fragments})",
            )
        owners = self.fragment_map or FragmentMap.modulo(plan.num_fragments, self.cfg.num_shards)
        owner, since = owners.owner(p), owners.moved_at[p]
        if owner != self.cfg.shard_index:
            raise ShardError(
                grpc.StatusCode.FAILED_PRECONDITION,
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
                grpc.StatusCode.FAILED_PRECONDITION,
                "this shard has no fragment plan yet: a learner must Init first",
            )
        self._check_fragment(self.plan, p, fingerprint)
        frag = self.fragments[p]
        if need_init and not frag.initialized:
            raise ShardError(
                grpc.StatusCode.FAILED_PRECONDITION,
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
                raise ShardError(grpc.StatusCode.UNAVAILABLE, f"fragment {p} changed; retry")
            yield

    def _refuse_if_moving(self, p: int) -> None:
        """Pushes of a fragment being moved away wait (UNAVAILABLE: retryable)."""
        moving = self.frozen.get(p)
        if moving is not None:
            raise ShardError(
                grpc.StatusCode.UNAVAILABLE,
                f"fragment {p} is moving to shard {moving.owner(p)} (map version "
                f"{moving.version}); retry",
            )

    def touch(self, learner: str) -> None:
        """Refreshes a learner's lease (every call does)."""
        if learner:
            with self.lock:
                self.last_seen[learner] = self.clock()

    def _parse_plan(self, plan_json: str, fingerprint: str) -> FragmentPlan:
        try:
            plan = FragmentPlan.from_json(plan_json)
        except ValueError as e:
            raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, f"bad plan_json: {e}") from None
        if plan.fingerprint != fingerprint:
            raise ShardError(
                grpc.StatusCode.INVALID_ARGUMENT, "plan_json does not match plan_fingerprint"
            )
        if plan.num_fragments < self.cfg.num_shards:
            raise ShardError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"plan has {plan.num_fragments} fragments for {self.cfg.num_shards} "
                "shards: some shard would own nothing",
            )
        return plan

    def init(
        self,
        learner: str,
        p: int,
        fingerprint: str,
        plan_json: str,
        frame: bytes,
        frame_codec: int,
        num_params: int,
    ) -> tuple[bool, int]:
        """Seeds fragment p from frame unless it exists; returns (created, version).

        The first Init also brings the plan; it is logged only with a valid first
        fragment, so a refused Init leaves the shard as it was. Inits run one at a time
        (they are rare); the fragment is seeded once its record is durable."""
        self._require_ready()
        if frame_codec not in ACCEPTED_CODECS:
            raise ShardError(
                grpc.StatusCode.INVALID_ARGUMENT, f"codec {frame_codec} is not accepted"
            )
        with self.init_lock:
            plan = self.plan or self._parse_plan(plan_json, fingerprint)
            self._check_fragment(plan, p, fingerprint)
            if self.plan is not None and self.fragments[p].initialized:
                return False, self.fragments[p].version
            size = plan.fragment_sizes[p]
            if num_params != size:
                raise ShardError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"fragment {p} holds {size} params, init says {num_params}",
                )
            try:
                codes = codec.read_codes(frame, codec=codec.Codec(frame_codec), num_values=size)
            except codec.CodecError as e:
                raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, f"init frame: {e}") from None
            too_big = _magnitude_problem(codes, merge.Segments.from_plan(plan, p))
            if too_big is not None:
                raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, f"init frame: {too_big}")
            values = np.empty(size, np.float32)
            codes.decode_into(values, accumulate=False)
            if self.plan is None:  # the plan, its map and first fragment: durable together
                first = FragmentMap.modulo(plan.num_fragments, self.cfg.num_shards)
                self._sync(
                    self._write(
                        [
                            # the map is durable from here: a restart with another
                            # --num-shards never changes who owns what; only moves do
                            log_record(LOG_PLAN, {"plan": plan_json, "map": first.to_json()}),
                            log_record(LOG_INIT, {"fragment": p}, frame),
                        ]
                    )
                )
                self._adopt_plan(plan, first)
                self.fragments[p].initialize(values)
            else:
                with self.frag_locks[
                    p
                ]:  # a snapshot sees the fragment seeded with its record, or neither
                    self._sync(self._write([log_record(LOG_INIT, {"fragment": p}, frame)]))
                    self.fragments[p].initialize(values)
            with self.lock:
                self._version_changed()
            return True, self.fragments[p].version

    def push(self, h: PushHeader, frame: bytes) -> Answer:
        """Judges, logs and merges one outer gradient; returns its acknowledgement once
        its record is durable.

        The frame is decompressed and checked with no lock held; under the fragment's
        lock the push is judged, its record written and its codes merged; the fsync comes
        after the lock is let go, shared with whatever other pushes wait for one."""
        self._require_ready()
        frag, codes = self._checked_push(h, frame)
        with self._lock_of(h.fragment, frag):
            self._require_ready()
            self._refuse_if_moving(h.fragment)
            now = self.clock()
            with self.lock:
                self._heard_from(h, now)
                if h.last:
                    self.finished[h.fragment].add(h.learner_id)
                else:
                    self.finished[h.fragment].discard(h.learner_id)
            answer, durable_at = self._judged(h, frag, codes, frame, now)
        del codes
        if durable_at is None:  # refused: nothing was logged
            return self._count(answer)
        self._sync(durable_at)  # fsync before ack: the ack is a promise
        return self._count(answer)

    def _checked_push(self, h: PushHeader, frame: bytes) -> tuple[Fragment, codec.Codes]:
        """(fragment, the frame's checked codes) of a push whose header and frame pass
        every check made before a lock is taken; ShardError otherwise."""
        problem = h.problem()
        if problem is not None:
            raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if h.codec not in ACCEPTED_CODECS:
            raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, f"codec {h.codec} is not accepted")
        frag = self._fragment(h.fragment, h.plan_fingerprint)
        if h.num_params != frag.size:
            raise ShardError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"fragment {h.fragment} holds {frag.size} params, push says {h.num_params}",
            )
        try:
            # decompressed and checked, never decoded to float32: the merge reads the codes
            codes = codec.read_codes(frame, codec=codec.Codec(h.codec), num_values=frag.size)
        except codec.CodecError as e:
            # the codec refuses frames holding or decoding to NaN/Inf: the codes are finite
            raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, f"push frame: {e}") from None
        # Checked before logging: a logged record must be one the merge can apply.
        too_big = _magnitude_problem(codes, frag.segments)
        if too_big is not None:
            raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, f"push frame: {too_big}")
        return frag, codes

    def _judged(
        self, h: PushHeader, frag: Fragment, codes: codec.Codes, frame: bytes, now: float
    ) -> tuple[Answer, int | None]:
        """(answer, the LSN to make durable before it goes out; None: a refusal, nothing
        logged) of a push, under its fragment's lock: a retry gets its first answer, a new
        push is judged by the rules and, accepted, logged and merged."""
        prior = frag.answers.get(h.learner_id)
        refused = frag.refusals.get(h.learner_id)
        if prior is not None and prior.seq == h.seq:
            # the first push's record may still be on its way to disk: answer once it is there
            duplicate = dataclasses.replace(prior, reason=str(rules.Reason.DUPLICATE))
            return duplicate, self.wal.written_lsn
        if refused is not None and refused.seq == h.seq:
            return refused, None  # a retried refusal gets its first answer
        newest = max((a.seq for a in (prior, refused) if a is not None), default=None)
        verdict = rules.admit(
            seq=h.seq,
            newest_seq=newest,
            base_version=h.base_version,
            current_version=frag.version,
            in_round=h.learner_id in frag.contributors,
            tokens=h.tokens,
            inner_steps=h.inner_steps,
            policy=self.policy,
        )
        if verdict.reason in (rules.Reason.FUTURE_BASE, rules.Reason.SEQ_TOO_FAR):
            raise ShardError(
                grpc.StatusCode.INVALID_ARGUMENT, f"fragment {h.fragment}: {verdict.detail}"
            )
        if not verdict.accept:
            answer = Answer(
                h.seq,
                False,
                str(verdict.reason),
                verdict.detail,
                frag.version,
                verdict.staleness,
                0.0,
            )
            if verdict.reason is not rules.Reason.DUPLICATE:
                frag.refusals[h.learner_id] = answer
            return answer, None
        answer = Answer(
            h.seq,
            True,
            str(verdict.reason),
            "",
            frag.version,
            verdict.staleness,
            verdict.weight * verdict.discount,
            verdict.discount,
        )
        return self._merged(h, frag, codes, frame, answer, now)

    def _merged(
        self,
        h: PushHeader,
        frag: Fragment,
        codes: codec.Codes,
        frame: bytes,
        answer: Answer,
        now: float,
    ) -> tuple[Answer, int]:
        """Logs (written, not yet durable) and merges an accepted push: (its answer, which
        a round it closes moves to the new version; its record's LSN)."""
        meta = {
            "fragment": h.fragment,
            "learner": h.learner_id,
            "answer": dataclasses.asdict(answer),
        }
        lsn = self._write([log_record_parts(LOG_PUSH, meta, frame)])
        frag.contribute(h.learner_id, codes, answer, now)
        frag.refusals.pop(h.learner_id, None)
        with self.lock:
            self.known.add(h.learner_id)
        self.metrics.staleness.observe(answer.staleness)
        assert self.plan is not None  # _fragment found it
        self.metrics.compute_seconds.inc(h.inner_steps * h.step_seconds / self.plan.num_fragments)
        self._maybe_close(h.fragment, now, trigger=h.learner_id)
        return frag.answers[h.learner_id], lsn

    def _heard_from(self, h: PushHeader, now: float) -> None:
        """A push renews its learner's lease and brings its timing: step time, τ, H."""
        self.last_seen[h.learner_id] = now
        self.timings[h.learner_id] = Timing(h.step_seconds, h.overlap_steps, h.period_steps)
        live = self._live_timings(now)
        periods = [t.period_steps for t in live.values() if t.period_steps]
        steps = {m: t.step_seconds for m, t in live.items()}
        period = rules.cadence(min(periods), steps, frozenset(live)) if periods else None
        if period is not None:
            self.cadence_seconds = period

    def _live_timings(self, now: float) -> dict[str, Timing]:
        live = rules.live_learners(self.last_seen, now, self.policy.lease_seconds)
        return {m: t for m, t in self.timings.items() if m in live}

    def _count(self, answer: Answer) -> Answer:
        self.metrics.pushes.labels(answer.reason).inc()
        return answer

    def _grace(self, live: frozenset[str]) -> float:
        """The grace window from the live learners' timing: the slowest step, the largest τ;
        never past one period, nor past a lease (whom the shard waits for is live for that long)."""
        timings = [t for m, t in self.timings.items() if m in live]
        slowest = max((t.step_seconds for t in timings if t.step_seconds > 0), default=None)
        overlap = max((t.overlap_steps for t in timings), default=0)
        cap = min(self.cadence_seconds or math.inf, self.policy.lease_seconds)
        grace: float = rules.estimate_grace(self.policy, overlap, slowest, self.sync_time, cap)
        return grace

    def due_in(self, p: int, learner: str) -> float:
        """Seconds until `learner`'s next push of fragment p is due (0: no schedule yet).

        Takes no lock (the event loop calls it): a round state is a value, replaced whole."""
        frag = self.fragments.get(p)
        if frag is None:
            return 0.0
        state = frag.round_state
        in_round = learner in state.contributors
        due_in: float = rules.due_in(state, self.clock(), self.cadence_seconds, in_round=in_round)
        return due_in

    def _joined(self) -> int:
        """Learners this shard knows: any with a lease, any whose push it holds (under lock)."""
        return len(self.known.union(self.last_seen))

    def _maybe_close(self, p: int, now: float, trigger: str | None = None) -> float | None:
        """Closes fragment p's round if the rules say so; returns when to look again.

        Called under p's lock. A close is made durable before the lock is let go, so a
        pull or watch never sees a version that a crash could take back."""
        frag = self.fragments[p]
        if p in self.frozen:  # its state is being moved: exactly as exported
            return None
        state = frag.round_state
        with self.lock:
            live = rules.live_learners(self.last_seen, now, self.policy.lease_seconds)
            grace, joined = self._grace(live), self._joined()
            if frag.version == 0 and self.cadence_seconds:
                # A fragment's first round: each island pushes it first at step t_p of its own
                # pace, a slower one up to a period after the fastest (later still if it was
                # slower to start); waiting for that once keeps slower islands from starting a
                # version behind (and pulling two deltas). Not capped at a lease: only live
                # learners are waited for, and a learner that is gone lapses within one.
                grace = max(grace, FIRST_ROUND_GRACE_PERIODS * self.cadence_seconds)
            # a learner whose last push of p came in is not waited for (its push still counts)
            waited_for = live - self.finished[p]
        decision = rules.decide_close(
            state, waited_for, now, self.policy.quorum, grace, joined=joined
        )
        if not decision.close:
            wake_at: float | None = decision.wake_at
            return wake_at
        started = self.clock()  # the shard's clock: ξ_sync sizes the grace window on it
        lsn = self._write([log_record(LOG_CLOSE, {"fragment": p, "trigger": trigger})])
        frag.close_round(trigger)  # the same call replay makes
        # the fragment's schedule goes on a period after this round's due time, whenever
        # the round closed (round timing is not logged: after a restart, the first push
        # sets the phase again)
        frag.round_state = frag.round_state._replace(
            due_at=rules.next_due(state, now, self.cadence_seconds)
        )
        merge_seconds = self.clock() - started
        self._sync(lsn)  # under this fragment's lock only
        self.metrics.rounds.inc()
        self.metrics.round_size.observe(frag.last_round_size)
        self.metrics.merge_seconds.observe(merge_seconds)
        with self.lock:
            self.sync_time = self.sync_time.update(merge_seconds, self.policy.ewma_alpha)
            self.periods[p] = self.periods[p].closed(now, self.cadence_seconds)
            self.rounds_since_snapshot += 1
            snapshot = (
                self.rounds_since_snapshot >= self.cfg.snapshot_every and not self._snapshotting
            )
            if snapshot:
                self.rounds_since_snapshot, self._snapshotting = 0, True
            self._version_changed()
        if snapshot:  # written by a thread of its own while pushes go on
            self._snapshot_thread = threading.Thread(
                target=self._snapshot_in_background,
                name=f"shard{self.cfg.shard_index}-snapshot",
                daemon=True,
            )
            self._snapshot_thread.start()
        return None

    def _version_changed(self) -> None:
        self.changed.notify_all()
        for listener in self.listeners:
            listener()

    def tick(self) -> float | None:
        """Closes rounds whose grace ended or whose missing learners' leases lapsed;
        returns the next instant worth looking again (None: only a push can help)."""
        with self.lock:
            if not self.ready or self.recovery_error is not None:
                return None
            now = self.clock()
            gone = self._forget_departed(now)
        wakes = []
        for p in list(self.fragments):
            with self.frag_locks[p]:
                frag = self.fragments.get(p)
                if frag is None:  # moved away meanwhile
                    continue
                for learner in gone:
                    frag.refusals.pop(learner, None)
                if frag.round.count:
                    wakes.append(self._maybe_close(p, now))
        with self.lock:
            expiry = rules.next_lease_expiry(self.last_seen, now, self.policy.lease_seconds)
        candidates = [w for w in wakes if w is not None] + ([expiry] if expiry is not None else [])
        return min(candidates) if candidates else None

    def _forget_departed(self, now: float) -> frozenset[str]:
        """Forgets learners silent for PRUNE_AFTER_LEASES leases (under lock): their lease,
        timing and finished marks; returns them, for their fragments' refusals to go too.

        Each fragment's answer to a learner's newest accepted push stays: it is durable
        state (a retry of that push, however late, is answered once, never merged again).
        `known` keeps at least a quorum: it only counts learners up to K at start-up."""
        horizon = now - PRUNE_AFTER_LEASES * self.policy.lease_seconds
        gone = frozenset(m for m, seen in self.last_seen.items() if seen < horizon)
        for learner in gone:
            del self.last_seen[learner]
            self.timings.pop(learner, None)
            if len(self.known) > self.policy.quorum:
                self.known.discard(learner)
            for finished in self.finished.values():
                finished.discard(learner)
        return gone

    def pull(
        self, p: int, have_version: int | None
    ) -> tuple[int, bool, list[tuple[int, codec.Codec, bytes]]]:
        """(version, is_snapshot, [(version, codec, frame)]) taking the caller to the newest."""
        self._require_ready()
        frag = self._fragment(p)
        with self.frag_locks[p]:
            version = frag.version
            if have_version is not None and have_version > version:
                raise ShardError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"have_version {have_version} is ahead of fragment {p}'s version {version}",
                )
            deltas = None if have_version is None else frag.deltas_since(have_version)
            published = frag.published
            if deltas is None:
                frag.lend()  # encoded outside the lock: no close writes it meanwhile
        assert published is not None  # _fragment checked it is initialized
        if deltas is not None:
            out = [(v, frag.publish_codec, f) for v, f in deltas]
        else:
            try:
                out = [(version, codec.Codec.FP32, codec.encode(published, codec.Codec.FP32))]
            finally:
                with self.frag_locks[p]:
                    frag.give_back()
        self.metrics.bytes_out.inc(sum(len(f) for _, _, f in out))
        return version, deltas is None, out

    # --- moving a fragment to another shard (docs/resharding.md, server/moves.py) ---

    @staticmethod
    def _move_refusal(e: moves.MoveRefused) -> ShardError:
        code = (
            grpc.StatusCode.INVALID_ARGUMENT
            if e.why is moves.Why.MALFORMED
            else grpc.StatusCode.FAILED_PRECONDITION
        )
        return ShardError(code, str(e))

    def _check_move(self, p: int, new: FragmentMap, *, next_map: bool = True) -> None:
        """`new` is a valid map moving p (and, with `next_map`, the next version after
        this shard's): server/moves.py's rule 1, before anything is logged."""
        if self.plan is None:
            raise ShardError(grpc.StatusCode.FAILED_PRECONDITION, "this shard has no plan yet")
        try:
            moves.check_map(new, p, self.plan.num_fragments)
            if next_map:
                moves.check_next_map(
                    self.fragment_map, p, new, self.cfg.shard_index, self.fragments
                )
        except moves.MoveRefused as e:
            raise self._move_refusal(e) from None

    def freeze(self, p: int, new: FragmentMap) -> None:
        """Step 1 of moving fragment p away: from the durable FREEZE on, its pushes wait and
        its rounds stay as they are. Again with the same map: nothing more."""
        self._require_ready()
        frag = self._fragment(p)
        with self._lock_of(p, frag):
            if _same_move(self.frozen.get(p), p, new):
                return
            if p in self.frozen:
                raise ShardError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"fragment {p} is already moving under map version {self.frozen[p].version}",
                )
            self._check_move(p, new)
            if new.owner(p) == self.cfg.shard_index:
                raise ShardError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"map version {new.version} keeps {p} here"
                )
            record = log_record(LOG_FREEZE, {"fragment": p, "map": new.to_json()})
            lsn = self._write([record])
            self._sync(lsn)
            self.frozen[p] = new
            self.freeze_lsns[p] = lsn
            self.frozen_since[p] = self.clock()

    def unfreeze(self, p: int) -> None:
        """Aborts a move that never reached its target: p takes pushes again."""
        self._require_ready()
        frag = self._fragment(p)
        with self._lock_of(p, frag):
            if p not in self.frozen:
                return
            self._sync(self._write([log_record(LOG_UNFREEZE, {"fragment": p})]))
            del self.frozen[p]
            self.freeze_lsns.pop(p, None)
            self._thawed(p)

    def export(self, p: int) -> tuple[dict[str, Any], bytes]:
        """Step 2's source half: frozen fragment p's whole state, as an ADOPT payload,
        with this shard's freeze record (the move id its target logs too)."""
        self._require_ready()
        frag = self._fragment(p)
        with self._lock_of(p, frag):
            moving = self.frozen.get(p)
            if moving is None:
                raise ShardError(
                    grpc.StatusCode.FAILED_PRECONDITION, f"fragment {p} is not frozen for a move"
                )
            fmeta, arrays = frag.state()
            freeze = {"source": self.cfg.shard_index, "lsn": self.freeze_lsns[p]}
            buf = io.BytesIO()
            # read under the lock: a frozen fragment does not change (numpy types **arrays as
            # if a key could be its allow_pickle flag)
            np.savez(buf, **arrays)  # type: ignore[arg-type]
        assert self.plan is not None
        meta = {
            "fragment": p,
            "map": moving.to_json(),
            "plan": self.plan.to_json(),
            "state": fmeta,
            "freeze": freeze,
        }
        payload = buf.getvalue()
        self.metrics.moved_bytes.labels("out").inc(len(payload))
        return meta, payload

    def adopt(self, meta: dict[str, Any], payload: bytes) -> None:
        """Step 2's target half: fragment p's state from its old owner, durable before p
        is served here. Again once adopted: nothing more."""
        self._require_ready()
        p, new, checked = self._checked_state(meta, payload)
        with self.init_lock:
            if self.fragment_map is not None and p in self.fragments:
                if _same_move(self.fragment_map, p, new):
                    return  # adopted already (a retried step 2)
            if new.owner(p) != self.cfg.shard_index:
                raise ShardError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"map version {new.version} gives fragment {p} to shard {new.owner(p)}",
                )
            if self.plan is not None and self.plan.to_json() != meta["plan"]:
                raise ShardError(
                    grpc.StatusCode.FAILED_PRECONDITION, "the fragment comes with another plan"
                )
            try:
                moves.check_next_map(
                    self.fragment_map, p, new, self.cfg.shard_index, self.fragments
                )
            except moves.MoveRefused as e:
                raise self._move_refusal(e) from None
            self._sync(self._write([log_record(LOG_ADOPT, meta, payload)]))
            self._install(meta, payload, checked)
            self.metrics.moves.labels("in").inc()
            self.metrics.moved_bytes.labels("in").inc(len(payload))
            with self.lock:
                self._version_changed()

    def _checked_state(self, meta: Any, payload: bytes) -> tuple[int, FragmentMap, Fragment]:
        """(fragment, map, the fragment restored) of an Adopt, once it passes every check
        of server/moves.py and its whole state restores into a fragment with valid delta
        frames: a record logged must be one replay can apply. Anything else is refused
        (INVALID_ARGUMENT, or FAILED_PRECONDITION for a call out of step) and changes
        nothing."""
        try:
            moves.check_adopt_meta(meta)
            p, new = int(meta["fragment"]), FragmentMap.from_json(meta["map"])
            plan = FragmentPlan.from_json(str(meta["plan"]))
            if self.plan is not None and plan.fingerprint != self.plan.fingerprint:
                raise ValueError("the fragment comes with another plan than this shard's")
            moves.check_map(new, p, plan.num_fragments)
            moves.check_freeze_record(meta.get("freeze"), self.cfg.shard_index, new, p)
            moves.check_state_meta(meta["state"], self.cfg.delta_ring)
            template = self._new_fragment(plan, p)
            template.initialize(np.zeros(template.size, np.float32))
            with np.load(io.BytesIO(payload), allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            moves.check_state_arrays(meta["state"], arrays, template)
            trial = self._new_fragment(plan, p)
            trial.restore(meta["state"], arrays, self.clock())
            for _, frame in trial.ring:
                codec.read_codes(frame, codec=trial.publish_codec, num_values=trial.size)
        except moves.MoveRefused as e:
            raise self._move_refusal(e) from None
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, it is refused
            raise ShardError(
                grpc.StatusCode.INVALID_ARGUMENT, f"fragment state: {type(e).__name__}: {e}"
            ) from None
        return p, new, trial

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

    def commit_move(self, p: int, new: FragmentMap) -> None:
        """Step 3: fragment p's target holds it; this shard forgets it and names the owner."""
        self._require_ready()
        self._check_move(p, new, next_map=False)
        held = self.fragment_map
        if held is not None and p not in self.fragments and _same_move(held, p, new):
            return  # committed already
        frag = self._fragment(p)
        with self._lock_of(p, frag):
            frozen = self.frozen.get(p)
            if frozen is None or not _same_move(frozen, p, new):
                raise ShardError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"fragment {p} is not frozen for map version {new.version}",
                )
            record = log_record(LOG_MOVED, {"fragment": p, "map": frozen.to_json()})
            self._sync(self._write([record]))
            self._moved_away(p, frozen)
            self._thawed(p)
            self.metrics.moves.labels("out").inc()
        with self.lock:
            self._version_changed()

    def newest_seq(self, learner: str, p: int) -> int:
        """The newest seq answered for `learner` on fragment p (0: none)."""
        frag = self._fragment(p, need_init=False)
        with self.frag_locks[p]:
            answers = (frag.answers.get(learner), frag.refusals.get(learner))
        return max((a.seq for a in answers if a is not None), default=0)

    def moved_away(self, fragments: list[int]) -> ShardError | None:
        """The refusal naming the new owner of the first of `fragments` that moved away
        (a Watch of it ends with it), or None."""
        plan = self.plan
        for p in fragments:
            if plan is not None and 0 <= p < plan.num_fragments and p not in self.fragments:
                try:
                    self._check_fragment(plan, p, None)
                except ShardError as e:
                    return e
        return None

    def versions(self, fragments: list[int] | None = None) -> dict[int, tuple[int, int]]:
        """{fragment: (version, contributors of the last round)} for initialized fragments."""
        wanted = fragments if fragments else sorted(self.fragments)
        for p in wanted:
            self._fragment(p, need_init=False)
        out = {}
        for p in wanted:
            with self.frag_locks[p]:
                f = self.fragments[p]
                if f.initialized:
                    out[p] = (f.version, f.last_round_size)
        return out

    def wait_for_change(
        self, known: dict[int, int], fragments: list[int] | None, timeout: float
    ) -> None:
        """Blocks until some watched fragment's version differs from `known`, or timeout."""
        with self.changed:
            self.changed.wait_for(
                lambda: any(
                    self.fragments[p].version != known.get(p) and self.fragments[p].initialized
                    for p in (fragments or self.fragments)
                ),
                timeout,
            )

    def _gauges(self) -> ScrapeGauges:
        """What the metrics read at scrape time: versions, open rounds, cadence, leases, grace."""
        with self.lock:
            now = self.clock()
            fragments = {
                p: FragmentGauges(f.version, f.round.count, self.periods[p].outer_steps_per_period)
                for p, f in self.fragments.items()
                if f.initialized
            }
            live = rules.live_learners(self.last_seen, now, self.policy.lease_seconds)
            return ScrapeGauges(
                fragments,
                len(live),
                self._grace(live),
                self.cadence_seconds,
                owned=len(self.fragments),
                moving=len(self.frozen),
                map_version=self.fragment_map.version if self.fragment_map else 0,
            )

    def describe(self) -> dict[str, Any]:
        with self.lock:
            now = self.clock()
            return {
                "plan": self.plan,
                "fragment_map": self.fragment_map,
                "frozen": dict(self.frozen),
                "fragments": {p: f for p, f in self.fragments.items()},
                "live": sorted(rules.live_learners(self.last_seen, now, self.policy.lease_seconds)),
            }

    def close(self) -> None:
        """Writes a final snapshot so the next start replays nothing."""
        thread = self._snapshot_thread
        if thread is not None:
            thread.join()
        if self.ready and self.plan is not None and self.recovery_error is None:
            self._snapshot()
        self.wal.close()
        self.snapshots.close()
