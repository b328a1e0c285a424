"""What the processes of a learner sharded over several JAX processes agree on and tell
each other (learner/sharded.py runs them): the checks at join (plan, sharding,
settings), the row every process gives at every call, and the board where one process
posts what the others read.

A row is one small int32 vector per process, every process's read by every process
(`Rows`, through the coordination service's key-value store): which call, which step, stop
and failure, and per fragment whether process 0 adopted and pushed, with the push's
agreed header fields. Every row reaches every process, so a process that called another
method or is at another step sees it and every process raises, at the same call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import numpy as np

from atoll.learner.boxes import bounds_of
from atoll.learner.pytree import ParamsError, TreeLayout
from atoll.learner.routing import SyncError
from atoll.learner.stopping import Stopped

JOIN, STEP, FINISH = 1, 2, 3  # the call a row is exchanged at
_CALLS = {JOIN: "join", STEP: "step", FINISH: "finish"}
_HEAD = 4  # call, step, stopped, failed
_PER_FRAGMENT = 8  # adopt, push, seq, steps, tokens (hi, lo), last, step_seconds (bits)
_POLL_MS = 500  # a wait on the key-value store looks at `stopping` this often
_DROP_EVERY = 256  # a process deletes its own rows of the store this many calls at a time


class Done(Protocol):
    """What this process did in the current call, as its row tells it."""

    adopted: set[int]  # fragments adopted
    pushed: dict[int, dict[str, Any]]  # fragment -> the agreed fields of the push started


class LearnerDisagreement(ParamsError):
    """The processes of one learner disagree (plan, sharding, call order)."""


def allgather(row: np.ndarray) -> np.ndarray:
    """Every process's int32 `row` (all of one length), as an (n, len) array."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(row.astype(np.int32)))


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


def _describe_sharding(leaf: Any) -> str:
    sharding = leaf.sharding
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    if mesh is not None:
        return f"mesh {dict(mesh.shape)} spec {spec}"
    return f"{type(sharding).__name__} over {len(sharding.device_set)} devices"


def _placement(leaf: Any) -> str:
    """Which device holds which piece of the leaf, every device's: one global array has
    one placement, so every process of the learner must see the same."""
    where = leaf.sharding.devices_indices_map(tuple(leaf.shape))
    return ";".join(
        f"{d.id}:{bounds_of(index, leaf.shape)}"
        for d, index in sorted(where.items(), key=lambda kv: int(kv[0].id))
    )


def check_agreement(layout: TreeLayout, leaves: Sequence[Any]) -> None:
    """LearnerDisagreement on every process unless every process joined with the same
    plan (names, shapes, P) and the same sharding of every synced leaf."""
    me = process_index()
    head = allgather(np.asarray([JOIN, len(layout.synced), _digest(layout.plan.fingerprint)]))
    if (head != head[0]).any():
        j = int(np.nonzero((head != head[0]).any(axis=1))[0][0])
        if (head[:, 0] != JOIN).any():
            raise LearnerDisagreement(
                f"process {me}: the processes of this learner are at different calls "
                f"({_calls(head)}): every process calls join, step and finish alike"
            )
        raise LearnerDisagreement(
            f"process {me}: process {j} of this learner joined with another fragment plan "
            f"than process 0 (plan fingerprint here {layout.plan.fingerprint[:12]}): every "
            "process passes the same tree (names, shapes) and the same fragments"
        )
    descriptions = [_describe_sharding(leaves[i]) for i in layout.synced]
    placements = [_placement(leaves[i]) for i in layout.synced]
    rows = allgather(np.asarray([_digest(d) for d in descriptions + placements]))
    n = len(descriptions)
    for k, i in enumerate(layout.synced):
        if (rows[:, k] != rows[0, k]).any() or (rows[:, n + k] != rows[0, n + k]).any():
            raise LearnerDisagreement(
                f"process {me}: leaf {layout.names[i]!r} is sharded differently on the "
                f"processes of this learner (here: {descriptions[k]}, or its pieces on other "
                "devices): place every leaf with the same sharding, over a mesh of the same "
                "devices in the same order, on every process"
            )


def check_cover(sent_sizes: np.ndarray, fragment_sizes: Sequence[int]) -> None:
    """LearnerDisagreement unless the boxes the processes send of every fragment add up to
    the fragment (`sent_sizes`: (processes, fragments)), every element once."""
    for p, size in enumerate(fragment_sizes):
        total = int(sent_sizes[:, p].sum())
        if total != size:
            raise LearnerDisagreement(
                f"process {process_index()}: the processes of this learner send {total} "
                f"values of fragment {p}, of {size}: their shards do not cover its leaves "
                "exactly once (each process must see every leaf's whole sharding alike)"
            )


def check_settings(cfg: Any, learner_id: str) -> None:
    """LearnerDisagreement on every process unless every process made its learner with
    the same id and sync settings (`SyncConfig`: codec, period, overlap, ...): parts of
    one push must agree, and process 0's schedule must be everyone's."""
    me = process_index()
    fields = {"learner id": repr(learner_id)}
    fields.update({f.name: repr(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)})
    rows = allgather(np.asarray([_digest(f"{k}={v}") for k, v in fields.items()]))
    for k, (name, value) in enumerate(fields.items()):
        if (rows[:, k] != rows[0, k]).any():
            j = int(np.nonzero(rows[:, k] != rows[0, k])[0][0])
            raise LearnerDisagreement(
                f"process {me}: process {j} of this learner has another {name} than process "
                f"0 (here: {value}): every process makes its Learner with the same settings"
            )


def _calls(rows: np.ndarray) -> str:
    return ", ".join(
        f"process {j}: {_CALLS.get(int(r[0]), '?')} at step {int(r[1])}" for j, r in enumerate(rows)
    )


def process_index() -> int:
    import jax

    return int(jax.process_index())


class Board:
    """The JAX coordination service's key-value store (a private JAX API, the one
    `jax.distributed` itself uses): one process posts a push's outcome, the others
    read it, from their sync threads, without a collective."""

    def __init__(self, prefix: str):
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise SyncError("a learner sharded over processes needs jax.distributed.initialize")
        self.client, self.prefix = client, prefix

    def post(self, key: str, value: dict[str, Any]) -> None:
        self.client.key_value_set(f"{self.prefix}/{key}", json.dumps(value))

    def read(self, key: str, stopping: Any, timeout: float | None = None) -> dict[str, Any]:
        """The value posted at `key`, waiting for it (Stopped when `stopping` is set;
        SyncError past `timeout` seconds)."""
        ends = None if timeout is None else time.monotonic() + timeout
        while True:
            if stopping.is_set():
                raise Stopped(f"stopped while waiting for {key}")
            value = self._get(self.client.blocking_key_value_get, key)
            if value is not None:
                return cast(dict[str, Any], json.loads(value))
            if ends is not None and time.monotonic() > ends:
                raise SyncError(f"no {key} after {timeout:.0f} s: another process stopped")

    def post_bytes(self, key: str, value: bytes) -> None:
        self.client.key_value_set_bytes(f"{self.prefix}/{key}", value)

    def read_bytes(self, key: str) -> bytes:
        """The bytes posted at `key`, waiting for them as long as it takes (as a
        collective would: a process that died ends the job through the coordination
        service, whose error is raised here)."""
        while True:
            value = self._get(self.client.blocking_key_value_get_bytes, key)
            if value is not None:
                return cast(bytes, value)

    def drop(self, key: str) -> None:
        """Deletes `key` and every key under it."""
        self.client.key_value_delete(f"{self.prefix}/{key}")

    def _get(self, get: Any, key: str) -> Any:
        """get(key) within _POLL_MS; None when nothing is posted there yet."""
        try:
            return get(f"{self.prefix}/{key}", _POLL_MS)
        except Exception as e:  # the store's timeout is a generic runtime error
            if "DEADLINE" not in str(e).upper() and "TIMEOUT" not in str(e).upper():
                raise
        return None


class Rows:
    """Every process's row of each call, through the board rather than a collective:
    each process posts its row and reads the others' (one write and n - 1 reads on the
    coordination service, ~0.5 ms on one host where a gloo all-gather of a few int32
    over every device takes 1-2 ms and ~5 ms at p90), at every step of the run.

    Keys count the calls, which every process makes alike (`exchange` raises where they
    are not at the same call). Once a process has every row of call k, every process
    has posted row k, so every process is done reading rows before k: a process drops
    its own keys of old calls, _DROP_EVERY calls at a time, and the store stays small.
    """

    def __init__(self, board: Board, processes: int, me: int):
        self.board, self.processes, self.me = board, processes, me
        self.calls = 0

    def _key(self, call: int, process: int) -> str:
        return f"rows/{call // _DROP_EVERY}/{process}/{call}"

    def __call__(self, row: np.ndarray) -> np.ndarray:
        """Every process's int32 `row` of this call, as an (n, len) array."""
        k, self.calls = self.calls, self.calls + 1
        mine = np.ascontiguousarray(row, "<i4")
        self.board.post_bytes(self._key(k, self.me), mine.tobytes())
        rows = np.empty((self.processes, mine.size), np.int32)
        for j in range(self.processes):
            theirs = (
                mine
                if j == self.me
                else np.frombuffer(self.board.read_bytes(self._key(k, j)), "<i4")
            )
            if theirs.size != mine.size:
                raise LearnerDisagreement(
                    f"process {self.me}: process {j} of this learner sent a row of "
                    f"{theirs.size} values, this one {mine.size}: another plan"
                )
            rows[j] = theirs
        if k % _DROP_EVERY == 0 and k >= _DROP_EVERY:
            self.board.drop(f"rows/{k // _DROP_EVERY - 1}/{self.me}")
        return rows


def encode_row(
    call: int, step: int, stopped: bool, failed: bool, done: Done, num_fragments: int
) -> np.ndarray:
    row = np.zeros(_HEAD + _PER_FRAGMENT * num_fragments, np.int32)
    row[:_HEAD] = [call, step, int(stopped), int(failed)]
    for p in range(num_fragments):
        at = _HEAD + _PER_FRAGMENT * p
        row[at] = int(p in done.adopted)
        fields = done.pushed.get(p)
        if fields is not None:
            tokens = int(fields["tokens"])
            seconds = np.asarray([fields["step_seconds"]], np.float32).view(np.int32)[0]
            row[at + 1 : at + _PER_FRAGMENT] = [
                1,
                fields["seq"],
                fields["steps"],
                tokens >> 31,
                tokens & 0x7FFFFFFF,
                int(fields["last"]),
                seconds,
            ]
    return row


def decode_row(row: np.ndarray, num_fragments: int) -> tuple[set[int], dict[int, dict[str, Any]]]:
    adopted, pushed = set(), {}
    for p in range(num_fragments):
        at = _HEAD + _PER_FRAGMENT * p
        if row[at]:
            adopted.add(p)
        if row[at + 1]:
            seq, steps, hi, lo, last, seconds = (int(x) for x in row[at + 2 : at + _PER_FRAGMENT])
            pushed[p] = {
                "seq": seq,
                "steps": steps,
                "tokens": (hi << 31) | lo,
                "last": bool(last),
                "step_seconds": float(np.asarray([seconds], np.int32).view(np.float32)[0]),
            }
    return adopted, pushed


def exchange(
    call: int,
    step: int,
    stopped: bool,
    failed: bool,
    done: Done,
    num_fragments: int,
    gather: Callable[[np.ndarray], np.ndarray] = allgather,
) -> tuple[np.ndarray, np.ndarray]:
    """Every process's row of this call (through `gather`: `Rows`, or a collective);
    LearnerDisagreement on every process where they are not at the same call and step.
    Returns (process 0's row, all rows)."""
    rows = gather(encode_row(call, step, stopped, failed, done, num_fragments))
    if (rows[:, :2] != rows[0, :2]).any():
        raise LearnerDisagreement(
            f"process {process_index()}: the processes of this learner called it out of "
            f"order ({_calls(rows)}): every process calls join, step and finish alike, "
            "once per inner step"
        )
    return rows[0], rows


def any_pushed(row: np.ndarray) -> bool:
    """Whether the row says a push of some fragment started."""
    return bool(row[_HEAD + 1 :: _PER_FRAGMENT].any())
