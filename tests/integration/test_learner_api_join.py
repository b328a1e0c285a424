"""atoll.Learner's join and step as a new user meets them, against a real shard (in this
process) or none: a tree changed after join fails at the next step, a join against
shards that never answer ends within its bound, and Ctrl-C during join is one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import atoll
from atoll.server.config import ShardConfig
from atoll.server.service import SyncerServer


def init() -> dict:
    k0, k1 = jax.random.split(jax.random.key(0))
    return {
        "layer0": {"w": jax.random.normal(k0, (8, 16)), "b": jnp.zeros(16)},
        "layer1": {"w": jax.random.normal(k1, (16, 1)), "b": jnp.zeros(1)},
    }


@pytest.fixture
def one_shard(tmp_path):
    server = SyncerServer(
        ShardConfig(shard_index=0, num_shards=1, data_dir=tmp_path / "shard", listen="127.0.0.1:0")
    )
    server.start()
    yield f"127.0.0.1:{server.port}"
    server.stop()


def _shape(p):
    p["layer1"]["w"] = jnp.zeros((16, 2))
    return p


def _dtype(p):
    p["layer0"]["b"] = p["layer0"]["b"].astype(jnp.bfloat16)
    return p


def _structure(p):
    p["layer1"]["extra"] = jnp.zeros(3)
    return p


@pytest.mark.parametrize(
    "change,match",
    [
        (_shape, r"leaf 'layer1/w' is float32\(16, 2\), was float32\(16, 1\)"),
        (_dtype, r"leaf 'layer0/b' is bfloat16\(16,\), was float32\(16,\)"),
        (_structure, r"leaf 'layer1/extra' is new"),
    ],
)
def test_a_tree_changed_after_join_fails_at_the_next_step(one_shard, change, match):
    # H = 64: no fragment is read or written for dozens of steps, yet the change is caught
    with atoll.Learner(one_shard, "a", period=64, fragments=2) as learner:
        params = learner.join(init())
        for _ in range(3):
            params = learner.step(params)
        with pytest.raises(atoll.ParamsError, match=match):
            learner.step(change(params))
        assert learner.steps == 4 and not learner.pushed  # caught before any sync was due
