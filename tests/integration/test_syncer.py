"""A real shard on a free port: Init, concurrent pushes, rounds, bit-exact pulls."""

from __future__ import annotations

import concurrent.futures

import grpc
import numpy as np
import pytest
from syncer_helpers import connect, describe, push_requests, serving_shard
from syncer_helpers import init as _init
from syncer_helpers import pull as _pull
from syncer_helpers import push as _push
from syncer_helpers import status_of as status

from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.plan import FragmentPlan, TensorSpec

SPECS = [
    TensorSpec("embed", (64, 16)),
    TensorSpec("w1", (16, 48)),
    TensorSpec("w2", (48, 16)),
    TensorSpec("norm", (16,)),
]


@pytest.fixture
def plan():
    return FragmentPlan.build(SPECS, 2)


@pytest.fixture
def shard(tmp_path):
    with serving_shard(tmp_path, quorum=2, grace_factor=0.0, snapshot_every=3) as server:
        yield server


def test_rounds_close_at_quorum_and_pulls_are_bit_exact(shard, plan):
    channel, stub = connect(shard.port)
    rng = np.random.default_rng(0)
    size = plan.fragment_sizes[0]
    init = rng.standard_normal(size).astype(np.float32)
    assert _init(stub, plan, 0, init).created
    assert not _init(stub, plan, 0, init).created  # a later writer is told it exists
    header, frames = _pull(stub, 0)
    assert header.snapshot and header.version == 0
    held = codec.decode(frames[0][1])
    assert held.tobytes() == init.tobytes()

    for round_ in range(4):
        deltas = [rng.standard_normal(size).astype(np.float32) * 0.01 for _ in range(2)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            acks = list(
                pool.map(
                    lambda i: _push(stub, plan, 0, f"l{i}", round_, round_, deltas[i]), range(2)
                )
            )
        assert all(a.accepted for a in acks)
        assert max(a.version for a in acks) == round_ + 1  # the second push closed the round
        # deltas from what we hold reproduce the shard's published copy exactly
        header, frames = _pull(stub, 0, have=round_)
        assert not header.snapshot and [v for v, _ in frames] == [round_ + 1]
        for _, f in frames:
            codec.decode_into(f, held, 1.0)
        _, snap = _pull(stub, 0)
        assert codec.decode(snap[0][1]).tobytes() == held.tobytes()
    watch = stub.Watch(pb.WatchRequest(fragments=[0], learner_id="w"), timeout=10)
    notice = next(watch)
    watch.cancel()
    assert (notice.fragment, notice.version, notice.contributors) == (0, 4, 2)
    channel.close()


def test_bad_pushes_get_precise_statuses(shard, plan):
    channel, stub = connect(shard.port)
    size = plan.fragment_sizes[0]
    _init(stub, plan, 0, np.zeros(size, np.float32))
    good = np.ones(size, np.float32) * 0.01

    assert (
        status(lambda: _push(stub, plan, 0, "x", 1, 5, good)) == grpc.StatusCode.INVALID_ARGUMENT
    )  # future
    assert (
        status(lambda: _push(stub, plan, 0, "x", 1, 0, np.ones(size + 1, np.float32)))
        == grpc.StatusCode.INVALID_ARGUMENT
    )  # wrong shape
    assert status(lambda: _push(stub, plan, 7, "x", 1, 0, good)) == grpc.StatusCode.NOT_FOUND
    frame = codec.encode(good)
    msgs = push_requests(plan, 0, "x", 1, 0, frame, size, chunks=1, inner_steps=1, tokens=1)
    header = msgs[0].header
    truncated = [msgs[0], pb.PushRequest(chunk=frame[:-3])]
    assert (
        status(lambda: stub.Push(iter(truncated), timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    )
    nan = np.full(size, np.nan, np.float32)
    fp32 = codec._HEADER.pack(codec.MAGIC, 1, 1, 1, size) + codec._compressor(None).compress(
        nan.tobytes()
    )
    header.codec, header.frame_bytes = pb.CODEC_FP32, len(fp32)
    assert (
        status(
            lambda: stub.Push(
                iter([pb.PushRequest(header=header), pb.PushRequest(chunk=fp32)]), timeout=10
            )
        )
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    d = describe(stub)
    assert d.fragments[0].version == 0 and d.fragments[0].round_size == 0  # nothing changed
    channel.close()
