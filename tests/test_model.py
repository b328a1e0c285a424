"""Tests for learner/trainer/model.py: shapes, causality, init, the fragment plan, a golden step."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atoll.learner.trainer.model import (
    PRESETS,
    ModelConfig,
    ModelConfigError,
    forward,
    init_params,
    loss_fn,
    preset,
)
from atoll.wire.plan import FragmentPlan, named_leaves

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def params():
    return init_params(TINY, 0)


def fixed_batch(cfg, rows=4):
    """A deterministic (rows, context + 1) batch of byte ids."""
    return (np.arange(rows * (cfg.context + 1)).reshape(rows, -1) * 37 + 11) % cfg.vocab


def test_forward_shape_and_dtype(params):
    tokens_BxL = jnp.asarray(fixed_batch(TINY)[:, :-1], jnp.int32)
    logits_BxLxV = jax.jit(forward, static_argnums=2)(params, tokens_BxL, TINY)
    assert logits_BxLxV.shape == (4, TINY.context, TINY.vocab)
    assert logits_BxLxV.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits_BxLxV)))


def test_params_are_a_nested_float32_dict_with_the_counted_size(params):
    leaves = named_leaves(params)
    assert all(a.dtype == np.float32 for a in leaves.values())
    assert sum(a.size for a in leaves.values()) == TINY.num_params
    assert leaves["embed/tokens"].shape == (TINY.vocab, TINY.d_model)
    assert leaves["head/w"].shape == (TINY.d_model, TINY.vocab)
    assert leaves["blocks/1/mlp/w_in"].shape == (TINY.d_model, TINY.d_ff)


def test_causal_a_future_token_never_changes_earlier_logits(params):
    fwd = jax.jit(forward, static_argnums=2)
    tokens = fixed_batch(TINY, rows=2)[:, :-1].astype(np.int32)
    t = 17
    changed = tokens.copy()
    changed[:, t] = (changed[:, t] + 101) % TINY.vocab
    a, b = np.asarray(fwd(params, tokens, TINY)), np.asarray(fwd(params, changed, TINY))
    np.testing.assert_array_equal(a[:, :t], b[:, :t])
    assert np.abs(a[:, t:] - b[:, t:]).max() > 1e-4  # ...but does change later ones


def test_initial_loss_is_near_uniform(params):
    loss = float(jax.jit(loss_fn, static_argnums=2)(params, fixed_batch(TINY), TINY))
    assert abs(loss - math.log(256)) < 0.1, loss


def test_init_is_deterministic_and_accepts_jax_keys():
    a, b = init_params(TINY, 3), init_params(TINY, jax.random.key(3))
    c, d = init_params(TINY, jax.random.PRNGKey(3)), init_params(TINY, 4)
    for x, y, z, _w in zip(*(jax.tree.leaves(t) for t in (a, b, c, d))):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, z)
    assert not np.array_equal(a["head"]["w"], d["head"]["w"])


@pytest.mark.parametrize("P", [1, 3, 8])
def test_fragment_plan_round_trip(params, P):
    plan = FragmentPlan.build(params, P)
    assert plan.num_params == TINY.num_params
    vectors = plan.flatten(params)
    tree = plan.unflatten(vectors)
    assert jax.tree.structure(tree) == jax.tree.structure(params)
    for (name, x), (_, y) in zip(
        sorted(named_leaves(params).items()), sorted(named_leaves(tree).items())
    ):
        np.testing.assert_array_equal(x, y, err_msg=name)
    # The merge rules the syncer reads from the names: only the token table averages.
    embeddings = {s.name for s in plan.slots if s.spec.embedding}
    assert embeddings == {"embed/tokens"}


def test_fragment_plan_takes_device_arrays(params):
    on_device = jax.device_put(params)
    plan = FragmentPlan.build(on_device, 4)
    for a, b in zip(plan.flatten(on_device), plan.flatten(params)):
        np.testing.assert_array_equal(a, b)


# Golden values of the tiny preset, seed 0, `fixed_batch(TINY)`: the loss at init and
# after one AdamW step (lr 1e-2, no warm-up). Changed model init/architecture on
# purpose? Update GOLDEN with the values the failure prints.
GOLDEN = {"init_loss": 5.555826187133789, "one_step_loss": 5.158759117126465}


def test_golden_one_step_loss(params):
    from atoll.learner.trainer.train import TrainConfig, make_optimizer

    opt = make_optimizer(TrainConfig(peak_lr=1e-2, warmup_steps=0, total_steps=100))
    batch = jnp.asarray(fixed_batch(TINY), jnp.int32)

    @jax.jit
    def one_step(p):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch, TINY)
        updates, _ = opt.update(grads, opt.init(p), p)
        return loss, loss_fn(jax.tree.map(jnp.add, p, updates), batch, TINY)

    init_loss, one_step_loss = (float(x) for x in one_step(params))
    got = {"init_loss": init_loss, "one_step_loss": one_step_loss}
    for k in GOLDEN:
        assert got[k] == pytest.approx(GOLDEN[k], rel=1e-4), (
            f"golden {k} moved: got {got}. Changed model init/architecture on purpose? "
            f"update GOLDEN in tests/test_model.py"
        )
    assert one_step_loss < init_loss


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(d_model=30, n_heads=4), "not a multiple of n_heads"),
        (dict(d_model=36, n_heads=12), "must be even"),
        (dict(vocab=1), "vocab must be at least 2"),
        (dict(n_layers=0), "n_layers must be an int >= 1"),
        (dict(context=2.5), "context must be an int"),
        (dict(compute_dtype="float16"), "compute_dtype must be one of"),
        (dict(init_std=0.0), "init_std must be > 0"),
    ],
)
def test_config_validation_says_how_to_fix(kwargs, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig(**kwargs)


def test_presets_have_the_advertised_sizes():
    sizes = {name: cfg.num_params for name, cfg in PRESETS.items()}
    assert sizes["tiny"] < 100_000
    assert 1_000_000 <= sizes["small"] <= 3_000_000 and PRESETS["small"].context == 128
    assert 20_000_000 <= sizes["base"] <= 50_000_000
    assert sizes["large"] >= 350_000_000
    with pytest.raises(ModelConfigError, match="choose one of tiny, small"):
        preset("huge")


def test_bfloat16_compute_keeps_float32_logits(params):
    cfg = ModelConfig(**{**TINY.__dict__, "compute_dtype": "bfloat16"})
    logits = jax.jit(forward, static_argnums=2)(params, fixed_batch(cfg, 2)[:, :-1], cfg)
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
