"""A push in parts (server/parts.py): the assembly decisions as pure functions, and the
shard on a fake clock and in-memory storage taking pushes in parts: the same bits as the
push whole, each part once, all or nothing, dropped after its bound, rebuilt by replay."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_shard_memory import PLAN, Clock, MemoryLog, MemorySnapshots, _seed, _shard, _state

from atoll.server import parts
from atoll.server.log_records import LOG_ASSEMBLED, LOG_PART, LOG_PARTS_DROPPED, parse_log_record
from atoll.server.parts import Box, Step
from atoll.server.refusal import Why
from atoll.server.shard import PushHeader, ShardError
from atoll.wire import codec

SHAPES = ((4, 6), (3,))
SIZE = 27
HEADER = {"parts": 2, "tokens": 10}


# --- the decisions ---


def test_a_box_past_its_tensor_or_empty_or_of_the_wrong_rank_is_a_problem():
    assert parts.box_problem(Box(0), SHAPES) is None
    assert parts.box_problem(Box(0, (0, 0), (4, 6)), SHAPES) is None
    assert "exceeds" in parts.box_problem(Box(0, (0, 0), (5, 6)), SHAPES)
    assert "empty" in parts.box_problem(Box(1, (2,), (2,)), SHAPES)
    assert "one bound per dimension" in parts.box_problem(Box(0, (0,), (4,)), SHAPES)
    assert "2 tensors" in parts.box_problem(Box(2), SHAPES)
    assert "overlap" in parts.boxes_problem(
        [Box(0, (0, 0), (2, 6)), Box(0, (1, 3), (3, 4))], SHAPES
    )
    assert parts.boxes_problem([Box(0, (0, 0), (2, 6)), Box(0, (2, 0), (4, 6))], SHAPES) is None
    assert "at least one box" in parts.boxes_problem([], SHAPES)


def _judge(held, part, boxes, header=HEADER):
    return parts.judge_part(
        held, header=header, part=part, boxes=boxes, shapes=SHAPES, fragment_size=SIZE
    )


def _held(boxes_of: dict[int, tuple[Box, ...]]) -> parts.PartSet:
    return parts.PartSet(7, dict(HEADER), dict(boxes_of), {k: b"" for k in boxes_of}, 0.0)


def test_parts_are_held_until_the_last_one_and_complete_only_when_they_cover_the_fragment():
    first = (Box(0, (0, 0), (4, 3)),)
    assert _judge(None, 0, first) == (Step.HOLD, "")
    rest = (Box(0, (0, 3), (4, 6)), Box(1))
    assert _judge(_held({0: first}), 1, rest) == (Step.COMPLETE, "")
    # the same part again: a retry, answered as before
    assert _judge(_held({0: first}), 0, first) == (Step.RETRY, "")


def test_overlaps_gaps_other_boxes_for_a_held_part_and_disagreeing_headers_are_refused():
    first = (Box(0, (0, 0), (4, 3)),)
    step, why = _judge(_held({0: first}), 1, (Box(0, (0, 2), (4, 6)), Box(1)))
    assert step is None and "overlap" in why
    step, why = _judge(_held({0: first}), 1, (Box(0, (0, 3), (4, 6)),))
    assert step is None and "leave some out" in why
    step, why = _judge(_held({0: first}), 0, (Box(1),))
    assert step is None and "other boxes" in why
    step, why = _judge(_held({0: first}), 1, (Box(1),), header={"parts": 2, "tokens": 11})
    assert step is None and "tokens" in why
    step, why = _judge(None, 2, first)
    assert step is None and "part 2 of a push in 2 parts" in why


def test_incomplete_parts_expire_a_bound_after_their_first_part():
    assert parts.expired({"a": 0.0, "b": 5.0}, now=10.0, wait_seconds=8.0) == (["a"], 13.0)
    assert parts.expired({}, now=10.0, wait_seconds=8.0) == ([], None)
    assert parts.expired({"a": 0.0}, now=7.9, wait_seconds=8.0) == ([], 8.0)


def test_assemble_writes_each_box_where_its_tensor_lives():
    out = np.zeros(SIZE, np.float32)
    boxes = (Box(0, (1, 2), (3, 5)), Box(1, (1,), (3,)))
    parts.assemble(out, [0, 24], SHAPES, boxes, np.arange(1, 9, dtype=np.float32))
    want = np.zeros(SIZE, np.float32)
    want[:24].reshape(4, 6)[1:3, 2:5] = np.arange(1, 7).reshape(2, 3)
    want[25:27] = [7, 8]
    np.testing.assert_array_equal(out, want)


# --- the shard, on a fake clock and in-memory storage ---

P = 1  # fragment 1 of PLAN: tensors w1 (8, 24) and w2 (24, 8)


def _header(learner: str, seq: int, base: int, **kw) -> PushHeader:
    fields = dict(
        learner_id=learner,
        fragment=P,
        base_version=base,
        seq=seq,
        inner_steps=4,
        tokens=400,
        codec=int(codec.Codec.FP32),
        num_params=PLAN.fragment_sizes[P],
        plan_fingerprint=PLAN.fingerprint,
    )
    return PushHeader(**{**fields, **{k: int(v) if k == "codec" else v for k, v in kw.items()}})


def _delta(learner: str, seq: int) -> np.ndarray:
    rng = np.random.default_rng([ord(learner[-1]), seq])
    return (rng.standard_normal(PLAN.fragment_sizes[P]) * 0.01).astype(np.float32)


def _shapes():
    return [tuple(s.spec.shape) for s in PLAN.tensors_of(P)]


def _offsets():
    return [s.offset for s in PLAN.tensors_of(P)]


# FSDP of w1 over its columns (split mid-row: many flat ranges) and of w2 over its rows,
# as 4 processes of a learner hold them.
FOUR = [
    (Box(0, (0, 0), (8, 6)), Box(1, (0, 0), (6, 8))),
    (Box(0, (0, 6), (8, 12)), Box(1, (6, 0), (12, 8))),
    (Box(0, (0, 12), (8, 18)), Box(1, (12, 0), (18, 8))),
    (Box(0, (0, 18), (8, 24)), Box(1, (18, 0), (24, 8))),
]


def _values(delta: np.ndarray, boxes) -> np.ndarray:
    """A process's values of `boxes` of the fragment vector `delta`, box after box."""
    shapes, offsets = _shapes(), _offsets()
    out = []
    for b in boxes:
        shape = shapes[b.tensor]
        tensor = delta[offsets[b.tensor] : offsets[b.tensor] + int(np.prod(shape))].reshape(shape)
        out.append(b.view(tensor).reshape(-1))
    return np.concatenate(out)


def _push_parts(shard, learner, seq, base, delta, layout=FOUR, order=None, codec_id=None):
    codec_id = codec.Codec.FP32 if codec_id is None else codec_id
    answers = {}
    for k in order or range(len(layout)):
        h = _header(learner, seq, base, codec=codec_id, parts=len(layout), part=k, boxes=layout[k])
        answers[k] = shard.push(h, codec.encode(_values(delta, layout[k]), codec_id))
    return answers


def _push_whole(shard, learner, seq, base, delta, codec_id=codec.Codec.FP32):
    return shard.push(_header(learner, seq, base, codec=codec_id), codec.encode(delta, codec_id))


def _two(**kw):
    """Two shards on fake clocks and in-memory storage, seeded alike (quorum 2)."""
    out = []
    for _ in range(2):
        log, snaps, clock = MemoryLog(), MemorySnapshots(), Clock()
        shard = _shard(log, snaps, clock, **kw)
        _seed(shard)
        out.append((shard, log, snaps, clock))
    return out


@pytest.mark.parametrize("codec_id", [codec.Codec.FP32, codec.Codec.INT4])
def test_a_push_in_four_parts_gives_the_bits_of_the_same_values_pushed_whole(codec_id):
    (whole, *_), (split, *_) = _two()
    for r in range(3):
        a, b = _delta("a", r + 1), _delta("b", r + 1)
        if codec_id is codec.Codec.INT4:
            # the same values: what the parts' own frames decode to, pushed whole losslessly
            a = np.zeros_like(a)
            for boxes in FOUR:
                got = codec.decode(codec.encode(_values(_delta("a", r + 1), boxes), codec_id))
                parts.assemble(a, _offsets(), _shapes(), boxes, got)
        answers = _push_parts(split, "la", r + 1, r, a, order=[2, 0, 3, 1], codec_id=codec_id)
        assert [answers[k].reason for k in (2, 0, 3)] == ["part_held"] * 3
        assert answers[1].accepted and answers[1].reason == "fresh"
        assert _push_whole(whole, "la", r + 1, r, a).accepted
        # a round's norms and sums are over the whole push: compare the open round exactly
        for name in ("acc", "norm_sum"):
            got, want = (getattr(s.fragments[P].round.state(), name) for s in (split, whole))
            assert got.tobytes() == want.tobytes(), name
        assert _push_whole(split, "lb", r + 1, r, b).accepted
        assert _push_whole(whole, "lb", r + 1, r, b).accepted
        assert split.fragments[P].version == r + 1
    assert _state(split) == _state(whole)


def test_each_part_is_durable_before_its_answer_and_a_retry_is_answered_once():
    (shard, log, _, _), _ = _two()
    delta = _delta("a", 1)
    h = _header("la", 1, 0, parts=4, part=0, boxes=FOUR[0])
    frame = codec.encode(_values(delta, FOUR[0]), codec.Codec.FP32)
    first = shard.push(h, frame)
    assert first.accepted and first.reason == "part_held"
    kinds = [parse_log_record(r)[0] for _, r in log.records]
    assert kinds.count(LOG_PART) == 1 and log.durable_lsn == log.records[-1][0]
    assert shard.push(h, frame) == first  # a retry: the same answer, nothing logged
    assert [parse_log_record(r)[0] for _, r in log.records].count(LOG_PART) == 1
    answers = _push_parts(shard, "la", 1, 0, delta, order=[1, 2, 3])
    assert answers[3].reason == "fresh"
    # every part retried after the push is in gets the push's one answer
    again = shard.push(h, frame)
    assert again.accepted and again.reason == "duplicate" and again.seq == 1
    assert shard.fragments[P].round.count == 1
    kinds = [parse_log_record(r)[0] for _, r in log.records]
    assert kinds.count(LOG_PART) == 4 and kinds.count(LOG_ASSEMBLED) == 1


def _refused(shard, h, frame) -> ShardError:
    with pytest.raises(ShardError) as e:
        shard.push(h, frame)
    return e.value


def test_overlapping_gapped_oversize_and_disagreeing_parts_are_invalid_and_change_nothing():
    (shard, log, _, _), _ = _two()
    delta = _delta("a", 1)
    _push_parts(shard, "la", 1, 0, delta, order=[0])
    before = list(log.records)

    def part(k, boxes, **kw):
        h = _header("la", 1, 0, parts=4, part=k, boxes=boxes, **kw)
        return h, codec.encode(_values(delta, boxes), codec.Codec.FP32)

    overlapping = (Box(0, (0, 5), (8, 12)), Box(1, (6, 0), (12, 8)))
    past = (Box(0, (0, 6), (9, 12)),)
    for h, frame in (part(1, overlapping), part(1, past), part(1, FOUR[1], tokens=401)):
        assert _refused(shard, h, frame).why is Why.MALFORMED
    h, _ = part(1, FOUR[1])
    short = codec.encode(_values(delta, FOUR[1])[:-1], codec.Codec.FP32)
    assert _refused(shard, h, short).why is Why.MALFORMED  # a frame of other than its boxes
    _push_parts(shard, "la", 1, 0, delta, order=[1, 2])
    gapped = (Box(0, (0, 18), (8, 24)), Box(1, (18, 0), (23, 8)))
    assert "leave some out" in str(_refused(shard, *part(3, gapped)))
    assert shard.fragments[P].round.count == 0 and len(log.records) == len(before) + 2
    assert sorted(shard.fragments[P].part_sets["la"].frames) == [0, 1, 2]
    assert _push_parts(shard, "la", 1, 0, delta, order=[3])[3].reason == "fresh"


def test_a_part_gets_the_refusal_a_whole_push_would_get():
    (shard, *_), _ = _two(max_staleness=0)
    delta = _delta("a", 1)
    assert _push_whole(shard, "la", 1, 0, delta).accepted
    # already in the open round
    assert _push_parts(shard, "la", 2, 0, delta, order=[0])[0].reason == "already_in_round"
    # an older seq than the learner's newest
    assert _push_parts(shard, "la", 0, 0, delta, order=[0])[0].reason == "duplicate"
    assert _push_whole(shard, "lb", 1, 0, delta).accepted  # closes the round: version 1
    assert _push_parts(shard, "la", 3, 0, delta, order=[0])[0].reason == "too_stale"
    with pytest.raises(ShardError) as e:  # a base from the future
        _push_parts(shard, "la", 4, 9, delta, order=[0])
    assert e.value.why is Why.MALFORMED
    assert not shard.fragments[P].part_sets


def test_incomplete_parts_are_dropped_after_the_bound_and_never_touch_the_model():
    (shard, log, _, clock), (reference, *_) = _two(quorum=1, lease_seconds=10.0)
    _push_parts(shard, "la", 1, 0, _delta("a", 1), order=[0, 1, 2])  # process 3 died
    assert shard.fragments[P].round.count == 0
    clock.now += 19.0  # part_wait_leases 2 × lease 10 s, from the first part
    shard.tick()
    assert "la" in shard.fragments[P].part_sets
    clock.now += 1.0
    shard.tick()
    assert not shard.fragments[P].part_sets
    assert shard.metrics.parts_dropped.labels("expired")._value.get() == 1
    assert parse_log_record(log.records[-1][1])[0] == LOG_PARTS_DROPPED
    # the straggler comes too late: refused, nothing merged
    late = _push_parts(shard, "la", 1, 0, _delta("a", 1), order=[3])[3]
    assert not late.accepted and late.reason == "parts_dropped"
    # the learner goes on with a new seq; the round holds that push alone
    assert _push_parts(shard, "la", 2, 0, _delta("a", 2))[3].reason == "fresh"
    assert _push_whole(reference, "la", 2, 0, _delta("a", 2)).accepted
    assert _state(shard) == _state(reference)


def test_replay_rebuilds_held_parts_merges_nothing_partial_and_completes_with_the_rest():
    (shard, log, snaps, clock), (reference, *_) = _two(snapshot_every=1)
    a, b = _delta("a", 1), _delta("b", 1)
    assert _push_whole(shard, "lb", 1, 0, b).accepted
    _push_parts(shard, "la", 1, 0, a, order=[0, 2])
    shard._snapshot()  # the held parts go into the snapshot, and the log is cut after it
    _push_parts(shard, "la", 1, 0, a, order=[3])  # and one more after it, in the log only
    log.crash()
    back = _shard(log, snaps, clock)
    held = back.fragments[P].part_sets["la"]
    assert sorted(held.frames) == [0, 2, 3] and back.fragments[P].round.count == 1
    assert _push_parts(back, "la", 1, 0, a, order=[0])[0].reason == "part_held"  # a retry
    assert _push_parts(back, "la", 1, 0, a, order=[1])[1].reason == "fresh"  # the round closes
    assert _push_whole(reference, "lb", 1, 0, b).accepted
    assert _push_whole(reference, "la", 1, 0, a).accepted
    assert _state(back) == _state(reference)
    again = _shard(log, snaps, clock)  # and replaying the completion lands on the same bits
    assert _state(again) == _state(reference)


def test_a_newer_push_replaces_an_unfinished_one_in_parts():
    (shard, *_), _ = _two()
    _push_parts(shard, "la", 1, 0, _delta("a", 1), order=[0, 1])
    assert _push_whole(shard, "la", 2, 0, _delta("a", 2)).accepted
    assert not shard.fragments[P].part_sets
    assert shard.metrics.parts_dropped.labels("superseded")._value.get() == 1
    h = _header("la", 2, 0, parts=4, part=0, boxes=FOUR[0])
    assert dataclasses.replace(h, parts=0, part=0, boxes=()).problem() is None


@pytest.mark.parametrize("held_in", ["log", "snapshot"])
def test_a_learner_resuming_goes_on_above_a_push_in_parts_its_last_run_left_unfinished(held_in):
    """The learner's newest seq (a pull's last_seq) counts a push in parts still missing
    parts, after a restart too, so a resumed learner never sends a part of that seq again;
    its next push supersedes the held parts, and a straggler of them changes nothing."""
    (shard, log, snaps, clock), (reference, *_) = _two()
    old = _delta("a", 1)
    _push_parts(shard, "la", 1, 0, old, order=[0, 1])  # its processes died before parts 2, 3
    assert shard.newest_seq("la", P) == 1
    if held_in == "snapshot":
        shard._snapshot()
    log.crash()
    back = _shard(log, snaps, clock)
    assert sorted(back.fragments[P].part_sets["la"].frames) == [0, 1]
    seq = back.newest_seq("la", P) + 1  # what the resumed learner sends next
    assert seq == 2
    new = _delta("a", 2)
    answers = _push_parts(back, "la", seq, 0, new, order=[2, 0])
    assert [answers[k].reason for k in (2, 0)] == ["part_held"] * 2
    held = back.fragments[P].part_sets["la"]
    assert (held.seq, sorted(held.frames)) == (2, [0, 2])  # none of the old parts in it
    assert back.metrics.parts_dropped.labels("superseded")._value.get() == 1
    (dropped, meta, _), *after = [parse_log_record(r) for _, r in log.records[-3:]]
    assert (dropped, meta["seq"], meta["reason"]) == (LOG_PARTS_DROPPED, 1, "superseded")
    assert [kind for kind, *_ in after] == [LOG_PART, LOG_PART]  # logged before the new parts
    straggler = _push_parts(back, "la", 1, 0, old, order=[3])[3]
    assert not straggler.accepted and straggler.reason == "duplicate"
    assert _push_parts(back, "la", seq, 0, new, order=[1, 3])[3].accepted
    assert _push_whole(back, "lb", 1, 0, _delta("b", 1)).version == 1
    assert _push_whole(reference, "la", seq, 0, new).accepted
    assert _push_whole(reference, "lb", 1, 0, _delta("b", 1)).version == 1
    assert _state(back) == _state(reference)  # the old run's parts never touched the model


def test_a_push_that_went_too_stale_before_its_last_part_is_refused_then_and_dropped():
    (shard, log, _, _), _ = _two(max_staleness=0)
    a = _delta("a", 1)
    _push_parts(shard, "la", 1, 0, a, order=[0, 1, 2])
    assert _push_whole(shard, "lb", 1, 0, _delta("b", 1)).accepted
    assert _push_whole(shard, "lc", 1, 0, _delta("c", 1)).version == 1  # quorum 2: closed
    last = _push_parts(shard, "la", 1, 0, a, order=[3])[3]
    assert not last.accepted and last.reason == "too_stale"
    assert _push_parts(shard, "la", 1, 0, a, order=[0])[0] == last  # one answer
    assert not shard.fragments[P].part_sets and shard.fragments[P].round.count == 0
    assert parse_log_record(log.records[-1][1])[0] == LOG_PARTS_DROPPED
    assert shard.metrics.parts_dropped.labels("refused")._value.get() == 1


def test_a_whole_push_with_the_seq_of_a_push_in_parts_is_invalid():
    (shard, *_), _ = _two()
    _push_parts(shard, "la", 1, 0, _delta("a", 1), order=[0])
    with pytest.raises(ShardError) as e:
        _push_whole(shard, "la", 1, 0, _delta("a", 1))
    assert e.value.why is Why.MALFORMED and "push in parts" in str(e.value)
    assert sorted(shard.fragments[P].part_sets["la"].frames) == [0]


def test_a_part_with_a_value_past_the_bound_is_invalid_but_a_large_norm_alone_is_not():
    (shard, log, _, _), _ = _two()
    before = len(log.records)
    values = np.full(parts.part_size(FOUR[0], _shapes()), 9e8, np.float32)  # norm > 1e9
    h = _header("la", 1, 0, parts=4, part=0, boxes=FOUR[0])
    values[5] = 2e9
    e = _refused(shard, h, codec.encode(values, codec.Codec.FP32))
    assert e.why is Why.MALFORMED and "beyond" in str(e)
    assert len(log.records) == before and not shard.fragments[P].part_sets
    values[5] = -1e9  # every value within the bound, the part's norm far past it
    assert shard.push(h, codec.encode(values, codec.Codec.FP32)).reason == "part_held"


def test_the_overlap_check_finds_what_comparing_every_pair_finds():
    rng = np.random.default_rng(0)
    shapes = ((12, 10), (7,))
    for _ in range(300):
        boxes = []
        for _ in range(int(rng.integers(2, 9))):
            t = int(rng.integers(0, 2))
            lo = [int(rng.integers(0, n)) for n in shapes[t]]
            hi = [int(rng.integers(a + 1, n + 1)) for a, n in zip(lo, shapes[t])]
            boxes.append(Box(t, tuple(lo), tuple(hi)))
        clash = any(parts.overlap(a, b, shapes) for i, a in enumerate(boxes) for b in boxes[:i])
        # one part carrying them all, and each in a part of its own
        assert (parts.boxes_problem(boxes, shapes) is not None) == clash
        header = {"parts": len(boxes) + 1}
        held, refused = None, False
        for k, box in enumerate(boxes):
            step, why = parts.judge_part(
                held, header=header, part=k, boxes=[box], shapes=shapes, fragment_size=127
            )
            if step is None:
                assert "overlap" in why
                refused = True
                break
            held = held or parts.PartSet(1, dict(header), {}, {}, 0.0)
            held.boxes[k], held.frames[k] = (box,), b""
        assert refused == clash
    # P parts split by rows: each part set against the few rows near its own
    many = [(Box(0, (k, 0), (k + 1, 10)),) for k in range(12)]
    held = parts.PartSet(1, {"parts": 13}, dict(enumerate(many)), {}, 0.0)
    assert parts.judge_part(
        held, header={"parts": 13}, part=12, boxes=[Box(1)], shapes=shapes, fragment_size=127
    ) == (Step.COMPLETE, "")
    index = held.held_index(shapes)[0]
    assert index.axis == 0 and index.longest == 1 and len(index.boxes) == 12
