"""Pushes in batches: `Shard.push_many` answers each push as `push` would, after one fsync
for the batch, and `PushBatches` groups the small pushes that arrive while a batch runs
(server/push_batch.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import types

import numpy as np
import pytest

from atoll.server import push_batch, storage
from atoll.server.config import ShardConfig
from atoll.server.fragment import Answer
from atoll.server.push_batch import PushBatches
from atoll.server.refusal import Why
from atoll.server.shard import PushHeader, Shard, ShardError
from atoll.wire import codec
from atoll.wire.plan import FragmentPlan, TensorSpec

PLAN = FragmentPlan.build([TensorSpec("w", (64, 16)), TensorSpec("b", (16,))], 2)


@pytest.fixture
def shard(tmp_path):
    s = Shard(
        ShardConfig(shard_index=0, num_shards=1, data_dir=tmp_path, quorum=3, snapshot_every=1000)
    )
    s.recover()
    for p, size in enumerate(PLAN.fragment_sizes):
        values = np.random.default_rng(p).standard_normal(size).astype(np.float32)
        frame = codec.encode(values, codec.Codec.FP32)
        s.init("seed", p, PLAN.fingerprint, PLAN.to_json(), frame, int(codec.Codec.FP32), size)
    yield s
    s.close()


def push(learner: str, seq: int, p: int = 0, size: int | None = None):
    n = PLAN.fragment_sizes[p]
    delta = np.random.default_rng([p, seq, len(learner)]).standard_normal(n).astype(np.float32)
    h = PushHeader(
        learner_id=learner,
        fragment=p,
        base_version=0,
        seq=seq,
        inner_steps=4,
        tokens=100,
        codec=int(codec.Codec.INT4),
        num_params=n if size is None else size,
        plan_fingerprint=PLAN.fingerprint,
    )
    return h, [codec.encode(delta * 0.01, codec.Codec.INT4)]


def fsyncs_counted(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = storage._datasync

    def counted(fd):
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(storage, "_datasync", counted)
    return calls


def test_each_push_of_a_batch_gets_its_own_answer_after_one_fsync(shard, monkeypatch):
    fsyncs = fsyncs_counted(monkeypatch)
    first = push("a", 1)
    out = shard.push_many([first, first, push("b", 1, size=7), push("c", 1, p=1)])
    assert len(fsyncs) == 1
    assert shard.wal.last_lsn == shard.wal.written_lsn  # every record answered is durable
    accepted, retried, malformed, other = out
    assert isinstance(accepted, Answer) and accepted.accepted and accepted.seq == 1
    assert isinstance(retried, Answer) and retried.reason == "duplicate"
    assert isinstance(malformed, ShardError) and malformed.why is Why.MALFORMED
    assert isinstance(other, Answer) and other.accepted
    # what the batch merged is what single pushes merge: b's malformed push took nothing
    assert shard.push(*push("b", 2)).accepted


def test_a_failed_fsync_refuses_every_push_it_covered_and_no_other(shard, monkeypatch):
    def broken(fd):
        raise OSError(5, "EIO")

    monkeypatch.setattr(storage, "_datasync", broken)
    out = shard.push_many([push("a", 1), push("b", 1, size=7), push("c", 1, p=1)])
    assert [o.why for o in out if isinstance(o, ShardError)] == [Why.BUSY, Why.MALFORMED, Why.BUSY]


def header(seq: int) -> PushHeader:
    return PushHeader("a", 0, 0, seq, 1, 1, int(codec.Codec.INT4), 10, PLAN.fingerprint)


class Recording:
    """A shard whose push_many records each batch and, for the first, waits to be let go."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.release = threading.Event()
        self.timed: list[float] = []  # push_seconds, one per push
        self.metrics = types.SimpleNamespace(
            push_seconds=types.SimpleNamespace(observe=self.timed.append)
        )

    def push_many(self, pushes):
        self.batches.append([h.seq for h, _ in pushes])
        if len(self.batches) == 1:
            assert self.release.wait(10)
        return [
            ShardError(Why.MALFORMED, "odd")
            if h.seq % 2
            else Answer(h.seq, True, "fresh", "", 0, 0, 1.0)
            for h, _ in pushes
        ]


def test_small_pushes_that_come_while_a_batch_runs_go_together_and_big_ones_alone():
    recording = Recording()

    async def run():
        with concurrent.futures.ThreadPoolExecutor(4) as workers:
            batches = PushBatches(recording, workers)  # type: ignore[arg-type]
            small = [b"x" * 10]
            big = [b"x" * push_batch.ALONE_BYTES]
            first = asyncio.ensure_future(batches.push(header(2), small))
            await asyncio.sleep(0.05)  # the first batch is running
            waiting = [asyncio.ensure_future(batches.push(header(s), small)) for s in (3, 4, 5)]
            alone = asyncio.ensure_future(batches.push(header(6), big))
            assert (await alone).seq == 6  # not held behind the running batch
            recording.release.set()
            results = await asyncio.gather(first, *waiting, return_exceptions=True)
        return results

    results = asyncio.run(run())
    assert recording.batches == [[2], [6], [3, 4, 5]] and len(recording.timed) == 5
    assert [r.seq if isinstance(r, Answer) else r.why for r in results] == [
        2,
        Why.MALFORMED,
        4,
        Why.MALFORMED,
    ]
