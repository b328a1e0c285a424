"""The report of an `atoll up` run: report.json and PNG plots, from the run directory.

Everything is computed from what the run left on disk (learners' status files,
sessions.jsonl, shards.jsonl), so the report of a resumed run covers all its sessions.
A learner's counters restart with each of its processes ("lives", split at each
`joining` record); totals add the lives up.
"""

from __future__ import annotations

import bisect
import json
import os
import pathlib

from atoll.local.progress import read_status

FORMAT = "atoll.report.v1"
DEFINITIONS = {
    "goodput": "useful learner time / (M x wall time of the learner phase): useful is time spent in "
    "inner steps (compute, and the --slowdown that emulates slower hardware); not useful is "
    "start-up and compilation, time blocked waiting on a sync, evaluations, time lost to "
    "crashes and restarts, and idling after finishing early",
    "push_bits_per_param": "bytes of outer-gradient pushes x 8 / parameters pushed (pushes x params / P); "
    "the FP32 Init offers at join are not counted",
    "pull_bits_per_param": "bytes pulled after joining x 8 / parameters adopted (syncs x params / P); "
    "the FP32 snapshot pulled at join is not counted. A learner k versions behind "
    "pulls a chain of k deltas in one sync, so this is ~k x the codec's rate",
    "pull_bits_per_param_per_version": "the same bytes per parameter per global version received (approximate: "
    "versions counted by the learner's oldest fragment)",
    "data_parallel_bytes": "what data-parallel training of the same tokens on M workers moves: per worker "
    "and step, a ring all-reduce of FP32 gradients sends and receives "
    "2(M-1)/M x 4 bytes x params each way",
    "tokens": "tokens trained on (predicted targets), all learners together",
    "lag": "a learner's newest known global version minus the version it holds, worst fragment",
    "outer_steps_per_period": "outer steps a fragment took per sync period (the cadence the shards ask "
    "learners to keep: H steps of the fastest live learners), measured by each "
    "shard between its first and last close; mean over fragments (1 = one merge "
    "per fragment per period)",
    "open_rounds": "fragments whose round was still open when the global model was read, and the "
    "pushes waiting in it (not in the model): the read waits a few sync periods for open rounds "
    "to close (at most a lease), never longer; lockstep's rounds wait for every learner for good",
    "model": "the directory the global model was written to as it was read (an Orbax checkpoint with its "
    "fragment plan, atoll/model_dir.py; `atoll sample --model DIR` prints text from it); null when "
    "this session read or wrote none",
    "shards": "each shard's last metrics sample; counters (rounds, pushes, bytes) count since its process "
    "last started, versions are durable",
}


def lives(records: list[dict]) -> list[list[dict]]:
    """A learner's records split into its processes' lives (each begins with `joining`)."""
    out: list[list[dict]] = []
    for r in records:
        if r.get("state") == "joining" or not out:
            out.append([])
        out[-1].append(r)
    return out


def learner_summary(records: list[dict], num_fragments: int, target_steps: int) -> dict:
    """One learner's figures, added up over its lives."""
    last = records[-1] if records else {}
    training = [r for r in records if r.get("state") == "training"]
    per_step = last["tokens"] / last["step"] if last.get("step") else 0
    step_seconds = sum(per_step / r["tokens_per_s"] for r in training if r.get("tokens_per_s"))
    sums = {
        k: 0
        for k in (
            "bytes_sent",
            "bytes_received",
            "push_bytes",
            "pull_bytes",
            "pushes",
            "refused",
            "resyncs",
            "adopted",
            "versions_pulled",
        )
    }
    blocked = 0.0
    for life in lives(records):
        synced = [r for r in life if "bytes_sent" in r]
        if not synced:
            continue
        first, end = synced[0], synced[-1]
        sums["bytes_sent"] += end["bytes_sent"]
        sums["bytes_received"] += end["bytes_received"]
        # the first record after joining holds exactly the join's Init offers and snapshot pulls
        sums["push_bytes"] += end["bytes_sent"] - first["bytes_sent"]
        sums["pull_bytes"] += end["bytes_received"] - first["bytes_received"]
        for k in ("pushes", "refused", "resyncs", "adopted"):
            sums[k] += end.get(k, 0)
        sums["versions_pulled"] += end.get("version", 0) - first.get("version", 0)
        blocked += end.get("blocked_seconds", 0.0)
    params = last.get("params", 0)
    evals = [r for r in records if r.get("eval_loss") is not None]
    final = [
        r
        for r in records
        if r.get("state") in ("done", "stopped") and r.get("eval_loss") is not None
    ]
    lags = [r["lag"] for r in training if r.get("lag") is not None]
    out = {
        "state": last.get("state", "not started"),
        "slowdown": last.get("slowdown"),
        "steps": last.get("step", 0),
        "target_steps": target_steps,
        "tokens": last.get("tokens", 0),
        "restarts": max(0, len(lives(records)) - 1),
        "final_eval_loss": final[-1]["eval_loss"] if final else None,
        "final_eval_bits_per_byte": final[-1].get("eval_bits_per_byte") if final else None,
        "last_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "first_train_loss": training[0]["loss"] if training else None,
        "last_train_loss": training[-1]["loss"] if training else None,
        **sums,
        "blocked_seconds": blocked,
        "step_seconds": step_seconds,
        "blocked_pct": 100 * blocked / (step_seconds + blocked) if step_seconds + blocked else None,
        "tokens_per_s": sum(per_step for _ in training) / step_seconds if step_seconds else None,
        "mean_lag": sum(lags) / len(lags) if lags else None,
        "max_lag": max(lags) if lags else None,
        "params": params,
    }
    frag_params = params / num_fragments if num_fragments else 0
    out["push_bits_per_param"] = (
        8 * sums["push_bytes"] / (sums["pushes"] * frag_params) if sums["pushes"] else None
    )
    out["pull_bits_per_param"] = (
        8 * sums["pull_bytes"] / (sums["adopted"] * frag_params) if sums["adopted"] else None
    )
    out["pull_bits_per_param_per_version"] = (
        8 * sums["pull_bytes"] / (sums["versions_pulled"] * params)
        if sums["versions_pulled"] and params
        else None
    )
    return out


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    return read_status(path)


def build_report(
    run_dir: pathlib.Path,
    cfg,
    specs,
    baseline_spec=None,
    *,
    global_eval: dict | None = None,
    events: list[str] = (),
    failure: str | None = None,
    interrupted: str | None = None,
    states: dict[str, str] | None = None,
    shard_restarts: dict[int, int] | None = None,
) -> dict:
    """report.json's content. `cfg`: the run's UpConfig; `specs`: its LearnerSpecs."""
    sessions = _read_jsonl(run_dir / "sessions.jsonl")
    records = {s.name: read_status(run_dir / "learners" / f"{s.name}.jsonl") for s in specs}
    learners = {s.name: learner_summary(records[s.name], cfg.fragments, s.steps) for s in specs}
    # the session's word on how each process ended, where its records cannot tell: a
    # learner stopped before its first step wrote no final record
    for name, state in (states or {}).items():
        if name not in learners or learners[name]["state"] == "done":
            continue
        if state in ("crashed", "killed"):
            learners[name]["state"] = "crashed"
        elif state == "stopped":
            learners[name]["state"] = "stopped"
    M = cfg.learners
    learner_wall = sum(
        (s.get("learners_end") or s["end"]) - s["learners_start"]
        for s in sessions
        if s.get("learners_start") is not None
    )
    tokens = sum(l["tokens"] for l in learners.values())
    push_bytes = sum(l["push_bytes"] for l in learners.values())
    pull_bytes = sum(l["pull_bytes"] for l in learners.values())
    pushes = sum(l["pushes"] for l in learners.values())
    adopted = sum(l["adopted"] for l in learners.values())
    versions = sum(l["versions_pulled"] for l in learners.values())
    params = max((l["params"] for l in learners.values()), default=0)
    frag = params / cfg.fragments
    wire = sum(l["bytes_sent"] + l["bytes_received"] for l in learners.values())
    total_steps = sum(l["steps"] for l in learners.values())
    dp_bytes = total_steps * 2 * (2 * (M - 1) / M) * 4 * params
    g = {
        "eval_loss": (global_eval or {}).get("eval_loss"),
        "eval_bits_per_byte": (global_eval or {}).get("eval_bits_per_byte"),
        "versions": (global_eval or {}).get("versions"),
        "open_rounds": (global_eval or {}).get("open_rounds"),
        "model": (global_eval or {}).get("model"),
        "tokens": tokens,
        "steps": total_steps,
        "goodput": (
            sum(l["step_seconds"] for l in learners.values()) / (M * learner_wall)
            if learner_wall > 0
            else None
        ),
        "learner_phase_seconds": learner_wall,
        "push_bits_per_param": 8 * push_bytes / (pushes * frag) if pushes else None,
        "pull_bits_per_param": 8 * pull_bytes / (adopted * frag) if adopted else None,
        "pull_bits_per_param_per_version": (
            8 * pull_bytes / (versions * params) if versions and params else None
        ),
        "bytes_sent": sum(l["bytes_sent"] for l in learners.values()),
        "bytes_received": sum(l["bytes_received"] for l in learners.values()),
        "data_parallel_bytes": dp_bytes,
        "bytes_reduction_vs_data_parallel": dp_bytes / wire if wire and M > 1 else None,
        "baseline_eval_loss": None,
    }
    baseline = None
    if baseline_spec is not None:
        b_records = read_status(run_dir / "learners" / f"{baseline_spec.name}.jsonl")
        records[baseline_spec.name] = b_records
        baseline = learner_summary(b_records, 1, baseline_spec.steps)
        for k in (
            "bytes_sent",
            "bytes_received",
            "push_bytes",
            "pull_bytes",
            "pushes",
            "refused",
            "resyncs",
            "adopted",
            "versions_pulled",
            "blocked_seconds",
            "blocked_pct",
            "mean_lag",
            "max_lag",
            "push_bits_per_param",
            "pull_bits_per_param",
            "pull_bits_per_param_per_version",
        ):
            baseline.pop(k, None)
        g["baseline_eval_loss"] = baseline["final_eval_loss"]
        if g["eval_loss"] is not None and baseline["final_eval_loss"]:
            g["eval_loss_vs_baseline_pct"] = 100 * (
                g["eval_loss"] / baseline["final_eval_loss"] - 1
            )
    shards = {}
    for sample in _read_jsonl(run_dir / "shards.jsonl"):
        shards[str(sample["shard"])] = {
            k: v for k, v in sample.items() if k not in ("shard", "time")
        }
    per_period = [
        v for s in shards.values() for v in (s.get("outer_steps_per_period") or {}).values()
    ]
    g["outer_steps_per_period"] = sum(per_period) / len(per_period) if per_period else None
    for i, n in (shard_restarts or {}).items():
        shards.setdefault(str(i), {})["restarts_this_session"] = n
    done = all(l["state"] == "done" and l["steps"] >= l["target_steps"] for l in learners.values())
    complete = (
        done
        and not interrupted
        and not failure
        and (
            baseline is None
            or (baseline["state"] == "done" and baseline["steps"] >= baseline["target_steps"])
        )
    )
    return {
        "format": FORMAT,
        "complete": complete,
        "interrupted": interrupted,
        "failure": failure,
        "run_dir": str(run_dir),
        "config": cfg.to_json(),
        "wall_seconds": sum(s["end"] - s["start"] for s in sessions),
        "sessions": sessions,
        "global": g,
        "learners": learners,
        "baseline": baseline,
        "shards": shards,
        "definitions": DEFINITIONS,
        "events": list(events),
    }


def write_report(run_dir: pathlib.Path, cfg, specs, baseline_spec=None, **kw) -> dict:
    """Builds the report, draws the plots next to it, writes report.json (atomically); returns it."""
    report = build_report(run_dir, cfg, specs, baseline_spec, **kw)
    try:
        report["plots"] = plot(run_dir, report, specs, baseline_spec)
    except Exception as e:  # plots are worth having, not worth losing the numbers over
        report["plots"] = []
        report["events"].append(f"plots failed: {type(e).__name__}: {e}")
    tmp = run_dir / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, run_dir / "report.json")
    return report


# -- plots ------------------------------------------------------------------------------------


def _series(records: list[dict], key: str) -> list[tuple[float, float]]:
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


def _save(fig, ax, path: pathlib.Path, legend: dict) -> str:
    """Grid, legend (when anything is labelled), layout; writes the PNG, frees the figure."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path.name


def plot(run_dir: pathlib.Path, report: dict, specs, baseline_spec=None) -> list[str]:
    """loss.png, wire.png, lag.png; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    records = {s.name: read_status(run_dir / "learners" / f"{s.name}.jsonl") for s in specs}
    sessions = report["sessions"]
    t0 = min([s["start"] for s in sessions] + [r[0]["time"] for r in records.values() if r] or [0])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    label = {
        s.name: f"{s.name}" + (f" ({s.slowdown:g}x slower)" if s.slowdown > 1 else "")
        for s in specs
    }

    # tokens of all learners together at time t: the x axis that matches the baseline's
    token_curves = {
        n: ([r["time"] for r in rs if "tokens" in r], [r["tokens"] for r in rs if "tokens" in r])
        for n, rs in records.items()
    }

    def run_tokens(t: float) -> float:
        total = 0
        for times, toks in token_curves.values():
            i = bisect.bisect_right(times, t)
            total += toks[i - 1] if i else 0
        return total

    names = []
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=100)
    for k, (name, rs) in enumerate(records.items()):
        c = colors[k % len(colors)]
        train = _smoothed(
            [(run_tokens(r["time"]), r["loss"]) for r in rs if r.get("state") == "training"]
        )
        if train:
            ax.plot(*zip(*train), "-", lw=0.8, color=c, alpha=0.3)
        pts = [
            (run_tokens(r["time"]), r["eval_loss"]) for r in rs if r.get("eval_loss") is not None
        ]
        if pts:
            ax.plot(*zip(*pts), "o-", ms=3, lw=1.2, color=c, alpha=0.9, label=label[name])
    g = report["global"]
    if baseline_spec is not None:
        b = [
            r
            for r in read_status(run_dir / "learners" / f"{baseline_spec.name}.jsonl")
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
    cfg = report["config"]
    ax.set_title(
        f"atoll up: {cfg['learners']} learners, {cfg['shards']} shards, {cfg['preset']}, "
        f"{cfg['codec']}, H={cfg['period']}"
    )
    names.append(_save(fig, ax, run_dir / "loss.png", legend=dict(fontsize=8)))

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=100)
    for k, (name, rs) in enumerate(records.items()):
        c = colors[k % len(colors)]
        for key, style, what in (("bytes_sent", "-", "sent"), ("bytes_received", "--", "received")):
            pts = _series(rs, key)
            if pts:
                ax.plot(
                    [(t - t0) / 60 for t, _ in pts],
                    [v / 1e6 for _, v in pts],
                    style,
                    color=c,
                    lw=1.2,
                    label=f"{name} {what}",
                )
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("MB on the wire (cumulative)")
    bits = g.get("push_bits_per_param")
    ax.set_title(
        "bytes on the wire per learner" + (f" ({bits:.2f} bits/param per push)" if bits else "")
    )
    names.append(_save(fig, ax, run_dir / "wire.png", legend=dict(fontsize=7, ncol=2)))

    fig, ax = plt.subplots(figsize=(7.5, 4.0), dpi=100)
    for k, (name, rs) in enumerate(records.items()):
        pts = [((r["time"] - t0) / 60, r["lag"]) for r in rs if r.get("lag") is not None]
        if pts:
            ax.step(
                *zip(*pts),
                where="post",
                color=colors[k % len(colors)],
                lw=1.2,
                alpha=0.85,
                label=label[name],
            )
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("version lag (versions)")
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title("version lag per learner (newest known - held, worst fragment)")
    names.append(_save(fig, ax, run_dir / "lag.png", legend=dict(fontsize=8)))
    return names
