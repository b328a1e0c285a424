"""Durable learner state: a restarted learner (or a standby that takes its id) resumes
at the step, data position and optimiser state it had, not at the global weights alone.

A checkpoint is `<dir>/<learner id>.ckpt`: the trainer's parameters and AdamW state,
its step and tokens (the data position: a batch is a pure function of the step), the
sync engine's newest seq, and per fragment the global version adopted, the point the
next outer gradient is measured from (`origin`), the error-feedback residual and the
compute seconds the next push will carry.

Ordering guarantees (what a reader may rely on):

1. A checkpoint file is whole or absent: it is written to a temporary file in the same
   directory, fsynced, renamed over the previous one, and the directory fsynced. A kill
   -9 at any point leaves the previous checkpoint readable; the temporary file is
   removed by the next writer.
2. A checkpoint is one cut at a step boundary: everything in it was read on the
   training thread between two steps. The parameters and optimiser state are immutable
   jax arrays there, so only references are kept; the writer thread copies them to the
   host and writes. The training thread never waits on the disk.
3. At most one write runs at a time; a checkpoint due while one is still being written
   is skipped (`skipped` counts them), never queued.
4. Resuming never counts steps twice. A fragment's local progress since its origin is
   carried onto the current global weights only if the fragment's shard has answered
   no push of this learner newer than the checkpoint's (PullHeader.last_seq); otherwise
   a push made after the checkpoint already delivered it, and the fragment simply adopts
   the global weights. Seqs go on from the newest of the checkpoint's and the shards'.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np

if TYPE_CHECKING:
    from atoll.learner.sync import Synchronizer
    from atoll.wire.plan import FragmentPlan

log = logging.getLogger("atoll.learner")
FORMAT = "atoll.learner-checkpoint.v1"  # bump when the layout or meaning changes
SUFFIX = ".ckpt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from here; the message says why."""


def path_for(directory: pathlib.Path, learner_id: str) -> pathlib.Path:
    return pathlib.Path(directory) / f"{learner_id}{SUFFIX}"


class TrainerState(Protocol):
    """What a checkpoint captures of the training side (a Trainer, or the API's progress)."""

    @property
    def params(self) -> Any: ...
    @property
    def opt_state(self) -> Any: ...
    @property
    def steps_done(self) -> int: ...
    @property
    def tokens_total(self) -> int: ...


class Restorable(TrainerState, Protocol):
    """A trainer a checkpoint is restored into (learner/train.py's Trainer)."""

    def restore(self, snapshot: Mapping[str, Any]) -> None: ...


class PushTrail:
    """Per fragment, the seq and the parameters θ_p of its newest push, as the training
    thread saw them start (a push in flight at a checkpoint is measured from there)."""

    def __init__(self, num_fragments: int):
        self.seq = [0] * num_fragments
        self.theta: list[np.ndarray | None] = [None] * num_fragments

    def after_step(
        self, sync: Synchronizer, plan: FragmentPlan, seq_before: int, step: int, params: Any
    ) -> None:
        """Call after `sync.after_step(step, ...)` and after applying its updates."""
        started = [f.p for f in sync.frags if f.task is not None and f.task_step == step]
        if len(started) != sync.seq - seq_before:  # cannot tell which seq went where
            for p in started:
                self.seq[p], self.theta[p] = sync.seq, None
            return
        # Synchronizer.after_step numbers the pushes it starts in fragment order
        for seq, p in zip(range(seq_before + 1, sync.seq + 1), started):
            self.seq[p] = seq
            self.theta[p] = np.asarray(sync.read_fragment(params, p), np.float32).copy()


@dataclasses.dataclass
class Capture:
    """One cut of a learner's state, taken on the training thread (host copies deferred)."""

    meta: dict[str, Any]
    params: Any  # jax tree (immutable: referenced, copied by the writer)
    opt_state: Any
    origins: dict[int, np.ndarray]  # fragment -> what its next Δ is measured from
    residuals: dict[int, np.ndarray]  # fragment -> error-feedback residual


def capture(
    identity: dict[str, Any],
    trainer: TrainerState,
    sync: Synchronizer | None,
    trail: PushTrail | None,
) -> Capture:
    """Reads the state at this step boundary. `identity`: learner id, index, plan, configs."""
    frags, origins, residuals = [], {}, {}
    if sync is not None:
        for f in sync.frags:
            in_flight = f.task is not None
            if in_flight:
                origin = trail.theta[f.p] if trail is not None else None
                residual = None  # being rewritten by the push's encode: start it over
            else:
                origin = (f.origin if f.origin is not None else f.base).copy()
                residual = f.ef.residual.copy()
            if origin is not None:
                origins[f.p] = origin
            if residual is not None:
                residuals[f.p] = residual
            frags.append(
                {
                    "fragment": f.p,
                    "version": int(f.version),
                    "in_flight": in_flight,
                    "seq": int(trail.seq[f.p]) if trail is not None else int(sync.seq),
                    "compute_seconds": float(f.compute),
                }
            )
    meta = {
        **identity,
        "format": FORMAT,
        "time": time.time(),
        "step": int(trainer.steps_done),
        "tokens": int(trainer.tokens_total),
        "seq": int(sync.seq) if sync is not None else 0,
        "fragments": frags,
    }
    return Capture(meta, trainer.params, trainer.opt_state, origins, residuals)


def write(path: pathlib.Path, cap: Capture) -> None:
    """Writes `cap` to `path` atomically (guarantee 1)."""
    path = pathlib.Path(path)
    params = jax.tree.leaves(jax.device_get(cap.params))
    opt = jax.tree.leaves(jax.device_get(cap.opt_state))
    meta = {**cap.meta, "num_params_leaves": len(params), "num_opt_leaves": len(opt)}
    arrays: dict[str, Any] = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}
    arrays.update({f"param_{i}": np.asarray(x) for i, x in enumerate(params)})
    arrays.update({f"opt_{i}": np.asarray(x) for i, x in enumerate(opt)})
    arrays.update({f"origin_{p}": v for p, v in cap.origins.items()})
    arrays.update({f"residual_{p}": v for p, v in cap.residuals.items()})
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself is durable
    finally:
        os.close(dir_fd)


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint read back: `meta` as written, host arrays."""

    meta: dict[str, Any]
    params_leaves: list[np.ndarray]
    opt_leaves: list[np.ndarray]
    origins: dict[int, np.ndarray]
    residuals: dict[int, np.ndarray]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def read(path: pathlib.Path) -> Checkpoint | None:
    """The checkpoint at `path`, or None if there is none. CheckpointError if unreadable."""
    path = pathlib.Path(path)
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("format") != FORMAT:
                raise CheckpointError(
                    f"{path} is format {meta.get('format')!r}, this learner reads {FORMAT}"
                )
            params = [z[f"param_{i}"] for i in range(meta["num_params_leaves"])]
            opt = [z[f"opt_{i}"] for i in range(meta["num_opt_leaves"])]
            origins = {int(k[7:]): z[k] for k in z.files if k.startswith("origin_")}
            residuals = {int(k[9:]): z[k] for k in z.files if k.startswith("residual_")}
    except CheckpointError:
        raise
    except (
        Exception
    ) as e:  # a file that is not a checkpoint at all (guarantee 1 rules out torn ones)
        raise CheckpointError(
            f"{path} cannot be read as a learner checkpoint ({type(e).__name__}: {e}); "
            "move it away to start this learner afresh"
        ) from None
    return Checkpoint(meta, params, opt, origins, residuals)


def progress(path: pathlib.Path) -> tuple[int, int] | None:
    """(step, tokens) of the checkpoint at `path` from its metadata alone, or None if there
    is none or it cannot be read (`read` then says why)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
        return int(meta["step"]), int(meta.get("tokens", 0))
    except Exception:  # absent, or not a checkpoint: `read` reports it at join
        return None


def check(ckpt: Checkpoint, identity: dict[str, Any], path: pathlib.Path) -> None:
    """CheckpointError unless `ckpt` is of the same model, plan and data shard as `identity`."""
    for key in (
        "model_config",
        "plan_fingerprint",
        "learner_index",
        "num_learners",
        "batch_size",
        "seed",
    ):
        if ckpt.meta.get(key) != identity.get(key):
            raise CheckpointError(
                f"{path} was written with {key}={ckpt.meta.get(key)!r}, this learner runs "
                f"{key}={identity.get(key)!r}: resume with the same settings, or give "
                "another --checkpoint-dir"
            )


def restore_trainer(ckpt: Checkpoint, trainer: Restorable) -> None:
    """Parameters, optimiser state, step and tokens from `ckpt` into `trainer`."""
    params = jax.tree.unflatten(jax.tree.structure(trainer.params), ckpt.params_leaves)
    opt_treedef = jax.tree.structure(trainer.opt_state)
    if len(jax.tree.leaves(trainer.opt_state)) != len(ckpt.opt_leaves):
        raise CheckpointError(
            "the checkpoint's optimiser state does not match this learner's optimiser"
        )
    trainer.restore(
        {
            "model_config": ckpt.meta["model_config"],
            "params": params,
            "opt_state": jax.tree.unflatten(opt_treedef, ckpt.opt_leaves),
            "steps_done": ckpt.meta["step"],
            "tokens_total": ckpt.meta["tokens"],
        }
    )


def resume_sync(
    ckpt: Checkpoint,
    sync: Synchronizer,
    theta_ckpt: list[np.ndarray],
    trail: PushTrail,
    shard_last_seq: dict[int, int],
) -> dict[int, np.ndarray]:
    """After `sync.join`: carries each fragment's local progress onto the global weights
    where that counts no step twice (guarantee 4).

    Args:
      ckpt: the checkpoint resumed from.
      sync: the joined Synchronizer (its fragments' bases are the current global ones).
      theta_ckpt: the checkpoint's parameters as fragment vectors (plan.flatten).
      trail: this learner's push trail, brought up to the shards' seqs here.
      shard_last_seq: fragment -> the newest seq its shard answered for this learner
        (missing: unknown, and nothing is carried for that fragment).

    Returns:
      {fragment: new vector} to put into the trainer: Θ_now + (θ_ckpt − origin).
    """
    sync.seq = max(sync.seq, int(ckpt.meta.get("seq", 0)))
    updates = {}
    for info in ckpt.meta.get("fragments", []):
        p = info["fragment"]
        frag = sync.frags[p]
        last = shard_last_seq.get(p)
        trail.seq[p] = max(info["seq"], last or 0)
        carry_ok = last is not None and last <= info["seq"] and p in ckpt.origins
        if not carry_ok:
            continue
        carry = theta_ckpt[p] - ckpt.origins[p]
        updates[p] = frag.base + carry
        frag.compute = float(info["compute_seconds"])
        if p in ckpt.residuals:
            frag.ef.residual[...] = ckpt.residuals[p]
    return updates


def shard_last_seqs(sync: Synchronizer) -> dict[int, int]:
    """Fragment -> the newest seq its shard answered for this learner (one header-only pull
    each, from the version just joined at); a fragment whose shard does not answer is left out."""
    import grpc

    from atoll.wire.client import IncompletePull

    out = {}
    for f in sync.frags:
        try:  # (a stop raises Stopped here)
            pulled = sync.call_shard(functools.partial(sync.client_of(f.p).pull, f.p, f.version))
            out[f.p] = int(pulled.last_seq)
        except (grpc.RpcError, IncompletePull):
            pass
    return out


class Checkpointer:
    """Every `every` steps, a background write of the learner's state (guarantees 2-3)."""

    def __init__(
        self, directory: pathlib.Path, learner_id: str, every: int, identity: dict[str, Any]
    ):
        self.path = path_for(directory, learner_id)
        self.every, self.identity = every, identity
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.path.parent.glob(f".{self.path.name}.*.tmp"):  # a writer killed mid-write
            stale.unlink(missing_ok=True)
        self._writer: threading.Thread | None = None
        self.written = self.skipped = 0
        self.last_step: int | None = None
        self.error: BaseException | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(
        self,
        trainer: TrainerState,
        sync: Synchronizer | None,
        trail: PushTrail | None,
        wait: bool = False,
    ) -> bool:
        """Starts a write of this step's state; False (skipped) if one is still running."""
        if self._writer is not None and self._writer.is_alive():
            if not wait:
                self.skipped += 1
                return False
            self._writer.join()
        cap = capture(self.identity, trainer, sync, trail)
        self._writer = threading.Thread(
            target=self._write, args=(cap,), name="checkpoint", daemon=True
        )
        self._writer.start()
        if wait:
            self._writer.join()
        return True

    def _write(self, cap: Capture) -> None:
        try:
            write(self.path, cap)
            self.written += 1
            self.last_step = cap.meta["step"]
        except Exception as e:  # keep training: the previous checkpoint stays usable
            self.error = e
            log.warning(
                "checkpoint at step %d not written: %s: %s", cap.meta["step"], type(e).__name__, e
            )

    def close(self) -> None:
        if self._writer is not None:
            self._writer.join()
