"""One syncer shard: its calls, over the state, recovery and moves of its other modules.

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
on (`server/recovery.py`); moves are `server/moves.py`'s, the shared state
`server/state.py`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from atoll.server import merge, rules
from atoll.server.fragment import Answer, Fragment
from atoll.server.log_records import (
    LOG_CLOSE,
    LOG_INIT,
    LOG_INIT_PART,
    LOG_PLAN,
    LOG_PUSH,
    log_record,
    log_record_parts,
)
from atoll.server.moves import MoveCalls
from atoll.server.part_calls import ACCEPTED_CODECS, PartCalls
from atoll.server.parts import Box, boxes_problem
from atoll.server.push_header import PushHeader
from atoll.server.recovery import Recovery
from atoll.server.refusal import ShardError, Why, broken
from atoll.server.roster import Timing
from atoll.server.seed_parts import SeedPart
from atoll.server.state import (
    MAX_ABS_VALUE,
    PeriodCount,
    RecoveryError,
    RecoveryStopped,
    ShardState,
    _magnitude_problem,
)
from atoll.wire import codec
from atoll.wire.parts import BoxLayout
from atoll.wire.plan import FragmentMap, FragmentPlan

__all__ = [
    "MAX_ABS_VALUE",
    "PeriodCount",
    "PushHeader",
    "RecoveryError",
    "RecoveryStopped",
    "Shard",
    "ShardError",
    "ShardState",
    "Timing",
]

log = logging.getLogger("atoll.syncer")
Pushed = Answer | ShardError  # a push's answer, or its refusal
PART = -1  # push_many: no LSN, a push in parts answered (durable) by `push` itself
FIRST_ROUND_GRACE_PERIODS = 1.5  # how long a fragment's first round waits for every live learner
PRUNE_AFTER_LEASES = 10  # a learner silent this many leases is forgotten (its lease table entry)
SNAPSHOT_FREE_ANSWERS = 4096  # a snapshot of this many answers or fewer is due every few rounds
SNAPSHOT_ANSWERS_PER_PUSH = 8  # past them, the answers a snapshot writes per push since the last


def _as_refusal(e: Exception) -> ShardError:
    """A push's refusal: its ShardError, or an unexpected error as INTERNAL (as the servicer
    words one)."""
    if isinstance(e, ShardError):
        return e
    log.error("push failed", exc_info=e)
    return broken(e)


class Shard(Recovery, MoveCalls, PartCalls):
    """Create, then `recover()` before serving (the state: `server/state.py`)."""

    def _refuse_if_moving(self, p: int) -> None:
        """Pushes of a fragment being moved away wait (UNAVAILABLE: retryable)."""
        moving = self.frozen.get(p)
        if moving is not None:
            raise ShardError(
                Why.BUSY,
                f"fragment {p} is moving to shard {moving.owner(p)} (map version "
                f"{moving.version}); retry",
            )

    def touch(self, learner: str) -> None:
        """Refreshes a learner's lease (every call does)."""
        if learner:
            with self.lock:
                self.roster.renew(learner, self.clock())

    def _parse_plan(self, plan_json: str, fingerprint: str) -> FragmentPlan:
        try:
            plan = FragmentPlan.from_json(plan_json)
        except ValueError as e:
            raise ShardError(Why.MALFORMED, f"bad plan_json: {e}") from None
        if plan.fingerprint != fingerprint:
            raise ShardError(Why.MALFORMED, "plan_json does not match plan_fingerprint")
        if plan.num_fragments < self.cfg.num_shards:
            raise ShardError(
                Why.OUT_OF_STEP,
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
        """Seeds fragment p from a whole frame unless it exists; returns (created, version)."""
        created, version, _ = self.init_part(
            learner, p, fingerprint, plan_json, frame, frame_codec, num_params, None
        )
        return created, version

    def init_part(
        self,
        learner: str,
        p: int,
        fingerprint: str,
        plan_json: str,
        frame: bytes,
        frame_codec: int,
        num_params: int,
        part: SeedPart | None,
    ) -> tuple[bool, int, bool]:
        """Seeds fragment p from frame unless it exists; returns (created, version, held).

        The first Init also brings the plan; it is logged only with a valid first
        fragment (or seed part), so a refused Init leaves the shard as it was. Inits run
        one at a time (they are rare); the fragment is seeded once its record is durable.
        With `part` (frame: the part's values in FP32) the part is held, durable, until
        the seed's parts cover the fragment (server/seed_parts.py); held: it was."""
        self._require_ready()
        if frame_codec not in ACCEPTED_CODECS:
            raise ShardError(Why.MALFORMED, f"codec {frame_codec} is not accepted")
        with self.init_lock:
            plan = self.plan or self._parse_plan(plan_json, fingerprint)
            self._check_fragment(plan, p, fingerprint)
            if self.plan is not None and self.fragments[p].initialized:
                return False, self.fragments[p].version, False
            size = plan.fragment_sizes[p]
            if num_params != size:
                raise ShardError(
                    Why.MALFORMED,
                    f"fragment {p} holds {size} params, init says {num_params}",
                )
            first = [] if self.plan is not None else [self._plan_record(plan, plan_json)]
            if part is not None:
                part = self._seed_part(plan, p, part, frame, frame_codec)
                if part is None:  # a retry of a part held: nothing changes
                    return False, 0, True
                if not self.seeds.complete(plan, p, part):
                    self._hold_seed_part(plan, p, part, first)
                    return False, 0, True
                frame = codec.encode(self.seeds.assemble(plan, p, part), codec.Codec.FP32)
                frame_codec = codec.Codec.FP32
            values = self._seed_values(plan, p, frame, frame_codec)
            record = log_record(LOG_INIT, {"fragment": p}, frame)
            if first:  # the plan, its map and first fragment: durable together
                self._sync(self._write([*first, record]))
                self._adopt_plan(plan, self._first_map(plan))
                self._seeded(p, values)
            else:
                with self.frag_locks[p]:  # a snapshot sees it seeded with its record, or neither
                    self._sync(self._write([record]))
                    self._seeded(p, values)
            with self.lock:
                self._version_changed()
            return True, self.fragments[p].version, False

    def _hold_seed_part(
        self, plan: FragmentPlan, p: int, part: SeedPart, first: list[bytes]
    ) -> None:
        """Logs a seed part, durable, then holds it; a snapshot sees both or neither."""
        record = log_record(LOG_INIT_PART, part.meta(p), part.values.tobytes())
        if first:  # no snapshot holds fragments before the plan
            self._sync(self._write([*first, record]))
            self._adopt_plan(plan, self._first_map(plan))
            self.seeds.hold(p, part)
            return
        with self.frag_locks[p]:
            self._sync(self._write([record]))
            self.seeds.hold(p, part)

    def _seeded(self, p: int, values: np.ndarray) -> None:
        self.fragments[p].initialize(values)
        self.seeds.drop(p)

    def _first_map(self, plan: FragmentPlan) -> FragmentMap:
        return FragmentMap.modulo(plan.num_fragments, self.cfg.num_shards)

    def _plan_record(self, plan: FragmentPlan, plan_json: str) -> bytes:
        # the map is durable from here: a restart with another --num-shards never
        # changes who owns what; only moves do
        return log_record(LOG_PLAN, {"plan": plan_json, "map": self._first_map(plan).to_json()})

    def _seed_values(
        self, plan: FragmentPlan, p: int, frame: bytes, frame_codec: int
    ) -> np.ndarray:
        """A whole seed's checked values."""
        size = plan.fragment_sizes[p]
        try:
            codes = codec.read_codes(frame, codec=codec.Codec(frame_codec), num_values=size)
        except codec.CodecError as e:
            raise ShardError(Why.MALFORMED, f"init frame: {e}") from None
        too_big = _magnitude_problem(codes, merge.Segments.from_plan(plan, p))
        if too_big is not None:
            raise ShardError(Why.MALFORMED, f"init frame: {too_big}")
        values = np.empty(size, np.float32)
        codes.decode_into(values, accumulate=False)
        return values

    def _seed_part(
        self, plan: FragmentPlan, p: int, part: SeedPart, frame: bytes, frame_codec: int
    ) -> SeedPart | None:
        """`part` with its frame's values, judged; None: a duplicate of a part held."""
        if frame_codec != codec.Codec.FP32:
            raise ShardError(Why.MALFORMED, "a seed part's frame must be FP32")
        shapes = [tuple(t.spec.shape) for t in plan.tensors_of(p)]
        problem = boxes_problem(part.boxes, shapes)
        if problem is not None:
            raise ShardError(Why.MALFORMED, f"seed part {part.part} of fragment {p}: {problem}")
        n = sum(b.size(shapes[b.tensor]) for b in part.boxes)
        try:
            codes = codec.read_codes(frame, codec=codec.Codec.FP32, num_values=n)
        except codec.CodecError as e:
            raise ShardError(Why.MALFORMED, f"seed part {part.part} frame: {e}") from None
        values = np.empty(n, np.float32)
        codes.decode_into(values, accumulate=False)
        if n and float(np.abs(values).max()) > MAX_ABS_VALUE:
            raise ShardError(Why.MALFORMED, f"seed part {part.part}: a value past {MAX_ABS_VALUE}")
        part = dataclasses.replace(part, values=values)
        return part if self.seeds.judge(plan, p, part) else None

    def push(self, h: PushHeader, frame: bytes | Sequence[bytes]) -> Answer:
        """Judges, logs and merges one outer gradient; returns its acknowledgement once
        its record is durable.

        The frame is decompressed and checked with no lock held; under the fragment's
        lock the push is judged, its record written and its codes merged; the fsync comes
        after the lock is let go, shared with whatever other pushes wait for one."""
        self._require_ready()
        if h.parts:
            return self._push_part(h, frame)
        answer, durable_at = self._written(h, frame)
        if durable_at is not None:  # None: refused, nothing was logged
            self._sync(durable_at)  # fsync before ack: the ack is a promise
        return self._count(answer)

    def push_many(self, pushes: Sequence[tuple[PushHeader, Sequence[bytes]]]) -> list[Pushed]:
        """`push` of each push in turn, their records made durable by one fsync at the end;
        each push's answer, or the ShardError `push` would have raised for it.

        Each push is judged, logged and merged exactly as `push` does, one after another;
        the batch's one fsync covers every record they wrote (group commit within the
        batch) and an answer that needs a record is given only once that fsync returned.
        A push in parts runs whole through `push` (its parts have fsyncs of their own)."""
        written: list[tuple[Answer, int | None] | ShardError] = []
        for h, frame in pushes:
            try:
                if h.parts:
                    written.append((self.push(h, frame), PART))
                else:
                    self._require_ready()
                    written.append(self._written(h, frame))
            except Exception as e:  # noqa: BLE001 - this push's refusal, the others go on
                written.append(_as_refusal(e))
        lsns = [w[1] for w in written if not isinstance(w, ShardError) and w[1] not in (None, PART)]
        failed = None
        if lsns:
            try:
                self._sync(max(lsns))  # fsync before ack: the ack is a promise
            except Exception as e:  # noqa: BLE001 - every push that needed it is refused
                failed = _as_refusal(e)
        out: list[Pushed] = []
        for w in written:
            if isinstance(w, ShardError):
                out.append(w)
            elif w[1] == PART:  # answered and counted by `push`
                out.append(w[0])
            elif w[1] is not None and failed is not None:
                out.append(failed)
            else:
                out.append(self._count(w[0]))
        return out

    def _written(self, h: PushHeader, frame: bytes | Sequence[bytes]) -> tuple[Answer, int | None]:
        """(answer, the LSN to make durable before it goes out; None: refused, nothing
        logged) of a whole push: checked with no lock, then judged, logged and merged
        under its fragment's lock."""
        frag, codes = self._checked_push(h, frame)
        with self._lock_of(h.fragment, frag):
            now = self._arrived(h)
            return self._judged(h, frag, codes, frame, now)

    def _checked_push(
        self, h: PushHeader, frame: bytes | Sequence[bytes]
    ) -> tuple[Fragment, codec.Codes]:
        """(fragment, the frame's checked codes) of a push whose header and frame pass
        every check made before a lock is taken; ShardError otherwise."""
        frag = self._checked_header(h)
        try:
            # decompressed and checked, never decoded to float32: the merge reads the codes
            codes = codec.read_codes(frame, codec=codec.Codec(h.codec), num_values=frag.size)
        except codec.CodecError as e:
            # the codec refuses frames holding or decoding to NaN/Inf: the codes are finite
            raise ShardError(Why.MALFORMED, f"push frame: {e}") from None
        # Checked before logging: a logged record must be one the merge can apply.
        too_big = _magnitude_problem(codes, frag.segments)
        if too_big is not None:
            raise ShardError(Why.MALFORMED, f"push frame: {too_big}")
        return frag, codes

    def _judged(
        self,
        h: PushHeader,
        frag: Fragment,
        codes: codec.Codes,
        frame: bytes | Sequence[bytes],
        now: float,
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
        held = frag.part_sets.get(h.learner_id)
        if held is not None and held.seq == h.seq:
            raise ShardError(
                Why.MALFORMED,
                f"fragment {h.fragment}: seq {h.seq} of {h.learner_id} is a push in parts; "
                "send its parts (parts > 0), or push whole with a new seq",
            )
        newest = max((a.seq for a in (prior, refused, held) if a is not None), default=None)
        verdict = self._admitted(h, frag, newest)
        if not verdict.accept:
            return self._refusal(h, frag, verdict), None
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
        frame: bytes | Sequence[bytes],
        answer: Answer,
        now: float,
    ) -> tuple[Answer, int]:
        """Logs (written, not yet durable) and merges an accepted push: (its answer, which
        a round it closes moves to the new version; its record's LSN)."""
        meta = {
            "fragment": h.fragment,
            "learner": h.learner_id,
            "answer": answer.to_json(),
        }
        # an older push in parts of this learner's will never finish: a newer push replaced it
        dropped = self._dropped_parts(frag, h.learner_id, "superseded")
        lsn = self._write([*dropped, log_record_parts(LOG_PUSH, meta, frame)])
        if dropped:
            frag.drop_parts(h.learner_id)
        frag.contribute(h.learner_id, codes, answer, now)
        return self._joined_round(h, frag, now), lsn

    def _joined_round(self, h: PushHeader, frag: Fragment, now: float) -> Answer:
        """What follows an accepted contribution (whole or assembled from parts): leases,
        metrics, and the round's close if the rules say so; returns its answer."""
        frag.refusals.pop(h.learner_id, None)
        with self.lock:
            self.roster.know(h.learner_id)
            self.pushes_since_snapshot += 1
        self.metrics.staleness.observe(frag.answers[h.learner_id].staleness)
        assert self.plan is not None  # _fragment found it
        self.metrics.compute_seconds.inc(h.inner_steps * h.step_seconds / self.plan.num_fragments)
        self._maybe_close(h.fragment, now, trigger=h.learner_id)
        return frag.answers[h.learner_id]

    def _heard_from(self, h: PushHeader, now: float) -> None:
        """A push (under lock) marks whether it was its learner's last of its fragment,
        renews its lease and brings its timing: step time, τ, H. The pace is set by the
        learners still training: one whose last push of some fragment came in has stopped
        stepping, though its lease runs on. The roster keeps all of it as it changes, so
        this costs the same however many learners the shard remembers."""
        roster = self.roster
        roster.advance(now)
        roster.mark_finished(h.fragment, h.learner_id, h.last)
        roster.renew(h.learner_id, now)
        roster.heard(h.learner_id, Timing(h.step_seconds, h.overlap_steps, h.period_steps))
        period = roster.cadence()
        if period is not None:
            self.cadence_seconds = period

    def _count(self, answer: Answer) -> Answer:
        self.metrics.pushes.labels(answer.reason).inc()
        return answer

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

    def _maybe_close(self, p: int, now: float, trigger: str | None = None) -> float | None:
        """Closes fragment p's round if the rules say so; returns when to look again.

        Called under p's lock. A close is made durable before the lock is let go, so a
        pull or watch never sees a version that a crash could take back."""
        frag = self.fragments[p]
        if p in self.frozen:  # its state is being moved: exactly as exported
            return None
        state = frag.round_state
        with self.lock:
            roster = self.roster
            roster.advance(now)
            roster.sync_round(p, state.contributors)
            grace, joined = self._grace(), roster.joined
            if frag.version == 0 and self.cadence_seconds:
                # A fragment's first round: each island pushes it first at step t_p of its own
                # pace, a slower one up to a period after the fastest (later still if it was
                # slower to start); waiting for that once keeps slower islands from starting a
                # version behind (and pulling two deltas). Not capped at a lease: only live
                # learners are waited for, and a learner that is gone lapses within one.
                grace = max(grace, FIRST_ROUND_GRACE_PERIODS * self.cadence_seconds)
            # waited for: the live learners, less those whose last push of p came in (their
            # push still counts); how many of them the round lacks, kept by the roster
            missing = roster.missing(p)
        decision = rules.decide_close_counted(
            state, missing, now, self.policy.quorum, grace, joined=joined
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
            snapshot = self._snapshot_due()
            self._version_changed()
        if snapshot:  # written by a thread of its own while pushes go on
            self._snapshot_thread = threading.Thread(
                target=self._snapshot_in_background,
                name=f"shard{self.cfg.shard_index}-snapshot",
                daemon=True,
            )
            self._snapshot_thread.start()
        return None

    def _snapshot_due(self) -> bool:
        """After a round's close (under lock): whether to write a snapshot now. Every
        `snapshot_every` rounds; but a snapshot writes every answer the shard holds (one per
        learner ever seen, per fragment), so past SNAPSHOT_FREE_ANSWERS of them it also waits
        for a push per SNAPSHOT_ANSWERS_PER_PUSH answers: under churn (rounds of a few
        pushes, thousands of learners come and gone) its cost per push stays fixed."""
        self.rounds_since_snapshot += 1
        if self.rounds_since_snapshot < self.cfg.snapshot_every or self._snapshotting:
            return False
        answers = sum(len(f.answers) for f in list(self.fragments.values()))
        pushes = self.pushes_since_snapshot
        if answers > SNAPSHOT_FREE_ANSWERS and pushes * SNAPSHOT_ANSWERS_PER_PUSH < answers:
            return False
        self.rounds_since_snapshot = self.pushes_since_snapshot = 0
        self._snapshotting = True
        return True

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
                if frag.part_sets:
                    wakes.append(self._drop_expired_parts(p, now))
                if frag.round.count:
                    wakes.append(self._maybe_close(p, now))
        with self.lock:
            expiry = self.roster.next_expiry(now)
        candidates = [w for w in wakes if w is not None] + ([expiry] if expiry is not None else [])
        return min(candidates) if candidates else None

    def _forget_departed(self, now: float) -> frozenset[str]:
        """Forgets learners silent for PRUNE_AFTER_LEASES leases (under lock): their lease,
        timing and finished marks; returns them, for their fragments' refusals to go too.

        Each fragment's answer to a learner's newest accepted push stays: it is durable
        state (a retry of that push, however late, is answered once, never merged again;
        a learner resuming from its checkpoint reads its seq back). That is all a forgotten
        learner leaves: its id once and one answer per fragment of this shard it pushed,
        about 70 + 180 bytes per fragment (tests/test_roster.py holds it to 100 + 250); the
        roster's tables shrink once the crowd that grew them has gone. `known` keeps at
        least a quorum: it only counts learners up to K at start-up."""
        self.roster.advance(now)
        horizon = now - PRUNE_AFTER_LEASES * self.policy.lease_seconds
        return frozenset(self.roster.forget(horizon, self.policy.quorum))

    def pull(
        self, p: int, have_version: int | None, boxes: Sequence[Box] = ()
    ) -> tuple[int, bool, list[tuple[int, codec.Codec, bytes]]]:
        """(version, is_snapshot, [(version, codec, frame)]) taking the caller to the newest;
        with `boxes`, of those elements only (wire/parts.py `BoxLayout`)."""
        self._require_ready()
        frag = self._fragment(p)
        layout = None
        if boxes:
            problem = boxes_problem(boxes, frag.shapes)
            if problem is not None:
                raise ShardError(Why.MALFORMED, f"pull of fragment {p}: {problem}")
            layout = BoxLayout.of(
                frag.shapes, [(b.tensor, *b.bounds(frag.shapes[b.tensor])) for b in boxes]
            )
        with self.frag_locks[p]:
            version = frag.version
            if have_version is not None and have_version > version:
                raise ShardError(
                    Why.MALFORMED,
                    f"have_version {have_version} is ahead of fragment {p}'s version {version}",
                )
            deltas = None if have_version is None else frag.deltas_since(have_version)
            published = frag.published
            if deltas is None:
                frag.lend()  # encoded outside the lock: no close writes it meanwhile
        assert published is not None  # _fragment checked it is initialized
        if deltas is not None:
            out = [
                (v, frag.publish_codec, f if layout is None else layout.delta(f)) for v, f in deltas
            ]
        else:
            try:
                values = published if layout is None else published[layout.index()]
                out = [(version, codec.Codec.FP32, codec.encode(values, codec.Codec.FP32))]
            finally:
                with self.frag_locks[p]:
                    frag.give_back()
        self.metrics.bytes_out.inc(sum(len(f) for _, _, f in out))
        return version, deltas is None, out

    def newest_seq(self, learner: str, p: int) -> int:
        """The newest seq `learner` used on fragment p (0: none): its answered pushes' and
        that of a push in parts still missing parts (held parts are logged: this outlives
        a restart). A learner resuming goes on above it, so no part it sends is taken for
        one of a push its previous run never finished: its first part supersedes those."""
        frag = self._fragment(p, need_init=False)
        with self.frag_locks[p]:
            seen = (frag.answers.get(learner), frag.refusals.get(learner))
            held = frag.part_sets.get(learner)
        return max([a.seq for a in seen if a is not None] + [held.seq if held else 0])

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
