"""The scale-down path (docs/resharding.md, "Scaling the service in Kubernetes"): the
shards a StatefulSet scale-down takes away hand their fragments to those that stay in
their preStop hook (`atoll drain`), with real shard processes reached through an
address pattern, and the StatefulSet's size read from a Kubernetes API (kmock)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from syncer_helpers import PLAN, REPO, client_push, run_atoll, syncer_processes
from test_kube import Emulator, serve_namespace

from atoll.wire import codec
from atoll.wire.client import ShardClient

FLAGS = ("--num-shards", "2", "--quorum", "1", "--grace-factor", "0", "--snapshot-every", "2")
SHARDS = 4
# A leaving shard's rounds 0.1 s apart (`atoll drain --poll`; 1 s in a pod): a drain ends
# (or runs out of time) as it would, sooner after the round that finds it done
POLL = ("--poll", "0.1")


def consecutive_ports(n: int) -> int:
    """A prefix X such that ports X0 ... X(n-1) are free on 127.0.0.1."""
    for _ in range(200):
        prefix = random.randrange(2000, 6000)
        sockets = []
        try:
            for i in range(n):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", int(f"{prefix}{i}")))
            return prefix
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no run of free ports")


def drain_args(pattern: str, index: int, *flags: str) -> list[str]:
    """`atoll drain`'s arguments: shard `index` of the shards at `pattern` leaves."""
    return ["drain", "--shards", pattern, "--shard-index", str(index), *flags]


def _statefulset(namespace: str, replicas: int, policy: str | None) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "atoll-syncer", "namespace": namespace},
        "spec": {
            "replicas": replicas,
            **({"podManagementPolicy": policy} if policy else {}),
            "serviceName": "atoll-syncer",
            "selector": {"matchLabels": {"app.kubernetes.io/component": "syncer"}},
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/component": "syncer"}},
                "spec": {"containers": [{"name": "syncer", "image": "atoll"}]},
            },
        },
    }


def _answer(obj: dict):
    return lambda: obj


@pytest.fixture
def api(tmp_path):
    """A Kubernetes API where StatefulSet atoll-syncer has 2 replicas in namespaces atoll
    (pods managed in parallel, as shipped) and ordered (the API's default, OrderedReady),
    and none in any other; and a kubeconfig for it."""

    def seed(k) -> None:
        serve_namespace(k, "atoll", {"atoll.dev/enabled": "true"})
        for namespace, policy in (("atoll", "Parallel"), ("ordered", None)):
            route = f"get /apis/apps/v1/namespaces/{namespace}/statefulsets/atoll-syncer"
            k[route] << _answer(_statefulset(namespace, 2, policy))

    emulator = Emulator(seed)
    kubeconfig = emulator.kubeconfig(tmp_path / "kubeconfig")
    yield {"KUBECONFIG": str(kubeconfig), "KUBERNETES_SERVICE_HOST": ""}
    emulator.close()


@pytest.fixture
def spawn():
    """spawn(args, env) -> a started `atoll ARGS` (output on stdout); killed at the test's
    end whatever happened (an assert, a communicate() timeout), so none outlives it."""
    procs: list[subprocess.Popen] = []

    def start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "atoll.cli", *args],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO), **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        return procs[-1]

    yield start
    for proc in procs:
        proc.kill()  # a no-op on one that exited
        proc.wait()
        proc.stdout.close()


def _seed(clients: list[ShardClient]) -> None:
    """Seeds every fragment on shard p mod 2 (the run's first layout)."""
    for p in range(PLAN.num_fragments):
        values = np.random.default_rng(p).standard_normal(PLAN.fragment_sizes[p])
        frame = codec.encode(values.astype(np.float32), codec.Codec.FP32)
        clients[p % 2].init(PLAN, p, frame, codec.Codec.FP32)


def _owned(clients: list[ShardClient]) -> dict[int, tuple[int, int]]:
    """{fragment: (shard holding it, its version)}; no fragment on two shards."""
    owned: dict[int, tuple[int, int]] = {}
    for i, c in enumerate(clients):
        for f in c.describe().fragments:
            assert f.fragment not in owned, f"fragment {f.fragment} on two shards"
            owned[f.fragment] = (i, f.version)
    return owned


def test_a_scale_down_drains_the_leaving_shards_into_those_that_stay(tmp_path, api, spawn):
    # scaled up: `atoll reshard` found shards 2 and 3 through the pattern (LAYOUT)
    with _four_shards(tmp_path) as (pattern, shard, procs, clients, acked):
        owners = dict(LAYOUT)
        # a shard that stays keeps its fragments (a restart, an eviction)
        stays = run_atoll(*drain_args(pattern, 1), env=api)
        assert stays.returncode == 0, stays.stdout + stays.stderr
        assert "stays (2 replicas)" in stays.stdout
        # the StatefulSet went from 4 to 2: pods 2 and 3 run their preStop hooks at once
        leaving = [
            spawn(drain_args(pattern, i, "--namespace", "atoll", *POLL), api) for i in (3, 2)
        ]
        outs = [p.communicate(timeout=180)[0] for p in leaving]
        assert [p.returncode for p in leaving] == [0, 0], outs
        waited, led = outs
        assert "owns no fragment" in waited and "plans" not in waited  # shard 2 planned
        moves = json.loads(led[led.index("\n{") :])["moves"]
        assert sorted((m["fragment"], m["from"]) for m in moves) == sorted(
            (p, i) for p, i in owners.items() if i >= 2
        )
        assert {m["to"] for m in moves} == {0, 1}
        after = _owned(clients)
        # every fragment on a shard that stays, balanced, with every acknowledged push
        assert {i for i, _ in after.values()} == {0, 1}
        assert sorted(i for i, _ in after.values()) == [0, 0, 1, 1]
        assert {p: v for p, (_, v) in after.items()} == acked
        for i in (2, 3):  # the pods go
            procs[i].kill()
        # the map the shards that stay hold sends every fragment to them, versions go on
        for p, (i, v) in after.items():
            assert client_push(clients[i], p, v + 1, v).accepted
        again = _owned(clients[:2])
        assert {p: v for p, (_, v) in again.items()} == {p: n + 1 for p, n in acked.items()}
        # nothing left to do: the first leaving shard finds no shard past the others
        done = run_atoll("reshard", "--shards", pattern, "--to", "2")
        assert done.returncode == 0, done.stdout + done.stderr
        assert json.loads(done.stdout[done.stdout.index("\n{") :])["moves"] == []
        # pods stopped one at a time (OrderedReady), highest first: shard 3's hook moves
        # what shards 2 and 3 own while shard 2 still runs, and shard 2's finds nothing
        for i in (2, 3):
            procs[i] = shard(i)
        up = run_atoll("reshard", "--shards", pattern, "--to", "4")
        assert up.returncode == 0, up.stdout + up.stderr
        ordered = ("--namespace", "ordered", *POLL)
        first = run_atoll(*drain_args(pattern, 3, *ordered), env=api)
        assert first.returncode == 0, first.stdout + first.stderr
        assert len(json.loads(first.stdout[first.stdout.index("\n{") :])["moves"]) == 2
        procs[3].kill()
        second = run_atoll(*drain_args(pattern, 2, *ordered), env=api)
        assert second.returncode == 0, second.stdout + second.stderr
        assert json.loads(second.stdout[second.stdout.index("\n{") :])["moves"] == []
        assert sorted(i for i, _ in _owned(clients[:3]).values()) == [0, 0, 1, 1]


def test_drain_says_what_it_cannot_do(tmp_path, api):
    pattern = "127.0.0.1:1{i}"  # nothing listens on ports 10-13
    gone = run_atoll(*drain_args(pattern, 3, "--namespace", "elsewhere"), env=api)
    assert gone.returncode == 0 and "is gone" in gone.stdout, gone.stdout + gone.stderr
    zero = run_atoll(*drain_args(pattern, 0, "--replicas", "0"))
    assert zero.returncode == 2 and "scales to 0" in zero.stdout
    dead_api = tmp_path / "kubeconfig-down"
    config = json.loads(pathlib.Path(api["KUBECONFIG"]).read_text())
    config["clusters"][0]["cluster"]["server"] = "http://127.0.0.1:1"  # nothing listens
    dead_api.write_text(json.dumps(config))
    down = run_atoll(*drain_args(pattern, 3), env={**api, "KUBECONFIG": str(dead_api)})
    assert down.returncode == 2 and "cannot reach the Kubernetes API" in down.stdout, (
        down.stdout + down.stderr
    )
    leaves = drain_args(pattern, 3, "--replicas", "1")  # shard 3 of 4 leaves, 1 stays
    no_ca = run_atoll(*leaves, "--tls-ca", str(tmp_path / "ca.crt"))
    assert no_ca.returncode == 2 and "no such file" in no_ca.stdout, no_ca.stdout + no_ca.stderr
    # the preStop hook gives no flags: the TLS files come from the pod's environment
    env_ca = run_atoll(*leaves, env={"ATOLL_DRAIN_TLS_CA": str(tmp_path / "ca.crt")})
    assert (
        env_ca.returncode == 2 and "--tls-ca" in env_ca.stdout and "no such file" in env_ca.stdout
    )
    env_cert = run_atoll(
        *leaves, env={"ATOLL_DRAIN_TLS_CA": "ca.crt", "ATOLL_DRAIN_TLS_CERT": "tls.crt"}
    )
    assert env_cert.returncode == 2 and "go together" in env_cert.stderr, env_cert.stderr
    for out in (down, no_ca, env_ca, env_cert):
        assert "Traceback" not in out.stdout + out.stderr
    for bad, says in [
        (["--shards", "h:1,h:2"], "pattern"),
        (["--shards", pattern, "--shard-index", "0", "--timeout", "0"], "--timeout"),
        (["--shards", pattern, "--shard-index", "0", "--poll", "0"], "--poll"),
        (["--shards", pattern], "--shard-index"),
    ]:
        out = run_atoll("drain", *bad, env={"ATOLL_POD_NAME": "", "ATOLL_SHARD_INDEX": ""})
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr
    token = tmp_path / "token"
    token.write_text("learner-a " + "x" * 40 + "\n")
    bound = run_atoll(*leaves, "--token-file", str(token))
    assert bound.returncode == 2 and "bound to a learner" in bound.stdout
    assert "Traceback" not in bound.stdout + bound.stderr
    # a shard that stays needs no operator token: a restart never fails on it
    stays = run_atoll(*drain_args(pattern, 0, "--replicas", "1", "--token-file", str(token)))
    assert stays.returncode == 0 and "stays" in stays.stdout


LAYOUT = {0: 0, 1: 1, 2: 3, 3: 2}  # {fragment: shard} after `atoll reshard --to 4`


@contextlib.contextmanager
def _four_shards(tmp_path: pathlib.Path):
    """Four shard processes on consecutive ports, the fragments on them as in LAYOUT (by
    `atoll reshard --to 4`), fragment p given p + 1 acknowledged pushes; yields (pattern,
    start(i) -> shard i (re)started on its data directory, procs, clients, {fragment: its
    version})."""
    prefix = consecutive_ports(SHARDS)
    pattern = f"127.0.0.1:{prefix}{{i}}"
    with syncer_processes(tmp_path) as start:

        def shard(i: int):
            listen = pattern.replace("{i}", str(i))
            return start(tmp_path / f"s{i}", "--shard-index", str(i), "--listen", listen, *FLAGS)

        with ThreadPoolExecutor(SHARDS) as pool:  # side by side: each start waits on imports
            procs = list(pool.map(shard, range(SHARDS)))
        clients = [
            ShardClient(pattern.replace("{i}", str(i)), "l0", deadline=30.0) for i in range(SHARDS)
        ]
        try:
            _seed(clients)
            up = run_atoll("reshard", "--shards", pattern, "--to", "4")
            assert up.returncode == 0, up.stdout + up.stderr
            assert {p: i for p, (i, _) in _owned(clients).items()} == LAYOUT
            planned = json.loads(up.stdout[up.stdout.index("\n{") :])["owners"]
            assert planned == [LAYOUT[p] for p in range(len(LAYOUT))], "what it said it did"
            acked = {}
            for p, i in LAYOUT.items():
                for seq in range(1, 2 + p):
                    assert client_push(clients[i], p, seq, seq - 1).accepted
                acked[p] = 1 + p
            yield pattern, shard, procs, clients, acked
        finally:
            for c in clients:
                c.close()


def _frozen(clients: list[ShardClient]) -> list[tuple[int, int]]:
    """(shard, fragment) of every fragment a shard holds frozen mid-move."""
    return [(i, f.fragment) for i, c in enumerate(clients) for f in c.describe().fragments
            if f.moving_version]  # fmt: skip


def test_a_drain_waits_for_a_target_that_restarts(tmp_path, api, spawn):
    # shards 4 -> 2 while shard 0 restarts (a rolling update): shard 2 plans, moves fragment
    # 2 from shard 3 to shard 1, and fragment 3 waits on shard 2, serving, for shard 0
    with _four_shards(tmp_path) as (pattern, shard, procs, clients, acked):
        procs[0].kill()  # SIGKILL: it comes back on its volume
        flags = ("--namespace", "atoll", "--timeout", "45", *POLL)
        leaving = {i: spawn(drain_args(pattern, i, *flags), api) for i in (3, 2)}
        out3 = leaving[3].communicate(timeout=40)[0]
        assert leaving[3].returncode == 0, out3  # its fragment is on shard 1
        assert [f.fragment for f in clients[1].describe().fragments] == [1, 2]
        # fragment 3 waits unfrozen on shard 2, and takes pushes meanwhile
        assert leaving[2].poll() is None
        assert _frozen(clients[1:]) == []
        assert client_push(clients[2], 3, acked[3] + 1, acked[3]).accepted
        acked[3] += 1
        procs[0] = shard(0)  # back after a delay, replaying its log
        out2 = leaving[2].communicate(timeout=40)[0]
        assert leaving[2].returncode == 0, out2
        assert "fragment 3: shard 2 or 0 is not serving" in out2, out2
        assert "Traceback" not in out2 + out3
        after = _owned(clients[:2])  # every fragment on exactly one shard that stays
        assert sorted(i for i, _ in after.values()) == [0, 0, 1, 1]
        assert {p: v for p, (_, v) in after.items()} == acked  # nothing acknowledged lost
        assert _frozen(clients) == [] and [len(c.describe().fragments) for c in clients[2:]] == [
            0,
            0,
        ]
        for p, (i, v) in after.items():
            assert client_push(clients[i], p, v + 1, v).accepted


def test_a_drain_whose_target_never_returns_leaves_nothing_frozen(tmp_path, api):
    # shard 0, the target of fragment 3, is gone for longer than the drain's --timeout
    with _four_shards(tmp_path) as (pattern, shard, procs, clients, acked):
        procs[0].kill()
        # 3 s: the first round must move fragment 2 to shard 1 (and skip fragment 3) before
        # the timeout, as none starts after it: a round is a few calls, well under 1 s on 2
        # loaded cores since a probe where nothing listens ends at once (it took over 3 s
        # when the probe of shard 4 waited 5 s); the rest are rounds at --poll 0.1 that find
        # shard 0 still down
        flags = ("--namespace", "atoll", "--timeout", "3", *POLL)
        out = run_atoll(*drain_args(pattern, 2, *flags), env=api)
        assert out.returncode == 2, out.stdout + out.stderr
        assert "Traceback" not in out.stdout + out.stderr
        message = out.stdout.strip().splitlines()[-1]
        assert "shard 2 still holds fragments [3] after 3 s (shards [0] did not serve)" in message
        assert "none frozen" in message and f"atoll reshard --shards '{pattern}' --to 2" in message
        # every fragment but shard 0's own takes pushes where it is; none is frozen
        live = {i: clients[i] for i in (1, 2, 3)}
        assert _frozen(list(live.values())) == []
        owners = {f.fragment: i for i, c in live.items() for f in c.describe().fragments}
        assert owners == {1: 1, 2: 1, 3: 2}
        for p, i in owners.items():
            assert client_push(clients[i], p, acked[p] + 1, acked[p]).accepted
            acked[p] += 1
        # the way out the message gives: shard 0 back, then atoll reshard
        procs[0] = shard(0)
        done = run_atoll("reshard", "--shards", pattern, "--to", "2")
        assert done.returncode == 0, done.stdout + done.stderr
        after = _owned(clients)
        assert sorted(i for i, _ in after.values()) == [0, 0, 1, 1]
        assert {p: v for p, (_, v) in after.items()} == acked
