"""One process of a test learner sharded over 2 processes x 2 CPU devices (or one process
holding the params replicated), the model and meshes of sharded_learner_worker.py: trains
on a fixed schedule and writes, as JSON, the bytes it pulled at join and after, and, with
`--join-only`, the values of every shard it holds right after join (an .npz beside the
JSON); `--pause-part F`: the closer of fragment 0 stops before it sends its part of that
fragment's second push (every other part acknowledged), touches F.armed and goes on once
F.go exists; `--lockstep`: after every step a process waits until its syncs in flight
are done, so every push is adopted at the step it would be with no delay anywhere (a
run whose shard is killed and one whose is not adopt alike). Run by tests/integration/test_sharded_pull_boxes.py and
test_sharded_shard_kill.py."""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from sharded_learner_worker import SHAPES, SPECS, place, train_step, values


def _held(params: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """Every distinct shard this process holds: "<leaf>:<start>-<stop>,..." -> values."""
    out = {}
    for name, leaf in params.items():
        for shard in leaf.addressable_shards:
            bounds = ",".join(
                f"{s.indices(n)[0]}-{s.indices(n)[1]}" for s, n in zip(shard.index, leaf.shape)
            )
            out[f"{name}:{bounds}"] = np.asarray(shard.data)
    return out


def _pause_before_part(path: str) -> None:
    """The injector of `--pause-part`: wraps `PartSync._push_part` on this process."""
    from atoll.learner import sharded

    push_part, seen = sharded.PartSync._push_part, []

    def paused(self, theta, fields, part):
        roles = self.shared.roles
        if self.p == 0 and roles.closer(0) == roles.me:
            seen.append(fields["seq"])
            if len(seen) == 2:
                pathlib.Path(path + ".armed").touch()
                while not pathlib.Path(path + ".go").exists():
                    time.sleep(0.05)
        return push_part(self, theta, fields, part)

    sharded.PartSync._push_part = paused


def _settle(learner: object, timeout: float = 120.0) -> None:
    """Waits until none of this process's fragments has a sync in flight."""
    sync = learner._sync  # the sync engine (atoll.Learner's, private): tests only
    deadline = time.monotonic() + timeout
    while any(f.task is not None and not f.task.done() for f in sync.frags):
        assert time.monotonic() < deadline, f"syncs still in flight after {timeout} s"
        time.sleep(0.01)


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
    ap.add_argument("--join-only", action="store_true")
    ap.add_argument("--pause-part", default="")
    ap.add_argument("--lockstep", action="store_true")
    ap.add_argument("--fault", default="", help="codec | id | devices: process 1's misuse")
    args = ap.parse_args()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.num_processes > 1:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import atoll

    if args.pause_part:
        _pause_before_part(args.pause_part)

    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    odd = args.process_id == 1
    if args.fault == "devices" and odd:  # the same mesh shape, the devices in another order
        devices = devices[::-1]
    if args.mesh == "fsdp-tp":  # a row of the mesh per process
        mesh = Mesh(devices.reshape(-1, 2), ("fsdp", "tp"))
    else:
        mesh = Mesh(devices, ("fsdp",))
    specs = {k: P() if args.replicated else spec for k, spec in SPECS[args.mesh].items()}
    out: dict = {"process": args.process_id}
    learner = None
    try:
        learner = atoll.Learner(
            args.shards,
            "other" if args.fault == "id" and odd else "island",
            fragments=2,
            sync=atoll.SyncConfig(
                period=4,
                overlap=1,
                codec="FP32" if args.fault == "codec" and odd else "INT4",
                wait_for_rounds=True,
            ),
        )
        params = learner.join(place(values(0, SHAPES), specs, mesh))
        joined = dict(learner.stats)
        out["bytes_joined"] = joined.get("bytes_received", 0)
        if args.join_only:
            np.savez(args.out + ".npz", **_held(params))
        for step in range(0 if args.join_only else args.steps):
            params = train_step(params, place(values(100 + step, SHAPES), specs, mesh))
            params = learner.step(params, tokens=8)
            if args.lockstep:
                _settle(learner)
            else:
                time.sleep(0.3)  # every round closes before the next step: one schedule
        params = learner.finish(params)
        stats = learner.stats
        out["bytes_pulled"] = stats.get("bytes_received", 0) - out["bytes_joined"]
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
