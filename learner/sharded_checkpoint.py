"""The sync state in the checkpoint of a learner sharded over its JAX processes
(learner/sharded.py): each process writes and reads its own fragment vectors.

A process of such a learner keeps, per fragment, its *local* vectors: the origin its
next outer gradient is measured from (its held boxes' values, learner/boxes.py) and the
error-feedback residual of the boxes it sends. In the checkpoint's `sync/` item each is
one global float32 array of shape (processes, width), row j being process j's vector,
zero-padded to the widest process's (`origin_<p>`, `residual_<p>`). The array is sharded
by rows over a (process, device) mesh: every process writes its row, from its own
devices, with no value from another process, and reads it back the same way. `meta/`
(written by process 0) records the layout, the process count and a digest of every
process's boxes.

A row is a process's boxes of a fragment, which only the same mesh (process count,
shardings of the synced leaves) gives again. A checkpoint restored onto another mesh
(more or fewer processes, another sharding, or one process) takes its params and state
(Orbax reads each leaf into its new sharding) and the step, data position and seqs; its
fragments restart from the global weights (their local progress since their last push
is dropped, as a learner without a checkpoint would), and the log says so. The other
way carries: a sharded learner resuming the checkpoint of a learner whose process 0
synced for all (one process, or params replicated) takes its boxes of those whole
vectors.
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from atoll.learner import checkpoint

if TYPE_CHECKING:
    from atoll.learner.boxes import ProcessBoxes
    from atoll.learner.checkpoint import Capture, Checkpoint, PushTrail

log = logging.getLogger("atoll.learner")
LAYOUT = "process-rows"  # meta["sync_layout"] of a checkpoint written this way
NO_CUT = 0  # process 0 found no cut (cuts count from 1)


def _allgather(row: Sequence[int]) -> np.ndarray:
    """Every process's int64 `row` (all of one length), as an (n, len) array."""
    from jax.experimental import multihost_utils

    mine = np.asarray(row, np.int64)
    return np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size)


def boxes_digest(boxes: ProcessBoxes) -> int:
    """A digest of which boxes this process holds and sends: equal on a restart onto
    the same mesh, different where a row would mean other values."""
    text = repr([[(b.tensor, b.bounds, b.sent) for b in f.boxes] for f in boxes.fragments])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


def agreed_cut(path: pathlib.Path) -> int:
    """The cut every process of a multi-process learner resumes: process 0's newest
    (NO_CUT where it has none). CheckpointError on every process where one of them does
    not see that cut (its directory is not the same one)."""
    newest = checkpoint.newest_cut(path)
    cut = int(_allgather([newest or NO_CUT])[0, 0])
    seen = _allgather([cut == NO_CUT or (pathlib.Path(path) / str(cut)).is_dir()])[:, 0]
    if not seen.all():
        missing = [j for j, ok in enumerate(seen) if not ok]
        raise checkpoint.CheckpointError(
            f"{path}: process 0 resumes cut {cut}, which process {missing[0]} does not see; "
            "every process of a learner must mount the same checkpoint directory"
        )
    return cut


def _row_sharding() -> Any:
    """Rows over a (process, device) mesh: row j on process j's devices, replicated there."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    spec: Any = P  # (untyped in jax's stubs)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices).reshape(jax.process_count(), -1)
    return NamedSharding(Mesh(grid, ("process", "device")), spec("process"))


class ProcessRows:
    """The Checkpointer's hook for a sharded learner: a capture's local vectors as
    per-process rows (called on every process, at the same steps: it all-gathers)."""

    def __init__(self, boxes: ProcessBoxes):
        self.boxes = boxes
        self.digest = boxes_digest(boxes)

    def rows(self, cap: Capture) -> Capture:
        """`cap` with its vectors as global row arrays and meta describing them. A vector
        that any process lacks (a push in flight there) is left out on all."""
        fragments = len(self.boxes.fragments)
        have = [int(p in cap.origins) for p in range(fragments)]
        have += [int(p in cap.residuals) for p in range(fragments)]
        sizes = [f.size for f in self.boxes.fragments]
        sizes += [f.sent_size for f in self.boxes.fragments]
        rows = _allgather([self.digest, *have, *sizes])
        agreed = np.asarray(rows[:, 1 : 1 + 2 * fragments].all(axis=0))
        widths = rows[:, 1 + 2 * fragments :].max(axis=0)
        make: Any = jax.make_array_from_process_local_data  # (untyped in jax's stubs)
        sharding = _row_sharding()
        out: list[dict[int, Any]] = [{}, {}]
        for k, vectors in enumerate((cap.origins, cap.residuals)):
            for p in range(fragments):
                width = int(widths[k * fragments + p])
                if agreed[k * fragments + p] and width > 0:
                    row = np.zeros((1, width), np.float32)
                    row[0, : vectors[p].size] = vectors[p]
                    shape = (jax.process_count(), width)
                    out[k][p] = make(sharding, row, shape)
        meta = {
            **cap.meta,
            "sync_layout": LAYOUT,
            "processes": jax.process_count(),
            "boxes": [int(d) for d in rows[:, 0]],
            "origins": sorted(out[0]),
            "residuals": sorted(out[1]),
        }
        return checkpoint.Capture(meta, cap.params, cap.state, out[0], out[1])


def read_rows(
    ckpt: Checkpoint, boxes: ProcessBoxes
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """This process's (origins, residuals) from `ckpt`, read by every process together:
    its rows, or its boxes of a one-process checkpoint's whole vectors; ({}, {}) on every
    process where another mesh wrote the rows (the fragments restart from the global
    weights)."""
    meta, me = ckpt.meta, jax.process_index()
    if meta.get("sync_layout") is None and ckpt.path is not None:
        return _taken(ckpt.path, ckpt.cut, boxes)
    same = (
        meta.get("sync_layout") == LAYOUT
        and meta.get("processes") == jax.process_count()
        and meta["boxes"][me] == boxes_digest(boxes)
    )
    if not _allgather([same])[:, 0].all():
        log.warning(
            "%s: written by %s; this learner's sync vectors are per process and per box, "
            "so each fragment restarts from the global weights (its local progress since "
            "its last push is not carried); params, state and step are resumed",
            ckpt.path,
            f"{meta['processes']} processes of another mesh",
        )
        return {}, {}
    import orbax.checkpoint as ocp

    sharding, n = _row_sharding(), jax.process_count()
    sizes = [[f.size for f in boxes.fragments], [f.sent_size for f in boxes.fragments]]
    widths = _allgather([*sizes[0], *sizes[1]]).max(axis=0).reshape(2, -1)
    shape_dtype: Any = jax.ShapeDtypeStruct  # (untyped in jax's stubs)
    targets = {
        f"{name}_{p}": shape_dtype((n, int(widths[k, p])), np.float32, sharding=sharding)
        for k, name in enumerate(("origin", "residual"))
        for p in meta[name + "s"]
    }
    if not targets:
        return {}, {}
    got = checkpoint.restore_items(ckpt, **{checkpoint.SYNC: ocp.args.StandardRestore(targets)})
    saved = got[checkpoint.SYNC]
    out: list[dict[int, np.ndarray]] = [{}, {}]
    for k, name in enumerate(("origin", "residual")):
        for p in meta[name + "s"]:
            row = np.asarray(saved[f"{name}_{p}"].addressable_shards[0].data)
            out[k][p] = row.reshape(-1)[: sizes[k][p]].copy()
    return out[0], out[1]


def _taken(
    path: pathlib.Path, cut: int, boxes: ProcessBoxes
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """This process's boxes of the whole-fragment vectors of a checkpoint written by a
    learner whose process 0 synced for all (each process reads them whole, once)."""
    whole = checkpoint.read(path, vectors=True, cut=cut)
    assert whole is not None  # the cut read already
    origins = {p: boxes.take(p, v) for p, v in whole.origins.items()}
    residuals = {p: boxes.fragments[p].sent(boxes.take(p, v)) for p, v in whole.residuals.items()}
    return origins, residuals


def resume(
    ckpt: Checkpoint, island: Any, leaves: Sequence[Any], trail: PushTrail
) -> dict[int, np.ndarray]:
    """After `island.join`, on every process: carries each fragment's local progress onto
    the global weights as learner/checkpoint.py's guarantee 4 allows, with process 0's
    reading of the shards' last seqs for all. Returns {fragment: local vector}.

    `leaves`: the checkpoint's params, as restored into the live shardings."""
    sync, boxes = island.sync, island.boxes
    try:
        ckpt.origins, ckpt.residuals = read_rows(ckpt, boxes)
        failed = None
    except Exception as e:  # told to every process: none waits at a collective for it
        failed = e
    told = _allgather([failed is not None])[:, 0]
    if told.any():
        if failed is not None:
            raise failed
        raise checkpoint.CheckpointError(
            f"{ckpt.path}: process {int(told.argmax())} of this learner cannot read its sync "
            "vectors: its log says why"
        )
    theta = [f.read(leaves) for f in boxes.fragments]
    fragments = len(boxes.fragments)
    last = checkpoint.shard_last_seqs(sync) if island.leader else {}
    agreed = _allgather([last.get(p, -1) for p in range(fragments)])[0]
    # A push of the previous run may still be held in part by its shard (a process died
    # before the last part): the shard counts its seq in last_seq, so join's seqs already
    # go on above it and this run's first push of the fragment supersedes those parts.
    return checkpoint.resume_sync(
        ckpt, sync, theta, trail, {p: int(s) for p, s in enumerate(agreed) if s >= 0}
    )
