"""Bad input over real gRPC: each malformed call gets its precise status (or refusal)
and changes nothing; and Watch reports versions as rounds close.

"Changes nothing" is checked twice: the visible state (Describe versions and open
rounds, snapshot and delta Pull bytes) is the same before and after, and once the open
round is completed the shard holds bit for bit what a shard that never saw the bad call
holds (so no hidden state, such as the round accumulator, moved either).
"""

from __future__ import annotations

import queue
import struct
import threading

import grpc
import numpy as np
import pytest
import zstandard
from syncer_helpers import (
    DEADLINE,
    PLAN,
    connect,
    describe,
    init,
    init_requests,
    pull,
    push,
    push_requests,
    shard_state,
    status_of,
)

from atoll.server.config import ShardConfig
from atoll.server.service import SyncerServer
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import MAP_VERSION_KEY, OWNER_KEY

# Shard 0 of 2 owns fragments 0 and 2; fragment 1 lives on shard 1; the plan has 4.
CONFIG = dict(
    shard_index=0,
    num_shards=2,
    quorum=2,
    grace_factor=0.0,
    max_staleness=2,
    staleness_discount=1.0,
    max_message_bytes=1 << 20,
)
FRAME_LIMIT = CONFIG["max_message_bytes"] * 64  # what the servicer allows one frame
P, OTHER_SHARDS, UNKNOWN = 0, 1, 9
SIZE = PLAN.fragment_sizes[P]
# (learner, seq, base) of the pushes that bring fragment 0 to version 3 with l0 alone in
# round 4; FINISH completes that round. l1's seq 3 is stale by one (discounted).
SETUP = [
    ("l0", 1, 0),
    ("l1", 1, 0),
    ("l0", 2, 1),
    ("l1", 2, 1),
    ("l0", 3, 2),
    ("l1", 3, 1),
    ("l0", 4, 3),
]
FINISH = ("l1", 4, 3)
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
PRECONDITION, EXHAUSTED = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED


def delta(learner: str, seq: int, size: int = SIZE) -> np.ndarray:
    return (np.random.default_rng([int(learner[1:]), seq]).standard_normal(size) * 0.01).astype(
        np.float32
    )


def good_push(stub, learner: str, seq: int, base: int) -> pb.PushResponse:
    return push(stub, PLAN, P, learner, seq, base, delta(learner, seq))


class Running:
    """An in-process shard at the SETUP state, and its acks."""

    def __init__(self, directory):
        self.server = SyncerServer(ShardConfig(data_dir=directory, listen="127.0.0.1:0", **CONFIG))
        self.server.start()
        self.channel, self.stub = connect(self.server.port)
        for p in (0, 2):  # as learner "a": its lease keeps a lone contributor's round open
            init(
                self.stub,
                PLAN,
                p,
                np.random.default_rng(p).standard_normal(PLAN.fragment_sizes[p]).astype(np.float32),
            )
        self.acks = {
            (learner, seq): good_push(self.stub, learner, seq, base) for learner, seq, base in SETUP
        }
        assert all(a.accepted for a in self.acks.values())
        assert self.version() == 3 and describe(self.stub).fragments[0].round_size == 1

    def version(self) -> int:
        return describe(self.stub).fragments[0].version

    def finish(self) -> dict:
        """Completes the open round; returns the shard's whole visible state."""
        ack = good_push(self.stub, *FINISH)
        assert ack.accepted and ack.version == 4, ack
        return shard_state(self.stub)

    def close(self):
        self.channel.close()
        self.server.stop(grace=0)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """The state after SETUP + FINISH with nothing in between."""
    running = Running(tmp_path_factory.mktemp("golden"))
    try:
        return running.finish()
    finally:
        running.close()


@pytest.fixture
def shard(tmp_path):
    running = Running(tmp_path / "shard")
    yield running
    running.close()


# --- crafted frames ---


def _recompress(frame: bytes, body: bytes) -> bytes:
    return frame[: codec.HEADER_BYTES] + zstandard.ZstdCompressor(write_content_size=True).compress(
        body
    )


def fp32_frame_holding(values: np.ndarray) -> bytes:
    """A well-formed FP32 frame around values the encoder would refuse (NaN, Inf)."""
    template = codec.encode(np.zeros(values.size, np.float32), codec.Codec.FP32)
    return _recompress(template, values.astype("<f4").tobytes())


def int4_frame_with_scale(bits: int) -> bytes:
    """An INT4 frame whose first block's bfloat16 scale is `bits` (0x7f80: +Inf)."""
    frame = codec.encode(delta("l9", 1))
    body = bytearray(zstandard.ZstdDecompressor().decompress(frame[codec.HEADER_BYTES :]))
    body[0:2] = struct.pack("<H", bits)  # scales come first in the body
    return _recompress(frame, bytes(body))


def raw_push(
    stub, frame: bytes, *, num_params: int = SIZE, codec_id: int = pb.CODEC_INT4, **header
):
    msgs = push_requests(
        PLAN,
        header.pop("fragment", P),
        header.pop("learner", "x"),
        header.pop("seq", 1),
        header.pop("base", 3),
        frame,
        num_params,
        codec_id=codec_id,
        **header,
    )
    return stub.Push(iter(msgs), timeout=DEADLINE)


def push_messages(stub, msgs):
    return stub.Push(iter(msgs), timeout=DEADLINE)


def _fields(header: pb.PushHeader) -> dict:
    return {f.name: v for f, v in header.ListFields()}


GOOD = codec.encode(delta("l9", 1))
HEADER = push_requests(PLAN, P, "x", 1, 3, GOOD, SIZE)[0]

# name -> (call(stub), the status it must fail with)
MALFORMED = {
    "wrong num_params": (lambda s: push(s, PLAN, P, "x", 1, 3, delta("l9", 1, SIZE + 1)), INVALID),
    "frame size differs from num_params": (
        lambda s: raw_push(s, codec.encode(delta("l9", 1, SIZE - 32))),
        INVALID,
    ),
    "NaN in an FP32 frame": (
        lambda s: raw_push(s, fp32_frame_holding(np.full(SIZE, np.nan)), codec_id=pb.CODEC_FP32),
        INVALID,
    ),
    "one Inf in an FP32 frame": (
        lambda s: raw_push(
            s,
            fp32_frame_holding(np.where(np.arange(SIZE) == 7, np.inf, 0.01)),
            codec_id=pb.CODEC_FP32,
        ),
        INVALID,
    ),
    "Inf scale in an INT4 frame": (lambda s: raw_push(s, int4_frame_with_scale(0x7F80)), INVALID),
    "NaN scale in an INT4 frame": (lambda s: raw_push(s, int4_frame_with_scale(0x7FC0)), INVALID),
    "corrupt frame bytes": (
        lambda s: raw_push(s, GOOD[: codec.HEADER_BYTES] + b"\x00" * 40),
        INVALID,
    ),
    "truncated stream": (
        lambda s: push_messages(s, [HEADER, pb.PushRequest(chunk=GOOD[:-5])]),
        INVALID,
    ),
    "chunks beyond frame_bytes": (
        lambda s: push_messages(
            s, [HEADER, pb.PushRequest(chunk=GOOD), pb.PushRequest(chunk=b"x")]
        ),
        INVALID,
    ),
    "chunk before the header": (
        lambda s: push_messages(s, [pb.PushRequest(chunk=GOOD), HEADER]),
        INVALID,
    ),
    "two headers": (
        lambda s: push_messages(s, [HEADER, HEADER, pb.PushRequest(chunk=GOOD)]),
        INVALID,
    ),
    "empty push stream": (lambda s: push_messages(s, []), INVALID),
    "frame_bytes over the shard's limit": (
        lambda s: push_messages(
            s,
            [
                pb.PushRequest(
                    header=pb.PushHeader(
                        **{**_fields(HEADER.header), "frame_bytes": FRAME_LIMIT + 1}
                    )
                )
            ],
        ),
        EXHAUSTED,
    ),
    "one message over max_message_bytes": (
        lambda s: push_messages(s, [HEADER, pb.PushRequest(chunk=bytes((1 << 20) + 1))]),
        EXHAUSTED,
    ),
    "frame_bytes over what the fragment can need": (
        lambda s: push_messages(
            s,
            [
                pb.PushRequest(
                    header=pb.PushHeader(
                        **{
                            **_fields(HEADER.header),
                            "frame_bytes": codec.max_frame_bytes(SIZE, codec.Codec.INT4) + 1,
                        }
                    )
                )
            ],
        ),
        INVALID,
    ),
    "learner_id too long": (lambda s: raw_push(s, GOOD, learner="l" * 129), INVALID),
    "learner_id with a space": (lambda s: raw_push(s, GOOD, learner="l 0"), INVALID),
    "base_version from the future": (
        lambda s: push(s, PLAN, P, "x", 1, 4, delta("l9", 1)),
        INVALID,
    ),
    "unknown fragment": (lambda s: push(s, PLAN, UNKNOWN, "x", 1, 0, delta("l9", 1)), NOT_FOUND),
    "fragment of another shard": (
        lambda s: push(
            s, PLAN, OTHER_SHARDS, "x", 1, 0, delta("l9", 1, PLAN.fragment_sizes[OTHER_SHARDS])
        ),
        PRECONDITION,
    ),
    "wrong plan fingerprint": (
        lambda s: raw_push(s, GOOD, plan_fingerprint="0123456789abcdef"),
        PRECONDITION,
    ),
    "unknown codec id": (lambda s: raw_push(s, GOOD, codec_id=9), INVALID),
    "unspecified codec": (lambda s: raw_push(s, GOOD, codec_id=pb.CODEC_UNSPECIFIED), INVALID),
    "header codec differs from the frame's": (
        lambda s: raw_push(s, codec.encode(delta("l9", 1), codec.Codec.MXFP4)),
        INVALID,
    ),
    "empty learner_id": (lambda s: raw_push(s, GOOD, learner=""), INVALID),
    "zero tokens": (lambda s: raw_push(s, GOOD, tokens=0), INVALID),
    "zero inner_steps": (lambda s: raw_push(s, GOOD, inner_steps=0), INVALID),
    "Pull: have_version ahead": (lambda s: pull(s, P, have=4), INVALID),
    "Pull: unknown fragment": (lambda s: pull(s, UNKNOWN), NOT_FOUND),
    "Pull: fragment of another shard": (lambda s: pull(s, OTHER_SHARDS), PRECONDITION),
    "Init: fragment of another shard": (
        lambda s: init(
            s, PLAN, OTHER_SHARDS, np.zeros(PLAN.fragment_sizes[OTHER_SHARDS], np.float32)
        ),
        PRECONDITION,
    ),
    "Init: wrong plan fingerprint": (
        lambda s: s.Init(
            iter(
                init_requests(
                    PLAN,
                    2,
                    np.zeros(PLAN.fragment_sizes[2], np.float32),
                    plan_fingerprint="0123456789abcdef",
                )
            ),
            timeout=DEADLINE,
        ),
        PRECONDITION,
    ),
    "Init: one message over max_message_bytes": (
        lambda s: s.Init(
            iter(
                [
                    init_requests(PLAN, 2, np.zeros(PLAN.fragment_sizes[2], np.float32))[0],
                    pb.InitRequest(chunk=bytes((1 << 20) + 1)),
                ]
            ),
            timeout=DEADLINE,
        ),
        EXHAUSTED,
    ),
    "Init: frame_bytes over what the fragment can need": (
        lambda s: s.Init(
            iter(
                init_requests(
                    PLAN,
                    2,
                    np.zeros(PLAN.fragment_sizes[2], np.float32),
                    frame_bytes=codec.max_frame_bytes(PLAN.fragment_sizes[2], codec.Codec.FP32) + 1,
                )[:1]
            ),
            timeout=DEADLINE,
        ),
        INVALID,
    ),
    "Init: empty stream": (lambda s: s.Init(iter([]), timeout=DEADLINE), INVALID),
    "Watch: unknown fragment": (
        lambda s: next(s.Watch(pb.WatchRequest(fragments=[UNKNOWN]), timeout=DEADLINE)),
        NOT_FOUND,
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_call_gets_its_status_and_changes_nothing(shard, golden, case):
    call, code = MALFORMED[case]
    before = shard_state(shard.stub)
    assert status_of(lambda: call(shard.stub)) == code
    assert shard_state(shard.stub) == before
    assert shard.finish() == golden


def test_the_codec_refuses_non_finite_values_so_the_bad_frames_are_crafted():
    for bad in (np.nan, np.inf, -np.inf):
        x = np.full(64, 0.5, np.float32)
        x[3] = bad
        for c in codec.Codec:
            with pytest.raises(codec.CodecError, match="non-finite"):
                codec.encode(x, c)
    # The crafted frames are refused for their values alone: the same framing with
    # finite values decodes.
    ones = np.ones(SIZE, np.float32)
    assert codec.decode(fp32_frame_holding(ones)).tobytes() == ones.tobytes()
    with pytest.raises(codec.CodecError, match="non-finite"):
        codec.decode(fp32_frame_holding(np.full(SIZE, np.nan)))
    assert np.isfinite(codec.decode(int4_frame_with_scale(0x3F80))).all()  # scale 1.0
    with pytest.raises(codec.CodecError, match="invalid scale"):
        codec.decode(int4_frame_with_scale(0x7F80))


def test_a_fragment_of_another_shard_is_refused_naming_its_owner_and_map(shard, golden):
    # docs/resharding.md: the refusal says where the fragment is, in the message and in
    # the trailing metadata a learner routes by; Describe carries the whole map
    d = describe(shard.stub)
    assert (d.map_version, list(d.owners)) == (0, [0, 1, 0, 1])
    before = shard_state(shard.stub)
    for call in (
        lambda: push(
            shard.stub, PLAN, OTHER_SHARDS, "x", 1, 0, delta("l9", 1, PLAN.fragment_sizes[1])
        ),
        lambda: pull(shard.stub, OTHER_SHARDS),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == PRECONDITION
        assert "is on shard 1 (map version 0)" in e.value.details()
        trailing = dict(e.value.trailing_metadata())
        assert (trailing[OWNER_KEY], trailing[MAP_VERSION_KEY]) == ("1", "0")
    assert shard_state(shard.stub) == before
    assert shard.finish() == golden


def test_too_stale_push_is_refused_with_its_staleness(shard, golden):
    before = shard_state(shard.stub)
    ack = good_push(shard.stub, "l2", 1, 0)  # 3 versions behind, max_staleness 2
    assert not ack.accepted and ack.reason == pb.PUSH_REASON_TOO_STALE
    assert (ack.version, ack.staleness, ack.weight) == (3, 3, 0.0)
    assert "pull" in ack.detail
    assert shard_state(shard.stub) == before
    assert shard.finish() == golden


def test_second_push_into_the_same_open_round_is_refused(shard, golden):
    before = shard_state(shard.stub)
    ack = good_push(shard.stub, "l0", 5, 3)  # l0 is in round 4 already (seq 4)
    assert not ack.accepted and ack.reason == pb.PUSH_REASON_ALREADY_IN_ROUND and ack.weight == 0.0
    assert shard_state(shard.stub) == before
    assert shard.finish() == golden


def test_duplicate_push_is_answered_as_the_first_and_counted_once(shard, golden):
    before = shard_state(shard.stub)
    for learner, seq, base in (("l0", 4, 3), ("l1", 3, 1)):  # in the open round; in a closed one
        first = shard.acks[(learner, seq)]
        retry = good_push(shard.stub, learner, seq, base)
        assert retry.reason == pb.PUSH_REASON_DUPLICATE and retry.accepted
        assert (retry.version, retry.staleness, retry.weight) == (
            first.version,
            first.staleness,
            first.weight,
        )
    assert shard_state(shard.stub) == before  # round 4 still holds l0 once
    assert shard.finish() == golden


def test_an_older_acknowledged_push_retried_late_is_not_merged_again(shard, golden):
    """l1's seq 2 (base 1) was acked and merged into round 2; arriving again after l1's
    seq 3, it is still the same push (learner, fragment, seq) and must count once:
    answered as a duplicate or refused, never merged into round 4."""
    before = shard_state(shard.stub)
    retry = good_push(shard.stub, "l1", 2, 1)
    assert retry.reason == pb.PUSH_REASON_DUPLICATE or not retry.accepted, retry
    assert shard_state(shard.stub) == before
    assert shard.finish() == golden


# --- Watch ---


class Watcher:
    """Reads a Watch stream on a thread; `next()` is the next notice as a tuple."""

    def __init__(self, stub, fragments=()):
        self.call = stub.Watch(pb.WatchRequest(fragments=list(fragments)), timeout=60)
        self.notices: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for n in self.call:
                self.notices.put((n.fragment, n.version, n.contributors))
        except grpc.RpcError as e:
            self.notices.put(e.code())

    def next(self, timeout: float = 10.0):
        return self.notices.get(timeout=timeout)

    def close(self):
        self.call.cancel()
        self.thread.join(timeout=10)


@pytest.fixture
def watch_server(tmp_path):
    """Quorum 2 and a grace window, so a round waits for every live learner it can."""
    server = SyncerServer(
        ShardConfig(data_dir=tmp_path, listen="127.0.0.1:0", **{**CONFIG, "grace_factor": 1.0})
    )
    server.start()
    channel, stub = connect(server.port)
    yield server, stub
    channel.close()
    server.stop(grace=0)


def test_watch_sends_current_versions_then_one_notice_per_new_version(watch_server):
    _, stub = watch_server
    for p in (0, 2):  # as l2, so l0, l1 and l2 are the live learners below
        init(stub, PLAN, p, np.zeros(PLAN.fragment_sizes[p], np.float32), learner="l2")
    watcher = Watcher(stub)
    try:
        assert {watcher.next(), watcher.next()} == {(0, 0, 0), (2, 0, 0)}
        # No step time reported yet, so no grace: the round closes at quorum with 2.
        push(stub, PLAN, 0, "l0", 1, 0, delta("l0", 1))
        push(stub, PLAN, 0, "l1", 1, 0, delta("l1", 1))
        assert watcher.next() == (0, 1, 2)
        # With a step time the grace window is long (γ·τ·step = 100 s): the round waits
        # for l2, the last live learner, and closes with 3.
        slow = dict(step_seconds=10.0, overlap_steps=10)
        push(stub, PLAN, 0, "l0", 2, 1, delta("l0", 2), **slow)
        assert push(stub, PLAN, 0, "l1", 2, 1, delta("l1", 2), **slow).version == 1  # still open
        assert describe(stub).fragments[0].round_size == 2
        assert push(stub, PLAN, 0, "l2", 1, 1, delta("l2", 1), **slow).version == 2
        assert watcher.next() == (0, 2, 3)
        for learner in ("l0", "l1", "l2"):
            push(stub, PLAN, 2, learner, 1, 0, delta(learner, 1, PLAN.fragment_sizes[2]), **slow)
        assert watcher.next() == (2, 1, 3)  # and nothing came in between
    finally:
        watcher.close()


def test_a_lagging_watcher_is_told_the_newest_version(watch_server, monkeypatch):
    """The contract: a watcher that falls behind is told the newest version, once. Here
    the watcher is held up (as a slow or descheduled servicer thread would be) while
    two rounds close."""
    server, stub = watch_server
    init(stub, PLAN, 0, np.zeros(SIZE, np.float32), learner="l1")  # l1 live: l0 alone never closes
    reads, entered, release = [], threading.Event(), threading.Event()
    versions = server.shard.versions

    def lagging_versions(fragments=None):
        reads.append(1)
        if len(reads) == 2:  # the watcher's read after the first close
            entered.set()
            assert release.wait(timeout=10)
        return versions(fragments)

    monkeypatch.setattr(server.shard, "versions", lagging_versions)
    watcher = Watcher(stub, [0])
    try:
        assert watcher.next() == (0, 0, 0)
        push(stub, PLAN, 0, "l0", 1, 0, delta("l0", 1))
        push(stub, PLAN, 0, "l1", 1, 0, delta("l1", 1))
        assert entered.wait(timeout=10)
        push(stub, PLAN, 0, "l0", 2, 1, delta("l0", 2))
        push(stub, PLAN, 0, "l1", 2, 1, delta("l1", 2))
        assert describe(stub).fragments[0].version == 2
        release.set()
        first = watcher.next()
        try:
            second = watcher.next(timeout=2.0)
        except queue.Empty:
            second = "no further notice"
        assert [first, second] == [(0, 2, 2), "no further notice"]
    finally:
        release.set()
        watcher.close()


# --- Init ---


@pytest.fixture
def fresh(tmp_path):
    """A shard that has seen nothing yet."""
    server = SyncerServer(ShardConfig(data_dir=tmp_path, listen="127.0.0.1:0", **CONFIG))
    server.start()
    channel, stub = connect(server.port)
    yield stub
    channel.close()
    server.stop(grace=0)


def _init_with(stub, p: int, frame: bytes, **header):
    values = np.zeros(PLAN.fragment_sizes[p], np.float32)
    head = init_requests(PLAN, p, values, frame_bytes=len(frame), **header)[0]
    return stub.Init(iter([head, pb.InitRequest(chunk=frame)]), timeout=DEADLINE)


SIZE2 = PLAN.fragment_sizes[2]
BAD_INITS = {
    "NaN in the frame": (
        lambda s: _init_with(s, 2, fp32_frame_holding(np.full(SIZE2, np.nan))),
        INVALID,
    ),
    "frame of the wrong size": (
        lambda s: _init_with(
            s,
            2,
            codec.encode(np.zeros(SIZE2 + 1, np.float32), codec.Codec.FP32),
            num_params=SIZE2 + 1,
        ),
        INVALID,
    ),
    "num_params differs from the fragment's": (
        lambda s: _init_with(
            s, 2, codec.encode(np.zeros(SIZE2, np.float32), codec.Codec.FP32), num_params=SIZE2 + 1
        ),
        INVALID,
    ),
    "header codec differs from the frame's": (
        lambda s: _init_with(
            s, 2, codec.encode(np.zeros(SIZE2, np.float32), codec.Codec.FP32), codec=pb.CODEC_INT4
        ),
        INVALID,
    ),
    "truncated stream": (
        lambda s: s.Init(
            iter([init_requests(PLAN, 2, np.zeros(SIZE2, np.float32))[0]]), timeout=DEADLINE
        ),
        INVALID,
    ),
    "chunk before the header": (
        lambda s: s.Init(
            iter(init_requests(PLAN, 2, np.zeros(SIZE2, np.float32))[::-1]), timeout=DEADLINE
        ),
        INVALID,
    ),
    "unknown fragment": (
        lambda s: s.Init(
            iter(init_requests(PLAN, UNKNOWN, np.zeros(SIZE2, np.float32))), timeout=DEADLINE
        ),
        NOT_FOUND,
    ),
}


@pytest.mark.parametrize("case", list(BAD_INITS))
def test_bad_init_is_refused_and_leaves_the_fragment_unseeded(fresh, case):
    call, code = BAD_INITS[case]
    assert init(fresh, PLAN, 0, np.ones(SIZE, np.float32)).created  # the plan is in place
    before = describe(fresh)
    assert status_of(lambda: call(fresh)) == code
    assert describe(fresh) == before and not before.fragments[1].initialized
    values = np.arange(SIZE2, dtype=np.float32)
    assert init(fresh, PLAN, 2, values).created  # a good one still seeds it
    assert codec.decode(pull(fresh, 2)[1][0][1]).tobytes() == values.tobytes()


@pytest.mark.parametrize("case", ["NaN in the frame", "frame of the wrong size"])
def test_a_refused_first_init_leaves_no_plan_behind(fresh, case):
    """The plan comes with the first Init; when that Init is refused the shard must not
    keep (and log) its plan, or a bad first caller binds the shard to its model."""
    call, code = BAD_INITS[case]
    assert status_of(lambda: call(fresh)) == code
    d = describe(fresh)
    assert (d.plan_fingerprint, d.num_fragments, len(d.fragments)) == ("", 0, 0), d


def test_first_init_with_a_bad_plan_is_refused(fresh):
    values = np.zeros(SIZE, np.float32)
    for header, code in (
        (dict(plan_json="{not json"), INVALID),
        (dict(plan_fingerprint="0123456789abcdef"), INVALID),
    ):
        assert (
            status_of(
                lambda: fresh.Init(iter(init_requests(PLAN, 0, values, **header)), timeout=DEADLINE)
            )
            == code
        )
    assert describe(fresh).num_fragments == 0
