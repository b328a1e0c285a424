"""`atoll status` and `atoll chaos --kubernetes` against kmock's Kubernetes emulator over HTTP
(reached through a kubeconfig file) and two real `atoll syncer` processes as the shard pods.

The emulator ignores label selectors (it lists every pod of the namespace), so the decoy
pods here also check that atoll repeats the label check itself before showing or deleting.

A second emulator plays a learner cluster (`--learner-context`), and a third, over HTTPS
with a service-account token, the cluster the operator Jobs of k8s/components/operator run
in; every request atoll makes is checked against that component's Role for its Job
(atoll-operator for status, which may not delete; atoll-chaos for chaos).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import ipaddress
import json
import pathlib
import random
import re
import ssl
import statistics
import threading

import aiohttp.test_utils
import kmock
import numpy as np
import pytest
import yaml
from syncer_helpers import PLAN, connect, describe, free_port, init, push, syncer_processes

from atoll.cluster import kube, kube_chaos

NS = "atoll"
SYNCER = {
    "app.kubernetes.io/name": "atoll",
    "app.kubernetes.io/part-of": "atoll",
    "app.kubernetes.io/component": "syncer",
}
LEARNER = {**SYNCER, "app.kubernetes.io/component": "learner"}
LEARNERS = {
    "atoll-learner-us-0": "us-east",
    "atoll-learner-us-1": "us-east",
    "atoll-learner-eu-0": "eu-west",
    "atoll-learner-eu-1": "eu-west",
}
NOT_READY = "atoll-learner-eu-1"
# not atoll's: no labels; a learner and a syncer of some other app (no app.kubernetes.io/name=atoll)
BYSTANDERS = {
    "postgres-0": {},
    "other-learner": {"app.kubernetes.io/component": "learner"},
    "other-syncer": {"app.kubernetes.io/component": "syncer"},
}
# a learner cluster's learners (context kmock-learners), beside a pod of another app
REMOTE = {"atoll-learner-v5p-slice-0": "us-east5", "atoll-learner-v5p-slice-1": "us-east5"}
COMPUTE_PER_PUSH = 10 * 0.5 / PLAN.num_fragments  # inner_steps x step_seconds / fragments
ROLE = pathlib.Path(__file__).resolve().parents[2] / "k8s" / "components" / "operator" / "rbac.yaml"


def pod(
    name: str,
    labels: dict,
    namespace: str = NS,
    ports: dict | None = None,
    ready: bool = True,
    restarts: int = 0,
    node: str = "node-a",
) -> dict:
    container = {
        "name": "main",
        "image": "atoll:test",
        "ports": [{"name": n, "containerPort": p} for n, p in (ports or {}).items()],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"nodeName": node, "containers": [container]},
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": str(ready)}],
            "containerStatuses": [
                {
                    "name": "main",
                    "image": "atoll:test",
                    "imageID": "",
                    "ready": ready,
                    "restartCount": restarts,
                }
            ],
        },
    }


class Emulator:
    """kmock's KubernetesEmulator served over HTTP (HTTPS with `tls`) from its own thread and
    event loop; `seed(k)` fills it."""

    def __init__(self, seed, tls: ssl.SSLContext | None = None):
        self.seed, self.tls, self.ready, self.stop = seed, tls, threading.Event(), None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self.thread.start()
        assert self.ready.wait(30), "emulator did not start"

    async def _serve(self) -> None:
        server_cls = _tls_server(self.tls) if self.tls else aiohttp.test_utils.RawTestServer
        async with (
            kmock.KubernetesEmulator() as k,
            kmock.Server(k, server_cls=server_cls) as server,
        ):
            self.seed(k)
            self.k, self.url, self.port, self.stop = (
                k,
                str(server.url).rstrip("/"),
                server.port,
                asyncio.Event(),
            )
            self.loop = asyncio.get_running_loop()
            self.ready.set()
            await self.stop.wait()

    def kubeconfig(self, path: pathlib.Path, token: str = "test-token") -> pathlib.Path:
        """Writes a kubeconfig whose current context ("kmock") reaches this emulator with a
        bearer `token`; returns its path."""
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "kmock",
                    "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
                    "users": [{"name": "user", "user": {"token": token}}],
                    "contexts": [
                        {"name": "kmock", "context": {"cluster": "kmock", "user": "user"}}
                    ],
                }
            )
        )
        return path

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=30)

    def requests(self, method: str | None = None, namespace: str | None = None) -> list:
        return [
            r
            for r in list(self.k)
            if r.resource is not None
            and r.resource.plural == "pods"
            and (method is None or r.method.value.upper() == method)
            and (namespace is None or r.namespace == namespace)
        ]

    def alive(self, name: str, namespace: str = NS) -> bool:
        try:  # (kmock's `in` wants a parsed resource; its [] parses the string)
            return not self.k.objects["v1/pods", namespace, name].deleted
        except KeyError:
            return False


def _tls_server(context: ssl.SSLContext):
    class TlsServer(aiohttp.test_utils.RawTestServer):
        async def start_server(self, loop=None, **kwargs):
            return await super().start_server(loop=loop, ssl=context, **kwargs)

    return TlsServer


def seed_run(k, shards: list[tuple[int, int]]) -> None:
    """Namespace `atoll` with the two shard pods, the learner pods and the bystanders."""
    serve_namespace(k, NS, {"atoll.dev/enabled": "true"})
    for i, (grpc_port, metrics_port) in enumerate(shards):
        add_pod(
            k,
            pod(
                f"atoll-syncer-{i}",
                SYNCER,
                ports={"grpc": grpc_port, "metrics": metrics_port},
                node=f"node-{i}",
                restarts=i,
            ),
        )
    for name, region in LEARNERS.items():
        add_pod(
            k,
            pod(
                name,
                {**LEARNER, "atoll.dev/region": region},
                ports={"metrics": 9091},
                ready=name != NOT_READY,
                restarts=2 * (name == NOT_READY),
            ),
        )
    for name, labels in BYSTANDERS.items():
        add_pod(k, pod(name, labels, ports={"grpc": shards[0][0]}))


def serve_namespace(k, name: str, labels: dict) -> None:
    # kmock reads GET /api/v1/namespaces/NAME as a list, so namespaces are served explicitly
    obj = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
    k[f"get /api/v1/namespaces/{name}"] << (lambda: obj)


def add_pod(k, p: dict) -> None:
    k.objects["v1/pods", p["metadata"]["namespace"], p["metadata"]["name"]] = p


class Cluster(Emulator):
    """The syncer's cluster (context kmock) and a learner cluster (context kmock-learners)."""

    def __init__(self, shards: list[tuple[int, int]], tmp_path):
        self.shards = shards
        super().__init__(self._seed)
        self.learners = Emulator(self._seed_learners)
        # one kubeconfig, three contexts: the two emulators, and (current) an API nobody listens on
        self.dead_url = f"http://127.0.0.1:{free_port()}"
        self.kubeconfig = tmp_path / "kubeconfig"
        self.kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "down",
                    "clusters": [
                        {"name": "kmock", "cluster": {"server": self.url}},
                        {"name": "kmock-learners", "cluster": {"server": self.learners.url}},
                        {"name": "down", "cluster": {"server": self.dead_url}},
                    ],
                    "users": [{"name": "tester", "user": {"token": "test-token"}}],
                    "contexts": [
                        {"name": "kmock", "context": {"cluster": "kmock", "user": "tester"}},
                        {
                            "name": "kmock-learners",
                            "context": {"cluster": "kmock-learners", "user": "tester"},
                        },
                        {"name": "down", "context": {"cluster": "down", "user": "tester"}},
                    ],
                }
            )
        )

    def close(self) -> None:
        self.learners.close()
        super().close()

    @staticmethod
    def _seed_learners(k) -> None:
        serve_namespace(k, NS, {"atoll.dev/enabled": "true"})
        for name, region in REMOTE.items():
            add_pod(k, pod(name, {**LEARNER, "atoll.dev/region": region}, ports={"metrics": 9091}))
        add_pod(k, pod("other-learner", {"app.kubernetes.io/component": "learner"}))

    def _seed(self, k) -> None:
        def namespace(name: str, labels: dict) -> None:
            serve_namespace(k, name, labels)

        def add(p: dict) -> None:
            add_pod(k, p)

        seed_run(k, self.shards)
        # labelled, but one shard does not answer and the other is not ready
        namespace("atoll-down", {"atoll.dev/enabled": "true"})
        add(
            pod(
                "atoll-syncer-0",
                SYNCER,
                "atoll-down",
                ports={"grpc": free_port(), "metrics": free_port()},
            )
        )
        add(
            pod(
                "atoll-syncer-1",
                SYNCER,
                "atoll-down",
                ports={"grpc": self.shards[1][0]},
                ready=False,
            )
        )
        namespace("plain", {})  # not marked for atoll: every tool must refuse it
        add(pod("atoll-learner-0", LEARNER, "plain"))
        namespace("locked", {"atoll.dev/enabled": "true"})
        k["get /api/v1/namespaces/locked/pods"] << kmock.KubernetesError(
            status=403,
            reason="Forbidden",
            message='pods is forbidden: User "tester" cannot list pods',
        )


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two `atoll syncer` shards (quorum 1, /metrics on) with every fragment initialised and one
    push to fragment 0; yields [(grpc port, metrics port)]."""
    tmp = tmp_path_factory.mktemp("shards")
    with syncer_processes(tmp) as start:
        ports = []
        for i in range(2):
            metrics = free_port()
            proc = start(
                tmp / f"s{i}",
                "--shard-index",
                i,
                "--num-shards",
                2,
                "--quorum",
                1,
                "--grace-factor",
                0,
                "--lease-seconds",
                600,
                "--metrics-port",
                metrics,
            )
            ports.append((proc.port, metrics))
        for p in range(PLAN.num_fragments):
            with_stub(
                ports[p % 2][0], lambda stub: init(stub, PLAN, p, np.zeros(PLAN.fragment_sizes[p]))
            )
        push_to(ports, 0, seq=1)
        yield ports


def with_stub(port: int, call):
    channel, stub = connect(port)
    try:
        return call(stub)
    finally:
        channel.close()


def versions(port: int) -> dict[int, tuple[int, int]]:
    return {f.fragment: (f.version, f.round_size) for f in with_stub(port, describe).fragments}


def push_to(ports, fragment: int, seq: int) -> None:
    """One accepted push from learner "a"; quorum 1 closes its round at once."""
    port = ports[fragment % 2][0]
    base = versions(port)[fragment][0]
    delta = np.full(PLAN.fragment_sizes[fragment], 0.01, np.float32)
    ack = with_stub(
        port, lambda stub: push(stub, PLAN, fragment, "a", seq, base, delta, step_seconds=0.5)
    )
    assert ack.accepted, ack


@pytest.fixture
def cluster(shards, tmp_path):
    c = Cluster(shards, tmp_path)
    yield c
    c.close()


def status_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="atoll status")
    kube.add_status_arguments(p)
    return p


def chaos_parser() -> argparse.ArgumentParser:
    """`atoll chaos` as the CLI builds it: the local mode's flags and the Kubernetes mode's."""
    from atoll.faults.chaos import add_arguments

    p = argparse.ArgumentParser(prog="atoll chaos")
    add_arguments(p)
    return p


def run(main, parser, argv: list[str]) -> int:
    return main(parser.parse_args(argv), parser)


class ChaosTime:
    """`atoll chaos`'s clock and sleep: a sleep moves the clock at once, so the deletions a
    seed draws are the same on a loaded host as on an idle one (real time let slow API
    calls eat the window). `during()` runs in the first sleep, after the first scrape:
    work done then falls in the window."""

    def __init__(self):
        self.now = 0.0
        self.during = lambda: None

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.during()
        self.during = lambda: None
        self.now += seconds


@pytest.fixture
def chaos_time(monkeypatch) -> ChaosTime:
    """`atoll chaos` (chaos_main) runs on a ChaosTime."""
    fake = ChaosTime()
    monkeypatch.setattr(
        kube_chaos, "chaos", functools.partial(kube_chaos.chaos, clock=fake.clock, sleep=fake.sleep)
    )
    return fake


# --- status ---


def test_status_lists_shards_with_their_versions_and_learners_with_readiness(
    cluster, shards, capsys
):
    argv = ["--kubeconfig", str(cluster.kubeconfig), "--context", "kmock", "--namespace", NS]
    assert run(kube.status_main, status_parser(), argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["pod"] for s in report["shards"]] == ["atoll-syncer-0", "atoll-syncer-1"]
    for i, s in enumerate(report["shards"]):
        assert (s["index"], s["ready"], s["restarts"], s["node"]) == (i, True, i, f"node-{i}")
        assert s["address"] == f"127.0.0.1:{shards[i][0]}"
        d = s["describe"]
        assert (d["shard_index"], d["num_shards"], d["live_learners"]) == (i, 2, ["a"])
        assert {f["fragment"]: (f["version"], f["round_size"]) for f in d["fragments"]} == versions(
            shards[i][0]
        )
    assert report["shards"][0]["describe"]["fragments"][0]["version"] >= 1  # the fixture's push
    learners = {r["pod"]: r for r in report["learners"]}
    assert set(learners) == set(LEARNERS)  # no bystanders, whatever the selector returned
    assert {n: (r["region"], r["ready"]) for n, r in learners.items()} == {
        n: (region, n != NOT_READY) for n, region in LEARNERS.items()
    }
    assert learners[NOT_READY]["restarts"] == 2

    assert run(kube.status_main, status_parser(), argv) == 0
    table = capsys.readouterr().out
    assert "atoll-syncer-1" in table and "eu-west" in table and "3/4 learner pods ready" in table
    assert "postgres-0" not in table and "other-syncer" not in table


def test_status_reports_a_shard_that_does_not_answer(cluster, capsys):
    argv = [
        "--kubeconfig",
        str(cluster.kubeconfig),
        "--context",
        "kmock",
        "--namespace",
        "atoll-down",
        "--deadline",
        "1",
        "--json",
    ]
    assert run(kube.status_main, status_parser(), argv) == 1
    s0, s1 = json.loads(capsys.readouterr().out)["shards"]
    assert "describe" not in s0 and s0["error"].startswith(
        ("unreachable (UNAVAILABLE", "unreachable (DEADLINE")
    )
    assert s1["error"] == "not asked: pod not ready" and s1["ready"] is False


def test_status_of_shards_given_directly(shards, capsys):
    dead = free_port()
    argv = [
        "--shards",
        f"127.0.0.1:{shards[0][0]},127.0.0.1:{shards[1][0]},127.0.0.1:{dead}",
        "--deadline",
        "1",
    ]
    assert run(kube.status_main, status_parser(), argv) == 1
    table = capsys.readouterr().out
    version, open_round = versions(shards[0][0])[0]
    assert f"0:v{version}/{open_round}" in table and "unreachable" in table


def test_kubeconfig_from_the_environment(cluster, monkeypatch, capsys):
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    assert (
        run(kube.status_main, status_parser(), ["--context", "kmock", "--namespace", NS, "--json"])
        == 0
    )
    assert len(json.loads(capsys.readouterr().out)["learners"]) == len(LEARNERS)


def test_config_and_api_errors_are_readable(cluster, tmp_path, monkeypatch, capsys):
    def error(main, parser, argv) -> str:
        assert run(main, parser, argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return err

    config = ["--kubeconfig", str(cluster.kubeconfig)]
    err = error(
        kube.status_main, status_parser(), config + ["--context", "down"]
    )  # nobody listening
    assert "cannot reach the Kubernetes API" in err and cluster.dead_url in err
    err = error(
        kube_chaos.chaos_main,
        chaos_parser(),
        ["--kubernetes", *config, "--context", "down", "--mtbf", "1", "--duration", "1"],
    )
    assert "cannot reach the Kubernetes API" in err
    assert "forbidden" in error(
        kube.status_main, status_parser(), config + ["--context", "kmock", "--namespace", "locked"]
    )
    assert "does not exist" in error(
        kube.status_main, status_parser(), config + ["--context", "kmock", "--namespace", "nowhere"]
    )
    assert "context" in error(kube.status_main, status_parser(), config + ["--context", "nosuch"])
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    err = error(kube.status_main, status_parser(), [])
    assert "no usable Kubernetes config" in err and "--shards HOST:PORT" in err  # the other way


def test_status_shards_must_be_host_and_port(capsys):
    for bad in ("nonsense", "host:99999", "host:0", ":50051", "host:port", "a:1,b"):
        with pytest.raises(SystemExit) as e:
            run(kube.status_main, status_parser(), ["--shards", bad])
        assert e.value.code == 2
        assert "--shards" in capsys.readouterr().err


# --- chaos ---


def test_chaos_deletes_only_learner_pods_and_measures_goodput(cluster, shards, capsys, chaos_time):
    argv = [
        "--kubernetes",
        "--kubeconfig",
        str(cluster.kubeconfig),
        "--context",
        "kmock",
        "--namespace",
        NS,
        "--mtbf",
        "2",
        "--duration",
        "2.5",
        "--seed",
        "1",
        "--json",
    ]
    pushes = 2

    def work() -> None:  # pushed in the window, after the first scrape: counted
        for seq in range(2, 2 + pushes):
            push_to(shards, 0, seq)

    chaos_time.during = work
    assert run(kube_chaos.chaos_main, chaos_parser(), argv) == 0
    r = json.loads(capsys.readouterr().out)

    deletes = [q.name for q in cluster.requests("DELETE")]
    assert (
        r["failures_injected"] == len(deletes) == len(r["deleted"]) >= 1
    )  # seed 1: first after 0.07 s
    assert deletes == r["deleted"] and set(deletes) <= set(LEARNERS)
    assert not any(cluster.alive(name) for name in deletes)
    assert all(cluster.alive(name) for name in [*BYSTANDERS, "atoll-syncer-0", "atoll-syncer-1"])
    selectors = {q.params.get("labelSelector") for q in cluster.requests("GET", NS)}
    assert selectors == {
        "app.kubernetes.io/component=learner,app.kubernetes.io/name=atoll",
        "app.kubernetes.io/component=syncer,app.kubernetes.io/name=atoll",
    }

    assert r["learner_pods"] == len(LEARNERS) and r["unscraped_shards"] == []
    assert r["accepted_compute_seconds"] == pytest.approx(pushes * COMPUTE_PER_PUSH)
    assert r["goodput"] == pytest.approx(
        pushes * COMPUTE_PER_PUSH / (len(LEARNERS) * r["window_seconds"])
    )
    assert r["rounds_closed"] == pushes
    assert r["version_advance"] == {"0": pushes, "1": 0, "2": 0, "3": 0}


def test_chaos_dry_run_deletes_nothing(cluster, capsys):
    argv = [
        "--kubernetes",
        "--kubeconfig",
        str(cluster.kubeconfig),
        "--context",
        "kmock",
        "--namespace",
        NS,
        "--mtbf",
        "1",
        "--duration",
        "5",
        "--dry-run",
    ]
    assert run(kube_chaos.chaos_main, chaos_parser(), argv) == 0
    out = capsys.readouterr().out
    planned = [line.split()[3] for line in out.splitlines() if line.startswith("would delete pod")]
    assert planned and set(planned) <= set(LEARNERS) and "nothing was deleted" in out
    assert cluster.requests("DELETE") == []
    assert all(cluster.alive(name) for name in [*LEARNERS, *BYSTANDERS])


def test_chaos_refuses_an_unlabelled_namespace_before_touching_it(cluster, capsys):
    argv = [
        "--kubernetes",
        "--kubeconfig",
        str(cluster.kubeconfig),
        "--context",
        "kmock",
        "--namespace",
        "plain",
        "--mtbf",
        "0.1",
        "--duration",
        "1",
    ]
    assert run(kube_chaos.chaos_main, chaos_parser(), argv) == 2
    err = capsys.readouterr().err
    assert "not labelled atoll.dev/enabled=true" in err and "Traceback" not in err
    assert cluster.requests(namespace="plain") == []  # not even listed
    assert cluster.alive("atoll-learner-0", "plain")
    assert run(kube.status_main, status_parser(), argv[1:7]) == 2


def test_chaos_flags(cluster):
    base = ["--kubernetes", "--kubeconfig", str(cluster.kubeconfig), "--context", "kmock"]
    for bad in (
        ["--mtbf", "1"],
        ["--duration", "1"],
        ["--mtbf", "0", "--duration", "1"],
        ["--mtbf", "1", "--duration", "-3"],
        ["--mtbf", "nan", "--duration", "1"],
        ["--mtbf", "1", "--duration", "1", "--address-template", "{host}:{port}"],
    ):
        with pytest.raises(SystemExit) as e:
            run(kube_chaos.chaos_main, chaos_parser(), base + bad)
        assert e.value.code == 2
    assert cluster.requests() == []
    # the Kubernetes mode's flags also go in first without clashing with the local mode's
    p = argparse.ArgumentParser()
    kube_chaos.add_chaos_arguments(p)
    from atoll.faults.chaos import add_arguments as add_local_arguments

    add_local_arguments(p)
    assert p.parse_args(["--mtbf", "3", "--seed", "2", "--learners", "2"]).mtbf == 3.0


def test_failure_rate_grows_with_the_learner_pods():
    rng = random.Random(0)
    for pods in (1, 4, 16):
        mean = statistics.fmean(kube_chaos.next_failure_in(rng, pods, 60.0) for _ in range(20_000))
        assert mean == pytest.approx(60.0 / pods, rel=0.05), f"{pods} pods"
    assert kube_chaos.next_failure_in(rng, 0, 60.0) == float("inf")


# --- several clusters ---


def test_status_lists_the_learners_of_every_cluster(cluster, capsys):
    argv = [
        "--kubeconfig",
        str(cluster.kubeconfig),
        "--context",
        "kmock",
        "--learner-context",
        "kmock-learners",
        "--namespace",
        NS,
    ]
    assert run(kube.status_main, status_parser(), argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["pod"] for s in report["shards"]] == [
        "atoll-syncer-0",
        "atoll-syncer-1",
    ]  # from kmock only
    contexts = {r["pod"]: r["context"] for r in report["learners"]}
    assert contexts == {**{n: None for n in LEARNERS}, **{n: "kmock-learners" for n in REMOTE}}
    assert run(kube.status_main, status_parser(), argv) == 0
    table = capsys.readouterr().out
    assert (
        "kmock-learners" in table
        and "atoll-learner-v5p-slice-1" in table
        and "5/6 learner pods ready" in table
    )
    assert "other-learner" not in table


def test_chaos_across_clusters_deletes_learners_where_they_run(cluster, shards, capsys, chaos_time):
    argv = [
        "--kubernetes",
        "--kubeconfig",
        str(cluster.kubeconfig),
        "--context",
        "kmock",
        "--learner-context",
        "kmock-learners",
        "--namespace",
        NS,
        "--mtbf",
        "0.5",
        "--duration",
        "1.5",
        "--seed",
        "3",
        "--json",
    ]
    assert run(kube_chaos.chaos_main, chaos_parser(), argv) == 0
    r = json.loads(capsys.readouterr().out)
    remote = [name.split("/", 1)[1] for name in r["deleted"] if name.startswith("kmock-learners/")]
    local = [name for name in r["deleted"] if "/" not in name]
    assert remote and local, r["deleted"]  # seed 3: both clusters lose pods
    assert set(remote) <= set(REMOTE) and set(local) <= set(LEARNERS)
    assert [q.name for q in cluster.learners.requests("DELETE")] == remote
    assert [q.name for q in cluster.requests("DELETE")] == local
    assert cluster.learners.alive("other-learner")
    # Goodput: the shards' accepted compute over every learner that feeds them.
    assert r["learner_pods"] == len(LEARNERS) + len(REMOTE) and r["unscraped_shards"] == []
    assert r["goodput"] == pytest.approx(
        r["accepted_compute_seconds"] / (r["learner_pods"] * r["window_seconds"])
    )


def test_chaos_in_a_learner_cluster_says_where_the_shards_are(cluster, capsys):
    argv = [
        "--kubernetes",
        "--kubeconfig",
        str(cluster.kubeconfig),
        "--context",
        "kmock-learners",
        "--namespace",
        NS,
        "--mtbf",
        "1000",
        "--duration",
        "0.2",
    ]
    assert run(kube_chaos.chaos_main, chaos_parser(), argv) == 0
    out = capsys.readouterr().out
    assert "no syncer pods" in out and "--learner-context" in out and "goodput n/a" in out


# --- the operator Jobs: in-cluster, over HTTPS, with the operator Role ---


def _self_signed(tmp_path) -> tuple[ssl.SSLContext, pathlib.Path]:
    """A server context for 127.0.0.1 and its certificate (the pod's ca.crt)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    ca, pem = tmp_path / "ca.crt", tmp_path / "key.pem"
    ca.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(ca, pem)
    return context, ca


def _operator_role(name: str) -> dict:
    (role,) = [
        d
        for d in yaml.safe_load_all(ROLE.read_text())
        if d["kind"] == "Role" and d["metadata"]["name"] == name
    ]
    return role


def _allowed(role: dict, method: str, path: str) -> bool:
    """Whether the Role lets a request through (core API group, namespaced paths only)."""
    m = re.fullmatch(r"/api/v1/namespaces/([^/]+)(?:/(pods)(?:/([^/]+))?)?", path)
    if m is None:
        return False
    namespace, resource, name = m.groups()
    if resource is None:
        resource, name, verb = "namespaces", namespace, {"GET": "get"}.get(method)
    else:
        verb = {"GET": "get" if name else "list", "DELETE": "delete"}.get(method)
    return any(
        "" in r["apiGroups"]
        and resource in r["resources"]
        and verb in r["verbs"]
        and (not r.get("resourceNames") or name in r["resourceNames"])
        for r in role["rules"]
    )


def test_role_check_refuses_what_the_role_does_not_grant():
    role = _operator_role("atoll-chaos")
    assert _allowed(role, "GET", "/api/v1/namespaces/atoll") and _allowed(
        role, "DELETE", "/api/v1/namespaces/atoll/pods/x"
    )
    assert not _allowed(
        _operator_role("atoll-operator"), "DELETE", "/api/v1/namespaces/atoll/pods/x"
    )
    assert not _allowed(role, "GET", "/api/v1/namespaces/kube-system")  # only its own namespace
    assert not _allowed(role, "PATCH", "/api/v1/namespaces/atoll/pods/x")
    assert not _allowed(role, "GET", "/api/v1/namespaces/atoll/secrets")


def test_operator_jobs_run_in_cluster_with_the_operator_role(
    shards, tmp_path, monkeypatch, capsys, chaos_time
):
    """As the operator component's Jobs run them: no kubeconfig, the pod's service account
    (token and CA files, KUBERNETES_SERVICE_HOST/PORT), an API server over HTTPS; each
    Job's requests within its own account's Role."""
    from kubernetes.config import incluster_config

    context, ca = _self_signed(tmp_path)
    api = Emulator(lambda k: seed_run(k, shards), tls=context)
    try:
        token = tmp_path / "token"
        token.write_text("service-account-token")  # as the kubelet writes it: no newline
        monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
        monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
        monkeypatch.delenv("KUBECONFIG", raising=False)
        assert api.url.startswith("https://")

        assert run(kube.status_main, status_parser(), ["--namespace", NS, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert all("describe" in s for s in report["shards"]) and len(report["learners"]) == len(
            LEARNERS
        )
        by_status = len(list(api.k))
        argv = [
            "--kubernetes",
            "--namespace",
            NS,
            "--mtbf",
            "0.5",
            "--duration",
            "1",
            "--seed",
            "1",
            "--json",
        ]
        assert run(kube_chaos.chaos_main, chaos_parser(), argv) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["failures_injected"] >= 1 and r["goodput"] is not None

        requests = list(api.k)
        assert requests and all(
            q.headers.get("Authorization", "").lower() == "bearer service-account-token"
            for q in requests
        )
        for role, made in (
            ("atoll-operator", requests[:by_status]),
            ("atoll-chaos", requests[by_status:]),
        ):
            refused = [
                (q.method.value.upper(), q.url.path)
                for q in made
                if not _allowed(_operator_role(role), q.method.value.upper(), q.url.path)
            ]
            assert made and not refused, f"the Role {role} does not allow {refused}"
        assert {q.method.value.upper() for q in requests[:by_status]} == {"GET"}
        assert {q.method.value.upper() for q in requests[by_status:]} == {"GET", "DELETE"}
    finally:
        api.close()
