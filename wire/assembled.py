"""A push assembled from parts as the merge reads it (`Assembled`): the values of one
fragment vector, each part's where its boxes lie, never decoded to float32 in bulk.

Each part is read once to take the per-tensor norms: each block of the fragment that one
run of a part fills whole has its sum of squares taken while its values are in registers
(from one block of the part's codes, or assembled from the two it straddles where the
part's blocks fall off the fragment's grid) and is not written; only the blocks at a
run's ends are written to the fragment vector, where `range_sq_norms` sums them. Then the merge adds each part's values from its codes, run by run, into the round
(`accumulate_ranges`). Both give the bits the same values pushed whole give: the same
sums in the same order, the same products and adds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from atoll.wire import _kernels
from atoll.wire.codec_threads import parallel
from atoll.wire.codes import Codes, _check_out
from atoll.wire.frames import _SAFE_PRODUCT, BLOCK, CodecError


@dataclasses.dataclass(frozen=True)
class PartRuns:
    """One part's codes and where they go: values [src[r], src[r] + lengths[r]) of the
    part are [dst[r], dst[r] + lengths[r]) of the fragment, in tensor tensor[r]."""

    codes: Codes
    src: np.ndarray  # int64, ascending
    dst: np.ndarray  # int64
    lengths: np.ndarray  # int64
    tensor: np.ndarray  # int64: the range (tensor) of the fragment each run lies in


class Assembled(Codes):
    """The fragment vector the parts assemble, as Codes over `out` (float32, the
    fragment's size; the caller's buffer, written where a part's block does not fill a
    fragment block). Tensor t is [offsets[t], ends[t]); peaks[t] bounds its |values|.
    Any read other than the tensors' norms and sums first writes every value into `out`."""

    def __init__(
        self,
        out: np.ndarray,
        parts: Sequence[PartRuns],
        offsets: npt.ArrayLike,
        ends: npt.ArrayLike,
        peaks: npt.ArrayLike,
    ):
        known = np.full(-(-out.size // BLOCK), -1.0)
        for p in parts:
            p.codes.decode_runs(out, p.src, p.dst, p.lengths, known, skip_known=True)
        values = Codes.of_values(out, finite=True, max_abs=(offsets, ends, peaks), block_sq=known)
        super().__init__(values.info, values._chunks)
        self._vouched, self._known = values._vouched, values._known
        self._out, self._parts, self._filled = out, tuple(parts), False

    def _fill(self) -> None:
        """Writes every value into `out`: the plain FP32 Codes reads are then all valid."""
        if not self._filled:
            for p in self._parts:
                p.codes.decode_runs(self._out, p.src, p.dst, p.lengths)
            self._filled = True

    def _tensors(self, offsets: npt.ArrayLike, ends: npt.ArrayLike) -> bool:
        """Whether the ranges are the tensors the parts' runs were laid out by."""
        o, e, _ = self._ranges(offsets, ends)
        return self._vouched is not None and self._vouched[:2] == (o.tobytes(), e.tobytes())

    def range_sq_norms(self, offsets: npt.ArrayLike, ends: npt.ArrayLike) -> np.ndarray:
        if not self._tensors(offsets, ends):  # a known block may straddle such a range
            self._fill()
        return super().range_sq_norms(offsets, ends)

    def accumulate_ranges(
        self,
        out: np.ndarray,
        offsets: npt.ArrayLike,
        ends: npt.ArrayLike,
        scales: npt.ArrayLike,
        *,
        add: bool = True,
    ) -> None:
        """As `Codes.accumulate_ranges`; over the tensors, with every sum bounded by the
        parts' scales, straight from each part's codes."""
        _check_out(out, self.num_values)
        s64 = np.asarray(scales, np.float64).reshape(-1)
        with np.errstate(over="ignore", invalid="ignore"):
            w = s64.astype(np.float32)
        safe = (
            self._tensors(offsets, ends)
            and self._vouched is not None
            and s64.shape == self._vouched[2].shape
            and bool(np.all(np.isfinite(w)))
            and not np.any(self._vouched[2] * np.abs(w.astype(np.float64)) >= _SAFE_PRODUCT)
        )
        if not safe:  # near float32's limits, or not the tensors: the checked path
            self._fill()
            super().accumulate_ranges(out, offsets, ends, scales, add=add)
            return
        flat = out.reshape(-1)
        items = [(p, i) for p in self._parts for i in range(len(p.codes._chunks))]

        def one(k: int) -> None:
            p, i = items[k]
            c = p.codes._chunks[i]
            a = int(np.searchsorted(p.src + p.lengths, c.start, side="right"))
            b = max(int(np.searchsorted(p.src, c.start + c.count, side="left")), a)
            if b > a:
                ws = np.ascontiguousarray(w[p.tensor[a:b]])
                _kernels.accumulate_runs(
                    p.codes._format, c.scales, c.codes, c.count, c.start,
                    p.src[a:b], p.dst[a:b], p.lengths[a:b], ws, flat, add,
                )  # fmt: skip

        parallel(one, len(items))

    def range_max_abs(
        self, offsets: npt.ArrayLike, ends: npt.ArrayLike, *, exact: bool = True
    ) -> np.ndarray:
        self._fill()
        return super().range_max_abs(offsets, ends, exact=exact)

    def decode_into(self, out: np.ndarray, weight: float = 1.0, *, accumulate: bool = True) -> None:
        self._fill()
        super().decode_into(out, weight, accumulate=accumulate)


def part_runs(
    codes: Codes, starts: np.ndarray, lengths: np.ndarray, offsets: np.ndarray
) -> PartRuns:
    """A part's runs from where they start in the fragment and their lengths, in part
    order (`wire.parts.BoxLayout`), in a fragment whose tensors start at `offsets`."""
    if int(lengths.sum()) != codes.num_values:
        raise CodecError(f"runs of {int(lengths.sum())} values for a part of {codes.num_values}")
    tensor = np.searchsorted(np.asarray(offsets, np.int64), starts, side="right") - 1
    return PartRuns(codes, np.cumsum(lengths) - lengths, starts, lengths, tensor)
