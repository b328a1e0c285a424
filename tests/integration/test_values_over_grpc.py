"""Every value a shard takes obeys the same rules, over real gRPC: an Adopt whose params,
momentum, published copy or answers a push could not bring is refused INVALID_ARGUMENT
with nothing logged (and the genuine one follows), and a learner id outside
server/learner_ids.py's rule is refused INVALID_ARGUMENT, saying the rule, on every RPC
that names one."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from syncer_helpers import (
    DEADLINE,
    PLAN,
    arrays_of,
    connect,
    describe,
    init,
    npz,
    pull,
    push,
    serving_shard,
)
from test_move_forgery import _genuine, adopt, pair, refused_with_nothing_logged  # noqa: F401

from atoll.server import learner_ids
from atoll.server.state import MAX_ABS_VALUE
from atoll.wire import syncer_pb2 as pb


def _huge(arrays: dict, key: str) -> bytes:
    return npz(arrays | {key: np.full_like(arrays[key], 2 * MAX_ABS_VALUE)})


@pytest.mark.parametrize("key", ["params", "published", "opt.1"])
def test_an_adopt_with_values_beyond_a_pushs_is_refused_and_logs_nothing(pair, key):  # noqa: F811
    (_, b), (_, stub_b) = pair
    meta, payload = _genuine(pair)
    forged = _huge(arrays_of(payload), key)
    code = refused_with_nothing_logged(b, lambda: adopt(stub_b, meta, forged))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert [f.fragment for f in describe(stub_b).fragments] == [1, 3]
    adopt(stub_b, meta, payload)  # the genuine one still goes in
    assert [f.fragment for f in describe(stub_b).fragments] == [0, 1, 3]


def test_an_adopt_whose_answer_names_a_bad_learner_id_says_the_rule(pair):  # noqa: F811
    (_, b), (stub_a, stub_b) = pair
    assert push(stub_a, PLAN, 0, "l0", 1, 0, np.full(PLAN.fragment_sizes[0], 0.01)).accepted
    meta, payload = _genuine(pair)
    state = meta["state"]
    answers = dict(state["answers"])
    assert answers, "the moved fragment holds no answer to forge"
    first = next(iter(answers))
    answers["bad id"] = answers.pop(first)
    contributors = ["bad id" if c == first else c for c in state["contributors"]]
    forged = meta | {"state": state | {"answers": answers, "contributors": contributors}}
    with pytest.raises(grpc.RpcError) as e:
        refused_with_nothing_logged(b, lambda: adopt(stub_b, forged, payload))
        adopt(stub_b, forged, payload)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert learner_ids.CHARACTERS in e.value.details(), e.value.details()
    adopt(stub_b, meta, payload)


@pytest.fixture
def shard(tmp_path):
    with serving_shard(tmp_path / "s", grace=0) as server:
        channel, stub = connect(server.port)
        init(stub, PLAN, 0, np.zeros(PLAN.fragment_sizes[0], np.float32))
        yield stub
        channel.close()


BAD_IDS = ["a b", "x" * (learner_ids.MAX_CHARS + 1), "é", "a/b"]


@pytest.mark.parametrize("learner", BAD_IDS)
def test_a_bad_learner_id_is_refused_on_every_rpc_that_names_one(shard, learner):
    size = PLAN.fragment_sizes[0]
    calls = {
        "Init": lambda: init(shard, PLAN, 0, np.zeros(size, np.float32), learner=learner),
        "Push": lambda: push(shard, PLAN, 0, learner, 1, 0, np.zeros(size)),
        "Pull": lambda: pull(shard, 0, learner=learner),
        "Watch": lambda: next(
            shard.Watch(pb.WatchRequest(fragments=[0], learner_id=learner), timeout=DEADLINE)
        ),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.value)
        assert f"1-{learner_ids.MAX_CHARS} of {learner_ids.CHARACTERS}" in e.value.details(), name
    # the longest id the rule allows is taken
    ok = "x" * learner_ids.MAX_CHARS
    assert push(shard, PLAN, 0, ok, 1, 0, np.zeros(size)).accepted
    assert pull(shard, 0, learner=ok)[0].last_seq == 1  # its push is known by that id
