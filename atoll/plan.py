"""`atoll plan`: a discrete-event simulator of training goodput at datacenter scale.

Goodput = useful chip-seconds / provisioned chip-seconds, where a chip-second is useful
when it does training work that reaches the model that is finally kept: work rolled back
to a checkpoint, work lost with a dead learner, time spent restarting, reconfiguring or
waiting for a slower chip is not. Three strategies run on the same failure process
(every chip is interrupted after an exponential lifetime with mean `mtbi_years`):

    dp       one synchronous job over all chips. Any interruption stops the whole job;
             it restarts on spare hosts after `restart_s` and rolls back to its last
             checkpoint (every Young/Daly interval √(2·C·MTBI_job), at least one step;
             each checkpoint stalls the job `checkpoint_cost_s`, 0 by default: an
             in-memory snapshot overlapped with the next step).
    elastic  one synchronous job that drops the failed slice (a data-parallel replica of
             `slice_chips`) after a `reconfig_s` pause and continues on fewer chips; the
             slice comes back `repair_s` later, at the cost of another pause.
    atoll    Decoupled DiLoCo: M independent learners of chips/M each. An interruption
             takes down only its learner, which loses its inner steps since each
             fragment's last sync and rejoins after `rejoin_s` from the syncer's global
             model. The syncer closes rounds on a quorum and never waits for the dead,
             and syncs overlap compute, so the other learners never stop.

Stragglers: a synchronous step waits for the slowest chip of its group (all chips for
dp/elastic, one learner for atoll). Per-chip step times have coefficient of variation
`step_cv`; the slowest of n is drawn exactly (the max of n normals via its CDF), so the
efficiency is mean step / mean slowest step.

The simulator is event-driven at the level of the failure process of a whole group (rate
chips / MTBI), never per chip, so a million chips cost no more than a thousand. The
defaults reproduce the published figures in `REFERENCE`; docs/plan.md says why each is
plausible.

Example:
    >>> cfg = PlanConfig(chips=150_000)
    >>> round(simulate(cfg, "atoll")["goodput"], 2)  # doctest: +SKIP
    0.98
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
from statistics import NormalDist
from typing import Any

import numpy as np

from atoll.wire import settings
from atoll.wire.settings import setting

YEAR_S = 365.25 * 86400
STRATEGIES = ("dp", "elastic", "atoll")
LABELS = {"dp": "data-parallel", "elastic": "elastic DP", "atoll": "atoll"}

# Decoupled DiLoCo (arXiv 2604.21428), MTBI 1 year per chip, atoll = M 8 learners
REFERENCE_SOURCE = "Decoupled DiLoCo, arXiv 2604.21428 (MTBI 1 year per chip, M = 8)"
REFERENCE = {
    150_000: {"dp": 0.72, "elastic": 0.88, "atoll": 0.98},
    300_000: {"dp": 0.57, "elastic": 0.80, "atoll": 0.96},
    600_000: {"dp": 0.38, "elastic": 0.69, "atoll": 0.94},
    1_200_000: {"dp": 0.27, "elastic": 0.58, "atoll": 0.88},
    2_400_000: {"dp": 0.18, "elastic": 0.40, "atoll": 0.80},
}
STRAGGLER_SAMPLES = 1024  # synchronous steps drawn to estimate the straggler efficiency


class PlanConfigError(ValueError):
    """A planner setting that cannot work; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    chips: int = 1_200_000  # accelerator chips provisioned (spares not counted), >= 1
    mtbi_years: float = setting(1.0, "mean time between interruptions of one chip, years, > 0")
    learners: int = setting(8, "M: atoll learners, each chips/M chips, in [1, chips]")
    restart_s: float = setting(
        69.5,
        "data-parallel job restart after an interruption (detect, swap spares, re-init all "
        "chips, restore), s, >= 0",
    )
    checkpoint_cost_s: float = setting(
        0.0, "data-parallel stall per in-memory checkpoint, s, >= 0 (0: overlapped)"
    )
    checkpoint_interval_s: float = setting(
        0.0, "training s between data-parallel checkpoints; 0 = Young/Daly, >= 1 step"
    )
    rejoin_s: float = setting(15.0, "atoll learner restart and pull of the global model, s, >= 0")
    step_s: float = setting(0.5, "one synchronous inner step at nominal speed, s, > 0")
    sync_steps: int = setting(16, "H: inner steps between two syncs of a fragment, >= 1")
    fragments: int = setting(4, "P: fragments synced on a staggered schedule, >= 1")
    reconfig_s: float = setting(8.0, "elastic DP pause to drop or re-add a slice, s, >= 0")
    repair_s: float = setting(
        1200.0, "elastic DP: until a dropped slice is repaired and re-added, s, >= 0"
    )
    slice_chips: int = setting(
        1024, "elastic DP: chips one interruption removes (a replica), in [1, chips]"
    )
    step_cv: float = setting(0.008, "coefficient of variation of a chip's step time, in [0, 0.5]")
    duration_days: float = setting(7.0, "simulated wall-clock time, days, > 0")
    seed: int = setting(0, "failure and straggler draws' seed; same seed, same result")

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise PlanConfigError(message)

        def finite(name: str, low: float) -> None:
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            need(
                isinstance(value, (int, float)) and math.isfinite(value) and value >= low,
                f"{flag} must be a number >= {low:g}, got {value!r}",
            )

        need(
            isinstance(self.chips, int) and self.chips >= 1,
            f"--chips must be a whole number >= 1, got {self.chips!r}",
        )
        need(
            isinstance(self.learners, int) and 1 <= self.learners <= self.chips,
            f"--learners must be in [1, chips={self.chips}], got {self.learners!r}",
        )
        need(
            isinstance(self.slice_chips, int) and 1 <= self.slice_chips <= self.chips,
            f"--slice-chips must be in [1, chips={self.chips}], got {self.slice_chips!r}",
        )
        need(
            isinstance(self.sync_steps, int) and self.sync_steps >= 1,
            f"--sync-steps must be a whole number >= 1, got {self.sync_steps!r}",
        )
        need(
            isinstance(self.fragments, int) and self.fragments >= 1,
            f"--fragments must be a whole number >= 1, got {self.fragments!r}",
        )
        for name in (
            "restart_s",
            "checkpoint_cost_s",
            "checkpoint_interval_s",
            "rejoin_s",
            "reconfig_s",
            "repair_s",
            "step_cv",
        ):
            finite(name, 0.0)
        for name in ("mtbi_years", "step_s", "duration_days"):
            finite(name, 0.0)
            need(
                getattr(self, name) > 0,
                f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)!r}",
            )
        need(
            self.step_cv <= 0.5,
            f"--step-cv is a coefficient of variation in [0, 0.5], got {self.step_cv!r}",
        )
        need(
            self.duration_days * 86400 >= 100 * self.step_s,
            f"--duration-days ({self.duration_days:g}) must cover at least 100 steps of --step-s ({self.step_s:g})",
        )
        need(
            self.chips / self.mtbi_years * self.duration_days / 365.25 <= 5e6,
            "more than 5 million interruptions to simulate: shorten --duration-days or raise --mtbi-years",
        )

    @property
    def chip_mtbi_s(self) -> float:
        return self.mtbi_years * YEAR_S

    @property
    def duration_s(self) -> float:
        return self.duration_days * 86400

    def checkpoint_interval(self) -> float:
        """dp training seconds between checkpoints: as set, else Young/Daly √(2·C·MTBI_job)."""
        if self.checkpoint_interval_s > 0:
            return self.checkpoint_interval_s
        return max(
            self.step_s, math.sqrt(2 * self.checkpoint_cost_s * self.chip_mtbi_s / self.chips)
        )


def straggler_efficiency(n: int, cv: float, rng: np.random.Generator) -> float:
    """Mean chip step / mean synchronous step, the step waiting for the slowest of n chips."""
    if cv == 0 or n == 1:
        return 1.0
    # max of n iid normals: P(max <= z) = Φ(z)^n, so z = Φ⁻¹(U^(1/n)); the tail form keeps precision
    tail = -np.expm1(np.log(rng.random(STRAGGLER_SAMPLES)) / n)
    z_max = [-NormalDist().inv_cdf(p) for p in tail]
    return 1.0 / (1.0 + cv * float(np.mean(z_max)))


def _renewal(
    rng: np.random.Generator, rate: float, down_s: float, horizon_s: float
) -> tuple[np.ndarray, float]:
    """One group's life: exponential up-times (rate per s), each interruption followed by
    `down_s` of recovery. Returns the up-times that ended in an interruption, and the last,
    cut short by the horizon. Interruptions during recovery are absorbed by it (every bad
    host is swapped before relaunching; the next up-time starts afresh, memoryless)."""
    ups = np.empty(0)
    while True:  # draw in batches: the event loop is a cumulative sum
        more = rng.exponential(1 / rate, size=int(1.2 * rate * horizon_s) + 64)
        ups = np.concatenate([ups, more])
        ends = np.cumsum(ups + down_s) - down_s  # when each up-time ends
        if ends[-1] >= horizon_s:
            break
    last = int(np.searchsorted(ends, horizon_s))  # the up-time the horizon cuts
    start = ends[last] - ups[last]
    return ups[:last], max(0.0, horizon_s - start)


def _dp(cfg: PlanConfig, rng: np.random.Generator) -> dict[str, Any]:
    """One job over all chips: every interruption rolls back to the last checkpoint and restarts."""
    interval, cost = cfg.checkpoint_interval(), cfg.checkpoint_cost_s
    segment = interval + cost  # a checkpoint completes every `segment` s of uptime
    ups, last = _renewal(rng, cfg.chips / cfg.chip_mtbi_s, cfg.restart_s, cfg.duration_s)
    work = interval * np.floor(ups / segment).sum()  # only checkpointed work survives
    work += interval * (last // segment) + min(last % segment, interval)  # the horizon ends the run
    return {
        "work_s": float(work),
        "interruptions": len(ups),
        "group_chips": cfg.chips,
        "checkpoint_interval_s": interval,
    }


def _lost_since_sync(ups: np.ndarray, period: float, fragments: int) -> np.ndarray:
    """Training s lost when a learner dies after each up-time: per fragment, since its last sync."""
    offsets = period * (np.arange(fragments) + 1) / fragments  # fragment p first syncs at (p+1)·S/P
    up = ups[:, None]
    since = np.where(up < offsets, up, (up - offsets) % period)
    lost: np.ndarray = since.mean(axis=1)
    return lost


def _atoll(cfg: PlanConfig, rng: np.random.Generator) -> dict[str, Any]:
    """M independent learners; each dies alone, loses its unsynced steps and rejoins."""
    period = cfg.sync_steps * cfg.step_s
    sizes = [
        cfg.chips // cfg.learners + (i < cfg.chips % cfg.learners) for i in range(cfg.learners)
    ]
    chip_work = 0.0
    interruptions = 0
    for size in sizes:  # learners share nothing but the syncer, so each is its own process
        ups, last = _renewal(rng, size / cfg.chip_mtbi_s, cfg.rejoin_s, cfg.duration_s)
        interruptions += len(ups)
        chip_work += size * (
            float((ups - _lost_since_sync(ups, period, cfg.fragments)).sum()) + last
        )
    return {
        "work_s": chip_work / cfg.chips,
        "interruptions": interruptions,
        "group_chips": max(sizes),
        "sync_period_s": period,
    }


def _elastic(cfg: PlanConfig, rng: np.random.Generator) -> dict[str, Any]:
    """One job that shrinks by a slice per interruption and grows back after repair."""
    slices = cfg.chips // cfg.slice_chips
    rest = (
        cfg.chips - slices * cfg.slice_chips
    )  # chips outside whole slices train but never fail alone
    alive = slices
    repairs: collections.deque[float] = (
        collections.deque()
    )  # re-add times; FIFO as repair_s is fixed
    # standard draws made in bulk; an Exp(1) / rate is an Exp(rate) at whatever rate holds then
    batch = int(2.4 * cfg.chips / cfg.chip_mtbi_s * cfg.duration_s) + 64
    unit_exp, unit = iter(rng.exponential(size=batch)), iter(rng.random(size=batch))
    t = chip_work = paused_until = 0.0
    interruptions = 0
    while t < cfg.duration_s:
        chips_alive = alive * cfg.slice_chips + rest
        # memoryless: redrawing the next interruption after every event is exact
        failure = (
            t + next(unit_exp, rng.exponential()) * cfg.chip_mtbi_s / chips_alive
            if alive
            else math.inf
        )
        now = min(failure, repairs[0] if repairs else math.inf, cfg.duration_s)
        chip_work += chips_alive * max(0.0, now - max(t, paused_until))  # no training while paused
        t = now
        if t >= cfg.duration_s:
            break
        if t == failure:
            interruptions += 1
            alive -= 1
            repairs.append(t + cfg.repair_s)
            if t >= paused_until:  # the synchronous step in flight is lost on every chip
                chip_work -= chips_alive * cfg.step_s * next(unit, rng.random())
        else:
            repairs.popleft()
            alive += 1
        # a reconfiguration under way takes in every change that arrives before it commits
        if t >= paused_until:
            paused_until = t + cfg.reconfig_s
    return {
        "work_s": max(float(chip_work), 0.0) / cfg.chips,
        "interruptions": interruptions,
        "group_chips": cfg.chips,
    }


def simulate(cfg: PlanConfig, strategy: str) -> dict[str, Any]:
    """Goodput of one strategy under `cfg`.

    Args:
      cfg: the cluster, failure and recovery assumptions.
      strategy: "dp", "elastic" or "atoll".
    Returns:
      {"strategy", "chips", "goodput" (useful / provisioned chip-seconds, in [0, 1]),
       "availability" (the same before straggler loss), "straggler_efficiency",
       "interruptions"} plus the strategy's derived interval (checkpoint or sync period).
    Example:
      >>> simulate(PlanConfig(chips=300_000), "dp")["goodput"]  # doctest: +SKIP
      0.57...
    """
    if strategy not in STRATEGIES:
        raise PlanConfigError(
            f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}"
        )
    # one stream per (seed, strategy, chips), so adding a strategy never changes another's draws
    rng = np.random.default_rng([cfg.seed, STRATEGIES.index(strategy), cfg.chips])
    run = {"dp": _dp, "elastic": _elastic, "atoll": _atoll}[strategy](cfg, rng)
    efficiency = straggler_efficiency(run.pop("group_chips"), cfg.step_cv, rng)
    availability = run.pop("work_s") / cfg.duration_s
    return {
        "strategy": strategy,
        "chips": cfg.chips,
        "goodput": availability * efficiency,
        "availability": availability,
        "straggler_efficiency": efficiency,
        **run,
    }


def table(cfg: PlanConfig, chips_list: list[int]) -> list[dict[str, Any]]:
    """One row per chip count: every strategy's goodput, and the published figures where
    they apply (this chip count, MTBI 1 year, M = 8), else None."""
    rows = []
    for chips in chips_list:
        run = dataclasses.replace(cfg, chips=chips)
        row = {"chips": chips, **{s: simulate(run, s)["goodput"] for s in STRATEGIES}}
        same = cfg.mtbi_years == 1.0 and cfg.learners == 8
        row["reference"] = REFERENCE.get(chips) if same else None
        rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Goodput vs chips: simulated lines, published points (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chips = [r["chips"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strategy, color in zip(STRATEGIES, ("tab:red", "tab:orange", "tab:blue")):
        ax.plot(
            chips,
            [100 * r[strategy] for r in rows],
            "-",
            color=color,
            marker=".",
            label=f"{LABELS[strategy]} (simulated)",
        )
        ref = [(r["chips"], 100 * r["reference"][strategy]) for r in rows if r.get("reference")]
        if ref:
            ax.plot(
                *zip(*ref), "o", mfc="none", color=color, label=f"{LABELS[strategy]} (published)"
            )
    ax.set_xscale("log")
    ax.set_xticks(chips, [_chips_text(c) for c in chips])
    ax.minorticks_off()
    ax.set_ylim(0, 100)
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput, %")
    ax.set_title("Goodput vs scale")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _chips_text(chips: int) -> str:
    return (
        f"{chips / 1e6:g}M"
        if chips >= 1_000_000
        else f"{chips / 1e3:g}k"
        if chips >= 1000
        else str(chips)
    )


def render(rows: list[dict[str, Any]], cfg: PlanConfig) -> str:
    """The side-by-side text table: simulated goodput, published in brackets."""
    head = f"{'chips':>8}  " + "  ".join(
        f"{LABELS[s] + (' M=' + str(cfg.learners) if s == 'atoll' else ''):>16}" for s in STRATEGIES
    )
    lines = [head]
    for r in rows:
        cells = []
        for s in STRATEGIES:
            ref = f" ({100 * r['reference'][s]:.0f})" if r["reference"] else "     "
            cells.append(f"{100 * r[s]:>11.1f}{ref}")
        lines.append(f"{_chips_text(r['chips']):>8}  " + "  ".join(cells))
    if any(r["reference"] for r in rows):
        lines.append(f"goodput %, simulated (published: {REFERENCE_SOURCE})")
    else:
        lines.append("goodput %, simulated")
    return "\n".join(lines)


def _chips_list(text: str) -> list[int]:
    try:
        chips = [int(float(c.strip().replace("_", ""))) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected chip counts like 150000,1.2e6, got {text!r}"
        ) from None
    if not chips or min(chips) < 1:
        raise argparse.ArgumentTypeError(f"chip counts must be whole numbers >= 1, got {text!r}")
    return chips


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`atoll plan` flags: the chip counts of the rows, then one flag per PlanConfig
    assumption, generated from its fields (help and default the field's)."""
    p.add_argument(
        "--chips",
        type=_chips_list,
        default=list(REFERENCE),
        help="comma-separated chip counts, one row each (default: the published ones, "
        "150k to 2.4M)",
    )
    settings.add_flags(p, PlanConfig)
    p.add_argument(
        "--json", action="store_true", help="print one JSON object: assumptions and rows"
    )
    p.add_argument(
        "--plot", metavar="PATH", default=None, help="also write goodput vs chips as a PNG"
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The CLI entry: print the table (or JSON), optionally write the plot; 0 on success."""
    try:
        cfg = settings.from_args(PlanConfig, args, chips=max(args.chips))
        rows = table(cfg, args.chips)
    except PlanConfigError as e:
        parser.error(str(e))
    if args.plot:
        try:
            plot(rows, args.plot)
        except OSError as e:
            parser.error(f"cannot write --plot {args.plot}: {e.strerror or e}")
    if args.json:
        assumptions = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "chips"}
        print(
            json.dumps(
                {"assumptions": assumptions, "reference_source": REFERENCE_SOURCE, "rows": rows},
                indent=2,
            )
        )
    else:
        print(render(rows, cfg))
    return 0
