"""Bounds the serving layer relies on: a frame's worst-case size, a lease table that
forgets departed learners."""

from __future__ import annotations

import ctypes
import gc
import os
import pathlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_shard_memory import PLAN, Clock, MemoryLog, MemorySnapshots, _seed_own

from atoll.server.config import ShardConfig
from atoll.server.shard import PRUNE_AFTER_LEASES, PushHeader, Shard
from atoll.wire import codec


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40_000),
    c=st.sampled_from(list(codec.Codec)),
    seed=st.integers(0, 2**32 - 1),
    level=st.sampled_from([None, 1, 19]),
)
def test_no_frame_outgrows_max_frame_bytes(n, c, seed, level):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-30, 30)).astype(np.float32)
    assert len(codec.encode(x, c, level=level)) <= codec.max_frame_bytes(n, c)
    # the worst case: a body zstd cannot shrink at all
    noise = rng.integers(0, 256, codec.body_bytes(c, n), dtype=np.uint8)
    assert len(codec._frame(c, n, noise, level)) <= codec.max_frame_bytes(n, c)


def test_a_learner_silent_for_ten_leases_is_forgotten(tmp_path):
    now = [1000.0]
    shard = Shard(
        ShardConfig(shard_index=0, num_shards=1, data_dir=tmp_path, lease_seconds=2.0),
        clock=lambda: now[0],
    )
    shard.recover()
    shard.touch("gone")
    shard.touch("here")
    now[0] += PRUNE_AFTER_LEASES * 2.0 - 0.5
    shard.touch("here")
    shard.tick()
    assert set(shard.last_seen) == {"gone", "here"}  # lapsed, but not yet forgotten
    now[0] += 1.0
    shard.tick()
    assert set(shard.last_seen) == {"here"}
    shard.close()


LEARNERS = int(os.environ.get("ATOLL_DEPARTED_LEARNERS", "300"))


def _wave(shard, log, clock, first: int, n: int) -> None:
    """n learners each push fragment 0 once and then again in the same round (a refusal
    the shard keeps), then leave; their leases lapse and the shard prunes them. The log
    is truncated after (as a snapshot would): what stays in memory is the shard's."""
    size = PLAN.fragment_sizes[0]
    frame = codec.encode(np.full(size, 0.01, np.float32), codec.Codec.INT4)
    for m in range(first, first + n):
        for seq in (1, 2):
            h = PushHeader(
                learner_id=f"learner-{m}",
                fragment=0,
                base_version=shard.fragments[0].version,
                seq=seq,
                inner_steps=4,
                tokens=400,
                codec=int(codec.Codec.INT4),
                num_params=size,
                plan_fingerprint=PLAN.fingerprint,
                period_steps=8,
                last=m % 2 == 0,
            )
            shard.push(h, frame)
    clock.now += (PRUNE_AFTER_LEASES + 1) * shard.policy.lease_seconds
    shard.tick()
    log.truncate_through(log.written_lsn)


def _settled_rss() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_departed_learners_leave_only_their_acknowledged_answers():
    """Per-learner tables (leases, timings, refusals, last-push marks, the joined set past
    a quorum) are emptied once leases lapse; what stays is each fragment's durable answer
    to a learner's newest accepted push, and RSS after a second wave of learners grows by
    about that much. (LEARNERS keeps it fast: each push scans every lease, so a wave costs
    O(n^2); ATOLL_DEPARTED_LEARNERS=1000 measures the issue's 1,000.)"""
    clock, log = Clock(), MemoryLog()
    cfg = ShardConfig(
        shard_index=0, num_shards=2, data_dir=pathlib.Path("/nonexistent"), quorum=10_000
    )
    shard = Shard(cfg, clock, log=log, snapshots=MemorySnapshots())  # no round closes
    shard.recover()
    _seed_own(shard)
    _wave(shard, log, clock, 0, LEARNERS)
    before = _settled_rss()
    _wave(shard, log, clock, LEARNERS, LEARNERS)
    grown = _settled_rss() - before
    assert shard.last_seen == {} and shard.timings == {} and len(shard.known) <= 10_000
    assert all(not f.refusals for f in shard.fragments.values())
    assert all(not learners for learners in shard.finished.values())
    assert len(shard.fragments[0].answers) == 2 * LEARNERS  # durable: a late retry is answered once
    print(f"RSS grew {grown / 1e3:.0f} kB over {LEARNERS} departed learners (their answers stay)")
    assert grown < 2 << 20
