"""The learner's defaults, declared once, and SyncConfig, the synchronizer's settings:
LearnerConfig (`atoll learner`, learner/config.py re-exports them), SyncConfig (below),
Checkpointing (learner/config.py) and UpConfig (`atoll up`) read them, and
tests/test_defaults.py holds every entry point to them. The built-in benches (`atoll
bench quality`, `atoll chaos`) keep budgets of their own
and say so where they set them."""

from __future__ import annotations

import dataclasses
import numbers

from atoll.wire import codec
from atoll.wire.codec import DEFAULT_CODEC
from atoll.wire.settings import setting

# H = 32: on `atoll bench quality`'s budget the gap to data-parallel training grows with H
# and so does the bandwidth saved: 1.49 / 0.36 / -0.15 % over seeds 0-2 at H = 32 with a
# 277-285x saving, 2.04 / 1.48 / 0.28 % at 48 (docs/rounds.md), so 32 is the largest H
# that stays within about 1 %. `atoll up` and atoll.Learner ran 32; `atoll learner` said 16.
PERIOD = 32  # H: inner steps between two syncs of one fragment
OVERLAP = 1  # τ: steps trained while a sync is in flight
MIX = 0.0  # α: share of local weights kept when adopting (0: the global fragment, as DiLoCo)
LATE_MIX = 0.0  # α's cap for a late adoption, (d − τ)/H after d steps (0: off; docs/rounds.md)
FRAGMENTS = 4  # P: fragments the model is synced in, staggered over the period
CODEC = DEFAULT_CODEC  # outer-gradient codec: the wire's default (int4)
SYNC_PATIENCE = 30.0  # seconds (at least; 4 periods of steps if longer) to wait on a round
CHECKPOINT_EVERY = 50  # steps between background checkpoints
DEADLINE = 60.0  # seconds per RPC to a shard
# seconds `join` waits for the shards to answer, every call and retry together: long
# enough for shards that start with the learners (a pod scheduled, a log replayed), short
# enough that a wrong address fails rather than retrying forever
JOIN_TIMEOUT = 300.0
PRESET = "small"  # model preset (learner.trainer.model.PRESETS)
BATCH_SIZE = 16  # sequences per inner step
STEPS = 200  # inner steps to run
EVAL_BATCHES = 8  # held-out batches per evaluation
SEED = 0  # model init seed and data order


class LearnerConfigError(ValueError):
    """A learner setting that cannot work; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """How a learner syncs with the shards (atoll.Learner's `sync=`): each setting's
    default and check, declared once; a setting that cannot work raises
    LearnerConfigError (a ValueError) naming it.

    Example:
      >>> learner = atoll.Learner(shards, "learner-0", sync=atoll.SyncConfig(period=64))
    """

    # `atoll learner`'s flags are these fields' (wire/settings.py: LearnerConfig nests
    # SyncConfig); max_backoff has none
    period: int = setting(PERIOD, "H: inner steps between syncs of a fragment")  # >= 1
    # τ: steps training continues before adopting a push's result, in [0, H)
    overlap: int = setting(OVERLAP, "τ: steps trained while a sync is in flight")
    # α: share of the local fragment kept when adopting, in [0, 1)
    mix: float = setting(MIX, "α: share of local weights kept when adopting")
    # α's cap for a sync adopted d steps after its push, d past τ: α is then (d − τ)/H up
    # to this, in [0, 1); 0 turns it off (links whose round trip spans many steps)
    late_mix: float = setting(
        LATE_MIX,
        "α's cap for a sync adopted d steps after its push, past τ: α = (d − τ)/H up to "
        "this; helps on links whose round trip spans many steps; 0: off",
    )
    # outer-gradient codec on the wire (a Codec, or its name)
    codec: codec.Codec = setting(CODEC, "outer-gradient codec", choices=("int4", "mxfp4", "fp32"))
    max_backoff: float = 5.0  # seconds, cap of the retry backoff (jittered), > 0
    # seconds (at least; 4 periods of steps if longer) to wait for a round, > 0
    patience: float = setting(
        SYNC_PATIENCE,
        "seconds to wait on a round holding our push before training on without it "
        "(at least 4 periods of steps)",
        name="sync-patience",
        metavar="SYNC_PATIENCE",
    )
    # synchronous semantics: adopt each round τ steps after its push, waiting for it there
    wait_for_rounds: bool = setting(
        False,
        "synchronous semantics, for baselines: adopt each round exactly τ steps after its push, "
        "stopping training there until it closes (by default a learner trains on through late "
        "rounds, waiting only for one two periods late)",
    )
    # seconds join waits for the shards, all retries, > 0
    join_timeout: float = setting(
        JOIN_TIMEOUT, "seconds joining waits for the shards to answer, all retries together"
    )
    deadline: float = setting(DEADLINE, "seconds per call to a shard")  # > 0

    def __post_init__(self) -> None:
        check_types(self)
        object.__setattr__(self, "codec", _codec(self.codec))
        if self.period < 1:
            raise LearnerConfigError(f"period (H) must be at least 1, got {self.period}")
        if not 0 <= self.overlap < self.period:
            raise LearnerConfigError(
                f"overlap (τ) must be in [0, H={self.period}), got {self.overlap}: "
                "a fragment must be adopted before its next sync"
            )
        if not 0 <= self.mix < 1:
            raise LearnerConfigError(f"mix (α) must be in [0, 1), got {self.mix}")
        if not 0 <= self.late_mix < 1:
            raise LearnerConfigError(f"late_mix must be in [0, 1), got {self.late_mix}")
        if self.patience <= 0:
            raise LearnerConfigError(f"patience must be > 0 seconds, got {self.patience}")
        if self.join_timeout <= 0:
            raise LearnerConfigError(f"join_timeout must be > 0 seconds, got {self.join_timeout}")
        if self.deadline <= 0:
            raise LearnerConfigError(f"deadline must be > 0 seconds, got {self.deadline}")
        if self.max_backoff <= 0:
            raise LearnerConfigError(f"max_backoff must be > 0, got {self.max_backoff}")


def _codec(value: object) -> codec.Codec:
    """SyncConfig's codec: a Codec, or its name in any case ('fp32')."""
    if isinstance(value, codec.Codec):
        return value
    if isinstance(value, str) and value.upper() in codec.Codec.__members__:
        return codec.Codec[value.upper()]
    names = ", ".join(c.name.lower() for c in codec.Codec)
    raise LearnerConfigError(f"codec {value!r}: want one of {names}")


# a field's annotation -> what its value may be (numpy's numbers too)
_KINDS = {"int": numbers.Integral, "float": numbers.Real, "bool": bool}


def check_types(settings: object, prefix: str = "") -> None:
    """Refuses a dataclass's int, float or bool field holding something else (a str, a
    bool for a number): LearnerConfigError naming the field, not a TypeError from a
    comparison further on."""
    for field in dataclasses.fields(settings):  # type: ignore[arg-type]
        value, kind = getattr(settings, field.name), _KINDS.get(str(field.type))
        if kind is None:
            continue
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            article = "an" if field.type == "int" else "a"
            raise LearnerConfigError(
                f"{prefix}{field.name} must be {article} {field.type}, got {value!r}"
            )
