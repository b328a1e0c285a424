"""`atoll bench learner` end to end at a tiny size: a real shard process, the real API.

Checks the report's shape and that its figures are measured, not the targets: timing
targets live in the bench."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # a whole run: `make test-fast` skips it

SUMMARIES = (
    "bare_step_ms",
    "api_step_no_sync_ms",
    "api_step_sync_ms",
    "learner_step_no_sync_ms",
    "sync_pause_ms",
    "sync_pause_cpu_ms",
)


def _bench(*flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atoll.cli", "bench", "learner", *flags, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(150)
def test_tiny_run_reports_every_figure():
    run = _bench("--preset", "tiny", "--steps", "60", "--period", "8")
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)
    assert (r["preset"], r["period"], r["steps"]["pairs"]) == ("tiny", 8, 60)
    assert r["params"] > 0 and r["fragments"] >= 1 and r["method"]
    syncs = r["syncs"]
    assert syncs["sync_steps"] + syncs["no_sync_steps"] == 60
    assert syncs["pushes_started"] >= 1 and syncs["adoptions"] >= 1, syncs
    assert syncs["refused"] == 0 and syncs["stalled"] == 0, syncs
    assert r["bare_step_ms"]["count"] == 60
    assert r["sync_pause_ms"]["count"] == syncs["sync_steps"]
    for key in SUMMARIES:
        s = r[key]
        assert s["count"] >= 1, key
        assert 0 < s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (key, s)
        assert math.isfinite(s["max"]) and s["mean"] > 0, (key, s)
    low, high = r["overhead_ratio_ci95"]
    assert all(math.isfinite(x) for x in (r["overhead_ratio"], low, high)) and low <= high
    assert set(r["targets"]) == {"overhead_ratio", "sync_pause_ms_p99"}
    assert all(isinstance(t["met"], bool) for t in r["targets"].values())
    assert r["targets"]["sync_pause_ms_p99"]["got"] > 0


def test_bad_flags_get_readable_errors():
    run = _bench("--period", "1", timeout=60)
    assert run.returncode == 2 and "--period 1: overlap" in run.stderr, run.stderr
    run = _bench("--preset", "huge", timeout=60)
    assert run.returncode == 2 and "invalid choice: 'huge'" in run.stderr, run.stderr
