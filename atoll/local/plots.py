"""The plots of an `atoll up` run's report (atoll/local/report.py): loss.png, wire.png and
lag.png, drawn from the learners' status files and the report's figures."""

from __future__ import annotations

import bisect
import dataclasses
import pathlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from atoll.local.progress import lives, read_status

if TYPE_CHECKING:
    from atoll.local.config import LearnerSpec


def _series(records: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(time, value) of `key`, counters made cumulative across lives."""
    out, offset, last = [], 0.0, 0.0
    for life in lives(records):
        offset += last
        last = 0.0
        for r in life:
            if r.get(key) is not None:
                last = r[key]
                out.append((r["time"], offset + last))
    return out


def _smoothed(points: list[tuple[float, float]], keep: float = 0.9) -> list[tuple[float, float]]:
    """An exponential moving average of (x, y) points, for noisy training losses."""
    out, avg = [], None
    for x, y in points:
        avg = y if avg is None else keep * avg + (1 - keep) * y
        out.append((x, avg))
    return out


def _save(fig: Any, ax: Any, path: pathlib.Path, legend: dict[str, Any]) -> str:
    """Grid, legend (when anything is labelled), layout; writes the PNG, frees the figure."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path.name


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every plot of one run draws from."""

    run_dir: pathlib.Path
    report: dict[str, Any]
    records: dict[str, list[dict[str, Any]]]  # learner name -> its status records
    label: dict[str, str]  # learner name -> its legend entry
    colors: list[str]
    t0: float  # the run's start: time 0 of the minutes axes

    def color(self, k: int) -> str:
        return self.colors[k % len(self.colors)]


def plot(
    run_dir: pathlib.Path,
    report: dict[str, Any],
    specs: Sequence[LearnerSpec],
    baseline_spec: LearnerSpec | None = None,
) -> list[str]:
    """loss.png, wire.png, lag.png; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = {s.name: read_status(run_dir / "learners" / f"{s.name}.jsonl") for s in specs}
    starts = [s["start"] for s in report["sessions"]] + [
        r[0]["time"] for r in records.values() if r
    ]
    run = _Run(
        run_dir,
        report,
        records,
        label={
            s.name: f"{s.name}" + (f" ({s.slowdown:g}x slower)" if s.slowdown > 1 else "")
            for s in specs
        },
        colors=plt.rcParams["axes.prop_cycle"].by_key()["color"],
        t0=min(starts or [0]),
    )
    return [_loss_plot(run, baseline_spec), _wire_plot(run), _lag_plot(run)]


def _run_tokens(records: dict[str, list[dict[str, Any]]]) -> Callable[[float], float]:
    """Tokens of all learners together at time t: the x axis that matches the baseline's."""
    curves = {
        n: ([r["time"] for r in rs if "tokens" in r], [r["tokens"] for r in rs if "tokens" in r])
        for n, rs in records.items()
    }

    def at(t: float) -> float:
        total = 0
        for times, toks in curves.values():
            i = bisect.bisect_right(times, t)
            total += toks[i - 1] if i else 0
        return total

    return at


def _loss_plot(run: _Run, baseline_spec: LearnerSpec | None) -> str:
    """Each learner's held-out (and faint, smoothed training) loss against the tokens trained,
    the data-parallel baseline's and the global model's."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    run_tokens = _run_tokens(run.records)
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=100)
    for k, (name, rs) in enumerate(run.records.items()):
        train = _smoothed(
            [(run_tokens(r["time"]), r["loss"]) for r in rs if r.get("state") == "training"]
        )
        if train:
            ax.plot(*zip(*train), "-", lw=0.8, color=run.color(k), alpha=0.3)
        pts = [
            (run_tokens(r["time"]), r["eval_loss"]) for r in rs if r.get("eval_loss") is not None
        ]
        if pts:
            ax.plot(
                *zip(*pts), "o-", ms=3, lw=1.2, color=run.color(k), alpha=0.9, label=run.label[name]
            )
    g = run.report["global"]
    if baseline_spec is not None:
        b = [
            r
            for r in read_status(run.run_dir / "learners" / f"{baseline_spec.name}.jsonl")
            if r.get("eval_loss") is not None
        ]
        if b:
            ax.plot(
                [r["tokens"] for r in b],
                [r["eval_loss"] for r in b],
                "s--",
                ms=3,
                lw=1.5,
                color="black",
                label="data-parallel baseline",
            )
    if g.get("eval_loss") is not None:
        ax.plot(
            [g["tokens"]],
            [g["eval_loss"]],
            "*",
            ms=16,
            color="crimson",
            zorder=5,
            label=f"global model {g['eval_loss']:.3f}",
        )
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1e6:g}M"))
    ax.set_xlabel("tokens trained, all learners together")
    ax.set_ylabel("held-out loss (nats/byte); faint: training loss")
    cfg = run.report["config"]
    ax.set_title(
        f"atoll up: {cfg['learners']} learners, {cfg['shards']} shards, {cfg['preset']}, "
        f"{cfg['codec']}, H={cfg['period']}"
    )
    return _save(fig, ax, run.run_dir / "loss.png", legend=dict(fontsize=8))


def _wire_plot(run: _Run) -> str:
    """Bytes each learner sent and received, cumulative over the run's minutes."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=100)
    for k, (name, rs) in enumerate(run.records.items()):
        for key, style, what in (("bytes_sent", "-", "sent"), ("bytes_received", "--", "received")):
            pts = _series(rs, key)
            if pts:
                ax.plot(
                    [(t - run.t0) / 60 for t, _ in pts],
                    [v / 1e6 for _, v in pts],
                    style,
                    color=run.color(k),
                    lw=1.2,
                    label=f"{name} {what}",
                )
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("MB on the wire (cumulative)")
    bits = run.report["global"].get("push_bits_per_param")
    ax.set_title(
        "bytes on the wire per learner" + (f" ({bits:.2f} bits/param per push)" if bits else "")
    )
    return _save(fig, ax, run.run_dir / "wire.png", legend=dict(fontsize=7, ncol=2))


def _lag_plot(run: _Run) -> str:
    """Each learner's version lag (worst fragment) over the run's minutes."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7.5, 4.0), dpi=100)
    for k, (name, rs) in enumerate(run.records.items()):
        pts = [((r["time"] - run.t0) / 60, r["lag"]) for r in rs if r.get("lag") is not None]
        if pts:
            ax.step(
                *zip(*pts),
                where="post",
                color=run.color(k),
                lw=1.2,
                alpha=0.85,
                label=run.label[name],
            )
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("version lag (versions)")
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title("version lag per learner (newest known - held, worst fragment)")
    return _save(fig, ax, run.run_dir / "lag.png", legend=dict(fontsize=8))
