"""`atoll bench ingest`'s report: the figures derived from what one run measured, the JSON
object it prints, and each target with what the run got (docs/design.md §6, issue 31).

`ingest.py` runs the shard, the learners and the anchors and fills in a `Measured`; this
turns it into rates, costs and memory per parameter. MB = 10^6 bytes.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from atoll.wire.client import CHUNK_BYTES
from atoll.wire.plan import FragmentPlan

TARGET_RATIO = 0.5  # ingest wire rate / raw gRPC rate (docs/design.md §6)
TARGET_RSS_BYTES_PER_PARAM = 16.0  # docs/design.md §6, with the delta ring full
TARGET_COST_OVER_LIMIT = 2.0  # shard CPU per MB over the unavoidable work's (issue 31)
TARGET_CORES_SCALING = 1.7  # shard MB/s pinned to 2 CPUs over 1


def percentiles_ms(seconds: list[float]) -> dict[str, float | None]:
    """p50, p90, p99 and max of latencies, in milliseconds."""
    if not seconds:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(np.asarray(seconds) * 1e3, [50, 90, 99])
    return {
        "p50": round(float(p50), 2),
        "p90": round(float(p90), 2),
        "p99": round(float(p99), 2),
        "max": round(max(seconds) * 1e3, 2),
    }


def delta(after: dict[str, Any], before: dict[str, Any], name: str) -> dict[Any, float]:
    """Metric `name` of a `_scrape` after a phase less the one before it, per label."""
    return {k: v - before.get(name, {}).get(k, 0.0) for k, v in after.get(name, {}).items()}


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """PromQL's histogram_quantile over cumulative {upper bound: count} buckets."""
    bounds = sorted(buckets)
    total = buckets[math.inf]
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if upper == math.inf:
                return lower  # the highest finite bound, as Prometheus answers
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def quantile_ms(
    after: dict[str, Any], before: dict[str, Any], name: str, q: float = 0.5
) -> float | None:
    value = histogram_quantile(q, delta(after, before, name + "_bucket"))
    return None if value is None else round(value * 1e3, 3)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One run's shape, checked: who pushes what over how many connections."""

    plan: FragmentPlan
    learners: int  # learner processes, also the quorum
    connections: int  # push connections over all learners
    per_learner: list[int]  # connections of each learner process
    fragments: int
    rounds: int  # measured rounds
    warmup_rounds: int  # unmeasured rounds first
    parts: int = 1  # each push in this many parts (a learner of as many processes)


@dataclasses.dataclass(frozen=True)
class Measured:
    """What one run measured, before any figure is derived from it."""

    rss_start: int  # the shard's VmRSS once serving, before Init
    bits_per_param: float  # of the learners' frames
    raw_before: dict[str, Any]  # ingest._run_phase of the no-op server, before the ingest
    ingest: dict[str, Any]  # ingest._run_phase of the measured ingest rounds
    cpu_shard: float  # the shard's CPU seconds over them
    before: dict[str, Any]  # the shard's /metrics before them
    after: dict[str, Any]  # and after
    mem: dict[str, Any]  # the shard's VmRSS and VmHWM after them
    peak_scope: str  # what VmHWM spans
    ring: dict[str, Any]  # ingest._delta_ring
    fsyncs: int  # the shard's fsyncs over the measured rounds
    limit: dict[str, Any]  # ingest._limit
    pinned: dict[int, Any]  # --cores K: ingest._pinned_phase
    raw_after: dict[str, Any]  # ingest._run_phase of the no-op server, after everything else


def _mb_per_s(phase: dict[str, Any]) -> float:
    return float(phase["bytes"] / phase["seconds"] / 1e6)


def _figures(lay: Layout, m: Measured) -> dict[str, Any]:
    """The rates, costs and memory figures derived from a run's measurements."""
    held = lay.plan.num_params
    raw_runs = [_mb_per_s(m.raw_before), _mb_per_s(m.raw_after)]
    wire = _mb_per_s(m.ingest)
    core_ms_per_mb = m.cpu_shard * 1e3 / (m.ingest["bytes"] / 1e6)
    limit_ms_per_mb = m.limit["cpu_seconds"] * 1e3 / (m.limit["bytes"] / 1e6)
    rss = (m.mem["VmRSS"] - m.rss_start) / held
    ring_delta_bytes_per_param = m.ring["delta_bytes"] / held
    ring_filled = min(m.ring["capacity"], lay.warmup_rounds + lay.rounds)
    by_cores: dict[str, Any] = {str(k): v for k, v in m.pinned.items()}
    if len(m.pinned) >= 2:
        lo, hi = min(m.pinned), max(m.pinned)
        scaling = m.pinned[hi]["wire_mb_per_s"] / m.pinned[lo]["wire_mb_per_s"]
        by_cores[f"mb_per_s_{hi}_over_{lo}"] = round(scaling, 3)
    return {
        "raw_runs": raw_runs,
        "raw": max(raw_runs),
        "wire": wire,
        "ratio": wire / max(raw_runs),
        "ingest_mparams": m.ingest["accepted_params"] / m.ingest["seconds"] / 1e6,
        "core_ms_per_mb": core_ms_per_mb,
        "limit_ms_per_mb": limit_ms_per_mb,
        "cost_over_limit": core_ms_per_mb / limit_ms_per_mb,
        "by_cores": by_cores,
        "rss": rss,
        "peak": (m.mem["VmHWM"] - m.rss_start) / held,
        "ring_filled": ring_filled,
        "ring_delta_bytes_per_param": ring_delta_bytes_per_param,
        "rss_ring_full": rss + (m.ring["capacity"] - ring_filled) * ring_delta_bytes_per_param,
    }


def report(lay: Layout, m: Measured, load_before: float) -> dict[str, Any]:
    """The bench's JSON object."""
    f = _figures(lay, m)
    ingest, ratio, cost_over_limit = m.ingest, f["ratio"], f["cost_over_limit"]
    return {
        "params": lay.plan.num_params,
        "learners": lay.learners,
        "connections": lay.connections,
        "parts_per_push": lay.parts,
        "client_processes": lay.learners,
        "fragments": lay.fragments,
        "rounds": lay.rounds,
        "warmup_rounds": lay.warmup_rounds,
        "codec": "int4",
        "bits_per_param": round(m.bits_per_param, 4),
        "chunk_bytes": CHUNK_BYTES,
        "pushes_accepted": ingest["accepted"],
        "pushes_expected": lay.learners * lay.fragments * lay.rounds,
        "pushes_refused": ingest["refused"],
        "measured_seconds": round(ingest["seconds"], 3),
        # each push from its first message to its ack, as a learner sees it (the raw runs:
        # the same messages drained by a no-op server)
        "push_latency_ms": percentiles_ms(ingest["latency"]),
        "raw_latency_ms": percentiles_ms(m.raw_before["latency"] + m.raw_after["latency"]),
        "ingest_mparams_per_s": round(f["ingest_mparams"], 1),
        "wire_mb_per_s": round(f["wire"], 1),
        "raw_grpc_mb_per_s": round(f["raw"], 1),
        "raw_grpc_mb_per_s_runs": [round(r, 1) for r in f["raw_runs"]],  # before, after the ingest
        "ratio": round(ratio, 3),
        # the shard's CPU (user + system, all threads) per MB of frames it took, against
        # the same frames decoded, merged and logged by the codec's kernels on one core
        "core_ms_per_mb": round(f["core_ms_per_mb"], 3),
        "limit_core_ms_per_mb": round(f["limit_ms_per_mb"], 3),
        "cost_over_limit": round(cost_over_limit, 3),
        "limit": {
            "cpu_seconds": round(m.limit["cpu_seconds"], 3),
            "mb": round(m.limit["bytes"] / 1e6, 1),
            "pushes": m.limit["pushes"],
            "fsyncs": m.limit["fsyncs"],
            "pinned_cpu": m.limit["pinned_cpu"],
        },
        **({"cores": f["by_cores"]} if f["by_cores"] else {}),
        **_memoryreport(m, f),
        "shard": _shardreport(m),
        "clients_cpu_cores_busy": round(ingest["client_cpu_seconds"] / ingest["seconds"], 2),
        # other work on the machine skews every rate: compare runs only under similar load
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_1m_before": round(load_before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
        },
        "targets": _targets(f, m.fsyncs),
    }


def _memoryreport(m: Measured, f: dict[str, Any]) -> dict[str, Any]:
    """fsync latency and count, and the shard's memory per parameter held."""
    capacity, filled = m.ring["capacity"], f["ring_filled"]
    return {
        "fsync_ms_p50": quantile_ms(m.after, m.before, "atoll_wal_fsync_seconds"),
        "fsync_ms_p99": quantile_ms(m.after, m.before, "atoll_wal_fsync_seconds", 0.99),
        "fsyncs": int(m.fsyncs),
        "rss_bytes_per_param": round(f["rss"], 2),
        "rss_peak_bytes_per_param": round(f["peak"], 2),
        "rss_ring_full_bytes_per_param_est": round(f["rss_ring_full"], 2),
        "rss_note": (
            "rss_bytes_per_param: the shard's VmRSS after the measured rounds minus its "
            "VmRSS once serving (before Init), per parameter held; the target applies to "
            f"it. rss_peak_bytes_per_param: VmHWM over {m.peak_scope}, same baseline. The "
            f"delta ring then holds {filled} of its {capacity} published deltas "
            "per fragment; rss_ring_full_bytes_per_param_est adds the rest at the measured "
            "delta size."
        ),
        "delta_ring": {
            "capacity": capacity,
            "filled": filled,
            "bytes_per_param_per_delta": round(f["ring_delta_bytes_per_param"], 4),
        },
    }


def _shardreport(m: Measured) -> dict[str, Any]:
    """The shard's own view of the measured rounds: memory, CPU, and its /metrics."""

    def total(name: str) -> float:
        return delta(m.after, m.before, name).get("", 0.0)

    return {
        "rss_start_bytes": m.rss_start,
        "rss_after_bytes": m.mem["VmRSS"],
        "rss_peak_bytes": m.mem["VmHWM"],
        "cpu_cores_busy": round(m.cpu_shard / m.ingest["seconds"], 2),
        "push_ms_p50": quantile_ms(m.after, m.before, "atoll_push_seconds"),
        "push_seconds_sum": round(total("atoll_push_seconds_sum"), 3),
        "merge_ms_p50": quantile_ms(m.after, m.before, "atoll_merge_seconds"),
        "merge_seconds_sum": round(total("atoll_merge_seconds_sum"), 3),
        "fsync_seconds_sum": round(total("atoll_wal_fsync_seconds_sum"), 3),
        "rounds_closed": int(total("atoll_rounds_total")),
        "received_mb": round(total("atoll_received_bytes_total") / 1e6, 1),
    }


def _targets(f: dict[str, Any], fsyncs: int) -> dict[str, Any]:
    """Each target: what is wanted, what this run got, and whether it met it."""
    ratio, rss, cost_over_limit = f["ratio"], f["rss"], f["cost_over_limit"]
    by_cores = f["by_cores"]
    return {
        "ratio": {
            "want": f">= {TARGET_RATIO}",
            "got": round(ratio, 3),
            "met": ratio >= TARGET_RATIO,
        },
        "rss_bytes_per_param": {
            "want": f"<= {TARGET_RSS_BYTES_PER_PARAM}",
            "got": round(rss, 2),
            "met": rss <= TARGET_RSS_BYTES_PER_PARAM,
        },
        "fsync_ms_p50": {"want": "reported", "met": fsyncs > 0},
        "cost_over_limit": {
            "want": f"<= {TARGET_COST_OVER_LIMIT}",
            "got": round(cost_over_limit, 3),
            "met": cost_over_limit <= TARGET_COST_OVER_LIMIT,
        },
        **(
            {
                "cores_scaling": {
                    "want": f">= {TARGET_CORES_SCALING} (MB/s on 2 CPUs over 1)",
                    "got": by_cores["mb_per_s_2_over_1"],
                    "met": by_cores["mb_per_s_2_over_1"] >= TARGET_CORES_SCALING,
                }
            }
            if "mb_per_s_2_over_1" in by_cores
            else {}
        ),
    }
