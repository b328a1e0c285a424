"""The children of `atoll up`: shard and learner processes, each with its own log.

Children run in their own session (a terminal's Ctrl-C reaches only `atoll up`, which
stops learners first, then shards) and get SIGTERM if `atoll up` dies, however it dies
(PR_SET_PDEATHSIG), so a run never leaves orphans. pids.json lists every child started.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from atoll.learner.config import ENV_CHECKPOINT_DIR, ENV_COMPILE_CACHE, LearnerConfig
from atoll.local import progress
from atoll.local.config import LearnerSpec, UpConfig
from atoll.wire.records import parse_serving

REPO = pathlib.Path(__file__).resolve().parents[2]  # the checkout (atoll/local/ is two below)
# 4 learners and 2 shards share 2 cores: one compute thread per child, not XLA's and
# BLAS's pools oversubscribing them. Measured on 2 cores: the same CPU time per small-model
# step either way (20.0 vs 20.1 user-s for 20 steps), so one thread costs nothing.
CHILD_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
XLA_SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false"


_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when `atoll up` dies, however it dies."""
    _libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def child_env(single_thread: bool) -> dict[str, str]:
    env = dict(os.environ)
    # a launcher spells out --checkpoint-dir where it wants one: the variable must not give
    # checkpoints to a learner it asked none of (the baseline refuses them)
    env.pop(ENV_CHECKPOINT_DIR, None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["PYTHONUNBUFFERED"] = "1"
    if single_thread:
        for k, v in CHILD_THREAD_ENV.items():
            env.setdefault(k, v)
        if "xla_cpu_multi_thread_eigen" not in env.get("XLA_FLAGS", ""):
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {XLA_SINGLE_THREAD}".strip()
    return env


class Child:
    """One `atoll …` child process with its own log file."""

    def __init__(
        self,
        name: str,
        kind: str,
        args: list[str],
        log_path: pathlib.Path,
        single_thread: bool = True,
    ):
        self.name, self.kind, self.args, self.log_path = name, kind, args, log_path
        self.single_thread = single_thread
        self.prefix: list[
            str
        ] = []  # a command that runs the child elsewhere, e.g. `ip netns exec NS`
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_offset = 0  # where this start's output begins in the log
        self.stop_sent = False  # this start was sent SIGTERM by stop_children

    def start(self, pids: PidFile) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            log.write(
                f"--- {datetime.datetime.now().isoformat(timespec='seconds')} atoll up starts: "
                f"{' '.join(self.args[2:])}\n".encode()
            )
            log.flush()
            self.stop_sent = False
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "atoll.cli", *self.args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(self.single_thread),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        pids.add(self)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """This start's process (there is one once start() has run)."""
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def output(self) -> str:
        """This start's output so far."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 12) -> str:
        return "\n".join("    " + t for t in self.output().splitlines()[-lines:])


def stop_children(
    children: Sequence[Child], seconds: float, hurry: threading.Event | None = None
) -> list[Child]:
    """SIGTERM, wait up to `seconds` (or until `hurry`), SIGKILL the stragglers, reap all;
    returns the stragglers (those that did not stop by themselves)."""
    live = [c for c in children if c.alive()]
    for c in live:
        c.stop_sent = True
        try:
            c.process.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + seconds
    while (
        any(c.alive() for c in live)
        and time.monotonic() < deadline
        and not (hurry and hurry.is_set())
    ):
        time.sleep(0.05)
    stragglers = [c for c in live if c.alive()]
    for c in stragglers:
        try:
            c.process.kill()
        except ProcessLookupError:
            pass
    for c in live:
        c.process.wait()
    return stragglers


class PidFile:
    """pids.json: this session's `atoll up` pid and every child it started, written atomically."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.children: list[dict[str, Any]] = []
        self._write()

    def add(self, child: Child) -> None:
        self.children.append({"name": child.name, "kind": child.kind, "pid": child.process.pid})
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"up": os.getpid(), "children": self.children}, indent=1))
        os.replace(tmp, self.path)


class ShardProcess(Child):
    """`atoll syncer` on 127.0.0.1, port 0 at first (read from its serving line), with metrics."""

    def __init__(self, cfg: UpConfig, index: int, run_dir: pathlib.Path):
        self.cfg, self.index, self.run_dir = cfg, index, run_dir
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.restarts = 0
        self.state = "starting"  # starting, serving, restarting, stopped, failed
        super().__init__(
            f"shard-{index}", "shard", self._args(0), run_dir / "logs" / f"shard-{index}.log"
        )

    def _args(self, port: int) -> list[str]:
        shard = self.cfg.shard_config(self.index, self.run_dir / "shards" / str(self.index), port)
        return ["syncer", *shard.to_args()]

    def restart(self, pids: PidFile) -> None:
        """On the same port, from the same data directory (it recovers from disk)."""
        assert self.port is not None  # restarted only once it served (session._shard_exited)
        self.args = self._args(self.port)
        self.restarts += 1
        self.state, self.metrics_port = "restarting", None
        self.start(pids)

    def check_serving(self) -> bool:
        """True once this start printed its serving line (ports read from it)."""
        if self.state in ("starting", "restarting"):
            ports = parse_serving(self.output())
            if ports:
                self.port, self.metrics_port = ports
                self.state = "serving"
        return self.state == "serving"


def checkpoint_dir(run_dir: pathlib.Path) -> pathlib.Path:
    """Where a run's learners keep their checkpoints and claim their ids."""
    return run_dir / "checkpoints"


def learner_config(
    spec: LearnerSpec,
    cfg: UpConfig,
    run_dir: pathlib.Path,
    addresses: list[str],
    learner_id: str,
    status: pathlib.Path,
    push_log: pathlib.Path,
) -> LearnerConfig:
    """The settings of `spec`'s `atoll learner` (a standby's: learner_id its own, {id} in
    the paths), with its files in `run_dir`; `to_args()` is its command line."""
    syncing = spec.index >= 0  # the baseline trains alone
    checkpoints = syncing and cfg.checkpoint_every > 0
    return dataclasses.replace(
        cfg.learner_config(spec, addresses),
        learner_id=learner_id,
        status_file=status,
        push_log=push_log if syncing else None,
        checkpoint_dir=checkpoint_dir(run_dir) if checkpoints else None,
        compile_cache=compile_cache(run_dir),
    )


def compile_cache(run_dir: pathlib.Path) -> pathlib.Path:
    """Where a run's learners keep compiled programs, so restarts load instead of compile:
    the run folder's own, or one shared by several runs where ATOLL_COMPILE_CACHE names it
    (the learners' own default: runs of one model then compile once, not once per run)."""
    shared = os.environ.get(ENV_COMPILE_CACHE, "")
    return pathlib.Path(shared) if shared else run_dir / "compile-cache"


class LearnerProcess(Child):
    """`atoll learner` (or the data-parallel baseline) and its status file."""

    def __init__(
        self, spec: LearnerSpec, cfg: UpConfig, run_dir: pathlib.Path, addresses: list[str]
    ):
        self.spec = spec
        self.status = progress.StatusFile(run_dir / "learners" / f"{spec.name}.jsonl")
        self.push_log = run_dir / "learners" / f"{spec.name}.pushes.jsonl"
        self.status.poll()
        self.state = "waiting"  # waiting, starting, then the records' joining/training/done/stopped, or crashed
        self.stepped = False  # this process wrote a training record (took a step)
        self.eval_loss: float | None = None
        self.life_start: float | None = None
        self.cfg, self.run_dir, self.addresses = cfg, run_dir, addresses
        baseline = spec.index < 0
        # the baseline runs alone, after the learners: let it use every core
        super().__init__(
            spec.name,
            "baseline" if baseline else "learner",
            [],  # made at each start, from `config`
            run_dir / "logs" / f"{spec.name}.log",
            single_thread=not baseline,
        )

    @property
    def config(self) -> LearnerConfig:
        """This learner's settings; its command line is their `to_args()`."""
        return learner_config(
            self.spec,
            self.cfg,
            self.run_dir,
            self.addresses,
            self.name,
            self.status.path,
            self.push_log,
        )

    def start(self, pids: PidFile) -> None:
        self.args = ["learner", *self.config.to_args()]
        super().start(pids)
        self.stepped = False

    def take_over(self, standby: Standby) -> None:
        """From now on this learner is the process of `standby`, which took over its id."""
        self.proc, self.log_path, self.log_offset = (
            standby.proc,
            standby.log_path,
            standby.log_offset,
        )
        self.state, self.stepped, self.stop_sent = "starting", False, False

    @property
    def finished(self) -> bool:
        last = self.status.last
        return (
            last is not None
            and last.get("state") == "done"
            and last.get("step", 0) >= self.spec.steps
        )

    def update(self) -> None:
        for r in self.status.poll():
            if r.get("state") == "joining":
                self.life_start = r["time"]
            if r.get("eval_loss") is not None:
                self.eval_loss = r["eval_loss"]
            if r.get("state") == "training":
                self.stepped = True
            if self.state not in ("crashed", "killed"):
                self.state = r.get("state", self.state)

    def row(self) -> dict[str, Any]:
        r = self.status.last
        training = (r["time"] - self.life_start) if r and self.life_start else None
        return {
            "name": self.name,
            "state": self.state,
            "steps": self.spec.steps,
            "record": r,
            "eval_loss": self.eval_loss,
            "training_seconds": training,
        }


class Standby(Child):
    """`atoll learner --standby`: compiled and waiting to take over a failed learner's id."""

    READY = "ready (compiled"  # the standby's log line once it waits

    def __init__(
        self,
        name: str,
        spec: LearnerSpec,
        cfg: UpConfig,
        run_dir: pathlib.Path,
        addresses: list[str],
    ):
        status = run_dir / "learners" / "{id}.jsonl"
        push_log = run_dir / "learners" / "{id}.pushes.jsonl"
        config = learner_config(spec, cfg, run_dir, addresses, name, status, push_log)
        args = ["learner", *dataclasses.replace(config, standby=True).to_args()]
        super().__init__(name, "standby", args, run_dir / "logs" / f"{name}.log")

    def ready(self) -> bool:
        return self.READY in self.output()
