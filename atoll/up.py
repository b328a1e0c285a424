"""`atoll up`: a whole Decoupled-DiLoCo run on this machine, then a report.

Starts S `atoll syncer` shard processes and M `atoll learner` processes over loopback
(real processes, real gRPC), draws a live table, and at the end pulls the global model
from the shards, evaluates it on the learners' held-out batches, optionally trains the
data-parallel baseline, and writes `report.json` and PNG plots into the run directory.

This module is the settings and the command: `UpConfig` (the embedded default run),
the run directory (`prepare_run_dir`: new, or a resume checked against config.json)
and the flags. `atoll.session` runs it; `atoll.processes` holds the children.

The run directory holds everything, so a run can be resumed (`atoll up --run-dir X`):

    config.json          the UpConfig the run was started with (a resume must match it)
    pids.json            every child process this session started (for tests and humans)
    sessions.jsonl       one line per `atoll up` session: start, end, outcome
    shards/<i>/          shard i's write-ahead log and snapshots
    shards.jsonl         shard metrics sampled over time (versions, rounds, bytes)
    learners/<id>.jsonl  each learner's status records
    checkpoints/         each learner's checkpoint and id claim (a restart resumes from them)
    logs/<name>.log      each child's stdout and stderr
    report.json, loss.png, wire.png, lag.png
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fcntl
import json
import math
import os
import pathlib
import sys

from atoll import progress
from server.config import GRACE_FACTOR, OUTER_LR, OUTER_MOMENTUM, OUTER_MOMENTUM_DELAY

FORMAT = "atoll.up.v1"  # config.json format; bump when UpConfig changes meaning


class UpConfigError(ValueError):
    """A setting that cannot work; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class UpConfig:
    shards: int = 2  # S: syncer shard processes, >= 1, <= fragments
    learners: int = 4  # M: learner processes, >= 1
    preset: str = "small"  # model preset (learner.model.PRESETS)
    steps: int = 200  # inner steps of a full-speed learner, >= 1
    slowdown: tuple[float, ...] = ()  # >= 1: one factor for all learners or one each; () = last M//2 at 2x
    same_time: bool = True  # a learner slowed s× runs steps/s steps, so all islands finish together
    batch_size: int = 16  # sequences per inner step per learner
    period: int = 32  # H: inner steps between two syncs of a fragment
    overlap: int = 1  # τ: steps trained while a sync is in flight, in [0, H)
    fragments: int = 4  # P: fragments, >= shards
    codec: str = "int4"  # outer-gradient and published-delta codec: int4, mxfp4, fp32
    quorum: int = 0  # K: learners to close a round, <= learners; 0 = min(2, M)
    grace_factor: float = GRACE_FACTOR  # γ: multiplies the grace window a round waits for stragglers
    lease_seconds: float = 10.0  # a learner silent this long is not waited for
    max_staleness: int = 4  # versions a push's base may lag before it is refused
    sync_patience: float = 30.0  # seconds a learner waits on a round holding its push, then trains on
    wait_for_rounds: bool = False  # learners block on a round a period late (the lockstep baseline)
    checkpoint_every: int = 50  # steps between learner checkpoints (run_dir/checkpoints), >= 0; 0: none
    outer_lr: float = OUTER_LR  # shards' outer SGD learning rate, > 0
    outer_momentum: float = OUTER_MOMENTUM  # shards' outer Nesterov momentum, in [0, 1)
    momentum_delay: int = OUTER_MOMENTUM_DELAY  # rounds per outer momentum update (delayed Nesterov), >= 1
    evals: int = 6  # held-out evaluations per learner during the run (plus the final one)
    eval_batches: int = 8  # held-out batches per evaluation (rounded up to a multiple of M)
    seed: int = 0  # model init and data order
    baseline: bool = False  # then train the data-parallel baseline (M× batch) for the loss plot

    def __post_init__(self):
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise UpConfigError(message)

        need(self.shards >= 1, f"--shards must be at least 1, got {self.shards}")
        need(self.learners >= 1, f"--learners must be at least 1, got {self.learners}")
        need(self.steps >= 1, f"--steps must be at least 1, got {self.steps}")
        need(self.batch_size >= 1, f"--batch-size must be at least 1, got {self.batch_size}")
        need(self.fragments >= self.shards,
             f"--fragments ({self.fragments}) must be at least --shards ({self.shards}): a shard owns fragments")
        need(self.period >= 1, f"--period must be at least 1, got {self.period}")
        need(0 <= self.overlap < self.period, f"--overlap must be in [0, --period={self.period}), got {self.overlap}")
        need(self.codec in ("int4", "mxfp4", "fp32"), f"--codec must be int4, mxfp4 or fp32, got {self.codec!r}")
        need(len(self.slowdown) in (0, 1, self.learners),
             f"--slowdown lists {len(self.slowdown)} factors for {self.learners} learners: give one factor "
             f"for all of them or exactly {self.learners}, one per learner")
        need(all(math.isfinite(s) and s >= 1 for s in self.slowdown),
             f"--slowdown factors must be >= 1 (1 = full speed), got {list(self.slowdown)}")
        need(0 <= self.quorum <= self.learners, f"--quorum must be in [1, --learners={self.learners}], got {self.quorum}")
        need(self.lease_seconds > 0, f"--lease-seconds must be > 0, got {self.lease_seconds}")
        need(self.grace_factor >= 0, f"--grace-factor must be >= 0, got {self.grace_factor}")
        need(self.sync_patience > 0, f"--sync-patience must be > 0, got {self.sync_patience}")
        need(self.checkpoint_every >= 0, f"--checkpoint-every must be >= 0 (0: no checkpoints), got {self.checkpoint_every}")
        need(self.max_staleness >= 0, f"--max-staleness must be >= 0, got {self.max_staleness}")
        need(self.outer_lr > 0, f"--outer-lr must be > 0, got {self.outer_lr}")
        need(0 <= self.outer_momentum < 1, f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        need(self.momentum_delay >= 1,
             f"--momentum-delay must be at least 1 (1: Nesterov every round), got {self.momentum_delay}")
        need(self.evals >= 0, f"--evals must be >= 0, got {self.evals}")
        need(self.eval_batches >= 1, f"--eval-batches must be at least 1, got {self.eval_batches}")
        from learner.model import PRESETS

        need(self.preset in PRESETS, f"unknown --preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        # resolve the defaults that depend on M, so config.json says what actually ran
        slow = self.slowdown or tuple(1.0 if i < self.learners - self.learners // 2 else 2.0
                                      for i in range(self.learners))
        object.__setattr__(self, "slowdown", tuple(float(s) for s in slow) * (self.learners // len(slow)))
        # K = 2: a round merges at least two islands' deltas but never waits for all of them
        # (with K = M, learners blocked on rounds that each need the other can stall)
        object.__setattr__(self, "quorum", self.quorum or min(2, self.learners))
        object.__setattr__(self, "eval_batches", self.learners * -(-self.eval_batches // self.learners))

    def to_json(self) -> dict:
        return {"format": FORMAT, **dataclasses.asdict(self), "slowdown": list(self.slowdown)}

    @classmethod
    def from_json(cls, data: dict) -> UpConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: tuple(v) if k == "slowdown" else v for k, v in data.items() if k in fields})


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
        out.append(LearnerSpec(f"learner-{i}", i, slow, steps, steps // cfg.evals if cfg.evals else 0,
                               cfg.eval_batches, cfg.batch_size))
    return out


def baseline_spec(cfg: UpConfig) -> LearnerSpec:
    """Data-parallel reference: M× batch for as many tokens as all learners together, and
    1/M of the eval batches of M× the rows, i.e. the same held-out rows as the learners."""
    steps = -(-sum(s.steps for s in learner_specs(cfg)) // cfg.learners)
    return LearnerSpec("baseline", -1, 1.0, steps, steps // cfg.evals if cfg.evals else 0,
                       cfg.eval_batches // cfg.learners, cfg.batch_size)


# -- the run directory ------------------------------------------------------------------------


def prepare_run_dir(run_dir: pathlib.Path, overrides: dict) -> tuple[UpConfig, bool]:
    """(config, resuming): a new run from `overrides`, or the stored one after checking them.

    Raises UpConfigError for a finished run, a directory that is not a run, or flags
    that contradict the stored config.
    """
    config_path = run_dir / "config.json"
    if config_path.exists():
        stored = json.loads(config_path.read_text())
        if stored.get("format") != FORMAT:
            raise UpConfigError(f"{config_path} is format {stored.get('format')!r}, this atoll reads {FORMAT}; "
                                "use a new --run-dir")
        cfg = UpConfig.from_json(stored)
        conflicts = []
        for key, value in overrides.items():
            try:
                same = getattr(UpConfig(**{**dataclasses.asdict(cfg), key: value}), key) == getattr(cfg, key)
            except UpConfigError:  # e.g. --learners that the stored --slowdown list does not fit
                same = False
            if not same:
                conflicts.append(f"--{key.replace('_', '-')} {_flag_text(value)} (the run has "
                                 f"{_flag_text(getattr(cfg, key))})")
        if conflicts:
            raise UpConfigError(f"{run_dir} holds a run started with other settings: " + "; ".join(conflicts)
                                + f". Resume it with the same flags (or none: `atoll up --run-dir {run_dir}`), "
                                "or start a new run with another --run-dir")
        report = run_dir / "report.json"
        if report.exists() and json.loads(report.read_text()).get("complete"):
            raise UpConfigError(f"{run_dir} holds a finished run (see {report}); start a new one with another "
                                "--run-dir, or none for runs/<timestamp>")
        return cfg, True
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UpConfigError(f"{run_dir} exists and is not an atoll run directory (no config.json); "
                            "give an empty or new --run-dir")
    cfg = UpConfig(**overrides)
    for sub in ("shards", "learners", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    tmp = config_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg.to_json(), indent=1))
    os.replace(tmp, config_path)
    return cfg, False


def _flag_text(value) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(f"{v:g}" for v in value)
    return str(value)


# -- the command ----------------------------------------------------------------------------


def _slowdowns(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected one factor (2) or one per learner (1,1,2,2), got {text!r}") from None
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`atoll up` flags; every setting defaults to UpConfig's (None here = not given, so a
    resume can tell which flags were asked for)."""
    d = {f.name: f.default for f in dataclasses.fields(UpConfig)}
    p.add_argument("--run-dir", type=pathlib.Path, default=None,
                   help="run directory (default runs/<timestamp>); an unfinished one is resumed")
    p.add_argument("--shards", type=int, help=f"S, syncer shard processes (default {d['shards']})")
    p.add_argument("--learners", type=int, help=f"M, learner processes (default {d['learners']})")
    p.add_argument("--preset", help=f"model size: tiny, small, base, large (default {d['preset']})")
    p.add_argument("--steps", type=int, help=f"inner steps of a full-speed learner (default {d['steps']})")
    p.add_argument("--slowdown", type=_slowdowns,
                   help="slowdown factors emulating older accelerators: one for every learner (2) or one "
                        "per learner (1,1,2,2); default: the last M//2 learners at 2")
    p.add_argument("--same-steps", dest="same_time", action="store_false", default=None,
                   help="every learner runs --steps (default: a learner slowed s× runs steps/s, "
                        "so all finish at about the same time)")
    p.add_argument("--batch-size", type=int, help=f"sequences per inner step per learner (default {d['batch_size']})")
    p.add_argument("--period", type=int, help=f"H: inner steps between syncs of a fragment (default {d['period']})")
    p.add_argument("--overlap", type=int, help=f"τ: steps trained while a sync is in flight (default {d['overlap']})")
    p.add_argument("--fragments", type=int, help=f"P: fragments (default {d['fragments']})")
    p.add_argument("--codec", choices=["int4", "mxfp4", "fp32"], help=f"wire codec (default {d['codec']})")
    p.add_argument("--quorum", type=int, help="K: learners needed to close a round (default min(2, M))")
    p.add_argument("--lease-seconds", type=float,
                   help=f"a learner silent this long is not waited for (default {d['lease_seconds']:g})")
    p.add_argument("--outer-lr", type=float, help=f"shards' outer learning rate (default {d['outer_lr']:g})")
    p.add_argument("--outer-momentum", type=float,
                   help=f"shards' outer Nesterov momentum (default {d['outer_momentum']:g})")
    p.add_argument("--momentum-delay", type=int,
                   help=f"rounds per outer momentum update (delayed Nesterov); 1: every round "
                        f"(default {d['momentum_delay']})")
    p.add_argument("--checkpoint-every", type=int,
                   help=f"steps between learner checkpoints, which a restarted learner resumes from; 0: none "
                        f"(default {d['checkpoint_every']})")
    p.add_argument("--evals", type=int, help=f"held-out evaluations per learner during the run (default {d['evals']})")
    p.add_argument("--seed", type=int, help=f"init and data-order seed (default {d['seed']})")
    p.add_argument("--baseline", action="store_true", default=None,
                   help="afterwards, train the data-parallel baseline on as many tokens, for the loss plot")
    p.add_argument("--no-table", action="store_true", help="plain log lines instead of the live table")
    p.add_argument("--json", action="store_true", help="print report.json on stdout at the end")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The CLI entry: exit 0 finished, 1 failed, 130/143 stopped by SIGINT/SIGTERM."""
    names = {f.name for f in dataclasses.fields(UpConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in names and v is not None}
    run_dir = args.run_dir or pathlib.Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        cfg, resuming = prepare_run_dir(run_dir, overrides)
    except UpConfigError as e:
        parser.error(str(e))
    lock = open(run_dir / ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        parser.error(f"another `atoll up` is using {run_dir}")
    out = sys.stderr if args.json else sys.stdout
    live = not args.no_table and out.isatty()
    print(f"atoll up: {'resuming' if resuming else 'starting'} {run_dir}: {cfg.shards} shards, {cfg.learners} "
          f"learners ({cfg.preset}, {cfg.steps} steps, slowdown {_flag_text(cfg.slowdown)})", file=out, flush=True)
    from atoll.session import Session

    session = Session(cfg, run_dir, out, live)
    report = session.run()
    if args.json:
        print(json.dumps(report, indent=2))
    print(summary(report, run_dir), file=out, flush=True)
    if session.stop_signal is not None:
        return 128 + session.stop_signal
    if report["failure"] or not any(l["state"] == "done" for l in report["learners"].values()):
        return 1
    return 0


def summary(report: dict, run_dir: pathlib.Path) -> str:
    """The few lines printed at the end."""
    wall = progress.clock(report["wall_seconds"])
    if report.get("interrupted"):
        head = (f"atoll up: interrupted ({report['interrupted']}) after {wall}; children stopped, data kept. "
                f"Resume with: atoll up --run-dir {run_dir}")
    elif report.get("failure"):
        head = f"atoll up: failed after {wall}: {report['failure']}. Resume with: atoll up --run-dir {run_dir}"
    elif not report["complete"]:
        head = (f"atoll up: finished after {wall}, but not every learner did; resume them with: "
                f"atoll up --run-dir {run_dir}")
    else:
        n = len(report["sessions"])
        head = f"atoll up: finished in {wall}" + (f" ({n} sessions)" if n > 1 else "")
    g = report["global"]
    parts = []
    if g.get("eval_loss") is not None:
        parts.append(f"global model eval loss {g['eval_loss']:.4f}")
    if g.get("baseline_eval_loss") is not None:
        parts.append(f"baseline {g['baseline_eval_loss']:.4f}")
    parts.append(f"{g['tokens'] / 1e6:.2f} M tokens")
    if g.get("goodput") is not None:
        parts.append(f"goodput {100 * g['goodput']:.1f}%")
    if g.get("push_bits_per_param") is not None:
        parts.append(f"{g['push_bits_per_param']:.2f} bits/param per push")
    if g.get("pull_bits_per_param") is not None:
        per_version = g.get("pull_bits_per_param_per_version")
        parts.append(f"{g['pull_bits_per_param']:.2f} per pull"
                     + (f" ({per_version:.2f} per version)" if per_version else ""))
    lines = [head, "  " + " | ".join(parts), f"  report: {run_dir / 'report.json'}"]
    if report.get("plots"):
        lines.append("  plots:  " + ", ".join(str(run_dir / p) for p in report["plots"]))
    return "\n".join(lines)
