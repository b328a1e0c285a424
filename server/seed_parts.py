"""A seed in parts: each process of a sharded learner sends the elements of a fragment it
holds (proto `InitHeader.parts`, `part`, `boxes`, `run_id`), and the shard seeds the
fragment once, when the parts of one seeding attempt cover it exactly.

1. A part is judged before anything changes: bounds, overlap with the parts held, its
   count and its run against those held; a refused part changes nothing. Another run's
   part waits (BUSY) while the held run is live, and replaces it once that run is stale.
2. A part is logged (LOG_INIT_PART, its FP32 frame the payload) and synced before it is
   held and acknowledged, so a restart replays every acknowledged part.
3. The last part writes one LOG_INIT of the assembled fragment, the record a whole seed
   writes, and seeds it: the seeded values are those a whole seed of the same values
   gives, bit for bit, and a replay after it never sees the parts again as pending.
4. A retried part (same run, index, boxes and values) is a duplicate and changes nothing.

`SeedParts.judge` is a pure check of the held parts; the shard (server/shard.py) calls it
under its init lock, logs, then `hold`s, the call replaying the log makes too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from atoll.server import parts
from atoll.server.parts import Box
from atoll.server.refusal import ShardError, Why
from atoll.wire.parts import BoxLayout
from atoll.wire.plan import FragmentPlan


@dataclasses.dataclass(frozen=True)
class SeedPart:
    """One part of a seed: which attempt, its index of `parts`, its boxes and values."""

    run: str
    part: int
    parts: int
    boxes: tuple[Box, ...]
    values: np.ndarray  # float32, the boxes' values, box after box, each in C order

    def meta(self, p: int) -> dict[str, object]:
        """The part's log record metadata (its values are the payload)."""
        return {
            "fragment": p,
            "run": self.run,
            "part": self.part,
            "parts": self.parts,
            "boxes": [b.to_json() for b in self.boxes],
        }


@dataclasses.dataclass
class Pending:
    """The held parts of one fragment's seed in progress."""

    run: str
    parts: int
    held: dict[int, SeedPart]
    last: float  # when its newest part was held (replay: when it was replayed)


class SeedParts:
    """Every fragment's seed in progress: {fragment: Pending}. A run's parts block another
    run's (BUSY: retry) until `wait` seconds pass with no part of theirs; then the other
    run's first part replaces them (a learner that died mid-seed never blocks the next)."""

    def __init__(self, clock: Callable[[], float], wait: float) -> None:
        self.pending: dict[int, Pending] = {}
        self.clock, self.wait = clock, wait

    def _held(self, p: int, run: str) -> dict[int, SeedPart]:
        """The parts held of fragment p's seed by `run` (none: another run's or nothing)."""
        pending = self.pending.get(p)
        return dict(pending.held) if pending is not None and pending.run == run else {}

    def judge(self, plan: FragmentPlan, p: int, part: SeedPart) -> bool:
        """Whether `part` is new (False: a duplicate of one held); raises ShardError
        (MALFORMED, OUT_OF_STEP) for a part that does not fit the plan or the parts held."""
        shapes = [tuple(t.spec.shape) for t in plan.tensors_of(p)]
        if not 0 < part.parts <= parts.MAX_PARTS or not 0 <= part.part < part.parts:
            raise ShardError(
                Why.MALFORMED,
                f"seed part {part.part} of {part.parts}: a seed comes in 1 to "
                f"{parts.MAX_PARTS} parts, each index in [0, parts)",
            )
        if not part.run:
            raise ShardError(Why.MALFORMED, "a seed part must name its run_id")
        problem = parts.boxes_problem(part.boxes, shapes)
        if problem is not None:
            raise ShardError(Why.MALFORMED, f"seed part {part.part} of fragment {p}: {problem}")
        size = parts.part_size(part.boxes, shapes)
        if part.values.size != size:
            raise ShardError(
                Why.MALFORMED,
                f"seed part {part.part} of fragment {p}: its boxes hold {size} values, "
                f"its frame {part.values.size}",
            )
        pending = self.pending.get(p)
        if pending is not None and pending.run != part.run:
            idle = self.clock() - pending.last
            if idle < self.wait:
                raise ShardError(
                    Why.BUSY,
                    f"fragment {p} is being seeded by run {pending.run!r}; part of run "
                    f"{part.run!r} refused: retry (its parts are dropped after "
                    f"{self.wait:g} s without one; {idle:.1f} s so far)",
                )
            pending = None  # a stale run: this part replaces it once logged
        if pending is None:
            self._check_cover(plan, p, part, {})
            return True
        if pending.parts != part.parts:
            raise ShardError(
                Why.MALFORMED,
                f"seed part {part.part} of fragment {p} says {part.parts} parts; "
                f"its run's others say {pending.parts}",
            )
        held = pending.held.get(part.part)
        if held is not None:
            if held.boxes == part.boxes and np.array_equal(
                held.values.view(np.uint32), part.values.view(np.uint32)
            ):
                return False
            raise ShardError(
                Why.OUT_OF_STEP,
                f"seed part {part.part} of fragment {p} is held with other boxes or values",
            )
        for other in pending.held.values():
            for a in part.boxes:
                if any(parts.overlap(a, b, shapes) for b in other.boxes):
                    raise ShardError(
                        Why.MALFORMED,
                        f"seed part {part.part} of fragment {p} overlaps part {other.part} "
                        f"in tensor {a.tensor}",
                    )
        self._check_cover(plan, p, part, pending.held)
        return True

    @staticmethod
    def _check_cover(plan: FragmentPlan, p: int, part: SeedPart, held: dict[int, SeedPart]) -> None:
        """Refuses a last part after which the parts would still leave values uncovered."""
        if len(held) + 1 != part.parts:
            return
        total = part.values.size + sum(h.values.size for h in held.values())
        if total != plan.fragment_sizes[p]:
            raise ShardError(
                Why.MALFORMED,
                f"seed part {part.part} of fragment {p} is its last; the {part.parts} parts "
                f"hold {total} of its {plan.fragment_sizes[p]} values",
            )

    def hold(self, p: int, part: SeedPart) -> None:
        """Holds a judged, logged part (replacing another run's parts)."""
        pending = self.pending.get(p)
        if pending is None or pending.run != part.run:
            pending = self.pending[p] = Pending(part.run, part.parts, {}, self.clock())
        pending.held[part.part] = part
        pending.last = self.clock()

    def complete(self, plan: FragmentPlan, p: int, part: SeedPart) -> bool:
        """Whether `part`, with the parts held, makes the seed whole (parts that do not
        overlap and hold every value of the fragment cover it exactly)."""
        held = self._held(p, part.run)
        held[part.part] = part
        return len(held) == part.parts and (
            sum(h.values.size for h in held.values()) == plan.fragment_sizes[p]
        )

    def assemble(self, plan: FragmentPlan, p: int, last: SeedPart) -> np.ndarray:
        """The fragment's values from the parts held and `last`."""
        shapes = [tuple(t.spec.shape) for t in plan.tensors_of(p)]
        out = np.empty(plan.fragment_sizes[p], np.float32)
        held = self._held(p, last.run)
        held[last.part] = last
        for part in held.values():
            layout = BoxLayout.of(shapes, [(b.tensor, b.start, b.stop) for b in part.boxes])
            out[layout.index()] = part.values
        return out

    def state(self, p: int) -> tuple[list[dict[str, object]], dict[str, np.ndarray]]:
        """Fragment p's held parts for a snapshot: their metadata, and their values as
        arrays named seed.<part>."""
        pending = self.pending.get(p)
        if pending is None:
            return [], {}
        held = sorted(pending.held.values(), key=lambda h: h.part)
        return [h.meta(p) for h in held], {f"seed.{h.part}": h.values for h in held}

    def restore(
        self, p: int, metas: list[dict[str, object]], arrays: dict[str, np.ndarray]
    ) -> None:
        """Holds the parts a snapshot kept of fragment p (`state`'s output)."""
        self.pending.pop(p, None)
        for meta in metas:
            boxes = tuple(Box.from_json(b) for b in meta["boxes"])  # type: ignore[attr-defined]
            k = int(meta["part"])  # type: ignore[call-overload]
            part = SeedPart(str(meta["run"]), k, int(meta["parts"]), boxes, arrays[f"seed.{k}"])  # type: ignore[call-overload]
            self.hold(p, part)

    def drop(self, p: int) -> None:
        """Forgets fragment p's parts (it is seeded)."""
        self.pending.pop(p, None)
