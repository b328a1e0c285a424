"""`atoll bench wan`'s arithmetic (time to a loss, the comparison) and its refusal off root."""

from __future__ import annotations

import argparse

import pytest

from atoll.bench import wan


def _evals(points):
    return [{"seconds": s, "tokens": 0, "eval_loss": l} for s, l in points]


def test_time_to_loss_interpolates_between_evaluations():
    curve = _evals([(0, 5.0), (10, 3.0), (20, 2.0)])
    assert wan.time_to_loss(curve, 4.0) == pytest.approx(5.0)
    assert wan.time_to_loss(curve, 2.0) == pytest.approx(20.0)
    assert wan.time_to_loss(curve, 1.9) is None
    assert wan.time_to_loss(curve, 6.0) == 0


def test_compare_takes_the_lowest_loss_both_reach_and_the_busiest_link():
    cfg = wan.WanBenchConfig(steps=100, evals=2)
    links = lambda mbit, nbytes: {  # noqa: E731
        "r0_up": {"bytes": nbytes, "mean_mbit_s": mbit, "peak_mbit_s": mbit},
        "r1_up": {"bytes": nbytes // 2, "mean_mbit_s": mbit / 2, "peak_mbit_s": mbit},
    }
    dp = {
        "eval": _evals([(0, 5.0), (100, 3.0), (200, 2.0)]),
        "links": links(4.0, 1_000_000),
        "steps": 100,
        "compute_step_s": 0.01,
        "all_reduce_over_compute": 25.0,
        "final_eval_loss": 2.0,
    }
    atoll = {
        "eval": _evals([(0, 5.0), (5, 3.0), (10, 2.05)]),
        "links": links(0.02, 10_000),
        "final_eval_loss": 2.05,
    }
    c = wan.compare(dp, atoll, cfg)
    assert c["equal_loss"] == 2.05
    assert c["atoll_seconds_to_equal_loss"] == pytest.approx(10.0)
    assert c["dp_seconds_to_equal_loss"] == pytest.approx(195.0)
    assert c["speedup_at_equal_loss"] == pytest.approx(19.5)
    assert c["dp_needed_mbit_s"] == pytest.approx(8.0)  # 10 kB per step in 10 ms
    assert c["bandwidth_ratio"] == pytest.approx(400.0)
    assert c["eval_loss_gap_pct_equal_tokens"] == pytest.approx(2.5)
    assert c["targets"]["speedup_at_equal_loss"]["met"]
    assert c["targets"]["bandwidth_ratio"]["met"]
    assert c["targets"]["eval_loss_gap_pct_equal_tokens"]["met"]


def test_off_root_it_refuses_with_the_reason(monkeypatch, capsys):
    monkeypatch.setattr("atoll.faults.wan.available", lambda: "WAN emulation needs root")
    p = argparse.ArgumentParser()
    wan.add_arguments(p)
    assert wan.main(p.parse_args(["--json"]), p) == 2
    assert "atoll bench wan: WAN emulation needs root" in capsys.readouterr().err


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="--regions must be >= 2"):
        wan.WanBenchConfig(regions=1)
    with pytest.raises(Exception, match="rate_mbit"):
        wan.WanBenchConfig(rate_mbit=0)
    with pytest.raises(ValueError, match="--period must be >= 1"):
        wan.WanBenchConfig(period=0)
    with pytest.raises(ValueError, match="--late-mix must be in"):
        wan.WanBenchConfig(late_mix=1.0)


def test_the_data_parallel_job_is_given_time_for_the_steps_asked():
    """The job's hang bound follows steps and links: a fixed 900 s had stopped a 4,000-step
    run at 20 Mbit/s (0.23 s a step) at step ~3,900."""
    from atoll.bench.wan import WanBenchConfig, dp_timeout

    assert dp_timeout(WanBenchConfig()) > 1.5 * 534  # the defaults' measured 534 s
    assert dp_timeout(WanBenchConfig(steps=4000, rate_mbit=20)) > 1.5 * 4000 * 0.23
    assert dp_timeout(WanBenchConfig(steps=4000)) > 2 * dp_timeout(WanBenchConfig(steps=1000))
