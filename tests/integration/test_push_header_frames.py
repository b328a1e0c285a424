"""A small push's frame carried in its header (PushHeader.frame), over a real gRPC server
on a socket: the shard says it takes it (PushResponse.header_frames) and answers, merges
and dedupes such a push exactly as one in chunks; a frame of the wrong length, or a chunk
after it, is refused; the learner's client sends one message per push once its stream's
shard said so, and header and chunks to a shard that never did (an older one)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from syncer_helpers import DEADLINE, PLAN, client_push, connect, init, push_requests, serving_shard

from atoll.server import intake
from atoll.wire import codec, push_stream
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import ShardClient
from atoll.wire.push_stream import HEADER_FRAME_BYTES, in_header

SETTINGS = dict(quorum=3, grace_factor=0.0, lease_seconds=600.0)  # no round closes


def requests(p: int, seq: int, chunks: int = 1) -> list[pb.PushRequest]:
    delta = np.random.default_rng([p, seq]).standard_normal(PLAN.fragment_sizes[p]) * 0.01
    frame = codec.encode(delta.astype(np.float32))
    return push_requests(PLAN, p, "a", seq, 0, frame, delta.size, chunks=chunks)


def round_sizes(stub) -> list[int]:
    fragments = stub.Describe(pb.DescribeRequest(), timeout=DEADLINE).fragments
    return [f.round_size for f in sorted(fragments, key=lambda f: f.fragment)]


@pytest.fixture
def stub(tmp_path):
    with serving_shard(tmp_path / "data", **SETTINGS) as server:
        channel, stub = connect(server.port)
        for p, n in enumerate(PLAN.fragment_sizes):
            init(stub, PLAN, p, np.zeros(n, np.float32))
        yield server, stub
        channel.close()


def test_in_header_joins_a_small_one_chunk_push_only():
    small = requests(0, 1)
    (joined,) = in_header(small)
    assert joined.header.frame == small[1].chunk
    joined.header.ClearField("frame")
    assert joined.header == small[0].header  # every other field as sent
    assert in_header(requests(0, 1, chunks=2)) == requests(0, 1, chunks=2)
    big = [small[0], pb.PushRequest(chunk=b"x" * (HEADER_FRAME_BYTES + 1))]
    assert in_header(big) == big


def test_a_frame_in_the_header_is_answered_merged_and_deduped_as_chunks_are(stub):
    _, stub = stub
    answers = stub.PushStream(
        iter([*in_header(requests(0, 1)), *requests(0, 1), *in_header(requests(1, 2))]),
        timeout=DEADLINE,
    )
    first, retry, other = list(answers)
    assert first.header_frames and first.reason == pb.PUSH_REASON_FRESH
    assert retry.reason == pb.PUSH_REASON_DUPLICATE  # the same seq in chunks: counted once
    assert (other.fragment, other.seq, other.reason) == (1, 2, pb.PUSH_REASON_FRESH)
    assert stub.Push(iter(in_header(requests(2, 3))), timeout=DEADLINE).accepted  # Push too
    assert round_sizes(stub) == [1, 1, 1, 0]


def test_a_header_frame_of_the_wrong_length_or_with_a_chunk_after_it_is_refused(stub):
    _, stub = stub
    (short,) = in_header(requests(0, 1))
    short.header.frame_bytes -= 1
    trailing = [*in_header(requests(1, 2)), pb.PushRequest(chunk=b"x")]
    for messages, said in (([short], "frame_bytes says"), (trailing, "no chunk may follow")):
        with pytest.raises(grpc.RpcError) as refused:
            stub.Push(iter(messages), timeout=DEADLINE)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert said in refused.value.details()
    assert round_sizes(stub) == [0, 0, 0, 0]


def sent_messages(monkeypatch) -> list[int]:
    """How many messages each push the client sends on its stream takes."""
    counts: list[int] = []
    real = push_stream.PushStreams._send

    def counted(self, call, messages):
        counts.append(len(in_header(messages) if call.header_frames else messages))
        return real(self, call, messages)

    monkeypatch.setattr(push_stream.PushStreams, "_send", counted)
    return counts


def test_the_client_sends_one_message_once_its_shard_said_it_takes_it(stub, monkeypatch):
    server, stub = stub
    counts = sent_messages(monkeypatch)
    client = ShardClient(f"127.0.0.1:{server.port}", "a", deadline=DEADLINE)
    assert all(client_push(client, p, seq=p + 1, base=0).accepted for p in range(3))
    client.close()
    assert counts == [2, 1, 1] and round_sizes(stub) == [1, 1, 1, 0]


def test_a_shard_that_never_says_so_gets_header_and_chunks(tmp_path, monkeypatch):
    def older(shard, h, a):
        answer = real(shard, h, a)
        answer.header_frames = False  # as a shard before PushHeader.frame answers
        return answer

    real = intake.push_response
    monkeypatch.setattr("atoll.server.service.push_response", older)
    counts = sent_messages(monkeypatch)
    with serving_shard(tmp_path / "data", **SETTINGS) as server:
        channel, stub = connect(server.port)
        for p, n in enumerate(PLAN.fragment_sizes):
            init(stub, PLAN, p, np.zeros(n, np.float32))
        client = ShardClient(f"127.0.0.1:{server.port}", "a", deadline=DEADLINE)
        assert all(client_push(client, p, seq=p + 1, base=0).accepted for p in range(3))
        client.close()
        channel.close()
    assert counts == [2, 2, 2]
