"""Execute the workbook headless: `python -m course_lib.runner [--profile cpu] [--only 03,05]`.

Each chapter runs under papermill with its `parameters` cell set to the profile, writing
`build/executed/NN_*.ipynb`; chapters write their ledgers to `build/results/NN_*.json`; the runner
adds `build/runs.json` (status and time of each) and `build/report.html`. A failing chapter prints
one short block (notebook, cell, error), not papermill's internals, and the exit code is 1.
`make run` and `make test` (tests/test_notebooks.py) both come through here.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .presets import PRESETS, detect_profile
from .results import REPO_ROOT, build_dir

NOTEBOOKS = REPO_ROOT / "notebooks"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Outcome:
    notebook: str
    status: str  # "ok", "failed", or "skipped" (stopped by course_lib.optional.ChapterSkipped)
    seconds: float
    error: str = ""


def all_notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


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


def execute(notebook: Path, profile: str, out_dir: Path, cell_timeout: int = 1800) -> Outcome:
    """Run one chapter with papermill; return its outcome (never raises for a failing cell)."""
    import papermill as pm

    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        pm.execute_notebook(str(notebook), str(out_dir / notebook.name), parameters={"profile": profile},
                            cwd=str(notebook.parent), progress_bar=False, execution_timeout=cell_timeout)
    except pm.PapermillExecutionError as e:
        if e.ename == "ChapterSkipped":  # a library the whole chapter needs is missing here (course_lib.optional)
            return Outcome(notebook.stem, "skipped", time.monotonic() - start)
        return Outcome(notebook.stem, "failed", time.monotonic() - start, _short_error(e, out_dir / notebook.name))
    except Exception as e:  # the kernel died, a timeout, a broken notebook file
        return Outcome(notebook.stem, "failed", time.monotonic() - start, f"{type(e).__name__}: {e}")
    return Outcome(notebook.stem, "ok", time.monotonic() - start)


def _short_error(e, executed: Path) -> str:
    """`In [7] of build/executed/03_x.ipynb: AssertionError: ...` and the last lines of its traceback."""
    lines = "\n".join(_ANSI.sub("", frame) for frame in e.traceback[-6:]).splitlines()
    tail = [ln for ln in lines if ln.strip() and not set(ln.strip()) <= set("-") and "Traceback" not in ln][-7:]
    body = "\n".join("    " + line for line in tail)
    return f"In [{e.exec_count}] of {executed}: {e.ename}: {_ANSI.sub('', str(e.evalue))}\n{body}"


def run(profile: str = "auto", only: str | None = None) -> list[Outcome]:
    """Execute the selected chapters in order; write runs.json and the report; return outcomes."""
    profile = resolve_profile(profile)
    books = select(only)
    build = build_dir()
    os.environ["COURSE_BUILD_DIR"] = str(build)  # the kernels inherit it: ledgers land in build/results
    runs_path = build / "runs.json"
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    outcomes = []
    print(f"profile {profile}: {len(books)} notebook(s) -> {build}", flush=True)
    for book in books:
        print(f"  {book.stem} ...", end="", flush=True)
        outcome = execute(book, profile, build / "executed")
        outcomes.append(outcome)
        print(f" {outcome.status} in {outcome.seconds:.1f} s", flush=True)
        if outcome.error:
            print(f"FAILED {book.name}: {outcome.error}", flush=True)
        runs[outcome.notebook] = {**asdict(outcome), "profile": profile}
        build.mkdir(parents=True, exist_ok=True)
        runs_path.write_text(json.dumps(runs, indent=1))
    from .report import write_report

    print(f"report: {write_report(build)}")
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Execute the workbook's notebooks headless with papermill.")
    parser.add_argument("--profile", default=os.environ.get("PROFILE") or "auto", help="auto, cpu or gpu")
    parser.add_argument("--only", default=os.environ.get("ONLY") or None, help="e.g. 03 or 03,05")
    args = parser.parse_args(argv)
    try:
        outcomes = run(args.profile, args.only)
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
