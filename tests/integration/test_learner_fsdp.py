"""`atoll learner --fsdp` as one learner of 2 JAX processes x 2 CPU devices (gloo): the
built-in model's params split over the slice's 4 devices, every process pushing its own
parts of each fragment to real `atoll syncer` shards, which publish versions; a --fsdp
the slice's devices cannot take is one line on every process, exit status 2."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import grpc
import pytest
from syncer_helpers import REPO, free_port, syncer_processes

from atoll.wire.client import ShardClient
from atoll.wire.records import read_jsonl

pytestmark = pytest.mark.e2e  # real processes: `make test-fast` skips it

FLAGS = ["--preset", "tiny", "--batch-size", "8", "--eval-batches", "1", "--quiet"]
SHARD = ["--quorum", "1", "--grace-factor", "1", "--lease-seconds", "5"]  # and its index, count


def _learner(
    tmp: pathlib.Path, flags: list[str], timeout: float = 300, run: str = "learner"
) -> list[tuple[int, str]]:
    """Runs `atoll learner` as 2 processes x 2 CPU devices to its end; each one's
    (exit status, log), the log also in tmp/<run>.<process>.log."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false",
    }
    port, procs = free_port(), []
    logs = [tmp / f"{run}.{i}.log" for i in range(2)]
    for i in range(2):
        cmd = [sys.executable, "-m", "atoll.cli", "learner", "--learner-id", "slice"]
        cmd += ["--cache-dir", str(tmp / "cache"), *FLAGS, *flags]
        cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
        cmd += ["--process-id", str(i)]
        with open(logs[i], "w") as log:
            procs.append(
                subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
    try:
        codes = [proc.wait(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return [(code, log.read_text()) for code, log in zip(codes, logs)]


def _published_version(port: int, fragment: int) -> int:
    """The version the shard on `port` publishes of `fragment`, or -1 if not its."""
    client = ShardClient(f"127.0.0.1:{port}", "observer", deadline=10)
    try:
        return int(client.pull(fragment).version)
    except grpc.RpcError:
        return -1
    finally:
        client.close()


def test_a_two_process_learner_trains_fsdp_sharded_and_the_shards_publish(tmp_path):
    with syncer_processes(tmp_path) as start:
        shards = [
            start(tmp_path / f"s{i}", "--shard-index", str(i), "--num-shards", "2", *SHARD)
            for i in range(2)
        ]
        addresses = ",".join(f"127.0.0.1:{s.port}" for s in shards)
        push_log = tmp_path / "pushes.jsonl"
        status = tmp_path / "slice.jsonl"
        runs = _learner(
            tmp_path,
            ["--shards", addresses, "--fsdp", "all", "--steps", "24", "--period", "4"]
            + ["--overlap", "1", "--fragments", "2", "--eval-every", "0"]
            + ["--push-log", str(push_log), "--status-file", str(status)],
        )
        for code, log in runs:
            assert code == 0, log
        versions = [max(_published_version(s.port, p) for s in shards) for p in range(2)]
    # Every process split the model's matrices over the 4 devices of the slice...
    for _, log in runs:
        (split,) = re.findall(r"fsdp 4 over 4 devices: (\d+) of \d+ tensors split", log)
        assert int(split) > 0, log
    # ...and sent its own parts of every push: each a share of the learner's bytes.
    sent = [int(re.findall(r"\(sent (\d+) bytes\)", log)[-1]) for _, log in runs]
    assert all(b > 0.25 * sum(sent) for b in sent), sent
    # Each fragment's rounds closed and the shards published them.
    accepted = [p for p in read_jsonl(push_log) if p.get("accepted")]
    assert {p["fragment"] for p in accepted} == {0, 1}, accepted
    assert min(versions) >= 3, versions
    done = [r for r in read_jsonl(status) if r["state"] == "done"]
    assert len(done) == 1 and done[0]["step"] == 24 and done[0]["version"] >= 1, done
    # The held-out loss is computed over the split params on both: the same to the digit.
    finals = {re.findall(r"done at step 24: eval loss ([0-9.]+)", log)[-1] for _, log in runs}
    assert len(finals) == 1, runs


def test_a_two_process_fsdp_learner_resumes_its_checkpoint(tmp_path):
    """What a recreated multi-host pod set does: every process writes its own shards of the
    checkpoint at the end, and the same learner given more steps resumes there."""
    with syncer_processes(tmp_path) as start:
        shard = start(tmp_path / "s0", "--shard-index", "0", "--num-shards", "1", *SHARD)
        status = tmp_path / "slice.jsonl"
        flags = ["--shards", f"127.0.0.1:{shard.port}", "--fsdp", "all", "--period", "4"]
        flags += ["--overlap", "1", "--fragments", "2", "--eval-every", "0"]
        flags += ["--status-file", str(status), "--checkpoint-dir", str(tmp_path / "ck")]
        flags += ["--checkpoint-every", "8"]
        for code, log in _learner(tmp_path, [*flags, "--steps", "16"], run="first"):
            assert code == 0, log
        runs = _learner(tmp_path, [*flags, "--steps", "24"], run="second")
        for code, log in runs:
            assert code == 0, log
    assert all("from step 16 (its checkpoint)" in log for _, log in runs), runs
    records = read_jsonl(status)
    second = records[next(i for i, r in enumerate(records) if r["state"] == "joining" and i > 0) :]
    training = [r for r in second if r["state"] == "training"]
    assert training[0]["step"] == 17 and second[-1]["state"] == "done" and second[-1]["step"] == 24
    finals = {re.findall(r"done at step 24: eval loss ([0-9.]+)", log)[-1] for _, log in runs}
    assert len(finals) == 1, runs


def test_an_fsdp_the_slice_cannot_take_is_one_line_on_every_process(tmp_path):
    runs = _learner(tmp_path, ["--baseline", "--fsdp", "3", "--steps", "2"], timeout=180)
    for code, log in runs:
        assert code == 2, log
        assert "Traceback" not in log, log
        errors = [line for line in log.splitlines() if "error:" in line]
        assert errors == [
            "atoll learner: error: --fsdp 3 does not divide the island's 4 devices: use one "
            "of 1, 2, 4, or all (0)"
        ], log
