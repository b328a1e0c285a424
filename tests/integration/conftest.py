"""Every test under tests/integration/ is marked `integration` (real servers and processes):
`make test-fast` deselects them with `-m "not e2e and not integration"`. The marker is
registered here, beside the tests it marks (pyproject.toml holds the suite-wide ones)."""

from __future__ import annotations

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
