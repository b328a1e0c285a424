"""Property-based tests of the move calls against two real `atoll syncer` processes.

Hypothesis draws sequences of Freeze / Export / Adopt / Commit / Unfreeze calls, each
genuine (the next map, the state an Export gave) or fuzzed (maps of any versions and
owners, states with any values, arrays of any dtype and shape, freeze records missing or
made up), sent to either shard in any order. Throughout: every refused call leaves the
shard's data directory byte for byte as it was and is refused as the caller's fault
(never UNKNOWN or INTERNAL), both shards answer health as SERVING, and at the end each
shard, killed with SIGKILL, replays its log to the same map, moves and fragment state.

The shards live for the whole module (state carries over from example to example, as a
run's would); examples are few, so the module takes seconds.
"""

from __future__ import annotations

import collections
import hashlib
import json
import pathlib

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from syncer_helpers import (
    DEADLINE,
    PLAN,
    SERVICE,
    arrays_of,
    connect,
    describe,
    health_status,
    init,
    npz,
    shard_state,
    syncer_processes,
)

from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import described_map
from atoll.wire.plan import FragmentMap

EXAMPLES = 100
REFUSED_AS_CALLERS_FAULT = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
}
OUTCOMES: collections.Counter[str] = collections.Counter()  # "kind: OK" or "kind: CODE"
BIG = [0, 1, 2, 3, 7, 2**31, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1]


class Cluster:
    """Two shard processes, their stubs, and the newest export of each fragment."""

    def __init__(self, start, root: pathlib.Path):
        self.start, self.root = start, root
        self.procs = [self._start(i) for i in (0, 1)]
        self.channels, self.stubs = [], []
        self._connect()
        self.exports: dict[int, tuple[dict, bytes]] = {}

    def _start(self, i: int):
        return self.start(self.root / f"s{i}", "--shard-index", i, "--num-shards", 2)

    def _connect(self) -> None:
        for channel in self.channels:
            channel.close()
        pairs = [connect(p.port) for p in self.procs]
        self.channels = [c for c, _ in pairs]
        self.stubs = [s for _, s in pairs]

    def restart_after_kill(self) -> None:
        for i, proc in enumerate(self.procs):
            assert proc.kill() == -9
            self.procs[i] = self._start(i)  # on the same data directory
        self._connect()

    def data_bytes(self, i: int) -> dict[str, str]:
        root = self.root / f"s{i}"
        return {
            str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*"))
            if f.is_file() and not f.name.endswith(".lock")
        }

    def newest_map(self) -> FragmentMap:
        return FragmentMap.merge_all([described_map(describe(s)) for s in self.stubs])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = pathlib.Path(tmp_path_factory.mktemp("move-fuzz"))
    with syncer_processes(root) as start:
        c = Cluster(start, root)
        rng = np.random.default_rng(0)
        for p, size in enumerate(PLAN.fragment_sizes):
            init(c.stubs[p % 2], PLAN, p, rng.standard_normal(size).astype(np.float32))
        yield c
        for channel in c.channels:
            channel.close()


# --- what hypothesis draws ---

big_ints = st.one_of(st.sampled_from(BIG), st.integers(-(2**70), 2**70))
json_values = st.one_of(
    big_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.none(),
    st.booleans(),
    st.lists(st.integers(-3, 9), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(-1, 3), max_size=2),
)
fuzzed_maps = st.builds(
    lambda v, owners, moved: pb.FragmentMap(version=v, owners=owners, moved_at=moved),
    st.sampled_from(BIG),
    st.lists(st.sampled_from([0, 1, 2, 5, 4095, 4096, 2**32 - 1]), min_size=3, max_size=5),
    st.lists(st.sampled_from(BIG), min_size=3, max_size=5),
)


def _filled(dtype: str, shape: tuple, fill: float) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):  # NaN or 1e30 into an int: any bits
        return np.full(shape, fill).astype(dtype)


fuzzed_arrays = st.builds(
    _filled,
    st.sampled_from(["float32", "float64", "complex64", "int32", "uint8", "float16"]),
    st.sampled_from([(0,), (1,), (320,), (288,), (1, 320), (3, 3)]),
    st.sampled_from([0.0, 1.0, np.nan, np.inf, 1e30]),
)
calls = st.fixed_dictionaries(
    {
        # "step": the next genuine step of the fragment's move (freeze, export, adopt, commit)
        "kind": st.sampled_from(
            ["freeze", "export", "adopt", "commit", "unfreeze", "step", "step"]
        ),
        "fragment": st.one_of(st.integers(0, 3), st.sampled_from([4, 9, 2**32 - 1])),
        "shard": st.sampled_from([0, 1]),
        "genuine": st.booleans(),
        "map": fuzzed_maps,
        "tamper": st.sampled_from(["state", "array", "freeze", "meta", "map", "none"]),
        "key": st.sampled_from(
            [
                "version",
                "ring",
                "answers",
                "contributors",
                "round",
                "initialized",
                "last_round_size",
            ]
        ),
        "value": json_values,
        "array": fuzzed_arrays,
        "which": st.integers(0, 20),  # the array replaced
    }
)


# --- making one call ---


def _adoption(c: Cluster, call: dict) -> tuple[dict, bytes]:
    """The meta and payload of an Adopt: the newest export of the fragment, tampered."""
    p = call["fragment"]
    meta, payload = c.exports.get(p) or next(iter(c.exports.values()), ({}, b""))
    meta = json.loads(json.dumps(meta))
    tamper = "none" if call["genuine"] else call["tamper"]
    if tamper == "state" and isinstance(meta.get("state"), dict):
        meta["state"][call["key"]] = call["value"]
    elif tamper == "array" and payload:
        arrays = arrays_of(payload)
        key = sorted(arrays)[call["which"] % len(arrays)] if arrays else "params"
        payload = npz(arrays | {key: call["array"]})
    elif tamper == "freeze":
        meta["freeze"] = call["value"]
    elif tamper == "meta":
        meta[call["key"]] = call["value"]
    elif tamper == "map":
        m = call["map"]
        meta["map"] = {"version": m.version, "owners": list(m.owners), "moved_at": list(m.moved_at)}
    return meta, payload


def _move_map(c: Cluster, call: dict) -> pb.FragmentMap:
    """A genuine call's map: freeze, the fragment moved one version on; commit, the map
    its owner froze it for. Otherwise the fuzzed one."""
    p = call["fragment"]
    if not call["genuine"] or p > 3:
        return call["map"]
    current = c.newest_map()
    d = describe(c.stubs[call["shard"]])
    frozen = {f.fragment: f for f in d.fragments if f.moving_version}
    if call["kind"] == "commit" and p in frozen:
        new = current.stating(p, frozen[p].moving_to, frozen[p].moving_version)
    else:
        new = current.moved(p, 1 - current.owner(p))
    return pb.FragmentMap(version=new.version, owners=new.owners, moved_at=new.moved_at)


def _shard_for(c: Cluster, call: dict) -> int:
    """The shard a call goes to: a genuine one, where a move of its fragment stands (the
    source, or the target for an Adopt); a fuzzed one, the shard drawn."""
    p = call["fragment"]
    if not call["genuine"] or p > 3:
        return int(call["shard"])
    frozen_on = [
        i
        for i, s in enumerate(c.stubs)
        for f in describe(s).fragments
        if f.fragment == p and f.moving_version
    ]
    source = frozen_on[0] if frozen_on else c.newest_map().owner(p)
    return 1 - source if call["kind"] == "adopt" else source


def _next_step(c: Cluster, call: dict) -> dict:
    """A "step" call as the genuine call that takes its fragment's move one step on."""
    p = call["fragment"]
    if p > 3:
        return call | {"kind": "freeze"}
    held = [{f.fragment: f for f in describe(s).fragments} for s in c.stubs]
    frozen_on = [i for i in (0, 1) if p in held[i] and held[i][p].moving_version]
    if not frozen_on:
        return call | {"kind": "freeze", "genuine": True}
    source = frozen_on[0]
    moving = held[source][p].moving_version
    if p in held[1 - source]:
        kind = "commit"
    elif c.exports.get(p, ({}, b""))[0].get("map", {}).get("version") == moving:
        kind = "adopt"
    else:
        kind = "export"
    return call | {"kind": kind, "genuine": True}


def _send(c: Cluster, call: dict) -> None:
    stub, p = c.stubs[call["shard"]], call["fragment"]
    kind = call["kind"]
    if kind in ("freeze", "commit"):
        request = pb.MoveRequest(fragment=p, map=_move_map(c, call))
        (stub.Freeze if kind == "freeze" else stub.Commit)(request, timeout=DEADLINE)
    elif kind == "unfreeze":
        stub.Unfreeze(pb.MoveRequest(fragment=p), timeout=DEADLINE)
    elif kind == "export":
        header, parts = None, []
        for msg in stub.Export(pb.MoveRequest(fragment=p), timeout=DEADLINE):
            if msg.WhichOneof("kind") == "header":
                header = msg.header
            else:
                parts.append(msg.chunk)
        c.exports[p] = (json.loads(header.meta_json), b"".join(parts))
    else:
        meta, payload = _adoption(c, call)
        messages = [
            pb.FragmentState(
                header=pb.FragmentStateHeader(
                    meta_json=json.dumps(meta), payload_bytes=len(payload)
                )
            )
        ] + ([pb.FragmentState(chunk=payload)] if payload else [])
        stub.Adopt(iter(messages), timeout=DEADLINE)


# --- the properties ---


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sequence=st.lists(calls, min_size=1, max_size=6))
def test_a_refused_move_call_logs_nothing_and_the_shards_stay_healthy(cluster, sequence):
    for call in sequence:
        if call["kind"] == "step":
            call = _next_step(cluster, call)
        i = call["shard"] = _shard_for(cluster, call)
        before = cluster.data_bytes(i)
        try:
            _send(cluster, call)
            OUTCOMES[f"{call['kind']}: OK"] += 1
        except grpc.RpcError as e:
            OUTCOMES[f"{call['kind']}: {e.code().name}"] += 1
            assert e.code() in REFUSED_AS_CALLERS_FAULT, (call["kind"], e.code(), e.details())
            assert cluster.data_bytes(i) == before, f"refused {call['kind']} changed shard {i}"
        for channel in cluster.channels:
            assert health_status(channel, SERVICE) == health_pb2.HealthCheckResponse.SERVING


def _visible(c: Cluster) -> list[tuple]:
    """Each shard's map, moves in progress and every fragment's state as pulled."""
    out = []
    for stub in c.stubs:
        d = describe(stub)
        moving = {f.fragment: (f.moving_version, f.moving_to) for f in d.fragments}
        out.append((described_map(d), moving, shard_state(stub)))
    return out


KINDS = ("freeze", "export", "adopt", "commit")


def _finish_a_move(c: Cluster) -> None:
    """Genuine steps of the fragments' moves until each kind of move call has been taken:
    a fuzzing run draws fresh examples each time and may not get that far (one got no
    adopt through), and the replay below must go through every kind of record."""
    for _ in range(10):
        for p in range(4):
            if all(OUTCOMES[f"{kind}: OK"] for kind in KINDS):
                return
            call = _next_step(c, {"kind": "step", "fragment": p, "genuine": True, "map": None})
            call["shard"] = _shard_for(c, call)
            try:
                _send(c, call)
                OUTCOMES[f"{call['kind']}: OK"] += 1
            except grpc.RpcError as e:  # a fuzzed call may have left a move stuck: go on
                OUTCOMES[f"{call['kind']}: {e.code().name}"] += 1


def test_after_kill_9_each_shard_replays_to_the_state_and_map_it_served(cluster):
    """Runs after the fuzzing above (the same shards): SIGKILL, restart, same answers."""
    print("move calls made by the fuzzing:", dict(sorted(OUTCOMES.items())))
    _finish_a_move(cluster)
    assert all(OUTCOMES[f"{kind}: OK"] for kind in KINDS), dict(OUTCOMES)
    before = _visible(cluster)
    cluster.restart_after_kill()
    assert _visible(cluster) == before
