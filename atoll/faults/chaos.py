"""`atoll chaos`: an `atoll up` run with failures injected into its real processes, then
the same run in lockstep under the same failures, and what each kept.

The failure clock starts once every learner is training and the run lasts `duration`
seconds on it (then learners are stopped, the global model evaluated). Failures: every
learner is SIGKILLed as a Poisson process (mean time between failures `mtbf` seconds
per learner, drawn from `seed`, in seconds on the failure clock),
and restarted `restart_delay` seconds later (it resumes its data position and rejoins
at the current global versions by itself); shards are SIGKILLed at the given times and
restarted on their port `shard_restart_delay` seconds later (they recover from disk).
A kill that falls while its learner is already down does nothing. With `standbys`,
a killed learner's id is taken over by a compiled standby learner (from its
checkpoint) instead, and its machine returns as a standby `restart_delay` seconds later.

The lockstep baseline is the same harness with synchronous semantics: quorum = every
learner, no grace window, leases that never lapse (a dead learner holds every round it
is part of until it returns) and learners that wait on a round for as long as it takes:
synchronous DiLoCo, which behaves as data-parallel training does under failures. With
`lockstep_restart`, any failure also restarts every learner (checkpoint-restart: the job
goes down as one). The failure-free run stops when its learners have trained as many
tokens as the atoll run's, so the two final eval losses compare at equal tokens.

Accounting (the same for every run) is over the failure clock's window, from its start
to the end of `duration` (or to the first learner that finished its steps, if sooner).

* goodput: learner-seconds of inner steps that reached the global model, over the
  provisioned learner-seconds (M × window). A push carries the compute seconds of the
  steps it summarises (per fragment, so each counts 1/P); it reached the global model
  if it was accepted and its fragment's final version is at least the version that
  merged it. Work lost to a kill (steps since the last sync), time down and restarting,
  time blocked on rounds (lockstep), and refused pushes are all what goodput does not count.
* uptime: the share of `uptime_window`-second windows in which some global version
  advanced (shards' /metrics, sampled every second).
* acked_pushes_lost: accepted acknowledgements a learner logged that no shard holds
  durably after the run (server.audit reads each stopped shard's log and snapshot).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from atoll.faults.chaos_session import ChaosSession
from atoll.local.config import UpConfig, UpConfigError, learner_specs, prepare_run_dir
from atoll.wire.records import read_jsonl

if TYPE_CHECKING:
    from atoll.faults.wan import Wan, WanConfig


class ChaosConfigError(ValueError):
    """A chaos setting that cannot work; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class ChaosConfig:
    duration: float = 120.0  # seconds of training on the failure clock, > 0
    mtbf: float = 90.0  # seconds: mean time between SIGKILLs of each learner (Poisson), > 0
    restart_delay: float = 5.0  # seconds a killed learner stays down before its restart, >= 0
    shard_kill_at: tuple[float, ...] = (
        40.0,
    )  # seconds after learners start: SIGKILL a shard (round robin)
    shard_restart_delay: float = 2.0  # seconds a killed shard stays down, >= 0
    seed: int = 0  # the failure schedule (the same in every run of one `atoll chaos`)
    atoll: bool = True  # run atoll under failures (off: the lockstep baseline alone)
    lockstep: bool = True  # also run the lockstep baseline under the same schedule
    lockstep_restart: bool = (
        True  # lockstep with checkpoint-restart: any failure restarts every learner
    )
    failure_free: bool = (
        True  # also run without failures to the atoll run's tokens, for the eval-loss comparison
    )
    uptime_window: float = 5.0  # seconds per uptime window, > 0
    standbys: int = (
        2  # compiled spare learners that take over a killed one's id (atoll run only), >= 0
    )
    standby_ready_wait: float = (
        120.0  # seconds the failure clock waits for the standbys to be ready, >= 0
    )

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration) and self.duration > 0):
            raise ChaosConfigError(
                f"--duration must be a positive number of seconds, got {self.duration}"
            )
        if not (math.isfinite(self.mtbf) and self.mtbf > 0):
            raise ChaosConfigError(f"--mtbf must be a positive number of seconds, got {self.mtbf}")
        if not self.restart_delay >= 0 or not self.shard_restart_delay >= 0:
            raise ChaosConfigError("--restart-delay and --shard-restart-delay must be >= 0 seconds")
        if any(not (math.isfinite(t) and t >= 0) for t in self.shard_kill_at):
            raise ChaosConfigError(
                f"--shard-kill-at takes seconds >= 0, got {list(self.shard_kill_at)}"
            )
        if not self.uptime_window > 0:
            raise ChaosConfigError(f"--uptime-window must be > 0 seconds, got {self.uptime_window}")
        if not (isinstance(self.standbys, int) and self.standbys >= 0):
            raise ChaosConfigError(f"--standbys must be a whole number >= 0, got {self.standbys}")
        if not self.atoll and (self.failure_free or not self.lockstep):
            raise ChaosConfigError(
                "--no-atoll runs the lockstep baseline alone: drop --no-lockstep and add "
                "--no-failure-free (the failure-free run compares against the atoll run)"
            )


# -- accounting ----------------------------------------------------------------------------


def account(
    run_dir: pathlib.Path,
    cfg: UpConfig,
    session: ChaosSession,
    report: dict[str, Any],
    window: float,
) -> dict[str, Any]:
    """Goodput, uptime, lost acknowledgements and rejoins of one finished run."""
    from atoll.server.audit import durable_pushes, lost_acks

    specs = learner_specs(cfg)
    status = {s.name: read_jsonl(run_dir / "learners" / f"{s.name}.jsonl") for s in specs}
    pushes = [r for s in specs for r in read_jsonl(run_dir / "learners" / f"{s.name}.pushes.jsonl")]
    done = [r["time"] for rs in status.values() for r in rs if r.get("state") == "done"]
    start = session.t0
    end = min([session.end or time.time(), *done]) if start is not None else None
    versions = {int(p): v for p, v in ((report.get("global") or {}).get("versions") or {}).items()}
    durable = {}
    for i in range(cfg.shards):
        for key, value in durable_pushes(run_dir / "shards" / str(i)).items():
            durable[key] = value
    useful, merged, accepted = _merged_compute(pushes, versions, start, end, cfg.fragments)
    span = (end - start) if start is not None and end is not None else 0.0
    provisioned = cfg.learners * span
    rejoined = sum(
        1
        for k in session.restarts
        if any(r.get("state") == "training" and r["time"] > k["time"] for r in status[k["learner"]])
    )
    # tokens trained, each learner id at its newest record (a resumed learner's count goes
    # on from its checkpoint, so steps redone after a kill count once)
    tokens = sum(
        next((int(r["tokens"]) for r in reversed(rs) if "tokens" in r), 0) for rs in status.values()
    )
    return {
        "tokens": tokens,
        "goodput": useful / provisioned if provisioned > 0 else 0.0,
        "uptime": _uptime(session.samples, start, end, window),
        "utilisation": _step_seconds(status, start, end) / provisioned if provisioned > 0 else 0.0,
        "window_seconds": span,
        "useful_learner_seconds": useful,
        "provisioned_learner_seconds": provisioned,
        # the schedule's failures: a lockstep restart's other kills are one failure's cost
        "failures_injected": sum(
            1 for k in session.kills if k.get("cause", "") == k.get("learner")
        ),
        "learner_restarts": len(session.restarts),
        "learners_rejoined": rejoined,
        "standby_takeovers": sum(1 for k in session.restarts if "standby" in k),
        "kill_to_first_accepted_push_s": _rejoin_seconds(session.kills, pushes),
        "shard_restarts": sum(s.restarts for s in session.shards),
        "pushes_accepted": accepted,
        "pushes_merged": merged,
        "pushes_refused": sum(1 for a in pushes if not a["accepted"]),
        "acked_pushes_lost": len(lost_acks(pushes, durable)),
        "final_eval_loss": (report.get("global") or {}).get("eval_loss"),
        "final_versions": versions,
        # rounds still open when the global model was read (lockstep's wait for every learner)
        "open_rounds": {
            int(p): n for p, n in ((report.get("global") or {}).get("open_rounds") or {}).items()
        },
        "steps": {
            name: max((r.get("step", 0) for r in rs), default=0) for name, rs in status.items()
        },
        "kills": [{**k, "time": round(k["time"] - session.t0, 2)} for k in session.kills]
        if session.t0
        else [],
        "outcome": (report.get("sessions") or [{}])[-1].get("outcome"),
    }


def _merged_compute(
    pushes: list[dict[str, Any]],
    versions: dict[int, int],
    start: float | None,
    end: float | None,
    fragments: int,
) -> tuple[float, int, int]:
    """(learner-seconds in the window that reached the global model, pushes merged, pushes
    accepted): an accepted push reached it if its fragment's final version is at least the one
    that merged it, and carries its compute seconds over its `fragments` fragments."""
    useful = 0.0
    merged = accepted = 0
    for a in pushes:
        if not a["accepted"]:
            continue
        accepted += 1
        if versions.get(a["fragment"], -1) >= a["merged_in"]:
            merged += 1
            if start is not None and start <= a["time"] <= end:
                # the steps a push carries, less those made before the window (the first push)
                useful += min(a["compute_seconds"], a["time"] - start) / fragments
    return useful, merged, accepted


def _step_seconds(
    status: dict[str, list[dict[str, Any]]], start: float | None, end: float | None
) -> float:
    """Learner-seconds of inner steps in the window, whether or not they reached the model."""
    seconds: float = sum(
        min(r.get("step_seconds", 0.0), r["time"] - start)  # a step that began before the window
        for rs in status.values()
        for r in rs
        if r.get("state") == "training" and start is not None and start <= r["time"] <= end
    )
    return seconds


def _rejoin_seconds(
    kills: list[dict[str, Any]], pushes: list[dict[str, Any]]
) -> list[float | None]:
    """Per learner kill, seconds to the killed learner id's next accepted push (by a standby or
    by its own restart); None where none came."""
    rejoin: list[float | None] = []
    for k in kills:
        if "learner" in k:
            later = [
                a["time"]
                for a in pushes
                if a["learner"] == k["learner"] and a["accepted"] and a["time"] > k["time"]
            ]
            rejoin.append(round(min(later) - k["time"], 2) if later else None)
    return rejoin


def _uptime(
    samples: list[tuple[float, int]], start: float | None, end: float | None, window: float
) -> float:
    """Share of the window-second slices of [start, end] in which the version sum grew."""
    if start is None or end is None or end - start < window or not samples:
        return 0.0
    times = np.array([t for t, _ in samples])
    totals = np.array([v for _, v in samples])

    def at(t: float) -> int:  # the newest sample at or before t (the first one before any)
        i = int(np.searchsorted(times, t, side="right")) - 1
        return int(totals[max(i, 0)])

    n = int((end - start) // window)
    return sum(at(start + (k + 1) * window) > at(start + k * window) for k in range(n)) / n


# -- the command ---------------------------------------------------------------------------


def lockstep_config(cfg: UpConfig) -> UpConfig:
    """Synchronous semantics in the same harness: every learner in every round, nobody dropped."""
    return dataclasses.replace(
        cfg,
        quorum=cfg.learners,
        grace_factor=0.0,
        lease_seconds=1e9,
        sync_patience=1e9,
        wait_for_rounds=True,
    )


def run_chaos(
    cfg: UpConfig,
    chaos: ChaosConfig,
    work_dir: pathlib.Path,
    out: TextIO = sys.stderr,
    wan: RegionsPerRun | None = None,
) -> dict[str, Any]:
    """Runs atoll under failures, then (by choice) lockstep and failure-free; returns the figures."""
    runs = [("atoll", cfg, True)] if chaos.atoll else []
    if chaos.lockstep:
        runs.append(("lockstep", lockstep_config(cfg), True))
    if chaos.failure_free:
        runs.append(("failure_free", cfg, False))
    results: dict[str, dict[str, Any]] = {}
    for name, run_cfg, inject in runs:
        restart_all = name == "lockstep" and chaos.lockstep_restart
        run_dir = work_dir / name
        run_cfg, _ = prepare_run_dir(run_dir, dataclasses.asdict(run_cfg))
        print(f"atoll chaos: {name} run in {run_dir}", file=out, flush=True)
        # the failure-free run stops at the atoll run's tokens: eval losses compared at equal tokens
        budget = (
            results["atoll"]["tokens"]
            if name == "failure_free" and results["atoll"]["tokens"]
            else None
        )
        session = ChaosSession(
            run_cfg,
            chaos,
            run_dir,
            out,
            inject,
            wan=wan if name != "failure_free" else None,
            restart_all=restart_all,
            standbys=chaos.standbys if name == "atoll" else 0,
            token_budget=budget,
        )
        try:
            report = session.run()
        finally:
            if wan is not None:
                wan.stop()
        results[name] = account(run_dir, run_cfg, session, report, chaos.uptime_window)
        if wan is not None and name != "failure_free":
            results[name]["wan"] = wan.describe()
        if session.stop_signal is not None:
            results[name]["interrupted"] = signal.Signals(session.stop_signal).name
            break
    a = results.get("atoll", {})
    first = next(iter(results.values()))  # one schedule: the first run's kills are every run's
    out_json = {
        "goodput": a.get("goodput"),
        "uptime": a.get("uptime"),
        "lockstep_goodput": results.get("lockstep", {}).get("goodput"),
        "lockstep_uptime": results.get("lockstep", {}).get("uptime"),
        "failures_injected": first["failures_injected"],
        "shard_restarts": first["shard_restarts"],
        "acked_pushes_lost": sum(r["acked_pushes_lost"] for r in results.values()),
        "final_eval_loss": a.get("final_eval_loss"),
        "lockstep_final_eval_loss": results.get("lockstep", {}).get("final_eval_loss"),
        "standbys": chaos.standbys,
        "kill_to_first_accepted_push_s": _median(a.get("kill_to_first_accepted_push_s")),
        "lockstep_kill_to_first_accepted_push_s": _median(
            results.get("lockstep", {}).get("kill_to_first_accepted_push_s")
        ),
    }
    if "failure_free" in results:
        ff = results["failure_free"]["final_eval_loss"]
        out_json["failure_free_eval_loss"] = ff
        out_json["tokens"] = a["tokens"]
        out_json["failure_free_tokens"] = results["failure_free"]["tokens"]
        if ff and a["final_eval_loss"]:
            out_json["eval_loss_gap_pct"] = 100.0 * (a["final_eval_loss"] - ff) / ff
    out_json["config"] = {
        **{k: v for k, v in dataclasses.asdict(cfg).items()},
        "chaos": dataclasses.asdict(chaos),
    }
    out_json["runs"] = results
    out_json["work_dir"] = str(work_dir)
    (work_dir / "chaos.json").write_text(json.dumps(out_json, indent=1))
    return out_json


def _median(values: list[float | None] | None) -> float | None:
    """The median of the figures that exist (a kill with no accepted push after it has none)."""
    known = [v for v in values or [] if v is not None]
    return round(float(np.median(known)), 2) if known else None


def chaos_up_config(a: argparse.Namespace) -> UpConfig:
    """The run under test, from `atoll chaos` flags: `atoll up`'s settings with chaos's defaults."""
    return UpConfig(
        shards=a.shards,
        learners=a.learners,
        preset=a.preset,
        steps=a.steps,
        slowdown=(1.0,) * a.learners,
        batch_size=a.batch_size,
        period=a.period,
        overlap=a.overlap,
        fragments=a.fragments,
        quorum=a.quorum,
        lease_seconds=a.lease_seconds,
        outer_lr=1.0,
        outer_momentum=0.0,
        evals=0,
        seed=0,
        checkpoint_every=a.checkpoint_every,
    )


def _seconds_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds like 40,90, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`atoll chaos`: the local mode's flags, then --kubernetes and its own."""
    from atoll.cluster.kube_chaos import add_chaos_arguments

    p.add_argument(
        "--kubernetes",
        action="store_true",
        help="delete random learner pods in a cluster (its controllers restart them) "
        "and report goodput from the shards' metrics, instead of running processes here",
    )
    _add_local_arguments(p)
    add_chaos_arguments(p)


# `atoll chaos`'s run: `atoll up`'s settings (flags generated from UpConfig's fields) at
# these defaults. The period is 64, not atoll up's 32: steps of a few ms on two shared cores
# make a 32-step period about a third of a second, where per-round latency and overhead,
# not failures, decide goodput (failure-free: 89 % at H=32, 96 % at H=64).
CHAOS_RUN = {
    "learners": 4,
    "shards": 2,
    "preset": "tiny",
    "steps": 20000,  # the learning-rate schedule's length; --duration normally ends the run
    "batch_size": 16,
    "period": 64,
    "overlap": 1,
    "fragments": 4,
    "lease_seconds": 5.0,
}
CHAOS_RUN_FLAGS = (*CHAOS_RUN, "quorum", "checkpoint_every")


def _add_local_arguments(p: argparse.ArgumentParser) -> None:
    """The local mode's flags (`--mtbf`, `--seed` and `--json` are shared with --kubernetes)."""
    from atoll.wire import settings

    d = {f.name: f.default for f in dataclasses.fields(ChaosConfig)}
    have = {o for action in p._actions for o in action.option_strings}
    if "--mtbf" not in have:
        p.add_argument(
            "--mtbf",
            type=float,
            default=None,
            help=f"mean seconds between failures of each learner (default {d['mtbf']:g})",
        )
    if "--duration" not in have:
        p.add_argument(
            "--duration",
            type=float,
            default=None,
            help=f"seconds of training on the failure clock (default {d['duration']:g})",
        )
    if "--seed" not in have:
        p.add_argument("--seed", type=int, default=None, help="failure schedule seed (default 0)")
    if "--json" not in have:
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g = p.add_argument_group("local runs (real processes on this machine)")
    settings.add_flags(g, UpConfig, only=CHAOS_RUN_FLAGS, defaults=CHAOS_RUN)
    _add_failure_arguments(g, d)
    g.add_argument(
        "--work-dir",
        type=pathlib.Path,
        default=None,
        help="where the runs go (default runs/chaos-<timestamp>)",
    )
    _add_wan_arguments(g)


def _add_failure_arguments(g: argparse._ArgumentGroup, d: dict[str, Any]) -> None:
    """The failures of the local mode and the runs it compares, defaulting to ChaosConfig's `d`."""
    g.add_argument(
        "--restart-delay",
        type=float,
        default=d["restart_delay"],
        help="seconds a killed learner stays down (default %(default)s)",
    )
    g.add_argument(
        "--shard-kill-at",
        type=_seconds_list,
        default=d["shard_kill_at"],
        help="seconds after learners start at which to SIGKILL a shard, e.g. 40,90; '' for none "
        "(default 40)",
    )
    g.add_argument(
        "--shard-restart-delay",
        type=float,
        default=d["shard_restart_delay"],
        help="seconds a killed shard stays down (default %(default)s)",
    )
    g.add_argument(
        "--standbys",
        type=int,
        default=d["standbys"],
        help="standby learners, compiled and waiting, that take over a killed learner's id in the "
        "atoll run (a killed learner's machine returns as one after --restart-delay); 0: "
        "killed learners are restarted instead (default %(default)s)",
    )
    g.add_argument(
        "--no-lockstep", dest="lockstep", action="store_false", help="skip the lockstep baseline"
    )
    g.add_argument(
        "--no-atoll",
        dest="atoll",
        action="store_false",
        help="skip the atoll run: the lockstep baseline alone (with --no-failure-free)",
    )
    g.add_argument(
        "--lockstep-restart",
        dest="lockstep_restart",
        action="store_true",
        default=d["lockstep_restart"],
        help="lockstep with checkpoint-restart semantics: any failure restarts every learner (the default)",
    )
    g.add_argument(
        "--no-lockstep-restart",
        dest="lockstep_restart",
        action="store_false",
        help="lockstep restarts only the killed learner; the others wait for it in their rounds",
    )
    g.add_argument(
        "--failure-free",
        dest="failure_free",
        action="store_true",
        default=d["failure_free"],
        help="also run without failures and compare final eval loss (the default)",
    )
    g.add_argument(
        "--no-failure-free",
        dest="failure_free",
        action="store_false",
        help="skip the failure-free run",
    )
    g.add_argument(
        "--uptime-window",
        type=float,
        default=d["uptime_window"],
        help="seconds per uptime window (default %(default)s)",
    )


def _add_wan_arguments(g: argparse._ArgumentGroup) -> None:
    """--wan: the learners behind emulated wide-area links."""
    g.add_argument(
        "--wan",
        action="store_true",
        help="learners in their own network namespaces behind rate-limited, delayed links (root)",
    )
    g.add_argument(
        "--wan-regions", type=int, default=4, help="regions for --wan (default %(default)s)"
    )
    g.add_argument(
        "--wan-rate-mbit",
        type=float,
        default=20.0,
        help="each region's link rate (default %(default)s)",
    )
    g.add_argument(
        "--wan-latency-ms",
        type=float,
        default=25.0,
        help="one-way latency added by the proxy (default %(default)s)",
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`atoll chaos` on this machine: exit 0 when nothing acknowledged was lost, 1 otherwise,
    128 + the signal when SIGINT/SIGTERM stopped it (with --kubernetes,
    `atoll.cluster.kube_chaos.chaos_main`)."""
    import datetime

    if args.kubernetes:
        from atoll.cluster.kube_chaos import chaos_main

        return chaos_main(args, parser)

    try:
        chaos = ChaosConfig(
            mtbf=args.mtbf if args.mtbf is not None else ChaosConfig.mtbf,
            duration=args.duration if args.duration is not None else ChaosConfig.duration,
            restart_delay=args.restart_delay,
            shard_kill_at=tuple(args.shard_kill_at),
            shard_restart_delay=args.shard_restart_delay,
            seed=args.seed or 0,
            atoll=args.atoll,
            lockstep=args.lockstep,
            lockstep_restart=args.lockstep_restart,
            failure_free=args.failure_free,
            uptime_window=args.uptime_window,
            standbys=args.standbys,
        )
        cfg = chaos_up_config(args)
        if chaos.standbys and cfg.checkpoint_every <= 0:
            raise ChaosConfigError(
                "--standbys needs --checkpoint-every > 0: a standby resumes the failed "
                "learner's checkpoint (or give --standbys 0)"
            )
    except (ChaosConfigError, UpConfigError) as e:
        parser.error(str(e))
    if any(t >= 0 for t in chaos.shard_kill_at) and cfg.shards < 1:
        parser.error("--shard-kill-at needs shards")
    work_dir = args.work_dir or pathlib.Path("runs") / datetime.datetime.now().strftime(
        "chaos-%Y%m%d-%H%M%S"
    )
    if work_dir.exists() and any(work_dir.iterdir()):
        parser.error(f"--work-dir {work_dir} is not empty; give a new one")
    wan = None
    if args.wan:
        from atoll.faults import wan as wan_mod

        why = wan_mod.available()
        if why is not None:
            parser.error(f"--wan cannot run here: {why}")
        try:
            wan = RegionsPerRun(
                wan_mod.WanConfig(
                    regions=args.wan_regions,
                    rate_mbit=args.wan_rate_mbit,
                    latency_ms=args.wan_latency_ms,
                )
            )
        except ValueError as e:
            parser.error(str(e))
    work_dir.mkdir(parents=True, exist_ok=True)
    result = run_chaos(cfg, chaos, work_dir, out=sys.stderr if args.json else sys.stdout, wan=wan)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(summary(result))
    stopped = [r["interrupted"] for r in result["runs"].values() if r.get("interrupted")]
    if stopped:
        return 128 + signal.Signals[stopped[0]]  # as `atoll up`: 130 for SIGINT, 143 for SIGTERM
    return 0 if result["acked_pushes_lost"] == 0 else 1


class RegionsPerRun:
    """A fresh set of WAN regions for each run of one `atoll chaos` (its shards' ports differ)."""

    def __init__(self, cfg: WanConfig):
        self.cfg, self.regions = cfg, cfg.regions
        self.current: Wan | None = None

    def start(self, shard_ports: list[int]) -> None:
        from atoll.faults.wan import Wan

        self.current = Wan(self.cfg, shard_ports).__enter__()

    def stop(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None

    def describe(self) -> str:
        return (
            f"{self.regions} regions (network namespaces), {self.cfg.rate_mbit:g} Mbit/s each way, "
            f"+{self.cfg.latency_ms:g} ms one-way; learner i in region i mod {self.regions}"
        )

    def command_prefix(self, region: int) -> list[str]:
        return self._running().command_prefix(region)

    def shard_addresses(self, region: int) -> list[str]:
        return self._running().shard_addresses(region)

    def _running(self) -> Wan:
        assert self.current is not None, "the regions of a run start with its shards"
        return self.current


def summary(r: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f} %"

    lines = [
        f"atoll chaos: {r['failures_injected']} learner kills, {r['shard_restarts']} shard restarts "
        f"(runs in {r['work_dir']})",
        f"  atoll     goodput {pct(r['goodput'])}  uptime {pct(r['uptime'])}  "
        f"final eval loss {r['final_eval_loss']}",
        f"  lockstep  goodput {pct(r['lockstep_goodput'])}  uptime {pct(r['lockstep_uptime'])}  "
        f"final eval loss {r['lockstep_final_eval_loss']}",
        f"  acknowledged pushes lost: {r['acked_pushes_lost']}",
    ]
    for name, run in r["runs"].items():
        if run.get("open_rounds"):
            lines.append(
                f"  {name}: global model read with rounds still open (pushes not in it): "
                + ", ".join(f"fragment {p}: {n}" for p, n in sorted(run["open_rounds"].items()))
            )
    if "wan" in r["runs"].get("atoll", {}):
        lines.append(
            f"  WAN: {r['runs']['atoll']['wan']}; learners computing "
            f"{pct(r['runs']['atoll']['utilisation'])} of the time (lockstep "
            f"{pct(r['runs'].get('lockstep', {}).get('utilisation'))})"
        )
    if "failure_free_eval_loss" in r:
        lines.append(
            f"  failure-free eval loss {r['failure_free_eval_loss']} "
            f"(gap {r.get('eval_loss_gap_pct', float('nan')):.2f} %)"
        )
    return "\n".join(lines)
