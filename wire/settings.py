"""A config dataclass's command line, generated from its fields.

Each field a flag sets carries a `Flag` in its metadata (`setting(default, help)`, or
`dataclasses.field(metadata=flag(help))` for a field with no default); the flag's name,
type, choices and default come from the field itself, so a setting is declared, defaulted
and checked in its dataclass alone:

- `add_flags(parser, Config)` adds one flag per such field;
- `from_args(Config, namespace)` builds the config back, and the dataclass's own checks
  (its `__post_init__`) run there: a bad value is that check's one-line message;
- `to_args(config)` renders a config as the flags that give it back (what a launcher
  passes to a child process), leaving out settings at their defaults.

Example:

    @dataclasses.dataclass(frozen=True)
    class Config:
        quorum: int = setting(1, "learners needed to close a round, >= 1")

    parser = argparse.ArgumentParser()
    add_flags(parser, Config)
    from_args(Config, parser.parse_args(["--quorum", "2"]))  # Config(quorum=2)
    to_args(Config(quorum=2))  # ["--quorum", "2"]

Types a field may have: int, float, str, pathlib.Path, an Enum (its members' names in
lower case are the choices), bool (a switch: `--NAME` when it defaults to False,
`--no-NAME` when to True), `T | None`, and `tuple[T, ...]` (a repeated flag, or one flag
that `Flag.parse` splits).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
KEY = "atoll.flag"  # the metadata key a field's Flag sits under


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one field appears on the command line."""

    help: str  # what the setting does and its limits; the default is appended
    name: str = ""  # the flag, when not --field-name (or --no-field-name for a True bool)
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # text -> value, in place of the field's type
    render: Callable[[Any], str] | None = None  # value -> text, the inverse of parse
    choices: tuple[str, ...] | None = None  # the values offered (an Enum's default: all)
    default_text: str | None = None  # the default as help shows it, where str() misleads


def flag(help: str, **how: Any) -> dict[str, Flag]:
    """A field's metadata: its flag (`Flag`'s fields as keywords)."""
    return {KEY: Flag(help, **how)}


def setting(default: T, help: str, **how: Any) -> T:
    """A field with a default and a flag: `quorum: int = setting(1, "...")`."""
    return dataclasses.field(default=default, metadata=flag(help, **how))


@dataclasses.dataclass(frozen=True)
class Setting:
    """One field with a flag: the field, its Flag, and the type its flag's text becomes."""

    field: dataclasses.Field[Any]
    how: Flag
    base: type  # int, float, str, pathlib.Path, bool or an Enum
    repeated: bool  # a tuple of `base`

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def default(self) -> Any:
        """The field's default; None for a field without one."""
        d = self.field.default
        return None if d is dataclasses.MISSING else d

    @property
    def flag(self) -> str:
        """The flag, with its dashes."""
        if self.how.name:
            return "--" + self.how.name
        prefix = "no-" if self.base is bool and self.default is True else ""
        return "--" + prefix + self.name.replace("_", "-")


def settings(cls: type) -> list[Setting]:
    """The fields of dataclass `cls` that have a flag, in order."""
    hints = typing.get_type_hints(cls)
    return [
        Setting(f, f.metadata[KEY], *_kind(hints[f.name]))
        for f in dataclasses.fields(cls)
        if KEY in f.metadata
    ]


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: tuple[str, ...] | None = None,
    absent: bool = False,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Adds the flags of `cls`'s fields (or of those named in `only`) to `parser`.

    A flag's value defaults to its field's or, with `absent`, to None, so that a caller can
    tell which flags were given (a resume that keeps the rest); help shows the field's
    default either way. `defaults` replaces some fields' defaults for a command that runs
    `cls` another way (`atoll chaos`'s run is not `atoll up`'s)."""
    for s in settings(cls):
        if defaults and s.name in defaults:
            s = dataclasses.replace(s, field=_with_default(s.field, defaults[s.name]))
        if only is None or s.name in only:
            parser.add_argument(s.flag, **_argument(s, absent))


def _with_default(field: dataclasses.Field[Any], default: Any) -> dataclasses.Field[Any]:
    """A copy of `field` with another default."""
    out: dataclasses.Field[Any] = dataclasses.field(default=default, metadata=field.metadata)
    out.name, out.type = field.name, field.type
    return out


def _argument(s: Setting, absent: bool) -> dict[str, Any]:
    """add_argument's keywords for one setting."""
    shown = s.how.default_text or ("" if s.repeated else _text(s.default))
    help = s.how.help.replace("%", "%%")
    if shown and s.base is not bool:
        help += " (default " + shown.replace("%", "%%") + ")"
    kw: dict[str, Any] = {"dest": s.name, "help": help}
    if s.base is bool:
        kw["action"] = "store_false" if s.default is True else "store_true"
        kw["default"] = None if absent else s.default
        return kw
    kw["metavar"] = s.how.metavar
    if issubclass(s.base, enum.Enum):
        kw["choices"] = s.how.choices or [m.name.lower() for m in s.base]
    else:
        kw["type"] = s.how.parse or s.base
        kw["choices"] = s.how.choices
    if s.repeated and s.how.parse is None:
        kw["action"] = "append"  # default None: a list default would be appended to
        kw["default"] = None
    elif absent or s.default is None:
        kw["default"] = None
    else:
        kw["default"] = _text(s.default) if isinstance(s.default, enum.Enum) else s.default
    return kw


def given(cls: type, namespace: argparse.Namespace) -> dict[str, Any]:
    """The settings of `cls` that the parsed flags hold (those not None), as field values."""
    out = {}
    for s in settings(cls):
        value = getattr(namespace, s.name, None)
        if value is None:
            continue
        if issubclass(s.base, enum.Enum) and isinstance(value, str):
            value = s.base[value.upper()]
        elif s.repeated:
            value = tuple(value)
        out[s.name] = value
    return out


def from_args(cls: type[T], namespace: argparse.Namespace, **values: Any) -> T:
    """`cls` built from the parsed flags, `values` taking precedence (what a caller found
    elsewhere, such as the environment); the dataclass's own checks run as it is built.

    A field without a default that neither gives is a ValueError naming its flag."""
    fields = given(cls, namespace) | values
    for s in settings(cls):
        if s.name not in fields and s.field.default is dataclasses.MISSING:
            raise ValueError(f"{s.flag} is required")
    return cls(**fields)


def to_args(config: object, *, skip: tuple[str, ...] = (), every: bool = False) -> list[str]:
    """The flags that give `config` back through `from_args`: settings at their defaults
    (and those in `skip`) are left out; a repeated flag comes once per item.

    With `every`, settings at their defaults are spelled out too (a child whose flags
    default from its environment must not read another value there), but for None, an
    empty tuple and a switch left as it is, which no flag says."""
    args: list[str] = []
    for s in settings(type(config)):
        value = getattr(config, s.name)
        if s.name in skip or (value == s.field.default and not every):
            continue
        if value is None or value == () or (s.base is bool and value == s.default):
            continue
        if s.base is bool:
            args.append(s.flag)
        elif s.repeated and s.how.parse is None:
            for item in value:
                args += [s.flag, _text(item)]
        else:
            args += [s.flag, s.how.render(value) if s.how.render else _text(value)]
    return args


def _text(value: object) -> str:
    """A value as a flag writes it: an Enum by its name in lower case, None as nothing."""
    if value is None:
        return ""
    if isinstance(value, enum.Enum):
        return value.name.lower()
    return str(value)


def _kind(hint: Any) -> tuple[type, bool]:
    """(the type a flag's text becomes, whether the field is a tuple of them) for a type
    hint: T, T | None, tuple[T, ...]."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    if not isinstance(hint, type):
        raise TypeError(f"a flag cannot give a value of type {hint}")
    return hint, False


__all__ = [
    "Flag",
    "Setting",
    "add_flags",
    "flag",
    "from_args",
    "given",
    "setting",
    "settings",
    "to_args",
]
