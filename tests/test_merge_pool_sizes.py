"""The accumulator pool lends a kept buffer to a fragment a little larger than the one
that gave it back (a plan's fragments differ by a few rows), instead of a fresh one."""

from __future__ import annotations

import numpy as np

from atoll.server.merge import POOL_GRANULE, AccumulatorPool, RoundAccumulator, Segments


def test_a_fragment_a_few_values_larger_takes_a_kept_buffer():
    pool = AccumulatorPool()
    open_round = pool.take(10)  # a round still open: what is given back is kept
    size = 3 * POOL_GRANULE - 768
    a = pool.take(size)
    pool.give(a)
    b = pool.take(size + 700)  # would not have fit a buffer made for `size` alone
    assert b.base is a.base and b.size == size + 700
    pool.give(b)
    c = pool.take(3 * POOL_GRANULE + 1)  # past the rounding: a new buffer
    assert c.base is not a.base and c.size == 3 * POOL_GRANULE + 1
    pool.give(c)
    pool.give(open_round)
    assert pool.kept == 0


def test_small_buffers_are_not_rounded_up():
    pool = AccumulatorPool()
    assert pool.take(10).base.size == 10


def test_a_round_in_a_larger_kept_buffer_gives_the_bits_of_a_fresh_one():
    rng = np.random.default_rng(7)
    seg = Segments.from_sizes([POOL_GRANULE - 5, 300], embedding=[False, True])
    deltas = [rng.standard_normal(seg.size).astype(np.float32) for _ in range(3)]

    def merged(pool: AccumulatorPool | None) -> bytes:
        acc = RoundAccumulator(seg, pool=pool)
        for d in deltas:
            acc.add(d, 1.0)
        return acc.result().tobytes()

    pool = AccumulatorPool()
    hold = pool.take(4)
    stale = pool.take(seg.size - 50)
    stale[:] = np.nan  # a kept buffer's old bits are written over, never read
    pool.give(stale)
    assert merged(pool) == merged(None)
    pool.give(hold)
