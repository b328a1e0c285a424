"""A learner of 2 and 4 JAX CPU processes (gloo collectives), as on a multi-host slice:
the same loss trajectory as one process with the same global batch, and the
multi-process learner syncing with a real `atoll syncer` shard, every process ending
on the same parameters."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from syncer_helpers import REPO, free_port, syncer_processes

from atoll.learner import checkpoint
from atoll.wire.records import read_jsonl

pytestmark = pytest.mark.e2e  # a whole run: `make test-fast` skips it

# Measured here: 1, 2 and 4 processes agree to within 1e-6 (float32 reduction order).
LOSS_TOLERANCE = 1e-4
FLAGS = ["--preset", "tiny", "--batch-size", "8", "--eval-batches", "1", "--quiet"]
# the one shard of the tests that sync: K = 1, so process 0's pushes close rounds alone
ONE_SHARD = ["--shard-index", "0", "--num-shards", "1", "--quorum", "1", "--grace-factor", "1"]
ONE_SHARD += ["--lease-seconds", "5"]


def _run(
    tmp: pathlib.Path, name: str, processes: int, flags: list[str], timeout: float = 240.0
) -> list[str]:
    """Runs one learner as `processes` processes to the end; returns each process's log."""
    procs, logs = _start(tmp, name, processes, flags)
    try:
        for i, proc in enumerate(procs):
            assert proc.wait(timeout=timeout) == 0, f"process {i} failed:\n{logs[i].read_text()}"
    finally:
        _kill(procs)
    return [log.read_text() for log in logs]


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _start(
    tmp: pathlib.Path, name: str, processes: int, flags: list[str]
) -> tuple[list[subprocess.Popen], list[pathlib.Path]]:
    """Starts one learner as `processes` processes; returns them and their log files."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}
    base = [
        sys.executable,
        "-m",
        "atoll.cli",
        "learner",
        "--learner-id",
        name,
        "--cache-dir",
        str(tmp / "cache"),
        "--status-file",
        str(tmp / f"{name}.jsonl"),
        *FLAGS,
        *flags,
    ]
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs = [tmp / f"{name}.{i}.log" for i in range(processes)]
    try:
        for i in range(processes):
            extra = (
                []
                if processes == 1
                else [
                    "--coordinator",
                    f"127.0.0.1:{port}",
                    "--num-processes",
                    str(processes),
                    "--process-id",
                    str(i),
                ]
            )
            with open(logs[i], "w") as log:
                procs.append(
                    subprocess.Popen(
                        base + extra,
                        cwd=REPO,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
    except BaseException:
        _kill(procs)
        raise
    return procs, logs


def _losses(path: pathlib.Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(path) if r["state"] == "training"]


def _final_eval(log: str) -> str:
    found = re.findall(r"done at step \d+: eval loss ([0-9.]+)", log)
    assert found, f"no final evaluation in:\n{log}"
    return found[-1]


@pytest.mark.parametrize("processes", [2, 4])
def test_a_multi_process_learner_follows_the_one_process_trajectory(tmp_path, processes):
    flags = ["--baseline", "--steps", "4", "--eval-every", "0"]
    _run(tmp_path, "one", 1, flags)
    logs = _run(tmp_path, "many", processes, flags)
    one, many = _losses(tmp_path / "one.jsonl"), _losses(tmp_path / "many.jsonl")
    assert len(one) == len(many) == 4, "process 0 alone writes the status file, one record a step"
    assert max(abs(a - b) for a, b in zip(one, many)) <= LOSS_TOLERANCE, (one, many)
    assert one[-1] < one[0], "the steps trained"
    # Every process ends on the same parameters (the held-out loss is a collective on each).
    assert len({_final_eval(log) for log in logs}) == 1, logs
    assert all(f"process {i} of {processes}" in log for i, log in enumerate(logs))


def test_a_two_process_learner_syncs_with_a_real_shard(tmp_path):
    with syncer_processes(tmp_path) as start:
        shard = start(tmp_path / "s0", *ONE_SHARD)
        push_log = tmp_path / "pushes.jsonl"
        logs = _run(
            tmp_path,
            "mh",
            2,
            [
                "--shards",
                f"127.0.0.1:{shard.port}",
                "--steps",
                "24",
                "--period",
                "8",
                "--overlap",
                "1",
                "--fragments",
                "2",
                "--eval-every",
                "0",
                "--push-log",
                str(push_log),
            ],
        )
    pushes = read_jsonl(push_log)
    assert {p["learner"] for p in pushes} == {"mh"}
    accepted = [p for p in pushes if p.get("accepted")]
    assert len(accepted) >= 2, pushes
    # Process 0 alone pushes: no (fragment, seq) twice, as a second pusher would give.
    keys = [(p["fragment"], p["seq"]) for p in pushes]
    assert len(keys) == len(set(keys)), pushes
    final = [r for r in read_jsonl(tmp_path / "mh.jsonl") if r["state"] == "done"]
    assert len(final) == 1 and final[0]["step"] == 24 and final[0]["version"] >= 1, final
    # Both processes adopted the same fragments: the same held-out loss to the last digit.
    assert _final_eval(logs[0]) == _final_eval(logs[1]), logs


def test_a_two_process_learner_resumes_its_checkpoint_and_joins_a_moved_on_shard(tmp_path):
    with syncer_processes(tmp_path) as start:
        shard = start(tmp_path / "s0", *ONE_SHARD)
        flags = [
            "--shards",
            f"127.0.0.1:{shard.port}",
            "--period",
            "8",
            "--overlap",
            "1",
            "--fragments",
            "2",
            "--eval-every",
            "0",
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--checkpoint-every",
            "8",
        ]
        # a one-process learner moves the shard's versions on first
        _run(
            tmp_path,
            "solo",
            1,
            [*flags, "--steps", "24", "--learner-index", "0", "--num-learners", "2"],
        )
        mh = [*flags, "--learner-index", "1", "--num-learners", "2"]
        _run(tmp_path, "mh", 2, [*mh, "--steps", "16"])
        saved = checkpoint.read(checkpoint.path_for(tmp_path / "ck", "mh"))
        assert saved is not None and saved.step == 16  # process 0 wrote it
        logs = _run(tmp_path, "mh", 2, [*mh, "--steps", "32"])  # the same learner, given more steps
    records = read_jsonl(tmp_path / "mh.jsonl")
    second = records[next(i for i, r in enumerate(records) if r["state"] == "joining" and i > 0) :]
    training = [r for r in second if r["state"] == "training"]
    assert training[0]["step"] == 17 and second[-1]["state"] == "done" and second[-1]["step"] == 32
    assert "resumed its checkpoint at step 16" in logs[0]
    # process 1 took process 0's start (the joined global weights), not its own
    assert _final_eval(logs[0]) == _final_eval(logs[1]), logs


def test_a_process_stopped_through_process_0_exits_as_process_0_does(tmp_path):
    """SIGTERM to process 0 alone: every process stops at the same step, and each exits
    143 (128 + SIGTERM, a stop before the steps were done), none with an error's 1."""
    with syncer_processes(tmp_path) as start:
        shard = start(tmp_path / "s0", *ONE_SHARD)
        status = tmp_path / "mh.jsonl"
        flags = ["--shards", f"127.0.0.1:{shard.port}", "--steps", "100000", "--period", "8"]
        flags += ["--eval-every", "0", "--slowdown", "2"]
        procs, logs = _start(tmp_path, "mh", 2, flags)
        try:
            deadline = time.monotonic() + 180
            while not any(r["state"] == "training" for r in read_jsonl(status)):
                assert time.monotonic() < deadline, logs[0].read_text()
                assert all(p.poll() is None for p in procs), [f.read_text() for f in logs]
                time.sleep(0.2)
            procs[0].send_signal(signal.SIGTERM)
            codes = [p.wait(timeout=120) for p in procs]
        finally:
            _kill(procs)
    assert codes == [143, 143], [f.read_text() for f in logs]
    assert "stopped by process 0" in logs[1].read_text()
    stopped = [r for r in read_jsonl(status) if r["state"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["step"] < 100000, stopped
