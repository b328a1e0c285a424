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


@pytest.mark.parametrize("args, message", [
    ((), "--shards is required"),
    (("--shards", "127.0.0.1:1", "--overlap", "16", "--period", "16"), "--overlap must be in [0, --period=16)"),
    (("--shards", "atoll-{i}:7070"), "give --num-shards too"),
    (("--shards", "nohost"), "must be HOST:PORT"),
    (("--shards", "a:1,b:2", "--fragments", "1"), "--fragments (1) must be at least the number of shards (2)"),
    (("--baseline", "--learner-index", "4", "--num-learners", "4"), "--learner-index must be in [0, 4)"),
    (("--baseline", "--slowdown", "0.5"), "--slowdown must be >= 1"),
    (("--baseline", "--metrics-port", "99999"), "--metrics-port must be in 1-65535"),
    (("--baseline", "--metrics-port", "-1"), "--metrics-port must be in 1-65535"),
    (("--shards", "127.0.0.1:99999"), "'127.0.0.1:99999': the port must be in 1-65535"),
    (("--shards", "127.0.0.1:0"), "'127.0.0.1:0': the port must be in 1-65535"),
    (("--shards", "127.0.0.1:7070,127.0.0.1:x"), "'127.0.0.1:x': the port must be in 1-65535"),
    (("--shards", "atoll-{i}:70700", "--num-shards", "2"), "'atoll-0:70700': the port must be in 1-65535"),
])
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


def test_one_host_of_a_multi_host_slice_refuses_to_train(run, monkeypatch, tmp_path):
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "slice-0-0.atoll,slice-0-1.atoll")
    result = run("--shards", "127.0.0.1:1", "--steps", "1", "--status-file", str(tmp_path / "s.jsonl"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "one of 2 hosts of a TPU slice" in result.stderr
    assert not (tmp_path / "s.jsonl").exists(), "it refused before doing anything"


@pytest.mark.parametrize("hosts", ["", "slice-0-0.atoll"])
def test_a_single_host_slice_is_not_refused(hosts):
    from learner.main import multi_host_refusal

    assert multi_host_refusal({"TPU_WORKER_HOSTNAMES": hosts}) is None
    assert multi_host_refusal({}) is None
