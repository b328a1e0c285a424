"""`atoll bench learners --transport stream`: a client process's learners each push on a
PushStream of their own, as the learner's client does (wire/push_stream.py), one push at a
time per stream, as one message (its frame in its header) once its stream's shard said it
takes that, as the client sends it. grpc.aio, so a thousand open streams cost coroutines, not threads; the
same pushes in flight at once as the Push calls' threads (`inflight`). A learner has a
connection of its own; here up to CHANNEL_STREAMS learners share one, below the shard's
streams per connection (--max-concurrent-streams, 64): past it a new stream waits for
one to end, and a push stream does not end."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from atoll.wire import syncer_pb2 as pb
from atoll.wire import syncer_pb2_grpc as pb_grpc
from atoll.wire.push_stream import in_header

Result = dict[str, Any]
CHANNEL_STREAMS = 48  # learners' streams open on one connection at most


class StreamPushes:
    """One client process's learners' pushes, each learner on a stream of its own."""

    def __init__(
        self,
        address: str,
        requests: Callable[[str, int, int, bool, bool], list[pb.PushRequest]],
        inflight: int,
        deadline: float,
    ):
        self.requests, self.inflight, self.deadline = requests, inflight, deadline
        self.address = address
        self.loop = asyncio.new_event_loop()
        self.streams: dict[str, tuple[Any, int]] = {}  # learner -> (its call, its channel)
        self.header_frames: set[str] = set()  # learners whose stream takes frames in headers
        self.channels: list[tuple[grpc.aio.Channel, pb_grpc.SyncerStub, list[int]]] = []

    def _open(self, learner: str) -> Any:
        """A stream for `learner`, on the first connection with room for one more."""
        free = [i for i, (_, _, n) in enumerate(self.channels) if n[0] < CHANNEL_STREAMS]
        if not free:  # a connection of its own, not one shared with the other channels
            options = [("grpc.use_local_subchannel_pool", 1)]
            channel = grpc.aio.insecure_channel(self.address, options=options)
            self.channels.append((channel, pb_grpc.SyncerStub(channel), [0]))
            free = [len(self.channels) - 1]
        _, stub, open_streams = self.channels[free[0]]
        open_streams[0] += 1
        call = stub.PushStream()
        self.streams[learner] = (call, free[0])
        return call

    def _drop(self, learner: str) -> Any:
        self.header_frames.discard(learner)
        call, i = self.streams.pop(learner, (None, -1))
        if call is not None:
            self.channels[i][2][0] -= 1
        return call

    async def push(self, learner: str, p: int, base: int, last: bool, steady: bool) -> Result:
        """One push on the learner's stream (opened on its first); {ms, accepted, reason,
        version, p} or {failed: status name} (the stream is dropped, the next opens anew)."""
        messages = self.requests(learner, p, base, last, steady)
        if learner in self.header_frames:  # as the learner's client sends it
            messages = list(in_header(messages))
        started = self.loop.time()
        try:
            async with asyncio.timeout(self.deadline):
                call = self.streams[learner][0] if learner in self.streams else self._open(learner)
                for message in messages:
                    await call.write(message)
                ack = await call.read()
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            self._drop(learner)
            return {"failed": e.code().name if isinstance(e, grpc.aio.AioRpcError) else "TIMEOUT"}
        if ack is grpc.aio.EOF:
            self._drop(learner)
            return {"failed": "EOF"}
        ms = (self.loop.time() - started) * 1e3
        if ack.header_frames:
            self.header_frames.add(learner)
        reason = pb.PushReason.Name(ack.reason).removeprefix("PUSH_REASON_").lower()
        return {
            "ms": ms, "accepted": ack.accepted, "reason": reason, "version": ack.version, "p": p,
        }  # fmt: skip

    async def _leave(self, learner: str) -> None:
        call = self._drop(learner)
        if call is not None:
            await call.done_writing()
            await call.code()  # the shard ends the stream: it has left

    def _each(self, jobs: list[Callable[[], Awaitable[list[Result]]]]) -> list[Result]:
        """Runs the jobs, `inflight` at a time; their results in the jobs' order."""

        async def run() -> list[list[Result]]:
            limit = asyncio.Semaphore(self.inflight)

            async def one(job: Callable[[], Awaitable[list[Result]]]) -> list[Result]:
                async with limit:
                    return await job()

            return await asyncio.gather(*(one(job) for job in jobs))

        return [r for done in self.loop.run_until_complete(run()) for r in done]

    def wave(self, learners: list[str], versions: list[int]) -> list[Result]:
        """Every learner pushes every fragment once, fragment by fragment."""
        out = []
        for p, base in enumerate(versions):
            out += self._each([self._one(m, p, base) for m in learners])
        return out

    def _one(self, m: str, p: int, base: int) -> Callable[[], Awaitable[list[Result]]]:
        async def job() -> list[Result]:
            return [await self.push(m, p, base, False, True)]

        return job

    def churn(self, learners: list[str], versions: list[int], pushes: int) -> list[Result]:
        """Each learner pushes every fragment `pushes` times back to back and leaves."""
        latest = list(versions)

        def visit(m: str) -> Callable[[], Awaitable[list[Result]]]:
            async def job() -> list[Result]:
                done = []
                for k in range(pushes):
                    for p in range(len(latest)):
                        r = await self.push(m, p, latest[p], k == pushes - 1, False)
                        latest[p] = max(latest[p], r.get("version", 0))
                        done.append(r)
                await self._leave(m)
                return done

            return job

        return self._each([visit(m) for m in learners])

    def close(self) -> None:
        async def close() -> None:
            for learner in list(self.streams):
                await self._leave(learner)
            for channel, _, _ in self.channels:
                await channel.close()

        self.loop.run_until_complete(close())
        self.loop.close()
