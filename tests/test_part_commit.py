"""Group commit of a push's parts (server/part_commit.py): a part whose record is written
waits for the parts of its push still in hand, then one sync makes them all durable;
never an answer before its record is durable, and never a wait past the bound."""

from __future__ import annotations

import threading
import time

from test_parts import FOUR, P, _delta, _header, _two, _values

from atoll.server.log_records import LOG_PART, parse_log_record
from atoll.server.part_commit import PartCommit
from atoll.wire import codec


def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never came true"
        time.sleep(0.001)


def test_a_part_waits_for_its_push_parts_in_hand_only_and_at_most_its_bound():
    commit = PartCommit(wait_seconds=10.0)
    assert commit.await_siblings(("p", "la", 1))  # nothing in hand: no wait
    left = threading.Event()
    with commit.arriving(("p", "la", 1)):
        assert commit.await_siblings(("p", "la", 2))  # another push's part: no wait
        waiter = threading.Thread(
            target=lambda: commit.await_siblings(("p", "la", 1)) and left.set()
        )
        waiter.start()
        assert not left.wait(0.05)  # a sibling in hand: it waits
    waiter.join(10)
    assert left.is_set()
    short = PartCommit(wait_seconds=0.01)
    with short.arriving("push"):
        started = time.monotonic()
        assert not short.await_siblings("push")  # a sibling that never comes: the bound
        assert time.monotonic() - started < 5.0


def test_parts_that_arrive_together_share_one_sync_and_each_answer_waits_for_it():
    (shard, log, _, _), _ = _two()
    shard.part_commit.wait_seconds = 10.0
    delta, answers = _delta("a", 1), {}

    def push(k: int) -> None:
        h = _header("la", 1, 0, parts=4, part=k, boxes=FOUR[k])
        answers[k] = shard.push(h, codec.encode(_values(delta, FOUR[k]), codec.Codec.FP32))

    def logged_parts() -> list[int]:
        return [lsn for lsn, r in log.records if parse_log_record(r)[0] == LOG_PART]

    syncs = log.syncs
    with shard.part_commit.arriving((P, "la", 1)):  # part 2 of the push, still being read
        threads = []
        for k in (0, 1):
            threads.append(threading.Thread(target=push, args=(k,)))
            threads[-1].start()
            _until(lambda: len(logged_parts()) == k + 1)
        assert all(t.is_alive() for t in threads) and not answers
        assert log.syncs == syncs and log.durable_lsn < logged_parts()[0]
    for t in threads:
        t.join(10)
    assert [answers[k].reason for k in (0, 1)] == ["part_held"] * 2
    assert log.syncs == syncs + 1 and log.durable_lsn >= max(logged_parts())
