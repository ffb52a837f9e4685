"""Inside a distributed recipe: set up the process group, print once, report a result.

One code path for 1 or N processes (as in nanoGPT): without `torchrun`'s environment, `init()`
returns rank 0 of 1 and nothing is initialized. Introduced in chapter 05; every recipe in
`course_lib/recipes/` starts with `ctx = cl.dist.init()`. The launcher (`cl.launch`) and the ranks agree on the
names below: the launcher imports them from here, a rank never imports the launcher.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..env import cuda_usable

RESULTS_VAR = "COURSE_RESULTS_DIR"  # the folder `cl.launch` gives a run for what its ranks report, a JSON file each
LAUNCH_ID_VAR = "COURSE_LAUNCH_ID"  # every process of one launch carries it: the sweep finds them all
PARENT_PID_VAR = "COURSE_PARENT_PID"  # the notebook kernel's pid: a rank exits when it dies
CPU_RANKS_VAR = "COURSE_CPU_RANKS"  # "1": the launcher meant these ranks for the CPU; no GPU is theirs (hide_gpus)


def hide_gpus() -> None:
    """A rank `cl.launch` meant for the CPU (CPU_RANKS_VAR) sees no GPU, whatever its launcher wrote. DeepSpeed's
    per-node launcher (deepspeed/launcher/launch.py) sets CUDA_VISIBLE_DEVICES to its accelerator ids for every
    accelerator, the CPU's included: "0,1" over the plan's "" on a one-GPU machine, and rank 1 would then ask for
    cuda:1. Run when this module is imported (`import course_lib`, before a rank's first CUDA call, which reads the
    variable) and again in `init`; `cl.env.cuda_usable` reads the variable, so the device is the CPU even where
    CUDA had started."""
    if os.environ.get(CPU_RANKS_VAR) == "1":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


hide_gpus()


@dataclass
class Context:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(timeout_s: float | None = None, group_of_one: bool = False) -> Context:
    """Join the process group the launcher set up (gloo on CPU, nccl on GPU), or run alone.

    A frozen peer would otherwise hang the others for PyTorch's default 30 minutes; the timeout
    (COURSE_DIST_TIMEOUT, default 120 s) makes a collective fail instead. `group_of_one=True`
    builds a process group even for a single process (DistributedDataParallel needs one).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    hide_gpus()
    cuda = cuda_usable()  # False under the cpu profile, even on a GPU machine (CUDA_VISIBLE_DEVICES="")
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if (world > 1 or group_of_one) and not dist.is_initialized():
        backend = os.environ.get("COURSE_BACKEND") or ("nccl" if cuda else "gloo")
        timeout = timedelta(seconds=float(timeout_s or os.environ.get("COURSE_DIST_TIMEOUT", 120)))
        if world == 1 and "MASTER_ADDR" not in os.environ:  # run as plain `python recipe.py`
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    if not cuda and "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    _exit_with_notebook()
    return Context(rank, world, local_rank, device)


def _exit_with_notebook() -> None:
    """Under `cl.launch`, exit this rank if the notebook kernel that launched it dies (killed, or a
    restart), so no rank outlives its notebook even when the launcher never got to clean up."""
    parent = int(os.environ.get(PARENT_PID_VAR, "0"))
    if parent <= 1 or getattr(_exit_with_notebook, "started", False):
        return

    def watch():
        while True:
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # alive, someone else's: a reused pid; stop watching
                return
            time.sleep(2)

    threading.Thread(target=watch, name="exit-with-notebook", daemon=True).start()
    _exit_with_notebook.started = True


def rprint(*args, ctx: Context | None = None, all_ranks: bool = False, **kwargs) -> None:
    """Print from rank 0 only (or from every rank), flushed so the launcher streams it live."""
    rank = ctx.rank if ctx else int(os.environ.get("RANK", "0"))
    if all_ranks or rank == 0:
        print(*args, flush=True, **kwargs)


def report(result: dict) -> None:
    """Hand `result` to the notebook: `cl.launch(...)` returns it as `run.result` (every report, in order, as
    `run.results`). It is a file, not a line of output: JSON in the folder the launcher gave the run
    (COURSE_RESULTS_DIR), written whole, then renamed. A run started by hand has no such folder and writes nothing
    here (a recipe's own files in its out-dir say what it did)."""
    folder = os.environ.get(RESULTS_VAR)
    if not folder:
        return
    report.count = getattr(report, "count", 0) + 1
    path = Path(folder) / f"{time.time_ns():020d}-rank{os.environ.get('RANK', '0')}-{os.getpid()}-{report.count}.json"
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(result, default=float))
    part.replace(path)


def finish(result: dict) -> None:
    """A recipe's end: rank 0 reports `result` (`report`), then every rank leaves the process group (`close`)."""
    if int(os.environ.get("RANK", "0")) == 0:
        report(result)
    close()


def read_results(folder) -> list[dict]:
    """The results a run's ranks reported into `folder` (`report`), in the order they were written."""
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]


def gather(obj, ctx: Context) -> list:
    """Every rank's `obj`, in rank order, on every rank (a list of one when running alone)."""
    if ctx.world_size == 1:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def collective_device(group=None) -> torch.device:
    """Where a tensor must live for a collective over `group`: this rank's GPU under nccl (it only moves GPU
    tensors), the CPU under gloo. A number or a flag a recipe reduces is built here."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_scalar(x: float, op: str = "sum") -> float:
    """A number reduced over all ranks: "sum", "mean" or "max" (the number itself when running alone).
    Every rank must call it (a collective). Float64 on the `collective_device`."""
    if op not in ("sum", "mean", "max"):
        raise ValueError(f"op must be 'sum', 'mean' or 'max', got {op!r}")
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return float(t.item()) / (dist.get_world_size() if op == "mean" else 1)


def close() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_now() -> None:
    """A recipe's last line, under `if __name__ == "__main__":` after `main()`: end the process without the
    interpreter's teardown. By then the recipe has closed what it opened (the process group, writers); this runs the
    atexit handlers and flushes the output, and skips the destruction of leftover C++ objects, where a finished rank
    has aborted ("terminate called without an active exception", faulthandler: no Python frame left) in about 1 of
    300 gloo launches of the test suite, after reporting its result."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
