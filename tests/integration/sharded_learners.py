"""What the tests of learners sharded over JAX processes share: fresh in-process shards,
the worker (sharded_pull_worker.py) run as one learner of N processes, and the weights
the shards publish."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import grpc
import numpy as np
from syncer_helpers import REPO, free_port

from atoll.server.config import ShardConfig
from atoll.server.service import SyncerServer
from atoll.wire import codec
from atoll.wire.client import ShardClient

HERE = pathlib.Path(__file__).parent
WORKER = HERE / "sharded_pull_worker.py"
FRAGMENTS = 2  # the worker's


@contextlib.contextmanager
def shards(tmp: pathlib.Path, name: str, n: int) -> Iterator[list[SyncerServer]]:
    """`n` fresh shards (quorum 1, a whole-period grace, 5 s leases), stopped at the end."""
    servers = [
        SyncerServer(
            ShardConfig(
                shard_index=i,
                num_shards=n,
                data_dir=tmp / f"{name}-shard{i}",
                listen="127.0.0.1:0",
                quorum=1,
                grace_factor=1.0,
                lease_seconds=5,
            )
        )
        for i in range(n)
    ]
    for s in servers:
        s.start()
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


def addresses(servers: list[SyncerServer]) -> str:
    return ",".join(f"127.0.0.1:{s.port}" for s in servers)


class Learner:
    """The worker as one learner of `processes` processes (gloo over a free port)."""

    def __init__(
        self, tmp: pathlib.Path, name: str, addresses: str, processes: int, flags: list[str]
    ):
        self.tmp, self.name, self.processes = tmp, name, processes
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)]),
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2 "
            "--xla_cpu_multi_thread_eigen=false",
        }
        port, self.procs = free_port(), []
        for i in range(processes):
            cmd = [sys.executable, str(WORKER), "--shards", addresses]
            cmd += ["--out", str(tmp / f"{name}.{i}.json"), *flags]
            if processes > 1:
                cmd += ["--coordinator", f"127.0.0.1:{port}"]
                cmd += ["--num-processes", str(processes), "--process-id", str(i)]
            log = open(tmp / f"{name}.{i}.log", "w")  # noqa: SIM115 (closed with the process)
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))

    def reports(self, timeout: float = 240) -> list[dict]:
        """Each process's report, once all have exited 0 (killed if not within `timeout`)."""
        try:
            for i, proc in enumerate(self.procs):
                assert proc.wait(timeout=timeout) == 0, self.log(i)
        finally:
            self.kill()
        return [
            json.loads((self.tmp / f"{self.name}.{i}.json").read_text())
            for i in range(self.processes)
        ]

    def log(self, i: int) -> str:
        return (self.tmp / f"{self.name}.{i}.log").read_text()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def learn(
    tmp: pathlib.Path, name: str, addresses: str, processes: int, flags: list[str]
) -> list[dict]:
    """Runs the worker as one learner of `processes` processes; each process's report."""
    return Learner(tmp, name, addresses, processes, flags).reports()


def published(addresses: str) -> list[np.ndarray]:
    """Every fragment's published weights, each from the shard that owns it."""
    out = []
    for p in range(FRAGMENTS):
        for address in addresses.split(","):
            client = ShardClient(address, "observer", deadline=10)
            try:
                out.append(codec.decode(client.pull(p).frames[0][2]).copy())
                break
            except grpc.RpcError:
                continue  # not this shard's
            finally:
                client.close()
        else:
            raise AssertionError(f"no shard serves fragment {p}")
    return out
