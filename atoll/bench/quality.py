"""`atoll bench quality`: the quality / bandwidth frontier against data-parallel training
and synchronous DiLoCo.

For each seed, the data-parallel baseline (one process, M× batch) and, for each sync
period H in `periods`, the same model on the same data for the same tokens trained by

* `atoll`: atoll at its defaults (K of M learners close a round, delayed Nesterov,
  4-bit outer gradients and published deltas);
* `sync`: synchronous DiLoCo in the same harness: K = M, learners wait for every
  round, Nesterov every round (`momentum_delay` 1), the same codec
  (`synchronous_config`);
* `mixed`: `atoll` with half the learners `slowdown`× slower, each still training its
  full share of tokens (so the slow ones take fewer inner steps per sync);
* with `fp32`, `atoll_fp32` and `sync_fp32`: the first two with lossless fp32 pushes and
  published deltas, for the cost of 4 bits.

Each run is a real `atoll up` (shard and learner processes over loopback); its eval
loss is the *global* model's, pulled from the shards at the end, on the held-out rows
the baseline is scored on. Bandwidth as the issue defines it: data-parallel training
exchanges one fp32 gradient per step per learner (4 bytes per parameter, one
direction), a run what its learners sent (Init offers, pushes); the figure counting
both directions (DP 8 bytes per parameter per step against sent + received, the
start-up snapshot pulls included) is printed next to it.

The summary (`summarise`) is a pure function of the runs' reports: tests feed it
reports of their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from atoll.commands import period_list, positive_int, seed_list
from atoll.faults.chaos import lockstep_config
from atoll.learner.defaults import SYNC_PATIENCE as SYNC_PATIENCE_DEFAULT
from atoll.local.config import UpConfig, learner_specs, prepare_run_dir
from atoll.local.progress import read_status
from atoll.local.session import Session

PERIODS = (32, 64)
MIXED_SLOWDOWN = 2.0  # how much slower the slow half of the islands is in the mixed run
# A synchronous learner waits this long on a round before it trains on (the learner's
# default; `atoll chaos`'s lockstep waits for ever): a run that stalls still ends, and
# reports it (`stalls`).
SYNC_PATIENCE = SYNC_PATIENCE_DEFAULT
METHODS = ("atoll", "sync", "mixed")
FP32_METHODS = ("atoll_fp32", "sync_fp32")
# the targets, by H (where a period is not measured, its target is left out)
TARGET_GAP_EVERY_SEED = {32: 1.0}
TARGET_GAP_MEAN = {64: 2.0}
TARGET_INT4_COST_MEAN = {64: 0.5}
TARGET_MIXED_GAP_MEAN = {32: 1.0}


def synchronous_config(cfg: UpConfig) -> UpConfig:
    """Synchronous DiLoCo from `cfg`: `atoll chaos`'s lockstep semantics (K = M, no
    grace window, nobody dropped, learners wait for their rounds and push each fragment
    by step count), Nesterov every round, the same fragments and shards as `cfg`."""
    return dataclasses.replace(lockstep_config(cfg), momentum_delay=1, sync_patience=SYNC_PATIENCE)


def mixed_config(cfg: UpConfig, slowdown: float) -> UpConfig:
    """`cfg` with the last M//2 learners `slowdown`× slower, each training all its steps."""
    m = cfg.learners
    slow = tuple(1.0 if i < m - m // 2 else slowdown for i in range(m))
    return dataclasses.replace(cfg, slowdown=slow, same_time=False)


def run_configs(
    cfg: UpConfig, periods: Sequence[int], fp32: bool, slowdown: float
) -> dict[str, UpConfig]:
    """{name: config} of one seed's runs; `cfg` is atoll's at the first period, and its
    run also trains the data-parallel baseline (the same for every H)."""
    out = {}
    for i, h in enumerate(periods):
        at_h = dataclasses.replace(cfg, period=h, codec="int4", baseline=i == 0)
        plain = dataclasses.replace(at_h, baseline=False)
        out[f"atoll-h{h}"] = at_h
        out[f"sync-h{h}"] = synchronous_config(plain)
        out[f"mixed-h{h}"] = mixed_config(plain, slowdown)
        if fp32:
            out[f"atoll_fp32-h{h}"] = dataclasses.replace(plain, codec="fp32")
            out[f"sync_fp32-h{h}"] = synchronous_config(dataclasses.replace(plain, codec="fp32"))
    return out


def _run(cfg: UpConfig, run_dir: pathlib.Path) -> dict[str, Any]:
    cfg, _ = prepare_run_dir(run_dir, dataclasses.asdict(cfg) | {"slowdown": list(cfg.slowdown)})
    report = Session(cfg, run_dir, sys.stderr, live=False).run()
    if not report.get("complete"):
        raise RuntimeError(
            f"the run in {run_dir} did not finish: {report.get('failure') or report.get('interrupted')}"
        )
    report["stalls"] = sum(
        (read_status(run_dir / "learners" / f"{s.name}.jsonl") or [{}])[-1].get("stalled", 0)
        for s in learner_specs(cfg)
    )
    return report


def run_summary(report: dict[str, Any], baseline_loss: float) -> dict[str, Any]:
    """One run's figures from its `atoll up` report."""
    g = report["global"]
    learners = report["learners"].values()
    params = next(iter(learners))["params"]
    steps = sum(r["steps"] for r in learners)
    sent = sum(r["bytes_sent"] for r in learners)
    received = sum(r["bytes_received"] for r in learners)
    bytes_dp = steps * params * 4  # one fp32 gradient per learner step
    versions = [
        int(v) for _, v in sorted((g.get("versions") or {}).items(), key=lambda kv: int(kv[0]))
    ]
    return {
        "eval_loss": g["eval_loss"],
        "gap_pct": round(100 * (g["eval_loss"] / baseline_loss - 1), 3),
        "outer_steps_per_fragment": versions,  # the fragments' global versions at the end
        "periods_per_learner": round(
            max(r["steps"] for r in learners) / report["config"]["period"], 2
        ),
        "outer_steps_per_period": g.get("outer_steps_per_period"),
        "push_bits_per_param": g.get("push_bits_per_param"),
        "pull_bits_per_param": g.get("pull_bits_per_param"),
        "bandwidth_reduction": round(bytes_dp / sent, 1),
        "bandwidth_reduction_both_ways": round(2 * bytes_dp / (sent + received), 1),
        "bytes_sent": sent,
        "bytes_received": received,
        "tokens": g["tokens"],
        "stalls": report.get("stalls", 0),
        "wall_seconds": report["wall_seconds"],
        "run_dir": report["run_dir"],
    }


def _spread(values: list[float]) -> dict[str, Any]:
    return {
        "mean": round(statistics.fmean(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "seeds": [round(v, 3) for v in values],
    }


def summarise(
    reports: dict[int, dict[str, dict[str, Any]]], periods: Sequence[int], seeds: Sequence[int]
) -> dict[str, Any]:
    """The frontier from every run's report: `reports[seed][name]` (`run_configs`' names)."""
    baseline = {s: reports[s][f"atoll-h{periods[0]}"]["baseline"]["final_eval_loss"] for s in seeds}
    runs = {
        h: {
            method: {s: run_summary(reports[s][f"{method}-h{h}"], baseline[s]) for s in seeds}
            for method in METHODS + FP32_METHODS
            if f"{method}-h{h}" in reports[seeds[0]]
        }
        for h in periods
    }

    def over_seeds(h: int, method: str, key: str) -> dict[str, Any]:
        return _spread([runs[h][method][s][key] for s in seeds])

    def difference(h: int, a: str, b: str) -> dict[str, Any]:
        return _spread([runs[h][a][s]["gap_pct"] - runs[h][b][s]["gap_pct"] for s in seeds])

    frontier = {
        h: {
            method: {
                key: over_seeds(h, method, key)
                for key in (
                    "gap_pct",
                    "bandwidth_reduction",
                    "push_bits_per_param",
                    "pull_bits_per_param",
                )
            }
            for method in runs[h]
        }
        for h in periods
    }
    out = {
        "seeds": list(seeds),
        "periods": list(periods),
        "baseline_eval_loss": {str(s): baseline[s] for s in seeds},
        "runs": {
            str(h): {m: {str(s): r for s, r in by.items()} for m, by in runs[h].items()}
            for h in periods
        },
        "frontier": {str(h): f for h, f in frontier.items()},
        "async_minus_sync_pct": {str(h): difference(h, "atoll", "sync") for h in periods},
        "mixed_speed_gap_pct": {str(h): over_seeds(h, "mixed", "gap_pct") for h in periods},
    }
    if all("atoll_fp32" in runs[h] for h in periods):
        out["int4_cost_pct"] = {
            str(h): {
                "atoll": difference(h, "atoll", "atoll_fp32"),
                "sync": difference(h, "sync", "sync_fp32"),
            }
            for h in periods
        }
    out["targets"] = _targets(out, periods)
    return out


def _targets(out: dict[str, Any], periods: Sequence[int]) -> dict[str, Any]:
    def target(want: str, got: float, met: bool) -> dict[str, Any]:
        return {"want": want, "got": got, "met": met}

    t = {}
    for h in periods:
        k = str(h)
        diff = out["async_minus_sync_pct"][k]["mean"]
        t[f"async_minus_sync_pct_h{h}"] = target("mean <= 0", diff, diff <= 0)
        gap = out["frontier"][k]["atoll"]["gap_pct"]
        if h in TARGET_GAP_EVERY_SEED:
            limit = TARGET_GAP_EVERY_SEED[h]
            t[f"gap_pct_h{h}"] = target(f"every seed <= {limit}", gap["max"], gap["max"] <= limit)
        if h in TARGET_GAP_MEAN:
            limit = TARGET_GAP_MEAN[h]
            t[f"gap_pct_h{h}"] = target(f"mean <= {limit}", gap["mean"], gap["mean"] <= limit)
        if h in TARGET_MIXED_GAP_MEAN:
            limit, mixed = TARGET_MIXED_GAP_MEAN[h], out["mixed_speed_gap_pct"][k]["mean"]
            t[f"mixed_speed_gap_pct_h{h}"] = target(f"mean <= {limit}", mixed, mixed <= limit)
        if h in TARGET_INT4_COST_MEAN and "int4_cost_pct" in out:
            limit = TARGET_INT4_COST_MEAN[h]
            for method, cost in out["int4_cost_pct"][k].items():
                t[f"int4_cost_pct_{method}_h{h}"] = target(
                    f"mean <= {limit}", cost["mean"], cost["mean"] <= limit
                )
    return t


def plot_frontier(result: dict[str, Any], path: pathlib.Path) -> None:
    """frontier.png: gap to data-parallel against bandwidth saved, one curve per method
    (a point per H, the mean over seeds with the seeds' range as error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([1], [0], "ks", label="data-parallel")
    labels = {
        "atoll": "atoll (int4)",
        "sync": "synchronous DiLoCo (int4)",
        "mixed": "atoll, mixed-speed learners",
        "atoll_fp32": "atoll (fp32)",
        "sync_fp32": "synchronous DiLoCo (fp32)",
    }
    periods = result["periods"]
    for method, label in labels.items():
        points = [result["frontier"][str(h)].get(method) for h in periods]
        if not all(points):
            continue
        x = [p["bandwidth_reduction"]["mean"] for p in points]
        y = [p["gap_pct"]["mean"] for p in points]
        err = [
            [m - p["gap_pct"]["min"] for p, m in zip(points, y)],
            [p["gap_pct"]["max"] - m for p, m in zip(points, y)],
        ]
        dashed = "--" if method.endswith("fp32") else "-"
        line = ax.errorbar(x, y, yerr=err, fmt="o" + dashed, capsize=3, label=label)
        for h, xi, yi in zip(periods, x, y):
            ax.annotate(
                f"H={h}",
                (xi, yi),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
                color=line[0].get_color(),
            )
    ax.set_xscale("log")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("bandwidth saved against data-parallel (×, learners' bytes sent)")
    ax.set_ylabel("eval loss gap to data-parallel (%)")
    seeds = result["seeds"]
    which = f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
    ax.set_title(f"quality / bandwidth frontier at equal tokens, {which}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_quality(
    cfg: UpConfig,
    periods: Sequence[int] = PERIODS,
    seeds: Sequence[int] = (0,),
    *,
    fp32: bool = False,
    slowdown: float = MIXED_SLOWDOWN,
    work_dir: pathlib.Path | None = None,
    out_dir: pathlib.Path | None = None,
) -> dict[str, Any]:
    """Every run of the frontier, then their summary; `cfg` is atoll's settings but H and the seed."""
    base = pathlib.Path(work_dir or tempfile.mkdtemp(prefix="atoll-quality-"))
    reports: dict[int, dict[str, dict[str, Any]]] = {}
    for seed in seeds:
        configs = run_configs(dataclasses.replace(cfg, seed=seed), periods, fp32, slowdown)
        reports[seed] = {name: _run(c, base / f"seed{seed}" / name) for name, c in configs.items()}
    result = {
        "budget": {
            "preset": cfg.preset,
            "params": next(iter(reports[seeds[0]][f"atoll-h{periods[0]}"]["learners"].values()))[
                "params"
            ],
            "learners": cfg.learners,
            "tokens": reports[seeds[0]][f"atoll-h{periods[0]}"]["global"]["tokens"],
            "baseline_tokens": reports[seeds[0]][f"atoll-h{periods[0]}"]["baseline"]["tokens"],
            "inner_steps_per_learner": cfg.steps,
            "batch_size": cfg.batch_size,
            "overlap": cfg.overlap,
            "fragments": cfg.fragments,
            "mixed_slowdown": list(mixed_config(cfg, slowdown).slowdown),
        },
        "config": {
            "atoll": _settings(cfg),
            "sync": _settings(synchronous_config(cfg)),
        },
        **summarise(reports, tuple(periods), tuple(seeds)),
        "wall_seconds": round(
            sum(r["wall_seconds"] for by in reports.values() for r in by.values()), 1
        ),
        "work_dir": str(base),
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        plot_frontier(result, out_dir / "frontier.png")
        result["plot"] = str(out_dir / "frontier.png")
    return result


def _settings(cfg: UpConfig) -> dict[str, Any]:
    return {
        "outer_lr": cfg.outer_lr,
        "outer_momentum": cfg.outer_momentum,
        "momentum_delay": cfg.momentum_delay,
        "quorum": cfg.quorum,
        "grace_factor": cfg.grace_factor,
        "wait_for_rounds": cfg.wait_for_rounds,
        "fragments": cfg.fragments,
        "sync_patience": cfg.sync_patience,
    }


def _slowdown(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a number >= 1, got {text!r}") from None
    if not value >= 1 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"want a finite number >= 1, got {text!r}")
    return value


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
    p.add_argument(
        "--periods",
        type=period_list,
        default=PERIODS,
        help="sync periods H to measure, comma-separated (default 32,64)",
    )
    p.add_argument("--overlap", type=int, default=1, help="τ (default %(default)s)")
    p.add_argument("--fragments", type=positive_int, default=4, help="P (default %(default)s)")
    p.add_argument("--quorum", type=positive_int, default=2, help="atoll's K (default %(default)s)")
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
        help="atoll's rounds per outer momentum update (delayed Nesterov; synchronous "
        "DiLoCo takes 1) (default %(default)s)",
    )
    p.add_argument(
        "--seeds",
        type=seed_list,
        default=(0,),
        help="init and data-order seeds, comma-separated; every run for each (default 0)",
    )
    p.add_argument(
        "--fp32",
        action="store_true",
        help="also run atoll and synchronous DiLoCo with fp32 outer gradients and deltas "
        "(int4_cost_pct)",
    )
    p.add_argument(
        "--slowdown",
        type=_slowdown,
        default=MIXED_SLOWDOWN,
        help="how much slower half the learners are in the mixed-speed run (default %(default)s)",
    )
    p.add_argument(
        "--work-dir",
        type=pathlib.Path,
        default=None,
        help="where the runs go (default: a temp dir)",
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="draw DIR/frontier.png (gap against bandwidth saved)",
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
            period=args.periods[0],
            overlap=args.overlap,
            fragments=args.fragments,
            quorum=args.quorum,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            momentum_delay=args.momentum_delay,
            evals=4,
            seed=args.seeds[0],
        )
        for h in args.periods:  # every period must fit the other settings (τ < H, ...)
            run_configs(dataclasses.replace(cfg, period=h), (h,), args.fp32, args.slowdown)
    except UpConfigError as e:
        parser.error(str(e))
    if args.work_dir is not None and args.work_dir.exists() and any(args.work_dir.iterdir()):
        parser.error(f"--work-dir {args.work_dir} is not empty: give a new or empty directory")
    result = bench_quality(
        cfg,
        args.periods,
        args.seeds,
        fp32=args.fp32,
        slowdown=args.slowdown,
        work_dir=args.work_dir,
        out_dir=args.out,
    )
    print(json.dumps(result, indent=2))
    return 0
