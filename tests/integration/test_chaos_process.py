"""`atoll chaos` as a user runs it: real learner and shard processes, SIGKILLed on a
schedule and restarted; training goes on, the killed rejoin, nothing acknowledged is lost."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from atoll.faults.chaos_session import FailureSchedule

pytestmark = pytest.mark.e2e  # a whole run: `make test-fast` skips it

# seed 0 at a 20 s MTBF kills learner-2 at 3.6 s and learner-0 at 13.6 s: both before
# DURATION - 15, so each must train again; a 30 s run (was 40 s) holds every figure below
LEARNERS, DURATION, MTBF, SEED = 3, 30.0, 20.0, 0
SHARD_KILL_AT = 12.0


def test_chaos_run_survives_learner_and_shard_kills(tmp_path):
    # the injector's plan for this seed: at least two learner kills early enough to see a rejoin
    schedule = FailureSchedule(SEED, LEARNERS, MTBF)
    planned = [i for i in range(LEARNERS) if schedule.due(i, DURATION - 15)]
    assert len(planned) >= 2, "pick a seed whose schedule kills learners inside the run"

    work = tmp_path / "chaos"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "atoll.cli",
            "chaos",
            "--learners",
            str(LEARNERS),
            "--shards",
            "2",
            "--duration",
            str(DURATION),
            "--mtbf",
            str(MTBF),
            "--seed",
            str(SEED),
            "--restart-delay",
            "1",
            "--shard-kill-at",
            str(SHARD_KILL_AT),
            "--shard-restart-delay",
            "1",
            "--no-lockstep",
            "--work-dir",
            "chaos",  # relative, as `atoll chaos`'s own ./runs is: learners resume through it
            "--json",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    run = result["runs"]["atoll"]
    assert run["outcome"] == "finished", proc.stderr[-3000:]

    # the faults fired: learners killed with SIGKILL, one shard killed and restarted
    assert result["failures_injected"] >= 2, run["kills"]
    assert result["shard_restarts"] == 1
    assert any("shard" in k for k in run["kills"])
    # nothing acknowledged was lost, across the shard's kill -9 and restart
    assert result["acked_pushes_lost"] == 0
    assert run["pushes_accepted"] > 0 and run["pushes_merged"] > 0

    # the killed learners rejoined: each restart that had time was followed by training
    status = {
        f"learner-{i}": [
            json.loads(l)
            for l in (work / "atoll" / "learners" / f"learner-{i}.jsonl").read_text().splitlines()
            if l.strip()
        ]
        for i in range(LEARNERS)
    }
    kills = [k for k in run["kills"] if "learner" in k]
    for k in kills:
        if k["time"] < DURATION - 15:
            later = [
                r
                for r in status[k["learner"]]
                if r.get("state") == "training" and r["step"] > k["step"]
            ]
            assert later, f"{k['learner']} killed at step {k['step']} never trained again"
    assert run["learners_rejoined"] >= 1
    # by default compiled standbys take the killed learners' ids over (from their checkpoints)
    assert run["standby_takeovers"] >= 1 and result["standbys"] == 2
    assert result["kill_to_first_accepted_push_s"] is not None
    assert result["eval_loss_gap_pct"] is not None  # the failure-free run ran too

    # training continued: versions advanced through the failures, loss went down
    assert run["uptime"] > 0.5
    assert all(v >= 5 for v in run["final_versions"].values()), run["final_versions"]
    assert 0 < result["goodput"] <= 1
    assert (
        result["final_eval_loss"] is not None and result["final_eval_loss"] < 4.0
    )  # from ~5.5 at init
