"""Execute the workbook headless: `python -m course_lib.workbook.runner [--profile cpu] [--only 03,05] [--set k=v ...]`.

Each chapter runs under papermill with its `parameters` cell set to the profile (and to any `--set`
values), writing `build/executed/NN_*.ipynb`; chapters write their ledgers to `build/results/NN_*.json`;
the runner adds `build/runs.json` (status, time and parameters of each), the book `build/book/`
(course_lib.workbook.book: a page per chapter, index.html = the report) and `build/report.html`. A failing chapter
prints one short block (notebook, cell, error), not papermill's internals, and the exit code is 1.
`make run` and `make test` (tests/test_notebooks.py) both come through here. Kernels run quiet: the
libraries' deprecation warnings and TensorFlow's C++ lines filtered by environment (`cl.env.quiet_env`), no
progress bars (`HEADLESS_ENV`), and the kernel's own start-up warnings at ERROR level. `--solutions` (the test
suite) fills every exercise with its reference solution (course_lib.workbook.exercises). `--jobs 2` (cpu profile) runs two
chapters at a time, and the ones whose checks read wall-clock time last, alone (TIMED). With the gpu profile on
one GPU, `--jobs 2` keeps one chapter at a time on the GPU and runs the chapters whose work is CPU ranks there
(`cl.presets.CPU_RANK_CHAPTERS`) beside it. Each kernel knows its chapter (COURSE_CHAPTER in its environment). The
gpu profile starts the next chapter's kernel ahead, its imports done (`warm_kernel`).

`--set "model_path=/models/x steps=3"` (make: SET="...") passes papermill parameters: each value is read
as a Python literal (3, 1e-3, True, None, "text", [1, 2]), else kept as a string. With --only, every
name must be a parameter of every chosen chapter; without it, a name goes to the chapters that define it.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import fcntl
import importlib.util
import json
import multiprocessing
import os
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .book import write_book
from ..paths import NOTEBOOKS, all_notebooks, build_dir, compile_cache_dir  # noqa: F401  (all_notebooks: tests import it from here)
from ..presets import PRESETS, detect_profile
from .report import write_report

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Progress bars belong in JupyterLab, not in executed notebooks: tqdm's (cl.env.progress_bar, the ranks'), Hugging Face's
HEADLESS_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
                "COURSE_HEADLESS": "1"}  # chapter 00's calculator draws once instead of opening widgets
# --jobs > 1 (cpu profile, one job per core): the chapters whose checks read wall-clock time (02: TensorFlow's XLA
# speed-up; 10: the recipe against Trainer; 12: the profiler's shares) run last, each with nothing beside it; the
# others first, side by side. A chapter that reads another one's output starts after it.
TIMED = ("02", "10", "12")
READS = {"07": ("06",), "12": ("10",)}  # 07: 06's ledger; 12: 10's model (09 and 10 each build build/sft, never at once)

# Kernels: the arguments each chapter's kernel starts with, and a kernel started ahead of its chapter. The gpu profile
# starts the next chapter's kernel, its imports done, while the chapters before it run: kernel start-up and imports
# (~10 s a chapter: torch and transformers import in 8-9 s on a 2-vCPU Xeon) leave the GPU's path. Not the cpu
# profile's way: its cores are all busy with the chapters themselves.
KERNEL_ARGS = ["--IPKernelApp.log_level=ERROR"]  # its "running over TCP" notice, once per chapter, is not an error
WARM_IMPORTS = "import torch, transformers, matplotlib.pyplot, course_lib"
# ... and what a chapter imports first thing beside those: chapter 02, TensorFlow and Keras as its first cell
# does. Chapters 03, 05 and 08 import TensorFlow later, some after hiding devices from it: not ahead.
WARM_MORE = {"02_mixed_precision_keras": "import importlib.util, os\nif importlib.util.find_spec('tensorflow'):\n"
             "    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')\n    course_lib.env.import_tensorflow()\n    import keras"}


def warm_kernel(notebook: Path):
    """A kernel for `notebook`, started now in its folder with its COURSE_CHAPTER, WARM_IMPORTS (and its WARM_MORE)
    done, not in the chapter's history; `execute(..., km=...)` runs the chapter on it later. None, and a line, if
    that fails: the chapter then starts its own kernel."""
    from jupyter_client.manager import KernelManager

    km = None
    try:
        km = KernelManager(kernel_name=json.loads(notebook.read_text())["metadata"]["kernelspec"]["name"])
        km.start_kernel(extra_arguments=KERNEL_ARGS, cwd=str(notebook.parent),
                        env={**os.environ, "COURSE_CHAPTER": notebook.stem})
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=120)
            code = "\n".join([WARM_IMPORTS, WARM_MORE.get(notebook.stem, "")])
            reply = kc.execute_interactive(code, store_history=False, timeout=300)
        finally:
            kc.stop_channels()
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"{code!r}: {reply['content'].get('evalue')}")
        return km
    except Exception as e:  # noqa: BLE001  a faster start is not worth a failed chapter
        print(f"  {notebook.stem}: no kernel started ahead ({type(e).__name__}: {e}); it starts its own", flush=True)
        if km is not None and km.has_kernel:
            km.shutdown_kernel(now=True)
        return None



@dataclass
class Outcome:
    notebook: str
    status: str  # "ok", "failed", or "skipped" (stopped by course_lib.env.ChapterSkipped)
    seconds: float
    error: str = ""
    parameters: dict = field(default_factory=dict)  # what --set gave this chapter
    warm_seconds: float = 0.0  # kernel start and WARM_IMPORTS, done ahead while other chapters ran (not in seconds)


def select(only: str | None) -> list[Path]:
    """The notebooks whose number (or name) is listed in `only` ("03", "03,05", "00_where..."); all if empty."""
    books = all_notebooks()
    if not only:
        return books
    chosen = []
    for want in (w.strip() for w in only.split(",") if w.strip()):
        match = [b for b in books if b.stem == want or b.stem.split("_", 1)[0] == want.zfill(2)]
        if not match:
            have = ", ".join(b.stem.split("_", 1)[0] for b in books)
            raise ValueError(f"no notebook matches ONLY={want!r} (have {have})")
        chosen += [m for m in match if m not in chosen]
    return chosen


def resolve_profile(profile: str) -> str:
    if profile == "auto":
        return detect_profile()
    if profile not in PRESETS:
        raise ValueError(f"unknown profile {profile!r}: choose one of auto, {', '.join(PRESETS)}")
    return profile


def parse_sets(items: list[str]) -> dict:
    """["steps=3 lr=1e-3", "model_path=/m"] -> {"steps": 3, "lr": 0.001, "model_path": "/m"}.
    Pairs split like a shell line; a value is a Python literal when it reads as one, else a string."""
    values = {}
    for pair in (p for item in items for p in shlex.split(item)):
        name, sep, text = pair.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"SET takes name=value pairs, got {pair!r}")
        if name == "profile":
            raise ValueError("choose the profile with PROFILE= (--profile), not SET")
        try:
            values[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            values[name] = text
    return values


def parameters_for(books: list[Path], values: dict, only: bool) -> dict[str, dict]:
    """Which chapter gets which of `values`, by the names its parameters cell defines (papermill reads it).
    With `only`, a name a chosen chapter does not define is an error that lists the chapter's parameters;
    without, each name goes to the chapters that define it, and the runner says which."""
    if not values:
        return {b.stem: {} for b in books}
    from papermill.inspection import inspect_notebook

    defined = {b.stem: list(inspect_notebook(str(b))) for b in books}
    for name in values:
        users = [stem for stem in defined if name in defined[stem]]
        if only and len(users) < len(books):
            stem = next(s for s in defined if name not in defined[s])
            raise ValueError(f"{stem} has no parameter {name!r}; its parameters: {', '.join(defined[stem])}")
        if not users:
            raise ValueError(f"no chapter has a parameter {name!r} (each chapter's first code cell lists its own)")
        if not only:
            print(f"SET {name}={values[name]!r} goes to the chapters that define it: {', '.join(u[:2] for u in users)}")
    return {stem: {k: v for k, v in values.items() if k in names} for stem, names in defined.items()}


def execute(notebook: Path, profile: str, out_dir: Path, cell_timeout: int = 1800, parameters: dict | None = None,
            solutions: bool = False, km=None) -> Outcome:
    """Run one chapter with papermill; return its outcome (never raises for a failing cell). `km`: a kernel started
    ahead for it (`warm_kernel`), shut down after; else papermill starts one."""
    import papermill as pm

    out_dir.mkdir(parents=True, exist_ok=True)
    # papermill rewrites its output after every cell; it writes beside, in running/, and the run's notebook replaces
    # out_dir's when the chapter ends: what reads out_dir meanwhile (the book, another runner) finds whole notebooks
    running = out_dir.parent / "running" / notebook.name
    running.parent.mkdir(parents=True, exist_ok=True)
    parameters = dict(parameters or {})
    os.environ["COURSE_CHAPTER"] = notebook.stem  # the kernel inherits it: tools/gpu_run.py stops one chapter by it
    start = time.monotonic()
    try:
        pm.execute_notebook(str(notebook), str(running),
                            parameters={"profile": profile, "solutions": solutions, **parameters},
                            cwd=str(notebook.parent), progress_bar=False, execution_timeout=cell_timeout,
                            extra_arguments=KERNEL_ARGS, **({"km": km} if km else {}))
    except pm.PapermillExecutionError as e:
        if e.ename == "ChapterSkipped":  # a library the whole chapter needs is missing here (course_lib.env)
            return Outcome(notebook.stem, "skipped", time.monotonic() - start, parameters=parameters)
        return Outcome(notebook.stem, "failed", time.monotonic() - start, _short_error(e, out_dir / notebook.name), parameters)
    except Exception as e:  # the kernel died, a timeout, a broken notebook file
        return Outcome(notebook.stem, "failed", time.monotonic() - start, f"{type(e).__name__}: {e}", parameters)
    finally:
        if km:
            km.shutdown_kernel(now=True)
        if running.exists():
            os.replace(running, out_dir / notebook.name)
        else:  # nothing written (the notebook file itself was broken): no earlier run's notebook stands for this one
            (out_dir / notebook.name).unlink(missing_ok=True)
    return Outcome(notebook.stem, "ok", time.monotonic() - start, parameters=parameters)


def execute_warm(go, notebook: Path, profile: str, out_dir: Path, **kwargs) -> Outcome:
    """`execute` on a kernel warmed now (`warm_kernel`), once `go` (a multiprocessing Event) is set."""
    start = time.monotonic()
    km = warm_kernel(notebook)
    warmed = time.monotonic() - start if km else 0.0
    go.wait()
    outcome = execute(notebook, profile, out_dir, km=km, **kwargs)
    outcome.warm_seconds = warmed
    return outcome


def _short_error(e, executed: Path) -> str:
    """`In [7] of build/executed/03_x.ipynb: AssertionError: ...` and the last lines of its traceback."""
    lines = "\n".join(_ANSI.sub("", frame) for frame in e.traceback[-6:]).splitlines()
    tail = [ln for ln in lines if ln.strip() and not set(ln.strip()) <= set("-") and "Traceback" not in ln][-7:]
    body = "\n".join("    " + line for line in tail)
    return f"In [{e.exec_count}] of {executed}: {e.ename}: {_ANSI.sub('', str(e.evalue))}\n{body}"


def startable(pending: list[Path], running: list[str], jobs: int, beside: tuple | None = None) -> list[Path]:
    """Which of `pending` (in order) to start now beside `running` (stems), with `jobs` slots (see TIMED, READS).
    `beside` (the gpu profile on one GPU): only these chapters run beside another; the rest, one at a time."""
    chosen, waiting = [], {b.stem[:2] for b in pending} | {r[:2] for r in running}
    untimed_left = beside is None and bool(waiting - set(TIMED))  # on one GPU a timed chapter takes its turn
    for i, book in enumerate(pending):
        busy = running + [c.stem for c in chosen]
        num = book.stem[:2]
        if len(busy) >= jobs or any(b[:2] in TIMED for b in busy):
            break
        if waiting & set(READS.get(num, ())) or (num in TIMED and (busy or untimed_left)):
            if beside is not None and num in TIMED and all(b.stem[:2] in beside for b in pending[:i]):
                break  # its turn on the GPU: the chapters after it wait until it has run, alone
            continue
        if beside is not None and num not in beside and any(b[:2] not in beside for b in busy):
            continue  # one chapter on the GPU at a time
        chosen.append(book)
    return chosen


def next_to_warm(pending: list[Path], jobs: int, beside: tuple | None = None) -> Path | None:
    """The chapter whose kernel `run(warm=True)` starts ahead: the first that could start were nothing running."""
    return next(iter(startable(pending, [], jobs, beside)), None)


@contextlib.contextmanager
def busy_core():
    """A noisy neighbour for the length of the block: one process that keeps one core busy (a pure Python loop, at
    normal priority), as another program on a learner's laptop would. The chapters' asserted claims must hold
    beside it; `make run BUSY=1` runs the workbook so."""
    import subprocess

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
    try:
        yield spin
    finally:
        spin.kill()
        spin.wait(timeout=10)


def record_run(build: Path, notebook: str, entry: dict) -> None:
    """Add a chapter's outcome to build/runs.json: read, changed and replaced under a lock, so that two runners
    writing to one build/ (two `make run`s, the test suite's two workers) keep each other's entries."""
    build.mkdir(parents=True, exist_ok=True)
    path = build / "runs.json"
    with open(build / "runs.json.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        runs = json.loads(path.read_text()) if path.exists() else {}
        runs[notebook] = entry
        part = path.with_suffix(".json.part")
        part.write_text(json.dumps(runs, indent=1, default=repr))
        part.replace(path)


def run(profile: str = "auto", only: str | None = None, sets: list[str] | dict | None = None,
        solutions: bool = False, jobs: int = 1, warm: bool | None = None, record: bool = False,
        busy: bool = False) -> list[Outcome]:
    """Execute the selected chapters (in order; `jobs` > 1: that many at a time, see `startable`); write runs.json,
    the book and the report; return outcomes. `sets`: papermill parameters, as --set strings or a dict (see
    parse_sets / parameters_for); `solutions`: every exercise filled with its reference solution; `warm` (default:
    the gpu profile's): each next chapter's kernel started ahead (`warm_kernel`); `record`: claims that miss are
    recorded, not raised (COURSE_RECORD_ONLY, cl.results), so every cell runs; `busy`: one core kept busy by
    another process the whole time (`busy_core`)."""
    with busy_core() if busy else contextlib.nullcontext():
        return _run(profile, only, sets, solutions, jobs, warm, record)


def _run(profile, only, sets, solutions, jobs, warm, record) -> list[Outcome]:
    from .results import RECORD_ONLY, record_only
    from ..env import CPU_PROFILE_ENV, cuda_count, quiet_env
    from ..presets import CPU_RANK_CHAPTERS

    profile = resolve_profile(profile)
    one_gpu = profile == "gpu" and jobs == 2 and cuda_count() == 1  # the CPU-rank chapters beside the GPU's
    if jobs < 1 or (jobs > 1 and profile != "cpu" and not one_gpu):
        raise ValueError(f"--jobs takes 1, more with the cpu profile, or 2 with the gpu profile on one GPU (the GPU "
                         f"chapters measure the one device, one at a time); got {jobs}")
    beside = CPU_RANK_CHAPTERS if one_gpu else None
    warm = profile == "gpu" if warm is None else warm  # the next chapter's kernel started ahead (WARM_IMPORTS)
    books = select(only)
    values = sets if isinstance(sets, dict) else parse_sets(sets or [])
    parameters = parameters_for(books, values, only=bool(only))
    build = build_dir()
    os.environ["COURSE_BUILD_DIR"] = str(build)  # the kernels inherit it: ledgers land in build/results
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir()))  # torch.compile's kernels, kept
    if profile == "cpu":  # the kernels and their ranks see no GPU: the cpu profile's one code path on any machine
        os.environ.update(CPU_PROFILE_ENV)
    os.environ.update({**quiet_env(), **HEADLESS_ENV})  # the kernels (and their ranks) inherit it too
    if record:
        os.environ[RECORD_ONLY] = "1"
    outcomes = []
    print(f"profile {profile}: {len(books)} notebook(s) -> {build}" + (f", {jobs} at a time" if jobs > 1 else "")
          + (", claims recorded, not asserted" if record_only() else ""), flush=True)

    def finished(outcome: Outcome) -> None:
        outcomes.append(outcome)
        if jobs > 1 or warm:
            print(f"  {outcome.notebook} ...", end="")
        print(f" {outcome.status} in {outcome.seconds:.1f} s", flush=True)
        if outcome.error:
            print(f"FAILED {outcome.notebook}.ipynb: {outcome.error}", flush=True)
        record_run(build, outcome.notebook, {**asdict(outcome), "profile": profile, "solutions": solutions})

    if jobs == 1 and not warm:
        for book in books:
            print(f"  {book.stem} ...", end="", flush=True)
            finished(execute(book, profile, build / "executed", parameters=parameters[book.stem], solutions=solutions))
    else:
        context = multiprocessing.get_context("spawn")
        with (context.Manager() if warm else contextlib.nullcontext()) as manager, \
                concurrent.futures.ProcessPoolExecutor(jobs + warm, mp_context=context) as pool:
            pending, running, warming = list(books), {}, {}  # warming: stem -> (future, its go event)
            while pending or running:
                for book in startable(pending, [b.stem for b in running.values()], jobs, beside):
                    print(f"  {book.stem} started" + (" (its kernel warmed ahead)" if book.stem in warming else ""),
                          flush=True)
                    pending.remove(book)
                    if book.stem in warming:
                        future, go = warming.pop(book.stem)
                        go.set()
                    else:
                        future = pool.submit(execute, book, profile, build / "executed",
                                             parameters=parameters[book.stem], solutions=solutions)
                    running[future] = book
                if warm and not warming and (book := next_to_warm(pending, jobs, beside)):  # its kernel, now
                    go = manager.Event()
                    warming[book.stem] = (pool.submit(execute_warm, go, book, profile, build / "executed",
                                                      parameters=parameters[book.stem], solutions=solutions), go)
                done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    running.pop(future)
                    finished(future.result())
        order = {b.stem: i for i, b in enumerate(books)}
        outcomes.sort(key=lambda o: order[o.notebook])
    start = time.monotonic()
    if importlib.util.find_spec("nbconvert") is None:  # the book extra is not installed: the report still is
        print("book: not written (nbconvert is missing: pip install -e '.[book]')")
    else:
        index, pages = write_book(build)
        print(f"book: {index} ({pages} page(s) rendered in {time.monotonic() - start:.1f} s)")
    print(f"report: {write_report(build)}")
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Execute the workbook's notebooks headless with papermill.")
    parser.add_argument("--profile", default=os.environ.get("PROFILE") or "auto", help="auto, cpu or gpu")
    parser.add_argument("--only", default=os.environ.get("ONLY") or None, help="e.g. 03 or 03,05")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help='papermill parameters, e.g. --set steps=3 --set "model_path=/models/x lr=1e-4"')
    parser.add_argument("--solutions", action="store_true", help="fill every exercise with its reference solution")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("JOBS") or 1),
                        help="chapters at a time (cpu profile; 2 on one GPU: CPU-rank chapters beside the GPU's; "
                             "the timed ones still run alone)")
    parser.add_argument("--record", action="store_true",
                        help="record every claim instead of asserting it (a first run on new hardware: every cell runs, "
                             "and the report lists the claims that missed)")
    parser.add_argument("--busy", action="store_true",
                        help="keep one core busy with another process while the chapters run (a noisy neighbour)")
    args = parser.parse_args(argv)
    try:
        outcomes = run(args.profile, args.only, args.set, args.solutions, args.jobs, record=args.record, busy=args.busy)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    failed = [o.notebook for o in outcomes if o.status == "failed"]
    if failed:
        print(f"{len(failed)} of {len(outcomes)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
