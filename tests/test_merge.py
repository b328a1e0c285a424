"""Tests for server/merge.py: RDA vs plain averaging, weights, determinism, outer step."""

import gc
import threading

import jax
import numpy as np
import optax
import pytest

from atoll.server.merge import (
    STEP_CHUNK,
    AccumulatorPool,
    AccumulatorSnapshot,
    RoundAccumulator,
    Segments,
    add_scaled,
    delayed_nesterov,
    outer_optimizer,
    outer_step,
    segment_norms,
)
from atoll.wire import codec
from atoll.wire.plan import FragmentPlan, TensorSpec


def rand_deltas(rng, m, n, scale=1.0):
    return [(scale * rng.standard_normal(n)).astype(np.float32) for _ in range(m)]


def merged(seg, deltas, weights=None, rda=True):
    acc = RoundAccumulator(seg, rda=rda)
    for d, w in zip(deltas, weights or [1.0] * len(deltas)):
        acc.add(d, w)
    return acc.result()


def weighted_avg(deltas, weights):
    return np.average(np.stack(deltas).astype(np.float64), axis=0, weights=weights)


# -- segments ---------------------------------------------------------------------


def test_segments_from_plan_follow_layout_and_embedding_flags():
    specs = [
        TensorSpec("embed/table", (50, 4)),
        TensorSpec("blocks/0/w", (4, 4)),
        TensorSpec("blocks/0/b", (4,)),
        TensorSpec("head/w", (4, 3)),
    ]
    plan = FragmentPlan.build(specs, 2)
    for p in range(2):
        seg, slots = Segments.from_plan(plan, p), plan.tensors_of(p)
        assert seg.size == plan.fragment_sizes[p] and len(seg) == len(slots)
        assert seg.offsets.tolist() == [s.offset for s in slots]
        assert seg.ends.tolist() == [s.end for s in slots]
        assert seg.embedding.tolist() == [s.spec.embedding for s in slots]


@pytest.mark.parametrize("offsets,ends", [([1], [3]), ([0, 2], [2, 5][::-1]), ([0, 3], [2, 5])])
def test_segments_refuse_gaps_and_overlaps(offsets, ends):
    with pytest.raises(ValueError, match="tile"):
        Segments(offsets, ends, [False] * len(offsets))


# -- RDA ----------------------------------------------------------------------------


def test_rda_keeps_norm_as_m_grows_where_plain_average_shrinks():
    rng, n = np.random.default_rng(0), 20_000  # random deltas in 20k dims: ~orthogonal
    seg = Segments.from_sizes([n])
    for m in (1, 4, 16, 64):
        deltas = rand_deltas(rng, m, n)
        mean_norm = np.mean([np.linalg.norm(d) for d in deltas])
        rda = np.linalg.norm(merged(seg, deltas))
        plain = np.linalg.norm(merged(seg, deltas, rda=False))
        assert rda == pytest.approx(mean_norm, rel=1e-5)
        assert plain == pytest.approx(mean_norm / np.sqrt(m), rel=0.05)
        if m > 1:
            assert rda > 0.9 * np.sqrt(m) * plain


def test_rda_direction_is_the_weighted_sum_of_unit_directions():
    seg = Segments.from_sizes([3])
    out = merged(seg, [np.array([3, 4, 0], np.float32), np.array([0, 0, 10], np.float32)])
    direction = np.array([0.6, 0.8, 1.0]) / np.sqrt(2)
    np.testing.assert_allclose(out, 7.5 * direction, rtol=1e-6)


def test_rda_of_identical_deltas_is_that_delta():
    rng = np.random.default_rng(1)
    seg = Segments.from_sizes([100, 7, 1000])
    d = rand_deltas(rng, 1, seg.size, scale=0.01)[0]
    np.testing.assert_allclose(
        merged(seg, [d] * 5, [1.0, 2.0, 0.5, 3.0, 1.0]), d, rtol=1e-5, atol=1e-9
    )


def test_single_contribution_returns_it():
    rng = np.random.default_rng(2)
    seg = Segments.from_sizes([64, 32, 5], embedding=[False, True, False])
    d = rand_deltas(rng, 1, seg.size)[0]
    np.testing.assert_allclose(merged(seg, [d], [42.0]), d, rtol=1e-5, atol=1e-7)


def test_embeddings_get_the_plain_weighted_average():
    rng = np.random.default_rng(3)
    seg = Segments.from_sizes([500, 300, 200], embedding=[True, False, True])
    deltas, weights = rand_deltas(rng, 6, seg.size), [1.0, 2.0, 0.5, 4.0, 1.5, 3.0]
    out, ref = merged(seg, deltas, weights), weighted_avg(deltas, weights)
    emb = np.r_[0:500, 800:1000]
    np.testing.assert_allclose(out[emb], ref[emb], rtol=1e-5, atol=1e-6)
    # The RDA tensor keeps its mean norm; the plain average would be much shorter.
    rda_norm = np.linalg.norm(out[500:800])
    assert rda_norm > 1.5 * np.linalg.norm(ref[500:800])


def test_rda_false_is_the_weighted_average_everywhere():
    rng = np.random.default_rng(4)
    seg = Segments.from_sizes([400, 100, 250], embedding=[False, True, False])
    deltas, weights = rand_deltas(rng, 5, seg.size), [1.0, 3.0, 2.0, 0.25, 7.0]
    np.testing.assert_allclose(
        merged(seg, deltas, weights, rda=False), weighted_avg(deltas, weights), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("rda", [True, False])
def test_weight_pulls_the_result_toward_the_heavier_learner(rda):
    seg = Segments.from_sizes([2])
    a, b = np.array([1, 0], np.float32), np.array([0, 1], np.float32)
    even, heavy_a = merged(seg, [a, b], [1.0, 1.0], rda), merged(seg, [a, b], [3.0, 1.0], rda)
    np.testing.assert_allclose(even[0], even[1], rtol=1e-6)
    assert heavy_a[0] == pytest.approx(3 * heavy_a[1], rel=1e-6)


def test_rda_norm_is_the_weighted_mean_norm():
    seg = Segments.from_sizes([2])
    out = merged(seg, [np.array([2, 0], np.float32), np.array([0, 6], np.float32)], [3.0, 1.0])
    assert np.linalg.norm(out) == pytest.approx((3 * 2 + 1 * 6) / 4, rel=1e-6)


def test_zero_norm_tensor_adds_weight_but_no_direction():
    seg = Segments.from_sizes([2, 3])
    d = np.array([4, 0, 1, 2, 2], np.float32)
    z = np.array([0, 0, 1, 2, 2], np.float32)  # first tensor zero
    out = merged(seg, [d, z], [1.0, 1.0])
    np.testing.assert_allclose(out[:2], [2, 0], rtol=1e-6)  # norm (4+0)/2, direction of d
    np.testing.assert_allclose(out[2:], [1, 2, 2], rtol=1e-6)


def test_all_zero_or_cancelling_directions_give_zeros():
    seg = Segments.from_sizes([3])
    zero = np.zeros(3, np.float32)
    assert not np.any(merged(seg, [zero, zero]))
    d = np.array([1, 2, 3], np.float32)
    out = merged(seg, [d, -d])
    assert np.all(np.isfinite(out)) and not np.any(out)


def test_bad_input_is_refused_and_changes_nothing():
    seg = Segments.from_sizes([3, 2])
    acc = RoundAccumulator(seg)
    acc.add(np.ones(5, np.float32), 2.0)
    before = acc.state()
    for delta, w in [
        (np.ones(4, np.float32), 1.0),
        (np.ones(5, np.float64), 1.0),
        (np.ones(5, np.float32), 0.0),
        (np.ones(5, np.float32), float("nan")),
        (np.array([1, np.nan, 1, 1, 1], np.float32), 1.0),
        (np.array([1, 1, 1, 1, np.inf], np.float32), 1.0),
    ]:
        with pytest.raises(ValueError):
            acc.add(delta, w)
    after = acc.state()
    assert acc.count == 1 and acc.total_weight == 2.0
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="empty round"):
        RoundAccumulator(seg).result()


def test_reset_empties_the_round():
    rng = np.random.default_rng(5)
    seg = Segments.from_sizes([10, 10])
    a, b = rand_deltas(rng, 2, 20)
    acc = RoundAccumulator(seg)
    acc.add(a, 5.0)
    acc.reset()
    assert acc.count == 0 and acc.total_weight == 0.0
    acc.add(b, 1.0)
    np.testing.assert_array_equal(acc.result(), merged(seg, [b]))


# -- determinism ---------------------------------------------------------------------


def _round(seg, deltas, weights, snapshot_at=None):
    acc = RoundAccumulator(seg)
    for i, (d, w) in enumerate(zip(deltas, weights)):
        if i == snapshot_at:  # through plain arrays and back, as a shard snapshot would
            acc = RoundAccumulator.from_state(
                AccumulatorSnapshot(
                    *[np.array(x) if isinstance(x, np.ndarray) else x for x in acc.state()]
                ),
                seg,
            )
        acc.add(d.copy(), w)
    return acc.result()


def test_same_adds_give_bit_identical_results_across_snapshot_resume():
    rng = np.random.default_rng(6)
    seg = Segments.from_sizes([70_000, 3, 150_001, 999], embedding=[False, False, True, False])
    deltas, weights = rand_deltas(rng, 7, seg.size), list(rng.uniform(0.1, 10, 7))
    first = _round(seg, deltas, weights)
    assert first.tobytes() == _round(seg, deltas, weights).tobytes()
    assert first.tobytes() == _round(seg, deltas, weights, snapshot_at=3).tobytes()


def test_from_state_refuses_another_layout():
    acc = RoundAccumulator(Segments.from_sizes([3, 2]))
    acc.add(np.ones(5, np.float32), 1.0)
    with pytest.raises(ValueError, match="different fragment layout"):
        RoundAccumulator.from_state(acc.state(), Segments.from_sizes([2, 3]))
    resumed = RoundAccumulator.from_state(acc.state())
    assert resumed.count == 1 and resumed.rda


def test_a_round_holds_its_accumulator_only_while_open():
    seg = Segments.from_sizes([3, 2])
    acc = RoundAccumulator(seg)
    assert acc.state().acc.size == 0  # no push in: nothing held, nothing saved
    acc.add(np.ones(5, np.float32), 1.0)
    assert acc.state().acc.shape == (5,)
    acc.reset()
    assert acc.state().acc.size == 0
    # an empty round saved either way (the old layout kept a zero vector) resumes empty,
    # and takes pushes as a fresh one does
    for saved in (acc.state(), acc.state()._replace(acc=np.zeros(5, np.float32))):
        resumed = RoundAccumulator.from_state(saved, seg)
        resumed.add(np.arange(5, dtype=np.float32), 2.0)
        fresh = RoundAccumulator(seg)
        fresh.add(np.arange(5, dtype=np.float32), 2.0)
        assert resumed.result().tobytes() == fresh.result().tobytes()
    with pytest.raises(ValueError, match="do not fit"):  # a push in, but no accumulator
        RoundAccumulator.from_state(acc.state()._replace(count=1, total_weight=1.0), seg)


def test_take_is_result_in_the_accumulators_buffer_and_empties_the_round():
    rng = np.random.default_rng(14)
    seg = Segments.from_sizes([700, 3, 1500], embedding=[False, True, False])
    acc = RoundAccumulator(seg)
    for d, w in zip(rand_deltas(rng, 3, seg.size), (1.0, 2.5, 0.5)):
        acc.add(d, w)
    want = acc.result()
    got = acc.take()
    assert got.tobytes() == want.tobytes()
    assert acc.count == 0 and acc.total_weight == 0.0 and acc.state().acc.size == 0
    with pytest.raises(ValueError, match="empty round"):
        acc.take()


def _same_state(a: RoundAccumulator, b: RoundAccumulator) -> bool:
    return all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(a.state(), b.state())
    )


# Tensors that ignore 32-value blocks and the codec's chunks (2^18 values), embeddings among them.
WIDE = Segments.from_sizes(
    [70_000, 3, 300_001, 999, 160_000, 33], embedding=[False, False, True, False, False, True]
)


def _pushes(seg, seed=11):
    rng = np.random.default_rng(seed)
    scales = 10.0 ** rng.uniform(-4, 1, (4, len(seg)))
    deltas = [
        (rng.standard_normal(seg.size) * np.repeat(s, seg.ends - seg.offsets)).astype(np.float32)
        for s in scales
    ]
    codecs = [codec.Codec.INT4, codec.Codec.MXFP4, codec.Codec.FP32, codec.Codec.INT4]
    return [codec.encode(d, c) for d, c in zip(deltas, codecs)], [1.0, 3.5, 0.25, 2.0]


@pytest.mark.parametrize("rda", [True, False])
def test_add_frame_is_bit_identical_to_add_of_the_decoded_frame(rda):
    frames, weights = _pushes(WIDE)
    old = codec.get_threads()
    try:
        states = []
        for threads in (1, 2, 3):
            codec.set_threads(threads)
            from_frames, from_values = (
                RoundAccumulator(WIDE, rda=rda),
                RoundAccumulator(WIDE, rda=rda),
            )
            for f, w in zip(frames, weights):
                from_frames.add_frame(f, w, codec.frame_info(f).codec)
                from_values.add(codec.decode(f), w)
                assert _same_state(from_frames, from_values)
            assert from_frames.result().tobytes() == from_values.result().tobytes()
            states.append(from_frames)
        assert _same_state(states[0], states[1]) and _same_state(
            states[0], states[2]
        )  # any thread count
    finally:
        codec.set_threads(old)


def test_add_frame_takes_checked_codes():
    frames, weights = _pushes(WIDE, seed=12)
    a, b = RoundAccumulator(WIDE), RoundAccumulator(WIDE)
    for f, w in zip(frames, weights):
        a.add_frame(f, w)
        b.add_frame(codec.read_codes(f), w)
    assert _same_state(a, b)


def test_add_adds_what_add_scaled_states():
    """The kernel's accumulation is numpy's multiply-then-add, bit for bit."""
    rng = np.random.default_rng(13)
    d = rand_deltas(rng, 1, WIDE.size)[0]
    acc = RoundAccumulator(WIDE, rda=False)
    acc.add(d, 2.5)
    want = np.zeros(WIDE.size, np.float32)
    add_scaled(want, d, WIDE, np.full(len(WIDE), 2.5))
    assert acc.state().acc.tobytes() == want.tobytes()
    acc = RoundAccumulator(WIDE)
    acc.add(d, 2.5)
    want = np.zeros(WIDE.size, np.float32)
    norms = segment_norms(d, WIDE)
    add_scaled(want, d, WIDE, np.where(WIDE.embedding, 2.5, 2.5 / norms))
    assert acc.state().acc.tobytes() == want.tobytes()


def test_add_frame_refuses_bad_frames_and_changes_nothing():
    seg = Segments.from_sizes([40, 300], embedding=[True, False])
    acc = RoundAccumulator(seg)
    acc.add_frame(codec.encode(np.ones(340, np.float32)), 1.0)
    before = acc.state()
    huge = np.ones(340, np.float32)
    huge[5] = 3e38  # an embedding: 2 · 3e38 overflows float32
    good = codec.encode(np.ones(340, np.float32))
    for frame, w, c, match in [
        (codec.encode(np.ones(341, np.float32)), 1.0, None, "341 values; expected 340"),
        (good, 1.0, codec.Codec.MXFP4, "expected MXFP4"),
        (good[:-3], 1.0, None, "truncated|corrupt"),
        (good, 0.0, None, "weight"),
        (good, float("inf"), None, "weight"),
        (codec.encode(huge), 2.0, None, "overflow"),
    ]:
        with pytest.raises(ValueError, match=match):
            acc.add_frame(frame, w, c)
    with pytest.raises(ValueError, match="overflow"):
        acc.add(codec.decode(codec.encode(huge)), 2.0)  # add() refuses the same push
    assert acc.count == 1 and _same_state(acc, RoundAccumulator.from_state(before))
    acc.add_frame(codec.encode(huge), 1.0)  # the same values at weight 1 fit
    huge[5], huge[45] = 1.0, 3e38  # RDA tensors are normalised first: huge values are fine there
    acc.add_frame(codec.encode(huge), 1.0)
    assert np.isfinite(acc.result()).all()


def test_tiny_tensors_add_weight_but_no_direction():
    """A tensor so small that w/‖Δ‖ is beyond float32 counts as a zero tensor; add and add_frame agree."""
    seg = Segments.from_sizes([4, 3])
    d = np.array([1e-44, 0, 0, 0, 1, 2, 2], np.float32)
    a, b = RoundAccumulator(seg), RoundAccumulator(seg)
    a.add(d, 1.0)
    b.add_frame(codec.encode(d, codec.Codec.FP32), 1.0)
    assert _same_state(a, b)
    assert not a.state().acc[:4].any() and a.state().norm_sum[0] > 0
    np.testing.assert_allclose(a.result()[4:], [1, 2, 2], rtol=1e-6)


def test_segment_norms_match_numpy():
    rng = np.random.default_rng(7)
    seg = Segments.from_sizes([1, 200_000, 17])
    v = rand_deltas(rng, 1, seg.size)[0]
    ref = [np.linalg.norm(v[o:e].astype(np.float64)) for o, e in zip(seg.offsets, seg.ends)]
    np.testing.assert_allclose(segment_norms(v, seg), ref, rtol=1e-6)


# -- outer step ----------------------------------------------------------------------


def test_zero_momentum_step_moves_against_the_outer_gradient():
    rng = np.random.default_rng(8)
    theta, learner = rand_deltas(rng, 2, 1000)
    delta = theta - learner  # Θ_base − θ_learner
    opt = outer_optimizer(lr=0.7, momentum=0.0)
    new, _ = outer_step(theta, opt.init(theta), delta, opt)
    assert new.dtype == np.float32 and isinstance(new, np.ndarray)
    np.testing.assert_allclose(new, theta - 0.7 * delta, rtol=1e-6, atol=1e-6)
    opt1 = outer_optimizer(lr=1.0, momentum=0.0)  # lr 1, one learner: adopt its params
    np.testing.assert_allclose(
        outer_step(theta, opt1.init(theta), delta, opt1)[0], learner, rtol=1e-6, atol=1e-6
    )


def test_nesterov_matches_a_hand_written_reference():
    rng = np.random.default_rng(9)
    lr, mu, n = 0.7, 0.9, 257
    theta = rng.standard_normal(n).astype(np.float32)
    opt = outer_optimizer(lr, mu, delay=1)
    state, ref, trace = opt.init(theta), theta.astype(np.float64), np.zeros(n)
    for _ in range(6):
        g = (0.1 * rng.standard_normal(n)).astype(np.float32)
        theta, state = outer_step(theta, state, g, opt)
        trace = g + mu * trace  # m ← Δ + μm;  Θ ← Θ − lr(Δ + μm)
        ref = ref - lr * (g + mu * trace)
        np.testing.assert_allclose(theta, ref, rtol=1e-5, atol=1e-5)


def test_delayed_nesterov_with_delay_one_is_optax_nesterov_bit_for_bit():
    rng = np.random.default_rng(11)
    theta = rng.standard_normal(513).astype(np.float32)
    plain, delayed = optax.sgd(0.7, momentum=0.9, nesterov=True), delayed_nesterov(0.7, 0.9, 1)
    a, sa, b, sb = theta, plain.init(theta), theta, delayed.init(theta)
    for _ in range(5):
        g = (0.1 * rng.standard_normal(theta.size)).astype(np.float32)
        a, sa = outer_step(a, sa, g, plain)
        b, sb = outer_step(b, sb, g, delayed)
        assert np.array_equal(a, b)


@pytest.mark.parametrize(
    "lr,mu,delay", [(0.7, 0.9, 1), (0.7, 0.9, 2), (0.7, 0.9, 3), (1.0, 0.0, 1)]
)
def test_the_kernel_step_is_the_xla_program_bit_for_bit(lr, mu, delay):
    # the shard steps with the C kernel; optax's Nesterov (delay 1) and delayed_nesterov
    # run by XLA are the definition, over more values than one kernel call takes
    rng = np.random.default_rng(13 + delay)
    theta = (0.02 * rng.standard_normal(STEP_CHUNK + STEP_CHUNK // 2 + 7)).astype(np.float32)
    opt = outer_optimizer(lr, mu, delay)
    a, sa, b, sb = theta, opt.init(theta), theta, opt.reference.init(theta)
    for _ in range(2 * delay + 3):
        g = (1e-3 * rng.standard_normal(theta.size)).astype(np.float32)
        a, sa = outer_step(a, sa, g, opt)
        b, sb = outer_step(b, sb, g, opt.reference)
        assert a.tobytes() == np.asarray(b).tobytes()
        for x, y in zip(jax.tree_util.tree_leaves(sa), jax.tree_util.tree_leaves(sb)):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_delayed_nesterov_matches_a_hand_written_reference():
    # plain steps every round; every N-th round m <- mu*m + mean of the N rounds' gradients,
    # and that round's step gains mu*m
    rng = np.random.default_rng(12)
    lr, mu, n, delay = 0.7, 0.9, 257, 3
    theta = rng.standard_normal(n).astype(np.float32)
    opt = outer_optimizer(lr, mu, delay)
    state, ref, m, buffered = opt.init(theta), theta.astype(np.float64), np.zeros(n), []
    for r in range(1, 11):
        g = (0.1 * rng.standard_normal(n)).astype(np.float32)
        theta, state = outer_step(theta, state, g, opt)
        buffered.append(g.astype(np.float64))
        step = g.astype(np.float64)
        if r % delay == 0:
            m = mu * m + np.mean(buffered, axis=0)
            buffered = []
            step = step + mu * m
        ref = ref - lr * step
        np.testing.assert_allclose(theta, ref, rtol=1e-5, atol=1e-5)
        assert int(state.rounds) == r % delay


def test_outer_optimizer_refuses_a_delay_below_one():
    with pytest.raises(ValueError, match="delay"):
        outer_optimizer(0.7, 0.9, 0)


def test_outer_step_is_pure_and_bit_deterministic():
    rng = np.random.default_rng(10)
    theta, g1, g2 = rand_deltas(rng, 3, 4096)
    opt = outer_optimizer()

    def run():
        p, s = theta, opt.init(theta)
        for g in (g1, g2, g1):
            p, s = outer_step(p, s, g, opt)
        return p

    keep = theta.copy()
    assert run().tobytes() == run().tobytes()
    assert theta.tobytes() == keep.tobytes()  # inputs untouched


def test_outer_step_validates():
    opt = outer_optimizer()
    theta = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="equal 1-D"):
        outer_step(theta, opt.init(theta), np.zeros(5, np.float32), opt)
    with pytest.raises(ValueError):
        outer_optimizer(lr=0.0)
    with pytest.raises(ValueError):
        outer_optimizer(momentum=1.0)


def test_rounds_reuse_the_accumulator_and_give_the_same_bits():
    rng = np.random.default_rng(3)
    seg = Segments.from_sizes([300, 200, 500], embedding=[False, True, False])
    deltas = rand_deltas(rng, 3, seg.size)
    want = merged(seg, deltas)
    acc = RoundAccumulator(seg)
    for _ in range(3):  # each round's buffer is free once its merged result is dropped
        for d in deltas:
            acc.add(d, 1.0)
        assert acc.take().tobytes() == want.tobytes()


# -- the accumulator pool -------------------------------------------------------------


def test_pooled_rounds_write_over_old_buffers_and_give_the_bits_of_fresh_ones():
    """A round whose accumulator was another fragment's (bigger, holding its old sums)
    merges to the bits a fresh buffer gives: the first push writes every value."""
    rng = np.random.default_rng(5)
    small = Segments.from_sizes([300, 200, 500], embedding=[False, True, False])
    big = Segments.from_sizes([1000, 37, 40], embedding=[True, False, False])
    pool = AccumulatorPool()
    a, b = RoundAccumulator(big, pool=pool), RoundAccumulator(small, pool=pool)
    for _ in range(3):
        big_d, small_d = rand_deltas(rng, 3, big.size), rand_deltas(rng, 3, small.size)
        for d in big_d:
            a.add(d, 1.5)
        for d in small_d[:2]:
            b.add(d, 1.0)
        out = a.take()
        assert out.tobytes() == merged(big, big_d, [1.5] * 3).tobytes()
        pool.give(out)  # b's round is still open: the buffer is kept
        assert pool.kept == 1
        c = RoundAccumulator(small, pool=pool)
        c.add(small_d[2], 2.0)  # a round opened now writes into the kept buffer
        assert pool.kept == 0
        assert c.take().tobytes() == merged(small, small_d[2:], [2.0]).tobytes()
        b.add(small_d[2], 1.0)
        assert b.take().tobytes() == merged(small, small_d).tobytes()


def test_the_pool_keeps_buffers_only_while_a_round_that_took_one_is_open():
    pool = AccumulatorPool()
    x, y, z = pool.take(10), pool.take(10), pool.take(6)
    pool.give(x)
    pool.give(y)
    assert pool.kept == 2
    pool.keep(z)  # z stays with its taker: no round is out, so nothing is kept
    assert pool.kept == 0
    # a round dropped without settling its buffer (an abandoned fragment) counts as closed
    u, v = pool.take(10), pool.take(10)
    pool.give(u)
    assert pool.kept == 1
    del v
    gc.collect()
    assert pool.kept == 0
    with pytest.raises(AssertionError, match="did not lend"):
        pool.give(np.empty(3, np.float32))


def test_a_buffer_collected_while_the_pool_is_locked_does_not_stop_it():
    """The collector can free a dropped round's buffer at any allocation, the pool's own
    locked ones included: its callback must not wait for the lock."""
    pool = AccumulatorPool()
    u, w = pool.take(4), pool.take(4)

    def drop_under_the_lock():
        nonlocal u
        with pool._lock:
            del u  # the callback runs here, while this thread holds the lock

    t = threading.Thread(target=drop_under_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the pool deadlocked on its own lock"
    pool.give(w)  # the dropped one counts as settled: nothing is out, nothing kept
    assert pool.kept == 0


def test_the_pool_never_holds_more_buffers_than_were_out_at_once():
    """A take no kept buffer fits makes a new one in place of a kept one: buffers in use
    plus kept never exceed the most that were in use together."""
    pool = AccumulatorPool()
    held = [pool.take(n) for n in (4, 8)]
    pool.give(held.pop(0))  # kept: one of 4 values; out: one of 8
    bigger = pool.take(16)  # the 4 cannot serve: dropped, a 16 made
    assert pool.kept == 0 and bigger.size == 16 and bigger.base.size == 16
    pool.give(bigger)
    small = pool.take(3)
    assert small.base is bigger.base  # the smallest kept buffer that fits is reused
    assert small.shape == (3,) and small.dtype == np.float32
    # several kept, none big enough: the largest goes (picked by identity, never by value)
    out = [pool.take(n) for n in (5, 6, 7)]
    pool.give(out[0])
    pool.give(out[1])
    kept = pool.kept
    assert pool.take(40).size == 40 and pool.kept == kept - 1


def test_segment_norms_of_a_vector_known_finite_skip_only_the_check():
    v = np.random.default_rng(4).standard_normal(1000).astype(np.float32)
    seg = Segments.from_sizes([100, 900])
    assert segment_norms(v, seg, finite=True).tobytes() == segment_norms(v, seg).tobytes()
    v[5] = np.inf
    with pytest.raises(codec.CodecError):
        segment_norms(v, seg)
