"""A real `atoll syncer` process for the benches, started from its `ShardConfig`.

The shard dies with the bench: a bench killed (a test's timeout, a kill -9) leaves no
shard behind holding its port and data directory."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from atoll.local.processes import _die_with_parent
from atoll.server.config import ShardConfig
from atoll.wire.records import parse_serving


def start_shard(cfg: ShardConfig, log_path: pathlib.Path) -> tuple[subprocess.Popen[str], int, int]:
    """Starts `atoll syncer` with `cfg`'s flags (give it port 0 and metrics_port=0 for
    free ports); returns (process, gRPC port, metrics port) once it serves.

    The shard gets SIGTERM when the thread that called this exits (PR_SET_PDEATHSIG, set
    per thread): call it from the bench's main thread."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "atoll.cli", "syncer", *cfg.to_args()],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            preexec_fn=_die_with_parent,
        )
    assert proc.stdout is not None
    for line in proc.stdout:
        if (ports := parse_serving(line)) and ports[1] is not None:
            return proc, ports[0], ports[1]
    proc.wait()
    raise RuntimeError(
        f"atoll syncer exited with {proc.returncode} before serving:\n"
        + log_path.read_text()[-2000:]
    )
