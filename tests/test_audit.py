"""server/audit.py on a real shard's data directory: a push taken in parts is one
accepted push, found by its assembly record; parts never assembled are none."""

from __future__ import annotations

import numpy as np

from atoll.server.audit import durable_pushes, lost_acks
from atoll.server.config import ShardConfig
from atoll.server.parts import Box
from atoll.server.shard import PushHeader, Shard
from atoll.wire import codec
from atoll.wire.plan import FragmentPlan, TensorSpec

PLAN = FragmentPlan.build([TensorSpec("w", (8, 4)), TensorSpec("b", (6,))], 1)
SIZE = PLAN.fragment_sizes[0]
SHAPES = [tuple(s.spec.shape) for s in PLAN.tensors_of(0)]
W, B = (SHAPES.index(s) for s in ((8, 4), (6,)))
ROWS = [(Box(W, (0, 0), (4, 4)), Box(B, (0,), (3,))), (Box(W, (4, 0), (8, 4)), Box(B, (3,), (6,)))]


def _header(learner: str, seq: int, **kw) -> PushHeader:
    return PushHeader(
        learner_id=learner,
        fragment=0,
        base_version=0,
        seq=seq,
        inner_steps=1,
        tokens=1,
        codec=int(codec.Codec.FP32),
        num_params=SIZE,
        plan_fingerprint=PLAN.fingerprint,
        **kw,
    )


def _part(learner: str, seq: int, k: int) -> tuple[PushHeader, bytes]:
    n = sum(b.size(SHAPES[b.tensor]) for b in ROWS[k])
    frame = codec.encode(np.full(n, 0.01 * (k + 1), np.float32), codec.Codec.FP32)
    return _header(learner, seq, parts=2, part=k, boxes=ROWS[k]), frame


def test_a_push_in_parts_is_one_accepted_push_and_unassembled_parts_are_none(tmp_path):
    shard = Shard(ShardConfig(shard_index=0, num_shards=1, data_dir=tmp_path, quorum=3))
    shard.recover()
    zeros = codec.encode(np.zeros(SIZE, np.float32), codec.Codec.FP32)
    shard.init("x", 0, PLAN.fingerprint, PLAN.to_json(), zeros, codec.Codec.FP32, SIZE)
    whole = shard.push(
        _header("w", 1), codec.encode(np.full(SIZE, 0.01, np.float32), codec.Codec.FP32)
    )
    held = shard.push(*_part("p", 1, 0))
    retried = shard.push(*_part("p", 1, 0))
    last = shard.push(*_part("p", 1, 1))
    again = shard.push(*_part("p", 1, 1))  # a retry after the push is in: its one answer
    lone = shard.push(*_part("q", 1, 0))  # its other part never comes
    assert whole.accepted and last.accepted and last.reason == "fresh"
    assert held.reason == retried.reason == lone.reason == "part_held"
    assert again.reason == "duplicate"
    shard.close()
    durable = durable_pushes(tmp_path)
    assert durable[("w", 0)].logged == {1} and durable[("p", 0)].logged == {1}
    assert ("q", 0) not in durable  # held parts are no push yet
    acks = [{"learner": m, "fragment": 0, "seq": 1, "accepted": True} for m in ("w", "p", "q")]
    assert lost_acks(acks, durable) == [acks[2]]
