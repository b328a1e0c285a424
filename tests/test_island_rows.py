"""learner/island_rows.py's Rows: every process's row of each call through the
coordination service's key-value store (here an in-memory one with its blocking reads
and timeouts), in call order, with each process's old keys dropped as it goes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from atoll.learner import island_rows
from atoll.learner.island_rows import Board, LearnerDisagreement, Rows


class Store:
    """The coordination service's key-value calls Board makes."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.changed = threading.Condition()

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        with self.changed:
            assert key not in self.values, f"{key} written twice"
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: no {key}")
            return self.values[key]

    def key_value_delete(self, key: str) -> None:
        with self.changed:
            for k in [k for k in self.values if k == key or k.startswith(key + "/")]:
                del self.values[k]


def _board(store: Store) -> Board:
    board = Board.__new__(Board)
    board.client, board.prefix = store, "atoll/x/1"
    return board


def test_every_process_gets_every_row_of_each_call_and_old_keys_go(monkeypatch):
    monkeypatch.setattr(island_rows, "_DROP_EVERY", 4)
    monkeypatch.setattr(island_rows, "_POLL_MS", 20)  # a late row is waited for past timeouts
    store, n, calls = Store(), 3, 11
    got: dict[int, list[np.ndarray]] = {}

    def process(me: int) -> None:
        rows = Rows(_board(store), n, me)
        got[me] = [rows(np.asarray([k, me, 7 * k + me], np.int32)) for k in range(calls)]

    threads = [threading.Thread(target=process, args=(j,)) for j in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    want = [np.asarray([[k, j, 7 * k + j] for j in range(n)]) for k in range(calls)]
    for me in range(n):
        assert [r.tolist() for r in got[me]] == [w.tolist() for w in want]
    # calls 0-3 and 4-7 dropped (at calls 4 and 8), 8-10 kept: 3 per process
    assert sorted(store.values) == sorted(
        f"atoll/x/1/rows/2/{j}/{k}" for j in range(n) for k in (8, 9, 10)
    )


def test_a_row_of_another_length_is_a_disagreement():
    store = Store()
    store.key_value_set_bytes("atoll/x/1/rows/0/1/0", np.zeros(5, "<i4").tobytes())
    with pytest.raises(LearnerDisagreement, match="process 1 .* row of 5 values"):
        Rows(_board(store), 2, 0)(np.zeros(4, np.int32))
