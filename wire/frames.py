"""The frame format of wire/codec.py: header, chunk grid, codec ids, zstd, and the
reading of a frame's chunks before anything is decoded (see wire/codec.py for the
format and its compatibility rules)."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import enum
import itertools
import struct
import threading
from collections.abc import Iterator, Sequence
from typing import TypeAlias

import numpy as np
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


# ---- zstd ----

_local = threading.local()  # per thread: zstd contexts


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


_spare_bodies: list[np.ndarray] = []  # chunk body buffers not lent out, any thread's
_spare_lock = threading.Lock()


@contextlib.contextmanager
def _scratch(size: int) -> Iterator[np.ndarray]:
    """A reusable byte buffer for a chunk body, lent for the `with` block: as many are
    kept as were ever lent at once, whichever threads use them (no fresh pages per chunk,
    nor per thread that first encodes)."""
    with _spare_lock:
        buf = _spare_bodies.pop() if _spare_bodies else None
    if buf is None or buf.size < size:
        buf = np.empty(max(size, body_bytes(Codec.INT4, CHUNK_VALUES)), np.uint8)
    try:
        yield buf[:size]
    finally:
        with _spare_lock:
            _spare_bodies.append(buf)


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


# ---- reading a frame's chunks ----


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
