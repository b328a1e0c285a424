"""A write-ahead log that fails its checks at start-up (storage.py's guarantee 4): a
stand-in that says why, so the shard reports the damage instead of dying, and the one
repair that provably loses nothing acknowledged.

What can be known: an append is acknowledged only after an fsync covered it, and nothing
on disk records which fsyncs returned, so any record that reached the disk whole may
have been acknowledged. A damaged record, or whole ones after it, can therefore be
dropped only where something else holds them: a snapshot whose LSN is at or past every
record in the log (as after a clean stop, whose final snapshot covers the whole log).
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Iterable, Iterator

from atoll.server.storage import (
    SEGMENT_NAME,
    Record,
    StorageError,
    WALCorruption,
    WriteAheadLog,
    fsync_dir,
    lock_dir,
    valid_frame_after,
)

log = logging.getLogger(__name__)


class DamagedLog:
    """The log of a directory `WriteAheadLog` refused to open: every call but `close`
    raises the WALCorruption that said why, so recovery can report it (file, offset)
    instead of dying. Holds the directory's lock, as the open log would."""

    def __init__(self, directory: pathlib.Path, error: WALCorruption):
        self.directory, self.error = directory, error
        self._lock_fd: int | None = lock_dir(directory, ".wal.lock")

    def _refuse(self) -> WALCorruption:
        return self.error

    @property
    def first_lsn(self) -> int:
        return 0

    @property
    def last_lsn(self) -> int:
        return 0

    @property
    def written_lsn(self) -> int:
        return 0

    def append(self, record: Record) -> int:
        raise self._refuse()

    def append_many(self, records: Iterable[Record]) -> list[int]:
        raise self._refuse()

    def write_many(self, records: Iterable[Record]) -> list[int]:
        raise self._refuse()

    def sync(self, lsn: int) -> float | None:
        raise self._refuse()

    def replay(self, after_lsn: int = 0) -> Iterator[tuple[int, bytes]]:
        raise self._refuse()

    def truncate_through(self, lsn: int) -> int:
        raise self._refuse()

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def open_log(directory: pathlib.Path) -> WriteAheadLog | DamagedLog:
    """The write-ahead log in `directory`, or a DamagedLog saying why it cannot be opened."""
    try:
        return WriteAheadLog(directory)
    except WALCorruption as e:
        log.error("%s", e)
        return DamagedLog(directory, e)


def records_after(directory: pathlib.Path, lsn: int) -> bool:
    """Whether any segment in `directory` may hold a record with an LSN past `lsn`: a
    non-empty segment named past it, or a whole, valid frame past it anywhere."""
    for path in sorted(directory.iterdir()):
        m = SEGMENT_NAME.match(path.name)
        size = path.stat().st_size if m else 0
        if not size:
            continue
        assert m is not None  # only segments have a size here
        if int(m.group(1)) > lsn:
            return True
        with open(path, "rb") as f:
            if valid_frame_after(f, -1, size, lsn + 1):
                return True
    return False


def set_aside_damaged(damage: WALCorruption, covered_through: int) -> list[pathlib.Path]:
    """Moves the damaged log `damage` names aside when a snapshot at LSN `covered_through`
    holds every record of it: each segment renamed *.wal.damaged (kept for inspection),
    and an empty one started at LSN covered_through + 1, so the log goes on where the
    snapshot ends. Returns the segments moved. Raises StorageError, changing nothing,
    when a record past `covered_through` may be in the log (the damaged one included):
    only the log holds it, and nothing on disk says whether it was acknowledged."""
    directory = damage.path.parent
    if damage.lsn > covered_through or records_after(directory, covered_through):
        raise StorageError(
            f"the log in {directory} holds records past LSN {covered_through}, the newest "
            "snapshot's: only the log holds them and any may have been acknowledged, so it "
            "is not set aside"
        )
    moved = []
    for path in sorted(p for p in directory.iterdir() if SEGMENT_NAME.match(p.name)):
        path.rename(path.with_suffix(".wal.damaged"))
        moved.append(path)
    fresh = directory / f"{covered_through + 1:020d}.wal"
    os.close(os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    fsync_dir(directory)
    log.warning(
        "WAL %s: set aside %d damaged segment(s) as *.wal.damaged; every record in them is "
        "at or before LSN %d, which the newest snapshot holds; the log goes on from LSN %d",
        directory,
        len(moved),
        covered_through,
        covered_through + 1,
    )
    return moved
