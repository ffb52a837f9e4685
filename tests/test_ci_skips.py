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
