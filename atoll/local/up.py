"""`atoll up`: a whole Decoupled-DiLoCo run on this machine, then a report.

Starts S `atoll syncer` shard processes and M `atoll learner` processes over loopback
(real processes, real gRPC), draws a live table, and at the end pulls the global model
from the shards, evaluates it on the learners' held-out batches, optionally trains the
data-parallel baseline, and writes `report.json` and PNG plots into the run directory.

This module is the settings and the command: `UpConfig` (the embedded default run),
the run directory (`prepare_run_dir`: new, or a resume checked against config.json)
and the flags. `atoll.local.session` runs it; `atoll.local.processes` holds the children.

`atoll up` starts a new run in runs/<timestamp>, `atoll up --new-run-dir X` one in X (new
or empty, in a directory that exists). The run directory holds everything, so a run can
be resumed (`atoll up --run-dir X`; X must hold a run):

    config.json          the UpConfig the run was started with (a resume must match it)
    pids.json            every child process this session started (for tests and humans)
    sessions.jsonl       one line per `atoll up` session: start, end, outcome
    shards/<i>/          shard i's write-ahead log and snapshots
    shards.jsonl         shard metrics sampled over time (versions, rounds, bytes)
    learners/<id>.jsonl  each learner's status records
    checkpoints/         each learner's checkpoint and id claim (a restart resumes from them)
    logs/<name>.log      each child's stdout and stderr
    model/               the final global model (atoll.model_dir: an Orbax checkpoint)
    report.json, loss.png, wire.png, lag.png
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import pathlib
import sys
from typing import Any

from atoll.local import progress
from atoll.local.config import UpConfig, UpConfigError, _flag_text, prepare_run_dir
from atoll.wire import settings

# -- the run directory ------------------------------------------------------------------------


# -- the command ----------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`atoll up` flags: where the run lives, how it reports, and one flag per UpConfig
    setting, generated from its fields (each None here when not given, so a resume can
    tell which flags were asked for; help shows UpConfig's default)."""
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--run-dir",
        type=pathlib.Path,
        default=None,
        metavar="DIR",
        help="resume the unfinished run in DIR (one `atoll up` started there)",
    )
    where.add_argument(
        "--new-run-dir",
        type=pathlib.Path,
        default=None,
        metavar="DIR",
        help="start a new run in DIR, a new or empty directory whose parent exists "
        "(default: a new run in runs/<timestamp>)",
    )
    settings.add_flags(p, UpConfig, absent=True)
    p.add_argument(
        "--no-table", action="store_true", help="plain log lines instead of the live table"
    )
    p.add_argument("--json", action="store_true", help="print report.json on stdout at the end")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The CLI entry: exit 0 finished, 1 failed, 130/143 stopped by SIGINT/SIGTERM."""
    overrides = settings.given(UpConfig, args)
    run_dir = (
        args.run_dir
        or args.new_run_dir
        or pathlib.Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    )
    try:
        cfg, resuming = prepare_run_dir(
            run_dir,
            overrides,
            resume=args.run_dir is not None,
            parents=args.new_run_dir is None,  # runs/ is made; a directory given must be there
        )
    except UpConfigError as e:
        parser.error(str(e))
    lock = open(run_dir / ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        parser.error(f"another `atoll up` is using {run_dir}")
    out = sys.stderr if args.json else sys.stdout
    live = not args.no_table and out.isatty()
    print(
        f"atoll up: {'resuming' if resuming else 'starting'} {run_dir}: {cfg.shards} shards, {cfg.learners} "
        f"learners ({cfg.preset}, {cfg.steps} steps, slowdown {_flag_text(cfg.slowdown)})",
        file=out,
        flush=True,
    )
    from atoll.local.session import Session

    session = Session(cfg, run_dir, out, live)
    report = session.run()
    if args.json:
        print(json.dumps(report, indent=2))
    print(summary(report, run_dir), file=out, flush=True)
    if session.stop_signal is not None:
        return 128 + session.stop_signal
    if report["failure"] or not any(l["state"] == "done" for l in report["learners"].values()):
        return 1
    return 0


def summary(report: dict[str, Any], run_dir: pathlib.Path) -> str:
    """The few lines printed at the end."""
    wall = progress.clock(report["wall_seconds"])
    if report.get("interrupted"):
        head = (
            f"atoll up: interrupted ({report['interrupted']}) after {wall}; children stopped, data kept. "
            f"Resume with: atoll up --run-dir {run_dir}"
        )
    elif report.get("failure"):
        head = f"atoll up: failed after {wall}: {report['failure']}. Resume with: atoll up --run-dir {run_dir}"
    elif not report["complete"]:
        head = (
            f"atoll up: finished after {wall}, but not every learner did; resume them with: "
            f"atoll up --run-dir {run_dir}"
        )
    else:
        n = len(report["sessions"])
        head = f"atoll up: finished in {wall}" + (f" ({n} sessions)" if n > 1 else "")
    g = report["global"]
    parts = []
    if g.get("eval_loss") is not None:
        parts.append(f"global model eval loss {g['eval_loss']:.4f}")
    if g.get("baseline_eval_loss") is not None:
        parts.append(f"baseline {g['baseline_eval_loss']:.4f}")
    parts.append(f"{g['tokens'] / 1e6:.2f} M tokens")
    if g.get("goodput") is not None:
        parts.append(f"goodput {100 * g['goodput']:.1f}%")
    if g.get("push_bits_per_param") is not None:
        parts.append(f"{g['push_bits_per_param']:.2f} bits/param per push")
    if g.get("pull_bits_per_param") is not None:
        per_version = g.get("pull_bits_per_param_per_version")
        parts.append(
            f"{g['pull_bits_per_param']:.2f} per pull"
            + (f" ({per_version:.2f} per version)" if per_version else "")
        )
    lines = [head, "  " + " | ".join(parts), f"  report: {run_dir / 'report.json'}"]
    if g.get("model"):
        lines.append(f"  model:  {g['model']} (atoll sample --model {g['model']} --prompt TEXT)")
    if g.get("open_rounds"):
        lines.append(
            "  read with rounds still open (their pushes are not in the model): "
            + ", ".join(f"fragment {p}: {n} pushes" for p, n in g["open_rounds"].items())
        )
    if report.get("plots"):
        lines.append("  plots:  " + ", ".join(str(run_dir / p) for p in report["plots"]))
    return "\n".join(lines)
