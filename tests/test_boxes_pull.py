"""learner/boxes.py with wire/parts.py: the boxes a process of a sharded learner pulls
name its local vector's values in its order, so a pull by them rebuilds that vector (on
2 CPU devices, in a child process: the device count is fixed when JAX starts)."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from atoll.learner.boxes import process_boxes
from atoll.learner.pytree import TreeLayout
from atoll.wire.parts import BoxLayout
mesh = Mesh(np.array(jax.devices()), ("x",))
rows, cols, whole = (NamedSharding(mesh, s) for s in (P("x"), P(None, "x"), P()))
tree = {
    "a": jax.device_put(jnp.arange(40.0).reshape(10, 4), rows),
    "b": jax.device_put(jnp.arange(6.0) + 100, whole),
    "c": jax.device_put(jnp.arange(36.0).reshape(3, 12) + 200, cols),
    "s": jax.device_put(jnp.asarray(7.0), whole),
}
layout = TreeLayout(tree, 2)
leaves = layout.leaves(tree)
boxes = process_boxes(leaves, layout.slots)
seen = 0
for p, frag in enumerate(boxes.fragments):
    full = layout.read(leaves, p)
    shapes = [s.spec.shape for s in layout.plan.tensors_of(p)]
    held = frag.wire_boxes(held=True)
    assert len(held) == len(frag.boxes) and len(frag.wire_boxes()) == len(frag.sent_boxes)
    lay = BoxLayout.of(shapes, held)
    assert lay.size == frag.size and lay.fragment_size == full.size
    # a pull by these boxes gives full[lay.index()]: the local vector, value for value
    np.testing.assert_array_equal(full[lay.index()], frag.read(leaves))
    np.testing.assert_array_equal(full[lay.index()], boxes.take(p, full))
    seen += frag.size
assert seen == 40 + 6 + 36 + 1, seen  # one process holds every box of every leaf here
print("ok")
"""


def test_the_boxes_a_process_pulls_name_its_local_vector_in_order():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", CODE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert out.stdout.strip() == "ok", out.stderr
