"""`atoll.Learner`'s arguments, checked (learner/api.py): a setting that cannot work
raises LearnerConfigError (a ValueError) saying why, before anything connects."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from typing import Any

from atoll.learner.config import (
    LearnerConfig,
    LearnerConfigError,
    directory_problem,
    shard_addresses,
)
from atoll.learner.sync import SyncConfig
from atoll.wire.client import TlsFiles
from atoll.wire.codec import Codec


def need(ok: bool, message: str) -> None:
    if not ok:
        raise LearnerConfigError(message)


def addresses(
    shards: str | Sequence[str], num_shards: int | None
) -> tuple[str | None, tuple[str, ...]]:
    """(pattern or None, addresses) of `Learner`'s `shards` argument, checked."""
    if isinstance(shards, str):
        pattern = shards if "{i}" in shards else None
        addresses = shard_addresses(shards, num_shards)
    else:
        need(
            not isinstance(shards, (bytes, bytearray)) and all(isinstance(a, str) for a in shards),
            f"shards must be a str or a list of 'host:port' str, got {shards!r}",
        )
        pattern, addresses = None, shard_addresses(",".join(shards), num_shards)
    need(len(addresses) >= 1, "shards names no shard: give 'host:port' of each, in index order")
    return pattern, addresses


def sync_config(
    period: int,
    overlap: int,
    mix: float,
    late_mix: float,
    codec: Codec | str,
    patience: float,
    wait_for_rounds: bool,
    join_timeout: float,
) -> SyncConfig:
    """The sync settings, checked by SyncConfig (its errors as LearnerConfigError)."""
    try:
        wire_codec = Codec[codec.upper()] if isinstance(codec, str) else Codec(codec)
    except (KeyError, ValueError):
        raise LearnerConfigError(
            f"codec {codec!r}: want one of {', '.join(c.name for c in Codec)}"
        ) from None
    try:
        return SyncConfig(
            period=period,
            overlap=overlap,
            mix=mix,
            late_mix=late_mix,
            codec=wire_codec,
            patience=patience,
            wait_for_rounds=wait_for_rounds,
            join_timeout=join_timeout,
        )
    except ValueError as e:
        raise LearnerConfigError(str(e)) from None


def checkpoint_dir(path: str | os.PathLike[str] | None) -> pathlib.Path | None:
    """`checkpoint_dir` as a path the learner can write in (made if missing), or None."""
    if path is None:
        return None
    directory = pathlib.Path(path)
    problem = directory_problem(directory)
    need(problem is None, f"checkpoint_dir {directory}: {problem}")
    return directory


def check(
    *,
    learner_id: str,
    fragments: int,
    num_shards: int,
    deadline: float,
    checkpoint_every: int,
    num_learners: int,
    index: int,
    standby: bool,
    checkpoint_dir: str | os.PathLike[str] | None,
    tls: TlsFiles | None,
) -> None:
    """The Learner's settings that no config dataclass checks, each checked once."""
    need(isinstance(learner_id, str) and learner_id != "", "learner_id must be a nonempty str")
    need(
        isinstance(fragments, int) and fragments >= num_shards,
        f"fragments ({fragments!r}) must be an int, at least the number of shards "
        f"({num_shards}): each shard owns one fragment or more",
    )
    need(deadline > 0, f"deadline must be > 0 seconds, got {deadline}")
    need(checkpoint_every >= 0, f"checkpoint_every must be >= 0 steps, got {checkpoint_every}")
    need(num_learners >= 1, f"num_learners must be >= 1, got {num_learners}")
    need(
        0 <= index < num_learners,
        f"index must be in [0, num_learners={num_learners}), got {index}",
    )
    need(
        not standby or checkpoint_dir is not None,
        "standby=True needs checkpoint_dir: the directory where learners claim their ids",
    )
    need(tls is None or isinstance(tls, TlsFiles), "tls must be an atoll.TlsFiles(ca, cert, key)")


# SyncConfig's settings that are Learner arguments of the same name (`of_config`)
_SYNC_ARGS = (
    "period",
    "overlap",
    "mix",
    "late_mix",
    "codec",
    "patience",
    "wait_for_rounds",
    "join_timeout",
)


def of_config(cfg: LearnerConfig) -> tuple[str | list[str], str, dict[str, Any]]:
    """(shards, learner_id, keyword arguments) of a Learner with `atoll learner`'s
    settings (`Learner.from_config`)."""
    try:
        token = cfg.token_file.read_text().strip() if cfg.token_file else None
    except OSError as e:  # a standby took an id whose token the Secret does not hold
        raise LearnerConfigError(f"--token-file {cfg.token_file}: {e.strerror}") from None
    sync = cfg.sync_config()
    keywords = dict(
        num_shards=len(cfg.shards) if cfg.shard_pattern is not None else None,
        fragments=cfg.fragments,
        token=token,
        tls=TlsFiles(cfg.tls_ca, cfg.tls_cert, cfg.tls_key) if cfg.tls_ca else None,
        checkpoint_dir=cfg.checkpoint_dir,
        checkpoint_every=cfg.checkpoint_every,
        standby=cfg.standby,
        index=cfg.learner_index,
        num_learners=cfg.num_learners,
        deadline=cfg.deadline,
        **{name: getattr(sync, name) for name in _SYNC_ARGS},
    )
    shards = cfg.shard_pattern if cfg.shard_pattern is not None else list(cfg.shards)
    return shards, cfg.learner_id, keywords
