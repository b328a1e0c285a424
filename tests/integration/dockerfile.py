"""A Dockerfile read as data, for checking an image's recipe without a container engine.

`stages` splits a Dockerfile into its stages and instructions, each RUN into the
commands its `&&` chain runs, with the WORKDIR each runs in; `copy_context` copies files
the way a COPY from the build context does, leaving out what .dockerignore excludes.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex
import shutil


@dataclasses.dataclass
class Instruction:
    keyword: str  # upper case: RUN, COPY, WORKDIR, ...
    args: str  # the rest, continuation lines joined
    line: int  # where it starts in the Dockerfile, 1-based
    workdir: str = "/"  # the WORKDIR in effect: set by its stage


@dataclasses.dataclass(frozen=True)
class Command:
    text: str  # one command of a RUN's `&&` chain
    workdir: str  # where it runs
    line: int  # its RUN's first line in the Dockerfile


@dataclasses.dataclass
class Stage:
    name: str  # the `AS` name, or the stage's index when it has none
    base: str  # the image or stage it is FROM
    instructions: list[Instruction]
    workdir: str  # its last WORKDIR, else its base stage's, else /
    env: dict[str, str]  # its ENVs and its base stage's

    def runs(self) -> list[Command]:
        """The commands of its RUNs, each `&&` chain split, in order."""
        return [
            Command(text, i.workdir, i.line)
            for i in self.instructions
            if i.keyword == "RUN"
            for text in split_and(i.args)
        ]


def _instructions(text: str) -> list[Instruction]:
    found: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(), 1):
        # Comments are dropped, inside a continued instruction too; blank lines end none.
        if line.lstrip().startswith("#") or (not pending and not line.strip()):
            continue
        if not pending:
            start = number
        # Docker removes a trailing backslash and the newline; the next line's indent stays.
        if line.rstrip().endswith("\\"):
            pending.append(line.rstrip()[:-1])
            continue
        pending.append(line)
        keyword, _, args = "".join(pending).strip().partition(" ")
        found.append(Instruction(keyword.upper(), args.strip(), start))
        pending = []
    return found


def stages(path: pathlib.Path) -> dict[str, Stage]:
    """The stages of the Dockerfile at `path` by name, in order (ARGs before the first
    FROM substituted with their defaults)."""
    args: dict[str, str] = {}
    result: dict[str, Stage] = {}
    stage: Stage | None = None
    for ins in _instructions(path.read_text()):
        if ins.keyword == "ARG" and stage is None:
            name, _, default = ins.args.partition("=")
            args[name] = default
        elif ins.keyword == "FROM":
            words = ins.args.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(result))
            parent = result.get(base)
            stage = Stage(
                name,
                base,
                [],
                parent.workdir if parent else "/",
                dict(parent.env) if parent else {},
            )
            result[name] = stage
        elif stage is not None:
            if ins.keyword == "WORKDIR":
                stage.workdir = str(pathlib.PurePosixPath(stage.workdir, ins.args))
            elif ins.keyword == "ENV":
                stage.env.update(w.split("=", 1) for w in shlex.split(ins.args))
            ins.workdir = stage.workdir
            stage.instructions.append(ins)
    return result


def split_and(command: str) -> list[str]:
    """`a && b "c && d"` -> ['a', 'b "c && d"']: the commands of a shell `&&` chain."""
    parts: list[str] = []
    start, quote, i = 0, "", 0
    while i < len(command):
        c = command[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif command.startswith("&&", i):
            parts.append(command[start:i].strip())
            start = i + 2
            i += 1
        i += 1
    parts.append(command[start:].strip())
    return parts


def _ignore_rules(context: pathlib.Path) -> list[tuple[bool, re.Pattern[str]]]:
    """(is an exception `!...`, pattern) for each line of .dockerignore, in order."""
    rules: list[tuple[bool, re.Pattern[str]]] = []
    ignore = context / ".dockerignore"
    lines = ignore.read_text().splitlines() if ignore.exists() else []
    for line in (raw.strip() for raw in lines):
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = str(pathlib.PurePosixPath(line.lstrip("!").lstrip("/")))
        # As Docker (Go's filepath.Match, plus `**` for any number of directories).
        regex = ""
        for token in re.split(r"(\*\*/|\*\*|\*|\?)", pattern):
            regex += {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(
                token, re.escape(token)
            )
        rules.append((negated, re.compile(regex)))
    return rules


def _relative(path: pathlib.Path, context: pathlib.Path) -> pathlib.PurePosixPath:
    return pathlib.PurePosixPath(path.relative_to(context).as_posix())


def _ignored(relative: pathlib.PurePosixPath, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    # A path is left out when it or a directory above it matches; the last rule wins.
    candidates = [str(relative), *(str(p) for p in relative.parents if str(p) != ".")]
    ignored = False
    for negated, regex in rules:
        if any(regex.fullmatch(c) for c in candidates):
            ignored = not negated
    return ignored


def copy_context(
    context: pathlib.Path, sources: list[str], dest: pathlib.Path, *, into: bool
) -> list[str]:
    """Does `COPY <sources...> <dest>` from the build context `context`, .dockerignore's
    exclusions left out: a directory's contents land under dest, a file in dest when
    `into` (dest ends with / or there are several sources), else at dest. Returns the
    files copied, relative to the context."""
    rules = _ignore_rules(context)
    copied: list[str] = []
    for source in sources:
        root = context / source
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        files = [f for f in files if not _ignored(_relative(f, context), rules)]
        if not files:
            raise FileNotFoundError(f"COPY {source}: not in the build context or .dockerignored")
        for file in files:
            if file != root:
                target = dest / file.relative_to(root)
            else:
                target = dest / file.name if into else dest
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, target)
            copied.append(str(_relative(file, context)))
    return copied
