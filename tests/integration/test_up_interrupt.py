"""`atoll up` stopped by Ctrl-C before any learner took a step: its learners stop
cleanly (they are not reported as crashed) and no child outlives it."""

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

pytestmark = pytest.mark.e2e  # a whole (short) run: `make test-fast` skips it

FLAGS = ["--preset", "tiny", "--shards", "2", "--learners", "2", "--steps", "60", "--no-table"]


def _children(run_dir: pathlib.Path) -> list[dict]:
    try:
        return json.loads((run_dir / "pids.json").read_text())["children"]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def test_ctrl_c_before_the_first_step_stops_the_learners_cleanly(tmp_path):
    # a new run in runs/<timestamp> under the working directory, as a user starts one
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "atoll.cli", "up", *FLAGS],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    run_dir = None
    try:
        deadline = time.monotonic() + 120
        # the injected fault: Ctrl-C as soon as the learner processes exist, long before
        # their first step (they are still importing: no status record yet)
        while not [c for c in (_children(run_dir) if run_dir else []) if c["kind"] == "learner"]:
            assert up.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            runs = list((tmp_path / "runs").glob("*")) if (tmp_path / "runs").exists() else []
            run_dir = runs[0] if runs else None
            time.sleep(0.02)
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=90) == 130, log.read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for c in _children(run_dir) if run_dir else []:
            if running(c["pid"], "atoll"):
                os.kill(c["pid"], signal.SIGKILL)

    output = log.read_text()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["interrupted"] == "SIGINT" and not report["complete"]
    # the learners were stopped before they wrote a record (what this test is about) ...
    assert not any((run_dir / "learners").glob("learner-*.jsonl")), output
    # ... and are reported as stopped, not crashed, with no false "killed it"
    assert {n: l["state"] for n, l in report["learners"].items()} == {
        "learner-0": "stopped",
        "learner-1": "stopped",
    }, report["events"]
    assert not [e for e in report["events"] if "killed it" in e or "the others go on" in e]
    assert "crashed" not in output
    assert not [c for c in _children(run_dir) if running(c["pid"], "atoll")], "orphaned children"
