"""One process of a test learner whose params (a bfloat16 and a float32 leaf FSDP-sharded
over 2 processes x 2 CPU devices, a replicated float32 bias, an int step counter kept out
of the plan) are checkpointed in Orbax; or, `--replicated`, an ordinary one-process
learner of the same model. Trains an elementwise model, checkpoints, and writes what it
holds (digests of its params, state and sync vectors) as JSON. Run by
tests/integration/test_sharded_checkpoint.py.

`--hold-from-seq S` (process 1, the closer of every push): before sending its part of
the first push with seq >= S, it writes that seq to `--marker` and waits, so a test can
kill it with the push's other part already held by the shard.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

SHAPES = {"w0": (16, 64), "w1": (8, 32), "b": (64,)}
DTYPES = {"w0": jnp.bfloat16, "w1": jnp.float32, "b": jnp.float32}
SPLIT = {"w0", "w1"}  # FSDP over the rows; "b" and "count" replicated on every device


def place(tree: dict[str, np.ndarray], specs: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    return {
        k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]), lambda i, v=v: v[i])
        for k, v in tree.items()
    }


def model(seed: int, specs: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    values = {k: rng.standard_normal(s).astype(DTYPES[k]) for k, s in SHAPES.items()}
    values["count"] = np.asarray(0, np.int32)
    return place(values, specs, mesh)


@jax.jit
def train_step(params, momentum, target):
    """Elementwise: a heavy-ball step toward tanh(target), the counter counting steps."""
    floats = {k: v for k, v in params.items() if k != "count"}
    grads = jax.tree.map(lambda w, t: w.astype(jnp.float32) - jnp.tanh(t), floats, target)
    momentum = jax.tree.map(lambda m, g: 0.9 * m + g, momentum, grads)
    new = jax.tree.map(lambda w, m: (w - 0.05 * m).astype(w.dtype), floats, momentum)
    return {**new, "count": params["count"] + 1}, momentum


def digest(leaf: Any) -> str:
    """This process's shards of a leaf (or a host vector), bit for bit."""
    h = hashlib.sha256()
    shards = getattr(leaf, "addressable_shards", None)
    if shards is None:
        h.update(np.ascontiguousarray(leaf).tobytes())
    else:
        for s in sorted(shards, key=lambda s: s.device.id):
            h.update(np.ascontiguousarray(np.asarray(s.data)).tobytes())
    return h.hexdigest()[:16]


def hold_closer(from_seq: int, marker: pathlib.Path) -> None:
    """The fault injector: this process's part of the first push of seq >= from_seq
    waits (the test kills the process meanwhile)."""
    from atoll.learner import sharded

    push_part = sharded.PartSync._push_part

    def held(self: Any, theta: Any, fields: dict[str, Any], part: int) -> Any:
        if fields["seq"] >= from_seq:
            marker.write_text(json.dumps({"seq": fields["seq"], "fragment": self.p}))
            time.sleep(600)
        return push_part(self, theta, fields, part)

    sharded.PartSync._push_part = held  # type: ignore[method-assign]


def local_values(leaf: Any) -> list[float]:
    """This process's shards of a leaf, as float64 values, device after device."""
    shards = sorted(leaf.addressable_shards, key=lambda s: s.device.id)
    return [float(x) for s in shards for x in np.asarray(s.data, np.float64).reshape(-1)]


def settled(learner: Any) -> bool:
    """No push in flight on any process of the learner."""
    from jax.experimental import multihost_utils

    busy = any(f.task is not None for f in learner._sync.frags)
    return not np.asarray(multihost_utils.process_allgather(np.int32(busy))).any()


def sync_state(learner: Any) -> dict[str, Any]:
    """Per fragment: the digest of this process's residual and of the vector its next
    outer gradient is measured from (none while a push is in flight)."""
    out = {}
    for f in learner._sync.frags:
        if f.task is None:
            origin = f.origin if f.origin is not None else f.base
            out[str(f.p)] = {
                "residual": digest(f.ef.residual),
                "residual_nonzero": bool(np.any(f.ef.residual)),
                "origin": digest(origin),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--learner-id", default="island")
    ap.add_argument("--coordinator")
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--replicated", action="store_true")
    ap.add_argument("--checkpoint-dir")
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--until", help="train until this file exists (instead of --steps)")
    ap.add_argument("--sleep", type=float, default=0.2)
    ap.add_argument("--end", default="finish", help="finish | save (stop, checkpoint, close)")
    ap.add_argument("--hold-from-seq", type=int, default=0)
    ap.add_argument("--marker")
    args = ap.parse_args()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.num_processes > 1:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    if args.hold_from_seq and args.process_id == 1:
        hold_closer(args.hold_from_seq, pathlib.Path(args.marker))
    import atoll

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    specs = {k: P("fsdp") if k in SPLIT and not args.replicated else P() for k in SHAPES}
    specs["count"] = P()
    out: dict[str, Any] = {"process": args.process_id}
    saving = None  # --checkpoint-dir: atoll.Checkpointing
    if args.checkpoint_dir:
        saving = atoll.Checkpointing(args.checkpoint_dir, every=args.checkpoint_every)
    learner = atoll.Learner(
        args.shards,
        args.learner_id,
        fragments=2,
        sync=atoll.SyncConfig(period=4, overlap=1, patience=5.0),
        checkpoint=saving,
    )
    try:
        params = learner.join(model(0, specs, mesh))
        floats = {k: v for k, v in params.items() if k != "count"}
        zeros = {k: np.zeros(v.shape, np.float32) for k, v in floats.items()}
        momentum = learner.restore_state(place(zeros, specs, mesh))
        out["joined"] = {
            "resumed": learner.resumed,
            "steps": learner.steps,
            "count": int(np.asarray(params["count"].addressable_shards[0].data)),
            "momentum": {k: digest(v) for k, v in momentum.items()},
            "sync": sync_state(learner),
            "seq": learner._sync.seq,
        }
        out["joined"]["values"] = {k: local_values(v) for k, v in params.items()}
        if learner.resumed:  # the checkpoint's own params, read again into these shardings
            # the state read into a template held whole on every host, too
            whole = learner.restore_state({k: jnp.zeros(v.shape) for k, v in zeros.items()})
            out["joined"]["whole_state"] = all(
                np.array_equal(np.asarray(whole[k])[s.index], np.asarray(s.data))
                for k, v in momentum.items()
                for s in v.addressable_shards
            )
            ckpt = learner.resumed_checkpoint  # the checkpoint join resumed
            out["joined"]["origins"] = {str(p): digest(v) for p, v in ckpt.origins.items()}
            restored = ckpt.params(jax.tree.leaves(model(1, specs, mesh)))
            names = sorted(params)  # a dict's leaves are in key order
            out["joined"]["restored"] = {k: local_values(v) for k, v in zip(names, restored)}
        pushes0 = learner.stats.get("pushes", 0)
        step, versions = 0, []
        while (args.until and not os.path.exists(args.until)) or (
            not args.until and step < args.steps
        ):
            target = place(
                {k: np.full(s, np.sin(learner.steps + 1), np.float32) for k, s in SHAPES.items()},
                {k: specs[k] for k in SHAPES},
                mesh,
            )
            params, momentum = train_step(params, momentum, target)
            params = learner.step(params, tokens=8, state=momentum)
            step += 1
            versions.append(min(v for v, _ in learner.versions.values()))
            time.sleep(args.sleep)
        if args.end == "save":
            while not settled(learner):  # nothing in flight: every vector is checkpointed
                # a step trained like the others, so the counter still counts learner.steps
                params, momentum = train_step(params, momentum, target)
                params = learner.step(params, tokens=8, state=momentum)
                time.sleep(args.sleep)
            learner.save(params, state=momentum)
            out["saved"] = {
                "steps": learner.steps,
                "count": int(np.asarray(params["count"].addressable_shards[0].data)),
                "params": {k: digest(v) for k, v in params.items()},
                "values": {k: local_values(v) for k, v in params.items()},
                "momentum": {k: digest(v) for k, v in momentum.items()},
                "sync": sync_state(learner),
                "versions": {str(p): v for p, v in learner.versions.items()},
            }
        else:
            params = learner.finish(params, state=momentum)
        out["pushes"] = learner.stats.get("pushes", 0) - pushes0
        out["steps"] = learner.steps
        out["versions_seen"] = versions
    except Exception as e:  # the test reads what each process raised
        out["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()  # (the log, for whoever reads a failure)
    finally:
        learner.close()
    pathlib.Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
