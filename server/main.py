"""`atoll syncer`: run one shard until SIGTERM or SIGINT.

Exit status: 0 after a clean stop; 2 for a bad flag or what the host refuses (a port, a
data directory); 3 when the shard did not recover (a damaged log or snapshot, a record it
cannot apply) or its log failed while it served: it stays up NOT_SERVING, the reason on
stdout and in every refusal, until a signal stops it."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import logging
import os
import pathlib
import signal
import tempfile
import threading
from typing import TYPE_CHECKING

from atoll.server.config import (
    ENV_DATA_DIR,
    ENV_NUM_SHARDS,
    ENV_TOKEN_FILE,
    ConfigError,
    ShardConfig,
    load_tokens,
    shard_index_from_env,
)
from atoll.wire import settings
from atoll.wire.records import serving_line

if TYPE_CHECKING:
    from atoll.server.service import SyncerServer

log = logging.getLogger("atoll.syncer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The syncer's flags: one per ShardConfig field, its help and default the field's
    (--shard-index, --num-shards, --data-dir and --token-file, which the environment may
    give instead, have none here: `config_from_args`)."""
    settings.add_flags(p, ShardConfig)


def config_from_args(a: argparse.Namespace) -> ShardConfig:
    """Flags first, then the environment (ATOLL_SHARD_INDEX or ATOLL_POD_NAME,
    ATOLL_NUM_SHARDS, ATOLL_DATA_DIR, ATOLL_TOKEN_FILE), then ShardConfig's defaults; its
    checks run as it is built (a ConfigError)."""
    index = a.shard_index if a.shard_index is not None else shard_index_from_env(0)
    num = a.num_shards if a.num_shards is not None else _env_int(ENV_NUM_SHARDS, 1)
    data = a.data_dir or _env_path(ENV_DATA_DIR)
    if data is None:
        raise ConfigError(
            f"--data-dir is required (or set {ENV_DATA_DIR}): the shard's log and snapshots live there"
        )
    return settings.from_args(
        ShardConfig,
        a,
        shard_index=index,
        num_shards=num,
        data_dir=data,
        token_file=a.token_file or _env_path(ENV_TOKEN_FILE),
    )


def _env_path(name: str) -> pathlib.Path | None:
    return pathlib.Path(os.environ[name]) if os.environ.get(name) else None


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a whole number") from None


MMAP_THRESHOLD_BYTES = 4 << 20  # larger blocks are mapped for themselves, unmapped when freed


def _release_freed_memory() -> None:
    """Makes glibc give large freed blocks back to the OS at once.

    A shard allocates per push and per close buffers of several MB (decompressed codes,
    a closing round's vectors). glibc's threshold for mapping a block by itself grows
    with every such block freed (up to 32 MB), after which they come from, and stay in,
    the heaps of the threads that freed them: ~2 bytes per parameter held for nothing
    (`atoll bench ingest`). A fixed threshold keeps them out of the heaps."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES)
    mallopt(m_trim_threshold, MMAP_THRESHOLD_BYTES)


def _make_data_dir(path: pathlib.Path) -> None:
    """Makes --data-dir where missing; a ConfigError, leaving nothing made, when it cannot
    hold a shard's files."""
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"--data-dir {path} is not a directory: name a directory (made if missing)"
        )
    missing = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    step = "make it"
    try:
        path.mkdir(parents=True, exist_ok=True)
        # a nameless file (O_TMPFILE): a directory that takes no files is found now, not
        # by the write-ahead log with a traceback
        step = "create files in it"
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        for made in missing:
            with contextlib.suppress(OSError):
                made.rmdir()
        raise ConfigError(f"--data-dir {path}: cannot {step} ({e.strerror})") from None


def _open(cfg: ShardConfig) -> SyncerServer:
    """The shard's server, bound to its ports; a ConfigError when another process holds
    the data directory or a port, or gRPC cannot load the TLS files."""
    from atoll.server.service import SyncerServer
    from atoll.server.storage import StorageError

    try:
        return SyncerServer(cfg)
    except StorageError as e:
        if type(e) is not StorageError:  # damage the log found on opening: its own message
            raise
        raise ConfigError(f"--data-dir {cfg.data_dir}: {e}") from None  # the directory's lock


def run(cfg: ShardConfig) -> int:
    """Serves until SIGTERM/SIGINT, then stops cleanly (a final snapshot). A ConfigError
    when this host refuses what cfg asks (a port taken, a data directory it cannot write),
    before anything is served."""
    from atoll.server.serving import check_ports
    from atoll.server.shard import RecoveryStopped

    _release_freed_memory()
    check_ports(cfg)
    _make_data_dir(cfg.data_dir)
    server = _open(cfg)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    try:
        server.start(stop=done)  # a signal ends a long replay too
    except ConfigError:  # the metrics port: nothing served yet
        server.stop(grace=0)
        raise
    except RecoveryStopped as e:
        log.info(
            "shard %d/%d: recovery %s, on a signal; nothing written (the next start replays them)",
            cfg.shard_index,
            cfg.num_shards,
            e,
        )
        server.stop()
        return 0
    if server.shard.recovery_error is not None:
        print(
            f"syncer shard {cfg.shard_index}/{cfg.num_shards} did not recover and serves nothing "
            f"(port {server.port}): {server.shard.recovery_error}",
            flush=True,
        )
        done.wait()
        server.stop()
        return 3
    # What start-up allocated (jax, the recovered state) lives as long as the process:
    # frozen, the cyclic collector stops rescanning it, so its full passes no longer
    # stall the event loop for tens of milliseconds under a crowd of streams.
    gc.freeze()
    print(
        serving_line(
            cfg.shard_index, cfg.num_shards, server.port, server.metrics_port, server.health_port
        ),
        flush=True,
    )
    done.wait()
    server.stop()
    if server.shard.recovery_error is not None:  # its log failed while serving
        print(
            f"syncer shard {cfg.shard_index}/{cfg.num_shards} stopped serving: "
            f"{server.shard.recovery_error}",
            flush=True,
        )
        return 3
    return 0


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`atoll syncer`: a bad flag or token file is a flag error (exit 2), before any replay;
    so is what the host refuses (a port taken, a data directory it cannot write), told in
    one line without the usage."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
        # the files the flags name, before anything is made (a data directory, a log)
        if cfg.token_file is not None:
            load_tokens(cfg.token_file)
        if cfg.tls_cert is not None and cfg.tls_key is not None:
            from atoll.server.certificates import CertificateFiles, check

            check(CertificateFiles(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca))
    except ConfigError as e:
        parser.error(str(e))
    try:
        return run(cfg)
    except ConfigError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
