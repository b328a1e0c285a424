"""`atoll bench cadence` end to end at a tiny size: a real `atoll up` per seed, its figures
read back from the run's own files (the pieces: tests/test_bench_cadence.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # a whole run: `make test-fast` skips it


@pytest.mark.timeout(240)
def test_tiny_run_reports_every_figure(tmp_path):
    work = tmp_path / "runs"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "atoll.cli",
            "bench",
            "cadence",
            "--steps",
            "64",
            "--period",
            "8",
            "--learners",
            "2",
            "--burners",
            "0",
            "--seeds",
            "0",
            "--work-dir",
            str(work),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout)
    assert r["settings"]["seeds"] == [0] and r["settings"]["burners"] == 0
    one = r["runs"]["0"]
    report = json.loads((work / "seed0" / "report.json").read_text())
    # the outer steps are the run's own final versions, over the fastest learner's periods
    final = [
        int(v) for _, v in sorted(report["global"]["versions"].items(), key=lambda kv: int(kv[0]))
    ]
    assert one["outer_steps_per_fragment"] == final and len(final) == 4 and min(final) >= 1
    assert one["periods_of_fastest"] == 64 / 8
    assert one["ratio"] == [round(v / 8, 3) for v in final]
    assert one["pull_bits_per_param"] == report["global"]["pull_bits_per_param"] > 0
    assert r["ratio_range"] == [min(one["ratio"]), max(one["ratio"])]
    low, high = r["targets"]["ratio_within"]
    assert r["targets"]["ratio_met"] == all(low <= x <= high for x in one["ratio"])
