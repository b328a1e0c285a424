"""Real learners train on while `atoll reshard` takes the service from 2 to 4 to 3
shards (docs/resharding.md): fragments move between live shard processes, the learners
follow each move, versions go on, and nothing acknowledged is lost."""

from __future__ import annotations

from syncer_helpers import syncer_processes
from test_learner import Learner

from atoll.cluster import reshard
from atoll.wire.client import ShardClient

FLAGS = ["--quorum", "2", "--grace-factor", "1", "--lease-seconds", "3", "--snapshot-every", "4"]
STEPS = 240


def _state(clients: list[ShardClient]) -> dict:
    """{fragment: (owning shard, version)} from every shard's Describe, and each map."""
    owned, maps = {}, []
    for i, c in enumerate(clients):
        d = c.describe()
        maps.append((d.map_version, tuple(d.owners)))
        for f in d.fragments:
            assert f.fragment not in owned, f"fragment {f.fragment} on two shards"
            owned[f.fragment] = (i, f.version)
    return {"owned": owned, "maps": maps}


def test_learners_train_on_while_the_service_goes_from_2_to_4_to_3_shards(tmp_path):
    with syncer_processes(tmp_path) as start:
        # shards 2 and 3 join later in a real deployment; here they are up from the start,
        # own nothing, and the learners know all four addresses
        shards = [
            start(
                tmp_path / f"s{i}",
                "--shard-index",
                str(i),
                "--num-shards",
                "2" if i < 2 else "4",
                *FLAGS,
            )
            for i in range(4)
        ]
        ports = [s.port for s in shards]
        learners = [
            Learner(tmp_path, f"l{i}", i, ports, STEPS, "--slowdown", "8").start() for i in range(2)
        ]
        clients = [ShardClient(f"127.0.0.1:{p}", "", deadline=60.0) for p in ports]
        try:
            learners[0].wait_for_step(40)
            before_up = _state(clients)
            assert sorted(before_up["owned"]) == [0, 1, 2, 3]
            assert {i for i, _ in before_up["owned"].values()} == {0, 1}
            up = reshard.reshard(clients, 4, say=lambda _: None)
            assert len(up["moves"]) == 2 and sorted(up["owners"]) == [0, 1, 2, 3]
            learners[0].wait_for_step(120)
            down = reshard.reshard(clients, 3, say=lambda _: None)
            assert len(down["moves"]) == 1 and 3 not in down["owners"]
            after = _state(clients)
            assert [learner.wait() for learner in learners] == [0, 0]
            final = _state(clients)
        finally:
            for c in clients:
                c.close()
    # every fragment on the shard the map names, versions never went back and went on
    assert {p: i for p, (i, _) in final["owned"].items()} == dict(enumerate(down["owners"]))
    for p, (_, version) in final["owned"].items():
        assert version >= after["owned"][p][1] >= before_up["owned"][p][1]
    assert sum(v for _, v in final["owned"].values()) > sum(
        v for _, v in before_up["owned"].values()
    )
    for learner in learners:
        records = learner.records()
        done = records[-1]
        assert done["state"] == "done" and done["step"] == STEPS, done
    # the learners followed the moves: a refusal naming the new owner, then the same call there
    assert any("moved" in learner.log.read_text() for learner in learners)
    for moved in up["moves"] + down["moves"]:
        assert moved["bytes"] > 0
