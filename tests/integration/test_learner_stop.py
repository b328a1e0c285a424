"""A real `atoll learner` leaves within seconds of its SIGTERM whatever it waits for:
shards that never answer at the start (nothing listening, or a listener that never
speaks gRPC), and its one shard vanishing mid-run (stopped with SIGSTOP, or killed).
In Kubernetes a learner that ignores SIGTERM holds its pod until the grace period ends.
Stopped before its steps are done it exits 143 (128 + SIGTERM): a Job must not count it
as completed."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
from syncer_helpers import REPO, free_port, syncer_processes

from atoll.wire.records import read_jsonl

# SIGTERM to exit: a stopped learner takes 0.2-0.6 s (measured on a 2-core host shared
# with other suites). 10 s gives a loaded host a 15x margin and still binds: a wait that
# SIGTERM failed to end would run out its 60 s RPC deadline (learner/config.py
# `deadline`), and the fault tests' shards never answer before that.
STOP_SECONDS = 10.0
JOINING = "joining the syncer at"  # the log line of the phase a learner joins in
FLAGS = ["--preset", "tiny", "--period", "4", "--fragments", "2", "--eval-every", "0", "--quiet"]


class Learner:
    def __init__(self, tmp: pathlib.Path, shards: str, *flags: str):
        self.status, self.log = tmp / "learner.jsonl", tmp / "learner.log"
        args = ["--learner-id", "l0", "--shards", shards, "--status-file", str(self.status)]
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "atoll.cli", "learner", *args, *FLAGS, *flags],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, ready, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, f"learner exited early:\n{self.output()}"
            assert time.monotonic() < deadline, f"learner never {what}:\n{self.output()}"
            time.sleep(0.05)

    def records(self) -> list[dict]:
        return read_jsonl(self.status) if self.status.exists() else []

    def blocked(self, still: float = 1.0) -> bool:
        """No step recorded for `still` s: the steps of a tiny model take milliseconds,
        so the learner waits on a sync (the status file gets a record after every step)."""
        return time.time() - self.status.stat().st_mtime > still

    def stop(self) -> float:
        """SIGTERM; the seconds until it exited (fails the test past STOP_SECONDS)."""
        sent = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.fail(f"learner still running {STOP_SECONDS} s after SIGTERM:\n{self.output()}")
        return time.monotonic() - sent

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def learners():
    started: list[Learner] = []
    yield started
    for learner in started:
        learner.kill()


def test_sigterm_ends_the_wait_for_shards_nobody_serves(tmp_path, learners):
    # the injected fault: --shards names a port nothing listens on
    learners.append(learner := Learner(tmp_path, f"127.0.0.1:{free_port()}"))
    # compiled (tiny), asking the shard: a wait with a 60 s deadline
    learner.wait_for(lambda: JOINING in learner.output(), "started joining the syncer")
    learner.stop()
    assert learner.proc.returncode == 128 + signal.SIGTERM, learner.output()  # not done: 143
    assert "SIGTERM: stopping" in learner.output()
    assert "stopped by SIGTERM while joining the syncer" in learner.output()
    assert "Traceback" not in learner.output()


def test_sigterm_ends_the_wait_for_a_shard_that_never_answers(tmp_path, learners):
    # the injected fault: a listener that takes the connection and never speaks (a hung pod)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        hung.settimeout(120.0)
        learners.append(learner := Learner(tmp_path, f"127.0.0.1:{hung.getsockname()[1]}"))
        connection, _ = hung.accept()  # the learner asks the shard: it waits for an answer
        with connection:
            learner.wait_for(lambda: JOINING in learner.output(), "started joining the syncer")
            learner.stop()
    assert learner.proc.returncode == 128 + signal.SIGTERM, learner.output()  # not done: 143
    assert "stopped by SIGTERM while joining the syncer" in learner.output()
    assert learner.records()[-1]["state"] == "stopped"
    assert "Traceback" not in learner.output()


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_sigterm_ends_the_waits_of_a_learner_whose_shard_vanished(tmp_path, learners, fault):
    with syncer_processes(tmp_path) as start:
        shard = start(tmp_path / "shard")
        learners.append(
            learner := Learner(tmp_path, f"127.0.0.1:{shard.port}", "--steps", "100000")
        )
        learner.wait_for(
            lambda: any(r.get("pushes", 0) >= 2 for r in learner.records()), "pushed twice"
        )
        # the injected fault: the shard stops answering (SIGSTOP: a hung host) or dies mid-run
        os.kill(shard.pid, fault)
        # its syncs to the shard are never answered (or fail and are retried): the learner
        # blocks on the round it needs
        learner.wait_for(learner.blocked, "blocked on the vanished shard")
        learner.stop()
        if fault == signal.SIGSTOP:
            os.kill(shard.pid, signal.SIGCONT)
    assert learner.proc.returncode == 128 + signal.SIGTERM, learner.output()  # not done: 143
    assert "stopped by SIGTERM at step" in learner.output()
    assert learner.records()[-1]["state"] == "stopped"
    assert "Traceback" not in learner.output()
