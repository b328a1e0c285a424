"""`atoll bench streams`: one real shard process under a crowd of open streams.

Client processes open W Watch streams (every learner keeps one per shard) and S Push
streams that send their header and then nothing, spread over connections of at most
PER_CONNECTION streams, against a real `atoll syncer` subprocess on loopback. Three
phases of the same length: before the crowd, while it is open, after it has left. In
each, a prober process checks health at a fixed rate and records every latency (a
timeout counts as its deadline), a pusher sends real pushes at a fixed rate (quorum 1,
so each closes a round and every watcher is told of the new version), and the shard's
RSS is sampled from /proc. The shard's stalled-stream timeout is set above the bench's
length, so the stalled pushes stay open throughout instead of timing out.

Targets (docs/design.md §6): health p99 < 100 ms with the crowd open, every push accepted,
and RSS flat: no growth while the crowd sits there (pushes flowing), and what the crowd
took given back once it leaves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from atoll.bench.ingest import _proc_status, _recv, _scrape
from atoll.bench.shard import start_shard
from atoll.commands import positive_int
from atoll.local.processes import _die_with_parent
from atoll.server.config import ShardConfig
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire import syncer_pb2_grpc as pb_grpc
from atoll.wire.client import ShardClient
from atoll.wire.metrics import read_metrics
from atoll.wire.plan import FragmentPlan, TensorSpec

TARGET_HEALTH_P99_MS = 100.0
TARGET_RSS_GROWTH_MB = 16.0  # while the crowd is open, and from one crowd to the next
PER_CONNECTION = 50  # streams per client connection (the shard allows 64)
PROBE_INTERVAL = 0.02  # seconds between health checks
PROBE_DEADLINE = 5.0  # a health check slower than this counts as this
OPEN_TIMEOUT = 120.0  # seconds a client process waits for all its streams to open
SERVICE = "atoll.v1.Syncer"
SPECS = [TensorSpec(f"w{i}", (512, 128)) for i in range(4)]  # 4 fragments of 64 Ki params


# --- the client processes ----------------------------------------------------------


def _crowd(
    conn: Connection,
    address: str,
    kind: str,
    count: int,
    first: int,
    frame_bytes: int,
    plan_json: str,
) -> None:
    """`count` Watch streams, or Push streams that stall after their header, opened on
    one asyncio loop; reports when they are open, closes them when told to."""
    _die_with_parent()  # a bench killed mid-phase takes its children with it
    asyncio.run(
        _crowd_async(
            conn, address, kind, count, first, frame_bytes, FragmentPlan.from_json(plan_json)
        )
    )


async def _crowd_async(
    conn: Connection,
    address: str,
    kind: str,
    count: int,
    first: int,
    frame_bytes: int,
    plan: FragmentPlan,
) -> None:
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(-(-count // PER_CONNECTION))
    ]
    opened, notices, errors = asyncio.Semaphore(0), [0], list[str]()
    stall = asyncio.Event()  # never set: the stalled pushes' request streams wait on it

    async def watch(i: int, stub: pb_grpc.SyncerStub) -> None:
        seen = 0
        try:
            async for _ in stub.Watch(pb.WatchRequest(learner_id=f"watcher-{first + i}")):
                seen += 1
                notices[0] += 1
                if seen == plan.num_fragments:  # the current version of every fragment: open
                    opened.release()
        except grpc.aio.AioRpcError as e:
            errors.append(e.code().name)

    async def stalled(i: int, stub: pb_grpc.SyncerStub) -> None:
        async def requests() -> AsyncIterator[pb.PushRequest]:
            yield pb.PushRequest(
                header=pb.PushHeader(
                    learner_id=f"staller-{first + i}",
                    fragment=0,
                    base_version=0,
                    seq=1,
                    inner_steps=1,
                    tokens=1,
                    codec=pb.CODEC_INT4,
                    num_params=plan.fragment_sizes[0],
                    plan_fingerprint=plan.fingerprint,
                    frame_bytes=frame_bytes,
                )
            )
            opened.release()  # sent; the shard's open-call gauge says when it arrived
            await stall.wait()

        try:
            await stub.Push(requests())
        except grpc.aio.AioRpcError as e:
            errors.append(e.code().name)

    started = time.monotonic()
    run = watch if kind == "watch" else stalled
    tasks = [
        asyncio.ensure_future(run(i, pb_grpc.SyncerStub(channels[i // PER_CONNECTION])))
        for i in range(count)
    ]
    ready = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(OPEN_TIMEOUT):
            while ready < count:
                await opened.acquire()
                ready += 1
    conn.send(
        {
            "opened": ready,
            "opened_seconds": time.monotonic() - started,
            "connections": len(channels),
            "errors": sorted(set(errors)),
        }
    )
    await asyncio.get_running_loop().run_in_executor(
        None, conn.recv
    )  # the parent says when to leave
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close()
    conn.send({"notices": notices[0], "errors": sorted(set(errors))})


def _prober(conn: Connection, address: str) -> None:
    """Checks health every PROBE_INTERVAL until told to stop; sends the latencies."""
    _die_with_parent()
    channel = grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service=SERVICE)
    while True:
        conn.recv()  # start a phase
        latencies, failures = list[float](), 0
        while not conn.poll():
            started = time.perf_counter()
            try:
                ok = (
                    stub.Check(request, timeout=PROBE_DEADLINE).status
                    == health_pb2.HealthCheckResponse.SERVING
                )
            except grpc.RpcError:
                ok = False
            latencies.append(time.perf_counter() - started)
            failures += not ok
            time.sleep(max(0.0, PROBE_INTERVAL - latencies[-1]))
        if conn.recv() is None:  # end the phase; None: and leave
            conn.send({"latencies": latencies, "failures": failures})
            break
        conn.send({"latencies": latencies, "failures": failures})
    channel.close()


# --- the phases --------------------------------------------------------------------


def _percentile_ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 2) if values else None


class _Pusher:
    """Real pushes at a fixed interval, one learner, fragments in turn (quorum 1: each
    push closes its fragment's round)."""

    def __init__(self, address: str, plan: FragmentPlan) -> None:
        self.client = ShardClient(address, "bench-pusher", deadline=30.0)
        self.plan = plan
        self.frames = [
            codec.encode(np.random.default_rng(p).standard_normal(n).astype(np.float32) * 1e-3)
            for p, n in enumerate(plan.fragment_sizes)
        ]
        self.versions = [0] * plan.num_fragments
        self.seq = 0

    def run(self, seconds: float, interval: float) -> dict[str, Any]:
        latencies, accepted, refused, failed = list[float](), 0, 0, list[str]()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            p = self.seq % self.plan.num_fragments
            self.seq += 1
            header = pb.PushHeader(
                fragment=p,
                base_version=self.versions[p],
                seq=self.seq,
                inner_steps=10,
                tokens=10_000,
                codec=pb.CODEC_INT4,
                num_params=self.plan.fragment_sizes[p],
                plan_fingerprint=self.plan.fingerprint,
            )
            started = time.perf_counter()
            try:
                ack = self.client.push(header, self.frames[p])
            except grpc.RpcError as e:
                failed.append(e.code().name)
            else:
                latencies.append(time.perf_counter() - started)
                self.versions[p] = ack.version
                accepted += ack.accepted
                refused += not ack.accepted
            time.sleep(max(0.0, interval - (time.perf_counter() - started)))
        return {
            "pushes": accepted + refused + len(failed),
            "pushes_accepted": accepted,
            "pushes_refused": refused,
            "pushes_failed": sorted(set(failed)),
            "push_ms_p50": _percentile_ms(latencies, 50),
            "push_ms_p99": _percentile_ms(latencies, 99),
        }


def _phase(
    prober: tuple[Connection, SpawnProcess],
    pusher: _Pusher,
    shard_pid: int,
    seconds: float,
    push_interval: float,
) -> dict[str, Any]:
    """Probes health and pushes for `seconds`; RSS at the start and end of the phase."""
    conn, proc = prober
    rss_start = _proc_status(shard_pid)["VmRSS"]
    conn.send("start")
    pushed = pusher.run(seconds, push_interval)
    conn.send("stop")
    probed = _recv(conn, proc)
    rss_end = _proc_status(shard_pid)["VmRSS"]
    lat = probed["latencies"]
    return {
        "health_checks": len(lat),
        "health_failures": probed["failures"],
        "health_ms_p50": _percentile_ms(lat, 50),
        "health_ms_p99": _percentile_ms(lat, 99),
        "health_ms_max": _percentile_ms(lat, 100),
        **pushed,
        "rss_mb_start": round(rss_start / 2**20, 1),
        "rss_mb_end": round(rss_end / 2**20, 1),
    }


def _gauge(metrics_port: int, name: str, label: str = "") -> float:
    value: float = _scrape(metrics_port).get(name, {}).get(label, 0.0)
    return value


def _open_calls(metrics_port: int) -> dict[str, float]:
    """atoll_open_calls by method."""
    return {
        s.labels["method"]: s.value
        for s in read_metrics(f"127.0.0.1:{metrics_port}", timeout=10)
        if s.name == "atoll_open_calls"
    }


def _wait_for(check: Callable[[], bool], timeout: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what} not reached after {timeout:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - started


class _Crowd:
    """The client processes: watchers spread over `processes`, the stalled pushes in one more."""

    def __init__(
        self,
        ctx: SpawnContext,
        address: str,
        metrics_port: int,
        watches: int,
        stalled: int,
        processes: int,
        frame_bytes: int,
        plan: FragmentPlan,
    ) -> None:
        self.watches, self.stalled, self.metrics_port = watches, stalled, metrics_port
        self.frame_bytes = frame_bytes
        sizes = [watches // processes + (i < watches % processes) for i in range(processes)]
        self.jobs = [("watch", n, sum(sizes[:i])) for i, n in enumerate(sizes) if n]
        self.jobs += [("stall", stalled, 0)] if stalled else []
        self.procs: list[tuple[Connection, SpawnProcess]] = []
        for kind, n, first in self.jobs:
            conn, child = ctx.Pipe()
            proc = ctx.Process(
                target=_crowd,
                name=f"crowd-{kind}-{first}",
                daemon=True,
                args=(child, address, kind, n, first, frame_bytes, plan.to_json()),
            )
            proc.start()
            self.procs.append((conn, proc))

    def opened(self) -> dict[str, Any]:
        """Waits until every stream is open at the shard; returns what the clients saw."""
        started = time.monotonic()
        reports = [_recv(conn, proc, timeout=OPEN_TIMEOUT + 60) for conn, proc in self.procs]
        if any(r["opened"] < n for r, (_, n, _) in zip(reports, self.jobs)):
            raise RuntimeError(f"the crowd did not open: {reports}")
        _wait_for(
            lambda: (
                _open_calls(self.metrics_port).get("Watch", 0) >= self.watches
                and _gauge(self.metrics_port, "atoll_inflight_frame_bytes")
                >= self.stalled * self.frame_bytes
            ),
            120,
            "the crowd open at the shard",
        )
        return {
            "connections": sum(r["connections"] for r in reports),
            "seconds": round(
                max(r["opened_seconds"] for r in reports) + time.monotonic() - started, 2
            ),
        }

    def leave(self) -> dict[str, Any]:
        """Closes every stream; waits until the shard has let go of them."""
        for conn, _ in self.procs:
            conn.send("leave")
        left = [_recv(conn, proc, timeout=120) for conn, proc in self.procs]
        seconds = _wait_for(
            lambda: not any(_open_calls(self.metrics_port).get(m, 0) for m in ("Watch", "Push")),
            60,
            "the crowd gone",
        )
        self.close()
        return {
            "seconds": round(seconds, 2),
            "errors": sorted({e for r in left for e in r["errors"]}),
            "notices": sum(
                r["notices"] for r, (kind, _, _) in zip(left, self.jobs) if kind == "watch"
            ),
        }

    def close(self) -> None:
        for _, proc in self.procs:
            if proc.pid is not None:
                proc.join(5)
            if proc.is_alive():
                proc.kill()


def _rss_mb(pid: int) -> float:
    return round(_proc_status(pid)["VmRSS"] / 2**20, 1)


# --- the bench ---------------------------------------------------------------------


def bench_streams(
    watches: int = 2000,
    stalled: int = 200,
    seconds: float = 20.0,
    push_interval: float = 1.0,
    crowd_processes: int = 4,
) -> dict[str, Any]:
    """Health latency, pushes and RSS of one shard process before, during and after a crowd.

    Raises ValueError for counts or durations that cannot work.
    """
    if (
        watches < 0
        or stalled < 0
        or watches + stalled == 0
        or seconds <= 0
        or push_interval <= 0
        or crowd_processes < 1
    ):
        raise ValueError(
            "--watches and --stalled must be >= 0 (not both 0), --seconds and --push-interval "
            "> 0, --crowd-processes >= 1"
        )
    plan = FragmentPlan.build(SPECS, len(SPECS))
    ctx = mp.get_context("spawn")
    rig = _Rig(pathlib.Path(tempfile.mkdtemp(prefix="atoll-bench-streams-")))
    load_before = os.getloadavg()[0]
    try:
        # Above the whole bench (three phases, two crowds opening): no stream times out inside it.
        rig.start(ctx, plan, idle_seconds=3 * seconds + 600)
        figures = _run(rig, ctx, plan, watches, stalled, crowd_processes, seconds, push_interval)
    finally:
        rig.close()
    report = {
        "watch_streams": watches,
        "stalled_pushes": stalled,
        "streams_per_connection": PER_CONNECTION,
        "client_connections": figures["opened"]["connections"],
        "seconds_per_phase": seconds,
        "push_interval_s": push_interval,
    }
    return {**report, **_streams_report(figures, watches + stalled, seconds, load_before)}


class _Rig:
    """What one bench runs and must stop: the shard process, the prober, the pusher and the
    crowd open now, with the shard's directory `root`."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.shard: subprocess.Popen[str] | None = None
        self.prober: tuple[Connection, SpawnProcess] | None = None
        self.crowd: _Crowd | None = None
        self.pusher: _Pusher | None = None
        self.address, self.metrics_port = "", 0

    def start(self, ctx: SpawnContext, plan: FragmentPlan, idle_seconds: float) -> None:
        """Starts the shard (its fragments initialised), the pusher and the prober."""
        self.shard, port, self.metrics_port = start_shard(
            ShardConfig(
                shard_index=0,
                num_shards=1,
                data_dir=self.root / "data",
                listen="127.0.0.1:0",
                quorum=1,
                grace_factor=0.0,
                metrics_port=0,
                stream_idle_seconds=idle_seconds,
            ),
            self.root / "syncer.log",
        )
        self.address = f"127.0.0.1:{port}"
        init = ShardClient(self.address, "bench-init")
        for p, n in enumerate(plan.fragment_sizes):
            init.init(
                plan, p, codec.encode(np.zeros(n, np.float32), codec.Codec.INT4), codec.Codec.INT4
            )
        init.close()
        self.pusher = _Pusher(self.address, plan)
        conn, child = ctx.Pipe()
        prober = ctx.Process(target=_prober, name="prober", args=(child, self.address), daemon=True)
        self.prober = (conn, prober)
        prober.start()

    def close(self) -> None:
        try:
            if self.crowd is not None:
                self.crowd.close()
            if self.prober is not None and self.prober[1].pid is not None:
                self.prober[1].join(5)
                if self.prober[1].is_alive():
                    self.prober[1].kill()
            if self.pusher is not None:
                self.pusher.client.close()
        finally:  # whatever failed above, the shard process goes
            if self.shard is not None:
                # the data is thrown away: no final snapshot needed
                self.shard.send_signal(signal.SIGKILL)
                self.shard.wait()
            shutil.rmtree(self.root, ignore_errors=True)


def _run(
    rig: _Rig,
    ctx: SpawnContext,
    plan: FragmentPlan,
    watches: int,
    stalled: int,
    processes: int,
    seconds: float,
    push_interval: float,
) -> dict[str, Any]:
    """The phases: before, during and after a crowd, then after the same crowd again."""
    # rig.start set them
    assert rig.shard is not None and rig.pusher is not None and rig.prober is not None
    pid, pusher, prober = rig.shard.pid, rig.pusher, rig.prober

    def phase(length: float) -> dict[str, Any]:
        return _phase(prober, pusher, pid, length, push_interval)

    def crowd() -> _Crowd:
        frame_bytes = len(pusher.frames[0])
        args = (rig.address, rig.metrics_port, watches, stalled, processes, frame_bytes, plan)
        rig.crowd = c = _Crowd(ctx, *args)
        return c

    pusher.run(2.0, push_interval)  # warm up: the first outer steps compile
    out: dict[str, Any] = {"before": phase(seconds)}
    first = crowd()
    out["opened"] = first.opened()
    out["open_calls"] = _open_calls(rig.metrics_port)
    out["during"] = phase(seconds)
    out["left"] = first.leave()
    time.sleep(2.0)
    out["after"] = phase(seconds)
    # The same crowd again: what the first left behind must not grow with the second.
    second = crowd()
    second.opened()
    out["rss_second_open"] = _rss_mb(pid)
    second.leave()
    time.sleep(2.0)
    out["again"] = phase(seconds / 2)
    prober[0].send("start")
    prober[0].send(None)
    _recv(*prober)
    out["peak"] = round(_proc_status(pid)["VmHWM"] / 2**20, 1)
    return out


def _streams_report(
    f: dict[str, Any], streams: int, seconds: float, load_before: float
) -> dict[str, Any]:
    """The phases' figures, RSS, the host and the targets met, from `_run`'s figures `f`."""
    before, during, after, again = f["before"], f["during"], f["after"], f["again"]
    opened, left = f["opened"], f["left"]
    held = during["rss_mb_start"] - before["rss_mb_end"]
    phases = {"before": before, "during": during, "after": after, "after_second_crowd": again}
    return {
        "crowd_open_seconds": opened["seconds"],
        "crowd_leave_seconds": left["seconds"],
        "open_calls_at_shard": f["open_calls"],
        "watch_notices_received": left["notices"],
        "watch_notices_per_s": round(left["notices"] / (seconds + opened["seconds"]), 1),
        "crowd_errors": left["errors"],
        **phases,
        "rss_mb": {
            "before": before["rss_mb_end"],
            "crowd_open": during["rss_mb_start"],
            "crowd_open_end": during["rss_mb_end"],
            "after": after["rss_mb_end"],
            "second_crowd_open": f["rss_second_open"],
            "after_second_crowd": again["rss_mb_end"],
            "peak": f["peak"],
        },
        "rss_kb_per_open_stream": round(held * 1024 / max(1, streams), 1),
        "rss_note": (
            "crowd_open - before: what the open streams hold; after - before: what the first crowd "
            "leaves behind (gRPC and allocator caches, grown tables), reused by the next crowd: "
            "after_second_crowd - after is the growth from crowd to crowd"
        ),
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_1m_before": round(load_before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
        },
        "targets": _targets(phases),
    }


def _targets(phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Health p99 with the crowd open, every push accepted, RSS flat: wanted, got, met."""
    during = phases["during"]
    p99 = during["health_ms_p99"]
    growth_open = during["rss_mb_end"] - during["rss_mb_start"]
    growth_again = phases["after_second_crowd"]["rss_mb_end"] - phases["after"]["rss_mb_end"]
    return {
        "health_p99_ms": {
            "want": f"< {TARGET_HEALTH_P99_MS:g} with the crowd open, no failed check",
            "got": p99,
            "met": p99 is not None
            and p99 < TARGET_HEALTH_P99_MS
            and during["health_failures"] == 0,
        },
        "pushes_accepted": {
            "want": "every push, in every phase",
            "got": {k: f"{ph['pushes_accepted']}/{ph['pushes']}" for k, ph in phases.items()},
            "met": all(ph["pushes_accepted"] == ph["pushes"] > 0 for ph in phases.values()),
        },
        "rss_flat": {
            "want": f"<= {TARGET_RSS_GROWTH_MB:g} MB growth while the crowd is open and pushes "
            f"flow, and <= {TARGET_RSS_GROWTH_MB:g} MB from one crowd to the next",
            "got": {"while_open": round(growth_open, 1), "crowd_to_crowd": round(growth_again, 1)},
            "met": growth_open <= TARGET_RSS_GROWTH_MB and growth_again <= TARGET_RSS_GROWTH_MB,
        },
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll bench streams`."""
    p.add_argument(
        "--watches", type=int, default=2000, help="open Watch streams (default %(default)s)"
    )
    p.add_argument(
        "--stalled",
        type=int,
        default=200,
        help="Push streams that send their header, then nothing (default %(default)s)",
    )
    p.add_argument(
        "--seconds", type=float, default=20.0, help="length of each phase (default %(default)s)"
    )
    p.add_argument(
        "--push-interval",
        type=float,
        default=1.0,
        help="seconds between real pushes; each closes a round and notifies every "
        "watcher (default %(default)s)",
    )
    p.add_argument(
        "--crowd-processes",
        type=positive_int,
        default=4,
        help="client processes holding the Watch streams (default %(default)s)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (the only output format)"
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        result = bench_streams(
            args.watches, args.stalled, args.seconds, args.push_interval, args.crowd_processes
        )
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(result, indent=2))
    return 0
