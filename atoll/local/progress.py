"""What `atoll up` watches: learners' status files, shards' /metrics, and the live table.

Learners append one JSON record per step to their status file (learner/trainer/loop.py);
`StatusFile` reads only what was appended since its last look. Shards serve
Prometheus text on their metrics port; `scrape` turns it into one small dict. The
table is a pure function of both, drawn in place on a terminal (`Screen`) or as one
compact line every few seconds elsewhere.
"""

from __future__ import annotations

import time
from typing import Any, TextIO

from atoll.wire.metrics import read_metrics
from atoll.wire.records import JsonLines, read_jsonl

REFUSED_REASONS = ("too_stale", "already_in_round")  # push reasons that mean "not merged"
SCRAPE_TIMEOUT = 0.5  # seconds per /metrics request; a busy shard is skipped, not waited for


StatusFile = JsonLines  # a learner's status file: one JSON record per step
read_status = read_jsonl  # every whole record of a status file ([] when there is none)


def lives(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A learner's records split into its processes' lives (each begins with `joining`)."""
    out: list[list[dict[str, Any]]] = []
    for r in records:
        if r.get("state") == "joining" or not out:
            out.append([])
        out[-1].append(r)
    return out


def scrape(port: int | None, timeout: float = SCRAPE_TIMEOUT) -> dict[str, Any] | None:
    """A shard's /metrics as {versions, outer_steps_per_period, cadence_seconds, rounds, pushes, refused,
    live, received, sent}; None if unreachable."""
    if port is None:
        return None
    try:
        samples = read_metrics(f"127.0.0.1:{port}", timeout)
    except (OSError, ValueError):
        return None
    out: dict[str, Any] = {
        "versions": {},
        "outer_steps_per_period": {},
        "cadence_seconds": None,
        "rounds": 0,
        "pushes": 0,
        "refused": 0,
        "refused_calls": 0,
        "live": 0,
        "received_bytes": 0,
        "sent_bytes": 0,
    }
    for s in samples:
        if s.name == "atoll_fragment_version":
            out["versions"][int(s.labels["fragment"])] = int(s.value)
        elif s.name == "atoll_outer_steps_per_period":
            out["outer_steps_per_period"][int(s.labels["fragment"])] = s.value
        elif s.name == "atoll_cadence_seconds":
            out["cadence_seconds"] = s.value
        elif s.name == "atoll_rounds_total":
            out["rounds"] = int(s.value)
        elif s.name == "atoll_pushes_total":
            out["pushes"] += int(s.value)
            if s.labels.get("reason") in REFUSED_REASONS:
                out["refused"] += int(s.value)
        elif s.name == "atoll_refused_calls_total":
            out["refused_calls"] += int(s.value)
        elif s.name == "atoll_live_learners":
            out["live"] = int(s.value)
        elif s.name == "atoll_received_bytes_total":
            out["received_bytes"] = int(s.value)
        elif s.name == "atoll_sent_bytes_total":
            out["sent_bytes"] = int(s.value)
    return out


# -- the table ------------------------------------------------------------------------


def clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _num(value: Any, fmt: str, missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def table(
    title: str,
    elapsed: float,
    learners: list[dict[str, Any]],
    shards: list[dict[str, Any]],
    events: list[str],
) -> list[str]:
    """The live table's lines.

    learners: {name, state (ours: starting/running/exited/crashed, or the record's),
    steps (target), record (last status record or None)}; shards: {index, port, state,
    restarts, metrics (scrape() or None)}; events: recent one-line messages.
    """
    lines = [f"{title}   elapsed {clock(elapsed)}", ""]
    lines.append(
        f"{'learner':<12} {'state':<9} {'step':>11} {'tok/s':>7} {'loss':>6} {'eval':>6} "
        f"{'ver':>5} {'lag':>4} {'sent MB':>8} {'recv MB':>8} {'blocked':>7} {'refused':>7}"
    )
    for row in learners:
        r = row["record"] or {}
        step = f"{r.get('step', 0)}/{row['steps']}"
        blocked = None
        if r.get("blocked_seconds") is not None and row.get("training_seconds"):
            blocked = 100 * r["blocked_seconds"] / row["training_seconds"]
        lines.append(
            f"{row['name']:<12} {row['state']:<9} {step:>11} {_num(r.get('tokens_per_s'), ',.0f'):>7} "
            f"{_num(r.get('loss'), '.3f'):>6} {_num(row.get('eval_loss'), '.3f'):>6} "
            f"{_num(r.get('version'), 'd'):>5} {_num(r.get('lag'), 'd'):>4} "
            f"{_num(r.get('bytes_sent') and r['bytes_sent'] / 1e6, '.2f'):>8} "
            f"{_num(r.get('bytes_received') and r['bytes_received'] / 1e6, '.2f'):>8} "
            f"{_num(blocked, '.1f') + ('%' if blocked is not None else ''):>7} "
            f"{_num(r.get('refused'), 'd'):>7}"
        )
    lines.append("")
    lines.append(
        f"{'shard':<6} {'state':<9} {'port':>6} {'versions':<24} {'rounds':>7} {'pushes':>7} "
        f"{'refused':>7} {'live':>5} {'in MB':>8} {'out MB':>8}"
    )
    for row in shards:
        m = row["metrics"] or {}
        versions = " ".join(f"{p}:v{v}" for p, v in sorted(m.get("versions", {}).items())) or "-"
        state = row["state"] + (f" ({row['restarts']}x)" if row["restarts"] else "")
        refused = None if not m else m["refused"] + m["refused_calls"]
        lines.append(
            f"{row['index']:<6} {state:<9} {_num(row['port'], 'd'):>6} {versions[:24]:<24} "
            f"{_num(m.get('rounds'), 'd'):>7} {_num(m.get('pushes'), 'd'):>7} {_num(refused, 'd'):>7} "
            f"{_num(m.get('live'), 'd'):>5} {_num(m.get('received_bytes') and m['received_bytes'] / 1e6, '.2f'):>8} "
            f"{_num(m.get('sent_bytes') and m['sent_bytes'] / 1e6, '.2f'):>8}"
        )
    if events:
        lines += [""] + [text for event in events for text in event.splitlines()][-8:]
    return lines


def line(elapsed: float, learners: list[dict[str, Any]], shards: list[dict[str, Any]]) -> str:
    """One compact log line for a non-terminal (CI, a pipe)."""
    parts = []
    for row in learners:
        r = row["record"] or {}
        loss = f" loss {r['loss']:.3f}" if r.get("loss") is not None else ""
        lag = f" lag {r['lag']}" if r.get("lag") is not None else ""
        parts.append(f"{row['name']} {row['state']} {r.get('step', 0)}/{row['steps']}{loss}{lag}")
    rounds = sum((s["metrics"] or {}).get("rounds", 0) for s in shards)
    refused = sum((s["metrics"] or {}).get("refused", 0) for s in shards)
    down = [
        f"{s['index']} {s['state']}"
        for s in shards
        if s["state"] in ("starting", "restarting", "failed")
    ]
    shard_part = f"shards: {rounds} rounds, {refused} refused" + (
        f" ({', '.join(down)})" if down else ""
    )
    return f"[{clock(elapsed)}] " + " | ".join(parts + [shard_part])


class Screen:
    """Redraws a block of lines in place on a terminal (cursor home, clear to the end)."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self._cleared = False

    def draw(self, lines: list[str]) -> None:
        head = "\x1b[H" if self._cleared else "\x1b[H\x1b[2J"
        self._cleared = True
        self.stream.write(head + "".join(f"{text}\x1b[K\n" for text in lines) + "\x1b[J")
        self.stream.flush()


class Ticker:
    """True at most once every `seconds`."""

    def __init__(self, seconds: float):
        self.seconds, self._last = seconds, float("-inf")

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self._last >= self.seconds:
            self._last = now
            return True
        return False
