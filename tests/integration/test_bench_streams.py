"""`atoll bench streams` end to end at a tiny size: a real shard process, real client processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # a whole run: `make test-fast` skips it


def _bench(*flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atoll.cli", "bench", "streams", *flags, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(150)
def test_tiny_crowd_reports_every_figure():
    run = _bench(
        "--watches",
        "120",
        "--stalled",
        "20",
        "--seconds",
        "1",  # per phase: 3.5 phases, each >= 2 pushes at the interval below (1 in the half)
        "--push-interval",
        "0.5",
        "--crowd-processes",
        "2",
    )
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)
    assert (r["watch_streams"], r["stalled_pushes"]) == (120, 20)
    assert r["open_calls_at_shard"]["Watch"] == 120 and r["open_calls_at_shard"]["Push"] >= 20
    assert (
        r["crowd_errors"] == [] and r["watch_notices_received"] >= 120 * 4
    )  # each fragment's version, then more
    for phase in ("before", "during", "after", "after_second_crowd"):
        p = r[phase]
        assert p["health_checks"] > 0 and p["health_failures"] == 0, phase
        assert p["pushes"] > 0 and p["pushes_accepted"] == p["pushes"], phase
        assert p["health_ms_p99"] > 0 and p["push_ms_p50"] > 0, phase
    assert r["rss_mb"]["crowd_open"] > 0 and r["rss_kb_per_open_stream"] is not None
    assert set(r["targets"]) == {"health_p99_ms", "pushes_accepted", "rss_flat"}
    assert all(isinstance(t["met"], bool) for t in r["targets"].values())
    assert r["targets"]["pushes_accepted"]["met"]


def test_bad_flags_get_readable_errors():
    run = _bench("--watches", "0", "--stalled", "0", timeout=30)
    assert run.returncode == 2 and "not both 0" in run.stderr and "Traceback" not in run.stderr
    run = _bench("--crowd-processes", "0", timeout=30)
    assert run.returncode == 2 and "--crowd-processes: must be at least 1" in run.stderr
