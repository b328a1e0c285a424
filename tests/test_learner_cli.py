"""`atoll learner` refuses bad flags and bad data with a readable message, no traceback."""

from __future__ import annotations

import dataclasses

import pytest

from atoll.cli import main


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
        (("--shards", "atoll-{i}:7070"), "give --num-shards too"),
        (("--shards", "nohost"), "must be HOST:PORT"),
        (
            ("--shards", "a:1,b:2", "--fragments", "1"),
            "--fragments (1) must be at least the number of shards (2)",
        ),
        (
            ("--baseline", "--learner-index", "4", "--num-learners", "4"),
            "--learner-index must be in [0, 4)",
        ),
        (("--baseline", "--slowdown", "0.5"), "--slowdown must be >= 1"),
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


def test_multi_process_setting_from_flags_then_environment_then_tpu_slice():
    from atoll.learner.distributed import DistributedConfig, DistributedConfigError, config_from

    env = {
        "ATOLL_COORDINATOR": "learner-0.atoll:8476",
        "ATOLL_NUM_PROCESSES": "4",
        "ATOLL_PROCESS_ID": "3",
    }
    assert config_from(None, None, None, env) == DistributedConfig("learner-0.atoll:8476", 4, 3)
    assert config_from("10.0.0.1:9", 2, 1, env) == DistributedConfig("10.0.0.1:9", 2, 1), (
        "flags win"
    )
    assert config_from("10.0.0.1:9", 1, 0, {}) is None, "one process: nothing to join"
    assert config_from(None, None, None, {}) is None
    assert config_from(None, None, None, {"TPU_WORKER_HOSTNAMES": "slice-0-0.atoll"}) is None
    # A multi-host TPU slice: jax.distributed reads the TPU metadata (no flags needed).
    assert config_from(None, None, None, {"TPU_WORKER_HOSTNAMES": "h0,h1"}) == DistributedConfig()
    with pytest.raises(DistributedConfigError, match="ATOLL_NUM_PROCESSES"):
        config_from(None, None, None, {**env, "ATOLL_NUM_PROCESSES": "four"})


def test_a_shard_pattern_is_kept_to_reach_shards_added_later():
    import argparse

    from atoll.learner.main import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    pattern = parser.parse_args(["--shards", "atoll-syncer-{i}.s:7070", "--num-shards", "2"])
    cfg = config_from_args(pattern)
    assert cfg.shards == ("atoll-syncer-0.s:7070", "atoll-syncer-1.s:7070")
    assert cfg.shard_pattern == "atoll-syncer-{i}.s:7070"
    listed = config_from_args(parser.parse_args(["--shards", "a:1,b:2"]))
    assert listed.shards == ("a:1", "b:2") and listed.shard_pattern is None
