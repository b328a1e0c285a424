"""The end of an `atoll up` run on real shard processes: the global model is read from
the shard the fragment map names, and a round left open for good (lockstep: every
learner in every round, leases that never lapse) is reported, not waited on."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from syncer_helpers import client_push, syncer_processes

from atoll.cluster import reshard
from atoll.faults.chaos import lockstep_config
from atoll.learner.trainer.model import init_params, preset
from atoll.local.config import UpConfig
from atoll.local.session import evaluate_global
from atoll.wire import codec
from atoll.wire.client import ShardClient
from atoll.wire.plan import FragmentMap, FragmentPlan

# two learners, both needed in every round; fragment 1 moves from shard 1 to shard 0
CFG = lockstep_config(UpConfig(preset="tiny", shards=2, learners=2, fragments=4, eval_batches=2))
WAIT = 2.0  # seconds the read waits for open rounds (a run derives it from its period)


@pytest.fixture
def shards(tmp_path):
    """The run's two `atoll syncer` processes, with the flags `atoll up` gives them."""
    with syncer_processes(tmp_path) as start:
        procs = [
            start(tmp_path / f"shard{i}", *CFG.shard_config(i, tmp_path / f"shard{i}", 0).to_args())
            for i in range(CFG.shards)
        ]
        yield [f"127.0.0.1:{s.port}" for s in procs]


def _push(client: ShardClient, plan: FragmentPlan, p: int, seq: int, base: int) -> None:
    assert client_push(client, p, seq, base, plan).accepted


def test_the_global_model_is_read_through_the_map_and_open_rounds_are_reported(shards):
    plan = FragmentPlan.build(init_params(preset(CFG.preset), CFG.seed), CFG.fragments)
    a, b = ([ShardClient(addr, name) for addr in shards] for name in ("learner-0", "learner-1"))
    try:
        for p, vector in enumerate(plan.flatten(init_params(preset(CFG.preset), CFG.seed))):
            a[p % 2].init(plan, p, codec.encode(vector, codec.Codec.FP32), codec.Codec.FP32)
        # the injected change: fragment 1 moves to shard 0 (map version 1)
        moved, _ = reshard.move(a, FragmentMap.modulo(4, 2), reshard.Move(1, 1, 0))
        assert moved.owners == (0, 0, 0, 1)
        # both learners push fragments 0 and 1 (on shard 0): their rounds close
        for seq, p in enumerate((0, 1), start=1):
            _push(a[0], plan, p, seq, 0)
            _push(b[0], plan, p, seq, 0)
        # then learner-0 pushes fragment 2 and learner-1 fragment 3, and both stop: the
        # rounds wait for the other learner, whose lease (1e9 s) never lapses
        _push(a[0], plan, 2, 3, 0)
        _push(b[1], plan, 3, 3, 0)
    finally:
        for c in a + b:
            c.close()

    result = evaluate_global(CFG, shards, WAIT)

    # read where the map says: fragment 1 from shard 0, which holds its round's close
    # (shard 1, its owner by p mod S, refuses it)
    assert result["versions"] == {0: 1, 1: 1, 2: 0, 3: 0}
    # the rounds still open are reported with the pushes they hold, after the bounded wait
    assert result["open_rounds"] == {2: 1, 3: 1}
    # it waited its WAIT and then stopped: the leases (1e9 s) would have held it for good;
    # the margin is the last Describes' on a loaded host
    assert WAIT <= result["waited_seconds"] < WAIT + 30
    assert np.isfinite(result["eval_loss"]) and result["eval_loss"] > 0

    # a Ctrl-C meanwhile ends the wait at once; the model is read as it is
    ctrl_c = threading.Event()
    ctrl_c.set()
    again = evaluate_global(CFG, shards, 600.0, stop=ctrl_c)
    # one round of Describes, far short of the 600 s it was allowed
    assert again["waited_seconds"] < 30 and again["open_rounds"] == {2: 1, 3: 1}
