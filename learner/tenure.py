"""One learner id's tenure in a run: the parts of `atoll.Learner` (learner/api.py) around
its steps. `claim` holds the id (one live process per id; a standby takes a failed
learner's), `resume` reads the id's checkpoint and makes its writer, `connect` and
`join_shards` reach the shards and start from the run's weights (the checkpoint's local
progress carried onto them), `save` writes a checkpoint, `restored_state` reads the
caller's state back, `release` lets the id go. Functions of what they need: the Learner
keeps what they return, and its phase.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from atoll.learner import checkpoint, distributed, standby
from atoll.learner.config import Checkpointing
from atoll.learner.pytree import ParamsError, PyTree, TreeLayout
from atoll.learner.stopping import Stopped
from atoll.learner.sync import SyncConfig, Synchronizer
from atoll.wire.client import ShardClient, TlsFiles
from atoll.wire.plan import FragmentPlan

log = logging.getLogger("atoll.learner")


class View:
    """The params of one call, flattened and checked once (`leaves`): structure, shapes
    and dtypes are metadata, so a step with no sync due still reads nothing from the
    device."""

    __slots__ = ("layout", "params", "what", "_leaves")

    def __init__(self, layout: TreeLayout, params: PyTree, what: str):
        self.layout, self.params, self.what = layout, params, what
        self._leaves: list[Any] | None = None

    def leaves(self) -> list[Any]:
        if self._leaves is None:
            self._leaves = self.layout.leaves(self.params, self.what)
        return self._leaves


def read(view: View, p: int) -> np.ndarray:
    """Fragment `p` of the view's params, as one float32 vector on the host."""
    return view.layout.read(view.leaves(), p)


def add(view: View, p: int, out: np.ndarray) -> None:
    """`out += read(view, p)`, bit for bit, with no vector of the fragment's own."""
    view.layout.add_to(view.leaves(), p, out)


@dataclasses.dataclass(frozen=True)
class Connection:
    """How a learner reaches the shards: their addresses in index order (and the pattern
    that names shards a reshard adds), its id, bearer token, TLS and per-call deadline."""

    addresses: tuple[str, ...]
    pattern: str | None
    learner_id: str
    token: str | None
    tls: TlsFiles | None
    deadline: float

    def client(self, address: str) -> ShardClient:
        return ShardClient(
            address, self.learner_id, token=self.token, tls=self.tls, deadline=self.deadline
        )


@dataclasses.dataclass
class Progress:
    """What a checkpoint captures of the caller's side (the names checkpoint.py reads)."""

    steps_done: int = 0
    tokens_total: int = 0
    params: Any = None  # every leaf of the tree, in tree order (synced or not)
    opt_state: Any = ()  # the caller's `state`, if it passes one


def claim(
    directory: pathlib.Path,
    learner_id: str,
    index: int,
    num_learners: int,
    *,
    wait: bool,
    stop: threading.Event,
) -> standby.Claim | None:
    """One live process per id: `learner_id`'s claim in `directory`, None where a live
    process holds it; or (`wait`, a standby) the claim of the first learner of this run
    to fail, whose id, data shard and checkpoint are then this process's. Raises Stopped
    where `stop` ends a standby's wait."""
    if not wait:
        return standby.acquire(directory, learner_id, index, num_learners, stop=stop)
    log.info("standby %s waiting for a failed learner in %s", learner_id, directory)
    taken = standby.wait_for_vacancy(directory, num_learners, stop)
    if taken is None:
        raise Stopped(f"standby {learner_id} stopped before taking over a learner")
    log.info("standby %s takes over learner %s", learner_id, taken.learner_id)
    return taken


def identity(
    run_info: Mapping[str, Any], learner_id: str, index: int, num_learners: int, plan: FragmentPlan
) -> dict[str, Any]:
    """What a checkpoint records of the learner that wrote it, and a resume checks."""
    return {
        **run_info,
        "learner_id": learner_id,
        "learner_index": index,
        "num_learners": num_learners,
        "plan_fingerprint": plan.fingerprint,
    }


def resume(
    directory: pathlib.Path,
    layout: TreeLayout,
    ident: dict[str, Any],
    run_info: Mapping[str, Any],
    every: int,
    *,
    multi: bool,
    rows: Any = None,
) -> tuple[checkpoint.Checkpoint | None, checkpoint.PushTrail, checkpoint.Checkpointer]:
    """(the checkpoint of `ident`'s id, None where there is none; the push trail a
    checkpoint records; the writer of its next ones, every `every` steps). The checkpoint
    is checked to be of this plan and run; every process of a
    multi-host learner resumes process 0's newest cut. `rows`: a sharded learner's
    (learner/sharded_checkpoint.py)."""
    from atoll.learner.sharded_checkpoint import agreed_cut

    learner_id = str(ident["learner_id"])
    path = checkpoint.path_for(directory, learner_id)
    cut = agreed_cut(path) if multi else None
    vectors = distributed.is_leader() and rows is None
    ckpt = checkpoint.read(path, vectors=vectors, cut=cut)
    if ckpt is not None:
        checkpoint.check(ckpt, ident, path)
        for key, value in run_info.items():
            if ckpt.meta.get(key) != value:
                raise checkpoint.CheckpointError(
                    f"{path} was written with {key}={ckpt.meta.get(key)!r}, this learner "
                    f"runs {key}={value!r}: resume with the same settings, or give "
                    "another checkpoint directory"
                )
        if [tuple(s) for s, _ in ckpt.meta["params"]] != layout.shapes:
            raise checkpoint.CheckpointError(f"{path} holds another model's params")
    trail = checkpoint.PushTrail(layout.plan.num_fragments)
    return ckpt, trail, checkpoint.Checkpointer(directory, learner_id, every, ident, rows)


def connect(
    config: SyncConfig,
    plan: FragmentPlan,
    shards: Connection,
    on_push: Callable[[dict[str, Any]], None] | None,
    **engine: Any,
) -> Synchronizer:
    """The sync engine over a client per shard (and the pattern's, for shards a reshard
    adds). `engine`: the Synchronizer's `fragment_sync`, `read_fragment` and
    `add_fragment`, for a sharded island."""
    pattern = shards.pattern
    return Synchronizer(
        config,
        plan,
        [shards.client(a) for a in shards.addresses],
        on_push=on_push,
        connect=None
        if pattern is None
        else lambda i: shards.client(pattern.replace("{i}", str(i))),
        **{"read_fragment": read, "add_fragment": add, **engine},
    )


def join_shards(
    sync: Synchronizer,
    view: View,
    ckpt: checkpoint.Checkpoint | None,
    trail: checkpoint.PushTrail | None,
    shards: Connection,
) -> list[np.ndarray]:
    """Process 0: joins the shards (seeding what nobody has) and resumes the sync state of
    `ckpt` (with `trail`, both from `resume`), if any; returns every fragment's vector to
    start from."""
    log.info("learner %s joining the syncer at %s", shards.learner_id, ", ".join(shards.addresses))
    theta_ckpt = None
    if ckpt is not None:
        theta_ckpt = [read(view, p) for p in range(view.layout.plan.num_fragments)]
    vectors = sync.join_fragments(view)
    if ckpt is not None:
        assert trail is not None and theta_ckpt is not None  # made by resume, and above
        carried = checkpoint.resume_sync(
            ckpt, sync, theta_ckpt, trail, checkpoint.shard_last_seqs(sync)
        )
        for p, vector in carried.items():
            vectors[p] = vector
        log.info(
            "learner %s resumed its checkpoint at step %d: local progress kept for fragments %s",
            shards.learner_id,
            ckpt.step,
            sorted(carried),
        )
    return vectors


def save(
    checkpointer: checkpoint.Checkpointer,
    view: View,
    progress: Progress,
    sync: Synchronizer | None,
    trail: checkpoint.PushTrail | None,
    wait: bool = False,
) -> None:
    """Writes a checkpoint of `view`'s params (every leaf, out of the plan too: an int
    step counter) and `progress`, in the background unless `wait`."""
    progress.params = list(view.leaves())
    checkpointer.save(progress, sync, trail, wait=wait)


def restored_state(ckpt: checkpoint.Checkpoint, template: PyTree) -> PyTree:
    """The `state` `ckpt` holds, in `template`'s structure, dtypes and shardings (each
    process reads its own shards), or `template` itself where it holds none."""
    if not ckpt.meta["state"]:
        return template
    leaves, treedef = jax.tree_util.tree_flatten(template)
    saved = [tuple(shape) for shape, _ in ckpt.meta["state"]]
    if saved != [np.shape(b) for b in leaves]:
        raise ParamsError(
            f"the checkpoint's state has {len(saved)} leaves of shapes "
            f"{saved[:4]}..., the template {len(leaves)} of "
            f"{[np.shape(b) for b in leaves][:4]}...: pass a template made the way the "
            "state you checkpointed was (the same optimiser, over the same params)"
        )
    return jax.tree_util.tree_unflatten(treedef, ckpt.state(leaves))


def release(
    checkpointer: checkpoint.Checkpointer | None, claim: standby.Claim | None, done: bool
) -> None:
    """Ends the checkpoint writes in flight and gives up the id's claim (`done`: marked
    done, so no standby takes the id over)."""
    if checkpointer is not None:
        checkpointer.close()
    if claim is not None:
        claim.release(done=done)


class Keeping:
    """A learner id's checkpoints, from `join` to the end (empty without a
    `Checkpointing`): the id's claim, the checkpoint it resumed, the writer of its next
    ones and the push trail they record; the Learner keeps one and asks it."""

    def __init__(self, settings: Checkpointing | None):
        self.settings = settings
        self.claim: standby.Claim | None = None
        self.resumed: checkpoint.Checkpoint | None = None  # what `join` resumed, if any
        self.trail: checkpoint.PushTrail | None = None
        self.writer: checkpoint.Checkpointer | None = None  # None: nothing is kept

    def hold(
        self, learner_id: str, index: int, num_learners: int, stop: threading.Event
    ) -> standby.Claim | None:
        """The id's claim (`claim`): None where a live process holds it."""
        assert self.settings is not None
        where, wait = self.settings.directory, self.settings.standby
        self.claim = claim(where, learner_id, index, num_learners, wait=wait, stop=stop)
        return self.claim

    def resume(
        self,
        layout: TreeLayout,
        ident: dict[str, Any],
        run_info: Mapping[str, Any],
        *,
        multi: bool,
        rows: Any = None,
    ) -> checkpoint.Checkpoint | None:
        """Reads the id's checkpoint, if any, and makes the writer (`resume`)."""
        assert self.settings is not None
        where, every = self.settings.directory, self.settings.every
        self.resumed, self.trail, self.writer = resume(
            where, layout, ident, run_info, every, multi=multi, rows=rows
        )
        return self.resumed

    def after_step(
        self, sync: Synchronizer | None, seq_before: int, local: int, view: View
    ) -> None:
        """Records the step's pushes in the trail (process 0 of a replicated learner)."""
        if sync is not None and self.trail is not None:
            self.trail.after_step(sync, view.layout.plan, seq_before, local, view)

    def save(
        self, view: View, progress: Progress, sync: Synchronizer | None, wait: bool = False
    ) -> None:
        """Writes a checkpoint (`save`), in the background unless `wait`."""
        assert self.writer is not None
        save(self.writer, view, progress, sync, self.trail, wait=wait)

    def release(self, done: bool) -> None:
        release(self.writer, self.claim, done)


def split(layout: TreeLayout, leaves: Sequence[Any]) -> bool:
    """Whether a synced leaf is split over several processes: then every process syncs its
    own boxes (learner/sharded.py); else process 0 syncs for all (learner/distributed.py)."""
    return any(
        hasattr(leaves[i], "is_fully_addressable")
        and not (leaves[i].is_fully_addressable or leaves[i].is_fully_replicated)
        for i in layout.synced
    )
