"""`atoll learner` refuses bad flags and bad data with a readable message, no traceback."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re

import pytest

from atoll.cli import main
from atoll.learner.config import Checkpointing, LearnerConfig, LearnerConfigError, SyncConfig
from atoll.learner.distributed import DistributedConfig
from atoll.learner.trainer.main import add_arguments, config_from_args
from atoll.wire.codec import Codec


@dataclasses.dataclass
class Result:
    returncode: int
    stderr: str


@pytest.fixture
def run(capsys):
    def go(*args: str) -> Result:
        try:
            code = main(["learner", *args])
        except SystemExit as e:  # argparse's way out
            code = e.code
        return Result(code, capsys.readouterr().err)

    return go


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "--shards is required"),
        (
            ("--shards", "127.0.0.1:1", "--overlap", "16", "--period", "16"),
            "--overlap must be in [0, --period=16)",
        ),
        # H, τ, α and the patience are checked by SyncConfig, and named here as flags
        (("--shards", "127.0.0.1:1", "--period", "0"), "--period must be at least 1, got 0"),
        (("--shards", "127.0.0.1:1", "--mix", "1"), "--mix must be in [0, 1), got 1.0"),
        (("--shards", "127.0.0.1:1", "--late-mix", "-0.1"), "--late-mix must be in [0, 1)"),
        (("--shards", "127.0.0.1:1", "--sync-patience", "0"), "--sync-patience must be > 0"),
        (("--baseline", "--deadline", "0"), "--deadline must be > 0 seconds"),
        (("--baseline", "--lease-exit-wait", "-1"), "--lease-exit-wait must be >= 0 seconds"),
        (("--shards", "atoll-{i}:7070"), "give --num-shards too"),
        (("--shards", "nohost"), "must be HOST:PORT"),
        (
            ("--shards", "a:1,b:2", "--fragments", "1"),
            "--fragments (1) must be at least the number of shards (2)",
        ),
        (
            ("--baseline", "--learner-index", "4", "--num-learners", "4"),
            "--learner-index must be in [0, --num-learners=4), got 4",
        ),
        (("--baseline", "--slowdown", "0.5"), "--slowdown must be >= 1"),
        (("--baseline", "--fsdp", "-2"), "--fsdp must be 1 (replicated), a number of devices"),
        (("--baseline", "--fsdp", "half"), "argument --fsdp: 'half' is not a number of devices"),
        (("--baseline", "--checkpoint-dir", "ck"), "the --baseline trains alone and keeps no"),
        (("--baseline", "--metrics-port", "99999"), "--metrics-port must be in 1-65535"),
        (("--baseline", "--metrics-port", "-1"), "--metrics-port must be in 1-65535"),
        (("--shards", "127.0.0.1:99999"), "'127.0.0.1:99999': the port must be in 1-65535"),
        (("--shards", "127.0.0.1:0"), "'127.0.0.1:0': the port must be in 1-65535"),
        (("--shards", "127.0.0.1:7070,127.0.0.1:x"), "'127.0.0.1:x': the port must be in 1-65535"),
        (
            ("--shards", "atoll-{i}:70700", "--num-shards", "2"),
            "'atoll-0:70700': the port must be in 1-65535",
        ),
    ],
)
def test_bad_flags_are_refused_with_a_message(run, args, message):
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_missing_data_and_unknown_preset_are_readable_errors(run, tmp_path):
    result = run("--baseline", "--data", str(tmp_path / "nothing-here"), "--steps", "1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "atoll learner: error:" in result.stderr and "nothing-here" in result.stderr
    result = run("--baseline", "--preset", "huge", "--steps", "1", "--data", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr and "huge" in result.stderr


@pytest.mark.parametrize(
    "flags, wanted",
    [
        (["--coordinator", "127.0.0.1:1234"], "go together"),
        (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], "HOST:PORT"),
        (
            ["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
            "--process-id must be in [0, 2)",
        ),
        (["--coordinator", "127.0.0.1:0", "--num-processes", "2", "--process-id", "0"], "1-65535"),
    ],
)
def test_bad_multi_process_flags_are_readable_errors(run, tmp_path, flags, wanted):
    result = run(
        "--shards",
        "127.0.0.1:1",
        "--steps",
        "1",
        "--status-file",
        str(tmp_path / "s.jsonl"),
        *flags,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert wanted in result.stderr
    assert not (tmp_path / "s.jsonl").exists(), "it stopped before doing anything"


def test_multi_process_setting_from_flags_then_environment_then_tpu_slice(parse, monkeypatch):
    env = {
        "ATOLL_COORDINATOR": "learner-0.atoll:8476",
        "ATOLL_NUM_PROCESSES": "4",
        "ATOLL_PROCESS_ID": "3",
    }
    flags = ["--coordinator", "10.0.0.1:9", "--num-processes", "2", "--process-id", "1"]
    assert parse(["--baseline"]).distributed is None, "nothing given: one process"
    one = ["--coordinator", "10.0.0.1:9", "--num-processes", "1", "--process-id", "0"]
    assert parse(["--baseline", *one]).distributed is None, "one process: nothing to join"
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "slice-0-0.atoll")
    assert parse(["--baseline"]).distributed is None
    # A multi-host TPU slice: jax.distributed reads the TPU metadata (no flags needed).
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "h0,h1")
    assert parse(["--baseline"]).distributed == DistributedConfig()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert parse(["--baseline"]).distributed == DistributedConfig("learner-0.atoll:8476", 4, 3)
    assert parse(["--baseline", *flags]).distributed == DistributedConfig("10.0.0.1:9", 2, 1), (
        "flags win"
    )


def test_a_malformed_environment_variable_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setenv("ATOLL_NUM_PROCESSES", "four")
    with pytest.raises(SystemExit) as exit:
        main(["learner", "--baseline"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "Traceback" not in err
    assert (
        "argument --num-processes: environment variable ATOLL_NUM_PROCESSES='four': "
        "not a valid int" in err
    )


def test_a_shard_pattern_is_kept_to_reach_shards_added_later():
    import argparse

    from atoll.learner.trainer.main import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    pattern = parser.parse_args(["--shards", "atoll-syncer-{i}.s:7070", "--num-shards", "2"])
    cfg = config_from_args(pattern)
    assert cfg.shards == ("atoll-syncer-0.s:7070", "atoll-syncer-1.s:7070")
    assert cfg.shard_pattern == "atoll-syncer-{i}.s:7070"
    listed = config_from_args(parser.parse_args(["--shards", "a:1,b:2"]))
    assert listed.shards == ("a:1", "b:2") and listed.shard_pattern is None


@pytest.fixture
def parse(monkeypatch):
    """`atoll learner`'s flags to a LearnerConfig, in an environment with no ATOLL_* or
    TPU variables (they would give the flags left out other defaults)."""
    for name in list(os.environ):
        if name.startswith(("ATOLL_", "TPU_")):
            monkeypatch.delenv(name)

    def go(args: list[str]) -> LearnerConfig:
        parser = argparse.ArgumentParser()
        add_arguments(parser)  # now: flags read their environment defaults here
        return config_from_args(parser.parse_args(args))

    return go


def _configs(tmp: pathlib.Path) -> dict[str, LearnerConfig]:
    for name in ("ca.pem", "cert.pem", "key.pem", "token"):
        (tmp / name).write_text("x")
    (tmp / "tokens").mkdir()
    shards = ("127.0.0.1:7070", "127.0.0.1:7071")
    plain = LearnerConfig(shards=shards, learner_id="island-a")
    return {
        "defaults": plain,
        "baseline": LearnerConfig(shards=(), learner_id="b", baseline=True, num_learners=4),
        "settings": dataclasses.replace(
            plain,
            learner_index=2,
            num_learners=3,
            preset="tiny",
            batch_size=8,
            steps=7,
            lr=1e-4,
            warmup=3,
            sync=SyncConfig(
                period=5,
                overlap=0,
                mix=0.25,
                codec=Codec.FP32,
                patience=1e9,
                wait_for_rounds=True,
                deadline=0.5,
            ),
            fragments=6,
            seed=11,
            eval_every=0,
            eval_batches=3,
            slowdown=2.5,
            fsdp=0,
            metrics_port=0,
            lease_exit_wait=0.0,
            progress=False,
            checkpoint_every=0,
        ),
        "paths": dataclasses.replace(
            plain,
            data=tmp / "corpus.txt",
            cache_dir=tmp / "cache",
            status_file=tmp / "{id}.jsonl",
            push_log=tmp / "{id}.pushes.jsonl",
            compile_cache=tmp / "xla",
            checkpoint_dir=tmp / "ckpt",
        ),
        "tls and token": dataclasses.replace(
            plain,
            tls_ca=tmp / "ca.pem",
            tls_cert=tmp / "cert.pem",
            tls_key=tmp / "key.pem",
            token_file=tmp / "token",
        ),
        "standby": dataclasses.replace(
            plain,
            standby=True,
            checkpoint_dir=tmp / "ckpt",
            token_file=tmp / "tokens" / "{id}",
            status_file=tmp / "{id}.jsonl",
        ),
        "multihost and a shard pattern": dataclasses.replace(
            plain,
            shards=("atoll-syncer-0.s:7070", "atoll-syncer-1.s:7070", "atoll-syncer-2.s:7070"),
            shard_pattern="atoll-syncer-{i}.s:7070",
            distributed=DistributedConfig("10.0.0.2:8476", 2, 1),
            fsdp=4,
        ),
    }


@pytest.mark.parametrize(
    "name",
    [
        "defaults",
        "baseline",
        "settings",
        "paths",
        "tls and token",
        "standby",
        "multihost and a shard pattern",
    ],
)
def test_a_config_renders_the_command_line_that_gives_it_back(parse, tmp_path, name):
    cfg = _configs(tmp_path)[name]
    assert parse(cfg.to_args()) == cfg


def test_every_learner_setting_has_a_flag_to_render():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    dests = {a.dest.partition(".")[0] for a in parser._actions}  # nested: FIELD.NAME
    spelled_apart = {"shard_pattern": "shards"}  # --shards with a pattern gives both
    for f in dataclasses.fields(LearnerConfig):
        assert spelled_apart.get(f.name, f.name) in dests, f"LearnerConfig.{f.name} has no flag"


# `atoll learner --help` before its flags were generated: (flag, default shown, env)
HELP = [
    ("--shards", None, "ATOLL_SHARDS"),
    ("--num-shards", None, None),
    ("--learner-id", "the host name", "ATOLL_LEARNER_ID"),
    ("--learner-index", "0", "ATOLL_LEARNER_INDEX"),
    ("--num-learners", "1", None),
    ("--token-file", None, "ATOLL_TOKEN_FILE"),
    ("--tls-ca", None, None),
    ("--tls-cert", None, None),
    ("--tls-key", None, None),
    ("--preset", "small", None),
    ("--batch-size", "16", None),
    ("--steps", "200", None),
    ("--lr", "0.003", None),
    ("--warmup", "20", None),
    ("--seed", "0", None),
    ("--data", None, None),
    ("--cache-dir", "~/.cache/atoll", None),
    ("--eval-every", "50", None),
    ("--eval-batches", "8", None),
    ("--slowdown", "1.0", None),
    ("--baseline", None, None),
    ("--fsdp", "1", None),
    ("--period", "32", None),
    ("--overlap", "1", None),
    ("--mix", "0.0", None),
    ("--late-mix", "0.0", None),
    ("--fragments", "4", None),
    ("--codec", "int4", None),
    ("--sync-patience", "30.0", None),
    ("--wait-for-rounds", None, None),
    ("--deadline", "60.0", None),
    ("--join-timeout", "300.0", None),
    ("--lease-exit-wait", "10.0", None),
    ("--status-file", None, None),
    ("--push-log", None, None),
    ("--compile-cache", None, "ATOLL_COMPILE_CACHE"),
    ("--metrics-port", None, None),
    ("--quiet", None, None),
    ("--checkpoint-dir", None, "ATOLL_CHECKPOINT_DIR"),
    ("--checkpoint-every", "50", "ATOLL_CHECKPOINT_EVERY"),
    ("--standby", None, None),
    ("--coordinator", None, "ATOLL_COORDINATOR"),
    ("--num-processes", None, "ATOLL_NUM_PROCESSES"),
    ("--process-id", None, "ATOLL_PROCESS_ID"),
]


def test_help_lists_the_flags_defaults_and_variables_it_always_did(monkeypatch, capsys):
    """The flags, help's defaults and the ATOLL_* variables that scripts and the k8s
    manifests rely on, as `atoll learner --help` gave them when they were written by hand."""
    for name in list(os.environ):
        if name.startswith(("ATOLL_", "TPU_")):
            monkeypatch.delenv(name)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    listed = []
    for action in parser._actions[1:]:  # after -h
        shown = re.search(r"\(default ([^)]*)\)", action.help or "")
        env = re.search(r"\(env (ATOLL_\w+)\)", action.help or "")
        listed.append((action.option_strings[0], shown and shown[1], env and env[1]))
    assert sorted(listed) == sorted(HELP)
    with pytest.raises(SystemExit) as exit:
        main(["learner", "--help"])
    text = capsys.readouterr().out
    assert exit.value.code == 0 and all(f"  {name} " in text for name, _, _ in HELP)
    assert "multi-host learners:" in text and "sync:" in text


def test_an_fsdp_the_devices_cannot_take_is_a_readable_error(run, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    # one process with one CPU device here: params cannot be split 2 ways
    result = run("--baseline", "--fsdp", "2", "--steps", "1", "--data", str(corpus))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        "atoll learner: error: --fsdp 2 does not divide the island's 1 devices: use one of 1"
        in result.stderr
    )


def test_fsdp_all_is_every_device():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--fsdp", "all"]).fsdp == 0
    assert parser.parse_args([]).fsdp == 1 == LearnerConfig(("a:1",), "x").fsdp


def test_to_args_spells_out_defaults_the_environment_could_change(parse, monkeypatch):
    cfg = LearnerConfig(shards=("127.0.0.1:7070",), learner_id="a")
    monkeypatch.setenv("ATOLL_CHECKPOINT_EVERY", "7")
    monkeypatch.setenv("ATOLL_LEARNER_INDEX", "3")
    monkeypatch.setenv("ATOLL_SHARDS", "127.0.0.1:9999")
    assert parse(cfg.to_args()) == cfg
    read = parse(["--learner-id", "a", "--num-learners", "4"])
    assert (read.checkpoint_every, read.learner_index, read.shards) == (7, 3, ("127.0.0.1:9999",))


def test_a_sync_setting_is_checked_once_by_the_synchronizer(monkeypatch):
    made: list[SyncConfig] = []
    check = SyncConfig.__post_init__
    monkeypatch.setattr(SyncConfig, "__post_init__", lambda s: (made.append(s), check(s))[1])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(
        parser.parse_args(["--shards", "h:1", "--period", "8", "--overlap", "3"])
    )
    assert made == [cfg.sync] and (cfg.sync.period, cfg.sync.overlap) == (8, 3)
    with pytest.raises(LearnerConfigError, match=r"--overlap must be in \[0, --period=8\), got 8"):
        config_from_args(parser.parse_args(["--shards", "h:1", "--period", "8", "--overlap", "8"]))


def test_checkpoint_settings_are_checked_by_checkpointing_in_flags_words(tmp_path):
    cfg = LearnerConfig(shards=("127.0.0.1:7070",), learner_id="a", checkpoint_dir=tmp_path)
    assert cfg.checkpoint == Checkpointing(tmp_path, every=cfg.checkpoint_every)
    refused = r"--checkpoint-every must be >= 0 steps, got -1"
    with pytest.raises(LearnerConfigError, match=refused):
        dataclasses.replace(cfg, checkpoint_every=-1)
    with pytest.raises(LearnerConfigError, match=refused):  # refused with no directory too
        dataclasses.replace(cfg, checkpoint_dir=None, checkpoint_every=-1)
    (tmp_path / "file").write_text("")
    with pytest.raises(LearnerConfigError, match=r"--checkpoint-dir \S+/file: not a directory"):
        dataclasses.replace(cfg, checkpoint_dir=tmp_path / "file")


@pytest.mark.parametrize(
    "reason, status", [("SIGTERM", 143), ("SIGINT", 130), ("a stop request", 1), (None, 1)]
)
def test_a_stopped_learner_exits_with_128_plus_its_signal(reason, status):
    from atoll.learner.stopping import Stop
    from atoll.learner.trainer.loop import stopped_status

    stop = Stop()
    if reason is not None:
        stop.set(reason)
    assert stopped_status(stop) == status
