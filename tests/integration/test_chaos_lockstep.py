"""`atoll chaos`'s lockstep run with checkpoint-restart (its default, lockstep_restart) in
real processes: one learner's failure takes every learner down, all restart from their
checkpoints, and the synchronous run goes on to its end."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from syncer_helpers import REPO

from atoll.faults.chaos_session import FailureSchedule
from atoll.wire.records import read_jsonl

pytestmark = pytest.mark.e2e  # a whole run: `make test-fast` skips it

LEARNERS, DURATION, MTBF, SEED = 2, 35.0, 40.0, 54
INIT_LOSS = math.log(256)  # nats: a byte model's loss, uniform over the bytes


def _kill_times(seed: int, learners: int, mtbf: float, duration: float) -> list[tuple[float, int]]:
    """(seconds on the failure clock, learner) of each kill the schedule draws in `duration`."""
    schedule, kills = FailureSchedule(seed, learners, mtbf), []
    for tenth in range(int(duration * 10)):
        kills += [(tenth / 10, i) for i in range(learners) if schedule.due(i, tenth / 10)]
    return kills


def test_a_lockstep_run_restarts_every_learner_from_its_checkpoint_and_goes_on(tmp_path):
    # the injected fault: the schedule kills learner-0 once, early enough to see the restart
    # train on (rejoining takes a restart's import and compile: 10-20 s on a loaded host)
    kills = _kill_times(SEED, LEARNERS, MTBF, DURATION)
    assert [i for _, i in kills] == [0] and kills[0][0] < 10, f"pick another seed: {kills}"

    work = tmp_path / "chaos"
    flags = ["--learners", str(LEARNERS), "--shards", "1", "--duration", str(DURATION)]
    flags += ["--mtbf", str(MTBF), "--seed", str(SEED), "--restart-delay", "1", "--period", "16"]
    # the lockstep run alone: no atoll run (test_chaos_process holds its figures), no standbys
    # (a lockstep run has none), no failure-free run; no shard kill (at 40 s)
    flags += ["--no-atoll", "--standbys", "0", "--no-failure-free"]
    flags += ["--work-dir", str(work), "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "atoll.cli", "chaos", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    lockstep = result["runs"]["lockstep"]
    assert lockstep["outcome"] == "finished", proc.stderr[-3000:]
    assert result["acked_pushes_lost"] == 0

    # the fault fired and took the job down as one: both learners killed, for learner-0
    assert sorted((k["learner"], k["cause"]) for k in lockstep["kills"]) == [
        ("learner-0", "learner-0"),
        ("learner-1", "learner-0"),
    ], lockstep["kills"]
    assert lockstep["learner_restarts"] == 2 and lockstep["learners_rejoined"] == 2
    # the lockstep run alone ran, and its failures are the figures' failures
    assert list(result["runs"]) == ["lockstep"] and result["goodput"] is None, result["runs"]
    assert result["failures_injected"] == lockstep["failures_injected"] == 1
    # it reports its figures; rounds read while open are named in the figures and in the
    # lockstep report, never waited out (its leases never lapse)
    for figure in ("lockstep_goodput", "lockstep_uptime"):
        assert result[figure] is not None and 0 < result[figure] <= 1, figure
    # its global model learned: an untrained model starts at uniform over the bytes
    # (ln 256 = 5.55 nats) and a run that never learned stays there; measured 1.78, so
    # 1.5 nats under uniform leaves a loaded host (fewer steps in the 35 s, a longer
    # restart) more than 2 nats
    loss = result["lockstep_final_eval_loss"]
    assert loss is not None and loss < INIT_LOSS - 1.5, result
    report = json.loads((work / "lockstep" / "report.json").read_text())
    assert report["global"]["open_rounds"] == lockstep["open_rounds"]
    assert any("evaluating the global model" in e for e in report["events"])

    killed_at = {k["learner"]: k["step"] for k in lockstep["kills"]}
    for name, step in killed_at.items():
        records = read_jsonl(work / "lockstep" / "learners" / f"{name}.jsonl")
        trained = [i for i, r in enumerate(records) if r["state"] == "training"]
        # the restarted process: its first record after the kill
        back = next(i for i in range(trained[0], len(records)) if records[i]["state"] == "joining")
        # ... resumed its checkpoint: not from step 0, not past where it was killed
        assert 0 < records[back]["step"] <= step, (name, records[back], step)
        # ... and the synchronous run went on: a round with both learners in it closed (how
        # many depends on how long the restart's import and compile took on a loaded host)
        after = [r for r in records[back:] if r["state"] == "training"]
        assert after and after[-1]["version"] > after[0]["version"], (name, after[-1:])
        pushes = read_jsonl(work / "lockstep" / "learners" / f"{name}.pushes.jsonl")
        merged = [
            p
            for p in pushes
            if p["accepted"]
            and p["time"] > records[back]["time"]
            and p["merged_in"] <= lockstep["final_versions"][str(p["fragment"])]
        ]
        assert merged, f"{name} pushed nothing after its restart that the global model holds"
