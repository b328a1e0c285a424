"""What the training thread does at a sync point, kept small (issue 40's sync pause): an
adoption adds θ_p leaf by leaf into the outcome's vector, bit for bit as a read and an
add would; a push takes a copy only of a θ_p adopted in the same call."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from atoll.learner.fragment_sync import FragmentSync
from atoll.learner.pytree import TreeLayout
from atoll.learner.sync import SyncConfig, Synchronizer
from atoll.wire.plan import FragmentPlan, TensorSpec


def test_add_to_is_a_read_and_an_add_bit_for_bit():
    rng = np.random.default_rng(0)
    tree = {
        "w": jnp.asarray(rng.standard_normal((3, 5)), jnp.float32),
        "h": jnp.asarray(rng.standard_normal(7), jnp.bfloat16),
        "step": jnp.asarray(3),
    }
    layout = TreeLayout(tree, 1)
    leaves = layout.leaves(tree)
    out = rng.standard_normal(22).astype(np.float32) * np.float32(1e-3)
    want = np.add(out, layout.read(leaves, 0))
    layout.add_to(leaves, 0, out)
    assert out.view(np.uint32).tolist() == want.view(np.uint32).tolist()


class _NoShard:
    """A shard the test never calls."""

    address = "none"

    def close(self) -> None:
        pass


class _Started(FragmentSync):
    """A fragment whose push is recorded, not run."""

    def start(self, pool, theta, step, seq, tokens_per_step, last=False):  # type: ignore[override]
        self.started = theta


def test_a_push_copies_only_a_theta_adopted_in_the_same_call():
    plan = FragmentPlan.build([TensorSpec("w", (4, 8))], 1)
    read = np.arange(32, dtype=np.float32)
    sync = Synchronizer(
        SyncConfig(period=4),
        plan,
        [_NoShard()],
        read_fragment=lambda params, p: read,
        fragment_sync=_Started,
    )
    try:
        frag = sync.frags[0]
        sync._start_push(frag, 1, None, {}, 1)
        assert frag.started is read  # read from the params: the task's own already
        adopted = np.full(32, 2.0, np.float32)
        sync._start_push(frag, 2, None, {0: adopted}, 1)
        # the caller's new leaves are built from the adopted vector: the task, which
        # writes over its θ, gets a copy of it
        assert frag.started is not adopted and not np.shares_memory(frag.started, adopted)
        np.testing.assert_array_equal(frag.started, adopted)
    finally:
        sync.close()
