"""One `atoll up` session: start or resume the children, watch them, finish or stop, report.

A small state machine driven by a 1 s tick: shards start (their ports read from the
line each prints), then learners; every tick reads learners' status files and shards'
/metrics, redraws the table, and handles children that exit (a learner: the others go
on; a shard: restarted once on the same port, it recovers from disk). Then the global
model is read through the shards' fragment map (rounds still open are waited for a few
sync periods at most, then reported), written into the run directory's model/ and
evaluated, shards stop, the optional baseline trains, and the report is written. SIGINT/SIGTERM at any point: learners stop first (one
stopped before its first step is stopped, not crashed), then shards; the report says so.
"""

from __future__ import annotations

import json
import pathlib
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, TextIO

# global_map and open_rounds: the read's pure parts, imported from here by tests/test_session.py
from atoll.export import GlobalModel, global_map, open_rounds, read_global  # noqa: F401
from atoll.local import progress
from atoll.local.config import LearnerSpec, UpConfig, baseline_spec, learner_specs
from atoll.local.processes import Child, LearnerProcess, PidFile, ShardProcess, stop_children
from atoll.local.report import write_report

TICK = 1.0  # seconds between table redraws and child checks
STALL_SECONDS = 60.0  # no learner step for this long while all train: say so
LINE_EVERY = 5.0  # seconds between log lines when not on a terminal
SAMPLE_EVERY = 2.0  # seconds between shard metric samples in shards.jsonl
LEARNER_STOP_SECONDS = 30.0  # SIGTERM -> SIGKILL: a learner finishes its step, evaluates, leaves
SHARD_STOP_SECONDS = 15.0  # SIGTERM -> SIGKILL: a shard writes its final snapshot
SHARD_START_SECONDS = 120.0  # a shard must print its port within this (imports on a busy machine)
MODEL_DIR = "model"  # where in the run directory the final global model is written


class Session:
    """One `atoll up` session: start or resume, watch, finish (or stop), report."""

    def __init__(self, cfg: UpConfig, run_dir: pathlib.Path, out: TextIO, live: bool):
        self.cfg, self.run_dir, self.out, self.live = cfg, run_dir, out, live
        self.screen = progress.Screen(out) if live else None
        self.stop_signal: int | None = None
        self.hurry = threading.Event()
        self.stopping = threading.Event()  # set by the first SIGINT/SIGTERM (ends waits)
        self.wake = threading.Event()
        self.events: list[str] = []
        self.shards: list[ShardProcess] = []
        self.learners: list[LearnerProcess] = []
        self.baseline: LearnerProcess | None = None
        self.started = time.time()
        self.learners_started: float | None = None
        self.learners_ended: float | None = None
        self.failure: str | None = None
        self.pids = PidFile(run_dir / "pids.json")
        self._line = progress.Ticker(LINE_EVERY)
        self._sample = progress.Ticker(SAMPLE_EVERY)
        self._metrics: dict[int, dict[str, Any]] = {}
        self._steps_seen, self._progress_at, self._stall_said = -1, time.monotonic(), False

    # -- signals and messages --

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            self.stopping.set()
        else:
            self.hurry.set()  # a second Ctrl-C: stop waiting for children, kill them
        self.wake.set()

    def say(self, text: str, detail: str = "") -> None:
        """An event: under the table on a terminal, a log line otherwise; always in the report."""
        stamp = progress.clock(time.time() - self.started)
        self.events.append(f"[{stamp}] {text}" + (f"\n{detail}" if detail else ""))
        if not self.live:
            print(self.events[-1], file=self.out, flush=True)

    # -- the session --

    def run(self) -> dict[str, Any]:
        """Runs the session to its end (or a signal or failure); returns the report."""
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        global_eval = None
        try:
            self._start_shards()
            if self._running():
                self._start_learners()
                self._watch(self._learners_busy)
            self._stop(self.learners, LEARNER_STOP_SECONDS)  # learners before shards, always
            self.learners_ended = time.time()
            if self._running() and self.cfg.baseline:
                self._start_baseline()  # before this process imports JAX: no fork() after its threads
            if self._running() and all(s.state == "serving" for s in self.shards):
                global_eval = self._evaluate_global()
            self._stop(self.shards, SHARD_STOP_SECONDS)
            if self._running() and self.baseline is not None:
                self._watch(self.baseline.alive)
        finally:
            self._stop(
                self.learners + ([self.baseline] if self.baseline else []), LEARNER_STOP_SECONDS
            )
            self._stop(self.shards, SHARD_STOP_SECONDS)
            for s, h in handlers.items():
                signal.signal(s, h)
        return self._finish(global_eval)

    def _running(self) -> bool:
        return self.stop_signal is None and self.failure is None

    def _start_shards(self) -> None:
        self.shards = [ShardProcess(self.cfg, i, self.run_dir) for i in range(self.cfg.shards)]
        for s in self.shards:
            s.start(self.pids)
        deadline = time.monotonic() + SHARD_START_SECONDS
        while self._running() and not all(s.check_serving() for s in self.shards):
            for s in self.shards:
                if not s.alive() and s.state != "serving":
                    self.failure = (
                        f"shard {s.index} exited with status {s.returncode} before serving"
                    )
                    self.say(self.failure, s.tail())
            if time.monotonic() > deadline:
                self.failure = f"shards did not start within {SHARD_START_SECONDS:.0f} s"
                self.say(self.failure)
            self.wake.wait(0.1)
        if self._running():
            self.say("shards serving on " + ", ".join(f"127.0.0.1:{s.port}" for s in self.shards))

    def _learners_busy(self) -> bool:
        return any(l.alive() for l in self.learners)

    def _addresses_for(self, spec: LearnerSpec) -> list[str]:
        """The shard addresses a learner is given (in shard index order)."""
        return [f"127.0.0.1:{s.port}" for s in self.shards]

    def _prefix_for(self, spec: LearnerSpec) -> list[str]:
        """A command a learner runs under (none here: on this host, in this namespace)."""
        return []

    def _start_learners(self) -> None:
        self.learners = [
            LearnerProcess(spec, self.cfg, self.run_dir, self._addresses_for(spec))
            for spec in learner_specs(self.cfg)
        ]
        for l in self.learners:
            l.prefix = self._prefix_for(spec=l.spec)
            if l.finished:
                l.state = "done"
                continue
            if l.status.last is not None:
                self.say(f"{l.name} resumes from step {l.status.last.get('step', 0)}")
            l.start(self.pids)
            l.state = "starting"
        self.learners_started = time.time()

    def _start_baseline(self) -> None:
        """The data-parallel reference, alone after the learners (so it has both cores)."""
        self.baseline = LearnerProcess(baseline_spec(self.cfg), self.cfg, self.run_dir, [])
        if self.baseline.finished:
            self.baseline.state = "done"
            return
        self.say(
            f"training the data-parallel baseline ({self.baseline.spec.steps} steps of "
            f"{self.cfg.learners}x{self.cfg.batch_size} sequences) for the loss plot"
        )
        self.baseline.start(self.pids)
        self.baseline.state = "starting"

    def _watch(self, busy: Callable[[], bool]) -> None:
        """Redraws and checks children every TICK until `busy()` is false or we must stop."""
        while self._running() and busy():
            self._tick()
            self.wake.wait(TICK)
            self.wake.clear()
        self._tick()

    def _tick(self, draw: bool = True) -> None:
        steps = 0
        for l in self.learners + ([self.baseline] if self.baseline else []):
            l.update()
            steps += (l.status.last or {}).get("step", 0)
            # a learner sent SIGTERM is judged by _stop (_learner_stopped), not here
            if l.proc is not None and not l.stop_sent and l.state != "crashed" and not l.alive():
                l.update()
                if l.returncode == 0 and l.state in ("done", "stopped"):
                    continue
                self._learner_exited(l)
        for s in self.shards:
            s.check_serving()
            if (
                s.state in ("serving", "restarting", "starting")
                and not s.alive()
                and self._running()
            ):
                self._shard_exited(s)
            if s.state == "serving":
                m = progress.scrape(s.metrics_port)
                if m is not None:
                    self._metrics[s.index] = m
        self._check_stall(steps)
        if self._sample():
            with open(self.run_dir / "shards.jsonl", "a") as f:
                now = time.time()
                for i, m in self._metrics.items():
                    f.write(
                        json.dumps({"time": now, "shard": i, **m}, separators=(",", ":")) + "\n"
                    )
        if draw:
            self._draw()

    def _learner_exited(self, l: LearnerProcess) -> None:
        """A learner died: the others go on without it."""
        l.state = "crashed"
        self.say(
            f"{l.name} exited with status {l.returncode} at step "
            f"{(l.status.last or {}).get('step', 0)}; the others go on. Its log "
            f"({l.log_path}) ends:",
            l.tail(),
        )

    def _shard_exited(self, s: ShardProcess) -> None:
        """A shard died: restarted once on its port (it recovers from disk); twice ends the run."""
        if s.restarts == 0 and s.port is not None:
            self.say(
                f"shard {s.index} exited with status {s.returncode}; restarting it on port {s.port} "
                f"(it recovers from {self.run_dir / 'shards' / str(s.index)}). Its log ends:",
                s.tail(),
            )
            s.restart(self.pids)
        else:
            s.state = "failed"
            self.failure = (
                f"shard {s.index} exited with status {s.returncode} again; stopping the run"
            )
            self.say(self.failure, s.tail())

    def _check_stall(self, steps: int) -> None:
        """Says so (once per stall) when training learners have taken no step for STALL_SECONDS."""
        now = time.monotonic()
        if steps != self._steps_seen or not any(
            l.alive() and l.state == "training" for l in self.learners
        ):
            self._steps_seen, self._progress_at, self._stall_said = steps, now, False
        elif now - self._progress_at > STALL_SECONDS and not self._stall_said:
            self._stall_said = True
            rounds = ", ".join(
                f"shard {i}: " + " ".join(f"{p}:v{v}" for p, v in sorted(m["versions"].items()))
                for i, m in sorted(self._metrics.items())
            )
            self.say(
                f"no learner has taken a step in {STALL_SECONDS:.0f} s: they are blocked on rounds that "
                f"have not closed ({rounds}); Ctrl-C stops the run, `atoll up --run-dir {self.run_dir}` "
                "resumes it"
            )

    def _rows(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        learners = [l.row() for l in self.learners + ([self.baseline] if self.baseline else [])]
        shards = [
            {
                "index": s.index,
                "port": s.port,
                "state": s.state,
                "restarts": s.restarts,
                "metrics": self._metrics.get(s.index),
            }
            for s in self.shards
        ]
        return learners, shards

    def _draw(self, final: bool = False) -> None:
        learners, shards = self._rows()
        elapsed = time.time() - self.started
        if self.screen is not None:  # live
            title = (
                f"atoll up  {self.run_dir}  |  {self.cfg.shards} shards, {self.cfg.learners} learners, "
                f"{self.cfg.preset}  |  Ctrl-C stops (data kept)"
            )
            self.screen.draw(progress.table(title, elapsed, learners, shards, self.events))
        elif final or self._line():
            print(progress.line(elapsed, learners, shards), file=self.out, flush=True)

    def _stop(self, children: Sequence[Child], seconds: float) -> None:
        live = [c for c in children if c.alive()]
        if not live:
            return
        if self.stop_signal is not None or self.failure is not None:
            self.say(f"stopping {', '.join(c.name for c in live)}")
        stragglers = stop_children(live, seconds, self.hurry)
        for c in live:
            if isinstance(c, ShardProcess):
                c.state = "stopped"
            elif isinstance(c, LearnerProcess):
                self._learner_stopped(c, seconds, killed=c in stragglers)
        self._tick(draw=False)

    def _learner_stopped(self, l: LearnerProcess, seconds: float, killed: bool) -> None:
        """What became of a learner sent SIGTERM: it left cleanly, was still starting, or not."""
        l.update()
        if l.state in ("done", "stopped"):
            pass  # its final record says so (it may have lingered on its way out)
        elif killed:
            l.state = "killed"
            self.say(f"{l.name} did not stop within {seconds:.0f} s of SIGTERM; killed it")
        elif not l.stepped:
            # SIGTERM before its first step (before it set its handler, or while joining):
            # nothing it trained is lost, the same as a clean stop
            l.state = "stopped"
            # 128 + the signal: how `atoll learner` exits when a signal stopped it
            if l.returncode not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
                self.say(
                    f"{l.name} exited with status {l.returncode} as it stopped before its first "
                    "step; its log ends:",
                    l.tail(),
                )
        else:
            l.state = "crashed"
            self.say(
                f"{l.name} exited with status {l.returncode} as it stopped, at step "
                f"{(l.status.last or {}).get('step', 0)}, without a final record. Its log "
                f"({l.log_path}) ends:",
                l.tail(),
            )

    def _period_seconds(self) -> float | None:
        """The run's sync period in seconds: the shards' cadence, else H of the fastest
        learner's last step time; None before either is known."""
        cadences = [
            m["cadence_seconds"] for m in self._metrics.values() if m.get("cadence_seconds")
        ]
        if cadences:
            return float(max(cadences))
        times = [(l.status.last or {}).get("step_seconds") for l in self.learners if l.status.last]
        steps: list[float] = [t for t in times if t]
        return self.cfg.period * min(steps) if steps else None

    def _evaluate_global(self) -> dict[str, Any] | None:
        wait = round_wait_seconds(self.cfg.lease_seconds, self._period_seconds())
        self.say(
            "learners finished; evaluating the global model from the shards (waiting up to "
            f"{wait:.0f} s for rounds still open)"
        )
        addresses = [f"127.0.0.1:{s.port}" for s in self.shards]
        try:
            model = read_global_model(self.cfg, addresses, wait, stop=self.stopping)
        except Exception as e:  # a report without the global figure beats no report
            self.say(f"could not read the global model: {type(e).__name__}: {e}")
            return None
        if model.open_rounds:
            self.say(
                f"read the global model with rounds still open after {model.waited_seconds:.0f} s "
                "(their pushes are not in it): "
                + ", ".join(
                    f"fragment {p} ({n} push{'es' if n > 1 else ''})"
                    for p, n in sorted(model.open_rounds.items())
                )
            )
        saved = self._save_model(model)
        try:
            result = evaluate_global(self.cfg, addresses, wait, model=model)
        except Exception as e:
            self.say(f"could not evaluate the global model: {type(e).__name__}: {e}")
            result = {
                "versions": model.versions,
                "open_rounds": model.open_rounds,
                "waited_seconds": model.waited_seconds,
            }
        return {**result, "model": saved}

    def _save_model(self, model: GlobalModel) -> str | None:
        """Writes the global model into the run directory's model/ (atoll.model_dir; a
        resumed run's replaces the previous session's); returns its path, None on failure."""
        from atoll import model_dir

        path = self.run_dir / MODEL_DIR
        try:
            model_dir.write(
                path, model.params(), model.plan, model.record(), self.cfg.preset, replace=True
            )
        except Exception as e:  # the report still comes, saying the model was not kept
            self.say(f"could not write the global model to {path}: {type(e).__name__}: {e}")
            return None
        self.say(f"wrote the global model to {path} (atoll sample --model {path} --prompt ...)")
        return str(path)

    def _finish(self, global_eval: dict[str, Any] | None) -> dict[str, Any]:
        self._draw(final=True)
        ended = time.time()
        interrupted = self.stop_signal is not None
        outcome = "interrupted" if interrupted else "failed" if self.failure else "finished"
        session: dict[str, Any] = {
            "start": self.started,
            "end": ended,
            "outcome": outcome,
            "learners_start": self.learners_started,
            "learners_end": self.learners_ended or ended,
        }
        if self.stop_signal is not None:  # interrupted
            session["signal"] = signal.Signals(self.stop_signal).name
        with open(self.run_dir / "sessions.jsonl", "a") as f:
            f.write(json.dumps(session) + "\n")
        report = write_report(
            self.run_dir,
            self.cfg,
            learner_specs(self.cfg),
            baseline_spec(self.cfg) if self.cfg.baseline else None,
            global_eval=global_eval,
            events=self.events,
            failure=self.failure,
            interrupted=session.get("signal"),
            states={l.name: l.state for l in self.learners},
            shard_restarts={s.index: s.restarts for s in self.shards},
        )
        return report


# Reading the global model at the end. A round still open when the learners have left
# closes within its grace window (less than a period) or, below its quorum, once the
# leases of the learners that left lapse, if they ever do (lockstep's never do). So the
# read waits for open rounds a few sync periods at most, and no longer than a lease
# (plus the shard's timer) where that is shorter; then it reads them as they are.
OPEN_ROUND_PERIODS = 3.0  # sync periods the read waits for open rounds to close
OPEN_ROUND_MIN_SECONDS = 5.0  # the least it waits (a period is unknown, or very short)
OPEN_ROUND_MARGIN_SECONDS = 5.0  # past a lease, what a round timer may take to close a round
EVAL_CALL_SECONDS = 30.0  # deadline of each Describe and Pull of the read (a busy shard answers)


def round_wait_seconds(lease_seconds: float, period_seconds: float | None) -> float:
    """How long the global model's read waits for rounds still open to close.

    Args:
      lease_seconds: the shards' lease; a round below quorum closes once the leases of
        the learners that left lapse, so no wait is longer than it (plus a margin).
      period_seconds: the run's sync period in seconds (H steps of the fastest learners),
        None when unknown.

    Returns:
      OPEN_ROUND_PERIODS periods (at least OPEN_ROUND_MIN_SECONDS), or the lease plus
      OPEN_ROUND_MARGIN_SECONDS when that is shorter; e.g. round_wait_seconds(1e9, 2.0)
      == 6.0 (lockstep: its leases never lapse) and round_wait_seconds(10.0, 8.0) == 15.0.
    """
    bound = max(OPEN_ROUND_MIN_SECONDS, OPEN_ROUND_PERIODS * (period_seconds or 0.0))
    return min(lease_seconds + OPEN_ROUND_MARGIN_SECONDS, bound)


def read_global_model(
    cfg: UpConfig,
    addresses: list[str],
    wait_seconds: float,
    stop: threading.Event | None = None,
) -> GlobalModel:
    """The run's global model, read fragment by fragment (FP32 snapshots) from the shards
    its fragment map names (atoll.export.read_global), waiting up to `wait_seconds` for
    rounds still open (see round_wait_seconds) or until `stop` is set (a Ctrl-C)."""
    from atoll.learner.trainer.model import init_params, preset
    from atoll.wire.client import ShardClient
    from atoll.wire.plan import FragmentPlan

    plan = FragmentPlan.build(init_params(preset(cfg.preset), cfg.seed), cfg.fragments)
    # anonymous: no lease, no round waits
    clients = [ShardClient(a, "", deadline=EVAL_CALL_SECONDS) for a in addresses]
    try:
        return read_global(clients, wait_seconds, stop, plan=plan)
    finally:
        for c in clients:
            c.close()


def evaluate_global(
    cfg: UpConfig,
    addresses: list[str],
    wait_seconds: float,
    stop: threading.Event | None = None,
    model: GlobalModel | None = None,
) -> dict[str, Any]:
    """The global model (`model`, or read from the shards by read_global_model) on the
    learners' held-out batches. Returns eval_loss, eval_bits_per_byte, versions
    ({fragment: version}), open_rounds ({fragment: pushes left in its round, not in the
    model}) and waited_seconds."""
    from atoll.learner.trainer.data import eval_batches, load_corpus
    from atoll.learner.trainer.model import preset
    from atoll.learner.trainer.train import evaluate

    model = model or read_global_model(cfg, addresses, wait_seconds, stop)
    model_cfg = preset(cfg.preset)
    corpus = load_corpus(None, vocab=model_cfg.vocab)
    batches = eval_batches(
        corpus.heldout,
        context=model_cfg.context,
        batch_size=cfg.batch_size,
        num_batches=cfg.eval_batches,
    )
    result = evaluate(model.params(), batches, model_cfg)
    return {
        "eval_loss": result["loss"],
        "eval_bits_per_byte": result["bits_per_byte"],
        "versions": model.versions,
        "open_rounds": model.open_rounds,
        "waited_seconds": model.waited_seconds,
    }
