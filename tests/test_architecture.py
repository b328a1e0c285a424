"""The tree keeps its architecture: no import cycles, configs out of entry points, and
everything imported through the `atoll` namespace (server/, learner/ and wire/ install as
atoll.server, atoll.learner and atoll.wire; nothing named `server` or `wire` may be
imported, as it would collide with other software in a user's environment)."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {
    "atoll": REPO / "atoll",
    "atoll.server": REPO / "server",
    "atoll.learner": REPO / "learner",
    "atoll.wire": REPO / "wire",
}
# entry points: flags in, a run out; only the command line imports them
ENTRY_POINTS = {"atoll.cli", "atoll.local.up", "atoll.learner.trainer.main", "atoll.server.main"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            if (
                name.startswith("atoll.")
                and name.split(".")[1] in ("server", "learner", "wire")
                and folder == PACKAGES["atoll"]
            ):
                continue  # atoll/ holds no server/learner/wire folders of its own
            found[name] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """Project modules `name` imports anywhere in its file (deferred imports included)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_the_packages():
    graph = _graph()
    assert {
        "atoll.cli",
        "atoll.server.shard",
        "atoll.learner.trainer.loop",
        "atoll.wire.codec",
        "atoll.local.session",
        "atoll.faults.chaos",
    } <= set(graph)
    assert "atoll.server.rules" in graph["atoll.server.shard"]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_command_line_imports_entry_points():
    graph = _graph()
    wrong = {(m, e) for m, deps in graph.items() for e in deps & ENTRY_POINTS if m != "atoll.cli"}
    assert not wrong, f"configs and helpers belong outside entry points: {sorted(wrong)}"


def test_nothing_imports_top_level_server_learner_or_wire():
    files = [p for folder in (*PACKAGES.values(), REPO / "tests") for p in folder.rglob("*.py")]
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            offenders += [
                f"{path.relative_to(REPO)}: {n}"
                for n in names
                if n.split(".")[0] in ("server", "learner", "wire")
            ]
    assert not offenders, offenders


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others (itself included)."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph[module]
    return seen


def test_the_learner_library_imports_only_the_learner_and_the_wire():
    """`atoll.Learner` (learner/api.py) and all it imports stay a library: nothing of the
    command layer (atoll.commands, atoll.cli), the server or the built-in trainer's entry
    point (issue 42). The built-in trainer's CLI, learner/trainer/main.py, may use the commands'
    shared flags; the library may not."""
    graph = _graph()
    reached = _reach(graph, "atoll.learner.api")
    outside = sorted(
        m for m in reached if m.split(".")[:2] not in (["atoll", "learner"], ["atoll", "wire"])
    )
    assert not outside, f"the learner library imports {outside}"
    assert "atoll.learner.trainer.main" not in reached
    assert {"atoll.learner.tenure", "atoll.learner.sync", "atoll.wire.client"} <= reached
    # the walk sees a command-layer import where there is one (`atoll export`'s TLS flags)
    assert "atoll.commands" in _reach(graph, "atoll.export")


def test_the_learner_library_never_imports_the_built_in_trainer():
    """learner/ is the library a user imports and learner/trainer/ the built-in trainer,
    one user of it (issue 42): no library module imports a trainer module, directly or
    deferred, so the library runs without the trainer's model, data or mesh."""
    graph = _graph()
    library = {m for m in graph if m.startswith("atoll.learner.")} - {
        m for m in graph if m.startswith("atoll.learner.trainer")
    }
    assert {"atoll.learner.api", "atoll.learner.sync", "atoll.learner.config"} <= library
    wrong = sorted(
        (m, d) for m in library for d in graph[m] if d.startswith("atoll.learner.trainer")
    )
    assert not wrong, f"the learner library imports the built-in trainer: {wrong}"
    # the walk sees the trainer's imports of the library where there are some
    assert "atoll.learner.api" in graph["atoll.learner.trainer.loop"]
