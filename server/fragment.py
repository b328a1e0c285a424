"""One fragment's state machine: global params, outer optimiser, open round,
published copy and delta ring.

Every change goes through `initialize`, `contribute` or `close_round`, the same
three calls that replaying the write-ahead log makes, in log order; that is what
makes recovery bit-identical. Nothing here does I/O, reads a clock or locks: the
shard does those around it.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from server import merge
from wire import codec
from wire.plan import FragmentPlan


@dataclasses.dataclass(frozen=True)
class Answer:
    """A push's acknowledgement, kept so a retry gets the same one."""

    seq: int
    accepted: bool
    reason: str
    detail: str
    version: int
    staleness: int
    weight: float


class Fragment:
    """Fragment p of a shard. `params is None` until initialized."""

    def __init__(self, index: int, plan: FragmentPlan, *, lr: float, momentum: float, rda: bool,
                 delta_ring: int, publish_codec: codec.Codec):
        self.index = index
        self.size = plan.fragment_sizes[index]
        self.segments = merge.Segments.from_plan(plan, index)
        self.opt = merge.outer_optimizer(lr, momentum)
        self.publish_codec = publish_codec
        self.params: np.ndarray | None = None  # Θ, the global params (fp32)
        self.published: np.ndarray | None = None  # what learners hold at `version`
        self.opt_state = None
        self.version = 0
        self.ring: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=delta_ring)
        self.round = merge.RoundAccumulator(self.segments, rda=rda)
        self.contributors: set[str] = set()  # learners in the open round
        self.last_round_size = 0  # learners merged into the round that made `version`
        self.answers: dict[str, Answer] = {}  # learner -> answer to its newest push

    @property
    def initialized(self) -> bool:
        return self.params is not None

    def initialize(self, values: np.ndarray) -> None:
        """Seeds version 0: params and the published copy are both `values`."""
        assert not self.initialized, "fragment seeded twice"
        values = np.asarray(values, np.float32).reshape(-1)
        assert values.size == self.size
        self.params = values.copy()
        self.published = values.copy()
        self.opt_state = self.opt.init(self.params)
        self.version = 0

    def contribute(self, learner: str, delta: np.ndarray, answer: Answer) -> None:
        """Folds an accepted outer gradient into the open round."""
        self.round.add(delta, answer.weight)
        self.contributors.add(learner)
        self.answers[learner] = answer

    def close_round(self) -> bytes:
        """Merges the round, takes one outer step, publishes; returns the delta frame."""
        assert self.round.count > 0, "closing an empty round"
        merged = self.round.result()
        self.params, self.opt_state = merge.outer_step(self.params, self.opt_state, merged, self.opt)
        # The published copy follows params through quantised deltas; what a delta
        # fails to carry stays in params − published and goes out with the next one.
        frame = codec.encode(self.params - self.published, self.publish_codec)
        codec.decode_into(frame, self.published, 1.0)
        self.version += 1
        self.last_round_size = self.round.count
        self.ring.append((self.version, frame))
        self.round.reset()
        self.contributors.clear()
        return frame

    def deltas_since(self, have_version: int) -> list[tuple[int, bytes]] | None:
        """Delta frames taking have_version to the current version, or None when the
        ring no longer reaches back that far (the caller then sends a snapshot)."""
        if have_version == self.version:
            return []
        if not self.ring or have_version < self.ring[0][0] - 1 or have_version > self.version:
            return None
        return [(v, f) for v, f in self.ring if v > have_version]

    def snapshot_frame(self) -> bytes:
        """The published copy as one lossless frame."""
        return codec.encode(self.published, codec.Codec.FP32)

    # --- snapshots of the whole state ---

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(JSON-able meta, arrays) describing everything above."""
        meta = {"version": self.version, "initialized": self.initialized,
                "last_round_size": self.last_round_size,
                "ring": [v for v, _ in self.ring], "contributors": sorted(self.contributors),
                "answers": {k: dataclasses.asdict(a) for k, a in self.answers.items()}}
        arrays: dict[str, np.ndarray] = {}
        if self.initialized:
            arrays["params"], arrays["published"] = self.params, self.published
            for i, leaf in enumerate(jax.tree_util.tree_leaves(self.opt_state)):
                arrays[f"opt.{i}"] = np.asarray(leaf)
        for i, (_, frame) in enumerate(self.ring):
            arrays[f"ring.{i}"] = np.frombuffer(frame, np.uint8)
        rs = self.round.state()
        arrays["round.acc"], arrays["round.norm_sum"] = rs.acc, rs.norm_sum
        meta["round"] = {"total_weight": rs.total_weight, "count": rs.count}
        return meta, arrays

    def restore(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        """Inverse of `state()`."""
        self.version = int(meta["version"])
        self.last_round_size = int(meta["last_round_size"])
        if meta["initialized"]:
            self.params = np.array(arrays["params"], np.float32)
            self.published = np.array(arrays["published"], np.float32)
            template = self.opt.init(self.params)
            leaves, treedef = jax.tree_util.tree_flatten(template)
            self.opt_state = jax.tree_util.tree_unflatten(
                treedef, [jax.numpy.asarray(arrays[f"opt.{i}"]) for i in range(len(leaves))])
        self.ring.clear()
        for i, v in enumerate(meta["ring"]):
            self.ring.append((int(v), arrays[f"ring.{i}"].tobytes()))
        rs = self.round.state()
        self.round = merge.RoundAccumulator.from_state(
            rs._replace(acc=arrays["round.acc"], norm_sum=arrays["round.norm_sum"],
                        total_weight=meta["round"]["total_weight"], count=meta["round"]["count"]),
            self.segments)
        self.contributors = set(meta["contributors"])
        self.answers = {k: Answer(**a) for k, a in meta["answers"].items()}
