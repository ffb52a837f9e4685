"""The launcher's reliability requirements, each checked on a real run of a tiny script.

A failing rank raises one LaunchError that names it and quotes its Python error; a rank killed
with SIGKILL is named within 60 s; a timeout and a kernel interrupt kill every process of the run;
bad input is refused before anything starts. "No process left" is checked in the process table:
every process whose environment carries this test's tag (the launcher, the ranks, a grandchild
that escaped into a session of its own).
"""
import _thread
import os
import signal
import textwrap
import threading
import time
import uuid

import psutil
import pytest

import course_lib as cl
from course_lib.env import cpu_cores
from course_lib.workbook.launch_errors import failure_message

pytestmark = pytest.mark.timeout(120)


def tagged(tag: str) -> list:
    """Live processes whose environment carries COURSE_TEST_TAG=tag."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("COURSE_TEST_TAG") == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def script(tmp_path, body: str, name: str = "job.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def when(condition, then, limit: float = 90):
    """Run `then()` in a thread as soon as `condition()` holds."""
    def watch():
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if condition():
                return then()
            time.sleep(0.1)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def tag():
    return uuid.uuid4().hex


# Ranks that start, mark that they run, and then wait forever; one leaves a grandchild in a session of its own.
SLEEPER = """
    import os, subprocess, sys, time
    rank = int(os.environ["RANK"])
    if rank == 1:
        subprocess.Popen(["sleep", "600"], start_new_session=True)
    open(os.path.join(sys.argv[1], f"started{rank}"), "w").close()
    print(f"rank {rank} waiting", flush=True)
    time.sleep(600)
"""


# --- bad input: one clear line, nothing started -------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, words", [
    (dict(script="/nonexistent/train.py"), FileNotFoundError, "no such script"),
    (dict(nproc=0), ValueError, "nproc must be"),
    (dict(nproc=-3), ValueError, "nproc must be"),
    (dict(nproc=1.5), ValueError, "nproc must be"),
    (dict(nproc=True), ValueError, "nproc must be"),
    (dict(nproc=10_000), ValueError, "more ranks than this machine"),
    (dict(launcher="mpirun"), ValueError, "unknown launcher"),
    (dict(args="--steps 5"), TypeError, "args must be a list"),
    (dict(timeout=0), ValueError, "timeout must be"),
])
def test_bad_input_is_refused_with_one_line(tmp_path, kwargs, error, words):
    kwargs = {"script": script(tmp_path, "print('never runs')"), **kwargs}
    with pytest.raises(error, match=words) as err:
        cl.launch(kwargs.pop("script"), **kwargs)
    assert "\n" not in str(err.value)


def test_recipe_names_what_exists():
    with pytest.raises(FileNotFoundError, match="no recipe 'nope.py'"):
        cl.recipe("nope.py")


# --- success: streamed, rank-prefixed, result returned, threads set --------------------------------------

def test_success_streams_ranks_and_returns_the_result(tmp_path, tag, capsys):
    path = script(tmp_path, """
        import atexit, os, torch
        import course_lib as cl
        ctx = cl.dist.init()
        print(f"hello from {ctx.rank} of {ctx.world_size}", flush=True)
        ranks = cl.dist.gather(ctx.rank, ctx)
        if ctx.is_main:
            cl.dist.report({"ranks": ranks, "threads": torch.get_num_threads(),
                            "omp": os.environ["OMP_NUM_THREADS"], "backend": torch.distributed.get_backend()})
        cl.dist.close()
        atexit.register(print, f"atexit on {ctx.rank}")
        print(f"bye from {ctx.rank}", end="")  # no newline, no flush
        cl.dist.exit_now()  # as the recipes end: atexit handlers run, output flushed, exit code 0
    """)
    run = cl.launch(path, nproc=2, env={"COURSE_TEST_TAG": tag}, timeout=90)
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0 of 2" in out and "[rank 1] hello from 1 of 2" in out
    assert all(f"bye from {r}atexit on {r}" in out for r in (0, 1)), out
    expect_threads = max(1, cpu_cores() // 2)
    assert run.result == {"ranks": [0, 1], "threads": expect_threads, "omp": str(expect_threads), "backend": "gloo"}
    assert run.returncode == 0 and run.seconds > 0 and '"threads"' not in out  # a file, not a line of output
    assert not tagged(tag)


# --- failures: the rank, its error, fast, nothing left --------------------------------------------------

def test_a_rank_that_raises_is_named_with_its_python_error(tmp_path, tag):
    path = script(tmp_path, """
        import glob, os, time
        import course_lib as cl
        if os.environ["RANK"] == "1":
            while not glob.glob(os.path.join(os.environ["COURSE_RESULTS_DIR"], "*.json")):
                time.sleep(0.1)  # until rank 0 has reported
            def load_shard(i):
                raise ValueError(f"shard {i} is corrupt")
            load_shard(7)
        cl.dist.report({"rank": 0, "part": 1})  # what rank 0 reported before the failure
        time.sleep(120)
    """)
    with pytest.raises(cl.LaunchError) as err:
        cl.launch(path, nproc=2, env={"COURSE_TEST_TAG": tag}, timeout=90, quiet=True)
    text = str(err.value)
    assert text.startswith("job.py: rank 1 failed with exit code 1")
    assert "ValueError: shard 7 is corrupt" in text and "load_shard" in text
    assert err.value.run.seconds < 60
    assert err.value.run.results == [{"rank": 0, "part": 1}]  # what was reported before the failure is kept
    assert not tagged(tag)


def test_a_rank_that_aborts_in_native_code_shows_where_its_python_code_was(tmp_path, tag):
    """A C++ `std::terminate` ("terminate called without an active exception") raises no Python error; the
    launcher turns on faulthandler in the ranks, so the message still names the function that was running."""
    path = script(tmp_path, """
        import os, time
        if os.environ["RANK"] == "1":
            def write_shard(i):
                os.abort()  # what std::terminate does to the process
            write_shard(3)
        time.sleep(120)
    """)
    with pytest.raises(cl.LaunchError) as err:
        cl.launch(path, nproc=2, env={"COURSE_TEST_TAG": tag}, timeout=90, quiet=True)
    text = str(err.value)
    assert text.startswith("job.py: rank 1 failed with exit code -6 (SIGABRT)"), text
    assert "Fatal Python error: Aborted" in text and "in write_shard" in text, text
    assert not tagged(tag)


def test_kill_9_of_one_rank_mid_training_is_named_within_60_s(tmp_path, tag):
    path = script(tmp_path, """
        import os, sys, time, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        rank, w = dist.get_rank(), torch.nn.Parameter(torch.zeros(1000))
        opt = torch.optim.SGD([w], lr=0.1)
        for step in range(100_000):
            (w - rank).pow(2).sum().backward()
            dist.all_reduce(w.grad)
            opt.step(); opt.zero_grad()
            if step == 20:
                open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
            time.sleep(0.01)
    """)
    pid_file, killed_at = tmp_path / "pid1", []

    def kill_rank_1():
        killed_at.append(time.monotonic())
        os.kill(int(pid_file.read_text()), signal.SIGKILL)

    when(lambda: pid_file.exists() and pid_file.read_text(), kill_rank_1)
    with pytest.raises(cl.LaunchError) as err:
        cl.launch(path, [tmp_path], nproc=2, env={"COURSE_TEST_TAG": tag}, timeout=100, quiet=True)
    assert killed_at, "rank 1 never reached step 20"
    print(f"LaunchError {time.monotonic() - killed_at[0]:.1f} s after the kill")
    assert time.monotonic() - killed_at[0] < 60
    assert str(err.value).startswith("job.py: rank 1 failed with exit code -9 (SIGKILL)")
    assert not tagged(tag)


def test_timeout_kills_every_process_of_the_run(tmp_path, tag):
    path = script(tmp_path, SLEEPER)
    start = time.monotonic()
    with pytest.raises(cl.LaunchError, match="timed out after 15 s") as err:
        cl.launch(path, [tmp_path], nproc=2, env={"COURSE_TEST_TAG": tag}, timeout=15, quiet=True)
    assert time.monotonic() - start < 30
    assert (tmp_path / "started0").exists() and (tmp_path / "started1").exists(), "ranks never started: raise the timeout"
    assert "rank 1 waiting" in "\n".join(err.value.run.lines)
    assert not tagged(tag)


def test_kernel_interrupt_kills_every_process_of_the_run(tmp_path, tag):
    # A Jupyter kernel turns SIGINT into KeyboardInterrupt. So does a foreground pytest, but one started
    # with `&` from a script inherits SIGINT ignored, and then interrupt_main() does nothing: give it
    # the kernel's handler for this test.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupt_the_launch(tmp_path, tag)
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupt_the_launch(tmp_path, tag):
    path = script(tmp_path, SLEEPER)
    started = [tmp_path / "started0", tmp_path / "started1"]
    when(lambda: all(p.exists() for p in started) and len(tagged(tag)) >= 4, _thread.interrupt_main)
    with pytest.raises(KeyboardInterrupt):
        cl.launch(path, [tmp_path], nproc=2, env={"COURSE_TEST_TAG": tag}, timeout=90, quiet=True)
    assert all(p.exists() for p in started)
    assert not tagged(tag)


# --- in the background (wait=False): chapter 11 runs CPU ranks while its kernel drives the GPU -------------

def test_in_the_background_the_kernel_goes_on_and_wait_shows_the_output_and_the_result(tmp_path, tag, capsys):
    with pytest.raises(FileNotFoundError, match="no such script"):  # bad input: refused at once, as with wait=True
        cl.launch(tmp_path / "nope.py", nproc=2, wait=False)
    path = script(tmp_path, """
        import course_lib as cl
        ctx = cl.dist.init()
        print(f"hello from {ctx.rank}", flush=True)
        if ctx.is_main:
            cl.dist.report({"world": ctx.world_size})
        cl.dist.close()
        cl.dist.exit_now()
    """)
    start = time.monotonic()
    job = cl.launch(path, nproc=2, env={"COURSE_TEST_TAG": tag}, timeout=90, wait=False)
    assert time.monotonic() - start < 5 and not job.done()  # returned while the ranks start
    while not job.done():  # the kernel's own work meanwhile; the ranks' lines wait for wait()
        time.sleep(0.2)
    assert "[rank" not in capsys.readouterr().out
    run = job.wait()
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out and '"world"' not in out
    assert run.result == {"world": 2} and run.returncode == 0 and not tagged(tag)


def test_a_failure_in_the_background_is_raised_by_wait(tmp_path, tag):
    path = script(tmp_path, """
        import os
        if os.environ["RANK"] == "1":
            raise ValueError("bad shard 7")
    """)
    job = cl.launch(path, nproc=2, env={"COURSE_TEST_TAG": tag}, timeout=60, quiet=True, wait=False)
    with pytest.raises(cl.LaunchError, match="rank 1") as err:
        job.wait()
    assert "ValueError: bad shard 7" in str(err.value) and not tagged(tag)


def test_interrupting_wait_kills_every_process_of_the_background_run(tmp_path, tag):
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in the test above
    try:
        path = script(tmp_path, SLEEPER)
        started = [tmp_path / "started0", tmp_path / "started1"]
        job = cl.launch(path, [tmp_path], nproc=2, env={"COURSE_TEST_TAG": tag}, timeout=90, quiet=True, wait=False)
        when(lambda: all(p.exists() for p in started) and len(tagged(tag)) >= 4, _thread.interrupt_main)
        with pytest.raises(KeyboardInterrupt):
            job.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert job.done() and not tagged(tag)


def test_deepspeed_launcher_names_the_failing_rank(tmp_path, tag):
    path = script(tmp_path, """
        import os, time  # (the deepspeed launcher passes --local_rank=N: ignored here)
        if os.environ["RANK"] == "1":
            raise KeyError("missing key on rank one")
        time.sleep(120)
    """)
    with pytest.raises(cl.LaunchError) as err:
        cl.launch(path, nproc=2, launcher="deepspeed", env={"COURSE_TEST_TAG": tag}, timeout=90, quiet=True)
    text = str(err.value)
    assert text.startswith("job.py: rank 1 failed with exit code 1") and "KeyError: 'missing key on rank one'" in text
    assert not tagged(tag)


# --- the failure analysis, on output shaped like a real gloo run (torchrun named the wrong rank) ---------------------------------------

GLOO_RAISE = """\
[default1]:[rank1]: Traceback (most recent call last):
[default1]:[rank1]:   File "/tmp/raise1.py", line 8, in <module>
[default1]:[rank1]:     raise ValueError("rank one is unhappy")
[default1]:[rank1]: ValueError: rank one is unhappy
[default0]:[rank0]: Traceback (most recent call last):
[default0]:[rank0]:   File "/tmp/raise1.py", line 9, in <module>
[default0]:[rank0]:     work.wait()
[default0]:[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:11150. This is typically caused by a remote worker crashing.
W1130 10:57:29.282000 8095 api.py:1028] Sending process 8314 closing signal SIGTERM
Failures:
[1]:
  time      : 2026-11-30_10:57:29
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 8314)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_10:57:29
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 8315)
  error_file: <N/A>
"""


def test_root_cause_is_the_rank_with_its_own_error_not_the_launchers_guess():
    text = failure_message("raise1.py", GLOO_RAISE.splitlines(), 1)
    assert text.splitlines()[0] == "raise1.py: rank 1 failed"
    assert "ValueError: rank one is unhappy" in text and "then rank 0 (exit code -6 (SIGABRT))" in text


ABORT_AT_EXIT = """\
[default1]:terminate called without an active exception
[default1]:Fatal Python error: Aborted
[default1]:
[default1]:Thread 0x00007f0000000001 (most recent call first):
[default1]:  File "/usr/lib/python3.11/threading.py", line 320 in wait
[default1]:
[default1]:Current thread 0x00007f0000000002 (most recent call first):
[default1]:  <no Python frame>
[default1]:
[default1]:Extension modules: numpy.core._multiarray_umath, torch._C (total: 2)
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_16:00:00
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 4242)
  error_file: <N/A>
"""


def test_an_abort_outside_python_code_says_so():
    """faulthandler's dump, read: the thread that was running had no Python frame (a C++ thread, or the
    interpreter shutting down), not the frames of the other threads."""
    text = failure_message("job.py", ABORT_AT_EXIT.splitlines(), 1)
    assert text.splitlines()[0] == "job.py: rank 1 failed with exit code -6 (SIGABRT)"
    assert "Fatal Python error: Aborted" in text and "<no Python frame>" in text and "threading.py" not in text


def test_a_launcher_failure_before_any_rank_is_reported_as_such():
    text = failure_message("x.py", ["usage: torchrun ...", "torchrun: error: unrecognized arguments"], 2)
    assert text.startswith("x.py: the launcher exited with code 2") and "unrecognized arguments" in text


def test_a_frozen_rank_is_reported_when_the_teardown_stalls():
    lines = ["[default0]:Traceback (most recent call last):", '[default0]:  File "x.py", line 6, in <module>',
             "[default0]:RuntimeError: [unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"]
    text = failure_message("x.py", lines, -9, stuck={1: "stopped"})
    assert text.startswith("x.py: rank 0 failed") and "Timed out waiting" in text
    assert "rank 1 never exited (stopped)" in text
