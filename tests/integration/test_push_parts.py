"""A real shard taking pushes in parts (server/parts.py) over gRPC: the bits of the same
push whole, each part answered once, a part set kept across kill -9 and finished after
the restart, and one that never completes dropped after its bound."""

from __future__ import annotations

import os
import signal
import time

import grpc
import numpy as np
import pytest
from syncer_helpers import connect, describe, init, push, syncer_processes
from syncer_helpers import pull as _pull

from atoll.server.config import ShardConfig
from atoll.server.service import SyncerServer
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.plan import FragmentPlan, TensorSpec

# One fragment of three tensors, which four processes of a learner hold in pieces.
PLAN = FragmentPlan.build(
    [TensorSpec("w1", (16, 48)), TensorSpec("w2", (48, 16)), TensorSpec("norm", (16,))], 1
)
SIZE = PLAN.fragment_sizes[0]
SHAPES = [tuple(s.spec.shape) for s in PLAN.tensors_of(0)]
OFFSETS = [s.offset for s in PLAN.tensors_of(0)]
# a tensor's position in the fragment (its layout order, not the model's)
W1, W2, NORM = ([s.name for s in PLAN.tensors_of(0)].index(n) for n in ("w1", "w2", "norm"))
# w1 split by columns, w2 by rows (FSDP on two axes), the norm replicated: sent by one
FOUR = [
    [(W1, (0, 12 * k), (16, 12 * (k + 1))), (W2, (12 * k, 0), (12 * (k + 1), 16))]
    + ([(NORM, (), ())] if k == 0 else [])
    for k in range(4)
]
SETTINGS = dict(quorum=2, grace_factor=0.0, lease_seconds=600.0, snapshot_every=2)
DEADLINE = 10.0


def _values(delta: np.ndarray, boxes) -> np.ndarray:
    out = []
    for t, start, stop in boxes:
        tensor = delta[OFFSETS[t] : OFFSETS[t] + int(np.prod(SHAPES[t]))].reshape(SHAPES[t])
        index = tuple(slice(a, b) for a, b in zip(start, stop)) if start else ...
        out.append(tensor[index].reshape(-1))
    return np.concatenate(out)


def part_requests(learner, seq, base, delta, k, layout=FOUR, codec_id=pb.CODEC_FP32, chunks=2):
    """Header + chunks of part k of `layout` of the fragment vector `delta`."""
    frame = codec.encode(_values(delta, layout[k]), codec.Codec(codec_id))
    header = pb.PushHeader(
        learner_id=learner,
        fragment=0,
        base_version=base,
        seq=seq,
        inner_steps=10,
        tokens=1000,
        codec=codec_id,
        num_params=SIZE,
        plan_fingerprint=PLAN.fingerprint,
        frame_bytes=len(frame),
        parts=len(layout),
        part=k,
        boxes=[pb.TensorBox(tensor=t, start=a, stop=b) for t, a, b in layout[k]],
    )
    size = -(-len(frame) // chunks)
    return [pb.PushRequest(header=header)] + [
        pb.PushRequest(chunk=frame[i : i + size]) for i in range(0, len(frame), size)
    ]


def push_part(stub, learner, seq, base, delta, k, **kw) -> pb.PushResponse:
    return stub.Push(iter(part_requests(learner, seq, base, delta, k, **kw)), timeout=DEADLINE)


def _delta(seed) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(SIZE) * 0.01).astype(np.float32)


def _server(tmp_path, name, **kw) -> SyncerServer:
    cfg = ShardConfig(
        shard_index=0,
        num_shards=1,
        data_dir=tmp_path / name,
        listen="127.0.0.1:0",
        **{**SETTINGS, **kw},
    )
    server = SyncerServer(cfg)
    server.start()
    return server


@pytest.fixture
def servers(tmp_path):
    started: list[SyncerServer] = []

    def start(name, **kw):
        started.append(_server(tmp_path, name, **kw))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def _seeded(port) -> tuple[grpc.Channel, object]:
    channel, stub = connect(port)
    assert init(stub, PLAN, 0, np.linspace(-1, 1, SIZE, dtype=np.float32)).created
    return channel, stub


def _published(stub) -> bytes:
    _, frames = _pull(stub, 0)
    return frames[0][1]


def _poll(condition, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout} s")
        time.sleep(0.02)


def test_a_push_in_four_parts_gives_the_state_of_the_same_push_whole(servers):
    split, whole = servers("split"), servers("whole")
    (_, s_stub), (_, w_stub) = _seeded(split.port), _seeded(whole.port)
    for r in range(3):
        a, b = _delta([r, 0]), _delta([r, 1])
        answers = [push_part(s_stub, "a", r + 1, r, a, k) for k in (3, 1, 0)]
        assert [x.reason for x in answers] == [pb.PUSH_REASON_PART_HELD] * 3
        assert all(x.accepted for x in answers)
        # a retried part before the push is in: answered as before, held once
        assert push_part(s_stub, "a", r + 1, r, a, 1).reason == pb.PUSH_REASON_PART_HELD
        last = push_part(s_stub, "a", r + 1, r, a, 2)
        assert last.accepted and last.reason == pb.PUSH_REASON_FRESH and last.weight > 0
        assert describe(s_stub).fragments[0].round_size == 1
        # after: every part retried gets the push's one answer
        again = push_part(s_stub, "a", r + 1, r, a, 0)
        assert again.reason == pb.PUSH_REASON_DUPLICATE and again.weight == last.weight
        assert push(w_stub, PLAN, 0, "a", r + 1, r, a, codec_id=pb.CODEC_FP32).accepted
        assert push(s_stub, PLAN, 0, "b", r + 1, r, b, codec_id=pb.CODEC_FP32).version == r + 1
        assert push(w_stub, PLAN, 0, "b", r + 1, r, b, codec_id=pb.CODEC_FP32).version == r + 1
    s_frag, w_frag = split.shard.fragments[0], whole.shard.fragments[0]
    assert s_frag.params.tobytes() == w_frag.params.tobytes()
    assert s_frag.published.tobytes() == w_frag.published.tobytes()
    assert _published(s_stub) == _published(w_stub)
    pushes = split.shard.metrics.pushes
    assert pushes.labels("fresh")._value.get() == 6  # a and b, 3 rounds: each push once


def test_overlapping_and_gapped_parts_are_invalid_arguments_and_change_nothing(servers):
    server = servers("bad")
    _, stub = _seeded(server.port)
    a = _delta(1)
    assert push_part(stub, "a", 1, 0, a, 0).accepted
    bad = [list(b) for b in FOUR]
    bad[1] = [(W1, (0, 11), (16, 24)), (W2, (12, 0), (24, 16))]  # overlaps part 0's columns
    with pytest.raises(grpc.RpcError) as e:
        push_part(stub, "a", 1, 0, a, 1, layout=bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "overlap" in e.value.details()
    for k in (1, 2):
        assert push_part(stub, "a", 1, 0, a, k).accepted
    bad[3] = [(W1, (0, 36), (16, 48)), (W2, (36, 0), (47, 16))]  # leaves w2's last row out
    with pytest.raises(grpc.RpcError) as e:
        push_part(stub, "a", 1, 0, a, 3, layout=bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "leave" in e.value.details()
    bad[3] = [(W1, (0, 36), (16, 49))]  # past the tensor
    with pytest.raises(grpc.RpcError) as e:
        push_part(stub, "a", 1, 0, a, 3, layout=bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert describe(stub).fragments[0].round_size == 0
    assert push_part(stub, "a", 1, 0, a, 3).reason == pb.PUSH_REASON_FRESH


def test_kill_9_while_parts_arrive_keeps_the_acknowledged_ones_and_merges_nothing_partial(
    tmp_path, servers
):
    reference = servers("reference")
    _, r_stub = _seeded(reference.port)
    a, b = _delta(7), _delta(8)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]
    with syncer_processes(tmp_path) as start:
        victim = start(tmp_path / "victim", *flags)
        channel, stub = _seeded(victim.port)
        assert push_part(stub, "a", 1, 0, a, 0).accepted
        assert push_part(stub, "a", 1, 0, a, 3).accepted

        killed = []

        def cut_mid_stream():
            requests = part_requests("a", 1, 0, a, 1, chunks=3)
            yield from requests[:2]  # the header and one chunk of three
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(True)
            yield from requests[2:]

        with pytest.raises(grpc.RpcError) as e:
            stub.Push(cut_mid_stream(), timeout=DEADLINE)
        assert killed, e.value
        assert victim.kill() == -signal.SIGKILL  # waits for it
        channel.close()
        back = start(tmp_path / "victim", *flags)  # on the same data directory
        channel, stub = connect(back.port)
        info = describe(stub).fragments[0]
        assert info.version == 0 and info.round_size == 0  # nothing partial merged
        # the parts acknowledged before the kill are kept: two more complete the push
        assert push_part(stub, "a", 1, 0, a, 1).reason == pb.PUSH_REASON_PART_HELD
        assert push_part(stub, "a", 1, 0, a, 2).reason == pb.PUSH_REASON_FRESH
        assert push_part(stub, "a", 1, 0, a, 0).reason == pb.PUSH_REASON_DUPLICATE
        assert push(stub, PLAN, 0, "b", 1, 0, b, codec_id=pb.CODEC_FP32).version == 1
        assert push(r_stub, PLAN, 0, "a", 1, 0, a, codec_id=pb.CODEC_FP32).accepted
        assert push(r_stub, PLAN, 0, "b", 1, 0, b, codec_id=pb.CODEC_FP32).version == 1
        assert _published(stub) == _published(r_stub)
        channel.close()


def test_a_part_set_that_never_completes_is_dropped_after_its_bound(servers, caplog):
    # a's process 3 died: its parts never complete. Quorum 2, so b's push alone does not
    # close the round; once a's lease lapses the round closes without a, and a's parts are
    # dropped a lease after the first came, none of them merged.
    server = servers("drop", lease_seconds=1.0, part_wait_leases=1.0)
    reference = servers("reference", quorum=1)
    (_, stub), (_, r_stub) = _seeded(server.port), _seeded(reference.port)
    a, b = _delta(1), _delta(3)
    for k in range(3):
        assert push_part(stub, "a", 1, 0, a, k).accepted
    assert push(stub, PLAN, 0, "b", 1, 0, b, codec_id=pb.CODEC_FP32).version == 0
    dropped = server.shard.metrics.parts_dropped.labels("expired")
    _poll(lambda: dropped._value.get() == 1, "the incomplete parts dropped")
    _poll(lambda: describe(stub).fragments[0].version == 1, "the round closed")
    assert server.shard.fragments[0].last_round_size == 1  # b's push alone
    late = push_part(stub, "a", 1, 0, a, 3)
    assert not late.accepted and late.reason == pb.PUSH_REASON_PARTS_DROPPED
    assert push(r_stub, PLAN, 0, "b", 1, 0, b, codec_id=pb.CODEC_FP32).version == 1
    assert _published(stub) == _published(r_stub)
    assert "dropped 3 of 4 parts of push 1 from a (expired)" in caplog.text
