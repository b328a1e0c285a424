"""Durable storage of one syncer shard: a write-ahead log of accepted pushes (here) and
atomic snapshots of the state they built (server/snapshots.py, over this module's errors
and directory helpers).

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
   appends (LogFailed) until reopened: after a failed fsync the page cache no
   longer says what is on disk. Callers treat such a record as unknown, and never
   acknowledge it. One exception: a write the disk had no room for (ENOSPC,
   EDQUOT) is taken back whole (the segment cut back to where the batch began,
   segments it opened removed, fsynced) and raises DiskFull; the log then takes
   appends again, so a writer retries once space returns. Only if taking it back
   fails does the log refuse appends as above. A failed fsync is final for the
   shard over the log too: it stops serving and says why (NOT_SERVING), as etcd and
   PostgreSQL do, rather than re-write its memory to a new segment (that memory may
   hold merges whose records the failed fsync left unknown); a restart replays what
   the disk holds. Tests inject one in a real process with FAULT_FSYNC_ENV.
4. Damage anywhere but the tail (a bad record followed by a valid one, or a bad
   record in a sealed segment) stops the open with WALCorruption: acknowledged
   data is never dropped silently. Limit: a damaged *final* record looks exactly
   like a torn write, and is cut off. WALCorruption names the file, byte offset and
   LSN; `open_log` turns it into a `DamagedLog` that opens nothing and answers every
   call with it, so the shard can say why it does not recover; `set_aside_damaged`
   moves a damaged log aside only when a snapshot holds every record of it (both in
   server/log_damage.py).
5. `truncate_through(n)` deletes only whole sealed segments whose records all have
   LSN <= n, oldest first; the active segment stays. `replay(after)` raises
   MissingRecords when records after `after` are gone or `after` is past the end.

Snapshots (`snapshots.SnapshotStore`; one directory, one open store at a time):

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

import errno
import fcntl
import io
import logging
import os
import pathlib
import re
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from typing import Protocol, TypeAlias

import numpy as np

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]


class StorageError(Exception):
    """Storage cannot do what was asked; the message says why and what to do."""


class WALCorruption(StorageError):
    """Acknowledged log records are damaged; the log refuses to drop them silently.

    `path`, `offset` and `lsn` say where: the segment, the byte the damage starts at and
    the LSN of the first record it takes (0 where unknown)."""

    def __init__(self, message: str, path: pathlib.Path, offset: int = 0, lsn: int = 0):
        super().__init__(message)
        self.path, self.offset, self.lsn = path, offset, lsn


class SnapshotCorruption(StorageError):
    """A snapshot file fails its checks (truncated, bit flips, not a snapshot)."""


class MissingRecords(StorageError):
    """A replay needs records the log no longer (or never) held."""


class LogFailed(StorageError):
    """An earlier write or fsync failed; reopen the log to recover."""


class DiskFull(StorageError):
    """The disk had no room for a write: none of it was kept, and the log takes appends
    again (retry once space returns)."""


# Tests only, off unless set: while the file this names exists, every fsync of a log
# opened meanwhile fails with EIO (an injected disk error, for a real process).
FAULT_FSYNC_ENV = "ATOLL_TEST_FAIL_FSYNC_WHILE_FILE_EXISTS"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


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


# -- shared helpers ----------------------------------------------------------------

# fdatasync also flushes the file size, which is all an append changes besides data.
_datasync = getattr(os, "fdatasync", os.fsync)


def write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock_dir(path: pathlib.Path, name: str) -> int:
    """Creates `path` durably and takes an exclusive lock on it (one writer only)."""
    if not path.is_dir():
        path.mkdir(parents=True)
        fsync_dir(path.parent)
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
SEGMENT_NAME = re.compile(r"^(\d{20})\.wal$")  # named by the LSN of its first record
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


def valid_frame_after(f: io.BufferedIOBase, start: int, file_size: int, min_lsn: int) -> bool:
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
        self._fault_file = os.environ.get(FAULT_FSYNC_ENV) or None
        if self._fault_file is not None:
            log.warning(
                "WAL %s: fsyncs fail while %s exists (%s)",
                directory,
                self._fault_file,
                FAULT_FSYNC_ENV,
            )
        self.last_sync_seconds = 0.0  # how long the newest append's fsync took
        self._lock_fd = lock_dir(self.directory, ".wal.lock")
        try:
            self._recover()
        except BaseException:
            self.close()
            raise

    def _path(self, first_lsn: int) -> pathlib.Path:
        return self.directory / f"{first_lsn:020d}.wal"

    def _recover(self) -> None:
        firsts = sorted(
            int(m.group(1)) for p in self.directory.iterdir() if (m := SEGMENT_NAME.match(p.name))
        )
        if not firsts:
            os.close(os.open(self._path(1), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            fsync_dir(self.directory)
            firsts = [1]
        due = firsts[0]
        for i, first in enumerate(firsts):
            path = self._path(first)
            if first != due:
                raise WALCorruption(
                    f"{path} starts at LSN {first} but the segment before it "
                    f"ends at LSN {due - 1}: a segment is missing or misnamed",
                    path,
                    0,
                    due,
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
                if i < len(firsts) - 1 or valid_frame_after(f, end, file_size, due):
                    raise WALCorruption(
                        f"{path} at byte {end}: record LSN {due} is damaged ({found}) and is not "
                        "the log's last record, so acknowledged data would be lost; restore the "
                        "log from a backup or replica, or move the damaged segment aside knowingly",
                        path,
                        end,
                        due,
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
            began = (len(self._firsts), self._size, self._next_lsn)
            try:
                lsns = []
                for record in records:
                    parts = _parts(record)
                    frame_bytes = _FRAME.size + sum(p.nbytes for p in parts)
                    if self._size and self._size + frame_bytes > self.segment_bytes:
                        self._rotate()
                    fd = self._fd
                    assert fd is not None  # checked open; a rotation opens the next segment
                    write_all(fd, memoryview(encode_frame_header(self._next_lsn, record)))
                    for part in parts:
                        write_all(fd, part)
                    self._size += frame_bytes
                    lsns.append(self._next_lsn)
                    self._next_lsn += 1
            except OSError as exc:
                if self._failed is None and exc.errno in _DISK_FULL and self._take_back(*began):
                    raise DiskFull(
                        f"no room on the disk of {self.directory} for {len(records)} log "
                        f"record(s) ({exc.strerror}); none was kept: retry once space returns"
                    ) from exc
                self._failed = exc
                raise
            except BaseException as exc:
                self._failed = exc
                raise
            return lsns

    def _take_back(self, segments: int, size: int, next_lsn: int) -> bool:
        """Undoes a batch the disk had no room for (under the log's lock): the segments it
        opened removed, the one it began in cut back to `size` and fsynced, so neither a
        restart nor the next write finds any of it. False if that failed too."""
        try:
            if len(self._firsts) > segments or self._fd is None:
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
                for first in self._firsts[segments:]:
                    self._path(first).unlink(missing_ok=True)
                del self._firsts[segments:]
                fsync_dir(self.directory)
                self._fd = os.open(self._path(self._firsts[-1]), os.O_WRONLY)
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
            os.lseek(self._fd, size, os.SEEK_SET)  # the next write goes where this one began
        except OSError:
            log.exception(
                "WAL %s: could not take back a write the disk had no room for", self.directory
            )
            return False
        self._size, self._next_lsn = size, next_lsn
        log.warning(
            "WAL %s: the disk is full; a write of LSN %d on was taken back, appends go on "
            "once space returns",
            self.directory,
            next_lsn,
        )
        return True

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
                    self._datasync(fd)  # fsync before ack: the ack is a promise
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

    def _datasync(self, fd: int) -> None:
        if self._fault_file is not None and os.path.exists(self._fault_file):
            raise OSError(errno.EIO, f"fsync failure injected ({FAULT_FSYNC_ENV})")
        _datasync(fd)

    def _rotate(self) -> None:
        old, self._fd = self._fd, None
        assert old is not None
        try:
            self._datasync(old)
        except BaseException as exc:
            self._failed = exc  # a failed fsync is never taken back (see guarantee 3)
            raise
        finally:
            os.close(old)
        self._fd = os.open(self._path(self._next_lsn), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._firsts.append(self._next_lsn)
        self._size = 0
        try:
            fsync_dir(
                self.directory
            )  # the segment's name is durable before any record in it is acked
        except BaseException as exc:
            self._failed = exc
            raise

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
                        raise WALCorruption(
                            f"{path}: record LSN {lsn} changed on disk since open", path, 0, lsn
                        )
                    if lsn <= after_lsn:
                        f.seek(size, os.SEEK_CUR)
                        continue
                    payload = f.read(size)
                    if len(payload) != size or encode_frame_header(lsn, payload) != head:
                        raise WALCorruption(
                            f"{path}: record LSN {lsn} changed on disk since open", path, 0, lsn
                        )
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
                fsync_dir(self.directory)
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
