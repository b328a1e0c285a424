"""`atoll bench learner`: what `atoll.Learner` costs the training loop it sits in.

One process trains a `learner/model.py` preset with the built-in jitted step
(`learner/train.py`: AdamW, `TrainConfig`'s batch size) on random byte batches, joined
as one learner to a real `atoll syncer` subprocess (quorum 1, no grace: each push
closes its round). Steps run in pairs, one bare (the jitted step alone) and one with
the API (the same step, then `params = learner.step(params)`), the pair's order
alternating (bare first, then API first), so drift and other work on the machine land
on both kinds alike and neither always follows the other. Each step is timed alone,
from its dispatch to `jax.block_until_ready` on its output (and on what `learner.step`
returned); warm-up pairs first compile and are not counted. The learner is called
after every other train step, so it sees steps twice as long as the bare ones: its
period of H steps, and the shards' cadence, span 2H train steps of wall time.

The figures (docs/design.md §6, "learner overhead"):
  overhead_ratio: over the pairs whose API step had no sync due (no push started,
    nothing adopted), the median of (API step - bare step of the same pair), over the
    median bare step. Pairing cancels drift in the machine's speed; `overhead_ratio_ci95`
    (a bootstrap of those pairs) is how far noise alone moves it.
  sync_pause_ms: at each step where a push started or a round was adopted, the wall
    time the training thread spent inside `learner.step` (the copy of the fragment to
    the host and its handoff to a sync thread, or the write of the adopted tensors).
    `sync_pause_cpu_ms` is that thread's CPU time there: the work itself, without the
    waits for a core or for the GIL that other processes and threads cause.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import tempfile
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import atoll
from atoll.bench.shard import start_shard
from atoll.commands import positive_int
from atoll.learner import config as defaults
from atoll.learner.model import PRESETS, init_params
from atoll.learner.sync import SyncConfig
from atoll.learner.train import (
    DATA_AXIS,
    TrainConfig,
    data_mesh,
    global_batch,
    make_optimizer,
    make_train_step,
)
from atoll.server.config import ShardConfig

TARGET_OVERHEAD_RATIO = 0.01  # an API step with no sync due over its bare pair (docs/design.md §6)
TARGET_SYNC_PAUSE_MS = 5.0  # p99 of the wall time inside learner.step at a sync point (§6)
WARMUP_PAIRS = 3  # the first two steps compile (uncommitted, then committed params)
NUM_BATCHES = 8  # distinct random batches, cycled
DEFAULT_STEPS = 128
BOOTSTRAP = 2000  # resamples of the overhead's confidence interval


@dataclasses.dataclass(frozen=True)
class _Step:
    """One timed step; the part inside `learner.step` is 0 for a bare one."""

    seconds: float  # the whole step, dispatch to results ready (wall)
    inside: float = 0.0  # of which inside learner.step (wall)
    inside_cpu: float = 0.0  # the training thread's CPU time inside learner.step
    pushed: bool = False  # learner.step started a push
    adopted: bool = False  # learner.step returned adopted fragments

    @property
    def sync(self) -> bool:
        return self.pushed or self.adopted


class _Loop:
    """The training loop under test: the built-in jitted step over random byte batches."""

    def __init__(self, learner: atoll.Learner, preset: str):
        self.learner, self.preset = learner, preset
        self.model_cfg, self.train_cfg = PRESETS[preset], TrainConfig()
        self.mesh = data_mesh()
        optimizer = make_optimizer(self.train_cfg)
        self.train_step = make_train_step(self.model_cfg, optimizer, self.mesh)
        rng = np.random.default_rng(0)
        shape = (self.train_cfg.batch_size, self.model_cfg.context + 1)
        rows = NamedSharding(self.mesh, PartitionSpec(DATA_AXIS))
        self.batches = [
            global_batch(rng.integers(0, self.model_cfg.vocab, shape, np.int32), rows)
            for _ in range(NUM_BATCHES)
        ]
        self.tokens = self.train_cfg.batch_size * self.model_cfg.context
        self.params = learner.join(init_params(self.model_cfg, self.train_cfg.seed))
        replicated = NamedSharding(self.mesh, PartitionSpec())
        self.opt_state = jax.jit(optimizer.init, out_shardings=replicated)(self.params)
        self.done = 0

    def pair(self, bare_first: bool) -> tuple[_Step, _Step]:
        """(bare step, API step), run in the order asked."""
        if bare_first:
            bare = self.step(api=False)
            return bare, self.step(api=True)
        api = self.step(api=True)
        return self.step(api=False), api

    def step(self, api: bool) -> _Step:
        """One train step, then `learner.step` if `api`; each part waited for."""
        batch = self.batches[self.done % NUM_BATCHES]
        self.done += 1
        start = time.perf_counter()
        self.params, self.opt_state, _ = jax.block_until_ready(
            self.train_step(self.params, self.opt_state, batch)
        )
        trained = time.perf_counter()
        if not api:
            return _Step(trained - start)
        cpu = time.thread_time()
        params = self.learner.step(self.params, tokens=self.tokens)
        adopted = params is not self.params  # else the tree given, whose step was waited for
        if adopted:
            jax.block_until_ready(params)
        end, cpu = time.perf_counter(), time.thread_time() - cpu
        self.params = params
        pushed = self.learner.pushed  # started by this call (stats count a push when answered)
        return _Step(end - start, end - trained, cpu, pushed, adopted)


def _summary_ms(seconds: list[float]) -> dict[str, float | int | None]:
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


def _paired_overhead(pairs: list[tuple[_Step, _Step]], median_bare: float) -> dict:
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


def _target(got: float | None, want: float) -> dict:
    return {"want": f"<= {want}", "got": got, "met": got is not None and got <= want}


def bench_learner(
    preset: str = defaults.PRESET, steps: int = DEFAULT_STEPS, period: int = defaults.PERIOD
) -> dict:
    """Times `steps` pairs of train steps, one bare and one with `learner.step` after it.

    Raises ValueError for a setting that cannot work (before any process starts).
    """
    try:
        SyncConfig(period=period)  # its checks, before a shard starts for nothing
    except ValueError as e:
        raise ValueError(f"--period {period}: {e}") from None
    load_before = os.getloadavg()[0]
    root = pathlib.Path(tempfile.mkdtemp(prefix="atoll-bench-learner-"))
    shard = learner = None
    try:
        shard, port, _ = start_shard(
            ShardConfig(
                shard_index=0,
                num_shards=1,
                data_dir=root / "data",
                listen="127.0.0.1:0",
                quorum=1,  # each push closes its round: no wait on other learners
                grace_factor=0.0,
                metrics_port=0,  # start_shard waits for both ports
            ),
            root / "syncer.log",
        )
        learner = atoll.Learner(f"127.0.0.1:{port}", "bench-learner", period=period)
        loop = _Loop(learner, preset)
        for pair in range(WARMUP_PAIRS):
            loop.pair(bare_first=pair % 2 == 0)
        stats_before = learner.stats
        pairs = [loop.pair(bare_first=pair % 2 == 0) for pair in range(steps)]
        stats = learner.stats
        learner.finish(loop.params, timeout=30.0)
    finally:
        if learner is not None:
            learner.close()
        if shard is not None:
            # The data is thrown away, so no clean stop (and its final snapshot) is waited for.
            shard.send_signal(signal.SIGKILL)
            shard.wait()
        shutil.rmtree(root, ignore_errors=True)
    return _report(loop, pairs, stats_before, stats, load_before)


def _report(
    loop: _Loop,
    pairs: list[tuple[_Step, _Step]],
    stats_before: dict,
    stats: dict,
    load_before: float,
) -> dict:
    """The JSON object: step times per kind, the overhead, the pause, the targets."""
    bare = [b.seconds for b, _ in pairs]
    median_bare = float(np.median(bare))
    quiet = [(b, a) for b, a in pairs if not a.sync]
    syncs = [(b, a) for b, a in pairs if a.sync]
    overhead = _paired_overhead(quiet, median_bare)
    pause = [a.inside for _, a in syncs]
    pause_p99 = round(float(np.percentile(pause, 99)) * 1e3, 3) if pause else None
    sync_config, plan = loop.learner.sync_config, loop.learner.plan

    def counted(key: str) -> float:
        return round(stats.get(key, 0) - stats_before.get(key, 0), 6)

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
        "bare_step_ms": _summary_ms(bare),
        "api_step_no_sync_ms": _summary_ms([a.seconds for _, a in quiet]),
        "api_step_sync_ms": _summary_ms([a.seconds for _, a in syncs]),
        "overhead_ratio": overhead["ratio"],
        "overhead_ratio_ci95": overhead["ci95"],
        "learner_step_no_sync_ms": _summary_ms([a.inside for _, a in quiet]),
        "sync_pause_ms": _summary_ms(pause),
        "sync_pause_cpu_ms": _summary_ms([a.inside_cpu for _, a in syncs]),
        # a sync step over its pair's bare step: the pause, the sync threads' work that
        # overlaps the step (on CPU they share its cores) and noise
        "sync_step_extra_ms": _summary_ms([a.seconds - b.seconds for b, a in syncs]),
        # other work on the machine skews every step time alike, but not every run alike
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_1m_before": round(load_before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
        },
        "targets": {
            "overhead_ratio": _target(overhead["ratio"], TARGET_OVERHEAD_RATIO),
            "sync_pause_ms_p99": _target(pause_p99, TARGET_SYNC_PAUSE_MS),
        },
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll bench learner`."""
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=defaults.PRESET,
        help=f"the model trained (learner/model.py; default {defaults.PRESET})",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=DEFAULT_STEPS,
        help=f"measured pairs of steps, one bare and one with the API (default {DEFAULT_STEPS})",
    )
    p.add_argument(
        "--period",
        type=positive_int,
        default=defaults.PERIOD,
        help="H, learner steps between two syncs of one fragment, >= 2 "
        f"(default {defaults.PERIOD}, the learners')",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (the only output format)"
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        result = bench_learner(args.preset, args.steps, args.period)
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(result, indent=2))
    return 0
