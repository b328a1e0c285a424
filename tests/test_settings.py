"""wire/settings.py: flags generated from a config dataclass's fields, and the config built
back from them, its own checks running; `to_args` is the inverse of `from_args`."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import pathlib

import pytest

from atoll.wire import settings
from atoll.wire.settings import setting


class Colour(enum.Enum):
    RED = 1
    BLUE = 2


def _pair(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


@dataclasses.dataclass(frozen=True)
class Example:
    name: str = dataclasses.field(metadata=settings.flag("a name, required"))
    count: int = setting(3, "how many, >= 1")
    rate: float = setting(0.5, "a rate in 100 % units")
    path: pathlib.Path | None = setting(None, "a file")
    colour: Colour = setting(Colour.RED, "a colour")
    on: bool = setting(True, "switch it off")
    loud: bool = setting(False, "switch it on")
    marks: tuple[int, ...] = setting((), "repeatable", name="mark")
    pair: tuple[float, ...] = setting(
        (), "comma-separated", parse=_pair, render=lambda v: ",".join(map(str, v))
    )
    hidden: int = 7  # no flag

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"--count must be at least 1, got {self.count}")


def _parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="example", exit_on_error=False)
    settings.add_flags(p, Example, **kw)
    return p


def test_defaults_come_from_the_fields():
    a = _parser().parse_args([])
    assert (a.count, a.rate, a.path, a.colour, a.on, a.loud, a.marks) == (
        3, 0.5, None, "red", True, False, None,
    )  # fmt: skip
    assert not hasattr(a, "hidden")
    assert settings.from_args(Example, a, name="x") == Example("x")


def test_flags_give_every_kind_of_field():
    a = _parser().parse_args(
        ["--name", "n", "--count", "2", "--path", "/p", "--colour", "blue", "--no-on",
         "--loud", "--mark", "4", "--mark", "5", "--pair", "1,2"]
    )  # fmt: skip
    got = settings.from_args(Example, a)
    assert got == Example(
        "n", 2, 0.5, pathlib.Path("/p"), Colour.BLUE, False, True, (4, 5), (1.0, 2.0)
    )


def test_to_args_gives_the_config_back_and_leaves_defaults_out():
    cfg = Example("n", 2, 0.25, pathlib.Path("/p"), Colour.BLUE, False, True, (4, 5), (1.0, 2.0))
    args = settings.to_args(cfg)
    assert settings.from_args(Example, _parser().parse_args(args)) == cfg
    assert settings.to_args(Example("n")) == ["--name", "n"]
    every = settings.to_args(Example("n"), every=True)
    assert every == ["--name", "n", "--count", "3", "--rate", "0.5", "--colour", "red"]
    assert settings.from_args(Example, _parser().parse_args(every)) == Example("n")


def test_the_dataclass_check_runs_and_a_missing_field_names_its_flag():
    with pytest.raises(ValueError, match="--count must be at least 1, got 0"):
        settings.from_args(Example, _parser().parse_args(["--name", "n", "--count", "0"]))
    with pytest.raises(ValueError, match="--name is required"):
        settings.from_args(Example, _parser().parse_args([]))


def test_absent_flags_are_none_so_a_caller_sees_which_were_given():
    a = _parser(absent=True).parse_args(["--count", "5", "--no-on"])
    assert settings.given(Example, a) == {"count": 5, "on": False}


def test_help_shows_each_default_once_and_escapes_percent():
    text = _parser().format_help()
    assert "how many, >= 1 (default 3)" in text
    assert "100 % units (default 0.5)" in " ".join(text.split())
    assert "{red,blue}" in text and "(default red)" in text
    assert "--no-on" in text and "--loud" in text and "--hidden" not in text


def test_a_field_type_no_flag_can_give_is_refused():
    @dataclasses.dataclass
    class Bad:
        x: frozenset[int] = setting(frozenset(), "no")

    with pytest.raises(TypeError, match="cannot give"):
        settings.add_flags(argparse.ArgumentParser(), Bad)


def test_the_commands_take_their_flags_from_the_configs():
    """`atoll up`'s flags are None until given (a resume keeps the rest), `atoll chaos`
    runs UpConfig at its own defaults, `atoll plan`'s defaults are PlanConfig's."""
    from atoll import cli
    from atoll.commands import subparser
    from atoll.faults.chaos import CHAOS_RUN, chaos_up_config
    from atoll.local.config import UpConfig
    from atoll.plan import PlanConfig

    up = subparser(cli.parser(), "up")
    assert settings.given(UpConfig, up.parse_args([])) == {}
    given = settings.given(UpConfig, up.parse_args(["--quorum", "3", "--same-steps"]))
    assert given == {"quorum": 3, "same_time": False}
    assert UpConfig().quorum == 2  # min(2, M), resolved where M is known
    chaos = subparser(cli.parser(), "chaos")
    run = chaos_up_config(chaos.parse_args([]))
    assert {k: getattr(run, k) for k in CHAOS_RUN} == CHAOS_RUN and run.quorum == 2
    assert chaos_up_config(chaos.parse_args(["--quorum", "4"])).quorum == 4
    plan = subparser(cli.parser(), "plan")
    assert settings.from_args(PlanConfig, plan.parse_args([])) == PlanConfig()
