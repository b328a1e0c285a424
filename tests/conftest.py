"""Suite-wide hooks. With ATOLL_NO_SKIPS set (`.ci/run` sets it) a skipped test fails: a runner
that lacks what a test needs (kubectl, network namespaces) must not pass by checking nothing."""

from __future__ import annotations

import os

import pytest

NO_SKIPS = "ATOLL_NO_SKIPS"  # "1": every skip is a failure that names the skip's reason


@pytest.fixture(scope="session", autouse=True)
def _jax_compile_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The child processes that run JAX (learners, benches, the examples) share one
    persistent compilation cache for the session: the same tiny models compile once, not
    in every process (an `atoll learner --preset tiny` of 20 steps: 4.9 s of CPU cold,
    1.6 s warm). Compiled programs are the same programs, so nothing a test checks moves;
    a variable already set (a developer's own cache) is kept."""
    cache = tmp_path_factory.getbasetemp() / "jax-compile-cache"
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache))
    # `atoll up` and `atoll chaos` give their learners a cache of the run's own unless
    # ATOLL_COMPILE_CACHE names one: the session's, so their runs compile once too
    os.environ.setdefault("ATOLL_COMPILE_CACHE", os.environ["JAX_COMPILATION_CACHE_DIR"])
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _no_skips() -> bool:
    return os.environ.get(NO_SKIPS, "") not in ("", "0")


def _failed_instead(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Turns a skipped report into a failed one, in place, keeping the skip's reason."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped while {NO_SKIPS} is set (CI runs every test): {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report: pytest.TestReport = yield
    # an xfail is reported as skipped too; it is the test's own claim, not a missing tool
    if report.skipped and not hasattr(report, "wasxfail") and _no_skips():
        _failed_instead(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport:
    report: pytest.CollectReport = yield
    if report.skipped and _no_skips():  # a module-level skip or importorskip
        _failed_instead(report)
    return report
