"""Learner ids as claims, and standby learners that take over a failed one's id.

A learner run with --checkpoint-dir holds `<dir>/<learner id>.claim` for its whole
life: an exclusive `flock` on the file, which holds JSON saying who it is (id, data
shard, pid, host, and "done" once it finished its steps). The kernel drops the lock
when the process dies, however it dies (kill -9 included), so a free lock on a claim
that is not done is a vacancy: that learner failed, or was stopped before its end.

A standby (`atoll learner --standby`) has loaded its data, built its trainer and
compiled its step; it then polls the directory's claims and takes the first vacancy
whose settings match its own. Having the lock, it rewrites the claim as its own and
becomes that learner: the same id (so the shards know it), data shard, status file,
and checkpoint, from which it resumes. Two standbys never take one id: the lock is
exclusive. A learner started under an id a live process holds (a restarted pod whose
id a standby took) waits as a standby itself instead.

Locally the directory is any directory. In Kubernetes it is the learners' shared
ReadWriteMany volume. Over NFSv4.1 a lock is a lease held by the client host, released
when the process exits or, if its node is lost, when the server's lease lapses (90 s by
default); over NFSv3 (Filestore's basic tiers) a lost node's locks stay until the node
returns, so its learner's id is not taken over meanwhile. Bucket mounts (GCS FUSE) do
not lock: with one, run no standbys there.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pathlib
import socket
import threading
import time
from typing import Any

log = logging.getLogger("atoll.learner")
SUFFIX = ".claim"
POLL_SECONDS = 0.1  # how often a standby looks for a vacancy
HOLD_RETRY_SECONDS = (
    2.0  # a starting learner retries its own claim this long (a standby may be peeking)
)


class Claim:
    """An exclusive hold on one learner id (released when the process exits)."""

    def __init__(self, path: pathlib.Path, fd: int, info: dict[str, Any]):
        self.path, self.fd, self.info = path, fd, info

    @property
    def learner_id(self) -> str:
        return str(self.info["learner_id"])

    def write(self, **fields: Any) -> None:
        """Rewrites the claim's JSON (the holder alone writes it)."""
        self.info.update(fields)
        data = json.dumps(self.info).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self, done: bool = False) -> None:
        """Drops the hold; `done`: the learner finished, nobody is to take the id over."""
        if self.fd < 0:
            return
        if done:
            self.write(done=True)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1


def _read(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 1 << 16, 0)
        return _object(json.loads(raw)) if raw else None
    except (OSError, ValueError):
        return None


def _lock(path: pathlib.Path) -> int | None:
    """An fd holding an exclusive lock on `path` (created if missing), or None if held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:  # the name may have been replaced since we opened it: the lock must be on the file it names
        same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return None
    return fd


def _object(value: Any) -> dict[str, Any] | None:
    """A claim's JSON, if it is an object (a damaged file may hold anything)."""
    return value if isinstance(value, dict) else None


def holder(directory: pathlib.Path, learner_id: str) -> dict[str, Any] | None:
    """The JSON of the claim on `learner_id` (who holds or last held it), or None."""
    path = pathlib.Path(directory) / f"{learner_id}{SUFFIX}"
    try:
        return _object(json.loads(path.read_text() or "null"))
    except (OSError, ValueError):
        return None


def acquire(
    directory: pathlib.Path,
    learner_id: str,
    index: int,
    num_learners: int,
    retry: float = HOLD_RETRY_SECONDS,
    stop: threading.Event | None = None,
) -> Claim | None:
    """This learner's claim on its id, or None if a live process holds it (or `stop` came
    while it waited)."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{learner_id}{SUFFIX}"
    deadline = time.monotonic() + retry
    while True:
        fd = _lock(path)
        if fd is not None:
            claim = Claim(path, fd, {})
            claim.write(
                learner_id=learner_id,
                learner_index=index,
                num_learners=num_learners,
                pid=os.getpid(),
                host=socket.gethostname(),
                since=time.time(),
                done=False,
            )
            return claim
        if time.monotonic() >= deadline:
            return None
        if stop is None:
            time.sleep(POLL_SECONDS)
        elif stop.wait(POLL_SECONDS):
            return None


def take_vacancy(directory: pathlib.Path, num_learners: int) -> Claim | None:
    """One pass over the claims: the first vacancy (free lock, not done, same M) taken."""
    directory = pathlib.Path(directory)
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        fd = _lock(path)
        if fd is None:
            continue
        info = _read(fd)
        if (
            not info
            or info.get("done")
            or info.get("num_learners") != num_learners
            or path.name != f"{info.get('learner_id')}{SUFFIX}"
        ):
            fcntl.flock(
                fd, fcntl.LOCK_UN
            )  # empty (its learner is just starting), finished, or another run's
            os.close(fd)
            continue
        claim = Claim(path, fd, info)
        claim.write(
            pid=os.getpid(),
            host=socket.gethostname(),
            since=time.time(),
            taken_from=info.get("pid"),
            taken_at=time.time(),
        )
        return claim
    return None


def wait_for_vacancy(
    directory: pathlib.Path, num_learners: int, stop: threading.Event, until_done: str | None = None
) -> Claim | None:
    """Polls until a vacancy is taken (the claim) or `stop` is set (None). `until_done`: a
    learner id whose claim, once marked done, ends the wait too (None): a learner restarted
    while a standby held its id waits only as long as its own id is being trained."""
    while not stop.is_set():
        claim = take_vacancy(directory, num_learners)
        if claim is not None:
            return claim
        if until_done is not None and (holder(directory, until_done) or {}).get("done"):
            return None
        stop.wait(POLL_SECONDS)
    return None
