"""Tests for wire/codec.py and its C kernels (wire/_kernels.c).

The 4-bit formats are checked value by value against tests/codec_reference.py, an
independent numpy/ml_dtypes statement of INT4 and MXFP4; scales and codes are pulled
straight out of the decompressed chunks (parsed here from the documented layout), so
the wire layout is pinned too. The merge kernels (`range_sq_norms`,
`accumulate_ranges`) are checked bit for bit against numpy statements of their order.

"""

import concurrent.futures
import itertools
import struct

import ml_dtypes
import numpy as np
import pytest
import zstandard
from codec_reference import (
    INT4_MAX_SCALE,
    int4_reference,
    int4_values,
    mxfp4_reference,
    mxfp4_values,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from atoll.wire import codec as codec_module
from atoll.wire import syncer_pb2
from atoll.wire.codec import (
    BLOCK,
    CHUNK_VALUES,
    FRAME_VERSION,
    HEADER_BYTES,
    Codec,
    CodecError,
    Codes,
    ErrorFeedback,
    accumulate_ranges,
    body_bytes,
    decode,
    decode_into,
    encode,
    encode_publish,
    frame_info,
    max_frame_bytes,
    range_sq_norms,
    read_codes,
)

INT4, MXFP4, FP32 = Codec.INT4, Codec.MXFP4, Codec.FP32
FOUR_BIT = [INT4, MXFP4]
F32_MAX = float(np.finfo(np.float32).max)
HEADER = struct.Struct("<4sBBHQ")
# Every E2M1 value by code, from ml_dtypes rather than from the kernel's table.
E2M1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


# ---- helpers ----


def chunks_of(frame: bytes) -> list[bytes]:
    """The compressed chunks of a version 2 frame, from the documented layout: a table of
    k - 1 u32 lengths after the header (k = ceil(n / CHUNK_VALUES), at least 1), then the
    chunks, the last running to the end."""
    n = HEADER.unpack_from(frame)[4]
    k = max(1, -(-n // CHUNK_VALUES))
    sizes = struct.unpack_from(f"<{k - 1}I", frame, HEADER_BYTES)
    start = HEADER_BYTES + 4 * (k - 1)
    bounds = list(itertools.accumulate(sizes, initial=start)) + [len(frame)]
    return [frame[a:b] for a, b in zip(bounds, bounds[1:])]


def body_of(frame: bytes) -> bytes:
    """The frame's body in version 1's layout (all scales, then all codes), whatever its version."""
    _, codec, version, _, n = HEADER.unpack_from(frame)
    if version == 1:
        return zstandard.ZstdDecompressor().decompress(frame[HEADER_BYTES:])
    bodies = [zstandard.ZstdDecompressor().decompress(c) for c in chunks_of(frame)]
    if codec == FP32:
        return b"".join(bodies)
    width = 2 if codec == INT4 else 1
    counts = [min(CHUNK_VALUES, n - i * CHUNK_VALUES) for i in range(len(bodies))]
    splits = [-(-c // BLOCK) * width for c in counts]
    return b"".join(
        [b[:w] for b, w in zip(bodies, splits)] + [b[w:] for b, w in zip(bodies, splits)]
    )


def v1_frame(frame: bytes) -> bytes:
    """The same values as a version 1 frame (one zstd frame over the whole body)."""
    _, codec, _, block, n = HEADER.unpack_from(frame)
    return make_frame(codec, n, body_of(frame), block=block, version=1)


def split_body(codec: Codec, n: int, body: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(scales, 4-bit codes per element incl. the tail block's padding) of a body.

    Layout (wire/_kernels.c header): nb scales, then 16 bytes per block; byte j of a
    block holds element j in its low nibble and element j + 16 in its high nibble.
    """
    nb = -(-n // BLOCK)
    width = 2 if codec == INT4 else 1
    assert len(body) == nb * (width + BLOCK // 2) == body_bytes(codec, n)
    scales = np.frombuffer(body, "<u2" if codec == INT4 else np.uint8, nb)
    packed = np.frombuffer(body, np.uint8, offset=nb * width).reshape(nb, BLOCK // 2)
    return scales, np.concatenate([packed & 15, packed >> 4], axis=1).reshape(-1)


def int4_codes(nibbles: np.ndarray) -> np.ndarray:
    n = nibbles.astype(np.int8)
    return np.where(n >= 8, n - 16, n).astype(np.int8)


def bf16(bits) -> np.ndarray:
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def same_bits(a: np.ndarray, b: np.ndarray, zero_sign: bool = True) -> bool:
    """Bit equality of float32 arrays; zero_sign=False treats -0 and +0 as one."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if not zero_sign:
        a, b = a + np.float32(0), b + np.float32(0)  # -0 + 0 == +0
    return a.shape == b.shape and bool(np.all(a.view(np.uint32) == b.view(np.uint32)))


def reference_values(codec: Codec, x: np.ndarray) -> np.ndarray:
    if codec == INT4:
        return int4_values(*int4_reference(x))[: x.size]
    return mxfp4_values(*mxfp4_reference(x))[: x.size]


def make_frame(
    codec_id: int,
    n: int,
    body: bytes,
    *,
    block: int | None = None,
    version: int = FRAME_VERSION,
    magic: bytes = b"ATLQ",
) -> bytes:
    """A frame built by hand: header + body compressed with checksum and content size (one
    chunk: n <= CHUNK_VALUES, or version 1)."""
    if block is None:
        block = 1 if codec_id == FP32 else BLOCK
    payload = zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(body)
    return HEADER.pack(magic, codec_id, version, block, n) + payload


def sentinel(n: int) -> np.ndarray:
    return np.random.default_rng(n).standard_normal(n).astype(np.float32)


def assert_rejected(frame, match: str, n: int | None = None, codec: Codec | None = None):
    """decode_into must raise CodecError (message matching) and leave out untouched."""
    if n is None:
        n = frame_info(frame).num_values
    out = sentinel(n)
    before = out.tobytes()
    with pytest.raises(CodecError, match=match):
        decode_into(frame, out, 0.5, codec=codec)
    assert out.tobytes() == before, "a rejected frame changed out"
    with pytest.raises(CodecError, match=match):
        decode_into(frame, out, accumulate=False, codec=codec)
    assert out.tobytes() == before, "a rejected frame changed out"


# ---- data ----


@st.composite
def tricky_vectors(draw, max_len: int = 5000) -> np.ndarray:
    """float32 vectors with per-block magnitudes from 1e-45 to 1e38, all-zero blocks,
    zeros, -0, denormals and huge values mixed into the same blocks."""
    n = draw(
        st.one_of(
            st.integers(1, max_len),
            st.sampled_from([1, 2, 31, 32, 33, 63, 64, 65, 96, 4095, 4096, 4097]),
        )
    )
    lo = draw(st.integers(-45, 38))
    hi = draw(st.integers(lo, 38))
    p_zero_block, p_zero, p_negzero, p_denormal, p_huge = (
        draw(st.sampled_from([0.0, 0.02, 0.3])) for _ in range(5)
    )
    spread = draw(st.sampled_from([0.0, 3.0, 30.0]))  # decades of spread within a block
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    nb = -(-n // BLOCK)
    mag = np.repeat(10.0 ** rng.uniform(lo, hi, nb), BLOCK)[:n]
    x = rng.standard_normal(n) * mag * 10.0 ** -rng.uniform(0, spread, n)
    x = np.clip(x, -1e38, 1e38).astype(np.float32)
    pick = lambda p: rng.random(n) < p  # noqa: E731
    x[pick(p_zero)] = 0.0
    x[pick(p_negzero)] = -0.0
    den = pick(p_denormal)
    x[den] = (
        rng.integers(1, 1 << 23, den.sum(), dtype=np.uint32)
        | (rng.integers(0, 2, den.sum(), dtype=np.uint32) << 31)
    ).view(np.float32)
    huge = pick(p_huge)
    x[huge] = (rng.uniform(1e37, 1e38, huge.sum()) * rng.choice([-1, 1], huge.sum())).astype(
        np.float32
    )
    for b in np.flatnonzero(rng.random(nb) < p_zero_block):
        x[b * BLOCK : (b + 1) * BLOCK] = 0.0
    return x


# Any finite float32 at all, up to FLT_MAX, in short vectors.
raw_vectors = hnp.arrays(
    np.float32,
    st.integers(1, 200),
    elements=st.floats(width=32, allow_nan=False, allow_infinity=False),
)


# ---- 1. kernels vs the reference, bit for bit ----


def check_against_reference(codec: Codec, x: np.ndarray):
    n = x.size
    frame = encode(x, codec)
    info = frame_info(frame)
    assert (info.codec, info.num_values, info.block) == (codec, n, BLOCK)
    scales, nib = split_body(codec, n, body_of(frame))
    if codec == INT4:
        ref_scales, ref_q = int4_reference(x)
        np.testing.assert_array_equal(scales, ref_scales)
        np.testing.assert_array_equal(int4_codes(nib), ref_q)  # padding codes are 0 too
        expected = int4_values(ref_scales, ref_q)[:n]
    else:
        ref_scales, ref_vals = mxfp4_reference(x)
        np.testing.assert_array_equal(scales, ref_scales)
        # The kernel writes +0 (code 0) where the reference rounds to -0: same value.
        assert same_bits(E2M1[nib], ref_vals, zero_sign=False)
        expected = mxfp4_values(ref_scales, ref_vals)[:n]
    decoded = decode(frame)
    assert same_bits(decoded, expected, zero_sign=False)
    # Error feedback: same frame, and the residual is exactly (x + 0) - decoded in
    # float32 (the stream starts from a zero residual, so x = -0 leaves +0).
    ef = ErrorFeedback(n, codec)
    assert ef.encode(x) == frame
    assert same_bits(ef.residual, (x + np.zeros_like(x)) - decoded)
    # A second step encodes y = x2 + residual (float32 add) by the same rules.
    x2 = x[::-1].copy()
    with np.errstate(over="ignore", invalid="ignore"):
        y = x2 + ef.residual
    if not np.isfinite(y).all():
        kept = ef.residual.tobytes()
        with pytest.raises(CodecError, match="non-finite"):
            ef.encode(x2)
        assert ef.residual.tobytes() == kept
        return
    frame2 = ef.encode(x2)
    assert frame2 == encode(y, codec)
    with np.errstate(over="ignore", invalid="ignore"):
        assert same_bits(ef.residual, y - reference_values(codec, y))


@pytest.mark.parametrize("codec", FOUR_BIT)
@settings(max_examples=120, deadline=None)
@given(x=tricky_vectors())
def test_kernels_match_reference_bit_exactly(codec, x):
    check_against_reference(codec, x)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # INT4 near FLT_MAX
@pytest.mark.parametrize("codec", FOUR_BIT)
@settings(max_examples=150, deadline=None)
@given(x=raw_vectors)
def test_kernels_match_reference_on_any_finite_float32(codec, x):
    check_against_reference(codec, x)


@pytest.mark.parametrize("codec", FOUR_BIT)
@pytest.mark.parametrize(
    "x",
    [
        np.zeros(1, np.float32),
        np.zeros(100, np.float32),
        np.full(77, -0.0, np.float32),
        np.full(40, 2**-149, np.float32),
        np.array([2**-149, -(2**-148), 3 * 2**-149], np.float32),
        np.full(33, 1e38, np.float32),
        np.array([1e38] + [1e-40] * 40, np.float32),
        np.array([0.0, -0.0, 1e-45, -1e-45, 1e-38, 1e38, -1e38, 1.0] * 9, np.float32),
    ],
    ids=[
        "zero1",
        "zero100",
        "negzero",
        "min-denormal",
        "tiny-amax",
        "1e38",
        "huge+denormal",
        "mixture",
    ],
)
def test_kernels_match_reference_on_edge_vectors(codec, x):
    check_against_reference(codec, x)


def test_mxfp4_rounds_ties_to_even_at_every_scale():
    """Every E8M0 scale the encoder can pick (2^-127 .. 2^125), with values exactly on
    E2M1 midpoints, above 6 (clipped) and just below 8 times the scale."""
    e = np.arange(-127, 126)
    mult = np.array(
        [
            4,
            7.99,
            6.5,
            6,
            5,
            -5,
            3.5,
            -3.5,
            2.5,
            -2.5,
            1.75,
            -1.75,
            1.25,
            -1.25,
            0.75,
            -0.75,
            0.25,
            -0.25,
            0.5,
            5.5,
            4.5,
            3,
            2.25,
            1.1,
        ]
    )
    want = np.array(
        [4, 6, 6, 6, 4, -4, 4, -4, 2, -2, 2, -2, 1, -1, 1, -1, 0, 0, 0.5, 6, 4, 3, 2, 1], np.float32
    )
    rng = np.random.default_rng(3)
    fill = rng.uniform(-7.9, 7.9, (e.size, BLOCK - mult.size))
    xm = np.concatenate([np.tile(mult, (e.size, 1)), fill], axis=1)
    x = (xm * np.exp2(e.astype(np.float64))[:, None]).astype(np.float32)
    dyadic = np.flatnonzero(mult * 4 == np.round(mult * 4))  # midpoints: exact at every scale
    assert np.all(x[:, dyadic].astype(np.float64) == xm[:, dyadic] * np.exp2(e)[:, None])
    x = x.reshape(-1)
    scales, nib = split_body(MXFP4, x.size, body_of(encode(x, MXFP4)))
    np.testing.assert_array_equal(scales, e + 127)
    got = E2M1[nib].reshape(e.size, BLOCK)
    np.testing.assert_array_equal(got[:, : mult.size], np.tile(want, (e.size, 1)))
    check_against_reference(MXFP4, x)


def _int4_tie_vectors():
    """One block per positive bf16 scale s the encoder can choose (up to the cap that keeps
    8s finite): 7s (so the scale is exactly s), then values exactly on the midpoints
    (k + 1/2) s, and values one float32 ulp past them."""
    bits = np.arange(1, INT4_MAX_SCALE + 1, dtype=np.uint32)
    s = bf16(bits)
    ties = np.array([k + 0.5 for k in range(7)], np.float32)
    mult = np.concatenate([[7, -7], ties, -ties]).astype(np.float32)
    x = np.zeros((s.size, BLOCK), np.float32)
    x[:, : mult.size] = mult * s[:, None]
    assert np.all(x[:, : mult.size].astype(np.float64) == mult.astype(np.float64) * s[:, None])
    past = mult.size + ties.size
    x[:, mult.size : past] = np.nextafter(x[:, 2 : 2 + ties.size], np.float32(np.inf))
    return s, mult, x


def test_int4_rounds_ties_to_even_at_every_bf16_scale():
    s, mult, x = _int4_tie_vectors()
    scales, nib = split_body(INT4, x.size, body_of(encode(x.reshape(-1))))
    np.testing.assert_array_equal(bf16(scales), s)
    q = int4_codes(nib).reshape(s.size, BLOCK)
    bad = np.flatnonzero(np.any(q[:, : mult.size] != np.rint(mult), axis=1))
    some = s[bad][s[bad] >= 1][:3]
    assert bad.size == 0, f"{bad.size} of {s.size} scales misround exact midpoints, e.g. s = {some}"
    past = q[:, mult.size : mult.size + 7]
    assert np.all(past == np.rint(mult[2:9]) + (np.arange(7) % 2 == 0)), "one ulp past a midpoint"
    check_against_reference(INT4, x.reshape(-1))


def test_int4_rounds_ties_to_even_for_power_of_two_scales():
    """The part of the tie rule that holds today (1/s exact): keep it from regressing."""
    s, mult, x = _int4_tie_vectors()
    pow2 = (s.view(np.uint32) & 0x007F0000) == 0  # bf16 mantissa 0 (normal scales)
    pow2 &= s >= 2**-126
    xs = x[pow2].reshape(-1)
    q = int4_codes(split_body(INT4, xs.size, body_of(encode(xs)))[1]).reshape(-1, BLOCK)
    np.testing.assert_array_equal(q[:, : mult.size], np.tile(np.rint(mult), (pow2.sum(), 1)))
    check_against_reference(INT4, xs)


def test_golden_frames_pin_the_wire_layout():
    """If this fails because the layout changed on purpose, bump FRAME_VERSION in
    wire/codec.py (frames from older builds would otherwise decode to shuffled values)
    and update these bytes, derived by hand: byte j of a block's 16 code bytes holds
    element j (low nibble) and element j + 16 (high nibble)."""
    q = np.concatenate([np.arange(32) % 15 - 7, [7, -7, 0, 1, 2, 3, -1, -2]])
    x = (q * np.repeat([0.25, 2.0], 32)[:40]).astype(np.float32)  # scales 0.25 and 2
    assert body_of(encode(x, INT4)).hex() == (
        "803e"
        "0040"  # bf16 0.25, 2.0
        "a9bacbdcedfe0f1021324354657697a9"  # -7..7, -7 | -6..7, -7, -6
        "0709000102030f0e" + "00" * 8
    )  # 7 -7 0 1 2 3 -1 -2, padding
    assert body_of(encode(x, MXFP4)).hex() == (
        "7d80"  # 2^-2, 2^1
        "ffefeedecdac0a20425465667677f7ff"  # |q| 5 -> 4 (tie to even), 7 -> 6
        "070f000204050a0c" + "00" * 8
    )
    assert encode(x, INT4)[:HEADER_BYTES] == HEADER.pack(b"ATLQ", 3, 2, 32, 40)
    assert encode(x, MXFP4)[:HEADER_BYTES] == HEADER.pack(b"ATLQ", 2, 2, 32, 40)
    assert encode(x, FP32)[:HEADER_BYTES] == HEADER.pack(b"ATLQ", 1, 2, 1, 40)
    # One chunk: the zstd frame follows the header directly (no table), as in version 1.
    assert zstandard.ZstdDecompressor().decompress(encode(x, INT4)[HEADER_BYTES:]) == body_of(
        encode(x, INT4)
    )


# ---- 2. round-trip error bounds ----


def check_int4_bounds(x: np.ndarray):
    frame = encode(x, INT4)
    dec = decode(frame).astype(np.float64)
    scales, _ = split_body(INT4, x.size, body_of(frame))
    s = np.repeat(bf16(scales).astype(np.float64), BLOCK)[: x.size]
    xb = np.concatenate([x, np.zeros(-x.size % BLOCK, np.float32)]).reshape(-1, BLOCK)
    amax_b = np.abs(xb.astype(np.float64)).max(axis=1)
    amax = np.repeat(amax_b, BLOCK)[: x.size]
    sb = bf16(scales).astype(np.float64)
    # The scale: >= absmax / 7 (up to the float32 rounding of the division, 2^-150 absolute
    # among denormals), at most one bf16 step (2^-7 relative, or the smallest bf16
    # denormal 2^-133) above it.
    assert np.all(sb >= amax_b / 7 * (1 - 2**-23) - 2**-150)
    assert np.all(sb <= amax_b / 7 * (1 + 2**-7) * (1 + 2**-23) + 2**-133)
    err = np.abs(x.astype(np.float64) - dec)
    assert np.all(err <= amax), "an error larger than the block's absmax"
    pos = s > 0
    worst = np.argmax(np.where(pos, err - s / 2, -np.inf)) if pos.any() else 0
    assert np.all(err[pos] <= s[pos] / 2), (
        f"|x - dec| > s/2 at {worst}: x={x[worst]!r} s={s[worst]!r}"
    )
    # A zero scale only when absmax / 7 underflows float32 (absmax <= 3 * 2^-149).
    assert np.all(amax[~pos] <= 3 * 2**-149) and np.all(dec[~pos] == 0)
    assert np.all(np.abs(dec) <= amax * (1 + 2**-7) * (1 + 2**-23) + 7 * 2**-133)


def check_mxfp4_bounds(x: np.ndarray):
    frame = encode(x, MXFP4)
    dec = decode(frame).astype(np.float64)
    scales, _ = split_body(MXFP4, x.size, body_of(frame))
    xb = np.concatenate([x, np.zeros(-x.size % BLOCK, np.float32)]).reshape(-1, BLOCK)
    amax_b = np.abs(xb.astype(np.float64)).max(axis=1)
    # OCP MX: shared exponent floor(log2 absmax) - emax(E2M1) = floor(log2 absmax) - 2.
    with np.errstate(divide="ignore"):
        e = np.where(amax_b > 0, np.floor(np.log2(np.where(amax_b > 0, amax_b, 1))) - 2, -127)
    np.testing.assert_array_equal(scales.astype(np.int64) - 127, np.maximum(e, -127))
    scale = np.repeat(np.exp2(scales.astype(np.float64) - 127), BLOCK)[: x.size]
    a = np.abs(x.astype(np.float64)) / scale
    assert np.all(a < 8)
    half_step = np.where(a <= 2, 0.25, np.where(a <= 4, 0.5, 1.0))
    bound = np.where(a <= 6, half_step * scale, (a - 6) * scale)
    err = np.abs(x.astype(np.float64) - dec)
    assert np.all(err <= bound)
    assert np.all(np.abs(dec) <= np.minimum(np.abs(x.astype(np.float64)) + bound, 6 * scale))


def check_signs(x: np.ndarray, codec: Codec):
    dec = decode(encode(x, codec))
    assert np.all((dec == 0) | (np.sign(dec) == np.sign(x))), "a decoded value flipped sign"


@settings(max_examples=100, deadline=None)
@given(x=tricky_vectors())
def test_int4_error_within_half_a_scale_step(x):
    check_int4_bounds(x)
    check_signs(x, INT4)


@settings(max_examples=100, deadline=None)
@given(x=tricky_vectors())
def test_mxfp4_error_within_half_an_e2m1_step(x):
    check_mxfp4_bounds(x)
    check_signs(x, MXFP4)


@settings(max_examples=100, deadline=None)
@given(x=st.one_of(raw_vectors, tricky_vectors(max_len=600)))
def test_fp32_round_trip_is_exact(x):
    frame = encode(x, FP32)
    assert body_of(frame) == x.astype("<f4").tobytes()
    assert same_bits(decode(frame), x)  # -0 and denormals included


@pytest.mark.parametrize("codec, limit", [(INT4, 0.12), (MXFP4, 0.13)])
def test_gaussian_relative_error(codec, limit):
    x = np.random.default_rng(11).standard_normal(1 << 20).astype(np.float32)
    dec = decode(encode(x, codec))
    rel = np.linalg.norm(x.astype(np.float64) - dec) / np.linalg.norm(x.astype(np.float64))
    assert 0.05 < rel <= limit
    check_signs(x, codec)


def test_default_codec_is_int4():
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    assert frame_info(encode(x)).codec == INT4
    assert encode(x) == encode(x, INT4)


def test_shapes_levels_and_threads():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((37, 29)).astype(np.float32)
    for codec in Codec:
        frame = encode(x, codec)
        assert same_bits(decode(frame), decode(encode(x.reshape(-1), codec)))
        assert same_bits(decode(encode(x, codec, level=19)), decode(frame))
        assert same_bits(decode(encode(np.asfortranarray(x), codec)), decode(frame))
    xs = [rng.standard_normal(5000).astype(np.float32) for _ in range(16)]
    serial = [encode(v) for v in xs]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(encode, xs)) == serial


@pytest.mark.parametrize("codec", [INT4, MXFP4, FP32])
@pytest.mark.parametrize("n", [1, 31, 32 * 8 * 3 + 5, CHUNK_VALUES + 777])
def test_encode_publish_is_subtract_encode_and_decode_into_bit_for_bit(codec, n):
    """What a shard's close sends and what its published copy becomes, in one pass: the
    frame of params − published, and published + 1.0 × each decoded value (what a
    learner's decode_into gives), over whole groups, lone blocks, tails and chunks, with
    magnitudes from denormal to near float32's limit."""
    rng = np.random.default_rng(n)
    mags = 10.0 ** rng.uniform(-40, 37, -(-n // BLOCK)).repeat(BLOCK)[:n]
    published = (rng.standard_normal(n) * mags).astype(np.float32)
    params = (published + rng.standard_normal(n) * mags * 0.1).astype(np.float32)
    params[: n // 7] = published[: n // 7]  # whole blocks that did not move
    want_frame = encode(params - published, codec)
    want = published.copy()
    decode_into(want_frame, want, 1.0)
    got = published.copy()
    assert encode_publish(params, got, codec) == want_frame
    assert got.tobytes() == want.tobytes()


def test_encode_publish_refuses_what_it_cannot_write():
    x = np.ones(64, np.float32)
    for bad in (np.ones(63, np.float32), np.ones(64), np.ones(128, np.float32)[::2]):
        with pytest.raises(CodecError):
            encode_publish(x, bad)
    far = np.full(64, F32_MAX, np.float32)
    with pytest.raises(CodecError, match="non-finite value inf at index 0"):
        encode_publish(far, -far)  # the difference overflows (named as x − published)


# ---- 3. error feedback ----


@pytest.mark.parametrize("codec", FOUR_BIT)
def test_error_feedback_keeps_the_running_sum_on_track(codec):
    rng = np.random.default_rng(5)
    n, steps = 4096, 200
    # Gradient-like: noise plus a small steady drift that alone rounds to zero.
    drift = (rng.standard_normal(n) * 0.02).astype(np.float32)
    ef = ErrorFeedback(n, codec)
    sum_x = np.zeros(n)
    sum_ef = np.zeros(n)
    sum_plain = np.zeros(n)
    frame_err = []
    gap_ef, gap_plain = [], []
    for _ in range(steps):
        x = (rng.standard_normal(n) + drift).astype(np.float32)
        sum_x += x
        sum_ef += decode(ef.encode(x))
        plain = decode(encode(x, codec))
        sum_plain += plain
        frame_err.append(np.linalg.norm(x - plain.astype(np.float64)))
        gap_ef.append(np.linalg.norm(sum_x - sum_ef))
        gap_plain.append(np.linalg.norm(sum_x - sum_plain))
    one_frame = float(np.mean(frame_err))
    # With feedback the gap is exactly the residual (up to float32 rounding of x + r).
    np.testing.assert_allclose(sum_x - sum_ef, ef.residual, rtol=0, atol=1e-4)
    assert max(gap_ef) <= 1.5 * one_frame, (max(gap_ef), one_frame)
    # Without it the gap grows: drift lost every round plus a random walk of errors.
    assert gap_plain[-1] > 5 * max(gap_ef)
    assert gap_plain[-1] > 3 * gap_plain[9]


@pytest.mark.parametrize("codec", [*FOUR_BIT, FP32])
def test_encode_written_is_encode_of_what_it_writes(codec):
    # x written where the next residual goes: the same frames and residuals, bit for bit
    rng = np.random.default_rng(6)
    n = CHUNK_VALUES + 3 * BLOCK + 5  # two chunks, a short last block
    a, b = ErrorFeedback(n, codec), ErrorFeedback(n, codec)
    for _ in range(3):
        x, y = rng.standard_normal((2, n)).astype(np.float32)
        assert b.encode_written(lambda out: np.subtract(x, y, out=out)) == a.encode(x - y)
        assert same_bits(b.residual, a.residual)
    kept = b.residual.copy()
    x[n - 7] = np.inf
    with pytest.raises(CodecError, match="non-finite"):
        b.encode_written(lambda out: np.copyto(out, x))
    assert same_bits(b.residual, kept)  # a failed encode leaves the stream as it was


def test_error_feedback_fp32_and_reset():
    x = np.random.default_rng(4).standard_normal(100).astype(np.float32)
    ef = ErrorFeedback(100, FP32)
    assert same_bits(decode(ef.encode(x)), x)
    assert not ef.residual.any()
    ef = ErrorFeedback(100)
    ef.encode(x)
    assert ef.residual.any()
    ef.reset()
    assert not ef.residual.any()
    assert ef.encode(x) == encode(x)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_error_feedback_non_finite_leaves_residual(codec, bad):
    rng = np.random.default_rng(6)
    ef = ErrorFeedback(100, codec)
    ef.encode(rng.standard_normal(100).astype(np.float32))
    if codec != FP32:
        assert ef.residual.any()
    before = ef.residual.tobytes()
    x = rng.standard_normal(100).astype(np.float32)
    x[77] = bad
    with pytest.raises(CodecError, match="index 77"):
        ef.encode(x)
    assert ef.residual.tobytes() == before
    # Finite x whose sum with the residual overflows is refused the same way.
    ef.residual[40] = 3e38
    before = ef.residual.tobytes()
    x = np.zeros(100, np.float32)
    x[40] = 3e38
    with pytest.raises(CodecError, match="non-finite value inf at index 40"):
        ef.encode(x)
    assert ef.residual.tobytes() == before


def test_error_feedback_rejects_wrong_length_and_dtype():
    ef = ErrorFeedback(64)
    ef.encode(np.ones(64, np.float32))
    before = ef.residual.tobytes()
    for x, match in [
        (np.ones(63, np.float32), "63 values; this stream carries 64"),
        (np.ones(65, np.float32), "65 values"),
        (np.ones(64, np.float64), "float32"),
    ]:
        with pytest.raises(CodecError, match=match):
            ef.encode(x)
        assert ef.residual.tobytes() == before


def test_int4_near_float32_max_stays_finite():
    x = np.array([F32_MAX, -3.4e38, 1.0], np.float32)
    assert np.isfinite(decode(encode(x))).all()
    ef = ErrorFeedback(3)
    ef.encode(x)
    assert np.isfinite(ef.residual).all()
    ef.encode(np.zeros(3, np.float32))


# ---- 4. decode_into ----


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000])
@pytest.mark.parametrize("weight", [1.0, 0.25, -1.5, 1 / 3, 0.0])
def test_decode_into_accumulates_weighted(codec, n, weight):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)
    frame = encode(x, codec)
    values = x if codec == FP32 else reference_values(codec, x)
    out = rng.standard_normal(n).astype(np.float32)
    expected = out + np.float32(weight) * values  # two float32 roundings, no fma
    info = decode_into(frame, out, weight)
    assert (info.codec, info.num_values) == (codec, n)
    assert same_bits(out, expected, zero_sign=codec == FP32)
    again = rng.standard_normal(n).astype(np.float32)
    again2 = again.copy()
    decode_into(frame, again, weight)
    decode_into(frame, again2, weight)
    assert again.tobytes() == again2.tobytes()


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("weight", [1.0, -0.5])
def test_decode_into_overwrite(codec, weight):
    x = np.random.default_rng(8).standard_normal(77).astype(np.float32)
    frame = encode(x, codec)
    values = x if codec == FP32 else reference_values(codec, x)
    out = np.full(77, np.nan, np.float32)  # prior contents must not matter
    decode_into(frame, out, weight, accumulate=False)
    assert same_bits(out, np.float32(weight) * values, zero_sign=False)
    out2d = np.full((7, 11), np.inf, np.float32)
    decode_into(frame, out2d, weight, accumulate=False)
    assert out2d.tobytes() == out.tobytes()
    assert decode(frame).tobytes() == decode(frame).tobytes()


@pytest.mark.parametrize("codec", list(Codec))
def test_decode_into_rejects_bad_out_or_weight(codec):
    n = 40
    frame = encode(np.random.default_rng(9).standard_normal(n).astype(np.float32), codec)
    cases = [
        (np.zeros(n, np.float64), "float32"),
        (np.zeros(n, np.float16), "float32"),
        (np.zeros(2 * n, np.float32)[::2], "C-contiguous"),
        (np.zeros((8, 5), np.float32, order="F"), "C-contiguous"),
        (np.zeros(n - 1, np.float32), f"frame holds {n} values; out holds {n - 1}"),
        (np.zeros(n + 1, np.float32), f"out holds {n + 1}"),
    ]
    for out, match in cases:
        out[...] = 3.0
        before = out.tobytes()
        with pytest.raises(CodecError, match=match):
            decode_into(frame, out)
        assert out.tobytes() == before
    with pytest.raises(CodecError, match="numpy array"):
        decode_into(frame, [0.0] * n)
    out = np.full(n, 3.0, np.float32)
    for weight in [np.nan, np.inf, -np.inf, np.float32(np.nan)]:
        with pytest.raises(CodecError, match="weight must be finite"):
            decode_into(frame, out, weight)
        assert np.all(out == 3.0)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("codec", [INT4, FP32])
def test_decode_into_rejects_weight_beyond_float32(codec):
    frame = encode(np.ones(40, np.float32), codec)
    out = np.zeros(40, np.float32)
    with pytest.raises(CodecError, match="weight"):
        decode_into(frame, out, 1e39)
    assert not out.any()


# ---- 5. malformed frames ----


@pytest.fixture(params=list(Codec), ids=lambda c: c.name)
def good(request):
    """(codec, n, frame) for a valid frame of 100 values (a tail block included)."""
    x = np.random.default_rng(10).standard_normal(100).astype(np.float32)
    return request.param, 100, encode(x, request.param)


def test_rejects_short_frames(good):
    _, n, frame = good
    for cut in [0, 1, HEADER_BYTES - 1]:
        with pytest.raises(CodecError, match=f"{cut} bytes is shorter than its 16-byte header"):
            frame_info(frame[:cut])
        assert_rejected(frame[:cut], "shorter", n=n)


def test_rejects_bad_header_fields(good):
    codec, n, frame = good
    body = frame[HEADER_BYTES:]
    block = 1 if codec == FP32 else BLOCK
    assert_rejected(HEADER.pack(b"ATLX", codec, 1, block, n) + body, "not an atoll frame", n=n)
    assert_rejected(HEADER.pack(b"\0\0\0\0", codec, 1, block, n) + body, "magic", n=n)
    for cid in [0, 4, 255]:
        assert_rejected(
            HEADER.pack(b"ATLQ", cid, 1, block, n) + body, f"unknown codec id {cid}", n=n
        )
    for version in [0, 3, 255]:
        assert_rejected(
            HEADER.pack(b"ATLQ", codec, version, block, n) + body,
            f"frame version {version} is not supported",
            n=n,
        )
    for wrong in [0, 16, 33, 64, 65535] + ([32] if codec == FP32 else [1]):
        assert_rejected(HEADER.pack(b"ATLQ", codec, 1, wrong, n) + body, f"block {wrong}", n=n)


def test_rejects_truncated_payload(good):
    _, n, frame = good
    cuts = sorted(
        set(range(HEADER_BYTES, HEADER_BYTES + 24))
        | set(range(HEADER_BYTES, len(frame), 7))
        | {len(frame) - 4, len(frame) - 1}
    )
    for cut in cuts:
        assert_rejected(frame[:cut], "truncated|corrupt", n=n)


def test_flipped_payload_bits_are_caught(good):
    codec, n, frame = good
    reference = decode(frame)
    ignored = []
    for pos in range(HEADER_BYTES, len(frame)):
        for bit in range(8):
            bad = bytearray(frame)
            bad[pos] ^= 1 << bit
            bad = bytes(bad)
            out = sentinel(n)
            before = out.tobytes()
            try:
                decode_into(bad, out, accumulate=False)
            except CodecError as e:
                assert out.tobytes() == before
                assert any(w in str(e) for w in ("corrupt", "truncated", "declares", "stray")), str(
                    e
                )
            else:
                assert same_bits(out, reference), f"byte {pos} bit {bit}: silently different values"
                ignored.append((pos, bit))
    # Only the zstd frame header descriptor's unused bit (bit 4) may be ignored.
    assert set(ignored) <= {(HEADER_BYTES + 4, 4)}


def test_rejects_stray_bytes_after_the_body(good):
    _, n, frame = good
    for extra in [b"\0", b"junk", frame[HEADER_BYTES:]]:
        assert_rejected(frame + extra, f"{len(extra)} stray bytes after the frame body", n=n)


def test_rejects_count_not_matching_body(good):
    codec, n, frame = good
    block = 1 if codec == FP32 else BLOCK
    for m in [0, 1, n - 40, n + 40, 10 * n]:
        if body_bytes(codec, m) == body_bytes(codec, n):
            continue
        bad = HEADER.pack(b"ATLQ", codec, 1, block, m) + frame[HEADER_BYTES:]
        assert_rejected(
            bad, f"declares {body_bytes(codec, n)} bytes; {m} {codec.name} values need", n=m
        )
        with pytest.raises(CodecError, match="declares"):
            decode(bad)
    # A zstd frame without its content size is refused too (the size is checked up front).
    raw = body_of(frame)
    no_size = zstandard.ZstdCompressor(write_content_size=False, write_checksum=True).compress(raw)
    assert_rejected(frame[:HEADER_BYTES] + no_size, "declares -1 bytes", n=n)


def test_rejects_wrong_out_size_and_count(good):
    codec, n, frame = good
    for m in [n - 1, n + 1, 0]:
        out = np.full(m, 2.0, np.float32)
        with pytest.raises(CodecError, match=f"frame holds {n} values; out holds {m}"):
            decode_into(frame, out)
        assert np.all(out == 2.0)
        with pytest.raises(CodecError, match=f"frame holds {n} values; expected {m}"):
            decode(frame, num_values=m)
    assert decode(frame, num_values=n).size == n


def test_rejects_codec_mismatch(good):
    codec, n, frame = good
    for other in Codec:
        if other != codec:
            assert_rejected(frame, f"frame uses {codec.name}; expected {other.name}", codec=other)
            with pytest.raises(CodecError, match="expected"):
                decode(frame, codec=other)
    assert decode(frame, codec=codec).size == n


@pytest.mark.parametrize(
    "scale", [0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x8000, 0x8000 | 0x3F80, 0xFFFF]
)
@pytest.mark.parametrize("bad_block", [0, 2])
def test_rejects_invalid_int4_scale(scale, bad_block):
    n = 3 * BLOCK - 5
    scales = np.array([0x3F80, 0x3F80, 0x3F80], "<u2")
    scales[bad_block] = scale
    codes = np.random.default_rng(scale).integers(0, 256, 3 * BLOCK // 2, dtype=np.uint8)
    codes[2 * 16 + 11 :] &= 0x0F  # values 27..31 of the last block are padding: code 0
    frame = make_frame(INT4, n, scales.tobytes() + codes.tobytes())
    assert_rejected(frame, f"INT4 frame has an invalid scale .* in block {bad_block}")
    valid = make_frame(INT4, n, np.array([0x3F80] * 3, "<u2").tobytes() + codes.tobytes())
    assert np.isfinite(decode(valid)).all()


@pytest.mark.parametrize("bad_block", [0, 1, 2])
def test_rejects_invalid_mxfp4_scale(bad_block):
    n = 3 * BLOCK
    scales = np.array([127, 127, 127], np.uint8)
    scales[bad_block] = 0xFF
    codes = np.random.default_rng(bad_block).integers(0, 256, 3 * BLOCK // 2, dtype=np.uint8)
    assert_rejected(
        make_frame(MXFP4, n, scales.tobytes() + codes.tobytes()),
        f"MXFP4 frame has an invalid scale .* in block {bad_block}",
    )


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_rejects_non_finite_fp32_body(bad):
    x = np.ones(10, np.float32)
    x[3] = bad
    assert_rejected(make_frame(FP32, 10, x.astype("<f4").tobytes()), "non-finite")


@pytest.mark.parametrize(
    "codec, scale", [(MXFP4, b"\xfe"), (MXFP4, b"\xfd"), (INT4, struct.pack("<H", 0x7F7F))]
)
def test_rejects_frames_that_decode_to_inf(codec, scale):
    frame = make_frame(codec, BLOCK, scale + bytes([0x77] * 16))
    out = np.zeros(BLOCK, np.float32)
    with pytest.raises(CodecError):
        decode_into(frame, out)
    assert not out.any()


def test_decode_refuses_absurd_count_without_allocating():
    frame = encode(np.ones(100, np.float32))
    bad = HEADER.pack(b"ATLQ", INT4, 1, BLOCK, 1 << 40) + frame[HEADER_BYTES:]
    with pytest.raises(CodecError, match="declares"):
        decode(bad)


# ---- 6. encode refuses bad input ----


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("index", [0, 31, 32, 99, 100])
def test_encode_refuses_non_finite(codec, bad, index):
    x = np.random.default_rng(index).standard_normal(101).astype(np.float32)
    x[index] = bad
    x[-1] = bad  # only the first is named
    message = f"cannot encode non-finite value -?(nan|inf) at index {index}$"
    with pytest.raises(CodecError, match=message):
        encode(x, codec)


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32, ">f4"])
def test_encode_refuses_non_float32(codec, dtype):
    with pytest.raises(CodecError, match="must be float32"):
        encode(np.ones(10, dtype), codec)


# ---- 7, 8. proto enum and wire size ----


def test_codec_ids_equal_the_proto():
    assert syncer_pb2.CODEC_FP32 == Codec.FP32
    assert syncer_pb2.CODEC_MXFP4 == Codec.MXFP4
    assert syncer_pb2.CODEC_INT4 == Codec.INT4
    names = dict(syncer_pb2.Codec.items())
    assert names.pop("CODEC_UNSPECIFIED") == 0
    assert {k.removeprefix("CODEC_"): v for k, v in names.items()} == {
        c.name: c.value for c in Codec
    }


@pytest.mark.parametrize("codec", FOUR_BIT)
@pytest.mark.parametrize("data", ["gaussian", "scaled-rows", "laplace"])
def test_bits_per_parameter(codec, data):
    rng = np.random.default_rng(12)
    n = 1 << 20
    if data == "gaussian":
        x = rng.standard_normal(n)
    elif data == "scaled-rows":  # per-row magnitudes like a layer's gradient
        x = rng.standard_normal((1024, 1024)) * 10.0 ** rng.uniform(-4, 0, (1024, 1))
    else:
        x = rng.laplace(size=n)
    frame = encode(x.astype(np.float32), codec)
    bits = 8 * len(frame) / n
    assert bits <= 4.5, f"{bits:.3f} bits/param"


@pytest.mark.parametrize("codec", [INT4, MXFP4])
@pytest.mark.parametrize("n", [33, 40, 47, 48, 63])
def test_rejects_nonzero_padding(codec, n):
    """A frame relabelled to fewer values (same block count) must not decode silently."""
    frame = encode(np.linspace(-1, 1, 64, dtype=np.float32), codec)
    relabelled = frame[: HEADER_BYTES - 8] + struct.pack("<Q", n) + frame[HEADER_BYTES:]
    assert_rejected(relabelled, "padding", n=n)
    honest = encode(np.linspace(-1, 1, n, dtype=np.float32), codec)
    assert decode(honest).size == n


# ---- 9. chunked frames (version 2) ----


@pytest.fixture
def threads():
    """set_threads for one test; the old count comes back after it."""
    old = codec_module.get_threads()
    yield codec_module.set_threads
    codec_module.set_threads(old)


def big_vector(n: int, seed: int = 0) -> np.ndarray:
    """Gaussian values whose magnitude changes between chunks and within them."""
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 1, -(-n // 1000)).repeat(1000)[:n]
    ).astype(np.float32)


N3 = 2 * CHUNK_VALUES + 1000 + 7  # three chunks, the last with a tail block


@pytest.mark.parametrize("codec", list(Codec))
def test_chunk_layout(codec):
    x = big_vector(N3)
    frame = encode(x, codec)
    chunks = chunks_of(frame)
    assert len(chunks) == 3
    assert frame[HEADER_BYTES : HEADER_BYTES + 8] == struct.pack(
        "<2I", len(chunks[0]), len(chunks[1])
    )
    for i, c in enumerate(chunks):  # each chunk is the frame of its own values, less the header
        part = x[i * CHUNK_VALUES : (i + 1) * CHUNK_VALUES]
        assert c == encode(part, codec)[HEADER_BYTES:]
    assert same_bits(
        decode(frame),
        np.concatenate(
            [decode(encode(x[i * CHUNK_VALUES : (i + 1) * CHUNK_VALUES], codec)) for i in range(3)]
        ),
    )
    assert len(frame) <= max_frame_bytes(N3, codec)


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("n", [0, 1, 100, CHUNK_VALUES, CHUNK_VALUES + 1, N3])
def test_version_1_frames_still_decode(codec, n):
    """A shard may replay a log of version 1 frames: same values, norms and sums."""
    x = big_vector(n, seed=n)
    frame = encode(x, codec)
    old = v1_frame(frame)
    assert old[5] == 1 and frame[5] == 2
    assert same_bits(decode(old), decode(frame))
    if n <= CHUNK_VALUES:  # one chunk: a version 1 frame but for the version byte
        assert same_bits(decode(frame[:5] + b"\x01" + frame[6:]), decode(frame))
    offsets, ends = ragged_ranges(n, seed=n)
    assert (
        range_sq_norms(old, offsets, ends).tobytes()
        == range_sq_norms(frame, offsets, ends).tobytes()
    )
    a, b = sentinel(n), sentinel(n)
    accumulate_ranges(old, a, offsets, ends, np.linspace(-2, 3, len(offsets)))
    accumulate_ranges(frame, b, offsets, ends, np.linspace(-2, 3, len(offsets)))
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("codec", list(Codec))
def test_results_do_not_depend_on_threads(codec, threads):
    x = big_vector(N3, seed=1)
    r = big_vector(N3, seed=2) * np.float32(0.01)
    offsets, ends = ragged_ranges(N3, seed=3)
    scales = np.random.default_rng(4).uniform(-3, 3, len(offsets))
    scales[::5] = 0.0
    seen = set()
    for t in [1, 2, 3, 8]:
        threads(t)
        frame = encode(x, codec)
        ef = ErrorFeedback(N3, codec)
        ef.residual[...] = r
        ef_frame = ef.encode(x)
        codes = read_codes(frame)
        out = sentinel(N3)
        codes.accumulate_ranges(out, offsets, ends, scales)
        dec = sentinel(N3)
        decode_into(frame, dec, 0.75)
        seen.add(
            (
                frame,
                ef_frame,
                ef.residual.tobytes(),
                decode(frame).tobytes(),
                codes.range_sq_norms(offsets, ends).tobytes(),
                out.tobytes(),
                dec.tobytes(),
            )
        )
    assert len(seen) == 1


def test_concurrent_callers_share_the_threads(threads):
    threads(2)
    xs = [big_vector(CHUNK_VALUES + 5000, seed=s) for s in range(6)]
    serial = [encode(v) for v in xs]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert list(pool.map(encode, xs)) == serial
        assert all(same_bits(a, decode(f)) for a, f in zip(pool.map(decode, serial), serial))


@pytest.fixture(params=list(Codec), ids=lambda c: c.name)
def chunked(request):
    """(codec, n, frame) for a valid three-chunk frame."""
    return request.param, N3, encode(big_vector(N3, seed=5), request.param)


def test_rejects_truncated_chunked_frames(chunked):
    _, n, frame = chunked
    c0, c1, c2 = map(len, chunks_of(frame))
    table_end = HEADER_BYTES + 8
    cuts = [
        HEADER_BYTES,
        HEADER_BYTES + 3,
        table_end - 1,
        table_end,
        table_end + 5,
        table_end + c0 - 1,
        table_end + c0,
        table_end + c0 + c1,
        len(frame) - c2 + 1,
        len(frame) - 1,
    ]
    for cut in cuts:
        assert_rejected(frame[:cut], "truncated|corrupt", n=n)


def _pieces(frame: bytes, cut: int) -> list[bytes]:
    return [frame[i : i + cut] for i in range(0, len(frame), cut)]


def test_a_frame_read_in_the_pieces_it_arrived_in_is_the_frame(chunked):
    _, n, frame = chunked
    c0 = len(chunks_of(frame)[0])
    want = read_codes(frame)
    offsets, ends = ragged_ranges(n, seed=3)
    # pieces that split the header, the table, a chunk, or fall on a chunk's edge
    for cut in (1, 5, HEADER_BYTES + 3, HEADER_BYTES + 8 + c0, 4099, len(frame)):
        got = read_codes(_pieces(frame, cut) + [b""], num_values=n)
        assert got.info == want.info
        assert (
            got.range_sq_norms(offsets, ends).tobytes()
            == want.range_sq_norms(offsets, ends).tobytes()
        )
        out, again = np.zeros(n, np.float32), np.zeros(n, np.float32)
        got.decode_into(out, 1.0)
        want.decode_into(again, 1.0)
        assert out.tobytes() == again.tobytes()


def test_pieces_of_a_truncated_or_empty_frame_are_refused(chunked):
    _, n, frame = chunked
    for cut in (HEADER_BYTES + 3, HEADER_BYTES + 9, len(frame) - 1):
        with pytest.raises(CodecError, match="truncated|corrupt|shorter"):
            read_codes(_pieces(frame[:cut], 1000), num_values=n)
    with pytest.raises(CodecError, match="shorter than its"):
        read_codes([])


def test_rejects_bad_chunk_tables(chunked):
    _, n, frame = chunked
    c0, c1, _ = map(len, chunks_of(frame))
    rest = frame[HEADER_BYTES + 8 :]
    head = frame[:HEADER_BYTES]
    for sizes in [
        (0, c1),
        (c0, 0),
        (c0 - 1, c1),
        (c0 + 1, c1),
        (c1, c0),
        (c0, c1 + len(rest)),
        (2**32 - 1, 1),
    ]:
        if sizes == (c1, c0) and c0 == c1:
            continue
        assert_rejected(
            head + struct.pack("<2I", *sizes) + rest, "truncated|corrupt|declares|stray", n=n
        )
    assert_rejected(
        head + struct.pack("<I", c0) + rest, "truncated|corrupt|declares|stray", n=n
    )  # short table


def test_rejects_stray_bytes_after_the_last_chunk(chunked):
    _, n, frame = chunked
    assert_rejected(frame + b"junk", "4 stray bytes after the chunk 2", n=n)


def test_chunked_frame_bit_flips_are_caught(chunked):
    """Flips in the table, around each chunk's zstd header, and in each chunk's checksum.

    A flip may go unnoticed only in a zstd frame header where it cannot change values:
    the descriptor's unused bit, or a window descriptor asking for a larger window."""
    codec, n, frame = chunked
    reference = decode(frame)
    c0, c1, _ = map(len, chunks_of(frame))
    starts = [HEADER_BYTES + 8, HEADER_BYTES + 8 + c0, HEADER_BYTES + 8 + c0 + c1]
    positions = set(range(HEADER_BYTES, HEADER_BYTES + 8))
    for s in starts:
        positions |= set(range(s, s + 8))
    positions |= {s - k for s in starts[1:] + [len(frame)] for k in range(1, 5)}
    allowed = {(s + 4, 4) for s in starts} | {(s + 5, b) for s in starts for b in range(8)}
    for pos in sorted(positions):
        for bit in (0, 3, 4, 7):  # a sample, to stay fast
            bad = bytearray(frame)
            bad[pos] ^= 1 << bit
            out = sentinel(n)
            before = out.tobytes()
            try:
                decode_into(bytes(bad), out, accumulate=False)
            except CodecError as e:
                assert out.tobytes() == before
                assert any(w in str(e) for w in ("corrupt", "truncated", "declares", "stray")), str(
                    e
                )
            else:
                assert same_bits(out, reference) and (pos, bit) in allowed, f"byte {pos} bit {bit}"


@pytest.mark.parametrize("codec", FOUR_BIT)
def test_bad_scale_in_a_later_chunk_names_its_block(codec):
    x = big_vector(N3, seed=6)
    frame = encode(x, codec)
    chunks = chunks_of(frame)
    body = bytearray(zstandard.ZstdDecompressor().decompress(chunks[1]))
    body[2 * 7 : 2 * 7 + 2] = (
        b"\x80\x7f" if codec == INT4 else b"\xff\xff"
    )  # block 7 (int4) / 14 (mxfp4)
    bad_chunk = zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(
        bytes(body)
    )
    bad = (
        frame[:HEADER_BYTES]
        + struct.pack("<2I", len(chunks[0]), len(bad_chunk))
        + chunks[0]
        + bad_chunk
        + chunks[2]
    )
    block = CHUNK_VALUES // BLOCK + (7 if codec == INT4 else 14)
    assert_rejected(bad, f"invalid scale .* in block {block}$")
    with pytest.raises(CodecError, match=f"block {block}"):
        read_codes(bad)
    out = sentinel(N3)
    with pytest.raises(CodecError):
        accumulate_ranges(bad, out, [0], [N3], [1.0])
    assert same_bits(out, sentinel(N3))


def test_refuses_absurd_chunk_count_without_allocating():
    frame = encode(np.ones(100, np.float32))
    bad = HEADER.pack(b"ATLQ", INT4, 2, BLOCK, 1 << 40) + frame[HEADER_BYTES:]
    with pytest.raises(CodecError, match="truncated frame: 1099511627776 values need a table"):
        decode(bad)


@pytest.mark.parametrize("codec", list(Codec))
def test_max_frame_bytes_bounds_incompressible_frames(codec):
    rng = np.random.default_rng(7)
    n = CHUNK_VALUES + 333
    if codec == FP32:
        x = rng.integers(0, 2**31, n, dtype=np.uint32).view(np.float32)  # random positive floats
        x[~np.isfinite(x)] = 1.0
    else:
        x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-30, 30, n)).astype(np.float32)
    frame = encode(x, codec)
    assert len(frame) <= max_frame_bytes(n, codec)


# ---- 10. merge kernels: range_sq_norms and accumulate_ranges ----


def ragged_ranges(n: int, seed: int = 0, count: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """Ordered ranges that ignore block and chunk boundaries, with gaps and empty ranges."""
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rng = np.random.default_rng(seed)
    cuts = np.sort(np.concatenate([[0, n], rng.integers(0, n + 1, 2 * count - 2)]))
    offsets, ends = cuts[0::2], cuts[1::2]
    return offsets.astype(np.int64), ends.astype(np.int64)


def sq_norms_reference(values: np.ndarray, offsets, ends) -> np.ndarray:
    """The documented order, in numpy: per 32-value block a pairwise tree of float64 squares
    (lanes outside the range +0), block sums in order within a chunk, chunk sums in order."""
    out = []
    for o, e in zip(offsets.tolist(), ends.tolist()):
        total = 0.0
        for c0 in range(0, max(values.size, 1), CHUNK_VALUES):
            a, b = max(o, c0), min(e, c0 + CHUNK_VALUES)
            part = 0.0
            if a < b:
                b0, b1 = a // BLOCK, -(-b // BLOCK)
                sq = np.zeros((b1 - b0) * BLOCK)
                v = values[a:b].astype(np.float64)
                sq[a - b0 * BLOCK : b - b0 * BLOCK] = v * v
                t = sq.reshape(-1, BLOCK)
                while t.shape[1] > 1:
                    h = t.shape[1] // 2
                    t = t[:, :h] + t[:, h:]
                for block_sum in t[:, 0].tolist():
                    part += block_sum
            total += part
        out.append(total)
    return np.array(out)


def add_scaled_reference(out: np.ndarray, values: np.ndarray, offsets, ends, scales) -> None:
    for o, e, s in zip(
        offsets.tolist(), ends.tolist(), np.asarray(scales, np.float64).astype(np.float32)
    ):
        if s != 0:
            t = values[o:e] * s  # multiply, then add: two float32 roundings
            out[o:e] = out[o:e] + t


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("n", [1, 31, 33, 5000, N3])
def test_range_sq_norms_follow_the_documented_order(codec, n):
    x = big_vector(n, seed=n)
    frame = encode(x, codec)
    values = decode(frame)
    offsets, ends = ragged_ranges(n, seed=n)
    got = range_sq_norms(frame, offsets, ends)
    assert got.dtype == np.float64
    assert got.tobytes() == sq_norms_reference(values, offsets, ends).tobytes()
    # From the decoded float32 vector: the same bits (4-bit block sums are exact).
    assert got.tobytes() == Codes.of_values(values).range_sq_norms(offsets, ends).tobytes()
    exact = [np.sum(values[o:e].astype(np.float64) ** 2) for o, e in zip(offsets, ends)]
    np.testing.assert_allclose(got, exact, rtol=1e-13)


@pytest.mark.parametrize("codec", FOUR_BIT)
def test_block_sums_of_squares_are_exact(codec):
    """Values at the extremes of the scale range: each block's sum is exact in float64."""
    x = np.concatenate(
        [
            np.full(BLOCK, 3e38, np.float32),
            np.full(BLOCK, 1e-40, np.float32),
            np.linspace(-1e30, 1e30, BLOCK, dtype=np.float32),
        ]
    )
    frame = encode(x, codec)
    values = decode(frame).astype(np.float64)
    got = range_sq_norms(
        frame, [0, BLOCK, 2 * BLOCK, 2 * BLOCK + 3], [BLOCK, 2 * BLOCK, 2 * BLOCK + 3, 3 * BLOCK]
    )
    import fractions

    for g, (a, b) in zip(got, [(0, 32), (32, 64), (64, 67), (67, 96)]):
        exact = sum(fractions.Fraction(float(v)) ** 2 for v in values[a:b])
        assert fractions.Fraction(float(g)) == exact
    assert np.all(np.isfinite(got))


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("n", [1, 31, 33, 5000, N3])
def test_accumulate_ranges_matches_numpy_bit_for_bit(codec, n):
    x = big_vector(n, seed=n + 1)
    frame = encode(x, codec)
    values = decode(frame)
    offsets, ends = ragged_ranges(n, seed=n + 2)
    rng = np.random.default_rng(n)
    scales = rng.uniform(-5, 5, len(offsets)) * 10.0 ** rng.uniform(-6, 3, len(offsets))
    scales[::4] = 0.0
    out = sentinel(n)
    want = out.copy()
    add_scaled_reference(want, values, offsets, ends, scales)
    accumulate_ranges(frame, out, offsets, ends, scales)
    assert out.tobytes() == want.tobytes()  # gaps between ranges untouched, too
    again = sentinel(n)
    Codes.of_values(values).accumulate_ranges(again, offsets, ends, scales)
    assert again.tobytes() == want.tobytes()


def test_range_arguments_are_checked():
    frame = encode(np.ones(100, np.float32))
    out = np.zeros(100, np.float32)
    for offsets, ends, match in [
        ([0, 50], [60, 100], "ordered"),
        ([10], [5], "ordered"),
        ([-1], [5], "ordered"),
        ([0], [101], "within"),
        ([[0]], [[5]], "1-D"),
        ([0, 1], [1], "1-D"),
    ]:
        with pytest.raises(CodecError, match=match):
            range_sq_norms(frame, offsets, ends)
        with pytest.raises(CodecError, match=match):
            accumulate_ranges(frame, out, offsets, ends, np.ones(len(offsets)))
    with pytest.raises(CodecError, match="2 scales for 1 ranges"):
        accumulate_ranges(frame, out, [0], [100], [1.0, 2.0])
    with pytest.raises(CodecError, match="out holds 99"):
        accumulate_ranges(frame, np.zeros(99, np.float32), [0], [100], [1.0])
    for bad in [np.nan, np.inf, 1e39]:
        with pytest.raises(CodecError, match="not finite in float32"):
            accumulate_ranges(frame, out, [0, 50], [50, 100], [1.0, bad])
    assert not out.any()
    assert range_sq_norms(frame, [], []).size == 0


@pytest.mark.parametrize("codec", list(Codec))
def test_accumulate_refuses_overflow_and_changes_nothing(codec):
    n = CHUNK_VALUES + 100
    x = np.full(n, 1.0, np.float32)
    x[-50] = 3e38  # in the last chunk, in range 1
    frame = encode(x, codec)
    out = np.zeros(n, np.float32)
    out[-50] = 3e38
    before = out.tobytes()
    with pytest.raises(
        CodecError, match=f"adding range 1 .* would overflow float32 at index {n - 50}"
    ):
        accumulate_ranges(frame, out, [0, 10], [10, n], [1.0, 1.0])
    assert out.tobytes() == before
    # The same terms with room to spare, or scaled down, go in.
    accumulate_ranges(frame, out, [0, 10], [10, n], [1.0, -1.0])
    assert np.isfinite(out).all() and out.tobytes() != before
    big = np.zeros(n, np.float32)
    with pytest.raises(CodecError, match="overflow"):
        accumulate_ranges(frame, big, [0], [n], [2.0])  # 2 * 3e38 alone
    assert not big.any()
    # The shard's order: norms first (their pass also bounds every range), then the merge,
    # which takes those bounds instead of reading the scales again: the same refusal.
    codes = read_codes(frame)
    codes.range_sq_norms([0, 10], [10, n])
    with pytest.raises(
        CodecError, match=f"adding range 1 .* would overflow float32 at index {n - 50}"
    ):
        codes.accumulate_ranges(
            np.asarray(np.frombuffer(before, np.float32)).copy(), [0, 10], [10, n], [1.0, 1.0]
        )
    codes.range_sq_norms([0], [n])  # other ranges: their own bounds
    with pytest.raises(CodecError, match="overflow"):
        codes.accumulate_ranges(big, [0], [n], [2.0])
    assert not big.any()


@pytest.mark.parametrize("codec", list(Codec))
def test_accumulate_without_add_writes_what_adding_into_zeros_gives(codec):
    n = CHUNK_VALUES + 700
    x = big_vector(n, seed=11)
    x[:64] = -0.0  # FP32 keeps negative zeros: 0 + (-0) is +0, and so is the write
    codes = read_codes(encode(x, codec))
    offsets, ends = ragged_ranges(n, seed=12)
    tiled_o = np.concatenate([[0], ends[:-1]])  # ranges that tile [0, ends[-1])
    scales = np.random.default_rng(13).uniform(0.5, 2.0, len(ends))
    scales[::5] = 0.0  # zero scales write zeros
    want = np.zeros(n, np.float32)
    codes.accumulate_ranges(want, tiled_o, ends, scales)
    got = np.full(n, np.nan, np.float32)  # whatever the buffer held before is never read
    got[ends[-1] :] = 0.0
    codes.accumulate_ranges(got, tiled_o, ends, scales, add=False)
    assert got.tobytes() == want.tobytes()
    # the overflow check looks at the new terms alone, not at what the buffer held
    y = np.full(n, 1.0, np.float32)
    y[-50] = 3e38
    big = read_codes(encode(y, codec))
    out = np.full(n, 3e38, np.float32)
    big.accumulate_ranges(out, [0], [n], [1.0], add=False)
    assert np.isfinite(out).all()
    with pytest.raises(CodecError, match="overflow"):
        big.accumulate_ranges(out, [0], [n], [2.0], add=False)


@pytest.mark.parametrize("codec", list(Codec))
def test_range_max_abs_is_exact(codec):
    x = big_vector(N3, seed=8)
    frame = encode(x, codec)
    values = np.abs(decode(frame))
    offsets, ends = ragged_ranges(N3, seed=9)
    want = [values[o:e].max(initial=0.0) for o, e in zip(offsets, ends)]
    assert read_codes(frame).range_max_abs(offsets, ends).tolist() == want


def test_range_sq_norms_are_reused_for_the_same_ranges_and_never_shared():
    values = np.arange(1, 1001, dtype=np.float32)
    codes = read_codes(encode(values, Codec.INT4))
    first = codes.range_sq_norms([0, 500], [500, 1000])
    first[:] = -1  # the caller's copy: the next answer is untouched
    again = codes.range_sq_norms([0, 500], [500, 1000])
    fresh = read_codes(encode(values, Codec.INT4)).range_sq_norms([0, 500], [500, 1000])
    assert again.tobytes() == fresh.tobytes() and np.all(again > 0)
    other = codes.range_sq_norms([0], [1000])  # other ranges: computed, not the cached ones
    assert other.tolist() == [pytest.approx(float(fresh.sum()))]
