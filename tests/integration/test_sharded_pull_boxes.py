"""Each process of a learner sharded over 2 JAX processes x 2 CPU devices pulls only the
boxes it holds (join, adoption): about its share of the fragments' bytes, not the whole,
and still publishes, bit for bit, what one process holding the params replicated does; a
learner joining afterwards holds exactly the published values. Processes that make their
Learner with other settings each get a clear error at join."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sharded_learner_worker import SHAPES, values
from sharded_learners import FRAGMENTS, addresses, learn, published, shards

from atoll.learner.pytree import TreeLayout

pytestmark = pytest.mark.e2e  # real processes: `make test-fast` skips it

# The share of the learner's elements (w0 1024, w1 512, b 64, emb 128: 1728) each process
# holds, so pulls: its rows of the split leaves, and "b" (replicated) on both; on fsdp-tp
# "w1" is split by columns only, within each process, so both hold it whole.
SHARES = {"fsdp": (512 + 256 + 64 + 64) / 1728, "fsdp-tp": (512 + 512 + 64 + 64) / 1728}


def _leaves(weights: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The published weights as the worker's leaves (its plan: the same names and P)."""
    layout = TreeLayout(values(0, SHAPES), FRAGMENTS)
    out = {}
    for p, vector in enumerate(weights):
        for i, start, end in layout.slots[p]:
            name = layout.names[i]
            out[name] = vector[start:end].reshape(SHAPES[name])
    assert sorted(out) == sorted(SHAPES), sorted(out)
    return out


def _box(leaf: np.ndarray, bounds: str) -> np.ndarray:
    return leaf[tuple(slice(*map(int, b.split("-"))) for b in bounds.split(","))]


def test_each_process_pulls_its_boxes_and_the_weights_are_a_replicated_learners(tmp_path):
    with shards(tmp_path, "replicated", 2) as servers:
        replicated = learn(
            tmp_path, "replicated", addresses(servers), 1, ["--lockstep", "--replicated"]
        )[0]
        assert "error" not in replicated, replicated
        reference = published(addresses(servers))
    assert min(v for v, _ in replicated["versions"].values()) >= 3, replicated
    figures = {}
    for mesh, share in SHARES.items():
        with shards(tmp_path, mesh, 2) as servers:
            sharded = learn(tmp_path, mesh, addresses(servers), 2, ["--lockstep", "--mesh", mesh])
            for report in sharded:
                assert "error" not in report, (mesh, report)
                assert report["versions"] == replicated["versions"], (mesh, report, replicated)
            weights = published(addresses(servers))
            # Bit for bit (the worker's model is elementwise, its boxes whole INT4 blocks):
            # what each process adopted from its boxes fed its next pushes, so a value
            # rebuilt wrong anywhere would show here.
            for p in range(FRAGMENTS):
                assert weights[p].tobytes() == reference[p].tobytes(), (mesh, p)
            # A learner joining now pulls a snapshot of its boxes: exactly the published values.
            joiner = learn(
                tmp_path, f"{mesh}-join", addresses(servers), 2, ["--mesh", mesh, "--join-only"]
            )
        leaves = _leaves(weights)
        for i, report in enumerate(joiner):
            assert "error" not in report, (mesh, report)
            held = np.load(tmp_path / f"{mesh}-join.{i}.json.npz")
            assert len(held.files) >= 4, held.files
            for key in held.files:
                name, bounds = key.split(":")
                assert held[key].tobytes() == _box(leaves[name], bounds).tobytes(), (mesh, key)
        # Each process pulls its share of the bytes, not the whole learner's: deltas after
        # join (every round's, by boxes) and the snapshot of a join.
        pulled = [r["bytes_pulled"] / replicated["bytes_pulled"] for r in sharded]
        joined = [r["bytes_joined"] / replicated["bytes_joined"] for r in joiner]
        figures[mesh] = {"pulled": pulled, "joined": joined, "share": share}
        assert all(abs(m - share) < 0.08 for m in pulled + joined), figures
    print(json.dumps(figures))


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("codec", "has another codec than process 0"),
        ("id", "has another learner id than process 0"),
        # the same mesh shape and spec, its devices in another order: other pieces here
        ("devices", "'emb' is sharded differently"),
    ],
)
def test_processes_that_disagree_each_get_a_clear_error_at_join(tmp_path, fault, message):
    with shards(tmp_path, fault, 1) as servers:
        reports = learn(tmp_path, fault, addresses(servers), 2, ["--fault", fault])
    errors = [r.get("error", "") for r in reports]
    assert all("LearnerDisagreement" in e and message in e for e in errors), errors
