"""A user's params pytree as fragments: which leaves are synced, what each is called,
and reading or replacing one fragment's tensors (docs/design.md §4).

The rule (what `atoll.Learner` documents):

* Every leaf is named by its path in the tree, keys joined with "/": a dict key or
  attribute name as is, a list or tuple index as its number (`blocks/0/attn/wq`; a
  Flax NNX `State` of `nnx.Param`s gives `layer/kernel/value`). Names are what the
  fragment plan is built from (wire/plan.py), so learners of one run must name their
  tensors alike: the same tree of the same model.
* Leaves with a floating dtype (float32, bfloat16, ...) and at least one element are
  synced. Other arrays (integer step counters, RNG keys, masks) are left out of the plan
  and carried through unchanged: they are the learner's own.
* A leaf that is not an array (a Python number, a string) is refused: make it an array
  or keep it out of the params. So are complex leaves, and keys holding "/".

Reading a fragment copies only its tensors to the host; writing one puts each new
tensor back with the leaf's own dtype and sharding, so a sharded or bfloat16 model
stays as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast

import jax
import jax.numpy as jnp
import numpy as np

from atoll.wire.plan import SEP, FragmentPlan, TensorSpec

PyTree = Any  # any JAX pytree of arrays: nested dicts, a Flax NNX State, an Equinox module


class ParamsError(ValueError):
    """A params tree the learner cannot sync, or one that differs from the tree it
    joined with or from the run's plan; the message names the first leaf that differs."""


def _key_name(key: Any) -> str:
    """One path entry as a name part: a dict key, attribute name or index."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_name(path: Sequence[Any]) -> str:
    """A leaf's "/"-joined name from its `jax.tree_util` key path ("params" at the root).

    Example:
      >>> from jax.tree_util import DictKey, SequenceKey
      >>> leaf_name((DictKey("blocks"), SequenceKey(0), DictKey("w")))
      'blocks/0/w'
    """
    parts = [_key_name(k) for k in path]
    for part in parts:
        if not part or SEP in part:
            raise ParamsError(
                f"key {part!r} under {SEP.join(parts[: parts.index(part)]) or '<root>'!r}: "
                f"atoll names a tensor by its path joined with {SEP!r}, so a key must be "
                f"non-empty and hold no {SEP!r}; rename it"
            )
    return SEP.join(parts) or "params"


def _describe(leaf: Any) -> str:
    return f"{getattr(leaf, 'dtype', type(leaf).__name__)}{tuple(np.shape(leaf))}"


def _synced(name: str, leaf: Any) -> bool:
    """Whether a leaf is synced (a non-empty float array), refusing what cannot be a leaf."""
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
        raise ParamsError(
            f"leaf {name!r} is a {type(leaf).__name__}, not an array: make it one "
            "(jnp.asarray) or keep it out of the params you sync"
        )
    dtype = leaf.dtype
    if jnp.issubdtype(dtype, np.complexfloating):
        raise ParamsError(
            f"leaf {name!r} is {dtype}: complex tensors cannot be synced; keep them out of "
            "the params, or pass their real and imaginary parts as two float leaves"
        )
    return bool(jnp.issubdtype(dtype, np.floating)) and int(np.prod(leaf.shape)) > 0


class TreeLayout:
    """How one params pytree maps onto a fragment plan; built from the tree a learner
    joins with, then used to check, read and write every tree it is given after.

    Example:
      >>> import jax.numpy as jnp
      >>> tree = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2), "step": jnp.array(0)}
      >>> layout = TreeLayout(tree, 2)
      >>> layout.plan.fragment_sizes, layout.unsynced
      ((8, 2), ('step',))
    """

    def __init__(
        self,
        params: PyTree,
        num_fragments: int,
        is_embedding: Callable[[str], bool] | None = None,
    ):
        with_paths, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.names = [leaf_name(path) for path, _ in with_paths]
        leaves = [leaf for _, leaf in with_paths]
        seen: dict[str, int] = {}
        for i, name in enumerate(self.names):
            if name in seen:
                raise ParamsError(
                    f"leaves {seen[name]} and {i} are both named {name!r} (keys that differ "
                    "only in type, such as 1 and '1'): rename one"
                )
            seen[name] = i
        synced = [_synced(n, x) for n, x in zip(self.names, leaves)]
        self.shapes = [tuple(np.shape(x)) for x in leaves]
        self.dtypes = [x.dtype for x in leaves]
        # what `leaves` compares at every step: one tuple, built once
        self._signature = tuple(zip(self.shapes, self.dtypes))
        self.synced = [i for i, s in enumerate(synced) if s]  # leaf indices, in tree order
        self.unsynced = tuple(n for n, s in zip(self.names, synced) if not s)
        if not self.synced:
            raise ParamsError(
                "the params hold no float arrays to sync"
                + (f" (only {', '.join(self.unsynced[:3])})" if self.unsynced else "")
            )
        specs = [TensorSpec(self.names[i], self.shapes[i]) for i in self.synced]
        try:
            self.plan = FragmentPlan.build(specs, num_fragments, is_embedding=is_embedding)
        except ValueError as e:
            raise ParamsError(f"fragments={num_fragments}: {e}") from None
        index = {self.names[i]: i for i in self.synced}
        # per fragment: (leaf index, offset, end) in the fragment's vector, layout order
        self.slots = [
            [(index[s.name], s.offset, s.end) for s in self.plan.tensors_of(p)]
            for p in range(self.plan.num_fragments)
        ]

    def leaves(self, params: PyTree, what: str = "params") -> list[Any]:
        """The tree's leaves, checked to be the tree the layout was built from: the same
        structure, leaf names, shapes and dtypes. ParamsError names the first leaf that
        differs.

        Cheap enough for every step: a flatten and one tuple compare (12 µs for the
        `small` preset's 35 leaves on a CPU host), no device read; only a tree that
        differs is walked again with paths, to name the leaf."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        try:
            signature = tuple((x.shape, x.dtype) for x in leaves)
        except AttributeError:  # a leaf that is not an array: the walk below names it
            signature = ()
        if signature == self._signature and cast(Any, treedef) == self.treedef:
            return leaves
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
        leaves = [leaf for _, leaf in with_paths]
        if cast(Any, treedef) != self.treedef:  # (jax's PyTreeDef stub has no __ne__)
            names = [leaf_name(path) for path, _ in with_paths]
            for a, b in zip(self.names, names):
                if a != b:
                    missing = a not in names
                    return self._raise(
                        what,
                        f"leaf {a!r} is missing"
                        if missing
                        else f"leaf {b!r} is new (before {a!r})",
                    )
            if len(names) != len(self.names):
                longer, extra = (
                    (names, "new") if len(names) > len(self.names) else (self.names, "missing")
                )
                return self._raise(
                    what, f"leaf {longer[min(len(names), len(self.names))]!r} is {extra}"
                )
            return self._raise(
                what,
                f"the tree is a {treedef} where join had a {self.treedef}, with leaves named alike: "
                "pass the same kind of tree",
            )
        for i, leaf in enumerate(leaves):
            shape, dtype = tuple(np.shape(leaf)), getattr(leaf, "dtype", type(leaf))
            if shape != self.shapes[i] or dtype != self.dtypes[i]:
                return self._raise(
                    what,
                    f"leaf {self.names[i]!r} is {_describe(leaf)}, was "
                    f"{self.dtypes[i]}{self.shapes[i]}",
                )
        return leaves

    def _raise(self, what: str, detail: str) -> NoReturn:
        raise ParamsError(
            f"{what} differ from the params this learner joined with: {detail}. Pass the tree "
            "join() returned, updated by your steps (same structure, shapes and dtypes)"
        )

    def read(self, leaves: Sequence[Any], p: int) -> np.ndarray:
        """Fragment p of `leaves` (from `leaves()`) as a fresh float32 vector: the only
        device-to-host copy, of this fragment's tensors alone."""
        out = np.empty(self.plan.fragment_sizes[p], np.float32)
        for i, start, end in self.slots[p]:
            out[start:end] = np.asarray(leaves[i], np.float32).reshape(-1)
        return out

    def add_to(self, leaves: Sequence[Any], p: int, out: np.ndarray) -> None:
        """`out += read(leaves, p)`, bit for bit, tensor by tensor: no vector of the
        fragment's size is made (on CPU devices a leaf's values are read in place)."""
        for i, start, end in self.slots[p]:
            np.add(
                out[start:end], np.asarray(leaves[i], np.float32).reshape(-1), out=out[start:end]
            )

    def write(self, leaves: Sequence[Any], vectors: dict[int, np.ndarray]) -> PyTree:
        """The tree with the tensors of fragments `vectors` replaced ({p: float32 vector}),
        each in its leaf's dtype and sharding; the other leaves are kept as they are."""
        out = list(leaves)
        placed: list[int] = []  # leaves put on their devices by one device_put, below
        values: list[np.ndarray] = []
        shardings: list[Any] = []
        for p, vector in vectors.items():
            for i, start, end in self.slots[p]:
                value = np.asarray(vector[start:end]).reshape(self.shapes[i])
                leaf = leaves[i]
                sharding = _placed_sharding(leaf)
                if sharding is None:
                    out[i] = as_like(value, leaf)
                    continue
                placed.append(i)
                # no host copy where the dtype is the vector's: a CPU device_put may alias
                # it, and nothing writes over a vector once it is written (a push copies
                # one adopted in the same call, Synchronizer._start_push)
                values.append(value.astype(leaf.dtype, copy=False))
                shardings.append(sharding)
        if placed:
            # one call for the fragment's tensors: a device_put per tensor costs more
            for i, x in zip(placed, jax.device_put(values, shardings)):
                out[i] = x
        return jax.tree_util.tree_unflatten(self.treedef, out)


def _placed_sharding(leaf: Any) -> Any:
    """The sharding a committed, fully addressable jax array is placed with, or None
    where `as_like` handles the leaf (numpy, uncommitted, multi-host)."""
    if not isinstance(leaf, jax.Array) or not getattr(leaf, "_committed", True):
        return None
    sharding = leaf.sharding
    return sharding if sharding.is_fully_addressable else None


def as_like(value: np.ndarray, leaf: Any) -> Any:
    """`value` as a fresh array of `leaf`'s type, dtype and (for a jax array) sharding."""
    value = value.astype(leaf.dtype)  # a copy: a CPU device_put may alias a host buffer
    if not isinstance(leaf, jax.Array):
        return value
    if not getattr(leaf, "_committed", True):
        # left uncommitted, as the leaf was: jit keys its cache on it, so a committed
        # copy would compile the caller's step a second time
        return jax.device_put(value)
    sharding = leaf.sharding
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    # a multi-host learner: each process places its own devices' parts of the same value
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
