"""Tests for learner/checkpoint.py and learner/standby.py: a learner checkpoint is whole or
absent (a write killed midway leaves the previous one), keeps every dtype and the leaves
kept out of the plan, resuming it continues the same trajectory, local progress is carried onto new
global weights only where no later push delivered it, and learner ids are exclusive
claims that a standby takes over only when their holder died."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atoll.learner import checkpoint, standby
from atoll.learner.trainer.data import Batches, load_corpus, stdlib_dir
from atoll.learner.trainer.model import PRESETS
from atoll.learner.trainer.train import TrainConfig, Trainer

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = PRESETS["tiny"]
TCFG = TrainConfig(
    batch_size=4, peak_lr=1e-2, warmup_steps=2, total_steps=40, eval_every=1000, eval_batches=1
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return load_corpus(stdlib_dir() / "json", cache_dir=tmp_path_factory.mktemp("cache"))


def trainer_of(corpus) -> Trainer:
    batches = Batches(
        corpus.train,
        context=TINY.context,
        batch_size=TCFG.batch_size,
        learner=1,
        num_learners=2,
        seed=3,
    )
    return Trainer(TINY, TCFG, batches, heldout=corpus.heldout)


IDENTITY = {
    "learner_id": "l1",
    "learner_index": 1,
    "num_learners": 2,
    "batch_size": 4,
    "seed": 3,
    "model_config": dataclasses.asdict(TINY),
    "plan_fingerprint": "abc",
}


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_resuming_a_checkpoint_continues_the_same_trajectory(corpus, tmp_path):
    straight = trainer_of(corpus)
    for _ in range(12):
        straight.step(evaluate=False)

    first = trainer_of(corpus)
    for _ in range(6):
        first.step(evaluate=False)
    ck = checkpoint.Checkpointer(tmp_path, "l1", every=3, identity=IDENTITY)
    assert ck.due(6) and not ck.due(7)
    assert ck.save(first, None, None, wait=True)
    assert ck.written == 1 and ck.last_step == 6 and ck.error is None
    ck.close()
    for _ in range(3):  # steps after the checkpoint: lost with the process
        first.step(evaluate=False)

    got = checkpoint.read(checkpoint.path_for(tmp_path, "l1"))
    checkpoint.check(got, IDENTITY, tmp_path)
    assert got.step == 6 and got.meta["tokens"] == 6 * TCFG.batch_size * TINY.context
    resumed = trainer_of(corpus)
    checkpoint.restore_trainer(got, resumed)
    assert resumed.steps_done == 6  # the data position: batches are a function of the step
    for _ in range(6):
        resumed.step(evaluate=False)
    for a, b in zip(leaves(straight.params), leaves(resumed.params)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)  # same data, same optimiser state
    for a, b in zip(leaves(straight.opt_state), leaves(resumed.opt_state)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def _progress(params, state=(), step=0):
    return types.SimpleNamespace(params=params, opt_state=state, steps_done=step, tokens_total=0)


def test_every_dtype_and_the_leaves_out_of_the_plan_round_trip(tmp_path):
    params = {
        "w": jnp.linspace(-3, 3, 12, dtype=jnp.bfloat16).reshape(4, 3),  # raw void in an npz
        "b": jnp.asarray([0.1, 1 / 3, 1e-8], jnp.float32),
        "step": jnp.int32(41),  # an int counter: not synced, kept all the same
    }
    state = [jnp.full((4, 3), 2.5, jnp.float32), np.asarray(7, np.int32)]
    ck = checkpoint.Checkpointer(tmp_path, "l1", every=1, identity=IDENTITY)
    assert ck.save(_progress(params, state, step=3), None, None, wait=True) and ck.error is None
    ck.close()
    got = checkpoint.read(checkpoint.path_for(tmp_path, "l1"))
    like = jax.tree.leaves(jax.tree.map(jnp.zeros_like, params))
    back = got.params(like)
    for a, b in zip(back, jax.tree.leaves(params)):
        assert a.dtype == b.dtype and isinstance(a, jax.Array)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit for bit
    state_back = got.state([jnp.zeros((4, 3)), np.zeros((), np.int32)])
    np.testing.assert_array_equal(state_back[0], state[0])
    assert isinstance(state_back[1], np.ndarray) and int(state_back[1]) == 7  # as the template
    assert got.step == 3 and checkpoint.progress(checkpoint.path_for(tmp_path, "l1")) == (3, 0)
    with pytest.raises(checkpoint.CheckpointError, match="not the same model"):
        got.params(like[:2])


def test_a_checkpoint_under_a_relative_directory_reads_back_its_sync_vectors(tmp_path, monkeypatch):
    # `atoll up` and `atoll chaos` put runs under ./runs: a resumed learner reads its
    # checkpoint, sync vectors too, through the relative path it was given
    monkeypatch.chdir(tmp_path)
    frag = types.SimpleNamespace(
        p=0,
        task=None,
        origin=np.arange(5, dtype=np.float32),
        base=None,
        ef=types.SimpleNamespace(residual=np.full(5, 0.25, np.float32)),
        version=4,
        compute=1.5,
    )
    sync = types.SimpleNamespace(frags=[frag], seq=9)
    params = {"w": jnp.ones((2, 3), jnp.float32)}
    relative = pathlib.Path("runs") / "checkpoints"
    ck = checkpoint.Checkpointer(relative, "l1", every=1, identity=IDENTITY)
    assert ck.save(_progress(params, step=2), sync, None, wait=True) and ck.error is None
    ck.close()
    got = checkpoint.read(checkpoint.path_for(relative, "l1"))
    assert got.step == 2 and got.meta["seq"] == 9
    np.testing.assert_array_equal(got.origins[0], frag.origin)
    np.testing.assert_array_equal(got.residuals[0], frag.ef.residual)


KILLED_MID_WRITE = textwrap.dedent("""
    import os, pathlib, signal, sys, time, types
    sys.path.insert(0, {repo!r})
    import numpy as np
    from atoll.learner import checkpoint
    def at(step, n):
        p = {{"w": np.full(n, step, np.float32)}}
        return types.SimpleNamespace(params=p, opt_state=(), steps_done=step, tokens_total=0)
    ck = checkpoint.Checkpointer(pathlib.Path({out!r}), "l1", 1, {{"learner_id": "l1"}})
    assert ck.save(at(1, 10), None, None, wait=True) and ck.error is None
    ck.save(at(2, 64 << 20), None, None)  # 256 MB, written in the background: killed in it
    while not any(not p.name.isdigit() for p in ck.path.iterdir()):  # its temporary cut
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_write_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    script = KILLED_MID_WRITE.format(repo=str(REPO), out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    path = checkpoint.path_for(tmp_path, "l1")
    torn = [p for p in path.iterdir() if not p.name.isdigit()]
    assert torn, sorted(p.name for p in path.iterdir())  # the fault fired mid-write
    got = checkpoint.read(path)
    assert got.step == 1 and np.all(got.params([np.zeros(10, np.float32)])[0] == 1)
    ck = checkpoint.Checkpointer(tmp_path, "l1", every=1, identity=IDENTITY)
    assert ck.save(_progress({"w": np.full(10, 3, np.float32)}, step=3), None, None, wait=True)
    ck.close()
    assert checkpoint.read(path).step == 3
    # the next writer removed the torn cut (and its own previous one, once written)
    assert [p.name.isdigit() for p in path.iterdir()] == [True]


def test_a_write_that_fails_keeps_the_previous_one_and_reports(tmp_path):
    ck = checkpoint.Checkpointer(tmp_path, "l1", every=1, identity=IDENTITY)
    assert ck.save(_progress({"w": np.ones(3, np.float32)}, step=1), None, None, wait=True)
    # a leaf Orbax cannot write (an object array): training goes on, the error is kept
    bad = _progress({"w": np.array([object()] * 3)}, step=2)
    ck.save(bad, None, None, wait=True)
    assert ck.error is not None and ck.written == 1 and ck.last_step == 1
    ck.close()
    assert checkpoint.read(checkpoint.path_for(tmp_path, "l1")).step == 1


def test_a_checkpoint_of_other_settings_is_refused_with_a_reason(corpus, tmp_path):
    t = trainer_of(corpus)
    ck = checkpoint.Checkpointer(tmp_path, "l1", every=1, identity=IDENTITY)
    ck.save(t, None, None, wait=True)
    ck.close()
    got = checkpoint.read(checkpoint.path_for(tmp_path, "l1"))
    with pytest.raises(checkpoint.CheckpointError, match="learner_index=1.*learner_index=0"):
        checkpoint.check(got, {**IDENTITY, "learner_index": 0}, tmp_path)
    junk = checkpoint.path_for(tmp_path, "l2") / "7"
    junk.mkdir(parents=True)
    (junk / "meta").write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="move it away"):
        checkpoint.read(junk.parent)
    # an older atoll's npz checkpoint: refused, naming the file and what to do
    (tmp_path / "l3.ckpt").write_bytes(b"PK\x03\x04 an npz")
    with pytest.raises(checkpoint.CheckpointError, match=r"l3\.ckpt is a checkpoint of an older"):
        checkpoint.read(checkpoint.path_for(tmp_path, "l3"))
    assert checkpoint.progress(checkpoint.path_for(tmp_path, "l3")) is None


def test_only_progress_no_later_push_delivered_is_carried():
    size = 4
    frags = [
        types.SimpleNamespace(
            p=p,
            base=np.full(size, 10.0 * (p + 1), np.float32),
            compute=0.0,
            ef=types.SimpleNamespace(residual=np.zeros(size, np.float32)),
        )
        for p in range(3)
    ]
    sync = types.SimpleNamespace(frags=frags, seq=5)
    meta = {
        "seq": 40,
        "fragments": [
            {"fragment": p, "seq": 30 + p, "compute_seconds": 1.5, "version": 2, "in_flight": False}
            for p in range(3)
        ],
    }
    ckpt = checkpoint.Checkpoint(
        meta,
        origins={p: np.ones(size, np.float32) for p in range(3)},
        residuals={p: np.full(size, 0.25, np.float32) for p in range(3)},
    )
    theta = [
        np.full(size, 3.0, np.float32) for _ in range(3)
    ]  # 2 of local progress since each origin
    trail = checkpoint.PushTrail(3)
    # fragment 0: its shard saw the checkpoint's push at most; fragment 1: a newer push
    # (made after the checkpoint, which already delivered the progress); fragment 2: unknown
    updates = checkpoint.resume_sync(ckpt, sync, theta, trail, {0: 30, 1: 35})
    assert sorted(updates) == [0]
    np.testing.assert_array_equal(updates[0], np.full(size, 12.0))  # Θ_now + (θ_ckpt − origin)
    assert frags[0].compute == 1.5 and np.all(frags[0].ef.residual == 0.25)
    assert frags[1].compute == 0.0 and np.all(frags[1].ef.residual == 0)
    assert sync.seq == 40  # seqs go on from the newest known: none is reused
    assert trail.seq == [30, 35, 32]


def test_a_claim_is_exclusive_while_its_holder_lives(tmp_path):
    mine = standby.acquire(tmp_path, "l0", 0, 2, retry=0)
    assert mine is not None and standby.holder(tmp_path, "l0")["pid"] == os.getpid()
    assert (
        standby.acquire(tmp_path, "l0", 0, 2, retry=0.2) is None
    )  # taken (flock is per open file)
    assert standby.take_vacancy(tmp_path, 2) is None  # a live holder is no vacancy
    mine.release(done=True)
    assert standby.holder(tmp_path, "l0")["done"] is True
    assert standby.take_vacancy(tmp_path, 2) is None  # a finished learner's id is not taken over
    # a learner restarted while a standby held its id waits only until that id is done
    assert standby.wait_for_vacancy(tmp_path, 2, threading.Event(), until_done="l0") is None


def test_a_standby_takes_over_the_id_of_a_killed_learner_and_only_once(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from atoll.learner import standby
        claim = standby.acquire({str(tmp_path)!r}, "l1", 1, 2, retry=0)
        print("held" if claim else "refused", flush=True)
        time.sleep(600)
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert standby.take_vacancy(tmp_path, 2) is None
        assert standby.take_vacancy(tmp_path, 3) is None
        holder.send_signal(signal.SIGKILL)  # the kernel drops its lock
        holder.wait(10)
    finally:
        holder.kill()
    assert (
        standby.take_vacancy(tmp_path, 3) is None
    )  # another run's claim (M differs) is left alone
    stop = threading.Event()
    taken = standby.wait_for_vacancy(tmp_path, 2, stop)
    assert taken.learner_id == "l1" and taken.info["learner_index"] == 1
    assert taken.info["taken_from"] == holder.pid and taken.info["pid"] == os.getpid()
    assert standby.take_vacancy(tmp_path, 2) is None  # the id has one holder again
    stop.set()
    assert standby.wait_for_vacancy(tmp_path, 2, stop) is None
    taken.release()
