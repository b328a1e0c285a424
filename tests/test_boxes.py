"""learner/boxes.py: what one process holds and sends of each fragment, on 2 CPU devices
(run in a child process: the device count is fixed when JAX starts)."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from atoll.learner.boxes import process_boxes
from atoll.learner.pytree import TreeLayout
mesh = Mesh(np.array(jax.devices()), ("x",))
rows, cols, whole = (NamedSharding(mesh, s) for s in (P("x"), P(None, "x"), P()))
tree = {
    "a": jax.device_put(jnp.arange(8.0).reshape(4, 2), rows),
    "b": jax.device_put(jnp.arange(6.0), whole),
    "c": jax.device_put(jnp.arange(12.0).reshape(2, 6), cols),
}
layout = TreeLayout(tree, 1)
leaves = layout.leaves(tree)
boxes = process_boxes(leaves, layout.slots)
frag = boxes.fragments[0]
# a split leaf: one box per distinct shard; a replicated one: one box, sent once
by_leaf = {}
for b in frag.boxes:
    by_leaf.setdefault(layout.names[b.leaf], []).append(b.bounds)
assert by_leaf == {
    "a": [((0, 2), (0, 2)), ((2, 4), (0, 2))],
    "b": [((0, 6),)],
    "c": [((0, 2), (0, 3)), ((0, 2), (3, 6))],
}, by_leaf
assert all(b.sent for b in frag.boxes) and frag.size == frag.sent_size == 8 + 6 + 12
# the local vector, from the devices and from the whole fragment alike
full = layout.read(leaves, 0)
local = frag.read(leaves)
np.testing.assert_array_equal(local, boxes.take(0, full))
wire = frag.wire_boxes()
assert [(w.tensor, list(w.start), list(w.stop)) for w in wire][-1][1:] == ([0, 3], [2, 6])
# written back: each leaf on its own sharding, the values moved by +1
out = dict(zip(["a", "b", "c"], boxes.write(leaves, {0: local + 1})))
for name, sharding in (("a", rows), ("b", whole), ("c", cols)):
    assert out[name].sharding == sharding, (name, out[name].sharding)
    np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(tree[name]) + 1)
print("ok")
"""


def test_a_process_holds_sends_and_writes_back_its_boxes():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", CODE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert out.stdout.strip() == "ok", out.stderr
