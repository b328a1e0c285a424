"""A real `atoll syncer` on a failing disk: a full disk (a small tmpfs the test mounts and
fills), an fsync error (injected through storage.FAULT_FSYNC_ENV) and a damaged log at
start-up. Each ends with a restart that finds every acknowledged push, and no traceback.

What the shard does (docs/operations.md, "Disk faults"):
- disk full: the push is refused with RESOURCE_EXHAUSTED (retryable), none of its record
  kept; pushes are taken again once space returns, without a restart.
- fsync error: the push it covered is never acknowledged; the shard stops serving
  (NOT_SERVING, every call refused with the reason) and exits 3 when stopped.
- damaged log: NOT_SERVING with the file and byte offset, exit 3; --truncate-damaged-log
  sets the log aside only where the newest snapshot holds all of it.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from syncer_helpers import (
    PLAN,
    REPO,
    connect,
    health_status,
    init,
    pull,
    push,
    shard_state,
    syncer_processes,
    wait_serving,
)

from atoll.server import storage
from atoll.wire import syncer_pb2 as pb

FLAGS = ("--quorum=2", "--grace-factor=0", "--lease-seconds=600")
LEARNERS = ("l0", "l1")
FRAGMENTS = (0, 1)
SERVING, NOT_SERVING = (
    health_pb2.HealthCheckResponse.SERVING,
    health_pb2.HealthCheckResponse.NOT_SERVING,
)


@pytest.fixture
def processes(tmp_path):
    with syncer_processes(tmp_path) as start:
        yield start


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs: a real disk that fills up (mounting one needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(disk) -> int:
    """Writes a filler file until the disk has no room; returns its size."""
    block, size = b"\0" * (64 << 10), 0
    with open(disk / "filler", "wb", buffering=0) as f:
        while True:
            try:
                size += f.write(block)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                return size


class Pushes:
    """Rounds of pushes by LEARNERS, and what was acknowledged: the newest ack of each
    (learner, fragment), which a retry with the same seq must get again after a restart."""

    def __init__(self, stub):
        self.stub, self.acked = stub, {}
        self.version = dict.fromkeys(FRAGMENTS, 0)

    def send(self, p: int, learner: str, seq: int) -> pb.PushResponse:
        rng = np.random.default_rng([p, seq, int(learner[1:])])
        delta = rng.standard_normal(PLAN.fragment_sizes[p])
        ack = push(self.stub, PLAN, p, learner, seq, self.version[p], delta * 0.01)
        assert ack.accepted, ack
        self.acked[learner, p] = (seq, ack.version)
        self.version[p] = max(self.version[p], ack.version)
        return ack

    def rounds(self, seqs) -> None:
        for seq in seqs:
            for p in FRAGMENTS:
                for learner in LEARNERS:
                    self.send(p, learner, seq)

    def check_present(self, stub) -> None:
        """Every acknowledged push is in the shard: its retry gets its first answer."""
        for (learner, p), (seq, version) in self.acked.items():
            delta = np.zeros(PLAN.fragment_sizes[p])
            again = push(stub, PLAN, p, learner, seq, 0, delta)
            assert again.accepted and again.reason == pb.PUSH_REASON_DUPLICATE, (learner, p, again)
            assert again.version == version, (learner, p, again, version)


def seeded(port: int) -> tuple[grpc.Channel, object, Pushes]:
    channel, stub = connect(port)
    for p in FRAGMENTS:
        init(stub, PLAN, p, np.zeros(PLAN.fragment_sizes[p], np.float32))
    return channel, stub, Pushes(stub)


def wait_health(channel, want: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while health_status(channel, "atoll.v1.Syncer") != want:
        assert time.monotonic() < deadline, f"health never became {want}"
        time.sleep(0.05)


def no_traceback(text: str) -> None:
    assert "Traceback" not in text, text


# --- disk full -------------------------------------------------------------------------


def test_a_full_disk_refuses_pushes_retryably_and_takes_them_again_once_space_returns(
    small_disk, processes
):
    data = small_disk / "shard"
    shard = processes(data, *FLAGS, "--snapshot-every=2")
    channel, stub, pushes = seeded(shard.port)
    pushes.rounds(range(1, 4))
    fill(small_disk)
    # the log's last page may still hold a few records: push until one finds no room
    refused = None
    for seq in range(4, 40):
        try:
            pushes.rounds([seq])
        except grpc.RpcError as e:
            refused = (e, seq)
            break
    assert refused is not None, "the disk never filled up"
    error, seq = refused
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert "no room on the disk" in error.details() and "retry" in error.details()
    # reads go on meanwhile; health is SERVING, or NOT_SERVING saying why (a round that
    # cannot log its close)
    pull(stub, 0)
    if health_status(channel) != SERVING:
        assert "health says NOT_SERVING" in shard.log(), shard.log()

    (small_disk / "filler").unlink()  # space returns: no restart
    wait_serving(shard.port)
    for p in FRAGMENTS:  # the refused push and the rest of its round, retried
        for learner in LEARNERS:
            if pushes.acked.get((learner, p), (0,))[0] < seq:
                pushes.send(p, learner, seq)
    pushes.rounds(range(seq + 1, seq + 3))
    before = shard_state(stub)
    channel.close()

    assert shard.kill() == -signal.SIGKILL
    again = processes(data, *FLAGS, "--snapshot-every=2")
    channel, stub = connect(again.port)
    assert shard_state(stub) == before  # nothing acknowledged lost, nothing refused kept
    pushes.check_present(stub)
    channel.close()
    no_traceback(shard.log() + again.log())


# --- fsync error -----------------------------------------------------------------------


def test_a_failed_fsync_is_never_acknowledged_and_stops_the_shard(tmp_path, processes, monkeypatch):
    switch = tmp_path / "fail-fsync"
    monkeypatch.setenv(storage.FAULT_FSYNC_ENV, str(switch))
    data = tmp_path / "shard"
    shard = processes(data, *FLAGS)
    channel, stub, pushes = seeded(shard.port)
    pushes.rounds(range(1, 4))

    switch.touch()  # the injector: every fsync of the log fails from here
    with pytest.raises(grpc.RpcError) as e:
        pushes.send(0, "l2", 1)  # a third learner: its record may reach the disk all the same
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
    assert "write-ahead log failed" in e.value.details()
    assert ("l2", 0) not in pushes.acked
    switch.unlink()  # the disk "recovers": the shard still does not trust its memory
    wait_health(channel, NOT_SERVING)
    with pytest.raises(grpc.RpcError) as e:
        pushes.send(1, "l0", 4)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "log failed" in e.value.details()
    channel.close()
    shard.proc.send_signal(signal.SIGTERM)
    assert shard.proc.wait(timeout=30) == 3
    assert "health says NOT_SERVING: the write-ahead log failed" in shard.log()
    no_traceback(shard.log())

    monkeypatch.delenv(storage.FAULT_FSYNC_ENV)
    again = processes(data, *FLAGS)
    channel, stub = connect(again.port)
    pushes.check_present(stub)
    channel.close()
    no_traceback(again.log())


# --- damaged log at start-up -----------------------------------------------------------


def stuck(data, *flags) -> tuple[subprocess.Popen, str, int]:
    """Starts `atoll syncer` on a data directory it cannot recover: (process, the line
    saying why, its port), the process still up."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "atoll.cli", "syncer", "--data-dir", str(data)]
        + ["--listen", "127.0.0.1:0", *FLAGS, *flags],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if m := re.search(r"did not recover and serves nothing \(port (\d+)\)", line):
            return proc, line, int(m.group(1))
        assert "serving on port" not in line, line
    proc.wait(timeout=10)
    raise AssertionError(f"exited {proc.returncode}: {proc.stderr.read()}")


def stop_stuck(proc: subprocess.Popen) -> str:
    """SIGTERM; the exit status must be 3 ("did not recover"); returns stderr."""
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 3, (proc.returncode, err)
    no_traceback(err)
    return err


def damage_record(data, lsn: int) -> int:
    """Flips a payload byte of log record `lsn`; returns the byte offset of its frame."""
    [segment] = sorted((data / "wal").glob("*.wal"))
    raw, offset = bytearray(segment.read_bytes()), 0
    header = storage._FRAME
    while offset < len(raw):
        _, size, got, _ = header.unpack_from(raw, offset)
        if got == lsn:
            raw[offset + header.size + size // 2] ^= 0x40
            segment.write_bytes(bytes(raw))
            return offset
        offset += header.size + size
    raise LookupError(lsn)


def test_a_damaged_log_after_a_crash_says_where_and_is_not_truncated(tmp_path, processes):
    data = tmp_path / "shard"
    shard = processes(data, *FLAGS)
    channel, stub, pushes = seeded(shard.port)
    pushes.rounds(range(1, 4))
    channel.close()
    shard.kill()  # no final snapshot: the log alone holds these pushes
    offset = damage_record(data, 3)  # records after it are whole

    proc, line, port = stuck(data)
    assert "damaged write-ahead log" in line and f"at byte {offset}" in line, line
    assert "00000000000000000001.wal" in line and "LSN 3" in line, line
    assert "restore the data directory" in line, line
    channel, _ = connect(port)
    assert health_status(channel) == NOT_SERVING
    channel.close()
    stop_stuck(proc)

    # the flag will not drop records only the log holds: still refused, nothing changed
    before = sorted((p.name, p.stat().st_size) for p in (data / "wal").iterdir())
    proc, line, _ = stuck(data, "--truncate-damaged-log")
    assert "--truncate-damaged-log refused" in line, line
    stop_stuck(proc)
    assert sorted((p.name, p.stat().st_size) for p in (data / "wal").iterdir()) == before


def test_a_damaged_log_a_snapshot_holds_is_set_aside_with_the_flag(tmp_path, processes):
    data = tmp_path / "shard"
    shard = processes(data, *FLAGS)
    channel, stub, pushes = seeded(shard.port)
    pushes.rounds(range(1, 4))
    before = shard_state(stub)
    channel.close()
    assert shard.stop() == 0  # a clean stop: its final snapshot holds every record
    offset = damage_record(data, 4)

    proc, line, _ = stuck(data)
    assert f"at byte {offset}" in line and "--truncate-damaged-log" in line, line
    assert "nothing acknowledged is lost" in line, line
    stop_stuck(proc)

    again = processes(data, *FLAGS, "--truncate-damaged-log")
    channel, stub = connect(again.port)
    assert shard_state(stub) == before
    pushes.check_present(stub)
    pushes.stub = stub
    pushes.rounds([4])  # and it takes pushes again
    channel.close()
    assert (data / "wal" / "00000000000000000001.wal.damaged").exists()
    no_traceback(again.log())


def test_every_snapshot_damaged_with_the_whole_log_kept_replays_it_all(tmp_path, processes):
    data = tmp_path / "shard"
    shard = processes(data, *FLAGS, "--snapshot-every=1")
    channel, stub, pushes = seeded(shard.port)
    pushes.rounds(range(1, 3))
    channel.close()
    assert shard.stop() == 0
    snapshots = sorted((data / "snapshots").glob("*.snap"))
    assert len(snapshots) == 2
    for path in snapshots:
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0x01
        path.write_bytes(bytes(raw))

    # the log still starts at LSN 1 (one segment): replayed from the start, nothing lost
    again = processes(data, *FLAGS)
    channel, stub = connect(again.port)
    pushes.check_present(stub)
    channel.close()
    assert again.stop() == 0
    assert "replayed from the start" in again.log()
    no_traceback(again.log())
