"""Command tables: `atoll COMMAND` and `atoll bench BENCH` as rows naming a module.

Each command's module owns its flags (`add_arguments(p)`) and its run (`main(args,
parser) -> exit code`). A table loads only the module of the command being run, so
`atoll --help` and `atoll status` never import jax or the shard; `atoll COMMAND --help`
loads that one module.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    help: str
    module: str  # imported only when this command runs or shows its help
    add: str = "add_arguments"  # module function (parser) -> None: the flags
    main: str = "main"  # module function (args, parser) -> int: the exit code

    def function(self, which: str) -> Callable[..., Any]:
        return getattr(importlib.import_module(self.module), which)  # type: ignore[no-any-return]


class _LazyParser(argparse.ArgumentParser):
    """A subcommand's parser that adds its flags the first time it is used."""

    def __init__(self, *args: Any, command: Command | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.command = command

    def _load(self) -> None:
        if self.command is not None and not getattr(self, "_loaded", False):
            self._loaded = True
            self.command.function(self.command.add)(self)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        self._load()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._load()
        return super().format_help()


def add_commands(parser: argparse.ArgumentParser, table: Sequence[Command], dest: str) -> None:
    """Adds one subcommand per row; the chosen row is left in `args.<dest>` and its parser
    in `args.<dest>_parser` for `run`."""
    sub = parser.add_subparsers(dest=dest, metavar=dest.upper(), parser_class=_LazyParser)
    sub.required = True
    for c in table:
        p = sub.add_parser(c.name, help=c.help, description=c.help, command=c)
        p.set_defaults(**{f"{dest}_parser": p})


def subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    """The parser of `atoll NAME NAME ...`, its flags loaded (for tests and docs)."""
    for name in names:
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[name]
        if isinstance(parser, _LazyParser):
            parser._load()
    return parser


COMMAND_LOG = "ATOLL_COMMAND_LOG"  # a file: each command run appends a line (below)
COMMAND_TAG = "ATOLL_COMMAND_TAG"  # what that line says ran it (the test suite: a test's id)


def _log_command(dest: str, name: str) -> None:
    """With ATOLL_COMMAND_LOG set, appends `{"table", "command", "tag"}` as one JSON line:
    how the test suite checks that the test it names for a command runs that command."""
    path = os.environ.get(COMMAND_LOG)
    if path:
        line = {"table": dest, "command": name, "tag": os.environ.get(COMMAND_TAG, "")}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def run(args: argparse.Namespace, table: Sequence[Command], dest: str) -> int:
    """Calls the chosen row's main with the parsed args and its own parser (so a flag error
    reads `atoll COMMAND: error: ...`)."""
    command = next(c for c in table if c.name == getattr(args, dest))
    _log_command(dest, command.name)
    return int(command.function(command.main)(args, getattr(args, f"{dest}_parser")))


# --- flag types every command may use ---


class Terminated(BaseException):
    """A signal (SIGTERM) that ends a command, raised in the main thread through any wait
    or call in flight by `raise_terminated`; a BaseException, so no handler of the
    command's own errors takes it for one."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def raise_terminated(signum: int, _frame: object) -> None:
    """A signal handler (`signal.signal(signal.SIGTERM, raise_terminated)`)."""
    raise Terminated(signum)


def _whole(text: str, least: int) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _whole(text, 1)


def non_negative_int(text: str) -> int:
    return _whole(text, 0)


def _whole_list(text: str, least: int, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"want comma-separated whole numbers, got {text!r}"
        ) from None
    if any(v < least for v in values):
        raise argparse.ArgumentTypeError(f"{what} must be at least {least}, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} names one value twice")
    return values


def seed_list(text: str) -> tuple[int, ...]:
    """'0,1,2': distinct seeds >= 0; a readable ArgumentTypeError for anything else."""
    return _whole_list(text, 0, "seeds")


def period_list(text: str) -> tuple[int, ...]:
    """'32,64': distinct sync periods (H) >= 1; a readable ArgumentTypeError otherwise."""
    return _whole_list(text, 1, "periods")


def address_list(text: str, flag: str = "--shards") -> list[str]:
    """'HOST:PORT,HOST:PORT' as a list, each address checked; a readable ArgumentTypeError for
    anything else (a learner's --shards, which may be a {i} pattern, is
    learner.config.shard_addresses's)."""
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    if not addresses:
        raise argparse.ArgumentTypeError(f"{flag} takes HOST:PORT,..., got {text!r}")
    for a in addresses:
        host, colon, port = a.rpartition(":")
        if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise argparse.ArgumentTypeError(
                f"{flag}: {a!r} is not HOST:PORT with a port in 1-65535 (in {text!r})"
            )
    return addresses


# --- TLS for the tools that call shards (status, reshard, drain) ---


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    """--tls-ca / --tls-cert / --tls-key, as the learner takes them."""
    import pathlib

    p.add_argument(
        "--tls-ca",
        type=pathlib.Path,
        default=None,
        help="PEM CA of the shards' certificates (enables TLS; the Secret's ca.crt)",
    )
    p.add_argument(
        "--tls-cert",
        type=pathlib.Path,
        default=None,
        help="PEM client certificate, for shards that require mutual TLS",
    )
    p.add_argument(
        "--tls-key", type=pathlib.Path, default=None, help="PEM private key of --tls-cert"
    )


def check_tls_pairs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A flag error when the --tls-* flags given cannot work together (files unread)."""
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_cert is not None and args.tls_ca is None:
        parser.error("--tls-cert needs --tls-ca as well")


def tls_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """The TlsFiles the flags name (None: plaintext); a flag error when they do not fit."""
    from atoll.wire.client import TlsFiles

    check_tls_pairs(args, parser)
    ca, cert, key = args.tls_ca, args.tls_cert, args.tls_key
    for flag, path in (("--tls-ca", ca), ("--tls-cert", cert), ("--tls-key", key)):
        if path is not None and not path.is_file():
            parser.error(f"{flag} {path}: no such file")
    return TlsFiles(ca, cert, key) if ca is not None else None
