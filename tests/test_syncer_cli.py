"""`atoll syncer` refuses bad settings as flag errors: a readable line, exit 2, no traceback."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("content,message", [("REPLACE-ME-with-a-real-token\n", "placeholder"),
                                             ("short\n", "32"), ("", "no tokens")])
def test_a_bad_token_file_is_a_flag_error_before_anything_starts(tmp_path, content, message):
    tokens = tmp_path / "tokens"
    tokens.write_text(content)
    r = subprocess.run([sys.executable, "-m", "atoll.cli", "syncer", "--data-dir", str(tmp_path / "data"),
                        "--listen", "127.0.0.1:0", "--token-file", str(tokens)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "data").exists()  # refused before the data directory was touched
