"""A real shard process answering pulls by boxes (proto `PullRequest.boxes`) over gRPC: two
processes of a sharded learner each pull the pieces they hold, delta chain and snapshot,
and together hold the bits of a whole pull; boxes past a tensor, overlapping or of no
tensor are INVALID_ARGUMENT."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from syncer_helpers import client_push, syncer_processes

from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import ShardClient, pull_boxes
from atoll.wire.parts import BoxLayout
from atoll.wire.plan import FragmentPlan, TensorSpec

# One fragment: a column-sharded matrix (runs cut mid-block), a row-sharded one, a norm
PLAN = FragmentPlan.build(
    [TensorSpec("w1", (24, 56)), TensorSpec("w2", (56, 24)), TensorSpec("norm", (24,))], 1
)
SIZE = PLAN.fragment_sizes[0]
NAMES = [s.name for s in PLAN.tensors_of(0)]
W1, W2, NORM = (NAMES.index(n) for n in ("w1", "w2", "norm"))
# two processes: w1 by columns, w2 by rows, the norm split unevenly
TWO = [
    [(W1, (0, 0), (24, 21)), (W2, (0, 0), (28, 24)), (NORM, (0,), (5,))],
    [(NORM, (5,), (24,)), (W2, (28, 0), (56, 24)), (W1, (0, 21), (24, 56))],
]
FLAGS = ["--quorum=1", "--grace-factor=0", "--lease-seconds=600", "--delta-ring=8"]


def _boxes(layout) -> list[pb.TensorBox]:
    return [pb.TensorBox(tensor=t, start=a, stop=b) for t, a, b in layout]


def _whole(client: ShardClient, have: int | None, held: np.ndarray | None) -> np.ndarray:
    pulled = client.pull(0, have)
    if pulled.snapshot:
        return codec.decode(pulled.frames[0][2], num_values=SIZE)
    out = held.copy()
    for _, frame_codec, frame in pulled.frames:
        codec.decode_into(frame, out, 1.0, codec=frame_codec)
    return out


@pytest.mark.parametrize("publish", ["int4", "fp32"])
def test_two_processes_pull_complementary_boxes_and_hold_a_whole_pulls_bits(tmp_path, publish):
    shapes = [s.spec.shape for s in PLAN.tensors_of(0)]
    with syncer_processes(tmp_path) as start:
        shard = start(tmp_path / "shard", *FLAGS, f"--publish-codec={publish}")
        address = f"127.0.0.1:{shard.port}"
        learner, p0, p1 = (ShardClient(address, n, deadline=10.0) for n in ("a", "a.0", "a.1"))
        seed = np.linspace(-1, 1, SIZE, dtype=np.float32)
        assert learner.init(PLAN, 0, codec.encode(seed, codec.Codec.FP32), codec.Codec.FP32).created
        held = [
            pull_boxes(c, PLAN, 0, _boxes(TWO[k])) for k, c in enumerate((p0, p1))
        ]  # snapshots at version 0
        whole0 = _whole(learner, None, None)
        for seq in range(1, 5):
            assert client_push(learner, 0, seq, seq - 1, PLAN).version == seq
        whole = _whole(learner, 0, whole0)
        assert whole.tobytes() == _whole(learner, None, None).tobytes()
        union = np.zeros(SIZE, np.float32)
        for k, client in enumerate((p0, p1)):
            lay = BoxLayout.of(shapes, _boxes(TWO[k]))
            version, mine = pull_boxes(client, PLAN, 0, _boxes(TWO[k]), held[k][1], held[k][0])
            assert version == 4 and mine is held[k][1]  # deltas, applied in place
            assert mine.tobytes() == whole[lay.index()].tobytes()
            _, fresh = pull_boxes(client, PLAN, 0, _boxes(TWO[k]))  # a snapshot by boxes
            assert fresh.tobytes() == mine.tobytes()
            union[lay.index()] = mine
        assert union.tobytes() == whole.tobytes()
        # bad boxes: refused, and the shard answers on
        for bad in (
            [(W1, (0, 0), (24, 57))],  # past the tensor
            [(W2, (0, 0), (30, 24)), (W2, (29, 0), (56, 24))],  # overlapping
            [(3, (), ())],  # no such tensor
        ):
            for have in (None, 0):
                with pytest.raises(grpc.RpcError) as e:
                    p0.pull(0, have, _boxes(bad))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert learner.pull(0, 3).version == 4
        for c in (learner, p0, p1):
            c.close()
