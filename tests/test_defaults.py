"""One source of defaults: the outer optimiser the shard, `atoll up`, `atoll bench quality`
and the Kubernetes ConfigMap use is the paper's (lr 0.7, Nesterov momentum 0.9)."""

from __future__ import annotations

import argparse
import pathlib
import re

import yaml

from atoll import cli
from atoll.commands import subparser
from atoll.local.config import UpConfig
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
