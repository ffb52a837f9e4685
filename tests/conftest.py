"""Shared test setup: ledgers go to build/, and the notebook times are printed at the end."""
import os

import pytest

from course_lib.results import REPO_ROOT

os.environ.setdefault("COURSE_BUILD_DIR", str(REPO_ROOT / "build"))
NOTEBOOK_TIMES: list[tuple[str, str, float]] = []


@pytest.fixture
def notebook_times():
    return NOTEBOOK_TIMES


def pytest_terminal_summary(terminalreporter):
    if NOTEBOOK_TIMES:
        terminalreporter.section("notebook times (cpu profile)")
        for name, status, seconds in NOTEBOOK_TIMES:
            terminalreporter.write_line(f"{name:45s} {status:7s} {seconds:7.1f} s")
        terminalreporter.write_line(f"{'total':45s} {'':7s} {sum(t for _, _, t in NOTEBOOK_TIMES):7.1f} s")
