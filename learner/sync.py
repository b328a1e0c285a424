"""The learner's side of Decoupled DiLoCo (docs/design.md §1): `Synchronizer` drives
one learner's fragments against the shards, composed of

- routing (learner/routing.py): which shard owns each fragment, following moves;
- the schedule (learner/schedule.py): push due, run-ahead, take-the-next-round, as pure
  functions of the learner's one clock (`clock`, injected: tests pass a fake one);
- per-fragment state and its sync task (learner/fragment_sync.py): push, wait, pull,
  adopt;
- the versions the shards announce (learner/watch.py): Watch streams, waits on a round.

Fragment p first syncs at step t_p, the offsets spread over the period; after that every
learner pushes on the fragment's one wall-clock schedule, which the shard names with
each answer (dynamic local updates, arXiv 2401.09135). At a sync point the training
thread only copies θ_p; a background task pushes and pulls, and the training thread
adopts its result τ steps later at the first step boundary where it is done. It blocks
only when the round is RUN_AHEAD_PERIODS late, or, with synchronous semantics
(`wait_for_rounds`), τ steps after the push (see `schedule.decide_adopt`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from atoll.learner import schedule
from atoll.learner.defaults import SyncConfig
from atoll.learner.fragment_sync import FragmentSync, Link, Pace
from atoll.learner.routing import (
    ASK_OTHERS_AFTER,
    MAX_SHARDS,
    PROBE_SECONDS,
    RETRYABLE,
    PlanMismatch,
    Router,
    SyncError,
    plan_difference,
)
from atoll.learner.schedule import (
    RUN_AHEAD_PERIODS,
    STEP_WARMUP,
    STEP_WINDOW,
    StepTimer,
    offsets,
    steps_per_period,
    sync_due,
)
from atoll.learner.stopping import Stopped
from atoll.learner.watch import Versions
from atoll.wire import codec
from atoll.wire.client import ShardClient
from atoll.wire.plan import FragmentMap, FragmentPlan

# the synchronizer, its settings and errors; the rest are the names this module had
# before routing and the schedule got modules of their own, kept for their callers
__all__ = [
    "Synchronizer",
    "SyncConfig",
    "SyncError",
    "PlanMismatch",
    "plan_difference",
    "Params",
    "offsets",
    "steps_per_period",
    "sync_due",
    "StepTimer",
    "STEP_WINDOW",
    "STEP_WARMUP",
    "RUN_AHEAD_PERIODS",
    "MAX_SHARDS",
    "ASK_OTHERS_AFTER",
    "PROBE_SECONDS",
    "RETRYABLE",
]
log = logging.getLogger("atoll.learner")
Params = dict[str, Any]  # nested str-keyed dict of arrays, the model's parameter tree
T = TypeVar("T")


class Synchronizer:
    """Drives one learner's fragments against the shards.

    Call `join(params)` once (inits fragments that nobody has seeded, then pulls
    every fragment: a restarted learner rejoins at the current versions), then
    `after_step(step, params, ...)` after every inner step, which returns the new
    vectors of the fragments adopted ({p: vector}; `apply` puts them into a tree).

    `on_push`, if given, is called from a sync thread with one dict per answered push
    (fragment, seq, shard, accepted, reason, base and merged-in versions, the steps and
    compute seconds it carries): `atoll chaos` audits acknowledgements with it.

    `connect(i)`, if given, makes a client for shard i past `clients` (from a --shards
    pattern): shards a reshard brings in later are found by it (docs/resharding.md).

    `read_fragment(params, p)`, if given, reads fragment p of whatever the caller passes
    as `params` as a fresh float32 vector (default `plan.flatten_fragment`, for nested
    dicts): the public API (learner/api.py) passes any pytree, read only at sync points.

    `add_fragment(params, p, out)`, if given, adds fragment p of `params` into `out`
    in place, as `np.add(out, read_fragment(params, p), out=out)` would (an adoption
    builds on it; a sharded island adds box by box, reading no vector of its own).

    `fragment_sync(p, size, link)`, if given, makes fragment p's sync state and task (a
    learner sharded over several processes syncs each process's part of it,
    learner/sharded.py).

    `clock` is the one clock the schedule reads (monotonic seconds): due times, waits on
    rounds, the end-of-run deadline and the time the training thread spends blocked.

    Public reads: `seq` (pushes numbered so far), `pushes_started` (sync tasks started:
    the training loop times evaluations by it), `stats` (bytes, pushes, refusals,
    adoptions, blocked seconds), `versions()`, `standing()`, `frags` (each fragment's
    `FragmentSync`, read by checkpoints).
    """

    def __init__(
        self,
        cfg: SyncConfig,
        plan: FragmentPlan,
        clients: list[ShardClient],
        on_push: Callable[[dict[str, Any]], None] | None = None,
        connect: Callable[[int], ShardClient] | None = None,
        read_fragment: Callable[[Any, int], np.ndarray] | None = None,
        clock: Callable[[], float] = time.monotonic,
        fragment_sync: Callable[[int, int, Link], FragmentSync] = FragmentSync,
        add_fragment: Callable[[Any, int, np.ndarray], None] | None = None,
    ):
        self.cfg, self.plan, self.on_push, self.clock = cfg, plan, on_push, clock
        self.read_fragment: Callable[[Any, int], np.ndarray] = (
            read_fragment or plan.flatten_fragment
        )
        self.add_fragment = add_fragment or self._add_read
        self.stopping = threading.Event()
        self.router = Router(plan, clients, self.stopping, cfg.max_backoff, connect)
        self.published = Versions(
            self.router, self.stopping, cfg.max_backoff, clock, on_notice=self._noticed
        )
        self.pace = Pace()
        self.lock = threading.Lock()  # guards `stats`
        self.stats: dict[str, float] = {
            "bytes_sent": 0,
            "bytes_received": 0,
            "pushes": 0,
            "refused": 0,
            "resyncs": 0,
            "adopted": 0,
            "stalled": 0,
            "blocked_seconds": 0.0,
        }
        link = Link(cfg, plan, self.router, self.published, self.pace, self._count, clock, on_push)
        self.offsets = offsets(plan.num_fragments, cfg.period)
        self.frags = [
            fragment_sync(p, plan.fragment_sizes[p], link) for p in range(plan.num_fragments)
        ]
        self.pool = concurrent.futures.ThreadPoolExecutor(max(2, plan.num_fragments), "sync")
        self.seq = 0  # pushes so far; join() goes on from the newest seq the shards answered
        self.pushes_started = 0  # sync tasks started (the training loop times evaluations by it)
        self._step_timer = schedule.StepTimer.for_period(cfg.period)

    # --- routing, as the router has it ---

    @property
    def clients(self) -> list[ShardClient]:
        return self.router.clients

    @property
    def num_shards(self) -> int:
        return self.router.num_shards

    @property
    def connect(self) -> Callable[[int], ShardClient] | None:
        return self.router.connect

    @property
    def fragment_map(self) -> FragmentMap:
        return self.router.fragment_map

    @property
    def step_seconds(self) -> float:
        """This learner's seconds per inner step (StepTimer), boundary to boundary."""
        return self.pace.step_seconds

    @property
    def cadence_seconds(self) -> float | None:
        """The sync period the shards ask for; None until one answers with it."""
        return self.pace.cadence_seconds

    @property
    def latest(self) -> dict[int, int]:
        """Newest version each fragment is known to have (Watch)."""
        return self.published.latest

    def client_of(self, p: int) -> ShardClient:
        return self.router.client_of(p)

    def client(self, i: int) -> ShardClient:
        return self.router.client(i)

    def shard_of(self, p: int) -> int:
        """The shard that owns fragment p, by the newest fragment map seen."""
        return self.router.shard_of(p)

    def check_shards(self) -> set[int]:
        """`Router.check_shards`: checks the shards, routes by their map; the seeded fragments."""
        return self.router.check_shards()

    def call_shard(self, call: Callable[[], T], what: str = "a call to a shard") -> T:
        return self.router.call_shard(call, what)

    def _retry(self, call: Callable[[], T], what: str, fragment: int = -1) -> T:
        return self.router.retry(call, what, fragment)

    def _follow(self, new: FragmentMap, joining: bool = False) -> None:
        self.router.follow(new, joining)

    def _moved(self, p: int, e: Any) -> bool:
        return self.router.moved(p, e)

    # --- joining ---

    def join(self, params: Params) -> Params:
        """Seeds unseeded fragments with `params`, then adopts every fragment's current version."""
        return self.apply(params, dict(enumerate(self.join_fragments(params))))

    def join_fragments(self, params: Any) -> list[np.ndarray]:
        """`join`, returning every fragment's current global vector (fresh copies) rather
        than a tree; `params` is read with `read_fragment`.

        Bounded by `cfg.join_timeout`, every call and retry together (each call has its
        own deadline too): past it the synchronizer is stopped and SyncError names the
        shards and the bound; a shard that never answers would otherwise be retried
        forever."""
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            self.stop()

        timer = threading.Timer(self.cfg.join_timeout, expire)
        timer.daemon = True
        timer.start()
        try:
            return self._join_fragments(params)
        except Stopped:
            if not expired.is_set():
                raise
            addresses = ", ".join(c.address for c in self.router.clients)
            raise SyncError(
                f"join: the shards at {addresses} did not all answer within "
                f"join_timeout={self.cfg.join_timeout:g} s: check that they run and that "
                "this host reaches them at those addresses (the log's retry lines give each "
                "call's error), or give a longer join_timeout"
            ) from None
        finally:
            timer.cancel()

    def _join_fragments(self, params: Any) -> list[np.ndarray]:
        seeded = self.router.check_shards()
        vectors = [self.read_fragment(params, p) for p in range(self.plan.num_fragments)]
        for p, vector in enumerate(vectors):
            if p in seeded:  # someone seeded it already: no need to offer our copy
                continue
            frame = codec.encode(vector, codec.Codec.FP32)
            answer = self.router.retry(
                lambda: self.router.client_of(p).init(self.plan, p, frame, codec.Codec.FP32),
                f"init fragment {p}",
                fragment=p,
            )
            self._count("bytes_sent", len(frame))
            if answer.created:
                log.info("seeded fragment %d on shard %d", p, self.shard_of(p))
        for p, frag in enumerate(self.frags):
            vectors[p], last_seq = frag.join()
            # a restarted learner's seqs go on from its newest answered push: no clock involved
            self.seq = max(self.seq, last_seq)
        self.published.start()
        return vectors

    def _noticed(self, p: int, version: int) -> bool:
        """A Watch heard of `version` of fragment p; False once the learner is going away."""
        frag = self.frags[p]
        if frag.due_at is None and frag.last_sync_step is None and not self.stopping.is_set():
            # joined before the fragment had a schedule: a round has closed since, so the
            # shard has one now; learn it rather than push on step counts
            try:
                self.pool.submit(frag.learn_schedule, version)
            except RuntimeError:  # the pool shut down: this learner is stopping
                return False
        return True

    # --- the step hook ---

    def after_step(
        self,
        step: int,
        params: Any,
        step_seconds: float,
        tokens_per_step: int,
        final: bool = False,
    ) -> dict[int, np.ndarray]:
        """Adopts finished syncs, starts due ones; `step` counts inner steps done since join.
        `final`: the run's last step; a push it starts is this learner's last of that
        fragment (see `finish`, which pushes the others' tails).
        Returns {fragment: new vector} for the fragments whose tensors the caller must replace."""
        pace, cfg = self.pace, self.cfg
        pace.step_seconds = self._step_timer.add(step, step_seconds)
        pace.reported_seconds = self._step_timer.measured
        updates: dict[int, np.ndarray] = {}
        now, cadence = self.clock(), pace.cadence_seconds
        per_period = steps_per_period(cfg.period, cadence, pace.step_seconds, cfg.wait_for_rounds)
        for frag in self.frags:
            frag.compute += step_seconds
            if frag.task is not None:
                adopt, _ = schedule.decide_adopt(
                    step=step,
                    task_step=frag.task_step,
                    done=frag.task.done(),
                    overlap=cfg.overlap,
                    per_period=per_period,
                    wait_for_rounds=cfg.wait_for_rounds,
                )
                if adopt:
                    if not frag.task.done():  # the only place a learner blocks
                        started = self.clock()
                        concurrent.futures.wait([frag.task])
                        self._count("blocked_seconds", self.clock() - started)
                    self._adopt(frag, step, params, updates)
            if frag.task is None:
                push, frag.due_at, _ = schedule.decide_push(
                    step=step,
                    first_step=self.offsets[frag.p],
                    last_sync_step=frag.last_sync_step,
                    due_at=frag.due_at,
                    now=now,
                    period=cfg.period,
                    cadence_seconds=cadence,
                    step_seconds=pace.step_seconds,
                    wait_for_rounds=cfg.wait_for_rounds,
                )
                if push:
                    self._start_push(frag, step, params, updates, tokens_per_step, final)
        return updates

    def _start_push(
        self,
        frag: FragmentSync,
        step: int,
        params: Any,
        updates: dict[int, np.ndarray],
        tokens_per_step: int,
        last: bool = False,
    ) -> None:
        """Starts fragment p's sync task: push θ_p's progress since its last push (θ_p as
        just adopted, if `updates` holds it), wait for its round, pull."""
        theta = self.theta_to_push(params, frag.p, updates)
        self.seq += 1
        self.pushes_started += 1
        frag.start(self.pool, theta, step, self.seq, tokens_per_step, last)

    def _adopt(
        self,
        frag: FragmentSync,
        step: int,
        params: Any,
        updates: dict[int, np.ndarray],
    ) -> None:
        p = frag.p
        updates[p] = frag.adopt(step, functools.partial(self.add_theta, params, p, updates))
        self._count("adopted", 1)

    def theta_to_push(self, params: Any, p: int, updates: dict[int, np.ndarray]) -> np.ndarray:
        """θ_p as the caller will hold it (as adopted in this call, if `updates` holds it),
        the push task's own: the task writes over it, so one adopted in this call is
        copied (the caller's new leaves are built from it; on CPU devices they may be its
        memory), one read from `params` is the task's alone already."""
        theta = updates.get(p)
        return self.read_fragment(params, p) if theta is None else theta.copy()

    def add_theta(
        self, params: Any, p: int, updates: dict[int, np.ndarray], out: np.ndarray
    ) -> None:
        """`out += θ_p` as the caller will hold it (as adopted earlier in this call, if
        `updates` holds it: `finish`), bit for bit."""
        if p in updates:
            np.add(out, updates[p], out=out)
        else:
            self.add_fragment(params, p, out)

    def _add_read(self, params: Any, p: int, out: np.ndarray) -> None:
        np.add(out, self.read_fragment(params, p), out=out)

    def finish(
        self, step: int, params: Any, timeout: float, tokens_per_step: int | None = None
    ) -> dict[int, np.ndarray]:
        """At the end of a run: pushes each fragment's steps since its last push (once the
        fragment's sync in flight, if any, is adopted) and adopts those rounds, all within
        `timeout` s.

        Without the last pushes the global model would never hold the run's tail: up to
        a period of each learner's last steps per fragment, the lowest-lr ones of its
        schedule. A round that has not closed by the deadline still holds the push (it
        is durable). These pushes are marked `last`: the shards stop waiting for this
        learner in those fragments' rounds, so the last learner to finish closes its round
        alone rather than waiting for the leases of those that left.
        `tokens_per_step` None: no tail pushes (the old end of run). A stop ends it at
        once with what was adopted so far."""
        deadline = self.clock() + timeout
        updates: dict[int, np.ndarray] = {}
        try:
            self._finish(step, params, deadline, tokens_per_step, updates)
        except Stopped:
            log.info("stopped before the last pushes were adopted (an acknowledged one is kept)")
        return updates

    def _finish(
        self,
        step: int,
        params: Any,
        deadline: float,
        tokens_per_step: int | None,
        updates: dict[int, np.ndarray],
    ) -> None:
        """`finish`'s loop; what it adopts goes into `updates`."""
        while not self.stopping.is_set():
            # Each fragment's tail goes out as soon as that fragment is idle, not once all
            # are: a round holding one of our pushes may wait for another learner's tail,
            # which waits on a round that needs ours.
            for frag in self.frags:
                if frag.task is not None and frag.task.done():
                    self._adopt(frag, step, params, updates)
                if (
                    tokens_per_step is not None
                    and frag.task is None
                    and step > (frag.last_sync_step or 0)
                ):
                    self._start_push(frag, step, params, updates, tokens_per_step, last=True)
            pending = [f.task for f in self.frags if f.task is not None]
            left = deadline - self.clock()
            if not pending or left <= 0:
                return
            concurrent.futures.wait(
                pending, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED
            )

    # --- reading ---

    def versions(self) -> dict[int, tuple[int, int]]:
        """{fragment: (adopted version, newest known version)}."""
        return {f.p: (f.version, self.published.newest(f.p, f.version)) for f in self.frags}

    def standing(self) -> tuple[int, int]:
        """(oldest adopted version, worst lag): the figures a progress line shows."""
        versions = self.versions().values()
        return min(v for v, _ in versions), max(latest - v for v, latest in versions)

    def apply(self, params: Params, vectors: dict[int, np.ndarray]) -> Params:
        """`params` with the given fragments' tensors replaced (a new tree; leaves not copied)."""
        flat: dict[str, Any] = {}
        for p, vector in vectors.items():
            flat.update(self.plan.unflatten_fragment(p, vector))
        return _replace(params, flat, "")

    def _count(self, key: str, amount: float) -> None:
        with self.lock:
            self.stats[key] += amount

    # --- ending ---

    def stop(self) -> None:
        """Ends every wait at once, from any thread: the channels close (calls in flight
        end CANCELLED, not at their deadline), and retries, waits on rounds and Watch
        threads stop with `Stopped`. Final: `close()` is all that is left to call."""
        self.stopping.set()
        self.router.close()
        self.published.wake()

    def close(self) -> None:
        self.stop()
        self.pool.shutdown(wait=True, cancel_futures=True)


def _replace(tree: Params, flat: dict[str, Any], prefix: str) -> Params:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out[key] = (
            _replace(value, flat, name + "/") if isinstance(value, dict) else flat.get(name, value)
        )
    return out
