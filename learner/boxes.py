"""What one process of a learner sharded over several processes holds of each fragment,
as boxes (wire/parts.py): the pieces it reads, pushes and adopts.

A process holds a box of a leaf for every distinct `shard.index` among the leaf's
addressable shards, and pulls those boxes (a replicated leaf by every process holding
it). It *sends* the boxes whose shard of `replica_id` 0 is its own, so across the
processes every element of a fragment is pushed exactly once: a replicated leaf (or a
replicated shard) goes from the one process holding replica 0, not from each. Its
local vector of a fragment is its held boxes' values, box after box, each in C order,
in the fragment's tensor order; the sent vector is the sent boxes' part of it, in the
same order, which is the order of the part's boxes on the wire.

Nothing here talks to the shards or to the other processes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import Pulled
from atoll.wire.parts import BoxLayout

Bounds = tuple[tuple[int, int], ...]  # [start, stop) along every dimension


@dataclasses.dataclass(frozen=True)
class Box:
    """One held piece of a tensor of a fragment."""

    tensor: int  # the tensor's position in the fragment (`plan.tensors_of(p)` order)
    leaf: int  # the leaf's index in the tree
    bounds: Bounds
    offset: int  # where its values start in the process's local vector of the fragment
    sent: bool  # replica 0 of this piece is on this process: this process pushes it

    # computed once: a sync step reads them for every box, tens per fragment
    @functools.cached_property
    def index(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.bounds)

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.bounds)

    @functools.cached_property
    def size(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def end(self) -> int:
        return self.offset + self.size


def bounds_of(index: Sequence[slice], shape: Sequence[int]) -> Bounds:
    """A jax shard's `index` of a leaf of `shape` as [start, stop) per dimension."""
    out = []
    for s, n in zip(index, shape):
        a, b, step = s.indices(n)
        assert step == 1, f"a shard index with step {step}"
        out.append((a, b))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class FragmentBoxes:
    """This process's boxes of one fragment."""

    p: int
    boxes: tuple[Box, ...]  # held, in tensor order then by bounds

    @functools.cached_property
    def size(self) -> int:
        """Values this process holds of the fragment (its local vector's length)."""
        return sum(b.size for b in self.boxes)

    @functools.cached_property
    def sent_boxes(self) -> tuple[Box, ...]:
        return tuple(b for b in self.boxes if b.sent)

    @functools.cached_property
    def sent_size(self) -> int:
        return sum(b.size for b in self.sent_boxes)

    def wire_boxes(self, held: bool = False) -> list[pb.TensorBox]:
        """The sent boxes as a push part names them; `held`: every held box, as a pull by
        boxes asks for them (its values come back in local vector order)."""
        return [
            pb.TensorBox(
                tensor=b.tensor, start=[a for a, _ in b.bounds], stop=[z for _, z in b.bounds]
            )
            for b in (self.boxes if held else self.sent_boxes)
        ]

    def sent(self, local: np.ndarray) -> np.ndarray:
        """The sent boxes' values of a local vector (a fresh vector, wire order)."""
        if not self.sent_boxes:
            return np.empty(0, np.float32)
        return np.concatenate([local[b.offset : b.end] for b in self.sent_boxes])

    def sent_difference(
        self, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None
    ) -> np.ndarray:
        """`sent(a) - sent(b)`, bit for bit, written into `out` (float32, `sent_size`;
        None: a fresh vector) and no other vector: what a push of the part encodes."""
        if out is None:
            out = np.empty(self.sent_size, np.float32)
        if len(self.sent_boxes) == len(self.boxes):
            np.subtract(a, b, out=out)
            return out
        at = 0
        for box in self.sent_boxes:
            np.subtract(
                a[box.offset : box.end], b[box.offset : box.end], out=out[at : at + box.size]
            )
            at += box.size
        return out

    def add_to(self, leaves: Sequence[Any], out: np.ndarray) -> None:
        """`out += read(leaves)`, bit for bit, box by box: no vector of the fragment's size
        is read (on CPU devices a box's values are read in place)."""
        for b in self.boxes:
            held = np.asarray(_shard_data(leaves[b.leaf], b.bounds), np.float32).reshape(-1)
            np.add(out[b.offset : b.end], held, out=out[b.offset : b.end])

    def read(self, leaves: Sequence[Any]) -> np.ndarray:
        """The local vector of the fragment from the caller's leaves: each held box read
        from one addressable shard holding it (the only device-to-host copy)."""
        out = np.empty(self.size, np.float32)
        for b in self.boxes:
            out[b.offset : b.end] = np.asarray(_shard_data(leaves[b.leaf], b.bounds)).reshape(-1)
        return out


def _shard_data(leaf: Any, bounds: Bounds) -> Any:
    for shard in leaf.addressable_shards:
        if bounds_of(shard.index, leaf.shape) == bounds:
            return shard.data
    raise AssertionError(f"no addressable shard holds {bounds}")


@dataclasses.dataclass(frozen=True)
class ProcessBoxes:
    """This process's boxes of every fragment, and how to write local vectors back."""

    fragments: tuple[FragmentBoxes, ...]
    shapes: tuple[tuple[int, ...], ...]  # every leaf's shape, tree order
    offsets: tuple[tuple[int, ...], ...]  # per fragment: each tensor's offset in its vector

    def take(self, p: int, full: np.ndarray) -> np.ndarray:
        """This process's local vector of fragment p from the whole fragment's vector (what
        a pull by `wire_boxes(held=True)` gives, taken from a whole pull)."""
        frag = self.fragments[p]
        out = np.empty(frag.size, np.float32)
        for b in frag.boxes:
            shape = self.shapes[b.leaf]
            start = self.offsets[p][b.tensor]
            tensor = full[start : start + int(np.prod(shape, dtype=np.int64))].reshape(shape)
            out[b.offset : b.end] = tensor[b.index].reshape(-1)
        return out

    def write(self, leaves: Sequence[Any], vectors: dict[int, np.ndarray]) -> list[Any]:
        """`leaves` with the tensors of fragments `vectors` ({p: local vector}) replaced:
        each new leaf built from this process's boxes on the leaf's own sharding (every
        addressable shard, replicas included), with no value from another process.

        Every piece of every leaf goes to its device in one `jax.device_put` (a call per
        piece costs ~0.1 ms of the training thread's CPU each, and a fragment has tens)."""
        out = list(leaves)
        values: list[np.ndarray] = []
        devices: list[Any] = []
        placed: list[tuple[int, int]] = []  # (leaf, its pieces in `values`), in order
        for p, local in vectors.items():
            by_leaf: dict[int, dict[Bounds, np.ndarray]] = {}
            for b in self.fragments[p].boxes:
                by_leaf.setdefault(b.leaf, {})[b.bounds] = local[b.offset : b.end].reshape(b.shape)
            for i, pieces in by_leaf.items():
                leaf = leaves[i]
                shards = leaf.addressable_shards
                for s in shards:
                    # no host copy of a float32 piece: device_put copies it to the device
                    piece = pieces[bounds_of(s.index, leaf.shape)]
                    values.append(piece.astype(leaf.dtype, copy=False))
                    devices.append(s.device)
                placed.append((i, len(shards)))
        arrays = jax.device_put(values, devices) if values else []
        at = 0
        for i, n in placed:
            leaf = leaves[i]
            out[i] = jax.make_array_from_single_device_arrays(
                leaf.shape, leaf.sharding, arrays[at : at + n]
            )
            at += n
        return out


def process_boxes(
    leaves: Sequence[Any], slots: Sequence[Sequence[tuple[int, int, int]]]
) -> ProcessBoxes:
    """This process's boxes of every fragment.

    Args:
      leaves: the tree's leaves (jax arrays for the synced ones).
      slots: per fragment, (leaf index, offset, end) of each tensor in tensor order
        (`TreeLayout.slots`).
    """
    fragments = []
    for p, tensors in enumerate(slots):
        boxes: list[Box] = []
        offset = 0
        for t, (i, _, _) in enumerate(tensors):
            leaf = leaves[i]
            held: dict[Bounds, bool] = {}
            for shard in leaf.addressable_shards:
                bounds = bounds_of(shard.index, leaf.shape)
                held[bounds] = held.get(bounds, False) or shard.replica_id == 0
            for bounds in sorted(held):
                box = Box(t, i, bounds, offset, held[bounds])
                boxes.append(box)
                offset = box.end
        fragments.append(FragmentBoxes(p, tuple(boxes)))
    shapes = tuple(tuple(np.shape(x)) for x in leaves)
    offsets = tuple(tuple(start for _, start, _ in tensors) for tensors in slots)
    return ProcessBoxes(tuple(fragments), shapes, offsets)


def in_fragment_order(layout: BoxLayout, block: int) -> bool:
    """Whether the values of a pull by `layout`'s boxes, in local vector order, are the
    values of its delta frames of `block`-value blocks, in frame order: every run starts
    at a block and ends at one (or at the fragment's end), after the one before it. Then
    a delta decodes straight onto the local vector (an FSDP shard of rows of whole
    blocks is one such run)."""
    starts, ends = layout.starts, layout.starts + layout.lengths
    whole = (ends % block == 0) | (ends == layout.fragment_size)
    return bool((starts % block == 0).all() and whole.all() and (starts[1:] >= ends[:-1]).all())


def apply_in_place(pulled: Pulled, layout: BoxLayout, held: np.ndarray) -> bool:
    """Adds a pull's deltas by `layout`'s boxes onto `held` (their values at the version
    pulled from) in place, as `wire.client.apply_boxes` does and bit for bit, with no
    vector of the part's size beside it: False (nothing done) where the boxes are not in
    fragment order (`in_fragment_order`), for apply_boxes to do it. Every frame is read
    (and checked) before any is added, so a bad one changes nothing (CodecError)."""
    n = layout.size
    codes = []
    for _, frame_codec, frame in pulled.frames:
        if bytes(frame[:4]) == codec.GATHERED_MAGIC:  # a 4-bit delta: codes of our values
            if not in_fragment_order(layout, codec.BLOCK):
                return False
            codes.append((frame_codec, codec.read_gathered(frame, n)))  # every value wanted
        else:  # an FP32 delta of our values alone
            if not in_fragment_order(layout, 1):
                return False
            codes.append((frame_codec, codec.read_codes(frame, num_values=n)))
    for frame_codec, c in codes:
        codec.decode_into(c, held, 1.0, codec=frame_codec)
    return True
