"""atoll.Learner against real shards (in this process): two learners train a plain pytree
through them, a restarted learner rejoins at the current versions, checkpoints and
standbys, sharded params, and every misuse that needs a shard to be seen."""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import atoll
from atoll.learner import checkpoint
from atoll.learner.pytree import TreeLayout
from atoll.server.config import ShardConfig
from atoll.server.service import SyncerServer

FEATURES, HIDDEN = 8, 16
TEACHER = np.random.default_rng(0).standard_normal((FEATURES, 1)).astype(np.float32)


def init(seed: int = 0) -> dict:
    k0, k1 = jax.random.split(jax.random.key(seed))
    return {
        "layer0": {"w": jax.random.normal(k0, (FEATURES, HIDDEN)) * 0.3, "b": jnp.zeros(HIDDEN)},
        "layer1": {"w": jax.random.normal(k1, (HIDDEN, 1)) * 0.3, "b": jnp.zeros(1)},
    }


def loss_fn(params, x_BxF, y_Bx1):
    h_BxH = jnp.tanh(x_BxF @ params["layer0"]["w"] + params["layer0"]["b"])
    return jnp.mean((h_BxH @ params["layer1"]["w"] + params["layer1"]["b"] - y_Bx1) ** 2)


OPTIMIZER = optax.adam(1e-2)
H4, H8 = atoll.SyncConfig(period=4), atoll.SyncConfig(period=8, overlap=1)


@jax.jit
def train_step(params, opt_state, x_BxF, y_Bx1):
    loss, grads = jax.value_and_grad(loss_fn)(params, x_BxF, y_Bx1)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def batch(rng: np.random.Generator, size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    x_BxF = rng.standard_normal((size, FEATURES)).astype(np.float32)
    return x_BxF, np.sin(x_BxF @ TEACHER)


TEST = batch(np.random.default_rng(99), 512)


def start_shards(tmp_path, count: int, quorum: int) -> list[SyncerServer]:
    servers = [
        SyncerServer(
            ShardConfig(
                shard_index=i,
                num_shards=count,
                data_dir=tmp_path / f"shard{i}",
                listen="127.0.0.1:0",
                quorum=quorum,
                grace_factor=1.0,
                lease_seconds=5,
            )
        )
        for i in range(count)
    ]
    for s in servers:
        s.start()
    return servers


@pytest.fixture
def two_shards(tmp_path):
    servers = start_shards(tmp_path, 2, quorum=2)
    yield [f"127.0.0.1:{s.port}" for s in servers]
    for s in servers:
        s.stop()


def train(learner: atoll.Learner, params, steps: int, seed: int, state=None, sleep: float = 0.004):
    """`steps` inner steps of the user's loop with `learner.step` after each."""
    rng = np.random.default_rng(seed)
    opt_state = OPTIMIZER.init(params) if state is None else state
    for _ in range(steps):
        params, opt_state, _ = train_step(params, opt_state, *batch(rng))
        time.sleep(sleep)  # steps of a few ms: a round trip is a fraction of a period
        params = learner.step(params, tokens=32, state=opt_state)
    return params, opt_state


def in_threads(fn, n: int, timeout: float) -> list:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(fn, i) for i in range(n)]
        return [f.result(timeout=timeout) for f in futures]


def test_two_learners_train_a_pytree_through_the_shards_and_the_global_loss_falls(
    two_shards, monkeypatch
):
    """Reads of the params (device-to-host copies) happen only at a push or an adoption:
    a step that starts no push and adopts nothing returns the very tree it was given."""
    reads = threading.local()
    real_read = TreeLayout.read

    def counting_read(self, leaves, p):
        reads.count = getattr(reads, "count", 0) + 1
        return real_read(self, leaves, p)

    monkeypatch.setattr(TreeLayout, "read", counting_read)
    start = float(loss_fn(init(), *TEST))

    def learner(i):
        rng = np.random.default_rng(i)
        quiet_steps = 0
        with atoll.Learner(two_shards, f"l{i}", fragments=4, sync=H8) as learner:
            params = learner.join(init(seed=i))  # the second learner starts from the first's
            reads.count = 0
            opt_state = OPTIMIZER.init(params)
            for step in range(1, 161):
                params, opt_state, _ = train_step(params, opt_state, *batch(rng))
                time.sleep(0.004)
                before = reads.count
                out = learner.step(params, tokens=32, last=step == 160)
                if out is params and not learner.pushed:
                    assert reads.count == before, f"step {step} read the params with no sync"
                    quiet_steps += 1
                params = out
            params = learner.finish(params)
            return params, learner.stats, learner.versions, quiet_steps

    results = in_threads(learner, 2, timeout=120)
    for params, stats, versions, quiet_steps in results:
        assert stats["pushes"] >= 8 and stats["adopted"] >= 8 and stats["refused"] == 0, stats
        assert all(adopted >= 3 for adopted, _ in versions.values()), versions
        # 4 fragments, each busy ~2 steps in 8: many steps do nothing (about 40-60; fewer on a
        # loaded host, where adoptions land apart from pushes): enough were checked above
        assert quiet_steps > 20
        assert float(loss_fn(params, *TEST)) < 0.5 * start
    # The two finish at different times, so they need not end on the same versions: in
    # each fragment the first to finish ends on the round that held its own tail, and the
    # last to finish, whose tail the shard no longer holds for the other (a `last` push),
    # closes the final round alone and adopts it. What `finish` guarantees is that each
    # ends on the global weights of the version it adopted last. A learner joining now
    # reads the final ones: the last finisher of every fragment holds exactly them (to
    # float rounding: adopting adds Θ − θ to θ).
    with atoll.Learner(two_shards, "reader", fragments=4) as reader:
        final, now = reader.join(init(seed=7)), reader.versions
        plan = reader.plan
    for p in range(4):
        ends = [versions[p][0] for _, _, versions, _ in results]
        assert max(ends) == now[p][0], (p, ends, now)
        for params, _, versions, _ in results:
            if versions[p][0] == now[p][0]:
                np.testing.assert_allclose(
                    plan.flatten_fragment(params, p), plan.flatten_fragment(final, p), atol=1e-6
                )


def test_a_restarted_learner_rejoins_at_the_current_versions(one_shard):
    with atoll.Learner(one_shard, "a", fragments=2, sync=H4) as first:
        params, _ = train(first, first.join(init()), 24, seed=0)
        trained = first.finish(params)
        versions = first.versions
    assert all(v >= 2 for v, _ in versions.values()), versions
    again = atoll.Learner(one_shard, "a", fragments=2, sync=H4)
    rejoined = again.join(jax.tree.map(jnp.zeros_like, init()))
    assert again.versions == versions, (again.versions, versions)
    # the global weights the first one adopted last (θ + (Θ − θ): to float rounding)
    for x, y in zip(jax.tree.leaves(rejoined), jax.tree.leaves(trained)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
    again.close()


def test_a_tree_unlike_the_runs_plan_is_refused_at_join_naming_the_tensor(one_shard):
    with atoll.Learner(one_shard, "a", fragments=2) as first:
        first.join(init())
        other = init()
        other["layer1"]["w"] = jnp.zeros((HIDDEN, 2))
        second = atoll.Learner(one_shard, "b", fragments=2)
        with pytest.raises(
            atoll.PlanMismatch,
            match=r"tensor 'layer1/w' has shape \(16, 2\) here, \(16, 1\) in the run",
        ):
            second.join(other)
        with pytest.raises(atoll.LearnerStateError, match="join failed: PlanMismatch"):
            second.step(other)
        third = atoll.Learner(one_shard, "c", fragments=3)
        with pytest.raises(atoll.PlanMismatch, match="the run has 2 fragments, this learner 3"):
            third.join(init())


def test_a_tree_that_changes_after_join_is_refused_when_a_fragment_is_read(one_shard):
    with atoll.Learner(
        one_shard, "a", fragments=2, sync=atoll.SyncConfig(period=2, overlap=0)
    ) as learner:
        params = learner.join(init())
        params["layer0"]["w"] = params["layer0"]["w"].astype(jnp.bfloat16)
        with pytest.raises(atoll.ParamsError, match=r"leaf 'layer0/w' is bfloat16\(8, 16\)"):
            for _ in range(2):  # fragment 0 syncs at step 1, fragment 1 at step 2
                learner.step(params)


def test_calls_out_of_order_after_join_are_refused(one_shard):
    learner = atoll.Learner(one_shard, "a", fragments=2, sync=H4)
    params = learner.join(init())
    with pytest.raises(atoll.LearnerStateError, match=r"join\(\) after join\(\)"):
        learner.join(params)
    params = learner.finish(learner.step(params))
    for call in (learner.step, learner.finish):
        with pytest.raises(atoll.LearnerStateError, match="after finish"):
            call(params)
    learner.close()  # after finish: nothing left to do, and no error


def test_stop_ends_a_join_that_waits_on_a_shard_that_does_not_answer():
    learner = atoll.Learner(
        "127.0.0.1:1", "a", sync=atoll.SyncConfig(deadline=30.0)
    )  # nothing listens on port 1
    threading.Timer(0.5, learner.stop).start()
    started = time.monotonic()
    with pytest.raises(atoll.Stopped):
        learner.join(init())
    assert time.monotonic() - started < 10


def test_a_checkpointed_learner_resumes_its_steps_and_state_and_holds_its_id(one_shard, tmp_path):
    ckpt = tmp_path / "ckpt"
    saving = atoll.Checkpointing(ckpt, every=5)
    first = atoll.Learner(one_shard, "a", fragments=2, sync=H4, checkpoint=saving)
    params = first.join(init())
    with pytest.raises(atoll.LearnerStateError, match="held by a live process"):
        atoll.Learner(one_shard, "a", fragments=2, checkpoint=saving).join(init())
    # the step-5 write on disk before step 10 is due (a write still running then would
    # skip it: learner/checkpoint.py, guarantee 3)
    params, opt_state = train(first, params, 5, seed=0, sleep=0.03)
    path, deadline = checkpoint.path_for(ckpt, "a"), time.monotonic() + 60
    while checkpoint.progress(path) != (5, 5 * 32):
        assert time.monotonic() < deadline, "the step-5 checkpoint was not written in 60 s"
        time.sleep(0.05)
    params, opt_state = train(first, params, 7, seed=1, state=opt_state, sleep=0.03)
    first.close()  # a crash, as far as the id is concerned: not finished; the write ends
    assert checkpoint.progress(path) == (10, 10 * 32)

    again = atoll.Learner(
        one_shard, "a", fragments=2, sync=H4, checkpoint=atoll.Checkpointing(ckpt)
    )
    resumed = again.join(init(seed=5))
    assert again.steps == 10
    state = again.restore_state(OPTIMIZER.init(resumed))
    assert int(state[0].count) == 10  # adam's step count, as checkpointed at step 10
    assert float(loss_fn(resumed, *TEST)) < float(loss_fn(init(seed=5), *TEST))
    with pytest.raises(atoll.ParamsError, match="pass a template made the way"):
        again.restore_state({"x": jnp.zeros(3)})
    again.finish(train(again, resumed, 2, seed=1, state=state)[0])
    assert again.steps == 12


def test_a_standby_takes_over_a_failed_learners_id(one_shard, tmp_path):
    ckpt = tmp_path / "ckpt"
    failed = atoll.Learner(
        one_shard,
        "a",
        fragments=2,
        checkpoint=atoll.Checkpointing(ckpt, every=4),
        index=1,
        num_learners=2,
    )
    params, _ = train(failed, failed.join(init()), 4, seed=0)
    standby = atoll.Checkpointing(ckpt, standby=True)
    spare = atoll.Learner(one_shard, "spare", fragments=2, checkpoint=standby, num_learners=2)
    taking = concurrent.futures.ThreadPoolExecutor(1).submit(spare.join, init())
    time.sleep(0.5)
    assert not taking.done()  # the id is held: the standby waits
    failed.close()
    params = taking.result(timeout=30)
    assert (spare.learner_id, spare.index, spare.steps) == ("a", 1, 4)
    spare.finish(params)


def test_sharded_params_keep_their_sharding_through_adoptions(tmp_path):
    """Two CPU devices in a child process: a leaf split over both, trained through a shard."""
    code = f"""
import time, pathlib
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import atoll
from atoll.server.config import ShardConfig
from atoll.server.service import SyncerServer

server = SyncerServer(ShardConfig(shard_index=0, num_shards=1, data_dir=pathlib.Path({str(tmp_path)!r}) / "s",
                                  listen="127.0.0.1:0", quorum=1))
server.start()
mesh = Mesh(np.array(jax.devices()), ("x",))
split, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
params = {{"w": jax.device_put(jnp.ones((8, 4)), split), "b": jax.device_put(jnp.ones(4), whole)}}
learner = atoll.Learner(
    f"127.0.0.1:{{server.port}}", "a", fragments=2, sync=atoll.SyncConfig(period=2, overlap=0)
)
params = learner.join(params)
step = jax.jit(lambda p: jax.tree.map(lambda x: x * 0.9, p))
for _ in range(12):
    params = step(params)
    time.sleep(0.01)
    params = learner.step(params)
params = learner.finish(params)
assert learner.stats["adopted"] >= 4, learner.stats
assert params["w"].sharding == split and params["b"].sharding == whole
assert len(params["w"].addressable_shards) == 2
assert float(params["w"][0, 0]) < 0.5
server.stop()
print("ok")
"""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env
    )
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


MULTIHOST_CHILD = """
import hashlib, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from atoll.learner import distributed
import atoll

shard, coordinator, process = sys.argv[1], sys.argv[2], int(sys.argv[3])
distributed.initialize(distributed.DistributedConfig(coordinator, 2, process))
mesh = Mesh(np.array(jax.devices()), ("data",))  # one device per process: the island's two hosts
whole = NamedSharding(mesh, P())
def replicated(x):
    return jax.make_array_from_callback(x.shape, whole, lambda index: x[index])
# each process starts from its own values: join must give both process 0's
start = np.random.default_rng(process).standard_normal((3, 8, 4)).astype(np.float32)
params = {"w": replicated(start[0]), "v": replicated(start[1]), "b": replicated(start[2, 0])}
step = jax.jit(lambda p: jax.tree.map(lambda x: x * 0.95 + 0.01, p), out_shardings=whole)
learner = atoll.Learner(shard, "mh", fragments=2, sync=atoll.SyncConfig(period=4, overlap=1))
params = learner.join(params)
for _ in range(16):
    params = step(params)
    time.sleep(0.01)
    params = learner.step(params)
params = learner.finish(params)
assert all(x.sharding == whole for x in jax.tree.leaves(params))
digest = hashlib.sha256(b"".join(np.asarray(params[k]).tobytes() for k in sorted(params)))
print("adopted", learner.stats.get("adopted", "-"), "params", digest.hexdigest()[:16], flush=True)
"""


@pytest.mark.e2e
def test_a_two_process_learner_joins_and_adopts_on_every_process(tmp_path):
    """Process 0 alone talks to the shard; process 1 starts from and adopts what it did."""
    from syncer_helpers import REPO, free_port, syncer_processes

    port = free_port()
    with syncer_processes(tmp_path) as start:
        shard = start(tmp_path / "s0", "--quorum", "1", "--lease-seconds", "5")
        env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    MULTIHOST_CHILD,
                    f"127.0.0.1:{shard.port}",
                    f"127.0.0.1:{port}",
                    str(i),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for i in range(2)
        ]
        try:
            outputs = [p.communicate(timeout=180) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    lead, other = (
        re.search(r"^adopted (\S+) params (\S+)$", out, re.M).groups() for out, _ in outputs
    )
    assert int(lead[0]) >= 4 and other[0] == "-", (lead, other)  # process 1 has no sync
    assert lead[1] == other[1], (lead, other)  # the same params, bit for bit
