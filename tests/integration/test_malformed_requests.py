"""Request bytes that do not parse are INVALID_ARGUMENT on every Syncer RPC (grpc's own
answer would be UNKNOWN), a message past the size limit is RESOURCE_EXHAUSTED naming the
limit, and the shard serves on after either."""

from __future__ import annotations

import pathlib

import grpc
import numpy as np
import pytest
from syncer_helpers import (
    DEADLINE,
    PLAN,
    SERVICE,
    connect,
    describe,
    health_status,
    init,
    serving_shard,
)

from atoll.wire import syncer_pb2 as pb

# A varint that never ends: no protobuf message parses from it.
GARBAGE = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"
METHODS = {  # method -> (request streaming, response streaming)
    "Init": (True, False),
    "Push": (True, False),
    "PushStream": (True, True),
    "Pull": (False, True),
    "Watch": (False, True),
    "Describe": (False, False),
    "Freeze": (False, False),
    "Unfreeze": (False, False),
    "Export": (False, True),
    "Adopt": (True, False),
    "Commit": (False, False),
}


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    data = pathlib.Path(tmp_path_factory.mktemp("malformed"))
    with serving_shard(data, grace=0) as server:
        channel, stub = connect(server.port)
        init(stub, PLAN, 0, np.zeros(PLAN.fragment_sizes[0], np.float32))
        yield server, channel, stub
        channel.close()


def test_every_rpc_in_the_proto_is_covered():
    assert set(METHODS) == set(pb.DESCRIPTOR.services_by_name["Syncer"].methods_by_name)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_bytes_that_do_not_parse_are_invalid_argument(shard, method):
    server, channel, stub = shard
    path = f"/{SERVICE}/{method}"
    streaming_in, streaming_out = METHODS[method]
    with pytest.raises(grpc.RpcError) as e:
        if streaming_in and streaming_out:
            list(channel.stream_stream(path)(iter([GARBAGE]), timeout=DEADLINE))
        elif streaming_in:
            channel.stream_unary(path)(iter([GARBAGE]), timeout=DEADLINE)
        elif streaming_out:
            list(channel.unary_stream(path)(GARBAGE, timeout=DEADLINE))
        else:
            channel.unary_unary(path)(GARBAGE, timeout=DEADLINE)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "does not parse" in e.value.details()
    assert describe(stub).fragments[0].initialized  # still serving
    assert health_status(channel) == 1  # SERVING


@pytest.mark.parametrize("method", ["Init", "Push", "PushStream", "Adopt"])
def test_a_chunk_past_the_message_limit_is_resource_exhausted_naming_it(shard, method):
    server, channel, stub = shard
    big = b"x" * (12 << 20)
    make = {
        "Init": lambda: pb.InitRequest(chunk=big),
        "Push": lambda: pb.PushRequest(chunk=big),
        "PushStream": lambda: pb.PushRequest(chunk=big),
        "Adopt": lambda: pb.FragmentState(chunk=big),
    }[method]
    with pytest.raises(grpc.RpcError) as e:
        answer = getattr(stub, method)(iter([make()]), timeout=DEADLINE)
        list(answer) if method == "PushStream" else None
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(server.cfg.max_message_bytes) in e.value.details()
    assert describe(stub).fragments[0].initialized
