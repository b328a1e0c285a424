"""Data-parallel training across processes: the baseline `atoll bench wan` runs over WAN links.

R processes, one per region, train one model as a single `jax.distributed` job: each step
every process computes the gradient of its own rows, the gradients (and the loss) are
all-reduced across the processes by XLA's CPU collectives over gloo, and every process
applies the same AdamW update to its replica. Process p reads the rows atoll's learner p
reads (`Batches(learner=p, num_learners=R)`), so both runs see the same data, and the
optimiser is the learners' (learner/trainer/train.py's `make_optimizer`) with a global batch of
R × batch_size.

The three phases of a step are timed apart (compute, all-reduce, update), so the bench
can say what the all-reduce costs against the compute step. With `processes=1` and
`shards=R` one process trains on the R shards' rows at once: the one-process reference
the collective must match.

The coordination service runs in a process of its own (`coordinator`), so it can sit on
the host side of emulated links while every worker sits in its region:

    python -m atoll.bench.data_parallel coordinator --port P --processes R
    python -m atoll.bench.data_parallel worker --coordinator HOST:P --process-id I \\
        --gloo-host ADDR --config JSON --out FILE
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from atoll.learner.config import LearnerConfig
from atoll.learner.defaults import EVAL_BATCHES, SEED
from atoll.local.processes import _die_with_parent

WORKER_START_SECONDS = 300.0  # jax.distributed's wait for every process to join
READY = "coordinator ready"
# how long a stopped coordinator waits for its workers to leave: killed ones never do, and
# the service's own shutdown waited for them for minutes after a stopped bench had exited
SHUTDOWN_WAIT_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class DataParallelConfig:
    preset: str = "tiny"  # model preset (learner.trainer.model.PRESETS)
    shards: int = 2  # R: data shards (atoll's learners), one per process in a job, >= 1
    batch_size: int = 16  # sequences per shard per step; the global batch is shards x this
    steps: int = 200  # optimiser steps, >= 1
    lr: float = LearnerConfig.lr  # AdamW peak learning rate (the learners' default)
    warmup: int = LearnerConfig.warmup  # warm-up steps (the learners' default)
    eval_every: int = 0  # steps between held-out evaluations on process 0; 0: only at the end
    eval_batches: int = EVAL_BATCHES  # held-out batches of batch_size rows per evaluation
    seed: int = SEED  # init and data order

    def __post_init__(self) -> None:
        for field in ("shards", "batch_size", "steps", "eval_batches"):
            value = getattr(self, field)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{field} must be an int >= 1, got {value!r}")
        if not (isinstance(self.eval_every, int) and self.eval_every >= 0):
            raise ValueError(f"eval_every must be an int >= 0, got {self.eval_every!r}")


def _use_gloo_host(host: str) -> None:
    """The CPU backend's gloo collectives bind `host` (by default they resolve the hostname,
    127.0.0.1 here, which no other region can reach)."""
    import jax
    from jax._src import distributed, xla_bridge
    from jaxlib import _jax  # jax._src.lib's _jax; it ships no stub (Any)

    update: Callable[[str, Any], None] = jax.config.update  # (untyped in jax)
    update("jax_cpu_collectives_implementation", "gloo")

    def cpu_client() -> Any:
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, hostname=host
        )
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", cpu_client, priority=0)


@dataclasses.dataclass
class _Replica:
    """One process's part of the job: its rows, the step's compiled pieces, and its model."""

    model_cfg: Any  # learner.trainer.model's config of cfg.preset
    shards: list[Any]  # Batches of the shards this process trains on
    heldout: Any  # held-out batches (process 0 evaluates on them)
    local_mesh: Any  # evaluation's mesh: this process's first device
    size: int  # parameters; a gradient vector holds them, then the loss
    gradient: Callable[..., Any]  # (params, batch) -> the gradient and the loss, one vector
    update: Callable[..., Any]  # (params, opt_state, vector) -> (params, opt_state)
    all_reduce: Callable[[Any], Any]  # vector -> the mean of every process's vector
    params: Any
    opt_state: Any

    def eval_loss(self, params: Any, batches: Any) -> float:
        """The mean held-out loss of `params` over `batches`."""
        from atoll.learner.trainer.train import evaluate

        return evaluate(params, batches, self.model_cfg, self.local_mesh)["loss"]


def _step_pieces(
    model_cfg: Any, optimizer: Any, params: Any, num_processes: int
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[[Any], Any], int]:
    """The step's three compiled pieces (gradient, update, all-reduce) and the vector's
    parameter count."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.flatten_util import ravel_pytree
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from atoll.learner.trainer.model import loss_fn

    flat, unravel = ravel_pytree(params)
    size = flat.size

    @jax.jit
    def gradient(
        params: Any, batch_BxL1: Any
    ) -> Any:  # the mean loss's gradient and the loss, one vector
        loss, grads = jax.value_and_grad(loss_fn)(params, batch_BxL1, model_cfg)
        return jnp.append(ravel_pytree(grads)[0], loss)

    @jax.jit
    def update(params: Any, opt_state: Any, vector: Any) -> Any:
        updates, opt_state = optimizer.update(unravel(vector[:size]), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    mesh = Mesh(np.asarray(jax.devices()), ("p",))
    spec: Callable[..., PartitionSpec] = PartitionSpec  # (untyped in jax)
    from_local: Callable[..., jax.Array] = jax.make_array_from_process_local_data  # (untyped)
    rows = NamedSharding(mesh, spec("p"))
    mean = jax.jit(lambda g: g.mean(axis=0), out_shardings=NamedSharding(mesh, spec()))

    def all_reduce(vector: Any) -> Any:
        """The mean of every process's vector (XLA's all-reduce: gloo on CPU)."""
        if num_processes == 1:
            return vector
        local = np.asarray(vector)[None]
        stacked = from_local(rows, local, (num_processes, size + 1))
        return mean(stacked).addressable_data(0)

    return gradient, update, all_reduce, size


def _replica(cfg: DataParallelConfig, process_id: int, num_processes: int) -> _Replica:
    """This process's data, model, optimiser and step, the model on its first device."""
    import jax

    from atoll.learner.trainer.data import Batches, eval_batches, load_corpus
    from atoll.learner.trainer.model import init_params, preset
    from atoll.learner.trainer.train import TrainConfig, data_mesh, make_optimizer

    model_cfg = preset(cfg.preset)
    corpus = load_corpus(None, vocab=model_cfg.vocab)
    tcfg = TrainConfig(
        batch_size=cfg.batch_size * cfg.shards,
        peak_lr=cfg.lr,
        warmup_steps=min(cfg.warmup, cfg.steps - 1),
        total_steps=cfg.steps,
        seed=cfg.seed,
    )
    mine = range(cfg.shards) if num_processes == 1 else [process_id]
    shards = [
        Batches(
            corpus.train,
            context=model_cfg.context,
            batch_size=cfg.batch_size,
            learner=i,
            num_learners=cfg.shards,
            seed=cfg.seed,
        )
        for i in mine
    ]
    optimizer = make_optimizer(tcfg)
    params = init_params(model_cfg, cfg.seed)
    opt_state = optimizer.init(params)
    gradient, update, all_reduce, size = _step_pieces(model_cfg, optimizer, params, num_processes)
    heldout = eval_batches(
        corpus.heldout,
        context=model_cfg.context,
        batch_size=cfg.batch_size,
        num_batches=cfg.eval_batches,
    )
    local_mesh = data_mesh(jax.local_devices()[:1])
    params, opt_state = jax.device_put((params, opt_state), jax.local_devices()[0])
    return _Replica(
        model_cfg=model_cfg,
        shards=shards,
        heldout=heldout,
        local_mesh=local_mesh,
        size=size,
        gradient=gradient,
        update=update,
        all_reduce=all_reduce,
        params=params,
        opt_state=opt_state,
    )


def _compile(r: _Replica) -> None:
    """Compiles everything before the clock starts: two steps on a copy of the model (the
    first step's inputs are placed differently from later ones'); the last all-reduce waits
    for every process."""
    import jax

    warm_params, warm_state = r.params, r.opt_state
    for step in range(2):
        batch = np.concatenate([s[step] for s in r.shards])
        vector = r.all_reduce(r.gradient(warm_params, batch))
        r.eval_loss(warm_params, r.heldout[:1])
        warm_params, warm_state = r.update(warm_params, warm_state, vector)
    wait: Callable[[Any], Any] = jax.block_until_ready  # (untyped in jax)
    wait(r.all_reduce(vector))


def _step(r: _Replica, step: int) -> tuple[float, dict[str, float], Any]:
    """One step, each phase waited for and timed: its seconds, each phase's, and the
    all-reduced vector (the mean gradient, then the mean loss)."""
    import jax

    wait: Callable[[Any], Any] = jax.block_until_ready  # (untyped in jax)
    start = time.perf_counter()
    batch = np.concatenate([s[step] for s in r.shards]) if len(r.shards) > 1 else r.shards[0][step]
    vector = r.gradient(r.params, batch).block_until_ready()
    computed = time.perf_counter()
    vector = r.all_reduce(vector)
    vector = wait(vector)
    reduced = time.perf_counter()
    r.params, r.opt_state = r.update(r.params, r.opt_state, vector)
    r.params = wait(r.params)
    done = time.perf_counter()
    phases = {
        "compute_s": computed - start,
        "all_reduce_s": reduced - computed,
        "update_s": done - reduced,
    }
    return done - start, phases, vector


class _Records:
    """A run's records, each stamped with its step, training time, wall time and tokens."""

    def __init__(
        self, tokens_per_step: int, on_record: Callable[[dict[str, Any]], None] | None
    ) -> None:
        self.rows: list[dict[str, Any]] = []
        self.clock = 0.0  # seconds of training (evaluations excluded)
        self.tokens_per_step = tokens_per_step
        self.on_record = on_record

    def add(self, step: int, row: dict[str, Any]) -> None:
        row = {
            "step": step,
            "time": round(self.clock, 4),  # seconds of training before this record
            "wall": time.time(),  # when (the bench finds the training window with it)
            "tokens": step * self.tokens_per_step,
            **row,
        }
        self.rows.append(row)
        if self.on_record is not None:
            self.on_record(row)


def train(
    cfg: DataParallelConfig,
    process_id: int = 0,
    num_processes: int = 1,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Trains; every process returns the same summary (process 0's evaluations included).

    With one process it trains on all `cfg.shards` shards' rows per step; with several,
    `num_processes` must equal `cfg.shards` and process p trains on shard p.
    """
    if num_processes not in (1, cfg.shards):
        raise ValueError(
            f"{num_processes} processes for {cfg.shards} shards: use 1 or {cfg.shards}"
        )
    r = _replica(cfg, process_id, num_processes)
    _compile(r)
    records = _Records(cfg.batch_size * cfg.shards * r.model_cfg.context, on_record)

    def evaluate_now(step: int) -> None:
        if process_id == 0:
            records.add(step, {"eval_loss": r.eval_loss(r.params, r.heldout)})

    evaluate_now(0)
    phases: dict[str, list[float]] = {"compute_s": [], "all_reduce_s": [], "update_s": []}
    for step in range(cfg.steps):
        seconds, times, vector = _step(r, step)
        records.clock += seconds
        for name, t in times.items():
            phases[name].append(t)
        if process_id == 0:
            records.add(step + 1, {"loss": float(vector[r.size])})
        if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == cfg.steps:
            evaluate_now(step + 1)
    return _summary(cfg, num_processes, r.size, records, phases)


def _summary(
    cfg: DataParallelConfig,
    num_processes: int,
    size: int,
    records: _Records,
    phases: dict[str, Any],
) -> dict[str, Any]:
    """What `train` returns: the run's shape, its time, its last evaluation, its records."""
    evals = [row for row in records.rows if "eval_loss" in row]
    return {
        "config": dataclasses.asdict(cfg),
        "processes": num_processes,
        "params": int(size),
        "steps": cfg.steps,
        "tokens": cfg.steps * records.tokens_per_step,
        "train_seconds": records.clock,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "median": {k: float(np.median(v)) for k, v in phases.items()},
        "records": records.rows,
    }


# -- processes --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_coordinator(processes: int, port: int) -> subprocess.Popen[str]:
    """The coordination service on 127.0.0.1:port in a child; returns once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "atoll.bench.data_parallel", "coordinator"]
        + ["--port", str(port), "--processes", str(processes)],
        stdout=subprocess.PIPE,
        stderr=open(os.environ.get("ATOLL_DP_COORD_LOG", os.devnull), "w"),
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if READY not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the coordination service did not start (exit {proc.returncode})")
    return proc


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where worker p runs: a command prefix (a region), the coordinator's and gloo's address."""

    prefix: list[str]
    coordinator: str  # HOST:PORT of the coordination service as seen from this process
    gloo_host: str  # the address this process's gloo binds (reachable by the others)


def run_job(
    cfg: DataParallelConfig,
    placements: Sequence[Placement],
    work_dir: pathlib.Path,
    timeout: float,
    on_started: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Runs one worker per placement (all of cfg.shards) to the end; process 0's summary.

    Process 0 appends its records to work_dir/records.jsonl as it trains.
    """
    if len(placements) != cfg.shards:
        raise ValueError(f"{len(placements)} placements for {cfg.shards} shards")
    work_dir.mkdir(parents=True, exist_ok=True)
    out = work_dir / "summary.json"
    out.unlink(missing_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for p, place in enumerate(placements):
            log = open(work_dir / f"worker{p}.log", "w")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [*place.prefix, sys.executable, "-m", "atoll.bench.data_parallel", "worker"]
                    + ["--coordinator", place.coordinator, "--process-id", str(p)]
                    + [
                        "--gloo-host",
                        place.gloo_host,
                        "--config",
                        json.dumps(dataclasses.asdict(cfg)),
                    ]
                    + ["--out", str(out), "--records", str(work_dir / "records.jsonl")],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            )
        if on_started is not None:
            on_started()
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = f"worker {failed[0]} failed" if failed else f"timed out after {timeout:.0f} s"
                tail = (work_dir / f"worker{failed[0] if failed else 0}.log").read_text()[-2000:]
                raise RuntimeError(f"data-parallel job: {why}:\n{tail}")
            time.sleep(0.2)
        summary: dict[str, Any] = json.loads(out.read_text())
        return summary
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for log in logs:
            log.close()


# -- entry points -----------------------------------------------------------------------------


def _coordinator(args: argparse.Namespace) -> int:
    from jaxlib import _jax  # jax._src.lib's _jax; it ships no stub (Any)

    _die_with_parent()  # a bench killed however it dies takes it along (not a preexec_fn:
    # forking a process that runs JAX's threads to run Python before exec can deadlock)

    service = _jax.get_distributed_runtime_service(f"127.0.0.1:{args.port}", args.processes)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    print(READY, flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    leaving = threading.Thread(target=service.shutdown, name="shutdown", daemon=True)
    leaving.start()
    leaving.join(SHUTDOWN_WAIT_SECONDS)
    sys.stdout.flush()
    os._exit(0)  # not a return: the interpreter's exit would wait on the shutdown too


def _say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def _worker(args: argparse.Namespace) -> int:
    _die_with_parent()  # as the coordinator does
    cfg = DataParallelConfig(**json.loads(args.config))
    _say(f"process {args.process_id}: joining {args.coordinator}, gloo on {args.gloo_host}")
    _use_gloo_host(args.gloo_host)
    import jax

    # process 0 also starts a service of its own (jax does); it binds an unused local port
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=cfg.shards,
        process_id=args.process_id,
        coordinator_bind_address=f"127.0.0.1:{free_port()}",
        initialization_timeout=int(WORKER_START_SECONDS),
    )
    _say(f"process {args.process_id}: joined; training")
    with open(args.records, "a") if args.process_id == 0 else contextlib.nullcontext() as f:

        def on_record(row: dict[str, Any]) -> None:
            assert f is not None  # passed on only with the file open
            f.write(json.dumps(row) + "\n")
            f.flush()

        summary = train(cfg, args.process_id, cfg.shards, on_record if f else None)
    if args.process_id == 0:
        tmp = pathlib.Path(args.out + ".tmp")
        tmp.write_text(json.dumps(summary))
        os.replace(tmp, args.out)
    _say(f"process {args.process_id}: trained; leaving")
    leave: Callable[[], None] = jax.distributed.shutdown  # (untyped in jax)
    leave()
    _say(f"process {args.process_id}: left")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m atoll.bench.data_parallel")
    sub = p.add_subparsers(dest="role", required=True)
    c = sub.add_parser("coordinator", help="the jax.distributed coordination service")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--processes", type=int, required=True)
    w = sub.add_parser("worker", help="one process of the job")
    w.add_argument("--coordinator", required=True)
    w.add_argument("--process-id", type=int, required=True)
    w.add_argument("--gloo-host", required=True)
    w.add_argument("--config", required=True, help="DataParallelConfig as JSON")
    w.add_argument("--out", required=True, help="process 0 writes its summary here")
    w.add_argument("--records", required=True, help="process 0 appends its records here")
    args = p.parse_args(argv)
    return _coordinator(args) if args.role == "coordinator" else _worker(args)


if __name__ == "__main__":
    sys.exit(main())
