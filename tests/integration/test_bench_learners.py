"""`atoll bench learners` end to end at a tiny size: a real shard process, real client
processes over gRPC; the structure and sanity of its report, not the targets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # a whole run: `make test-fast` skips it

FRAGMENTS = 2


def _bench(*flags: str, timeout: float = 500) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atoll.cli", "bench", "learners", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _sane(phase: dict) -> None:
    assert phase["shard_cpu_seconds"] > 0 and phase["cpu_ms_per_push"] > 0
    assert 0 < phase["push_ms_p50"] <= phase["push_ms_p99"]
    assert phase["seconds"] > 0 and phase["rounds_per_second"] > 0
    assert sum(phase["outcomes"].values()) == phase["pushes"]


@pytest.mark.timeout(600)
def test_tiny_run_reports_every_figure():
    # each churn run waits twice for its crowd to be forgotten, 11 leases + 1 s each time:
    # at a 0.1 s lease that is 4 x 2.1 s of the run (4 x 4.3 s at 0.3 s)
    run = _bench(
        "--learners", "10,50", "--waves", "1", "--min-pushes", "200", "--churn-pushes", "2",
        "--churn-lease", "0.1", "--processes", "2", "--inflight", "4",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout)
    assert r["learners"] == [10, 50] and r["fragments"] == FRAGMENTS and r["quorum"] == 2
    assert r["transport"] == "stream" and r["other_transports"] == {}
    for n in (10, 50):
        steady, churn = r["steady"][str(n)], r["churn"][str(n)]
        _sane(steady)
        _sane(churn)
        # every learner pushed every fragment once a wave, each accepted, one round each
        assert steady["pushes"] == n * FRAGMENTS * steady["waves"] == steady["accepted"]
        assert steady["waves"] >= 200 // (n * FRAGMENTS)
        assert steady["every_wave_closed_its_rounds"] and steady["joins_failed"] == 0
        assert steady["rounds_closed"] == FRAGMENTS * steady["waves"]
        assert steady["outcomes"] == {"fresh": steady["pushes"]}
        assert steady["rss_per_learner_bytes"] is not None
        # each churn learner pushed each fragment twice and left; all were forgotten
        assert churn["pushes"] == n * FRAGMENTS * 2 and churn["accepted"] > 0
        assert churn["rounds_closed"] > 0 and churn["live_after"] == 0
        assert isinstance(churn["rss_per_departed_learner_bytes"], int)
    ratio = r["steady"]["50"]["cpu_ms_per_push"] / r["steady"]["10"]["cpu_ms_per_push"]
    assert r["cpu_per_push_ratio"] == pytest.approx(ratio, rel=0.01)
    assert set(r["targets"]) == {"cpu_per_push_ratio"}  # the others need 1,000 learners
    target = r["targets"]["cpu_per_push_ratio"]
    assert target["want"] == 1.5 and target["met"] == (target["got"] <= 1.5)


@pytest.mark.timeout(300)
def test_both_transports_in_one_run():
    run = _bench(
        "--learners", "10", "--modes", "steady", "--waves", "1", "--min-pushes", "20",
        "--processes", "1", "--inflight", "2", "--transport", "call,stream",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout)
    assert r["transport"] == "call" and set(r["other_transports"]) == {"stream"}
    for steady in (r["steady"]["10"], r["other_transports"]["stream"]["steady"]["10"]):
        _sane(steady)
        assert steady["outcomes"] == {"fresh": steady["pushes"]} and steady["pushes"] == 20
        assert steady["every_wave_closed_its_rounds"]


def test_bad_flags_get_readable_errors():
    for flags, says in [
        (("--learners", "1,10"), "each count must be >= 2"),
        (("--learners", "ten"), "want learner counts like 10,100"),
        (("--churn-lease", "0"), "--churn-lease must be > 0"),
        (("--waves", "0"), "--waves"),
        (("--modes", "fast"), "want steady, churn or both"),
        (("--transport", "udp"), "want stream, call or both"),
        (("--transport", "call,call"), "want stream, call or both"),
    ]:
        run = _bench(*flags, timeout=60)
        assert run.returncode == 2 and says in run.stderr and "Traceback" not in run.stderr, flags
