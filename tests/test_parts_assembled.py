"""A push assembled from parts (server/parts.py `assembled_codes`, `Codes.decode_runs`):
each part decoded straight into its places in the fragment vector, and the merge reading
that vector with the parts' bounds gives the bits of the same values assembled by numpy."""

from __future__ import annotations

import numpy as np
import pytest

from atoll.server import parts
from atoll.server.parts import Box
from atoll.wire import codec
from atoll.wire.frames import CHUNK_VALUES
from atoll.wire.parts import BoxLayout

# a fragment of three tensors; the first spans two codec chunks, so runs cross chunk edges
SHAPES = ((520, 1001), (7, 5), (3,))
OFFSETS = np.cumsum([0] + [int(np.prod(s)) for s in SHAPES])
SIZE = int(OFFSETS[-1])
# three processes: the big tensor split by columns (a run per row, none block-aligned)
# and by rows, the small ones whole in one part or the other
LAYOUT = (
    (Box(0, (0, 0), (300, 333)), Box(2)),
    (Box(0, (0, 333), (300, 1001)), Box(1, (0, 0), (4, 5))),
    (Box(0, (300, 0), (520, 1001)), Box(1, (4, 0), (7, 5))),
)


def _values(delta, boxes):
    out = []
    for b in boxes:
        shape = SHAPES[b.tensor]
        tensor = delta[OFFSETS[b.tensor] : OFFSETS[b.tensor] + int(np.prod(shape))].reshape(shape)
        out.append(b.view(tensor).reshape(-1))
    return np.concatenate(out)


def _held(delta, codec_id):
    held = parts.PartSet(1, {"parts": len(LAYOUT)}, {}, {}, 0.0)
    for k, boxes in enumerate(LAYOUT):
        held.boxes[k], held.frames[k] = boxes, codec.encode(_values(delta, boxes), codec_id)
    return held


def _reference(held):
    """The parts decoded whole, then placed by numpy (`parts.assemble`)."""
    out = np.full(SIZE, np.nan, np.float32)
    for k, boxes in held.boxes.items():
        parts.assemble(out, OFFSETS[:-1].tolist(), SHAPES, boxes, codec.decode(held.frames[k]))
    return out


@pytest.mark.parametrize("codec_id", [codec.Codec.INT4, codec.Codec.MXFP4, codec.Codec.FP32])
def test_parts_decoded_in_place_merge_to_the_bits_of_the_values_assembled_by_numpy(codec_id):
    assert SIZE > CHUNK_VALUES
    delta = np.random.default_rng(0).standard_normal(SIZE, dtype=np.float32)
    held = _held(delta, codec_id)
    want = _reference(held)
    out = np.full(SIZE, np.nan, np.float32)
    got = parts.assembled_codes(held, out, SHAPES, OFFSETS[:-1], OFFSETS[1:])
    ref = codec.Codes.of_values(want)
    o, e = OFFSETS[:-1], OFFSETS[1:]
    assert got.range_sq_norms(o, e).tobytes() == ref.range_sq_norms(o, e).tobytes()
    scales = np.array([0.5, 3.0, 1e-3])
    acc_got, acc_ref = np.ones(SIZE, np.float32), np.ones(SIZE, np.float32)
    got.accumulate_ranges(acc_got, o, e, scales)
    ref.accumulate_ranges(acc_ref, o, e, scales)
    assert acc_got.tobytes() == acc_ref.tobytes()
    got.accumulate_ranges(acc_got, o, e, scales, add=False)  # a round's first push
    ref.accumulate_ranges(acc_ref, o, e, scales, add=False)
    assert acc_got.tobytes() == acc_ref.tobytes()
    # the bounds it carries bound every tensor's values, as a whole push's scales would
    assert np.all(got._vouched[2] >= ref.range_max_abs(o, e))
    assert not got._filled  # norms and sums read the parts' codes, not `out`
    # any other read has every value written first: the values numpy assembles
    values = np.empty(SIZE, np.float32)
    got.decode_into(values, accumulate=False)
    assert values.tobytes() == want.tobytes() == out.tobytes()


def test_vouched_bounds_still_refuse_a_merge_that_would_overflow_and_write_nothing():
    delta = np.random.default_rng(1).standard_normal(SIZE, dtype=np.float32)
    held = _held(delta * np.float32(1e37), codec.Codec.INT4)
    got = parts.assembled_codes(held, np.empty(SIZE, np.float32), SHAPES, OFFSETS[:-1], OFFSETS[1:])
    acc = np.full(SIZE, 3e38, np.float32)
    assert not got._filled
    with pytest.raises(codec.CodecError, match="overflow"):
        got.accumulate_ranges(acc, OFFSETS[:-1], OFFSETS[1:], [1.0, 1.0, 1.0])
    assert np.all(acc == np.float32(3e38))


def test_decode_runs_refuses_runs_outside_out_or_out_of_order():
    codes = codec.read_codes(codec.encode(np.arange(64, dtype=np.float32), codec.Codec.INT4))
    out = np.zeros(100, np.float32)
    with pytest.raises(ValueError, match="outside out"):
        codes.decode_runs(out, [0], [90], [20])
    with pytest.raises(codec.CodecError, match="ascend"):
        codes.decode_runs(out, [10, 0], [0, 50], [10, 10])
    with pytest.raises(codec.CodecError, match="past"):
        codes.decode_runs(out, [60], [0], [10])
    codes.decode_runs(out, [3, 40], [70, 0], [30, 24])  # unaligned both ways
    values = codec.decode(codec.encode(np.arange(64, dtype=np.float32), codec.Codec.INT4))
    want = np.zeros(100, np.float32)
    want[70:100], want[0:24] = values[3:33], values[40:64]
    assert out.tobytes() == want.tobytes()


def test_a_layout_runs_cover_each_part_in_order():
    lay = BoxLayout.of(SHAPES, [(b.tensor, b.start, b.stop) for b in LAYOUT[1]])
    assert lay.size == parts.part_size(LAYOUT[1], SHAPES) and lay.starts.size == 300 + 1


def test_rows_that_start_on_a_block_have_their_sums_taken_as_decoded_with_the_same_norms():
    shapes = ((64, 96), (64,))
    offsets = np.array([0, 64 * 96, 64 * 96 + 64])
    layout = (
        (Box(0, (0, 0), (32, 96)), Box(1, (0,), (32,))),
        (Box(0, (32, 0), (64, 96)), Box(1, (32,), (64,))),
    )
    delta = np.random.default_rng(2).standard_normal(int(offsets[-1]), dtype=np.float32)
    held = parts.PartSet(1, {"parts": 2}, {}, {}, 0.0)
    want = np.empty_like(delta)
    for k, boxes in enumerate(layout):
        values = np.concatenate(
            [
                b.view(
                    delta[offsets[b.tensor] : offsets[b.tensor + 1]].reshape(shapes[b.tensor])
                ).reshape(-1)
                for b in boxes
            ]
        )
        held.boxes[k], held.frames[k] = boxes, codec.encode(values, codec.Codec.INT4)
        parts.assemble(want, offsets[:-1].tolist(), shapes, boxes, codec.decode(held.frames[k]))
    out = np.full_like(delta, np.nan)
    got = parts.assembled_codes(held, out, shapes, offsets[:-1], offsets[1:])
    assert np.all(got._known >= 0)  # every block filled by one block of a part
    assert np.isnan(out).all()  # none written: the merge reads the parts' codes
    o, e = offsets[:-1], offsets[1:]
    assert (
        got.range_sq_norms(o, e).tobytes()
        == codec.Codes.of_values(want).range_sq_norms(o, e).tobytes()
    )


@pytest.mark.parametrize("kernel", ["decode_runs", "accumulate_runs"])
def test_a_run_outside_the_fragment_vector_is_refused_and_writes_nothing(kernel):
    from atoll.wire import _kernels

    values = np.arange(4, dtype=np.float32)
    out = np.full(8, 7.0, np.float32)
    i64 = lambda *a: np.array(a, np.int64)  # noqa: E731
    runs = (i64(0), i64(6), i64(4))  # 4 values at 6: past out's 8
    extra = (np.ones(1, np.float32), out, True) if kernel == "accumulate_runs" else (out,)
    with pytest.raises(ValueError, match=r"run 0 \(\[0, \+4\) to 6\) lies outside out"):
        getattr(_kernels, kernel)(_kernels.FP32, b"", values.tobytes(), 4, 0, *runs, *extra)
    assert (out == 7.0).all()
