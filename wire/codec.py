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

import itertools
import struct
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import zstandard

from atoll.wire import _kernels
from atoll.wire.codec_threads import THREADS_ENV, get_threads, parallel, set_threads
from atoll.wire.codes import (
    Codes,
    _as_codes,
    _check_out,
    accumulate_ranges,
    range_sq_norms,
    read_codes,
)
from atoll.wire.frames import (
    _HEADER,
    _KERNEL_FORMAT,
    _SCALE_BYTES,
    BLOCK,
    CHUNK_VALUES,
    DEFAULT_CODEC,
    FRAME_VERSION,
    HEADER_BYTES,
    MAGIC,
    READ_VERSIONS,
    Codec,
    CodecError,
    Frame,
    FrameInfo,
    _as_f32,
    _Chunk,
    _chunk_spans,
    _codec,
    _compressor,
    _decompressor,
    _scratch,
    _split_body,
    body_bytes,
    frame_info,
    max_frame_bytes,
)

__all__ = [
    "BLOCK",
    "CHUNK_VALUES",
    "DEFAULT_CODEC",
    "FRAME_VERSION",
    "GATHERED_MAGIC",
    "HEADER_BYTES",
    "MAGIC",
    "READ_VERSIONS",
    "THREADS_ENV",
    "Codec",
    "CodecError",
    "Codes",
    "ErrorFeedback",
    "Frame",
    "FrameInfo",
    "accumulate_ranges",
    "body_bytes",
    "decode",
    "decode_into",
    "encode",
    "encode_publish",
    "frame_info",
    "gather_blocks",
    "gather_codes",
    "get_threads",
    "max_frame_bytes",
    "parallel",
    "range_sq_norms",
    "read_codes",
    "read_gathered",
    "set_threads",
]

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
        with _scratch(body_bytes(codec, stop - start)) as body:
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

    def encode_written(self, write: Callable[[np.ndarray], object]) -> bytes:
        """`encode(x)`, bit for bit, for the x that `write(out)` writes into `out` (float32,
        this stream's size): `out` is the vector the next residual then goes to, so no
        vector of the stream's size is made beside the two this stream keeps. On error
        the residual is left as it was."""
        write(self._spare)
        # x and the new residual share one vector: the kernel reads each block of x
        # before it writes that block's residual
        frame = _encode(self._spare, self.residual, self.codec, self.level, r_out=self._spare)
        self.residual, self._spare = self._spare, self.residual
        return frame

    def reset(self) -> None:
        """Drops the residual (e.g. after a resync made it meaningless)."""
        self.residual[...] = 0.0


# ---- decode ----


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


def read_gathered(payload: Frame, num_values: int, wanted: np.ndarray | None = None) -> Codes:
    """The Codes of a `gather_codes` payload: `num_values` values (its blocks back to back,
    the fragment's last block possibly short), those not `wanted` decoding to 0. `wanted`
    None: every value of the blocks (the first `num_values`), read straight into the
    Codes' one buffer with no array of the values' size beside it.

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
    want_blocks = -(-num_values // BLOCK) if wanted is None else wanted.size // BLOCK
    want = num_values if wanted is None else int(np.count_nonzero(wanted))
    if nb != want_blocks or count != want or (wanted is not None and wanted.size != nb * BLOCK):
        raise CodecError(
            f"gathered frame of {nb} blocks and {count} values; expected {want_blocks} "
            f"blocks and {want} values"
        )
    if not (nb - 1) * BLOCK < num_values <= nb * BLOCK:
        raise CodecError(f"{num_values} values do not fill {nb} blocks")
    if wanted is None:
        return _read_every_value(mv[_GATHERED.size :], codec, nb, num_values)
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


_REPACK_ROWS = 512  # blocks repacked at a time: 8 KiB of scratch


def _read_every_value(body: memoryview, codec: Codec, nb: int, n: int) -> Codes:
    """`read_gathered` of a payload that keeps every value of its `nb` blocks (`n` of
    them): the zstd body is decompressed into one buffer laid out as the Codes read it
    (every scale, then every block's 16 code bytes), and each block's codes, two values
    to a byte in value order, are repacked in place to the frame's order (byte j: value
    j low, value j + 16 high). The same Codes, bit for bit, as the general path."""
    sb, half = _SCALE_BYTES[codec], BLOCK // 2
    expected = nb * sb + (n + 1) // 2
    buf = np.zeros(nb * (sb + half), np.uint8)  # the tail past `expected` stays 0 (padding)
    got, extra = 0, b""
    try:
        params = zstandard.get_frame_parameters(body)
        if params.content_size != expected or _zstd_frame_bytes(body) != len(body):
            raise CodecError(f"gathered frame is not one whole zstd frame of {expected} bytes")
        reader = _decompressor().stream_reader(body)  # straight into buf: no bytes between
        view = buf.data[:expected]
        while got < expected and (k := reader.readinto(view[got:])):
            got += k
        extra = reader.read(1)  # the frame's end: its checksum is checked here
    except zstandard.ZstdError as e:
        raise CodecError(f"corrupt gathered frame: {e}") from None
    if got != expected or extra:
        raise CodecError(f"gathered frame holds {got + len(extra)}+ bytes; expected {expected}")
    codes = buf[nb * sb :].reshape(nb, half)
    if n % 2:  # the pad nibble after the last value decodes to nothing: 0, as kept[:count]
        codes.reshape(-1)[n // 2] &= 15
    for r0 in range(0, nb, _REPACK_ROWS):
        g = codes[r0 : r0 + _REPACK_ROWS].copy()  # byte i: value 2i low, 2i + 1 high
        lo, hi = g[:, : half // 2], g[:, half // 2 :]  # values 0..15, 16..31
        out = codes[r0 : r0 + _REPACK_ROWS].reshape(-1, half // 2, 2)
        np.bitwise_or(lo & 15, (hi & 15) << 4, out=out[:, :, 0])  # values 2i, 16 + 2i
        np.bitwise_or(lo >> 4, hi & 0xF0, out=out[:, :, 1])  # values 2i + 1, 17 + 2i
    scales, packed = buf.data[: nb * sb], buf.data[nb * sb :]
    chunks = []
    for start, stop in _chunk_spans(n):
        k0, k1 = start // BLOCK, -(-stop // BLOCK)
        chunks.append(
            _Chunk(start, stop - start, scales[k0 * sb : k1 * sb], packed[k0 * half : k1 * half])
        )
    out_codes = Codes(FrameInfo(codec, n, BLOCK), chunks)
    out_codes._check()
    return out_codes


def _zstd_frame_bytes(frame: memoryview) -> int:
    """The length of the zstd frame `frame` starts with, from its header and its blocks'
    headers (RFC 8878 3.1.1): a frame cut short measures longer than what holds it."""
    at = zstandard.frame_header_size(frame)
    while at + 3 <= len(frame):
        head = int.from_bytes(frame[at : at + 3], "little")
        at += 3 + (1 if (head >> 1) & 3 == 1 else head >> 3)  # an RLE block holds one byte
        if head & 1:  # the last block
            return at + (4 if zstandard.get_frame_parameters(frame).has_checksum else 0)
    return len(frame) + 1
