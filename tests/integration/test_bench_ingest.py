"""`atoll bench ingest` end to end at a tiny size: a real shard process, real learners."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # a whole run: `make test-fast` skips it

FIELDS = (
    "params",
    "learners",
    "fragments",
    "rounds",
    "codec",
    "bits_per_param",
    "pushes_accepted",
    "pushes_expected",
    "ingest_mparams_per_s",
    "wire_mb_per_s",
    "raw_grpc_mb_per_s",
    "ratio",
    "fsync_ms_p50",
    "rss_bytes_per_param",
    "rss_peak_bytes_per_param",
    "rss_note",
    "targets",
    "connections",
    "client_processes",
    "push_latency_ms",
    "raw_latency_ms",
    "core_ms_per_mb",
    "limit_core_ms_per_mb",
    "cost_over_limit",
)


def _bench(*flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atoll.cli", "bench", "ingest", *flags, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(150)  # a loaded 2-core host: the limit and pinned phases add ~10 s
def test_tiny_run_reports_every_figure():
    run = _bench(
        "--params", "2000000", "--learners", "2", "--rounds", "2", "--connections", "5",
        "--cores", "1", timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)
    assert all(f in r for f in FIELDS), sorted(set(FIELDS) - set(r))
    assert r["params"] >= 2_000_000 and (r["learners"], r["fragments"], r["rounds"]) == (2, 8, 2)
    assert (r["connections"], r["client_processes"]) == (5, 2)
    lat = r["push_latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert 0 < r["raw_latency_ms"]["p50"] <= r["raw_latency_ms"]["p99"]
    assert r["pushes_accepted"] == r["pushes_expected"] == 2 * 8 * 2
    assert r["pushes_refused"] == {}
    assert r["shard"]["rounds_closed"] == 8 * 2  # quorum 2, no grace: every round closes
    assert 3.5 < r["bits_per_param"] < 4.5
    for key in (
        "ingest_mparams_per_s",
        "wire_mb_per_s",
        "raw_grpc_mb_per_s",
        "ratio",
        "fsync_ms_p50",
    ):
        assert r[key] > 0, key
    # 4-bit frames: params per second is about twice the MB per second
    assert 1.5 < r["ingest_mparams_per_s"] / r["wire_mb_per_s"] < 2.5
    assert (
        r["rss_bytes_per_param"] > 0 and r["rss_peak_bytes_per_param"] >= r["rss_bytes_per_param"]
    )
    # the same frames on one core, logged with the shard's fsync count
    limit = r["limit"]
    assert limit["pushes"] == 2 * 8 * 2 and limit["fsyncs"] == r["fsyncs"] > 0
    assert limit["mb"] == pytest.approx(r["shard"]["received_mb"], abs=0.2)
    assert 0 < r["limit_core_ms_per_mb"] and 0 < r["core_ms_per_mb"]
    assert r["cost_over_limit"] == pytest.approx(
        r["core_ms_per_mb"] / r["limit_core_ms_per_mb"], rel=0.01
    )
    one = r["cores"]["1"]  # the measured rounds again, the shard on one CPU
    assert len(one["shard_cpus"]) == 1 and one["pushes_accepted"] == 2 * 8 * 2
    assert one["wire_mb_per_s"] > 0 and one["core_ms_per_mb"] > 0
    assert set(r["targets"]) == {"ratio", "rss_bytes_per_param", "fsync_ms_p50", "cost_over_limit"}
    assert all(isinstance(t["met"], bool) for t in r["targets"].values())


def test_bad_flags_get_readable_errors():
    run = _bench("--learners", "0", timeout=30)
    assert run.returncode == 2 and "--learners: must be at least 1" in run.stderr
    run = _bench("--learners", "3", "--connections", "2", timeout=30)
    assert run.returncode == 2 and "--connections 2: want at least one per learner" in run.stderr
    run = _bench("--params", "1000", "--fragments", "50", timeout=30)
    assert run.returncode == 2 and "use --fragments <=" in run.stderr
    run = _bench("--cores", "1,x", timeout=30)
    assert run.returncode == 2 and "want CPU counts like 1,2" in run.stderr
    run = _bench("--cores", "0", timeout=30)
    assert run.returncode == 2 and "want CPU counts of at least 1" in run.stderr
    run = _bench("--params", "1000", "--cores", "1,4096", timeout=30)
    assert run.returncode == 2 and "--cores 4096: this host lets the bench use" in run.stderr


@pytest.mark.timeout(150)
def test_a_run_in_parts_counts_each_push_once_and_is_set_against_the_same_limit():
    run = _bench("--params", "2000000", "--learners", "2", "--rounds", "2", "--parts", "3",
                 timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)
    assert r["parts_per_push"] == 3
    # one accepted push per learner, fragment and round, however many parts it came in
    assert r["pushes_accepted"] == r["pushes_expected"] == 2 * 8 * 2 and r["pushes_refused"] == {}
    assert r["shard"]["rounds_closed"] == 8 * 2
    # every part is made durable before its answer: more fsyncs than whole pushes need
    assert r["fsyncs"] >= 2 * 8 * 2 and r["limit"]["fsyncs"] == r["fsyncs"]
    # the limit is the same frames' unavoidable work, counted as whole pushes
    assert r["limit"]["pushes"] == 2 * 8 * 2
    assert r["limit"]["mb"] == pytest.approx(r["shard"]["received_mb"], rel=0.05)
    assert r["targets"]["cost_over_limit"]["got"] == r["cost_over_limit"] > 0
