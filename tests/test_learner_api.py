"""atoll.Learner without shards: its settings, the order of its calls, and how a params
pytree becomes fragments (learner/pytree.py). Against real shards:
tests/integration/test_learner_api_shards.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import atoll
from atoll.learner.pytree import ParamsError, TreeLayout, leaf_name
from atoll.learner.sync import plan_difference
from atoll.wire.plan import FragmentPlan

PARAMS = {"w1": jnp.ones((4, 8)), "b1": jnp.zeros(8), "w2": jnp.ones((8, 2)), "b2": jnp.zeros(2)}


def test_import_atoll_is_light_and_exports_the_api():
    code = (
        "import sys, atoll; assert 'jax' not in sys.modules, 'import atoll pulled in jax'; "
        "assert atoll.Learner.__module__ == 'atoll.learner.api'; "
        "assert all(getattr(atoll, n) is not None for n in atoll.__all__); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
    assert set(atoll.__all__) == set(atoll.learner.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Lerner'"):
        atoll.Lerner  # noqa: B018


def test_every_error_join_promises_is_exported():
    from atoll.learner import checkpoint

    # join's docstring names CheckpointError: a user must be able to catch it by name
    assert "CheckpointError" in atoll.__all__
    assert atoll.CheckpointError is checkpoint.CheckpointError
    assert issubclass(atoll.CheckpointError, ValueError)
    raises = atoll.Learner.join.__doc__.split("Raises:")[1]
    named = {line.split(":")[0].split()[0] for line in raises.splitlines() if ":" in line}
    named -= {"KeyboardInterrupt"}  # a builtin
    assert named <= set(atoll.__all__), named - set(atoll.__all__)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(shards="", learner_id="a"), "names no shard"),
        (dict(shards="localhost", learner_id="a"), "HOST:PORT"),
        (dict(shards="h-{i}:7070", learner_id="a"), "give --num-shards"),
        (dict(shards=[b"h:1"], learner_id="a"), "list of 'host:port' str"),
        (dict(shards="h:1", learner_id=""), "learner_id"),
        (dict(shards="h:1,h:2,h:3", learner_id="a", fragments=2), "at least the number of shards"),
        (dict(shards="h:1", learner_id="a", index=2, num_learners=2), "index"),
        (dict(shards="h:1", learner_id="a", tls="ca.pem"), "TlsFiles"),
    ],
)
def test_a_setting_that_cannot_work_is_refused_at_construction(kwargs, match):
    with pytest.raises(atoll.LearnerConfigError, match=match):
        atoll.Learner(**kwargs)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(period=0), r"^period \(H\) must be at least 1, got 0$"),
        (dict(period=4, overlap=4), r"^overlap \(τ\) must be in \[0, H=4\), got 4"),
        (dict(mix=1.0), r"^mix \(α\) must be in \[0, 1\), got 1.0$"),
        (dict(late_mix=-0.1), r"^late_mix must be in \[0, 1\)"),
        (dict(codec="int8"), r"^codec 'int8': want one of fp32, mxfp4, int4$"),
        (dict(patience=0), r"^patience must be > 0 seconds, got 0$"),
        (dict(join_timeout=-1.0), r"^join_timeout must be > 0 seconds"),
        (dict(deadline=0), r"^deadline must be > 0 seconds, got 0$"),
        (dict(period="64"), r"^period must be an int, got '64'$"),
        (dict(mix=True), r"^mix must be a float, got True$"),
        (dict(wait_for_rounds="yes"), r"^wait_for_rounds must be a bool, got 'yes'$"),
    ],
)
def test_sync_settings_that_cannot_work_are_refused_by_sync_config_naming_the_field(fields, match):
    with pytest.raises(atoll.LearnerConfigError, match=match):
        atoll.SyncConfig(**fields)


@pytest.mark.parametrize(
    "args, match",
    [
        ((7,), r"^Checkpointing.directory must be a path, got 7$"),
        (("{tmp}/file",), r"^Checkpointing.directory .*/file: not a directory$"),
        (("{tmp}/file/sub",), r"cannot be made: .*/file is not a directory$"),
        (("{tmp}", -1), r"^Checkpointing.every must be >= 0 steps, got -1$"),
        (("{tmp}", 2.5), r"^Checkpointing.every must be an int, got 2.5$"),
        (("{tmp}", 10, "yes"), r"^Checkpointing.standby must be a bool, got 'yes'$"),
    ],
)
def test_checkpoint_settings_that_cannot_work_are_refused_by_checkpointing(tmp_path, args, match):
    (tmp_path / "file").write_text("")
    args = tuple(a.format(tmp=tmp_path) if isinstance(a, str) else a for a in args)
    with pytest.raises(atoll.LearnerConfigError, match=match):
        atoll.Checkpointing(*args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sync={"period": 64}), r"^sync must be an atoll.SyncConfig, got dict: e.g."),
        (dict(sync=64), r"^sync must be an atoll.SyncConfig, got int"),
        (dict(checkpoint="ckpt/"), r"^checkpoint must be an atoll.Checkpointing or None, got str"),
        (dict(checkpoint=atoll.SyncConfig()), r"Checkpointing or None, got SyncConfig"),
    ],
)
def test_sync_and_checkpoint_of_another_type_are_refused_saying_what_to_pass(kwargs, match):
    with pytest.raises(TypeError, match=match):
        atoll.Learner("h:1", "a", **kwargs)


def test_the_short_form_takes_every_default_and_the_objects_as_given(tmp_path):
    learner = atoll.Learner("h:1", "a")
    assert learner.sync_config == atoll.SyncConfig() and learner.checkpointing is None
    assert (learner.fragments, learner.index, learner.num_learners) == (4, 0, 1)
    sync = atoll.SyncConfig(period=64, overlap=2, codec="fp32")
    ckpt = atoll.Checkpointing(tmp_path / "ckpt", every=10, standby=True)
    learner = atoll.Learner("h:1", "a", sync=sync, checkpoint=ckpt)
    assert learner.sync_config is sync and sync.codec == atoll.Codec.FP32
    assert learner.checkpointing is ckpt and ckpt.directory == tmp_path / "ckpt"
    assert atoll.Checkpointing(str(tmp_path)).every == 50


def test_only_the_built_in_loop_passes_its_hooks():
    import inspect

    public = set(inspect.signature(atoll.Learner).parameters)
    assert not public & {"on_push", "claim_id", "run_info"}, public
    assert len(public) <= 12, f"{len(public)} parameters: group new settings in a config"
    hooks = set(inspect.signature(atoll.Learner.from_config).parameters)
    assert {"on_push", "claim_id", "run_info"} <= hooks


def test_from_config_gives_atoll_learners_settings_as_the_config_objects(tmp_path):
    from atoll.learner.config import LearnerConfig

    cfg = LearnerConfig(
        shards=("h:1", "h:2"),
        learner_id="a",
        sync=atoll.SyncConfig(period=8, overlap=2, deadline=5.0),
        checkpoint_dir=tmp_path,
        checkpoint_every=3,
        standby=True,
        learner_index=1,
        num_learners=2,
    )
    learner = atoll.Learner.from_config(cfg)
    assert learner.sync_config is cfg.sync and learner.checkpointing is cfg.checkpoint
    assert (learner.sync_config.period, learner.sync_config.deadline) == (8, 5.0)
    assert learner.checkpointing == atoll.Checkpointing(tmp_path, every=3, standby=True)
    assert (learner.index, learner.num_learners, learner.fragments) == (1, 2, 4)
    assert (
        atoll.Learner.from_config(
            dataclasses.replace(cfg, checkpoint_dir=None, standby=False)
        ).checkpointing
        is None
    )


def test_from_config_checks_each_setting_once(tmp_path, monkeypatch):
    """H (SyncConfig), the steps between checkpoints (Checkpointing), the data shard and
    the learner count (LearnerConfig): each checked when the config is made, and the
    Learner made of it takes them as they are."""
    from atoll.learner import arguments
    from atoll.learner.config import Checkpointing, LearnerConfig
    from atoll.learner.defaults import SyncConfig

    checks: list[str] = []
    for cls in (SyncConfig, Checkpointing):
        made = cls.__post_init__
        monkeypatch.setattr(
            cls,
            "__post_init__",
            lambda self, made=made: (checks.append(type(self).__name__), made(self))[1],
        )
    monkeypatch.setattr(arguments, "check", lambda **_: checks.append("Learner"))
    cfg = LearnerConfig(
        shards=("h:1",), learner_id="a", checkpoint_dir=tmp_path, learner_index=1, num_learners=2
    )
    assert checks == ["SyncConfig", "Checkpointing"]
    learner = atoll.Learner.from_config(cfg)
    assert checks == ["SyncConfig", "Checkpointing"], "checked again"
    assert (learner.index, learner.num_learners, learner.addresses) == (1, 2, ("h:1",))
    assert learner.resumed_checkpoint is None and not learner.resumed


def test_settings_by_name_and_pattern():
    learner = atoll.Learner("h-{i}:7070", "a", num_shards=2)
    assert learner.addresses == ("h-0:7070", "h-1:7070") and learner.pattern == "h-{i}:7070"
    assert atoll.Learner(["h:1", "h:2"], "a").addresses == ("h:1", "h:2")


def test_calls_out_of_order_say_what_to_call():
    learner = atoll.Learner("h:1", "a")
    with pytest.raises(atoll.LearnerStateError, match=r"step\(\) before join\(\)"):
        learner.step(PARAMS)
    with pytest.raises(atoll.LearnerStateError, match=r"finish\(\) before join\(\)"):
        learner.finish(PARAMS)
    with pytest.raises(atoll.LearnerStateError, match="before restore_state"):
        learner.restore_state({})
    with pytest.raises(atoll.LearnerStateError, match="call join first"):
        learner.plan  # noqa: B018
    learner.close()
    learner.close()  # twice is fine
    with pytest.raises(atoll.LearnerStateError, match=r"join\(\) after close\(\)"):
        learner.join(PARAMS)


def test_a_failed_join_says_why_on_every_later_call():
    learner = atoll.Learner("h:1", "a")
    with pytest.raises(ParamsError, match="no float arrays"):
        learner.join({"step": jnp.array(0)})
    with pytest.raises(atoll.LearnerStateError, match="join failed: ParamsError"):
        learner.step(PARAMS)


# --- the tree ---


def test_leaves_are_named_by_their_path_and_only_float_leaves_are_synced():
    tree = {
        "blocks": [{"w": jnp.ones((3, 2))}, {"w": jnp.ones((3, 2), jnp.bfloat16)}],
        "step": jnp.array(3),
        "key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(0),
        "mask": np.ones(4, bool),
        "empty": jnp.zeros((0, 4)),
        "scale": np.float32(2.0),
    }
    layout = TreeLayout(tree, 2)
    assert [s.name for s in layout.plan.slots] == ["blocks/0/w", "blocks/1/w", "scale"]
    assert set(layout.unsynced) == {"step", "key", "raw_key", "mask", "empty"}
    assert leaf_name(()) == "params"


def test_layout_reads_and_writes_fragments_keeping_dtypes_and_types():
    tree = {"a": jnp.arange(6.0).reshape(2, 3).astype(jnp.bfloat16), "b": np.ones(3, np.float32)}
    tree["n"] = jnp.array(7)
    layout = TreeLayout(tree, 1)
    leaves = layout.leaves(tree)
    vector = layout.read(leaves, 0)
    assert vector.dtype == np.float32 and vector.tolist() == [0, 1, 2, 3, 4, 5, 1, 1, 1]
    out = layout.write(leaves, {0: vector + 1})
    assert out["a"].dtype == jnp.bfloat16 and isinstance(out["a"], jax.Array)
    assert isinstance(out["b"], np.ndarray) and out["b"].tolist() == [2, 2, 2]
    assert out["n"] is tree["n"]  # left out of the plan: the same object
    np.testing.assert_array_equal(
        np.asarray(out["a"], np.float32), np.arange(1.0, 7.0).reshape(2, 3)
    )


@pytest.mark.parametrize(
    "tree, fragments, match",
    [
        ({"w": jnp.ones(3), "lr": 0.1}, 1, "leaf 'lr' is a float, not an array"),
        ({"w": jnp.ones(3), "z": jnp.ones(2, jnp.complex64)}, 1, "complex"),
        ({"w": jnp.ones(3), "a/b": jnp.ones(2)}, 1, "key 'a/b'.*rename it"),
        ({"w": jnp.ones(3), "": jnp.ones(2)}, 1, "key ''.*non-empty"),
        ((jnp.ones(3), {"0": jnp.ones(2)}, [jnp.ones(1)]), 1, None),
        ({"n": jnp.array(1)}, 1, "no float arrays to sync"),
        ({"w": jnp.ones(3)}, 2, r"fragments=2: .*use num_fragments <= 1"),
    ],
)
def test_a_tree_that_cannot_be_synced_is_refused_naming_the_leaf(tree, fragments, match):
    if match is None:  # tuple and dict keys that name alike: "0/0"... all distinct here
        assert len(TreeLayout(tree, fragments).plan.slots) == 3
        return
    with pytest.raises(ParamsError, match=match):
        TreeLayout(tree, fragments)


def test_two_leaves_named_alike_are_refused():
    class Pair:  # a pytree node whose two children have one name
        def __init__(self, a, b):
            self.a, self.b = a, b

    jax.tree_util.register_pytree_with_keys(
        Pair,
        lambda p: (
            ((jax.tree_util.GetAttrKey("x"), p.a), (jax.tree_util.GetAttrKey("x"), p.b)),
            None,
        ),
        lambda _, children: Pair(*children),
    )
    with pytest.raises(ParamsError, match="both named 'x'"):
        TreeLayout(Pair(jnp.ones(2), jnp.ones(3)), 1)


@pytest.mark.parametrize(
    "changed, match",
    [
        ({**PARAMS, "b1": jnp.zeros(9)}, r"leaf 'b1' is float32\(9,\), was float32\(8,\)"),
        ({**PARAMS, "b1": jnp.zeros(8, jnp.bfloat16)}, r"leaf 'b1' is bfloat16\(8,\)"),
        ({k: v for k, v in PARAMS.items() if k != "b2"}, "leaf 'b2' is missing"),
        ({**PARAMS, "b0": jnp.zeros(1)}, "leaf 'b0' is new"),
        ({**PARAMS, "w3": jnp.zeros(1)}, "leaf 'w3' is new"),
        ([PARAMS[k] for k in sorted(PARAMS)], "leaf 'b1' is missing"),
    ],
)
def test_a_tree_unlike_the_joined_one_is_refused_naming_the_first_leaf(changed, match):
    layout = TreeLayout(PARAMS, 2)
    with pytest.raises(ParamsError, match=match):
        layout.leaves(changed, "params given to step()")


def test_a_tree_of_another_kind_with_the_same_names_is_refused():
    from collections import OrderedDict

    layout = TreeLayout(PARAMS, 2)
    with pytest.raises(ParamsError, match="same kind of tree"):
        layout.leaves(OrderedDict(sorted(PARAMS.items())))


def test_plan_difference_names_the_first_tensor_that_differs():
    plan = FragmentPlan.build({"a": np.zeros(4), "b": np.zeros(2), "embed": np.zeros(3)}, 2)
    run = {s.name: (s.spec.shape, s.spec.embedding, s.fragment) for s in plan.slots}
    assert "'b' has shape (2,) here, (5,)" in plan_difference(
        {**run, "b": ((5,), False, 1)}, 2, plan
    )
    assert "'a0' (1,) is in the run" in plan_difference({**run, "a0": ((1,), False, 0)}, 2, plan)
    less = {k: v for k, v in run.items() if k != "b"}
    assert "'b' (2,) is in this learner's params, not in the run" in plan_difference(less, 2, plan)
    assert "embedding" in plan_difference({**run, "embed": ((3,), False, 1)}, 2, plan)
    assert "the run has 3 fragments" in plan_difference(run, 3, plan)
    # a shard that did not answer: its fragment's tensors are not called missing
    only_0 = {k: v for k, v in run.items() if v[2] == 0}
    assert plan_difference(only_0, 2, plan) == "model or fragment count differ"


def test_sharded_leaves_keep_their_sharding_when_written():
    """Two CPU devices in a child process: a leaf split over both stays split."""
    code = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from atoll.learner.pytree import TreeLayout
assert len(jax.devices()) == 2
mesh = Mesh(np.array(jax.devices()), ("x",))
split = NamedSharding(mesh, P("x"))
tree = {"w": jax.device_put(jnp.arange(8.0).reshape(4, 2), split), "b": jnp.ones(3)}
layout = TreeLayout(tree, 2)
leaves = layout.leaves(tree)
vectors = {p: layout.read(leaves, p) + 1 for p in range(2)}
out = layout.write(leaves, vectors)
assert out["w"].sharding == split, out["w"].sharding
assert len(out["w"].addressable_shards) == 2
np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(1.0, 9.0).reshape(4, 2))
print("ok")
"""
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    import os

    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert out.stdout.strip() == "ok", out.stderr
