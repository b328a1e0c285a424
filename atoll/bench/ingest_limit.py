"""What ingesting pushes costs at the least, for `atoll bench ingest`'s cost_over_limit.

The work a shard cannot avoid for a push: decompress and check its frame, take its
per-tensor norms, fold it into the round's accumulator (the codec's kernels, as the
merge calls them), and write its bytes to the log with the shard's fsync cadence. This
runs that work alone on one core (one codec thread, pinned where the host has cores to
pin), on the very frames the learners pushed, into one accumulator reused round after
round and a file in the shard's data directory, and reports the CPU it took (user +
system, so the log's page-cache copies and fsyncs count) per MB of frames.

Each frame is written in the messages it came in (`CHUNK_BYTES` each), as the shard's
log writes it: one write of a whole 6 MB frame took up to 4x the system time per MB,
and the more the fewer fsyncs came between, which no shard has to spend.
"""

from __future__ import annotations

import os
import pathlib
import resource
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from atoll.local.processes import _die_with_parent
from atoll.wire import codec
from atoll.wire.client import CHUNK_BYTES
from atoll.wire.plan import FragmentPlan, Slot

DELTA_STD = 1e-3  # scale of the synthetic outer gradients


def learner_frames(plan: FragmentPlan, index: int) -> list[bytes]:
    """Learner `index`'s INT4 frame of every fragment: the same bytes on every call."""
    frames = []
    for p, size in enumerate(plan.fragment_sizes):
        rng = np.random.default_rng([index, p])
        delta = rng.standard_normal(size, dtype=np.float32) * np.float32(DELTA_STD)
        frames.append(codec.encode(delta, codec.Codec.INT4))
    return frames


class _Segments:
    """A fragment's tensors as the merge reads them (`merge.Segments`, without importing
    the merge and the JAX it brings into this process)."""

    def __init__(self, slots: Sequence[Slot]) -> None:
        self.offsets = np.asarray([s.offset for s in slots], np.int64)
        self.ends = np.asarray([s.end for s in slots], np.int64)
        self.embedding = np.asarray([bool(s.spec.embedding) for s in slots], bool)
        self.size = int(self.ends[-1])


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _slices(frame: bytes, k: int) -> list[memoryview]:
    """`frame` cut into k pieces of about equal size, in order."""
    view, n = memoryview(frame), len(frame)
    return [view[n * j // k : n * (j + 1) // k] for j in range(k)]


def _write_all(fd: int, data: memoryview) -> None:
    """Writes `data` in pieces of at most CHUNK_BYTES: a push's messages, as the log does."""
    for start in range(0, len(data), CHUNK_BYTES):
        piece = data[start : start + CHUNK_BYTES]
        while piece:
            piece = piece[os.write(fd, piece) :]


def measure(
    plan: FragmentPlan, frames: list[list[bytes]], rounds: int, log_path: pathlib.Path, fsyncs: int
) -> dict[str, Any]:
    """CPU seconds and bytes of `rounds` rounds of every learner's frame of every fragment.

    Each round of a fragment goes into the same accumulator (warm pages; the round's
    first push written over it, as the merge does), and each push is weighted 1 and merged by RDA on non-embedding
    tensors, as `merge.RoundAccumulator` does; `fsyncs` fdatasyncs are spread evenly
    over the pushes (more than one for a push where the shard's outnumber the pushes, as
    for pushes in parts, each after its own slice of the push's bytes)."""
    segments = [_Segments(plan.tensors_of(p)) for p in range(plan.num_fragments)]
    acc = np.zeros(max(plan.fragment_sizes), np.float32)
    pushes = rounds * plan.num_fragments * len(frames)
    done = synced = written = 0
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        started = _cpu_seconds()
        for _ in range(rounds):
            for p, seg in enumerate(segments):
                out = acc[: seg.size]
                for i, learner in enumerate(frames):
                    frame = learner[p]
                    codes = codec.read_codes(frame, codec=codec.Codec.INT4, num_values=seg.size)
                    norms = np.sqrt(codes.range_sq_norms(seg.offsets, seg.ends))
                    with np.errstate(divide="ignore"):
                        unit = np.where(norms > 0, 1.0 / norms, 0.0)
                    scales = np.where(seg.embedding, 1.0, unit)
                    codes.accumulate_ranges(out, seg.offsets, seg.ends, scales, add=i > 0)
                    done += 1
                    # the fsyncs due by this push, each after a slice of its bytes: a push
                    # in parts has one per part
                    due = done * fsyncs // pushes - synced
                    for piece in _slices(frame, max(due, 1)):
                        _write_all(fd, piece)
                        if due > 0:
                            os.fdatasync(fd)
                            synced += 1
                    written += len(frame)
        cpu = _cpu_seconds() - started
    finally:
        os.close(fd)
        log_path.unlink(missing_ok=True)
    return {"cpu_seconds": cpu, "bytes": written, "pushes": done, "fsyncs": synced}


def run_limit(
    conn: Connection,
    plan_json: str,
    learners: int,
    rounds: int,
    log_path: str,
    fsyncs: int,
    cpu: int | None,
) -> None:
    """A child process: pins itself to `cpu` (None: not pinned), one codec thread, then
    sends `measure`'s result over `conn`."""
    _die_with_parent()
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    codec.set_threads(1)
    plan = FragmentPlan.from_json(plan_json)
    frames = [learner_frames(plan, i) for i in range(learners)]
    conn.send(measure(plan, frames, rounds, pathlib.Path(log_path), fsyncs))
