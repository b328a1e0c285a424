"""Pushes that used to brick a shard or lock a learner out, against a real `atoll syncer`
process: each is refused with INVALID_ARGUMENT before anything is logged, the shard
changes nothing, takes good pushes after them, and restarts after a kill -9."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest

from server.rules import MAX_SEQ_JUMP
from syncer_helpers import (PLAN, connect, init, pull, push, push_requests, shard_state, status_of,
                            syncer_processes)
from wire import codec
from wire import syncer_pb2 as pb

U64 = (1 << 64) - 1
SIZE0 = PLAN.fragment_sizes[0]


@pytest.fixture
def shard(tmp_path):
    with syncer_processes(tmp_path) as start:
        proc = start(tmp_path / "data", "--quorum=2", "--grace-factor=0", "--lease-seconds=600")
        channel, stub = connect(proc.port)
        for p in range(PLAN.num_fragments):
            init(stub, PLAN, p, np.zeros(PLAN.fragment_sizes[p], np.float32))
        yield proc, stub, start, tmp_path / "data"
        channel.close()


def _raw_push(stub, frame: bytes, codec_id: int, **header):
    msgs = push_requests(PLAN, 0, header.pop("learner", "l0"), header.pop("seq", 1), 0, frame, SIZE0,
                         codec_id=codec_id, **header)
    return stub.Push(iter(msgs), timeout=10)


HUGE = np.full(SIZE0, 3e38, np.float32)
POISON = {
    "int4 frame at the largest scale": lambda stub: _raw_push(stub, codec.encode(HUGE, codec.Codec.INT4),
                                                              pb.CODEC_INT4),
    "fp32 frame of 3e38": lambda stub: _raw_push(stub, codec.encode(HUGE, codec.Codec.FP32), pb.CODEC_FP32),
    "fp32 frame beyond 1e9": lambda stub: _raw_push(
        stub, codec.encode(np.full(SIZE0, 2e9, np.float32), codec.Codec.FP32), pb.CODEC_FP32),
    "tokens 2^64-1 in one step": lambda stub: push(stub, PLAN, 0, "l0", 1, 0, np.ones(SIZE0), tokens=U64,
                                                    inner_steps=1),
    "step_seconds 1e308": lambda stub: push(stub, PLAN, 0, "l0", 1, 0, np.ones(SIZE0), step_seconds=1e308,
                                            overlap_steps=2),
    "step_seconds inf": lambda stub: push(stub, PLAN, 0, "l0", 1, 0, np.ones(SIZE0), step_seconds=math.inf),
    "overlap 2^32-1": lambda stub: push(stub, PLAN, 0, "l0", 1, 0, np.ones(SIZE0), overlap_steps=(1 << 32) - 1),
    "seq 2^64-1": lambda stub: push(stub, PLAN, 0, "l0", U64, 0, np.ones(SIZE0)),
    "seq far ahead": lambda stub: push(stub, PLAN, 0, "l0", MAX_SEQ_JUMP + 1, 0, np.ones(SIZE0)),
    "fewer tokens than steps": lambda stub: push(stub, PLAN, 0, "l0", 1, 0, np.ones(SIZE0), tokens=5,
                                                 inner_steps=10),
}


def test_poison_pushes_are_refused_and_the_shard_survives_kill_9(shard):
    proc, stub, start, data = shard
    before = shard_state(stub)
    for name, send in POISON.items():
        assert status_of(lambda: send(stub)) == grpc.StatusCode.INVALID_ARGUMENT, name
    assert shard_state(stub) == before  # nothing logged, nothing merged, no round opened
    # the learner the poison claimed to be is not locked out: seq 1 is still new
    ok = push(stub, PLAN, 0, "l0", 1, 0, np.full(SIZE0, 0.01, np.float32))
    assert ok.accepted and ok.reason == pb.PUSH_REASON_FRESH
    push(stub, PLAN, 0, "l1", 1, 0, np.full(SIZE0, 0.02, np.float32))  # closes the round (K=2)
    assert shard_state(stub)[0]["version"] == 1
    proc.kill()
    again = start(data, "--quorum=2", "--grace-factor=0", "--lease-seconds=600")
    _, stub2 = connect(again.port)
    assert shard_state(stub2)[0]["version"] == 1
    header, _ = pull(stub2, 0, learner="l0")
    assert header.last_seq == 1  # a restarted learner goes on from here


def test_a_retried_refusal_gets_its_first_answer(shard):
    _, stub, _, _ = shard
    delta = np.full(SIZE0, 0.01, np.float32)
    assert push(stub, PLAN, 0, "a", 1, 0, delta).accepted
    assert push(stub, PLAN, 0, "b", 1, 0, delta).accepted  # version 1
    assert push(stub, PLAN, 0, "a", 2, 1, delta).accepted
    assert push(stub, PLAN, 0, "b", 2, 1, delta).accepted  # version 2
    first = push(stub, PLAN, 0, "a", 3, 2, delta)
    assert first.accepted
    again = push(stub, PLAN, 0, "a", 4, 2, delta)  # a is already in the open round
    assert (again.accepted, again.reason) == (False, pb.PUSH_REASON_ALREADY_IN_ROUND)
    assert push(stub, PLAN, 0, "b", 3, 2, delta).accepted  # closes: version 3
    retry = push(stub, PLAN, 0, "a", 4, 2, delta)  # the same push again, now that the round closed
    assert (retry.accepted, retry.reason, retry.version) == (False, pb.PUSH_REASON_ALREADY_IN_ROUND, 2)
    header, _ = pull(stub, 0, learner="a")
    assert header.last_seq == 4
