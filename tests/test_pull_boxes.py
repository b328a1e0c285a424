"""Pulls by boxes (proto `PullRequest.boxes`): a process of a sharded learner pulls only the
elements it holds. The layout of boxes in a fragment, a delta's blocks gathered without
re-quantising, and the shard on in-memory storage answering pulls by boxes with the bits
of a whole pull, delta chain and snapshot, in every publish codec."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from test_shard_memory import Clock, MemoryLog, MemorySnapshots

from atoll.server.config import ShardConfig
from atoll.server.parts import Box
from atoll.server.refusal import Why
from atoll.server.shard import PushHeader, Shard, ShardError
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import Pulled, apply_boxes
from atoll.wire.parts import BoxLayout
from atoll.wire.plan import FragmentPlan, TensorSpec

# sizes that cut 32-value blocks everywhere, a scalar, and a fragment ending mid-block
SHAPES = ((37, 19), (5,), (3, 7, 11), (), (64, 40))
PLAN = FragmentPlan.build([TensorSpec(f"t{i}", s) for i, s in enumerate(SHAPES)], 1)
ORDER = [tuple(s.spec.shape) for s in PLAN.tensors_of(0)]  # the fragment's tensor order
SIZE = PLAN.fragment_sizes[0]


def _split(rng: np.random.Generator, ways: int) -> list[list[tuple[int, tuple, tuple]]]:
    """Each tensor cut into a random grid; each cell given to one of `ways` processes."""
    out: list[list[tuple[int, tuple, tuple]]] = [[] for _ in range(ways)]
    for t, shape in enumerate(ORDER):
        if not shape:
            out[int(rng.integers(ways))].append((t, (), ()))
            continue
        cuts = [
            sorted({0, n, *rng.integers(1, n, size=int(rng.integers(0, 3))).tolist()})
            if n > 1
            else [0, n]
            for n in shape
        ]
        grid = np.stack(np.meshgrid(*[np.arange(len(c) - 1) for c in cuts], indexing="ij"), -1)
        for cell in grid.reshape(-1, len(shape)):
            start = tuple(cuts[d][i] for d, i in enumerate(cell))
            stop = tuple(cuts[d][i + 1] for d, i in enumerate(cell))
            out[int(rng.integers(ways))].append((t, start, stop))
    for boxes in out:
        rng.shuffle(boxes)  # boxes in any order, not the fragment's
    return out


def _elements(vector: np.ndarray, boxes) -> np.ndarray:
    """The boxes' elements of a fragment vector, box after box, each in C order."""
    offsets = np.cumsum([0] + [math.prod(s) for s in ORDER])
    pieces = []
    for t, start, stop in boxes:
        tensor = vector[offsets[t] : offsets[t + 1]].reshape(ORDER[t])
        index = tuple(slice(a, b) for a, b in zip(start, stop)) if start else ...
        pieces.append(tensor[index].reshape(-1))
    return np.concatenate(pieces) if pieces else np.zeros(0, vector.dtype)


# --- the layout and the codec ---


def test_a_layout_lists_the_boxes_elements_in_part_order():
    rng = np.random.default_rng(0)
    for _ in range(20):
        for boxes in _split(rng, 3):
            lay = BoxLayout.of(ORDER, boxes)
            want = _elements(np.arange(SIZE, dtype=np.int64), boxes)
            np.testing.assert_array_equal(lay.index(), want)
            assert lay.size == want.size and lay.fragment_size == SIZE


@pytest.mark.parametrize("codec_id", [codec.Codec.INT4, codec.Codec.MXFP4, codec.Codec.FP32])
def test_gathered_blocks_decode_to_the_bits_of_the_whole_frame(codec_id):
    n = codec.CHUNK_VALUES + 3 * codec.BLOCK + 5  # two chunks, a short last block
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    frame = codec.encode(x, codec_id)
    block = codec.frame_info(frame).block
    total = -(-n // block)
    rng = np.random.default_rng(2)
    for blocks in (
        np.arange(total),
        np.array([0, total - 1]),
        np.unique(rng.integers(0, total, 500)),
        np.array([codec.CHUNK_VALUES // block - 1, codec.CHUNK_VALUES // block]),
    ):
        got = codec.decode(codec.gather_blocks(frame, blocks))
        index = (blocks[:, None] * block + np.arange(block)).reshape(-1)
        want = codec.decode(frame)[index[index < n]]
        assert got.tobytes() == want.tobytes()
    with pytest.raises(codec.CodecError, match="increasing"):
        codec.gather_blocks(frame, [3, 2])
    with pytest.raises(codec.CodecError, match="within"):
        codec.gather_blocks(frame, [total])


@pytest.mark.parametrize("codec_id", [codec.Codec.INT4, codec.Codec.MXFP4])
def test_gathered_codes_decode_to_the_bits_of_the_whole_frame(codec_id):
    n = codec.CHUNK_VALUES + 3 * codec.BLOCK + 5
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    frame = codec.encode(x, codec_id)
    total = -(-n // codec.BLOCK)
    rng = np.random.default_rng(4)
    for blocks in (np.arange(total), np.unique(rng.integers(0, total, 900)), np.array([total - 1])):
        index = (blocks[:, None] * codec.BLOCK + np.arange(codec.BLOCK)).reshape(-1)
        wanted = (rng.random(index.size) < 0.6) & (index < n)
        m = int(np.count_nonzero(index < n))
        got = codec.decode(
            codec.read_gathered(codec.gather_codes(frame, blocks, wanted), m, wanted)
        )
        want = codec.decode(frame)[index[index < n]]
        keep = wanted[:m]
        assert got[keep].tobytes() == want[keep].tobytes()
        assert not got[~keep].any()
    payload = codec.gather_codes(frame, np.array([0, 1]), np.ones(64, bool))
    with pytest.raises(codec.CodecError, match="expected"):
        codec.read_gathered(payload, 64, np.ones(96, bool))
    with pytest.raises(codec.CodecError):
        codec.read_gathered(payload[:-3], 64, np.ones(64, bool))


@pytest.mark.parametrize("codec_id", [codec.Codec.INT4, codec.Codec.MXFP4])
@pytest.mark.parametrize("n", [1, 33, 4095, codec.CHUNK_VALUES + 3 * codec.BLOCK + 5])
def test_a_gathered_frame_of_every_value_reads_as_with_its_mask(codec_id, n):
    # wanted None (a pull by boxes in fragment order): the same codes, bit for bit, read
    # into one buffer with no array of the values' size beside it
    frame = codec.encode(np.random.default_rng(n).standard_normal(n).astype(np.float32), codec_id)
    blocks = np.arange(-(-n // codec.BLOCK))
    wanted = np.arange(blocks.size * codec.BLOCK) < n
    payload = codec.gather_codes(frame, blocks, wanted)
    tracemalloc.start()
    try:
        got = codec.read_gathered(payload, n)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    want = codec.read_gathered(payload, n, wanted)
    assert [(c.start, c.count, bytes(c.scales), bytes(c.codes)) for c in got._chunks] == [
        (c.start, c.count, bytes(c.scales), bytes(c.codes)) for c in want._chunks
    ]
    assert codec.decode(got).tobytes() == codec.decode(frame).tobytes()
    assert peak <= 0.2 * 4 * n + (32 << 10)  # its buffer (~0.14 x float32's) and scratch
    mid = (21 + len(payload)) // 2  # a byte of the zstd frame, past the 21-byte header
    flipped = payload[:mid] + bytes([payload[mid] ^ 1]) + payload[mid + 1 :]
    for bad in (payload[:-3], payload + b"\0", flipped):
        with pytest.raises(codec.CodecError):
            codec.read_gathered(bad, n)
    with pytest.raises(codec.CodecError, match="expected"):
        codec.read_gathered(payload, n + codec.BLOCK)


# --- the shard, on a fake clock and in-memory storage ---


def _shard(publish: codec.Codec) -> Shard:
    cfg = ShardConfig(
        shard_index=0,
        num_shards=1,
        data_dir=__import__("pathlib").Path("/nonexistent/memory"),
        quorum=1,
        grace_factor=0.0,
        delta_ring=8,
        publish_codec=publish,
    )
    shard = Shard(cfg, Clock(), log=MemoryLog(), snapshots=MemorySnapshots())
    shard.recover()
    seed = np.random.default_rng(7).standard_normal(SIZE).astype(np.float32)
    frame = codec.encode(seed, codec.Codec.FP32)
    shard.init("seed", 0, PLAN.fingerprint, PLAN.to_json(), frame, int(codec.Codec.FP32), SIZE)
    return shard


def _rounds(shard: Shard, rounds: int, first: int = 0) -> None:
    for r in range(first, first + rounds):
        delta = np.random.default_rng([9, r]).standard_normal(SIZE).astype(np.float32) * 0.01
        h = PushHeader(
            learner_id="la",
            fragment=0,
            base_version=r,
            seq=r + 1,
            inner_steps=4,
            tokens=400,
            codec=int(codec.Codec.INT4),
            num_params=SIZE,
            plan_fingerprint=PLAN.fingerprint,
        )
        assert shard.push(h, codec.encode(delta, codec.Codec.INT4)).accepted
    assert shard.fragments[0].version == first + rounds


def _pulled(shard: Shard, have: int | None, boxes=()) -> Pulled:
    version, snapshot, frames = shard.pull(0, have, tuple(Box(*b) for b in boxes))
    return Pulled(0, version, snapshot, SIZE, frames)


def _whole(shard: Shard, have: int | None, held: np.ndarray | None) -> np.ndarray:
    """What a learner holds after a whole pull (learner/fragment_sync.py's apply)."""
    pulled = _pulled(shard, have)
    if pulled.snapshot:
        return codec.decode(pulled.frames[0][2], num_values=SIZE).copy()
    out = held.copy()
    for _, frame_codec, frame in pulled.frames:
        codec.decode_into(frame, out, 1.0, codec=frame_codec)
    return out


@pytest.mark.parametrize("publish", [codec.Codec.INT4, codec.Codec.FP32])
def test_a_pull_by_boxes_gives_the_bits_of_the_same_elements_of_a_whole_pull(publish):
    shard = _shard(publish)
    held = {0: _whole(shard, None, None)}  # a whole learner's values at each version
    for v in range(1, 6):
        _rounds(shard, 1, first=v - 1)
        held[v] = _whole(shard, None, None)
    for v in range(5):  # the chain from any version rebuilds the same bits
        assert _whole(shard, v, held[v]).tobytes() == held[5].tobytes()
    rng = np.random.default_rng(3)
    for trial in range(6):
        ways = 1 + trial % 4
        processes = _split(rng, ways)
        for have in (None, 0, 2, 4, 5):
            union = np.zeros(SIZE, np.float32)
            for boxes in processes:
                if not boxes:
                    continue
                lay = BoxLayout.of(ORDER, boxes)
                pulled = _pulled(shard, have, boxes)
                assert pulled.snapshot == (have is None) and pulled.version == 5
                mine = None if have is None else _elements(held[have], boxes).copy()
                got = apply_boxes(pulled, lay, mine)
                assert got.tobytes() == _elements(held[5], boxes).tobytes()
                union[lay.index()] = got
            assert union.tobytes() == held[5].tobytes()  # complementary boxes: the whole


def test_deltas_need_the_values_they_apply_to_and_a_bad_frame_changes_nothing():
    shard = _shard(codec.Codec.INT4)
    _rounds(shard, 2)
    boxes = [(0, (0, 0), (10, 19))]
    lay = BoxLayout.of(ORDER, boxes)
    with pytest.raises(ValueError, match="need the values"):
        apply_boxes(_pulled(shard, 0, boxes), lay)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        apply_boxes(_pulled(shard, 0, boxes), lay, np.zeros(lay.size, np.float64))
    pulled = _pulled(shard, 0, boxes)
    bad = Pulled(0, 2, False, SIZE, [pulled.frames[0], (*pulled.frames[1][:2], b"ATLG")])
    held = np.ones(lay.size, np.float32)
    with pytest.raises(codec.CodecError):
        apply_boxes(bad, lay, held)
    assert (held == 1).all()


def test_a_delta_chain_pulled_by_boxes_carries_only_the_blocks_they_touch():
    shard = _shard(codec.Codec.INT4)
    _rounds(shard, 1)
    boxes = [(ORDER.index((64, 40)), (0, 0), (16, 40))]  # 640 elements: 20 blocks and an edge
    lay = BoxLayout.of(ORDER, boxes)
    (frame,) = [f for _, _, f in _pulled(shard, 0, boxes).frames]
    assert lay.delta_codes(frame).num_values == lay.gathered_size(codec.BLOCK) <= 640 + 32
    whole = _pulled(shard, 0).frames[0][2]
    assert len(frame) < len(whole) * 2 * lay.size / SIZE


@pytest.mark.parametrize(
    "boxes, match",
    [
        ([(0, (0, 0), (38, 19))], "exceeds"),
        ([(0, (0, 0), (10, 19)), (0, (9, 0), (20, 19))], "overlap"),
        ([(len(SHAPES), (), ())], "tensors"),
        ([(0, (0,), (5,))], "one bound per dimension"),
        ([(1, (3,), (3,))], "empty"),
    ],
)
def test_boxes_past_a_tensor_overlapping_or_of_no_tensor_are_refused(boxes, match):
    shard = _shard(codec.Codec.INT4)
    _rounds(shard, 1)
    for have in (None, 0):
        with pytest.raises(ShardError, match=match) as e:
            shard.pull(0, have, tuple(Box(*b) for b in boxes))
        assert e.value.why is Why.MALFORMED


def test_a_learner_can_name_boxes_as_the_wire_does():
    boxes = [pb.TensorBox(tensor=0, start=[1, 2], stop=[3, 5]), pb.TensorBox(tensor=1)]
    lay = BoxLayout.of(ORDER, boxes)
    assert (
        lay.index().tolist()
        == _elements(np.arange(SIZE), [(0, (1, 2), (3, 5)), (1, (), ())]).tolist()
    )


# --- bits per parameter a process pulls, on the `small` preset's plan at P = 4 ---


def _small_plan() -> FragmentPlan:
    D, F, V, L = 192, 768, 256, 4  # learner/trainer/model.py PRESETS["small"]
    specs = [TensorSpec("embed/tokens", (V, D)), TensorSpec("final_norm/scale", (D,))]
    specs.append(TensorSpec("head/w", (D, V)))
    for i in range(L):
        b = f"blocks/{i}"
        specs += [TensorSpec(f"{b}/attn/{w}", (D, D)) for w in ("wq", "wk", "wv", "wo")]
        specs += [TensorSpec(f"{b}/attn_norm/scale", (D,)), TensorSpec(f"{b}/mlp_norm/scale", (D,))]
        specs += [TensorSpec(f"{b}/mlp/w_in", (D, F)), TensorSpec(f"{b}/mlp/w_out", (F, D))]
    return FragmentPlan.build(specs, 4)


def pulled_bits(ways: int, axis: int) -> tuple[float, float]:
    """(bits per parameter a process pulls by boxes, the same for a whole pull): every
    fragment of the small plan's delta, each tensor split `ways` ways along `axis` (its
    last dimension when the tensor has fewer), worst process."""
    plan = _small_plan()
    rng = np.random.default_rng(0)
    worst, whole_bits = 0.0, 0.0
    for p in range(plan.num_fragments):
        shapes = [tuple(s.spec.shape) for s in plan.tensors_of(p)]
        n = plan.fragment_sizes[p]
        params = rng.standard_normal(n).astype(np.float32) * 0.02
        published = params.copy()
        codec.encode_publish(params + rng.standard_normal(n).astype(np.float32) * 1e-3, published)
        frame = codec.encode_publish(
            params + rng.standard_normal(n).astype(np.float32) * 1e-3, published
        )
        whole_bits = max(whole_bits, 8 * len(frame) / n)
        for k in range(ways):
            boxes = []
            for t, shape in enumerate(shapes):
                d = min(axis, len(shape) - 1)
                step = shape[d] // ways
                start = [0] * len(shape)
                stop = list(shape)
                start[d], stop[d] = k * step, shape[d] if k == ways - 1 else (k + 1) * step
                boxes.append((t, tuple(start), tuple(stop)))
            lay = BoxLayout.of(shapes, boxes)
            worst = max(worst, 8 * len(lay.delta(frame)) / lay.size)
    return worst, whole_bits


@pytest.mark.parametrize("ways", [2, 4])
@pytest.mark.parametrize("axis", [0, 1])
def test_a_process_pulls_at_most_4_5_bits_per_parameter_it_holds(ways, axis):
    bits, whole = pulled_bits(ways, axis)
    assert bits <= 4.5, (ways, axis, bits, whole)
