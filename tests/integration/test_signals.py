"""Every long-running atoll process leaves within seconds of its SIGTERM, whatever it is
waiting on, with a clean exit status: a syncer replaying a long log or serving open
Watch and Push streams, a standby learner waiting for an id to take, `atoll drain`
waiting for shards that never answer, and `atoll up` and `atoll chaos` mid-run (no
child of theirs outlives them). In Kubernetes a process that ignores SIGTERM holds its
pod until the grace period ends, then is SIGKILLed.

Covered elsewhere: a learner waiting on shards that never answer or have vanished
(test_learner_stop.py), `atoll up` stopped by Ctrl-C before its first step
(test_up_interrupt.py) and mid-run (test_up_process.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from procs import processes_naming
from syncer_helpers import (
    PLAN,
    REPO,
    SERVICE,
    connect,
    free_port,
    health_status,
    init,
    push_requests,
    syncer_processes,
)

from atoll.server.fragment import Answer
from atoll.server.log_records import LOG_CLOSE, LOG_INIT, LOG_PLAN, LOG_PUSH, log_record
from atoll.server.storage import WriteAheadLog
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.records import read_jsonl

STOP_SECONDS = 10.0  # SIGTERM to exit of one process: each takes 0.1-0.5 s here
# ... of a whole run, children stopped in order (learners finish their step and evaluate,
# shards write their final snapshots, then the report): 6-12 s on a loaded 2-core host
RUN_STOP_SECONDS = 20.0
TINY = ["--preset", "tiny", "--eval-every", "0", "--quiet"]


class Child:
    """One `atoll ...` process of this checkout, its output in a log file."""

    def __init__(self, log: pathlib.Path, *args: str):
        self.log, self.stdout = log, log.with_suffix(".stdout")
        with open(log, "a") as err, open(self.stdout, "a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "atoll.cli", *args],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )

    def output(self) -> str:
        """stdout and stderr so far (stderr first)."""
        return "".join(f.read_text() for f in (self.log, self.stdout) if f.exists())

    def wait_for(self, ready: Callable[[], bool], what: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, f"exited early ({what}):\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"never {what}:\n{self.output()[-4000:]}"
            time.sleep(0.1)

    def sigterm(self, within: float = STOP_SECONDS) -> int:
        """SIGTERM; its exit status (fails the test past `within` seconds)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {within} s after SIGTERM:\n{self.output()[-4000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def children():
    started: list[Child] = []
    yield started
    for child in started:
        child.kill()


def _processes_under(path: pathlib.Path) -> dict[int, str]:
    """{pid: command line} of every running process (not a zombie) naming `path`."""
    return processes_naming(str(path))


def _kill_all_under(path: pathlib.Path) -> None:
    for pid in _processes_under(path):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --- the syncer ---


def _long_log(data_dir: pathlib.Path, rounds: int) -> int:
    """A shard's log of `rounds` rounds of two learners' pushes to each of PLAN's fragments,
    written straight to the log (as the shard writes them, none of the shard's work):
    seconds to write, tens of seconds to replay. Returns how many records it holds."""
    written = 0
    frames = [
        codec.encode(np.random.default_rng(p).standard_normal(n).astype(np.float32) * 0.01)
        for p, n in enumerate(PLAN.fragment_sizes)
    ]
    zeros = [codec.encode(np.zeros(n, np.float32), codec.Codec.FP32) for n in PLAN.fragment_sizes]
    with WriteAheadLog(data_dir / "wal") as wal:
        records = [log_record(LOG_PLAN, {"plan": PLAN.to_json()})]
        records += [log_record(LOG_INIT, {"fragment": p}, f) for p, f in enumerate(zeros)]
        for r in range(rounds):
            for p, frame in enumerate(frames):
                for learner in ("a", "b"):
                    answer = dataclasses.asdict(Answer(r + 1, True, "accepted", "", r, 0, 1.0))
                    meta = {"fragment": p, "learner": learner, "answer": answer}
                    records.append(log_record(LOG_PUSH, meta, frame))
                records.append(log_record(LOG_CLOSE, {"fragment": p, "trigger": "b"}))
            if len(records) >= 20_000 or r == rounds - 1:
                wal.sync(wal.write_many(records)[-1])
                written, records = written + len(records), []
    return written


def _digest(data_dir: pathlib.Path) -> dict[str, str]:
    """{file: sha256} of the log's segments and the snapshots (not the empty lock files)."""
    return {
        str(f.relative_to(data_dir)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(data_dir.rglob("*"))
        if f.is_file() and not f.name.startswith(".")
    }


def test_a_syncer_replaying_a_long_log_stops_at_once_and_writes_nothing(tmp_path, children):
    data = tmp_path / "shard"
    records = _long_log(data, rounds=15_000)  # ~25 s of replay on an idle host
    before = _digest(data)
    port = free_port()
    children.append(
        syncer := Child(
            tmp_path / "syncer.log",
            "syncer",
            "--data-dir",
            str(data),
            "--listen",
            f"127.0.0.1:{port}",
        )
    )
    channel, _ = connect(port)

    def replaying() -> bool:  # the port answers NOT_SERVING from the start of recovery
        try:
            return health_status(channel, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
        except grpc.RpcError:
            return False

    try:
        syncer.wait_for(replaying, "started its recovery")
    finally:
        channel.close()
    # the injected fault: SIGTERM mid-recovery (a pod deleted while it recovers)
    assert syncer.sigterm() == 0, syncer.output()
    out = syncer.output()
    assert "recovered (" not in out and "serving on port" not in out, out  # it stopped mid-way
    stopped = re.search(r"recovery stopped after replaying (\d+) log records", out)
    assert stopped and int(stopped[1]) < records and "Traceback" not in out, out
    # half a replay is no state to snapshot: the data directory is as it was
    assert _digest(data) == before


def test_a_syncer_serving_open_watch_and_push_streams_stops_within_seconds(tmp_path):
    with syncer_processes(tmp_path) as start:
        shard = start(tmp_path / "shard")
        main, stub = connect(shard.port)
        for p in range(PLAN.num_fragments):
            init(stub, PLAN, p, np.zeros(PLAN.fragment_sizes[p], np.float32))
        channels = [connect(shard.port) for _ in range(2)]
        watches = [
            channels[i % 2][1].Watch(pb.WatchRequest(learner_id=f"w{i}"), timeout=120)
            for i in range(20)
        ]
        for call in watches:  # open: each has heard every fragment's version
            assert sorted(next(call).fragment for _ in range(PLAN.num_fragments)) == [0, 1, 2, 3]
        # Push streams stalled after their header: the frame never comes
        release = threading.Event()
        frame = codec.encode(np.full(PLAN.fragment_sizes[0], 0.01, np.float32))

        def stalled(learner: str):
            yield push_requests(PLAN, 0, learner, 1, 0, frame, PLAN.fragment_sizes[0])[0]
            release.wait()

        pushes = [channels[i % 2][1].Push.future(stalled(f"s{i}"), timeout=120) for i in range(5)]
        ended = threading.Event()

        def hear_the_end() -> None:  # the streams end with the shard, not at their deadlines
            for call in watches:
                try:
                    for _ in call:
                        pass
                except grpc.RpcError:
                    pass
            ended.set()

        threading.Thread(target=hear_the_end, daemon=True).start()
        try:
            time.sleep(0.5)
            assert all(not c.done() for c in pushes)
            # the injected fault: SIGTERM with 20 Watch and 5 stalled Push streams open
            sent = time.monotonic()
            assert shard.stop(timeout=STOP_SECONDS) == 0, shard.log()
            assert time.monotonic() - sent < STOP_SECONDS, shard.log()
            assert ended.wait(10.0), "the Watch streams outlived their shard"
            assert all(c.done() for c in pushes)
        finally:
            release.set()
            for call in [*pushes, *watches]:
                call.cancel()
            for channel, _ in [*channels, (main, stub)]:
                channel.close()
    assert "Traceback" not in shard.log()
    # a clean stop: the final snapshot (the next start replays nothing)
    assert list((tmp_path / "shard" / "snapshots").glob("*.snap")), shard.log()


# --- learners and the tools ---


def test_a_standby_waiting_for_an_id_to_take_stops_within_seconds(tmp_path, children):
    args = ["learner", "--standby", "--learner-id", "spare", "--num-learners", "2"]
    args += ["--shards", f"127.0.0.1:{free_port()}", "--checkpoint-dir", str(tmp_path / "ck")]
    args += ["--status-file", str(tmp_path / "{id}.jsonl"), *TINY]
    children.append(spare := Child(tmp_path / "spare.log", *args))
    # the phase: polling the claims (every learner holds its id: there are none)
    spare.wait_for(lambda: "waiting for a failed learner" in spare.output(), "compiled")
    assert spare.sigterm() == 128 + signal.SIGTERM, spare.output()  # stopped, not done: 143
    assert "stopped before taking over a learner" in spare.output()
    assert "Traceback" not in spare.output()


def test_atoll_drain_waiting_for_shards_that_never_answer_stops_within_seconds(tmp_path, children):
    # the injected fault: shards 0 to 2 on ports nothing listens on; shard 2 leaves (1 stays)
    base = free_port() // 10
    pattern = f"127.0.0.1:{base}{{i}}"
    args = ["drain", "--shards", pattern, "--shard-index", "2", "--replicas", "1"]
    children.append(drain := Child(tmp_path / "drain.log", *args, "--timeout", "600"))
    drain.wait_for(lambda: "plans the moves" in drain.output(), "asked the shards", timeout=60)
    status = drain.sigterm()
    out = drain.output()
    assert status == 128 + signal.SIGTERM, out  # not killed by it: it says what is left
    assert "stopped by SIGTERM" in out and "atoll reshard --to 1" in out, out
    assert "Traceback" not in out


# --- whole runs ---


@pytest.mark.e2e
def test_atoll_up_mid_run_stops_on_sigterm_with_its_children(tmp_path, children):
    run = tmp_path / "run"
    flags = ["--preset", "tiny", "--shards", "2", "--learners", "2", "--steps", "100000"]
    children.append(
        up := Child(tmp_path / "up.log", "up", "--new-run-dir", str(run), *flags, "--no-table")
    )
    try:
        statuses = [run / "learners" / f"learner-{i}.jsonl" for i in range(2)]
        up.wait_for(
            lambda: all(
                s.exists() and any(r.get("pushes", 0) >= 1 for r in read_jsonl(s)) for s in statuses
            ),
            "had both learners push",
        )
        # the injected fault: SIGTERM mid-run (a pod, a job scheduler, `kill`)
        assert up.sigterm(RUN_STOP_SECONDS) == 128 + signal.SIGTERM, up.output()
        left = _processes_under(run)
    finally:
        _kill_all_under(run)
    assert not left, f"orphaned children: {left}"
    report = json.loads((run / "report.json").read_text())
    assert report["interrupted"] == "SIGTERM" and not report["complete"]
    assert {n: l["state"] for n, l in report["learners"].items()} == {
        "learner-0": "stopped",
        "learner-1": "stopped",
    }, report["events"]
    assert "Traceback" not in up.output()


@pytest.mark.e2e
def test_atoll_chaos_mid_run_stops_on_sigterm_with_its_children(tmp_path, children):
    work = tmp_path / "chaos"
    flags = ["--learners", "2", "--shards", "1", "--duration", "600", "--standbys", "1"]
    children.append(
        chaos := Child(tmp_path / "chaos.log", "chaos", *flags, "--work-dir", str(work), "--json")
    )
    try:
        chaos.wait_for(lambda: "the failure clock starts" in chaos.output(), "started its clock")
        # learners, a standby and a shard are running: the injected fault, SIGTERM
        assert len(_processes_under(work)) >= 4, _processes_under(work)
        assert chaos.sigterm(RUN_STOP_SECONDS) == 128 + signal.SIGTERM, chaos.output()
        left = _processes_under(work)
    finally:
        _kill_all_under(work)
    assert not left, f"orphaned children: {left}"
    assert "Traceback" not in chaos.output()
    result = json.loads(chaos.stdout.read_text())  # --json: the figures on stdout
    assert result["runs"]["atoll"]["interrupted"] == "SIGTERM"
    assert "lockstep" not in result["runs"]  # the runs after it never started
