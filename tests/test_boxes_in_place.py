"""learner/boxes.py's apply_in_place: a pull by boxes in fragment order (an FSDP shard's
rows) decodes straight onto the held vector, bit for bit what wire.client.apply_boxes
gives, and declines boxes out of that order (columns) without touching anything."""

from __future__ import annotations

import numpy as np
import pytest

from atoll.learner.boxes import apply_in_place, in_fragment_order
from atoll.wire import codec
from atoll.wire.client import Pulled, apply_boxes
from atoll.wire.parts import BoxLayout

SHAPES = [(8, 64), (32,), (4, 96), (3, 7)]  # at 0, 512, 544, 928; 949 values


def _pulled(layout: BoxLayout, deltas: list[np.ndarray], c: codec.Codec) -> Pulled:
    frames = [(v + 1, c, layout.delta(codec.encode(d, c))) for v, d in enumerate(deltas)]
    return Pulled(0, len(deltas), False, layout.fragment_size, frames)


@pytest.mark.parametrize("c", [codec.Codec.INT4, codec.Codec.FP32])
def test_rows_decode_in_place_as_apply_boxes_does(c: codec.Codec) -> None:
    # rows 4..7 of tensor 0, all of the 1-D one, rows 2..3 of tensor 2, all of tensor 3
    # (it ends the fragment, mid-block)
    boxes = [(0, (4, 0), (8, 64)), (1, (0,), (32,)), (2, (2, 0), (4, 96)), (3, (0, 0), (3, 7))]
    layout = BoxLayout.of(SHAPES, boxes)
    assert in_fragment_order(layout, codec.BLOCK) and in_fragment_order(layout, 1)
    rng = np.random.default_rng(0)
    deltas = [rng.normal(size=layout.fragment_size).astype(np.float32) for _ in range(3)]
    held = rng.normal(size=layout.size).astype(np.float32)
    want = apply_boxes(_pulled(layout, deltas, c), layout, held.copy())
    assert apply_in_place(_pulled(layout, deltas, c), layout, held)
    assert held.tobytes() == want.tobytes()


def test_a_box_starting_mid_block_is_left_to_apply_boxes() -> None:
    shapes = [(5,), (2, 64)]  # the second tensor starts at value 5, mid-block
    layout = BoxLayout.of(shapes, [(1, (0, 0), (1, 64))])
    assert in_fragment_order(layout, 1) and not in_fragment_order(layout, codec.BLOCK)
    delta = np.ones(133, np.float32)
    held = np.zeros(64, np.float32)
    assert not apply_in_place(_pulled(layout, [delta], codec.Codec.INT4), layout, held)
    assert not held.any()
    assert apply_in_place(_pulled(layout, [delta], codec.Codec.FP32), layout, held)
    assert (held == 1).all()


def test_columns_and_bad_frames_change_nothing() -> None:
    rng = np.random.default_rng(1)
    columns = BoxLayout.of(SHAPES, [(0, (0, 16), (8, 48))])  # mid-block
    assert not in_fragment_order(columns, codec.BLOCK)
    held = rng.normal(size=columns.size).astype(np.float32)
    before = held.copy()
    delta = rng.normal(size=columns.fragment_size).astype(np.float32)
    assert not apply_in_place(_pulled(columns, [delta], codec.Codec.INT4), columns, held)
    assert held.tobytes() == before.tobytes()
    rows = BoxLayout.of(SHAPES, [(0, (0, 0), (4, 64))])
    held = rng.normal(size=rows.size).astype(np.float32)
    before = held.copy()
    good = rows.delta(codec.encode(delta))
    pulled = Pulled(0, 2, False, rows.fragment_size, [(1, codec.Codec.INT4, good)])
    pulled.frames.append((2, codec.Codec.INT4, good[:-3]))  # truncated: the second is bad
    with pytest.raises(codec.CodecError):
        apply_in_place(pulled, rows, held)
    assert held.tobytes() == before.tobytes()
