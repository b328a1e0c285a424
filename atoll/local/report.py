"""The report of an `atoll up` run: report.json (its plots: atoll/local/plots.py), from the
run directory.

Everything is computed from what the run left on disk (learners' status files,
sessions.jsonl, shards.jsonl), so the report of a resumed run covers all its sessions.
A learner's counters restart with each of its processes ("lives", split at each
`joining` record); totals add the lives up.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from atoll.local.plots import plot
from atoll.local.progress import lives, read_status

if TYPE_CHECKING:
    from atoll.local.config import LearnerSpec, UpConfig

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


def learner_summary(
    records: list[dict[str, Any]], num_fragments: int, target_steps: int
) -> dict[str, Any]:
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


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    return read_status(path)


def build_report(
    run_dir: pathlib.Path,
    cfg: UpConfig,
    specs: Sequence[LearnerSpec],
    baseline_spec: LearnerSpec | None = None,
    *,
    global_eval: dict[str, Any] | None = None,
    events: Sequence[str] = (),
    failure: str | None = None,
    interrupted: str | None = None,
    states: dict[str, str] | None = None,
    shard_restarts: dict[int, int] | None = None,
) -> dict[str, Any]:
    """report.json's content. `cfg`: the run's UpConfig; `specs`: its LearnerSpecs."""
    sessions = _read_jsonl(run_dir / "sessions.jsonl")
    records = {s.name: read_status(run_dir / "learners" / f"{s.name}.jsonl") for s in specs}
    learners = {s.name: learner_summary(records[s.name], cfg.fragments, s.steps) for s in specs}
    _end_states(learners, states or {})
    g = _global(learners, sessions, cfg, global_eval or {})
    baseline = None
    if baseline_spec is not None:
        baseline = _baseline(run_dir, baseline_spec, g)
    shards = _shards(run_dir, shard_restarts or {}, g)
    complete = (
        all(_finished(l) for l in learners.values())
        and not interrupted
        and not failure
        and (baseline is None or _finished(baseline))
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


def _finished(summary: dict[str, Any]) -> bool:
    return bool(summary["state"] == "done" and summary["steps"] >= summary["target_steps"])


def _end_states(learners: dict[str, dict[str, Any]], states: dict[str, str]) -> None:
    """The session's word on how each process ended, where its records cannot tell: a
    learner stopped before its first step wrote no final record."""
    for name, state in states.items():
        if name not in learners or learners[name]["state"] == "done":
            continue
        if state in ("crashed", "killed"):
            learners[name]["state"] = "crashed"
        elif state == "stopped":
            learners[name]["state"] = "stopped"


def _global(
    learners: dict[str, dict[str, Any]],
    sessions: list[dict[str, Any]],
    cfg: UpConfig,
    global_eval: dict[str, Any],
) -> dict[str, Any]:
    """The run's figures: the global model's eval, and the learners' added up."""
    M = cfg.learners
    learner_wall = sum(
        (s.get("learners_end") or s["end"]) - s["learners_start"]
        for s in sessions
        if s.get("learners_start") is not None
    )

    def total(key: str) -> Any:
        return sum(l[key] for l in learners.values())

    push_bytes, pull_bytes = total("push_bytes"), total("pull_bytes")
    pushes, adopted, versions = total("pushes"), total("adopted"), total("versions_pulled")
    params = max((l["params"] for l in learners.values()), default=0)
    frag = params / cfg.fragments
    wire = total("bytes_sent") + total("bytes_received")
    dp_bytes = total("steps") * 2 * (2 * (M - 1) / M) * 4 * params
    return {
        **{k: global_eval.get(k) for k in _GLOBAL_EVAL},
        "tokens": total("tokens"),
        "steps": total("steps"),
        "goodput": total("step_seconds") / (M * learner_wall) if learner_wall > 0 else None,
        "learner_phase_seconds": learner_wall,
        "push_bits_per_param": 8 * push_bytes / (pushes * frag) if pushes else None,
        "pull_bits_per_param": 8 * pull_bytes / (adopted * frag) if adopted else None,
        "pull_bits_per_param_per_version": (
            8 * pull_bytes / (versions * params) if versions and params else None
        ),
        "bytes_sent": total("bytes_sent"),
        "bytes_received": total("bytes_received"),
        "data_parallel_bytes": dp_bytes,
        "bytes_reduction_vs_data_parallel": dp_bytes / wire if wire and M > 1 else None,
        "baseline_eval_loss": None,
    }


_GLOBAL_EVAL = ("eval_loss", "eval_bits_per_byte", "versions", "open_rounds", "model")
# what a data-parallel baseline has no part in (it never pushes or pulls)
_NOT_BASELINE = (
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
)


def _baseline(run_dir: pathlib.Path, spec: LearnerSpec, g: dict[str, Any]) -> dict[str, Any]:
    """The data-parallel baseline's summary; its eval loss, and the global model's against it,
    go into the run's figures `g`."""
    baseline = learner_summary(
        read_status(run_dir / "learners" / f"{spec.name}.jsonl"), 1, spec.steps
    )
    for k in _NOT_BASELINE:
        baseline.pop(k, None)
    g["baseline_eval_loss"] = baseline["final_eval_loss"]
    if g["eval_loss"] is not None and baseline["final_eval_loss"]:
        g["eval_loss_vs_baseline_pct"] = 100 * (g["eval_loss"] / baseline["final_eval_loss"] - 1)
    return baseline


def _shards(
    run_dir: pathlib.Path, shard_restarts: dict[int, int], g: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Each shard's last metrics sample and restarts this session; their mean outer steps per
    period goes into the run's figures `g`."""
    shards: dict[str, dict[str, Any]] = {}
    for sample in _read_jsonl(run_dir / "shards.jsonl"):
        shards[str(sample["shard"])] = {
            k: v for k, v in sample.items() if k not in ("shard", "time")
        }
    per_period = [
        v for s in shards.values() for v in (s.get("outer_steps_per_period") or {}).values()
    ]
    g["outer_steps_per_period"] = sum(per_period) / len(per_period) if per_period else None
    for i, n in shard_restarts.items():
        shards.setdefault(str(i), {})["restarts_this_session"] = n
    return shards


def write_report(
    run_dir: pathlib.Path,
    cfg: UpConfig,
    specs: Sequence[LearnerSpec],
    baseline_spec: LearnerSpec | None = None,
    **kw: Any,
) -> dict[str, Any]:
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
