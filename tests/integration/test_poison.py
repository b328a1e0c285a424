"""Pushes that used to brick a shard or lock a learner out, against a real `atoll syncer`
process: each is refused with INVALID_ARGUMENT before anything is logged, the shard
changes nothing, takes good pushes after them, and restarts after a kill -9."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from syncer_helpers import (
    PLAN,
    REPO,
    connect,
    health_status,
    init,
    pull,
    push,
    push_requests,
    shard_state,
    status_of,
    syncer_processes,
)

from atoll.server import storage
from atoll.server.log_records import LOG_PUSH, log_record
from atoll.server.rules import MAX_SEQ_JUMP
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb

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
    msgs = push_requests(
        PLAN,
        0,
        header.pop("learner", "l0"),
        header.pop("seq", 1),
        0,
        frame,
        SIZE0,
        codec_id=codec_id,
        **header,
    )
    return stub.Push(iter(msgs), timeout=10)


HUGE = np.full(SIZE0, 3e38, np.float32)
POISON = {
    "int4 frame at the largest scale": lambda stub: _raw_push(
        stub, codec.encode(HUGE, codec.Codec.INT4), pb.CODEC_INT4
    ),
    "fp32 frame of 3e38": lambda stub: _raw_push(
        stub, codec.encode(HUGE, codec.Codec.FP32), pb.CODEC_FP32
    ),
    "fp32 frame beyond 1e9": lambda stub: _raw_push(
        stub, codec.encode(np.full(SIZE0, 2e9, np.float32), codec.Codec.FP32), pb.CODEC_FP32
    ),
    "tokens 2^64-1 in one step": lambda stub: push(
        stub, PLAN, 0, "l0", 1, 0, np.ones(SIZE0), tokens=U64, inner_steps=1
    ),
    "step_seconds 1e308": lambda stub: push(
        stub, PLAN, 0, "l0", 1, 0, np.ones(SIZE0), step_seconds=1e308, overlap_steps=2
    ),
    "step_seconds inf": lambda stub: push(
        stub, PLAN, 0, "l0", 1, 0, np.ones(SIZE0), step_seconds=math.inf
    ),
    "overlap 2^32-1": lambda stub: push(
        stub, PLAN, 0, "l0", 1, 0, np.ones(SIZE0), overlap_steps=(1 << 32) - 1
    ),
    "seq 2^64-1": lambda stub: push(stub, PLAN, 0, "l0", U64, 0, np.ones(SIZE0)),
    "seq far ahead": lambda stub: push(stub, PLAN, 0, "l0", MAX_SEQ_JUMP + 1, 0, np.ones(SIZE0)),
    "fewer tokens than steps": lambda stub: push(
        stub, PLAN, 0, "l0", 1, 0, np.ones(SIZE0), tokens=5, inner_steps=10
    ),
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
    assert (retry.accepted, retry.reason, retry.version) == (
        False,
        pb.PUSH_REASON_ALREADY_IN_ROUND,
        2,
    )
    header, _ = pull(stub, 0, learner="a")
    assert header.last_seq == 4


def test_a_log_record_that_cannot_be_applied_is_named_and_can_be_set_aside(tmp_path):
    """A record no check of this build would log (say, from an older build): recovery
    stops, says which record and what to do, serves nothing (NOT_SERVING, UNAVAILABLE)
    and does not exit into a restart loop; --quarantine-record sets it aside."""
    data = tmp_path / "data"
    with syncer_processes(tmp_path) as start:
        proc = start(data, "--quorum=2")
        channel, stub = connect(proc.port)
        for p in range(PLAN.num_fragments):
            init(stub, PLAN, p, np.zeros(PLAN.fragment_sizes[p], np.float32))
        assert push(stub, PLAN, 0, "good", 1, 0, np.full(SIZE0, 0.01, np.float32)).accepted
        channel.close()
        proc.kill()
        answer = {
            "seq": 1,
            "accepted": True,
            "reason": "fresh",
            "detail": "",
            "version": 0,
            "staleness": 0,
            "weight": 1.0,
        }
        wal = storage.WriteAheadLog(data / "wal")
        [bad] = wal.append_many(
            [
                log_record(
                    LOG_PUSH,
                    {"fragment": 0, "learner": "old-build", "answer": answer},
                    codec.encode(HUGE, codec.Codec.FP32),
                )
            ]
        )
        wal.close()

        stuck = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "atoll.cli",
                "syncer",
                "--data-dir",
                str(data),
                "--listen",
                "127.0.0.1:0",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            lines = []
            for line in stuck.stdout:
                lines.append(line)
                if m := re.search(r"did not recover and serves nothing \(port (\d+)\)", line):
                    break
                if (
                    "serving on port" in line
                ):  # recovered: the record was applied, which it must not be
                    break
            assert m, "".join(lines)
            assert f"--quarantine-record {bad}" in line and f"log record {bad}" in line
            channel, stub = connect(int(m.group(1)))
            assert health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                push(stub, PLAN, 0, "good", 2, 0, np.full(SIZE0, 0.01, np.float32))
            assert (
                e.value.code() == grpc.StatusCode.UNAVAILABLE
                and f"log record {bad}" in e.value.details()
            )
            assert stuck.poll() is None  # up and saying why, not exiting into a restart loop
            channel.close()
        finally:
            stuck.kill()
            stuck.wait()
            stuck.stdout.close()

        again = start(data, "--quorum=2", f"--quarantine-record={bad}")
        channel, stub = connect(again.port)
        state = shard_state(stub)
        assert state[0]["round_size"] == 1  # the good push is back; the bad one is set aside
        assert (data / "quarantine" / f"{bad}.record").exists()
        channel.close()
