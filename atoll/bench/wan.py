"""`atoll bench wan`: data-parallel training and atoll across the same emulated regions.

R regions (network namespaces behind `tbf` links and a latency proxy, atoll.faults.wan),
one learner each, the same model, total batch, data and tokens for two runs:
  * data-parallel: the R learners are one `jax.distributed` job (atoll/bench/data_parallel.py)
    whose gradients are all-reduced every step over gloo, region to region through the
    emulated links; the coordination service runs on the host side;
  * atoll at its defaults (`atoll up`'s learners, shards on the host side).
Each link's bytes are the `tbf` counters of both ends (Ethernet frames: headers and
retransmissions included), sampled every SAMPLE_S during training.

The comparison:
  * speedup_at_equal_loss: seconds of training data-parallel needs to reach the lowest
    eval loss both runs reach, over atoll's (linear between evaluations);
  * dp_needed_mbit_s: the link rate data-parallel would need to run at its compute-bound
    speed (its bytes per step on the busiest link over its compute step);
  * bandwidth_ratio: that rate over the mean rate atoll's busiest link carried;
  * all_reduce_over_compute: data-parallel's median all-reduce over its median compute
    step (gradient + update), at the chosen model and rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import signal
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from atoll.commands import Terminated, positive_int, raise_terminated
from atoll.learner.defaults import LATE_MIX, PERIOD

if TYPE_CHECKING:
    from atoll.faults.wan import Wan, WanConfig
    from atoll.local.config import LearnerSpec, UpConfig
    from atoll.local.session import Session

SAMPLE_S = 0.5  # how often the links' counters are read
PEER_PORTS = (61000, 61031)  # each region's ephemeral ports (gloo binds one)
TARGET_SPEEDUP = 10.0
TARGET_RATIO = 20.0  # all-reduce / compute step at which the speedup target applies
TARGET_BANDWIDTH_RATIO = 200.0
TARGET_GAP_PCT = 3.0


@dataclasses.dataclass(frozen=True)
class WanBenchConfig:
    regions: int = 2  # R: regions, one learner each, >= 2
    rate_mbit: float = 10.0  # link rate per region and direction, Mbit/s
    latency_ms: float = 20.0  # one-way delay region <-> host (region to region: the same)
    preset: str = "tiny"  # model preset
    # optimiser steps (data-parallel) = inner steps per learner (atoll): at 1,000 or 2,000
    # the method's own gap at equal tokens has not closed (README, "Across regions")
    steps: int = 3000
    batch_size: int = 16  # sequences per learner per step; the global batch is R x this
    evals: int = 8  # evaluations during each run (plus the final one)
    seed: int = 0
    period: int = PERIOD  # atoll's H (its default): inner steps between syncs of a fragment
    late_mix: float = LATE_MIX  # atoll's late-adoption mix cap (its default: off)

    def __post_init__(self) -> None:
        from atoll.faults.wan import WanConfig

        if not (isinstance(self.regions, int) and self.regions >= 2):
            raise ValueError(f"--regions must be >= 2 (one is no all-reduce), got {self.regions}")
        WanConfig(self.regions, self.rate_mbit, self.latency_ms)  # checks rate and latency
        if not (isinstance(self.period, int) and self.period >= 1):
            raise ValueError(f"--period must be >= 1, got {self.period}")
        if not 0 <= self.late_mix < 1:
            raise ValueError(f"--late-mix must be in [0, 1), got {self.late_mix}")
        if self.steps < 2 * self.evals:
            raise ValueError(f"--steps must be at least 2 x evals ({2 * self.evals})")


class LinkSampler:
    """Reads every link's tbf byte counters every SAMPLE_S in a thread: (time, {link: bytes})."""

    def __init__(self, wan: Wan) -> None:
        self.wan = wan
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-sampler", daemon=True)

    def _read(self) -> tuple[float, dict[str, int]]:
        stats = self.wan.stats()
        return time.time(), {
            f"r{r}_{d}": int(s[f"tc_{d}"].get("bytes", 0))
            for r, s in stats.items()
            for d in ("up", "down")
        }

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.samples.append(self._read())

    def __enter__(self) -> LinkSampler:
        self.samples.append(self._read())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self._read())

    def window(self, start: float, end: float) -> dict[str, Any]:
        """Per link: bytes carried in [start, end] (interpolated), peak and mean Mbit/s."""

        def at(t: float, link: str) -> float:
            s = self.samples
            for (t0, a), (t1, b) in zip(s, s[1:]):
                if t0 <= t <= t1:
                    return a[link] + (b[link] - a[link]) * (t - t0) / max(t1 - t0, 1e-9)
            return s[0][1][link] if t < s[0][0] else s[-1][1][link]

        out = {}
        for link in self.samples[0][1]:
            inside = [(t, v[link]) for t, v in self.samples if start <= t <= end]
            rates = [
                8 * (b - a) / (t1 - t0) / 1e6
                for (t0, a), (t1, b) in zip(inside, inside[1:])
                if t1 > t0
            ]
            carried = at(end, link) - at(start, link)
            out[link] = {
                "bytes": int(carried),
                "mean_mbit_s": round(8 * carried / max(end - start, 1e-9) / 1e6, 4),
                "peak_mbit_s": round(max(rates, default=0.0), 4),
            }
        return out


def dp_timeout(cfg: WanBenchConfig) -> float:
    """Seconds the data-parallel job may take before it counts as hung: one and a half
    times what its all-reduces need over the links (each step sends and receives about 2 x 4 bytes a
    parameter on every link, and crosses the delay four times), plus 10 minutes."""
    from atoll.learner.trainer.model import PRESETS

    step_bits = 2 * 4 * 8 * PRESETS[cfg.preset].num_params
    step_seconds = step_bits / (cfg.rate_mbit * 1e6) + 4 * cfg.latency_ms / 1e3
    return 600.0 + 1.5 * cfg.steps * step_seconds


def run_data_parallel(cfg: WanBenchConfig, work_dir: pathlib.Path) -> dict[str, Any]:
    from atoll.bench import data_parallel as dp
    from atoll.faults.wan import Wan, WanConfig

    dcfg = dp.DataParallelConfig(
        preset=cfg.preset,
        shards=cfg.regions,
        batch_size=cfg.batch_size,
        steps=cfg.steps,
        eval_every=cfg.steps // cfg.evals,
        seed=cfg.seed,
    )
    port = dp.free_port()
    coordinator = dp.start_coordinator(cfg.regions, port)
    try:
        wcfg = WanConfig(cfg.regions, cfg.rate_mbit, cfg.latency_ms)
        with Wan(wcfg, [port], peer_ports=PEER_PORTS) as wan:
            placements = [
                dp.Placement(
                    wan.command_prefix(r), wan.shard_addresses(r)[0], wan.region_address(r)
                )
                for r in range(cfg.regions)
            ]
            with LinkSampler(wan) as sampler:
                summary = dp.run_job(dcfg, placements, work_dir, timeout=dp_timeout(cfg))
    finally:
        coordinator.terminate()
        coordinator.wait()
    records = summary["records"]
    start, end = records[0]["wall"], records[-1]["wall"]
    evals = [r for r in records if "eval_loss" in r]
    median = summary["median"]
    compute = median["compute_s"] + median["update_s"]
    return {
        "train_seconds": round(summary["train_seconds"], 3),
        "steps": summary["steps"],
        "steps_per_s": round(summary["steps"] / summary["train_seconds"], 3),
        "tokens": summary["tokens"],
        "params": summary["params"],
        "final_eval_loss": summary["final_eval_loss"],
        "median_step_s": {k: round(v, 5) for k, v in median.items()},
        "compute_step_s": round(compute, 5),
        "all_reduce_over_compute": round(median["all_reduce_s"] / compute, 2),
        "links": sampler.window(start, end),
        "eval": [
            {"seconds": r["time"], "tokens": r["tokens"], "eval_loss": r["eval_loss"]}
            for r in evals
        ],
    }


def _wan_session(
    cfg: UpConfig, run_dir: pathlib.Path, wcfg: WanConfig, holder: dict[str, Any]
) -> Session:
    """An `atoll up` session whose learner i runs in region i, shards on the host."""
    from atoll.faults.wan import Wan
    from atoll.local.session import Session

    class WanSession(Session):
        def _start_shards(self) -> None:
            super()._start_shards()
            if self._running():
                ports = [s.port for s in self.shards if s.port is not None]
                assert len(ports) == len(self.shards), "every shard printed its serving line"
                holder["wan"] = Wan(wcfg, ports).__enter__()
                holder["sampler"] = LinkSampler(holder["wan"]).__enter__()

        def _addresses_for(self, spec: LearnerSpec) -> list[str]:
            wan: Wan = holder["wan"]
            return wan.shard_addresses(spec.index)

        def _prefix_for(self, spec: LearnerSpec) -> list[str]:
            wan: Wan = holder["wan"]
            return wan.command_prefix(spec.index)

    return WanSession(cfg, run_dir, sys.stderr, live=False)


def run_atoll(cfg: WanBenchConfig, run_dir: pathlib.Path) -> dict[str, Any]:
    from atoll.faults.wan import WanConfig
    from atoll.local.config import UpConfig, prepare_run_dir
    from atoll.local.progress import read_status

    up = UpConfig(
        learners=cfg.regions,
        preset=cfg.preset,
        steps=cfg.steps,
        slowdown=(1.0,) * cfg.regions,
        batch_size=cfg.batch_size,
        evals=cfg.evals,
        seed=cfg.seed,
        period=cfg.period,
        late_mix=cfg.late_mix,
    )
    up, _ = prepare_run_dir(run_dir, dataclasses.asdict(up) | {"slowdown": list(up.slowdown)})
    holder: dict[str, Any] = {}
    try:
        report = _wan_session(
            up, run_dir, WanConfig(cfg.regions, cfg.rate_mbit, cfg.latency_ms), holder
        ).run()
    finally:
        if "sampler" in holder:
            holder["sampler"].__exit__()
        if "wan" in holder:
            holder["wan"].close()
    if not report.get("complete"):
        raise RuntimeError(
            f"the atoll run in {run_dir} did not finish: "
            f"{report.get('failure') or report.get('interrupted')}"
        )
    records = [read_status(run_dir / "learners" / f"learner-{i}.jsonl") for i in range(cfg.regions)]
    # training starts at each learner's first step (start-up and compile are not counted,
    # as they are not for data-parallel) and ends at the last learner's last record
    firsts = [next(r for r in rs if r.get("step", 0) >= 1) for rs in records]
    start = min(r["time"] - r["step"] * r.get("step_seconds", 0.0) for r in firsts)
    end = max(rs[-1]["time"] for rs in records)
    evals = []
    by_learner = [[r for r in rs if r.get("eval_loss") is not None] for rs in records]
    for points in zip(*by_learner):  # the learners' k-th evaluations (of their own weights)
        evals.append(
            {
                "seconds": round(max(p["time"] for p in points) - start, 3),
                "tokens": sum(p["tokens"] for p in points),
                "eval_loss": sum(p["eval_loss"] for p in points) / len(points),
                "model": "learners (mean)",
            }
        )
    g = report["global"]
    final = {
        "seconds": round(end - start, 3),
        "tokens": g["tokens"],
        "eval_loss": g["eval_loss"],
        "model": "global",
    }
    steps = max(rs[-1]["step"] for rs in records)
    return {
        "train_seconds": round(end - start, 3),
        "steps": steps,
        "steps_per_s": round(steps / (end - start), 3),
        "tokens": g["tokens"],
        "final_eval_loss": g["eval_loss"],
        "settings": {  # atoll's defaults but for --period and --late-mix
            "period": up.period,
            "overlap": up.overlap,
            "late_mix": up.late_mix,
            "fragments": up.fragments,
            "codec": up.codec,
            "shards": up.shards,
        },
        "links": holder["sampler"].window(start, end),
        "eval": evals + [final],
        "run_dir": str(run_dir),
    }


def time_to_loss(evals: list[dict[str, Any]], target: float) -> float | None:
    """Seconds until the eval loss first reaches `target` (linear between evaluations)."""
    prev = None
    for e in evals:
        if e["eval_loss"] <= target:
            seconds: float = e["seconds"]
            if prev is None:
                return seconds
            frac: float = (prev["eval_loss"] - target) / max(
                prev["eval_loss"] - e["eval_loss"], 1e-12
            )
            before: float = prev["seconds"]
            return before + frac * (seconds - before)
        prev = e
    return None


def compare(dp: dict[str, Any], atoll: dict[str, Any], cfg: WanBenchConfig) -> dict[str, Any]:
    """The headline figures from the two runs."""
    target = max(
        min(e["eval_loss"] for e in dp["eval"]), min(e["eval_loss"] for e in atoll["eval"])
    )
    t_dp, t_atoll = time_to_loss(dp["eval"], target), time_to_loss(atoll["eval"], target)
    busiest_dp = max(v["bytes"] for v in dp["links"].values())
    needed_mbit = 8 * busiest_dp / dp["steps"] / dp["compute_step_s"] / 1e6
    atoll_mbit = max(v["mean_mbit_s"] for v in atoll["links"].values())
    dp_mbit = max(v["mean_mbit_s"] for v in dp["links"].values())
    busiest_atoll = max(v["bytes"] for v in atoll["links"].values())
    gap = 100 * (atoll["final_eval_loss"] / dp["final_eval_loss"] - 1)
    speedup = t_dp / t_atoll if t_dp and t_atoll else None
    ratio = needed_mbit / atoll_mbit if atoll_mbit else None
    return {
        "equal_loss": round(target, 4),
        "dp_seconds_to_equal_loss": t_dp,
        "atoll_seconds_to_equal_loss": t_atoll,
        "speedup_at_equal_loss": round(speedup, 2) if speedup else None,
        "dp_needed_mbit_s": round(needed_mbit, 2),
        "atoll_mean_mbit_s": atoll_mbit,
        "dp_mean_mbit_s": dp_mbit,
        "bandwidth_ratio": round(ratio, 1) if ratio else None,
        "bandwidth_ratio_measured": round(dp_mbit / atoll_mbit, 1) if atoll_mbit else None,
        "bytes_ratio_equal_tokens": round(busiest_dp / busiest_atoll, 1) if busiest_atoll else None,
        "all_reduce_over_compute": dp["all_reduce_over_compute"],
        "eval_loss_gap_pct_equal_tokens": round(gap, 3),
        "targets": {
            "speedup_at_equal_loss": {
                "want": f">= {TARGET_SPEEDUP:g} with all-reduce >= {TARGET_RATIO:g}x compute",
                "got": speedup,
                "met": bool(speedup and speedup >= TARGET_SPEEDUP)
                and dp["all_reduce_over_compute"] >= TARGET_RATIO,
            },
            "bandwidth_ratio": {
                "want": f">= {TARGET_BANDWIDTH_RATIO:g}",
                "got": ratio,
                "met": bool(ratio and ratio >= TARGET_BANDWIDTH_RATIO),
            },
            "eval_loss_gap_pct_equal_tokens": {
                "want": f"<= {TARGET_GAP_PCT:g}",
                "got": round(gap, 3),
                "met": gap <= TARGET_GAP_PCT,
            },
        },
    }


def plot(result: dict[str, Any], out_dir: pathlib.Path) -> str:
    """wan.png: eval loss against seconds of training (log) and against tokens, both runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, c = result["config"], result["comparison"]
    fig, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for name, run, style in (
        ("data-parallel", result["data_parallel"], "o-"),
        ("atoll", result["atoll"], "s-"),
    ):
        # the untrained model's loss (at 0 s) stays in the JSON: a log axis has no 0
        timed = [e for e in run["eval"] if e["seconds"] > 0 and e["tokens"] > 0]
        by_time.plot(
            [e["seconds"] for e in timed],
            [e["eval_loss"] for e in timed],
            style,
            label=f"{name} ({run['train_seconds']:.0f} s)",
        )
        by_tokens.plot(
            [e["tokens"] / 1e6 for e in timed],
            [e["eval_loss"] for e in timed],
            style,
            label=name,
        )
    for ax in (by_time, by_tokens):
        ax.axhline(c["equal_loss"], color="grey", lw=0.8, ls="--")
        ax.legend()
    by_time.set_xscale("log")
    by_time.set_xlabel("seconds of training (log)")
    by_time.set_ylabel("held-out eval loss")
    by_time.set_title(
        f"{cfg['regions']} regions, {cfg['rate_mbit']:g} Mbit/s, +{cfg['latency_ms']:g} ms: "
        f"atoll {c['speedup_at_equal_loss']}x faster at equal loss",
        fontsize=10,
    )
    by_tokens.set_xlabel("tokens (M)")
    by_tokens.set_title(
        f"equal tokens: atoll {c['eval_loss_gap_pct_equal_tokens']:+.2f} % eval loss", fontsize=10
    )
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "wan.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def bench_wan(
    cfg: WanBenchConfig, work_dir: pathlib.Path, out_dir: pathlib.Path | None
) -> dict[str, Any]:
    started = time.time()
    dp = run_data_parallel(cfg, work_dir / "data-parallel")
    atoll = run_atoll(cfg, work_dir / "atoll")
    result = {
        "config": dataclasses.asdict(cfg),
        "data_parallel": dp,
        "atoll": atoll,
        "comparison": compare(dp, atoll, cfg),
        "bench_seconds": round(time.time() - started, 1),
        "work_dir": str(work_dir),
    }
    if out_dir is not None:
        result["plot"] = plot(result, out_dir)
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll bench wan`."""
    d = WanBenchConfig()
    p.add_argument("--regions", type=int, default=d.regions, help="R (default %(default)s)")
    p.add_argument(
        "--rate-mbit",
        type=float,
        default=d.rate_mbit,
        help="link rate per region and direction, Mbit/s (default %(default)s)",
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=d.latency_ms,
        help="one-way delay per region, ms (default %(default)s)",
    )
    p.add_argument("--preset", default=d.preset, help="model preset (default %(default)s)")
    p.add_argument(
        "--steps",
        type=positive_int,
        default=d.steps,
        help="steps of each run (per learner for atoll) (default %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=d.batch_size,
        help="sequences per learner step (default %(default)s)",
    )
    p.add_argument("--evals", type=positive_int, default=d.evals, help="(default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="(default %(default)s)")
    p.add_argument(
        "--period",
        type=positive_int,
        default=d.period,
        help="atoll's H, inner steps between syncs of a fragment (default: atoll's, "
        "%(default)s); fewer steps per sync close more of the gap at equal tokens on a short "
        "run and send proportionally more bytes",
    )
    p.add_argument(
        "--late-mix",
        type=float,
        default=d.late_mix,
        help="atoll's --late-mix: the share of its own fragment a learner keeps when a sync "
        "comes back late, at most (default: atoll's, %(default)g, off)",
    )
    p.add_argument("--work-dir", type=pathlib.Path, default=None, help="default: a temp dir")
    p.add_argument("--out", type=pathlib.Path, default=None, help="draw wan.png in this folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from atoll.faults.wan import WanError, available
    from atoll.learner.trainer.model import PRESETS

    if (why := available()) is not None:
        print(f"atoll bench wan: {why}", file=sys.stderr)
        return 2
    if args.preset not in PRESETS:
        parser.error(f"unknown --preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    try:
        cfg = WanBenchConfig(
            regions=args.regions,
            rate_mbit=args.rate_mbit,
            latency_ms=args.latency_ms,
            preset=args.preset,
            steps=args.steps,
            batch_size=args.batch_size,
            evals=args.evals,
            seed=args.seed,
            period=args.period,
            late_mix=args.late_mix,
        )
    except (ValueError, WanError) as e:
        parser.error(str(e))
    work_dir = args.work_dir or pathlib.Path(tempfile.mkdtemp(prefix="atoll-bench-wan-"))
    if args.work_dir is not None and work_dir.exists() and any(work_dir.iterdir()):
        parser.error(f"--work-dir {work_dir} is not empty: give a new or empty directory")
    # SIGTERM unwinds the bench like an error: the data-parallel workers and coordinator are
    # killed and the regions removed at once (by default they were orphaned, to die by the
    # coordinator's heartbeat timeout about 100 s later)
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        result = bench_wan(cfg, work_dir, args.out)
    except RuntimeError as e:  # a run that failed or hung: what it said, and where it ran
        print(f"atoll bench wan: {e}\n(the runs are in {work_dir})", file=sys.stderr)
        return 1
    except Terminated as e:
        name = signal.Signals(e.signum).name
        print(f"atoll bench wan: stopped by {name} (the runs are in {work_dir})", file=sys.stderr)
        return 128 + e.signum
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps(result, indent=2))
    return 0
