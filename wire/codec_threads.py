"""The codec's thread pool: chunks of a frame are encoded, decoded and merged on
threads (the C kernels release the GIL); the chunk grid never depends on how many."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any

THREADS_ENV = "ATOLL_CODEC_THREADS"  # threads for chunks; default: the CPUs this process may use

_local = threading.local()
_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_workers = 0


def _default_threads() -> int:
    env = os.environ.get(THREADS_ENV, "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{THREADS_ENV}={env!r}: want a whole number of threads >= 1")
        return n
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_threads = _default_threads()


def set_threads(n: int | None) -> int:
    """Sets how many threads run a frame's chunks (None: the default); returns the old count.

    Results never depend on it, only speed does. The default is $ATOLL_CODEC_THREADS,
    else every CPU this process may run on.
    """
    global _threads
    new = _default_threads() if n is None else int(n)
    if new < 1:
        raise ValueError(f"threads={n}: want >= 1")
    old, _threads = _threads, new
    return old


def get_threads() -> int:
    """How many threads run a frame's chunks."""
    return _threads


def _get_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The shared pool, with at least `workers` threads (a smaller one is retired)."""
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)  # its queued work still runs
            _pool, _pool_workers = (
                concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="codec"),
                workers,
            )
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist here."""
    global _pool, _pool_workers, _pool_lock
    _pool, _pool_workers, _pool_lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def parallel(fn: Callable[[int], Any], n: int) -> list[Any]:
    """[fn(0), ..., fn(n - 1)] on up to get_threads() threads, the caller's included.

    Items go to whichever thread is free (each writes only its own outputs), so the
    results do not depend on timing. The first failure in item order is raised, after
    every item has finished.
    """
    threads = min(_threads, n)
    if threads <= 1 or getattr(_local, "in_pool", False):
        return [fn(i) for i in range(n)]
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n
    items = iter(range(n))  # next() on a range iterator is atomic under the GIL

    def work(in_pool: bool) -> None:
        _local.in_pool = in_pool
        for i in items:
            try:
                results[i] = fn(i)
            except BaseException as e:  # noqa: BLE001 - re-raised below, in item order
                errors[i] = e

    futures = [_get_pool(threads - 1).submit(work, True) for _ in range(threads - 1)]
    work(False)
    for f in futures:
        if not f.cancel():  # queued behind another frame's work: nothing left for it
            f.result()
    for e in errors:
        if e is not None:
            raise e
    return results
