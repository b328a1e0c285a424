"""atoll.Learner's join and step as a new user meets them, against a real shard (in this
process) or none: a tree changed after join fails at the next step, a join against
shards that never answer ends within its bound, and Ctrl-C during join is one line."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest
from syncer_helpers import serving_shard

import atoll


def init() -> dict:
    k0, k1 = jax.random.split(jax.random.key(0))
    return {
        "layer0": {"w": jax.random.normal(k0, (8, 16)), "b": jnp.zeros(16)},
        "layer1": {"w": jax.random.normal(k1, (16, 1)), "b": jnp.zeros(1)},
    }


@pytest.fixture
def one_shard(tmp_path):
    with serving_shard(tmp_path / "shard") as server:
        yield f"127.0.0.1:{server.port}"


def _shape(p):
    p["layer1"]["w"] = jnp.zeros((16, 2))
    return p


def _dtype(p):
    p["layer0"]["b"] = p["layer0"]["b"].astype(jnp.bfloat16)
    return p


def _structure(p):
    p["layer1"]["extra"] = jnp.zeros(3)
    return p


@pytest.mark.parametrize(
    "change,match",
    [
        (_shape, r"leaf 'layer1/w' is float32\(16, 2\), was float32\(16, 1\)"),
        (_dtype, r"leaf 'layer0/b' is bfloat16\(16,\), was float32\(16,\)"),
        (_structure, r"leaf 'layer1/extra' is new"),
    ],
)
def test_a_tree_changed_after_join_fails_at_the_next_step(one_shard, change, match):
    # H = 64: no fragment is read or written for dozens of steps, yet the change is caught
    with atoll.Learner(one_shard, "a", fragments=2, sync=atoll.SyncConfig(period=64)) as learner:
        params = learner.join(init())
        for _ in range(3):
            params = learner.step(params)
        with pytest.raises(atoll.ParamsError, match=match):
            learner.step(change(params))
        assert learner.steps == 4 and not learner.pushed  # caught before any sync was due


@pytest.fixture
def silent_server():
    """A listening socket that takes connections and never answers (a hung shard, a wrong
    service); `accept` tells a test that a client has connected."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield server
    server.close()


@pytest.fixture
def silent_port(silent_server):
    return silent_server.getsockname()[1]


@pytest.mark.parametrize("listening", [False, True], ids=["nothing-listens", "never-answers"])
def test_a_join_against_shards_that_never_answer_ends_at_join_timeout(listening, silent_port):
    address = f"127.0.0.1:{silent_port if listening else 1}"  # nothing listens on port 1
    learner = atoll.Learner(address, "a", sync=atoll.SyncConfig(deadline=30.0, join_timeout=2.0))
    started = time.monotonic()
    with pytest.raises(
        atoll.SyncError, match=rf"shards at {address} did not all answer within join_timeout=2 s"
    ):
        learner.join(init())
    assert time.monotonic() - started < 8  # the bound, not a call's 30 s deadline
    with pytest.raises(atoll.LearnerStateError, match="did not all answer"):
        learner.step(init())  # the failed join says why on every later call


def test_join_timeout_is_checked_where_it_is_declared():
    with pytest.raises(atoll.LearnerConfigError, match="join_timeout must be > 0"):
        atoll.SyncConfig(join_timeout=0)


SCRIPT = """
import sys, jax.numpy as jnp, atoll
learner = atoll.Learner(sys.argv[1], "a", fragments=1, sync=atoll.SyncConfig(deadline=60.0))
print("joining", flush=True)
learner.join({"w": jnp.zeros((4, 2))})
"""


def test_ctrl_c_during_join_ends_the_program_with_one_line(silent_server, silent_port):
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, f"127.0.0.1:{silent_port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "joining"
        # inside join, in a call the silent shard never answers: its channel has connected
        # (a fixed sleep could land the signal in JAX's start-up, whose gc callback
        # swallows a KeyboardInterrupt)
        silent_server.settimeout(60)
        connection, _ = silent_server.accept()  # held open, never answered
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # what it printed says where it was (hung at exit?)
            proc.kill()
            pytest.fail(f"no exit within 30 s of SIGINT; stderr: {proc.communicate()[1][-3000:]}")
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"atoll: learner a interrupted while joining the shards at 127.0.0.1:{silent_port}"
    )
