"""Tests for atoll/plan.py (the goodput simulator behind `atoll plan`): the published goodput table, sanity limits, config errors, CLI."""

import argparse
import dataclasses

import pytest

from atoll.plan import (
    REFERENCE,
    PlanConfig,
    PlanConfigError,
    add_arguments,
    main,
    simulate,
    table,
)

CHIPS = list(REFERENCE)
# The published data-parallel row is not reproducible within 3 points by a restart model with
# a fixed cost per interruption: its 600k and 2.4M points pull the restart time opposite ways
# (docs/plan.md). At the defaults they sit at +3.0 and -3.0; allow a little simulation noise.
DP_TOLERANCE = 3.5
ATOLL_TOLERANCE = 3.0


@pytest.fixture(scope="module")
def rows():
    return table(PlanConfig(), CHIPS)


def test_published_rows_at_defaults(rows):
    """If this fails after a model change, re-fit PlanConfig's defaults and update docs/plan.md."""
    for r in rows:
        ref = r["reference"]
        assert abs(100 * (r["dp"] - ref["dp"])) <= DP_TOLERANCE, (r["chips"], r["dp"], ref["dp"])
        assert abs(100 * (r["atoll"] - ref["atoll"])) <= ATOLL_TOLERANCE, (
            r["chips"],
            r["atoll"],
            ref["atoll"],
        )


def test_strategies_rank_as_published(rows):
    for r in rows:
        assert r["dp"] < r["elastic"] < r["atoll"]


def test_no_failures_leaves_only_straggler_loss():
    cfg = PlanConfig(chips=150_000, mtbi_years=1e9, duration_days=1)
    for strategy in ("dp", "elastic", "atoll"):
        out = simulate(cfg, strategy)
        assert out["interruptions"] == 0
        assert out["goodput"] == pytest.approx(out["straggler_efficiency"], rel=1e-9)
        assert 0.95 < out["straggler_efficiency"] < 1.0
    no_variance = dataclasses.replace(cfg, step_cv=0.0)
    assert simulate(no_variance, "dp")["goodput"] == pytest.approx(1.0)


def test_more_chips_lower_dp_goodput(rows):
    dp = [r["dp"] for r in rows]
    assert dp == sorted(dp, reverse=True)


def test_single_learner_is_a_single_job():
    # one learner that syncs every S s with nothing stalled, vs a job checkpointing every S s for free
    cfg = PlanConfig(
        chips=300_000,
        learners=1,
        fragments=1,
        sync_steps=20,
        step_s=0.5,
        rejoin_s=30.0,
        restart_s=30.0,
        checkpoint_cost_s=0.0,
        checkpoint_interval_s=10.0,
    )
    one, job = simulate(cfg, "atoll")["goodput"], simulate(cfg, "dp")["goodput"]
    assert one == pytest.approx(job, abs=0.01)
    assert one < simulate(dataclasses.replace(cfg, learners=8), "atoll")["goodput"] - 0.2


def test_deterministic_for_a_seed():
    cfg = PlanConfig(chips=600_000, duration_days=1)
    for strategy in ("dp", "elastic", "atoll"):
        assert simulate(cfg, strategy) == simulate(cfg, strategy)
    assert simulate(cfg, "dp") != simulate(dataclasses.replace(cfg, seed=1), "dp")


@pytest.mark.parametrize(
    "change, words",
    [
        ({"chips": 0}, "--chips"),
        ({"learners": 9, "chips": 8}, "--learners must be in [1, chips=8]"),
        ({"mtbi_years": -1.0}, "--mtbi-years"),
        ({"restart_s": float("nan")}, "--restart-s"),
        ({"step_cv": 2.0}, "--step-cv"),
        ({"slice_chips": 10, "chips": 8}, "--slice-chips"),
    ],
)
def test_bad_config_says_how_to_fix(change, words):
    with pytest.raises(PlanConfigError) as e:
        PlanConfig(**change)
    assert words in str(e.value)


def _parser():
    parser = argparse.ArgumentParser(prog="atoll plan")
    add_arguments(parser)
    return parser


@pytest.mark.parametrize(
    "argv", [["--learners", "0"], ["--chips", "many"], ["--mtbi-years", "0"], ["--no-such-flag"]]
)
def test_bad_flag_exits_with_a_message(argv, capsys):
    parser = _parser()
    with pytest.raises(SystemExit) as e:
        main(parser.parse_args(argv), parser)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_main_json_and_plot(tmp_path, capsys):
    import json

    parser = _parser()
    png = tmp_path / "g.png"
    args = parser.parse_args(
        ["--chips", "150000,300000", "--duration-days", "1", "--json", "--plot", str(png)]
    )
    assert main(args, parser) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["chips"] for r in out["rows"]] == [150_000, 300_000]
    assert out["assumptions"]["restart_s"] == PlanConfig().restart_s
    assert png.read_bytes()[:4] == b"\x89PNG"
