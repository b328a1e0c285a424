"""Routing by the fragment map (docs/resharding.md): a learner sends each fragment's
calls to the owner the newest map names, and follows a refusal that names a newer one."""

from __future__ import annotations

import grpc
import pytest

from atoll.learner.sync import SyncConfig, SyncError, Synchronizer
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import FRAGMENT_KEY, MAP_VERSION_KEY, OWNER_KEY
from atoll.wire.plan import FragmentMap, FragmentPlan, TensorSpec

PLAN = FragmentPlan.build([TensorSpec(f"w{i}", (4, 8)) for i in range(4)], 4)


class Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, trailing: tuple = ()):
        self._code, self._trailing = code, trailing

    def code(self):
        return self._code

    def details(self):
        return "refused"

    def trailing_metadata(self):
        return self._trailing


def moved_to(owner: int, version: int) -> Refused:
    return Refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        ((OWNER_KEY, str(owner)), (MAP_VERSION_KEY, str(version))),
    )


class FakeShard:
    """Answers pushes, or refuses the fragments in `refuse` with the error given; a shard
    that is `down` answers nothing (UNAVAILABLE)."""

    def __init__(self, index: int, refuse: dict | None = None, down: bool = False):
        self.index, self.refuse, self.pushes, self.down = index, refuse or {}, [], down
        self.map: dict = {}  # map_version and owners, as Describe gives them
        self.address = f"fake-{index}"

    def push(self, header: pb.PushHeader, frame: bytes) -> pb.PushResponse:
        if self.down:
            raise Refused(grpc.StatusCode.UNAVAILABLE)
        self.pushes.append((header.fragment, header.seq))
        if header.fragment in self.refuse:
            raise self.refuse[header.fragment]
        return pb.PushResponse(accepted=True, version=7)

    def listening(self, timeout: float | None = None) -> bool:
        return not self.down

    def describe(self, timeout: float | None = None) -> pb.DescribeResponse:
        if self.down:
            raise Refused(grpc.StatusCode.UNAVAILABLE)
        if self.index >= 2 and not self.map:  # a shard a reshard may use, not started yet
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED)
        return pb.DescribeResponse(shard_index=self.index, num_shards=2, **self.map)

    def close(self) -> None:
        pass


def _sync(shards: list[FakeShard]) -> Synchronizer:
    return Synchronizer(SyncConfig(period=4, max_backoff=0.01), PLAN, shards)


def _push(sync: Synchronizer, p: int, seq: int) -> pb.PushResponse:
    header = pb.PushHeader(fragment=p, seq=seq)
    return sync._retry(lambda: sync.client_of(p).push(header, b""), f"push {p}", fragment=p)


def test_a_push_refused_by_a_former_owner_goes_to_the_new_one_with_its_seq():
    shards = [FakeShard(0, {2: moved_to(1, 3)}), FakeShard(1)]
    sync = _sync(shards)
    try:
        assert sync.fragment_map == FragmentMap.modulo(4, 2)  # p mod S until told otherwise
        assert _push(sync, 2, seq=5).accepted
        assert shards[0].pushes == [(2, 5)] and shards[1].pushes == [(2, 5)]
        assert sync.fragment_map == FragmentMap(3, (0, 1, 1, 1), (0, 0, 3, 0))
        assert sync.shard_of(2) == 1 and sync.shard_of(0) == 0
        assert _push(sync, 2, seq=6).accepted  # straight to the new owner now
        assert shards[1].pushes[-1] == (2, 6) and len(shards[0].pushes) == 1
    finally:
        sync.close()


@pytest.mark.parametrize(
    "error",
    [
        moved_to(1, 0),  # not newer than the map held: two shards disagreeing is an error
        moved_to(5, 9),  # a shard this learner was not given
        Refused(grpc.StatusCode.FAILED_PRECONDITION),  # no owner named
        Refused(grpc.StatusCode.FAILED_PRECONDITION, ((OWNER_KEY, "x"), (MAP_VERSION_KEY, "2"))),
    ],
)
def test_a_refusal_that_names_no_usable_newer_owner_is_an_error(error):
    shards = [FakeShard(0, {2: error}), FakeShard(1)]
    sync = _sync(shards)
    try:
        with pytest.raises(SyncError, match="FAILED_PRECONDITION"):
            _push(sync, 2, seq=1)
        assert sync.fragment_map == FragmentMap.modulo(4, 2) and shards[1].pushes == []
    finally:
        sync.close()


def test_a_learner_starts_from_the_newest_map_the_shards_describe():
    shards = [FakeShard(0), FakeShard(1)]
    # version 1 moved fragment 0 to shard 1; version 2 fragment 1 to shard 0: each shard
    # knows the moves it took part in, the learner puts them together
    shards[0].map = dict(map_version=2, owners=[1, 0, 0, 1], moved_at=[1, 2, 0, 0])
    shards[1].map = dict(map_version=2, owners=[1, 0, 0, 1], moved_at=[1, 2, 0, 0])
    sync = _sync(shards)
    try:
        sync.check_shards()
        assert sync.fragment_map == FragmentMap(2, (1, 0, 0, 1), (1, 2, 0, 0))
        assert sync.client_of(0) is shards[1] and sync.client_of(1) is shards[0]
    finally:
        sync.close()


def test_a_learner_follows_an_older_move_of_another_fragment_than_the_one_it_knows():
    # it learned version 2 (fragment 3 moved) first; fragment 2's move was version 1:
    # the refusal of its old owner is still news about fragment 2
    shards = [FakeShard(0, {2: moved_to(1, 1)}), FakeShard(1)]
    sync = _sync(shards)
    try:
        sync._follow(FragmentMap.modulo(4, 2).stating(3, 0, 2))
        assert _push(sync, 2, seq=1).accepted and shards[1].pushes == [(2, 1)]
        assert sync.fragment_map == FragmentMap(2, (0, 1, 1, 0), (0, 0, 1, 2))
    finally:
        sync.close()


def test_a_learner_may_list_shards_past_the_first_layout_that_are_not_up_yet():
    shards = [FakeShard(0), FakeShard(1), FakeShard(2)]
    sync = Synchronizer(SyncConfig(period=4, max_backoff=0.01), PLAN, shards)
    try:
        sync.check_shards()  # shard 2 does not answer: it owns nothing yet
        assert sync.fragment_map == FragmentMap.modulo(4, 2)
    finally:
        sync.close()


def test_a_call_sent_before_another_thread_followed_the_move_is_retried_at_the_new_owner():
    # the push left for shard 0 while another thread learned fragment 2 moved to shard 1:
    # shard 0's refusal is no news, but the call goes where the map now sends it
    shards = [FakeShard(0, {2: moved_to(1, 1)}), FakeShard(1)]
    sync = _sync(shards)
    try:
        header = pb.PushHeader(fragment=2, seq=9)
        calls = iter([shards[0], shards[1]])  # the first attempt went out before the follow
        sync._follow(FragmentMap.modulo(4, 2).stating(2, 1, 1))
        ack = sync._retry(lambda: next(calls).push(header, b""), "push 2", fragment=2)
        assert ack.accepted and shards[1].pushes == [(2, 9)]
    finally:
        sync.close()


def test_a_learner_given_a_pattern_reaches_a_shard_it_was_not_started_with():
    made: dict[int, FakeShard] = {}

    def connect(i: int) -> FakeShard:
        made[i] = FakeShard(i)
        return made[i]

    shards = [FakeShard(0, {2: moved_to(3, 1)}), FakeShard(1)]
    sync = Synchronizer(SyncConfig(period=4, max_backoff=0.01), PLAN, shards, connect=connect)
    try:
        assert _push(sync, 2, seq=4).accepted
        assert made[3].pushes == [(2, 4)] and sync.client_of(2) is made[3]
        assert sync.fragment_map == FragmentMap(1, (0, 1, 3, 1), (0, 0, 1, 0))
    finally:
        sync.close()


def test_with_a_pattern_a_joining_learner_asks_the_shards_past_those_given():
    # fragment 1 went 1 -> 3 (version 1), then 3 -> 2 (version 2), and shard 3 is gone (a
    # scale-down): only shard 2, which the learner was not given, knows where fragment 1 is
    shards = [FakeShard(0), FakeShard(1)]
    shards[0].map = dict(map_version=0, owners=[0, 1, 0, 1], moved_at=[0, 0, 0, 0])
    shards[1].map = dict(map_version=1, owners=[0, 3, 0, 1], moved_at=[0, 1, 0, 0])
    later = {2: FakeShard(2)}
    later[2].map = dict(map_version=2, owners=[0, 2, 0, 1], moved_at=[0, 2, 0, 0])
    asked = []

    def connect(i: int) -> FakeShard:
        asked.append(i)
        return later.get(i) or FakeShard(i, down=True)

    sync = Synchronizer(SyncConfig(period=4, max_backoff=0.01), PLAN, shards, connect=connect)
    try:
        sync.check_shards()
        assert sync.fragment_map == FragmentMap(2, (0, 2, 0, 1), (0, 2, 0, 0))
        assert sync.client_of(1) is later[2]
        assert asked == [2, 3] and len(sync.clients) == 3  # asked up to the first that is not up
    finally:
        sync.close()


def test_a_learner_whose_shard_is_gone_asks_the_others_where_its_fragment_went():
    # fragment 1 moved from shard 1 to shard 0 (version 1) while this learner was away, and
    # shard 1 no longer answers: its pushes go where shard 0's map says
    shards = [FakeShard(0), FakeShard(1, down=True)]
    shards[0].map = dict(map_version=1, owners=[0, 0, 0, 1], moved_at=[0, 1, 0, 0])
    sync = _sync(shards)
    try:
        assert sync.shard_of(1) == 1  # p mod S: it has not heard of the move
        assert _push(sync, 1, seq=3).accepted and shards[0].pushes == [(1, 3)]
        assert sync.fragment_map == FragmentMap(1, (0, 0, 0, 1), (0, 1, 0, 0))
    finally:
        sync.close()


class Holding(FakeShard):
    """A leaving shard that holds `held` until `moved` says so, or until it has been
    asked `until` times."""

    def __init__(self, index: int, held: list[int], until: int | None = None, moved=None):
        super().__init__(index)
        self.held, self.until, self.asked, self.moved = held, until, 0, moved or {}

    def describe(self, timeout: float | None = None) -> pb.DescribeResponse:
        self.asked += 1
        gone = self.moved.get("done") or (self.until is not None and self.asked >= self.until)
        fragments = [] if gone else [pb.FragmentInfo(fragment=p) for p in self.held]
        return pb.DescribeResponse(shard_index=self.index, num_shards=2, fragments=fragments)


def up(i: int) -> FakeShard:
    """A shard that answers Describe, whatever its index."""
    shard = FakeShard(i)
    shard.map = dict(map_version=0, owners=[0, 1, 0, 1], moved_at=[0, 0, 0, 0])
    return shard


def _drain(index, shards: dict, **kw):
    from atoll.cluster import drain as dr

    kw.setdefault("timeout", 60.0)
    return dr.drain(
        index,
        lambda: 2,
        lambda i: shards.get(i) or FakeShard(i, down=True),
        say=lambda _: None,
        **kw,
    )


@pytest.fixture
def planned(monkeypatch):
    """atoll drain's reshard, faked: the first call meets a target restarting
    (UNAVAILABLE), the next moves everything; `calls` lists the shards each was given."""
    from atoll.cluster import drain as dr

    state: dict = {"calls": [], "done": False}

    def reshard(shards, n, say, **kw):
        state["calls"].append(len(shards))
        if len(state["calls"]) == 1:
            raise Refused(grpc.StatusCode.UNAVAILABLE)
        state["done"] = True
        return {"map_version": 5, "owners": [0, 1, 0, 1], "moves": [{"fragment": 2}]}

    monkeypatch.setattr(dr, "reshard", reshard)
    monkeypatch.setattr(dr, "DRAIN_POLL_SECONDS", 0.0)
    return state


def test_the_first_leaving_shard_plans_every_move_and_asks_again_after_a_failure(planned):
    shards = {0: FakeShard(0), 1: FakeShard(1)}
    shards.update({i: Holding(i, [i], moved=planned) for i in (2, 3)})
    out = _drain(2, shards)
    assert out["drained"] and out["moves"] == [{"fragment": 2}]
    assert planned["calls"] == [4, 4]  # shards 0-3 (shard 4 did not answer), twice
    # a shard that stays does nothing, and asks no shard
    assert not _drain(1, {})["drained"]


def test_the_other_leaving_shards_wait_until_they_hold_nothing(planned):
    shards = {0: FakeShard(0), 1: FakeShard(1), 2: up(2), 3: Holding(3, [1, 3], until=3)}
    assert _drain(3, shards)["drained"] and shards[3].asked == 3
    assert planned["calls"] == []  # shard 2 answers: it plans, not shard 3


def test_with_the_first_leaving_shard_gone_the_next_plans(planned):
    shards = {0: FakeShard(0), 1: FakeShard(1), 3: Holding(3, [3], moved=planned)}
    assert _drain(3, shards)["drained"] and planned["calls"] == [4, 4]


def test_pods_stopped_one_at_a_time_each_plan_in_turn(planned):
    shards = {0: FakeShard(0), 1: FakeShard(1), 2: up(2), 3: Holding(3, [3], moved=planned)}
    assert _drain(3, shards, ordered=True)["drained"] and planned["calls"] == [4, 4]


def test_a_leaving_shard_gives_up_at_its_timeout_saying_what_is_left(monkeypatch):
    from atoll.cluster import drain as dr

    monkeypatch.setattr(dr, "DRAIN_POLL_SECONDS", 0.0)
    now = [0.0]

    def clock() -> float:
        now[0] += 10.0
        return now[0]

    stuck = {0: FakeShard(0), 1: FakeShard(1), 2: up(2), 3: Holding(3, [1, 3])}
    with pytest.raises(dr.DrainError, match=r"shard 3 still holds fragments \[1, 3\] after 60 s"):
        _drain(3, stuck, clock=clock)
    with pytest.raises(dr.DrainError, match="scales to 0"):
        dr.drain(0, lambda: 0, lambda i: FakeShard(i), 60.0, say=lambda _: None)


def test_a_refusal_waiting_cannot_mend_ends_the_drain(monkeypatch):
    from atoll.cluster import drain as dr

    def reshard(shards, n, say, **kw):
        raise Refused(grpc.StatusCode.PERMISSION_DENIED)

    monkeypatch.setattr(dr, "reshard", reshard)
    shards = {0: FakeShard(0), 1: FakeShard(1), 2: Holding(2, [2])}
    with pytest.raises(grpc.RpcError):
        _drain(2, shards)


def test_a_watch_refusal_naming_a_shard_first_heard_of_makes_its_client_and_watch():
    made: dict[int, FakeShard] = {}

    def connect(i: int) -> FakeShard:
        made[i] = FakeShard(i)
        return made[i]

    sync = Synchronizer(
        SyncConfig(period=4, max_backoff=0.01), PLAN, [FakeShard(0), FakeShard(1)], connect=connect
    )
    try:
        refusal = Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            ((OWNER_KEY, "2"), (MAP_VERSION_KEY, "1"), (FRAGMENT_KEY, "0")),
        )
        assert sync._moved(-1, refusal)  # a Watch's refusal: no call of fragment 0 follows
        assert sync.shard_of(0) == 2 and 2 in made and sync.clients[2] is made[2]
    finally:
        sync.close()


def test_a_learner_joins_a_run_scaled_below_its_first_layout():
    # the run started on 2 shards; a scale-down moved everything to shard 0 and shard 1 is
    # gone: a learner (re)joining must not wait for it
    shards = [FakeShard(0), FakeShard(1, down=True)]
    shards[0].map = dict(map_version=2, owners=[0, 0, 0, 0], moved_at=[0, 1, 0, 2])
    sync = _sync(shards)
    try:
        sync.check_shards()
        assert sync.fragment_map == FragmentMap(2, (0, 0, 0, 0), (0, 1, 0, 2))
    finally:
        sync.close()
