"""Units of an `atoll up` session: how long the global model's read waits for open
rounds, which shard it reads each fragment from, and what a learner sent SIGTERM is
reported as (stand-in processes, not learners)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from atoll.local.config import learner_specs, prepare_run_dir
from atoll.local.processes import LearnerProcess
from atoll.local.report import build_report
from atoll.local.session import (
    OPEN_ROUND_MIN_SECONDS,
    Session,
    global_map,
    open_rounds,
    round_wait_seconds,
)
from atoll.wire import syncer_pb2 as pb


def test_the_read_waits_a_few_periods_never_a_lockstep_lease():
    # lockstep's leases never lapse: three periods, not 1e9 s
    assert round_wait_seconds(1e9, 4.0) == 12.0
    # an unknown or very short period: the floor
    assert round_wait_seconds(1e9, None) == OPEN_ROUND_MIN_SECONDS
    assert round_wait_seconds(1e9, 0.1) == OPEN_ROUND_MIN_SECONDS
    # a lease shorter than that: by then the learners that left are dropped and rounds closed
    assert round_wait_seconds(5.0, 8.0) == 10.0


def _describe(index: int, owners, version: int = 0, moved_at=None, rounds=None):
    """Shard `index`'s DescribeResponse: the map it knows, and the fragments it holds with
    {fragment: round_size} of their open rounds."""
    moved_at = moved_at or [0] * len(owners)
    held = [p for p, o in enumerate(owners) if o == index]
    return pb.DescribeResponse(
        shard_index=index,
        num_shards=2,
        num_fragments=len(owners),
        map_version=version,
        owners=owners,
        moved_at=moved_at,
        fragments=[
            pb.FragmentInfo(fragment=p, initialized=True, round_size=(rounds or {}).get(p, 0))
            for p in held
        ],
    )


def test_fragments_are_read_where_the_shards_map_puts_them():
    # fragment 1 moved from shard 1 to shard 0 (version 1): shard 1 took part and knows;
    # a shard that knows only version 0 is outvoted fragment by fragment
    moved = _describe(0, [0, 0, 0, 1], version=1, moved_at=[0, 1, 0, 0], rounds={1: 2})
    stale = _describe(1, [0, 1, 0, 1], rounds={1: 1, 3: 1})  # still lists fragment 1's round
    fmap = global_map([moved, stale], 4)
    assert fmap.owners == (0, 0, 0, 1) and fmap.owner(1) == 0  # not 1 % 2
    # open rounds are read on each fragment's owner only
    assert open_rounds([moved, stale], fmap) == {1: 2, 3: 1}


def test_before_any_map_fragments_are_read_modulo_the_shards():
    blank = [pb.DescribeResponse(shard_index=i, num_shards=2) for i in range(2)]
    assert global_map(blank, 4).owners == (0, 1, 0, 1)


def test_a_map_naming_a_shard_the_run_lacks_is_an_error():
    grown = _describe(0, [0, 2, 0, 1], version=1, moved_at=[0, 1, 0, 0])
    with pytest.raises(RuntimeError, match="1 on shard 2"):
        global_map([grown, _describe(1, [0, 1, 0, 1])], 4)


# -- a learner sent SIGTERM --

# stand-ins for a learner process: each says "ready" once its SIGTERM handling is set
DIES_ON_SIGTERM = "pass"  # Python's default action: before the learner set its handler
IGNORES_SIGTERM = "signal.signal(signal.SIGTERM, signal.SIG_IGN)"
FAILS_ON_SIGTERM = "signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))"


def _session(tmp_path, learners: int) -> Session:
    cfg, _ = prepare_run_dir(tmp_path / "run", {"learners": learners, "preset": "tiny"})
    return Session(cfg, tmp_path / "run", io.StringIO(), live=False)


def _stand_in(session: Session, index: int, code: str, records=()) -> LearnerProcess:
    """Learner `index` of the session, its process a Python stand-in running `code`, its
    status file holding `records` (as the learner would have written them)."""
    l = LearnerProcess(learner_specs(session.cfg)[index], session.cfg, session.run_dir, [])
    with open(l.status.path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    l.proc = subprocess.Popen(
        [sys.executable, "-c", f"import signal, sys, time; {code}; print('ready'); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert l.proc.stdout.readline() == "ready\n"
    l.state = "starting"
    return l


def test_a_learner_stopped_before_its_first_step_is_stopped_not_crashed(tmp_path):
    session = _session(tmp_path, 3)
    early = _stand_in(session, 0, DIES_ON_SIGTERM)  # SIGTERM before it set its handler
    joining = _stand_in(
        session, 1, FAILS_ON_SIGTERM, [{"state": "joining", "time": 0.0, "step": 0, "tokens": 0}]
    )
    training = _stand_in(
        session,
        2,
        FAILS_ON_SIGTERM,
        [
            {"state": "joining", "time": 0.0, "step": 0, "tokens": 0},
            {"state": "training", "time": 1.0, "step": 1, "tokens": 512, "loss": 5.5},
        ],
    )
    session.learners = [early, joining, training]
    session.stop_signal = 2  # a Ctrl-C
    session._stop(session.learners, seconds=20.0)
    assert [l.state for l in session.learners] == ["stopped", "stopped", "crashed"]
    assert early.returncode < 0 and joining.returncode == 1
    events = "\n".join(session.events)
    assert "did not stop" not in events and "the others go on" not in events
    assert "learner-2 exited with status 1 as it stopped, at step 1" in events
    report = build_report(
        session.run_dir,
        session.cfg,
        learner_specs(session.cfg),
        interrupted="SIGINT",
        states={l.name: l.state for l in session.learners},
    )
    assert [report["learners"][l.name]["state"] for l in session.learners] == [
        "stopped",
        "stopped",
        "crashed",
    ]


def test_a_learner_that_ignores_sigterm_is_killed_and_said_so(tmp_path):
    session = _session(tmp_path, 1)
    session.learners = [stuck := _stand_in(session, 0, IGNORES_SIGTERM)]
    session._stop(session.learners, seconds=0.5)
    assert stuck.state == "killed" and stuck.returncode == -9
    assert any("did not stop within 0 s of SIGTERM; killed it" in e for e in session.events)
