"""The trained model comes out (docs/design.md §4): `atoll export` against real `atoll
syncer` processes writes one version of every fragment, bit for bit what the shards
serve, as an Orbax checkpoint that loads back and that `atoll sample` runs; shards with
no model, a fragment no given shard owns and a shard that does not answer are readable
errors that write nothing; `atoll up` leaves its final model in its run directory."""

from __future__ import annotations

import json

import numpy as np
import orbax.checkpoint as ocp
import pytest
from syncer_helpers import client_push, free_port, run_atoll, syncer_processes

import atoll
from atoll import model_dir
from atoll.faults.chaos import lockstep_config
from atoll.learner.trainer.model import PRESETS, init_params
from atoll.local.config import UpConfig
from atoll.wire import codec
from atoll.wire.client import ShardClient
from atoll.wire.plan import FragmentPlan, named_leaves

# two shards as `atoll up` starts them for two lockstep learners: a round closes when both
# have pushed, and one learner's push alone leaves it open (leases of 1e9 s never lapse)
CFG = lockstep_config(UpConfig(preset="tiny", shards=2, learners=2, fragments=4))
PARAMS = init_params(PRESETS["tiny"], CFG.seed)
PLAN = FragmentPlan.build(PARAMS, CFG.fragments)


@pytest.fixture
def shards(tmp_path):
    """The two shards' addresses, in index order."""
    with syncer_processes(tmp_path) as start:
        procs = [
            start(tmp_path / f"shard{i}", *CFG.shard_config(i, tmp_path / f"shard{i}", 0).to_args())
            for i in range(CFG.shards)
        ]
        yield [f"127.0.0.1:{s.port}" for s in procs]


def _seed(addresses: list[str]) -> None:
    """A learner's first Init of every fragment, on shard p mod 2."""
    clients = [ShardClient(a, "learner-0") for a in addresses]
    try:
        for p, vector in enumerate(PLAN.flatten(PARAMS)):
            frame = codec.encode(vector, codec.Codec.FP32)
            clients[p % 2].init(PLAN, p, frame, codec.Codec.FP32)
    finally:
        for c in clients:
            c.close()


def _push(client: ShardClient, p: int, seq: int, base: int) -> None:
    assert client_push(client, p, seq, base, PLAN).accepted


def _served(addresses: list[str]) -> tuple[dict[int, int], list[np.ndarray]]:
    """What the shards publish now: each fragment's version and FP32 snapshot."""
    clients = [ShardClient(a, "") for a in addresses]
    try:
        pulled = [clients[p % 2].pull(p) for p in range(PLAN.num_fragments)]
    finally:
        for c in clients:
            c.close()
    vectors = [
        codec.decode(x.frames[0][2], num_values=PLAN.fragment_sizes[x.fragment]) for x in pulled
    ]
    return {x.fragment: x.version for x in pulled}, vectors


def _bits(tree) -> dict[str, bytes]:
    return {n: np.asarray(a, np.float32).tobytes() for n, a in named_leaves(tree).items()}


def test_export_writes_what_the_shards_serve_and_sample_runs_it(shards, tmp_path):
    _seed(shards)
    a, b = ([ShardClient(addr, name) for addr in shards] for name in ("learner-0", "learner-1"))
    try:
        versions = dict.fromkeys(range(4), 0)
        # both learners push every fragment, then fragment 0 twice more: those rounds close
        for seq, p in enumerate((0, 1, 2, 3, 0, 0), start=1):
            _push(a[p % 2], p, seq, versions[p])
            _push(b[p % 2], p, seq, versions[p])
            versions[p] += 1
        # then learner-0 alone pushes fragment 2: its round waits for learner-1
        _push(a[0], 2, 7, versions[2])
    finally:
        for c in a + b:
            c.close()

    out = tmp_path / "model"
    result = run_atoll("export", "--shards", ",".join(shards), "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert {f["fragment"]: f["version"] for f in record["fragments"]} == {0: 3, 1: 1, 2: 1, 3: 1}
    assert [f["round_open"] for f in record["fragments"]] == [False, False, True, False]
    assert [f["shard"] for f in record["fragments"]] == [0, 1, 0, 1]
    assert "fragment 2 was read with its round open" in result.stderr
    assert record["preset"] == "tiny" and record["plan_fingerprint"] == PLAN.fingerprint
    assert json.loads((out / "export.json").read_text()) == {
        k: v for k, v in record.items() if k != "out"
    }

    # bit for bit the shards' published weights at the versions named
    served_versions, vectors = _served(shards)
    assert served_versions == versions
    loaded = model_dir.load(out)
    assert loaded.plan == PLAN and _bits(loaded.params) == _bits(PLAN.unflatten(vectors))
    with ocp.StandardCheckpointer() as checkpointer:  # what a user's JAX code does
        assert _bits(checkpointer.restore((out / "params").resolve())) == _bits(loaded.params)
    # ... or with atoll, into a template of the model (a fresh init), in one call
    assert _bits(atoll.load_export(out, like=PARAMS)) == _bits(loaded.params)
    assert _bits(loaded.params) != _bits(PARAMS)  # the pushes are in it

    sample = run_atoll("sample", "--model", str(out), "--prompt", "def ", "--tokens", "16")
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("def ") and len(sample.stdout.encode()) > len("def \n")


def test_what_cannot_be_exported_is_a_readable_error_that_writes_nothing(shards, tmp_path):
    out = tmp_path / "model"

    def export(*flags: str):
        result = run_atoll("export", "--out", str(out), *flags)
        assert not out.exists() and not list(tmp_path.glob(".model.*")), "half-written"
        return result.returncode, result.stderr

    # shards no learner has joined: there is no model yet
    code, err = export("--shards", ",".join(shards))
    assert code == 2 and "no shard holds a fragment plan yet" in err, err

    _seed(shards)
    # shard 1 left out: the fragments the map puts on it have no owner among those given
    code, err = export("--shards", shards[0])
    assert code == 2 and "beyond the 1 given: 1 on shard 1, 3 on shard 1" in err, err

    # a shard that does not answer (nothing listens there): exit 1, rerun when it is up
    dead = f"127.0.0.1:{free_port()}"
    code, err = export("--shards", f"{shards[0]},{dead}", "--deadline", "2")
    assert code == 1 and f"shard {dead} did not answer: DEADLINE_EXCEEDED" in err, err


@pytest.mark.e2e
def test_up_leaves_its_final_model_in_the_run_directory(tmp_path):
    run = tmp_path / "run"
    result = run_atoll(
        *("up", "--new-run-dir", str(run), "--preset", "tiny", "--shards", "1"),
        *("--learners", "1", "--steps", "16", "--period", "4", "--evals", "1", "--no-table"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((run / "report.json").read_text())
    assert report["global"]["model"] == str(run / "model")
    assert f"model:  {run / 'model'}" in result.stdout
    loaded = model_dir.load(run / "model")
    assert loaded.preset == "tiny"
    assert {f["fragment"]: f["version"] for f in loaded.record["fragments"]} == {
        int(p): v for p, v in report["global"]["versions"].items()
    }
    sample = run_atoll("sample", "--model", str(run / "model"), "--prompt", "import ")
    assert sample.returncode == 0 and sample.stdout.startswith("import "), sample.stderr
