"""What a stopped shard's data directory holds durably: the pushes it can prove it accepted.

`atoll chaos` checks every acknowledgement a learner logged against this after the run:
an accepted push is durable if its record is in the write-ahead log, or if the newest
snapshot already holds a later push of the same learner and fragment (the log is only
truncated behind snapshots, and a learner's sequence numbers only grow).

A push taken in parts counts once, by the record of its assembly (LOG_ASSEMBLED, written
with its last part), as the one answer its learner logs for it; its parts alone (LOG_PART,
each answered "part held") and parts dropped unassembled are no accepted push.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from atoll.server import storage
from atoll.server.log_records import LOG_ASSEMBLED, LOG_PUSH, parse_log_record
from atoll.server.snapshots import SnapshotStore


@dataclasses.dataclass
class Durable:
    """One learner's pushes to one fragment that a shard holds."""

    # seqs with a LOG_PUSH record (a whole push) or a LOG_ASSEMBLED one (a push in parts)
    logged: set[int] = dataclasses.field(default_factory=set)
    snapshot_seq: int = -1  # newest seq the newest snapshot remembers (-1: none)

    def holds(self, seq: int) -> bool:
        return seq in self.logged or seq <= self.snapshot_seq


def durable_pushes(data_dir: str | pathlib.Path) -> dict[tuple[str, int], Durable]:
    """{(learner, fragment): Durable} of a shard data directory; the shard must be stopped."""
    data = pathlib.Path(data_dir)
    out: dict[tuple[str, int], Durable] = {}
    with SnapshotStore(data / "snapshots") as snapshots:
        snap = snapshots.latest()
    if snap is not None:
        for p, fmeta in snap.meta["fragments"].items():
            for learner, answer in fmeta["answers"].items():
                out.setdefault((learner, int(p)), Durable()).snapshot_seq = int(answer["seq"])
    with storage.WriteAheadLog(data / "wal") as wal:
        for _, record in wal.replay(wal.first_lsn - 1):  # every record it still holds
            kind, meta, _ = parse_log_record(record)
            if kind in (LOG_PUSH, LOG_ASSEMBLED) and meta["answer"]["accepted"]:
                out.setdefault((meta["learner"], meta["fragment"]), Durable()).logged.add(
                    int(meta["answer"]["seq"])
                )
    return out


def lost_acks(
    acks: list[dict[str, Any]], durable: dict[tuple[str, int], Durable]
) -> list[dict[str, Any]]:
    """The accepted acknowledgements (learner, fragment, seq) that no shard holds."""
    return [
        a
        for a in acks
        if a["accepted"]
        and not durable.get((a["learner"], a["fragment"]), Durable()).holds(a["seq"])
    ]
