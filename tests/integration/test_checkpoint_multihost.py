"""A learner checkpoint written by 2 JAX CPU processes x 2 devices (gloo collectives), its
params FSDP-sharded over the 4 devices: each process writes only the shards it holds, and
the checkpoint reads back onto the same mesh and onto one process with replicated params,
value for value (learner/checkpoint.py, guarantee 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from syncer_helpers import REPO, free_port

# Both processes (and the reader) build the same values: row r of every leaf is r + 0.5.
SCRIPT = textwrap.dedent("""
    import json, sys, types
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, index, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=index)
    import jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from atoll.learner import checkpoint

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    fsdp, replicated = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())

    def tree(fill):
        rows = np.arange(8, dtype=np.float32)[:, None] + 0.5 if fill else np.zeros((8, 1))
        put = lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i])
        return {
            "w": put(np.broadcast_to(rows, (8, 6)).astype(jnp.bfloat16), fsdp),
            "b": put(np.broadcast_to(rows, (8, 2)).astype(np.float32), fsdp),
            "count": put(np.asarray(41 if fill else 0, np.int32), replicated),
        }

    params = tree(True)
    # the sync engine runs on process 0 alone: its vectors are process 0's
    frag = types.SimpleNamespace(p=0, task=None, origin=None, base=np.full(5, 2.0, np.float32),
        ef=types.SimpleNamespace(residual=np.full(5, 0.25, np.float32)), version=3, compute=1.0)
    sync = types.SimpleNamespace(frags=[frag], seq=9) if index == 0 else None
    ck = checkpoint.Checkpointer(out, "mh", 1, {"learner_id": "mh"})
    trainer = types.SimpleNamespace(params=params, opt_state=[params["b"]], steps_done=12,
                                    tokens_total=96)
    assert ck.save(trainer, sync, None, wait=True) and ck.error is None, ck.error
    ck.close()
    # as a Learner does: process 0 alone reads the sync vectors (no barrier to join)
    got = checkpoint.read(checkpoint.path_for(out, "mh"), vectors=index == 0)
    like = jax.tree.leaves(tree(False))
    back = got.params(like)
    same = all(
        a.sharding == b.sharding and a.dtype == b.dtype and all(
            np.array_equal(np.asarray(x.data), np.asarray(y.data))
            for x, y in zip(a.addressable_shards, b.addressable_shards))
        for a, b in zip(back, jax.tree.leaves(params)))
    print(json.dumps({"index": index, "same": bool(same), "step": got.step,
                      "origins": sorted(got.origins), "seq": got.meta["seq"]}), flush=True)
""")

READER = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from atoll.learner import checkpoint

    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P())
    like = jax.tree.leaves({
        "w": jax.device_put(jnp.zeros((8, 6), jnp.bfloat16), replicated),
        "b": jax.device_put(jnp.zeros((8, 2), jnp.float32), replicated),
        "count": jax.device_put(jnp.int32(0), replicated),
    })
    got = checkpoint.read(checkpoint.path_for(sys.argv[1], "mh"))
    back = dict(zip(["b", "count", "w"], got.params(like)))
    rows = np.arange(8, dtype=np.float32)[:, None] + 0.5
    print(json.dumps({
        "w": bool(np.array_equal(np.asarray(back["w"], np.float32), np.broadcast_to(rows, (8, 6)))),
        "b": bool(np.array_equal(np.asarray(back["b"]), np.broadcast_to(rows, (8, 2)))),
        "count": int(back["count"]),
        "dtypes": [str(back[k].dtype) for k in ("w", "b", "count")],
        "replicated": all(back[k].sharding == replicated for k in back),
        "origin": np.asarray(got.origins[0]).tolist(),
        "residual": np.asarray(got.residuals[0]).tolist(),
        "state": np.asarray(got.state([like[0]])[0]).tolist() == np.broadcast_to(rows, (8, 2)).tolist(),
    }), flush=True)
""")


def _env(devices: int) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    }


@pytest.mark.timeout(120)
def test_two_processes_write_their_shards_and_it_restores_on_any_mesh(tmp_path):
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(port), str(i), str(tmp_path)],
            env=_env(2),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    # (a) the same mesh: every process gets its own shards back, bit for bit
    assert all(r["same"] and r["step"] == 12 and r["seq"] == 9 for r in results), results
    assert [r["origins"] for r in results] == [[0], []], results  # process 0's vectors

    # (b) one process with 2 devices, every leaf replicated: the same values, own dtypes
    reader = subprocess.run(
        [sys.executable, "-c", READER, str(tmp_path)],
        env=_env(2),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert reader.returncode == 0, reader.stderr[-3000:]
    got = json.loads(reader.stdout.strip().splitlines()[-1])
    assert got["w"] and got["b"] and got["count"] == 41 and got["replicated"], got
    assert got["dtypes"] == ["bfloat16", "float32", "int32"], got
    assert got["origin"] == [2.0] * 5 and got["residual"] == [0.25] * 5 and got["state"], got
