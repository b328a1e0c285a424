"""The shard's write-ahead log records: only the shard (server/shard.py, recovery.py,
moves.py) and `atoll chaos`'s audit (server/audit.py) read them.

Each record: kind (u8), the JSON metadata's length (u32, little-endian), the JSON, then
the payload (a frame, or nothing). The shard writes and replays them; the audit reads
them from a stopped shard's data directory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

LOG_PLAN, LOG_INIT, LOG_PUSH, LOG_CLOSE = 1, 2, 3, 4  # record kinds
# moving a fragment between shards (docs/resharding.md): the source freezes it (or
# unfreezes it, aborting), the target adopts its state, the source records it moved
LOG_FREEZE, LOG_UNFREEZE, LOG_ADOPT, LOG_MOVED = 5, 6, 7, 8
# a push in parts (server/parts.py): one part held (its frame the payload); the push's
# parts merged as one contribution (with its answer); its parts dropped, none merged
LOG_PART, LOG_ASSEMBLED, LOG_PARTS_DROPPED = 9, 10, 11
# a seed in parts (server/seed_parts.py): one part held; the seed itself is a LOG_INIT
LOG_INIT_PART = 12
_LOG_HEADER = struct.Struct("<BI")


def log_record(kind: int, meta: dict[str, Any], payload: bytes = b"") -> bytes:
    """One write-ahead log record: its kind, JSON metadata and payload."""
    return b"".join(log_record_parts(kind, meta, payload))


def log_record_parts(
    kind: int, meta: dict[str, Any], payload: bytes | memoryview | Sequence[bytes] = b""
) -> tuple[bytes | memoryview, ...]:
    """`log_record` as (head, payload), for a log that writes parts as one record: a
    push's frame goes to disk without being copied behind its head first. A payload
    given as the pieces it arrived in (a stream's chunks) stays in pieces: (head, *pieces)."""
    body = json.dumps(meta, separators=(",", ":")).encode()
    head = _LOG_HEADER.pack(kind, len(body)) + body
    if isinstance(payload, (bytes, memoryview)):
        return head, payload
    return (head, *payload)


def parse_log_record(record: bytes | memoryview) -> tuple[int, dict[str, Any], memoryview]:
    """(kind, metadata, payload) of a `log_record`."""
    kind, n = _LOG_HEADER.unpack_from(record)
    start = _LOG_HEADER.size
    meta: dict[str, Any] = json.loads(bytes(record[start : start + n]))
    return kind, meta, memoryview(record)[start + n :]
