"""`atoll bench wan` as a real process over real emulated regions (root: this machine and CI),
and the region-to-region path its data-parallel run's gloo traffic takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from syncer_helpers import REPO

from atoll.faults.wan import Wan, WanConfig, available

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


def _env() -> dict[str, str]:
    """This test's environment (read when it runs: the suite sets what each test runs under)."""
    return {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.mark.timeout(120)
def test_region_to_region_tcp_crosses_both_links_and_the_delay():
    """A server in region 1 on an ephemeral port (as gloo binds) is reached from region 0 one
    latency away each way; the bytes leave by 0's uplink and enter by 1's downlink."""
    cfg = WanConfig(regions=2, rate_mbit=20, latency_ms=30)
    with Wan(cfg, [1], peer_ports=(61100, 61107)) as wan:
        server = subprocess.Popen(
            wan.command_prefix(1)
            + [sys.executable, "-c", _SERVER.format(host=wan.region_address(1))],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            port = int(server.stdout.readline())
            assert 61100 <= port <= 61107, port
            before = wan.stats()
            client = subprocess.run(
                wan.command_prefix(0)
                + [sys.executable, "-c", _CLIENT.format(host=wan.region_address(1), port=port)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert client.returncode == 0, client.stderr
            result = json.loads(client.stdout)
        finally:
            server.kill()
            server.wait()
        after = wan.stats()
    # one latency each way through the proxy: >= 60 ms for a round trip
    assert result["rtt_s"] >= 0.058, result
    # 1 MB at 20 Mbit/s takes >= 0.4 s
    assert result["upload_s"] >= 0.38, result

    def grew(region, key):
        return after[region][key]["bytes"] - before[region][key]["bytes"]

    assert grew(0, "tc_up") > 1_000_000 and grew(1, "tc_down") > 1_000_000
    assert grew(1, "tc_up") < 200_000 and grew(0, "tc_down") < 200_000
    assert after[0]["bytes_up"] >= 1_000_000 and after[1]["bytes_down"] >= 1_000_000
    listed = subprocess.run(["ip", "rule"], capture_output=True, text=True).stdout
    assert wan.name not in listed, "routing rules left behind"


_SERVER = """
import socket
s = socket.socket(); s.bind(("{host}", 0)); s.listen()
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.sendall(c.recv(1))  # ping
    n = 0
    while (x := c.recv(65536)):
        n += len(x)
    c.sendall(b"k"); c.close()
"""
_CLIENT = """
import json, socket, time
c = socket.create_connection(("{host}", {port}), timeout=30)
t = time.perf_counter(); c.sendall(b"p"); c.recv(1); rtt = time.perf_counter() - t
t = time.perf_counter(); c.sendall(bytes(1_000_000)); c.shutdown(socket.SHUT_WR); c.recv(1)
print(json.dumps({{"rtt_s": rtt, "upload_s": time.perf_counter() - t}}))
"""


@pytest.mark.timeout(600)
def test_tiny_run_reports_every_figure(tmp_path):
    """Both modes over 2 regions for a few steps: the figures, the links' bytes and the plot."""
    done = subprocess.run(
        [sys.executable, "-m", "atoll.cli", "bench", "wan", "--json"]
        + ["--steps", "16", "--evals", "2", "--batch-size", "8", "--rate-mbit", "20"]
        + ["--latency-ms", "10", "--work-dir", str(tmp_path / "runs"), "--out", str(tmp_path)]
        + ["--period", "4"],
        capture_output=True,
        text=True,
        timeout=560,
        env=_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout)
    dp, atoll, c = r["data_parallel"], r["atoll"], r["comparison"]
    for run in (dp, atoll):
        assert run["steps"] == 16 and run["tokens"] == 16 * 2 * 8 * 32
        assert run["train_seconds"] > 0 and run["steps_per_s"] > 0
        assert set(run["links"]) == {"r0_up", "r0_down", "r1_up", "r1_down"}
        # every link carries traffic while training: a mean over the window within the
        # link's 20 Mbit/s, and a peak over one 0.5 s sample that is neither nothing nor
        # past the link's rate by more than its burst and the sampler's timing (the peak
        # leaves out the two samples that straddle the window's edges, which the mean
        # interpolates, so a mean above the peak can happen and is not checked)
        for name, v in run["links"].items():
            assert v["bytes"] > 0 and 0 < v["mean_mbit_s"] <= 20, (name, v)
            assert 0 < v["peak_mbit_s"] <= 1.5 * 20, (name, v)
        # both learn in 16 steps: atoll's global model too (4.81 -> 3.99 measured)
        assert run["eval"][-1]["eval_loss"] < run["eval"][0]["eval_loss"], run["eval"]
    # every data-parallel step all-reduces a fp32 gradient: each direction of every link
    # carries 4 bytes per parameter per step (a 2-process ring). The links are sampled
    # every 0.5 s over the training window, so its edges may miss a few steps' bytes: at
    # least half the steps' worth, far above what atoll's 4-bit syncs would send
    assert min(v["bytes"] for v in dp["links"].values()) >= 16 // 2 * 4 * dp["params"]
    assert dp["median_step_s"]["all_reduce_s"] > 0 and dp["all_reduce_over_compute"] > 0
    assert atoll["eval"][-1]["model"] == "global"
    assert atoll["settings"]["period"] == 4  # --period reached the learners
    for key in ("speedup_at_equal_loss", "bandwidth_ratio", "dp_needed_mbit_s"):
        assert c[key] is not None and c[key] > 0, key
    assert set(c["targets"]) == {
        "speedup_at_equal_loss",
        "bandwidth_ratio",
        "eval_loss_gap_pct_equal_tokens",
    }
    assert (tmp_path / "wan.png").stat().st_size > 10_000


@pytest.mark.timeout(300)
def test_sigterm_during_the_data_parallel_run_ends_it_at_once(tmp_path):
    """SIGTERM while the data-parallel job trains: the bench exits 143 within seconds, with
    its workers, its coordinator and its regions gone (not orphaned until the coordination
    service's heartbeat timeout)."""
    runs = tmp_path / "runs"
    before = _namespaces()
    bench = subprocess.Popen(
        [sys.executable, "-m", "atoll.cli", "bench", "wan", "--json", "--steps", "100000"]
        + ["--rate-mbit", "20", "--latency-ms", "5", "--work-dir", str(runs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        records = runs / "data-parallel" / "records.jsonl"
        deadline = time.monotonic() + 240
        while not (records.exists() and records.read_text().count("\n") >= 3):
            assert bench.poll() is None, bench.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the data-parallel job never trained"
            time.sleep(0.5)
        assert _processes_naming(runs / "data-parallel"), "no worker names its directory"
        bench.terminate()
        stopped = time.monotonic()
        _, err = bench.communicate(timeout=60)
        took = time.monotonic() - stopped
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 143, err[-3000:]
    # it stops in 1-2 s (workers, coordinator and regions torn down); 10 s still binds
    # under a loaded CI host where a wait for the heartbeat timeout (minutes) would not pass
    assert took < 10 and "stopped by SIGTERM" in err, (took, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert _processes_naming(runs / "data-parallel") == [], "workers left running"
    assert _namespaces() <= before, _namespaces() - before


def _processes_naming(path) -> list[int]:
    """Pids of processes whose command line names `path`."""
    found = subprocess.run(["pgrep", "-f", str(path)], capture_output=True, text=True).stdout
    return [int(pid) for pid in found.split()]


def _namespaces() -> set[str]:
    """The network namespaces a Wan made (atoll-*) that exist now."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {word for word in listed.split() if word.startswith("atoll-")}
