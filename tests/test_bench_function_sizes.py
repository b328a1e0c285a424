"""The ingest and data-parallel benches read as named steps: no function over 80 lines
(split a function into setup / step / finish before it grows past, as the server and the
learner do)."""

from __future__ import annotations

import ast
import pathlib

BENCH = pathlib.Path(__file__).resolve().parents[1] / "atoll" / "bench"


def test_no_function_of_the_ingest_or_data_parallel_bench_is_over_80_lines():
    long = []
    for name in ("ingest.py", "ingest_clients.py", "data_parallel.py"):
        for node in ast.walk(ast.parse((BENCH / name).read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"bench/{name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
