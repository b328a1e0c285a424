"""A push in parts on the wire (proto `PushHeader.parts`, `part`, `boxes`): what each
process of a sharded learner sends of a fragment.

Each process pushes one part: the same header as every other part of the push but for
`part` (its index) and `boxes` (the tensor pieces it carries), with a frame of those
pieces' values, box after box, each in C order. A jax shard's `index` is such a piece
already: `tensor_box(t, shard.index, leaf.shape)` names it, and
`np.asarray(shard.data).reshape(-1)` is its values. A replicated leaf goes in one part
only (a box with no bounds: the whole tensor). The shard merges the push once its parts
cover the fragment exactly; it refuses overlaps, gaps and boxes past a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

from atoll.wire import syncer_pb2 as pb


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
