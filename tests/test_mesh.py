"""learner/trainer/mesh.py: which leaves FSDP splits and how; and a Trainer whose params are split
over 4 host devices follows the replicated trajectory, its AdamW state split alike."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from atoll.learner.trainer.mesh import (
    FSDP_AXIS,
    MIN_SPLIT,
    MeshError,
    island_mesh,
    leaf_spec,
    placement,
    split_count,
)
from atoll.learner.trainer.model import PRESETS, init_params

REPO = str(pathlib.Path(__file__).resolve().parents[1])


@pytest.mark.parametrize(
    "shape, ways, spec",
    [
        ((64, 32), 4, P(FSDP_AXIS)),  # the first dimension 4 divides
        ((6, 256), 4, P(None, FSDP_AXIS)),  # 6 rows do not split 4 ways: the columns do
        ((6, 10), 4, P()),  # no dimension 4 divides: replicated
        ((4 * MIN_SPLIT - 4,), 4, P()),  # under MIN_SPLIT values a device: replicated
        ((4 * MIN_SPLIT,), 4, P(FSDP_AXIS)),
        ((64, 32), 1, P()),  # fsdp 1: everything replicated
        ((), 4, P()),  # a scalar
    ],
)
def test_leaf_spec(shape, ways, spec):
    assert leaf_spec(shape, ways) == spec


def test_an_fsdp_the_devices_cannot_take_says_which_would():
    with pytest.raises(
        MeshError, match=r"--fsdp 2 does not divide the island's 1 devices: use one of 1"
    ):
        island_mesh(fsdp=2)
    with pytest.raises(MeshError, match="--fsdp -1"):
        island_mesh(fsdp=-1)
    assert dict(island_mesh(fsdp=0).shape) == {"data": 1}, "all of 1 device: replicated"


def test_the_tiny_model_splits_its_matrices_and_keeps_its_norm_scales_whole():
    params = init_params(PRESETS["tiny"], 0)
    mesh = island_mesh(fsdp=1)
    assert split_count(placement(params, mesh)) == (0, 19)
    shapes = {k: np.shape(v) for k, v in params["blocks"]["0"]["attn"].items()}
    assert all(leaf_spec(s, 4) == P(FSDP_AXIS) for s in shapes.values())
    assert leaf_spec(np.shape(params["final_norm"]["scale"]), 4) == P()


# Runs in a fresh process: XLA_FLAGS must be set before jax starts.
_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    import numpy as np
    from atoll.learner.trainer.data import Batches, load_corpus, stdlib_dir
    from atoll.learner.trainer.mesh import split_count
    from atoll.learner.trainer.model import PRESETS
    from atoll.learner.trainer.train import Trainer, TrainConfig
    cfg = PRESETS["tiny"]
    corpus = load_corpus(stdlib_dir() / "json", cache_dir=sys.argv[1])
    out = {}
    for fsdp in (1, 2, 0):
        batches = Batches(corpus.train, context=cfg.context, batch_size=8, seed=1)
        t = Trainer(cfg, TrainConfig(batch_size=8, warmup_steps=2, total_steps=20), batches,
                    heldout=corpus.heldout,
                    fsdp=fsdp)
        losses = [t.step()["loss"] for _ in range(4)]
        wq = t.params["blocks"]["0"]["attn"]["wq"]
        adam = t.opt_state[1][0]
        t.set_tensors({"blocks/0/attn/wq": np.zeros(wq.shape, np.float32)})
        t.restore(t.snapshot())
        out[fsdp] = {
            "mesh": dict(t.mesh.shape),
            "split": split_count(t.placement),
            "losses": losses,
            "wq": str(wq.sharding.spec),
            "wq_shard": list(wq.addressable_shards[0].data.shape),
            "mu": str(adam.mu["blocks"]["0"]["attn"]["wq"].sharding.spec),
            "scale": str(t.params["final_norm"]["scale"].sharding.spec),
            "after_set": str(t.params["blocks"]["0"]["attn"]["wq"].sharding.spec),
            "after_restore": str(t.opt_state[1][0].mu["head"]["w"].sharding.spec),
            "eval": t.evaluate()["loss"],
        }
    print(json.dumps(out))
""")


def test_a_trainer_split_over_four_devices_follows_the_replicated_one(tmp_path):
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": REPO,
    }
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    one, two, four = out["1"], out["2"], out["0"]
    assert one["mesh"] == {"data": 4} and one["split"][0] == 0 and one["wq"] == "P()"
    assert two["mesh"] == {"data": 2, "fsdp": 2} and four["mesh"] == {"data": 1, "fsdp": 4}
    for split, ways in ((two, 2), (four, 4)):
        assert split["split"] == [14, 19], "every matrix split, the 5 norm scales whole"
        assert split["wq"] == split["mu"] == "P('fsdp',)", "AdamW's state alike"
        assert split["wq_shard"] == [32 // ways, 32]
        assert split["scale"] == "P()"
        assert split["after_set"] == split["wq"], "a tensor set keeps its place"
        assert split["after_restore"] == "P('fsdp',)", "a restore keeps it too"
        # the same steps; sums over a split dimension may add in another order
        np.testing.assert_allclose(split["losses"], one["losses"], rtol=1e-5)
        assert split["eval"] == pytest.approx(one["eval"], rel=1e-5)
