"""The processes of one `atoll chaos` run and the failures it injects into them.

`ChaosSession` is an `atoll up` session (atoll/local/session.py) that kills its learners
on a `FailureSchedule` (a Poisson process per learner) and its shards at given times, and
restarts them, or hands a killed learner's id to a standby; atoll/faults/chaos.py runs it
and accounts for what the run kept.
"""

from __future__ import annotations

import pathlib
import signal
import time
from collections.abc import Sequence
from typing import Any, Protocol, TextIO

import numpy as np

from atoll.local.config import LearnerSpec, UpConfig, learner_specs
from atoll.local.processes import (
    Child,
    LearnerProcess,
    ShardProcess,
    Standby,
    checkpoint_dir,
    stop_children,
)
from atoll.local.session import SHARD_START_SECONDS, Session


class Failures(Protocol):
    """What a session reads of its ChaosConfig (atoll/faults/chaos.py, which imports this
    module), each setting documented there; read-only, as the frozen config is."""

    @property
    def duration(self) -> float: ...
    @property
    def mtbf(self) -> float: ...
    @property
    def restart_delay(self) -> float: ...
    @property
    def shard_kill_at(self) -> tuple[float, ...]: ...
    @property
    def shard_restart_delay(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def standby_ready_wait(self) -> float: ...


class Regions(Protocol):
    """The WAN regions a session's learners run in (RegionsPerRun, atoll/faults/chaos.py):
    learner i runs in region i mod `regions`, started once the shards' ports are known."""

    regions: int

    def start(self, shard_ports: list[int]) -> None: ...
    def describe(self) -> str: ...
    def command_prefix(self, region: int) -> list[str]: ...
    def shard_addresses(self, region: int) -> list[str]: ...


class FailureSchedule:
    """Kill times per learner (seconds since the learners started): a Poisson process each,
    from its own stream of `seed`, so every run of one chaos command meets the same ones."""

    def __init__(self, seed: int, learners: int, mtbf: float):
        self._rngs = [np.random.default_rng([seed, i]) for i in range(learners)]
        self._next = [float(rng.exponential(mtbf)) for rng in self._rngs]
        self.mtbf = mtbf

    def due(self, learner: int, elapsed: float) -> bool:
        """True once per kill time passed (and consumes it); times that passed together count once."""
        if elapsed < self._next[learner]:
            return False
        while self._next[learner] <= elapsed:
            self._next[learner] += float(self._rngs[learner].exponential(self.mtbf))
        return True


class ChaosSession(Session):
    """An `atoll up` session that kills and restarts its own children on a schedule."""

    def __init__(
        self,
        cfg: UpConfig,
        chaos: Failures,
        run_dir: pathlib.Path,
        out: TextIO,
        inject: bool,
        wan: Regions | None = None,
        restart_all: bool = False,
        standbys: int = 0,
        token_budget: int | None = None,
    ):
        super().__init__(cfg, run_dir, out, live=False)
        self.chaos, self.inject, self.wan = chaos, inject, wan
        self.restart_all = (
            restart_all  # checkpoint-restart: one learner's failure takes down every learner
        )
        self.token_budget = (
            token_budget  # stop once the learners trained this many tokens (equal-token runs)
        )
        self.standbys = standbys  # spares kept: each killed learner's id goes to one, its machine returns as one
        self.spares: list[Standby] = []  # standby processes holding no id yet
        self.spares_started = 0
        self.spare_at: list[
            float
        ] = []  # when to start another spare (a killed learner's machine is back)
        self.handover: dict[
            str, float
        ] = {}  # learner name -> when it was killed, until a standby has its id
        self.schedule = FailureSchedule(chaos.seed, cfg.learners, chaos.mtbf)
        self.t0: float | None = None  # the failure clock's start: every learner training
        self.end: float | None = None  # when the duration was up
        self.restart_at: dict[str, float] = {}  # learner name -> when to start it again
        self.shard_back_at: dict[int, float] = {}  # killed shard -> when to restart it
        self.shards_down = False  # the session is stopping its shards: none is restarted
        self.shard_kills_left = sorted(chaos.shard_kill_at)
        self.kills: list[dict[str, Any]] = []  # every SIGKILL: time, who, step
        self.restarts: list[dict[str, Any]] = []  # every restart: time, who
        self.samples: list[tuple[float, int]] = []  # (time, sum of global versions)

    # -- hooks into the session --

    def _start_shards(self) -> None:
        super()._start_shards()
        if self._running() and self.wan is not None:
            ports = [s.port for s in self.shards]
            assert all(p is not None for p in ports), "the shards of a running session serve"
            self.wan.start([p for p in ports if p is not None])
            self.say(f"WAN: {self.wan.describe()}")

    def _addresses_for(self, spec: LearnerSpec) -> list[str]:
        if self.wan is None:
            return super()._addresses_for(spec)
        return self.wan.shard_addresses(spec.index % self.wan.regions)

    def _prefix_for(self, spec: LearnerSpec) -> list[str]:
        return [] if self.wan is None else self.wan.command_prefix(spec.index % self.wan.regions)

    def _start_learners(self) -> None:
        super()._start_learners()
        for _ in range(self.standbys):
            self._start_spare()

    def _start_spare(self) -> None:
        name = f"standby-{self.spares_started}"
        spec = learner_specs(self.cfg)[self.spares_started % self.cfg.learners]
        spare = Standby(name, spec, self.cfg, self.run_dir, self._addresses_for(spec))
        spare.prefix = self._prefix_for(spec=spec)
        spare.start(self.pids)
        self.spares.append(spare)
        self.spares_started += 1

    def _tokens(self) -> int:
        """Tokens the learners trained so far (each at its newest status record)."""
        return sum(int((l.status.last or {}).get("tokens", 0)) for l in self.learners)

    def _spares_ready(self) -> bool:
        waited = time.time() - (self.learners_started or time.time())
        return (
            all(s.ready() or not s.alive() for s in self.spares)
            or waited > self.chaos.standby_ready_wait
        )

    def _stop(self, children: Sequence[Child], seconds: float) -> None:
        learners = any(isinstance(c, LearnerProcess) for c in children)
        if any(isinstance(c, ShardProcess) for c in children):
            self.shards_down = True  # from now on a killed shard stays down
        if self.spares and learners:
            spares, self.spares = (
                self.spares,
                [],
            )  # before the learners: a stopped learner's id is not taken
            stop_children([*spares], seconds, self.hurry)
        super()._stop(children, seconds)
        if learners and not self.shards_down:
            self._shards_back()

    def _shards_back(self) -> None:
        """Before the global model is read: every killed shard restarted and serving (a
        shard killed near the end may still be down or recovering)."""
        deadline = time.monotonic() + SHARD_START_SECONDS
        while self.shard_back_at and self._running() and time.monotonic() < deadline:
            for s in self.shards:
                s.check_serving()
            self._restart_shards(time.time())
            self.wake.wait(0.1)

    def _learners_busy(self) -> bool:
        # a run stopped by tokens goes past the duration (up to 3x) to reach them
        limit = self.chaos.duration * (3 if self.token_budget is not None else 1)
        if self.t0 is not None and time.time() >= self.t0 + limit:
            if self.end is None:
                self.end = time.time()
                self.say(f"chaos: {limit:g} s on the failure clock are up; stopping the learners")
            return False
        if (
            self.t0 is not None
            and self.token_budget is not None
            and self._tokens() >= self.token_budget
        ):
            if self.end is None:
                self.end = time.time()
                self.say(
                    f"chaos: the learners trained {self.token_budget:,} tokens, as many as the run compared "
                    "with; stopping them"
                )
            return False
        return bool(self.restart_at) or bool(self.handover) or super()._learners_busy()

    def _learner_exited(self, l: LearnerProcess) -> None:
        if l.name not in self.restart_at and l.name not in self.handover:  # not one of ours
            super()._learner_exited(l)

    def _shard_exited(self, s: ShardProcess) -> None:
        if s.index not in self.shard_back_at:
            super()._shard_exited(s)

    def _tick(self, draw: bool = True) -> None:
        if (
            self.t0 is None
            and self.learners
            and all(l.state == "training" for l in self.learners)
            and self._spares_ready()
        ):
            self.t0 = time.time()
            self.say(
                f"chaos: every learner is training; the failure clock starts ({self.chaos.duration:g} s)"
            )
        if self.inject and self.t0 is not None and self._running():
            self.inject_failures(time.time())
        super()._tick(draw)
        if self._metrics:
            self.samples.append(
                (time.time(), sum(sum(m["versions"].values()) for m in self._metrics.values()))
            )

    # -- failures --

    def inject_failures(self, now: float) -> None:
        """One tick's failures at wall time `now`: the learner and shard kills due, standby
        hand-overs, and restarts of what was killed once its delay has passed."""
        assert self.t0 is not None, "failures are injected once the failure clock runs"
        elapsed = now - self.t0
        kills = self.end is None  # once the duration is up, only restarts of what was killed
        for i, l in enumerate(self.learners):
            if (
                kills
                and self.schedule.due(i, elapsed)
                and l.alive()
                and not l.finished
                and l.state != "done"
            ):
                victims = self.learners if self.restart_all else [l]
                for v in victims:
                    if v.alive() and not v.finished:
                        self._kill_learner(v, now, cause=l.name)
        self._hand_over(now)
        while self.spare_at and now >= self.spare_at[0]:
            self.spare_at.pop(0)
            self._start_spare()
            self.say(f"chaos: a killed learner's machine is back as {self.spares[-1].name}")
        for l in self.learners:
            if l.name in self.restart_at and now >= self.restart_at[l.name] and not l.alive():
                del self.restart_at[l.name]
                l.status.poll()
                if l.finished:
                    continue
                l.start(self.pids)
                l.state = "starting"
                self.restarts.append({"time": now, "learner": l.name})
                self.say(f"chaos: restarted {l.name}")
        while kills and self.shard_kills_left and elapsed >= self.shard_kills_left[0]:
            self.shard_kills_left.pop(0)
            s = self.shards[len(self.shard_back_at) % len(self.shards)] if self.shards else None
            if (
                s is not None
                and s.proc is not None
                and s.alive()
                and s.index not in self.shard_back_at
            ):
                s.proc.send_signal(signal.SIGKILL)
                s.proc.wait()
                self.shard_back_at[s.index] = now + self.chaos.shard_restart_delay
                self.kills.append({"time": now, "shard": s.index})
                self.say(
                    f"chaos: SIGKILL shard {s.index}; back in {self.chaos.shard_restart_delay:g} s"
                )
        self._restart_shards(now)

    def _restart_shards(self, now: float) -> None:
        """Restarts each killed shard once its delay is up, until the shards are stopped."""
        for index, back in list(self.shard_back_at.items()):
            s = self.shards[index]
            if now >= back and not s.alive() and s.state != "restarting" and not self.shards_down:
                s.restart(self.pids)
                self.say(f"chaos: restarted shard {index} on port {s.port}")
            if s.state == "serving" and s.alive() and s.restarts > 0:
                del self.shard_back_at[index]

    def _kill_learner(self, l: LearnerProcess, now: float, cause: str) -> None:
        l.update()
        step = (l.status.last or {}).get("step", 0)
        started = time.time()
        assert l.proc is not None, "only a live learner is killed"
        l.proc.send_signal(signal.SIGKILL)
        l.proc.wait()
        # the kill's time is when the process is gone: `now` came earlier in the tick, and
        # a push the learner logged in between would look like one made after the kill
        now += time.time() - started
        l.state = "killed"
        self.kills.append({"time": now, "learner": l.name, "step": step, "cause": cause})
        if self.standbys:
            # a standby takes the id over; the killed learner's machine comes back as a spare
            self.handover[l.name] = now
            self.spare_at.append(now + self.chaos.restart_delay)
            self.say(f"chaos: SIGKILL {l.name} at step {step}; a standby takes over")
            return
        self.restart_at[l.name] = now + self.chaos.restart_delay
        self.say(
            f"chaos: SIGKILL {l.name} at step {step}"
            + (f" (with {cause})" if cause != l.name else "")
            + f"; back in {self.chaos.restart_delay:g} s"
        )

    def _hand_over(self, now: float) -> None:
        """A killed learner whose id a standby has claimed is that standby's process from now on."""
        from atoll.learner.standby import holder

        for spare in [s for s in self.spares if not s.alive()]:
            self.spares.remove(spare)
            self.say(
                f"chaos: {spare.name} exited with status {spare.returncode}; its log ends:",
                spare.tail(),
            )
        for name, killed in list(self.handover.items()):
            pid = (holder(checkpoint_dir(self.run_dir), name) or {}).get("pid")
            taker = next((s for s in self.spares if s.proc is not None and s.proc.pid == pid), None)
            if taker is None:
                continue
            self.spares.remove(taker)
            del self.handover[name]
            learner = next(l for l in self.learners if l.name == name)
            learner.take_over(taker)
            self.restarts.append({"time": now, "learner": name, "standby": taker.name})
            self.say(f"chaos: {taker.name} took over {name} {now - killed:.1f} s after its kill")
