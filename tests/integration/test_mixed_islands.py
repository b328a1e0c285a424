"""Islands of different shapes train one model: a learner of 1 process beside a learner
of 2 processes whose params are FSDP-sharded over their 4 CPU devices (gloo), each a
real process of examples/fsdp_sharded.py against a real `atoll syncer` shard. Over 3
seeds, the global model they publish is as good as the one two 1-process learners
publish from the same seeds and data. Both runs block on late rounds (`--wait-for-rounds`):
without it, a learner whose steps are faster than a round trip syncs less often, and the
runs would compare step speeds (a 2-process learner steps slower), not learning."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from syncer_helpers import REPO, syncer_processes

from atoll.wire import codec
from atoll.wire.client import ShardClient
from atoll.wire.plan import FragmentPlan

pytestmark = pytest.mark.e2e  # real processes: `make test-fast` skips it

EXAMPLE = REPO / "examples" / "fsdp_sharded.py"
SEEDS = (0, 1, 2)
HIDDEN, FRAGMENTS = 64, 2  # the example's defaults
FLAGS = ["--steps", "150", "--period", "8", "--batch-size", "32", "--wait-for-rounds"]
LEARNED = 0.4  # every run's global loss is below this share of its untrained loss
# The spread: the mixed runs' mean global loss lies within the baseline's range over the
# seeds, widened by TOLERANCE of the baseline's mean on each side; and seed by seed, the
# mixed run is within TOLERANCE of the baseline run of the same seed and data. Measured
# (2 loaded cores): seed by seed within 0.5 %; a baseline rerun varies by up to 4.5 %
# (when each round closes, and so what the overlapped steps add, is the run's timing).
# 150 steps: every run's global loss at most 0.34 of its untrained one, seed by seed
# within 0.6 % (measured once over the 3 seeds); 100 steps is too few (0.43 on seed 1).
TOLERANCE = 0.1


def _example():
    spec = importlib.util.spec_from_file_location("fsdp_sharded", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp: pathlib.Path, name: str, seed: int, processes: tuple[int, ...]) -> list[np.ndarray]:
    """Trains learners of the given process counts (data streams 0, 1, ...) through one
    fresh shard (quorum: all of them); returns the fragments it publishes at the end."""
    with syncer_processes(tmp) as start:
        shard = start(tmp / name, "--quorum", str(len(processes)), "--lease-seconds", "10")
        address = f"127.0.0.1:{shard.port}"
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
        }
        procs = []
        for i, n in enumerate(processes):
            cmd = [sys.executable, str(EXAMPLE), "--shards", address, "--learner-id", f"l{i}"]
            cmd += ["--index", str(i), "--seed", str(seed), "--processes", str(n), *FLAGS]
            log = open(tmp / f"{name}.l{i}.log", "w")  # noqa: SIM115 (closed with the process)
            procs.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
        try:
            for i, proc in enumerate(procs):
                assert proc.wait(timeout=240) == 0, (tmp / f"{name}.l{i}.log").read_text()[-3000:]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)  # the example's own processes too
                    proc.wait()
        client = ShardClient(address, "observer", deadline=10)
        try:
            return [codec.decode(client.pull(p).frames[0][2]) for p in range(FRAGMENTS)]
        finally:
            client.close()


# about 2.5 min on 2 cores under a load average of 17 (6 runs, 2 at a time); the suite's
# 300 s is for hangs, and this one's processes each end within 240 s or fail
@pytest.mark.timeout(480)
def test_a_sharded_learner_beside_a_one_process_one_trains_as_two_one_process_ones(tmp_path):
    example = _example()
    x_test, y_test = next(example.batches(-1, 1024))  # the example's own test set

    def loss(params) -> float:
        return float(example.loss_fn(params, x_test, y_test))

    untrained, baseline, mixed = [], [], []
    for seed in SEEDS:
        init = example.init_params(example.jax.random.key(seed), HIDDEN)
        plan = FragmentPlan.build(init, FRAGMENTS)
        untrained.append(loss(init))
        # the two runs of a seed side by side, each on its own shard: the same load on both
        with ThreadPoolExecutor(2) as pool:
            runs = [
                pool.submit(_run, tmp_path, f"{name}{seed}", seed, processes)
                for name, processes in (("base", (1, 1)), ("mixed", (1, 2)))
            ]
            published = [run.result() for run in runs]
        baseline.append(loss(plan.unflatten(published[0])))
        mixed.append(loss(plan.unflatten(published[1])))
    figures = dict(untrained=untrained, baseline=baseline, mixed=mixed)
    print(figures)
    for runs in (baseline, mixed):
        assert all(r < LEARNED * u for r, u in zip(runs, untrained)), figures
    low, high = min(baseline), max(baseline)
    tol = TOLERANCE * float(np.mean(baseline))
    assert low - tol <= float(np.mean(mixed)) <= high + tol, figures
    assert all(abs(m - b) <= TOLERANCE * b for m, b in zip(mixed, baseline)), figures
