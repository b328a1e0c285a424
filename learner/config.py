"""A learner's settings (`LearnerConfig`), their defaults and the environment variables
that give their defaults in a cluster; `atoll.learner.trainer.main` turns flags into one,
`LearnerConfig.to_args()` turns one back into flags, `atoll.learner.trainer.loop` runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import re
import socket
import tempfile
from collections.abc import Callable
from typing import TypeVar

# the learner's defaults (learner/defaults.py), re-exported for whoever builds configs
from atoll.learner.defaults import (  # noqa: F401
    BATCH_SIZE,
    CHECKPOINT_EVERY,
    CODEC,
    DEADLINE,
    EVAL_BATCHES,
    FRAGMENTS,
    JOIN_TIMEOUT,
    LATE_MIX,
    MIX,
    OVERLAP,
    PERIOD,
    PRESET,
    SEED,
    STEPS,
    SYNC_PATIENCE,
    SyncConfig,
    check_types,
)
from atoll.learner.defaults import LearnerConfigError as LearnerConfigError
from atoll.learner.distributed import DistributedConfig, processes
from atoll.wire import settings
from atoll.wire.settings import flag, nested, setting

T = TypeVar("T")


def _need(ok: bool, message: str) -> None:
    """Refuses a setting: LearnerConfigError(message) unless `ok`."""
    if not ok:
        raise LearnerConfigError(message)


ENV_LEARNER_ID = "ATOLL_LEARNER_ID"  # default learner id (Kubernetes: the pod name)


ENV_LEARNER_INDEX = "ATOLL_LEARNER_INDEX"  # default data shard index (JobSet: the job index)


ENV_SHARDS = "ATOLL_SHARDS"  # default shard addresses


ENV_TOKEN_FILE = "ATOLL_TOKEN_FILE"


ENV_COMPILE_CACHE = "ATOLL_COMPILE_CACHE"  # default --compile-cache


ENV_CHECKPOINT_DIR = "ATOLL_CHECKPOINT_DIR"  # default --checkpoint-dir (empty: none)


ENV_CHECKPOINT_EVERY = "ATOLL_CHECKPOINT_EVERY"  # default --checkpoint-every


def devices(text: str) -> int:
    """--fsdp's value: a number of devices, 'all' being 0."""
    if text.strip().lower() == "all":
        return 0
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of devices (or 'all')"
        ) from None


# help's groups of `atoll learner`'s flags (the identity and TLS flags stay ungrouped)
_TRAINING, _SYNC, _FILES = "model and training", "sync", "files, state and standbys"


@dataclasses.dataclass(frozen=True)
class ShardList:
    """--shards and --num-shards: together they give LearnerConfig's `shards` and
    `shard_pattern`; a pattern needs its count, a list must match it."""

    shards: str | None = setting(
        None,
        "shard addresses in index order, 'HOST:PORT,HOST:PORT', or a pattern such as "
        "'atoll-syncer-{i}.atoll-syncer:7070' with --num-shards, the shards asked at join; "
        "a pattern also reaches shards a reshard adds later",
        env=ENV_SHARDS,
    )
    num_shards: int | None = setting(None, "shards, when --shards is a pattern")

    def __post_init__(self) -> None:
        self.addresses()  # a pattern without its count, a bad address: refused here

    def addresses(self) -> tuple[str, ...]:
        """The shards' addresses, in index order (none without --shards)."""
        return () if self.shards is None else shard_addresses(self.shards, self.num_shards)

    def fields(self) -> dict[str, object]:
        """LearnerConfig's fields these flags give."""
        pattern = self.shards if self.shards is not None and "{i}" in self.shards else None
        return {"shards": self.addresses(), "shard_pattern": pattern}

    @staticmethod
    def of(cfg: LearnerConfig) -> ShardList:
        """The flags that give `cfg`'s shards back."""
        if cfg.shard_pattern is not None:
            return ShardList(cfg.shard_pattern, len(cfg.shards))
        return ShardList(",".join(cfg.shards) or None)


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """A learner's settings; `atoll learner`'s flags are its fields' and their nested
    configs' (wire/settings.py), each defaulting to the field's default or, where it names
    one, to its ATOLL_* variable (what a cluster sets)."""

    # shard addresses in index order (empty only with baseline): --shards, --num-shards
    shards: tuple[str, ...] = dataclasses.field(
        default=(), metadata=nested(ShardList, into=ShardList.fields, out_of=ShardList.of)
    )
    # stable across restarts: the shards know a learner by it
    learner_id: str = dataclasses.field(
        default_factory=socket.gethostname,
        metadata=flag(
            "stable name of this learner", env=ENV_LEARNER_ID, default_text="the host name"
        ),
    )
    # --shards as a pattern ('host-{i}:port'): shards past `shards` that a reshard brings
    # in are reached by it (docs/resharding.md); None: only `shards` exist
    shard_pattern: str | None = None
    learner_index: int = setting(
        0, "data shard of this learner in [0, num-learners)", env=ENV_LEARNER_INDEX
    )
    num_learners: int = setting(
        1, "M, learners in the run (data shards; baseline batch multiplier)"
    )
    preset: str = setting(PRESET, "model size: tiny, small, base, large", group=_TRAINING)
    batch_size: int = setting(BATCH_SIZE, "sequences per inner step", group=_TRAINING)
    steps: int = setting(STEPS, "inner steps to run", group=_TRAINING)
    lr: float = setting(3e-3, "inner AdamW peak learning rate", group=_TRAINING)
    warmup: int = setting(20, "inner warm-up steps", group=_TRAINING)
    # H, τ, α, the codec, the patience and the calls' limits: SyncConfig's own settings,
    # defaults and checks; their flags are its fields' (--period, --sync-patience, ...)
    sync: SyncConfig = dataclasses.field(
        default_factory=SyncConfig, metadata=nested(SyncConfig, title=_SYNC)
    )
    fragments: int = setting(FRAGMENTS, "P: fragments; all learners must agree", group=_SYNC)
    seed: int = setting(SEED, "init and data-order seed", group=_TRAINING)
    data: pathlib.Path | None = setting(
        None,
        "text file, directory of text files, or .npy token array "
        "(default: the Python stdlib's sources)",
        group=_TRAINING,
    )
    cache_dir: pathlib.Path | None = setting(
        None, "corpus cache (default ~/.cache/atoll)", group=_TRAINING
    )
    eval_every: int = setting(50, "steps between evaluations; 0: only at the end", group=_TRAINING)
    eval_batches: int = setting(EVAL_BATCHES, "held-out batches per evaluation", group=_TRAINING)
    slowdown: float = setting(
        1.0, "stretch each step X times, emulating an older accelerator", group=_TRAINING
    )
    baseline: bool = setting(False, "data-parallel reference: no syncer, M× batch", group=_TRAINING)
    fsdp: int = setting(
        1,
        "split each param and its optimiser state N ways over the mesh axis 'fsdp' of "
        "the slice's devices (a (data, fsdp) = (devices/N, N) mesh; the batch is split over "
        "all of them); params too small or with no dimension N divides stay replicated; "
        "all (or 0): every device of the slice; 1: replicated",
        parse=devices,
        metavar="N",
        group=_TRAINING,
    )
    token_file: pathlib.Path | None = setting(
        None, "file holding this learner's bearer token", env=ENV_TOKEN_FILE
    )
    tls_ca: pathlib.Path | None = setting(
        None, "PEM CA of the shards' certificates (enables TLS; the Secret's ca.crt)"
    )
    tls_cert: pathlib.Path | None = setting(
        None, "PEM client certificate, for shards that require mutual TLS"
    )
    tls_key: pathlib.Path | None = setting(None, "PEM private key of --tls-cert")
    status_file: pathlib.Path | None = setting(
        None, "append JSON progress records here ({id} stands for the learner id)", group=_FILES
    )
    push_log: pathlib.Path | None = setting(
        None,
        "append one JSON line per answered push here (fragment, seq, accepted, versions; "
        "{id} stands for the learner id)",
        group=_FILES,
    )
    compile_cache: pathlib.Path | None = setting(
        None,
        "directory for compiled programs, so a restarted learner skips compiling (off by default)",
        env=ENV_COMPILE_CACHE,
        group=_FILES,
    )
    metrics_port: int | None = setting(
        None, "Prometheus /metrics port (off by default)", group=_FILES
    )
    lease_exit_wait: float = setting(
        10.0, "seconds to wait at the end for syncs in flight", group=_SYNC
    )
    progress: bool = setting(True, "no progress line", name="quiet", group=_FILES)
    # the slice's processes (learner/distributed.py); None: one
    distributed: DistributedConfig | None = dataclasses.field(
        default=None,
        metadata=nested(
            DistributedConfig,
            title="multi-host learners",
            into=lambda given: {"distributed": processes(given)},
        ),
    )
    checkpoint_dir: pathlib.Path | None = setting(
        None,
        "durable learner state: a checkpoint per learner id, written in the background, "
        "that a restart resumes from (same step, data position and optimiser state); "
        "also where learners claim their ids for standbys (off by default)",
        env=ENV_CHECKPOINT_DIR,
        group=_FILES,
    )
    checkpoint_every: int = setting(
        CHECKPOINT_EVERY,
        "steps between checkpoints; 0: only when stopped by a signal",
        env=ENV_CHECKPOINT_EVERY,
        group=_FILES,
    )
    standby: bool = setting(
        False,
        "load and compile, then wait to take over the id of a failed learner of "
        "--checkpoint-dir (its data shard, status file and checkpoint)",
        group=_FILES,
    )

    def __post_init__(self) -> None:
        self._check_run()
        self._check_modes()
        self._check_paths()

    def _check_run(self) -> None:
        """The run's sizes and the synchronizer's settings."""
        _need(
            self.baseline or len(self.shards) >= 1,
            "--shards is required (HOST:PORT,... in shard index order), or use --baseline",
        )
        _need(bool(self.learner_id), "--learner-id must not be empty")
        in_flags(lambda: self.check_data_shard(self.learner_index, self.num_learners))
        _need(self.steps >= 1, f"--steps must be >= 1, got {self.steps}")
        _need(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        _need(
            self.baseline or self.fragments >= len(self.shards),
            f"--fragments ({self.fragments}) must be at least the number of shards ({len(self.shards)})",
        )
        _need(
            isinstance(self.sync, SyncConfig),
            f"sync must be a SyncConfig, got {type(self.sync).__name__}",
        )
        _need(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        _need(self.slowdown >= 1, f"--slowdown must be >= 1 (1 = full speed), got {self.slowdown}")
        _need(
            self.fsdp >= 0,
            f"--fsdp must be 1 (replicated), a number of devices that divides the slice's, or "
            f"all (0); got {self.fsdp}",
        )
        _need(
            self.lease_exit_wait >= 0,
            f"--lease-exit-wait must be >= 0 seconds, got {self.lease_exit_wait}",
        )
        _need(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")

    def _check_modes(self) -> None:
        """Checkpoints, standby, multi-process, metrics and TLS settings that go together."""
        # the directory and the steps between checkpoints: Checkpointing checks them
        in_flags(lambda: self.checkpoint)
        _need(
            not self.standby or self.checkpoint_dir is not None,
            "--standby needs --checkpoint-dir: the directory where learners claim their ids",
        )
        _need(not self.standby or not self.baseline, "--standby and --baseline do not go together")
        _need(
            self.checkpoint_dir is None or not self.baseline,
            "--checkpoint-dir is for a learner that syncs: the --baseline trains alone and "
            "keeps no checkpoints",
        )
        _need(
            self.distributed is None or not self.standby,
            "--standby is for one-process learners: a multi-host learner's spare is a whole slice, "
            "which its controller (a JobSet) recreates",
        )
        _need(
            self.metrics_port is None or 0 <= self.metrics_port <= 65535,
            f"--metrics-port must be in 1-65535 (0 picks a free one), got {self.metrics_port}",
        )
        _need(
            (self.tls_cert is None) == (self.tls_key is None),
            "--tls-cert and --tls-key go together",
        )
        _need(self.tls_cert is None or self.tls_ca is not None, "--tls-cert needs --tls-ca as well")

    def _check_paths(self) -> None:
        """Files the learner reads and paths it writes: refused here, not by a traceback."""
        # {id} in the token file: a standby sends the token of the id it takes over
        token_dir = self.token_file is not None and "{id}" in pathlib.Path(self.token_file).name
        if token_dir and self.token_file is not None:
            parent = pathlib.Path(self.token_file).parent
            _need(parent.is_dir(), f"--token-file {self.token_file}: no directory {parent}")
        for option, path in (
            ("--token-file", None if token_dir else self.token_file),
            ("--tls-ca", self.tls_ca),
            ("--tls-cert", self.tls_cert),
            ("--tls-key", self.tls_key),
        ):
            _need(path is None or pathlib.Path(path).is_file(), f"{option} {path}: no such file")
        # paths the learner writes: refused here, not once it has loaded
        for option, path, check in (
            ("--compile-cache", self.compile_cache, directory_problem),
            ("--status-file", self.status_file, file_problem),
            ("--push-log", self.push_log, file_problem),
        ):
            try:
                problem = None if path is None else check(pathlib.Path(path))
            except OSError as e:  # e.g. a directory on the way that may not be searched
                problem = e.strerror
            _need(problem is None, f"{option} {path}: {problem}")

    @functools.cached_property
    def checkpoint(self) -> Checkpointing | None:
        """This learner's checkpoint settings (atoll.Learner's `checkpoint=`), made and
        checked once, by __post_init__; None without --checkpoint-dir, where
        --checkpoint-every is still refused if Checkpointing would refuse it."""
        if self.checkpoint_dir is None:
            Checkpointing.check_every(self.checkpoint_every)
            return None
        return Checkpointing(self.checkpoint_dir, self.checkpoint_every, self.standby)

    @staticmethod
    def check_data_shard(index: int, num_learners: int) -> None:
        """Refuses a learner count below 1 or a data shard outside [0, num_learners)
        (atoll.Learner's `index` and `num_learners` are checked here too)."""
        _need(num_learners >= 1, f"num_learners must be >= 1, got {num_learners}")
        _need(
            0 <= index < num_learners,
            f"index (the data shard) must be in [0, num_learners={num_learners}), got {index}",
        )

    def to_args(self) -> list[str]:
        """The `atoll learner` flags that give this config: what a launcher (`atoll up`,
        `atoll chaos`) runs, so each setting is declared and checked here once.

        Every setting is spelled out, defaults too: --learner-index, --checkpoint-every
        and others default from ATOLL_* variables, which must not change what a launcher
        asked for. A setting that is None or False has no flag and is left out, and so is a
        TPU slice's `DistributedConfig()`: the child reads those from its environment.
        """
        args = ["--learner-id", self.learner_id]  # first: `atoll up` logs a child's flags after it
        return args + settings.to_args(self, skip=("learner_id",), every=True)

    def as_learner(self, learner_id: str, learner_index: int) -> LearnerConfig:
        """This config for learner `learner_id` ({id} in the token, status and push-log paths
        filled in)."""

        def fill(path: pathlib.Path | None) -> pathlib.Path | None:
            return None if path is None else pathlib.Path(str(path).replace("{id}", learner_id))

        return dataclasses.replace(
            self,
            learner_id=learner_id,
            learner_index=learner_index,
            standby=False,
            status_file=fill(self.status_file),
            push_log=fill(self.push_log),
            token_file=fill(self.token_file),
        )


# SyncConfig, Checkpointing and the data shard's check name their settings as
# atoll.Learner's arguments; `atoll learner` takes them as flags (SyncConfig's: the flags
# its fields' metadata gives)
_FLAGS = {
    "Checkpointing.directory": "--checkpoint-dir",
    "Checkpointing.every": "--checkpoint-every",
    "index": "--learner-index",
    "num_learners": "--num-learners",
} | {s.name: s.flag for s in settings.settings(SyncConfig)}


def as_flags(message: str) -> str:
    """A SyncConfig, Checkpointing or data shard error in `atoll learner`'s words:
    'overlap (τ) must be in [0, H=4)' -> '--overlap must be in [0, --period=4)'."""
    message = re.sub(r"^([\w.]+)( \([^)]*\))?", lambda m: _FLAGS.get(m[1], m[0]), message)
    return message.replace("H=", "--period=").replace("num_learners=", "--num-learners=")


def in_flags(make: Callable[[], T]) -> T:
    """What `make` makes (a LearnerConfig from flags, or one of its settings objects), its
    refusal in flags' words."""
    try:
        return make()
    except LearnerConfigError as e:
        raise LearnerConfigError(as_flags(str(e))) from None


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """Where a learner keeps its checkpoint and id claim, how often it writes one, and
    whether it waits as a standby (atoll.Learner's `checkpoint=`): each setting's default
    and check, declared once; one that cannot work raises LearnerConfigError naming it.

    A restart with the same directory and id resumes every leaf, as `join`'s dtypes and
    shardings, the step, the sync state (same mesh only) and `step`'s `state`, carrying
    local progress onto the global weights; one live process holds an id at a time.

    Example:
      >>> learner = atoll.Learner(shards, "learner-0", checkpoint=atoll.Checkpointing("ckpt/"))
    """

    # `<directory>/<learner id>/`: the id's claim and Orbax checkpoint (made if missing)
    directory: pathlib.Path
    # steps between background checkpoints, >= 0; 0: only at `save` and `finish`
    every: int = CHECKPOINT_EVERY
    # `join` waits until a learner of this run (same `num_learners`) fails, then takes
    # over its id, data shard (`learner.index`) and checkpoint
    standby: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.directory, (str, os.PathLike)):
            raise LearnerConfigError(
                f"Checkpointing.directory must be a path, got {self.directory!r}"
            )
        object.__setattr__(self, "directory", pathlib.Path(self.directory))
        check_types(self, "Checkpointing.")
        try:
            problem = directory_problem(self.directory)
        except OSError as e:  # e.g. a directory on the way that may not be searched
            problem = e.strerror
        _need(problem is None, f"Checkpointing.directory {self.directory}: {problem}")
        self.check_every(self.every)

    @staticmethod
    def check_every(every: int) -> None:
        """Refuses steps between checkpoints below 0 (LearnerConfig asks too, with no
        --checkpoint-dir)."""
        _need(every >= 0, f"Checkpointing.every must be >= 0 steps, got {every}")


def directory_problem(path: pathlib.Path) -> str | None:
    """Why the learner cannot write in directory `path` (made if missing), or None."""
    if path.exists():
        if not path.is_dir():
            return "not a directory"
        return None if _writable(path) else "not writable"
    existing = next(p for p in path.parents if p.exists())  # "/" or "." at the latest
    if not existing.is_dir():
        return f"cannot be made: {existing} is not a directory"
    if not _writable(existing):
        return f"cannot be made: {existing} is not writable"
    return None


def _writable(directory: pathlib.Path) -> bool:
    """Whether a file can be made in `directory`, tried for real: permission bits say
    nothing to root, and /proc or a read-only mount refuse root too."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def file_problem(path: pathlib.Path) -> str | None:
    """Why the learner cannot append to file `path` (made if missing), or None. A path
    whose directory holds {id} is not checked: each learner id has its own."""
    if "{id}" in str(path.parent):
        return None
    if "{id}" not in path.name:
        if path.is_dir():
            return "a directory, not a file"
        if path.exists():
            return None if os.access(path, os.W_OK) else "not writable"
    if not path.parent.is_dir():
        return f"no directory {path.parent}"
    return None if os.access(path.parent, os.W_OK | os.X_OK) else f"{path.parent} is not writable"


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
        raise LearnerConfigError(
            f"--num-shards {num_shards} but {len(addresses)} addresses in --shards"
        )
    return addresses
