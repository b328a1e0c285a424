"""`atoll syncer` refuses bad settings as flag errors: a readable line, exit 2, no traceback."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "content,message",
    [("REPLACE-ME-with-a-real-token\n", "placeholder"), ("short\n", "32"), ("", "no tokens")],
)
def test_a_bad_token_file_is_a_flag_error_before_anything_starts(tmp_path, content, message):
    tokens = tmp_path / "tokens"
    tokens.write_text(content)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "atoll.cli",
            "syncer",
            "--data-dir",
            str(tmp_path / "data"),
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            str(tokens),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "data").exists()  # refused before the data directory was touched


def test_a_config_renders_the_flags_that_give_it_back(tmp_path):
    import argparse
    import dataclasses

    from atoll.server import main as syncer_main
    from atoll.server.config import ShardConfig
    from atoll.wire.codec import Codec

    token = tmp_path / "tokens"
    token.write_text("learner-0 " + "t" * 32 + "\n")
    configs = [
        ShardConfig(shard_index=1, num_shards=3, data_dir=tmp_path / "d"),
        ShardConfig(
            shard_index=0,
            num_shards=2,
            data_dir=tmp_path / "e",
            listen="127.0.0.1:0",
            quorum=3,
            grace_factor=0.5,
            max_staleness=2,
            staleness_discount=0.5,
            lease_seconds=7.5,
            outer_lr=1.0,
            outer_momentum=0.0,
            momentum_delay=1,
            rda=False,
            delta_ring=2,
            snapshot_every=10,
            publish_codec=Codec.FP32,
            metrics_port=0,
            health_port=0,
            token_file=token,
            quarantine_records=(3, 9),
            stream_idle_seconds=5.0,
        ),
    ]
    for cfg in configs:
        parser = argparse.ArgumentParser()
        syncer_main.add_arguments(parser)
        back = syncer_main.config_from_args(parser.parse_args(cfg.to_args()))
        assert dataclasses.asdict(back) == dataclasses.asdict(cfg), cfg.to_args()


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("quorum", 0, "--quorum=0: need an int >= 1"),
        ("grace_factor", -1.0, "--grace-factor=-1.0: need a finite number >= 0"),
        ("max_staleness", -1, "--max-staleness=-1: need an int >= 0"),
        ("staleness_discount", float("nan"), "--staleness-discount=nan: need a finite number"),
        ("lease_seconds", 0.0, "--lease-seconds=0.0: need a finite number > 0"),
    ],
)
def test_the_round_rules_settings_are_refused_in_the_flags_words(field, value, message):
    from atoll.server.config import ConfigError, ShardConfig

    fields = {"shard_index": 0, "num_shards": 1, "data_dir": pathlib.Path("/nonexistent")}
    with pytest.raises(ConfigError) as e:
        ShardConfig(**fields, **{field: value})
    assert str(e.value).startswith(message), str(e.value)
