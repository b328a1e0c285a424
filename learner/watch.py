"""The versions the shards publish, as this learner hears of them: one Watch stream per
shard, following the fragments the current map gives it, and waits on a version.

A Watch thread reconnects with backoff when its stream breaks, and at once when the
fragment map moves a fragment (the router cancels the streams opened under the old map).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable

import grpc

from atoll.learner.routing import Router, backoff
from atoll.learner.stopping import Stopped
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import ShardClient

MAP_WAIT_SECONDS = 5.0  # a shard that owns nothing re-reads the map at least this often
POLL_SECONDS = 1.0  # a wait on a version re-checks for a stop at least this often


class Versions:
    """The newest version of each fragment the shards announced, and waits on them.

    `on_notice(p, version)`, if given, is called from a Watch thread with each version
    announced; it returns False when the learner is going away (the thread then ends).
    """

    def __init__(
        self,
        router: Router,
        stopping: threading.Event,
        max_backoff: float,
        clock: Callable[[], float] = time.monotonic,
        on_notice: Callable[[int, int], bool] | None = None,
    ):
        self.router, self.stopping, self.max_backoff = router, stopping, max_backoff
        self.clock, self.on_notice = clock, on_notice
        self.lock = threading.Lock()
        self.known = threading.Condition(self.lock)
        self.latest: dict[int, int] = {}  # newest version each fragment is known to have

    def note(self, p: int, version: int) -> None:
        """Fragment p is at `version` at least."""
        with self.known:
            self.latest[p] = max(self.latest.get(p, 0), version)
            self.known.notify_all()

    def newest(self, p: int, default: int = 0) -> int:
        with self.lock:
            return self.latest.get(p, default)

    def wait_for(self, p: int, version: int, timeout: float | None = None) -> bool:
        """Waits until fragment p is known at `version`; False if `timeout` s pass first."""
        deadline = None if timeout is None else self.clock() + timeout
        with self.known:
            while self.latest.get(p, 0) < version and not self.stopping.is_set():
                if deadline is not None and self.clock() >= deadline:
                    return False
                self.known.wait(POLL_SECONDS)
        if self.stopping.is_set():
            raise Stopped(f"waiting for fragment {p} at version {version}")
        return True

    def wake(self) -> None:
        """Ends waits at once (after `stopping` is set)."""
        with self.known:
            self.known.notify_all()

    def start(self) -> None:
        """Starts a Watch thread per shard, now and for each shard found later."""
        self.router.each_shard(self._start_watcher)

    def _start_watcher(self, i: int, client: ShardClient) -> None:
        threading.Thread(
            target=self._watch, args=(i, client), name=f"watch-{i}", daemon=True
        ).start()

    def _watch(self, i: int, client: ShardClient) -> None:
        """Follows shard i's versions of the fragments the map gives it for as long as we
        run, reconnecting with backoff, and again at once when the map changes."""
        router, failures = self.router, 0
        while not self.stopping.is_set():
            with router.lock:
                generation = router.generation
            fragments = list(router.fragment_map.fragments_of(i))
            if not fragments:  # owns nothing (yet, or any more): wait for the map to change
                with router.changed:
                    router.changed.wait_for(
                        functools.partial(self._map_changed, generation), MAP_WAIT_SECONDS
                    )
                continue
            try:
                call = router.call_shard(lambda: client.watch(fragments))
            except Stopped:
                return
            router.add_stream(call)
            try:
                heard = self._follow(call)
                if heard is None:
                    return
                if heard:
                    failures = 0
            except grpc.RpcError as e:
                router.moved(-1, e)  # a fragment moved away: the map changes, the streams reopen
            if self.stopping.is_set():
                return
            if router.generation != generation:  # cancelled for the new map: reopen now
                failures = 0
                continue
            failures += 1
            self.stopping.wait(backoff(failures, self.max_backoff))

    def _map_changed(self, generation: int) -> bool:
        """Whether the map moved a fragment since `generation`, or the learner is stopping."""
        return self.router.generation != generation or self.stopping.is_set()

    def _follow(self, call: Iterable[pb.WatchResponse]) -> int | None:
        """Notes each version a Watch stream announces until it ends; returns how many,
        or None if `on_notice` says the learner is going away."""
        heard = 0
        for notice in call:
            heard += 1
            self.note(notice.fragment, notice.version)
            if self.on_notice is not None and not self.on_notice(notice.fragment, notice.version):
                return None
        return heard
