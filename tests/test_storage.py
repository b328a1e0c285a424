"""Contract tests for server/storage.py: every log and snapshot backend runs them all.

A backend is a class below with open_log/open_snapshots and fault injectors that
damage its storage the way crashes and disks do; add it to BACKENDS.
"""

import errno
import logging
import os
import pathlib
import struct
import tempfile
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from atoll.server import storage
from atoll.server.snapshots import SnapshotStore, load_snapshot
from atoll.server.storage import (
    LogFailed,
    MissingRecords,
    SnapshotCorruption,
    StorageError,
    WALCorruption,
    WriteAheadLog,
    encode_frame_header,
)


class LocalDisk:
    """WriteAheadLog and SnapshotStore on a local directory; injectors need them closed."""

    name = "local"

    def __init__(self, root: pathlib.Path):
        self.wal_dir, self.snap_dir = root / "wal", root / "snapshots"

    def open_log(self, **kw):
        return WriteAheadLog(self.wal_dir, **kw)

    def open_snapshots(self, **kw):
        return SnapshotStore(self.snap_dir, **kw)

    # -- log faults --
    def segments(self) -> list[pathlib.Path]:
        return sorted(self.wal_dir.glob("*.wal"))

    def _offset_of(self, lsn: int) -> tuple[pathlib.Path, int, int]:
        """(segment, byte offset, payload size) of record `lsn`."""
        for path in self.segments():
            data, offset = path.read_bytes(), 0
            while offset < len(data):
                _, size, got, _ = storage._FRAME.unpack_from(data, offset)
                if got == lsn:
                    return path, offset, size
                offset += storage._FRAME.size + size
        raise LookupError(lsn)

    def tear_log_tail(self, kind: str, lsn: int, record: bytes) -> None:
        """Leaves what a crash mid-append of record `lsn` can leave after the last record."""
        frame = encode_frame_header(lsn, record) + record
        bad = bytearray(frame)
        bad[-1] ^= 0x01
        tail = {
            "garbage": os.urandom(37),
            "header": frame[:10],
            "half": frame[: len(frame) // 2],
            "crc": bytes(bad),
            "zeros": bytes(4096),
            "all-but-one-byte": frame[:-1],
        }[kind]
        with open(self.segments()[-1], "ab") as f:
            f.write(tail)

    def damage_record(self, lsn: int, where: str) -> None:
        path, offset, size = self._offset_of(lsn)
        at = offset + (storage._FRAME.size + size // 2 if where == "payload" else 4)
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x40]))

    def delete_segment(self, index: int) -> None:
        self.segments()[index].unlink()

    # -- snapshot faults --
    def crash_mid_save(self, lsn: int) -> None:
        """A temp file as left by a save killed before its rename."""
        with tempfile.TemporaryDirectory() as other:
            with SnapshotStore(other) as store:
                path = store.save(lsn, {"half": True}, {"x": np.ones(1000, np.float32)})
            data = path.read_bytes()
        (self.snap_dir / f".{lsn:020d}.snap.tmp-1234-abcd").write_bytes(data[: len(data) // 2])

    def leftovers(self) -> list[str]:
        return [p.name for p in self.snap_dir.iterdir() if ".tmp-" in p.name]

    def damage_snapshot(self, lsn: int, how: str) -> None:
        path = self.snap_dir / f"{lsn:020d}.snap"
        data = bytearray(path.read_bytes())
        if how == "truncate":
            del data[len(data) // 2 :]
        else:
            at = {"magic": 0, "header": 30, "data": len(data) - 100, "tail": len(data) - 2}[how]
            data[at] ^= 0x01
        path.write_bytes(bytes(data))


BACKENDS = [LocalDisk]


@pytest.fixture(params=BACKENDS, ids=lambda b: b.name)
def backend(request, tmp_path):
    return request.param(tmp_path)


def record(lsn: int, size: int = 100) -> bytes:
    """Deterministic content for record `lsn`."""
    return np.random.default_rng(lsn).bytes(size)


def records_of(log, after=0) -> dict[int, bytes]:
    return dict(log.replay(after))


# -- write-ahead log: order, LSNs, reopen ----------------------------------------------


def test_append_returns_consecutive_lsns_and_replays_in_order(backend):
    with backend.open_log() as wal:
        assert (wal.first_lsn, wal.last_lsn) == (1, 0)
        assert list(wal.replay()) == []
        lsns = [wal.append(record(i, 10 * i)) for i in range(1, 6)]
        lsns += wal.append_many([record(6), memoryview(record(7)), b""])
        assert lsns == list(range(1, 9))
        assert wal.last_lsn == 8
        got = list(wal.replay())
        assert [lsn for lsn, _ in got] == lsns
        want = [record(i, 10 * i) for i in range(1, 6)] + [record(6), record(7), b""]
        assert [r for _, r in got] == want
        assert [lsn for lsn, _ in wal.replay(5)] == [6, 7, 8]
        assert list(wal.replay(8)) == []


def test_reopen_continues_lsns(backend):
    with backend.open_log() as wal:
        for i in range(1, 4):
            wal.append(record(i))
    with backend.open_log() as wal:
        assert wal.last_lsn == 3
        assert wal.append(record(4)) == 4
    with backend.open_log() as wal:
        assert records_of(wal) == {i: record(i) for i in range(1, 5)}


def test_numpy_buffers_are_appended_without_conversion(backend):
    values = np.arange(1000, dtype=np.float32)
    with backend.open_log() as wal:
        wal.append(values)
        assert list(wal.replay()) == [(1, values.tobytes())]


def test_a_push_record_in_the_pieces_its_frame_arrived_in_replays_as_one(backend):
    from atoll.server.log_records import LOG_PUSH, log_record, log_record_parts, parse_log_record

    frame = record(9, 10_000)
    pieces = [frame[i : i + 1024] for i in range(0, len(frame), 1024)]
    meta = {"fragment": 2, "learner": "a"}
    with backend.open_log() as wal:
        wal.append(log_record_parts(LOG_PUSH, meta, pieces))
        wal.append(log_record_parts(LOG_PUSH, meta, frame))
        (_, first), (_, second) = wal.replay()
    assert first == second == log_record(LOG_PUSH, meta, frame)
    kind, got_meta, payload = parse_log_record(first)
    assert (kind, got_meta, bytes(payload)) == (LOG_PUSH, meta, frame)


def test_second_open_of_the_same_log_is_refused(backend):
    with backend.open_log():
        with pytest.raises(StorageError, match="already open"):
            backend.open_log()
    backend.open_log().close()


def test_replay_past_the_end_is_refused(backend):
    with backend.open_log() as wal:
        wal.append(b"x")
        with pytest.raises(MissingRecords, match="ends at LSN 1"):
            wal.replay(2)


# -- torn tails and corruption ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["garbage", "header", "half", "crc", "zeros", "all-but-one-byte"])
def test_torn_tail_is_cut_off_and_appends_continue(backend, kind, caplog):
    with backend.open_log() as wal:
        for i in range(1, 6):
            wal.append(record(i, 5000))
    backend.tear_log_tail(kind, 6, record(6, 5000))
    with caplog.at_level(logging.WARNING), backend.open_log() as wal:
        assert wal.last_lsn == 5
        assert records_of(wal) == {i: record(i, 5000) for i in range(1, 6)}
        assert wal.append(b"after") == 6
    assert "torn tail" in caplog.text
    with backend.open_log() as wal:
        assert records_of(wal) == {**{i: record(i, 5000) for i in range(1, 6)}, 6: b"after"}


def test_torn_first_record_leaves_an_empty_log(backend):
    backend.open_log().close()
    backend.tear_log_tail("half", 1, record(1, 1000))
    with backend.open_log() as wal:
        assert (wal.last_lsn, list(wal.replay())) == (0, [])
        assert wal.append(b"a") == 1


@pytest.mark.parametrize("where", ["payload", "length"])
def test_damage_in_the_middle_of_the_log_is_an_error(backend, where):
    with backend.open_log() as wal:
        for i in range(1, 7):
            wal.append(record(i, 1000))
    backend.damage_record(3, where)
    for _ in range(2):  # a failed open releases the directory; it fails the same way again
        with pytest.raises(WALCorruption, match="LSN 3 is damaged"):
            backend.open_log()


def test_damaged_last_record_of_a_sealed_segment_is_an_error(backend):
    with backend.open_log(segment_bytes=1000) as wal:
        for i in range(1, 8):
            wal.append(record(i, 300))  # three 328-byte frames per segment
    backend.damage_record(3, "payload")
    with pytest.raises(WALCorruption, match="LSN 3 is damaged"):
        backend.open_log(segment_bytes=1000)


def test_missing_segment_is_an_error(backend):
    with backend.open_log(segment_bytes=1000) as wal:
        for i in range(1, 10):
            wal.append(record(i, 300))
    backend.delete_segment(1)
    with pytest.raises(WALCorruption, match="missing"):
        backend.open_log(segment_bytes=1000)


def _failing_write(monkeypatch, code: int, nth: int) -> list[int]:
    """Makes the nth os.write from now on raise OSError(code); returns the calls made."""
    real_write, calls = os.write, []

    def flaky_write(fd, data):
        calls.append(fd)
        if len(calls) >= nth:
            raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    monkeypatch.setattr(storage.os, "write", flaky_write)
    return calls


def test_failed_write_fails_the_log_until_reopened(backend, monkeypatch):
    with backend.open_log() as wal:
        wal.append(record(1))
        _failing_write(monkeypatch, errno.EIO, 2)  # the header lands, then the disk breaks
        with pytest.raises(OSError, match="Input/output"):
            wal.append(record(2))
        monkeypatch.undo()
        with pytest.raises(LogFailed, match="reopen"):
            wal.append(record(3))
        assert wal.last_lsn == 1
    with backend.open_log() as wal:
        assert records_of(wal) == {1: record(1)}
        assert wal.append(record(2)) == 2


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_write_the_disk_has_no_room_for_is_taken_back_and_appends_go_on(
    backend, monkeypatch, code
):
    with backend.open_log() as wal:
        wal.append(record(1))
        size = backend.segments()[-1].stat().st_size
        # a batch of three: the first record and the second's header land, then no room
        calls = _failing_write(monkeypatch, code, 4)
        with pytest.raises(storage.DiskFull, match="retry once space returns"):
            wal.write_many([record(2), record(3), record(4)])
        assert len(calls) == 4  # the fault fired mid-batch
        monkeypatch.undo()
        assert backend.segments()[-1].stat().st_size == size  # none of the batch is left
        assert (wal.written_lsn, wal.last_lsn) == (1, 1)
        assert wal.append(record(5)) == 2  # space is back: LSNs go on without a gap
    with backend.open_log() as wal:
        assert records_of(wal) == {1: record(1), 2: record(5)}


def test_a_batch_the_disk_has_no_room_for_is_taken_back_across_a_rotation(backend, monkeypatch):
    with backend.open_log(segment_bytes=1000) as wal:
        wal.append(record(1, 300))
        before = [(p.name, p.stat().st_size) for p in backend.segments()]
        # records 2 and 3 fill the segment, 4 opens a new one and finds no room
        _failing_write(monkeypatch, errno.ENOSPC, 5)
        with pytest.raises(storage.DiskFull):
            wal.write_many([record(i, 300) for i in (2, 3, 4)])
        monkeypatch.undo()
        assert [(p.name, p.stat().st_size) for p in backend.segments()] == before
        assert [wal.append(record(i, 300)) for i in (5, 6, 7)] == [2, 3, 4]
    with backend.open_log(segment_bytes=1000) as wal:
        assert records_of(wal) == {i - 3 if i > 1 else 1: record(i, 300) for i in (1, 5, 6, 7)}


def test_an_injected_fsync_failure_fails_the_log_while_its_file_exists(
    backend, monkeypatch, tmp_path
):
    switch = tmp_path / "fail-fsync"
    monkeypatch.setenv(storage.FAULT_FSYNC_ENV, str(switch))
    with backend.open_log() as wal:
        assert wal.append(record(1)) == 1  # no file yet: fsyncs succeed
        switch.touch()
        lsn = wal.write_many([record(2)])[-1]
        with pytest.raises(OSError, match="injected"):
            wal.sync(lsn)
        switch.unlink()
        with pytest.raises(LogFailed):  # never retried and then called durable
            wal.sync(lsn)
        assert wal.last_lsn == 1


# -- segments --------------------------------------------------------------------------


def test_rotation_and_truncate_through_delete_only_covered_segments(backend):
    kw = {"segment_bytes": 1000}
    with backend.open_log(**kw) as wal:
        for i in range(1, 11):
            wal.append(record(i, 300))  # segments hold 1-3, 4-6, 7-9, 10
        assert wal.truncate_through(0) == 0
        assert wal.truncate_through(5) == 1  # 4-6 is not wholly covered
        assert wal.first_lsn == 4
        assert records_of(wal, 3) == {i: record(i, 300) for i in range(4, 11)}
        with pytest.raises(MissingRecords, match="already truncated"):
            wal.replay(2)
        assert wal.truncate_through(1000) == 2  # the active segment always stays
        assert (wal.first_lsn, wal.last_lsn) == (10, 10)
        assert records_of(wal, 9) == {10: record(10, 300)}
    with backend.open_log(**kw) as wal:
        assert (wal.first_lsn, wal.last_lsn) == (10, 10)
        assert wal.append(record(11, 300)) == 11
        assert records_of(wal, 9) == {10: record(10, 300), 11: record(11, 300)}


def test_segment_files_follow_the_size_limit(backend):
    if not hasattr(backend, "segments"):
        pytest.skip("backend has no segment files")
    with backend.open_log(segment_bytes=1000) as wal:
        for i in range(1, 8):
            wal.append(record(i, 300))
        wal.append(record(8, 5000))  # bigger than a segment: one of its own
        wal.append(record(9, 10))
        assert [p.name for p in backend.segments()] == [f"{n:020d}.wal" for n in (1, 4, 7, 8, 9)]
        wal.truncate_through(7)
        assert [p.name for p in backend.segments()] == [f"{n:020d}.wal" for n in (8, 9)]
    with backend.open_log(segment_bytes=1000) as wal:
        assert records_of(wal, 7) == {8: record(8, 5000), 9: record(9, 10)}


# -- concurrency -----------------------------------------------------------------------


def test_concurrent_appends_are_gap_free_and_intact(backend):
    threads, per_thread = 8, 30
    acked: dict[int, bytes] = {}
    lock, start = threading.Lock(), threading.Barrier(threads)
    with backend.open_log(segment_bytes=20_000) as wal:

        def worker(t):
            start.wait()
            mine = []
            for i in range(per_thread):
                data = f"thread {t} item {i} ".encode() * (1 + (t * 7 + i) % 50)
                if i % 5 == 4:
                    lsns = wal.append_many([data, data[::-1]])
                    assert lsns[1] == lsns[0] + 1
                    got = dict(zip(lsns, [data, data[::-1]]))
                else:
                    got = {wal.append(data): data}
                mine += list(got)
                with lock:
                    acked.update(got)
            assert mine == sorted(mine)

        pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        total = threads * (per_thread + per_thread // 5)
        assert sorted(acked) == list(range(1, total + 1))
        assert records_of(wal) == acked
    with backend.open_log(segment_bytes=20_000) as wal:
        assert records_of(wal) == acked


# -- snapshots -------------------------------------------------------------------------


def assert_bit_exact(saved, loaded):
    assert list(saved) == list(loaded)
    for name, want in saved.items():
        dtype = want.dtype.newbyteorder("<") if want.dtype.kind != "V" else want.dtype
        got = loaded[name]
        assert (got.dtype, got.shape) == (dtype, want.shape), name
        assert got.tobytes() == want.astype(dtype).tobytes(), name  # tobytes: C order
        assert got.flags.c_contiguous and got.flags.writeable


def awkward_arrays():
    nan_bits = np.array(
        [0x7FC00001, 0xFFC12345, 0x7F800001, 0x80000000, 0x00000001, 0x7F800000], np.uint32
    )
    rng = np.random.default_rng(0)
    return {
        "f32_nan_payloads_neg_zero": nan_bits.view(np.float32),
        "f64": np.array([-0.0, np.nan, np.inf, 5e-324]),
        "f16": rng.standard_normal((3, 5)).astype(np.float16),
        "bf16": rng.standard_normal(7).astype(ml_dtypes.bfloat16),
        "i8": np.arange(-128, 128, dtype=np.int8),
        "u64": np.array([0, 2**64 - 1], np.uint64),
        "bool": np.array([True, False, True]),
        "c64": np.array([1 + 2j, np.nan * 1j], np.complex64),
        "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 3), np.float32),
        "big_endian": np.arange(6, dtype=">f4").reshape(2, 3),
        "transposed": rng.standard_normal((4, 6)).astype(np.float32).T,
        "strided": np.arange(40, dtype=np.int32)[::3],
        "fortran": np.asfortranarray(rng.standard_normal((3, 4))),
    }


def test_snapshot_round_trip_is_bit_exact(backend):
    arrays = awkward_arrays()
    meta = {
        "config": {"outer_lr": 0.7, "codec": "int4", "tags": ["a", None, True]},
        "plan_fingerprint": "abc123",
        "versions": [3, 4],
    }
    with backend.open_snapshots() as store:
        assert store.latest() is None
        store.save(17, meta, arrays)
    with backend.open_snapshots() as store:
        snap = store.latest()
    assert (snap.lsn, snap.meta) == (17, meta)
    assert_bit_exact(arrays, snap.arrays)
    assert snap.shapes()["transposed"] == ("float32", (6, 4))
    assert snap.shapes()["bf16"] == ("bfloat16", (7,))


@settings(max_examples=25, deadline=None)
@given(
    arrays=st.dictionaries(
        st.text(min_size=1, max_size=8),
        hnp.arrays(
            st.sampled_from(
                [
                    np.float32,
                    np.float64,
                    np.float16,
                    np.int16,
                    np.uint8,
                    np.bool_,
                    np.complex128,
                    np.dtype(">i4"),
                ]
            ),
            hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
        ),
        max_size=4,
    )
)
def test_snapshot_round_trip_property(arrays):
    with tempfile.TemporaryDirectory() as d, SnapshotStore(d) as store:
        store.save(1, {}, arrays)
        assert_bit_exact(arrays, store.latest().arrays)


def test_latest_picks_the_newest_and_keep_prunes(backend):
    with backend.open_snapshots(keep=2) as store:
        for lsn in (5, 9, 30):
            store.save(lsn, {"at": lsn}, {"x": np.full(3, lsn, np.float32)})
        assert store.lsns() == [9, 30]
        snap = store.latest()
        assert (snap.lsn, snap.meta, snap.arrays["x"].tolist()) == (30, {"at": 30}, [30.0] * 3)
        store.save(30, {"at": "again"}, {})  # same LSN: replaced atomically
        assert store.latest().meta == {"at": "again"}
        with pytest.raises(ValueError, match="not older than the newest"):
            store.save(29, {}, {})


def test_truncatable_lsn_needs_two_snapshots(backend):
    with backend.open_snapshots(keep=2) as store:
        assert store.truncatable_lsn() == 0
        store.save(10, {}, {})
        assert store.truncatable_lsn() == 0
        store.save(20, {}, {})
        assert store.truncatable_lsn() == 10
        store.save(30, {}, {})
        assert store.truncatable_lsn() == 20
    with backend.open_snapshots(keep=1) as store:
        assert store.truncatable_lsn() == 30


def test_bad_meta_or_arrays_are_refused_before_writing(backend):
    with backend.open_snapshots() as store:
        with pytest.raises(ValueError, match="must be JSON"):
            store.save(1, {"lr": float("nan")}, {})
        with pytest.raises(ValueError, match="must be JSON"):
            store.save(1, {"f": object()}, {})
        with pytest.raises(ValueError, match="plain numeric dtype"):
            store.save(1, {}, {"o": np.array([None])})
        assert store.lsns() == []


def test_leftover_temp_file_from_a_crashed_save_is_ignored_and_removed(backend):
    with backend.open_snapshots() as store:
        store.save(4, {"ok": True}, {"x": np.arange(3.0)})
    backend.crash_mid_save(8)
    assert backend.leftovers()
    with backend.open_snapshots() as store:
        assert backend.leftovers() == []
        assert store.lsns() == [4]
        assert store.latest().meta == {"ok": True}


def test_failed_save_leaves_no_trace(backend, monkeypatch):
    with backend.open_snapshots() as store:
        store.save(4, {"ok": True}, {"x": np.arange(3.0)})

        def broken_fsync(fd):
            raise OSError(errno.EIO, "I/O error")

        monkeypatch.setattr(storage.os, "fsync", broken_fsync)
        with pytest.raises(OSError, match="I/O error"):
            store.save(8, {}, {"x": np.arange(3.0)})
        monkeypatch.undo()
        assert store.lsns() == [4] and backend.leftovers() == []
        assert store.latest().lsn == 4


@pytest.mark.parametrize("how", ["magic", "header", "data", "tail", "truncate"])
def test_damaged_newest_snapshot_falls_back_loudly(backend, how, caplog):
    with backend.open_snapshots() as store:
        store.save(10, {"n": 10}, {"x": np.arange(100, dtype=np.float32)})
        store.save(20, {"n": 20}, {"x": np.arange(100, dtype=np.float32) + 1})
    backend.damage_snapshot(20, how)
    with caplog.at_level(logging.WARNING), backend.open_snapshots() as store:
        snap = store.latest()
        assert (snap.lsn, snap.meta) == (10, {"n": 10})
        assert store.lsns() == [10]  # the damaged one is moved aside, not deleted
    assert "damaged" in caplog.text


@pytest.mark.parametrize("how", ["magic", "header", "data", "tail", "truncate"])
def test_load_snapshot_detects_damage(backend, how):
    with backend.open_snapshots() as store:
        path = store.save(20, {"n": 20}, {"x": np.arange(100, dtype=np.float32)})
    backend.damage_snapshot(20, how)
    with pytest.raises(SnapshotCorruption, match="damaged"):
        load_snapshot(path)


def test_every_snapshot_damaged_is_an_error_not_a_fresh_start(backend):
    with backend.open_snapshots() as store:
        store.save(10, {}, {"x": np.zeros(10)})
    backend.damage_snapshot(10, "data")
    with backend.open_snapshots() as store:
        with pytest.raises(SnapshotCorruption, match="every snapshot is damaged"):
            store.latest()


# -- recovery, end to end ----------------------------------------------------------------


def test_recovery_survives_a_damaged_newest_snapshot_after_truncation(backend):
    """The documented recipe: snapshot, truncate through truncatable_lsn, recover."""

    def apply(state, rec):
        return state + np.frombuffer(rec, np.float32)

    kw = {"segment_bytes": 2000}
    state = np.zeros(100, np.float32)
    with backend.open_log(**kw) as wal, backend.open_snapshots() as store:
        for i in range(1, 31):
            rec = np.full(100, i, np.float32).tobytes()
            lsn = wal.append(rec)
            state = apply(state, rec)
            if lsn % 10 == 0:
                store.save(lsn, {"shape": [100]}, {"state": state})
                wal.truncate_through(store.truncatable_lsn())
        assert wal.first_lsn > 1  # something was truncated
    backend.damage_snapshot(30, "data")
    with backend.open_log(**kw) as wal, backend.open_snapshots() as store:
        snap = store.latest()
        assert snap.lsn == 20
        recovered = snap.arrays["state"]
        for _, rec in wal.replay(snap.lsn):
            recovered = apply(recovered, rec)
    assert recovered.tobytes() == state.tobytes()


def test_frame_header_covers_length_and_lsn():
    payload = b"abc"
    assert encode_frame_header(1, payload) != encode_frame_header(2, payload)
    magic, size, lsn, _ = struct.unpack("<4sQQI", encode_frame_header(7, payload))
    assert (magic, size, lsn) == (b"AWAL", 3, 7)


def test_a_record_written_in_parts_is_one_record(backend):
    # a push's head and frame go to disk back to back, with no copy joining them
    with backend.open_log() as wal:
        wal.append_many([(b"head:", memoryview(b"frame bytes")), b"whole", (b"",)])
        assert records_of(wal) == {1: b"head:frame bytes", 2: b"whole", 3: b""}
    assert encode_frame_header(4, (b"ab", b"c")) == encode_frame_header(4, b"abc")
    with backend.open_log() as wal:  # and replays so after a reopen
        assert records_of(wal)[1] == b"head:frame bytes"


def test_an_abandoned_store_releases_its_directory(backend):
    """Dropping an object without close() (an in-process "crash") frees the directory."""
    wal, store = backend.open_log(), backend.open_snapshots()
    wal.append(b"kept")
    del wal, store
    with backend.open_log() as wal, backend.open_snapshots():
        assert records_of(wal) == {1: b"kept"}


def test_concurrent_syncs_share_fsyncs_and_return_only_once_durable(backend, monkeypatch):
    """Group commit: 8 writers whose syncs overlap a slow fsync need far fewer than 8 fsyncs,
    and no sync returns before an fsync that started after its record was written."""
    calls, lock = [], threading.Lock()
    real = storage._datasync
    all_written = threading.Event()

    def slow_datasync(fd):
        with lock:
            calls.append(time.perf_counter())
        # a slow disk: the fsync lasts until every writer has written (an event, not a
        # sleep, so a loaded host's late threads still overlap it), 10 s at most
        all_written.wait(10)
        real(fd)

    with backend.open_log() as wal:
        monkeypatch.setattr(storage, "_datasync", slow_datasync)
        barrier, done = threading.Barrier(8), {}

        def writer(i: int) -> None:
            barrier.wait()
            lsn = wal.write_many([f"rec {i}".encode()])[0]
            written = time.perf_counter()
            if wal.written_lsn >= 8:
                all_written.set()
            wal.sync(lsn)
            # an fsync covering this record started after it was written
            done[i] = lsn if any(t >= written for t in calls) and wal.last_lsn >= lsn else None

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        monkeypatch.undo()
        assert sorted(done.values()) == list(range(1, 9))
        # one leader's fsync, then at most one for all the records written meanwhile
        assert 1 <= len(calls) <= 2, len(calls)
        assert wal.sync(8) is None  # already durable: no fsync
        with pytest.raises(ValueError):
            wal.sync(9)  # never written
    with backend.open_log() as wal:
        assert [r for _, r in wal.replay()] == sorted(
            (f"rec {i}".encode() for i in range(8)), key=lambda r: done[int(r.split()[1])]
        )


def test_failed_group_fsync_fails_every_waiter(backend, monkeypatch):
    with backend.open_log() as wal:
        lsn = wal.write_many([b"a", b"b"])[-1]

        def broken(fd):
            raise OSError(5, "EIO")

        monkeypatch.setattr(storage, "_datasync", broken)
        with pytest.raises(OSError):
            wal.sync(lsn)
        with pytest.raises(LogFailed):
            wal.sync(lsn)  # the records are unknown: no caller is told they are durable
        with pytest.raises(LogFailed):
            wal.write_many([b"c"])
