"""A bench's processes die with it: its shard (atoll/bench/shard.py) and its multiprocessing
children get a signal when the bench dies, however it dies (PR_SET_PDEATHSIG), so a bench
killed by a test's timeout or a kill -9 leaves no shard holding its port and data."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from procs import running
from syncer_helpers import REPO

# SIGKILL of the parent -> its children gone: well under a second when idle; the shard's
# SIGTERM is a clean stop (a final snapshot), and a loaded 2-core host may be slow to run it
GONE_SECONDS = 30.0

# a bench in miniature: a shard started as the benches start theirs, then a long wait
WRAPPER = textwrap.dedent("""
    import pathlib, sys, time
    from atoll.bench.shard import start_shard
    from atoll.server.config import ShardConfig

    root = pathlib.Path(sys.argv[1])
    cfg = ShardConfig(
        shard_index=0, num_shards=1, data_dir=root / "data", listen="127.0.0.1:0", metrics_port=0
    )
    shard, port, _ = start_shard(cfg, root / "syncer.log")
    print(shard.pid, flush=True)
    time.sleep(600)
""")


def _descendants(pid: int) -> dict[int, str]:
    """{pid: command line} of every live process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = {}, list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            out[child] = (
                pathlib.Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            ).decode()
        except OSError:
            continue
        todo += children.get(child, [])
    return out


def _wait_gone(pids: list[int]) -> list[int]:
    """The pids still alive after GONE_SECONDS (none, once they have all died)."""
    deadline = time.monotonic() + GONE_SECONDS
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _kill_left(pids) -> None:
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def _shard_logs(tree: dict[int, str]) -> dict[str, str]:
    """The tail of each shard's log (next to its --data-dir): what it did after SIGTERM."""
    out = {}
    for command in tree.values():
        words = command.split()
        if "--data-dir" in words:
            log = pathlib.Path(words[words.index("--data-dir") + 1]).parent / "syncer.log"
            out[str(log)] = log.read_text()[-3000:] if log.exists() else "(no log)"
    return out


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_the_shard_a_bench_started_dies_when_the_bench_is_killed(tmp_path):
    wrapper = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, str(tmp_path)],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    shard = None
    try:
        shard = int(wrapper.stdout.readline())  # printed once the shard serves
        assert running(shard)
        # the injected fault: the bench dies with no chance to stop its shard
        wrapper.send_signal(signal.SIGKILL)
        assert wrapper.wait(timeout=30) == -signal.SIGKILL
        assert _wait_gone([shard]) == [], (tmp_path / "syncer.log").read_text()
    finally:
        wrapper.kill()
        wrapper.wait()
        wrapper.stdout.close()
        if shard is not None:
            _kill_left([shard])


@pytest.mark.e2e  # a whole bench
@pytest.mark.timeout(240)
def test_a_killed_bench_leaves_no_process_behind():
    # a long first phase: the bench sits in it, its shard and prober running, when killed
    args = ["--watches", "10", "--stalled", "1", "--seconds", "120", "--crowd-processes", "1"]
    bench = subprocess.Popen(
        [sys.executable, "-m", "atoll.cli", "bench", "streams", *args, "--json"],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    tree: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 180
        while not (
            any(" syncer " in c for c in tree.values())
            and any("multiprocessing.spawn" in c for c in tree.values())
        ):
            assert bench.poll() is None, bench.stderr.read()
            assert time.monotonic() < deadline, f"the bench never started its children: {tree}"
            time.sleep(0.2)
            tree = _descendants(bench.pid)
        # the injected fault: the bench dies with no chance to stop its children
        bench.send_signal(signal.SIGKILL)
        assert bench.wait(timeout=30) == -signal.SIGKILL
        left = _wait_gone(list(tree))
        assert left == [], ({p: tree[p] for p in left}, _shard_logs(tree))
    finally:
        bench.kill()
        bench.wait()
        bench.stderr.close()
        _kill_left(tree)
