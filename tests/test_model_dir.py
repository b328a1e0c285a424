"""An exported model's directory (atoll.model_dir): written whole or not at all, never
into a directory that holds anything, and loaded back bit for bit, by atoll and by plain
Orbax; a built-in preset is recognised by its tensors."""

from __future__ import annotations

import json

import numpy as np
import orbax.checkpoint as ocp
import pytest

from atoll import model_dir
from atoll.learner.trainer.model import PRESETS, init_params
from atoll.wire.plan import FragmentPlan, named_leaves

READ = {"map_version": 0, "waited_seconds": 0.0, "fragments": []}


def _tiny():
    params = init_params(PRESETS["tiny"], 3)
    return params, FragmentPlan.build(params, 4)


def _bits(tree) -> dict[str, bytes]:
    return {n: np.asarray(a, np.float32).tobytes() for n, a in named_leaves(tree).items()}


def test_an_export_loads_back_bit_for_bit_with_its_plan_and_config(tmp_path):
    params, plan = _tiny()
    record = model_dir.write(tmp_path / "m", params, plan, READ, "tiny")
    assert record["preset"] == "tiny" and record["model"]["d_model"] == 32
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "export.json",
        "params",
        "plan.json",
    ]
    loaded = model_dir.load(tmp_path / "m")
    assert _bits(loaded.params) == _bits(params)
    assert loaded.plan == plan and loaded.preset == "tiny"
    assert loaded.model_config() == PRESETS["tiny"]
    assert json.loads((tmp_path / "m" / "export.json").read_text()) == record
    # a user's own JAX code needs only Orbax
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore((tmp_path / "m" / "params").resolve())
    assert _bits(restored) == _bits(params)


def test_a_model_that_is_no_preset_is_recorded_as_none():
    custom = {"layer": {"w": np.ones((3, 5), np.float32)}, "bias": np.zeros(5, np.float32)}
    assert model_dir.recognise_preset(FragmentPlan.build(custom, 2)) is None
    assert model_dir.recognise_preset(_tiny()[1]) == "tiny"
    # whatever P the run used: the preset's plan is built with the plan's P to compare
    assert model_dir.recognise_preset(FragmentPlan.build(_tiny()[0], 3)) == "tiny"


def test_the_target_must_be_new_or_empty_in_a_directory_that_exists(tmp_path):
    params, plan = _tiny()
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("mine")
    for target, says in (
        (tmp_path / "file", "not a directory"),
        (tmp_path / "full", "not empty"),
        (tmp_path / "no" / "m", "no directory"),
    ):
        with pytest.raises(model_dir.ModelDirError, match=says):
            model_dir.write(target, params, plan, READ)
    assert (tmp_path / "full" / "keep").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]  # no leftovers
    (tmp_path / "empty").mkdir()
    model_dir.write(tmp_path / "empty", params, plan, READ)
    assert model_dir.load(tmp_path / "empty").preset is None


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    params, plan = _tiny()

    def half_then_fail(path, tree):
        path.mkdir()
        (path / "partial").write_bytes(b"\0" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_dir, "_save_params", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        model_dir.write(tmp_path / "m", params, plan, READ, "tiny")
    assert list(tmp_path.iterdir()) == []


def test_replace_swaps_a_previous_export_and_nothing_else(tmp_path):
    params, plan = _tiny()
    model_dir.write(tmp_path / "m", params, plan, READ, "tiny")
    newer = {**params, "head": {"w": params["head"]["w"] + 1}}
    model_dir.write(tmp_path / "m", newer, plan, {**READ, "map_version": 7}, "tiny", replace=True)
    loaded = model_dir.load(tmp_path / "m")
    assert _bits(loaded.params) == _bits(newer) and loaded.record["map_version"] == 7
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # the old one is gone, no temporaries
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(model_dir.ModelDirError, match="not empty"):
        model_dir.write(tmp_path / "other", params, plan, READ, replace=True)


def test_loading_a_directory_without_an_export_says_where_to_look(tmp_path):
    with pytest.raises(model_dir.ModelDirError, match="no such directory"):
        model_dir.load(tmp_path / "absent")
    with pytest.raises(model_dir.ModelDirError, match="give a directory `atoll export --out`"):
        model_dir.load(tmp_path)
    params, plan = _tiny()
    model_dir.write(tmp_path / "model", params, plan, READ, "tiny")  # a run directory's
    with pytest.raises(model_dir.ModelDirError, match="the run's model is in .*model"):
        model_dir.load(tmp_path)


def test_an_export_whose_plan_was_edited_is_refused(tmp_path):
    params, plan = _tiny()
    model_dir.write(tmp_path / "m", params, plan, READ, "tiny")
    other = FragmentPlan.build(params, 2)
    (tmp_path / "m" / "plan.json").write_text(other.to_json())
    with pytest.raises(model_dir.ModelDirError, match="plan"):
        model_dir.load(tmp_path / "m")
