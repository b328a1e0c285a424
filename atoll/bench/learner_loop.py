"""The training loop and report of `atoll bench learner` (learner.py describes the
method and its figures): pairs of a bare and an API step, each timed alone, and the
JSON object made of them. Shared by the 1-process bench and every process of the
sharded one (learner_sharded.py)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from atoll.learner.api import Learner
from atoll.learner.trainer.mesh import DATA_AXIS
from atoll.learner.trainer.model import PRESETS, init_params
from atoll.learner.trainer.train import (
    TrainConfig,
    data_mesh,
    global_batch,
    make_optimizer,
    make_train_step,
)

_spec: Callable[..., PartitionSpec] = PartitionSpec  # (untyped in jax)
_ready: Callable[[Any], Any] = jax.block_until_ready  # (untyped in jax)

TARGET_OVERHEAD_RATIO = 0.01  # an API step with no sync due over its bare pair (docs/design.md §6)
TARGET_SYNC_PAUSE_MS = 5.0  # p99 of the wall time inside learner.step at a sync point (§6)
WARMUP_PAIRS = 3  # the first two steps compile (uncommitted, then committed params)
NUM_BATCHES = 8  # distinct random batches, cycled
BOOTSTRAP = 2000  # resamples of the overhead's confidence interval


@dataclasses.dataclass(frozen=True)
class Step:
    """One timed step; the part inside `learner.step` is 0 for a bare one."""

    seconds: float  # the whole step, dispatch to results ready (wall)
    inside: float = 0.0  # of which inside learner.step (wall)
    inside_cpu: float = 0.0  # the training thread's CPU time inside learner.step
    pushed: bool = False  # learner.step started a push
    adopted: bool = False  # learner.step returned adopted fragments

    @property
    def sync(self) -> bool:
        return self.pushed or self.adopted


class Loop:
    """The training loop under test: the built-in jitted step over random byte batches."""

    def __init__(self, learner: Learner, preset: str):
        self.learner, self.preset = learner, preset
        self.model_cfg, self.train_cfg = PRESETS[preset], TrainConfig()
        self.mesh = data_mesh()
        optimizer = make_optimizer(self.train_cfg)
        self.train_step = make_train_step(self.model_cfg, optimizer, self.mesh)
        rng = np.random.default_rng(0)
        shape = (self.train_cfg.batch_size, self.model_cfg.context + 1)
        rows = NamedSharding(self.mesh, _spec(DATA_AXIS))
        self.batches = [
            global_batch(rng.integers(0, self.model_cfg.vocab, shape, np.int32), rows)
            for _ in range(NUM_BATCHES)
        ]
        self.tokens = self.train_cfg.batch_size * self.model_cfg.context
        self.params = learner.join(init_params(self.model_cfg, self.train_cfg.seed))
        replicated = NamedSharding(self.mesh, _spec())
        self.opt_state = jax.jit(optimizer.init, out_shardings=replicated)(self.params)
        self.done = 0

    def pair(self, bare_first: bool) -> tuple[Step, Step]:
        """(bare step, API step), run in the order asked."""
        if bare_first:
            bare = self.step(api=False)
            return bare, self.step(api=True)
        api = self.step(api=True)
        return self.step(api=False), api

    def step(self, api: bool) -> Step:
        """One train step, then `learner.step` if `api`; each part waited for."""
        batch = self.batches[self.done % NUM_BATCHES]
        self.done += 1
        start = time.perf_counter()
        self.params, self.opt_state, _ = _ready(self.train_step(self.params, self.opt_state, batch))
        trained = time.perf_counter()
        if not api:
            return Step(trained - start)
        cpu = time.thread_time()
        params = self.learner.step(self.params, tokens=self.tokens)
        adopted = params is not self.params  # else the tree given, whose step was waited for
        if adopted:
            _ready(params)
        end, cpu = time.perf_counter(), time.thread_time() - cpu
        self.params = params
        pushed = self.learner.pushed  # started by this call (stats count a push when answered)
        return Step(end - start, end - trained, cpu, pushed, adopted)


def summary_ms(seconds: list[float]) -> dict[str, float | int | None]:
    """count, p50, p90, p99, max and mean of step times, in milliseconds."""
    if not seconds:
        return {"count": 0, "p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    ms = np.asarray(seconds) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "count": len(seconds),
        "p50": round(float(p50), 3),
        "p90": round(float(p90), 3),
        "p99": round(float(p99), 3),
        "max": round(float(ms.max()), 3),
        "mean": round(float(ms.mean()), 3),
    }


def paired_overhead(pairs: list[tuple[Step, Step]], median_bare: float) -> dict[str, Any]:
    """median(API step - its pair's bare step) / median bare step, with a bootstrap 95 %
    interval; None where no pair is given."""
    if not pairs:
        return {"ratio": None, "ci95": None}
    diffs = np.asarray([api.seconds - bare.seconds for bare, api in pairs])
    resampled = diffs[np.random.default_rng(0).integers(0, len(diffs), (BOOTSTRAP, len(diffs)))]
    low, high = np.percentile(np.median(resampled, axis=1), [2.5, 97.5]) / median_bare
    return {
        "ratio": round(float(np.median(diffs)) / median_bare, 5),
        "ci95": [round(float(low), 5), round(float(high), 5)],
    }


def target(got: float | None, want: float) -> dict[str, Any]:
    return {"want": f"<= {want}", "got": got, "met": got is not None and got <= want}


def report(
    loop: Loop,
    pairs: list[tuple[Step, Step]],
    stats_before: dict[str, Any],
    stats: dict[str, Any],
    load_before: float,
) -> dict[str, Any]:
    """The JSON object: step times per kind, the overhead, the pause, the targets."""
    bare = [b.seconds for b, _ in pairs]
    median_bare = float(np.median(bare))
    quiet = [(b, a) for b, a in pairs if not a.sync]
    syncs = [(b, a) for b, a in pairs if a.sync]
    overhead = paired_overhead(quiet, median_bare)
    pause = [a.inside for _, a in syncs]
    pause_p99 = round(float(np.percentile(pause, 99)) * 1e3, 3) if pause else None
    sync_config, plan = loop.learner.sync_config, loop.learner.plan

    def counted(key: str) -> float:
        return round(float(stats.get(key, 0)) - float(stats_before.get(key, 0)), 6)

    return {
        "preset": loop.preset,
        "params": plan.num_params,
        "batch_size": loop.train_cfg.batch_size,
        "context": loop.model_cfg.context,
        "backend": jax.default_backend(),
        "devices": loop.mesh.size,
        "period": sync_config.period,
        "overlap": sync_config.overlap,
        "fragments": plan.num_fragments,
        "method": (
            "pairs of one bare step (the jitted train step) and one API step (the same "
            "step, then learner.step), in one run, bare first and API first in turn; each "
            "step timed alone, dispatch to jax.block_until_ready on its results; "
            f"{WARMUP_PAIRS} warm-up pairs not counted. Overhead: median over the pairs "
            "with no sync due of (API step - bare step), over the median bare step. A "
            "sync step: learner.step started a push or returned an adopted round; its "
            "pause: the wall time inside learner.step"
        ),
        "steps": {"pairs": len(pairs), "warmup_pairs": WARMUP_PAIRS},
        "syncs": {
            "sync_steps": len(syncs),
            "no_sync_steps": len(quiet),
            "pushes_started": sum(a.pushed for _, a in syncs),
            "adoptions": sum(a.adopted for _, a in syncs),
            "refused": counted("refused"),
            "stalled": counted("stalled"),
            "blocked_seconds": counted("blocked_seconds"),
        },
        "bare_step_ms": summary_ms(bare),
        "api_step_no_sync_ms": summary_ms([a.seconds for _, a in quiet]),
        "api_step_sync_ms": summary_ms([a.seconds for _, a in syncs]),
        "overhead_ratio": overhead["ratio"],
        "overhead_ratio_ci95": overhead["ci95"],
        "learner_step_no_sync_ms": summary_ms([a.inside for _, a in quiet]),
        "sync_pause_ms": summary_ms(pause),
        "sync_pause_cpu_ms": summary_ms([a.inside_cpu for _, a in syncs]),
        # a sync step over its pair's bare step: the pause, the sync threads' work that
        # overlaps the step (on CPU they share its cores) and noise
        "sync_step_extra_ms": summary_ms([a.seconds - b.seconds for b, a in syncs]),
        # other work on the machine skews every step time alike, but not every run alike
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_1m_before": round(load_before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
        },
        "targets": {
            "overhead_ratio": target(overhead["ratio"], TARGET_OVERHEAD_RATIO),
            "sync_pause_ms_p99": target(pause_p99, TARGET_SYNC_PAUSE_MS),
        },
    }
