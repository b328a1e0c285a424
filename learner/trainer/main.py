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
import logging
import os
import pathlib
import socket
import sys
from typing import Any

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
from atoll.wire.settings import add_flags, from_args

log = logging.getLogger("atoll.learner")


def _env_int(name: str) -> int | None:
    """The whole number in environment variable `name`, None if unset; exit status 2 if malformed."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        print(
            f"atoll learner: environment variable {name} must be a whole number, got {raw!r}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


# the flags of LearnerConfig's fields, by help group (the rest are ungrouped)
_GROUPS = {
    "model and training": (
        "preset",
        "batch_size",
        "steps",
        "lr",
        "warmup",
        "seed",
        "data",
        "cache_dir",
        "eval_every",
        "eval_batches",
        "slowdown",
        "baseline",
        "fsdp",
    ),
    "sync": (
        "period",
        "overlap",
        "mix",
        "late_mix",
        "fragments",
        "codec",
        "wait_for_rounds",
        "sync_patience",
        "deadline",
        "join_timeout",
        "lease_exit_wait",
    ),
    "files, state and standbys": (
        "status_file",
        "push_log",
        "metrics_port",
        "compile_cache",
        "checkpoint_dir",
        "checkpoint_every",
        "standby",
        "progress",
    ),
}
_IDENTITY = (
    "learner_id",
    "learner_index",
    "num_learners",
    "token_file",
    "tls_ca",
    "tls_cert",
    "tls_key",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The learner's flags: LearnerConfig's fields (wire/settings.py), defaulting to its
    defaults or, where set, to the ATOLL_* variables a cluster gives; plus --shards,
    --num-shards and the multi-host flags, which are not one field each."""
    env = _environment_defaults()
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
    add_flags(p, LearnerConfig, only=_IDENTITY, defaults=env)
    for title, names in _GROUPS.items():
        add_flags(p.add_argument_group(title), LearnerConfig, only=names, defaults=env)
    _add_multihost(p.add_argument_group("multi-host learners"))


def _environment_defaults() -> dict[str, Any]:
    """The defaults the ATOLL_* variables set (Kubernetes: the pod name, the job index)."""
    env: dict[str, Any] = {"learner_id": os.environ.get(ENV_LEARNER_ID) or socket.gethostname()}
    for name, var in (
        ("learner_index", ENV_LEARNER_INDEX),
        ("checkpoint_every", ENV_CHECKPOINT_EVERY),
    ):
        number = _env_int(var)
        if number is not None:
            env[name] = number
    for name, var in (
        ("token_file", ENV_TOKEN_FILE),
        ("compile_cache", ENV_COMPILE_CACHE),
        ("checkpoint_dir", ENV_CHECKPOINT_DIR),
    ):
        if os.environ.get(var):
            env[name] = pathlib.Path(os.environ[var])
    return env


def _add_multihost(g: argparse._ArgumentGroup) -> None:
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


def config_from_args(a: argparse.Namespace) -> LearnerConfig:
    """The LearnerConfig the parsed flags give; its own checks run here."""
    shards = () if a.baseline and not a.shards else shard_addresses(a.shards, a.num_shards)
    return from_args(
        LearnerConfig,
        a,
        shards=shards,
        shard_pattern=a.shards if shards and "{i}" in a.shards else None,
        distributed=config_from(a.coordinator, a.num_processes, a.process_id, os.environ),
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
