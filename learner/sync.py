"""The learner's side of Decoupled DiLoCo: when to push which fragment, and adopting
what comes back (docs/design.md §1).

Fragment p first syncs at step t_p = round((p+1)·H/P), the offsets spread over the
period so the link carries one fragment at a time. After that every learner keeps one
wall-clock cadence (dynamic local updates, arXiv 2401.09135): the shard tells it the
period T = H steps of the fastest live learners and, with each answer, when its next
push of fragment p is due on the fragment's schedule (rounds a period apart); the
learner pushes at the step boundary nearest that instant. A
fast island takes about H steps per sync, a 2× slower one about H/2, and all of them
push within a step of each other, so a round gathers one push per learner per period
(see `sync_due`). At a sync point the training thread only copies θ_p; a background task forms
the outer gradient Δ = Θ_p(base) − θ_p, adds the error-feedback residual, encodes it
to 4 bits, pushes it (retrying the same seq until acknowledged: pushes are
idempotent), waits until a version holding it is published (Watch), and pulls the
deltas that take its exact copy of Θ_p there. Training goes on meanwhile; from step
t + τ on, at the first step boundary where the task is done, the learner adopts

    θ_p ← θ_p + (1−α)·(Θ_new − θ_p(t))

that is, the new global fragment plus whatever the τ overlapped steps added (α = 0),
or a mix with the local weights (α > 0). It blocks only when the next sync point of
the same fragment comes before the task is done.

A push refused as too stale, or one in a round that already holds this learner,
resyncs the fragment instead: θ_p ← Θ_current, residual dropped. A learner that gave
up waiting on a round (its push is in it, but the round did not close) measures its
next outer gradient from θ_p at that push, so the same steps are never sent twice.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import numpy as np

from atoll.learner.defaults import CODEC, MIX, OVERLAP, PERIOD, SYNC_PATIENCE
from atoll.learner.stopping import Stopped
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import (
    FRAGMENT_KEY,
    MAP_VERSION_KEY,
    OWNER_KEY,
    IncompletePull,
    Pulled,
    ShardClient,
    described_map,
)
from atoll.wire.plan import FragmentMap, FragmentPlan

log = logging.getLogger("atoll.learner")
Params = dict  # nested str-keyed dict of arrays, the model's parameter tree
T = TypeVar("T")
RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


STEP_WINDOW = 128  # recent steps whose mean is this learner's step time (what the cadence follows)
STEP_WARMUP = 2  # the first steps after joining are not counted (they compile)
# Periods a fragment trains on while its push waits in an open round before the learner
# waits for that round: 2 lets a push that just missed a close (back one period plus a
# grace window later) go by without a stall.
RUN_AHEAD_PERIODS = 2
MAX_SHARDS = 1024  # the highest shard index a --shards pattern is expanded for
# Attempts of a call about a fragment whose shard does not answer before the learner asks
# the other shards whether the fragment moved (its old owner may be gone: a scale-down)
ASK_OTHERS_AFTER = 3
# Seconds a shard that may be gone (scaled away, not started yet) has to answer Describe
PROBE_SECONDS = 5.0


class SyncError(RuntimeError):
    """The syncer refused this learner for a reason retrying cannot fix; the message says which."""


class PlanMismatch(SyncError):
    """The shards serve another fragment plan than this learner's params make; the
    message names the first tensor that differs."""


def plan_difference(
    run: dict[str, tuple[tuple[int, ...], bool, int]], run_fragments: int, plan: FragmentPlan
) -> str:
    """The first difference between the run's tensors and `plan`'s, in words.

    Args:
      run: {tensor name: (shape, embedding, fragment)} as the shards describe them (the
        fragments of shards that did not answer are missing).
      run_fragments: P of the run.
      plan: this learner's plan.

    Returns:
      A sentence naming the first tensor, in name order, that differs.

    Example:
      >>> plan = FragmentPlan.build({"a": np.zeros(4), "b": np.zeros(2)}, 1)
      >>> plan_difference({"a": ((4,), False, 0), "b": ((3,), False, 0)}, 1, plan)
      "tensor 'b' has shape (2,) here, (3,) in the run"
    """
    mine = {s.name: (s.spec.shape, s.spec.embedding, s.fragment) for s in plan.slots}
    complete = len({fragment for _, _, fragment in run.values()}) == run_fragments
    for name in sorted(set(run) | set(mine)):
        if name not in mine:
            return f"tensor {name!r} {run[name][0]} is in the run, not in this learner's params"
        if name not in run:
            if not complete:
                continue  # perhaps in a fragment whose shard did not answer
            return f"tensor {name!r} {mine[name][0]} is in this learner's params, not in the run"
        (shape, emb, _), (run_shape, run_emb, _) = mine[name], run[name]
        if shape != run_shape:
            return f"tensor {name!r} has shape {shape} here, {run_shape} in the run"
        if emb != run_emb:
            return (
                f"tensor {name!r} is merged as {'an embedding' if run_emb else 'a non-embedding'} "
                "in the run, not here (is_embedding differs)"
            )
    if run_fragments != plan.num_fragments:
        return f"the run has {run_fragments} fragments, this learner {plan.num_fragments}"
    for name in sorted(set(run) & set(mine)):
        if mine[name][2] != run[name][2]:
            return f"tensor {name!r} is in fragment {mine[name][2]} here, {run[name][2]} in the run"
    return "model or fragment count differ"


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    # the defaults are the learner's (learner/config.py), declared once
    period: int = PERIOD  # H: inner steps between two syncs of one fragment, >= 1
    overlap: int = OVERLAP  # τ: steps training continues before adopting a push's result, in [0, H)
    mix: float = MIX  # α: share of the local fragment kept when adopting, in [0, 1)
    codec: codec.Codec = CODEC  # outer-gradient codec on the wire
    max_backoff: float = 5.0  # seconds, cap of the retry backoff (jittered), > 0
    patience: float = (
        SYNC_PATIENCE  # seconds (at least; 4 periods of steps if longer) to wait for a round
    )
    wait_for_rounds: bool = False  # synchronous semantics: block when a round is a period late

    def __post_init__(self):
        if self.period < 1:
            raise ValueError(f"period (H) must be at least 1, got {self.period}")
        if not 0 <= self.overlap < self.period:
            raise ValueError(
                f"overlap (τ) must be in [0, H={self.period}), got {self.overlap}: "
                "a fragment must be adopted before its next sync"
            )
        if not 0 <= self.mix < 1:
            raise ValueError(f"mix (α) must be in [0, 1), got {self.mix}")
        if self.patience <= 0:
            raise ValueError(f"patience must be > 0 seconds, got {self.patience}")
        if self.max_backoff <= 0:
            raise ValueError(f"max_backoff must be > 0, got {self.max_backoff}")


def offsets(num_fragments: int, period: int) -> list[int]:
    """t_p in [1, H]: the step of each fragment's first sync, spread over the period."""
    return [max(1, round((p + 1) * period / num_fragments)) for p in range(num_fragments)]


def steps_per_period(period: int, cadence_seconds: float | None, step_seconds: float) -> int:
    """Inner steps this learner takes in one sync period: H until the shard names a
    cadence, then as many of its own steps as fit in it (at least 1)."""
    if not cadence_seconds or step_seconds <= 0:
        return period
    return max(1, round(cadence_seconds / step_seconds))


def sync_due(
    *,
    step: int,
    first_step: int,
    last_sync_step: int | None,
    due_at: float | None,
    now: float,
    period: int,
    step_seconds: float,
) -> bool:
    """Whether fragment p's next push starts at this step boundary (no push in flight).

    Args:
      step: inner steps done since joining.
      first_step: t_p, the fragment's first sync step (staggered over the period).
      last_sync_step: the step of the fragment's last push, or None before the first.
      due_at: when the shard asked for this learner's next push of the fragment
        (PushResponse.next_due_seconds after its last push), on this learner's
        monotonic clock; None when not known.
      now: the same clock, at this step boundary.
      period: H, inner steps per sync of the fastest learner.
      step_seconds: this learner's recent seconds per inner step.

    Returns:
      True at the step boundary nearest to `due_at`, so every learner, fast or slow,
      pushes once per period and within a step of the others; with no due time, at t_p
      first and then every H steps.

    Example:
      >>> sync_due(step=40, first_step=8, last_sync_step=8, due_at=103.15, now=103.1,
      ...          period=32, step_seconds=0.2)
      True
    """
    if step <= (last_sync_step or 0):
        return False
    if due_at is None:
        return step >= first_step if last_sync_step is None else step - last_sync_step >= period
    return now + step_seconds / 2 >= due_at


class StepTimer:
    """A learner's seconds per inner step, the figure the shards' cadence is built from:
    the plain mean of the last STEP_WINDOW steps, the first STEP_WARMUP after joining left
    out (they compile).

    Long steps count: on a busy host most steps are quick and a few wait for a core
    (measured with 4 learners on 2 cores: 3 ms typical, one in ~20 at 20-150 ms, 7 ms
    mean). A period must hold H steps of wall time; a median or a trimmed mean gave a
    cadence half that long, so rounds came due twice as often as learners pushed and
    half the pushes arrived a version stale."""

    def __init__(self, window: int = STEP_WINDOW, warmup: int = STEP_WARMUP):
        self.warmup = warmup
        self.recent: collections.deque[float] = collections.deque(maxlen=window)

    def add(self, step: int, seconds: float) -> float:
        """Records step `step` (counted from 1 since joining); returns the estimate (the
        step's own time until a counted step is in: a compile never enters the window,
        which a loop that compiles in its first step, as a library user's does, needs)."""
        if step > self.warmup:
            self.recent.append(seconds)
        return float(np.mean(self.recent)) if self.recent else float(seconds)


@dataclasses.dataclass
class _Outcome:
    """What a finished sync task hands the training thread."""

    version: int
    correction: np.ndarray | None  # add to θ_p (adopt), or None with `values` set (resync)
    values: np.ndarray | None = None
    due_at: float | None = (
        None  # when the next push of the fragment is due (monotonic), None: not known
    )


class _Fragment:
    """One fragment's sync state; touched by one task at a time, then by the training thread."""

    def __init__(self, p: int, size: int, wire_codec: codec.Codec):
        self.p = p
        self.version = 0  # the global version adopted
        self.base: np.ndarray = np.zeros(size, np.float32)  # Θ_p at `version`, bit-exact
        self.ef = codec.ErrorFeedback(size, wire_codec)
        self.last_sync_step: int | None = None  # the step of the last push
        self.due_at: float | None = None  # when the next push is due (monotonic), from the shard
        self.origin: np.ndarray | None = None  # what the next Δ is measured from, if not `base`
        self.compute = (
            0.0  # seconds of inner steps since the last sync (what the next push carries)
        )
        self.task: concurrent.futures.Future | None = None
        self.task_step = 0  # the step the in-flight task was started at


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
    """

    def __init__(
        self,
        cfg: SyncConfig,
        plan: FragmentPlan,
        clients: list[ShardClient],
        on_push: Callable[[dict], None] | None = None,
        connect: Callable[[int], ShardClient] | None = None,
        read_fragment: Callable[[Any, int], np.ndarray] | None = None,
    ):
        self.cfg, self.plan, self.on_push, self.connect = cfg, plan, on_push, connect
        self.read_fragment = read_fragment or plan.flatten_fragment
        self.clients = list(clients)  # by shard index; grows through `connect`
        self.num_shards = len(clients)  # the shards given at start
        try:  # where each fragment is: p mod S until a shard names a newer map
            self.fragment_map = FragmentMap.modulo(plan.num_fragments, self.num_shards)
        except ValueError as e:
            raise SyncError(
                f"{self.num_shards} shards for {plan.num_fragments} fragments: {e}"
            ) from None
        self.offsets = offsets(plan.num_fragments, cfg.period)
        self.frags = [
            _Fragment(p, plan.fragment_sizes[p], cfg.codec) for p in range(plan.num_fragments)
        ]
        self.pool = concurrent.futures.ThreadPoolExecutor(max(2, plan.num_fragments), "sync")
        self.seq = 0  # pushes so far; join() goes on from the newest seq the shards answered
        self.lock = threading.Lock()
        self.known = threading.Condition(self.lock)
        self.latest: dict[int, int] = {}  # newest version each fragment is known to have
        self.stopping = threading.Event()
        self.step_seconds = (
            0.0  # this learner's seconds per inner step (StepTimer), boundary to boundary
        )
        self._step_timer = StepTimer()
        self.cadence_seconds: float | None = None  # the sync period the shards ask for
        self.pushes_started = 0  # sync tasks started (the training loop times evaluations by it)
        self.stats = {
            "bytes_sent": 0,
            "bytes_received": 0,
            "pushes": 0,
            "refused": 0,
            "resyncs": 0,
            "adopted": 0,
            "stalled": 0,
            "blocked_seconds": 0.0,
        }
        self._watches: list[grpc.Future] = []  # open Watch calls, cancelled by close()
        self._map_generation = 0  # fragment map changes seen: Watch streams reopen on each
        self._watching = False  # Watch threads started: a shard found later gets one too
        self._probing = threading.Lock()  # one probe past the known shards at a time
        self._probe_client: ShardClient | None = None  # the shard being probed (stop() closes it)

    def client_of(self, p: int) -> ShardClient:
        return self.client(self.shard_of(p))

    def client(self, i: int) -> ShardClient:
        """Shard i's client; one past those given is made from the --shards pattern (and
        watched, once the learner watches)."""
        with self.lock:
            if i < len(self.clients):
                return self.clients[i]
            if self.stopping.is_set():  # stop() closed the channels: no new ones after it
                raise Stopped(f"shard {i}: learner stopping")
            if not self._reachable(i):
                raise SyncError(f"shard {i}: this learner has no address for it")
            assert self.connect is not None
            new = [(k, self.connect(k)) for k in range(len(self.clients), i + 1)]
            self.clients.extend(c for _, c in new)
            watching = self._watching
        for k, c in new:
            log.info("shard %d is at %s", k, c.address)
            if watching:
                self._start_watcher(k, c)
        return self.clients[i]

    def _reachable(self, shard: int) -> bool:
        """Whether this learner can address shard `shard`: one given, or any with a pattern."""
        return 0 <= shard < len(self.clients) or (
            self.connect is not None and 0 <= shard < MAX_SHARDS
        )

    def shard_of(self, p: int) -> int:
        """The shard that owns fragment p, by the newest fragment map seen."""
        return self.fragment_map.owner(p)

    def _follow(self, new: FragmentMap, joining: bool = False) -> None:
        """Routes by what `new` says of each fragment where it is newer than what this
        learner knows (docs/resharding.md); when joining, the shards' map replaces the
        p mod S this learner assumed, whatever S."""
        if new.num_fragments != self.plan.num_fragments or not all(
            self._reachable(s) for s in set(new.owners)
        ):
            raise SyncError(
                f"fragment map version {new.version} names shards {sorted(set(new.owners))} "
                f"for {new.num_fragments} fragments; this learner was given "
                f"{self.num_shards} shards for {self.plan.num_fragments}"
                + ("" if self.connect else " (a --shards pattern reaches shards added later)")
            )
        with self.known:
            old = self.fragment_map
            self.fragment_map = new if joining else old.merged(new)
            now = self.fragment_map
            moved = [p for p, (a, b) in enumerate(zip(old.owners, now.owners)) if a != b]
            if moved:  # Watch streams reopen on the shards that own what moved
                self._map_generation += 1
                self.known.notify_all()
            watches = list(self._watches) if moved else []
        for call in watches:
            call.cancel()
        for shard in sorted({now.owners[p] for p in moved}):
            self.client(shard)  # a shard first named now: its client, and its Watch
        if joining:
            log.info("routing by the shards' fragment map (version %d)", now.version)
        elif moved:
            log.info("fragment map version %d: fragments %s moved", now.version, moved)

    def _moved(self, p: int, e: grpc.RpcError) -> bool:
        """Follows a refusal naming fragment p's owner under a newer map; True if it did
        (p < 0: the fragment the refusal names, as a Watch's does)."""
        if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
            return False
        trailing = dict(e.trailing_metadata() or ())
        try:
            owner, version = int(trailing[OWNER_KEY]), int(trailing[MAP_VERSION_KEY])
            p = p if p >= 0 else int(trailing[FRAGMENT_KEY])
        except (KeyError, ValueError):
            return False
        if not (0 <= p < self.plan.num_fragments and self._reachable(owner)):
            return False
        known = self.fragment_map
        if version <= known.moved_at[p]:
            # nothing new, but a call sent before this learner followed the move (another
            # thread did) is retried where the map now sends it
            return known.owner(p) == owner
        self._follow(known.stating(p, owner, version))
        return True

    # --- joining ---

    def check_shards(self) -> set[int]:
        """Every shard must be the one its position says, serving this plan (or none yet).
        Routes by the newest fragment map they describe (p mod S, S the shards given,
        while none has a plan). With a --shards pattern, the shards past those given are
        asked too, while they answer (a reshard may have moved fragments to them).
        Returns the fragments already seeded."""
        seeded, maps, layouts = set(), [], []
        for i, client in enumerate(list(self.clients)):
            if layouts and (i >= layouts[0] or maps):
                # past the first layout, a shard a reshard may use, perhaps not started yet;
                # in a run with a map, one a scale-down may have taken away (the maps of the
                # shards moves took fragments from say where they went)
                try:
                    d = self.call_shard(lambda c=client: c.describe(timeout=PROBE_SECONDS))
                except grpc.RpcError:
                    log.info(
                        "shard %d at %s is not up: the shards' maps say what it owns",
                        i,
                        client.address,
                    )
                    continue
            else:
                d = self._retry(client.describe, f"describe shard {i}")
            if d.shard_index != i:
                raise SyncError(
                    f"{client.address} is shard {d.shard_index}, but was given as shard {i} of "
                    f"{self.num_shards}: list the shards in index order"
                )
            if d.plan_fingerprint and d.plan_fingerprint != self.plan.fingerprint:
                raise PlanMismatch(
                    f"shard {i} at {client.address} serves plan {d.plan_fingerprint}, this learner "
                    f"has {self.plan.fingerprint}: {self._difference(d)}"
                )
            seeded.update(f.fragment for f in d.fragments if f.initialized)
            layouts.append(d.num_shards)
            if (mine := self._plan_map(d)) is not None:
                maps.append(mine)
        maps += self._probe()
        if maps:  # the run has a map: it says where each fragment is, whatever S was
            self._follow(FragmentMap.merge_all(maps), joining=True)
        else:  # a new run: p mod S0, S0 the layout shard 0 was started with; shards past
            # it (listed for a later reshard) own nothing until fragments move to them
            first = layouts[0]
            if first > min(self.num_shards, self.plan.num_fragments) or any(
                n != first for n in layouts[1:first]
            ):
                raise SyncError(
                    f"the shards were started with --num-shards {layouts}, but "
                    f"{self.num_shards} were given: list every shard, in index order"
                )
            with self.lock:
                self.fragment_map = FragmentMap.modulo(self.plan.num_fragments, first)
        return seeded

    def _difference(self, first: pb.DescribeResponse) -> str:
        """What differs between the run's plan (as the shards describe their fragments)
        and this learner's, naming the first tensor that does."""
        described = [first]
        for i, c in enumerate(list(self.clients)):
            if i == first.shard_index:
                continue
            try:
                described.append(self.call_shard(lambda c=c: c.describe(timeout=PROBE_SECONDS)))
            except grpc.RpcError:
                continue  # its fragments go uncompared
        run = {
            t.name: (tuple(t.shape), t.embedding, f.fragment)
            for d in described
            for f in d.fragments
            for t in f.tensors
        }
        return plan_difference(run, first.num_fragments, self.plan)

    def _plan_map(self, d: pb.DescribeResponse) -> FragmentMap | None:
        """The fragment map a shard describes, if it has one for this plan's fragments."""
        described = described_map(d)
        if described is None or described.num_fragments != self.plan.num_fragments:
            return None
        return described

    def _probe(self) -> list[FragmentMap]:
        """With a --shards pattern: the maps of the shards past those known, asked in
        index order until one does not answer as the next shard of this plan; each that
        answers is kept as a client."""
        found: list[FragmentMap] = []
        if self.connect is None:
            return found
        with self._probing:  # (a refusal may still make a client meanwhile: `client`)
            while len(self.clients) < MAX_SHARDS and not self.stopping.is_set():
                i = len(self.clients)
                client = self.connect(i)
                with self.lock:
                    self._probe_client = client
                try:
                    d = self.call_shard(lambda: client.describe(timeout=PROBE_SECONDS))
                except grpc.RpcError:
                    d = None
                except Stopped:
                    client.close()
                    raise
                finally:
                    with self.lock:
                        self._probe_client = None
                described = None if d is None else described_map(d)
                if (
                    d is None
                    or d.shard_index != i
                    or d.plan_fingerprint not in ("", self.plan.fingerprint)
                    or (
                        described is not None and described.num_fragments != self.plan.num_fragments
                    )
                ):
                    client.close()
                    break
                with self.lock:  # (stop() closes only the clients listed when it ran)
                    kept = len(self.clients) == i and not self.stopping.is_set()
                    if kept:
                        self.clients.append(client)
                    watching = self._watching
                if kept:
                    log.info("found shard %d at %s", i, client.address)
                    if watching:
                        self._start_watcher(i, client)
                else:
                    client.close()
                if described is not None:
                    found.append(described)
        return found

    def _ask_others(self, p: int) -> bool:
        """Fragment p's shard does not answer: merges every other shard's map (and, with a
        pattern, any shard found past them); True if p's owner changed."""
        before = self.shard_of(p)
        maps = []
        for i, client in enumerate(list(self.clients)):
            if i == before:
                continue
            try:
                mine = self._plan_map(
                    self.call_shard(lambda c=client: c.describe(timeout=PROBE_SECONDS))
                )
            except grpc.RpcError:
                continue
            if mine is not None:
                maps.append(mine)
        maps += self._probe()
        if maps:
            try:
                self._follow(FragmentMap.merge_all(maps))
            except SyncError as e:
                log.warning("the shards' maps cannot be followed: %s", e)
        return self.shard_of(p) != before

    def join(self, params: Params) -> Params:
        """Seeds unseeded fragments with `params`, then adopts every fragment's current version."""
        return self.apply(params, dict(enumerate(self.join_fragments(params))))

    def join_fragments(self, params: Any) -> list[np.ndarray]:
        """`join`, returning every fragment's current global vector (fresh copies) rather
        than a tree; `params` is read with `read_fragment`."""
        seeded = self.check_shards()
        vectors = [self.read_fragment(params, p) for p in range(self.plan.num_fragments)]
        for p, vector in enumerate(vectors):
            if p in seeded:  # someone seeded it already: no need to offer our copy
                continue
            frame = codec.encode(vector, codec.Codec.FP32)
            answer = self._retry(
                lambda: self.client_of(p).init(self.plan, p, frame, codec.Codec.FP32),
                f"init fragment {p}",
                fragment=p,
            )
            self._count("bytes_sent", len(frame))
            if answer.created:
                log.info("seeded fragment %d on shard %d", p, self.shard_of(p))
        for p, frag in enumerate(self.frags):
            pulled = self._pull(p, None)
            # a restarted learner's seqs go on from its newest answered push: no clock involved
            self.seq = max(self.seq, pulled.last_seq)
            frag.base = codec.decode(pulled.frames[0][2], num_values=frag.base.size).copy()
            frag.version = pulled.version
            if pulled.next_due_seconds > 0:  # push the first one in step with the others
                frag.due_at = time.monotonic() + pulled.next_due_seconds
            vectors[p] = frag.base.copy()
            with self.lock:
                self.latest[p] = max(self.latest.get(p, 0), frag.version)
        self._start_watchers()
        return vectors

    # --- the step hook ---

    def after_step(
        self,
        step: int,
        params: Params,
        step_seconds: float,
        tokens_per_step: int,
        final: bool = False,
    ) -> dict[int, np.ndarray]:
        """Adopts finished syncs, starts due ones; `step` counts inner steps done since join.
        `final`: the run's last step; a push it starts is this learner's last of that
        fragment (see `finish`, which pushes the others' tails).
        Returns {fragment: new vector} for the fragments whose tensors the caller must replace."""
        self.step_seconds = self._step_timer.add(step, step_seconds)
        updates: dict[int, np.ndarray] = {}
        flat_now: dict[int, np.ndarray] = {}
        now = time.monotonic()
        per_period = steps_per_period(self.cfg.period, self.cadence_seconds, self.step_seconds)
        for frag in self.frags:
            frag.compute += step_seconds
            if frag.task is not None:
                # A round still open after τ steps (one that waits on slower learners, or a
                # push that just missed a close and joined the next round, back about a
                # period later) does not stop training: the fragment trains on and adopts
                # when the round is back (with the steps made meanwhile). Only a round
                # RUN_AHEAD_PERIODS late (one period with synchronous semantics) is waited
                # for, so a fragment's local drift stays bounded (up to the patience).
                ready = step >= frag.task_step + self.cfg.overlap and frag.task.done()
                late = 1 if self.cfg.wait_for_rounds else RUN_AHEAD_PERIODS
                overdue = step - frag.task_step >= late * per_period
                if ready or overdue:
                    if not frag.task.done():  # the only place a learner blocks
                        started = time.perf_counter()
                        concurrent.futures.wait([frag.task])
                        self._count("blocked_seconds", time.perf_counter() - started)
                    self._adopt(frag, step, params, flat_now, updates)
            if (
                frag.task is None
                and frag.due_at is not None
                and self.cadence_seconds
                and now + self.step_seconds / 2 >= frag.due_at
                and step - (frag.last_sync_step or 0) < max(1, per_period // 2)
            ):
                # due, with less than half a period done since the last push (just joined,
                # or back late from a round): this learner takes the next round instead
                frag.due_at += self.cadence_seconds
            if frag.task is None and sync_due(
                step=step,
                first_step=self.offsets[frag.p],
                last_sync_step=frag.last_sync_step,
                due_at=frag.due_at,
                now=now,
                period=self.cfg.period,
                step_seconds=self.step_seconds,
            ):
                self._start_push(frag, step, params, updates, flat_now, tokens_per_step, final)
        return updates

    def _start_push(
        self,
        frag: _Fragment,
        step: int,
        params: Params,
        updates: dict[int, np.ndarray],
        flat_now: dict[int, np.ndarray],
        tokens_per_step: int,
        last: bool = False,
    ) -> None:
        """Starts fragment p's sync task: push θ_p's progress since its last push (θ_p as
        just adopted, if `updates` holds it), wait for its round, pull."""
        theta = updates.get(frag.p)
        if theta is None:
            theta = flat_now.setdefault(frag.p, self.read_fragment(params, frag.p))
        steps = step - (frag.last_sync_step or 0)
        tokens = steps * tokens_per_step
        frag.last_sync_step = step
        frag.task_step = step
        self.seq += 1
        compute, frag.compute = frag.compute, 0.0
        self.pushes_started += 1
        frag.task = self.pool.submit(
            self._sync, frag, theta.copy(), self.seq, steps, tokens, compute, last
        )

    def _adopt(
        self, frag: _Fragment, step: int, params: Params, flat_now: dict, updates: dict
    ) -> None:
        outcome: _Outcome = frag.task.result()
        frag.task = None
        if outcome.correction is not None:
            # θ_p as the caller will hold it: a fragment adopted once already in this call
            # (finish: the sync in flight, then its tail's) adds to that, not to `params`
            now = updates.get(frag.p)
            if now is None:
                now = flat_now.setdefault(frag.p, self.read_fragment(params, frag.p))
            updates[frag.p] = now + outcome.correction
        else:
            updates[frag.p] = outcome.values
            frag.last_sync_step = step
        frag.version = outcome.version
        frag.due_at = outcome.due_at
        self._count("adopted", 1)

    def finish(
        self, step: int, params: Params, timeout: float, tokens_per_step: int | None = None
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
        deadline = time.monotonic() + timeout
        updates: dict[int, np.ndarray] = {}
        flat_now: dict[int, np.ndarray] = {}
        try:
            self._finish(step, params, deadline, tokens_per_step, updates, flat_now)
        except Stopped:
            log.info("stopped before the last pushes were adopted (an acknowledged one is kept)")
        return updates

    def _finish(
        self,
        step: int,
        params: Params,
        deadline: float,
        tokens_per_step: int | None,
        updates: dict[int, np.ndarray],
        flat_now: dict[int, np.ndarray],
    ) -> None:
        """`finish`'s loop; what it adopts goes into `updates`."""
        while not self.stopping.is_set():
            # Each fragment's tail goes out as soon as that fragment is idle, not once all
            # are: a round holding one of our pushes may wait for another learner's tail,
            # which waits on a round that needs ours.
            for frag in self.frags:
                if frag.task is not None and frag.task.done():
                    self._adopt(frag, step, params, flat_now, updates)
                if (
                    tokens_per_step is not None
                    and frag.task is None
                    and step > (frag.last_sync_step or 0)
                ):
                    self._start_push(
                        frag, step, params, updates, flat_now, tokens_per_step, last=True
                    )
            pending = [f.task for f in self.frags if f.task is not None]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                return
            concurrent.futures.wait(
                pending, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def _sync(
        self,
        frag: _Fragment,
        theta: np.ndarray,
        seq: int,
        steps: int,
        tokens: int,
        compute: float = 0.0,
        last: bool = False,
    ) -> _Outcome:
        """Push, wait for the round holding it, pull: the background half of one sync."""
        p = frag.p
        # after giving up on a round that holds our last push, only what came since counts
        origin = frag.base if frag.origin is None else frag.origin
        frame = frag.ef.encode(origin - theta)
        header = pb.PushHeader(
            fragment=p,
            base_version=frag.version,
            seq=seq,
            inner_steps=max(1, steps),
            tokens=max(1, tokens),
            codec=int(self.cfg.codec),
            num_params=theta.size,
            plan_fingerprint=self.plan.fingerprint,
            step_seconds=self.step_seconds,
            overlap_steps=self.cfg.overlap,
            period_steps=self.cfg.period,
            last=last,
        )
        # a retry goes to p's owner by the newest map: the same seq, so a push that reached
        # the old owner first is answered once, from the state that moved with p
        ack = self._retry(
            lambda: self.client_of(p).push(header, frame), f"push fragment {p}", fragment=p
        )
        if ack.cadence_seconds > 0:
            self.cadence_seconds = ack.cadence_seconds
        # the fragment's schedule, from the shard (relative: no clock in common needed)
        due_at = time.monotonic() + ack.next_due_seconds if ack.next_due_seconds > 0 else None
        self._count("bytes_sent", len(frame))
        self._count("pushes", 1)
        if self.on_push is not None:
            self.on_push(
                {
                    "fragment": p,
                    "seq": seq,
                    "shard": self.shard_of(p),
                    "accepted": ack.accepted,
                    "reason": pb.PushReason.Name(ack.reason),
                    "base_version": frag.version,
                    "merged_in": frag.version + ack.staleness + 1 if ack.accepted else None,
                    "steps": max(1, steps),
                    "compute_seconds": compute,
                }
            )
        if not ack.accepted:
            # too stale, or a round already holding us: this contribution is lost; start over from Θ
            self._count("refused", 1)
            self._count("resyncs", 1)
            log.info(
                "fragment %d: push refused (%s: %s); resyncing",
                p,
                pb.PushReason.Name(ack.reason),
                ack.detail,
            )
            frag.ef.reset()
            self._advance(frag, None)
            frag.origin = None
            return _Outcome(frag.version, None, frag.base.copy(), self._due(due_at))
        merged_in = frag.version + ack.staleness + 1  # the version that will hold this push
        patience = max(self.cfg.patience, 4 * self.cfg.period * self.step_seconds)
        if not self._wait_for(p, merged_in, patience):
            # the round holding our push is stuck (its other members are blocked on us, or
            # gone but still holding leases): keep training on local weights rather than
            # wait on it; the next push finds us still in that round and resyncs
            self._count("stalled", 1)
            log.warning(
                "fragment %d: no version %d after %.0f s; going on without it",
                p,
                merged_in,
                patience,
            )
            frag.origin = theta  # the round still holds the steps up to here
            return _Outcome(frag.version, np.zeros_like(theta), due_at=self._due(due_at))
        due_at = self._due(
            due_at
        )  # without a schedule: a period after the round holding our push closed
        self._advance(frag, merged_in)
        frag.origin = None
        keep = 1.0 - self.cfg.mix
        return _Outcome(frag.version, np.float32(keep) * (frag.base - theta), due_at=due_at)

    def _due(self, due_at: float | None) -> float | None:
        """The shard's due time, or one period from now when the shard gave none."""
        if due_at is not None or not self.cadence_seconds:
            return due_at
        return time.monotonic() + self.cadence_seconds

    def _advance(self, frag: _Fragment, at_least: int | None) -> None:
        """Brings frag.base up to the newest version (>= at_least) by deltas, or a snapshot."""
        while True:
            pulled = self._pull(frag.p, frag.version)
            if pulled.snapshot:
                frag.base = codec.decode(pulled.frames[0][2], num_values=frag.base.size).copy()
            else:
                for _, frame_codec, frame in pulled.frames:
                    codec.decode_into(frame, frag.base, 1.0, codec=frame_codec)
            frag.version = pulled.version
            if at_least is None or frag.version >= at_least:
                return
            self._wait_for(frag.p, at_least)

    def _learn_schedule(self, frag: _Fragment, have: int) -> None:
        """Asks fragment p's shard when this learner's first push of it is due (a pull
        from the version just announced: no frames unless another round closed since)."""
        try:  # one try: on failure the first push goes on step counts (t_p) instead
            pulled = self.call_shard(lambda: self.client_of(frag.p).pull(frag.p, have))
        except (grpc.RpcError, IncompletePull, Stopped):
            return
        self._count("bytes_received", sum(len(f) for _, _, f in pulled.frames))
        if pulled.next_due_seconds > 0 and frag.due_at is None:
            frag.due_at = time.monotonic() + pulled.next_due_seconds

    def _pull(self, p: int, have: int | None) -> Pulled:
        pulled = self._retry(
            lambda: self.client_of(p).pull(p, have), f"pull fragment {p}", fragment=p
        )
        self._count("bytes_received", sum(len(f) for _, _, f in pulled.frames))
        return pulled

    # --- versions from Watch ---

    def _start_watchers(self) -> None:
        with self.lock:
            self._watching = True
            clients = list(self.clients)
        for i, client in enumerate(clients):
            self._start_watcher(i, client)

    def _start_watcher(self, i: int, client: ShardClient) -> None:
        threading.Thread(
            target=self._watch, args=(i, client), name=f"watch-{i}", daemon=True
        ).start()

    def _watch(self, i: int, client: ShardClient) -> None:
        """Follows shard i's versions of the fragments the map gives it for as long as we
        run, reconnecting with backoff, and again at once when the map changes."""
        failures = 0
        while not self.stopping.is_set():
            with self.known:
                generation = self._map_generation
            fragments = list(self.fragment_map.fragments_of(i))
            if not fragments:  # owns nothing (yet, or any more): wait for the map to change
                with self.known:
                    self.known.wait_for(
                        lambda g=generation: self._map_generation != g or self.stopping.is_set(),
                        timeout=5.0,
                    )
                continue
            try:
                call = self.call_shard(lambda: client.watch(fragments))
            except Stopped:
                return
            with self.lock:
                self._watches = [c for c in self._watches if c.is_active()] + [call]
            try:
                for notice in call:
                    failures = 0
                    with self.known:
                        self.latest[notice.fragment] = max(
                            self.latest.get(notice.fragment, 0), notice.version
                        )
                        self.known.notify_all()
                    frag = self.frags[notice.fragment]
                    if (
                        frag.due_at is None
                        and frag.last_sync_step is None
                        and not self.stopping.is_set()
                    ):
                        # joined before the fragment had a schedule: a round has closed since,
                        # so the shard has one now; learn it rather than push on step counts
                        try:
                            self.pool.submit(self._learn_schedule, frag, notice.version)
                        except RuntimeError:  # the pool shut down: this learner is stopping
                            break
            except grpc.RpcError as e:
                self._moved(-1, e)  # a fragment moved away: the map changes, the streams reopen
            if self.stopping.is_set():
                return
            if self._map_generation != generation:  # cancelled for the new map: reopen now
                failures = 0
                continue
            failures += 1
            self.stopping.wait(self._backoff(failures))

    def _wait_for(self, p: int, version: int, timeout: float | None = None) -> bool:
        """Waits until fragment p is known at `version`; False if `timeout` s pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.known:
            while self.latest.get(p, 0) < version and not self.stopping.is_set():
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self.known.wait(1.0)
        if self.stopping.is_set():
            raise Stopped(f"waiting for fragment {p} at version {version}")
        return True

    def versions(self) -> dict[int, tuple[int, int]]:
        """{fragment: (adopted version, newest known version)}."""
        with self.lock:
            return {f.p: (f.version, self.latest.get(f.p, f.version)) for f in self.frags}

    def standing(self) -> tuple[int, int]:
        """(oldest adopted version, worst lag): the figures a progress line shows."""
        versions = self.versions().values()
        return min(v for v, _ in versions), max(latest - v for v, latest in versions)

    # --- plumbing ---

    def _backoff(self, attempt: int) -> float:
        return random.uniform(0, min(self.cfg.max_backoff, 0.1 * 2**attempt))  # full jitter

    def _retry(self, call, what: str, fragment: int = -1):
        """Retries transient failures with jittered exponential backoff until stopped; a
        call about `fragment` refused by a shard that names its new owner goes there."""
        attempt = 0
        while True:
            try:
                return self.call_shard(call, what)
            except grpc.RpcError as e:
                if self._moved(fragment, e):
                    continue
                if e.code() not in RETRYABLE:
                    raise SyncError(f"{what}: {e.code().name}: {e.details()}") from None
                error = f"{e.code().name}: {e.details()}"
                if (
                    e.code() == grpc.StatusCode.UNAVAILABLE
                    and fragment >= 0
                    and (attempt + 1) % ASK_OTHERS_AFTER == 0
                    and self._ask_others(fragment)
                ):
                    log.info(
                        "%s: fragment %d moved to shard %d", what, fragment, self.shard_of(fragment)
                    )
                    attempt = 0
                    continue
            except IncompletePull as e:
                error = str(e)
            attempt += 1
            if self.stopping.is_set():
                raise Stopped(what)
            log.warning("%s failed (%s); retry %d", what, error, attempt)
            self.stopping.wait(self._backoff(attempt))

    def _count(self, key: str, amount: float) -> None:
        with self.lock:
            self.stats[key] += amount

    def apply(self, params: Params, vectors: dict[int, np.ndarray]) -> Params:
        """`params` with the given fragments' tensors replaced (a new tree; leaves not copied)."""
        flat = {}
        for p, vector in vectors.items():
            flat.update(self.plan.unflatten_fragment(p, vector))
        return _replace(params, flat, "")

    def call_shard(self, call: Callable[[], T], what: str = "a call to a shard") -> T:
        """call(), where one that a stop cut short, or that finds its channel closed by
        `stop()`, raises Stopped."""
        if self.stopping.is_set():
            raise Stopped(what)
        try:
            return call()
        except (grpc.RpcError, ValueError, IncompletePull):  # ValueError: a closed channel
            if self.stopping.is_set():
                raise Stopped(what) from None
            raise

    def stop(self) -> None:
        """Ends every wait at once, from any thread: the channels close (calls in flight
        end CANCELLED, not at their deadline), and retries, waits on rounds and Watch
        threads stop with `Stopped`. Final: `close()` is all that is left to call."""
        self.stopping.set()
        with self.known:
            watches, clients = list(self._watches), list(self.clients)
            if self._probe_client is not None:
                clients.append(self._probe_client)
            self.known.notify_all()  # _wait_for, and watchers waiting for a map change
        for call in watches:
            call.cancel()
        for client in clients:
            client.close()

    def close(self) -> None:
        self.stop()
        self.pool.shutdown(wait=True, cancel_futures=True)


def _replace(tree: Params, flat: dict[str, np.ndarray], prefix: str) -> Params:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out[key] = (
            _replace(value, flat, name + "/") if isinstance(value, dict) else flat.get(name, value)
        )
    return out
