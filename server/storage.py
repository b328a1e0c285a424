"""Durable storage of one syncer shard: a write-ahead log of accepted pushes and
atomic snapshots of the state they built.

Ordering guarantees
-------------------
Write-ahead log (`WriteAheadLog`; one directory, one open log at a time):

1. `append(r)` returns LSN n only after r, its frame and (for a new segment file)
   the segment's directory entry are on stable storage. The ack is a promise.
   `write_many` assigns LSNs and writes without waiting; its records are durable
   once `sync(n)` of the last returns. Group commit: concurrent `sync` calls share
   one fdatasync (each waits for the first one that started after its write), and
   no fsync runs under the log's lock, so writers go on while the disk works.
2. LSNs run 1, 2, 3, ... without gaps, in the order appends took the log's lock;
   that order is the merge order, and `replay` yields exactly it. Reopening
   continues from the last durable LSN + 1.
3. Opening the log (recovery) sees every acknowledged record, byte for byte. A
   record whose append had not returned when the process or machine died is
   either whole or gone: a torn tail is cut off at open, never half replayed. An
   append that raised is in the same whole-or-gone state, and the log then refuses
   appends (LogFailed) until reopened: after a failed write or fsync the page
   cache no longer says what is on disk. Callers treat such a record as unknown.
4. Damage anywhere but the tail (a bad record followed by a valid one, or a bad
   record in a sealed segment) stops the open with WALCorruption: acknowledged
   data is never dropped silently. Limit: a damaged *final* record looks exactly
   like a torn write, and is cut off.
5. `truncate_through(n)` deletes only whole sealed segments whose records all have
   LSN <= n, oldest first; the active segment stays. `replay(after)` raises
   MissingRecords when records after `after` are gone or `after` is past the end.

Snapshots (`SnapshotStore`; one directory, one open store at a time):

6. `save` returns only after the file is written, fsynced, renamed into place and
   the directory fsynced. A crash before the rename leaves the older snapshots as
   they were plus a temp file that the next open deletes; after it, the new one.
7. Each file ends with a CRC32 of all its bytes, checked on every load. `latest`
   returns the newest snapshot that checks out; a damaged one is logged, renamed
   to *.damaged and skipped. Falling back is safe because the WAL is truncated only
   through `truncatable_lsn()` (the oldest retained snapshot: two snapshots cover a
   record before it is deleted), and `replay` refuses if records are missing.

A crash at any point loses nothing acknowledged. Recovery is

    snap = snapshots.latest()                                  # None: fresh start
    for lsn, record in wal.replay(snap.lsn if snap else 0): apply(record)

and a snapshot is `snapshots.save(last_applied_lsn, meta, arrays)` followed by
`wal.truncate_through(snapshots.truncatable_lsn())`.
"""

from __future__ import annotations

import dataclasses
import fcntl
import io
import json
import logging
import math
import os
import pathlib
import re
import secrets
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]


class StorageError(Exception):
    """Storage cannot do what was asked; the message says why and what to do."""


class WALCorruption(StorageError):
    """Acknowledged log records are damaged; the log refuses to drop them silently."""


class SnapshotCorruption(StorageError):
    """A snapshot file fails its checks (truncated, bit flips, not a snapshot)."""


class MissingRecords(StorageError):
    """A replay needs records the log no longer (or never) held."""


class LogFailed(StorageError):
    """An earlier write or fsync failed; reopen the log to recover."""


Record: TypeAlias = bytes | memoryview | tuple[bytes | memoryview, ...]
"""One log record: its bytes, or parts written back to back as one record (no copy
joins them)."""


class Log(Protocol):
    """What the shard needs of a write-ahead log; tests/test_storage.py is the contract."""

    @property
    def first_lsn(self) -> int: ...  # oldest LSN still held (last_lsn + 1 if none)
    @property
    def last_lsn(self) -> int: ...  # newest durable LSN, 0 if none was ever written
    @property
    def written_lsn(self) -> int: ...  # newest LSN written, durable or not yet
    def append(self, record: Record) -> int: ...
    def append_many(self, records: Iterable[Record]) -> list[int]: ...
    def write_many(self, records: Iterable[Record]) -> list[int]: ...  # written, not yet durable
    def sync(self, lsn: int) -> float | None: ...  # durable through lsn (group commit)
    def replay(self, after_lsn: int = 0) -> Iterator[tuple[int, bytes]]: ...
    def truncate_through(self, lsn: int) -> int: ...
    def close(self) -> None: ...


class SnapshotStorage(Protocol):
    """What the shard needs of a snapshot store; tests/test_storage.py is the contract."""

    def save(
        self, lsn: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
    ) -> pathlib.Path: ...
    def latest(self) -> Snapshot | None: ...
    def lsns(self) -> list[int]: ...
    def truncatable_lsn(self) -> int: ...
    def close(self) -> None: ...


# -- shared helpers ----------------------------------------------------------------

# fdatasync also flushes the file size, which is all an append changes besides data.
_datasync = getattr(os, "fdatasync", os.fsync)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lock_dir(path: pathlib.Path, name: str) -> int:
    """Creates `path` durably and takes an exclusive lock on it (one writer only)."""
    if not path.is_dir():
        path.mkdir(parents=True)
        _fsync_dir(path.parent)
    fd = os.open(path / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StorageError(
            f"{path} is already open (another process or object holds "
            f"{name}); one writer per directory: close the other first"
        ) from None
    return fd


# -- write-ahead log ---------------------------------------------------------------

# A frame is this header then the payload: magic, payload length, LSN, and a CRC32
# of (length, LSN, payload), so torn, misplaced and flipped records all fail it.
_FRAME = struct.Struct("<4sQQI")
_FRAME_MAGIC = b"AWAL"
_SEGMENT = re.compile(r"^(\d{20})\.wal$")  # named by the LSN of its first record
_CHUNK = 1 << 20


def _parts(record: Record) -> list[memoryview]:
    return [memoryview(r).cast("B") for r in (record if isinstance(record, tuple) else (record,))]


def encode_frame_header(lsn: int, payload: Record) -> bytes:
    """The header written before `payload` as record `lsn` (tests forge tails with it)."""
    parts = _parts(payload)
    size = sum(p.nbytes for p in parts)
    crc = zlib.crc32(struct.pack("<QQ", size, lsn))
    for part in parts:
        crc = zlib.crc32(part, crc)
    return _FRAME.pack(_FRAME_MAGIC, size, lsn, crc)


def _check_frame(
    f: io.BufferedIOBase, offset: int, file_size: int, due_lsn: int | None
) -> tuple[int, int] | str:
    """(lsn, payload size) of the whole, valid frame at `offset`, or why there is none."""
    f.seek(offset)
    head = f.read(_FRAME.size)
    if len(head) < _FRAME.size:
        return "a partial frame header"
    magic, size, lsn, crc = _FRAME.unpack(head)
    if magic != _FRAME_MAGIC:
        return "no frame magic"
    if offset + _FRAME.size + size > file_size:
        return f"a {size}-byte payload running past the end of the file"
    if due_lsn is not None and lsn != due_lsn:
        return f"LSN {lsn} where {due_lsn} was due"
    got, buf = zlib.crc32(struct.pack("<QQ", size, lsn)), memoryview(bytearray(min(size, _CHUNK)))
    left = size
    while left:
        n = f.readinto(buf[: min(left, len(buf))])
        if not n:
            return "a short read"
        got, left = zlib.crc32(buf[:n], got), left - n
    return (lsn, size) if got == crc else "a CRC mismatch"


def _valid_frame_after(f: io.BufferedIOBase, start: int, file_size: int, min_lsn: int) -> bool:
    """Whether any whole, valid frame with LSN >= min_lsn starts after `start`."""
    pos = start + 1
    while pos < file_size:
        f.seek(pos)
        chunk = f.read(_CHUNK + len(_FRAME_MAGIC) - 1)
        i = chunk.find(_FRAME_MAGIC)
        while i >= 0:
            found = _check_frame(f, pos + i, file_size, None)
            if not isinstance(found, str) and found[0] >= min_lsn:
                return True
            i = chunk.find(_FRAME_MAGIC, i + 1)
        pos += _CHUNK
    return False


class WriteAheadLog:
    """An append-only, fsynced, checksummed record log in segment files.

    Args:
      directory: where the segments live; created if missing; one open log per directory.
      segment_bytes: a segment is sealed once the next record would take it past this
        size (a larger record gets a segment of its own); sealed segments can be
        deleted by `truncate_through`.

    Example:
      >>> with WriteAheadLog(tmp / "wal") as wal:
      ...     wal.append(b"push 1"), wal.append(b"push 2")
      (1, 2)
    """

    def __init__(self, directory: str | os.PathLike[str], *, segment_bytes: int = 256 << 20):
        self._mutex = threading.Lock()  # appends are serialised: their order is the merge order
        self._synced = threading.Condition(
            threading.Lock()
        )  # durable LSN and the one fsync in flight
        self._syncing = False
        self._fd: int | None = None
        self._lock_fd: int | None = None
        if segment_bytes <= _FRAME.size:
            raise ValueError(
                f"segment_bytes must exceed the {_FRAME.size}-byte frame header, "
                f"got {segment_bytes}"
            )
        self.directory, self.segment_bytes = pathlib.Path(directory), segment_bytes
        self._failed: BaseException | None = None
        self.last_sync_seconds = 0.0  # how long the newest append's fsync took
        self._lock_fd = _lock_dir(self.directory, ".wal.lock")
        try:
            self._recover()
        except BaseException:
            self.close()
            raise

    def _path(self, first_lsn: int) -> pathlib.Path:
        return self.directory / f"{first_lsn:020d}.wal"

    def _recover(self) -> None:
        firsts = sorted(
            int(m.group(1)) for p in self.directory.iterdir() if (m := _SEGMENT.match(p.name))
        )
        if not firsts:
            os.close(os.open(self._path(1), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            _fsync_dir(self.directory)
            firsts = [1]
        due = firsts[0]
        for i, first in enumerate(firsts):
            path = self._path(first)
            if first != due:
                raise WALCorruption(
                    f"{path.name} starts at LSN {first} but the segment before it "
                    f"ends at LSN {due - 1}: a segment is missing or misnamed"
                )
            file_size, end = path.stat().st_size, 0
            with open(path, "rb") as f:
                while end < file_size:
                    found = _check_frame(f, end, file_size, due)
                    if isinstance(found, str):
                        break
                    end, due = end + _FRAME.size + found[1], due + 1
                if end == file_size:
                    continue
                if i < len(firsts) - 1 or _valid_frame_after(f, end, file_size, due):
                    raise WALCorruption(
                        f"{path} at byte {end}: record LSN {due} is damaged ({found}) and is not "
                        "the log's last record, so acknowledged data would be lost; restore the "
                        "log from a backup or replica, or move the damaged segment aside knowingly"
                    )
            log.warning(
                "WAL %s: cut off a torn tail of %d bytes at byte %d (%s); it was never "
                "acknowledged",
                path,
                file_size - end,
                end,
                found,
            )
            with open(path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        self._firsts, self._next_lsn, self._durable_lsn = firsts, due, due - 1
        self._fd = os.open(self._path(firsts[-1]), os.O_WRONLY)
        self._size = os.lseek(self._fd, 0, os.SEEK_END)

    @property
    def first_lsn(self) -> int:
        with self._mutex:
            return self._firsts[0]

    @property
    def last_lsn(self) -> int:
        with self._mutex:
            return self._durable_lsn

    def append(self, record: Record) -> int:
        """Writes one record durably and returns its LSN (see the module's guarantees)."""
        return self.append_many([record])[0]

    def append_many(self, records: Iterable[Record]) -> list[int]:
        """Writes records durably with one fsync, consecutive LSNs, and returns them."""
        lsns = self.write_many(records)
        if lsns:
            self.sync(lsns[-1])
        return lsns

    def _check_open(self) -> None:
        if self._failed is not None:
            raise LogFailed(
                f"an earlier write to {self.directory} failed ({self._failed!r}); "
                "reopen the log to recover"
            ) from self._failed
        if self._fd is None:
            raise StorageError(f"the log in {self.directory} is closed")

    def write_many(self, records: Iterable[Record]) -> list[int]:
        """Writes records with consecutive LSNs and returns them, without waiting for the
        disk: they are durable (guarantee 1) only once `sync` of the last one returns."""
        records = list(records)
        with self._mutex:
            self._check_open()
            try:
                lsns = []
                for record in records:
                    parts = _parts(record)
                    frame_bytes = _FRAME.size + sum(p.nbytes for p in parts)
                    if self._size and self._size + frame_bytes > self.segment_bytes:
                        self._rotate()
                    fd = self._fd
                    assert fd is not None  # checked open; a rotation opens the next segment
                    _write_all(fd, memoryview(encode_frame_header(self._next_lsn, record)))
                    for part in parts:
                        _write_all(fd, part)
                    self._size += frame_bytes
                    lsns.append(self._next_lsn)
                    self._next_lsn += 1
            except BaseException as exc:
                self._failed = exc
                raise
            return lsns

    @property
    def written_lsn(self) -> int:
        """The newest LSN written, durable or not yet."""
        with self._mutex:
            return self._next_lsn - 1

    def sync(self, lsn: int) -> float | None:
        """Returns once every record through `lsn` is durable (group commit).

        One caller at a time runs fdatasync, for everything written when it starts;
        callers arriving meanwhile wait for it and, if their record came later, the
        next one runs for all of them: concurrent appenders share fsyncs, and none
        holds the log's lock while the disk works. Returns the seconds of the fsync
        this call ran, or None if others' fsyncs covered `lsn`. Raises LogFailed if
        the fsync failed (for this caller or the one it waited on)."""
        if lsn > self.written_lsn:
            raise ValueError(
                f"sync({lsn}): the log in {self.directory} has written only through "
                f"LSN {self.written_lsn}"
            )
        with self._synced:
            while self._durable_lsn < lsn:
                if self._syncing:
                    self._synced.wait()
                    continue
                with self._mutex:  # what is written now; a dup so a rotation may close the original
                    self._check_open()  # a failed fsync leaves these records unknown: no ack
                    assert self._fd is not None
                    target, fd = self._next_lsn - 1, os.dup(self._fd)
                self._syncing = True
                self._synced.release()
                started = time.perf_counter()
                try:
                    _datasync(fd)  # fsync before ack: the ack is a promise
                except BaseException as exc:
                    self._failed = exc
                    raise
                finally:
                    os.close(fd)
                    self._synced.acquire()
                    self._syncing = False
                    self._synced.notify_all()
                # records in earlier segments were fsynced when their segment was sealed
                self._durable_lsn = max(self._durable_lsn, target)
                self.last_sync_seconds = seconds = time.perf_counter() - started
                if self._durable_lsn >= lsn:
                    return seconds
            return None

    def _rotate(self) -> None:
        old, self._fd = self._fd, None
        assert old is not None
        try:
            _datasync(old)
        finally:
            os.close(old)
        self._fd = os.open(self._path(self._next_lsn), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        _fsync_dir(self.directory)  # the segment's name is durable before any record in it is acked
        self._firsts.append(self._next_lsn)
        self._size = 0

    def replay(self, after_lsn: int = 0) -> Iterator[tuple[int, bytes]]:
        """Yields (lsn, record) for every durable record after `after_lsn`, in LSN order.

        Meant for recovery, before serving: records appended after the call starts are
        not yielded, and a concurrent `truncate_through` may delete what it reads.
        """
        with self._mutex:
            firsts, last = list(self._firsts), self._durable_lsn
        if after_lsn < firsts[0] - 1:
            raise MissingRecords(
                f"replay after LSN {after_lsn} needs records {after_lsn + 1}.."
                f"{firsts[0] - 1}, already truncated from {self.directory}; "
                f"replay from a snapshot at LSN >= {firsts[0] - 1}"
            )
        if after_lsn > last:
            raise MissingRecords(
                f"replay after LSN {after_lsn} but the log in {self.directory} "
                f"ends at LSN {last}: the snapshot is newer than the log "
                "(was the log directory replaced?)"
            )
        return self._records(firsts, after_lsn, last)

    def _records(self, firsts: list[int], after_lsn: int, last: int) -> Iterator[tuple[int, bytes]]:
        for first, end in zip(firsts, [f - 1 for f in firsts[1:]] + [last]):
            if end <= after_lsn:
                continue
            path = self._path(first)
            with open(path, "rb") as f:
                for lsn in range(first, end + 1):
                    head = f.read(_FRAME.size)
                    magic, size, got_lsn, crc = _FRAME.unpack(head.ljust(_FRAME.size, b"\0"))
                    if len(head) < _FRAME.size or magic != _FRAME_MAGIC or got_lsn != lsn:
                        raise WALCorruption(f"{path}: record LSN {lsn} changed on disk since open")
                    if lsn <= after_lsn:
                        f.seek(size, os.SEEK_CUR)
                        continue
                    payload = f.read(size)
                    if len(payload) != size or encode_frame_header(lsn, payload) != head:
                        raise WALCorruption(f"{path}: record LSN {lsn} changed on disk since open")
                    yield lsn, payload

    def truncate_through(self, lsn: int) -> int:
        """Deletes sealed segments whose records all have LSN <= lsn; returns how many."""
        with self._mutex:
            doomed = [
                first
                for first, following in zip(self._firsts, self._firsts[1:])
                if following - 1 <= lsn
            ]
            for first in doomed:  # oldest first: a crash midway leaves a contiguous log
                self._path(first).unlink()
            if doomed:
                self._firsts = self._firsts[len(doomed) :]
                _fsync_dir(self.directory)
            return len(doomed)

    def close(self) -> None:
        """Closes the files and releases the directory; idempotent."""
        with self._mutex:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __del__(self) -> None:  # an abandoned log still releases its directory
        self.close()

    def __enter__(self) -> WriteAheadLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- snapshots ---------------------------------------------------------------------

# File: head (magic, format, header length), JSON header, arrays at 64-byte aligned
# offsets as raw little-endian C-order bytes, then tail (CRC32 of all before it, magic).
_SNAP_HEAD = struct.Struct("<8sIQ")
_SNAP_TAIL = struct.Struct("<I8s")
_SNAP_MAGIC, _SNAP_END, _SNAP_FORMAT = b"ATOLLSNP", b"SNAP-END", 1
_SNAPSHOT = re.compile(r"^(\d{20})\.snap$")
_TEMP = re.compile(r"^\..*\.snap\.tmp-")
_ALIGN = 64


def _pad(n: int) -> int:
    return -n % _ALIGN


def _dtype_name(dtype: np.dtype) -> str:
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise ValueError(f"snapshot arrays need a plain numeric dtype, got {dtype}")
    # ml_dtypes (bfloat16, float8_*) are kind "V" and known to numpy only by name.
    return dtype.name if dtype.kind == "V" else dtype.newbyteorder("<").str


def _dtype_of(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # noqa: F401  (registers bfloat16 etc. with numpy)

        return np.dtype(name)


def _plain(array: npt.ArrayLike) -> np.ndarray:
    """Little-endian, C-contiguous (a copy only where the input is neither)."""
    array = np.asarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.ascontiguousarray(array) if not array.flags.c_contiguous else array


def _bytes_of(array: np.ndarray) -> memoryview:
    return array.reshape(-1).view(np.uint8).data


@dataclasses.dataclass(frozen=True)
class Snapshot:
    lsn: int  # the last WAL record the state includes
    meta: dict[str, Any]  # what the saver passed: config, plan fingerprint, versions
    arrays: Arrays  # bit-exact copies, C-order, little-endian
    path: pathlib.Path  # the file it was loaded from

    def shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """{name: (dtype, shape)}, to check a resume is resuming the same model."""
        return {name: (str(a.dtype), a.shape) for name, a in self.arrays.items()}


def load_snapshot(path: str | os.PathLike[str]) -> Snapshot:
    """Reads and verifies one snapshot file; raises SnapshotCorruption if it fails a check."""
    path = pathlib.Path(path)

    def damaged(why: str) -> SnapshotCorruption:
        return SnapshotCorruption(f"snapshot {path} is damaged: {why}")

    file_size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_SNAP_HEAD.size)
        if len(head) < _SNAP_HEAD.size:
            raise damaged("shorter than its header")
        magic, fmt, header_len = _SNAP_HEAD.unpack(head)
        if magic != _SNAP_MAGIC:
            raise damaged("not an atoll snapshot (bad magic)")
        if fmt != _SNAP_FORMAT:
            raise StorageError(f"{path} is snapshot format {fmt}; this build reads {_SNAP_FORMAT}")
        if _SNAP_HEAD.size + header_len + _SNAP_TAIL.size > file_size:
            raise damaged("its header runs past the end of the file")
        prefix = head + f.read(header_len + _pad(_SNAP_HEAD.size + header_len))
        crc = zlib.crc32(prefix)
        try:
            header = json.loads(prefix[_SNAP_HEAD.size : _SNAP_HEAD.size + header_len])
            lsn, meta, entries = int(header["lsn"]), header["meta"], header["arrays"]
            layout = [
                (e["name"], _dtype_of(e["dtype"]), tuple(int(d) for d in e["shape"]))
                for e in entries
            ]
            if any(d < 0 for _, _, shape in layout for d in shape):
                raise ValueError("negative dimension")
        except (ValueError, KeyError, TypeError) as exc:
            raise damaged(f"unreadable header ({exc})") from None
        sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in layout]
        expected = len(prefix) + sum(n + _pad(n) for n in sizes) + _SNAP_TAIL.size
        if expected != file_size or path.name != f"{lsn:020d}.snap":
            raise damaged(
                f"{file_size} bytes named {path.name}, but its header describes "
                f"{expected} bytes at LSN {lsn}"
            )
        arrays = {}
        for (name, dtype, shape), size in zip(layout, sizes):
            array = np.empty(shape, dtype)
            view = _bytes_of(array)
            if f.readinto(view) != size:
                raise damaged(f"short read in array {name!r}")
            crc = zlib.crc32(f.read(_pad(size)), zlib.crc32(view, crc))
            arrays[name] = array
        stored, end = _SNAP_TAIL.unpack(f.read(_SNAP_TAIL.size))
        if end != _SNAP_END or stored != crc:
            raise damaged("checksum mismatch")
    return Snapshot(lsn, meta, arrays, path)


class SnapshotStore:
    """Atomic, checksummed snapshots of the shard's arrays, named by WAL LSN.

    Args:
      directory: where the snapshots live; created if missing; one open store per directory.
      keep: snapshots retained after each save (>= 2 lets `latest` fall back if the
        newest is damaged).

    Example:
      >>> with SnapshotStore(tmp / "snapshots") as store:
      ...     store.save(41, {"config": {...}}, {"params": params_N})
      ...     store.latest().lsn
      41
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 2):
        self._lock_fd: int | None = None
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (2 or more allows a fallback), got {keep}")
        self.directory, self.keep = pathlib.Path(directory), keep
        self._lock_fd = _lock_dir(self.directory, ".snapshots.lock")
        try:
            temps = [p for p in self.directory.iterdir() if _TEMP.match(p.name)]
            for p in temps:  # a save that crashed before its rename; never visible as a snapshot
                log.info("removing %s, left by a snapshot save that did not finish", p)
                p.unlink()
            if temps:
                _fsync_dir(self.directory)
        except BaseException:
            self.close()
            raise

    def _path(self, lsn: int) -> pathlib.Path:
        return self.directory / f"{lsn:020d}.snap"

    def lsns(self) -> list[int]:
        """LSNs of the snapshots on disk (not yet found damaged), oldest first."""
        return sorted(
            int(m.group(1)) for p in self.directory.iterdir() if (m := _SNAPSHOT.match(p.name))
        )

    def save(
        self, lsn: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
    ) -> pathlib.Path:
        """Writes a snapshot of the state after WAL record `lsn` atomically; returns its path.

        `meta` must be JSON (config, plan fingerprint, versions); arrays round-trip
        bit-exactly with dtype and shape, stored little-endian and C-order.
        """
        if self._lock_fd is None:
            raise StorageError(f"the snapshot store in {self.directory} is closed")
        existing = self.lsns()
        if lsn < 0 or (existing and lsn < existing[-1]):
            raise ValueError(
                f"snapshot LSN must be >= 0 and not older than the newest "
                f"({existing[-1] if existing else 0}), got {lsn}"
            )
        plain = {str(name): _plain(a) for name, a in arrays.items()}
        entries, offset = [], 0
        for name, a in plain.items():
            entries.append(
                {
                    "name": name,
                    "dtype": _dtype_name(a.dtype),
                    "shape": list(a.shape),
                    "offset": offset,
                    "nbytes": a.nbytes,
                }
            )
            offset += a.nbytes + _pad(a.nbytes)
        try:
            header = json.dumps(
                {"lsn": lsn, "meta": meta, "arrays": entries}, allow_nan=False, sort_keys=True
            ).encode()
        except (TypeError, ValueError) as exc:
            raise ValueError(
                "snapshot meta must be JSON: dicts with str keys, lists, str, "
                f"int, finite float, bool, None ({exc})"
            ) from None
        prefix = _SNAP_HEAD.pack(_SNAP_MAGIC, _SNAP_FORMAT, len(header)) + header
        prefix += bytes(_pad(len(prefix)))
        final = self._path(lsn)
        temp = self.directory / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            crc, pieces = 0, [memoryview(prefix)]
            for a in plain.values():
                pieces += [_bytes_of(a), memoryview(bytes(_pad(a.nbytes)))]
            for view in pieces:
                crc = zlib.crc32(view, crc)
                _write_all(fd, view)
            _write_all(fd, memoryview(_SNAP_TAIL.pack(crc, _SNAP_END)))
            os.fsync(fd)  # the bytes are on disk before the name points at them
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(temp, final)  # atomic: a reader sees the old set or the whole new file
        _fsync_dir(self.directory)
        doomed = self.lsns()[: -self.keep]
        for old in doomed:
            self._path(old).unlink()
        if doomed:
            _fsync_dir(self.directory)
        return final

    def latest(self) -> Snapshot | None:
        """The newest snapshot that passes its checks; None if there is none at all.

        A damaged one is logged and renamed to *.damaged (kept for inspection), and the
        next older one is tried; if every snapshot is damaged, SnapshotCorruption.
        """
        errors = []
        for lsn in reversed(self.lsns()):
            try:
                return load_snapshot(self._path(lsn))
            except SnapshotCorruption as exc:
                log.warning("%s; moving it aside and falling back to an older snapshot", exc)
                errors.append(str(exc))
                os.replace(self._path(lsn), self._path(lsn).with_suffix(".snap.damaged"))
                _fsync_dir(self.directory)
        if errors:
            raise SnapshotCorruption(
                "every snapshot is damaged, refusing to start from nothing: " + "; ".join(errors)
            )
        return None

    def truncatable_lsn(self) -> int:
        """The LSN through which the WAL may be truncated: the oldest of the newest `keep`
        snapshots, once min(keep, 2) exist (so a damaged newest one can fall back), else 0."""
        lsns = self.lsns()
        return lsns[max(len(lsns) - self.keep, 0)] if len(lsns) >= min(self.keep, 2) else 0

    def close(self) -> None:
        """Releases the directory; idempotent."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __del__(self) -> None:  # an abandoned store still releases its directory
        self.close()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
