"""The fragment plan: which tensors form each of the P fragments, and where.

Balanced tensor fragmentation (docs/design.md §1): whole tensors, greedily bin-packed
largest first into P fragments of near-equal size. Each fragment is one flat float32
vector with its tensors laid out in name order at fixed offsets, and is owned by
syncer shard ``p % S``. Learners and shards must agree on the plan bit for bit, so it
is a pure function of the tensor names and shapes and carries a fingerprint.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

Params = Mapping[str, Any]  # nested str-keyed mapping with array leaves
FlatParams = dict[str, np.ndarray]  # "/"-joined tensor name -> array
FragmentVector = np.ndarray  # one fragment's tensors as a flat float32 vector
IsEmbedding = Callable[[str], bool]  # tensor name -> merge by plain average?

FORMAT = "atoll.fragment_plan.v1"  # bump when the layout or encoding changes
SEP = "/"


def default_is_embedding(name: str) -> bool:
    """Embeddings are merged by plain average: tensors whose name says "embed"."""
    return "embed" in name.lower()


def _is_int(x: Any) -> bool:
    """An int (numpy ints included), but not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_count(num_tensors: int, num_fragments: Any) -> None:
    """Refuses a fragment count that cannot give every fragment a tensor."""
    if not _is_int(num_fragments) or num_fragments < 1:
        raise ValueError(f"num_fragments={num_fragments!r}: need an int >= 1")
    if num_tensors == 0:
        raise ValueError("empty parameter tree: nothing to fragment")
    if num_tensors < num_fragments:
        raise ValueError(
            f"num_fragments={num_fragments} but only {num_tensors} tensors: "
            f"a fragment would be empty; use num_fragments <= {num_tensors}"
        )


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A named tensor: its "/"-joined path, shape and merge rule."""

    name: str  # "/"-joined key path, e.g. "blocks/0/attn/wq"
    shape: tuple[int, ...]  # every dim >= 1
    embedding: bool | None = None  # None: default_is_embedding(name)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not all(self.name.split(SEP)):
            raise ValueError(f"tensor name {self.name!r}: want non-empty '/'-joined keys")
        dims = tuple(self.shape) if isinstance(self.shape, Iterable) else (self.shape,)
        if not all(_is_int(d) for d in dims):
            raise ValueError(f"tensor {self.name!r}: shape {self.shape!r} must be ints")
        if any(d < 1 for d in dims):
            raise ValueError(f"tensor {self.name!r}: shape {dims} has a zero or negative dim")
        object.__setattr__(self, "shape", tuple(int(d) for d in dims))
        if self.embedding is None:
            object.__setattr__(self, "embedding", default_is_embedding(self.name))

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where a tensor lives: fragment index and offset in that fragment's vector."""

    spec: TensorSpec
    fragment: int
    offset: int

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def end(self) -> int:
        return self.offset + self.spec.size


def named_leaves(tree: Params, prefix: str = "") -> dict[str, Any]:
    """Flattens a nested mapping into {"/"-joined name: leaf}."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if not isinstance(key, str) or not key or SEP in key:
            raise ValueError(
                f"key {key!r} under {prefix or '<root>'!r}: keys must be "
                f"non-empty str without {SEP!r} (it joins tensor names)"
            )
        name = prefix + SEP + key if prefix else key
        if isinstance(value, Mapping):
            out.update(named_leaves(value, name))
        else:
            out[name] = value
    return out


def _shape(leaf: Any) -> tuple[int, ...]:
    """The shape of an array-like leaf, without copying device arrays."""
    return tuple(leaf.shape) if hasattr(leaf, "shape") else np.shape(leaf)


@dataclasses.dataclass(frozen=True)
class FragmentPlan:
    """P fragments of whole tensors; build with `FragmentPlan.build`."""

    num_fragments: int
    slots: tuple[Slot, ...]  # sorted by name
    _by_name: dict[str, Slot] = dataclasses.field(init=False, repr=False, compare=False)
    _frags: tuple[tuple[Slot, ...], ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        P, slots = self.num_fragments, tuple(sorted(self.slots, key=lambda s: s.name))
        _check_count(len(slots), P)
        P = int(P)
        for a, b in zip(slots, slots[1:]):
            if a.name == b.name:
                raise ValueError(f"duplicate tensor name {a.name!r}")
        names = {s.name for s in slots}
        for s in slots:  # "a" and "a/b" cannot both be leaves of one tree
            parent = s.name.rpartition(SEP)[0]
            while parent and parent not in names:
                parent = parent.rpartition(SEP)[0]
            if parent:
                raise ValueError(f"tensor {s.name!r} nests under tensor {parent!r}")
        frags: list[list[Slot]] = [[] for _ in range(P)]
        for s in slots:
            if not 0 <= s.fragment < P:
                raise ValueError(f"tensor {s.name!r}: fragment {s.fragment} not in [0, {P})")
            frags[s.fragment].append(s)
        for p, members in enumerate(frags):
            if not members:
                raise ValueError(f"fragment {p} has no tensors")
            offset = 0
            for s in members:  # name order, contiguous: the canonical layout
                if s.offset != offset:
                    raise ValueError(f"tensor {s.name!r}: offset {s.offset}, layout says {offset}")
                offset = s.end
        object.__setattr__(self, "num_fragments", P)
        object.__setattr__(self, "slots", slots)
        object.__setattr__(self, "_by_name", {s.name: s for s in slots})
        object.__setattr__(self, "_frags", tuple(tuple(m) for m in frags))

    @classmethod
    def build(
        cls,
        specs_or_tree: Params | Iterable[TensorSpec],
        num_fragments: int,
        *,
        is_embedding: IsEmbedding | None = None,
    ) -> FragmentPlan:
        """Splits tensors into `num_fragments` balanced fragments.

        Greedy longest-processing-time packing: tensors largest first (ties by name,
        so input order never matters), each into the currently smallest fragment
        (ties by lowest index). Within a fragment, tensors sit in name order.

        Args:
          specs_or_tree: a nested mapping with array leaves (only shapes are read;
            numpy, jax, or anything with `.shape`) or an iterable of `TensorSpec`.
          num_fragments: P, between 1 and the number of tensors.
          is_embedding: name -> bool, overriding which tensors are merged by plain
            average (default: `default_is_embedding` or the specs' own flags).

        Returns:
          The plan. Raises ValueError for an empty tree, bad P, bad shapes or names.

        Example:
          >>> tree = {"embed": np.zeros((100, 8)), "blocks": {"0": {"w": np.zeros((8, 8))}}}
          >>> plan = FragmentPlan.build(tree, 2)
          >>> plan.fragment_sizes, plan.fragment_of("blocks/0/w")
          ((800, 64), 1)
        """
        if isinstance(specs_or_tree, Mapping):
            specs = [TensorSpec(n, _shape(leaf)) for n, leaf in named_leaves(specs_or_tree).items()]
        else:
            specs = list(specs_or_tree)
            if not all(isinstance(s, TensorSpec) for s in specs):
                raise ValueError("build() takes a nested mapping or TensorSpecs")
        if is_embedding is not None:
            specs = [dataclasses.replace(s, embedding=bool(is_embedding(s.name))) for s in specs]
        _check_count(len(specs), num_fragments)
        loads = [(0, p) for p in range(num_fragments)]  # (params, fragment): min-heap
        assign: dict[str, int] = {}
        for s in sorted(specs, key=lambda s: (-s.size, s.name)):
            load, p = heapq.heappop(loads)
            assign[s.name] = p  # duplicates are refused in __post_init__
            heapq.heappush(loads, (load + s.size, p))
        return cls(num_fragments, _layout(specs, assign))

    # -- queries ---------------------------------------------------------------

    @property
    def fragment_sizes(self) -> tuple[int, ...]:
        return tuple(m[-1].end for m in self._frags)

    @property
    def num_params(self) -> int:
        return sum(self.fragment_sizes)

    def tensors_of(self, fragment: int) -> tuple[Slot, ...]:
        """The fragment's tensors (with offsets), in layout order."""
        return self._frags[self._check_fragment(fragment)]

    def fragment_of(self, name: str) -> int:
        """The fragment that holds tensor `name`."""
        if name not in self._by_name:
            raise KeyError(f"no tensor {name!r} in this plan")
        return self._by_name[name].fragment

    def _check_fragment(self, fragment: int) -> int:
        """Validates a fragment index."""
        if not _is_int(fragment) or not 0 <= fragment < self.num_fragments:
            raise ValueError(f"fragment {fragment!r} not in [0, {self.num_fragments})")
        return int(fragment)

    # -- flat vectors ------------------------------------------------------------

    def _checked_leaves(self, tree: Params) -> dict[str, Any]:
        """The tree's leaves by name, checked against the plan's names and shapes."""
        leaves = named_leaves(tree)
        for s in self.slots:
            if s.name not in leaves:
                raise ValueError(f"tree lacks tensor {s.name!r} {s.spec.shape}")
            if _shape(leaves[s.name]) != s.spec.shape:
                raise ValueError(
                    f"tensor {s.name!r}: shape {_shape(leaves[s.name])}, plan says {s.spec.shape}"
                )
        extra = sorted(set(leaves) - set(self._by_name))
        if extra:
            raise ValueError(
                f"tree has tensor {extra[0]!r} the plan does not know ({len(extra)} unknown)"
            )
        return leaves

    def _pack(self, leaves: dict[str, Any], fragment: int) -> FragmentVector:
        """Copies one fragment's tensors into a fresh float32 vector."""
        out = np.empty(self.fragment_sizes[fragment], np.float32)
        for s in self._frags[fragment]:
            out[s.offset : s.end] = np.asarray(leaves[s.name], np.float32).reshape(-1)
        return out

    def flatten(self, tree: Params) -> list[FragmentVector]:
        """One fresh contiguous float32 vector per fragment."""
        leaves = self._checked_leaves(tree)
        return [self._pack(leaves, p) for p in range(self.num_fragments)]

    def flatten_fragment(self, tree: Params, fragment: int) -> FragmentVector:
        """Fragment `fragment` of `tree` as a fresh float32 vector."""
        return self._pack(self._checked_leaves(tree), self._check_fragment(fragment))

    def unflatten_fragment(self, fragment: int, vector: Any) -> FlatParams:
        """{name: float32 array} for one fragment; views into `vector` when float32."""
        p = self._check_fragment(fragment)
        vec = np.asarray(vector, np.float32)
        if vec.shape != (self.fragment_sizes[p],):
            raise ValueError(
                f"fragment {p}: vector shape {vec.shape}, want ({self.fragment_sizes[p]},)"
            )
        return {s.name: vec[s.offset : s.end].reshape(s.spec.shape) for s in self._frags[p]}

    def unflatten(self, vectors: Sequence[Any]) -> dict[str, Any]:
        """The nested tree of float32 arrays (views where possible) from P vectors."""
        if len(vectors) != self.num_fragments:
            raise ValueError(f"got {len(vectors)} vectors, plan has {self.num_fragments} fragments")
        tree: dict[str, Any] = {}
        for p, vec in enumerate(vectors):
            for name, arr in self.unflatten_fragment(p, vec).items():
                *path, leaf = name.split(SEP)
                node = tree
                for key in path:
                    node = node.setdefault(key, {})
                node[leaf] = arr
        return tree

    # -- identity ----------------------------------------------------------------

    def _records(self) -> list[dict[str, Any]]:
        """Per-tensor records, in name order, that define the plan."""
        return [
            {
                "name": s.name,
                "shape": list(s.spec.shape),
                "embedding": s.spec.embedding,
                "fragment": s.fragment,
                "offset": s.offset,
            }
            for s in self.slots
        ]

    @functools.cached_property  # every push and part checks it: not its JSON each time
    def fingerprint(self) -> str:
        """Stable id: first 16 hex chars of sha256 over the canonical JSON encoding."""
        body = {"format": FORMAT, "num_fragments": self.num_fragments, "tensors": self._records()}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        """The plan as JSON, fingerprint included."""
        return json.dumps(
            {
                "format": FORMAT,
                "num_fragments": self.num_fragments,
                "fingerprint": self.fingerprint,
                "tensors": self._records(),
            },
            sort_keys=True,
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> FragmentPlan:
        """Rebuilds a plan from `to_json`, refusing malformed or tampered input."""
        try:
            doc = json.loads(text)
            if doc["format"] != FORMAT:
                raise ValueError(f"format {doc['format']!r}, want {FORMAT!r}")
            slots = []
            for t in doc["tensors"]:
                if not all(_is_int(t[k]) for k in ("fragment", "offset")):
                    raise ValueError(f"tensor {t['name']!r}: fragment/offset must be ints")
                if not isinstance(t["embedding"], bool) or not isinstance(t["shape"], list):
                    raise ValueError(f"tensor {t['name']!r}: bad embedding or shape")
                slots.append(
                    Slot(
                        TensorSpec(t["name"], tuple(t["shape"]), t["embedding"]),
                        t["fragment"],
                        t["offset"],
                    )
                )
            plan = cls(doc["num_fragments"], tuple(slots))
            claimed = doc["fingerprint"]
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed fragment plan JSON: {e!r}") from e
        if claimed != plan.fingerprint:
            raise ValueError(
                f"fragment plan fingerprint mismatch: JSON says {claimed!r}, "
                f"content hashes to {plan.fingerprint!r}"
            )
        return plan


@dataclasses.dataclass(frozen=True)
class FragmentMap:
    """Which shard owns each fragment, since which map version, and the map's version
    (docs/resharding.md).

    Version 0 is the layout a run starts from, fragment p on shard p mod S; each move of
    a fragment makes the next version, and `moved_at[p]` is the version that put p on
    its owner. Shards learn only the moves they take part in, so two shards' maps may
    each be newest about different fragments: `merged` takes, fragment by fragment, the
    statement with the higher `moved_at`.

    Example:
      >>> m = FragmentMap.modulo(5, 2)
      >>> m.owners, m.fragments_of(1)
      ((0, 1, 0, 1, 0), (1, 3))
      >>> n = m.moved(4, 1)
      >>> n.version, n.fragments_of(1), n.moved_at
      (1, (1, 3, 4), (0, 0, 0, 0, 1))
    """

    version: int
    owners: tuple[int, ...]  # owners[p]: the index of the shard that owns fragment p
    moved_at: tuple[int, ...] = ()  # the version that put each fragment there (() = all 0)

    def __post_init__(self) -> None:
        if not _is_int(self.version) or self.version < 0:
            raise ValueError(f"map version {self.version!r}: need an int >= 0")
        owners = tuple(self.owners)
        if not owners or not all(_is_int(o) and o >= 0 for o in owners):
            raise ValueError(f"map owners {owners!r}: need one shard index >= 0 per fragment")
        moved_at = tuple(self.moved_at) or (0,) * len(owners)
        if len(moved_at) != len(owners) or not all(
            _is_int(v) and 0 <= v <= self.version for v in moved_at
        ):
            raise ValueError(
                f"map moved_at {moved_at!r}: need one version in [0, {self.version}] per fragment"
            )
        object.__setattr__(self, "owners", tuple(int(o) for o in owners))
        object.__setattr__(self, "moved_at", tuple(int(v) for v in moved_at))

    @classmethod
    def modulo(cls, num_fragments: int, num_shards: int) -> FragmentMap:
        """Version 0: fragment p on shard p mod num_shards."""
        if not _is_int(num_shards) or not 1 <= num_shards <= num_fragments:
            raise ValueError(
                f"num_shards={num_shards!r}: need an int in [1, {num_fragments}] "
                "(a shard would own nothing)"
            )
        return cls(0, tuple(p % num_shards for p in range(num_fragments)))

    @property
    def num_fragments(self) -> int:
        return len(self.owners)

    def owner(self, fragment: int) -> int:
        if not _is_int(fragment) or not 0 <= fragment < len(self.owners):
            raise ValueError(f"fragment {fragment!r} not in [0, {len(self.owners)})")
        return self.owners[fragment]

    def fragments_of(self, shard: int) -> tuple[int, ...]:
        """The fragments `shard` owns, in order."""
        return tuple(p for p, o in enumerate(self.owners) if o == shard)

    def moved(self, fragment: int, to: int) -> FragmentMap:
        """The next version, with `fragment` on shard `to`."""
        return self.stating(fragment, to, self.version + 1)

    def stating(self, fragment: int, owner: int, version: int) -> FragmentMap:
        """This map with what version `version` says of `fragment`: on shard `owner`."""
        self.owner(fragment)
        owners, moved_at = list(self.owners), list(self.moved_at)
        owners[fragment], moved_at[fragment] = owner, version
        return FragmentMap(max(self.version, version), tuple(owners), tuple(moved_at))

    def merged(self, other: FragmentMap) -> FragmentMap:
        """Fragment by fragment, the newer statement of the two maps."""
        if other.num_fragments != self.num_fragments:
            raise ValueError(f"maps of {self.num_fragments} and {other.num_fragments} fragments")
        pick = [
            (o2, v2) if v2 > v1 else (o1, v1)
            for o1, v1, o2, v2 in zip(self.owners, self.moved_at, other.owners, other.moved_at)
        ]
        return FragmentMap(
            max(self.version, other.version),
            tuple(o for o, _ in pick),
            tuple(v for _, v in pick),
        )

    @staticmethod
    def merge_all(maps: Sequence[FragmentMap]) -> FragmentMap:
        """Several shards' maps merged (see `merged`); at least one."""
        out = maps[0]
        for m in maps[1:]:
            out = out.merged(m)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "owners": list(self.owners),
            "moved_at": list(self.moved_at),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FragmentMap:
        return cls(
            int(data["version"]),
            tuple(int(o) for o in data["owners"]),
            tuple(int(v) for v in data.get("moved_at", ())),
        )


def _layout(specs: Iterable[TensorSpec], assign: Mapping[str, int]) -> tuple[Slot, ...]:
    """Slots at name-ordered contiguous offsets within each assigned fragment."""
    offsets: dict[int, int] = {}
    slots = []
    for s in sorted(specs, key=lambda s: s.name):
        p = assign[s.name]
        slots.append(Slot(s, p, offsets.get(p, 0)))
        offsets[p] = offsets.get(p, 0) + s.size
    return tuple(slots)
