"""Units of `atoll chaos`: the failure schedule, the lockstep settings, uptime, and the
acknowledgement audit against a real shard's log and snapshots."""

from __future__ import annotations

import io
import math
import signal
import types

import numpy as np
import pytest

from atoll.faults.chaos import ChaosConfig, ChaosConfigError, _uptime, lockstep_config
from atoll.faults.chaos_session import ChaosSession, FailureSchedule
from atoll.local.config import UpConfig
from atoll.server.audit import durable_pushes, lost_acks
from atoll.server.config import ShardConfig
from atoll.server.shard import PushHeader, Shard
from atoll.wire import codec
from atoll.wire.plan import FragmentPlan


def test_schedule_is_the_same_for_one_seed_and_poisson_on_average():
    a, b = FailureSchedule(7, 3, 10.0), FailureSchedule(7, 3, 10.0)
    times_a = [t for t in range(0, 2000) if a.due(1, t / 2)]
    times_b = [t for t in range(0, 2000) if b.due(1, t / 2)]
    assert times_a == times_b and times_a
    other = FailureSchedule(8, 3, 10.0)
    assert [t for t in range(0, 2000) if other.due(1, t / 2)] != times_a
    # ~1000 s at a 10 s mean: about 100 kills (a 0.5 s tick merges the rare close pairs)
    assert 70 <= len(times_a) <= 130


def test_schedule_fires_once_for_kills_that_passed_together():
    s = FailureSchedule(0, 1, 1.0)
    assert s.due(0, 1000.0)  # many kill times passed while the learner was down: one kill
    assert not s.due(0, 1000.0)


def test_lockstep_waits_for_every_learner():
    cfg = lockstep_config(UpConfig(learners=4, preset="tiny"))
    assert cfg.quorum == 4 and cfg.grace_factor == 0
    assert cfg.lease_seconds >= 1e6 and cfg.sync_patience >= 1e6


class KillOnceAt:
    """A failure schedule with set kill times: learner i is due once, from times[i] on."""

    def __init__(self, times: list[float]):
        self.times = list(times)

    def due(self, learner: int, elapsed: float) -> bool:
        if elapsed < self.times[learner]:
            return False
        self.times[learner] = math.inf
        return True


class FakeLearner:
    """What the injector touches of a learner process: alive, killed with a signal, restarted."""

    def __init__(self, name: str):
        self.name, self.state, self.finished, self.signals, self.starts = (
            name,
            "training",
            False,
            [],
            0,
        )
        self.status = types.SimpleNamespace(last={"step": 10}, poll=lambda: None)
        self.proc = types.SimpleNamespace(send_signal=self.signals.append, wait=lambda: 0)

    def alive(self) -> bool:
        return not self.signals

    def update(self) -> None:
        pass

    def start(self, _pids) -> None:
        self.signals.clear()
        self.starts += 1


@pytest.mark.parametrize("restart_all", [False, True])
def test_a_kill_takes_one_learner_down_or_with_checkpoint_restart_all(tmp_path, restart_all):
    chaos = ChaosConfig(mtbf=1e9, restart_delay=1.0, shard_kill_at=(), lockstep_restart=True)
    session = ChaosSession(
        UpConfig(learners=3, preset="tiny"),
        chaos,
        tmp_path,
        io.StringIO(),
        inject=True,
        restart_all=restart_all,
    )
    session.learners = [FakeLearner(f"learner-{i}") for i in range(3)]
    session.schedule = KillOnceAt([5.0, math.inf, math.inf])  # learner-0 fails 5 s in
    session.t0 = 1000.0
    session.inject_failures(1004.0)
    assert all(l.alive() for l in session.learners)
    session.inject_failures(1005.5)
    down = [l.name for l in session.learners if not l.alive()]
    # the atoll run passes restart_all=False even when the command asked for lockstep restarts
    assert down == (["learner-0", "learner-1", "learner-2"] if restart_all else ["learner-0"])
    assert all(l.signals == [signal.SIGKILL] for l in session.learners if not l.alive())
    # the restart delay has passed: every killed learner is started again
    session.inject_failures(1006.6)
    assert all(l.alive() for l in session.learners)
    assert [l.starts for l in session.learners] == ([1, 1, 1] if restart_all else [1, 0, 0])


def test_config_errors_say_what_to_fix():
    with pytest.raises(ChaosConfigError, match="--mtbf"):
        ChaosConfig(mtbf=0)
    with pytest.raises(ChaosConfigError, match="--duration"):
        ChaosConfig(duration=float("nan"))
    with pytest.raises(ChaosConfigError, match="--shard-kill-at"):
        ChaosConfig(shard_kill_at=(-1.0,))
    with pytest.raises(ChaosConfigError, match="--no-failure-free"):
        ChaosConfig(atoll=False)  # the failure-free run compares against the atoll run
    with pytest.raises(ChaosConfigError, match="--no-lockstep"):
        ChaosConfig(atoll=False, lockstep=False, failure_free=False)  # no run at all
    assert not ChaosConfig(atoll=False, failure_free=False).atoll


def test_uptime_counts_windows_in_which_versions_advanced():
    # versions grow for 10 s, stall for 10 s, grow again for 10 s
    samples = [(t, t if t < 10 else 10 if t < 20 else t - 10) for t in range(0, 31)]
    assert _uptime(samples, 0.0, 30.0, 5.0) == pytest.approx(4 / 6)
    assert _uptime(samples, 10.0, 20.0, 5.0) == 0.0
    assert _uptime([], 0.0, 30.0, 5.0) == 0.0


def _plan() -> FragmentPlan:
    rng = np.random.default_rng(0)
    return FragmentPlan.build(
        {
            "a": rng.standard_normal((8, 8)).astype(np.float32),
            "b": rng.standard_normal(16).astype(np.float32),
        },
        2,
    )


def test_audit_finds_acknowledged_pushes_in_log_and_snapshot(tmp_path):
    plan = _plan()
    shard = Shard(
        ShardConfig(shard_index=0, num_shards=1, data_dir=tmp_path, quorum=1, snapshot_every=2)
    )
    shard.recover()
    size = plan.fragment_sizes[0]
    shard.init(
        "x",
        0,
        plan.fingerprint,
        plan.to_json(),
        codec.encode(np.zeros(size, np.float32), codec.Codec.FP32),
        codec.Codec.FP32,
        size,
    )
    acks = []
    for seq in range(1, 8):  # quorum 1: every push closes a round; a snapshot every 2 rounds
        h = PushHeader(
            learner_id="x",
            fragment=0,
            base_version=seq - 1,
            seq=seq,
            inner_steps=1,
            tokens=1,
            codec=int(codec.Codec.INT4),
            num_params=size,
            plan_fingerprint=plan.fingerprint,
        )
        answer = shard.push(h, codec.encode(np.full(size, 0.01, np.float32)))
        assert answer.accepted
        acks.append({"learner": "x", "fragment": 0, "seq": seq, "accepted": True})
    shard.close()
    durable = durable_pushes(tmp_path)
    assert durable[("x", 0)].snapshot_seq >= 2  # some pushes now live only in a snapshot
    assert lost_acks(acks, durable) == []
    # an acknowledgement the shard never gave is found missing: the audit can fail
    ghost = {"learner": "y", "fragment": 0, "seq": 3, "accepted": True}
    refused = {"learner": "x", "fragment": 0, "seq": 99, "accepted": False}
    unlogged = {
        "learner": "x",
        "fragment": 0,
        "seq": 8,
        "accepted": True,
    }  # newer than anything held
    assert lost_acks(acks + [ghost, refused, unlogged], durable) == [ghost, unlogged]


class FakeShard:
    """What the injector touches of a shard process: killed, restarted, serving again."""

    def __init__(self, index: int):
        self.index, self.port, self.state, self.restarts, self.up = index, 5000, "stopped", 0, False

    def alive(self) -> bool:
        return self.up

    def restart(self, _pids) -> None:
        self.up, self.state, self.restarts = True, "restarting", self.restarts + 1

    def check_serving(self) -> bool:
        if self.state == "restarting":
            self.state = "serving"  # recovered from its data directory
        return self.state == "serving"


def test_a_killed_shard_is_back_for_the_read_and_never_restarted_once_shards_stop(tmp_path):
    chaos = ChaosConfig(mtbf=1e9, shard_kill_at=(), shard_restart_delay=0.0)
    session = ChaosSession(
        UpConfig(learners=2, preset="tiny"), chaos, tmp_path, io.StringIO(), inject=True
    )
    session.shards = [FakeShard(0)]
    # killed just before the duration was up: still down when the learners stop
    session.shard_back_at = {0: 0.0}
    session._shards_back()  # the learners stopped: the shard comes back before the read
    assert session.shards[0].state == "serving" and session.shard_back_at == {}
    # a shard killed and not yet back when the session stops its shards stays down
    late = FakeShard(0)
    session.shards, session.shard_back_at = [late], {0: 0.0}
    session.shards_down = True
    session.t0 = 0.0
    session.inject_failures(100.0)
    assert late.restarts == 0 and not late.alive()
