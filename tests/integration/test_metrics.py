"""A real shard's /metrics endpoint, scraped over HTTP after real pushes."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from atoll.server.config import ShardConfig
from atoll.server.service import SyncerServer
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire import syncer_pb2_grpc as pb_grpc
from atoll.wire.metrics import read_metrics
from atoll.wire.plan import FragmentPlan, TensorSpec

PLAN = FragmentPlan.build([TensorSpec("embed", (32, 8)), TensorSpec("w", (8, 40))], 2)


def _send(stub_call, header_msg, frame, request_type):
    return stub_call(iter([request_type(header=header_msg), request_type(chunk=frame)]), timeout=10)


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for s in read_metrics(f"127.0.0.1:{port}", timeout=10)
    }


@pytest.fixture
def server(tmp_path):
    s = SyncerServer(
        ShardConfig(
            shard_index=0,
            num_shards=1,
            data_dir=tmp_path,
            listen="127.0.0.1:0",
            quorum=2,
            grace_factor=0.0,
            metrics_port=0,
        )
    )
    s.start()
    yield s
    s.stop()


def test_metrics_follow_pushes_rounds_and_refusals(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.SyncerStub(channel)
    size = PLAN.fragment_sizes[0]
    init = codec.encode(np.zeros(size, np.float32), codec.Codec.FP32)
    _send(
        stub.Init,
        pb.InitHeader(
            learner_id="a",
            fragment=0,
            plan_fingerprint=PLAN.fingerprint,
            plan_json=PLAN.to_json(),
            codec=pb.CODEC_FP32,
            num_params=size,
            frame_bytes=len(init),
        ),
        init,
        pb.InitRequest,
    )
    sent = len(init)
    # b says hello too (and learns the fragment exists), so both hold leases before pushing
    _send(
        stub.Init,
        pb.InitHeader(
            learner_id="b",
            fragment=0,
            plan_fingerprint=PLAN.fingerprint,
            plan_json=PLAN.to_json(),
            codec=pb.CODEC_FP32,
            num_params=size,
            frame_bytes=len(init),
        ),
        init,
        pb.InitRequest,
    )
    sent += len(init)
    for learner in ("a", "b"):
        frame = codec.encode(np.full(size, 0.01, np.float32))
        sent += len(frame)
        ack = _send(
            stub.Push,
            pb.PushHeader(
                learner_id=learner,
                fragment=0,
                base_version=0,
                seq=1,
                inner_steps=4,
                tokens=400,
                codec=pb.CODEC_INT4,
                num_params=size,
                plan_fingerprint=PLAN.fingerprint,
                frame_bytes=len(frame),
                step_seconds=0.5,
            ),
            frame,
            pb.PushRequest,
        )
        assert ack.accepted
    # the same push again: a duplicate, answered and counted as one
    ack = _send(
        stub.Push,
        pb.PushHeader(
            learner_id="b",
            fragment=0,
            base_version=0,
            seq=1,
            inner_steps=4,
            tokens=400,
            codec=pb.CODEC_INT4,
            num_params=size,
            plan_fingerprint=PLAN.fingerprint,
            frame_bytes=len(frame),
        ),
        frame,
        pb.PushRequest,
    )
    sent += len(frame)
    assert ack.reason == pb.PUSH_REASON_DUPLICATE
    with pytest.raises(grpc.RpcError) as refused:
        _send(
            stub.Push,
            pb.PushHeader(
                learner_id="c",
                fragment=5,
                base_version=0,
                seq=1,
                inner_steps=4,
                tokens=400,
                codec=pb.CODEC_INT4,
                num_params=size,
                plan_fingerprint=PLAN.fingerprint,
                frame_bytes=len(frame),
            ),
            frame,
            pb.PushRequest,
        )
    sent += len(frame)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    channel.close()

    m = _scrape(server.metrics_port)
    assert m[("atoll_fragment_version", (("fragment", "0"),))] == 1
    assert m[("atoll_open_round_size", (("fragment", "0"),))] == 0
    assert m[("atoll_rounds_total", ())] == 1
    assert m[("atoll_round_size_sum", ())] == 2 and m[("atoll_round_size_count", ())] == 1
    assert m[("atoll_pushes_total", (("reason", "fresh"),))] == 2
    assert m[("atoll_pushes_total", (("reason", "duplicate"),))] == 1
    assert m[("atoll_refused_calls_total", (("code", "NOT_FOUND"), ("method", "Push")))] == 1
    assert m[("atoll_received_bytes_total", ())] == sent
    assert m[("atoll_push_staleness_count", ())] == 2
    # two accepted pushes of 4 steps at 0.5 s, over the plan's fragments; the duplicate adds nothing
    assert m[("atoll_accepted_compute_seconds_total", ())] == pytest.approx(
        2 * 4 * 0.5 / PLAN.num_fragments
    )
    # one fsync for the plan with its first fragment, one for the first push; the push that
    # closes the round is written with its close and both share the close's fsync
    assert m[("atoll_wal_fsync_seconds_count", ())] == 3
    assert m[("atoll_merge_seconds_count", ())] == 1
    assert m[("atoll_live_learners", ())] == 2  # a and b; c was refused before its lease began
    assert m[("atoll_shard_info", (("shard_index", "0"),))] == 1
