"""A shard's snapshots: atomic files of the state its log built (`SnapshotStore`), the
half of durable storage beside the write-ahead log (server/storage.py, whose docstring
states both halves' guarantees: 6 and 7 are this module's).

File: head (magic, format, header length), JSON header, arrays at 64-byte aligned
offsets as raw little-endian C-order bytes, then tail (CRC32 of all before it, magic).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import re
import secrets
import struct
import zlib
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from atoll.server.storage import (
    Arrays,
    SnapshotCorruption,
    StorageError,
    fsync_dir,
    lock_dir,
    write_all,
)

log = logging.getLogger(__name__)


class SnapshotStorage(Protocol):
    """What the shard needs of a snapshot store; tests/test_storage.py is the contract."""

    def save(
        self, lsn: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
    ) -> pathlib.Path: ...
    def latest(self) -> Snapshot | None: ...
    def lsns(self) -> list[int]: ...
    def truncatable_lsn(self) -> int: ...
    def close(self) -> None: ...


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
            raise damaged(f"{len(head)} bytes, shorter than its header (at byte {len(head)})")
        magic, fmt, header_len = _SNAP_HEAD.unpack(head)
        if magic != _SNAP_MAGIC:
            raise damaged("not an atoll snapshot (bad magic at byte 0)")
        if fmt != _SNAP_FORMAT:
            raise StorageError(f"{path} is snapshot format {fmt}; this build reads {_SNAP_FORMAT}")
        if _SNAP_HEAD.size + header_len + _SNAP_TAIL.size > file_size:
            raise damaged(f"its header runs past the end of the file (byte {file_size})")
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
            raise damaged(f"unreadable header at byte {_SNAP_HEAD.size} ({exc})") from None
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
            at = f.tell()
            if f.readinto(view) != size:
                raise damaged(f"short read in array {name!r} at byte {at}")
            crc = zlib.crc32(f.read(_pad(size)), zlib.crc32(view, crc))
            arrays[name] = array
        stored, end = _SNAP_TAIL.unpack(f.read(_SNAP_TAIL.size))
        if end != _SNAP_END or stored != crc:
            raise damaged(
                f"checksum mismatch: some byte of 0..{file_size} changed (the CRC covers all)"
            )
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
        self._lock_fd = lock_dir(self.directory, ".snapshots.lock")
        try:
            temps = [p for p in self.directory.iterdir() if _TEMP.match(p.name)]
            for p in temps:  # a save that crashed before its rename; never visible as a snapshot
                log.info("removing %s, left by a snapshot save that did not finish", p)
                p.unlink()
            if temps:
                fsync_dir(self.directory)
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
                write_all(fd, view)
            write_all(fd, memoryview(_SNAP_TAIL.pack(crc, _SNAP_END)))
            os.fsync(fd)  # the bytes are on disk before the name points at them
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(temp, final)  # atomic: a reader sees the old set or the whole new file
        fsync_dir(self.directory)
        doomed = self.lsns()[: -self.keep]
        for old in doomed:
            self._path(old).unlink()
        if doomed:
            fsync_dir(self.directory)
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
                fsync_dir(self.directory)
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
