"""A plain-pytree model (a dict of jnp arrays) and an optax optimizer, trained by several
learners that sync through atoll's shards. The six lines marked `# atoll` are all that
atoll adds to an ordinary optax loop.

Start a shard, then two learners (each in its own shell):

    atoll syncer --data-dir /tmp/atoll-shard --listen 127.0.0.1:7070 --quorum 2
    python examples/plain_optax.py --shards 127.0.0.1:7070 --learner-id a --index 0
    python examples/plain_optax.py --shards 127.0.0.1:7070 --learner-id b --index 1
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

import atoll  # atoll

FEATURES = 16


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


def batches(stream: int, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The data: a fixed teacher function; each learner reads its own stream of inputs."""
    teacher_Fx1 = np.random.default_rng(0).standard_normal((FEATURES, 1))
    rng = np.random.default_rng(1 + stream)
    while True:
        x_BxF = rng.standard_normal((batch_size, FEATURES)).astype(np.float32)
        yield x_BxF, np.sin(x_BxF @ teacher_Fx1).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", default="127.0.0.1:7070", help="HOST:PORT,... of the shards")
    parser.add_argument("--learner-id", required=True)
    parser.add_argument("--index", type=int, default=0, help="which data stream to read")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--period", type=int, default=16, help="H: inner steps per sync")
    parser.add_argument("--fragments", type=int, default=2, help="P")
    args = parser.parse_args()

    optimizer = optax.adamw(args.lr)

    @jax.jit
    def train_step(params, opt_state, x_BxF, y_Bx1):
        loss, grads = jax.value_and_grad(loss_fn)(params, x_BxF, y_Bx1)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x_test, y_test = next(batches(-1, 1024))
    params = init_params(jax.random.key(0), args.hidden)
    print(f"{args.learner_id}: loss at start {float(loss_fn(params, x_test, y_test)):.4f}")
    sync = atoll.SyncConfig(period=args.period)  # atoll: H; τ, α, codec at their defaults
    learner = atoll.Learner(
        args.shards, args.learner_id, fragments=args.fragments, sync=sync
    )  # atoll
    params = learner.join(params)  # atoll: the run's current global weights
    opt_state = optimizer.init(params)
    data = batches(args.index, args.batch_size)
    for _ in range(args.steps):
        x_BxF, y_Bx1 = next(data)
        params, opt_state, loss = train_step(params, opt_state, x_BxF, y_Bx1)
        params = learner.step(params, tokens=len(x_BxF))  # atoll: adopts synced fragments
    params = learner.finish(params)  # atoll: pushes the last steps, adopts their rounds
    print(f"{args.learner_id}: global loss at the end {float(loss_fn(params, x_test, y_test)):.4f}")


if __name__ == "__main__":
    main()
