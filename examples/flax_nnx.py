"""A Flax NNX model with an optax optimizer and its own data iterator, trained by several
learners that sync through atoll's shards. The model's parameters go to atoll as the
`nnx.State` that `nnx.split` gives; the lines marked `# atoll` are all atoll adds.

Start a shard, then two learners (each in its own shell):

    atoll syncer --data-dir /tmp/atoll-shard --listen 127.0.0.1:7070 --quorum 2
    python examples/flax_nnx.py --shards 127.0.0.1:7070 --learner-id a --index 0
    python examples/flax_nnx.py --shards 127.0.0.1:7070 --learner-id b --index 1

Needs flax (`pip install flax`); atoll itself does not.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import jax
import numpy as np
import optax
from flax import nnx

import atoll  # atoll

FEATURES, CLASSES = 16, 4


class Classifier(nnx.Module):
    def __init__(self, hidden: int, rngs: nnx.Rngs):
        self.embed = nnx.Linear(FEATURES, hidden, rngs=rngs)
        self.norm = nnx.LayerNorm(hidden, rngs=rngs)
        self.head = nnx.Linear(hidden, CLASSES, rngs=rngs)

    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        return self.head(jax.nn.gelu(self.norm(self.embed(x_BxF))))


class Batches:
    """The data: points labelled by the nearest of CLASSES fixed centres; each learner
    reads its own stream."""

    def __init__(self, stream: int, batch_size: int):
        self.centres_CxF = np.random.default_rng(0).standard_normal((CLASSES, FEATURES))
        self.rng, self.batch_size = np.random.default_rng(1 + stream), batch_size

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        while True:
            x_BxF = self.rng.standard_normal((self.batch_size, FEATURES)).astype(np.float32)
            distances_BxC = ((x_BxF[:, None, :] - self.centres_CxF[None]) ** 2).sum(-1)
            yield x_BxF, distances_BxC.argmin(-1).astype(np.int32)


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

    graphdef, params = nnx.split(Classifier(args.hidden, nnx.Rngs(0)))
    optimizer = optax.adamw(args.lr)

    def loss_fn(params, x_BxF, labels_B):
        logits_BxC = nnx.merge(graphdef, params)(x_BxF)
        return optax.softmax_cross_entropy_with_integer_labels(logits_BxC, labels_B).mean()

    @jax.jit
    def train_step(params, opt_state, x_BxF, labels_B):
        loss, grads = jax.value_and_grad(loss_fn)(params, x_BxF, labels_B)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x_test, labels_test = next(iter(Batches(-1, 1024)))
    print(f"{args.learner_id}: loss at start {float(loss_fn(params, x_test, labels_test)):.4f}")
    sync = atoll.SyncConfig(period=args.period)  # atoll: H; τ, α, codec at their defaults
    learner = atoll.Learner(
        args.shards, args.learner_id, fragments=args.fragments, sync=sync
    )  # atoll
    params = learner.join(params)  # atoll: the run's current global weights
    opt_state = optimizer.init(params)
    for _, (x_BxF, labels_B) in zip(range(args.steps), Batches(args.index, args.batch_size)):
        params, opt_state, loss = train_step(params, opt_state, x_BxF, labels_B)
        params = learner.step(params, tokens=len(x_BxF))  # atoll: adopts synced fragments
    params = learner.finish(params)  # atoll: pushes the last steps, adopts their rounds
    model = nnx.merge(graphdef, params)  # the trained model, as an nnx.Module
    loss = float(optax.softmax_cross_entropy_with_integer_labels(model(x_test), labels_test).mean())
    print(f"{args.learner_id}: global loss at the end {loss:.4f}")


if __name__ == "__main__":
    main()
