"""What atoll's processes tell each other through files and output lines.

Learners append JSON lines (a status record per step, one record per answered push);
`atoll up`, `atoll chaos` and the audit read them with `JsonLines` / `read_jsonl`, which
skip a line a kill cut short. A shard announces its ports with `serving_line`, which
`atoll up`, the benches and the tests read back with `parse_serving`.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any, TypedDict

Record = dict[str, Any]


class PushRecord(TypedDict):
    """One answered push: a line of a learner's push log (`atoll learner --push-log`),
    what `atoll chaos` checks against the shards' logs (server/audit.py)."""

    learner: str
    time: float  # when the answer came (seconds since the epoch)
    fragment: int
    seq: int
    shard: int
    accepted: bool
    reason: str  # PushReason name, e.g. PUSH_REASON_FRESH
    base_version: int
    merged_in: int | None  # the version that holds the push; None when refused
    steps: int  # inner steps the push carries
    compute_seconds: float  # seconds of those steps


class StatusRecord(TypedDict, total=False):
    """One line of a learner's status file (`--status-file`), written at every step and
    state change; `atoll up` draws and reports from them, a restart resumes from the last."""

    learner: str
    index: int  # the data shard
    slowdown: float
    params: int
    baseline: bool
    time: float
    state: str  # joining, standby, training, done, stopped, failed
    step: int
    tokens: int
    loss: float
    tokens_per_s: float
    step_seconds: float
    eval_loss: float
    eval_bits_per_byte: float
    wall_seconds: float
    bytes_sent: int
    bytes_received: int
    pushes: int
    refused: int
    resyncs: int
    adopted: int
    stalled: int
    blocked_seconds: float
    version: int  # the oldest fragment version adopted
    lag: int  # newest known version minus adopted, worst fragment


def append_jsonl(path: pathlib.Path | str, record: PushRecord | StatusRecord | Record) -> None:
    """Appends one compact JSON line (readers skip a line a kill cuts short)."""
    with open(path, "a") as f:
        f.write(json.dumps(record, separators=(",", ":")) + "\n")


_SERVING = re.compile(r"syncer shard (\d+)/(\d+) serving on port (\d+)(?:, metrics on port (\d+))?")


def serving_line(
    shard_index: int,
    num_shards: int,
    port: int,
    metrics_port: int | None = None,
    health_port: int | None = None,
) -> str:
    """The line a shard prints once it serves (stdout, flushed): its gRPC, metrics and
    plaintext health ports."""
    metrics = f", metrics on port {metrics_port}" if metrics_port is not None else ""
    health = f", health on port {health_port}" if health_port is not None else ""
    return f"syncer shard {shard_index}/{num_shards} serving on port {port}{metrics}{health}"


def parse_serving(line: str) -> tuple[int, int | None] | None:
    """(port, metrics port or None) from a `serving_line` anywhere in `line`, else None."""
    m = _SERVING.search(line)
    if m is None:
        return None
    return int(m.group(3)), int(m.group(4)) if m.group(4) else None


class JsonLines:
    """A JSON-lines file read incrementally; `records` holds every whole record so far."""

    def __init__(self, path: pathlib.Path):
        self.path = pathlib.Path(path)
        self.records: list[Record] = []
        self._offset = 0

    def poll(self) -> list[Record]:
        """Records appended since the last poll (a half-written last line waits for the next)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        new = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill -9, then appended to by the restart
            if isinstance(record, dict):
                new.append(record)
        self.records += new
        return new

    @property
    def last(self) -> Record | None:
        return self.records[-1] if self.records else None


def read_jsonl(path: pathlib.Path | str) -> list[Record]:
    """Every whole record of a JSON-lines file ([] when there is none)."""
    lines = JsonLines(pathlib.Path(path))
    lines.poll()
    return lines.records
