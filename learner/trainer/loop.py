"""One learner's life: load data, build the trainer, join the syncer, train, leave.

`atoll learner` is one user of `atoll.Learner` (learner/api.py): `setup` builds the
trainer and joins through it, `_step` is the one step body of every learner (one
process or many: the Learner agrees process 0's decisions with the others), `_finish`
pushes the tail (or, stopped, checkpoints) and evaluates.

Status records (JSON lines, one per step and one at the end) go to
`cfg.status_file`; `atoll up` draws its table and report from them, and a restarted
learner resumes its data position and schedule from the last one.

Exit status: 0 once this learner's steps are trained (or, waiting as a standby, once
its own id's are); stopped by a signal before that, 128 + the signal (143 for SIGTERM,
130 for SIGINT), after it checkpointed and wrote its final record, so a Job does not
count a preempted learner as completed. The processes of a multi-process learner stop
at the same step and all exit with process 0's status.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import prometheus_client as prom

from atoll.learner import checkpoint, distributed, standby, stopping
from atoll.learner.api import Learner
from atoll.learner.config import LearnerConfig
from atoll.learner.stopping import Stop, Stopped
from atoll.learner.trainer import mesh
from atoll.learner.trainer.data import Batches, Corpus, load_corpus
from atoll.learner.trainer.model import ModelConfig, preset
from atoll.learner.trainer.train import TrainConfig, Trainer
from atoll.wire.records import Record, append_jsonl, read_jsonl

log = logging.getLogger("atoll.learner")
PROGRESS_SECONDS = 2.0  # how often the live line is redrawn
Metrics = dict[str, Any]  # one step's figures (Trainer.step)


class _Syncing(Protocol):
    """What the status records, metrics and progress line read of the sync engine."""

    @property
    def stats(self) -> dict[str, float]: ...

    def standing(self) -> tuple[int, int]: ...


@dataclasses.dataclass
class _Held:
    """What a run holds until it ends, however it ends."""

    claim: standby.Claim | None = None
    learner: Learner | None = None
    done: bool = False  # every step trained: the id is not to be taken over

    def release(self) -> None:
        if self.learner is not None:
            self.learner.close()
        if self.claim is not None:
            self.claim.release(done=self.done)  # not done: a standby may take the id over


@dataclasses.dataclass
class _Run:
    """A learner between setup and finish."""

    cfg: LearnerConfig
    stop: Stop
    trainer: Trainer
    learner: Learner | None  # None: --baseline, no syncer
    metrics: _Metrics
    status: dict[str, Any]  # the fields every status record starts with
    leader: bool  # process 0: it writes status and serves metrics
    started: float = 0.0  # perf_counter when training started
    last_print: float = 0.0
    eval_pending: bool = False  # an evaluation is due, waiting for the step after a push
    m: Metrics = dataclasses.field(default_factory=dict)  # the last step's figures

    @property
    def syncing(self) -> _Syncing | None:
        return self.learner if self.leader else None


def _resume_point(path: pathlib.Path | None, learner_id: str) -> tuple[int, int]:
    """(steps, tokens) this learner had done, from the last record of its status file."""
    if path is None or not path.exists():
        return 0, 0
    last = None
    for record in read_jsonl(path):  # a line a kill cut short is skipped
        if record.get("learner") == learner_id and "step" in record:
            last = record
    return (last["step"], last["tokens"]) if last else (0, 0)


class _Metrics:
    def __init__(self, learner_id: str):
        self.registry = registry = prom.CollectorRegistry()

        def g(name: str, doc: str) -> prom.Gauge:
            return prom.Gauge(name, doc, registry=registry)

        def c(name: str, doc: str) -> prom.Counter:
            return prom.Counter(name, doc, registry=registry)

        self.step, self.loss, self.eval_loss = (
            g("atoll_learner_step", "Inner steps done"),
            g("atoll_learner_loss", "Training loss of the last step"),
            g("atoll_learner_eval_loss", "Held-out loss of the last evaluation"),
        )
        self.tokens_per_s = g("atoll_learner_tokens_per_second", "Training throughput")
        self.lag = g(
            "atoll_learner_version_lag", "Newest known version minus adopted, worst fragment"
        )
        # Totals are counters (exposed with _total; rate() them). The sync engine keeps running
        # totals, so _observe adds what grew since it last looked (`seen`).
        self.bytes_sent = c("atoll_learner_sent_bytes", "Bytes pushed and offered to shards")
        self.bytes_received = c("atoll_learner_received_bytes", "Bytes pulled from shards")
        self.blocked = c("atoll_learner_blocked_seconds", "Time the training loop waited on sync")
        self.tokens = c("atoll_learner_tokens", "Tokens trained on by this process")
        self.seen = {"bytes_sent": 0.0, "bytes_received": 0.0, "blocked_seconds": 0.0}
        # The goodput denominator: 1 from start-up on (loading, compiling, joining and training
        # are all provisioned time), labelled with the learner id, which outlives its pods.
        prom.Gauge(
            "atoll_learner_up",
            "1 while this learner process runs (provisioned)",
            ["learner"],
            registry=self.registry,
        ).labels(learner_id).set(1)
        prom.Info("atoll_learner", "Which learner this is", registry=self.registry).info(
            {"learner": learner_id}
        )


# --- the run ---


def run(cfg: LearnerConfig) -> int:
    """Trains until cfg.steps (or a signal); returns the process exit status.

    SIGTERM or SIGINT ends any wait (learner/stopping.py): during training the learner
    finishes its step, checkpoints, evaluates and leaves; before it, it leaves at once.
    Either way the exit status is 128 + the signal (143, 130): the steps were not all
    trained. Call it from the main thread (it takes the signals)."""
    stop, held = Stop(), _Held()
    with stopping.on_signals(stop):
        try:
            return _run(cfg, stop, held)
        except Stopped as e:
            log.info("learner %s %s; leaving", cfg.learner_id, e)
            return stopped_status(stop)
        finally:
            held.release()


def stopped_status(stop: Stop) -> int:
    """The exit status of a learner stopped before its end: 128 + the signal that stopped
    it, as a shell reports a process the signal killed; 1 for a stop of another kind."""
    try:
        return 128 + signal.Signals[stop.reason or ""].value
    except KeyError:
        return 1


def _run(cfg: LearnerConfig, stop: Stop, held: _Held) -> int:
    run = setup(cfg, stop, held)
    if run is None:  # a standby that took no id over
        return stopped_status(stop) if stop.is_set() else 0
    finished = True
    try:
        while run.trainer.steps_done < run.cfg.steps:
            if not _step(run):
                finished = False
                break
        _finish(run, finished)
    finally:
        held.done = run.trainer.steps_done >= run.cfg.steps
    # every process agreed the stop: each leaves with process 0's status
    return 0 if finished else distributed.agree_status(stopped_status(stop))


def setup(cfg: LearnerConfig, stop: Stop, held: _Held) -> _Run | None:
    """Claims the id (or waits as a standby for one), builds the trainer, joins the
    syncer through `atoll.Learner` and resumes; None: a standby stopped before taking
    an id over (or whose own id was trained to the end meanwhile)."""
    if cfg.compile_cache is not None:
        _use_compile_cache(cfg.compile_cache)
    cfg, own_id = _claim(cfg, stop, held)
    model_cfg = preset(cfg.preset)
    corpus = load_corpus(cfg.data, vocab=model_cfg.vocab, cache_dir=cfg.cache_dir)
    trainer = Trainer(
        model_cfg,
        _train_config(cfg),
        _batches(cfg, corpus, model_cfg),
        heldout=corpus.heldout,
        slowdown=cfg.slowdown,
        fsdp=cfg.fsdp,
    )
    trainer.sleep = stop.wait  # a slowed step's wait ends on a stop too
    stop.check("loading data")
    if cfg.standby:
        taken = _take_over(cfg, trainer, stop, held, own_id)
        if taken is None:
            return None
        cfg = taken
        trainer.batches = _batches(cfg, corpus, model_cfg)
    leader = distributed.is_leader()
    run = _Run(cfg, stop, trainer, None, _Metrics(cfg.learner_id), _status(cfg), leader)
    if cfg.metrics_port is not None and leader:
        prom.start_http_server(cfg.metrics_port, registry=run.metrics.registry)
    # where the last run of this id got to, read before this run's first record
    resume = _resume_point(cfg.status_file, cfg.learner_id) if leader else (0, 0)
    saved = None  # its checkpoint's step, which join resumes: this life starts there
    if cfg.checkpoint_dir is not None and not cfg.baseline:
        saved = checkpoint.progress(checkpoint.path_for(cfg.checkpoint_dir, cfg.learner_id))
    step, tokens = saved or resume
    _emit(run, "joining", step=step, tokens=tokens)
    trainer.compile()
    if stop.is_set():
        _emit(run, "stopped")
        stop.check("compiling")
    if not cfg.baseline:
        run.learner = held.learner = _join(run)
    if not run.learner or not run.learner.resumed:
        _resume_from_status(run, resume)
    log.info(
        "learner %s: %s model (%d params, %s), batch %d, %s, data %s, from step %d%s",
        cfg.learner_id,
        cfg.preset,
        model_cfg.num_params,
        _placement(trainer),
        trainer.train_cfg.batch_size,
        "baseline" if cfg.baseline else f"{len(cfg.shards)} shards",
        corpus.source,
        trainer.steps_done,
        " (its checkpoint)" if run.learner and run.learner.resumed else "",
    )
    run.started = time.perf_counter()
    return run


def _claim(cfg: LearnerConfig, stop: Stop, held: _Held) -> tuple[LearnerConfig, str | None]:
    """This learner's id claim (one live process per id); a restarted learner whose id a
    standby took waits as a standby itself: (its config, then, and its own id)."""
    # Id claims are for one-process learners (standbys take them over); every process of a
    # multi-host learner reads and writes its checkpoint, each the shards it holds.
    if cfg.checkpoint_dir is not None and not cfg.standby and cfg.distributed is None:
        held.claim = standby.acquire(
            cfg.checkpoint_dir, cfg.learner_id, cfg.learner_index, cfg.num_learners, stop=stop.event
        )
        stop.check("claiming its id")
        if held.claim is None:
            log.warning(
                "learner id %s is held by a live process (%s); waiting as a standby",
                cfg.learner_id,
                standby.holder(cfg.checkpoint_dir, cfg.learner_id),
            )
            return dataclasses.replace(cfg, standby=True), cfg.learner_id
    if cfg.standby:
        return cfg, None
    return cfg.as_learner(cfg.learner_id, cfg.learner_index), None


def _take_over(
    cfg: LearnerConfig, trainer: Trainer, stop: Stop, held: _Held, own_id: str | None
) -> LearnerConfig | None:
    """A standby: ready to train at once (step compiled), it waits for a vacancy and
    becomes that learner (its config); None if stopped, or its own id got trained."""
    assert cfg.checkpoint_dir is not None  # LearnerConfig: --standby needs it
    trainer.compile()
    stop.check("compiling")
    log.info(
        "standby %s ready (compiled in %.1f s); waiting for a failed learner in %s",
        cfg.learner_id,
        trainer.compile_time_s,
        cfg.checkpoint_dir,
    )
    held.claim = claim = standby.wait_for_vacancy(
        cfg.checkpoint_dir, cfg.num_learners, stop.event, until_done=own_id
    )
    if claim is None:
        log.info(
            "standby %s stopped before taking over a learner%s",
            cfg.learner_id,
            " (its own id was trained to the end)" if own_id and not stop.is_set() else "",
        )
        return None
    log.info(
        "standby %s takes over learner %s (data shard %d) from pid %s",
        cfg.learner_id,
        claim.learner_id,
        claim.info["learner_index"],
        claim.info.get("taken_from"),
    )
    return cfg.as_learner(claim.learner_id, int(claim.info["learner_index"]))


def _join(run: _Run) -> Learner:
    """Joins the syncer through `atoll.Learner` (it resumes this id's checkpoint, if any);
    the trainer takes the params, step, tokens and optimiser state to go on from."""
    cfg, trainer = run.cfg, run.trainer
    learner = Learner.from_config(
        cfg,
        on_push=_push_logger(cfg),
        claim_id=False,  # the claim is held above (a held id makes this one a standby)
        run_info={
            "model_config": dataclasses.asdict(trainer.model_cfg),
            "batch_size": trainer.train_cfg.batch_size,
            "seed": cfg.seed,
        },
    )
    run.stop.on_stop(learner.stop)  # calls in flight end at once, not at their deadline
    try:
        trainer.params = learner.join(trainer.params)
    except Stopped:
        _emit(run, "stopped")
        raise Stopped(f"stopped by {run.stop.reason} while joining the syncer") from None
    if learner.resumed:  # same step, data position and optimiser state
        trainer.opt_state = learner.restore_state(trainer.opt_state)
        trainer.steps_done, trainer.tokens_total = learner.steps, learner.tokens
    return learner


def _resume_from_status(run: _Run, resume: tuple[int, int]) -> None:
    """No checkpoint: the step and tokens of this learner's last status record (`resume`,
    process 0's), so a restart goes on with its data and schedule."""
    trainer = run.trainer
    steps, tokens = (int(x) for x in distributed.broadcast(np.asarray(resume, np.int64)))
    trainer.steps_done, trainer.tokens_total = steps, tokens
    if run.learner is not None:
        run.learner.steps, run.learner.tokens = steps, tokens


def _step(run: _Run) -> bool:
    """One inner step, its sync, evaluation and records; False once stopped (then the
    step was trained but not synced). The same on every process of a learner."""
    trainer, learner = run.trainer, run.learner
    m = run.m = trainer.step(evaluate=False)
    last = trainer.steps_done >= run.cfg.steps
    run.eval_pending = run.eval_pending or trainer.eval_due()
    if learner is None:
        if _agreed_stop(run.stop):
            return False
    else:
        try:
            params = learner.step(
                trainer.params, tokens=int(m["tokens"]), last=last, state=trainer.opt_state
            )
        except Stopped:
            return False
        if params is not trainer.params:
            trainer.params = params
    # An evaluation waits for the step right after a push: there it overlaps the round
    # in flight, where elsewhere it could make a push late for its round.
    if run.eval_pending and (learner is None or learner.pushed or last):
        run.eval_pending = False
        result = _evaluate(run)
        m.update(eval_loss=result["loss"], eval_bits_per_byte=result["bits_per_byte"])
    _observe(run.metrics, m, run.syncing)
    _emit(run, "training", m)
    _progress(run, last)
    return True


def _agreed_stop(stop: Stop) -> bool:
    """Whether process 0 was stopped, on every process (a learner without a syncer; with
    one, `Learner.step` agrees it)."""
    _, (stopped,) = distributed.broadcast_step({}, (stop.is_set(),), ())
    return stopped


def _evaluate(run: _Run) -> Metrics:
    """The held-out loss now; its time is not counted as step time."""
    if run.learner is None:
        return run.trainer.evaluate()
    with run.learner.paused():
        return run.trainer.evaluate()


def _finish(run: _Run, finished: bool) -> None:
    """Trained to the end: the tail's pushes, adopted; stopped: a checkpoint of where it
    is. Then the final evaluation and record."""
    trainer, learner = run.trainer, run.learner
    if learner is not None and finished:
        # the tail: each fragment's steps since its last push go to the shards too
        trainer.params = learner.finish(
            trainer.params, timeout=run.cfg.lease_exit_wait, state=trainer.opt_state
        )
    elif learner is not None:
        learner.save(trainer.params, state=trainer.opt_state)  # stopped on purpose: keep every step
    final = trainer.evaluate()
    state = "done" if finished else "stopped"
    _emit(
        run,
        state,
        run.m,
        eval_loss=final["loss"],
        eval_bits_per_byte=final["bits_per_byte"],
        wall_seconds=time.perf_counter() - run.started,
    )
    where = ""
    if distributed.process_count() > 1:  # what this process sent (its own boxes, if split)
        sent = learner.stats.get("bytes_sent", 0) if learner is not None else 0
        where = (
            f", process {distributed.process_index()} of {distributed.process_count()}"
            f" (sent {int(sent)} bytes)"
        )
    log.info(
        "learner %s %s at step %d: eval loss %.6f (%.4f bits/byte)%s",
        run.cfg.learner_id,
        state if finished else f"stopped by {run.stop.reason or 'process 0'}",
        trainer.steps_done,
        final["loss"],
        final["bits_per_byte"],
        where,
    )


# --- parts ---


def _placement(trainer: Trainer) -> str:
    """Where the params live, for the log: 'replicated over 4 devices', or 'fsdp 4 over 4
    devices: 14 of 19 tensors split'."""
    split, leaves = mesh.split_count(trainer.placement)
    ways = mesh.fsdp_size(trainer.mesh)
    if ways == 1:
        return f"replicated over {trainer.mesh.size} devices"
    return f"fsdp {ways} over {trainer.mesh.size} devices: {split} of {leaves} tensors split"


def _train_config(cfg: LearnerConfig) -> TrainConfig:
    """The inner optimiser's settings; the baseline trains M learners' batch at once."""
    return TrainConfig(
        batch_size=cfg.batch_size * (cfg.num_learners if cfg.baseline else 1),
        peak_lr=cfg.lr,
        warmup_steps=min(cfg.warmup, cfg.steps - 1),
        total_steps=cfg.steps,
        eval_every=cfg.eval_every or cfg.steps + 1,
        eval_batches=cfg.eval_batches,
        seed=cfg.seed,
    )


def _batches(cfg: LearnerConfig, corpus: Corpus, model_cfg: ModelConfig) -> Batches:
    """This learner's data shard (the baseline reads the whole corpus, M× batch)."""
    return Batches(
        corpus.train,
        context=model_cfg.context,
        batch_size=cfg.batch_size * (cfg.num_learners if cfg.baseline else 1),
        learner=0 if cfg.baseline else cfg.learner_index,
        num_learners=1 if cfg.baseline else cfg.num_learners,
        seed=cfg.seed,
    )


def _status(cfg: LearnerConfig) -> dict[str, Any]:
    return {
        "learner": cfg.learner_id,
        "index": cfg.learner_index,
        "slowdown": cfg.slowdown,
        "params": preset(cfg.preset).num_params,
        "baseline": cfg.baseline,
    }


def _emit(run: _Run, state: str, m: Metrics | None = None, **extra: Any) -> None:
    """Appends a status record (process 0)."""
    if run.cfg.status_file is None or not run.leader:
        return
    trainer = run.trainer
    record: Record = dict(  # the fields of a StatusRecord (wire/records.py)
        run.status,
        time=time.time(),
        state=state,
        step=trainer.steps_done,
        tokens=trainer.tokens_total,
    )
    if m:
        record.update({k: m[k] for k in ("loss", "tokens_per_s", "eval_loss") if k in m})
        if state == "training":
            record["step_seconds"] = m["wall_time_s"]
    record.update(extra)
    if run.learner is not None:
        record.update(run.learner.stats)
        record["version"], record["lag"] = run.learner.standing()
    append_jsonl(run.cfg.status_file, record)


def _progress(run: _Run, last: bool) -> None:
    """Redraws the live line (process 0, every PROGRESS_SECONDS and at the last step)."""
    if not (run.leader and run.cfg.progress):
        return
    now = time.perf_counter()
    if now - run.last_print > PROGRESS_SECONDS or last:
        run.last_print = now
        line = _progress_line(run.cfg, run.m, run.syncing, now - run.started)
        print(line, file=sys.stderr, flush=True)


def _use_compile_cache(directory: pathlib.Path) -> None:
    """Compiled programs persist in `directory`: a restart loads instead of compiling."""
    import jax

    directory.mkdir(parents=True, exist_ok=True)
    update: Callable[[str, Any], None] = jax.config.update  # (untyped in jax)
    update("jax_compilation_cache_dir", str(directory))
    update("jax_persistent_cache_min_compile_time_secs", 0.0)
    update("jax_persistent_cache_min_entry_size_bytes", 0)


def _push_logger(cfg: LearnerConfig) -> Callable[[dict[str, Any]], None] | None:
    """One JSON line per answered push, written (and flushed) as the answer arrives."""
    path = cfg.push_log
    if path is None:
        return None
    lock = threading.Lock()

    def log_push(answer: dict[str, Any]) -> None:  # the fields of a PushRecord
        record: Record = {"learner": cfg.learner_id, "time": time.time(), **answer}
        with lock:
            append_jsonl(path, record)

    return log_push


def _observe(metrics: _Metrics, m: Metrics, sync: _Syncing | None) -> None:
    metrics.step.set(m["step"])
    metrics.loss.set(m["loss"])
    metrics.tokens_per_s.set(m["tokens_per_s"])
    metrics.tokens.inc(m["tokens"])
    if "eval_loss" in m:
        metrics.eval_loss.set(m["eval_loss"])
    if sync is not None:
        stats = sync.stats
        for counter, key in (
            (metrics.bytes_sent, "bytes_sent"),
            (metrics.bytes_received, "bytes_received"),
            (metrics.blocked, "blocked_seconds"),
        ):
            total = stats[key]
            if total > metrics.seen[key]:
                counter.inc(total - metrics.seen[key])
                metrics.seen[key] = total
        metrics.lag.set(sync.standing()[1])


def _progress_line(cfg: LearnerConfig, m: Metrics, sync: _Syncing | None, elapsed: float) -> str:
    line = (
        f"[{cfg.learner_id}] step {m['step']}/{cfg.steps} | {m['tokens_per_s']:,.0f} tok/s | "
        f"loss {m['loss']:.3f}"
    )
    if "eval_loss" in m:
        line += f" | eval {m['eval_loss']:.3f}"
    if sync is not None:
        adopted, lag = sync.standing()
        s = sync.stats
        line += (
            f" | v{adopted} lag {lag} | sent {s['bytes_sent'] / 1e6:.2f} MB recv "
            f"{s['bytes_received'] / 1e6:.2f} MB | blocked {100 * s['blocked_seconds'] / max(elapsed, 1e-9):.1f}%"
        )
    return line
