"""The operator tools against shards that require mutual TLS and a bearer token, as with
k8s/components/tls: `atoll status`, `atoll reshard` and `atoll drain` reach them with
--tls-ca/--tls-cert/--tls-key, and fail readably without. Real `atoll syncer` processes
over real sockets; certificates made per run (pki.py)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pki import pki  # noqa: F401 (a fixture)
from syncer_helpers import PLAN, run_atoll, syncer_processes
from test_scale_down import consecutive_ports, drain_args

from atoll.wire import codec
from atoll.wire.client import ShardClient, TlsFiles

OPERATOR = "operator-token-5b2e8c1d9f0a4e3b7c6d"  # a bare line: bound to no learner
FLAGS = ("--num-shards", "2", "--quorum", "1", "--grace-factor", "0")


@pytest.fixture
def shards(tmp_path, pki):
    """Two shards on 127.0.0.1:{prefix}0 and :{prefix}1 with mutual TLS and tokens, every
    fragment seeded on shard p mod 2; yields (address pattern, operator flags)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{OPERATOR}\n")
    prefix = consecutive_ports(2)
    pattern = f"127.0.0.1:{prefix}{{i}}"
    tls = ("--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert))
    tls += ("--tls-key", str(pki.client_key))
    with syncer_processes(tmp_path) as start:

        def shard(i: int):
            return start(
                tmp_path / f"shard{i}",
                *FLAGS,
                "--shard-index",
                str(i),
                "--listen",
                pattern.replace("{i}", str(i)),
                "--tls-cert",
                pki.server_cert,
                "--tls-key",
                pki.server_key,
                "--tls-client-ca",
                pki.ca,
                "--token-file",
                tokens,
                "--health-port",
                "0",
            )

        with ThreadPoolExecutor(2) as pool:  # side by side: each start waits on imports
            list(pool.map(shard, (0, 1)))
        files = TlsFiles(pki.ca, pki.client_cert, pki.client_key)
        clients = [
            ShardClient(pattern.replace("{i}", str(i)), "seed", token=OPERATOR, tls=files)
            for i in (0, 1)
        ]
        for p in range(PLAN.num_fragments):
            values = np.random.default_rng(p).standard_normal(PLAN.fragment_sizes[p])
            frame = codec.encode(values.astype(np.float32), codec.Codec.FP32)
            clients[p % 2].init(PLAN, p, frame, codec.Codec.FP32)
        yield pattern, clients, [*tls, "--token-file", str(tokens)]
        for c in clients:
            c.close()


def test_status_reshard_and_drain_reach_shards_over_mutual_tls(shards, pki):
    pattern, clients, operator = shards
    addresses = ",".join(pattern.replace("{i}", str(i)) for i in (0, 1))

    # a status that cannot reach a shard waits out its --deadline (its Describe waits for
    # the channel): 1 s, where a shard that can be reached answers in milliseconds
    plain = run_atoll("status", "--shards", addresses, "--deadline", "1", "--json")
    assert plain.returncode == 1, plain.stderr  # plaintext reaches no shard
    assert all("error" in s for s in json.loads(plain.stdout)["shards"])
    no_cert = run_atoll(
        "status", "--shards", addresses, "--deadline", "1", "--json", "--tls-ca", str(pki.ca)
    )
    assert no_cert.returncode == 1  # mutual TLS: the CA alone is not enough

    status = run_atoll("status", "--shards", addresses, "--json", *operator)
    assert status.returncode == 0, status.stdout + status.stderr
    described = [s["describe"] for s in json.loads(status.stdout)["shards"]]
    assert [d["shard_index"] for d in described] == [0, 1]
    assert sorted(f["fragment"] for d in described for f in d["fragments"]) == [0, 1, 2, 3]

    moved = run_atoll("reshard", "--shards", pattern, "--to", "1", *operator)
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert json.loads(moved.stdout[moved.stdout.index("{") :])["owners"] == [0, 0, 0, 0]
    assert sorted(f.fragment for f in clients[0].describe().fragments) == [0, 1, 2, 3]

    back = run_atoll("reshard", "--shards", pattern, "--to", "2", *operator)
    assert back.returncode == 0, back.stdout + back.stderr
    assert len(clients[1].describe().fragments) == 2

    # Shard 1 leaves (1 replica stays): its preStop hook hands its fragments to shard 0.
    drained = run_atoll(*drain_args(pattern, 1, "--replicas", "1", *operator))
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert json.loads(drained.stdout.splitlines()[-1])["drained"] is True
    assert clients[1].describe().fragments == []
    assert len(clients[0].describe().fragments) == PLAN.num_fragments


def test_tls_flags_that_do_not_fit_are_flag_errors(tmp_path, pki):
    missing = str(tmp_path / "nowhere.pem")
    for argv, says in (
        (["status", "--shards", "127.0.0.1:1", "--tls-cert", str(pki.client_cert)], "together"),
        (
            ["status", "--shards", "127.0.0.1:1"]
            + ["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)],
            "needs --tls-ca",
        ),
        (["reshard", "--shards", "127.0.0.1:1", "--to", "1", "--tls-ca", missing], "no such"),
        (["drain", "--shards", "h-{i}:1", "--shard-index", "0", "--tls-key", missing], "together"),
    ):
        r = run_atoll(*argv)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_drain_that_stays_never_reads_its_tls_files(tmp_path):
    """A restart (the shard stays) must not fail on a Secret that is not mounted yet."""
    missing = str(tmp_path / "ca.crt")
    r = run_atoll(
        "drain", "--shards", "h-{i}:1", "--shard-index", "0", "--replicas", "1", "--tls-ca", missing
    )
    assert r.returncode == 0 and "keeps its fragments" in r.stdout, r.stdout + r.stderr
    gone = run_atoll(
        "drain", "--shards", "h-{i}:1", "--shard-index", "1", "--replicas", "1", "--tls-ca", missing
    )
    assert gone.returncode == 2 and "no such file" in gone.stdout, gone.stdout + gone.stderr
