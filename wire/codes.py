"""A frame's values as checked codes and scales (`Codes`, `read_codes`): what the
shard's merge reads instead of a float32 copy, and the sums it takes over them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from atoll.wire import _kernels
from atoll.wire.codec_threads import parallel
from atoll.wire.frames import (
    _HEADER,
    _KERNEL_FORMAT,
    _SAFE_PRODUCT,
    BLOCK,
    HEADER_BYTES,
    Codec,
    CodecError,
    Frame,
    FrameInfo,
    _as_f32,
    _check_chunk,
    _Chunk,
    _chunk_spans,
    _codec,
    _inflate,
    _payloads,
    _Pieces,
    _split_body,
    _v1_chunks,
    frame_info,
)


class Codes:
    """A frame's values as checked codes and scales, decompressed chunk by chunk.

    What the merge reads instead of a float32 copy: about 0.56 bytes per INT4 value.
    Make one with `read_codes(frame)` (every part of the frame checked) or
    `Codes.of_values(vector)` (float32 values, checked finite, not copied).

    Example:
      >>> from atoll.wire.codec import encode
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
        # bounds on max |value| over ranges that the maker of these codes vouched for
        # (`of_values(max_abs=...)`): accumulate_ranges over those ranges needs no scan
        self._vouched: tuple[bytes, bytes, np.ndarray] | None = None
        # per block of the values, a whole block's sum of squares where already known (>= 0)
        self._known: np.ndarray | None = None

    @property
    def num_values(self) -> int:
        return self.info.num_values

    @classmethod
    def of_values(
        cls,
        values: np.ndarray,
        *,
        finite: bool = False,
        max_abs: tuple[npt.ArrayLike, npt.ArrayLike, npt.ArrayLike] | None = None,
        block_sq: np.ndarray | None = None,
    ) -> Codes:
        """The float32 vector `values` (not copied: do not change it while this is in use).

        Checked finite (CodecError otherwise), unless the caller vouches that it is
        (`finite=True`: a sum the merge kernels already refused to overflow, or values
        decoded from checked codes), which saves a pass over the values. `max_abs`:
        (offsets, ends, bounds) the caller vouches for, bounds[r] >= max |value| over
        [offsets[r], ends[r]) (a push assembled from parts knows them from its parts'
        scales): `accumulate_ranges` over those ranges then skips its scan for them.
        `block_sq`: float64, one per 32-value block, each whole block's sum of squares
        where the caller knows it (>= 0; `decode_runs` leaves them), the bits
        `range_sq_norms` would sum from the values, which it then takes instead."""
        flat = _as_f32(values, "values")
        info = FrameInfo(Codec.FP32, flat.size, 1)
        chunks = [_split_body(Codec.FP32, a, b - a, flat[a:b]) for a, b in _chunk_spans(flat.size)]
        codes = cls(info, chunks)
        if not finite:
            codes._check()
        if max_abs is not None:
            o, e, _ = codes._ranges(max_abs[0], max_abs[1])
            bounds = np.array(max_abs[2], np.float64).reshape(-1)
            if bounds.shape != o.shape:
                raise CodecError(f"{bounds.size} bounds for {o.size} ranges")
            codes._vouched = (o.tobytes(), e.tobytes(), bounds)
        if block_sq is not None:
            if block_sq.dtype != np.float64 or block_sq.shape != (-(-flat.size // BLOCK),):
                raise CodecError(f"block_sq {block_sq.dtype}{block_sq.shape}: one float64 a block")
            codes._known = block_sq
        return codes

    def decode_runs(
        self,
        out: np.ndarray,
        src: npt.ArrayLike,
        dst: npt.ArrayLike,
        lengths: npt.ArrayLike,
        known: np.ndarray | None = None,
        *,
        skip_known: bool = False,
    ) -> None:
        """out[dst[r] + i] = value[src[r] + i] for i < lengths[r], for every run r: the
        values written in their places in `out` (float32, C-contiguous), the bits
        `decode_into` writes, with no copy between. Runs ascend by src and do not overlap.

        `known` (float64, one per 32-value block of out): each block of out that one run
        fills whole (within one chunk of these values) gets its sum of squares, taken while
        its values are in registers, wherever the run's values fall against their own blocks
        (`of_values(block_sq=known)` then sums the norms without reading it);
        `skip_known`: such blocks are not written (a caller that reads the values from
        these codes again, not from `out`)."""
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != np.float32
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise CodecError("out must be a writeable C-contiguous float32 numpy array")
        s, d, n = (np.ascontiguousarray(a, np.int64).reshape(-1) for a in (src, dst, lengths))
        if not s.shape == d.shape == n.shape:
            raise CodecError(f"runs: src {s.shape}, dst {d.shape}, lengths {n.shape} differ")
        if s.size and (np.any(n < 0) or np.any(s[1:] < s[:-1] + n[:-1]) or s[0] < 0):
            raise CodecError("runs must ascend by src without overlapping")
        if s.size and s[-1] + n[-1] > self.num_values:
            raise CodecError(f"runs reach past the {self.num_values} values")
        flat = out.reshape(-1)
        starts = np.array([c.start for c in self._chunks], np.int64)
        stops = starts + np.array([c.count for c in self._chunks], np.int64)
        r0 = np.searchsorted(s + n, starts, side="right")  # first run ending after the chunk starts
        r1 = np.maximum(np.searchsorted(s, stops, side="left"), r0)

        def run(i: int) -> None:
            c, a, b = self._chunks[i], int(r0[i]), int(r1[i])
            if b > a:
                _kernels.decode_runs(
                    self._format, c.scales, c.codes, c.count, c.start, s[a:b], d[a:b], n[a:b],
                    flat, known, skip_known,
                )  # fmt: skip

        parallel(run, len(self._chunks))

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
                    self._known,
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
        key = (o.tobytes(), e.tobytes())
        if cached is not None and cached[3] is not None and cached[:2] == key:
            peaks = cached[3]  # taken with the norms, in the same pass
        elif self._vouched is not None and self._vouched[:2] == key:
            peaks = self._vouched[2]  # known to the maker of these codes
        else:
            peaks = self._max_abs(o, e, meets, exact=False)
        risky = peaks * np.abs(w.astype(np.float64)) >= _SAFE_PRODUCT
        if np.any(risky):  # only near float32's limits: try each sum before writing any
            w_risky = np.where(risky, w, np.float32(0))
            for bad in self._accumulate(o, e, meets, w_risky, flat, check=True, add=add):
                if bad >= 0:
                    r = int(np.searchsorted(e, bad, side="right"))
                    raise CodecError(
                        f"adding range {r} (scale {float(w[r])!r}) would overflow float32 "
                        f"at index {bad}"
                    )
        self._accumulate(o, e, meets, w, flat, check=False, add=add)

    def _accumulate(
        self,
        o: np.ndarray,
        e: np.ndarray,
        meets: list[tuple[int, int]],
        w: np.ndarray,
        flat: np.ndarray,
        *,
        check: bool,
        add: bool,
    ) -> list[int]:
        """The accumulate kernel on each chunk's share of the ranges, on the thread pool. With
        `check` it writes nothing and answers, per chunk, the first index whose sum would not
        be finite (-1: none, or a chunk no range meets)."""

        def one(i: int) -> int:
            c, (r0, r1) = self._chunks[i], meets[i]
            if r1 <= r0:
                return -1
            return _kernels.accumulate(
                self._format,
                c.scales,
                c.codes,
                c.count,
                c.start,
                o[r0:r1],
                e[r0:r1],
                w[r0:r1],
                flat,
                check,
                add,
            )

        return parallel(one, len(self._chunks))

    def range_max_abs(
        self, offsets: npt.ArrayLike, ends: npt.ArrayLike, *, exact: bool = True
    ) -> np.ndarray:
        """max |value| over each range [offsets[r], ends[r]) (0 for an empty one), float64;
        exact=False: for 4-bit codes a bound read from the scales alone (7 or 6 times the
        largest), the exact maximum for FP32.

        Example:
          >>> from atoll.wire.codec import encode
          >>> codes = read_codes(encode(np.array([-3, 1, 2], np.float32), Codec.FP32))
          >>> codes.range_max_abs([0, 1], [1, 3]).tolist()
          [3.0, 2.0]
        """
        o, e, meets = self._ranges(offsets, ends)
        return self._max_abs(o, e, meets, exact=exact)

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

        # a bound from the scales reads 1/16 of the codes' bytes: not worth a thread's wakeup
        scales_only = not exact and self.info.codec != Codec.FP32
        ms = [part(i) for i in range(len(self._chunks))] if scales_only else None
        out = np.zeros(o.size, np.float64)
        for (r0, r1), m in zip(meets, ms or parallel(part, len(self._chunks))):
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
      >>> from atoll.wire.codec import encode
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
      >>> from atoll.wire.codec import encode
      >>> out = np.ones(3, np.float32)
      >>> accumulate_ranges(encode(np.array([3, 4, 1], np.float32), Codec.FP32), out, [0, 2], [2, 3], [0.5, 2.0])
      >>> out.tolist()
      [2.5, 3.0, 3.0]
    """
    _as_codes(frame).accumulate_ranges(out, offsets, ends, scales)
