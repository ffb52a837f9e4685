"""Launch a distributed recipe from a notebook with `torchrun` or the `deepspeed` launcher.

    cfg = ddp.Config.from_preset(P, steps=5)      # a recipe's typed config (course_lib.config)
    run = cl.launch(cfg, nproc=2)                   # runs the recipe that defines it, with cfg.to_argv()
    run.result          # the dict the script reported with `cl.dist.report(...)`
    cl.launch(path, ["--flag", "value"], nproc=2)   # any other script, with a plain argument list
    job = cl.launch(cfg, nproc=2, wait=False)       # in the background; job.wait() shows its output, returns the Run

What a `!torchrun` cell does not give you, this does: the ranks' output streams into the cell
with each line's rank in front; a failing rank raises one `LaunchError` naming the rank, its exit
code and its Python error; a hard timeout; and every process of the run is killed at the end,
even after a crash, a timeout or a kernel interrupt. The launcher runs in a session of its own and
every process of the run carries a marker in its environment (COURSE_LAUNCH_ID), so the sweep
finds the ranks even where the launcher gave them sessions of their own. Introduced in chapter 05;
chapters 06, 07, 08, 10, 11 and 12 launch through it.
"""
from __future__ import annotations

import os
import queue
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..env import cpu_cores, cuda_count, gpus_hidden, quiet_env, rank_threads
from ..parallel.dist import CPU_RANKS_VAR, LAUNCH_ID_VAR, PARENT_PID_VAR, RESULTS_VAR, read_results
from .launch_errors import excerpt, failure_message, split_rank

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
LAUNCHERS = ("torchrun", "deepspeed")
TEARDOWN_GRACE_S = 10  # after the launcher starts tearing a failed run down, wait this long, then kill

_TEARDOWN = re.compile(r"closing signal SIGTERM|sigkill_handler\] Killing subprocess|sigkill_handler\] .* exits with return code")
_PORT_TAKEN = re.compile(r"EADDRINUSE|[Aa]ddress already in use")
# The deepspeed launcher's notices that say nothing on one machine: kept in `Run.lines`, not printed. (Started
# without --hostfile, it looks for /job/hostfile and warns that it will use this machine's resources, which is the plan.)
_LAUNCHER_NOTICE = re.compile(r"Unable to find hostfile, will proceed with training with local resources only")


class LaunchError(RuntimeError):
    """A distributed run failed: the message names the rank, its exit code and its Python error;
    `.run` holds the `Run` so far (its `.lines` are the whole output)."""

    def __init__(self, message: str, run: "Run | None" = None):
        super().__init__(message)
        self.run = run


@dataclass
class Run:
    command: list[str]
    returncode: int = 0
    seconds: float = 0.0
    results: list[dict] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    launch_id: str = ""
    stuck: dict = field(default_factory=dict)  # {rank: process state} of ranks that never exited after a failure

    @property
    def result(self) -> dict | None:
        """The last result a rank reported (recipes report from rank 0)."""
        return self.results[-1] if self.results else None


def recipe(name: str) -> Path:
    """The path of a recipe script shipped in course_lib/recipes/ (e.g. `cl.recipe("ddp.py")`)."""
    path = RECIPES / name
    if not path.is_file():
        have = ", ".join(sorted(p.name for p in RECIPES.glob("*.py"))) or "none"
        raise FileNotFoundError(f"no recipe {name!r} in {RECIPES} (have: {have})")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_gpus(env: dict | None = None) -> int:
    """The GPUs the ranks will see: none where `env` hides them (`cl.presets.ranks_plan` on one GPU), else this
    machine's."""
    return 0 if gpus_hidden({**os.environ, **(env or {})}) else cuda_count()


def build_command(script: Path, args: list[str], nproc: int, launcher: str, port: int, gpus: int | None = None) -> list[str]:
    py = sys.executable  # never PATH's `torchrun`: under papermill PATH is not the venv's
    if launcher == "torchrun":
        return [py, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
                "--master-addr=127.0.0.1", f"--master-port={port}", "--tee=3", str(script), *args]
    # The deepspeed launcher counts accelerators; on a CPU machine it starts one process unless told.
    gpus = cuda_count() if gpus is None else gpus
    count = ["--num_gpus", str(nproc)] if gpus else ["--num_accelerators", str(nproc)]
    # --log_level=warning: the launcher's INFO lines (its command lines, world info, "exits successfully") stay out
    return [py, "-m", "deepspeed.launcher.runner", *count, "--log_level=warning", "--master_addr", "127.0.0.1",
            "--master_port", str(port), str(script), *args]


def launch(script, args: list | tuple = (), nproc: int = 2, launcher: str = "torchrun",
           timeout: float = 600, env: dict | None = None, quiet: bool = False, wait: bool = True,
           oversubscribe: bool = False) -> Run | Background:
    """Run `script` on `nproc` ranks; stream its output; return a `Run` or raise `LaunchError`. `wait=False`: start
    it and return at once a `Background` (below) whose `.wait()` shows the output and returns the
    `Run` (chapter 11: CPU ranks beside the GPU's rows). Bad input raises at once either way. `oversubscribe`: CPU
    ranks may outnumber the cores (the build checks' three ranks of tiny tensors, where the number of ranks matters).

    `script` is a recipe's config (its recipe runs with `script.to_argv()` then `args`) or a path.
    `env` adds variables for the ranks (a value of None removes one). OMP_NUM_THREADS defaults to
    the cores divided among the ranks, so 2 ranks on 2 cores do not oversubscribe them; CPU ranks beside a GPU, one
    each (`cl.env.rank_threads`). CPU ranks see no GPU whatever the launcher sets (`cl.dist.hide_gpus`). The ranks run quiet
    (`cl.env.quiet_env`: no library deprecation warnings), unless the environment says otherwise.
    """
    if hasattr(script, "to_argv"):  # a RecipeConfig
        script, args = type(script).script(), [*script.to_argv(), *args]
    gpus = ranks_gpus(env)  # env={"CUDA_VISIBLE_DEVICES": ""}: CPU ranks (gloo) on a GPU machine
    script = _check_input(script, args, nproc, launcher, timeout, gpus, oversubscribe)
    extra = {k: v for k, v in (env or {}).items()}
    # PYTHONFAULTHANDLER: a rank killed by a signal (a C++ abort, a segfault) prints where its Python code was
    run_env = {"PYTHONFAULTHANDLER": "1", **os.environ, **quiet_env(), "PYTHONUNBUFFERED": "1",
               "COURSE_BACKEND": "nccl" if gpus else "gloo",
               **({} if gpus else {"DS_ACCELERATOR": "cpu", CPU_RANKS_VAR: "1"}),
               "OMP_NUM_THREADS": str(rank_threads(nproc, cpu_cores(), beside_gpu=not gpus and cuda_count() > 0)),
               "TOKENIZERS_PARALLELISM": "false",
               PARENT_PID_VAR: str(os.getpid())}
    for key, value in extra.items():
        if value is None:
            run_env.pop(key, None)
        else:
            run_env[key] = str(value)

    def attempt(emit, stop) -> Run:
        for retry in range(2):  # another launch may grab our free port before torchrun binds it: retry once
            run = _launch_once(script, [str(a) for a in args], nproc, launcher, timeout, run_env, quiet, gpus, emit, stop)
            if run.returncode == 0 or retry or not _PORT_TAKEN.search("\n".join(run.lines)) or run.results:
                break
            if not quiet:
                emit("[launch] port taken by another process; retrying on a new port")
        if run.returncode != 0:
            raise LaunchError(failure_message(script.name, run.lines, run.returncode, run.stuck), run)
        return run

    return attempt(_print, None) if wait else Background(attempt)


def _print(line: str) -> None:
    print(line, flush=True)


class Background:
    """Work that runs in a thread of its own while the notebook goes on; its output is shown when you wait for it.

        job = cl.launch(cfg, nproc=2, env=plan.env, wait=False)  # returns at once (chapter 11 on one GPU: CPU ranks
        ...                                                      # run while the GPU runs the cells in between)
        run = job.wait()    # prints the ranks' lines (those so far, then as they come); the Run, or its LaunchError

    Runs `work(emit, stop)` in a daemon thread: `emit(line)` queues a line for `wait()` to print; `stop` is a
    `threading.Event` the work checks now and then and ends on. Why the work does not print itself: a line printed
    from another thread lands in whichever cell runs at that moment. So the work hands its lines to `emit`, and
    `wait()` prints them in the cell that waits. Interrupting `wait()` sets `stop`, which the work checks (a launch
    then kills every process of its run), and lets the interrupt through."""

    def __init__(self, work):
        self.lines, self.stop = queue.Queue(), threading.Event()
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True)
        self._thread.start()

    def _run(self, work) -> None:
        try:
            self._result = work(self.lines.put, self.stop)
        except BaseException as e:  # noqa: BLE001  handed to the caller by wait()
            self._error = e

    def done(self) -> bool:
        """Whether the work has ended (its lines may still wait to be printed)."""
        return not self._thread.is_alive()

    def wait(self):
        """Print the work's lines until it ends; return its result, or raise its error."""
        try:
            while not self.done() or not self.lines.empty():
                try:
                    print(self.lines.get(timeout=0.2), flush=True)
                except queue.Empty:
                    pass
        except BaseException:  # a kernel interrupt: stop the work (it cleans up after itself), then go on raising
            self.stop.set()
            self._thread.join(60)
            raise
        if self._error is not None:
            raise self._error
        return self._result


def _check_input(script, args, nproc, launcher, timeout, gpus: int, oversubscribe: bool = False) -> Path:
    """Refuse bad input with one clear line, before anything starts."""
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"no such script: {path} (shipped recipes: cl.recipe(name))")
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a whole number >= 1, got {nproc!r}")
    most = gpus or cpu_cores()
    if nproc > most and not (oversubscribe and not gpus):
        where = f"{gpus} GPUs" if gpus else f"{cpu_cores()} CPU cores"
        raise ValueError(f"nproc={nproc} is more ranks than this machine can run ({where}: at most {most})")
    if isinstance(args, (str, bytes)) or not isinstance(args, (list, tuple)):
        raise TypeError(f"args must be a list of command-line arguments, got {type(args).__name__}: {args!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return path


def _launch_once(script: Path, args: list[str], nproc: int, launcher: str, timeout: float, env: dict,
                 quiet: bool, gpus: int, emit=_print, stop=None) -> Run:
    launch_id = uuid.uuid4().hex
    command = build_command(script, args, nproc, launcher, free_port(), gpus)
    run = Run(command, launch_id=launch_id)
    results = tempfile.mkdtemp(prefix="course-results-")  # what the ranks report (`cl.dist.report`): a file each
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**env, LAUNCH_ID_VAR: launch_id, RESULTS_VAR: results}, start_new_session=True)
    printer = _Printer(run, quiet, emit)
    try:
        why = _pump(proc, printer, deadline=start + timeout, stop=stop)
        if why in ("timeout", "stopped"):
            kill_run(proc, launch_id)
            printer.drain(proc)
            what = f"timed out after {timeout:g} s" if why == "timeout" else "stopped"
            raise LaunchError(f"{script.name}: {what}; every process of the run was killed\n" + excerpt(run.lines), run)
        if why == "stuck":  # a failed run the launcher could not tear down (e.g. a frozen rank)
            run.stuck = _rank_states(launch_id)
            kill_run(proc, launch_id)
            printer.drain(proc)
        try:  # the output has ended; the launcher itself should be gone in a moment
            run.returncode = proc.wait(max(5.0, start + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_run(proc, launch_id)
            raise LaunchError(f"{script.name}: the launcher closed its output but did not exit within the "
                              f"timeout ({timeout:g} s); every process of the run was killed\n" + excerpt(run.lines), run)
    finally:  # success, failure, timeout or KeyboardInterrupt: never leave a process of the run behind
        kill_run(proc, launch_id)
        proc.stdout.close()
        run.seconds = time.monotonic() - start
        run.results = read_results(results)  # what was reported before a failure counts too
        shutil.rmtree(results, ignore_errors=True)
    if why == "stuck" and run.returncode == 0:
        run.returncode = -9
    return run


def _pump(proc: subprocess.Popen, printer: "_Printer", deadline: float, stop=None) -> str:
    """Stream the run's output until it ends ("done"), the deadline passes ("timeout"), a failed run stays up
    after the launcher began its teardown ("stuck"), or `stop` is set ("stopped"). In the caller's thread, a
    kernel interrupt lands here; in a `Background`'s, its `wait()` sets `stop`."""
    fd = proc.stdout.fileno()
    exited_at = None
    while True:
        now = time.monotonic()
        if now >= deadline:
            return "timeout"
        if stop is not None and stop.is_set():
            return "stopped"
        if printer.teardown_at and now - printer.teardown_at > TEARDOWN_GRACE_S:
            return "stuck"
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 5:  # launcher gone, a leftover holds the pipe
            printer.feed(b"", final=True)
            return "done"
        ready, _, _ = select.select([fd], [], [], min(0.5, deadline - now))
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                printer.feed(b"", final=True)
                return "done"
            printer.feed(chunk)


class _Printer:
    """Splits the output into lines: records them, prints them rank-prefixed."""

    def __init__(self, run: Run, quiet: bool, emit=_print):
        self.run, self.quiet, self.emit, self.buffer, self.teardown_at = run, quiet, emit, b"", None
        self.hide_launcher_traceback = False

    def feed(self, chunk: bytes, final: bool = False) -> None:
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        if final and self.buffer:
            lines, self.buffer = lines + [self.buffer], b""
        for raw in lines:
            self.line(raw.decode("utf-8", errors="replace").rstrip("\r"))

    def drain(self, proc: subprocess.Popen) -> None:
        """Read what is left in the pipe after the run was killed (without blocking for long)."""
        fd = proc.stdout.fileno()
        while select.select([fd], [], [], 1.0)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            self.feed(chunk)
        self.feed(b"", final=True)

    def line(self, line: str) -> None:
        self.run.lines.append(line)
        rank, body = split_rank(line)
        if rank is None and _TEARDOWN.search(body) and self.teardown_at is None:
            self.teardown_at = time.monotonic()
        if rank is None and body.startswith("Traceback") and self.teardown_at:
            self.hide_launcher_traceback = True  # the launcher's own ChildFailedError: summarized in LaunchError
        if self.quiet or (rank is None and (self.hide_launcher_traceback or _LAUNCHER_NOTICE.search(body))):
            return
        self.emit(f"[rank {rank}] {body}" if rank is not None else body)


def _rank_states(launch_id: str) -> dict:
    """{rank: psutil status} of the run's rank processes still alive (a frozen rank shows "stopped")."""
    import psutil

    states = {}
    for p in run_processes(launch_id):
        try:
            if "RANK" in (env := p.environ()) and "LOCAL_RANK" in env:
                states[int(env["RANK"])] = p.status()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return states


def run_processes(launch_id: str) -> list:
    """Every live process started by the launch with this id (found by its environment marker)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get(LAUNCH_ID_VAR) == launch_id:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def kill_run(proc: subprocess.Popen, launch_id: str) -> None:
    """SIGKILL the launcher's process group, then every process carrying the run's marker, until none is left."""
    import psutil

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(5):  # a rank may have forked (data-loader workers) while we swept
        left = run_processes(launch_id)
        if not left:
            break
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=3)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass

