"""`atoll up`'s config and run directory, and its report's arithmetic, without processes."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from atoll.learner.trainer.main import add_arguments, config_from_args
from atoll.local.config import (
    UpConfig,
    UpConfigError,
    baseline_spec,
    learner_specs,
    prepare_run_dir,
)
from atoll.local.processes import LearnerProcess, Standby, child_env
from atoll.local.progress import lives
from atoll.local.report import build_report, learner_summary, write_report
from atoll.local.up import summary


def test_the_default_run():
    cfg = UpConfig()
    assert (cfg.shards, cfg.learners, cfg.preset, cfg.quorum) == (2, 4, "small", 2)
    assert cfg.slowdown == (1.0, 1.0, 2.0, 2.0)  # the second half an older generation
    specs = learner_specs(cfg)
    assert [s.steps for s in specs] == [200, 200, 100, 100]  # 2x slower, half the steps: same time
    assert [s.name for s in specs] == ["learner-0", "learner-1", "learner-2", "learner-3"]
    base = baseline_spec(cfg)
    # as many tokens as the learners together, on the same held-out rows (M x batch, 1/M of the batches)
    assert base.steps * cfg.learners == sum(s.steps for s in specs)
    assert base.eval_batches * cfg.learners == cfg.eval_batches
    assert [s.steps for s in learner_specs(UpConfig(same_time=False))] == [200] * 4


def test_defaults_follow_the_learner_count():
    cfg = UpConfig(learners=3, eval_batches=8)
    assert cfg.slowdown == (1.0, 1.0, 2.0) and cfg.quorum == 2 and cfg.eval_batches == 9
    assert UpConfig(learners=1).quorum == 1 and UpConfig(learners=1).slowdown == (1.0,)
    assert UpConfig(learners=4, slowdown=(3.0,)).slowdown == (
        3.0,
        3.0,
        3.0,
        3.0,
    )  # one factor: every learner


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(shards=4, fragments=2), "--fragments (2) must be at least the number of shards (4)"),
        (dict(slowdown=(0.5,)), "--slowdown factors must be >= 1"),
        (dict(learners=2, slowdown=(1, 1, 2)), "--slowdown lists 3 factors for 2 learners"),
        (
            dict(learners=4, slowdown=(1, 2)),
            "--slowdown lists 2 factors for 4 learners: give one factor for all",
        ),
        # the learners' settings, checked by LearnerConfig as `atoll learner` would
        (dict(period=4, overlap=4), "--overlap must be in [0, --period=4)"),
        (dict(period=0), "--period must be at least 1"),
        (dict(sync_patience=0), "--sync-patience must be > 0"),
        (dict(checkpoint_every=-1), "--checkpoint-every must be >= 0"),
        (dict(batch_size=0), "--batch-size must be >= 1"),
        (dict(learners=2, quorum=3), "--quorum must be at most --learners=2, got 3"),
        # 0 is no longer "the default": the shard's own check refuses it
        (dict(learners=2, quorum=0), "--quorum=0: need an int >= 1"),
        (dict(preset="huge"), "unknown --preset 'huge'"),
    ],
)
def test_settings_that_cannot_work_say_how_to_fix_them(fields, message):
    with pytest.raises(
        UpConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        UpConfig(**fields)


def test_each_learner_runs_the_command_line_of_its_config(tmp_path, monkeypatch):
    monkeypatch.delenv("ATOLL_COMPILE_CACHE", raising=False)  # the run folder's own cache
    run = tmp_path / "run"
    cfg, _ = prepare_run_dir(
        run,
        {"preset": "tiny", "learners": 2, "period": 8, "codec": "fp32", "wait_for_rounds": True},
    )
    addresses = ["127.0.0.1:7070", "127.0.0.1:7071"]
    learner = LearnerProcess(learner_specs(cfg)[1], cfg, run, addresses)
    c = learner.config
    assert (c.learner_id, c.learner_index, c.num_learners, c.shards) == (
        "learner-1",
        1,
        2,
        tuple(addresses),
    )
    assert (c.sync.period, c.sync.codec.name, c.sync.wait_for_rounds, c.steps) == (
        8,
        "FP32",
        True,
        100,
    )
    assert (c.status_file, c.push_log) == (learner.status.path, learner.push_log)
    assert (c.checkpoint_dir, c.compile_cache) == (run / "checkpoints", run / "compile-cache")
    for name in [n for n in os.environ if n.startswith(("ATOLL_", "TPU_"))]:
        monkeypatch.delenv(name)  # defaults of flags left out (a token file, a TPU slice)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(c.to_args())) == c
    baseline = LearnerProcess(baseline_spec(cfg), cfg, run, []).config
    assert baseline.baseline and baseline.shards == () and not baseline.sync.wait_for_rounds
    assert baseline.push_log is None and baseline.checkpoint_dir is None
    # the variable that defaults --checkpoint-dir does not reach the children: the
    # baseline, asked for none, would be refused, and a learner given none would keep them
    monkeypatch.setenv("ATOLL_CHECKPOINT_DIR", str(tmp_path / "elsewhere"))
    assert "ATOLL_CHECKPOINT_DIR" not in child_env(single_thread=False)
    assert os.environ["ATOLL_CHECKPOINT_DIR"] == str(tmp_path / "elsewhere")  # ours is kept
    standby = Standby("standby-0", learner_specs(cfg)[0], cfg, run, addresses)
    assert standby.args[:3] == ["learner", "--learner-id", "standby-0"]
    assert "--standby" in standby.args and str(run / "learners" / "{id}.jsonl") in standby.args


def test_a_run_directory_resumes_only_with_the_same_settings(tmp_path):
    run = tmp_path / "run"
    cfg, resuming = prepare_run_dir(run, {"preset": "tiny", "steps": 30})
    assert not resuming and cfg.steps == 30
    assert json.loads((run / "config.json").read_text())["steps"] == 30
    again, resuming = prepare_run_dir(
        run, {"steps": 30, "slowdown": (1, 1, 2, 2)}, resume=True
    )  # same, spelled out
    assert resuming and again == cfg
    with pytest.raises(
        UpConfigError, match=r"--steps 40 \(the run has 30\).*--learners 2 \(the run has 4\)"
    ):
        prepare_run_dir(run, {"steps": 40, "learners": 2}, resume=True)
    with pytest.raises(UpConfigError, match="already holds a run: resume it with"):
        prepare_run_dir(run, {"steps": 30})  # a new run where one is
    (run / "report.json").write_text(json.dumps({"complete": True}))
    with pytest.raises(UpConfigError, match="holds a finished run"):
        prepare_run_dir(run, {}, resume=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UpConfigError, match="not an atoll run directory"):
        prepare_run_dir(tmp_path / "other", {})
    with pytest.raises(UpConfigError, match="holds no atoll run"):
        prepare_run_dir(tmp_path / "other", {}, resume=True)


def test_a_run_directory_is_made_only_where_asked(tmp_path):
    with pytest.raises(UpConfigError, match="does not exist: --run-dir resumes a run"):
        prepare_run_dir(tmp_path / "gone", {}, resume=True)
    with pytest.raises(UpConfigError, match="does not exist: make it first"):
        prepare_run_dir(tmp_path / "a" / "run", {}, parents=False)
    assert not any(tmp_path.iterdir())
    (tmp_path / "empty").mkdir()
    _, resuming = prepare_run_dir(tmp_path / "empty", {"preset": "tiny"}, parents=False)
    assert not resuming and (tmp_path / "empty" / "config.json").is_file()
    prepare_run_dir(tmp_path / "runs" / "20261125-000000", {})  # the default: runs/ is made
    assert (tmp_path / "runs" / "20261125-000000" / "shards").is_dir()


def _record(t, state, step, **kw):
    return {
        "learner": "l",
        "params": 400,
        "slowdown": 1.0,
        "time": t,
        "state": state,
        "step": step,
        "tokens": step * 10,
        **kw,
    }


def _synced(t, step, sent, received, pushes, adopted, version, **kw):
    return _record(
        t,
        "training",
        step,
        loss=3.0,
        tokens_per_s=10.0,
        bytes_sent=sent,
        bytes_received=received,
        pushes=pushes,
        refused=0,
        resyncs=0,
        adopted=adopted,
        blocked_seconds=0.5,
        version=version,
        lag=1,
        **kw,
    )


# two lives: the second process restarts its counters; join traffic (first record) is not sync traffic
RECORDS = [
    _record(0, "joining", 0),
    _synced(1, 1, 1600, 1600, 0, 0, 0),
    _synced(2, 2, 1800, 1900, 1, 1, 1),
    _record(3, "joining", 2),
    _synced(4, 3, 0, 1600, 0, 0, 3),
    _synced(5, 4, 100, 1750, 1, 1, 4, eval_loss=2.5),
    _record(6, "done", 4, eval_loss=2.4),
]


def test_a_learner_summary_adds_up_its_lives():
    assert [len(life) for life in lives(RECORDS)] == [3, 4]
    s = learner_summary(RECORDS, num_fragments=4, target_steps=4)
    assert (s["steps"], s["tokens"], s["restarts"], s["state"]) == (4, 40, 1, "done")
    assert (s["bytes_sent"], s["bytes_received"]) == (1900, 3650)  # everything, both lives
    assert (s["push_bytes"], s["pull_bytes"], s["pushes"], s["adopted"]) == (300, 450, 2, 2)
    assert s["push_bits_per_param"] == pytest.approx(
        8 * 300 / (2 * 100)
    )  # 2 pushes of 400/4 params
    assert s["pull_bits_per_param"] == pytest.approx(8 * 450 / (2 * 100))
    assert s["blocked_seconds"] == 1.0 and s["step_seconds"] == pytest.approx(4 * 10 / 10.0)
    assert s["final_eval_loss"] == 2.4 and s["first_train_loss"] == 3.0


def test_the_report_and_its_plots(tmp_path):
    cfg, _ = prepare_run_dir(
        tmp_path / "run", {"learners": 1, "preset": "tiny", "steps": 4, "fragments": 4}
    )
    run = tmp_path / "run"
    (run / "learners" / "learner-0.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in RECORDS) + '{"cut'
    )
    (run / "sessions.jsonl").write_text(
        json.dumps(
            {"start": 0, "end": 8, "outcome": "finished", "learners_start": 0, "learners_end": 8}
        )
        + "\n"
    )
    report = write_report(
        run, cfg, learner_specs(cfg), global_eval={"eval_loss": 2.3, "versions": {}}
    )
    assert report["complete"] and report["wall_seconds"] == 8
    g = report["global"]
    assert g["eval_loss"] == 2.3 and g["tokens"] == 40
    assert g["goodput"] == pytest.approx(4.0 / 8)  # 4 s of steps in an 8 s learner phase
    assert g["bytes_reduction_vs_data_parallel"] is None  # one learner: data parallel moves nothing
    assert json.loads((run / "report.json").read_text()) == report
    for name in ("loss.png", "wire.png", "lag.png"):
        assert (run / name).read_bytes()[:4] == b"\x89PNG"
    interrupted = build_report(run, cfg, learner_specs(cfg), interrupted="SIGINT")
    assert not interrupted["complete"] and interrupted["interrupted"] == "SIGINT"
    assert "rounds still open" not in summary(report, run)
    held = write_report(
        run,
        cfg,
        learner_specs(cfg),
        global_eval={"eval_loss": 2.3, "versions": {}, "open_rounds": {2: 1}},
    )
    assert "read with rounds still open" in summary(held, run)
    assert "fragment 2: 1 pushes" in summary(held, run)


def test_runs_share_the_compile_cache_atoll_compile_cache_names(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOLL_COMPILE_CACHE", str(tmp_path / "shared"))
    run = tmp_path / "run"
    cfg, _ = prepare_run_dir(run, {"preset": "tiny", "learners": 2})
    learner = LearnerProcess(learner_specs(cfg)[0], cfg, run, ["127.0.0.1:7070"])
    assert learner.config.compile_cache == tmp_path / "shared"
    assert "--compile-cache" in learner.config.to_args()
