"""`atoll bench ingest`: how fast one real shard process takes in 4-bit pushes.

N simulated learners (spawned processes, so the shard rather than one client GIL is
the bottleneck) push pre-encoded INT4 outer gradients of a transformer-shaped model
to a real `atoll syncer` subprocess over loopback, over `--connections` connections
spread evenly over them (one each by default), each connection one push at a time,
rounds closing at quorum N with no grace. Every push is timed by its learner from its
first message to its ack (p50/p90/p99). The anchor is measured in the same run: the same
messages, in the same chunks and over as many concurrent streams, through a no-op
gRPC server (another process) that only drains them; it runs before and after the
ingest and the faster run is kept, so the ratio errs low. MB = 10^6 bytes.

The shard's fsync latency comes from its /metrics histogram (PromQL's
histogram_quantile over the measured phase only), its memory and CPU time from /proc.
What the shard spends per MB of frames (core_ms_per_mb) is set against what that work
costs at the least, measured in the same run on the same frames (`ingest_limit`: one
core decoding, merging and logging them): cost_over_limit travels to any machine, where
MB/s depends on how many cores the shard gets. `--cores 1,2` runs the measured rounds
again with the shard pinned to 1 and then 2 CPUs (the learners on the others).

This module runs the bench; `ingest_report` derives the figures and checks the targets,
`ingest_clients` holds the learner processes and the no-op server, `ingest_limit` the
limit's work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from atoll.bench.ingest_clients import learner, serve_raw
from atoll.bench.ingest_limit import run_limit
from atoll.bench.ingest_report import Layout, Measured, delta, percentiles_ms, report
from atoll.bench.shard import start_shard
from atoll.commands import positive_int
from atoll.server.config import ShardConfig
from atoll.wire import codec
from atoll.wire.client import ShardClient
from atoll.wire.metrics import read_metrics
from atoll.wire.plan import FragmentPlan, TensorSpec

DEFAULT_PARAMS = 100_000_000

_Child = tuple[Connection, BaseProcess]  # a child process and the parent's end of its pipe


def transformer_specs(num_params: int) -> list[TensorSpec]:
    """A decoder-only transformer's tensors, with at least `num_params` values.

    Width d grows as √num_params (768 at 100 M); an untied embedding and output head of
    16·d tokens, then as many blocks (attention, MLP 4·d, two norms) as it takes.
    """
    d = max(64, 64 * round(math.sqrt(num_params / 160) / 64))
    vocab = 16 * d
    specs = [
        TensorSpec("embed", (vocab, d)),
        TensorSpec("head/w", (d, vocab)),
        TensorSpec("final_norm", (d,)),
    ]
    block = 12 * d * d + 2 * d
    layers = max(1, -(-(num_params - sum(s.size for s in specs)) // block))
    for i in range(layers):
        specs += [
            TensorSpec(f"blocks/{i:03d}/{name}", shape)
            for name, shape in (
                ("attn/wqkv", (d, 3 * d)),
                ("attn/wo", (d, d)),
                ("mlp/w_in", (d, 4 * d)),
                ("mlp/w_out", (4 * d, d)),
                ("norm1", (d,)),
                ("norm2", (d,)),
            )
        ]
    return specs


# --- reading the shard from outside -------------------------------------------------


def _proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    out = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _scrape(port: int) -> dict[str, dict[Any, float]]:
    """{metric name: {le or label value or "": value}} from the shard's /metrics."""
    out: dict[str, dict[Any, float]] = {}
    for s in read_metrics(f"127.0.0.1:{port}", timeout=10):
        key = s.labels.get("le", s.labels.get("reason", ""))
        out.setdefault(s.name, {})[float(key) if "le" in s.labels else key] = s.value
    return out


def _delta_ring(address: str) -> dict[str, int]:
    """The shard's delta ring capacity and the size of its newest delta of every fragment."""
    probe = ShardClient(address, "")  # no learner id: an anonymous reader takes no lease
    try:
        described = probe.describe()
        delta_bytes = 0
        for f in described.fragments:
            pulled = probe.pull(f.fragment, have_version=f.version - 1)
            delta_bytes += sum(len(frame) for _, _, frame in pulled.frames)
    finally:
        probe.close()
    return {"capacity": described.settings.delta_ring, "delta_bytes": delta_bytes}


def _recv(conn: Connection, proc: BaseProcess, timeout: float = 600.0) -> Any:
    """The child's next message; raises instead of waiting forever on a child that died."""
    deadline = time.monotonic() + timeout
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"bench process {proc.name} exited with {proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench process {proc.name} sent nothing for {timeout:.0f} s")
    return conn.recv()


def _run_phase(learners: list[_Child], phase: str, rounds: int) -> dict[str, Any]:
    """Starts every learner on one phase and gathers the span from first push to last ack."""
    for conn, _ in learners:
        conn.send((phase, rounds))
    results = [_recv(conn, proc) for conn, proc in learners]
    refused: dict[str, int] = {}
    for r in results:
        for k, v in r["refused"].items():
            refused[k] = refused.get(k, 0) + v
    return {
        "seconds": max(r["ended"] for r in results) - min(r["started"] for r in results),
        "latency": [t for r in results for t in r["latency"]],
        "bytes": sum(r["bytes"] for r in results),
        "accepted": sum(r["accepted"] for r in results),
        "accepted_params": sum(r["accepted_params"] for r in results),
        "refused": refused,
        "client_cpu_seconds": sum(r["cpu_seconds"] for r in results),
    }


def _pin(pid: int, cpus: list[int]) -> None:
    """Every thread of process `pid` onto `cpus` (taskset -a); threads it starts later
    inherit it from the thread that starts them."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile


def _pin_all(
    shard_pid: int, learners: list[_Child], shard_cpus: list[int], client_cpus: list[int]
) -> None:
    _pin(shard_pid, shard_cpus)
    for _, proc in learners:
        if proc.pid is not None:  # None only before it starts
            _pin(proc.pid, client_cpus)
    _pin(os.getpid(), client_cpus)


def _pinned_phase(
    shard_pid: int, learners: list[_Child], cpus: list[int], k: int, rounds: int
) -> dict[str, Any]:
    """`rounds` ingest rounds with the shard pinned to the first k CPUs and the learners
    (and the bench) to the others, or to all of them where none are left."""
    shard_cpus, client_cpus = cpus[:k], cpus[k:] or cpus
    _pin_all(shard_pid, learners, shard_cpus, client_cpus)
    cpu_before = _cpu_seconds(shard_pid)
    phase = _run_phase(learners, "ingest", rounds)
    cpu = _cpu_seconds(shard_pid) - cpu_before
    mb = phase["bytes"] / 1e6
    return {
        "shard_cpus": shard_cpus,
        "client_cpus": client_cpus,
        "wire_mb_per_s": round(mb / phase["seconds"], 1),
        "cpu_cores_busy": round(cpu / phase["seconds"], 2),
        "core_ms_per_mb": round(cpu * 1e3 / mb, 3),
        "push_latency_ms": percentiles_ms(phase["latency"]),
        "pushes_accepted": phase["accepted"],
    }


def _limit(
    ctx: mp.context.SpawnContext,
    plan: FragmentPlan,
    learners: int,
    rounds: int,
    data_dir: pathlib.Path,
    fsyncs: int,
    cpus: list[int],
) -> dict[str, Any]:
    """`ingest_limit.measure` in a child process on one core, over the learners' frames."""
    cpu = cpus[0] if len(cpus) > 1 else None
    conn, child = ctx.Pipe()
    proc = ctx.Process(
        target=run_limit,
        name="ingest-limit",
        daemon=True,
        args=(child, plan.to_json(), learners, rounds, str(data_dir / "limit.log"), fsyncs, cpu),
    )
    proc.start()
    try:
        result: dict[str, Any] = _recv(conn, proc)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    result["pinned_cpu"] = cpu
    return result


def parse_cores(text: str) -> list[int]:
    """--cores: "1,2" -> [1, 2]; each a CPU count this process may use."""
    try:
        cores = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want CPU counts like 1,2") from None
    if not cores or any(k < 1 for k in cores):
        raise argparse.ArgumentTypeError(f"{text!r}: want CPU counts of at least 1, like 1,2")
    return cores


# --- the bench ----------------------------------------------------------------------


def _layout(
    num_params: int,
    learners: int,
    fragments: int,
    rounds: int,
    warmup_rounds: int,
    connections: int | None,
    cores: list[int] | None,
    cpus: list[int],
    parts: int = 1,
) -> Layout:
    """The run's layout; ValueError (worded for the flags) where one cannot run."""
    if cores and max(cores) > len(cpus):
        raise ValueError(f"--cores {max(cores)}: this host lets the bench use {len(cpus)} CPUs")
    connections = learners if connections is None else connections
    if connections < learners:
        raise ValueError(f"--connections {connections}: want at least one per learner ({learners})")
    if connections > learners * fragments:
        raise ValueError(
            f"--connections {connections}: at most {learners * fragments} (one per learner "
            "and fragment) can push at once"
        )
    per_learner = [connections // learners + (i < connections % learners) for i in range(learners)]
    specs = transformer_specs(num_params)
    if len(specs) < fragments:
        raise ValueError(
            f"--fragments {fragments}: the {num_params}-param model has only "
            f"{len(specs)} tensors; use --fragments <= {len(specs)} or more --params"
        )
    if parts > min(s.shape[0] for s in specs):
        raise ValueError(f"--parts {parts}: more than the rows of the model's smallest tensor")
    plan = FragmentPlan.build(specs, fragments)
    return Layout(plan, learners, connections, per_learner, fragments, rounds, warmup_rounds, parts)


@dataclasses.dataclass
class _Run:
    """The processes of one run, filled in as each starts so that `_stop` ends those that did."""

    ctx: mp.context.SpawnContext
    shard: subprocess.Popen[str] | None = None
    port: int = 0  # the shard's gRPC port
    metrics_port: int = 0
    rss_start: int = 0  # the shard's VmRSS once serving, before Init
    raw: _Child | None = None  # (pipe, process) of the no-op gRPC server
    learners: list[_Child] = dataclasses.field(default_factory=list)  # (pipe, process) per learner


def _start(run: _Run, lay: Layout, root: pathlib.Path) -> None:
    """The shard, the no-op server and the learners; then the shard's fragments are Init'ed."""
    run.shard, run.port, run.metrics_port = start_shard(
        ShardConfig(
            shard_index=0,
            num_shards=1,
            data_dir=root / "data",
            listen="127.0.0.1:0",
            quorum=lay.learners,
            grace_factor=0.0,
            metrics_port=0,
        ),
        root / "syncer.log",
    )
    run.rss_start = _proc_status(run.shard.pid)["VmRSS"]
    raw_conn, child = run.ctx.Pipe()
    raw = run.ctx.Process(target=serve_raw, name="raw-grpc-server", args=(child,), daemon=True)
    raw.start()
    run.raw = (raw_conn, raw)  # started: `_stop` ends it
    raw_port = _recv(raw_conn, raw)
    for i in range(lay.learners):
        conn, child = run.ctx.Pipe()
        proc = run.ctx.Process(
            target=learner,
            name=f"learner-{i}",
            daemon=True,
            args=(
                child,
                i,
                f"127.0.0.1:{run.port}",
                f"127.0.0.1:{raw_port}",
                lay.plan.to_json(),
                lay.per_learner[i],
                lay.parts,
            ),
        )
        proc.start()
        run.learners.append((conn, proc))
    _init_fragments(f"127.0.0.1:{run.port}", lay.plan)


def _init_fragments(address: str, plan: FragmentPlan) -> None:
    """Every fragment's first version: small random values, INT4-encoded."""
    init = ShardClient(address, "bench-init")
    rng = np.random.default_rng(12345)
    for p, size in enumerate(plan.fragment_sizes):
        values = rng.standard_normal(size, dtype=np.float32) * np.float32(0.02)
        init.init(plan, p, codec.encode(values, codec.Codec.INT4), codec.Codec.INT4)
    del values
    init.close()


def _stop(run: _Run) -> None:
    """Ends whatever of `run` started."""
    # learners first: a server that goes away under an open channel makes gRPC log it
    for stage in [run.learners, [run.raw] if run.raw else []]:
        for conn, _ in stage:
            try:
                conn.send(None)
            except OSError:
                pass
        for _, proc in stage:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    if run.shard is not None:
        # The data is thrown away, so no clean stop (and its final snapshot) is waited for.
        run.shard.send_signal(signal.SIGKILL)
        run.shard.wait()


def _warm_up(learners: list[_Child], warmup_rounds: int) -> None:
    """Every learner watches (and is live) before any pushes; then the unmeasured rounds."""
    for conn, _ in learners:
        conn.send(("watch", 0))
    for conn, proc in learners:
        _recv(conn, proc)
    if warmup_rounds:
        _run_phase(learners, "ingest", warmup_rounds)


def _shard_pid(run: _Run) -> int:
    if run.shard is None:
        raise RuntimeError("the shard has not started")
    return run.shard.pid


def _measured_ingest(run: _Run, rounds: int) -> dict[str, Any]:
    """The measured ingest rounds, the shard's metrics, CPU time and memory read around them."""
    pid = _shard_pid(run)
    before = _scrape(run.metrics_port)
    cpu_before = _cpu_seconds(pid)
    try:  # "5" resets VmHWM, so the peak below is the measured phase's own
        pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")
        peak_scope = "the measured phase"
    except OSError:
        peak_scope = "the shard's whole life (could not reset VmHWM)"
    ingest = _run_phase(run.learners, "ingest", rounds)
    cpu_shard = _cpu_seconds(pid) - cpu_before
    after = _scrape(run.metrics_port)
    return {
        "ingest": ingest,
        "cpu_shard": cpu_shard,
        "before": before,
        "after": after,
        "mem": _proc_status(pid),
        "peak_scope": peak_scope,
    }


def _measure(
    run: _Run, lay: Layout, cores: list[int] | None, cpus: list[int], data_dir: pathlib.Path
) -> Measured:
    """Warm-up, then raw, ingest, the limit, any pinned rounds, and raw again."""
    frame_bytes = [_recv(conn, proc) for conn, proc in run.learners]  # frames are encoded
    bits_per_param = 8 * sum(map(sum, frame_bytes)) / (lay.learners * lay.plan.num_params)
    _warm_up(run.learners, lay.warmup_rounds)
    raw_before = _run_phase(run.learners, "raw", lay.rounds)
    shard = _measured_ingest(run, lay.rounds)
    ring = _delta_ring(f"127.0.0.1:{run.port}")
    fsync_counts = delta(shard["after"], shard["before"], "atoll_wal_fsync_seconds_count")
    fsyncs = int(fsync_counts.get("", 0.0))
    limit = _limit(run.ctx, lay.plan, lay.learners, lay.rounds, data_dir, fsyncs, cpus)
    pid = _shard_pid(run)
    pinned = {k: _pinned_phase(pid, run.learners, cpus, k, lay.rounds) for k in cores or []}
    if pinned:
        _pin_all(pid, run.learners, cpus, cpus)
    return Measured(
        rss_start=run.rss_start,
        bits_per_param=bits_per_param,
        raw_before=raw_before,
        **shard,
        ring=ring,
        fsyncs=fsyncs,
        limit=limit,
        pinned=pinned,
        raw_after=_run_phase(run.learners, "raw", lay.rounds),
    )


def bench_ingest(
    num_params: int = DEFAULT_PARAMS,
    learners: int = 4,
    fragments: int = 8,
    rounds: int = 4,
    warmup_rounds: int = 1,
    connections: int | None = None,
    cores: list[int] | None = None,
    parts: int = 1,
) -> dict[str, Any]:
    """Ingest rate, push latency, fsync latency and memory of one shard process under N learners.

    Every learner pushes each fragment once per round; `warmup_rounds` go first,
    unmeasured (the shard jit-compiles one outer step per fragment size there).
    `connections` (default: one per learner, at least `learners`) are spread evenly
    over the learner processes, each connection pushing its share of the fragments
    one at a time. Raises ValueError for a layout with fewer tensors than fragments or
    fewer connections than learners.

    The shard's CPU per MB of frames is set against `ingest_limit.measure` of the same
    frames on one core (cost_over_limit). With `cores` (CPU counts, e.g. [1, 2]) the
    measured rounds run again with the shard pinned to that many CPUs each, the learners
    on the rest; ValueError for more CPUs than this process may use. With `parts` > 1
    every push comes in that many parts (each tensor split by rows, as FSDP over as many
    processes holds it), one after another on its connection.
    """
    cpus = sorted(os.sched_getaffinity(0))
    lay = _layout(
        num_params, learners, fragments, rounds, warmup_rounds, connections, cores, cpus, parts
    )
    load_before = os.getloadavg()[0]
    run = _Run(mp.get_context("spawn"))
    root = pathlib.Path(tempfile.mkdtemp(prefix="atoll-bench-ingest-"))
    try:
        _start(run, lay, root)
        measured = _measure(run, lay, cores, cpus, root / "data")
    finally:
        _stop(run)
        shutil.rmtree(root, ignore_errors=True)
    return report(lay, measured, load_before)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll bench ingest`."""
    p.add_argument(
        "--params",
        type=positive_int,
        default=100_000_000,
        help="model size; a transformer-shaped tensor list of at least this "
        "many parameters (default 100000000)",
    )
    p.add_argument(
        "--learners",
        type=positive_int,
        default=4,
        help="simulated learner processes, also the quorum (default 4)",
    )
    p.add_argument("--fragments", type=positive_int, default=8, help="fragments (default 8)")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=4,
        help="measured pushes per learner per fragment (default 4)",
    )
    p.add_argument(
        "--warmup-rounds",
        type=int,
        choices=range(0, 10),
        default=1,
        metavar="N",
        help="unmeasured rounds first, 0-9 (default 1)",
    )
    p.add_argument(
        "--connections",
        type=positive_int,
        default=None,
        help="push connections, spread evenly over the learner processes; at least "
        "--learners (default: one per learner)",
    )
    p.add_argument(
        "--cores",
        type=parse_cores,
        default=None,
        metavar="K,K",
        help="then run the measured rounds again with the shard pinned to K CPUs each "
        "(e.g. 1,2), the learners on the rest, and report MB/s per K and their ratio",
    )
    p.add_argument(
        "--parts",
        type=positive_int,
        default=1,
        help="send every push in this many parts, each tensor split by rows as FSDP over "
        "that many processes holds it (default 1: whole pushes)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (the only output format)"
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        result = bench_ingest(
            args.params,
            args.learners,
            args.fragments,
            args.rounds,
            args.warmup_rounds,
            args.connections,
            args.cores,
            args.parts,
        )
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(result, indent=2))
    return 0
