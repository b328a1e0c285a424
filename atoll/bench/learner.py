"""`atoll bench learner`: what `atoll.Learner` costs the training loop it sits in.

One process trains a `learner/trainer/model.py` preset with the built-in jitted step
(`learner/trainer/train.py`: AdamW, `TrainConfig`'s batch size) on random byte batches, joined
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

`--processes N --sharded` runs this loop in every process of a learner whose params
are FSDP-sharded over N processes x 2 CPU devices, beside a 1-process learner of the
same model, and adds each process's bytes and sync memory (atoll/bench/learner_sharded.py).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import tempfile
from typing import Any

from atoll.bench.learner_loop import WARMUP_PAIRS, Loop, report
from atoll.bench.learner_sharded import MEMORY_SYNCS, bench_sharded
from atoll.bench.shard import start_shard
from atoll.commands import positive_int
from atoll.learner import defaults
from atoll.learner.api import Learner
from atoll.learner.sync import SyncConfig
from atoll.learner.trainer.model import PRESETS
from atoll.server.config import ShardConfig

DEFAULT_STEPS = 128


def bench_learner(
    preset: str = defaults.PRESET, steps: int = DEFAULT_STEPS, period: int = defaults.PERIOD
) -> dict[str, Any]:
    """Times `steps` pairs of train steps, one bare and one with `learner.step` after it.

    Raises ValueError for a setting that cannot work (before any process starts).
    """
    try:
        sync = SyncConfig(period=period)  # its checks, before a shard starts for nothing
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
        learner = Learner(f"127.0.0.1:{port}", "bench-learner", sync=sync)
        loop = Loop(learner, preset)
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
    return report(loop, pairs, stats_before, stats, load_before)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll bench learner`."""
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=defaults.PRESET,
        help=f"the model trained (learner/trainer/model.py; default {defaults.PRESET})",
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
        "--processes",
        type=positive_int,
        default=1,
        help="with --sharded: the processes of the sharded learner, each with "
        "2 CPU devices (default 1)",
    )
    p.add_argument(
        "--sharded",
        action="store_true",
        help="params FSDP-sharded over --processes x 2 CPU devices, each process's bytes, "
        "sync memory and step costs beside a 1-process learner's "
        "(atoll/bench/learner_sharded.py)",
    )
    p.add_argument(
        "--memory-syncs",
        type=positive_int,
        default=MEMORY_SYNCS,
        help="with --sharded: syncs whose host memory is measured, per process "
        f"(default {MEMORY_SYNCS})",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (the only output format)"
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.processes > 1 and not args.sharded:
        parser.error(f"--processes {args.processes}: only a --sharded learner spans processes here")
    try:
        if args.sharded:
            result = bench_sharded(
                args.preset, args.steps, args.period, args.processes, args.memory_syncs
            )
        else:
            result = bench_learner(args.preset, args.steps, args.period)
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(result, indent=2))
    return 0
