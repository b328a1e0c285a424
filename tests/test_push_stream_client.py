"""wire/push_stream.py against a scripted stream: what a learner's push does when its
stream is stale, silent, cancelled, answers the wrong push, or is not offered."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest

from atoll.wire import syncer_pb2 as pb
from atoll.wire.push_stream import PushStreams, StreamTimeout


class Ended(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class FakeCall:
    """A stream whose shard answers each push by `answer(header)`: a PushResponse, an
    RpcError that ends the stream, or None (silence)."""

    def __init__(self, messages, answer):
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = threading.Event()

        def shard():
            for message in messages:
                if message.WhichOneof("kind") == "header":
                    reply = answer(message.header)
                    if reply is not None:
                        self.out.put(reply)
                    if isinstance(reply, grpc.RpcError):
                        return

        threading.Thread(target=shard, daemon=True).start()

    def __iter__(self):
        while True:
            item = self.out.get()
            if isinstance(item, grpc.RpcError):
                self.finished = True
                raise item
            yield item

    def done(self) -> bool:
        return getattr(self, "finished", False) or self.cancelled.is_set()

    def cancel(self) -> None:
        self.cancelled.set()
        self.out.put(Ended(grpc.StatusCode.CANCELLED))


def push(p: int, seq: int) -> list[pb.PushRequest]:
    header = pb.PushHeader(fragment=p, seq=seq, frame_bytes=1)
    return [pb.PushRequest(header=header), pb.PushRequest(chunk=b"x")]


def echo(header: pb.PushHeader) -> pb.PushResponse:
    return pb.PushResponse(accepted=True, fragment=header.fragment, seq=header.seq)


def streams(
    answer, deadline: float = 5.0, open_delay: float = 0.0
) -> tuple[PushStreams, list[FakeCall]]:
    """A client whose calls answer by `answer`; each call is in `opened` `open_delay`
    seconds before the client has it (a slow open)."""
    opened: list[FakeCall] = []

    def open_call(messages):
        opened.append(FakeCall(messages, answer))
        time.sleep(open_delay)
        return opened[-1]

    return PushStreams(open_call, deadline), opened


def test_pushes_share_one_stream_and_answers_must_name_their_push():
    s, opened = streams(echo)
    assert s.push(push(0, 1)).seq == 1 and s.push(push(1, 2)).seq == 2
    assert len(opened) == 1
    wrong, _ = streams(lambda h: pb.PushResponse(fragment=h.fragment, seq=h.seq + 1))
    with pytest.raises(RuntimeError, match="not the push sent"):
        wrong.push(push(0, 1))


def test_a_stream_that_ended_unavailable_after_carrying_pushes_is_reopened_once():
    answers = iter([echo, lambda h: Ended(grpc.StatusCode.UNAVAILABLE), echo])
    s, opened = streams(lambda h: next(answers)(h))
    assert s.push(push(0, 1)).accepted
    assert s.push(push(0, 2)).seq == 2  # the first stream broke; sent again on a new one
    assert len(opened) == 2
    fresh, _ = streams(lambda h: Ended(grpc.StatusCode.UNAVAILABLE))
    with pytest.raises(grpc.RpcError) as e:  # a new stream that breaks: the caller retries
        fresh.push(push(0, 1))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_refusal_raises_and_the_next_push_opens_a_new_stream():
    answers = iter([lambda h: Ended(grpc.StatusCode.NOT_FOUND), echo])
    s, opened = streams(lambda h: next(answers)(h))
    with pytest.raises(grpc.RpcError) as e:
        s.push(push(9, 1))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert s.push(push(0, 2)).accepted and len(opened) == 2


def test_an_older_shard_is_not_asked_again():
    s, opened = streams(lambda h: Ended(grpc.StatusCode.UNIMPLEMENTED))
    assert s.push(push(0, 1)) is None and not s.offered
    assert s.push(push(0, 2)) is None and len(opened) == 1


def test_a_silent_stream_times_out_and_is_cancelled():
    s, opened = streams(lambda h: None, deadline=0.2)
    with pytest.raises(StreamTimeout) as e:
        s.push(push(0, 1))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert opened[0].cancelled.is_set()


@pytest.mark.parametrize("open_delay", [0.0, 0.3], ids=["opened", "close-while-opening"])
def test_a_busy_stream_sends_the_second_push_by_push_and_close_cuts_the_first(open_delay):
    s, opened = streams(lambda h: None, deadline=30.0, open_delay=open_delay)
    raised: list[BaseException] = []

    def first() -> None:
        try:
            s.push(push(0, 1))
        except grpc.RpcError as e:
            raised.append(e)

    t = threading.Thread(target=first)
    t.start()
    while not opened:
        time.sleep(0.01)
    assert s.push(push(1, 1)) is None  # busy: the caller makes it a Push call
    started = time.monotonic()
    s.close()
    t.join(timeout=5)
    assert not t.is_alive() and time.monotonic() - started < 5
    assert raised[0].code() == grpc.StatusCode.CANCELLED
