"""Forged move calls against real shards over gRPC: each is refused with nothing logged
(the data directory's bytes unchanged), and the genuine move still goes through after it.

Two in-process shards (0 and 1 of 2) on port 0; the calls are built from the proto alone,
as a client holding an operator token could make them."""

from __future__ import annotations

import hashlib
import json
import pathlib

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
    push,
    status_of,
)

from atoll.server.config import ShardConfig
from atoll.server.fragment import Fragment
from atoll.server.service import SyncerServer
from atoll.wire import syncer_pb2 as pb
from atoll.wire.plan import FragmentMap

BAD = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
START = FragmentMap.modulo(PLAN.num_fragments, 2)
MOVED = START.moved(0, 1)  # fragment 0: shard 0 -> shard 1, version 1


def data_bytes(server: SyncerServer) -> dict[str, str]:
    """{path: sha256} of every file in the shard's data directory."""
    root = pathlib.Path(server.cfg.data_dir)
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


@pytest.fixture
def pair(tmp_path):
    """Shards 0 and 1 of 2, every fragment seeded on its owner; (servers, stubs)."""
    servers, channels, stubs = [], [], []
    for i in (0, 1):
        cfg = ShardConfig(
            shard_index=i, num_shards=2, data_dir=tmp_path / f"s{i}", listen="127.0.0.1:0"
        )
        server = SyncerServer(cfg)
        server.start()
        servers.append(server)
        channel, stub = connect(server.port)
        channels.append(channel)
        stubs.append(stub)
    rng = np.random.default_rng(0)
    for p, size in enumerate(PLAN.fragment_sizes):
        init(stubs[p % 2], PLAN, p, rng.standard_normal(size).astype(np.float32))
    yield servers, stubs
    for channel in channels:
        channel.close()
    for server in servers:
        server.stop(grace=0)


def as_pb(m: FragmentMap) -> pb.FragmentMap:
    return pb.FragmentMap(version=m.version, owners=m.owners, moved_at=m.moved_at)


def freeze(stub, p: int, m: pb.FragmentMap):
    return stub.Freeze(pb.MoveRequest(fragment=p, map=m), timeout=DEADLINE)


def export(stub, p: int) -> tuple[dict, bytes]:
    header, parts = None, []
    for msg in stub.Export(pb.MoveRequest(fragment=p), timeout=DEADLINE):
        if msg.WhichOneof("kind") == "header":
            header = msg.header
        else:
            parts.append(msg.chunk)
    assert header is not None
    return json.loads(header.meta_json), b"".join(parts)


def adopt(stub, meta: dict, payload: bytes):
    messages = [
        pb.FragmentState(
            header=pb.FragmentStateHeader(meta_json=json.dumps(meta), payload_bytes=len(payload))
        )
    ]
    messages += [pb.FragmentState(chunk=payload)] if payload else []
    return stub.Adopt(iter(messages), timeout=DEADLINE)


def refused_with_nothing_logged(server: SyncerServer, call) -> grpc.StatusCode:
    before = data_bytes(server)
    code = status_of(call)
    assert data_bytes(server) == before, "a refused call changed the data directory"
    return code


@pytest.mark.parametrize(
    "forged",
    [
        # several versions ahead of anything the shard or the map itself knows
        pb.FragmentMap(version=5, owners=[1, 1, 0, 1], moved_at=[5, 0, 0, 0]),
        # a target shard that cannot exist (2^32 - 1)
        pb.FragmentMap(version=1, owners=[2**32 - 1, 1, 0, 1], moved_at=[1, 0, 0, 0]),
        # moves fragment 2 as well
        pb.FragmentMap(version=1, owners=[1, 1, 1, 1], moved_at=[1, 0, 1, 0]),
        # a version past 2^63 - 1
        pb.FragmentMap(version=2**64 - 1, owners=[1, 1, 0, 1], moved_at=[2**64 - 1, 0, 0, 0]),
        # fragment 0 does not move in it
        pb.FragmentMap(version=1, owners=[0, 1, 0, 1], moved_at=[0, 0, 0, 0]),
        # fewer fragments than the plan
        pb.FragmentMap(version=1, owners=[1, 1, 0], moved_at=[1, 0, 0]),
    ],
    ids=["ahead", "huge-owner", "two-fragments", "version-2^64", "no-move", "short"],
)
def test_a_forged_freeze_is_refused_and_logs_nothing(pair, forged):
    (a, _), (stub_a, _) = pair
    assert refused_with_nothing_logged(a, lambda: freeze(stub_a, 0, forged)) in BAD
    assert describe(stub_a).fragments[0].moving_version == 0
    freeze(stub_a, 0, as_pb(MOVED))  # the genuine one still goes in
    assert describe(stub_a).fragments[0].moving_version == 1


def test_a_forged_commit_and_unfreeze_of_a_fragment_out_of_range_log_nothing(pair):
    (a, _), (stub_a, _) = pair
    ahead = pb.FragmentMap(version=9, owners=[1, 1, 0, 1], moved_at=[9, 0, 0, 0])
    for call in (
        lambda: stub_a.Commit(pb.MoveRequest(fragment=0, map=ahead), timeout=DEADLINE),
        lambda: stub_a.Commit(pb.MoveRequest(fragment=7, map=as_pb(MOVED)), timeout=DEADLINE),
        lambda: stub_a.Unfreeze(pb.MoveRequest(fragment=7), timeout=DEADLINE),
        lambda: list(stub_a.Export(pb.MoveRequest(fragment=7), timeout=DEADLINE)),
    ):
        assert refused_with_nothing_logged(a, call) in (*BAD, grpc.StatusCode.NOT_FOUND)


def _genuine(pair) -> tuple[dict, bytes]:
    """Fragment 0's exported state after one accepted push, so it carries an answer."""
    (_, _), (stub_a, _) = pair
    delta = np.full(PLAN.fragment_sizes[0], 0.01, np.float32)
    assert push(stub_a, PLAN, 0, "L", seq=1, base=0, delta=delta).accepted
    freeze(stub_a, 0, as_pb(MOVED))
    meta, payload = export(stub_a, 0)
    assert "L" in meta["state"]["answers"] and "freeze" in meta
    return meta, payload


def _forgeries(meta: dict, payload: bytes) -> dict[str, tuple[dict, bytes]]:
    arrays = arrays_of(payload)
    state = meta["state"]
    size = PLAN.fragment_sizes[0]

    def with_state(**changes) -> dict:
        return meta | {"state": state | changes}

    def with_array(key: str, value: np.ndarray) -> bytes:
        return npz(arrays | {key: value})

    skip = FragmentMap(3, MOVED.owners, (3, 0, 0, 0))
    return {
        "map skips versions": (meta | {"map": skip.to_json()}, payload),
        "map gives fragment 2 too": (
            meta | {"map": MOVED.stating(2, 1, 1).to_json()},
            payload,
        ),
        "version 2^64": (with_state(version=2**64), payload),
        "version -1": (with_state(version=-1), payload),
        "version a string": (with_state(version="7"), payload),
        "complex64 params": (
            meta,
            with_array("params", arrays["params"].astype(np.complex64) + 1j),
        ),
        "float64 params": (meta, with_array("params", arrays["params"].astype(np.float64))),
        "params 2-D": (meta, with_array("params", arrays["params"].reshape(1, size))),
        "an unknown array": (meta, with_array("extra", np.zeros(3, np.float32))),
        "an unknown meta key": (meta | {"surprise": 1}, payload),
        "a ring version past the fragment's": (
            with_state(ring=[state["version"] + 1]),
            with_array("ring.0", np.frombuffer(b"frame", np.uint8)),
        ),
        "answer seq -1": (
            with_state(answers={"L": {**state["answers"]["L"], "seq": -1}}),
            payload,
        ),
        "no freeze record": ({k: v for k, v in meta.items() if k != "freeze"}, payload),
        "freeze by another source": (meta | {"freeze": {**meta["freeze"], "source": 1}}, payload),
    }


@pytest.mark.parametrize(
    "name",
    [
        "map skips versions",
        "map gives fragment 2 too",
        "version 2^64",
        "version -1",
        "version a string",
        "complex64 params",
        "float64 params",
        "params 2-D",
        "an unknown array",
        "an unknown meta key",
        "a ring version past the fragment's",
        "answer seq -1",
        "no freeze record",
        "freeze by another source",
    ],
)
def test_a_forged_adopt_is_refused_logs_nothing_and_the_genuine_one_follows(pair, name):
    (a, b), (stub_a, stub_b) = pair
    meta, payload = _genuine(pair)
    forged_meta, forged_payload = _forgeries(meta, payload)[name]
    code = refused_with_nothing_logged(b, lambda: adopt(stub_b, forged_meta, forged_payload))
    assert code in BAD, code
    assert [f.fragment for f in describe(stub_b).fragments] == [1, 3]  # Describe still answers
    adopt(stub_b, meta, payload)
    stub_a.Commit(pb.MoveRequest(fragment=0, map=as_pb(MOVED)), timeout=DEADLINE)
    assert [f.fragment for f in describe(stub_b).fragments] == [0, 1, 3]
    assert [f.fragment for f in describe(stub_a).fragments] == [2]


def test_an_adopt_of_a_fragment_its_owner_never_froze_is_refused(pair):
    """A state made by hand for fragment 2 (shard 0's, never frozen): the target has no
    freeze of its owner's to go by, and refuses it; shard 0 still owns and serves it."""
    (a, b), (stub_a, stub_b) = pair
    meta, _ = _genuine(pair)  # fragment 0's real meta, as a template
    cfg = a.cfg
    made = Fragment(
        2,
        PLAN,
        lr=cfg.outer_lr,
        momentum=cfg.outer_momentum,
        rda=cfg.rda,
        delta_ring=cfg.delta_ring,
        publish_codec=cfg.publish_codec,
        quorum=cfg.quorum,
        momentum_delay=cfg.momentum_delay,
    )
    made.initialize(np.zeros(PLAN.fragment_sizes[2], np.float32))
    state, arrays = made.state()
    forged = {k: v for k, v in meta.items() if k != "freeze"}
    forged |= {"fragment": 2, "map": START.moved(2, 1).to_json(), "state": state}
    code = refused_with_nothing_logged(b, lambda: adopt(stub_b, forged, npz(arrays)))
    assert code in BAD, code
    assert 2 not in [f.fragment for f in describe(stub_b).fragments]
    assert 2 in [f.fragment for f in describe(stub_a).fragments]


def _move_0(stub_a, stub_b) -> None:
    freeze(stub_a, 0, as_pb(MOVED))
    adopt(stub_b, *export(stub_a, 0))
    stub_a.Commit(pb.MoveRequest(fragment=0, map=as_pb(MOVED)), timeout=DEADLINE)


@pytest.mark.parametrize("watched", [[0, 2], [2, 0]])
def test_a_watch_of_several_fragments_ends_naming_the_owner_when_one_moves(pair, watched):
    (a, _), (stub_a, stub_b) = pair
    stream = stub_a.Watch(pb.WatchRequest(fragments=watched, learner_id="w"), timeout=DEADLINE)
    seen = {next(stream).fragment, next(stream).fragment}
    assert seen == {0, 2}
    _move_0(stub_a, stub_b)
    with pytest.raises(grpc.RpcError) as e:
        list(stream)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    trailing = dict(e.value.trailing_metadata())
    assert (trailing["atoll-owner"], trailing["atoll-fragment"]) == ("1", "0")


def test_a_watch_of_every_fragment_ends_when_one_moves_away(pair):
    (a, _), (stub_a, stub_b) = pair
    stream = stub_a.Watch(pb.WatchRequest(learner_id="w"), timeout=DEADLINE)
    assert {next(stream).fragment, next(stream).fragment} == {0, 2}
    _move_0(stub_a, stub_b)
    with pytest.raises(grpc.RpcError) as e:
        list(stream)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(e.value.trailing_metadata())["atoll-owner"] == "1"


def test_a_commit_of_a_fragment_never_exported_is_refused_and_logs_nothing(pair):
    """A frozen fragment whose state no Export handed out cannot be on its target: a
    Commit then (a forged or replayed one) would leave no shard owning it."""
    (a, _), (stub_a, stub_b) = pair
    freeze(stub_a, 0, as_pb(MOVED))
    commit = pb.MoveRequest(fragment=0, map=as_pb(MOVED))
    code = refused_with_nothing_logged(a, lambda: stub_a.Commit(commit, timeout=DEADLINE))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert 0 in [f.fragment for f in describe(stub_a).fragments]
    adopt(stub_b, *export(stub_a, 0))
    stub_a.Commit(commit, timeout=DEADLINE)  # the genuine order goes through
    assert [f.fragment for f in describe(stub_a).fragments] == [2]
