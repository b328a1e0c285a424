"""Tests for wire/plan.py: balance, determinism, flat layout, shards, JSON."""

import itertools
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from atoll.wire.plan import FragmentMap, FragmentPlan, Slot, TensorSpec, named_leaves

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def transformer_specs(d, layers, vocab, tied):
    """TensorSpecs of a decoder-only transformer (mlp 4*d, pre-norm scales)."""
    out = [TensorSpec("embed/table", (vocab, d))]
    if not tied:
        out.append(TensorSpec("unembed/w", (d, vocab)))
    per_layer = [
        ("attn/wq", (d, d)),
        ("attn/wk", (d, d)),
        ("attn/wv", (d, d)),
        ("attn/wo", (d, d)),
        ("mlp/w1", (d, 4 * d)),
        ("mlp/w2", (4 * d, d)),
        ("ln1/scale", (d,)),
        ("ln2/scale", (d,)),
    ]
    for i in range(layers):
        out += [TensorSpec(f"blocks/{i}/{n}", shape) for n, shape in per_layer]
    out.append(TensorSpec("final_norm/scale", (d,)))
    return out


def nest(flat):
    """{"a/b": x} -> {"a": {"b": x}}."""
    tree = {}
    for name, leaf in flat.items():
        *path, last = name.split("/")
        node = tree
        for k in path:
            node = node.setdefault(k, {})
        node[last] = leaf
    return tree


def shape_tree(specs):
    """A nested tree of zero-memory leaves with the specs' shapes."""
    return nest({s.name: np.broadcast_to(np.zeros((), np.int8), s.shape) for s in specs})


def small_tree(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((11, 4)).astype(np.float32),
        "blocks": {
            str(i): {
                "w": rng.standard_normal((4, 4)).astype(np.float32),
                "b": rng.standard_normal(4).astype(np.float32),
            }
            for i in range(3)
        },
        "head": {"w": rng.standard_normal((4, 11)).astype(np.float32)},
    }


# -- balance -----------------------------------------------------------------------


def test_balance_on_transformer_trees():
    checked = 0
    for d, layers, vocab, tied in itertools.product(
        [256, 512, 768, 1024, 2048], [4, 12, 24], [256, 8192, 32000, 50257], [True, False]
    ):
        specs = transformer_specs(d, layers, vocab, tied)
        total, largest = sum(s.size for s in specs), max(s.size for s in specs)
        # Balance is achievable only while the largest tensor fits in a mean fragment.
        for P in range(1, min(len(specs), total // largest, 64) + 1):
            plan = FragmentPlan.build(specs, P)
            mean = total / P
            assert plan.num_params == total
            assert max(plan.fragment_sizes) <= 4 / 3 * mean, (
                f"d={d} L={layers} V={vocab} tied={tied} P={P}: "
                f"sizes {plan.fragment_sizes}, mean {mean:.0f}"
            )
            checked += 1
    assert checked > 1000  # the sweep really swept


def test_tree_and_specs_give_same_plan():
    specs = transformer_specs(256, 4, 1000, tied=False)
    assert FragmentPlan.build(shape_tree(specs), 7) == FragmentPlan.build(specs, 7)


def test_greedy_rule_on_a_known_case():
    specs = [TensorSpec(n, (k,)) for n, k in [("a", 5), ("b", 4), ("c", 3), ("d", 3), ("e", 3)]]
    plan = FragmentPlan.build(specs, 2)
    # a -> 0 (loads 5, 0); b -> 1 (5, 4); c -> 1 (5, 7); d -> 0 (8, 7); e -> 1 (8, 10).
    assert [plan.fragment_of(n) for n in "abcde"] == [0, 1, 1, 0, 1]
    assert plan.fragment_sizes == (8, 10)
    assert [(s.name, s.offset) for s in plan.tensors_of(1)] == [("b", 0), ("c", 4), ("e", 7)]


def test_ties_go_to_lowest_fragment_and_by_name():
    specs = [TensorSpec(n, (2, 2)) for n in "dcba"]
    plan = FragmentPlan.build(specs, 4)
    assert [plan.fragment_of(n) for n in "abcd"] == [0, 1, 2, 3]


# -- determinism and fingerprint --------------------------------------------------------


def test_same_plan_from_shuffled_input():
    specs = transformer_specs(512, 6, 8192, tied=False)
    plan = FragmentPlan.build(specs, 9)
    for seed in range(5):
        shuffled = specs[:]
        random.Random(seed).shuffle(shuffled)
        other = FragmentPlan.build(shuffled, 9)
        assert other == plan and other.fingerprint == plan.fingerprint
        tree = shape_tree(shuffled)  # dict insertion order follows the shuffle
        assert FragmentPlan.build(tree, 9).fingerprint == plan.fingerprint


def test_fingerprint_stable_across_processes():
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from tests.test_plan import transformer_specs, shape_tree;"
        "from wire.plan import FragmentPlan;"
        "print(FragmentPlan.build(shape_tree(transformer_specs(256, 4, 1000, False)),"
        " 5).fingerprint)"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code, REPO],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    here = FragmentPlan.build(transformer_specs(256, 4, 1000, False), 5).fingerprint
    assert out.stdout.strip() == here
    assert len(here) == 16 and int(here, 16) >= 0


def test_fingerprint_changes_with_every_ingredient():
    base = {"embed": np.zeros((8, 4)), "w": np.zeros((4, 4)), "v": np.zeros((4, 2))}
    fp = FragmentPlan.build(base, 2).fingerprint
    changed = {
        "shape": FragmentPlan.build({**base, "w": np.zeros((4, 5))}, 2),
        "transposed": FragmentPlan.build({**base, "v": np.zeros((2, 4))}, 2),
        "name": FragmentPlan.build({"embed": base["embed"], "x": base["w"], "v": base["v"]}, 2),
        "P": FragmentPlan.build(base, 3),
        "embedding": FragmentPlan.build(base, 2, is_embedding=lambda n: False),
    }
    for what, plan in changed.items():
        assert plan.fingerprint != fp, what
    # Same tensors, different assignment (a hand-made plan) => different fingerprint.
    offsets, moved = [0, 0], []
    for s in FragmentPlan.build(base, 2).slots:  # name order, as the layout wants
        p = 1 - s.fragment
        moved.append(Slot(s.spec, p, offsets[p]))
        offsets[p] += s.spec.size
    assert FragmentPlan(2, tuple(moved)).fingerprint != fp


def test_default_and_custom_embedding_rule():
    tree = {
        "tok_embed": np.zeros((5, 2)),
        "embed": {"table": np.zeros((5, 2))},
        "head": np.zeros((2, 5)),
    }
    plan = FragmentPlan.build(tree, 1)
    assert {s.name: s.spec.embedding for s in plan.slots} == {
        "embed/table": True,
        "head": False,
        "tok_embed": True,
    }
    plan = FragmentPlan.build(tree, 1, is_embedding=lambda n: n == "head")
    assert [s.name for s in plan.slots if s.spec.embedding] == ["head"]


# -- flat vectors --------------------------------------------------------------------

keys = st.text(alphabet="abcxyz_0123", min_size=1, max_size=3)
leaves = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
    elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
)
trees = st.recursive(
    leaves, lambda kids: st.dictionaries(keys, kids, min_size=1, max_size=4), max_leaves=12
)
dict_trees = st.dictionaries(keys, trees, min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(tree=dict_trees, data=st.data())
def test_flatten_unflatten_bit_exact(tree, data):
    n = len(named_leaves(tree))
    P = data.draw(st.integers(1, n))
    plan = FragmentPlan.build(tree, P)
    vectors = plan.flatten(tree)
    assert [v.dtype for v in vectors] == [np.float32] * P
    assert [v.shape for v in vectors] == [(k,) for k in plan.fragment_sizes]
    back = named_leaves(plan.unflatten(vectors))
    orig = named_leaves(tree)
    assert back.keys() == orig.keys()
    for name, arr in orig.items():
        assert back[name].shape == arr.shape and back[name].dtype == np.float32
        assert np.array_equal(back[name].view(np.uint32), arr.view(np.uint32)), name
    for p in range(P):
        assert np.array_equal(
            plan.flatten_fragment(tree, p).view(np.uint32), vectors[p].view(np.uint32)
        )
        part = plan.unflatten_fragment(p, vectors[p])
        assert set(part) == {s.name for s in plan.tensors_of(p)}


@settings(max_examples=40, deadline=None)
@given(tree=dict_trees, data=st.data())
def test_every_parameter_in_exactly_one_fragment(tree, data):
    names = named_leaves(tree)
    P = data.draw(st.integers(1, len(names)))
    plan = FragmentPlan.build(tree, P)
    seen = [s.name for p in range(P) for s in plan.tensors_of(p)]
    assert sorted(seen) == sorted(names)
    for p in range(P):
        slots = plan.tensors_of(p)
        assert slots, "empty fragment"
        # Contiguous, non-overlapping, name-ordered, covering the vector exactly.
        assert [s.name for s in slots] == sorted(s.name for s in slots)
        assert [s.offset for s in slots] == [0] + [s.end for s in slots[:-1]]
        assert slots[-1].end == plan.fragment_sizes[p]
        assert all(plan.fragment_of(s.name) == p for s in slots)
    # Each scalar lands in exactly one place: number positions and read them back.
    numbered, start = {}, 0
    for name, arr in names.items():
        numbered[name] = np.arange(start, start + arr.size, dtype=np.float32).reshape(arr.shape)
        start += arr.size
    flat = np.concatenate(plan.flatten(nest(numbered)))
    assert plan.num_params == start
    assert np.array_equal(np.sort(flat), np.arange(start, dtype=np.float32))


def test_flatten_converts_dtypes_and_unflatten_fragment_views():
    tree = {"a": np.arange(6, dtype=np.float64).reshape(2, 3), "b": [1, 2], "c": 7}
    plan = FragmentPlan.build(tree, 1)
    (vec,) = plan.flatten(tree)
    assert vec.dtype == np.float32 and vec.tolist() == [0, 1, 2, 3, 4, 5, 1, 2, 7]
    parts = plan.unflatten_fragment(0, vec)
    parts["a"][0, 0] = 42.0
    assert vec[0] == 42.0  # a view, as documented
    assert plan.unflatten([vec])["c"].shape == ()


def test_flatten_jax_arrays():
    jnp = pytest.importorskip("jax.numpy")
    tree = {"w": jnp.ones((3, 2), jnp.bfloat16), "embed": jnp.arange(4.0)}
    plan = FragmentPlan.build(tree, 2)
    vectors = plan.flatten(tree)
    back = plan.unflatten(vectors)
    assert np.array_equal(back["w"], np.ones((3, 2))) and back["embed"].tolist() == [0, 1, 2, 3]


def test_flatten_names_the_first_mismatch():
    tree = small_tree()
    plan = FragmentPlan.build(tree, 3)
    missing = small_tree()
    del missing["blocks"]["1"]["b"]
    with pytest.raises(ValueError, match="lacks tensor 'blocks/1/b'"):
        plan.flatten(missing)
    extra = small_tree()
    extra["blocks"]["0"]["zz"] = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="'blocks/0/zz'"):
        plan.flatten(extra)
    wrong = small_tree()
    wrong["head"]["w"] = np.zeros((11, 4), np.float32)
    with pytest.raises(ValueError, match=r"'head/w': shape \(11, 4\), plan says \(4, 11\)"):
        plan.flatten_fragment(wrong, 0)
    vectors = plan.flatten(tree)
    with pytest.raises(ValueError, match="got 2 vectors, plan has 3"):
        plan.unflatten(vectors[:2])
    with pytest.raises(ValueError, match="fragment 1: vector shape"):
        plan.unflatten([vectors[0], vectors[1][:-1], vectors[2]])
    with pytest.raises(ValueError, match=r"fragment 3 not in \[0, 3\)"):
        plan.unflatten_fragment(3, vectors[0])


# -- shards --------------------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 2, 5, 8, 13])
def test_shards_cover_every_fragment_once(P):
    # a run's first layout: fragment p on shard p mod S (FragmentMap.modulo)
    for S in range(1, P + 1):
        layout = FragmentMap.modulo(P, S)
        owned = [p for s in range(S) for p in layout.fragments_of(s)]
        assert sorted(owned) == list(range(P))
        assert all(layout.fragments_of(s) for s in range(S))
        for p in range(P):
            assert layout.owner(p) == p % S
            assert p in layout.fragments_of(layout.owner(p))


def test_shard_argument_refusals():
    plan = FragmentPlan.build(small_tree(), 4)
    with pytest.raises(ValueError, match="num_shards=0"):
        FragmentMap.modulo(plan.num_fragments, 0)
    with pytest.raises(ValueError, match="a shard would own nothing"):
        FragmentMap.modulo(plan.num_fragments, 5)
    with pytest.raises(ValueError, match=r"fragment -1 not in \[0, 4\)"):
        FragmentMap.modulo(plan.num_fragments, 2).owner(-1)
    with pytest.raises(ValueError, match="fragment 4"):
        plan.tensors_of(4)


# -- build refusals ------------------------------------------------------------------


@pytest.mark.parametrize(
    "tree_or_specs, P, message",
    [
        ({"a": np.zeros(2)}, 0, "num_fragments=0: need an int >= 1"),
        ({"a": np.zeros(2)}, 1.5, "num_fragments=1.5"),
        (
            {"a": np.zeros(2), "b": np.zeros(3)},
            3,
            "num_fragments=3 but only 2 tensors: a fragment would be empty",
        ),
        ({}, 1, "empty parameter tree"),
        ({"a": {}}, 1, "empty parameter tree"),
        ({"a": np.zeros((2, 0))}, 1, r"shape \(2, 0\) has a zero or negative dim"),
        ([TensorSpec("a", (2,)), TensorSpec("a", (3,))], 1, "duplicate tensor name 'a'"),
        ([TensorSpec("a", (2,)), TensorSpec("a/b", (3,))], 1, "'a/b' nests under tensor 'a'"),
        ({"a/b": np.zeros(2)}, 1, "key 'a/b'.*without '/'"),
        ({"x": {3: np.zeros(2)}}, 1, "key 3 under 'x'"),
        ({"x": {"": np.zeros(2)}}, 1, "key '' under 'x'"),
        (["not a spec"], 1, "nested mapping or TensorSpecs"),
    ],
)
def test_build_refusals(tree_or_specs, P, message):
    with pytest.raises(ValueError, match=message):
        FragmentPlan.build(tree_or_specs, P)


def test_tensor_spec_refusals_and_size():
    assert TensorSpec("w", (3, 4)).size == 12 and TensorSpec("s", ()).size == 1
    with pytest.raises(ValueError, match="zero or negative"):
        TensorSpec("w", (3, -1))
    with pytest.raises(ValueError, match="must be ints"):
        TensorSpec("w", (3.0, 4))
    with pytest.raises(ValueError, match="non-empty"):
        TensorSpec("a//b", (1,))


# -- JSON ----------------------------------------------------------------------------


def test_json_round_trip():
    plan = FragmentPlan.build(shape_tree(transformer_specs(256, 4, 1000, False)), 6)
    text = plan.to_json()
    back = FragmentPlan.from_json(text)
    assert back == plan and back.fingerprint == plan.fingerprint
    assert json.loads(text)["fingerprint"] == plan.fingerprint
    assert back.to_json() == text
    assert FragmentPlan.from_json(text.encode()) == plan


def _tamper(text, edit):
    doc = json.loads(text)
    edit(doc)
    return json.dumps(doc)


def _swap_fragments(doc):
    a, b = doc["tensors"][0], doc["tensors"][-1]
    a["fragment"], b["fragment"] = b["fragment"], a["fragment"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["tensors"][0].update(shape=[7, 7]), "offset|fingerprint mismatch"),
        (
            lambda d: d["tensors"][0].update(embedding=not d["tensors"][0]["embedding"]),
            "fingerprint mismatch",
        ),
        (lambda d: d["tensors"][0].update(name="zzz"), "offset|fingerprint mismatch"),
        (lambda d: d.update(fingerprint="0" * 16), "fingerprint mismatch"),
        (lambda d: d.update(num_fragments=7), "fragment 3 has no tensors"),
        (lambda d: d.update(format="other"), "format 'other'"),
        (lambda d: d.pop("tensors"), "malformed"),
        (lambda d: d["tensors"][0].pop("offset"), "malformed"),
        (lambda d: d["tensors"][0].update(offset=1), "offset 1, layout says 0"),
        (lambda d: d["tensors"][0].update(fragment=99), r"fragment 99 not in \[0, 3\)"),
        (lambda d: d["tensors"][0].update(fragment="0"), "must be ints"),
        (lambda d: d["tensors"][0].update(shape=[2, 0]), "zero or negative"),
        (lambda d: d["tensors"].append(dict(d["tensors"][0])), "duplicate tensor name"),
        (_swap_fragments, "offset|fingerprint mismatch"),
    ],
)
def test_tampered_json_rejected(edit, message):
    plan = FragmentPlan.build(small_tree(), 3)
    with pytest.raises(ValueError, match=message):
        FragmentPlan.from_json(_tamper(plan.to_json(), edit))


@pytest.mark.parametrize("text", ["", "{", "[]", "null", '{"format": 1}'])
def test_malformed_json_rejected(text):
    with pytest.raises(ValueError):
        FragmentPlan.from_json(text)


# -- the fragment map ---------------------------------------------------------------------


def test_fragment_map_version_zero_is_p_mod_s_and_moves_make_the_next_version():
    m = FragmentMap.modulo(6, 4)
    assert (m.version, m.owners) == (0, (0, 1, 2, 3, 0, 1))
    assert [m.fragments_of(s) for s in range(4)] == [(0, 4), (1, 5), (2,), (3,)]
    moved = m.moved(5, 2)
    assert (moved.version, moved.owner(5), moved.fragments_of(2)) == (1, 2, (2, 5))
    assert m.owner(5) == 1  # the old version is unchanged
    assert FragmentMap.from_json(json.loads(json.dumps(moved.to_json()))) == moved


@pytest.mark.parametrize(
    "build",
    [
        lambda M: M.modulo(3, 4),  # a shard would own nothing
        lambda M: M.modulo(3, 0),
        lambda M: M(-1, (0, 1)),
        lambda M: M(0, ()),
        lambda M: M(0, (0, -1)),
        lambda M: M.modulo(3, 2).owner(3),
        lambda M: M.modulo(3, 2).moved(-1, 0),
    ],
)
def test_fragment_map_refuses_what_cannot_be(build):
    with pytest.raises(ValueError):
        build(FragmentMap)
