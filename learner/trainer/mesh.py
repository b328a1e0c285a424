"""The island's mesh and where each parameter lives on it: replicated on every device,
or split over the mesh's "fsdp" axis (FSDP).

`atoll learner --fsdp N` lays the slice's devices (`jax.devices()`: every process's, once
`jax.distributed.initialize` has run) out as a (data, fsdp) = (D/N, N) mesh. A batch is
split over all D devices; a parameter big enough is split N ways along its first
dimension that N divides, and replicated over "data", with its optimiser state split
alike. XLA gathers a split leaf for the step's matmuls and reduce-scatters its gradient.
A leaf with fewer than MIN_SPLIT values per device, or with no dimension N divides, stays
replicated: gathering it would cost more than holding it. N = 1 (the default) keeps the
1-D "data" mesh of a replicated learner; N = 0 means every device of the slice.

The split is a function of shapes and N alone, so every process of a learner computes the
same one, and `atoll.Learner` syncs each process's own part of a split leaf
(learner/sharded.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"  # the mesh axis the batch is split over (with FSDP, over both)
FSDP_AXIS = "fsdp"  # the mesh axis split parameters are split over
MIN_SPLIT = 256  # values per device below which a leaf stays replicated
# jax ships these untyped: typed names for them keep the calls below checked
_spec: Callable[..., PartitionSpec] = PartitionSpec
_shape_dtype: Callable[..., Any] = jax.ShapeDtypeStruct


class MeshError(ValueError):
    """An FSDP size the island's devices cannot be laid out in; the message says how."""


def island_mesh(devices: Sequence[jax.Device] | None = None, fsdp: int = 1) -> Mesh:
    """The island's mesh over `devices` (default every device of the slice): 1-D "data"
    for fsdp=1, else (data, fsdp) = (D/fsdp, fsdp); fsdp=0 means all D devices.

    Example:
      >>> island_mesh(fsdp=0).shape   # 2 processes x 2 devices
      {'data': 1, 'fsdp': 4}
    """
    found = np.asarray(devices if devices is not None else jax.devices())
    d = found.size
    size = d if fsdp == 0 else fsdp
    if size < 0 or d % size:
        divisors = ", ".join(str(k) for k in range(1, d + 1) if d % k == 0)
        raise MeshError(
            f"--fsdp {fsdp} does not divide the island's {d} devices: use one of {divisors}, "
            "or all (0)"
        )
    if size == 1:
        return Mesh(found.reshape(-1), (DATA_AXIS,))
    return Mesh(found.reshape(d // size, size), (DATA_AXIS, FSDP_AXIS))


def fsdp_size(mesh: Mesh) -> int:
    """How many ways a split leaf is split on `mesh` (1: nothing is)."""
    return int(dict(mesh.shape).get(FSDP_AXIS, 1))


def batch_spec(mesh: Mesh) -> PartitionSpec:
    """A batch's rows split over every device of `mesh`, in device order."""
    names = tuple(mesh.axis_names)
    return _spec(names[0] if len(names) == 1 else names)


def leaf_spec(shape: Sequence[int], ways: int) -> PartitionSpec:
    """Where a leaf of `shape` lives when split leaves are split `ways` ways: over the
    fsdp axis along its first dimension `ways` divides, or replicated (P())."""
    size = int(np.prod(shape, dtype=np.int64))
    if ways <= 1 or size < ways * MIN_SPLIT:
        return _spec()
    for axis, n in enumerate(shape):
        if n % ways == 0:
            return _spec(*([None] * axis), FSDP_AXIS)
    return _spec()


# Where a tree's leaves live, hashable (a cache key of the jitted steps): its treedef and,
# per leaf in tree order, its shape and PartitionSpec.
Placement = tuple[Any, tuple[tuple[tuple[int, ...], PartitionSpec], ...]]


def placement(params: Any, mesh: Mesh) -> Placement:
    """Where each leaf of `params` (arrays, or anything with a shape) lives on `mesh`."""
    leaves, treedef = jax.tree.flatten(params)
    ways = fsdp_size(mesh)
    return treedef, tuple((tuple(np.shape(x)), leaf_spec(np.shape(x), ways)) for x in leaves)


def param_shardings(where: Placement, mesh: Mesh) -> Any:
    """The params' NamedShardings on `mesh`, as a tree like the params."""
    treedef, leaves = where
    return jax.tree.unflatten(treedef, [NamedSharding(mesh, spec) for _, spec in leaves])


def state_shardings(optimizer: optax.GradientTransformation, where: Placement, mesh: Mesh) -> Any:
    """The shardings of `optimizer`'s state over params placed `where`: each moment as
    its parameter, counters and the like replicated."""
    treedef, leaves = where
    abstract = jax.tree.unflatten(treedef, [_shape_dtype(shape, np.float32) for shape, _ in leaves])
    replicated = NamedSharding(mesh, _spec())
    return optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        jax.eval_shape(optimizer.init, abstract),
        param_shardings(where, mesh),
        transform_non_params=lambda _: replicated,
    )


def split_count(where: Placement) -> tuple[int, int]:
    """(leaves split, all leaves) of a placement."""
    _, leaves = where
    return sum(1 for _, spec in leaves if spec != _spec()), len(leaves)
