"""The shard's concurrency: group commit, per-fragment locks, snapshots while pushes flow,
and recovery that lands on the live run's bytes."""

from __future__ import annotations

import concurrent.futures
import threading

import jax
import numpy as np
import pytest

from atoll.server import storage
from atoll.server.config import ShardConfig
from atoll.server.log_records import parse_log_record
from atoll.server.refusal import Why
from atoll.server.shard import PushHeader, Shard, ShardError
from atoll.server.snapshots import SnapshotStore
from atoll.wire import codec
from atoll.wire.plan import FragmentMap, FragmentPlan, TensorSpec

SPECS = [
    TensorSpec("embed", (64, 16)),
    TensorSpec("w1", (16, 48)),
    TensorSpec("w2", (48, 16)),
    TensorSpec("w3", (32, 32)),
    TensorSpec("norm", (16,)),
]
LEARNERS = 3


@pytest.fixture
def plan():
    return FragmentPlan.build(SPECS, 3)


def _shard(tmp_path, **kw) -> Shard:
    shard = Shard(
        ShardConfig(
            shard_index=0, num_shards=1, data_dir=tmp_path, quorum=LEARNERS, grace_factor=0.0, **kw
        )
    )
    shard.recover()
    return shard


def _seed(shard: Shard, plan: FragmentPlan) -> None:
    for p, size in enumerate(plan.fragment_sizes):
        values = np.random.default_rng(p).standard_normal(size).astype(np.float32)
        shard.init(
            "seed",
            p,
            plan.fingerprint,
            plan.to_json(),
            codec.encode(values, codec.Codec.FP32),
            int(codec.Codec.FP32),
            size,
        )


def _push(shard: Shard, plan: FragmentPlan, p: int, learner: int, seq: int, base: int):
    size = plan.fragment_sizes[p]
    delta = np.random.default_rng([p, learner, seq]).standard_normal(size).astype(np.float32) * 0.01
    h = PushHeader(
        learner_id=f"l{learner}",
        fragment=p,
        base_version=base,
        seq=seq,
        inner_steps=4,
        tokens=400 * (learner + 1),
        codec=int(codec.Codec.INT4),
        num_params=size,
        plan_fingerprint=plan.fingerprint,
    )
    return shard.push(h, codec.encode(delta, codec.Codec.INT4))


def _run_rounds(shard: Shard, plan: FragmentPlan, rounds: int, first: int = 0) -> None:
    """Every learner pushes every fragment once per round, all at once from threads."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for r in range(first, first + rounds):
            jobs = [
                pool.submit(_push, shard, plan, p, m, r + 1, r)
                for p in range(plan.num_fragments)
                for m in range(LEARNERS)
            ]
            assert all(j.result().accepted for j in jobs)


def _state(shard: Shard) -> dict:
    out = {}
    for p, f in shard.fragments.items():
        meta, arrays = f.state()
        out[p] = (
            meta["version"],
            meta["round"],
            meta["answers"],
            {k: np.asarray(v).tobytes() for k, v in arrays.items()},
        )
    return out


def _crash(shard: Shard) -> None:
    """Lets the files go as a killed process would: no final snapshot."""
    if shard._snapshot_thread is not None:
        shard._snapshot_thread.join()
    shard.wal.close()
    shard.snapshots.close()


def test_snapshots_taken_while_pushes_flow_recover_bit_identically(tmp_path, plan):
    shard = _shard(tmp_path, snapshot_every=2)
    _seed(shard, plan)
    _run_rounds(shard, plan, 4)
    # and an open round left half full, so the snapshot's accumulator matters too
    assert _push(shard, plan, 1, 0, 5, 4).accepted
    live = _state(shard)
    assert all(v[0] == 4 for v in live.values())
    _crash(shard)
    lsns = SnapshotStore(tmp_path / "snapshots").lsns()
    assert lsns, "a snapshot was written in the background"
    again = _shard(tmp_path, snapshot_every=2)
    assert _state(again) == live
    again.close()


def test_replay_skips_what_the_snapshot_holds_per_fragment(tmp_path, plan):
    """Fragments are captured one at a time: records of a fragment captured after the
    snapshot's (oldest) LSN are in the snapshot and must not be merged twice."""
    shard = _shard(tmp_path, snapshot_every=1000)
    _seed(shard, plan)
    _run_rounds(shard, plan, 1)
    captured, pushed = threading.Event(), threading.Event()
    real_state = shard.fragments[1].state

    def slow_state():  # fragment 0 is captured; while fragment 1 is, fragment 2 takes a push
        out = real_state()
        captured.set()
        pushed.wait(10)  # a push the snapshot held up fails below, after 10 s
        return out

    shard.fragments[1].state = slow_state
    snap = threading.Thread(target=shard._snapshot)
    snap.start()
    assert captured.wait(10)
    assert _push(shard, plan, 2, 0, 2, 1).accepted  # logged after fragment 0's LSN
    pushed.set()
    snap.join()
    del shard.fragments[1].state
    live = _state(shard)
    _crash(shard)
    with SnapshotStore(tmp_path / "snapshots") as store:
        saved = store.latest()
    assert (
        saved.meta["fragment_lsns"]["2"] > saved.lsn
    )  # fragment 2 holds a record past the snapshot's LSN
    again = _shard(tmp_path)
    assert _state(again) == live
    again.close()


def test_concurrent_pushes_share_fsyncs_and_are_acked_only_once_durable(
    tmp_path, plan, monkeypatch
):
    shard = _shard(tmp_path, snapshot_every=1000)
    _seed(shard, plan)
    written: dict[tuple[str, int], int] = {}
    real_write, real_sync = shard.wal.write_many, storage._datasync
    fsyncs = []
    # 9 pushes and the 3 closes the last push to each fragment brings
    last = shard.wal.written_lsn + plan.num_fragments * (LEARNERS + 1)
    all_written = threading.Event()

    def write_many(records):
        records = list(records)
        lsns = real_write(records)
        for lsn, r in zip(lsns, records):
            whole = b"".join(r) if isinstance(r, tuple) else bytes(r)
            kind, meta, _ = parse_log_record(whole)
            if "learner" in meta:
                written[(meta["learner"], meta["fragment"])] = lsn
        if lsns[-1] >= last:
            all_written.set()
        return lsns

    def slow_datasync(fd):
        fsyncs.append(1)
        # a slow disk: the fsync lasts until every record is written (an event, not a
        # sleep, so a loaded host's late threads still overlap it), 10 s at most
        all_written.wait(10)
        real_sync(fd)

    monkeypatch.setattr(shard.wal, "write_many", write_many)
    monkeypatch.setattr(storage, "_datasync", slow_datasync)
    late = []

    def push(p, m):
        answer = _push(shard, plan, p, m, 1, 0)
        if shard.wal.last_lsn < written[(f"l{m}", p)]:
            late.append((p, m))  # acknowledged before its record was durable
        return answer

    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        jobs = [pool.submit(push, p, m) for p in range(plan.num_fragments) for m in range(LEARNERS)]
        assert all(j.result().accepted for j in jobs)
    assert late == []
    # 12 records from threads that overlap: the first fsync, then one for all the rest
    assert len(fsyncs) <= 2, len(fsyncs)
    shard.close()


def test_a_fragment_busy_merging_does_not_hold_up_another(tmp_path, plan):
    shard = _shard(tmp_path, snapshot_every=1000)
    _seed(shard, plan)
    with shard.frag_locks[0]:  # fragment 0 in the middle of a long merge or close
        done = concurrent.futures.ThreadPoolExecutor(1).submit(_push, shard, plan, 1, 0, 1, 0)
        assert done.result(timeout=10).accepted
        assert shard.versions([1]) == {1: (0, 0)}
    shard.close()


def test_pushes_go_on_while_a_snapshot_is_written(tmp_path, plan, monkeypatch):
    shard = _shard(tmp_path, snapshot_every=1)
    _seed(shard, plan)
    release, saving, saved = threading.Event(), threading.Event(), threading.Event()
    real_save = shard.snapshots.save

    def slow_save(*args):
        saving.set()
        release.wait(60)  # pushes the snapshot held up would wait this out
        saved.set()
        return real_save(*args)

    monkeypatch.setattr(shard.snapshots, "save", slow_save)
    _run_rounds(shard, plan, 1)  # the closes start a snapshot, which then waits
    assert saving.wait(10)
    _run_rounds(shard, plan, 2, first=1)
    # a whole two rounds while the snapshot is still being written: no push waited for it
    assert not saved.is_set()
    assert all(f.version == 3 for f in shard.fragments.values())
    release.set()
    live = _state(shard)
    _crash(shard)
    again = _shard(tmp_path)
    assert _state(again) == live
    again.close()


def test_a_failed_fsync_stops_the_shard_serving(tmp_path, plan, monkeypatch):
    shard = _shard(tmp_path, snapshot_every=1000)
    _seed(shard, plan)

    def broken(fd):
        raise OSError(5, "EIO")

    monkeypatch.setattr(storage, "_datasync", broken)
    from atoll.server.shard import ShardError

    with pytest.raises(ShardError) as e:
        _push(shard, plan, 0, 0, 1, 0)
    assert e.value.why is Why.BUSY
    with pytest.raises(ShardError):  # what the memory holds is no longer what the disk does
        shard.pull(0, None)
    monkeypatch.undo()
    _crash(shard)
    jax.clear_caches()


def test_a_snapshot_written_with_another_momentum_delay_is_refused_with_the_reason(tmp_path, plan):
    from atoll.server.fragment import Fragment

    shard = _shard(tmp_path)
    _seed(shard, plan)
    _run_rounds(shard, plan, 1)
    meta, arrays = shard.fragments[0].state()
    other = Fragment(
        0,
        plan,
        lr=0.7,
        momentum=0.9,
        rda=True,
        delta_ring=4,
        publish_codec=codec.Codec.INT4,
        quorum=shard.cfg.quorum,
        momentum_delay=1,
    )
    with pytest.raises(ValueError, match="--momentum-delay"):
        other.restore(meta, arrays, now=0.0)
    same = Fragment(
        0,
        plan,
        lr=0.7,
        momentum=0.9,
        rda=True,
        delta_ring=4,
        publish_codec=codec.Codec.INT4,
        quorum=shard.cfg.quorum,
        momentum_delay=shard.cfg.momentum_delay,
    )
    same.restore(meta, arrays, now=0.0)
    assert np.array_equal(same.params, shard.fragments[0].params) and same.version == 1


def test_a_shard_restarted_with_another_momentum_delay_stops_with_a_recovery_error(tmp_path, plan):
    from atoll.server.shard import RecoveryError

    shard = _shard(tmp_path, snapshot_every=1)
    _seed(shard, plan)
    _run_rounds(shard, plan, 2)
    shard.close()
    again = Shard(
        ShardConfig(
            shard_index=0,
            num_shards=1,
            data_dir=tmp_path,
            quorum=LEARNERS,
            grace_factor=0.0,
            momentum_delay=1,
        )
    )  # Nesterov every round: another state layout
    with pytest.raises(RecoveryError, match="--momentum-delay"):
        again.recover()


def test_a_round_does_not_wait_for_a_learner_whose_last_push_came_in(tmp_path, plan):
    shard = Shard(
        ShardConfig(
            shard_index=0,
            num_shards=1,
            data_dir=tmp_path,
            quorum=2,
            grace_factor=0.0,
            lease_seconds=60.0,
        )
    )
    shard.recover()
    _seed(shard, plan)
    size = plan.fragment_sizes[0]
    frame = codec.encode(np.full(size, 0.01, np.float32), codec.Codec.INT4)

    def push(learner, seq, base, last):
        h = PushHeader(
            learner_id=learner,
            fragment=0,
            base_version=base,
            seq=seq,
            inner_steps=4,
            tokens=400,
            codec=int(codec.Codec.INT4),
            num_params=size,
            plan_fingerprint=plan.fingerprint,
            last=last,
        )
        return shard.push(h, frame)

    assert push("a", 1, 0, False).accepted and push("b", 1, 0, False).accepted
    assert shard.fragments[0].version == 1
    assert push("a", 2, 1, True).accepted  # a finishes; b is live and still training
    assert shard.fragments[0].version == 1  # the round waits for b
    assert push("b", 2, 1, False).accepted
    assert shard.fragments[0].version == 2
    assert push("b", 3, 2, True).accepted  # b's own last push: a, live but done, is not waited for
    assert shard.fragments[0].version == 3
    assert push("a", 3, 3, False).accepted  # a is back; b is done, so a's push closes alone
    assert shard.fragments[0].version == 4
    assert push("b", 4, 4, False).accepted  # b is back too, and now its round waits for a again
    assert shard.fragments[0].version == 4 and shard.fragments[0].contributors == {"b"}


def test_a_restart_with_another_num_shards_keeps_the_map_of_the_first_init(tmp_path, plan):
    """Shard 0 of 3 seeds fragment 0 and dies before any snapshot (kill -9: the log alone);
    back as shard 0 of 1 or of 2, it owns what the first Init's map gave it, and an Init of
    a fragment shard 1 seeded is refused naming that owner."""
    first = Shard(ShardConfig(shard_index=0, num_shards=3, data_dir=tmp_path))
    first.recover()
    values = np.zeros(plan.fragment_sizes[0], np.float32)
    first.init(
        "seed",
        0,
        plan.fingerprint,
        plan.to_json(),
        codec.encode(values, codec.Codec.FP32),
        int(codec.Codec.FP32),
        values.size,
    )
    first.wal.close()  # no final snapshot: what a kill -9 leaves
    first.snapshots.close()
    for num_shards in (1, 2):
        back = Shard(ShardConfig(shard_index=0, num_shards=num_shards, data_dir=tmp_path))
        back.recover()
        assert back.fragment_map == FragmentMap.modulo(3, 3)
        assert sorted(back.fragments) == [0]
        size = plan.fragment_sizes[1]
        with pytest.raises(ShardError) as e:
            back.init(
                "seed",
                1,
                plan.fingerprint,
                plan.to_json(),
                codec.encode(np.zeros(size, np.float32), codec.Codec.FP32),
                int(codec.Codec.FP32),
                size,
            )
        assert e.value.why is Why.OUT_OF_STEP
        assert dict(e.value.metadata)["atoll-owner"] == "1"
        back.wal.close()
        back.snapshots.close()


def test_the_servicer_reads_every_push_header_field_from_the_protobuf_by_name():
    from atoll.server.intake import PUSH_FIELDS, push_header
    from atoll.server.parts import Box
    from atoll.wire import syncer_pb2 as pb

    assert set(PUSH_FIELDS) <= set(pb.PushHeader.DESCRIPTOR.fields_by_name)
    values = {
        "learner_id": "l",
        "fragment": 2,
        "base_version": 3,
        "seq": 4,
        "inner_steps": 5,
        "tokens": 6,
        "codec": 1,
        "num_params": 7,
        "plan_fingerprint": "f",
        "step_seconds": 0.5,
        "overlap_steps": 1,
        "period_steps": 8,
        "last": True,
        "parts": 4,
        "part": 2,
    }
    boxes = [pb.TensorBox(tensor=1, start=[0, 2], stop=[3, 4]), pb.TensorBox(tensor=0)]
    assert set(values) | {"boxes"} == set(PUSH_FIELDS)
    assert push_header(pb.PushHeader(**values, boxes=boxes, frame_bytes=9)) == PushHeader(
        **values, boxes=(Box(1, (0, 2), (3, 4)), Box(0))
    )
