"""The kernels a push in parts is merged with (wire/_kernels.c): `decode_runs` taking the
sum of squares of every block of the fragment that one run of a part fills, wherever the
part's own blocks fall, and `range_stats`' bound from the scales alone, each against a
numpy statement of the same numbers."""

from __future__ import annotations

import numpy as np
import pytest

from atoll.wire import _kernels, codec
from atoll.wire.frames import BLOCK, CHUNK_VALUES

CODECS = [codec.Codec.INT4, codec.Codec.MXFP4, codec.Codec.FP32]


def _codes(n: int, seed: int, codec_id: codec.Codec) -> tuple[codec.Codes, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n, dtype=np.float32) * np.float32(10.0) ** rng.integers(-3, 3, n)
    codes = codec.read_codes(codec.encode(x.astype(np.float32), codec_id))
    return codes, codec.decode(codec.encode(x.astype(np.float32), codec_id))


@pytest.mark.parametrize("codec_id", CODECS)
@pytest.mark.parametrize("skip", [False, True])
def test_decode_runs_sums_every_block_one_run_fills_as_the_values_would_give(codec_id, skip):
    # runs at every shift against the block grid, one across the part's chunk edge
    n = CHUNK_VALUES + 3000
    codes, values = _codes(n, 3, codec_id)
    src = np.array([0, 5, 1000, CHUNK_VALUES - 700, CHUNK_VALUES + 1500], np.int64)
    lengths = np.array([5, 900, 2017, 1400, 1400], np.int64)
    dst = np.array([40, 3 * BLOCK + 16, 7000 + 7, 10000, 20000 + 31], np.int64)
    size = 40000
    out = np.full(size, np.nan, np.float32)
    known = np.full(size // BLOCK, -1.0)
    codes.decode_runs(out, src, dst, lengths, known, skip_known=skip)

    want = np.full(size, np.nan, np.float32)
    for s, d, k in zip(src, dst, lengths):
        want[d : d + k] = values[s : s + k]
    filled = np.flatnonzero(known >= 0)
    # every block of out lying whole in a run (within one of the part's chunks) is summed
    assert filled.size > 150
    for s, d, k in zip(src, dst, lengths):
        for f in range(-(-d // BLOCK), (d + k) // BLOCK):
            i = f * BLOCK - d + s  # the part's value at the block's start
            if i // CHUNK_VALUES == (i + BLOCK - 1) // CHUNK_VALUES:
                assert known[f] >= 0, f
    # ...with the bits the merge's sum over those values gives (a pairwise tree per block)
    ref = codec.Codes.of_values(np.nan_to_num(want))
    assert ref.range_sq_norms(filled * BLOCK, filled * BLOCK + BLOCK).tobytes() == (
        known[filled].tobytes()
    )
    written = ~np.isnan(want)
    if skip:  # the summed blocks are left unwritten; every other value is in place
        written[(filled[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)] = False
        assert np.isnan(out[(filled[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)]).all()
    assert out[written].tobytes() == want[written].tobytes()
    assert np.isnan(out[np.isnan(want)]).all()


def _block_bounds(codes: codec.Codes) -> np.ndarray:
    """7 (INT4) or 6 (MXFP4) times each block's scale, from the chunks' scale bytes."""
    out = []
    for c in codes._chunks:
        raw = np.frombuffer(c.scales, np.uint8)
        if codes.info.codec == codec.Codec.INT4:
            s = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            out.append(7.0 * s.astype(np.float64))
        else:
            out.append(6.0 * np.exp2(raw.astype(np.float64) - 127))
    return np.concatenate(out)


@pytest.mark.parametrize("codec_id", [codec.Codec.INT4, codec.Codec.MXFP4])
def test_the_bound_from_scales_is_the_largest_scale_bound_of_the_blocks_a_range_touches(codec_id):
    n = CHUNK_VALUES + 5000
    codes, _ = _codes(n, 4, codec_id)
    bounds = _block_bounds(codes)
    cuts = np.sort(np.random.default_rng(5).choice(n, 41, replace=False))
    offsets, ends = cuts[:-1:2], cuts[1::2]
    offsets = np.concatenate([offsets, [n, n]])[:-1]  # an empty range at the end
    ends = np.concatenate([ends, [n]])
    want = [
        bounds[a // BLOCK : -(-b // BLOCK)].max() if b > a else 0.0 for a, b in zip(offsets, ends)
    ]
    assert codes.range_max_abs(offsets, ends, exact=False).tolist() == want


def test_the_bound_from_scales_skips_scales_no_checked_chunk_holds_as_the_block_loop_does():
    def bf16(x: float) -> bytes:
        return (np.float32(x).view(np.uint32) >> 16).astype("<u2").tobytes()

    codes = bytes(4 * 16)  # four blocks of zero codes
    i64 = lambda *a: np.array(a, np.int64)  # noqa: E731
    for scales, want in [
        (bf16(2.0) + bf16(-8.0) + bf16(0.5) + bf16(0.0), 14.0),  # a negative scale bounds nothing
        (bf16(2.0) + bf16(float("nan")) + bf16(3.0) + bf16(1.0), 21.0),  # NaN: the loop's max
        (bf16(-0.0) * 4, 0.0),
    ]:
        m = np.zeros(1)
        _kernels.range_stats(_kernels.INT4, scales, codes, 128, 0, i64(0), i64(128), None, m, False)
        assert m.tolist() == [want]
