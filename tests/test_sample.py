"""`atoll sample` (atoll.sample): a built-in preset's export continues a prompt byte by
byte; a model that is not a preset, or a directory with no export, is a readable error."""

from __future__ import annotations

import numpy as np
import pytest

from atoll import model_dir
from atoll.cli import main as atoll
from atoll.learner.trainer.model import PRESETS, forward, init_params
from atoll.sample import generate
from atoll.wire.plan import FragmentPlan

READ = {"map_version": 0, "waited_seconds": 0.0, "fragments": []}
TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    params = init_params(TINY, 5)
    out = tmp_path_factory.mktemp("export") / "model"
    model_dir.write(out, params, FragmentPlan.build(params, 4), READ, "tiny")
    return out


def test_temperature_zero_takes_the_likeliest_byte_even_past_the_context():
    params = init_params(TINY, 5)
    prompt = np.frombuffer(b"x" * (TINY.context + 7), np.uint8)  # longer than the context
    drawn = list(generate(params, TINY, prompt, 3, temperature=0))
    # the first draw: the likeliest byte after the newest `context` prompt bytes
    window = prompt[-TINY.context :].astype(np.int32)[None]
    assert drawn[0] == int(np.argmax(np.asarray(forward(params, window, TINY))[0, -1]))
    assert all(0 <= t < 256 for t in drawn)


def test_a_seed_gives_the_same_text_and_another_seed_other_text():
    params = init_params(TINY, 5)
    prompt = np.frombuffer(b"def ", np.uint8)

    def text(seed):
        return list(generate(params, TINY, prompt, 24, temperature=1.0, seed=seed))

    assert text(1) == text(1) and text(1) != text(2)


def test_sample_prints_the_prompt_and_its_continuation(tiny_export, capsys):
    assert (
        atoll(["sample", "--model", str(tiny_export), "--prompt", "héllo", "--tokens", "12"]) == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("héllo") and len(out.encode()) > len("héllo".encode())


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "a", "--temperature", "-1"], "--temperature must be >= 0"),
        (["--prompt", "a", "--tokens", "0"], "must be at least 1"),
    ],
)
def test_bad_flags_are_refused(tiny_export, capsys, flags, says):
    with pytest.raises(SystemExit) as e:
        atoll(["sample", "--model", str(tiny_export), *flags])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_a_model_that_is_not_a_preset_or_no_export_is_a_readable_error(tmp_path, capsys):
    custom = {"layer": {"w": np.ones((3, 5), np.float32)}, "bias": np.zeros(5, np.float32)}
    model_dir.write(tmp_path / "custom", custom, FragmentPlan.build(custom, 2), READ)
    with pytest.raises(SystemExit) as e:
        atoll(["sample", "--model", str(tmp_path / "custom"), "--prompt", "a"])
    assert e.value.code == 2 and "not a built-in preset" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        atoll(["sample", "--model", str(tmp_path), "--prompt", "a"])
    assert e.value.code == 2 and "holds no atoll export" in capsys.readouterr().err
