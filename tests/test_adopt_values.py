"""What an Adopt brings is held to the rules a push's values meet (server/moves.py rule 2):
params, momentum and the published copy within ±MAX_ABS_VALUE, weights within a push's
bounds and safe in float32, learner ids as server/learner_ids.py says; anything else is
refused MALFORMED with nothing logged, and the genuine state still goes in."""

from __future__ import annotations

import numpy as np
import pytest
from test_shard_memory import PLAN, _moving_pair, _refusal, _tampered

from atoll.server import learner_ids
from atoll.server.moves import FLOAT32_MAX, MAX_WEIGHT, values_problem
from atoll.server.refusal import Why
from atoll.server.state import MAX_ABS_VALUE
from atoll.wire.plan import FragmentMap

MOVED = FragmentMap.modulo(2, 2).moved(0, 1)


def _with_answer(meta: dict, **changes) -> dict:
    state = meta["state"]
    (learner, answer), *_ = state["answers"].items()
    answers = {**state["answers"], learner: answer | changes}
    return meta | {"state": state | {"answers": answers}}


def _renamed(meta: dict, learner: str) -> dict:
    state = meta["state"]
    answers = dict(state["answers"])
    first = next(iter(answers))
    answers[learner] = answers.pop(first)
    contributors = [learner if c == first else c for c in state["contributors"]]
    return meta | {"state": state | {"answers": answers, "contributors": contributors}}


def _bad_adopts(meta: dict, payload: bytes) -> dict[str, tuple[dict, bytes]]:
    size = PLAN.fragment_sizes[0]
    huge = np.full(size, 2 * MAX_ABS_VALUE, np.float32)
    round_ = meta["state"]["round"]
    return {  # name: ((meta, payload), what the refusal says)
        "params past ±MAX_ABS_VALUE, beyond": _tampered(meta, payload, "params", huge),
        "published beyond": _tampered(meta, payload, "published", -huge),
        "momentum beyond": _tampered(meta, payload, "opt.1", huge),
        "a float32-max param beyond": _tampered(
            meta, payload, "params", np.full(size, FLOAT32_MAX, np.float32)
        ),
        "an answer's weight past a push's: weight": (
            _with_answer(meta, weight=MAX_WEIGHT * 2),
            payload,
        ),
        "round weights past float32": (
            meta | {"state": meta["state"] | {"round": round_ | {"full_weight": FLOAT32_MAX * 2}}},
            payload,
        ),
        "a space in a learner_id": (_renamed(meta, "l 0"), payload),
        "129 characters in a learner_id": (_renamed(meta, "l" * 129), payload),
        "é in a learner_id": (_renamed(meta, "é"), payload),
    }


def test_an_adopt_whose_values_a_push_could_not_bring_is_refused_and_changes_nothing():
    _, stores, a, b = _moving_pair()
    a.freeze(0, MOVED)
    meta, payload = a.export(0)
    log = stores[1][0]
    for name, (m, p) in _bad_adopts(meta, payload).items():
        before = len(log.records)
        refused = _refusal(lambda m=m, p=p: b.adopt(m, p))
        assert refused.why is Why.MALFORMED, (name, refused)
        said = name.split()[-1]  # each name ends with a word its refusal says
        assert said in str(refused), (name, refused)
        assert len(log.records) == before and 0 not in b.fragments, name
        assert b.fragment_map == FragmentMap.modulo(2, 2), name
    b.adopt(meta, payload)  # the genuine one still goes in
    assert 0 in b.fragments


@pytest.mark.parametrize(
    ("key", "values", "problem"),
    [
        ("params", [1.0, MAX_ABS_VALUE], None),
        ("params", [1.0, -MAX_ABS_VALUE * 1.5], "beyond"),
        ("opt.0", [np.nan], "not finite"),
        ("published", [np.inf], "not finite"),
        # the round's accumulator holds weighted sums, larger than any one value
        ("round.acc", [MAX_ABS_VALUE * 1e6], None),
        ("round.acc", [np.inf], "not finite"),
        ("params", [], None),
    ],
)
def test_values_problem(key, values, problem):
    got = values_problem(key, np.asarray(values, np.float32))
    assert (got is None) if problem is None else (problem in got and key in got), got


@pytest.mark.parametrize(
    "learner",
    ["a", "us-west1-tpu-3", "host:1.worker_2", "x" * learner_ids.MAX_CHARS],
)
def test_learner_ids_that_pass(learner):
    assert learner_ids.learner_id_problem(learner) is None


@pytest.mark.parametrize(
    "learner", ["", "a b", "x" * (learner_ids.MAX_CHARS + 1), "é", "a/b", "a\nb", 7, None]
)
def test_learner_ids_refused_say_the_rule(learner):
    problem = learner_ids.learner_id_problem(learner)
    assert problem is not None and "learner_id" in problem
    if isinstance(learner, str):
        assert f"1-{learner_ids.MAX_CHARS}" in problem and learner_ids.CHARACTERS in problem
