"""Whole pushes handed to the shard's worker threads in batches (`Shard.push_many`).

A push handed to a worker on its own cost the shard a thread handoff there, an fsync
wait and a wake-up of the event loop back: with a crowd of learners pushing tiny frames,
more CPU than the push's work (context switches were ~40 % of the shard's CPU). Here a
push waits on the event loop while BATCHES_IN_FLIGHT batches run; the pushes that
arrived meanwhile go together in the next: one handoff, one fsync and one wake-up of
the loop per batch. Each push is still judged, logged and answered on its own, in the
order it arrived, and each answer goes out only after the fsync that covers its record
(`Shard.push_many`). A push alone on an idle shard runs at once, as before. A push of
ALONE_BYTES of frame or more, or one in parts, takes a worker of its own at once, as
every push did before: its own work dwarfs a handoff, big pushes to different fragments
decompress and merge side by side, and a part may wait for its push's other parts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Sequence

from atoll.server.fragment import Answer
from atoll.server.refusal import ShardError, Why, broken
from atoll.server.shard import Pushed, PushHeader, Shard

log = logging.getLogger("atoll.syncer")
BATCHES_IN_FLIGHT = 1  # batches running at once (1 took the least CPU per push of 1, 2, 8)
ALONE_BYTES = 64 * 1024  # a push with this many frame bytes or more is not batched

Waiting = tuple[PushHeader, Sequence[bytes], "asyncio.Future[Answer]"]


class PushBatches:
    """Runs whole pushes on `workers` in batches; `push` is called on the event loop."""

    def __init__(
        self,
        shard: Shard,
        workers: concurrent.futures.Executor,
        in_flight: int = BATCHES_IN_FLIGHT,
    ):
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        self.shard, self.workers, self.in_flight = shard, workers, in_flight
        self.waiting: list[Waiting] = []
        self.running = 0  # batches handed to workers and not yet answered

    async def push(self, h: PushHeader, frame: Sequence[bytes]) -> Answer:
        """The push's answer once its record is durable; raises its ShardError."""
        answer: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self.waiting.append((h, frame, answer))
        if h.parts or sum(map(len, frame)) >= ALONE_BYTES:  # see the module's docstring
            self._start([self.waiting.pop()], batch_slot=False)  # a worker of its own at once
        elif self.running < self.in_flight:
            self._start(self.waiting)
            self.waiting = []
        return await answer

    def _start(self, batch: list[Waiting], *, batch_slot: bool = True) -> None:
        """Hands `batch` to a worker; `batch_slot`: it counts against BATCHES_IN_FLIGHT."""
        loop = asyncio.get_running_loop()
        pushes = [(h, frame) for h, frame, _ in batch]
        try:
            job = loop.run_in_executor(self.workers, self._run, pushes)
        except RuntimeError as e:  # the pool is shut down: the server is stopping
            self._answer(batch, [ShardError(Why.BROKEN, f"the shard failed: {e}")] * len(batch))
            return
        self.running += batch_slot
        job.add_done_callback(functools.partial(self._finished, batch, batch_slot))

    def _run(self, pushes: list[tuple[PushHeader, Sequence[bytes]]]) -> list[Pushed]:
        """On a worker: the batch's answers; each push timed from the batch's start (the
        pushes before it in the batch and the fsync they share are part of its wait)."""
        started = time.perf_counter()
        out = self.shard.push_many(pushes)
        seconds = time.perf_counter() - started
        for _ in out:
            self.shard.metrics.push_seconds.observe(seconds)
        return out

    def _finished(
        self, batch: list[Waiting], batch_slot: bool, job: asyncio.Future[list[Pushed]]
    ) -> None:
        """On the event loop: answers the batch's pushes, then starts the next batch."""
        self.running -= batch_slot
        if job.cancelled():
            why = "the shard failed: its pushes' batch was cancelled"
            self._answer(batch, [ShardError(Why.BROKEN, why)] * len(batch))
        elif (e := job.exception()) is not None:
            log.error("a batch of pushes failed", exc_info=e)
            self._answer(batch, [broken(e)] * len(batch))
        else:
            self._answer(batch, job.result())
        if self.waiting and self.running < self.in_flight:
            self._start(self.waiting)
            self.waiting = []

    @staticmethod
    def _answer(batch: list[Waiting], outcomes: Sequence[Pushed]) -> None:
        for (_, _, answer), outcome in zip(batch, outcomes, strict=True):
            if answer.done():  # its caller is gone (cancelled); the push ran all the same
                continue
            if isinstance(outcome, ShardError):
                answer.set_exception(outcome)
            else:
                answer.set_result(outcome)
