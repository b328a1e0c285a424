"""One process of a test learner whose params are sharded over 2 processes x 2 CPU devices
(`--mesh fsdp`: FSDP over all 4 devices; `--mesh fsdp-tp`: a 2 x 2 mesh, FSDP across the
processes and tensor parallel within each) or, `--replicated`, one process holding them
replicated: trains a fixed elementwise model on a fixed schedule against the shards given
and writes what it measured as JSON. Run by tests/integration/test_learner_sharded.py."""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Every box any mesh below cuts is made of whole 32-value runs of its tensor, at offsets
# in the fragment that are multiples of 32: each part's INT4 blocks are a whole push's.
SHAPES = {"w0": (16, 64), "w1": (8, 64), "b": (64,), "emb": (4, 32)}
SPECS = {
    # FSDP over the rows; "b" replicated on every device
    "fsdp": {"w0": P("fsdp"), "w1": P("fsdp"), "b": P(), "emb": P("fsdp")},
    # rows over the processes, columns over each process's 2 devices; "w1" split only by
    # columns, so held whole by both processes (process 0 sends it); "b" replicated
    "fsdp-tp": {"w0": P("fsdp", "tp"), "w1": P(None, "tp"), "b": P(), "emb": P("fsdp")},
}


def values(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def place(tree: dict[str, np.ndarray], specs: dict[str, P], mesh: Mesh) -> dict[str, jax.Array]:
    return {
        k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]), lambda i, v=v: v[i])
        for k, v in tree.items()
    }


@jax.jit
def train_step(params, target):
    # elementwise: no reduction over a sharded axis, so no order of sums differs between
    # the sharded and the replicated learner
    return jax.tree.map(lambda w, t: w - 0.1 * (w - jnp.tanh(t)), params, target)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--coordinator")
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--replicated", action="store_true")
    ap.add_argument("--mesh", choices=sorted(SPECS), default="fsdp")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--codec", default="INT4")
    ap.add_argument("--w1-columns", type=int, default=64, help="32: boxes off the INT4 blocks")
    ap.add_argument("--fault", default="", help="misorder | mesh | plan: process 1's misuse")
    args = ap.parse_args()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.num_processes > 1:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import atoll

    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    if args.mesh == "fsdp-tp":  # a row of the mesh per process
        mesh = Mesh(devices.reshape(-1, 2), ("fsdp", "tp"))
    else:
        mesh = Mesh(devices, ("fsdp",))
    specs = {k: P() if args.replicated else spec for k, spec in SPECS[args.mesh].items()}
    if args.fault == "mesh" and args.process_id == 1:
        specs["w1"] = P(None, "fsdp")
    shapes = {**SHAPES, "w1": (SHAPES["w1"][0], args.w1_columns)}
    out: dict = {"process": args.process_id}
    learner = None
    try:
        learner = atoll.Learner(
            args.shards,
            "island",
            fragments=3 if args.fault == "plan" and args.process_id == 1 else 2,
            sync=atoll.SyncConfig(period=4, overlap=1, codec=args.codec, wait_for_rounds=True),
        )
        params = learner.join(place(values(0, shapes), specs, mesh))
        joined = dict(learner.stats)
        out["bytes_seeded"] = joined.get("bytes_sent", 0)  # join sends only its seed parts
        out["held"] = {
            k: [list(s.data.shape) for s in v.addressable_shards] for k, v in params.items()
        }
        for step in range(args.steps):
            params = train_step(params, place(values(100 + step, shapes), specs, mesh))
            if args.fault == "misorder" and args.process_id == 1 and step == 5:
                params = learner.finish(params)
                break
            params = learner.step(params, tokens=8)
            time.sleep(0.3)  # every round closes before the next step: one schedule
        else:
            params = learner.finish(params)
        stats = learner.stats
        out["bytes_pushed"] = stats.get("bytes_sent", 0) - joined.get("bytes_sent", 0)
        out["pushes"] = stats.get("pushes", 0)
        out["versions"] = {str(p): v for p, v in learner.versions.items()}
    except Exception as e:  # the test reads what each process raised
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if learner is not None:
            learner.close()
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
