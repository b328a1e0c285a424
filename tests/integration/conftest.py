"""Every test under tests/integration/ is marked `integration` (real servers and processes):
`make test-fast` deselects them with `-m "not e2e and not integration"`. The marker is
registered here, beside the tests it marks (pyproject.toml holds the suite-wide ones)."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent
MARKER = "integration"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}: real servers and processes (every test in tests/integration/, marked by "
        "its conftest); `make test-fast` skips them",
    )


# tryfirst: the marker is on every item before `-m` deselects by it
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # a conftest's hook sees the whole session's items: mark only those collected here
    for item in items:
        if item.path.resolve().is_relative_to(HERE):
            item.add_marker(MARKER)


@pytest.fixture
def one_shard(tmp_path: pathlib.Path):
    """One shard (quorum 1) serving in this process, for an atoll.Learner: its address."""
    # imported here: the module brings JAX, which only the learner tests need
    from test_learner_api_shards import start_shards

    servers = start_shards(tmp_path, 1, quorum=1)
    yield f"127.0.0.1:{servers[0].port}"
    for s in servers:
        s.stop()


# --- the tests test_commands.COVERAGE names run the commands it names them for ---------
# Every `atoll` command run during the session (in a child process or in-process) appends
# a line naming itself and the test that ran it (atoll.commands: ATOLL_COMMAND_LOG and
# ATOLL_COMMAND_TAG); at the end, each COVERAGE test that passed must have run its command.

_passed: set[str] = set()


@pytest.fixture(scope="session", autouse=True)
def _command_log(tmp_path_factory: pytest.TempPathFactory) -> None:
    from atoll.commands import COMMAND_LOG

    os.environ[COMMAND_LOG] = str(tmp_path_factory.getbasetemp() / "commands.jsonl")


@pytest.fixture(autouse=True)
def _tag_commands(request: pytest.FixtureRequest) -> None:
    from atoll.commands import COMMAND_TAG

    os.environ[COMMAND_TAG] = request.node.nodeid


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.passed:
        _passed.add(report.nodeid)


def _missing_commands(log: pathlib.Path) -> list[str]:
    """`file::test (atoll COMMAND)` for each COVERAGE test that passed without running it."""
    from test_commands import COVERAGE

    ran = set()
    if log.exists():
        for line in log.read_text().splitlines():
            r = json.loads(line)
            name = r["command"] if r["table"] == "command" else f"{r['table']} {r['command']}"
            ran.add((r["tag"], name))
    prefix = HERE.relative_to(HERE.parents[1]).as_posix()  # tests/integration
    missing = []
    for command, tests in COVERAGE.items():
        for ref in filter(None, tests):
            nodeid = f"{prefix}/{ref}"
            if nodeid in _passed and (nodeid, command) not in ran:
                missing.append(f"{ref} (atoll {command})")
    return missing


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from atoll.commands import COMMAND_LOG

    if COMMAND_LOG not in os.environ:  # no test of this directory ran
        return
    missing = _missing_commands(pathlib.Path(os.environ[COMMAND_LOG]))
    if missing:
        writer = session.config.get_terminal_writer()
        writer.line(
            "test_commands.COVERAGE names tests that passed without running their command: "
            + "; ".join(missing),
            red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
