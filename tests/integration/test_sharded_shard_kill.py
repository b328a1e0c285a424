"""kill -9 of a real shard process while the parts of a sharded learner's push are
arriving: one process's part is acknowledged, the other's not yet sent. The restarted
shard (same data directory, same port) holds the acknowledged part and has merged
nothing of the push; the last part completes it, and the run publishes, bit for bit,
what the same learner publishes with no kill and what one replicated process does."""

from __future__ import annotations

import pathlib
import time

import pytest
from sharded_learners import Learner, learn, published
from syncer_helpers import connect, describe, syncer_processes

pytestmark = pytest.mark.e2e  # real processes: `make test-fast` skips it

FLAGS = ["--quorum=1", "--grace-factor=1.0", "--lease-seconds=30"]


def _wait_for(path: pathlib.Path, learner: Learner, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for i, proc in enumerate(learner.procs):
            assert proc.poll() is None, learner.log(i)
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.05)


def _fragment0(port: int) -> tuple[int, int]:
    channel, stub = connect(port)
    try:
        info = next(f for f in describe(stub).fragments if f.fragment == 0)
        return info.version, info.round_size
    finally:
        channel.close()


def test_kill_9_of_the_shard_between_the_parts_of_a_push_loses_and_merges_nothing(tmp_path):
    with syncer_processes(tmp_path) as start:
        runs = {}
        for name, kill in (("reference", False), ("killed", True)):
            shard = start(tmp_path / name, *FLAGS)
            address = f"127.0.0.1:{shard.port}"
            pause = tmp_path / f"{name}-pause"
            learner = Learner(
                tmp_path, name, address, 2, ["--lockstep", "--pause-part", str(pause)]
            )
            try:
                _wait_for(pause.with_suffix(".armed"), learner)
                # process 0's part is acknowledged; the closer's is held back
                before = _fragment0(shard.port)
                assert before[1] == 0, before  # a part alone is no contribution
                if kill:
                    assert shard.kill() == -9
                    shard = start(tmp_path / name, *FLAGS, "--listen", address)
                    assert shard.port == int(address.rsplit(":", 1)[1])
                    assert shard.replayed() and shard.replayed()[-1] > 0, shard.log()
                    # replayed: the same version, and still nothing of the push merged
                    assert _fragment0(shard.port) == before
                pause.with_suffix(".go").touch()
                reports = learner.reports()
            finally:
                learner.kill()
            for report in reports:
                assert "error" not in report, (name, report)
            runs[name] = (reports[0]["versions"], published(address))
        shard = start(tmp_path / "replicated", *FLAGS)
        address = f"127.0.0.1:{shard.port}"
        replicated = learn(tmp_path, "replicated", address, 1, ["--lockstep", "--replicated"])[0]
        assert "error" not in replicated, replicated
        runs["replicated"] = (replicated["versions"], published(address))
    # the acknowledged part was not lost: the push it belongs to merged, in its round,
    # as it did with no kill and as one process's whole push did
    assert min(v for v, _ in runs["killed"][0].values()) >= 3, runs
    for name in ("reference", "replicated"):
        assert runs["killed"][0] == runs[name][0], (name, runs)
        for p, (ref, got) in enumerate(zip(runs[name][1], runs["killed"][1])):
            assert got.tobytes() == ref.tobytes(), (name, p)
