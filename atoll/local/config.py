"""`atoll up`'s settings: `UpConfig` (the embedded default run), the learners it starts
(`LearnerSpec`), and the run directory (`prepare_run_dir`: new, or a resume checked
against config.json). Read by the command (`atoll.local.up`), the session, the
processes, `atoll chaos` and `atoll bench quality`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

from atoll.learner.config import LearnerConfig, LearnerConfigError, as_flags
from atoll.learner.defaults import (
    BATCH_SIZE,
    CHECKPOINT_EVERY,
    CODEC,
    EVAL_BATCHES,
    FRAGMENTS,
    LATE_MIX,
    OVERLAP,
    PERIOD,
    PRESET,
    SEED,
    STEPS,
    SYNC_PATIENCE,
    SyncConfig,
)
from atoll.server.config import (
    GRACE_FACTOR,
    OUTER_LR,
    OUTER_MOMENTUM,
    OUTER_MOMENTUM_DELAY,
    ConfigError,
    ShardConfig,
)
from atoll.wire.codec import Codec
from atoll.wire.settings import setting

FORMAT = "atoll.up.v1"  # config.json format; bump when UpConfig changes meaning


class UpConfigError(ValueError):
    """A setting that cannot work; the message says how to fix it."""


def _slowdowns(text: str) -> tuple[float, ...]:
    """--slowdown's text: one factor (2) or one per learner (1,1,2,2)."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected one factor (2) or one per learner (1,1,2,2), got {text!r}"
        ) from None


@dataclasses.dataclass(frozen=True)
class UpConfig:
    shards: int = setting(2, "S, syncer shard processes, >= 1, <= --fragments")
    learners: int = setting(4, "M, learner processes, >= 1")
    preset: str = setting(PRESET, "model size: tiny, small, base, large")
    steps: int = setting(STEPS, "inner steps of a full-speed learner, >= 1")
    # resolved in __post_init__ to one factor per learner
    slowdown: tuple[float, ...] = setting(
        (),
        "slowdown factors emulating older accelerators, each >= 1: one for every learner (2) "
        "or one per learner (1,1,2,2)",
        parse=_slowdowns,
        render=lambda v: _flag_text(v),
        default_text="the last M//2 learners at 2",
    )
    same_time: bool = setting(
        True,
        "every learner runs --steps (default: a learner slowed s× runs steps/s, so all "
        "finish at about the same time)",
        name="same-steps",
    )
    # the learners' settings default to the learner's own (learner/config.py), and
    # LearnerConfig checks them: `learner_config` is what each learner runs
    batch_size: int = setting(BATCH_SIZE, "sequences per inner step per learner")
    period: int = setting(PERIOD, "H: inner steps between syncs of a fragment")
    overlap: int = setting(OVERLAP, "τ: steps trained while a sync is in flight, in [0, H)")
    late_mix: float = setting(
        LATE_MIX,
        "α's cap for a sync adopted d steps after its push, past τ: the learner keeps "
        "(d − τ)/H of its own fragment, up to this",
        default_text=f"{LATE_MIX:g}: off",
    )
    fragments: int = setting(FRAGMENTS, "P: fragments, >= --shards")
    codec: str = setting(
        CODEC.name.lower(),
        "wire codec of outer gradients and published deltas",
        choices=("int4", "mxfp4", "fp32"),
    )
    quorum: int | None = setting(
        None,
        "K: learners needed to close a round, in [1, M]",
        default_text="min(2, M)",
    )
    grace_factor: float = (
        GRACE_FACTOR  # γ: multiplies the grace window a round waits for stragglers
    )
    lease_seconds: float = setting(10.0, "a learner silent this long is not waited for")
    max_staleness: int = ShardConfig.max_staleness  # versions a push's base may lag, >= 0
    sync_patience: float = SYNC_PATIENCE  # seconds a learner waits on a round holding its push
    wait_for_rounds: bool = False  # learners adopt each round at push + τ, waiting (lockstep)
    checkpoint_every: int = setting(
        CHECKPOINT_EVERY,
        "steps between learner checkpoints (run_dir/checkpoints), which a restarted learner "
        "resumes from; 0: none",
    )
    outer_lr: float = setting(OUTER_LR, "shards' outer learning rate, > 0")
    outer_momentum: float = setting(OUTER_MOMENTUM, "shards' outer Nesterov momentum, in [0, 1)")
    momentum_delay: int = setting(
        OUTER_MOMENTUM_DELAY,
        "rounds per outer momentum update (delayed Nesterov), >= 1; 1: every round",
    )
    evals: int = setting(6, "held-out evaluations per learner during the run (plus the final one)")
    eval_batches: int = EVAL_BATCHES  # held-out batches per evaluation (rounded up to M's multiple)
    seed: int = setting(SEED, "init and data-order seed")
    baseline: bool = setting(
        False, "afterwards, train the data-parallel baseline on as many tokens, for the loss plot"
    )

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise UpConfigError(message)

        need(self.shards >= 1, f"--shards must be at least 1, got {self.shards}")
        need(self.learners >= 1, f"--learners must be at least 1, got {self.learners}")
        need(self.steps >= 1, f"--steps must be at least 1, got {self.steps}")
        need(
            self.codec in ("int4", "mxfp4", "fp32"),
            f"--codec must be int4, mxfp4 or fp32, got {self.codec!r}",
        )
        need(
            len(self.slowdown) in (0, 1, self.learners),
            f"--slowdown lists {len(self.slowdown)} factors for {self.learners} learners: give one factor "
            f"for all of them or exactly {self.learners}, one per learner",
        )
        need(
            all(math.isfinite(s) and s >= 1 for s in self.slowdown),
            f"--slowdown factors must be >= 1 (1 = full speed), got {list(self.slowdown)}",
        )
        need(self.evals >= 0, f"--evals must be >= 0, got {self.evals}")
        need(self.eval_batches >= 1, f"--eval-batches must be at least 1, got {self.eval_batches}")
        from atoll.learner.trainer.model import PRESETS

        need(
            self.preset in PRESETS,
            f"unknown --preset {self.preset!r}; choose one of {', '.join(PRESETS)}",
        )
        # resolve the defaults that depend on M, so config.json says what actually ran
        slow = self.slowdown or tuple(
            1.0 if i < self.learners - self.learners // 2 else 2.0 for i in range(self.learners)
        )
        object.__setattr__(
            self, "slowdown", tuple(float(s) for s in slow) * (self.learners // len(slow))
        )
        # K = 2: a round merges at least two islands' deltas but never waits for all of them
        # (with K = M, learners blocked on rounds that each need the other can stall)
        quorum = min(2, self.learners) if self.quorum is None else self.quorum
        object.__setattr__(self, "quorum", quorum)
        # at least 1 is ShardConfig's check (below); at most M needs M, so it is this one's
        need(
            quorum <= self.learners,
            f"--quorum must be at most --learners={self.learners}, got {self.quorum}",
        )
        object.__setattr__(
            self, "eval_batches", self.learners * -(-self.eval_batches // self.learners)
        )
        # the shards' and learners' settings are their own: declared and checked once, in
        # ShardConfig and LearnerConfig (which leaves H, τ and the patience to SyncConfig)
        try:
            self.shard_config(0, pathlib.Path("shards/0"), 0)
            for spec in learner_specs(self):
                self.learner_config(spec, [f"127.0.0.1:{i + 1}" for i in range(self.shards)])
        except ConfigError as e:
            raise UpConfigError(str(e)) from None
        except LearnerConfigError as e:  # SyncConfig's words, as `atoll learner` says them
            raise UpConfigError(as_flags(str(e))) from None

    def shard_config(self, index: int, data_dir: pathlib.Path, port: int) -> ShardConfig:
        """Shard `index`'s settings in this run; `ShardConfig.to_args()` is its command line."""
        assert self.quorum is not None  # resolved in __post_init__
        return ShardConfig(
            shard_index=index,
            num_shards=self.shards,
            data_dir=data_dir,
            listen=f"127.0.0.1:{port}",
            metrics_port=0,
            quorum=self.quorum,
            grace_factor=self.grace_factor,
            lease_seconds=self.lease_seconds,
            max_staleness=self.max_staleness,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            momentum_delay=self.momentum_delay,
            publish_codec=Codec[self.codec.upper()],
        )

    def learner_config(self, spec: LearnerSpec, addresses: Sequence[str]) -> LearnerConfig:
        """Learner `spec`'s settings in this run, without its files in the run directory
        (`atoll.local.processes` adds them); `LearnerConfig.to_args()` is its command line.
        The baseline (index -1) trains alone: no shards, no syncs."""
        baseline = spec.index < 0
        return LearnerConfig(
            shards=() if baseline else tuple(addresses),
            learner_id=spec.name,
            learner_index=max(spec.index, 0),
            num_learners=self.learners,
            preset=self.preset,
            batch_size=spec.batch_size,
            steps=spec.steps,
            sync=SyncConfig(
                period=self.period,
                overlap=self.overlap,
                late_mix=self.late_mix,
                codec=Codec[self.codec.upper()],
                patience=self.sync_patience,
                wait_for_rounds=self.wait_for_rounds and not baseline,
            ),
            fragments=self.fragments,
            seed=self.seed,
            eval_every=spec.eval_every,
            eval_batches=spec.eval_batches,
            slowdown=spec.slowdown,
            baseline=baseline,
            checkpoint_every=self.checkpoint_every,
        )

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **dataclasses.asdict(self), "slowdown": list(self.slowdown)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UpConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {
            k: tuple(v) if k == "slowdown" else v for k, v in data.items() if k in fields
        }
        return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class LearnerSpec:
    name: str  # learner id, also the status and log file names
    index: int  # data shard in [0, M); -1 for the baseline
    slowdown: float
    steps: int
    eval_every: int  # 0: only the final evaluation
    eval_batches: int
    batch_size: int


def learner_specs(cfg: UpConfig) -> list[LearnerSpec]:
    """The M learners: a learner slowed s× runs steps/s steps when cfg.same_time."""
    out = []
    for i, slow in enumerate(cfg.slowdown):
        steps = max(1, round(cfg.steps / slow)) if cfg.same_time else cfg.steps
        out.append(
            LearnerSpec(
                f"learner-{i}",
                i,
                slow,
                steps,
                steps // cfg.evals if cfg.evals else 0,
                cfg.eval_batches,
                cfg.batch_size,
            )
        )
    return out


def baseline_spec(cfg: UpConfig) -> LearnerSpec:
    """Data-parallel reference: M× batch for as many tokens as all learners together, and
    1/M of the eval batches of M× the rows, i.e. the same held-out rows as the learners."""
    steps = -(-sum(s.steps for s in learner_specs(cfg)) // cfg.learners)
    return LearnerSpec(
        "baseline",
        -1,
        1.0,
        steps,
        steps // cfg.evals if cfg.evals else 0,
        cfg.eval_batches // cfg.learners,
        cfg.batch_size,
    )


def prepare_run_dir(
    run_dir: pathlib.Path, overrides: dict[str, Any], *, resume: bool = False, parents: bool = True
) -> tuple[UpConfig, bool]:
    """(config, resuming): a new run from `overrides`, or with `resume` the stored one
    after checking them.

    A new run needs `run_dir` missing or empty, and its parent there unless `parents`;
    a resume needs the run there. Raises UpConfigError, saying which flag to use, for
    either one's directory given to the other, a finished run, a directory that is not
    a run, or flags that contradict the stored config.
    """
    config_path = run_dir / "config.json"
    if resume:
        return _resumed(run_dir, overrides), True
    if config_path.exists():
        raise UpConfigError(
            f"{run_dir} already holds a run: resume it with `atoll up --run-dir {run_dir}`, "
            "or give a new directory"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise UpConfigError(f"{run_dir} is a file: give a new directory for the run")
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UpConfigError(
            f"{run_dir} holds files and is not an atoll run directory (no config.json); "
            "give an empty or new directory"
        )
    if not parents and not run_dir.parent.is_dir():
        raise UpConfigError(
            f"{run_dir.parent} does not exist: make it first, or give a directory in one that does"
        )
    cfg = UpConfig(**overrides)
    run_dir.mkdir(parents=parents, exist_ok=True)
    # config.json first: a directory left by a crash here is empty or a run, never a stray
    tmp = config_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg.to_json(), indent=1))
    os.replace(tmp, config_path)
    for sub in ("shards", "learners", "logs"):
        (run_dir / sub).mkdir(exist_ok=True)
    return cfg, False


def _resumed(run_dir: pathlib.Path, overrides: dict[str, Any]) -> UpConfig:
    """The stored config of the run in `run_dir`, once `overrides` are found to agree."""
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        what = "does not exist" if not run_dir.exists() else "holds no atoll run (no config.json)"
        raise UpConfigError(
            f"--run-dir {run_dir} {what}: --run-dir resumes a run; start a new one with "
            f"`atoll up --new-run-dir {run_dir}`, or `atoll up` for runs/<timestamp>"
        )
    stored = json.loads(config_path.read_text())
    if stored.get("format") != FORMAT:
        raise UpConfigError(
            f"{config_path} is format {stored.get('format')!r}, this atoll reads {FORMAT}; "
            "start a new run with --new-run-dir"
        )
    cfg = UpConfig.from_json(stored)
    conflicts = []
    for key, value in overrides.items():
        try:
            same = getattr(UpConfig(**{**dataclasses.asdict(cfg), key: value}), key) == getattr(
                cfg, key
            )
        except UpConfigError:  # e.g. --learners that the stored --slowdown list does not fit
            same = False
        if not same:
            conflicts.append(
                f"--{key.replace('_', '-')} {_flag_text(value)} (the run has "
                f"{_flag_text(getattr(cfg, key))})"
            )
    if conflicts:
        raise UpConfigError(
            f"{run_dir} holds a run started with other settings: "
            + "; ".join(conflicts)
            + f". Resume it with the same flags (or none: `atoll up --run-dir {run_dir}`), "
            "or start a new run with --new-run-dir"
        )
    report = run_dir / "report.json"
    if report.exists() and json.loads(report.read_text()).get("complete"):
        raise UpConfigError(
            f"{run_dir} holds a finished run (see {report}); start a new one with "
            "--new-run-dir, or `atoll up` for runs/<timestamp>"
        )
    return cfg


def _flag_text(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(f"{v:g}" for v in value)
    return str(value)
