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


@pytest.mark.timeout(600)
def test_sharded_run_reports_every_process_beside_the_whole_learner():
    run = _bench(
        "--preset", "tiny", "--steps", "20", "--period", "16", "--processes", "2", "--sharded",
        "--memory-syncs", "2", timeout=560,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout)
    assert (r["mode"], r["processes"], r["devices_per_process"]) == ("sharded", 2, 2)
    assert r["params"] > 0 and r["fragments"] >= 1 and all(r["method"].values())
    whole = r["whole"]["bytes"]
    assert whole["pushed"] > 0 and whole["pulled"] > 0 and whole["adoptions"] >= 1, whole
    assert [p["process"] for p in r["per_process"]] == [0, 1]
    for p in r["per_process"]:
        b = p["bytes"]
        assert b["adoptions"] >= 1, b
        # each process sends and receives its own part: something, and less than the whole
        for key in ("pushed", "pulled"):
            assert 0 < b[f"{key}_per_adoption"] < r["whole"]["bytes"][f"{key}_per_adoption"], b
            assert 0 < b[f"{key}_share_of_whole"] < 1, b
        held = p["addressable_fragment_bytes"]
        assert len(held) == r["fragments"] and all(h > 0 for h in held), held
        # a process holds about half of the model (float32), the 1-D leaves whole
        assert 0.4 < sum(held) / (4 * r["params"]) < 0.75, held
        m = p["memory"]
        assert m["sync_windows"] >= 1, m
        assert len(m["ratios"]) == m["sync_windows"] == len(m["fragment_of_window"])
        assert all(r >= 0 for r in m["ratios"]) and m["ratio_max"] == max(m["ratios"]), m
        for key in ("sync_rss_added_bytes", "sync_tracemalloc_added_bytes"):
            assert m[key]["count"] == m["sync_windows"] and m[key]["max"] >= 0, (key, m)
        # a sync allocates something Python sees (its encoded frame at least)
        assert m["sync_tracemalloc_added_bytes"]["max"] > 0, m
        assert p["syncs"]["sync_steps"] >= 1 and p["syncs"]["refused"] == 0, p["syncs"]
        assert p["sync_pause_ms"]["count"] == p["syncs"]["sync_steps"]
        assert 0 < p["bare_step_ms"]["p50"] <= p["bare_step_ms"]["max"]
        assert set(p["targets"]) == {
            "bytes_pushed_share",
            "bytes_pulled_share",
            "sync_memory_ratio",
            "overhead_ratio",
            "sync_pause_ms_p99",
            "sync_pause_cpu_ms_p99",
        }
        assert all(isinstance(t["met"], bool) for t in p["targets"].values())
        assert p["targets"]["bytes_pushed_share"]["want"] == "<= 0.55"
    assert isinstance(r["targets_met"], bool)


def test_processes_without_sharded_get_a_readable_error():
    run = _bench("--processes", "2", timeout=60)
    assert run.returncode == 2 and "only a --sharded learner spans processes" in run.stderr
