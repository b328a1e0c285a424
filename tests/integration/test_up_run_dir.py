"""`atoll up` as a process: --run-dir resumes a run that is there and only that;
--new-run-dir starts one only in a new or empty directory whose parent exists. Every
refusal is one readable line, exit status 2, and nothing made on disk."""

from __future__ import annotations

import pathlib

import pytest
from syncer_helpers import run_atoll

from atoll.local.config import prepare_run_dir


def _refused(*args: str) -> str:
    result = run_atoll("up", "--no-table", *args, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "atoll up: error:" in result.stderr and "Traceback" not in result.stderr
    return result.stderr


def test_resuming_a_run_that_is_not_there_is_refused(tmp_path):
    missing = tmp_path / "no" / "such" / "run"
    assert "does not exist: --run-dir resumes a run" in _refused("--run-dir", str(missing))
    assert "atoll up --new-run-dir" in _refused("--run-dir", str(missing))
    assert not (tmp_path / "no").exists()  # nothing made on the way
    assert "holds no atoll run" in _refused("--run-dir", "/")
    assert not pathlib.Path("/.lock").exists() and not pathlib.Path("/shards").exists()


@pytest.mark.parametrize(
    "where, message",
    [
        ("no/parent", "does not exist: make it first"),
        ("notes", "holds files and is not an atoll run directory"),
        ("notes/notes.txt", "is a file"),
        ("run", "already holds a run: resume it with `atoll up --run-dir"),
    ],
    ids=["missing-parent", "other-files", "a-file", "a-run"],
)
def test_a_new_run_is_refused_where_it_cannot_start_clean(tmp_path, where, message):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("mine")
    prepare_run_dir(tmp_path / "run", {"preset": "tiny"})
    before = sorted(tmp_path.rglob("*"))
    assert message in _refused("--new-run-dir", str(tmp_path / where))
    assert sorted(tmp_path.rglob("*")) == before


def test_resume_and_new_do_not_go_together(tmp_path):
    stderr = _refused("--run-dir", str(tmp_path / "a"), "--new-run-dir", str(tmp_path / "b"))
    assert "not allowed with argument" in stderr
