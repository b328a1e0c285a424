"""Orbax checkpoints of a learner whose params are FSDP-sharded over 2 JAX processes x 2
CPU devices (gloo), with real processes and real signals (learner/sharded_checkpoint.py):
every process writes and reads its own shards and sync vectors; a stopped slice resumes
at the same step with the same params and sync state; the checkpoint restores onto one
process; and a slice with one process killed by SIGKILL in the middle of a push merges
none of it, while another learner's rounds go on, and rejoins from its checkpoint."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from syncer_helpers import REPO, free_port

from atoll.server.config import ShardConfig
from atoll.server.service import SyncerServer

pytestmark = pytest.mark.e2e  # real processes: `make test-fast` skips it

WORKER = pathlib.Path(__file__).with_name("sharded_checkpoint_worker.py")
ENV = {
    **os.environ,
    "PYTHONPATH": str(REPO),
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false",
}

# seconds each step of the stopped-slice test's workers waits after its sync call (the
# worker's default is 0.2): each run there ends once nothing is in flight (--end save
# settles it) and checks what was saved and resumed, never how far a clock got. The
# mid-push kill keeps 0.2 (at 0.1 its checkpoint case, 1 run in 3, had no checkpoint yet)
STEP_SLEEP = "0.1"


@pytest.fixture
def shard(tmp_path, request):
    settings = getattr(request, "param", {})  # ShardConfig fields a test sets
    server = SyncerServer(
        ShardConfig(
            shard_index=0,
            num_shards=1,
            data_dir=tmp_path / "shard",
            listen="127.0.0.1:0",
            quorum=1,
            grace_factor=1.0,
            lease_seconds=5,
            **settings,
        )
    )
    server.start()
    yield server
    server.stop()


def _start(
    tmp: pathlib.Path, server: SyncerServer, name: str, processes: int, flags: list[str]
) -> list[subprocess.Popen]:
    """The worker as one learner of `processes` processes (1: params replicated)."""
    port, procs = free_port(), []
    for i in range(processes):
        cmd = [sys.executable, str(WORKER), "--shards", f"127.0.0.1:{server.port}"]
        cmd += ["--out", str(tmp / f"{name}.{i}.json"), *flags]
        if processes > 1:
            cmd += ["--coordinator", f"127.0.0.1:{port}"]
            cmd += ["--num-processes", str(processes), "--process-id", str(i)]
        else:
            cmd += ["--replicated"]
        log = open(tmp / f"{name}.{i}.log", "w")  # noqa: SIM115 (closed with the process)
        procs.append(subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _finish(tmp: pathlib.Path, name: str, procs: list[subprocess.Popen]) -> list[dict]:
    """Each process's report, once all exited (every one with status 0, and no error)."""
    try:
        for i, proc in enumerate(procs):
            assert proc.wait(timeout=240) == 0, (tmp / f"{name}.{i}.log").read_text()[-3000:]
    finally:
        _kill(procs)
    reports = [json.loads((tmp / f"{name}.{i}.json").read_text()) for i in range(len(procs))]
    for i, report in enumerate(reports):
        assert "error" not in report, (report, (tmp / f"{name}.{i}.log").read_text()[-3000:])
    return reports


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _checkpoint_flags(directory: pathlib.Path) -> list[str]:
    return ["--checkpoint-dir", str(directory), "--checkpoint-every", "2"]


@pytest.mark.timeout(600)
def test_a_stopped_slice_resumes_its_step_params_and_sync_state(tmp_path, shard):
    ckpt = tmp_path / "ckpt"
    saves = [*_checkpoint_flags(ckpt), "--sleep", STEP_SLEEP]
    flags = [*saves, "--steps", "9", "--end", "save"]
    saved = [
        r["saved"] for r in _finish(tmp_path, "first", _start(tmp_path, shard, "first", 2, flags))
    ]
    assert saved[0]["steps"] >= 9 and saved[0]["count"] == saved[0]["steps"], saved

    flags = [*saves, "--steps", "5", "--end", "save"]
    again = _finish(tmp_path, "again", _start(tmp_path, shard, "again", 2, flags))
    for j, (before, report) in enumerate(zip(saved, again)):
        after = report["joined"]
        assert after["resumed"] and after["steps"] == before["steps"], (j, after, before)
        assert after["count"] == before["count"]  # the int leaf, kept out of the plan
        assert after["momentum"] == before["momentum"]  # the caller's state, bit for bit
        assert after["whole_state"]  # and into a template each host holds whole
        # the checkpoint's params, read back into this process's shards, bit for bit
        assert after["restored"] == before["values"], j
        # every fragment's sync state as this process held it: its origin and the
        # error-feedback residual of the boxes it sends
        assert set(after["origins"]) == set(before["sync"]) == {"0", "1"}, (after, before)
        for p, state in before["sync"].items():
            assert after["origins"][p] == state["origin"], (j, p)
            assert after["sync"][p]["residual"] == state["residual"], (j, p)
        assert any(s["residual_nonzero"] for s in before["sync"].values()), before
        # the params it goes on from: its local progress on the same global weights
        for k, values in before["values"].items():
            tolerance = 2**-7 if k == "w0" else 1e-6  # w0 is bfloat16
            np.testing.assert_allclose(after["values"][k], values, rtol=tolerance, atol=1e-6)
        assert report["pushes"] > 0, report

    # another mesh: one process, every leaf replicated over its 2 devices
    one = _finish(tmp_path, "one", _start(tmp_path, shard, "one", 1, saves))
    after, last = one[0]["joined"], [r["saved"] for r in again]
    assert after["resumed"] and after["steps"] == last[0]["steps"], (after, last)
    assert after["count"] == last[0]["count"]
    for k, values in after["restored"].items():
        # w0, w1: rows 0-7 were process 0's, 8-15 process 1's; b, count: replicated
        whole = last[0]["values"][k] + last[1]["values"][k] if k in ("w0", "w1") else None
        assert values == (2 * whole if whole else last[0]["values"][k]), k
    assert after["origins"] == {}  # per-process sync vectors do not carry across meshes
    log = (tmp_path / "one.0.log").read_text()
    assert "sync vectors" in log and "are per process" in log, log[-2000:]

    # and back: the one process's whole vectors carry onto the 2-process slice's boxes
    flags = [*saves, "--steps", "3"]
    back = _finish(tmp_path, "back", _start(tmp_path, shard, "back", 2, flags))
    for report in back:
        after = report["joined"]
        assert after["resumed"] and after["steps"] == one[0]["steps"], (after, one)
        assert set(after["origins"]) == {"0", "1"} and report["pushes"] > 0, report


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("checkpointed", "shard"),
    [(True, {}), (False, {"part_wait_leases": 100.0})],
    ids=["checkpoint", "no-checkpoint-parts-still-held"],
    indirect=["shard"],
)
def test_a_process_killed_mid_push_merges_nothing_and_the_slice_rejoins(
    tmp_path, shard, checkpointed
):
    """Whether or not a checkpoint's seq is past the killed push's, the restarted slice's
    seqs go on above it: the shard's last_seq counts the parts it still holds of it (kept
    past the restart in the second case), and the slice's next push supersedes them."""
    stop = tmp_path / "stop"
    solo = _start(tmp_path, shard, "solo", 1, ["--learner-id", "solo", "--until", str(stop)])
    marker = tmp_path / "held"
    saves = _checkpoint_flags(tmp_path / "ckpt") if checkpointed else []
    flags = [*saves, "--until", str(stop)]
    island = _start(
        tmp_path, shard, "island", 2, [*flags, "--hold-from-seq", "5", "--marker", str(marker)]
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert time.monotonic() < deadline, (tmp_path / "island.1.log").read_text()[-3000:]
            assert all(p.poll() is None for p in [*solo, *island]), "a learner exited"
            time.sleep(0.1)
        held = json.loads(marker.read_text())
        frag = shard.shard.fragments[held["fragment"]]
        # the fault fired mid-push: process 0's part of that push is held, process 1's not
        part_set = frag.part_sets.get("island")
        assert part_set is not None and part_set.seq == held["seq"], (held, part_set)
        assert sorted(part_set.boxes) == [0], part_set.boxes
        island[1].send_signal(signal.SIGKILL)
        assert island[1].wait(timeout=10) == -signal.SIGKILL
        # process 0 cannot go on without its peer: the slice goes down and is restarted
        island[0].send_signal(signal.SIGKILL)
        island[0].wait(timeout=10)

        # the other learner's rounds keep closing meanwhile (two more on every fragment)
        before = [f.version for f in shard.shard.fragments.values()]
        deadline = time.monotonic() + 60
        while any(f.version < v + 2 for f, v in zip(shard.shard.fragments.values(), before)):
            assert time.monotonic() < deadline, (before, solo[0].poll())
            time.sleep(0.2)

        dropped = shard.shard.metrics.parts_dropped
        restarted = _start(tmp_path, shard, "restarted", 2, [*saves, "--steps", "8"])
        reports = _finish(tmp_path, "restarted", restarted)
    finally:
        stop.touch()
        _kill(island)
    solo_report = _finish(tmp_path, "solo", solo)
    assert solo_report[0]["pushes"] > 0
    for report in reports:
        joined = report["joined"]
        assert joined["resumed"] == checkpointed == (joined["steps"] > 0), report
        assert joined["seq"] >= held["seq"], (joined["seq"], held)  # never that seq again
        assert report["pushes"] > 0, report  # the slice pushes again
    # nothing of the killed push was merged: its held part was dropped (superseded by
    # the restarted slice's newer push, or expired), and the slice's pushes since carry
    # newer seqs
    total = sum(dropped.labels(r)._value.get() for r in ("superseded", "expired"))
    assert total >= 1, total
    if not checkpointed:  # held until the slice came back: its newer push replaced them
        assert dropped.labels("superseded")._value.get() >= 1
    assert frag.part_sets.get("island") is None or frag.part_sets["island"].seq != held["seq"]
    assert frag.answers["island"].seq > held["seq"] and frag.answers["island"].accepted
