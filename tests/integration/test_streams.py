"""The serving layer under crowds and stalls, over real gRPC: open streams hold no
thread, declared frames are capped and budgeted before a byte is buffered, stalled
streams time out, odd learner ids are refused, and health follows the round timer.

In-process shards on port 0, stopped in teardown; every call carries a deadline.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from syncer_helpers import (
    DEADLINE,
    PLAN,
    REPO,
    SERVICE,
    connect,
    describe,
    init,
    pull,
    push,
    push_requests,
    status_of,
)

from atoll.server.config import ShardConfig
from atoll.server.service import LEARNER_ID, TICK_FAILURES_UNHEALTHY, SyncerServer
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire import syncer_pb2_grpc as pb_grpc
from atoll.wire.plan import FragmentPlan, TensorSpec

SERVING, NOT_SERVING = (
    health_pb2.HealthCheckResponse.SERVING,
    health_pb2.HealthCheckResponse.NOT_SERVING,
)
SIZE = PLAN.fragment_sizes[0]
# A fragment big enough that one FP32 frame can declare most of a MiB.
BIG = FragmentPlan.build([TensorSpec("embed", (1024, 160))], 1)
BIG_FRAME = (
    600_000  # bytes declared by each held push below; BIG's FP32 frames may need up to ~660 kB
)


@pytest.fixture
def serve(tmp_path):
    """start(**ShardConfig fields) -> a started in-process shard; all stopped at the end."""
    servers = []

    def start(**fields) -> SyncerServer:
        fields = {"shard_index": 0, "num_shards": 1, "listen": "127.0.0.1:0", **fields}
        server = SyncerServer(ShardConfig(data_dir=tmp_path / f"s{len(servers)}", **fields))
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop(grace=0)


def channel_to(port: int) -> tuple[grpc.Channel, pb_grpc.SyncerStub]:
    """A channel with its own connection (not shared with other channels' calls)."""
    return connect(port, options=[("grpc.use_local_subchannel_pool", 1)])


def gauge(server: SyncerServer, name: str, **labels) -> float:
    return server.shard.metrics.registry.get_sample_value(name, labels) or 0.0


def wait_until(condition, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached after {timeout} s"
        time.sleep(0.02)


def health(channel: grpc.Channel, service: str = "") -> int:
    return (
        health_pb2_grpc.HealthStub(channel)
        .Check(health_pb2.HealthCheckRequest(service=service), timeout=DEADLINE)
        .status
    )


class Held:
    """Push streams that send their header, then nothing until released (or cancelled)."""

    def __init__(self):
        self.release = threading.Event()
        self.calls = []

    def open(self, stub, header: pb.PushHeader, chunks: list[bytes] = (), timeout: float = 60.0):
        def requests():
            yield pb.PushRequest(header=header)
            self.release.wait()
            for chunk in chunks:
                yield pb.PushRequest(chunk=chunk)

        self.calls.append(stub.Push.future(requests(), timeout=timeout))
        return self.calls[-1]

    def close(self):
        self.release.set()
        for call in self.calls:
            call.cancel()


def header(
    plan: FragmentPlan,
    p: int,
    learner: str,
    frame_bytes: int,
    codec_id: int = pb.CODEC_INT4,
    num_params: int | None = None,
) -> pb.PushHeader:
    return pb.PushHeader(
        learner_id=learner,
        fragment=p,
        base_version=0,
        seq=1,
        inner_steps=10,
        tokens=1000,
        codec=codec_id,
        num_params=plan.fragment_sizes[p] if num_params is None else num_params,
        plan_fingerprint=plan.fingerprint,
        frame_bytes=frame_bytes,
    )


def test_a_crowd_of_watches_and_stalled_pushes_leaves_health_and_pushes_answered(serve):
    """300 open Watch streams and 50 Push streams stalled after their header, on 8
    connections: health answers at once, Describe too, and a real push is accepted.
    (A thread per stream froze the shard at 64 of them.)"""
    server = serve(quorum=1, grace_factor=0.0)
    main, stub = connect(server.port)
    for p in range(PLAN.num_fragments):
        init(stub, PLAN, p, np.zeros(PLAN.fragment_sizes[p], np.float32))
    channels = [channel_to(server.port) for _ in range(8)]
    watches = []
    for i in range(300):
        call = channels[i % 8][1].Watch(pb.WatchRequest(learner_id=f"w{i}"), timeout=120)
        watches.append(call)
    for call in watches:  # open and answered: each fragment's version
        assert sorted(next(call).fragment for _ in range(PLAN.num_fragments)) == [0, 1, 2, 3]
    held = Held()
    frame = codec.encode(np.full(SIZE, 0.01, np.float32))
    try:
        for i in range(50):
            held.open(channels[i % 8][1], header(PLAN, 0, f"s{i}", len(frame)))
        wait_until(
            lambda: gauge(server, "atoll_inflight_frame_bytes") == 50 * len(frame),
            what="50 held headers",
        )
        assert gauge(server, "atoll_open_calls", method="Watch") == 300
        assert gauge(server, "atoll_open_calls", method="Push") == 50

        # answered, each within its DEADLINE (a frozen shard answers none); how fast is the
        # bench's figure: `atoll bench streams` reports health_ms_p99 against its target
        assert [health(main, SERVICE) for _ in range(20)] == [SERVING] * 20
        assert len(describe(stub).live_learners) == 301  # the watchers hold leases, and "a"
        ack = push(stub, PLAN, 0, "real", 1, 0, np.full(SIZE, 0.01, np.float32))
        assert ack.accepted and ack.version == 1  # quorum 1: it closed the round
        notices = {(n.fragment, n.version) for n in (next(call) for call in watches[::30])}
        assert notices == {(0, 1)}  # and the watchers heard of it
    finally:
        held.close()
        for call in watches:
            call.cancel()
    wait_until(
        lambda: gauge(server, "atoll_open_calls", method="Watch") == 0, what="watches closed"
    )
    wait_until(lambda: gauge(server, "atoll_inflight_frame_bytes") == 0, what="budget given back")
    for channel, _ in channels:
        channel.close()
    main.close()


def test_a_declared_frame_larger_than_its_fragment_can_need_is_refused_before_any_chunk(serve):
    server = serve()
    channel, stub = connect(server.port)
    init(stub, PLAN, 0, np.zeros(SIZE, np.float32))
    held = Held()
    try:
        need = codec.max_frame_bytes(SIZE, codec.Codec.INT4)
        call = held.open(
            stub, header(PLAN, 0, "x", need + 1)
        )  # the stream stays open, sends no chunk
        with pytest.raises(grpc.RpcError) as e:
            call.result(timeout=30)
        assert (
            e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "can need" in e.value.details()
        )
        # a count that is not the fragment's cannot raise the cap either
        call = held.open(stub, header(PLAN, 0, "x", need + 1, num_params=100 * SIZE))
        assert call.exception(timeout=30).code() == grpc.StatusCode.INVALID_ARGUMENT
        # nor can an unknown fragment: it is capped at the plan's largest
        largest = codec.max_frame_bytes(max(PLAN.fragment_sizes), codec.Codec.INT4)
        call = held.open(
            stub, pb.PushHeader(**{**_fields(header(PLAN, 0, "x", largest + 1)), "fragment": 9})
        )
        assert call.exception(timeout=30).code() == grpc.StatusCode.INVALID_ARGUMENT
        assert gauge(server, "atoll_inflight_frame_bytes") == 0
    finally:
        held.close()
    channel.close()


def _fields(h: pb.PushHeader) -> dict:
    return {f.name: v for f, v in h.ListFields()}


def test_in_flight_frame_bytes_are_limited_per_connection_and_in_all(serve):
    server = serve(max_connection_inflight_bytes=1 << 20, max_inflight_bytes=(3 << 20) // 2)
    first, stub = channel_to(server.port)
    second, other = channel_to(server.port)
    third, more = channel_to(server.port)
    values = np.zeros(BIG.fragment_sizes[0], np.float32)
    init(stub, BIG, 0, values)
    assert codec.max_frame_bytes(BIG.fragment_sizes[0], codec.Codec.FP32) > BIG_FRAME
    held = Held()
    try:
        h = header(BIG, 0, "a", BIG_FRAME, codec_id=pb.CODEC_FP32)
        held.open(stub, h)
        wait_until(lambda: gauge(server, "atoll_inflight_frame_bytes") == BIG_FRAME)
        refused = held.open(stub, h).exception(timeout=30)  # same connection: 1.2 MB > 1 MiB
        assert (
            refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "connection" in refused.details()
        )
        held.open(other, h)  # another connection has its own budget
        wait_until(lambda: gauge(server, "atoll_inflight_frame_bytes") == 2 * BIG_FRAME)
        refused = held.open(more, h).exception(timeout=30)  # but all of them share 1.5 MiB
        assert (
            refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "in flight" in refused.details()
        )
    finally:
        held.close()
    wait_until(lambda: gauge(server, "atoll_inflight_frame_bytes") == 0, what="budget given back")
    # once given back, a whole push goes through
    frame = codec.encode(np.full(values.size, 0.01, np.float32), codec.Codec.FP32)
    ack = stub.Push(
        iter(push_requests(BIG, 0, "a", 1, 0, frame, values.size, codec_id=pb.CODEC_FP32)),
        timeout=DEADLINE,
    )
    assert ack.accepted
    for channel in (first, second, third):
        channel.close()


def test_a_stalled_push_times_out_and_gives_its_budget_back(serve):
    server = serve(stream_idle_seconds=0.5)
    channel, stub = connect(server.port)
    init(stub, PLAN, 0, np.zeros(SIZE, np.float32))
    frame = codec.encode(np.full(SIZE, 0.01, np.float32))
    held = Held()
    try:
        call = held.open(stub, header(PLAN, 0, "slow", len(frame)), chunks=[frame])
        # ended by the shard's 0.5 s idle timer ("sent nothing"), not by the call's own 60 s
        # deadline; the 30 s wait is a loaded host's margin
        error = call.exception(timeout=30)
        assert (
            error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "sent nothing" in error.details()
        )
        assert gauge(server, "atoll_inflight_frame_bytes") == 0
        assert (
            gauge(server, "atoll_refused_calls_total", method="Push", code="DEADLINE_EXCEEDED") == 1
        )
    finally:
        held.close()
    assert describe(stub).fragments[0].round_size == 0  # nothing of it arrived
    channel.close()


@pytest.mark.parametrize("learner", ["x" * 129, "has space", "slash/y", "ünï", "nul\x00"])
def test_learner_ids_out_of_shape_are_refused_on_every_call(serve, learner):
    server = serve()
    channel, stub = connect(server.port)
    values = np.zeros(SIZE, np.float32)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(lambda: init(stub, PLAN, 0, values, learner=learner)) == invalid
    init(stub, PLAN, 0, values)
    assert status_of(lambda: push(stub, PLAN, 0, learner, 1, 0, values)) == invalid
    assert status_of(lambda: pull(stub, 0, learner=learner)) == invalid
    assert (
        status_of(lambda: next(stub.Watch(pb.WatchRequest(learner_id=learner), timeout=DEADLINE)))
        == invalid
    )
    assert describe(stub).live_learners == ["a"]  # none of them took a lease
    assert LEARNER_ID.fullmatch("x" * 128) and LEARNER_ID.fullmatch("pod-7.zone:a_b")
    channel.close()


def test_init_and_push_need_a_learner_id_which_pull_and_watch_may_leave_empty(serve):
    server = serve()
    channel, stub = connect(server.port)
    values = np.zeros(SIZE, np.float32)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(lambda: init(stub, PLAN, 0, values, learner="")) == invalid
    assert not describe(stub).fragments  # the refused Init brought no plan, seeded nothing
    init(stub, PLAN, 0, values)
    assert status_of(lambda: push(stub, PLAN, 0, "", 1, 0, values)) == invalid
    header, _ = pull(stub, 0, learner="")  # an anonymous reader is answered
    assert header.version == 0
    assert describe(stub).live_learners == ["a"]
    channel.close()


def test_a_failing_round_timer_turns_health_not_serving_until_it_recovers(
    serve, monkeypatch, caplog
):
    server = serve(health_port=0)
    channel, _ = connect(server.port)
    probe = grpc.insecure_channel(f"127.0.0.1:{server.health_port}")  # the plaintext health port
    assert health(channel) == health(probe) == SERVING
    tick = server.shard.tick

    def broken():
        raise FloatingPointError("grace window is inf")

    with caplog.at_level(logging.ERROR, logger="atoll.syncer"):
        monkeypatch.setattr(server.shard, "tick", broken)
        wait_until(lambda: health(probe, SERVICE) == NOT_SERVING, what="NOT_SERVING")
    assert health(channel) == health(channel, SERVICE) == NOT_SERVING
    assert gauge(server, "atoll_round_timer_failures_total") >= TICK_FAILURES_UNHEALTHY
    assert gauge(server, "atoll_serving") == 0
    assert "grace window is inf" in caplog.text  # logged with its traceback
    assert server._timer.is_alive()
    monkeypatch.setattr(server.shard, "tick", tick)
    wait_until(lambda: health(probe) == SERVING, what="SERVING again")
    assert health(channel, SERVICE) == SERVING and gauge(server, "atoll_serving") == 1
    probe.close()
    channel.close()


def test_the_health_port_answers_in_plaintext_beside_a_tls_port_and_serves_only_health(
    serve, tmp_path
):
    from pki import _cert, _key, _write

    key = _key()
    cert, key_path = _write(
        tmp_path, "server", _cert("syncer", key, "syncer", key, server=True), key
    )
    server = serve(tls_cert=cert, tls_key=key_path, health_port=0)
    probe = grpc.insecure_channel(f"127.0.0.1:{server.health_port}")
    assert health(probe) == health(probe, SERVICE) == SERVING
    stub = pb_grpc.SyncerStub(probe)
    assert status_of(lambda: describe(stub)) == grpc.StatusCode.UNIMPLEMENTED
    plain, plain_stub = connect(server.port)
    assert (
        status_of(lambda: describe(plain_stub)) == grpc.StatusCode.UNAVAILABLE
    )  # the main port is TLS
    plain.close()
    server.stop(grace=0)
    with pytest.raises(grpc.RpcError):
        health(probe)  # stopped with the shard
    probe.close()


def test_a_port_out_of_range_is_refused_with_a_readable_message(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "atoll.cli",
            "syncer",
            "--data-dir",
            str(tmp_path),
            "--listen",
            "127.0.0.1:99999",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out
    assert (
        "--listen port must be in 1-65535 (0 picks a free one), got '127.0.0.1:99999'" in out.stderr
    )
    assert "Traceback" not in out.stderr, out.stderr
    assert not any(tmp_path.iterdir())  # nothing was started


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["syncer", "--metrics-port", "70000"],
            "--metrics-port must be in 1-65535 (0 picks a free one), got 70000",
        ),
        (["syncer", "--health-port", "-1"], "--health-port must be in 1-65535"),
        (
            ["syncer", "--listen", "127.0.0.1:7070", "--health-port", "7070"],
            "--health-port 7070 is the --listen port",
        ),
        (["syncer", "--stream-idle-seconds", "0"], "--stream-idle-seconds must be a number > 0"),
        (
            ["syncer", "--max-inflight-bytes", "1000"],
            "--max-inflight-bytes (1000) must be at least",
        ),
        (
            ["up", "--learners", "4", "--slowdown", "1,2"],
            "--slowdown lists 2 factors for 4 learners: give one factor "
            "for all of them or exactly 4, one per learner",
        ),
        (
            ["up", "--slowdown", "1,,2"],
            "expected one factor (2) or one per learner (1,1,2,2), got '1,,2'",
        ),
    ],
)
def test_flags_that_cannot_work_are_refused_with_a_readable_message(
    tmp_path, capsys, args, message
):
    from atoll.cli import main

    where = (
        ["--data-dir", str(tmp_path / "data")]
        if args[0] == "syncer"
        else ["--new-run-dir", str(tmp_path / "run")]
    )
    with pytest.raises(SystemExit) as e:
        main([*args, *where])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing was started or written
