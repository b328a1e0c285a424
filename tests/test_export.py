"""`atoll export`'s flags: what cannot work is refused (exit 2) before any shard is called
and before anything is written (the reads themselves: tests/integration/test_export.py)."""

from __future__ import annotations

import numpy as np
import pytest

from atoll.cli import main as atoll
from atoll.export import GlobalModel
from atoll.wire.plan import FragmentMap, FragmentPlan


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--shards", "nowhere"], "is not HOST:PORT"),
        (["--shards", "a-{i}:7070,b:7070"], "a pattern is one address with {i}"),
        (["--shards", "a:1", "--wait", "-1"], "--wait must be >= 0"),
        (["--shards", "a:1", "--deadline", "0"], "--deadline must be > 0"),
        (["--shards", "a:1", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    ],
)
def test_bad_flags_are_refused(tmp_path, capsys, flags, says):
    with pytest.raises(SystemExit) as e:
        atoll(["export", "--out", str(tmp_path / "m"), *flags])
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_out_that_is_taken_is_refused_and_left_alone(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as e:
        atoll(["export", "--shards", "127.0.0.1:1", "--out", str(tmp_path / "m")])
    assert e.value.code == 2 and "exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert (tmp_path / "m" / "notes.txt").read_text() == "mine"
    with pytest.raises(SystemExit) as e:
        atoll(["export", "--shards", "127.0.0.1:1", "--out", str(tmp_path / "no" / "m")])
    assert e.value.code == 2 and "no directory" in capsys.readouterr().err


def test_the_record_names_each_fragments_version_shard_and_open_round():
    tree = {"a": np.zeros(4, np.float32), "b": np.ones(6, np.float32)}
    plan = FragmentPlan.build(tree, 2)
    fmap = FragmentMap(1, (1, 0), (1, 0))
    model = GlobalModel(plan, plan.flatten(tree), {0: 5, 1: 3}, {1: 2}, fmap, 0.4)
    assert model.record() == {
        "map_version": 1,
        "waited_seconds": 0.4,
        "fragments": [
            {
                "fragment": 0,
                "version": 5,
                "shard": 1,
                "round_open": False,
                "pushes_not_in_model": 0,
            },
            {"fragment": 1, "version": 3, "shard": 0, "round_open": True, "pushes_not_in_model": 2},
        ],
    }
    assert model.params()["b"].tolist() == [1.0] * 6
