"""`atoll up` as a user runs it: a whole (tiny) run to a report with plots; Ctrl-C mid-run
stops every child and leaves an interrupted report; the same command resumes the run."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from procs import running
from syncer_helpers import REPO

from atoll.wire.records import read_jsonl

pytestmark = pytest.mark.e2e  # a whole run: `make test-fast` skips it

# tiny model, short run: 2 shards, a full-speed learner and one 2x slower (half the steps)
FLAGS = [
    "--preset",
    "tiny",
    "--shards",
    "2",
    "--learners",
    "2",
    "--period",
    "8",
    "--evals",
    "2",
    "--no-table",
]


class Up:
    """`atoll up` as a child: a new run in `run_dir`, or with `resume` the one there, named
    relative to its parent (the child's working directory), as a user's ./runs are."""

    def __init__(self, run_dir: pathlib.Path, *flags: str, resume: bool = False):
        self.run_dir = run_dir
        self.log = run_dir.parent / f"{run_dir.name}-up.log"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "atoll.cli", "up"),
                    *("--run-dir" if resume else "--new-run-dir", run_dir.name, *flags),
                ],
                cwd=run_dir.parent,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

    def wait(self, timeout: float = 150.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"atoll up did not finish in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def children(self) -> list[dict]:
        path = self.run_dir / "pids.json"
        return json.loads(path.read_text())["children"] if path.exists() else []

    def report(self) -> dict:
        return json.loads((self.run_dir / "report.json").read_text())

    def kill_everything(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for child in self.children():
            if running(child["pid"], "atoll"):
                os.kill(child["pid"], signal.SIGKILL)


@pytest.fixture
def ups():
    started: list[Up] = []
    yield started
    for up in started:
        up.kill_everything()


def _wait_for_step(up: Up, learner: str, step: int, timeout: float = 120.0) -> None:
    status = up.run_dir / "learners" / f"{learner}.jsonl"
    deadline = time.monotonic() + timeout
    while not (
        status.exists()
        and any(r["state"] == "training" and r["step"] >= step for r in read_jsonl(status))
    ):
        assert up.proc.poll() is None, up.output()
        assert time.monotonic() < deadline, (
            f"{learner} not at step {step} after {timeout} s:\n{up.output()}"
        )
        time.sleep(0.05)


def test_up_runs_to_a_report_with_plots_through_a_shard_kill(tmp_path, ups):
    run = tmp_path / "run"
    ups.append(up := Up(run, *FLAGS, "--steps", "60"))
    _wait_for_step(up, "learner-1", 10)  # both learners have pushed to shard 1: it knows them
    # the injected fault: kill -9 shard 1 mid-run; `atoll up` restarts it once, on the same port
    shard = next(c for c in up.children() if c["name"] == "shard-1")
    os.kill(shard["pid"], signal.SIGKILL)
    assert up.wait() == 0, up.output()

    report = up.report()
    assert report["complete"] and report["interrupted"] is None and report["failure"] is None
    g = report["global"]
    learners = report["learners"]
    assert set(learners) == {"learner-0", "learner-1"}
    assert [learners[n]["steps"] for n in sorted(learners)] == [60, 30]  # 2x slower: half the steps
    for figure in (
        "eval_loss",
        "tokens",
        "goodput",
        "push_bits_per_param",
        "pull_bits_per_param",
        "bytes_sent",
        "bytes_received",
    ):
        assert g[figure] is not None, figure
    first_loss = min(l["first_train_loss"] for l in learners.values())
    assert g["eval_loss"] < first_loss - 1.0, (
        first_loss,
        g["eval_loss"],
    )  # the global model learned
    assert all(l["final_eval_loss"] < first_loss - 1.0 for l in learners.values())
    assert 3.0 < g["push_bits_per_param"] <= 4.6 and 3.0 < g["pull_bits_per_param"] <= 4.6
    assert 0 < g["goodput"] <= 1 and report["wall_seconds"] > 0
    assert g["tokens"] == sum(l["tokens"] for l in learners.values()) == 90 * 16 * 32
    assert all(l["bytes_sent"] > 0 and l["bytes_received"] > 0 for l in learners.values())
    for name in ("loss.png", "wire.png", "lag.png"):
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert report["plots"] == ["loss.png", "wire.png", "lag.png"]
    assert "finished in" in up.output() and "report.json" in up.output()
    # the shard came back from its data directory and the run went on
    assert any("shard 1 exited with status -9; restarting it" in e for e in report["events"]), (
        report["events"]
    )
    assert report["shards"]["1"]["restarts_this_session"] == 1
    assert (run / "logs" / "shard-1.log").read_text().count(
        "recovered ("
    ) == 2  # started, restarted
    children = up.children()
    assert sorted(c["name"] for c in children) == [
        "learner-0",
        "learner-1",
        "shard-0",
        "shard-1",
        "shard-1",
    ]
    assert not [c for c in children if running(c["pid"], "atoll")]


def test_ctrl_c_stops_every_child_and_the_run_resumes(tmp_path, ups):
    run = tmp_path / "run"
    ups.append(up := Up(run, *FLAGS, "--steps", "60"))
    status = run / "learners" / "learner-0.jsonl"
    _wait_for_step(up, "learner-0", 3)
    # the injected fault: a user's Ctrl-C mid-run
    up.proc.send_signal(signal.SIGINT)
    assert up.wait(timeout=60) == 130, up.output()

    children = up.children()
    assert len(children) == 4
    assert not [c for c in children if running(c["pid"], "atoll")], "orphaned children"
    report = up.report()
    assert report["interrupted"] == "SIGINT" and not report["complete"]
    reached = report["learners"]["learner-0"]["steps"]
    assert 3 <= reached < 60
    assert "Resume with: atoll up --run-dir" in up.output()
    assert (run / "shards" / "0").is_dir() and any((run / "shards" / "0").iterdir())  # data kept

    # a resume that asks for other settings is refused, and says why
    refused = subprocess.run(
        [sys.executable, "-m", "atoll.cli", "up", "--run-dir", str(run), "--steps", "99"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--steps 99 (the run has 60)" in refused.stderr, (
        refused.stderr
    )

    ups.append(resumed := Up(run, "--no-table", resume=True))
    assert resumed.wait() == 0, resumed.output()
    report = resumed.report()
    assert report["complete"] and report["interrupted"] is None
    assert [s["outcome"] for s in report["sessions"]] == ["interrupted", "finished"]
    assert (
        report["learners"]["learner-0"]["steps"] == 60
        and report["learners"]["learner-0"]["restarts"] == 1
    )
    records = read_jsonl(status)
    rejoin = max(i for i, r in enumerate(records) if r["state"] == "joining")
    assert (
        next(r for r in records[rejoin:] if r["state"] == "training")["step"]
        == records[rejoin]["step"] + 1
    )
    assert report["global"]["eval_loss"] is not None
    assert not [c for c in resumed.children() if running(c["pid"], "atoll")]
