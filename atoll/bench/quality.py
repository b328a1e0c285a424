"""`atoll bench quality`: does the method train as well as data-parallel training?

Four runs of the same model on the same data for the same number of tokens:
(a) the data-parallel baseline (one process, M× batch), (b) atoll with M learners
and 4-bit outer gradients, (c) the same with fp32 outer gradients, (d) (b) with
mixed-speed islands: half the learners 2× slower (`--slowdown 2`), each still training
its full share of tokens, so the slow ones take fewer inner steps per sync and twice
the wall time. Each atoll run is
a real `atoll up` (shard and learner processes over loopback); its eval loss is the
*global* model's, pulled from the shards at the end, on the same held-out rows the
baseline is scored on.

Bandwidth is counted the way the issue defines it: data-parallel training exchanges
one fp32 gradient per step per learner (4 bytes per parameter, one direction), atoll
what its learners actually sent (Init offers, pushes); the figure counting both
directions (DP 8 bytes per parameter per step against atoll's sent + received,
the start-up snapshot pulls included) is printed next to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile

from atoll.commands import positive_int
from atoll.local.config import UpConfig, prepare_run_dir
from atoll.local.session import Session

TARGET_GAP_PCT = 1.0
TARGET_REDUCTION = 400.0
MIXED_SLOWDOWN = 2.0  # how much slower the slow half of the islands is in run (d)


def _run(cfg: UpConfig, run_dir: pathlib.Path) -> dict:
    cfg, _ = prepare_run_dir(run_dir, dataclasses.asdict(cfg) | {"slowdown": list(cfg.slowdown)})
    report = Session(cfg, run_dir, sys.stderr, live=False).run()
    if not report.get("complete"):
        raise RuntimeError(
            f"the run in {run_dir} did not finish: {report.get('failure') or report.get('interrupted')}"
        )
    return report


def bench_quality(cfg: UpConfig, work_dir: pathlib.Path | None = None) -> dict:
    """Runs (a), (b), (c) and compares them; `cfg` is (b)'s configuration."""
    base = pathlib.Path(work_dir or tempfile.mkdtemp(prefix="atoll-quality-"))
    four = _run(dataclasses.replace(cfg, codec="int4", baseline=True), base / "int4")
    fp32 = _run(dataclasses.replace(cfg, codec="fp32", baseline=False), base / "fp32")
    m = cfg.learners
    slow = tuple(1.0 if i < m - m // 2 else MIXED_SLOWDOWN for i in range(m))
    mixed = _run(
        dataclasses.replace(cfg, codec="int4", baseline=False, slowdown=slow, same_time=False),
        base / "mixed",
    )
    learners = four["learners"].values()
    params = next(iter(learners))["params"]
    steps = sum(r["steps"] for r in learners)
    sent = sum(r["bytes_sent"] for r in learners)
    received = sum(r["bytes_received"] for r in learners)
    bytes_dp = steps * params * 4  # one fp32 gradient per learner step
    baseline_loss = four["baseline"]["final_eval_loss"]
    loss4, loss32 = four["global"]["eval_loss"], fp32["global"]["eval_loss"]
    loss_mixed = mixed["global"]["eval_loss"]
    gap = 100 * (loss4 / baseline_loss - 1)
    mixed_gap = 100 * (loss_mixed / baseline_loss - 1)
    reduction = bytes_dp / sent
    return {
        "budget": {
            "preset": cfg.preset,
            "params": params,
            "learners": cfg.learners,
            "tokens": four["global"]["tokens"],
            "baseline_tokens": four["baseline"]["tokens"],
            "inner_steps_per_learner": cfg.steps,
            "batch_size": cfg.batch_size,
            "period": cfg.period,
            "overlap": cfg.overlap,
            "fragments": cfg.fragments,
            "mixed_tokens": mixed["global"]["tokens"],
            "mixed_slowdown": list(slow),
        },
        "config": {
            "outer_lr": cfg.outer_lr,
            "outer_momentum": cfg.outer_momentum,
            "momentum_delay": cfg.momentum_delay,
            "quorum": cfg.quorum,
            "learners": cfg.learners,
            "grace_factor": cfg.grace_factor,
            "seed": cfg.seed,
        },
        "baseline_eval_loss": baseline_loss,
        "atoll_4bit_eval_loss": loss4,
        "atoll_fp32_eval_loss": loss32,
        "atoll_mixed_speed_eval_loss": loss_mixed,
        "gap_pct": round(gap, 3),
        "mixed_speed_gap_pct": round(mixed_gap, 3),
        "gap_fp32_pct": round(100 * (loss32 / baseline_loss - 1), 3),
        "bytes_dp": bytes_dp,
        "bytes_atoll": sent,
        "bytes_atoll_received": received,
        "bytes_atoll_fp32": sum(r["bytes_sent"] for r in fp32["learners"].values()),
        "bandwidth_reduction": round(reduction, 1),
        "bandwidth_reduction_both_ways": round(2 * bytes_dp / (sent + received), 1),
        "outer_steps_per_period": {
            "int4": four["global"].get("outer_steps_per_period"),
            "mixed": mixed["global"].get("outer_steps_per_period"),
        },
        "wall_seconds": {
            "int4_and_baseline": four["wall_seconds"],
            "fp32": fp32["wall_seconds"],
            "mixed": mixed["wall_seconds"],
        },
        "run_dirs": {
            "int4": str(base / "int4"),
            "fp32": str(base / "fp32"),
            "mixed": str(base / "mixed"),
        },
        "targets": {
            "gap_pct": {
                "want": f"<= {TARGET_GAP_PCT}",
                "got": round(gap, 3),
                "met": gap <= TARGET_GAP_PCT,
            },
            "mixed_speed_gap_pct": {
                "want": f"<= {TARGET_GAP_PCT}",
                "got": round(mixed_gap, 3),
                "met": mixed_gap <= TARGET_GAP_PCT,
            },
            "bandwidth_reduction": {
                "want": f">= {TARGET_REDUCTION:g}",
                "got": round(reduction, 1),
                "met": reduction >= TARGET_REDUCTION,
            },
        },
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll bench quality`."""
    from atoll.server.config import OUTER_LR, OUTER_MOMENTUM, OUTER_MOMENTUM_DELAY

    p.add_argument("--preset", default="tiny", help="model preset (default %(default)s)")
    p.add_argument(
        "--steps",
        type=positive_int,
        default=4000,
        help="inner steps per learner (default %(default)s)",
    )
    p.add_argument("--learners", type=positive_int, default=4, help="M (default %(default)s)")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=16,
        help="sequences per learner step (default %(default)s)",
    )
    p.add_argument("--period", type=positive_int, default=64, help="H (default %(default)s)")
    p.add_argument("--overlap", type=int, default=1, help="τ (default %(default)s)")
    p.add_argument("--fragments", type=positive_int, default=4, help="P (default %(default)s)")
    p.add_argument("--quorum", type=positive_int, default=2, help="K (default %(default)s)")
    p.add_argument(
        "--outer-lr", type=float, default=OUTER_LR, help="shards' outer lr (default %(default)s)"
    )
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=OUTER_MOMENTUM,
        help="shards' outer Nesterov momentum (default %(default)s)",
    )
    p.add_argument(
        "--momentum-delay",
        type=positive_int,
        default=OUTER_MOMENTUM_DELAY,
        help="rounds per outer momentum update (delayed Nesterov) (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="init and data-order seed (default %(default)s)"
    )
    p.add_argument(
        "--work-dir",
        type=pathlib.Path,
        default=None,
        help="where the runs go (default: a temp dir)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (the only output format)"
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from atoll.local.config import UpConfigError

    try:
        cfg = UpConfig(
            learners=args.learners,
            preset=args.preset,
            steps=args.steps,
            slowdown=(1.0,) * args.learners,
            batch_size=args.batch_size,
            period=args.period,
            overlap=args.overlap,
            fragments=args.fragments,
            quorum=args.quorum,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            momentum_delay=args.momentum_delay,
            evals=4,
            seed=args.seed,
        )
    except UpConfigError as e:
        parser.error(str(e))
    print(json.dumps(bench_quality(cfg, args.work_dir), indent=2))
    return 0
