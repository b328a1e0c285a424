"""Every `atoll` command has a test that runs it as a user does (a real process, short
settings), every long-running one a test of its SIGTERM, and every one answers --help.

COVERAGE names those tests; a command added to atoll.cli.COMMANDS or atoll.bench.BENCHES
without a row here fails test_every_command_has_its_tests, so the table stays true.
The commands no other file runs (`atoll plan`, `atoll bench codec`) are run here."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest
from syncer_helpers import run_atoll

from atoll import bench, cli

HERE = pathlib.Path(__file__).parent


def _commands() -> list[str]:
    """Every runnable command: `atoll NAME`, and `atoll bench NAME` for each bench."""
    names = [c.name for c in cli.COMMANDS if c.name != "bench"]
    return names + [f"bench {b.name}" for b in bench.BENCHES]


# command -> (the test that runs it, the test of its SIGTERM or None for a command that
# returns within seconds on its own); "file.py::test" under tests/integration/
COVERAGE: dict[str, tuple[str, str | None]] = {
    "syncer": (
        "test_syncer_process.py::test_sigkill_mid_push_stream_keeps_exactly_the_acknowledged_pushes",
        "test_signals.py::test_a_syncer_serving_open_watch_and_push_streams_stops_within_seconds",
    ),
    "learner": (
        "test_learner.py::test_learners_train_through_a_shard_kill",
        "test_learner_stop.py::test_sigterm_ends_the_waits_of_a_learner_whose_shard_vanished",
    ),
    "up": (
        "test_up_process.py::test_up_runs_to_a_report_with_plots_through_a_shard_kill",
        "test_signals.py::test_atoll_up_mid_run_stops_on_sigterm_with_its_children",
    ),
    "chaos": (
        "test_chaos_lockstep.py::test_a_lockstep_run_restarts_every_learner_from_its_checkpoint_and_goes_on",
        "test_signals.py::test_atoll_chaos_mid_run_stops_on_sigterm_with_its_children",
    ),
    "plan": ("test_commands.py::test_atoll_plan_prints_the_goodput_table", None),
    "status": (
        "test_reshard_process.py::test_atoll_status_shows_the_map_and_moves_in_progress",
        None,
    ),
    "reshard": (
        "test_reshard_process.py::test_atoll_reshard_balances_the_fragments_and_says_what_it_moved",
        None,  # each call has a deadline; a rerun finishes what a kill interrupted
    ),
    "drain": (
        "test_reshard_learners.py::test_learners_train_on_while_the_service_goes_from_2_to_4_to_3_shards",
        "test_signals.py::test_atoll_drain_waiting_for_shards_that_never_answer_stops_within_seconds",
    ),
    "export": (
        "test_export_shards.py::test_export_writes_what_the_shards_serve_and_sample_runs_it",
        None,
    ),
    "sample": (
        "test_export_shards.py::test_export_writes_what_the_shards_serve_and_sample_runs_it",
        None,
    ),
    "bench codec": ("test_commands.py::test_atoll_bench_codec_reports_every_codec", None),
    "bench quality": (
        "test_bench_quality.py::test_quality_bench_measures_the_frontier_at_equal_tokens",
        None,
    ),
    "bench ingest": ("test_bench_ingest.py::test_tiny_run_reports_every_figure", None),
    "bench streams": ("test_bench_streams.py::test_tiny_crowd_reports_every_figure", None),
    "bench learner": ("test_bench_learner.py::test_tiny_run_reports_every_figure", None),
    "bench learners": ("test_bench_learners.py::test_tiny_run_reports_every_figure", None),
    "bench wan": ("test_bench_wan.py::test_tiny_run_reports_every_figure", None),
    "bench cadence": ("test_bench_cadence_run.py::test_tiny_run_reports_every_figure", None),
}
LONG_RUNNING = {"syncer", "learner", "up", "chaos", "drain"}  # wait until stopped, or long


def _test_source(ref: str) -> str:
    """The source of test function `file.py::name` (fails the test when there is none)."""
    file, name = ref.split("::")
    path = HERE / file
    assert path.is_file(), f"{ref}: no such file"
    tree = ast.parse(path.read_text())
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{ref}: no such test"
    return ast.get_source_segment(path.read_text(), found[0]) or ""


@pytest.mark.parametrize("command", _commands())
def test_every_command_has_its_tests(command):
    assert command in COVERAGE, (
        f"`atoll {command}` has no row in COVERAGE: name the test that runs it as a real "
        "process (and, if it waits until stopped, the test of its SIGTERM)"
    )
    runs, stops = COVERAGE[command]
    _test_source(runs)
    if command in LONG_RUNNING:
        assert stops is not None, f"`atoll {command}` runs until stopped: name its SIGTERM test"
    if stops is not None:
        assert "SIGTERM" in _test_source(stops) or "sigterm" in stops, stops
    assert set(COVERAGE) == set(_commands()), "COVERAGE names a command that no longer exists"


@pytest.mark.parametrize("command", ["", "bench", *_commands()])
def test_every_command_answers_help(command, capsys):
    argv = [*command.split(), "--help"]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: atoll {command}".rstrip()), out


def test_atoll_plan_prints_the_goodput_table():
    result = run_atoll("plan", timeout=120)  # at its defaults
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["chips", "data-parallel", "elastic", "DP", "atoll", "M=8"], lines
    assert [line.split()[0] for line in lines[1:6]] == ["150k", "300k", "600k", "1.2M", "2.4M"]
    assert "goodput %" in result.stdout and not result.stderr


def test_atoll_bench_codec_reports_every_codec():
    result = run_atoll("bench", "codec", "--params", "100000", "--repeats", "1", timeout=120)
    assert result.returncode == 0, result.stderr
    r = json.loads(result.stdout)
    assert (r["params"], r["repeats"]) == (100_000, 1)
    assert r["default_codec"] in r["codecs"]
    for name, figures in r["codecs"].items():
        assert figures["per_core"]["encode_mparams_per_s"] > 0, name
