"""Real `atoll learner` processes against real `atoll syncer` processes on loopback:
training converges, versions advance, the wire carries ~4 bits per parameter, and
both a shard's kill -9 and a learner's kill -9 are survived."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from syncer_helpers import REPO, SyncerProcess, syncer_processes

from atoll.wire.client import ShardClient
from atoll.wire.records import read_jsonl

LEARNER_FLAGS = [
    "--preset",
    "tiny",
    "--period",
    "8",
    "--overlap",
    "1",
    "--fragments",
    "4",
    "--eval-every",
    "0",
    "--quiet",
]


class Learner:
    def __init__(
        self, tmp: pathlib.Path, name: str, index: int, shards: list[int], steps: int, *flags
    ):
        self.status = tmp / f"{name}.jsonl"
        self.log = tmp / f"{name}.log"
        self.args = [
            sys.executable,
            "-m",
            "atoll.cli",
            "learner",
            "--learner-id",
            name,
            "--learner-index",
            str(index),
            "--num-learners",
            "2",
            "--steps",
            str(steps),
            "--shards",
            ",".join(f"127.0.0.1:{p}" for p in shards),
            "--status-file",
            str(self.status),
            "--cache-dir",
            str(tmp / "cache"),
            *LEARNER_FLAGS,
            *flags,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> Learner:
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
        }
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                self.args, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        return self

    def records(self) -> list[dict]:
        return read_jsonl(self.status)

    def wait_for_step(self, step: int, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            training = [r for r in self.records() if r["state"] == "training" and r["step"] >= step]
            if training:
                return training[0]
            assert self.proc.poll() is None, f"learner exited early:\n{self.log.read_text()}"
            time.sleep(0.05)
        raise TimeoutError(f"learner never reached step {step}:\n{self.log.read_text()}")

    def wait(self, timeout: float = 180.0) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture
def learners():
    started: list[Learner] = []
    yield started
    for learner in started:
        learner.kill()


SHARD_FLAGS = [
    "--num-shards",
    "2",
    "--quorum",
    "2",
    "--grace-factor",
    "1",
    "--lease-seconds",
    "3",
    "--snapshot-every",
    "4",
]


# Steps of each run. Their steps last 8x their measured time (--slowdown 8), so a loaded
# host stretches them 8x too; the faults come at step 20 (fragments 1 and 3 close their
# first rounds by step ~10: offsets 4 and 8 at H = 8), which leaves a revived shard or a
# rejoined learner 80 steps (~10 rounds a fragment) where the tests wait for 2.
KILL_STEPS = 100
REJOIN_STEPS = 100


def _versions(port: int) -> dict[int, int]:
    """{fragment: version} of the fragments the shard on `port` serves."""
    client = ShardClient(f"127.0.0.1:{port}", "")
    try:
        return {f.fragment: f.version for f in client.describe(timeout=10).fragments}
    finally:
        client.close()


def _wait_for_versions(
    port: int, want: dict[int, int], learners: list[Learner], timeout: float = 150.0
) -> dict[int, int]:
    """Polls the shard on `port` until each fragment in `want` is at its version or past it;
    fails if the learners all exit first (no round closes after that) or at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        running = any(learner.proc.poll() is None for learner in learners)
        versions = _versions(port)
        if all(versions.get(p, -1) >= v for p, v in want.items()):
            return versions
        assert running, f"the learners finished with the shard at {versions}, not {want}"
        assert time.monotonic() < deadline, (
            f"the shard still at {versions} after {timeout} s, not {want}"
        )
        time.sleep(0.2)


def _two_shards_two_learners(start, tmp_path, learners, steps):
    shards = [start(tmp_path / f"s{i}", "--shard-index", str(i), *SHARD_FLAGS) for i in range(2)]
    ports = [s.port for s in shards]
    learners += [
        Learner(tmp_path, f"l{i}", i, ports, steps, "--slowdown", "8").start() for i in range(2)
    ]
    return shards, ports


def test_learners_train_through_a_shard_kill(tmp_path, learners):
    with syncer_processes(tmp_path) as start:
        shards, ports = _two_shards_two_learners(start, tmp_path, learners, KILL_STEPS)
        learners[0].wait_for_step(20)
        # the injected fault: kill -9 shard 1 mid-run, once each of its fragments has closed
        # a round (so there is something to recover), then bring it back on the same port
        at_kill = _wait_for_versions(ports[1], {1: 1, 3: 1}, learners)
        assert shards[1].kill() == -signal.SIGKILL
        before = max(r.get("version", 0) for r in learners[0].records())
        time.sleep(1.0)
        revived = SyncerProcess(
            tmp_path / "s1",
            ["--shard-index", "1", *SHARD_FLAGS, "--listen", f"127.0.0.1:{ports[1]}"],
            tmp_path / "s1b.log",
        )
        revived.start()
        try:
            # it came back from its log and snapshots with every round it had closed (a
            # record is written before its round shows; a kill -9 loses no written record)
            replayed = _versions(ports[1])
            assert sorted(replayed) == [1, 3]
            assert all(replayed[p] >= at_kill[p] for p in replayed), (at_kill, replayed)
            # and rounds go on closing there, with both learners' pushes (quorum 2): two more
            # of each of its fragments while the learners run (when depends on how the
            # cadence settles on a loaded host, so it is waited for, not looked for at the end)
            _wait_for_versions(ports[1], {p: v + 2 for p, v in replayed.items()}, learners)
            assert [learner.wait() for learner in learners] == [0, 0]
        finally:
            revived.kill()

    for learner in learners:
        records = learner.records()
        final = records[-1]
        assert final["state"] == "done" and final["step"] == KILL_STEPS
        first_loss = next(r["loss"] for r in records if "loss" in r)
        assert final["eval_loss"] < first_loss - 1.0, (first_loss, final["eval_loss"])  # it learned
        assert final["version"] > before
        assert final["refused"] == 0 or final["resyncs"] == final["refused"]
        # bits on the wire per pushed parameter: 4-bit frames, zstd-framed
        params = final["params"]
        pushed_params = final["pushes"] * params / 4  # 4 fragments of ~equal size
        push_bytes = final["bytes_sent"] - 4 * params  # less the fp32 Init offers
        assert push_bytes * 8 / pushed_params <= 4.6


def test_a_killed_learner_rejoins_at_the_current_version(tmp_path, learners):
    with syncer_processes(tmp_path) as start:
        shards, ports = _two_shards_two_learners(start, tmp_path, learners, REJOIN_STEPS)
        learners[1].wait_for_step(20)
        learners[1].kill()  # kill -9: no goodbye
        killed_at = learners[1].records()[-1]["step"]
        # the survivor goes on alone once the dead learner's lease lapses
        survivor_then = learners[0].wait_for_step(learners[0].records()[-1]["step"] + 24)
        rejoined = Learner(tmp_path, "l1", 1, ports, REJOIN_STEPS, "--slowdown", "8").start()
        learners.append(rejoined)
        assert learners[0].wait() == 0 and rejoined.wait() == 0

    records = rejoined.records()
    restart = next(i for i, r in enumerate(records) if r["state"] == "joining" and i > 0)
    first_after = next(r for r in records[restart:] if r["state"] == "training")
    # it resumed its data position and joined at a version at least as new as the survivor's then
    assert first_after["step"] == killed_at + 1
    assert first_after["version"] >= survivor_then["version"] > 0
    assert records[-1]["state"] == "done" and records[-1]["step"] == REJOIN_STEPS
