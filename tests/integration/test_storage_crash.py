"""Real crashes: a child process appends (or snapshots) and prints each ack; the
parent SIGKILLs it mid-stream, reopens the storage, and checks every acked record.

A SIGKILL leaves what the process had written in the page cache, so this tests the
process-crash half of the guarantees (torn frames between or inside write calls,
rotation midway); a power cut's lost page cache is what the fsync before each ack is
for, and tests/test_storage.py forges those torn tails by hand.
"""

import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from atoll.server.snapshots import SnapshotStore
from atoll.server.storage import WriteAheadLog

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEGMENT_BYTES = 24 << 20  # small, so segments rotate during the run

RECORDS = """
import hashlib
import numpy as np

def make_record(lsn):
    # Deterministic from the LSN; every third one (8 MB) takes long enough to write that
    # kills often land inside it, leaving a torn frame.
    pattern = hashlib.sha256(b"%d" % lsn).digest()
    return b"%d|" % lsn + pattern * (1, 30, 250_000)[lsn % 3]

def make_tagged(thread, item):
    return b"%d %d|" % (thread, item) + np.random.default_rng([thread, item]).bytes(
        (64, 300_000)[item % 2])
"""

CHILD_LOG = (
    RECORDS
    + """
import sys, threading
from atoll.server.storage import WriteAheadLog

directory, mode, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
wal = WriteAheadLog(directory, segment_bytes=SEGMENT_BYTES)
if mode == "single":
    for _ in range(limit):
        lsn = wal.last_lsn + 1  # one appender: the next LSN is known in advance
        got = wal.append(make_record(lsn))
        assert got == lsn, (got, lsn)
        print(got, flush=True)  # the ack leaves the process only after append returned
else:
    say = threading.Lock()
    def worker(t):
        for i in range(limit):
            lsn = wal.append(make_tagged(t, i))
            with say:
                print(lsn, t, i, flush=True)
    pool = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for th in pool: th.start()
    for th in pool: th.join()
""".replace("SEGMENT_BYTES", str(SEGMENT_BYTES))
)

CHILD_SNAPSHOTS = """
import sys
import numpy as np
from atoll.server.snapshots import SnapshotStore

store = SnapshotStore(sys.argv[1])
start = (store.lsns() or [0])[-1] + 1
for lsn in range(start, start + int(sys.argv[2])):
    store.save(lsn, {"lsn": lsn}, {"x": np.full(1 << 20, lsn, np.float32), "y": np.arange(lsn)})
    print(lsn, flush=True)
"""

records = {}
exec(RECORDS, records)


def kill_after(tmp_path, program, args, acks_wanted, delay):
    """Runs the child until it printed `acks_wanted` acks, SIGKILLs it, returns every ack."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(tmp_path / "child.err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", program, *map(str, args)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    acks = []
    try:
        for line in proc.stdout:
            acks.append(line.split())
            if len(acks) >= acks_wanted:
                break
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        # printed before death; a line the kill cut short never reached the reader whole,
        # so it was never an acknowledgement
        acks += [line.split() for line in proc.stdout.read().split("\n")[:-1]]
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
    # The fault fired: the child died by the kill, not by finishing or failing.
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "child.err").read_text()
    assert len(acks) >= acks_wanted
    return acks


def recovered(wal_dir, caplog) -> tuple[dict[int, bytes], bool]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="server.storage"):
        with WriteAheadLog(wal_dir, segment_bytes=SEGMENT_BYTES) as wal:
            got = dict(wal.replay(wal.first_lsn - 1))
            assert wal.first_lsn == 1 and wal.last_lsn == len(got)
    assert list(got) == list(range(1, len(got) + 1))  # gap-free, in order
    return got, "torn tail" in caplog.text


def test_sigkill_mid_append_loses_no_acknowledged_record(tmp_path, caplog):
    wal_dir, torn, acked = tmp_path / "wal", 0, set()
    rounds = [(1, 0), (6, 0.015), (23, 0.02), (9, 0.005), (40, 0.025), (3, 0.03)]
    for acks_wanted, delay in rounds:
        acks = kill_after(
            tmp_path, CHILD_LOG, [wal_dir, "single", acks_wanted + 400], acks_wanted, delay
        )
        acked |= {int(lsn) for (lsn,) in acks}
        got, cut = recovered(wal_dir, caplog)
        torn += cut
        assert acked <= set(got), f"acknowledged records lost: {sorted(acked - set(got))}"
        # At most the one append in flight at the kill got in without being printed.
        assert len(got) <= max(acked) + 1
        for lsn, payload in got.items():
            assert payload == records["make_record"](lsn), f"record {lsn} differs"
    print(f"torn tails cut off in {torn} of {len(rounds)} recoveries")


def test_sigkill_with_concurrent_appenders_loses_no_acknowledged_record(tmp_path, caplog):
    wal_dir = tmp_path / "wal"
    for acks_wanted, delay in [(10, 0), (31, 0.001), (5, 0.0003)]:
        acks = kill_after(
            tmp_path, CHILD_LOG, [wal_dir, "threads", acks_wanted + 300], acks_wanted, delay
        )
        got, _ = recovered(wal_dir, caplog)
        for lsn, thread, item in acks:
            assert got.get(int(lsn)) == records["make_tagged"](int(thread), int(item)), lsn
        for lsn, payload in got.items():  # unacked survivors are whole records too
            thread, item = map(int, payload.split(b"|", 1)[0].split())
            assert payload == records["make_tagged"](thread, item), f"record {lsn} differs"
        assert len(got) <= max(int(lsn) for lsn, _, _ in acks) + 3  # one in flight per thread


@pytest.mark.parametrize("acks_wanted, delay", [(1, 0), (4, 0.003), (7, 0.001)])
def test_sigkill_mid_snapshot_keeps_the_last_acknowledged_one(tmp_path, acks_wanted, delay):
    snap_dir = tmp_path / "snapshots"
    acks = kill_after(tmp_path, CHILD_SNAPSHOTS, [snap_dir, acks_wanted + 200], acks_wanted, delay)
    with SnapshotStore(snap_dir) as store:
        assert not [p for p in snap_dir.iterdir() if ".tmp-" in p.name]  # cleaned on open
        snap = store.latest()
    newest_ack = max(int(lsn) for (lsn,) in acks)
    assert snap.lsn in (newest_ack, newest_ack + 1)  # the save in flight may have landed
    assert snap.meta == {"lsn": snap.lsn}
    assert np.array_equal(snap.arrays["x"], np.full(1 << 20, snap.lsn, np.float32))
    assert np.array_equal(snap.arrays["y"], np.arange(snap.lsn))
