"""A learner whose params are sharded over 2 JAX processes x 2 CPU devices (gloo), FSDP
alone or FSDP x tensor parallel on a 2 x 2 mesh: every process pushes its own boxes as
parts of each push, and the run publishes the same global weights as one process holding
the params replicated; processes that
disagree (plan, sharding, call order) each get a clear error."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from sharded_learners import addresses as shards_at
from sharded_learners import published, shards
from syncer_helpers import REPO, free_port

pytestmark = pytest.mark.e2e  # real processes: `make test-fast` skips it

WORKER = pathlib.Path(__file__).with_name("sharded_learner_worker.py")
FRAGMENTS = 2  # the worker's


def _learn(
    tmp: pathlib.Path, name: str, processes: int, num_shards: int, flags: list[str]
) -> tuple[list[dict], np.ndarray]:
    """Runs the worker as one learner of `processes` processes against fresh shards
    (quorum 1); returns each process's report and the published weights, fragment after
    fragment (none where a process failed)."""
    with shards(tmp, name, num_shards) as servers:
        addresses = shards_at(servers)
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2 "
            "--xla_cpu_multi_thread_eigen=false",
        }
        port, procs = free_port(), []
        for i in range(processes):
            cmd = [sys.executable, str(WORKER), "--shards", addresses]
            cmd += ["--out", str(tmp / f"{name}.{i}.json"), *flags]
            if processes > 1:
                cmd += ["--coordinator", f"127.0.0.1:{port}"]
                cmd += ["--num-processes", str(processes), "--process-id", str(i)]
            log = open(tmp / f"{name}.{i}.log", "w")  # noqa: SIM115 (closed with the process)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        try:
            for i, proc in enumerate(procs):
                assert proc.wait(timeout=240) == 0, (tmp / f"{name}.{i}.log").read_text()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        reports = [json.loads((tmp / f"{name}.{i}.json").read_text()) for i in range(processes)]
        if any("error" in r for r in reports):
            return reports, np.empty(0, np.float32)
        return reports, np.concatenate(published(addresses))


# What each process of a sharded learner holds of every leaf (its shards' shapes) and its
# share of the elements the learner pushes (w0 1024, w1 512, b 64, emb 128: 1728 in all).
MESHES = {
    "fsdp": (
        {"w0": [[4, 64]] * 2, "w1": [[2, 64]] * 2, "b": [[64]] * 2, "emb": [[1, 32]] * 2},
        [(512 + 256 + 64 + 64) / 1728, (512 + 256 + 64) / 1728],
    ),
    # w1, P(None, "tp"), is held by both processes and sent by process 0 alone
    "fsdp-tp": (
        {"w0": [[8, 32]] * 2, "w1": [[8, 32]] * 2, "b": [[64]] * 2, "emb": [[2, 32]] * 2},
        [(512 + 512 + 64 + 64) / 1728, (512 + 64) / 1728],
    ),
}


@pytest.mark.parametrize("num_shards", [1, 2])
def test_a_sharded_learner_publishes_what_a_replicated_one_does(tmp_path, num_shards):
    replicated, replicated_weights = _learn(tmp_path, "replicated", 1, num_shards, ["--replicated"])
    assert "error" not in replicated[0], replicated
    assert min(v for v, _ in replicated[0]["versions"].values()) >= 3, replicated
    whole = replicated[0]["bytes_pushed"]
    for mesh, (held, shares) in MESHES.items():
        sharded, sharded_weights = _learn(tmp_path, mesh, 2, num_shards, ["--mesh", mesh])
        for report in sharded:
            assert "error" not in report, (mesh, report)
            assert report["held"] == held, (mesh, report)
        assert sharded[0]["versions"] == replicated[0]["versions"], (mesh, sharded, replicated)
        # Bit for bit: the worker's model is elementwise (no sum whose order the sharding
        # changes), its boxes are whole 32-value INT4 blocks, and the shard merges a push's
        # parts as the same float32 vector a whole push decodes to.
        np.testing.assert_array_equal(sharded_weights, replicated_weights, err_msg=mesh)
        # Each process pushes the boxes it holds replica 0 of: its share of the elements,
        # give or take the headers every part carries.
        measured = [r["bytes_pushed"] / whole for r in sharded]
        assert all(abs(m - s) < 0.08 for m, s in zip(measured, shares)), (mesh, measured, shares)
        assert sum(r["pushes"] for r in sharded) == 2 * replicated[0]["pushes"], mesh
        # Seeding by parts: each process sends its share of the seed (FP32), never the
        # whole fragment gathered to one process.
        seeded = [r["bytes_seeded"] / replicated[0]["bytes_seeded"] for r in sharded]
        assert all(abs(m - s) < 0.08 for m, s in zip(seeded, shares)), (mesh, seeded, shares)


def test_boxes_off_the_codec_blocks_publish_the_same_weights_through_fp32(tmp_path):
    # w1 of 32 columns on the 2 x 2 mesh: boxes of 16-column runs, so a part's 32-value
    # blocks are not a whole push's. Through FP32 the weights are still bit for bit the
    # replicated learner's: the shard assembles any boxes exactly. Through INT4 each part
    # is quantized in its own blocks: 186 of 1472 published values differ, the largest
    # by 0.105 (11 % of the largest weight; 4.5 % of the weights' norm), which is why the
    # equivalence test above cuts whole blocks.
    flags = ["--w1-columns", "32", "--codec", "FP32"]
    replicated, replicated_weights = _learn(tmp_path, "replicated", 1, 1, ["--replicated", *flags])
    sharded, sharded_weights = _learn(tmp_path, "narrow", 2, 1, ["--mesh", "fsdp-tp", *flags])
    for report in [*replicated, *sharded]:
        assert "error" not in report, report
    assert all(r["held"]["w1"] == [[8, 16]] * 2 for r in sharded), sharded
    assert sharded[0]["versions"] == replicated[0]["versions"], (sharded, replicated)
    np.testing.assert_array_equal(sharded_weights, replicated_weights)


def _errors(tmp_path: pathlib.Path, fault: str) -> list[str]:
    reports, _ = _learn(tmp_path, fault, 2, 1, ["--fault", fault])
    return [r.get("error", "") for r in reports]


def test_processes_that_call_in_another_order_each_get_a_clear_error(tmp_path):
    errors = _errors(tmp_path, "misorder")
    assert all("LearnerDisagreement" in e and "out of order" in e for e in errors), errors
    assert all("process 1: finish at step 5" in e for e in errors), errors


def test_processes_that_shard_a_leaf_differently_each_get_a_clear_error_at_join(tmp_path):
    errors = _errors(tmp_path, "mesh")
    assert all("LearnerDisagreement" in e and "'w1' is sharded differently" in e for e in errors)


def test_processes_that_join_with_another_plan_each_get_a_clear_error_at_join(tmp_path):
    errors = _errors(tmp_path, "plan")
    assert all("LearnerDisagreement" in e and "another fragment plan" in e for e in errors)
