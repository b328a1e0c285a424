"""A shard's calls for a push in parts (server/parts.py decides; this logs and applies):
each part checked, judged against the parts held, logged and made durable before its
answer; the last one has the whole push judged and merged as one contribution, through
the same `Fragment` calls that replay makes; parts that never complete dropped by the
round timer after `ShardConfig.part_wait_leases`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from atoll.server import parts, rules, storage
from atoll.server.fragment import Answer, Fragment
from atoll.server.log_records import (
    LOG_ASSEMBLED,
    LOG_PART,
    LOG_PARTS_DROPPED,
    log_record,
    log_record_parts,
)
from atoll.server.push_header import PushHeader
from atoll.server.refusal import ShardError, Why
from atoll.server.state import MAX_ABS_VALUE, ShardState, log
from atoll.wire import codec

ACCEPTED_CODECS = (codec.Codec.INT4, codec.Codec.MXFP4, codec.Codec.FP32)


class PartCalls(ShardState):
    """Pushes in parts over the shard's state; what they share with whole pushes (leases,
    the round's close, counting answers) is the shard's own (server/shard.py)."""

    def _heard_from(self, h: PushHeader, now: float) -> None:
        raise NotImplementedError  # the shard's

    def _joined_round(self, h: PushHeader, frag: Fragment, now: float) -> Answer:
        raise NotImplementedError  # the shard's

    def _count(self, answer: Answer) -> Answer:
        raise NotImplementedError  # the shard's

    def _refuse_if_moving(self, p: int) -> None:
        raise NotImplementedError  # the shard's

    def _push_part(self, h: PushHeader, frame: bytes | Sequence[bytes]) -> Answer:
        """Judges, logs and holds one part of a push in parts; the part that completes the
        push has the push judged, logged and merged as one contribution. Answered once its
        record is durable, like a whole push, by an fsync it shares with the push's other
        parts that arrived with it (`server/part_commit.py`)."""
        push = (h.fragment, h.learner_id, h.seq)
        with self.part_commit.arriving(push):
            frag, joined, codes = self._checked_part(h, frame)
            with self._lock_of(h.fragment, frag):
                now = self._arrived(h)  # every part renews the one lease of its learner
                answer, durable_at = self._judged_part(h, frag, joined, codes, now)
        if durable_at is not None:
            # group commit: the push's other parts in hand are logged first, one fsync for all
            self.part_commit.await_siblings(push)
            self._sync(durable_at)  # fsync before ack: the ack is a promise
        return answer

    def _arrived(self, h: PushHeader) -> float:
        """Under the fragment's lock, a push (whole or a part) arriving: the shard serves and
        the fragment is not moving, the learner's finished mark and lease are renewed;
        returns the time it arrived."""
        self._require_ready()
        self._refuse_if_moving(h.fragment)
        now = self.clock()
        with self.lock:
            self._heard_from(h, now)  # the finished mark too
        return now

    def _checked_header(self, h: PushHeader) -> Fragment:
        """The fragment a push, whole or a part, is for, once its header passes the checks
        that need no lock (its fields, codec, plan and size); ShardError otherwise."""
        problem = h.problem()
        if problem is not None:
            raise ShardError(Why.MALFORMED, problem)
        if h.codec not in ACCEPTED_CODECS:
            raise ShardError(Why.MALFORMED, f"codec {h.codec} is not accepted")
        frag = self._fragment(h.fragment, h.plan_fingerprint)
        if h.num_params != frag.size:
            raise ShardError(
                Why.MALFORMED,
                f"fragment {h.fragment} holds {frag.size} params, push says {h.num_params}",
            )
        return frag

    def _checked_part(
        self, h: PushHeader, frame: bytes | Sequence[bytes]
    ) -> tuple[Fragment, bytes | tuple[bytes, ...], codec.Codes]:
        """(fragment, the part's frame as it arrived, its checked codes) of a part whose
        header, boxes and frame pass every check made before a lock is taken; ShardError
        otherwise. The frame stays in the pieces it came in (no joined copy: logged and
        read as they are)."""
        frag = self._checked_header(h)
        problem = parts.boxes_problem(h.boxes, frag.shapes)
        if problem is not None:
            raise ShardError(Why.MALFORMED, f"fragment {h.fragment} part {h.part}: {problem}")
        n = parts.part_size(h.boxes, frag.shapes)
        joined = frame if isinstance(frame, bytes) else tuple(frame)
        try:
            codes = codec.read_codes(joined, codec=codec.Codec(h.codec), num_values=n)
        except codec.CodecError as e:  # NaN/Inf, or a frame of another size than its boxes
            raise ShardError(Why.MALFORMED, f"push part {h.part} frame: {e}") from None
        # the whole push's check (server/state.py): a logged part is one the merge can
        # apply, whatever the other parts hold. Its scales bound every element (a read of
        # the scales alone, where a norm would read every code), so only a part whose
        # bound passes the limit needs the exact per-element check
        bound = float(codes.range_max_abs([0], [n], exact=False)[0])
        if bound > MAX_ABS_VALUE and float(codes.range_max_abs([0], [n])[0]) > MAX_ABS_VALUE:
            raise ShardError(
                Why.MALFORMED,
                f"push part {h.part} frame: values beyond ±{MAX_ABS_VALUE:g}: a diverged "
                "learner's update is not merged",
            )
        return frag, joined, codes

    def _part_answer(
        self, h: PushHeader, frag: Fragment, reason: rules.Reason, detail: str
    ) -> Answer:
        accepted = reason is rules.Reason.PART_HELD
        staleness = frag.version - h.base_version
        return Answer(h.seq, accepted, str(reason), detail, frag.version, staleness, 0.0)

    def _judged_part(
        self,
        h: PushHeader,
        frag: Fragment,
        frame: bytes | tuple[bytes, ...],
        codes: codec.Codes,
        now: float,
    ) -> tuple[Answer, int | None]:
        """(answer, the LSN to make durable first; None: nothing logged) of one part, under
        its fragment's lock. The push's first part is judged as a whole push would be (a
        retry, an old seq, too stale, already in the round: the whole push's answer); each
        part is then checked against the parts held (`parts.judge_part`); the last one has
        the whole push judged again and merged."""
        learner = h.learner_id
        prior, refused = frag.answers.get(learner), frag.refusals.get(learner)
        if prior is not None and prior.seq == h.seq:  # the push is in: its one answer
            return dataclasses.replace(
                prior, reason=str(rules.Reason.DUPLICATE)
            ), self.wal.written_lsn
        if refused is not None and refused.seq == h.seq:
            return refused, None
        held = frag.part_sets.get(learner)
        if held is None or held.seq != h.seq:
            newest = max((a.seq for a in (prior, refused, held) if a is not None), default=None)
            verdict = self._admitted(h, frag, newest)
            if not verdict.accept:
                return self._count(self._refusal(h, frag, verdict)), None
            held = None  # a newer push than any held: those parts are dropped below
        agreed = h.agreed()
        step, problem = parts.judge_part(
            held,
            header=agreed,
            part=h.part,
            boxes=h.boxes,
            shapes=frag.shapes,
            fragment_size=frag.size,
        )
        if step is None:
            raise ShardError(Why.MALFORMED, f"fragment {h.fragment} part {h.part}: {problem}")
        held_detail = f"part {h.part} of {h.parts} held"
        if step is parts.Step.RETRY:  # its record may still be on its way to disk
            held_answer = self._part_answer(h, frag, rules.Reason.PART_HELD, held_detail)
            return held_answer, self.wal.written_lsn
        meta = {
            "fragment": h.fragment,
            "learner": learner,
            "seq": h.seq,
            "header": agreed,
            "part": h.part,
            "boxes": [b.to_json() for b in h.boxes],
        }
        records: list[storage.Record] = [*self._dropped_parts(frag, learner, "superseded", h.seq)]
        records.append(log_record_parts(LOG_PART, meta, frame))
        if step is parts.Step.HOLD:
            lsn = self._write(records)
            if len(records) > 1:
                frag.drop_parts(learner)
            frag.hold_part(learner, h.seq, agreed, h.part, h.boxes, frame, now, codes)
            return self._part_answer(h, frag, rules.Reason.PART_HELD, held_detail), lsn
        return self._completed(h, frag, (frame, codes), records, meta, now)

    def _completed(
        self,
        h: PushHeader,
        frag: Fragment,
        part: tuple[bytes | tuple[bytes, ...], codec.Codes],
        records: list[storage.Record],
        meta: dict[str, Any],
        now: float,
    ) -> tuple[Answer, int]:
        """The last part of a push in parts is in: the push is judged once more (rounds may
        have closed since its first part), then merged as one contribution, or dropped;
        `part`: its frame and checked codes."""
        learner, (frame, codes) = h.learner_id, part
        prior, refused = frag.answers.get(learner), frag.refusals.get(learner)
        newest = max((a.seq for a in (prior, refused) if a is not None), default=None)
        verdict = self._admitted(h, frag, newest)
        if verdict.accept:
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
            done = {"fragment": h.fragment, "learner": learner, "seq": h.seq}
            records.append(
                log_record(LOG_ASSEMBLED, {**done, "answer": dataclasses.asdict(answer)})
            )
        else:
            answer = self._part_answer(h, frag, verdict.reason, verdict.detail)
            records.append(log_record(LOG_PARTS_DROPPED, {**meta, "reason": str(verdict.reason)}))
        lsn = self._write(records)
        if len(records) > 2:
            frag.drop_parts(learner)  # an older push in parts, superseded
        frag.hold_part(learner, h.seq, meta["header"], h.part, h.boxes, frame, now, codes)
        if not verdict.accept:
            frag.drop_parts(learner)
            frag.refusals[learner] = answer
            self.metrics.parts_dropped.labels("refused").inc()
            return self._count(answer), lsn
        frag.contribute_parts(learner, answer, now)
        return self._count(self._joined_round(h, frag, now)), lsn

    def _admitted(self, h: PushHeader, frag: Fragment, newest: int | None) -> rules.Admission:
        """The rules' verdict on a push, whole or in parts (an invalid argument raised as
        such); `newest`: the learner's newest seq the fragment has seen."""
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
            raise ShardError(Why.MALFORMED, f"fragment {h.fragment}: {verdict.detail}")
        return verdict

    def _refusal(self, h: PushHeader, frag: Fragment, verdict: rules.Admission) -> Answer:
        """The answer to a push, whole or in parts, that the rules refused; kept (but for a
        duplicate) so that a retry gets it again."""
        answer = Answer(
            h.seq, False, str(verdict.reason), verdict.detail, frag.version, verdict.staleness, 0.0
        )
        if verdict.reason is not rules.Reason.DUPLICATE:
            frag.refusals[h.learner_id] = answer
        return answer

    def _dropped_parts(
        self, frag: Fragment, learner: str, reason: str, keep_seq: int | None = None
    ) -> list[storage.Record]:
        """The record dropping `learner`'s held parts (of a seq other than keep_seq), if
        any: logged before the record that replaces them; the caller then drops them."""
        held = frag.part_sets.get(learner)
        if held is None or held.seq == keep_seq:
            return []
        log.warning(
            "fragment %d: dropped %d of %d parts of push %d from %s (%s); none of it merged",
            frag.index,
            len(held.frames),
            held.parts,
            held.seq,
            learner,
            reason,
        )
        self.metrics.parts_dropped.labels(reason).inc()
        meta = {"fragment": frag.index, "learner": learner, "seq": held.seq, "reason": reason}
        return [log_record(LOG_PARTS_DROPPED, meta)]

    def _drop_expired_parts(self, p: int, now: float) -> float | None:
        """Drops fragment p's pushes in parts that waited too long for their other parts
        (a process of the learner died), under p's lock; returns when to look again."""
        frag = self.fragments[p]
        wait = self.cfg.part_wait_leases * self.policy.lease_seconds
        due, wake = parts.expired({m: s.started for m, s in frag.part_sets.items()}, now, wait)
        if not due or p in self.frozen:
            return wake
        records = [r for m in due for r in self._dropped_parts(frag, m, "expired")]
        lsn = self._write(records)
        for learner in due:
            held = frag.drop_parts(learner)
            assert held is not None
            detail = (
                f"{len(held.frames)} of its {held.parts} parts came in within "
                f"{wait:g} s; none of it was merged: push again with a new seq"
            )
            frag.refusals[learner] = Answer(
                held.seq, False, str(rules.Reason.PARTS_DROPPED), detail, frag.version, 0, 0.0
            )
        self._sync(lsn)  # nothing is acknowledged by it; durable all the same, like a close
        return wake
