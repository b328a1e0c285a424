"""Group commit against a real `atoll syncer`: many pushes in flight at once share fsyncs,
and SIGKILL while they fly loses none that was acknowledged."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import numpy as np
import pytest
from syncer_helpers import PLAN, connect, free_port, init, pull, push, shard_state, syncer_processes

from atoll.server.audit import durable_pushes, lost_acks
from atoll.wire import syncer_pb2 as pb
from atoll.wire.metrics import read_metrics

LEARNERS = ("g0", "g1", "g2")
# quorum 2 of 3: some pushes wait for their own fsync, some ride on their round's close;
# snapshots every 4 rounds are written in the background while the pushes go on
FLAGS = [
    "--quorum=2",
    "--grace-factor=0",
    "--snapshot-every=4",
    "--max-staleness=64",
    "--staleness-discount=0",
    "--lease-seconds=600",
]


def _fsyncs_and_pushes(metrics_port: int) -> tuple[int, int]:
    """(WAL fsyncs run, pushes accepted) from one scrape of the shard's own counters."""
    samples = read_metrics(f"127.0.0.1:{metrics_port}", timeout=10)
    fsyncs = sum(s.value for s in samples if s.name == "atoll_wal_fsync_seconds_count")
    accepted = sum(
        s.value
        for s in samples
        if s.name == "atoll_pushes_total" and s.labels["reason"] in ("fresh", "stale_discounted")
    )
    return int(fsyncs), int(accepted)


@pytest.mark.timeout(120)
def test_sigkill_among_concurrent_pushes_shares_fsyncs_and_loses_no_acknowledged_one(tmp_path):
    data = tmp_path / "shard"
    metrics_port = free_port()
    with syncer_processes(tmp_path) as start:
        shard = start(data, *FLAGS, f"--metrics-port={metrics_port}")
        channel, stub = connect(shard.port)
        for p in range(PLAN.num_fragments):
            init(stub, PLAN, p, np.zeros(PLAN.fragment_sizes[p], np.float32))
        lock = threading.Lock()
        acks: list[dict] = []
        broken: list[tuple[str, int]] = []  # streams the kill cut: no answer, so no promise
        killed = threading.Event()

        def stream(learner: str, p: int) -> None:
            base, rng = 0, np.random.default_rng([LEARNERS.index(learner), p])
            for seq in range(1, 10_000):
                delta = rng.standard_normal(PLAN.fragment_sizes[p]).astype(np.float32) * 0.01
                try:
                    ack = push(stub, PLAN, p, learner, seq, base, delta)
                except grpc.RpcError:
                    with lock:
                        broken.append((learner, p))
                    return
                refusals = (pb.PUSH_REASON_TOO_STALE, pb.PUSH_REASON_ALREADY_IN_ROUND)
                assert ack.accepted or ack.reason in refusals, ack
                base = ack.version
                with lock:
                    acks.append(
                        {"learner": learner, "fragment": p, "seq": seq, "accepted": ack.accepted}
                    )
                if killed.is_set():
                    return

        with concurrent.futures.ThreadPoolExecutor(len(LEARNERS) * PLAN.num_fragments) as pool:
            streams = [
                pool.submit(stream, m, p) for m in LEARNERS for p in range(PLAN.num_fragments)
            ]
            try:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:  # the injector: kill once enough acks are in
                    with lock:
                        if sum(a["accepted"] for a in acks) >= 60:
                            break
                    time.sleep(0.01)
                fsyncs, pushed = _fsyncs_and_pushes(metrics_port)  # while the pushes still fly
            finally:  # the streams end only once the shard is gone
                killed.set()
                status = shard.kill()
            assert status == -9
            for s in streams:
                s.result(timeout=30)  # a stream's failed check fails the test here
        channel.close()
        accepted = [a for a in acks if a["accepted"]]
        assert len(accepted) >= 60, "the pushes did not get going before the kill"
        assert broken, "the kill came between pushes, not while any was in flight"
        # group commit: every accepted push (and every round close) waits for an fsync of its
        # record, and concurrent ones share one, so fewer fsyncs ran than pushes were accepted
        assert 0 < fsyncs < pushed, (fsyncs, pushed)

        # every acknowledged push is in the log or behind the newest snapshot
        assert lost_acks(acks, durable_pushes(data)) == []
        # and the shard comes back from them, serving every fragment
        again = start(data, *FLAGS)
        channel, stub = connect(again.port)
        state = shard_state(stub)
        assert sorted(state) == list(range(PLAN.num_fragments))
        newest: dict[tuple[str, int], int] = {}
        for a in accepted:
            newest[a["learner"], a["fragment"]] = max(
                a["seq"], newest.get((a["learner"], a["fragment"]), 0)
            )
        for (
            learner,
            p,
        ), seq in newest.items():  # the restarted shard knows each newest acknowledged seq
            header, _ = pull(stub, p, learner=learner)
            assert header.last_seq >= seq, (learner, p, seq)
        channel.close()
