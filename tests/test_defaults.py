"""One source of defaults: the outer optimiser the shard, `atoll up`, `atoll bench quality`
and the Kubernetes ConfigMap use is the paper's (lr 0.7, Nesterov momentum 0.9); the
learner's settings (H, τ, α, P, codec, ...) are learner/config.py's wherever a learner is
made: `atoll learner`, SyncConfig, atoll.Learner and `atoll up`."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import pathlib
import re

import pytest
import yaml

from atoll import Learner, cli
from atoll.commands import subparser
from atoll.learner import config as home
from atoll.learner.config import Checkpointing, LearnerConfig
from atoll.learner.sync import SyncConfig
from atoll.learner.trainer import main as learner_main
from atoll.local.config import UpConfig, learner_specs
from atoll.server import main as syncer_main
from atoll.server.config import (
    GRACE_FACTOR,
    OUTER_LR,
    OUTER_MOMENTUM,
    OUTER_MOMENTUM_DELAY,
    ShardConfig,
)
from atoll.server.merge import outer_optimizer

REPO = pathlib.Path(__file__).resolve().parents[1]


def _configmap(path: pathlib.Path, name: str) -> dict[str, str]:
    doc = yaml.safe_load(path.read_text())
    [generator] = [g for g in doc["configMapGenerator"] if g["name"] == name]
    return dict(re.match(r"([^=]+)=(\S+)", line).groups() for line in generator["literals"])


def test_the_outer_optimiser_defaults_agree_everywhere():
    assert (OUTER_LR, OUTER_MOMENTUM) == (0.7, 0.9)  # DiLoCo's outer Nesterov
    fields = {f.name: f.default for f in ShardConfig.__dataclass_fields__.values()}
    assert (fields["outer_lr"], fields["outer_momentum"]) == (OUTER_LR, OUTER_MOMENTUM)
    assert (UpConfig().outer_lr, UpConfig().outer_momentum) == (OUTER_LR, OUTER_MOMENTUM)
    quality = subparser(cli.parser(), "bench", "quality").parse_args([])
    assert (quality.outer_lr, quality.outer_momentum) == (OUTER_LR, OUTER_MOMENTUM)
    syncer = argparse.ArgumentParser()
    syncer_main.add_arguments(syncer)
    flags = vars(syncer.parse_known_args([])[0])
    assert (flags["outer_lr"], flags["outer_momentum"]) == (OUTER_LR, OUTER_MOMENTUM)
    config = _configmap(REPO / "k8s/base/syncer/kustomization.yaml", "atoll-syncer-config")
    assert (float(config["ATOLL_OUTER_LR"]), float(config["ATOLL_OUTER_MOMENTUM"])) == (
        OUTER_LR,
        OUTER_MOMENTUM,
    )
    assert (
        int(config["ATOLL_OUTER_MOMENTUM_DELAY"])
        == OUTER_MOMENTUM_DELAY
        == fields["momentum_delay"]
        == UpConfig().momentum_delay
        == flags["momentum_delay"]
        == quality.momentum_delay
    )
    assert (
        float(config["ATOLL_GRACE_FACTOR"])
        == GRACE_FACTOR
        == UpConfig().grace_factor
        == fields["grace_factor"]
    )
    # and the optimiser itself takes them when called bare
    assert outer_optimizer.__defaults__ == (OUTER_LR, OUTER_MOMENTUM, OUTER_MOMENTUM_DELAY)


# the learner settings several entry points default: LearnerConfig field -> its home
LEARNER_DEFAULTS = {
    "preset": home.PRESET,
    "batch_size": home.BATCH_SIZE,
    "steps": home.STEPS,
    "period": home.PERIOD,
    "overlap": home.OVERLAP,
    "mix": home.MIX,
    "late_mix": home.LATE_MIX,
    "fragments": home.FRAGMENTS,
    "codec": home.CODEC,
    "seed": home.SEED,
    "eval_batches": home.EVAL_BATCHES,
    "sync_patience": home.SYNC_PATIENCE,
    "checkpoint_every": home.CHECKPOINT_EVERY,
    "deadline": home.DEADLINE,
}
# atoll.Learner's arguments and SyncConfig's fields named otherwise than LearnerConfig's
RENAMED = {"patience": "sync_patience", "index": "learner_index"}


@pytest.fixture
def clean_env(monkeypatch):
    """No ATOLL_* or TPU variables: the flags' defaults are then the config's alone."""
    for name in list(os.environ):
        if name.startswith(("ATOLL_", "TPU_")):
            monkeypatch.delenv(name)


def test_the_learner_defaults_have_one_home():
    assert (home.PERIOD, home.OVERLAP, home.FRAGMENTS, home.CODEC.name) == (32, 1, 4, "INT4"), (
        "README and docs/rounds.md give figures at these settings: change them together"
    )
    fields = {f.name: f.default for f in dataclasses.fields(LearnerConfig)}
    # the sync settings are SyncConfig's, which LearnerConfig holds (its `sync`)
    fields |= {RENAMED.get(f.name, f.name): f.default for f in dataclasses.fields(SyncConfig)}
    assert {k: fields[k] for k in LEARNER_DEFAULTS} == LEARNER_DEFAULTS


def test_atoll_learner_flags_default_to_learner_config(clean_env):
    parser = argparse.ArgumentParser()
    learner_main.add_arguments(parser)
    given = learner_main.config_from_args(
        parser.parse_args(["--shards", "a:1", "--learner-id", "x"])
    )
    assert given == LearnerConfig(shards=("a:1",), learner_id="x"), "every flag's default"


def test_the_synchronizer_and_the_library_default_as_atoll_learner_does():
    # `atoll learner`'s sync settings are a SyncConfig's: declared there alone
    fields = {f.name: f for f in dataclasses.fields(LearnerConfig)}
    assert (
        fields["sync"].default_factory is SyncConfig
        and LearnerConfig(baseline=True).sync == SyncConfig()
    )
    sync_names = {RENAMED.get(f.name, f.name) for f in dataclasses.fields(SyncConfig)}
    assert not sync_names & set(fields), "a sync setting declared twice"
    fields = {f.name: f.default for f in dataclasses.fields(LearnerConfig)}
    ckpt = {f"checkpoint_{f.name}": f.default for f in dataclasses.fields(Checkpointing)}
    assert ckpt["checkpoint_every"] == fields["checkpoint_every"]
    assert fields["standby"] is ckpt["checkpoint_standby"] is False
    api = {
        RENAMED.get(name, name): p.default
        for name, p in inspect.signature(Learner.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    shared = set(api) & set(fields) - {"sync"}  # None: SyncConfig's defaults, as above
    assert shared >= {"fragments", "num_learners", "learner_index"}
    assert {k: api[k] for k in shared} == {k: fields[k] for k in shared}
    # the rest are the config objects', not re-defaulted by the Learner
    assert api["sync"] is None and api["checkpoint"] is None


def test_atoll_up_runs_learners_at_the_learner_defaults():
    up = UpConfig()
    on_up = {k: getattr(up, k) for k in LEARNER_DEFAULTS if hasattr(up, k)}
    assert on_up == {k: LEARNER_DEFAULTS[k] for k in on_up} | {"codec": home.CODEC.name.lower()}
    # and what each learner it starts is given (batch and steps per learner: its spec's)
    spec = learner_specs(up)[0]
    learner = up.learner_config(spec, ["127.0.0.1:1", "127.0.0.1:2"])
    assert learner == dataclasses.replace(
        LearnerConfig(shards=learner.shards, learner_id=spec.name),
        num_learners=up.learners,
        eval_every=spec.eval_every,
    )
    assert UpConfig().max_staleness == ShardConfig.max_staleness


# The built-in benches keep budgets of their own, where a test of the learner's defaults
# would not show what they measure; each is stated where the bench sets it:
BENCH_BUDGETS = {
    # README "bench quality" and docs/rounds.md: the frontier at H = 32 and 64, 4,000 steps
    ("bench", "quality"): {"periods": (32, 64), "steps": 4000, "preset": "tiny"},
    # atoll/faults/chaos.py: at H = 32 round overhead, not failures, decides goodput
    # (and its --seed is the failure schedule's, not the learners')
    ("chaos",): {"period": 64, "steps": 20000, "preset": "tiny", "seed": None},
}


@pytest.mark.parametrize("command", list(BENCH_BUDGETS))
def test_the_benches_differ_from_the_learner_defaults_only_in_their_budgets(command):
    flags = vars(subparser(cli.parser(), *command).parse_args([]))
    budget = BENCH_BUDGETS[command]
    assert {k: flags[k] for k in budget} == budget
    shared = set(flags) & set(LEARNER_DEFAULTS) - set(budget)
    assert shared >= {"overlap", "fragments", "batch_size"}
    assert {k: flags[k] for k in shared} == {k: LEARNER_DEFAULTS[k] for k in shared}


def test_the_kubernetes_learners_agree_on_the_run_settings_they_do_not_set_for_themselves():
    config = _configmap(REPO / "k8s/base/learner/kustomization.yaml", "atoll-learner-config")
    # H, steps and the checkpoint interval are the example deployment's own settings
    assert int(config["ATOLL_OVERLAP"]) == home.OVERLAP
    assert int(config["ATOLL_FRAGMENTS"]) == home.FRAGMENTS
    assert config["ATOLL_CODEC"] == home.CODEC.name.lower()
    assert config["ATOLL_PRESET"] == home.PRESET
    assert int(config["ATOLL_BATCH_SIZE"]) == home.BATCH_SIZE
