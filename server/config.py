"""Settings of one syncer shard, validated at construction."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re

from atoll.server import rules
from atoll.wire import settings
from atoll.wire.codec import Codec
from atoll.wire.settings import setting

# Environment overrides, for Kubernetes: the StatefulSet sets the shard index from
# the pod ordinal (ATOLL_SHARD_INDEX, or a pod name ending in -N via ATOLL_POD_NAME).
ENV_SHARD_INDEX = "ATOLL_SHARD_INDEX"
ENV_POD_NAME = "ATOLL_POD_NAME"
ENV_NUM_SHARDS = "ATOLL_NUM_SHARDS"
ENV_DATA_DIR = "ATOLL_DATA_DIR"
ENV_TOKEN_FILE = "ATOLL_TOKEN_FILE"


# The outer optimiser's defaults (DiLoCo, arXiv 2311.08105): the one source for the shard,
# `atoll up`, `atoll bench quality` and the Kubernetes ConfigMap (a test keeps them equal).
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
# Delayed Nesterov (arXiv 2401.09135): the momentum moves once per 2 rounds. Measured with
# `atoll bench quality`'s runs (4 learners, K = 2, H = 64, 4,000 steps) on 2 shared cores,
# where host jitter makes half the pushes a version stale: eval loss 1.86-2.00 with the
# momentum moved every round against 1.64-1.67 every second round over seeds 0-2 (data-
# parallel 1.59); with the learners' steps padded 3x (pushes fresh, lag 0.03), 1.62-1.64
# against 1.65. docs/rounds.md has the table.
OUTER_MOMENTUM_DELAY = 2
# γ: 2, because a period's pushes arrive spread by a step of the slowest island plus the
# jitter of real step times (±50 % measured on a busy 2-core machine), and a round that
# closes before the last of them splits the period in two.
GRACE_FACTOR = 2.0
# Shard indices are below this: a fragment map naming a shard past it is a forgery or a
# bug (server/moves.py), and no run spreads its fragments over more shards than this.
MAX_SHARDS = 1 << 12


class ConfigError(ValueError):
    """A setting that cannot work; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class ShardConfig:
    shard_index: int = dataclasses.field(
        metadata=settings.flag(
            "this shard's index, from 0 (env ATOLL_SHARD_INDEX, or the ordinal ending "
            "ATOLL_POD_NAME; default 0); a shard at or past --num-shards starts owning no "
            "fragment, until `atoll reshard` moves some to it"
        )
    )
    num_shards: int = dataclasses.field(
        metadata=settings.flag(
            f"shards of the run's first layout, in [1, {MAX_SHARDS}], fragment p on shard p "
            "mod S (env ATOLL_NUM_SHARDS; default 1); `atoll reshard` changes it while the "
            "run goes on"
        )
    )
    data_dir: pathlib.Path = dataclasses.field(
        metadata=settings.flag(
            "directory for the write-ahead log and snapshots, made if missing; must be "
            "writable (env ATOLL_DATA_DIR)"
        )
    )
    listen: str = setting("127.0.0.1:7070", "HOST:PORT to serve gRPC on; port 0 picks a free one")
    quorum: int = setting(1, "learners needed to close a round, >= 1")
    grace_factor: float = setting(
        GRACE_FACTOR,
        "γ, >= 0: share of the overlap slack a round waits for stragglers "
        "(see rules.estimate_grace)",
    )
    max_staleness: int = setting(4, "versions a push's base may lag before it is refused, >= 0")
    staleness_discount: float = setting(0.0, "a in the (1+s)^-a weight discount, >= 0; 0 disables")
    lease_seconds: float = setting(
        30.0, "a learner counts as live this long after its last call, > 0"
    )
    outer_lr: float = setting(OUTER_LR, "outer SGD learning rate, > 0")
    outer_momentum: float = setting(OUTER_MOMENTUM, "outer Nesterov momentum, in [0, 1)")
    momentum_delay: int = setting(
        OUTER_MOMENTUM_DELAY,
        "rounds per outer momentum update (delayed Nesterov), >= 1; 1: every round",
    )
    rda: bool = setting(True, "plain weighted average instead of radial-directional averaging")
    # past max_staleness a push is refused anyway
    delta_ring: int = setting(4, "published deltas kept for delta pulls, >= 1")
    snapshot_every: int = setting(50, "rounds between snapshots, >= 1")
    publish_codec: Codec = setting(
        Codec.INT4, "codec of published deltas", choices=("int4", "mxfp4", "fp32")
    )
    max_message_bytes: int = setting(8 << 20, "largest gRPC message accepted, >= 1 MiB")
    max_concurrent_streams: int = setting(64, "concurrent RPCs per connection, >= 1")
    token_file: pathlib.Path | None = setting(
        None,
        "bearer tokens, one per line as TOKEN or 'LEARNER_ID TOKEN' (env ATOLL_TOKEN_FILE)",
    )
    tls_cert: pathlib.Path | None = setting(None, "PEM server certificate (enables TLS)")
    tls_key: pathlib.Path | None = setting(None, "PEM private key of --tls-cert")
    tls_client_ca: pathlib.Path | None = setting(
        None, "PEM CA bundle; requires client certificates (mTLS)"
    )
    metrics_port: int | None = setting(
        None, "Prometheus /metrics port, 0 for any free one (off by default)"
    )
    quarantine_records: tuple[int, ...] = setting(
        (),
        "at recovery, copy log record LSN to DATA_DIR/quarantine/ and replay without it; "
        "only when recovery names that record as one it cannot apply (repeatable; an "
        "operator's decision)",
        name="quarantine-record",
        metavar="LSN",
    )
    truncate_damaged_log: bool = setting(
        False,
        "at recovery, when the write-ahead log is damaged, set its segments aside "
        "(renamed *.wal.damaged) and go on from the newest snapshot, but only if that "
        "snapshot holds every record of the log (as after a clean stop): nothing on disk "
        "says which records were acknowledged, so a record only the log holds is never "
        "dropped; otherwise recovery still refuses and says what the log alone holds",
    )
    health_port: int | None = setting(
        None,
        "also serve grpc.health.v1 alone, in plaintext, on this port of the --listen host "
        "(for probes when the main port uses TLS); 0 for any free one (off by default)",
    )
    max_inflight_bytes: int = setting(
        2 << 30,
        "frame bytes all open Push and Init streams may declare at once, >= 1 MiB",
    )
    max_connection_inflight_bytes: int = setting(
        512 << 20,
        "the same for one client connection, >= 1 MiB; also the largest frame",
    )
    stream_idle_seconds: float = setting(
        60.0, "a Push or Init stream that sends nothing this long is aborted, > 0"
    )
    part_wait_leases: float = setting(
        2.0,
        "a push in parts still missing some this many leases after its first part came in "
        "is dropped, none of it merged (a process of its learner died), > 0",
    )

    def __post_init__(self) -> None:
        _need(
            1 <= self.num_shards <= MAX_SHARDS,
            f"--num-shards must be in [1, {MAX_SHARDS}], got {self.num_shards}",
        )
        # a shard at or past num_shards (a StatefulSet scaled up) owns nothing until
        # `atoll reshard` moves fragments to it (docs/resharding.md)
        _need(
            0 <= self.shard_index < MAX_SHARDS,
            f"--shard-index must be in [0, {MAX_SHARDS - 1}], got {self.shard_index}",
        )
        _need(
            re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[\w.-]+):\d{1,5}", self.listen) is not None,
            f"--listen must be HOST:PORT (e.g. 0.0.0.0:7070), got {self.listen!r}",
        )
        _need(
            _port_ok(self.port),
            f"--listen port must be in 1-65535 (0 picks a free one), got {self.listen!r}",
        )
        try:  # the round rules' settings: their one check is RoundPolicy's
            self.round_policy()
        except ValueError as e:
            name, _, rest = str(e).partition("=")
            flags = {s.name: s.flag for s in settings.settings(ShardConfig)}
            field = _POLICY_FIELDS.get(name, name)
            raise ConfigError(f"{flags.get(field, name)}={rest}") from None
        _need(
            math.isfinite(self.part_wait_leases) and self.part_wait_leases > 0,
            f"--part-wait-leases must be a number > 0, got {self.part_wait_leases}",
        )
        _need(self.outer_lr > 0, f"--outer-lr must be > 0, got {self.outer_lr}")
        _need(
            0 <= self.outer_momentum < 1,
            f"--outer-momentum must be in [0, 1), got {self.outer_momentum}",
        )
        _need(
            self.momentum_delay >= 1,
            f"--momentum-delay must be at least 1 (1: Nesterov every round), got {self.momentum_delay}",
        )
        _need(self.delta_ring >= 1, f"--delta-ring must be at least 1, got {self.delta_ring}")
        _need(
            self.snapshot_every >= 1,
            f"--snapshot-every must be at least 1, got {self.snapshot_every}",
        )
        _need(
            self.publish_codec in (Codec.INT4, Codec.MXFP4, Codec.FP32),
            f"--publish-codec must be int4, mxfp4 or fp32, got {self.publish_codec}",
        )
        self._check_serving()

    def round_policy(self) -> rules.RoundPolicy:
        """The settings the round rules run on (server/rules.py), checked there."""
        return rules.RoundPolicy(
            quorum=self.quorum,
            grace_factor=self.grace_factor,
            max_staleness=self.max_staleness,
            discount_exponent=self.staleness_discount,
            lease_seconds=self.lease_seconds,
        )

    def _check_serving(self) -> None:
        """The serving settings: message and stream limits, TLS and token files, ports."""
        _need(
            self.max_message_bytes >= 1 << 20,
            f"--max-message-bytes must be at least 1048576, got {self.max_message_bytes}",
        )
        _need(
            self.max_concurrent_streams >= 1,
            f"--max-concurrent-streams must be at least 1, got {self.max_concurrent_streams}",
        )
        _need(
            (self.tls_cert is None) == (self.tls_key is None),
            "--tls-cert and --tls-key go together: give both or neither",
        )
        _need(
            self.tls_client_ca is None or self.tls_cert is not None,
            "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key as well",
        )
        for flag, path in (
            ("--token-file", self.token_file),
            ("--tls-cert", self.tls_cert),
            ("--tls-key", self.tls_key),
            ("--tls-client-ca", self.tls_client_ca),
        ):
            _need(path is None or pathlib.Path(path).is_file(), f"{flag}: no such file {path}")
        for flag, port in (
            ("--metrics-port", self.metrics_port),
            ("--health-port", self.health_port),
        ):
            _need(
                port is None or _port_ok(port),
                f"{flag} must be in 1-65535 (0 picks a free one), got {port}",
            )
        _need(
            self.health_port is None or self.health_port == 0 or self.health_port != self.port,
            f"--health-port {self.health_port} is the --listen port; give it a port of its own",
        )
        _need(
            self.max_connection_inflight_bytes >= 1 << 20,
            f"--max-connection-inflight-bytes must be at least 1048576, got {self.max_connection_inflight_bytes}",
        )
        _need(
            self.max_inflight_bytes >= self.max_connection_inflight_bytes,
            f"--max-inflight-bytes ({self.max_inflight_bytes}) must be at least "
            f"--max-connection-inflight-bytes ({self.max_connection_inflight_bytes})",
        )
        _need(
            math.isfinite(self.stream_idle_seconds) and self.stream_idle_seconds > 0,
            f"--stream-idle-seconds must be a number > 0, got {self.stream_idle_seconds}",
        )

    def to_args(self) -> list[str]:
        """The `atoll syncer` flags that give this config: what a launcher (`atoll up`,
        `atoll chaos`) runs, so each setting is declared and checked here once. Settings at
        their defaults are left out; `--quarantine-record` repeats per LSN."""
        return settings.to_args(self)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def host(self) -> str:
        """The listen address without its port (and IPv6 brackets)."""
        return self.listen.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        """The listen port as given (0: any free one)."""
        return int(self.listen.rsplit(":", 1)[1])

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame one Push or Init may declare, whatever its fragment."""
        return min(self.max_message_bytes * 64, self.max_connection_inflight_bytes)


# RoundPolicy's field names where ShardConfig's differ (its refusals name ShardConfig's flags)
_POLICY_FIELDS = {"discount_exponent": "staleness_discount"}


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _port_ok(port: int) -> bool:
    """A TCP port a flag may name: 1-65535, or 0 for any free one."""
    return 0 <= port <= 65535


def shard_index_from_env(default: int | None = None) -> int | None:
    """ATOLL_SHARD_INDEX, else the ordinal at the end of ATOLL_POD_NAME (syncer-3 -> 3)."""
    if os.environ.get(ENV_SHARD_INDEX):
        return _int_env(ENV_SHARD_INDEX)
    pod = os.environ.get(ENV_POD_NAME, "")
    match = re.search(r"-(\d+)$", pod)
    if pod and not match:
        raise ConfigError(f"{ENV_POD_NAME}={pod!r} does not end in -ORDINAL; set {ENV_SHARD_INDEX}")
    return int(match.group(1)) if match else default


def _int_env(name: str) -> int:
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a whole number") from None


def load_tokens(path: pathlib.Path) -> dict[str, str | None]:
    """Reads a token file: {token: learner id or None (any learner)}.

    Refuses, at start, a token that is a placeholder (the REPLACE-ME line of
    k8s/base/common/token.example) or shorter than 32 characters: either would let anyone who
    guesses it push outer gradients.
    """
    min_chars = 32  # `openssl rand -hex 32` gives 64
    placeholder = re.compile(r"replace[-_ ]?me|change[-_ ]?me|placeholder|example", re.IGNORECASE)
    how = f"put a real one there, e.g. `openssl rand -hex 32 > {path}`"
    try:
        text = pathlib.Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it as a token file ({e})") from None
    tokens: dict[str, str | None] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) > 2:
            raise ConfigError(f"{path}:{number}: expected 'TOKEN' or 'LEARNER_ID TOKEN'")
        learner, token = (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
        if placeholder.search(token):
            raise ConfigError(f"{path}:{number}: the token is a placeholder, not a secret; {how}")
        if len(token) < min_chars:
            raise ConfigError(
                f"{path}:{number}: the token has {len(token)} characters, fewer than the "
                f"{min_chars} a bearer token needs; {how}"
            )
        tokens[token] = learner
    if not tokens:
        raise ConfigError(f"{path}: no tokens (one per line, '#' starts a comment)")
    return tokens
