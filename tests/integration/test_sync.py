"""Learners' sync engine against two real shards: schedule, adoption, bit-exact copies."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest

from atoll.learner.sync import SyncConfig, SyncError, Synchronizer, offsets
from atoll.server.config import ShardConfig
from atoll.server.service import SyncerServer
from atoll.wire import codec
from atoll.wire.client import ShardClient
from atoll.wire.plan import FragmentPlan

RNG = np.random.default_rng(0)
START = {
    "embed": RNG.standard_normal((64, 32)).astype(np.float32),
    "block": {
        "w1": RNG.standard_normal((32, 96)).astype(np.float32),
        "w2": RNG.standard_normal((96, 32)).astype(np.float32),
    },
    "norm": np.ones(32, np.float32),
}
PLAN = FragmentPlan.build(START, 4)


def _copy(tree):
    return {k: _copy(v) if isinstance(v, dict) else v.copy() for k, v in tree.items()}


def _zeros(tree):
    return {k: _zeros(v) if isinstance(v, dict) else np.zeros_like(v) for k, v in tree.items()}


def _toward(tree, target, rate):
    return {
        k: _toward(v, target[k], rate) if isinstance(v, dict) else v - rate * (v - target[k])
        for k, v in tree.items()
    }


@pytest.fixture
def shards(tmp_path):
    servers = [
        SyncerServer(
            ShardConfig(
                shard_index=i,
                num_shards=2,
                data_dir=tmp_path / str(i),
                listen="127.0.0.1:0",
                quorum=2,
                grace_factor=1.0,
                lease_seconds=5,
            )
        )
        for i in range(2)
    ]
    for s in servers:
        s.start()
    yield servers
    for s in servers:
        s.stop()


def _clients(shards, name):
    return [ShardClient(f"127.0.0.1:{s.port}", name) for s in shards]


def _in_threads(fn, n: int, timeout: float) -> None:
    """fn(0) ... fn(n - 1) at once, each in a thread; re-raises the first one's exception."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        for future in [pool.submit(fn, i) for i in range(n)]:
            future.result(timeout=timeout)


def test_offsets_spread_fragments_over_the_period():
    assert offsets(4, 8) == [2, 4, 6, 8]
    assert offsets(3, 2) == [1, 1, 2]
    with pytest.raises(ValueError, match="overlap"):
        SyncConfig(period=4, overlap=4)


def test_two_learners_train_toward_a_target_and_hold_the_published_copy(shards):
    """Each inner step moves a learner's params 5 % of the way to zero; syncing must keep that.
    Steps take at least 5 ms and report what they took, so the shards' cadence is H steps.
    finish() then pushes the tails and adopts their rounds, so the newest version of every
    fragment is held by a learner, which must hold the shard's bytes exactly."""
    cfg = SyncConfig(period=8, overlap=2)
    zeros = _zeros(START)
    results = {}

    def learner(i):
        sync = Synchronizer(cfg, PLAN, _clients(shards, f"l{i}"))
        params = sync.join(_copy(START))
        last = time.perf_counter()
        for step in range(1, 65):
            time.sleep(0.005)
            params = _toward(params, zeros, 0.05)
            now = time.perf_counter()  # the step's real seconds, as the training loop reports them
            updates = sync.after_step(step, params, now - last, 128, final=step == 64)
            params = sync.apply(params, updates)
            last = now
        params = sync.apply(params, sync.finish(64, params, 15.0, tokens_per_step=128))
        results[i] = (
            dict(sync.stats),
            sync.versions(),
            [f.base.copy() for f in sync.frags],
            params,
        )
        sync.close()

    _in_threads(learner, 2, timeout=60)
    assert len(results) == 2

    for stats, versions, _bases, params in results.values():
        # 64 steps, H=8: a fragment pushes once per cadence (H steps, give or take the one
        # nearest the due time: at most 1 + 64/7 per fragment) and once more for its tail in
        # finish(), and its rounds merge both learners
        assert 4 * 3 <= stats["pushes"] <= 4 * 11 and stats["refused"] == 0
        assert stats["adopted"] >= stats["pushes"] - 4
        assert all(adopted >= 3 for adopted, _ in versions.values())
        # 4-bit frames: a push is at most ~4.5 bits per parameter plus a 16-byte header
        assert stats["bytes_sent"] - 4 * PLAN.num_params <= stats["pushes"] * (
            PLAN.num_params / 4 * 4.5 / 8 + 64
        )
        # the model moved toward the targets (all zeros) from |N(0,1)| ≈ 0.8
        assert float(np.abs(params["block"]["w1"]).mean()) < 0.4

    for p in range(PLAN.num_fragments):
        client = ShardClient(f"127.0.0.1:{shards[p % 2].port}", "check")
        pulled = client.pull(p)
        client.close()
        snapshot = codec.decode(pulled.frames[0][2])
        held = [
            bases[p]
            for _, versions, bases, _ in results.values()
            if versions[p][0] == pulled.version
        ]
        assert held, f"fragment {p}: no learner adopted its newest version {pulled.version}"
        for base in held:  # a learner at version v holds v's bytes exactly
            assert snapshot.tobytes() == base.tobytes()


def test_a_learner_with_another_plan_is_refused(shards):
    first = Synchronizer(SyncConfig(), PLAN, _clients(shards, "a"))
    first.join(_copy(START))
    first.close()
    other = FragmentPlan.build(START, 2)
    second = Synchronizer(SyncConfig(), other, _clients(shards, "b"))
    with pytest.raises(SyncError, match="plan"):
        second.join(_copy(START))
    second.close()
    swapped = Synchronizer(SyncConfig(), PLAN, list(reversed(_clients(shards, "c"))))
    with pytest.raises(SyncError, match="index order"):
        swapped.check_shards()
    swapped.close()


def test_a_learner_does_not_wait_forever_on_a_round_that_cannot_close(shards):
    """Quorum 2; learner b is live (its Watch keeps its lease) but never pushes, so a's
    rounds never close. a waits `patience`, then trains on, and at its next push (refused:
    it is still in the open round) resyncs to the global weights."""
    cfg = SyncConfig(period=4, overlap=1, patience=1.0)
    a = Synchronizer(cfg, PLAN, _clients(shards, "a"))
    b = Synchronizer(cfg, PLAN, _clients(shards, "b"))
    params = a.join(_copy(START))
    b.join(_copy(START))
    zeros = _zeros(START)
    for step in range(1, 41):  # ten periods: every fragment is due again while stuck
        time.sleep(0.002)
        params = _toward(params, zeros, 0.05)
        params = a.apply(params, a.after_step(step, params, 0.002, 64))
    stats = dict(a.stats)
    a.close()
    b.close()
    assert stats["stalled"] >= PLAN.num_fragments  # each fragment gave up on its first round
    assert stats["resyncs"] >= 1  # and the next push found a still in that round
    assert stats["pushes"] >= 2 * PLAN.num_fragments  # training went on past the stuck rounds


def test_at_the_end_every_step_reaches_the_shards(shards):
    """finish() pushes each fragment's steps since its last push: the global model holds the
    run's tail, which the schedule alone would leave on the learners."""
    cfg = SyncConfig(period=8, overlap=1)
    zeros = _zeros(START)
    pushes: dict[int, list[dict]] = {0: [], 1: []}
    done = {}

    def learner(i):
        sync = Synchronizer(cfg, PLAN, _clients(shards, f"l{i}"), on_push=pushes[i].append)
        params = sync.join(_copy(START))
        last = time.perf_counter()
        # 20 steps, H = 8: a schedule alone leaves some of each fragment's steps unpushed
        for step in range(1, 21):
            time.sleep(0.005)
            params = _toward(params, zeros, 0.05)
            now = time.perf_counter()
            # a push the last step starts is marked last too: nobody waits for more from it
            updates = sync.after_step(step, params, now - last, 128, final=step == 20)
            params = sync.apply(params, updates)
            last = now
        params = sync.apply(params, sync.finish(20, params, 15.0, tokens_per_step=128))
        done[i] = sync.versions()
        sync.close()

    _in_threads(learner, 2, timeout=60)
    assert len(done) == 2
    for i, log in pushes.items():
        for p in range(PLAN.num_fragments):
            mine = [r for r in log if r["fragment"] == p]
            assert all(r["accepted"] for r in mine), mine
            assert sum(r["steps"] for r in mine) == 20, (  # every step, once
                i,
                p,
                [(r["seq"], r["steps"], r["base_version"], r["merged_in"]) for r in mine],
                [
                    (r["seq"], r["steps"], r["base_version"], r["merged_in"])
                    for r in pushes[1 - i]
                    if r["fragment"] == p
                ],
            )
        # the round holding each last push closed (the other learner's last push is not
        # waited for) and the learner adopted it before finish() returned
        assert all(
            adopted >= max(r["merged_in"] for r in log if r["fragment"] == p)
            for p, (adopted, _) in done[i].items()
        )
