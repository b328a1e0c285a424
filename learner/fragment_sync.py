"""One fragment's sync state and the task that syncs it (docs/design.md §1).

At a sync point the training thread only copies θ_p (`FragmentSync.start`); the task,
on a sync thread, forms the outer gradient Δ = Θ_p(base) − θ_p, adds the
error-feedback residual, encodes it, pushes it (retrying the same seq until
acknowledged: pushes are idempotent), waits until a version holding it is published
(Watch), and pulls the deltas that take its exact copy of Θ_p there. From step t + τ on,
at the first step boundary where the task is done, the training thread adopts
(`FragmentSync.adopt`)

    θ_p ← θ_p + (1−α)·(Θ_new − θ_p(t))

that is, the new global fragment plus whatever the τ overlapped steps added (α = 0),
or a mix with the local weights (α > 0). α is `mix`, or, with `late_mix` set and the
result adopted d steps after the push, (d − τ)/H where that is more, up to `late_mix`:
a learner whose syncs come back late (a slow link, a round held open for stragglers)
keeps more of its own fragment (docs/rounds.md, "Late adoption").

A push refused as too stale, or one in a round that already holds this learner,
resyncs the fragment instead: θ_p ← Θ_current, residual dropped. A learner that gave
up waiting on a round (its push is in it, but the round did not close) measures its
next outer gradient from θ_p at that push, so the same steps are never sent twice.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable
from typing import Any, cast

import grpc
import numpy as np

from atoll.learner import schedule
from atoll.learner.defaults import SyncConfig
from atoll.learner.routing import Router
from atoll.learner.stopping import Stopped
from atoll.learner.watch import Versions
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import IncompletePull, Pulled
from atoll.wire.plan import FragmentPlan

log = logging.getLogger("atoll.learner")


@dataclasses.dataclass
class Pace:
    """What every fragment's schedule follows, written by the training thread (step
    time) and by sync tasks (cadence)."""

    step_seconds: float = 0.0  # this learner's seconds per inner step (StepTimer)
    # what pushes report as the step time: StepTimer.measured, 0.0 (not known) until a
    # counted step is in, so a compile step never sets the shards' cadence
    reported_seconds: float = 0.0
    cadence_seconds: float | None = None  # the sync period the shards ask for


@dataclasses.dataclass
class Link:
    """What the fragments of one learner share: settings, routing, versions, the clock."""

    cfg: SyncConfig
    plan: FragmentPlan
    router: Router
    versions: Versions
    pace: Pace
    count: Callable[[str, float], None]  # adds to one of the learner's stats
    clock: Callable[[], float]  # the learner's monotonic clock, the schedule's `now`
    on_push: Callable[[dict[str, Any]], None] | None = None  # each answered push, described


@dataclasses.dataclass
class Outcome:
    """What a finished sync task hands the training thread."""

    version: int
    correction: np.ndarray | None  # Θ_new − θ_p(t): (1 − α)× it is added to θ_p (adopt), or
    # None with `values` set (resync)
    values: np.ndarray | None = None
    due_at: float | None = None  # when the next push of the fragment is due; None: not known


class FragmentSync:
    """Fragment p's sync state and its sync task; the task and the training thread take
    turns (the training thread touches the state only while no task runs)."""

    def __init__(self, p: int, size: int, link: Link):
        self.p, self.link = p, link
        self.version = 0  # the global version adopted
        self.base: np.ndarray = np.zeros(size, np.float32)  # Θ_p at `version`, bit-exact
        self.ef = codec.ErrorFeedback(size, link.cfg.codec)
        self.last_sync_step: int | None = None  # the step of the last push
        self.due_at: float | None = None  # when the next push is due (link.clock), from the shard
        self.origin: np.ndarray | None = None  # what the next Δ is measured from, if not `base`
        # seconds of inner steps since the last sync (what the next push carries)
        self.compute = 0.0
        self.task: concurrent.futures.Future[Outcome] | None = None
        self.task_step = 0  # the step the in-flight task was started at

    # --- on the training thread ---

    def join(self) -> tuple[np.ndarray, int]:
        """Takes the fragment's current global version (and when to push it first);
        returns a copy of it and the newest seq its shard answered for this learner."""
        pulled = self.pull(None)
        self.base = codec.decode(pulled.frames[0][2], num_values=self.base.size).copy()
        self.version = pulled.version
        # push the first one in step with the others
        self.due_at = schedule.due_after(self.link.clock(), pulled.next_due_seconds)
        self.link.versions.note(self.p, self.version)
        return self.base.copy(), pulled.last_seq

    def start(
        self,
        pool: concurrent.futures.Executor,
        theta: np.ndarray,
        step: int,
        seq: int,
        tokens_per_step: int,
        last: bool = False,
    ) -> None:
        """Starts the sync task of push `seq`: θ_p's progress since the last push.
        `theta` is the task's own from here on (it writes over it): the caller passes a
        vector nobody else reads or writes (`Synchronizer._start_push` copies one)."""
        steps = step - (self.last_sync_step or 0)
        self.last_sync_step = self.task_step = step
        compute, self.compute = self.compute, 0.0
        self.task = pool.submit(
            self.sync, theta, seq, steps, steps * tokens_per_step, compute, last
        )

    def adopt(self, step: int, add_theta: Callable[[np.ndarray], None]) -> np.ndarray:
        """Takes the finished task's result (waiting for it if need be); returns θ_p's
        new vector, built on θ_p as the caller holds it unless a resync: `add_theta(v)`
        adds that θ_p into v in place (`np.add(v, θ_p, out=v)`, bit for bit)."""
        assert self.task is not None
        outcome = self.task.result()
        self.task = None
        if outcome.correction is not None:
            keep = np.float32(1.0 - self.mix_at(step))
            # keep·correction + θ_now, bit for bit, written over the correction (the
            # outcome's own vector): no other vector of the fragment's size is made
            vector: np.ndarray = outcome.correction
            np.multiply(vector, keep, out=vector)
            add_theta(vector)
        else:
            assert outcome.values is not None
            vector = outcome.values
            self.last_sync_step = step
        self.version = outcome.version
        self.due_at = outcome.due_at
        return vector

    def mix_at(self, step: int) -> float:
        """α for adopting at `step` the sync started at `task_step`."""
        cfg = self.link.cfg
        late = (step - self.task_step - cfg.overlap) / cfg.period
        return max(cfg.mix, min(cfg.late_mix, late))

    # --- the task ---

    def sync(
        self,
        theta: np.ndarray,
        seq: int,
        steps: int,
        tokens: int,
        compute: float = 0.0,
        last: bool = False,
    ) -> Outcome:
        """Push, wait for the round holding it, pull: the background half of one sync.
        `theta` is the task's own: an adopted outcome's correction is written over it."""
        link = self.link
        ack, due_at = self._push(theta, seq, steps, tokens, compute, last)
        if not ack.accepted:
            # too stale, or a round already holding us: this contribution is lost; start over from Θ
            link.count("refused", 1)
            link.count("resyncs", 1)
            log.info(
                "fragment %d: push refused (%s: %s); resyncing",
                self.p,
                pb.PushReason.Name(ack.reason),
                ack.detail,
            )
            self.ef.reset()
            self.advance(None)
            self.origin = None
            return Outcome(self.version, None, self.base.copy(), self._due(due_at))
        merged_in = self.version + ack.staleness + 1  # the version that will hold this push
        patience = schedule.round_patience(
            link.cfg.patience, link.cfg.period, link.pace.step_seconds
        )
        if not link.versions.wait_for(self.p, merged_in, patience):
            # the round holding our push is stuck (its other members are blocked on us, or
            # gone but still holding leases): keep training on local weights rather than
            # wait on it; the next push finds us still in that round and resyncs
            link.count("stalled", 1)
            log.warning(
                "fragment %d: no version %d after %.0f s; going on without it",
                self.p,
                merged_in,
                patience,
            )
            self.origin = theta  # the round still holds the steps up to here
            return Outcome(self.version, np.zeros_like(theta), due_at=self._due(due_at))
        # without a schedule: a period after the round holding our push closed
        due_at = self._due(due_at)
        self.advance(merged_in)
        self.origin = None
        # Θ_new − θ written over θ (this task's own copy): no third vector of the fragment
        return Outcome(self.version, np.subtract(self.base, theta, out=theta), due_at=due_at)

    def _push(
        self, theta: np.ndarray, seq: int, steps: int, tokens: int, compute: float, last: bool
    ) -> tuple[pb.PushResponse, float | None]:
        """Encodes and pushes Δ; returns the answer and when the next push is due."""
        link, p = self.link, self.p
        # after giving up on a round that holds our last push, only what came since counts
        origin = self.base if self.origin is None else self.origin
        # Δ is written where the residual it leaves goes: no vector of Δ's own
        frame = self.ef.encode_written(lambda out: np.subtract(origin, theta, out=out))
        header = pb.PushHeader(
            fragment=p,
            base_version=self.version,
            seq=seq,
            inner_steps=max(1, steps),
            tokens=max(1, tokens),
            codec=cast(pb.Codec, int(link.cfg.codec)),
            num_params=theta.size,
            plan_fingerprint=link.plan.fingerprint,
            step_seconds=link.pace.reported_seconds,
            overlap_steps=link.cfg.overlap,
            period_steps=link.cfg.period,
            last=last,
        )
        sent = [link.clock()]  # when the answered attempt left

        def attempt() -> pb.PushResponse:
            sent[0] = link.clock()
            return link.router.client_of(p).push(header, frame)

        # a retry goes to p's owner by the newest map: the same seq, so a push that reached
        # the old owner first is answered once, from the state that moved with p
        ack = link.router.retry(attempt, f"push fragment {p}", fragment=p)
        if ack.cadence_seconds > 0:
            link.pace.cadence_seconds = ack.cadence_seconds
        # the fragment's schedule, from the shard (relative: no clock in common needed),
        # counted from when the push left (`schedule.due_after`)
        due_at = schedule.due_after(sent[0], ack.next_due_seconds)
        link.count("bytes_sent", len(frame))
        link.count("pushes", 1)
        if link.on_push is not None:
            link.on_push(
                {
                    "fragment": p,
                    "seq": seq,
                    "shard": link.router.shard_of(p),
                    "accepted": ack.accepted,
                    "reason": pb.PushReason.Name(ack.reason),
                    "base_version": self.version,
                    "merged_in": self.version + ack.staleness + 1 if ack.accepted else None,
                    "steps": max(1, steps),
                    "compute_seconds": compute,
                }
            )
        return ack, due_at

    def _due(self, due_at: float | None) -> float | None:
        return schedule.next_due(due_at, self.link.clock(), self.link.pace.cadence_seconds)

    def advance(self, at_least: int | None) -> None:
        """Brings `base` up to the newest version (>= at_least) by deltas, or a snapshot."""
        while True:
            pulled = self.pull(self.version)
            if pulled.snapshot:
                self.base = codec.decode(pulled.frames[0][2], num_values=self.base.size).copy()
            else:
                for _, frame_codec, frame in pulled.frames:
                    codec.decode_into(frame, self.base, 1.0, codec=frame_codec)
            self.version = pulled.version
            if at_least is None or self.version >= at_least:
                return
            self.link.versions.wait_for(self.p, at_least)

    def learn_schedule(self, have: int) -> None:
        """Asks the shard when this learner's first push of the fragment is due (a pull
        from the version just announced: no frames unless another round closed since)."""
        link, p = self.link, self.p
        sent = link.clock()
        try:  # one try: on failure the first push goes on step counts (t_p) instead
            pulled = link.router.call_shard(lambda: link.router.client_of(p).pull(p, have))
        except (grpc.RpcError, IncompletePull, Stopped):
            return
        link.count("bytes_received", sum(len(f) for _, _, f in pulled.frames))
        if pulled.next_due_seconds > 0 and self.due_at is None:
            self.due_at = schedule.due_after(sent, pulled.next_due_seconds)

    def pull(self, have: int | None) -> Pulled:
        link, p = self.link, self.p
        pulled = link.router.retry(
            lambda: link.router.client_of(p).pull(p, have), f"pull fragment {p}", fragment=p
        )
        link.count("bytes_received", sum(len(f) for _, _, f in pulled.frames))
        return pulled
