"""Property-based fuzzing of a real `atoll syncer` process over real gRPC.

Random and mutated Push headers and frames, Init, Pull, Watch and Describe messages go
to one shard; every answer must be a well-formed response or a precise status (never
UNKNOWN, INTERNAL or a dropped connection), the shard stays SERVING, takes a good push
afterwards, and after a kill -9 restarts holding every push it acknowledged.
One shard process per test; a bounded number of examples keeps it to seconds.

Each test runs twice: on the fixed examples (derandomized, the same every run) and on a
fresh seed, printed with the test's output; ATOLL_FUZZ_SEED=<seed> replays a failure.
"""

from __future__ import annotations

import math
import os
import random
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from syncer_helpers import (
    DEADLINE,
    PLAN,
    connect,
    describe,
    health_status,
    init,
    pull,
    push,
    push_requests,
    shard_state,
    syncer_processes,
)

from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb

U32, U64 = (1 << 32) - 1, (1 << 64) - 1
FLAGS = ("--quorum=2", "--grace-factor=0", "--lease-seconds=600", "--stream-idle-seconds=5")
# Statuses a shard may answer bad input with; UNKNOWN and INTERNAL are its own failures,
# UNAVAILABLE a crash or a dropped connection.
PRECISE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.ABORTED,
}
FUZZ_SEED = "ATOLL_FUZZ_SEED"  # an integer: the fresh-seed run replays it instead of a new one
FIXED = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

# --- strategies ---

u64 = st.one_of(
    st.integers(0, 16), st.sampled_from([U32, U32 + 1, 1 << 63, U64]), st.integers(0, U64)
)
u32 = st.one_of(st.integers(0, 16), st.sampled_from([U32, 1 << 31]), st.integers(0, U32))
doubles = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e308, 5e-324])
)
# Each strategy mostly draws what a learner would send, so most examples get past the
# first check and reach the codec, the magnitude check, admission, the log and the merge.
VALID_IDS = st.sampled_from(["f0", "f1", "f2", "f3", "f4", "f5"])
learner_ids = st.one_of(VALID_IDS, VALID_IDS, VALID_IDS, st.text(max_size=200))
VALID_CODECS = st.sampled_from([pb.CODEC_INT4, pb.CODEC_MXFP4, pb.CODEC_FP32])
codecs = st.one_of(VALID_CODECS, VALID_CODECS, VALID_CODECS, st.integers(0, 7))
magnitudes = st.sampled_from([1e-3, 1e-3, 1.0, 0.0, 1e-30, 1e6, 1e9, 1e12, 3e38])


@st.composite
def frames(draw, size: int, codec_id: int) -> bytes:
    """A real frame of random values (possibly non-finite or huge), then perhaps mutated."""
    n = draw(st.sampled_from([size] * 6 + [0, 1, size - 1, size + 1, size * 2]))
    scale = draw(magnitudes)
    values = (
        np.random.default_rng(draw(st.integers(0, 2**32 - 1))).standard_normal(max(n, 0)) * scale
    )
    special = draw(st.sampled_from([None] * 6 + [math.nan, math.inf, -math.inf]))
    if special is not None and n:
        values[draw(st.integers(0, n - 1))] = special
    try:
        with np.errstate(over="ignore"):  # beyond float32 becomes inf, which the encoder refuses
            frame = codec.encode(values.astype(np.float32), codec.Codec(codec_id))
    except codec.CodecError:  # values the encoder itself refuses: send bytes instead
        frame = draw(st.binary(max_size=4096))
    mutation = draw(
        st.sampled_from(["none"] * 6 + ["truncate", "flip", "append", "random", "empty"])
    )
    if mutation == "truncate" and frame:
        frame = frame[: draw(st.integers(0, len(frame) - 1))]
    elif mutation == "flip" and frame:
        at = draw(st.integers(0, len(frame) - 1))
        frame = frame[:at] + bytes([frame[at] ^ draw(st.integers(1, 255))]) + frame[at + 1 :]
    elif mutation == "append":
        frame += draw(st.binary(min_size=1, max_size=64))
    elif mutation == "random":
        frame = draw(st.binary(max_size=4096))
    elif mutation == "empty":
        frame = b""
    return frame


@st.composite
def push_streams(draw) -> list[pb.PushRequest]:
    """A Push stream: a header with any field fuzzed, a frame, and a mangled message order."""
    p = draw(st.integers(0, PLAN.num_fragments - 1))
    codec_id = draw(codecs)
    frame = draw(
        frames(PLAN.fragment_sizes[p], codec_id if codec_id in (1, 2, 3) else pb.CODEC_INT4)
    )
    header = dict(
        learner_id=draw(learner_ids),
        fragment=p,
        base_version=0,
        seq=draw(st.one_of(st.integers(1, 64), st.integers(1, 1 << 21))),
        inner_steps=10,
        tokens=1000,
        codec=codec_id,
        num_params=PLAN.fragment_sizes[p],
        plan_fingerprint=PLAN.fingerprint,
        frame_bytes=len(frame),
        step_seconds=0.1,
        overlap_steps=1,
        period_steps=16,
    )
    fuzzed = {
        "fragment": u32,
        "base_version": u64,
        "seq": u64,
        "inner_steps": u64,
        "tokens": u64,
        "num_params": u64,
        "plan_fingerprint": st.text(max_size=80),
        "frame_bytes": u64,
        "step_seconds": doubles,
        "overlap_steps": u32,
        "period_steps": u32,
    }
    for name in draw(
        st.lists(
            st.sampled_from(sorted(fuzzed)),
            max_size=draw(st.sampled_from([0, 0, 1, 3])),
            unique=True,
        )
    ):
        header[name] = draw(fuzzed[name])
    chunks = draw(st.integers(1, 4))
    msgs = push_requests(
        PLAN,
        p,
        header.pop("learner_id"),
        header.pop("seq"),
        header.pop("base_version"),
        frame,
        header.pop("num_params"),
        chunks=chunks,
        codec_id=header.pop("codec"),
        **header,
    )
    order = draw(
        st.sampled_from(
            ["as is"] * 8
            + ["no header", "two headers", "header only", "chunk first", "empty stream"]
        )
    )
    if order == "no header":
        msgs = msgs[1:]
    elif order == "two headers":
        msgs = msgs[:1] + msgs
    elif order == "header only":
        msgs = msgs[:1]
    elif order == "chunk first":
        msgs = [pb.PushRequest(chunk=b"\x00")] + msgs
    elif order == "empty stream":
        msgs = []
    return msgs


@st.composite
def well_formed_pushes(draw) -> dict:
    """A Push a learner could send, its values and training figures fuzzed: it reaches the
    magnitude check, admission, the log and the merge (the test fills in seq and base)."""
    p = draw(st.integers(0, PLAN.num_fragments - 1))
    codec_id = draw(VALID_CODECS)
    values = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).standard_normal(
        PLAN.fragment_sizes[p]
    )
    values *= draw(magnitudes)
    if draw(st.sampled_from([False] * 6 + [True])):  # one value at float32's edge
        values[draw(st.integers(0, values.size - 1))] = 3.4e38
    with np.errstate(over="ignore"):
        values = values.astype(np.float32)
    if not np.isfinite(values).all():  # the encoder refuses these; frames() sends such bytes
        values = np.nan_to_num(values, posinf=3.4e38, neginf=-3.4e38)
    frame = codec.encode(values, codec.Codec(codec_id))

    def mostly(plausible, anything):
        return draw(anything if draw(st.integers(0, 15)) == 15 else plausible)

    steps = mostly(st.integers(1, 64), u64)
    header = dict(
        inner_steps=steps,
        tokens=mostly(st.integers(steps, min(steps << 10, U64)), u64),
        step_seconds=mostly(st.floats(0.001, 10.0), doubles),
        overlap_steps=mostly(st.integers(0, 4), u32),
        period_steps=mostly(st.integers(8, 64), u32),
    )
    return dict(
        p=p,
        learner=draw(VALID_IDS),
        codec_id=codec_id,
        frame=frame,
        header=header,
        base_lag=draw(st.sampled_from([0, 0, 0, 1, 2, 5, -1])),
        seq_step=draw(st.sampled_from([1, 1, 1, 1, 0, -1, 1 << 20, (1 << 20) + 1])),
    )


@st.composite
def other_calls(draw) -> tuple[str, object]:
    """An Init, Pull, Watch or Describe with fuzzed fields."""
    kind = draw(st.sampled_from(["init", "pull", "watch", "describe"]))
    if kind == "pull":
        req = pb.PullRequest(fragment=draw(u32), learner_id=draw(learner_ids))
        if draw(st.booleans()):
            req.have_version = draw(u64)
        return kind, req
    if kind == "watch":
        return kind, pb.WatchRequest(
            fragments=draw(st.lists(u32, max_size=5)), learner_id=draw(learner_ids)
        )
    if kind == "describe":
        return kind, pb.DescribeRequest()
    p = draw(st.integers(0, PLAN.num_fragments - 1))
    frame = draw(frames(PLAN.fragment_sizes[p], pb.CODEC_FP32))
    header = pb.InitHeader(
        learner_id=draw(learner_ids),
        fragment=draw(st.one_of(st.just(p), u32)),
        plan_fingerprint=draw(st.one_of(st.just(PLAN.fingerprint), st.text(max_size=40))),
        plan_json=draw(st.one_of(st.just(PLAN.to_json()), st.text(max_size=200))),
        codec=draw(codecs),
        num_params=draw(st.one_of(st.just(PLAN.fragment_sizes[p]), u64)),
        frame_bytes=draw(st.one_of(st.just(len(frame)), u64)),
    )
    return kind, [pb.InitRequest(header=header), pb.InitRequest(chunk=frame)]


# --- checks ---


def _well_formed(resp: pb.PushResponse) -> None:
    taken = (pb.PUSH_REASON_FRESH, pb.PUSH_REASON_STALE_DISCOUNTED, pb.PUSH_REASON_DUPLICATE)
    refused = (pb.PUSH_REASON_TOO_STALE, pb.PUSH_REASON_ALREADY_IN_ROUND, pb.PUSH_REASON_DUPLICATE)
    assert resp.reason in (taken if resp.accepted else refused), resp
    for x in (resp.weight, resp.cadence_seconds, resp.next_due_seconds):
        assert math.isfinite(x) and x >= 0, resp
    assert resp.accepted or resp.weight == 0, resp


def _answer(call):
    """call()'s result, or None when it failed with a precise status; fails on any other."""
    try:
        return call()
    except grpc.RpcError as e:
        assert e.code() in PRECISE, f"{e.code()}: {e.details()}"
        return None


def _serving(channel) -> None:
    assert health_status(channel, "atoll.v1.Syncer") == health_pb2.HealthCheckResponse.SERVING


def _settled(stub) -> dict:
    """The shard's state once no round is closing (rounds at quorum close on the timer)."""
    last = None
    for _ in range(50):
        now = shard_state(stub)
        if now == last:
            return now
        last = now
        time.sleep(0.2)
    raise AssertionError("the shard's state kept changing with no pushes")


@pytest.fixture(params=["fixed", "fresh"])
def examples(request):
    """A decorator for a @given test: the fixed examples, or a fresh seed's (printed, so the
    failure report shows how to replay it)."""
    if request.param == "fixed":
        return FIXED
    run_seed = int(os.environ.get(FUZZ_SEED) or random.SystemRandom().randrange(2**32))
    print(
        f"fuzz seed {run_seed}: replay with {FUZZ_SEED}={run_seed} pytest '{request.node.nodeid}'"
    )
    return lambda test: seed(run_seed)(settings(FIXED, derandomize=False)(test))


@pytest.fixture
def shard(tmp_path):
    with syncer_processes(tmp_path) as start:
        proc = start(tmp_path / "data", *FLAGS)
        channel, stub = connect(proc.port)
        for p in range(PLAN.num_fragments):
            init(stub, PLAN, p, np.zeros(PLAN.fragment_sizes[p], np.float32))
        yield proc, channel, stub, lambda: start(tmp_path / "data", *FLAGS)
        channel.close()


def test_fuzzed_pushes_get_precise_answers_and_acknowledged_ones_survive_kill_9(shard, examples):
    proc, channel, stub, restart = shard
    acked: list[
        tuple[list[pb.PushRequest], pb.PushResponse]
    ] = []  # streams taken as new, and the answer

    @examples
    @given(msgs=push_streams())
    def fuzz(msgs):
        resp = _answer(lambda: stub.Push(iter(msgs), timeout=DEADLINE))
        if resp is not None:
            _well_formed(resp)
            if resp.reason in (pb.PUSH_REASON_FRESH, pb.PUSH_REASON_STALE_DISCOUNTED):
                acked.append((msgs, resp))
        _serving(channel)

    newest: dict[tuple[str, int], int] = {}  # the highest seq each learner used per fragment

    @examples
    @given(push_=well_formed_pushes())
    def fuzz_values(push_):
        p, learner = push_["p"], push_["learner"]
        seq = max(0, newest.get((learner, p), 0) + push_["seq_step"])
        newest[(learner, p)] = max(seq, newest.get((learner, p), 0))
        base = max(0, describe(stub).fragments[p].version - push_["base_lag"])
        msgs = push_requests(
            PLAN,
            p,
            learner,
            seq,
            base,
            push_["frame"],
            PLAN.fragment_sizes[p],
            codec_id=push_["codec_id"],
            **push_["header"],
        )
        resp = _answer(lambda: stub.Push(iter(msgs), timeout=DEADLINE))
        if resp is not None:
            _well_formed(resp)
            if resp.reason in (pb.PUSH_REASON_FRESH, pb.PUSH_REASON_STALE_DISCOUNTED):
                acked.append((msgs, resp))
        _serving(channel)

    fuzz()
    fuzz_values()
    # a good push from a learner the fuzz never named is taken
    good = push(
        stub,
        PLAN,
        1,
        "good",
        1,
        describe(stub).fragments[1].version,
        np.full(PLAN.fragment_sizes[1], 0.01, np.float32),
    )
    assert good.accepted and good.reason in (pb.PUSH_REASON_FRESH, pb.PUSH_REASON_STALE_DISCOUNTED)
    before = _settled(stub)
    assert proc.kill() == -9
    again = restart()
    channel2, stub2 = connect(again.port)
    try:
        after = _settled(stub2)
        for p, was in before.items():  # every acknowledged push is back, nothing else:
            if after[p]["version"] != was["version"]:
                # a round open at quorum may close once the restarted shard has no leases left
                # to wait for; its pushes are all in the close
                assert (after[p]["version"], after[p]["round_size"]) == (was["version"] + 1, 0), (
                    p,
                    after[p],
                )
                assert was["round_size"] >= 2, (p, was)
            else:
                assert after[p] == was, p
        assert acked, "the fuzz never produced a push the shard took"
        for msgs, first in acked:  # each is known: its retry is a DUPLICATE, never merged again
            header = msgs[0].header
            retry = stub2.Push(iter(msgs), timeout=DEADLINE)
            assert retry.reason == pb.PUSH_REASON_DUPLICATE, (header, first, retry)
            assert pull(stub2, header.fragment, learner=header.learner_id)[0].last_seq >= header.seq
        assert shard_state(stub2) == after  # and counted once
        _serving(channel2)
    finally:
        channel2.close()


def test_fuzzed_init_pull_watch_and_describe_get_precise_answers(shard, examples):
    proc, channel, stub, _ = shard
    before = shard_state(stub)

    @examples
    @given(call=other_calls())
    def fuzz(call):
        kind, req = call
        if kind == "init":
            resp = _answer(lambda: stub.Init(iter(req), timeout=DEADLINE))
            assert resp is None or not resp.created  # every fragment already has its values
        elif kind == "pull":
            resp = _answer(lambda: list(stub.Pull(req, timeout=DEADLINE)))
            assert resp is None or resp[0].WhichOneof("kind") == "header"
        elif kind == "watch":
            stream = stub.Watch(req, timeout=0.3)
            try:
                for note in stream:  # notices of fragments this shard owns, then the deadline
                    assert note.fragment < PLAN.num_fragments
            except grpc.RpcError as e:
                assert e.code() in PRECISE | {grpc.StatusCode.DEADLINE_EXCEEDED}, (
                    f"{e.code()}: {e.details()}"
                )
        else:
            assert len(describe(stub).fragments) == PLAN.num_fragments
        _serving(channel)

    fuzz()
    assert shard_state(stub) == before  # none of it changed a fragment
    ok = push(stub, PLAN, 0, "good", 1, 0, np.full(PLAN.fragment_sizes[0], 0.01, np.float32))
    assert ok.accepted and ok.reason == pb.PUSH_REASON_FRESH
