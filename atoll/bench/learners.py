"""`atoll bench learners`: one real shard process under N simulated learners.

Client processes (spawned; each one gRPC channel carrying many learner ids) push tiny
INT4 frames of a two-fragment plan to a real `atoll syncer` subprocess on loopback, for
each N in {10, 100, 1,000, 10,000} (`--learners`), each N on a fresh shard, in two modes:

- steady: N learners; each wave, every learner pushes every fragment once, based on the
  fragment's current version. Learners report a step time and a long period, so a
  fragment's round closes once every live learner is in (quorum 2): a wave is one round
  per fragment. One unmeasured wave, then `--waves` measured ones.
- churn: N learners arrive one after another; each pushes every fragment
  `--churn-pushes` times back to back (the last push of each marked `last`, so rounds
  stop waiting for it) and leaves. They report no step time (no grace: a round closes at
  quorum) and push without pulling, so the shard accepts any staleness here. The lease
  is short (`--churn-lease`): the bench then waits until the shard has forgotten them
  all (PRUNE_AFTER_LEASES leases) and reads what they left in its RSS.

Each push is a Push call of its own (`--transport call`) or, as the learner's client sends
them, a header and a chunk on a PushStream its learner keeps open (`stream`, the default;
atoll/bench/learners_stream.py); `--transport stream,call` measures both, one after the
other, each on a fresh shard. The same number of pushes are in flight at every N
(`--inflight`), so latency compares
what a push costs with more learners remembered, not a longer queue. Read from outside
the shard: CPU time (user + system, /proc/<pid>/stat) over the measured pushes, RSS
(/proc/<pid>/status), versions (Describe, anonymous: no lease). Push latency is each
push's call time at its client.

Targets (issue 41): shard CPU per push at the largest N within 1.5x of the smallest; push
p99 at 1,000 learners within 2x of 10; a 1,000-learner wave (one round of 1,000 pushes)
in at most 0.5 s of shard CPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing as mp
import pathlib
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import grpc
import numpy as np

from atoll.bench.ingest import _cpu_seconds, _proc_status, _recv
from atoll.bench.learners_stream import StreamPushes
from atoll.bench.shard import start_shard
from atoll.commands import positive_int
from atoll.local.processes import _die_with_parent
from atoll.server.config import ShardConfig
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire import syncer_pb2_grpc as pb_grpc
from atoll.wire.client import ShardClient
from atoll.wire.plan import FragmentPlan, TensorSpec

COUNTS = (10, 100, 1000, 10_000)
TRANSPORTS = ("stream", "call")  # a PushStream per learner, or a Push call per push
SPECS = [TensorSpec("w0", (64, 16)), TensorSpec("w1", (64, 16))]  # 2 fragments of 1 Ki params
QUORUM = 2  # as the issue measured: a round needs two learners, closes once all live are in
STEADY_STEP_SECONDS, STEADY_PERIOD = 1.0, 1000  # a cadence far past any wave: no grace closes
TARGET_CPU_RATIO = 1.5  # CPU per push at the largest N over the smallest
TARGET_P99_RATIO = 2.0  # push p99 at 1,000 learners over 10
TARGET_WAVE_CPU_SECONDS = 0.5  # shard CPU for one round of 1,000 pushes
PUSH_DEADLINE = 120.0  # seconds; a push slower than this fails (counted)
REPLY_TIMEOUT = 1800.0  # seconds the bench waits on one client process's wave


# --- the client processes ----------------------------------------------------------


class _Pushes:
    """One client process's learners' pushes over one channel."""

    def __init__(self, address: str, plan: FragmentPlan, threads: int):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.SyncerStub(self.channel)
        self.plan = plan
        rng = np.random.default_rng(0)
        self.frames = [
            codec.encode((rng.standard_normal(n) * 1e-3).astype(np.float32), codec.Codec.INT4)
            for n in plan.fragment_sizes
        ]
        self.seq: Counter[str] = Counter()
        self.pool = concurrent.futures.ThreadPoolExecutor(threads)

    def requests(
        self, learner: str, p: int, base: int, last: bool, steady: bool
    ) -> list[pb.PushRequest]:
        """The learner's next push of fragment p: a header and one chunk."""
        self.seq[learner] += 1
        header = pb.PushHeader(
            learner_id=learner,
            fragment=p,
            base_version=base,
            seq=self.seq[learner],
            inner_steps=8,
            tokens=8 * 512,
            codec=pb.CODEC_INT4,
            num_params=self.plan.fragment_sizes[p],
            plan_fingerprint=self.plan.fingerprint,
            frame_bytes=len(self.frames[p]),
            step_seconds=STEADY_STEP_SECONDS if steady else 0.0,
            overlap_steps=STEADY_PERIOD - 1 if steady else 0,
            period_steps=STEADY_PERIOD if steady else 0,
            last=last,
        )
        return [pb.PushRequest(header=header), pb.PushRequest(chunk=self.frames[p])]

    def push(self, learner: str, p: int, base: int, last: bool, steady: bool) -> dict[str, Any]:
        """One push; {ms, accepted, reason, version} or {failed: status name}."""
        requests = self.requests(learner, p, base, last, steady)
        started = time.perf_counter()
        try:
            ack = self.stub.Push(iter(requests), timeout=PUSH_DEADLINE)
        except grpc.RpcError as e:
            return {"failed": e.code().name}
        ms = (time.perf_counter() - started) * 1e3
        reason = pb.PushReason.Name(ack.reason).removeprefix("PUSH_REASON_").lower()
        return {
            "ms": ms, "accepted": ack.accepted, "reason": reason, "version": ack.version, "p": p,
        }  # fmt: skip

    def join(self, learners: list[str], versions: list[int]) -> list[dict[str, Any]]:
        """Every learner pulls fragment 0 at the version it holds (nothing comes back):
        its lease starts, as a learner's does when it joins, before its first push."""

        def pull(m: str) -> dict[str, Any]:
            request = pb.PullRequest(fragment=0, have_version=versions[0], learner_id=m)
            try:
                for _ in self.stub.Pull(request, timeout=PUSH_DEADLINE):
                    pass
            except grpc.RpcError as e:
                return {"failed": e.code().name}
            return {}

        return [j.result() for j in [self.pool.submit(pull, m) for m in learners]]

    def wave(self, learners: list[str], versions: list[int]) -> list[dict[str, Any]]:
        """Every learner pushes every fragment once, fragment by fragment."""
        out = []
        for p, base in enumerate(versions):
            jobs = [self.pool.submit(self.push, m, p, base, False, True) for m in learners]
            out += [j.result() for j in jobs]
        return out

    def churn(self, learners: list[str], versions: list[int], pushes: int) -> list[dict[str, Any]]:
        """Each learner pushes every fragment `pushes` times back to back and leaves."""
        latest = list(versions)

        def visit(m: str) -> list[dict[str, Any]]:
            done = []
            for k in range(pushes):
                for p in range(len(latest)):
                    r = self.push(m, p, latest[p], k == pushes - 1, False)
                    latest[p] = max(latest[p], r.get("version", 0))
                    done.append(r)
            return done

        return [r for job in [self.pool.submit(visit, m) for m in learners] for r in job.result()]


def _client(conn: Connection, address: str, plan_json: str, threads: int, transport: str) -> None:
    """A client process: runs each ("join" | "wave" | "churn", learners, versions, pushes) it is
    sent and answers with the pushes' results; None ends it."""
    _die_with_parent()
    pushes = _Pushes(address, FragmentPlan.from_json(plan_json), threads)
    streams = StreamPushes(address, pushes.requests, threads, PUSH_DEADLINE)
    sender: _Pushes | StreamPushes = streams if transport == "stream" else pushes
    conn.send("ready")
    while (job := conn.recv()) is not None:
        kind, learners, versions, n = job
        if kind == "join":
            conn.send(pushes.join(learners, versions))
        elif kind == "wave":
            conn.send(sender.wave(learners, versions))
        else:
            conn.send(sender.churn(learners, versions, n))
    streams.close()
    pushes.pool.shutdown()
    pushes.channel.close()


# --- one shard under one crowd -----------------------------------------------------


class _Run:
    """A shard process and its client processes, for one N and one mode."""

    def __init__(
        self, root: pathlib.Path, cfg: ShardConfig, processes: int, inflight: int, transport: str
    ):
        self.plan = FragmentPlan.build(SPECS, len(SPECS))
        root.mkdir(parents=True)
        self.shard, port, _ = start_shard(cfg, root / "syncer.log")
        self.address = f"127.0.0.1:{port}"
        self.clients: list[tuple[Connection, mp.context.SpawnProcess]] = []
        ctx = mp.get_context("spawn")
        threads = max(1, inflight // processes)
        for i in range(processes):
            conn, child = ctx.Pipe()
            proc = ctx.Process(
                target=_client,
                name=f"learners-{i}",
                args=(child, self.address, self.plan.to_json(), threads, transport),
                daemon=True,
            )
            proc.start()
            self.clients.append((conn, proc))
        for conn, proc in self.clients:
            _recv(conn, proc, REPLY_TIMEOUT)
        self.probe = ShardClient(self.address, "")  # anonymous: takes no lease

    def init(self, learner: str) -> None:
        """Seeds every fragment, as `learner` (one of the crowd: its lease is renewed)."""
        init = ShardClient(self.address, learner)
        for p, n in enumerate(self.plan.fragment_sizes):
            frame = codec.encode(np.zeros(n, np.float32), codec.Codec.FP32)
            init.init(self.plan, p, frame, codec.Codec.FP32)
        init.close()

    def versions(self) -> list[int]:
        return [
            f.version for f in sorted(self.probe.describe().fragments, key=lambda f: f.fragment)
        ]

    def rss(self) -> int:
        return _proc_status(self.shard.pid)["VmRSS"]

    def cpu(self) -> float:
        return _cpu_seconds(self.shard.pid)

    def run(
        self, kind: str, learners: list[str], pushes: int = 1, versions: list[int] | None = None
    ) -> list[dict[str, Any]]:
        """Splits `learners` over the client processes, runs `kind` from `versions` (None:
        the shard's now), returns every push's result."""
        versions = self.versions() if versions is None else versions
        n = len(self.clients)
        for i, (conn, _) in enumerate(self.clients):
            conn.send((kind, learners[i::n], versions, pushes))
        return [r for conn, proc in self.clients for r in _recv(conn, proc, REPLY_TIMEOUT)]

    def wait_for(self, check: Callable[[], bool], timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not check():
            if time.monotonic() > end:
                return False
            time.sleep(0.1)
        return True

    def stop(self) -> None:
        for conn, proc in self.clients:
            try:
                conn.send(None)
            except OSError:
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        self.probe.close()
        self.shard.send_signal(signal.SIGKILL)  # the data is thrown away: no final snapshot
        self.shard.wait()


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def _summary(
    results: list[dict[str, Any]], cpu: float, seconds: float, rounds: int
) -> dict[str, Any]:
    """What a phase's pushes and the shard's CPU over them came to."""
    ms = [r["ms"] for r in results if "ms" in r]
    reasons = Counter(r.get("reason") or r.get("failed") for r in results)
    return {
        "pushes": len(results),
        "accepted": sum(1 for r in results if r.get("accepted")),
        "outcomes": dict(sorted(reasons.items())),
        "shard_cpu_seconds": round(cpu, 3),
        "cpu_ms_per_push": round(cpu / len(results) * 1e3, 4) if results else None,
        "push_ms_p50": _pct(ms, 50),
        "push_ms_p99": _pct(ms, 99),
        "seconds": round(seconds, 2),
        "rounds_closed": rounds,
        "rounds_per_second": round(rounds / seconds, 2) if seconds > 0 else None,
    }


def _steady(
    root: pathlib.Path, n: int, waves: int, processes: int, inflight: int, transport: str
) -> dict[str, Any]:
    """N learners, one round per fragment per wave; RSS per learner after the waves (at
    small N mostly the first rounds' one-off allocations)."""
    # a lease longer than any wave: no learner lapses between its pushes
    lease = max(60.0, n * len(SPECS) * 0.02)
    cfg = ShardConfig(
        0, 1, root / "data", listen="127.0.0.1:0", quorum=QUORUM, lease_seconds=lease,
        metrics_port=0,
    )  # fmt: skip
    run = _Run(root, cfg, min(processes, n), inflight, transport)
    try:
        learners = [f"steady-{i}" for i in range(n)]
        run.init(learners[0])
        rss0 = run.rss()
        joins = run.run("join", learners)  # all live before the first push: whole rounds
        run.run("wave", learners)  # unmeasured: the first rounds' one-off costs
        closed = run.wait_for(lambda: min(run.versions()) >= 1, 60.0)
        # measured: no Describe meanwhile (the shard's CPU is the pushes'); a wave's round
        # closes on its last push, whose answer carries the new version
        versions = before = run.versions()
        cpu0, t0 = run.cpu(), time.monotonic()
        results: list[dict[str, Any]] = []
        for _ in range(waves):
            wave = run.run("wave", learners, versions=versions)
            new = [
                max(r.get("version", 0) for r in wave if r.get("p") == p) for p in range(len(SPECS))
            ]
            closed &= new == [v + 1 for v in versions]
            versions, results = [max(a, b) for a, b in zip(new, versions)], results + wave
        seconds, cpu = time.monotonic() - t0, run.cpu() - cpu0
        rounds = sum(run.versions()) - sum(before)
        out = _summary(results, cpu, seconds, rounds)
        out["every_wave_closed_its_rounds"] = closed
        out["joins_failed"] = sum(1 for r in joins if "failed" in r)
        out["waves"] = waves
        out["wave_cpu_seconds"] = round(cpu / (waves * len(SPECS)), 4)
        out["rss_per_learner_bytes"] = round((run.rss() - rss0) / n)
        out["lease_seconds"] = lease
        return out
    finally:
        run.stop()


def _churn(
    root: pathlib.Path,
    n: int,
    pushes: int,
    lease: float,
    processes: int,
    inflight: int,
    transport: str,
) -> dict[str, Any]:
    """N learners that each push a few times and leave; RSS per departed learner once the
    shard has forgotten them."""
    cfg = ShardConfig(
        0, 1, root / "data", listen="127.0.0.1:0", quorum=QUORUM, lease_seconds=lease,
        max_staleness=1 << 30, metrics_port=0,
    )  # fmt: skip
    run = _Run(root, cfg, min(processes, n), inflight, transport)
    try:
        run.init("churn-init")
        run.run("churn", [f"warm-{i}" for i in range(min(n, 50))], pushes)  # one-off costs
        forget = (_prune_after_leases() + 1) * lease + 1.0
        time.sleep(forget)  # the warm-up crowd forgotten too
        rss0, before, cpu0, t0 = run.rss(), sum(run.versions()), run.cpu(), time.monotonic()
        results = run.run("churn", [f"churn-{i}" for i in range(n)], pushes)
        seconds, cpu = time.monotonic() - t0, run.cpu() - cpu0
        out = _summary(results, cpu, seconds, sum(run.versions()) - before)
        time.sleep(forget)  # every one of them forgotten (the round timer ticks meanwhile)
        out["live_after"] = len(run.probe.describe().live_learners)
        out["rss_per_departed_learner_bytes"] = round((run.rss() - rss0) / n)
        out["lease_seconds"] = lease
        return out
    finally:
        run.stop()


def _prune_after_leases() -> int:
    from atoll.server.shard import PRUNE_AFTER_LEASES  # the shard's (jax): not in the clients

    return PRUNE_AFTER_LEASES


def _target(got: float | None, want: float) -> dict[str, Any]:
    return {"got": got, "want": want, "met": got is not None and got <= want}


def _targets(steady: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, from the steady runs that were made."""
    small, large = min(steady), max(steady)
    cpu = [steady[k]["cpu_ms_per_push"] for k in (small, large)]
    ratio = round(cpu[1] / cpu[0], 3) if None not in cpu and cpu[0] else None
    out: dict[str, Any] = {"cpu_per_push_ratio": _target(ratio, TARGET_CPU_RATIO)}
    if 10 in steady and 1000 in steady:
        p99 = steady[1000]["push_ms_p99"] / steady[10]["push_ms_p99"]
        out["push_p99_ratio_1000_over_10"] = _target(round(p99, 3), TARGET_P99_RATIO)
    if 1000 in steady:
        out["wave_cpu_seconds_1000"] = _target(
            steady[1000]["wave_cpu_seconds"], TARGET_WAVE_CPU_SECONDS
        )
    return out


def bench_learners(
    counts: tuple[int, ...] = COUNTS,
    waves: int = 2,
    min_pushes: int = 2000,
    churn_pushes: int = 3,
    churn_lease: float = 2.0,
    processes: int = 4,
    inflight: int = 8,
    modes: tuple[str, ...] = ("steady", "churn"),
    transports: tuple[str, ...] = ("stream",),
) -> dict[str, Any]:
    """Shard CPU per push, push latency, rounds per second and RSS per learner (steady)
    and per departed learner (churn) at each N in `counts`, for the first of `transports`
    (the others' in `other_transports`, each N run with each transport in turn); one
    JSON-able dict.

    Raises ValueError for counts or settings that cannot work.
    """
    if not counts or min(counts) < QUORUM or min(waves, min_pushes, churn_pushes) < 1:
        raise ValueError(
            f"--learners each >= {QUORUM}; --waves, --min-pushes and --churn-pushes >= 1"
        )
    if churn_lease <= 0 or processes < 1 or inflight < 1:
        raise ValueError("--churn-lease must be > 0, --processes and --inflight >= 1")
    if not modes or not set(modes) <= {"steady", "churn"}:
        raise ValueError(f"--modes {','.join(modes)}: want steady, churn or both")
    if (
        not transports
        or not set(transports) <= set(TRANSPORTS)
        or len(set(transports)) < len(transports)
    ):
        raise ValueError(f"--transport {','.join(transports)}: want stream, call or both")
    root = pathlib.Path(tempfile.mkdtemp(prefix="atoll-bench-learners-"))
    started = time.monotonic()
    runs: dict[str, dict[str, dict[int, dict[str, Any]]]] = {
        t: {"steady": {}, "churn": {}} for t in transports
    }
    try:
        for n in sorted(set(counts)):
            n_waves = max(waves, -(-min_pushes // (n * len(SPECS))))  # enough pushes to time
            for t in transports:
                here = root / f"{t}-{n}"
                if "steady" in modes:
                    runs[t]["steady"][n] = _steady(
                        here / "steady", n, n_waves, processes, inflight, t
                    )
                if "churn" in modes:
                    runs[t]["churn"][n] = _churn(
                        here / "churn", n, churn_pushes, churn_lease, processes, inflight, t
                    )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    first, *others = transports
    return {
        "learners": sorted(set(counts)),
        "fragments": len(SPECS),
        "quorum": QUORUM,
        "inflight_pushes": inflight,
        "client_processes": processes,
        "transport": first,
        **_report(runs[first]),
        "other_transports": {t: _report(runs[t]) for t in others},
        "seconds": round(time.monotonic() - started, 1),
    }


def _report(run: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """One transport's figures by mode and N, its CPU ratio and its targets."""
    steady, churn = run["steady"], run["churn"]
    targets = _targets(steady) if steady else {}
    return {
        "steady": {str(k): v for k, v in steady.items()},  # "waves" measured at each N
        "churn": {str(k): v for k, v in churn.items()},
        "cpu_per_push_ratio": targets["cpu_per_push_ratio"]["got"] if steady else None,
        "targets": targets,
    }


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want learner counts like 10,100") from None
    if not counts or min(counts) < QUORUM:
        raise argparse.ArgumentTypeError(f"{text!r}: each count must be >= {QUORUM}")
    return counts


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll bench learners`."""
    p.add_argument(
        "--learners",
        type=_counts,
        default=COUNTS,
        help="learner counts, comma-separated (default 10,100,1000,10000)",
    )
    p.add_argument(
        "--waves", type=positive_int, default=2, help="measured steady waves (default %(default)s)"
    )
    p.add_argument(
        "--min-pushes",
        type=positive_int,
        default=2000,
        help="steady waves enough for this many measured pushes at small N, the shard's "
        "CPU being read in 10 ms ticks (default %(default)s)",
    )
    p.add_argument(
        "--churn-pushes",
        type=positive_int,
        default=3,
        help="pushes of every fragment each churn learner makes before it leaves "
        "(default %(default)s)",
    )
    p.add_argument(
        "--churn-lease",
        type=float,
        default=2.0,
        help="the shard's lease in the churn runs, seconds; the bench waits 11 of them "
        "for departed learners to be forgotten (default %(default)s)",
    )
    p.add_argument(
        "--processes", type=positive_int, default=4, help="client processes (default %(default)s)"
    )
    p.add_argument(
        "--inflight",
        type=positive_int,
        default=8,
        help="pushes in flight at once, at every N (default %(default)s)",
    )
    _add_modes(p)


def _add_modes(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--modes",
        default="steady,churn",
        help="steady, churn or both, comma-separated (default %(default)s)",
    )
    p.add_argument(
        "--transport",
        default="stream",
        help="how pushes travel: stream (a PushStream per learner, as the learner's client "
        "sends them), call (a Push call per push), or both, comma-separated, the first "
        "reported as the result (default %(default)s)",
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        result = bench_learners(
            args.learners,
            args.waves,
            args.min_pushes,
            args.churn_pushes,
            args.churn_lease,
            args.processes,
            args.inflight,
            tuple(m for m in args.modes.split(",") if m),
            tuple(t for t in args.transport.split(",") if t),
        )
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(result, indent=2))
    return 0
