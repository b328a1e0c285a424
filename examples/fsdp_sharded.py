r"""A model FSDP-sharded over the JAX processes of one learner (2 processes x 2 CPU devices
here, gloo collectives), trained with optax in its own loop and synced through atoll's
shards. Every process holds a quarter of each sharded leaf and pushes and adopts only
what it holds; the lines marked `# atoll` are all atoll adds to an ordinary sharded loop.

Start a shard, then one learner of 2 processes (the script starts both on this host):

    atoll syncer --data-dir /tmp/atoll-shard --listen 127.0.0.1:7070 --quorum 1
    python examples/fsdp_sharded.py --shards 127.0.0.1:7070 --learner-id a --processes 2

or start the processes yourself, each in its own shell (on one host or several, with a
coordinator address every process reaches):

    python examples/fsdp_sharded.py --shards 127.0.0.1:7070 --learner-id a \
        --processes 2 --process-id 0 --coordinator 127.0.0.1:7171
    python examples/fsdp_sharded.py --shards 127.0.0.1:7070 --learner-id a \
        --processes 2 --process-id 1 --coordinator 127.0.0.1:7171

More learners (give the shard `--quorum` of their number) each take their own
`--learner-id` and `--index`; a learner of 1 process (`--processes 1`) or of any other
mesh trains the same model beside them.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import atoll  # atoll

FEATURES = 16
# FSDP: weights and the first bias split by rows over every device of the learner; the
# last bias (1 value) replicated. Every process's batch is its part of the global batch.
SPECS = {"layer0": {"w": P("fsdp"), "b": P("fsdp")}, "layer1": {"w": P("fsdp"), "b": P()}}


def init_params(key: jax.Array, hidden: int) -> dict:
    """A two-layer MLP as a nested dict: leaves named layer0/w, layer0/b, ..."""
    k0, k1 = jax.random.split(key)
    return {
        "layer0": {
            "w": jax.random.normal(k0, (FEATURES, hidden)) / np.sqrt(FEATURES),
            "b": jnp.zeros(hidden),
        },
        "layer1": {"w": jax.random.normal(k1, (hidden, 1)) / np.sqrt(hidden), "b": jnp.zeros(1)},
    }


def loss_fn(params: dict, x_BxF: jax.Array, y_Bx1: jax.Array) -> jax.Array:
    h_BxH = jnp.tanh(x_BxF @ params["layer0"]["w"] + params["layer0"]["b"])
    return jnp.mean((h_BxH @ params["layer1"]["w"] + params["layer1"]["b"] - y_Bx1) ** 2)


def batches(stream: int, batch_size: int, seed: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The data: a fixed teacher function; each (seed, stream) its own sequence of inputs."""
    # scaled so that sin(x @ teacher) takes a few hundred steps to learn, not one to
    # shrink the output to its mean
    teacher_Fx1 = 2 * np.random.default_rng(0).standard_normal((FEATURES, 1)) / np.sqrt(FEATURES)
    rng = np.random.default_rng([seed, 1 + stream])
    while True:
        x_BxF = rng.standard_normal((batch_size, FEATURES)).astype(np.float32)
        yield x_BxF, np.sin(x_BxF @ teacher_Fx1).astype(np.float32)


def start_processes(n: int) -> int:
    """Runs this script as the n processes of one learner on this host (a coordinator on
    a free local port); returns the first nonzero exit status, or 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, sys.argv[0], *sys.argv[1:], "--coordinator", f"127.0.0.1:{port}"]
    procs = [subprocess.Popen([*command, "--process-id", str(i)]) for i in range(n)]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", default="127.0.0.1:7070", help="HOST:PORT,... of the shards")
    parser.add_argument("--learner-id", required=True)
    parser.add_argument("--index", type=int, default=0, help="which data stream to read")
    parser.add_argument("--seed", type=int, default=0, help="of the init and the data streams")
    parser.add_argument("--processes", type=int, default=1, help="JAX processes of this learner")
    parser.add_argument(
        "--process-id", type=int, help="this process's index; none: start all of them here"
    )
    parser.add_argument("--coordinator", help="HOST:PORT of process 0's JAX coordinator")
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32, help="the learner's, all processes'")
    parser.add_argument("--hidden", type=int, default=64, help="a multiple of all devices")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--period", type=int, default=16, help="H: inner steps per sync")
    parser.add_argument("--fragments", type=int, default=2, help="P")
    parser.add_argument(
        "--wait-for-rounds",
        action="store_true",
        help="synchronous: adopt each round τ steps after its push, waiting for it there",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.processes > 1 and args.process_id is None:
        sys.exit(start_processes(args.processes))
    jax.config.update("jax_num_cpu_devices", args.devices)  # XLA_FLAGS' host device count
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.processes > 1:
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), SPECS)
    batch = NamedSharding(mesh, P("fsdp"))  # the global batch, split over every device
    optimizer = optax.adamw(args.lr)

    @jax.jit
    def train_step(params, opt_state, x_BxF, y_Bx1):
        loss, grads = jax.value_and_grad(loss_fn)(params, x_BxF, y_Bx1)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def global_batch(x_BxF: np.ndarray, y_Bx1: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """A batch every process drew whole, as global arrays: each process gives only
        its rows (a real loader would read only those)."""
        rows = len(x_BxF) // args.processes
        mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
        return (
            jax.make_array_from_process_local_data(batch, x_BxF[mine]),
            jax.make_array_from_process_local_data(batch, y_Bx1[mine]),
        )

    def evaluate(params: dict) -> float:
        """The loss on one test set of 1024 rows, whatever the seed and process count."""
        return float(jax.jit(loss_fn)(params, *global_batch(*next(batches(-1, 1024)))))

    init = jax.jit(init_params, static_argnums=1, out_shardings=shardings)
    params = init(jax.random.key(args.seed), args.hidden)
    loss = evaluate(params)  # every process takes part in the evaluation; process 0 prints
    if jax.process_index() == 0:
        print(f"{args.learner_id}: loss at start {loss:.4f}", flush=True)
    learner = atoll.Learner(
        args.shards,
        args.learner_id,
        fragments=args.fragments,
        sync=atoll.SyncConfig(period=args.period, wait_for_rounds=args.wait_for_rounds),
    )  # atoll
    params = learner.join(params)  # atoll: the global weights, as the shardings of `params`
    opt_state = optimizer.init(params)  # sharded as the params are
    data = batches(args.index, args.batch_size, args.seed)  # the same for any process count
    for _ in range(args.steps):
        params, opt_state, loss = train_step(params, opt_state, *global_batch(*next(data)))
        params = learner.step(params, tokens=args.batch_size)  # atoll: every process calls it
    params = learner.finish(params)  # atoll
    loss = evaluate(params)
    if jax.process_index() == 0:
        print(f"{args.learner_id}: global loss at the end {loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
