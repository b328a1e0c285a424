"""One learner's life: load data, build the trainer, join the syncer, train, leave.

Status records (JSON lines, one per step and one at the end) go to
`cfg.status_file`; `atoll up` draws its table and report from them, and a restarted
learner resumes its data position and schedule from the last one.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import sys
import threading
import time

import numpy as np
import prometheus_client as prom

from atoll.learner import checkpoint, distributed, standby, stopping
from atoll.learner.config import LearnerConfig, LearnerConfigError
from atoll.learner.data import Batches, load_corpus
from atoll.learner.model import preset
from atoll.learner.stopping import Stop, Stopped
from atoll.learner.sync import SyncConfig, SyncError, Synchronizer
from atoll.learner.train import TrainConfig, Trainer
from atoll.wire.client import ShardClient, TlsFiles
from atoll.wire.plan import FragmentPlan
from atoll.wire.records import PushRecord, StatusRecord, append_jsonl, read_jsonl

log = logging.getLogger("atoll.learner")
PROGRESS_SECONDS = 2.0  # how often the live line is redrawn


@dataclasses.dataclass
class _Held:
    """What a run holds until it ends, however it ends."""

    claim: standby.Claim | None = None
    sync: Synchronizer | None = None
    checkpointer: checkpoint.Checkpointer | None = None
    done: bool = False  # every step trained: the id is not to be taken over

    def release(self) -> None:
        if self.sync is not None:
            self.sync.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.claim is not None:
            self.claim.release(done=self.done)  # not done: a standby may take the id over


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
        self.registry = prom.CollectorRegistry()
        g = lambda name, doc: prom.Gauge(name, doc, registry=self.registry)  # noqa: E731
        c = lambda name, doc: prom.Counter(name, doc, registry=self.registry)  # noqa: E731
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


def run(cfg: LearnerConfig) -> int:
    """Trains until cfg.steps (or a signal); returns the process exit code.

    SIGTERM or SIGINT ends any wait (learner/stopping.py): during training the learner
    finishes its step, checkpoints, evaluates and leaves; before it, it leaves at once.
    Either way the exit code is 0. Call it from the main thread (it takes the signals)."""
    stop, held = Stop(), _Held()
    with stopping.on_signals(stop):
        try:
            return _run(cfg, stop, held)
        except Stopped as e:
            log.info("learner %s %s; leaving", cfg.learner_id, e)
            return 0
        finally:
            held.release()


def _run(cfg: LearnerConfig, stop: Stop, held: _Held) -> int:
    if cfg.compile_cache is not None:
        _use_compile_cache(cfg.compile_cache)
    claim, own_id = None, None
    # Id claims are for one-process learners (standbys take them over); every process of a
    # multi-host learner reads its checkpoint, process 0 alone writes it.
    one_process = cfg.distributed is None
    if cfg.checkpoint_dir is not None and not cfg.standby and one_process:
        # one live process per id: a restarted learner whose id a standby took waits as a standby
        held.claim = claim = standby.acquire(
            cfg.checkpoint_dir, cfg.learner_id, cfg.learner_index, cfg.num_learners, stop=stop.event
        )
        stop.check("claiming its id")
        if claim is None:
            log.warning(
                "learner id %s is held by a live process (%s); waiting as a standby",
                cfg.learner_id,
                standby.holder(cfg.checkpoint_dir, cfg.learner_id),
            )
            cfg, own_id = dataclasses.replace(cfg, standby=True), cfg.learner_id
    if not cfg.standby:
        cfg = cfg.as_learner(cfg.learner_id, cfg.learner_index)
    model_cfg = preset(cfg.preset)
    members = 1 if cfg.baseline else cfg.num_learners
    batch = cfg.batch_size * (cfg.num_learners if cfg.baseline else 1)
    train_cfg = TrainConfig(
        batch_size=batch,
        peak_lr=cfg.lr,
        warmup_steps=min(cfg.warmup, cfg.steps - 1),
        total_steps=cfg.steps,
        eval_every=cfg.eval_every or cfg.steps + 1,
        eval_batches=cfg.eval_batches,
        seed=cfg.seed,
    )
    corpus = load_corpus(cfg.data, vocab=model_cfg.vocab, cache_dir=cfg.cache_dir)
    batches = Batches(
        corpus.train,
        context=model_cfg.context,
        batch_size=batch,
        learner=0 if cfg.baseline else cfg.learner_index,
        num_learners=members,
        seed=cfg.seed,
    )
    trainer = Trainer(model_cfg, train_cfg, batches, heldout=corpus.heldout, slowdown=cfg.slowdown)
    trainer.sleep = stop.wait  # a slowed step's wait ends on a stop too
    stop.check("loading data")
    # A multi-host learner: process 0 alone talks to the syncer and writes status; the
    # others take its decisions and fragments after every step (learner/distributed.py).
    multi, leader = distributed.process_count() > 1, distributed.is_leader()
    if cfg.standby:
        # ready to train at once: data loaded, step compiled; then wait for a vacancy
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
            return 0
        log.info(
            "standby %s takes over learner %s (data shard %d) from pid %s",
            cfg.learner_id,
            claim.learner_id,
            claim.info["learner_index"],
            claim.info.get("taken_from"),
        )
        cfg = cfg.as_learner(claim.learner_id, int(claim.info["learner_index"]))
        trainer.batches = Batches(
            corpus.train,
            context=model_cfg.context,
            batch_size=batch,
            learner=cfg.learner_index,
            num_learners=members,
            seed=cfg.seed,
        )
    plan = FragmentPlan.build(trainer.params, cfg.fragments) if not cfg.baseline else None
    identity = {
        "learner_id": cfg.learner_id,
        "learner_index": cfg.learner_index,
        "num_learners": cfg.num_learners,
        "model_config": dataclasses.asdict(model_cfg),
        "batch_size": batch,
        "seed": cfg.seed,
        "plan_fingerprint": plan.fingerprint if plan is not None else None,
    }
    ckpt, checkpointer, theta_ckpt = None, None, None
    trail = checkpoint.PushTrail(plan.num_fragments) if plan is not None else None
    if cfg.checkpoint_dir is not None:
        path = checkpoint.path_for(cfg.checkpoint_dir, cfg.learner_id)
        ckpt = checkpoint.read(path)
        if ckpt is not None:
            checkpoint.check(ckpt, identity, path)
            checkpoint.restore_trainer(
                ckpt, trainer
            )  # same step, data position and optimiser state
            theta_ckpt = plan.flatten(trainer.params) if plan is not None else None
        if multi:  # every process must resume at the same step: they read the same file
            steps = distributed.broadcast(np.asarray(trainer.steps_done, np.int64))
            if int(steps) != trainer.steps_done:
                raise checkpoint.CheckpointError(
                    f"{path}: process 0 resumes at step {int(steps)}, process {distributed.process_index()} at "
                    f"{trainer.steps_done}; every process of a learner must mount the same --checkpoint-dir"
                )
        if leader:
            held.checkpointer = checkpointer = checkpoint.Checkpointer(
                cfg.checkpoint_dir, cfg.learner_id, cfg.checkpoint_every, identity
            )
    if ckpt is None:
        resume = _resume_point(cfg.status_file, cfg.learner_id) if leader else (0, 0)
        trainer.steps_done, trainer.tokens_total = (
            int(x) for x in distributed.broadcast(np.asarray(resume, np.int64))
        )
    log.info(
        "learner %s: %s model (%d params), batch %d, %s, data %s, from step %d%s",
        cfg.learner_id,
        cfg.preset,
        model_cfg.num_params,
        batch,
        "baseline" if cfg.baseline else f"{len(cfg.shards)} shards",
        corpus.source,
        trainer.steps_done,
        " (its checkpoint)" if ckpt is not None else "",
    )
    metrics = _Metrics(cfg.learner_id)
    if cfg.metrics_port is not None and leader:
        prom.start_http_server(cfg.metrics_port, registry=metrics.registry)

    sync = None
    status = {
        "learner": cfg.learner_id,
        "index": cfg.learner_index,
        "slowdown": cfg.slowdown,
        "params": model_cfg.num_params,
        "baseline": cfg.baseline,
    }

    def emit(state: str, m: dict | None = None, **extra) -> None:
        record: StatusRecord = dict(
            status,
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
        if sync is not None:
            record.update(sync.stats)
            record["version"], record["lag"] = sync.standing()
        if cfg.status_file is not None and leader:
            append_jsonl(cfg.status_file, record)

    emit("joining")
    trainer.compile()
    if stop.is_set():
        emit("stopped")
        stop.check("compiling")
    if plan is not None and leader:
        tls = TlsFiles(cfg.tls_ca, cfg.tls_cert, cfg.tls_key) if cfg.tls_ca else None
        try:
            token = cfg.token_file.read_text().strip() if cfg.token_file else None
        except OSError as e:  # a standby took an id whose token the Secret does not hold
            raise LearnerConfigError(f"--token-file {cfg.token_file}: {e.strerror}") from None

        def connect(address: str) -> ShardClient:
            return ShardClient(address, cfg.learner_id, token=token, tls=tls, deadline=cfg.deadline)

        pattern = cfg.shard_pattern
        clients = [connect(a) for a in cfg.shards]
        held.sync = sync = Synchronizer(
            SyncConfig(
                period=cfg.period,
                overlap=cfg.overlap,
                mix=cfg.mix,
                codec=cfg.codec,
                patience=cfg.sync_patience,
                wait_for_rounds=cfg.wait_for_rounds,
            ),
            plan,
            clients,
            on_push=_push_logger(cfg),
            connect=None if pattern is None else lambda i: connect(pattern.replace("{i}", str(i))),
        )
        stop.on_stop(sync.stop)  # calls in flight end at once, not at their deadline
        log.info("learner %s joining the syncer at %s", cfg.learner_id, ", ".join(cfg.shards))
        try:
            trainer.params = sync.join(trainer.params)
            last_seqs = checkpoint.shard_last_seqs(sync) if ckpt is not None else {}
        except Stopped:
            emit("stopped")
            raise Stopped(f"stopped by {stop.reason} while joining the syncer") from None
        if ckpt is not None:
            carried = checkpoint.resume_sync(ckpt, sync, theta_ckpt, trail, last_seqs)
            for p, vector in carried.items():
                trainer.set_tensors(plan.unflatten_fragment(p, vector))
            log.info(
                "learner %s resumed its checkpoint at step %d: local progress kept for fragments %s, "
                "the rest at the global versions; seq %d",
                cfg.learner_id,
                ckpt.step,
                sorted(carried),
                sync.seq,
            )
    if multi and plan is not None:
        # one start for every process: what process 0 joined at (and carried from its checkpoint)
        trainer.params = distributed.broadcast(trainer.params)

    state, last_print, local, m, eval_pending = "done", 0.0, 0, {}, False
    started = time.perf_counter()
    boundary, excluded = started, 0.0  # the last step boundary; waits and evaluations since
    try:
        while trainer.steps_done < cfg.steps:
            if stop.is_set() and not multi:
                state = "stopped"
                break
            m = trainer.step(evaluate=sync is None and not multi)
            local += 1
            # What a step costs this learner, from boundary to boundary: the step, its sync
            # work and bookkeeping, less the waits on rounds and the evaluations. The
            # shards' cadence is H of these, so a period holds about H steps.
            now = time.perf_counter()
            iteration, boundary, excluded = max(now - boundary - excluded, 1e-6), now, 0.0
            eval_pending = eval_pending or (sync is not None and trainer.eval_due())
            if multi:
                # Process 0 syncs, then every process adopts what it adopted and follows its
                # decisions (stop; evaluate, a collective every process must join).
                updates, stopping_now, due = {}, stop.is_set(), False
                seq_before = sync.seq if sync is not None else 0
                if sync is not None and not stopping_now:
                    try:
                        blocked = sync.stats["blocked_seconds"]
                        pushes = sync.pushes_started
                        updates = sync.after_step(
                            local,
                            trainer.params,
                            iteration,
                            m["tokens"],
                            trainer.steps_done >= cfg.steps,
                        )
                        excluded += sync.stats["blocked_seconds"] - blocked
                        due = eval_pending and (
                            sync.pushes_started > pushes or trainer.steps_done >= cfg.steps
                        )
                    except (SyncError, Stopped):
                        if not stop.is_set():
                            raise
                        stopping_now = True
                elif plan is None:
                    due = trainer.eval_due()
                updates, (stopping_now, due) = distributed.broadcast_step(
                    updates, (stopping_now, due), plan.fragment_sizes if plan is not None else ()
                )
                for p, vector in updates.items():
                    trainer.set_tensors(plan.unflatten_fragment(p, vector))
                if checkpointer is not None and sync is not None:
                    trail.after_step(sync, plan, seq_before, local, trainer.params)
                if due:
                    eval_pending = False
                    evaluating = time.perf_counter()
                    result = trainer.evaluate()
                    excluded += time.perf_counter() - evaluating
                    m.update(eval_loss=result["loss"], eval_bits_per_byte=result["bits_per_byte"])
                if stopping_now:
                    state = "stopped"
                    _observe(metrics, m, sync)
                    emit("training", m)
                    break
            elif sync is not None:
                try:
                    pushes, seq_before = sync.pushes_started, sync.seq
                    blocked = sync.stats["blocked_seconds"]
                    updates = sync.after_step(
                        local,
                        trainer.params,
                        iteration,
                        m["tokens"],
                        trainer.steps_done >= cfg.steps,
                    )
                    excluded += sync.stats["blocked_seconds"] - blocked
                except (SyncError, Stopped):
                    if not stop.is_set():
                        raise
                    state = "stopped"  # a signal ended a wait on the syncer
                    break
                for p, vector in updates.items():
                    trainer.set_tensors(plan.unflatten_fragment(p, vector))
                if checkpointer is not None:
                    trail.after_step(sync, plan, seq_before, local, trainer.params)
                # An evaluation waits for the step right after a push: there it overlaps the
                # round in flight, where elsewhere it could make a push late for its round.
                if eval_pending and (
                    sync.pushes_started > pushes or trainer.steps_done >= cfg.steps
                ):
                    eval_pending = False
                    evaluating = time.perf_counter()
                    result = trainer.evaluate()
                    excluded += time.perf_counter() - evaluating
                    m.update(eval_loss=result["loss"], eval_bits_per_byte=result["bits_per_byte"])
            if checkpointer is not None and checkpointer.due(trainer.steps_done):
                checkpointer.save(
                    trainer, sync, trail
                )  # host copies and the write in the background
            _observe(metrics, m, sync)
            emit("training", m)
            if (
                leader
                and cfg.progress
                and (
                    time.perf_counter() - last_print > PROGRESS_SECONDS
                    or trainer.steps_done == cfg.steps
                )
            ):
                last_print = time.perf_counter()
                print(
                    _progress_line(cfg, m, sync, time.perf_counter() - started),
                    file=sys.stderr,
                    flush=True,
                )
        if checkpointer is not None and state == "stopped":
            checkpointer.save(
                trainer, sync, trail, wait=True
            )  # stopped on purpose: keep every step
        if plan is not None and state == "done":
            # the tail: each fragment's steps since its last push go to the shards too
            final_updates = (
                sync.finish(
                    local, trainer.params, cfg.lease_exit_wait, m["tokens"] if local else None
                )
                if sync is not None
                else {}
            )
            if multi:
                final_updates, _ = distributed.broadcast_step(
                    final_updates, (), plan.fragment_sizes
                )
            for p, vector in final_updates.items():
                trainer.set_tensors(plan.unflatten_fragment(p, vector))
        final = trainer.evaluate()
        emit(
            state,
            m,
            eval_loss=final["loss"],
            eval_bits_per_byte=final["bits_per_byte"],
            wall_seconds=time.perf_counter() - started,
        )
        log.info(
            "learner %s %s at step %d: eval loss %.6f (%.4f bits/byte)%s",
            cfg.learner_id,
            f"stopped by {stop.reason}" if state == "stopped" else state,
            trainer.steps_done,
            final["loss"],
            final["bits_per_byte"],
            f", process {distributed.process_index()} of {distributed.process_count()}"
            if multi
            else "",
        )
    finally:
        held.done = trainer.steps_done >= cfg.steps
    return 0


def _use_compile_cache(directory: pathlib.Path) -> None:
    """Compiled programs persist in `directory`: a restart loads instead of compiling."""
    import jax

    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _push_logger(cfg: LearnerConfig):
    """One JSON line per answered push, written (and flushed) as the answer arrives."""
    if cfg.push_log is None:
        return None
    lock = threading.Lock()

    def log_push(answer: dict) -> None:
        record: PushRecord = {"learner": cfg.learner_id, "time": time.time(), **answer}
        with lock:
            append_jsonl(cfg.push_log, record)

    return log_push


def _observe(metrics: _Metrics, m: dict, sync: Synchronizer | None) -> None:
    metrics.step.set(m["step"])
    metrics.loss.set(m["loss"])
    metrics.tokens_per_s.set(m["tokens_per_s"])
    metrics.tokens.inc(m["tokens"])
    if "eval_loss" in m:
        metrics.eval_loss.set(m["eval_loss"])
    if sync is not None:
        for counter, key in (
            (metrics.bytes_sent, "bytes_sent"),
            (metrics.bytes_received, "bytes_received"),
            (metrics.blocked, "blocked_seconds"),
        ):
            total = sync.stats[key]
            if total > metrics.seen[key]:
                counter.inc(total - metrics.seen[key])
                metrics.seen[key] = total
        metrics.lag.set(sync.standing()[1])


def _progress_line(cfg: LearnerConfig, m: dict, sync: Synchronizer | None, elapsed: float) -> str:
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
