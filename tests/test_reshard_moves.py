"""One move against a target that restarts (atoll/cluster/reshard.py `move`): a fragment is
frozen only for a target that serves, thawed when its target stops serving before the
state was sent or refuses it unlogged, and kept frozen when an Adopt may have been logged."""

from __future__ import annotations

import json

import grpc
import pytest

from atoll.cluster import reshard as rs
from atoll.wire import syncer_pb2 as pb
from atoll.wire.plan import FragmentMap

START = FragmentMap.modulo(4, 2)  # fragments 0 and 2 on shard 0, 1 and 3 on shard 1
MOVE = rs.Move(fragment=2, source=0, target=1)


class Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "refused"


class Shard:
    """A shard's move calls over its map and frozen fragments; `adopt_error` is what its
    next Adopt raises (after logging it, when `logged`)."""

    def __init__(self, index: int, fmap: FragmentMap = START):
        self.index, self.map, self.frozen, self.calls = index, fmap, {}, []
        self.adopt_error: grpc.RpcError | None = None
        self.logged = False

    def describe(self, timeout: float | None = None) -> pb.DescribeResponse:
        return pb.DescribeResponse(
            shard_index=self.index,
            map_version=self.map.version,
            owners=self.map.owners,
            moved_at=self.map.moved_at,
            fragments=[
                pb.FragmentInfo(
                    fragment=p,
                    moving_version=self.frozen[p].version if p in self.frozen else 0,
                    moving_to=self.frozen[p].owner(p) if p in self.frozen else 0,
                )
                for p in self.map.fragments_of(self.index)
            ],
        )

    def freeze(self, p: int, new: FragmentMap) -> int:
        self.calls.append("freeze")
        self.frozen[p] = new
        return self.map.version

    def unfreeze(self, p: int) -> int:
        self.calls.append("unfreeze")
        self.frozen.pop(p, None)
        return self.map.version

    def export(self, p: int) -> tuple[str, bytes]:
        self.calls.append("export")
        return f'{{"fragment": {p}}}', b"state"

    def adopt(self, meta: str, payload: bytes) -> int:
        self.calls.append("adopt")
        if self.adopt_error is not None and not self.logged:
            raise self.adopt_error
        self.map = self.map.moved(json.loads(meta)["fragment"], self.index)
        return self.map.version

    def commit(self, p: int, new: FragmentMap) -> int:
        self.calls.append("commit")
        self.frozen.pop(p)
        self.map = new
        return new.version

    def close(self) -> None:
        pass


def serving_until(target: Shard, checks: int):
    """`ready` that says the target serves for its first `checks` asks, then not."""
    asked = {"n": 0}

    def ready(c) -> bool:
        if c is not target:
            return True
        asked["n"] += 1
        return asked["n"] <= checks

    return ready


def test_a_target_that_is_not_serving_is_waited_for_with_nothing_frozen():
    shards = [Shard(0), Shard(1)]
    out = rs.reshard(shards, 1, say=lambda _: None, ready=serving_until(shards[1], 0))
    # shard 1 answers Describe (replaying its log) but is not SERVING: no move starts
    assert out["moves"] == [] and out["skipped"] and shards[0].calls == []
    out = rs.reshard(shards, 1, say=lambda _: None, ready=lambda _: True)
    assert len(out["moves"]) == 2 and shards[0].frozen == {}


def test_a_target_that_stops_serving_before_the_state_is_sent_thaws_the_fragment():
    shards = [Shard(0), Shard(1)]
    with pytest.raises(rs.NotServing):
        rs.move(shards, START, MOVE, ready=serving_until(shards[1], 1))
    assert shards[0].calls == ["freeze", "export", "unfreeze"] and shards[0].frozen == {}
    assert "adopt" not in shards[1].calls


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT]
)
def test_an_adopt_refused_before_it_is_logged_thaws_the_fragment(code):
    shards = [Shard(0), Shard(1)]
    shards[1].adopt_error = Refused(code)
    with pytest.raises(grpc.RpcError):
        rs.move(shards, START, MOVE, ready=lambda _: True)
    assert shards[0].calls[-1] == "unfreeze" and shards[0].frozen == {}


def test_an_adopt_cut_short_keeps_the_fragment_frozen_until_the_target_answers():
    # the target was killed during the Adopt: it may have logged it, so thawing the source
    # could leave two shards taking pushes; the rerun finds the move and finishes it
    shards = [Shard(0), Shard(1)]
    shards[1].adopt_error = Refused(grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(grpc.RpcError):
        rs.move(shards, START, MOVE, ready=lambda _: True)
    assert "unfreeze" not in shards[0].calls and 2 in shards[0].frozen
    # back, not serving yet: the move waits and nothing else starts
    out = rs.reshard(shards, 2, say=lambda _: None, ready=serving_until(shards[1], 0))
    assert out["moves"] == [] and 2 in shards[0].frozen and "unfreeze" not in shards[0].calls
    # serving, with the Adopt logged before the kill: the rerun commits
    shards[1].logged = True
    shards[1].map = shards[1].map.moved(2, 1)
    out = rs.reshard(shards, 2, say=lambda _: None, ready=lambda _: True)
    assert out["moves"][0]["fragment"] == 2 and out["moves"][0]["bytes"] == 0  # not sent again
    assert shards[0].frozen == {} and shards[0].map.owner(2) == 1
    assert "unfreeze" not in shards[0].calls
