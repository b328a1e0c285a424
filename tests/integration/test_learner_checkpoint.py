"""Durable learner state with real processes: `atoll learner --checkpoint-dir` killed with
SIGKILL resumes at its checkpoint's step and data position, so does a user's own loop of
a bfloat16 model with an int counter (`atoll.Learner`), and a standby
(`atoll learner --standby`), compiled in advance, takes a killed learner's id over and
finishes its steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from syncer_helpers import REPO, syncer_processes
from test_learner import LEARNER_FLAGS, SHARD_FLAGS, Learner, learners  # noqa: F401 (a fixture)

from atoll.learner import checkpoint, standby
from atoll.wire.records import read_jsonl

# Steps of each run (8x their measured time each, --slowdown 8): the kill comes at step 25,
# past two checkpoints (every 10; the one at 20 may still be in flight), and leaves the
# resumed learner or the standby 65 steps.
STEPS = 90
KILL_AT = 25
ONE_SHARD = ["--shard-index", "0", "--num-shards", "1", "--quorum", "1", "--grace-factor", "1"]
# Kill -> the standby's first training step: it has imported, loaded data and compiled
# (the test waits for its "ready (compiled" line before the kill), so what is left is
# noticing the free claim (every 0.1 s), reading the checkpoint and joining the shards.
# About 1 s on an idle 2-core machine (1.2 s measured with other suites running). 15 s
# is a loaded host's margin (other suites and the learners' own steps stretch each of
# these) that still binds: a standby that misses the freed claim (a lock released when
# its holder dies) and waits for something slower, a lease lapse (90 s over NFS) or the
# shards dropping the dead learner, does not make it.
TAKEOVER_SECONDS = 15.0


def _shards(start, tmp_path):
    shards = [start(tmp_path / f"s{i}", "--shard-index", str(i), *SHARD_FLAGS) for i in range(2)]
    return [s.port for s in shards]


def _ckpt_flags(tmp_path):
    return ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "10", "--slowdown", "8"]


def _first_training_after(records: list[dict], t: float) -> dict:
    return next(r for r in records if r["state"] == "training" and r["time"] > t)


@pytest.mark.timeout(300)
def test_a_killed_learner_resumes_at_its_checkpoint(tmp_path, learners):
    with syncer_processes(tmp_path) as start:
        ports = _shards(start, tmp_path)
        learners += [
            Learner(tmp_path, f"l{i}", i, ports, STEPS, *_ckpt_flags(tmp_path)).start()
            for i in range(2)
        ]
        learners[1].wait_for_step(KILL_AT)
        learners[1].kill()
        killed_at = time.time()
        reached = learners[1].records()[-1]["step"]
        saved = checkpoint.read(checkpoint.path_for(tmp_path / "ck", "l1"))
        assert saved is not None and saved.step % 10 == 0 and 10 <= saved.step <= reached
        assert standby.holder(tmp_path / "ck", "l1")["done"] is False  # died holding its id
        again = Learner(tmp_path, "l1", 1, ports, STEPS, *_ckpt_flags(tmp_path)).start()
        learners.append(again)
        assert learners[0].wait() == 0 and again.wait() == 0

    records = again.records()
    first = _first_training_after(records, killed_at)
    # the checkpoint's step and data position (the batch of a step is fixed by the step)
    assert first["step"] == saved.step + 1
    a, b = [r for r in records if r["state"] == "training"][:2]
    assert first["tokens"] == saved.meta["tokens"] + (b["tokens"] - a["tokens"])
    assert f"resumed its checkpoint at step {saved.step}" in again.log.read_text()
    assert records[-1]["state"] == "done" and records[-1]["step"] == STEPS
    assert standby.holder(tmp_path / "ck", "l1")["done"] is True  # finished: nobody takes it over


@pytest.mark.timeout(300)
def test_a_standby_takes_over_a_killed_learner(tmp_path, learners):
    with syncer_processes(tmp_path) as start:
        ports = _shards(start, tmp_path)
        learners += [
            Learner(tmp_path, f"l{i}", i, ports, STEPS, *_ckpt_flags(tmp_path)).start()
            for i in range(2)
        ]
        log = tmp_path / "spare.log"
        args = [
            sys.executable,
            "-m",
            "atoll.cli",
            "learner",
            "--standby",
            "--learner-id",
            "spare",
            "--num-learners",
            "2",
            "--steps",
            str(STEPS),
            "--shards",
            ",".join(f"127.0.0.1:{p}" for p in ports),
            "--status-file",
            str(tmp_path / "{id}.jsonl"),
            "--cache-dir",
            str(tmp_path / "cache"),
            *LEARNER_FLAGS,
            *_ckpt_flags(tmp_path),
        ]
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
        }
        with open(log, "a") as out:
            spare = subprocess.Popen(
                args, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )
        try:
            deadline = time.monotonic() + 120
            while "ready (compiled" not in log.read_text():
                assert spare.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            learners[1].wait_for_step(KILL_AT)
            assert spare.poll() is None  # both learners hold their ids: nothing to take
            learners[1].kill()
            killed_at = time.time()
            saved = checkpoint.read(checkpoint.path_for(tmp_path / "ck", "l1"))
            while not any(
                r["state"] == "training" and r["time"] > killed_at for r in learners[1].records()
            ):
                assert spare.poll() is None, log.read_text()
                assert time.time() - killed_at < TAKEOVER_SECONDS, log.read_text()
                time.sleep(0.05)
            took = _first_training_after(learners[1].records(), killed_at)
            assert standby.holder(tmp_path / "ck", "l1")["pid"] == spare.pid
            assert learners[0].wait() == 0 and spare.wait(180) == 0
        finally:
            if spare.poll() is None:
                spare.send_signal(signal.SIGKILL)
                spare.wait()

    assert took["step"] == saved.step + 1 and took["time"] - killed_at < TAKEOVER_SECONDS, (
        took,
        killed_at,
    )
    assert "takes over learner l1 (data shard 1)" in log.read_text()
    records = read_jsonl(tmp_path / "l1.jsonl")
    assert records[-1]["state"] == "done" and records[-1]["step"] == STEPS
    assert not (tmp_path / "spare.jsonl").exists()  # it wrote as l1, never as itself


# A user's own loop (atoll.Learner) over a bfloat16 + float32 model with an int step
# counter kept out of the plan; it prints one JSON line at join and one per step.
OWN_LOOP = textwrap.dedent("""
    import json, sys, time
    import jax, jax.numpy as jnp, optax
    import atoll
    shard, ckpt_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    params = {"w": jnp.zeros((16, 8), jnp.bfloat16), "b": jnp.zeros(8, jnp.float32),
              "count": jnp.int32(0)}
    opt = optax.adam(1e-2)
    floats = lambda p: {"w": p["w"], "b": p["b"]}
    learner = atoll.Learner(shard, "bf", fragments=2, sync=atoll.SyncConfig(period=4),
                            checkpoint=atoll.Checkpointing(ckpt_dir, every=5))
    params = learner.join(params)
    opt_state = learner.restore_state(opt.init(floats(params)))
    print(json.dumps({"resumed": learner.resumed, "steps": learner.steps,
                      "count": int(params["count"]), "adam": int(opt_state[0].count),
                      "dtypes": [str(params[k].dtype) for k in ("w", "b", "count")]}), flush=True)

    @jax.jit
    def train_step(params, opt_state):
        loss = lambda f: jnp.sum((f["w"].astype(jnp.float32) - 1) ** 2) + jnp.sum((f["b"] + 2) ** 2)
        grads = jax.grad(loss)(floats(params))
        updates, opt_state = opt.update(grads, opt_state)
        new = optax.apply_updates(floats(params), updates)
        return {**new, "count": params["count"] + 1}, opt_state

    while learner.steps < steps:
        params, opt_state = train_step(params, opt_state)
        time.sleep(0.03)
        params = learner.step(params, tokens=8, state=opt_state)
        print(json.dumps({"step": learner.steps, "count": int(params["count"])}), flush=True)
    learner.finish(params, state=opt_state)
""")


@pytest.mark.timeout(120)
def test_an_own_loop_bfloat16_learner_killed_resumes_its_model_counter_and_state(tmp_path):
    with syncer_processes(tmp_path) as start:
        shard = start(tmp_path / "s0", *ONE_SHARD)
        env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
        args = [sys.executable, "-c", OWN_LOOP, f"127.0.0.1:{shard.port}", str(tmp_path / "ck")]
        first = subprocess.Popen(
            [*args, "1000"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            joined = json.loads(first.stdout.readline())
            assert not joined["resumed"] and joined["count"] == 0, joined
            for line in first.stdout:  # past two checkpoints (steps 5 and 10)
                if json.loads(line)["step"] >= 13:
                    break
            first.send_signal(signal.SIGKILL)
            first.wait(30)
        finally:
            first.kill()
            first.communicate()
        saved = checkpoint.read(checkpoint.path_for(tmp_path / "ck", "bf"))
        assert saved is not None and saved.step in (5, 10), saved and saved.step
        # what an npz checkpoint could not hold: the bfloat16 leaf, and the int counter
        assert sorted(d for _, d in saved.meta["params"]) == ["bfloat16", "float32", "int32"]

        again = subprocess.run(
            [*args, str(saved.step + 6)], env=env, capture_output=True, text=True, timeout=90
        )
    assert again.returncode == 0, again.stderr[-3000:]
    lines = [json.loads(line) for line in again.stdout.splitlines()]
    resumed = lines[0]
    assert resumed["resumed"] and resumed["steps"] == saved.step, resumed
    # the counter kept out of the plan and adam's own count came back at the checkpoint's step
    assert resumed["count"] == saved.step and resumed["adam"] == saved.step, resumed
    assert resumed["dtypes"] == ["bfloat16", "float32", "int32"], resumed
    assert lines[-1] == {"step": saved.step + 6, "count": saved.step + 6}, lines[-3:]
