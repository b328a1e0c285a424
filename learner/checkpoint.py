"""Durable learner state: a restarted learner (or a standby that takes its id) resumes
at the step, data position and optimiser state it had, not at the global weights alone.

A checkpoint is the directory `<dir>/<learner id>/`, an Orbax checkpoint (the format
`atoll export` writes) kept by `orbax.checkpoint.CheckpointManager`, holding one cut
`<n>/` (n counts the writes of this id) of four items:

    params/  every leaf of the tree given to `join`, in tree order and its own dtype:
             the synced float leaves and those kept out of the plan (an int step counter)
    state/   the leaves of the `state` the caller passes (its optimiser state), if any
    sync/    per fragment, float32: `origin_<p>` (what the next outer gradient is
             measured from) and `residual_<p>` (error feedback); the sync engine's
             vectors (process 0's), or, for a learner whose params are sharded over its
             processes, every process's own local vectors as the rows of one global
             array sharded by process (learner/sharded_checkpoint.py)
    meta/    JSON: the identity checked on resume (model, plan, learner, run_info), the
             step and tokens (the data position: a batch is a pure function of the step),
             the sync engine's newest seq, and per fragment the version adopted, the seq
             of its newest push and the compute seconds the next push will carry

A jax.Array leaf sharded over the processes of a multi-process learner is written by
each process for the shards it holds (Orbax's multi-process checkpointing) and read back
into the sharding of the live leaf it replaces; host values (numpy leaves, meta/, the
sync/ of a learner whose process 0 syncs for all) are written by process 0. The
processes of a multi-process learner resume the cut process 0 finds newest.

Ordering guarantees (what a reader may rely on):

1. A cut is whole or absent: Orbax writes it into `<n>.orbax-checkpoint-tmp-*` and
   renames that to `<n>` only after every process has written its shards; the previous
   cut is deleted only after that. A kill -9 of any process at any point leaves the
   previous cut readable; a new `Checkpointer` removes the temporary directories. (Array
   data is fsynced by TensorStore; Orbax's small metadata files are not, so a machine
   crash just after a write may leave the newest cut unreadable: `read` says so.)
2. A cut is one consistent state at a step boundary: everything in it was read on the
   training thread between two steps (jax arrays are immutable, so only referenced;
   numpy values are copied). The training thread never waits for the disk: a
   one-process learner starts the write on a thread of its own; a multi-process one
   starts it on the training thread (Orbax's start is collective, so every process
   must make it in the same order: it copies the arrays to the host there), and Orbax
   writes in its background thread.
3. At most one write runs at a time. A one-process learner skips a checkpoint due while
   one is still being written (`skipped` counts them), never queues it; the processes of
   a multi-process learner must all write the same cuts (the write is collective), so
   there a due checkpoint waits for the previous write to finish.
4. Resuming never counts steps twice. A fragment's local progress since its origin is
   carried onto the current global weights only if the fragment's shard has answered
   no push of this learner newer than the checkpoint's (PullHeader.last_seq, which also
   counts a push in parts the shard still holds unfinished); otherwise a push made after
   the checkpoint delivered it or may have, and the fragment simply adopts the global
   weights. Seqs go on from the newest of the checkpoint's and the shards'.
5. A checkpoint restores onto any mesh of the same model: each array comes back in the
   dtype and sharding of the live leaf it replaces (the tree given to `join`, the
   template given to `restore_state`), each process reading only the shards it holds;
   a checkpoint of a 2-process FSDP-sharded learner restores onto one device. The sync
   vectors of a sharded learner are its processes' boxes, so they carry onto the same
   mesh only; elsewhere each fragment restarts from the global weights, and the log
   says so (learner/sharded_checkpoint.py).

An npz checkpoint of an older atoll (`<dir>/<learner id>.ckpt`) is not read: it cannot
hold a bfloat16 leaf or a leaf kept out of the plan, and two readers of two formats would
drift. Where it is the only checkpoint of an id, `read` refuses it and says what to do.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

    from atoll.learner.sync import Synchronizer
    from atoll.wire.plan import FragmentPlan

log = logging.getLogger("atoll.learner")
FORMAT = "atoll.learner-checkpoint.v2"  # bump when the layout or meaning changes
OLD_SUFFIX = ".ckpt"  # v1: one npz file per learner id, refused by `read`
PARAMS, STATE, SYNC, META = "params", "state", "sync", "meta"  # the items of a cut


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from here; the message says why."""


def path_for(directory: pathlib.Path, learner_id: str) -> pathlib.Path:
    """The directory of `learner_id`'s checkpoint in `directory`."""
    return pathlib.Path(directory) / learner_id


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
    """A trainer a checkpoint is restored into (learner/trainer/train.py's Trainer)."""

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
    """One cut of a learner's state, taken on the training thread."""

    meta: dict[str, Any]
    params: list[Any]  # every leaf of the params tree, in tree order
    state: list[Any]  # the leaves of the caller's state (optimiser state), maybe none
    origins: dict[int, np.ndarray]  # fragment -> what its next Δ is measured from
    residuals: dict[int, np.ndarray]  # fragment -> error-feedback residual


def _held(leaf: Any, copied: bool = False) -> Any:
    """A value as Orbax may keep it until its background write: a jax array as is
    (immutable) when it is one global value, else a host copy (a numpy buffer may be
    reused; a process-local jax array of a multi-process learner is not one value)."""
    if isinstance(leaf, jax.Array) and (jax.process_count() == 1 or not leaf.is_fully_addressable):
        return leaf
    value = leaf if copied else np.array(leaf)
    if jax.process_count() > 1:
        return value  # written by process 0 alone
    # Orbax copies a numpy value again on the calling (training) thread, a jax array in
    # its background thread: make it a jax array on the host (over the copy's buffer)
    try:
        return jax.device_put(value, jax.devices("cpu")[0])
    except (RuntimeError, TypeError):  # no CPU backend, or a dtype jax has no array of
        return value


def _described(leaves: Sequence[Any]) -> list[list[Any]]:
    return [[list(np.shape(x)), str(np.dtype(x.dtype))] for x in leaves]


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
    params = [_held(x) for x in jax.tree.leaves(trainer.params)]
    state = [_held(x) for x in jax.tree.leaves(trainer.opt_state)]
    meta = {
        **identity,
        "format": FORMAT,
        "time": time.time(),
        "step": int(trainer.steps_done),
        "tokens": int(trainer.tokens_total),
        "seq": int(sync.seq) if sync is not None else 0,
        "fragments": frags,
        "params": _described(params),  # [shape, dtype] of each leaf
        "state": _described(state),
        "origins": sorted(origins),
        "residuals": sorted(residuals),
    }
    return Capture(meta, params, state, origins, residuals)


def _handlers() -> dict[str, Any]:
    import orbax.checkpoint as ocp

    return {
        PARAMS: ocp.StandardCheckpointHandler(),
        STATE: ocp.StandardCheckpointHandler(),
        SYNC: ocp.StandardCheckpointHandler(),
        META: ocp.JsonCheckpointHandler(),
    }


def _manager(path: pathlib.Path) -> ocp.CheckpointManager:
    """Orbax's manager of one learner id's cuts: the newest whole one is kept (guarantee 1)."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=1, create=True, enable_async_checkpointing=True, cleanup_tmp_directories=True
    )
    return ocp.CheckpointManager(path.resolve(), options=options, item_handlers=_handlers())


def _restore(path: pathlib.Path, cut: int, local: bool = False, **items: Any) -> dict[str, Any]:
    """`items` (name -> restore args) of cut `cut` in `path`: with every process of a
    multi-process learner (arrays: each reads its shards), or `local`ly, by this process
    alone (host values: meta/, sync/), without a barrier the others would have to join."""
    import orbax.checkpoint as ocp

    me = jax.process_index()
    processes = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    reader = ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(**_handlers()),
        **({"multiprocessing_options": processes} if local else {}),
    )
    with reader:
        return dict(reader.restore((path / str(cut)).resolve(), ocp.args.Composite(**items)))


def _save_args(cap: Capture) -> Any:
    import orbax.checkpoint as ocp

    items: dict[str, Any] = {META: ocp.args.JsonSave(cap.meta)}
    if cap.params:
        items[PARAMS] = ocp.args.StandardSave(cap.params)
    if cap.state:
        items[STATE] = ocp.args.StandardSave(cap.state)
    vectors = {f"origin_{p}": _held(v, copied=True) for p, v in cap.origins.items()}
    vectors.update({f"residual_{p}": _held(v, copied=True) for p, v in cap.residuals.items()})
    if vectors:
        items[SYNC] = ocp.args.StandardSave(vectors)
    return ocp.args.Composite(**items)


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint read back: `meta` as written and the sync vectors; the params and
    state are read on demand, into the dtypes and shardings of live leaves (guarantee 5)."""

    meta: dict[str, Any]
    origins: dict[int, np.ndarray]
    residuals: dict[int, np.ndarray]
    path: pathlib.Path | None = None  # the learner id's directory
    cut: int = 0  # which of its cuts

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def params(self, like: Sequence[Any]) -> list[Any]:
        """Every params leaf, each as the leaf of `like` (the live tree's leaves) it replaces."""
        return self._restore(PARAMS, like)

    def state(self, like: Sequence[Any]) -> list[Any]:
        """The state's leaves, each as the leaf of `like` (a template's leaves) it replaces."""
        return self._restore(STATE, like)

    def _restore(self, item: str, like: Sequence[Any]) -> list[Any]:
        import orbax.checkpoint as ocp

        from atoll.learner.pytree import as_like

        saved = self.meta.get(item, [])
        if len(saved) != len(like) or any(
            tuple(s) != tuple(np.shape(x)) for (s, _), x in zip(saved, like)
        ):
            raise CheckpointError(
                f"{self.path}: its {item} are {len(saved)} leaves of shapes "
                f"{[tuple(s) for s, _ in saved][:4]}..., this learner's {len(like)} of "
                f"{[tuple(np.shape(x)) for x in like][:4]}...: not the same model"
            )
        if not like:
            return []
        # straight into a committed jax leaf's sharding (each process reads its shards);
        # others whole to the host (a numpy target: whatever mesh wrote it), then placed
        # as the leaf is (left uncommitted where it was)
        shape_dtype: Any = jax.ShapeDtypeStruct  # (untyped in jax's stubs)
        target = [
            shape_dtype(x.shape, x.dtype, sharding=x.sharding)
            if _direct(x)
            else np.empty(np.shape(x), np.dtype(x.dtype))
            for x in like
        ]
        assert self.path is not None  # a checkpoint read from disk
        got = _restore(self.path, self.cut, **{item: ocp.args.StandardRestore(target)})[item]
        return [v if _direct(x) else as_like(np.asarray(v), x) for v, x in zip(got, like)]


def _direct(leaf: Any) -> bool:
    """Whether a leaf is read straight into its sharding: a committed jax array that is
    one global value (in a multi-process learner, one that spans processes)."""
    return (
        isinstance(leaf, jax.Array)
        and getattr(leaf, "_committed", True)
        and (jax.process_count() == 1 or not leaf.is_fully_addressable)
    )


def read(path: pathlib.Path, vectors: bool = True, cut: int | None = None) -> Checkpoint | None:
    """The checkpoint in `path` (a learner id's directory, `path_for`): the metadata and
    (with `vectors`) sync vectors of cut `cut` (None: the newest here; 0: none, as process
    0 of a multi-process learner found), or None if there is none. CheckpointError if
    unreadable. A sharded learner's per-process vectors are not read here
    (learner/sharded_checkpoint.py reads them, on every process together)."""
    import orbax.checkpoint as ocp

    path = pathlib.Path(path)
    old = path.with_name(path.name + OLD_SUFFIX)
    cut = newest_cut(path) if cut is None else (cut or None)
    if cut is None:
        if old.exists():
            raise CheckpointError(
                f"{old} is a checkpoint of an older atoll (one npz file), which this one "
                f"does not read; it keeps {path}/ instead. Move {old.name} away to start "
                "this learner from the global weights (its local progress since its last "
                "push is lost), or finish the run with the atoll that wrote it"
            )
        return None
    if old.exists():
        log.warning("%s: an older atoll's checkpoint, ignored (%s is newer)", old, path)
    try:
        meta = _restore(path, cut, local=True, **{META: ocp.args.JsonRestore()})[META]
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else None
            raise CheckpointError(f"{path} is format {found!r}, this learner reads {FORMAT}")
        saved: Mapping[str, np.ndarray] = {}
        if meta.get("sync_layout") is not None and vectors:  # per process: not here
            log.warning(
                "%s: written by a learner sharded over %s processes, whose sync vectors "
                "are per process: each fragment restarts from the global weights (its local "
                "progress since its last push is not carried); params, state and step are "
                "resumed",
                path,
                meta.get("processes"),
            )
            vectors = False
        if vectors and (meta["origins"] or meta["residuals"]):
            # numpy targets: read whole on this host, whatever devices wrote them
            # (Orbax reads metadata by absolute path only: runs live under ./runs)
            shapes = ocp.StandardCheckpointHandler().metadata((path / str(cut) / SYNC).resolve())
            target = {k: np.empty(m.shape, m.dtype) for k, m in shapes.items()}
            restore = ocp.args.StandardRestore(target)
            saved = _restore(path, cut, local=True, **{SYNC: restore})[SYNC]
    except CheckpointError:
        raise
    except Exception as e:  # not a checkpoint (guarantee 1 rules out torn ones after a kill)
        raise CheckpointError(
            f"{path}/{cut} cannot be read as a learner checkpoint ({type(e).__name__}: {e}); "
            "move it away to start this learner afresh"
        ) from None
    origins = {p: np.asarray(saved[f"origin_{p}"]) for p in meta["origins"] if vectors}
    residuals = {p: np.asarray(saved[f"residual_{p}"]) for p in meta["residuals"] if vectors}
    return Checkpoint(meta, origins, residuals, path, cut)


def restore_items(ckpt: Checkpoint, **items: Any) -> dict[str, Any]:
    """`items` (name -> restore args) of `ckpt`'s cut, read by every process together."""
    assert ckpt.path is not None  # a checkpoint read from disk
    return _restore(ckpt.path, ckpt.cut, **items)


def newest_cut(path: pathlib.Path) -> int | None:
    """The newest whole cut in `path` (a numbered directory; Orbax's temporary ones are
    not numbers), or None."""
    cuts = [int(p.name) for p in path.iterdir() if p.name.isdigit()] if path.is_dir() else []
    return max(cuts, default=None)


def progress(path: pathlib.Path) -> tuple[int, int] | None:
    """(step, tokens) of the checkpoint in `path` from its metadata alone, or None if there
    is none or it cannot be read (`read` then says why)."""
    try:
        ckpt = read(path, vectors=False)
        return None if ckpt is None else (ckpt.step, int(ckpt.meta.get("tokens", 0)))
    except Exception:  # not a checkpoint: `read` reports it at join
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
    params_like, params_def = jax.tree.flatten(trainer.params)
    opt_like, opt_def = jax.tree.flatten(trainer.opt_state)
    if len(ckpt.meta["state"]) != len(opt_like):
        raise CheckpointError(
            "the checkpoint's optimiser state does not match this learner's optimiser"
        )
    trainer.restore(
        {
            "model_config": ckpt.meta["model_config"],
            "params": jax.tree.unflatten(params_def, ckpt.params(params_like)),
            "opt_state": jax.tree.unflatten(opt_def, ckpt.state(opt_like)),
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


class Rows(Protocol):
    """How a sharded learner's processes write their own sync vectors
    (learner/sharded_checkpoint.py's ProcessRows)."""

    def rows(self, cap: Capture) -> Capture: ...


class Checkpointer:
    """Every `every` steps, a background write of the learner's state (guarantees 1-3).
    Every process of a multi-process learner makes one and calls `save` at the same steps."""

    def __init__(
        self,
        directory: pathlib.Path,
        learner_id: str,
        every: int,
        identity: dict[str, Any],
        rows: Rows | None = None,
    ):
        self.path = path_for(directory, learner_id)
        self.every, self.identity = every, identity
        self.rows = rows  # a sharded learner's: every process writes its own vectors
        self._manager = _manager(self.path)  # removes a killed write's temp
        self._next = (newest_cut(self.path) or 0) + 1  # cut numbers go on across restarts
        self._pending: int | None = None  # the step of the write in progress
        self._writer: threading.Thread | None = None  # one process: it starts the write
        self._writer_error: BaseException | None = None
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
        alone = jax.process_count() == 1
        if self._busy() and not wait and alone:
            self.skipped += 1
            return False
        self._settle()  # (a multi-process learner: every process waits here alike)
        try:
            cap = capture(self.identity, trainer, sync, trail)
            if self.rows is not None:
                cap = self.rows.rows(cap)
            args = _save_args(cap)
        except Exception as e:
            self._failed(e, int(trainer.steps_done))
            return True
        cut, self._next = self._next, self._next + 1
        self._pending = cap.meta["step"]
        if alone:  # even Orbax's start (host copies, temporary directory) off this thread
            self._writer = threading.Thread(
                target=self._write, args=(cut, args), name="checkpoint", daemon=True
            )
            self._writer.start()
        else:  # a collective: here, in the same order on every process; written behind
            try:
                self._manager.save(cut, args=args, force=True)
            except Exception as e:
                self._writer_error = e
        if wait:
            self._settle()
        return True

    def _write(self, cut: int, args: Any) -> None:
        try:
            self._manager.save(cut, args=args, force=True)
            self._manager.wait_until_finished()
        except Exception as e:
            self._writer_error = e

    def _busy(self) -> bool:
        if self._writer is not None and self._writer.is_alive():
            return True
        return self._pending is not None and self._manager.is_saving_in_progress()

    def _settle(self) -> None:
        """Waits for the write in progress; counts it, or its error."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        error, self._writer_error = self._writer_error, None
        if error is None:
            try:
                self._manager.wait_until_finished()  # raises what the background write raised
            except Exception as e:
                error = e
        if error is not None:
            self._failed(error, step)
            return
        self.written += 1
        self.last_step = step

    def _failed(self, e: BaseException, step: int) -> None:
        """Keeps training: the previous checkpoint stays usable (guarantee 1)."""
        self.error = e
        log.warning("checkpoint at step %d not written: %s: %s", step, type(e).__name__, e)

    def close(self) -> None:
        self._settle()
        try:
            self._manager.close()
        except Exception as e:  # a failed write's error again (Orbax keeps it): reported
            self.error = self.error or e
