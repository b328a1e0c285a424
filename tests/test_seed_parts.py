"""A seed in parts (server/seed_parts.py) on the shard with a fake clock and in-memory
storage: the same bits as a whole seed, each part once, refusals that change nothing,
and every acknowledged part kept across a restart (from the log or a snapshot)."""

from __future__ import annotations

import numpy as np
import pytest
from test_parts import FOUR, P, _values
from test_shard_memory import PLAN, Clock, MemoryLog, MemorySnapshots, _shard

from atoll.server.log_records import LOG_INIT, LOG_INIT_PART, parse_log_record
from atoll.server.parts import Box
from atoll.server.refusal import Why
from atoll.server.seed_parts import SeedPart
from atoll.server.shard import ShardError
from atoll.wire import codec

SIZE = PLAN.fragment_sizes[P]


def _seed_values(p: int) -> np.ndarray:
    return np.random.default_rng([7, p]).standard_normal(PLAN.fragment_sizes[p]).astype(np.float32)


def _new():
    log, snaps, clock = MemoryLog(), MemorySnapshots(), Clock()
    return _shard(log, snaps, clock), log, snaps, clock


def _send(shard, k, layout=FOUR, run="run-a", values=None, parts=None, num_params=SIZE):
    values = _seed_values(P) if values is None else values
    part = SeedPart(run, k, len(layout) if parts is None else parts, tuple(layout[k]), np.zeros(0))
    frame = codec.encode(_values(values, layout[k]), codec.Codec.FP32)
    return shard.init_part(
        "l", P, PLAN.fingerprint, PLAN.to_json(), frame, int(codec.Codec.FP32), num_params, part
    )


def _whole(shard, p=P):
    frame = codec.encode(_seed_values(p), codec.Codec.FP32)
    size = PLAN.fragment_sizes[p]
    return shard.init("l", p, PLAN.fingerprint, PLAN.to_json(), frame, int(codec.Codec.FP32), size)


def _kinds(log) -> list[int]:
    return [parse_log_record(r)[0] for _, r in log.records]


def test_four_parts_seed_the_bits_of_a_whole_seed_once_the_last_is_in():
    shard, log, *_ = _new()
    for k in (2, 0, 3):
        assert _send(shard, k) == (False, 0, True)
        assert not shard.fragments[P].initialized
    assert _send(shard, 1) == (True, 0, False)
    reference, *_ = _new()
    assert _whole(reference) == (True, 0)
    assert shard.fragments[P].params.tobytes() == reference.fragments[P].params.tobytes()
    assert shard.fragments[P].published.tobytes() == reference.fragments[P].published.tobytes()
    assert _kinds(log)[1:] == [LOG_INIT_PART] * 3 + [LOG_INIT]  # after the plan
    assert _send(shard, 0) == (False, 0, False)  # a part after the seed: it exists


def test_a_retried_part_changes_nothing_and_each_part_is_logged_once():
    shard, log, *_ = _new()
    assert _send(shard, 1) == (False, 0, True)
    before = len(log.records)
    assert _send(shard, 1) == (False, 0, True)
    assert len(log.records) == before and list(shard.seeds.pending[P].held) == [1]


def _refused(call) -> ShardError:
    with pytest.raises(ShardError) as e:
        call()
    return e.value


@pytest.mark.parametrize(
    "kw, why, words",
    [
        ({"parts": 5}, Why.MALFORMED, "says 5 parts"),
        ({"run": "run-b"}, Why.BUSY, "being seeded by run 'run-a'"),
        ({"layout": [FOUR[0], FOUR[0]], "parts": 4}, Why.MALFORMED, "overlaps part 0"),
        ({"values": _seed_values(P) + 1}, Why.OUT_OF_STEP, "held with other boxes or values"),
    ],
)
def test_a_part_that_disagrees_with_those_held_is_refused_and_changes_nothing(kw, why, words):
    shard, log, *_ = _new()
    assert _send(shard, 0) == (False, 0, True)
    before = len(log.records)
    k = 1 if "layout" in kw or "values" not in kw else 0
    e = _refused(lambda: _send(shard, k, **kw))
    assert e.why is why and words in str(e), str(e)
    assert len(log.records) == before and list(shard.seeds.pending[P].held) == [0]


def test_parts_that_break_the_plan_are_invalid_and_change_nothing():
    shard, log, *_ = _new()
    past = [(Box(0, (0, 0), (9, 6)),)]  # 9 rows of an 8-row tensor
    gap = [FOUR[0], FOUR[1]]  # two parts that leave half the fragment out
    cases = [
        (lambda: _send(shard, 0, layout=past, parts=1), "exceeds its shape"),
        (lambda: _send(shard, 4, layout=[*FOUR, FOUR[0]], parts=4), "index in [0, parts)"),
        (lambda: _send(shard, 0, num_params=SIZE - 1), f"holds {SIZE} params"),
        (lambda: _send(shard, 0, run=""), "must name its run_id"),
    ]
    for call, words in cases:
        e = _refused(call)
        assert e.why is Why.MALFORMED and words in str(e), str(e)
    assert log.records == [] and shard.plan is None  # not even the plan went in
    assert _send(shard, 0, layout=gap) == (False, 0, True)
    e = _refused(lambda: _send(shard, 1, layout=gap))
    assert e.why is Why.MALFORMED and "hold 192 of its 384 values" in str(e), str(e)
    assert list(shard.seeds.pending[P].held) == [0] and not shard.fragments[P].initialized


def test_acknowledged_parts_survive_a_restart_from_the_log_and_from_a_snapshot():
    shard, log, snaps, clock = _new()
    _whole(shard, 1 - P)  # the other fragment, so a snapshot has something to hold
    assert _send(shard, 0)[2] and _send(shard, 3)[2]
    shard._snapshot()
    assert _send(shard, 2)[2]  # in the log only, after the snapshot
    log.crash()
    back = _shard(log, snaps, clock)
    assert sorted(back.seeds.pending[P].held) == [0, 2, 3]
    assert _send(back, 0) == (False, 0, True)  # a retry after the restart: nothing new
    assert _send(back, 1) == (True, 0, False)
    reference, *_ = _new()
    _whole(reference, 1 - P)
    _whole(reference)
    assert back.fragments[P].params.tobytes() == reference.fragments[P].params.tobytes()
    again = _shard(log, snaps, clock)  # replaying the seed drops its parts
    assert again.fragments[P].initialized and P not in again.seeds.pending
    assert again.fragments[P].params.tobytes() == reference.fragments[P].params.tobytes()


def test_a_stale_run_of_parts_gives_way_to_another_run_once_the_parts_wait_is_over():
    shard, log, snaps, clock = _new()
    assert _send(shard, 0)[2] and _send(shard, 1)[2]  # run-a stops there (a process died)
    clock.now += shard.seeds.wait - 1
    assert _refused(lambda: _send(shard, 2, run="run-b")).why is Why.BUSY
    clock.now += 2
    assert _send(shard, 2, run="run-b")[2]  # replaces run-a's parts
    assert sorted(shard.seeds.pending[P].held) == [2]
    back = _shard(log, snaps, clock)  # and replay replaces them the same way
    assert back.seeds.pending[P].run == "run-b" and sorted(back.seeds.pending[P].held) == [2]
    for k in (0, 1, 3):
        _send(back, k, run="run-b")
    assert back.fragments[P].initialized
    assert back.fragments[P].params.tobytes() == _seed_values(P).tobytes()
