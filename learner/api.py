"""The learner as a library: `atoll.Learner` puts Decoupled DiLoCo into your own JAX
training loop (docs/design.md §4). Three calls: `join` once, `step` after every inner
step, `finish` at the end.

    learner = atoll.Learner("127.0.0.1:7070", "learner-0", sync=atoll.SyncConfig(period=16))
    params = learner.join(params)                 # the run's current global weights
    for batch in batches:
        params, opt_state = train_step(params, opt_state, batch)
        params = learner.step(params)             # fragments adopted since, if any
    params = learner.finish(params)               # the last steps pushed and adopted

The params are any pytree of float arrays (nested dicts, a Flax NNX `State`, an Equinox
module); how a tree becomes fragments is learner/pytree.py. The optimiser, its state and
the data stay yours: at an adoption the fragment's tensors change and the optimiser
state is kept as it is, as in DiLoCo. Underneath is the same `Synchronizer` that
`atoll learner` runs (learner/sync.py): on process 0 of a multi-host learner whose params
are replicated on every process (learner/distributed.py), or on every process of one
whose params are split over them, each syncing its own boxes (learner/sharded.py).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from atoll.learner import arguments, checkpoint, distributed, standby, tenure
from atoll.learner.config import Checkpointing, LearnerConfig
from atoll.learner.defaults import FRAGMENTS
from atoll.learner.pytree import ParamsError, PyTree, TreeLayout
from atoll.learner.stopping import Stopped
from atoll.learner.sync import SyncConfig, SyncError, Synchronizer
from atoll.learner.tenure import View
from atoll.wire.client import TlsFiles
from atoll.wire.plan import FragmentPlan

__all__ = ["Learner", "LearnerStateError", "ParamsError"]

log = logging.getLogger("atoll.learner")
_NEW, _JOINED, _FINISHED, _CLOSED = "new", "joined", "finished", "closed"


class LearnerStateError(RuntimeError):
    """A call out of order: `step` before `join`, anything after `finish` or `close`."""


class JoinInterrupted(SystemExit, KeyboardInterrupt):
    """Ctrl-C during `join`: a KeyboardInterrupt to code that catches one, and a
    SystemExit(130) (the shell's status for SIGINT) to the interpreter, which then exits
    without printing a traceback."""


class Learner:
    """One learner of a Decoupled DiLoCo run, driven by your training loop.

    Each of the P fragments (whole tensors of your params, bin-packed by size) syncs
    every H inner steps at its own offset in the period: its outer gradient (the global
    fragment it last adopted minus its current value) goes to the shard that owns it,
    4-bit encoded, while training goes on; τ steps later (or at the first step after
    the round closed) `step` returns the params with the new global fragment adopted,
    plus whatever the overlapped steps added. Only a push whose round is very late makes
    `step` wait.

    Args:
      shards: the syncer shards' addresses in shard index order: "host:port,host:port",
        a list of them, or a pattern "host-{i}:port" with `num_shards` (shards a reshard
        adds later are then found by it).
      learner_id: this learner's stable name: the shards know it by it, across restarts.
      num_shards: how many shards a pattern names (only with a pattern).
      fragments: P, fragments the params are split into; at least the number of shards
        and at most the number of float leaves.
      sync: how it syncs (`atoll.SyncConfig`): H, τ, α, the codec, patience and
        timeouts, each with its default and check there.
      checkpoint: where it keeps its id claim and checkpoint, how often it writes one,
        and whether it waits as a standby (`atoll.Checkpointing`). None: no checkpoint;
        a restart rejoins at the run's weights.
      index: which data shard this learner reads, in [0, num_learners): recorded in its
        claim so a standby that takes the id over reads it back as `learner.index`.
      num_learners: learners in the run (standbys take only ids of the same run).
      token: this learner's bearer token, if the shards ask for one.
      tls: CA (and client certificate and key, for mutual TLS) of the shards' TLS.
      is_embedding: tensor name -> merged by plain average (default: names holding
        "embed"); every other tensor is merged by radial-directional averaging.

    Raises:
      LearnerConfigError (a ValueError) for a setting that cannot work, saying why;
      TypeError for a `sync` or `checkpoint` that is not a SyncConfig or Checkpointing.

    Example:
      >>> import jax, jax.numpy as jnp, optax, atoll
      >>> params = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
      >>> opt = optax.adamw(1e-2)
      >>> opt_state = opt.init(params)
      >>> learner = atoll.Learner(
      ...     "127.0.0.1:7070", "learner-0", fragments=2, sync=atoll.SyncConfig(period=8)
      ... )
      >>> params = learner.join(params)
      >>> for x, y in my_batches():                       # your own data
      ...     grads = jax.grad(loss_fn)(params, x, y)
      ...     updates, opt_state = opt.update(grads, opt_state, params)
      ...     params = optax.apply_updates(params, updates)
      ...     params = learner.step(params, tokens=len(x))
      >>> params = learner.finish(params)
    """

    def __init__(
        self,
        shards: str | Sequence[str],
        learner_id: str,
        *,
        num_shards: int | None = None,
        fragments: int = FRAGMENTS,
        sync: SyncConfig | None = None,
        checkpoint: Checkpointing | None = None,
        index: int = 0,
        num_learners: int = 1,
        token: str | None = None,
        tls: TlsFiles | None = None,
        is_embedding: Callable[[str], bool] | None = None,
    ):
        given = arguments.checked(
            shards,
            learner_id,
            num_shards=num_shards,
            fragments=fragments,
            sync=sync,
            checkpoint=checkpoint,
            index=index,
            num_learners=num_learners,
            token=token,
            tls=tls,
        )
        self._take(given, is_embedding)

    def _take(self, given: arguments.Arguments, is_embedding: Callable[[str], bool] | None) -> None:
        """Keeps the settings `given` (checked) and sets the state before `join`."""
        self.pattern, self.addresses = given.pattern, given.addresses
        self.sync_config, self.checkpointing = given.sync, given.checkpoint
        self.learner_id, self.index = given.learner_id, given.index
        self.num_learners, self.fragments = given.num_learners, given.fragments
        self.is_embedding, self.token, self.tls = is_embedding, given.token, given.tls
        # what only `atoll learner`'s own loop sets (`from_config`)
        self._on_push: Callable[[dict[str, Any]], None] | None = None
        self._holds_claim, self._run_info = True, dict[str, Any]()
        # inner steps and tokens this learner id has trained (a resumed checkpoint's
        # too); what a checkpoint records as its data position: set them after `join`
        # if your loop resumed from a position of its own
        self.steps, self.tokens = 0, 0
        self._init_run_state()

    def _init_run_state(self) -> None:
        """The state a learner keeps from join to finish, as before join."""
        self._phase = _NEW
        self._failed: str | None = None  # why join failed, if it did
        self._multi = False  # several processes (learner/distributed.py), known at join
        # params split over those processes: each syncs its own boxes (learner/sharded.py)
        self._island: Any = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _phase and _sync against stop() from other threads
        self._layout: TreeLayout | None = None
        self._sync: Synchronizer | None = None
        self._keeping = tenure.Keeping(self.checkpointing)
        self._local = 0  # steps since join: the Synchronizer's step count
        self._boundary = 0.0  # perf_counter at the last step boundary
        self._excluded = 0.0  # seconds since it not of the caller's step (waits, `paused`)
        self._tokens = 1  # tokens of the last step (what the tail pushes count per step)
        self._pushed = False  # the last step started a push
        self._stats: dict[str, float] = {}  # the sync engine's, once it is closed
        self._versions: dict[int, tuple[int, int]] = {}

    @classmethod
    def from_config(
        cls,
        cfg: LearnerConfig,
        *,
        on_push: Callable[[dict[str, Any]], None] | None = None,
        claim_id: bool = True,
        run_info: Mapping[str, Any] | None = None,
    ) -> Learner:
        """A Learner with `atoll learner`'s settings (learner/config.py): its shards (or
        their pattern), id, data shard, fragments, sync settings (`cfg.sync`), token
        file, TLS and checkpoints (`cfg.checkpoint`), as the config checked them (not
        checked again); and what only the built-in loop (learner/trainer/loop.py) needs:

        Args:
          cfg: the settings.
          on_push: called from a sync thread with one dict per answered push (fragment,
            seq, shard, accepted, reason, versions, the steps and compute seconds it
            carried): an audit log (`atoll learner --push-log`).
          claim_id: with a checkpoint directory, `join` holds this id's claim there (one
            live process per id; a standby takes a failed learner's). False: the caller
            holds it (as `atoll learner` does, waiting as a standby itself when it is held).
          run_info: settings a resume must share with the checkpoint it resumes (a data
            order's seed, a batch size): recorded in each checkpoint, and `join` refuses
            a checkpoint written with other values (CheckpointError, naming the setting).

        Example:
          >>> cfg = LearnerConfig(shards=("127.0.0.1:7070",), learner_id="learner-0")
          >>> learner = Learner.from_config(cfg)
        """
        learner = cls.__new__(cls)
        learner._take(arguments.of_config(cfg), is_embedding=None)
        learner._on_push, learner._holds_claim = on_push, claim_id
        learner._run_info = dict(run_info or {})
        return learner

    # --- the three calls ---

    def join(self, params: PyTree) -> PyTree:
        """Joins the run: returns `params` with every synced tensor at its current global
        value.

        The first learner of a run seeds each fragment with its own values; later ones
        (and a restarted one) start from the run's current versions, so every learner of
        a run should pass the same model, initialised alike or not. With a
        `checkpoint`, a learner whose checkpoint is there resumes it: its step count,
        and each fragment's local progress since its last sync carried onto the current
        global weights (where no push since delivered it already).

        Args:
          params: your model's parameters, any pytree of arrays (learner/pytree.py
            says which leaves are synced and how they are named). Every later call takes
            a tree of this structure, shapes and dtypes.

        Returns:
          A new tree of the same structure, dtypes and shardings; leaves left out of the
          plan are the ones given.

        Raises:
          ParamsError: a leaf that cannot be synced, or a tree that differs from the run's
            fragment plan (naming the first tensor that differs).
          PlanMismatch (a SyncError): the shards serve another plan; the message names
            the first tensor that differs.
          SyncError: the shards refused this learner in a way retrying cannot fix.
          CheckpointError: this id's checkpoint is of another model, plan or `run_info`.
          LearnerStateError: called twice, or after `close`.
          KeyboardInterrupt: Ctrl-C while joining. It is also a SystemExit(130): one
            that your program does not catch ends it with one line on stderr, not a
            traceback through the gRPC calls it interrupted.
        """
        with self._lock:
            self._expect(_NEW, "join")
            self._phase = _JOINED  # a second join, even during this one, is refused
        try:
            return self._join(params)
        except KeyboardInterrupt:
            self._failed = "KeyboardInterrupt: interrupted while joining"
            self.close()
            print(
                f"atoll: learner {self.learner_id} interrupted while joining the shards at "
                f"{', '.join(self.addresses)}",
                file=sys.stderr,
            )
            raise JoinInterrupted(130) from None
        except BaseException as e:
            self._failed = f"{type(e).__name__}: {e}"
            self.close()
            raise

    def step(
        self, params: PyTree, *, tokens: int = 1, last: bool = False, state: PyTree = None
    ) -> PyTree:
        """Call after every inner step: returns `params` with the fragments adopted since.

        When no sync is due this reads nothing from the device and returns `params`
        itself. At a fragment's sync point it copies that fragment's tensors to the host
        and hands them to a background push; when a sync's round comes back it returns a
        new tree whose fragment tensors are the new global ones plus the steps trained
        meanwhile (your optimiser state is kept as it is, as in DiLoCo). It blocks only
        when a fragment's previous round is very late (see `SyncConfig.wait_for_rounds`).

        In a multi-host program every process calls it. With params replicated on every
        process, process 0 syncs and the others take what it adopted; with params split
        over the processes, each pushes and adopts its own shards and follows process
        0's schedule. A stop or a sync error raises on every process, at the same step;
        so does a process calling another method or at another step (LearnerDisagreement,
        a ParamsError).

        Args:
          params: the tree `join` returned, as your steps left it (same structure, shapes
            and dtypes; checked at every step, from metadata alone).
          tokens: what this step trained on (tokens, or examples): the merge weighs each
            push by its tokens, so learners of one run should count alike.
          last: True on your last step, if you know it: its pushes tell the shards to
            stop waiting for this learner.
          state: any pytree of arrays to checkpoint with this step (your optimiser state,
            your data position), read back after a restart with `restore_state`; only
            with a `checkpoint`.

        Returns:
          `params`, or a new tree with adopted fragments replaced.

        Raises:
          ParamsError: the tree differs from the one joined with (naming the leaf).
          SyncError: the shards refused this learner in a way retrying cannot fix.
          Stopped: `stop()` was called (this step is counted, not synced: `save` then
            checkpoints it), or ended a wait on the shards.
          LearnerStateError: before `join`, or after `finish` or `close`.
        """
        self._expect(_JOINED, "step")
        layout = self._joined()
        now = time.perf_counter()
        seconds = max(now - self._boundary - self._excluded, 1e-6)  # the caller's step alone
        self._boundary, self._excluded = now, 0.0
        self._local += 1
        self.steps += 1
        self._tokens = max(1, int(tokens))
        self.tokens += self._tokens
        view = View(layout, params, "params given to step()")
        view.leaves()  # a tree changed since join fails here, at this step (ParamsError)
        seq_before = self._sync.seq if self._sync is not None else 0
        updates = self._sync_step(view, seconds, last)
        if updates:
            params = self._write(view, updates)
            view = View(layout, params, "params given to step()")
        keeping = self._keeping
        if keeping.writer is not None:  # every process writes its own shards
            keeping.after_step(self._sync, seq_before, self._local, view)
            if keeping.writer.due(self.steps):
                self._save(view, state)
        return params

    def finish(self, params: PyTree, *, timeout: float = 60.0, state: PyTree = None) -> PyTree:
        """Ends this learner's part in the run: pushes each fragment's steps since its
        last sync, waits up to `timeout` seconds for those rounds, and returns `params`
        with what came back adopted. Then releases the shards' connections (and the id
        claim, marked done: no standby takes it over).

        Without these last pushes the global model would never hold the run's tail (up
        to a period of each fragment's last steps). A round that has not closed by the
        deadline still holds the push (the shards keep it durably).

        Args:
          params: the tree the last `step` returned.
          timeout: seconds to wait for the last rounds.
          state: as for `step`: with a `checkpoint`, the final checkpoint holds it.

        Returns:
          `params` with the last rounds adopted.

        Raises:
          LearnerStateError: before `join`, or after `finish` or `close`.
        """
        self._expect(_JOINED, "finish")
        layout = self._joined()
        view = View(layout, params, "params given to finish()")
        updates: dict[int, np.ndarray] = {}
        tail = self._tokens if self._local else None
        if self._island is not None:
            updates = self._island.finish(self._local, view, timeout, tail)
        elif self._sync is not None:
            updates = self._sync.finish(self._local, view, timeout, tail)
        if self._multi and self._island is None:
            updates, _ = distributed.broadcast_step(updates, (), self.plan.fragment_sizes)
        if updates:
            params = self._write(view, updates)
        if self._keeping.writer is not None and self._local:
            self._save(View(layout, params, "params given to finish()"), state, wait=True)
        with self._lock:
            self._phase = _FINISHED
        self._release(done=True)
        return params

    # --- around them ---

    def save(self, params: PyTree, *, state: PyTree = None) -> bool:
        """Writes this learner's checkpoint now, and waits for it: what `step` does every
        `Checkpointing.every` steps, for a loop that leaves before `finish` (stopped), so a
        restart goes on from here. Call `close` after.

        Returns:
          True if written; False where this learner keeps none (no `checkpoint`).
          Every process of a multi-host learner calls it: each writes the shards it holds.

        Example:
          >>> try:
          ...     params = learner.step(params, state=opt_state)
          ... except atoll.Stopped:
          ...     learner.save(params, state=opt_state)
        """
        self._expect(_JOINED, "save")
        if self._keeping.writer is None:
            return False
        self._save(View(self._joined(), params, "params given to save()"), state, wait=True)
        return True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside this block (an evaluation, a log write) is not counted as
        inner-step time: the step time the shards' cadence is built from stays the
        training's own.

        Example:
          >>> with learner.paused():
          ...     eval_loss = evaluate(params)
        """
        started = time.perf_counter()
        try:
            yield
        finally:
            self._excluded += time.perf_counter() - started

    def restore_state(self, template: PyTree) -> PyTree:
        """The `state` this learner's checkpoint holds, in `template`'s structure, dtypes
        and shardings, or `template` itself when `join` resumed no checkpoint (or it
        held no state). Call after `join`.

        Example:
          >>> params = learner.join(params)
          >>> opt_state = learner.restore_state(opt.init(params))
          >>> start = learner.steps                  # where your data goes on from
        """
        if self._phase == _NEW:
            raise LearnerStateError("call join(params) before restore_state()")
        ckpt = self._keeping.resumed
        return template if ckpt is None else tenure.restored_state(ckpt, template)

    def stop(self) -> None:
        """Ends every wait on the shards at once, from any thread (a signal handler's
        too): a `join`, `step` or `finish` waiting raises `Stopped`, and so does the next
        `step`. Call `save` (to checkpoint where you are) and `close` after."""
        self._stop.set()
        with self._lock:
            sync = self._sync
        if sync is not None:
            sync.stop()

    def close(self) -> None:
        """Leaves without the last pushes (use `finish` to push them): stops the sync
        threads, closes the connections, releases the id claim (a standby may take it
        over). Safe to call more than once; a `with` block calls it."""
        with self._lock:
            if self._phase == _CLOSED:
                return
            self._phase = _CLOSED
        self._release(done=False)

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def plan(self) -> FragmentPlan:
        """The fragment plan made from the params given to `join`."""
        return self._joined().plan

    @property
    def unsynced(self) -> tuple[str, ...]:
        """Names of the leaves left out of the plan (not float): carried through as given."""
        return () if self._layout is None else self._layout.unsynced

    @property
    def resumed(self) -> bool:
        """Whether `join` resumed this id's checkpoint (then `steps`, `tokens` and
        `restore_state` give where it was)."""
        return self._keeping.resumed is not None

    @property
    def resumed_checkpoint(self) -> checkpoint.Checkpoint | None:
        """The checkpoint `join` resumed (its step, sync vectors, and params read on
        demand), or None: no checkpoint, or none of this id yet."""
        return self._keeping.resumed

    @property
    def pushed(self) -> bool:
        """Whether the last `step` started a push (on every process of a multi-host
        learner): a step right after one is where other work (an evaluation) overlaps
        the round in flight instead of delaying a push."""
        return self._pushed

    @property
    def versions(self) -> dict[int, tuple[int, int]]:
        """{fragment: (global version adopted, newest version known)}, as they were at
        the end after `finish` or `close`; {} off process 0."""
        return self._versions if self._sync is None else self._sync.versions()

    def standing(self) -> tuple[int, int]:
        """(oldest version adopted, worst lag behind the newest known) over the
        fragments: what a progress line shows; (0, 0) before `join` and off process 0."""
        versions = self.versions.values()
        if not versions:
            return 0, 0
        return min(v for v, _ in versions), max(latest - v for v, latest in versions)

    @property
    def stats(self) -> dict[str, float]:
        """Running totals: bytes sent and received, pushes, refusals, resyncs, adoptions,
        stalls and seconds blocked (the last ones after `finish` or `close`); {} off
        process 0."""
        return dict(self._stats if self._sync is None else self._sync.stats)

    # --- inside ---

    def _expect(self, phase: str, call: str) -> None:
        if self._phase == phase:
            return
        raise LearnerStateError(
            {
                _NEW: f"{call}() before join(): call params = learner.join(params) first",
                _JOINED: f"{call}() after join(): join once per Learner",
                _FINISHED: f"{call}() after finish(): this learner has left the run; "
                "make a new Learner to join again",
                _CLOSED: f"{call}() after close(): make a new Learner to join again"
                + (f" (join failed: {self._failed})" if self._failed else ""),
            }[self._phase]
        )

    def _joined(self) -> TreeLayout:
        if self._layout is None:
            raise LearnerStateError("the plan is made by join(params): call join first")
        return self._layout

    def _sync_step(self, view: View, seconds: float, last: bool) -> dict[int, np.ndarray]:
        """Process 0's sync work after a step, and (several processes) its outcome on
        every process: {fragment: vector adopted}. Raises where process 0 was stopped
        or failed, on every process alike."""
        if self._island is not None:
            return self._island_step(view, seconds, last)
        sync, updates = self._sync, {}
        stopped, error, pushed = self._stop.is_set(), None, False
        if sync is not None and not stopped:
            pushes, blocked = sync.pushes_started, sync.stats["blocked_seconds"]
            try:
                updates = sync.after_step(self._local, view, seconds, self._tokens, final=last)
            except (Stopped, SyncError) as e:
                error = e
                stopped = isinstance(e, Stopped) or self._stop.is_set()
            self._excluded += sync.stats["blocked_seconds"] - blocked
            pushed = sync.pushes_started != pushes
        if self._multi:
            flags = (stopped, error is not None and not stopped, pushed)
            updates, (stopped, failed, pushed) = distributed.broadcast_step(
                updates, flags, self.plan.fragment_sizes
            )
            if failed and error is None:
                raise SyncError("process 0 of this learner failed to sync: its log says why")
        self._pushed = pushed
        if stopped:
            raise Stopped(f"stopped at step {self.steps}") from error
        if error is not None:
            raise error
        return updates

    def _island_step(self, view: View, seconds: float, last: bool) -> dict[int, np.ndarray]:
        """`_sync_step` of a learner sharded over its processes: every process syncs its
        own boxes; process 0's schedule decides for all (learner/sharded.py)."""
        island = self._island
        updates, stopped, pushed, error = island.step(
            self._local, view, seconds, self._tokens, last, self._stop.is_set()
        )
        self._pushed = pushed
        if stopped:
            raise Stopped(f"stopped at step {self.steps}") from error
        if error is not None:
            raise error
        return dict(updates)

    def _write(self, view: View, updates: dict[int, np.ndarray]) -> PyTree:
        """The tree with fragments `updates` adopted (local vectors on a sharded island)."""
        layout = self._joined()
        if self._island is None:
            return layout.write(view.leaves(), updates)
        leaves = self._island.write(view.leaves(), updates)
        return jax.tree_util.tree_unflatten(layout.treedef, leaves)

    def _join_island(self, layout: TreeLayout, view: View) -> PyTree:
        """`join` of a learner whose params are split over its processes: every process
        connects, joins and later pushes its own boxes (learner/sharded.py)."""
        from atoll.learner import sharded, sharded_checkpoint

        self._island = island = sharded.Island(
            layout,
            view.leaves(),
            self.learner_id,
            self._connect,
            part_wait=max(self.sync_config.join_timeout, self.sync_config.patience),
        )
        ckpt = None
        if self.checkpointing is not None:  # each process reads its own shards
            ckpt = self._resume(layout, sharded_checkpoint.ProcessRows(island.boxes))
            if ckpt is not None:
                leaves = ckpt.params(view.leaves())
                view = View(layout, layout.write(leaves, {}), "params given to join()")
        vectors = island.join(view)
        if ckpt is not None:
            trail = self._keeping.trail
            assert trail is not None  # made by _resume
            vectors.update(sharded_checkpoint.resume(ckpt, island, leaves, trail))
        self._boundary = time.perf_counter()
        return self._write(view, vectors)

    def _join(self, params: PyTree) -> PyTree:
        self._layout = layout = TreeLayout(params, self.fragments, self.is_embedding)
        self._multi = multi = distributed.process_count() > 1
        leader = distributed.is_leader()
        view = View(layout, params, "params given to join()")
        leaves = view.leaves()
        if multi and tenure.split(layout, leaves):
            return self._join_island(layout, view)
        ckpt = None
        if self.checkpointing is not None and not multi and self._holds_claim:
            self._claim_id(self.checkpointing)
        if self.checkpointing is not None:
            ckpt = self._resume(layout)
            if ckpt is not None:  # every leaf, synced or not, as the live one is
                leaves = ckpt.params(leaves)
                view = View(layout, layout.write(leaves, {}), "params given to join()")
        vectors = [np.zeros(size, np.float32) for size in layout.plan.fragment_sizes]
        if leader:  # connects, joins, resumes the checkpoint's sync state
            sync, trail = self._connect(), self._keeping.trail
            vectors = tenure.join_shards(sync, view, ckpt, trail, self._shards)
        if multi:
            vectors = distributed.broadcast(vectors)
        self._boundary = time.perf_counter()
        return layout.write(view.leaves(), dict(enumerate(vectors)))

    def _claim_id(self, ckpt: Checkpointing) -> None:
        """One live process per id: the claim, or (standby) the id of a failed learner."""
        claim = self._keeping.hold(self.learner_id, self.index, self.num_learners, self._stop)
        if claim is None:
            raise LearnerStateError(
                f"learner id {self.learner_id!r} is held by a live process "
                f"({standby.holder(ckpt.directory, self.learner_id)}): give another id, "
                "or Checkpointing(standby=True) to wait for a failed learner's"
            )
        if ckpt.standby:  # this process is now the failed learner it took over
            self.learner_id, self.index = claim.learner_id, int(claim.info["learner_index"])

    def _resume(self, layout: TreeLayout, rows: Any = None) -> checkpoint.Checkpoint | None:
        """This id's checkpoint, if any (its steps and tokens are this learner's), and
        the writer of the next ones (tenure.resume)."""
        who = (self.learner_id, self.index, self.num_learners)
        ident = tenure.identity(self._run_info, *who, layout.plan)
        ckpt = self._keeping.resume(layout, ident, self._run_info, multi=self._multi, rows=rows)
        if ckpt is not None:
            self.steps, self.tokens = ckpt.step, int(ckpt.meta.get("tokens", 0))
        return ckpt

    @property
    def _shards(self) -> tenure.Connection:
        """How this learner reaches the shards, under its id as it is now."""
        return tenure.Connection(
            self.addresses,
            self.pattern,
            self.learner_id,
            self.token,
            self.tls,
            self.sync_config.deadline,
        )

    def _connect(self, **engine: Any) -> Synchronizer:
        """The sync engine (tenure.connect), stopped at once if `stop` came first."""
        sync = tenure.connect(self.sync_config, self.plan, self._shards, self._on_push, **engine)
        with self._lock:
            self._sync = sync
        if self._stop.is_set():
            sync.stop()
        return sync

    def _save(self, view: View, state: PyTree, wait: bool = False) -> None:
        progress = tenure.Progress(
            self.steps, self.tokens, opt_state=() if state is None else state
        )
        self._keeping.save(view, progress, self._sync, wait=wait)

    def _release(self, done: bool) -> None:
        with self._lock:
            sync, self._sync = self._sync, None
        if sync is not None:
            sync.close()
            self._stats, self._versions = dict(sync.stats), sync.versions()
        self._keeping.release(done)
