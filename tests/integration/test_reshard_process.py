"""Moving fragments between real `atoll syncer` processes (docs/resharding.md): every
acknowledged push survives a SIGKILL of the source or the target at each step of a
move, versions go on from where they were, and `atoll reshard` balances the fragments
and finishes a move a failure interrupted."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
from syncer_helpers import PLAN, client_push, run_atoll, syncer_processes

from atoll.cluster import reshard
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import MAP_VERSION_KEY, OWNER_KEY, ShardClient
from atoll.wire.plan import FragmentMap

FLAGS = ("--num-shards", "2", "--quorum", "1", "--grace-factor", "0", "--snapshot-every", "2")
P = 0  # the fragment that moves: shard 0 -> shard 1
MOVE = reshard.Move(P, 0, 1)


class Pair:
    """Shards 0 and 1 as processes, and a learner's client for each."""

    def __init__(self, start, tmp_path):
        self.start, self.tmp = start, tmp_path
        self.procs = [
            start(tmp_path / f"shard{i}", "--shard-index", str(i), *FLAGS) for i in (0, 1)
        ]
        self.clients = [self._client(i) for i in (0, 1)]
        self.acked: list[int] = []  # seqs of fragment P's acknowledged pushes

    def _client(self, i: int) -> ShardClient:
        return ShardClient(f"127.0.0.1:{self.procs[i].port}", "l0", deadline=30.0)

    def restart(self, i: int) -> None:
        """SIGKILL shard i and start it again on its data directory."""
        self.procs[i].kill()
        self.clients[i].close()
        self.procs[i] = self.start(self.tmp / f"shard{i}", "--shard-index", str(i), *FLAGS)
        self.clients[i] = self._client(i)

    def seed(self) -> None:
        for p in range(PLAN.num_fragments):
            values = np.random.default_rng(p).standard_normal(PLAN.fragment_sizes[p])
            frame = codec.encode(values.astype(np.float32), codec.Codec.FP32)
            self.clients[p % 2].init(PLAN, p, frame, codec.Codec.FP32)

    def push(self, shard: int, seq: int, base: int) -> pb.PushResponse:
        ack = client_push(self.clients[shard], P, seq, base)
        if ack.accepted and ack.reason != pb.PUSH_REASON_DUPLICATE:
            self.acked.append(seq)
        return ack

    def version(self, shard: int) -> int:
        infos = [f for f in self.clients[shard].describe().fragments if f.fragment == P]
        return infos[0].version

    def close(self) -> None:
        for c in self.clients:
            c.close()


@pytest.fixture
def pair(tmp_path):
    with syncer_processes(tmp_path) as start:
        pair = Pair(start, tmp_path)
        pair.seed()
        for seq in range(1, 4):  # quorum 1: each push closes a round
            assert pair.push(0, seq, seq - 1).accepted
        yield pair
        pair.close()


def _after_the_move(pair: Pair) -> None:
    """Shard 1 serves P from where shard 0 left it; shard 0 names it as the owner."""
    assert pair.version(1) == len(pair.acked) == 3  # every acknowledged push is in it
    retry = pair.push(1, 3, 2)  # the last acknowledged push, retried at the new owner
    assert retry.accepted and retry.reason == pb.PUSH_REASON_DUPLICATE
    with pytest.raises(grpc.RpcError) as e:
        pair.push(0, 4, 3)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    trailing = dict(e.value.trailing_metadata())
    assert (trailing[OWNER_KEY], trailing[MAP_VERSION_KEY]) == ("1", "1")
    assert pair.push(1, 4, 3).accepted and pair.version(1) == 4  # versions go on
    d = [c.describe() for c in pair.clients]
    assert [(x.map_version, list(x.owners)) for x in d] == [(1, [1, 1, 0, 1])] * 2
    assert sorted(f.fragment for f in d[1].fragments) == [0, 1, 3]


@pytest.mark.parametrize(
    "killed",
    [
        None,
        "source after freeze",
        "target after adopt",
        "source after adopt",
        "source after commit",
    ],
)
def test_a_move_loses_no_acknowledged_push_when_either_shard_is_killed(pair, killed):
    new = FragmentMap.modulo(PLAN.num_fragments, 2).moved(P, 1)
    source, target = pair.clients
    source.freeze(P, new)
    with pytest.raises(grpc.RpcError) as e:  # frozen: pushes wait
        pair.push(0, 4, 3)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    if killed == "source after freeze":
        pair.restart(0)
    else:
        meta, payload = source.export(P)
        target.adopt(meta, payload)
        if killed == "target after adopt":
            pair.restart(1)
        elif killed == "source after adopt":
            pair.restart(0)
        elif killed == "source after commit":
            source.commit(P, new)
            pair.restart(0)
    # a rerun finds where the move stands and finishes it
    current = FragmentMap.modulo(PLAN.num_fragments, 2)
    assert reshard.move(pair.clients, current, MOVE)[0] == new
    _after_the_move(pair)
    for i in (0, 1):  # and it all survives a restart of both
        pair.restart(i)
    assert pair.version(1) == 4


def test_atoll_reshard_balances_the_fragments_and_says_what_it_moved(pair):
    addresses = ",".join(f"127.0.0.1:{p.port}" for p in pair.procs)
    out = run_atoll("reshard", "--shards", addresses, "--to", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout[out.stdout.index("{") :])
    assert [(m["fragment"], m["from"], m["to"]) for m in result["moves"]] == [(1, 1, 0), (3, 1, 0)]
    assert result["owners"] == [0, 0, 0, 0] and result["map_version"] == 2
    assert all(m["bytes"] > 0 for m in result["moves"])
    d = pair.clients[0].describe()
    assert sorted(f.fragment for f in d.fragments) == [0, 1, 2, 3] and d.map_version == 2
    assert pair.version(0) == 3
    # and back to two shards: the planner moves the fewest fragments
    again = reshard.reshard(pair.clients, 2, say=lambda _: None)
    assert len(again["moves"]) == 2 and again["map_version"] == 4
    bad = run_atoll("reshard", "--shards", addresses, "--to", "9")
    assert bad.returncode == 2 and "--to 9" in bad.stdout and "Traceback" not in bad.stderr


def test_atoll_status_shows_the_map_and_moves_in_progress(pair):
    new = FragmentMap.modulo(PLAN.num_fragments, 2).moved(P, 1)
    addresses = ",".join(f"127.0.0.1:{p.port}" for p in pair.procs)

    def status() -> str:
        out = run_atoll("status", "--shards", addresses)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    assert "moves in progress" not in status()
    pair.clients[0].freeze(P, new)
    shown = status()
    assert "moves in progress" in shown and "fragment 0: shard 0 -> 1 (map version 1)" in shown
    assert "0:v3/0->1" in shown
    pair.clients[0].unfreeze(P)
    assert "moves in progress" not in status()
