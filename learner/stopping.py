"""How a learner process stops: SIGTERM or SIGINT sets one `Stop`, and every wait in the
learner ends on it, so a pod leaves within seconds of its SIGTERM whatever it waited for.

1. Waits are on an event that the stop sets: retry backoff, a round, the start of a run,
   a standby's poll, the tail pushes at the end.
2. What is not an event wait (a gRPC call in flight, a Watch stream) is ended by a hook
   given to `on_stop`: the synchronizer's closes its channels, so a call to a shard that
   does not answer ends at once rather than at its deadline, and raises `Stopped`.
3. The signal is taken by a thread of its own (Python's wakeup fd), not by a handler that
   interrupts the main thread: the hooks take locks the interrupted code may hold, and
   the thread sees a signal even while the main thread is inside a compile. A second
   signal ends the process at once (exit 128 + signal), for whatever no hook reaches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

log = logging.getLogger("atoll.learner")
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """A wait or a call that a stop ended; the learner leaves cleanly."""


class Stop:
    """One process's request to stop: set by a signal (`on_signals`) or by `set`."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason: str | None = None  # what asked: "SIGTERM", "SIGINT", ...
        self._hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def is_set(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits up to `timeout` s; True if stopped (a sleep that a stop cuts short)."""
        return self.event.wait(timeout)

    def set(self, reason: str = "a stop request") -> None:
        """Stops: the event first (every wait ends), then each hook once, in this thread."""
        with self._lock:
            if self.event.is_set():
                return
            self.reason = reason
            self.event.set()
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            _run(hook)

    def on_stop(self, hook: Callable[[], None]) -> None:
        """Runs `hook` when the stop comes; at once if it came already."""
        with self._lock:
            if not self.event.is_set():
                self._hooks.append(hook)
                return
        _run(hook)

    def check(self, doing: str) -> None:
        """Raises Stopped if stopped; `doing` says what the learner was at ("joining")."""
        if self.event.is_set():
            raise Stopped(f"stopped by {self.reason} while {doing}")


def _run(hook: Callable[[], None]) -> None:
    try:
        hook()
    except Exception:  # one failing hook must not keep the others from ending their waits
        log.exception("while stopping")


def _ignore(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: the wakeup fd's thread does the work (guarantee 3)."""


@contextlib.contextmanager
def on_signals(stop: Stop, name: str = "atoll learner") -> Iterator[Stop]:
    """Inside the block, the first SIGTERM or SIGINT sets `stop` and a second one ends the
    process (exit 128 + signal); the handlers and wakeup fd before it are restored after.
    Call it from the main thread. `name` starts the line printed for each signal."""
    readable, writable = os.pipe()
    os.set_blocking(writable, False)
    # the fd first: a signal between the two still kills or interrupts rather than vanish
    previous_fd = signal.set_wakeup_fd(writable, warn_on_full_buffer=False)
    previous = {s: signal.signal(s, _ignore) for s in SIGNALS}

    def watch() -> None:
        seen = 0
        while data := os.read(readable, 64):  # one byte per signal; empty: the block ended
            for number in data:
                if number not in SIGNALS:
                    continue
                seen += 1
                what = signal.Signals(number).name
                if seen > 1:
                    print(f"{name}: {what} again: exiting now", file=sys.stderr, flush=True)
                    os._exit(128 + number)
                print(
                    f"{name}: {what}: stopping (a second signal exits at once)",
                    file=sys.stderr,
                    flush=True,
                )
                # hooks may block on a call that is ending: this thread stays free for a second signal
                threading.Thread(
                    target=stop.set, args=(what,), name="stopping", daemon=True
                ).start()

    watcher = threading.Thread(target=watch, name="stop-signals", daemon=True)
    watcher.start()
    try:
        yield stop
    finally:
        signal.set_wakeup_fd(previous_fd)
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(writable)  # the watcher reads end-of-file and returns
        watcher.join(timeout=5.0)
        os.close(readable)
