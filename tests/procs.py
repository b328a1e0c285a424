"""Processes as /proc shows them, for the tests that check what a run leaves behind.

One rule everywhere: a zombie (exited, not yet reaped by its parent) is gone, and a pid
is a given process only while its command line still names what it was started as (pids
are reused). Importable from tests/ and tests/integration/ (pytest puts tests/ on the
path for its conftest.py)."""

from __future__ import annotations

import os
import pathlib

PROC = pathlib.Path("/proc")


def _state(entry: pathlib.Path) -> str | None:
    """The state letter of /proc/<pid> ('R', 'S', 'Z', ...), None if it is gone."""
    try:
        return (entry / "stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _cmdline(entry: pathlib.Path) -> str | None:
    try:
        return (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def running(pid: int, naming: str = "") -> bool:
    """True while `pid` exists, is not a zombie, and its command line holds `naming`."""
    entry = PROC / str(pid)
    state, cmdline = _state(entry), _cmdline(entry)
    return state not in (None, "Z") and cmdline is not None and naming in cmdline


def processes_naming(*marks: str) -> dict[int, str]:
    """{pid: command line} of every running process but this one (no zombies) whose
    command line holds one of `marks`."""
    found = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        cmdline = _cmdline(entry)
        if cmdline and any(m in cmdline for m in marks) and _state(entry) not in (None, "Z"):
            found[int(entry.name)] = cmdline
    return found
