"""atoll bench cadence's pieces without a run: the burners are real processes that end
with the block, the figures come from status files as `atoll up` writes them, and bad
input is refused before anything starts (the bench itself: docs/rounds.md, "Under load")."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from atoll.bench import cadence
from atoll.local.config import UpConfig


def test_burners_are_processes_that_end_with_the_block():
    with cadence.burners(2) as pids:
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, 0)  # alive: raises if not
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_summary_counts_outer_steps_against_the_fastest_learners_periods(tmp_path):
    cfg = UpConfig(learners=2, preset="tiny", steps=640, period=64, slowdown=(1.0, 1.0))
    # learner-0 finishes at t=10 (versions 10 then), learner-1 goes on to t=14 (versions 12)
    _write(
        tmp_path / "learners" / "learner-0.jsonl",
        [{"state": "training", "step": s, "time": t} for s, t in ((320, 5.0), (639, 10.0))],
    )
    _write(
        tmp_path / "learners" / "learner-1.jsonl",
        [{"state": "training", "step": s, "time": t} for s, t in ((320, 7.0), (640, 14.0))],
    )
    _write(
        tmp_path / "shards.jsonl",
        [
            {"time": 9.5, "versions": {"0": 10, "1": 9}},
            {"time": 10.5, "versions": {"1": 10}},
            {"time": 14.0, "versions": {"0": 12, "1": 12}},
        ],
    )
    report = {
        "global": {"versions": {"0": 12, "1": 12}, "pull_bits_per_param": 4.4},
        "learners": {"learner-0": {"steps": 640}, "learner-1": {"steps": 640}},
    }
    out = cadence.summary(report, tmp_path, cfg)
    assert out["periods_of_fastest"] == 10.0
    assert out["ratio"] == [1.2, 1.2]
    assert out["ratio_when_fastest_finished"] == [1.0, 0.9]  # fragment 1 was at 9 at t=10
    assert out["pull_bits_per_param"] == 4.4


@pytest.mark.parametrize("bad", [["--seeds", "x"], ["--seeds", "-1"], ["--burners", "-2"]])
def test_bad_input_is_refused_before_anything_runs(bad, capsys):
    p = argparse.ArgumentParser(prog="atoll bench cadence")
    cadence.add_arguments(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args(bad)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err
