"""Bounds the serving layer relies on: a frame's worst-case size, a lease table that
forgets departed learners."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.server.config import ShardConfig
from atoll.server.shard import PRUNE_AFTER_LEASES, Shard
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
