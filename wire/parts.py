"""A push in parts on the wire (proto `PushHeader.parts`, `part`, `boxes`): what each
process of a sharded learner sends of a fragment.

Each process pushes one part: the same header as every other part of the push but for
`part` (its index) and `boxes` (the tensor pieces it carries), with a frame of those
pieces' values, box after box, each in C order. A jax shard's `index` is such a piece
already: `tensor_box(t, shard.index, leaf.shape)` names it, and
`np.asarray(shard.data).reshape(-1)` is its values. A replicated leaf goes in one part
only (a box with no bounds: the whole tensor). The shard merges the push once its parts
cover the fragment exactly; it refuses overlaps, gaps and boxes past a tensor.

A pull by boxes (proto `PullRequest.boxes`) asks for the same pieces back: a snapshot
holds their values in the same order; a delta holds the fragment's blocks that the boxes
touch, whole with their scales, so each value decodes to exactly what a whole pull gives.
`BoxLayout` says where a part's values lie in the fragment and in such a delta.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb

# A box as plain values: (tensor, start, stop), bounds along every dimension or both empty.
Bounds = tuple[int, Sequence[int], Sequence[int]]


def tensor_box(tensor: int, index: Sequence[slice] | None, shape: Sequence[int]) -> pb.TensorBox:
    """The box of `tensor` (its position in the fragment, `FragmentPlan.tensors_of` order)
    that `index`, slices of an array of `shape` (a jax shard's `index`), selects; None:
    the whole tensor.

    Example:
      >>> b = tensor_box(1, (slice(None), slice(4, 8)), (16, 8))
      >>> (b.tensor, list(b.start), list(b.stop))
      (1, [0, 4], [16, 8])
    """
    if index is None:
        return pb.TensorBox(tensor=tensor)
    if len(index) != len(shape):
        raise ValueError(f"index {index} of {len(index)} slices for a tensor of shape {shape}")
    start, stop = [], []
    for s, n in zip(index, shape):
        a, b, step = s.indices(n)
        if step != 1 or a >= b:
            raise ValueError(f"index {index}: a box takes non-empty slices with step 1")
        start.append(a)
        stop.append(b)
    return pb.TensorBox(tensor=tensor, start=start, stop=stop)


def _runs(
    offset: int, shape: Sequence[int], start: Sequence[int], stop: Sequence[int]
) -> tuple[np.ndarray, int]:
    """Flat starts of the box's runs of contiguous elements, in C order, and their length:
    trailing dimensions the box spans whole are one run with the last one it cuts."""
    if not start and not stop:
        start, stop = (0,) * len(shape), tuple(shape)
    if not shape:
        return np.array([offset], np.int64), 1
    k = len(shape) - 1  # the outermost dimension of the run
    while k > 0 and start[k] == 0 and stop[k] == shape[k]:
        k -= 1
    strides = [math.prod(shape[j + 1 :]) for j in range(len(shape))]
    starts = np.array([offset + start[k] * strides[k]], np.int64)
    for j in range(k - 1, -1, -1):  # outer dimensions: one run per index
        starts = (
            np.arange(start[j], stop[j], dtype=np.int64)[:, None] * strides[j] + starts
        ).reshape(-1)
    return starts, (stop[k] - start[k]) * strides[k]


@dataclasses.dataclass(frozen=True)
class BoxLayout:
    """Where a part's values (its boxes', box after box, each in C order) lie in the flat
    vector of a fragment: runs of contiguous elements, in part order.

    Example:
      >>> lay = BoxLayout.of([(4, 8)], [(0, (0, 4), (4, 8))])  # columns 4..7 of a 4x8
      >>> lay.starts.tolist(), lay.lengths.tolist(), lay.size
      ([4, 12, 20, 28], [4, 4, 4, 4], 16)
    """

    starts: np.ndarray  # int64: flat index of each run's first element in the fragment
    lengths: np.ndarray  # int64: elements in each run
    fragment_size: int  # elements in the whole fragment

    @classmethod
    def of(
        cls, shapes: Sequence[Sequence[int]], boxes: Sequence[Bounds | pb.TensorBox]
    ) -> BoxLayout:
        """The layout of `boxes` in a fragment whose tensors have `shapes`, in order (the
        boxes already checked: within their tensors, not overlapping)."""
        offsets = np.cumsum([0] + [math.prod(s) for s in shapes]).tolist()
        starts, lengths = [], []
        for box in boxes:
            t, a, b = (box.tensor, box.start, box.stop) if isinstance(box, pb.TensorBox) else box
            s, n = _runs(offsets[t], tuple(shapes[t]), tuple(a), tuple(b))
            starts.append(s)
            lengths.append(np.full(s.size, n, np.int64))
        return cls(
            np.concatenate(starts) if starts else np.zeros(0, np.int64),
            np.concatenate(lengths) if lengths else np.zeros(0, np.int64),
            int(offsets[-1]),
        )

    @property
    def size(self) -> int:
        """Elements the boxes hold."""
        return int(self.lengths.sum())

    def _expand(self, first: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """first[r], first[r] + 1, ... counts[r] values for each run r, in order."""
        before = np.cumsum(counts) - counts
        return np.repeat(first - before, counts) + np.arange(int(counts.sum()), dtype=np.int64)

    def index(self) -> np.ndarray:
        """The flat fragment index of every value of the part, in part order."""
        return self._expand(self.starts, self.lengths)

    def blocks(self, block: int) -> np.ndarray:
        """The blocks of `block` values (from value 0) any box touches, increasing: what a
        delta pulled by these boxes holds (`codec.gather_blocks`)."""
        first = self.starts // block
        last = (self.starts + self.lengths - 1) // block
        return np.unique(self._expand(first, last - first + 1))

    def gathered_size(self, block: int) -> int:
        """Values in a frame of `blocks(block)` (the fragment's last block may be short)."""
        b = self.blocks(block)
        total = -(-self.fragment_size // block)
        short = total * block - self.fragment_size if b.size and b[-1] == total - 1 else 0
        return int(b.size * block - short)

    def delta(self, frame: codec.Frame) -> bytes:
        """A published delta restricted to these boxes: an FP32 frame of the blocks they
        touch (single values), or a 4-bit frame's scales of those blocks and codes of
        the boxes' values (`codec.gather_codes`)."""
        block = codec.frame_info(frame).block
        if block == 1:
            return codec.gather_blocks(frame, self.blocks(1))
        return codec.gather_codes(frame, self.blocks(block), self._wanted(block))

    def delta_codes(self, frame: codec.Frame) -> codec.Codes:
        """What `delta` sent, as Codes of a frame of `blocks` (see `positions`)."""
        if bytes(frame[:4]) != codec.GATHERED_MAGIC:
            return codec.read_codes(frame, num_values=self.gathered_size(1))
        return codec.read_gathered(
            frame, self.gathered_size(codec.BLOCK), self._wanted(codec.BLOCK)
        )

    def _wanted(self, block: int) -> np.ndarray:
        wanted = np.zeros(self.blocks(block).size * block, bool)
        wanted[self.positions(block)] = True
        return wanted

    def positions(self, block: int) -> np.ndarray:
        """Where each value of the part lies in a frame of `blocks(block)`, in part order."""
        b = self.blocks(block)
        # a run's blocks are all touched, so they lie side by side in `b`
        at = np.searchsorted(b, self.starts // block) * block + self.starts % block
        return self._expand(at, self.lengths)
