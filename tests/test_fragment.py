"""Tests for server/fragment.py alone: one fragment's state machine (seed, rounds,
publishing, the delta ring, state()/restore(), determinism). No gRPC, no disk, no clock:
every `now` is passed in."""

from __future__ import annotations

import dataclasses
import io
import json

import jax
import numpy as np
import pytest

from atoll.server import merge, rules
from atoll.server.fragment import Answer, Fragment
from atoll.wire import codec
from atoll.wire.plan import FragmentPlan, TensorSpec

# fragment 0: head + w1 (RDA only); fragment 1: embed (plain average) + w2 (RDA)
SPECS = [
    TensorSpec("embed", (32, 8)),
    TensorSpec("w1", (12, 25)),
    TensorSpec("w2", (20, 10)),
    TensorSpec("head", (6, 10)),
]
P = 1  # the fragment under test: an embedding and an RDA tensor side by side


@pytest.fixture(scope="module")
def plan() -> FragmentPlan:
    plan = FragmentPlan.build(SPECS, 2)
    assert [s.spec.embedding for s in plan.tensors_of(P)] == [True, False]
    return plan


def _fragment(
    plan: FragmentPlan,
    *,
    lr: float = 0.7,
    momentum: float = 0.9,
    delay: int = 1,
    rda: bool = True,
    ring: int = 4,
    publish: codec.Codec = codec.Codec.INT4,
    quorum: int = 2,
    seed: int | None = 0,
    index: int = P,
) -> Fragment:
    frag = Fragment(
        index,
        plan,
        lr=lr,
        momentum=momentum,
        rda=rda,
        delta_ring=ring,
        publish_codec=publish,
        quorum=quorum,
        momentum_delay=delay,
    )
    if seed is not None:
        frag.initialize(_values(frag.size, seed))
    return frag


def _values(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


def _delta(size: int, *key: int, scale: float = 0.01) -> np.ndarray:
    return (np.random.default_rng(list(key)).standard_normal(size) * scale).astype(np.float32)


def _answer(
    seq: int, version: int, *, weight: float = 1.0, staleness: int = 0, discount: float = 1.0
) -> Answer:
    reason = rules.Reason.FRESH if staleness == 0 else rules.Reason.STALE_DISCOUNTED
    return Answer(seq, True, str(reason), "", version, staleness, weight * discount, discount)


def _push(
    frag: Fragment,
    learner: str,
    seq: int,
    delta: np.ndarray,
    now: float,
    *,
    weight: float = 1.0,
    staleness: int = 0,
    discount: float = 1.0,
    as_codes: bool = True,
) -> Answer:
    """What the shard does for an accepted push: the frame's checked codes (or a float32 vector)."""
    answer = _answer(seq, frag.version, weight=weight, staleness=staleness, discount=discount)
    if as_codes:
        frag.contribute(
            learner,
            codec.read_codes(codec.encode(delta, codec.Codec.INT4), num_values=frag.size),
            answer,
            now,
        )
    else:
        frag.contribute(learner, delta, answer, now)
    return answer


def _round(
    frag: Fragment, r: int, learners: tuple[str, ...] = ("a", "b", "c"), now: float = 0.0
) -> bytes:
    """One round: every learner pushes (the last one stale by one version from round 2 on)."""
    for i, m in enumerate(learners):
        stale = 1 if (i == len(learners) - 1 and frag.version > 0) else 0
        _push(
            frag,
            m,
            r + 1,
            _delta(frag.size, r, i),
            now + i,
            weight=1.0 + i,
            staleness=stale,
            discount=0.5 if stale else 1.0,
        )
    return frag.close_round(trigger=learners[-1])


def _everything(frag: Fragment) -> dict:
    """All of a fragment's state, as bytes where it is arrays."""
    meta, arrays = frag.state()
    return {
        "meta": json.loads(json.dumps(meta)),
        "arrays": {k: np.asarray(v).tobytes() for k, v in arrays.items()},
        "ring": list(frag.ring),
        "full_weight": frag.full_weight,
    }


def _saved(frag: Fragment) -> tuple[dict, dict[str, np.ndarray]]:
    """state() as a snapshot would keep it: meta through JSON, arrays through np.savez (in memory)."""
    meta, arrays = frag.state()
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    buf.seek(0)
    with np.load(buf) as z:
        loaded = {k: z[k] for k in z.files}
    return json.loads(json.dumps(meta)), loaded


# -- seeding ----------------------------------------------------------------------------


def test_initialize_seeds_version_zero_with_params_equal_to_published(plan):
    frag = _fragment(plan, seed=None)
    assert not frag.initialized and frag.params is None and frag.published is None
    values = _values(frag.size, 7)
    kept = values.copy()
    frag.initialize(values)
    assert frag.initialized and frag.version == 0
    assert frag.params.dtype == np.float32 and frag.params.tobytes() == kept.tobytes()
    assert frag.published.tobytes() == kept.tobytes()
    assert frag.params is not frag.published
    values[:] = 0  # the caller's buffer is not adopted
    assert frag.params.tobytes() == kept.tobytes() and frag.published.tobytes() == kept.tobytes()
    assert frag.deltas_since(0) == [] and not frag.ring and frag.contributors == frozenset()
    assert codec.decode(frag.snapshot_frame()).tobytes() == kept.tobytes()


def test_seeding_twice_is_refused_and_changes_nothing(plan):
    frag = _fragment(plan)
    before = frag.params.tobytes()
    with pytest.raises(AssertionError, match="seeded twice"):
        frag.initialize(_values(frag.size, 99))
    assert (
        frag.params.tobytes() == before and frag.published.tobytes() == before and frag.version == 0
    )


def test_initialize_refuses_the_wrong_size(plan):
    frag = _fragment(plan, seed=None)
    with pytest.raises(AssertionError):
        frag.initialize(np.zeros(frag.size + 1, np.float32))
    assert not frag.initialized


# -- one round --------------------------------------------------------------------------


def test_close_round_publishes_a_delta_taking_old_published_to_new_bit_for_bit(plan):
    frag = _fragment(plan)
    for r in range(4):
        old_published, old_params = frag.published, frag.params
        old_bytes = old_published.tobytes()
        frag.lend()  # read after the close: lent, as a snapshot or pull does
        frame = _round(frag, r)
        frag.give_back()
        assert frag.version == r + 1 and frag.last_round_size == 3
        assert frag.ring[-1] == (frag.version, frame)
        assert codec.frame_info(frame).codec == codec.Codec.INT4
        assert old_published.tobytes() == old_bytes, "the old published copy was written in place"
        assert not np.array_equal(frag.params, old_params)
        via_decode = old_published + codec.decode(frame, num_values=frag.size)
        assert via_decode.tobytes() == frag.published.tobytes()
        held = old_published.copy()  # what a learner holding the old version does
        codec.decode_into(frame, held, 1.0)
        assert held.tobytes() == frag.published.tobytes()
        # INT4 loses a little; what it did not carry is left in params − published
        carried = np.abs(frag.published - old_published).max()
        assert 0 < np.abs(frag.params - frag.published).max() < carried / 4


def test_close_round_on_an_empty_round_is_refused(plan):
    frag = _fragment(plan)
    with pytest.raises(AssertionError, match="empty round"):
        frag.close_round()
    assert frag.version == 0 and not frag.ring


@pytest.mark.parametrize("rda", [True, False], ids=["rda", "plain"])
@pytest.mark.parametrize("as_codes", [True, False], ids=["codes", "vector"])
def test_one_learner_moves_params_against_its_outer_gradient(plan, rda, as_codes):
    frag = _fragment(
        plan, lr=1.0, momentum=0.0, delay=1, rda=rda, publish=codec.Codec.FP32, quorum=1
    )
    for r in range(3):
        old = frag.params.copy()
        delta = _delta(frag.size, 5, r, scale=0.1)
        _push(frag, "a", r + 1, delta, float(r), weight=3.0, as_codes=as_codes)
        if as_codes:  # what the push's INT4 frame carries
            delta = codec.decode(codec.encode(delta, codec.Codec.INT4))
        frame = frag.close_round(trigger="a")
        np.testing.assert_allclose(frag.params, old - delta, rtol=0, atol=1e-6)
        # a lossless publish codec: the published copy is params exactly
        assert frag.published.tobytes() == frag.params.tobytes()
        assert codec.decode(frame).tobytes() == (frag.params - old).tobytes()


def test_plain_average_weights_learners_by_their_weight(plan):
    frag = _fragment(plan, lr=1.0, momentum=0.0, rda=False, publish=codec.Codec.FP32)
    old = frag.params.copy()
    d1, d2 = _delta(frag.size, 1, scale=0.1), _delta(frag.size, 2, scale=0.1)
    _push(frag, "a", 1, d1, 0.0, weight=1.0, as_codes=False)
    _push(frag, "b", 1, d2, 0.0, weight=3.0, as_codes=False)
    frag.close_round(trigger="b")
    np.testing.assert_allclose(frag.params, old - (d1 + 3 * d2) / 4, rtol=0, atol=1e-6)


def test_momentum_carries_the_previous_round_into_the_next(plan):
    """Nesterov with delay 1: the second of two equal rounds moves (1 + β + β²)/(1 + β) times as far."""
    frag = _fragment(plan, lr=1.0, momentum=0.5, rda=False, publish=codec.Codec.FP32, quorum=1)
    delta = _delta(frag.size, 3, scale=0.1)
    moved = []
    for r in range(2):
        old = frag.params.copy()
        _push(frag, "a", r + 1, delta, float(r), as_codes=False)
        frag.close_round(trigger="a")
        moved.append(old - frag.params)
    np.testing.assert_allclose(moved[0], 1.5 * delta, rtol=0, atol=1e-6)
    np.testing.assert_allclose(moved[1], 1.75 * delta, rtol=0, atol=1e-6)


# -- staleness discount -------------------------------------------------------------------


@pytest.mark.parametrize("rda", [True, False], ids=["rda", "plain"])
def test_staleness_discount_shrinks_a_lone_stale_push_in_absolute_terms(plan, rda):
    d, w = 1.0 / 3.0, 2.0
    delta = _delta(plan.fragment_sizes[P], 4, scale=0.1)
    moved = {}
    for name, discount, staleness in (("fresh", 1.0, 0), ("stale", d, 2)):
        frag = _fragment(plan, lr=1.0, momentum=0.0, rda=rda, publish=codec.Codec.FP32, quorum=1)
        old = frag.params.copy()
        answer = _push(
            frag,
            "a",
            1,
            delta,
            0.0,
            weight=w,
            staleness=staleness,
            discount=discount,
            as_codes=False,
        )
        assert answer.weight == pytest.approx(w * discount) and answer.discount == discount
        frag.close_round(trigger="a")
        moved[name] = old - frag.params
    np.testing.assert_allclose(moved["fresh"], delta, rtol=0, atol=1e-6)
    np.testing.assert_allclose(moved["stale"], d * delta, rtol=0, atol=1e-6)
    assert np.linalg.norm(moved["stale"]) == pytest.approx(
        d * np.linalg.norm(moved["fresh"]), rel=1e-5
    )


def test_staleness_discount_in_a_mixed_round_scales_by_discounted_over_full_weight(plan):
    """Plain average, fresh w1 and stale w2 (discount d): Σ w·d·Δ / Σ w·d, shrunk by Σ w·d / Σ w,
    is Σ w·d·Δ / Σ w."""
    frag = _fragment(plan, lr=1.0, momentum=0.0, rda=False, publish=codec.Codec.FP32)
    old = frag.params.copy()
    d1, d2 = _delta(frag.size, 1, scale=0.1), _delta(frag.size, 2, scale=0.1)
    _push(frag, "a", 1, d1, 0.0, weight=1.0, as_codes=False)
    _push(frag, "b", 1, d2, 0.0, weight=3.0, staleness=1, discount=0.5, as_codes=False)
    assert frag.full_weight == pytest.approx(4.0) and frag.round.total_weight == pytest.approx(2.5)
    frag.close_round(trigger="b")
    np.testing.assert_allclose(frag.params, old - (d1 + 1.5 * d2) / 4.0, rtol=0, atol=1e-6)
    assert frag.full_weight == 0.0


# -- contributors and answers -------------------------------------------------------------


def test_round_contributors_and_answers(plan):
    frag = _fragment(plan, quorum=2)
    a1 = _push(frag, "a", 1, _delta(frag.size, 1), 10.0)
    assert frag.contributors == {"a"}
    assert frag.round_state.first_push_at == 10.0 and frag.round_state.quorum_reached_at is None
    b1 = _push(frag, "b", 7, _delta(frag.size, 2), 12.5)
    assert frag.contributors == {"a", "b"}
    assert frag.round_state.first_push_at == 10.0 and frag.round_state.quorum_reached_at == 12.5
    assert frag.answers == {"a": a1, "b": b1}

    frag.close_round(trigger="b")
    assert frag.version == 1
    assert frag.contributors == frozenset() and frag.round_state == rules.open_round()
    # the trigger's answer moves to the version its push made; the other keeps its own,
    # so a retry of a's push gets exactly the answer it first got
    assert frag.answers["b"] == dataclasses.replace(b1, version=1)
    assert frag.answers["a"] == a1 and frag.answers["a"].version == 0

    # round 2: only a pushes; b's newest answer stays for its retries; no trigger: no move
    a2 = _push(frag, "a", 2, _delta(frag.size, 3), 20.0)
    assert a2.version == 1 and frag.contributors == {"a"}
    frag.close_round()
    assert frag.version == 2
    assert frag.answers == {"a": a2, "b": dataclasses.replace(b1, version=1)}

    # a trigger that has no answer here changes nothing
    a3 = _push(frag, "a", 3, _delta(frag.size, 4), 30.0)
    frag.close_round(trigger="nobody")
    assert frag.answers == {"a": a3, "b": dataclasses.replace(b1, version=1)}


def test_contributing_twice_to_one_round_is_refused(plan):
    frag = _fragment(plan)
    _push(frag, "a", 1, _delta(frag.size, 1), 0.0)
    with pytest.raises(ValueError, match="already contributed"):
        _push(frag, "a", 2, _delta(frag.size, 2), 1.0)


# -- delta ring ---------------------------------------------------------------------------


def test_deltas_since_chains_to_the_published_copy_until_the_ring_runs_out(plan):
    ring = 3
    frag = _fragment(plan, ring=ring)
    published = {0: frag.published.copy()}
    for r in range(6):
        _round(frag, r)
        published[frag.version] = frag.published.copy()  # closes step it in place
        v = frag.version
        for have in range(0, v + 1):
            chain = frag.deltas_since(have)
            if have < v - ring:
                assert chain is None, (have, v)
                continue
            assert chain is not None, (have, v)
            assert [cv for cv, _ in chain] == list(range(have + 1, v + 1))
            held = published[have].copy()
            for _, frame in chain:
                codec.decode_into(frame, held, 1.0)
            assert held.tobytes() == frag.published.tobytes(), (have, v)
    assert frag.version == 6 and [v for v, _ in frag.ring] == [4, 5, 6]
    assert frag.deltas_since(6) == []
    assert frag.deltas_since(3) is not None and frag.deltas_since(2) is None
    assert frag.deltas_since(7) is None  # from the future: resync
    snap = frag.snapshot_frame()
    assert codec.frame_info(snap).codec == codec.Codec.FP32
    assert codec.decode(snap, num_values=frag.size).tobytes() == frag.published.tobytes()


def test_snapshot_frame_is_the_published_copy_not_params(plan):
    frag = _fragment(plan, publish=codec.Codec.INT4)
    _round(frag, 0)
    assert not np.array_equal(frag.params, frag.published)  # INT4 left something behind
    assert codec.decode(frag.snapshot_frame()).tobytes() == frag.published.tobytes()


# -- state() / restore() ------------------------------------------------------------------


@pytest.mark.parametrize("delay", [1, 2], ids=["delay1", "delay2"])
def test_restored_fragment_continues_bit_identically(plan, delay):
    live = _fragment(plan, delay=delay, ring=3)
    for r in range(3):
        _round(live, r)
    if delay == 2:  # three rounds: the snapshot lands mid-cycle, the momentum not yet moved
        assert int(live.opt_state.rounds) == 1
    # and an open round half full, so the accumulator and its full weight matter too
    _push(live, "a", 4, _delta(live.size, 3, 0), 50.0, weight=2.0, staleness=1, discount=0.5)
    meta, arrays = _saved(live)
    assert meta["contributors"] == ["a"] and meta["round"]["count"] == 1

    again = _fragment(plan, delay=delay, ring=3, seed=None)
    again.restore(meta, arrays, now=1000.0)
    assert _everything(again) == _everything(live)
    assert again.round_state.first_push_at == 1000.0 and again.contributors == {"a"}
    assert again.deltas_since(1) == live.deltas_since(1)

    for frag in (live, again):
        _push(frag, "b", 4, _delta(frag.size, 3, 1), 60.0)
        frag.close_round(trigger="b")
        for r in range(4, 8):
            _round(frag, r)
    assert live.version == again.version == 8
    assert again.params.tobytes() == live.params.tobytes()
    assert again.published.tobytes() == live.published.tobytes()
    assert _everything(again) == _everything(live)


def test_restore_detects_a_lost_momentum_cycle_count(plan):
    """The mid-cycle test above can fail: restarting the delayed-Nesterov cycle changes the bits."""
    live = _fragment(plan, delay=2, momentum=0.9)
    _round(live, 0)
    meta, arrays = _saved(live)
    arrays = {**arrays, "opt.0": np.zeros_like(arrays["opt.0"])}  # count 1 -> 0
    again = _fragment(plan, delay=2, momentum=0.9, seed=None)
    again.restore(meta, arrays, now=0.0)
    for frag in (live, again):
        _round(frag, 1)
    assert again.params.tobytes() != live.params.tobytes()


def test_restore_refuses_state_written_with_another_momentum_delay(plan):
    live = _fragment(plan, delay=2)
    _round(live, 0)
    meta, arrays = _saved(live)
    with pytest.raises(ValueError, match="momentum-delay"):
        _fragment(plan, delay=1, seed=None).restore(meta, arrays, now=0.0)


def test_state_of_an_unseeded_fragment_restores_unseeded(plan):
    meta, arrays = _saved(_fragment(plan, seed=None))
    assert meta["initialized"] is False and "params" not in arrays
    again = _fragment(plan, seed=None)
    again.restore(meta, arrays, now=0.0)
    assert not again.initialized and again.version == 0 and not again.ring


# -- determinism --------------------------------------------------------------------------


def _feed(frag: Fragment, rounds: int, *, as_codes: bool = True) -> None:
    for r in range(rounds):
        for i, m in enumerate(("a", "b", "c")):
            stale = i == 2 and frag.version > 0
            _push(
                frag,
                m,
                r + 1,
                _delta(frag.size, 9, r, i, scale=0.05),
                float(r),
                weight=0.5 + i,
                staleness=int(stale),
                discount=0.5 if stale else 1.0,
                as_codes=as_codes,
            )
        frag.close_round(trigger="c")


def test_two_fragments_fed_the_same_pushes_end_bit_identical():
    # one fragment over three codec chunks, so the threaded kernels have chunks to split
    big = FragmentPlan.build(
        [TensorSpec("embed", (1000, 300)), TensorSpec("w", (600, 500)), TensorSpec("b", (500,))], 1
    )
    size = big.fragment_sizes[0]
    assert size > 2 * codec.CHUNK_VALUES
    one, two = (_fragment(big, index=0, delay=2, ring=3) for _ in range(2))
    for frag in (one, two):
        _feed(frag, 5)
        _push(frag, "a", 6, _delta(size, 9, 5, 0), 5.0)  # an open round too
    assert one.version == two.version == 5
    assert _everything(one) == _everything(two)
    assert [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(one.opt_state)] == [
        np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(two.opt_state)
    ]


def test_codes_and_float32_vectors_of_the_same_push_give_the_same_bits(plan):
    """contribute() takes a push's checked codes or its decoded float32 vector: the same bits."""
    by_codes, by_vector = _fragment(plan, delay=2), _fragment(plan, delay=2)
    for r in range(4):
        for i, m in enumerate(("a", "b")):
            frame = codec.encode(_delta(by_codes.size, 11, r, i), codec.Codec.INT4)
            by_codes.contribute(
                m, codec.read_codes(frame), _answer(r + 1, r, weight=1.0 + i), float(r)
            )
            by_vector.contribute(
                m, codec.decode(frame), _answer(r + 1, r, weight=1.0 + i), float(r)
            )
        assert by_codes.close_round(trigger="b") == by_vector.close_round(trigger="b")
    assert _everything(by_codes) == _everything(by_vector)


@pytest.mark.parametrize("delay", [1, 2])
def test_a_close_steps_in_place_unless_lent_and_either_way_gives_the_same_bits(plan, delay):
    """Closes with nothing lent write over params, momentum and the published copy; with
    them lent (a snapshot or pull reading them unlocked) they leave those arrays as they
    were and make fresh ones. The bits are the same."""
    owned, lent = _fragment(plan, delay=delay), _fragment(plan, delay=delay)
    for r in range(5):
        held = {
            "params": owned.params,
            "published": owned.published,
            "momentum": jax.tree_util.tree_leaves(owned.opt_state)[-1],
        }
        lent.lend()
        loaned = {
            "params": lent.params,
            "published": lent.published,
            "momentum": jax.tree_util.tree_leaves(lent.opt_state)[-1],
        }
        before = {k: np.array(v) for k, v in loaned.items()}
        assert _round(owned, r) == _round(lent, r)
        # owned: the same arrays, stepped; lent: untouched, and replaced by fresh ones
        assert owned.params is held["params"] and owned.published is held["published"]
        assert jax.tree_util.tree_leaves(owned.opt_state)[-1] is held["momentum"]
        for k, v in loaned.items():
            assert v.tobytes() == before[k].tobytes(), k
        assert lent.params is not loaned["params"] and lent.published is not loaned["published"]
        lent.give_back()
        assert _everything(owned) == _everything(lent)
    with pytest.raises(AssertionError, match="without lend"):
        owned.give_back()


def test_fragments_sharing_an_accumulator_pool_give_the_bits_of_ones_without(plan):
    """Two fragments whose rounds overlap, each round's first push taking the buffer the
    other's close just gave back: with closes in place and lent among them, every frame
    and state is what fragments with fresh buffers give, and once no round is open the
    pool keeps nothing."""
    pool = merge.AccumulatorPool()
    pooled, plain = (
        [_fragment(plan, index=p) for p in (0, 1)],
        [_fragment(plan, index=p) for p in (0, 1)],
    )
    for f in pooled:
        f.round.pool = pool

    def push(p: int, r: int) -> None:
        for f in (pooled[p], plain[p]):
            _push(f, "a", r + 1, _delta(f.size, r, p), 0.0)

    push(0, 0), push(1, 0)
    for r in range(1, 5):
        for p in (0, 1):
            lent = r == 3 and p == 0  # this close makes fresh arrays: its buffer is kept
            if lent:
                pooled[p].lend(), plain[p].lend()
            assert pooled[p].close_round() == plain[p].close_round()
            assert pool.kept == (0 if lent else 1)  # the other fragment's round is open
            push(p, r)
            assert pool.kept == 0
            if lent:
                pooled[p].give_back(), plain[p].give_back()
    for p, kept in ((0, 1), (1, 0)):  # the last close with no round open lets go of all
        assert pooled[p].close_round() == plain[p].close_round()
        assert pool.kept == kept
    for a, b in zip(pooled, plain):
        assert _everything(a) == _everything(b)
