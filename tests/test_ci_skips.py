"""Under CI a skip is a failure unless tests/conftest.py lists it with its reason: probed on a throwaway suite that
uses this suite's conftest.py."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = '''
import pytest

def test_passes():
    pass

def test_needs_a_tool():
    pytest.skip("no such tool here")

def test_cpu_image_builds_and_the_workbook_passes_inside_it():
    pytest.skip("SKIPPED on purpose: run as its own step")
'''


@pytest.fixture
def probe(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)

    def run(ci: str | None, *select) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")}
        if ci is not None:
            env["CI"] = ci
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                               "--rootdir", str(tmp_path), *(f"test_probe.py::{s}" for s in select)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return run


def test_a_skip_fails_under_ci_and_an_allowed_one_does_not(probe):
    done = probe("true")
    assert done.returncode == 1, done.stdout[-2000:]
    assert "1 failed, 1 passed, 1 skipped" in done.stdout and "skipped under CI" in done.stdout, done.stdout[-2000:]
    assert "test_needs_a_tool" in done.stdout and "no such tool here" in done.stdout


def test_outside_ci_a_skip_is_a_skip(probe):
    done = probe(None)
    assert done.returncode == 0 and "1 passed, 2 skipped" in done.stdout, done.stdout[-1500:]


def test_what_counts_as_ci():
    from conftest import under_ci

    for value, ci in ((None, False), ("", False), ("0", False), ("false", False), ("1", True), ("true", True)):
        os.environ.pop("CI", None)
        if value is not None:
            os.environ["CI"] = value
        assert under_ci() is ci, value


GROUPED = '''
import os
import pytest

pytestmark = pytest.mark.xdist_group("one")

@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    print("worker", os.environ["PYTEST_XDIST_WORKER"])
'''


def test_an_xdist_group_runs_in_one_worker(tmp_path):
    """`make test` relies on xdist_group (chapters that read each other's output, runs made once for a module): with
    two workers and `--dist loadgroup`, a group's tests all run in one worker. pytest 9.2 with pytest-xdist 3.8 drops
    the group silently (each test then goes to any worker)."""
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-rA", "-s", "-q",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "test_grouped.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
    assert done.stdout.count("@one") == 6, done.stdout[-2000:]  # the group's mark on each test's id
