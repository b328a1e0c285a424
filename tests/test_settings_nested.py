"""wire/settings.py beyond one field, one flag: defaults from environment variables (`env=`),
help groups, a nested config whose flags are generated with its owner's, and a pair of
flags that together give two fields (a pattern and its count)."""

from __future__ import annotations

import argparse
import dataclasses
import enum

import pytest

from atoll.wire import settings
from atoll.wire.settings import nested, setting


class Mode(enum.Enum):
    FAST = 1
    SAFE = 2


@dataclasses.dataclass(frozen=True)
class Peer:
    host: str | None = setting(None, "HOST:PORT of the peer", env="T_PEER_HOST")
    count: int | None = setting(None, "peers, >= 2", env="T_PEER_COUNT")

    def __post_init__(self) -> None:
        if (self.host is None) != (self.count is None):
            raise ValueError("--host and --count go together")
        if self.count is not None and self.count < 2:
            raise ValueError(f"--count must be >= 2, got {self.count}")


@dataclasses.dataclass(frozen=True)
class Targets:
    """--targets (a list, or a pattern with {i}) and --num-targets, giving two fields."""

    targets: str | None = setting(None, "a,b or a pattern such as t{i}")
    num_targets: int | None = setting(None, "targets, when --targets is a pattern")

    def __post_init__(self) -> None:
        self.names()

    def names(self) -> tuple[str, ...]:
        if self.targets is None:
            return ()
        if "{i}" in self.targets:
            if self.num_targets is None:
                raise ValueError(f"--targets {self.targets!r} is a pattern: give --num-targets")
            return tuple(self.targets.replace("{i}", str(i)) for i in range(self.num_targets))
        return tuple(self.targets.split(","))

    def fields(self) -> dict[str, object]:
        pattern = self.targets if self.targets and "{i}" in self.targets else None
        return {"names": self.names(), "pattern": pattern}

    @staticmethod
    def of(owner: Owner) -> Targets:
        if owner.pattern is not None:
            return Targets(owner.pattern, len(owner.names))
        return Targets(",".join(owner.names) or None)


@dataclasses.dataclass(frozen=True)
class Owner:
    names: tuple[str, ...] = dataclasses.field(
        default=(), metadata=nested(Targets, into=Targets.fields, out_of=Targets.of)
    )
    pattern: str | None = None  # given by --targets with --num-targets
    rounds: int = setting(3, "rounds, >= 1", env="T_ROUNDS", group="run")
    mode: Mode = setting(Mode.FAST, "how", env="T_MODE", group="run")
    # no flag of its own given: None, as a one-process learner's DistributedConfig is
    peer: Peer | None = dataclasses.field(
        default=None,
        metadata=nested(Peer, title="peers", into=lambda p: {"peer": None if p == Peer() else p}),
    )

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")


def _parse(args: list[str], env: dict[str, str] | None = None) -> Owner:
    parser = argparse.ArgumentParser(prog="owner")
    settings.add_flags(parser, Owner, environ=env or {})
    return settings.from_args(Owner, parser.parse_args(args))


def test_a_nested_config_is_built_from_its_own_flags_and_checks():
    assert _parse([]).peer is None
    assert _parse(["--host", "h:1", "--count", "3"]).peer == Peer("h:1", 3)
    with pytest.raises(ValueError, match="--count must be >= 2, got 1"):
        _parse(["--host", "h:1", "--count", "1"])
    with pytest.raises(ValueError, match="go together"):
        _parse(["--host", "h:1"])


def test_a_nested_config_comes_back_through_to_args():
    cfg = Owner(peer=Peer("h:1", 4), rounds=5, mode=Mode.SAFE)
    args = settings.to_args(cfg)
    assert args == ["--rounds", "5", "--mode", "safe", "--host", "h:1", "--count", "4"]
    assert _parse(args) == cfg
    assert settings.to_args(Owner()) == [], "a nested config at its defaults says nothing"


def test_an_environment_variable_gives_the_default_and_a_flag_wins():
    env = {"T_ROUNDS": "7", "T_MODE": "safe", "T_PEER_HOST": "e:2", "T_PEER_COUNT": "2"}
    got = _parse([], env)
    assert (got.rounds, got.mode, got.peer) == (7, Mode.SAFE, Peer("e:2", 2))
    got = _parse(["--rounds", "9", "--mode", "fast"], env)
    assert (got.rounds, got.mode) == (9, Mode.FAST)
    assert _parse([], {"T_ROUNDS": "  "}).rounds == 3, "an empty variable is unset"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"T_ROUNDS": "many"}, "argument --rounds: environment variable T_ROUNDS='many': not a"),
        ({"T_MODE": "slow"}, "argument --mode: environment variable T_MODE='slow': want one of"),
    ],
)
def test_a_bad_environment_value_is_a_one_line_argparse_error(env, message, capsys):
    with pytest.raises(SystemExit) as exit:
        _parse([], env)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("owner: error: argument")


def test_a_bad_environment_value_is_not_read_when_its_flag_is_given():
    assert _parse(["--rounds", "2"], {"T_ROUNDS": "many"}).rounds == 2


def test_a_pair_of_flags_gives_two_fields_and_is_checked_together():
    got = _parse(["--targets", "t{i}", "--num-targets", "3"])
    assert (got.names, got.pattern) == (("t0", "t1", "t2"), "t{i}")
    listed = _parse(["--targets", "a,b"])
    assert (listed.names, listed.pattern) == (("a", "b"), None)
    with pytest.raises(ValueError, match="is a pattern: give --num-targets"):
        _parse(["--targets", "t{i}"])
    args = settings.to_args(got)
    assert args[:4] == ["--targets", "t{i}", "--num-targets", "3"]
    assert _parse(args) == got


def test_help_groups_titles_and_variables():
    parser = argparse.ArgumentParser()
    settings.add_flags(parser, Owner, environ={})
    titles = [g.title for g in parser._action_groups]
    assert titles[-2:] == ["run", "peers"]
    text = " ".join(parser.format_help().split())
    assert "rounds, >= 1 (env T_ROUNDS) (default 3)" in text
    assert "HOST:PORT of the peer (env T_PEER_HOST)" in text
    assert "--targets TARGETS" in text and "--num-targets NUM_TARGETS" in text


def test_a_switch_cannot_default_from_the_environment():
    @dataclasses.dataclass
    class Bad:
        on: bool = setting(False, "no", env="T_ON")

    with pytest.raises(TypeError, match="cannot default from T_ON"):
        settings.add_flags(argparse.ArgumentParser(), Bad, environ={})
