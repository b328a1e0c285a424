"""A real shard process seeded in parts over gRPC (proto `InitHeader.parts`): two processes
of a sharded learner each send the boxes they hold; the shard answers `held` until the
last part, keeps every acknowledged part across a kill -9, and seeds the bits a whole
Init gives; a part that disagrees gets INVALID_ARGUMENT or FAILED_PRECONDITION, a part of
another run while one is live UNAVAILABLE (retry)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from syncer_helpers import syncer_processes
from test_pull_parts import FLAGS, PLAN, SIZE, TWO, _boxes

from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import ShardClient
from atoll.wire.parts import BoxLayout

SEED = np.linspace(-1, 1, SIZE, dtype=np.float32)


def _part(client: ShardClient, k: int, run: str = "a/1", values: np.ndarray = SEED, parts=2):
    shapes = [s.spec.shape for s in PLAN.tensors_of(0)]
    mine = values[BoxLayout.of(shapes, TWO[k]).index()]
    header = pb.InitHeader(parts=parts, part=k, boxes=_boxes(TWO[k]), run_id=run)
    return client.init(PLAN, 0, codec.encode(mine, codec.Codec.FP32), codec.Codec.FP32, header)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_parts_are_held_across_a_kill_and_seed_the_bits_of_a_whole_init(tmp_path):
    with syncer_processes(tmp_path) as start:
        shard = start(tmp_path / "shard", *FLAGS)
        client = ShardClient(f"127.0.0.1:{shard.port}", "a", deadline=10.0)
        first = _part(client, 0)
        assert first.held and not first.created
        assert _code(lambda: _part(client, 1, run="b/2")) == grpc.StatusCode.UNAVAILABLE
        assert _code(lambda: _part(client, 1, parts=3)) == grpc.StatusCode.INVALID_ARGUMENT
        changed = SEED + 1
        assert (
            _code(lambda: _part(client, 0, values=changed)) == grpc.StatusCode.FAILED_PRECONDITION
        )
        shard.kill()  # the part acknowledged is on disk
        shard = start(tmp_path / "shard", *FLAGS)
        client = ShardClient(f"127.0.0.1:{shard.port}", "a", deadline=10.0)
        assert _part(client, 0).held  # a retry after the restart: nothing new
        last = _part(client, 1)
        assert last.created and not last.held and last.version == 0
        pulled = client.pull(0, None)
        assert pulled.snapshot and pulled.version == 0
        seeded = codec.decode(pulled.frames[0][2], num_values=SIZE)
        whole = start(tmp_path / "whole", *FLAGS)
        other = ShardClient(f"127.0.0.1:{whole.port}", "a", deadline=10.0)
        assert other.init(PLAN, 0, codec.encode(SEED, codec.Codec.FP32), codec.Codec.FP32).created
        reference = codec.decode(other.pull(0, None).frames[0][2], num_values=SIZE)
        assert seeded.tobytes() == reference.tobytes() == SEED.tobytes()
