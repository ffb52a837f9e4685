"""Launch a distributed recipe from a notebook with `torchrun` or the `deepspeed` launcher.

    run = cl.launch("course_lib/recipes/ddp.py", ["--steps", "5"], nproc=2)
    run.result          # the dict the script reported with `cl.dist.report(...)`

What a `!torchrun` cell does not give you, this does: the ranks' output streams into the cell
with each line's rank in front; a failing rank raises one `LaunchError` naming the rank, its exit
code and the end of its traceback; a hard timeout; and every process of the run is killed at the
end, even after a crash, a timeout or a kernel interrupt (workers run in sessions of their own, so
they are found by a marker in their environment, not by process group). Introduced in chapter 05;
chapters 06, 07, 08, 10, 11 and 12 launch through it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

RECIPES = Path(__file__).resolve().parent / "recipes"
RESULT_TAG = "COURSE_RESULT "
LAUNCH_ID_VAR = "COURSE_LAUNCH_ID"
LAUNCHERS = ("torchrun", "deepspeed")
_RANK_PREFIX = re.compile(r"^\[(?:default)?(\d+)\]:")  # torchrun --tee prefixes "[default1]:"


class LaunchError(RuntimeError):
    """A distributed run failed: the message names the rank, its exit code and its last lines."""


@dataclass
class Run:
    command: list[str]
    returncode: int = 0
    seconds: float = 0.0
    results: list[dict] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

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


def max_ranks() -> int:
    """How many ranks this machine can run: one per GPU, or one per CPU core without GPUs."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else (os.cpu_count() or 1)


def build_command(script: Path, args: list[str], nproc: int, launcher: str, port: int) -> list[str]:
    py = sys.executable  # never PATH's `torchrun`: under papermill PATH is not the venv's
    if launcher == "torchrun":
        return [py, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
                "--master-addr=127.0.0.1", f"--master-port={port}", "--tee=3", str(script), *args]
    # The deepspeed launcher counts accelerators; on a CPU machine it starts one process unless told.
    count = ["--num_gpus", str(nproc)] if _has_cuda() else ["--num_accelerators", str(nproc)]
    return [py, "-m", "deepspeed.launcher.runner", *count, "--master_addr", "127.0.0.1",
            "--master_port", str(port), str(script), *args]


def launch(script: str | os.PathLike, args: list | tuple = (), nproc: int = 2, launcher: str = "torchrun",
           timeout: float = 600, env: dict | None = None, quiet: bool = False) -> Run:
    """Run `script` on `nproc` ranks; stream its output; return a `Run` or raise `LaunchError`."""
    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"no such recipe script: {script}")
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a whole number >= 1, got {nproc!r}")
    if nproc > max_ranks():
        raise ValueError(f"nproc={nproc} is more ranks than this machine can run ({max_ranks()})")

    launch_id = uuid.uuid4().hex
    run_env = {**os.environ, **(env or {}), LAUNCH_ID_VAR: launch_id, "PYTHONUNBUFFERED": "1",
               "COURSE_BACKEND": "nccl" if _has_cuda() else "gloo"}
    run_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    run_env.setdefault("TOKENIZERS_PARALLELISM", "false")
    command = build_command(script, [str(a) for a in args], nproc, launcher, free_port())
    run = Run(command)
    tails: dict[int | None, deque] = defaultdict(lambda: deque(maxlen=25))

    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=run_env,
                            text=True, bufsize=1, start_new_session=True)
    reader = threading.Thread(target=_read, args=(proc, run, tails, quiet), daemon=True)
    reader.start()
    try:
        reader.join(timeout)
        if reader.is_alive():
            _kill_run(proc, launch_id)
            reader.join(5)
            raise LaunchError(f"{script.name}: timed out after {timeout:.0f} s; all ranks killed\n" + _tail(tails, None))
        run.returncode = proc.wait()
    except BaseException:  # a kernel interrupt too: never leave ranks behind
        _kill_run(proc, launch_id)
        raise
    finally:
        run.seconds = time.monotonic() - start
        _kill_run(proc, launch_id)
    if run.returncode != 0:
        raise LaunchError(_failure_message(script, run, tails))
    return run


def _read(proc, run: Run, tails, quiet: bool) -> None:
    for line in proc.stdout:
        line = line.rstrip("\n")
        m = _RANK_PREFIX.match(line)
        rank = int(m.group(1)) if m else None
        body = line[m.end():] if m else line
        run.lines.append(line)
        tails[rank].append(body)
        if RESULT_TAG in body:
            run.results.append(json.loads(body.split(RESULT_TAG, 1)[1]))
            continue
        if not quiet:
            print(f"[rank {rank}] {body}" if m else body, flush=True)
    proc.stdout.close()


def _failure_message(script: Path, run: Run, tails) -> str:
    text = "\n".join(run.lines)
    ranks = re.findall(r"rank\s*:\s*(\d+)", text)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", text)
    if not ranks:  # the deepspeed launcher: "... rank=1 ... exits with return code = -9"
        found = re.findall(r"rank=(\d+)[^\n]*return code = (-?\d+)", text)
        ranks, codes = [r for r, _ in found], [c for _, c in found]
    rank = int(ranks[0]) if ranks else None
    code = codes[0] if codes else run.returncode
    who = f"rank {rank}" if rank is not None else "a rank"
    signal_name = ""
    if str(code).startswith("-") and int(code) < 0:
        signal_name = f" ({signal.Signals(-int(code)).name})"
    return f"{script.name}: {who} failed with exit code {code}{signal_name}\n" + _tail(tails, rank)


def _tail(tails, rank) -> str:
    lines = list(tails.get(rank) or []) or [ln for q in tails.values() for ln in q][-25:]
    return "\n".join(f"  | {ln}" for ln in lines[-15:])


def run_processes(launch_id: str) -> list:
    """Every live process started by the launch with this id (found by its environment marker)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get(LAUNCH_ID_VAR) == launch_id:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _kill_run(proc: subprocess.Popen, launch_id: str) -> None:
    import psutil

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in run_processes(launch_id):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
