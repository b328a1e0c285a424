"""learner/stopping.py: one stop ends every wait; signals reach it from a thread of their
own, and a second signal ends the process even while the main thread is busy."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

from atoll.learner.stopping import Stop, Stopped

# the main thread busy in one long call (as in a compile); SIGTERMs come from outside
BUSY = """
import sys, time
from atoll.learner.stopping import Stop, on_signals
stop = Stop()
stop.on_stop(lambda: print("hook ran", flush=True))
with on_signals(stop, name="test"):
    print("ready", flush=True)
    time.sleep(float(sys.argv[1]))
print("left with", stop.reason, flush=True)
"""


def test_hooks_run_once_and_a_late_hook_runs_at_once():
    stop, ran = Stop(), []
    stop.on_stop(lambda: ran.append("early"))
    stop.check("training")  # not stopped: nothing raised
    stop.set("SIGTERM")
    stop.set("SIGINT")  # a second request changes nothing
    stop.on_stop(lambda: ran.append("late"))
    assert ran == ["early", "late"] and stop.reason == "SIGTERM" and stop.wait(0)
    with pytest.raises(Stopped, match="stopped by SIGTERM while joining"):
        stop.check("joining")


def test_a_failing_hook_does_not_keep_the_others_from_running():
    stop, ran = Stop(), []
    stop.on_stop(lambda: 1 / 0)
    stop.on_stop(lambda: ran.append(True))
    stop.set()
    assert ran == [True]


def test_a_wait_ends_when_another_thread_stops():
    stop = Stop()
    threading.Thread(target=stop.set).start()
    assert stop.wait(30.0)  # True: the stop ended it, not the 30 s


@pytest.fixture
def busy():
    """busy(seconds) -> a child whose main thread sleeps `seconds` inside on_signals, once
    it is ready; killed at the test's end whatever happened."""
    procs: list[subprocess.Popen] = []

    def start(seconds: float) -> subprocess.Popen:
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", BUSY, str(seconds)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        assert procs[-1].stdout.readline() == "ready\n"
        return procs[-1]

    yield start
    for proc in procs:
        proc.kill()  # a no-op on one that exited
        proc.wait()
        proc.stdout.close()


def test_a_signal_sets_the_stop_and_runs_its_hooks_while_the_main_thread_is_busy(busy):
    proc = busy(1.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "test: SIGTERM: stopping" in out and "hook ran" in out and "left with SIGTERM" in out


def test_a_second_signal_ends_the_process_at_once(busy):
    proc = busy(600.0)
    proc.send_signal(signal.SIGINT)
    first = proc.stdout.readline()  # the first signal is handled: the process is stopping
    assert first.startswith("test: SIGINT: stopping"), first
    proc.send_signal(signal.SIGTERM)
    # "at once": long before the 600 s sleep ends (communicate raises past 60 s)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, first + out
    assert "test: SIGTERM again: exiting now" in out
