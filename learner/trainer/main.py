"""`atoll learner`: one island training the model (replicated on its devices, or split
over them with --fsdp) and syncing with the shards.

Thin on purpose: flags become a `LearnerConfig`, then `run(cfg)` loads data, builds
the trainer, joins the syncer (or, with --baseline, trains alone with M× batch as
the data-parallel reference) and loops until --steps, printing a progress line and
appending status records that `atoll up` reads.

Exit status: 0 once the steps are trained; 2 for a setting that cannot work (one line
says which); 128 + the signal (143 for SIGTERM) when a signal stopped it before its end.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import socket
import sys
from typing import Any

from atoll.commands import add_tls_arguments
from atoll.learner.config import (
    ENV_CHECKPOINT_DIR,
    ENV_CHECKPOINT_EVERY,
    ENV_COMPILE_CACHE,
    ENV_LEARNER_ID,
    ENV_LEARNER_INDEX,
    ENV_SHARDS,
    ENV_TOKEN_FILE,
    LearnerConfig,
    LearnerConfigError,
    shard_addresses,
)
from atoll.learner.distributed import (
    DistributedConfigError,
    config_from,
    initialize,
)
from atoll.wire.codec import Codec

log = logging.getLogger("atoll.learner")


def _env_int(name: str, default: int) -> int:
    """The whole number in environment variable `name`, else `default`; exit status 2 if malformed."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        print(
            f"atoll learner: environment variable {name} must be a whole number, got {raw!r}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The learner's flags, defaulting to LearnerConfig's (its `to_args()` renders them)."""
    d = {f.name: f.default for f in dataclasses.fields(LearnerConfig)}
    _add_identity(p, d)
    _add_training(p.add_argument_group("model and training"), d)
    _add_sync(p.add_argument_group("sync"), d)
    _add_state(p.add_argument_group("files, state and standbys"), d)
    _add_multihost(p.add_argument_group("multi-host learners"), d)


def _add_identity(p: argparse.ArgumentParser, d: dict[str, Any]) -> None:
    """Which shards, which learner, and its credentials (ungrouped: the flags every run names)."""
    p.add_argument(
        "--shards",
        default=os.environ.get(ENV_SHARDS, ""),
        help="shard addresses in index order, 'HOST:PORT,HOST:PORT', or a pattern such as "
        "'atoll-syncer-{i}.atoll-syncer:7070' with --num-shards, the shards asked at join; "
        "a pattern also reaches shards a reshard adds later (env ATOLL_SHARDS)",
    )
    p.add_argument(
        "--num-shards", type=int, default=None, help="shards, when --shards is a pattern"
    )
    p.add_argument(
        "--learner-id",
        default=os.environ.get(ENV_LEARNER_ID) or f"{socket.gethostname()}",
        help="stable name of this learner (env ATOLL_LEARNER_ID; default the host name)",
    )
    p.add_argument(
        "--learner-index",
        type=int,
        default=_env_int(ENV_LEARNER_INDEX, d["learner_index"]),
        help="data shard of this learner in [0, num-learners) (env ATOLL_LEARNER_INDEX; "
        "default %(default)s)",
    )
    p.add_argument(
        "--num-learners",
        type=int,
        default=d["num_learners"],
        help="M, learners in the run (default %(default)s)",
    )
    p.add_argument(
        "--token-file",
        type=pathlib.Path,
        default=None,
        help="file holding this learner's bearer token (env ATOLL_TOKEN_FILE)",
    )
    add_tls_arguments(p)  # the same flags as every tool that calls shards


def _add_training(g: argparse._ArgumentGroup, d: dict[str, Any]) -> None:
    """The model, its data and the inner optimiser."""
    g.add_argument(
        "--preset",
        default=d["preset"],
        help="model size: tiny, small, base, large (default %(default)s)",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        default=d["batch_size"],
        help="sequences per inner step (default %(default)s)",
    )
    g.add_argument(
        "--steps", type=int, default=d["steps"], help="inner steps to run (default %(default)s)"
    )
    g.add_argument(
        "--lr",
        type=float,
        default=d["lr"],
        help="inner AdamW peak learning rate (default %(default)s)",
    )
    g.add_argument(
        "--warmup", type=int, default=d["warmup"], help="inner warm-up steps (default %(default)s)"
    )
    g.add_argument(
        "--seed", type=int, default=d["seed"], help="init and data-order seed (default %(default)s)"
    )
    g.add_argument(
        "--data",
        type=pathlib.Path,
        default=None,
        help="text file, directory of text files, or .npy token array (default: the Python stdlib's sources)",
    )
    g.add_argument(
        "--cache-dir", type=pathlib.Path, default=None, help="corpus cache (default ~/.cache/atoll)"
    )
    g.add_argument(
        "--eval-every",
        type=int,
        default=d["eval_every"],
        help="steps between evaluations; 0: only at the end (default %(default)s)",
    )
    g.add_argument(
        "--eval-batches",
        type=int,
        default=d["eval_batches"],
        help="held-out batches per evaluation (default %(default)s)",
    )
    g.add_argument(
        "--slowdown",
        type=float,
        default=d["slowdown"],
        help="stretch each step X times, emulating an older accelerator (default %(default)s)",
    )
    g.add_argument(
        "--baseline", action="store_true", help="data-parallel reference: no syncer, M× batch"
    )
    g.add_argument(
        "--fsdp",
        type=_devices,
        default=d["fsdp"],
        metavar="N",
        help="split each param and its optimiser state N ways over the mesh axis 'fsdp' of "
        "the slice's devices (a (data, fsdp) = (devices/N, N) mesh; the batch is split over "
        "all of them); params too small or with no dimension N divides stay replicated; "
        "all (or 0): every device of the slice; 1: replicated (default %(default)s)",
    )


def _add_sync(g: argparse._ArgumentGroup, d: dict[str, Any]) -> None:
    """Decoupled DiLoCo's settings and the calls to the shards."""
    g.add_argument(
        "--period",
        type=int,
        default=d["period"],
        help="H: inner steps between syncs of a fragment (default %(default)s)",
    )
    g.add_argument(
        "--overlap",
        type=int,
        default=d["overlap"],
        help="τ: steps trained while a sync is in flight (default %(default)s)",
    )
    g.add_argument(
        "--mix",
        type=float,
        default=d["mix"],
        help="α: share of local weights kept when adopting (default %(default)s)",
    )
    g.add_argument(
        "--late-mix",
        type=float,
        default=d["late_mix"],
        help="α's cap for a sync adopted d steps after its push, past τ: α = (d − τ)/H up to "
        "this; helps on links whose round trip spans many steps (default %(default)s: off)",
    )
    g.add_argument(
        "--fragments",
        type=int,
        default=d["fragments"],
        help="P: fragments; all learners must agree (default %(default)s)",
    )
    g.add_argument(
        "--codec",
        choices=["int4", "mxfp4", "fp32"],
        default=d["codec"].name.lower(),
        help="outer-gradient codec (default %(default)s)",
    )
    g.add_argument(
        "--wait-for-rounds",
        action="store_true",
        help="synchronous semantics, for baselines: when a fragment's round is still open a whole "
        "period after its push, stop training until it closes (by default a learner never waits)",
    )
    g.add_argument(
        "--sync-patience",
        type=float,
        default=d["sync_patience"],
        help="seconds to wait on a round holding our push before training on without it "
        "(at least 4 periods of steps; default %(default)s)",
    )
    g.add_argument(
        "--deadline",
        type=float,
        default=d["deadline"],
        help="seconds per call to a shard (default %(default)s)",
    )
    g.add_argument(
        "--join-timeout",
        type=float,
        default=d["join_timeout"],
        help="seconds joining waits for the shards to answer, all retries together "
        "(default %(default)s)",
    )
    g.add_argument(
        "--lease-exit-wait",
        type=float,
        default=d["lease_exit_wait"],
        help="seconds to wait at the end for syncs in flight (default %(default)s)",
    )


def _add_state(g: argparse._ArgumentGroup, d: dict[str, Any]) -> None:
    """What the learner writes and keeps, and standbys."""
    g.add_argument(
        "--status-file",
        type=pathlib.Path,
        help="append JSON progress records here ({id} stands for the learner id)",
    )
    g.add_argument(
        "--push-log",
        type=pathlib.Path,
        help="append one JSON line per answered push here (fragment, seq, accepted, versions; "
        "{id} stands for the learner id)",
    )
    g.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus /metrics port (off by default)"
    )
    g.add_argument(
        "--compile-cache",
        type=pathlib.Path,
        default=pathlib.Path(os.environ[ENV_COMPILE_CACHE])
        if os.environ.get(ENV_COMPILE_CACHE)
        else None,
        help="directory for compiled programs, so a restarted learner skips compiling "
        "(env ATOLL_COMPILE_CACHE; off by default)",
    )
    g.add_argument(
        "--checkpoint-dir",
        type=pathlib.Path,
        default=pathlib.Path(os.environ[ENV_CHECKPOINT_DIR])
        if os.environ.get(ENV_CHECKPOINT_DIR)
        else None,
        help="durable learner state: a checkpoint per learner id, written in the background, "
        "that a restart resumes from (same step, data position and optimiser state); "
        "also where learners claim their ids for standbys (env ATOLL_CHECKPOINT_DIR; off by default)",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=_env_int(ENV_CHECKPOINT_EVERY, d["checkpoint_every"]),
        help="steps between checkpoints; 0: only when stopped by a signal "
        "(env ATOLL_CHECKPOINT_EVERY; default %(default)s)",
    )
    g.add_argument(
        "--standby",
        action="store_true",
        help="load and compile, then wait to take over the id of a failed learner of "
        "--checkpoint-dir (its data shard, status file and checkpoint)",
    )
    g.add_argument("--quiet", action="store_true", help="no progress line")


def _add_multihost(g: argparse._ArgumentGroup, d: dict[str, Any]) -> None:
    """The processes of a learner spanning several hosts (learner/distributed.py)."""
    g.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT of process 0 of a multi-host learner (env ATOLL_COORDINATOR; "
        "a multi-host TPU slice needs none)",
    )
    g.add_argument(
        "--num-processes",
        type=int,
        default=None,
        help="processes (hosts) of a multi-host learner (env ATOLL_NUM_PROCESSES)",
    )
    g.add_argument(
        "--process-id",
        type=int,
        default=None,
        help="this process of a multi-host learner, 0 talks to the syncer (env ATOLL_PROCESS_ID)",
    )


def _devices(text: str) -> int:
    """--fsdp's value: a number of devices, 'all' being 0."""
    if text.strip().lower() == "all":
        return 0
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of devices (or 'all')"
        ) from None


def config_from_args(a: argparse.Namespace) -> LearnerConfig:
    token = a.token_file or (
        pathlib.Path(os.environ[ENV_TOKEN_FILE]) if os.environ.get(ENV_TOKEN_FILE) else None
    )
    shards = () if a.baseline and not a.shards else shard_addresses(a.shards, a.num_shards)
    return LearnerConfig(
        shards=shards,
        shard_pattern=a.shards if shards and "{i}" in a.shards else None,
        learner_id=a.learner_id,
        learner_index=a.learner_index,
        num_learners=a.num_learners,
        preset=a.preset,
        batch_size=a.batch_size,
        steps=a.steps,
        lr=a.lr,
        warmup=a.warmup,
        period=a.period,
        overlap=a.overlap,
        mix=a.mix,
        late_mix=a.late_mix,
        fragments=a.fragments,
        codec=Codec[a.codec.upper()],
        seed=a.seed,
        data=a.data,
        cache_dir=a.cache_dir,
        eval_every=a.eval_every,
        eval_batches=a.eval_batches,
        slowdown=a.slowdown,
        baseline=a.baseline,
        fsdp=a.fsdp,
        token_file=token,
        tls_ca=a.tls_ca,
        tls_cert=a.tls_cert,
        tls_key=a.tls_key,
        status_file=a.status_file,
        push_log=a.push_log,
        sync_patience=a.sync_patience,
        wait_for_rounds=a.wait_for_rounds,
        compile_cache=a.compile_cache,
        metrics_port=a.metrics_port,
        deadline=a.deadline,
        join_timeout=a.join_timeout,
        lease_exit_wait=a.lease_exit_wait,
        progress=not a.quiet,
        distributed=config_from(a.coordinator, a.num_processes, a.process_id, os.environ),
        checkpoint_dir=a.checkpoint_dir,
        checkpoint_every=a.checkpoint_every,
        standby=a.standby,
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The CLI entry: readable errors for user mistakes, never a traceback."""
    from atoll.learner.checkpoint import CheckpointError
    from atoll.learner.sync import SyncError
    from atoll.learner.trainer.data import DataError
    from atoll.learner.trainer.mesh import MeshError
    from atoll.learner.trainer.model import ModelConfigError
    from atoll.learner.trainer.train import TrainConfigError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
    except (LearnerConfigError, DistributedConfigError, ValueError) as e:
        parser.error(str(e))
    initialize(cfg.distributed)  # before anything touches a JAX backend
    try:
        from atoll.learner.trainer.loop import run

        return run(cfg)
    except (
        DataError,
        ModelConfigError,
        TrainConfigError,
        SyncError,
        LearnerConfigError,
        CheckpointError,
        MeshError,
    ) as e:
        print(f"atoll learner: error: {e}", file=sys.stderr)
        return 2
