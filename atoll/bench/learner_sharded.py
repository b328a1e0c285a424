"""`atoll bench learner --processes N --sharded`: what each process of a learner whose
params are FSDP-sharded over N processes x 2 CPU devices sends, receives, holds and
costs its training loop, against the whole learner's figures from the same invocation.

One invocation runs two learners, one after the other, each against a fresh real
`atoll syncer` subprocess (quorum 1, no grace: each push closes its round):
  whole: one process holding the same model replicated over its 2 devices; its bytes
    are the whole learner's.
  sharded: N processes (`jax.distributed` on a localhost coordinator, gloo
    collectives) over a 1-D mesh of N x 2 devices, every parameter with two or more
    dimensions split over the mesh on its first axis (FSDP), the 1-D ones (norm
    scales) replicated; optimiser state sharded alike. Each process pushes and adopts
    its own boxes.
Every process of either learner runs `atoll bench learner`'s loop (learner.py: pairs
of a bare and an API step, the same model, batches, warm-up and figures), then a memory
phase, and writes its report; this module puts them side by side.

Bytes: the learner's own counts (`stats`: bytes_sent, bytes_received), i.e. the encoded
frames, without gRPC framing or push headers, from a point with no sync in flight
before the timed pairs to one after them (untimed pairs settle it), so every pull
counted belongs to an adoption counted. Per adoption, so a run that fitted one more
sync in its steps is not counted as sending more; a process's share is its bytes per
adoption over the whole learner's.

Memory: what a sync adds to the host, per window from the `learner.step` that starts a
push to the one that adopts its round, with no train step in between (the loop sleeps
and calls `learner.step` until the adoption), so only the sync's own work (host copy,
encode, push, pull, decode, write back) and the threads it waits on run in it. Two
measures, the larger counted against the process's addressable float32 bytes of the
fragment:
  rss: the peak resident set (VmHWM, reset through /proc/self/clear_refs) over the
    resident set before. It sees every allocator (numpy, XLA's host buffers, gRPC's),
    but only pages newly touched: memory an earlier sync freed and this one reuses from
    malloc's free lists would hide, so the phase first fixes glibc's mmap threshold at
    one page (mallopt): every buffer of a page or more (a box of a shard is tens of
    KiB) is mapped when allocated and unmapped when freed, and counted by each window it
    lives in; smaller ones may still reuse freed memory unseen.
  tracemalloc: Python's peak traced memory over its level before: exact, reuse or not,
    for what it sees (Python objects and numpy arrays), blind to the rest.
Windows where another sync started or was adopted are left out (counted); windows of
the same shape with no sync (`quiet`) show the floor of both measures.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from atoll.bench import learner_loop as bench
from atoll.bench.shard import start_shard
from atoll.learner.api import Learner
from atoll.learner.pytree import leaf_name
from atoll.learner.sync import SyncConfig
from atoll.learner.trainer.model import PRESETS, ModelConfig, Params, init_params, loss_fn
from atoll.learner.trainer.train import TrainConfig, global_batch, make_optimizer
from atoll.server.config import ShardConfig
from atoll.wire.plan import FragmentPlan

P: Callable[..., PartitionSpec] = PartitionSpec  # (untyped in jax)
_ready: Callable[[Any], Any] = jax.block_until_ready  # (untyped in jax)

DEVICES_PER_PROCESS = 2
AXIS = "fsdp"  # the mesh axis parameters and batches are split over
TARGET_BYTES_SHARE = 1.1  # a process's bytes <= 1.1 / n of the whole learner's
TARGET_MEMORY_RATIO = 1.5  # host memory added by a sync <= 1.5 x the process's fragment
MEMORY_SYNCS = 8  # sync windows measured in the memory phase (default)
MEMORY_SLEEP = 0.05  # seconds between the learner.step calls of a window
MEMORY_MAX_CALLS = 400  # learner.step calls a window waits for its adoption, at most
MMAP_THRESHOLD = 4096  # bytes: glibc maps every allocation of a page or more on its own
WORKER_TIMEOUT = 1800.0  # seconds a run's processes may take


def bench_sharded(
    preset: str, steps: int, period: int, processes: int, memory_syncs: int = MEMORY_SYNCS
) -> dict[str, Any]:
    """Runs the whole learner (1 process, replicated) and the sharded one (`processes`
    processes); returns the comparison. Raises ValueError for a setting that cannot work
    and RuntimeError when a process fails (with its log's tail)."""
    try:
        SyncConfig(period=period)
    except ValueError as e:
        raise ValueError(f"--period {period}: {e}") from None
    root = pathlib.Path(tempfile.mkdtemp(prefix="atoll-bench-learner-sharded-"))
    try:
        whole = _run(root / "whole", preset, steps, period, memory_syncs, 1, sharded=False)[0]
        parts = _run(root / "sharded", preset, steps, period, memory_syncs, processes, True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _compare(whole, parts, processes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(
    root: pathlib.Path,
    preset: str,
    steps: int,
    period: int,
    memory_syncs: int,
    processes: int,
    sharded: bool,
) -> list[dict[str, Any]]:
    """One learner of `processes` worker processes against a fresh shard; their reports."""
    root.mkdir(parents=True)
    shard = None
    procs: list[subprocess.Popen[bytes]] = []
    try:
        shard, port, _ = start_shard(
            ShardConfig(
                shard_index=0,
                num_shards=1,
                data_dir=root / "data",
                listen="127.0.0.1:0",
                quorum=1,
                grace_factor=0.0,
                metrics_port=0,
            ),
            root / "syncer.log",
        )
        flags = f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
        coordinator = f"127.0.0.1:{_free_port()}"
        for i in range(processes):
            cmd = [sys.executable, "-m", "atoll.bench.learner_sharded"]
            cmd += ["--shards", f"127.0.0.1:{port}", "--out", str(root / f"{i}.json")]
            cmd += ["--preset", preset, "--steps", str(steps), "--period", str(period)]
            cmd += ["--memory-syncs", str(memory_syncs)]
            cmd += ["--coordinator", coordinator, "--processes", str(processes)]
            cmd += ["--process-id", str(i)] + (["--sharded"] if sharded else [])
            with open(root / f"{i}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        preexec_fn=_killed_with_parent,
                    )
                )
        _wait(procs, root)
        return [json.loads((root / f"{i}.json").read_text()) for i in range(processes)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if shard is not None:
            shard.send_signal(signal.SIGKILL)  # its data is thrown away
            shard.wait()


def _killed_with_parent() -> None:
    """In a worker, before exec: SIGKILL when the bench dies, however it dies (a
    learner's process stopped by SIGTERM may wait on its peers; the data is thrown away)."""
    ctypes.CDLL("libc.so.6").prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def _wait(procs: list[subprocess.Popen[bytes]], root: pathlib.Path) -> None:
    """Until every process exits 0; RuntimeError with its log's tail as soon as one
    fails (the others may wait on it in a collective forever) or past WORKER_TIMEOUT."""
    ends = time.monotonic() + WORKER_TIMEOUT
    while True:
        codes = [proc.poll() for proc in procs]
        for i, code in enumerate(codes):
            if code not in (None, 0):
                tail = (root / f"{i}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"process {i} of the {root.name} learner exited {code}:\n{tail}")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > ends:
            raise RuntimeError(f"the {root.name} learner ran past {WORKER_TIMEOUT:.0f} s")
        time.sleep(0.5)


# --- the comparison (parent) ---


def _per_adoption(report: dict[str, Any], key: str) -> float | None:
    adoptions = report["bytes"]["adoptions"]
    return report["bytes"][key] / adoptions if adoptions else None


def _share(report: dict[str, Any], whole: dict[str, Any], key: str) -> float | None:
    mine, all_ = _per_adoption(report, key), _per_adoption(whole, key)
    return None if mine is None or not all_ else round(mine / all_, 4)


def _compare(whole: dict[str, Any], parts: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The JSON object: the whole learner's bytes, then every process's figures and
    targets; `targets_met` is whether every process met every target."""
    per_process = []
    for r in parts:
        pushed, pulled = _share(r, whole, "pushed"), _share(r, whole, "pulled")
        worst = r["memory"]["ratio_max"]
        targets = {
            "bytes_pushed_share": bench.target(pushed, round(TARGET_BYTES_SHARE / n, 4)),
            "bytes_pulled_share": bench.target(pulled, round(TARGET_BYTES_SHARE / n, 4)),
            "sync_memory_ratio": bench.target(worst, TARGET_MEMORY_RATIO),
            **r["targets"],
            "sync_pause_cpu_ms_p99": bench.target(
                r["sync_pause_cpu_ms"]["p99"], bench.TARGET_SYNC_PAUSE_MS
            ),
        }
        per_process.append(
            {
                "process": r["process"],
                "bytes": {
                    **r["bytes"],
                    "pushed_per_adoption": _per_adoption(r, "pushed"),
                    "pulled_per_adoption": _per_adoption(r, "pulled"),
                    "pushed_share_of_whole": pushed,
                    "pulled_share_of_whole": pulled,
                },
                "addressable_fragment_bytes": r["addressable_fragment_bytes"],
                "memory": r["memory"],
                **{k: r[k] for k in _TIMING},
                "targets": targets,
            }
        )
    first = parts[0]
    return {
        "mode": "sharded",
        "preset": first["preset"],
        "params": first["params"],
        "processes": n,
        "devices_per_process": DEVICES_PER_PROCESS,
        "backend": first["backend"],
        "period": first["period"],
        "fragments": first["fragments"],
        "steps": first["steps"],
        "method": {
            "runs": "the whole learner (1 process, params replicated over its 2 devices), "
            f"then the sharded one ({n} processes x {DEVICES_PER_PROCESS} devices, FSDP), "
            "each against a fresh shard, each process timed as `atoll bench learner` does",
            "bytes": "the learner's stats over the timed pairs: encoded frames only (no "
            "gRPC framing, no push headers), per adoption; share = a process's bytes per "
            "adoption over the whole learner's",
            "memory": "from the learner.step that starts a push to the one that adopts "
            "it, no train step in between: VmHWM (reset at the start) over VmRSS before, "
            f"glibc mmap threshold fixed at {MMAP_THRESHOLD} B so freed buffers are not "
            "reused unseen; and tracemalloc's peak over its level before; ratio = the "
            "larger over the process's addressable float32 bytes of the fragment",
        },
        "whole": {
            "bytes": {
                **whole["bytes"],
                "pushed_per_adoption": _per_adoption(whole, "pushed"),
                "pulled_per_adoption": _per_adoption(whole, "pulled"),
            },
            "addressable_fragment_bytes": whole["addressable_fragment_bytes"],
            "memory": whole["memory"],
            **{k: whole[k] for k in _TIMING},
        },
        "per_process": per_process,
        "targets_met": all(t["met"] for p in per_process for t in p["targets"].values()),
    }


_TIMING = (
    "syncs",
    "bare_step_ms",
    "learner_step_no_sync_ms",  # inside learner.step where no sync was due: the rows
    "overhead_ratio",
    "overhead_ratio_ci95",
    "sync_pause_ms",
    "sync_pause_cpu_ms",
    "host",
)


# --- one process of a learner (worker) ---


class _ShardedLoop(bench.Loop):
    """learner.py's loop (its pair and step), over a mesh of every process's devices,
    params and optimiser state split on their first axis (FSDP) or replicated."""

    def __init__(self, learner: Learner, preset: str, sharded: bool):
        self.learner, self.preset = learner, preset
        self.model_cfg, self.train_cfg = PRESETS[preset], TrainConfig()
        self.mesh = mesh = Mesh(np.asarray(jax.devices()), (AXIS,))
        host = jax.tree.map(np.asarray, init_params(self.model_cfg, self.train_cfg.seed))

        def placed(x: jax.ShapeDtypeStruct) -> NamedSharding:
            return NamedSharding(mesh, _fsdp_spec(x.shape, mesh.size) if sharded else P())

        shardings = jax.tree.map(placed, host)

        def on_devices(x: np.ndarray, s: NamedSharding) -> jax.Array:
            return jax.make_array_from_callback(x.shape, s, lambda i: x[i])

        params = jax.tree.map(
            on_devices,
            host,
            shardings,
        )
        optimizer = make_optimizer(self.train_cfg)
        # the moments split as their params are (same shapes), the counts replicated
        opt_shardings = jax.tree.map(placed, jax.eval_shape(optimizer.init, params))
        self.opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
        rows = NamedSharding(mesh, P(AXIS))
        self.train_step = jax.jit(
            functools.partial(_train_step, optimizer, self.model_cfg),
            in_shardings=(shardings, opt_shardings, rows),
            out_shardings=(shardings, opt_shardings, NamedSharding(mesh, P())),
        )
        rng = np.random.default_rng(0)
        shape = (self.train_cfg.batch_size, self.model_cfg.context + 1)
        self.batches = [
            global_batch(rng.integers(0, self.model_cfg.vocab, shape, np.int32), rows)
            for _ in range(bench.NUM_BATCHES)
        ]
        self.tokens = self.train_cfg.batch_size * self.model_cfg.context
        self.params = learner.join(params)
        self.done = 0


def _fsdp_spec(shape: tuple[int, ...], devices: int) -> PartitionSpec:
    return P(AXIS) if len(shape) >= 2 and shape[0] % devices == 0 else P()


def _train_step(
    optimizer: optax.GradientTransformation,
    model_cfg: ModelConfig,
    params: Params,
    opt_state: optax.OptState,
    batch_BxL1: jax.Array,
) -> tuple[Params, optax.OptState, jax.Array]:
    """train.py's step, its shardings left to the caller's jit."""
    loss, grads = jax.value_and_grad(loss_fn)(params, batch_BxL1, model_cfg)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _settle(loop: _ShardedLoop) -> None:
    """Untimed pairs until two API steps in a row neither pushed nor adopted: no sync is
    in flight, so every pull counted after it belongs to an adoption counted after it."""
    quiet = 0
    for _ in range(4 * loop.learner.sync_config.period):
        _, api = loop.pair(bare_first=True)
        quiet = 0 if api.sync else quiet + 1
        if quiet == 2:
            return


def _addressable_bytes(params: Params, plan: FragmentPlan) -> list[int]:
    """Per fragment, the float32 bytes of the distinct pieces this process's devices hold."""
    out = [0] * plan.num_fragments
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        pieces = {
            tuple(s.indices(n)[:2] for s, n in zip(shard.index, leaf.shape)): shard.data.size
            for shard in leaf.addressable_shards
        }
        with contextlib.suppress(KeyError, ValueError):  # a leaf outside the plan
            out[plan.fragment_of(leaf_name(path))] += 4 * sum(pieces.values())
    return out


def _status_kb(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _window_start() -> tuple[int, int]:
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    tracemalloc.reset_peak()
    return _status_kb("VmRSS"), tracemalloc.get_traced_memory()[0]


def _window_end(start: tuple[int, int]) -> tuple[int, int]:
    rss, traced = start
    return 1024 * (_status_kb("VmHWM") - rss), tracemalloc.get_traced_memory()[1] - traced


def _memory_phase(loop: _ShardedLoop, addressable: list[int], windows: int) -> dict[str, Any]:
    """Peak host memory over `windows` sync windows (push to adoption, no train step)
    and over as many quiet windows of the same shape."""
    ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD: fixed from now
    tracemalloc.start()
    syncs: list[tuple[int, int, float, int]] = []
    quiet: list[tuple[int, int]] = []
    overlapped = 0
    for _ in range(windows * loop.learner.sync_config.period * 4):
        if len(syncs) >= windows and len(quiet) >= windows:
            break
        loop.step(api=False)
        before = {p: v for p, (v, _) in loop.learner.versions.items()}
        start = _window_start()
        window = _window(loop)
        rss, traced = _window_end(start)
        after = {p: v for p, (v, _) in loop.learner.versions.items()}
        moved = [p for p in after if after[p] > before.get(p, 0)]
        if window == "sync" and len(moved) == 1:
            syncs.append((rss, traced, max(rss, traced) / addressable[moved[0]], moved[0]))
        elif window == "quiet" and not moved:
            quiet.append((rss, traced))
        else:
            overlapped += 1
    tracemalloc.stop()
    ratios = [r for _, _, r, _ in syncs]
    return {
        "sync_windows": len(syncs),
        "quiet_windows": len(quiet),
        "windows_left_out": overlapped,  # another sync in them, or never adopted
        "sync_rss_added_bytes": _stats([s[0] for s in syncs]),
        "sync_tracemalloc_added_bytes": _stats([s[1] for s in syncs]),
        "quiet_rss_added_bytes": _stats([q[0] for q in quiet]),
        "quiet_tracemalloc_added_bytes": _stats([q[1] for q in quiet]),
        "fragment_of_window": [s[3] for s in syncs],
        "ratios": [round(r, 4) for r in ratios],
        "ratio_max": round(max(ratios), 4) if ratios else None,
        # each measure alone over the fragment's addressable bytes: which one binds
        "ratio_rss_max": _ratio_max([s[0] for s in syncs], syncs, addressable),
        "ratio_tracemalloc_max": _ratio_max([s[1] for s in syncs], syncs, addressable),
    }


def _ratio_max(
    added: list[int], syncs: list[tuple[int, int, float, int]], addressable: list[int]
) -> float | None:
    ratios = [a / addressable[s[3]] for a, s in zip(added, syncs)]
    return round(max(ratios), 4) if ratios else None


def _window(loop: _ShardedLoop) -> str:
    """learner.step, then (after MEMORY_SLEEP each) until the push it started, if any,
    is adopted, or once more; "sync", "quiet", or "overlapped" (another push started or
    was adopted inside: not one sync's memory alone) or "late" (never adopted)."""
    learner, params = loop.learner, loop.params
    new = learner.step(params, tokens=loop.tokens)
    pushed, other = learner.pushed, new is not params
    params, adopted = _ready(new), False
    for calls in range(MEMORY_MAX_CALLS):
        if calls >= 1 and not (pushed and not adopted):
            break
        time.sleep(MEMORY_SLEEP)
        new = learner.step(params, tokens=loop.tokens)
        other = other or learner.pushed
        if new is not params:
            other, adopted = other or not pushed or adopted, True
            params = _ready(new)
    loop.params = params
    if other:
        return "overlapped"
    if not pushed:
        return "quiet"
    return "sync" if adopted else "late"


def _stats(values: list[int]) -> dict[str, Any]:
    if not values:
        return {"count": 0, "median": None, "max": None}
    return {"count": len(values), "median": int(np.median(values)), "max": int(max(values))}


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """One process: the timed pairs, the memory phase, finish; its report."""
    load_before = os.getloadavg()[0]
    learner = Learner(args.shards, "bench-learner", sync=SyncConfig(period=args.period))
    try:
        loop = _ShardedLoop(learner, args.preset, args.sharded)
        for pair in range(bench.WARMUP_PAIRS):
            loop.pair(bare_first=pair % 2 == 0)
        _settle(loop)
        stats_before = learner.stats
        pairs = [loop.pair(bare_first=pair % 2 == 0) for pair in range(args.steps)]
        _settle(loop)
        stats = learner.stats
        addressable = _addressable_bytes(loop.params, learner.plan)
        memory = _memory_phase(loop, addressable, args.memory_syncs)
        learner.finish(loop.params, timeout=60.0)
    finally:
        learner.close()
    report = bench.report(loop, pairs, stats_before, stats, load_before)

    def delta(key: str) -> int:
        return int(stats.get(key, 0) - stats_before.get(key, 0))

    report["process"] = args.process_id
    report["bytes"] = {
        "pushed": delta("bytes_sent"),
        "pulled": delta("bytes_received"),
        "pushes": delta("pushes"),
        "adoptions": delta("adopted"),
    }
    report["addressable_fragment_bytes"] = addressable
    report["memory"] = memory
    return report


def _worker_main() -> None:
    ap = argparse.ArgumentParser(description="one process of atoll bench learner --sharded")
    ap.add_argument("--shards", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--period", type=int, required=True)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--sharded", action="store_true")
    ap.add_argument("--memory-syncs", type=int, required=True)
    args = ap.parse_args()
    update: Callable[[str, Any], None] = jax.config.update  # (untyped in jax)
    update("jax_cpu_collectives_implementation", "gloo")
    if args.processes > 1:
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
    report = _worker(args)
    pathlib.Path(args.out).write_text(json.dumps(report))


if __name__ == "__main__":
    _worker_main()
