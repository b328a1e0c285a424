"""What the syncer integration tests share: raw-stub Init/Push/Pull, a shard's visible
state, and `atoll syncer` child processes on a free port.

Every gRPC call here carries a deadline (DEADLINE seconds); every child process is
killed by `syncer_processes` when its test ends, however it ends.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire import syncer_pb2_grpc as pb_grpc
from atoll.wire.plan import FragmentPlan, TensorSpec
from atoll.wire.records import parse_serving

REPO = pathlib.Path(__file__).resolve().parents[2]
SERVICE = "atoll.v1.Syncer"
DEADLINE = 10.0  # seconds, on every call
# Four tensors of a few hundred values, one per fragment: small enough that a push is
# all fsync and bookkeeping, large enough for several 32-value codec blocks.
SPECS = [
    TensorSpec("embed", (40, 8)),
    TensorSpec("w1", (8, 36)),
    TensorSpec("w2", (36, 8)),
    TensorSpec("w3", (16, 16)),
]
PLAN = FragmentPlan.build(SPECS, 4)
Metadata = Sequence[tuple[str, str]] | None


def free_port() -> int:
    """A port nothing listens on right now (bound and released: it stays free only until
    another process takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving_shard(data_dir: pathlib.Path, grace: float = 2.0, **settings) -> Iterator:
    """A SyncerServer in this process on a free port (shard 0 of 1 unless `settings`, any
    ShardConfig fields, say otherwise), stopped with `grace` when the block ends."""
    from atoll.server.config import ShardConfig
    from atoll.server.service import SyncerServer

    settings = {"shard_index": 0, "num_shards": 1, "listen": "127.0.0.1:0", **settings}
    server = SyncerServer(ShardConfig(data_dir=data_dir, **settings))
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=grace)


def bearer(token: str) -> list[tuple[str, str]]:
    """Call metadata carrying a bearer token."""
    return [("authorization", f"Bearer {token}")]


def connect(
    port: int,
    credentials: grpc.ChannelCredentials | None = None,
    options: Sequence[tuple[str, object]] = (),
) -> tuple[grpc.Channel, pb_grpc.SyncerStub]:
    """A channel to 127.0.0.1:port (TLS when credentials are given) and a Syncer stub."""
    target = f"127.0.0.1:{port}"
    channel = (
        grpc.secure_channel(target, credentials, options=list(options))
        if credentials
        else grpc.insecure_channel(target, options=list(options))
    )
    return channel, pb_grpc.SyncerStub(channel)


# --- requests ---


def init_requests(
    plan: FragmentPlan, p: int, values: np.ndarray, learner: str = "a", **header
) -> list[pb.InitRequest]:
    """Header + one chunk seeding fragment p with `values` (FP32); `header` overrides fields."""
    frame = codec.encode(np.asarray(values, np.float32), codec.Codec.FP32)
    fields = dict(
        learner_id=learner,
        fragment=p,
        plan_fingerprint=plan.fingerprint,
        plan_json=plan.to_json(),
        codec=pb.CODEC_FP32,
        num_params=np.asarray(values).size,
        frame_bytes=len(frame),
    )
    fields.update(header)
    return [pb.InitRequest(header=pb.InitHeader(**fields)), pb.InitRequest(chunk=frame)]


def init(
    stub,
    plan: FragmentPlan,
    p: int,
    values: np.ndarray,
    learner: str = "a",
    metadata: Metadata = None,
) -> pb.InitResponse:
    return stub.Init(
        iter(init_requests(plan, p, values, learner)), timeout=DEADLINE, metadata=metadata
    )


def push_requests(
    plan: FragmentPlan,
    p: int,
    learner: str,
    seq: int,
    base: int,
    frame: bytes,
    num_params: int,
    *,
    chunks: int = 3,
    codec_id: int = pb.CODEC_INT4,
    **header,
) -> list[pb.PushRequest]:
    """Header + `frame` split into `chunks` chunks; `header` overrides any header field."""
    fields = dict(
        learner_id=learner,
        fragment=p,
        base_version=base,
        seq=seq,
        inner_steps=10,
        tokens=1000,
        codec=codec_id,
        num_params=num_params,
        plan_fingerprint=plan.fingerprint,
        frame_bytes=len(frame),
    )
    fields.update(header)
    size = max(1, -(-len(frame) // chunks))
    return [pb.PushRequest(header=pb.PushHeader(**fields))] + [
        pb.PushRequest(chunk=frame[i : i + size]) for i in range(0, len(frame), size)
    ]


def push(
    stub,
    plan: FragmentPlan,
    p: int,
    learner: str,
    seq: int,
    base: int,
    delta: np.ndarray,
    *,
    chunks: int = 3,
    codec_id: int = pb.CODEC_INT4,
    metadata: Metadata = None,
    **header,
) -> pb.PushResponse:
    """Encodes `delta` with `codec_id` and pushes it; `header` overrides any header field."""
    frame = codec.encode(np.asarray(delta, np.float32), codec.Codec(codec_id))
    msgs = push_requests(
        plan,
        p,
        learner,
        seq,
        base,
        frame,
        np.asarray(delta).size,
        chunks=chunks,
        codec_id=codec_id,
        **header,
    )
    return stub.Push(iter(msgs), timeout=DEADLINE, metadata=metadata)


def client_push(client, p: int, seq: int, base: int, plan: FragmentPlan = PLAN) -> pb.PushResponse:
    """A learner's int4 push of a small random Δ for fragment p of `plan`, through a
    ShardClient (the Δ is the same for the same p and seq)."""
    delta = np.random.default_rng([p, seq]).standard_normal(plan.fragment_sizes[p]) * 0.01
    header = pb.PushHeader(
        fragment=p,
        base_version=base,
        seq=seq,
        inner_steps=4,
        tokens=400,
        codec=pb.CODEC_INT4,
        num_params=plan.fragment_sizes[p],
        plan_fingerprint=plan.fingerprint,
    )
    return client.push(header, codec.encode(delta.astype(np.float32)))


def run_atoll(
    *args: str, env: dict | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    """`atoll ARGS` as a child process of this checkout; its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "atoll.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        timeout=timeout,
    )


def pull(
    stub, p: int, have: int | None = None, learner: str = "", metadata: Metadata = None
) -> tuple[pb.PullHeader, list[tuple[int, bytes]]]:
    """(header, [(version, frame bytes)]) of one Pull; chunks are joined into frames."""
    req = pb.PullRequest(fragment=p, learner_id=learner)
    if have is not None:
        req.have_version = have
    header, frames, parts = None, [], []
    for msg in stub.Pull(req, timeout=DEADLINE, metadata=metadata):
        if msg.WhichOneof("kind") == "header":
            header = msg.header
        else:
            parts.append(msg.chunk.data)
            if msg.chunk.last:
                frames.append((msg.chunk.version, b"".join(parts)))
                parts = []
    assert header is not None and not parts, "Pull stream ended mid-frame"
    return header, frames


def describe(stub, metadata: Metadata = None) -> pb.DescribeResponse:
    return stub.Describe(pb.DescribeRequest(), timeout=DEADLINE, metadata=metadata)


def status_of(call: Callable[[], object]) -> grpc.StatusCode:
    """The status code `call` fails with; fails the test when it succeeds."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


# --- state, as a learner can see it ---


def fragment_state(stub, info: pb.FragmentInfo) -> dict | None:
    """A fragment's visible state: version, open round, the published copy as a full
    FP32 snapshot frame, and every delta frame still in the ring (all bytes). None when a
    round closed between the Describe that gave `info` and the Pull."""
    state = {
        "initialized": info.initialized,
        "version": info.version,
        "round_size": info.round_size,
        "oldest_delta_base": info.oldest_delta_base,
    }
    if info.initialized:
        header, snap = pull(stub, info.fragment)
        assert header.snapshot
        if header.version != info.version:
            return None
        state["snapshot"] = snap[0][1]
        _, state["deltas"] = pull(stub, info.fragment, have=info.oldest_delta_base)
    return state


def shard_state(stub, metadata: Metadata = None, attempts: int = 20) -> dict[int, dict]:
    """{fragment: fragment_state} for every fragment the shard owns, read again when a
    round closed while it was read (a restarted shard's round timer may close a replayed
    round at any moment)."""
    for _ in range(attempts):
        state = {f.fragment: fragment_state(stub, f) for f in describe(stub, metadata).fragments}
        if all(s is not None for s in state.values()):
            return state
        time.sleep(0.1)
    raise AssertionError(f"the shard's versions kept moving over {attempts} reads")


# --- health ---


def health_status(channel: grpc.Channel, service: str = "") -> int:
    return (
        health_pb2_grpc.HealthStub(channel)
        .Check(health_pb2.HealthCheckRequest(service=service), timeout=DEADLINE)
        .status
    )


def wait_serving(
    port: int, timeout: float = 30.0, credentials: grpc.ChannelCredentials | None = None
) -> None:
    """Polls the health service until the shard reports SERVING for the Syncer service."""
    channel, _ = connect(port, credentials)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                if health_status(channel, SERVICE) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"shard on port {port} not SERVING after {timeout} s")
            time.sleep(0.05)
    finally:
        channel.close()


# --- `atoll syncer` processes ---


class SyncerProcess:
    """One `atoll syncer` child on 127.0.0.1:0; `start()` returns the port it printed."""

    def __init__(self, data_dir: pathlib.Path, flags: Sequence[str], log_path: pathlib.Path):
        self.args = [
            sys.executable,
            "-m",
            "atoll.cli",
            "syncer",
            "--data-dir",
            str(data_dir),
            "--listen",
            "127.0.0.1:0",
            *map(str, flags),
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._reader: threading.Thread | None = None

    def start(self, timeout: float = 60.0) -> int:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
            ),
        }
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                self.args,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        lines: queue.Queue[str | None] = queue.Queue()

        def read(out=self.proc.stdout):  # drains stdout so the child never blocks on it
            for line in out:
                lines.put(line)
            lines.put(None)

        self._reader = threading.Thread(target=read, name="syncer-stdout", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while self.port is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"no 'serving on port' line after {timeout} s:\n{self.log()}"
                ) from None
            if line is None:
                self.proc.wait(timeout=10)
                raise RuntimeError(
                    f"atoll syncer exited with {self.proc.returncode} before serving:\n{self.log()}"
                )
            if ports := parse_serving(line):
                self.port = ports[0]
                # with TLS on, the plaintext health port (--health-port) answers the probe
                health = re.search(r"health on port (\d+)", line)
        probe = int(health.group(1)) if health else self.port
        wait_serving(probe, timeout=max(1.0, deadline - time.monotonic()))
        return self.port

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> int:
        """SIGKILL: no final snapshot, no cleanup; returns the exit status (-9)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        return self.proc.wait(timeout=30)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (a clean stop with a final snapshot), SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def replayed(self) -> list[int]:
        """Log records replayed at each start, from the shard's own log lines."""
        return [int(n) for n in re.findall(r"recovered \((\d+) log records replayed\)", self.log())]


@contextlib.contextmanager
def syncer_processes(tmp_path: pathlib.Path) -> Iterator[Callable[..., SyncerProcess]]:
    """Yields start(data_dir, *flags) -> a started SyncerProcess; kills them all at the end.
    Threads may call start at once (shards that start side by side)."""
    started: list[SyncerProcess] = []
    lock = threading.Lock()  # each process its own log

    def start(data_dir: pathlib.Path, *flags) -> SyncerProcess:
        with lock:
            proc = SyncerProcess(data_dir, flags, tmp_path / f"syncer-{len(started)}.log")
            started.append(proc)
        proc.start()
        return proc

    try:
        yield start
    finally:
        for proc in started:
            if proc.proc is not None:
                proc.kill()
                proc._reader.join(timeout=10)  # EOF once the child is gone
                proc.proc.stdout.close()


def arrays_of(payload: bytes) -> dict[str, np.ndarray]:
    """The arrays of an .npz payload (an Export's fragment state)."""
    with np.load(io.BytesIO(payload)) as z:
        return {k: z[k] for k in z.files}


def npz(arrays: dict[str, np.ndarray]) -> bytes:
    """`arrays` as an .npz payload (an Adopt's fragment state)."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()
