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
from atoll.wire.codec import Codec
from atoll.wire.records import serving_line

if TYPE_CHECKING:
    from atoll.server.service import SyncerServer

log = logging.getLogger("atoll.syncer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The syncer's flags; every default is ShardConfig's."""
    d = ShardConfig.__dataclass_fields__
    p.add_argument(
        "--shard-index",
        type=int,
        default=None,
        help="this shard's index, from 0 (env ATOLL_SHARD_INDEX, or the ordinal ending "
        "ATOLL_POD_NAME); a shard at or past --num-shards starts owning no fragment, until "
        "`atoll reshard` moves some to it",
    )
    p.add_argument(
        "--num-shards",
        type=int,
        default=None,
        help="shards of the run's first layout, fragment p on shard p mod S (env "
        "ATOLL_NUM_SHARDS; default 1); `atoll reshard` changes it while the run goes on",
    )
    p.add_argument(
        "--data-dir",
        type=pathlib.Path,
        default=None,
        help="directory for the write-ahead log and snapshots (env ATOLL_DATA_DIR)",
    )
    p.add_argument(
        "--listen",
        default=d["listen"].default,
        help="HOST:PORT to serve gRPC on; port 0 picks a free one (default %(default)s)",
    )
    _add_round_arguments(p)
    _add_serving_arguments(p)


def _add_round_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of rounds and the outer optimiser: quorum, grace, staleness, codecs."""
    d = ShardConfig.__dataclass_fields__
    p.add_argument(
        "--quorum",
        type=int,
        default=d["quorum"].default,
        help="learners needed to close a round (default %(default)s)",
    )
    p.add_argument(
        "--grace-factor",
        type=float,
        default=d["grace_factor"].default,
        help="γ: share of the overlap slack a round waits for stragglers (default %(default)s)",
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=d["max_staleness"].default,
        help="versions a push's base may lag before it is refused (default %(default)s)",
    )
    p.add_argument(
        "--staleness-discount",
        type=float,
        default=d["staleness_discount"].default,
        help="a in the (1+s)^-a weight discount; 0 disables (default %(default)s)",
    )
    p.add_argument(
        "--lease-seconds",
        type=float,
        default=d["lease_seconds"].default,
        help="a learner counts as live this long after its last call (default %(default)s)",
    )
    p.add_argument(
        "--outer-lr",
        type=float,
        default=d["outer_lr"].default,
        help="outer SGD learning rate (default %(default)s)",
    )
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=d["outer_momentum"].default,
        help="outer Nesterov momentum (default %(default)s)",
    )
    p.add_argument(
        "--momentum-delay",
        type=int,
        default=d["momentum_delay"].default,
        help="rounds per outer momentum update (delayed Nesterov); 1: every round (default %(default)s)",
    )
    p.add_argument(
        "--no-rda",
        action="store_true",
        help="plain weighted average instead of radial-directional averaging",
    )
    p.add_argument(
        "--delta-ring",
        type=int,
        default=d["delta_ring"].default,
        help="published deltas kept for delta pulls (default %(default)s)",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=d["snapshot_every"].default,
        help="rounds between snapshots (default %(default)s)",
    )
    p.add_argument(
        "--publish-codec",
        choices=["int4", "mxfp4", "fp32"],
        default="int4",
        help="codec of published deltas (default %(default)s)",
    )


def _add_serving_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of serving: message and stream limits, tokens, TLS, ports, recovery."""
    d = ShardConfig.__dataclass_fields__
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=d["max_message_bytes"].default,
        help="largest gRPC message accepted (default %(default)s)",
    )
    p.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=d["max_concurrent_streams"].default,
        help="concurrent RPCs per connection (default %(default)s)",
    )
    p.add_argument(
        "--token-file",
        type=pathlib.Path,
        default=None,
        help="bearer tokens, one per line as TOKEN or 'LEARNER_ID TOKEN' (env ATOLL_TOKEN_FILE)",
    )
    p.add_argument("--tls-cert", type=pathlib.Path, help="PEM server certificate (enables TLS)")
    p.add_argument("--tls-key", type=pathlib.Path, help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca",
        type=pathlib.Path,
        help="PEM CA bundle; requires client certificates (mTLS)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus /metrics port, 0 for any free one (off by default)",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also serve grpc.health.v1 alone, in plaintext, on this port of the --listen host "
        "(for probes when the main port uses TLS); 0 for any free one (off by default)",
    )
    p.add_argument(
        "--max-inflight-bytes",
        type=int,
        default=d["max_inflight_bytes"].default,
        help="frame bytes all open Push and Init streams may declare at once (default %(default)s)",
    )
    p.add_argument(
        "--max-connection-inflight-bytes",
        type=int,
        default=d["max_connection_inflight_bytes"].default,
        help="the same for one client connection; also the largest frame (default %(default)s)",
    )
    p.add_argument(
        "--quarantine-record",
        type=int,
        action="append",
        default=[],
        metavar="LSN",
        help="at recovery, copy log record LSN to DATA_DIR/quarantine/ and replay without it; "
        "only when recovery names that record as one it cannot apply (repeatable)",
    )
    p.add_argument(
        "--truncate-damaged-log",
        action="store_true",
        help="at recovery, when the write-ahead log is damaged, set its segments aside "
        "(renamed *.wal.damaged) and go on from the newest snapshot, but only if that "
        "snapshot holds every record of the log (as after a clean stop): nothing on disk says "
        "which records were acknowledged, so a record only the log holds is never dropped; "
        "otherwise recovery still refuses and says what the log alone holds",
    )
    p.add_argument(
        "--stream-idle-seconds",
        type=float,
        default=d["stream_idle_seconds"].default,
        help="a Push or Init stream that sends nothing this long is aborted (default %(default)s)",
    )
    p.add_argument(
        "--part-wait-leases",
        type=float,
        default=d["part_wait_leases"].default,
        help="a push in parts still missing some this many leases after its first part is "
        "dropped, none of it merged (default %(default)s)",
    )


def config_from_args(a: argparse.Namespace) -> ShardConfig:
    """Flags first, then the environment, then defaults."""
    index = a.shard_index if a.shard_index is not None else shard_index_from_env(0)
    assert index is not None  # shard_index_from_env(0) falls back to 0
    num = a.num_shards if a.num_shards is not None else int(os.environ.get(ENV_NUM_SHARDS, "1"))
    data = a.data_dir or (
        pathlib.Path(os.environ[ENV_DATA_DIR]) if os.environ.get(ENV_DATA_DIR) else None
    )
    if data is None:
        raise ConfigError(
            f"--data-dir is required (or set {ENV_DATA_DIR}): the shard's log and snapshots live there"
        )
    token = a.token_file or (
        pathlib.Path(os.environ[ENV_TOKEN_FILE]) if os.environ.get(ENV_TOKEN_FILE) else None
    )
    return ShardConfig(
        shard_index=index,
        num_shards=num,
        data_dir=data,
        listen=a.listen,
        quorum=a.quorum,
        grace_factor=a.grace_factor,
        max_staleness=a.max_staleness,
        staleness_discount=a.staleness_discount,
        lease_seconds=a.lease_seconds,
        outer_lr=a.outer_lr,
        outer_momentum=a.outer_momentum,
        momentum_delay=a.momentum_delay,
        rda=not a.no_rda,
        delta_ring=a.delta_ring,
        snapshot_every=a.snapshot_every,
        publish_codec=Codec[a.publish_codec.upper()],
        max_message_bytes=a.max_message_bytes,
        max_concurrent_streams=a.max_concurrent_streams,
        token_file=token,
        tls_cert=a.tls_cert,
        tls_key=a.tls_key,
        tls_client_ca=a.tls_client_ca,
        metrics_port=a.metrics_port,
        health_port=a.health_port,
        max_inflight_bytes=a.max_inflight_bytes,
        max_connection_inflight_bytes=a.max_connection_inflight_bytes,
        stream_idle_seconds=a.stream_idle_seconds,
        part_wait_leases=a.part_wait_leases,
        quarantine_records=tuple(a.quarantine_record),
        truncate_damaged_log=a.truncate_damaged_log,
    )


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
