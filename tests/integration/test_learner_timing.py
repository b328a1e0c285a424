"""The step-time accounting the shards' cadence is built on, against real shards: a
learner's step time (what each push reports as `compute_seconds`, what `on_push`
describes) is the caller's step alone, with `paused()` blocks and the seconds it spent
blocked on a round left out; `on_push` sees each answered push; `standing()` gives the
oldest version adopted and the worst lag."""

from __future__ import annotations

import threading
import time

from test_learner_api_shards import init, start_shards

import atoll
from atoll.learner.config import LearnerConfig

H = 4
STEPS = 16  # four periods
SLOW = 0.1  # seconds of a slow step (a sleep: one a learner would count as its own)


def logged(shard: str, name: str, on_push, **settings) -> atoll.Learner:
    """Learner `name` at H with `on_push`: the built-in loop's push log, given through
    its path (Learner.from_config)."""
    sync = atoll.SyncConfig(period=H, **settings)
    cfg = LearnerConfig(shards=(shard,), learner_id=name, sync=sync, fragments=2)
    return atoll.Learner.from_config(cfg, on_push=on_push)


def run(learner: atoll.Learner, steps: int, step_sleep: float = 0.0, paused_sleep: float = 0.0):
    """`steps` steps of a loop whose own work is `step_sleep` seconds a step and which
    spends `paused_sleep` a step inside `paused()` (an evaluation); then `finish`."""
    params = learner.join(init())
    for _ in range(steps):
        time.sleep(step_sleep)
        if paused_sleep:
            with learner.paused():
                time.sleep(paused_sleep)
        params = learner.step(params, tokens=8)
    return learner.finish(params)


def compute_by_fragment(pushes: list[dict]) -> dict[int, float]:
    totals: dict[int, float] = {}
    for push in pushes:
        totals[push["fragment"]] = totals.get(push["fragment"], 0.0) + push["compute_seconds"]
    return totals


def test_time_inside_paused_is_not_step_time(one_shard):
    pushes: list[dict] = []
    learner = logged(one_shard, "a", pushes.append)
    run(learner, STEPS, paused_sleep=SLOW)
    assert pushes, "no push answered"
    for p, seconds in compute_by_fragment(pushes).items():
        # each fragment's pushes cover its steps: counted as paused they would be
        # >= ~STEPS/2 * SLOW; the steps themselves (a step() call) take milliseconds
        assert seconds < 0.25 * (STEPS // 2) * SLOW, (p, seconds, pushes)


def test_time_outside_paused_is_step_time(one_shard):
    """The control for the test above: the same sleep outside `paused()` is counted."""
    pushes: list[dict] = []
    learner = logged(one_shard, "a", pushes.append)
    run(learner, STEPS, step_sleep=SLOW)
    totals = compute_by_fragment(pushes)
    assert set(totals) == {0, 1}, pushes
    steps = {p: sum(x["steps"] for x in pushes if x["fragment"] == p) for p in totals}
    for p, seconds in totals.items():
        assert seconds >= 0.9 * steps[p] * SLOW, (p, seconds, steps, pushes)


def test_seconds_blocked_on_a_round_are_not_step_time(tmp_path):
    """With synchronous semantics and a quorum of two, a fast learner waits for each
    round on a slow one: those waits are `blocked_seconds`, not its step time."""
    servers = start_shards(tmp_path, 1, quorum=2)
    address = f"127.0.0.1:{servers[0].port}"
    pushes: dict[str, list[dict]] = {"fast": [], "slow": []}
    learners = {
        name: logged(address, name, pushes[name].append, wait_for_rounds=True) for name in pushes
    }
    errors: list[BaseException] = []

    def train(name: str) -> None:
        try:
            run(learners[name], STEPS, step_sleep=SLOW if name == "slow" else 0.0)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=train, args=(name,)) for name in learners]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        for s in servers:
            s.stop()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    fast = learners["fast"]
    blocked = fast.stats["blocked_seconds"]
    # the slow learner's steps hold up the rounds: the fast one waits about their time
    assert blocked > 0.3 * STEPS * SLOW, fast.stats
    fast_compute = sum(compute_by_fragment(pushes["fast"]).values())
    slow_compute = sum(compute_by_fragment(pushes["slow"]).values())
    # counted as step time the waits would make the fast learner's compute match the
    # slow one's; subtracted, it stays a small part of it
    assert fast_compute < 0.25 * slow_compute, (fast_compute, slow_compute, fast.stats)
    assert slow_compute >= 0.5 * STEPS * SLOW, (slow_compute, pushes["slow"])


def test_on_push_is_called_once_per_answered_push_with_what_was_pushed(one_shard):
    pushes: list[dict] = []
    learner = logged(one_shard, "a", pushes.append)
    run(learner, STEPS)
    assert len(pushes) == learner.stats["pushes"], (pushes, learner.stats)
    assert {x["fragment"] for x in pushes} == {0, 1}
    for p in (0, 1):
        mine = [x for x in pushes if x["fragment"] == p]
        # a quorum of one: every push accepted, each merged into the version after the
        # one it was based on, and the next push based on that version
        assert all(x["accepted"] for x in mine), mine
        assert [x["merged_in"] for x in mine] == [x["base_version"] + 1 for x in mine], mine
        assert [x["base_version"] for x in mine[1:]] == [x["merged_in"] for x in mine[:-1]]
        # the steps reported cover the run: every step is in exactly one push (the
        # tail's in the one `finish` sends)
        assert sum(x["steps"] for x in mine) == STEPS, mine
    seqs = [x["seq"] for x in pushes]
    assert len(set(seqs)) == len(seqs), seqs  # no push described twice


def test_standing_gives_the_oldest_version_adopted_and_the_worst_lag(one_shard):
    """A learner that stops stepping falls behind the rounds another one closes: its
    standing is the version it adopted and how far the newest it hears of is ahead."""
    behind = atoll.Learner(one_shard, "behind", fragments=2, sync=atoll.SyncConfig(period=H))
    assert behind.standing() == (0, 0)  # before join
    params = behind.join(init())
    for _ in range(10 * H):  # until each fragment adopted a round (a push answered)
        params = behind.step(params, tokens=8)
        if min(v for v, _ in behind.versions.values()) >= 1:
            break
        time.sleep(0.02)
    adopted = {p: v for p, (v, _) in behind.versions.items()}
    assert set(adopted) == {0, 1} and min(adopted.values()) >= 1, behind.versions
    ahead = atoll.Learner(one_shard, "ahead", fragments=2, sync=atoll.SyncConfig(period=H))
    run(ahead, 3 * H)
    newest = {p: v for p, (v, _) in ahead.versions.items()}
    deadline = time.monotonic() + 10
    while {p: known for p, (_, known) in behind.versions.items()} != newest:
        assert time.monotonic() < deadline, (behind.versions, newest)
        time.sleep(0.05)
    lag = max(newest[p] - adopted[p] for p in adopted)
    assert lag >= 2, (adopted, newest)  # three periods of rounds it took no part in
    assert behind.standing() == (min(adopted.values()), lag), (behind.versions, newest)
    behind.close()
