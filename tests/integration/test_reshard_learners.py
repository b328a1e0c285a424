"""Real learners train on while the service goes from 2 to 4 to 3 shards
(docs/resharding.md): two shards start later and `atoll reshard` gives them fragments,
then the last one leaves through `atoll drain` (the scale-down's preStop hook) and is
killed. Fragments move between live shard processes; the learners, given the shards'
address pattern and only the first two, find the new shards, follow each move, and
versions go on with nothing acknowledged lost."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from syncer_helpers import run_atoll, syncer_processes
from test_learner import Learner
from test_scale_down import consecutive_ports, drain_args

from atoll.cluster import reshard
from atoll.wire.client import ShardClient

FLAGS = ["--quorum", "2", "--grace-factor", "1", "--lease-seconds", "3", "--snapshot-every", "4"]
# The learners' steps last SLOWDOWN x their measured time, so they are still training when
# each change comes however loaded the machine (a loaded step is slower, and so is the
# test's own work): 2 shards start at step SCALE_UP, `atoll reshard` runs at RESHARD,
# `atoll drain` at DRAIN (a drain takes well under a second), and STEPS - DRAIN steps
# follow the leaving shard's kill. The stretch multiplies the load too (8 x 240 steps ran
# 24 s to 84 s on 2 loaded cores), hence no more steps than those cushions need.
SLOWDOWN, STEPS = "8", 120
SCALE_UP, RESHARD, DRAIN = 10, 20, 60


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
    pattern = f"127.0.0.1:{consecutive_ports(4)}{{i}}"
    with syncer_processes(tmp_path) as start:

        def shard(i: int):
            # one --num-shards for every shard, as the StatefulSet's ConfigMap gives it
            listen = pattern.replace("{i}", str(i))
            return start(
                tmp_path / f"s{i}",
                "--shard-index",
                str(i),
                "--num-shards",
                "2",
                "--listen",
                listen,
                *FLAGS,
            )

        with ThreadPoolExecutor(2) as pool:  # side by side: each start waits on imports
            shards = list(pool.map(shard, range(2)))
        learners = []
        for i in range(2):  # they know the pattern and that the run starts with 2 shards
            learner = Learner(tmp_path, f"l{i}", i, [], STEPS, "--slowdown", SLOWDOWN)
            at = learner.args.index("--shards")
            learner.args[at + 1 : at + 2] = [pattern, "--num-shards", "2"]
            learners.append(learner.start())
        clients = [ShardClient(pattern.replace("{i}", str(i)), "", deadline=60.0) for i in range(4)]
        try:
            learners[0].wait_for_step(SCALE_UP)
            with ThreadPoolExecutor(2) as pool:  # kubectl scale --replicas=4
                shards += list(pool.map(shard, (2, 3)))
            learners[0].wait_for_step(RESHARD)
            before_up = _state(clients)
            assert sorted(before_up["owned"]) == [0, 1, 2, 3]
            assert {i for i, _ in before_up["owned"].values()} == {0, 1}
            up = reshard.reshard(clients, 4, say=lambda _: None)
            assert len(up["moves"]) == 2 and sorted(up["owners"]) == [0, 1, 2, 3]
            learners[0].wait_for_step(DRAIN)
            # kubectl scale --replicas=3: shard 3's preStop hook hands its fragment over
            drained = run_atoll(*drain_args(pattern, 3, "--replicas", "3"))
            assert drained.returncode == 0, drained.stdout + drained.stderr
            down = json.loads(drained.stdout[drained.stdout.index("\n{") :])
            assert len(down["moves"]) == 1 and 3 not in down["owners"]
            shards[3].kill()  # and the pod goes
            clients[3].close()
            clients = clients[:3]
            after = _state(clients)
            for learner in learners:  # the changes came while they trained
                last = learner.records()[-1]
                assert last["state"] == "training" and last["step"] < STEPS, last
            assert [learner.wait() for learner in learners] == [0, 0]
            final = _state(clients)
        finally:
            for c in clients:
                c.close()
            for learner in learners:  # a failed check leaves none behind
                learner.kill()
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
    # the learners followed the moves: a refusal naming the new owner, then the same call
    # there; and reached shards 2 and 3 through the pattern
    logs = [learner.log.read_text() for learner in learners]
    assert any("moved" in text for text in logs)
    address = pattern.replace("{i}", "2")  # (on a refusal, or found at join)
    assert all(f"shard 2 is at {address}" in t or f"found shard 2 at {address}" in t for t in logs)
    for moved in up["moves"] + down["moves"]:
        assert moved["bytes"] > 0
