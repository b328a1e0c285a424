"""A push in parts: each process of a sharded learner sends the elements of a fragment it
holds, and the shard merges the push once, when its parts cover the fragment exactly.

A part names what it carries as boxes, one per tensor piece (`Box`: the tensor's position
in the fragment and a [start, stop) range along each dimension, which is what a jax
shard's `index` already says); its frame holds the boxes' values one after another, each
in C order. Every part of a push carries the same header but for its index and boxes.

The decisions here are pure functions of their arguments (`judge_part`, `expired`): the
shard (server/shard.py) calls them under the fragment's lock, logs what they decide, and
changes the fragment through `Fragment.hold_part` / `contribute_parts` / `drop_parts`, the
calls that replaying the log makes too.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from atoll.wire import assembled, codec
from atoll.wire import parts as wire_parts

MAX_PARTS = 1 << 12  # parts one push may come in (processes of one learner)
MAX_BOXES = 1 << 16  # boxes one part may carry


@dataclasses.dataclass(frozen=True)
class Box:
    """Elements start[d] <= i < stop[d] of tensor `tensor` of a fragment (empty: all of it)."""

    tensor: int
    start: tuple[int, ...] = ()
    stop: tuple[int, ...] = ()

    def bounds(self, shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(start, stop) along every dimension of a tensor of `shape`."""
        if not self.start and not self.stop:
            return (0,) * len(shape), tuple(shape)
        return self.start, self.stop

    def size(self, shape: Sequence[int]) -> int:
        if not self.start and not self.stop:
            return math.prod(shape)
        return math.prod(map(operator.sub, self.stop, self.start))

    def view(self, tensor: np.ndarray) -> np.ndarray:
        """The box's elements of `tensor` (shaped as the tensor), as a writable view."""
        start, stop = self.bounds(tensor.shape)
        out: np.ndarray = tensor[tuple(slice(a, b) for a, b in zip(start, stop))]
        return out

    def to_json(self) -> list[Any]:
        return [self.tensor, list(self.start), list(self.stop)]

    @classmethod
    def from_json(cls, value: Sequence[Any]) -> Box:
        tensor, start, stop = value
        return cls(int(tensor), tuple(map(int, start)), tuple(map(int, stop)))


def box_problem(box: Box, shapes: Sequence[Sequence[int]]) -> str | None:
    """What makes `box` name no non-empty piece of the fragment's tensors `shapes`, or None."""
    if not 0 <= box.tensor < len(shapes):
        return f"box of tensor {box.tensor}: the fragment has {len(shapes)} tensors"
    shape = shapes[box.tensor]
    if (box.start or box.stop) and not (len(box.start) == len(box.stop) == len(shape)):
        return (
            f"box of tensor {box.tensor}: start {list(box.start)} and stop {list(box.stop)} "
            f"must both have one bound per dimension of its shape {list(shape)} (or both be empty)"
        )
    start, stop = box.bounds(shape)
    if any(not 0 <= a < b <= n for a, b, n in zip(start, stop, shape)):
        return (
            f"box of tensor {box.tensor}: [{list(start)}, {list(stop)}) is empty or exceeds "
            f"its shape {list(shape)}"
        )
    return None


def overlap(a: Box, b: Box, shapes: Sequence[Sequence[int]]) -> bool:
    """Whether two valid boxes share an element."""
    if a.tensor != b.tensor:
        return False
    shape = shapes[a.tensor]
    (a0, a1), (b0, b1) = a.bounds(shape), b.bounds(shape)
    return all(max(x0, y0) < min(x1, y1) for x0, x1, y0, y1 in zip(a0, a1, b0, b1))


def boxes_problem(boxes: Sequence[Box], shapes: Sequence[Sequence[int]]) -> str | None:
    """What is wrong with one part's boxes on their own (bounds, overlap), or None."""
    if not boxes:
        return "a part must carry at least one box"
    if len(boxes) > MAX_BOXES:
        return f"{len(boxes)} boxes: at most {MAX_BOXES} per part"
    for box in boxes:
        problem = box_problem(box, shapes)
        if problem is not None:
            return problem
    if len({b.tensor for b in boxes}) == len(boxes):
        return None  # a box per tensor (the usual part): none can overlap another
    index: dict[int, TensorIndex] = {}
    for box in boxes:  # each against those before it
        problem = _overlap_problem([box], index, shapes)
        if problem is not None:
            return problem
        _enter([box], shapes, index)
    return None


class TensorIndex:
    """One tensor's boxes, sorted by where they start along one axis (the one its first
    box splits: FSDP's rows, a tensor-parallel column block), so that a new box is set
    against only the boxes that can reach it there: a box at most `longest` long along
    the axis meets [a, b) only if it starts in (a - longest, b). The parts of a push
    split along that axis are then checked in O(P log P) comparisons, not O(P^2)."""

    def __init__(self, box: Box, shape: Sequence[int]):
        start, stop = box.bounds(shape)
        split = [d for d, (a, b, n) in enumerate(zip(start, stop, shape)) if b - a < n]
        self.axis = split[0] if split else 0
        self.starts: list[int] = []  # each box's start along the axis, ascending
        self.boxes: list[Box] = []  # in the same order
        self.longest = 0  # the longest box's extent along the axis

    def meeting(self, box: Box, shapes: Sequence[Sequence[int]]) -> Box | None:
        """A box held here that shares an element with `box`, or None."""
        a, b = self._extent(box, shapes[box.tensor])
        lo = bisect.bisect_right(self.starts, a - self.longest)
        for other in self.boxes[lo : bisect.bisect_left(self.starts, b)]:
            if overlap(box, other, shapes):
                return other
        return None

    def add(self, box: Box, shape: Sequence[int]) -> None:
        a, b = self._extent(box, shape)
        at = bisect.bisect_right(self.starts, a)
        self.starts.insert(at, a)
        self.boxes.insert(at, box)
        self.longest = max(self.longest, b - a)

    def _extent(self, box: Box, shape: Sequence[int]) -> tuple[int, int]:
        """[a, b) of `box` along the axis; a scalar tensor's one element is [0, 1)."""
        start, stop = box.bounds(shape)
        if not shape:
            return 0, 1
        return start[self.axis], stop[self.axis]


def _overlap_problem(
    new: Sequence[Box], index: Mapping[int, TensorIndex], shapes: Sequence[Sequence[int]]
) -> str | None:
    """The overlap of a box of `new` with one of `index`, or None."""
    for box in new:
        held = index.get(box.tensor)
        other = held.meeting(box, shapes) if held is not None else None
        if other is not None:
            return f"boxes {box.to_json()} and {other.to_json()} overlap"
    return None


def _enter(
    boxes: Sequence[Box], shapes: Sequence[Sequence[int]], index: dict[int, TensorIndex]
) -> None:
    for box in boxes:
        shape = shapes[box.tensor]
        if box.tensor not in index:
            index[box.tensor] = TensorIndex(box, shape)
        index[box.tensor].add(box, shape)


@dataclasses.dataclass
class PartSet:
    """The parts of one push held so far. `header`: what every part must agree on."""

    seq: int
    header: dict[str, Any]
    boxes: dict[int, tuple[Box, ...]]  # part index -> its boxes
    # part index -> its frame as logged: the pieces it arrived in (a stream's chunks,
    # never joined into one copy) or, after a replay or a snapshot, one bytes
    frames: dict[int, bytes | tuple[bytes, ...]]
    started: float  # the shard's clock when its first part came (after a restart: then)
    # part index -> its frame's codes as the live check read them, so the merge does not
    # decompress the frame again (none after a replay or a snapshot: read from the frame)
    codes: dict[int, codec.Codes] = dataclasses.field(default_factory=dict)
    # the held parts' boxes by tensor for the overlap check, and which parts it holds:
    # entered as parts come (`held_index`), never saved
    index: dict[int, TensorIndex] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )
    indexed: set[int] = dataclasses.field(default_factory=set, repr=False, compare=False)

    @property
    def parts(self) -> int:
        return int(self.header["parts"])

    def held_index(self, shapes: Sequence[Sequence[int]]) -> dict[int, TensorIndex]:
        """The boxes of every part held, by tensor (parts held since the last call entered)."""
        for part in sorted(self.boxes.keys() - self.indexed):
            _enter(self.boxes[part], shapes, self.index)
            self.indexed.add(part)
        return self.index


class Step(enum.Enum):
    """What a part does to its push's set of parts."""

    RETRY = "retry"  # this part is already held: answer it as before, change nothing
    HOLD = "hold"  # a new part, more to come: log and hold it
    COMPLETE = "complete"  # the last part: log it, then judge and merge the whole push


def judge_part(
    held: PartSet | None,
    *,
    header: Mapping[str, Any],
    part: int,
    boxes: Sequence[Box],
    shapes: Sequence[Sequence[int]],
    fragment_size: int,
) -> tuple[Step | None, str]:
    """Decides what one part does to its push's parts held so far (same learner and seq).

    Args:
      held: the push's parts already held, or None for its first part.
      header: the part's header fields every part must agree on (with `parts`).
      part, boxes: the part's index and boxes (each already checked by `boxes_problem`).
      shapes: the fragment's tensor shapes, in its order; fragment_size: their sizes' sum.

    Returns:
      (step, "") or (None, why the part is refused: never changes anything). E.g. the
      second of two parts that together leave an element out is (None, "... leave ... out").
    """
    parts = int(header["parts"])
    if not 0 <= part < parts:
        return None, f"part {part} of a push in {parts} parts"
    if held is not None:
        if dict(header) != held.header:
            differ = sorted(k for k in header if header[k] != held.header.get(k))
            return None, f"part {part} disagrees with the push's other parts on {differ}"
        if part in held.boxes:
            if tuple(boxes) != held.boxes[part]:
                return None, f"part {part} is held already, with other boxes"
            return Step.RETRY, ""
    if held is not None:
        problem = _overlap_problem(boxes, held.held_index(shapes), shapes)
        if problem is not None:
            return None, problem
    in_hand = (len(held.boxes) if held else 0) + 1
    if in_hand < parts:
        return Step.HOLD, ""
    others = [b for bs in (held.boxes.values() if held else ()) for b in bs]
    covered = sum(b.size(shapes[b.tensor]) for b in [*others, *boxes])
    if covered != fragment_size:
        return None, (
            f"the push's {parts} parts cover {covered} of the fragment's {fragment_size} "
            "elements: they leave some out"
        )
    return Step.COMPLETE, ""


def expired(
    started: Mapping[str, float], now: float, wait_seconds: float
) -> tuple[list[str], float | None]:
    """(learners whose incomplete parts have waited `wait_seconds` since their first part,
    sorted; when the next of the others will have, or None).

    E.g. expired({"a": 0.0, "b": 5.0}, now=10.0, wait_seconds=8.0) == (["a"], 13.0)."""
    due = sorted(m for m, t in started.items() if now >= t + wait_seconds)
    later = [t + wait_seconds for m, t in started.items() if now < t + wait_seconds]
    return due, min(later) if later else None


def part_size(boxes: Sequence[Box], shapes: Sequence[Sequence[int]]) -> int:
    """Elements a part of `boxes` carries."""
    return sum(b.size(shapes[b.tensor]) for b in boxes)


def assembled_codes(
    held: PartSet,
    out: np.ndarray,
    shapes: Sequence[Sequence[int]],
    offsets: npt.ArrayLike,
    ends: npt.ArrayLike,
) -> codec.Codes:
    """A complete push's parts as Codes of the fragment vector they assemble, which the
    merge reads as it reads a whole push's (`wire.assembled.Assembled`): `out` (float32,
    the fragment's size; tensor t is [offsets[t], ends[t])) is its buffer.

    The norms are taken from the parts as they are read, where a part's block fills a
    fragment block (and from the values written to `out` elsewhere), and the merge adds
    each part's values from its codes where its boxes lie (`BoxLayout`): the same sums
    in the same order as the values pushed whole, with no float32 copy of the push. The
    parts' scales bound each tensor's largest |value| (the bound a whole push's scales
    give), so the merge needs no scan for its overflow check.
    """
    o = np.asarray(offsets, np.int64)
    peaks = np.zeros(len(shapes), np.float64)
    runs = []
    for part in sorted(held.frames):
        boxes = held.boxes[part]
        sizes = np.array([b.size(shapes[b.tensor]) for b in boxes], np.int64)
        codes = held.codes.get(part)
        if codes is None:
            codes = codec.read_codes(held.frames[part], num_values=int(sizes.sum()))
        layout = wire_parts.BoxLayout.of(shapes, [(b.tensor, b.start, b.stop) for b in boxes])
        runs.append(assembled.part_runs(codes, layout.starts, layout.lengths, o))
        box_ends = np.cumsum(sizes)
        box_peaks = codes.range_max_abs(box_ends - sizes, box_ends, exact=False)
        np.maximum.at(peaks, [b.tensor for b in boxes], box_peaks)
    return assembled.Assembled(out, runs, o, ends, peaks)


def assemble(
    out: np.ndarray,
    offsets: Sequence[int],
    shapes: Sequence[Sequence[int]],
    boxes: Sequence[Box],
    values: np.ndarray,
) -> None:
    """Writes a part's `values` (its boxes' elements, box after box, C order) into the
    fragment vector `out` whose tensor t starts at offsets[t]: the plain numpy statement
    of where `assembled_codes` decodes each part."""
    at = 0
    for box in boxes:
        shape = tuple(shapes[box.tensor])
        n = box.size(shape)
        tensor = out[offsets[box.tensor] : offsets[box.tensor] + math.prod(shape)].reshape(shape)
        start, stop = box.bounds(shape)
        box.view(tensor)[...] = values[at : at + n].reshape([b - a for a, b in zip(start, stop)])
        at += n
    assert at == values.size, "a part's frame holds its boxes' elements"
