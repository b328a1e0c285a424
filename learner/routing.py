"""Which shard owns each fragment, following moves (docs/resharding.md): a client per
shard, the newest fragment map seen, and retries that go where the map now sends them.

A learner starts routing by p mod S (S the shards given), then by the map the shards
describe when it joins (`check_shards`). A call refused by a former owner names the new
one under a newer map version (`moved`), and a fragment whose shard stops answering
makes the learner ask the other shards (and, with a --shards pattern, shards past those
known) where it went (`ask_others`). Maps only ever merge forward: each fragment's
owner is taken from the map that moved it last.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from atoll.learner.stopping import Stopped
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import (
    FRAGMENT_KEY,
    MAP_VERSION_KEY,
    OWNER_KEY,
    IncompletePull,
    ShardClient,
    described_map,
)
from atoll.wire.plan import FragmentMap, FragmentPlan

log = logging.getLogger("atoll.learner")
T = TypeVar("T")
RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
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


def backoff(attempt: int, cap: float) -> float:
    """Seconds to wait before retry `attempt`: exponential, capped, full jitter."""
    return random.uniform(0, min(cap, 0.1 * 2**attempt))


class Router:
    """Routes each fragment's calls to its owner by the newest fragment map seen.

    `connect(i)`, if given, makes a client for shard i past `clients` (from a --shards
    pattern): shards a reshard brings in later are found by it. `stopping`, set by the
    owner, makes every call and retry raise `Stopped`; `close()` then closes the channels.
    Streams opened under the current map (`add_stream`) are cancelled when a fragment
    moves, and `generation` counts those moves, so whoever opened them reopens them.
    """

    def __init__(
        self,
        plan: FragmentPlan,
        clients: list[ShardClient],
        stopping: threading.Event,
        max_backoff: float,
        connect: Callable[[int], ShardClient] | None = None,
    ):
        self.plan, self.stopping, self.connect = plan, stopping, connect
        self.max_backoff = max_backoff  # seconds, cap of the jittered retry backoff
        self.clients = list(clients)  # by shard index; grows through `connect`
        self.num_shards = len(clients)  # the shards given at start
        try:  # where each fragment is: p mod S until a shard names a newer map
            self.fragment_map = FragmentMap.modulo(plan.num_fragments, self.num_shards)
        except ValueError as e:
            raise SyncError(
                f"{self.num_shards} shards for {plan.num_fragments} fragments: {e}"
            ) from None
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # the map moved a fragment, or a stop
        self.generation = 0  # fragment map changes seen: streams reopen on each
        self._streams: list[Any] = []  # open streams (grpc futures), cancelled by a move
        # called with each shard found past the known ones, once set (Watch threads)
        self._on_shard: Callable[[int, ShardClient], None] | None = None
        self._probing = threading.Lock()  # one probe past the known shards at a time
        self._probe_client: ShardClient | None = None  # the shard being probed (close() closes it)

    # --- clients ---

    def client_of(self, p: int) -> ShardClient:
        return self.client(self.shard_of(p))

    def shard_of(self, p: int) -> int:
        """The shard that owns fragment p, by the newest fragment map seen."""
        return self.fragment_map.owner(p)

    def client(self, i: int) -> ShardClient:
        """Shard i's client; one past those given is made from the --shards pattern (and
        handed to `on_shard`, once set)."""
        with self.lock:
            if i < len(self.clients):
                return self.clients[i]
            if self.stopping.is_set():  # close() closed the channels: no new ones after it
                raise Stopped(f"shard {i}: learner stopping")
            if not self.reachable(i):
                raise SyncError(f"shard {i}: this learner has no address for it")
            assert self.connect is not None
            new = [(k, self.connect(k)) for k in range(len(self.clients), i + 1)]
            self.clients.extend(c for _, c in new)
            on_shard = self._on_shard
        for k, c in new:
            log.info("shard %d is at %s", k, c.address)
            if on_shard is not None:
                on_shard(k, c)
        return self.clients[i]

    def reachable(self, shard: int) -> bool:
        """Whether this learner can address shard `shard`: one given, or any with a pattern."""
        return 0 <= shard < len(self.clients) or (
            self.connect is not None and 0 <= shard < MAX_SHARDS
        )

    def each_shard(self, on_shard: Callable[[int, ShardClient], None]) -> None:
        """Calls on_shard(i, client) for every shard known, now and as more are found."""
        with self.lock:
            self._on_shard = on_shard
            clients = list(self.clients)
        for i, client in enumerate(clients):
            on_shard(i, client)

    def add_stream(self, call: Any) -> None:
        """Keeps a stream opened under the current map, to cancel when a fragment moves."""
        with self.lock:
            self._streams = [c for c in self._streams if c.is_active()] + [call]

    # --- calls ---

    def call_shard(self, call: Callable[[], T], what: str = "a call to a shard") -> T:
        """call(), where one that a stop cut short, or that finds its channel closed by
        `close()`, raises Stopped."""
        if self.stopping.is_set():
            raise Stopped(what)
        try:
            return call()
        except (grpc.RpcError, ValueError, IncompletePull):  # ValueError: a closed channel
            if self.stopping.is_set():
                raise Stopped(what) from None
            raise

    def retry(self, call: Callable[[], T], what: str, fragment: int = -1) -> T:
        """Retries transient failures with jittered exponential backoff until stopped; a
        call about `fragment` refused by a shard that names its new owner goes there."""
        attempt = 0
        while True:
            try:
                return self.call_shard(call, what)
            except grpc.RpcError as e:
                if self.moved(fragment, e):
                    continue
                if e.code() not in RETRYABLE:
                    raise SyncError(f"{what}: {e.code().name}: {e.details()}") from None
                error = f"{e.code().name}: {e.details()}"
                if (
                    e.code() == grpc.StatusCode.UNAVAILABLE
                    and fragment >= 0
                    and (attempt + 1) % ASK_OTHERS_AFTER == 0
                    and self.ask_others(fragment)
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
            self.stopping.wait(backoff(attempt, self.max_backoff))

    def close(self) -> None:
        """After `stopping` is set: cancels the streams, closes every channel (calls in
        flight end CANCELLED, not at their deadline), and wakes waits on a map change."""
        with self.changed:
            streams, clients = list(self._streams), list(self.clients)
            if self._probe_client is not None:
                clients.append(self._probe_client)
            self.changed.notify_all()
        for call in streams:
            call.cancel()
        for client in clients:
            client.close()

    # --- following moves ---

    def follow(self, new: FragmentMap, joining: bool = False) -> None:
        """Routes by what `new` says of each fragment where it is newer than what this
        learner knows (docs/resharding.md); when joining, the shards' map replaces the
        p mod S this learner assumed, whatever S."""
        if new.num_fragments != self.plan.num_fragments or not all(
            self.reachable(s) for s in set(new.owners)
        ):
            raise SyncError(
                f"fragment map version {new.version} names shards {sorted(set(new.owners))} "
                f"for {new.num_fragments} fragments; this learner was given "
                f"{self.num_shards} shards for {self.plan.num_fragments}"
                + ("" if self.connect else " (a --shards pattern reaches shards added later)")
            )
        with self.changed:
            old = self.fragment_map
            self.fragment_map = new if joining else old.merged(new)
            now = self.fragment_map
            moved = [p for p, (a, b) in enumerate(zip(old.owners, now.owners)) if a != b]
            if moved:  # streams reopen on the shards that own what moved
                self.generation += 1
                self.changed.notify_all()
            streams = list(self._streams) if moved else []
        for call in streams:
            call.cancel()
        for shard in sorted({now.owners[p] for p in moved}):
            self.client(shard)  # a shard first named now: its client (and its Watch)
        if joining:
            log.info("routing by the shards' fragment map (version %d)", now.version)
        elif moved:
            log.info("fragment map version %d: fragments %s moved", now.version, moved)

    def moved(self, p: int, e: grpc.RpcError) -> bool:
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
        if not (0 <= p < self.plan.num_fragments and self.reachable(owner)):
            return False
        known = self.fragment_map
        if version <= known.moved_at[p]:
            # nothing new, but a call sent before this learner followed the move (another
            # thread did) is retried where the map now sends it
            return known.owner(p) == owner
        self.follow(known.stating(p, owner, version))
        return True

    def ask_others(self, p: int) -> bool:
        """Fragment p's shard does not answer: merges every other shard's map (and, with a
        pattern, any shard found past them); True if p's owner changed."""
        before = self.shard_of(p)
        maps = []
        for i, client in enumerate(list(self.clients)):
            if i == before:
                continue
            d = self._ask(client)
            if d is not None and (mine := self._plan_map(d)) is not None:
                maps.append(mine)
        maps += self._probe()
        if maps:
            try:
                self.follow(FragmentMap.merge_all(maps))
            except SyncError as e:
                log.warning("the shards' maps cannot be followed: %s", e)
        return self.shard_of(p) != before

    # --- joining ---

    def check_shards(self) -> set[int]:
        """Every shard must be the one its position says, serving this plan (or none yet).
        Routes by the newest fragment map they describe (p mod S, S the shards given,
        while none has a plan). With a --shards pattern, the shards past those given are
        asked too, while they answer (a reshard may have moved fragments to them).
        Returns the fragments already seeded."""
        seeded: set[int] = set()
        maps: list[FragmentMap] = []
        layouts: list[int] = []
        for i, client in enumerate(list(self.clients)):
            if layouts and (i >= layouts[0] or maps):
                # past the first layout, a shard a reshard may use, perhaps not started yet;
                # in a run with a map, one a scale-down may have taken away (the maps of the
                # shards moves took fragments from say where they went)
                if (asked := self._ask(client)) is None:
                    log.info(
                        "shard %d at %s is not up: the shards' maps say what it owns",
                        i,
                        client.address,
                    )
                    continue
                d = asked
            else:
                d = self.retry(client.describe, f"describe shard {i}")
            self._check_described(i, client, d)
            seeded.update(f.fragment for f in d.fragments if f.initialized)
            layouts.append(d.num_shards)
            if (mine := self._plan_map(d)) is not None:
                maps.append(mine)
        maps += self._probe()
        if maps:  # the run has a map: it says where each fragment is, whatever S was
            self.follow(FragmentMap.merge_all(maps), joining=True)
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

    def _check_described(self, i: int, client: ShardClient, d: pb.DescribeResponse) -> None:
        """Shard i must say it is shard i, and serve this learner's plan (or none yet)."""
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

    def _difference(self, first: pb.DescribeResponse) -> str:
        """What differs between the run's plan (as the shards describe their fragments)
        and this learner's, naming the first tensor that does."""
        described = [first]
        for i, c in enumerate(list(self.clients)):
            if i == first.shard_index:
                continue
            try:
                described.append(
                    self.call_shard(functools.partial(c.describe, timeout=PROBE_SECONDS))
                )
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
                d = self._probe_one(client)
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
                self._keep(i, client)
                if described is not None:
                    found.append(described)
        return found

    def _probe_one(self, client: ShardClient) -> pb.DescribeResponse | None:
        """A shard past those known, asked to describe itself; None if it does not answer
        (a stop closes it and raises Stopped)."""
        with self.lock:
            self._probe_client = client
        try:
            return self._ask(client)
        except Stopped:
            client.close()
            raise
        finally:
            with self.lock:
                self._probe_client = None

    def _ask(self, client: ShardClient) -> pb.DescribeResponse | None:
        """The Describe of a shard that may not be up; None if it does not answer: at once
        where nothing listens at its address, after PROBE_SECONDS where it is silent."""
        if not self.call_shard(functools.partial(client.listening, PROBE_SECONDS)):
            return None
        try:
            return self.call_shard(functools.partial(client.describe, timeout=PROBE_SECONDS))
        except grpc.RpcError:
            return None

    def _keep(self, i: int, client: ShardClient) -> None:
        """Keeps a probed shard as shard i's client, unless one was made meanwhile."""
        with self.lock:  # (close() closes only the clients listed when it ran)
            kept = len(self.clients) == i and not self.stopping.is_set()
            if kept:
                self.clients.append(client)
            on_shard = self._on_shard
        if kept:
            log.info("found shard %d at %s", i, client.address)
            if on_shard is not None:
                on_shard(i, client)
        else:
            client.close()
