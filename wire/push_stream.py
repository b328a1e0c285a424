"""A learner's pushes to one shard on one long-lived PushStream call.

One gRPC call per push costs a Python shard about as much CPU as the push's own work
(call setup, an HTTP/2 stream, metadata, a dozen context switches); on a stream kept open
a push is two messages and its answer one. Pushes go one at a time (a second push while
one is in flight takes a Push call of its own), so the answer read next is the push's;
its echoed fragment, seq and part say so.

A stream found ended before a push, or that ends UNAVAILABLE with one in flight after it
carried others (the shard restarted, a link dropped), is reopened and the push sent there,
once (pushes dedupe by seq); any other failure raises the push's RpcError, as a Push call
would, for the caller to branch on or retry. A refusal ends the stream on the shard's side;
the next push opens another. A shard that does not offer PushStream (UNIMPLEMENTED: an older shard) is not asked
again: `push` returns None and the caller uses Push. Once a stream's answer says its shard
takes a frame in the header (`header_frames`), a small push goes on it as one message
(`in_header`): one read fewer for the shard; a new stream starts with header and chunks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from atoll.wire import syncer_pb2 as pb

_END = None  # put on a stream's request queue: the learner closes its side
HEADER_FRAME_BYTES = 64 * 1024  # a frame this size or smaller may travel in its header


def in_header(messages: Sequence[pb.PushRequest]) -> Sequence[pb.PushRequest]:
    """A push's messages (a header, then its frame in chunks) as one message, the frame in
    the header, where the frame is one chunk of HEADER_FRAME_BYTES or fewer; else as they
    are. Only for a shard that said it takes it (PushResponse.header_frames)."""
    if len(messages) != 2 or messages[1].WhichOneof("kind") != "chunk":
        return messages
    if len(messages[1].chunk) > HEADER_FRAME_BYTES:
        return messages
    joined = pb.PushRequest()
    joined.header.CopyFrom(messages[0].header)
    joined.header.frame = messages[1].chunk
    return [joined]


class StreamTimeout(grpc.RpcError):  # type: ignore[misc]  # grpc ships no types
    """A push on a stream not answered within the deadline (the stream is cancelled):
    DEADLINE_EXCEEDED, as a Push call past its deadline raises."""

    def __init__(self, seconds: float):
        super().__init__(f"no answer on the push stream within {seconds:g} s")
        self.seconds = seconds

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return str(self)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class _Call:
    """One open PushStream: its request queue, and its answers read on a thread."""

    def __init__(self, open_call: Callable[[Iterator[pb.PushRequest]], Any]):
        self.requests: queue.SimpleQueue[Sequence[pb.PushRequest] | None] = queue.SimpleQueue()
        self.answers: queue.SimpleQueue[pb.PushResponse | grpc.RpcError] = queue.SimpleQueue()
        self.call = open_call(self._messages())
        self.used = False  # a push was answered on it
        self.header_frames = False  # its shard said it takes a frame in the header
        threading.Thread(target=self._read, name="push-stream", daemon=True).start()

    def _messages(self) -> Iterator[pb.PushRequest]:
        while (push := self.requests.get()) is not _END:
            yield from push

    def _read(self) -> None:
        try:
            for answer in self.call:
                self.answers.put(answer)
        except grpc.RpcError as e:
            self.answers.put(e)
        finally:
            self.requests.put(_END)  # grpc's thread sending requests ends too

    def ended(self) -> bool:
        return bool(self.call.done())

    def close(self) -> None:
        self.requests.put(_END)
        self.call.cancel()


class PushStreams:
    """The push stream of one ShardClient (thread-safe)."""

    def __init__(self, open_call: Callable[[Iterator[pb.PushRequest]], Any], deadline: float):
        self.open_call, self.deadline = open_call, deadline
        self.offered = True  # False once the shard answered UNIMPLEMENTED
        self._lock = threading.Lock()
        self._call: _Call | None = None
        self._closed = False

    def push(self, messages: Sequence[pb.PushRequest]) -> pb.PushResponse | None:
        """The push's answer; None when this stream is busy with another push or the shard
        does not offer streams (send it as a Push call). Raises grpc.RpcError as Push does."""
        if not self.offered or not self._lock.acquire(blocking=False):
            return None
        try:
            call = self._call
            if call is None or call.ended():  # never opened, or ended while idle: reopen
                call = self._open()
            answer = self._send(call, messages)
            if answer is None and call.used:  # a stale stream: its shard went away since
                call = self._open()
                answer = self._send(call, messages)
            if answer is None:
                self.offered = False  # an older shard: Push from now on
            return answer
        finally:
            self._lock.release()

    def _open(self) -> _Call:
        """A new stream, made this client's; cancelled at once where close() came while it
        opened (close sets _closed before it reads _call, this sets _call before it reads
        _closed: one of the two sees the other), so the push on it raises CANCELLED."""
        call = self._call = _Call(self.open_call)
        if self._closed:
            call.close()
        return call

    def _send(self, call: _Call, messages: Sequence[pb.PushRequest]) -> pb.PushResponse | None:
        """The answer on `call`; None where the call is stale or unimplemented (see push)."""
        call.requests.put(in_header(messages) if call.header_frames else messages)
        try:
            answer = call.answers.get(timeout=self.deadline)
        except queue.Empty:
            call.close()
            self._call = None
            raise StreamTimeout(self.deadline) from None
        if isinstance(answer, grpc.RpcError):
            self._call = None
            code = answer.code()
            if code == grpc.StatusCode.UNIMPLEMENTED or (
                call.used and code == grpc.StatusCode.UNAVAILABLE
            ):
                return None
            raise answer
        header = messages[0].header
        if (answer.fragment, answer.seq, answer.part) != (header.fragment, header.seq, header.part):
            call.close()
            self._call = None
            raise RuntimeError(
                f"push stream answered fragment {answer.fragment} seq {answer.seq} part "
                f"{answer.part}, not the push sent (fragment {header.fragment} seq {header.seq})"
            )
        call.used, call.header_frames = True, answer.header_frames
        return answer

    def close(self) -> None:
        """Cancels the stream, a push in flight on it too (it raises CANCELLED at once, as a
        Push call does when its channel closes); later pushes are not streamed."""
        self.offered = False
        self._closed = True
        call, self._call = self._call, None
        if call is not None:
            call.close()
