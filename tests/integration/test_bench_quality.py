"""`atoll bench quality` end to end at a toy budget: four real runs, one JSON."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from syncer_helpers import REPO

pytestmark = pytest.mark.e2e  # a whole run: `make test-fast` skips it

INIT_LOSS = math.log(256)  # ln 256 ≈ 5.55 nats, uniform over the bytes: above it, diverged
# how far the 4-bit runs may trail the fp32 one in the same test. Measured at this budget
# (four runs of this command on a loaded 2-core host, delayed Nesterov): 4-bit - fp32 from
# -0.45 to -0.02, mixed-speed - fp32 from -0.64 to -0.06 (fp32 3.27 to 3.44, baseline 3.45)
MARGIN_4BIT = 0.5


def test_quality_bench_compares_four_runs_at_equal_tokens(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "atoll.cli",
            "bench",
            "quality",
            "--steps",
            "40",
            "--learners",
            "2",
            "--period",
            "8",
            "--work-dir",
            str(tmp_path),
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(result.stdout)
    for key in ("baseline_eval_loss", "atoll_fp32_eval_loss"):
        assert 0 < r[key] < INIT_LOSS, (key, r[key])  # learned something
    # 4-bit outer gradients (and mixed-speed islands) train about as well as fp32 ones: a
    # diverged outer step (once 3.6 to 10.8 here with Nesterov every round) fails this
    for key in ("atoll_4bit_eval_loss", "atoll_mixed_speed_eval_loss"):
        assert 0 < r[key] < min(INIT_LOSS, r["atoll_fp32_eval_loss"] + MARGIN_4BIT), (
            key,
            r[key],
            r["atoll_fp32_eval_loss"],
        )
    # the mixed-speed run trains the same tokens: its slow learner takes longer, not fewer steps
    assert (
        r["budget"]["tokens"]
        == r["budget"]["baseline_tokens"]
        == r["budget"]["mixed_tokens"]
        == 2 * 40 * 16 * 32
    )
    assert r["budget"]["mixed_slowdown"] == [1.0, 2.0]
    assert (
        abs(
            r["mixed_speed_gap_pct"]
            - 100 * (r["atoll_mixed_speed_eval_loss"] / r["baseline_eval_loss"] - 1)
        )
        < 1e-2
    )
    # the defaults: the paper's outer optimiser, K = 2 (< M at the default M = 4)
    assert (
        r["config"]["outer_lr"] == 0.7
        and r["config"]["outer_momentum"] == 0.9
        and r["config"]["quorum"] == 2
    )
    assert (
        abs(r["gap_pct"] - 100 * (r["atoll_4bit_eval_loss"] / r["baseline_eval_loss"] - 1)) < 1e-2
    )
    # 4-bit frames carry ~8x fewer bytes than fp32 ones; the Init offers are the same in both
    assert r["bytes_atoll"] < r["bytes_atoll_fp32"]
    assert r["bandwidth_reduction"] == round(r["bytes_dp"] / r["bytes_atoll"], 1)
    assert set(r["targets"]) == {"gap_pct", "mixed_speed_gap_pct", "bandwidth_reduction"}
