"""Blockwise 4-bit codecs for outer gradients and weight deltas, zstd-framed in chunks.

A frame (version 2) is, all integers little-endian:

  header  16 bytes: magic b"ATLQ", codec id (u8), frame version (u8), block (u16),
          value count n (u64)
  table   (k - 1) x u32: the compressed length of every chunk but the last, where
          k = max(1, ceil(n / CHUNK_VALUES))
  chunks  k zstd frames, each with its content size and a checksum; chunk i holds
          values [i * CHUNK_VALUES, min((i + 1) * CHUNK_VALUES, n)) as a body of its
          own: per-block scales, then 4-bit codes two to a byte (`wire/_kernels.c`
          gives the layout); FP32 bodies are the float32 values. The last chunk runs
          to the end of the frame.

Chunks are independent, so encode, decode and the merge kernels run them on threads
(`set_threads`; the C kernels release the GIL). The chunk grid is fixed by the format,
never by the thread count, and every sum across chunks is taken in chunk order: the
bytes of a frame and every decoded value, norm and accumulated sum are the same on any
number of threads and any host.

Wire compatibility, decided here:
  * Codec ids are those of atoll.v1.Codec and never change meaning.
  * Writers emit version 2 only. Readers take versions 1 and 2: a version 1 frame is one
    zstd frame over the whole body (all scales, then all codes) and decodes to the same
    values, so a shard replays a write-ahead log written by an older build. Older builds
    refuse version 2 with "frame version 2 is not supported": upgrade shards before
    learners.
  * A version 2 frame of at most CHUNK_VALUES values is a version 1 frame with its
    version byte changed (empty table, one chunk with version 1's body).
  * CHUNK_VALUES is part of version 2; another chunk size needs another version.

Formats (measured on Gaussian data, 32-value blocks):
  INT4   symmetric int4 in [-7, 7], bfloat16 scale rounded up from absmax / 7.
         The default: relative error ~0.097, ~3.9 bits/param after zstd.
  MXFP4  OCP MX FP4 (E2M1 values, E8M0 power-of-two scale). Relative error ~0.115.
  FP32   lossless float32, for snapshots and full-precision comparisons.

Reading is check-then-apply: `read_codes` decompresses and checks every chunk (header,
table, zstd frames, scales, padding, finiteness) and only then does anything write to
a caller's buffer; a malformed frame raises CodecError and changes nothing.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import enum
import itertools
import os
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import zstandard

from atoll.wire import _kernels

MAGIC = b"ATLQ"
FRAME_VERSION = 2
READ_VERSIONS = (1, 2)  # version 1: one zstd frame over the whole body
BLOCK: int = _kernels.BLOCK
CHUNK_VALUES = 1 << 18  # values per chunk: an INT4 chunk body is 144 KiB and stays in L2
_HEADER = struct.Struct("<4sBBHQ")  # magic, codec, frame version, block, num values
HEADER_BYTES = _HEADER.size
# The zstd settings favour speed: 4-bit codes have no long matches to find, so a
# small match search costs little ratio while Huffman coding of the literals does
# the compressing (measured: 3.64 bits per 4-bit code at ~600 MB/s).
_ZSTD_PARAMS = dict(
    strategy=zstandard.STRATEGY_FAST,
    window_log=17,
    hash_log=10,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,
    write_checksum=1,
    write_content_size=1,
)
_ZSTD_FRAME_OVERHEAD = 32  # zstd frame header (<= 18 bytes) and checksum (4), rounded up
THREADS_ENV = "ATOLL_CODEC_THREADS"  # threads for chunks; default: the CPUs this process may use
# |scale * value| below this cannot carry a finite float32 sum to infinity: FLT_MAX plus
# less than half its ulp (2^103) still rounds to FLT_MAX.
_SAFE_PRODUCT = 2.0**102


Frame: TypeAlias = bytes | memoryview  # a frame's bytes, read in place


class Codec(enum.IntEnum):
    """Codec ids on the wire; equal to atoll.v1.Codec."""

    FP32 = 1
    MXFP4 = 2
    INT4 = 3


DEFAULT_CODEC = Codec.INT4
_KERNEL_FORMAT = {Codec.INT4: _kernels.INT4, Codec.MXFP4: _kernels.MXFP4, Codec.FP32: _kernels.FP32}
_SCALE_BYTES = {Codec.INT4: 2, Codec.MXFP4: 1}


class CodecError(ValueError):
    """A frame that cannot be decoded, or input that cannot be encoded."""


@dataclasses.dataclass(frozen=True)
class FrameInfo:
    codec: Codec
    num_values: int
    block: int  # values per scale (1 for FP32)


def _codec(value: int) -> Codec:
    try:
        return Codec(value)
    except ValueError:
        raise CodecError(
            f"unknown codec {value!r}; expected one of {[c.name for c in Codec]}"
        ) from None


def body_bytes(codec: Codec, num_values: int) -> int:
    """Length of the uncompressed bodies of a frame of num_values values, all chunks together."""
    if codec == Codec.FP32:
        return 4 * num_values
    blocks = -(-num_values // BLOCK)
    return blocks * (_SCALE_BYTES[codec] + BLOCK // 2)


def _num_chunks(n: int) -> int:
    return max(1, -(-n // CHUNK_VALUES))


def _chunk_spans(n: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of an n-value frame (one empty chunk when n == 0)."""
    return [(s, min(s + CHUNK_VALUES, n)) for s in range(0, max(n, 1), CHUNK_VALUES)]


def max_frame_bytes(num_values: int, codec: Codec) -> int:
    """The most bytes a frame of num_values values can take: header, table and zstd's worst case.

    zstd never grows a body by more than ZSTD_COMPRESSBOUND (a byte per 256, plus a
    little for bodies under 128 KiB) and its frame header and checksum; receivers use
    this to refuse a declared size before buffering a byte of it.

    Example:
      >>> len(encode(np.ones(1000, np.float32))) <= max_frame_bytes(1000, Codec.INT4)
      True
    """
    codec = _codec(codec)

    def bound(values: int) -> int:  # one chunk: zstd frame overhead + ZSTD_COMPRESSBOUND
        body = body_bytes(codec, values)
        small = ((128 << 10) - body) >> 11 if body < 128 << 10 else 0
        return _ZSTD_FRAME_OVERHEAD + body + (body >> 8) + small

    k = _num_chunks(num_values)
    last = num_values - (k - 1) * CHUNK_VALUES
    return HEADER_BYTES + 4 * (k - 1) + (k - 1) * bound(CHUNK_VALUES) + bound(last)


def _as_f32(x: np.ndarray, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise CodecError(f"{what} must be float32, got {x.dtype}")
    return np.ascontiguousarray(x).reshape(-1)


# ---- threads ----

_local = threading.local()
_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_workers = 0


def _default_threads() -> int:
    env = os.environ.get(THREADS_ENV, "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{THREADS_ENV}={env!r}: want a whole number of threads >= 1")
        return n
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_threads = _default_threads()


def set_threads(n: int | None) -> int:
    """Sets how many threads run a frame's chunks (None: the default); returns the old count.

    Results never depend on it, only speed does. The default is $ATOLL_CODEC_THREADS,
    else every CPU this process may run on.
    """
    global _threads
    new = _default_threads() if n is None else int(n)
    if new < 1:
        raise ValueError(f"threads={n}: want >= 1")
    old, _threads = _threads, new
    return old


def get_threads() -> int:
    """How many threads run a frame's chunks."""
    return _threads


def _get_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The shared pool, with at least `workers` threads (a smaller one is retired)."""
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)  # its queued work still runs
            _pool, _pool_workers = (
                concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="codec"),
                workers,
            )
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist here."""
    global _pool, _pool_workers, _pool_lock
    _pool, _pool_workers, _pool_lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def parallel(fn: Callable[[int], Any], n: int) -> list[Any]:
    """[fn(0), ..., fn(n - 1)] on up to get_threads() threads, the caller's included.

    Items go to whichever thread is free (each writes only its own outputs), so the
    results do not depend on timing. The first failure in item order is raised, after
    every item has finished.
    """
    threads = min(_threads, n)
    if threads <= 1 or getattr(_local, "in_pool", False):
        return [fn(i) for i in range(n)]
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n
    items = iter(range(n))  # next() on a range iterator is atomic under the GIL

    def work(in_pool: bool) -> None:
        _local.in_pool = in_pool
        for i in items:
            try:
                results[i] = fn(i)
            except BaseException as e:  # noqa: BLE001 - re-raised below, in item order
                errors[i] = e

    futures = [_get_pool(threads - 1).submit(work, True) for _ in range(threads - 1)]
    work(False)
    for f in futures:
        if not f.cancel():  # queued behind another frame's work: nothing left for it
            f.result()
    for e in errors:
        if e is not None:
            raise e
    return results


# ---- zstd ----


def _compressor(level: int | None) -> zstandard.ZstdCompressor:
    """One compressor per thread and level: zstd contexts are not thread-safe."""
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        if level is None:
            params = zstandard.ZstdCompressionParameters(**_ZSTD_PARAMS)
        else:
            params = zstandard.ZstdCompressionParameters.from_level(
                level, write_checksum=1, write_content_size=1
            )
        cache[level] = zstandard.ZstdCompressor(compression_params=params)
    compressor: zstandard.ZstdCompressor = cache[level]
    return compressor


def _scratch(size: int) -> np.ndarray:
    """This thread's reusable byte buffer for a chunk body (no fresh pages per chunk)."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.size < size:
        buf = _local.scratch = np.empty(max(size, body_bytes(Codec.INT4, CHUNK_VALUES)), np.uint8)
    return buf[:size]


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def _inflate(payload: memoryview, codec: Codec, count: int, what: str) -> bytes:
    """Decompresses exactly one complete zstd frame holding `count` values' body, or raises CodecError."""
    expected = body_bytes(codec, count)
    try:
        size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise CodecError(f"corrupt {what}: {e}") from None
    if size != expected:
        raise CodecError(
            f"{what} declares {size} bytes; {count} {codec.name} values need {expected}"
        )
    if expected <= 4 * CHUNK_VALUES:  # allocates `expected` up front: only for chunk-sized bodies
        try:
            body = _decompressor().decompress(payload, allow_extra_data=False)
            if len(body) == expected:
                return body
        except zstandard.ZstdError:
            pass
    # A version 1 body, or something is wrong: a streaming pass that says what.
    dobj = zstandard.ZstdDecompressor().decompressobj()
    try:
        body = dobj.decompress(payload)
    except zstandard.ZstdError as e:
        raise CodecError(f"corrupt {what}: {e}") from None
    if not dobj.eof or len(body) != expected:
        raise CodecError(f"truncated frame: {what} ends after {len(body)} of {expected} bytes")
    if dobj.unused_data:
        raise CodecError(f"{len(dobj.unused_data)} stray bytes after the {what}")
    return body


# ---- encode ----


def _assemble(codec: Codec, n: int, chunks: Sequence[Sequence[bytes]]) -> bytes:
    """Header, table and compressed chunks (each a list of pieces): a version 2 frame."""
    header = _HEADER.pack(MAGIC, int(codec), FRAME_VERSION, 1 if codec == Codec.FP32 else BLOCK, n)
    table = struct.pack(f"<{len(chunks) - 1}I", *[sum(map(len, c)) for c in chunks[:-1]])
    return b"".join([header, table, *itertools.chain.from_iterable(chunks)])  # one copy


def _frame(codec: Codec, n: int, body: Frame | np.ndarray, level: int | None = None) -> bytes:
    """A frame around ready-made chunk bodies laid back to back (for frames the encoder
    would not write, e.g. an incompressible worst case)."""
    mv = memoryview(body).cast("B")  # type: ignore[arg-type]  # numpy types no buffer before 3.12
    chunks: list[list[bytes]] = []
    at = 0
    for start, stop in _chunk_spans(n):
        size = body_bytes(codec, stop - start)
        chunks.append([_compressor(level).compress(mv[at : at + size])])
        at += size
    return _assemble(codec, n, chunks)


def _compress_4bit(codec: Codec, body: np.ndarray, count: int, level: int | None) -> list[bytes]:
    """One 4-bit chunk body of `count` values (scales, then codes) as a zstd frame, in pieces."""
    # The scales end a zstd block of their own: one Huffman table for scales and
    # codes together costs ~0.18 bits per INT4 value (measured, Gaussian data).
    split = -(-count // BLOCK) * _SCALE_BYTES[codec]
    z = _compressor(level).compressobj(size=body.size)
    return [
        z.compress(body[:split].data),
        z.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK),
        z.compress(body[split:].data),
        z.flush(),
    ]


def _encode(
    x: np.ndarray,
    residual: np.ndarray | None,
    codec: Codec,
    level: int | None,
    r_out: np.ndarray | None = None,
    publish: bool = False,
) -> bytes:
    """The frame of x (+ residual); raises CodecError on non-finite input.

    When r_out is given (never `residual` itself) the new residual is written there.
    publish: the frame of x − residual instead, each decoded value added to r_out (which
    may be `residual` itself) as `decode_into` adds it."""
    codec = _codec(codec)
    spans = _chunk_spans(x.size)

    def chunk(i: int) -> list[bytes] | int:
        start, stop = spans[i]
        xs = x[start:stop]
        rs = None if residual is None else residual[start:stop]
        if codec == Codec.FP32:
            with np.errstate(over="ignore", invalid="ignore"):  # x ± r may overflow: refused below
                y = xs if rs is None else (xs - rs if publish else xs + rs)
            bad = np.flatnonzero(~np.isfinite(y))
            if bad.size:
                return start + int(bad[0])
            if r_out is not None and publish:
                np.add(r_out[start:stop], y, out=r_out[start:stop])
            elif r_out is not None:
                r_out[start:stop] = 0.0  # lossless: nothing is left over
            return [_compressor(level).compress(y.astype("<f4", copy=False).data)]
        body = _scratch(body_bytes(codec, stop - start))
        bad_at: int = _kernels.encode(
            _KERNEL_FORMAT[codec],
            xs,
            rs,
            None if r_out is None else r_out[start:stop],
            body,
            publish,
        )
        if bad_at >= 0:
            return start + bad_at
        return _compress_4bit(codec, body, stop - start, level)

    chunks = parallel(chunk, len(spans))
    for c in chunks:
        if isinstance(c, int):
            with np.errstate(over="ignore", invalid="ignore"):
                if residual is None:
                    value = x[c]
                else:
                    value = x[c] - residual[c] if publish else x[c] + residual[c]
            raise CodecError(f"cannot encode non-finite value {value} at index {c}")
    return _assemble(codec, x.size, chunks)


def encode_publish(x: np.ndarray, published: np.ndarray, codec: Codec = DEFAULT_CODEC) -> bytes:
    """The frame of x − published, with `published` advanced by it in place.

    One pass instead of three (subtract, encode, `decode_into`): a shard's close encodes
    its new params against the published copy learners hold and moves that copy on by
    what the frame carries. published ends as `decode_into(frame, published, 1.0)` would
    leave it, bit for bit, which is what every learner rebuilding from the frame holds.

    Raises:
      CodecError: a non-finite difference. `published` may then be partly advanced.

    Example:
      >>> held = np.zeros(4, np.float32)
      >>> frame = encode_publish(np.array([7, 0, -7, 3.5], np.float32), held)
      >>> held.tolist(), decode(frame).tolist()
      ([7.0, 0.0, -7.0, 4.0], [7.0, 0.0, -7.0, 4.0])
    """
    flat = _as_f32(x, "x")
    _check_out(published, flat.size)  # as decode_into checks its out
    if published.ndim != 1:
        raise CodecError(f"published {published.shape}: want a flat vector ({flat.size},)")
    return _encode(flat, published, codec, None, r_out=published, publish=True)


def encode(x: np.ndarray, codec: Codec = DEFAULT_CODEC, *, level: int | None = None) -> bytes:
    """Encodes float32 values into one frame.

    Args:
      x: float32 array of any shape (encoded flat, C order).
      codec: the format; INT4 by default.
      level: a zstd level instead of the tuned fast settings.

    Returns:
      The frame bytes.

    Example:
      >>> frame = encode(np.full(100, 7.0, np.float32))  # absmax 7: scale 1, exact
      >>> float(decode(frame).sum())
      700.0
    """
    return _encode(_as_f32(x, "x"), None, codec, level)


class ErrorFeedback:
    """The sender's error-feedback residual for one stream of vectors.

    Each call encodes x + residual and keeps what the frame failed to carry, so the
    running sum of decoded frames tracks the running sum of inputs to within one
    frame's quantisation error instead of drifting.

    Example:
      >>> ef = ErrorFeedback(4)
      >>> frame = ef.encode(np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    """

    def __init__(self, size: int, codec: Codec = DEFAULT_CODEC, *, level: int | None = None):
        self.codec = _codec(codec)
        self.level = level
        self.residual = np.zeros(size, np.float32)
        self._spare = np.empty(size, np.float32)  # the next residual is written here, then swapped

    def encode(self, x: np.ndarray) -> bytes:
        """Encodes x plus the residual; on error the residual is left as it was."""
        flat = _as_f32(x, "x")
        if flat.size != self.residual.size:
            raise CodecError(
                f"x holds {flat.size} values; this stream carries {self.residual.size}"
            )
        frame = _encode(flat, self.residual, self.codec, self.level, r_out=self._spare)
        # only now: a failed encode leaves the stream as it was
        self.residual, self._spare = self._spare, self.residual
        return frame

    def reset(self) -> None:
        """Drops the residual (e.g. after a resync made it meaningless)."""
        self.residual[...] = 0.0


# ---- read ----


def frame_info(frame: bytes | memoryview) -> FrameInfo:
    """Parses and checks a frame's header."""
    if len(frame) < HEADER_BYTES:
        raise CodecError(
            f"frame of {len(frame)} bytes is shorter than its {HEADER_BYTES}-byte header"
        )
    magic, codec_id, version, block, n = _HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise CodecError(f"not an atoll frame (magic {magic!r})")
    if version not in READ_VERSIONS:
        raise CodecError(
            f"frame version {version} is not supported (this build reads {READ_VERSIONS})"
        )
    try:
        codec = Codec(codec_id)
    except ValueError:
        raise CodecError(f"unknown codec id {codec_id}") from None
    expected_block = 1 if codec == Codec.FP32 else BLOCK
    if block != expected_block:
        raise CodecError(f"{codec.name} frame with block {block}; expected {expected_block}")
    return FrameInfo(codec, n, block)


@dataclasses.dataclass(frozen=True)
class _Chunk:
    start: int  # index of its first value in the frame
    count: int
    scales: memoryview  # empty for FP32
    codes: memoryview  # 4-bit codes, or FP32 values


def _split_body(codec: Codec, start: int, count: int, body: bytes | np.ndarray) -> _Chunk:
    """A chunk over one chunk body: scales then codes (4-bit) or float32 values."""
    mv = memoryview(body).cast("B")  # type: ignore[arg-type]  # numpy types no buffer before 3.12
    if codec == Codec.FP32:
        return _Chunk(start, count, mv[:0], mv)
    nb = -(-count // BLOCK)
    return _Chunk(start, count, mv[: nb * _SCALE_BYTES[codec]], mv[nb * _SCALE_BYTES[codec] :])


def _check_chunk(codec: Codec, c: _Chunk) -> None:
    """Raises CodecError for a chunk with a bad scale or padding, or a non-finite value."""
    bad = _kernels.check(_KERNEL_FORMAT[codec], c.scales, c.codes, c.count)
    if bad < 0:
        return
    if codec == Codec.FP32:
        raise CodecError(f"non-finite FP32 value at index {c.start + bad}")
    raise CodecError(
        f"{codec.name} frame has an invalid scale (out of range) or nonzero "
        f"padding in block {c.start // BLOCK + bad}"
    )


def _v1_chunks(codec: Codec, n: int, body: bytes) -> list[_Chunk]:
    """A version 1 body cut on the version 2 chunk grid (views, no copies)."""
    mv = memoryview(body)
    if codec == Codec.FP32:
        return [_Chunk(a, b - a, mv[:0], mv[4 * a : 4 * b]) for a, b in _chunk_spans(n)]
    nb, sb = -(-n // BLOCK), _SCALE_BYTES[codec]
    out = []
    for a, b in _chunk_spans(n):
        b0, b1 = a // BLOCK, -(-b // BLOCK)
        out.append(
            _Chunk(
                a,
                b - a,
                mv[b0 * sb : b1 * sb],
                mv[nb * sb + b0 * (BLOCK // 2) : nb * sb + b1 * (BLOCK // 2)],
            )
        )
    return out


class _Pieces:
    """A frame as the pieces it arrived in (a stream's chunks), read as one byte string:
    a span inside one piece is a view of it; only a span across pieces is copied."""

    def __init__(self, frame: Frame | Sequence[Frame]):
        if isinstance(frame, (bytes, bytearray, memoryview)):
            frame = [frame]
        self._views = [memoryview(p).cast("B") for p in frame if len(p)]
        self._starts = list(itertools.accumulate(map(len, self._views), initial=0))
        self.size = self._starts[-1]

    def span(self, a: int, b: int) -> memoryview:
        """Bytes [a, b) of the frame (0 <= a <= b <= size)."""
        if a >= b:
            return memoryview(b"")
        i = bisect.bisect_right(self._starts, a) - 1
        if b <= self._starts[i + 1]:
            return self._views[i][a - self._starts[i] : b - self._starts[i]]
        out, at = bytearray(b - a), 0
        while at < b - a:
            view = self._views[i][a + at - self._starts[i] : b - self._starts[i]]
            out[at : at + len(view)] = view
            at, i = at + len(view), i + 1
        return memoryview(out)


def _payloads(frame: _Pieces, info: FrameInfo, version: int) -> list[tuple[int, int, memoryview]]:
    """(start, count, compressed bytes) of every chunk, from the header and table alone."""
    n, size = info.num_values, frame.size
    if version == 1:
        return [(0, n, frame.span(HEADER_BYTES, size))]
    k = _num_chunks(n)
    table_end = HEADER_BYTES + 4 * (k - 1)
    if size <= table_end:  # also refuses an absurd count before allocating for it
        raise CodecError(
            f"truncated frame: {n} values need a table of {k - 1} chunk lengths and "
            f"{k} chunks; the frame ends after {size} bytes"
        )
    spans = _chunk_spans(n)
    sizes = list(struct.unpack(f"<{k - 1}I", frame.span(HEADER_BYTES, table_end)))
    last = size - table_end - sum(sizes)
    if last <= 0 or 0 in sizes:
        raise CodecError(
            f"truncated frame: chunk lengths {sizes[:8]}{'...' if k > 9 else ''} leave "
            f"{last} bytes for the last chunk"
        )
    bounds = list(itertools.accumulate(sizes + [last], initial=table_end))  # k + 1 offsets
    return [(a, b - a, frame.span(bounds[i], bounds[i + 1])) for i, (a, b) in enumerate(spans)]


class Codes:
    """A frame's values as checked codes and scales, decompressed chunk by chunk.

    What the merge reads instead of a float32 copy: about 0.56 bytes per INT4 value.
    Make one with `read_codes(frame)` (every part of the frame checked) or
    `Codes.of_values(vector)` (float32 values, checked finite, not copied).

    Example:
      >>> codes = read_codes(encode(np.array([3, 4, 0, 0], np.float32), Codec.FP32))
      >>> codes.range_sq_norms([0, 2], [2, 4]).tolist()
      [25.0, 0.0]
    """

    def __init__(self, info: FrameInfo, chunks: Sequence[_Chunk]):
        self.info = info
        self._chunks = tuple(chunks)
        self._format = _KERNEL_FORMAT[info.codec]
        # the newest range_sq_norms and max |value| bounds (exact=False) of the same ranges:
        # a shard checks a push's norms, then merges it with them (and the bounds). FP32
        # keeps no bounds: they would cost a scan of every value, not a read of the scales
        self._sq_norms: tuple[bytes, bytes, np.ndarray, np.ndarray | None] | None = None

    @property
    def num_values(self) -> int:
        return self.info.num_values

    @classmethod
    def of_values(cls, values: np.ndarray, *, finite: bool = False) -> Codes:
        """The float32 vector `values` (not copied: do not change it while this is in use).

        Checked finite (CodecError otherwise), unless the caller vouches that it is
        (`finite=True`: a sum the merge kernels already refused to overflow), which
        saves a pass over the values."""
        flat = _as_f32(values, "values")
        info = FrameInfo(Codec.FP32, flat.size, 1)
        chunks = [_split_body(Codec.FP32, a, b - a, flat[a:b]) for a, b in _chunk_spans(flat.size)]
        codes = cls(info, chunks)
        if not finite:
            codes._check()
        return codes

    def _check(self) -> None:
        parallel(lambda i: _check_chunk(self.info.codec, self._chunks[i]), len(self._chunks))

    def _ranges(
        self, offsets: npt.ArrayLike, ends: npt.ArrayLike
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
        """Checked int64 ranges and, per chunk, the slice [r0, r1) of ranges that meet it."""
        o = np.ascontiguousarray(offsets, np.int64).reshape(-1)
        e = np.ascontiguousarray(ends, np.int64).reshape(-1)
        if np.ndim(offsets) != 1 or o.shape != e.shape:
            raise CodecError(
                f"offsets {np.shape(offsets)} and ends {np.shape(ends)}: want equal 1-D shapes"
            )
        n = self.num_values
        if o.size and (o[0] < 0 or np.any(e < o) or np.any(o[1:] < e[:-1]) or e[-1] > n):
            raise CodecError(f"ranges must be ordered, non-overlapping and within [0, {n})")
        starts = np.array([c.start for c in self._chunks], np.int64)
        stops = starts + np.array([c.count for c in self._chunks], np.int64)
        r0 = np.searchsorted(e, starts, side="right")  # first range ending after the chunk starts
        r1 = np.maximum(
            np.searchsorted(o, stops, side="left"), r0
        )  # first range starting at/after its end
        return o, e, list(zip(r0.tolist(), r1.tolist()))

    def range_sq_norms(self, offsets: npt.ArrayLike, ends: npt.ArrayLike) -> np.ndarray:
        """Σ value² over each range [offsets[r], ends[r]) of the values, as float64.

        Order, fixed by the format and not by threads: per 32-value block (counted from
        value 0) the squares of the range's values in float64 summed by a pairwise tree
        (exact for 4-bit codes); those block sums in block order within each chunk of
        CHUNK_VALUES; those chunk sums in chunk order. Ranges need not align to blocks;
        they must be ordered and not overlap. Every finite frame gives finite sums
        (float64 holds (7 * max scale)^2 many times over).
        """
        o, e, meets = self._ranges(offsets, ends)
        key = (o.tobytes(), e.tobytes())
        cached = self._sq_norms
        if (
            cached is not None and cached[:2] == key
        ):  # the codes never change: neither do their sums
            return cached[2].copy()

        bounds = self.info.codec != Codec.FP32

        def part(i: int) -> tuple[np.ndarray, np.ndarray]:
            c, (r0, r1) = self._chunks[i], meets[i]
            sq, m = np.empty(r1 - r0, np.float64), np.zeros(r1 - r0, np.float64)
            if r1 > r0:  # the bounds come from the scales the pass reads anyway
                _kernels.range_stats(
                    self._format,
                    c.scales,
                    c.codes,
                    c.count,
                    c.start,
                    o[r0:r1],
                    e[r0:r1],
                    sq,
                    m if bounds else None,
                    False,
                )
            return sq, m

        parts = parallel(part, len(self._chunks))
        total, bound = np.zeros(o.size, np.float64), np.zeros(o.size, np.float64)
        for (r0, r1), (sq, m) in zip(meets, parts):  # chunk order: the same sums on any threads
            total[r0:r1] += sq
            np.maximum(bound[r0:r1], m, out=bound[r0:r1])
        if not np.all(np.isfinite(total)):  # cannot happen for checked codes; refuse all the same
            raise CodecError("a range's sum of squares is not finite")
        self._sq_norms = (*key, total.copy(), bound if bounds else None)
        return total

    def accumulate_ranges(
        self,
        out: np.ndarray,
        offsets: npt.ArrayLike,
        ends: npt.ArrayLike,
        scales: npt.ArrayLike,
        *,
        add: bool = True,
    ) -> None:
        """out[i] += float32(scales[r]) * value_i for i in each range r; 0 scales skip.

        Multiply, then add, each rounded to float32 (never fused): bit-identical to
        numpy's `out[a:b] += np.float32(s) * values[a:b]`. Checks first, then writes:
        non-finite scales, or any sum that would not be finite, raise CodecError and
        leave out as it was (out must be finite to begin with).

        add=False: the ranges of out are written as if they held zeros (0 scales write
        zeros), the same bits, without reading (or first zeroing) out: a round's first
        push goes straight into its accumulator.
        """
        _check_out(out, self.num_values)
        o, e, meets = self._ranges(offsets, ends)
        s64 = np.asarray(scales, np.float64).reshape(-1)
        if s64.shape != o.shape:
            raise CodecError(f"{s64.size} scales for {o.size} ranges")
        with np.errstate(over="ignore", invalid="ignore"):
            w = s64.astype(np.float32)
        if not np.all(np.isfinite(w)):
            bad = int(np.argmin(np.isfinite(w)))
            raise CodecError(f"scale {s64[bad]!r} of range {bad} is not finite in float32")
        flat = out.reshape(-1)
        cached = self._sq_norms
        if (
            cached is not None
            and cached[3] is not None
            and cached[:2] == (o.tobytes(), e.tobytes())
        ):
            peaks = cached[3]  # taken with the norms, in the same pass
        else:
            peaks = self._max_abs(o, e, meets, exact=False)
        bound = peaks * np.abs(w.astype(np.float64))
        risky = bound >= _SAFE_PRODUCT
        if np.any(risky):  # only near float32's limits: try each sum before writing any
            w_risky = np.where(risky, w, np.float32(0))

            def check(i: int) -> int:
                c, (r0, r1) = self._chunks[i], meets[i]
                return (
                    _kernels.accumulate(
                        self._format,
                        c.scales,
                        c.codes,
                        c.count,
                        c.start,
                        o[r0:r1],
                        e[r0:r1],
                        w_risky[r0:r1],
                        flat,
                        True,
                        add,
                    )
                    if r1 > r0
                    else -1
                )

            for bad in parallel(check, len(self._chunks)):
                if bad >= 0:
                    r = int(np.searchsorted(e, bad, side="right"))
                    raise CodecError(
                        f"adding range {r} (scale {float(w[r])!r}) would overflow float32 "
                        f"at index {bad}"
                    )

        def run(i: int) -> None:
            c, (r0, r1) = self._chunks[i], meets[i]
            if r1 > r0:
                _kernels.accumulate(
                    self._format,
                    c.scales,
                    c.codes,
                    c.count,
                    c.start,
                    o[r0:r1],
                    e[r0:r1],
                    w[r0:r1],
                    flat,
                    False,
                    add,
                )

        parallel(run, len(self._chunks))

    def range_max_abs(self, offsets: npt.ArrayLike, ends: npt.ArrayLike) -> np.ndarray:
        """max |value| over each range [offsets[r], ends[r]) (0 for an empty one), float64.

        Example:
          >>> codes = read_codes(encode(np.array([-3, 1, 2], np.float32), Codec.FP32))
          >>> codes.range_max_abs([0, 1], [1, 3]).tolist()
          [3.0, 2.0]
        """
        o, e, meets = self._ranges(offsets, ends)
        return self._max_abs(o, e, meets, exact=True)

    def _max_abs(
        self, o: np.ndarray, e: np.ndarray, meets: list[tuple[int, int]], exact: bool
    ) -> np.ndarray:
        """max |value| per range; exact=False: for 4-bit codes, a bound from the scales alone."""

        def part(i: int) -> np.ndarray:
            c, (r0, r1) = self._chunks[i], meets[i]
            m = np.empty(r1 - r0, np.float64)
            if r1 > r0:
                _kernels.range_stats(
                    self._format,
                    c.scales,
                    c.codes,
                    c.count,
                    c.start,
                    o[r0:r1],
                    e[r0:r1],
                    None,
                    m,
                    exact,
                )
            return m

        out = np.zeros(o.size, np.float64)
        for (r0, r1), m in zip(meets, parallel(part, len(self._chunks))):
            np.maximum(out[r0:r1], m, out=out[r0:r1])
        return out

    def decode_into(self, out: np.ndarray, weight: float = 1.0, *, accumulate: bool = True) -> None:
        """out += weight * values (or out = weight * values); no overflow check, as `decode_into`."""
        _check_out(out, self.num_values)
        with np.errstate(over="ignore"):
            if not np.isfinite(np.float32(weight)):
                raise CodecError(f"weight must be finite in float32, got {weight}")
        flat = out.reshape(-1)

        def run(i: int) -> None:
            c = self._chunks[i]
            _kernels.decode(
                self._format,
                c.scales,
                c.codes,
                flat[c.start : c.start + c.count],
                float(weight),
                accumulate,
            )

        parallel(run, len(self._chunks))


def _check_out(out: object, n: int) -> None:
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != np.float32
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise CodecError("out must be a writeable C-contiguous float32 numpy array")
    if out.size != n:
        raise CodecError(f"frame holds {n} values; out holds {out.size}")


def read_codes(
    frame: Frame | Sequence[Frame], *, codec: Codec | None = None, num_values: int | None = None
) -> Codes:
    """Decompresses and checks every part of a frame: the merge's input, with no float32 copy.

    Args:
      frame: bytes of one frame (any readable version), or the pieces it arrived in, in
        order (a push stream's chunks: read in place, no joined copy of the frame).
      codec: when given, the frame must use this codec.
      num_values: when given, the frame must hold exactly this many values.

    Returns:
      The frame's Codes: `range_sq_norms` and `accumulate_ranges` read them.

    Raises:
      CodecError: for any malformed part, before anything is allocated for the values.
    """
    pieces = _Pieces(frame)
    head = pieces.span(0, min(HEADER_BYTES, pieces.size))
    info = frame_info(head)
    if num_values is not None and info.num_values != num_values:
        raise CodecError(f"frame holds {info.num_values} values; expected {num_values}")
    if codec is not None and info.codec != _codec(codec):
        raise CodecError(f"frame uses {info.codec.name}; expected {_codec(codec).name}")
    version = _HEADER.unpack_from(head)[2]
    payloads = _payloads(pieces, info, version)
    many = len(payloads) > 1

    def inflate(i: int) -> bytes:
        start, count, payload = payloads[i]
        what = f"chunk {i} (values {start}..{start + count})" if many else "frame body"
        return _inflate(payload, info.codec, count, what)

    if version == 1:
        codes = Codes(info, _v1_chunks(info.codec, info.num_values, inflate(0)))
        codes._check()
        return codes

    def inflate_and_check(i: int) -> _Chunk:  # each chunk checked while its body is in cache
        start, count, _ = payloads[i]
        chunk = _split_body(info.codec, start, count, inflate(i))
        _check_chunk(info.codec, chunk)
        return chunk

    return Codes(info, parallel(inflate_and_check, len(payloads)))


def _as_codes(
    frame: Frame | Codes, codec: Codec | None = None, num_values: int | None = None
) -> Codes:
    if isinstance(frame, Codes):
        if codec is not None and frame.info.codec != _codec(codec):
            raise CodecError(f"frame uses {frame.info.codec.name}; expected {_codec(codec).name}")
        if num_values is not None and frame.num_values != num_values:
            raise CodecError(f"frame holds {frame.num_values} values; expected {num_values}")
        return frame
    return read_codes(frame, codec=codec, num_values=num_values)


def range_sq_norms(frame: Frame | Codes, offsets: npt.ArrayLike, ends: npt.ArrayLike) -> np.ndarray:
    """Σ value² per range [offsets[r], ends[r]) of a frame's values, float64 (see Codes.range_sq_norms).

    Example:
      >>> range_sq_norms(encode(np.array([3, 4, 1], np.float32), Codec.FP32), [0, 2], [2, 3]).tolist()
      [25.0, 1.0]
    """
    return _as_codes(frame).range_sq_norms(offsets, ends)


def accumulate_ranges(
    frame: Frame | Codes,
    out: np.ndarray,
    offsets: npt.ArrayLike,
    ends: npt.ArrayLike,
    scales: npt.ArrayLike,
) -> None:
    """out[i] += float32(scales[r]) * value_i over each range r of a frame's values.

    The frame is checked whole, and so is every sum, before out is touched (see
    Codes.accumulate_ranges); frame may be bytes or Codes from `read_codes`.

    Example:
      >>> out = np.ones(3, np.float32)
      >>> accumulate_ranges(encode(np.array([3, 4, 1], np.float32), Codec.FP32), out, [0, 2], [2, 3], [0.5, 2.0])
      >>> out.tolist()
      [2.5, 3.0, 3.0]
    """
    _as_codes(frame).accumulate_ranges(out, offsets, ends, scales)


def decode_into(
    frame: Frame | Codes,
    out: np.ndarray,
    weight: float = 1.0,
    *,
    accumulate: bool = True,
    codec: Codec | None = None,
) -> FrameInfo:
    """Adds weight * decoded frame into out (or overwrites when accumulate=False).

    No temporary of the decoded size is made for 4-bit codecs. Every check runs before
    out is touched, so a bad frame changes nothing.

    Args:
      frame: bytes of one frame (or Codes from `read_codes`).
      out: a C-contiguous float32 array with exactly the frame's number of values.
      weight: multiplier applied to each decoded value.
      accumulate: add into out (True) or overwrite it (False).
      codec: when given, the frame must use this codec.

    Returns:
      The frame's FrameInfo.
    """
    if isinstance(frame, Codes):
        codes = _as_codes(frame, codec)
    else:
        info = frame_info(frame)
        if codec is not None and info.codec != _codec(codec):
            raise CodecError(f"frame uses {info.codec.name}; expected {_codec(codec).name}")
        _check_out(out, info.num_values)  # before decompressing: a wrong buffer costs nothing
        codes = read_codes(frame)
    codes.decode_into(out, weight, accumulate=accumulate)
    return codes.info


def decode(
    frame: Frame | Codes, *, codec: Codec | None = None, num_values: int | None = None
) -> np.ndarray:
    """Decodes a frame into a new flat float32 array.

    When num_values is given, a frame of any other length is refused.
    """
    codes = _as_codes(
        frame, codec, num_values
    )  # before allocating: the header's count is not yet trusted
    out = np.empty(codes.num_values, np.float32)
    codes.decode_into(out, 1.0, accumulate=False)
    return out


def _block_rows(codes: Codes) -> tuple[np.ndarray, np.ndarray]:
    """(scales, packed codes) of every block of 4-bit Codes, one row per block."""
    # every chunk but the last holds whole blocks: the chunks' scales and codes laid back
    # to back are the frame's, block by block
    sb = _SCALE_BYTES[codes.info.codec]
    scales = np.concatenate([np.frombuffer(c.scales, np.uint8) for c in codes._chunks])
    packed = np.concatenate([np.frombuffer(c.codes, np.uint8) for c in codes._chunks])
    return scales.reshape(-1, sb), packed.reshape(-1, BLOCK // 2)


def _check_blocks(b: np.ndarray, total: int) -> None:
    if b.size == 0 or b[0] < 0 or b[-1] >= total or np.any(np.diff(b) <= 0):
        raise CodecError(f"blocks must be increasing and within the frame's {total} blocks")


def gather_blocks(frame: Frame | Codes, blocks: npt.ArrayLike) -> bytes:
    """A frame of some of `frame`'s blocks, whole, each with its own scale: every value
    it holds decodes to the very bits it decodes to in `frame` (no re-quantising).

    A block is `frame_info(frame).block` values (32 for 4-bit codecs, one for FP32),
    counted from value 0; the new frame holds the given blocks one after another.

    Args:
      frame: the frame (bytes, or Codes from `read_codes`).
      blocks: block indices, increasing, within the frame.

    Example:
      >>> x = np.arange(96, dtype=np.float32)
      >>> decode(gather_blocks(encode(x), [0, 2])).tolist() == decode(encode(x))[
      ...     np.r_[0:32, 64:96]].tolist()
      True
    """
    codes = _as_codes(frame)
    info, n = codes.info, codes.num_values
    b = np.asarray(blocks, np.int64).reshape(-1)
    total = -(-n // info.block)
    _check_blocks(b, total)
    if info.codec == Codec.FP32:
        values = np.concatenate([np.frombuffer(c.codes, "<f4") for c in codes._chunks])
        return encode(values[b].astype(np.float32), Codec.FP32)
    scales, packed = _block_rows(codes)
    sub_scales, sub_codes = scales[b], packed[b]
    m = b.size * BLOCK - (total * BLOCK - n if b[-1] == total - 1 else 0)
    spans = _chunk_spans(m)

    def chunk(i: int) -> list[bytes]:
        start, stop = spans[i]
        k0, k1 = start // BLOCK, -(-stop // BLOCK)
        body = np.concatenate([sub_scales[k0:k1].reshape(-1), sub_codes[k0:k1].reshape(-1)])
        return _compress_4bit(info.codec, body, stop - start, None)

    return _assemble(info.codec, m, parallel(chunk, len(spans)))


# A 4-bit frame's values picked out of some of its blocks (`gather_codes`): magic, codec,
# blocks, values kept; then one zstd frame of the blocks' scales and the kept codes.
GATHERED_MAGIC = b"ATLG"
_GATHERED = struct.Struct("<4sBQQ")


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Packed blocks (rows of 16 bytes) as one code per value, in value order: byte j of
    a block holds value j in its low nibble and value j + 16 in its high one."""
    return np.concatenate([packed & 15, packed >> 4], axis=1)


def gather_codes(frame: Frame | Codes, blocks: npt.ArrayLike, wanted: np.ndarray) -> bytes:
    """Some values of a 4-bit frame, each kept with its own code and its block's scale:
    `read_gathered` turns them back into Codes that decode them to the very bits they
    decode to in `frame`, the other values of those blocks to 0.

    What a shard sends a process that pulls only some elements of a fragment's delta: a
    block only partly wanted costs its scale and its wanted codes (wire/parts.py
    `BoxLayout` names the blocks and the values).

    Args:
      frame: a 4-bit frame (bytes, or Codes from `read_codes`).
      blocks: block indices, increasing, within the frame.
      wanted: bool, one per value of `blocks` laid back to back (32 each): the values kept.
    """
    codes = _as_codes(frame)
    info = codes.info
    if info.codec == Codec.FP32:
        raise CodecError("gather_codes takes a 4-bit frame; FP32 frames gather whole values")
    b = np.asarray(blocks, np.int64).reshape(-1)
    _check_blocks(b, -(-info.num_values // BLOCK))
    if wanted.dtype != np.bool_ or wanted.size != b.size * BLOCK:
        raise CodecError(f"wanted: {b.size * BLOCK} bools, one per value of the blocks")
    scales, packed = _block_rows(codes)
    kept = _nibbles(packed[b]).reshape(-1)[wanted.reshape(-1)]
    if kept.size % 2:
        kept = np.append(kept, np.uint8(0))
    body = np.concatenate([scales[b].reshape(-1), kept[0::2] | (kept[1::2] << 4)])
    head = _GATHERED.pack(GATHERED_MAGIC, int(info.codec), b.size, int(np.count_nonzero(wanted)))
    return b"".join([head, *_compress_4bit(info.codec, body, b.size * BLOCK, None)])


def read_gathered(payload: Frame, num_values: int, wanted: np.ndarray) -> Codes:
    """The Codes of a `gather_codes` payload: `num_values` values (its blocks back to back,
    the fragment's last block possibly short), those not `wanted` decoding to 0.

    Raises:
      CodecError: a payload that does not hold what `wanted` names, or a malformed one.
    """
    mv = memoryview(payload).cast("B")
    if len(mv) < _GATHERED.size:
        raise CodecError(f"a gathered frame of {len(mv)} bytes has no header")
    magic, codec_id, nb, count = _GATHERED.unpack_from(mv)
    codec = _codec(codec_id)
    if magic != GATHERED_MAGIC or codec == Codec.FP32:
        raise CodecError(f"not a gathered 4-bit frame (magic {magic!r}, codec {codec.name})")
    if wanted.size != nb * BLOCK or count != int(np.count_nonzero(wanted)):
        raise CodecError(
            f"gathered frame of {nb} blocks and {count} values; expected {wanted.size // BLOCK} "
            f"blocks and {int(np.count_nonzero(wanted))} values"
        )
    if not (nb - 1) * BLOCK < num_values <= nb * BLOCK:
        raise CodecError(f"{num_values} values do not fill {nb} blocks")
    sb = _SCALE_BYTES[codec]
    expected = nb * sb + (count + 1) // 2
    try:
        body = _decompressor().decompress(mv[_GATHERED.size :], max_output_size=expected)
    except zstandard.ZstdError as e:
        raise CodecError(f"corrupt gathered frame: {e}") from None
    if len(body) != expected:
        raise CodecError(f"gathered frame holds {len(body)} bytes; expected {expected}")
    raw = np.frombuffer(body, np.uint8)
    scales = raw[: nb * sb].reshape(nb, sb)
    kept = np.empty(2 * (expected - nb * sb), np.uint8)
    kept[0::2], kept[1::2] = raw[nb * sb :] & 15, raw[nb * sb :] >> 4
    values = np.zeros(nb * BLOCK, np.uint8)
    values[wanted.reshape(-1)] = kept[:count]
    v = values.reshape(nb, BLOCK)
    packed = v[:, : BLOCK // 2] | (v[:, BLOCK // 2 :] << 4)
    info = FrameInfo(codec, num_values, BLOCK)
    chunks = []
    for start, stop in _chunk_spans(num_values):
        k0, k1 = start // BLOCK, -(-stop // BLOCK)
        body_k = np.concatenate([scales[k0:k1].reshape(-1), packed[k0:k1].reshape(-1)])
        chunks.append(_split_body(codec, start, stop - start, body_k))
    out = Codes(info, chunks)
    out._check()
    return out
