"""`atoll bench cadence`: whether a fragment's rounds keep H steps of the fastest learner
per period on a host loaded on purpose (docs/rounds.md, "Under load").

For each seed it starts `--burners` CPU-burning processes (`while True: pass`), runs a
real `atoll up` (tiny preset, M learners at full speed, every learner training all its
steps) beside them, stops the burners and reports, from the run's report and status
files: each fragment's outer steps against the fastest learner's periods (steps / H),
the same ratio at the moment the fastest learner finished its steps (what the period
held while it trained: the others may go on syncing their last steps after it), the
bits per parameter per sync pushed and pulled, and the host's load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from atoll.commands import non_negative_int, positive_int, seed_list
from atoll.local.config import UpConfig, UpConfigError, learner_specs, prepare_run_dir
from atoll.local.session import Session

# the targets: outer steps per fragment per period of the fastest learner, pulls
RATIO_LOW, RATIO_HIGH = 0.8, 1.25
PULL_BITS_MAX = 4.5


@contextlib.contextmanager
def burners(count: int) -> Iterator[list[int]]:
    """`count` processes that each burn one core until the block ends; yields their pids."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _status(path: pathlib.Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def versions_at(shard_records: list[dict[str, Any]], t: float) -> list[int]:
    """Each fragment's version as the shards' status records had it at instant `t`."""
    seen: dict[str, int] = {}
    for r in shard_records:
        if r["time"] <= t:
            seen.update({k: int(v) for k, v in (r.get("versions") or {}).items()})
    return [seen[k] for k in sorted(seen, key=int)]


def summary(report: dict[str, Any], run_dir: pathlib.Path, cfg: UpConfig) -> dict[str, Any]:
    """One run's cadence figures from its report and status files."""
    g = report["global"]
    periods = max(r["steps"] for r in report["learners"].values()) / cfg.period
    finished = []  # when each learner's last training step was recorded
    for spec in learner_specs(cfg):
        records = [
            r
            for r in _status(run_dir / "learners" / f"{spec.name}.jsonl")
            if r.get("state") == "training" and r.get("step", 0) >= cfg.steps - 1
        ]
        if records:
            finished.append(records[0]["time"])
    final = [
        int(v) for _, v in sorted((g.get("versions") or {}).items(), key=lambda kv: int(kv[0]))
    ]
    at_first = versions_at(_status(run_dir / "shards.jsonl"), min(finished)) if finished else []
    return {
        "outer_steps_per_fragment": final,
        "periods_of_fastest": round(periods, 2),
        "ratio": [round(v / periods, 3) for v in final],
        "ratio_when_fastest_finished": [round(v / periods, 3) for v in at_first],
        "push_bits_per_param": g.get("push_bits_per_param"),
        "pull_bits_per_param": g.get("pull_bits_per_param"),
        "wall_seconds": report.get("wall_seconds"),
        "run_dir": str(run_dir),
    }


def bench_cadence(
    cfg: UpConfig, seeds: tuple[int, ...], burn: int, work_dir: pathlib.Path
) -> dict[str, Any]:
    runs = {}
    for seed in seeds:
        run_dir = work_dir / f"seed{seed}"
        at_seed, _ = prepare_run_dir(run_dir, {**_overrides(cfg), "seed": seed})
        load_before = os.getloadavg()[0]
        with burners(burn):
            report = Session(at_seed, run_dir, sys.stderr, live=False).run()
        if not report.get("complete"):
            raise RuntimeError(f"the run in {run_dir} did not finish: {report.get('failure')}")
        runs[str(seed)] = summary(report, run_dir, at_seed) | {
            "load_average_before": round(load_before, 1),
            "load_average_after": round(os.getloadavg()[0], 1),
        }
    ratios = [r for run in runs.values() for r in run["ratio"]]
    pulls = [run["pull_bits_per_param"] or 0.0 for run in runs.values()]
    return {
        "settings": _overrides(cfg) | {"burners": burn, "seeds": list(seeds)},
        "runs": runs,
        "ratio_range": [min(ratios), max(ratios)],
        "pull_bits_range": [round(min(pulls), 3), round(max(pulls), 3)],
        "targets": {
            "ratio_within": [RATIO_LOW, RATIO_HIGH],
            "ratio_met": all(RATIO_LOW <= r <= RATIO_HIGH for r in ratios),
            "pull_bits_max": PULL_BITS_MAX,
            "pull_bits_met": all(p <= PULL_BITS_MAX for p in pulls),
        },
    }


def _overrides(cfg: UpConfig) -> dict[str, Any]:
    keys = ("learners", "preset", "steps", "batch_size", "period", "overlap", "fragments")
    return {k: getattr(cfg, k) for k in keys} | {
        "quorum": cfg.quorum,
        "evals": cfg.evals,
        "slowdown": list(cfg.slowdown),
        "same_time": cfg.same_time,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--steps", type=positive_int, default=2000, help="steps per learner (default %(default)s)"
    )
    p.add_argument("--period", type=positive_int, default=64, help="H (default %(default)s)")
    p.add_argument("--learners", type=positive_int, default=4, help="M (default %(default)s)")
    p.add_argument(
        "--burners",
        type=non_negative_int,
        default=1,
        help="CPU-burning processes beside the run (default %(default)s)",
    )
    p.add_argument("--seeds", type=seed_list, default=(0,), help="comma-separated (default 0)")
    p.add_argument(
        "--work-dir", type=pathlib.Path, help="where the runs go (default: a temporary directory)"
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (the only output format)"
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        cfg = UpConfig(
            learners=args.learners,
            preset="tiny",
            steps=args.steps,
            slowdown=(1.0,) * args.learners,
            same_time=False,
            batch_size=16,
            period=args.period,
            overlap=1,
            fragments=4,
            quorum=min(2, args.learners),
            evals=1,
        )
    except UpConfigError as e:
        parser.error(str(e))
    if args.work_dir is not None and args.work_dir.exists() and any(args.work_dir.iterdir()):
        parser.error(f"--work-dir {args.work_dir} is not empty: give a new or empty directory")
    if args.work_dir is not None:
        result = bench_cadence(cfg, args.seeds, args.burners, args.work_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="atoll-cadence-") as d:
            result = bench_cadence(cfg, args.seeds, args.burners, pathlib.Path(d))
    print(json.dumps(result, indent=2))
    return 0
