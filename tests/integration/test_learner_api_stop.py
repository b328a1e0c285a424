"""atoll.Learner's calls for a loop that leaves early, against a real shard: after
`stop()` the next `step` raises Stopped (the step counted, not synced), `save` then
checkpoints there and a restart resumes that step; `pushed` says which steps started a
push; `run_info` keeps a restart from resuming another run's checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
from test_learner_api_shards import OPTIMIZER, batch, init, train_step

import atoll
from atoll.learner.checkpoint import CheckpointError
from atoll.learner.config import LearnerConfig


def _with_run_info(shard, ckpt, run, **settings):
    """Learner "a" checkpointing in `ckpt` with `run_info`: the built-in loop's
    setting, given through its path (Learner.from_config)."""
    cfg = LearnerConfig(
        shards=(shard,), learner_id="a", fragments=2, checkpoint_dir=ckpt, **settings
    )
    return atoll.Learner.from_config(cfg, run_info=run)


def test_a_stopped_learner_raises_at_its_next_step_and_saves_where_it_is(one_shard, tmp_path):
    ckpt = tmp_path / "ckpt"
    run = {"seed": 0, "batch_size": 32}
    learner = _with_run_info(
        one_shard, ckpt, run, sync=atoll.SyncConfig(period=4), checkpoint_every=0
    )
    params = learner.join(init())
    opt_state, rng, pushed = OPTIMIZER.init(params), np.random.default_rng(0), []
    for _ in range(8):
        params, opt_state, _ = train_step(params, opt_state, *batch(rng))
        params = learner.step(params, tokens=32, state=opt_state)
        pushed.append(learner.pushed)
    assert sum(pushed) >= 2, pushed  # each fragment syncs at least once in two periods
    learner.stop()  # as a signal handler would
    params, opt_state, _ = train_step(params, opt_state, *batch(rng))
    with pytest.raises(atoll.Stopped):
        learner.step(params, tokens=32, state=opt_state)
    assert (learner.steps, learner.tokens) == (9, 9 * 32)  # the step is counted
    assert learner.save(params, state=opt_state)
    learner.close()

    other = {**run, "seed": 1}
    with pytest.raises(CheckpointError, match="written with seed=0, this learner runs seed=1"):
        _with_run_info(one_shard, ckpt, other).join(init())
    again = _with_run_info(one_shard, ckpt, run)
    again.join(init(seed=3))
    assert again.resumed and (again.steps, again.tokens) == (9, 9 * 32)
    state = again.restore_state(OPTIMIZER.init(params))
    assert int(state[0].count) == 9  # adam's step count, as saved after the stop
    again.close()


def test_save_without_a_checkpoint_dir_writes_nothing_and_save_before_join_is_refused(one_shard):
    learner = atoll.Learner(one_shard, "b", fragments=2)
    with pytest.raises(atoll.LearnerStateError, match="before join"):
        learner.save(init())
    params = learner.join(init())
    assert learner.save(params) is False and not learner.resumed
    learner.close()
