"""`atoll learner`: one island training a full replica and syncing with the shards.

Thin on purpose: flags become a `LearnerConfig`, then `run(cfg)` loads data, builds
the trainer, joins the syncer (or, with --baseline, trains alone with M× batch as
the data-parallel reference) and loops until --steps, printing a progress line and
appending status records that `atoll up` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import socket
import sys

from learner.distributed import DistributedConfig, DistributedConfigError, config_from, initialize
from wire.codec import Codec

log = logging.getLogger("atoll.learner")
ENV_LEARNER_ID = "ATOLL_LEARNER_ID"  # default learner id (Kubernetes: the pod name)
ENV_LEARNER_INDEX = "ATOLL_LEARNER_INDEX"  # default data shard index (JobSet: the job index)
ENV_SHARDS = "ATOLL_SHARDS"  # default shard addresses
ENV_TOKEN_FILE = "ATOLL_TOKEN_FILE"
ENV_COMPILE_CACHE = "ATOLL_COMPILE_CACHE"  # default --compile-cache
ENV_CHECKPOINT_DIR = "ATOLL_CHECKPOINT_DIR"  # default --checkpoint-dir (empty: none)
ENV_CHECKPOINT_EVERY = "ATOLL_CHECKPOINT_EVERY"  # default --checkpoint-every


class LearnerConfigError(ValueError):
    """A learner setting that cannot work; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    shards: tuple[str, ...]  # shard addresses in index order (empty only with baseline)
    learner_id: str  # stable across restarts: the shards know a learner by it
    learner_index: int = 0  # which disjoint data shard this learner reads, in [0, num_learners)
    num_learners: int = 1  # M, learners in the run (data shards; baseline batch multiplier)
    preset: str = "small"  # model preset (learner.model.PRESETS)
    batch_size: int = 16  # sequences per inner step on this learner
    steps: int = 200  # inner steps to run, >= 1
    lr: float = 3e-3  # inner AdamW peak learning rate
    warmup: int = 20  # inner warm-up steps
    period: int = 16  # H: inner steps between syncs of one fragment
    overlap: int = 1  # τ: steps trained while a sync is in flight, in [0, H)
    mix: float = 0.0  # α: share of local weights kept when adopting a global fragment
    fragments: int = 4  # P: fragments (>= shards); every learner and shard must agree
    codec: Codec = Codec.INT4  # outer-gradient codec
    seed: int = 0  # model init seed (the same on every learner) and data order
    data: pathlib.Path | None = None  # text file, directory or .npy tokens; None: the stdlib
    cache_dir: pathlib.Path | None = None  # corpus cache (default ~/.cache/atoll)
    eval_every: int = 50  # steps between held-out evaluations; 0: only at the end
    eval_batches: int = 8  # held-out batches per evaluation
    slowdown: float = 1.0  # >= 1: stretch each step (an older accelerator generation)
    baseline: bool = False  # data-parallel reference: no syncer, M× batch
    token_file: pathlib.Path | None = None  # a file holding this learner's bearer token
    tls_ca: pathlib.Path | None = None  # PEM CA of the shards' certificates (enables TLS)
    tls_cert: pathlib.Path | None = None  # PEM client certificate (mutual TLS)
    tls_key: pathlib.Path | None = None  # its private key
    status_file: pathlib.Path | None = None  # JSON lines of progress, for `atoll up`
    push_log: pathlib.Path | None = None  # JSON lines, one per answered push (for `atoll chaos` audits)
    sync_patience: float = 30.0  # seconds (at least; 4 periods of steps if longer) to wait on a round
    wait_for_rounds: bool = False  # block on a round a whole period late (synchronous semantics)
    compile_cache: pathlib.Path | None = None  # persistent XLA compilation cache: restarts skip compiling
    metrics_port: int | None = None  # Prometheus /metrics; None: off, 0: any free port
    deadline: float = 60.0  # seconds per RPC
    lease_exit_wait: float = 10.0  # seconds to wait at the end for syncs in flight
    progress: bool = True  # print the live progress line
    distributed: DistributedConfig | None = None  # the slice's processes (learner/distributed.py); None: one
    checkpoint_dir: pathlib.Path | None = None  # durable learner state and id claims (learner/checkpoint.py)
    checkpoint_every: int = 50  # steps between background checkpoints, >= 0 (0: only when stopped)
    standby: bool = False  # wait, compiled, to take over a failed learner's id (learner/standby.py)

    def __post_init__(self):
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise LearnerConfigError(message)

        need(self.baseline or len(self.shards) >= 1,
             "--shards is required (HOST:PORT,... in shard index order), or use --baseline")
        need(bool(self.learner_id), "--learner-id must not be empty")
        need(self.num_learners >= 1, f"--num-learners must be >= 1, got {self.num_learners}")
        need(0 <= self.learner_index < self.num_learners,
             f"--learner-index must be in [0, {self.num_learners}), got {self.learner_index}")
        need(self.steps >= 1, f"--steps must be >= 1, got {self.steps}")
        need(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        need(self.baseline or self.fragments >= len(self.shards),
             f"--fragments ({self.fragments}) must be at least the number of shards ({len(self.shards)})")
        need(self.period >= 1, f"--period must be >= 1, got {self.period}")
        need(0 <= self.overlap < self.period,
             f"--overlap must be in [0, --period={self.period}), got {self.overlap}: a fragment is "
             "adopted before its next sync")
        need(0 <= self.mix < 1, f"--mix must be in [0, 1), got {self.mix}")
        need(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        need(self.slowdown >= 1, f"--slowdown must be >= 1 (1 = full speed), got {self.slowdown}")
        need(self.sync_patience > 0, f"--sync-patience must be > 0 seconds, got {self.sync_patience}")
        need(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")
        need(self.checkpoint_every >= 0, f"--checkpoint-every must be >= 0 steps, got {self.checkpoint_every}")
        need(not self.standby or self.checkpoint_dir is not None,
             "--standby needs --checkpoint-dir: the directory where learners claim their ids")
        need(not self.standby or not self.baseline, "--standby and --baseline do not go together")
        need(self.distributed is None or not self.standby,
             "--standby is for one-process learners: a multi-host learner's spare is a whole slice, "
             "which its controller (a JobSet) recreates")
        need(self.metrics_port is None or 0 <= self.metrics_port <= 65535,
             f"--metrics-port must be in 1-65535 (0 picks a free one), got {self.metrics_port}")
        need((self.tls_cert is None) == (self.tls_key is None), "--tls-cert and --tls-key go together")
        need(self.tls_cert is None or self.tls_ca is not None, "--tls-cert needs --tls-ca as well")
        for flag, path in (("--token-file", self.token_file), ("--tls-ca", self.tls_ca),
                           ("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            need(path is None or pathlib.Path(path).is_file(), f"{flag} {path}: no such file")

    def as_learner(self, learner_id: str, learner_index: int) -> LearnerConfig:
        """This config for learner `learner_id` ({id} in the status and push-log paths filled in)."""
        def fill(path):
            return None if path is None else pathlib.Path(str(path).replace("{id}", learner_id))

        return dataclasses.replace(self, learner_id=learner_id, learner_index=learner_index, standby=False,
                                   status_file=fill(self.status_file), push_log=fill(self.push_log))


def shard_addresses(spec: str, num_shards: int | None) -> tuple[str, ...]:
    """'h0:p,h1:p' as given, or a pattern with {i} expanded for i < num_shards."""
    if "{i}" in spec:
        if not num_shards:
            raise LearnerConfigError(f"--shards {spec!r} is a pattern: give --num-shards too")
        addresses = tuple(spec.replace("{i}", str(i)) for i in range(num_shards))
    else:
        addresses = tuple(a.strip() for a in spec.split(",") if a.strip())
    for a in addresses:
        host, _, port = a.rpartition(":")
        if not host:
            raise LearnerConfigError(f"shard address {a!r} must be HOST:PORT")
        if not (port.isdigit() and 1 <= int(port) <= 65535):
            raise LearnerConfigError(f"shard address {a!r}: the port must be in 1-65535")
    if "{i}" not in spec and num_shards is not None and num_shards != len(addresses):
        raise LearnerConfigError(f"--num-shards {num_shards} but {len(addresses)} addresses in --shards")
    return addresses


def _env_int(name: str, default: int) -> int:
    """The whole number in environment variable `name`, else `default`; exit status 2 if malformed."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        print(f"atoll learner: environment variable {name} must be a whole number, got {raw!r}", file=sys.stderr)
        raise SystemExit(2) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The learner's flags; defaults are LearnerConfig's."""
    d = {f.name: f.default for f in dataclasses.fields(LearnerConfig)}
    p.add_argument("--shards", default=os.environ.get(ENV_SHARDS, ""),
                   help="shard addresses in index order, 'HOST:PORT,HOST:PORT', or a pattern such as "
                        "'atoll-syncer-{i}.atoll-syncer:7070' with --num-shards (env ATOLL_SHARDS)")
    p.add_argument("--num-shards", type=int, default=None, help="shards, when --shards is a pattern")
    p.add_argument("--learner-id", default=os.environ.get(ENV_LEARNER_ID) or f"{socket.gethostname()}",
                   help="stable name of this learner (env ATOLL_LEARNER_ID; default the host name)")
    p.add_argument("--learner-index", type=int, default=int(os.environ.get(ENV_LEARNER_INDEX, "0")),
                   help="data shard of this learner in [0, num-learners) (env ATOLL_LEARNER_INDEX)")
    p.add_argument("--num-learners", type=int, default=d["num_learners"], help="M, learners in the run (default %(default)s)")
    p.add_argument("--preset", default=d["preset"], help="model size: tiny, small, base, large (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d["batch_size"], help="sequences per inner step (default %(default)s)")
    p.add_argument("--steps", type=int, default=d["steps"], help="inner steps to run (default %(default)s)")
    p.add_argument("--lr", type=float, default=d["lr"], help="inner AdamW peak learning rate (default %(default)s)")
    p.add_argument("--warmup", type=int, default=d["warmup"], help="inner warm-up steps (default %(default)s)")
    p.add_argument("--period", type=int, default=d["period"], help="H: inner steps between syncs of a fragment (default %(default)s)")
    p.add_argument("--overlap", type=int, default=d["overlap"], help="τ: steps trained while a sync is in flight (default %(default)s)")
    p.add_argument("--mix", type=float, default=d["mix"], help="α: share of local weights kept when adopting (default %(default)s)")
    p.add_argument("--fragments", type=int, default=d["fragments"], help="P: fragments; all learners must agree (default %(default)s)")
    p.add_argument("--codec", choices=["int4", "mxfp4", "fp32"], default="int4", help="outer-gradient codec (default %(default)s)")
    p.add_argument("--seed", type=int, default=d["seed"], help="init and data-order seed (default %(default)s)")
    p.add_argument("--data", type=pathlib.Path, default=None,
                   help="text file, directory of text files, or .npy token array (default: the Python stdlib's sources)")
    p.add_argument("--cache-dir", type=pathlib.Path, default=None, help="corpus cache (default ~/.cache/atoll)")
    p.add_argument("--eval-every", type=int, default=d["eval_every"], help="steps between evaluations; 0: only at the end (default %(default)s)")
    p.add_argument("--eval-batches", type=int, default=d["eval_batches"], help="held-out batches per evaluation (default %(default)s)")
    p.add_argument("--slowdown", type=float, default=d["slowdown"],
                   help="stretch each step X times, emulating an older accelerator (default %(default)s)")
    p.add_argument("--baseline", action="store_true", help="data-parallel reference: no syncer, M× batch")
    p.add_argument("--token-file", type=pathlib.Path, default=None, help="file holding this learner's bearer token (env ATOLL_TOKEN_FILE)")
    p.add_argument("--tls-ca", type=pathlib.Path, help="PEM CA of the shards' certificates (enables TLS)")
    p.add_argument("--tls-cert", type=pathlib.Path, help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", type=pathlib.Path, help="PEM private key of --tls-cert")
    p.add_argument("--status-file", type=pathlib.Path,
                   help="append JSON progress records here ({id} stands for the learner id)")
    p.add_argument("--push-log", type=pathlib.Path,
                   help="append one JSON line per answered push here (fragment, seq, accepted, versions; "
                        "{id} stands for the learner id)")
    p.add_argument("--wait-for-rounds", action="store_true",
                   help="synchronous semantics, for baselines: when a fragment's round is still open a whole "
                        "period after its push, stop training until it closes (by default a learner never waits)")
    p.add_argument("--sync-patience", type=float, default=d["sync_patience"],
                   help="seconds to wait on a round holding our push before training on without it "
                        "(at least 4 periods of steps; default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (off by default)")
    p.add_argument("--compile-cache", type=pathlib.Path,
                   default=pathlib.Path(os.environ[ENV_COMPILE_CACHE]) if os.environ.get(ENV_COMPILE_CACHE) else None,
                   help="directory for compiled programs, so a restarted learner skips compiling "
                        "(env ATOLL_COMPILE_CACHE; off by default)")
    p.add_argument("--checkpoint-dir", type=pathlib.Path,
                   default=pathlib.Path(os.environ[ENV_CHECKPOINT_DIR]) if os.environ.get(ENV_CHECKPOINT_DIR) else None,
                   help="durable learner state: a checkpoint per learner id, written in the background, "
                        "that a restart resumes from (same step, data position and optimiser state); "
                        "also where learners claim their ids for standbys (env ATOLL_CHECKPOINT_DIR; off by default)")
    p.add_argument("--checkpoint-every", type=int, default=_env_int(ENV_CHECKPOINT_EVERY, d["checkpoint_every"]),
                   help="steps between checkpoints; 0: only when stopped by a signal "
                        "(env ATOLL_CHECKPOINT_EVERY; default %(default)s)")
    p.add_argument("--standby", action="store_true",
                   help="load and compile, then wait to take over the id of a failed learner of "
                        "--checkpoint-dir (its data shard, status file and checkpoint)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--coordinator", default=None,
                   help="HOST:PORT of process 0 of a multi-host learner (env ATOLL_COORDINATOR; "
                        "a multi-host TPU slice needs none)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="processes (hosts) of a multi-host learner (env ATOLL_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=None,
                   help="this process of a multi-host learner, 0 talks to the syncer (env ATOLL_PROCESS_ID)")


def config_from_args(a: argparse.Namespace) -> LearnerConfig:
    token = a.token_file or (pathlib.Path(os.environ[ENV_TOKEN_FILE]) if os.environ.get(ENV_TOKEN_FILE) else None)
    shards = () if a.baseline and not a.shards else shard_addresses(a.shards, a.num_shards)
    return LearnerConfig(
        shards=shards, learner_id=a.learner_id, learner_index=a.learner_index, num_learners=a.num_learners,
        preset=a.preset, batch_size=a.batch_size, steps=a.steps, lr=a.lr, warmup=a.warmup, period=a.period,
        overlap=a.overlap, mix=a.mix, fragments=a.fragments, codec=Codec[a.codec.upper()], seed=a.seed,
        data=a.data, cache_dir=a.cache_dir, eval_every=a.eval_every, eval_batches=a.eval_batches,
        slowdown=a.slowdown, baseline=a.baseline, token_file=token, tls_ca=a.tls_ca, tls_cert=a.tls_cert,
        tls_key=a.tls_key, status_file=a.status_file, push_log=a.push_log,
        sync_patience=a.sync_patience, wait_for_rounds=a.wait_for_rounds, compile_cache=a.compile_cache, metrics_port=a.metrics_port, progress=not a.quiet,
        distributed=config_from(a.coordinator, a.num_processes, a.process_id, os.environ),
        checkpoint_dir=a.checkpoint_dir, checkpoint_every=a.checkpoint_every, standby=a.standby)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The CLI entry: readable errors for user mistakes, never a traceback."""
    from learner.checkpoint import CheckpointError
    from learner.data import DataError
    from learner.model import ModelConfigError
    from learner.sync import SyncError
    from learner.train import TrainConfigError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
    except (LearnerConfigError, DistributedConfigError, ValueError) as e:
        parser.error(str(e))
    initialize(cfg.distributed)  # before anything touches a JAX backend
    try:
        from learner.loop import run

        return run(cfg)
    except (DataError, ModelConfigError, TrainConfigError, SyncError, LearnerConfigError, CheckpointError) as e:
        print(f"atoll learner: error: {e}", file=sys.stderr)
        return 2
