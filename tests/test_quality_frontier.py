"""`atoll bench quality`'s runs and summary, on reports made up here (no processes)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from atoll.bench import quality
from atoll.faults.chaos import lockstep_config
from atoll.local.config import UpConfig

PARAMS = 1000
STEPS = 100


def _report(name: str, loss: float, sent: int, *, baseline: float | None = None) -> dict:
    """An `atoll up` report with what `run_summary` reads: two learners, two fragments."""
    learner = {"params": PARAMS, "steps": STEPS, "bytes_sent": sent, "bytes_received": 2 * sent}
    return {
        "global": {
            "eval_loss": loss,
            "versions": {"1": 11, "0": 9},
            "outer_steps_per_period": 1.1,
            "push_bits_per_param": 4.1,
            "pull_bits_per_param": 4.4,
            "tokens": 2 * STEPS * 64,
        },
        "learners": {"learner-0": learner, "learner-1": learner},
        "baseline": None
        if baseline is None
        else {"final_eval_loss": baseline, "tokens": 2 * STEPS * 64},
        "config": {"period": 10},
        "stalls": 3 if name.startswith("sync") else 0,
        "wall_seconds": 5.0,
        "run_dir": f"/runs/{name}",
    }


def _reports(periods, seeds, losses, fp32=True):
    """reports[seed][name] with eval loss losses[(method, h, seed)], baseline 2.0 + seed."""
    methods = quality.METHODS + (quality.FP32_METHODS if fp32 else ())
    return {
        s: {
            f"{m}-h{h}": _report(
                f"{m}-h{h}",
                losses[(m, h, s)],
                sent=1000 * h,
                baseline=2.0 + s if (m, h) == ("atoll", periods[0]) else None,
            )
            for m, h in itertools.product(methods, periods)
        }
        for s in seeds
    }


def test_the_summary_is_computed_from_the_runs():
    periods, seeds = (8, 16), (0, 1)
    # every run a loss of its own: gap = 100 (loss / baseline - 1)
    losses = {}
    for i, (m, h, s) in enumerate(
        itertools.product(quality.METHODS + quality.FP32_METHODS, periods, seeds)
    ):
        losses[(m, h, s)] = (2.0 + s) * (1 + (i + 1) / 1000)
    r = quality.summarise(_reports(periods, seeds, losses), periods, seeds)

    def gap(m, h, s):
        return 100 * (losses[(m, h, s)] / (2.0 + s) - 1)

    assert r["baseline_eval_loss"] == {"0": 2.0, "1": 3.0}
    for m, h, s in losses:
        run = r["runs"][str(h)][m][str(s)]
        assert run["eval_loss"] == losses[(m, h, s)]
        assert run["gap_pct"] == pytest.approx(gap(m, h, s), abs=1e-3)
        assert run["outer_steps_per_fragment"] == [9, 11]  # by fragment
        assert run["periods_per_learner"] == STEPS / 10
        # DP: one fp32 gradient per learner step, against the bytes the learners sent
        assert run["bandwidth_reduction"] == round(2 * STEPS * PARAMS * 4 / (2 * 1000 * h), 1)
        assert run["stalls"] == (3 if m.startswith("sync") else 0)
    for h in periods:
        diffs = [gap("atoll", h, s) - gap("sync", h, s) for s in seeds]
        got = r["async_minus_sync_pct"][str(h)]
        assert got["mean"] == pytest.approx(sum(diffs) / 2, abs=1e-3)
        assert got["seeds"] == pytest.approx(diffs, abs=1e-3)
        assert got["min"] <= got["mean"] <= got["max"]
        for m in ("atoll", "sync"):
            cost = r["int4_cost_pct"][str(h)][m]
            want = [gap(m, h, s) - gap(f"{m}_fp32", h, s) for s in seeds]
            assert cost["seeds"] == pytest.approx(want, abs=1e-3)
        mixed = r["mixed_speed_gap_pct"][str(h)]
        assert mixed["seeds"] == pytest.approx([gap("mixed", h, s) for s in seeds], abs=1e-3)
        assert set(r["frontier"][str(h)]) == set(quality.METHODS + quality.FP32_METHODS)
    # targets only at the H the issue sets them for: none of them measured here
    assert set(r["targets"]) == {"async_minus_sync_pct_h8", "async_minus_sync_pct_h16"}


def test_targets_follow_the_issue_at_h32_and_h64():
    periods, seeds = (32, 64), (0,)
    losses = {k: 2.0 * 1.015 for k in itertools.product(quality.METHODS, periods, seeds)}
    losses[("sync", 32, 0)] = 2.0 * 1.025  # atoll 1 point better than sync at H = 32
    r = quality.summarise(_reports(periods, seeds, losses, fp32=False), periods, seeds)
    t = r["targets"]
    assert "int4_cost_pct" not in r  # no fp32 runs
    assert t["async_minus_sync_pct_h32"] == {"want": "mean <= 0", "got": -1.0, "met": True}
    assert t["async_minus_sync_pct_h64"]["met"]  # equal: <= 0
    assert t["gap_pct_h32"] == {"want": "every seed <= 1.0", "got": 1.5, "met": False}
    assert t["gap_pct_h64"] == {"want": "mean <= 2.0", "got": 1.5, "met": True}
    assert t["mixed_speed_gap_pct_h32"] == {"want": "mean <= 1.0", "got": 1.5, "met": False}
    assert set(t) == {
        "async_minus_sync_pct_h32",
        "async_minus_sync_pct_h64",
        "gap_pct_h32",
        "gap_pct_h64",
        "mixed_speed_gap_pct_h32",
    }


def test_each_seed_runs_every_method_at_every_period_and_the_baseline_once():
    cfg = UpConfig(learners=4, preset="tiny", steps=100, slowdown=(1.0,), seed=3)
    runs = quality.run_configs(cfg, (8, 16), fp32=True, slowdown=3.0)
    assert set(runs) == {
        f"{m}-h{h}" for m in ("atoll", "sync", "mixed", "atoll_fp32", "sync_fp32") for h in (8, 16)
    }
    assert [n for n, c in runs.items() if c.baseline] == ["atoll-h8"]
    for name, c in runs.items():
        h = int(name.split("-h")[1])
        assert c.period == h and c.seed == 3 and c.steps == 100
        assert c.codec == ("fp32" if "fp32" in name else "int4")
    # atoll at its defaults; synchronous DiLoCo: the lockstep harness, Nesterov every round
    atoll = runs["atoll-h16"]
    assert (atoll.quorum, atoll.momentum_delay, atoll.wait_for_rounds) == (2, 2, False)
    sync = runs["sync-h16"]
    assert sync == dataclasses.replace(
        lockstep_config(atoll),
        momentum_delay=1,
        sync_patience=quality.SYNC_PATIENCE,
    )
    assert (sync.fragments, sync.shards) == (atoll.fragments, atoll.shards)  # the bench's P
    assert (sync.quorum, sync.grace_factor, sync.wait_for_rounds) == (4, 0.0, True)
    mixed = runs["mixed-h8"]
    assert mixed.slowdown == (1.0, 1.0, 3.0, 3.0) and not mixed.same_time
    assert mixed.quorum == 2 and mixed.momentum_delay == 2


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--periods", "32,x"], "comma-separated whole numbers"),
        (["--periods", "0,32"], "periods must be at least 1"),
        (["--periods", "32,32"], "names one value twice"),
        (["--seeds", "0,,1"], "comma-separated whole numbers"),
        (["--slowdown", "0.5"], ">= 1"),
        (["--periods", "1"], "overlap"),  # τ = 1 needs H > 1
    ],
)
def test_bad_flags_are_refused_with_a_reason(flags, message, capsys):
    from atoll import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "quality", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_work_dir_with_files_is_refused_before_any_run(tmp_path, capsys):
    from atoll import cli

    (tmp_path / "stray").write_text("x")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "quality", "--work-dir", str(tmp_path)])
    assert e.value.code == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["stray"]
