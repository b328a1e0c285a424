"""Tests for learner/trainer/train.py: learning, the schedule, swaps, save-resume, devices."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from atoll.learner.trainer.data import Batches, load_corpus, stdlib_dir
from atoll.learner.trainer.model import PRESETS
from atoll.learner.trainer.train import (
    TrainConfig,
    TrainConfigError,
    Trainer,
    evaluate,
    lr_at,
    make_schedule,
)
from atoll.wire.plan import FragmentPlan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = PRESETS["tiny"]
TCFG = TrainConfig(
    batch_size=8, peak_lr=1e-2, warmup_steps=5, total_steps=200, eval_every=10, eval_batches=2
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The stdlib's json package: ~100 KB of real Python."""
    return load_corpus(stdlib_dir() / "json", cache_dir=tmp_path_factory.mktemp("cache"))


def make_trainer(corpus, tcfg=TCFG, **kwargs):
    batches = Batches(corpus.train, context=TINY.context, batch_size=tcfg.batch_size, seed=1)
    return Trainer(TINY, tcfg, batches, heldout=corpus.heldout, **kwargs)


def assert_trees_close(a, b, atol=0.0):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


def test_loss_decreases_and_metrics_add_up(corpus):
    trainer = make_trainer(corpus)
    before = trainer.evaluate()
    metrics = [trainer.step() for _ in range(30)]
    after = trainer.evaluate()
    assert after["loss"] < before["loss"] - 0.7, (before, after)
    assert np.mean([m["loss"] for m in metrics[-5:]]) < metrics[0]["loss"] - 0.7
    assert after["bits_per_byte"] == pytest.approx(after["loss"] / math.log(2))
    last = metrics[-1]
    assert last["step"] == trainer.steps_done == 30
    assert last["tokens"] == 8 * TINY.context and last["tokens_total"] == 30 * last["tokens"]
    assert "eval_loss" in metrics[9] and "eval_loss" not in metrics[10]
    assert last["eval_loss"] == pytest.approx(after["loss"])
    assert [m["lr"] for m in metrics[:6]] == pytest.approx([0, 2e-3, 4e-3, 6e-3, 8e-3, 1e-2])


def test_warmup_cosine_schedule():
    cfg = TrainConfig(peak_lr=1.0, warmup_steps=10, total_steps=110, end_lr_fraction=0.1)
    schedule = make_schedule(cfg)
    expect = {0: 0.0, 5: 0.5, 10: 1.0, 60: 0.55, 110: 0.1, 500: 0.1}
    for step, lr in expect.items():
        assert float(schedule(step)) == pytest.approx(lr, abs=1e-6), step
    for step in range(0, 130, 7):  # the metric's plain-Python copy agrees with optax
        assert lr_at(cfg, step) == pytest.approx(float(schedule(step)), abs=1e-6)


def test_save_resume_continue_equals_straight_run(corpus):
    n = 6
    straight = make_trainer(corpus)
    for _ in range(2 * n):
        straight.step()
    first = make_trainer(corpus)
    for _ in range(n):
        first.step()
    snapshot = first.snapshot()
    resumed = make_trainer(corpus)  # a fresh process would build the same trainer
    resumed.restore(snapshot)
    losses = [resumed.step()["loss"] for _ in range(n)]
    assert resumed.steps_done == 2 * n and resumed.tokens_total == straight.tokens_total
    assert_trees_close(resumed.params, straight.params)  # bit-identical
    assert_trees_close(resumed.opt_state, straight.opt_state)
    assert np.isfinite(losses).all()


def test_restore_refuses_another_model(corpus):
    trainer = make_trainer(corpus)
    snapshot = trainer.snapshot()
    snapshot["model_config"] = {**snapshot["model_config"], "d_model": 64}
    with pytest.raises(ValueError, match="snapshot is of model"):
        trainer.restore(snapshot)


def test_sync_client_swaps_params_through_the_plan(corpus):
    trainer = make_trainer(corpus)
    trainer.step()
    plan = FragmentPlan.build(trainer.params, 4)
    vectors = plan.flatten(trainer.params)
    # One fragment adopted: only its tensors change.
    new = vectors[2] + 1.0
    trainer.set_tensors(plan.unflatten_fragment(2, new))
    after = plan.flatten(trainer.params)
    np.testing.assert_array_equal(after[2], new)
    new += 5.0  # the trainer holds a copy, not a view of the caller's buffer
    np.testing.assert_array_equal(plan.flatten_fragment(trainer.params, 2), after[2])
    for p in (0, 1, 3):
        np.testing.assert_array_equal(after[p], vectors[p])
    # The whole tree from the syncer's vectors.
    trainer.params = plan.unflatten(vectors)
    for a, b in zip(plan.flatten(trainer.params), vectors):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(trainer.step()["loss"])  # the compiled step takes swapped params
    with pytest.raises(KeyError, match="no tensor 'blocks/9/attn/wq'"):
        trainer.set_tensors({"blocks/9/attn/wq": np.zeros((32, 32))})
    with pytest.raises(ValueError, match="shape"):
        trainer.set_tensors({"head/w": np.zeros((3, 3))})
    with pytest.raises(ValueError, match="tree structure"):
        trainer.params = {"head": {"w": np.zeros((32, 256))}}


def test_swapped_params_never_alias_the_callers_buffer(corpus):
    """The CPU client adopts a 64-byte-aligned host array instead of copying it; the
    trainer must copy, or the caller's later writes would reach the model."""
    trainer = make_trainer(corpus)
    plan = FragmentPlan.build(trainer.params, 4)
    size = plan.fragment_sizes[2]
    raw = np.empty(size * 4 + 64, np.uint8)
    aligned = raw[-raw.ctypes.data % 64 :][: size * 4].view(np.float32)
    aligned[:] = plan.flatten_fragment(trainer.params, 2) + 1.0
    expected = aligned.copy()
    trainer.set_tensors(plan.unflatten_fragment(2, aligned))
    aligned += 5.0
    np.testing.assert_array_equal(plan.flatten_fragment(trainer.params, 2), expected)
    vectors = plan.flatten(trainer.params)
    trainer.params = plan.unflatten([aligned if p == 2 else v for p, v in enumerate(vectors)])
    aligned += 5.0
    np.testing.assert_array_equal(plan.flatten_fragment(trainer.params, 2), expected + 5.0)


def test_slowdown_stretches_each_step(corpus):
    trainer = make_trainer(corpus, slowdown=3.0)
    trainer.step()
    m = trainer.step()
    assert m["wall_time_s"] >= 2.9 * m["step_time_s"]
    assert m["tokens_per_s"] == pytest.approx(m["tokens"] / m["wall_time_s"])
    with pytest.raises(TrainConfigError, match="slowdown must be a finite number >= 1"):
        make_trainer(corpus, slowdown=0.5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=0), "batch_size must be an int >= 1"),
        (dict(warmup_steps=100, total_steps=100), "warmup_steps must be in"),
        (dict(peak_lr=0.0), "peak_lr must be a finite number > 0"),
        (dict(b2=1.0), "b1 and b2 must be in"),
        (dict(grad_clip=-1.0), "grad_clip must be >= 0"),
        (dict(eval_every=-1), "eval_every must be an int >= 0"),
        (dict(end_lr_fraction=2.0), "end_lr_fraction must be in"),
    ],
)
def test_config_validation_says_how_to_fix(kwargs, match):
    with pytest.raises(TrainConfigError, match=match):
        TrainConfig(**kwargs)


def test_batch_of_the_wrong_shape_is_refused(corpus):
    batches = Batches(corpus.train, context=TINY.context + 1, batch_size=8)
    trainer = Trainer(TINY, TCFG, batches)
    with pytest.raises(ValueError, match=r"want \(8, 33\)"):
        trainer.step()


# Runs in a fresh process: XLA_FLAGS must be set before jax starts.
_DEVICE_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from atoll.learner.trainer.data import Batches, load_corpus, stdlib_dir
    from atoll.learner.trainer.model import PRESETS
    from atoll.learner.trainer.train import Trainer, TrainConfig, TrainConfigError
    cfg = PRESETS["tiny"]
    tcfg = TrainConfig(**json.loads(sys.argv[2]))
    corpus = load_corpus(stdlib_dir() / "json", cache_dir=sys.argv[1])
    trainer = Trainer(cfg, tcfg, Batches(corpus.train, context=cfg.context, batch_size=8,
                                         seed=1))
    losses = [trainer.step()["loss"] for _ in range(4)]
    leaf = trainer.params["head"]["w"]
    try:
        Trainer(cfg, TrainConfig(batch_size=6), trainer.batches)
        error = None
    except TrainConfigError as e:
        error = str(e)
    print(json.dumps({"devices": jax.device_count(), "losses": losses, "error": error,
                      "param_devices": len(leaf.sharding.device_set)}))
""")


def test_four_host_devices_match_one(corpus, tmp_path):
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": REPO,
    }
    args = [str(tmp_path), json.dumps(dataclasses.asdict(TCFG))]
    proc = subprocess.run(
        [sys.executable, "-c", _DEVICE_SCRIPT, *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4 and out["param_devices"] == 4
    assert "not divisible by the 4 local devices; use a multiple of 4" in out["error"]
    trainer = make_trainer(corpus)
    assert len(jax.devices()) == 1
    losses = [trainer.step()["loss"] for _ in range(4)]
    np.testing.assert_allclose(out["losses"], losses, rtol=1e-5)


def test_evaluate_function_matches_trainer(corpus):
    trainer = make_trainer(corpus)
    got = evaluate(jax.device_get(trainer.params), trainer.eval_set, TINY)
    assert got["loss"] == pytest.approx(trainer.evaluate()["loss"], rel=1e-6)
    assert got["loss"] == pytest.approx(math.log(256), abs=0.1)
