"""The data-parallel baseline of `atoll bench wan`: two processes all-reducing over gloo train
exactly what one process trains on both shards' rows (no emulation: both on this host)."""

from __future__ import annotations

import os
import pathlib

import pytest
from procs import processes_naming

from atoll.bench import data_parallel as dp

pytestmark = pytest.mark.timeout(400)


def test_two_processes_over_gloo_follow_the_one_process_trajectory(tmp_path: pathlib.Path):
    cfg = dp.DataParallelConfig(
        preset="tiny", shards=2, batch_size=4, steps=12, eval_every=6, eval_batches=2
    )
    port = dp.free_port()
    coordinator = dp.start_coordinator(2, port)
    try:
        here = dp.Placement([], f"127.0.0.1:{port}", "127.0.0.1")
        job = dp.run_job(cfg, [here, here], tmp_path, timeout=360)
    finally:
        coordinator.terminate()
        coordinator.wait()
    alone = dp.train(cfg)
    two = [r["loss"] for r in job["records"] if "loss" in r]
    one = [r["loss"] for r in alone["records"] if "loss" in r]
    assert len(two) == len(one) == cfg.steps
    assert two[-1] < two[0] - 0.1, "the job did not train"
    assert max(abs(a - b) for a, b in zip(two, one)) < 1e-4, (two, one)
    evals = [r["eval_loss"] for r in job["records"] if "eval_loss" in r]
    assert len(evals) == 3  # steps 0, 6 and 12
    assert abs(job["final_eval_loss"] - alone["final_eval_loss"]) < 1e-4
    assert job["processes"] == 2 and alone["processes"] == 1
    assert all(job["median"][k] > 0 for k in ("compute_s", "all_reduce_s", "update_s"))


PARENT = """
import pathlib, sys
from atoll.bench import data_parallel as dp
port, work = int(sys.argv[1]), pathlib.Path(sys.argv[2])
cfg = dp.DataParallelConfig(preset="tiny", shards=2, batch_size=4, steps=100000, eval_every=0)
coordinator = dp.start_coordinator(2, port)
here = dp.Placement([], f"127.0.0.1:{port}", "127.0.0.1")
dp.run_job(cfg, [here, here], work, timeout=600)
"""


def test_a_killed_job_takes_its_coordinator_and_workers_along(tmp_path: pathlib.Path):
    """However the bench dies, its coordinator and workers go too, within seconds: the
    coordinator's own shutdown waited minutes for workers that were killed."""
    import signal
    import subprocess
    import sys
    import time

    port = dp.free_port()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(port), str(tmp_path)])
    marks = (f"--port {port} ", str(tmp_path / "records.jsonl"))
    try:
        deadline = time.monotonic() + 300
        records = tmp_path / "records.jsonl"  # a step recorded: the workers joined the service
        while not (records.exists() and records.read_text().strip()):
            assert parent.poll() is None and time.monotonic() < deadline, "the job never trained"
            time.sleep(0.2)
        assert len(processes_naming(*marks)) == 3  # the coordinator and both workers
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        gone_by = time.monotonic() + 15
        while (left := processes_naming(*marks)) and time.monotonic() < gone_by:
            time.sleep(0.2)
        assert not left, f"outlived the killed job: {left}"
    finally:
        parent.kill()
        for pid in processes_naming(*marks):
            os.kill(pid, signal.SIGKILL)
