"""The shard with its clock and storage injected: a fake clock and an in-memory log and
snapshot store, no disk, no gRPC. What the shard promises of its storage is checked
through what it asks of it: an acknowledged push is durable first, concurrent pushes
share syncs, snapshots let the log be truncated, and a shard rebuilt from the same
storage lands on the same bytes."""

from __future__ import annotations

import concurrent.futures
import io
import pathlib
import threading

import numpy as np
import pytest

from atoll.server.config import ShardConfig
from atoll.server.log_records import LOG_PUSH, parse_log_record
from atoll.server.refusal import Why
from atoll.server.shard import PushHeader, Shard, ShardError
from atoll.server.snapshots import Snapshot
from atoll.wire import codec
from atoll.wire.client import FRAGMENT_KEY, MAP_VERSION_KEY, OWNER_KEY
from atoll.wire.plan import FragmentMap, FragmentPlan, TensorSpec

PLAN = FragmentPlan.build(
    [TensorSpec("embed", (32, 8)), TensorSpec("w1", (8, 24)), TensorSpec("w2", (24, 8))], 2
)


class MemoryLog:
    """A write-ahead log in a list; `durable` is what a crash would keep."""

    def __init__(self):
        self.records: list[tuple[int, bytes]] = []
        self.durable_lsn = 0
        self.first = 1
        self.syncs = 0
        # a slow disk: a sync lasts until this LSN is written (10 s at most); 0: at once
        self.sync_until_written = 0
        self.mutex = threading.Lock()
        self.written = threading.Condition(self.mutex)  # notified on every write
        self.sync_lock = threading.Lock()

    @property
    def first_lsn(self) -> int:
        return self.first

    @property
    def last_lsn(self) -> int:
        return self.durable_lsn

    @property
    def written_lsn(self) -> int:
        with self.mutex:
            return self.records[-1][0] if self.records else self.first - 1

    def write_many(self, records) -> list[int]:
        with self.mutex:
            start = self.records[-1][0] + 1 if self.records else self.first
            out = []
            for i, r in enumerate(records):
                whole = b"".join(bytes(x) for x in r) if isinstance(r, tuple) else bytes(r)
                self.records.append((start + i, whole))
                out.append(start + i)
            self.written.notify_all()
            return out

    def sync(self, lsn: int) -> float | None:
        """One sync at a time, covering everything written when it starts; writers go on
        meanwhile (as the real log's group commit does)."""
        with self.sync_lock:
            with self.mutex:
                if self.durable_lsn >= lsn:
                    return None
                target = self.records[-1][0]
                self.syncs += 1
            with self.written:
                self.written.wait_for(
                    lambda: self.records[-1][0] >= self.sync_until_written, timeout=10
                )
                self.durable_lsn = max(self.durable_lsn, target)
            return 0.0

    def append_many(self, records) -> list[int]:
        lsns = self.write_many(records)
        if lsns:
            self.sync(lsns[-1])
        return lsns

    def append(self, record: bytes) -> int:
        return self.append_many([record])[0]

    def replay(self, after_lsn: int = 0):
        with self.mutex:
            kept = [(lsn, r) for lsn, r in self.records if after_lsn < lsn <= self.durable_lsn]
        yield from kept

    def truncate_through(self, lsn: int) -> int:
        with self.mutex:
            before = len(self.records)
            self.records = [(n, r) for n, r in self.records if n > lsn]
            self.first = max(self.first, lsn + 1)
            return before - len(self.records)

    def crash(self) -> None:
        """What a kill -9 leaves: the records written but never synced are gone."""
        with self.mutex:
            self.records = [(n, r) for n, r in self.records if n <= self.durable_lsn]

    def close(self) -> None:
        pass


class MemorySnapshots:
    def __init__(self):
        self.saved: list[Snapshot] = []

    def save(self, lsn, meta, arrays) -> pathlib.Path:
        copies = {k: np.array(v, copy=True) for k, v in arrays.items()}
        self.saved.append(Snapshot(lsn, dict(meta), copies, pathlib.Path(f"memory/{lsn}")))
        return self.saved[-1].path

    def latest(self) -> Snapshot | None:
        return self.saved[-1] if self.saved else None

    def lsns(self) -> list[int]:
        return [s.lsn for s in self.saved]

    def truncatable_lsn(self) -> int:
        return self.saved[-2].lsn if len(self.saved) >= 2 else 0

    def close(self) -> None:
        pass


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _shard(log, snaps, clock, **kw) -> Shard:
    settings = {"quorum": 2, "grace_factor": 0.0, **kw}
    cfg = ShardConfig(
        shard_index=0, num_shards=1, data_dir=pathlib.Path("/nonexistent/memory"), **settings
    )
    shard = Shard(cfg, clock, log=log, snapshots=snaps)
    shard.recover()
    return shard


def _seed(shard: Shard) -> None:
    for p, size in enumerate(PLAN.fragment_sizes):
        values = np.random.default_rng(p).standard_normal(size).astype(np.float32)
        shard.init(
            "seed",
            p,
            PLAN.fingerprint,
            PLAN.to_json(),
            codec.encode(values, codec.Codec.FP32),
            int(codec.Codec.FP32),
            size,
        )


def _push(shard: Shard, p: int, learner: int, seq: int, base: int):
    size = PLAN.fragment_sizes[p]
    delta = np.random.default_rng([p, learner, seq]).standard_normal(size).astype(np.float32) * 0.01
    h = PushHeader(
        learner_id=f"l{learner}",
        fragment=p,
        base_version=base,
        seq=seq,
        inner_steps=4,
        tokens=400,
        codec=int(codec.Codec.INT4),
        num_params=size,
        plan_fingerprint=PLAN.fingerprint,
    )
    return shard.push(h, codec.encode(delta, codec.Codec.INT4))


def _rounds(shard: Shard, rounds: int, first: int = 0) -> None:
    for r in range(first, first + rounds):
        for p in range(PLAN.num_fragments):
            for m in range(2):
                assert _push(shard, p, m, r + 1, r).accepted


def _state(shard: Shard) -> dict:
    return {
        p: (f.version, f.params.tobytes(), f.published.tobytes())
        for p, f in shard.fragments.items()
    }


def test_every_acknowledged_push_is_durable_before_its_answer():
    log, snaps, clock = MemoryLog(), MemorySnapshots(), Clock()
    shard = _shard(log, snaps, clock)
    _seed(shard)
    answer = _push(shard, 0, 0, 1, 0)
    assert answer.accepted
    pushes = [parse_log_record(r) for n, r in log.records if n <= log.durable_lsn]
    assert [(m["learner"], m["answer"]["seq"]) for k, m, _ in pushes if k == LOG_PUSH] == [
        ("l0", 1)
    ]


def test_concurrent_pushes_share_syncs():
    log, snaps, clock = MemoryLog(), MemorySnapshots(), Clock()
    shard = _shard(log, snaps, clock, quorum=16)
    _seed(shard)
    log.sync_until_written = log.written_lsn + 16  # each push's record
    before = log.syncs
    barrier = threading.Barrier(16)

    def push(m):
        barrier.wait()
        return _push(shard, m % 2, m, 1, 0)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert all(a.accepted for a in pool.map(push, range(16)))
    # pushes that arrive while a sync runs are covered by the next one: the first sync,
    # then one for all the rest
    assert log.syncs - before <= 2, log.syncs - before
    assert log.durable_lsn == log.written_lsn  # and every acknowledged record is durable


def test_a_shard_rebuilt_from_its_storage_lands_on_the_same_bytes_and_snapshots_truncate_the_log():
    log, snaps, clock = MemoryLog(), MemorySnapshots(), Clock()
    shard = _shard(log, snaps, clock, snapshot_every=2)
    _seed(shard)
    for r in range(6):  # a snapshot due while one is written is put off: let each finish
        _rounds(shard, 1, first=r)
        shard._snapshot_thread and shard._snapshot_thread.join()
    live = _state(shard)
    assert all(v == 6 for v, _, _ in live.values())
    assert len(snaps.saved) >= 2 and log.first_lsn > 1  # the log was truncated behind snapshots
    log.crash()
    again = _shard(log, snaps, Clock())
    assert _state(again) == live
    _rounds(again, 1, first=6)  # and it goes on
    assert all(f.version == 7 for f in again.fragments.values())


def test_the_fake_clock_drives_leases():
    log, snaps, clock = MemoryLog(), MemorySnapshots(), Clock()
    shard = _shard(log, snaps, clock, lease_seconds=5.0)
    _seed(shard)
    assert _push(shard, 0, 0, 1, 0).accepted
    assert shard.fragments[0].version == 0  # quorum 2 and only l0 known: it does not close alone
    clock.now += 1.0
    assert _push(shard, 0, 1, 1, 0).accepted
    assert shard.fragments[0].version == 1
    assert _push(shard, 0, 0, 2, 1).accepted
    clock.now += 6.0  # l1's lease lapses: the round holding l0 closes below quorum
    shard.tick()
    assert shard.fragments[0].version == 2


class SlowSnapshots(MemorySnapshots):
    """A snapshot store whose writes wait for `go`: closes happen while one is written."""

    def __init__(self):
        super().__init__()
        self.writing, self.go = threading.Event(), threading.Event()

    def save(self, lsn, meta, arrays):
        self.writing.set()
        assert self.go.wait(10)
        return super().save(lsn, meta, arrays)


def test_closes_while_a_snapshot_is_written_leave_what_it_captured_unchanged():
    # closes step params, momentum and the published copy in place, except while a
    # snapshot (or pull) has them lent: the snapshot written is the state it captured
    log, snaps, clock = MemoryLog(), SlowSnapshots(), Clock()
    shard = _shard(log, snaps, clock, snapshot_every=1000)
    _seed(shard)
    _rounds(shard, 2)
    captured = _state(shard)
    writer = threading.Thread(target=shard._snapshot)
    writer.start()
    assert snaps.writing.wait(10)
    _rounds(shard, 2, first=2)  # closes while the snapshot's arrays are lent
    after = _state(shard)
    snaps.go.set()
    writer.join(10)
    saved = snaps.saved[-1].arrays
    for p, (version, params, published) in captured.items():
        assert saved[f"f{p}.params"].tobytes() == params
        assert saved[f"f{p}.published"].tobytes() == published
        assert after[p][0] == version + 2 and after[p][1] != params
    assert all(f.lent == 0 for f in shard.fragments.values())
    _rounds(shard, 1, first=4)  # given back: closes step in place again
    assert all(f.lent == 0 for f in shard.fragments.values())


# --- moving a fragment between shards (docs/resharding.md) ---------------------------------


def _of(index: int, log, snaps, clock) -> Shard:
    cfg = ShardConfig(
        shard_index=index,
        num_shards=2,
        data_dir=pathlib.Path("/nonexistent/memory"),
        quorum=2,
        grace_factor=0.0,
    )
    shard = Shard(cfg, clock, log=log, snapshots=snaps)
    shard.recover()
    return shard


def _seed_own(shard: Shard) -> None:
    for p in range(PLAN.num_fragments):
        if p % 2 == shard.cfg.shard_index:
            values = np.random.default_rng(p).standard_normal(PLAN.fragment_sizes[p])
            frame = codec.encode(values.astype(np.float32), codec.Codec.FP32)
            shard.init(
                "seed",
                p,
                PLAN.fingerprint,
                PLAN.to_json(),
                frame,
                int(codec.Codec.FP32),
                frame_size(p),
            )


def frame_size(p: int) -> int:
    return PLAN.fragment_sizes[p]


def _whole(shard: Shard, p: int) -> dict:
    """Everything fragment p holds on `shard`, as bytes and JSON."""
    meta, arrays = shard.fragments[p].state()
    return {"meta": meta, "arrays": {k: np.asarray(v).tobytes() for k, v in arrays.items()}}


MOVED = FragmentMap.modulo(2, 2).moved(0, 1)  # fragment 0: shard 0 -> shard 1, version 1


def _moving_pair():
    """Shards 0 and 1; fragment 0 on shard 0 has two closed rounds and l0's push open."""
    clock = Clock()
    stores = {i: (MemoryLog(), MemorySnapshots()) for i in (0, 1)}
    a, b = (_of(i, *stores[i], clock) for i in (0, 1))
    _seed_own(a)
    _seed_own(b)
    for r in range(2):
        for m in range(2):
            assert _push(a, 0, m, r + 1, r).accepted
    assert _push(a, 0, 0, 3, 2).accepted  # in the open round when the move starts
    return clock, stores, a, b


def _refusal(call) -> ShardError:
    with pytest.raises(ShardError) as e:
        call()
    return e.value


def test_a_fragment_moves_with_everything_it_acknowledged():
    clock, stores, a, b = _moving_pair()
    before = _whole(a, 0)
    a.freeze(0, MOVED)
    a.freeze(0, MOVED)  # again: nothing more
    assert _refusal(lambda: _push(a, 0, 1, 3, 2)).why is Why.BUSY
    meta, payload = a.export(0)
    b.adopt(meta, payload)
    b.adopt(meta, payload)  # a retried step 2: nothing more
    a.commit_move(0, MOVED)
    a.commit_move(0, MOVED)  # a retried step 3: nothing more
    assert _whole(b, 0) == before
    assert (a.fragment_map, b.fragment_map) == (MOVED, MOVED)
    refused = _refusal(lambda: _push(a, 0, 1, 3, 2))
    assert refused.why is Why.OUT_OF_STEP
    assert dict(refused.metadata) == {OWNER_KEY: "1", MAP_VERSION_KEY: "1", FRAGMENT_KEY: "0"}
    # l0's push moved with the state: its retry is answered once, not merged again
    retry = _push(b, 0, 0, 3, 2)
    assert retry.accepted and retry.reason == "duplicate"
    closing = _push(b, 0, 1, 3, 2)
    assert closing.accepted and b.fragments[0].version == 3
    assert b.fragments[0].last_round_size == 2
    # what the metrics say of it
    out, into = a.metrics.text(), b.metrics.text()
    assert 'atoll_fragment_moves_total{direction="out"} 1.0' in out
    assert 'atoll_fragment_moves_total{direction="in"} 1.0' in into
    assert f'atoll_fragment_moved_bytes_total{{direction="in"}} {float(len(payload))}' in into
    assert "atoll_fragment_frozen_seconds_count 1.0" in out
    assert "atoll_fragments_owned 0.0" in out and "atoll_fragments_owned 2.0" in into
    assert "atoll_fragment_map_version 1.0" in into and "atoll_fragments_moving 0.0" in out


@pytest.mark.parametrize("snapshot", [False, True])
@pytest.mark.parametrize(
    "killed", ["source after freeze", "target after adopt", "source after commit"]
)
def test_a_move_survives_a_kill_at_each_step(killed, snapshot):
    clock, stores, a, b = _moving_pair()
    before = _whole(a, 0)
    a.freeze(0, MOVED)
    if killed != "source after freeze":
        meta, payload = a.export(0)
        b.adopt(meta, payload)
    if killed == "source after commit":
        a.commit_move(0, MOVED)
    index = 1 if killed == "target after adopt" else 0
    log, snaps = stores[index]
    if snapshot:
        (b if index else a)._snapshot()
    log.crash()
    back = _of(index, log, snaps, clock)
    if killed == "source after freeze":
        assert _whole(back, 0) == before and back.frozen == {0: MOVED}
        assert _refusal(lambda: _push(back, 0, 1, 3, 2)).why is Why.BUSY
        meta, payload = back.export(0)  # the move goes on from step 2
        b.adopt(meta, payload)
        back.commit_move(0, MOVED)
        assert _whole(b, 0) == before
    elif killed == "target after adopt":
        assert _whole(back, 0) == before and back.fragment_map == MOVED
        a.commit_move(0, MOVED)  # step 3 completes
        assert _push(back, 0, 1, 3, 2).accepted and back.fragments[0].version == 3
    else:
        assert 0 not in back.fragments and back.fragment_map == MOVED
        refused = _refusal(lambda: _push(back, 0, 1, 3, 2))
        assert dict(refused.metadata)[OWNER_KEY] == "1"


def test_unfreeze_aborts_a_move_that_never_reached_its_target():
    clock, stores, a, b = _moving_pair()
    a.freeze(0, MOVED)
    a.unfreeze(0)
    assert a.frozen == {} and a.fragment_map.version == 0
    assert _push(a, 0, 1, 3, 2).accepted and a.fragments[0].version == 3
    stores[0][0].crash()
    assert _of(0, *stores[0], clock).frozen == {}


def test_moves_that_do_not_follow_are_refused_and_change_nothing():
    clock, stores, a, b = _moving_pair()
    before = _whole(a, 0)
    for bad in (
        FragmentMap(0, (1, 1)),  # not newer
        FragmentMap(1, (0, 1)),  # keeps fragment 0 here
        FragmentMap(1, (1, 0)),  # moves fragment 1 too
    ):
        assert _refusal(lambda bad=bad: a.freeze(0, bad)).why in (
            Why.OUT_OF_STEP,
            Why.MALFORMED,
        )
    assert _refusal(lambda: a.export(0)).why is Why.OUT_OF_STEP
    assert _refusal(lambda: a.commit_move(0, MOVED)).why is Why.OUT_OF_STEP
    assert a.frozen == {} and _whole(a, 0) == before


def test_a_shard_past_the_first_layout_owns_nothing_until_a_fragment_moves_to_it():
    # kubectl scale up: shard 2 of a run laid out over 2 starts, serves, owns nothing
    clock, stores, a, b = _moving_pair()
    c = _of(2, MemoryLog(), MemorySnapshots(), clock)
    assert c.fragments == {} and c.plan is None
    to_c = FragmentMap.modulo(2, 2).moved(0, 2)
    before = _whole(a, 0)
    a.freeze(0, to_c)
    c.adopt(*a.export(0))
    a.commit_move(0, to_c)
    assert _whole(c, 0) == before and c.plan is not None and sorted(c.fragments) == [0]
    assert _push(c, 0, 1, 3, 2).accepted and c.fragments[0].version == 3
    refused = _refusal(lambda: _push(a, 0, 1, 4, 3))
    assert dict(refused.metadata) == {OWNER_KEY: "2", MAP_VERSION_KEY: "1", FRAGMENT_KEY: "0"}


def _tampered(meta: dict, payload: bytes, key: str, value) -> tuple[dict, bytes]:
    """The export with one array replaced."""
    with np.load(io.BytesIO(payload)) as z:
        arrays = {k: z[k] for k in z.files}
    arrays[key] = value
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return meta, buf.getvalue()


def test_an_adopt_that_replay_could_not_apply_is_refused_and_changes_nothing():
    clock, stores, a, b = _moving_pair()
    a.freeze(0, MOVED)
    meta, payload = a.export(0)
    size = PLAN.fragment_sizes[0]
    nan = np.full(size, np.nan, np.float32)
    bad = {
        "not an object": ([1, 2], payload),
        "no state": ({k: v for k, v in meta.items() if k != "state"}, payload),
        "not npz": (meta, b"\x00" * 64),
        "another plan": (meta | {"plan": PLAN.to_json().replace('"w1"', '"w9"')}, payload),
        "gives it elsewhere": (
            meta | {"map": FragmentMap.modulo(2, 2).moved(0, 0).to_json()},
            payload,
        ),
        "params short": _tampered(meta, payload, "params", np.zeros(size - 1, np.float32)),
        "params NaN": _tampered(meta, payload, "params", nan),
        "published inf": _tampered(meta, payload, "published", np.full(size, np.inf, np.float32)),
        "momentum NaN": _tampered(meta, payload, "opt.1", nan),
        "round inf": _tampered(meta, payload, "round.acc", np.full(size, np.inf, np.float32)),
        "ring garbage": _tampered(meta, payload, "ring.0", np.frombuffer(b"junk" * 9, np.uint8)),
        "weights": (
            meta
            | {"state": meta["state"] | {"round": meta["state"]["round"] | {"total_weight": -1}}},
            payload,
        ),
    }
    log = stores[1][0]
    for name, (m, p) in bad.items():
        before = len(log.records)
        refused = _refusal(lambda m=m, p=p: b.adopt(m, p))
        assert refused.why in (
            Why.MALFORMED,
            Why.OUT_OF_STEP,
        ), name
        assert len(log.records) == before and 0 not in b.fragments, name
        assert b.fragment_map == FragmentMap.modulo(2, 2), name
    b.adopt(meta, payload)  # the real one still goes in
    assert 0 in b.fragments


def test_the_shared_state_builds_alone_and_refuses_in_its_own_terms():
    """ShardState is what the shard's jobs share; a test can make one with no calls,
    recovery or moves, and its refusals carry a reason, not a transport's status."""
    from atoll.server.state import ShardState

    cfg = ShardConfig(shard_index=0, num_shards=1, data_dir=pathlib.Path("/nonexistent/memory"))
    state = ShardState(cfg, Clock(), log=MemoryLog(), snapshots=MemorySnapshots())
    assert state.plan is None and state.fragments == {} and state.frozen == {}
    assert _refusal(state._require_ready).why is Why.BUSY  # not recovered
    assert _refusal(lambda: state._fragment(0)).why is Why.OUT_OF_STEP  # no plan yet
    state._adopt_plan(PLAN)
    assert sorted(state.fragments) == [0, 1] and state.fragment_map == FragmentMap.modulo(2, 1)
    assert _refusal(lambda: state._fragment(5)).why is Why.NOT_FOUND
