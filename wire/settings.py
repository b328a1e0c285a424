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

Beyond one field, one flag:

- `env="ATOLL_X"`: the flag defaults to that environment variable where it is set (and not
  empty), read as the flag's own text is; a value it cannot take is argparse's one-line
  error naming the variable. Help says `(env ATOLL_X)`.
- `group="title"`: the flag goes in help's argument group of that title.
- `nested(Inner)`: a field holding another config, whose flags (its fields') are added
  with the owner's and build it (its checks running) as the owner is built. `into` maps
  the built config to the owner's fields it gives (several fields from a pair of flags,
  such as a pattern with its count), `out_of` the owner back to it, for `to_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
KEY = "atoll.flag"  # the metadata key a field's Flag sits under
NESTED = "atoll.nested"  # the metadata key a nested config's Nested sits under


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
    env: str = ""  # the environment variable that, when set and not empty, gives the default
    group: str = ""  # help's argument group of this flag (none: the parser's options)


@dataclasses.dataclass(frozen=True)
class Nested:
    """A field whose flags are those of another config dataclass (`nested`)."""

    cls: type  # the nested config: its fields' flags are added, and it is built from them
    title: str = ""  # help's argument group of its flags (none: the parser's options)
    # the built nested config -> the owner's fields it gives (default: this field, itself)
    into: Callable[[Any], dict[str, Any]] | None = None
    # the owner config -> the nested config that `to_args` renders (default: this field)
    out_of: Callable[[Any], Any] | None = None


def nested(cls: type, **how: Any) -> dict[str, Nested]:
    """A field's metadata: its value is a `cls` built from `cls`'s own flags (`Nested`'s
    fields as keywords): `distributed: Multi | None = field(default=None,
    metadata=nested(Multi, title="multi-host"))`."""
    return {NESTED: Nested(cls, **how)}


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


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], Flag | Nested]]:
    """The fields of `cls` with a flag or nested flags, in order, with how."""
    return [
        (f, f.metadata[KEY] if KEY in f.metadata else f.metadata[NESTED])
        for f in dataclasses.fields(cls)
        if KEY in f.metadata or NESTED in f.metadata
    ]


Container = argparse.ArgumentParser | argparse._ArgumentGroup


def add_flags(
    parser: Container,
    cls: type,
    *,
    only: tuple[str, ...] | None = None,
    absent: bool = False,
    defaults: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    prefix: str = "",
) -> None:
    """Adds the flags of `cls`'s fields (or of those named in `only`) to `parser`, and
    those of its nested configs', in field order.

    A flag's value defaults to its `env` variable's in `environ` (default os.environ), else
    to its field's or, with `absent`, to None, so that a caller can tell which flags were
    given (a resume that keeps the rest); help shows the field's default either way.
    `defaults` replaces some fields' defaults for a command that runs `cls` another way
    (`atoll chaos`'s run is not `atoll up`'s). A nested config's flags keep their names;
    their values sit in the namespace under `prefix` + "FIELD.NAME"."""
    env = os.environ if environ is None else environ
    by_name = {s.name: s for s in settings(cls)}
    for f, how in _fields(cls):
        if only is not None and f.name not in only:
            continue
        if isinstance(how, Nested):
            inner = _group(parser, how.title)
            add_flags(inner, how.cls, absent=absent, environ=env, prefix=f"{prefix}{f.name}.")
            continue
        s = by_name[f.name]
        if defaults and s.name in defaults:
            s = dataclasses.replace(s, field=_with_default(s.field, defaults[s.name]))
        kw = _argument(s, absent, env.get(s.how.env, "") if s.how.env else "")
        _group(parser, s.how.group).add_argument(s.flag, **kw, dest=prefix + s.name)


def _group(parser: Container, title: str) -> Container:
    """The argument group of `parser` titled `title` (made if new); `parser` itself for
    no title, or where `parser` is a group already (argparse's groups do not nest)."""
    if not title or not isinstance(parser, argparse.ArgumentParser):
        return parser
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def _with_default(field: dataclasses.Field[Any], default: Any) -> dataclasses.Field[Any]:
    """A copy of `field` with another default."""
    out: dataclasses.Field[Any] = dataclasses.field(default=default, metadata=field.metadata)
    out.name, out.type = field.name, field.type
    return out


def _argument(s: Setting, absent: bool, env_text: str) -> dict[str, Any]:
    """add_argument's keywords (but dest) for one setting; `env_text` is its `env`
    variable's value ("" where unset)."""
    shown = s.how.default_text or ("" if s.repeated else _text(s.default))
    help = s.how.help.replace("%", "%%")
    if s.how.env:
        help += f" (env {s.how.env})"
    if shown and s.base is not bool:
        help += " (default " + shown.replace("%", "%%") + ")"
    kw: dict[str, Any] = {"help": help}
    if s.how.env and (s.base is bool or (s.repeated and s.how.parse is None)):
        raise TypeError(f"{s.flag}: a switch or a repeated flag cannot default from {s.how.env}")
    if s.base is bool:
        kw["action"] = "store_false" if s.default is True else "store_true"
        kw["default"] = None if absent else s.default
        return kw
    if issubclass(s.base, enum.Enum):
        kw["choices"] = s.how.choices or [m.name.lower() for m in s.base]
    else:
        kw["type"] = s.how.parse or s.base
        kw["choices"] = s.how.choices
    # argparse's own: the choices, else the dest in capitals (a nested one's has a prefix)
    kw["metavar"] = s.how.metavar or (None if kw["choices"] else s.name.upper())
    if s.repeated and s.how.parse is None:
        kw["action"] = "append"  # default None: a list default would be appended to
        kw["default"] = None
    elif absent or s.default is None:
        kw["default"] = None
    else:
        kw["default"] = _text(s.default) if isinstance(s.default, enum.Enum) else s.default
    if env_text.strip():
        # argparse converts a str default with `type` only when the flag is not given, and
        # reports a failure as its usual one-line error (exit status 2)
        kw["default"] = _EnvText(env_text)
        kw["type"] = _from_env(s.how.env, kw.get("type") or str, kw["choices"])
    return kw


class _EnvText(str):
    """A flag's default read from the environment: its conversion errors name the variable."""


def _from_env(var: str, convert: Callable[[str], Any], choices: Any) -> Callable[[str], Any]:
    """`convert` for a flag defaulting to `var`: where the text is `var`'s, an error says
    so, and `choices` (which argparse leaves unchecked on a default) are checked."""

    def read(text: str) -> Any:
        if not isinstance(text, _EnvText):
            return convert(text)
        try:
            value = convert(text)
        except argparse.ArgumentTypeError as e:
            reason = str(e)
        except (TypeError, ValueError):
            reason = f"not a valid {getattr(convert, '__name__', 'value')}"
        else:
            if choices is None or value in choices:
                return value
            reason = "want one of " + ", ".join(map(str, choices))
        raise argparse.ArgumentTypeError(f"environment variable {var}={str(text)!r}: {reason}")

    return read


def given(cls: type, namespace: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """The settings of `cls` that the parsed flags hold (those not None), as field values
    (a nested config's are not: `from_args` builds it)."""
    out = {}
    for s in settings(cls):
        value = getattr(namespace, prefix + s.name, None)
        if value is None:
            continue
        if issubclass(s.base, enum.Enum) and isinstance(value, str):
            value = s.base[value.upper()]
        elif s.repeated:
            value = tuple(value)
        out[s.name] = value
    return out


def from_args(cls: type[T], namespace: argparse.Namespace, prefix: str = "", **values: Any) -> T:
    """`cls` built from the parsed flags, `values` taking precedence (what a caller found
    elsewhere); each nested config is built first, from its own flags, then `cls`, and
    each dataclass's own checks run as it is built.

    A field without a default that neither gives is a ValueError naming its flag."""
    fields = given(cls, namespace, prefix)
    for f, how in _fields(cls):
        if isinstance(how, Nested) and f.name not in values:
            inner: Any = from_args(how.cls, namespace, f"{prefix}{f.name}.")
            fields |= how.into(inner) if how.into else {f.name: inner}
    fields |= values
    for s in settings(cls):
        missing = dataclasses.MISSING
        no_default = s.field.default is missing and s.field.default_factory is missing
        if s.name not in fields and no_default:
            raise ValueError(f"{s.flag} is required")
    return cls(**fields)


def to_args(config: object, *, skip: tuple[str, ...] = (), every: bool = False) -> list[str]:
    """The flags that give `config` back through `from_args`: settings at their defaults
    (and those in `skip`) are left out; a repeated flag comes once per item.

    With `every`, settings at their defaults are spelled out too (a child whose flags
    default from its environment must not read another value there), but for None, an
    empty tuple and a switch left as it is, which no flag says."""
    args: list[str] = []
    by_name = {s.name: s for s in settings(type(config))}
    for f, how in _fields(type(config)):
        if f.name in skip:
            continue
        if isinstance(how, Nested):
            inner = how.out_of(config) if how.out_of else getattr(config, f.name)
            args += [] if inner is None else to_args(inner, every=every)
            continue
        s = by_name[f.name]
        value = getattr(config, s.name)
        if value == s.field.default and not every:
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
    "Nested",
    "Setting",
    "add_flags",
    "flag",
    "from_args",
    "given",
    "nested",
    "setting",
    "settings",
    "to_args",
]
