"""`atoll export`'s flags: what cannot work is refused (exit 2) before any shard is called
and before anything is written (the reads themselves: tests/integration/test_export.py)."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import atoll
from atoll import model_dir
from atoll.cli import main as atoll_cli
from atoll.export import GlobalModel
from atoll.learner.pytree import TreeLayout, leaf_name
from atoll.wire.plan import FragmentMap, FragmentPlan


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--shards", "nowhere"], "is not HOST:PORT"),
        (["--shards", "a-{i}:7070,b:7070"], "a pattern is one address with {i}"),
        (["--shards", "a:1", "--wait", "-1"], "--wait must be >= 0"),
        (["--shards", "a:1", "--deadline", "0"], "--deadline must be > 0"),
        (["--shards", "a:1", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    ],
)
def test_bad_flags_are_refused(tmp_path, capsys, flags, says):
    with pytest.raises(SystemExit) as e:
        atoll_cli(["export", "--out", str(tmp_path / "m"), *flags])
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_out_that_is_taken_is_refused_and_left_alone(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as e:
        atoll_cli(["export", "--shards", "127.0.0.1:1", "--out", str(tmp_path / "m")])
    assert e.value.code == 2 and "exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert (tmp_path / "m" / "notes.txt").read_text() == "mine"
    with pytest.raises(SystemExit) as e:
        atoll_cli(["export", "--shards", "127.0.0.1:1", "--out", str(tmp_path / "no" / "m")])
    assert e.value.code == 2 and "no directory" in capsys.readouterr().err


def test_the_record_names_each_fragments_version_shard_and_open_round():
    tree = {"a": np.zeros(4, np.float32), "b": np.ones(6, np.float32)}
    plan = FragmentPlan.build(tree, 2)
    fmap = FragmentMap(1, (1, 0), (1, 0))
    model = GlobalModel(plan, plan.flatten(tree), {0: 5, 1: 3}, {1: 2}, fmap, 0.4)
    assert model.record() == {
        "map_version": 1,
        "waited_seconds": 0.4,
        "fragments": [
            {
                "fragment": 0,
                "version": 5,
                "shard": 1,
                "round_open": False,
                "pushes_not_in_model": 0,
            },
            {"fragment": 1, "version": 3, "shard": 0, "round_open": True, "pushes_not_in_model": 2},
        ],
    }
    assert model.params()["b"].tolist() == [1.0] * 6


@dataclasses.dataclass
class Block:
    """An Equinox-like module: array fields, a static field, an int counter."""

    w: jax.Array  # bfloat16
    b: jax.Array  # float32
    count: jax.Array  # int32: not synced
    act: str = "gelu"  # static


jax.tree_util.register_dataclass(Block, data_fields=["w", "b", "count"], meta_fields=["act"])


def _model(seed: int) -> dict:
    k0, k1, k2 = jax.random.split(jax.random.key(seed), 3)
    return {
        "blocks": [
            Block(
                jax.random.normal(k0, (4, 8)).astype(jnp.bfloat16),
                jax.random.normal(k1, (8,)),
                jnp.array(seed, jnp.int32),
                act="relu",
            )
        ],
        "head": {"w": jax.random.normal(k2, (8, 2))},
    }


def _export_of(tmp_path, tree) -> pathlib.Path:
    """An export of `tree`'s synced leaves, as `atoll export` writes one."""
    plan = TreeLayout(tree, 2).plan
    leaves = {leaf_name(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    vectors = [
        np.concatenate([np.asarray(leaves[s.name], np.float32).ravel() for s in plan.tensors_of(p)])
        for p in range(plan.num_fragments)
    ]
    out = tmp_path / "model"
    model_dir.write(out, plan.unflatten(vectors), plan, {"fragments": []})
    return out


def test_an_export_goes_back_into_the_users_own_pytree_in_one_call(tmp_path):
    trained, template = _model(1), _model(2)
    restored = atoll.load_export(_export_of(tmp_path, trained), like=template)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(template)
    block = restored["blocks"][0]
    assert block.act == "relu" and block.w.dtype == jnp.bfloat16 and block.b.dtype == jnp.float32
    np.testing.assert_array_equal(block.w, trained["blocks"][0].w)  # bf16 -> f32 -> bf16: exact
    np.testing.assert_array_equal(block.b, trained["blocks"][0].b)
    np.testing.assert_array_equal(restored["head"]["w"], trained["head"]["w"])
    assert int(block.count) == 2  # not synced, so not exported: the template's
    for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(template)):
        assert got.sharding == want.sharding


def test_an_export_of_another_model_is_refused_naming_the_tensor(tmp_path):
    out = _export_of(tmp_path, _model(1))
    wider = _model(1)
    wider["head"]["w"] = jnp.zeros((8, 3))
    with pytest.raises(atoll.ParamsError, match=r"tensor 'head/w' is \(8, 2\) in .*\(8, 3\)"):
        atoll.load_export(out, like=wider)
    more = {**_model(1), "tail": {"w": jnp.zeros(3)}}
    with pytest.raises(atoll.ParamsError, match="holds no tensor 'tail/w'"):
        atoll.load_export(out, like=more)
    fewer = {"blocks": _model(1)["blocks"]}
    with pytest.raises(atoll.ParamsError, match="holds tensor 'head/w' that the template lacks"):
        atoll.load_export(out, like=fewer)
