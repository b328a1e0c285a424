"""PushStream over a real gRPC server on a socket: pushes on one stream are answered as
Push answers them (in order, identity echoed), a refused push ends the stream with Push's
status, a push retried after the stream broke is counted once, a shard without the
method is pushed to by Push, and a SIGKILL mid-stream keeps exactly the answered pushes.
"""

from __future__ import annotations

import queue
import threading

import grpc
import numpy as np
import pytest
from syncer_helpers import (
    DEADLINE,
    PLAN,
    client_push,
    connect,
    describe,
    free_port,
    init,
    push_requests,
    serving_shard,
    syncer_processes,
)

from atoll.server.service import SyncerServicer
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import ShardClient

# rounds never close here (quorum 3 of the 1-2 learners pushing, no grace): a fragment's
# open round counts exactly the pushes the shard holds
SETTINGS = dict(quorum=3, grace_factor=0.0, lease_seconds=600.0)


class Stream:
    """A raw PushStream whose messages the test sends one push at a time."""

    def __init__(self, stub, metadata=()):
        self.sent: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.PushStream(
            iter(self.sent.get, None), timeout=DEADLINE, metadata=list(metadata)
        )

    def push(self, p: int, seq: int, learner: str = "a", **header) -> pb.PushResponse:
        for message in requests(p, seq, learner, **header):
            self.sent.put(message)
        return next(self.call)

    def close(self) -> None:
        self.sent.put(None)


def requests(p: int, seq: int, learner: str = "a", **header) -> list[pb.PushRequest]:
    delta = np.random.default_rng([p, seq]).standard_normal(PLAN.fragment_sizes[p]) * 0.01
    frame = codec.encode(delta.astype(np.float32))
    return push_requests(PLAN, p, learner, seq, 0, frame, delta.size, chunks=2, **header)


def seed(stub) -> None:
    for p, n in enumerate(PLAN.fragment_sizes):
        init(stub, PLAN, p, np.zeros(n, np.float32))


def round_sizes(stub, metadata=None) -> list[int]:
    fragments = describe(stub, metadata).fragments
    return [f.round_size for f in sorted(fragments, key=lambda f: f.fragment)]


@pytest.fixture
def shard(tmp_path):
    with serving_shard(tmp_path / "data", **SETTINGS) as server:
        channel, stub = connect(server.port)
        seed(stub)
        yield server, stub
        channel.close()


def test_pushes_on_one_stream_are_answered_in_order_and_a_retry_counts_once(shard):
    server, stub = shard
    stream = Stream(stub)
    answers = [stream.push(p, seq=p + 1) for p in range(3)]
    retry = stream.push(0, seq=1)  # the same push again: answered, not counted again
    stream.close()
    assert [a.reason for a in answers] == [pb.PUSH_REASON_FRESH] * 3
    assert [(a.fragment, a.seq) for a in answers] == [(0, 1), (1, 2), (2, 3)]
    assert retry.reason == pb.PUSH_REASON_DUPLICATE and (retry.fragment, retry.seq) == (0, 1)
    assert round_sizes(stub) == [1, 1, 1, 0]
    assert list(stream.call) == []  # the learner closed its side: the stream ends OK
    assert stream.call.code() == grpc.StatusCode.OK


def test_a_refused_push_ends_the_stream_with_push_s_status(shard):
    server, stub = shard
    stream = Stream(stub)
    assert stream.push(0, seq=1).accepted
    with pytest.raises(grpc.RpcError) as refused:
        stream.push(1, seq=2, fragment=9)  # a fragment the plan does not have
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as bad:  # and a push whose chunks overrun its header
        Stream(stub).push(1, seq=3, frame_bytes=8)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert round_sizes(stub) == [1, 0, 0, 0]
    # the learner's client opens a new stream for its next push, which is taken
    client = ShardClient(f"127.0.0.1:{server.port}", "a", deadline=DEADLINE)
    with pytest.raises(grpc.RpcError) as again:
        header, frame, _ = requests(1, seq=4, fragment=9)
        client.push(header.header, frame.chunk + _.chunk)
    assert again.value.code() == grpc.StatusCode.NOT_FOUND
    assert client_push(client, 1, seq=5, base=0).accepted
    assert client_push(client, 2, seq=6, base=0).accepted
    client.close()
    assert round_sizes(stub) == [1, 1, 1, 0]


def test_a_push_retried_after_its_stream_broke_is_counted_once(shard):
    server, stub = shard
    client = ShardClient(f"127.0.0.1:{server.port}", "a", deadline=DEADLINE)
    first = client_push(client, 0, seq=1, base=0)
    opened = client.streams._call
    assert first.reason == pb.PUSH_REASON_FRESH and opened is not None
    assert client_push(client, 1, seq=2, base=0).accepted
    assert client.streams._call is opened  # both pushes went on one stream
    opened.call.cancel()  # the stream breaks; the answer to seq 2 was the learner's
    again = client_push(client, 1, seq=2, base=0)
    assert again.reason == pb.PUSH_REASON_DUPLICATE and again.version == 0
    assert client.streams._call is not opened
    client.close()
    assert round_sizes(stub) == [1, 1, 0, 0]


def test_a_token_bound_to_another_learner_is_refused_on_the_stream(tmp_path):
    tokens = tmp_path / "tokens"
    ta, tb = "a" * 40, "b" * 40
    tokens.write_text(f"a {ta}\nb {tb}\n")
    with serving_shard(tmp_path / "data", token_file=tokens, **SETTINGS) as server:
        channel, stub = connect(server.port)
        auth = [("authorization", f"Bearer {ta}")]
        for p, n in enumerate(PLAN.fragment_sizes):
            init(stub, PLAN, p, np.zeros(n, np.float32), metadata=auth)
        with pytest.raises(grpc.RpcError) as unknown:
            Stream(stub).push(0, seq=1)
        assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stream = Stream(stub, auth)
        assert stream.push(0, seq=1).accepted
        with pytest.raises(grpc.RpcError) as denied:
            stream.push(1, seq=1, learner="b")
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert round_sizes(stub, auth) == [1, 0, 0, 0]
        channel.close()


def test_a_shard_without_push_stream_is_pushed_to_by_push(tmp_path, monkeypatch):
    called = threading.Event()

    async def older_shard(self, request_iterator, context):
        called.set()
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        yield  # pragma: no cover

    monkeypatch.setattr(SyncerServicer, "PushStream", older_shard)
    with serving_shard(tmp_path / "data", **SETTINGS) as server:
        channel, stub = connect(server.port)
        seed(stub)
        client = ShardClient(f"127.0.0.1:{server.port}", "a", deadline=DEADLINE)
        assert client_push(client, 0, seq=1, base=0).accepted
        assert called.is_set() and not client.streams.offered
        assert client_push(client, 1, seq=2, base=0).accepted
        client.close()
        assert round_sizes(stub) == [1, 1, 0, 0]
        channel.close()


def test_sigkill_mid_stream_keeps_exactly_the_answered_pushes(tmp_path):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]
    with syncer_processes(tmp_path) as start:
        victim = start(tmp_path / "data", *flags)
        channel, stub = connect(victim.port)
        seed(stub)
        stream = Stream(stub)
        answered = [stream.push(p, seq=p + 1) for p in range(3)]
        assert all(a.accepted for a in answered)
        header, first_chunk, _ = requests(3, seq=4)
        stream.sent.put(header)
        stream.sent.put(first_chunk)  # fragment 3's push is on the wire, its last chunk not
        assert victim.kill() == -9
        with pytest.raises(grpc.RpcError):
            next(stream.call)
        channel.close()
        again = start(tmp_path / "data", *flags)
        channel, stub = connect(again.port)
        assert round_sizes(stub) == [1, 1, 1, 0]  # the three answered, not the cut one
        stream = Stream(stub)
        retried = [stream.push(p, seq=p + 1) for p in range(4)]
        stream.close()
        reasons = [a.reason for a in retried]
        assert reasons == [pb.PUSH_REASON_DUPLICATE] * 3 + [pb.PUSH_REASON_FRESH]
        assert round_sizes(stub) == [1, 1, 1, 1]
        channel.close()


def test_a_learner_s_stream_follows_its_shard_through_a_restart(tmp_path):
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]
    flags.append(f"--listen=127.0.0.1:{port}")  # the same address after the restart
    with syncer_processes(tmp_path) as start:
        shard = start(tmp_path / "data", *flags)
        channel, stub = connect(port)
        seed(stub)
        client = ShardClient(f"127.0.0.1:{port}", "a", deadline=DEADLINE)
        assert client_push(client, 0, seq=1, base=0).accepted
        before = client.streams._call
        assert shard.stop() == 0  # SIGTERM: the idle stream ends with the shard
        start(tmp_path / "data", *flags)
        assert client_push(client, 1, seq=2, base=0).accepted  # on a new stream
        assert client_push(client, 0, seq=1, base=0).reason == pb.PUSH_REASON_DUPLICATE
        assert client.streams._call is not before and client.streams.offered
        client.close()
        assert round_sizes(stub) == [1, 1, 0, 0]
        channel.close()
