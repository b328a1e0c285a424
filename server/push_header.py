"""A push's header as the shard reads it: every field range- and finiteness-checked
(`PushHeader.problem`) before anything is logged."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from atoll.server.parts import MAX_PARTS, Box

# Header bounds. Weights tokens²/steps stay below 2^80 and outer-gradient values below
# MAX_ABS_VALUE, so a round of up to 2^17 pushes cannot overflow its float32 accumulator.
MAX_TOKENS = 1 << 40  # tokens one push may carry (a trillion: more than any sync period trains)
MAX_INNER_STEPS = 1 << 31
MAX_SEQ = (1 << 63) - 1
MAX_STEP_SECONDS = 86400.0  # a step longer than a day is a broken clock, not a slow island
MAX_PERIOD_STEPS = 1 << 20


@dataclasses.dataclass(frozen=True)
class PushHeader:
    learner_id: str
    fragment: int
    base_version: int
    seq: int
    inner_steps: int
    tokens: int
    codec: int
    num_params: int
    plan_fingerprint: str
    step_seconds: float = 0.0
    overlap_steps: int = 0
    period_steps: int = 0  # H of the learner; 0: not given
    last: bool = False  # the learner's last push of this fragment: its rounds stop waiting for it
    parts: int = 0  # a push in this many parts (server/parts.py); 0: a whole push
    part: int = 0  # this part's index, in [0, parts)
    boxes: tuple[Box, ...] = ()  # what this part carries of the fragment

    def agreed(self) -> dict[str, Any]:
        """The fields every part of a push in parts must carry alike."""
        return {name: getattr(self, name) for name in _AGREED}  # not asdict: no deep copies

    def problem(self) -> str | None:
        """What is out of range in this header, or None. Every field is checked here,
        before anything is logged: the timing fields size the grace window and the
        cadence, tokens and steps the merge weight."""
        if not self.learner_id:
            return "learner_id is empty"
        for name, value, low, high in (
            ("inner_steps", self.inner_steps, 1, MAX_INNER_STEPS),
            ("tokens", self.tokens, 1, MAX_TOKENS),
            ("seq", self.seq, 0, MAX_SEQ),
        ):
            if not low <= value <= high:
                return f"{name}={value}: must be in [{low}, {high}]"
        if self.tokens < self.inner_steps:
            return f"tokens={self.tokens} < inner_steps={self.inner_steps}: a step trains on at least one token"
        if not (math.isfinite(self.step_seconds) and 0 <= self.step_seconds <= MAX_STEP_SECONDS):
            return f"step_seconds={self.step_seconds}: must be a finite number in [0, {MAX_STEP_SECONDS}]"
        if not 0 <= self.period_steps <= MAX_PERIOD_STEPS:
            return f"period_steps={self.period_steps}: must be in [0, {MAX_PERIOD_STEPS}]"
        most = self.period_steps - 1 if self.period_steps else MAX_PERIOD_STEPS
        if not 0 <= self.overlap_steps <= most:
            return f"overlap_steps={self.overlap_steps}: must be in [0, {most}] (below period_steps when given)"
        if not 0 <= self.parts <= MAX_PARTS:
            return f"parts={self.parts}: must be in [0, {MAX_PARTS}] (0: a whole push)"
        if self.parts and not 0 <= self.part < self.parts:
            return f"part={self.part}: must be in [0, parts={self.parts})"
        if not self.parts and (self.part or self.boxes):
            return "part and boxes belong to a push in parts: set parts too"
        return None


_OWN = ("part", "boxes", "learner_id", "fragment", "seq")  # what each part has of its own
_AGREED = tuple(f.name for f in dataclasses.fields(PushHeader) if f.name not in _OWN)
