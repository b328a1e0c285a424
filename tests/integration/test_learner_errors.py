"""`atoll learner` as a process refuses paths it cannot write, and shard addresses that
cannot exist, with one readable line and exit status 2: no traceback, nothing loaded."""

from __future__ import annotations

import os
import pathlib

import pytest
from syncer_helpers import run_atoll


@pytest.mark.parametrize(
    "flag, where, message",
    [
        ("--checkpoint-dir", "a-file", "--checkpoint-dir {}: not a directory"),
        ("--checkpoint-dir", "a-file/sub", "cannot be made: {tmp}/a-file is not a directory"),
        ("--compile-cache", "a-file", "--compile-cache {}: not a directory"),
        ("--status-file", "missing/status.jsonl", "no directory {tmp}/missing"),
        ("--status-file", ".", "--status-file {}: a directory, not a file"),
        ("--push-log", "missing/{{id}}.pushes.jsonl", "no directory {tmp}/missing"),
    ],
    ids=["dir-is-a-file", "dir-under-a-file", "cache-is-a-file", "no-dir", "file-is-a-dir", "log"],
)
def test_a_path_the_learner_cannot_write_is_refused(tmp_path, flag, where, message):
    (tmp_path / "a-file").write_text("not a directory")
    path = tmp_path / where.format()
    result = run_atoll("learner", "--shards", "127.0.0.1:7070", flag, str(path), timeout=60)
    assert result.returncode == 2, result.stderr
    assert message.format(path, tmp=tmp_path) in result.stderr
    assert "Traceback" not in result.stderr


def test_a_directory_the_learner_may_not_write_is_refused(tmp_path):
    # /proc takes no new files, from root either; a mode-0555 directory stops anyone else
    locked = pathlib.Path("/proc") if os.geteuid() == 0 else tmp_path / "locked"
    locked.mkdir(mode=0o555, exist_ok=True)
    ck = locked / f"atoll-ck-{os.getpid()}"
    result = run_atoll(
        "learner", "--shards", "127.0.0.1:7070", "--checkpoint-dir", str(ck), timeout=60
    )
    assert result.returncode == 2 and f"cannot be made: {locked} is not writable" in result.stderr
    assert "Traceback" not in result.stderr and not ck.exists()


def test_a_port_that_cannot_exist_is_refused():
    result = run_atoll("learner", "--shards", "127.0.0.1:99999", timeout=60)
    assert result.returncode == 2, result.stderr
    assert "shard address '127.0.0.1:99999': the port must be in 1-65535" in result.stderr
    assert "Traceback" not in result.stderr
