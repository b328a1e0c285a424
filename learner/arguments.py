"""`atoll.Learner`'s settings (`Arguments`), each checked once: `checked` checks the
constructor's own arguments (those no config dataclass holds: shards, id, fragments, data
shard, TLS), raising LearnerConfigError (a ValueError) saying why before anything
connects; `sync` and `checkpoint` must be the configs that checked theirs (SyncConfig,
Checkpointing). `of_config` takes a LearnerConfig's as they are: it checked them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from atoll.learner.config import (
    Checkpointing,
    LearnerConfig,
    LearnerConfigError,
    shard_addresses,
)
from atoll.learner.defaults import SyncConfig
from atoll.wire.client import TlsFiles


@dataclasses.dataclass(frozen=True)
class Arguments:
    """A Learner's settings, checked: by `checked` or by the LearnerConfig they come of."""

    pattern: str | None  # the shards' pattern ("host-{i}:port"), or None
    addresses: tuple[str, ...]  # the shards', in index order
    learner_id: str
    fragments: int
    sync: SyncConfig
    checkpoint: Checkpointing | None
    index: int
    num_learners: int
    token: str | None
    tls: TlsFiles | None


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


def settings(
    sync: SyncConfig | None, checkpoint: Checkpointing | None
) -> tuple[SyncConfig, Checkpointing | None]:
    """`Learner`'s `sync` (None: SyncConfig's defaults) and `checkpoint`, of the right
    types: each checked its settings when it was made."""
    if not isinstance(sync, (SyncConfig, type(None))):
        raise TypeError(
            f"sync must be an atoll.SyncConfig, got {type(sync).__name__}: "
            "e.g. sync=atoll.SyncConfig(period=64)"
        )
    if not isinstance(checkpoint, (Checkpointing, type(None))):
        raise TypeError(
            f"checkpoint must be an atoll.Checkpointing or None, got "
            f"{type(checkpoint).__name__}: e.g. checkpoint=atoll.Checkpointing('ckpt/')"
        )
    return sync or SyncConfig(), checkpoint


def check(
    *,
    learner_id: str,
    fragments: int,
    num_shards: int,
    num_learners: int,
    index: int,
    tls: TlsFiles | None,
) -> None:
    """The Learner's own settings, each checked once: those no config dataclass holds here,
    the data shard and learner count by LearnerConfig's check, as `atoll learner`'s are."""
    need(isinstance(learner_id, str) and learner_id != "", "learner_id must be a nonempty str")
    need(
        isinstance(fragments, int) and fragments >= num_shards,
        f"fragments ({fragments!r}) must be an int, at least the number of shards "
        f"({num_shards}): each shard owns one fragment or more",
    )
    LearnerConfig.check_data_shard(index, num_learners)
    need(tls is None or isinstance(tls, TlsFiles), "tls must be an atoll.TlsFiles(ca, cert, key)")


def checked(
    shards: str | Sequence[str],
    learner_id: str,
    *,
    num_shards: int | None,
    fragments: int,
    sync: SyncConfig | None,
    checkpoint: Checkpointing | None,
    index: int,
    num_learners: int,
    token: str | None,
    tls: TlsFiles | None,
) -> Arguments:
    """`atoll.Learner`'s arguments, each checked here once."""
    pattern, found = addresses(shards, num_shards)
    sync, checkpoint = settings(sync, checkpoint)
    check(
        learner_id=learner_id,
        fragments=fragments,
        num_shards=len(found),
        num_learners=num_learners,
        index=index,
        tls=tls,
    )
    return Arguments(
        pattern, found, learner_id, fragments, sync, checkpoint, index, num_learners, token, tls
    )


def of_config(cfg: LearnerConfig) -> Arguments:
    """A Learner's settings with `atoll learner`'s (`Learner.from_config`): the ones
    LearnerConfig made and checked (its shards, id, data shard, `sync`, `checkpoint`),
    not checked again, and the token its file holds."""
    need(len(cfg.shards) >= 1, "--shards names no shard (a --baseline trains alone)")
    try:
        token = cfg.token_file.read_text().strip() if cfg.token_file else None
    except OSError as e:  # a standby took an id whose token the Secret does not hold
        raise LearnerConfigError(f"--token-file {cfg.token_file}: {e.strerror}") from None
    return Arguments(
        pattern=cfg.shard_pattern,
        addresses=cfg.shards,
        learner_id=cfg.learner_id,
        fragments=cfg.fragments,
        sync=cfg.sync,
        checkpoint=cfg.checkpoint,
        index=cfg.learner_index,
        num_learners=cfg.num_learners,
        token=token,
        tls=TlsFiles(cfg.tls_ca, cfg.tls_cert, cfg.tls_key) if cfg.tls_ca else None,
    )
