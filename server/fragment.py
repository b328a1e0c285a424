"""One fragment's state machine: global params, outer optimiser, open round,
published copy and delta ring.

Every change goes through `initialize`, `contribute` or `close_round`, the same
three calls that replaying the write-ahead log makes, in log order; that is what
makes recovery bit-identical. Nothing here does I/O, reads a clock or locks: the
shard does those around it (one lock per fragment). Arrays a snapshot or pull holds
are never written: a caller reading params, optimiser state or the published copy
outside the fragment's lock `lend`s them first and `give_back`s them after, and a close
while any are lent makes fresh arrays instead of stepping in place (ring frames are
bytes; the round accumulator changes in place, and `state()` copies it). A close with
nothing lent writes over the old arrays: the same bits, no new memory to fault in.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import Any

import jax
import numpy as np

from atoll.server import merge, parts, rules
from atoll.wire import codec
from atoll.wire.plan import FragmentPlan


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """A push's acknowledgement, kept so a retry gets the same one.

    Every fragment keeps one per learner that ever pushed it, departed ones too
    (`Fragment.answers`): slots and a shared reason string keep that at about 150 bytes."""

    seq: int
    accepted: bool
    reason: str
    detail: str
    version: int
    staleness: int
    weight: float  # the merge weight: token weight × discount
    discount: float = 1.0  # the staleness discount in `weight`; the round is shrunk by it too

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", sys.intern(self.reason))  # a few values, shared

    def to_json(self) -> dict[str, Any]:
        """`dataclasses.asdict(self)`, ten times as fast: a snapshot writes one per learner
        that ever pushed, under the fragment's lock."""
        return {
            "seq": self.seq,
            "accepted": self.accepted,
            "reason": self.reason,
            "detail": self.detail,
            "version": self.version,
            "staleness": self.staleness,
            "weight": self.weight,
            "discount": self.discount,
        }


class Fragment:
    """Fragment p of a shard. `params is None` until initialized."""

    def __init__(
        self,
        index: int,
        plan: FragmentPlan,
        *,
        lr: float,
        momentum: float,
        rda: bool,
        delta_ring: int,
        publish_codec: codec.Codec,
        quorum: int,
        momentum_delay: int,
        pool: merge.AccumulatorPool | None = None,
    ):
        self.index = index
        self.size = plan.fragment_sizes[index]
        self.segments = merge.Segments.from_plan(plan, index)
        self.opt = merge.outer_optimizer(lr, momentum, momentum_delay)
        self.publish_codec = publish_codec
        self.params: np.ndarray | None = None  # Θ, the global params (fp32)
        self.published: np.ndarray | None = None  # what learners hold at `version`
        self.opt_state: merge.OuterState | None = None
        self.version = 0
        self.ring: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=delta_ring)
        self.quorum = quorum  # K, for stamping when the open round reaches it
        # round accumulators come from `pool`, shared by the shard's fragments
        self.round = merge.RoundAccumulator(self.segments, rda=rda, pool=pool)
        self.round_state = rules.open_round()  # who is in the open round, and since when
        self.full_weight = 0.0  # Σ token weights of the open round before staleness discounts
        self.last_round_size = 0  # learners merged into the round that made `version`
        self.lent = 0  # loans of params, optimiser state or published copy not given back
        self.answers: dict[str, Answer] = {}  # learner -> answer to its newest accepted push
        self.refusals: dict[str, Answer] = {}  # learner -> its newest refused push (not durable)
        # learner -> the parts held of its push in parts, until all are in (server/parts.py)
        self.part_sets: dict[str, parts.PartSet] = {}
        slots = plan.tensors_of(index)
        self.shapes = tuple(tuple(s.spec.shape) for s in slots)  # its tensors' shapes, in order

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

    @property
    def contributors(self) -> AbstractSet[str]:
        contributors: AbstractSet[str] = self.round_state.contributors
        return contributors

    def contribute(
        self, learner: str, delta: codec.Codes | np.ndarray, answer: Answer, now: float
    ) -> None:
        """Folds an accepted outer gradient into the open round: a push's checked codes
        (`codec.read_codes`, merged with no float32 copy) or a float32 vector, the same bits."""
        if isinstance(delta, codec.Codes):
            self.round.add_frame(delta, answer.weight)
        else:
            self.round.add(delta, answer.weight)
        self.full_weight += answer.weight / answer.discount
        self.round_state = rules.add_contributor(self.round_state, learner, now, self.quorum)
        # one id string for every fragment's answer: what a departed learner leaves is that
        # and one answer per fragment it pushed (server/shard.py `_forget_departed`)
        self.answers[sys.intern(learner)] = answer

    def hold_part(
        self,
        learner: str,
        seq: int,
        header: dict[str, Any],
        part: int,
        boxes: tuple[parts.Box, ...],
        frame: bytes | tuple[bytes, ...],
        now: float,
        codes: codec.Codes | None = None,
    ) -> None:
        """Holds one part of `learner`'s push `seq` (judged by `parts.judge_part`), with
        its frame's checked codes when the caller has them."""
        held = self.part_sets.get(learner)
        if held is None or held.seq != seq:
            held = self.part_sets[learner] = parts.PartSet(seq, dict(header), {}, {}, now)
        held.boxes[part], held.frames[part] = boxes, frame
        if codes is not None:
            held.codes[part] = codes

    def drop_parts(self, learner: str) -> parts.PartSet | None:
        """Forgets `learner`'s held parts (none of them merged); returns them."""
        return self.part_sets.pop(learner, None)

    def contribute_parts(self, learner: str, answer: Answer, now: float) -> None:
        """Folds `learner`'s complete push in parts into the open round as one contribution.

        The parts are read as the fragment vector they assemble (`parts.assembled_codes`):
        its per-tensor norms over whole tensors in the codec's fixed order, and its sums
        added from each part's codes where its boxes lie, so `add_frame` of it gives the bits
        a whole frame decoding to the same values gives, however the tensors were split
        between parts. `delta` is its buffer (blocks no part fills whole are written there)."""
        held = self.part_sets.pop(learner)
        assert len(held.frames) == held.parts, "a push in parts merged before all were in"
        # a buffer a close gave back (its pages in already) goes to the round's accumulator
        # first: delta is written only where a part's block does not fill a fragment block
        # (none, for rows of 32·k values), so its fresh pages are mostly never touched
        pool = self.round.pool if self.round.count else None
        delta = np.empty(self.size, np.float32) if pool is None else pool.take(self.size)
        try:
            seg = self.segments
            assembled = parts.assembled_codes(held, delta, self.shapes, seg.offsets, seg.ends)
            self.contribute(learner, assembled, answer, now)
        finally:
            if pool is not None:  # the round holds none of it: it summed delta into its own
                pool.give(delta)

    def parts_state(self) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
        """(JSON-able meta, arrays) of the held parts, for a snapshot (not moved with the
        fragment: a push in parts caught by a move is finished again at its new shard)."""
        meta, arrays = [], {}
        for i, (learner, held) in enumerate(sorted(self.part_sets.items())):
            meta.append(
                {
                    "learner": learner,
                    "seq": held.seq,
                    "header": held.header,
                    "boxes": {str(k): [b.to_json() for b in v] for k, v in held.boxes.items()},
                }
            )
            for k, frame in held.frames.items():
                whole = frame if isinstance(frame, bytes) else b"".join(frame)
                arrays[f"parts.{i}.{k}"] = np.frombuffer(whole, np.uint8)
        return meta, arrays

    def restore_parts(
        self, meta: list[dict[str, Any]], arrays: dict[str, np.ndarray], now: float
    ) -> None:
        """Inverse of `parts_state()`; each part set's wait restarts at `now`."""
        self.part_sets = {}
        for i, m in enumerate(meta):
            for k, boxes in m["boxes"].items():
                self.hold_part(
                    m["learner"],
                    int(m["seq"]),
                    m["header"],
                    int(k),
                    tuple(parts.Box.from_json(b) for b in boxes),
                    arrays[f"parts.{i}.{k}"].tobytes(),
                    now,
                )

    def close_round(self, trigger: str | None = None) -> bytes:
        """Merges the round, takes one outer step, publishes; returns the delta frame.

        `trigger`, the learner whose push closed the round, has its answer moved to the
        new version. Live closes and replayed ones both come here."""
        assert self.round.count > 0, "closing an empty round"
        assert self.params is not None and self.published is not None, "fragment not seeded"
        # The staleness discount shrinks stale work in absolute terms: the merge
        # normalises by Σ w·d, so scale by Σ w·d / Σ w (a lone push with discount d
        # moves the model d times as far; a fresh round is untouched).
        shrink = self.round.total_weight / self.full_weight
        self.last_round_size = self.round.count
        merged = self.round.take()  # in the accumulator's buffer; the round is now empty
        if shrink != 1.0:
            np.multiply(merged, np.float32(shrink), out=merged)
        in_place = self.lent == 0  # nobody reads the old arrays: step over them
        self.params, self.opt_state = merge.outer_step(
            self.params, self.opt_state, merged, self.opt, in_place=in_place
        )
        # The published copy follows params through quantised deltas; what a delta
        # fails to carry stays in params − published and goes out with the next one.
        # It moves on by published + 1.0 × each value, the bits a learner's
        # decode_into(frame, held, 1.0) gives: in place, or (lent) in merged's spent
        # buffer over a copy of it.
        if not in_place:
            np.copyto(merged, self.published)
            self.published = merged
            if self.round.pool is not None:
                self.round.pool.keep(merged)
        elif self.round.pool is not None:
            self.round.pool.give(merged)  # spent: the next round's first push writes over it
        frame: bytes = codec.encode_publish(self.params, self.published, self.publish_codec)
        self.version += 1
        self.ring.append((self.version, frame))
        self.round_state = rules.open_round()
        self.full_weight = 0.0
        if trigger in self.answers:
            self.answers[trigger] = dataclasses.replace(self.answers[trigger], version=self.version)
        return frame

    def lend(self) -> None:
        """Params, optimiser state and published copy are read outside the fragment's lock
        until `give_back`: closes leave them unwritten meanwhile."""
        self.lent += 1

    def give_back(self) -> None:
        assert self.lent > 0, "give_back without lend"
        self.lent -= 1

    def restamp(self, contributors: Iterable[str], now: float) -> rules.RoundState:
        """The open round holding `contributors`, as if they had all pushed at `now`
        (after a restart: round timing is not durable, membership is)."""
        state = rules.open_round()
        for learner in sorted(contributors):
            state = rules.add_contributor(state, learner, now, self.quorum)
        return state

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
        assert self.published is not None, "fragment not seeded"
        frame: bytes = codec.encode(self.published, codec.Codec.FP32)
        return frame

    # --- snapshots of the whole state ---

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(JSON-able meta, arrays) describing everything above."""
        meta: dict[str, Any] = {
            "version": self.version,
            "initialized": self.initialized,
            "last_round_size": self.last_round_size,
            "ring": [v for v, _ in self.ring],
            "contributors": sorted(self.contributors),
            "answers": {k: a.to_json() for k, a in self.answers.items()},
        }
        arrays: dict[str, np.ndarray] = {}
        if self.params is not None and self.published is not None:  # initialized
            arrays["params"], arrays["published"] = self.params, self.published
            for i, leaf in enumerate(jax.tree_util.tree_leaves(self.opt_state)):
                arrays[f"opt.{i}"] = np.asarray(leaf)
        for i, (_, frame) in enumerate(self.ring):
            arrays[f"ring.{i}"] = np.frombuffer(frame, np.uint8)
        rs = self.round.state()
        arrays["round.acc"], arrays["round.norm_sum"] = rs.acc, rs.norm_sum
        meta["round"] = {
            "total_weight": rs.total_weight,
            "count": rs.count,
            "full_weight": self.full_weight,
        }
        return meta, arrays

    def restore(self, meta: dict[str, Any], arrays: dict[str, np.ndarray], now: float) -> None:
        """Inverse of `state()`; the open round's clock restarts at `now`."""
        self.version = int(meta["version"])
        self.last_round_size = int(meta["last_round_size"])
        if meta["initialized"]:
            self.params = np.array(arrays["params"], np.float32)
            self.published = np.array(arrays["published"], np.float32)
            template = self.opt.init(self.params)
            leaves, treedef = jax.tree_util.tree_flatten(template)
            saved = sum(1 for k in arrays if k.startswith("opt."))
            if saved != len(leaves) or any(
                np.shape(arrays[f"opt.{i}"]) != np.shape(leaf) for i, leaf in enumerate(leaves)
            ):
                raise ValueError(
                    f"fragment {self.index}: the snapshot's outer optimiser state ({saved} arrays) "
                    f"does not fit this shard's optimiser ({len(leaves)}): it was written with "
                    "another --momentum-delay; restart with the setting it was written with"
                )
            self.opt_state = jax.tree_util.tree_unflatten(
                treedef,
                [np.array(arrays[f"opt.{i}"], leaf.dtype) for i, leaf in enumerate(leaves)],
            )
        self.ring.clear()
        for i, v in enumerate(meta["ring"]):
            self.ring.append((int(v), arrays[f"ring.{i}"].tobytes()))
        rs = self.round.state()
        self.round = merge.RoundAccumulator.from_state(
            rs._replace(
                acc=arrays["round.acc"],
                norm_sum=arrays["round.norm_sum"],
                total_weight=meta["round"]["total_weight"],
                count=meta["round"]["count"],
            ),
            self.segments,
            pool=self.round.pool,
        )
        self.full_weight = float(meta["round"].get("full_weight", meta["round"]["total_weight"]))
        self.round_state = self.restamp(meta["contributors"], now)
        self.answers = {k: Answer(**a) for k, a in meta["answers"].items()}
