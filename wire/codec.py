"""Blockwise 4-bit codecs for outer gradients and weight deltas, zstd-framed.

A frame is a 16-byte header (magic, codec id, frame version, block size, value
count) followed by one zstd frame holding the body: per-block scales, then 4-bit
codes two to a byte. The hot loops are C kernels (`wire/_kernels.c`); this module
frames, validates and names things.

Formats (measured on Gaussian data, 32-value blocks):
  INT4   symmetric int4 in [-7, 7], bfloat16 scale rounded up from absmax / 7.
         The default: relative error ~0.097, ~3.9 bits/param after zstd.
  MXFP4  OCP MX FP4 (E2M1 values, E8M0 power-of-two scale). Relative error ~0.115.
  FP32   lossless float32, for snapshots and full-precision comparisons.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import threading

import numpy as np
import zstandard

from wire import _kernels

MAGIC = b"ATLQ"
FRAME_VERSION = 1
BLOCK = _kernels.BLOCK
_HEADER = struct.Struct("<4sBBHQ")  # magic, codec, frame version, block, num values
HEADER_BYTES = _HEADER.size
# The zstd settings favour speed: 4-bit codes have no long matches to find, so a
# small match search costs little ratio while Huffman coding of the literals does
# the compressing (measured: 3.64 bits per 4-bit code at ~600 MB/s).
_ZSTD_PARAMS = dict(strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=10, chain_log=6,
                    search_log=1, min_match=7, target_length=0,
                    write_checksum=1, write_content_size=1)


class Codec(enum.IntEnum):
    """Codec ids on the wire; equal to atoll.v1.Codec."""

    FP32 = 1
    MXFP4 = 2
    INT4 = 3


DEFAULT_CODEC = Codec.INT4
_KERNEL_FORMAT = {Codec.INT4: _kernels.INT4, Codec.MXFP4: _kernels.MXFP4}
_SCALE_BYTES = {Codec.INT4: 2, Codec.MXFP4: 1}


class CodecError(ValueError):
    """A frame that cannot be decoded, or input that cannot be encoded."""


@dataclasses.dataclass(frozen=True)
class FrameInfo:
    codec: Codec
    num_values: int
    block: int  # values per scale (1 for FP32)


def _codec(value) -> Codec:
    try:
        return Codec(value)
    except ValueError:
        raise CodecError(f"unknown codec {value!r}; expected one of {[c.name for c in Codec]}") from None


def body_bytes(codec: Codec, num_values: int) -> int:
    """Length of an uncompressed frame body for num_values values."""
    if codec == Codec.FP32:
        return 4 * num_values
    blocks = -(-num_values // BLOCK)
    return blocks * (_SCALE_BYTES[codec] + BLOCK // 2)


def max_frame_bytes(num_values: int, codec: Codec) -> int:
    """The most bytes a frame of num_values values can take: header plus zstd's worst case.

    zstd never grows a body by more than ZSTD_COMPRESSBOUND (a byte per 256, plus a
    little for bodies under 128 KiB) and its frame header and checksum; receivers use
    this to refuse a declared size before buffering a byte of it.

    Example:
      >>> len(encode(np.ones(1000, np.float32))) <= max_frame_bytes(1000, Codec.INT4)
      True
    """
    body = body_bytes(_codec(codec), num_values)
    small = ((128 << 10) - body) >> 11 if body < 128 << 10 else 0
    return HEADER_BYTES + _ZSTD_FRAME_OVERHEAD + body + (body >> 8) + small


_ZSTD_FRAME_OVERHEAD = 32  # frame header (<= 18 bytes) and checksum (4), rounded up


def _as_f32(x: np.ndarray, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise CodecError(f"{what} must be float32, got {x.dtype}")
    return np.ascontiguousarray(x).reshape(-1)


_local = threading.local()


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
                level, write_checksum=1, write_content_size=1)
        cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cache[level]


def _frame(codec: Codec, n: int, body, level: int | None) -> bytes:
    header = _HEADER.pack(MAGIC, int(codec), FRAME_VERSION, 1 if codec == Codec.FP32 else BLOCK, n)
    return header + _compressor(level).compress(body)


def encode(x: np.ndarray, codec: Codec = DEFAULT_CODEC, *, level: int | None = None) -> bytes:
    """Encodes float32 values into one frame.

    Args:
      x: float32 array of any shape (encoded flat, C order).
      codec: the format; INT4 by default.
      level: a zstd level instead of the tuned fast settings.

    Returns:
      The frame bytes.

    Example:
      >>> frame = encode(np.ones(100, np.float32))
      >>> float(decode(frame).sum())
      100.0
    """
    body = _encode_body(_as_f32(x, "x"), None, codec)
    return _frame(codec, int(np.asarray(x).size), body, level)


def _encode_body(x: np.ndarray, residual: np.ndarray | None, codec: Codec,
                 r_out: np.ndarray | None = None):
    """Returns the frame body of x (+ residual); raises CodecError on non-finite input.

    When r_out is given (never `residual` itself) the new residual is written there."""
    codec = _codec(codec)
    if codec == Codec.FP32:
        y = x if residual is None else x + residual
        bad = np.flatnonzero(~np.isfinite(y))
        if bad.size:
            raise CodecError(f"cannot encode non-finite value {y[bad[0]]} at index {bad[0]}")
        if r_out is not None:
            r_out[...] = 0.0  # lossless: nothing is left over
        return y.astype("<f4", copy=False)
    body = np.empty(body_bytes(codec, x.size), np.uint8)
    bad = _kernels.encode(_KERNEL_FORMAT[codec], x, residual, r_out, body)
    if bad >= 0:
        value = x[bad] if residual is None else x[bad] + residual[bad]
        raise CodecError(f"cannot encode non-finite value {value} at index {bad}")
    return body


def frame_info(frame: bytes | memoryview) -> FrameInfo:
    """Parses and checks a frame's header."""
    if len(frame) < HEADER_BYTES:
        raise CodecError(f"frame of {len(frame)} bytes is shorter than its {HEADER_BYTES}-byte header")
    magic, codec_id, version, block, n = _HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise CodecError(f"not an atoll frame (magic {magic!r})")
    if version != FRAME_VERSION:
        raise CodecError(f"frame version {version} is not supported (this build reads {FRAME_VERSION})")
    try:
        codec = Codec(codec_id)
    except ValueError:
        raise CodecError(f"unknown codec id {codec_id}") from None
    expected_block = 1 if codec == Codec.FP32 else BLOCK
    if block != expected_block:
        raise CodecError(f"{codec.name} frame with block {block}; expected {expected_block}")
    return FrameInfo(codec, n, block)


def _body(frame, info: FrameInfo) -> bytes:
    """Decompresses a frame's body, insisting on exactly one complete zstd frame."""
    expected = body_bytes(info.codec, info.num_values)
    payload = memoryview(frame)[HEADER_BYTES:]
    try:
        size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise CodecError(f"corrupt frame body: {e}") from None
    if size != expected:
        raise CodecError(f"frame body declares {size} bytes; {info.num_values} "
                         f"{info.codec.name} values need {expected}")
    dobj = zstandard.ZstdDecompressor().decompressobj()
    try:
        body = dobj.decompress(payload)
    except zstandard.ZstdError as e:
        raise CodecError(f"corrupt frame body: {e}") from None
    if not dobj.eof or len(body) != expected:
        raise CodecError(f"truncated frame: body ends after {len(body)} of {expected} bytes")
    if dobj.unused_data:
        raise CodecError(f"{len(dobj.unused_data)} stray bytes after the frame body")
    return body


def decode_into(frame, out: np.ndarray, weight: float = 1.0, *, accumulate: bool = True,
                codec: Codec | None = None) -> FrameInfo:
    """Adds weight * decoded frame into out (or overwrites when accumulate=False).

    The shard's hot path: no temporary of the decoded size is made for 4-bit codecs.
    Every check runs before out is touched, so a bad frame changes nothing.

    Args:
      frame: bytes of one frame.
      out: a C-contiguous float32 array with exactly the frame's number of values.
      weight: multiplier applied to each decoded value.
      accumulate: add into out (True) or overwrite it (False).
      codec: when given, the frame must use this codec.

    Returns:
      The frame's FrameInfo.
    """
    info = frame_info(frame)
    if codec is not None and info.codec != _codec(codec):
        raise CodecError(f"frame uses {info.codec.name}; expected {_codec(codec).name}")
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or not out.flags.c_contiguous \
            or not out.flags.writeable:
        raise CodecError("out must be a writeable C-contiguous float32 numpy array")
    if out.size != info.num_values:
        raise CodecError(f"frame holds {info.num_values} values; out holds {out.size}")
    with np.errstate(over="ignore"):
        if not np.isfinite(np.float32(weight)):
            raise CodecError(f"weight must be finite in float32, got {weight}")
    _decode_body(_body(frame, info), info, out.reshape(-1), weight, accumulate)
    return info


def _decode_body(body: bytes, info: FrameInfo, flat: np.ndarray, weight: float, accumulate: bool) -> None:
    """Writes or adds weight * values of a decompressed body into flat; checks first."""
    if info.codec == Codec.FP32:
        values = np.frombuffer(body, "<f4")
        if not np.isfinite(values).all():
            raise CodecError("FP32 frame holds non-finite values")
        if weight != 1.0:
            values = values * np.float32(weight)
        if accumulate:
            np.add(flat, values, out=flat)
        else:
            flat[...] = values
        return
    bad = _kernels.decode(_KERNEL_FORMAT[info.codec], body, flat, float(weight), accumulate)
    if bad >= 0:
        raise CodecError(f"{info.codec.name} frame has an invalid scale (out of range) or nonzero padding "
                         f"in block {bad}")


def decode(frame, *, codec: Codec | None = None, num_values: int | None = None) -> np.ndarray:
    """Decodes a frame into a new flat float32 array.

    When num_values is given, a frame of any other length is refused.
    """
    info = frame_info(frame)
    if num_values is not None and info.num_values != num_values:
        raise CodecError(f"frame holds {info.num_values} values; expected {num_values}")
    if codec is not None and info.codec != _codec(codec):
        raise CodecError(f"frame uses {info.codec.name}; expected {_codec(codec).name}")
    body = _body(frame, info)  # before allocating: the header's count is not yet trusted
    out = np.empty(info.num_values, np.float32)
    _decode_body(body, info, out, 1.0, accumulate=False)
    return out


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
            raise CodecError(f"x holds {flat.size} values; this stream carries {self.residual.size}")
        body = _encode_body(flat, self.residual, self.codec, r_out=self._spare)
        frame = _frame(self.codec, flat.size, body, self.level)
        # only now: a failed encode leaves the stream as it was
        self.residual, self._spare = self._spare, self.residual
        return frame

    def reset(self) -> None:
        """Drops the residual (e.g. after a resync made it meaningless)."""
        self.residual[...] = 0.0
